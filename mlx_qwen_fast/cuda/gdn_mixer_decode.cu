// A Gated DeltaNet decoder layer's mixer for one decode step (T = 1), in one
// launch:
//
//   proj = rms_norm(x, w_in_norm, eps_in) @ dequant(W_in).T     [qkv | z | a | b]
//   y, conv_state', state' = the GDN step (gdn_decode_step.cuh) on proj
//   out  = x + y @ dequant(W_out).T
//
// the work of quantized_gemv.cu (norm + in_proj), gated_delta_decode.cu and
// quantized_gemv.cu again (out_proj + residual), each phase with the same
// device code and arithmetic order as those kernels, so that for bf16
// activations the results are those of the three launches bit for bit (the
// CUDA check shows it on the CPU; on the GPU the same instructions run in
// the same order, which holds unless the two compilations contract or order
// an fp32 operation differently).
//
// A persistent grid of G <= SM-count CTAs of 512 threads, all resident at
// once, exchanging data through global scratch and two grid barriers
// (grid_sync.cuh):
//   A  every CTA stages rms_norm(x) in shared memory and computes 16-row
//      tiles of proj ([qkv | z | a | b], P rows): in bf16, teams of KWA
//      warps per tile as quantized_gemv.cu's blocks (tiles over the grid's
//      teams team-major, team * G + block: see "Tile order" below; the next
//      tile's weights loaded while the last one is summed);
//      in fp32, one warp per row on the CUDA cores. proj -> scratch.
//      The first GDN item's state rows are loaded while the grid meets.
//   --- barrier 1 ---
//   B  items (b, h), bh = blockIdx.x + k * G: the GDN step (conv, norms,
//      gates, recurrence, gated RMSNorm) of gated_delta_decode.cu's block,
//      proj read through L2 (ld.global.cg); y -> scratch, conv state and
//      state to their outputs. The first out_proj tile's weights are loaded
//      while the grid meets (after this block's arrival: the arrival's
//      release would wait for loads in flight).
//   --- barrier 2 ---
//   C  out_proj tiles (teams of KWC warps, or a warp per row in fp32), y
//      read through L2, the residual x added, out stored.
//
// Numerics: bf16 activations: quantized_gemv.cu's rounding points (the
// norm's two, the GEMV result, the residual add) and gated_delta_decode.cu's
// (q, k, v, y, the gated norm's); the staged norm takes its sum of squares
// with the first 32 * KWA threads in quantized_gemv's order. fp32
// activations: fp32 throughout (no rounding), weights dequantised to
// s * q + b in fp32 (fp32 scales and biases), fp32 dot products.
//
// Inputs: x [M, K] (xt), w_in uint32 [P, K / 8], s_in, b_in [P, K / 64]
// (xt), params fp32 [C*4 + 2*HV + D + K] = [conv_w | A_log | dt_bias | norm_w
// (D) | w_in_norm (K)], conv_state [M, 3, C] (xt), state [M, HV, D, D] fp32,
// w_out uint32 [K, HV*D / 8], s_out, b_out [K, HV*D / 64] (xt), after (any
// array, never read: see the launch contract). Outputs: out
// [M, K] (xt), conv_state_out [M, 3, C], state_out [M, HV, D, D], scratch
// uint32 [scratch_words]: proj [M, P] (xt, from byte 0), y [M, HV*D] (xt,
// 16-byte aligned); no output needs a start value. Scalars: float eps_in,
// eps_qk, eps_norm. Weights: affine 4-bit, group 64 (mx.quantize).
//
// Launch contract: G blocks of 512 threads, G <= the number of SMs and
// G <= BARW, every block resident at once (one block fits an SM, not two:
// 512 threads x ~100 registers); other kernels only delay it. MLX orders two
// launches only when one reads what the other writes (its CUDA graphs have
// edges from a buffer's writer to its readers), so launches of graphs that
// do not depend on each other (teacher-forced tokens evaluated together) may
// run at once: each launch takes a barrier slot of its own from the module's
// table (grid_sync.cuh: claimed by its grid id, freed after the last
// barrier), and the decode step also passes the previous call's output as
// `after` to its first such launch (ops/_launch_order.py), so that its calls
// run in order. A grid that is not resident traps after ~2^23 polls rather
// than hang. The slots are __device__ variables of the kernel's module (zero
// when the module loads, counters never reset: grid_sync.cuh's contract),
// so a launch needs no output filled first; a counter value that cannot be
// a launch's start (remainder mod 2 * BARW at least BARW when a block first
// reads it) traps.
//
// Build macros: KNAME, GDN_X (bf16_t or float), GDN_HV, GDN_HK, GM_K
// (hidden size, a multiple of 64), GM_M (1..4 rows).
//
// Tile order: the bf16 GEMV tiles of phases A and C go team-major over the
// grid (qgemv_tile.cuh's qg_tile0 / qg_tiles with SPREAD true: team t of
// block b starts at tile t * G + b), so the tiles of a last, partial round
// fall one per block before any block gets a second one: no block runs two
// of the round's tiles while another idles, and every block's SM loads
// weights, not the first blocks' alone (timings: bench/results/gdn-cuda-log.md).
// A tile's arithmetic does not depend on which team runs it.
//
// Prediction for the GPU (Qwen3.6-35B-A3B: K = 2048, HK = 16, HV = 32, P =
// 12352, bf16, one token; not measured). Bytes per step: in_proj 12352 x
// 2048 x 0.5 B = 12.65 MB + scales/biases 1.58 MB; out_proj 2048 x 4096 x
// 0.5 B = 4.19 MB + 0.52 MB; state 2.10 MB read + 2.10 MB written;
// conv state, constants, x, scratch < 0.5 MB: ~24 MB, 19 MB of it weights.
// At ~3 TB/s effective: ~8 us of memory time, plus two grid barriers
// (~1 us each, bench: 0.6-1.3 us per grid-wide exchange), the launch and the
// first loads (~2 us): ~12-13 us per layer, ~0.4 ms per token over 30
// layers. Phase B runs on B * HV blocks (32 of 132 at B = 1), as
// gated_delta_decode.cu's grid does. About the three launches' GPU time
// (same bytes; two barriers for two inter-kernel gaps of ~1.3 us). The gain
// is host time: 3 graph nodes -> 1 per GDN layer, 60 nodes fewer per token
// (7-9 us of host time per small custom-kernel node, bench/node_cost.py:
// ~0.4-0.5 ms per token), less what this node's 10 inputs add.
#include "gdn_mixer_body.cuh"

