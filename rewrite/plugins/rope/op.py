"""``ai.rewrite::RotaryEmbedding``: rotary position embedding, optionally after a per-head RMSNorm.

Contract (one float type, f32 or f16, for X, cos, sin and the weight):

0. ``X`` [B, H, T, D], D even
1. ``cos`` [Bc, 1, Tc, D] with Bc in (1, B) and Tc in (1, T) (broadcast as ONNX's Mul broadcasts them)
2. ``sin`` [Bs, 1, Ts, D] likewise
3. ``norm_weight`` (optional) [D]
4. ``X2`` (optional) [B, H2, T, D]: a second tensor rotated by the same cos and sin (a layer's K beside its Q: one
   launch for both, the ``rotary-embedding-pair`` rule), output 1 ``Y2``
5. ``norm_weight2`` (optional, with X2) [D]: X2's norm weight, the same ``norm_epsilon``

Attribute ``norm_epsilon`` (float; with a norm weight). Output ``Y`` [B, H, T, D] (and ``Y2`` [B, H2, T, D])::

    with norm_weight:  X = Cast(X / Sqrt(ReduceMean(X * X, axis=-1) + norm_epsilon))  (in float32, rounded to
                       X's type) * norm_weight                                       (rounded to X's type)
    Y = X * cos + rotate_half(X) * sin     (each product and the sum rounded to X's type: the ONNX Mul and Add)
    rotate_half(X) = Concat(-X[..., D/2:], X[..., :D/2])
    Y2 likewise from X2 (and norm_weight2)

the decomposition the ``rope`` rules replace: transformers' ``apply_rotary_pos_emb`` (seed 000 "Rotary Position
Embeddings") and, before it, Qwen3's ``q_norm``/``k_norm`` (an RMSNorm over the head size, computed in float32 and
rounded back before its weight, as ``Qwen3RMSNorm`` does). The CUDA kernel sums the squares in another order than
ONNX Runtime's ReduceMean: within the conformance kit's tolerance, not bit for bit.

Lowerings: ONNX Runtime gets the decomposition back; IREE llvm-cpu ``linalg.generic`` ops (the sum of squares per
row, then one elementwise op); IREE cuda one dispatch of ``kernels/rope_cuda.cu``: a warp per row of D (iree-compile
3.13 runs Qwen3-30B-A3B's q/k RMSNorm and RoPE in 8 dispatches per layer: BENCHMARKS.md).
"""

from __future__ import annotations

import re
import struct

import numpy as np
from onnx import TensorProto

from rewrite.core.abstract_ops import AbstractOp
from rewrite.core.iree_lowering import IreeLowering, PatchContext, TorchOperator, dispatch_dims, operand_dim, cuda_executable_source
from rewrite.core.ir import Graph, Node
from rewrite.core.kernels import build_cuda_ptx, kernel_source
from rewrite.core.lowering import Lowering
from rewrite.core.rules import Builder
from rewrite.errors import BackendError

CUDA_HEAD_SIZES = (32, 64, 128, 256)  #: D the kernels are built for (D / 32 elements a lane)
CUDA_WARPS = 8  #: rows a workgroup of the CUDA kernel takes (WARPS in kernels/rope_cuda.cu)
CUDA_EXECUTABLE = "rope_exec"
CUDA_KERNELS = [f"rotary_embedding_{el}_d{d}" for el in ("f16", "f32") for d in CUDA_HEAD_SIZES]
CUDA_PAIR_EXECUTABLE = "rope2_exec"
CUDA_PAIR_KERNELS = [f"rotary_embedding2_{el}_d{d}" for el in ("f16", "f32") for d in CUDA_HEAD_SIZES]


