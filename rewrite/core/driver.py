"""The rewrite driver: runs a plugin's rules over a graph to a fixed point and reports what happened.

Order is deterministic: rules by descending benefit, then registration order; anchors in graph order.
After each applied rewrite the pattern outputs' users are redirected to the replacement values and the
matched nodes that became dead are removed. Each plugin runs all-or-nothing: if anything raises, the graph
is restored to its state before the plugin and a :class:`~rewrite.errors.PluginError` names plugin, rule
and node.
"""

from __future__ import annotations

import copy
import gc
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Protocol, Sequence, TypeVar

from rewrite.core.ir import RULE_TAG, Graph, Node
from rewrite.core.matcher import Failure, Match, Matcher, MatchTrace
from rewrite.core.rules import Builder, Rule
from rewrite.errors import PluginError, RewriteError



class RunnablePlugin(Protocol):
    """What :func:`run_plugin` needs of a plugin (:class:`rewrite.plugins.base.Plugin` is one)."""

    short: str
    #: backends the plugin rewrites for; for any other backend :func:`run_plugin` leaves the graph alone
    backends: tuple[str, ...]

    def run(self, graph: Graph, report: "PluginReport", ctx: "RewriteContext | None" = None, *, dry_run: bool = False) -> None: ...


@dataclass
class RewriteContext:
    """Options shared by the plugins of one run (backend and target they lower for, user dims, plugin options)."""

    backend: str = "ort"
    target: str = "cpu"
    dims: dict[str, int] = field(default_factory=dict)
    options: dict = field(default_factory=dict)

T = TypeVar("T")

#: Passes over all rules before the driver stops even if rewrites still apply.
MAX_ITERATIONS = 16


@dataclass
class RuleReport:
    """What one rule did: applied matches, refusals by reason, nodes removed and added."""

    rule: str
    matches: int = 0
    refusals: dict[str, list[str]] = field(default_factory=dict)  # reason -> nodes refused (each once)
    nodes_removed: int = 0
    nodes_added: int = 0
    best_partial: Failure | None = None

    def refuse(self, reason: str, node: str) -> None:
        """Record that ``reason`` refused the match at ``node`` (a node name; each listed once per reason)."""
        nodes = self.refusals.setdefault(reason, [])
        if node not in nodes:
            nodes.append(node)

    def found(self, nodes: Iterable[Node], find: Callable[[Node], T | str | None]) -> Iterator[tuple[Node, T]]:
        """(node, match) for each of ``nodes`` (a list, not a view: passes rewrite the graph as they go) where ``find`` matches,
        for passes that find their matches themselves: ``find`` returns None (nothing there, skipped), a refusal
        reason (recorded against the node's name) or the match."""
        for node in nodes:
            got = find(node)
            if isinstance(got, str):
                self.refuse(got, node.name)
            elif got is not None:
                yield node, got

    def applied(self, removed: int, added: int, matches: int = 1) -> None:
        """Record ``matches`` applied matches that removed ``removed`` nodes and added ``added`` (for passes that
        rewrite the graph themselves instead of through a rule's rewrite)."""
        self.matches += matches
        self.nodes_removed += removed
        self.nodes_added += added

    def to_json(self) -> dict:
        d = {
            "rule": self.rule,
            "matches": self.matches,
            "nodes_removed": self.nodes_removed,
            "nodes_added": self.nodes_added,
            "refusals": [{"reason": r, "count": len(ns), "nodes": ns[:20]} for r, ns in self.refusals.items()],
        }
        if self.best_partial is not None and self.matches == 0:
            d["best_partial"] = {"reason": self.best_partial.reason, "node": self.best_partial.node, "matched": self.best_partial.pairs}
        return d


@dataclass
class PluginReport:
    """Per-plugin report: one :class:`RuleReport` per rule, plus free-form notes from the plugin."""

    plugin: str
    rules: dict[str, RuleReport] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def matches(self) -> int:
        return sum(r.matches for r in self.rules.values())

    def rule(self, name: str) -> RuleReport:
        return self.rules.setdefault(name, RuleReport(name))

    def to_json(self) -> dict:
        return {"plugin": self.plugin, "matches": self.matches, "rules": [r.to_json() for r in self.rules.values()], "notes": self.notes}


def ordered(rules: Sequence[Rule]) -> list[Rule]:
    """Rules by descending benefit; equal benefits keep registration order (Python's sort is stable)."""
    return sorted(rules, key=lambda r: -r.benefit)


