"""The GPU check: greedy tokens of CUDA output folders against ONNX Runtime CPU on the original export.

Two steps, because the GPU machine has no IREE compiler and no package registry:

    python examples/gpu_check.py prepare --out gpu_bundle     # here: export, apply, reference tokens
    python examples/gpu_check.py run gpu_bundle               # on the GPU machine: decode, compare

``prepare`` exports the tiny Qwen1.5-MoE and Qwen3-MoE decoders (transformers' exporter, fp32 and fp16), lowers
each with every plugin set of :data:`CONFIGS` for ``--backend iree --target cuda`` and ``--backend ort --target
cuda`` (``--families mixtral,olmoe,...`` adds the coverage matrix's tiny models of those families,
``examples/moe_families.py``, transformers' exporter, ``batched_mm`` experts, with :data:`FAMILY_CONFIGS`), and
records the tokens ONNX Runtime CPU decodes greedily on the original export (``PROMPT``, ``STEPS`` new tokens; for
plugin sets with the lossy ``quant4``, on the quantized model) in ``bundle.json``; and the seed's tiny static-cache
form of both compiled as the full-size decode is (:data:`STATEFUL_CONFIGS`). It also
lowers single ops for CUDA with inputs and reference outputs beside them: the router in each mode of
:data:`ROUTER_MODES` for ``iree`` (the topk plugin's CUDA build of its C kernel) and FusedMoE (:data:`MOE_SAMPLES`)
for ``ort`` (QMoE and MoE) and ``iree`` (the moe plugin's CUDA kernels), and the conformance kit's samples of the
ops with CUDA kernels of their own (:func:`_op_samples`). A configuration that cannot be lowered
is recorded with its error. ``--lowerings MODULE`` registers more lowerings first (``rewrite_cuda_router.lowering``:
the PTX kernel of ``examples/cuda_router_lowering`` in place of the built-in one for the modes it takes).

``run`` needs only the runtimes (``iree-base-runtime``; ``onnxruntime-gpu`` for the ``ort`` rows, whose CUDA
execution provider loads after ``import torch``) and prints one line per (model, dtype, backend, plugins):
``ok`` when every token equals the reference, else the first step that differs; exit status 1 when a row that
was expected to pass does not. Rows are expected to pass except plain IREE without ``topk`` (IREE's own TopK
picks wrong experts inside these models: reported, not hidden).
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import sys
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

PROMPT = [11, 22, 33, 44, 55]
STEPS = 16
MODELS = ("qwen2_moe", "qwen3_moe")
DTYPES = ("fp32", "fp16")
#: (backend, plugins, expected to give the reference tokens)
CONFIGS = (
    ("iree", "cast,legalize,expand,kv", False),  # IREE's own TopK: wrong experts (issue seen on llvm-cpu too)
    ("iree", "cast,legalize,expand,kv,topk", True),
    ("ort", "cast,kv,topk", True),
    ("ort", "cast,kv,topk,moe", True),
    ("iree", "cast,legalize,expand,kv,topk,moe", True),  # FusedMoE: the moe plugin's CUDA kernels
    ("iree", "quant4,cast,legalize,expand,kv,topk,moe", True),  # INT4 experts: against the quantized model
    ("ort", "quant4,cast,kv,topk,moe", True),  # QMoE (fp16) / dequantized MoE (fp32): against the quantized model
    # dense INT4 too: matmul4's CUDA kernels, merged q/k/v with their biases, gate/up with their SwiGLU, o with its
    # residual add
    ("iree", "quant4,matmul4,cast,legalize,expand,kv,topk,moe", True),
    ("ort", "quant4,matmul4,cast,kv,topk,moe", True),
    # the attention core as one op: the attention plugin's CUDA kernel (ONNX Runtime gets the decomposition back)
    ("iree", "cast,legalize,expand,kv,attention,topk,moe", True),
    ("iree", "quant4,matmul4,cast,legalize,expand,kv,attention,topk,moe", True),
    ("ort", "cast,kv,attention,topk,moe", True),
    # RoPE (with Qwen3's q/k norms) and the other RMSNorms as one op each: the rope and norm plugins' CUDA kernels
    ("iree", "cast,rope,norm,legalize,expand,kv,attention,topk,moe", True),
    # and the norms before a product in its kernel's prologue (matmul4's and densemm's rms-norm-prologue): the
    # plugins the full-size decode runs with
    ("iree", "quant4,matmul4,densemm,cast,rope,norm,legalize,expand,kv,attention,topk,moe", True),
    ("ort", "cast,rope,norm,kv,attention,topk,moe", True),
)
#: plugin sets also checked on the seed's static-cache form (``examples/seed_form.py``, tiny) compiled as the
#: full-size decode is: a stateful module of one token per call (``--stateful --dim seq_len=1``: the KV cache in
#: module state, its row writes as state-rows dispatches), against ONNX Runtime CPU on the seed form:
#: (backend, plugins, expected to give the reference tokens, --next-token: decoded on the device)
STATEFUL_CONFIGS = (
    ("iree", "cast,rope,norm,legalize,expand,kv,attention,topk,moe", True, False),
    ("iree", "quant4,matmul4,densemm,cast,rope,norm,legalize,expand,kv,attention,topk,moe", True, False),
    # and with --next-token, decoded on the device as the full-size runs decode (the prompt's calls queued too)
    ("iree", "quant4,matmul4,densemm,cast,rope,norm,legalize,expand,kv,attention,topk,moe", True, True),
)
#: plugin sets for the other families (``--families``): the coverage matrix's ``topk,moe`` with a static KV cache
FAMILY_CONFIGS = (
    ("iree", "cast,legalize,expand,kv", False),
    ("iree", "cast,legalize,expand,kv,topk,moe", True),
    ("ort", "cast,kv,topk,moe", True),
)


def _export(family: str, dtype: str, out_dir: Path) -> tuple[Path, tuple]:
    """The tiny ``family`` decoder exported by transformers' exporter, and the plugin sets it is checked with."""
    import torch

    import moe_families
    import qwen_moe

    torch_dtype = torch.float16 if dtype == "fp16" else torch.float32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if family in MODELS:
            return qwen_moe.export_hf(qwen_moe.build_model(family, "tiny", dtype=torch_dtype), out_dir), CONFIGS
        return moe_families.export(moe_families.build(family, dtype=torch_dtype), "hf", out_dir), FAMILY_CONFIGS


