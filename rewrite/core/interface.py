"""The decode interface of a decoder graph, read from its structure, and validation of feeds against it.

Exporters leave artefacts in graph signatures that a runtime must not have to guess around:

* transformers' ``OnnxExporter`` with ``OnnxConfig(dynamic=True)`` declares the fixed axes of the past-KV
  inputs as symbolic dims *named* ``"4"``, ``"32"``; :func:`exporter_static_dims` reads such a dim as the
  static size it names (`rewrite.core.shapes.infer_shapes` applies it before inference).
* past and present caches are paired by what the graph computes, not by their names: a present output that
  is ``Concat(past, new)`` of a past input (through Casts, and Slices of a sliding window) is a growing KV
  cache along the Concat's axis, or a fixed-length window (a convolution state) when a Slice keeps a static
  length; one written by ``ScatterElements``/``ScatterND``/``KVCacheUpdate`` into a past input is a static KV
  cache; any other output with the same static type as an input (hybrid models' recurrent state) is carried
  state. Names only break ties (``past_key_values.X`` pairs with ``cache.X`` or ``present.X``).

:func:`decoder_interface` records the result (token ids, positions, mask, pairs with their kinds and
shapes, vocabulary size) and :func:`validate_feeds` checks feeds against a signature before any runtime
sees them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import onnx

from rewrite.core.feeds import TensorSpec, integer_named
from rewrite.core.ir import Graph
from rewrite.core.next_token import NEXT_TOKEN
from rewrite.errors import InputError

#: ops a cache tensor may pass through between input and Concat/Scatter (an fp16 export casts around its Concat)
_PASS_THROUGH = frozenset({"Identity", "Cast"})
#: ops that write new positions into a cache tensor of fixed size
_STATIC_WRITERS = frozenset({"ScatterElements", "ScatterND", "KVCacheUpdate"})
_TOKEN_NAMES = ("input_ids", "input.input_ids")
_POSITION_NAMES = ("position_ids", "input.position_ids")
_MASK_NAMES = ("attention_mask", "input.attention_mask")


def exporter_static_dims(shapes: Sequence[Sequence | None]) -> dict[str, int]:
    """Symbolic dims whose name is a non-negative integer literal (``"4"``), mapped to that size.

    transformers' exporter names the static axes of dynamic-shape inputs after their sample size; no
    exporter uses a number as the name of a dim that varies.
    """
    out: dict[str, int] = {}
    for shape in shapes:
        for d in shape or ():
            if integer_named(d):
                out[d] = int(d)
    return out


@dataclass(frozen=True)
class CachePair:
    """One past input fed back from one present output.

    Attributes:
        past: graph input name.
        present: graph output name.
        kind: ``"kv-growing"`` (``Concat(past, new)``: present is one step longer along ``axis``),
            ``"kv-static"`` (new positions written into a fixed-size cache along ``axis``) or ``"state"``
            (a fixed-size recurrent or convolution state, fed back whole).
        axis: the sequence axis of a KV cache (non-negative), None for ``"state"``.
        shape: the past input's shape (ints, symbolic names, or None for unknown dims).
    """

    past: str
    present: str
    kind: str
    axis: int | None
    shape: tuple


@dataclass
class DecoderInterface:
    """How to drive a decoder graph one call at a time (recorded in the manifest as ``decoder``).

    Attributes:
        input_ids: the token-id input (int64 ``[B, S]``).
        position_ids, attention_mask, seq_position: those inputs' names, or None when absent.
        pairs: the caches and states fed back between calls, in input order.
        logits: the logits output (float ``[B, S, vocab]``).
        vocab: the logits' last dim when static, else None.
        next_token: the greedy next-token output (int64 ``[B, 1]``, :mod:`rewrite.core.next_token`), or None.
    """

    input_ids: str
    logits: str
    position_ids: str | None = None
    attention_mask: str | None = None
    seq_position: str | None = None
    pairs: list[CachePair] = field(default_factory=list)
    vocab: int | None = None
    next_token: str | None = None

    def to_json(self) -> dict:
        d = asdict(self)
        d["pairs"] = [dict(asdict(p), shape=list(p.shape)) for p in self.pairs]
        return d

    @classmethod
    def from_json(cls, d: Mapping) -> "DecoderInterface":
        pairs = [CachePair(**{**p, "shape": tuple(p["shape"])}) for p in d.get("pairs", [])]
        return cls(**{**d, "pairs": pairs})

    @property
    def max_seq(self) -> int | None:
        """Positions of a static KV cache (its size along the sequence axis), None for a growing one."""
        for p in self.pairs:
            if p.kind == "kv-static" and p.axis is not None and p.axis < len(p.shape) and isinstance(p.shape[p.axis], int):
                return p.shape[p.axis]
        return None


def _first(names: Sequence[str], candidates: Sequence[str]) -> str | None:
    return next((c for c in candidates if c in names), None)


def _source_input(graph: Graph, value: str, inputs: set[str]) -> str | None:
    """The graph input ``value`` is, up to Identity/Cast (and Slice: a sliding window trims the past), else None."""
    seen = 0
    while value not in inputs and seen < 8:
        node = graph.producer_node(value)
        if node is None or (node.op_type not in _PASS_THROUGH and node.op_type != "Slice") or not node.inputs:
            return None
        value, seen = node.inputs[0], seen + 1
    return value if value in inputs else None


def _classify(graph: Graph, present: str, inputs: set[str]) -> tuple[str, str, int | None] | None:
    """(past input, kind, axis) for a present output, from the op that makes it; None when it is no cache."""
    value, sliced = present, False
    for _ in range(8):
        node = graph.producer_node(value)
        if node is None:
            return None
        if node.op_type in _PASS_THROUGH or node.op_type == "Slice":  # Slice: a sliding window keeps the last W
            sliced |= node.op_type == "Slice"
            value = node.inputs[0]
            continue
        if node.op_type == "Concat" and node.inputs:
            past = _source_input(graph, node.inputs[0], inputs)
            if past is None:
                return None
            shape = graph.values[past].shape or ()
            axis = int(node.attr("axis")) % (len(shape) or 1)
            if sliced and axis < len(shape) and isinstance(shape[axis], int):
                return past, "state", None  # a window of fixed length (a convolution state), fed back whole
            return past, "kv-growing", axis
        if node.op_type in _STATIC_WRITERS and node.inputs:
            past = _source_input(graph, node.inputs[0], inputs)
            if past is None:
                return None
            rank = len(graph.values[past].shape or ()) or 1
            if node.op_type == "ScatterND":  # no axis: the [batch, heads, seq, head_dim] layout's sequence axis
                return past, "kv-static", min(2, rank - 1)
            return past, "kv-static", int(node.attr("axis", 0)) % rank  # ScatterElements' default axis is 0
        return None
    return None


def _same_type(graph: Graph, a: str, b: str) -> bool:
    va, vb = graph.values[a], graph.values[b]
    return va.dtype == vb.dtype and va.shape is not None and va.shape == vb.shape and all(isinstance(d, int) for d in va.shape)


def _downstream_outputs(graph: Graph, value: str) -> set[str]:
    """Graph outputs computed (directly or not) from ``value``."""
    seen, stack = {value}, [value]
    while stack:
        for node in graph.consumers(stack.pop()):
            for out in node.outputs:
                if out and out not in seen:
                    seen.add(out)
                    stack.append(out)
    return seen & set(graph.outputs)


_CACHE_PREFIX = re.compile(r"^(past_key_values|input\.cache|output\.cache|cache|present|past)[._]")


def _name_key(name: str) -> str:
    """A cache name without its exporter's input/output prefix: ``past_key_values.layers.0.conv_states.0`` and
    ``cache.layers.0.conv_states.0`` both give ``layers.0.conv_states.0``."""
    return _CACHE_PREFIX.sub("", name)


def cache_pairs(graph: Graph) -> list[CachePair]:
    """Past/present pairs of ``graph`` in input order (see the module docstring for how they are found).

    A fixed-size state input is paired with an output of the same static type computed from it (or, when the
    export does not read the input, any output of its type); when several outputs qualify, the one whose name
    is the input's without the exporter's prefix wins (``past_key_values.X`` / ``cache.X``), and a state left
    ambiguous is not paired.
    """
    inputs = [n for n in graph.inputs if n not in graph.initializers]
    input_set = set(inputs)
    interface = set(_TOKEN_NAMES + _POSITION_NAMES + _MASK_NAMES) | {"seq_position"}
    found: dict[str, CachePair] = {}
    taken: set[str] = set()
    for out in graph.outputs:
        hit = _classify(graph, out, input_set)
        if hit is not None and hit[0] not in found:
            past, kind, axis = hit
            found[past] = CachePair(past, out, kind, axis, tuple(graph.values[past].shape or ()))
            taken.add(out)
    for past in inputs:
        if past in found or past in interface:
            continue
        candidates = [o for o in graph.outputs if o not in taken and _same_type(graph, past, o)]
        if not candidates:
            continue
        downstream = _downstream_outputs(graph, past)
        candidates = [o for o in candidates if o in downstream] or candidates
        best = next((o for o in candidates if _name_key(o) == _name_key(past)), None)
        if best is None and len(candidates) == 1:
            best = candidates[0]
        if best is not None:
            found[past] = CachePair(past, best, "state", None, tuple(graph.values[past].shape or ()))
            taken.add(best)
    return [found[p] for p in inputs if p in found]


def decoder_interface(graph: Graph) -> DecoderInterface | None:
    """The decode interface of ``graph``, or None when it has no token-id input or no ``logits`` output."""
    inputs = [n for n in graph.inputs if n not in graph.initializers]
    ids = _first(inputs, _TOKEN_NAMES)
    logits = "logits" if "logits" in graph.outputs else None
    if ids is None or logits is None:
        return None
    shape = graph.values[logits].shape
    vocab = shape[-1] if shape and isinstance(shape[-1], int) else None
    return DecoderInterface(
        input_ids=ids, logits=logits, position_ids=_first(inputs, _POSITION_NAMES),
        attention_mask=_first(inputs, _MASK_NAMES), seq_position="seq_position" if "seq_position" in inputs else None,
        pairs=cache_pairs(graph), vocab=vocab, next_token=_next_token_output(graph, logits),
    )


def _next_token_output(graph: Graph, logits: str) -> str | None:
    """The output :func:`rewrite.core.next_token.add_next_token` made: int64 ``[B, 1]`` from an ArgMax over the
    last axis without keepdims, of the logits or of a Slice of them; else None."""
    p = graph.producer.get(NEXT_TOKEN)
    if NEXT_TOKEN not in graph.outputs or p is None or p[0] not in graph.nodes:
        return None
    node, v = graph.nodes[p[0]], graph.values[NEXT_TOKEN]
    attrs = {k: onnx.helper.get_attribute_value(a) for k, a in node.attrs.items()}
    if (node.op_type != "ArgMax" or node.domain not in ("", "ai.onnx") or attrs.get("keepdims", 1) != 0
            or attrs.get("axis", 0) not in (-1, 2) or v.dtype != onnx.TensorProto.INT64
            or v.shape is None or len(v.shape) != 2 or v.shape[1] != 1):
        return None
    src = node.inputs[0]
    q = graph.producer.get(src)
    if q is not None and q[0] in graph.nodes and graph.nodes[q[0]].op_type == "Slice":
        src = graph.nodes[q[0]].inputs[0]
    return NEXT_TOKEN if src == logits else None


def validate_feeds(specs: Sequence[TensorSpec], feeds: Mapping[str, np.ndarray], where: str, *,
                   vocab: int | None = None, token_input: str | None = None) -> None:
    """Check ``feeds`` against the signature ``specs`` before a runtime sees them.

    Checks: every input given (those with a ``default`` may be left out) and no other; element type equal to the declared one; rank and every static
    dim equal; one size per symbolic dim name across all inputs; token ids (``token_input``) in
    ``[0, vocab)`` when ``vocab`` is known.

    Raises:
        InputError: one line naming ``where``, the input and what was expected.
    """
    names = [s.name for s in specs]
    missing = [s.name for s in specs if s.name not in feeds and not s.default]
    if missing:
        raise InputError(f"{where}: missing input '{missing[0]}' (inputs: {', '.join(names)})")
    extra = [n for n in feeds if n not in names]
    if extra:
        raise InputError(f"{where}: unexpected input '{extra[0]}' (inputs: {', '.join(names)})")
    bound: dict[str, tuple[int, str]] = {}
    for spec in specs:
        if spec.name not in feeds:  # an input with a default, left out
            continue
        arr = np.asarray(feeds[spec.name])
        if spec.dtype and arr.dtype != spec.np_dtype:
            raise InputError(f"{where}: input '{spec.name}' is {arr.dtype}, expected {spec.np_dtype}")
        if spec.shape is None:  # no declared shape: any shape goes
            continue
        if arr.ndim != len(spec.shape):
            raise InputError(f"{where}: input '{spec.name}' has shape {list(arr.shape)}, expected rank {len(spec.shape)} {list(spec.shape)}")
        for axis, (got, want) in enumerate(zip(arr.shape, spec.shape)):
            if isinstance(want, int) and got != want:
                raise InputError(f"{where}: input '{spec.name}' has shape {list(arr.shape)}, expected {list(spec.shape)} (axis {axis})")
            if isinstance(want, str):
                size, first = bound.setdefault(want, (got, spec.name))
                if size != got:
                    raise InputError(f"{where}: input '{spec.name}' axis {axis} is {got}, but dim '{want}' is {size} in '{first}'")
    if token_input and vocab and token_input in feeds:
        ids = np.asarray(feeds[token_input])
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            bad = int(ids.max() if ids.max() >= vocab else ids.min())
            raise InputError(f"{where}: input '{token_input}' holds token id {bad}, outside the vocabulary [0, {vocab})")
