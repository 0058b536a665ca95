// The whole decode MoE block (N <= 4 tokens) in one launch: router GEMV,
// softmax + top-k, gate + up + SwiGLU of the selected and the shared experts,
// down + routing weights + shared-expert gate + combine.
//
// One persistent grid of G CTAs (G <= the number of SMs, so that every CTA is
// resident at once) runs three phases separated by two grid-wide barriers:
//
//   A  router logits (one warp per expert row, the row's weights loaded while
//      x is staged in shared memory; logit = bf16(fp32 dot), as the router's
//      bf16 quantised matmul); the shared-expert gate's logit (the same dot on
//      row "E"): sgate = sigmoid(bf16(x . w)); the shared expert's gate + up
//      tiles (they do not depend on the routing). CTAs [0, RC) take the router
//      rows, the last I/16 CTAs the shared expert's tiles.
//   -- barrier 1 --
//   B  every CTA reads the N x E logits back (L2) and routes each token with
//      one warp (route_warp: the routing kernel's own code, so the selection
//      is the same as moe_routing.route on these logits); the distinct experts
//      in order of first appearance are the items. Its gate + up tiles (item,
//      16 rows) u = c, c + G, ... and its phase-C down rows of every item are
//      requested at once with bulk copies (TMA, cp.async.bulk) into shared
//      memory rings; the gate + up tiles are computed as they land, the h rows
//      written to global memory.
//   -- barrier 2 --
//   C  CTA c < D/16: output rows [16c, +16) of y: h staged in shared memory,
//      the down GEMVs of every item from the ring, coef * bf16(out) summed in
//      fp32 in a fixed order (deterministic, no atomics), stored as bf16.
//
// Weights stream by TMA into shared-memory slots (one mbarrier each): a gate +
// up slot holds one tile (16 rows of gate and of up, their scales and biases:
// 36 KB at D = 2048), GU_SLOTS slots in flight; a down slot holds one item's 16
// rows (4.5 KB at I = 512), DN_SLOTS slots. The tile arithmetic is that of
// moe_decode_gemv.cu (same dequantisation, mma.sync m16n8k16 with permuted k
// order, same roundings and summation order), so h and y equal the two-kernel
// path's given the same inds and scores.
//
// Grid barrier: a 64-bit arrival counter in `sync` (persistent uint32[64],
// zero at first use: 256 bytes so that MLX's allocator gives device memory,
// not its managed pool for allocations of <= 8 bytes). Every launch adds
// exactly 2 * BARW (CTA 0 arrives with weight 1 + BARW - G), so each CTA reads
// the launch's base (a multiple of 2 * BARW) before its first arrival, arrives
// with red.release.gpu and waits with ld.acquire.gpu for base + b * BARW. A
// CTA that waits ~1 s (a grid that is not resident at once) traps: the launch
// fails instead of hanging. Reads of data written by other CTAs in this launch
// (logits, h, sgate) go through L2 (ld.global.cg / cp.async.cg).
//
// inputs: x [N, D] bf16; rw, rs, rb (router: uint32 [E, D*RBITS/32], bf16
//   [E, D/64] x2); wg, sg, bg, wu, su, bu ([E, I, D/8], [E, I, D/64]); wd, sd,
//   bd ([E, D, I/8], [E, D, I/64]); xwg, xsg, xbg, xwu, xsu, xbu, xwd, xsd, xbd
//   (shared expert, the same without E); gw, gs, gb (shared-expert gate, as in
//   moe_decode_gemv.cu, MDG_SGB 4/8/16); sync uint32 [64] (written).
// outputs: y [N, D] bf16; logits [N, E] float (bf16 values); inds [N, K]
//   int32; scores [N, K] float; h [N*K + N, I] bf16 (scratch); sgate [N] float.
// Launch: G * 256 threads, 256 per CTA, G <= min(SM count, BARW); dynamic
// shared memory smem_bytes() of kernels/moe_decode_fused.py.
//
// Build macros: KNAME, MDG_N (1..4), MDG_K, MDG_E (multiple of 32, <= 1024),
// MDG_D (% 256), MDG_I (% 128), MDG_RBITS (4, 8), MDG_SGB (4, 8, 16),
// MDG_NORM (1: scores renormalised over the K selected), MDG_GU_SLOTS,
// MDG_DN_SLOTS; MDG_TIMING: an extra output [G, 8] uint64 of %globaltimer
// stamps at the phase points (bench builds).
#include "moe_decode_common.cuh"
#include "moe_route_common.cuh"
#include "grid_sync.cuh"