def prepare(out: Path, lowerings: list[str], families: tuple[str, ...] = MODELS, dtypes: tuple[str, ...] = DTYPES,
            only_with: str | None = None) -> None:
    """Export, lower and record the reference tokens (module docstring). ``only_with``: comma-separated plugins;
    only the plugin sets that include one of them, and of the single-op rows only those plugins' op samples (a
    bundle to check some plugins with)."""
    from rewrite.errors import RewriteError
    from rewrite.generate import Generator
    from rewrite.pipeline import apply
    from rewrite.testing.conformance import registered_lowerings

    extra = [low for name in lowerings for low in importlib.import_module(name).rewrite_lowerings()]
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with registered_lowerings(extra):
        for arch in families:
            for dtype in dtypes:
                src, configs = _export(arch, dtype, out / f"{arch}_{dtype}_src")
                ref = Generator.reference(src).generate(PROMPT, STEPS).tokens
                # lossy plugins are checked against the model they make, run on ONNX Runtime CPU
                ref_q4 = None
                if any(plugins.startswith("quant4") for _, plugins, _ in configs):
                    apply(src, out / f"{arch}_{dtype}_quant4_src", plugins="quant4", backend="ort")
                    ref_q4 = Generator.reference(out / f"{arch}_{dtype}_quant4_src" / "model.onnx").generate(PROMPT, STEPS).tokens
                for backend, plugins, expected in configs:
                    if only_with and not set(only_with.split(",")) & set(plugins.split(",")):
                        continue
                    name = f"{arch}_{dtype}_{backend}_{plugins.replace(',', '-')}"
                    row = dict(model=arch, dtype=dtype, backend=backend, target="cuda", plugins=plugins, folder=name,
                               reference=ref_q4 if plugins.startswith("quant4") else ref, expected=expected, error=None)
                    try:
                        try:
                            apply(src, out / name, plugins=plugins, backend=backend, target="cuda", options={"kv": {"max_seq": 64}})
                        except RewriteError as e:
                            if not (str(e).startswith("plugin 'kv'") and configs is FAMILY_CONFIGS):
                                raise
                            # a cache kv cannot make static (a sliding-window cache trimmed by a Slice): the dynamic one
                            row["plugins"] = plugins = ",".join(p for p in plugins.split(",") if p != "kv")
                            apply(src, out / name, plugins=plugins, backend=backend, target="cuda")
                    except RewriteError as e:
                        row["error"] = str(e)
                    rows.append(row)
                    print(f"prepared {name}: {row['error'] or 'ok'}", flush=True)
                if arch in MODELS:
                    rows += _stateful_rows(out, arch, dtype, only_with)
        for mode in ROUTER_MODES if not only_with else ():  # the router alone: the iree:cuda kernel against its reference
            name = f"router_{mode}_iree"
            row = dict(model=f"router-{mode}", dtype="fp32", backend="iree", target="cuda", plugins="topk", folder=name,
                       reference=None, expected=True, error=None)
            try:
                apply(_router_model(out / f"{name}.onnx", mode), out / name, plugins="topk", backend="iree", target="cuda")
            except RewriteError as e:
                row["error"] = str(e)
            (out / f"{name}.onnx").unlink()
            rows.append(row)
            print(f"prepared {name}: {row['error'] or 'ok'}", flush=True)
        moe_samples = MOE_SAMPLES.items() if not only_with or "moe" in only_with.split(",") else ()
        for (name, sample), backend in itertools.product(moe_samples, ("ort", "iree")):
            folder = f"moe_{name}_{backend}"  # FusedMoE alone, lowered for CUDA, against its reference
            row = dict(model=f"moe-{name}", dtype=str(np.dtype(sample["dtype"])), backend=backend, target="cuda",
                       plugins="-", folder=folder, reference=None, expected=True, error=None)
            try:
                _moe_op_folder(out / folder, sample, backend)
            except RewriteError as e:
                row["error"] = str(e)
            rows.append(row)
            print(f"prepared {folder}: {row['error'] or 'ok'}", flush=True)
        for plugin, op in _op_samples():  # the conformance kit's samples of ops with CUDA kernels, lowered for iree cuda
            if only_with and plugin not in only_with.split(","):
                continue
            rows += _op_sample_rows(out, op)
    (out / "bundle.json").write_text(json.dumps({"prompt": PROMPT, "steps": STEPS, "rows": rows}, indent=1) + "\n")


