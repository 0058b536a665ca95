// Grid-wide barrier on a persistent arrival counter, L2 loads, and TMA bulk
// copies into shared memory with mbarriers: the one-launch decode MoE kernel
// (moe_decode_fused.cu) and the benchmark's dependent read floor
// (bench/cuda/decode_dep_floor.cu).
//
// Barrier protocol (the grid must be resident at once): a 64-bit counter,
// zero at first use, never reset. A launch with B barriers adds exactly
// B * BARW (BARW >= gridDim.x): CTA 0 arrives with weight 1 + BARW - G, the
// others with 1. Thread 0 reads the counter at entry (the launch's base, a
// multiple of B * BARW), arrives with red.release.gpu and waits with
// ld.acquire.gpu for base + b * BARW at barrier b. A CTA waiting ~1 s (a grid
// not resident at once) traps: the launch fails instead of hanging.
#pragma once
#include "gdn_common.cuh"

// ---- grid barrier, L2 loads --------------------------------------------------------

__device__ __forceinline__ unsigned long long ld_acquire_u64(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];\n" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned long long ld_relaxed_u64(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];\n" : "=l"(v) : "l"(p) : "memory");
  return v;
}
// Arrive (after the CTA's writes): CTA-wide barrier, then thread 0 adds with release.
template <unsigned long long BARW>
__device__ __forceinline__ void grid_arrive(unsigned long long* ctr) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned long long w = blockIdx.x == 0 ? 1ull + BARW - gridDim.x : 1ull;
    asm volatile("red.release.gpu.global.add.u64 [%0], %1;\n" ::"l"(ctr), "l"(w) : "memory");
  }
}
// Wait until every CTA arrived `target` (base + b * BARW); thread 0 polls.
__device__ __forceinline__ void grid_wait(const unsigned long long* ctr, unsigned long long target) {
  if (threadIdx.x == 0) {
    unsigned spins = 0;
    while (ld_acquire_u64(ctr) < target) {
      if (++spins > 4096u) sleep_ns(128);
      if (spins > (1u << 23)) __trap();  // ~1 s: the grid is not co-resident
    }
  }
  __syncthreads();
}

__device__ __forceinline__ float ldcg_f(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

// ---- TMA bulk copies into shared memory, mbarriers ---------------------------------

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
// bytes: a multiple of 16; both addresses 16-byte aligned.
__device__ __forceinline__ void bulk_g2s(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
// Order earlier generic-proxy reads of a slot before the async-proxy refill.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
