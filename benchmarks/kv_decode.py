"""Decode-step latency and dispatches per step on IREE llvm-cpu, with and without ``kv``, side by side.

Model: the seed's static-cache form (examples/seed_form.py), fp32, mid-size by default (hidden 1024,
8 layers, 32 experts top-4, 8 heads x 128, cache of 256 positions). Variants, all with
``cast,legalize,topk`` (IREE's own router TopK is wrong inside these models):

* ``scatter``: the caches passed in and out, written by ScatterElements (the seed's form);
* ``kv``: the same interface, written by ``KVCacheUpdate`` (``tensor.insert_slice``);
* ``kv+stateful``: ``kv`` with the caches in one ``util.global`` (function takes ids and position).

Per variant: median and p90 wall time of one decode step (1 token, after a 16-token prefill, positions
advancing), and the ops of the entry function after iree-compile's flow phase: ``flow.dispatch`` count and
the copy ops (``flow.tensor.update/slice/clone/transfer``). ORT's decode step (``ort``, ``ort+kv``: the
ScatterND lowering) is printed alongside. The greedy tokens of every variant are compared with the first
variant run (``ort`` unless ``--only`` leaves it out).

``--ort-forms`` instead times one cache write on ONNX Runtime CPU (1 thread) in the three forms ``kv``'s ORT
lowering could take (``[1, 16, 512, 128]`` f32 cache, 1 and 8 new positions): ScatterElements (the original),
ScatterND (chosen), Slice+Concat.

Run: ``python benchmarks/kv_decode.py [--layers 8 --hidden 1024 --experts 32 --steps 24]``, ``--ort-forms``
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import seed_form  # noqa: E402

from rewrite.backends.iree_toolchain import compile_mlir  # noqa: E402
from rewrite.generate import Generator  # noqa: E402
from rewrite.pipeline import apply  # noqa: E402

PREFILL = 16


def flow_counts(folder: Path) -> tuple[int, int]:
    """(flow.dispatch ops, copy ops) in the compiled entry function after the flow phase."""
    out = folder / "flow.mlir"
    compile_mlir(folder / "model.mlir", out, extra_flags=["--compile-to=flow"])
    text = out.read_text()
    return len(re.findall(r"\bflow\.dispatch @", text)), len(re.findall(r"\bflow\.tensor\.(?:update|slice|clone|transfer)\b", text))


def step_times(gen: Generator, steps: int) -> tuple[list[int], list[float]]:
    gen.reset()
    logits = gen.step(np.arange(1, PREFILL + 1)[None])
    tokens, times = [], []
    for _ in range(steps):
        tokens.append(int(np.argmax(logits[0, -1])))
        t = time.perf_counter()
        logits = gen.step(np.array([[tokens[-1]]]))
        times.append(time.perf_counter() - t)
    return tokens, times


def ort_update_forms(reps: int = 300) -> None:
    """Median time of one cache write on ORT CPU per form (see the module docstring); checks all agree."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto as T
    from onnx import helper

    from rewrite.core import onnx_io
    from rewrite.core.abstract_ops import DOMAIN
    from rewrite.plugins.kv_cache import KV_UPDATE, scatter_model

    h, s, d = 16, 512, 128
    scatter = scatter_model("seed", heads=h, max_seq=s, head_dim=d)  # K and V: keep K's scatter only
    gp = scatter.graph
    for coll, keep in ((gp.node, lambda x: x.name != "scatter_v"), (gp.input, lambda x: x.name not in ("v", "past_v")),
                       (gp.output, lambda x: x.name != "present_v")):
        kept = [x for x in coll if keep(x)]
        del coll[:]
        coll.extend(kept)
    forms = {"ScatterElements": scatter}
    # ScatterND and Slice+Concat: one node each on top of the same position input
    node = helper.make_node(KV_UPDATE.op_type, ["past_k", "k", "position"], ["present_k"], domain=DOMAIN, axis=2)
    one = helper.make_graph([node], "one", [helper.make_tensor_value_info("past_k", T.FLOAT, [1, h, s, d]),
                                            helper.make_tensor_value_info("k", T.FLOAT, [1, h, "n", d]),
                                            helper.make_tensor_value_info("position", T.INT64, [1])],
                            [helper.make_tensor_value_info("present_k", T.FLOAT, [1, h, s, d])])
    m = helper.make_model(one, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)])
    with tempfile.TemporaryDirectory(prefix="kv-forms-") as tmp:
        onnx.save(m, Path(tmp) / "one.onnx")
        g = onnx_io.load(Path(tmp) / "one.onnx")
    KV_UPDATE.lower_ort(g, g.nodes_by_op(KV_UPDATE.op_type, DOMAIN)[0])
    forms["ScatterND"] = onnx_io.to_model(g)
    slc = [helper.make_node("Shape", ["k"], ["n1"], start=2, end=3), helper.make_node("Add", ["position", "n1"], ["end"]),
           helper.make_node("Slice", ["past_k", "z", "position", "ax"], ["a"]), helper.make_node("Slice", ["past_k", "end", "big", "ax"], ["b"]),
           helper.make_node("Concat", ["a", "k", "b"], ["present_k"], axis=2)]
    inits = [helper.make_tensor(n, T.INT64, [1], [v]) for n, v in (("z", 0), ("ax", 2), ("big", 2**62))]
    forms["Slice+Concat"] = helper.make_model(helper.make_graph(slc, "slc", list(one.input), list(one.output), initializer=inits),
                                              opset_imports=[helper.make_opsetid("", 18)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    rng = np.random.default_rng(0)
    past = rng.standard_normal((1, h, s, d)).astype(np.float32)
    print(f"ORT CPU, one cache write into [1, {h}, {s}, {d}] f32, 1 thread, median of {reps}")
    print(f"{'form':<16} {'n=1 us':>8} {'n=8 us':>8}")
    for name, model in forms.items():
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        names = {i.name for i in sess.get_inputs()}
        row = []
        for n in (1, 8):
            upd = rng.standard_normal((1, h, n, d)).astype(np.float32)
            feeds = {k: v for k, v in {"past_k": past, "k": upd, "past_v": past, "v": upd, "position": np.array([37], np.int64)}.items() if k in names}
            want = past.copy()
            want[:, :, 37:37 + n] = upd
            assert np.array_equal(sess.run(["present_k"], feeds)[0], want), name
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                sess.run(["present_k"], feeds)
                times.append(time.perf_counter() - t)
            row.append(np.median(times) * 1e6)
        print(f"{name:<16} {row[0]:8.1f} {row[1]:8.1f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--max-seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--ort-forms", action="store_true", help="time the ORT forms of one cache write instead")
    ap.add_argument("--only", default="", help="comma-separated variants to run (default: all)")
    args = ap.parse_args(argv)
    if args.ort_forms:
        return ort_update_forms()
    with tempfile.TemporaryDirectory(prefix="kv-bench-") as tmp:  # about 6 GB for the default size
        run_variants(args, Path(tmp))


def run_variants(args: argparse.Namespace, work: Path) -> None:
    """Build the model in ``work``, lower and time every variant (see the module docstring)."""
    model, _ = seed_form.build_seed_model("fp32", hidden=args.hidden, layers=args.layers, heads=8, kv_heads=8, head_dim=128,
                                          experts=args.experts, top_k=4, moe_intermediate=512, shared_intermediate=args.hidden,
                                          vocab=4096, max_seq=args.max_seq)
    src = seed_form.save_seed_model(model, work / "seed.onnx")
    variants = {
        "ort": ("cast,legalize", "ort", {}),
        "ort+kv": ("cast,legalize,expand,kv", "ort", {}),
        "scatter": ("cast,legalize,topk", "iree", {}),
        "kv": ("cast,legalize,topk,expand,kv", "iree", {}),
        "kv+stateful": ("cast,legalize,topk,expand,kv", "iree", {"stateful": True}),
    }
    print(f"seed form fp32: hidden {args.hidden}, {args.layers} layers, {args.experts} experts top-4, 8x128 heads, "
          f"cache {args.max_seq}; decode step after a {PREFILL}-token prefill, {args.steps} steps")
    print(f"{'variant':<13} {'compile s':>9} {'median ms':>9} {'p90 ms':>8} {'dispatches':>10} {'copies':>7}  tokens")
    ref = None
    for name, (plugins, backend, options) in variants.items():
        if args.only and name not in args.only.split(","):
            continue
        t = time.perf_counter()
        apply(src, work / name, plugins=plugins, backend=backend, options=options)
        build = time.perf_counter() - t
        tokens, times = step_times(Generator(work / name), args.steps)
        ref = ref or tokens
        disp, copies = flow_counts(work / name) if backend == "iree" else ("-", "-")
        ms = np.array(times) * 1e3
        print(f"{name:<13} {build:9.1f} {np.median(ms):9.2f} {np.percentile(ms, 90):8.2f} {disp:>10} {copies:>7}  "
              f"{'same' if tokens == ref else 'DIFFER'}")


if __name__ == "__main__":
    main()
