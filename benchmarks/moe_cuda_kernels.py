"""The moe plugin's FusedMoE CUDA kernels launched directly (CuPy), without IREE: kernel time per layer at the
seeds' decode shapes against the copy bandwidth measured in the same run, and a check against the numpy
reference. For iterating on rewrite/plugins/moe/kernels/moe_cuda.cu on the GPU machine, which has nvcc and
CuPy but no IREE:

    python benchmarks/moe_cuda_kernels.py                          # the shipped source on the lowering's grid
    python benchmarks/moe_cuda_kernels.py --variant old=old.cu --variant new=moe_cuda.cu,GATE_PAIRS=1,gate=8
    python benchmarks/moe_cuda_kernels.py --once                   # one launch of each kernel (for ncu)

A variant is ``NAME=SOURCE[,MACRO[=V]...][,gate=N][,down=N][,mma=0]``: a kernel source (another version of
moe_cuda.cu with the same launch interface), macros passed to nvcc, and the grid (``gate``: the lowering's
CUDA_GATE_ITEMS, ``down``: CUDA_DOWN_ROWS); all variants run side by side on the same weights, so their times
compare directly. The kernels are launched as IREE launches them (rewrite/plugins/moe/lowering.py
``lower_iree_cuda``): the bindings' pointers, then the 10 push constants as 32-bit integers, on the same grid.
Where the lowering takes the tensor-core pair (``cuda_mma_steps``: the seeds' shapes, either mode) and the
source has its exports, that pair runs on its grid (the row's variant name gets ``/mma``), at T = 1 with the
one-token down ``moe_down_mma<S>t1_f16`` where the source has it, as the lowering for a decode graph (``/mma-t1``); ``mma=0`` keeps the
other pair, ``mix=1`` takes the other pair's gate_up with the tensor-core down (``/mix``: the same act rows and
routing tail between them; not a choice of the lowering). ``mgate=N`` gives the tensor-core gate_up N of its
groups per workgroup (its grid's y divided by N; default the lowering's ``MMA_GATE_GROUPS``).
``--mode routed`` (the default)
gives the kernels the experts and weights, as the ``topk`` router does in the seeds' models; ``logits`` lets them
route from the router logits.
Where the source has ``moe_stream2x<D>_f16`` (benchmarks/variants/moe_stream.cu: the layer in one launch at T = 1, its
weights streamed into shared memory; not shipped) its row ``NAME/st`` follows, on that kernel's grid and shared
memory (:func:`stream_layout`), checked before timing, on the next launch and after it (not with ``--once``).
Where the source has ``moe_fused_f16`` (the one-launch kernel) its row ``NAME/1`` follows: one launch per layer on
the 1-D grid of both halves' workgroups, checked against the reference before and after it is timed (its
counters must be back at zero after every launch). Where it has ``moe_sliced16_f16`` / ``moe_sliced32_f16`` (the
one-launch kernels of benchmarks/variants/moe_sliced.cu, not shipped) rows ``NAME/s16`` and ``NAME/s32`` follow,
checked three times: before timing, once more (the first launch's sums must have been zeroed) and after it.
``LAYERS`` weight sets (more bytes than the L2 holds) are used in turn, so each launch reads its weights from
HBM, as a decode step does. ``ITERS`` launches are captured in a CUDA graph and its replays timed with CUDA
events (the median of ``REPS``), so the host's launch rate is not measured.
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
LAYERS = 24  # weight sets: down alone reads 24 x 6 MB per cycle, several times the 60 MB L2
ITERS = 64
REPS = 20
F16, INT4, ZERO_POINTS, ROUTED = 1, 2, 16, 32  # the kernels' flags (moe_cuda.cu)


#: benchmarks/variants/moe_stream.cu: the down steps D of its exports moe_stream2x<D>_f16 (gate_up's S is 2:
#: H = 2048), its grid (the SMs of an H100 SXM or H200, at least H / 16; on fewer SMs it still ends, see the
#: kernel's comment) and largest grid, an SM's shared memory for a workgroup
STREAM_DOWN_STEPS = (2, 4, 6, 8)
STREAM_WORKGROUPS, STREAM_MAX_G, STREAM_MAX_LOCAL_MEMORY = 132, 256, 232448 - 8192  # room for its static 4.8 KB


def _stream_stride(nbytes: int) -> int:
    """moe_stream.cu's stream_stride: a row of ``nbytes`` in shared memory, padded to 64 bytes past a multiple of
    128 (rows g and g + 1 on the two halves of the banks)."""
    return nbytes + (64 - nbytes % 128 + 128) % 128


def stream_layout(h: int, i: int, k: int) -> tuple[int, int, int] | None:
    """(grid G, gate_up groups of a range, dynamic shared memory in bytes) of moe_stream.cu's ``moe_stream2x<D>_f16``
    at T = 1 for hidden ``h``, expert intermediate ``i`` and top-k ``k`` (f16, INT4 blocks of 128); None where it
    does not apply (h other than 2048, k * i past its D, more than 8 groups a range, more than an SM's shared
    memory). The bytes are its ``stream_layout(h, i, k, groups, D).total``: per group slot 16 padded rows of h / 2
    codes and 48 bytes per block of 128 (16 scales, 16 zero points), the down tile's 16 padded rows of k * i / 2
    and 48 k bytes per block, x staged (2h) and its sums, the act rows staged for down (8 warps x D x 256) and
    their sums."""
    from rewrite.plugins.moe.lowering import cuda_mma_steps

    steps = cuda_mma_steps("f16", BLOCK, h, i, k)
    if steps is None or steps[0] != 2 or steps[1] not in STREAM_DOWN_STEPS:
        return None
    d = steps[1]
    g = max(STREAM_WORKGROUPS, h // 16)
    groups = -(-(k * i // 8) // g)
    nb, nb2 = h // BLOCK, i // BLOCK
    total = (groups * (16 * _stream_stride(h // 2) + 48 * nb) + 16 * _stream_stride(k * i // 2) + 48 * k * nb2
             + 2 * h + 8 * nb + 8 * d * 256 + 8 * d * 8)
    return (g, groups, total) if g <= STREAM_MAX_G and groups <= 8 and total <= STREAM_MAX_LOCAL_MEMORY else None


def cupy_or_exit():
    """The ``cupy`` module; exits with a message instead of a traceback where CuPy or a CUDA GPU is missing (these
    benchmarks run on the GPU machine: its CuPy builds the kernels with nvcc there)."""
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # ImportError, or CUDARuntimeError without a driver or device
        raise SystemExit(f"{Path(sys.argv[0]).name}: needs CuPy and a CUDA GPU ({type(e).__name__}: {e})") from None
    return cupy


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


def parse_variant(spec: str, gate: int, down: int, mgate: int) -> dict:
    """``NAME=SOURCE[,MACRO[=V]...][,gate=N][,down=N][,mma=0][,mix=1][,mgate=N]`` -> {name, source, defines, gate,
    down, mma, mix, mgate}."""
    name, _, rest = spec.partition("=")
    source, *opts = rest.split(",")
    v = dict(name=name, source=Path(source), defines=[], gate=gate, down=down, mma=1, mix=0, mgate=mgate)
    for o in opts:
        key, _, val = o.partition("=")
        if key in ("gate", "down", "mma", "mix", "mgate"):
            v[key] = int(val)
        else:
            v["defines"].append(o)
    return v


#: the floor any kernel reading n bytes meets: every thread issues its 4 16-byte loads at once (the whole read in
#: flight in one wave where it fits the GPU's resident threads), then folds them (a store no one reads keeps the
#: loads); what a layer's pair of launches could take at best is this kernel on each kernel's bytes in turn
READ_FLOOR = r"""
extern "C" __global__ void read_floor(const uint4* __restrict__ p, long long n, unsigned int* sink) {
  long long i0 = (long long)blockIdx.x * blockDim.x * 4 + threadIdx.x;
  uint4 v[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) v[u] = i0 + u * blockDim.x < n ? __ldg(p + i0 + u * blockDim.x) : make_uint4(0, 0, 0, 0);
  unsigned int acc = 0;
#pragma unroll
  for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  if (acc == 0x9e3779b9u) sink[0] = acc;
}
"""


def read_floor(cp):
    """A launcher of :data:`READ_FLOOR`: ``read(buf)`` reads the bytes of the uint8 device array ``buf`` (its
    size rounded down to 16) once, in one launch of 256-thread workgroups."""
    kernel, sink = cp.RawKernel(READ_FLOOR, "read_floor"), cp.zeros(1, cp.uint32)

    def read(buf) -> None:
        n = buf.size // 16
        kernel((-(-n // (4 * 256)),), (256,), (buf, np.int64(n), sink))

    return read


def timed(cp, launches, reps: int) -> float:
    """Median microseconds per launch of ``launches`` (a list of callables), captured once in a CUDA graph."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for f in launches[:4]:  # warm: module load, clocks
            f()
        stream.begin_capture()
        for f in launches:
            f()
        graph = stream.end_capture()
        graph.launch(stream)
        times = []
        for _ in range(reps):
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            graph.launch(stream)
            stop.record(stream)
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop) * 1e3 / len(launches))
    return float(np.median(times))


