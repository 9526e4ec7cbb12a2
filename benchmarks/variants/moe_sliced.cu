// A FusedMoE kernel tried and not shipped (BENCHMARKS.md, "`moe` on CUDA"): the layer in one launch, sliced along
// I, for benchmarks/moe_cuda_kernels.py:
//     python benchmarks/moe_cuda_kernels.py --variant sliced=benchmarks/variants/moe_sliced.cu[,MACRO...]
// It builds on the shipped kernels' source (routing, staging, the INT4 dot products), included whole. Timing
// macros (wrong results on purpose, except SLICE_COPIES and SLICE_U): TILED reads down's codes, scales and zero
// points as if they were laid out per slice (coalesced), NO_DOWN issues no down loads, NO_TAIL returns after the
// SwiGLU values (no down products, sums or store), NO_RED computes the products without adding them, X_FIRST issues
// x's loads before the weights'; SLICE_COPIES spreads the sums over that many accumulators.
#include "moe_cuda.cu"

// moe_sliced<S>_<el>: a 1-D grid of T * k * ceil(I / S) workgroups, item n = ((t * k) + j) * ceil(I / S) + s: token
// t, its expert slot j, rows s*S .. s*S+S-1 of I. A workgroup computes its S SwiGLU values (the gate and up rows of
// its slice, H codes each) and then their part of the down projection for every row of H (the S codes of each down
// row that multiply them: 16 contiguous bytes at S = 32, one L2 sector with the neighbouring slice's), scaled by the
// expert's mixing weight, added into an f32 accumulator of the token with `red.global.add`. Every byte the layer
// reads is asked for at the start: the gate_up rows into registers, the down codes into shared memory by cp.async,
// so a decode layer is one burst of loads over every SM instead of two launches each with its own ramp. The last
// workgroup of a token to finish (a ticket per token) reads the token's sums, zeroes them for the next launch, adds
// the biases, the gated shared expert and the addend as moe_down does, and stores the row. The accumulators and
// tickets are this module's own memory per dispatch site (zero when the driver loads the module, zero again after
// every launch), sized for T * H <= SLICE_ACC. Fast path only: f16, INT4 with block size a multiple of S, H a
// multiple of 256 and H * S / 2 bytes within SLICE_DOWN_BYTES.
#ifndef SLICE_SLOTS
#define SLICE_SLOTS 256
#endif
#define SLICE_ACC 16384        // floats of accumulator per site: T * H
#define SLICE_T 64             // tickets per site: tokens
#define SLICE_DOWN_BYTES 32768 // shared memory for the down codes of a slice: H * S / 2
#define SLICE_MAX_H(S) (SLICE_DOWN_BYTES * 2 / (S))  // largest H: 2048 at S = 32, 4096 at S = 16
#ifndef SLICE_U
#define SLICE_U 1              // gate_up: 16-byte pieces per lane per row in flight
#endif
#ifndef SLICE_MIN_BLOCKS
#define SLICE_MIN_BLOCKS 2
#endif
#ifndef SLICE_COPIES
#define SLICE_COPIES 1         // accumulators per site, workgroup n adding into copy n % SLICE_COPIES
#endif
__device__ float moe_slice_acc[SLICE_SLOTS][SLICE_COPIES][SLICE_ACC];
__device__ unsigned moe_slice_done[SLICE_SLOTS][SLICE_T];

template <int NB>
__device__ __forceinline__ void cp_async(void* smem, const void* g) {
  unsigned d = (unsigned)__cvta_generic_to_shared(smem);
  if constexpr (NB == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(g) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(d), "l"(g), "n"(NB) : "memory");
}

