"""Tensors a plugin creates go to the spill file, not memory, and the saved model is as it would be without it."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from rewrite.core import onnx_io, spill
from rewrite.errors import RewriteError
from rewrite.pipeline import apply


def _dense_model(k: int = 256, n: int = 128) -> onnx.ModelProto:
    w = np.random.default_rng(0).standard_normal((k, n)).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, n])],
                          [numpy_helper.from_array(w, "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    return m


def _outputs(path: Path, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_add_initializer_spills_large_tensors_only(monkeypatch):
    monkeypatch.setattr(spill, "SPILL_MIN_BYTES", 1024)
    g = onnx_io.load(_dense_model())
    big = np.arange(512, dtype=np.float32).reshape(2, 256)  # 2048 bytes: spilled
    small = np.arange(8, dtype=np.int64)  # 64 bytes: kept
    vb, vs = g.add_initializer("big", big), g.add_initializer("small", small)
    assert vb.initializer.data_location == TensorProto.EXTERNAL and vb._const_cache is None
    assert spill.is_spilled(vb.initializer, vb.base_dir)
    assert vs.initializer.data_location == TensorProto.DEFAULT and not spill.is_spilled(vs.initializer, vs.base_dir)
    np.testing.assert_array_equal(g.const("big"), big, strict=True)
    np.testing.assert_array_equal(g.const("small"), small, strict=True)
    # replacing data spills too, and changes the value's type
    g.set_initializer_data("small", np.zeros((16, 32), np.float16))
    assert spill.is_spilled(g.values["small"].initializer, g.values["small"].base_dir)
    assert (g.values["small"].dtype, g.values["small"].shape) == (TensorProto.FLOAT16, (16, 32))
    with pytest.raises(RewriteError, match="'x' is not an initializer"):
        g.set_initializer_data("x", small)


def test_spilled_tensors_the_graph_dropped_give_their_disk_back(monkeypatch):
    """Replaced and removed spilled tensors are punched out of the spill file once no snapshot can bring them back;
    the tensors still held read back unchanged."""
    monkeypatch.setattr(spill, "SPILL_MIN_BYTES", 1 << 16)
    g = onnx_io.load(_dense_model())
    gc.collect()
    g.release_spilled()  # what earlier tests' graphs left in this process's spill file
    rng = np.random.default_rng(1)
    arrays = {f"t{i}": rng.standard_normal((256, 256)).astype(np.float32) for i in range(4)}  # 256 KiB each
    for name, a in arrays.items():
        g.add_initializer(name, a)
    g.add_node("Identity", ["t3"], ["kept_out"])  # t3 stays read; t0..t2 are read by nothing
    other = onnx_io.load(_dense_model())  # another graph of the process holding t1's bytes keeps them
    other.add_initializer("t1", arrays["t1"])
    other.values["t1"].initializer.CopyFrom(g.values["t1"].initializer)
    path = Path(spill._spill["path"])
    blocks = lambda: os.stat(path).st_blocks * 512  # noqa: E731 - bytes the file occupies on disk
    before = blocks()
    g.set_initializer_data("t3", arrays["t3"] * 2)  # t3's first range is dropped, a new one appended
    g.remove_unused_initializers()
    released = g.release_spilled()
    assert released == 4 * arrays["t0"].nbytes  # t0, t2, t3's first data, and other's own copy of t1
    np.testing.assert_array_equal(g.const("t3"), arrays["t3"] * 2, strict=True)
    np.testing.assert_array_equal(other.const("t1"), arrays["t1"], strict=True)
    assert g.release_spilled() == 0  # nothing more to give back
    del other
    gc.collect()
    assert g.release_spilled() == arrays["t1"].nbytes  # t1 once its last holder is gone
    assert blocks() <= before + 2 * arrays["t0"].nbytes - released - arrays["t1"].nbytes + 4096 * 4


def test_saving_with_rebase_leaves_the_plugins_tensors_on_disk_once(tmp_path, monkeypatch):
    """``save(..., rebase_spilled=True)`` (the iree backend, before the .irpa is written): the spilled tensors now
    read from the saved data file, unchanged, and the spill file gives their ranges back."""
    monkeypatch.setattr(spill, "SPILL_MIN_BYTES", 1 << 16)
    g = onnx_io.load(_dense_model())
    gc.collect()
    g.release_spilled()
    a = np.random.default_rng(2).standard_normal((256, 256)).astype(np.float32)
    g.add_initializer("big", a)
    g.add_node("Identity", ["big"], ["big_out"])
    onnx_io.save(g, tmp_path / "m.onnx", external=True, rebase_spilled=True)
    v = g.values["big"]
    assert not spill.is_spilled(v.initializer, v.base_dir) and v.base_dir == str(tmp_path)
    assert {e.key: e.value for e in v.initializer.external_data}["location"] == "m.onnx.data"
    np.testing.assert_array_equal(g.const("big"), a, strict=True)
    assert g.release_spilled() == 0  # already given back by the save
    # saving again from the rebased graph copies the same bytes
    onnx_io.save(g, tmp_path / "again" / "m.onnx", external=True)
    np.testing.assert_array_equal(onnx_io.load(tmp_path / "again" / "m.onnx").const("big"), a, strict=True)


@pytest.mark.parametrize("backend", ["ort", "iree"])
def test_spilled_quant4_output_equals_the_unspilled_one(tmp_path, monkeypatch, backend):
    """quant4's codes and scales spilled: the saved folder is byte-identical to the one made in memory and refers
    to no spill file (the source had no external data: an ort folder holds its data inline, an iree folder's
    model.onnx refers to the bytes in its model.irpa)."""
    src = tmp_path / "m.onnx"
    onnx.save(_dense_model(), src)
    plugins = "quant4,legalize" if backend == "iree" else "quant4"
    apply(src, tmp_path / "mem", plugins=plugins, backend=backend)
    monkeypatch.setattr(spill, "SPILL_MIN_BYTES", 256)
    apply(src, tmp_path / "spilled", plugins=plugins, backend=backend)
    a, b = (onnx.load(str(tmp_path / d / "model.onnx"), load_external_data=False) for d in ("mem", "spilled"))
    assert a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)
    locations = {e.value for t in b.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == (set() if backend == "ort" else {"model.irpa"})
    assert sorted(os.listdir(tmp_path / "mem")) == sorted(os.listdir(tmp_path / "spilled"))
    if backend == "ort":
        x = np.random.default_rng(1).standard_normal((2, 256)).astype(np.float32)
        np.testing.assert_array_equal(_outputs(tmp_path / "spilled" / "model.onnx", x),
                                      _outputs(tmp_path / "mem" / "model.onnx", x))


def test_spill_folder_is_configurable_and_stale_ones_go(tmp_path, monkeypatch):
    """REWRITE_SPILL_DIR picks the parent; a folder left by a process that no longer exists is removed."""
    import subprocess as sp

    dead = sp.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    stale = tmp_path / f"rewrite-spill-{dead}-abc"
    stale.mkdir()
    (stale / "spill.bin").write_bytes(b"x")
    script = ("import numpy as np\nfrom rewrite.core.ir import Graph\nfrom rewrite.core import spill\n"
              "v = Graph().add_initializer('big', np.zeros(spill.SPILL_MIN_BYTES, np.uint8))\nprint(v.base_dir)\n")
    proc = sp.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                  env={**os.environ, "REWRITE_SPILL_DIR": str(tmp_path)})
    assert Path(proc.stdout.strip()).parent == tmp_path, proc.stderr
    assert not stale.exists()
    assert list(tmp_path.glob("rewrite-spill-*")) == []  # its own went at exit


def test_spilled_tensors_stream_into_an_external_output(tmp_path, monkeypatch):
    monkeypatch.setattr(spill, "SPILL_MIN_BYTES", 256)
    g = onnx_io.load(_dense_model())
    w = np.random.default_rng(2).standard_normal((256, 128)).astype(np.float32)
    g.set_initializer_data("W", w)
    out = onnx_io.save(g, tmp_path / "o" / "model.onnx", external=True)
    saved = onnx.load(str(out), load_external_data=False)
    (t,) = saved.graph.initializer
    assert {e.key: e.value for e in t.external_data}["location"] == "model.onnx.data"
    x = np.ones((2, 256), np.float32)
    np.testing.assert_allclose(_outputs(out, x), x @ w, rtol=1e-5)


def test_the_spill_folder_goes_with_the_process(tmp_path):
    """Normal exit and SIGTERM (the command line's handler raises SystemExit) both remove it."""
    script = (
        "import sys, signal, numpy as np\n"
        "from rewrite.core import spill, onnx_io\n"
        "from rewrite.cli import _exit_on_signal\n"
        "import onnx\n"
        "signal.signal(signal.SIGTERM, _exit_on_signal)\n"
        f"g = onnx_io.load(onnx.load({str(tmp_path / 'm.onnx')!r}))\n"
        "v = g.add_initializer('big', np.zeros(spill.SPILL_MIN_BYTES // 4, np.float32))\n"
        "print(v.base_dir, flush=True)\n"
        "if sys.argv[1] == 'term':\n"
        "    import os; os.kill(os.getpid(), signal.SIGTERM)\n"
    )
    onnx.save(_dense_model(), tmp_path / "m.onnx")
    for how in ("exit", "term"):
        proc = subprocess.run([sys.executable, "-c", script, how], capture_output=True, text=True, timeout=120)
        folder = Path(proc.stdout.strip())
        assert folder.name.startswith("rewrite-spill-"), proc.stderr
        assert not folder.exists(), f"{how}: {folder} left behind"
        assert proc.returncode == (0 if how == "exit" else 128 + 15)
