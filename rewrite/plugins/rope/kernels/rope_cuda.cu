// RotaryEmbedding CUDA kernel for IREE's cuda target (extern dispatch; PTX for sm_80, which sm_90 runs).
//
// IREE CUDA dispatch ABI (samples/custom_dispatch/cuda/kernels in IREE): the bindings' base pointers in binding
// order (x, cos, sin, weight, y), then each push constant as a 32-bit integer: rows, H, T, cos_b_stride,
// cos_t_stride, sin_b_stride, sin_t_stride, has_norm, eps_bits.
// Layouts: the contract of ai.rewrite::RotaryEmbedding (rewrite/plugins/rope/op.py), row-major, one float type:
//   x, y [B, H, T, D]; cos [Bc, 1, Tc, D], element (b, t, d) at b * cos_b_stride + t * cos_t_stride + d (a stride
//   is 0 where cos broadcasts); sin [Bs, 1, Ts, D] likewise; weight [D] (when has_norm).
//   with has_norm: x = round(round(x / sqrt(mean_d(x * x) + eps)) * weight)   (float32 inside, as Qwen3RMSNorm)
//   y = round(round(x * cos) + round(rotate_half(x) * sin)), rotate_half(x) = concat(-x[D/2:], x[:D/2])
//   (round: to the model's type, as the ONNX Mul, Cast and Add they replace).
//
// A warp per row (b, h, t): lane l holds elements l * DL .. l * DL + DL - 1 (DL = D / 32), so an element's
// rotation partner d +- D/2 sits in lane l ^ 16 at the same offset (one shuffle). WARPS rows a workgroup.
#include <cuda_fp16.h>
#include <stdint.h>

#include "../../kernels/cuda_rope.h"  // rotate_row
#include "../../kernels/cuda_rows.h"  // to_f, store

#define WARPS 8  // CUDA_WARPS in op.py

template <typename T, int D>
__device__ void rotary_row(const T* x, const T* cos, const T* sin, const T* weight, T* y, int row, int H, int Tq,
                           int csb, int cst, int ssb, int sst, int has_norm, float eps) {
  constexpr int DL = D / 32;
  const int lane = threadIdx.x & 31;
  const int t = row % Tq, b = row / (Tq * H);
  const T* xr = x + (size_t)row * D + lane * DL;
  float v[DL];
#pragma unroll
  for (int j = 0; j < DL; ++j) v[j] = to_f(xr[j]);
  const T* cr = cos + (size_t)b * csb + (size_t)t * cst + lane * DL;
  const T* sr = sin + (size_t)b * ssb + (size_t)t * sst + lane * DL;
  rotate_row<DL>(v, cr, sr, has_norm ? weight + lane * DL : nullptr, eps);
  T* yr = y + (size_t)row * D + lane * DL;
#pragma unroll
  for (int j = 0; j < DL; ++j) store(yr + j, v[j]);
}

// rotary_embedding_<el>_d<D>: one X. rotary_embedding2_<el>_d<D>: two (Q and K of a layer: one launch), bindings
// x, cos, sin, weight, x2, weight2, y, y2 and push constants rows, H, T, the four strides, has_norm, eps_bits,
// rows2, H2, has_norm2; rows 0 .. rows - 1 of the grid are x's, the next rows2 x2's (same B, T, cos, sin, eps).
#define KERNEL(T, el, D)                                                                                     \
  extern "C" __global__ void __launch_bounds__(32 * WARPS) rotary_embedding_##el##_d##D(                    \
      const T* x, const T* cos, const T* sin, const T* weight, T* y, int rows, int H, int Tq, int csb,       \
      int cst, int ssb, int sst, int has_norm, int eps_bits) {                                               \
    const int row = blockIdx.x * WARPS + (threadIdx.x >> 5);                                                 \
    if (row >= rows) return;                                                                                 \
    rotary_row<T, D>(x, cos, sin, weight, y, row, H, Tq, csb, cst, ssb, sst, has_norm,                      \
                     __int_as_float(eps_bits));                                                              \
  }                                                                                                          \
  extern "C" __global__ void __launch_bounds__(32 * WARPS) rotary_embedding2_##el##_d##D(                   \
      const T* x, const T* cos, const T* sin, const T* weight, const T* x2, const T* weight2, T* y, T* y2,   \
      int rows, int H, int Tq, int csb, int cst, int ssb, int sst, int has_norm, int eps_bits, int rows2,    \
      int H2, int has_norm2) {                                                                               \
    const int row = blockIdx.x * WARPS + (threadIdx.x >> 5);                                                 \
    if (row < rows)                                                                                          \
      rotary_row<T, D>(x, cos, sin, weight, y, row, H, Tq, csb, cst, ssb, sst, has_norm,                    \
                       __int_as_float(eps_bits));                                                            \
    else if (row < rows + rows2)                                                                             \
      rotary_row<T, D>(x2, cos, sin, weight2, y2, row - rows, H2, Tq, csb, cst, ssb, sst, has_norm2,        \
                       __int_as_float(eps_bits));                                                            \
  }

KERNEL(__half, f16, 32)
KERNEL(__half, f16, 64)
KERNEL(__half, f16, 128)
KERNEL(__half, f16, 256)
KERNEL(float, f32, 32)
KERNEL(float, f32, 64)
KERNEL(float, f32, 128)
KERNEL(float, f32, 256)
