"""Full-size decode on a GPU: the seeds' INT4 models through IREE with and without the fusing plugins, ONNX Runtime
CUDA with our lowering and PyTorch eager, side by side in one run, against the copy bandwidth measured in it.

Two steps, because the GPU machine has no IREE compiler and full-size weights are never carried:

    python benchmarks/decode_full.py prepare --arch qwen2_moe --out fd_q15     # here: export, apply, compile
    python benchmarks/decode_full.py run fd_q15 --work /tmp/fd                  # on the GPU machine

``prepare`` exports the seed form at full size (``examples/seed_form.py``: Qwen1.5-MoE-A2.7B or Qwen3-30B-A3B, INT4
experts, fp16, static KV cache of ``--max-seq`` positions, weights drawn from a seed) and applies each IREE
configuration of :data:`CONFIGS` with ``--backend iree --target cuda --stateful``. The bundle holds the weightless
graph (``seed/model.onnx``, a few MB) and each compiled folder without its weights (``model.vmfb``, ``params.json``,
manifest): about 10 MB for Qwen1.5-MoE-A2.7B.

``run`` (``iree-base-runtime``; ``onnxruntime-gpu`` for ``ort``; torch and transformers for ``torch``) regenerates
the seed form's weights from the seed (``examples/seeded_weights.py``), then per configuration applies the same
plugins there (IREE: ``--module-from`` the bundle's compiled folder, which checks that the rewritten graph is the
same and writes only the ``.irpa``), loads the folder and measures:

* prefill: one call on a ``PROMPT_LEN``-token prompt (seeded random ids; one call per token for a module compiled
  for one token per call, queued on the device several at a time for a folder that decodes there,
  ``Generator.prefill_token``), after the token check below has warmed the runtime up;
* decode: the ``DECODE_STEPS - 1`` greedy one-token calls after the prefill, each with its logits read back to the
  host and an argmax there, as ``rewrite generate`` does; tok/s over those calls;
* tokens: ``CHECK_TOKENS`` greedy tokens after the prompt's first ``CHECK_PROMPT`` tokens, against ONNX Runtime CPU
  on the quantized model (``--plugins quant4`` only, the model every configuration computes; its seed-form experts
  are gathered then dequantized per token, so a 128-token prefill would take minutes there), and the teacher-forced
  logits of those steps against the reference's (:func:`compare_logits`); with ``reference-fp32`` (the same quantized
  model with every fp16 tensor widened to float32, on ONNX Runtime CPU: :func:`_reference_fp32`) also against its
  logits, and the fp16 reference itself against them, which tells fp16 rounding on a near tie from a wrong graph;
* the per-kernel GPU time of ``PROFILE_STEPS`` more decode steps (:func:`kernel_profile`); the table's "GPU us/token"
  is their sum and "launches" their count per token: the rest of a step's wall time is the host's (launches,
  the runtime's bookkeeping, the logits' copy and argmax); and their timeline (:func:`timeline`: whether the GPU
  runs back to back or waits between kernels for the host's launches).

ONNX Runtime CUDA keeps its KV cache on the device between steps (IO binding: each step's presents are the next
step's pasts); without that every step would copy the whole cache to the host and back. PyTorch eager is
transformers' model class of the same configuration with random bf16 weights (its default experts implementation)
and its own dynamic cache; its tokens are not compared (other weights). Each configuration's folder is deleted
after it is measured (the GPU machine's disk holds the seed form and one folder at a time). Results go to
``WORK/results/*.json``, one per configuration, and a configuration already there is skipped, so a run that stopped
continues where it was.

Bytes per decode token (the speed-of-light traffic, :func:`decode_bytes`): every weight read once per token except
that only the ``top_k`` selected experts' weights are read and one embedding row; the KV cache read up to the
positions used. The fraction reached is bytes per token x tok/s over the copy bandwidth measured in the same run
(``torch`` device-to-device copy of 1 GiB, bytes read + written, CUDA events).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

from rewrite.generate import greedy_token  # noqa: E402

PROMPT_LEN = 128
DECODE_STEPS = 64
CHECK_PROMPT = 16  #: prompt tokens of the token check (the reference's gather-then-dequantize experts cost ~T x k)
CHECK_TOKENS = 8
MAX_SEQ = 256
#: name -> (backend, plugins, more apply arguments). "iree-plain": only what IREE needs to compile the quantized model
#: at all (INT4 dense weights, legal ops, static shapes, static cache); the MoE block and router are IREE's own
#: lowering. "iree-t1": the fused model compiled for one token per call (``--dim seq_len=1``: static shapes let IREE
#: pick its matrix-vector code for the dense MatMuls, and the step's command buffer is recorded once); its prefill is
#: one call per prompt token. "iree-t1-nomerge": the same without matmul4's shared-input merge; "iree-t1-noprologue":
#: without matmul4's and densemm's rms-norm-prologue (each norm a launch of its own); "iree-t1-one": FusedMoE in one
#: launch (moe_fused) instead of two; "iree-t1-next": with the greedy next token in the module
#: (``--next-token``), decoded on the device several steps in flight (``Generator.decode``) and, for the ratio, by the
#: host's argmax loop on the same folder; "iree-t1-next-nomma": the same with FusedMoE's other kernel pair instead of
#: the tensor-core one (``moe.tensor_cores=false``); "iree-t1-next-rope-apart": the same with each layer's RoPE in a
#: launch of its own before the attention (``attention.rope=false``); "iree-t1-next-gate-apart": the same with
#: Qwen1.5-MoE's shared-expert gate a launch of its own (``densemm.merge=false``); "iree-t1-noshared": without moe's fused-moe-shared (Qwen1.5-MoE's gated
#: shared expert summed by an elementwise dispatch); "iree-t1-norope":
#: without the rope and norm plugins (IREE's own norms and RoPE); "iree-t1-noattn": without those and the
#: attention plugin (IREE's own lowering of the attention core too).
CONFIGS = {
    "iree": ("iree", "quant4,matmul4,densemm,cast,rope,norm,legalize,expand,kv,attention,topk,moe", ()),
    "iree-t1": ("iree", "quant4,matmul4,densemm,cast,rope,norm,legalize,expand,kv,attention,topk,moe", ("--dim", "seq_len=1")),
    "iree-t1-nomerge": ("iree", "quant4,matmul4,densemm,cast,rope,norm,legalize,expand,kv,attention,topk,moe",
                        ("--dim", "seq_len=1", "--opt", "matmul4.merge=false")),
    "iree-t1-noprologue": ("iree", "quant4,matmul4,densemm,cast,rope,norm,legalize,expand,kv,attention,topk,moe",
                           ("--dim", "seq_len=1", "--opt", "matmul4.prologue=false", "--opt", "densemm.prologue=false")),
    "iree-t1-one": ("iree", "quant4,matmul4,densemm,cast,rope,norm,legalize,expand,kv,attention,topk,moe",
                    ("--dim", "seq_len=1", "--opt", "moe.launches=1")),
    "iree-t1-next": ("iree", "quant4,matmul4,densemm,cast,rope,norm,legalize,expand,kv,attention,topk,moe",
                     ("--dim", "seq_len=1", "--next-token")),
    "iree-t1-next-nomma": ("iree", "quant4,matmul4,densemm,cast,rope,norm,legalize,expand,kv,attention,topk,moe",
                           ("--dim", "seq_len=1", "--next-token", "--opt", "moe.tensor_cores=false")),
    "iree-t1-next-rope-apart": ("iree", "quant4,matmul4,densemm,cast,rope,norm,legalize,expand,kv,attention,topk,moe",
                             ("--dim", "seq_len=1", "--next-token", "--opt", "attention.rope=false")),
    "iree-t1-next-gate-apart": ("iree", "quant4,matmul4,densemm,cast,rope,norm,legalize,expand,kv,attention,topk,moe",
                                ("--dim", "seq_len=1", "--next-token", "--opt", "densemm.merge=false")),
    "iree-t1-noshared": ("iree", "quant4,matmul4,densemm,cast,rope,norm,legalize,expand,kv,attention,topk,moe",
                         ("--dim", "seq_len=1", "--opt", "moe.shared=false")),
    "iree-t1-norope": ("iree", "quant4,matmul4,densemm,cast,legalize,expand,kv,attention,topk,moe", ("--dim", "seq_len=1")),
    "iree-t1-noattn": ("iree", "quant4,matmul4,densemm,cast,legalize,expand,kv,topk,moe", ("--dim", "seq_len=1")),
    "iree-plain": ("iree", "quant4,cast,legalize,expand,kv", ()),
    "ort": ("ort", "quant4,cast,kv,topk,moe", ()),
}
REFERENCE_PLUGINS = "quant4"
#: the references' files: ONNX Runtime CPU on the quantized model, and on its float32 twin (``reference-fp32``)
REFERENCE_FILES = ("reference.json", "reference_logits.npy", "reference-fp32.json", "reference_fp32_logits.npy")
_ORT_TARGET = {"cuda": "cuda", "llvm-cpu": "cpu"}  #: the ort target beside an iree one
COMPILED_FILES = ("manifest.json", "params.json", "model.vmfb", "compile.log")


def _rewrite(*args: str) -> None:
    cmd = [sys.executable, "-c", "from rewrite.cli import main; main()", *args, "--quiet"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"rewrite {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    print(f"  rewrite {args[0]} {args[-1]}: {time.perf_counter() - t0:.0f} s", flush=True)


def prepare(arch: str, out: Path, work: Path, max_seq: int, reference: bool = False, *, layers: int | None = None,
            target: str = "cuda", configs: list[str] | None = None) -> None:
    """Export the full-size seed form into ``work/seed`` (unless there); with ``reference``, decode the reference
    tokens here (ONNX Runtime CPU: the weights are the same on any machine; ``reference.json`` in the bundle, which
    ``run`` then takes instead of decoding them); compile each IREE configuration of ``configs`` (default: all)
    in ``work/<name>``, copy what runs into the bundle ``out`` and delete the folder (a configuration already in
    the bundle is skipped)."""
    import seed_form

    seed = work / "seed" / "model.onnx"
    if not seed.exists():
        t0 = time.perf_counter()
        seed_form.export_seeded(arch, seed.parent, **_sizes(arch, max_seq, layers))
        print(f"  export {arch}: {time.perf_counter() - t0:.0f} s", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "seed").mkdir(exist_ok=True)
    shutil.copyfile(seed, out / "seed" / "model.onnx")
    (out / "bundle.json").write_text(json.dumps({"arch": arch, "max_seq": max_seq, "layers": layers, "target": target,
                                                "configs": CONFIGS}, indent=1) + "\n")
    if reference and not (out / "reference.json").exists():
        run(out, work, ["reference", "reference-fp32"], None)
        for f in REFERENCE_FILES:
            shutil.copyfile(work / "results" / f, out / f)
    for name in configs or [n for n, (backend, _, _) in CONFIGS.items() if backend == "iree"]:
        backend, plugins, more = CONFIGS[name]
        dst = out / name
        if backend != "iree" or (dst / "model.vmfb").exists():
            continue
        folder = work / name
        _rewrite("apply", str(seed), "--plugins", plugins, "--max-seq", str(max_seq), "--backend", "iree",
                 "--target", target, "--stateful", *more, "-o", str(folder))
        dst.mkdir(exist_ok=True)
        for f in COMPILED_FILES:
            shutil.copyfile(folder / f, dst / f)
        shutil.rmtree(folder)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {out} ({size / 2**20:.1f} MiB)")


def _sizes(arch: str, max_seq: int, layers: int | None) -> dict:
    """The seed form's full-size config of ``arch`` with ``max_seq`` cache positions (and ``layers`` decoder layers,
    a smaller model of the real layer shapes, when given)."""
    import seed_form

    return {**seed_form.FULL[arch], "max_seq": max_seq, **({"layers": layers} if layers else {})}


def decode_bytes(cfg, positions: int) -> dict[str, float]:
    """Bytes one decode token must read at ``positions`` cached positions, by part, for the seed form after
    ``quant4`` (dense weights INT4 block 128 with fp16 scales and 4-bit zero points; LM head, router and embedding
    in fp16, as quant4 leaves them): attention projections, shared expert, the ``top_k`` routed experts, router,
    LM head, one embedding row, and the K and V cache rows of every layer."""
    h, layers, item = cfg.hidden, cfg.layers, 2
    int4 = 0.5 + (item + 0.5) / cfg.block_size  # code + scale + zero point per weight
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    attention = layers * (h * q + 2 * h * kv + q * h) * int4
    shared = layers * (3 * h * cfg.shared_intermediate * int4 + h * item) if cfg.shared_intermediate else 0
    routed = layers * cfg.top_k * 3 * h * cfg.moe_intermediate * int4
    parts = {"attention": attention, "shared expert": shared, "routed experts": routed,
             "router": layers * cfg.experts * h * item, "lm head": cfg.vocab * h * item, "embedding": h * item,
             "kv cache": layers * 2 * kv * positions * item}
    parts["total"] = sum(parts.values())
    return parts


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + written) of a 1 GiB buffer, median of 20 CUDA-event timed
    copies."""
    import torch

    n = 1 << 30
    a, b = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(22):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n / float(np.median(times[2:]))