def check_shapes(x, cos, sin, weight, where: str) -> tuple:
    """(B, H, T, D) from the operands' shapes (tuples, None for an unknown dim; ``weight`` None when absent). A dim
    of cos or sin that is not known statically is taken as broadcasting correctly (the lowerings look at run time).

    Raises:
        ValueError: naming ``where``: ranks other than 4, an odd or unknown D, cos or sin not [1 or B, 1, 1 or T, D],
            or a weight not [D]."""
    if len(x) != 4 or len(cos) != 4 or len(sin) != 4:
        raise ValueError(f"{where}: X {list(x)}, cos {list(cos)}, sin {list(sin)}; X [B, H, T, D] and cos, sin "
                         "[1 or B, 1, 1 or T, D] expected")
    b, h, t, d = x
    fits = lambda dim, full: dim == 1 or dim == full or not isinstance(dim, int) or not isinstance(full, int)  # noqa: E731
    table_ok = lambda c: c[3] == d and c[1] == 1 and fits(c[0], b) and fits(c[2], t)  # noqa: E731
    if not isinstance(d, int) or d % 2 or not table_ok(cos) or not table_ok(sin):
        raise ValueError(f"{where}: X {list(x)} with cos {list(cos)}, sin {list(sin)}: a static even D and cos, sin "
                         "[1 or B, 1, 1 or T, D] expected")
    if weight is not None and list(weight) != [d]:
        raise ValueError(f"{where}: norm weight {list(weight)}; [{d}] expected")
    return b, h, t, d


