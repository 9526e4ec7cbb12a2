"""The conformance kit: the built-in plugins pass it, and each check fails on a plugin that breaks its promise."""

from __future__ import annotations

import atexit
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto as TP
from onnx import helper

from rewrite.core.abstract_ops import AbstractOp
from rewrite.core.pattern import AttrVar
from rewrite.core.rules import Builder, rule
from rewrite.errors import RewriteError
from rewrite.plugins.base import Plugin
from rewrite.plugins.cast_roundtrip import CastRoundtrip
from rewrite.testing.cases import bad_input, negative, positive
from rewrite.testing.conformance import ConformanceFailure, checks_for
from rewrite.testing.pytest_plugin import conformance_params

_WORK = Path(tempfile.mkdtemp(prefix="rewrite-conformance-builtin-"))
atexit.register(shutil.rmtree, _WORK, ignore_errors=True)  # lowered models and compiled modules


# ----------------------------------------------------------- built-in plugins
def _builtin_plugins() -> list[str]:
    from rewrite.plugins.manager import available_plugins

    return [short for short, p in available_plugins().items() if type(p).__module__.startswith("rewrite.plugins.")]


@pytest.mark.parametrize("check", conformance_params(_builtin_plugins(), _WORK))
def test_builtin_plugin_conformance(check):
    check.run()


def test_every_builtin_plugin_declares_positive_and_negative_cases():
    from rewrite.plugins.manager import select_plugins

    for p in select_plugins(_builtin_plugins()):
        kinds = {c.kind for c in p.cases}
        assert {"positive", "negative"} <= kinds, f"plugin '{p.short}' declares {sorted(kinds)}"


def test_builtin_plugins_declare_every_kind_of_check():
    ids = [c.id for c in checks_for(CastRoundtrip(), _WORK)]
    assert "cast/f16-f32-f16-after-softmax/numerics-iree" in ids and "cast/lossy-f32-f16-f32/untouched" in ids
    assert sum(i.endswith("/untouched") for i in ids) == 5
    assert sum(i.endswith("/numerics-ort") for i in ids) == sum(i.endswith("/numerics-iree") for i in ids) == 2


# ------------------------------------------------- each check can fail
def _chain(t, w, back):
    nodes = [helper.make_node("Cast", ["X"], ["W"], to=w, name="inner"), helper.make_node("Cast", ["W"], ["Y"], to=back, name="outer")]
    g = helper.make_graph(nodes, "main_graph", [helper.make_tensor_value_info("X", t, [4])], [helper.make_tensor_value_info("Y", back, [4])])
    return lambda: helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


@rule("any-cast-pair")
def _any_cast_pair(op, x):
    """Removes every Cast pair, lossy or not (wrong on purpose)."""
    return op.Cast(op.Cast(x, to=AttrVar("w")), to=AttrVar("n"))


@_any_cast_pair.rewrite
def _(m, b):
    return m["x"]


@rule("neg-forever")
def _neg_forever(op, x):
    """Replaces a Neg by a new Neg: fires again on its own output (wrong on purpose)."""
    return op.Neg(x)


@_neg_forever.rewrite
def _(m, b):
    return b.op("Neg", [m["x"]])


class _Broken(Plugin):
    name = short = "broken"
    backends = ("ort",)

    def __init__(self, rules, cases, ops=()):
        self._rules, self._cases, self._ops = rules, cases, ops

    @property
    def rules(self):
        return self._rules

    @property
    def cases(self):
        return self._cases

    @property
    def abstract_ops(self):
        return list(self._ops)


def _run(plugin, check_name):
    (c,) = [c for c in checks_for(plugin, Path(tempfile.mkdtemp())) if c.name == check_name]
    c.run()


def test_negative_case_fails_when_a_lossy_pair_is_removed():
    p = _Broken([_any_cast_pair], [negative("lossy", _chain(TP.FLOAT, TP.FLOAT16, TP.FLOAT))])
    with pytest.raises(ConformanceFailure, match=r"case 'lossy', check 'untouched': expected no match, got \{'any-cast-pair': 1\}"):
        _run(p, "untouched")


def test_numerics_fail_when_the_rewrite_changes_results():
    p = _Broken([_any_cast_pair], [positive("lossy", _chain(TP.FLOAT, TP.FLOAT16, TP.FLOAT), matches=1,
                                            feeds=lambda m: {"X": np.array([1e-8, 0.1, 1 / 3, 7e4], np.float32)})])
    _run(p, "matches")
    with pytest.raises(ConformanceFailure, match=r"check 'numerics-ort': FAIL Y"):
        _run(p, "numerics-ort")


def test_match_count_must_be_exact():
    case = _chain(TP.FLOAT16, TP.FLOAT, TP.FLOAT16)
    with pytest.raises(ConformanceFailure, match="expected 2 matches, got 1"):
        _run(_Broken([_any_cast_pair], [positive("once", case, matches=2)]), "matches")
    with pytest.raises(ConformanceFailure, match=r"expected matches per rule \{'any-cast-pair': 0\}, got \{'any-cast-pair': 1\}"):
        _run(_Broken([_any_cast_pair], [positive("once", case, matches={"any-cast-pair": 0})]), "matches")


