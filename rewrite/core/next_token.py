"""The greedy next token as a graph output (``rewrite apply --next-token``).

A decode step's logits ``[B, S, vocab]`` are read back to the host only to take their argmax: 300 KB a step for a
151,936-token vocabulary, a copy and a host wait per step, and the host then has to feed the token back. With the
argmax in the graph, a runtime can feed one step's ``next_token`` to the next step on the device and keep several
steps in flight (:meth:`rewrite.generate.Generator.decode`), reading the tokens back behind them.

The output is ``ArgMax(logits[:, -1:, :], axis=-1, keepdims=0)``: int64 ``[B, 1]``, the shape of a one-token
``input_ids``. ONNX ArgMax with ``select_last_index=0`` returns the first index of the maximum (ONNX operator
spec, ArgMax), as ``numpy.argmax`` and :func:`rewrite.generate.greedy_token` do for ties; a row with a NaN may
differ (numpy returns the NaN's index, ONNX Runtime the maximum's).
"""

from __future__ import annotations

import numpy as np
import onnx

from rewrite.core.ir import Graph
from rewrite.errors import RewriteError

NEXT_TOKEN = "next_token"  #: the output's name
#: logits element types taken (ArgMax-13's floating-point T less bfloat16, which ONNX Runtime's CPU EP does not
#: implement: a folder written for it would not load)
_FLOAT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE)


def add_next_token(graph: Graph, logits: str = "logits") -> str:
    """Append the graph output :data:`NEXT_TOKEN`: the argmax of ``logits``' last position (see the module's
    docstring). Returns its name.

    Args:
        graph: a decoder graph with a ``logits`` output, float ``[B, S, vocab]`` (S may be symbolic).

    Raises:
        RewriteError: no such output, its type is not a floating-point rank-3 tensor, or the graph already has a
            value named :data:`NEXT_TOKEN`; the graph is left unchanged.
    """
    if logits not in graph.outputs:
        raise RewriteError(f"--next-token: the graph has no '{logits}' output (outputs: {', '.join(graph.outputs)}); "
                           "it needs a decoder's logits [batch, seq, vocab]")
    v = graph.values[logits]
    if v.dtype not in _FLOAT_TYPES or v.shape is None or len(v.shape) != 3:
        raise RewriteError(f"--next-token: output '{logits}' is {v.type_str()}; expected float, float16 or double "
                           "logits [batch, seq, vocab]")
    if NEXT_TOKEN in graph.values:
        raise RewriteError(f"--next-token: the graph already has a value named '{NEXT_TOKEN}'")
    batch, seq = v.shape[0], v.shape[1]
    last = logits
    if seq != 1:  # a prefill's [B, S, vocab]: keep the last position (a one-token module's logits are it)
        starts = graph.add_initializer(graph.fresh_name("next_token_start"), np.array([-1], np.int64)).name
        ends = graph.add_initializer(graph.fresh_name("next_token_end"), np.array([np.iinfo(np.int64).max], np.int64)).name
        axes = graph.add_initializer(graph.fresh_name("next_token_axis"), np.array([1], np.int64)).name
        last = graph.fresh_name("next_token_logits")
        graph.add_node("Slice", [logits, starts, ends, axes], [last], name=last)
        graph.values[last].set_type(v.dtype, (batch, 1, v.shape[2]))
    graph.add_node("ArgMax", [last], [NEXT_TOKEN], name=NEXT_TOKEN,
                   attrs=[onnx.helper.make_attribute("axis", -1), onnx.helper.make_attribute("keepdims", 0)])
    graph.values[NEXT_TOKEN].set_type(onnx.TensorProto.INT64, (batch, 1))
    graph.add_output(NEXT_TOKEN)
    return NEXT_TOKEN
