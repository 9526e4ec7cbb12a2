// MatMulInt4 CUDA kernel for IREE's cuda target (extern dispatch; PTX for sm_80, which sm_90 runs).
//
// IREE CUDA dispatch ABI (samples/custom_dispatch/cuda/kernels in IREE): the bindings' base pointers in binding
// order, then each push constant as a 32-bit integer: m, k, n, bs, has_zp, n0, n1, add_mode.
// Layouts: the contract of ai.rewrite::MatMulInt4 (rewrite/plugins/matmul4/op.py):
//   x [M, K] float (f32 or f16), w [N, K/2] uint8: INT4 codes two per byte along K, even element in the low
//   nibble (ORT MatMulNBits / QMoE packing), s [N, nb] x's type, z [N, nb] uint8 zero points (8 when has_zp is
//   0), y [M, N] x's type: y[m, n] = sum_k x[m, k] * (code[n, k] - z[n, k / bs]) * s[n, k / bs], summed in f32
//   (the *_t1 fast path below: products and sums of 4 in half2 first).
//   Y's columns go to OUTS outputs (the op's ``splits``): y0 [M, n0] takes columns 0 .. n0 - 1, y1 [M, n1] the
//   next n1, y2 [M, N - n0 - n1] the rest (kernels *_o2 and *_o3; the one-output kernel ignores n0 and n1).
//   Output i may add an addend a_i after rounding to x's type (the ONNX Add the ``output-add`` rule fused):
//   bits 2i..2i+1 of add_mode say how: 0 none (a_i is a dummy), 1 a_i [width_i] (a bias, the same for each row),
//   2 a_i [M, width_i] (a residual).
//   The *_swiglu kernels (the ``swiglu`` rule): w holds the gate's N/2 rows then the up projection's, and
//   y [M, N/2] = silu(gate) * up, each step rounded to x's type as the ONNX Sigmoid, Mul, Mul it replaces;
//   no addends (add_mode 0).
//   The *_norm kernels (the ``rms-norm-prologue`` rule; one row of x, K <= RMS_NORM_MAX_K) take x before its
//   RMSNorm: one more binding, the norm's weight nw [K] (after z), and a ninth push constant, the epsilon's float32
//   bits; the workgroup first normalizes the row into shared memory, round(round(x / sqrt(mean_k(x * x) + eps)) *
//   nw[k]) (ai.rewrite::RMSNorm's contract, the arithmetic of rewrite/plugins/rmsnorm/kernels/rmsnorm_cuda.cu; its
//   sum of squares in another order), and its loop reads it from there.
//
// Grid (ceil(N / WARPS), ceil(M / TOKENS)) (N / 2 for *_swiglu), THREADS threads: warp w of workgroup (i, j)
// computes output column n = i * WARPS + w for tokens j * TOKENS .. + TOKENS - 1 (with *_swiglu from weight rows n
// and n + N / 2), so the weight row is read once per TOKENS tokens and a decode step (M = 1) reads each weight byte
// once, dequantized inside the dot product (seed 000, "warp-per-row matvec"). Each lane takes VEC consecutive
// codes of the row per step (VEC = 32: one 16-byte load, when K and the block size are multiples of 32; else
// VEC = 8: one 4-byte load, K and the block size multiples of 8, which the lowering checks), so a step's codes
// share one block's scale and zero point.
//
// Fast path of the *_t1 kernels for f16 with VEC = 32 and K <= STAGE_MAX_K (decode's one row): each warp issues
// the loads of its row's first pieces, then the workgroup stages x (normalized, for *_norm) once in shared memory
// as half2 and the dot products read it from there: rewrite/plugins/kernels/cuda_int4.h (the FusedMoE kernels'
// arithmetic: half2 products of the codes minus their zero point, sums of 4 in half2, then f32).
#include <cuda_fp16.h>
#include <stdint.h>

#include "../../kernels/cuda_int4.h"  // stage_group, dot_rows, Chunk, load_chunk, VEC_SCALE
#include "../../kernels/cuda_rows.h"  // load8, store, to_f, rounded, rms_norm_row

#define THREADS 256  // CUDA_THREADS in op.py
#define WARPS (THREADS / 32)
#define STAGE_MAX_K 8192  // fast path: the longest row of x staged as half2 (16 KB of shared memory)
// TOKENS rows of A per workgroup: 8 (CUDA_TOKENS in op.py), or 1 in the *_t1 kernels for a one-row A (decode),
// whose 8 accumulators fewer leave registers for more warps in flight (sm_90: 76 registers a thread with 8)

