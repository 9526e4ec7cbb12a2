"""Decode microbenchmark of the moe plugin's FusedMoE CUDA kernels (IREE ``--target cuda``) at the seeds' layer
shapes, against the device copy bandwidth measured in the same run.

Two steps, because the GPU machine has no IREE compiler and its weights are made there:

    python benchmarks/moe_cuda.py prepare --out bench_moe            # here: compile the modules
    python benchmarks/moe_cuda.py run bench_moe [--profile]          # on the GPU machine: time them
    python benchmarks/moe_cuda.py ort [--layers 1,4]                 # on the GPU machine: ONNX Runtime CUDA (QMoE)

``prepare`` writes, per shape of :data:`SHAPES` and chain length (``--layers``, default 1, 8 and 32), an ONNX graph
of that many FusedMoE ops in a chain (the output of one is the next one's hidden state; each layer has its own
INT4 expert weights, block 128 with zero points, fp16, so a chain reads more than the GPU's L2 holds), with
every weight a graph input, and compiles it with ``rewrite apply --backend iree --target
cuda``. ``run`` draws the weights with numpy on the host, moves them to the device once, and times calls of the
module at T tokens (:data:`TOKENS`). Per call it reports the time per layer, the bytes a layer must read (the k
selected experts' codes, scales and zero points of both projections: the speed-of-light traffic), the achieved
GB/s, and that as a fraction of the copy bandwidth (``torch`` device-to-device copy, bytes read + written,
timed with CUDA events in the same process). Times are host wall clock per call (``ITERS`` calls, the last one's
result read back): a call's fixed cost (Python, the IREE invocation) spreads over its layers, so the difference
between chain lengths gives the per-layer cost on the GPU, dispatch gaps included, as a model's decode step
would see it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np

#: (experts E, top-k, hidden H, expert intermediate I): Qwen/Qwen1.5-MoE-A2.7B and Qwen/Qwen3-30B-A3B config.json
SHAPES = {"qwen1.5-moe-a2.7b": (60, 4, 2048, 1408), "qwen3-30b-a3b": (128, 8, 2048, 768)}
BLOCK = 128
TOKENS = (1, 4)
ITERS = 50


def _weights_spec(e: int, h: int, i: int) -> dict[str, tuple[tuple[int, ...], str]]:
    nb1, nb2 = h // BLOCK, i // BLOCK
    return {"fc1": ((e, 2 * i, h // 2), "uint8"), "s1": ((e, 2 * i, nb1), "float16"), "z1": ((e, 2 * i, nb1), "uint8"),
            "fc2": ((e, h, i // 2), "uint8"), "s2": ((e, h, nb2), "float16"), "z2": ((e, h, nb2), "uint8")}


def _random_weight(rng, name: str, shape: tuple[int, ...], dt: str) -> np.ndarray:
    """Codes (two per byte), zero points (0..15) or fp16 scales of one weight of :func:`_weights_spec`."""
    a = rng.integers(0, 256, shape, dtype=np.uint8) if dt == "uint8" else (rng.uniform(0.5, 1.5, shape) * 0.01).astype(np.float16)
    if name[0] == "z":
        a &= 15
    return a


def build_model(e: int, k: int, h: int, i: int, layers: int = 8, rng=None):
    """The chain of ``layers`` FusedMoE (mode softmax_topk, Qwen-style) over inputs hidden [T, H] and logits [T, E];
    the weights are graph inputs, or with ``rng`` initializers drawn from it (ONNX Runtime's QMoE lowering needs
    initializers)."""
    from onnx import TensorProto, helper, numpy_helper

    from rewrite.core.abstract_ops import DOMAIN

    spec = _weights_spec(e, h, i)
    types = {"uint8": TensorProto.UINT8, "float16": TensorProto.FLOAT16}
    inputs = [helper.make_tensor_value_info("hidden", TensorProto.FLOAT16, ["T", h]),
              helper.make_tensor_value_info("logits", TensorProto.FLOAT16, ["T", e])]
    inits = []
    nodes, x = [], "hidden"
    for layer in range(layers):
        names = {n: f"{n}_{layer}" for n in spec}
        if rng is None:
            inputs += [helper.make_tensor_value_info(names[n], types[dt], list(shape)) for n, (shape, dt) in spec.items()]
        else:
            inits += [numpy_helper.from_array(_random_weight(rng, n, shape, dt), names[n]) for n, (shape, dt) in spec.items()]
        y = f"y{layer}" if layer < layers - 1 else "y"
        nodes.append(helper.make_node("FusedMoE", [x, "logits", names["fc1"], names["fc2"], names["s1"], names["z1"],
                                                   names["s2"], names["z2"]], [y], domain=DOMAIN, name=f"moe{layer}",
                                      k=k, normalize=0, mode="softmax_topk", activation="swiglu", block_size=BLOCK))
        x = y
    g = helper.make_graph(nodes, "moe_chain", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["T", h])], inits,
                          value_info=[helper.make_tensor_value_info(f"y{n}", TensorProto.FLOAT16, ["T", h]) for n in range(layers - 1)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)])
    m.ir_version = 10
    return m


def layer_bytes(e: int, k: int, h: int, i: int) -> int:
    """Bytes one layer reads at one token: k experts' codes, fp16 scales and uint8 zero points of fc1 and fc2."""
    per_expert = sum(int(np.prod(shape[1:])) * np.dtype(dt).itemsize for shape, dt in _weights_spec(e, h, i).values())
    return k * per_expert


