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

// ---- the kernels' work items as functions (moe_decode_gemv.cu runs one item
// per CTA; moe_block_decode.cu runs them as phases of one launch) ----------------
//
// Gate + up tile: rows [row0, row0 + 16) of both matrices of one expert, by
// NW warps (warp = the warp's index among them, 0..NW-1), each warp the
// 256-input chunks c = warp, warp + NW, ... of the D inputs. Per warp the
// shared memory of moe_decode_gemv.cu's MDG_KIND 0 header: wsm [8][32]
// uint4 (the chunk's weights; after the last chunk, the warp's partial
// sums, gu_red), sbs [2][2][16][4] bf16 (scales, biases), xs [N][256] bf16
// (x's chunk in B-pair order). XL: uint4 xl(n, kb, l) = x[n][kb + 8 l .. + 8).

constexpr int GU_KC = 256;  // inputs per warp chunk
constexpr int GU_RB = 16;   // weight rows per tile

// A warp's partial sums [2][16][N] (gate, up) in its weight slice.
template <int N>
__device__ __forceinline__ float (*gu_red(uint4 (*wsm)[8][32], int w))[GU_RB][N] {
  return reinterpret_cast<float (*)[GU_RB][N]>(&wsm[w][0][0]);
}

// Warp w's gate+up accumulators acc[m] (c0, c1: row g, tokens 2t, 2t+1; c2,
// c3: row g + 8) into its gu_red slice, the tokens < N.
template <int N>
__device__ __forceinline__ void gu_red_store(uint4 (*wsm)[8][32], int w, const float (&acc)[2][4], int g, int t) {
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int tok = 2 * t + (c & 1);
      if (tok < N) gu_red<N>(wsm, w)[m][g + 8 * (c >> 1)][tok] = acc[m][c];
    }
}

// The warp's chunks into acc[m] (m = 0 gate, 1 up; c0..c3 of the m16n8 C
// fragment): weights, scales and biases through cp.async in four commit
// groups, waited for in the order they are used. moe_decode_gemv.cu's
// gate+up build runs the same statements inline (for its machine code).
template <int N, int NW, int D, class XL>
__device__ __forceinline__ void gu_dots(float (&acc)[2][4], uint4 (*wsm)[8][32], gdn_u16 (*sbs)[2][2][GU_RB][4],
                                        gdn_u16 (*xs)[N][GU_KC], XL xl, const unsigned* W0, const unsigned* W1,
                                        const bf16_t* S0, const bf16_t* S1, const bf16_t* B0, const bf16_t* B1,
                                        int row0, int warp, int lane, int g, int t) {
  constexpr int NCH = D / GU_KC, GKW = D / 8, GKG = D / 64;
  for (int ch = warp; ch < NCH; ch += NW) {
    const int kb = ch * GU_KC;
    // weights: 16 bytes per (u, mat, row g / g+8), copied in four groups in
    // the order they are used, (u, m) = (0, 0), (0, 1), (1, 0), (1, 1), so
    // that the first can be computed while the later ones are in flight
    // (ptxas hoists the second wait of each u next to the first: in effect
    // two halves, u = 0 and u = 1). A lane reads back only the weights it
    // copied (its own waits suffice); the scales and biases, in the first
    // group, 8 bytes (4 groups) per (array, mat, row), two pieces per lane,
    // are read by other lanes: a __syncwarp after the first wait.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int p = lane + 32 * i, arr = p & 1, m = (p >> 1) & 1, r = p >> 2;
      const bf16_t* src = (arr ? (m ? B1 : B0) : (m ? S1 : S0)) + (size_t)(row0 + r) * GKG + (kb >> 6);
      cp_async8(&sbs[warp][arr][m][r][0], src);
    }
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int m = 0; m < 2; ++m) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const size_t row = (size_t)(row0 + g + 8 * hh);
          cp_async16(&wsm[warp][4 * m + 2 * hh + u][lane], (m ? W1 : W0) + row * GKW + (kb >> 3) + 16 * u + 4 * t);
        }
        cp_async_commit();
      }
    // x[:, kb : kb + 256] -> this warp's shared slice, each 8 inputs stored as
    // the mma's B pairs (0,4), (1,5), (2,6), (3,7) (b_pairs once per input)
