// FusedMoE CUDA kernels for IREE's cuda target (extern dispatches; PTX for sm_80, which sm_90 runs).
//
// IREE CUDA dispatch ABI (samples/custom_dispatch/cuda/kernels in IREE): the bindings' base pointers in binding
// order, then each push constant as a 32-bit integer. The kernels take the same 10 constants:
//   t, h, i, e, k, bs, flags, alpha_bits, beta_bits, limit_bits
// (moe_fused also gy1, gy2: the row blocks per token of each half, and its dispatch site's counter slot).
// moe_gate_up_mma<S>_f16 / moe_down_mma<S>_f16 are the same pair on the tensor cores for f16 INT4 blocks of 128
// (the lowering's choice where its shape allows; the last section of this file), with the same bindings;
// moe_down_mma<S>t1_f16 is that down for a graph of one token (decode).
// moe_fused_<el> is both halves in one launch (the lowering's choice with moe.launches=1; see fused() below):
// bindings x, logits, ids, w1, s1, z1, b1, w2, s2, z2, b2, shared, gate, out, act. moe_gate_up_<el> then moe_down_<el> are the same work in
// two launches (down's bindings: logits, ids, act, w2, s2, z2, b2, shared, gate, out).
// Layouts and semantics: the contract of ai.rewrite::FusedMoE (rewrite/plugins/moe/lowering.py) and the CPU
// kernels (moe_cpu.c), which these follow step for step:
//   x [T, H], logits [T, E] (ROUTED: weights [T, k]), ids [T, k] i64 (ROUTED), w1 [E, 2I, H] float or INT4 codes
//   two per byte along H (even element in the low nibble), s1/z1 [E, 2I, nb] scales / uint8 zero points (8 when
//   absent), b1 [E, 2I]; w2 [E, H, I], s2/z2 [E, H, nb2], b2 [E, H]; act [T*k*I + 2*T*k] f32 scratch (the act
//   rows, then the routing: see moe_gate_up); out [T, H] (flag ADDEND: it holds the addend on entry, tied in
//   place, and the sum on exit).
//
// moe_gate_up_<el>: grid (T, ceil(I / rows)), THREADS threads; rows = ceil(I / gridDim.y) (the lowering picks
// the grid). Warp 0 routes the block's token into shared memory, once for all k experts (softmax, then top-k with
// the warp's max/min reductions: lowest index first on ties); the block's items are (expert j, row r) pairs, each
// the gate and up rows r of expert e_j, then SwiGLU into act[t*k + j, r]. The blocks of row block 0 also write
// the token's routing behind the act rows: act[T*k*I + 2*k*t + j] = w_j, [.. + k + j] = e_j (int bits).
// moe_down_<el>: grid (T, ceil(H / rows)): each warp reads its token's routing from behind the act rows (no
// routing again), then per row r of H the sum over the k experts of w_j * (w2[e_j] row r . act[t, j] + b2),
// written once in x's type (ADDEND: rounded to it, plus the addend, rounded again).
//
// Fast path (f16 activations, INT4 weights, H, I and the block size multiples of 32, the vectors within the
// shared stages): the vector (x, or the k act rows) is staged once per workgroup in shared memory as half2, and the
// rows' 16-byte pieces are dotted with it as rewrite/plugins/kernels/cuda_int4.h describes (half2 products of the
// codes minus their zero point, piece-major staging). Each lane reads 16 bytes (32 codes) of a row per load.
// gate_up: a warp works on the gate
// and up rows of GATE_PAIRS items with one vector read, all their loads in flight at once. down: a warp takes
// one row of H for all k experts at once, the k * I / 32 pieces spread over its lanes (up to DOWN_LOADS per lane
// in flight), issued before the act rows are staged, so the staging hides behind the weight loads. Products and
// sums of 4 are in half2 (codes minus zero point are exact), the rest in f32. Other configurations take the
// general path: one row per warp, f32 arithmetic.
#include <cuda_fp16.h>
#include <stdint.h>

#include "../../kernels/cuda_int4.h"  // VEC_SCALE, stage_group, staged_piece, dot32, Chunk, load_chunk, dot_rows

// Alignment: H and I multiples of 8 (the lowering checks), so every 8-value read of x or act is 16-byte aligned.

#define F16 1
#define INT4 2
#define NORMALIZE 4
#define TOPK_SOFTMAX 8
#define ZERO_POINTS 16
#define ROUTED 32
#define BIAS 64
#define ADDEND 128
#define SHARED 256

#define MAX_K 64
#define THREADS 256    // 8 warps per workgroup (CUDA_THREADS in lowering.py)
#define WARPS (THREADS / 32)
#define MAX_E 512      // largest expert count: the router holds E / 32 logits per lane
#define MAX_XH 8192    // fast path: largest H (x staged as half in shared memory)
#define MAX_ACT 16384  // fast path: largest k * I (the token's act rows staged as half)
#ifndef GATE_PAIRS
#define GATE_PAIRS 1   // gate_up: items (gate and up rows of one expert) per warp per pass
#endif
#ifndef GATE_MIN_BLOCKS
#define GATE_MIN_BLOCKS 3  // gate_up: __launch_bounds__ minimum of resident workgroups per SM (80 registers)
#endif
#ifndef DOWN_LOADS
#define DOWN_LOADS 8   // down: 16-byte pieces per lane in flight
#endif

