// FusedMoE's two decode kernels on the tensor cores, for benchmarks/moe_cuda_kernels.py (not shipped yet: BENCHMARKS.md,
// "`moe` on CUDA", "On the tensor cores"):
//     python benchmarks/moe_cuda_kernels.py --variant mma8=benchmarks/variants/moe_mma.cu,MMA_KS=8,MMA_GU_STEPS=2,gate=8,down=16
//     [--variant mma=benchmarks/variants/moe_mma.cu,gate=16,down=16]   (gate_up over 4 warps, two groups a workgroup)
// The harness's gate and down values make its grids (T, k * I / 8 / MMA_GPW) and (T, H / 16) at the seeds' shapes.
// The shipped kernels spend about 80 instructions on each 16-byte piece of INT4 codes (extract two nibbles, subtract
// the zero point, multiply-add in half2, per pair). Here a warp takes 16 weight rows at once as the A operand of
// mma.m16n8k16 (f16 in, f32 accumulate; PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"):
// lane (g = lane / 4, c = lane % 4) loads one 16-byte piece of rows g and g + 8, and the four lanes of a row group
// take four consecutive pieces, so a step is one block of 128 codes. The codes become halves with two lop3s per word
// and no subtraction (as Marlin does): the low nibbles of each byte as 1024 + code, the high ones as 1024 + 16 code.
// The vector (B, the same in all 8 columns) is staged to match: x for the low nibbles, x / 16 for the high ones, so
// every product is (1024 + code) x in f32. Per block and row the sum is then corrected in f32:
//     sum (code - zp) x = D - 1024 S - zp X,   S = sum of the staged values, X = sum of x (staged once per block)
// and scaled by the block's scale. The 8 columns of D are equal; lane c = 0 keeps column 0.
// gate_up: a group is 8 gate rows and the same 8 up rows of one expert (rows g and g + 8 of the A operand), split
// along H over MMA_KS warps, reduced through shared memory, then SwiGLU. down: a group is 16 rows of H, its k = the
// token's k act rows concatenated (the act buffer's layout), split over the workgroup's 8 warps. Each warp stages
// only its own part of the vector, after issuing its weight loads, so no workgroup barrier precedes the loads.
// Fast path only: f16, INT4, routed mode, block size 128, H a multiple of 128 * MMA_KS, I a multiple of 128, and
// MMA_GU_STEPS and MMA_DOWN_STEPS (compile-time register arrays) matching the shape; anything else traps.
#define moe_gate_up_f16 moe_gate_up_f16_shipped
#define moe_down_f16 moe_down_f16_shipped
#include "moe_cuda.cu"
#undef moe_gate_up_f16
#undef moe_down_f16

#ifndef MMA_KS
#define MMA_KS 4  // gate_up: warps along H per group
#endif
#define MMA_GPW (WARPS / MMA_KS)  // gate_up: groups per workgroup
#ifndef MMA_GU_STEPS
#define MMA_GU_STEPS 4  // gate_up: blocks of 128 codes per warp, H / (128 * MMA_KS): 4 at H = 2048
#endif
#ifndef MMA_DOWN_STEPS
#define MMA_DOWN_STEPS 6  // down: most blocks of 128 codes per warp, ceil(k * I / (128 * 8)): 6 at both seeds' shapes
#endif

__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One warp stages n codes of v (n a multiple of 128): piece q (codes 32q ..) quarter m (codes 32q + 8m + 0..7) at
// sh[m * n/32 + q] as (x0, x4), (x1, x5) / 16, (x2, x6), (x3, x7) / 16, the pairs the A operand's lop3s give; block b
// (codes 128b ..) gets sums[b] = (S, X).
template <typename V>
__device__ __forceinline__ void stage_mma(const V* __restrict__ v, int n, uint4* sh, float2* sums) {
  int lane = threadIdx.x & 31, np = n / 32;
  for (int g0 = 0; g0 < n / 8; g0 += 32) {  // 32 groups of 8 = two blocks
    int gi = g0 + lane;
    float s = 0.f, xs = 0.f;
    if (gi < n / 8) {
      float f[8];
      load8(v, 8 * gi, f);
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
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) {  // within each half-warp: one block
      s += __shfl_xor_sync(0xffffffffu, s, o);
      xs += __shfl_xor_sync(0xffffffffu, xs, o);
    }
    int b = (g0 + lane) / 16;
    if ((lane & 15) == 0 && b < n / 128) sums[b] = make_float2(s, xs);
  }
}

// One block (step) of two rows: the 16-byte pieces wa (row g) and wb (row g + 8) of this lane against staged quarter
// xq[0..3]; returns D for rows g and g + 8 (column 0 of the tile, every column being equal).
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

