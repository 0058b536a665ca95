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
#include "moe_block_body.cuh"

namespace {
constexpr unsigned long long NBAR = 2;  // barriers per launch
// The grid barriers' slots: one table per module (one per build configuration), a slot per
// running launch (grid_sync.cuh).
__device__ GridSlot moe_block_slots[GRID_SLOTS];
struct BlockSlots {
  static __device__ __forceinline__ GridSlot* table() { return moe_block_slots; }
};
}  // namespace

extern "C" __global__ void __launch_bounds__(mbd::NT, 1) KNAME(
    const bf16_t* __restrict__ x,
    MBD_WEIGHT_PARAMS,
    const void* __restrict__ after,  // never read (the launch contract)
    bf16_t* __restrict__ out,
    unsigned* __restrict__ scratch,
    int normalize,
    float eps) {
  extern __shared__ __align__(16) unsigned char dsm[];
  __shared__ __align__(16) gdn_u16 xn[mbd::N][mbd::D];
  __shared__ float red[mbd::NW][32][4];
  __shared__ float ssq[mbd::NW][mbd::N];
  __shared__ int rinds[mbd::NK];
  __shared__ float rscores[mbd::NK];
  if (dynamic_smem_size() < mbd::DSM) __trap();
  GridBarriers<NBAR, mbd::BARW, BlockSlots> bar;  // the launch's slot: claimed by the body
  mbd::block<0, false>(x, MBD_WEIGHT_ARGS,
                         out, scratch, normalize, eps,
                       mbd::Smem{xn, red, ssq, rinds, rscores, dsm}, bar);
}
