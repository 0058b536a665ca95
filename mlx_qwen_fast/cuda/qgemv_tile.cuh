// The quantised decode GEMV's device code (1 to 4 token rows), per 16-row
// output tile: quantized_gemv.cu's, shared with gdn_mixer_decode.cu (which
// runs two such GEMVs in one launch). What it computes and its rounding
// points: quantized_gemv.cu's header.
//
// A tile (rows [row0, row0 + 16) for all M tokens) belongs to KWARPS warps,
// warp w of them (u0 = w * BPW) owning the 128-input blocks [u0, u0 + BPW):
//   qg_load         the warp's weight words, scales and biases into registers
//                   (lane (g, t) = (lane / 4, lane % 4): rows row0 + g and + 8,
//                   inputs [128 u + 32 t, + 32) of block u; rows past N load
//                   row N - 1, never stored);
//   (the kernel stages xin [M][K] bf16 in shared memory)
//   qg_mma          the warp's fp32 mma chain over its blocks (4-bit);
//   qg_warp_order_sum, qg_store   the KWARPS partial sums added in warp
//                   order (deterministic), rounded to bf16, residual added,
//                   stored.
// The same tile with the same staged xin gives the same bits in any kernel
// that runs these steps.
//
// Layout (mlx.core.quantize, mode "affine"): W uint32 [N, K * BITS / 32],
// value k of row n in bits (k % (32 / BITS)) * BITS of word k / (32 / BITS);
// scales, biases bf16 [N, K / GS].
#pragma once
#include "moe_decode_common.cuh"

// A GEMV's shape: BITS (4, 8), GS (32, 64, 128), K (K % GS == 0), M token
// rows (1..4), KWARPS warps per tile (1..16).
template <int BITS_, int GS_, int K_, int M_, int KWARPS_>
struct QgCfg {
  static constexpr int BITS = BITS_;
  static constexpr int GS = GS_;
  static constexpr int K = K_;
  static constexpr int M = M_;
  static constexpr int KWARPS = KWARPS_;
  static constexpr int NB = (K + 127) / 128;                 // 128-input blocks (the last may be partial)
  static constexpr int BPW = (NB + KWARPS - 1) / KWARPS;     // blocks per warp
  static constexpr int WPR = K * BITS / 32;                  // packed words per row
  static constexpr int NG = K / GS;                          // groups per row
  static constexpr int LV = BITS / 4;                        // 16-byte loads per lane per row and block
  static_assert(BITS == 4 || BITS == 8, "4- or 8-bit weights");
  static_assert(GS == 32 || GS == 64 || GS == 128, "group size 32, 64 or 128");
  static_assert(K % GS == 0 && K >= GS, "K a multiple of the group size");
  static_assert(M >= 1 && M <= 4, "1 to 4 token rows");
  static_assert(KWARPS >= 1 && KWARPS <= 16, "1 to 16 warps per block");
};

// A warp's weight registers for one tile: A[2][BPW][LV] (the words of rows
// g, g + 8) and sb[2][BPW] (their packed scales and biases).
template <class Cfg>
using QgA = uint4[2][Cfg::BPW][Cfg::LV];
template <class Cfg>
using QgSB = unsigned[2][Cfg::BPW];

// The warp's weight loads (blocks [u0, u0 + BPW)) of rows row0 + g, + 8.
template <class Cfg>
__device__ __forceinline__ void qg_load(QgA<Cfg>& A, QgSB<Cfg>& sb, const unsigned* __restrict__ w,
                                        const bf16_t* __restrict__ scales, const bf16_t* __restrict__ biases,
                                        int row0, int n_rows, int u0, int g, int t) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = min(row0 + g + 8 * hh, n_rows - 1);
#pragma unroll
    for (int i = 0; i < Cfg::BPW; ++i) {
      const int k0 = 128 * (u0 + i) + 32 * t;
      if (u0 + i < Cfg::NB && k0 < Cfg::K) {
        const unsigned* p = w + (size_t)r * Cfg::WPR + k0 * Cfg::BITS / 32;
#pragma unroll
        for (int v = 0; v < Cfg::LV; ++v) A[hh][i][v] = ldg_stream16(p + 4 * v);
        const size_t gi = (size_t)r * Cfg::NG + k0 / Cfg::GS;
        sb[hh][i] = load_sb(scales + gi, biases + gi);
      } else {
#pragma unroll
        for (int v = 0; v < Cfg::LV; ++v) A[hh][i][v] = make_uint4(0u, 0u, 0u, 0u);
        sb[hh][i] = 0u;
      }
    }
  }
}

// The warp's blocks as one fp32 mma chain into acc (c0..c3 of the m16n8 C
// fragment: rows g, g + 8; tokens 2t, 2t + 1), 4-bit weights (quantized_gemv.cu
// keeps its own 8-bit loop). bb: four registers of the caller for the B
// fragments (declared in the kernel rather than here: the register numbering
// nvcc emits, and with it ptxas's allocation, follows where they are
// declared; so quantized_gemv.cu compiles to the machine code of its own loop).
template <class Cfg>
__device__ __forceinline__ void qg_mma(float* acc, const QgA<Cfg>& A, const QgSB<Cfg>& sb,
                                       const gdn_u16 (*xs)[Cfg::K], int u0, int g, int t, unsigned (&bb)[4]) {
  static_assert(Cfg::BITS == 4, "qg_mma: 4-bit weights");
#pragma unroll
  for (int i = 0; i < Cfg::BPW; ++i) {
    const int k0 = 128 * (u0 + i) + 32 * t;
    const unsigned s0 = splat_s(sb[0][i]), b0 = splat_b(sb[0][i]);
    const unsigned s1 = splat_s(sb[1][i]), b1 = splat_b(sb[1][i]);
#pragma unroll
    for (int wq = 0; wq < 4; ++wq) {
      bb[0] = 0u, bb[1] = 0u, bb[2] = 0u, bb[3] = 0u;
      // B column g is token g; lanes past the tokens or past K give zeros
      if (g < Cfg::M && u0 + i < Cfg::NB && k0 < Cfg::K) b_pairs(*reinterpret_cast<const uint4*>(&xs[g][k0 + 8 * wq]), bb);
      mma_word(acc, w4(A[0][i][0], wq), w4(A[1][i][0], wq), s0, b0, s1, b1, bb);
    }
  }
}

// acc = the partial sums of warps w0 .. w0 + KW - 1 (red [warp][lane][c]),
// added in warp order.
template <int KW>
__device__ __forceinline__ void qg_warp_order_sum(float* acc, const float (*red)[32][4], int w0, int lane) {
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    float s = red[w0][lane][c];
#pragma unroll 1
    for (int ww = 1; ww < KW; ++ww) s += red[w0 + ww][lane][c];
    acc[c] = s;
  }
}

// out[m][row] = bf16(bf16(acc) (+ residual[m][row])) for the lane's four
// results that exist (token m < M, row < n_rows).
template <class Cfg, bool RES>
__device__ __forceinline__ void qg_store(const float* acc, bf16_t* out, const bf16_t* residual, int row0,
                                         int n_rows, int g, int t) {
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int m = 2 * t + (c & 1), row = row0 + g + 8 * (c >> 1);
    if (m < Cfg::M && row < n_rows) {
      float v = from_f_round<bf16_t>(acc[c]);
      if constexpr (RES) v += to_f(residual[(size_t)m * n_rows + row]);
      out[(size_t)m * n_rows + row] = from_f<bf16_t>(v);
    }
  }
}
