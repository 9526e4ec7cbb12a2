// GroupedAttention CUDA kernel for IREE's cuda target (extern dispatch; PTX for sm_80, which sm_90 runs).
//
// IREE CUDA dispatch ABI (samples/custom_dispatch/cuda/kernels in IREE): the bindings' base pointers in binding
// order (q, k, v, mask, k_new, v_new, position, y, part), then each push constant as a 32-bit integer: T, S, Hq,
// Hkv, msb, msh, mst, has_mask, scale_bits, n_new, splits, site.
// Layouts: the contract of ai.rewrite::GroupedAttention (rewrite/plugins/attention/op.py), row-major:
//   q [B, Hq, T, D], k and v [B, Hkv, S, D], y [B, Hq, T, D], one float type (f32 or f16); mask (when has_mask)
//   the same type, element (b, h, t, s) at b * msb + h * msh + t * mst + s (a stride is 0 where the mask
//   broadcasts); query head h reads K/V head h / (Hq / Hkv). With n_new > 0, k_new and v_new [B, Hkv, n_new, D]
//   replace the cache's rows p .. p + n_new (p = position[0] as int64, + S when negative, clamped to
//   [0, S - n_new] as the KVCacheUpdate lowering clamps): the cache as the step loaded it plus the step's rows,
//   read before the step writes them.
//   y[b, h, t] = softmax_s(round(round(q . k_s) * scale) + mask[b, h, t, s]) . v, the scores rounded to the
//   type as the ONNX MatMul and Mul they replace; the softmax and the product with V in float32 (online
//   softmax, seed 000's flash decode), y rounded once.
//
// Grid (Hq * splits, T, B), THREADS threads: workgroup (h * splits + z, t, b) computes split z of query row t of
// head h. Warp w of split z takes positions s = z * WARPS + w + splits * WARPS * i (so the splits share any prefix
// of visible positions evenly): lane i first reads the mask of the warp's i-th position (one load for 32
// positions), a ballot gives the visible ones (an unwritten slot of a static cache, a future position: -inf,
// skipped without reading K or V), then the warp reads the K and V rows of UNROLL visible positions at a time
// (independent loads in flight together: a decode step is latency-bound, not bandwidth-bound), each lane D / 32
// consecutive elements, and updates its running max, sum and accumulator. The warps' partial states are merged
// through shared memory. Query heads of one group read the same K/V rows: after the first, from L2. With one split
// the workgroup stores y; with more (split-KV, seed 000's flash decode: a decode row's positions over several
// workgroups, for 16 or 32 query heads on 132 SMs), each stores its state (max, sum, D weighted sums of V) in the
// f32 scratch binding part [B * Hq * T, splits, D + 2], takes a ticket of its row, and the last of the row's
// splits merges the states and stores y. The tickets are this module's own memory per dispatch site (push
// constant site < ATTN_SITES; rows < ATTN_ROWS), zero when the driver loads it and set back by the merging
// workgroup: launches of one site must not overlap (IREE's CUDA HAL runs a module's dispatches in stream order),
// and a launch aborted midway leaves its tickets behind until the module is loaded again.
//
// grouped_attention_rope_<el>_d<D> (the contract's rotary inputs): bindings q, k, v, mask, k_new, v_new, position,
// cos, sin, q_norm_weight, k_norm_weight, then y, part and k_rot; push constants as above, then cos's and sin's
// strides over B and T (csb, cst, ssb, sst: 0 where a table broadcasts), rope_flags (1: Q's norm, 2: K_new's) and
// the norm epsilon's bits. Q's row and each K_new row are rotated as they are read, by the rope kernel's own
// rotate_row (kernels/cuda_rope.h: the optional per-head RMSNorm first), and k_rot [B, Hkv, n, D] gets the rotated K_new
// rows (n = T: new row r is rotated by the tables' row r), each written by the first split of its group's first
// query head: what the cache stores.
#include <cuda_fp16.h>
#include <math_constants.h>
#include <stdint.h>

