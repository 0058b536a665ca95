// Test kernel of the CUDA check (tests/test_cuda_check.py), not launched by
// the package: L launches of a grid-barrier kernel running at once, as CTAs
// of one resident grid. CTA b belongs to launch l = b / G (its CTA b % G) and
// takes the barrier slot of tags[l] from the module's table (grid_sync.cuh);
// each launch exchanges partial sums over two barriers, as the one-launch
// decode kernels do. NO_SLOTS: every launch on one counter (a table's first
// slot, never claimed), the scheme that two launches at once break.
// Launch: L * G blocks of 64 threads (G = MQF_G, at most 64), all resident;
// inputs x [L * G * 64] f32, tags [L] u64 (nonzero); outputs partial, total,
// next [L * G] f32: a CTA's own sum, its launch's total after barrier 1, the
// total that the launch's next CTA computed, read after barrier 2.
#include "grid_sync.cuh"

#ifndef MQF_G
#define MQF_G 4
#endif
constexpr unsigned G = MQF_G;
constexpr unsigned long long BARW = 64, NBAR = 2;
__device__ GridSlot test_slots[GRID_SLOTS];

#ifdef NO_SLOTS
__device__ __forceinline__ GridSlot* slot_of(unsigned long long) { return test_slots; }
#else
__device__ __forceinline__ GridSlot* slot_of(unsigned long long tag) { return grid_slot(test_slots, tag); }
#endif

extern "C" __global__ void __launch_bounds__(64) KNAME(const float* __restrict__ x,
                                                       const unsigned long long* __restrict__ tags,
                                                       float* __restrict__ partial, float* __restrict__ total,
                                                       float* __restrict__ next) {
  __shared__ float part[64];
  const unsigned t = threadIdx.x, b = blockIdx.x, l = b / G, cta = b % G;
  const unsigned long long tag = tags[l];
  unsigned long long v0 = 0;
  if (t == 0) {
#ifndef NO_SLOTS
    grid_claim(test_slots, tag);
#endif
    v0 = ld_relaxed_u64(&slot_of(tag)->ctr);
  }
  part[t] = x[b * 64 + t];
  __syncthreads();
  if (t == 0) {
    float s = 0.0f;
    for (int i = 0; i < 64; ++i) s += part[i];
    partial[b] = s;
  }
  unsigned long long base = 0;
  if (t == 0) base = grid_launch_base<NBAR, BARW>(v0, G);
  grid_arrive<BARW>(&slot_of(tag)->ctr, cta, G);
  grid_wait(&slot_of(tag)->ctr, base + BARW);
  if (t == 0) {
    float s = 0.0f;
    for (unsigned i = 0; i < G; ++i) s += ldcg_f(partial + l * G + i);
    total[b] = s;
  }
  grid_arrive<BARW>(&slot_of(tag)->ctr, cta, G);
  grid_wait(&slot_of(tag)->ctr, base + 2 * BARW);
  if (t == 0) next[b] = ldcg_f(total + l * G + (cta + 1) % G);
#ifndef NO_SLOTS
  grid_free(slot_of(tag), cta);
#endif
}
