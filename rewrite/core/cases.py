"""Cases a plugin declares for the conformance kit.

A case builds a small ONNX model and states what the plugin must do with it:

* :func:`positive`: the plugin's rules fire exactly ``matches`` times (an int for the whole plugin, or a
  dict ``{rule name: count}``), and the rewritten model computes the same outputs as the original within
  ``rtol`` (default by dtype) on every backend in ``backends``;
* :func:`negative`: nothing fires and the model is left byte-identical (lossy Cast pairs, Softmax on
  another axis than TopK, scatter indices that are not one contiguous range, ...);
* :func:`bad_input`: applying the plugin raises a :class:`~rewrite.errors.RewriteError` whose message
  contains ``error``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx


@dataclass(frozen=True)
class Case:
    """One declared case; build it with :func:`positive`, :func:`negative` or :func:`bad_input`."""

    name: str
    build: Callable[[], onnx.ModelProto]
    kind: str  # "positive" | "negative" | "bad_input"
    matches: int | dict[str, int] = 0
    rtol: float | None = None
    backends: tuple[str, ...] = ("ort", "iree")
    feeds: Callable[[onnx.ModelProto], dict[str, np.ndarray]] | None = None
    error: str | None = None
    dims: dict[str, int] = field(default_factory=dict)
    options: dict = field(default_factory=dict)


def positive(name: str, build: Callable[[], onnx.ModelProto], matches: int | dict[str, int] = 1, **kw) -> Case:
    """A model the plugin must rewrite exactly ``matches`` times, keeping its outputs."""
    return Case(name, build, "positive", matches, **kw)


def negative(name: str, build: Callable[[], onnx.ModelProto], **kw) -> Case:
    """A model the plugin must leave byte-identical."""
    return Case(name, build, "negative", 0, **kw)


def bad_input(name: str, build: Callable[[], onnx.ModelProto], error: str, **kw) -> Case:
    """A model on which the plugin must fail with a clear error containing ``error``."""
    return Case(name, build, "bad_input", 0, error=error, **kw)