def _prefill(step, prompt: list[int], width: int | None) -> np.ndarray:
    """Logits of the prompt's last position: one call, or one call per token when the module takes ``width`` = 1."""
    if width == 1:
        for t in prompt:
            logits = step(np.array([[t]], np.int64))
        return logits
    return step(np.array([prompt], np.int64))


def _timed_generate(step, prompt: list[int], steps: int, width: int | None = None, decode=None,
                    prefill_token=None) -> dict:
    """Prefill ``prompt`` (:func:`_prefill`), then ``steps`` greedy one-token calls; ``step(ids [1, n]) ->
    logits [1, n, vocab]`` (host). Returns tokens, the last position's logits of each step and wall times.
    ``decode(token, count) -> tokens``: the decode calls made that way instead (``Generator.decode`` on the
    device: no logits come back, ``logits`` holds the prefill's only); ``prefill_token(prompt) -> token``: the
    prefill made that way (``Generator.prefill_token``: the prompt's calls queued on the device; no logits)."""
    t0 = time.perf_counter()
    if prefill_token is not None:
        tokens, last = [prefill_token(prompt)], []
    else:
        logits = _prefill(step, prompt, width)
        tokens, last = [greedy_token(logits[0, -1])], [logits[0, -1]]
    t1 = time.perf_counter()
    if decode is not None:
        tokens += decode(tokens[-1], steps - 1)
    else:
        for _ in range(steps - 1):
            logits = step(np.array([[tokens[-1]]], np.int64))
            tokens.append(greedy_token(logits[0, -1]))
            last.append(logits[0, -1])  # converted after the timing: a 152k-entry f16 -> f32 copy costs ~0.3 ms
    t2 = time.perf_counter()
    last = [row.astype(np.float32) for row in last]
    return {"tokens": tokens, "logits": np.stack(last) if last else None, "prefill_s": t1 - t0, "decode_s": t2 - t1,
            "prefill_tok_s": len(prompt) / (t1 - t0), "decode_tok_s": (steps - 1) / (t2 - t1)}


