// The KV cache state writes of a stateful IREE module (rewrite/backends/iree_stateful.py), CUDA: the new rows of up
// to MAX_ROWS consecutive cache slots of one state global written in one dispatch, in place.
//
// IREE CUDA dispatch ABI (samples/custom_dispatch/cuda/kernels in IREE): the bindings' base pointers in binding
// order (position, rows_0 .. rows_{M-1}, state), then each push constant as a 32-bit integer: outer, seq, inner,
// n, slot0. Element data is moved as 16-bit words (an f32 cache passes inner twice its elements).
// Layouts, row-major: state [N, outer, seq, inner] (N slots; outer the cache dims before the sequence axis, inner
// those after it); rows_j [outer, n, inner], the new rows of slot slot0 + j; position one int64.
// The KVCacheUpdate contract (rewrite/plugins/kv_cache.py), as insert_rows_mlir writes it: off = position
// (+ seq when negative) clamped to [0, seq - n]; state[slot0 + j, o, off + r, :] = rows_j[o, r, :].
//
// Grid: x = M (one rows tensor each), y = outer * n (one row each); 128 threads move a row's words.
#include <stdint.h>

#define MAX_ROWS 14  // MAX_ROWS_PER_WRITE in iree_stateful.py: 14 rows, the position and the state: IREE's 16 bindings

__device__ __forceinline__ void write_rows(const long long* __restrict__ position, const uint16_t* __restrict__ rows,
                                           uint16_t* __restrict__ state, int outer, int seq, int inner, int n,
                                           int slot) {
  long long p = position[0];
  if (p < 0) p += seq;
  long long off = p < (long long)(seq - n) ? p : (long long)(seq - n);
  if (off < 0) off = 0;
  const int row = blockIdx.y, o = row / n, r = row % n;
  const uint16_t* src = rows + (size_t)row * inner;
  uint16_t* dst = state + (((size_t)slot * outer + o) * seq + (size_t)(off + r)) * inner;
  if ((inner & 7) == 0 && ((uintptr_t)src & 15) == 0 && ((uintptr_t)dst & 15) == 0) {
    for (int i = threadIdx.x; i < inner / 8; i += blockDim.x)
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
  } else {
    for (int i = threadIdx.x; i < inner; i += blockDim.x) dst[i] = src[i];
  }
}

extern "C" __global__ void __launch_bounds__(128) state_rows_m1(const long long* __restrict__ position, const uint16_t* __restrict__ r0,
    uint16_t* __restrict__ state, int outer, int seq, int inner, int n, int slot0) {
  const uint16_t* rows[1] = {r0};
  write_rows(position, rows[blockIdx.x], state, outer, seq, inner, n, slot0 + blockIdx.x);
}

extern "C" __global__ void __launch_bounds__(128) state_rows_m2(const long long* __restrict__ position, const uint16_t* __restrict__ r0, const uint16_t* __restrict__ r1,
    uint16_t* __restrict__ state, int outer, int seq, int inner, int n, int slot0) {
  const uint16_t* rows[2] = {r0, r1};
  write_rows(position, rows[blockIdx.x], state, outer, seq, inner, n, slot0 + blockIdx.x);
}

extern "C" __global__ void __launch_bounds__(128) state_rows_m3(const long long* __restrict__ position, const uint16_t* __restrict__ r0, const uint16_t* __restrict__ r1, const uint16_t* __restrict__ r2,
    uint16_t* __restrict__ state, int outer, int seq, int inner, int n, int slot0) {
  const uint16_t* rows[3] = {r0, r1, r2};
  write_rows(position, rows[blockIdx.x], state, outer, seq, inner, n, slot0 + blockIdx.x);
}

extern "C" __global__ void __launch_bounds__(128) state_rows_m4(const long long* __restrict__ position, const uint16_t* __restrict__ r0, const uint16_t* __restrict__ r1, const uint16_t* __restrict__ r2, const uint16_t* __restrict__ r3,
    uint16_t* __restrict__ state, int outer, int seq, int inner, int n, int slot0) {
  const uint16_t* rows[4] = {r0, r1, r2, r3};
  write_rows(position, rows[blockIdx.x], state, outer, seq, inner, n, slot0 + blockIdx.x);
}

