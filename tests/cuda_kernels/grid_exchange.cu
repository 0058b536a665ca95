// Test kernel of the CUDA check (tests/test_cuda_check.py), not launched by
// the package: every block writes its partial sum, meets the others at a
// grid barrier (grid_sync.cuh), then writes the total of all partials.
// Launch: gridDim.x <= 64 blocks of 64 threads, all resident; input x
// [gridDim.x * 64] f32; outputs (all zero-filled) ctr [1] u64 (the barrier's
// counter), partial [gridDim.x] f32, total [gridDim.x] f32.
#include "grid_sync.cuh"

extern "C" __global__ void __launch_bounds__(64) KNAME(const float* __restrict__ x, unsigned long long* __restrict__ ctr,
                                                       float* __restrict__ partial, float* __restrict__ total) {
  __shared__ float part[64];
  const int t = threadIdx.x, b = blockIdx.x;
  part[t] = x[b * 64 + t];
  __syncthreads();
  if (t == 0) {
    float s = 0.0f;
    for (int i = 0; i < 64; ++i) s += part[i];
    partial[b] = s;
  }
#ifndef NO_GRID_BARRIER
  grid_arrive<64>(ctr);
  grid_wait(ctr, 64);
#endif
  if (t == 0) {
    float s = 0.0f;
    for (int i = 0; i < (int)gridDim.x; ++i) s += ldcg_f(partial + i);
    total[b] = s;
  }
}