def main() -> int:
    from rewrite.plugins.moe.lowering import (CUDA_DOWN_ROWS, CUDA_GATE_ITEMS, CUDA_THREADS, MMA_GATE_GROUPS, FusedMoE,
                                              cuda_mma_steps)

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=SOURCE[,MACRO...][,gate=N][,down=N][,mma=0][,mix=1][,mgate=N] (repeatable)")
    ap.add_argument("--once", action="store_true", help="one launch of each kernel per shape, no timing")
    ap.add_argument("--tokens", default="1,4")
    ap.add_argument("--reps", type=int, default=REPS)
    ap.add_argument("--mode", default="routed",
                    help="routed: the experts and weights given (the topk router's, as in the seeds' models); "
                         "logits: the kernels route from the router logits themselves; routed,logits: both")
    args = ap.parse_args()
    if not set(args.mode.split(",")) <= {"routed", "logits"}:
        ap.error(f"--mode {args.mode}: expected routed, logits or both, comma-separated")
    cp = cupy_or_exit()
    shipped = ROOT / "rewrite/plugins/moe/kernels/moe_cuda.cu"
    variants = [parse_variant(v, CUDA_GATE_ITEMS, CUDA_DOWN_ROWS, MMA_GATE_GROUPS) for v in args.variant] or \
        [dict(name="shipped", source=shipped, defines=[], gate=CUDA_GATE_ITEMS, down=CUDA_DOWN_ROWS, mma=1, mix=0,
              mgate=MMA_GATE_GROUPS)]
    for v in variants:
        mod = cp.RawModule(code=v["source"].read_text(), backend="nvcc",  # quoted includes: its folder, the shipped one's
                           options=("-O3", f"-I{v['source'].resolve().parent}", f"-I{shipped.parent}",
                                    *(f"-D{d}" for d in v["defines"])))
        v["kernels"] = mod.get_function("moe_gate_up_f16"), mod.get_function("moe_down_f16")
        v["mma_kernels"] = {}  # (gate_up S, down S) -> the tensor-core pair, in sources that have it
        for name, (e, k, h, i) in SHAPES.items():
            steps = cuda_mma_steps("f16", BLOCK, h, i, k)
            if steps and v["mma"]:
                try:
                    v["mma_kernels"][steps] = (mod.get_function(f"moe_gate_up_mma{steps[0]}_f16"),
                                               mod.get_function(f"moe_down_mma{steps[1]}_f16"))
                except Exception:
                    continue
                try:  # the one-token down, which the lowering takes where T is statically 1
                    v["mma_kernels"][steps, 1] = (v["mma_kernels"][steps][0],
                                                  mod.get_function(f"moe_down_mma{steps[1]}t1_f16"))
                except Exception:
                    pass
        v["stream"] = {}  # down's D -> moe_stream2x<D>_f16, in sources that have it
        for d in STREAM_DOWN_STEPS:
            try:
                v["stream"][d] = mod.get_function(f"moe_stream2x{d}_f16")
            except Exception:
                pass
        try:  # the one-launch kernel, in sources that have it
            v["fused"] = mod.get_function("moe_fused_f16")
        except Exception:
            v["fused"] = None
        v["sliced"] = {}
        for sl in (16, 32):  # the sliced one-launch kernels, in sources that have them
            try:
                v["sliced"][sl] = mod.get_function(f"moe_sliced{sl}_f16")
            except Exception:
                pass
    bw = copy_bandwidth(cp)
    print(f"copy bandwidth: {bw / 1e9:.0f} GB/s; {ITERS} launches per CUDA graph, median of {args.reps} replays")
    for v in variants:
        print(f"  {v['name']}: {v['source'].name} {' '.join('-D' + d for d in v['defines']) or ''} gate items "
              f"{v['gate']}, down rows {v['down']}")
    print(f"{'shape':<18} {'T':>2} {'variant':<12} {'gate_up':>8} {'down':>8} {'layer':>8} {'MB':>6} {'GB/s':>6} "
          f"{'of copy':>8}  check")
    rng = np.random.default_rng(0)
    for mode in args.mode.split(","):
        print(f"mode: {mode}")
        for name, (e, k, h, i) in SHAPES.items():
            layers = []  # drawn on the GPU (random bytes are random pairs of codes); layer 0 also on the host
            crng = cp.random.RandomState(e)
            for _ in range(LAYERS):
                d = dict(fc1=crng.randint(0, 256, (e, 2 * i, h // 2), dtype=cp.uint8),
                         s1=(crng.uniform(0.5, 1.5, (e, 2 * i, h // BLOCK)) * 0.02).astype(cp.float16),
                         z1=crng.randint(0, 16, (e, 2 * i, h // BLOCK), dtype=cp.uint8),
                         fc2=crng.randint(0, 256, (e, h, i // 2), dtype=cp.uint8),
                         s2=(crng.uniform(0.5, 1.5, (e, h, -(-i // BLOCK))) * 0.02).astype(cp.float16),
                         z2=crng.randint(0, 16, (e, h, -(-i // BLOCK)), dtype=cp.uint8))
                layers.append((None, d))
            layers[0] = ({n: cp.asnumpy(v) for n, v in layers[0][1].items()}, layers[0][1])
            per_expert = {"gate_up": sum(layers[0][0][n][0].nbytes for n in ("fc1", "s1", "z1")),
                          "down": sum(layers[0][0][n][0].nbytes for n in ("fc2", "s2", "z2"))}
            for t in (int(v) for v in args.tokens.split(",")):
                x = rng.standard_normal((t, h)).astype(np.float16)
                logits = (rng.standard_normal((t, e)) * 3).astype(np.float16)
                dummy_ids, dummy_b = cp.zeros(1, cp.int64), cp.zeros(1, cp.float16)
                lf = logits.astype(np.float32)
                top = np.argsort(-lf, axis=-1, kind="stable")[:, :k]
                p = np.exp(lf - lf.max(-1, keepdims=True))
                p /= p.sum(-1, keepdims=True)
                routed_w = np.take_along_axis(p, top, -1).astype(np.float16)  # softmax then top-k, not normalized
                dx = cp.asarray(x)
                dl, given = (cp.asarray(routed_w), cp.asarray(top.astype(np.int64))) if mode == "routed" else \
                    (cp.asarray(logits), dummy_ids)
                # the act rows, then the routing gate_up leaves for down (2 * T * k floats)
                act, out = cp.zeros(t * k * (i + 2), cp.float32), cp.zeros((t, h), cp.float16)
                flags = F16 | INT4 | ZERO_POINTS | (ROUTED if mode == "routed" else 0)
                consts = [np.int32(c) for c in (t, h, i, e, k, BLOCK, flags, np.float32(1.0).view(np.int32), 0, 0)]
                w0 = layers[0][0]
                attrs = dict(k=k, normalize=0, activation="swiglu", block_size=BLOCK)
                if mode == "routed":
                    want = FusedMoE().reference(dict(attrs, mode="routed"), x, routed_w, w0["fc1"], w0["fc2"], w0["s1"],
                                                w0["z1"], w0["s2"], w0["z2"], top)[0]
                else:
                    want = FusedMoE().reference(dict(attrs, mode="softmax_topk"), x, logits, w0["fc1"], w0["fc2"], w0["s1"],
                                                w0["z1"], w0["s2"], w0["z2"])[0]
                distinct = len(np.unique(top))
                nbytes = {kn: distinct * per_expert[kn] for kn in per_expert}
                if not args.once:  # a device-to-device copy of the layer's bytes (read + write), the same way timed
                    half = (nbytes["gate_up"] + nbytes["down"]) // 2
                    bufs = [(cp.empty(half, cp.uint8), cp.empty(half, cp.uint8)) for _ in range(LAYERS)]
                    copy_us = timed(cp, [lambda n=n: bufs[n % LAYERS][1].__setitem__(Ellipsis, bufs[n % LAYERS][0])
                                         for n in range(ITERS)], args.reps)
                    print(f"{name:<18} {t:>2} {'copy':<12} {'':>8} {'':>8} {copy_us:>8.1f} {2 * half / 1e6:>6.2f} "
                          f"{2 * half / copy_us / 1e3:>6.0f} {2 * half / copy_us / 1e3 / (bw / 1e9):>8.1%}  "
                          "(a copy of as many bytes, read + write)")
                    del bufs
                    read = read_floor(cp)
                    reads = [{kn: cp.empty(nbytes[kn], cp.uint8) for kn in nbytes} for _ in range(LAYERS)]
                    fl = {kn: timed(cp, [lambda n=n, kn=kn: read(reads[n % LAYERS][kn]) for n in range(ITERS)], args.reps)
                          for kn in nbytes}
                    fboth = timed(cp, [lambda n=n, kn=kn: read(reads[n % LAYERS][kn]) for n in range(ITERS) for kn in nbytes],
                                  args.reps) * 2
                    tb = sum(nbytes.values())
                    print(f"{name:<18} {t:>2} {'read floor':<12} {fl['gate_up']:>8.1f} {fl['down']:>8.1f} {fboth:>8.1f} "
                          f"{tb / 1e6:>6.2f} {tb / fboth / 1e3:>6.0f} {tb / fboth / 1e3 / (bw / 1e9):>8.1%}  "
                          "(each kernel's bytes read, nothing computed: the pair's floor)")
                    del reads
                def error_of(launch_layer0) -> float:
                    """Relative error against the reference of ``out`` after ``launch_layer0(0)`` (out zeroed first)."""
                    out[...] = 0
                    launch_layer0(0)
                    cp.cuda.Device().synchronize()
                    got = cp.asnumpy(out).astype(np.float64)
                    return float(np.abs(got - want).max() / max(1.0, np.abs(want.astype(np.float64)).max()))

                for v in variants:
                    gate_up, down = v["kernels"]
                    grid1 = (t, -(-i // -(-v["gate"] // k)))
                    grid2 = (t, -(-h // v["down"]))
                    steps = cuda_mma_steps("f16", BLOCK, h, i, k)
                    label = v["name"]
                    if steps in v["mma_kernels"] and v["mix"]:  # the other gate_up, the tensor-core down
                        down, grid2 = v["mma_kernels"][steps][1], (t, h // 16)
                        label += "/mix"
                    elif steps in v["mma_kernels"]:  # the lowering's tensor-core pair and its grids
                        one = t == 1 and (steps, 1) in v["mma_kernels"]
                        pair = v["mma_kernels"][steps, 1] if one else v["mma_kernels"][steps]
                        (gate_up, down), grid1, grid2 = pair, (t, -(-k * i // 8 // v["mgate"])), (t, h // 16)
                        label += "/mma-t1" if one else "/mma"

                    # sources with moe_fused: down also takes the shared expert and its gate (absent: flag SHARED off)
                    shared = (dummy_b, dummy_b) if v["fused"] is not None else ()

                    def launch(kernel, layer, gate_up=gate_up, down=down, grid1=grid1, grid2=grid2, shared=shared):
                        d = layers[layer][1]
                        if kernel == "gate_up":
                            gate_up(grid1, (CUDA_THREADS,), (dx, dl, given, d["fc1"], d["s1"], d["z1"], dummy_b, act, *consts))
                        else:
                            down(grid2, (CUDA_THREADS,), (dl, given, act, d["fc2"], d["s2"], d["z2"], dummy_b, *shared, out,
                                                          *consts))

                    err = error_of(lambda layer: (launch("gate_up", layer), launch("down", layer)))
                    check = f"rel. error {err:.1e} {'ok' if err <= 1e-2 else 'WRONG'}"
                    if args.once:
                        print(f"{name:<18} {t:>2} {label:<12} {'-':>8} {'-':>8} {'-':>8} {'-':>6} {'-':>6} {'-':>8}  {check}")
                        continue
                    us = {kn: timed(cp, [lambda n=n, kn=kn: launch(kn, n % LAYERS) for n in range(ITERS)], args.reps)
                          for kn in ("gate_up", "down")}
                    both = timed(cp, [lambda n=n, kn=kn: launch(kn, n % LAYERS) for n in range(ITERS) for kn in ("gate_up", "down")],
                                 args.reps) * 2
                    total = nbytes["gate_up"] + nbytes["down"]
                    print(f"{name:<18} {t:>2} {label:<12} {us['gate_up']:>8.1f} {us['down']:>8.1f} {both:>8.1f} "
                          f"{total / 1e6:>6.2f} {total / both / 1e3:>6.0f} {total / both / 1e3 / (bw / 1e9):>8.1%}  {check}",
                          flush=True)
                    layout = stream_layout(h, i, k)
                    stream = v["stream"].get(cuda_mma_steps("f16", BLOCK, h, i, k)[1]) if layout and t == 1 else None
                    if stream is not None:
                        G, slots, smem = layout
                        stream.max_dynamic_shared_size_bytes = smem

                        def one_stream(layer, kern=stream, G=G, slots=slots, smem=smem):  # dispatch site 0
                            d = layers[layer][1]
                            kern((G,), (CUDA_THREADS,),
                                 (dx, dl, given, d["fc1"], d["s1"], d["z1"], dummy_b, d["fc2"], d["s2"], d["z2"], dummy_b,
                                  dummy_b, dummy_b, out, act, *consts, np.int32(slots), np.int32(0), np.int32(0)),
                                 shared_mem=smem)

                        checks = [error_of(one_stream), error_of(one_stream)]  # a launch, then the next one
                        us1 = timed(cp, [lambda n=n: one_stream(n % LAYERS) for n in range(ITERS)], args.reps)
                        checks.append(error_of(one_stream))  # and after thousands of launches
                        err = max(checks)
                        check = f"rel. error {err:.1e} {'ok' if err <= 1e-2 else 'WRONG'} (streamed; {len(checks)} checks)"
                        print(f"{name:<18} {t:>2} {v['name'] + '/st':<12} {'':>8} {'':>8} {us1:>8.1f} "
                              f"{total / 1e6:>6.2f} {total / us1 / 1e3:>6.0f} {total / us1 / 1e3 / (bw / 1e9):>8.1%}  "
                              f"{check}", flush=True)
                    for sl, kern in v["sliced"].items():
                        if h * sl // 2 > 32768:  # SLICE_DOWN_BYTES: the slice's down codes in shared memory
                            continue

                        def one_sliced(layer, kern=kern, sl=sl):  # moe_sliced: T * k * ceil(I / S) workgroups, site 0
                            d = layers[layer][1]
                            kern((t * k * -(-i // sl),), (CUDA_THREADS,),
                                 (dx, dl, given, d["fc1"], d["s1"], d["z1"], dummy_b, d["fc2"], d["s2"], d["z2"], dummy_b,
                                  dummy_b, dummy_b, out, *consts, np.int32(0)))

                        checks = []
                        for rep in range(3):  # before timing, again (the sums zeroed by the first), and after it
                            if rep == 2:
                                us1 = timed(cp, [lambda n=n: one_sliced(n % LAYERS) for n in range(ITERS)], args.reps)
                            checks.append(error_of(one_sliced))
                        err = max(checks)
                        check = f"rel. error {err:.1e} {'ok' if err <= 1e-2 else 'WRONG'} (sliced; {len(checks)} checks)"
                        print(f"{name:<18} {t:>2} {v['name'] + '/s' + str(sl):<12} {'':>8} {'':>8} {us1:>8.1f} "
                              f"{total / 1e6:>6.2f} {total / us1 / 1e3:>6.0f} {total / us1 / 1e3 / (bw / 1e9):>8.1%}  {check}",
                              flush=True)
                    if v["fused"] is None:
                        continue

                    fused_rows = -(-i // -(-v["gate"] // k)), -(-h // v["down"])  # its halves' row blocks (not mma's)

                    def one(layer, fused=v["fused"], g1=fused_rows[0], g2=fused_rows[1]):  # moe_fused: the lowering's 1-D grid
                        d = layers[layer][1]
                        fused((t * (g1 + g2),), (CUDA_THREADS,),
                              (dx, dl, given, d["fc1"], d["s1"], d["z1"], dummy_b, d["fc2"], d["s2"], d["z2"], dummy_b,
                               dummy_b, dummy_b, out, act, *consts, np.int32(g1), np.int32(g2), np.int32(0)))

                    checks = []
                    for _ in range(2):  # the second launch finds the counters the first one set back
                        checks.append(error_of(one))
                    if not args.once:
                        us1 = timed(cp, [lambda n=n: one(n % LAYERS) for n in range(ITERS)], args.reps)
                        checks.append(error_of(one))  # and after thousands of launches
                    err = max(checks)
                    check = f"rel. error {err:.1e} {'ok' if err <= 1e-2 else 'WRONG'} (one launch; {len(checks)} checks)"
                    if args.once:
                        print(f"{name:<18} {t:>2} {v['name'] + '/1':<12} {'-':>8} {'-':>8} {'-':>8} {'-':>6} {'-':>6} {'-':>8}  {check}")
                        continue
                    print(f"{name:<18} {t:>2} {v['name'] + '/1':<12} {'':>8} {'':>8} {us1:>8.1f} "
                          f"{total / 1e6:>6.2f} {total / us1 / 1e3:>6.0f} {total / us1 / 1e3 / (bw / 1e9):>8.1%}  {check}",
                          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
