// The one-launch GDN mixer's device code (its constants, helpers and the
// `mixer` body), shared by gdn_mixer_decode.cu (the mixer as its own launch)
// and gdn_layer_decode.cu (the mixer, then the MoE block, in one launch).
// What it computes, its phases and its numerics: gdn_mixer_decode.cu's
// header. Build macros: GDN_X, GDN_HV, GDN_HK, GM_K, GM_M.
#pragma once
#include "grid_sync.cuh"
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

constexpr int KWA = qg_tile_warps(HID), KWC = qg_tile_warps(KO);
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

// The mixer's phases (gdn_mixer_decode.cu's header), a template on the
// activation type T (= xt) so that only the GEMVs of that type are compiled.
// It claims the launch's barrier slot (`bar`, grid_sync.cuh's GridBarriers:
// the mixer is a launch's first body); its two grid barriers are the
// launch's BAR0 + 1 and BAR0 + 2.
template <class T, unsigned BAR0, class Bar>
__device__ __forceinline__ void mixer(const T* __restrict__ x, const unsigned* __restrict__ w_in,
                                      const T* __restrict__ s_in, const T* __restrict__ b_in,
                                      const float* __restrict__ params, const T* __restrict__ conv_state,
                                      const float* __restrict__ state_in, const unsigned* __restrict__ w_out,
                                      const T* __restrict__ s_out, const T* __restrict__ b_out, T* __restrict__ out,
                                      T* __restrict__ conv_state_out, float* __restrict__ state_out,
                                      unsigned* __restrict__ scratch, float eps_in, float eps_qk, float eps_norm,
                                      const Smem& sm, Bar& bar) {
  T* const proj = reinterpret_cast<T*>(reinterpret_cast<unsigned char*>(scratch) + OFF_PROJ);
  T* const y = reinterpret_cast<T*>(reinterpret_cast<unsigned char*>(scratch) + OFF_Y);
  const float* const in_norm_w = params + C * KW + 2 * HV + D;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  PhaseClock clk;
  clk.mark(0);
  bar.claim();  // first used at the first barrier

  // ---- A: proj = rms_norm(x) @ W_in.T ---------------------------------------------------
  if constexpr (SameType<T, bf16_t>::value) {
    gdn_u16 (*xs)[HID] = reinterpret_cast<gdn_u16 (*)[HID]>(sm.stage);
    const int team = warp / KWA, wt = warp - team * KWA;
    const int tile = qg_tile0<TA, true>(team);
    QgA<CfgA> A;
    QgSB<CfgA> sb;
    if (team < TA && tile < TILES_A)  // weight loads first, as quantized_gemv.cu
      qg_load<CfgA>(A, sb, w_in, s_in, b_in, tile * 16, P, wt * CfgA::BPW, lane >> 2, lane & 3);
    qg_stage_norm<M, HID, KWA, NT>(xs, sm.ssq, x, in_norm_w, eps_in);
    qg_tiles<CfgA, KWA, TA, TILES_A, false, true>(A, sb, xs, w_in, s_in, b_in, proj, nullptr, P, sm.red);
  } else {
    float* xs = reinterpret_cast<float*>(sm.stage);
    stage_norm_f32(xs, sm.ssq, x, in_norm_w, eps_in);
    gemv_rows_f32<HID, false>(SharedRows{xs}, w_in, s_in, b_in, proj, nullptr, P);
  }

  clk.mark(1);
  bar.arrive(BAR0 + 1);
  // the first item's state rows: loaded while the grid meets (after the arrival, whose release
  // would otherwise wait for thread 0's loads in flight)
  float S[E];
  if ((int)blockIdx.x < M * HV) gdn_step_state_loads(state_in, blockIdx.x, S);
  bar.wait(BAR0 + 1);
  clk.mark(2);

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
    bar.arrive(BAR0 + 2);
    if (team < TC && tile < TILES_C)  // loaded while the grid meets (after the arrival, as above)
      qg_load<CfgC>(A, sb, w_out, s_out, b_out, tile * 16, HID, wt * CfgC::BPW, lane >> 2, lane & 3);
    bar.wait(BAR0 + 2);
    clk.mark(4);
    gdn_u16 (*xs)[KO] = reinterpret_cast<gdn_u16 (*)[KO]>(sm.stage);
    for (int i = tid; i < M * KO / 8; i += NT)
      *reinterpret_cast<uint4*>(&xs[0][0] + 8 * i) = ldcg16(y + 8 * i);
    __syncthreads();
    qg_tiles<CfgC, KWC, TC, TILES_C, true, true>(A, sb, xs, w_out, s_out, b_out, out, x, HID, sm.red);
  } else {
    bar.arrive(BAR0 + 2);
    bar.wait(BAR0 + 2);
    clk.mark(4);
    gemv_rows_f32<KO, true>(ScratchRows{y}, w_out, s_out, b_out, out, x, HID);
  }
  clk.mark(5);
  clk.store(reinterpret_cast<long long*>(reinterpret_cast<unsigned char*>(scratch) + OFF_CLOCK), 6);
}
}  // namespace

