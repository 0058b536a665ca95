// A Qwen3-Next / Qwen3.5 MoE block's decode step (1 to 4 token rows) with the
// decoder layer's RMSNorm before it and the residual after it, in one launch:
//
//   xn     = rms_norm(x, norm_w, eps)
//   logits = xn @ dequant(W_router).T                         [N, E]
//   ids, weights = softmax + top-k (+ renormalised) of logits
//   h      = SwiGLU(xn) of every selected expert and of the shared expert
//   out    = x + bf16(sum_j weight_j * bf16(h_j @ Wd_j.T)
//                    + sigmoid(bf16(xn . w_gate)) * bf16(h_s @ Wd_s.T))
//
// the work of quantized_gemv.cu (the router, QG_NORM + QG_XN) and
// moe_decode_gemv.cu's two builds (gate+up that routes, MDG_ROUTE; down with
// the residual, MDG_RES), each phase with those kernels' device code and
// arithmetic order (qgemv_tile.cuh, moe_route_common.cuh,
// moe_decode_common.cuh), so that the results are those of the three
// launches bit for bit (the CUDA check shows it on the CPU; on the GPU the
// same instructions run in the same order, which holds unless the
// compilations contract or order an fp32 operation differently).
//
// A persistent grid of G <= SM-count blocks of 512 threads (16 warps), all
// resident at once, exchanging data through global scratch and two grid
// barriers (grid_sync.cuh). The gate+up work items (moe_decode_gemv.cu's
// gate+up CTA each, x read from the staged xn, run by a team of 8 warps, two
// teams per block) are the shared expert's I / 16 row tiles and the
// shared-expert gate (the NSH = I / 16 + 1 shared items, independent of the
// routing) and, per distinct selected expert, its I / 16 tiles (the routed
// items).
//   A  every block stages xn = rms_norm(x) in shared memory (sums of squares
//      in quantized_gemv.cu's order for its 32 * KWR threads). The first
//      RBLK = ceil(E / 16 / TR) blocks compute the router's 16-row logit
//      tiles with teams of KWR warps, as quantized_gemv.cu's blocks (tiles
//      over those blocks' teams, in rounds where G < RBLK); logits ->
//      scratch (bf16). Each later block runs shared items instead: item
//      (blockIdx.x - RBLK) * 2 + team, one round, so min(NSH, 2 (G - RBLK))
//      of them (all of them at Qwen3.6-35B-A3B's shapes: 8 router blocks,
//      33 shared items). A block runs router tiles or shared items, never
//      both (the router uses the static `red`, the items dynamic shared
//      memory). Shared h rows, sgate -> scratch.
//   --- barrier 1 ---
//   B  every block routes the N tokens itself (warp n token n, route_row_ld
//      on the logits read through L2: the routing kernel's code), keeping the
//      ids and weights in shared memory; the items left -- the shared items
//      phase A had no slot for, then the routed items of each distinct
//      selected expert (the slots whose expert no lower slot lists: one tile
//      serves every token that picked it) -- go to the two teams per block
//      (item blockIdx.x * 2 + team + r * 2G in round r). h rows (sgate) ->
//      scratch. The block's first down item's weights are loaded while the
//      grid meets (after the block's arrival).
//   --- barrier 2 ---
//   C  h [N*k + N, I] staged from scratch (L2) in shared memory; down tiles
//      rb = blockIdx.x + r * G of D / 16: warp w takes the item slots w, w +
//      16, ... (a slot whose expert a lower slot lists is skipped) as
//      moe_decode_gemv.cu's down CTA; the items' weighted outputs added in
//      slot order, bf16-rounded, the residual x added, out stored.
// Rounds of phase B at those shapes (G = 128 or 132, 256 or 264 team slots):
// 32 N k routed items with N k distinct experts, so 1, 2, 3, 4 rounds at N =
// 1..4 (each item's weights read once: a round is about one 32 KB weight
// read per team).
//
// Numerics: bf16 activations only (as the kernels it fuses): the norm's two
// roundings, the logits' (bf16), fp32 routing (softmax, top-k, weights), the
// gate and up outputs, SwiGLU, each expert's down output rounded to bf16,
// fp32 weighted sum, its bf16 rounding, the residual add's.
//
// Inputs: x [N, D] bf16; norm_w [D] (MBD_WT); router w uint32 [E, D * RBITS
// / 32], scales, biases bf16 [E, D / RGS]; routed experts gate, up (w uint32
// [E, I, D / 8], s, b bf16 [E, I, D / 64]), down ([E, D, I / 8], [E, D, I /
// 64]); shared expert gate, up ([I, D / 8], [I, D / 64]), down ([D, I / 8],
// [D, I / 64]); shared-expert gate gw, gs, gb (MBD_SGB 4, 8: uint32 [1, D *
// bits / 32] + bf16 [1, D / 64]; 16: bf16 weight [1, D], gs / gb unused);
// after: any array, never read (see the launch contract).
// Outputs: out [N, D] bf16; scratch uint32: logits [N, E] bf16 (from byte
// 0), h [N*k + N, I] bf16, sgate [N] fp32 (each 16-byte aligned:
// moe_block_decode.py's scratch_words); no output needs a start value.
// Scalars: int normalize (divide the k probabilities by their sum), float
// eps. Dynamic shared memory: DSM bytes (the kernel traps when given less).
//
// Launch contract: G blocks of 512 threads, G <= the number of SMs and G <=
// BARW, every block resident at once (one block per SM: 512 threads x up to
// 128 registers and ~100 KB of shared memory). MLX orders two launches only
// when one reads what the other writes (its CUDA graphs have edges from a
// buffer's writer to its readers), so launches of graphs that do not depend
// on each other (teacher-forced tokens evaluated together) may run at once:
// each launch takes a barrier slot of its own from the module's table
// (grid_sync.cuh: claimed by its grid id, freed after the last barrier), and
// the decode step also passes the previous call's output as `after` to its
// first such launch (ops/_launch_order.py), so that its calls run in order.
// A grid that is not resident traps after ~2^23 polls rather than hang. The
// slots are __device__ variables of the kernel's module (zero when the
// module loads, counters never reset: grid_sync.cuh's contract), so no
// output needs a start value; a counter value that cannot be a launch's
// start traps.
//
// Build macros: KNAME, MBD_N (1..4), MBD_K (top-k, N*k <= 32), MBD_E
// (experts, a multiple of 32 in [32, 512]), MBD_D (a multiple of 256, N * D
// * 2 <= 32768), MBD_I (a multiple of 128), MBD_SGB (4, 8, 16), MBD_RBITS (4,
// 8), MBD_RGS (32, 64, 128), MBD_WT (the norm weight's type, default
// bf16_t).
//
// Prediction for the GPU (Qwen3.6-35B-A3B: D = 2048, E = 256, k = 8, I =
// 512, one token; not measured): bench/results/moe-cuda-log.md.
#include "grid_sync.cuh"
#include "moe_route_common.cuh"
#include "next_prefetch.cuh"
#include "phase_clock.cuh"
#include "qgemv_tile.cuh"