__device__ __forceinline__ float ld(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float ld(const __half* p, long long i) { return __half2float(p[i]); }
__device__ __forceinline__ void st(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void st(__half* p, long long i, float v) { p[i] = __float2half_rn(v); }
__device__ __forceinline__ float rnd(const float*, float v) { return v; }
__device__ __forceinline__ float rnd(const __half*, float v) { return __half2float(__float2half_rn(v)); }
// down's store of row i of token t: with SHARED, plus the gated shared expert, round(round(v) +
// round(round(sigmoid(gate[t])) * shared[i])); with ADDEND, out holds the addend (the residual, tied in place) and
// gets round(round(v) + addend): each step rounded as the ONNX Sigmoid, Mul and Adds after the block compute it
template <typename T>
__device__ __forceinline__ void st_out(T* out, long long i, float v, int flags, const T* shared, const T* gate,
                                       long long t) {
  if (flags & SHARED) v = rnd(out, v) + rnd(out, rnd(out, 1.f / (1.f + expf(-ld(gate, t)))) * ld(shared, i));
  if (flags & ADDEND) v = rnd(out, v) + ld(out, i);
  st(out, i, v);
}
__device__ __forceinline__ float bits(int b) { return __int_as_float(b); }

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// A float's order as an unsigned key (larger float, larger key; -0 and +0 one key, so they tie as values do);
// NaN is 0, below every number, -inf included.
__device__ __forceinline__ unsigned order_key(float v) {
  unsigned b = v == 0.f ? 0u : __float_as_uint(v);
  return v != v ? 0u : (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key_value(unsigned k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// One warp (lane = threadIdx.x & 31) routes token t from its logits: softmax over E in f32, then top-k by value
// with the lowest index first on ties: per round the warp's max key, then the lowest index that holds it, one
// reduction each; only the lane that gave up its value scans its NM values again. NM = logits per lane, E <= 32 NM.
template <int NM, typename T>
__device__ void route_logits(const T* __restrict__ logits, int t, int E, int K, int flags, long long* ids, float* w) {
  int lane = threadIdx.x & 31;
  unsigned key[NM];
  float mx = -INFINITY;
#pragma unroll
  for (int m = 0; m < NM; ++m) {
    int e = lane + 32 * m;
    float v = e < E ? ld(logits, (long long)t * E + e) : NAN;
    key[m] = order_key(v);
    mx = fmaxf(mx, v);
  }
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float den = 0.f;
  bool nan = false;
#pragma unroll
  for (int m = 0; m < NM; ++m) {
    if (key[m]) den += __expf(key_value(key[m]) - mx);
    nan |= lane + 32 * m < E && !key[m];
  }
  den = warp_sum(den);
  if (__any_sync(0xffffffffu, nan)) den = NAN;  // a NaN logit makes the softmax NaN, as the reference's
  unsigned best = 0u;
  int bi = 0x7fffffff;
#pragma unroll
  for (int m = 0; m < NM; ++m)
    if (key[m] > best) best = key[m], bi = lane + 32 * m;  // ascending e: the lowest index wins ties
  float sel = 0.f;
  for (int j = 0; j < K; ++j) {
    unsigned top = __reduce_max_sync(0xffffffffu, best);
    int win = (int)__reduce_min_sync(0xffffffffu, (unsigned)(best == top && top ? bi : 0x7fffffff));
    float p = top ? __expf(key_value(top) - mx) : 0.f;
    if (!top) win = -1;  // fewer than k logits are numbers: contributes nothing
    if (lane == 0) ids[j] = win, w[j] = p;
    sel += p;
    if (win == bi) {  // this lane's best was taken: drop it, scan again
      best = 0u, bi = 0x7fffffff;
#pragma unroll
      for (int m = 0; m < NM; ++m) {
        if (lane + 32 * m == win) key[m] = 0u;
        if (key[m] > best) best = key[m], bi = lane + 32 * m;
      }
    }
  }
  __syncwarp();
  float d = (flags & (NORMALIZE | TOPK_SOFTMAX)) ? sel : den;
  for (int j = lane; j < K; j += 32) w[j] /= d;
}

// The calling warp routes token t into ids / w (its own, shared), as route() below says; no barrier.
template <typename T>
__device__ __forceinline__ void route_warp(const T* __restrict__ logits, const long long* __restrict__ given, int t,
                                           int E, int K, int flags, long long* ids, float* w) {
  int lane = threadIdx.x & 31;
#ifdef NO_ROUTE  // as in route()
  for (int j = lane; j < K; j += 32) ids[j] = j, w[j] = 1.f / K;
  __syncwarp();
  return;
#endif
  if (flags & ROUTED) {
    for (int j = lane; j < K; j += 32) {
      long long e = given[(long long)t * K + j];
      bool ok = e >= 0 && e < E;
      ids[j] = ok ? e : -1;
      w[j] = ok ? ld(logits, (long long)t * K + j) : 0.f;
    }
  } else if (E <= 32) {
    route_logits<1>(logits, t, E, K, flags, ids, w);
  } else if (E <= 64) {
    route_logits<2>(logits, t, E, K, flags, ids, w);
  } else if (E <= 128) {
    route_logits<4>(logits, t, E, K, flags, ids, w);
  } else if (E <= 256) {
    route_logits<8>(logits, t, E, K, flags, ids, w);
  } else {
    route_logits<MAX_E / 32>(logits, t, E, K, flags, ids, w);
  }
  __syncwarp();
}

// Warp 0 routes token t into ids / w (shared); every thread returns after the barrier. Logits: route_logits, with
// TOPK_SOFTMAX and NORMALIZE dividing by the sum over the k. ROUTED: the given ids and weights, an id outside
// [0, E) contributing nothing. ``tail`` (or null): where the routing is also written for the down kernel, k
// weights then k ids (int bits).
template <typename T>
__device__ void route(const T* __restrict__ logits, const long long* __restrict__ given, int t, int E, int K,
                      int flags, long long* ids, float* w, float* tail) {
#ifdef NO_ROUTE  // a variant for benchmarks/moe_cuda_kernels.py: experts 0..k-1, weight 1/k, no routing
  if (threadIdx.x < K) ids[threadIdx.x] = threadIdx.x, w[threadIdx.x] = 1.f / K;
  if (tail && threadIdx.x < K) tail[threadIdx.x] = 1.f / K, tail[K + threadIdx.x] = __int_as_float(threadIdx.x);
  __syncthreads();
  return;
#endif
  if (threadIdx.x < 32) {
    route_warp(logits, given, t, E, K, flags, ids, w);
    if (tail)
      for (int j = threadIdx.x; j < K; j += 32) tail[j] = w[j], tail[K + j] = __int_as_float((int)ids[j]);
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
// the same through the L2 only (ld.global.cg): act rows written by other workgroups of the same launch (moe_fused),
// which the read-only path (__ldg) may not read
__device__ __forceinline__ void load8_cg(const float* __restrict__ v, int c, float* o) {
  float4 a = __ldcg((const float4*)(v + c)), b = __ldcg((const float4*)(v + c + 4));
  o[0] = a.x, o[1] = a.y, o[2] = a.z, o[3] = a.w, o[4] = b.x, o[5] = b.y, o[6] = b.z, o[7] = b.w;
}
__device__ void load8_cg(const __half* __restrict__ v, int c, float* o) = delete;  // act rows are f32 only
__device__ __forceinline__ float ld_cg(const float* p, long long i) { return __ldcg(p + i); }
__device__ float ld_cg(const __half* p, long long i) = delete;  // act rows are f32 only
template <bool CG, typename V>
__device__ __forceinline__ void load8v(const V* __restrict__ v, int c, float* o) {
  if constexpr (CG) load8_cg(v, c, o); else load8(v, c, o);
}

// Lane-parallel dot of row `row` of a [*, N, Kd] weight with the vector v (global, read through the L1: every
// warp of the block reads the same one); full sum on every lane. INT4 rows with Kd and bs multiples of 32 are
// read 16 bytes (32 codes) per lane per load, two loads in flight; others 4 bytes (8 codes) at a time.
template <bool CG = false, typename T, typename V>
__device__ float row_dot(const void* __restrict__ w, const T* __restrict__ s, const uint8_t* __restrict__ z,
                         long long row, int Kd, int bs, int flags, const V* __restrict__ v) {
  int lane = threadIdx.x & 31;
  float acc = 0.f;
  if (!(flags & INT4)) {
    const T* p = (const T*)w + row * Kd;
    for (int c = lane; c < Kd; c += 32) {
      if constexpr (CG) acc += ld(p, c) * ld_cg(v, c); else acc += ld(p, c) * ld(v, c);
    }
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
        load8v<CG>(v, 32 * q + 8 * m, xs);
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
    load8v<CG>(v, 8 * q, xs);
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

// ---------------------------------------------------------------- fast path: f16, INT4, multiples of 32

// Stage n values of v (n % 32 == 0) into sh as n/2 half2 (stage_group's layout); CG: read through the L2 only.
template <bool CG = false, typename V>
__device__ __forceinline__ void stage(const V* __restrict__ v, int n, __half2* sh) {
  for (int g = threadIdx.x; g < n / 8; g += THREADS) {
    float f[8];
    load8v<CG>(v, 8 * g, f);
    stage_group(sh, n / 32, g, f);
  }
}

__device__ __forceinline__ bool fast_path(int flags, int H, int I, int K, int bs) {
  return (flags & F16) && (flags & INT4) && H % 32 == 0 && I % 32 == 0 && bs % 32 == 0 && H <= MAX_XH &&
         K * I <= MAX_ACT;
}

__device__ __forceinline__ float swiglu(float g, float u, float alpha, float beta, float limit) {
  if (limit > 0.f) {
    g = fminf(g, limit);
    u = fminf(fmaxf(u, -limit), limit);
  }
  return g / (1.f + __expf(-alpha * g)) * (u + beta);
}

// ---------------------------------------------------------------- the two kernels

// Row block ``by`` of ``gy`` of token t's gate_up items (moe_gate_up: the workgroup's; moe_fused: its ticket's).
// w, ids: shared, MAX_K each; xsh: shared, MAX_XH / 2 half2. ``tail``: write the routing behind the act rows (the
// first row block of a token, for moe_down).
template <typename T>
__device__ void gate_up(const T* __restrict__ x, const T* __restrict__ logits, const long long* __restrict__ given,
                        const void* __restrict__ w1, const T* __restrict__ s1, const uint8_t* __restrict__ z1,
                        const T* __restrict__ b1, float* __restrict__ act, int H, int I, int E, int K, int bs,
                        int tokens, int flags, int alpha_b, int beta_b, int limit_b, int t, int by, int gy,
                        bool tail_out, float* w, long long* ids, __half2* xsh) {
  int rows = (I + (unsigned)gy - 1) / (unsigned)gy, r0 = by * rows, r1 = min(I, r0 + rows);
  bool fast = fast_path(flags, H, I, K, bs);
  const T* xv = x + (long long)t * H;
  if (fast && threadIdx.x >= 32) stage(xv, H, xsh);  // warps 1.. stage x while warp 0 routes
  float* tail = tail_out && by == 0 ? act + (long long)tokens * K * I + 2LL * K * t : nullptr;
  route(logits, given, t, E, K, flags, ids, w, tail);
  if (fast && threadIdx.x < 32) stage(xv, H, xsh);  // warp 0's share of the groups, after routing
  __syncthreads();
  float alpha = bits(alpha_b), beta = bits(beta_b), limit = bits(limit_b);
  int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  int items = K * (r1 - r0);  // item n: expert slot n / rows_here, row r0 + n % rows_here
  int here = r1 - r0;
  if (here <= 0) return;
  if (fast) {
    int nb = (H + bs - 1) / bs;  // a last block may be partial, or longer than the row
    constexpr int R = 2 * GATE_PAIRS;
    Chunk<R, 2> chunk;
    for (int n0 = GATE_PAIRS * warp; n0 < items; n0 += GATE_PAIRS * WARPS) {  // GATE_PAIRS items per pass
      const uint8_t* rp[R];
      const __half* sp[R];
      const uint8_t* zp[R];
      bool live[R];
      long long e2[GATE_PAIRS];
      int r2[GATE_PAIRS];
#pragma unroll
      for (int m = 0; m < GATE_PAIRS; ++m) {
        int n = n0 + m;
        bool ok = n < items;
        int j = ok ? n / here : 0, r = r0 + (ok ? n % here : 0);
        long long e = ok ? ids[j] : -1;
        e2[m] = e, r2[m] = r;
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // h 0: gate row r, h 1: up row I + r
          long long row = (e < 0 ? 0 : e) * 2 * I + h * I + r;
          rp[2 * m + h] = (const uint8_t*)w1 + row * (H / 2);
          sp[2 * m + h] = (const __half*)s1 + row * nb;
          zp[2 * m + h] = (flags & ZERO_POINTS) ? z1 + row * nb : nullptr;
          live[2 * m + h] = e >= 0;
        }
      }
      float acc[R];
      const __half2* vec[R];
#pragma unroll
      for (int m = 0; m < R; ++m) acc[m] = 0.f, vec[m] = xsh;
      dot_rows<R, 2, true>(rp, sp, zp, live, H, bs, vec, acc, chunk, false);
#pragma unroll
      for (int m = 0; m < GATE_PAIRS; ++m) {
        float g = warp_sum(acc[2 * m]) * (1.f / VEC_SCALE), u = warp_sum(acc[2 * m + 1]) * (1.f / VEC_SCALE);
        int n = n0 + m;
        if (n >= items) continue;
        long long e = e2[m];
        int r = r2[m];
        float out = 0.f;
        if (e >= 0) {
          if (flags & BIAS) {
            g += ld(b1, e * 2 * I + r);
            u += ld(b1, e * 2 * I + I + r);
          }
          out = swiglu(g, u, alpha, beta, limit);
        }
        if (lane == 0) act[((long long)t * K + n / here) * I + r] = out;
      }
    }
    return;
  }
  for (int n = warp; n < items; n += WARPS) {
    int j = n / here, r = r0 + n % here;
    long long e = ids[j];
    float out = 0.f;
    if (e >= 0) {
      float g = row_dot(w1, s1, z1, e * 2 * I + r, H, bs, flags, xv);
      float u = row_dot(w1, s1, z1, e * 2 * I + I + r, H, bs, flags, xv);
      if (flags & BIAS) {
        g += ld(b1, e * 2 * I + r);
        u += ld(b1, e * 2 * I + I + r);
      }
      out = swiglu(g, u, alpha, beta, limit);
    }
    if (lane == 0) act[((long long)t * K + j) * I + r] = out;
  }
}

// One 16-byte piece of the down projection: row ``row`` of w2, piece q (codes 32q .. 32q+31), its scale times the
// expert's mixing weight, its zero point as the half 1024 + zp (see dot32).
struct Piece {
  uint4 w;
  float sc;
  __half2 zh;
};

// Wait until ``*ready`` (a counter of the launch's finished gate_up workgroups) reaches ``need``: one thread polls
// with acquire loads, then the workgroup's barrier; every thread of the workgroup must call it.
__device__ __forceinline__ void wait_for(const unsigned* ready, unsigned need) {
  if (threadIdx.x == 0) {
    unsigned v;
    for (;;) {
      asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(ready) : "memory");  // generic address
      if (v >= need) break;
      __nanosleep(32);
    }
    __threadfence();  // as cooperative groups' grid sync does after its wait
  }
  __syncthreads();
}

// Row block ``by`` of ``gy`` of token t's H rows. w, ids: the token's routing (shared); ash: shared, MAX_ACT / 2
// half2. ``ready`` (moe_fused; null for moe_down): the act rows are read only once it counts ``need``, after the
// first pass's weight loads are issued; CG: the act rows through the L2 only (written in the same launch).
template <bool CG, typename T>
__device__ void down(const float* __restrict__ act, const void* __restrict__ w2, const T* __restrict__ s2,
                     const uint8_t* __restrict__ z2, const T* __restrict__ b2, const T* __restrict__ shared,
                     const T* __restrict__ gate, T* __restrict__ out, int H, int I, int K, int bs, int flags, int t,
                     int by, int gy, const float* w, const int* ids, __half2* ash, const unsigned* ready,
                     unsigned need) {
  int rows = (H + (unsigned)gy - 1) / (unsigned)gy, r0 = by * rows, r1 = min(H, r0 + rows);
  int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const float* at = act + (long long)t * K * I;  // the token's k act rows, contiguous
  bool fast = fast_path(flags, H, I, K, bs);
  if (fast) {
    int nq = I / 32, nb = (I + bs - 1) / bs, np = K * nq;  // pieces per row, scale blocks, pieces of all k rows
    int r = r0 + warp;  // one row per warp per pass
    // the first pass's loads go out before the staging of the act rows (which they do not need)
    Piece pc[DOWN_LOADS];
    auto issue = [&](int rr, int p0) {
#pragma unroll
      for (int u = 0; u < DOWN_LOADS; ++u) {
        int p = p0 + lane + 32 * u, j = p / nq, q = p - j * nq;
        int e = p < np && rr < r1 ? ids[j] : -1;
        long long row = (long long)(e < 0 ? 0 : e) * H + rr;
        int b = (32 * q) / bs;
        pc[u].w = e >= 0 ? __ldg((const uint4*)((const uint8_t*)w2 + row * (I / 2)) + q) : make_uint4(0, 0, 0, 0);
        pc[u].sc = e >= 0 ? __half2float(__ldg((const __half*)s2 + row * nb + b)) * w[j] : 0.f;
        pc[u].zh = __float2half2_rn(1024.f + (e >= 0 && (flags & ZERO_POINTS) ? (float)__ldg(z2 + row * nb + b) : 8.f));
      }
    };
    issue(r, 0);
    if (ready) wait_for(ready, need);
    stage<CG>(at, K * I, ash);
    __syncthreads();
    for (; r < r1; r += WARPS) {
      float total = 0.f;
      for (int p0 = 0; p0 < np; p0 += 32 * DOWN_LOADS) {
        if (p0 > 0 || r > r0 + warp) issue(r, p0);
#pragma unroll
        for (int u = 0; u < DOWN_LOADS; ++u) {
          int p = p0 + lane + 32 * u;
          if (p >= np) break;
          uint4 xv[4];
          staged_piece(ash, np, p, xv);  // piece q of act row j is piece j * nq + q = p of the k rows
          total += pc[u].sc * dot32(pc[u].w, xv, pc[u].zh);
        }
      }
      total = warp_sum(total) * (1.f / VEC_SCALE);
      if (lane == 0) {
        if (flags & BIAS)
          for (int j = 0; j < K; ++j)
            if (ids[j] >= 0) total += w[j] * ld(b2, (long long)ids[j] * H + r);
        st_out(out, (long long)t * H + r, total, flags, shared, gate, t);
      }
    }
    return;
  }
  if (ready) wait_for(ready, need);
  for (int r = r0 + warp; r < r1; r += WARPS) {
    float acc = 0.f;
    for (int j = 0; j < K; ++j) {
      long long e = ids[j];
      if (e < 0) continue;
      float d = row_dot<CG>(w2, s2, z2, e * H + r, I, bs, flags, act + ((long long)t * K + j) * I);
      if (flags & BIAS) d += ld(b2, e * H + r);
      acc += w[j] * d;
    }
    if (lane == 0) st_out(out, (long long)t * H + r, acc, flags, shared, gate, t);
  }
}

// One launch of both halves (moe_fused_<el>): a 1-D grid of T * (gy1 + gy2) workgroups. Each takes a ticket from
// the slot's counters in the order workgroups start; tickets 0 .. T*gy1-1 are gate_up row blocks (token-major),
// the rest down row blocks. A down workgroup routes its token itself (off the critical path: gate_up is still
// running), issues its first pass of weight loads, and only then waits until every gate_up workgroup has counted
// itself done. Every lower ticket belongs to a workgroup that has already started, so the wait ends whatever the
// grid's size and residency (the tickets, not blockIdx, order the work). The last down workgroup to finish sets
// the slot's counters back to zero for the next launch (stream order). The counters are this module's own memory,
// zero when the driver loads it: no buffer to clear per call. A slot is one dispatch site (the lowering numbers
// them across the module: iree-compile merges equal executables into one PTX module), so two launches of this
// kernel that might overlap never share counters.
#ifndef SYNC_SLOTS
#define SYNC_SLOTS 1024
#endif
__device__ unsigned moe_sync[SYNC_SLOTS][4];  // ticket, gate_up done, down done, (pad)

template <typename T>
__device__ void fused(const T* __restrict__ x, const T* __restrict__ logits, const long long* __restrict__ given,
                      const void* __restrict__ w1, const T* __restrict__ s1, const uint8_t* __restrict__ z1,
                      const T* __restrict__ b1, const void* __restrict__ w2, const T* __restrict__ s2,
                      const uint8_t* __restrict__ z2, const T* __restrict__ b2, const T* __restrict__ shared,
                      const T* __restrict__ gate, T* __restrict__ out, float* __restrict__ act, int tokens, int H, int I, int E, int K, int bs, int flags, int alpha_b,
                      int beta_b, int limit_b, int gy1, int gy2, int slot) {
  __shared__ unsigned ticket;
  __shared__ float w[MAX_K];
  __shared__ long long ids[MAX_K];
  __shared__ int ids32[MAX_K];
  __shared__ __align__(16) __half2 vsh[MAX_ACT / 2];  // x for gate_up, the act rows for down (MAX_XH <= MAX_ACT)
  unsigned* sync = moe_sync[slot];
  if (threadIdx.x == 0) ticket = atomicAdd(&sync[0], 1u);
  __syncthreads();
  unsigned n = ticket, g1 = (unsigned)tokens * gy1, g2 = (unsigned)tokens * gy2;
  if (n < g1) {
    gate_up(x, logits, given, w1, s1, z1, b1, act, H, I, E, K, bs, tokens, flags, alpha_b, beta_b, limit_b,
            (int)(n / gy1), (int)(n % gy1), gy1, false, w, ids, vsh);
    __syncthreads();  // every act row of this workgroup is stored
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(&sync[1], 1u);
    }
    return;
  }
  n -= g1;
  int t = (int)(n / gy2);
  route(logits, given, t, E, K, flags, ids, w, nullptr);
  for (int j = threadIdx.x; j < K; j += THREADS) ids32[j] = (int)ids[j];
  __syncthreads();
  down<true>(act, w2, s2, z2, b2, shared, gate, out, H, I, K, bs, flags, t, (int)(n % gy2), gy2, w, ids32, vsh, &sync[1],
             g1);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&sync[2], 1u) == g2 - 1) {  // the last workgroup of the launch: every ticket is taken, every wait over
      __threadfence();  // the other workgroups' counter updates before the reset
      sync[0] = 0u, sync[1] = 0u, sync[2] = 0u;
    }
  }
}

#ifndef FUSED_MIN_BLOCKS
#define FUSED_MIN_BLOCKS 3  // moe_fused: __launch_bounds__ minimum of resident workgroups per SM (80 registers; 2 was
#endif                      // 19% slower at the seeds' decode shapes on an H100: BENCHMARKS.md)

#define GATE_UP(name, T)                                                                                        \
  extern "C" __global__ void __launch_bounds__(THREADS, GATE_MIN_BLOCKS) name(                                  \
      const T* x, const T* logits, const long long* given, const void* w1, const T* s1, const uint8_t* z1,      \
      const T* b1, float* act, int t, int H, int I, int E, int K, int bs, int flags, int alpha_b, int beta_b,   \
      int limit_b) {                                                                                             \
    __shared__ float w[MAX_K];                                                                                   \
    __shared__ long long ids[MAX_K];                                                                             \
    __shared__ __align__(16) __half2 xsh[MAX_XH / 2];                                                            \
    gate_up(x, logits, given, w1, s1, z1, b1, act, H, I, E, K, bs, t, flags, alpha_b, beta_b, limit_b,          \
            blockIdx.x, blockIdx.y, gridDim.y, true, w, ids, xsh);                                               \
  }
// moe_down: each warp its own copy of the routing gate_up left behind the act rows (read from the L2, no barrier
// before the weight loads)
#define DOWN(name, T)                                                                                           \
  extern "C" __global__ void __launch_bounds__(THREADS) name(                                                  \
      const T* logits, const long long* given, const float* act, const void* w2, const T* s2, const uint8_t* z2, \
      const T* b2, const T* shared, const T* gate, T* out, int t, int H, int I, int E, int K, int bs, int flags, \
      int alpha_b, int beta_b, int limit_b) {                                                                    \
    (void)logits, (void)given, (void)E, (void)alpha_b, (void)beta_b, (void)limit_b;                             \
    __shared__ float wsh[WARPS][MAX_K];                                                                          \
    __shared__ int idsh[WARPS][MAX_K];                                                                           \
    __shared__ __align__(16) __half2 ash[MAX_ACT / 2];                                                           \
    int warp = threadIdx.x / 32, tok = blockIdx.x;                                                               \
    const float* tail = act + (long long)t * K * I + 2LL * K * tok;                                              \
    for (int j = threadIdx.x & 31; j < K; j += 32) wsh[warp][j] = tail[j], idsh[warp][j] = __float_as_int(tail[K + j]); \
    __syncwarp();                                                                                                \
    down<false>(act, w2, s2, z2, b2, shared, gate, out, H, I, K, bs, flags, tok, blockIdx.y, gridDim.y, wsh[warp], \
                idsh[warp], ash, nullptr, 0u);                                                                   \
  }
#define FUSED(name, T)                                                                                          \
  extern "C" __global__ void __launch_bounds__(THREADS, FUSED_MIN_BLOCKS) name(                                 \
      const T* x, const T* logits, const long long* given, const void* w1, const T* s1, const uint8_t* z1,      \
      const T* b1, const void* w2, const T* s2, const uint8_t* z2, const T* b2, const T* shared, const T* gate,  \
      T* out, float* act, int t, int H, int I, int E, int K, int bs, int flags, int alpha_b, int beta_b,        \
      int limit_b, int gy1, int gy2, int slot) {                                                                 \
    fused(x, logits, given, w1, s1, z1, b1, w2, s2, z2, b2, shared, gate, out, act, t, H, I, E, K, bs, flags,    \
          alpha_b, beta_b, limit_b, gy1, gy2, slot);                                                             \
  }

GATE_UP(moe_gate_up_f32, float)
GATE_UP(moe_gate_up_f16, __half)
DOWN(moe_down_f32, float)
DOWN(moe_down_f16, __half)
FUSED(moe_fused_f32, float)
FUSED(moe_fused_f16, __half)

// ---------------------------------------------------------------- on the tensor cores (f16, INT4 blocks of 128)
//
// moe_gate_up_mma<S>_f16 and moe_down_mma<S>_f16: the same bindings and push constants as moe_gate_up_f16 /
// moe_down_f16, for what the lowering's ``cuda_mma_steps`` accepts: f16, INT4 with blocks of 128 codes, H = 1024 S
// for gate_up, k * I <= 1024 S for down (S: a compile-time count of register-held steps), I a multiple of 128, any
// routing mode. The kernels above spend about 80 instructions on each 16-byte piece of codes; these give 16 weight
// rows at a time to one warp as the A operand of mma.m16n8k16 (f16 in, f32 accumulate; PTX ISA, "Matrix Fragments
// for mma.m16n8k16 with floating point type"): lane (g = lane / 4, c = lane % 4) loads one 16-byte piece of rows g
// and g + 8, and the four lanes of a row group take four consecutive pieces, so a step is one block of 128 codes. Two lop3s per word make the codes halves with no
// subtraction (as Marlin does, arXiv:2408.11743): the low nibbles of each byte as 1024 + code, the high ones as
// 1024 + 16 code. The vector (B, the same in all 8 columns) is staged to match: x for the low nibbles, x / 16 for
// the high ones, so every product is (1024 + code) x in f32. Per block and row the sum is then corrected in f32:
//     sum (code - zp) x = D - 1024 S - zp X,   S = sum of the staged values, X = sum of x (staged once per block)
// and scaled by the block's scale. The 8 columns of D are equal; lane c = 0 keeps column 0.
// gate_up: grid (T, gy), a workgroup at a time one group of 8 gate rows and the same 8 up rows of one expert
// (groups n = blockIdx.y, + gy, ... of the k * I / 8), each warp an eighth of H, reduced through shared memory, then
// SwiGLU into the act row; the lowering gives each workgroup MMA_GATE_GROUPS groups (lowering.py), so the
// routing and the staging of x are paid once for several groups. gate_up's warp 0 routes the token (route_warp: the
// given experts, or softmax and top-k of the logits) while the others stage x, then a barrier before the first
// weight loads; a workgroup's next group is loaded after the barrier that ends this one. The first row block of a
// token leaves the routing behind the act rows, where down reads it, as moe_down does. down: grid (T, gy), a
// workgroup 16 rows of H at a time, its k act rows (contiguous) split over the 8 warps by blocks of 128; each warp
// stages only its own part of them, after issuing its weight loads, so no workgroup barrier precedes those.

__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One warp stages n values of v (n a multiple of 128): piece q (values 32q ..) quarter m (32q + 8m + 0..7) at
// sh[m * n/32 + q] as (x0, x4), (x1, x5) / 16, (x2, x6), (x3, x7) / 16, the pairs the A operand's lop3s give;
// block b (values 128b ..) gets sums[b] = (S, X).
// Group gi of 8 values f into its staged piece; adds its values to s and to xs (the high-nibble pairs times 16,
// as staged: X is the sum of the values themselves).
__device__ __forceinline__ void stage_eight(const float (&f)[8], int gi, int np, uint4* sh, float& s, float& xs) {
  __half2 h[4] = {__floats2half2_rn(f[0], f[4]), __floats2half2_rn(f[1] * 0.0625f, f[5] * 0.0625f),
                  __floats2half2_rn(f[2], f[6]), __floats2half2_rn(f[3] * 0.0625f, f[7] * 0.0625f)};
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    float2 v2 = __half22float2(h[p]);
    s += v2.x + v2.y;
    xs += (p & 1) ? 16.f * (v2.x + v2.y) : v2.x + v2.y;
  }
  sh[(gi & 3) * np + (gi >> 2)] = *reinterpret_cast<const uint4*>(h);
}
// The per-block sums of one round of 32 groups (two blocks): each half-warp's, written by its lane 0.
__device__ __forceinline__ void stage_sums(float s, float xs, int g0, int n, float2* sums) {
  int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) {  // within each half-warp: one block
    s += __shfl_xor_sync(0xffffffffu, s, o);
    xs += __shfl_xor_sync(0xffffffffu, xs, o);
  }
  int b = (g0 + lane) / 16;
  if ((lane & 15) == 0 && b < n / 128) sums[b] = make_float2(s, xs);
}
// The same in two parts, for a warp that can hold all its values in registers (n <= 256 NI): stage_load issues
// every load of this lane's groups of 8 at once (one L2 round trip, not one per 256 values; CG: through the L2
// only, for act rows written in the same launch), stage_store converts and stores them; a caller issues its
// weight loads between the two.
template <int NI, bool CG = false, typename V>
__device__ __forceinline__ void stage_load(const V* __restrict__ v, int n, float (&f)[NI][8]) {
  int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < NI; ++i)
    if (32 * i + lane < n / 8) {
      if (CG)
        load8_cg(v, 8 * (32 * i + lane), f[i]);
      else
        load8(v, 8 * (32 * i + lane), f[i]);
    }
}
template <int NI>
__device__ __forceinline__ void stage_store(const float (&f)[NI][8], int n, uint4* sh, float2* sums) {
  int lane = threadIdx.x & 31, np = n / 32;
#pragma unroll
  for (int i = 0; i < NI; ++i) {  // round i: groups 32 i .. 32 i + 31
    if (32 * i >= n / 8) break;
    int gi = 32 * i + lane;
    float s = 0.f, xs = 0.f;
    if (gi < n / 8) stage_eight(f[i], gi, np, sh, s, xs);
    stage_sums(s, xs, 32 * i, n, sums);
  }
}
template <typename V>
__device__ __forceinline__ void stage_mma(const V* __restrict__ v, int n, uint4* sh, float2* sums) {
  int lane = threadIdx.x & 31, np = n / 32;
  for (int g0 = 0; g0 < n / 8; g0 += 32) {  // 32 groups of 8 = two blocks
    int gi = g0 + lane;
    float s = 0.f, xs = 0.f;
    if (gi < n / 8) {
      float f[8];
      load8(v, 8 * gi, f);
      stage_eight(f, gi, np, sh, s, xs);
    }
    stage_sums(s, xs, g0, n, sums);
  }
}

