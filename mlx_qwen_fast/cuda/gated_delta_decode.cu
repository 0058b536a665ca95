// Gated DeltaNet decode step (T = 1): the whole layer between the input
// projections and out_proj in one kernel.
//
// Fuses, for one token (mlx_lm/models/qwen3_5.py GatedDeltaNet.__call__):
//   conv: x = silu(sum_i w[c,i] * [conv_state ; qkv][i, c]),  new conv_state
//   q = x_q / sqrt(sum x_q^2 + eps) * D^-0.5,  k = x_k / sqrt(sum x_k^2 + eps)
//   g = exp(-exp(A_log) softplus(a + dt_bias)),  beta = sigmoid(b)
//   S <- g S;  d = beta (v - S k);  S <- S + d k^T;  y = S q
//   out = silu(z) * (w_n * rms_norm(y))            (Qwen3NextRMSNormGated)
// q, k, v and y are rounded to the activation type where the reference path
// stores them in that type, so the step equals the prefill kernels at T = 1.
//
// Work split: one block of 512 threads per (b, value head h), its device
// code in gdn_decode_step.cuh (shared with gdn_mixer_decode.cu): the block
// first issues the loads of its 128x128 fp32 state rows, then computes the
// conv/norm/gates of the channels it needs while those loads are in flight,
// updates the rows and runs the gated RMSNorm over the head's 128 outputs.
//
// Inputs: four arrays (MLX's host cost of a graph node grows with its
// inputs: bench/node_cost.py). proj [B, P], P = C + HV*D + 2*HV: the four
// input projections' outputs concatenated, [qkv | z | a | b] (each row read
// at its offsets); params [C*4 + 2*HV + D] fp32: the layer's constants,
// [conv_w (C*4) | A_log (HV) | dt_bias (HV) | norm_w (D)] (fp32 holds the
// layer's bf16/f16/f32 values exactly); conv_state [B,3,C]; state
// [B,HV,D,D] fp32. Outputs out [B,HV*D], conv_state_out [B,3,C], state_out
// [B,HV,D,D]; scalars float eps_qk, float eps_norm. Launch: B*HV blocks of
// 512 threads.
//
// Build macros: KNAME, GDN_X (proj, conv state, out), GDN_HV, GDN_HK.
#include "gdn_decode_step.cuh"

extern "C" __global__ void __launch_bounds__(NT) KNAME(
    const xt* __restrict__ proj,
    const float* __restrict__ params,
    const xt* __restrict__ conv_state,
    const float* __restrict__ state_in,
    xt* __restrict__ out,
    xt* __restrict__ conv_state_out,
    float* __restrict__ state_out,
    float eps_qk,
    float eps_norm) {
  __shared__ __align__(16) float qsh[D];
  __shared__ __align__(16) float ksh[D];
  __shared__ float vsh[D];
  __shared__ float ysh[D];
  __shared__ float red[4][3];
  __shared__ float gate[2];

  // 1. State loads first: they are the long pole, everything below overlaps.
  float S[E];
  gdn_step_state_loads(state_in, blockIdx.x, S);
  gdn_step<GdnProjLoad>(proj, params, conv_state, S, out, conv_state_out, state_out, eps_qk, eps_norm, blockIdx.x,
                        qsh, ksh, vsh, ysh, red, gate);
}