def compare_logits(step, prompt: list[int], ref_tokens: list[int], ref_logits: np.ndarray, width: int | None) -> dict:
    """Teacher-forced comparison with the reference: prefill ``prompt``, then feed the reference's tokens one per
    call (whatever this model would pick), and compare each step's last-position logits with ``ref_logits``
    ``[steps, vocab]``: ``max_rel`` (max abs difference over the reference's max abs logit), ``top1_equal`` (the
    same argmax) and the reference's own ``margin`` (its top-1 minus top-2 logit, over its max abs logit: how far
    from a tie the reference's choice was)."""
    logits = [_prefill(step, prompt, width)[0, -1]]
    for t in ref_tokens[:-1]:
        logits.append(step(np.array([[t]], np.int64))[0, -1])
    out = {"max_rel": [], "top1_equal": [], "margin": []}
    for got, ref in zip(logits, ref_logits):
        got, scale = got.astype(np.float32), float(np.abs(ref).max())
        top2 = np.sort(ref)[-2:]
        out["max_rel"].append(float(np.abs(got - ref).max() / scale))
        out["top1_equal"].append(bool(np.argmax(got) == np.argmax(ref)))
        out["margin"].append(float((top2[1] - top2[0]) / scale))
    return out


PROFILE_STEPS = 8


STEP_RANGE, ARGMAX_RANGE = "decode step", "argmax"  #: record_function ranges of :func:`kernel_profile`
#: kineto's activity types of GPU work: kernels, copies and memsets; not the record_function ranges CUPTI also puts
#: on the GPU's timeline (``gpu_user_annotation``: a step's whole span) nor CUPTI's own ``overhead`` records
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
#: CUPTI's overhead records by the names kineto gives them (its ``overheadKindString``), for a torch whose events
#: carry no activity type
CUPTI_OVERHEAD = ("Unknown", "Driver Compiler", "Buffer Flush", "Instrumentation", "Resource", "Runtime Triggered Module Loading",
                  "Lazy Function Loading", "Command Buffer Full", "Activity Buffer Request", "UVM Activity Init",
                  "Unrecognized")


def gpu_work(prof) -> list[tuple[str, int, int]]:
    """The GPU work a ``torch.profiler`` run recorded, as (name, start ns, end ns): the events of
    :data:`GPU_WORK` types with a duration. Where kineto names no event so (torch 2.11's ``_KinetoEvent`` has no
    ``activity_type``, or a torch that spells the types otherwise), every GPU event but the :data:`STEP_RANGE` and
    :data:`ARGMAX_RANGE` ranges and :data:`CUPTI_OVERHEAD`."""
    def activity(e) -> str | None:
        return e.activity_type() if hasattr(e, "activity_type") else None

    gpu = [e for e in prof.profiler.kineto_results.events()
           if "cuda" in str(e.device_type()).lower() and e.duration_ns() > 0]
    work = ([e for e in gpu if activity(e) in GPU_WORK]
            or [e for e in gpu if e.name() not in (STEP_RANGE, ARGMAX_RANGE, *CUPTI_OVERHEAD)])
    return [(e.name(), e.start_ns(), e.start_ns() + e.duration_ns()) for e in work]


def kernel_rows(prof, steps: int) -> list[dict]:
    """Per name of :func:`gpu_work`'s records: ``{"kernel", "us_per_token", "launches_per_token"}`` over ``steps``
    tokens (unsorted)."""
    per_kernel: dict[str, list[float]] = {}
    for name, start, end in gpu_work(prof):
        total = per_kernel.setdefault(name, [0.0, 0])
        total[0] += (end - start) / 1e3
        total[1] += 1
    return [{"kernel": name, "us_per_token": us / steps, "launches_per_token": n / steps}
            for name, (us, n) in per_kernel.items()]