// One block (step) of two rows: the 16-byte pieces wa (row g) and wb (row g + 8) of this lane against the staged
// quarters xq[0], xq[np], ..; returns D of rows g and g + 8 (column 0 of the tile, every column being equal).
__device__ __forceinline__ float2 mma_step(uint4 wa, uint4 wb, const uint4* xq, int np) {
  float d[4] = {0.f, 0.f, 0.f, 0.f};
  const uint32_t A[4] = {wa.x, wa.y, wa.z, wa.w}, B[4] = {wb.x, wb.y, wb.z, wb.w};
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    uint4 x = xq[m * np];
    uint32_t a = A[m], b = B[m], a8 = a >> 8, b8 = b >> 8;
    mma16816(d, (a & 0x000F000Fu) | 0x64006400u, (b & 0x000F000Fu) | 0x64006400u, (a & 0x00F000F0u) | 0x64006400u,
             (b & 0x00F000F0u) | 0x64006400u, x.x, x.y);
    mma16816(d, (a8 & 0x000F000Fu) | 0x64006400u, (b8 & 0x000F000Fu) | 0x64006400u,
             (a8 & 0x00F000F0u) | 0x64006400u, (b8 & 0x00F000F0u) | 0x64006400u, x.z, x.w);
  }
  return make_float2(d[0], d[2]);
}

