// MoE router top-k for IREE llvm-cpu, linked statically, and for IREE CUDA through router_topk_cuda.cu (see rewrite/plugins/router/op.py, MoERouterTopK).
//
// Bare metal: no libc, no libm (built with -ffreestanding -fno-builtin); exp and the f16 <-> f32 conversions
// are implemented here. One workgroup routes ROUTER_TOPK_TOKENS consecutive tokens; per token:
//   mode 0 (softmax_topk): p = softmax(x) over all E experts (f32 result, exp and sum in double),
//                          then the k largest p;
//   mode 1 (topk_softmax): the k largest logits x, then softmax over those k;
//   mode 2 (topk):         the k largest x themselves (ONNX TopK, largest=1, sorted=1, last axis);
//   normalize: w /= sum(w) over the k selected weights;
//   grouped mode (sigmoid or softmax scores, selection bias, group-limited top-k, normalization, scaling):
//   route_grouped below, its own entry points router_grouped_<x>_<w>_workgroup;
//   sparsemixer mode (PhiMoE's two masked argmax rounds): route_sparsemixer_block, entry points
//   router_sparsemixer_<x>_<w>_workgroup.
// Selection is O(k*E): each round takes the largest value ordered after the previous pick in
// (value descending, index ascending) order, so among equal values the lower index comes first
// (ONNX TopK-11: "the element with the lower index will appear first"). In the plain modes a NaN ranks
// above every number, NaNs by index among themselves, as ONNX Runtime's TopK ranks them (a row of NaNs
// gives indices 0, 1, ..); in grouped mode NaN scores give unspecified (but in-bounds) indices.

#include <stddef.h>
#include <stdint.h>

// The same source builds the CUDA kernels (router_topk_cuda.cu includes it with ROUTER_CUDA defined): every
// function is then a device function and the llvm-cpu entry points below are left out.
#ifdef ROUTER_CUDA
#define ROUTER_FN static __device__
#define ROUTER_API __device__
#else
#define ROUTER_FN static
#define ROUTER_API
#endif

#ifndef ROUTER_TOPK_MAX_EXPERTS
#define ROUTER_TOPK_MAX_EXPERTS 1024
#endif
#ifndef ROUTER_TOPK_TOKENS
#define ROUTER_TOPK_TOKENS 64
#endif

typedef union { uint32_t u; float f; } f32_bits;
typedef union { uint64_t u; double d; } f64_bits;

// IEEE 754 binary16 -> binary32, exact for every pattern (subnormals, infinities, NaN payloads).
ROUTER_API float rewrite_router_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  f32_bits r;
  if (e == 0x1fu) {
    r.u = sign | 0x7f800000u | (m << 13);
  } else if (e == 0) {
    r.f = (float)m * 5.9604644775390625e-08f;  // m * 2^-24: exact (m < 2^10, power-of-two scale)
    r.u |= sign;
  } else {
    r.u = sign | ((e + 112u) << 23) | (m << 13);
  }
  return r.f;
}

// binary32 -> binary16, round to nearest even (IEEE 754 §4.3.1), overflow to infinity, NaN kept quiet.
ROUTER_API uint16_t rewrite_router_f32_to_f16(float f) {
  f32_bits v = {.f = f};
  uint16_t sign = (uint16_t)((v.u >> 16) & 0x8000u);
  uint32_t ax = v.u & 0x7fffffffu;
  if (ax >= 0x7f800000u) return sign | 0x7c00u | (ax > 0x7f800000u ? (uint16_t)(0x200u | ((ax >> 13) & 0x3ffu)) : 0);
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to infinity
  if (ax < 0x38800000u) {                        // below 2^-14: subnormal or zero
    if (ax <= 0x33000000u) return sign;          // <= 2^-25 rounds to 0 (2^-25 is a tie, to even)
    uint32_t e = ax >> 23, mant = (ax & 0x7fffffu) | 0x800000u, shift = 126u - e;
    uint32_t r = mant >> shift, rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return sign | (uint16_t)r;
  }
  uint32_t r = ax - 0x38000000u;  // rebias the exponent from 127 to 15
  uint32_t h = r >> 13, rem = r & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is still right
  return sign | (uint16_t)h;
}

