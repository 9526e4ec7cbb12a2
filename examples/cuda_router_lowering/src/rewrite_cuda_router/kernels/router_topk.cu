// MoERouterTopK for IREE CUDA: one thread per token (an example kernel, not a fast one); router_topk_f32 and
// router_topk_f16 by the logits' type, weights f32.
//
// IREE CUDA dispatch ABI (samples/custom_dispatch/cuda/kernels in IREE): the bindings' base pointers in
// binding order, then each push constant as a 32-bit integer.
//   bindings: logits f32 or f16 [t, e] (read only), weights f32 [t, k], ids i64 [t, k]
//   constants: t, e (<= 1024), k (1..e), mode (0 softmax_topk, 1 topk_softmax, 2 topk), normalize (0/1)
// workgroup size [64, 1, 1], ceil(t / 64) workgroups.
// Semantics: rewrite/plugins/router/op.py router_topk_reference; ties pick the lower expert index.

#include <cuda_fp16.h>

__device__ inline float load(const float* p, long long i) { return p[i]; }
__device__ inline float load(const __half* p, long long i) { return __half2float(p[i]); }

template <typename T>
__device__ void route(const T* __restrict__ logits, float* __restrict__ weights, long long* __restrict__ ids, int t,
                      int e, int k, int mode, int normalize) {
  int tok = blockIdx.x * blockDim.x + threadIdx.x;
  if (tok >= t) return;
  long long row = (long long)tok * e;
  float* w = weights + (long long)tok * k;
  long long* id = ids + (long long)tok * k;
  float mx = load(logits, row);
  for (int j = 1; j < e; ++j) mx = fmaxf(mx, load(logits, row + j));
  float den = 0.f;
  for (int j = 0; j < e; ++j) den += expf(load(logits, row + j) - mx);
  unsigned taken[32] = {0};
  float sum = 0.f, first = 0.f;
  for (int s = 0; s < k; ++s) {
    int best = -1;
    float xb = 0.f;
    for (int j = 0; j < e; ++j) {
      if (taken[j >> 5] & (1u << (j & 31))) continue;
      float xj = load(logits, row + j);
      if (best < 0 || xj > xb) best = j, xb = xj;
    }
    taken[best >> 5] |= 1u << (best & 31);
    id[s] = best;
    if (s == 0) first = xb;
    float v = mode == 0 ? expf(xb - mx) / den : (mode == 1 ? expf(xb - first) : xb);
    w[s] = v;
    sum += v;
  }
  if (mode == 1 || normalize)
    for (int s = 0; s < k; ++s) w[s] /= sum;
}

extern "C" __global__ void router_topk_f32(const float* __restrict__ logits, float* __restrict__ weights,
                                           long long* __restrict__ ids, int t, int e, int k, int mode, int normalize) {
  route(logits, weights, ids, t, e, k, mode, normalize);
}

extern "C" __global__ void router_topk_f16(const __half* __restrict__ logits, float* __restrict__ weights,
                                           long long* __restrict__ ids, int t, int e, int k, int mode, int normalize) {
  route(logits, weights, ids, t, e, k, mode, normalize);
}