class RotaryEmbedding(AbstractOp):
    """The contract in the module docstring."""

    op_type = "RotaryEmbedding"
    ort_targets = ("cpu", "cuda")

    def lowerings(self) -> list[Lowering]:
        return super().lowerings() + [Lowering(self.op_type, "iree", ("cuda",), self.lower_iree_cuda, origin=type(self).__module__)]

    def reference(self, attrs: dict, x, cos, sin, weight=None, x2=None, weight2=None) -> list[np.ndarray]:
        """numpy evaluation of the contract, each ONNX op's result rounded to X's dtype; returns [Y] (with X2:
        [Y, Y2]).

        Raises:
            ValueError: shapes outside the contract (:func:`check_shapes`)."""
        if x2 is not None:
            return self.reference(attrs, x, cos, sin, weight) + self.reference(attrs, x2, cos, sin, weight2)
        check_shapes(x.shape, cos.shape, sin.shape, None if weight is None else weight.shape, "RotaryEmbedding")
        dt, f32 = x.dtype, np.float32
        if weight is not None:
            xf = x.astype(f32)
            var = (xf * xf).mean(axis=-1, keepdims=True, dtype=f32)
            eps = np.float32(attrs["norm_epsilon"])
            x = (xf / np.sqrt(var + eps)).astype(dt)
            x = (x.astype(f32) * weight.astype(f32)).astype(dt)
        half = x.shape[-1] // 2
        rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        a = (x.astype(f32) * cos.astype(f32)).astype(dt)
        c = (rot.astype(f32) * sin.astype(f32)).astype(dt)
        return [(a.astype(f32) + c.astype(f32)).astype(dt)]

    def sample_inputs(self, rng: np.random.Generator) -> list[tuple[dict, list[np.ndarray]]]:
        """Conformance-kit samples: decode (T = 1) and prefill rows, Qwen's head size 128 and smaller ones, cos of
        [1, 1, T, D] and [B, 1, T, D], with and without the norm, f32 and f16."""
        def case(b, h, t, d, dt, norm=False, per_batch=False):
            x = rng.standard_normal((b, h, t, d)).astype(dt) * 3
            pos = rng.integers(0, 4096, size=(b if per_batch else 1, t)).astype(np.float32)
            inv = 1e6 ** (-np.arange(0, d, 2, dtype=np.float32) / d)
            ang = pos[..., None] * np.concatenate([inv, inv])[None, None]
            cos, sin = (f(ang)[:, None].astype(dt) for f in (np.cos, np.sin))
            ins = [x, cos, sin]
            attrs = {}
            if norm:
                ins.append((1 + 0.1 * rng.standard_normal(d)).astype(dt))
                attrs["norm_epsilon"] = 1e-6
            return attrs, ins
        def pair(b, h, h2, t, d, dt, norm=False):  # Q and K of a layer: X2 of other heads, the same tables
            attrs, ins = case(b, h, t, d, dt, norm=norm)
            x2 = rng.standard_normal((b, h2, t, d)).astype(dt) * 3
            ins += [x2, (1 + 0.1 * rng.standard_normal(d)).astype(dt)] if norm else [None, x2]
            return attrs, ins
        return [case(1, 32, 1, 128, np.float16, norm=True), case(1, 4, 1, 128, np.float16, norm=True),
                case(1, 16, 1, 128, np.float16), case(2, 4, 5, 64, np.float32, norm=True, per_batch=True),
                case(1, 3, 7, 32, np.float32), case(2, 2, 3, 256, np.float16, per_batch=True),
                pair(1, 32, 4, 1, 128, np.float16, norm=True), pair(1, 16, 16, 1, 128, np.float16),
                pair(2, 4, 2, 3, 64, np.float32, norm=True)]

    # ------------------------------------------------------------------ ORT
    def lower_ort(self, graph: Graph, node: Node) -> None:
        """The decomposition: ``[Cast -> Mul(x, x) -> ReduceMean -> Add(eps) -> Sqrt -> Div -> Cast -> Mul(weight)]``
        then ``Add(Mul(X, cos), Mul(Concat(Neg(X[..., D/2:]), X[..., :D/2]), sin))``; for X2 the same again."""
        ins = list(node.inputs) + [""] * (6 - len(node.inputs))
        b = Builder(graph, "lower/RotaryEmbedding", node.order, node.name)
        where = f"RotaryEmbedding node {node.describe()}"
        eps = node.attr("norm_epsilon")
        ys = [rotated_onnx(graph, b, ins[0], ins[1], ins[2], ins[3], eps, where)]
        if ins[4]:
            ys.append(rotated_onnx(graph, b, ins[4], ins[1], ins[2], ins[5], eps, where))
        graph.replace_node(node, ys)
        graph.remove_unused_initializers()

    # ----------------------------------------------------------------- IREE
    def lower_iree(self, op: TorchOperator, ctx: PatchContext) -> IreeLowering:
        """llvm-cpu: with the norm, a ``linalg.generic`` summing the squares of each row in f32; then one
        elementwise ``linalg.generic`` over [B, H, T, D] reading X at d and at its rotation partner (d +- D/2,
        ``tensor.extract``) and cos/sin through broadcasting maps (Bc, Tc of 1 read at 0, found at run time).

        Raises:
            BackendError: a target other than llvm-cpu, or operands outside the contract."""
        if ctx.target != "llvm-cpu":
            raise BackendError(f"RotaryEmbedding linalg lowering asked for target '{ctx.target}'")
        first, second = _split_pair(op)
        body = _Linalg(first).body()
        if second is not None:  # X2: the same ops again, its SSA names apart
            body += _renamed(_Linalg(second).body(), {"in0": "in4", "in1": "in1", "in2": "in2", "in3": "in5", "out0": "out1"}, "pair_")
        return IreeLowering(body=body)

    def lower_iree_cuda(self, op: TorchOperator, ctx: PatchContext) -> IreeLowering:
        """One dispatch of ``kernels/rope_cuda.cu`` (PTX for ``ctx.cuda_arch``), ``rotary_embedding_<el>_d<D>`` on
        ceil(B * H * T / 8) workgroups of 256 threads, a warp per row. Bindings X, cos, sin, weight (a dummy when
        absent), Y; push constants rows, H, T, cos's and sin's strides over B and T (0 where they broadcast),
        has_norm and the epsilon's float32 bits. With X2, one dispatch of the pair kernel (:func:`_pair_cuda`).

        Raises:
            BackendError: a target other than cuda, D not in :data:`CUDA_HEAD_SIZES`, or operands outside the
                contract."""
        if ctx.target != "cuda":
            raise BackendError(f"RotaryEmbedding CUDA lowering asked for target '{ctx.target}'")
        first, second = _split_pair(op)
        if second is not None:
            return _pair_cuda(op, first, second, ctx)
        t = _Operands(op)
        if t.d not in CUDA_HEAD_SIZES:
            raise BackendError(f"RotaryEmbedding {op.where}: head size D={t.d}; the CUDA kernel takes {CUDA_HEAD_SIZES}")
        obj = ctx.object_path(build_cuda_ptx(kernel_source(__file__, "rope_cuda.cu"), ctx.cuda_arch))
        kernel = f"rotary_embedding_{t.el}_d{t.d}"
        dims = dispatch_dims
        eps_bits = struct.unpack("<i", struct.pack("<f", float(op.attrs.get("norm_epsilon", 0.0))))[0]
        lines = ["    %c0 = arith.constant 0 : index", "    %c1 = arith.constant 1 : index",
                 f"    %cw = arith.constant {CUDA_WARPS - 1} : index", f"    %cwd = arith.constant {CUDA_WARPS} : index",
                 operand_dim(op, 0, 0, "%b"), f"    %h = arith.constant {t.h} : index", operand_dim(op, 0, 2, "%t"),
                 "    %bh = arith.muli %b, %h : index", "    %rows = arith.muli %bh, %t : index",
                 "    %rw = arith.addi %rows, %cw : index", "    %gx = arith.divui %rw, %cwd : index",
                 "    %rows32 = arith.index_cast %rows : index to i32", "    %t32 = arith.index_cast %t : index to i32",
                 f"    %h32 = arith.constant {t.h} : i32", f"    %has32 = arith.constant {int(t.w is not None)} : i32",
                 f"    %eps32 = arith.constant {eps_bits} : i32",
                 f"    %cd = arith.constant {t.d} : index", *table_strides(op, 1, "c"), *table_strides(op, 2, "s")]
        w_arg, w_type = ("%in3", t.w.builtin) if t.w is not None else ("%dummy", f"tensor<1x{t.el}>")
        lines.append(f"""    %dummy = arith.constant dense<0.0> : tensor<1x{t.el}>
    %y = flow.dispatch @{CUDA_EXECUTABLE}::@{kernel}[%gx](%in0, %in1, %in2, {w_arg}, %rows32, %h32, %t32, %csb32, %cst32, %ssb32, %sst32, %has32, %eps32) :
        ({t.x.builtin}{dims(0, t.x)}, {t.cos.builtin}{dims(1, t.cos)}, {t.sin.builtin}{dims(2, t.sin)}, {w_type}, i32, i32, i32, i32, i32, i32, i32, i32, i32)
        -> {t.x.builtin}{dims(0, t.x)}
    %out0 = tensor.cast %y : {t.x.builtin} to {op.result_types[0].builtin}""")
        return IreeLowering(body="\n".join(lines) + "\n", module_items={CUDA_EXECUTABLE: cuda_executable_source(CUDA_EXECUTABLE, obj, CUDA_KERNELS, 4, 1, 9, 32 * CUDA_WARPS, grid=1)})