extern "C" __global__ void __launch_bounds__(128) state_rows_m5(const long long* __restrict__ position, const uint16_t* __restrict__ r0, const uint16_t* __restrict__ r1, const uint16_t* __restrict__ r2, const uint16_t* __restrict__ r3, const uint16_t* __restrict__ r4,
    uint16_t* __restrict__ state, int outer, int seq, int inner, int n, int slot0) {
  const uint16_t* rows[5] = {r0, r1, r2, r3, r4};
  write_rows(position, rows[blockIdx.x], state, outer, seq, inner, n, slot0 + blockIdx.x);
}

extern "C" __global__ void __launch_bounds__(128) state_rows_m6(const long long* __restrict__ position, const uint16_t* __restrict__ r0, const uint16_t* __restrict__ r1, const uint16_t* __restrict__ r2, const uint16_t* __restrict__ r3, const uint16_t* __restrict__ r4, const uint16_t* __restrict__ r5,
    uint16_t* __restrict__ state, int outer, int seq, int inner, int n, int slot0) {
  const uint16_t* rows[6] = {r0, r1, r2, r3, r4, r5};
  write_rows(position, rows[blockIdx.x], state, outer, seq, inner, n, slot0 + blockIdx.x);
}

extern "C" __global__ void __launch_bounds__(128) state_rows_m7(const long long* __restrict__ position, const uint16_t* __restrict__ r0, const uint16_t* __restrict__ r1, const uint16_t* __restrict__ r2, const uint16_t* __restrict__ r3, const uint16_t* __restrict__ r4, const uint16_t* __restrict__ r5, const uint16_t* __restrict__ r6,
    uint16_t* __restrict__ state, int outer, int seq, int inner, int n, int slot0) {
  const uint16_t* rows[7] = {r0, r1, r2, r3, r4, r5, r6};
  write_rows(position, rows[blockIdx.x], state, outer, seq, inner, n, slot0 + blockIdx.x);
}

extern "C" __global__ void __launch_bounds__(128) state_rows_m8(const long long* __restrict__ position, const uint16_t* __restrict__ r0, const uint16_t* __restrict__ r1, const uint16_t* __restrict__ r2, const uint16_t* __restrict__ r3, const uint16_t* __restrict__ r4, const uint16_t* __restrict__ r5, const uint16_t* __restrict__ r6, const uint16_t* __restrict__ r7,
    uint16_t* __restrict__ state, int outer, int seq, int inner, int n, int slot0) {
  const uint16_t* rows[8] = {r0, r1, r2, r3, r4, r5, r6, r7};
  write_rows(position, rows[blockIdx.x], state, outer, seq, inner, n, slot0 + blockIdx.x);
}

extern "C" __global__ void __launch_bounds__(128) state_rows_m9(const long long* __restrict__ position, const uint16_t* __restrict__ r0, const uint16_t* __restrict__ r1, const uint16_t* __restrict__ r2, const uint16_t* __restrict__ r3, const uint16_t* __restrict__ r4, const uint16_t* __restrict__ r5, const uint16_t* __restrict__ r6, const uint16_t* __restrict__ r7, const uint16_t* __restrict__ r8,
    uint16_t* __restrict__ state, int outer, int seq, int inner, int n, int slot0) {
  const uint16_t* rows[9] = {r0, r1, r2, r3, r4, r5, r6, r7, r8};
  write_rows(position, rows[blockIdx.x], state, outer, seq, inner, n, slot0 + blockIdx.x);
}

extern "C" __global__ void __launch_bounds__(128) state_rows_m10(const long long* __restrict__ position, const uint16_t* __restrict__ r0, const uint16_t* __restrict__ r1, const uint16_t* __restrict__ r2, const uint16_t* __restrict__ r3, const uint16_t* __restrict__ r4, const uint16_t* __restrict__ r5, const uint16_t* __restrict__ r6, const uint16_t* __restrict__ r7, const uint16_t* __restrict__ r8, const uint16_t* __restrict__ r9,
    uint16_t* __restrict__ state, int outer, int seq, int inner, int n, int slot0) {
  const uint16_t* rows[10] = {r0, r1, r2, r3, r4, r5, r6, r7, r8, r9};
  write_rows(position, rows[blockIdx.x], state, outer, seq, inner, n, slot0 + blockIdx.x);
}

