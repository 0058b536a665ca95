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
#include "grid_sync.cuh"
#include "next_prefetch.cuh"
#include "phase_clock.cuh"
#include "gdn_decode_step.cuh"
#include "qgemv_tile.cuh"

namespace {

constexpr bool BF = SameType<xt, bf16_t>::value;
static_assert(BF || SameType<xt, float>::value, "GDN_X: bf16_t or float");
constexpr int HID = GM_K;        // hidden size: in_proj's K, out_proj's N
constexpr int M = GM_M;          // token rows
constexpr int KO = HV * D;       // out_proj's K
constexpr int GSZ = 64;          // quantisation group
constexpr int NW = NT / 32;      // warps per block (16)
static_assert(HID % GSZ == 0 && HID >= GSZ, "GM_K: a multiple of 64");
static_assert(M >= 1 && M <= 4, "GM_M: 1 to 4 rows");

// Warps per tile: quantized_gemv.py's warps() (one per 512 inputs, 1..16).
__host__ __device__ constexpr int tile_warps(int k) {
  return k <= 512 ? 1 : ((k + 511) / 512 > 16 ? 16 : (k + 511) / 512);
}
constexpr int KWA = tile_warps(HID), KWC = tile_warps(KO);
constexpr int TA = NW / KWA, TC = NW / KWC;  // tile teams per block
constexpr int TILES_A = (P + 15) / 16, TILES_C = (HID + 15) / 16;
typedef QgCfg<4, GSZ, HID, M, KWA> CfgA;
typedef QgCfg<4, GSZ, KO, M, KWC> CfgC;

// Shared staging of the GEMVs' input rows: bf16 xin [M][HID] (A) and y
// [M][KO] (C); fp32 xin [M][HID] (A; C reads y from L2).
constexpr int STAGE_A = M * HID * (BF ? 2 : 4), STAGE_C = BF ? M * KO * 2 : 0;
constexpr int STAGE = STAGE_A > STAGE_C ? STAGE_A : STAGE_C;
static_assert(STAGE <= 32768, "the staged rows fit 32 KB of shared memory");

// Scratch (bytes): proj from 0, y 16-byte aligned after it (gdn_mixer_decode.py's
// scratch_words: OFF_Y + round16(M * KO * sizeof(xt))).
__host__ __device__ constexpr int round16(int n) {
  return (n + 15) / 16 * 16;
}
constexpr int OFF_PROJ = 0;
constexpr int OFF_Y = OFF_PROJ + round16(M * P * (int)sizeof(xt));
// MQF_PHASE_CLOCK builds: PC_SLOTS int64 per block after y (phase_clock.cuh), marks 0 start, 1 A done,
// 2 barrier 1 passed, 3 B done, 4 barrier 2 passed, 5 end.
constexpr int OFF_CLOCK = OFF_Y + round16(M * KO * (int)sizeof(xt));

constexpr unsigned long long BARW = 1024;  // barrier weight, >= gridDim.x
constexpr unsigned long long NBAR = 2;     // barriers per launch
// The grid barriers' slots: one table per module (one per build configuration), a slot per
// running launch (grid_sync.cuh).
__device__ GridSlot mixer_slots[GRID_SLOTS];

// proj read by the GDN step: through L2 (other blocks wrote it in this launch).
struct ScratchLoad {
  static __device__ __forceinline__ float get(const bf16_t* p) {
    return __uint_as_float(ldcg_u16(p) << 16);
  }
  static __device__ __forceinline__ float get(const float* p) {
    return ldcg_f(p);
  }
};

// ---- bf16: the GEMVs as quantized_gemv.cu's tiles (qgemv_tile.cuh: qg_stage_norm,
// qg_tiles) ------------------------------------------------------------------------------

// ---- fp32: the GEMVs on the CUDA cores ----------------------------------------------------

// out[m][r] = sum_k xin(m, k) * (s * q + b) (+ residual[m][r]) for rows r of
// warp (blockIdx.x * NW + warp) + i * gridDim.x * NW; lanes split K in
// 32-input chunks (4 packed words, one group), the lanes' sums added by
// warp_sum. XIN::get(m, k) reads the input row.
template <int KD, bool RES, class XIN>
__device__ __forceinline__ void gemv_rows_f32(XIN xin, const unsigned* w, const float* scales, const float* biases,
                                              float* out, const float* residual, int n_rows) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  constexpr int WPR = KD / 8, NG = KD / GSZ, CHUNKS = KD / 32;
  for (int r = (int)blockIdx.x * NW + warp; r < n_rows; r += (int)gridDim.x * NW) {
    float acc[M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = 0.0f;
    for (int c = lane; c < CHUNKS; c += 32) {
      const uint4 wv = ldg_stream16(w + (size_t)r * WPR + 4 * c);
      const size_t gi = (size_t)r * NG + (32 * c) / GSZ;
      const float s = scales[gi], b = biases[gi];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const unsigned word = w4(wv, j);
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          const float wf = fmaf(s, (float)((word >> (4 * n)) & 15u), b);
          const int k = 32 * c + 8 * j + n;
#pragma unroll
          for (int m = 0; m < M; ++m) acc[m] = fmaf(wf, xin.get(m, k), acc[m]);
        }
      }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const float v = warp_sum(acc[m]);
      if (lane == 0) out[(size_t)m * n_rows + r] = RES ? v + residual[(size_t)m * n_rows + r] : v;
    }
  }
}

