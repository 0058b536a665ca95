// Fused decode MoE (N <= 4 tokens): expert GEMVs with in-register 4-bit
// dequantisation on tensor cores, two launches per layer.
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
//   shared memory: 36864 + 4096 N bytes (moe_decode_gate_up.cuh).
//   Partial sums meet in shared memory, summed in warp order (deterministic).
//   inputs: x [N, D] bf16, inds [NK] int32/uint32, wg, sg, bg, wu, su, bu
//   (routed [E, I, D/8] / [E, I, D/64]), xwg, xsg, xbg, xwu, xsu, xbu (shared
//   [I, D/8] / [I, D/64]), gw, gs, gb (shared-expert gate, 1 x D: MDG_SGB 4 or
//   8: packed [1, D*bits/32] uint32 + bf16 scales/biases [1, D/64]; 16:
//   bf16 weight [1, D], gs/gb unused).
//   outputs: h [NK + N, I] bf16: row n*k + j = bf16(silu(bf16(x.Wg)) *
//   bf16(x.Wu)) of pair (n, j), row NK + n = the shared expert's for token n;
//   sgate [N] float = sigmoid(bf16(x[n] . w_gate)).
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
//   order (deterministic, no atomics; the one-launch kernel moe_decode_fused.cu
//   adds its distinct items in the same order: equal bits).
//   inputs: h [NK + N, I] bf16, inds [NK], scores [NK] float, sgate [N]
//   float, wd, sd, bd (routed [E, D, I/8] / [E, D, I/64]), xwd, xsd, xbd
//   (shared [D, I/8] / [D, I/64]); output y [N, D] MDG_YT.
//
// Build macros: KNAME, MDG_KIND, MDG_N (1..4), MDG_K (top-k, N*k <= 32),
// MDG_D, MDG_I (D % 256 == 0, I % 128 == 0), MDG_SGB (4, 8, 16), MDG_YT; MDG_DNW
// (down only, default 8): warps per CTA; MDG_TIMING: phase stamps (benchmarks).
#include "moe_decode_common.cuh"

#ifndef MDG_YT
#define MDG_YT bf16_t
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
// gate + up + SwiGLU (the tile is moe_decode_gate_up.cuh's)
// ============================================================================
#include "moe_decode_gate_up.cuh"

extern "C" __global__ void __launch_bounds__(NT, 3) KNAME(
    const bf16_t* __restrict__ x,
    const int* __restrict__ inds,
    const unsigned* __restrict__ wg, const bf16_t* __restrict__ sg, const bf16_t* __restrict__ bg,
    const unsigned* __restrict__ wu, const bf16_t* __restrict__ su, const bf16_t* __restrict__ bu,
    const unsigned* __restrict__ xwg, const bf16_t* __restrict__ xsg, const bf16_t* __restrict__ xbg,
    const unsigned* __restrict__ xwu, const bf16_t* __restrict__ xsu, const bf16_t* __restrict__ xbu,
    const void* __restrict__ gw, const bf16_t* __restrict__ gs, const bf16_t* __restrict__ gb,
    bf16_t* __restrict__ h,
    float* __restrict__ sgate TIMING_ARG) {
  extern __shared__ __align__(16) unsigned char dsm[];
  const GateUpArgs a{x, inds, wg, wu, xwg, xwu, sg, bg, su, bu, xsg, xbg, xsu, xbu, gw, gs, gb, h, sgate
#ifdef MDG_TIMING
                     , tim
#endif
  };
  gate_up_cta(a, blockIdx.y, blockIdx.x, dsm);
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

struct ItemRegs {
  uint4 A[2][NU];         // rows g, g + 8
  unsigned sb[2][NU];     // (scale, bias) of the lane's group
};

extern "C" __global__ void __launch_bounds__(NT, 1) KNAME(
    const bf16_t* __restrict__ hin,
    const int* __restrict__ inds,
    const float* __restrict__ scores,
    const float* __restrict__ sgate,
    const unsigned* __restrict__ wd, const bf16_t* __restrict__ sd, const bf16_t* __restrict__ bd,
    const unsigned* __restrict__ xwd, const bf16_t* __restrict__ xsd, const bf16_t* __restrict__ xbd,
    yt* __restrict__ y TIMING_ARG) {
  __shared__ __align__(16) gdn_u16 hs[HROWS][I];
  __shared__ float ired[NK + 1][RB][N];  // each item's weighted output, by slot

  const int rb = blockIdx.x;
  const int row0 = rb * RB;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  STAMP(0);  // start

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
  };

  // an item's coef * bf16(out) goes to ired[slot]; y sums them in slot order
  // (the one-launch kernel sums its items in the same order: the same bits,
  // whatever the warp count)
  auto compute_item = [&](const ItemRegs& R, int e, int slot) {
    if (e == SKIP) return;
    int hrow;
    float cf0, cf1;
    item_coefs<N, TOPK>(e, my_e, my_s, [&](int n) { return sgate[n]; }, lane, g, t, hrow, cf0, cf1);
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
      if (tok < N) ired[slot][g + 8 * (c >> 1)][tok] = yacc[c];
    }
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
  STAMP(1);  // warp 0's weights requested
  // h [NK + N, I] -> shared memory
  for (int i = tid; i < HROWS * I / 8; i += NT)
    *reinterpret_cast<uint4*>(&hs[0][0] + 8 * i) = ldg16(hin + 8 * i);
  __syncthreads();
  STAMP(2);  // h staged
  bool first_item = true;

  while (it < nitems) {
    compute_item(RA, eA, it);
    if (first_item) {
      STAMP(3);  // warp 0's first item arrived and computed
      first_item = false;
    }
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
  STAMP(4);  // warp 0's items done
  __syncthreads();
  STAMP(5);  // every warp done
  if (tid < RB * N) {
    const int r = tid % RB, n = tid / RB;
    float v = 0.0f;
#pragma unroll 1
    for (int sl = 0; sl < NK; ++sl)
      if ((items >> sl) & 1u) v += ired[sl][r][n];
    v += ired[NK][r][n];
    y[(size_t)n * D + row0 + r] = from_f<yt>(v);
  }
  STAMP(6);  // y stored
}
#endif
