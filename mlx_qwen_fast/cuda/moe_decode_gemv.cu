// Fused decode MoE (N <= 4 tokens): expert GEMVs with in-register 4-bit
// dequantisation on tensor cores, two launches per layer after the router's
// GEMV (the first routes the tokens itself: MDG_ROUTE).
//
// Weights: MLX affine 4-bit, group 64: W [E, O, K/8] uint32 (eight nibbles per
// word, lowest nibble = lowest input index), bf16 scales/biases [E, O, K/64].
// Dequantised in registers as bf16x2 w = bf16(s * q + b) (one rounding, as
// MLX's CUDA mx.dequantize): nibbles OR-ed into the mantissa of bf16 128.0
// (exact 128 + q), minus 128 (exact), one fma.rn.bf16x2. Never stored.
//
// Tensor-core GEMV: mma.sync m16n8k16 bf16 -> fp32 with A = 16 weight rows x
// 16 inputs, B = 16 inputs x 8 token columns (tokens 0..N-1, the rest zero),
// C = 16 rows x 8 tokens. Lane (g = lane/4, t = lane%4) loads 16 bytes (32
// inputs) of rows g and g+8 per 128-input block u: words covering inputs
// [128u + 32t, +32). The inputs of one mma are permuted so that every lane's
// A registers come from its own words: in k-step (u, wd, half) lane t's
// logical k-columns {2t, 2t+1, 2t+8, 2t+9} are nibbles (j, j+4, j+1, j+5),
// j = 2*half, of word wd, i.e. inputs 128u + 32t + 8wd + {j, j+4, j+1, j+5};
// B (x or h) is read in the same order (8 consecutive bf16, prmt into pairs
// (0,4),(1,5),(2,6),(3,7)). The dot products are unchanged.
//
// MDG_KIND 0: gate + up + SwiGLU (+ shared expert, + shared-expert gate).
//   grid (I/16 CTAs) x (NK + 2), NK = N*k; 256 threads = 8 warps.
//   CTA (rb, item): rows [16 rb, +16) of both the gate and the up matrix of
//   item's expert; item < NK: routed pair item = n*k + j (expert inds[item]);
//   a pair whose expert already appears at a lower pair index returns at once
//   (deduplication: the first pair of an expert computes it for every token
//   and writes the h row of every pair that selected it); item == NK: the
//   shared expert (all tokens); item == NK + 1, rb == 0: shared-expert gate.
//   Warps split K: warp w takes inputs [256c, +256) for c = w, w+8, ...;
//   its weights, scales and biases go to shared memory through cp.async in
//   four commit groups (scales and biases with the first), waited for in
//   the order they are used -- in effect two halves, inputs [0, 128) then
//   [128, 256) of the chunk -- so that the first half is computed while the
//   second is in flight; x is staged in the mma's B-pair order. Dynamic
//   shared memory: 36864 + 4096 N bytes (GU_SMEM).
//   Partial sums meet in shared memory, summed in warp order (deterministic).
//   inputs: x [N, D] bf16, inds [NK] int32/uint32, wg, sg, bg, wu, su, bu
//   (routed [E, I, D/8] / [E, I, D/64]), xwg, xsg, xbg, xwu, xsu, xbu (shared
//   [I, D/8] / [I, D/64]), gw, gs, gb (shared-expert gate, 1 x D: MDG_SGB 4 or
//   8: packed [1, D*bits/32] uint32 + bf16 scales/biases [1, D/64]; 16:
//   bf16 weight [1, D], gs/gb unused).
//   outputs: h [NK + N, I] bf16: row n*k + j = bf16(silu(bf16(x.Wg)) *
//   bf16(x.Wu)) of pair (n, j), row NK + n = the shared expert's for token n;
//   sgate [N] float = sigmoid(bf16(x[n] . w_gate)).
//   MDG_ROUTE 1: the kernel routes the tokens itself. Input logits [N, E]
//   (MDG_LT, E = MDG_E) in place of inds; every routed pair's CTA (item <
//   NK) first routes all N tokens, warp n token n, with route_row of
//   moe_route_common.cuh (the routing kernel's own code: the same experts
//   and weights, bit for bit), the N*k ids kept in shared memory; CTA (0, 0)
//   also writes them: extra outputs inds [N, k] int32 and scores [N, k]
//   float (what the down kernel reads). Scalar: int normalize (divide the k
//   probabilities by their sum). The shared-expert and gate CTAs do not
//   route. Costs every routed CTA the routing (E/32 logits per lane, k
//   rounds of two warp reductions) before its first weight load, and saves
//   the routing kernel's launch.
// MDG_KIND 1: down + routing weights + shared expert + combine.
//   grid D/16 CTAs of 32 MDG_DNW threads (kernels/moe_decode_gemv.py
//   down_warps: N*k + 1 at one token up to 12, so that every item has its own
//   warp; 8 otherwise). CTA rb: output rows [16 rb, +16) of y
//   for all tokens. Items = the pair slots whose expert no lower slot lists,
//   then the shared expert (slot N*k); warp w takes slots w, w + NW, ...
//   (whole K = I each, double-buffered loads; a duplicate slot is skipped);
//   per item and token
//   coef * bf16(h . Wd) is added in fp32 (coef = score of the pair, the sum
//   of both if the token listed the expert twice, 0 if it did not pick it;
//   sgate[n] for the shared expert); the items' sums are added in slot
//   order (deterministic, no atomics, the same bits whatever MDG_DNW).
//   inputs: h [NK + N, I] bf16, inds [NK], scores [NK] float, sgate [N]
//   float, wd, sd, bd (routed [E, D, I/8] / [E, D, I/64]), xwd, xsd, xbd
//   (shared [D, I/8] / [D, I/64]), with MDG_RES res [N, D] bf16 (the
//   decoder layer's residual); output y [N, D] MDG_YT (with MDG_RES: res +
//   the block's output rounded to MDG_YT, rounded again).
//
// Build macros: KNAME, MDG_KIND, MDG_N (1..4), MDG_K (top-k, N*k <= 32),
// MDG_D, MDG_I (D % 256 == 0, I % 128 == 0), MDG_SGB (4, 8, 16; gate+up),
// MDG_ROUTE (gate+up, default 0), with it MDG_E (experts, a multiple of 32,
// 32..512: kernels/moe_decode_gemv.py ROUTE_MAX_EXPERTS) and MDG_LT (logit
// type: float, bf16_t, f16_t),
// MDG_YT (down output type); MDG_DNW (down only, default 8): warps per CTA;
// MDG_RES (down only, default 0): add the residual input.
#include "moe_decode_common.cuh"
#include "moe_route_common.cuh"

