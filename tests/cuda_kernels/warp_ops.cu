// Test kernel of the CUDA check (tests/test_cuda_check.py), not launched by
// the package: the warp and block collectives of cuda_shim.h on known data.
// Input x [n] int32 (n = blocks * 64, 64 threads per block). Outputs [n]
// int32 each: shfl (from lane (lane * 5) % 32), xor (lane ^ 5 within width
// 16), up (delta 3, width 8), down (delta 2), ballot (of x odd), any (x > 40),
// all (x >= 0), radd (__reduce_add_sync), rmin, rmax, match (__match_any_sync
// of x % 4), bor (__syncthreads_or(x == 7)), band (__syncthreads_and(x >= 0)),
// bcount (__syncthreads_count(x % 3 == 0)).
extern "C" __global__ void __launch_bounds__(64) KNAME(const int* __restrict__ x, int* __restrict__ shfl,
                                                       int* __restrict__ xr, int* __restrict__ up,
                                                       int* __restrict__ down, int* __restrict__ ballot,
                                                       int* __restrict__ any, int* __restrict__ all,
                                                       int* __restrict__ radd, int* __restrict__ rmin,
                                                       int* __restrict__ rmax, int* __restrict__ match,
                                                       int* __restrict__ bor, int* __restrict__ band,
                                                       int* __restrict__ bcount) {
  const int i = blockIdx.x * 64 + threadIdx.x, lane = threadIdx.x & 31;
  const int v = x[i];
  shfl[i] = __shfl_sync(0xffffffffu, v, (lane * 5) % 32);
  xr[i] = __shfl_xor_sync(0xffffffffu, v, 5, 16);
  up[i] = __shfl_up_sync(0xffffffffu, v, 3, 8);
  down[i] = __shfl_down_sync(0xffffffffu, v, 2);
  ballot[i] = (int)__ballot_sync(0xffffffffu, v & 1);
  any[i] = __any_sync(0xffffffffu, v > 40);
  all[i] = __all_sync(0xffffffffu, v >= 0);
  radd[i] = __reduce_add_sync(0xffffffffu, v);
  rmin[i] = __reduce_min_sync(0xffffffffu, v);
  rmax[i] = __reduce_max_sync(0xffffffffu, v);
  match[i] = (int)__match_any_sync(0xffffffffu, v % 4);
  bor[i] = __syncthreads_or(v == 7);
  band[i] = __syncthreads_and(v >= 0);
  bcount[i] = __syncthreads_count(v % 3 == 0);
}
