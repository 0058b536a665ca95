// Test kernel of the CUDA check (tests/test_cuda_check.py), not launched by
// the package: y = 2 x, one thread per element; with OVERFLOW_THREAD, that
// thread first calls fill(), whose local array is larger than the check's
// thread stacks (256 KB) and is written from its top down, overflowing the
// thread's stack. grid_sync.cuh is included only so that the check runs
// every block at once, with a stack per thread of the whole grid (its
// many-thread launches).
// Launch: blocks of 64 threads; input x [n] f32, output y [n] f32.
#include "grid_sync.cuh"

#ifdef OVERFLOW_THREAD
__device__ __noinline__ float fill() {
  volatile char buf[(256 + 16) << 10];
  for (int k = (int)sizeof(buf) - 1; k >= 0; --k) buf[k] = char(k & 1);
  return float(buf[2]);  // 0
}
#endif

extern "C" __global__ void __launch_bounds__(64) KNAME(const float* __restrict__ x, float* __restrict__ y) {
  const int i = blockIdx.x * 64 + threadIdx.x;
  float extra = 0.0f;
#ifdef OVERFLOW_THREAD
  if (i == OVERFLOW_THREAD) extra = fill();
#endif
  __syncthreads();  // a yield: the check looks at the thread's stack there at the latest
  y[i] = 2.0f * x[i] + extra;
}
