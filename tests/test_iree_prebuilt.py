"""``rewrite apply --module-from``: an IREE folder whose module was compiled elsewhere, weights written here.

On the seed form (fp16, INT4 experts) with the fusing plugins and a stateful cache: the folder written with
``--module-from`` holds the same ``.irpa`` bytes as the compiled one and decodes the same tokens with the same
logits; a different rewritten graph, other compile options and a folder without ``params.json`` are refused
with one line naming what differs.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

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


def test_module_from_writes_the_same_weights_and_decodes_the_same(seed_fp16, compiled, tmp_path):
    out = tmp_path / "reused"
    m = apply(seed_fp16, out, plugins=PLUGINS, backend="iree", options={"stateful": True, "module_from": str(compiled)})
    assert (out / "model.irpa").read_bytes() == (compiled / "model.irpa").read_bytes()
    assert (out / "model.vmfb").read_bytes() == (compiled / "model.vmfb").read_bytes()
    assert m.state and m.state == json.loads((compiled / "manifest.json").read_text())["state"]
    a, b = Generator(compiled).generate(PROMPT, 6), Generator(out).generate(PROMPT, 6)
    assert a.tokens == b.tokens
    for la, lb in zip(a.logits, b.logits):
        np.testing.assert_array_equal(la, lb)


def test_params_index_names_every_parameter_of_the_irpa(compiled):
    import iree.runtime as rt

    index = json.loads((compiled / PARAMS_INDEX).read_text())
    archive = rt.ParameterIndex()
    archive.load(str(compiled / "model.irpa"))
    assert sorted(key for _, key in index["keys"]) == sorted(key for key, _ in archive.items())
    assert index["graph_digest"] == graph_digest(compiled / "model.onnx", index["param_threshold"])


def test_another_rewritten_graph_is_refused(seed_fp16, compiled, tmp_path):
    with pytest.raises(BackendError, match=r"compiled from another rewritten graph .* --plugins"):
        apply(seed_fp16, tmp_path / "o", plugins="cast,legalize,expand,kv,topk,moe", backend="iree",
              options={"stateful": True, "module_from": str(compiled)})
    assert not (tmp_path / "o").exists()


def test_other_compile_options_are_refused(seed_fp16, compiled, tmp_path):
    with pytest.raises(BackendError, match="compiled with --stateful; apply here with it too"):
        apply(seed_fp16, tmp_path / "o", plugins=PLUGINS, backend="iree", options={"module_from": str(compiled)})
    with pytest.raises(BackendError, match="a iree/llvm-cpu folder; expected a compiled iree/cuda one"):
        apply(seed_fp16, tmp_path / "o", plugins=PLUGINS, backend="iree", target="cuda",
              options={"stateful": True, "module_from": str(compiled)})


def test_a_folder_without_params_index_is_refused_on_the_command_line(seed_fp16, compiled, tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    for f in compiled.iterdir():
        if f.is_file() and f.name != PARAMS_INDEX:
            (old / f.name).write_bytes(f.read_bytes())
    r = subprocess.run([sys.executable, "-m", "rewrite.cli", "apply", str(seed_fp16), "--plugins", PLUGINS, "--backend",
                        "iree", "--stateful", "--module-from", str(old), "-o", str(tmp_path / "o"), "--quiet"],
                       capture_output=True, text=True)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: --module-from {old}: no {PARAMS_INDEX}")
    r = CliRunner().invoke(cli, ["apply", str(seed_fp16), "--plugins", PLUGINS, "--module-from", str(compiled),
                                 "-o", str(tmp_path / "o2")])
    assert r.exit_code == 2 and "--module-from needs --backend iree" in r.output
