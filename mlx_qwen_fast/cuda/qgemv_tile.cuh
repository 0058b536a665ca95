// The quantised decode GEMV's device code (1 to 4 token rows), per 16-row
// output tile: quantized_gemv.cu's, shared with the one-launch kernels that
// run such GEMVs as phases (gdn_mixer_decode.cu: two; moe_block_decode.cu:
// the router). What it computes and its rounding points: quantized_gemv.cu's
// header.
//
// A tile (rows [row0, row0 + 16) for all M tokens) belongs to KWARPS warps,
// warp w of them (u0 = w * BPW) owning the 128-input blocks [u0, u0 + BPW):
//   qg_load         the warp's weight words, scales and biases into registers
//                   (lane (g, t) = (lane / 4, lane % 4): rows row0 + g and + 8,
//                   inputs [128 u + 32 t, + 32) of block u; rows past N load
//                   row N - 1, never stored);
//   (the kernel stages xin [M][K] bf16 in shared memory)
//   qg_mma, qg_mma8 the warp's fp32 mma chain over its blocks (4-, 8-bit);
//   qg_warp_order_sum, qg_store   the KWARPS partial sums added in warp
//                   order (deterministic), rounded to bf16, residual added,
//                   stored.
// The same tile with the same staged xin gives the same bits in any kernel
// that runs these steps. For kernels whose blocks run several tiles
// (persistent grids): qg_stage_norm (xin = rms_norm(x) staged as
// quantized_gemv.cu's block of 32 * KWARPS threads stages it) and qg_tiles
// (a GEMV's tiles over the grid's teams of KWARPS warps).
//
// Layout (mlx.core.quantize, mode "affine"): W uint32 [N, K * BITS / 32],
// value k of row n in bits (k % (32 / BITS)) * BITS of word k / (32 / BITS);
// scales, biases bf16 [N, K / GS].
#pragma once
#include "moe_decode_common.cuh"

// Warps per tile of a K-input GEMV: quantized_gemv.py's warps() (one per 512
// inputs, 1..16).
__host__ __device__ constexpr int qg_tile_warps(int k) {
  return k <= 512 ? 1 : ((k + 511) / 512 > 16 ? 16 : (k + 511) / 512);
}

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

// 8 consecutive 8-bit values (words a: values 0-3, b: 4-7) -> 4 bf16x2:
// out[j] = (bf16(s q_j + b), bf16(s q_{j+4} + b)). A byte placed in the
// mantissa of 2^23 gives 2^23 + q exactly; the fma and the bf16 rounding are
// fp32 math on exact values.
__device__ __forceinline__ void dequant8_pairs(unsigned a, unsigned b, float s, float bias, unsigned* out) {
  const unsigned magic = 0x4B000000u;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const unsigned sel = (unsigned)j | (4u << 4) | (4u << 8) | (7u << 12);
    const float q0 = __uint_as_float(prmt(a, magic, sel)) - 8388608.0f;
    const float q1 = __uint_as_float(prmt(b, magic, sel)) - 8388608.0f;
    out[j] = cvt_rn_bf16x2_f32(fmaf(s, q1, bias), fmaf(s, q0, bias));
  }
}

