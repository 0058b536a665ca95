// The one-launch MoE block's device code (its constants and the `block`
// body, in namespace mbd), shared by moe_block_decode.cu (the block as its
// own launch) and gdn_layer_decode.cu (a GDN layer's mixer, then its MoE
// block, in one launch). What it computes, its phases and its numerics:
// moe_block_decode.cu's header. Build macros: MBD_N, MBD_K, MBD_E, MBD_D,
// MBD_I, MBD_SGB, MBD_RBITS, MBD_RGS, MBD_WT.
#pragma once
#include "grid_sync.cuh"
#include "moe_route_common.cuh"
#include "phase_clock.cuh"
#include "qgemv_tile.cuh"

#ifndef MBD_WT
#define MBD_WT bf16_t
#endif
typedef MBD_WT nwt;

namespace mbd {
constexpr int N = MBD_N;
constexpr int TOPK = MBD_K;
constexpr int NK = N * TOPK;
constexpr int E = MBD_E;
constexpr int D = MBD_D;
constexpr int I = MBD_I;
constexpr int NT = 512;       // threads per block
constexpr int NW = NT / 32;   // warps per block
constexpr int RB = GU_RB;     // rows per tile (16)
constexpr int GUW = 8;        // warps per gate+up team (moe_decode_gemv.cu's CTA)
constexpr int TGU = NW / GUW; // gate+up teams per block
static_assert(N >= 1 && N <= 4, "MBD_N: 1 to 4 rows");
static_assert(NK <= 32, "N * top_k must fit one warp");
static_assert(E % 32 == 0 && E >= 32 && E <= 512, "MBD_E: a multiple of 32 in [32, 512]");
static_assert(TOPK >= 1 && TOPK <= E, "1 <= top_k <= E");
static_assert(D % 256 == 0 && I % 128 == 0, "MBD_D % 256 == 0, MBD_I % 128 == 0");
static_assert(N * D * 2 <= 32768, "the staged rows fit 32 KB of shared memory");

// Router: quantized_gemv.py's warps() per tile (one per 512 inputs at 4 bits,
// 256 at 8; 1..16).
__host__ __device__ constexpr int router_warps(int k, int bits) {
  return (k + (bits == 4 ? 511 : 255)) / (bits == 4 ? 512 : 256) > 16 ? 16
                                                                       : (k + (bits == 4 ? 511 : 255)) / (bits == 4 ? 512 : 256);
}
constexpr int KWR = router_warps(D, MBD_RBITS);
constexpr int TR = NW / KWR;  // router teams per block
constexpr int TILES_R = E / 16;
typedef QgCfg<MBD_RBITS, MBD_RGS, D, N, KWR> CfgR;

// Down phase.
constexpr int NU = I / 128;
constexpr int HROWS = NK + N;
constexpr int TILES_D = D / RB;

// Scratch (bytes): logits from 0, h and sgate each 16-byte aligned
// (moe_block_decode.py's scratch_words).
__host__ __device__ constexpr int round16(int n) {
  return (n + 15) / 16 * 16;
}
constexpr int OFF_LOGITS = 0;
constexpr int OFF_H = OFF_LOGITS + round16(N * E * 2);
constexpr int OFF_SG = OFF_H + round16(HROWS * I * 2);
// MQF_PHASE_CLOCK builds: PC_SLOTS int64 per block after sgate (phase_clock.cuh), marks 0 start, 1 A
// done (the block's router tiles or shared items), 2 barrier 1 passed, 3 routed, 4 B done (the items
// left to B), 5 barrier 2 passed, 6 end.
constexpr int OFF_CLOCK = OFF_SG + round16(N * 4);

// Gate+up items (phases A and B).
constexpr int RBS = I / RB;                    // tiles per expert
constexpr int NSH = RBS + 1;                   // shared items: RBS tiles, then the shared gate
constexpr int RBLK = (TILES_R + TR - 1) / TR;  // blocks that hold a router tile

// Dynamic shared memory: phases A and B's gate+up teams (per team the
// gate+up CTA's layout, 36864 + 4096 N bytes) or phase C's h rows and item
// outputs.
constexpr int GU_OFF_SB = NW * 8 * 32 * 16;
constexpr int GU_OFF_X = GU_OFF_SB + NW * 2 * 2 * RB * 4 * 2;
constexpr int GU_BYTES = GU_OFF_X + NW * N * GU_KC * 2;  // = TGU * (36864 + 4096 N)
constexpr int DN_OFF_IRED = round16(HROWS * I * 2);
constexpr int DN_BYTES = DN_OFF_IRED + (NK + 1) * RB * N * 4;
constexpr int DSM = GU_BYTES > DN_BYTES ? GU_BYTES : DN_BYTES;  // moe_block_decode.py's smem_bytes

constexpr unsigned long long BARW = 1024;  // barrier weight, >= gridDim.x

constexpr int SKIP = -2;  // a down slot whose expert a lower slot lists

// The block's shared arrays (declared in the kernel): xn [N][D] 16-byte aligned, red [NW][32][4],
// ssq [NW][N], rinds and rscores [NK], dsm (DSM bytes of dynamic shared memory, 16-byte aligned).
struct Smem {
  gdn_u16 (*xn)[D];
  float (*red)[32][4];
  float (*ssq)[N];
  int* rinds;
  float* rscores;
  unsigned char* dsm;
};


// A kernel's parameters for the block's weights (after its x), in moe_block_decode.cu's order, and
// the body's arguments from them: one list for every kernel that runs the body.
#define MBD_WEIGHT_PARAMS                                                                                   \
  const nwt *__restrict__ norm_w, const unsigned *__restrict__ wr, const bf16_t *__restrict__ sr,           \
      const bf16_t *__restrict__ br, const unsigned *__restrict__ wg, const bf16_t *__restrict__ sg,         \
      const bf16_t *__restrict__ bg, const unsigned *__restrict__ wu, const bf16_t *__restrict__ su,         \
      const bf16_t *__restrict__ bu, const unsigned *__restrict__ wd, const bf16_t *__restrict__ sd,         \
      const bf16_t *__restrict__ bd, const unsigned *__restrict__ xwg, const bf16_t *__restrict__ xsg,       \
      const bf16_t *__restrict__ xbg, const unsigned *__restrict__ xwu, const bf16_t *__restrict__ xsu,      \
      const bf16_t *__restrict__ xbu, const unsigned *__restrict__ xwd, const bf16_t *__restrict__ xsd,      \
      const bf16_t *__restrict__ xbd, const void *__restrict__ gw, const bf16_t *__restrict__ gs,            \
      const bf16_t *__restrict__ gb
#define MBD_WEIGHT_ARGS \
  norm_w, wr, sr, br, wg, sg, bg, wu, su, bu, wd, sd, bd, xwg, xsg, xbg, xwu, xsu, xbu, xwd, xsd, xbd, gw, gs, gb

// The block's phases (moe_block_decode.cu's header). Its two grid barriers
// are the launch's BAR0 + 1 and BAR0 + 2 on `bar` (grid_sync.cuh's
// GridBarriers). JOIN false: the block is the launch's first body (it claims
// the slot; x is an input of the launch, read through the non-coherent
// path). JOIN true: a body before it wrote x in this launch and made the
// arrival of the launch's barrier BAR0: the block waits for it after issuing
// its router weight loads, and reads x (norm and residual) through L2 only.
template <unsigned BAR0, bool JOIN, class Bar>
__device__ __forceinline__ void block(
    const bf16_t* __restrict__ x,
    const nwt* __restrict__ norm_w,
    const unsigned* __restrict__ wr, const bf16_t* __restrict__ sr, const bf16_t* __restrict__ br,
    const unsigned* __restrict__ wg, const bf16_t* __restrict__ sg, const bf16_t* __restrict__ bg,
    const unsigned* __restrict__ wu, const bf16_t* __restrict__ su, const bf16_t* __restrict__ bu,
    const unsigned* __restrict__ wd, const bf16_t* __restrict__ sd, const bf16_t* __restrict__ bd,
    const unsigned* __restrict__ xwg, const bf16_t* __restrict__ xsg, const bf16_t* __restrict__ xbg,
    const unsigned* __restrict__ xwu, const bf16_t* __restrict__ xsu, const bf16_t* __restrict__ xbu,
    const unsigned* __restrict__ xwd, const bf16_t* __restrict__ xsd, const bf16_t* __restrict__ xbd,
    const void* __restrict__ gw, const bf16_t* __restrict__ gs, const bf16_t* __restrict__ gb,
    bf16_t* __restrict__ out,
    unsigned* __restrict__ scratch,
    int normalize,
    float eps,
    const Smem& sm, Bar& bar) {
  gdn_u16 (*const xn)[D] = sm.xn;
  float (*const red)[32][4] = sm.red;
  float (*const ssq)[N] = sm.ssq;
  int* const rinds = sm.rinds;
  float* const rscores = sm.rscores;
  unsigned char* const dsm = sm.dsm;

  unsigned char* const scr = reinterpret_cast<unsigned char*>(scratch);
  bf16_t* const logits = reinterpret_cast<bf16_t*>(scr + OFF_LOGITS);
  bf16_t* const h = reinterpret_cast<bf16_t*>(scr + OFF_H);
  float* const sgate = reinterpret_cast<float*>(scr + OFF_SG);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  PhaseClock clk;
  clk.mark(0);

  if constexpr (!JOIN) bar.claim();  // first used at the first barrier (joined: the launch's first body's)

  // ---- gate+up items (phases A and B) -----------------------------------------------
  // One round of items: each team of GUW warps its item (act: the team has
  // one; gate: the shared gate; shared: a shared-expert tile; else expert
  // e's tile), rows [row0, row0 + 16). Every thread of the block calls it
  // (its two __syncthreads).
  const int team = warp / GUW, gwarp = warp - team * GUW, ttid = tid - team * GUW * 32;
  uint4 (*wsm)[8][32] = reinterpret_cast<uint4 (*)[8][32]>(dsm) + team * GUW;
  gdn_u16 (*sbs)[2][2][RB][4] = reinterpret_cast<gdn_u16 (*)[2][2][RB][4]>(dsm + GU_OFF_SB) + team * GUW;
  gdn_u16 (*xs)[N][GU_KC] = reinterpret_cast<gdn_u16 (*)[N][GU_KC]>(dsm + GU_OFF_X) + team * GUW;
  auto gu_item = [&](const bool act, const bool gate, const bool shared, const int e, const int row0) {
    if (act && gate) {
      sgate_dots<N, D, GUW * 32, MBD_SGB>(wsm, reinterpret_cast<const bf16_t*>(&xn[0][0]), gw, gs, gb, ttid, lane, gwarp);
    } else if (act) {
      const unsigned* W0 = shared ? xwg : wg + (size_t)e * I * (D / 8);
      const unsigned* W1 = shared ? xwu : wu + (size_t)e * I * (D / 8);
      const bf16_t* S0 = shared ? xsg : sg + (size_t)e * I * (D / 64);
      const bf16_t* S1 = shared ? xsu : su + (size_t)e * I * (D / 64);
      const bf16_t* B0 = shared ? xbg : bg + (size_t)e * I * (D / 64);
      const bf16_t* B1 = shared ? xbu : bu + (size_t)e * I * (D / 64);
      float acc[2][4];
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[m][c] = 0.0f;
      gu_dots<N, GUW, D>(acc, wsm, sbs, xs,
                         [&](int n, int kb, int l) { return *reinterpret_cast<const uint4*>(&xn[n][kb + 8 * l]); },
                         W0, W1, S0, S1, B0, B1, row0, gwarp, lane, g, t);
      gu_red_store<N>(wsm, gwarp, acc, g, t);
    }
    __syncthreads();
    if (act && gate) {
      if (ttid < N) sgate[ttid] = sgate_final<N, GUW>(wsm, ttid);
    } else if (act && ttid < RB * N) {
      const int rr = ttid % RB, n = ttid / RB;
      const bf16_t hv = gu_swiglu<N, GUW>(wsm, rr, n);
      if (shared) {
        h[(size_t)(NK + n) * I + row0 + rr] = hv;
      } else {
        // every pair of token n with this expert (the down items read the first)
#pragma unroll
        for (int jj = 0; jj < TOPK; ++jj)
          if (rinds[n * TOPK + jj] == e) h[(size_t)(n * TOPK + jj) * I + row0 + rr] = hv;
      }
    }
    __syncthreads();
  };
  // Shared items phase A runs (the first a_done; the rest open phase B's list).
  const int a_slots = (int)gridDim.x > RBLK ? ((int)gridDim.x - RBLK) * TGU : 0;
  const int a_done = a_slots < NSH ? a_slots : NSH;

  // ---- A: xn = rms_norm(x); logits = xn @ W_router.T, or shared items -----------------
  if ((int)blockIdx.x < RBLK) {
    const int rteam = warp / KWR, wt = warp - rteam * KWR;
    const int tile = (int)blockIdx.x * TR + rteam;
    QgA<CfgR> A;
    QgSB<CfgR> sb;
    if (rteam < TR && tile < TILES_R)  // weight loads first, as quantized_gemv.cu
      qg_load<CfgR>(A, sb, wr, sr, br, tile * 16, E, wt * CfgR::BPW, lane >> 2, lane & 3);
    if constexpr (JOIN) bar.wait(BAR0);  // x complete (the join barrier's arrival: the caller's)
    qg_stage_norm<N, D, KWR, NT, JOIN>(xn, ssq, x, norm_w, eps);
    qg_tiles<CfgR, KWR, TR, TILES_R, false>(A, sb, xn, wr, sr, br, logits, nullptr, E, red);
  } else {
    // shared item q (none past NSH): the shared expert's tile q, or the shared gate (q == RBS)
    const int q = ((int)blockIdx.x - RBLK) * TGU + team;
    if constexpr (JOIN) bar.wait(BAR0);
    qg_stage_norm<N, D, KWR, NT, JOIN>(xn, ssq, x, norm_w, eps);  // ends with a __syncthreads: xn staged
    gu_item(q < NSH, q == RBS, true, -1, (q % RBS) * RB);
  }
  clk.mark(1);

  bar.arrive(BAR0 + 1);
  bar.wait(BAR0 + 1);
  clk.mark(2);

  // ---- B: routing (every block), the shared items left, the routed items --------------
  if (warp < N) {
    int ri;
    float rs;
    const bf16_t* row = logits + (size_t)warp * E;
    route_row_ld<E, TOPK>([&](int i) { return __uint_as_float(ldcg_u16(row + i) << 16); }, normalize != 0, ri, rs);
    if (lane < TOPK) {
      rinds[warp * TOPK + lane] = ri;
      rscores[warp * TOPK + lane] = rs;
    }
  }
  __syncthreads();
  clk.mark(3);
  const int my_e = lane < NK ? rinds[lane] : -1;
  const float my_s = lane < NK ? rscores[lane] : 0.0f;
  // the slots whose expert no lower slot lists (moe_decode_gemv.cu's items)
  const unsigned same = __match_any_sync(0xffffffffu, my_e);
  const unsigned items = __ballot_sync(0xffffffffu, lane < NK && __ffs(same) - 1 == lane);
  {
    const int left = NSH - a_done;  // shared items a_done.. first
    const int n_items = left + RBS * __popc(items);
    const int stride = (int)gridDim.x * TGU;
    const int rounds = (n_items + stride - 1) / stride;
    for (int r = 0; r < rounds; ++r) {
      const int j = (int)blockIdx.x * TGU + team + r * stride;
      const bool act = j < n_items, shared = j < left;
      const int q = shared ? a_done + j : j - left;  // shared item q, or routed item q
      int e = -1;
      if (act && !shared) {
        unsigned m = items;
        for (int s = q / RBS; s > 0; --s) m &= m - 1u;
        e = rinds[__ffs(m) - 1];
      }
      gu_item(act, shared && q == RBS, shared, e, (q % RBS) * RB);
    }
  }

  // ---- C: down + routing weights + shared expert + combine + residual -----------------
  // slot -> expert id (-1: shared, SKIP: a lower slot lists the same expert)
  auto item_expert = [&](int it) -> int {
    if (it == NK) return -1;
    const int e = __shfl_sync(0xffffffffu, my_e, it);
    return __ballot_sync(0xffffffffu, lane < it && my_e == e) ? SKIP : e;
  };
  auto load_item = [&](DownRegs<NU>& R, int e, int row0) {
    if (e == SKIP) return;
    const unsigned* Wm = e < 0 ? xwd : wd + (size_t)e * D * (I / 8);
    const bf16_t* Sm = e < 0 ? xsd : sd + (size_t)e * D * (I / 64);
    const bf16_t* Bm = e < 0 ? xbd : bd + (size_t)e * D * (I / 64);
    down_load<NU>(R, Wm, Sm, Bm, row0, g, t);
  };
  clk.mark(4);
  // the first tile's first item: loaded while the grid meets (after this block's arrival, whose
  // release would otherwise wait for thread 0's loads in flight)
  DownRegs<NU> R;
  int e0 = SKIP;
  bar.arrive(BAR0 + 2);
  if ((int)blockIdx.x < TILES_D && warp < NK + 1) {
    e0 = item_expert(warp);
    load_item(R, e0, (int)blockIdx.x * RB);
  }
  bar.wait(BAR0 + 2);
  clk.mark(5);

  gdn_u16 (*hs)[I] = reinterpret_cast<gdn_u16 (*)[I]>(dsm);
  float (*ired)[RB][N] = reinterpret_cast<float (*)[RB][N]>(dsm + DN_OFF_IRED);
  for (int i = tid; i < HROWS * I / 8; i += NT)
    *reinterpret_cast<uint4*>(&hs[0][0] + 8 * i) = ldcg16(h + 8 * i);
  __syncthreads();
  bool first = true;
  for (int rb = blockIdx.x; rb < TILES_D; rb += gridDim.x) {
    const int row0 = rb * RB;
    for (int slot = warp; slot < NK + 1; slot += NW) {
      int e = e0;
      if (!first) {
        e = item_expert(slot);
        load_item(R, e, row0);
      }
      first = false;
      if (e != SKIP)
        down_compute<N, TOPK, NU>(R, e, my_e, my_s, [&](int n) { return ldcg_f(sgate + n); }, hs, ired[slot], lane,
                                  g, t);
    }
    first = false;
    __syncthreads();
    if (tid < RB * N) {
      const int rr = tid % RB, n = tid / RB;
      float v = down_slot_sum<N, NK>(ired, items, rr, n);
      // the decoder layer's residual: x + bf16(block output), rounded once more (stock's add)
      const size_t xi = (size_t)n * D + row0 + rr;
      v = (JOIN ? __uint_as_float(ldcg_u16(x + xi) << 16) : to_f(x[xi])) + from_f_round<bf16_t>(v);
      out[(size_t)n * D + row0 + rr] = from_f<bf16_t>(v);
    }
    __syncthreads();
  }
  clk.mark(6);
  clk.store(reinterpret_cast<long long*>(scr + OFF_CLOCK), 7);
}
}  // namespace mbd

