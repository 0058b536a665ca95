// The next launch's weights into L2: up to 6 arrays that a persistent decode
// kernel receives only to prefetch them (prefetch.global.L2, ptx.cuh), split
// over all threads of its grid, at a point of its own where DRAM has room
// (the one-launch GDN mixer: after its second barrier's arrival; the MoE
// block: after its second barrier's arrival). Nothing is read back and no
// result changes; the next kernel's first loads of those lines then hit L2.
//
// Build macros: PF_N (0..6, default 0: no prefetch input) and PF_B0 ..
// PF_B<PF_N - 1>, the arrays' sizes in bytes. A kernel declares the
// inputs with PF_PARAMS after its other inputs (before its outputs) and calls
// next_prefetch(PF_ARGS) at its prefetch point.
#pragma once
#include "ptx.cuh"

#ifndef PF_N
#define PF_N 0
#endif
#if PF_N < 0 || PF_N > 6
#error "PF_N: 0 to 6 prefetch inputs"
#endif

#define PF_P_(i) , const void* __restrict__ pf##i
#if PF_N > 0
#define PF_P0 PF_P_(0)
#else
#define PF_P0
#endif
#if PF_N > 1
#define PF_P1 PF_P_(1)
#else
#define PF_P1
#endif
#if PF_N > 2
#define PF_P2 PF_P_(2)
#else
#define PF_P2
#endif
#if PF_N > 3
#define PF_P3 PF_P_(3)
#else
#define PF_P3
#endif
#if PF_N > 4
#define PF_P4 PF_P_(4)
#else
#define PF_P4
#endif
#if PF_N > 5
#define PF_P5 PF_P_(5)
#else
#define PF_P5
#endif
// The kernel's prefetch inputs, each preceded by a comma.
#define PF_PARAMS PF_P0 PF_P1 PF_P2 PF_P3 PF_P4 PF_P5

#if PF_N == 0
#define PF_ARGS nullptr
#define PF_BYTES 0
#elif PF_N == 1
#define PF_ARGS pf0
#define PF_BYTES PF_B0
#elif PF_N == 2
#define PF_ARGS pf0, pf1
#define PF_BYTES PF_B0, PF_B1
#elif PF_N == 3
#define PF_ARGS pf0, pf1, pf2
#define PF_BYTES PF_B0, PF_B1, PF_B2
#elif PF_N == 4
#define PF_ARGS pf0, pf1, pf2, pf3
#define PF_BYTES PF_B0, PF_B1, PF_B2, PF_B3
#elif PF_N == 5
#define PF_ARGS pf0, pf1, pf2, pf3, pf4
#define PF_BYTES PF_B0, PF_B1, PF_B2, PF_B3, PF_B4
#else
#define PF_ARGS pf0, pf1, pf2, pf3, pf4, pf5
#define PF_BYTES PF_B0, PF_B1, PF_B2, PF_B3, PF_B4, PF_B5
#endif

// Every thread of the grid: its share (thread blockIdx.x * blockDim.x + threadIdx.x of the grid's,
// 128-byte lines) of each prefetch input.
template <class... P>
__device__ __forceinline__ void next_prefetch(P... ps) {
#if PF_N > 0
  constexpr unsigned long long bytes[PF_N] = {PF_BYTES};  // PF_B0.. (ull: one size may pass 2^31)
  const void* const p[PF_N] = {ps...};
  const int i = (int)(blockIdx.x * blockDim.x + threadIdx.x), n = (int)(gridDim.x * blockDim.x);
#pragma unroll
  for (int a = 0; a < PF_N; ++a) prefetch_l2_range(p[a], bytes[a], i, n);
#endif
}
