"""``ai.rewrite::FusedMoE``: the routed experts of one MoE block as one op, its reference and its lowerings.

Contract (inputs; T tokens, H hidden, E experts, I expert intermediate size, float = f32 or f16):

0. ``hidden`` float [T, H]
1. ``router_logits`` [T, E], hidden's dtype (LOGITS, before the softmax)
2. ``fc1`` [E, 2I, H]: gate rows 0..I-1 then up rows I..2I-1 (torch Linear ``[out, in]``). Float (hidden's
   dtype), or when ``block_size > 0`` UINT8 holding INT4 codes two per byte along H, even element in the low
   nibble (the ORT QMoE packing), shape [E, 2I, ceil(H/2)]
3. ``fc2`` [E, H, I] (or [E, H, ceil(I/2)] packed), the down projection
4. ``fc1_scales`` [E, 2I, ceil(H/block_size)] hidden's dtype (only when quantized)
5. ``fc1_zero_points`` UINT8 [E, 2I, ceil(H/block_size)], codes' zero point per block (optional; absent
   means 8, ORT QMoE's symmetric convention)
6. ``fc2_scales`` [E, H, ceil(I/block_size)], 7. ``fc2_zero_points`` likewise

Attributes: ``k`` (experts per token), ``normalize`` (0/1: divide the k weights by their sum; Qwen1.5-MoE 0,
Qwen3-MoE 1), ``mode`` ("softmax_topk": softmax over E then top-k; "topk_softmax": top-k logits then softmax
over the k, which equals softmax_topk with normalize), ``activation`` ("swiglu": SiLU(gate) * up),
``block_size`` (0 for float weights). Output: float [T, H], hidden's dtype::

    p = softmax(logits[t]); idx = top-k(p); w = p[idx] (/ sum when normalize)
    out[t] = sum_j w_j * fc2[idx_j] @ (silu(fc1[idx_j, :I] @ x[t]) * (fc1[idx_j, I:] @ x[t]))

Dequantized weight = (code - zero_point) * scale per block along the input axis (ONNX DequantizeLinear-21,
seed 000 "Expert Computation (INT4 QDQ)").
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from rewrite.backends.iree_patch import IreeLowering, PatchContext, TorchOperator
from rewrite.core.abstract_ops import AbstractOp
from rewrite.core.ir import Graph, Node
from rewrite.core.kernels import build_cpu_object, kernel_source
from rewrite.core.rules import Builder
from rewrite.errors import BackendError

ROWS_PER_WORKGROUP = 32  #: ROWS in plugin_kernels/moe/moe_cpu.c
_FLAG = {"f16": 1, "int4": 2, "normalize": 4, "topk_softmax": 8, "zero_points": 16}


def pack_int4(codes: np.ndarray) -> np.ndarray:
    """[..., K] codes 0..15 -> uint8 [..., ceil(K/2)], even element in the low nibble (ORT QMoE / MatMulNBits)."""
    c = codes.astype(np.uint8)
    if c.shape[-1] % 2:
        c = np.concatenate([c, np.zeros(c.shape[:-1] + (1,), np.uint8)], -1)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)


def unpack_int4(packed: np.ndarray, k: int) -> np.ndarray:
    """Inverse of :func:`pack_int4`: uint8 [..., ceil(k/2)] -> uint8 codes [..., k]."""
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), np.uint8)
    out[..., 0::2] = packed & 15
    out[..., 1::2] = packed >> 4
    return out[..., :k]


def dequantize(packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, k: int, block: int) -> np.ndarray:
    """Float32 [E, N, k] from packed codes, per-block scales [E, N, nb] and zero points (8 when None)."""
    codes = unpack_int4(packed, k).astype(np.float32)
    zp = np.full(scales.shape, 8.0, np.float32) if zero_points is None else zero_points.astype(np.float32)
    rep = lambda a: np.repeat(a.astype(np.float32), block, axis=-1)[..., :k]  # noqa: E731
    return (codes - rep(zp)) * rep(scales)


def route(logits: np.ndarray, k: int, normalize: int, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """(weights f32 [T, k], indices int64 [T, k]) of the contract's routing; ties pick the lower expert index."""
    z = logits.astype(np.float32)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    idx = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, idx, -1)
    if normalize or mode == "topk_softmax":
        w = w / w.sum(-1, keepdims=True)
    return w, idx.astype(np.int64)


