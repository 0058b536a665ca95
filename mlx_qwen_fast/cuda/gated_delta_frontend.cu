// Gated DeltaNet prefill front end, one pass over the qkv projection.
//
// Fuses what mlx-lm's GatedDeltaNet.__call__ does between the projections and
// the recurrence (mlx_lm/models/qwen3_5.py, gated_delta.py):
//   conv_input = concat(conv_state, qkv)           [B, 3 + T, C]
//   x = silu(depthwise_conv1d(conv_input, w))      kernel 4, no bias
//   q, k, v = split(x)                              [HK*D | HK*D | HV*D]
//   q = q / sqrt(sum(q^2) + eps) * D^-0.5           (normalize_qk)
//   k = k / sqrt(sum(k^2) + eps)
//   g = exp(-exp(A_log) * softplus(a + dt_bias)),  beta = sigmoid(b)
//   new conv_state = conv_input[:, -3:]
// All arithmetic in fp32 (SiLU with the hardware exp and reciprocal:
// silu_fast, gdn_common.cuh); q, k, v are rounded once to the activation type.
//
// Work split: one warp per (b, 128-channel head slice, tile of TT tokens); a
// lane owns 4 consecutive channels and walks the tile keeping the previous
// three input rows in registers, so each input row is read once (plus a
// 3-row halo per tile). The L2 norms are warp sums. Warps of v slices also
// compute g and beta of their head for their tokens (lane = token).
//
// Build macros: KNAME, GDN_X (activations: qkv, a, b, conv state, q/k/v out),
// GDN_W (conv weight), GDN_A (A_log), GDN_DT (dt_bias), GDN_HV, GDN_HK, GDN_TT.
// Parameters: inputs qkv [B,T,C], a [B,T,HV], b [B,T,HV], conv_w [C,4],
// conv_state [B,3,C], A_log [HV], dt_bias [HV]; outputs q [B,T,HK,D],
// k [B,T,HK,D], v [B,T,HV,D], g [B,T,HV] f32, beta [B,T,HV] f32,
// conv_state_out [B,3,C]; scalars int B, int T, float eps.
// Launch: B * ceil(T / TT) * (2 HK + HV) warps, 4 warps per block.
#include "gdn_frontend.cuh"

using namespace gdnfe;

extern "C" __global__ void __launch_bounds__(128) KNAME(
    const xt* __restrict__ qkv,
    const xt* __restrict__ a_in,
    const xt* __restrict__ b_in,
    const wt* __restrict__ conv_w,
    const xt* __restrict__ conv_state,
    const at* __restrict__ A_log,
    const dtt* __restrict__ dt_bias,
    xt* __restrict__ q_out,
    xt* __restrict__ k_out,
    xt* __restrict__ v_out,
    float* __restrict__ g_out,
    float* __restrict__ beta_out,
    xt* __restrict__ conv_state_out,
    int B,
    int T,
    float eps) {
  frontend_warp(blockIdx.x * 4 + (threadIdx.x >> 5), threadIdx.x & 31, qkv, a_in, b_in, conv_w,
                conv_state, A_log, dt_bias, q_out, k_out, v_out, g_out, beta_out, conv_state_out,
                B, T, eps);
}