// e^x in double: n = round(x / ln 2), r = x - n ln 2 (Cody-Waite split, exact for |n| < 2^11), degree-11
// Taylor polynomial on |r| <= 0.347 (truncation < 2e-14 relative), scaled by 2^n. Results below 2^-1022
// (x < -708) are flushed to 0: no float result of this kernel can see them.
ROUTER_FN double exp_d(double x) {
  if (x != x) return x;
  if (x < -708.0) return 0.0;
  if (x > 709.0) {
    f64_bits inf = {.u = 0x7ff0000000000000ull};
    return inf.d;
  }
  double kd = x * 1.4426950408889634;
  int64_t n = (int64_t)(kd + (kd >= 0.0 ? 0.5 : -0.5));
  double r = (x - (double)n * 6.93147180369123816490e-01) - (double)n * 1.90821492927058770002e-10;
  double p = 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  f64_bits scale = {.u = (uint64_t)(n + 1023) << 52};
  return p * scale.d;
}

// expf through exp_d, rounded once to float; exported for the accuracy test against numpy.
ROUTER_API float rewrite_router_expf(float x) { return (float)exp_d((double)x); }

// (a, i) before (b, j) in the plain modes' order: NaN first, then values descending, then indices ascending
// (-0 and +0 equal, as values)
ROUTER_FN int ranks_before(float a, size_t i, float b, size_t j) {
  int an = a != a, bn = b != b;
  if (an || bn) return an && (!bn || i < j);
  return a > b || (a == b && i < j);
}

// One token: x[e] logits (f16 when xh is set, else xf) -> idx[k], weights written as f32 (wf) or f16 (wh).
ROUTER_FN void route(const uint16_t* xh, const float* xf, size_t e, size_t k, size_t mode, size_t normalize,
                  float* wf, uint16_t* wh, int64_t* idx, float* buf) {
  for (size_t j = 0; j < e; ++j) buf[j] = xh ? rewrite_router_f16_to_f32(xh[j]) : xf[j];
  if (mode == 0) {
    float m = buf[0];
    for (size_t j = 1; j < e; ++j) if (buf[j] > m) m = buf[j];
    double s = 0.0;
    for (size_t j = 0; j < e; ++j) s += exp_d((double)buf[j] - (double)m);
    for (size_t j = 0; j < e; ++j) buf[j] = (float)(exp_d((double)buf[j] - (double)m) / s);
  }
  float pv = 0.0f;
  size_t pi = 0;
  for (size_t r = 0; r < k; ++r) {
    size_t best = e;
    for (size_t j = 0; j < e; ++j) {
      float v = buf[j];
      if (r > 0 && !ranks_before(pv, pi, v, j)) continue;
      if (best == e || ranks_before(v, j, buf[best], best)) best = j;
    }
    if (best == e) best = 0;  // not reached: k <= e distinct positions
    idx[r] = (int64_t)best;
    pv = buf[best];
    pi = best;
  }
  // Weights overwrite buf at the selected (distinct) positions once every value they depend on is read.
  if (mode == 1) {
    double m = (double)buf[idx[0]], s = 0.0;
    for (size_t r = 0; r < k; ++r) s += exp_d((double)buf[idx[r]] - m);
    for (size_t r = 0; r < k; ++r) buf[idx[r]] = (float)(exp_d((double)buf[idx[r]] - m) / s);
  }
  if (normalize) {
    double s = 0.0;
    for (size_t r = 0; r < k; ++r) s += (double)buf[idx[r]];
    for (size_t r = 0; r < k; ++r) buf[idx[r]] = (float)((double)buf[idx[r]] / s);
  }
  for (size_t r = 0; r < k; ++r) {
    if (wh) wh[r] = rewrite_router_f32_to_f16(buf[idx[r]]);
    else wf[r] = buf[idx[r]];
  }
}