def kernel_profile(step, token: int, steps: int = PROFILE_STEPS, decode=None) -> tuple[list[dict], dict]:
    """GPU time per decode token of each kernel, copy and memset that ``steps`` more one-token ``step`` calls
    launch, from CUPTI through ``torch.profiler`` (it sees every CUDA context of the process: IREE's and ONNX
    Runtime's kernels too; :func:`gpu_work`: not the ranges, not PyTorch's operators, whose device time is their
    kernels' again), largest first: ``{"kernel", "us_per_token", "launches_per_token"}``; and the timeline of those
    steps (:func:`timeline`, with the host's phases of :func:`host_phases` under ``"host"``). ``decode(token, count)``:
    the steps made by one such call instead (the device's loop: no per-step host phases). Both empty when the
    profiler fails."""
    try:
        from torch.profiler import ProfilerActivity, profile, record_function

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            if decode is not None:
                decode(token, steps)
            for _ in range(steps if decode is None else 0):
                with record_function(STEP_RANGE):
                    logits = step(np.array([[token]], np.int64))
                with record_function(ARGMAX_RANGE):
                    token = greedy_token(logits[0, -1])
            wall = time.perf_counter() - t0
        rows = kernel_rows(prof, steps)
    except Exception as e:  # a profiler that cannot attach must not cost the run's other numbers
        print(f"  profile failed: {type(e).__name__}: {e}", flush=True)
        return [], {}
    try:
        line = timeline(prof, steps, wall)
        line["host"] = host_phases(prof)
    except Exception as e:  # (kineto_results is torch.profiler's internal API)
        print(f"  timeline failed: {type(e).__name__}: {e}", flush=True)
        line = {}
    return sorted(rows, key=lambda r: -r["us_per_token"]), line


def host_phases(prof) -> dict:
    """Where the host's time of a profiled decode step goes (medians over the steps, us): ``step`` (the
    :data:`STEP_RANGE` call: inputs to the device, the module's invocation, the logits back), ``to_first_launch``
    (from the call's start to its first ``cuLaunchKernel``: argument conversion, queue allocations, the runtime's
    setup), ``launching`` (first to last launch call), ``after_launches`` (last launch call's end to the call's
    end: waiting for the GPU, the logits' copy), ``gpu_end_to_return`` (the step's last GPU activity's end to the
    call's end: the host's work once the GPU is done), ``argmax`` and ``between_steps`` (the loop's own time); and
    ``api``: each CUDA driver or runtime call the steps made, ``{name: [calls per step, us per step]}``, largest
    first (a synchronization there is the host waiting for the GPU)."""
    cpu, api, gpu_ends = {}, {}, [end for _, _, end in gpu_work(prof)]
    for e in prof.profiler.kineto_results.events():
        name, start, dur = e.name(), e.start_ns(), e.duration_ns()
        if "cuda" in str(e.device_type()).lower():
            continue
        if name in (STEP_RANGE, ARGMAX_RANGE):
            cpu.setdefault(name, []).append((start, start + dur))
        elif name.startswith("cu"):
            api.setdefault(name, []).append((start, dur))
    steps = sorted(cpu.get(STEP_RANGE, []))
    if not steps:
        return {}
    launches = sorted(s for n, calls in api.items() if n.startswith(("cuLaunchKernel", "cudaLaunchKernel")) for s, _ in calls)
    gpu_ends.sort()
    phases = {k: [] for k in ("step", "to_first_launch", "launching", "after_launches", "gpu_end_to_return", "between_steps")}
    for i, (s, e) in enumerate(steps):
        inside = [t for t in launches if s <= t <= e]
        phases["step"].append(e - s)
        if inside:
            phases["to_first_launch"].append(inside[0] - s)
            phases["launching"].append(inside[-1] - inside[0])
            phases["after_launches"].append(e - inside[-1])
        ends = [t for t in gpu_ends if s <= t <= e]
        if ends:
            phases["gpu_end_to_return"].append(e - ends[-1])
        if i + 1 < len(steps):
            phases["between_steps"].append(steps[i + 1][0] - e)
    out = {k: float(np.median(v)) / 1e3 for k, v in phases.items() if v}
    out["argmax"] = float(np.median([e - s for s, e in cpu.get(ARGMAX_RANGE, [(0, 0)])])) / 1e3
    n = len(steps)
    out["api"] = {k: [len(v) / n, sum(d for _, d in v) / 1e3 / n]
                  for k, v in sorted(api.items(), key=lambda kv: -sum(d for _, d in kv[1]))}
    return out


def timeline(prof, steps: int, wall_s: float) -> dict:
    """Where a profiled step's time goes, from the GPU work's start and end times (ns, CUPTI; :func:`gpu_work`): per
    token the wall time of the calls (``wall_us``, under the profiler), the time from the first activity's start
    to the last one's end (``span_us``), the time some activity ran (``busy_us``: the GPU is idle for span -
    busy), and the gaps between one activity's end and the next one's start (``gap_median_us``, ``gap_p90_us``). A busy
    time near the span means the GPU is the bound; gaps of microseconds between short kernels mean it waits for
    the host's launches. With the driver API calls in the trace: the median time inside one ``cuLaunchKernel``
    (``launch_api_us``) and the median time from one launch call's start to the next one's (``launch_interval_us``):
    the rest of the interval is the runtime's own work per launch (IREE's replay of the command buffer). Empty when
    the profiler gives no activity times."""
    spans = [(start, end) for _, start, end in gpu_work(prof)]
    launches = [(e.start_ns(), e.duration_ns()) for e in prof.profiler.kineto_results.events()
                if "cuda" not in str(e.device_type()).lower()
                and e.name().startswith(("cuLaunchKernel", "cudaLaunchKernel"))]
    if not spans:
        return {}
    spans.sort()
    busy, gaps, (cs, ce) = 0, [], spans[0]
    for s, e in spans[1:]:
        if s > ce:
            busy += ce - cs
            gaps.append(s - ce)
            cs, ce = s, e
        else:
            ce = max(ce, e)
    busy += ce - cs
    gaps = np.array(gaps or [0], np.float64) / 1e3
    line = {"wall_us": wall_s * 1e6 / steps, "span_us": (spans[-1][1] - spans[0][0]) / 1e3 / steps, "busy_us": busy / 1e3 / steps,
            "gap_median_us": float(np.median(gaps)), "gap_p90_us": float(np.percentile(gaps, 90))}
    if len(launches) > 1:
        launches.sort()
        starts = np.array([s for s, _ in launches], np.float64)
        line["launch_api_us"] = float(np.median([d for _, d in launches])) / 1e3
        line["launch_interval_us"] = float(np.median(np.diff(starts))) / 1e3
    return line


