// A FusedMoE kernel tried and not shipped (BENCHMARKS.md, "`moe` on CUDA", "the layer in one launch, its weights
// streamed into shared memory"): a decode token's layer in one launch, for benchmarks/moe_cuda_kernels.py:
//     python benchmarks/moe_cuda_kernels.py --tokens 1 --variant stream=benchmarks/variants/moe_stream.cu[,MACRO...]
// (its rows are NAME/st; the shipped pair's rows NAME/mma come first). It builds on the shipped kernels' source
// (routing, the staging of x and of the act rows, the tensor-core steps, the down tile's store), included whole. Timing macros
// (wrong results on purpose):
// STREAM_COPY_ONLY returns once the workgroup's copies landed, STREAM_GATE_ONLY after publishing its gate_up range
// (no wait, no down), STREAM_NO_WAIT computes down without waiting for the other ranges, STREAM_NO_TILE copies no
// down tile; STREAM_NO_FENCE publishes with the release store alone (a correct variant).
#include "moe_cuda.cu"

// ---------------------------------------------------------------- one launch for a decode token, weights streamed
//
// moe_stream<S>x<D>_f16: a decode token's whole FusedMoE layer in one launch, for what the tensor-core pair takes
// (f16, INT4 blocks of 128, H = 1024 S for gate_up, k * I <= 1024 D for down) at T = 1 with H a multiple of 256.
// The same bindings and 13 push constants as moe_fused (gy1: the most gate_up groups of one range, gy2: unused),
// a 1-D grid of G workgroups (G >= H / 16) and, as the dispatch's dynamic shared memory, stream_layout(..).total below.
// At T = 1 the two kernels of the pair are bound by latency, not bandwidth: each waits for its first loads, and
// down starts only after gate_up's last workgroup (BENCHMARKS.md, "what bounds the tensor-core pair"). Here
// every workgroup, as soon as it knows the token's experts, issues cp.async copies of all the weight bytes it
// will use into shared memory: its range of gate_up groups (range r of G: groups r ng / G .. (r + 1) ng / G - 1
// of the k * I / 8 groups of 8 gate and 8 up rows) and its tile of down (rows 16 r .. 16 r + 15 of H, all k
// experts), about 175 KB a workgroup at the seeds' shapes, so the layer's bytes stream from HBM at once. Once
// its groups land it computes them (the tensor-core steps of the pair, reading the codes from shared memory;
// each warp its S blocks of H of every group), publishes its act values, waits until every range is published,
// then computes its down tile from the copy already in shared memory: one wait in the layer instead of a launch
// boundary.
//
// Ranges, the wait and why it ends. A workgroup's range is its arrival index a % G, where a counts the
// workgroups of every launch of this dispatch site (a 64-bit counter in this module's memory, zero when the
// driver loads it; every launch of a site has the same G, so launch n's workgroups get a = nG .. nG + G - 1 and
// know n = a / G). Publishing range r of launch n stores n + 1 in done[r]; the wait reads the G flags. Every
// range whose workgroup has arrived gets published without any wait, so the wait can only block on ranges whose
// workgroups have not started (a GPU with fewer SMs than G: workgroups that wait hold their SMs). The waiting
// workgroups therefore compute those ranges' gate_up groups themselves, each range taken by one of them
// (taken[r]: atomicMax to n + 1); a late workgroup that arrives afterwards computes its range again, writing the
// same act values and the same flag (the same arithmetic in the same order; other workgroups may be reading
// those act values meanwhile, which is a race on equal bits), and only then its down tile, which no other
// workgroup touches (the output is written once, as the addend it holds requires). No counter is ever reset: no
// atomic at the end of the launch. This assumes the launches of one site run one after another (one stream, no
// programmatic dependent launch) and all with the same G.
#define STREAM_SITES 256  // dispatch sites of a module
#define STREAM_MAX_G 256  // largest grid
__device__ unsigned long long moe_stream_arrive[STREAM_SITES];
__device__ unsigned long long moe_stream_done[STREAM_SITES][STREAM_MAX_G];
__device__ unsigned long long moe_stream_taken[STREAM_SITES][STREAM_MAX_G];

