// RotaryEmbedding of one row in a warp's registers, shared by the rope kernel (rope_cuda.cu) and the attention
// kernel's rotary inputs (attention_cuda.cu): the contract of ai.rewrite::RotaryEmbedding
// (rewrite/plugins/rope/op.py).
#pragma once
#include <cuda_fp16.h>

#include "cuda_rows.h"  // to_f, rounded

// A row of D = 32 DL elements held by the calling warp, lane l holding elements l * DL .. l * DL + DL - 1 in v: with
// a norm weight (w non-null), x = round(round(x / sqrt(mean_d(x * x) + eps)) * w) (float32 inside, as
// Qwen3RMSNorm), then y = round(round(x * cos) + round(rotate_half(x) * sin)), rotate_half(x) = concat(-x[D/2:],
// x[:D/2]); round: to T, as the ONNX ops it replaces. The partner d +- D/2 sits in lane l ^ 16 at the same offset
// (one shuffle). cr, sr and w: this lane's part of the cos and sin rows and of the weight. The whole warp calls it;
// v holds y on return.
template <int DL, typename T>
__device__ __forceinline__ void rotate_row(float (&v)[DL], const T* cr, const T* sr, const T* w, float eps) {
  const int lane = threadIdx.x & 31;
  if (w) {
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < DL; ++j) ss += v[j] * v[j];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float den = sqrtf(ss / (float)(32 * DL) + eps);
#pragma unroll
    for (int j = 0; j < DL; ++j) v[j] = rounded(rounded(v[j] / den, cr) * to_f(w[j]), cr);
  }
#pragma unroll
  for (int j = 0; j < DL; ++j) {
    const float partner = __shfl_xor_sync(0xffffffffu, v[j], 16);
    const float rot = lane < 16 ? -partner : partner;
    v[j] = rounded(rounded(v[j] * to_f(cr[j]), cr) + rounded(rot * to_f(sr[j]), cr), cr);
  }
}
