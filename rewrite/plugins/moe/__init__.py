"""``moe``: fuse the routed experts of each MoE block into one ``ai.rewrite::FusedMoE``.

Rules (patterns in :mod:`rewrite.plugins.moe.patterns`, the op and its lowerings in
:mod:`rewrite.plugins.moe.lowering`):

* ``fused-moe-hf``: ``batched_mm`` experts as transformers' exporter and ``torch.onnx.export(dynamo=True)`` write
  them (fp32/fp16; float stacks or ``quant4``'s INT4 stacks);
* ``fused-moe-seed-int4``: the seed's INT4 form, DequantizeLinear or after ``legalize``;
* ``fused-moe-by-value`` (tried last): any region that ends in the per-token sum over the k experts and passes
  the numerical check of :mod:`rewrite.plugins.moe.semantic` (transformers' default ``grouped_mm`` experts);
* ``fused-moe-index-add`` (tried last): the same check for a region whose weighted expert outputs are added
  into their tokens' rows by ``ScatterND(zeros, ids, ., reduction="add")`` (JetMoE's ``index_add``);
* ``fused-moe-scatter-sum`` (tried last): the same check for a loop over the experts, one module each, as
  TorchScript exports it (optimum's Qwen3-MoE): per expert ``ScatterElements(zeros, rows,
  out_e, axis=0)``, summed by a chain of Adds; the experts' 2-D weights are stacked in the chain's order;
* ``fused-moe-dense-sum`` (tried last): the same check for every expert run on every token, weighted by the
  routing scattered densely into [T, E] (zeros for the experts not selected) and summed over the experts,
  ``ReduceSum(., axes=[0])`` (optimum's gpt-oss): equal to FusedMoE within the check's tolerance (FusedMoE runs
  the k selected experts only, so an unselected expert's inf or NaN, which the original multiplies by zero, is
  not computed);
* ``fused-moe-shared`` (after them; for IREE cuda, or any backend with the option ``shared=true``): the sum with a
  sigmoid-gated shared expert (Qwen1.5-MoE) becomes FusedMoE's ``shared`` and ``shared_gate`` inputs
  (:mod:`rewrite.plugins.moe.shared`);
* ``fused-moe-residual`` (last; for IREE cuda, or any backend with the option ``residual=true``): the
  residual Add after a block becomes the FusedMoE's addend (:mod:`rewrite.plugins.moe.residual`).

All accept the router as the raw Softmax/TopK chain or as the ``topk`` plugin's ``MoERouterTopK``, so
``--plugins moe`` works alone and after ``topk``. The shared expert's own products (Qwen1.5-MoE) stay in the graph
(``matmul4`` takes them); only its gated sum with the routed experts can move into the op.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from rewrite.core.abstract_ops import DOMAIN
from rewrite.core.analysis import upstream_nodes
from rewrite.core.ir import dtype_name
from rewrite.core.matcher import Match, Matcher
from rewrite.core.pattern import AttrVar, Const, Or, Var
from rewrite.core.rules import rule
from rewrite.core.shape_eval import shape_elements
from rewrite.errors import RewriteError
from rewrite.plugins.base import KernelObject, Plugin
from rewrite.core.int4 import pack_int4
from rewrite.plugins.moe.lowering import FusedMoE, _ort_block
from rewrite.plugins.moe.patterns import hf_experts, seed_experts
from rewrite.plugins.moe.residual import fuse_residual
from rewrite.plugins.moe.shared import fuse_shared
from rewrite.plugins.moe.semantic import aliases, prove_fused_moe

_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16)


def _routing_attrs(m):
    """(k, normalize, mode) of the matched router, or a refusal string."""
    if "router" in m:
        if "topk" in m.binding.names or "topk_first" in m.binding.names:
            return "routing weights and expert indices come from different routers"
        r = m.node("router")
        mode = r.attr("mode", "softmax_topk")
        if mode not in ("softmax_topk", "topk_softmax"):
            return f"MoERouterTopK mode '{mode}' is not softmax_topk or topk_softmax"
        return int(r.attr("k")), int(r.attr("normalize", 0)), mode
    # weights and indices must come from one router spelling (one TopK node)
    topks = {m.binding.names[n] for n in ("topk", "topk_first") if n in m.binding.names}
    if len(topks) != 1:
        return "routing weights and expert indices come from different TopK nodes"
    first = "topk_first" in m.binding.names
    topk = m.node("topk_first" if first else "topk")
    if m.attr("largest") != 1:
        return m.fail(f"TopK has largest={m.attr('largest')}: it selects the lowest-probability experts", topk)
    k = m.const("k").reshape(-1)
    if k.size != 1:
        return f"TopK k '{m['k']}' is not a single value"
    return int(k[0]), int("norm_div" in m), ("topk_softmax" if first else "softmax_topk")


def _common_check(m, k: int):
    """Checks shared by both forms: dtypes of hidden, logits, routing-weight Cast and output."""
    hv, lv = m.value("hidden"), m.value("logits")
    if hv.dtype not in _FLOATS or hv.rank != 2:
        return f"hidden '{m['hidden']}' is {hv.type_str()}, expected float16/float32 [T, H]"
    if lv.dtype != hv.dtype or lv.rank != 2:
        return f"router logits '{m['logits']}' are {lv.type_str()}, expected {dtype_name(hv.dtype)} [T, E]"
    out = m.graph.values[m.outputs[0]]
    if out.dtype != hv.dtype:
        return f"expert output '{m.outputs[0]}' is {dtype_name(out.dtype)}, hidden is {dtype_name(hv.dtype)}"
    if "weights_cast" in m and m.attr("weights_to") not in _FLOATS:
        return "routing weights are cast to a non-float type"
    experts = lv.shape[1]
    if not 1 <= k <= 64 or (isinstance(experts, int) and k > experts):
        return f"k={k} outside 1..min(64, E={experts})"


def _routing_k(m):
    """k (int) of the matched router after the checks both forms share, or a refusal (str or Failure)."""
    ra = _routing_attrs(m)
    if not isinstance(ra, tuple):
        return ra
    return _common_check(m, ra[0]) or ra[0]


def _const_is(m, name: str, want) -> bool:
    c = m.const(name)
    return c is not None and list(c.reshape(-1)) == list(want)


def _repeats_rows(m, k: int, H: int) -> str | None:
    """Refusal unless the Tile / Expand of ``Unsqueeze(hidden, 1)`` [T, 1, H] makes [T, k, H] (each token
    row k times). An Expand target may hold run-time entries where broadcasting leaves no other result:
    its first entry 1 or (for k > 1, where a mismatch cannot broadcast later) any, its last 1 or H."""
    if "rep_tiles" in m:
        if _const_is(m, "rep_tiles", [1, k, 1]):
            return None
        return f"Tile repeats '{m['rep_tiles']}' are {m.const('rep_tiles').tolist()}, expected [1, {k}, 1] for k={k}"
    e = shape_elements(m.graph, m["rep_expand"])
    if e is not None and len(e) == 3 and e[1] == k and (e[0] == 1 or (e[0] is None and k > 1)) and e[2] in (1, H, None):
        return None
    return f"Expand shape '{m['rep_expand']}' is {e}, expected [1, {k}, 1] or [1, {k}, {H}] for k={k}"


def _reshapes_to(m, name: str, trailing: list[int]) -> str | None:
    """Refusal unless the Reshape target ``name`` ends in ``trailing`` (known entries). Its first entry may be
    anything (-1, or a run-time size such as onnxscript 0.7.0's ``Shape(input_ids)[1:2]``): the element
    count of the reshaped tensor fixes it to the one value the rule assumes."""
    e = shape_elements(m.graph, m[name])
    if e is not None and len(e) == len(trailing) + 1 and e[1:] == trailing:
        return None
    return f"Reshape target '{m[name]}' is {e}, expected [-1, {', '.join(map(str, trailing))}]"


@rule("fused-moe-hf")
def fused_moe_hf(op, hidden, logits):
    """transformers-exported routed experts (GatherND of stacked weights, batched MatMul) -> FusedMoE."""
    return hf_experts(op, hidden, logits)


@fused_moe_hf.check
def _(m):
    k = _routing_k(m)
    if not isinstance(k, int):
        return k
    hv = m.value("hidden")
    if "fc1" in m and "fc2" in m:
        fc1, fc2 = m.value("fc1"), m.value("fc2")
        if fc1.rank != 3 or fc2.rank != 3:
            return f"stacked expert weights '{m['fc1']}' {fc1.type_str()} / '{m['fc2']}' {fc2.type_str()} are not rank 3"
        E, N1, H = fc1.shape
        I = N1 // 2
        if N1 % 2 or tuple(fc2.shape) != (E, H, I):
            return f"expert weights {fc1.type_str()} and {fc2.type_str()} are not [E, 2I, H] and [E, H, I]"
        if fc1.dtype != hv.dtype or fc2.dtype != fc1.dtype:
            return f"expert weights are {dtype_name(fc1.dtype)}, hidden is {dtype_name(hv.dtype)}"
    elif "fc1q_codes" in m and "fc2q_codes" in m:
        if m.const("fc1q_codes").ndim != 3:
            return f"gate_up codes '{m['fc1q_codes']}' are not [E, 2I, H]"
        E, N1, H = m.const("fc1q_codes").shape
        I = N1 // 2
        bad = _check_quantized(m, {"fc1q": (2 * I, H), "fc2q": (H, I)})
        if bad:
            return bad
    else:
        return "gate_up and down stacks are not both float or both INT4"
    if m.value("logits").shape[1] != E:
        return f"router has {m.value('logits').shape[1]} experts, weights have {E}"
    if hv.shape[1] != H:
        return f"hidden width {hv.shape[1]} != expert input width {H}"
    return _repeats_rows(m, k, H) or _reshapes_to(m, "rep_shape", [H]) or _reshapes_to(m, "sum_shape", [k, H])


@fused_moe_hf.rewrite
def _(m, b):
    if "fc1" in m:
        k, normalize, mode = _routing_attrs(m)
        out = m.graph.values[m.outputs[0]]
        return b.op("FusedMoE", [m["hidden"], m["logits"], m["fc1"], m["fc2"]], domain=DOMAIN, k=k, normalize=normalize,
                    mode=mode, activation="swiglu", block_size=0, dtype=out.dtype, shape=out.shape)
    c = lambda n: m.const(n)  # noqa: E731
    return _emit_quantized(m, b, [c("fc1q_codes"), c("fc1q_scales"), c("fc1q_zp")], [c("fc2q_codes"), c("fc2q_scales"), c("fc2q_zp")],
                           _block_size(m, "fc1q"))


@rule("fused-moe-by-value", benefit=1)
def fused_moe_by_value(op, pairs):
    """Routed experts of any spelling (transformers' grouped_mm, ...) ending in the per-token sum over the k
    experts, proved equal to FusedMoE on random inputs (rewrite.plugins.moe.semantic). fp16 exports sum in
    float32: a Cast between the Reshape and the sum."""
    grouped = op.Reshape(pairs, Var("sum_shape"), _name="grouped")
    grouped = Or([op.Cast(grouped, to=AttrVar("sum_to")), grouped])
    return op.ReduceSum(grouped, Const("sum_axes", value=[1]), keepdims=0, _name="sum")


def _left_to_structural_rules(m) -> bool:
    """The sum is the end of a block ``fused-moe-hf`` accepts (in a dry run it is still there when this rule
    looks): counted once, by the structural rule."""
    sum_node = m.node("sum")
    anchors = [sum_node] + [c for c in m.graph.consumers(sum_node.outputs[0]) if c.op_type == "Cast"]
    matcher = Matcher(m.graph, fused_moe_hf.pattern)
    return any(fused_moe_hf.run_check(Match(m.graph, fused_moe_hf.pattern, b)) is None
               for a in anchors for b in matcher.match_at(a))


@fused_moe_by_value.check
def _(m):
    if _left_to_structural_rules(m):
        return "left to fused-moe-hf, which matches this block"
    e = shape_elements(m.graph, m["sum_shape"])
    if e is None or len(e) != 3 or e[1] is None or e[2] is None:
        return f"Reshape target '{m['sum_shape']}' is {e}, expected [T, k, H]"
    proven = prove_fused_moe(m.graph, m.node("sum"), m["pairs"], k=e[1])
    if isinstance(proven, str):
        return proven
    if m.graph.values[proven.hidden].shape[1] != e[2]:
        return f"the sum is over rows of width {e[2]}, hidden is {m.graph.values[proven.hidden].type_str()}"
    m.found["proven"] = proven
    m.extra_nodes = proven.region


@rule("fused-moe-index-add", benefit=1)
def fused_moe_index_add(op, zeros, index, pairs):
    """Routed experts whose outputs, weighted, are added into their tokens' rows (JetMoE: tokens sorted by
    expert, one Gemm per expert on its slice, ``index_add``), proved equal to FusedMoE on random inputs
    (rewrite.plugins.moe.semantic); k is the router's."""
    return op.ScatterND(zeros, index, pairs, reduction=AttrVar("reduction", default="none"), _name="sum")


def _is_zeros(graph, value: str) -> bool:
    """``value`` is zeros: a constant of zeros, or an Expand / ConstantOfShape of one."""
    node = graph.producer_node(value)
    if node is not None and node.op_type == "Expand":
        value, node = node.inputs[0], graph.producer_node(node.inputs[0])
    if node is not None and node.op_type == "ConstantOfShape":
        fill = node.attr("value")
        return fill is None or not np.any(fill)
    c = graph.const(value)
    return c is not None and not np.any(c)


@fused_moe_index_add.check
def _(m):
    node = m.node("sum")
    if node.attr("reduction", "none") != "add":
        return f"{node.describe()} has reduction={node.attr('reduction', 'none')}, pattern wants add"
    if not _is_zeros(m.graph, m["zeros"]):
        return f"'{m['zeros']}' (the rows added into) is not zeros"
    out = m.graph.values[node.outputs[0]]
    iv = m.graph.values[m["index"]]
    if out.rank != 2 or iv.rank != 2 or iv.shape[1] != 1:
        return f"{node.describe()} writes {out.type_str()} at indices {iv.type_str()}: expected rows [T, H] at [N, 1]"
    proven = prove_fused_moe(m.graph, node, m["pairs"], k=None)
    if isinstance(proven, str):
        return proven
    m.found["proven"] = proven
    m.extra_nodes = proven.region


@rule("fused-moe-scatter-sum", benefit=1)
def fused_moe_scatter_sum(op, acc, zeros, rows, out_e):
    """A loop over the experts as TorchScript exports ``index_add_`` (optimum): ``acc + ScatterElements(zeros,
    rows, out_e, axis=0)`` per expert, the last Add of the chain anchoring it; proved equal to FusedMoE on random
    inputs (rewrite.plugins.moe.semantic) with the experts' 2-D weights stacked in the chain's order."""
    return op.Add(acc, op.ScatterElements(zeros, rows, out_e, _name="term"), _name="sum")


def _scatter_term(graph, value: str):
    """The ``ScatterElements(zeros, rows, out_e, axis=0)`` (reduction none or add) producing ``value``, else None."""
    node = graph.producer_node(value)
    if node is None or node.op_type != "ScatterElements" or node.attr("axis", 0) != 0:
        return None
    if node.attr("reduction", "none") not in ("none", "add") or not _is_zeros(graph, node.inputs[0]):
        return None
    return node


def _shape_read(graph, node) -> bool:
    """``node`` reads its input only for the shape: a Shape, or a Slice only Shapes read (TorchScript's shape
    of a slice of the partial sum, for the next scatter's indices)."""
    if node.op_type == "Shape":
        return True
    return node.op_type == "Slice" and all(c.op_type == "Shape" for c in graph.consumers(node.outputs[0]))


def _scatter_chain(graph, add) -> list | None:
    """The ScatterElements terms, first expert first, that the chain of Adds ending at ``add`` sums (it starts
    from zeros or from the first term), or None when ``add`` is not such a chain of two terms or more."""
    terms = []
    while True:
        a, b = add.inputs
        ta, tb = _scatter_term(graph, a), _scatter_term(graph, b)
        if ta is None and tb is None:
            return None
        if ta is not None and tb is not None:  # the first Add: the first two experts' terms
            terms += [tb, ta]
            break
        acc, term = (a, tb) if tb is not None else (b, ta)
        terms.append(term)
        if _is_zeros(graph, acc):
            break
        first = _scatter_term(graph, acc)
        if first is not None:
            terms.append(first)
            break
        add = graph.producer_node(acc)
        # the partial sum may be read otherwise only for its shape (the next expert's zeros are shaped like it)
        if add is None or add.op_type != "Add" or sum(not _shape_read(graph, c) for c in graph.consumers(acc)) != 1:
            return None
    return terms[::-1] if len(terms) >= 2 else None


def _one_hot(graph, term) -> tuple[int | None, int | None]:
    """(k, E) when the experts' masks are ``OneHot`` of the [T, k] expert ids (transformers' loop over the
    experts): the static last dim of the nearest OneHot's indices above ``term`` and its constant depth; None
    for what is not there (the router's k is taken)."""
    for n in upstream_nodes(graph, [term.inputs[1]], set(graph.initializers) | set(graph.inputs), 200, truncate=True):
        if n.op_type == "OneHot":
            shape, depth = graph.values[n.inputs[0]].shape, graph.const(n.inputs[1])
            k = shape[-1] if shape and isinstance(shape[-1], int) else None
            return k, (int(depth.reshape(-1)[0]) if depth is not None and depth.size == 1 else None)
    return None, None


@fused_moe_scatter_sum.check
def _(m):
    g, node = m.graph, m.node("sum")
    terms = _scatter_chain(g, node)
    if terms is None:
        return "not the end of a chain of Adds of ScatterElements(zeros, rows, expert output, axis=0)"
    if any(c.op_type == "Add" and _scatter_chain(g, c) is not None for c in g.consumers(node.outputs[0])):
        return "inside a chain of expert terms (its last Add anchors it)"
    out = g.values[node.outputs[0]]
    if out.rank != 2:
        return f"{node.describe()} sums {out.type_str()}: expected rows [T, H]"
    outputs = [t.inputs[2] for t in terms]
    k, experts = _one_hot(g, terms[0])
    if experts is not None and experts != len(terms):
        return (f"the loop sums {len(terms)} experts' outputs, the experts' one-hot masks have {experts}: the "
                "export left experts out (a traced `if` per expert keeps only those its sample input routed to)")
    proven = prove_fused_moe(g, node, outputs[-1], k=k, expert_outputs=outputs)
    if isinstance(proven, str):
        return proven
    m.found["proven"] = proven
    m.extra_nodes = proven.region


@rule("fused-moe-dense-sum", benefit=1)
def fused_moe_dense_sum(op, pairs):
    """Every expert on every token, ``[E, ..., H]``, weighted by the dense routing (zero where an expert is not
    selected) and summed over the experts (optimum's gpt-oss); proved equal to FusedMoE on random inputs
    (rewrite.plugins.moe.semantic), k the router's."""
    return op.ReduceSum(pairs, Const("sum_axes", value=[0]), keepdims=0, _name="sum")


@fused_moe_dense_sum.check
def _(m):
    g, node = m.graph, m.node("sum")
    pv, out = g.values[m["pairs"]], g.values[node.outputs[0]]
    if pv.shape is None or len(pv.shape) not in (3, 4) or not isinstance(pv.shape[0], int) or pv.shape[0] < 2:
        return f"{node.describe()} sums {pv.type_str()} over axis 0: expected [E, T, H] or [E, B, S, H]"
    proven = prove_fused_moe(g, node, m["pairs"], k=None)
    if isinstance(proven, str):
        return proven
    if pv.shape[0] != proven.fc1.shape[0]:
        return f"{node.describe()} sums {pv.shape[0]} experts' outputs, the stacked weights hold {proven.fc1.shape[0]}"
    if out.rank == 3:  # [B, S, H]: the fused [T, H] takes the shape of the hidden state's [B, S, H] source
        src = [a for a in aliases(g, proven.hidden) if g.values[a].rank == 3]
        if not src:
            return f"{node.describe()} gives {out.type_str()}, and hidden '{proven.hidden}' has no [B, S, H] source"
        m.found["shape_of"] = src[0]
    m.found["proven"] = proven
    m.extra_nodes = proven.region


@fused_moe_by_value.rewrite
@fused_moe_index_add.rewrite
@fused_moe_scatter_sum.rewrite
@fused_moe_dense_sum.rewrite
def _(m, b):
    p = m.found["proven"]
    g = m.graph
    out = g.values[m.outputs[0]]
    hidden = g.values[p.hidden]
    dtype = helper.tensor_dtype_to_np_dtype(hidden.dtype)
    fc1, fc2 = b.const(p.fc1.astype(dtype), "gate_up"), b.const(p.fc2.astype(dtype), "down")
    ins = [p.hidden, p.logits, fc1, fc2]
    if p.mode == "routed":  # weights in hidden's dtype, ids int64: the contract's
        if g.values[p.logits].dtype != hidden.dtype:
            ins[1] = b.op("Cast", [p.logits], to=hidden.dtype, dtype=hidden.dtype, shape=g.values[p.logits].shape)
        ids = p.ids
        if g.values[ids].dtype != TensorProto.INT64:
            ids = b.op("Cast", [ids], to=TensorProto.INT64, dtype=TensorProto.INT64, shape=g.values[ids].shape)
        ins += ["", "", "", "", ids]
    if p.b1 is not None or p.b2 is not None:  # both or neither (IREE's kernels take both): a zero one for the other
        E, I2, H = p.fc1.shape[0], p.fc1.shape[1], p.fc2.shape[1]
        b1 = p.b1 if p.b1 is not None else np.zeros((E, I2), np.float32)
        b2 = p.b2 if p.b2 is not None else np.zeros((E, H), np.float32)
        ins += [""] * (9 - len(ins)) + [b.const(b1.astype(dtype), "gate_up_bias"), b.const(b2.astype(dtype), "down_bias")]
    rows = hidden.shape if "shape_of" in m.found else out.shape
    fused = b.op("FusedMoE", ins, domain=DOMAIN, k=p.k, normalize=p.normalize, mode=p.mode, activation="swiglu",
                 activation_alpha=p.alpha, activation_beta=p.beta, swiglu_limit=p.limit, block_size=0,
                 dtype=hidden.dtype, shape=rows)
    if "shape_of" in m.found:  # the sum's [B, S, H]
        fused = b.op("Reshape", [fused, b.op("Shape", [m.found["shape_of"]])], dtype=hidden.dtype, shape=out.shape)
    if out.dtype == hidden.dtype:
        return fused
    # fp16 exports sum the k expert outputs in float32: FusedMoE gives the hidden dtype, cast to the sum's
    return b.op("Cast", [fused], to=out.dtype, dtype=out.dtype, shape=out.shape)


@rule("fused-moe-seed-int4")
def fused_moe_seed(op, hidden, logits):
    """The seed's INT4 gather-then-compute experts (DequantizeLinear or legalize's form) -> FusedMoE."""
    return seed_experts(op, hidden, logits)


def _block_size(m, proj: str) -> int | None:
    if f"{proj}_bs" in m:
        return int(m.attr(f"{proj}_bs"))
    tiles = [m.const(f"{proj}_{t}_tiles") for t in ("sc", "zp")]
    if any(t is None or t.shape != (4,) or list(t[:3]) != [1, 1, 1] for t in tiles) or tiles[0][3] != tiles[1][3]:
        return None
    return int(tiles[0][3])


def _check_quantized(m, dims: dict[str, tuple]) -> str | None:
    """Codes uint8 [E, N, K] <= 15, scales (hidden's dtype) and zero points [E, N, ceil(K/bs)], one even block size."""
    hv = m.value("hidden")
    bss = {_block_size(m, p) for p in dims}
    if len(bss) != 1 or None in bss or min(bss) <= 0 or min(bss) % 2:
        return f"block sizes {sorted(map(str, bss))} of {', '.join(dims)} are not one even size"
    bs = bss.pop()
    E = m.const(f"{next(iter(dims))}_codes").shape[0]
    for p, (n, kk) in dims.items():
        c, s, z = m.const(f"{p}_codes"), m.const(f"{p}_scales"), m.const(f"{p}_zp")
        nb = -(-kk // bs)
        if c.dtype != np.uint8 or c.shape != (E, n, kk) or s.shape != (E, n, nb) or z.shape != (E, n, nb):
            return f"{p} codes/scales/zero points {c.dtype}{c.shape}/{s.shape}/{z.shape} do not fit uint8 [E={E}, {n}, {kk}] with block {bs}"
        if c.max(initial=0) > 15 or z.max(initial=0) > 15:
            return f"{p} codes or zero points exceed the UINT4 range"
        if s.dtype != np.dtype(np.float16 if hv.dtype == TensorProto.FLOAT16 else np.float32):
            return f"{p} scales are {s.dtype}, hidden is {dtype_name(hv.dtype)}"
    return None


def _emit_quantized(m, b, fc1: list, fc2: list, bs: int) -> str:
    """FusedMoE with INT4 weights: fc1/fc2 = [codes [E, N, K], scales, zero points], codes packed here."""
    k, normalize, mode = _routing_attrs(m)
    ins = [b.const(pack_int4(fc1[0]), "fc1"), b.const(pack_int4(fc2[0]), "fc2"), b.const(fc1[1], "fc1_scales"),
           b.const(fc1[2], "fc1_zero_points"), b.const(fc2[1], "fc2_scales"), b.const(fc2[2], "fc2_zero_points")]
    out = m.graph.values[m.outputs[0]]
    return b.op("FusedMoE", [m["hidden"], m["logits"]] + ins, domain=DOMAIN, k=k, normalize=normalize, mode=mode,
                activation="swiglu", block_size=bs, dtype=out.dtype, shape=out.shape)


@fused_moe_seed.check
def _(m):
    k = _routing_k(m)
    if not isinstance(k, int):
        return k
    hv = m.value("hidden")
    H = hv.shape[1]
    if m.const("gate_codes").ndim != 3:
        return f"gate codes '{m['gate_codes']}' are not [E, I, H]"
    E, I, _ = m.const("gate_codes").shape
    bad = _check_quantized(m, {"gate": (I, H), "up": (I, H), "down": (H, I)})
    if bad:
        return bad
    if m.value("logits").shape[1] != E:
        return f"router has {m.value('logits').shape[1]} experts, weights have {E}"
    bad = _repeats_rows(m, k, H)
    if bad:
        return bad
    for name, want in (("rep_shape", [-1, 1, H]), ("w_shape", [-1, 1, k]),
                       ("sum_shape", [-1, k, H]), ("out_shape", [-1, H])):
        if not _const_is(m, name, want):
            return f"'{m[name]}' is {m.const(name).tolist()}, expected {want} for k={k}, H={H}"
    return None


@fused_moe_seed.rewrite
def _(m, b):
    c = lambda n: m.const(n)  # noqa: E731
    cat = lambda a, b_: np.concatenate([c(a), c(b_)], 1)  # noqa: E731
    fc1 = [cat("gate_codes", "up_codes"), cat("gate_scales", "up_scales"), cat("gate_zp", "up_zp")]
    return _emit_quantized(m, b, fc1, [c("down_codes"), c("down_scales"), c("down_zp")], _block_size(m, "gate"))


class MoE(Plugin):
    name = "fused-moe"
    short = "moe"
    # moe takes topk's MoERouterTopK as the router of the block it fuses
    runs_after = ("topk",)
    description = "Fuse each MoE block's routed experts (router + SwiGLU experts + weighted sum) into FusedMoE"
    opset_range = (13, 28)
    kernels = (KernelObject("moe_gate_up_swiglu, moe_down_proj_reduce", "iree", "llvm-cpu", "kernels/moe_cpu.c"),
               KernelObject("moe_gate_up_f32/f16, moe_down_f32/f16, the tensor-core moe_gate_up_mma<S>_f16 and "
                            "moe_down_mma<S>_f16 (moe_down_mma<S>t1_f16 for one token), moe_fused_f32/f16", "iree", "cuda", "kernels/moe_cuda.cu"))

    @property
    def rules(self):
        return [fused_moe_hf, fused_moe_seed, fused_moe_by_value, fused_moe_index_add, fused_moe_scatter_sum,
                fused_moe_dense_sum]

    @property
    def abstract_ops(self):
        return [FusedMoE()]

    def run(self, graph, report, ctx=None, *, dry_run=False):
        """Apply the rules, :func:`fuse_shared` and :func:`fuse_residual` (options ``shared`` and ``residual``:
        default true for IREE cuda, where CUDA's down half adds the gated shared expert and the residual in its
        store, false elsewhere, where the ops come back in the lowering and nothing is gained), then note per INT4
        FusedMoE how ONNX Runtime will run it (QMoE block or float MoE). Options ``launches`` (2, the default, or 1)
        and ``tensor_cores`` (true, the default, or false) are the IREE cuda lowering's: the gate_up and down
        kernels, or ``moe_fused``'s one launch (measured slower on the GPU, a launch fewer on the host:
        BENCHMARKS.md); of the two kernels, the tensor-core pair where the shape allows it (``lowering.cuda_mma_steps``).

        Raises:
            RewriteError: an unknown option, ``residual``, ``shared`` or ``tensor_cores`` not a boolean,
                ``launches`` not 1 or 2."""
        opts = dict(((getattr(ctx, "options", None) or {}).get(self.short) or {}))
        known = {"residual", "shared", "launches", "tensor_cores"}
        if set(opts) - known:
            raise RewriteError(f"moe: unknown option '{sorted(set(opts) - known)[0]}'; options: residual, shared, "
                               "launches, tensor_cores")
        cuda = ctx is not None and (ctx.backend, getattr(ctx, "target", None)) == ("iree", "cuda")
        residual, shared = opts.get("residual", cuda), opts.get("shared", cuda)
        for name, value in (("residual", residual), ("shared", shared), ("tensor_cores", opts.get("tensor_cores", True))):
            if not isinstance(value, bool):
                raise RewriteError(f"moe: option {name}={value!r}; true or false expected")
        if opts.get("launches", 2) not in (1, 2) or isinstance(opts.get("launches"), bool):
            raise RewriteError(f"moe: option launches={opts['launches']!r}; 1 or 2 expected")
        super().run(graph, report, ctx, dry_run=dry_run)
        if shared:  # first: the residual Add then reads the block's own output
            fuse_shared(graph, report, dry_run=dry_run)
        if residual:
            fuse_residual(graph, report, dry_run=dry_run)
        if dry_run or getattr(ctx, "backend", "ort") != "ort":
            return
        for n in graph.nodes_by_op("FusedMoE", DOMAIN):
            bs = int(n.attr("block_size", 0))
            if not bs:
                continue
            fc1 = graph.values[n.inputs[2]].shape
            h, i = graph.values[n.inputs[0]].shape[1], fc1[1] // 2
            cuda = getattr(ctx, "target", "cpu") == "cuda"
            q = _ort_block(bs, h, i, len(n.inputs) > 5 and bool(n.inputs[5]), cuda=cuda)
            f32 = graph.values[n.inputs[0]].dtype != TensorProto.FLOAT16
            if cuda and f32:
                report.notes.append(f"{n.name}: QMoE has no float32 CUDA kernel; ONNX Runtime runs com.microsoft "
                                    "MoE with dequantized float experts")
            elif q == 0:
                report.notes.append(f"{n.name}: INT4 block {bs} with H={h}, I={i} has no QMoE block_size; "
                                    "ONNX Runtime runs com.microsoft MoE with dequantized float experts")
            elif q != bs:
                report.notes.append(f"{n.name}: QMoE block_size {q} (the model's {bs}-blocks split, scales and zero points repeated)")

    @property
    def cases(self):
        from rewrite.plugins.moe.cases import moe_cases

        return moe_cases()
