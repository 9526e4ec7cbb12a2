"""Abstract ops: what a plugin's rewrite produces, lowered separately for each backend.

A matched subgraph becomes one node in domain :data:`DOMAIN` (say ``ai.rewrite::MoERouterTopK``) with a
declared contract and a numpy reference. Each backend lowers it its own way:

* ``ort``: :meth:`AbstractOp.lower_ort` replaces the node in the graph by ONNX Runtime contrib ops
  (com.microsoft QMoE, MoE, MatMulNBits, ...) or a standard-ONNX decomposition, before the file is written;
* ``iree``: IREE's ONNX importer turns the node into ``torch.operator "onnx.<op_type>"`` (it drops the
  domain, so op types must not collide with ONNX op names), and :meth:`AbstractOp.lower_iree` returns the
  MLIR that replaces it: an extern dispatch of a plugin kernel, or plain tensor ops
  (see :mod:`rewrite.backends.iree_patch`).

The producing rule must record a type on every output (``Builder.op(..., dtype=, shape=)``): the importer
types an output it cannot infer as ``!torch.none``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import numpy as np

from rewrite.core.lowering import Lowering, LoweringError

if TYPE_CHECKING:
    from rewrite.core.iree_lowering import IreeLowering, PatchContext, TorchOperator
    from rewrite.core.ir import Graph, Node

DOMAIN = "ai.rewrite"  #: domain of every abstract op


class AbstractOp:
    """Base class; subclasses set :attr:`op_type` and implement the reference and the lowerings."""

    op_type: ClassVar[str] = ""
    domain: ClassVar[str] = DOMAIN
    #: targets :meth:`lower_ort` and :meth:`lower_iree` serve (:data:`rewrite.core.lowering.TARGETS`); when not
    #: declared, ``("cpu",)`` and ``("llvm-cpu",)`` for an overridden method, none otherwise
    ort_targets: ClassVar[tuple[str, ...] | None] = None
    iree_targets: ClassVar[tuple[str, ...] | None] = None

    def lowerings(self) -> list[Lowering]:
        """The lowerings this op brings (:mod:`rewrite.core.lowering`): its methods on its declared targets.
        Lowerings for other targets come from the ``rewrite_lowerings`` hook, in any package."""
        out = []
        for backend, method, declared, default in (("ort", "lower_ort", self.ort_targets, ("cpu",)),
                                                     ("iree", "lower_iree", self.iree_targets, ("llvm-cpu",))):
            overridden = getattr(type(self), method) is not getattr(AbstractOp, method)
            if declared and not overridden:
                raise LoweringError(f"{self.op_type} declares {backend} targets {', '.join(declared)} but has no {method}")
            targets = declared if declared is not None else (default if overridden else ())
            if targets:
                out.append(Lowering(self.op_type, backend, tuple(targets), getattr(self, method), origin=type(self).__module__))
        return out

    def reference(self, attrs: dict, *inputs: np.ndarray) -> list[np.ndarray]:
        """numpy semantics of the op (the contract every lowering and kernel is tested against)."""
        raise NotImplementedError

    def lower_ort(self, graph: "Graph", node: "Node") -> None:
        """Replace ``node`` in ``graph`` by ops ONNX Runtime runs (contrib ops or a decomposition)."""
        raise NotImplementedError(f"{self.op_type} has no ONNX Runtime lowering")

    def lower_iree(self, op: "TorchOperator", ctx: "PatchContext") -> "IreeLowering":
        """MLIR replacing the imported ``torch.operator "onnx.<op_type>"``."""
        raise NotImplementedError(f"{self.op_type} has no IREE lowering")

    #: Optional conformance hook: ``sample_inputs(rng: numpy.random.Generator) -> list[(attrs, inputs)]``,
    #: ``attrs`` a dict of the node's ONNX attributes and ``inputs`` a list of numpy arrays. Cover several
    #: shapes, ragged ones included (a row count not a multiple of the kernel's tile, an expert with no
    #: token). When defined, the conformance kit (:mod:`rewrite.testing.conformance`, check ``kernel-<backend>``)
    #: lowers each sample as a one-node model for every backend of the plugin and compares it with
    #: :meth:`reference` (float32 rtol 1e-4, float16 1e-2, integers exact). Each sample costs one compile on
    #: IREE (~2-4 s): keep the list short.
    sample_inputs: ClassVar = None
