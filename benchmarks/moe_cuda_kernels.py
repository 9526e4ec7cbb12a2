"""The moe plugin's FusedMoE CUDA kernels launched directly (CuPy), without IREE: kernel time per layer at the
seeds' decode shapes against the copy bandwidth measured in the same run, and a check against the numpy
reference. For iterating on rewrite/plugins/moe/kernels/moe_cuda.cu on the GPU machine, which has nvcc and
CuPy but no IREE:

    python benchmarks/moe_cuda_kernels.py                      # time and check every shape of SHAPES
    python benchmarks/moe_cuda_kernels.py -D NO_ROUTE          # a variant: macros passed to nvcc
    python benchmarks/moe_cuda_kernels.py --once               # one launch of each kernel (for ncu)

The kernels are launched as IREE launches them (rewrite/plugins/moe/lowering.py ``lower_iree_cuda``): the
bindings' pointers, then the 10 push constants as 32-bit integers, on the same grid. ``LAYERS`` weight sets
(more bytes than the L2 holds) are used in turn, so each launch reads its weights from HBM, as a decode step
does. Times are CUDA events around ``ITERS`` launches of one kernel.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: (experts E, top-k, hidden H, expert intermediate I): Qwen/Qwen1.5-MoE-A2.7B and Qwen/Qwen3-30B-A3B config.json
SHAPES = {"qwen1.5-moe-a2.7b": (60, 4, 2048, 1408), "qwen3-30b-a3b": (128, 8, 2048, 768)}
BLOCK = 128
LAYERS = 8
ITERS = 64
F16, INT4, ZERO_POINTS = 1, 2, 16  # the kernels' flags (moe_cuda.cu)


def copy_bandwidth(cp, nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), CUDA events."""
    a = cp.empty(nbytes, dtype=cp.uint8)
    b = cp.empty_like(a)
    b[...] = a
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(iters):
        b[...] = a
    stop.record()
    stop.synchronize()
    return 2 * nbytes * iters / (cp.cuda.get_elapsed_time(start, stop) / 1e3)


