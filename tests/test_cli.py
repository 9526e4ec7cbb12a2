"""The command line: listing plugins, apply/run/verify round trips, and one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper


def rewrite(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rewrite.cli", *map(str, args)], capture_output=True, text=True, cwd=cwd)


def small_model(path: Path, *, opset: int = 17, domain: str = "") -> Path:
    """y = Cast(Cast(x: f16, to=f32), to=f16) + 1, or a node in ``domain``."""
    if domain:
        nodes = [helper.make_node("Foo", ["x"], ["y"], domain=domain, name="foo_node")]
    else:
        nodes = [
            helper.make_node("Cast", ["x"], ["w"], to=TensorProto.FLOAT, name="inner"),
            helper.make_node("Cast", ["w"], ["n"], to=TensorProto.FLOAT16, name="outer"),
            helper.make_node("Add", ["n", "one"], ["y"], name="add"),
        ]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["N", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["N", 4])],
                          [numpy_helper.from_array(np.ones(4, np.float16), "one")] if not domain else [])
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    onnx.save(helper.make_model(g, opset_imports=imports), path)
    return path


def test_plugins_lists_builtins():
    r = rewrite("plugins")
    assert r.returncode == 0, r.stderr
    for word in ("cast-roundtrip", "cast", "legalize", "dequantize-block", "ort, iree"):
        assert word in r.stdout


def test_apply_run_verify_ort(tmp_path):
    model = small_model(tmp_path / "m.onnx")
    out = tmp_path / "out"
    r = rewrite("apply", model, "--plugins", "cast", "--backend", "ort", "-o", out, "--dim", "N=3", "--report", tmp_path / "r.json")
    assert r.returncode == 0, r.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["inputs"] == [{"name": "x", "dtype": "FLOAT16", "shape": [3, 4]}]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report[0]["rules"][0]["matches"] == 1
    ops = [n.op_type for n in onnx.load(out / "model.onnx").graph.node]
    assert ops == ["Add"]
    r = rewrite("verify", model, out)
    assert r.returncode == 0 and "verify: PASS" in r.stdout, r.stdout + r.stderr
    np.savez(tmp_path / "in.npz", x=np.full((3, 4), 2, np.float16))
    r = rewrite("run", out, "--inputs", tmp_path / "in.npz", "--save", tmp_path / "o.npz")
    assert r.returncode == 0, r.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "o.npz")["y"], np.full((3, 4), 3, np.float16))


def test_verify_fails_with_status_1_when_outputs_differ(tmp_path):
    """A folder lowered from a different model must not pass."""
    model = small_model(tmp_path / "m.onnx")
    out = tmp_path / "out"
    assert rewrite("apply", model, "-o", out).returncode == 0
    m = onnx.load(out / "model.onnx")
    m.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.full(4, 1.5, np.float16), "one"))
    onnx.save(m, out / "model.onnx")
    r = rewrite("verify", model, out)
    assert r.returncode == 1
    assert "FAIL y" in r.stdout and "verify: FAIL" in r.stdout


def _bad_inputs(tmp: Path) -> dict[str, tuple[Path, str]]:
    good = small_model(tmp / "good.onnx")
    (tmp / "text.onnx").write_text("not a model\n")
    data = good.read_bytes()
    (tmp / "truncated.onnx").write_bytes(data[: len(data) // 2])
    # external data whose file is gone
    w = numpy_helper.from_array(np.ones((64, 64), np.float32), "W")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [w])
    ext = tmp / "ext.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), ext, save_as_external_data=True, location="ext.data", size_threshold=0)
    (tmp / "ext.data").unlink()
    return {
        "text": (tmp / "text.onnx", "text.onnx: not a readable ONNX model"),
        "truncated": (tmp / "truncated.onnx", "truncated.onnx: not a readable ONNX model"),
        "missing": (tmp / "missing.onnx", "missing.onnx: no such file"),
        "external": (ext, "initializer 'W' needs external data file 'ext.data'"),
        "domain": (small_model(tmp / "dom.onnx", domain="my.custom"), "node 'foo_node' (my.custom::Foo) is in unknown domain 'my.custom'"),
        "opset": (small_model(tmp / "old.onnx", opset=9), "opset 9 is outside plugin 'legalize' range"),
    }


@pytest.mark.parametrize("case", ["text", "truncated", "missing", "external", "domain", "opset"])
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, case):
    path, message = _bad_inputs(tmp_path)[case]
    out = tmp_path / "out"
    r = rewrite("apply", path, "--plugins", "cast,legalize", "-o", out)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr
    assert not out.exists()
    assert not any(p.name.startswith(".out-") for p in tmp_path.iterdir())


def test_unknown_plugin_lists_available(tmp_path):
    r = rewrite("apply", small_model(tmp_path / "m.onnx"), "--plugins", "cast,nope", "-o", tmp_path / "o")
    assert r.returncode == 2
    from rewrite.plugins.manager import available_plugins

    assert r.stderr.strip() == f"error: unknown plugin 'nope'; available: {', '.join(sorted(available_plugins()))}"


def test_bad_dim_names_the_symbolic_dims(tmp_path):
    r = rewrite("apply", small_model(tmp_path / "m.onnx"), "--dim", "seq=1", "-o", tmp_path / "o")
    assert r.returncode == 2
    assert "'seq' is not a symbolic dim of the graph inputs; they are: N" in r.stderr
