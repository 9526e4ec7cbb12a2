// RMSNorm CUDA kernel for IREE's cuda target (extern dispatch; PTX for sm_80, which sm_90 runs).
//
// IREE CUDA dispatch ABI (samples/custom_dispatch/cuda/kernels in IREE): the bindings' base pointers in binding
// order (x, weight, y), then each push constant as a 32-bit integer: rows, H, eps_bits.
// Layouts: the contract of ai.rewrite::RMSNorm (rewrite/plugins/rmsnorm/op.py), row-major, one float type:
//   x, y [rows, H], weight [H];
//   y = round(round(x / sqrt(mean_h(x * x) + eps)) * weight)   (float32 inside, as transformers' RMSNorm: the
//   normalized row rounded to the model's type before the weight, as the Cast and Mul they replace).
//
// A workgroup per row: THREADS threads take the row's elements h = tid, tid + THREADS, ... (coalesced), keep
// them in registers (H <= THREADS * PER_THREAD), sum their squares (warp shuffles, then the warps' sums through
// shared memory), and write the row. f16 rows with H a multiple of 8 take 16-byte pieces instead (piece c = tid,
// tid + THREADS, ...), the weight's pieces loaded with the row's before the reduction: at decode the kernel is a
// few dependent memory round trips, and this makes them one (Qwen3-30B-A3B's H = 2048: one piece a thread).
#include <cuda_fp16.h>
#include <stdint.h>

#include "../../kernels/cuda_rows.h"  // to_f, store, rounded, block_sum

#define THREADS 256  // CUDA_THREADS in op.py
#define PER_THREAD 32  // H up to THREADS * PER_THREAD = 8192 (CUDA_MAX_H in op.py)

template <typename T>
__device__ void rms_norm(const T* x, const T* weight, T* y, int H, float eps) {
  const T* xr = x + (size_t)blockIdx.x * H;
  T* yr = y + (size_t)blockIdx.x * H;
  float v[PER_THREAD];
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < PER_THREAD; ++j) {
    const int h = threadIdx.x + j * THREADS;
    v[j] = h < H ? to_f(xr[h]) : 0.f;
    ss += v[j] * v[j];
  }
  const float den = sqrtf(block_sum<THREADS>(ss) / (float)H + eps);
#pragma unroll
  for (int j = 0; j < PER_THREAD; ++j) {
    const int h = threadIdx.x + j * THREADS;
    if (h < H) store(yr + h, rounded(v[j] / den, x) * to_f(weight[h]));
  }
}

// f16, H % 8 == 0: 16-byte pieces of 8 elements, up to PER_THREAD / 8 a thread
__device__ void rms_norm_f16_vec(const __half* x, const __half* weight, __half* y, int H, float eps) {
  constexpr int PIECES = PER_THREAD / 8;
  const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)blockIdx.x * H);
  const uint4* wr = reinterpret_cast<const uint4*>(weight);
  uint4* yr = reinterpret_cast<uint4*>(y + (size_t)blockIdx.x * H);
  const int n = H / 8;
  uint4 xv[PIECES], wv[PIECES];
#pragma unroll
  for (int j = 0; j < PIECES; ++j) {
    const int c = threadIdx.x + j * THREADS;
    xv[j] = c < n ? xr[c] : make_uint4(0, 0, 0, 0);
    wv[j] = c < n ? __ldg(wr + c) : make_uint4(0, 0, 0, 0);
  }
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < PIECES; ++j) {
    const __half2* h = reinterpret_cast<const __half2*>(&xv[j]);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(h[i]);
      ss += f.x * f.x + f.y * f.y;
    }
  }
  const float den = sqrtf(block_sum<THREADS>(ss) / (float)H + eps);
#pragma unroll
  for (int j = 0; j < PIECES; ++j) {
    const int c = threadIdx.x + j * THREADS;
    if (c >= n) continue;
    const __half2* h = reinterpret_cast<const __half2*>(&xv[j]);
    const __half2* w = reinterpret_cast<const __half2*>(&wv[j]);
    uint4 out;
    __half2* o = reinterpret_cast<__half2*>(&out);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(h[i]), g = __half22float2(w[i]);
      const float a = __half2float(__float2half_rn(f.x / den)) * g.x;
      const float b = __half2float(__float2half_rn(f.y / den)) * g.y;
      o[i] = __floats2half2_rn(a, b);
    }
    yr[c] = out;
  }
}

extern "C" __global__ void __launch_bounds__(THREADS) rms_norm_f16(const __half* x, const __half* weight, __half* y,
                                                                     int rows, int H, int eps_bits) {
  const bool aligned = (((uintptr_t)x | (uintptr_t)weight | (uintptr_t)y) & 15) == 0;
  if ((H & 7) == 0 && aligned)  // every row then starts at a multiple of 16 bytes too
    rms_norm_f16_vec(x, weight, y, H, __int_as_float(eps_bits));
  else
    rms_norm<__half>(x, weight, y, H, __int_as_float(eps_bits));
}
extern "C" __global__ void __launch_bounds__(THREADS) rms_norm_f32(const float* x, const float* weight, float* y,
                                                                     int rows, int H, int eps_bits) {
  rms_norm<float>(x, weight, y, H, __int_as_float(eps_bits));
}
