// MoERouterTopK for IREE CUDA: one thread per token (an example kernel, not a fast one).
//
// IREE CUDA dispatch ABI (samples/custom_dispatch/cuda/kernels in IREE): the bindings' base pointers in
// binding order, then each push constant as a 32-bit integer.
//   bindings: logits f32 [t, e] (read only), weights f32 [t, k], ids i64 [t, k]
//   constants: t, e (<= 1024), k (1..e), mode (0 softmax_topk, 1 topk_softmax, 2 topk), normalize (0/1)
// workgroup size [64, 1, 1], ceil(t / 64) workgroups.
// Semantics: rewrite/plugins/router_op.py router_topk_reference; ties pick the lower expert index.

extern "C" __global__ void router_topk_f32(const float* __restrict__ logits, float* __restrict__ weights,
                                           long long* __restrict__ ids, int t, int e, int k, int mode,
                                           int normalize) {
  int tok = blockIdx.x * blockDim.x + threadIdx.x;
  if (tok >= t) return;
  const float* x = logits + (long long)tok * e;
  float* w = weights + (long long)tok * k;
  long long* id = ids + (long long)tok * k;
  float mx = x[0];
  for (int j = 1; j < e; ++j) mx = fmaxf(mx, x[j]);
  float den = 0.f;
  for (int j = 0; j < e; ++j) den += expf(x[j] - mx);
  unsigned taken[32] = {0};
  float sum = 0.f;
  for (int s = 0; s < k; ++s) {
    int best = -1;
    for (int j = 0; j < e; ++j) {
      if (taken[j >> 5] & (1u << (j & 31))) continue;
      if (best < 0 || x[j] > x[best]) best = j;
    }
    taken[best >> 5] |= 1u << (best & 31);
    id[s] = best;
    float v = mode == 0 ? expf(x[best] - mx) / den : (mode == 1 ? expf(x[best] - x[id[0]]) : x[best]);
    w[s] = v;
    sum += v;
  }
  if (mode == 1 || normalize)
    for (int s = 0; s < k; ++s) w[s] /= sum;
}