def _references(results: Path) -> dict[str, dict]:
    """The teacher-forced checks to make, ``{result key: {"tokens", "logits"}}``: ``check_logits`` against the
    reference (ONNX Runtime CPU on the quantized fp16 model) and ``check_logits_fp32`` against its float32 twin,
    each where ``results`` holds it."""
    out = {}
    for key, meta, logits in (("check_logits", "reference.json", "reference_logits.npy"),
                              ("check_logits_fp32", "reference-fp32.json", "reference_fp32_logits.npy")):
        if (results / logits).exists() and (results / meta).exists():  # (a run stopped between the two: neither)
            out[key] = {"tokens": json.loads((results / meta).read_text())["check_tokens"],
                        "logits": np.load(results / logits)}
    return out


def _reference_tokens(model: Path, prompt: list[int], logits_file: Path, low_memory: bool = False) -> tuple[dict, np.ndarray]:
    """ONNX Runtime CPU on ``model`` (``Generator.reference``): ``CHECK_TOKENS`` greedy tokens after ``prompt``, the
    result as ``run`` stores it and the logits of each step (also saved to ``logits_file``)."""
    from rewrite.generate import Generator

    res = _timed_generate(Generator.reference(model, low_memory=low_memory).step, prompt, CHECK_TOKENS)
    logits = res.pop("logits")
    np.save(logits_file, logits)
    res["check_tokens"] = res["tokens"]
    res["host"] = f"{platform.node()}, {os.cpu_count()} cores"
    return res, logits


def _reference_fp32(seed: Path, folder: Path, prompt: list[int], results: Path) -> dict:
    """The float32 reference: the reference's quantized model (``--plugins quant4``) with every fp16 tensor
    widened to float32 (:func:`rewrite.core.widen.widen_float16`: the same weights, without fp16's rounding of each
    intermediate) on ONNX Runtime CPU. Its greedy tokens after ``prompt`` and their logits
    (``reference_fp32_logits.npy`` in ``results``), and, where ``results`` holds the fp16 reference, that
    reference's own teacher-forced check against it (``check_logits_fp32``: how far ONNX Runtime CPU's fp16 is from
    the same model computed in float32, the fp16 model run as ``reference`` runs it). The twin's weights stay in
    their memory-mapped files (``low_memory``). ``folder`` may already hold the quantized model (``run`` keeps the
    reference's when this follows it)."""
    from rewrite.core.widen import widen_float16
    from rewrite.generate import Generator

    if not (folder / "model.onnx").exists():
        _rewrite("apply", str(seed), "--plugins", REFERENCE_PLUGINS, "--backend", "ort", "-o", str(folder))
    t0 = time.perf_counter()
    wide = widen_float16(folder / "model.onnx", folder / "model.fp32.onnx")  # beside it: the INT4 codes not copied
    print(f"  widened to float32: {time.perf_counter() - t0:.0f} s", flush=True)
    res, logits = _reference_tokens(wide, prompt, results / "reference_fp32_logits.npy", low_memory=True)
    for f in (wide, wide.with_name(wide.name + ".data")):
        f.unlink(missing_ok=True)
    if (results / "reference_logits.npy").exists():
        gen = Generator.reference(folder / "model.onnx")  # as the reference ran
        res["check_logits_fp32"] = compare_logits(gen.step, prompt, res["tokens"], logits, None)
    return res


def _measure(step, reset, prompt: list[int], profile: bool, references: dict[str, dict], width: int | None = None,
             decode=None, prefill_token=None) -> dict:
    """The token check (``CHECK_TOKENS`` after ``prompt[:CHECK_PROMPT]``; also the warm-up: first calls load
    kernels and allocate), the teacher-forced logits check against each of ``references`` (:func:`compare_logits`;
    ``{result key: {"tokens", "logits"}}``, :func:`_references`), the timed generation on ``prompt``, then the
    kernel profile; ``reset()`` before each.

    With ``decode`` (``Generator.decode`` of a folder that decodes on the device): the token check and the timed
    generation are made both ways, the host's argmax loop first (``host_loop_decode_tok_s``,
    ``host_loop_tokens_equal``), and the profile is of the device's loop."""
    check = _timed_generate(step, prompt[:CHECK_PROMPT], CHECK_TOKENS, width)
    compared = {}
    for key, ref in references.items():
        reset()
        compared[key] = compare_logits(step, prompt[:CHECK_PROMPT], ref["tokens"], ref["logits"], width)
    reset()
    res = _timed_generate(step, prompt, DECODE_STEPS, width)
    del res["logits"]
    if decode is not None:
        host = res
        try:
            reset()
            check_device = _timed_generate(step, prompt[:CHECK_PROMPT], CHECK_TOKENS, width, decode, prefill_token)
            reset()
            device = _timed_generate(step, prompt, DECODE_STEPS, width, decode, prefill_token)
        except Exception as e:  # the host loop's numbers stand; the error is the device loop's result
            print(f"  decode on the device failed: {type(e).__name__}: {e}", flush=True)
            res["device_loop_error"] = f"{type(e).__name__}: {e}"
            decode = None
            reset()
        else:
            res = device
            del res["logits"]
            res["host_loop_decode_tok_s"] = host["decode_tok_s"]
            res["host_loop_prefill_tok_s"] = host["prefill_tok_s"]
            res["host_loop_tokens_equal"] = host["tokens"] == res["tokens"] and check["tokens"] == check_device["tokens"]
            check = check_device
    res["check_tokens"] = check["tokens"]
    res.update(compared)
    if profile:
        res["profile"], res["timeline"] = kernel_profile(step, res["tokens"][-1], decode=decode)
    return res


