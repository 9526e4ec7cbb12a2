"""The RotaryEmbedding and RMSNorm CUDA kernels launched directly (CuPy), without IREE: time per call at the decode
shapes of the seeds' models, and every conformance sample of both ops against its numpy reference. On the GPU
machine (nvcc and CuPy, no IREE)::

    python benchmarks/norm_cuda_kernels.py

Each kernel is launched as IREE launches it (``lower_iree_cuda`` of ``rewrite.plugins.rope.op`` and
``rewrite.plugins.rmsnorm.op``): the bindings' pointers, then the push constants as 32-bit integers, on the same
grid. ``LAYERS`` sets of inputs are used in turn; ``ITERS`` calls are captured in a CUDA graph and its replays timed
with CUDA events (``timed`` of benchmarks/moe_cuda_kernels.py). These kernels move kilobytes: their time is launch
and latency, so the table gives microseconds per call beside what a copy kernel of as many bytes takes. Exits 1
when an output is off its reference.
"""

from __future__ import annotations

import argparse
import struct
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from moe_cuda_kernels import ITERS, REPS, cupy_or_exit, timed  # noqa: E402

LAYERS = 24
#: (name, heads, head size, with the q/k norm): one decode token's Q or K of Qwen1.5-MoE-A2.7B and Qwen3-30B-A3B
ROPE_SHAPES = (("qwen1.5 q/k", 16, 128, False), ("qwen3 q", 32, 128, True), ("qwen3 k", 4, 128, True))
#: (name, rows, H): one decode token's hidden state, and a 128-token prefill
NORM_SHAPES = (("decode", 1, 2048), ("prefill 128", 128, 2048))


def _bits(v: float) -> np.int32:
    return np.int32(struct.unpack("<i", struct.pack("<f", float(v)))[0])


