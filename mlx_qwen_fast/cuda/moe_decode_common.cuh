// Helpers of the decode MoE kernels (moe_decode_gemv.cu): 16-byte weight
// loads, in-register 4-bit dequantisation into bf16x2, the m16n8k16
// tensor-core step with the permuted k order documented in moe_decode_gemv.cu,
// and the down kernel's per-item GEMV and coefficients.
#pragma once
#include "gdn_common.cuh"

// Defaults of the build macros both kernels take (tokens, top-k, model and
// expert widths, shared-gate bits); the wrappers always pass them.
#ifndef MDG_N
#define MDG_N 1
#endif
#ifndef MDG_K
#define MDG_K 8
#endif
#ifndef MDG_D
#define MDG_D 2048
#endif
#ifndef MDG_I
#define MDG_I 512
#endif
#ifndef MDG_SGB
#define MDG_SGB 8
#endif

// (ldg_stream16, ldg_u16, ldg16: ptx.cuh)

// c += a b on the tensor cores, the A fragment as four registers.
__device__ __forceinline__ void mma_bf16(float* c, unsigned a0, unsigned a1, unsigned a2,
                                         unsigned a3, unsigned b0, unsigned b1 MQF_PTX_SITE) {
  const unsigned a[4] = {a0, a1, a2, a3};
#ifdef MQF_CPU_CHECK
  mma_bf16_m16n8k16(c, a, b0, b1, mqf_site);
#else
  mma_bf16_m16n8k16(c, a, b0, b1);
#endif
}

// One packed word -> 4 bf16x2: out[j] = (w of nibble j, w of nibble j + 4),
// w = bf16(s * q + b); s2, b2 = (s, s), (b, b).
__device__ __forceinline__ void dequant_word(unsigned word, unsigned s2, unsigned b2, unsigned* out) {
#pragma unroll
  for (int j = 0; j < 4; ++j) out[j] = dequant_nibble_pair(word >> (4 * j), s2, b2);
}

// 8 consecutive bf16 -> pairs (0,4), (1,5), (2,6), (3,7).
__device__ __forceinline__ void b_pairs(uint4 v, unsigned* bb) {
  bb[0] = prmt(v.x, v.z, 0x5410u);
  bb[1] = prmt(v.x, v.z, 0x7632u);
  bb[2] = prmt(v.y, v.w, 0x5410u);
  bb[3] = prmt(v.y, v.w, 0x7632u);
}

// A lane's scale and bias packed as (s, b) in one u32: loaded as two u16.
__device__ __forceinline__ unsigned load_sb(const bf16_t* s, const bf16_t* b) {
  return ldg_u16(s) | (ldg_u16(b) << 16);
}
// (s, s) and (b, b) from a packed (s, b).
__device__ __forceinline__ unsigned splat_s(unsigned sb) {
  return prmt(sb, sb, 0x1010u);
}
__device__ __forceinline__ unsigned splat_b(unsigned sb) {
  return prmt(sb, sb, 0x3232u);
}

// 16 x 8 x 16 step on one 16-row tile: words wr0 (row g) and wr1 (row g+8)
// of k-block word wd, both halves (two mma).
__device__ __forceinline__ void mma_word(float* acc, unsigned wr0, unsigned wr1, unsigned s0,
                                         unsigned b0, unsigned s1, unsigned b1, const unsigned* bb) {
  unsigned p0[4], p1[4];
  dequant_word(wr0, s0, b0, p0);
  dequant_word(wr1, s1, b1, p1);
  // half 0: k-cols (2t, 2t+1) = nibbles (0, 4), (2t+8, 2t+9) = nibbles (1, 5)
  mma_bf16(acc, p0[0], p1[0], p0[1], p1[1], bb[0], bb[1]);
  // half 1: nibbles (2, 6), (3, 7)
  mma_bf16(acc, p0[2], p1[2], p0[3], p1[3], bb[2], bb[3]);
}