def main() -> int:
    import cupy as cp

    from rewrite.core.int4 import pack_int4
    from rewrite.plugins.moe.lowering import CUDA_DOWN_ROWS, CUDA_GATE_ITEMS, CUDA_THREADS, FusedMoE

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-D", action="append", default=[], dest="defines", help="a macro for nvcc (repeatable)")
    ap.add_argument("--once", action="store_true", help="one launch of each kernel per shape, no timing")
    ap.add_argument("--tokens", default="1,4")
    ap.add_argument("--gate-items", type=int, default=CUDA_GATE_ITEMS, help="the lowering's CUDA_GATE_ITEMS")
    ap.add_argument("--down-rows", type=int, default=CUDA_DOWN_ROWS, help="the lowering's CUDA_DOWN_ROWS")
    args = ap.parse_args()
    src = (ROOT / "rewrite/plugins/moe/kernels/moe_cuda.cu").read_text()
    mod = cp.RawModule(code=src, backend="nvcc", options=("-O3", *(f"-D{d}" for d in args.defines)))
    gate_up, down = mod.get_function("moe_gate_up_f16"), mod.get_function("moe_down_f16")
    bw = copy_bandwidth(cp)
    print(f"copy bandwidth: {bw / 1e9:.0f} GB/s; macros: {' '.join(args.defines) or '-'}; gate items "
          f"{args.gate_items}, down rows {args.down_rows}")
    print(f"{'shape':<20} {'T':>2} {'kernel':<8} {'us':>7} {'MB':>7} {'GB/s':>6} {'of copy':>8}  check")
    rng = np.random.default_rng(0)
    for name, (e, k, h, i) in SHAPES.items():
        layers = []
        for _ in range(LAYERS):
            w = dict(fc1=pack_int4(rng.integers(0, 16, (e, 2 * i, h), dtype=np.uint8)),
                     s1=(rng.uniform(0.5, 1.5, (e, 2 * i, h // BLOCK)) * 0.02).astype(np.float16),
                     z1=rng.integers(0, 16, (e, 2 * i, h // BLOCK), dtype=np.uint8),
                     fc2=pack_int4(rng.integers(0, 16, (e, h, i), dtype=np.uint8)),
                     s2=(rng.uniform(0.5, 1.5, (e, h, -(-i // BLOCK))) * 0.02).astype(np.float16),
                     z2=rng.integers(0, 16, (e, h, -(-i // BLOCK)), dtype=np.uint8))
            layers.append((w, {n: cp.asarray(v) for n, v in w.items()}))
        per_expert = {"gate_up": sum(layers[0][0][n][0].nbytes for n in ("fc1", "s1", "z1")),
                      "down": sum(layers[0][0][n][0].nbytes for n in ("fc2", "s2", "z2"))}
        for t in (int(v) for v in args.tokens.split(",")):
            x = rng.standard_normal((t, h)).astype(np.float16)
            logits = (rng.standard_normal((t, e)) * 3).astype(np.float16)
            dx, dl = cp.asarray(x), cp.asarray(logits)
            dummy_ids, dummy_b = cp.zeros(1, cp.int64), cp.zeros(1, cp.float16)
            act, out = cp.zeros(t * k * i, cp.float32), cp.zeros((t, h), cp.float16)
            flags = F16 | INT4 | ZERO_POINTS
            consts = [np.int32(v) for v in (t, h, i, e, k, BLOCK, flags, np.float32(1.0).view(np.int32),
                                            0, 0)]
            grid1 = (t, -(-i // -(-args.gate_items // k)))
            grid2 = (t, -(-h // args.down_rows))

            def launch(kernel, layer):
                d = layers[layer][1]
                if kernel == "gate_up":
                    gate_up(grid1, (CUDA_THREADS,), (dx, dl, dummy_ids, d["fc1"], d["s1"], d["z1"], dummy_b, act, *consts))
                else:
                    down(grid2, (CUDA_THREADS,), (dl, dummy_ids, act, d["fc2"], d["s2"], d["z2"], dummy_b, out, *consts))

            launch("gate_up", 0)
            launch("down", 0)
            cp.cuda.Device().synchronize()
            got = cp.asnumpy(out).astype(np.float64)
            w0 = layers[0][0]
            want = FusedMoE().reference(dict(k=k, normalize=0, mode="softmax_topk", activation="swiglu", block_size=BLOCK),
                                        x, logits, w0["fc1"], w0["fc2"], w0["s1"], w0["z1"], w0["s2"], w0["z2"])[0]
            err = float(np.abs(got - want).max() / max(1.0, np.abs(want.astype(np.float64)).max()))
            check = f"rel. error {err:.1e} {'ok' if err <= 1e-2 else 'WRONG'}"
            if args.once:
                print(f"{name:<20} {t:>2} {'both':<8} {'-':>7} {'-':>7} {'-':>6} {'-':>8}  {check}")
                continue
            distinct = len(np.unique(np.argsort(-logits.astype(np.float32), axis=-1)[:, :k]))
            for kernel in ("gate_up", "down"):
                for n in range(4):  # warm
                    launch(kernel, n % LAYERS)
                start, stop = cp.cuda.Event(), cp.cuda.Event()
                start.record()
                for n in range(ITERS):
                    launch(kernel, n % LAYERS)
                stop.record()
                stop.synchronize()
                us = cp.cuda.get_elapsed_time(start, stop) * 1e3 / ITERS
                nbytes = distinct * per_expert[kernel]
                print(f"{name:<20} {t:>2} {kernel:<8} {us:>7.1f} {nbytes / 1e6:>7.2f} {nbytes / us / 1e3:>6.0f} "
                      f"{nbytes / us / 1e3 / (bw / 1e9):>8.1%}  {check if kernel == 'down' else ''}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
