// Gate + up + SwiGLU tile of the decode MoE kernel moe_decode_gemv.cu
// (MDG_KIND 0): one CTA of NT = 256 threads computes
// rows [16 rb, +16) of the gate and the up matrix of one item for the N
// tokens, or the shared-expert gate (see moe_decode_gemv.cu for the layouts,
// the numerics and the shared-memory use).
//
// The includer defines, before including: constexpr int N, TOPK, NK, D, I,
// NW (8), NT (256), RB (16), and includes moe_decode_common.cuh. With
// MDG_TIMING, GateUpArgs carries tim: [CTAs, 8] uint64 %globaltimer stamps
// (ns) of thread 0 at the tile's phase points (slots 0-5, by linear CTA).
#pragma once

constexpr int KC = 256;       // inputs per warp chunk
constexpr int NCH = D / KC;   // chunks (warp w: c = w, w + NW, ...)
constexpr int GKW = D / 8;    // packed words per row (x side)
constexpr int GKG = D / 64;   // groups per row
constexpr int GU_OFF_SB = NW * 8 * 32 * 16;
constexpr int GU_OFF_X = GU_OFF_SB + NW * 2 * 2 * RB * 4 * 2;
constexpr int GU_SMEM = GU_OFF_X + NW * N * KC * 2;  // = 36864 + 4096 N (kernels/moe_decode_gemv.py)


struct GateUpArgs {
  const bf16_t* x;
  const int* inds;
  const unsigned *wg, *wu, *xwg, *xwu;  // routed [E, I, D/8], shared [I, D/8]
  const bf16_t *sg, *bg, *su, *bu, *xsg, *xbg, *xsu, *xbu;  // [E, I, D/64], [I, D/64]
  const void* gw;  // shared-expert gate (MDG_SGB bits)
  const bf16_t *gs, *gb;
  bf16_t* h;
  float* sgate;
#ifdef MDG_TIMING
  unsigned long long* tim;
#endif
};

#ifdef MDG_TIMING
#define GU_STAMP(i) MDG_STAMP_TO(a.tim, i)
#else
#define GU_STAMP(i)
#endif

