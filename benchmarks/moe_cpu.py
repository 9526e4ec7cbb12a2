"""Decode-step latency of a Qwen1.5-MoE-shaped model on CPU (2 threads), with and without the ``moe`` plugin.

Model: ``qwen_moe.build_model("qwen2_moe", "mid")`` (hidden 1024, 8 layers, 60 experts top-4, expert
intermediate 512, shared expert 1024), fp32, exported by transformers' exporter. One decode step: 1 new token
after a past of 64 tokens (random past keys/values). Variants, side by side in one run:

a. ``ort``: the export on ONNX Runtime;
b. ``ort-fused``: transformers' exporter with ``OnnxConfig(dynamic=True, ort_fusions="cpu")``;
c. ``ort-fused-4bit``: (b) after ORT's ``MatMulNBitsQuantizer`` (block 128, 4-bit; it leaves the experts float);
d. ``rewrite-ort-moe`` (``--plugins moe``: com.microsoft MoE, float) and ``rewrite-ort-q4x-moe``
   (``quant4,moe`` with ``quant4.experts_only``: QMoE with INT4 experts, quant4 block 128 run as
   QMoE block 64 (rewrite.core.int4.ORT_MAX_BLOCK), dense weights float like (c)'s
   experts are) and ``rewrite-ort-q4-moe`` (``quant4,moe``, dense weights INT4 too, which the ``ort`` backend
   lowers to com.microsoft MatMulNBits) on ORT;
f. ``rewrite-ort-fused-q4-moe``: ``quant4,moe`` (dense weights INT4 too) applied to (b), the
   ``ort_fusions="cpu"`` export (GroupQueryAttention, SkipSimplifiedLayerNormalization, fused QKV and gate/up
   weights: 40 MatMulNBits instead of 56), on ORT; its experts are the same batched_mm form, so ``moe`` matches;
e. IREE llvm-cpu, all with INT4 experts (the fp32 mid export is 3 GB, over the 2 GB protobuf limit of IREE's
   ONNX import): ``iree-q4x-topk`` (``quant4,legalize,topk``; ``topk`` because IREE's own router TopK is wrong
   inside these models) vs ``iree-q4x-topk-moe`` (``quant4,legalize,topk,moe``).

Rewritten variants are built into ``--work`` once and reused while their ``manifest.json`` exists: use a fresh
``--work`` after changing a plugin.

Per variant: median and min of ``--reps`` timed calls after 3 warm-up calls, and the max |logits - (a)|.
ORT sessions use 2 intra-op threads; IREE's local-task device 2 workers (``--task_topology_max_group_count``).

Run: ``python benchmarks/moe_cpu.py [--size mid] [--reps 20] [--only a,b,...] [--work DIR]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import qwen_moe  # noqa: E402

THREADS = 2
PAST = 64


def export(size: str, work: Path) -> tuple[Path, Path]:
    """(plain export, ort_fusions="cpu" export) of the qwen2_moe model of ``size``, cached in ``work``."""
    plain, fused = work / "plain" / "model.onnx", work / "fused" / "model.onnx"
    if plain.is_file() and fused.is_file():
        return plain, fused
    import onnx_ir
    from transformers.exporters.exporter_onnx import OnnxConfig, OnnxExporter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = qwen_moe.build_model("qwen2_moe", size)
        if not plain.is_file():
            qwen_moe.export_hf(model, plain.parent)
        if not fused.is_file():
            program = OnnxExporter().export(model, qwen_moe._decode_sample(model, 5, 2), OnnxConfig(dynamic=True, ort_fusions="cpu")).program
            qwen_moe._make_numeric_dims_static(program.graph)
            fused.parent.mkdir(parents=True, exist_ok=True)
            onnx_ir.save(program, str(fused), external_data="model.onnx.data")
    return plain, fused


def ort_4bit(fused: Path, work: Path) -> Path:
    """(b) quantized by ORT's MatMulNBitsQuantizer (4-bit, block 128, asymmetric)."""
    out = work / "fused4" / "model.onnx"
    if out.is_file():
        return out
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    q = MatMulNBitsQuantizer(onnx.load(str(fused)), block_size=128, is_symmetric=False)
    q.process()
    out.parent.mkdir(parents=True, exist_ok=True)
    q.model.save_model_to_file(str(out), use_external_data_format=True)
    return out


def feeds_for(input_names, dtype, kv_shape, rng) -> dict:
    past = {n: rng.standard_normal((1, *kv_shape[:1], PAST, kv_shape[1])).astype(dtype) * 0.5 for n in input_names if n.startswith("past_key_values")}
    return qwen_moe.make_feeds(input_names, np.array([[7]], np.int64), past, PAST)


