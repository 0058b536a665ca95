// Quantised GEMV for decode (1 to 4 token rows): a dense affine-quantised
// projection with its neighbours fused, the call mlx-lm's decoder layer makes
// around each projection at one token per row:
//
//   xin = rms_norm(x, norm_w, eps)           (QG_NORM; else xin = x)
//   y   = xin @ dequant(W).T                 (W [N, K], 4- or 8-bit, group GS)
//   out = residual + y                       (QG_RES; else out = y)
//
// and, with QG_XN, xin itself (written once, by block 0), for a caller whose
// next kernel reads the normalised rows too (the MoE experts after the
// router).
//
// Rounding points are the stock path's: MLX's rms_norm rounds x * r to bf16
// and then its product with the weight; the matmul's result is rounded to
// bf16; the residual add rounds once more. The dot products run on the
// tensor cores (mma m16n8k16, bf16 in, fp32 accumulate) with each weight
// dequantised to bf16(s * q + b), as MLX's dequantize rounds it; the k order
// inside an mma is permuted (moe_decode_common.cuh: pairs (j, j + 4) of 8
// consecutive inputs), the same permutation on both operands.
//
// Layout (mlx.core.quantize, mode "affine"): W uint32 [N, K * BITS / 32],
// value k of row n in bits (k % (32 / BITS)) * BITS of word k / (32 / BITS);
// scales, biases bf16 [N, K / GS].
//
// Grid: ceil(N / 16) blocks of 32 * QG_KW threads. Block b computes rows
// [16 b, 16 b + 16) for all tokens; its warps split K into runs of 128-input
// blocks (warp w: blocks [w * BPW, (w + 1) * BPW)), lane (g, t) = (lane / 4,
// lane % 4) loads rows 16 b + g and + 8, inputs [128 u + 32 t, + 32) of block
// u; the warps' partial sums are added in warp order (deterministic). Every
// weight load is issued before the block stages xin in shared memory. The
// tile's device code: qgemv_tile.cuh (shared with gdn_mixer_decode.cu).
//
// Inputs: x [M, K] bf16, w, scales, biases, [norm_w [K] QG_WT (QG_NORM)],
// [residual [M, N] bf16 (QG_RES)]. Outputs: out [M, N] bf16, [xn [M, K] bf16
// (QG_XN)]. Scalars: n_rows (N), eps.
//
// Build macros: KNAME, QG_BITS (4, 8), QG_GS (32, 64, 128), QG_K (K % GS ==
// 0), QG_M (1..4), QG_KW (warps per block, 1..16), QG_NORM, QG_RES, QG_XN
// (0/1), QG_WT (norm weight type).
#include "qgemv_tile.cuh"

#ifndef QG_WT
#define QG_WT bf16_t
#endif
typedef QG_WT wt;

namespace {
typedef QgCfg<QG_BITS, QG_GS, QG_K, QG_M, QG_KW> Cfg;
constexpr int K = Cfg::K;
constexpr int M = Cfg::M;
constexpr int KWARPS = Cfg::KWARPS;
constexpr int NT = 32 * KWARPS;
static_assert(M * K * 2 <= 32768, "the staged rows fit 32 KB of shared memory");

}  // namespace

extern "C" __global__ void __launch_bounds__(NT) KNAME(
    const bf16_t* __restrict__ x,
    const unsigned* __restrict__ w,
    const bf16_t* __restrict__ scales,
    const bf16_t* __restrict__ biases,
#if QG_NORM
    const wt* __restrict__ norm_w,
#endif
#if QG_RES
    const bf16_t* __restrict__ residual,
#endif
    bf16_t* __restrict__ out,
#if QG_XN
    bf16_t* __restrict__ xn,
#endif
    int n_rows,
    float eps) {
  __shared__ __align__(16) gdn_u16 xs[M][K];
  __shared__ float red[KWARPS > 1 ? KWARPS : 1][32][4];
  __shared__ float ssq[KWARPS][M];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * 16;
  const int u0 = warp * Cfg::BPW;

  // ---- weight loads first: rows past N load row N - 1 (never stored) ------
  uint4 A[2][Cfg::BPW][Cfg::LV];
  unsigned sb[2][Cfg::BPW];
  qg_load<Cfg>(A, sb, w, scales, biases, row0, n_rows, u0, g, t);

  // ---- stage xin = x or rms_norm(x) in shared memory ------------------------
  float part[M];
#pragma unroll
  for (int m = 0; m < M; ++m) part[m] = 0.0f;
  for (int i = tid; i < M * K / 8; i += NT) {
    const uint4 v = ldg16(x + 8 * i);
    *reinterpret_cast<uint4*>(&xs[0][0] + 8 * i) = v;
#if QG_NORM
    float f[8];
    load16(reinterpret_cast<const bf16_t*>(&v), f);
    float s = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) s = fmaf(f[e], f[e], s);
    const int m = (8 * i) / K;
#pragma unroll
    for (int mm = 0; mm < M; ++mm)
      if (mm == m) part[mm] += s;
#endif
  }
#if QG_NORM
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
#pragma unroll 1
    for (int ww = 0; ww < KWARPS; ++ww) s += ssq[ww][m];
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
#endif
  __syncthreads();
#if QG_XN
  if (blockIdx.x == 0)
    for (int i = tid; i < M * K / 8; i += NT)
      *reinterpret_cast<uint4*>(xn + 8 * i) = *reinterpret_cast<const uint4*>(&xs[0][0] + 8 * i);
#endif

  // ---- the warp's blocks: one fp32 mma chain ---------------------------------
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#if QG_BITS == 4
  unsigned bb[4];
  qg_mma<Cfg>(acc, A, sb, xs, u0, g, t, bb);
#else
  // qg_mma8 of qgemv_tile.cuh, statement for statement, kept inline here: as
  // a call nvcc numbers the virtual registers otherwise and this kernel's
  // machine code would change (bench/cubin_identity.py)
#pragma unroll
  for (int i = 0; i < Cfg::BPW; ++i) {
    const int k0 = 128 * (u0 + i) + 32 * t;
    const unsigned s0 = splat_s(sb[0][i]), b0 = splat_b(sb[0][i]);
    const unsigned s1 = splat_s(sb[1][i]), b1 = splat_b(sb[1][i]);
#pragma unroll
    for (int wq = 0; wq < 4; ++wq) {
      unsigned bb[4] = {0u, 0u, 0u, 0u};
      // B column g is token g; lanes past the tokens or past K give zeros
      if (g < M && u0 + i < Cfg::NB && k0 < K) b_pairs(*reinterpret_cast<const uint4*>(&xs[g][k0 + 8 * wq]), bb);
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
#endif

  // ---- the warps' sums in warp order, rounding, residual, store ------------
  if (KWARPS > 1) {
#pragma unroll
    for (int c = 0; c < 4; ++c) red[warp][lane][c] = acc[c];
    __syncthreads();
    if (warp != 0) return;
    qg_warp_order_sum<KWARPS>(acc, red, 0, lane);
  }
#if QG_RES
  qg_store<Cfg, true>(acc, out, residual, row0, n_rows, g, t);
#else
  qg_store<Cfg, false>(acc, out, nullptr, row0, n_rows, g, t);
#endif
}
