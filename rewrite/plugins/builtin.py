"""Registers the built-in plugins with the plugin manager."""

from __future__ import annotations

from rewrite.hookspecs import hookimpl


@hookimpl
def rewrite_plugins():
    from rewrite.plugins.attention import Attention
    from rewrite.plugins.cast_roundtrip import CastRoundtrip
    from rewrite.plugins.densemm import DenseMM
    from rewrite.plugins.expand import ExpandShapes
    from rewrite.plugins.kv_cache import KVCache
    from rewrite.plugins.legalize import Legalize
    from rewrite.plugins.matmul4 import MatMul4
    from rewrite.plugins.moe import MoE
    from rewrite.plugins.f32acc import F32Acc
    from rewrite.plugins.quant4 import Quant4
    from rewrite.plugins.rmsnorm import RmsNorm
    from rewrite.plugins.rope import Rope
    from rewrite.plugins.router import RouterTopK

    return [CastRoundtrip(), Legalize(), ExpandShapes(), KVCache(), Rope(), RmsNorm(), Attention(), RouterTopK(), MoE(), Quant4(), MatMul4(), DenseMM(), F32Acc()]
