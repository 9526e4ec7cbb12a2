"""The rmsnorm plugin: registered through its entry point, and conformant (the rewrite kit's checks)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from rewrite.plugins.manager import available_plugins
from rewrite.testing.pytest_plugin import conformance_params


def test_registered_through_the_entry_point():
    p = available_plugins()["rmsnorm"]
    assert type(p).__module__ == "rewrite_rmsnorm.plugin"
    assert [r.name for r in p.rules] == ["rms-norm"]


@pytest.mark.parametrize("check", conformance_params(["rmsnorm"], Path(tempfile.mkdtemp(prefix="rmsnorm-"))))
def test_conformance(check):
    check.run()
