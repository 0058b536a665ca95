// Gated RMSNorm of the Gated DeltaNet output, one pass.
//
// Matches mlx-lm's Qwen3NextRMSNormGated (mlx_lm/models/qwen3_next.py) with
// its precise_swiglu, including where that code rounds to the activation type:
//   n   = round(y * rsqrt(mean(y^2) + eps))       (mx.fast.rms_norm: x * rstd,
//   o   = round(w * n)                              then times the weight)
//   out = round(silu(float(z)) * float(o))         (precise_swiglu)
// over rows of D = 128 values (one row per token and value head).
//
// Work split: 16 lanes per row, 8 values per lane (16-byte loads for 2-byte
// types), so a warp normalises 2 rows.
//
// Build macros: KNAME, GDN_X (y, z, out), GDN_N (weight).
// Parameters: inputs y [N,128], z [N,128], w [128]; output out [N,128];
// scalars int N, float eps. Launch: N * 16 threads, 256 per block.
#include "gdn_common.cuh"

typedef GDN_X xt;
typedef GDN_N nt_;

extern "C" __global__ void __launch_bounds__(256) KNAME(
    const xt* __restrict__ y,
    const xt* __restrict__ z,
    const nt_* __restrict__ w,
    xt* __restrict__ out,
    int N,
    float eps) {
  constexpr int D = 128;
  const int gt = blockIdx.x * 256 + threadIdx.x;
  const int row = gt >> 4;
  const int l = gt & 15;
  // Rows past the end still take part in the shuffles (masked by value).
  const bool ok = row < N;
  const size_t base = (size_t)(ok ? row : 0) * D + l * 8;
  float yv[8], zv[8], wv[8];
#pragma unroll
  for (int i = 0; i < 8; i += 4) {
    load4(y + base + i, &yv[i]);
    load4(z + base + i, &zv[i]);
    load4(w + l * 8 + i, &wv[i]);
  }
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    ss = fmaf(yv[i], yv[i], ss);
  }
  ss = warp_sum<16>(ss);
  const float rstd = rsqrtf(ss / D + eps);
  float o[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float n = from_f_round<xt>(yv[i] * rstd);
    const float wn = from_f_round<xt>(wv[i] * n);
    o[i] = silu_f(zv[i]) * wn;
  }
  if (ok) {
    store4(out + base, o);
    store4(out + base + 4, &o[4]);
  }
}
