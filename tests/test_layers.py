"""The package's shape: layers that import downward only (import-linter contracts in pyproject.toml), and lowered
folders that run with the runtimes alone (no IREE compiler imported)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert exe, "import-linter is part of the [test] extra"
    r = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "Contracts: 1 kept, 0 broken." in r.stdout


def _router_model(path: Path) -> Path:
    nodes = [helper.make_node("Softmax", ["logits"], ["p"], axis=-1, name="softmax"),
             helper.make_node("TopK", ["p", "k"], ["w", "ids"], axis=-1, name="topk")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("logits", TP.FLOAT, ["T", 8])],
                          [helper.make_tensor_value_info("w", TP.FLOAT, ["T", 2]), helper.make_tensor_value_info("ids", TP.INT64, ["T", 2])],
                          [numpy_helper.from_array(np.array([2], np.int64), "k")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    onnx.save(m, path)
    return path


@pytest.mark.parametrize("backend", ["ort", "iree"])
def test_running_a_folder_imports_no_compiler(tmp_path, backend):
    """A deployment machine needs iree-base-runtime or onnxruntime only: with ``iree.compiler`` made
    unimportable, a folder moved elsewhere still loads and runs through ``rewrite.backends.load_runner``."""
    from rewrite.pipeline import apply

    apply(_router_model(tmp_path / "m.onnx"), tmp_path / "made", plugins="topk", backend=backend)
    shutil.move(tmp_path / "made", tmp_path / "moved")  # the folder holds all it needs (kernels, params)
    script = textwrap.dedent(f"""
        import sys
        sys.modules["iree.compiler"] = None  # any import of the compiler package now fails
        import numpy as np
        from rewrite.backends import load_runner
        out = load_runner({str(tmp_path / "moved")!r}).run({{"logits": np.arange(24, dtype=np.float32).reshape(3, 8)}})
        print(out["ids"].tolist())
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[[7, 6], [7, 6], [7, 6]]"