#pragma unroll
    for (int n = 0; n < N; ++n) {
      unsigned bb[4];
      b_pairs(xl(n, kb, lane), bb);
      *reinterpret_cast<uint4*>(&xs[warp][n][8 * lane]) = make_uint4(bb[0], bb[1], bb[2], bb[3]);
    }
    __syncwarp();
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      uint4 xb[4] = {};  // B pairs of the 128 inputs of u (token g; zero for g >= N)
#pragma unroll
      for (int wd = 0; wd < 4; ++wd)
        if (g < N) xb[wd] = *reinterpret_cast<const uint4*>(&xs[warp][g][128 * u + 32 * t + 8 * wd]);
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        // group (u, m) has landed: at most 3 - (2u + m) younger groups pending
        if (2 * u + m == 0) {
          cp_async_wait<3>();
          __syncwarp();  // the other lanes' scale/bias copies are visible
        }
        else if (2 * u + m == 1) cp_async_wait<2>();
        else if (2 * u + m == 2) cp_async_wait<1>();
        else cp_async_wait<0>();
        unsigned s2[2], b2[2];
        uint4 A[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          // the lane's 32 inputs lie in group kb/64 + 2u + t/2
          const unsigned sv = sbs[warp][0][m][g + 8 * hh][2 * u + (t >> 1)];
          const unsigned bv = sbs[warp][1][m][g + 8 * hh][2 * u + (t >> 1)];
          s2[hh] = sv | (sv << 16);
          b2[hh] = bv | (bv << 16);
          A[hh] = wsm[warp][4 * m + 2 * hh + u][lane];
        }
#pragma unroll
        for (int wd = 0; wd < 4; ++wd) {
          const unsigned bb[4] = {xb[wd].x, xb[wd].y, xb[wd].z, xb[wd].w};
          mma_word(acc[m], w4(A[0], wd), w4(A[1], wd), s2[0], b2[0], s2[1], b2[1], bb);
        }
      }
    }
    __syncwarp();
  }
}

// After gu_dots, each warp's acc stored with gu_red, and a barrier: the
// SwiGLU of row r, token n: bf16(silu(bf16(gate)) * bf16(up)), the NW
// warps' sums added in warp order.
template <int N, int NW>
__device__ __forceinline__ bf16_t gu_swiglu(uint4 (*wsm)[8][32], int r, int n) {
  float gt = 0.0f, up = 0.0f;
#pragma unroll
  for (int w = 0; w < NW; ++w) {
    gt += gu_red<N>(wsm, w)[0][r][n];
    up += gu_red<N>(wsm, w)[1][r][n];
  }
  gt = from_f_round<bf16_t>(gt);
  up = from_f_round<bf16_t>(up);
  return from_f<bf16_t>(silu_f(gt) * up);
}

// Shared-expert gate, first part: thread tid (of NT) takes the inputs 8 tid
// + 8 NT i of x [N][D] (any address space) . w, w dequantised in fp32 (SGB 4,
// 8: s * q + b from packed gw and bf16 gs, gb per group of 64; 16: bf16 gw);
// the warp sums go to gu_red(wsm, warp)[0][0][n]. Then a barrier, then
// sgate_final. moe_decode_gemv.cu's gate+up build runs the same statements
// inline (for its machine code).
template <int N, int D, int NT, int SGB>
__device__ __forceinline__ void sgate_dots(uint4 (*wsm)[8][32], const bf16_t* x, const void* gw, const bf16_t* gs,
                                           const bf16_t* gb, int tid, int lane, int warp) {
  float dot[N];
#pragma unroll
  for (int n = 0; n < N; ++n) dot[n] = 0.0f;
  for (int k0 = 8 * tid; k0 < D; k0 += 8 * NT) {
    float w[8];
    if constexpr (SGB == 16) {
      load16(reinterpret_cast<const bf16_t*>(gw) + k0, w);
    } else {
      const float s = to_f(gs[k0 / 64]), b = to_f(gb[k0 / 64]);
      if constexpr (SGB == 8) {
        const uint2 q = *reinterpret_cast<const uint2*>(reinterpret_cast<const unsigned*>(gw) + k0 / 4);
#pragma unroll
        for (int j = 0; j < 8; ++j) w[j] = s * (float)(((j < 4 ? q.x : q.y) >> (8 * (j & 3))) & 255u) + b;
      } else {
        const unsigned q = reinterpret_cast<const unsigned*>(gw)[k0 / 8];
#pragma unroll
        for (int j = 0; j < 8; ++j) w[j] = s * (float)((q >> (4 * j)) & 15u) + b;
      }
    }
#pragma unroll
    for (int n = 0; n < N; ++n) {
      float xv[8];
      load16(x + (size_t)n * D + k0, xv);
#pragma unroll
      for (int j = 0; j < 8; ++j) dot[n] = fmaf(xv[j], w[j], dot[n]);
    }
  }
#pragma unroll
  for (int n = 0; n < N; ++n) {
    const float v = warp_sum(dot[n]);
    if (lane == 0) gu_red<N>(wsm, warp)[0][0][n] = v;
  }
}
// Token n's gate: sigmoid(bf16(the NW warps' sums in warp order)).
template <int N, int NW>
__device__ __forceinline__ float sgate_final(uint4 (*wsm)[8][32], int n) {
  float v = 0.0f;
#pragma unroll
  for (int w = 0; w < NW; ++w) v += gu_red<N>(wsm, w)[0][0][n];
  return sigmoid_f(from_f_round<bf16_t>(v));
}

