// FusedMoE CPU kernels for IREE llvm-cpu (statically linked, llvm.bareptr ABI: base pointer then element
// offset per memref). Freestanding: no libc, no libm, no libgcc helpers (half floats are converted by hand).
//
// Layouts (contract of ai.rewrite::FusedMoE, rewrite/plugins/moe/lowering.py):
//   x       [T, H]   activations, f32 or f16 (flags & F16)
//   logits  [T, E]   router logits, same dtype as x
//   w1      [E, 2I, H] gate rows 0..I-1 then up rows I..2I-1: float (x's dtype), or INT4 codes packed two per
//           byte along H (even element in the low nibble) with scales s1 [E, 2I, nb] (x's dtype) and optional
//           uint8 zero points z1 [E, 2I, nb], nb = ceil(H / bs); value = (code - zp) * scale (ONNX
//           DequantizeLinear-21 blocked; zp = 8 when absent, ORT QMoE's symmetric convention)
//   w2      [E, H, I] the same way along I
//   b1, b2  [E, 2I], [E, H] biases (x's dtype) when BIAS, else a 1-element placeholder
//   ids     [T, k]   int64 experts when ROUTED (then logits holds the [T, k] mixing weights), else a placeholder
//   act     [T*k, I] f32 scratch: the SwiGLU of each (token, selected expert) pair
//   out     [T, H]   x's dtype
// Routing (seed 000, "Router"): p = softmax(logits[t]) in f32, top-k by value (lowest index first on ties),
// weights p[idx], renormalised when NORMALIZE; TOPK_SOFTMAX: softmax over the k selected logits instead;
// ROUTED: weights and experts as given (an expert id outside 0..E-1 contributes nothing: no read out of
// bounds). SwiGLU (seed 003 section 8): g = min(g, limit), u = clamp(u, -limit, limit) when limit > 0, then
// g * sigmoid(alpha * g) * (u + beta); alpha, beta, limit arrive as the bits of f32 values.
#include <stddef.h>
#include <stdint.h>

enum { F16 = 1, INT4 = 2, NORMALIZE = 4, TOPK_SOFTMAX = 8, ZERO_POINTS = 16, ROUTED = 32, BIAS = 64 };
#define MAX_K 64
#define ROWS 32 /* output rows per workgroup (must match ROWS_PER_WORKGROUP in lowering.py) */

static inline float half_to_float(uint16_t h) {
  uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, bits;
  if (e == 0) {
    if (m == 0) {
      bits = s;
    } else {  // subnormal: normalise
      e = 127 - 15 + 1;
      while (!(m & 0x400)) { m <<= 1; --e; }
      bits = s | (e << 23) | ((m & 0x3ff) << 13);
    }
  } else if (e == 31) {
    bits = s | 0x7f800000u | (m << 13);
  } else {
    bits = s | ((e + 127 - 15) << 23) | (m << 13);
  }
  union { uint32_t u; float f; } v = {bits};
  return v.f;
}

static inline uint16_t float_to_half(float f) {  // round to nearest even
  union { float f; uint32_t u; } v = {f};
  uint32_t u = v.u, s = (u >> 16) & 0x8000;
  int32_t e = (int32_t)((u >> 23) & 0xff) - 127 + 15;
  uint32_t m = u & 0x7fffff;
  if (((u >> 23) & 0xff) == 0xff) return (uint16_t)(s | 0x7c00 | (m ? 0x200 : 0));
  if (e >= 31) return (uint16_t)(s | 0x7c00);
  if (e <= 0) {
    if (e < -10) return (uint16_t)s;
    m |= 0x800000;
    uint32_t shift = (uint32_t)(14 - e), half = 1u << (shift - 1), r = m >> shift, rem = m & ((1u << shift) - 1);
    if (rem > half || (rem == half && (r & 1))) ++r;
    return (uint16_t)(s | r);
  }
  uint32_t r = ((uint32_t)e << 10) | (m >> 13), rem = m & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) ++r;
  return (uint16_t)(s | r);
}

