// Per-block cycle stamps at a persistent kernel's phase boundaries (a
// diagnostic build, for bench/profile_kernels.py phases): with
// MQF_PHASE_CLOCK=1 thread 0 of each block reads clock64() at each mark(i)
// and store() writes the differences from mark 0, int64, to
// out[blockIdx.x * PC_SLOTS + i]; without it every call compiles to nothing
// and the kernel is the default build. Cycle counts of one SM: differences
// within a block only (SM clocks are not synchronised).
#pragma once

#ifndef MQF_PHASE_CLOCK
#define MQF_PHASE_CLOCK 0
#endif

constexpr int PC_SLOTS = 8;  // marks per block at most

struct PhaseClock {
#if MQF_PHASE_CLOCK
  long long t[PC_SLOTS];
  __device__ __forceinline__ void mark(int i) {
    if (threadIdx.x == 0) t[i] = clock64();
  }
  __device__ __forceinline__ void store(long long* out, int n) {
    if (threadIdx.x == 0)
      for (int i = 0; i < PC_SLOTS; ++i) out[(size_t)blockIdx.x * PC_SLOTS + i] = i < n ? t[i] - t[0] : -1;
  }
#else
  __device__ __forceinline__ void mark(int) {}
  __device__ __forceinline__ void store(long long*, int) {}
#endif
};
