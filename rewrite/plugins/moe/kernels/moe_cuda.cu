// FusedMoE CUDA kernels for IREE's cuda target (extern dispatches; PTX for sm_80, which sm_90 runs).
//
// IREE CUDA dispatch ABI (samples/custom_dispatch/cuda/kernels in IREE): the bindings' base pointers in binding
// order, then each push constant as a 32-bit integer. Both kernels take the same 10 constants:
//   t, h, i, e, k, bs, flags, alpha_bits, beta_bits, limit_bits
// Layouts and semantics: the contract of ai.rewrite::FusedMoE (rewrite/plugins/moe/lowering.py) and the CPU
// kernels (moe_cpu.c), which these follow step for step:
//   x [T, H], logits [T, E] (ROUTED: weights [T, k]), ids [T, k] i64 (ROUTED), w1 [E, 2I, H] float or INT4 codes
//   two per byte along H (even element in the low nibble), s1/z1 [E, 2I, nb] scales / uint8 zero points (8 when
//   absent), b1 [E, 2I]; w2 [E, H, I], s2/z2 [E, H, nb2], b2 [E, H]; act [T*k, I] f32 scratch; out [T, H].
//
// moe_gate_up_<el>: grid (T*k, ceil(I / GATE_ROWS)), THREADS threads. Warp 0 routes the block's token
// (warp-parallel softmax and top-k, lowest index first on ties) into shared memory; then each warp takes one
// row r of the expert's gate and up halves: lanes read consecutive 16-byte pieces of the packed row (32 codes,
// one block's scale and zero point), dequantize in the dot product (scale * (sum(code * x) - zp * sum(x))),
// reduce by shuffles and apply SwiGLU. The activations are read from global memory through the L1.
// moe_down_<el>: grid (T, ceil(H / DOWN_ROWS)): the same routing, then each warp accumulates
// w_j * (w2[e_j] row . act[t, j] + b2) over the k experts for its row, written once in x's type.
#include <cuda_fp16.h>
#include <stdint.h>

// Alignment: H and I multiples of 8 (the lowering checks), so every 8-value read of x or act is 16-byte aligned.

#define F16 1
#define INT4 2
#define NORMALIZE 4
#define TOPK_SOFTMAX 8
#define ZERO_POINTS 16
#define ROUTED 32
#define BIAS 64

#define MAX_K 64
#define GATE_ROWS 4    // rows of I per gate_up workgroup, one per warp (CUDA_GATE_ROWS in lowering.py)
#define DOWN_ROWS 4    // rows of H per down workgroup (CUDA_DOWN_ROWS in lowering.py)
#define THREADS 128    // 4 warps per workgroup (CUDA_THREADS in lowering.py)
#define WARPS (THREADS / 32)
#define MAX_E 512      // largest expert count: the router's logits, f32 in shared memory