static inline float load(const void* p, size_t i, int f16) {
  return f16 ? half_to_float(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

// exp for the softmax / sigmoid (no libm): exp(x) = 2^n * e^r, |r| <= ln2/2, degree-7 Taylor for e^r.
static inline float fexp(float x) {
  if (x < -87.0f) return 0.0f;
  if (x > 88.0f) x = 88.0f;
  float n = (float)(int)(x * 1.44269504f + (x >= 0 ? 0.5f : -0.5f));
  float r = x - n * 0.693145752f - n * 1.42860677e-6f;
  float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.6666667e-1f + r * (4.1666668e-2f + r * (8.3333338e-3f + r * (1.3888889e-3f + r * 1.9841270e-4f))))));
  union { uint32_t u; float f; } v = {(uint32_t)((int)n + 127) << 23};
  return p * v.f;
}

static inline float bits_to_float(size_t b) {
  union { uint32_t u; float f; } v = {(uint32_t)b};
  return v.f;
}

// Top-k experts of token t and their routing weights (ROUTED: read from logits [T, k] and given [T, k]).
static void route(const void* logits, const int64_t* given, size_t t, size_t E, size_t K, size_t flags, int64_t* ids,
                  float* w) {
  int f16 = flags & F16;
  if (flags & ROUTED) {
    for (size_t j = 0; j < K; ++j) {
      int64_t e = given[t * K + j];
      int ok = e >= 0 && e < (int64_t)E;
      ids[j] = ok ? e : -1;
      w[j] = ok ? load(logits, t * K + j, f16) : 0.0f;
    }
    return;
  }
  float mx = -3.4e38f;
  for (size_t e = 0; e < E; ++e) { float v = load(logits, t * E + e, f16); if (v > mx) mx = v; }
  for (size_t j = 0; j < K; ++j) {
    int64_t best = -1; float bv = 0;
    for (size_t e = 0; e < E; ++e) {
      int taken = 0;
      for (size_t q = 0; q < j; ++q) taken |= ids[q] == (int64_t)e;
      float v = load(logits, t * E + e, f16);
      if (!taken && (best < 0 || v > bv)) { best = (int64_t)e; bv = v; }
    }
    ids[j] = best;
    w[j] = fexp(bv - mx);  // softmax numerators; top-k of logits = top-k of probabilities
  }
  float denom = 0;
  if (flags & (NORMALIZE | TOPK_SOFTMAX)) {
    for (size_t j = 0; j < K; ++j) denom += w[j];
  } else {
    for (size_t e = 0; e < E; ++e) denom += fexp(load(logits, t * E + e, f16) - mx);
  }
  for (size_t j = 0; j < K; ++j) w[j] /= denom;
}

// Branch-free half -> float (vectorizable): exponent rebias by a float multiply (handles zero and subnormals),
// Inf/NaN kept by a select.
static inline float half_bits_to_float(uint16_t h) {
  union { uint32_t u; float f; } v = {(uint32_t)(h & 0x7fff) << 13}, inf = {((uint32_t)(h & 0x7fff) << 13) | 0x7f800000u};
  float f = v.f * 0x1p112f;
  f = (h & 0x7c00) == 0x7c00 ? inf.f : f;
  union { float f; uint32_t u; } r = {f};
  r.u |= (uint32_t)(h & 0x8000) << 16;
  return r.f;
}

#define LANES 8 /* independent partial sums: lets gcc -O3 vectorize the reductions (no -ffast-math) */

static inline float hsum(const float* a) {
  float s = 0.0f;
  for (int l = 0; l < LANES; ++l) s += a[l];
  return s;
}

static float dot_f32(const float* restrict p, const float* restrict v, size_t n) {
  float acc[LANES] = {0};
  size_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; ++l) acc[l] += p[i + l] * v[i + l];
  float s = hsum(acc);
  for (; i < n; ++i) s += p[i] * v[i];
  return s;
}

static float dot_f16(const uint16_t* restrict p, const float* restrict v, size_t n) {
  float acc[LANES] = {0};
  size_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; ++l) acc[l] += half_bits_to_float(p[i + l]) * v[i + l];
  float s = hsum(acc);
  for (; i < n; ++i) s += half_bits_to_float(p[i]) * v[i];
  return s;
}

// An activation vector prepared for INT4 rows: even / odd elements apart (ve, vo, ceil(n/2) each, odd tail 0)
// and the sum of each block (the zero-point term is zp * scale * sum(v over the block), the same for every row).
typedef struct { float* ve; float* vo; float* bsum; } q4vec;