// Down item registers: a lane's weight words of rows g, g + 8 of one
// 16-row tile over the whole expert width (NU = I / 128 blocks), and their
// (scale, bias) pairs.
template <int NU>
struct DownRegs {
  uint4 A[2][NU];      // rows g, g + 8
  unsigned sb[2][NU];  // (scale, bias) of the lane's group
};

// Load a down item's registers: rows row0 + g, + 8 of W [D, I / 8] (S, B
// [D, I / 64]) of one expert.
template <int NU>
__device__ __forceinline__ void down_load(DownRegs<NU>& R, const unsigned* Wm, const bf16_t* Sm, const bf16_t* Bm,
                                          int row0, int g, int t) {
  constexpr int KW = NU * 16, KG = NU * 2;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const size_t row = (size_t)(row0 + g + 8 * hh);
#pragma unroll
    for (int u = 0; u < NU; ++u) {
      R.A[hh][u] = ldg_stream16(Wm + row * KW + 16 * u + 4 * t);
      const size_t gi = row * KG + 2 * u + (t >> 1);
      R.sb[hh][u] = load_sb(Sm + gi, Bm + gi);
    }
  }
}

// A down item of expert e (-1: shared) from its registers: coef *
// bf16(h . Wd) for the tile's 16 rows and the N tokens into out [16][N]
// (down_item, item_coefs). hs: the staged h rows [N*k + N][NU * 128]; sg(n):
// the shared expert's gate of token n.
template <int N, int TOPK, int NU, class SG>
__device__ __forceinline__ void down_compute(const DownRegs<NU>& R, int e, int my_e, float my_s, SG sg,
                                             const gdn_u16 (*hs)[NU * 128], float (*out)[N], int lane, int g,
                                             int t) {
  int hrow;
  float cf0, cf1;
  item_coefs<N, TOPK>(e, my_e, my_s, sg, lane, g, t, hrow, cf0, cf1);
  float yacc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  down_item<NU>(
      yacc,
      [&](int u, uint4(&A)[2], unsigned(&s2)[2], unsigned(&b2)[2]) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          A[hh] = R.A[hh][u];
          s2[hh] = splat_s(R.sb[hh][u]);
          b2[hh] = splat_b(R.sb[hh][u]);
        }
      },
      hrow >= 0 ? &hs[hrow][0] : nullptr, t, cf0, cf1);
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int tok = 2 * t + (c & 1);
    if (tok < N) out[g + 8 * (c >> 1)][tok] = yacc[c];
  }
}

// Row r, token n of a down tile: the items' outputs (ired [N*k + 1][16][N],
// by slot) added in slot order: the slots in the mask items (those whose
// expert no lower slot lists), then the shared slot N*k.
template <int N, int NK>
__device__ __forceinline__ float down_slot_sum(const float (*ired)[GU_RB][N], unsigned items, int r, int n) {
  float v = 0.0f;
#pragma unroll 1
  for (int sl = 0; sl < NK; ++sl)
    if ((items >> sl) & 1u) v += ired[sl][r][n];
  v += ired[NK][r][n];
  return v;
}