def _op_samples() -> tuple:
    """(plugin, abstract op) whose ``sample_inputs`` are checked one op at a time on IREE cuda."""
    from rewrite.plugins.attention.op import GroupedAttention
    from rewrite.plugins.densemm.op import DenseMatMul
    from rewrite.plugins.matmul4.op import MatMulInt4
    from rewrite.plugins.rmsnorm.op import RMSNorm
    from rewrite.plugins.rope.op import RotaryEmbedding

    return (("attention", GroupedAttention()), ("rope", RotaryEmbedding()), ("norm", RMSNorm()), ("matmul4", MatMulInt4()),
            ("densemm", DenseMatMul()))


def _op_sample_rows(out: Path, op) -> list[dict]:
    """One row per ``op.sample_inputs`` sample: a one-node model lowered with ``apply --backend iree --target
    cuda`` into ``op_<type>_<k>``, its inputs and the reference's outputs in ``cases.npz`` (a sample the CUDA
    lowering refuses, such as attention's ``nan_rows_zero``, is recorded with its error, not expected)."""
    import onnx

    from rewrite.errors import RewriteError
    from rewrite.pipeline import apply
    from rewrite.testing.conformance import single_op_model

    rows = []
    for k, (attrs, inputs) in enumerate(op.sample_inputs(np.random.default_rng(0))):
        inputs = [None if x is None else np.asarray(x) for x in inputs]
        want = [np.asarray(r) for r in op.reference(attrs, *inputs)]
        folder = out / f"op_{op.op_type}_{k}"
        row = dict(model=f"op-{op.op_type}-{k}", dtype=str(inputs[0].dtype), backend="iree", target="cuda", plugins="-",
                   folder=folder.name, reference=None, expected=not attrs.get("nan_rows_zero"), error=None)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            src = folder.with_suffix(".onnx")
            onnx.save(single_op_model(op, attrs, inputs, want), src)
            apply(src, folder, backend="iree", target="cuda")
            src.unlink()
            np.savez(folder / "cases.npz", **{f"in{i}": x for i, x in enumerate(inputs) if x is not None},
                     **{f"want{i}": w for i, w in enumerate(want)})
        except RewriteError as e:
            row["error"] = str(e)
        rows.append(row)
        print(f"prepared {folder.name}: {row['error'] or 'ok'}", flush=True)
    return rows


