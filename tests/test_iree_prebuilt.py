"""``rewrite apply --module-from``: an IREE folder whose module was compiled elsewhere, weights written here.

On the seed form (fp16, INT4 experts) with the fusing plugins and a stateful cache:

* weights written with ``--module-from`` (in another process, with another hash seed, on a model whose large
  weights differ from the compiled one's) are byte-identical to a fresh compile's ``.irpa`` of that model, and the
  folder decodes the same tokens with the same logits;
* a different rewritten graph, other compile options, a compiled folder without module or with a malformed
  ``params.json``, and file names outside the folder are refused with one line naming what differs, and nothing is
  left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import numpy_helper

from rewrite.backends.iree_prebuilt import PARAMS_INDEX, graph_digest
from rewrite.cli import cli
from rewrite.errors import BackendError
from rewrite.generate import Generator
from rewrite.pipeline import apply

PLUGINS = "quant4,cast,legalize,expand,kv,topk,moe"
PROMPT = [7, 300, 41, 9]


@pytest.fixture(scope="module")
def seed_fp16(tmp_path_factory):
    import seed_form

    model, _ = seed_form.build_seed_model("fp16", seed=3)
    return seed_form.save_seed_model(model, tmp_path_factory.mktemp("seed16") / "seed_fp16.onnx")


@pytest.fixture(scope="module")
def compiled(seed_fp16, tmp_path_factory):
    folder = tmp_path_factory.mktemp("compiled") / "iree"
    apply(seed_fp16, folder, plugins=PLUGINS, backend="iree", options={"stateful": True})
    return folder


@pytest.fixture(scope="module")
def perturbed(seed_fp16, tmp_path_factory):
    """The seed model with its largest float initializer scaled by 1.5: the same graph, other weights."""
    model = onnx.load(str(seed_fp16))
    t = max((t for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT16), key=lambda t: np.prod(t.dims))
    assert np.prod(t.dims) >= 4096  # an .irpa parameter, not a constant compiled into the module
    t.CopyFrom(numpy_helper.from_array((numpy_helper.to_array(t) * 1.5).astype(np.float16), t.name))
    path = tmp_path_factory.mktemp("perturbed") / "seed_fp16.onnx"
    onnx.save(model, str(path))
    return path


def _apply_cli(*args, hash_seed: str = "7") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    return subprocess.run([sys.executable, "-m", "rewrite.cli", "apply", *map(str, args), "--quiet"],
                          capture_output=True, text=True, env=env)


def test_module_from_writes_this_machines_weights(perturbed, compiled, tmp_path):
    fresh = tmp_path / "fresh"
    apply(perturbed, fresh, plugins=PLUGINS, backend="iree", options={"stateful": True})
    assert (fresh / "model.irpa").read_bytes() != (compiled / "model.irpa").read_bytes()
    reused = tmp_path / "reused"
    r = _apply_cli(perturbed, "--plugins", PLUGINS, "--backend", "iree", "--stateful", "--module-from", compiled,
                   "-o", reused)
    assert r.returncode == 0, r.stderr
    assert (reused / "model.irpa").read_bytes() == (fresh / "model.irpa").read_bytes()
    a, b = Generator(fresh).generate(PROMPT, 6), Generator(reused).generate(PROMPT, 6)
    assert a.tokens == b.tokens
    for la, lb in zip(a.logits, b.logits):
        np.testing.assert_array_equal(la, lb)
    assert json.loads((reused / "manifest.json").read_text())["state"] == json.loads((compiled / "manifest.json").read_text())["state"]


def test_params_index_names_every_parameter_of_the_irpa(compiled):
    import iree.runtime as rt

    index = json.loads((compiled / PARAMS_INDEX).read_text())
    archive = rt.ParameterIndex()
    archive.load(str(compiled / "model.irpa"))
    assert sorted(key for _, key in index["keys"]) == sorted(key for key, _ in archive.items())
    assert index["graph_digest"] == graph_digest(compiled / "model.onnx", index["param_threshold"])


def test_digest_ignores_large_weights_in_typed_fields_and_sees_small_ones(tmp_path):
    from onnx import TensorProto, helper

    def model(big: float, small: float):
        w = helper.make_tensor("w", TensorProto.FLOAT, [64, 128], np.full(64 * 128, big, np.float32))  # float_data
        b = helper.make_tensor("b", TensorProto.FLOAT, [128], np.full(128, small, np.float32))
        g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", ["y", "b"], ["z"])],
                              "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 128])], [w, b])
        path = tmp_path / f"m_{big}_{small}.onnx"
        onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
        return path

    assert graph_digest(model(1.0, 0.0), 4096) == graph_digest(model(2.0, 0.0), 4096)
    assert graph_digest(model(1.0, 0.0), 4096) != graph_digest(model(1.0, 0.5), 4096)


def test_another_rewritten_graph_is_refused(seed_fp16, compiled, tmp_path):
    with pytest.raises(BackendError, match=r"compiled from another rewritten graph .* --plugins"):
        apply(seed_fp16, tmp_path / "o", plugins="cast,legalize,expand,kv,topk,moe", backend="iree",
              options={"stateful": True, "module_from": str(compiled)})
    assert not (tmp_path / "o").exists()


def _copy(compiled, dst, *, drop=(), manifest=None, index=None):
    dst.mkdir()
    for f in compiled.iterdir():
        if f.is_file() and f.name not in drop:
            shutil.copyfile(f, dst / f.name)
    if manifest:
        m = json.loads((dst / "manifest.json").read_text())
        m.update(manifest)
        (dst / "manifest.json").write_text(json.dumps(m))
    if index is not None:
        (dst / PARAMS_INDEX).write_text(json.dumps(index))
    return dst


@pytest.mark.parametrize("case, target, message", [
    ("not stateful", "llvm-cpu", "compiled with --stateful; apply here with it too"),
    ("other target", "cuda", "an iree/llvm-cpu folder; expected an iree/cuda one"),
    ("no module", "llvm-cpu", "has no compiled module (model.vmfb)"),
    ("no params.json", "llvm-cpu", f"no {PARAMS_INDEX} (the folder was not written by"),
    ("params.json without digest", "llvm-cpu", f"{PARAMS_INDEX} lacks a graph_digest"),
    ("other CPU", "llvm-cpu", "compiled for the CPU 'another CPU', this machine's is"),
    ("other SM", "cuda", "compiled for sm_90, here for sm_80 (--cuda-sm must be the same)"),
    ("kernel object outside", "llvm-cpu", "its manifest names the file '../k.o', which is not inside the folder"),
])
def test_refusals_name_what_differs_and_leave_nothing(seed_fp16, compiled, tmp_path, case, target, message):
    src = {
        "not stateful": lambda d: compiled,
        "other target": lambda d: compiled,
        "no module": lambda d: _copy(compiled, d, drop=("model.vmfb",)),
        "no params.json": lambda d: _copy(compiled, d, drop=(PARAMS_INDEX,)),
        "params.json without digest": lambda d: _copy(compiled, d, index={"format": "rewrite-params/1", "keys": []}),
        "other CPU": lambda d: _copy(compiled, d, manifest={"target_options": {"host_cpu": "another CPU"}}),
        "other SM": lambda d: _copy(compiled, d, manifest={"target": "cuda", "target_options": {"cuda_sm": "sm_90"}}),
        "kernel object outside": lambda d: _copy(compiled, d, manifest={"kernel_objects": ["../k.o"]}),
    }[case](tmp_path / "compiled")
    args = [seed_fp16, "--plugins", PLUGINS, "--backend", "iree", "--target", target, "--module-from", src,
            "-o", tmp_path / "o"]
    r = _apply_cli(*args, *([] if case == "not stateful" else ["--stateful"]))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: --module-from {src}: ") and message in lines[0], lines[0]
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.failed").exists()


def test_module_from_needs_the_iree_backend(seed_fp16, compiled, tmp_path):
    r = CliRunner().invoke(cli, ["apply", str(seed_fp16), "--plugins", PLUGINS, "--module-from", str(compiled),
                                 "-o", str(tmp_path / "o2")])
    assert r.exit_code == 2 and "--module-from needs --backend iree" in r.output


def test_parameter_archive_that_cannot_be_written_is_one_line(tmp_path):
    """The .irpa writer's failure (a full disk; here a folder that does not exist) is a BackendError naming the
    archive, the bytes it needs and the space left, not the runtime's traceback."""
    from rewrite.backends.iree_import import save_params
    from rewrite.errors import BackendError

    w = numpy_helper.from_array(np.ones(4, np.float32), "w")
    target = tmp_path / "missing" / "model.irpa"
    with pytest.raises(BackendError, match=r"cannot write the parameter archive .*model\.irpa \(.*; it needs 0\.00 GB, "
                                           r"[0-9.]+ GB free there\)") as e:
        save_params([("w", "w")], {"w": w}, str(tmp_path), str(target))
    assert "\n" not in str(e.value)