__device__ __forceinline__ float ld(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float ld(const __half* p, long long i) { return __half2float(p[i]); }
__device__ __forceinline__ void st(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void st(__half* p, long long i, float v) { p[i] = __float2half_rn(v); }
__device__ __forceinline__ float bits(int b) { return __int_as_float(b); }

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Warp 0 routes token t into ids / w (shared); every thread returns after the barrier. Softmax over E in f32,
// top-k by value with the lowest index first on ties; TOPK_SOFTMAX and NORMALIZE divide by the sum over the k.
template <typename T>
__device__ void route(const T* __restrict__ logits, const long long* __restrict__ given, int t, int E, int K,
                      int flags, long long* ids, float* w, float* scratch) {
  __shared__ unsigned char taken[MAX_E];
  if (threadIdx.x < 32) {
    int lane = threadIdx.x;
    if (flags & ROUTED) {
      for (int j = lane; j < K; j += 32) {
        long long e = given[(long long)t * K + j];
        bool ok = e >= 0 && e < E;
        ids[j] = ok ? e : -1;
        w[j] = ok ? ld(logits, (long long)t * K + j) : 0.f;
      }
    } else {
      float mx = -INFINITY;
      for (int e = lane; e < E; e += 32) {
        float v = ld(logits, (long long)t * E + e);
        scratch[e] = v;
        taken[e] = 0;
        mx = fmaxf(mx, v);
      }
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      __syncwarp();
      float den = 0.f;
      for (int e = lane; e < E; e += 32) den += __expf(scratch[e] - mx);
      den = warp_sum(den);
      float sel = 0.f;
      for (int j = 0; j < K; ++j) {
        float bv = -INFINITY;
        int bi = -1;  // none yet: -inf logits are still candidates, NaN ones never are
        for (int e = lane; e < E; e += 32) {
          float v = scratch[e];
          if (!taken[e] && v == v && (bi < 0 || v > bv)) bv = v, bi = e;  // ascending e: the lowest index wins ties
        }
        for (int o = 16; o > 0; o >>= 1) {
          float ov = __shfl_xor_sync(0xffffffffu, bv, o);
          int oi = __shfl_xor_sync(0xffffffffu, bi, o);
          if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) bv = ov, bi = oi;
        }
        float p = bi >= 0 ? __expf(bv - mx) : 0.f;
        if (lane == 0) {
          ids[j] = bi;  // -1 (contributes nothing) only when fewer than k logits are numbers
          w[j] = p;
        }
        sel += p;
        if (bi >= 0 && lane == (bi & 31)) taken[bi] = 1;
        __syncwarp();
      }
      float d = (flags & (NORMALIZE | TOPK_SOFTMAX)) ? sel : den;
      for (int j = lane; j < K; j += 32) w[j] /= d;
    }
  }
  __syncthreads();
}

__device__ __forceinline__ void load8(const float* __restrict__ v, int c, float* o) {  // 8 values, 32-byte aligned
  float4 a = __ldg((const float4*)(v + c)), b = __ldg((const float4*)(v + c + 4));
  o[0] = a.x, o[1] = a.y, o[2] = a.z, o[3] = a.w, o[4] = b.x, o[5] = b.y, o[6] = b.z, o[7] = b.w;
}
__device__ __forceinline__ void load8(const __half* __restrict__ v, int c, float* o) {  // 16-byte aligned
  uint4 a = __ldg((const uint4*)(v + c));
  const __half2* h = (const __half2*)&a;
#pragma unroll
  for (int n = 0; n < 4; ++n) {
    float2 f = __half22float2(h[n]);
    o[2 * n] = f.x, o[2 * n + 1] = f.y;
  }
}

// Lane-parallel dot of row `row` of a [*, N, Kd] weight with the vector v (global, read through the L1: every
// warp of the block reads the same one); full sum on every lane. INT4 rows with Kd and bs multiples of 32 are
// read 16 bytes (32 codes) per lane per load, two loads in flight; others 4 bytes (8 codes) at a time.
template <typename T, typename V>
__device__ float row_dot(const void* __restrict__ w, const T* __restrict__ s, const uint8_t* __restrict__ z,
                         long long row, int Kd, int bs, int flags, const V* __restrict__ v) {
  int lane = threadIdx.x & 31;
  float acc = 0.f;
  if (!(flags & INT4)) {
    const T* p = (const T*)w + row * Kd;
    for (int c = lane; c < Kd; c += 32) acc += ld(p, c) * ld(v, c);
    return warp_sum(acc);
  }
  int nb = (Kd + bs - 1) / bs;
  const uint8_t* base = (const uint8_t*)w + row * (Kd / 2);
  const T* srow = s + row * nb;
  const uint8_t* zrow = (flags & ZERO_POINTS) ? z + row * nb : nullptr;
  float xs[8];
  if (Kd % 32 == 0 && bs % 32 == 0) {
    const uint4* p = (const uint4*)base;
#pragma unroll 2
    for (int q = lane; q < Kd / 32; q += 32) {
      uint4 wv = __ldg(p + q);
      const uint32_t words[4] = {wv.x, wv.y, wv.z, wv.w};
      float dot = 0.f, vs = 0.f;
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        load8(v, 32 * q + 8 * m, xs);
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          dot += (float)((words[m] >> (4 * n)) & 15u) * xs[n];
          vs += xs[n];
        }
      }
      int b = (32 * q) / bs;
      float zp = zrow ? (float)zrow[b] : 8.f;
      acc += ld(srow, b) * (dot - zp * vs);
    }
    return warp_sum(acc);
  }
  const uint32_t* p = (const uint32_t*)base;
  for (int q = lane; q < Kd / 8; q += 32) {  // 8 codes per 32-bit word, one block's (bs % 8 == 0)
    uint32_t word = __ldg(p + q);
    load8(v, 8 * q, xs);
    float dot = 0.f, vs = 0.f;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      dot += (float)((word >> (4 * n)) & 15u) * xs[n];
      vs += xs[n];
    }
    int b = (8 * q) / bs;
    float zp = zrow ? (float)zrow[b] : 8.f;
    acc += ld(srow, b) * (dot - zp * vs);
  }
  return warp_sum(acc);
}