def time_run(run, feeds, reps: int) -> tuple[float, float, np.ndarray]:
    for _ in range(3):
        out = run(feeds)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        out = run(feeds)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, min(times) * 1e3, np.asarray(out["logits"])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="mid", choices=qwen_moe.SIZES)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--only", default="a,b,c,d,e,f", help="comma list of variant groups a..f")
    ap.add_argument("--work", default="/tmp/rewrite-bench-moe")
    args = ap.parse_args(argv)
    groups = set(args.only.split(","))
    work = Path(args.work) / args.size
    work.mkdir(parents=True, exist_ok=True)

    import iree.runtime as ireert
    import onnxruntime as ort

    ireert.flags.parse_flags(f"--task_topology_max_group_count={THREADS}")
    from rewrite.backends import load_runner
    from rewrite.pipeline import apply

    plain, fused = export(args.size, work)
    sig = qwen_moe.decode_signature(plain)
    feeds = feeds_for(sig.input_names, sig.dtype, sig.kv_shape_per_layer, np.random.default_rng(0))

    def ort_run(path: Path):
        so = ort.SessionOptions()
        so.intra_op_num_threads = THREADS
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        names = [i.name for i in sess.get_inputs()]
        outs = [o.name for o in sess.get_outputs()]
        return lambda f: dict(zip(outs, sess.run(None, {n: f[n] for n in names})))

    def rewritten(name: str, plugins: list[str], backend: str, experts_only: bool = True, source: Path = plain):
        out = work / name
        if not (out / "manifest.json").is_file():
            t = time.perf_counter()
            options = {"quant4": {"experts_only": experts_only}} if "quant4" in plugins else {}
            apply(source, out, plugins=plugins, backend=backend, options=options)
            print(f"  ({name}: apply + compile {time.perf_counter() - t:.0f} s)", flush=True)
        if backend == "ort":
            return ort_run(out / "model.onnx")
        return load_runner(out).run

    variants = []
    if "a" in groups:
        variants.append(("a ort", lambda: ort_run(plain)))
    if "b" in groups:
        variants.append(("b ort-fused", lambda: ort_run(fused)))
    if "c" in groups:
        variants.append(("c ort-fused-4bit", lambda: ort_run(ort_4bit(fused, work))))
    if "d" in groups:
        variants.append(("d rewrite-ort-moe", lambda: rewritten("ort_moe", ["moe"], "ort")))
        variants.append(("d rewrite-ort-q4x-moe", lambda: rewritten("ort_q4x_moe", ["quant4", "moe"], "ort")))
        variants.append(("d rewrite-ort-q4-moe", lambda: rewritten("ort_q4_moe", ["quant4", "moe"], "ort", experts_only=False)))
    if "f" in groups:
        variants.append(("f rewrite-ort-fused-q4-moe", lambda: rewritten("ort_fused_q4_moe", ["quant4", "moe"], "ort", experts_only=False, source=fused)))
    if "e" in groups:
        variants.append(("e iree-q4x-topk", lambda: rewritten("iree_q4x_topk", ["quant4", "legalize", "topk"], "iree")))
        variants.append(("e iree-q4x-topk-moe", lambda: rewritten("iree_q4x_topk_moe", ["quant4", "legalize", "topk", "moe"], "iree")))

    print(f"qwen2_moe {args.size}, fp32, decode step: 1 token after {PAST} past, {THREADS} threads, median of {args.reps}")
    ref = None
    rows = []
    for name, make in variants:
        try:
            med, best, logits = time_run(make(), feeds, args.reps)
        except Exception as e:  # noqa: BLE001 - a failing variant is reported, the others still run
            rows.append((name, None, None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"))
            print(f"{name:26s} failed: {rows[-1][3]}", flush=True)
            continue
        if ref is None and name.startswith("a"):
            ref = logits
        diff = "" if ref is None else f"{np.abs(logits - ref).max():.2e}"
        rows.append((name, med, best, diff))
        print(f"{name:26s} {med:8.2f} ms (min {best:7.2f})  max|dlogits| vs a {diff}", flush=True)
    print("\n| variant | median ms | min ms | max abs logits diff vs (a) |\n|---|---|---|---|")
    for name, med, best, diff in rows:
        print(f"| {name} | {'-' if med is None else f'{med:.2f}'} | {'-' if best is None else f'{best:.2f}'} | {diff} |")


if __name__ == "__main__":
    main()
