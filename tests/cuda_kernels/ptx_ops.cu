// Test kernel of the CUDA check (tests/test_cuda_check.py), not launched by
// the package: the scalar PTX helpers of ptx.cuh applied elementwise, so
// that their CPU bodies can be compared with exact references.
// Inputs a, b, c [n] u32; outputs [n] u32 each: bf16 (cvt_rn_bf16_f32 of a's
// float), f16 (cvt_rn_f16_f32 of a's float), f16f (cvt_f32_f16 of a's low
// half, as float bits), pair (cvt_rn_bf16x2_f32(a, b)), perm (prmt(a, b, c)),
// sub (sub_rn_bf16x2(a, b)), fma (fma_rn_bf16x2(a, b, c)), lop (lop3_and_or).
// Scalar n. Launch: n threads or more, 128 per block.
#include "ptx.cuh"

extern "C" __global__ void __launch_bounds__(128) KNAME(const unsigned* __restrict__ a, const unsigned* __restrict__ b,
                                                        const unsigned* __restrict__ c, unsigned* __restrict__ bf16,
                                                        unsigned* __restrict__ f16, unsigned* __restrict__ f16f,
                                                        unsigned* __restrict__ pair, unsigned* __restrict__ perm,
                                                        unsigned* __restrict__ sub, unsigned* __restrict__ fma,
                                                        unsigned* __restrict__ lop, int n) {
  const int i = blockIdx.x * 128 + threadIdx.x;
  if (i >= n) return;
  const float fa = __uint_as_float(a[i]), fb = __uint_as_float(b[i]);
  bf16[i] = cvt_rn_bf16_f32(fa);
  f16[i] = cvt_rn_f16_f32(fa);
  f16f[i] = __float_as_uint(cvt_f32_f16((unsigned short)(a[i] & 0xffffu)));
  pair[i] = cvt_rn_bf16x2_f32(fa, fb);
  perm[i] = prmt(a[i], b[i], c[i]);
  sub[i] = sub_rn_bf16x2(a[i], b[i]);
  fma[i] = fma_rn_bf16x2(a[i], b[i], c[i]);
  lop[i] = lop3_and_or(a[i], b[i], c[i]);
}
