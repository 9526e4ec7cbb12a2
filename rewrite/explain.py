"""``rewrite explain`` and ``rewrite apply --dry-run``: what the plugins would do to a model, and why a rule
did not fire, without writing anything.

For each rule of each selected plugin, :func:`explain` reports how often it fired (plugins run in memory in
the given order, as ``rewrite apply`` runs them) and, for a rule that did not fire, its best attempt on the
graph the plugin was given:

* ``refused``: the whole pattern matched but the rule's check refused, with the check's reason;
* ``partial``: the deepest partial match, as pattern node -> graph node pairs, and the first reason it
  stopped (the matcher's :class:`~rewrite.core.matcher.MatchTrace`);
* ``no-anchor``: the graph has no node of the op type(s) that produce the pattern's output.

Attempts are ranked like onnxscript's ``MatchingTracer``: a refused full match beats any partial match,
then more matched pattern nodes win, then graph order. With ``node=NAME`` only attempts anchored at that node
or whose partial match or stopping point involves it are considered.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import onnx

from rewrite.core import onnx_io
from rewrite.core.driver import PluginReport, run_plugin
from rewrite.core.ir import Graph
from rewrite.core.matcher import Failure, Match, Matcher, MatchTrace
from rewrite.core.rules import Rule
from rewrite.core.shapes import infer_shapes
from rewrite.errors import RewriteError
from rewrite.pipeline import RewriteContext, check_model
from rewrite.plugins.base import Plugin
from rewrite.plugins.manager import select_plugins


@dataclass
class RuleExplanation:
    """What one rule did, and, when it did not fire, its best attempt.

    Attributes:
        status: ``fired``, ``refused``, ``partial``, ``no-anchor``, or ``would-fire`` (a match the check
            accepts exists on the plugin's input graph but the run consumed it another way); for a step of a
            plugin without pattern rules (a pass that finds its matches itself, as ``quant4``), ``fired``,
            ``refused`` with the reasons its report recorded in ``refusals``, or ``no-anchor`` (nothing found).
        refusals: (reason, nodes) a pass's step recorded (empty for pattern rules).
        pairs: (pattern node label, graph node name) matched, in match order.
        size: number of pattern nodes.
        node: the graph node the stopping reason is about.
    """

    plugin: str
    rule: str
    doc: str
    size: int
    matches: int = 0
    status: str = "fired"
    reason: str | None = None
    node: str | None = None
    anchor: str | None = None
    pairs: list[tuple[str, str]] = field(default_factory=list)
    refusals: list[tuple[str, list[str]]] = field(default_factory=list)
    rank: tuple = field(default=(), repr=False, compare=False)  # (refused or would-fire, matched pattern nodes)

    def to_json(self) -> dict:
        return {"plugin": self.plugin, "rule": self.rule, "matches": self.matches, "status": self.status, "reason": self.reason,
                "node": self.node, "anchor": self.anchor, "matched": [list(p) for p in self.pairs], "pattern_nodes": self.size,
                "refusals": [{"reason": r, "nodes": ns} for r, ns in self.refusals]}

    def lines(self) -> list[str]:
        """Human-readable lines (first line: plugin/rule and status)."""
        head = f"{self.plugin}/{self.rule}: "
        refused = [f"    refused {len(ns)}x: {r} ({', '.join(ns[:3])}{', ...' if len(ns) > 3 else ''})" for r, ns in self.refusals]
        if self.status == "fired":
            return [head + f"fired {self.matches} time(s)"] + refused
        if self.refusals:
            return [head + "did not fire (a pass without pattern rules)"] + refused
        if self.matches:  # explained at a --node where it did not fire
            head += f"fired {self.matches} time(s) elsewhere; here it "
        if self.status == "no-anchor":
            return [head + f"did not fire: {self.reason}"]
        what = {"refused": "check refused a full match", "partial": f"best partial match {len(self.pairs)}/{self.size} pattern nodes",
                "would-fire": "a match exists on its input graph, but the run did not apply it"}[self.status]
        out = [head + f"did not fire; {what}" + (f", anchored at '{self.anchor}'" if self.anchor else "")]
        out += [f"    {p:<16} -> {g}" for p, g in self.pairs]
        if self.reason:
            out.append(f"    stopped: {self.reason}" + (f" (at node '{self.node}')" if self.node else ""))
        return out


def _involves(f: Failure, node: str) -> bool:
    return f.anchor == node or f.node == node or any(g == node for _, g in f.pairs)


def explain_rule(graph: Graph, rule: Rule, plugin: str = "", node: str | None = None, *, require_node: bool = True,
                 ctx: RewriteContext | None = None) -> RuleExplanation:
    """The best attempt of ``rule`` on ``graph`` (read only), restricted to ``node`` when given; its check sees
    ``ctx`` as a run's would.

    Raises:
        RewriteError: ``node`` names no node of the graph (unless ``require_node`` is False).
    """
    if node is not None and require_node and graph.find_node(node) is None:
        raise RewriteError(f"no node named '{node}' in the graph")
    pat = rule.pattern
    labels = pat.labels()
    ex = RuleExplanation(plugin, rule.name, rule.doc, pat.max_nodes(), status="no-anchor")
    root = pat.root(0)
    domain = root.domain if root else ""
    anchors = sorted((n for t in pat.root_op_types() for n in graph.nodes_by_op(t, domain)), key=lambda n: n.order)
    if not anchors:
        ex.reason = f"no node of op type {' or '.join(pat.root_op_types()) or '(none)'} in the graph"
        return ex
    best: tuple[tuple, Failure, str] | None = None
    for anchor in anchors:
        trace = MatchTrace(labels)
        for binding in Matcher(graph, pat, trace).match_at(anchor):
            m = Match(graph, pat, binding, ctx)
            f = rule.run_check(m)
            status = "refused" if f is not None else "would-fire"
            f = f or Failure("", None, len(m.nodes), m.pairs(), anchor.name)
            if node is None or _involves(f, node):
                key = (1, len(f.pairs), -anchor.order)
                if best is None or key > best[0]:
                    best = (key, f, status)
        f = trace.best
        if f is not None and (node is None or _involves(f, node)):
            key = (0, f.matched, -anchor.order)
            if best is None or key > best[0]:
                best = (key, f, "partial")
    if best is None:
        ex.reason = f"no attempt is anchored at or involves node '{node}'" if node else "no attempt recorded"
        return ex
    ex.rank, f, ex.status = best[0][:2], best[1], best[2]
    ex.reason, ex.node, ex.anchor, ex.pairs = f.reason or None, f.node, f.anchor, list(f.pairs)
    return ex


def _load(model: str | os.PathLike | onnx.ModelProto | Graph, plugins: list[Plugin], dims: dict[str, int] | None,
          freeze_inputs: bool = False) -> Graph:
    graph = model if isinstance(model, Graph) else onnx_io.load(model)
    if freeze_inputs:
        graph.freeze_inputs()
    check_model(graph, plugins, str(model) if not isinstance(model, (Graph, onnx.ModelProto)) else "model")
    infer_shapes(graph, dims or {})
    return graph


def explain(model: str | os.PathLike | onnx.ModelProto | Graph, plugins: list[str] | str | list[Plugin], *, node: str | None = None,
            dims: dict[str, int] | None = None, freeze_inputs: bool = False, backend: str | None = None) -> list[RuleExplanation]:
    """One :class:`RuleExplanation` per rule of each plugin, in plugin order then rule order (on the graph
    ``apply`` would see: ``freeze_inputs`` as there). The plugins run as ``apply --backend backend`` runs them
    (a plugin not at all for a backend it does not rewrite for); by default for ort, or for iree when some
    selected plugin rewrites for iree only.

    Plugins run in memory in the order given (each sees its predecessors' output). A rule that did not fire
    is explained by its best attempt on the graph its plugin was given or on the graph the plugin left (where
    a rule that only applies after another rule's rewrite stopped). With ``node``, a rule that fired elsewhere
    is still explained at that node. A plugin without pattern rules (a pass such as ``quant4``) gets one
    explanation per step its report lists, with the refusals it recorded (by the node or weight names it
    chose: not narrowed to ``node``). ``model`` is not modified (a Graph is copied).

    Raises:
        RewriteError: unknown plugin, unloadable model, a plugin failure, or ``node`` not in the graph.
    """
    selected = plugins if plugins and isinstance(plugins, list) and isinstance(plugins[0], Plugin) else select_plugins(plugins)
    graph = _load(onnx_io.to_model(model) if isinstance(model, Graph) else model, selected, dims, freeze_inputs)
    if node is not None and graph.find_node(node) is None:  # here too: a pass has no rule to check it
        raise RewriteError(f"no node named '{node}' in the graph")
    # by default one backend every plugin rewrites for, as a single `apply` would run them all
    be = backend or next((b for b in ("ort", "iree") if all(b in p.backends for p in selected)), "ort")
    ctx = RewriteContext(backend=be, dims=dict(dims or {}))
    out: list[RuleExplanation] = []
    for p in selected:
        before = [explain_rule(graph, r, p.short, node, ctx=ctx) for r in p.rules]
        report = run_plugin(graph, p, ctx)
        graph.remove_unused_initializers()
        for r, ex in zip(p.rules, before):
            ex.matches = report.rule(r.name).matches
            after = explain_rule(graph, r, p.short, node, require_node=False, ctx=ctx)
            if after.rank > ex.rank:
                after.matches, ex = ex.matches, after
            if ex.matches and (node is None or ex.status == "would-fire"):
                ex.status, ex.reason, ex.node, ex.anchor, ex.pairs = "fired", None, None, None, []
            out.append(ex)
        if not p.rules:  # a pass: its own steps, as its report recorded them
            for rep in report.rules.values():
                refusals = [(r, list(ns)) for r, ns in rep.refusals.items()]
                status = "fired" if rep.matches else "refused" if refusals else "no-anchor"
                out.append(RuleExplanation(p.short, rep.rule, "", 0, matches=rep.matches, status=status,
                                           reason="the pass found nothing to rewrite" if status == "no-anchor" else None,
                                           refusals=refusals))
    return out


def preview(model: str | os.PathLike, plugins: list[str] | str, *, dims: dict[str, int] | None = None, backend: str = "ort",
            options: dict | None = None, freeze_inputs: bool = False, target: str | None = None) -> list[PluginReport]:
    """``rewrite apply --dry-run``: run the plugins in memory, with the context ``apply`` would give them
    (``backend``, ``target`` (default the backend's first), plugin ``options``, ``freeze_inputs``), and return
    their reports; nothing is lowered or written. Raises RewriteError like ``rewrite apply``."""
    from rewrite.pipeline import check_options

    selected = select_plugins(plugins)
    check_options(dict(options or {}), selected)
    graph = _load(model, selected, dims, freeze_inputs)
    from rewrite.backends import get_backend

    targets = get_backend(backend).targets
    if target is not None and target not in targets:
        raise RewriteError(f"backend '{backend}' has no target '{target}'; targets: {', '.join(targets)}")
    ctx = RewriteContext(backend=backend, target=target or targets[0], dims=dict(dims or {}), options=dict(options or {}))
    reports = []
    for p in selected:
        reports.append(run_plugin(graph, p, ctx))
        graph.remove_unused_initializers()
    return reports


def parse_expect(specs: tuple[str, ...] | list[str]) -> dict[str, int]:
    """``("moe=24", "cast/cast-roundtrip=2")`` -> ``{"moe": 24, "cast/cast-roundtrip": 2}``.

    Raises RewriteError for a spec that is not ``PLUGIN[/RULE]=INT``."""
    out = {}
    for s in specs:
        k, sep, v = s.partition("=")
        if not sep or not k.strip() or not v.strip().isdigit():
            raise RewriteError(f"--expect '{s}': expected PLUGIN=N or PLUGIN/RULE=N with N a non-negative integer, e.g. moe=24")
        out[k.strip()] = int(v)
    return out


def shortfalls(expect: dict[str, int], reports: list[dict]) -> list[str]:
    """Messages for every expectation the reports (``PluginReport.to_json()`` dicts) fall short of.

    A key ``plugin`` counts all its rules' matches, ``plugin/rule`` one rule's. A plugin or rule that did not
    run counts 0.
    """
    by_plugin = {r["plugin"]: r for r in reports}
    msgs = []
    for key, want in expect.items():
        plugin, _, rule = key.partition("/")
        rep = by_plugin.get(plugin)
        if rule:
            got = next((r["matches"] for r in (rep or {}).get("rules", []) if r["rule"] == rule), 0)
        else:
            got = rep["matches"] if rep else 0
        if got < want:
            detail = ", ".join(f"{r['rule']}: {r['matches']}" for r in (rep or {}).get("rules", [])) or "plugin not run"
            msgs.append(f"expected {key}={want} matches, got {got} ({detail})")
    return msgs