class FusedMoE(AbstractOp):
    """The contract in the module docstring; ORT lowering to com.microsoft MoE / QMoE, IREE to two C kernels."""

    op_type = "FusedMoE"

    # ------------------------------------------------------------ reference
    def reference(self, attrs: dict, hidden, logits, fc1, fc2, s1=None, z1=None, s2=None, z2=None) -> list[np.ndarray]:
        """numpy float32 evaluation of the contract; returns [out] in hidden's dtype."""
        T, H = hidden.shape
        I = fc1.shape[1] // 2
        bs = int(attrs.get("block_size", 0))
        if bs:
            fc1, fc2 = dequantize(fc1, s1, z1, H, bs), dequantize(fc2, s2, z2, I, bs)
        fc1, fc2 = fc1.astype(np.float32), fc2.astype(np.float32)
        w, idx = route(logits, int(attrs["k"]), int(attrs.get("normalize", 0)), attrs.get("mode", "softmax_topk"))
        x = hidden.astype(np.float32)
        out = np.zeros((T, H), np.float32)
        for j in range(idx.shape[1]):
            e = idx[:, j]
            gu = np.einsum("tnh,th->tn", fc1[e], x)
            g, u = gu[:, :I], gu[:, I:]
            a = g / (1 + np.exp(-g)) * u
            out += w[:, j:j + 1] * np.einsum("thi,ti->th", fc2[e], a)
        return [out.astype(hidden.dtype)]

    # ------------------------------------------------------------------ ORT
    def lower_ort(self, graph: Graph, node: Node) -> None:
        """com.microsoft MoE (float) or QMoE (INT4) with swiglu_fusion=1 (interleaved gate/up rows: the only
        layout ORT 1.32's CPU kernels accept) and router_probs = the logits (the op applies softmax, top-k).

        QMoE's block_size must be a power of two >= 16 dividing H and I (>= 64 with zero points, ORT docs); a
        block of the model that is not, or is larger than ORT_MAX_BLOCK, is split into smaller blocks sharing its
        scale and zero point, which is exact. When no such block exists the experts are dequantized to float and
        lowered to MoE (the plugin's report notes it). Qwen1.5-MoE's normalize=0 goes through QMoE's
        ``router_weights`` input: ORT 1.32's CPU QMoE renormalises the top-k weights even with
        normalize_routing_weights=0 (MoE does not).
        """
        ins = list(node.inputs) + [""] * (8 - len(node.inputs))
        hidden, logits, fc1, fc2, s1, z1, s2, z2 = ins
        k, normalize = int(node.attr("k")), int(node.attr("normalize", 0))
        if node.attr("mode", "softmax_topk") == "topk_softmax":
            normalize = 1  # softmax over the k selected logits == renormalised softmax probabilities
        dt = graph.values[hidden].dtype
        npdt = np.float16 if dt == TensorProto.FLOAT16 else np.float32
        bs = int(node.attr("block_size", 0))
        w1, w2 = graph.const(fc1), graph.const(fc2)
        if w1 is None or w2 is None:
            raise BackendError(f"node {node.describe()}: FusedMoE expert weights must be initializers for ONNX Runtime")
        b = Builder(graph, "lower/FusedMoE", node.order, node.name)
        attrs = dict(k=k, activation_type="swiglu", normalize_routing_weights=normalize, swiglu_fusion=1,
                     activation_alpha=1.0, activation_beta=0.0)
        E, N1 = w1.shape[0], w1.shape[1]
        I, H = N1 // 2, w2.shape[1]
        qbs = _ort_block(bs, H, I, bool(z1)) if bs else 0
        if bs and qbs:
            rep = bs // qbs
            sc1, sc2 = np.repeat(graph.const(s1), rep, -1), np.repeat(graph.const(s2), rep, -1)
            sc1, sc2 = sc1[..., : H // qbs], sc2[..., : I // qbs]
            q_ins = [hidden, logits, b.const(_interleave(w1), "fc1"), b.const(_interleave(sc1).astype(npdt), "fc1_scales"), "",
                     b.const(w2, "fc2"), b.const(sc2.astype(npdt), "fc2_scales"), "", "", "", ""]
            if z1:
                zp1 = np.repeat(graph.const(z1), rep, -1)[..., : H // qbs]
                zp2 = np.repeat(graph.const(z2), rep, -1)[..., : I // qbs]
                q_ins += [b.const(pack_int4(_interleave(zp1)), "fc1_zp"), b.const(pack_int4(zp2), "fc2_zp")]
            if not normalize:
                # ORT 1.32's CPU QMoE renormalises the top-k weights even with normalize_routing_weights=0
                # (measured: tests/test_plugin_moe.py); router_weights = softmax(logits) gives it the raw ones.
                q_ins += [""] * (14 - len(q_ins)) + [b.op("Softmax", [logits], axis=-1, dtype=dt)]
            out = b.op("QMoE", q_ins, domain="com.microsoft", expert_weight_bits=4, block_size=qbs, dtype=dt,
                       shape=graph.values[node.outputs[0]].shape, **attrs)
        else:
            if bs:
                w1 = dequantize(w1, graph.const(s1), graph.const(z1) if z1 else None, H, bs)
                w2 = dequantize(w2, graph.const(s2), graph.const(z2) if z2 else None, I, bs)
            out = b.op("MoE", [hidden, logits, b.const(_interleave(w1).astype(npdt), "fc1"), "", b.const(w2.astype(npdt), "fc2")],
                       domain="com.microsoft", dtype=dt, shape=graph.values[node.outputs[0]].shape, **attrs)
        _ensure_opset(graph, "com.microsoft")
        graph.replace_node(node, [out])
        graph.remove_unused_initializers()  # the FusedMoE layouts, now repacked: do not ship the weights twice

    # ----------------------------------------------------------------- IREE
    def lower_iree(self, op: TorchOperator, ctx: PatchContext) -> IreeLowering:
        """Two dispatches of plugin_kernels/moe/moe_cpu.c: ``moe_gate_up_swiglu`` on a (T*k, ceil(I/32)) grid
        into an f32 [T*k, I] scratch, then ``moe_down_proj_reduce`` on (T, ceil(H/32)) into [T, H]; each
        workgroup recomputes its token's routing (E logits, negligible next to its dot products)."""
        if ctx.target != "llvm-cpu":
            raise BackendError(f"FusedMoE has kernels for llvm-cpu only, not '{ctx.target}'")
        obj = build_cpu_object(kernel_source("moe", "moe_cpu.c"))
        tys = op.operand_types
        el = tys[0].builtin_element
        H, E = tys[0].dims[1], tys[1].dims[1]
        k, bs = int(op.attrs["k"]), int(op.attrs.get("block_size", 0))
        I = None if tys[2].dims[1] is None else tys[2].dims[1] // 2
        flags = (_FLAG["f16"] if el == "f16" else 0) | (_FLAG["int4"] if bs else 0)
        flags |= _FLAG["normalize"] if int(op.attrs.get("normalize", 0)) else 0
        flags |= _FLAG["topk_softmax"] if op.attrs.get("mode", "softmax_topk") == "topk_softmax" else 0
        if bs and len(tys) != 8:  # an absent input in the middle is imported as !torch.none
            raise BackendError(f"FusedMoE with block_size {bs} needs all 8 inputs on IREE (zero points included), got {len(tys)}")
        has_zp = bool(bs)
        flags |= _FLAG["zero_points"] if has_zp else 0
        if None in (H, E, I) or not 1 <= k <= min(64, E):
            raise BackendError(f"FusedMoE: H, E, I must be static and 1 <= k <= min(64, E) (got H={H}, E={E}, I={I}, k={k})")
        wel = "i8" if bs else el
        sizes = {n: int(np.prod(t.dims)) for n, t in zip(("fc1", "fc2", "s1", "z1", "s2", "z2"), tys[2:])}
        lines = ["    %moe_c0 = arith.constant 0 : index",
                 f"    %t = tensor.dim %in0, %moe_c0 : {tys[0].builtin}",
                 f"    %tk = arith.muli %t, %c{k}k : index",
                 f"    %th = arith.muli %t, %cH : index", f"    %te = arith.muli %t, %cE : index",
                 f"    %tki = arith.muli %tk, %cI : index"]
        consts = {f"%c{k}k": k, "%cH": H, "%cE": E, "%cI": I, "%cbs": bs, "%cfl": flags,
                  "%nb1": -(-I // ROWS_PER_WORKGROUP), "%nb2": -(-H // ROWS_PER_WORKGROUP)}
        lines = [f"    {n} = arith.constant {v} : index" for n, v in consts.items()] + lines
        for name, kk in (("x", 0), ("l", 1)):  # [T, n] -> tensor<?xel> (a static T is cast to dynamic)
            t = tys[kk]
            if t.dims[0] is None:
                lines.append(f"    %{name} = tensor.collapse_shape %in{kk} [[0, 1]] : {t.builtin} into tensor<?x{el}>")
            else:
                lines.append(f"    %{name}_s = tensor.collapse_shape %in{kk} [[0, 1]] : {t.builtin} into tensor<{t.dims[0] * t.dims[1]}x{el}>")
                lines.append(f"    %{name} = tensor.cast %{name}_s : tensor<{t.dims[0] * t.dims[1]}x{el}> to tensor<?x{el}>")
        for n, kk in (("fc1", 2), ("fc2", 3)):
            lines.append(f"    %{n} = tensor.collapse_shape %in{kk} [[0, 1, 2]] : {tys[kk].builtin} into tensor<{sizes[n]}x{wel}>")
        if bs:
            for n, kk in (("s1", 4), ("s2", 6)):
                lines.append(f"    %{n} = tensor.collapse_shape %in{kk} [[0, 1, 2]] : {tys[kk].builtin} into tensor<{sizes[n]}x{el}>")
            if has_zp:
                for n, kk in (("z1", 5), ("z2", 7)):
                    lines.append(f"    %{n} = tensor.collapse_shape %in{kk} [[0, 1, 2]] : {tys[kk].builtin} into tensor<{sizes[n]}xi8>")
        dummy = {"s1": el, "s2": el, "z1": "i8", "z2": "i8"}
        for n, e in dummy.items():
            if n not in sizes or not bs or (n[0] == "z" and not has_zp):
                sizes[n] = 1
                lines.append(f"    %{n} = arith.constant dense<0{'.0' if e != 'i8' else ''}> : tensor<1x{e}>")
        S = sizes
        lines.append(
            f"    %act = flow.dispatch @moe_exec::@gate_up[%tk, %nb1](%x, %l, %fc1, %s1, %z1, %t, %cH, %cI, %cE, %c{k}k, %cbs, %cfl) : "
            f"(tensor<?x{el}>{{%th}}, tensor<?x{el}>{{%te}}, tensor<{S['fc1']}x{wel}>, tensor<{S['s1']}x{el}>, tensor<{S['z1']}xi8>, "
            f"index, index, index, index, index, index, index) -> tensor<?xf32>{{%tki}}")
        lines.append(
            f"    %o = flow.dispatch @moe_exec::@down[%t, %nb2](%l, %act, %fc2, %s2, %z2, %t, %cH, %cI, %cE, %c{k}k, %cbs, %cfl) : "
            f"(tensor<?x{el}>{{%te}}, tensor<?xf32>{{%tki}}, tensor<{S['fc2']}x{wel}>, tensor<{S['s2']}x{el}>, tensor<{S['z2']}xi8>, "
            f"index, index, index, index, index, index, index) -> tensor<?x{el}>{{%th}}")
        lines.append(f"    %o2 = tensor.expand_shape %o [[0, 1]] output_shape [%t, {H}] : tensor<?x{el}> into tensor<?x{H}x{el}>")
        lines.append(f"    %out0 = tensor.cast %o2 : tensor<?x{H}x{el}> to {op.result_types[0].builtin}")
        name = f"moe_exec_{el}_{wel}_{S['fc1']}_{S['s1']}_{S['z1']}_{S['fc2']}"
        body = "\n".join(lines).replace("@moe_exec::", f"@{name}::")
        return IreeLowering(body=body, module_items={name: _executable(name, str(obj), el, wel, S)}, kernel_objects=[str(obj)])


def _executable(name: str, obj: str, el: str, wel: str, S: dict[str, int]) -> str:
    """The stream.executable with the two exports calling the statically linked kernels (bareptr ABI)."""
    # (element type, size: static int or an SSA dim computed in the function) of each binding, output last
    gate_up = [(el, "%th"), (el, "%te"), (wel, S["fc1"]), (el, S["s1"]), ("i8", S["z1"]), ("f32", "%tki")]
    down = [(el, "%te"), ("f32", "%tki"), (wel, S["fc2"]), (el, S["s2"]), ("i8", S["z2"]), (el, "%th")]
    exports, funcs = [], []
    for export, kernel, bindings in (("gate_up", "moe_gate_up_swiglu", gate_up), ("down", "moe_down_proj_reduce", down)):
        args = [f"%b{i}: !stream.binding" for i in range(len(bindings))]
        args += ["%t: index", "%h: index", "%i: index", "%e: index", "%k: index", "%bs: index", "%fl: index"]
        body = ["        %c0 = arith.constant 0 : index",
                "        %wx = stream.dispatch.workgroup.id[0] : index", "        %wy = stream.dispatch.workgroup.id[1] : index",
                "        %tk = arith.muli %t, %k : index", "        %th = arith.muli %t, %h : index",
                "        %te = arith.muli %t, %e : index", "        %tki = arith.muli %tk, %i : index"]
        call_args, call_types = [], []
        for j, (etype, size) in enumerate(bindings):
            dyn = isinstance(size, str)
            mt = f"memref<?x{etype}>" if dyn else f"memref<{size}x{etype}>"
            body.append(f"        %m{j} = stream.binding.subspan %b{j}[%c0] : !stream.binding -> {mt}" + (f"{{{size}}}" if dyn else ""))
            body.append(f"        %p{j}, %o{j}, %s{j}, %t{j} = iree_codegen.extract_strided_metadata %m{j} : {mt} -> memref<{etype}>, index, index, index")
            call_args += [f"%p{j}", f"%o{j}"]
            call_types += [f"memref<{etype}>", "index"]
        call_args += ["%h", "%i", "%e", "%k", "%bs", "%fl", "%wx", "%wy"]
        call_types += ["index"] * 8
        body.append(f"        func.call @{kernel}({', '.join(call_args)}) : ({', '.join(call_types)}) -> ()")
        body.append("        return")
        exports.append(f"    stream.executable.export public @{export} workgroups(%gx: index, %gy: index) -> (index, index, index) {{\n"
                       f"      %c1 = arith.constant 1 : index\n      stream.return %gx, %gy, %c1 : index, index, index\n    }}")
        funcs.append(f"      func.func private @{kernel}({', '.join(call_types)}) attributes {{hal.import.static, llvm.bareptr = true}}\n"
                     f"      func.func @{export}({', '.join(args)}) {{\n" + "\n".join(body) + "\n      }")
    return (f"  stream.executable private @{name} attributes {{\n"
            f"    hal.executable.objects = #hal.executable.objects<{{\n"
            f"      #hal.executable.target<\"llvm-cpu\", \"embedded-elf-x86_64\"> = [#hal.executable.object<{{path = \"{obj}\"}}>]\n"
            f"    }}>\n  }} {{\n" + "\n".join(exports) + "\n    builtin.module {\n" + "\n".join(funcs) + "\n    }\n  }")


#: Largest QMoE block_size the ORT lowering emits: ORT 1.32's CPU QMoE runs a decode step faster at 64 than at
#: 128 (qwen2_moe mid, 2 threads, ORT profiler: 2.9 vs 3.6 ms per step for the 8 layers; benchmarks/moe_cpu.py),
#: and splitting a block into blocks that share its scale and zero point is exact.
ORT_MAX_BLOCK = 64


def _ort_block(bs: int, h: int, i: int, zero_points: bool) -> int:
    """Largest power-of-two block <= ORT_MAX_BLOCK dividing ``bs``, H and I that QMoE accepts (>= 16; >= 64
    with zero points); 0 if none."""
    q = min(bs & -bs, ORT_MAX_BLOCK)  # bs & -bs: largest power of two dividing bs (96 -> 32)
    while q >= (64 if zero_points else 16):
        if h % q == 0 and i % q == 0:
            return q
        q //= 2
    return 0


def _interleave(a: np.ndarray) -> np.ndarray:
    """[E, 2I, ...] gate rows then up rows -> rows g0, u0, g1, u1, ... (ORT swiglu_fusion=1)."""
    n = a.shape[1] // 2
    out = np.empty_like(a)
    out[:, 0::2], out[:, 1::2] = a[:, :n], a[:, n:]
    return out


def _ensure_opset(graph: Graph, domain: str, version: int = 1) -> None:
    """Declare ``domain`` in the model's opset imports (ORT refuses nodes of an undeclared domain)."""
    if graph.opset(domain) is None:
        graph.model_shell.opset_import.add(domain=domain, version=version)