// The sums of two rows (g and g + 8) over this warp's first n of its S steps: per step the scale times
// D - 1024 S - zp X (the correction in the header above), against the warp's staged vector xs (n steps of it) and
// its per-block sums.
template <int S>
__device__ __forceinline__ float2 mma_rows(const uint4 (&wa)[S], const uint4 (&wb)[S], const float (&sa)[S],
                                           const float (&sb)[S], const float (&za)[S], const float (&zb)[S], int n,
                                           const uint4* xs, const float2* sums, int c) {
  float ya = 0.f, yb = 0.f;
#pragma unroll
  for (int s = 0; s < S; ++s) {
    if (s >= n) break;
    float2 d = mma_step(wa[s], wb[s], &xs[s * 4 + c], n * 4);
    float2 sm = sums[s];
    ya += sa[s] * (d.x - 1024.f * sm.x - za[s] * sm.y);
    yb += sb[s] * (d.y - 1024.f * sm.x - zb[s] * sm.y);
  }
  return make_float2(ya, yb);
}

// This lane's part of one gate_up group (8 gate rows and the same 8 up rows of the token's j-th expert, group n
// of the k * I / 8) over its warp's S steps: codes, scales and zero points of rows g and g + 8 of the tile.
template <int S>
struct GateGroup {
  uint4 wa[S], wb[S];
  float sa[S], sb[S], za[S], zb[S];
  long long e;
  int j, r;
};

