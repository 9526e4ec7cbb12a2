"""The package's shape: layers that import downward only (import-linter contracts in pyproject.toml), and lowered
folders that run with the runtimes alone (no IREE compiler imported)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert exe, "import-linter is part of the [test] extra"
    r = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "Contracts: 1 kept, 0 broken." in r.stdout


@pytest.mark.parametrize("backend", ["ort", "iree"])
def test_running_a_folder_imports_no_compiler(tmp_path, backend, router_onnx):
    """A deployment machine needs iree-base-runtime or onnxruntime only: with ``iree.compiler`` made
    unimportable, a folder moved elsewhere still loads and runs through ``rewrite.backends.load_runner``."""
    from rewrite.pipeline import apply

    apply(router_onnx, tmp_path / "made", plugins="topk", backend=backend)
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
