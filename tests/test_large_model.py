"""A model past protobuf's 2 GB: one 2.2 GB initializer in external data, written without ever holding a
serialized proto, and an 8-element bias stored there too. Both backends lower it and compute x @ W and
(x @ W)[:, :8] + B (IREE's importer takes its large-model path: before, it serialized the whole model and failed
with EncodeError; on that path it reads no external data for the small constants it inlines, so the saved model
holds small tensors inline)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from rewrite.backends import load_runner
from rewrite.core import onnx_io
from rewrite.pipeline import apply

N, M = 16384, 33792  #: W is N x M float32: 2,214,592,512 bytes


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("big")
    w = np.memmap(d / "big.onnx.data", np.float32, "w+", shape=(N, M))  # zeros on disk, a few rows set
    w[0, :] = 1.0
    w[3, :5] = np.arange(5, dtype=np.float32)
    w[N - 1, M - 1] = -2.0
    w.flush()
    del w
    with open(d / "big.onnx.data", "ab") as f:
        f.write(np.arange(8, dtype=np.float32).tobytes())

    def external(name: str, dims: list[int], offset: int, length: int) -> onnx.TensorProto:
        t = onnx.TensorProto(name=name, data_type=TensorProto.FLOAT, dims=dims, data_location=TensorProto.EXTERNAL)
        for k, v in (("location", "big.onnx.data"), ("offset", str(offset)), ("length", str(length))):
            e = t.external_data.add()
            e.key, e.value = k, v
        return t

    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm"),
             helper.make_node("Slice", ["y", "s0", "s8", "ax1"], ["y8"], name="first8"),
             helper.make_node("Add", ["y8", "B"], ["z"], name="bias")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, N])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, M]),
                           helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 8])],
                          [external("W", [N, M], 0, N * M * 4), external("B", [8], N * M * 4, 32),
                           *(numpy_helper.from_array(np.array([v], np.int64), n) for n, v in (("s0", 0), ("s8", 8), ("ax1", 1)))])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    onnx.save(m, d / "big.onnx")
    return d / "big.onnx"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ort", "iree"])
def test_a_model_over_2gb_lowers_and_runs(big_model, tmp_path, backend):
    apply(big_model, tmp_path / "out", backend=backend)
    x = np.zeros((1, N), np.float32)
    x[0, 0], x[0, 3], x[0, N - 1] = 0.5, 2.0, 1.0
    want = np.full((1, M), 0.5, np.float32)
    want[0, :5] += 2.0 * np.arange(5)
    want[0, M - 1] -= 2.0
    got = load_runner(tmp_path / "out").run({"x": x})
    np.testing.assert_array_equal(got["y"], want)
    np.testing.assert_array_equal(got["z"], want[:, :8] + np.arange(8, dtype=np.float32))
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    if backend == "iree":
        # the weights are on disk once: the folder's model.onnx refers to its bytes in the .irpa, B moved inline
        assert "model.onnx.data" not in files and "model.irpa" in files
        saved = {t.name: t for t in onnx.load(str(tmp_path / "out" / "model.onnx"), load_external_data=False).graph.initializer}
        assert {e.key: e.value for e in saved["W"].external_data}["location"] == "model.irpa"
        assert saved["B"].data_location == TensorProto.DEFAULT
        w = onnx_io.load(tmp_path / "out" / "model.onnx").const("W")
        assert w[0].min() == w[0].max() == 1.0 and w[N - 1, M - 1] == -2.0 and w[3, :5].tolist() == [0, 1, 2, 3, 4]
    else:
        assert files == ["manifest.json", "model.onnx", "model.onnx.data"]


@pytest.mark.parametrize("broken", [False, True])
def test_ort_load_check_of_a_large_model_runs_on_its_skeleton(tmp_path, monkeypatch, broken):
    """Above CHECK_WEIGHTS_MAX_BYTES the apply-time ORT check loads the weightless skeleton: a graph ORT
    refuses is still refused, naming the folder's model, and the check leaves no file behind."""
    from rewrite.backends import ort as ort_backend

    monkeypatch.setattr(ort_backend, "CHECK_WEIGHTS_MAX_BYTES", 0)
    w = numpy_helper.from_array(np.eye(4, dtype=np.float32), "W")
    node = helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")
    if broken:  # an attribute MatMul does not have: ORT's loader refuses it
        node.attribute.append(helper.make_attribute("bogus", 1))
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    onnx.save(m, tmp_path / "m.onnx")
    if broken:
        with pytest.raises(Exception, match="ONNX Runtime cannot load it") as ei:
            apply(tmp_path / "m.onnx", tmp_path / "out", backend="ort")
        assert "model.onnx" in str(ei.value) and ".ort-check" not in str(ei.value)
        assert not (tmp_path / "out").exists()
    else:
        apply(tmp_path / "m.onnx", tmp_path / "out", backend="ort")
        assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["manifest.json", "model.onnx"]
        got = load_runner(tmp_path / "out").run({"x": np.arange(4, dtype=np.float32)[None]})
        np.testing.assert_array_equal(got["y"], np.arange(4, dtype=np.float32)[None])


def _small_matmul(path):
    """y = x @ W, W [64, 32] float32 (a MatMul whose weight ONNX Runtime prepacks)."""
    w = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 32])], [numpy_helper.from_array(w, "W")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path, w


def test_low_memory_turns_prepacking_off_and_is_chosen_by_the_folder_size(tmp_path, monkeypatch):
    """``--low-memory`` (or a folder larger than 40% of the available memory) runs an ort folder with ONNX
    Runtime's prepacking off; outputs are unchanged."""
    import rewrite.backends as backends

    src, w = _small_matmul(tmp_path / "m.onnx")
    apply(src, tmp_path / "out", backend="ort")
    x = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
    key = "session.disable_prepacking"
    low = load_runner(tmp_path / "out", low_memory=True)
    assert low.session.get_session_options().get_session_config_entry(key) == "1"
    with pytest.raises(RuntimeError):  # not set at all
        load_runner(tmp_path / "out", low_memory=False).session.get_session_options().get_session_config_entry(key)
    np.testing.assert_allclose(low.run({"x": x})["y"], x @ w, rtol=1e-5, atol=1e-5)
    size = sum(p.stat().st_size for p in (tmp_path / "out").iterdir())
    monkeypatch.setattr(backends, "available_memory", lambda: int(size / backends.LOW_MEMORY_SHARE) - 1)
    assert backends.needs_low_memory(tmp_path / "out")
    assert load_runner(tmp_path / "out").session.get_session_options().get_session_config_entry(key) == "1"
    monkeypatch.setattr(backends, "available_memory", lambda: int(size / backends.LOW_MEMORY_SHARE) + 1)
    assert not backends.needs_low_memory(tmp_path / "out")


def test_a_full_disk_while_saving_is_one_error_naming_the_sizes(tmp_path, monkeypatch):
    """An OSError while streaming external data (ENOSPC) becomes a RewriteError naming the file, the bytes and the
    free space; no partial data file is left."""
    import errno

    from rewrite.errors import RewriteError

    src, _ = _small_matmul(tmp_path / "m.onnx")
    g = onnx_io.load(src)

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(onnx_io, "_write_external", full)
    with pytest.raises(RewriteError, match=r"cannot write .*out\.onnx and its 0\.00 GB of external data \(No space left on device; .* GB free there\)"):
        onnx_io.save(g, tmp_path / "out.onnx", external=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