// Workgroup `wg` routes tokens [wg*ROUTER_TOPK_TOKENS, min(t, (wg+1)*ROUTER_TOPK_TOKENS)) of x[t, e] into
// w[t, k] and idx[t, k] (row-major, llvm.bareptr ABI: base pointer then element offset per buffer).
ROUTER_FN void route_block(const uint16_t* xh, const float* xf, float* wf, uint16_t* wh, int64_t* idx,
                        size_t t, size_t e, size_t k, size_t wg, size_t mode, size_t normalize) {
  float buf[ROUTER_TOPK_MAX_EXPERTS];
  if (e == 0 || e > ROUTER_TOPK_MAX_EXPERTS || k == 0 || k > e) return;  // the lowering refuses these
  size_t t0 = wg * ROUTER_TOPK_TOKENS, t1 = t0 + ROUTER_TOPK_TOKENS < t ? t0 + ROUTER_TOPK_TOKENS : t;
  for (size_t i = t0; i < t1; ++i)
    route(xh ? xh + i * e : 0, xf ? xf + i * e : 0, e, k, mode, normalize, wf ? wf + i * k : 0,
          wh ? wh + i * k : 0, idx + i * k, buf);
}

#ifndef ROUTER_CUDA
#define ROUTER_ENTRY(NAME, XT, WT, XH, XF, WF, WH)                                                          \
  void NAME(const XT* x, size_t x_off, WT* w, size_t w_off, int64_t* idx, size_t idx_off, size_t t,        \
            size_t e, size_t k, size_t wg, size_t mode, size_t normalize) {                                \
    route_block(XH, XF, WF, WH, idx + idx_off, t, e, k, wg, mode, normalize);                               \
  }

ROUTER_ENTRY(router_topk_f32_f32_workgroup, float, float, 0, x + x_off, w + w_off, 0)
ROUTER_ENTRY(router_topk_f32_f16_workgroup, float, uint16_t, 0, x + x_off, 0, w + w_off)
ROUTER_ENTRY(router_topk_f16_f32_workgroup, uint16_t, float, x + x_off, 0, w + w_off, 0)
ROUTER_ENTRY(router_topk_f16_f16_workgroup, uint16_t, uint16_t, x + x_off, 0, 0, w + w_off)
#endif  // ROUTER_CUDA

// Grouped mode (DeepSeek-V3, GLM4-MoE, dots1 with groups; Ernie 4.5 with one group; reference:
// router_topk_reference in rewrite/plugins/router.py), one token, float32 throughout:
//   s = sigmoid(x) (scoring 0) or softmax(x) (scoring 1); c = s + bias;
//   group score = sum of the 2 largest c of each group; the topk_group best groups are kept, c = -inf elsewhere;
//   idx = top-k(c); w = s[idx]; when normalize: w /= max(sum(w) + eps, lo); w *= scale.
ROUTER_FN size_t pick(const float* v, size_t n, size_t r, float pv, size_t pi) {
  size_t best = n;  // the largest value ordered after (pv, pi) in (value descending, index ascending) order
  for (size_t j = 0; j < n; ++j) {
    if (r > 0 && !(v[j] < pv || (v[j] == pv && j > pi))) continue;
    if (best == n || v[j] > v[best]) best = j;
  }
  return best == n ? 0 : best;  // n only with NaN scores
}

typedef struct {
  size_t e, k, normalize, scoring, n_group, topk_group;
  float scale, eps, lo;
} grouped_params;

ROUTER_FN void route_grouped(const uint16_t* xh, const float* xf, const float* bias, const grouped_params* p,
                          float* wf, uint16_t* wh, int64_t* idx, float* s, float* c) {
  size_t e = p->e, k = p->k;
  for (size_t j = 0; j < e; ++j) s[j] = xh ? rewrite_router_f16_to_f32(xh[j]) : xf[j];
  if (p->scoring == 0) {
    for (size_t j = 0; j < e; ++j) s[j] = (float)(1.0 / (1.0 + exp_d(-(double)s[j])));
  } else {
    float m = s[0];
    for (size_t j = 1; j < e; ++j) if (s[j] > m) m = s[j];
    double sum = 0.0;
    for (size_t j = 0; j < e; ++j) sum += exp_d((double)s[j] - (double)m);
    for (size_t j = 0; j < e; ++j) s[j] = (float)(exp_d((double)s[j] - (double)m) / sum);
  }
  for (size_t j = 0; j < e; ++j) c[j] = s[j] + bias[j];
  if (p->n_group > 1) {
    size_t g_n = p->n_group, per = e / g_n;
    float gs[ROUTER_TOPK_MAX_EXPERTS / 2];
    unsigned char kept[ROUTER_TOPK_MAX_EXPERTS / 2];
    for (size_t g = 0; g < g_n; ++g) {
      size_t a = pick(c + g * per, per, 0, 0.0f, 0), b = pick(c + g * per, per, 1, c[g * per + a], a);
      gs[g] = c[g * per + a] + c[g * per + b];
      kept[g] = 0;
    }
    float pv = 0.0f;
    size_t pi = 0;
    for (size_t r = 0; r < p->topk_group; ++r) {
      pi = pick(gs, g_n, r, pv, pi);
      pv = gs[pi];
      kept[pi] = 1;
    }
    for (size_t j = 0; j < e; ++j) if (!kept[j / per]) c[j] = -__builtin_inff();
  }
  float pv = 0.0f, sum = 0.0f;
  size_t pi = 0;
  for (size_t r = 0; r < k; ++r) {
    pi = pick(c, e, r, pv, pi);
    pv = c[pi];
    idx[r] = (int64_t)pi;
    sum += s[pi];
  }
  float denom = sum + p->eps;
  if (denom < p->lo) denom = p->lo;
  for (size_t r = 0; r < k; ++r) {
    float w = s[idx[r]];
    if (p->normalize) w = w / denom;
    w = w * p->scale;
    if (wh) wh[r] = rewrite_router_f32_to_f16(w);
    else wf[r] = w;
  }
}