def rotated_onnx(graph: Graph, b: Builder, x: str, cos: str, sin: str, weight: str, eps: float | None, where: str) -> str:
    """The contract's decomposition for one X (:meth:`RotaryEmbedding.lower_ort`; also GroupedAttention's rotary
    inputs): ``[Cast -> Mul(x, x) -> ReduceMean -> Add(eps) -> Sqrt -> Div -> Cast -> Mul(weight)]`` with a norm
    weight ("" when absent), then ``Add(Mul(X, cos), Mul(Concat(Neg(X[..., D/2:]), X[..., :D/2]), sin))``, built
    with ``b``; returns Y's name.

    Raises:
        BackendError: naming ``where``: shapes outside the contract (:func:`check_shapes`)."""
    xv = graph.values[x]
    try:
        _, _, _, d = check_shapes(xv.shape, graph.values[cos].shape, graph.values[sin].shape,
                                  graph.values[weight].shape if weight else None, where)
    except ValueError as e:
        raise BackendError(str(e)) from None
    dt, shape = xv.dtype, xv.shape
    i64 = lambda vals, name: b.const(np.asarray(vals, np.int64), name)  # noqa: E731
    if weight:
        f32 = TensorProto.FLOAT
        xf = b.op("Cast", [x], to=f32, dtype=f32) if dt != f32 else x
        sq = b.op("Mul", [xf, xf], dtype=f32)
        if (graph.opset() or 18) >= 18:
            var = b.op("ReduceMean", [sq, i64([-1], "axes")], keepdims=1, dtype=f32)
        else:  # before opset 18 ReduceMean takes its axes as an attribute
            var = b.op("ReduceMean", [sq], axes=[-1], keepdims=1, dtype=f32)
        eps = b.const(np.array(eps, np.float32), "eps")
        normed = b.op("Div", [xf, b.op("Sqrt", [b.op("Add", [var, eps], dtype=f32)], dtype=f32)], dtype=f32)
        normed = b.op("Cast", [normed], to=dt, dtype=dt) if dt != f32 else normed
        x = b.op("Mul", [normed, weight], dtype=dt, shape=shape)
    half = d // 2
    lo = b.op("Slice", [x, i64([0], "zero"), i64([half], "half"), i64([-1], "last")], dtype=dt)
    hi = b.op("Slice", [x, i64([half], "half_b"), i64([d], "full"), i64([-1], "last_b")], dtype=dt)
    rot = b.op("Concat", [b.op("Neg", [hi], dtype=dt), lo], axis=-1, dtype=dt)
    return b.op("Add", [b.op("Mul", [x, cos], dtype=dt), b.op("Mul", [rot, sin], dtype=dt)], dtype=dt, shape=shape)