template <typename T>
__device__ void gate_up(const T* __restrict__ x, const T* __restrict__ logits, const long long* __restrict__ given,
                        const void* __restrict__ w1, const T* __restrict__ s1, const uint8_t* __restrict__ z1,
                        const T* __restrict__ b1, float* __restrict__ act, int H, int I, int E, int K, int bs,
                        int flags, int alpha_b, int beta_b, int limit_b) {
  __shared__ float scratch[MAX_E], w[MAX_K];
  __shared__ long long ids[MAX_K];
  int pair = blockIdx.x, t = pair / K, j = pair % K;
  route(logits, given, t, E, K, flags, ids, w, scratch);
  const T* xv = x + (long long)t * H;
  long long e = ids[j];
  float alpha = bits(alpha_b), beta = bits(beta_b), limit = bits(limit_b);
  int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  for (int r = blockIdx.y * GATE_ROWS + warp; r < min(I, (int)(blockIdx.y + 1) * GATE_ROWS); r += WARPS) {
    float out = 0.f;
    if (e >= 0) {
      float g = row_dot(w1, s1, z1, e * 2 * I + r, H, bs, flags, xv);
      float u = row_dot(w1, s1, z1, e * 2 * I + I + r, H, bs, flags, xv);
      if (flags & BIAS) {
        g += ld(b1, e * 2 * I + r);
        u += ld(b1, e * 2 * I + I + r);
      }
      if (limit > 0.f) {
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
      }
      out = g / (1.f + __expf(-alpha * g)) * (u + beta);
    }
    if (lane == 0) act[(long long)pair * I + r] = out;
  }
}

template <typename T>
__device__ void down(const T* __restrict__ logits, const long long* __restrict__ given, const float* __restrict__ act,
                     const void* __restrict__ w2, const T* __restrict__ s2, const uint8_t* __restrict__ z2,
                     const T* __restrict__ b2, T* __restrict__ out, int H, int I, int E, int K, int bs, int flags) {
  __shared__ float scratch[MAX_E], w[MAX_K];
  __shared__ long long ids[MAX_K];
  int t = blockIdx.x;
  route(logits, given, t, E, K, flags, ids, w, scratch);
  int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  for (int r = blockIdx.y * DOWN_ROWS + warp; r < min(H, (int)(blockIdx.y + 1) * DOWN_ROWS); r += WARPS) {
    float acc = 0.f;
    for (int j = 0; j < K; ++j) {
      long long e = ids[j];
      if (e < 0) continue;
      float d = row_dot(w2, s2, z2, e * H + r, I, bs, flags, act + ((long long)t * K + j) * I);
      if (flags & BIAS) d += ld(b2, e * H + r);
      acc += w[j] * d;
    }
    if (lane == 0) st(out, (long long)t * H + r, acc);
  }
}

#define GATE_UP(name, T)                                                                                        \
  extern "C" __global__ void __launch_bounds__(THREADS) name(                                                  \
      const T* x, const T* logits, const long long* given, const void* w1, const T* s1, const uint8_t* z1,      \
      const T* b1, float* act, int t, int H, int I, int E, int K, int bs, int flags, int alpha_b, int beta_b,   \
      int limit_b) {                                                                                             \
    (void)t;                                                                                                    \
    gate_up(x, logits, given, w1, s1, z1, b1, act, H, I, E, K, bs, flags, alpha_b, beta_b, limit_b);           \
  }
#define DOWN(name, T)                                                                                           \
  extern "C" __global__ void __launch_bounds__(THREADS) name(                                                  \
      const T* logits, const long long* given, const float* act, const void* w2, const T* s2, const uint8_t* z2, \
      const T* b2, T* out, int t, int H, int I, int E, int K, int bs, int flags, int alpha_b, int beta_b,       \
      int limit_b) {                                                                                             \
    (void)t, (void)alpha_b, (void)beta_b, (void)limit_b;                                                        \
    down(logits, given, act, w2, s2, z2, b2, out, H, I, E, K, bs, flags);                                      \
  }

GATE_UP(moe_gate_up_f32, float)
GATE_UP(moe_gate_up_f16, __half)
DOWN(moe_down_f32, float)
DOWN(moe_down_f16, __half)