#include "../../kernels/cuda_rope.h"  // rotate_row (rope_cuda.cu's rotation)
#include "../../kernels/cuda_rows.h"  // to_f, store, rounded

#define THREADS 512  // CUDA_THREADS in op.py
#define WARPS (THREADS / 32)
#define UNROLL 4

// DL consecutive elements at p as floats (DL = D / 32: 1, 2, 4 or 8).
template <int DL>
__device__ __forceinline__ void load_row(const float* p, float* out) {
#pragma unroll
  for (int j = 0; j < DL; ++j) out[j] = p[j];
}
template <int DL>
__device__ __forceinline__ void load_row(const __half* p, float* out) {
  if (DL >= 2) {
#pragma unroll
    for (int j = 0; j < DL; j += 2) {
      float2 f = __half22float2(reinterpret_cast<const __half2*>(p)[j / 2]);
      out[j] = f.x, out[j + 1] = f.y;
    }
  } else {
    out[0] = __half2float(p[0]);
  }
}

// The tables and norm weights of the rotary variant (the header's last paragraph); null tables: no rotation.
template <typename T>
struct Rotary {
  const T* cos;
  const T* sin;
  const T* q_weight;  // null: no norm
  const T* k_weight;
  T* k_rot;
  int csb, cst, ssb, sst;
  float eps;
};

#define ATTN_SITES 1024  // CUDA_SPLIT_SITES in op.py: dispatch sites of a module that may split
#define ATTN_ROWS 128    // CUDA_SPLIT_ROWS in op.py: query rows (B * Hq * T) of a launch that splits
__device__ unsigned attn_tickets[ATTN_SITES][ATTN_ROWS];