// qg_mma for 8-bit weights (LV = 2 16-byte loads per block and row; words
// wa, wa + 1 of load v hold the 8 inputs of mma word wq), dequantised by
// dequant8_pairs (fp32 fma, one bf16 rounding). quantized_gemv.cu's 8-bit
// build runs the same statements inline (for its machine code).
template <class Cfg>
__device__ __forceinline__ void qg_mma8(float* acc, const QgA<Cfg>& A, const QgSB<Cfg>& sb,
                                        const gdn_u16 (*xs)[Cfg::K], int u0, int g, int t, unsigned (&bb)[4]) {
  static_assert(Cfg::BITS == 8, "qg_mma8: 8-bit weights");
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
      unsigned p0[4], p1[4];
      const int v = wq >> 1, wa = 2 * (wq & 1);
      dequant8_pairs(w4(A[0][i][v], wa), w4(A[0][i][v], wa + 1), __uint_as_float(s0 << 16),
                     __uint_as_float(b0 << 16), p0);
      dequant8_pairs(w4(A[1][i][v], wa), w4(A[1][i][v], wa + 1), __uint_as_float(s1 << 16),
                     __uint_as_float(b1 << 16), p1);
      mma_bf16(acc, p0[0], p1[0], p0[1], p1[1], bb[0], bb[1]);
      mma_bf16(acc, p0[2], p1[2], p0[3], p1[3], bb[2], bb[3]);
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

// ---- several tiles per block (persistent grids) ---------------------------------------

// xs [M][K] = rms_norm(x) in shared memory (bf16), as quantized_gemv.cu
// stages it for a block of 32 * KW threads: the first 32 * KW threads of the
// block (of NT) take the sums of squares in that kernel's order (chunk i of
// 8 inputs by thread i mod 32 KW, a warp_sum per row, the warps' sums in
// warp order), every thread normalises (MLX's rms_norm roundings:
// bf16(w * bf16(x * r))). ssq [>= KW][M]. CG: x read through L2 only
// (ld.global.cg: rows other blocks wrote earlier in the same launch), else
// through the non-coherent path. Ends with a __syncthreads.
template <int M, int K, int KW, int NT, bool CG = false, class WT>
__device__ __forceinline__ void qg_stage_norm(gdn_u16 (*xs)[K], float (*ssq)[M], const bf16_t* x, const WT* norm_w,
                                              float eps) {
  constexpr int NTR = 32 * KW;
  static_assert(NTR <= NT, "the staging threads are the block's first 32 * KW");
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float part[M];
#pragma unroll
  for (int m = 0; m < M; ++m) part[m] = 0.0f;
  if (tid < NTR) {
    for (int i = tid; i < M * K / 8; i += NTR) {
      const uint4 v = CG ? ldcg16(x + 8 * i) : ldg16(x + 8 * i);
      *reinterpret_cast<uint4*>(&xs[0][0] + 8 * i) = v;
      float f[8];
      load16(reinterpret_cast<const bf16_t*>(&v), f);
      float s = 0.0f;
#pragma unroll
      for (int e = 0; e < 8; ++e) s = fmaf(f[e], f[e], s);
      const int m = (8 * i) / K;
#pragma unroll
      for (int mm = 0; mm < M; ++mm)
        if (mm == m) part[mm] += s;
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const float s = warp_sum(part[m]);
    if (lane == 0 && warp < KW) ssq[warp][m] = s;
  }
  __syncthreads();
  float r[M];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    float s = 0.0f;
#pragma unroll 1
    for (int ww = 0; ww < KW; ++ww) s += ssq[ww][m];
    r[m] = rsqrtf(s / (float)K + eps);
  }
  for (int i = tid; i < M * K; i += NT) {
    const int m = i / K, k = i - m * K;
    float rm = r[0];
#pragma unroll
    for (int mm = 1; mm < M; ++mm)
      if (mm == m) rm = r[mm];
    bf16_t* e = reinterpret_cast<bf16_t*>(&xs[0][0]) + i;
    const float v = from_f_round<bf16_t>(to_f(norm_w[k]) * from_f_round<bf16_t>(to_f(*e) * rm));
    *e = from_f<bf16_t>(v);
  }
  __syncthreads();
}

// First tile of team `team` (of T per block) in a GEMV over the grid's
// teams; round r adds r * gridDim.x * T. Block-major (SPREAD false): tiles
// blockIdx.x * T + team, a block's teams on consecutive tiles. Team-major
// (SPREAD true): team * gridDim.x + blockIdx.x, so the tiles of a last,
// partial round fall one per block before any block gets a second one
// (every block's SM loads weights, not the first blocks' alone). Each tile's
// arithmetic is the same in both orders: bit-identical results.
template <int T, bool SPREAD>
__device__ __forceinline__ int qg_tile0(int team) {
  return SPREAD ? team * (int)gridDim.x + (int)blockIdx.x : (int)blockIdx.x * T + team;
}

// One GEMV over the grid's teams (team = warp / KW of every block, T teams
// per block; tile qg_tile0<T, SPREAD>(team) + r * gridDim.x * T in round r):
// each tile exactly as quantized_gemv.cu's block computes it. A / sb hold
// round 0's weights on entry (qg_load by the caller); the next round's are
// loaded after each mma chain. red [warps][32][4]: the warps' partial sums.
// Every thread of the block calls it (the rounds' __syncthreads). Ends with
// a __syncthreads.
template <class Cfg, int KW, int T, int TILES, bool RES, bool SPREAD = false>
__device__ __forceinline__ void qg_tiles(QgA<Cfg>& A, QgSB<Cfg>& sb, const gdn_u16 (*xs)[Cfg::K], const unsigned* w,
                                         const bf16_t* scales, const bf16_t* biases, bf16_t* out,
                                         const bf16_t* residual, int n_rows, float (*red)[32][4]) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int team = warp / KW, wt = warp - team * KW;
  const int u0 = wt * Cfg::BPW;
  const int stride = (int)gridDim.x * T;
  const int rounds = (TILES + stride - 1) / stride;
  int tile = qg_tile0<T, SPREAD>(team);
  bool act = team < T && tile < TILES;
  for (int r = 0; r < rounds; ++r) {
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if constexpr (Cfg::BITS == 4) {
      unsigned bb[4];
      if (act) qg_mma<Cfg>(acc, A, sb, xs, u0, g, t, bb);
    } else {
      unsigned bb[4];
      if (act) qg_mma8<Cfg>(acc, A, sb, xs, u0, g, t, bb);
    }
    const int next = tile + stride;
    const bool next_act = team < T && next < TILES;
    if (next_act) qg_load<Cfg>(A, sb, w, scales, biases, next * 16, n_rows, u0, g, t);
    if constexpr (KW > 1) {
#pragma unroll
      for (int c = 0; c < 4; ++c) red[warp][lane][c] = acc[c];
      __syncthreads();
      if (act && wt == 0) {
        qg_warp_order_sum<KW>(acc, red, team * KW, lane);
        qg_store<Cfg, RES>(acc, out, residual, tile * 16, n_rows, g, t);
      }
      __syncthreads();
    } else {
      if (act) qg_store<Cfg, RES>(acc, out, residual, tile * 16, n_rows, g, t);
    }
    tile = next;
    act = next_act;
  }
  __syncthreads();
}
