"""The command line: listing plugins, apply/run/verify round trips, and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import re
import socket
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
    assert r.stdout.splitlines()[0] == (f"verify: {out} (ort/cpu, ONNX Runtime session level all, "
                                        "session.qdq_matmulnbits_accuracy_level=0; plugins: cast) against "
                                        f"{model} on ONNX Runtime CPU, basic level")
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


def test_verify_against_the_float32_twin(tmp_path):
    """y = (x + 1000) - 1000 with the sum rounded to fp16 (a Cast round trip) takes x to steps of 0.5; a folder
    computing it without the rounding is far from that original but near its float32 twin: it passes with
    --float32-reference (the original's own distance from the twin is the yardstick), while a folder with a wrong
    constant fails both ways."""
    f16, f32 = TensorProto.FLOAT16, TensorProto.FLOAT
    c = numpy_helper.from_array(np.array([1000.0], np.float32), "c")
    nodes = [helper.make_node("Cast", ["x"], ["x32"], to=f32), helper.make_node("Add", ["x32", "c"], ["s"]),
             helper.make_node("Cast", ["s"], ["s16"], to=f16), helper.make_node("Cast", ["s16"], ["s32"], to=f32),
             helper.make_node("Sub", ["s32", "c"], ["y32"]), helper.make_node("Cast", ["y32"], ["y"], to=f16)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f16, [4])],
                          [helper.make_tensor_value_info("y", f16, [4])], [c])
    model = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), model)
    out = tmp_path / "out"
    assert rewrite("apply", model, "--backend", "ort", "-o", out).returncode == 0
    m = onnx.load(out / "model.onnx")
    del m.graph.node[:], m.graph.value_info[:]  # the same without the rounding Cast pair
    m.graph.node.extend([n for n in nodes if n.output[0] not in ("s16", "s32")])
    m.graph.node[2].input[0] = "s"
    onnx.save(m, out / "model.onnx")
    np.savez(tmp_path / "in.npz", x=np.array([0.1, 0.2, 0.3, 0.4], np.float16))
    r = rewrite("verify", model, out, "--inputs", tmp_path / "in.npz")
    assert r.returncode == 1 and "FAIL y" in r.stdout, r.stdout + r.stderr
    r = rewrite("verify", model, out, "--inputs", tmp_path / "in.npz", "--float32-reference")
    assert r.returncode == 0 and "verify: PASS" in r.stdout, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("ok   y"))
    got, bound, own = (float(v) for v in re.search(
        r"against float32: max_rel=(\S+) \(bound (\S+)\), the original's (\S+):", line).groups())
    assert got < 1e-3 and own > 0.2 and bound == 0.05  # twice 0.5, capped at 5 tolerances
    assert "passes on the float32 twin" in line and "the original itself is beyond tolerance" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.npz", "m.onnx", "out"]  # the twin is gone
    m.graph.initializer.append(numpy_helper.from_array(np.array([999.0], np.float32), "c_wrong"))
    m.graph.node[2].input[1] = "c_wrong"  # y = x + 1
    onnx.save(m, out / "model.onnx")
    r = rewrite("verify", model, out, "--inputs", tmp_path / "in.npz", "--float32-reference")
    assert r.returncode == 1 and "FAIL y" in r.stdout and "against float32" in r.stdout, r.stdout + r.stderr


def test_the_float32_twin_loosens_nothing_past_its_cap_or_where_the_original_overflows():
    from rewrite.verify import compare, judge_with_float32

    twin = np.array([100.0, 1.0, 2.0], np.float32)
    ref = np.array([90.0, 1.0, 2.0], np.float16)  # the original 10% off its twin: bound capped at 5% (5 x 1e-2)
    for got, ok in (([100.0, 1.0, 2.0], True), ([96.0, 1.0, 2.0], True), ([93.0, 1.0, 2.0], False)):
        c = judge_with_float32(compare("y", np.array(got, np.float16), ref), np.array(got, np.float16), ref, twin)
        assert (c.ok, c.fp32_bound) == (ok, 0.05), (got, c)
    overflowed = np.array([np.inf, 1.0, 2.0], np.float16)  # fp16 overflow where the twin is finite
    for got in ([7.0, -50.0, 1000.0], [np.nan] * 3):
        got = np.array(got, np.float16)
        c = judge_with_float32(compare("y", got, overflowed), got, overflowed, twin)
        assert not c.ok and c.fp32_bound == 1e-2 and c.reference_fp32_rel == np.inf


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
        "opset": (small_model(tmp / "old.onnx", opset=9), "opset 9 is outside plugin 'legalize' range 13..28 (onnx.version_converter.convert_version(model, 13) converts the model, or leave 'legalize' out)"),
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


def test_report_inside_the_output_folder_is_written(tmp_path):
    out = tmp_path / "out"
    r = rewrite("apply", small_model(tmp_path / "m.onnx"), "--plugins", "cast", "-o", out, "--report", out / "report.json")
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "report.json").read_text())[0]["plugin"] == "cast"


@pytest.mark.parametrize("command", ["apply", "explain"])
def test_file_option_in_a_missing_folder_is_refused_before_any_work(tmp_path, command):
    model = small_model(tmp_path / "m.onnx")
    out = tmp_path / "out"
    extra = ["-o", out, "--report"] if command == "apply" else ["--json"]
    r = rewrite(command, model, "--plugins", "cast", *extra, tmp_path / "nodir" / "r.json")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert lines == [f"error: {'--report' if command == 'apply' else '--json'} {tmp_path / 'nodir' / 'r.json'}: folder "
                     f"'{tmp_path / 'nodir'}' does not exist (see 'rewrite {command} --help')"], r.stderr
    assert not out.exists()


def _unsupported_on_iree(kind: str) -> onnx.ModelProto:
    """One node IREE 3.13 cannot compile or call, without a name, after a named Relu: a TopK with sorted=0, a
    ReduceSum whose axes are a graph input, or an Identity of a string graph input."""
    relu = helper.make_node("Relu", ["x"], ["r"], name="relu")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])
    if kind == "string-input":  # passes through: IREE compiles it, and its runtime cannot call the module
        g = helper.make_graph([relu, helper.make_node("Identity", ["s"], ["s_out"])], "g",
                              [x, helper.make_tensor_value_info("s", TensorProto.STRING, [2])],
                              [helper.make_tensor_value_info("r", TensorProto.FLOAT, [2, 8]),
                               helper.make_tensor_value_info("s_out", TensorProto.STRING, [2])])
    elif kind == "topk-unsorted":
        g = helper.make_graph([relu, helper.make_node("TopK", ["r", "k"], ["v", "i"], sorted=0)], "g", [x],
                              [helper.make_tensor_value_info("v", TensorProto.FLOAT, [2, 3]), helper.make_tensor_value_info("i", TensorProto.INT64, [2, 3])],
                              [numpy_helper.from_array(np.array([3], np.int64), "k")])
    else:
        g = helper.make_graph([relu, helper.make_node("ReduceSum", ["r", "axes"], ["s"], keepdims=1)], "g",
                              [x, helper.make_tensor_value_info("axes", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("s", TensorProto.FLOAT, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("kind, message", [
    ("topk-unsorted", "node '<unnamed #1>' (TopK): TopK with sorted=0 is not supported by IREE's ONNX import"),
    ("reduce-runtime-axes", "node '<unnamed #1>' (ReduceSum): axes 'axes' are known only at run time"),
    ("string-input", "graph input 's' is tensor(string): IREE has no string tensors"),
])
def test_node_iree_cannot_compile_is_refused_before_compiling_naming_the_unnamed_node(tmp_path, kind, message):
    """IREE 3.13's own errors for these name an internal torch op, not the ONNX node; the node has no name, so
    the message gives its position in the graph."""
    model = tmp_path / "m.onnx"
    onnx.save(_unsupported_on_iree(kind), model)
    out = tmp_path / "out"
    r = rewrite("apply", model, "--backend", "iree", "-o", out)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr
    assert not out.exists() and not any(p.name.startswith(".out-") for p in tmp_path.iterdir())
    assert rewrite("apply", model, "--backend", "ort", "-o", out).returncode == 0  # ONNX Runtime runs it


def _slow_to_compile(path: Path, layers: int = 400) -> Path:
    """A chain of ``layers`` MatMul+Tanh: a few seconds of iree-compile, long enough to be interrupted."""
    rng = np.random.default_rng(0)
    nodes, inits, prev = [], [], "x"
    for i in range(layers):
        inits.append(numpy_helper.from_array(rng.standard_normal((32, 32)).astype(np.float32) * 0.1, f"w{i}"))
        nodes += [helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"], name=f"mm{i}"),
                  helper.make_node("Tanh", [f"m{i}"], [f"t{i}"], name=f"tanh{i}")]
        prev = f"t{i}"
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 32])],
                          [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [4, 32])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.slow
def test_sigterm_during_apply_leaves_nothing_and_ends_the_compiler(tmp_path):
    import signal
    import time

    model = _slow_to_compile(tmp_path / "chain.onnx")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "rewrite.cli", "apply", str(model), "--backend", "iree", "-o", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, children = time.time() + 120, []
    while time.time() < deadline and proc.poll() is None and not children:  # wait until a child (importer, compiler) runs
        children = _children(proc.pid)
        time.sleep(0.02)
    assert children and proc.poll() is None, "apply finished before it could be interrupted"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert not any(p.name.startswith(".out-") for p in tmp_path.iterdir()) and not out.exists()
    time.sleep(0.5)
    for c in children:  # the child was killed with the run, not left writing
        assert not os.path.exists(f"/proc/{c}") or open(f"/proc/{c}/stat").read().split()[2] == "Z"


def test_staging_folders_of_dead_runs_are_removed_live_ones_kept(tmp_path):
    model = small_model(tmp_path / "m.onnx")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale, live, foreign = tmp_path / ".out-dead1", tmp_path / ".out-live1", tmp_path / ".out-nopid"
    other_host = tmp_path / ".out-otherhost1"
    host = socket.gethostname()
    for d, owner in ((stale, f"{host} {dead.stdout.strip()}"), (live, f"{host} {os.getpid()}"),
                     (other_host, f"not-{host} {dead.stdout.strip()}")):
        d.mkdir()
        (d / ".owner-pid").write_text(owner)
        (d / "model.onnx").write_bytes(b"x" * 1000)
    foreign.mkdir()
    r = rewrite("apply", model, "--plugins", "cast", "-o", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert not stale.exists() and live.exists() and foreign.exists() and other_host.exists()
    assert not (tmp_path / "out" / ".owner-pid").exists()


def test_verify_says_when_a_plugin_changes_outputs_by_design(tmp_path):
    rng = np.random.default_rng(0)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["m"], name="mm"), helper.make_node("Relu", ["m"], ["y"], name="relu")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 32])],
                          [numpy_helper.from_array(rng.standard_normal((64, 32)).astype(np.float32), "W")])
    model = tmp_path / "mm.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), model)
    out = tmp_path / "q4"
    r = rewrite("apply", model, "--plugins", "quant4", "--opt", "quant4.min_elements=0", "-o", out)
    assert r.returncode == 0, r.stderr
    r = rewrite("verify", out / "model.onnx", out)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "plugins: quant4 (quant4 change outputs by design: compare with the model they produced)" in r.stdout.splitlines()[0]


def test_unknown_plugin_lists_available(tmp_path):
    r = rewrite("apply", small_model(tmp_path / "m.onnx"), "--plugins", "cast,nope", "-o", tmp_path / "o")
    assert r.returncode == 2
    from rewrite.plugins.manager import available_plugins

    assert r.stderr.strip() == f"error: unknown plugin 'nope'; available: {', '.join(sorted(available_plugins()))}"


def test_bad_dim_names_the_symbolic_dims(tmp_path):
    r = rewrite("apply", small_model(tmp_path / "m.onnx"), "--dim", "seq=1", "-o", tmp_path / "o")
    assert r.returncode == 2
    assert "'seq' is not a symbolic dim of the graph inputs; they are: N" in r.stderr


@pytest.mark.slow
def test_generate_compare_feeds_the_reference_the_folders_tokens(qwen2_moe_tiny, tmp_path):
    """`generate --compare MODEL`: one line per call with the logits error, PASS within the dtype's tolerance
    (exit 0); against a model the folder does not compute (the float source of a quant4 folder) FAIL, exit 1,
    with the note that quant4 changes outputs by design."""
    model = qwen2_moe_tiny
    kv, q4 = tmp_path / "kv", tmp_path / "q4"
    assert rewrite("apply", model, "--plugins", "kv,topk,moe", "--max-seq", "16", "-o", kv, "--quiet").returncode == 0
    r = rewrite("generate", kv, "--prompt-ids", "11,22,33", "--max-new-tokens", "3", "--compare", model)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[1].startswith("compare: ") and "plugins: kv, topk, moe" in lines[1]
    assert [ln.split()[0] for ln in lines[2:5]] == ["prefill", "decode", "decode"]
    assert all("(ok, FLOAT tolerance)" in ln for ln in lines[2:5])
    assert lines[-1].startswith("compare: PASS") and lines[-1].endswith("3 of 3 tokens equal")
    tokens = [int(t) for t in lines[0].split(",")]
    assert [int(re.search(r"token +(\d+)", ln).group(1)) for ln in lines[2:5]] == tokens

    assert rewrite("apply", model, "--plugins", "quant4", "-o", q4, "--quiet").returncode == 0
    r = rewrite("generate", q4, "--prompt-ids", "11,22,33", "--max-new-tokens", "2", "--compare", model)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "quant4 change outputs by design" in r.stdout and "FAIL, FLOAT tolerance" in r.stdout
    assert r.stdout.splitlines()[-1].startswith("compare: FAIL")
