// nvcc-flags: -fmad=false
// (no fused multiply-add: the double-precision exp and sums round as in the llvm-cpu build)
// MoERouterTopK for IREE CUDA: every mode of router_topk.c (the llvm-cpu kernel), one thread per token, from the
// same source (semantics: router_topk_reference in rewrite/plugins/router/op.py; ids equal it bit for bit).
//
// IREE CUDA dispatch ABI (IREE samples/custom_dispatch/cuda): the bindings' base pointers in binding order, then
// each push constant as a 32-bit integer. Workgroups of ROUTER_CUDA_THREADS threads, ceil(t / threads) of them.
//   router_topk_<x>_<w>:        x [t, e], w [t, k], ids [t, k];        t, e, k, mode, normalize
//   router_grouped_<x>_<w>:     x [t, e], bias [e] f32, w [t, k], ids;  t, e, k, normalize, scoring, n_group,
//                               topk_group, scale, eps, lo (the last three as float32 bit patterns)
//   router_sparsemixer_<x>_<w>: x [t, e], w [t, 2], ids [t, 2];        t, e, k, threshold (float32 bits)
// <x>, <w>: f32 or f16 (f16 as its bit pattern). Each thread keeps its scores in local memory (up to
// ROUTER_TOPK_MAX_EXPERTS floats, twice for grouped and sparsemixer): built for correctness at decode, not speed.

#define ROUTER_CUDA 1
#define ROUTER_TOPK_TOKENS 1  // the C block functions' "workgroup" is one token here
#include "router_topk.c"

#define TOKEN_OR_RETURN()                                     \
  size_t tok = (size_t)blockIdx.x * blockDim.x + threadIdx.x; \
  if (tok >= (size_t)(unsigned)t) return;

#define TOPK_KERNEL(NAME, XT, WT, XH, XF, WF, WH)                                                              \
  extern "C" __global__ void NAME(const XT* x, WT* w, int64_t* idx, int t, int e, int k, int mode, int normalize) { \
    TOKEN_OR_RETURN();                                                                                         \
    route_block(XH, XF, WF, WH, idx, (size_t)t, (size_t)e, (size_t)k, tok, (size_t)mode, (size_t)normalize);  \
  }

#define GROUPED_KERNEL(NAME, XT, WT, XH, XF, WF, WH)                                                           \
  extern "C" __global__ void NAME(const XT* x, const float* bias, WT* w, int64_t* idx, int t, int e, int k,    \
                                  int normalize, int scoring, int n_group, int topk_group, unsigned scale_bits, \
                                  unsigned eps_bits, unsigned lo_bits) {                                        \
    TOKEN_OR_RETURN();                                                                                         \
    grouped_params p = {(size_t)e, (size_t)k, (size_t)normalize, (size_t)scoring, (size_t)n_group,             \
                        (size_t)topk_group, bits_f32(scale_bits), bits_f32(eps_bits), bits_f32(lo_bits)};      \
    route_grouped_block(XH, XF, bias, WF, WH, idx, (size_t)t, tok, p);                                         \
  }

#define SPARSEMIXER_KERNEL(NAME, XT, WT, XH, XF, WF, WH)                                                       \
  extern "C" __global__ void NAME(const XT* x, WT* w, int64_t* idx, int t, int e, int k, unsigned thr_bits) {  \
    TOKEN_OR_RETURN();                                                                                         \
    route_sparsemixer_block(XH, XF, WF, WH, idx, (size_t)t, (size_t)e, (size_t)k, tok, bits_f32(thr_bits));    \
  }

#define ALL_TYPES(KERNEL, MODE)                                                      \
  KERNEL(router_##MODE##_f32_f32, float, float, 0, x, w, 0)                          \
  KERNEL(router_##MODE##_f32_f16, float, uint16_t, 0, x, 0, w)                       \
  KERNEL(router_##MODE##_f16_f32, uint16_t, float, x, 0, w, 0)                       \
  KERNEL(router_##MODE##_f16_f16, uint16_t, uint16_t, x, 0, 0, w)

ALL_TYPES(TOPK_KERNEL, topk)
ALL_TYPES(GROUPED_KERNEL, grouped)
ALL_TYPES(SPARSEMIXER_KERNEL, sparsemixer)
