"""The command line refuses, before any work and in one line, what would overwrite the model or the output
folder, external data outside the model's folder, option values out of range, and options nobody reads."""

from __future__ import annotations

import stat
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from test_cli import rewrite, small_model


def external_model(folder, location: str):
    """y = x @ W with W [4, 4] f32 stored as external data at ``location`` (relative to ``folder``, unchecked)."""
    w = numpy_helper.from_array(np.eye(4, dtype=np.float32), "W")
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", "64")):
        w.external_data.add(key=key, value=value)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [w])
    path = folder / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def one_error(r, text: str) -> None:
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and text in lines[0], r.stderr


@pytest.mark.parametrize("option", ["--report", "--stages"])
def test_a_report_on_the_model_is_refused_and_the_model_kept(tmp_path, option):
    model = small_model(tmp_path / "m.onnx")
    before = model.read_bytes()
    r = rewrite("apply", model, "--plugins", "cast", "-o", tmp_path / "out", option, model)
    one_error(r, f"{option} {model}: that is the model")
    assert model.read_bytes() == before and not (tmp_path / "out").exists()


def test_explain_json_on_the_model_is_refused(tmp_path):
    model = small_model(tmp_path / "m.onnx")
    before = model.read_bytes()
    one_error(rewrite("explain", model, "--plugins", "cast", "--json", model), "that is the model")
    assert model.read_bytes() == before


def test_a_report_on_the_model_s_external_data_is_refused(tmp_path):
    (tmp_path / "w.bin").write_bytes(np.eye(4, dtype=np.float32).tobytes())
    model = external_model(tmp_path, "w.bin")
    r = rewrite("apply", model, "--plugins", "cast", "-o", tmp_path / "out", "--report", tmp_path / "w.bin")
    one_error(r, "that is the model")
    assert (tmp_path / "w.bin").read_bytes() == np.eye(4, dtype=np.float32).tobytes()


def test_a_report_that_is_the_output_folder_is_refused(tmp_path):
    out = tmp_path / "out"
    one_error(rewrite("apply", small_model(tmp_path / "m.onnx"), "--plugins", "cast", "-o", out, "--report", out),
              "that is the output folder")
    assert not out.exists()


def test_a_report_named_as_a_file_of_the_output_folder_is_refused(tmp_path):
    out = tmp_path / "out"
    r = rewrite("apply", small_model(tmp_path / "m.onnx"), "--plugins", "cast", "-o", out, "--report", out / "model.onnx")
    one_error(r, "the output folder's own model.onnx")
    assert not out.exists()


def test_a_report_that_is_a_folder_above_the_output_folder_is_refused(tmp_path):
    out = tmp_path / "nd" / "out"
    one_error(rewrite("apply", small_model(tmp_path / "m.onnx"), "--plugins", "cast", "-o", out, "--report", tmp_path / "nd"),
              "that is the output folder or a folder above it")
    assert not out.exists()