#ifndef MDG_E
#define MDG_E 256
#endif
#ifndef MDG_RBITS
#define MDG_RBITS 8
#endif
#ifndef MDG_NORM
#define MDG_NORM 1
#endif
#ifndef MDG_GU_SLOTS
#define MDG_GU_SLOTS 3
#endif
#ifndef MDG_DN_SLOTS
#define MDG_DN_SLOTS 9
#endif

constexpr int N = MDG_N;
constexpr int TOPK = MDG_K;
constexpr int NK = N * TOPK;
constexpr int E = MDG_E;
constexpr int D = MDG_D;
constexpr int I = MDG_I;
constexpr int NW = 8;
constexpr int NT = 32 * NW;
constexpr int RB = 16;             // rows per tile
constexpr int HROWS = NK + N;
constexpr int KW = D / 8, KG = D / 64;     // gate/up row: packed words, groups
constexpr int DKW = I / 8, DKG = I / 64;   // down row
constexpr int NCH = D / 256;               // gate/up K chunks of 256 inputs
constexpr int NU = I / 128;                // down: 16-byte words per lane per row
constexpr int UT = I / RB;                 // gate/up tiles per expert
constexpr int SU = I / RB;                 // shared-expert gate/up tiles
constexpr int BARW = 1024;                 // counter units per barrier (>= G)
constexpr int GU_SLOTS = MDG_GU_SLOTS;
constexpr int DN_SLOTS = MDG_DN_SLOTS < NK + 1 ? MDG_DN_SLOTS : NK + 1;
// slot layouts (bytes): gate rows | up rows | gate scales | gate biases | up scales | up biases
constexpr int GU_W = RB * KW * 4, GU_S = RB * KG * 2;
constexpr int GU_SLOT = 2 * GU_W + 4 * GU_S;
// down: rows | scales | biases
constexpr int DN_W = RB * DKW * 4, DN_S = RB * DKG * 2;
constexpr int DN_SLOT = DN_W + 2 * DN_S;
static_assert(N >= 1 && N <= 4, "1 <= N <= 4 tokens");
static_assert(NK <= 32, "N * top_k must fit one warp");
static_assert(D % 256 == 0 && I % 128 == 0, "D % 256 == 0 and I % 128 == 0");
static_assert(E % 32 == 0 && E <= 1024, "E must be a multiple of 32, <= 1024");
static_assert(MDG_RBITS == 4 || MDG_RBITS == 8, "router bits 4 or 8");
static_assert(GU_SLOT % 128 == 0 && DN_SLOT % 128 == 0, "slots stay 128-byte aligned");

// ---- shared memory ----------------------------------------------------------------

struct Smem {
  union {
    gdn_u16 x[N][D];          // phases A, B: the tokens
    gdn_u16 h[HROWS][I];      // phase C: every h row
  } u;
  float red[NW][2][RB][N];    // warp partial sums
  float ired[NK + 1][RB][N];  // down: each item's weighted output, summed in item order
  int inds[NK];
  float scores[NK];
  int items[NK + 1];          // distinct routed experts, then -1 (shared)
  int nitems;
};
// dynamic shared memory: [gate+up slots][down slots][mbarriers][Smem]
constexpr int OFF_DN = GU_SLOTS * GU_SLOT;
constexpr int OFF_BAR = OFF_DN + DN_SLOTS * DN_SLOT;
constexpr int OFF_SM = (OFF_BAR + 8 * (GU_SLOTS + DN_SLOTS) + 127) / 128 * 128;
constexpr unsigned SMEM_BYTES = OFF_SM + (unsigned)sizeof(Smem);  // = smem_bytes() of the wrapper