__device__ __forceinline__ void group_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// gate_up with S blocks of 128 codes per warp (H = 128 * S * MMA_KS)
template <int S>
__device__ void gate_up_mma(const __half* x, const __half* logits, const long long* given, const void* w1,
                            const __half* s1, const uint8_t* z1, const __half* b1, float* act, int t, int H, int I,
                            int E, int K, int flags, int alpha_b, int beta_b, int limit_b) {
  __shared__ __align__(16) uint4 xs[WARPS][S * 16];
  __shared__ float2 sums[WARPS][S];
  __shared__ float red[WARPS][16];
  int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, tok = blockIdx.x;
  constexpr int spw = S;
  int kw = warp % MMA_KS, lw = warp / MMA_KS;
  if (blockIdx.y == 0 && threadIdx.x < K) {  // the routing behind the act rows, as moe_gate_up leaves it
    long long e = given[(long long)tok * K + threadIdx.x];
    bool ok = e >= 0 && e < E;
    float* tail = act + (long long)t * K * I + 2LL * K * tok;
    tail[threadIdx.x] = ok ? __half2float(logits[(long long)tok * K + threadIdx.x]) : 0.f;
    tail[K + threadIdx.x] = __int_as_float(ok ? (int)e : -1);
  }
  float alpha = bits(alpha_b), beta = bits(beta_b), limit = bits(limit_b);
  int nb = H / 128, np = spw * 4, ng = K * I / 8, rpe = I / 8;
  bool staged = false;
  for (int n = blockIdx.y * MMA_GPW + lw; n < ng; n += gridDim.y * MMA_GPW) {
    int j = n / rpe, r = (n - j * rpe) * 8 + g;
    long long e = given[(long long)tok * K + j];
    bool ok = e >= 0 && e < E;
    long long ra = (ok ? e : 0) * 2 * I + r, rb = ra + I;
    const uint4* pa = (const uint4*)((const uint8_t*)w1 + ra * (H / 2));
    const uint4* pb = (const uint4*)((const uint8_t*)w1 + rb * (H / 2));
    uint4 wa[S], wb[S];
    float sa[S], sb[S], za[S], zb[S];
#pragma unroll
    for (int s = 0; s < S; ++s) {
      int blk = kw * spw + s, q = blk * 4 + c;
      wa[s] = __ldg(pa + q), wb[s] = __ldg(pb + q);
      sa[s] = __half2float(__ldg(s1 + ra * nb + blk)), sb[s] = __half2float(__ldg(s1 + rb * nb + blk));
      za[s] = (flags & ZERO_POINTS) ? (float)__ldg(z1 + ra * nb + blk) : 8.f;
      zb[s] = (flags & ZERO_POINTS) ? (float)__ldg(z1 + rb * nb + blk) : 8.f;
    }
    if (!staged) {  // this warp's part of x, once, while its first loads fly
      stage_mma(x + (long long)tok * H + kw * spw * 128, spw * 128, xs[warp], sums[warp]);
      __syncwarp();
      staged = true;
    }
    float ga = 0.f, ub = 0.f;
#pragma unroll
    for (int s = 0; s < S; ++s) {
      float2 d = mma_step(wa[s], wb[s], &xs[warp][s * 4 + c], np);
      float2 sm = sums[warp][s];
      ga += sa[s] * (d.x - 1024.f * sm.x - za[s] * sm.y);
      ub += sb[s] * (d.y - 1024.f * sm.x - zb[s] * sm.y);
    }
    if (c == 0) red[warp][g] = ga, red[warp][8 + g] = ub;
    group_barrier(1 + lw, MMA_KS * 32);
    if (kw == 0 && c == 0) {
      float gs = 0.f, us = 0.f;
#pragma unroll
      for (int k2 = 0; k2 < MMA_KS; ++k2) gs += red[lw * MMA_KS + k2][g], us += red[lw * MMA_KS + k2][8 + g];
      float out = 0.f;
      if (ok) {
        if (flags & BIAS) gs += ld(b1, e * 2 * I + r), us += ld(b1, e * 2 * I + I + r);
        out = swiglu(gs, us, alpha, beta, limit);
      }
      act[((long long)tok * K + j) * I + r] = out;
    }
    group_barrier(1 + lw, MMA_KS * 32);  // red is written again by the next group
  }
}

extern "C" __global__ void __launch_bounds__(THREADS) moe_gate_up_f16(
    const __half* x, const __half* logits, const long long* given, const void* w1, const __half* s1,
    const uint8_t* z1, const __half* b1, float* act, int t, int H, int I, int E, int K, int bs, int flags,
    int alpha_b, int beta_b, int limit_b) {
  int nst = H / 128, spw = nst / MMA_KS;
  if (!(flags & F16) || !(flags & INT4) || !(flags & ROUTED) || bs != 128 || H % 128 || nst % MMA_KS || I % 8)
    __trap();
#define GU(S) gate_up_mma<S>(x, logits, given, w1, s1, z1, b1, act, t, H, I, E, K, flags, alpha_b, beta_b, limit_b)
  if (spw != MMA_GU_STEPS) __trap();
  GU(MMA_GU_STEPS);
#undef GU
}

