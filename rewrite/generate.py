"""Greedy generation through a lowered output folder (``rewrite generate``), for every decode interface:

* **stateful** (``rewrite apply --backend iree --stateful``; manifest ``state``): the function takes the
  token ids ``[1, n]`` and the position (``seq_position`` int64 ``[1]``) and returns logits; the KV cache
  lives in the module. :meth:`Generator.reset` clears it.
* **static cache passed in and out** (the seed's form, or after ``kv`` on ORT): caches ``[B, H, S, D]`` are
  fed as zeros first, then each call's presents are fed back; ``seq_position`` says where to write.
* **growing cache** (transformers' export: ``attention_mask``, ``position_ids``, pasts with a symbolic past
  length, named ``past_key_values.*`` or ``input.cache.*``): pasts start with 0 positions and grow by each
  call's presents.
* **no cache** (a decoder exported without one): each call runs the whole sequence so far.

Pasts are paired with presents by what the graph computes (:mod:`rewrite.core.interface`); a hybrid model's
convolution and recurrent states are fed back whole, starting from zeros.

A stateful IREE folder applied with ``--next-token`` and compiled for one token per call decodes on the device
(:meth:`Generator.decode`): the greedy token never comes to the host between calls, and calls are queued ahead
of it (:meth:`rewrite.backends.iree.IreeRunner.greedy_decode`).

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
from rewrite.core import onnx_io
from rewrite.core.interface import decoder_interface
from rewrite.errors import InputError, RewriteError

SEQ_AXIS = 2  #: sequence axis of a cache tensor when the manifest does not record one


class GenerationError(RewriteError):
    """A generation request the model cannot serve (past the cache's positions, bad prompt, unknown input).

    Attributes:
        positions: when the graph itself cannot go further, the positions it served (prompt included), so a
            caller can compare that many; None otherwise.
    """

    def __init__(self, message: str, positions: int | None = None):
        super().__init__(message)
        self.positions = positions


def greedy_token(row: np.ndarray) -> int:
    """``np.argmax(row)`` of one logits row [vocab] (the same index, ties and NaNs included).

    numpy's argmax has no vectorized float16 loop (about 1 ms for a 151,936-token f16 row on a server core), so an
    f16 row is compared through its bit patterns as int16, mapped to keep the float order (negative values' magnitude
    bits flipped): about 50 us. Rows with a NaN or whose maximum is a zero (-0.0 and 0.0 are equal to argmax) go to
    np.argmax."""
    if row.dtype != np.float16 or row.ndim != 1:
        return int(np.argmax(row))
    bits = np.ascontiguousarray(row).view(np.int16)
    k = int(np.argmax(bits ^ ((bits >> 15) & np.int16(0x7FFF))))
    if row[k] == 0 or ((bits & np.int16(0x7FFF)) > np.int16(0x7C00)).any():
        return int(np.argmax(row))
    return k


@dataclass
class GenerateResult:
    """``tokens``: the new token ids (prompt excluded); ``logits``: per call, float ``[1, n, vocab]``."""

    tokens: list[int]
    logits: list[np.ndarray] = field(default_factory=list)


class Generator:
    """Loads ``folder`` (an output of ``rewrite apply``) and decodes greedily through it (``low_memory``: see
    :func:`rewrite.backends.load_runner`; ``device_decode``: see :attr:`decodes_on_device`).

    Raises:
        GenerationError: the model's inputs are not a decoder interface this module knows (see module docstring).
    """

    def __init__(self, folder: str | Path, *, low_memory: bool | None = None, device_decode: bool | None = None):
        self.device_decode = device_decode
        self.folder = Path(folder)
        manifest = Manifest.read(self.folder)
        specs = manifest.input_specs
        iface = manifest.decoder_interface
        if iface is None:  # a folder written before manifests recorded the interface
            iface = decoder_interface(onnx_io.load(self.folder / manifest.model))
            if iface is not None:
                iface.pairs = [p for p in iface.pairs if p.past in {s.name for s in specs}]
        self.manifest = manifest
        self._setup(str(folder), load_runner(self.folder, low_memory=low_memory), specs, iface,
                    manifest.state[0] if manifest.state else None)

    @classmethod
    def reference(cls, model_path: str | Path, *, low_memory: bool = False) -> "Generator":
        """A generator over an ONNX file itself on ONNX Runtime CPU at the "basic" optimization level (exact
        graph semantics): the reference that lowered folders are compared with. ``low_memory``: prepacking off
        (:data:`rewrite.backends.ort.NO_PREPACKING`), the weights stay in their memory-mapped file.

        Raises:
            GenerationError: the model is not a decoder this module drives.
        """
        from rewrite.backends.ort import NO_PREPACKING, OrtRunner
        from rewrite.core.feeds import input_specs
        from rewrite.core.shapes import resolve_exporter_dims

        graph = onnx_io.load(model_path)
        resolve_exporter_dims(graph)
        specs = input_specs(onnx_io.to_model(graph))
        iface = decoder_interface(graph)
        self = cls.__new__(cls)
        self.folder, self.manifest, self.device_decode = None, None, None
        self._setup(str(model_path), OrtRunner(Path(model_path), optimize="basic", decoder=iface,
                                                    config=dict(NO_PREPACKING) if low_memory else None), specs, iface, None)
        return self

    def _setup(self, where: str, runner, specs, iface, state) -> None:
        self.runner = runner
        self.specs = {s.name: s for s in specs}
        if iface is None:
            raise GenerationError(f"{where}: not a decoder: needs an 'input_ids' input and a 'logits' output "
                                  f"(inputs: {', '.join(self.specs)})")
        self.interface = iface
        self.pairs = [(p.past, p.present) for p in iface.pairs]
        self.state = state
        known = {iface.input_ids, iface.seq_position, iface.position_ids, iface.attention_mask} | {p for p, _ in self.pairs}
        unknown = [n for n, spec in self.specs.items() if n not in known and not spec.default]  # defaults: left out
        if unknown:
            raise GenerationError(f"{where}: input '{unknown[0]}' is not a decoder input generate knows "
                                  f"(token ids, positions, attention mask, or a past fed back from an output)")
        for p in iface.pairs:
            if p.kind == "state" and any(not isinstance(d, int) for d in p.shape):
                raise GenerationError(f"{where}: state input '{p.past}' has a dynamic shape {list(p.shape)}; cannot start it")
        width = self.specs[iface.input_ids].shape
        self.fixed_width = width[1] if width and len(width) == 2 and isinstance(width[1], int) else None
        # past inputs the export declares with one symbolic dim: their fed-back sizes must stay equal
        self.tied: dict[str, list[tuple[str, int]]] = {}
        for p in iface.pairs:
            shape = self.specs[p.past].shape or ()
            for axis, d in enumerate(shape):
                if isinstance(d, str):
                    self.tied.setdefault(d, []).append((p.past, axis))
        self.tied = {d: uses for d, uses in self.tied.items() if len(uses) > 1}
        self.max_seq = self._max_seq()
        self.recompute = self.state is None and not self.pairs and iface.seq_position is None
        self.reset()

    def _max_seq(self) -> int | None:
        if self.state is not None:
            axis = self.state["axis"] if self.state["axis"] is not None else SEQ_AXIS
            return int(self.state["shape"][1 + axis])
        return self.interface.max_seq

    def reset(self) -> None:
        """Forget the cache: the next call writes at position 0 (growing caches start empty along their
        sequence axis, static caches and recurrent/conv states start as zeros of their shape)."""
        self.position = 0
        self.context = np.zeros((1, 0), np.int64)
        if self.state is not None:
            self.runner.reset()
        self.past = {}
        for p in self.interface.pairs:
            spec = self.specs[p.past]
            shape = [d if isinstance(d, int) else (0 if i == p.axis else 1) for i, d in enumerate(spec.shape)]
            self.past[p.past] = np.zeros(shape, spec.np_dtype)

    def step(self, ids: np.ndarray) -> np.ndarray:
        """Run the model on token ids ``[1, n]`` at the current position; returns logits ``[1, n, vocab]``.

        Raises:
            GenerationError: the tokens would be written past the cache's ``max_seq`` positions; the export
                fixes the number of tokens per call at another count; or the model returned caches of
                different lengths for past inputs that its export declares with one dim (``positions``: the
                positions served before).
        """
        ids = np.asarray(ids, np.int64).reshape(1, -1)
        n = ids.shape[1]
        if self.max_seq is not None and self.position + n > self.max_seq:
            raise GenerationError(f"position {self.position} + {n} token(s) exceeds the cache's {self.max_seq} positions (--max-seq); call reset()")
        for dim, uses in self.tied.items():
            sizes = {name: self.past[name].shape[axis] for name, axis in uses}
            if len(set(sizes.values())) > 1:
                (a, sa), (b, sb) = next(((x, y) for x in sizes.items() for y in sizes.items() if x[1] != y[1]))
                raise GenerationError(
                    f"after {self.position} positions the model returned {sa} for '{a}' and {sb} for '{b}', but its "
                    f"export declares both with one dim '{dim}': the graph serves {self.position} positions, no more "
                    "(a sliding-window layer's past stops at its window; re-export with one past dim per layer)",
                    positions=self.position)
        iface = self.interface
        start = self.position
        width = self.context.shape[1] + n if self.recompute else n
        if self.fixed_width is not None and width != self.fixed_width:
            raise GenerationError(f"input '{iface.input_ids}' takes exactly {self.fixed_width} token(s) per call "
                                  f"(the export fixed its sequence dim), this call has {width}: a prefill of the "
                                  "prompt and one-token decode steps need a dynamic sequence dim; re-export with one")
        if self.recompute:  # no cache: run the whole sequence so far, keep the new tokens' logits
            self.context = ids = np.concatenate([self.context, ids], axis=1)
            start = 0
        feeds = {iface.input_ids: ids.astype(self.specs[iface.input_ids].np_dtype)}
        if iface.seq_position:
            feeds[iface.seq_position] = np.array([start], self.specs[iface.seq_position].np_dtype)
        if iface.position_ids:
            feeds[iface.position_ids] = np.arange(start, start + width, dtype=self.specs[iface.position_ids].np_dtype)[None]
        if iface.attention_mask:
            mask = self.specs[iface.attention_mask].shape[1]
            mask = mask if isinstance(mask, int) else start + width
            feeds[iface.attention_mask] = np.ones((1, mask), self.specs[iface.attention_mask].np_dtype)
        feeds.update(self.past)
        out = self.runner.run(feeds)
        for p, o in self.pairs:
            self.past[p] = out[o]
        self.position += n
        return out[iface.logits][:, -n:]

    def prefill(self, prompt_ids: list[int]) -> np.ndarray:
        """Run the prompt from the current position: one call, or one call per token for a module compiled for
        one token per call (``--dim seq_len=1``). Returns the logits of that call, ``[1, n, vocab]`` (``n`` = 1 for
        the per-token calls: the prompt's last position)."""
        if self.fixed_width == 1 and len(prompt_ids) > 1:
            for t in prompt_ids[:-1]:
                self.step(np.array([[t]], np.int64))
            return self.step(np.array([prompt_ids[-1:]], np.int64))
        return self.step(np.array([prompt_ids], np.int64))

    def prefill_token(self, prompt_ids: list[int]) -> int:
        """Run the prompt from the current position and return the greedy next token (the argmax of its last
        position's logits). On a folder that :attr:`decodes_on_device` the prompt's one-token calls are queued on
        the device several at a time and only the last call's ``next_token`` comes back
        (:meth:`rewrite.backends.iree.IreeRunner.greedy_decode`); otherwise :meth:`prefill`.

        Raises:
            GenerationError: an empty prompt, or the prompt exceeds the cache's positions.
            InputError: a token is outside the vocabulary.
            IreeRuntimeError: a call on the device failed; the generator is then reset.
        """
        if not prompt_ids:
            raise GenerationError("empty prompt: give at least one token id")
        if not self.decodes_on_device:
            return greedy_token(self.prefill(prompt_ids)[0, -1])
        [token] = self._on_device(list(prompt_ids), 1, len(prompt_ids), "token(s)")
        return token

    def _on_device(self, tokens: list[int] | int, count: int, calls: int, what: str) -> list[int]:
        """:meth:`rewrite.backends.iree.IreeRunner.greedy_decode` of ``tokens`` then ``count - 1`` greedy calls
        from the current position, ``calls`` calls in all; the position advances by them. ``what`` names the calls
        in the error.

        Raises:
            GenerationError: the calls would write past the cache's positions (checked first: nothing runs).
            InputError: the runner refused the tokens before queuing a call.
            IreeRuntimeError: a call failed; the generator is then reset (its cache holds the rows of the calls
                that ran, at positions it no longer knows).
        """
        if self.max_seq is not None and self.position + calls > self.max_seq:
            raise GenerationError(f"position {self.position} + {calls} {what} exceeds the cache's {self.max_seq} "
                                  "positions (--max-seq); call reset()")
        try:
            out = self.runner.greedy_decode(tokens, self.position, count)
        except InputError:  # refused before any call was queued: nothing ran
            raise
        except BaseException:
            self.reset()
            raise
        self.position += calls
        return out

    def generate(self, prompt_ids: list[int], max_new_tokens: int, *, logits: bool = True) -> GenerateResult:
        """Reset, prefill ``prompt_ids`` (:meth:`prefill`), then decode ``max_new_tokens`` greedily (argmax), one per
        call.

        ``logits=False``: keep no logits (``GenerateResult.logits`` empty), which lets the prompt's calls and the
        decode steps run on the device (:meth:`prefill_token` instead of :meth:`prefill`, then :meth:`decode`).

        Raises:
            GenerationError: an empty prompt, or the request exceeds the cache's positions (checked up front).
            InputError: a token is outside the vocabulary (``logits=False`` on the device).
            IreeRuntimeError: a call on the device failed (``logits=False``); the generator is then reset.
        """
        if not prompt_ids:
            raise GenerationError("empty prompt: give at least one token id")
        if self.max_seq is not None and len(prompt_ids) + max_new_tokens > self.max_seq + 1:
            raise GenerationError(f"{len(prompt_ids)} prompt + {max_new_tokens} new tokens need {len(prompt_ids) + max_new_tokens - 1} cache positions; the cache has {self.max_seq} (--max-seq)")
        self.reset()
        res = GenerateResult([])
        if max_new_tokens <= 0:
            return res
        if not logits:
            res.tokens.append(self.prefill_token(prompt_ids))
            res.tokens += self.decode(res.tokens[-1], max_new_tokens - 1)
            return res
        first = self.prefill(prompt_ids)
        res.tokens.append(greedy_token(first[0, -1]))
        res.logits.append(first)
        for _ in range(max_new_tokens - 1):
            out = self.step(np.array([[res.tokens[-1]]], np.int64))
            res.logits.append(out)
            res.tokens.append(greedy_token(out[0, -1]))
        return res

    @property
    def decodes_on_device(self) -> bool:
        """Whether :meth:`decode` keeps its steps on the device: a folder that can (a stateful IREE folder applied
        with ``--next-token``, :meth:`rewrite.backends.iree.IreeRunner.greedy_decode`) and ``device_decode``
        (the constructor's) True, or None and a GPU target: on llvm-cpu the "device" is the host's own cores, and
        queuing calls ahead measured 0.92x the host's loop there (BENCHMARKS.md)."""
        if not getattr(self.runner, "decodes_on_device", False) or self.recompute:
            return False
        return self.device_decode if self.device_decode is not None else self.manifest.target != "llvm-cpu"

    def decode(self, token: int, count: int) -> list[int]:
        """``count`` greedy decode calls from the current position: the first feeds ``token``, each later one
        the previous call's argmax; returns the ``count`` new tokens. On a folder that :attr:`decodes_on_device`
        the tokens stay on the device between calls and several calls are in flight; otherwise each call's logits
        come back and the argmax is taken here (:func:`greedy_token`). The same tokens either way (ties go to the
        first index; a logits row with a NaN may differ: ONNX ArgMax and numpy order NaN differently).

        Raises:
            GenerationError: the calls would write past the cache's positions.
            InputError: ``token`` is outside the vocabulary.
            IreeRuntimeError: a call on the device failed; the generator is then reset (its cache holds the rows
                of the calls that ran, at positions it no longer knows).
        """
        if count <= 0:
            return []
        if self.decodes_on_device:
            return self._on_device(token, count, count, "decode step(s)")
        if self.max_seq is not None and self.position + count > self.max_seq:
            raise GenerationError(f"position {self.position} + {count} decode step(s) exceeds the cache's {self.max_seq} "
                                  "positions (--max-seq); call reset()")
        tokens = []
        for _ in range(count):
            token = greedy_token(self.step(np.array([[token]], np.int64))[0, -1])
            tokens.append(token)
        return tokens

    def replay(self, prompt_ids: list[int], tokens: list[int]) -> list[np.ndarray]:
        """Reset, prefill ``prompt_ids``, then feed ``tokens[:-1]`` one per call whatever this model would pick
        (teacher forcing): the logits of the calls that :meth:`generate` made to produce ``tokens``, for comparing
        two models step by step even after their tokens part.

        Returns:
            ``len(tokens)`` logits arrays, the prefill's (:meth:`prefill`) then ``[1, 1, vocab]`` each.
        """
        if not tokens:
            return []
        self.reset()
        out = [self.prefill(prompt_ids)]
        for t in tokens[:-1]:
            out.append(self.step(np.array([[t]], np.int64)))
        return out


def generate(folder: str | Path, prompt_ids: list[int], max_new_tokens: int) -> GenerateResult:
    """One-shot :meth:`Generator.generate` on ``folder``."""
    return Generator(folder).generate(prompt_ids, max_new_tokens)