#ifndef MDG_YT
#define MDG_YT bf16_t
#endif
#ifndef MDG_RES
#define MDG_RES 0
#endif
#ifndef MDG_ROUTE
#define MDG_ROUTE 0
#endif

constexpr int N = MDG_N;
constexpr int TOPK = MDG_K;
constexpr int NK = N * TOPK;
constexpr int D = MDG_D;
constexpr int I = MDG_I;
#if MDG_KIND == 1 && defined(MDG_DNW)
constexpr int NW = MDG_DNW;  // down: warps per CTA (MDG_DNW = N*k + 1 gives every item its own warp at N = 1)
#else
constexpr int NW = 8;  // warps per CTA
#endif
constexpr int NT = 32 * NW;
constexpr int RB = 16;  // weight rows per CTA (one m16 tile)
static_assert(N >= 1 && N <= 4, "1 <= N <= 4 tokens (B columns 0..3 of the m16n8 tile)");
static_assert(NK <= 32, "N * top_k must fit one warp");
static_assert(D % 256 == 0 && I % 128 == 0, "D % 256 == 0 and I % 128 == 0");
typedef MDG_YT yt;

#if MDG_KIND == 0
// ============================================================================
// gate + up + SwiGLU
// ============================================================================
constexpr int KC = GU_KC;     // inputs per warp chunk
constexpr int NCH = D / KC;   // chunks (warp w: c = w, w + NW, ...)
constexpr int GKW = D / 8;    // packed words per row (x side)
constexpr int GKG = D / 64;   // groups per row
constexpr int GU_OFF_SB = NW * 8 * 32 * 16;
constexpr int GU_OFF_X = GU_OFF_SB + NW * 2 * 2 * RB * 4 * 2;
constexpr int GU_SMEM = GU_OFF_X + NW * N * KC * 2;  // = 36864 + 4096 N (gate_up_smem_bytes in kernels/moe_decode_gemv.py)
#if MDG_ROUTE
#ifndef MDG_LT
#define MDG_LT bf16_t
#endif
typedef MDG_LT lt;
constexpr int E = MDG_E;
// 512: ROUTE_MAX_EXPERTS of kernels/moe_decode_gemv.py (every routed CTA
// repeats the routing, whose cost grows with E, before its first weight load)
static_assert(E % 32 == 0 && E >= 32 && E <= 512, "MDG_E: a multiple of 32 in [32, 512]");
static_assert(TOPK <= E, "top_k <= E");
#endif

