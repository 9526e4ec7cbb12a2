"""The dense-MatMul CUDA kernels launched directly (CuPy), without IREE: the matmul4 plugin's MatMulInt4 at the
dense INT4 shapes of the seeds' models and the densemm plugin's DenseMatMul at their LM head, time per call against
the copy bandwidth measured in the same run, and a check against each op's numpy reference. On the GPU machine
(nvcc and CuPy, no IREE)::

    python benchmarks/dense_cuda_kernels.py [--tokens 1,8,128]
    python benchmarks/dense_cuda_kernels.py --tokens 1 --variant old=old.cu --variant new=rewrite/plugins/matmul4/kernels/matmul4_cuda.cu

A variant is ``NAME=SOURCE``: another version of matmul4_cuda.cu (``--variant``) or densemm_cuda.cu
(``--dense-variant``) with the same launch interface (its quoted includes resolve against the shipped source's
folder); every variant runs on the same weights, one row each. The LM head runs without and, at T = 1, with its
RMSNorm prologue (``dense_matmul_norm``, as the ``rms-norm-prologue`` rule lowers the final norm).

The kernels are launched as IREE launches them (``lower_iree_cuda``): the bindings' pointers, then the push
constants as 32-bit integers, on the same grid. ``LAYERS`` weight sets (more bytes than the L2 holds) are used in
turn, so each call reads its weight from HBM, as a decode step does; ``ITERS`` calls are captured in a CUDA graph
and its replays timed with CUDA events (``timed`` of benchmarks/moe_cuda_kernels.py). Bytes per call: the weight
(codes, scales and zero points for INT4), plus A, Y and an addend. Exits 1 when a kernel's output is off its reference.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from moe_cuda_kernels import ITERS, REPS, copy_bandwidth, cupy_or_exit, read_floor, timed  # noqa: E402

#: name -> (K, N): the dense INT4 MatMuls of one layer (Qwen/Qwen1.5-MoE-A2.7B and Qwen/Qwen3-30B-A3B config.json)
SHAPES = {
    "qwen1.5 q/k/v/o": (2048, 2048),
    "qwen1.5 shared gate/up": (2048, 5632),
    "qwen1.5 shared down": (5632, 2048),
    "qwen3 q": (2048, 4096),
    "qwen3 k/v": (2048, 512),
    "qwen3 o": (4096, 2048),
    "qwen1.5 q+k+v merged": (2048, 6144),  # the shared-input merge: one launch over the members' columns
    "qwen1.5 gate+up merged": (2048, 11264),
    "qwen3 q+k+v merged": (2048, 5120),
}
#: name -> (K, N, epilogue): the matmul4 epilogues at their layer shapes ("swiglu": the *_swiglu kernel, N/2
#: outputs; "bias" / "residual": an addend of [N] / [T, N], the output-add rule's; "norm": the *_norm kernel, A
#: through an RMSNorm first, one row only)
EPILOGUE_SHAPES = {
    "qwen1.5 gate+up swiglu": (2048, 11264, "swiglu"),
    "qwen1.5 q + bias": (2048, 2048, "bias"),
    "qwen1.5 o + residual": (2048, 2048, "residual"),
    "qwen3 q+k+v norm": (2048, 5120, "norm"),
}
NORM_EPS = 1e-6
#: name -> (K, N): the f16 LM heads (DenseMatMul), 151936-token vocabularies
DENSE_SHAPES = {"qwen1.5 / qwen3 lm head": (2048, 151936)}
BLOCK = 128
LAYERS = 48
DENSE_LAYERS = 4  #: 4 x 622 MB, ten times the L2


def main() -> int:
    from rewrite.plugins.densemm.op import DenseMatMul
    from rewrite.plugins.matmul4.op import CUDA_THREADS, CUDA_TOKENS, MatMulInt4

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,8,128")
    ap.add_argument("--reps", type=int, default=REPS)
    ap.add_argument("--variant", action="append", default=[], help="NAME=SOURCE: a matmul4 kernel source (repeatable)")
    ap.add_argument("--dense-variant", action="append", default=[], help="NAME=SOURCE: a densemm kernel source (repeatable)")
    args = ap.parse_args()
    cp = cupy_or_exit()
    shipped = ROOT / "rewrite/plugins/matmul4/kernels/matmul4_cuda.cu"
    dense_shipped = ROOT / "rewrite/plugins/densemm/kernels/densemm_cuda.cu"

    def module(source: Path, folder: Path):  # from a string: quoted includes resolve against ``folder`` (-I)
        return cp.RawModule(code=source.read_text(), backend="nvcc", options=("-O3", f"-I{folder}"))

    def modules(specs: list[str], default: Path) -> list:
        named = [(name, Path(src)) for name, _, src in (v.partition("=") for v in specs)] or [("shipped", default)]
        return [(name, module(src, default.parent)) for name, src in named]

    mods = modules(args.variant, shipped)
    dense_mods = modules(args.dense_variant, dense_shipped)
    bw = copy_bandwidth(cp)
    print(f"copy bandwidth: {bw / 1e9:.0f} GB/s; {ITERS} calls per CUDA graph, median of {args.reps} replays; f16, "
          f"block {BLOCK}, zero points")
    print(f"{'shape':<24} {'K':>5} {'N':>5} {'T':>4} {'variant':<8} {'us':>8} {'MB':>7} {'GB/s':>6} {'of copy':>8}  check")
    rng = np.random.default_rng(0)
    failed = 0
    for name, (k, n, *epilogue) in [*SHAPES.items(), *EPILOGUE_SHAPES.items()]:
        epi = epilogue[0] if epilogue else None
        nb = -(-k // BLOCK)
        crng = cp.random.RandomState(k + n)
        layers = [dict(w=crng.randint(0, 256, (n, k // 2), dtype=cp.uint8),
                       s=(crng.uniform(0.5, 1.5, (n, nb)) * 0.02).astype(cp.float16),
                       z=crng.randint(0, 16, (n, nb), dtype=cp.uint8)) for _ in range(LAYERS)]
        host = {key: cp.asnumpy(v) for key, v in layers[0].items()}
        vec = 32 if k % 32 == 0 and BLOCK % 32 == 0 else 8
        for t in (int(v) for v in args.tokens.split(",")):
            if epi == "norm" and t != 1:
                continue  # the *_norm kernels take one row
            a = (rng.standard_normal((t, k)) * (3 if epi == "norm" else 1)).astype(np.float16)
            cols = n // 2 if epi == "swiglu" else n
            addend = {"bias": rng.standard_normal(n), "residual": rng.standard_normal((t, n))}.get(epi, np.zeros(1))
            addend = addend.astype(np.float16)
            nw = (rng.random(k) + 0.5).astype(np.float16)
            da, dadd, dnw, y = cp.asarray(a), cp.asarray(addend), cp.asarray(nw), cp.zeros((t, cols), cp.float16)
            grid = (-(-cols // (CUDA_THREADS // 32)), t if t == 1 else -(-t // CUDA_TOKENS))
            add_mode = {"bias": 1, "residual": 2}.get(epi, 0)
            consts = [np.int32(c) for c in (t, k, n, BLOCK, 1, n, 0, add_mode)]  # m, k, n, bs, has_zp, n0, n1, add_mode
            attrs = dict(K=k, N=n, block_size=BLOCK, **({"activation": "swiglu"} if epi == "swiglu" else {}),
                         **({"norm_epsilon": NORM_EPS} if epi == "norm" else {}))
            extra = [addend] if epi in ("bias", "residual") else [None, nw] if epi == "norm" else []
            want = MatMulInt4().reference(attrs, a, host["w"], host["s"], host["z"], *extra)[0]
            nbytes = host["w"].nbytes + host["s"].nbytes + host["z"].nbytes + a.nbytes + t * cols * 2 + \
                (addend.nbytes if epi in ("bias", "residual") else nw.nbytes if epi == "norm" else 0)
            if t == 1:  # the floor of a kernel reading the weights' bytes (moe_cuda_kernels.READ_FLOOR), same rotation
                read = read_floor(cp)
                wbytes = host["w"].nbytes + host["s"].nbytes + host["z"].nbytes
                reads = [cp.empty(wbytes, cp.uint8) for _ in range(LAYERS)]
                us = timed(cp, [lambda i=i: read(reads[i % LAYERS]) for i in range(ITERS)], args.reps)
                print(f"{name:<24} {k:>5} {n:>5} {t:>4} {'floor':<8} {us:>8.1f} {wbytes / 1e6:>7.2f} {wbytes / us / 1e3:>6.0f} "
                      f"{wbytes / us / 1e3 / (bw / 1e9):>8.1%}  (the weights' bytes read, nothing computed)", flush=True)
                del reads
            for vname, mod in mods:
                # as the lowering picks
                kernel = mod.get_function(f"matmul_int4_f16_v{vec}" + ("_t1" if t == 1 else "")
                                          + ("_swiglu" if epi == "swiglu" else "") + ("_norm" if epi == "norm" else ""))

                def launch(layer: int, kernel=kernel) -> None:
                    d = layers[layer]
                    if epi == "norm":
                        kernel(grid, (CUDA_THREADS,), (da, d["w"], d["s"], d["z"], dnw, dadd, y, *consts,
                                                       np.float32(NORM_EPS).view(np.int32)))
                    else:
                        kernel(grid, (CUDA_THREADS,), (da, d["w"], d["s"], d["z"], dadd, y, *consts))

                y[...] = 0
                launch(0)
                cp.cuda.Device().synchronize()
                got = cp.asnumpy(y).astype(np.float64)
                err = float(np.abs(got - want).max() / max(1.0, np.abs(want.astype(np.float64)).max()))
                ok = err <= 1e-2
                failed += not ok
                us = timed(cp, [lambda i=i: launch(i % LAYERS) for i in range(ITERS)], args.reps)
                print(f"{name:<24} {k:>5} {n:>5} {t:>4} {vname:<8} {us:>8.1f} {nbytes / 1e6:>7.2f} {nbytes / us / 1e3:>6.0f} "
                      f"{nbytes / us / 1e3 / (bw / 1e9):>8.1%}  rel. error {err:.1e} {'ok' if ok else 'WRONG'}", flush=True)
    for name, (k, n) in DENSE_SHAPES.items():
        crng = cp.random.RandomState(k)
        weights = [(crng.standard_normal((n, k), dtype=cp.float32) * 0.02).astype(cp.float16) for _ in range(DENSE_LAYERS)]
        host = cp.asnumpy(weights[0])
        for t in (int(v) for v in args.tokens.split(",")):
            for norm in (False, True) if t == 1 else (False,):
                a = (rng.standard_normal((t, k)) * (3 if norm else 1)).astype(np.float16)
                nw = (rng.random(k) + 0.5).astype(np.float16)
                da, dnw, y, xn = cp.asarray(a), cp.asarray(nw), cp.zeros((t, n), cp.float16), cp.zeros(k, cp.float16)
                grid = (-(-n // (CUDA_THREADS // 32)), -(-t // CUDA_TOKENS))
                if norm:
                    want = DenseMatMul().reference({"norm_epsilon": NORM_EPS}, a, host, nw)[0]
                else:
                    want = DenseMatMul().reference({}, a, host)[0]
                nbytes = host.nbytes + a.nbytes + t * n * 2 + (nw.nbytes if norm else 0)
                for vname, mod in dense_mods:
                    kernel = mod.get_function("dense_matmul_norm_f16" if norm else "dense_matmul_f16")

                    def launch_dense(layer: int, kernel=kernel, norm=norm) -> None:
                        if norm:
                            kernel(grid, (CUDA_THREADS,), (da, weights[layer], dnw, y, xn, np.int32(t), np.int32(k),
                                                           np.int32(n), np.float32(NORM_EPS).view(np.int32)))
                        else:
                            kernel(grid, (CUDA_THREADS,), (da, weights[layer], y, np.int32(t), np.int32(k), np.int32(n)))

                    y[...] = 0
                    launch_dense(0)
                    cp.cuda.Device().synchronize()
                    err = float(np.abs(cp.asnumpy(y).astype(np.float64) - want).max() / max(1.0, np.abs(want.astype(np.float64)).max()))
                    ok = err <= 1e-2
                    failed += not ok
                    us = timed(cp, [lambda i=i: launch_dense(i % DENSE_LAYERS) for i in range(ITERS)], args.reps)
                    label = name + (" norm" if norm else "")
                    print(f"{label:<24} {k:>5} {n:>6} {t:>4} {vname:<8} {us:>8.1f} {nbytes / 1e6:>7.2f} {nbytes / us / 1e3:>6.0f} "
                          f"{nbytes / us / 1e3 / (bw / 1e9):>8.1%}  rel. error {err:.1e} {'ok' if ok else 'WRONG'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
