"""Shared fixtures: the example exporters on sys.path and tiny exported models, built once per session."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))


def _export(tmp_path_factory, name: str, build, export) -> Path:
    """``export(build(), folder)`` with the exporters' warnings silenced, into a session folder named ``name``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return export(build(), tmp_path_factory.mktemp(name))


@pytest.fixture(scope="session")
def qwen2_moe_tiny(tmp_path_factory) -> Path:
    """The tiny Qwen1.5-MoE-architecture decoder (fp32) exported by transformers' ONNX exporter."""
    import qwen_moe

    return _export(tmp_path_factory, "qwen2_moe_tiny", lambda: qwen_moe.build_model("qwen2_moe", "tiny"), qwen_moe.export_hf)


@pytest.fixture(scope="session")
def qwen3_moe_tiny(tmp_path_factory) -> Path:
    """The tiny Qwen3-MoE-architecture decoder (fp32; top-8 of 16 experts, renormalized) exported by transformers."""
    import qwen_moe

    return _export(tmp_path_factory, "qwen3_moe_tiny", lambda: qwen_moe.build_model("qwen3_moe", "tiny"), qwen_moe.export_hf)


@pytest.fixture(scope="session")
def seed_fp32(tmp_path_factory):
    """The seed's static-cache INT4 form (fp32): (path, weights)."""
    import seed_form

    model, weights = seed_form.build_seed_model("fp32")
    return seed_form.save_seed_model(model, tmp_path_factory.mktemp("seed") / "seed_fp32.onnx"), weights


@pytest.fixture(scope="session")
def qwen2_moe_tiny_dynamo(tmp_path_factory) -> Path:
    """The tiny Qwen1.5-MoE decoder (fp32) exported by ``torch.onnx.export(..., dynamo=True)``."""
    import qwen_moe

    return _export(tmp_path_factory, "qwen2_moe_tiny_dynamo", lambda: qwen_moe.build_model("qwen2_moe", "tiny"),
                   qwen_moe.export_dynamo)


@pytest.fixture(scope="session")
def qwen2_moe_tiny_grouped_mm(tmp_path_factory) -> Path:
    """The tiny Qwen1.5-MoE decoder (fp32) with transformers' default ``grouped_mm`` experts, exported by
    transformers' exporter: tokens sorted by expert, one MatMul per expert."""
    import moe_families

    return _export(tmp_path_factory, "qwen2_moe_tiny_grouped_mm",
                   lambda: moe_families.build("qwen2_moe", experts="grouped_mm"),
                   lambda model, folder: moe_families.export(model, "hf", folder))


@pytest.fixture
def router_onnx(tmp_path) -> Path:
    """weights, ids = TopK(Softmax(logits: f32[T, 8]), 2), saved as ``router.onnx``: the smallest graph ``topk``
    fuses into MoERouterTopK."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("Softmax", ["logits"], ["p"], axis=-1, name="softmax"),
             helper.make_node("TopK", ["p", "k"], ["w", "ids"], axis=-1, name="topk")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["T", 8])],
                          [helper.make_tensor_value_info("w", TensorProto.FLOAT, ["T", 2]),
                           helper.make_tensor_value_info("ids", TensorProto.INT64, ["T", 2])],
                          [numpy_helper.from_array(np.array([2], np.int64), "k")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    onnx.save(m, tmp_path / "router.onnx")
    return tmp_path / "router.onnx"


@pytest.fixture(scope="session")
def gpt_oss_tiny(tmp_path_factory) -> Path:
    """The tiny gpt-oss decoder (fp32; a sliding-window layer of 16 positions, then a full-attention layer)
    exported by transformers' exporter: the two layers' caches carry different past-length symbols."""
    import moe_families

    return _export(tmp_path_factory, "gpt_oss_tiny", lambda: moe_families.build("gpt_oss"),
                   lambda model, folder: moe_families.export(model, "hf", folder))


@pytest.fixture(scope="session")
def qwen2_moe_tiny_iree_topk(qwen2_moe_tiny, tmp_path_factory):
    """``rewrite apply qwen2_moe_tiny --plugins cast,legalize,topk --backend iree -o FOLDER`` run once through the
    CLI (one iree-compile for the tests that read the folder): (the completed process, FOLDER)."""
    import subprocess

    out = tmp_path_factory.mktemp("qwen2_moe_tiny_iree_topk") / "iree"
    proc = subprocess.run([sys.executable, "-m", "rewrite.cli", "apply", str(qwen2_moe_tiny), "--plugins",
                           "cast,legalize,topk", "--backend", "iree", "-o", str(out)], capture_output=True, text=True)
    return proc, out


@pytest.fixture(scope="session")
def seed_fp16_qwen3_cuda_step(tmp_path_factory):
    """The fp16 Qwen3 seed form lowered by ``--backend iree --target cuda --stateful --dim seq_len=1`` with
    ``cast,rope,legalize,expand,kv,attention,topk,moe`` (compiled, not run; one iree-compile for the attention and
    rope tests): (FOLDER, its manifest, its stream census)."""
    import seed_form

    from rewrite.backends.iree_census import census
    from rewrite.pipeline import apply

    base = tmp_path_factory.mktemp("seed_fp16_qwen3_cuda_step")
    model, _ = seed_form.build_seed_model("fp16", arch="qwen3_moe")
    path = seed_form.save_seed_model(model, base / "seed.onnx")
    m = apply(path, base / "cuda", plugins="cast,rope,legalize,expand,kv,attention,topk,moe", backend="iree",
              target="cuda", options={"stateful": True}, dims={"seq_len": 1})
    return base / "cuda", m, census(base / "cuda")


@pytest.fixture(scope="session")
def qwen2_moe_tiny_applied(qwen2_moe_tiny, tmp_path_factory):
    """``(plugins, backend) -> (FOLDER, manifest)``: qwen2_moe_tiny after ``apply(..., plugins=plugins,
    backend=backend)`` (default target, no options), made once per session for each pair (test_plugin_moe's and
    test_plugin_order's full chain share one iree-compile). The tests only read the folder."""
    from rewrite.pipeline import apply

    made = {}

    def get(plugins: str, backend: str):
        if (plugins, backend) not in made:
            out = tmp_path_factory.mktemp("qwen2_moe_tiny_applied") / backend
            made[plugins, backend] = out, apply(qwen2_moe_tiny, out, plugins=plugins, backend=backend)
        return made[plugins, backend]

    return get