extern "C" __global__ void __launch_bounds__(NT, 3) KNAME(
    const bf16_t* __restrict__ x,
#if MDG_ROUTE
    const lt* __restrict__ logits,
#else
    const int* __restrict__ inds,
#endif
    const unsigned* __restrict__ wg, const bf16_t* __restrict__ sg, const bf16_t* __restrict__ bg,
    const unsigned* __restrict__ wu, const bf16_t* __restrict__ su, const bf16_t* __restrict__ bu,
    const unsigned* __restrict__ xwg, const bf16_t* __restrict__ xsg, const bf16_t* __restrict__ xbg,
    const unsigned* __restrict__ xwu, const bf16_t* __restrict__ xsu, const bf16_t* __restrict__ xbu,
    const void* __restrict__ gw, const bf16_t* __restrict__ gs, const bf16_t* __restrict__ gb,
    bf16_t* __restrict__ h,
#if MDG_ROUTE
    float* __restrict__ sgate,
    int* __restrict__ inds_out,
    float* __restrict__ scores_out,
    int normalize) {
#else
    float* __restrict__ sgate) {
#endif
  extern __shared__ __align__(16) unsigned char dsm[];
  // Dynamic shared memory (GU_SMEM bytes; the kernel traps when given less):
  // every global read of the dot products goes through cp.async, so that all
  // of a lane's pieces are in flight at once (as register loads, ptxas sinks
  // three of the eight weight loads -- and then scale loads -- behind the
  // first mma under the 80-register cap: a second DRAM round trip).
  //   wsm [NW][8][32] uint4: a warp's weights of one chunk, [m*4 + hh*2 + u][lane];
  //       after the last chunk the warp's slice holds its partial sums,
  //       gu_red(wsm, w) = [2][RB][N] floats
  //   sbs [NW][2][2][RB][4] bf16: the chunk's scales (0) and biases (1) of
  //       both matrices, 4 groups per row
  //   xs  [NW][N][KC] bf16: x's chunk, each 8 inputs stored as B pairs
  uint4 (*wsm)[8][32] = reinterpret_cast<uint4 (*)[8][32]>(dsm);
  gdn_u16 (*sbs)[2][2][RB][4] = reinterpret_cast<gdn_u16 (*)[2][2][RB][4]>(dsm + GU_OFF_SB);
  gdn_u16 (*xs)[N][KC] = reinterpret_cast<gdn_u16 (*)[N][KC]>(dsm + GU_OFF_X);
  static_assert(2 * RB * N * sizeof(float) <= 8 * 32 * 16, "partial sums fit a warp's weight slice");
  {
    if (dynamic_smem_size() < GU_SMEM) __trap();
  }

  const int item = blockIdx.y, rb = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;

  if (item == NK + 1) {
    // ---- shared-expert gate: sigmoid(bf16(x[n] . w)) ----------------------
    if (rb != 0) return;
    // sgate_dots of moe_decode_common.cuh, statement for statement, kept
    // inline here (for this kernel's machine code, bench/cubin_identity.py)
    float dot[N];
#pragma unroll
    for (int n = 0; n < N; ++n) dot[n] = 0.0f;
    for (int k0 = 8 * tid; k0 < D; k0 += 8 * NT) {
      float w[8];
#if MDG_SGB == 16
      load16(reinterpret_cast<const bf16_t*>(gw) + k0, w);
#else
      const float s = to_f(gs[k0 / 64]), b = to_f(gb[k0 / 64]);
#if MDG_SGB == 8
      const uint2 q = *reinterpret_cast<const uint2*>(reinterpret_cast<const unsigned*>(gw) + k0 / 4);
#pragma unroll
      for (int j = 0; j < 8; ++j) w[j] = s * (float)(((j < 4 ? q.x : q.y) >> (8 * (j & 3))) & 255u) + b;
#else
      const unsigned q = reinterpret_cast<const unsigned*>(gw)[k0 / 8];
#pragma unroll
      for (int j = 0; j < 8; ++j) w[j] = s * (float)((q >> (4 * j)) & 15u) + b;
#endif
#endif
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
    __syncthreads();
    if (tid < N) sgate[tid] = sgate_final<N, NW>(wsm, tid);
    return;
  }

  // ---- which expert ---------------------------------------------------------
  const bool shared = item == NK;
#if MDG_ROUTE
  // the N tokens' routing, warp n token n (ids: shared memory; CTA (0, 0)
  // writes the routing outputs); only the routed pairs' CTAs need it
  __shared__ int rinds[NK];
  if (!shared) {
    if (warp < N) {
      int ri;
      float rs;
      route_row<E, TOPK>(logits + (size_t)warp * E, normalize != 0, ri, rs);
      if (lane < TOPK) {
        rinds[warp * TOPK + lane] = ri;
        if (item == 0 && rb == 0) {
          inds_out[warp * TOPK + lane] = ri;
          scores_out[warp * TOPK + lane] = rs;
        }
      }
    }
    __syncthreads();
  }
  const int* ids = rinds;
#else
  const int* ids = inds;
#endif
  int e = 0;
  const int my_e = !shared && lane < NK ? ids[lane] : -1;
  if (!shared) {
    e = __shfl_sync(0xffffffffu, my_e, item);
    const unsigned dup = __ballot_sync(0xffffffffu, lane < item && my_e == e);
    if (dup) return;  // a lower pair owns this expert (uniform over the CTA)
  }
  const unsigned* W0 = shared ? xwg : wg + (size_t)e * I * GKW;
  const unsigned* W1 = shared ? xwu : wu + (size_t)e * I * GKW;
  const bf16_t* S0 = shared ? xsg : sg + (size_t)e * I * GKG;
  const bf16_t* S1 = shared ? xsu : su + (size_t)e * I * GKG;
  const bf16_t* B0 = shared ? xbg : bg + (size_t)e * I * GKG;
  const bf16_t* B1 = shared ? xbu : bu + (size_t)e * I * GKG;
  const int row0 = rb * RB;

  float acc[2][4];
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[m][c] = 0.0f;

  // gu_dots of moe_decode_common.cuh, statement for statement, kept inline
  // here: as a call nvcc numbers the virtual registers otherwise and this
  // kernel's machine code would change (bench/cubin_identity.py)
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
      b_pairs(ldg16(x + (size_t)n * D + kb + 8 * lane), bb);
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

  // ---- reduce the warps' partial sums, SwiGLU, store -----------------------
  gu_red_store<N>(wsm, warp, acc, g, t);
  __syncthreads();
  if (tid < RB * N) {
    const int r = tid % RB, n = tid / RB;
    const bf16_t hv = gu_swiglu<N, NW>(wsm, r, n);
    if (shared) {
      h[(size_t)(NK + n) * I + row0 + r] = hv;
    } else {
      // every pair of token n with this expert (a token listing an expert
      // twice gets both rows: down_combine reads the first)
#pragma unroll
      for (int j = 0; j < TOPK; ++j)
        if (ids[n * TOPK + j] == e) h[(size_t)(n * TOPK + j) * I + row0 + r] = hv;
    }
  }
}

#else
// ============================================================================
// down + routing weights + shared expert + combine
// ============================================================================
constexpr int NU = I / 128;  // 16-byte words per lane per row
constexpr int KW = I / 8;
constexpr int KG = I / 64;
constexpr int HROWS = NK + N;
static_assert(sizeof(gdn_u16) * HROWS * I + sizeof(float) * (NK + 1) * RB * N <= 46 * 1024,
              "h staging over the 48 KB static shared-memory limit");

typedef DownRegs<NU> ItemRegs;

extern "C" __global__ void __launch_bounds__(NT, 1) KNAME(
    const bf16_t* __restrict__ hin,
    const int* __restrict__ inds,
    const float* __restrict__ scores,
    const float* __restrict__ sgate,
    const unsigned* __restrict__ wd, const bf16_t* __restrict__ sd, const bf16_t* __restrict__ bd,
    const unsigned* __restrict__ xwd, const bf16_t* __restrict__ xsd, const bf16_t* __restrict__ xbd,
#if MDG_RES
    const bf16_t* __restrict__ res,
#endif
    yt* __restrict__ y) {
  __shared__ __align__(16) gdn_u16 hs[HROWS][I];
  __shared__ float ired[NK + 1][RB][N];  // each item's weighted output, by slot

  const int rb = blockIdx.x;
  const int row0 = rb * RB;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;

  // ---- items: the pair slots whose expert no lower slot lists, then the
  // shared expert (slot NK); warp w takes slots w, w + NW, ... A duplicate slot
  // costs its warp nothing: an expert's first slot serves every token that
  // picked it (compute_item gathers their coefficients).
  const int my_e = lane < NK ? inds[lane] : -1;
  const float my_s = lane < NK ? scores[lane] : 0.0f;
  const int nitems = NK + 1;
  constexpr int SKIP = -2;
  // slot -> expert id (-1: shared, SKIP: a lower slot lists the same expert)
  auto item_expert = [&](int it) -> int {
    if (it == NK) return -1;
    const int e = __shfl_sync(0xffffffffu, my_e, it);
    return __ballot_sync(0xffffffffu, lane < it && my_e == e) ? SKIP : e;
  };
  auto load_item = [&](ItemRegs& R, int e) {
    if (e == SKIP) return;
    const unsigned* Wm = e < 0 ? xwd : wd + (size_t)e * D * KW;
    const bf16_t* Sm = e < 0 ? xsd : sd + (size_t)e * D * KG;
    const bf16_t* Bm = e < 0 ? xbd : bd + (size_t)e * D * KG;
    down_load<NU>(R, Wm, Sm, Bm, row0, g, t);
  };

  // an item's coef * bf16(out) goes to ired[slot]; y sums them in slot order
  // (the same bits whatever the warp count)
  auto compute_item = [&](const ItemRegs& R, int e, int slot) {
    if (e == SKIP) return;
    down_compute<N, TOPK, NU>(R, e, my_e, my_s, [&](int n) { return sgate[n]; }, hs, ired[slot], lane, g, t);
  };

  // first item's weights in flight before the h copy and the barrier
  ItemRegs RA, RB_;
  int it = warp;
  int eA = 0, eB = 0;
  if (it < nitems) {
    eA = item_expert(it);
    load_item(RA, eA);
  }
  if (it + NW < nitems) {
    eB = item_expert(it + NW);
    load_item(RB_, eB);
  }
  // h [NK + N, I] -> shared memory
  for (int i = tid; i < HROWS * I / 8; i += NT)
    *reinterpret_cast<uint4*>(&hs[0][0] + 8 * i) = ldg16(hin + 8 * i);
  __syncthreads();

  while (it < nitems) {
    compute_item(RA, eA, it);
    if (it + 2 * NW < nitems) {
      eA = item_expert(it + 2 * NW);
      load_item(RA, eA);
    }
    if (it + NW >= nitems) break;
    compute_item(RB_, eB, it + NW);
    if (it + 3 * NW < nitems) {
      eB = item_expert(it + 3 * NW);
      load_item(RB_, eB);
    }
    it += 2 * NW;
  }

  // ---- sum the items in slot order, store ---------------------------------
  // items: the slots whose expert no lower slot lists, then the shared slot
  const unsigned same = __match_any_sync(0xffffffffu, my_e);
  const unsigned items = __ballot_sync(0xffffffffu, lane < NK && __ffs(same) - 1 == lane);
  __syncthreads();
  if (tid < RB * N) {
    const int r = tid % RB, n = tid / RB;
    float v = down_slot_sum<N, NK>(ired, items, r, n);
#if MDG_RES
    // the decoder layer's residual: h + bf16(block output), rounded once more (stock's add)
    v = to_f(res[(size_t)n * D + row0 + r]) + from_f_round<yt>(v);
#endif
    y[(size_t)n * D + row0 + r] = from_f<yt>(v);
  }
}
#endif