template <typename T>
struct IsHalf {
  static constexpr bool value = false;
};
template <>
struct IsHalf<__half> {
  static constexpr bool value = true;
};

// VEC / 8 words of 8 codes each; code i of a word sits at bits 4i.
template <int VEC>
__device__ __forceinline__ void load_codes(const uint8_t* p, uint32_t* words) {
  if (VEC == 32) {
    uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    words[0] = v.x, words[1] = v.y, words[2] = v.z, words[3] = v.w;
  } else {
    words[0] = __ldg(reinterpret_cast<const uint32_t*>(p));
  }
}

// Output column n of row m, v[ROWS] the column's sums (summed over the warp): the output holding it, its addend or
// the SwiGLU of the gate and up sums (see the header).
template <typename T, int OUTS, int ROWS>
__device__ __forceinline__ void store_column(const float (&v)[ROWS], const T* x, const T* a0, const T* a1,
                                             const T* a2, T* y0, T* y1, T* y2, int m, int n, int N, int n0, int n1,
                                             int add_mode) {
  const int cols = N / ROWS;
  T* y = y0;  // the output holding column n, its column there, its width and its addend
  const T* a = a0;
  int col = n, width = OUTS == 1 ? cols : n0, out = 0;
  if (OUTS > 1 && n >= n0) {
    const bool second = OUTS == 2 || n < n0 + n1;
    y = second ? y1 : y2;
    a = second ? a1 : a2;
    out = second ? 1 : 2;
    col = second ? n - n0 : n - n0 - n1;
    width = OUTS == 2 ? N - n0 : (second ? n1 : N - n0 - n1);
  }
  const int mode = (add_mode >> (2 * out)) & 3;
  const size_t at = (size_t)m * width + col;
  if (ROWS == 2) {  // silu(gate) * up as Sigmoid, Mul, Mul: each result rounded to T
    const float gate = rounded(v[0], x), up = rounded(v[ROWS - 1], x);
    const float sig = rounded(1.f / (1.f + expf(-gate)), x);
    store(y + at, rounded(gate * sig, x) * up);
  } else if (mode == 0) {
    store(y + at, v[0]);
  } else {  // the product rounded to T, then the Add
    store(y + at, rounded(v[0], x) + to_f(a[mode == 1 ? col : at]));
  }
}