def test_a_report_on_external_data_behind_a_link_is_refused(tmp_path):
    """As a Hugging Face cache lays a snapshot out: the model and its data are links into another folder."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snap"
    blobs.mkdir()
    snap.mkdir()
    (blobs / "w").write_bytes(np.eye(4, dtype=np.float32).tobytes())
    (snap / "w.bin").symlink_to(blobs / "w")
    external_model(blobs, "w.bin").rename(blobs / "m")
    (snap / "m.onnx").symlink_to(blobs / "m")
    r = rewrite("apply", snap / "m.onnx", "--plugins", "cast", "-o", tmp_path / "out", "--report", snap / "w.bin")
    one_error(r, "that is the model")
    assert (blobs / "w").read_bytes() == np.eye(4, dtype=np.float32).tobytes()


@pytest.mark.parametrize("location", ["../w.bin", "/etc/hostname"])
def test_external_data_outside_the_model_folder_is_refused(tmp_path, location):
    folder = tmp_path / "m"
    folder.mkdir()
    (tmp_path / "w.bin").write_bytes(np.eye(4, dtype=np.float32).tobytes())
    r = rewrite("apply", external_model(folder, location), "--plugins", "cast", "-o", tmp_path / "out")
    assert r.returncode == 2 and "initializer 'W' has its external data at" in r.stderr and "outside the model's folder" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dims, text", [(["N=99999999999999999999"], "past an ONNX dim's int64 range"), (["N=²"], "expected NAME=INT"),
                                        (["N=1", "N=2"], "N is already 1"), (["N=-1"], "expected NAME=INT with INT >= 0")])
def test_bad_dims_are_refused(tmp_path, dims, text):
    args = [a for d in dims for a in ("--dim", d)]
    one_error(rewrite("apply", small_model(tmp_path / "m.onnx"), "--plugins", "cast", "-o", tmp_path / "out", *args), text)


def test_options_for_a_plugin_that_takes_none_are_refused_in_a_dry_run_too(tmp_path):
    model = small_model(tmp_path / "m.onnx")
    for extra in (["-o", tmp_path / "out"], ["--dry-run"]):
        one_error(rewrite("apply", model, "--plugins", "cast", "--opt", "cast.bogus=1", *extra),
                  "option 'cast.bogus': plugin 'cast' takes no options")
    one_error(rewrite("apply", model, "--plugins", "cast", "--opt", "kv.max_seq=4", "--dry-run"),
              "options given for plugin 'kv', which is not among --plugins (cast)")


def test_max_seq_given_twice_differently_is_refused(tmp_path):
    one_error(rewrite("apply", small_model(tmp_path / "m.onnx"), "--plugins", "kv", "-o", tmp_path / "out",
                      "--opt", "kv.max_seq=16", "--max-seq", "32"), "--max-seq 32 and --opt kv.max_seq=16 disagree")


@pytest.mark.parametrize("value, text", [("abc", "option 'max_seq' must be an integer (got 'abc')"),
                                         ("8388608", "kv: max_seq 8388608 (--max-seq or --opt kv.max_seq): must be positive and at most 4194304")])
def test_kv_max_seq_out_of_range_is_refused(tmp_path, value, text):
    r = rewrite("apply", small_model(tmp_path / "m.onnx"), "--plugins", "kv", "-o", tmp_path / "out", "--opt", f"kv.max_seq={value}")
    assert r.returncode == 2 and text in r.stderr, r.stderr


@pytest.mark.parametrize("args, text", [(["--prompt-ids", "99999999999999999999"], "item 1 of 1 ('99999999999999999999')"),
                                        (["--prompt-ids", "1,,3"], "item 2 of 3 (''): expected a token id"),
                                        (["--prompt-ids", "1,-2"], "item 2 of 2 ('-2')"),
                                        (["--prompt-ids", "1", "--max-new-tokens", "-3"], "-3 is not in the range x>=0")])
def test_generate_refuses_bad_values_before_loading(tmp_path, args, text):
    one_error(rewrite("generate", tmp_path, *args), text)


@pytest.mark.parametrize("rtol", ["-1", "nan", "inf"])
def test_verify_refuses_a_tolerance_that_is_not_a_finite_number_at_least_0(tmp_path, rtol):
    model = small_model(tmp_path / "m.onnx")
    one_error(rewrite("verify", model, tmp_path, "--rtol", rtol), "expected a finite number >= 0")


def test_a_backend_error_names_the_requested_folder_not_the_staging_one(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])
    k = numpy_helper.from_array(np.array([12], np.int64), "k")
    g = helper.make_graph([helper.make_node("TopK", ["x", "k"], ["v", "i"], name="tk")], "g", [x],
                          [helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, 12]),
                           helper.make_tensor_value_info("i", TensorProto.INT64, [1, 12])], [k])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    out = tmp_path / "out"
    r = rewrite("apply", path, "--plugins", "cast", "-o", out)
    assert r.returncode == 2 and f"{out}/model.onnx: ONNX Runtime cannot load it" in r.stderr, r.stderr
    assert f"{out} not written" in r.stderr and f".{out.name}-" not in r.stderr and not out.exists()


def test_bfloat16_inputs_and_outputs_run_and_verify_on_onnx_runtime(tmp_path):
    """ONNX Runtime's Python API converts no bfloat16 array: the runner passes them as OrtValues of their bits."""
    nodes = [helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT, name="widen"),  # (no bf16 Mul on the CPU EP)
             helper.make_node("Mul", ["xf", "two"], ["f"], name="mul"),
             helper.make_node("Cast", ["f"], ["y"], to=TensorProto.BFLOAT16, name="narrow"),
             helper.make_node("Identity", ["s"], ["s_out"], name="scalar")]  # a scalar keeps its shape []
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [2, 3]),
                                       helper.make_tensor_value_info("s", TensorProto.INT64, [])],
                          [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [2, 3]),
                           helper.make_tensor_value_info("f", TensorProto.FLOAT, [2, 3]),
                           helper.make_tensor_value_info("s_out", TensorProto.INT64, [])],
                          [numpy_helper.from_array(np.array(2.0, np.float32), "two")])
    model = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), model)
    out = tmp_path / "out"
    assert rewrite("apply", model, "--plugins", "cast", "-o", out).returncode == 0
    r = rewrite("verify", model, out, "--seed", "3")
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "verify: PASS", r.stdout + r.stderr

    import ml_dtypes

    from rewrite.backends import load_runner

    x = np.array([[1.5, -2.25, 3.0], [0.5, 8.0, -0.125]], ml_dtypes.bfloat16)
    res = load_runner(out).run({"x": x, "s": np.array(7, np.int64)})
    assert res["s_out"].shape == () and res["s_out"] == 7
    assert res["y"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(res["y"].astype(np.float32), 2 * x.astype(np.float32))
    np.testing.assert_array_equal(res["f"], 2 * x.astype(np.float32))
    # run --save keeps bfloat16 as its bits; --inputs reads them back as bfloat16 (y fed back as x: 4 x)
    saved, feeds = tmp_path / "saved.npz", tmp_path / "feeds.npz"
    np.savez(feeds, x=x, s=np.array(7, np.int64))
    assert rewrite("run", out, "--inputs", feeds, "--save", saved).returncode == 0
    with np.load(saved) as z:
        np.savez(feeds, x=z["y"], s=z["s_out"])
    assert rewrite("run", out, "--inputs", feeds, "--save", saved).returncode == 0
    with np.load(saved) as z:
        assert z["y"].dtype.kind == "V" and z["y"].dtype.itemsize == 2
        np.testing.assert_array_equal(z["f"], 4 * x.astype(np.float32))


def test_the_output_folder_takes_the_umask_not_the_staging_folder_s_0700(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run(["sh", "-c", f"umask 022 && {sys.executable} -m rewrite.cli apply {small_model(tmp_path / 'm.onnx')} "
                        f"--plugins cast -o {out}"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o755


def test_float64_graphs_keep_float64_on_iree(tmp_path):
    """iree-compile demotes f64 to f32 by default, the signature included: the module's f64 results came back
    with half their bytes and the runtime failed to view them. A graph with float64 values keeps them."""
    nodes = [helper.make_node("Sigmoid", ["a"], ["b"], name="sig"),
             helper.make_node("Cast", ["c"], ["d"], to=TensorProto.DOUBLE, name="widen")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("a", TensorProto.DOUBLE, [2, 3]),
                                       helper.make_tensor_value_info("c", TensorProto.INT8, [2])],
                          [helper.make_tensor_value_info("b", TensorProto.DOUBLE, [2, 3]),
                           helper.make_tensor_value_info("d", TensorProto.DOUBLE, [2])])
    model = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), model)
    out = tmp_path / "out"
    assert rewrite("apply", model, "--backend", "iree", "-o", out).returncode == 0
    from rewrite.backends import load_runner

    a = np.array([[1e-300, -2.0, 40.0], [0.5, -700.0, 3.0]])  # sigmoid(-700) ~ 1e-304: no float32
    res = load_runner(out).run({"a": a, "c": np.array([-7, 100], np.int8)})
    assert res["b"].dtype == np.float64 and res["d"].dtype == np.float64
    np.testing.assert_allclose(res["b"], 1 / (1 + np.exp(-a)), rtol=1e-12)
    np.testing.assert_array_equal(res["d"], [-7.0, 100.0])
