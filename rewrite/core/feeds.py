"""Inputs for running a model when the user gives none: shapes from the model, values that make sense.

Decoder graphs get consistent decode-step inputs: with ``S`` new tokens and a past of ``P`` positions,
``input_ids`` and ``position_ids`` are ``[1, S]`` (positions ``P .. P+S-1``), ``attention_mask`` is ones of
``[1, P+S]``, KV-cache inputs ``[1, H, P, D]`` (or their static shape), ``seq_position`` holds ``P``.
Everything else: floats ~ N(0, 0.5^2), integers in ``[0, 4)``, booleans random.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

DEFAULT_SEQ = 2
DEFAULT_PAST = 3
DEFAULT_TOKEN_RANGE = 16


def integer_named(dim) -> bool:
    """A symbolic dim whose name is a decimal integer literal (``"4"``): transformers' exporter names static axes
    of dynamic-shape inputs that way; such a dim is read as that static size."""
    return isinstance(dim, str) and re.fullmatch(r"[0-9]+", dim) is not None


@dataclass(frozen=True)
class TensorSpec:
    """Name, ONNX element type (0 when not a typed tensor) and shape (ints, symbolic names or None per dim; None
    for the whole shape when none is declared) of a graph input or output. ``default``: the input has an
    initializer as its default (ONNX IR spec, "Graphs"), so a caller may leave it out."""

    name: str
    dtype: int
    shape: tuple | None
    default: bool = False

    def to_json(self) -> dict:
        d = {"name": self.name, "dtype": onnx.TensorProto.DataType.Name(self.dtype),
             "shape": None if self.shape is None else list(self.shape)}
        if self.default:
            d["default"] = True
        return d

    @classmethod
    def from_json(cls, d: dict) -> "TensorSpec":
        return cls(d["name"], onnx.TensorProto.DataType.Value(d["dtype"]), None if d["shape"] is None else tuple(d["shape"]),
                   bool(d.get("default", False)))

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(helper.tensor_dtype_to_np_dtype(self.dtype))


def specs_of(vis, defaults=()) -> list[TensorSpec]:
    """TensorSpecs from ValueInfoProtos (unknown dims become None; a symbolic dim named like an integer, an
    exporter artefact, is that static size: see :mod:`rewrite.core.interface`). Names in ``defaults`` (inputs
    that have an initializer) get ``default=True``."""
    defaults = set(defaults)
    out = []
    for vi in vis:
        tt = vi.type.tensor_type
        shape = tuple(d.dim_value if d.HasField("dim_value") else (int(d.dim_param) if integer_named(d.dim_param) else (d.dim_param or None))
                      for d in tt.shape.dim) if tt.HasField("shape") else None
        out.append(TensorSpec(vi.name, tt.elem_type, shape, vi.name in defaults))
    return out


def input_specs(model: onnx.ModelProto) -> list[TensorSpec]:
    """The inputs a caller of ``model`` passes, in order: from IR 4 on, those with an initializer are marked
    ``default`` (ONNX IR spec, "Graphs": the initializer is the input's default); before IR 4 every initializer
    is listed among the inputs as a weight, not an input, and is left out (ONNX Runtime refuses it as a feed)."""
    inits = {t.name for t in model.graph.initializer}
    if model.ir_version < 4:
        return [s for s in specs_of(model.graph.input) if s.name not in inits]
    return specs_of(model.graph.input, defaults=inits)


def _is_kv(name: str) -> bool:
    return bool(re.search(r"past|cache", name)) and not name.endswith("position")


def make_feeds(specs: list[TensorSpec], dims: dict[str, int] | None = None, *, seed: int = 0,
               seq: int = DEFAULT_SEQ, past: int = DEFAULT_PAST, token_range: int = DEFAULT_TOKEN_RANGE) -> dict[str, np.ndarray]:
    """Random but meaningful inputs for ``specs`` (see the module docstring). ``dims`` fixes symbolic dims.
    Inputs with a ``default`` are left out: the model's own default is what a caller gets without them."""
    rng = np.random.default_rng(seed)
    specs = [s for s in specs if not s.default]
    sym: dict[str, int] = dict(dims or {})
    specs = [s if s.shape is not None else TensorSpec(s.name, s.dtype, ()) for s in specs]  # undeclared: a scalar
    by = {s.name: s for s in specs}

    def bind(spec: TensorSpec | None, axis: int, size: int) -> None:
        if spec is not None and axis < len(spec.shape) and isinstance(spec.shape[axis], str):
            sym.setdefault(spec.shape[axis], size)

    bind(by.get("input_ids"), 1, seq)
    for s in specs:
        if _is_kv(s.name) and len(s.shape) == 4:
            bind(s, 2, past)
    s_len = sym.get(by["input_ids"].shape[1], seq) if "input_ids" in by and len(by["input_ids"].shape) > 1 and isinstance(by["input_ids"].shape[1], str) else seq
    kv_static = [s.shape[2] for s in specs if _is_kv(s.name) and len(s.shape) == 4 and isinstance(s.shape[2], int)]
    p_len = past
    for s in specs:
        if _is_kv(s.name) and len(s.shape) == 4 and isinstance(s.shape[2], str):
            p_len = sym[s.shape[2]]
            break
    if "attention_mask" in by:
        bind(by["attention_mask"], 1, p_len + s_len)
    feeds: dict[str, np.ndarray] = {}
    for s in specs:
        shape = tuple(sym.setdefault(d, 1) if isinstance(d, str) else (1 if d is None else d) for d in s.shape)
        dt = s.np_dtype
        if s.name == "attention_mask":
            a = np.ones(shape, dt)
        elif s.name == "position_ids":
            a = np.broadcast_to(np.arange(p_len, p_len + shape[-1], dtype=dt), shape).copy()
        elif s.name == "seq_position":
            a = np.full(shape, min(p_len, (kv_static[0] - s_len) if kv_static else p_len), dt)
        elif s.name == "input_ids":
            a = rng.integers(0, token_range, shape).astype(dt)
        elif dt == np.bool_:
            a = rng.integers(0, 2, shape).astype(bool)
        elif np.issubdtype(dt, np.integer):
            a = rng.integers(0, 4, shape).astype(dt)
        else:
            a = (rng.standard_normal(shape) * 0.5).astype(dt)
        feeds[s.name] = a
    return feeds