def _measure_folder(folder: Path, prompt: list[int], references: dict[str, dict], profile: bool = True) -> dict:
    from rewrite.generate import Generator

    gen = Generator(folder, low_memory=False, device_decode=True)  # (on llvm-cpu too: both loops measured)
    return _measure(gen.step, gen.reset, prompt, profile, references, gen.fixed_width,
                    gen.decode if gen.decodes_on_device else None,
                    gen.prefill_token if gen.decodes_on_device else None)


def _measure_ort(folder: Path, prompt: list[int], references: dict[str, dict], device: str = "cuda") -> dict:
    """ONNX Runtime on the folder's model with the KV cache kept on ``device`` ("cuda": the CUDA execution provider;
    "cpu": the CPU one) between steps (IO binding)."""
    import onnxruntime as ort

    from rewrite.backends.base import Manifest
    from rewrite.backends.ort import PROVIDERS, ort_session

    m = Manifest.read(folder)
    iface = m.decoder_interface
    session = ort_session(folder / m.model, optimize=m.session.get("optimize", "all"), config=m.session.get("config"),
                          providers=PROVIDERS[device])
    specs = {i.name: i for i in session.get_inputs()}
    pairs = [(p.past, p.present) for p in iface.pairs]
    np_type = {"tensor(float16)": np.float16, "tensor(float)": np.float32}

    def fresh():
        return {p: ort.OrtValue.ortvalue_from_numpy(np.zeros(specs[p].shape, np_type[specs[p].type]), device, 0)
                for p, _ in pairs}

    state = {"past": fresh(), "position": 0}

    def step(ids: np.ndarray) -> np.ndarray:
        b = session.io_binding()
        b.bind_cpu_input(iface.input_ids, ids)
        b.bind_cpu_input(iface.seq_position, np.array([state["position"]], np.int64))
        for p, _ in pairs:
            b.bind_ortvalue_input(p, state["past"][p])
        b.bind_output(iface.logits, "cpu")
        for _, o in pairs:
            b.bind_output(o, device, 0)
        session.run_with_iobinding(b)
        outs = dict(zip([iface.logits] + [o for _, o in pairs], b.get_outputs()))  # in the order bound
        state["past"] = {p: outs[o] for p, o in pairs}
        state["position"] += ids.shape[1]
        return outs[iface.logits].numpy()

    return _measure(step, lambda: state.update(past=fresh(), position=0), prompt, device == "cuda", references)


def _measure_torch(arch: str, prompt: list[int], max_seq: int, layers: int | None) -> dict:
    """transformers' model of ``arch`` at the seed form's full configuration, random bf16 weights, eager, its
    default experts implementation and dynamic cache."""
    import torch
    import transformers

    import seed_form

    c = seed_form.seed_config("fp16", arch, **_sizes(arch, max_seq, layers))
    common = dict(hidden_size=c.hidden, num_hidden_layers=c.layers, num_attention_heads=c.heads,
                  num_key_value_heads=c.kv_heads, head_dim=c.head_dim, num_experts=c.experts,
                  num_experts_per_tok=c.top_k, moe_intermediate_size=c.moe_intermediate, vocab_size=c.vocab,
                  max_position_embeddings=max(max_seq, 4096), norm_topk_prob=c.norm_topk)
    if arch == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(shared_expert_intermediate_size=c.shared_intermediate,
                                             intermediate_size=c.shared_intermediate, **common)
        cls = transformers.Qwen2MoeForCausalLM
    else:
        config = transformers.Qwen3MoeConfig(intermediate_size=6144, **common)
        cls = transformers.Qwen3MoeForCausalLM
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 on the device: Qwen3-30B-A3B in fp32 would not fit
    with torch.device("cuda"):
        model = cls(config).eval()
    torch.set_default_dtype(torch.float32)
    cache = {}

    @torch.inference_mode()
    def step(ids: np.ndarray) -> np.ndarray:
        out = model(input_ids=torch.from_numpy(ids).cuda(), past_key_values=cache.get("pkv"), use_cache=True)
        cache["pkv"] = out.past_key_values
        return out.logits[:, -1:].float().cpu().numpy()

    res = _measure(step, cache.clear, prompt, True, {})
    res["transformers"] = transformers.__version__
    del model
    torch.cuda.empty_cache()
    return res


