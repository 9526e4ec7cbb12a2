"""What every backend provides: lowering a rewritten graph into an output folder, and running that folder.

An output folder always holds ``manifest.json`` (see :class:`Manifest`) and ``model.onnx``, the rewritten
graph the backend lowered (kept so ``rewrite verify --locate`` can expose its intermediate values).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping, Protocol

import numpy as np

from rewrite.core.feeds import TensorSpec
from rewrite.core.interface import DecoderInterface, validate_feeds
from rewrite.core.ir import Graph
from rewrite.errors import BackendError

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "rewrite-manifest/1"


@dataclass
class Manifest:
    """Contents of ``manifest.json``.

    Attributes:
        backend: ``ort`` or ``iree``.
        target: ``cpu`` for ort; ``llvm-cpu`` or ``cuda`` for iree.
        source_model: path of the model given to ``rewrite apply``.
        model: the rewritten ONNX file in the folder.
        files: role -> file name in the folder (``vmfb``, ``mlir``, ``params``, ...).
        entry_function: name of the compiled function to call (iree).
        inputs, outputs: TensorSpec JSON of the function's arguments and results, in call order.
        state: module state (stateful KV cache globals), empty when none.
        kernel_objects: kernel object files linked in, relative to the folder.
        plugins: short names of the plugins applied, in order.
        dims: dimension overrides applied.
        frozen_inputs: graph inputs of the source whose initializer defaults were made constants
            (``apply --freeze-inputs``): the folder's function no longer takes them.
        report: per-plugin reports (see ``rewrite.core.driver.PluginReport.to_json``).
        decoder: the decode interface (``rewrite.core.interface.DecoderInterface.to_json``: token ids,
            positions, mask, past/present pairs with kind and shape, vocabulary size), None when the model
            is not a decoder.
        session: ort only: the ONNX Runtime session the folder runs with (``optimize``: a level of
            ``rewrite.backends.ort.OPT_LEVELS``; ``config``: session config entries), chosen so that the
            runtime's own graph optimizations keep the lowered graph's meaning; ``run``, ``verify`` and
            ``generate`` use it.
        target_options: what the target was compiled for beyond its name (iree cuda: ``cuda_sm``; iree llvm-cpu:
            ``host_cpu``, the compiling machine's CPU model, which the module is built for).
    """

    backend: str
    target: str
    source_model: str
    model: str = "model.onnx"
    files: dict[str, str] = field(default_factory=dict)
    entry_function: str | None = None
    inputs: list[dict] = field(default_factory=list)
    outputs: list[dict] = field(default_factory=list)
    state: list[dict] = field(default_factory=list)
    kernel_objects: list[str] = field(default_factory=list)
    plugins: list[str] = field(default_factory=list)
    dims: dict[str, int] = field(default_factory=dict)
    frozen_inputs: list[str] = field(default_factory=list)
    report: list[dict] = field(default_factory=list)
    decoder: dict | None = None
    session: dict = field(default_factory=dict)
    target_options: dict = field(default_factory=dict)
    format: str = MANIFEST_FORMAT

    def write(self, folder: Path) -> None:
        (folder / MANIFEST).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def read(cls, folder: Path) -> "Manifest":
        """Raises BackendError when the folder holds no readable manifest."""
        p = Path(folder) / MANIFEST
        if not p.is_file():
            raise BackendError(f"{folder}: no {MANIFEST} (not an output folder of 'rewrite apply')")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise BackendError(f"{p}: not valid JSON ({e})") from e
        if d.get("format") != MANIFEST_FORMAT:
            raise BackendError(f"{p}: manifest format {d.get('format')!r}, expected {MANIFEST_FORMAT!r}")
        return cls(**d)

    @property
    def input_specs(self) -> list[TensorSpec]:
        return [TensorSpec.from_json(d) for d in self.inputs]

    @property
    def output_specs(self) -> list[TensorSpec]:
        return [TensorSpec.from_json(d) for d in self.outputs]

    @property
    def decoder_interface(self) -> DecoderInterface | None:
        return DecoderInterface.from_json(self.decoder) if self.decoder else None


class Runner(Protocol):
    """A loaded output folder: call it with inputs by name, get outputs by name."""

    input_names: list[str]
    output_names: list[str]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


class Backend(Protocol):
    """A lowering target."""

    name: str
    targets: tuple[str, ...]

    def lower(self, graph: Graph, folder: Path, manifest: Manifest, *, options: dict, lowerings: dict) -> None:
        """Write the lowered model into ``folder`` and fill in ``manifest`` (files, inputs, outputs, ...);
        ``lowerings`` maps each abstract op_type to its lowering function for ``manifest.target``
        (:meth:`rewrite.core.lowering.LoweringRegistry.for_target`)."""
        ...

    def load(self, folder: Path, manifest: Manifest, *, low_memory: bool = False) -> Runner:
        """A runner of ``folder``; ``low_memory``: keep the weights in their memory-mapped files where the runtime
        would otherwise copy them into its own layouts (slower calls, memory that does not grow with the weights)."""
        ...


def check_feeds(specs: list[TensorSpec], feeds: dict[str, np.ndarray], where: str,
                decoder: DecoderInterface | None = None,
                defaults: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Feeds by name in ``specs`` order, validated first (:func:`rewrite.core.interface.validate_feeds`: names,
    dtypes, shapes, and token ids below the decoder's vocabulary). An input with a ``default`` that is left out
    takes its value from ``defaults`` when given there, and is otherwise absent from the result (ONNX Runtime
    applies the model's own initializer).

    Raises:
        InputError: one line naming the input and what was expected; no runtime has seen the feeds.
    """
    validate_feeds(specs, feeds, where, vocab=decoder.vocab if decoder else None,
                   token_input=decoder.input_ids if decoder else None)
    out = {}
    for s in specs:
        a = feeds.get(s.name, (defaults or {}).get(s.name))
        if a is not None:
            out[s.name] = np.require(a, requirements='C')  # (ascontiguousarray makes 0-d arrays 1-d)
    return out
