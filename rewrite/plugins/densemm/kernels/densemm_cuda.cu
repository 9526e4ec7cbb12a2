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
#include <cuda_fp16.h>
#include <stdint.h>

#include "../../kernels/cuda_rows.h"  // load8, store

#define THREADS 256  // CUDA_THREADS in op.py
#define WARPS (THREADS / 32)
#define TOKENS 8     // CUDA_TOKENS in op.py

template <typename T>
__device__ void dense_matmul(const T* x, const T* w, T* y, int M, int K, int N) {
  const int lane = threadIdx.x & 31;
  const int n = blockIdx.x * WARPS + (threadIdx.x >> 5);
  const int m0 = blockIdx.y * TOKENS;
  if (n >= N) return;
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
    if (lane == 0 && t < tokens) store(y + (size_t)(m0 + t) * N + n, v);
  }
}

extern "C" __global__ void __launch_bounds__(THREADS) dense_matmul_f16(const __half* x, const __half* w, __half* y,
                                                                       int m, int k, int n) {
  dense_matmul<__half>(x, w, y, m, k, n);
}
extern "C" __global__ void __launch_bounds__(THREADS) dense_matmul_f32(const float* x, const float* w, float* y,
                                                                       int m, int k, int n) {
  dense_matmul<float>(x, w, y, m, k, n);
}