template <int S>
__device__ __forceinline__ void load_gate_group(GateGroup<S>& q, int n, const long long* ids, const void* w1,
                                                const __half* s1, const uint8_t* z1, int H, int I, int flags,
                                                int warp, int g, int c) {
  int nb = H / 128, rpe = I / 8;
  q.j = n / rpe, q.r = (n - q.j * rpe) * 8 + g;
  q.e = ids[q.j];
  long long ra = (q.e >= 0 ? q.e : 0) * 2 * I + q.r, rb = ra + I;
  const uint4* pa = (const uint4*)((const uint8_t*)w1 + ra * (H / 2));
  const uint4* pb = (const uint4*)((const uint8_t*)w1 + rb * (H / 2));
#pragma unroll
  for (int s = 0; s < S; ++s) {
    int blk = warp * S + s, qi = blk * 4 + c;
    q.wa[s] = __ldg(pa + qi), q.wb[s] = __ldg(pb + qi);
    q.sa[s] = __half2float(__ldg(s1 + ra * nb + blk)), q.sb[s] = __half2float(__ldg(s1 + rb * nb + blk));
    q.za[s] = (flags & ZERO_POINTS) ? (float)__ldg(z1 + ra * nb + blk) : 8.f;
    q.zb[s] = (flags & ZERO_POINTS) ? (float)__ldg(z1 + rb * nb + blk) : 8.f;
  }
}