struct SharedRows {
  const float* xs;
  __device__ __forceinline__ float get(int m, int k) const {
    return xs[m * HID + k];
  }
};
struct ScratchRows {
  const float* y;
  __device__ __forceinline__ float get(int m, int k) const {
    return ldcg_f(y + m * KO + k);
  }
};

// xin [M][HID] fp32 = x * rsqrt(mean(x^2) + eps) * norm_w (MLX's rms_norm)
// in shared memory; ends with a __syncthreads.
__device__ __forceinline__ void stage_norm_f32(float* xs, float (*ssq)[M], const float* x, const float* norm_w,
                                               float eps) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float part[M];
#pragma unroll
  for (int m = 0; m < M; ++m) part[m] = 0.0f;
  for (int i = tid; i < M * HID; i += NT) {
    const float v = x[i];
    xs[i] = v;
    const int m = i / HID;
#pragma unroll
    for (int mm = 0; mm < M; ++mm)
      if (mm == m) part[mm] = fmaf(v, v, part[mm]);
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const float s = warp_sum(part[m]);
    if (lane == 0) ssq[warp][m] = s;
  }
  __syncthreads();
  float r[M];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    float s = 0.0f;
    for (int ww = 0; ww < NW; ++ww) s += ssq[ww][m];
    r[m] = rsqrtf(s / (float)HID + eps);
  }
  for (int i = tid; i < M * HID; i += NT) {
    const int m = i / HID;
    float rm = r[0];
#pragma unroll
    for (int mm = 1; mm < M; ++mm)
      if (mm == m) rm = r[mm];
    xs[i] = xs[i] * rm * norm_w[i - m * HID];
  }
  __syncthreads();
}

// The block's shared arrays (declared in the kernel).
struct Smem {
  unsigned char* stage;
  float (*red)[32][4];
  float (*ssq)[M];
  float *qsh, *ksh, *vsh, *ysh;
  float (*gred)[3];
  float* gate;
};