__device__ __forceinline__ unsigned w4(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// One down item of a 16-row tile: for each 128-input block u, getA(u, A, s2,
// b2) gives the lane's two weight words (rows g, g + 8) and their splatted
// scales and biases; hrow is the token's h row in shared memory (nullptr: the
// lane's token did not pick the item). One mma chain per block, the chains
// added in block order, the item's output rounded to bf16 (as SwitchGLU / the
// MLP), then weighted: yacc += bf16(out) * (cf0 for tokens 2t, cf1 for 2t + 1).
template <int NU, class GetA>
__device__ __forceinline__ void down_item(float (&yacc)[4], GetA getA, const gdn_u16* hrow, int t, float cf0,
                                          float cf1) {
  float acc[NU][4];
#pragma unroll
  for (int u = 0; u < NU; ++u)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[u][c] = 0.0f;
#pragma unroll
  for (int u = 0; u < NU; ++u) {
    uint4 A[2];
    unsigned s2[2], b2[2];
    getA(u, A, s2, b2);
#pragma unroll
    for (int wq = 0; wq < 4; ++wq) {
      unsigned bb[4] = {0u, 0u, 0u, 0u};
      if (hrow != nullptr) b_pairs(*reinterpret_cast<const uint4*>(hrow + 128 * u + 32 * t + 8 * wq), bb);
      mma_word(acc[u], w4(A[0], wq), w4(A[1], wq), s2[0], b2[0], s2[1], b2[1], bb);
    }
  }
#pragma unroll
  for (int u = 1; u < NU; ++u)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[0][c] += acc[u][c];
  yacc[0] += from_f_round<bf16_t>(acc[0][0]) * cf0;
  yacc[1] += from_f_round<bf16_t>(acc[0][1]) * cf1;
  yacc[2] += from_f_round<bf16_t>(acc[0][2]) * cf0;
  yacc[3] += from_f_round<bf16_t>(acc[0][3]) * cf1;
}

// The h row (hrow: of token g; -1: none) and the coefficients (cf0, cf1: of
// tokens 2t, 2t + 1) of a down item, expert e (-1: the shared expert, whose
// coefficient is sg(n) = sigmoid of its gate). A routed item's coefficient is
// the score of the token's pair with e, the sum of both if the token listed e
// twice, 0 if it did not pick e; its h row is the token's first pair with e
// (the gate+up tile writes every pair's row). my_e, my_s: inds[lane],
// scores[lane] for lane < N*k (warp-uniform call).
template <int N, int TOPK, class SG>
__device__ __forceinline__ void item_coefs(int e, int my_e, float my_s, SG sg, int lane, int g, int t, int& hrow,
                                           float& cf0, float& cf1) {
  constexpr int NK = N * TOPK;
  hrow = -1;
  cf0 = 0.0f, cf1 = 0.0f;
  if (e < 0) {
    if (g < N) hrow = NK + g;
    if (2 * t < N) cf0 = sg(2 * t);
    if (2 * t + 1 < N) cf1 = sg(2 * t + 1);
    return;
  }
  const unsigned pm = __ballot_sync(0xffffffffu, lane < NK && my_e == e);
#pragma unroll
  for (int n = 0; n < N; ++n) {
    // token n's pairs (TOPK == 32: 1u << 32 would be undefined)
    const unsigned sub = (pm >> (n * TOPK)) & (TOPK >= 32 ? 0xffffffffu : (1u << (TOPK & 31)) - 1u);
    const int p = sub ? n * TOPK + __ffs(sub) - 1 : 0;
    float sc = __shfl_sync(0xffffffffu, my_s, p);
    // (sub is warp-uniform, so is this loop)
    for (unsigned more = sub & (sub - 1u); more; more &= more - 1u)
      sc += __shfl_sync(0xffffffffu, my_s, n * TOPK + __ffs(more) - 1);
    if (sub) {
      if (g == n) hrow = p;
      if (2 * t == n) cf0 = sc;
      if (2 * t + 1 == n) cf1 = sc;
    }
  }
}