namespace {
constexpr unsigned long long NBAR = 2;  // barriers per launch
// The grid barriers' slots: one table per module (one per build configuration), a slot per
// running launch (grid_sync.cuh).
__device__ GridSlot mixer_slots[GRID_SLOTS];
struct MixerSlots {
  static __device__ __forceinline__ GridSlot* table() { return mixer_slots; }
};
}  // namespace

extern "C" __global__ void __launch_bounds__(NT) KNAME(
    const xt* __restrict__ x,
    const unsigned* __restrict__ w_in,
    const xt* __restrict__ s_in,
    const xt* __restrict__ b_in,
    const float* __restrict__ params,
    const xt* __restrict__ conv_state,
    const float* __restrict__ state_in,
    const unsigned* __restrict__ w_out,
    const xt* __restrict__ s_out,
    const xt* __restrict__ b_out,
    const void* __restrict__ after,  // never read (the launch contract)
    xt* __restrict__ out,
    xt* __restrict__ conv_state_out,
    float* __restrict__ state_out,
    unsigned* __restrict__ scratch,
    float eps_in,
    float eps_qk,
    float eps_norm) {
  __shared__ __align__(16) unsigned char stage[STAGE];
  __shared__ float red[NW][32][4];
  __shared__ float ssq[NW][M];
  __shared__ __align__(16) float qsh[D];
  __shared__ __align__(16) float ksh[D];
  __shared__ float vsh[D];
  __shared__ float ysh[D];
  __shared__ float gred[4][3];
  __shared__ float gate[2];
  const Smem sm{stage, red, ssq, qsh, ksh, vsh, ysh, gred, gate};
  GridBarriers<NBAR, BARW, MixerSlots> bar;  // the launch's slot: claimed by the body
  mixer<xt, 0>(x, w_in, s_in, b_in, params, conv_state, state_in, w_out, s_out, b_out, out, conv_state_out, state_out,
               scratch, eps_in, eps_qk, eps_norm, sm, bar);
}
