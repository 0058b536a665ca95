// Building blocks for one-launch kernels whose CTAs exchange data: a
// grid-wide barrier on a persistent arrival counter, an L2-only load, and
// TMA bulk copies into shared memory completed on mbarriers (sm_90). Used
// by the one-launch decode kernels (gdn_mixer_decode.cu: the barrier).
//
// Grid barrier contract (the whole grid must be resident at once):
// - ctr: a 64-bit global counter, zero before its first use, never reset,
//   used by one launch at a time, every launch with the same number B of
//   barriers and the same BARW >= gridDim.x. A module's kernel takes it from
//   a slot of the module's table (below), which gives each running launch
//   a counter of its own.
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
// Barrier slots: MLX orders a launch only after the launches that wrote its
// inputs, so two launches of one module may run at the same time (graphs
// that do not depend on each other, evaluated together). A module therefore
// holds a table of GRID_SLOTS slots {owner, ctr}, zero when it loads. Thread
// 0 of every CTA claims its launch's slot (grid_claim: the slot that the
// launch's tag hashes to, grid_tag in ptx.cuh; it waits while another launch
// owns it) before reading the slot's counter; CTA 0 frees it after its last
// barrier wait (grid_free), when every CTA of the launch has made its last
// arrival; a CTA still polling the counter then sees it only grow. The owner
// is claimed with acquire and freed with release, so the next owner's reads
// of the counter see every arrival of the last. A CTA waiting for a slot
// 2^23 polls traps like a barrier wait (the owner's grid not resident).
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
// red_release_add_u64, atom_cas_acquire_u64, st_release_u64, grid_tag, ldcg_f and the mbarrier/bulk-copy ones below: ptx.cuh) ----

// A module's table of barrier slots: `__device__ GridSlot name[GRID_SLOTS];`.
struct GridSlot {
  unsigned long long owner;  // the owning launch's tag, 0 while free
  unsigned long long ctr;    // the barrier counter (the contract above)
};
constexpr unsigned GRID_SLOTS = 64;

// Thread 0 of each CTA, before its first read of the counter: the slot of the launch with tag
// `tag` (nonzero, the same for every CTA of the launch and distinct from every other launch's),
// owned by the launch on return (claimed here or by a CTA of the same launch before).
__device__ __forceinline__ GridSlot* grid_slot(GridSlot* slots, unsigned long long tag) {
  return slots + ((tag * 0x9E3779B97F4A7C15ull) >> 58) % GRID_SLOTS;  // Fibonacci hashing
}
__device__ __forceinline__ GridSlot* grid_slot(GridSlot* slots) { return grid_slot(slots, grid_tag()); }
__device__ __forceinline__ GridSlot* grid_claim(GridSlot* slots, unsigned long long tag) {
  GridSlot* const s = grid_slot(slots, tag);
  unsigned spins = 0;
  for (;;) {
    const unsigned long long o = atom_cas_acquire_u64(&s->owner, 0ull, tag);
    if (o == 0 || o == tag) return s;
    if (++spins > 4096u) sleep_ns(128);
    if (spins > (1u << 23)) __trap();  // the owner's grid is not resident
  }
}
// Every thread, after the CTA's last grid_wait: CTA `cta` 0 frees the launch's slot.
__device__ __forceinline__ void grid_free(GridSlot* s, unsigned cta) {
  if (cta == 0 && threadIdx.x == 0) st_release_u64(&s->owner, 0ull);
}
__device__ __forceinline__ void grid_free(GridSlot* s) { grid_free(s, blockIdx.x); }

// Arrive (after the CTA's writes): CTA-wide barrier, then thread 0 adds with release. cta, ncta:
// the CTA's index in its launch and the launch's CTAs (blockIdx.x and gridDim.x but in tests that
// run several launches' CTAs as one grid).
template <unsigned long long BARW>
__device__ __forceinline__ void grid_arrive(unsigned long long* ctr, unsigned cta, unsigned ncta) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned long long w = cta == 0 ? 1ull + BARW - ncta : 1ull;
    red_release_add_u64(ctr, w);
  }
}
template <unsigned long long BARW>
__device__ __forceinline__ void grid_arrive(unsigned long long* ctr) {
  grid_arrive<BARW>(ctr, blockIdx.x, gridDim.x);
}
// The launch's base (thread 0; v0: the counter it read before its first
// arrival): v0 rounded down to a multiple of NBAR * BARW. Traps where v0 cannot
// be a launch's start (remainder at least BARW: a CTA of this launch arrived
// already, or the counter never started at a multiple) or the grid exceeds BARW.
template <unsigned long long NBAR, unsigned long long BARW>
__device__ __forceinline__ unsigned long long grid_launch_base(unsigned long long v0, unsigned ncta) {
  if (v0 % (NBAR * BARW) >= BARW || ncta > BARW) __trap();
  return v0 - v0 % (NBAR * BARW);
}
template <unsigned long long NBAR, unsigned long long BARW>
__device__ __forceinline__ unsigned long long grid_launch_base(unsigned long long v0) {
  return grid_launch_base<NBAR, BARW>(v0, gridDim.x);
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

// ---- a launch's barriers, for bodies that one kernel runs in turn ------------------------

// The NBAR grid barriers of one launch on its slot of the module's table SLOTS::table() (a struct
// whose static device function returns the module's `__device__ GridSlot name[GRID_SLOTS]`; the
// contract above): thread 0 claims the slot and reads its counter (claim), the launch's base is
// fixed at the first arrival, and CTA 0 frees the slot after the last wait. A body that runs as a part of a launch numbers its barriers from the
// part's first (b0 + 1, b0 + 2, ...), so that two bodies share one slot and one counter.
template <unsigned long long NBAR, unsigned long long BARW, class SLOTS>
struct GridBarriers {
  unsigned long long v0 = 0, base = 0;  // thread 0's: the counter before the first arrival, the base
  // Thread 0 claims the launch's slot and reads its counter: once per launch, by its first body
  // at its start (there rather than in the kernel before the body, so that the body's register
  // allocation stays that of the body alone).
  __device__ __forceinline__ void claim() {
    if (threadIdx.x == 0) v0 = ld_relaxed_u64(&grid_claim(SLOTS::table(), grid_tag())->ctr);
  }
  // The slot's counter at each use (thread 0's), from the grid id: not a pointer held in
  // registers across the phases (the bodies hold weight tiles in registers).
  static __device__ __forceinline__ unsigned long long* ctr() { return &grid_slot(SLOTS::table())->ctr; }
  // Barrier b's arrival (b = 1 .. NBAR; the first also fixes the base).
  __device__ __forceinline__ void arrive(unsigned b) {
    if (b == 1 && threadIdx.x == 0) base = grid_launch_base<NBAR, BARW>(v0);
    grid_arrive<BARW>(ctr());
  }
  // Barrier b's wait; after the last, the slot is freed.
  __device__ __forceinline__ void wait(unsigned b) {
    grid_wait(ctr(), base + b * BARW);
    if (b == NBAR) grid_free(grid_slot(SLOTS::table()));
  }
};
