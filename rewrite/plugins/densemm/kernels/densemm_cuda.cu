// DenseMatMul CUDA kernel for IREE's cuda target (extern dispatch; PTX for sm_80, which sm_90 runs).
//
// IREE CUDA dispatch ABI (samples/custom_dispatch/cuda/kernels in IREE): the bindings' base pointers in binding
// order, then each push constant as a 32-bit integer: m, k, n.
// Layouts: the contract of ai.rewrite::DenseMatMul (rewrite/plugins/densemm/op.py): x [M, K], w [N, K] (rows
// along K, as torch.nn.Linear stores them), y [M, N], all of one float type (f32 or f16);
// y[m, n] = sum_k x[m, k] * w[n, k], summed in f32.
//
// Grid (ceil(N / WARPS), ceil(M / TOKENS)), THREADS threads: warp w of workgroup (i, j) computes row
// n = i * WARPS + w for tokens j * TOKENS .. + TOKENS - 1, so the weight row is read once per TOKENS tokens and a
// decode step (M = 1) reads each weight byte once: a matrix-vector product bound by memory bandwidth (the LM head,
// 151936 x 2048 in Qwen's models). Each lane takes 8 consecutive elements per step (16 bytes of f16); K must be a
// multiple of 8 (the lowering checks), so every read is aligned.
//
// dense_matmul_norm_<type> (the ``rms-norm-prologue`` rule; one row of x, K <= RMS_NORM_MAX_K, grid
// (ceil(N / WARPS), 1)): x is the input of an RMSNorm with weight nw [K] (a third binding, before y); each workgroup
// first normalizes the row into shared memory, round(round(x / sqrt(mean_k(x * x) + eps)) * nw[k])
// (ai.rewrite::RMSNorm's contract), and workgroup 0 also writes it to xn [K] (a second output, for the norm's other
// readers); push constants m, k, n and the epsilon's float32 bits.
//
// *_o2 (the op's ``splits``, two widths: the ``merge-normed-products`` rule's router and shared-expert gate): y's
// columns go to two outputs, y0 [M, n0] the first n0, y1 [M, N - n0] the rest; n0 a last push constant.
//
// One row of x (decode: the norm kernel, and the plain kernel when m is 1): a warp's lanes issue STEPS steps of their
// row's loads at once (the whole row for K <= 2048 in f16), the norm kernel before its prologue, so the weight
// bytes are in flight while the workgroup normalizes x (they do not depend on it).
#include <cuda_fp16.h>
#include <stdint.h>

#include "../../kernels/cuda_rows.h"  // load8, store, rms_norm_row

#define THREADS 256  // CUDA_THREADS in op.py
#define WARPS (THREADS / 32)
#define TOKENS 8     // CUDA_TOKENS in op.py

// 8 consecutive elements of a row as raw bytes (16 of f16, 32 of f32), and as floats
template <typename T>
struct Raw8 {
  uint4 v[sizeof(T) / 2];
};
template <typename T>
__device__ __forceinline__ Raw8<T> raw8(const T* p) {
  Raw8<T> r;
#pragma unroll
  for (int i = 0; i < (int)(sizeof(T) / 2); ++i) r.v[i] = __ldg(reinterpret_cast<const uint4*>(p) + i);
  return r;
}
template <typename T>
__device__ __forceinline__ void floats8(const Raw8<T>& r, float* out) {
  load8(reinterpret_cast<const T*>(r.v), out);
}
// steps of 8 elements a lane has in flight at once on the one-row path (32 registers of loads either way)
template <typename T>
struct RowSteps {
  static constexpr int value = sizeof(T) == 2 ? 8 : 4;
};