// down with at most S blocks of 128 codes per warp (k * I <= 128 * S * WARPS)
template <int S>
__device__ void down_mma(const __half* logits, const long long* given, const float* act, const void* w2,
                         const __half* s2, const uint8_t* z2, const __half* b2, const __half* shared,
                         const __half* gate, __half* out, int H, int I, int E, int K, int flags) {
  __shared__ __align__(16) uint4 xs[WARPS][S * 16];
  __shared__ float2 sums[WARPS][S];
  __shared__ float red[WARPS][16];
  int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, tok = blockIdx.x;
  int nst = K * I / 128, st0 = warp * nst / WARPS, cnt = (warp + 1) * nst / WARPS - st0, nb = I / 128;
  bool staged = false;
  for (int h0 = blockIdx.y * 16; h0 < H; h0 += gridDim.y * 16) {
    uint4 wa[S], wb[S];
    float sa[S], sb[S], za[S], zb[S];
#pragma unroll
    for (int s = 0; s < S; ++s) {
      if (s >= cnt) break;
      int st = st0 + s, j = st / nb, blk = st - j * nb, q = blk * 4 + c;
      long long e = given[(long long)tok * K + j];
      bool ok = e >= 0 && e < E;
      float wj = ok ? __half2float(logits[(long long)tok * K + j]) : 0.f;
      long long ra = (ok ? e : 0) * H + h0 + g, rb = ra + 8;
      wa[s] = __ldg((const uint4*)((const uint8_t*)w2 + ra * (I / 2)) + q);
      wb[s] = __ldg((const uint4*)((const uint8_t*)w2 + rb * (I / 2)) + q);
      sa[s] = __half2float(__ldg(s2 + ra * nb + blk)) * wj, sb[s] = __half2float(__ldg(s2 + rb * nb + blk)) * wj;
      za[s] = (flags & ZERO_POINTS) ? (float)__ldg(z2 + ra * nb + blk) : 8.f;
      zb[s] = (flags & ZERO_POINTS) ? (float)__ldg(z2 + rb * nb + blk) : 8.f;
    }
    if (!staged) {  // this warp's steps of the token's k act rows (contiguous), while its first loads fly
      stage_mma(act + (long long)tok * K * I + st0 * 128, cnt * 128, xs[warp], sums[warp]);
      __syncwarp();
      staged = true;
    }
    float ya = 0.f, yb = 0.f;
#pragma unroll
    for (int s = 0; s < S; ++s) {
      if (s >= cnt) break;
      float2 d = mma_step(wa[s], wb[s], &xs[warp][s * 4 + c], cnt * 4);
      float2 sm = sums[warp][s];
      ya += sa[s] * (d.x - 1024.f * sm.x - za[s] * sm.y);
      yb += sb[s] * (d.y - 1024.f * sm.x - zb[s] * sm.y);
    }
    if (c == 0) red[warp][g] = ya, red[warp][8 + g] = yb;
    __syncthreads();
    if (threadIdx.x < 16) {
      int row = h0 + threadIdx.x;
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) total += red[w][threadIdx.x];
      if (flags & BIAS)
        for (int j = 0; j < K; ++j) {
          long long e = given[(long long)tok * K + j];
          if (e >= 0 && e < E) total += __half2float(logits[(long long)tok * K + j]) * ld(b2, e * H + row);
        }
      st_out(out, (long long)tok * H + row, total, flags, shared, gate, tok);
    }
    __syncthreads();
  }
}

extern "C" __global__ void __launch_bounds__(THREADS) moe_down_f16(
    const __half* logits, const long long* given, const float* act, const void* w2, const __half* s2,
    const uint8_t* z2, const __half* b2, const __half* shared, const __half* gate, __half* out, int t, int H, int I,
    int E, int K, int bs, int flags, int alpha_b, int beta_b, int limit_b) {
  (void)t, (void)alpha_b, (void)beta_b, (void)limit_b;
  int most = (K * I / 128 + WARPS - 1) / WARPS;
  if (!(flags & F16) || !(flags & INT4) || !(flags & ROUTED) || bs != 128 || I % 128 || H % 16) __trap();
#define DN(S) down_mma<S>(logits, given, act, w2, s2, z2, b2, shared, gate, out, H, I, E, K, flags)
  if (most > MMA_DOWN_STEPS) __trap();
  DN(MMA_DOWN_STEPS);
#undef DN
}