def _row(name: str, dims: tuple[int, int, int, int], layers: int, t: int, per_call: float, copy_bw: float) -> str:
    """One line of the tables of :func:`run` and :func:`run_ort`: a call of ``layers`` layers at ``t`` tokens took
    ``per_call`` seconds; the bytes are those of the distinct experts read (at most E)."""
    e, k, h, i = dims
    per_layer = per_call / layers
    nbytes = layer_bytes(e, min(t * k, e) if t > 1 else k, h, i)
    bw = nbytes / per_layer
    return (f"{name:<20} {layers:>6} {t:>2} {per_call * 1e6:>8.0f} {per_layer * 1e6:>9.1f} {nbytes / 1e6:>9.2f} "
            f"{bw / 1e9:>7.0f} {bw / copy_bw:>8.1%}")


def prepare(out: Path, layer_counts: list[int]) -> None:
    import onnx

    from rewrite.pipeline import apply

    out.mkdir(parents=True, exist_ok=True)
    modules = []
    for (name, shape), layers in itertools.product(SHAPES.items(), layer_counts):
        folder = f"{name}.L{layers}"
        src = out / f"{folder}.onnx"
        onnx.save(build_model(*shape, layers), src)
        apply(src, out / folder, backend="iree", target="cuda")
        src.unlink()
        for f in ("model.mlir", "compile.log"):
            (out / folder / f).unlink(missing_ok=True)
        modules.append(dict(folder=folder, shape=name, dims=shape, layers=layers))
        print(f"prepared {folder}", flush=True)
    (out / "bench.json").write_text(json.dumps({"modules": modules, "block": BLOCK}, indent=1) + "\n")


def copy_bandwidth(nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), CUDA events."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        b.copy_(a)
    stop.record()
    torch.cuda.synchronize()
    return 2 * nbytes * iters / (start.elapsed_time(stop) / 1e3)