template <typename T, int D>
__device__ void grouped_attention(const T* q, const T* k, const T* v, const T* mask, const T* k_new, const T* v_new,
                                  const int64_t* position, T* y, float* part, int Tq, int S, int Hq, int Hkv,
                                  int msb, int msh, int mst, int has_mask, float scale, int n_new, int splits,
                                  int site, const Rotary<T> rope) {
  constexpr int DL = D / 32;
  __shared__ float sh_m[WARPS], sh_l[WARPS];
  __shared__ float sh_acc[WARPS][D];
  __shared__ bool last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int h = blockIdx.x / splits, z = blockIdx.x - h * splits, t = blockIdx.y, b = blockIdx.z;
  const int stride = splits * WARPS;  // split z's warp w: positions z * WARPS + w + stride * i
  const int kvh = h / (Hq / Hkv);
  const float sc = rounded(scale, q);  // the Mul's constant in the model's type

  float qr[DL], acc[DL], m = -CUDART_INF_F, l = 0.f;
  load_row<DL>(q + ((size_t)(b * Hq + h) * Tq + t) * D + lane * DL, qr);
  // with the rotary inputs: the table rows of query row t (and of new row r = t)
  const T* crow = rope.cos ? rope.cos + (size_t)b * rope.csb + (size_t)t * rope.cst + lane * DL : nullptr;
  const T* srow = rope.cos ? rope.sin + (size_t)b * rope.ssb + (size_t)t * rope.sst + lane * DL : nullptr;
  if (rope.cos) rotate_row<DL>(qr, crow, srow, rope.q_weight ? rope.q_weight + lane * DL : nullptr, rope.eps);
#pragma unroll
  for (int j = 0; j < DL; ++j) acc[j] = 0.f;
  const T* kb = k + (size_t)(b * Hkv + kvh) * S * D + lane * DL;
  const T* vb = v + (size_t)(b * Hkv + kvh) * S * D + lane * DL;
  const T* mrow = has_mask ? mask + (size_t)b * msb + (size_t)h * msh + (size_t)t * mst : nullptr;
  int p = 0;  // the first of the new rows' positions
  if (n_new > 0) {
    const int64_t p0 = position[0] < 0 ? position[0] + S : position[0];
    p = (int)max((int64_t)0, min(p0, (int64_t)(S - n_new)));
  }
  const T* knb = k_new + (size_t)(b * Hkv + kvh) * n_new * D + lane * DL;
  const T* vnb = v_new + (size_t)(b * Hkv + kvh) * n_new * D + lane * DL;
  const T* kw = rope.k_weight ? rope.k_weight + lane * DL : nullptr;
  if (rope.cos && z == 0 && h % (Hq / Hkv) == 0 && warp == 0) {  // new row t of this K/V head, rotated, for the cache
    float kr0[DL];
    load_row<DL>(knb + (size_t)t * D, kr0);
    rotate_row<DL>(kr0, crow, srow, kw, rope.eps);
    T* out = rope.k_rot + ((size_t)(b * Hkv + kvh) * n_new + t) * D + lane * DL;
#pragma unroll
    for (int j = 0; j < DL; ++j) store(out + j, kr0[j]);
  }

  for (int base = z * WARPS + warp; base < S; base += stride * 32) {  // 32 positions of this warp: base + stride * i
    const int mine = base + stride * lane;
    const float add = (has_mask && mine < S) ? to_f(mrow[mine]) : 0.f;
    unsigned todo = __ballot_sync(0xffffffffu, mine < S && add != -CUDART_INF_F);
    while (todo) {
      int lanes[UNROLL];
      int n = 0;
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        lanes[u] = todo ? __ffs(todo) - 1 : -1;
        if (todo) todo &= todo - 1, ++n;
      }
      float kr[UNROLL][DL], vr[UNROLL][DL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        if (u < n) {
          const int s = base + stride * lanes[u];
          const unsigned r = (unsigned)(s - p);  // a new row when r < n_new
          load_row<DL>(r < (unsigned)n_new ? knb + (size_t)r * D : kb + (size_t)s * D, kr[u]);
          load_row<DL>(r < (unsigned)n_new ? vnb + (size_t)r * D : vb + (size_t)s * D, vr[u]);
        }
      }
      if (rope.cos) {  // a new key row is rotated as it is read (the row r is warp-uniform)
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          if (u >= n) break;
          const unsigned r = (unsigned)(base + stride * lanes[u] - p);
          if (r < (unsigned)n_new)
            rotate_row<DL>(kr[u], rope.cos + (size_t)b * rope.csb + (size_t)r * rope.cst + lane * DL,
                              rope.sin + (size_t)b * rope.ssb + (size_t)r * rope.sst + lane * DL, kw, rope.eps);
        }
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        if (u >= n) break;
        float dot = 0.f;
#pragma unroll
        for (int j = 0; j < DL; ++j) dot += qr[j] * kr[u][j];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        const float a = __shfl_sync(0xffffffffu, add, lanes[u]);
        const float score = rounded(rounded(rounded(dot, q) * sc, q) + a, q);
        if (score == -CUDART_INF_F) continue;  // a finite mask that underflows the rounded sum
        const float mn = fmaxf(m, score);
        const float corr = __expf(m - mn), p = __expf(score - mn);
        l = l * corr + p;
#pragma unroll
        for (int j = 0; j < DL; ++j) acc[j] = acc[j] * corr + p * vr[u][j];
        m = mn;
      }
    }
  }
  if (lane == 0) sh_m[warp] = m, sh_l[warp] = l;
