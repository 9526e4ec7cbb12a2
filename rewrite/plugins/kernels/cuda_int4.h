// INT4 matrix-vector products against a vector staged in shared memory as half2, shared by the plugins' CUDA kernels
// for one row of activations (moe's FusedMoE fast path, matmul4's one-row kernels).
//
// Weights: rows of INT4 codes two per byte (even element in the low nibble), a 16-byte piece (32 codes) per lane per
// load, with one scale (half) and one zero point (uint8, or 8) per block of bs codes (bs a multiple of 32, so a
// piece lies in one block). The vector: staged once per workgroup (stage_group), scaled by 1/16 (VEC_SCALE: the
// range for half products of up to 4 codes) and laid out per 8 elements as (v0,v4),(v1,v5),(v2,v6),(v3,v7): the
// order in which the "magic number" conversion (code | 0x6400 is the half 1024 + code) takes two nibbles of a
// 32-bit word at once. Products and sums of 4 are in half2 (codes minus zero point are exact), the rest in f32.
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

#define VEC_SCALE 0.0625f  // staged vectors are scaled by 1/16 so half products of up to 4 codes stay finite

// Group g (elements 8g .. 8g + 7, as floats in f) of a vector of np pieces, staged in sh: scaled, permuted, and
// piece-major: the 16 bytes of piece P's quarter m (elements 32P + 8m ..) at uint4 index m * np + P, so the lanes of
// a warp reading quarter m of consecutive pieces read consecutive 16 bytes (four consecutive 16 bytes per lane, a
// 64-byte stride across the lanes, would be a 4-way shared-memory bank conflict on every read).
__device__ __forceinline__ void stage_group(__half2* sh, int np, int g, const float (&f)[8]) {
  __half2 h[4];
#pragma unroll
  for (int m = 0; m < 4; ++m) h[m] = __floats2half2_rn(f[m] * VEC_SCALE, f[m + 4] * VEC_SCALE);
  reinterpret_cast<uint4*>(sh)[(g & 3) * np + (g >> 2)] = *reinterpret_cast<const uint4*>(h);
}

// The four quarters of staged piece P of a vector of np pieces (see stage_group).
__device__ __forceinline__ void staged_piece(const __half2* sh, int np, int P, uint4 (&xv)[4]) {
#pragma unroll
  for (int m = 0; m < 4; ++m) xv[m] = reinterpret_cast<const uint4*>(sh)[m * np + P];
}

// sum over the 8 * NW codes of NW 32-bit words of (code - zp) * vector, word m against the staged quarter xv[m]
// (NW = 4: one 16-byte piece); zh = 1024 + zp.
template <int NW>
__device__ __forceinline__ float dot_words(const uint32_t (&words)[NW], const uint4 (&xv)[4], __half2 zh) {
  float acc = 0.f;
#pragma unroll
  for (int m = 0; m < NW; ++m) {
    const __half2* xp = reinterpret_cast<const __half2*>(&xv[m]);
    __half2 s = __float2half2_rn(0.f);
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      uint32_t b = ((words[m] >> (4 * n)) & 0x000F000Fu) | 0x64006400u;
      s = __hfma2(__hsub2(*reinterpret_cast<const __half2*>(&b), zh), xp[n], s);
    }
    float2 f = __half22float2(s);
    acc += f.x + f.y;
  }
  return acc;
}

// sum over the 32 codes of one 16-byte load of (code - zp) * vector, the vector's 16 half2 in xv; zh = 1024 + zp.
__device__ __forceinline__ float dot32(uint4 wv, const uint4 (&xv)[4], __half2 zh) {
#ifdef NO_DOT  // a variant for the kernel benchmarks: the loads without the arithmetic
  return __uint_as_float((wv.x ^ wv.y ^ wv.z ^ wv.w ^ xv[0].x) & 0x3f7fffffu);
#endif
  const uint32_t words[4] = {wv.x, wv.y, wv.z, wv.w};
  return dot_words<4>(words, xv, zh);
}

// One chunk of R rows (byte pointers to packed rows of Kd codes, their scale and zero-point rows; zrow null: zero
// point 8): a lane's U 16-byte pieces q0, q0 + 32, .. of each row with their scales and zero points (as the half
// 1024 + zp). Pieces past nq, and rows not live, read nothing and contribute 0.
template <int R, int U>
struct Chunk {
  uint4 wv[U][R];
  float sc[U][R];
  __half2 zh[U][R];
};
template <int R, int U>
__device__ __forceinline__ void load_chunk(Chunk<R, U>& c, const uint8_t* const (&rows)[R],
                                           const __half* const (&srow)[R], const uint8_t* const (&zrow)[R],
                                           const bool (&live)[R], int nq, int bs, int q0) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    int q = q0 + 32 * u, b = (32 * q) / bs;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      bool ok = live[r] && q < nq;
      c.wv[u][r] = ok ? __ldg(reinterpret_cast<const uint4*>(rows[r]) + q) : make_uint4(0, 0, 0, 0);
      c.sc[u][r] = ok ? __half2float(__ldg(srow[r] + b)) : 0.f;
      c.zh[u][r] = __float2half2_rn(1024.f + (ok && zrow[r] ? (float)__ldg(zrow[r] + b) : 8.f));
    }
  }
}

// R rows dotted with staged vectors of nq = Kd / 32 pieces: vec[0] for every row when ONE_VEC, else vec[r] for row
// r. Each lane's partial sums go to acc (not reduced across the warp, not unscaled: times 1 / VEC_SCALE after the
// warp's sum). A lane takes its pieces U at a time (q0, q0 + 32, ..): every load of a chunk (R rows x U pieces,
// their scales and zero points) is issued before the arithmetic, so a row of up to 1024 U codes costs one memory
// round trip. ``c``: the chunk registers; with ``loaded``, c already holds the chunk at q0 = lane (load_chunk),
// issued before the vector was staged.
template <int R, int U, bool ONE_VEC>
__device__ __forceinline__ void dot_rows(const uint8_t* const (&rows)[R], const __half* const (&srow)[R],
                                         const uint8_t* const (&zrow)[R], const bool (&live)[R], int Kd, int bs,
                                         const __half2* const (&vec)[R], float (&acc)[R], Chunk<R, U>& c,
                                         bool loaded) {
  int lane = threadIdx.x & 31, nq = Kd / 32;
  for (int q0 = lane; q0 < nq; q0 += 32 * U) {
    if (!loaded || q0 != lane) load_chunk(c, rows, srow, zrow, live, nq, bs, q0);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      int q = q0 + 32 * u;
      if (q >= nq) break;
      uint4 xv[4];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r == 0 || !ONE_VEC) staged_piece(vec[r], nq, q, xv);
        acc[r] += c.sc[u][r] * dot32(c.wv[u][r], xv, c.zh[u][r]);
      }
    }
  }
}