// The one-row product of weight row ``row`` [K] with x [K] (shared or global), summed over the warp, on every lane.
// ``wr``: the lane's first STEPS steps (elements lane * 8 + 256 * d) when ``loaded``, else loaded here.
template <typename T>
__device__ __forceinline__ float row_dot1(const T* x, const T* row, int K, Raw8<T> (&wr)[RowSteps<T>::value],
                                          bool loaded) {
  constexpr int STEPS = RowSteps<T>::value;
  const int lane = threadIdx.x & 31;
  float acc = 0.f;
  for (int k0 = lane * 8; k0 < K; k0 += STEPS * 256) {
    if (!loaded || k0 != lane * 8) {
#pragma unroll
      for (int d = 0; d < STEPS; ++d)
        if (k0 + 256 * d < K) wr[d] = raw8(row + k0 + 256 * d);
    }
#pragma unroll
    for (int d = 0; d < STEPS; ++d) {
      const int k = k0 + 256 * d;
      if (k < K) {
        float wf[8], xv[8];
        floats8(wr[d], wf);
        load8(x + k, xv);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc = fmaf(xv[i], wf[i], acc);
      }
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  return acc;
}
template <typename T>
__device__ __forceinline__ void issue_row(const T* row, int K, Raw8<T> (&wr)[RowSteps<T>::value]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int d = 0; d < RowSteps<T>::value; ++d)
    if (lane * 8 + 256 * d < K) wr[d] = raw8(row + lane * 8 + 256 * d);
}

// y[m, n] of the whole product, into y0 or (OUTS = 2, n >= n0) y1
template <typename T, int OUTS>
__device__ __forceinline__ void store_col(T* y0, T* y1, int m, int n, int N, int n0, float v) {
  if (OUTS == 2 && n >= n0)
    store(y1 + (size_t)m * (N - n0) + (n - n0), v);
  else
    store(y0 + (size_t)m * (OUTS == 2 ? n0 : N) + n, v);
}

template <typename T, int OUTS>
__device__ void dense_matmul(const T* x, const T* w, T* y, T* y1, int M, int K, int N, int n0) {
  const int lane = threadIdx.x & 31;
  const int n = blockIdx.x * WARPS + (threadIdx.x >> 5);
  const int m0 = blockIdx.y * TOKENS;
  if (n >= N) return;
  if (M == 1) {  // decode: the one-row path
    Raw8<T> wr[RowSteps<T>::value];
    const float v = row_dot1(x, w + (size_t)n * K, K, wr, false);
    if (lane == 0) store_col<T, OUTS>(y, y1, 0, n, N, n0, v);
    return;
  }
  const int tokens = min(TOKENS, M - m0);
  const T* row = w + (size_t)n * K;
  float acc[TOKENS];
#pragma unroll
  for (int t = 0; t < TOKENS; ++t) acc[t] = 0.f;
#pragma unroll 4
  for (int k = lane * 8; k < K; k += 32 * 8) {
    float wf[8];
    load8(row + k, wf);
#pragma unroll
    for (int t = 0; t < TOKENS; ++t) {
      if (t < tokens) {
        float xv[8];
        load8(x + (size_t)(m0 + t) * K + k, xv);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[t] = fmaf(xv[i], wf[i], acc[t]);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < TOKENS; ++t) {
    float v = acc[t];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0 && t < tokens) store_col<T, OUTS>(y, y1, m0 + t, n, N, n0, v);
  }
}

// one row of x through its RMSNorm (nw, eps) into shared memory, then the product; workgroup 0 also writes the
// normalized row to xn
template <typename T, int OUTS>
__device__ void dense_matmul_norm(const T* x, const T* w, const T* nw, T* y, T* y1, T* xn, int K, int N, int n0,
                                  float eps) {
  __shared__ __align__(16) T xs[RMS_NORM_MAX_K];
  const int n = blockIdx.x * WARPS + (threadIdx.x >> 5);
  Raw8<T> wr[RowSteps<T>::value];
  if (n < N) issue_row(w + (size_t)n * K, K, wr);  // the weights do not wait for the prologue
  rms_norm_row<THREADS>(x, nw, eps, K, xs);  // every thread: barriers
  if (blockIdx.x == 0) {
    for (int k = threadIdx.x * 8; k < K; k += THREADS * 8)
      *reinterpret_cast<uint4*>(xn + k) = *reinterpret_cast<const uint4*>(xs + k);
    if (sizeof(T) == 4)  // f32: 8 elements are two 16-byte pieces
      for (int k = threadIdx.x * 8 + 4; k < K; k += THREADS * 8)
        *reinterpret_cast<uint4*>(xn + k) = *reinterpret_cast<const uint4*>(xs + k);
  }
  if (n >= N) return;
  const float v = row_dot1<T>(xs, w + (size_t)n * K, K, wr, true);
  if ((threadIdx.x & 31) == 0) store_col<T, OUTS>(y, y1, 0, n, N, n0, v);
}

#define DENSE(T, el)                                                                                             \
  extern "C" __global__ void __launch_bounds__(THREADS) dense_matmul_##el(const T* x, const T* w, T* y, int m, int k, \
                                                                          int n) {                                 \
    dense_matmul<T, 1>(x, w, y, y, m, k, n, n);                                                                    \
  }                                                                                                                \
  extern "C" __global__ void __launch_bounds__(THREADS) dense_matmul_o2_##el(const T* x, const T* w, T* y0, T* y1,  \
                                                                             int m, int k, int n, int n0) {        \
    dense_matmul<T, 2>(x, w, y0, y1, m, k, n, n0);                                                                 \
  }                                                                                                                \
  extern "C" __global__ void __launch_bounds__(THREADS) dense_matmul_norm_##el(                                    \
      const T* x, const T* w, const T* nw, T* y, T* xn, int m, int k, int n, int eps_bits) {                       \
    dense_matmul_norm<T, 1>(x, w, nw, y, y, xn, k, n, n, __int_as_float(eps_bits));                                \
  }                                                                                                                \
  extern "C" __global__ void __launch_bounds__(THREADS) dense_matmul_norm_o2_##el(                                 \
      const T* x, const T* w, const T* nw, T* y0, T* y1, T* xn, int m, int k, int n, int eps_bits, int n0) {       \
    dense_matmul_norm<T, 2>(x, w, nw, y0, y1, xn, k, n, n0, __int_as_float(eps_bits));                             \
  }
DENSE(__half, f16)
DENSE(float, f32)