#ifndef MBD_WT
#define MBD_WT bf16_t
#endif
typedef MBD_WT nwt;

namespace {
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
constexpr unsigned long long NBAR = 2;     // barriers per launch
// The grid barriers' slots: one table per module (one per build configuration), a slot per
// running launch (grid_sync.cuh).
__device__ GridSlot moe_block_slots[GRID_SLOTS];

constexpr int SKIP = -2;  // a down slot whose expert a lower slot lists
}  // namespace

extern "C" __global__ void __launch_bounds__(NT, 1) KNAME(
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
    const void* __restrict__ after  // never read (the launch contract)
    PF_PARAMS,                      // the next launch's weights, prefetched into L2 (next_prefetch.cuh)
    bf16_t* __restrict__ out,
    unsigned* __restrict__ scratch,
    int normalize,
    float eps) {
  extern __shared__ __align__(16) unsigned char dsm[];
  __shared__ __align__(16) gdn_u16 xn[N][D];
  __shared__ float red[NW][32][4];
  __shared__ float ssq[NW][N];
  __shared__ int rinds[NK];
  __shared__ float rscores[NK];
  if (dynamic_smem_size() < DSM) __trap();

  unsigned char* const scr = reinterpret_cast<unsigned char*>(scratch);
  bf16_t* const logits = reinterpret_cast<bf16_t*>(scr + OFF_LOGITS);
  bf16_t* const h = reinterpret_cast<bf16_t*>(scr + OFF_H);
  float* const sgate = reinterpret_cast<float*>(scr + OFF_SG);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  PhaseClock clk;
  clk.mark(0);

  // The launch's slot and its counter before this block's first arrival (grid_sync.cuh; thread 0
  // only); claimed and loaded here, first used at the first barrier.
  unsigned long long v0 = 0;
  if (tid == 0) {
    GridSlot* s = grid_claim(moe_block_slots, grid_tag());
    v0 = ld_relaxed_u64(&s->ctr);
  }
  // The slot's counter at each use (thread 0's), from the grid id: not a pointer held in
  // registers across the phases (the phases hold weight tiles in registers).
  const auto ctr = [] { return &grid_slot(moe_block_slots)->ctr; };

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
    qg_stage_norm<N, D, KWR, NT>(xn, ssq, x, norm_w, eps);
    qg_tiles<CfgR, KWR, TR, TILES_R, false>(A, sb, xn, wr, sr, br, logits, nullptr, E, red);
  } else {
    // shared item q (none past NSH): the shared expert's tile q, or the shared gate (q == RBS)
    const int q = ((int)blockIdx.x - RBLK) * TGU + team;
    if (q < RBS) {  // the tile's gate and up rows into L2 while xn is staged (gu_dots copies them after)
      const size_t w0 = (size_t)q * RB * (D / 8), s0 = (size_t)q * RB * (D / 64);
      prefetch_l2_range(xwg + w0, RB * D / 2, ttid, GUW * 32);
      prefetch_l2_range(xwu + w0, RB * D / 2, ttid, GUW * 32);
      prefetch_l2_range(xsg + s0, RB * (D / 64) * 2, ttid, GUW * 32);
      prefetch_l2_range(xsu + s0, RB * (D / 64) * 2, ttid, GUW * 32);
      prefetch_l2_range(xbg + s0, RB * (D / 64) * 2, ttid, GUW * 32);
      prefetch_l2_range(xbu + s0, RB * (D / 64) * 2, ttid, GUW * 32);
    }
    qg_stage_norm<N, D, KWR, NT>(xn, ssq, x, norm_w, eps);  // ends with a __syncthreads: xn staged
    gu_item(q < NSH, q == RBS, true, -1, (q % RBS) * RB);
  }
  clk.mark(1);

  // The launch's base: the counter rounded down to a multiple of NBAR * BARW.
  unsigned long long base = 0;
  if (tid == 0) base = grid_launch_base<NBAR, BARW>(v0);
  grid_arrive<BARW>(ctr());
  grid_wait(ctr(), base + BARW);
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
  grid_arrive<BARW>(ctr());
  if ((int)blockIdx.x < TILES_D && warp < NK + 1) {
    e0 = item_expert(warp);
    load_item(R, e0, (int)blockIdx.x * RB);
  }
  next_prefetch(PF_ARGS);
  grid_wait(ctr(), base + 2 * BARW);
  grid_free(grid_slot(moe_block_slots));
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
      v = to_f(x[(size_t)n * D + row0 + rr]) + from_f_round<bf16_t>(v);
      out[(size_t)n * D + row0 + rr] = from_f<bf16_t>(v);
    }
    __syncthreads();
  }
  clk.mark(6);
  clk.store(reinterpret_cast<long long*>(scr + OFF_CLOCK), 7);
}