def kernel_times(call, label: str, reps: int = 5) -> None:
    """Per-kernel GPU time of ``reps`` calls (torch.profiler's CUPTI trace sees every kernel of the process)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
    for ev in prof.key_averages():
        if ev.device_time_total > 0:
            print(f"  {label}: {ev.key[:40]:<40} {ev.count // reps:>4} per call, {ev.device_time_total / reps:>8.1f} us per call")


def run(bench: Path, profile: bool = False, iree_flags: tuple[str, ...] = ()) -> int:
    import iree.runtime as rt

    from rewrite.backends import load_runner

    if iree_flags:  # runtime flags (e.g. --cuda_use_streams=false), before the device is made
        rt.flags.parse_flags(*iree_flags)
        print(f"IREE runtime flags: {' '.join(iree_flags)}")

    copy_bw = copy_bandwidth()
    print(f"copy bandwidth: {copy_bw / 1e9:.0f} GB/s (device to device, read + write)")
    print(f"{'shape':<20} {'layers':>6} {'T':>2} {'us/call':>8} {'us/layer':>9} {'MB/layer':>9} {'GB/s':>7} {'of copy':>8}")
    rng = np.random.default_rng(0)
    for mod in json.loads((bench / "bench.json").read_text())["modules"]:
        name, (e, k, h, i), layers = mod["shape"], mod["dims"], mod["layers"]
        runner = load_runner(bench / mod["folder"])
        fn, dev = runner.module.invoker(runner.function), runner.module.device
        weights = {}
        for layer in range(layers):
            for n, (shape, dt) in _weights_spec(e, h, i).items():
                weights[f"{n}_{layer}"] = rt.asdevicearray(dev, _random_weight(rng, n, shape, dt))
        for t in TOKENS:
            hidden = rt.asdevicearray(dev, rng.standard_normal((t, h)).astype(np.float16))
            logits = rt.asdevicearray(dev, rng.standard_normal((t, e)).astype(np.float16))
            args = [hidden, logits] + [weights[n] for n in runner.input_names[2:]]
            for _ in range(3):
                np.asarray(fn(*args).to_host())
            t0 = time.perf_counter()
            for _ in range(ITERS):
                res = fn(*args)
            np.asarray(res.to_host())
            per_call = (time.perf_counter() - t0) / ITERS
            if profile:
                kernel_times(lambda: np.asarray(fn(*args).to_host()), f"{name} L{layers} T{t}")
            print(_row(name, (e, k, h, i), layers, t, per_call, copy_bw), flush=True)
    return 0


def run_ort(work: Path, layer_counts: list[int]) -> int:
    """The same chains lowered by ``rewrite apply --backend ort --target cuda`` (QMoE) and timed on ONNX Runtime's
    CUDA execution provider, on the GPU machine: weights drawn there (initializers), inputs and output bound on the
    device (IO binding), host wall clock per call as :func:`run`."""
    import onnx
    import torch  # noqa: F401  (onnxruntime-gpu finds the CUDA libraries torch loaded)

    from rewrite.backends import load_runner
    from rewrite.pipeline import apply

    import onnxruntime as ort

    copy_bw = copy_bandwidth()
    print(f"onnxruntime {ort.__version__}; copy bandwidth: {copy_bw / 1e9:.0f} GB/s (device to device, read + write)")
    print(f"{'shape':<20} {'layers':>6} {'T':>2} {'us/call':>8} {'us/layer':>9} {'MB/layer':>9} {'GB/s':>7} {'of copy':>8}  op")
    rng = np.random.default_rng(0)
    work.mkdir(parents=True, exist_ok=True)
    for (name, (e, k, h, i)), layers in itertools.product(SHAPES.items(), layer_counts):
        src = work / f"{name}.L{layers}.onnx"
        onnx.save(build_model(e, k, h, i, layers, rng=rng), src, save_as_external_data=True, location=src.name + ".data")
        folder = work / f"{name}.L{layers}.ort"
        apply(src, folder, backend="ort", target="cuda")
        sess = load_runner(folder).session
        ops = sorted({n.op_type for n in onnx.load(folder / "model.onnx", load_external_data=False).graph.node})
        for t in TOKENS:
            binding = sess.io_binding()
            for n, a in (("hidden", rng.standard_normal((t, h))), ("logits", rng.standard_normal((t, e)))):
                binding.bind_ortvalue_input(n, ort.OrtValue.ortvalue_from_numpy(a.astype(np.float16), "cuda", 0))
            binding.bind_output("y", "cuda", 0)
            for _ in range(3):
                sess.run_with_iobinding(binding)
            t0 = time.perf_counter()
            for _ in range(ITERS):
                sess.run_with_iobinding(binding)
            binding.copy_outputs_to_cpu()
            per_call = (time.perf_counter() - t0) / ITERS
            print(_row(name, (e, k, h, i), layers, t, per_call, copy_bw) + f"  {'/'.join(ops)}", flush=True)
        del sess
        for f in work.glob(f"{name}.L{layers}*"):
            if f.is_file():
                f.unlink()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", default="1,8,32", help="chain lengths to compile (comma-separated)")
    r = sub.add_parser("run")
    r.add_argument("bench", type=Path)
    r.add_argument("--profile", action="store_true", help="also print per-kernel GPU times (torch.profiler)")
    r.add_argument("--iree-flag", action="append", default=[], metavar="FLAG",
                   help="an IREE runtime flag, e.g. --iree-flag=--cuda_use_streams=false (repeatable)")
    o = sub.add_parser("ort", help="on the GPU machine: the chains lowered for ONNX Runtime CUDA (QMoE) and timed")
    o.add_argument("--work", type=Path, default=Path("/tmp/bench_moe_ort"))
    o.add_argument("--layers", default="1,4")
    args = ap.parse_args()
    if args.cmd == "ort":
        return run_ort(args.work, [int(n) for n in args.layers.split(",")])
    if args.cmd == "prepare":
        prepare(args.out, [int(n) for n in args.layers.split(",")])
        return 0
    return run(args.bench, args.profile, tuple(args.iree_flag))


if __name__ == "__main__":
    sys.exit(main())