def _check_op(folder: Path) -> str | None:
    """None when the folder's one-op model gives the reference's outputs (``rewrite.verify.compare``: the
    tolerance of the output's dtype)."""
    from rewrite.backends import load_runner
    from rewrite.verify import compare

    runner = load_runner(folder)
    cases = np.load(folder / "cases.npz")
    got = runner.run({n: cases[n] for n in cases.files if n.startswith("in") and n in runner.input_names})
    for name in (n for n in cases.files if n.startswith("want")):
        c = compare(name, got["out" + name[4:]], cases[name])
        if not c.ok:
            return c.line()
    return None


ROUTER_MODES = ("softmax_topk", "topk_softmax", "grouped", "sparsemixer")
ROUTER_E, ROUTER_K = 60, 4  #: Qwen1.5-MoE-A2.7B's router: 60 experts, top-4


def _router_model(path: Path, mode: str) -> Path:
    """softmax_topk: TopK(Softmax(logits), 4) renormalized; topk_softmax: Softmax(TopK(logits, 4)); grouped:
    DeepSeek-V3's router; sparsemixer: PhiMoE's (the topk plugin's case models)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if mode in ("grouped", "sparsemixer"):
        from rewrite.plugins.router.grouped import grouped_router_model
        from rewrite.plugins.router.sparsemixer import sparsemixer_router_model

        onnx.save(grouped_router_model(e=64, k=8, n_group=8, topk_group=4) if mode == "grouped" else sparsemixer_router_model(), path)
        return path

    k = numpy_helper.from_array(np.array([ROUTER_K], np.int64), "k")
    if mode == "softmax_topk":
        nodes = [helper.make_node("Softmax", ["logits"], ["p"], axis=-1), helper.make_node("TopK", ["p", "k"], ["v", "ids"], axis=-1),
                 helper.make_node("ReduceSum", ["v", "axes"], ["s"], keepdims=1), helper.make_node("Div", ["v", "s"], ["w"])]
        inits = [k, numpy_helper.from_array(np.array([-1], np.int64), "axes")]
    else:
        nodes = [helper.make_node("TopK", ["logits", "k"], ["v", "ids"], axis=-1), helper.make_node("Softmax", ["v"], ["w"], axis=-1)]
        inits = [k]
    g = helper.make_graph(nodes, "router", [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["T", ROUTER_E])],
                          [helper.make_tensor_value_info("w", TensorProto.FLOAT, ["T", ROUTER_K]),
                           helper.make_tensor_value_info("ids", TensorProto.INT64, ["T", ROUTER_K])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    onnx.save(m, path)
    return path


#: FusedMoE samples for ort:cuda: (E, k, H, I), block size (0: float experts), zero points, mode, normalize,
#: gpt-oss's activation and biases. QMoE's CUDA paths: asymmetric grouped GEMM, the symmetric GEMV fast path
#: (fp16, N and K >= 512, T*k <= 8: seed 003 section 4), routed weights; fp32 INT4 lowers to dequantized MoE.
MOE_SAMPLES = {
    "int4-asym-qwen15": dict(dtype=np.float16, dims=(8, 4, 256, 128), bs=64, zp=True, mode="softmax_topk", normalize=0),
    "int4-asym-bs128": dict(dtype=np.float16, dims=(8, 2, 256, 128), bs=128, zp=True, mode="softmax_topk", normalize=1),
    "int4-sym-gemv": dict(dtype=np.float16, dims=(4, 2, 512, 512), bs=128, zp=False, mode="topk_softmax", normalize=1),
    "int4-routed": dict(dtype=np.float16, dims=(8, 2, 256, 128), bs=64, zp=True, mode="routed", normalize=1),
    "int4-gptoss": dict(dtype=np.float16, dims=(8, 2, 256, 128), bs=64, zp=False, mode="topk_softmax", normalize=1,
                        gptoss=True),
    "int4-addend": dict(dtype=np.float16, dims=(8, 2, 256, 128), bs=128, zp=True, mode="softmax_topk", normalize=1, addend=True),
    "int4-f32": dict(dtype=np.float32, dims=(8, 2, 256, 128), bs=64, zp=True, mode="softmax_topk", normalize=1),
    "int4-long-block": dict(dtype=np.float16, dims=(8, 4, 128, 64), bs=128, zp=True, mode="softmax_topk", normalize=0),
    "float-f16": dict(dtype=np.float16, dims=(8, 2, 256, 128), bs=0, zp=False, mode="softmax_topk", normalize=0),
    # the layer width of Qwen1.5-MoE (H=2048: two 16-byte loads per lane and row), I with a partial last block
    "int4-wide": dict(dtype=np.float16, dims=(4, 2, 2048, 704), bs=128, zp=True, mode="softmax_topk", normalize=0),
    # Qwen1.5-MoE-A2.7B's expert layer (I=1408: 11 blocks of 128, which QMoE on CUDA takes as 22 of 64)
    "int4-qwen15-layer": dict(dtype=np.float16, dims=(4, 2, 2048, 1408), bs=128, zp=True, mode="softmax_topk", normalize=0),
    # f16, blocks of 128: IREE takes the tensor-core pair (lowering.cuda_mma_steps): routed at the smallest steps
    # (H = 1024, k * I = 256: most warps of down without a block) with gpt-oss's biases and clamp; routed with
    # Qwen3-30B-A3B's k = 8 and I = 768 (down's 6 steps a warp, as in the full model) and the residual as addend;
    # routing from the logits in gate_up's warp 0 (Qwen1.5-MoE's softmax then top-4, not normalized)
    "int4-gptoss-mma": dict(dtype=np.float16, dims=(8, 2, 1024, 128), bs=128, zp=False, mode="routed", normalize=1,
                            gptoss=True),
    "int4-k8-mma": dict(dtype=np.float16, dims=(8, 8, 1024, 768), bs=128, zp=True, mode="routed", normalize=1,
                        addend=True),
    "int4-softmax-mma": dict(dtype=np.float16, dims=(16, 4, 1024, 256), bs=128, zp=True, mode="softmax_topk",
                             normalize=0),
    # the largest steps of each kernel: gate_up's 4 (H = 4096), down's 8 (k * I = 7168)
    "int4-h4096-mma": dict(dtype=np.float16, dims=(4, 2, 4096, 128), bs=128, zp=True, mode="softmax_topk", normalize=1),
    "int4-k8i896-mma": dict(dtype=np.float16, dims=(8, 8, 1024, 896), bs=128, zp=False, mode="topk_softmax",
                            normalize=1),
}
MOE_TOKENS = (1, 3, 8)  #: token counts each sample runs (decode, ragged, a prefill chunk)


def _moe_op_folder(folder: Path, sample: dict, backend: str) -> None:
    """One FusedMoE over graph inputs hidden [T, H] and scores [T, E] (``routed``: Softmax/TopK in the graph
    make the weights and ids), lowered with ``apply --backend <backend> --target cuda``; ``cases.npz`` holds
    the inputs and the reference outputs for :data:`MOE_TOKENS`."""
    import onnx
    from onnx import helper, numpy_helper

    from rewrite.core.abstract_ops import DOMAIN
    from rewrite.core.int4 import pack_int4
    from rewrite.pipeline import apply
    from rewrite.plugins.moe.lowering import FusedMoE

    rng = np.random.default_rng(0)
    dt, (e, k, h, i), bs = sample["dtype"], sample["dims"], sample["bs"]
    attrs = dict(k=k, normalize=sample["normalize"], mode=sample["mode"], activation="swiglu")
    if sample.get("gptoss"):
        attrs.update(activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0)
    w = dict(fc1=None, fc2=None, s1=None, z1=None, s2=None, z2=None, ids=None, b1=None, b2=None)
    if bs:
        attrs["block_size"] = bs
        w["fc1"], w["fc2"] = pack_int4(rng.integers(0, 16, (e, 2 * i, h))), pack_int4(rng.integers(0, 16, (e, h, i)))
        w["s1"] = (rng.uniform(0.5, 1.5, (e, 2 * i, -(-h // bs))) * 0.02).astype(dt)
        w["s2"] = (rng.uniform(0.5, 1.5, (e, h, -(-i // bs))) * 0.02).astype(dt)
        if sample["zp"]:
            w["z1"] = rng.integers(0, 16, w["s1"].shape).astype(np.uint8)
            w["z2"] = rng.integers(0, 16, w["s2"].shape).astype(np.uint8)
    else:
        w["fc1"], w["fc2"] = ((rng.standard_normal(s) * 0.05).astype(dt) for s in ((e, 2 * i, h), (e, h, i)))
    if sample.get("gptoss"):
        w["b1"], w["b2"] = (rng.standard_normal((e, 2 * i)) * 0.1).astype(dt), (rng.standard_normal((e, h)) * 0.1).astype(dt)
    ins = ["hidden", "scores"] + [n if v is not None else "" for n, v in w.items()]
    inits = [numpy_helper.from_array(v, n) for n, v in w.items() if v is not None]
    nodes = []
    if sample["mode"] == "routed":
        inits.append(numpy_helper.from_array(np.array([k], np.int64), "k"))
        nodes += [helper.make_node("Softmax", ["scores"], ["p"], axis=-1), helper.make_node("TopK", ["p", "k"], ["rw", "ids"], axis=-1)]
        ins[1], ins[8] = "rw", "ids"
    if sample.get("addend"):  # input 11: the residual sum after the block (moe_down adds it in place)
        ins += [""] * (11 - len(ins)) + ["res"]
    while not ins[-1]:
        ins.pop()
    nodes.append(helper.make_node("FusedMoE", ins, ["y"], domain=DOMAIN, name="moe", **attrs))
    tdt = helper.np_dtype_to_tensor_dtype(np.dtype(dt))
    graph_ins = [helper.make_tensor_value_info("hidden", tdt, ["T", h]), helper.make_tensor_value_info("scores", tdt, ["T", e])]
    if sample.get("addend"):
        graph_ins.append(helper.make_tensor_value_info("res", tdt, ["T", h]))
    g = helper.make_graph(nodes, "moe", graph_ins, [helper.make_tensor_value_info("y", tdt, ["T", h])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)])
    m.ir_version = 10
    src = folder.with_suffix(".onnx")
    onnx.save(m, src)
    apply(src, folder, backend=backend, target="cuda")
    src.unlink()
    cases = {}
    for t in MOE_TOKENS:
        x = rng.standard_normal((t, h)).astype(dt)
        scores = (0.25 * rng.permuted(np.broadcast_to(np.arange(e, dtype=np.float64), (t, e)), axis=-1) - 0.5).astype(dt)
        logits, ids = scores, None
        if sample["mode"] == "routed":  # the graph's own Softmax/TopK, as ONNX Runtime computes them
            p = np.exp(scores.astype(np.float32) - scores.astype(np.float32).max(-1, keepdims=True))
            p = (p / p.sum(-1, keepdims=True)).astype(dt)
            ids = np.argsort(-p.astype(np.float32), axis=-1, kind="stable")[:, :k].astype(np.int64)
            logits = np.take_along_axis(p, ids, -1)
        ws = [w[n] if n != "ids" else ids for n in w]
        cases[f"hidden_{t}"], cases[f"scores_{t}"] = x, scores
        res = None
        if sample.get("addend"):
            res = cases[f"res_{t}"] = rng.standard_normal((t, h)).astype(dt)
        cases[f"want_{t}"] = FusedMoE().reference(attrs, x, logits, *ws, res)[0]
    np.savez(folder / "cases.npz", **cases)


def _check_moe(folder: Path) -> str | None:
    """None when the folder's FusedMoE lowering equals the reference for every token count (float32 rel. 1e-4,
    float16 1e-2 of the output's largest magnitude)."""
    from rewrite.backends import load_runner

    runner = load_runner(folder)
    cases = np.load(folder / "cases.npz")
    for t in MOE_TOKENS:
        f32 = cases[f"want_{t}"].dtype == np.float32
        want = cases[f"want_{t}"].astype(np.float64)
        feeds = {"hidden": cases[f"hidden_{t}"], "scores": cases[f"scores_{t}"]}
        if f"res_{t}" in cases:
            feeds["res"] = cases[f"res_{t}"]
        got = runner.run(feeds)["y"]
        err = float(np.abs(got.astype(np.float64) - want).max() / max(1.0, np.abs(want).max()))
        if err > (1e-4 if f32 else 1e-2):
            return f"{t} tokens: rel. error {err:.2e}"
    return None


