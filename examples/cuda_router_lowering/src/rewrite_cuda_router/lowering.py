"""A third party's IREE ``cuda`` lowering of rewrite's ``MoERouterTopK``, registered from outside the rewrite package.

rewrite's own ``topk`` plugin lowers the op for ``iree:cuda`` (its C kernel built with nvcc, one thread per token,
every mode). This package shows how a package puts its own kernel in that slot through the ``rewrite_lowerings``
hook without touching rewrite: its lowering is registered with ``replaces=True``, so it takes the slot from the
built-in one. One thread per token runs ``kernels/router_topk.cu`` (PTX for sm_80, which the H100/H200 driver
JITs), launched as an IREE extern dispatch (``hal.executable.source`` with the PTX object, ``flow.dispatch`` from
the op's wrapper). It takes the modes ``softmax_topk``, ``topk_softmax`` and ``topk`` on float32 or float16 logits
and float32 weights; it hands every other variant back to the built-in lowering.
"""

from __future__ import annotations

from pathlib import Path

from rewrite.core.iree_lowering import IreeLowering, PatchContext, TorchOperator, kernel_bindings
from rewrite.core.kernels import build_cuda_ptx
from rewrite.core.lowering import Lowering
from rewrite.errors import BackendError
from rewrite.hookspecs import hookimpl

KERNEL = Path(__file__).parent / "kernels" / "router_topk.cu"
MODES = ("softmax_topk", "topk_softmax", "topk")  #: the kernel's ``mode`` constant is the index
MAX_EXPERTS = 1024  #: the kernel's taken-expert bitmask holds 32 x 32 bits
THREADS = 64  #: workgroup (CUDA block) size; one thread per token


def lower_router_cuda(op: TorchOperator, ctx: PatchContext) -> IreeLowering:
    """The wrapper body: logits ``[..., E]`` (f32 or f16) collapsed to ``[T, E]``, one dispatch of
    ``router_topk_<f32|f16>`` on ``ceil(T / 64)`` workgroups, weights ``[T, k]`` f32 and ids ``[T, k]`` i64
    expanded back.

    Variants this kernel does not take (f16 weights, grouped and sparsemixer modes) go to rewrite's own lowering.

    Raises:
        BackendError: a dynamic or too large E, k outside 1..E.
    """
    xt, wt, it = op.operand_types[0], op.result_types[0], op.result_types[1]
    k, normalize, mode = int(op.attrs.get("k", 0)), int(op.attrs.get("normalize", 0)), op.attrs.get("mode", "softmax_topk")
    e = xt.dims[-1] if xt.dims else None
    if xt.element not in ("f32", "f16") or wt.element != "f32" or mode not in MODES:
        from rewrite.plugins.router.op import MoERouterTopK

        return MoERouterTopK().lower_iree(op, ctx)
    if len(xt.dims) < 2 or not isinstance(e, int) or not 1 <= e <= MAX_EXPERTS or not 1 <= k <= e:
        raise BackendError(f"MoERouterTopK {op.where} on cuda: logits {xt.text}, k={k}; needs a static E of 1..{MAX_EXPERTS} and 1 <= k <= E")
    ptx = ctx.object_path(build_cuda_ptx(KERNEL, ctx.cuda_arch))
    rank = len(xt.dims)
    lines = ["    %cr_t0 = arith.constant 1 : index"]
    dims = []  # the leading dims as index values, multiplied into the token count t
    for ax, d in enumerate(xt.dims[:-1]):
        if d is None:
            dims.append(f"%in0_d{ax}")
        else:
            lines.append(f"    %cr_s{ax} = arith.constant {d} : index")
            dims.append(f"%cr_s{ax}")
        lines.append(f"    %cr_t{ax + 1} = arith.muli %cr_t{ax}, {dims[-1]} : index")
    t = f"%cr_t{rank - 1}"
    group = "[[" + ", ".join(str(a) for a in range(rank - 1)) + f"], [{rank - 1}]]"
    el = xt.builtin_element
    flat = f"tensor<{'?' if None in xt.dims[:-1] else _prod(xt.dims[:-1])}x{e}x{el}>"
    lines += [
        f"    %cr_flat0 = tensor.collapse_shape %in0 {group} : {xt.builtin} into {flat}",
        f"    %cr_flat = tensor.cast %cr_flat0 : {flat} to tensor<?x{e}x{el}>",
        f"    %cr_t32 = arith.index_cast {t} : index to i32",
        f"    %cr_e = arith.constant {e} : i32",
        f"    %cr_k = arith.constant {k} : i32",
        f"    %cr_mode = arith.constant {MODES.index(mode)} : i32",
        f"    %cr_norm = arith.constant {normalize} : i32",
        f"    %cr_w, %cr_i = flow.dispatch @rewrite_cuda_router_{el}::@router_topk_{el}[{t}](%cr_flat, %cr_t32, %cr_e, %cr_k, %cr_mode, %cr_norm)"
        f" : (tensor<?x{e}x{el}>{{{t}}}, i32, i32, i32, i32, i32) -> (tensor<?x{k}xf32>{{{t}}}, tensor<?x{k}xi64>{{{t}}})",
    ]
    shape = ", ".join(dims + [str(k)])
    for name, src, res in (("%out0", "%cr_w", wt), ("%out1", "%cr_i", it)):
        rel = res.builtin_element
        dyn = "tensor<" + "?x" * (rank - 1) + f"{k}x{rel}>"
        lines.append(f"    {name}_x = tensor.expand_shape {src} {group} output_shape [{shape}] : tensor<?x{k}x{rel}> into {dyn}")
        lines.append(f"    {name} = tensor.cast {name}_x : {dyn} to {res.builtin}")
    return IreeLowering(body="\n".join(lines), module_items={f"rewrite_cuda_router_{el}": _executable(ptx, el)})


def _prod(dims) -> int:
    out = 1
    for d in dims:
        out *= d
    return out


def _executable(ptx: str, el: str) -> str:
    """The ``hal.executable.source`` declaring the PTX kernel ``router_topk_<el>``: 3 bindings (logits read only,
    weights, ids), 5 i32 push constants (t, e, k, mode, normalize), ``ceil(t / THREADS)`` workgroups of ``THREADS``."""
    return f"""
  hal.executable.source private @rewrite_cuda_router_{el} <objects = <{{
      #hal.executable.target<"cuda", "cuda-nvptx-fb"> = [#hal.executable.object<{{path = "{ptx}"}}>]}}>> {{
    hal.executable.export public @router_topk_{el} ordinal(0)
        layout(#hal.pipeline.layout<constants = 5, bindings = [{kernel_bindings(1, 2)}]>)
        count(%device: !hal.device, %t: index) -> (index, index, index) {{
      %x = affine.apply affine_map<()[s0] -> (s0 ceildiv {THREADS})>()[%t]
      %c1 = arith.constant 1 : index
      hal.return %x, %c1, %c1 : index, index, index
    }} <workgroup_size = [{THREADS} : index, 1 : index, 1 : index]>
  }}"""


@hookimpl
def rewrite_lowerings():
    return [Lowering("MoERouterTopK", "iree", ("cuda",), lower_router_cuda, origin="rewrite-cuda-router", replaces=True)]