extern "C" __global__ void __launch_bounds__(128) state_rows_m11(const long long* __restrict__ position, const uint16_t* __restrict__ r0, const uint16_t* __restrict__ r1, const uint16_t* __restrict__ r2, const uint16_t* __restrict__ r3, const uint16_t* __restrict__ r4, const uint16_t* __restrict__ r5, const uint16_t* __restrict__ r6, const uint16_t* __restrict__ r7, const uint16_t* __restrict__ r8, const uint16_t* __restrict__ r9, const uint16_t* __restrict__ r10,
    uint16_t* __restrict__ state, int outer, int seq, int inner, int n, int slot0) {
  const uint16_t* rows[11] = {r0, r1, r2, r3, r4, r5, r6, r7, r8, r9, r10};
  write_rows(position, rows[blockIdx.x], state, outer, seq, inner, n, slot0 + blockIdx.x);
}

extern "C" __global__ void __launch_bounds__(128) state_rows_m12(const long long* __restrict__ position, const uint16_t* __restrict__ r0, const uint16_t* __restrict__ r1, const uint16_t* __restrict__ r2, const uint16_t* __restrict__ r3, const uint16_t* __restrict__ r4, const uint16_t* __restrict__ r5, const uint16_t* __restrict__ r6, const uint16_t* __restrict__ r7, const uint16_t* __restrict__ r8, const uint16_t* __restrict__ r9, const uint16_t* __restrict__ r10, const uint16_t* __restrict__ r11,
    uint16_t* __restrict__ state, int outer, int seq, int inner, int n, int slot0) {
  const uint16_t* rows[12] = {r0, r1, r2, r3, r4, r5, r6, r7, r8, r9, r10, r11};
  write_rows(position, rows[blockIdx.x], state, outer, seq, inner, n, slot0 + blockIdx.x);
}

extern "C" __global__ void __launch_bounds__(128) state_rows_m13(const long long* __restrict__ position, const uint16_t* __restrict__ r0, const uint16_t* __restrict__ r1, const uint16_t* __restrict__ r2, const uint16_t* __restrict__ r3, const uint16_t* __restrict__ r4, const uint16_t* __restrict__ r5, const uint16_t* __restrict__ r6, const uint16_t* __restrict__ r7, const uint16_t* __restrict__ r8, const uint16_t* __restrict__ r9, const uint16_t* __restrict__ r10, const uint16_t* __restrict__ r11, const uint16_t* __restrict__ r12,
    uint16_t* __restrict__ state, int outer, int seq, int inner, int n, int slot0) {
  const uint16_t* rows[13] = {r0, r1, r2, r3, r4, r5, r6, r7, r8, r9, r10, r11, r12};
  write_rows(position, rows[blockIdx.x], state, outer, seq, inner, n, slot0 + blockIdx.x);
}

extern "C" __global__ void __launch_bounds__(128) state_rows_m14(const long long* __restrict__ position, const uint16_t* __restrict__ r0, const uint16_t* __restrict__ r1, const uint16_t* __restrict__ r2, const uint16_t* __restrict__ r3, const uint16_t* __restrict__ r4, const uint16_t* __restrict__ r5, const uint16_t* __restrict__ r6, const uint16_t* __restrict__ r7, const uint16_t* __restrict__ r8, const uint16_t* __restrict__ r9, const uint16_t* __restrict__ r10, const uint16_t* __restrict__ r11, const uint16_t* __restrict__ r12, const uint16_t* __restrict__ r13,
    uint16_t* __restrict__ state, int outer, int seq, int inner, int n, int slot0) {
  const uint16_t* rows[14] = {r0, r1, r2, r3, r4, r5, r6, r7, r8, r9, r10, r11, r12, r13};
  write_rows(position, rows[blockIdx.x], state, outer, seq, inner, n, slot0 + blockIdx.x);
}