def _check_router(folder: Path, mode: str) -> str | None:
    """None when the folder's router equals the reference (``MoERouterTopK.reference`` with the attributes of the
    op in the folder's ``model.onnx``) on random logits of 1, 7, 65 and 300 tokens, the odd counts with experts near
    each other: the same ids, weights within 1e-5."""
    from onnx import TensorProto

    from rewrite.backends import load_runner
    from rewrite.core import onnx_io
    from rewrite.core.abstract_ops import DOMAIN
    from rewrite.plugins.router import op

    runner = load_runner(folder)
    g = onnx_io.load(folder / "model.onnx")
    (node,) = g.nodes_by_op("MoERouterTopK", DOMAIN)
    attrs = {a: node.attr(a) for a in node.attrs}
    bias = g.const(node.inputs[1]) if len(node.inputs) > 1 else None
    xv = g.values[node.inputs[0]]
    dtype, e = (np.float16 if xv.dtype == TensorProto.FLOAT16 else np.float32), xv.shape[-1]
    w_name, i_name = runner.output_names[:2]
    for t in (1, 7, 65, 300):
        rng = np.random.default_rng(t)
        x = op._near_max(rng, (t, e), dtype) if t % 2 else rng.standard_normal((t, e)).astype(dtype)
        got = runner.run({"logits": x})
        w, i = op.MoERouterTopK().reference(attrs, x, bias)
        if not np.array_equal(got[i_name], i):
            return f"{t} tokens: ids differ in {int((got[i_name] != i).any(-1).sum())} rows"
        err = float(np.abs(got[w_name].astype(np.float64) - w).max())
        if err > 1e-5:
            return f"{t} tokens: weights differ by {err:.2e}"
    return None