// The whole launch (see the top of the file); a template on the activation
// type T (= xt) so that only the GEMVs of that type are compiled.
template <class T, class PF>
__device__ __forceinline__ void mixer(const T* __restrict__ x, const unsigned* __restrict__ w_in,
                                      const T* __restrict__ s_in, const T* __restrict__ b_in,
                                      const float* __restrict__ params, const T* __restrict__ conv_state,
                                      const float* __restrict__ state_in, const unsigned* __restrict__ w_out,
                                      const T* __restrict__ s_out, const T* __restrict__ b_out, T* __restrict__ out,
                                      T* __restrict__ conv_state_out, float* __restrict__ state_out,
                                      unsigned* __restrict__ scratch, float eps_in, float eps_qk, float eps_norm,
                                      const Smem& sm, PF prefetch_next) {
  T* const proj = reinterpret_cast<T*>(reinterpret_cast<unsigned char*>(scratch) + OFF_PROJ);
  T* const y = reinterpret_cast<T*>(reinterpret_cast<unsigned char*>(scratch) + OFF_Y);
  const float* const in_norm_w = params + C * KW + 2 * HV + D;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  PhaseClock clk;
  clk.mark(0);

  // The launch's slot and its counter before this block's first arrival (grid_sync.cuh; thread 0
  // only); claimed and loaded here, first used at the first barrier.
  unsigned long long v0 = 0;
  if (tid == 0) {
    GridSlot* s = grid_claim(mixer_slots, grid_tag());
    v0 = ld_relaxed_u64(&s->ctr);
  }
  // The slot's counter at each use (thread 0's), from the grid id: not a pointer held in
  // registers across the phases (phase A holds its weight tiles in registers).
  const auto ctr = [] { return &grid_slot(mixer_slots)->ctr; };

  // ---- A: proj = rms_norm(x) @ W_in.T ---------------------------------------------------
  if constexpr (SameType<T, bf16_t>::value) {
    gdn_u16 (*xs)[HID] = reinterpret_cast<gdn_u16 (*)[HID]>(sm.stage);
    const int team = warp / KWA, wt = warp - team * KWA;
    const int tile = qg_tile0<TA, true>(team);
    QgA<CfgA> A;
    QgSB<CfgA> sb;
    if (team < TA && tile < TILES_A)  // weight loads first, as quantized_gemv.cu
      qg_load<CfgA>(A, sb, w_in, s_in, b_in, tile * 16, P, wt * CfgA::BPW, lane >> 2, lane & 3);
    if (team < TA)  // the team's later tiles into L2 while round 0's weights arrive and xs is staged
      for (int tl = tile + (int)gridDim.x * TA; tl < TILES_A; tl += (int)gridDim.x * TA)
        qg_prefetch_l2<CfgA>(w_in, s_in, b_in, tl, P, tid - team * KWA * 32, KWA * 32);
    qg_stage_norm<M, HID, KWA, NT>(xs, sm.ssq, x, in_norm_w, eps_in);
    qg_tiles<CfgA, KWA, TA, TILES_A, false, true>(A, sb, xs, w_in, s_in, b_in, proj, nullptr, P, sm.red);
  } else {
    float* xs = reinterpret_cast<float*>(sm.stage);
    stage_norm_f32(xs, sm.ssq, x, in_norm_w, eps_in);
    gemv_rows_f32<HID, false>(SharedRows{xs}, w_in, s_in, b_in, proj, nullptr, P);
  }

  clk.mark(1);
  // The launch's base: the counter rounded down to a multiple of NBAR * BARW.
  unsigned long long base = 0;
  if (tid == 0) base = grid_launch_base<NBAR, BARW>(v0);
  grid_arrive<BARW>(ctr());
  // the first item's state rows: loaded while the grid meets (after the arrival, whose release
  // would otherwise wait for thread 0's loads in flight)
  float S[E];
  if ((int)blockIdx.x < M * HV) gdn_step_state_loads(state_in, blockIdx.x, S);
  grid_wait(ctr(), base + BARW);
  clk.mark(2);
  if constexpr (SameType<T, bf16_t>::value) {
    // the block's out_proj tiles (phase C) into L2 while the GDN step runs (on M * HV blocks)
    const int team = warp / KWC;
    if (team < TC)
      for (int tl = qg_tile0<TC, true>(team); tl < TILES_C; tl += (int)gridDim.x * TC)
        qg_prefetch_l2<CfgC>(w_out, s_out, b_out, tl, HID, tid - team * KWC * 32, KWC * 32);
  }

  // ---- B: the GDN step of items (b, h) ----------------------------------------------------
  for (int bh = blockIdx.x; bh < M * HV; bh += gridDim.x) {
    if (bh != (int)blockIdx.x) gdn_step_state_loads(state_in, bh, S);
    gdn_step<ScratchLoad>(proj, params, conv_state, S, y, conv_state_out, state_out, eps_qk, eps_norm, bh, sm.qsh,
                          sm.ksh, sm.vsh, sm.ysh, sm.gred, sm.gate);
  }

  clk.mark(3);

  // ---- C: out = x + y @ W_out.T ----------------------------------------------------------
  if constexpr (SameType<T, bf16_t>::value) {
    const int team = warp / KWC, wt = warp - team * KWC;
    const int tile = qg_tile0<TC, true>(team);
    QgA<CfgC> A;
    QgSB<CfgC> sb;
    grid_arrive<BARW>(ctr());
    if (team < TC && tile < TILES_C)  // loaded while the grid meets (after the arrival, as above)
      qg_load<CfgC>(A, sb, w_out, s_out, b_out, tile * 16, HID, wt * CfgC::BPW, lane >> 2, lane & 3);
    prefetch_next();
    grid_wait(ctr(), base + 2 * BARW);
    grid_free(grid_slot(mixer_slots));
    clk.mark(4);
    gdn_u16 (*xs)[KO] = reinterpret_cast<gdn_u16 (*)[KO]>(sm.stage);
    for (int i = tid; i < M * KO / 8; i += NT)
      *reinterpret_cast<uint4*>(&xs[0][0] + 8 * i) = ldcg16(y + 8 * i);
    __syncthreads();
    qg_tiles<CfgC, KWC, TC, TILES_C, true, true>(A, sb, xs, w_out, s_out, b_out, out, x, HID, sm.red);
  } else {
    grid_arrive<BARW>(ctr());
    prefetch_next();
    grid_wait(ctr(), base + 2 * BARW);
    grid_free(grid_slot(mixer_slots));
    clk.mark(4);
    gemv_rows_f32<KO, true>(ScratchRows{y}, w_out, s_out, b_out, out, x, HID);
  }
  clk.mark(5);
  clk.store(reinterpret_cast<long long*>(reinterpret_cast<unsigned char*>(scratch) + OFF_CLOCK), 6);
}
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
    const void* __restrict__ after  // never read (the launch contract)
    PF_PARAMS,                      // the next launch's weights, prefetched into L2 (next_prefetch.cuh)
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
  mixer<xt>(x, w_in, s_in, b_in, params, conv_state, state_in, w_out, s_out, b_out, out, conv_state_out, state_out,
            scratch, eps_in, eps_qk, eps_norm, sm, [&] { next_prefetch(PF_ARGS); });
}