def run(bundle: Path, work: Path, configs: list[str], threads: int | None, iree_flags: list[str] = (),
        label: str | None = None, keep: bool = False, seed_dir: Path | None = None) -> int:
    """Measure ``configs`` (see the module's docstring). ``iree_flags``: IREE runtime flags parsed before the
    device is created (e.g. ``--cuda_use_streams=false``: command buffers as CUDA graphs); ``label``: results go
    to ``NAME.LABEL.json`` (the same configuration under other runtime flags); ``keep``: leave each IREE folder
    in ``work`` and reuse one already there instead of applying again (a second process measuring it);
    ``seed_dir``: where the seed form's weights are regenerated (default ``work/seed``), e.g. ``/dev/shm/seed``
    where the disk cannot hold them beside a folder's ``.irpa`` (Qwen3-30B-A3B without ``moe``: 32.8 GB each;
    the folder's ``model.onnx`` then reaches them through a symbolic link while its ``.irpa`` is written)."""
    import seed_form
    import seeded_weights

    if iree_flags:
        import iree.runtime as rt

        rt.flags.parse_flags(*iree_flags)

    if {"ort", "torch", "bandwidth"} & set(configs):
        import torch  # noqa: F401  (before onnxruntime: its CUDA execution provider loads torch's CUDA libraries)
    info = json.loads((bundle / "bundle.json").read_text())
    arch, max_seq, layers, target = info["arch"], info["max_seq"], info.get("layers"), info.get("target", "cuda")
    cfg = seed_form.seed_config("fp16", arch, **_sizes(arch, max_seq, layers))
    results = work / "results"
    results.mkdir(parents=True, exist_ok=True)
    seed = (seed_dir or work / "seed") / "model.onnx"
    if not (seed.parent / "model.onnx.data").exists():
        seed.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(bundle / "seed" / "model.onnx", seed)
        t0 = time.perf_counter()
        seeded_weights.regenerate(seed, threads=threads)
        print(f"  regenerated the seed form's weights: {time.perf_counter() - t0:.0f} s", flush=True)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab, PROMPT_LEN).tolist()
    for f in REFERENCE_FILES:  # computed by prepare --reference
        if (bundle / f).exists() and not (results / f).exists():
            shutil.copyfile(bundle / f, results / f)
    for name in configs:
        references = _references(results)
        out = results / (f"{name}.{label}.json" if label else f"{name}.json")
        if out.exists():
            continue
        t0 = time.perf_counter()
        folder = work / f"{name}.measured"  # (not work / name: prepare's compiled folder when both share work)
        reuse = keep and (folder / "manifest.json").exists()
        if not reuse:
            shutil.rmtree(folder, ignore_errors=True)
        if name == "reference":
            _rewrite("apply", str(seed), "--plugins", REFERENCE_PLUGINS, "--backend", "ort", "-o", str(folder))
            res = _reference_tokens(folder / "model.onnx", prompt[:CHECK_PROMPT], results / "reference_logits.npy")[0]
        elif name == "reference-fp32":
            shared = work / "reference.measured"  # the reference's quantized model, when kept for this
            if (shared / "model.onnx").exists() and not reuse:
                shutil.rmtree(folder, ignore_errors=True)
                shared.rename(folder)
            res = _reference_fp32(seed, folder, prompt[:CHECK_PROMPT], results)
        elif name == "torch":
            res = _measure_torch(arch, prompt, max_seq, layers)
        elif name == "bandwidth":
            res = {"copy_bytes_per_s": copy_bandwidth()}
        else:
            backend, plugins, more = CONFIGS[name]
            args = ["apply", str(seed), "--plugins", plugins, "--max-seq", str(max_seq), "--backend", backend,
                    "--target", target if backend == "iree" else _ORT_TARGET[target], *more]
            if backend == "iree":
                args += ["--stateful", "--module-from", str(bundle / name)]
            if not reuse:
                _rewrite(*args, "-o", str(folder))
            res = (_measure_ort(folder, prompt, references, _ORT_TARGET[target]) if backend == "ort"
                   else _measure_folder(folder, prompt, references, profile=target == "cuda"))
        widened_next = "reference-fp32" in configs and not (results / "reference-fp32.json").exists()
        if not keep and not (name == "reference" and widened_next):  # the float32 reference widens this folder
            shutil.rmtree(folder, ignore_errors=True)
        res["wall_s"] = time.perf_counter() - t0
        if iree_flags:
            res["iree_flags"] = list(iree_flags)
        out.write_text(json.dumps(res) + "\n")
        print(f"  {out.stem}: {json.dumps({k: v for k, v in res.items() if k not in ('tokens', 'profile', 'logits')})}", flush=True)
        for row in res.get("profile", [])[:12]:
            print(f"    {row['us_per_token']:9.1f} us/token {row['launches_per_token']:6.1f}x  {row['kernel'][:100]}")
    return report(work, cfg)


def _logits_summary(c: dict | None) -> tuple[str, bool]:
    """One line on a teacher-forced logits check (:func:`compare_logits`), and whether the logits are within
    ``verify``'s fp16 tolerance (:data:`rewrite.verify.REL_TOL`) at every step."""
    import onnx

    from rewrite.verify import REL_TOL

    if not c:
        return "", False
    tol = REL_TOL[onnx.TensorProto.FLOAT16]
    decisive = [eq for eq, rel, margin in zip(c["top1_equal"], c["max_rel"], c["margin"]) if margin > 2 * rel]
    ok = _worst(c) <= tol
    return (f"; teacher-forced logits: max rel. diff {_worst(c):.1e} ({'within' if ok else 'beyond'} "
            f"{tol:g}), top-1 equal {sum(c['top1_equal'])}/{len(c['top1_equal'])}, {len(decisive)} step(s) "
            f"decided by more than twice the difference, {sum(decisive)} of them equal"), ok


def _worst(c: dict) -> float:
    """The largest of a teacher-forced check's ``max_rel`` (:func:`compare_logits`), NaN counted as infinite (Python's
    max would pass over it)."""
    return float(np.max(np.nan_to_num(np.asarray(c["max_rel"], np.float64), nan=np.inf)))


def _first_difference(tokens: list[int], ref: list[int]) -> str:
    first = next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), None)
    return "tokens equal" if first is None else f"tokens differ from token {first}"


