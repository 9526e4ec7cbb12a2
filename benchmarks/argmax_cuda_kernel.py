"""The backend's RowArgMax CUDA kernel (rewrite/backends/kernels/argmax_cuda.cu) launched directly (CuPy), without
IREE: every case against numpy, then the time per call at the next token's shapes (one row of the vocabulary's
logits) beside a copy of as many bytes. On the GPU machine (nvcc and CuPy, no IREE)::

    python benchmarks/argmax_cuda_kernel.py

The kernel is launched as the lowering launches it (``lower_row_argmax``): one workgroup of ARGMAX_THREADS threads
per row, bindings X and Y, push constants rows and N as 32-bit integers. The reference is numpy's argmax with NaN
ranked below every number (the contract in rewrite/backends/iree_argmax.py). ``ITERS`` calls are captured in a
CUDA graph and its replays timed with CUDA events (``timed`` of benchmarks/moe_cuda_kernels.py). Exits 1 when a
case is off its reference.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from moe_cuda_kernels import ITERS, REPS, cupy_or_exit, timed  # noqa: E402

#: (name, rows, N): the next token of Qwen's and DeepSeek's vocabularies, IREE's failing multiples of 256, odd sizes
SHAPES = (("qwen 151936", 1, 151936), ("deepseek 102400", 1, 102400), ("512", 1, 512), ("1000 x 3 rows", 3, 1000),
          ("257", 2, 257))


def reference(x: np.ndarray) -> np.ndarray:
    """The lowest index of each row's maximum, NaN below every number (a row of NaNs: 0)."""
    f = x.astype(np.float64)
    return np.argmax(np.where(np.isnan(f), -np.inf, f), axis=-1) * ~np.isnan(f).all(axis=-1)


def cases(rng: np.random.Generator, rows: int, n: int, dtype) -> list[tuple[str, np.ndarray]]:
    """Random rows, a tie at two places, all -inf, a NaN at the maximum's place, all NaN, -0 before +0."""
    base = rng.standard_normal((rows, n)).astype(dtype)
    tie = base.copy()
    tie[:, n // 3] = tie[:, n - 1] = 9
    ninf = np.full((rows, n), -np.inf, dtype)
    nan = tie.copy()
    nan[:, n // 3] = np.nan
    zeros = np.full((rows, n), -1, dtype)
    zeros[:, 5], zeros[:, 7] = -0.0, 0.0
    return [("random", base), ("tie", tie), ("all -inf", ninf), ("NaN", nan),
            ("all NaN", np.full((rows, n), np.nan, dtype)), ("-0 / +0", zeros)]


def main() -> int:
    cp = cupy_or_exit()

    from rewrite.backends.iree_argmax import ARGMAX_THREADS

    source = ROOT / "rewrite/backends/kernels/argmax_cuda.cu"
    mod = cp.RawModule(code=source.read_text(), backend="nvcc", options=("-O3",))
    rng = np.random.default_rng(0)
    failed = 0
    print(f"{'shape':<18} {'type':<4} {'us':>7} {'copy us':>8}  check")
    for name, rows, n in SHAPES:
        for dtype, el in ((np.float16, "f16"), (np.float32, "f32")):
            kernel = mod.get_function(f"row_argmax_{el}")
            y = cp.zeros(rows, cp.int64)
            bad = []
            for case, x in cases(rng, rows, n, dtype):
                dx = cp.asarray(x)
                kernel((rows,), (ARGMAX_THREADS,), (dx, y, np.int32(rows), np.int32(n)))
                got, want = cp.asnumpy(y), reference(x)
                if got.tolist() != want.tolist():
                    bad.append(f"{case}: {got.tolist()} against {want.tolist()}")
            failed += bool(bad)
            xs = [cp.asarray(rng.standard_normal((rows, n)).astype(dtype)) for _ in range(8)]
            us = timed(cp, [lambda i=i: kernel((rows,), (ARGMAX_THREADS,), (xs[i % 8], y, np.int32(rows), np.int32(n)))
                            for i in range(ITERS)], REPS)
            dst = cp.empty_like(xs[0])
            copy_us = timed(cp, [lambda i=i: dst.__setitem__(Ellipsis, xs[i % 8]) for i in range(ITERS)], REPS)
            print(f"{name:<18} {el:<4} {us:>7.1f} {copy_us:>8.1f}  {'; '.join(bad) if bad else 'ok (6 cases)'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
