// Element access shared by the plugins' CUDA kernels (matmul4, densemm, attention, rope, rmsnorm): an f16 or f32
// element as a float, 8 consecutive elements of a row as floats, one float stored in either type (round to
// nearest), and a float rounded to either type and back; and RMSNorm of one row in a kernel's prologue (matmul4,
// densemm).
#pragma once
#include <cuda_fp16.h>

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }
// v rounded to T and back: what storing an ONNX intermediate of type T does to it (the pointer picks T)
__device__ __forceinline__ float rounded(float v, const float*) { return v; }
__device__ __forceinline__ float rounded(float v, const __half*) { return __half2float(__float2half_rn(v)); }

// p must be 16-byte aligned (f16) or 32-byte aligned (f32).
__device__ __forceinline__ void load8(const __half* p, float* out) {
  uint4 v = *reinterpret_cast<const uint4*>(p);
  const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = __half22float2(h[i]);
    out[2 * i] = f.x, out[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void load8(const float* p, float* out) {
  float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
  out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w, out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}

// The sum of v over the workgroup's THREADS threads, returned to every thread: warp shuffles, then the warps' sums
// through shared memory (a barrier: every thread must call it; the shared sums are read after it, so a second call
// in one kernel needs a barrier between).
template <int THREADS>
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_sums[THREADS / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < THREADS / 32; ++w) total += warp_sums[w];
  return total;
}

// RMSNorm's denominator sqrt(mean_k(x * x) + eps) of one row x[0 .. K) (K a multiple of 8, x 16-byte aligned),
// returned to every thread of the workgroup: each thread sums the squares of 8 elements per step of 8 * THREADS
// (one step for K <= 8 * THREADS: one memory round trip), then the warps' sums meet through shared memory. Every
// thread of the workgroup must call it (a barrier). ai.rewrite::RMSNorm's arithmetic (rmsnorm_cuda.cu), its sum in
// another order. Its block_sum's rule holds for it: a second call in one kernel needs a barrier between
// (rms_norm_row ends with one).
template <int THREADS, typename T>
__device__ __forceinline__ float rms_denominator(const T* x, int K, float eps) {
  float ss = 0.f;
  for (int k = threadIdx.x * 8; k < K; k += THREADS * 8) {
    float v[8];
    load8(x + k, v);
#pragma unroll
    for (int i = 0; i < 8; ++i) ss = fmaf(v[i], v[i], ss);
  }
  return sqrtf(block_sum<THREADS>(ss) / (float)K + eps);
}

// x[k] normalized by den and scaled by the norm weight g[k], each rounded to T as RMSNorm's Cast and Mul do
template <typename T>
__device__ __forceinline__ float rms_normed(float x, float den, float g, const T* type) {
  return rounded(rounded(x / den, type) * g, type);
}

// RMS_NORM_MAX_K: the longest row rms_norm_row normalizes into shared memory (CUDA_MAX_H in rmsnorm/op.py: 16 KB of
// f16, 32 KB of f32 a workgroup)
#define RMS_NORM_MAX_K 8192

// The row x[0 .. K) through RMSNorm (weight g [K], eps) into xs[0 .. K) (the caller's shared memory, 16-byte
// aligned), each element rounded to T as RMSNorm's output is: a kernel's prologue, so that its loop reads the
// normalized row as it would read x (one division per element per workgroup, not per use). Every thread of the
// workgroup must call it (barriers).
template <int THREADS, typename T>
__device__ __forceinline__ void rms_norm_row(const T* x, const T* g, float eps, int K, T* xs) {
  const float den = rms_denominator<THREADS>(x, K, eps);
  for (int k = threadIdx.x * 8; k < K; k += THREADS * 8) {
    float v[8], w[8];
    load8(x + k, v);
    load8(g + k, w);
#pragma unroll
    for (int i = 0; i < 8; ++i) store(xs + k + i, rms_normed(v[i], den, w[i], x));
  }
  __syncthreads();
}