ROUTER_FN void route_grouped_block(const uint16_t* xh, const float* xf, const float* bias, float* wf, uint16_t* wh,
                                int64_t* idx, size_t t, size_t wg, grouped_params p) {
  float s[ROUTER_TOPK_MAX_EXPERTS], c[ROUTER_TOPK_MAX_EXPERTS];
  size_t e = p.e, k = p.k;
  // the lowering refuses what these checks catch; here they only keep every access in bounds
  if (e == 0 || e > ROUTER_TOPK_MAX_EXPERTS || k == 0 || k > e || p.n_group == 0 || e % p.n_group ||
      p.topk_group == 0 || p.topk_group > p.n_group || (p.n_group > 1 && e / p.n_group < 2))
    return;
  size_t t0 = wg * ROUTER_TOPK_TOKENS, t1 = t0 + ROUTER_TOPK_TOKENS < t ? t0 + ROUTER_TOPK_TOKENS : t;
  for (size_t i = t0; i < t1; ++i)
    route_grouped(xh ? xh + i * e : 0, xf ? xf + i * e : 0, bias, &p, wf ? wf + i * k : 0, wh ? wh + i * k : 0,
                  idx + i * k, s, c);
}

ROUTER_FN float bits_f32(size_t bits) {
  f32_bits v = {.u = (uint32_t)bits};
  return v.f;
}

// scale, eps and lo arrive as the bit patterns of float32 values (push constants are integers)
#ifndef ROUTER_CUDA
#define GROUPED_ENTRY(NAME, XT, WT, XH, XF, WF, WH)                                                          \
  void NAME(const XT* x, size_t x_off, const float* bias, size_t b_off, WT* w, size_t w_off, int64_t* idx,   \
            size_t idx_off, size_t t, size_t e, size_t k, size_t wg, size_t normalize, size_t scoring,       \
            size_t n_group, size_t topk_group, size_t scale_bits, size_t eps_bits, size_t lo_bits) {         \
    grouped_params p = {e, k, normalize, scoring, n_group, topk_group, bits_f32(scale_bits), bits_f32(eps_bits), \
                        bits_f32(lo_bits)};                                                                  \
    route_grouped_block(XH, XF, bias + b_off, WF, WH, idx + idx_off, t, wg, p);                              \
  }

GROUPED_ENTRY(router_grouped_f32_f32_workgroup, float, float, 0, x + x_off, w + w_off, 0)
GROUPED_ENTRY(router_grouped_f32_f16_workgroup, float, uint16_t, 0, x + x_off, 0, w + w_off)
GROUPED_ENTRY(router_grouped_f16_f32_workgroup, uint16_t, float, x + x_off, 0, w + w_off, 0)
GROUPED_ENTRY(router_grouped_f16_f16_workgroup, uint16_t, uint16_t, x + x_off, 0, 0, w + w_off)
#endif  // ROUTER_CUDA

