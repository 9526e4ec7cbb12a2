"""The GroupedAttention CUDA kernel launched directly (CuPy), without IREE: the attention plugin's kernel at the
attention shapes of the seeds' models, time per call against the copy bandwidth measured in the same run, and a
check against the op's numpy reference. On the GPU machine (nvcc and CuPy, no IREE)::

    python benchmarks/attention_cuda_kernels.py
    python benchmarks/attention_cuda_kernels.py --variant old=old.cu --variant new=attention_cuda.cu

The kernel is launched as IREE launches it (``lower_iree_cuda``): the bindings' pointers, then the push constants
as 32-bit integers, on the same grid. Cases: a static KV cache of S positions of which the first ``visible`` are
written (the mask hides the rest, as ``kv --max-seq`` leaves it), T query rows at the last visible positions
(causal), their K and V rows passed apart (``K_new``, ``V_new``, ``position``: the form the
``attention-reads-loaded-cache`` rule makes). Enough K/V caches (``LAYERS`` or more: together at least
``COLD_BYTES``, more than the L2 holds) are used in turn, so a call reads its cache from HBM as a decode step does
(between two steps every weight passes through the L2); one call per cache, at least ``ITERS``, is captured in a
CUDA graph and its replays timed with CUDA events (``timed`` of benchmarks/moe_cuda_kernels.py). A variant
(``--variant NAME=SOURCE[,MACRO[=V]...]``, repeatable) is another version of the kernel source with the same launch
interface, with macros passed to nvcc (``parse_variant`` of benchmarks/moe_cuda_kernels.py); the variants run side
by side on the same caches, so their times compare directly. Bytes per call: the visible K and V rows of every K/V
head, Q, Y and the mask rows. Each case runs with each of ``--splits`` (1, and the lowering's ``cuda_splits``: a
decode row's positions over several workgroups, merged by the last), checked before and after it is timed. Then the
conformance kit's samples of the op (f32 and f16, every mask form, the rotary inputs) through each variant's
kernel, with 1, 2 and 3 splits and the lowering's. Exits 1 when an output is off its reference.

Each case also runs ``grouped_attention_rope_f16_d<D>`` (``NAME+rope``): the layer's RoPE of Q and of the new K rows
inside the attention (the ``attention-absorbs-rope`` form), with Qwen3's q/k norms for qwen3 and none for qwen1.5,
checked against the reference of the op with its rotary inputs (Y and the rotated K rows).
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

from moe_cuda_kernels import ITERS, REPS, copy_bandwidth, cupy_or_exit, parse_variant, timed  # noqa: E402

#: name -> (query heads, K/V heads, head size, q/k norms): Qwen/Qwen1.5-MoE-A2.7B and Qwen/Qwen3-30B-A3B config.json
MODELS = {"qwen1.5": (16, 16, 128, False), "qwen3": (32, 4, 128, True)}
EPS = 1e-6  #: the q/k norms' epsilon (Qwen3's rms_norm_eps)
#: (T query rows, S cache positions, visible positions): decode at 160 of 256 (decode_full's cache), at 160 and
#: 4,000 of 4,096; a 128-token prefill into the 256-slot cache
CASES = ((1, 256, 160), (1, 4096, 160), (1, 4096, 4000), (128, 256, 128))
LAYERS = 24
COLD_BYTES = 256 << 20  #: K/V bytes cycled per graph: several times the L2 (50 MB on an H100, 60 on an H200)


def main() -> int:
    from rewrite.plugins.attention.op import CUDA_THREADS, GroupedAttention, cuda_splits

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=REPS)
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=SOURCE[,MACRO[=V]...] (repeatable; default: the shipped source)")
    ap.add_argument("--splits", default="1,auto",
                    help="splits of a row's positions to time each case with: numbers, or auto (the lowering's "
                         "cuda_splits); comma-separated")
    ap.add_argument("--samples-only", action="store_true", help="only the conformance kit's samples: no timing")
    args = ap.parse_args()
    cp = cupy_or_exit()
    shipped = ROOT / "rewrite/plugins/attention/kernels/attention_cuda.cu"
    variants = [parse_variant(v, 0, 0, 0) for v in args.variant] or [dict(name="shipped", source=shipped, defines=[])]
    # quoted includes: the variant's folder, then the shipped source's
    mods = {v["name"]: cp.RawModule(code=v["source"].read_text(), backend="nvcc",
                                    options=("-O3", f"-I{v['source'].resolve().parent}", f"-I{shipped.parent}",
                                             *(f"-D{d}" for d in v["defines"])))
            for v in variants}
    if args.samples_only:
        return 1 if sum(check_samples(cp, mod) for mod in mods.values()) else 0
    bw = copy_bandwidth(cp)
    print(f"copy bandwidth: {bw / 1e9:.0f} GB/s; one call per K/V cache (>= {COLD_BYTES >> 20} MB of them, >= {ITERS} "
          f"calls) per CUDA graph, median of {args.reps} replays; f16")
    print(f"{'model':<8} {'Hq':>3} {'Hkv':>3} {'T':>4} {'S':>5} {'vis':>5} {'variant':<11} {'us':>8} {'MB':>7} {'GB/s':>6} "
          f"{'of copy':>8}  check")
    rng = np.random.default_rng(0)
    failed = 0
    for name, (hq, hkv, d, norms) in MODELS.items():
        for t, s, visible in CASES:
            crng = cp.random.RandomState(t + s)
            layers = max(LAYERS, -(-COLD_BYTES // (2 * hkv * s * d * 2)))
            caches = [tuple(crng.standard_normal((1, hkv, s, d), dtype=cp.float32).astype(cp.float16) for _ in range(2))
                      for _ in range(layers)]
            q = rng.standard_normal((1, hq, t, d)).astype(np.float16)
            pos = np.arange(visible - t, visible)[:, None]
            mask = np.where(np.arange(s)[None, :] <= pos, 0.0, -np.inf).astype(np.float16)[None, None]
            dq, dmask, y = cp.asarray(q), cp.asarray(mask), cp.zeros((1, hq, t, d), cp.float16)
            scale = d ** -0.5
            # the step's rows apart from the cache as loaded (the attention-reads-loaded-cache form): T rows at
            # visible - T, read from k_new/v_new
            consts = [np.int32(c) for c in (t, s, hq, hkv, 0, 0, s, 1,  # T, S, Hq, Hkv, msb, msh, mst, has_mask
                                            struct.unpack("<i", struct.pack("<f", scale))[0], t)]  # scale, n_new
            news = [tuple(x[:, :, visible - t:visible].copy() for x in layer) for layer in caches]
            position = cp.asarray(np.array([visible - t], np.int64))
            k0, v0 = (cp.asnumpy(x) for x in caches[0])
            want = GroupedAttention().reference({"scale": scale}, q, k0, v0, mask)[0].astype(np.float64)
            # the rotary form: tables of the T positions, the norms' weights (qwen3), the rotated K rows written
            ang = np.arange(visible - t, visible, dtype=np.float32)[:, None] * 1e6 ** (-np.arange(0, d, 2, dtype=np.float32) / d)
            ang = np.concatenate([ang, ang], -1)[None, None]
            cos, sin = np.cos(ang).astype(np.float16), np.sin(ang).astype(np.float16)
            qw, kw = ((1 + 0.1 * rng.standard_normal(d)).astype(np.float16) if norms else None for _ in range(2))
            kn0, vn0 = (cp.asnumpy(x) for x in news[0])
            want_rope = [w.astype(np.float64) for w in GroupedAttention().reference(
                {"scale": scale, "norm_epsilon": EPS}, q, k0, v0, mask, kn0, vn0, np.array([visible - t]), cos, sin, qw, kw)]
            dummy = cp.zeros(1, cp.float16)
            rope_ins = (cp.asarray(cos), cp.asarray(sin), dummy if qw is None else cp.asarray(qw), dummy if kw is None else cp.asarray(kw))
            krot = cp.zeros((1, hkv, t, d), cp.float16)
            rope_consts = rotary_consts(cos, sin, qw, kw, EPS)
            splits = sorted({cuda_splits(1, hq, t, s) if p == "auto" else max(1, int(p)) for p in args.splits.split(",")})
            for (vname, mod), p, rope in ((vm, p, r) for vm in mods.items() for p in splits for r in (False, True)):
                kernel = mod.get_function(f"grouped_attention_{'rope_' if rope else ''}f16_d{d}")
                part = cp.empty(hq * t * p * (d + 2), cp.float32)
                tail = (np.int32(p), np.int32(0))  # splits, site
                vname = f"{vname}{'+rope' if rope else ''}/{p}"

                def launch(layer: int, kernel=kernel, part=part, tail=tail, p=p, rope=rope) -> None:
                    k, v = caches[layer]
                    kn, vn = news[layer]
                    if rope:
                        kernel((hq * p, t, 1), (CUDA_THREADS,), (dq, k, v, dmask, kn, vn, position, *rope_ins, y, part, krot,
                                                                 *consts, *tail, *rope_consts))
                    else:
                        kernel((hq * p, t, 1), (CUDA_THREADS,), (dq, k, v, dmask, kn, vn, position, y, part, *consts, *tail))

                def error(launch=launch, rope=rope) -> float:
                    """Relative error of ``y`` (and, rotary, of the rotated K rows) after one launch on layer 0
                    (both zeroed first)."""
                    cp.cuda.Device().synchronize()
                    y[...] = 0
                    krot[...] = 0
                    launch(0)
                    cp.cuda.Device().synchronize()
                    got = [y, krot] if rope else [y]
                    wants = want_rope if rope else [want]
                    return max(float(np.abs(cp.asnumpy(g).astype(np.float64) - w).max() / max(1e-6, np.abs(w).max()))
                               for g, w in zip(got, wants))

                err = error()
                us = timed(cp, [lambda i=i: launch(i % layers) for i in range(max(ITERS, layers))], args.reps)
                err = max(err, error())  # and after thousands of launches (the tickets set back by every one)
                ok = err <= 1e-2
                failed += not ok
                nbytes = 2 * hkv * visible * d * 2 + q.nbytes + y.nbytes + mask.nbytes
                print(f"{name:<8} {hq:>3} {hkv:>3} {t:>4} {s:>5} {visible:>5} {vname:<11} {us:>8.1f} {nbytes / 1e6:>7.2f} "
                      f"{nbytes / us / 1e3:>6.0f} {nbytes / us / 1e3 / (bw / 1e9):>8.1%}  rel. error {err:.1e} "
                      f"{'ok' if ok else 'WRONG'}", flush=True)
            del caches, news
    for vname, mod in mods.items():
        print(f"{vname}: the conformance kit's samples")
        failed += check_samples(cp, mod)
    return 1 if failed else 0


def rotary_consts(cos: np.ndarray, sin: np.ndarray, qw, kw, eps: float) -> list[np.int32]:
    """The rotary kernel's push constants after the plain kernel's, as the lowering passes them: each table's
    ([Bc, 1, Tc, D]) element strides over B and T (0 where that dim is 1: broadcast; ``rope.op.table_strides``),
    the norms present (bit 0 Q's, bit 1 K's) and the norms' epsilon as float32 bits."""
    d = cos.shape[-1]
    strides = [(0 if x.shape[0] == 1 else x.shape[2] * d, 0 if x.shape[2] == 1 else d) for x in (cos, sin)]
    flags = int(qw is not None) | 2 * int(kw is not None)
    return [np.int32(c) for c in (*strides[0], *strides[1], flags, struct.unpack("<i", struct.pack("<f", eps))[0])]