def _pair_cuda(op: TorchOperator, first: TorchOperator, second: TorchOperator, ctx: PatchContext) -> IreeLowering:
    """:meth:`RotaryEmbedding.lower_iree_cuda` with X2: one dispatch of ``rotary_embedding2_<el>_d<D>`` on
    ceil((B * H + B * H2) * T / 8) workgroups, X's rows then X2's (the kernel source's header)."""
    t, t2 = _Operands(first), _Operands(second)
    if t.d not in CUDA_HEAD_SIZES:
        raise BackendError(f"RotaryEmbedding {op.where}: head size D={t.d}; the CUDA kernel takes {CUDA_HEAD_SIZES}")
    obj = ctx.object_path(build_cuda_ptx(kernel_source(__file__, "rope_cuda.cu"), ctx.cuda_arch))
    kernel = f"rotary_embedding2_{t.el}_d{t.d}"
    eps_bits = struct.unpack("<i", struct.pack("<f", float(op.attrs.get("norm_epsilon", 0.0))))[0]
    lines = ["    %c0 = arith.constant 0 : index", "    %c1 = arith.constant 1 : index",
             f"    %cw = arith.constant {CUDA_WARPS - 1} : index", f"    %cwd = arith.constant {CUDA_WARPS} : index",
             operand_dim(op, 0, 0, "%b"), f"    %h = arith.constant {t.h} : index", f"    %h2 = arith.constant {t2.h} : index",
             operand_dim(op, 0, 2, "%t"), "    %bh = arith.muli %b, %h : index", "    %rows = arith.muli %bh, %t : index",
             "    %bh2 = arith.muli %b, %h2 : index", "    %rows2 = arith.muli %bh2, %t : index",
             "    %all = arith.addi %rows, %rows2 : index",
             "    %rw = arith.addi %all, %cw : index", "    %gx = arith.divui %rw, %cwd : index",
             "    %rows32 = arith.index_cast %rows : index to i32", "    %rows232 = arith.index_cast %rows2 : index to i32",
             "    %t32 = arith.index_cast %t : index to i32",
             f"    %h32 = arith.constant {t.h} : i32", f"    %h232 = arith.constant {t2.h} : i32",
             f"    %has32 = arith.constant {int(t.w is not None)} : i32", f"    %has232 = arith.constant {int(t2.w is not None)} : i32",
             f"    %eps32 = arith.constant {eps_bits} : i32",
             f"    %cd = arith.constant {t.d} : index", *table_strides(op, 1, "c"), *table_strides(op, 2, "s"),
             f"    %dummy = arith.constant dense<0.0> : tensor<1x{t.el}>"]
    w_arg, w_type = ("%in3", t.w.builtin) if t.w is not None else ("%dummy", f"tensor<1x{t.el}>")
    w2_arg, w2_type = ("%in5", t2.w.builtin) if t2.w is not None else ("%dummy", f"tensor<1x{t.el}>")
    dims = dispatch_dims
    lines.append(f"""    %y:2 = flow.dispatch @{CUDA_PAIR_EXECUTABLE}::@{kernel}[%gx](%in0, %in1, %in2, {w_arg}, %in4, {w2_arg}, %rows32, %h32, %t32, %csb32, %cst32, %ssb32, %sst32, %has32, %eps32, %rows232, %h232, %has232) :
        ({t.x.builtin}{dims(0, t.x)}, {t.cos.builtin}{dims(1, t.cos)}, {t.sin.builtin}{dims(2, t.sin)}, {w_type}, {t2.x.builtin}{dims(4, t2.x)}, {w2_type}, i32, i32, i32, i32, i32, i32, i32, i32, i32, i32, i32, i32)
        -> ({t.x.builtin}{dims(0, t.x)}, {t2.x.builtin}{dims(4, t2.x)})
    %out0 = tensor.cast %y#0 : {t.x.builtin} to {op.result_types[0].builtin}
    %out1 = tensor.cast %y#1 : {t2.x.builtin} to {op.result_types[1].builtin}""")
    return IreeLowering(body="\n".join(lines) + "\n", module_items={
        CUDA_PAIR_EXECUTABLE: cuda_executable_source(CUDA_PAIR_EXECUTABLE, obj, CUDA_PAIR_KERNELS, 6, 2, 12, 32 * CUDA_WARPS, grid=1)})


