"""4-bit weight layouts shared by the ONNX Runtime contrib ops (com.microsoft QMoE, MatMulNBits), the lowerings
that write them and the kernels: two codes per byte along the reduction axis, even element in the low nibble
(ORT's contrib-op docs, QMoE and MatMulNBits).
"""

from __future__ import annotations

import numpy as np

#: Largest QMoE block_size the ORT lowering emits: ORT 1.32's CPU QMoE runs a decode step faster at 64 than at
#: 128 (qwen2_moe mid, 2 threads, ORT profiler: 2.9 vs 3.6 ms per step for the 8 layers; benchmarks/moe_cpu.py),
#: and splitting a block into blocks that share its scale and zero point is exact.
ORT_MAX_BLOCK = 64


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