// The *_t1 fast path (see the header): f16, K % 32 == 0, bs % 32 == 0, K <= STAGE_MAX_K; one row of x. A warp's
// pieces go U at a time (4 for one weight row, 2 for the gate and up rows of *_swiglu).
template <int OUTS, int ROWS, bool NORM>
__device__ void matmul_int4_t1_f16(const __half* x, const uint8_t* w, const __half* s, const uint8_t* z,
                                   const __half* nw, const __half* a0, const __half* a1, const __half* a2, __half* y0,
                                   __half* y1, __half* y2, int K, int N, int bs, int has_zp, int n0, int n1,
                                   int add_mode, float eps) {
  constexpr int U = ROWS == 1 ? 4 : 2;
  __shared__ __align__(16) __half2 xsh[STAGE_MAX_K / 2];
  const int lane = threadIdx.x & 31, cols = N / ROWS;
  const int n = blockIdx.x * WARPS + (threadIdx.x >> 5);
  const int nq = K / 32, nb = (K + bs - 1) / bs;
  const uint8_t* rows[ROWS];
  const __half* srow[ROWS];
  const uint8_t* zrow[ROWS];
  bool live[ROWS];
  const __half2* vec[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const size_t row = n < cols ? (size_t)n + r * cols : 0;
    rows[r] = w + row * (K / 2);
    srow[r] = s + row * nb;
    zrow[r] = has_zp ? z + row * nb : nullptr;
    live[r] = n < cols;
    vec[r] = xsh;
  }
  Chunk<ROWS, U> c;
  load_chunk(c, rows, srow, zrow, live, nq, bs, lane);  // the weights do not wait for x
  if constexpr (NORM) {
    const float den = rms_denominator<THREADS>(x, K, eps);  // every thread: a barrier
    for (int g = threadIdx.x; g < K / 8; g += THREADS) {
      float v[8], gw[8];
      load8(x + 8 * g, v);
      load8(nw + 8 * g, gw);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = rms_normed(v[i], den, gw[i], x);
      stage_group(xsh, nq, g, v);
    }
  } else {
    for (int g = threadIdx.x; g < K / 8; g += THREADS) {
      float v[8];
      load8(x + 8 * g, v);
      stage_group(xsh, nq, g, v);
    }
  }
  __syncthreads();
  if (n >= cols) return;
  float acc[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
  dot_rows<ROWS, U, true>(rows, srow, zrow, live, K, bs, vec, acc, c, true);
  float v[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    v[r] = acc[r];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v[r] += __shfl_xor_sync(0xffffffffu, v[r], o);
    v[r] *= 1.f / VEC_SCALE;
  }
  if (lane == 0) store_column<__half, OUTS, ROWS>(v, x, a0, a1, a2, y0, y1, y2, 0, n, N, n0, n1, add_mode);
}

// ROWS = 1: output column n is weight row n. ROWS = 2 (*_swiglu): rows n (gate) and n + N / 2 (up).
// NORM: x is the RMSNorm's input (one row: TOKENS = 1), nw its weight (the *_norm kernels).
template <typename T, int VEC, int OUTS, int TOKENS, int ROWS, bool NORM>
__device__ void matmul_int4(const T* x, const uint8_t* w, const T* s, const uint8_t* z, const T* nw, const T* a0,
                            const T* a1, const T* a2, T* y0, T* y1, T* y2, int M, int K, int N, int bs, int has_zp,
                            int n0, int n1, int add_mode, float eps) {
  if constexpr (IsHalf<T>::value && VEC == 32 && TOKENS == 1) {
    if (K <= STAGE_MAX_K && bs % 32 == 0) {
      matmul_int4_t1_f16<OUTS, ROWS, NORM>(x, w, s, z, nw, a0, a1, a2, y0, y1, y2, K, N, bs, has_zp, n0, n1,
                                           add_mode, eps);
      return;
    }
  }
  const int lane = threadIdx.x & 31;
  const int cols = N / ROWS;
  const int n = blockIdx.x * WARPS + (threadIdx.x >> 5);
  const int m0 = blockIdx.y * TOKENS;
  static_assert(!NORM || TOKENS == 1, "the RMSNorm prologue normalizes one row");
  if constexpr (NORM) {  // every thread: barriers; then x is the normalized row in shared memory
    __shared__ __align__(16) T xs[RMS_NORM_MAX_K];
    rms_norm_row<THREADS>(x + (size_t)m0 * K, nw, eps, K, xs);
    x = xs - (size_t)m0 * K;
  }
  if (n >= cols) return;
  const int tokens = min(TOKENS, M - m0);
  const int nb = (K + bs - 1) / bs;
  float acc[ROWS][TOKENS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int t = 0; t < TOKENS; ++t) acc[r][t] = 0.f;
#pragma unroll 2
  for (int k = lane * VEC; k < K; k += 32 * VEC) {
    uint32_t words[ROWS][VEC / 8];
    float scale[ROWS], shift[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int row = n + r * cols;
      load_codes<VEC>(w + (size_t)row * (K / 2) + k / 2, words[r]);
      const int b = row * nb + k / bs;
      scale[r] = to_f(s[b]);
      shift[r] = -(has_zp ? (float)z[b] : 8.f) * scale[r];  // (code - zp) * scale = code * scale + shift
    }
#pragma unroll
    for (int g = 0; g < VEC / 8; ++g) {
      float wf[ROWS][8];
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int i = 0; i < 8; ++i) wf[r][i] = fmaf((float)((words[r][g] >> (4 * i)) & 15u), scale[r], shift[r]);
#pragma unroll
      for (int t = 0; t < TOKENS; ++t) {
        if (t < tokens) {
          float xv[8];
          load8(x + (size_t)(m0 + t) * K + k + 8 * g, xv);
#pragma unroll
          for (int r = 0; r < ROWS; ++r)
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[r][t] = fmaf(xv[i], wf[r][i], acc[r][t]);
        }
      }
    }
  }
#pragma unroll
  for (int t = 0; t < TOKENS; ++t) {
    float v[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      v[r] = acc[r][t];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v[r] += __shfl_xor_sync(0xffffffffu, v[r], o);
    }
    if (lane == 0 && t < tokens) store_column<T, OUTS, ROWS>(v, x, a0, a1, a2, y0, y1, y2, m0 + t, n, N, n0, n1, add_mode);
  }
}

#define PARAMS(T) const T *x, const uint8_t *w, const T *s, const uint8_t *z
#define CONSTS int m, int k, int n, int bs, int has_zp, int n0, int n1, int add_mode
#define CALL(T, VEC, OUTS, TOK, ROWS, NORM, nw, a0, a1, a2, y0, y1, y2, mode, eps)                               \
  matmul_int4<T, VEC, OUTS, TOK, ROWS, NORM>(x, w, s, z, nw, a0, a1, a2, y0, y1, y2, m, k, n, bs, has_zp, n0, n1,  \
                                             mode, eps)