def _split_pair(op: TorchOperator) -> tuple[TorchOperator, TorchOperator | None]:
    """An op with X2 as two ops of one X each: (X, cos, sin, weight) -> Y and (X2, cos, sin, weight2) -> Y2, the
    second's operands numbered as the first's (0 X2, 1 cos, 2 sin, 3 weight2); (op, None) without X2.

    Raises:
        BackendError: X2 of another B, T, D or element type than X."""
    types = list(op.operand_types) + [None] * (6 - len(op.operand_types))
    present = lambda t: t is not None and t.element != "none"  # noqa: E731
    first = TorchOperator(op.op_type, op.node, op.attrs, [t for t in types[:4] if t is not None], op.result_types[:1])
    if not present(types[4]):
        return first, None
    x, x2 = types[0], types[4]
    if x2.element != x.element or len(x2.dims) != 4 or x2.dims[3] != x.dims[3] or x2.dims[0] != x.dims[0] or x2.dims[2] != x.dims[2]:
        raise BackendError(f"RotaryEmbedding {op.where}: X {x.text}, X2 {x2.text}: X2 of X's B, T, D and type expected")
    second = [x2, types[1], types[2]] + ([types[5]] if present(types[5]) else [])
    return first, TorchOperator(op.op_type, op.node, op.attrs, second, op.result_types[1:2])


def _renamed(body: str, names: dict[str, str], prefix: str) -> str:
    """``body`` with each SSA name ``%n`` renamed: ``names[n]`` (and ``%n_d<k>``, an operand's dims, likewise), any
    other name prefixed with ``prefix`` (so a second lowered body defines no name of the first)."""
    def one(m: re.Match) -> str:
        name = m.group(1)
        base, _, rest = name.partition("_d") if name.startswith("in") else (name, "", "")
        if base in names:
            return "%" + names[base] + ("_d" + rest if rest else "")
        return "%" + prefix + name
    return re.sub(r"%([A-Za-z_][\w]*)", one, body)


def rotation_linalg(op: TorchOperator, x: int, cos: int, sin: int, weight: int | None, result: str, prefix: str) -> str:
    """llvm-cpu MLIR rotating operand ``x`` of another op ``op`` by its operands ``cos`` and ``sin`` (after the
    norm with operand ``weight``, or none), :meth:`RotaryEmbedding.lower_iree`'s ops as part of that op's body:
    defines ``%<result>`` of operand ``x``'s type, every other SSA name it defines prefixed with ``prefix``
    (GroupedAttention's rotary inputs; ``op.attrs`` holds ``norm_epsilon`` with a weight).

    Raises:
        BackendError: operands outside RotaryEmbedding's contract."""
    types = op.operand_types
    picked = [x, cos, sin] + ([weight] if weight is not None else [])
    sub = TorchOperator("RotaryEmbedding", op.node, op.attrs, [types[k] for k in picked], [types[x]])
    names = {f"in{i}": f"in{k}" for i, k in enumerate(picked)} | {"out0": result}
    return _renamed(_Linalg(sub).body(), names, prefix)


def table_strides(op: TorchOperator, k: int, tag: str) -> list[str]:
    """MLIR defining ``%{tag}sb32`` and ``%{tag}st32`` (i32), operand ``k``'s (cos or sin, [Bc, 1, Tc, D]) element
    strides over B and T: Tc * D and D, each 0 where that dim is 1 (broadcast; compared at run time when dynamic).
    ``%c0``, ``%c1`` and ``%cd`` (D) must be defined."""
    return [operand_dim(op, k, 0, f"%{tag}b"), operand_dim(op, k, 2, f"%{tag}t"), f"    %{tag}td = arith.muli %{tag}t, %cd : index",
            f"    %{tag}b1 = arith.cmpi eq, %{tag}b, %c1 : index", f"    %{tag}sb = arith.select %{tag}b1, %c0, %{tag}td : index",
            f"    %{tag}t1 = arith.cmpi eq, %{tag}t, %c1 : index", f"    %{tag}st = arith.select %{tag}t1, %c0, %cd : index",
            f"    %{tag}sb32 = arith.index_cast %{tag}sb : index to i32", f"    %{tag}st32 = arith.index_cast %{tag}st : index to i32"]


