// Element access shared by the plugins' CUDA kernels (matmul4, densemm, attention, rope, rmsnorm): an f16 or f32
// element as a float, 8 consecutive elements of a row as floats, one float stored in either type (round to
// nearest), and a float rounded to either type and back.
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
