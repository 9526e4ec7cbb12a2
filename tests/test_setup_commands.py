"""The README's two set-up commands are the ones CI runs, and every package the examples import is declared."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_setup_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```\n(.*?)```", text, re.S)
    assert block, "README.md has no code block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_readme_opens_with_two_setup_commands_that_ci_runs():
    commands = _readme_setup_commands()
    assert len(commands) == 2, commands
    assert commands[0].startswith("pip install -e '.[examples]'") and "examples/demo.py" in commands[0]
    assert commands[1].startswith("pip install -e '.[test]'") and "pytest" in commands[1]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for command in commands:  # each as written, failing the run when any part of it fails
        assert f"{command} || exit 1" in ci, f".ci/run does not run the README's command {command!r}"
    assert any("venv" in line and not line.lstrip().startswith("#") for line in ci), ".ci/run makes no venv"


def _distribution_of(module: str) -> str:
    return {"onnx_ir": "onnx-ir", "yaml": "pyyaml"}.get(module, module.replace("_", "-"))


def _third_party_imports(folder: Path) -> set[str]:
    stdlib = set(sys.stdlib_module_names)
    local = {p.stem for p in folder.glob("*.py")} | {"rewrite"}
    found = set()
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
            found |= {n.split(".")[0] for n in names}
    return found - stdlib - local


def test_examples_import_only_declared_packages():
    """A fresh ``pip install -e '.[examples]'`` must be enough for every script in ``examples/``."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=\[ ;]", d)[0].lower() for d in project["dependencies"]}
    declared |= {re.split(r"[<>=\[ ;]", d)[0].lower() for d in project["optional-dependencies"]["examples"]}
    missing = {m for m in _third_party_imports(ROOT / "examples") if _distribution_of(m) not in declared}
    assert not missing, f"examples/ import packages pyproject.toml does not declare in [examples]: {sorted(missing)}"