#define KERNELS(name, T, VEC, TOK)                                                                                 \
  extern "C" __global__ void __launch_bounds__(THREADS) name(PARAMS(T), const T* a0, T* y0, CONSTS) {             \
    CALL(T, VEC, 1, TOK, 1, false, nullptr, a0, nullptr, nullptr, y0, nullptr, nullptr, add_mode, 0.f);           \
  }                                                                                                                \
  extern "C" __global__ void __launch_bounds__(THREADS)                                                            \
      name##_o2(PARAMS(T), const T* a0, const T* a1, T* y0, T* y1, CONSTS) {                                      \
    CALL(T, VEC, 2, TOK, 1, false, nullptr, a0, a1, nullptr, y0, y1, nullptr, add_mode, 0.f);                      \
  }                                                                                                                \
  extern "C" __global__ void __launch_bounds__(THREADS)                                                            \
      name##_o3(PARAMS(T), const T* a0, const T* a1, const T* a2, T* y0, T* y1, T* y2, CONSTS) {                  \
    CALL(T, VEC, 3, TOK, 1, false, nullptr, a0, a1, a2, y0, y1, y2, add_mode, 0.f);                                \
  }                                                                                                                \
  extern "C" __global__ void __launch_bounds__(THREADS) name##_swiglu(PARAMS(T), const T* a0, T* y0, CONSTS) {    \
    CALL(T, VEC, 1, TOK, 2, false, nullptr, a0, nullptr, nullptr, y0, nullptr, nullptr, 0, 0.f);                  \
  }
// with the RMSNorm prologue: one-row kernels only (decode; the lowering runs a longer A's norm as a dispatch of its own)
#define NORM_KERNELS(name, T, VEC, TOK)                                                                            \
  extern "C" __global__ void __launch_bounds__(THREADS)                                                            \
      name##_norm(PARAMS(T), const T* nw, const T* a0, T* y0, CONSTS, int eps_bits) {                             \
    CALL(T, VEC, 1, TOK, 1, true, nw, a0, nullptr, nullptr, y0, nullptr, nullptr, add_mode, __int_as_float(eps_bits)); \
  }                                                                                                                \
  extern "C" __global__ void __launch_bounds__(THREADS)                                                            \
      name##_o2_norm(PARAMS(T), const T* nw, const T* a0, const T* a1, T* y0, T* y1, CONSTS, int eps_bits) {      \
    CALL(T, VEC, 2, TOK, 1, true, nw, a0, a1, nullptr, y0, y1, nullptr, add_mode, __int_as_float(eps_bits));       \
  }                                                                                                                \
  extern "C" __global__ void __launch_bounds__(THREADS) name##_o3_norm(                                            \
      PARAMS(T), const T* nw, const T* a0, const T* a1, const T* a2, T* y0, T* y1, T* y2, CONSTS, int eps_bits) {  \
    CALL(T, VEC, 3, TOK, 1, true, nw, a0, a1, a2, y0, y1, y2, add_mode, __int_as_float(eps_bits));                 \
  }                                                                                                                \
  extern "C" __global__ void __launch_bounds__(THREADS)                                                            \
      name##_swiglu_norm(PARAMS(T), const T* nw, const T* a0, T* y0, CONSTS, int eps_bits) {                      \
    CALL(T, VEC, 1, TOK, 2, true, nw, a0, nullptr, nullptr, y0, nullptr, nullptr, 0, __int_as_float(eps_bits));   \
  }

KERNELS(matmul_int4_f16_v32, __half, 32, 8)
KERNELS(matmul_int4_f16_v8, __half, 8, 8)
KERNELS(matmul_int4_f32_v32, float, 32, 8)
KERNELS(matmul_int4_f32_v8, float, 8, 8)
KERNELS(matmul_int4_f16_v32_t1, __half, 32, 1)
KERNELS(matmul_int4_f16_v8_t1, __half, 8, 1)
KERNELS(matmul_int4_f32_v32_t1, float, 32, 1)
KERNELS(matmul_int4_f32_v8_t1, float, 8, 1)
NORM_KERNELS(matmul_int4_f16_v32_t1, __half, 32, 1)
NORM_KERNELS(matmul_int4_f16_v8_t1, __half, 8, 1)
NORM_KERNELS(matmul_int4_f32_v32_t1, float, 32, 1)
NORM_KERNELS(matmul_int4_f32_v8_t1, float, 8, 1)