def apply_rules(graph: Graph, rules: Sequence[Rule], plugin: str, report: PluginReport, *, dry_run: bool = False,
                ctx: RewriteContext | None = None) -> int:
    """Apply ``rules`` greedily until none fires (at most :data:`MAX_ITERATIONS` passes; hitting the bound
    adds a note to ``report``). The checks see ``ctx`` as ``m.ctx`` (a form one target's lowering lacks is
    refused there).

    Returns the number of rewrites applied. With ``dry_run`` nothing changes; every first acceptable match is
    counted as a match. Exceptions from rules propagate (``run_plugin`` turns them into PluginError).
    """
    total = 0
    for r in rules:  # the report lists rules in registration order, whatever order they run in
        report.rule(r.name)
    rules = ordered(rules)
    for _ in range(MAX_ITERATIONS):
        changed = False
        for r in rules:
            rep = report.rule(r.name)
            roots = r.pattern.root_op_types()
            anchors = [n for t in roots for n in graph.nodes_by_op(t, r.pattern.root(0).domain if r.pattern.root(0) else "")]
            anchors.sort(key=lambda n: n.order)
            trace = MatchTrace()
            matcher = Matcher(graph, r.pattern, trace)
            for anchor in anchors:
                if anchor.id not in graph.nodes:
                    continue
                _current[:] = [r.name, anchor.name]
                for binding in matcher.match_at(anchor):
                    m = Match(graph, r.pattern, binding, ctx)
                    fail = r.run_check(m)
                    if fail is not None:
                        rep.refuse(fail.reason, fail.node or anchor.name)
                        continue
                    rep.matches += 1
                    total += 1
                    if not dry_run:
                        _apply(graph, r, m, plugin, rep)
                        changed = True
                    break
            if rep.matches == 0 and rep.best_partial is None:
                rep.best_partial = trace.best
        if not changed or dry_run:
            break
    else:
        report.notes.append(f"stopped after {MAX_ITERATIONS} passes while rules still applied (no fixed point; a rule may re-match its own output)")
    _current[:] = []
    return total


_current: list[str] = []  # (rule, anchor node) being processed, for error messages


def _apply(graph: Graph, r: Rule, m: Match, plugin: str, rep: RuleReport) -> None:
    if r.rewrite_fn is None:
        raise RewriteError(f"rule '{r.name}' has no rewrite")
    b = Builder(graph, f"{plugin}/{r.name}", m.anchor.order, m.anchor.name or r.name)
    out = r.rewrite_fn(m, b)
    repl = list(out) if isinstance(out, (list, tuple)) else [out]
    if len(repl) != len(m.outputs):
        raise RewriteError(f"rewrite returned {len(repl)} values for a pattern with {len(m.outputs)} outputs")
    for old, new in zip(m.outputs, repl):
        if new not in graph.values:
            raise RewriteError(f"rewrite returned unknown value '{new}'")
        new_producer = graph.producer.get(new)
        graph.replace_all_uses(old, new)
        bridge = graph.producer_node(old) if old in graph.outputs else None
        if bridge is not None and graph.producer.get(old) != new_producer and bridge.rule is None:
            # the Identity that keeps a graph output's name was created by this rewrite: tag it too
            bridge.extra = copy.deepcopy(bridge.extra)
            tag = bridge.extra.metadata_props.add()
            tag.key, tag.value = RULE_TAG, b.rule_tag
            b.created.append(bridge)
    removed = graph.remove_dead_nodes([n.id for n in m.nodes] + [n.id for n in m.extra_nodes])
    rep.nodes_removed += len(removed)
    rep.nodes_added += len([n for n in b.created if n.id in graph.nodes])


def run_plugin(graph: Graph, plugin: RunnablePlugin, ctx: RewriteContext | None = None, *, dry_run: bool = False) -> PluginReport:
    """Run one plugin all-or-nothing. A plugin whose ``backends`` do not include ``ctx.backend`` is not run:
    its report holds one note saying so (``legalize`` prepares a graph for IREE's importer; ONNX Runtime reads
    blocked DequantizeLinear and 4-bit tensors itself, and lowers them to MatMulNBits).

    Raises:
        PluginError: the plugin raised; the graph is exactly as before the call.
    """
    report = PluginReport(plugin.short)
    backends = getattr(plugin, "backends", None)
    if ctx is not None and backends is not None and ctx.backend not in backends:
        report.notes.append(f"not run: it rewrites for {', '.join(backends)} only, and the {ctx.backend} backend "
                            "takes the graph as it is")
        return report
    # The snapshot and the matcher's bindings create many small containers; with a large model loaded, each
    # automatic collection rescans every protobuf and IR object (measured: 90% of a snapshot's time at 12k
    # nodes). Nothing here builds reference cycles worth collecting mid-run.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        snap = graph.snapshot()
        try:
            plugin.run(graph, report, ctx, dry_run=dry_run)
            if dry_run:
                graph.restore(snap)
        except Exception as e:  # noqa: BLE001 - any failure must restore the graph
            rule_name, node = (_current + [None, None])[:2]
            _current[:] = []
            graph.restore(snap)
            raise PluginError(plugin.short, rule_name, node, e) from e
    finally:
        if gc_was_enabled:
            gc.enable()
    return report