class _Operands:
    """An imported RotaryEmbedding's operand types and static sizes.

    Raises:
        BackendError: operands outside the contract."""

    def __init__(self, op: TorchOperator):
        types = op.operand_types
        self.x, self.cos, self.sin = types[:3]
        self.w = types[3] if len(types) > 3 and types[3].element != "none" else None
        try:
            _, h, _, d = check_shapes(self.x.dims, self.cos.dims, self.sin.dims, None if self.w is None else self.w.dims,
                                      f"RotaryEmbedding {op.where}")
        except ValueError as e:
            raise BackendError(str(e)) from None
        if not isinstance(h, int) or any(t.element != self.x.element for t in (self.cos, self.sin, self.w) if t is not None):
            raise BackendError(f"RotaryEmbedding {op.where}: X {self.x.text}, cos {self.cos.text}: a static head count "
                               "and one element type expected")
        if self.w is not None and "norm_epsilon" not in op.attrs:
            raise BackendError(f"RotaryEmbedding {op.where}: a norm weight without norm_epsilon")
        self.h, self.d = h, d
        self.el = self.x.builtin_element


class _Linalg:
    """The llvm-cpu lowering's MLIR (:meth:`RotaryEmbedding.lower_iree`)."""

    def __init__(self, op: TorchOperator):
        self.op = op
        self.t = _Operands(op)

    def body(self) -> str:
        t, op = self.t, self.op
        el, f16, h, d = t.el, t.el == "f16", t.h, t.d
        half = d // 2
        x4 = f"tensor<?x{h}x?x{d}x{el}>"
        c4 = f"tensor<?x1x?x{d}x{el}>"
        lines = ["    %c0 = arith.constant 0 : index", "    %c1 = arith.constant 1 : index", operand_dim(op, 0, 0, "%b"),
                 operand_dim(op, 0, 2, "%t"), operand_dim(op, 1, 0, "%cb"), operand_dim(op, 1, 2, "%ct"), operand_dim(op, 2, 0, "%sb"),
                 operand_dim(op, 2, 2, "%st"),
                 f"    %x = tensor.cast %in0 : {t.x.builtin} to {x4}", f"    %cs = tensor.cast %in1 : {t.cos.builtin} to {c4}",
                 f"    %sn = tensor.cast %in2 : {t.sin.builtin} to {c4}",
                 "    %cb1 = arith.cmpi eq, %cb, %c1 : index", "    %ct1 = arith.cmpi eq, %ct, %c1 : index",
                 "    %sb1 = arith.cmpi eq, %sb, %c1 : index", "    %st1 = arith.cmpi eq, %st, %c1 : index",
                 f"    %chalf = arith.constant {half} : index", f"    %cd = arith.constant {d} : index",
                 "    %zero = arith.constant 0.0 : f32"]
        ext = lambda v: f"%{v}f = arith.extf %{v} : f16 to f32" if f16 else f"%{v}f = arith.addf %{v}, %zero : f32"  # noqa: E731
        rnd = (lambda v, n: f"%{n}h = arith.truncf %{v} : f32 to f16\n      %{n} = arith.extf %{n}h : f16 to f32") if f16 else \
            (lambda v, n: f"%{n} = arith.addf %{v}, %zero : f32")  # noqa: E731
        par4 = '"parallel", "parallel", "parallel", "parallel"'
        norm = ""
        if t.w is not None:
            eps = "0x%08X" % struct.unpack("<I", struct.pack("<f", float(op.attrs["norm_epsilon"])))[0]
            lines.append(f"""    %ss0 = tensor.empty(%b, %t) : tensor<?x{h}x?xf32>
    %ss1 = linalg.fill ins(%zero : f32) outs(%ss0 : tensor<?x{h}x?xf32>) -> tensor<?x{h}x?xf32>
    %ss = linalg.generic {{indexing_maps = [affine_map<(b, h, t, d) -> (b, h, t, d)>, affine_map<(b, h, t, d) -> (b, h, t)>],
                          iterator_types = ["parallel", "parallel", "parallel", "reduction"]}}
        ins(%x : {x4}) outs(%ss1 : tensor<?x{h}x?xf32>) {{
    ^bb0(%v: {el}, %acc: f32):
      {ext("v")}
      %sq = arith.mulf %vf, %vf : f32
      %r = arith.addf %acc, %sq : f32
      linalg.yield %r : f32
    }} -> tensor<?x{h}x?xf32>
    %eps = arith.constant {eps} : f32
    %dn = arith.constant {float(d)!r} : f32
    %w = tensor.cast %in3 : {t.w.builtin} to tensor<{d}x{el}>""")
            # the normalized, weighted element at index idx of the row: X / sqrt(mean + eps), rounded, times w, rounded
            norm = lambda v, n, idx: f"""%{n}m = arith.divf %sum, %dn : f32
      %{n}a = arith.addf %{n}m, %eps : f32
      %{n}s = math.sqrt %{n}a : f32
      %{n}q = arith.divf %{v}, %{n}s : f32
      {rnd(f"{n}q", f"{n}r")}
      %{n}w0 = tensor.extract %w[{idx}] : tensor<{d}x{el}>
      {ext(f"{n}w0")}
      %{n}p = arith.mulf %{n}r, %{n}w0f : f32
      {rnd(f"{n}p", n)}"""  # noqa: E731
        else:
            norm = lambda v, n, idx: f"%{n} = arith.addf %{v}, %zero : f32"  # noqa: E731
        sum_in = ", %ss" if t.w is not None else ""
        sum_type = f", tensor<?x{h}x?xf32>" if t.w is not None else ""
        sum_map = ", affine_map<(b, h, t, d) -> (b, h, t)>" if t.w is not None else ""
        sum_arg = ", %sum: f32" if t.w is not None else ""
        lines.append(f"""    %y0 = tensor.empty(%b, %t) : {x4}
    %y = linalg.generic {{indexing_maps = [affine_map<(b, h, t, d) -> (b, h, t, d)>{sum_map}, affine_map<(b, h, t, d) -> (b, h, t, d)>],
                          iterator_types = [{par4}]}}
        ins(%x{sum_in} : {x4}{sum_type}) outs(%y0 : {x4}) {{
    ^bb0(%v: {el}{sum_arg}, %o: {el}):
      %ib = linalg.index 0 : index
      %ih = linalg.index 1 : index
      %it = linalg.index 2 : index
      %ai = linalg.index 3 : index
      %lo = arith.cmpi ult, %ai, %chalf : index
      %up = arith.addi %ai, %chalf : index
      %dw = arith.subi %ai, %chalf : index
      %bi = arith.select %lo, %up, %dw : index
      %vb = tensor.extract %x[%ib, %ih, %it, %bi] : {x4}
      {ext("v")}
      {ext("vb")}
      {norm("vf", "xa", "%ai")}
      {norm("vbf", "xb", "%bi")}
      %nb = arith.negf %xb : f32
      %rot = arith.select %lo, %nb, %xb : f32
      %jb = arith.select %cb1, %c0, %ib : index
      %jt = arith.select %ct1, %c0, %it : index
      %kb = arith.select %sb1, %c0, %ib : index
      %kt = arith.select %st1, %c0, %it : index
      %cv = tensor.extract %cs[%jb, %c0, %jt, %ai] : {c4}
      %sv = tensor.extract %sn[%kb, %c0, %kt, %ai] : {c4}
      {ext("cv")}
      {ext("sv")}
      %m1 = arith.mulf %xa, %cvf : f32
      {rnd("m1", "m1r")}
      %m2 = arith.mulf %rot, %svf : f32
      {rnd("m2", "m2r")}
      %s = arith.addf %m1r, %m2r : f32
      {"%out = arith.truncf %s : f32 to f16" if f16 else "%out = arith.addf %s, %zero : f32"}
      linalg.yield %out : {el}
    }} -> {x4}
    %out0 = tensor.cast %y : {x4} to {op.result_types[0].builtin}""")
        return "\n".join(lines) + "\n"
