// Building blocks for one-launch kernels whose CTAs exchange data: a
// grid-wide barrier on a persistent arrival counter, an L2-only load, and
// TMA bulk copies into shared memory completed on mbarriers (sm_90). Used
// by the one-launch decode kernels (gdn_mixer_decode.cu: the barrier).
//
// Grid barrier contract (the whole grid must be resident at once):
// - ctr: a 64-bit global counter, zero before its first use, never reset,
//   used by one launch at a time, every launch with the same number B of
//   barriers and the same BARW >= gridDim.x.
// - Each barrier adds exactly BARW (grid_arrive: CTA 0 with weight
//   1 + BARW - gridDim.x, every other CTA with 1), so a launch adds B * BARW
//   and the counter is a multiple of B * BARW between launches.
// - Thread 0 of each CTA reads the counter (ld_relaxed_u64) before its first
//   arrival and rounds it down to a multiple of B * BARW: the launch's base
//   (no barrier of the launch completes before every CTA arrived once).
// - Barrier b = 1..B: grid_arrive<BARW>(ctr), then grid_wait(ctr, base +
//   b * BARW). Writes of every CTA before its arrive are visible to every
//   thread of a CTA after its wait (red.release.gpu / ld.acquire.gpu by
//   thread 0, each side of a __syncthreads); read them with ldcg_f or other
//   loads that skip the non-coherent read-only path (ld.global.nc).
// - A CTA still waiting after 2^23 polls (of the order of a second: a grid
//   not resident at once) traps, so the launch fails instead of hanging.
//
// Bulk copies: addresses of shared memory are 32-bit shared-window addresses
// (smem_addr, gdn_common.cuh). One thread initialises an mbarrier
// (mbar_init, then fence.mbarrier_init and a __syncthreads before other
// threads use it); a copy's issuer calls mbar_expect_tx with the bytes of
// the copies that complete on it, then bulk_g2s; consumers mbar_wait on the
// phase parity. fence_proxy_async orders this thread's earlier generic
// accesses of shared memory before later async-proxy writes (refilling a
// slot that was read).
#pragma once
#include "gdn_common.cuh"

// ---- grid barrier (the PTX helpers sleep_ns, ld_acquire_u64, ld_relaxed_u64,
// red_release_add_u64, ldcg_f and the mbarrier/bulk-copy ones below: ptx.cuh) ----

// Arrive (after the CTA's writes): CTA-wide barrier, then thread 0 adds with release.
template <unsigned long long BARW>
__device__ __forceinline__ void grid_arrive(unsigned long long* ctr) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned long long w = blockIdx.x == 0 ? 1ull + BARW - gridDim.x : 1ull;
    red_release_add_u64(ctr, w);
  }
}
// The launch's base (thread 0; v0: the counter it read before its first
// arrival): v0 rounded down to a multiple of NBAR * BARW. Traps where v0 cannot
// be a launch's start (remainder at least BARW: a CTA of this launch arrived
// already, or the counter never started at a multiple) or the grid exceeds BARW.
template <unsigned long long NBAR, unsigned long long BARW>
__device__ __forceinline__ unsigned long long grid_launch_base(unsigned long long v0) {
  if (v0 % (NBAR * BARW) >= BARW || gridDim.x > BARW) __trap();
  return v0 - v0 % (NBAR * BARW);
}
// Wait until every CTA arrived `target` (base + b * BARW); thread 0 polls.
__device__ __forceinline__ void grid_wait(const unsigned long long* ctr, unsigned long long target) {
  if (threadIdx.x == 0) {
    unsigned spins = 0;
    while (ld_acquire_u64(ctr) < target) {
      if (++spins > 4096u) sleep_ns(128);
      if (spins > (1u << 23)) __trap();  // the grid is not resident at once
    }
  }
  __syncthreads();
}