// gate_up with S blocks of 128 codes per warp (H = 128 * S * WARPS)
template <int S>
__device__ void gate_up_mma(const __half* x, const __half* logits, const long long* given, const void* w1,
                            const __half* s1, const uint8_t* z1, const __half* b1, float* act, int T, int H, int I,
                            int E, int K, int flags, int alpha_b, int beta_b, int limit_b) {
  __shared__ __align__(16) uint4 xs[WARPS][S * 16];
  __shared__ float2 sums[WARPS][S];
  __shared__ float red[WARPS][16];
  __shared__ float wr[MAX_K];
  __shared__ long long ids[MAX_K];
  int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, tok = blockIdx.x;
  // warp 0 routes the token while the others stage their part of x (routing in every warp instead, with no
  // barrier before the weight loads, measured the same or up to 3 us a layer slower: BENCHMARKS.md)
  if (warp == 0) route_warp(logits, given, tok, E, K, flags, ids, wr);
  stage_mma(x + (long long)tok * H + warp * S * 128, S * 128, xs[warp], sums[warp]);
  __syncthreads();
  if (blockIdx.y == 0 && warp == 0) {  // the routing behind the act rows, for moe_down_mma
    float* tail = act + (long long)T * K * I + 2LL * K * tok;
    for (int j = lane; j < K; j += 32) tail[j] = wr[j], tail[K + j] = __int_as_float((int)ids[j]);
  }
  float alpha = bits(alpha_b), beta = bits(beta_b), limit = bits(limit_b);
  int ng = K * I / 8;
  GateGroup<S> cur;
  if (blockIdx.y < ng) load_gate_group<S>(cur, blockIdx.y, ids, w1, s1, z1, H, I, flags, warp, g, c);
  for (int n = blockIdx.y; n < ng; n += gridDim.y) {
    float2 y = mma_rows<S>(cur.wa, cur.wb, cur.sa, cur.sb, cur.za, cur.zb, S, xs[warp], sums[warp], c);
    if (c == 0) red[warp][g] = y.x, red[warp][8 + g] = y.y;
    __syncthreads();
    if (warp == 0 && c == 0) {
      float gs = 0.f, us = 0.f;
#pragma unroll
      for (int k2 = 0; k2 < WARPS; ++k2) gs += red[k2][g], us += red[k2][8 + g];
      float out = 0.f;
      long long e = cur.e;
      if (e >= 0) {
        if (flags & BIAS) gs += ld(b1, e * 2 * I + cur.r), us += ld(b1, e * 2 * I + I + cur.r);
        out = swiglu(gs, us, alpha, beta, limit);
      }
      act[((long long)tok * K + cur.j) * I + cur.r] = out;
    }
    __syncthreads();  // red is written again by the next group
    if (n + gridDim.y < ng) load_gate_group<S>(cur, n + gridDim.y, ids, w1, s1, z1, H, I, flags, warp, g, c);
  }
}

