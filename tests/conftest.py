"""Shared fixtures: the example exporters on sys.path and tiny exported models, built once per session."""

from __future__ import annotations

import os
import shutil
import sys
import warnings
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))


def _shared_root(tmp_path_factory) -> Path:
    """The temp folder every pytest-xdist worker of this run sees (the run's base temp without workers)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _built_once(tmp_path_factory, key: str, make) -> Path:
    """``make(folder)`` (a path inside ``folder``) run once per test run for ``key``: the first pytest-xdist worker to
    ask builds it under a file lock in the run's shared temp folder, the others wait (up to 30 minutes) and reuse
    it (pytest-xdist's pattern for session data); a build that failed fails every later ask at once, with its
    error. Tests read what is built there and never change it."""
    import json

    from filelock import FileLock

    root = _shared_root(tmp_path_factory) / "built-once"
    root.mkdir(parents=True, exist_ok=True)
    folder, marker = root / key, root / f"{key}.json"
    with FileLock(str(root / f"{key}.lock"), timeout=1800):
        if marker.exists():
            done = json.loads(marker.read_text())
            if "error" in done:
                raise RuntimeError(f"building {key} failed earlier in this run: {done['error']}")
            return folder / done["path"]
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(exist_ok=True)
        try:
            made = Path(make(folder))
        except Exception as e:
            marker.write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
            raise
        marker.write_text(json.dumps({"path": str(made.relative_to(folder))}))
        return made


@pytest.fixture(scope="session", autouse=True)
def _iree_compile_cache(tmp_path_factory):
    """Every iree-compile of the run (in the workers and the command-line runs they start) reuses the module of the
    same inputs compiled before in the run, whichever worker compiled it (``REWRITE_IREE_COMPILE_CACHE``). A test
    that must see the compiler run removes the variable (monkeypatch)."""
    from rewrite.backends.iree_toolchain import COMPILE_CACHE_ENV

    before = os.environ.get(COMPILE_CACHE_ENV)
    os.environ[COMPILE_CACHE_ENV] = str(_shared_root(tmp_path_factory) / "iree-compile-cache")
    yield
    if before is None:
        os.environ.pop(COMPILE_CACHE_ENV, None)
    else:
        os.environ[COMPILE_CACHE_ENV] = before


def _export(tmp_path_factory, name: str, build, export) -> Path:
    """``export(build(), folder)`` with the exporters' warnings silenced, once per test run (:func:`_built_once`)."""

    def make(folder: Path) -> Path:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return export(build(), folder)

    return _built_once(tmp_path_factory, name, make)


@pytest.fixture(scope="session")
def family_export(tmp_path_factory):
    """``family_export(family, exporter="hf", experts="batched_mm", dtype="fp32") -> Path``: the tiny ``family``
    model of examples/moe_families.py exported once per test run, shared by the coverage matrix and the tests that
    read the same export."""
    import moe_families
    import torch

    def get(family: str, exporter: str = "hf", experts: str = "batched_mm", dtype: str = "fp32") -> Path:
        torch_dtype = {"fp32": torch.float32, "fp16": torch.float16}[dtype]
        return _export(tmp_path_factory, f"{family}.{exporter}.{experts}.{dtype}",
                       lambda: moe_families.build(family, experts=experts, dtype=torch_dtype),
                       lambda model, folder: moe_families.export(model, exporter, folder))

    return get


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
def qwen2_moe_tiny_grouped_mm(family_export) -> Path:
    """The tiny Qwen1.5-MoE decoder (fp32) with transformers' default ``grouped_mm`` experts, exported by
    transformers' exporter: tokens sorted by expert, one MatMul per expert."""
    return family_export("qwen2_moe", "hf", "grouped_mm")


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
def gpt_oss_tiny(family_export) -> Path:
    """The tiny gpt-oss decoder (fp32; a sliding-window layer of 16 positions, then a full-attention layer)
    exported by transformers' exporter: the two layers' caches carry different past-length symbols."""
    return family_export("gpt_oss")


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
