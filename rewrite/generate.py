"""Greedy generation through a lowered output folder (``rewrite generate``), for every decode interface:

* **stateful** (``rewrite apply --backend iree --stateful``; manifest ``state``): the function takes the
  token ids ``[1, n]`` and the position (``seq_position`` int64 ``[1]``) and returns logits; the KV cache
  lives in the module. :meth:`Generator.reset` clears it.
* **static cache passed in and out** (the seed's form, or after ``kv`` on ORT): caches ``[B, H, S, D]`` are
  fed as zeros first, then each call's presents are fed back; ``seq_position`` says where to write.
* **growing cache** (transformers' export: ``attention_mask``, ``position_ids``, ``past_key_values.*`` with
  a symbolic past length): pasts start with 0 positions and grow by each call's presents.

Positions are counted here: the prompt is written at 0, each new token at the next position. With a
static cache of ``S`` positions along the sequence axis (the state's recorded axis, else axis 2: the
``[batch, kv_heads, seq, head_dim]`` layout of both exporters), a call that would write past ``S`` raises
:class:`GenerationError` before running (IREE's slice insert has no bounds check).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rewrite.backends import load_runner
from rewrite.backends.base import Manifest
from rewrite.errors import RewriteError
from rewrite.stateful import cache_pairs

SEQ_AXIS = 2  #: sequence axis of a cache tensor when the manifest does not record one


class GenerationError(RewriteError):
    """A generation request the model cannot serve (past the cache's positions, bad prompt, unknown input)."""


@dataclass
class GenerateResult:
    """``tokens``: the new token ids (prompt excluded); ``logits``: per call, float ``[1, n, vocab]``."""

    tokens: list[int]
    logits: list[np.ndarray] = field(default_factory=list)


class Generator:
    """Loads ``folder`` (an output of ``rewrite apply``) and decodes greedily through it.

    Raises:
        GenerationError: the model's inputs are not a decoder interface this module knows (see module docstring).
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.manifest = Manifest.read(self.folder)
        self.runner = load_runner(self.folder)
        self.specs = {s.name: s for s in self.manifest.input_specs}
        out_names = [s.name for s in self.manifest.output_specs]
        self.pairs = cache_pairs(list(self.specs), out_names)
        self.state = self.manifest.state[0] if self.manifest.state else None
        if "input_ids" not in self.specs:
            raise GenerationError(f"{folder}: no 'input_ids' input (inputs: {', '.join(self.specs)})")
        if "logits" not in out_names:
            raise GenerationError(f"{folder}: no 'logits' output (outputs: {', '.join(out_names)})")
        known = {"input_ids", "seq_position", "position_ids", "attention_mask"} | {p for p, _ in self.pairs}
        unknown = [n for n in self.specs if n not in known]
        if unknown:
            raise GenerationError(f"{folder}: input '{unknown[0]}' is not a decoder input generate knows")
        self.max_seq = self._max_seq()
        self.reset()

    def _max_seq(self) -> int | None:
        if self.state is not None:
            axis = self.state["axis"] if self.state["axis"] is not None else SEQ_AXIS
            return int(self.state["shape"][1 + axis])
        if self.pairs:
            d = self.specs[self.pairs[0][0]].shape[SEQ_AXIS]
            return d if isinstance(d, int) else None
        return None

    def reset(self) -> None:
        """Forget the cache: the next call writes at position 0."""
        self.position = 0
        if self.state is not None:
            self.runner.reset()
        self.past = {}
        for p, _ in self.pairs:
            spec = self.specs[p]
            shape = [0 if not isinstance(d, int) else d for d in spec.shape]
            self.past[p] = np.zeros(shape, spec.np_dtype)

    def step(self, ids: np.ndarray) -> np.ndarray:
        """Run the model on token ids ``[1, n]`` at the current position; returns logits ``[1, n, vocab]``.

        Raises:
            GenerationError: the tokens would be written past the cache's ``max_seq`` positions.
        """
        ids = np.asarray(ids, np.int64).reshape(1, -1)
        n = ids.shape[1]
        if self.max_seq is not None and self.position + n > self.max_seq:
            raise GenerationError(f"position {self.position} + {n} token(s) exceeds the cache's {self.max_seq} positions (--max-seq); call reset()")
        feeds = {"input_ids": ids}
        if "seq_position" in self.specs:
            feeds["seq_position"] = np.array([self.position], np.int64)
        if "position_ids" in self.specs:
            feeds["position_ids"] = np.arange(self.position, self.position + n, dtype=np.int64)[None]
        if "attention_mask" in self.specs:
            width = self.specs["attention_mask"].shape[1]
            width = width if isinstance(width, int) else self.position + n
            feeds["attention_mask"] = np.ones((1, width), self.specs["attention_mask"].np_dtype)
        feeds.update(self.past)
        out = self.runner.run(feeds)
        for p, o in self.pairs:
            self.past[p] = out[o]
        self.position += n
        return out["logits"]

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> GenerateResult:
        """Reset, prefill ``prompt_ids`` in one call, then decode ``max_new_tokens`` greedily (argmax), one per call.

        Raises:
            GenerationError: an empty prompt, or the request exceeds the cache's positions (checked up front).
        """
        if not prompt_ids:
            raise GenerationError("empty prompt: give at least one token id")
        if self.max_seq is not None and len(prompt_ids) + max_new_tokens > self.max_seq + 1:
            raise GenerationError(f"{len(prompt_ids)} prompt + {max_new_tokens} new tokens need {len(prompt_ids) + max_new_tokens - 1} cache positions; the cache has {self.max_seq} (--max-seq)")
        self.reset()
        res = GenerateResult([])
        ids = np.array([prompt_ids], np.int64)
        for _ in range(max_new_tokens):
            logits = self.step(ids)
            res.logits.append(logits)
            res.tokens.append(int(np.argmax(logits[0, -1])))
            ids = np.array([[res.tokens[-1]]], np.int64)
        return res


def generate(folder: str | Path, prompt_ids: list[int], max_new_tokens: int) -> GenerateResult:
    """One-shot :meth:`Generator.generate` on ``folder``."""
    return Generator(folder).generate(prompt_ids, max_new_tokens)
