"""Plugins run in one order whatever the order of --plugins: declared constraints, then registration order."""

from __future__ import annotations

import itertools

import pytest

from rewrite.errors import PluginOrderError
from rewrite.plugins.base import Plugin
from rewrite.plugins.manager import _ordered, select_plugins


@pytest.mark.parametrize("names", list(itertools.permutations(["topk", "quant4", "moe", "legalize"])))
def test_any_order_of_the_same_plugins_runs_the_same(names):
    assert [p.short for p in select_plugins(list(names))] == ["quant4", "topk", "moe", "legalize"]


def test_unconstrained_plugins_keep_registration_order():
    assert [p.short for p in select_plugins("kv,expand,cast")] == ["cast", "expand", "kv"]


def test_contradictory_declarations_name_the_plugins():
    class A(Plugin):
        short = "a"
        runs_before = ("b",)

    class B(Plugin):
        short = "b"
        runs_before = ("a",)

    with pytest.raises(PluginOrderError, match="a after b, b after a"):
        _ordered([A(), B()])


def test_declarations_about_unselected_plugins_are_ignored():
    class A(Plugin):
        short = "a"
        runs_after = ("not-selected",)

    assert [p.short for p in _ordered([A()])] == ["a"]