template <int S, typename T>
__device__ void sliced(const T* __restrict__ x, const T* __restrict__ logits, const long long* __restrict__ given,
                       const void* __restrict__ w1, const T* __restrict__ s1, const uint8_t* __restrict__ z1,
                       const T* __restrict__ b1, const void* __restrict__ w2, const T* __restrict__ s2,
                       const uint8_t* __restrict__ z2, const T* __restrict__ b2, const T* __restrict__ shared,
                       const T* __restrict__ gate, T* __restrict__ out, int tokens, int H, int I, int E, int K,
                       int bs, int flags, int alpha_b, int beta_b, int limit_b, int slot) {
  static_assert(S == 16 || S == 32, "a slice is 16 or 32 rows of I");
  constexpr int RPW = S / WARPS, R = 2 * RPW, NB = S / 2;  // rows of the slice per warp; down bytes per row of H
  __shared__ float w[MAX_K];
  __shared__ long long ids[MAX_K];
  __shared__ __align__(16) __half2 xsh[SLICE_MAX_H(S) / 2];
  __shared__ __align__(16) uint8_t dsh[SLICE_DOWN_BYTES];
  __shared__ __align__(16) __half2 ash[16];  // the slice's SwiGLU values, staged as one piece
  __shared__ float actf[S];
  __shared__ bool last;
  int ns = (I + S - 1) / S, n = blockIdx.x, s = n % ns, j = (n / ns) % K, t = n / (ns * K);
  int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  route(logits, given, t, E, K, flags, ids, w, nullptr);  // ends with a barrier
  long long e = ids[j];
  float wj = w[j];
  int nb1 = (H + bs - 1) / bs, nb2 = (I + bs - 1) / bs, b2i = (S * s) / bs;
  // the gate and up rows of this warp's RPW rows of the slice (row m of the warp: gate row r0 + m, up row I + r0 + m)
  int r0 = S * s + RPW * warp, nq = H / 32;
  long long g0 = (e < 0 ? 0 : e) * 2 * I + r0;
  const uint8_t* wg = (const uint8_t*)w1 + g0 * (H / 2);
  const __half* sg = (const __half*)s1 + g0 * nb1;
  const uint8_t* zg = z1 + g0 * nb1;
  long long up_w = (long long)I * (H / 2), up_s = (long long)I * nb1;
  Chunk<R, SLICE_U> chunk;
  auto load = [&](int q0) {
#pragma unroll
    for (int u = 0; u < SLICE_U; ++u) {
      int q = q0 + 32 * u, b = (32 * q) / bs;
#pragma unroll
      for (int m = 0; m < R; ++m) {
        long long rw = (m / 2) * (H / 2) + (m & 1) * up_w, rs = (m / 2) * nb1 + (m & 1) * up_s;
        bool ok = e >= 0 && r0 + m / 2 < I && q < nq;
        chunk.wv[u][m] = ok ? __ldg(reinterpret_cast<const uint4*>(wg + rw) + q) : make_uint4(0, 0, 0, 0);
        chunk.sc[u][m] = ok ? __half2float(__ldg(sg + rs + b)) : 0.f;
        chunk.zh[u][m] = __float2half2_rn(1024.f + (ok && (flags & ZERO_POINTS) ? (float)__ldg(zg + rs + b) : 8.f));
      }
    }
  };
#ifdef X_FIRST  // x's loads issued before the weights' (its staging after them)
  constexpr int XG = SLICE_MAX_H(S) / 8 / THREADS;  // groups of 8 values of x per thread
  uint4 xr[XG];
#pragma unroll
  for (int g = 0; g < XG; ++g) {
    int gi = threadIdx.x + THREADS * g;
    xr[g] = gi < H / 8 ? __ldg(reinterpret_cast<const uint4*>((const __half*)x + (long long)t * H) + gi) : make_uint4(0, 0, 0, 0);
  }
#endif
  load(lane);
  // the down codes of the slice for every row of H: this thread's rows h = threadIdx.x + THREADS * u
  constexpr int DU = SLICE_MAX_H(S) / THREADS;
  float dsc[DU];
  __half2 dzh[DU];
#pragma unroll
  for (int u = 0; u < DU; ++u) {
    int h = threadIdx.x + THREADS * u;
    bool ok = e >= 0 && h < H;
#ifdef NO_DOWN  // a timing variant: the gate_up half's loads alone
    ok = false;
#endif
    long long row = (e < 0 ? 0 : e) * H + h;
#ifdef TILED  // a timing variant: the same bytes read as if w2 were [E, I / S, H, S / 2] and s2, z2 [E, nb2, H]
    long long cw = (((e < 0 ? 0 : e) * ns + s) * H + h) * NB, cs = ((e < 0 ? 0 : e) * nb2 + b2i) * (long long)H + h;
#else
    long long cw = row * (I / 2) + s * NB, cs = row * nb2 + b2i;
#endif
    if (ok) cp_async<NB>(dsh + h * NB, (const uint8_t*)w2 + cw);
    dsc[u] = ok ? __half2float(__ldg((const __half*)s2 + cs)) * wj : 0.f;
    dzh[u] = __float2half2_rn(1024.f + (ok && (flags & ZERO_POINTS) ? (float)__ldg(z2 + cs) : 8.f));
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
#ifdef X_FIRST
#pragma unroll
  for (int g = 0; g < XG; ++g) {
    int gi = threadIdx.x + THREADS * g;
    if (gi >= H / 8) break;
    float f[8];
    const __half2* hp = reinterpret_cast<const __half2*>(&xr[g]);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      float2 v = __half22float2(hp[q]);
      f[2 * q] = v.x, f[2 * q + 1] = v.y;
    }
    stage_group(xsh, H / 32, gi, f);
  }
#else
  stage((const __half*)x + (long long)t * H, H, xsh);
#endif
  __syncthreads();
  float acc[R];
#pragma unroll
  for (int m = 0; m < R; ++m) acc[m] = 0.f;
  for (int q0 = lane; q0 < nq; q0 += 32 * SLICE_U) {
    if (q0 != lane) load(q0);
#pragma unroll
    for (int u = 0; u < SLICE_U; ++u) {
      int q = q0 + 32 * u;
      if (q >= nq) break;
      uint4 xv[4];
      staged_piece(xsh, nq, q, xv);
#pragma unroll
      for (int m = 0; m < R; ++m) acc[m] += chunk.sc[u][m] * dot32(chunk.wv[u][m], xv, chunk.zh[u][m]);
    }
  }
  float alpha = bits(alpha_b), beta = bits(beta_b), limit = bits(limit_b);
#pragma unroll
  for (int m = 0; m < RPW; ++m) {
    float g = warp_sum(acc[2 * m]) * (1.f / VEC_SCALE), u = warp_sum(acc[2 * m + 1]) * (1.f / VEC_SCALE);
    int r = S * s + RPW * warp + m;
    if (lane == 0) {
      float a = 0.f;
      if (e >= 0 && r < I) {
        if (flags & BIAS) g += ld(b1, e * 2 * I + r), u += ld(b1, e * 2 * I + I + r);
        a = swiglu(g, u, alpha, beta, limit);
      }
      actf[RPW * warp + m] = a;
    }
  }
  __syncthreads();
  if (threadIdx.x < 4) {  // stage the S values as piece 0 (quarters past S / 8 zero)
    float f[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) f[q] = 8 * threadIdx.x + q < S ? actf[8 * threadIdx.x + q] : 0.f;
    stage_group(ash, 1, threadIdx.x, f);
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();
#ifdef NO_TAIL  // a timing variant: the gate_up half alone, nothing accumulated or stored
  if (actf[0] != 1234.5f) return;
#endif
  float* accum = moe_slice_acc[slot][n % SLICE_COPIES] + (long long)t * H;
  if (e >= 0) {
    uint4 xv[4];
    staged_piece(ash, 1, 0, xv);
#pragma unroll
    for (int u = 0; u < DU; ++u) {
      int h = threadIdx.x + THREADS * u;
      if (h >= H) break;
      uint32_t words[NB / 4];
      if constexpr (NB == 16) {  // one 16-byte read: consecutive threads, consecutive 16 bytes
        uint4 c = reinterpret_cast<const uint4*>(dsh)[h];
        words[0] = c.x, words[1] = c.y, words[2] = c.z, words[3] = c.w;
      } else {
        uint2 c = reinterpret_cast<const uint2*>(dsh)[h];
        words[0] = c.x, words[1] = c.y;
      }
      float v = dsc[u] * dot_words<NB / 4>(words, xv, dzh[u]) * (1.f / VEC_SCALE);
#ifdef NO_RED  // a variant for the kernel benchmarks: no accumulation (wrong on purpose)
      if (v == 1234.5f) accum[h] = v;
#else
      atomicAdd(accum + h, v);  // a red: no result
#endif
    }
  }
  __syncthreads();  // the workgroup's sums are added; its fence is cumulative (as cooperative groups' grid sync)
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(&moe_slice_done[slot][t], 1u) == (unsigned)(K * ns - 1);
    if (last) __threadfence();  // every other workgroup's sums of this token, before they are read
  }
  __syncthreads();
  if (!last) return;
  for (int h = threadIdx.x; h < H; h += THREADS) {
    float v = 0.f;
#pragma unroll
    for (int c = 0; c < SLICE_COPIES; ++c) {
      float* a = moe_slice_acc[slot][c] + (long long)t * H + h;
      v += __ldcg(a);
      __stcg(a, 0.f);
    }
    if (flags & BIAS)
      for (int q = 0; q < K; ++q)
        if (ids[q] >= 0) v += w[q] * ld(b2, ids[q] * H + h);
    st_out(out, (long long)t * H + h, v, flags, shared, gate, t);
  }
  if (threadIdx.x == 0) moe_slice_done[slot][t] = 0u;
}

#define SLICED(name, S)                                                                                         \
  extern "C" __global__ void __launch_bounds__(THREADS, SLICE_MIN_BLOCKS) name(                                 \
      const __half* x, const __half* logits, const long long* given, const void* w1, const __half* s1,          \
      const uint8_t* z1, const __half* b1, const void* w2, const __half* s2, const uint8_t* z2, const __half* b2, \
      const __half* shared, const __half* gate, __half* out, int t, int H, int I, int E, int K, int bs, int flags, \
      int alpha_b, int beta_b, int limit_b, int slot) {                                                          \
    sliced<S>(x, logits, given, w1, s1, z1, b1, w2, s2, z2, b2, shared, gate, out, t, H, I, E, K, bs, flags,     \
              alpha_b, beta_b, limit_b, slot);                                                                   \
  }

SLICED(moe_sliced16_f16, 16)
SLICED(moe_sliced32_f16, 32)