def report(work: Path, cfg) -> int:
    """Print the table of ``work/results``; exit status 1 when a configuration with the fusing plugins gives other
    tokens than the reference and its teacher-forced logits are not within the fp16 tolerance either (greedy tokens
    of a random-weight model can differ where its top two logits are closer than fp16 rounding). With the float32
    reference (``reference-fp32``) the second condition is instead: its logits are farther from the float32
    reference's than twice the fp16 reference's own distance from it, clamped to between the fp16 tolerance and
    five of them (``rewrite.verify.float32_bound``), i.e. less exact than ONNX Runtime CPU's fp16 by more than a
    factor of two."""
    import onnx

    from rewrite.verify import REL_TOL, float32_bound

    res = {p.stem: json.loads(p.read_text()) for p in (work / "results").glob("*.json")}
    ref = res.get("reference", {}).get("check_tokens")
    ref32 = res.get("reference-fp32", {})
    ref16_vs_32 = ref32.get("check_logits_fp32")
    bound32 = float32_bound(REL_TOL[onnx.TensorProto.FLOAT16], _worst(ref16_vs_32)) if ref16_vs_32 else None
    bw = res.get("bandwidth", {}).get("copy_bytes_per_s")
    nbytes = decode_bytes(cfg, PROMPT_LEN + DECODE_STEPS // 2)["total"]
    if bw:
        print(f"copy bandwidth {bw / 1e12:.2f} TB/s; {nbytes / 1e9:.2f} GB per decode token: speed of light "
              f"{bw / nbytes:.0f} tok/s")
    print(f"{'config':<16} {'prefill tok/s':>14} {'decode tok/s':>13} {'of light':>9} {'GPU us/token':>13} "
          f"{'launches':>9}  check against ONNX Runtime CPU")
    status = 0
    labeled = sorted(n for n in res if "." in n and n.split(".")[0] in CONFIGS)
    for name in (*CONFIGS, *labeled, "torch"):
        r = res.get(name)
        if r is None:
            continue
        light = f"{r['decode_tok_s'] * nbytes / bw:9.1%}" if bw else f"{'':9}"
        if name == "torch":
            check = "not compared (other weights)"
        elif ref is None:
            check = "no reference"
        else:
            logits, ok = _logits_summary(r.get("check_logits"))
            check = _first_difference(r["check_tokens"], ref) + logits
            c32 = r.get("check_logits_fp32")
            if c32 and bound32 is not None:
                ok = _worst(c32) <= bound32
                check += (f"; against float32: {_first_difference(r['check_tokens'], ref32['check_tokens'])}, "
                          f"max rel. diff {_worst(c32):.1e} ({'within' if ok else 'beyond'} {bound32:.1e}), "
                          f"top-1 equal {sum(c32['top1_equal'])}/{len(c32['top1_equal'])}")
            if check.startswith("tokens differ") and not ok and name != "iree-plain":
                status = 1
        prof = r.get("profile") or []
        gpu = f"{sum(k['us_per_token'] for k in prof):13.0f} {sum(k['launches_per_token'] for k in prof):9.0f}" if prof else f"{'':13} {'':9}"
        print(f"{name:<16} {r['prefill_tok_s']:14.0f} {r['decode_tok_s']:13.1f} {light} {gpu}  {check}")
    if ref16_vs_32:
        c = ref16_vs_32
        print(f"float32 reference (the quantized model widened, ONNX Runtime CPU): tokens {ref32['check_tokens']}; the "
              f"reference{' (' + _first_difference(ref, ref32['check_tokens']) + ')' if ref else ''} against it: max rel. "
              f"diff {_worst(c):.1e}, top-1 equal {sum(c['top1_equal'])}/{len(c['top1_equal'])}, its margins "
              + ", ".join(f"{m:.1e}" for m in c["margin"]))
    lines = [(n, r["timeline"]) for n, r in res.items() if r.get("timeline")]
    if lines:
        print("per profiled token (CUPTI activity times): wall, GPU span first start to last end, GPU busy, gaps between activities")
    for name, t in lines:
        print(f"  {name:<16} wall {t['wall_us']:7.0f} us  span {t['span_us']:7.0f} us  busy {t['busy_us']:7.0f} us  "
              f"gap median {t['gap_median_us']:5.1f} us, p90 {t['gap_p90_us']:5.1f} us"
              + (f"; host per launch {t['launch_interval_us']:.1f} us, {t['launch_api_us']:.1f} of it in cuLaunchKernel"
                 if "launch_api_us" in t else ""))
        h = t.get("host")
        if h:
            api = ", ".join(f"{k} {c:.0f}x {us:.0f} us" for k, (c, us) in list(h["api"].items())[:6])
            print(f"  {'':<16} host: step {h['step']:.0f} us = {h.get('to_first_launch', 0):.0f} to the first launch + "
                  f"{h.get('launching', 0):.0f} launching + {h.get('after_launches', 0):.0f} after (GPU end to return "
                  f"{h.get('gpu_end_to_return', 0):.0f}); argmax {h['argmax']:.0f}, between steps "
                  f"{h.get('between_steps', 0):.0f}; driver calls per step: {api}")
    for name, r in res.items():
        if "host_loop_decode_tok_s" in r:
            print(f"decode {name}: {r['decode_tok_s']:.1f} tok/s on the device, {r['host_loop_decode_tok_s']:.1f} with the "
                  f"host's argmax per step on the same folder ({r['decode_tok_s'] / r['host_loop_decode_tok_s']:.2f}x); "
                  f"tokens {'equal' if r['host_loop_tokens_equal'] else 'DIFFER'}; prefill {r['prefill_tok_s']:.1f} "
                  f"tok/s queued on the device, {r.get('host_loop_prefill_tok_s', float('nan')):.1f} call by call")
    others = [n for n in ("iree-plain", "ort", "torch") if n in res]
    for name in (n for n in CONFIGS if n in res and n.startswith("iree") and n != "iree-plain"):
        if others:
            ratios = ", ".join(f"{res[name]['decode_tok_s'] / res[o]['decode_tok_s']:.1f}x {o}" for o in others)
            print(f"decode {name}: {ratios} (the results in {work / 'results'})")
    return status


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="here: export the full-size seed form, compile the IREE folders, write the bundle")
    p.add_argument("--arch", choices=("qwen2_moe", "qwen3_moe"), default="qwen2_moe")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=None, help="where the seed form and compiled folders go (default OUT.work)")
    p.add_argument("--max-seq", type=int, default=MAX_SEQ)
    p.add_argument("--reference", action="store_true",
                   help="also decode the reference tokens here (ONNX Runtime CPU, fp16 and the float32 twin)")
    p.add_argument("--layers", type=int, default=None, help="this many decoder layers of the real shapes (a smaller model)")
    p.add_argument("--configs", default=None, help="comma list of the IREE configurations to compile (default: all)")
    p.add_argument("--target", choices=("cuda", "llvm-cpu"), default="cuda",
                   help="llvm-cpu: the same steps on this machine's CPU (a check of the flow, no GPU numbers)")
    r = sub.add_parser("run", help="on the GPU machine: regenerate the weights, apply, measure")
    r.add_argument("bundle", type=Path)
    r.add_argument("--work", type=Path, required=True)
    r.add_argument("--iree-flags", default="", help="IREE runtime flags, space-separated (e.g. --cuda_use_streams=false)")
    r.add_argument("--label", default=None, help="results as NAME.LABEL (a configuration under other --iree-flags)")
    r.add_argument("--keep", action="store_true", help="keep the applied IREE folders in --work and reuse them")
    r.add_argument("--configs", default="bandwidth,reference,iree,ort,torch,iree-plain",
                   help="comma list of bandwidth, reference, reference-fp32, the IREE configurations, ort, torch "
                        "(bandwidth, reference, iree, ort, torch, iree-plain by default)")
    r.add_argument("--threads", type=int, default=None, help="threads regenerating the weights (default: every core)")
    r.add_argument("--seed-dir", type=Path, default=None,
                   help="where the seed form's weights are regenerated (default WORK/seed; e.g. /dev/shm/seed)")
    args = ap.parse_args()
    if args.cmd == "prepare":
        prepare(args.arch, args.out, args.work or args.out.with_suffix(".work"), args.max_seq, args.reference,
                layers=args.layers, target=args.target, configs=args.configs.split(",") if args.configs else None)
        return 0
    return run(args.bundle, args.work, args.configs.split(","), args.threads, args.iree_flags.split(), args.label,
               args.keep, args.seed_dir)


if __name__ == "__main__":
    sys.exit(main())