def run(bundle: Path) -> int:
    from rewrite.generate import Generator

    spec = json.loads((bundle / "bundle.json").read_text())
    cuda_ep = _ort_cuda()
    bad = 0
    for row in spec["rows"]:
        head = f"{row['model']:<10} {row['dtype']:<5} {row['backend']}:{row['target']:<5} {row['plugins']:<30}"
        if row["error"]:
            print(f"{head} not lowered: {row['error']}")
            bad += row["expected"]
            continue
        if row["backend"] == "ort" and not cuda_ep:
            print(f"{head} skipped: this onnxruntime has no CUDA execution provider (install onnxruntime-gpu)")
            continue
        try:
            if row["reference"] is None:  # an op row: the lowering against its numpy reference
                kind, name = row["model"].split("-", 1)
                check = {"router": lambda: _check_router(bundle / row["folder"], name), "op": lambda: _check_op(bundle / row["folder"])}
                why = check.get(kind, lambda: _check_moe(bundle / row["folder"]))()
                print(f"{head} {'ok (equals the reference)' if why is None else 'WRONG: ' + why}", flush=True)
                bad += why is not None
                continue
            tokens = _generate(Generator(bundle / row["folder"]), spec["prompt"], spec["steps"])
        except Exception as e:  # a runtime that cannot load the folder is a row of the table, not the end of it
            print(f"{head} FAILED to run: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            bad += row["expected"]
            continue
        ref = row["reference"]
        diff = next((k for k, (a, b) in enumerate(zip(tokens, ref)) if a != b), None)
        verdict = "ok (tokens equal)" if diff is None else f"WRONG from step {diff}: {tokens} vs {ref}"
        if diff is not None and tokens[diff] in row.get("ties", {}).get(str(diff), ()):
            verdict, diff = f"ok (tokens equal up to step {diff}, where the reference's top two logits tie)", None
        if diff is not None and not row["expected"]:
            verdict += " (expected: IREE's own TopK)"
        print(f"{head} {verdict}", flush=True)
        bad += int(diff is not None and row["expected"])
    return 1 if bad else 0


def _stateful_rows(out: Path, arch: str, dtype: str, only_with: str | None) -> list[dict]:
    """The rows of :data:`STATEFUL_CONFIGS` for ``arch`` in ``dtype``: the tiny seed form, its reference tokens
    (ONNX Runtime CPU; on the quantized model for ``quant4`` sets) and each set lowered for IREE cuda."""
    import seed_form

    from rewrite.errors import RewriteError
    from rewrite.generate import Generator
    from rewrite.pipeline import apply

    src = seed_form.save_seed_model(seed_form.build_seed_model(dtype, arch=arch)[0], out / f"{arch}_{dtype}_seed" / "model.onnx")
    refs = {"": Generator.reference(src).generate(PROMPT, STEPS)}
    rows = []
    for backend, plugins, expected, next_token in STATEFUL_CONFIGS:
        if only_with and not set(only_with.split(",")) & set(plugins.split(",")):
            continue
        if plugins.startswith("quant4") and "quant4" not in refs:
            apply(src, out / f"{arch}_{dtype}_seed_quant4", plugins="quant4", backend="ort")
            refs["quant4"] = Generator.reference(out / f"{arch}_{dtype}_seed_quant4" / "model.onnx").generate(PROMPT, STEPS)
        name = f"{arch}_{dtype}_seed_{backend}_{plugins.replace(',', '-')}_stateful_t1{'_next' if next_token else ''}"
        ref = refs["quant4" if plugins.startswith("quant4") else ""]
        # steps whose reference logits tie at the top (the tiny fp16 seed form has some): any of the tied is right
        ties = {str(k): np.flatnonzero(lg[0, -1] == lg[0, -1].max()).tolist() for k, lg in enumerate(ref.logits)}
        ties = {k: v for k, v in ties.items() if len(v) > 1}
        how = " --stateful --next-token, on the device" if next_token else " --stateful, 1 token a call"
        row = dict(model=f"{arch}-seed", dtype=dtype, backend=backend, target="cuda", plugins=plugins + how,
                   folder=name, reference=ref.tokens, ties=ties, expected=expected, error=None)
        try:
            apply(src, out / name, plugins=plugins, backend=backend, target="cuda",
                  options={"stateful": True, "next_token": next_token}, dims={"seq_len": 1})
        except RewriteError as e:
            row["error"] = str(e)
        rows.append(row)
        print(f"prepared {name}: {row['error'] or 'ok'}", flush=True)
    return rows


def _generate(gen, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens of ``gen`` after ``prompt`` (``Generator.generate`` without logits): a module of one token
    per call (``--dim seq_len=1``) gets the prompt one token a call, and one that decodes on the device
    (``--next-token``) queues its prompt and decode calls there."""
    return gen.generate(prompt, steps, logits=False).tokens


def _ort_cuda() -> bool:
    """Whether ONNX Runtime's CUDA execution provider is there (onnxruntime-gpu loads it after ``import torch``,
    which brings the CUDA libraries)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    import onnxruntime

    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--lowerings", action="append", default=[], metavar="MODULE",
                   help="a module whose rewrite_lowerings() adds lowerings (repeatable)")
    p.add_argument("--families", default=",".join(MODELS),
                   help="comma-separated: qwen2_moe, qwen3_moe and the families of examples/moe_families.py")
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--only-with", metavar="PLUGINS", help="comma-separated: only the plugin sets with one of these "
                   "plugins, and only their op samples of the single-op rows (moe: the FusedMoE samples)")
    r = sub.add_parser("run")
    r.add_argument("bundle", type=Path)
    args = ap.parse_args()
    if args.cmd == "prepare":
        prepare(args.out, args.lowerings, tuple(args.families.split(",")), tuple(args.dtypes.split(",")), args.only_with)
        return 0
    return run(args.bundle)


if __name__ == "__main__":
    sys.exit(main())