// Sparsemixer mode (PhiMoE; reference: router_topk_reference(mode="sparsemixer")), one token, k = 2:
//   i1 = argmax(x), keep1 = !((x[i1] - x) / max(|x|, x[i1]) > thr), w1 = softmax(x | keep1)[i1];
//   x2 = x with x[i1] = -inf, i2 = argmax(x2), keep2 = !((x2[i2] - x) / max(|x|, x2[i2]) > thr),
//   w2 = softmax(x2 | keep2)[i2].
// thr = 2 * jitter_eps. Everything runs in float32, float16 logits included (what ONNX Runtime's CPU provider
// computes for the exported float16 graph); the softmax in double, rounded once to float. NaN ratios keep.
ROUTER_FN float mixer_weight(const float* x, const float* scores, size_t e, size_t i, float thr) {
  float m = scores[i];
  double mx = -__builtin_inf(), sum = 0.0;
  for (size_t j = 0; j < e; ++j) {
    float ax = x[j] < 0.0f ? -x[j] : x[j], factor = ax > m ? ax : m;
    if (!((m - x[j]) / factor > thr) && (double)scores[j] > mx) mx = (double)scores[j];
  }
  for (size_t j = 0; j < e; ++j) {
    float ax = x[j] < 0.0f ? -x[j] : x[j], factor = ax > m ? ax : m;
    if (!((m - x[j]) / factor > thr)) sum += exp_d((double)scores[j] - mx);
  }
  return (float)(exp_d((double)m - mx) / sum);
}

ROUTER_FN void route_sparsemixer_block(const uint16_t* xh, const float* xf, float* wf, uint16_t* wh, int64_t* idx,
                                    size_t t, size_t e, size_t k, size_t wg, float thr) {
  float x[ROUTER_TOPK_MAX_EXPERTS], x2[ROUTER_TOPK_MAX_EXPERTS];
  if (e < 2 || e > ROUTER_TOPK_MAX_EXPERTS || k != 2) return;  // the lowering refuses these
  size_t t0 = wg * ROUTER_TOPK_TOKENS, t1 = t0 + ROUTER_TOPK_TOKENS < t ? t0 + ROUTER_TOPK_TOKENS : t;
  for (size_t n = t0; n < t1; ++n) {
    for (size_t j = 0; j < e; ++j) x[j] = xh ? rewrite_router_f16_to_f32(xh[n * e + j]) : xf[n * e + j];
    size_t i1 = pick(x, e, 0, 0.0f, 0);  // first among equal maxima: ONNX ArgMax, select_last_index=0
    for (size_t j = 0; j < e; ++j) x2[j] = j == i1 ? -__builtin_inff() : x[j];
    size_t i2 = pick(x2, e, 0, 0.0f, 0);
    float w[2] = {mixer_weight(x, x, e, i1, thr), mixer_weight(x, x2, e, i2, thr)};
    idx[n * 2] = (int64_t)i1;
    idx[n * 2 + 1] = (int64_t)i2;
    for (size_t r = 0; r < 2; ++r) {
      if (wh) wh[n * 2 + r] = rewrite_router_f32_to_f16(w[r]);
      else wf[n * 2 + r] = w[r];
    }
  }
}

// thr arrives as the bit pattern of a float32 value (push constants are integers)
#ifndef ROUTER_CUDA
#define SPARSEMIXER_ENTRY(NAME, XT, WT, XH, XF, WF, WH)                                                     \
  void NAME(const XT* x, size_t x_off, WT* w, size_t w_off, int64_t* idx, size_t idx_off, size_t t,        \
            size_t e, size_t k, size_t wg, size_t thr_bits) {                                               \
    route_sparsemixer_block(XH, XF, WF, WH, idx + idx_off, t, e, k, wg, bits_f32(thr_bits));                \
  }

SPARSEMIXER_ENTRY(router_sparsemixer_f32_f32_workgroup, float, float, 0, x + x_off, w + w_off, 0)
SPARSEMIXER_ENTRY(router_sparsemixer_f32_f16_workgroup, float, uint16_t, 0, x + x_off, 0, w + w_off)
SPARSEMIXER_ENTRY(router_sparsemixer_f16_f32_workgroup, uint16_t, float, x + x_off, 0, w + w_off, 0)
SPARSEMIXER_ENTRY(router_sparsemixer_f16_f16_workgroup, uint16_t, uint16_t, x + x_off, 0, 0, w + w_off)
#endif  // ROUTER_CUDA