// The end of a down tile: rows row0 .. row0 + 15 summed over the warps' partial sums red, plus each routed
// expert's bias (weight(j) * b2[expert(j), row] where expert(j) >= 0), stored by st_out at out_base + row.
template <typename Weight, typename Expert>
__device__ __forceinline__ void store_down_tile(const float (*red)[16], int row0, long long out_base, int H, int K,
                                                int flags, const __half* b2, Weight weight, Expert expert, __half* out,
                                                const __half* shared, const __half* gate, long long tok) {
  if (threadIdx.x >= 16) return;
  int row = row0 + threadIdx.x;
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) total += red[w][threadIdx.x];
  if (flags & BIAS)
    for (int j = 0; j < K; ++j) {
      long long e = expert(j);
      if (e >= 0) total += weight(j) * ld(b2, e * H + row);
    }
  st_out(out, out_base + row, total, flags, shared, gate, tok);
}

// down with at most S blocks of 128 codes per warp (k * I <= 128 * S * WARPS). EARLY (the one-token export): each
// warp reads its act values into registers before its weight loads and converts them once those are issued, so
// their L2 round trip overlaps the weights' (at S = 6, the seeds' layers, 150 registers instead of 124: one
// workgroup an SM, which costs more tokens than it saves at one, where the 128 workgroups of H = 2048 take one SM
// each; BENCHMARKS.md)
template <int S, bool EARLY>
__device__ void down_mma(const float* act, const void* w2, const __half* s2, const uint8_t* z2, const __half* b2,
                         const __half* shared, const __half* gate, __half* out, int T, int H, int I, int K, int flags) {
  __shared__ __align__(16) uint4 xs[WARPS][S * 16];
  __shared__ float2 sums[WARPS][S];
  __shared__ float red[WARPS][16];
  int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, tok = blockIdx.x;
  int nst = K * I / 128, st0 = warp * nst / WARPS, cnt = (warp + 1) * nst / WARPS - st0, nb = I / 128;
  const float* tail = act + (long long)T * K * I + 2LL * K * tok;  // the routing gate_up left: k weights, k ids
  const float* mine = act + (long long)tok * K * I + st0 * 128;     // this warp's blocks of the token's k act rows
  float early[EARLY ? (S + 1) / 2 : 1][8];
  if (EARLY) stage_load(mine, cnt * 128, early);
  bool staged = false;
  for (int h0 = blockIdx.y * 16; h0 < H; h0 += gridDim.y * 16) {
    uint4 wa[S], wb[S];
    float sa[S], sb[S], za[S], zb[S];
#pragma unroll
    for (int s = 0; s < S; ++s) {
      if (s >= cnt) break;
      int st = st0 + s, j = st / nb, blk = st - j * nb, q = blk * 4 + c;
      int e = __float_as_int(tail[K + j]);
      bool ok = e >= 0;
      float wj = ok ? tail[j] : 0.f;
      long long ra = (ok ? e : 0) * H + h0 + g, rb = ra + 8;
      wa[s] = __ldg((const uint4*)((const uint8_t*)w2 + ra * (I / 2)) + q);
      wb[s] = __ldg((const uint4*)((const uint8_t*)w2 + rb * (I / 2)) + q);
      sa[s] = __half2float(__ldg(s2 + ra * nb + blk)) * wj, sb[s] = __half2float(__ldg(s2 + rb * nb + blk)) * wj;
      za[s] = (flags & ZERO_POINTS) ? (float)__ldg(z2 + ra * nb + blk) : 8.f;
      zb[s] = (flags & ZERO_POINTS) ? (float)__ldg(z2 + rb * nb + blk) : 8.f;
    }
    if (!staged) {  // this warp's blocks of the token's k act rows (contiguous), while its first loads fly
      if (EARLY)
        stage_store(early, cnt * 128, xs[warp], sums[warp]);
      else
        stage_mma(mine, cnt * 128, xs[warp], sums[warp]);
      __syncwarp();
      staged = true;
    }
    float2 y = mma_rows<S>(wa, wb, sa, sb, za, zb, cnt, xs[warp], sums[warp], c);
    if (c == 0) red[warp][g] = y.x, red[warp][8 + g] = y.y;
    __syncthreads();
    store_down_tile(red, h0, (long long)tok * H, H, K, flags, b2, [&](int j) { return tail[j]; },
                    [&](int j) { return (long long)__float_as_int(tail[K + j]); }, out, shared, gate, tok);
    __syncthreads();
  }
}