def check_samples(cp, mod) -> int:
    """The conformance kit's samples of GroupedAttention (grouped and plain heads, decode and prefill rows, masks
    of [1, 1, T, S], [B, 1, T, S] and [1, Hq, T, S], none; f32 and f16; with the rotary inputs through
    ``grouped_attention_rope_*``, its rotated K rows checked too) through the kernel, against the reference
    (float32 1e-4, float16 1e-2 relative to the largest output). Returns the number that are off."""
    from rewrite.plugins.attention.op import CUDA_SPLIT_ROWS, CUDA_THREADS, GroupedAttention, cuda_splits

    op = GroupedAttention()
    failed = 0
    for n, (attrs, ins) in enumerate(op.sample_inputs(np.random.default_rng(1))):
        if attrs.get("nan_rows_zero"):  # the kernel has no NaN guard: the attention rule does not match it for cuda
            continue
        q, k, v, mask, k_new, v_new, position, cos, sin, qw, kw = (ins + [None] * 11)[:11]
        b, hq, t, d = q.shape
        el = "f16" if q.dtype == np.float16 else "f32"
        y = cp.zeros(q.shape, q.dtype)
        strides = [0, 0, 0]
        if mask is not None:
            full = (mask.shape[1] * mask.shape[2] * mask.shape[3], mask.shape[2] * mask.shape[3], mask.shape[3])
            strides = [0 if mask.shape[i] == 1 else full[i] for i in range(3)]
        n_new = 0 if k_new is None else k_new.shape[2]
        consts = [np.int32(c) for c in (t, k.shape[2], hq, k.shape[1], *strides, int(mask is not None),
                                        struct.unpack("<i", struct.pack("<f", attrs["scale"]))[0], n_new)]
        dummy = cp.zeros(1, q.dtype)
        dmask = cp.asarray(mask) if mask is not None else dummy
        news = (cp.asarray(k_new), cp.asarray(v_new), cp.asarray(position)) if n_new else (dummy, dummy, cp.zeros(1, cp.int64))
        wants = [w.astype(np.float64) for w in op.reference(attrs, q, k, v, mask, k_new, v_new, position, cos, sin, qw, kw)]
        rope = cos is not None
        if rope:  # the rotary kernel: its tables' strides, the norms, the rotated K rows
            rope_consts = rotary_consts(cos, sin, qw, kw, attrs.get("norm_epsilon", 0.0))
            rope_ins = (cp.asarray(cos), cp.asarray(sin), *(dummy if w is None else cp.asarray(w) for w in (qw, kw)))
            krot = cp.zeros(k_new.shape, q.dtype)
        forced = (2, 3) if b * hq * t <= CUDA_SPLIT_ROWS else ()  # the samples' S are small: splits forced too
        for p in sorted({1, *forced, cuda_splits(b, hq, t, k.shape[2])}):
            y[...] = 0
            part = cp.empty(b * hq * t * p * (d + 2), cp.float32)
            qkv = (cp.asarray(q), cp.asarray(k), cp.asarray(v), dmask, *news)
            if rope:
                krot[...] = 0
                mod.get_function(f"grouped_attention_rope_{el}_d{d}")(
                    (hq * p, t, b), (CUDA_THREADS,),
                    (*qkv, *rope_ins, y, part, krot, *consts, np.int32(p), np.int32(0), *rope_consts))
            else:
                mod.get_function(f"grouped_attention_{el}_d{d}")(
                    (hq * p, t, b), (CUDA_THREADS,), (*qkv, y, part, *consts, np.int32(p), np.int32(0)))
            got = [y, krot] if rope else [y]
            err = max(float(np.abs(cp.asnumpy(g).astype(np.float64) - w).max() / max(1e-6, np.abs(w).max()))
                      for g, w in zip(got, wants))
            ok = err <= (1e-2 if el == "f16" else 1e-4)
            failed += not ok
            print(f"sample {n}: Q {list(q.shape)} K {list(k.shape)} mask {None if mask is None else list(mask.shape)} "
                  f"new rows {n_new}{' rotated' if rope else ''} {el}, {p} split(s): rel. error {err:.1e} "
                  f"{'ok' if ok else 'WRONG'}", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