static void prepare_q4(const float* v, size_t n, size_t bs, q4vec q) {
  size_t half = (n + 1) / 2, nb = (n + bs - 1) / bs;
  for (size_t j = 0; j < half; ++j) {
    q.ve[j] = v[2 * j];
    q.vo[j] = 2 * j + 1 < n ? v[2 * j + 1] : 0.0f;
  }
  for (size_t b = 0; b < nb; ++b) {
    float s = 0.0f;
    for (size_t i = b * bs; i < n && i < (b + 1) * bs; ++i) s += v[i];
    q.bsum[b] = s;
  }
}

// sum_i (code_i - zp_b) * scale_b * v_i over one packed row of n codes
static float dot_q4(const uint8_t* restrict codes, const void* scales, const uint8_t* zps, size_t n, size_t bs,
                    int f16, q4vec q) {
  size_t nb = (n + bs - 1) / bs, half = (n + 1) / 2;
  float total = 0.0f;
  for (size_t b = 0; b < nb; ++b) {
    size_t j0 = b * bs / 2, j1 = (b + 1) * bs / 2 < half ? (b + 1) * bs / 2 : half;
    float acc[LANES] = {0};
    size_t j = j0;
    for (; j + LANES <= j1; j += LANES)
      for (int l = 0; l < LANES; ++l) {
        uint8_t c = codes[j + l];
        acc[l] += (float)(c & 15) * q.ve[j + l] + (float)(c >> 4) * q.vo[j + l];
      }
    float part = hsum(acc);
    for (; j < j1; ++j) part += (float)(codes[j] & 15) * q.ve[j] + (float)(codes[j] >> 4) * q.vo[j];
    float zp = zps ? (float)zps[b] : 8.0f;
    total += load(scales, b, f16) * (part - zp * q.bsum[b]);
  }
  return total;
}

// dot(row r of expert e of a [E, N, Kd] weight, v): float rows read v, INT4 rows the prepared q.
static inline float row_dot(const void* w, const void* s, const uint8_t* z, size_t e, size_t r, size_t N, size_t Kd,
                            size_t bs, size_t flags, const float* v, q4vec q) {
  int f16 = flags & F16;
  size_t row = e * N + r;
  if (!(flags & INT4))
    return f16 ? dot_f16((const uint16_t*)w + row * Kd, v, Kd) : dot_f32((const float*)w + row * Kd, v, Kd);
  size_t nb = (Kd + bs - 1) / bs;
  const void* srow = f16 ? (const void*)((const uint16_t*)s + row * nb) : (const void*)((const float*)s + row * nb);
  return dot_q4((const uint8_t*)w + row * ((Kd + 1) / 2), srow, (flags & ZERO_POINTS) ? z + row * nb : 0, Kd, bs, f16, q);
}

