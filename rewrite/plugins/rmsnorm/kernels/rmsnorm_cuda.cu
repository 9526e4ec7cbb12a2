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
// shared memory), and write the row.
#include <cuda_fp16.h>
#include <stdint.h>

#define THREADS 256  // CUDA_THREADS in op.py
#define PER_THREAD 32  // H up to THREADS * PER_THREAD = 8192 (CUDA_MAX_H in op.py)

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ float rounded(float v, const float*) { return v; }
__device__ __forceinline__ float rounded(float v, const __half*) { return __half2float(__float2half_rn(v)); }

template <typename T>
__device__ void rms_norm(const T* x, const T* weight, T* y, int H, float eps) {
  __shared__ float sh[THREADS / 32];
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
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = ss;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < THREADS / 32; ++w) total += sh[w];
  const float den = sqrtf(total / (float)H + eps);
#pragma unroll
  for (int j = 0; j < PER_THREAD; ++j) {
    const int h = threadIdx.x + j * THREADS;
    if (h < H) store(yr + h, rounded(v[j] / den, x) * to_f(weight[h]));
  }
}

extern "C" __global__ void __launch_bounds__(THREADS) rms_norm_f16(const __half* x, const __half* weight, __half* y,
                                                                     int rows, int H, int eps_bits) {
  rms_norm<__half>(x, weight, y, H, __int_as_float(eps_bits));
}
extern "C" __global__ void __launch_bounds__(THREADS) rms_norm_f32(const float* x, const float* weight, float* y,
                                                                     int rows, int H, int eps_bits) {
  rms_norm<float>(x, weight, y, H, __int_as_float(eps_bits));
}