// CTA (rb, item) of the gate+up grid, item < NK: pair item, NK: the shared
// expert, NK + 1: the shared-expert gate (rb == 0; other rb return at once).
// Returns with every thread at the same point (no barrier after the stores).
__device__ __forceinline__ void gate_up_cta(const GateUpArgs& a, const int item, const int rb,
                                            unsigned char* dsm) {
  // Dynamic shared memory (GU_SMEM bytes; the kernel traps when given less):
  // every global read of the dot products goes through cp.async, so that all
  // of a lane's pieces are in flight at once (as register loads, ptxas sinks
  // three of the eight weight loads -- and then scale loads -- behind the
  // first mma under the 80-register cap: a second DRAM round trip).
  //   wsm [NW][8][32] uint4: a warp's weights of one chunk, [m*4 + hh*2 + u][lane];
  //       after the last chunk the warp's slice holds its partial sums,
  //       red(w) = [2][RB][N] floats
  //   sbs [NW][2][2][RB][4] bf16: the chunk's scales (0) and biases (1) of
  //       both matrices, 4 groups per row
  //   xs  [NW][N][KC] bf16: x's chunk, each 8 inputs stored as B pairs
  uint4 (*wsm)[8][32] = reinterpret_cast<uint4 (*)[8][32]>(dsm);
  gdn_u16 (*sbs)[2][2][RB][4] = reinterpret_cast<gdn_u16 (*)[2][2][RB][4]>(dsm + GU_OFF_SB);
  gdn_u16 (*xs)[N][KC] = reinterpret_cast<gdn_u16 (*)[N][KC]>(dsm + GU_OFF_X);
  static_assert(2 * RB * N * sizeof(float) <= 8 * 32 * 16, "partial sums fit a warp's weight slice");
  auto red = [&](int w) { return reinterpret_cast<float (*)[RB][N]>(&wsm[w][0][0]); };
  {
    unsigned dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (dyn < GU_SMEM) __trap();
  }

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  GU_STAMP(0);  // start

  if (item == NK + 1) {
    // ---- shared-expert gate: sigmoid(bf16(x[n] . w)) ----------------------
    if (rb != 0) return;
    float dot[N];
#pragma unroll
    for (int n = 0; n < N; ++n) dot[n] = 0.0f;
    for (int k0 = 8 * tid; k0 < D; k0 += 8 * NT) {
      float w[8];
#if MDG_SGB == 16
      load16(reinterpret_cast<const bf16_t*>(a.gw) + k0, w);
#else
      const float s = to_f(a.gs[k0 / 64]), b = to_f(a.gb[k0 / 64]);
#if MDG_SGB == 8
      const uint2 q = *reinterpret_cast<const uint2*>(reinterpret_cast<const unsigned*>(a.gw) + k0 / 4);
#pragma unroll
      for (int j = 0; j < 8; ++j) w[j] = s * (float)(((j < 4 ? q.x : q.y) >> (8 * (j & 3))) & 255u) + b;
#else
      const unsigned q = reinterpret_cast<const unsigned*>(a.gw)[k0 / 8];
#pragma unroll
      for (int j = 0; j < 8; ++j) w[j] = s * (float)((q >> (4 * j)) & 15u) + b;
#endif
#endif
#pragma unroll
      for (int n = 0; n < N; ++n) {
        float xv[8];
        load16(a.x + (size_t)n * D + k0, xv);
#pragma unroll
        for (int j = 0; j < 8; ++j) dot[n] = fmaf(xv[j], w[j], dot[n]);
      }
    }
#pragma unroll
    for (int n = 0; n < N; ++n) {
      const float v = warp_sum(dot[n]);
      if (lane == 0) red(warp)[0][0][n] = v;
    }
    __syncthreads();
    if (tid < N) {
      float v = 0.0f;
#pragma unroll
      for (int w = 0; w < NW; ++w) v += red(w)[0][0][tid];
      a.sgate[tid] = sigmoid_f(from_f_round<bf16_t>(v));
    }
    return;
  }

  // ---- which expert ---------------------------------------------------------
  const bool shared = item == NK;
  int e = 0;
  const int my_e = lane < NK ? a.inds[lane] : -1;
  if (!shared) {
    e = __shfl_sync(0xffffffffu, my_e, item);
    const unsigned dup = __ballot_sync(0xffffffffu, lane < item && my_e == e);
    if (dup) return;  // a lower pair owns this expert (uniform over the CTA)
  }
  GU_STAMP(1);  // expert known
  const unsigned* W0 = shared ? a.xwg : a.wg + (size_t)e * I * GKW;
  const unsigned* W1 = shared ? a.xwu : a.wu + (size_t)e * I * GKW;
  const bf16_t* S0 = shared ? a.xsg : a.sg + (size_t)e * I * GKG;
  const bf16_t* S1 = shared ? a.xsu : a.su + (size_t)e * I * GKG;
  const bf16_t* B0 = shared ? a.xbg : a.bg + (size_t)e * I * GKG;
  const bf16_t* B1 = shared ? a.xbu : a.bu + (size_t)e * I * GKG;
  const int row0 = rb * RB;

  float acc[2][4];
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[m][c] = 0.0f;

  for (int ch = warp; ch < NCH; ch += NW) {
    const int kb = ch * KC;
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
      b_pairs(ldg16(a.x + (size_t)n * D + kb + 8 * lane), bb);
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
        if (u == 0 && m == 0) GU_STAMP(2);  // warp 0's first weights arrived
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

  GU_STAMP(3);  // warp 0's dot products done
  // ---- reduce the warps' partial sums, SwiGLU, store -----------------------
  // c0, c1: row g, tokens 2t, 2t+1; c2, c3: row g + 8.
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int tok = 2 * t + (c & 1);
      if (tok < N) red(warp)[m][g + 8 * (c >> 1)][tok] = acc[m][c];
    }
  __syncthreads();
  GU_STAMP(4);  // every warp done
  if (tid < RB * N) {
    const int r = tid % RB, n = tid / RB;
    float gt = 0.0f, up = 0.0f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      gt += red(w)[0][r][n];
      up += red(w)[1][r][n];
    }
    gt = from_f_round<bf16_t>(gt);
    up = from_f_round<bf16_t>(up);
    const bf16_t hv = from_f<bf16_t>(silu_f(gt) * up);
    if (shared) {
      a.h[(size_t)(NK + n) * I + row0 + r] = hv;
    } else {
      // every pair of token n with this expert (a token listing an expert
      // twice gets both rows: down_combine reads the first)
#pragma unroll
      for (int j = 0; j < TOPK; ++j)
        if (a.inds[n * TOPK + j] == e) a.h[(size_t)(n * TOPK + j) * I + row0 + r] = hv;
    }
  }
  GU_STAMP(5);  // h stored
}