def _rope_args(cp, attrs, x, cos, sin, w):
    """Device arrays and push constants of one RotaryEmbedding launch (grid, block, args)."""
    from rewrite.plugins.rope.op import CUDA_WARPS

    b, h, t, d = x.shape
    y = cp.zeros(x.shape, x.dtype)

    def strides(c):
        return [0 if c.shape[0] == 1 else c.shape[2] * d, 0 if c.shape[2] == 1 else d]

    rows = b * h * t
    consts = [np.int32(c) for c in (rows, h, t, *strides(cos), *strides(sin), int(w is not None))] + [_bits(attrs.get("norm_epsilon", 0.0))]
    dw = cp.asarray(w) if w is not None else cp.zeros(1, x.dtype)
    grid = ((rows + CUDA_WARPS - 1) // CUDA_WARPS,)
    return grid, (32 * CUDA_WARPS,), (cp.asarray(x), cp.asarray(cos), cp.asarray(sin), dw, y, *consts), y


def _norm_args(cp, attrs, x, w):
    from rewrite.plugins.rmsnorm.op import CUDA_THREADS

    rows, h = int(np.prod(x.shape[:-1])), x.shape[-1]
    y = cp.zeros(x.shape, x.dtype)
    return (rows,), (CUDA_THREADS,), (cp.asarray(x), cp.asarray(w), y, np.int32(rows), np.int32(h), _bits(attrs["epsilon"])), y


def _check(name: str, got, want) -> bool:
    f16 = want.dtype == np.float16
    err = float(np.abs(got.astype(np.float64) - want.astype(np.float64)).max() / max(1e-6, np.abs(want.astype(np.float64)).max()))
    ok = err <= (1e-2 if f16 else 1e-4)
    print(f"{name}: rel. error {err:.1e} {'ok' if ok else 'WRONG'}", flush=True)
    return ok


def main() -> int:
    from rewrite.plugins.rmsnorm.op import RMSNorm
    from rewrite.plugins.rope.op import RotaryEmbedding

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=REPS)
    args = ap.parse_args()
    cp = cupy_or_exit()
    rope = cp.RawModule(code=(ROOT / "rewrite/plugins/rope/kernels/rope_cuda.cu").read_text(), backend="nvcc", options=("-O3",))
    norm = cp.RawModule(code=(ROOT / "rewrite/plugins/rmsnorm/kernels/rmsnorm_cuda.cu").read_text(), backend="nvcc", options=("-O3",))
    copy = cp.ElementwiseKernel("T x", "T y", "y = x", "copy_f16")
    rng = np.random.default_rng(0)
    failed = 0
    print(f"{ITERS} calls per CUDA graph, median of {args.reps} replays; f16")
    print(f"{'kernel':<28} {'us/call':>8} {'KB':>7} {'copy of as many bytes (us)':>27}")
    for name, heads, d, with_norm in ROPE_SHAPES:
        sets = []
        for _ in range(LAYERS):
            x = rng.standard_normal((1, heads, 1, d)).astype(np.float16)
            ang = rng.uniform(0, 100, (1, 1, 1, d)).astype(np.float32)
            w = (1 + 0.1 * rng.standard_normal(d)).astype(np.float16) if with_norm else None
            sets.append(({"norm_epsilon": 1e-6} if with_norm else {}, x, np.cos(ang).astype(np.float16), np.sin(ang).astype(np.float16), w))
        launches = [_rope_args(cp, *s) for s in sets]
        kernel = rope.get_function(f"rotary_embedding_f16_d{d}")
        us = timed(cp, [lambda a=a: kernel(a[0], a[1], a[2]) for a in launches * (ITERS // LAYERS)], args.reps)
        nbytes = 2 * sets[0][1].nbytes + 2 * sets[0][2].nbytes
        src, dst = cp.zeros(nbytes // 2, cp.float16), cp.zeros(nbytes // 2, cp.float16)
        cus = timed(cp, [lambda: copy(src, dst)] * ITERS, args.reps)
        print(f"{'rope ' + name:<28} {us:>8.2f} {nbytes / 1e3:>7.1f} {cus:>27.2f}", flush=True)
        got = cp.asnumpy(launches[0][3])
        failed += not _check(f"  rope {name} vs reference", got, RotaryEmbedding().reference(*sets[0][:4], sets[0][4])[0])
    for name, rows, h in NORM_SHAPES:
        sets = [({"epsilon": 1e-6}, (rng.standard_normal((rows, h)) * 4).astype(np.float16),
                 (1 + 0.1 * rng.standard_normal(h)).astype(np.float16)) for _ in range(LAYERS)]
        launches = [_norm_args(cp, *s) for s in sets]
        kernel = norm.get_function("rms_norm_f16")
        us = timed(cp, [lambda a=a: kernel(a[0], a[1], a[2]) for a in launches * (ITERS // LAYERS)], args.reps)
        nbytes = 2 * sets[0][1].nbytes + sets[0][2].nbytes
        src, dst = cp.zeros(nbytes // 2, cp.float16), cp.zeros(nbytes // 2, cp.float16)
        cus = timed(cp, [lambda: copy(src, dst)] * ITERS, args.reps)
        print(f"{'rmsnorm ' + name:<28} {us:>8.2f} {nbytes / 1e3:>7.1f} {cus:>27.2f}", flush=True)
        failed += not _check(f"  rmsnorm {name} vs reference", cp.asnumpy(launches[0][3]), RMSNorm().reference(*sets[0])[0])
    # the conformance kit's samples of both ops through the kernels
    for k, (attrs, ins) in enumerate(RotaryEmbedding().sample_inputs(np.random.default_rng(1))):
        x, cos, sin, w = (ins + [None])[:4]
        grid, block, kargs, y = _rope_args(cp, attrs, x, cos, sin, w)
        rope.get_function(f"rotary_embedding_{'f16' if x.dtype == np.float16 else 'f32'}_d{x.shape[3]}")(grid, block, kargs)
        failed += not _check(f"rope sample {k} {list(x.shape)} cos {list(cos.shape)} norm {w is not None}", cp.asnumpy(y),
                             RotaryEmbedding().reference(attrs, x, cos, sin, w)[0])
    for k, (attrs, (x, w)) in enumerate(RMSNorm().sample_inputs(np.random.default_rng(1))):
        grid, block, kargs, y = _norm_args(cp, attrs, x, w)
        norm.get_function(f"rms_norm_{'f16' if x.dtype == np.float16 else 'f32'}")(grid, block, kargs)
        failed += not _check(f"rmsnorm sample {k} {list(x.shape)}", cp.asnumpy(y), RMSNorm().reference(attrs, x, w)[0])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
