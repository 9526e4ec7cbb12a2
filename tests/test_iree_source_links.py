"""The IREE backend's weights on disk twice at most: the source's parameters are linked, not copied, into the folder's
``model.onnx`` while the ``.irpa`` is written from it (``onnx_io.save(link_source=...)``), then pointed at the
``.irpa`` (``share_params``), with no link left behind and the source untouched.

The model: ``y = x @ W + B`` with W [64, 8192] float32 (2 MiB, an ``.irpa`` parameter) and B [8192] float32 (32 KiB,
under the parameter threshold: the importer inlines it, so onnx's reader loads it and it must be copied, since
that reader refuses links), both in the source's external data file.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from rewrite.backends import load_runner
from rewrite.backends.iree import share_params
from rewrite.core import onnx_io
from rewrite.pipeline import apply

K, N = 64, 8192
THRESHOLD = 16384  #: elements: W (524,288) is a parameter, B (8,192) a constant the importer inlines


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    rng = np.random.default_rng(5)
    w = rng.integers(-8, 8, (K, N)).astype(np.float32)
    b = rng.integers(-8, 8, N).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["xw"], name="mm"),
                           helper.make_node("Add", ["xw", "B"], ["y"], name="bias")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N])],
                          [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "B")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    d = tmp_path_factory.mktemp("src")
    onnx.save_model(m, str(d / "src.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="src.onnx.data", size_threshold=0)
    return d / "src.onnx", w, b


def _digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _copies(monkeypatch) -> list[str]:
    """The tensor names whose bytes ``onnx_io.copy_span`` streams from here on."""
    names: list[str] = []
    real = onnx_io.copy_span

    def recorded(path, offset, length, out, name):
        names.append(name)
        real(path, offset, length, out, name)

    monkeypatch.setattr(onnx_io, "copy_span", recorded)
    return names


@pytest.mark.parametrize("hard_links", [True, False], ids=["hard-link", "symlink"])
def test_parameters_are_linked_not_copied_and_the_folder_keeps_no_link(source, tmp_path, monkeypatch, hard_links):
    path, w, b = source
    data = path.parent / "src.onnx.data"
    before = _digest(data)
    copied = _copies(monkeypatch)
    made = []
    real_symlink = os.symlink

    def no_link(src, dst):  # as across file systems
        raise OSError(18, "Invalid cross-device link")

    def symlink(src, dst):
        made.append(dst)
        real_symlink(src, dst)

    if not hard_links:
        monkeypatch.setattr(os, "link", no_link)
    monkeypatch.setattr(os, "symlink", symlink)
    out = tmp_path / "out"
    apply(path, out, backend="iree", options={"param_threshold": THRESHOLD})
    assert copied == ["B"]  # W went into the .irpa from the source's file, never through a copy
    assert len(made) == (0 if hard_links else 1)
    assert sorted(p.name for p in out.iterdir() if "source" in p.name or p.suffix == ".data") == []
    saved = {t.name: t for t in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.initializer}
    assert {e.key: e.value for e in saved["W"].external_data}["location"] == "model.irpa"
    assert saved["B"].data_location == TensorProto.DEFAULT
    assert _digest(data) == before and os.stat(data).st_nlink == 1
    x = np.arange(K, dtype=np.float32)[None] % 5 - 2
    got = load_runner(out).run({"x": x})["y"]
    np.testing.assert_array_equal(got, x @ w + b)  # small integers: exact in float32
    np.testing.assert_array_equal(onnx_io.load(out / "model.onnx").const("W"), w)


def test_a_source_whose_every_tensor_is_linked_leaves_no_empty_data_file(tmp_path):
    """Every external tensor of the source a parameter (linked, then in the .irpa): the folder's own data file,
    which nothing refers to, is not left behind empty."""
    w = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])], [numpy_helper.from_array(w, "w")])
    src = tmp_path / "src" / "m.onnx"
    src.parent.mkdir()
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(src), save_as_external_data=True,
              location="m.onnx.data", size_threshold=0)
    out = tmp_path / "out"
    apply(src, out, backend="iree", options={"param_threshold": 1024})
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("model.")) == \
        ["model.irpa", "model.mlir", "model.onnx", "model.vmfb"]
    x = np.ones((2, 64), np.float32)
    np.testing.assert_allclose(load_runner(out).run({"x": x})["y"], x @ w, rtol=1e-5)


def test_module_from_links_the_source_too(source, tmp_path, monkeypatch):
    path, w, b = source
    compiled = tmp_path / "compiled"
    apply(path, compiled, backend="iree", options={"param_threshold": THRESHOLD})
    copied = _copies(monkeypatch)
    out = tmp_path / "reused"
    apply(path, out, backend="iree", options={"param_threshold": THRESHOLD, "module_from": str(compiled)})
    assert copied == ["B"]
    assert not [p.name for p in out.iterdir() if "source" in p.name]
    assert (out / "model.irpa").read_bytes() == (compiled / "model.irpa").read_bytes()
    x = np.ones((1, K), np.float32)
    np.testing.assert_array_equal(load_runner(out).run({"x": x})["y"], x @ w + b)


def test_a_linked_tensor_the_irpa_does_not_hold_is_copied_into_the_folder(source, tmp_path):
    """share_params with no spans (nothing in the .irpa): W (2 MiB, over the inline limit) must leave the link
    for the folder's own data file; the link is deleted, the source is not."""
    path, w, b = source
    g = onnx_io.load(path)
    out = tmp_path / "f"
    onnx_io.save(g, out / "model.onnx", link_source=lambda t: t.name == "W")
    assert (out / "model.onnx.source0.data").exists()
    (out / "model.irpa").write_bytes(b"")
    share_params(out / "model.onnx", out / "model.irpa", {})
    assert sorted(p.name for p in out.iterdir()) == ["model.irpa", "model.onnx", "model.onnx.data"]
    again = onnx_io.load(out / "model.onnx")
    np.testing.assert_array_equal(again.const("W"), w)
    np.testing.assert_array_equal(again.const("B"), b)
    assert os.stat(path.parent / "src.onnx.data").st_nlink == 1