// Workgroup (pair, row block): act[pair, rows] = SwiGLU(gate, up) for pair = t * K + j.
void moe_gate_up_swiglu(const void* x, size_t x_off, const void* logits, size_t l_off, const int64_t* given,
                        size_t g_off, const void* w1, size_t w1_off, const void* s1, size_t s1_off, const uint8_t* z1,
                        size_t z1_off, const void* b1, size_t b1_off, float* act, size_t act_off, size_t H, size_t I,
                        size_t E, size_t K, size_t bs, size_t flags, size_t alpha_bits, size_t beta_bits,
                        size_t limit_bits, size_t pair, size_t blk) {
  int f16 = flags & F16;
  size_t esz = f16 ? 2 : 4;
  x = (const char*)x + x_off * esz;
  logits = (const char*)logits + l_off * esz;
  given += g_off;
  b1 = (const char*)b1 + b1_off * esz;
  float alpha = bits_to_float(alpha_bits), beta = bits_to_float(beta_bits), limit = bits_to_float(limit_bits);
  w1 = (const char*)w1 + w1_off * ((flags & INT4) ? 1 : esz);
  s1 = (const char*)s1 + s1_off * esz;
  z1 += z1_off;
  act += act_off;
  size_t t = pair / K, j = pair % K;
  int64_t ids[MAX_K];
  float w[MAX_K];
  route(logits, given, t, E, K, flags, ids, w);
  size_t r0 = blk * ROWS, r1 = r0 + ROWS < I ? r0 + ROWS : I;
  if (ids[j] < 0) {  // an expert id out of range: nothing to compute
    for (size_t r = r0; r < r1; ++r) act[pair * I + r] = 0.0f;
    return;
  }
  float xbuf[f16 ? H : 1];  // f16 activations converted once; f32 ones are read in place
  const float* xv = (const float*)x + t * H;
  if (f16) {
    for (size_t i = 0; i < H; ++i) xbuf[i] = half_to_float(((const uint16_t*)x)[t * H + i]);
    xv = xbuf;
  }
  size_t q4n = (flags & INT4) ? (H + 1) / 2 : 1, q4b = (flags & INT4) ? (H + bs - 1) / bs : 1;
  float ve[q4n], vo[q4n], bsum[q4b];
  q4vec q = {ve, vo, bsum};
  if (flags & INT4) prepare_q4(xv, H, bs, q);
  size_t e = (size_t)ids[j];
  for (size_t r = r0; r < r1; ++r) {
    float g = row_dot(w1, s1, z1, e, r, 2 * I, H, bs, flags, xv, q);
    float u = row_dot(w1, s1, z1, e, I + r, 2 * I, H, bs, flags, xv, q);
    if (flags & BIAS) {
      g += load(b1, e * 2 * I + r, f16);
      u += load(b1, e * 2 * I + I + r, f16);
    }
    if (limit > 0.0f) {
      g = g < limit ? g : limit;
      u = u < -limit ? -limit : (u > limit ? limit : u);
    }
    act[pair * I + r] = g / (1.0f + fexp(-alpha * g)) * (u + beta);
  }
}

// Workgroup (token, row block): out[t, rows] = sum_j w_j * (W2[e_j] @ act[t * K + j]).
void moe_down_proj_reduce(const void* logits, size_t l_off, const int64_t* given, size_t g_off, const float* act,
                          size_t act_off, const void* w2, size_t w2_off, const void* s2, size_t s2_off,
                          const uint8_t* z2, size_t z2_off, const void* b2, size_t b2_off, void* out, size_t out_off,
                          size_t H, size_t I, size_t E, size_t K, size_t bs, size_t flags, size_t alpha_bits,
                          size_t beta_bits, size_t limit_bits, size_t t, size_t blk) {
  (void)alpha_bits, (void)beta_bits, (void)limit_bits;  // one argument list for both kernels
  int f16 = flags & F16;
  size_t esz = f16 ? 2 : 4;
  logits = (const char*)logits + l_off * esz;
  given += g_off;
  b2 = (const char*)b2 + b2_off * esz;
  act += act_off;
  w2 = (const char*)w2 + w2_off * ((flags & INT4) ? 1 : esz);
  s2 = (const char*)s2 + s2_off * esz;
  z2 += z2_off;
  out = (char*)out + out_off * esz;
  int64_t ids[MAX_K];
  float w[MAX_K];
  route(logits, given, t, E, K, flags, ids, w);
  size_t r0 = blk * ROWS, r1 = r0 + ROWS < H ? r0 + ROWS : H;
  size_t q4n = (flags & INT4) ? (I + 1) / 2 : 1, q4b = (flags & INT4) ? (I + bs - 1) / bs : 1;
  float ve[q4n], vo[q4n], bsum[q4b], acc[ROWS];
  q4vec q = {ve, vo, bsum};
  for (size_t r = r0; r < r1; ++r) acc[r - r0] = 0.0f;
  for (size_t j = 0; j < K; ++j) {  // expert by expert: each act vector is prepared once per workgroup
    if (ids[j] < 0) continue;
    const float* a = act + (t * K + j) * I;
    size_t e = (size_t)ids[j];
    if (flags & INT4) prepare_q4(a, I, bs, q);
    for (size_t r = r0; r < r1; ++r) {
      float d = row_dot(w2, s2, z2, e, r, H, I, bs, flags, a, q);
      if (flags & BIAS) d += load(b2, e * H + r, f16);
      acc[r - r0] += w[j] * d;
    }
  }
  for (size_t r = r0; r < r1; ++r) {
    if (f16) ((uint16_t*)out)[t * H + r] = float_to_half(acc[r - r0]);
    else ((float*)out)[t * H + r] = acc[r - r0];
  }
}