// ---- router / shared-gate row dot ---------------------------------------------------

// One row of a D-input affine group-64 matrix (BITS 4/8) dotted with the N
// tokens by one warp. Lane chunk j: 16 bytes = CIN inputs at 16 * (lane + 32 j)
// bytes of the row.
template <int BITS>
struct RowRegs {
  static constexpr int CIN = 128 / BITS;                 // inputs per 16 bytes
  static constexpr int NC = D / CIN;                     // chunks per row
  static constexpr int NCHK = (NC + 31) / 32;            // chunks per lane (the last may be partial)
  uint4 w[NCHK];
  unsigned sb[NCHK];
  __device__ __forceinline__ void load(const void* Wv, const bf16_t* S, const bf16_t* B, int row) {
    const unsigned* W = reinterpret_cast<const unsigned*>(Wv);
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < NCHK; ++j) {
      const int c = lane + 32 * j;
      if (NC % 32 != 0 && c >= NC) break;
      w[j] = ldg_stream16(W + (size_t)row * (D * BITS / 32) + 4 * c);
      const size_t gi = (size_t)row * KG + (c * CIN) / 64;
      sb[j] = load_sb(S + gi, B + gi);
    }
  }
  // fp32 dot products of the row with every token (every lane gets the sums)
  __device__ __forceinline__ void dot(const Smem& sm, float* out) const {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int n = 0; n < N; ++n) out[n] = 0.0f;
#pragma unroll
    for (int j = 0; j < NCHK; ++j) {
      if (NC % 32 != 0 && lane + 32 * j >= NC) break;
      const int k0 = (lane + 32 * j) * CIN;
      const float s = __uint_as_float(sb[j] << 16), b = __uint_as_float(sb[j] & 0xffff0000u);
      float wv[CIN];
      const unsigned ww[4] = {w[j].x, w[j].y, w[j].z, w[j].w};
#pragma unroll
      for (int i = 0; i < CIN; ++i) {
        const unsigned q = (ww[i / (32 / BITS)] >> (BITS * (i % (32 / BITS)))) & ((1u << BITS) - 1u);
        wv[i] = fmaf(s, (float)q, b);
      }
#pragma unroll
      for (int n = 0; n < N; ++n) {
#pragma unroll
        for (int i = 0; i < CIN; i += 8) {
          float xv[8];
          load16(reinterpret_cast<const bf16_t*>(&sm.u.x[n][k0 + i]), xv);
#pragma unroll
          for (int q = 0; q < 8; ++q) out[n] = fmaf(xv[q], wv[i + q], out[n]);
        }
      }
    }
#pragma unroll
    for (int n = 0; n < N; ++n) out[n] = warp_sum(out[n]);
  }
};

// The shared-expert gate as a bf16 row (MDG_SGB 16).
struct RowRegsBf16 {
  static constexpr int NCHK = D / 8 / 32;
  static_assert(D % 256 == 0, "D % 256");
  uint4 w[NCHK];
  __device__ __forceinline__ void load(const void* W, const bf16_t*, const bf16_t*, int) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < NCHK; ++j) w[j] = ldg16(reinterpret_cast<const bf16_t*>(W) + 8 * (lane + 32 * j));
  }
  __device__ __forceinline__ void dot(const Smem& sm, float* out) const {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int n = 0; n < N; ++n) out[n] = 0.0f;
#pragma unroll
    for (int j = 0; j < NCHK; ++j) {
      float wv[8], xv[8];
      unpack_bf16x2(w[j].x, wv[0], wv[1]);
      unpack_bf16x2(w[j].y, wv[2], wv[3]);
      unpack_bf16x2(w[j].z, wv[4], wv[5]);
      unpack_bf16x2(w[j].w, wv[6], wv[7]);
#pragma unroll
      for (int n = 0; n < N; ++n) {
        load16(reinterpret_cast<const bf16_t*>(&sm.u.x[n][8 * (lane + 32 * j)]), xv);
#pragma unroll
        for (int q = 0; q < 8; ++q) out[n] = fmaf(xv[q], wv[q], out[n]);
      }
    }
