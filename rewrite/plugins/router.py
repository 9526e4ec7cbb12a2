"""``topk``: the MoE router (softmax + top-k [+ renormalization]) as one abstract op, ``MoERouterTopK``.

Forms matched (ONNX opset 13+, expert axis last):

* ``softmax-topk``: ``Softmax(logits) -> [Cast] -> TopK`` (Qwen1.5/Qwen2-MoE as transformers exports it; the
  seed form, whose f16 probabilities are Cast to f32 before TopK);
* ``softmax-topk-renorm``: the same, then ``Div(values, ReduceSum(values, axes=[-1], keepdims=1))``
  (Qwen3-MoE's ``router_top_value /= router_top_value.sum(dim=-1, keepdim=True)``, Mixtral);
* ``topk-softmax`` / ``topk-softmax-renorm``: ``TopK(logits) -> Softmax`` over the k selected logits
  (gpt-oss), optionally renormalized the same way;
* ``topk-exact`` (tried last): any other float TopK over the last axis with ``largest=1, sorted=1`` (the group
  and biased selections of sigmoid routers, routers the forms above do not cover) -> ``mode=topk``, the k
  largest values and their indices, so that IREE never runs its own TopK on them.

Why: IREE 3.13's own lowering of the router TopK returns wrong indices inside the full models (seed 000
"TopK Extern Kernel"; located by ``rewrite verify --locate``), and its sort-based TopK costs ~216 dispatches.
On IREE the op runs as one dispatch of ``plugin_kernels/topk/router_topk.c``; on ONNX Runtime it is lowered
back to standard ONNX (a ``moe`` plugin may instead absorb it into com.microsoft MoE/QMoE).

Refused, with the reason in the report: Softmax and TopK on different axes or not on the last axis,
``largest=0``, ``sorted=0`` (ORT's order is then unspecified), k not a constant or outside ``1..E``, a
dynamic or too large expert count, a Cast between Softmax and TopK that does not hold every value (to a
narrower float or to an integer), logits other than float16/float32, intermediate values read outside the
match (renormalized forms).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from rewrite.backends.iree_patch import IreeLowering, PatchContext, TorchOperator
from rewrite.core.abstract_ops import DOMAIN, AbstractOp
from rewrite.core.ir import Graph, Node, dtype_name
from rewrite.core.kernels import build_cpu_object, kernel_source
from rewrite.core.pattern import AttrVar, Const, Or
from rewrite.core.rules import Builder, holds_every_value_of, rule
from rewrite.errors import BackendError
from rewrite.plugins.base import KernelObject, Plugin

MAX_EXPERTS = 1024  #: the kernel keeps one f32 score per expert on the stack (passed to it with -D)
TOKENS_PER_WORKGROUP = 64  #: tokens one IREE workgroup routes
MODES = ("softmax_topk", "topk_softmax", "topk")
_FLOATS = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}
_KERNEL_FLAGS = (f"-DROUTER_TOPK_MAX_EXPERTS={MAX_EXPERTS}", f"-DROUTER_TOPK_TOKENS={TOKENS_PER_WORKGROUP}",
                 "-fno-tree-loop-distribute-patterns")  # no memset/memcpy calls: there is no libc to link


def router_topk_reference(logits: np.ndarray, k: int, normalize: int = 0, mode: str = "softmax_topk",
                          weights_dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """numpy semantics of ``ai.rewrite::MoERouterTopK`` (what the C kernel computes, bit for bit on indices).

    Args:
        logits: [..., E] float16 or float32 router logits (expert axis last).
        k: experts per token, 1 <= k <= E.
        normalize: 1 to divide the k weights by their sum.
        mode: ``softmax_topk`` (softmax over E, then the k largest probabilities), ``topk_softmax`` (the k
            largest logits, then softmax over them) or ``topk`` (the k largest values themselves: ONNX TopK with
            ``largest=1, sorted=1`` over the last axis).
        weights_dtype: float32 or float16, the weights' element type.

    Returns:
        (weights [..., k] ``weights_dtype``, indices [..., k] int64), sorted by descending score; equal scores
        give the lower index first (ONNX TopK-11). Softmax runs on float32 inputs with exp and sum in float64,
        rounded once to float32; renormalization divides in float64 and rounds to float32; then one rounding
        to ``weights_dtype``.

    Raises:
        ValueError: bad k or mode.
    """
    x = np.asarray(logits).astype(np.float32)
    e = x.shape[-1]
    if not 1 <= k <= e:
        raise ValueError(f"MoERouterTopK: k={k} outside 1..{e}")
    if mode not in MODES:
        raise ValueError(f"MoERouterTopK: mode '{mode}' is not one of {', '.join(MODES)}")

    def softmax(v: np.ndarray) -> np.ndarray:
        d = v.astype(np.float64)
        ex = np.exp(d - d.max(-1, keepdims=True))
        return (ex / ex.sum(-1, keepdims=True)).astype(np.float32)

    scores = softmax(x) if mode == "softmax_topk" else x
    idx = np.argsort(-scores, axis=-1, kind="stable")[..., :k]
    w = np.take_along_axis(scores, idx, -1)
    if mode == "topk_softmax":
        w = softmax(w)
    if normalize:
        d = w.astype(np.float64)
        w = (d / d.sum(-1, keepdims=True)).astype(np.float32)
    return w.astype(weights_dtype), idx.astype(np.int64)


class MoERouterTopK(AbstractOp):
    """``ai.rewrite::MoERouterTopK(logits) -> (weights, indices)``: the MoE router in one op.

    Inputs:
        logits: [..., E] float16 | float32 (in the Qwen models [T, E]); E static, at most :data:`MAX_EXPERTS`.
    Outputs:
        weights: [..., k] float32 | float16, the element type the matched graph's consumers read (the TopK
            values', or the Softmax's/Div's output type);
        indices: [..., k] int64 expert ids, by descending score, lower index first among equal scores.
    Attributes:
        k (int): experts per token.
        normalize (int 0/1): divide the k weights by their sum.
        mode (string): ``softmax_topk`` (softmax over all E in float32, then top-k) or ``topk_softmax``
            (top-k of the logits, then softmax over the k).

    Softmax is always computed in float32 (exp/sum in float64), also for float16 logits, as the seed's kernel
    does: on float16 graphs the op is more accurate than the original, whose probabilities are rounded to
    float16, so experts whose probabilities tie only after that rounding may be ordered differently.
    Semantics: :func:`router_topk_reference`. A ``moe`` plugin consuming this op may read the router's
    ``logits`` input and ``k``/``normalize`` for com.microsoft MoE/QMoE (``k``, ``normalize_routing_weights``).
    """

    op_type = "MoERouterTopK"

    def reference(self, attrs: dict, logits: np.ndarray) -> list[np.ndarray]:
        """``attrs``: k, normalize, mode, and optionally ``weights_dtype`` (numpy dtype, default float32)."""
        w, i = router_topk_reference(logits, int(attrs["k"]), int(attrs.get("normalize", 0)),
                                     attrs.get("mode", "softmax_topk"), attrs.get("weights_dtype", np.float32))
        return [w, i]

    def sample_inputs(self, rng: np.random.Generator) -> list[tuple[dict, list[np.ndarray]]]:
        """Conformance-kit samples: ragged token counts around the 64-token workgroup, both modes, f16 logits."""
        return [
            (dict(k=4, normalize=0, mode="softmax_topk"), [rng.standard_normal((65, 60)).astype(np.float32)]),
            (dict(k=8, normalize=1, mode="softmax_topk"), [rng.standard_normal((3, 128)).astype(np.float16)]),
            (dict(k=2, normalize=0, mode="topk_softmax"), [rng.standard_normal((2, 63, 16)).astype(np.float32)]),
        ]

    def lower_ort(self, graph: Graph, node: Node) -> None:
        """Standard ONNX: Cast to f32, Softmax/TopK in the op's order, [ReduceSum, Div], Cast to the weights type;
        mode ``topk`` is the TopK it replaced."""
        k, normalize, mode = _attrs_of(node)
        b = Builder(graph, "lower/MoERouterTopK", node.order, node.name or "router")
        x = node.inputs[0]
        if mode == "topk":
            v, idx = b.op("TopK", [x, b.const([k], "k", np.int64)], outputs=2, axis=-1, largest=1, sorted=1)
            graph.replace_node(node, [v, idx])
            return
        if graph.values[x].dtype != TensorProto.FLOAT:
            x = b.op("Cast", [x], to=TensorProto.FLOAT)
        kk = b.const([k], "k", np.int64)
        if mode == "softmax_topk":
            w, idx = b.op("TopK", [b.op("Softmax", [x], axis=-1), kk], outputs=2, axis=-1, largest=1, sorted=1)
        else:
            v, idx = b.op("TopK", [x, kk], outputs=2, axis=-1, largest=1, sorted=1)
            w = b.op("Softmax", [v], axis=-1)
        if normalize:
            w = b.op("Div", [w, b.op("ReduceSum", [w, b.const([-1], "axes", np.int64)], keepdims=1)])
        wdt = graph.values[node.outputs[0]].dtype or TensorProto.FLOAT
        if wdt != TensorProto.FLOAT:
            w = b.op("Cast", [w], to=wdt)
        graph.replace_node(node, [w, idx])

    def lower_iree(self, op: TorchOperator, ctx: PatchContext) -> IreeLowering:
        """One ``flow.dispatch`` of ``router_topk_<in>_<out>`` (C kernel, statically linked), one workgroup per
        :data:`TOKENS_PER_WORKGROUP` tokens; logits are collapsed to 1-D and results expanded back.

        Raises:
            BackendError: dtype other than f16/f32, dynamic or too large E, k outside 1..E, unknown mode.
        """
        xt, wt, it = op.operand_types[0], op.result_types[0], op.result_types[1]
        where = f"MoERouterTopK {op.result}"
        rank, e = len(xt.dims), xt.dims[-1] if xt.dims else None
        k, normalize, mode = int(op.attrs.get("k", 0)), int(op.attrs.get("normalize", 0)), op.attrs.get("mode", "softmax_topk")
        if xt.element not in ("f16", "f32") or wt.element not in ("f16", "f32") or it.element != "si64":
            raise BackendError(f"{where}: types {xt.text} -> {wt.text}, {it.text}; expected f16|f32 -> f16|f32, si64")
        if rank < 2 or not isinstance(e, int) or not 1 <= e <= MAX_EXPERTS:
            raise BackendError(f"{where}: logits {xt.text} need rank >= 2 and a static last dim of 1..{MAX_EXPERTS}")
        if not 1 <= k <= e or mode not in MODES:
            raise BackendError(f"{where}: k={k}, mode='{mode}'; expected 1 <= k <= {e} and a mode in {', '.join(MODES)}")
        obj = build_cpu_object(kernel_source("topk", "router_topk.c"), extra_flags=_KERNEL_FLAGS)
        xe, we = xt.builtin_element, wt.builtin_element
        entry = f"router_topk_{xe}_{we}"
        lines = ["    %rt_t0 = arith.constant 1 : index"]
        dims = []
        for ax in range(rank - 1):
            d = xt.dims[ax]
            if d is None:
                dims.append(f"%in0_d{ax}")
            else:
                lines.append(f"    %rt_s{ax} = arith.constant {d} : index")
                dims.append(f"%rt_s{ax}")
            lines.append(f"    %rt_t{ax + 1} = arith.muli %rt_t{ax}, {dims[-1]} : index")
        t = f"%rt_t{rank - 1}"
        group = "[[" + ", ".join(str(a) for a in range(rank)) + "]]"
        static = all(isinstance(d, int) for d in xt.dims)
        flat_static = f"tensor<{np.prod(xt.dims, dtype=np.int64) if static else '?'}x{xe}>"
        lines += [
            f"    %rt_e = arith.constant {e} : index",
            f"    %rt_k = arith.constant {k} : index",
            f"    %rt_mode = arith.constant {MODES.index(mode)} : index",
            f"    %rt_norm = arith.constant {normalize} : index",
            f"    %rt_ne = arith.muli {t}, %rt_e : index",
            f"    %rt_nk = arith.muli {t}, %rt_k : index",
            f"    %rt_c{TOKENS_PER_WORKGROUP - 1} = arith.constant {TOKENS_PER_WORKGROUP - 1} : index",
            f"    %rt_c{TOKENS_PER_WORKGROUP} = arith.constant {TOKENS_PER_WORKGROUP} : index",
            f"    %rt_tp = arith.addi {t}, %rt_c{TOKENS_PER_WORKGROUP - 1} : index",
            f"    %rt_nwg = arith.divui %rt_tp, %rt_c{TOKENS_PER_WORKGROUP} : index",
            f"    %rt_flat{'0' if static else ''} = tensor.collapse_shape %in0 {group} : {xt.builtin} into {flat_static}",
        ]
        if static:  # the dispatch takes a dynamic 1-D tensor (T is dynamic in every real graph)
            lines.append(f"    %rt_flat = tensor.cast %rt_flat0 : {flat_static} to tensor<?x{xe}>")
        lines.append(
            f"    %rt_w, %rt_i = flow.dispatch @{entry}_exec::@{entry}[%rt_nwg](%rt_flat, {t}, %rt_e, %rt_k, %rt_mode, %rt_norm)"
            f" : (tensor<?x{xe}>{{%rt_ne}}, index, index, index, index, index) -> (tensor<?x{we}>{{%rt_nk}}, tensor<?xi64>{{%rt_nk}})"
        )
        lead = "?x" * (rank - 1)
        shape = ", ".join(dims + [str(k)])
        for name, src, res in (("%out0", "%rt_w", wt), ("%out1", "%rt_i", it)):
            el = res.builtin_element
            dyn = f"tensor<{lead}{k}x{el}>"
            lines.append(f"    {name}_x = tensor.expand_shape {src} {group} output_shape [{shape}] : tensor<?x{el}> into {dyn}")
            lines.append(f"    {name} = tensor.cast {name}_x : {dyn} to {res.builtin}")
        return IreeLowering(body="\n".join(lines), module_items={f"{entry}_exec": _executable(entry, xe, we, obj)},
                            kernel_objects=[str(obj)])


def _executable(entry: str, xe: str, we: str, obj) -> str:
    """The ``stream.executable`` whose export calls the statically linked ``<entry>_workgroup`` C function."""
    return f"""
  stream.executable private @{entry}_exec attributes {{
    hal.executable.objects = #hal.executable.objects<{{
      #hal.executable.target<"llvm-cpu", "embedded-elf-x86_64"> = [#hal.executable.object<{{path = "{obj}"}}>]
    }}>
  }} {{
    stream.executable.export public @{entry} workgroups(%n: index) -> (index, index, index) {{
      %c1 = arith.constant 1 : index
      stream.return %n, %c1, %c1 : index, index, index
    }}
    builtin.module {{
      func.func private @{entry}_workgroup(memref<{xe}>, index, memref<{we}>, index, memref<i64>, index, index, index, index, index, index, index)
        attributes {{hal.import.static, llvm.bareptr = true}}
      func.func @{entry}(%b0: !stream.binding, %b1: !stream.binding, %b2: !stream.binding, %t: index, %e: index, %k: index, %mode: index, %norm: index) {{
        %c0 = arith.constant 0 : index
        %wg = stream.dispatch.workgroup.id[0] : index
        %ne = arith.muli %t, %e : index
        %nk = arith.muli %t, %k : index
        %m0 = stream.binding.subspan %b0[%c0] : !stream.binding -> memref<?x{xe}>{{%ne}}
        %m1 = stream.binding.subspan %b1[%c0] : !stream.binding -> memref<?x{we}>{{%nk}}
        %m2 = stream.binding.subspan %b2[%c0] : !stream.binding -> memref<?xi64>{{%nk}}
        %p0, %o0, %s0, %t0 = iree_codegen.extract_strided_metadata %m0 : memref<?x{xe}> -> memref<{xe}>, index, index, index
        %p1, %o1, %s1, %t1 = iree_codegen.extract_strided_metadata %m1 : memref<?x{we}> -> memref<{we}>, index, index, index
        %p2, %o2, %s2, %t2 = iree_codegen.extract_strided_metadata %m2 : memref<?xi64> -> memref<i64>, index, index, index
        func.call @{entry}_workgroup(%p0, %o0, %p1, %o1, %p2, %o2, %t, %e, %k, %wg, %mode, %norm)
          : (memref<{xe}>, index, memref<{we}>, index, memref<i64>, index, index, index, index, index, index, index) -> ()
        return
      }}
    }}
  }}"""


def _attrs_of(node: Node) -> tuple[int, int, str]:
    """(k, normalize, mode) of a MoERouterTopK node; BackendError naming the node when they are invalid."""
    mode = node.attr("mode", "softmax_topk")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    k, normalize = node.attr("k"), node.attr("normalize", 0)
    if mode not in MODES or k is None or int(k) < 1 or normalize not in (0, 1):
        raise BackendError(f"node {node.describe()}: k={k}, normalize={normalize}, mode='{mode}'; expected k >= 1, normalize 0|1, mode in {', '.join(MODES)}")
    return int(k), int(normalize), mode


# ----------------------------------------------------------------------------------------------- rules
def _topk(op, x, k):
    return op.TopK(x, k, axis=AttrVar("topk_axis", default=-1), largest=AttrVar("largest", default=1),
                   sorted=AttrVar("sorted", default=1), _outputs=2, _name="topk")


def _probs(op, logits):
    """Softmax(logits), optionally Cast (the seed form's f16 -> f32)."""
    sm = op.Softmax(logits, axis=AttrVar("sm_axis", default=-1), _name="softmax")
    return Or([op.Cast(sm, to=AttrVar("cast_to"), _name="cast"), sm])


def _renorm(op, w):
    s = op.ReduceSum(w, Const("sum_axes"), keepdims=AttrVar("keepdims", default=1), _name="sum")
    return op.Div(w, s, _name="div")


@rule("topk-exact")
def topk_exact(op, x, k=Const("k")):
    """Any other TopK over the last axis (largest=1, sorted=1) -> MoERouterTopK(mode=topk): the exact kernel on
    IREE instead of IREE's own TopK (group scores and biased selection of sigmoid routers, for one)."""
    return _topk(op, x, k)


@topk_exact.check
def _(m):
    topk, xv = m.node("topk"), m.value("x")
    if xv.dtype not in _FLOATS:
        return m.fail(f"TopK input '{m['x']}' is {dtype_name(xv.dtype)}; the kernel takes FLOAT16 or FLOAT", topk)
    if xv.shape is None or len(xv.shape) < 2 or not isinstance(xv.shape[-1], int) or xv.shape[-1] > MAX_EXPERTS:
        return m.fail(f"TopK input '{m['x']}' is {xv.type_str()}; expected rank >= 2 and a static last dim of at most {MAX_EXPERTS}", topk)
    rank, e = len(xv.shape), xv.shape[-1]
    if not _last_axis(m.attr("topk_axis"), rank):
        return m.fail(f"TopK over axis {m.attr('topk_axis')} of rank {rank}, not the last", topk)
    if m.attr("largest") != 1 or m.attr("sorted") != 1:
        return m.fail(f"TopK largest={m.attr('largest')} sorted={m.attr('sorted')}; the kernel gives the largest, sorted", topk)
    kc = m.const("k").reshape(-1)
    if kc.size != 1 or not 1 <= int(kc[0]) <= e:
        return m.fail(f"TopK k={kc.tolist()} is not one value in 1..{e}", topk)
    return None


@topk_exact.rewrite
def _(m, b):
    xv = m.value("x")
    k = int(m.const("k").reshape(-1)[0])
    if b.graph.opset(DOMAIN) is None:
        b.graph.model_shell.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return list(b.op(MoERouterTopK.op_type, [m["x"]], domain=DOMAIN, outputs=2, dtype=[xv.dtype, TensorProto.INT64],
                     shape=tuple(xv.shape[:-1]) + (k,), k=k, normalize=0, mode="topk"))


@rule("softmax-topk")
def softmax_topk(op, logits, k=Const("k")):
    """Softmax -> [Cast] -> TopK over the expert axis -> MoERouterTopK(mode=softmax_topk)."""
    return _topk(op, _probs(op, logits), k)


@rule("softmax-topk-renorm")
def softmax_topk_renorm(op, logits, k=Const("k")):
    """Softmax -> [Cast] -> TopK -> values / ReduceSum(values) -> MoERouterTopK(softmax_topk, normalize=1)."""
    values, indices = _topk(op, _probs(op, logits), k)
    return _renorm(op, values), indices


@rule("topk-softmax")
def topk_softmax(op, logits, k=Const("k")):
    """TopK -> Softmax over the k logits -> MoERouterTopK(mode=topk_softmax)."""
    values, indices = _topk(op, logits, k)
    return op.Softmax(values, axis=AttrVar("sm_axis", default=-1), _name="softmax"), indices


@rule("topk-softmax-renorm")
def topk_softmax_renorm(op, logits, k=Const("k")):
    """TopK -> Softmax -> w / ReduceSum(w) -> MoERouterTopK(topk_softmax, normalize=1)."""
    values, indices = _topk(op, logits, k)
    return _renorm(op, op.Softmax(values, axis=AttrVar("sm_axis", default=-1), _name="softmax")), indices


def _last_axis(axis: int, rank: int) -> bool:
    return (axis + rank if axis < 0 else axis) == rank - 1


def _check(m, mode: str, renorm: bool):
    """Shared refusals of the four rules (see the module docstring)."""
    topk = m.node("topk")
    lv = m.value("logits")
    if lv.dtype not in _FLOATS:
        return m.fail(f"router logits '{m['logits']}' are {dtype_name(lv.dtype)}; expected FLOAT16 or FLOAT", topk)
    if lv.shape is None or len(lv.shape) < 2:
        return m.fail(f"rank of router logits '{m['logits']}' is {lv.type_str()}; expected [..., T, E]", topk)
    rank, e = len(lv.shape), lv.shape[-1]
    if not isinstance(e, int):
        return m.fail(f"expert axis of '{m['logits']}' ({lv.type_str()}) is not static", topk)
    if e > MAX_EXPERTS:
        return m.fail(f"{e} experts; the kernel handles at most {MAX_EXPERTS}", topk)
    sm_axis, topk_axis = m.attr("sm_axis"), m.attr("topk_axis")
    if not _last_axis(topk_axis, rank):
        return m.fail(f"TopK over axis {topk_axis} of rank {rank}: the expert axis must be the last", topk)
    if not _last_axis(sm_axis, rank):
        return m.fail(f"Softmax over axis {sm_axis}, TopK over axis {topk_axis}: not the same (last) axis", m.node("softmax"))
    if m.attr("largest") != 1:
        return m.fail("TopK largest=0 selects the smallest scores, not a router", topk)
    if m.attr("sorted") != 1:
        return m.fail("TopK sorted=0: ONNX Runtime's output order is unspecified, the op's is sorted", topk)
    kc = m.const("k").reshape(-1)
    if kc.size != 1 or not 1 <= int(kc[0]) <= e:
        return m.fail(f"TopK k={kc.tolist()} is not one value in 1..{e} (the number of experts)", topk)
    if "cast" in m:
        sm_dt, to = m.value("logits").dtype, m.attr("cast_to")
        if to not in _FLOATS or not holds_every_value_of(to, sm_dt):
            return m.fail(f"Cast {dtype_name(sm_dt)}->{dtype_name(to)} between Softmax and TopK changes the probabilities", m.node("cast"))
    wdt = m.graph.values[m.outputs[0]].dtype
    if wdt not in _FLOATS:
        return m.fail(f"router weights '{m.outputs[0]}' are {dtype_name(wdt)}; expected FLOAT16 or FLOAT", topk)
    if renorm:
        axes = m.const("sum_axes").reshape(-1).tolist()
        if m.attr("keepdims") != 1 or len(axes) != 1 or not _last_axis(int(axes[0]), rank):
            return m.fail(f"ReduceSum axes={axes} keepdims={m.attr('keepdims')}: not a per-token sum over the k weights", m.node("sum"))
    inner = [m.node("topk").outputs[0]] if (renorm or mode == "topk_softmax") else []
    if renorm and mode == "topk_softmax":
        inner.append(m.node("softmax").outputs[0])
    leaked = sorted(set(inner) & set(m.used_outside()))
    if leaked:
        return m.fail(f"'{leaked[0]}' is also read outside the router pattern", topk)
    return None


def _emit(m, b: Builder, mode: str, normalize: int) -> list[str]:
    lv = m.value("logits")
    k = int(m.const("k").reshape(-1)[0])
    graph = b.graph
    if graph.opset(DOMAIN) is None:
        graph.model_shell.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    wdt = graph.values[m.outputs[0]].dtype
    w, i = b.op(MoERouterTopK.op_type, [m["logits"]], domain=DOMAIN, outputs=2, dtype=[wdt, TensorProto.INT64],
                shape=tuple(lv.shape[:-1]) + (k,), k=k, normalize=normalize, mode=mode)
    return [w, i]


for _r, _mode, _renorm_ in ((softmax_topk, "softmax_topk", False), (softmax_topk_renorm, "softmax_topk", True),
                            (topk_softmax, "topk_softmax", False), (topk_softmax_renorm, "topk_softmax", True)):
    _r.check(lambda m, mode=_mode, rn=_renorm_: _check(m, mode, rn))
    _r.rewrite(lambda m, b, mode=_mode, rn=_renorm_: _emit(m, b, mode, int(rn)))


class RouterTopK(Plugin):
    """The ``topk`` plugin: MoE router subgraphs -> ``ai.rewrite::MoERouterTopK`` (see the module docstring)."""

    name = "router-topk"
    short = "topk"
    description = "Softmax->[Cast]->TopK [->renormalize] and TopK->Softmax routers -> one MoERouterTopK op (C kernel on IREE)"
    opset_range = (13, 28)
    kernels = (KernelObject("router_topk", "iree", "llvm-cpu", "topk/router_topk.c"),)

    @property
    def rules(self):
        return [softmax_topk_renorm, softmax_topk, topk_softmax_renorm, topk_softmax, topk_exact]

    @property
    def abstract_ops(self):
        return [MoERouterTopK()]

    @property
    def cases(self):
        return _cases()


# ----------------------------------------------------------------------------------------------- cases
def _router_model(form: str, *, e: int = 8, k: int = 2, dtype: int = TensorProto.FLOAT, cast_to: int | None = None,
                  sm_axis: int = -1, topk_axis: int = -1, largest: int = 1, sorted_: int = 1, renorm: bool = False,
                  lead: tuple = ("T",), values_out: bool = False):
    """A one-router model: logits [*lead, E] -> (weights, indices) graph outputs, in ``form`` softmax_topk|topk_softmax;
    ``values_out`` also outputs the TopK values (read outside a renormalized pattern)."""
    n = helper.make_node
    nodes, x = [], "logits"
    topk_attrs = dict(axis=topk_axis, largest=largest, sorted=sorted_)
    if form == "softmax_topk":
        nodes.append(n("Softmax", [x], ["probs"], axis=sm_axis))
        x = "probs"
        if cast_to is not None:
            nodes.append(n("Cast", [x], ["probs_cast"], to=cast_to))
            x = "probs_cast"
        nodes.append(n("TopK", [x, "k"], ["values", "indices"], **topk_attrs))
        w = "values"
        if values_out:
            nodes.append(n("Identity", ["values"], ["raw_values"]))
    else:
        nodes.append(n("TopK", [x, "k"], ["top_logits", "indices"], **topk_attrs))
        nodes.append(n("Softmax", ["top_logits"], ["values"], axis=sm_axis))
        w = "values"
    if renorm:
        nodes += [n("ReduceSum", [w, "sum_axes"], ["sum"], keepdims=1), n("Div", [w, "sum"], ["normed"])]
        w = "normed"
    nodes.append(n("Identity", [w], ["weights"]))
    wdt = cast_to if (cast_to is not None and form == "softmax_topk") else dtype
    shape = list(lead) + [e]
    inits = [helper.make_tensor("k", TensorProto.INT64, [1], [k])]
    if renorm:
        inits.append(helper.make_tensor("sum_axes", TensorProto.INT64, [1], [-1]))
    outs = [helper.make_tensor_value_info("weights", wdt, None), helper.make_tensor_value_info("indices", TensorProto.INT64, None)]
    if values_out:
        outs.append(helper.make_tensor_value_info("raw_values", wdt, None))
    g = helper.make_graph(nodes, "router", [helper.make_tensor_value_info("logits", dtype, shape)], outs, initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def _separated_feeds(model) -> dict[str, np.ndarray]:
    """Logits whose scores differ by at least 0.25 per row, so float16 rounding cannot create ties."""
    from rewrite.core.feeds import specs_of

    (spec,) = specs_of(model.graph.input)
    shape = [d if isinstance(d, int) else 5 for d in spec.shape]
    rng = np.random.default_rng(0)
    base = rng.permuted(np.broadcast_to(np.arange(shape[-1], dtype=np.float64), shape), axis=-1)
    return {"logits": (0.25 * base - 1.0).astype(_FLOATS[model.graph.input[0].type.tensor_type.elem_type])}


def _cases() -> list:
    from rewrite.testing.cases import negative, positive

    F, H, I32 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT32
    pos = [
        ("qwen2-softmax-topk", dict(form="softmax_topk"), "softmax-topk"),
        ("seed-f16-softmax-cast-f32-topk", dict(form="softmax_topk", dtype=H, cast_to=F, e=60, k=4), "softmax-topk"),
        ("f16-softmax-topk", dict(form="softmax_topk", dtype=H, e=16, k=4), "softmax-topk"),
        ("qwen3-softmax-topk-renorm", dict(form="softmax_topk", renorm=True, e=16, k=8), "softmax-topk-renorm"),
        ("gptoss-topk-softmax", dict(form="topk_softmax", e=32, k=4), "topk-softmax"),
        ("topk-softmax-renorm", dict(form="topk_softmax", renorm=True), "topk-softmax-renorm"),
        ("rank3-logits", dict(form="softmax_topk", lead=("B", "S")), "softmax-topk"),
        # renormalization refused (its input is read outside), the plain router still replaced
        ("values-read-outside-keep-renorm", dict(form="softmax_topk", renorm=True, values_out=True), "softmax-topk"),
        # not a router: the TopK alone is still replaced by the exact kernel
        ("softmax-on-another-axis-plain-topk", dict(form="softmax_topk", sm_axis=0), "topk-exact"),
        ("lossy-cast-f32-to-f16-plain-topk", dict(form="softmax_topk", cast_to=H), "topk-exact"),
    ]
    neg = [
        ("topk-not-on-last-axis", dict(form="softmax_topk", sm_axis=0, topk_axis=0)),
        ("largest-0", dict(form="softmax_topk", largest=0)),
        ("sorted-0", dict(form="softmax_topk", sorted_=0)),
        ("k-larger-than-experts", dict(form="softmax_topk", e=8, k=9)),
        ("too-many-experts-for-the-kernel", dict(form="softmax_topk", e=MAX_EXPERTS + 1)),
        ("cast-to-integer", dict(form="softmax_topk", cast_to=I32)),
    ]
    out = [positive(name, (lambda kw=kw: _router_model(**kw)), {rule_name: 1}, feeds=_separated_feeds) for name, kw, rule_name in pos]
    out += [negative(name, (lambda kw=kw: _router_model(**kw))) for name, kw in neg]
    return out