def _source_with(tmp_path, *, b_is_input: bool):
    """The same y = x @ W + B, optionally with B also a graph input (an initializer default a caller may override:
    the importer leaves it out of the .irpa, so it stays behind in the link until share_params inlines it)."""
    rng = np.random.default_rng(6)
    w = rng.integers(-8, 8, (K, N)).astype(np.float32)
    b = rng.integers(-8, 8, N).astype(np.float32)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K])]
    if b_is_input:
        inputs.append(helper.make_tensor_value_info("B", TensorProto.FLOAT, [N]))
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["xw"], name="mm"),
                           helper.make_node("Add", ["xw", "B"], ["y"], name="bias")], "g", inputs,
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N])],
                          [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "B")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    tmp_path.mkdir(parents=True, exist_ok=True)
    onnx.save_model(m, str(tmp_path / "src.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="src.onnx.data", size_threshold=0)
    return tmp_path / "src.onnx", w, b


def test_an_input_default_linked_then_left_out_of_the_irpa_moves_inline(tmp_path):
    """B (8,192 elements, 32 KiB) is over a 4,096-element threshold, so it is linked; as an input with a default
    the importer leaves it out of the .irpa; share_params inlines it from the link without onnx's reader."""
    path, w, b = _source_with(tmp_path / "src", b_is_input=True)
    out = tmp_path / "out"
    apply(path, out, backend="iree", options={"param_threshold": 4096})
    assert not [p.name for p in out.iterdir() if "source" in p.name]
    saved = {t.name: t for t in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.initializer}
    assert saved["B"].data_location == TensorProto.DEFAULT
    x = np.ones((1, K), np.float32)
    runner = load_runner(out)
    np.testing.assert_array_equal(runner.run({"x": x})["y"], x @ w + b)
    np.testing.assert_array_equal(runner.run({"x": x, "B": -b})["y"], x @ w - b)


def test_module_from_with_another_threshold_reads_the_linked_constants(tmp_path):
    """Compiled with a threshold of 16,384 elements, applied again with 4,096: B is linked here and below the
    compiled folder's threshold, so the graph digest inlines it from the link (not through onnx's reader)."""
    path, w, b = _source_with(tmp_path / "src", b_is_input=False)
    compiled = tmp_path / "compiled"
    apply(path, compiled, backend="iree", options={"param_threshold": THRESHOLD})
    out = tmp_path / "reused"
    apply(path, out, backend="iree", options={"param_threshold": 4096, "module_from": str(compiled)})
    assert not [p.name for p in out.iterdir() if "source" in p.name]
    x = np.ones((1, K), np.float32)
    np.testing.assert_array_equal(load_runner(out).run({"x": x})["y"], x @ w + b)


def test_where_no_link_can_be_made_the_parameters_are_copied(source, tmp_path, monkeypatch):
    path, w, b = source
    copied = _copies(monkeypatch)

    def refused(src, dst):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", refused)
    monkeypatch.setattr(os, "symlink", refused)
    out = tmp_path / "out"
    apply(path, out, backend="iree", options={"param_threshold": THRESHOLD})
    assert copied == ["W", "B"]
    assert sorted(p.name for p in out.iterdir() if "source" in p.name or p.suffix == ".data") == []
    x = np.ones((1, K), np.float32)
    np.testing.assert_array_equal(load_runner(out).run({"x": x})["y"], x @ w + b)


def test_a_failed_apply_leaves_the_source_as_it_was_and_no_folder(source, tmp_path, monkeypatch):
    import rewrite.backends.iree as iree_backend
    from rewrite.backends.errors import IreeImportError
    from rewrite.errors import RewriteError

    path, _, _ = source
    data = path.parent / "src.onnx.data"
    before = _digest(data)

    def failing_import(*args, **kwargs):
        raise IreeImportError("import failed (a test's)")

    monkeypatch.setattr(iree_backend, "import_onnx", failing_import)
    with pytest.raises(RewriteError, match="a test's"):
        apply(path, tmp_path / "out", backend="iree", options={"param_threshold": THRESHOLD})
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert _digest(data) == before and os.stat(data).st_nlink == 1