#pragma unroll
    for (int n = 0; n < N; ++n) out[n] = warp_sum(out[n]);
  }
};
typedef Pick<MDG_SGB == 16, RowRegsBf16, RowRegs<(MDG_SGB == 16 ? 8 : MDG_SGB)>>::type GateRegs;

// ---- gate + up tile from a slot (16 rows of both matrices, one expert) --------------

struct GUPtr {
  const unsigned *W0, *W1;
  const bf16_t *S0, *S1, *B0, *B1;
};

// Thread 0: one tile (gate and up rows [row0, +16) of p) into slot `dst`.
__device__ __forceinline__ void issue_tile(unsigned dst, unsigned bar, const GUPtr& p, int row0) {
  fence_proxy_async();
  mbar_expect_tx(bar, GU_SLOT);
  bulk_g2s(dst, p.W0 + (size_t)row0 * KW, GU_W, bar);
  bulk_g2s(dst + GU_W, p.W1 + (size_t)row0 * KW, GU_W, bar);
  bulk_g2s(dst + 2 * GU_W, p.S0 + (size_t)row0 * KG, GU_S, bar);
  bulk_g2s(dst + 2 * GU_W + GU_S, p.B0 + (size_t)row0 * KG, GU_S, bar);
  bulk_g2s(dst + 2 * GU_W + 2 * GU_S, p.S1 + (size_t)row0 * KG, GU_S, bar);
  bulk_g2s(dst + 2 * GU_W + 3 * GU_S, p.B1 + (size_t)row0 * KG, GU_S, bar);
}

// The tile's gate and up dot products for every token (weights from the
// slot); the warps' partial sums meet in sm.red and thread (r, n) < RB * N gets
// h = silu(bf16 g) * bf16 u of row r, token n (moe_decode_gemv.cu's order and
// roundings; the caller rounds to bf16).
__device__ __forceinline__ float gate_up_tile(const unsigned char* slot, Smem& sm) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  float acc[2][4];
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[m][c] = 0.0f;
#pragma unroll 1
  for (int ch = warp; ch < NCH; ch += NW) {
    const int kb = ch * 256;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      uint4 A[2][2];
      unsigned s2[2][2], b2[2][2];
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int row = g + 8 * hh;
          A[m][hh] = *reinterpret_cast<const uint4*>(slot + m * GU_W + row * (KW * 4) + (kb >> 1) + 64 * u + 16 * t);
          const int gi = row * KG + (kb >> 6) + 2 * u + (t >> 1);
          const gdn_u16* sc = reinterpret_cast<const gdn_u16*>(slot + 2 * GU_W + 2 * m * GU_S);
          const gdn_u16* bi = reinterpret_cast<const gdn_u16*>(slot + 2 * GU_W + (2 * m + 1) * GU_S);
          const unsigned sb = (unsigned)sc[gi] | ((unsigned)bi[gi] << 16);
          s2[m][hh] = splat_s(sb);
          b2[m][hh] = splat_b(sb);
        }
#pragma unroll
      for (int wd = 0; wd < 4; ++wd) {
        unsigned bb[4] = {0u, 0u, 0u, 0u};
        if (g < N) b_pairs(*reinterpret_cast<const uint4*>(&sm.u.x[g][kb + 128 * u + 32 * t + 8 * wd]), bb);
#pragma unroll
        for (int m = 0; m < 2; ++m)
          mma_word(acc[m], w4(A[m][0], wd), w4(A[m][1], wd), s2[m][0], b2[m][0], s2[m][1], b2[m][1], bb);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int tok = 2 * t + (c & 1);
      if (tok < N) sm.red[warp][m][g + 8 * (c >> 1)][tok] = acc[m][c];
    }
  __syncthreads();
  float hv = 0.0f;
  if (tid < RB * N) {
    const int r = tid % RB, n = tid / RB;
    float gt = 0.0f, up = 0.0f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      gt += sm.red[w][0][r][n];
      up += sm.red[w][1][r][n];
    }
    gt = from_f_round<bf16_t>(gt);
    up = from_f_round<bf16_t>(up);
    hv = silu_f(gt) * up;
  }
  __syncthreads();  // sm.red and the slot are free again
  return hv;
}