__device__ __forceinline__ void cp_async16(void* sh, const void* g) {
  unsigned s = (unsigned)__cvta_generic_to_shared(sh);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(g) : "memory");
}
// The same for the scales and zero points, whose bindings need not be 16-byte aligned: byte by byte otherwise
// (a few hundred bytes a workgroup, read at once).
__device__ __forceinline__ void copy16(void* sh, const void* g) {
  if (((uintptr_t)g & 15) == 0) {
    cp_async16(sh, g);
  } else {
#pragma unroll
    for (int b = 0; b < 16; ++b) ((uint8_t*)sh)[b] = __ldg((const uint8_t*)g + b);
  }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// wait until at most n of this thread's committed groups are still in flight (n is an immediate in PTX)
__device__ __forceinline__ void cp_async_wait(int n) {
  switch (n) {
    case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
    case 4: asm volatile("cp.async.wait_group 4;" ::: "memory"); break;
    case 5: asm volatile("cp.async.wait_group 5;" ::: "memory"); break;
    case 6: asm volatile("cp.async.wait_group 6;" ::: "memory"); break;
    case 7: asm volatile("cp.async.wait_group 7;" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 8;" ::: "memory"); break;
  }
}

// Shared-memory rows padded so that rows g and g + 1 of a tile fall on the two halves of the banks (a row's
// length plus 64 bytes modulo 128): the A-operand reads of a warp (8 rows x 4 pieces) are then conflict-free.
__host__ __device__ __forceinline__ int stream_stride(int bytes) { return bytes + (64 - bytes % 128 + 128) % 128; }
// The dynamic shared memory of moe_stream (moe_cuda_kernels.py's stream_layout computes the same): per gate_up
// group slot 16 rows of H / 2 bytes, their scales (16 x nb halves) and zero points (16 x nb bytes); the down
// tile's 16 rows of k * I / 2 bytes, k x 16 x nb2 scales and zero points; x staged (2H bytes) and its per-block
// sums; the act rows staged for down (8 warps x D steps x 256 bytes) and their sums.
struct StreamLayout {
  int gstride, gbytes, dstride, dbytes, gates, down, xs, xsum, as, asum, total;
};
__host__ __device__ __forceinline__ StreamLayout stream_layout(int H, int I, int K, int slots, int D) {
  StreamLayout L;
  int nb = H / 128, nb2 = I / 128;
  L.gstride = stream_stride(H / 2);
  L.gbytes = 16 * L.gstride + 48 * nb;
  L.dstride = stream_stride(K * I / 2);
  L.dbytes = 16 * L.dstride + 48 * K * nb2;
  L.gates = 0;
  L.down = slots * L.gbytes;
  L.xs = L.down + L.dbytes;
  L.xsum = L.xs + 2 * H;
  L.as = L.xsum + 8 * (H / 128);
  L.asum = L.as + WARPS * D * 256;
  L.total = L.asum + WARPS * D * 8;
  return L;
}

// The workgroup's copies of gate_up group n (8 gate and 8 up rows of the token's expert n / (I / 8)) into slot
// gb: codes row by row, then the two 8-row runs of scales and of zero points (each contiguous in s1 / z1).
__device__ __forceinline__ void stream_copy_group(uint8_t* gb, int n, const long long* ids, const uint8_t* w1,
                                                  const __half* s1, const uint8_t* z1, int H, int I, int flags,
                                                  int gstride) {
  int lane = threadIdx.x, nb = H / 128, rpe = I / 8, j = n / rpe, r0 = (n - j * rpe) * 8, pieces = H / 32;
  long long e = ids[j] >= 0 ? ids[j] : 0;
  long long ga = e * 2 * I + r0, gu = ga + I;
  for (int p = lane; p < 16 * pieces; p += THREADS) {
    int row = p / pieces, q = p - row * pieces;
    long long src = row < 8 ? ga + row : gu + row - 8;
    cp_async16(gb + row * gstride + q * 16, w1 + src * (H / 2) + q * 16);
  }
  uint8_t* sc = gb + 16 * gstride;
  for (int p = lane; p < 2 * nb; p += THREADS) {  // 8 rows x nb halves = nb pieces per run
    int run = p / nb, q = p - run * nb;
    copy16(sc + run * 16 * nb + q * 16, (const uint8_t*)(s1 + (run ? gu : ga) * nb) + q * 16);
  }
  if (flags & ZERO_POINTS)
    for (int p = lane; p < nb; p += THREADS) {  // 8 rows x nb bytes = nb / 2 pieces per run
      int run = p / (nb / 2), q = p - run * (nb / 2);
      copy16(sc + 32 * nb + run * 8 * nb + q * 16, z1 + (run ? gu : ga) * nb + q * 16);
    }
}

// The workgroup's copies of down's tile of rows h0 .. h0 + 15: for expert slot j, its 16 rows (contiguous in w2,
// I / 2 bytes each) at column j I / 2 of the tile's rows, its 16 x nb2 scales and zero points.
__device__ __forceinline__ void stream_copy_tile(uint8_t* db, int h0, const long long* ids, const uint8_t* w2,
                                                 const __half* s2, const uint8_t* z2, int H, int I, int K, int flags,
                                                 int dstride) {
  int nb2 = I / 128, pe = I / 32;
  for (int p = threadIdx.x; p < 16 * K * pe; p += THREADS) {
    int j = p / (16 * pe), rest = p - j * 16 * pe, row = rest / pe, q = rest - row * pe;
    long long e = ids[j] >= 0 ? ids[j] : 0;
    cp_async16(db + row * dstride + j * (I / 2) + q * 16, w2 + (e * H + h0 + row) * (I / 2) + q * 16);
  }
  uint8_t* sc = db + 16 * dstride;
  for (int p = threadIdx.x; p < 2 * K * nb2; p += THREADS) {  // 16 rows x nb2 halves = 2 nb2 pieces per expert
    int j = p / (2 * nb2), q = p - j * 2 * nb2;
    long long e = ids[j] >= 0 ? ids[j] : 0;
    copy16(sc + j * 32 * nb2 + q * 16, (const uint8_t*)(s2 + (e * H + h0) * nb2) + q * 16);
  }
  if (flags & ZERO_POINTS)
    for (int p = threadIdx.x; p < K * nb2; p += THREADS) {  // 16 rows x nb2 bytes = nb2 pieces per expert
      int j = p / nb2, q = p - j * nb2;
      long long e = ids[j] >= 0 ? ids[j] : 0;
      copy16(sc + 32 * K * nb2 + j * 16 * nb2 + q * 16, z2 + (e * H + h0) * nb2 + q * 16);
    }
}

// The range's gate_up groups n0 .. n1 - 1 from slots 0 .. (landed, every thread's copies waited for and a
// barrier): warp w takes its S blocks of H of every group at once (independent chains of tensor-core steps),
// the sums are reduced over the warps through red, then SwiGLU into act; then the range is published.
template <int S>
__device__ void stream_groups(const uint8_t* dyn, int gbytes, int n0, int n1, const long long* ids, const __half* b1,
                              float* act, int H, int I, int flags, int gstride, const uint4* xs, const float2* sums,
                              float (*red)[WARPS][16], float alpha, float beta, float limit, unsigned long long* flag,
                              unsigned long long value) {
  int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, nb = H / 128;
  float ya[WARPS], yb[WARPS];
#pragma unroll
  for (int i = 0; i < WARPS; ++i) {
    ya[i] = yb[i] = 0.f;
    if (n0 + i >= n1) break;
    const uint8_t* gb = dyn + i * gbytes;
    const __half* sc = (const __half*)(gb + 16 * gstride);
    const uint8_t* zp = gb + 16 * gstride + 32 * nb;
#pragma unroll
    for (int s = 0; s < S; ++s) {
      int blk = warp * S + s, q = blk * 4 + c;
      uint4 wa = *(const uint4*)(gb + g * gstride + q * 16), wb = *(const uint4*)(gb + (8 + g) * gstride + q * 16);
      float2 d = mma_step(wa, wb, xs + warp * S * 16 + s * 4 + c, S * 4), sm = sums[blk];
      float za = (flags & ZERO_POINTS) ? (float)zp[g * nb + blk] : 8.f;
      float zb = (flags & ZERO_POINTS) ? (float)zp[(8 + g) * nb + blk] : 8.f;
      ya[i] += __half2float(sc[g * nb + blk]) * (d.x - 1024.f * sm.x - za * sm.y);
      yb[i] += __half2float(sc[(8 + g) * nb + blk]) * (d.y - 1024.f * sm.x - zb * sm.y);
    }
  }
  if (c == 0)
#pragma unroll
    for (int i = 0; i < WARPS; ++i) {
      if (n0 + i >= n1) break;
      red[i][warp][g] = ya[i], red[i][warp][8 + g] = yb[i];
    }
  __syncthreads();
  if (threadIdx.x < 8 * (n1 - n0)) {
    int i = threadIdx.x / 8, gg = threadIdx.x & 7, n = n0 + i, rpe = I / 8, j = n / rpe, r = (n - j * rpe) * 8 + gg;
    long long e = ids[j];
    float gs = 0.f, us = 0.f, out = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) gs += red[i][w][gg], us += red[i][w][8 + gg];
    if (e >= 0) {
      if (flags & BIAS) gs += ld(b1, e * 2 * I + r), us += ld(b1, e * 2 * I + I + r);
      out = swiglu(gs, us, alpha, beta, limit);
    }
    act[(long long)j * I + r] = out;
  }
  __syncthreads();  // every act value stored
  if (threadIdx.x == 0) {
#ifndef STREAM_NO_FENCE
    __threadfence();
#endif
    asm volatile("st.release.gpu.u64 [%0], %1;" ::"l"(flag), "l"(value) : "memory");
  }
}

template <int S, int D>
__device__ void stream(const __half* x, const __half* logits, const long long* given, const uint8_t* w1,
                       const __half* s1, const uint8_t* z1, const __half* b1, const uint8_t* w2, const __half* s2,
                       const uint8_t* z2, const __half* b2, const __half* shared, const __half* gate, __half* out,
                       float* act, int H, int I, int E, int K, int flags, int alpha_b, int beta_b, int limit_b,
                       int slots, int site) {
  extern __shared__ __align__(16) uint8_t dyn[];
  __shared__ float red3[WARPS][WARPS][16];  // gate_up's sums: group, warp, row; down's: red3[0]
  float (*red)[16] = red3[0];
  __shared__ float wr[MAX_K];
  __shared__ long long ids[MAX_K];
  __shared__ unsigned long long arrival;
  __shared__ int job;
  int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, G = gridDim.x;
  int ng = K * I / 8, nb2 = I / 128, nst = K * I / 128;
  StreamLayout L = stream_layout(H, I, K, slots, D);
  unsigned long long* done = moe_stream_done[site];
  if (threadIdx.x == 32) arrival = atomicAdd(&moe_stream_arrive[site], 1ull);  // its round trip beside the routing
  if (warp == 0) route_warp(logits, given, 0, E, K, flags, ids, wr);
  const uint4* xs = (const uint4*)(dyn + L.xs);
  const float2* xsum = (const float2*)(dyn + L.xsum);
  stage_mma(x + warp * S * 128, S * 128, (uint4*)(dyn + L.xs) + warp * S * 16, (float2*)(dyn + L.xsum) + warp * S);
  __syncthreads();
  unsigned long long launch = arrival / G;
  int r = (int)(arrival % G), n0 = (int)((long long)r * ng / G), n1 = (int)((long long)(r + 1) * ng / G);
  int h0 = 16 * r;
  bool tile = h0 < H;
  // every copy this workgroup needs, in the order it needs them: its range's groups, then its tile
  for (int n = n0; n < n1; ++n)
    stream_copy_group(dyn + L.gates + (n - n0) * L.gbytes, n, ids, w1, s1, z1, H, I, flags, L.gstride);
  cp_async_commit();
#ifndef STREAM_NO_TILE
  if (tile) stream_copy_tile(dyn + L.down, h0, ids, w2, s2, z2, H, I, K, flags, L.dstride);
#endif
  cp_async_commit();
#ifdef STREAM_COPY_ONLY  // a variant for benchmarks/moe_cuda_kernels.py: the copies alone
  cp_async_wait(0);
  __syncthreads();
  return;
#endif
  float alpha = bits(alpha_b), beta = bits(beta_b), limit = bits(limit_b);
  cp_async_wait(1);  // the groups landed (the tile may still be in flight)
  __syncthreads();
  stream_groups<S>(dyn + L.gates, L.gbytes, n0, n1, ids, b1, act, H, I, flags, L.gstride, xs, xsum, red3, alpha, beta,
                   limit, done + r, launch + 1);
#ifdef STREAM_GATE_ONLY  // a variant: no wait, no down
  cp_async_wait(0);
  return;
#endif
#ifndef STREAM_NO_WAIT  // a variant: down without the wait
  // the wait: thread i watches ranges i, i + THREADS, ..; then thread 0 reads the arrivals: a range not published
  // whose workgroup has not arrived is taken and computed here (see above); otherwise poll again.
  for (;;) {
    bool pub = true;
    for (int i = threadIdx.x; i < G; i += THREADS) {
      unsigned long long v;
      asm volatile("ld.acquire.gpu.u64 %0, [%1];" : "=l"(v) : "l"(done + i) : "memory");
      pub &= v > launch;
    }
    if (__syncthreads_and(pub)) break;
    if (threadIdx.x == 0) {
      job = -1;
      unsigned long long a;
      asm volatile("ld.relaxed.gpu.u64 %0, [%1];" : "=l"(a) : "l"(&moe_stream_arrive[site]) : "memory");
      long long arrived = (long long)(a - launch * G);
      for (int i = (int)(arrived < G ? arrived : G); i < G; ++i) {
        unsigned long long v;
        asm volatile("ld.acquire.gpu.u64 %0, [%1];" : "=l"(v) : "l"(done + i) : "memory");
        if (v <= launch && atomicMax(&moe_stream_taken[site][i], launch + 1) <= launch) {
          job = i;
          break;
        }
      }
      if (job < 0) __nanosleep(64);
    }
    __syncthreads();
    if (job >= 0) {  // the range's groups into the slots (its own are done), then computed and published
      int j0 = (int)((long long)job * ng / G), j1 = (int)((long long)(job + 1) * ng / G);
      for (int n = j0; n < j1; ++n)
        stream_copy_group(dyn + L.gates + (n - j0) * L.gbytes, n, ids, w1, s1, z1, H, I, flags, L.gstride);
      cp_async_commit();
      cp_async_wait(0);
      __syncthreads();
      stream_groups<S>(dyn + L.gates, L.gbytes, j0, j1, ids, b1, act, H, I, flags, L.gstride, xs, xsum, red3, alpha,
                       beta, limit, done + job, launch + 1);
    }
  }
#endif
  __threadfence();  // as cooperative groups' grid sync does after its wait
  if (!tile) return;
  // down: this warp's blocks of the k act rows, then the tile's sums
  int st0 = warp * nst / WARPS, cnt = (warp + 1) * nst / WARPS - st0;
  uint4* as = (uint4*)(dyn + L.as) + warp * D * 16;
  float2* asum = (float2*)(dyn + L.asum) + warp * D;
  float f[(D + 1) / 2][8];  // the act rows were written in this launch: read through the L2 (CG)
  stage_load<(D + 1) / 2, true>(act + st0 * 128, cnt * 128, f);
  stage_store<(D + 1) / 2>(f, cnt * 128, as, asum);
  cp_async_wait(0);
  __syncthreads();
  const uint8_t* db = dyn + L.down;
  const __half* sd = (const __half*)(db + 16 * L.dstride);
  const uint8_t* zd = db + 16 * L.dstride + 32 * K * nb2;
  uint4 wa[D], wb[D];
  float sa[D], sb[D], za[D], zb[D];
#pragma unroll
  for (int s = 0; s < D; ++s) {
    if (s >= cnt) break;
    int st = st0 + s, j = st / nb2, blk = st - j * nb2, q = blk * 4 + c;
    float wj = ids[j] >= 0 ? wr[j] : 0.f;
    wa[s] = *(const uint4*)(db + g * L.dstride + j * (I / 2) + q * 16);
    wb[s] = *(const uint4*)(db + (g + 8) * L.dstride + j * (I / 2) + q * 16);
    sa[s] = __half2float(sd[(j * 16 + g) * nb2 + blk]) * wj;
    sb[s] = __half2float(sd[(j * 16 + g + 8) * nb2 + blk]) * wj;
    za[s] = (flags & ZERO_POINTS) ? (float)zd[(j * 16 + g) * nb2 + blk] : 8.f;
    zb[s] = (flags & ZERO_POINTS) ? (float)zd[(j * 16 + g + 8) * nb2 + blk] : 8.f;
  }
  float2 y = mma_rows<D>(wa, wb, sa, sb, za, zb, cnt, as, asum, c);
  if (c == 0) red[warp][g] = y.x, red[warp][8 + g] = y.y;
  __syncthreads();
  store_down_tile(red, h0, 0, H, K, flags, b2, [&](int j) { return wr[j]; }, [&](int j) { return ids[j]; }, out,
                  shared, gate, 0);
}

// Launched only where moe_cuda_kernels.py's stream_layout holds; anything else traps rather than
// computing a wrong sum: another shape, T != 1, a grid outside [H / 16, STREAM_MAX_G], a site past
// STREAM_SITES, or less dynamic shared memory than the layout needs.
#define STREAM(S, D)                                                                                             \
  extern "C" __global__ void __launch_bounds__(THREADS, 1) moe_stream##S##x##D##_f16(                            \
      const __half* x, const __half* logits, const long long* given, const uint8_t* w1, const __half* s1,        \
      const uint8_t* z1, const __half* b1, const uint8_t* w2, const __half* s2, const uint8_t* z2,               \
      const __half* b2, const __half* shared, const __half* gate, __half* out, float* act, int t, int H, int I,  \
      int E, int K, int bs, int flags, int alpha_b, int beta_b, int limit_b, int gy1, int gy2, int site) {       \
    (void)gy2;                                                                                                   \
    unsigned smem;                                                                                               \
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem));                                                        \
    int ng = K * I / 8, G = gridDim.x;                                                                           \
    if (!mma_shape(flags, bs, H, I) || t != 1 || H != 128 * S * WARPS || K * I > 128 * D * WARPS || H % 256 ||   \
        G * 16 < H || G > STREAM_MAX_G || site < 0 || site >= STREAM_SITES || (ng + G - 1) / G > gy1 || gy1 > WARPS || \
        ((uintptr_t)w1 | (uintptr_t)w2) & 15 ||                                                                  \
        smem < (unsigned)stream_layout(H, I, K, gy1, D).total)                                                   \
      __trap();                                                                                                  \
    stream<S, D>(x, logits, given, w1, s1, z1, b1, w2, s2, z2, b2, shared, gate, out, act, H, I, E, K, flags,     \
                 alpha_b, beta_b, limit_b, gy1, site);                                                           \
  }
STREAM(2, 2)
STREAM(2, 4)
STREAM(2, 6)
STREAM(2, 8)