def test_idempotence_fails_for_a_rule_that_fires_on_its_own_output():
    g = helper.make_graph([helper.make_node("Neg", ["X"], ["Y"])], "main_graph", [helper.make_tensor_value_info("X", TP.FLOAT, [4])],
                          [helper.make_tensor_value_info("Y", TP.FLOAT, [4])])
    p = _Broken([_neg_forever], [positive("neg", lambda: helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10), matches=16)])
    _run(p, "matches")  # the driver's bound on passes stops it
    with pytest.raises(ConformanceFailure, match="a second run matched again"):
        _run(p, "idempotent")


def test_checker_fails_on_an_invalid_output():
    @rule("bad-attr")
    def bad(op, x):
        return op.Neg(x)

    @bad.rewrite
    def _(m, b):
        return b.op("Relu", [m["x"]], alpha=1.0)  # Relu has no attribute 'alpha'

    g = helper.make_graph([helper.make_node("Neg", ["X"], ["Y"])], "main_graph", [helper.make_tensor_value_info("X", TP.FLOAT, [4])],
                          [helper.make_tensor_value_info("Y", TP.FLOAT, [4])])
    p = _Broken([bad], [positive("neg", lambda: helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10))])
    with pytest.raises(ConformanceFailure, match="check 'checker'.*alpha"):
        _run(p, "checker")


def test_bad_input_case_needs_the_declared_error():
    @rule("refuse")
    def refuse(op, x):
        return op.Neg(x)

    @refuse.rewrite
    def _(m, b):
        raise RewriteError(f"value '{m['x']}' is not supported")

    case = _chain(TP.FLOAT16, TP.FLOAT, TP.FLOAT16)
    g = helper.make_graph([helper.make_node("Neg", ["X"], ["Y"], name="neg")], "main_graph", [helper.make_tensor_value_info("X", TP.FLOAT, [4])],
                          [helper.make_tensor_value_info("Y", TP.FLOAT, [4])])
    neg = lambda: helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)  # noqa: E731
    _run(_Broken([refuse], [bad_input("neg", neg, error="value 'X' is not supported")]), "error")
    with pytest.raises(ConformanceFailure, match="expected an error containing 'shape'"):
        _run(_Broken([refuse], [bad_input("neg", neg, error="shape")]), "error")
    with pytest.raises(ConformanceFailure, match="nothing was raised"):
        _run(_Broken([refuse], [bad_input("no-neg", case, error="x")]), "error")


# -------------------------------------------------------- kernel samples
class _RowMax(AbstractOp):
    """values [N, 1] = max(x, -1) * scale for x [N, E] float32; lowered for ORT as ReduceMax then Mul."""

    op_type = "TestConformanceRowMax"

    def __init__(self, wrong: bool = False):
        self.wrong = wrong

    def reference(self, attrs, x):
        return [x.max(-1, keepdims=True) * attrs["scale"]]

    def lower_ort(self, graph, node):
        b = Builder(graph, "lower/rowmax", node.order, node.name)
        red = b.op("ReduceMin" if self.wrong else "ReduceMax", [node.inputs[0], b.const([-1], "axes", np.int64)], keepdims=1)
        graph.replace_node(node, [b.op("Mul", [red, b.const(np.float32(node.attr("scale")), "scale")])])

    def sample_inputs(self, rng):
        return [({"scale": 0.5}, [rng.standard_normal((n, e)).astype(np.float32)]) for n, e in ((1, 8), (7, 3), (33, 5))]


def test_kernel_samples_are_compared_with_the_reference():
    ok = [c for c in checks_for(_Broken([], [], [_RowMax()]), Path(tempfile.mkdtemp()))]
    assert [c.id for c in ok] == ["broken/op-TestConformanceRowMax/kernel-ort"]
    ok[0].run()
    (bad,) = checks_for(_Broken([], [], [_RowMax(wrong=True)]), Path(tempfile.mkdtemp()))
    with pytest.raises(ConformanceFailure, match=r"TestConformanceRowMax on ort, sample 0 \(attrs \{'scale': 0.5\}, input shapes \[\[1, 8\]\]\)"):
        bad.run()


# ------------------------------------------------------ the pytest plugin
def test_pytest_option_generates_one_item_per_check(tmp_path):
    (tmp_path / "test_own.py").write_text("def test_own():\n    pass\n")
    # every item collected, run or deselected by -k, written down by the package's conftest (one pytest run)
    (tmp_path / "conftest.py").write_text(
        "def pytest_deselected(items):\n"
        "    with open('items.txt', 'a') as f:\n"
        "        f.writelines(i.nodeid + '\\n' for i in items)\n\n\n"
        "def pytest_collection_finish(session):\n"
        "    with open('items.txt', 'a') as f:\n"
        "        f.writelines(i.nodeid + '\\n' for i in session.items)\n")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rewrite-plugin=cast", "-k", "untouched or own", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "6 passed" in r.stdout  # 5 negative cases of 'cast' + the package's own test
    items = [line for line in (tmp_path / "items.txt").read_text().splitlines() if "rewrite-conformance::cast/" in line]
    assert len(items) == len(set(items)) == len(checks_for(CastRoundtrip(), tmp_path)) == 15


def test_an_unknown_plugin_name_is_a_usage_error_not_a_traceback(tmp_path):
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rewrite-plugin=nosuch", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 4  # pytest's usage error
    assert "ERROR: --rewrite-plugin: unknown plugin 'nosuch'; available: " in r.stderr and "INTERNALERROR" not in r.stderr + r.stdout