// The lowering dispatches these only where its cuda_mma_steps holds; anything else traps rather than computing
// a wrong sum. gate_up's minimum of resident workgroups per SM: 3 up to S = 2 (80 registers, no spill; 96 and 2
// workgroups with a minimum of 1, measured slower; a first build of S = 2 without routing and with no minimum got
// 48 registers and a spill from ptxas of CUDA 13.0), 1 above (3 spills there).
#ifndef MMA_GATE_MIN_BLOCKS
#define MMA_GATE_MIN_BLOCKS(S) ((S) <= 2 ? 3 : 1)
#endif
__device__ __forceinline__ bool mma_shape(int flags, int bs, int H, int I) {
  return (flags & F16) && (flags & INT4) && bs == 128 && H % 16 == 0 && I % 128 == 0;
}
#define GATE_UP_MMA(S)                                                                                           \
  extern "C" __global__ void __launch_bounds__(THREADS, MMA_GATE_MIN_BLOCKS(S))                                  \
      moe_gate_up_mma##S##_f16(                                                                                  \
      const __half* x, const __half* logits, const long long* given, const void* w1, const __half* s1,           \
      const uint8_t* z1, const __half* b1, float* act, int t, int H, int I, int E, int K, int bs, int flags,     \
      int alpha_b, int beta_b, int limit_b) {                                                                    \
    if (!mma_shape(flags, bs, H, I) || H != 128 * S * WARPS) __trap();                                           \
    gate_up_mma<S>(x, logits, given, w1, s1, z1, b1, act, t, H, I, E, K, flags, alpha_b, beta_b, limit_b);       \
  }
#define DOWN_MMA(S, EARLY, SUFFIX)                                                                               \
  extern "C" __global__ void __launch_bounds__(THREADS, 1) moe_down_mma##S##SUFFIX##_f16(                        \
      const __half* logits, const long long* given, const float* act, const void* w2, const __half* s2,          \
      const uint8_t* z2, const __half* b2, const __half* shared, const __half* gate, __half* out, int t, int H,  \
      int I, int E, int K, int bs, int flags, int alpha_b, int beta_b, int limit_b) {                            \
    (void)logits, (void)given, (void)E, (void)alpha_b, (void)beta_b, (void)limit_b;                              \
    if (!mma_shape(flags, bs, H, I) || K * I > 128 * S * WARPS) __trap();                                        \
    down_mma<S, EARLY>(act, w2, s2, z2, b2, shared, gate, out, t, H, I, K, flags);                               \
  }
// MMA_GATE_STEPS and MMA_DOWN_STEPS in lowering.py: the S of each export
GATE_UP_MMA(1)
GATE_UP_MMA(2)
GATE_UP_MMA(3)
GATE_UP_MMA(4)
// moe_down_mma<S>t1_f16: the lowering's choice where the token count is statically 1 (decode); any T computes
// the same sums
DOWN_MMA(2, false, )
DOWN_MMA(4, false, )
DOWN_MMA(6, false, )
DOWN_MMA(8, false, )
DOWN_MMA(2, true, t1)
DOWN_MMA(4, true, t1)
DOWN_MMA(6, true, t1)
DOWN_MMA(8, true, t1)