// ---- down item from a slot (16 output rows, one item) ------------------------------

__device__ __forceinline__ void issue_down(unsigned dst, unsigned bar, const unsigned* W, const bf16_t* S,
                                           const bf16_t* B, int row0) {
  fence_proxy_async();
  mbar_expect_tx(bar, DN_SLOT);
  bulk_g2s(dst, W + (size_t)row0 * DKW, DN_W, bar);
  bulk_g2s(dst + DN_W, S + (size_t)row0 * DKG, DN_S, bar);
  bulk_g2s(dst + DN_W + DN_S, B + (size_t)row0 * DKG, DN_S, bar);
}

extern "C" __global__ void __launch_bounds__(NT, 1) KNAME(
    const bf16_t* __restrict__ x,
    const unsigned* __restrict__ rw, const bf16_t* __restrict__ rs, const bf16_t* __restrict__ rbias,
    const unsigned* __restrict__ wg, const bf16_t* __restrict__ sg, const bf16_t* __restrict__ bg,
    const unsigned* __restrict__ wu, const bf16_t* __restrict__ su, const bf16_t* __restrict__ bu,
    const unsigned* __restrict__ wd, const bf16_t* __restrict__ sd, const bf16_t* __restrict__ bd,
    const unsigned* __restrict__ xwg, const bf16_t* __restrict__ xsg, const bf16_t* __restrict__ xbg,
    const unsigned* __restrict__ xwu, const bf16_t* __restrict__ xsu, const bf16_t* __restrict__ xbu,
    const unsigned* __restrict__ xwd, const bf16_t* __restrict__ xsd, const bf16_t* __restrict__ xbd,
    const void* __restrict__ gw, const bf16_t* __restrict__ gs, const bf16_t* __restrict__ gb,
    unsigned* sync,
    bf16_t* __restrict__ y,
    float* logits,
    int* __restrict__ inds_out,
    float* __restrict__ scores_out,
    bf16_t* hbuf,
    float* sgate
    TIMING_ARG  // [G, 8] %globaltimer (ns) at the phase points, thread 0
    ) {
  extern __shared__ __align__(128) unsigned char dsm[];
  Smem& sm = *reinterpret_cast<Smem*>(dsm + OFF_SM);
  const unsigned sbase = smem_addr(dsm);
  const unsigned gu_bar = sbase + OFF_BAR, dn_bar = gu_bar + 8 * GU_SLOTS;
  STAMP(0);
  {
    unsigned dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (dyn < SMEM_BYTES) __trap();  // launched with too little dynamic shared memory
  }
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int c = blockIdx.x, G = gridDim.x;
  unsigned long long* ctr = reinterpret_cast<unsigned long long*>(sync);
  // CTAs [0, RC): router rows (E of them, + row E = the shared gate); the last
  // SU CTAs: the shared expert's tiles (everything on every CTA when G is small)
  const int RC = G >= 2 * SU ? G - SU : G;
  const int sfirst = G >= 2 * SU ? G - 1 - c : c;   // this CTA's shared tiles: sfirst, + G, ...
  const int nsh = sfirst < SU ? (SU - 1 - sfirst) / G + 1 : 0;
  auto shared_tile = [&](int j, GUPtr& p) {  // j-th shared tile -> pointers, first row
    p = GUPtr{xwg, xwu, xsg, xsu, xbg, xbu};
    return (sfirst + j * G) * RB;
  };

  unsigned long long base = 0;  // thread 0: the counter at entry (a multiple of 2 * BARW once rounded)
  if (tid == 0) {
#pragma unroll 1
    for (int i = 0; i < GU_SLOTS + DN_SLOTS; ++i) mbar_init(gu_bar + 8 * i, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    base = ld_relaxed_u64(ctr);  // used at the first barrier: its latency hides behind phase A
    // the shared expert's tiles do not depend on the routing: requested now, computed in phase B
#pragma unroll 1
    for (int j = 0; j < nsh && j < GU_SLOTS; ++j) {
      GUPtr p;
      const int row0 = shared_tile(j, p);
      issue_tile(sbase + j * GU_SLOT, gu_bar + 8 * j, p, row0);
    }
  }

  // ======================= phase A ===========================================
  {
    const int r0 = c < RC ? c + RC * warp : E + 1;
    RowRegs<MDG_RBITS> rr;
    GateRegs gr;
    if (r0 < E) rr.load(rw, rs, rbias, r0);
    else if (r0 == E) gr.load(gw, gs, gb, 0);
    for (int i = tid; i < N * D / 8; i += NT)
      *reinterpret_cast<uint4*>(&sm.u.x[0][0] + 8 * i) = ldg16(x + 8 * i);
    __syncthreads();  // x staged; the mbarriers initialised
    STAMP(1);
#pragma unroll 1
    for (int r = r0; r <= E; r += RC * NW) {
      float out[N];
      if (r < E) {
        if (r != r0) rr.load(rw, rs, rbias, r);
        rr.dot(sm, out);
#pragma unroll
        for (int n = 0; n < N; ++n)
          if (lane == n) logits[(size_t)n * E + r] = from_f_round<bf16_t>(out[n]);
      } else {
        if (r != r0) gr.load(gw, gs, gb, 0);
        gr.dot(sm, out);
#pragma unroll
        for (int n = 0; n < N; ++n)
          if (lane == n) sgate[n] = sigmoid_f(from_f_round<bf16_t>(out[n]));
      }
    }
  }
  STAMP(2);
  grid_arrive<BARW>(ctr);
  base -= base % (2ull * BARW);
  grid_wait(ctr, base + BARW);
  STAMP(3);

  // ======================= phase B ===========================================
  if (warp < N) {
    float p[E / 32];
#pragma unroll
    for (int i = 0; i < E / 32; ++i) p[i] = ldcg_f(logits + (size_t)warp * E + i * 32 + lane);
    int my_i;
    float my_p, tot;
    route_warp<E, TOPK>(p, my_i, my_p, tot);
    if (lane < TOPK) {
      const float sc = MDG_NORM ? my_p / tot : my_p;
      sm.inds[warp * TOPK + lane] = my_i;
      sm.scores[warp * TOPK + lane] = sc;
      if (c == 0) {
        inds_out[warp * TOPK + lane] = my_i;
        scores_out[warp * TOPK + lane] = sc;
      }
    }
  }
  __syncthreads();
  if (warp == 0) {
    // distinct experts in order of first appearance, then the shared expert
    const int my_e = lane < NK ? sm.inds[lane] : -1;
    bool first = lane < NK;
    for (int q = 0; q < NK; ++q) {
      const int eq = __shfl_sync(0xffffffffu, my_e, q);
      if (q < lane && eq == my_e) first = false;
    }
    const unsigned fmask = __ballot_sync(0xffffffffu, first);
    if (first) sm.items[__popc(fmask & ((1u << lane) - 1u))] = my_e;
    if (lane == 0) {
      sm.items[__popc(fmask)] = -1;
      sm.nitems = __popc(fmask) + 1;
    }
  }
  __syncthreads();
  STAMP(4);
  const int nitems = sm.nitems, nrouted = nitems - 1;
  const int ntiles = nrouted * UT;
  const int nmine = c < ntiles ? (ntiles - 1 - c) / G + 1 : 0;  // routed tiles c, c + G, ...
  auto routed_tile = [&](int i, GUPtr& p) {  // i-th routed tile of this CTA -> pointers, first row
    const int u = c + i * G;
    const int e = sm.items[u / UT];
    const size_t ow = (size_t)e * I * KW, og = (size_t)e * I * KG;
    p = GUPtr{wg + ow, wu + ow, sg + og, su + og, bg + og, bu + og};
    return (u % UT) * RB;
  };
  auto down_ptrs = [&](int it, const unsigned*& W, const bf16_t*& S, const bf16_t*& B) {
    const int e = sm.items[it];
    if (e < 0) {
      W = xwd; S = xsd; B = xbd;
    } else {
      W = wd + (size_t)e * D * DKW; S = sd + (size_t)e * D * DKG; B = bd + (size_t)e * D * DKG;
    }
  };
  // gate+up jobs of this CTA: j < nsh its shared tiles (already requested), then its routed tiles
  const int njobs = nsh + nmine;
  auto issue_job = [&](int j) {
    GUPtr p;
    const int row0 = j < nsh ? shared_tile(j, p) : routed_tile(j - nsh, p);
    issue_tile(sbase + (j % GU_SLOTS) * GU_SLOT, gu_bar + 8 * (j % GU_SLOTS), p, row0);
  };
  if (tid == 0) {
#pragma unroll 1
    for (int j = min(nsh, GU_SLOTS); j < njobs && j < GU_SLOTS; ++j) issue_job(j);
    if (c < D / RB) {  // this CTA's first down items
#pragma unroll 1
      for (int it = 0; it < nitems && it < DN_SLOTS; ++it) {
        const unsigned* W;
        const bf16_t *S, *B;
        down_ptrs(it, W, S, B);
        issue_down(sbase + OFF_DN + it * DN_SLOT, dn_bar + 8 * it, W, S, B, c * RB);
      }
    }
  }
#pragma unroll 1
  for (int j = 0; j < njobs; ++j) {
    mbar_wait(gu_bar + 8 * (j % GU_SLOTS), (j / GU_SLOTS) & 1);
    const float hv = gate_up_tile(dsm + (j % GU_SLOTS) * GU_SLOT, sm);
    if (tid < RB * N) {
      const int r = tid % RB, n = tid / RB;
      const bf16_t hb = from_f<bf16_t>(hv);
      if (j < nsh) {
        hbuf[(size_t)(NK + n) * I + (sfirst + j * G) * RB + r] = hb;
      } else {
        const int u = c + (j - nsh) * G;
        const int e = sm.items[u / UT], row0 = (u % UT) * RB;
#pragma unroll
        for (int q = 0; q < TOPK; ++q)
          if (sm.inds[n * TOPK + q] == e) hbuf[(size_t)(n * TOPK + q) * I + row0 + r] = hb;
      }
    }
    if (tid == 0 && j + GU_SLOTS < njobs) issue_job(j + GU_SLOTS);
  }
  STAMP(5);
  grid_arrive<BARW>(ctr);
  grid_wait(ctr, base + 2 * BARW);
  STAMP(6);

  // ======================= phase C ===========================================
  if (c >= D / RB) return;
  const int g = lane >> 2, t = lane & 3;
  for (int i = tid; i < HROWS * I / 8; i += NT) cp_async16(&sm.u.h[0][0] + 8 * i, hbuf + 8 * i);  // L2, all in flight
  cp_async_commit();
  float sgv[N];
#pragma unroll
  for (int n = 0; n < N; ++n) sgv[n] = ldcg_f(sgate + n);
  cp_async_wait_all();
  __syncthreads();

#pragma unroll 1
  for (int rbk = c; rbk < D / RB; rbk += G) {
    const int rbi = (rbk - c) / G, row0 = rbk * RB;
    if (rbi > 0 && tid == 0) {  // a further row block (G < D / 16): its first items
#pragma unroll 1
      for (int it = 0; it < nitems && it < DN_SLOTS; ++it) {
        const unsigned* W;
        const bf16_t *S, *B;
        down_ptrs(it, W, S, B);
        issue_down(sbase + OFF_DN + it * DN_SLOT, dn_bar + 8 * it, W, S, B, row0);
      }
    }
#pragma unroll 1
    for (int w0 = 0; w0 < nitems; w0 += DN_SLOTS) {  // rounds of DN_SLOTS items
      const int wend = min(w0 + DN_SLOTS, nitems);
#pragma unroll 1
      // warp w takes the round's items it with it % NW == w; each item's
      // output goes to sm.ired[it], summed in item order at the end, as the
      // down kernel of moe_decode_gemv.cu sums its slots (same bits)
      for (int it = w0 + (warp - w0 % NW + NW) % NW; it < wend; it += NW) {
        const int slot = it % DN_SLOTS;
        // fills of this slot before item it: per row block, items slot, slot + DN_SLOTS, ...
        const int fills = rbi * ((nitems - 1 - slot) / DN_SLOTS + 1) + it / DN_SLOTS;
        mbar_wait(dn_bar + 8 * slot, fills & 1);
        const unsigned char* sl = dsm + OFF_DN + slot * DN_SLOT;
        const int e = sm.items[it];
        int hrow = -1;
        float cf0 = 0.0f, cf1 = 0.0f;
#pragma unroll
        for (int n = 0; n < N; ++n) {
          int p = -1;
          float sc = 0.0f;
          if (e < 0) {
            p = NK + n;
            sc = sgv[n];
          } else {
#pragma unroll
            for (int q = 0; q < TOPK; ++q)
              if (sm.inds[n * TOPK + q] == e) {
                if (p < 0) p = n * TOPK + q;
                sc += sm.scores[n * TOPK + q];
              }
          }
          if (p >= 0) {
            if (g == n) hrow = p;
            if (2 * t == n) cf0 = sc;
            if (2 * t + 1 == n) cf1 = sc;
          }
        }
        const gdn_u16* scl = reinterpret_cast<const gdn_u16*>(sl + DN_W);
        const gdn_u16* bis = reinterpret_cast<const gdn_u16*>(sl + DN_W + DN_S);
        float yacc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        down_item<NU>(
            yacc,
            [&](int u, uint4(&A)[2], unsigned(&s2)[2], unsigned(&b2)[2]) {
#pragma unroll
              for (int hh = 0; hh < 2; ++hh) {
                const int row = g + 8 * hh;
                A[hh] = *reinterpret_cast<const uint4*>(sl + row * (DKW * 4) + 64 * u + 16 * t);
                const int gi = row * DKG + 2 * u + (t >> 1);
                const unsigned sb = (unsigned)scl[gi] | ((unsigned)bis[gi] << 16);
                s2[hh] = splat_s(sb);
                b2[hh] = splat_b(sb);
              }
            },
            hrow >= 0 ? &sm.u.h[hrow][0] : nullptr, t, cf0, cf1);
#pragma unroll
        for (int cc = 0; cc < 4; ++cc) {
          const int tok = 2 * t + (cc & 1);
          if (tok < N) sm.ired[it][g + 8 * (cc >> 1)][tok] = yacc[cc];
        }
      }
      __syncthreads();  // this round's slots are read
      if (tid == 0) {
#pragma unroll 1
        for (int it = w0 + DN_SLOTS; it < nitems && it < w0 + 2 * DN_SLOTS; ++it) {
          const unsigned* W;
          const bf16_t *S, *B;
          down_ptrs(it, W, S, B);
          issue_down(sbase + OFF_DN + (it % DN_SLOTS) * DN_SLOT, dn_bar + 8 * (it % DN_SLOTS), W, S, B, row0);
        }
      }
    }
    // (the last round ended with __syncthreads: every item's output is in)
    if (tid < RB * N) {
      const int r = tid % RB, n = tid / RB;
      float v = 0.0f;
#pragma unroll 1
      for (int it = 0; it < nitems; ++it) v += sm.ired[it][r][n];
      y[(size_t)n * D + row0 + r] = from_f<bf16_t>(v);
    }
    __syncthreads();
  }
  STAMP(7);
}
