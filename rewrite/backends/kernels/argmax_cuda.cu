// ArgMax over the last axis for IREE's cuda target (rewrite/backends/iree_argmax.py): the next token of
// ``rewrite apply --next-token``, the first index of the largest of a vocabulary's logits, in one dispatch.
//
// IREE CUDA dispatch ABI (samples/custom_dispatch/cuda/kernels in IREE): the bindings' base pointers in binding
// order (x, y), then each push constant as a 32-bit integer: rows, n.
// Layouts, row-major: x [rows, n] (f16 or f32), y [rows] int64: y[r] = the lowest i with x[r, i] the row's maximum
// (ONNX ArgMax with select_last_index=0; -0 and +0 tie, as they compare equal). NaN ranks below every number,
// -inf included, so a row's NaNs are skipped; a row of NaNs only gives 0.
//
// Grid: x = rows; THREADS threads a row. Each thread keeps the best of the elements it reads (16 bytes at a time,
// VEC elements, several loads in flight), as one 64-bit key: the value's order (a float's bits made to compare as
// unsigned) above the complement of its index, so the largest key is the largest value at its lowest index; then
// the warps' and the workgroup's maxima. A 151,936-token row of f16 is 297 KB: one workgroup reads it in about
// 17 us on an H100, against 73 us for IREE 3.13's own one-workgroup arg_compare (BENCHMARKS.md).
#include <cuda_fp16.h>
#include <stdint.h>

#define THREADS 1024  // ARGMAX_THREADS in iree_argmax.py
#define UNROLL 4      // 16-byte loads in flight per thread

// A float's order as an unsigned key (larger float, larger key; -0 and +0 one key); NaN is 0, below -inf.
__device__ __forceinline__ unsigned order_key(float v) {
  unsigned b = v == 0.f ? 0u : __float_as_uint(v);
  return v != v ? 0u : (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ unsigned long long pack(float v, unsigned i) {
  return ((unsigned long long)order_key(v) << 32) | (unsigned long long)(~i);
}
__device__ __forceinline__ unsigned long long umax(unsigned long long a, unsigned long long b) { return a > b ? a : b; }

template <typename T>
struct Vec;  // elements per 16-byte load, and the element i of one as a float
template <>
struct Vec<__half> {
  static constexpr int n = 8;
  __device__ static float at(const uint4& v, int i) { return __half2float(reinterpret_cast<const __half*>(&v)[i]); }
};
template <>
struct Vec<float> {
  static constexpr int n = 4;
  __device__ static float at(const uint4& v, int i) { return reinterpret_cast<const float*>(&v)[i]; }
};

template <typename T>
__device__ void row_argmax(const T* __restrict__ x, long long* __restrict__ y, int n) {
  constexpr int V = Vec<T>::n;
  const T* row = x + (size_t)blockIdx.x * n;
  unsigned long long best = 0ull;  // below every element's key (a NaN's included: its index part is not 0)
  // the 16-byte path needs the row 16-byte aligned (n a multiple of V); the rest element by element
  const bool vec = (n % V) == 0 && (reinterpret_cast<uintptr_t>(row) & 15) == 0;
  const int nv = vec ? n / V : 0;
  for (int c0 = threadIdx.x; c0 < nv; c0 += THREADS * UNROLL) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int c = c0 + u * THREADS;
      v[u] = c < nv ? __ldg(reinterpret_cast<const uint4*>(row) + c) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int c = c0 + u * THREADS;
      if (c < nv) {
#pragma unroll
        for (int i = 0; i < V; ++i) best = umax(best, pack(Vec<T>::at(v[u], i), (unsigned)(c * V + i)));
      }
    }
  }
  for (int i = nv * V + threadIdx.x; i < n; i += THREADS) best = umax(best, pack((float)row[i], (unsigned)i));
  for (int o = 16; o > 0; o >>= 1) best = umax(best, __shfl_xor_sync(0xffffffffu, best, o));
  __shared__ unsigned long long warp_best[THREADS / 32];
  if ((threadIdx.x & 31) == 0) warp_best[threadIdx.x >> 5] = best;
  __syncthreads();
  if (threadIdx.x < 32) {
    best = threadIdx.x < THREADS / 32 ? warp_best[threadIdx.x] : 0ull;
    for (int o = 16; o > 0; o >>= 1) best = umax(best, __shfl_xor_sync(0xffffffffu, best, o));
    if (threadIdx.x == 0) y[blockIdx.x] = best ? (long long)(~(unsigned)(best & 0xffffffffull)) : 0ll;
  }
}

extern "C" __global__ void __launch_bounds__(THREADS) row_argmax_f16(const __half* x, long long* y, int rows, int n) {
  (void)rows;
  row_argmax(x, y, n);
}
extern "C" __global__ void __launch_bounds__(THREADS) row_argmax_f32(const float* x, long long* y, int rows, int n) {
  (void)rows;
  row_argmax(x, y, n);
}