#pragma unroll
  for (int j = 0; j < DL; ++j) sh_acc[warp][lane * DL + j] = acc[j];
  __syncthreads();
  const int row = (b * Hq + h) * Tq + t;
  float* state = part + ((size_t)row * splits + z) * (D + 2);  // this split's state: max, sum, D sums
  for (int d = threadIdx.x; d < D; d += THREADS) {
    float mx = -CUDART_INF_F;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, sh_m[w]);
    float den = 0.f, num = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      if (sh_m[w] == -CUDART_INF_F) continue;
      const float f = __expf(sh_m[w] - mx);
      den += sh_l[w] * f, num += sh_acc[w][d] * f;
    }
    if (splits == 1) {
      store(y + (size_t)row * D + d, num / den);  // every position hidden: 0 / 0, NaN as Softmax
    } else {
      if (d == 0) state[0] = mx, state[1] = den;
      state[2 + d] = num;
    }
  }
  if (splits == 1) return;
  // split-KV (seed 000's flash decode): the last of the row's splits to finish merges their states
  __syncthreads();  // the workgroup's state is stored; thread 0's fence is cumulative (cooperative groups' grid sync)
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(&attn_tickets[site][row], 1u) == (unsigned)(splits - 1);
    if (last) __threadfence();  // the other splits' states, before they are read
  }
  __syncthreads();
  if (!last) return;
  const float* all = part + (size_t)row * splits * (D + 2);
  for (int d = threadIdx.x; d < D; d += THREADS) {
    float mx = -CUDART_INF_F;
    for (int zz = 0; zz < splits; ++zz) mx = fmaxf(mx, __ldcg(all + zz * (D + 2)));
    float den = 0.f, num = 0.f;
    for (int zz = 0; zz < splits; ++zz) {
      const float mz = __ldcg(all + zz * (D + 2));
      if (mz == -CUDART_INF_F) continue;
      const float f = __expf(mz - mx);
      den += __ldcg(all + zz * (D + 2) + 1) * f, num += __ldcg(all + zz * (D + 2) + 2 + d) * f;
    }
    store(y + (size_t)row * D + d, num / den);
  }
  if (threadIdx.x == 0) attn_tickets[site][row] = 0u;  // for the site's next launch (stream order)
}

#define CONSTS \
  int Tq, int S, int Hq, int Hkv, int msb, int msh, int mst, int has_mask, int scale_bits, int n_new, int splits, int site
#define KERNEL(T, el, D)                                                                                    \
  extern "C" __global__ void __launch_bounds__(THREADS) grouped_attention_##el##_d##D(                     \
      const T* q, const T* k, const T* v, const T* mask, const T* k_new, const T* v_new,                   \
      const int64_t* position, T* y, float* part, CONSTS) {                                               \
    grouped_attention<T, D>(q, k, v, mask, k_new, v_new, position, y, part, Tq, S, Hq, Hkv, msb, msh, mst, \
                            has_mask, __int_as_float(scale_bits), n_new, splits, site,                    \
                            Rotary<T>{nullptr, nullptr, nullptr, nullptr, nullptr, 0, 0, 0, 0, 0.f});     \
  }                                                                                                        \
  extern "C" __global__ void __launch_bounds__(THREADS) grouped_attention_rope_##el##_d##D(                \
      const T* q, const T* k, const T* v, const T* mask, const T* k_new, const T* v_new,                   \
      const int64_t* position, const T* cos, const T* sin, const T* q_weight, const T* k_weight, T* y,     \
      float* part, T* k_rot, CONSTS, int csb, int cst, int ssb, int sst, int rope_flags, int eps_bits) {   \
    grouped_attention<T, D>(q, k, v, mask, k_new, v_new, position, y, part, Tq, S, Hq, Hkv, msb, msh, mst, \
                            has_mask, __int_as_float(scale_bits), n_new, splits, site,                    \
                            Rotary<T>{cos, sin, (rope_flags & 1) ? q_weight : nullptr,                    \
                                      (rope_flags & 2) ? k_weight : nullptr, k_rot, csb, cst, ssb, sst,   \
                                      __int_as_float(eps_bits)});                                         \
  }

KERNEL(__half, f16, 32)
KERNEL(__half, f16, 64)
KERNEL(__half, f16, 128)
KERNEL(__half, f16, 256)
KERNEL(float, f32, 32)
KERNEL(float, f32, 64)
KERNEL(float, f32, 128)
KERNEL(float, f32, 256)
