// A Gated DeltaNet decoder layer's whole decode step (1 to 4 token rows,
// bf16) in one launch: the one-launch mixer, then the one-launch MoE block,
//
//   h   = x + mixer(rms_norm(x, w_in_norm))       (gdn_mixer_decode.cu)
//   out = h + block(rms_norm(h, w_post_norm))     (moe_block_decode.cu)
//
// with the two kernels' device code (gdn_mixer_body.cuh, moe_block_body.cuh)
// and arithmetic order, so that out, the conv state and the recurrent state
// are those of the two launches bit for bit (the CUDA check shows it on the
// CPU; on the GPU the same instructions run in the same order, which holds
// unless the compilations contract or order an fp32 operation differently).
//
// A persistent grid of G <= SM-count blocks of 512 threads (one per SM),
// all resident at once, on five grid barriers of one slot (grid_sync.cuh's
// GridBarriers): the mixer's two (1, 2); the join (3: h complete, written
// by the mixer's out_proj tiles into scratch); the block's two (4, 5). After
// its arrival at the join each router block issues its router tile's
// register loads before waiting; the block then reads h through L2 only
// (ld.global.cg: other blocks wrote it in this launch).
//
// Inputs: the mixer's (x [M, K] bf16, w_in, s_in, b_in, params, conv_state,
// state, w_out, s_out, b_out: gdn_mixer_decode.cu's), then the MoE block's
// after its x (norm_w: the post-attention RMSNorm weight; the router, the
// routed and shared experts, the shared-expert gate: moe_block_decode.cu's),
// after (any array, never read). Outputs: out [M, K]
// bf16, conv_state_out, state_out, scratch uint32 [scratch_words]: the
// mixer's scratch (proj, y), h [M, K] bf16, the block's scratch (logits,
// SwiGLU rows, shared gate), each 16-byte aligned (gdn_layer_decode.py's
// scratch_words). Scalars: float eps_in, eps_qk, eps_norm (the mixer's),
// int normalize, float eps_post (the block's). Dynamic shared memory: the
// block's DSM bytes (the kernel traps when given less).
//
// Launch contract: the two kernels' (G blocks of 512 threads, G <= the SMs
// and <= BARW, every block resident at once; a barrier slot per running
// launch from the module's table, so launches that nothing orders may run at
// once; `after` orders a launch after its writer).
//
// Build macros: KNAME, the mixer's (GDN_X = bf16_t, GDN_HV, GDN_HK, GM_K,
// GM_M) and the block's (MBD_N = GM_M, MBD_K, MBD_E, MBD_D = GM_K, MBD_I,
// MBD_SGB, MBD_RBITS, MBD_RGS, MBD_WT).
//
// Design and prediction for the GPU: bench/results/gdn-cuda-log.md, "A Gated
// DeltaNet decoder layer as one launch".
#include "gdn_mixer_body.cuh"
#include "moe_block_body.cuh"

namespace {
static_assert(BF, "the one-launch layer is bf16 only (as the MoE block)");
static_assert(M == mbd::N && HID == mbd::D, "GM_M == MBD_N and GM_K == MBD_D");
static_assert(!MQF_PHASE_CLOCK, "no phase-clock build of the one-launch layer");
static_assert(mbd::N * mbd::D * 2 <= STAGE, "the block's staged rows fit the mixer's staging array");

constexpr unsigned long long NBAR_L = 5;  // barriers per launch: the mixer's 2, the join, the block's 2
constexpr unsigned JOIN = 3;
__device__ GridSlot layer_slots[GRID_SLOTS];
struct LayerSlots {
  static __device__ __forceinline__ GridSlot* table() { return layer_slots; }
};

// Scratch (bytes): the mixer's (proj, y), h, the block's.
constexpr int OFF_HL = OFF_Y + round16(M * KO * 2);
constexpr int OFF_BLOCK = OFF_HL + round16(M * HID * 2);
}  // namespace

extern "C" __global__ void __launch_bounds__(NT, 1) KNAME(
    const xt* __restrict__ x,
    const unsigned* __restrict__ w_in,
    const xt* __restrict__ s_in,
    const xt* __restrict__ b_in,
    const float* __restrict__ params,
    const xt* __restrict__ conv_state,
    const float* __restrict__ state_in,
    const unsigned* __restrict__ w_out,
    const xt* __restrict__ s_out,
    const xt* __restrict__ b_out,
    MBD_WEIGHT_PARAMS,
    const void* __restrict__ after,  // never read (the launch contract)
    xt* __restrict__ out,
    xt* __restrict__ conv_state_out,
    float* __restrict__ state_out,
    unsigned* __restrict__ scratch,
    float eps_in,
    float eps_qk,
    float eps_norm,
    int normalize,
    float eps_post) {
  extern __shared__ __align__(16) unsigned char dsm[];
  __shared__ __align__(16) unsigned char stage[STAGE];  // the mixer's staging, then the block's xn
  __shared__ float red[NW][32][4];
  __shared__ float ssq[NW][M];
  __shared__ __align__(16) float qsh[D];
  __shared__ __align__(16) float ksh[D];
  __shared__ float vsh[D];
  __shared__ float ysh[D];
  __shared__ float gred[4][3];
  __shared__ float gate[2];
  __shared__ int rinds[mbd::NK];
  __shared__ float rscores[mbd::NK];
  if (dynamic_smem_size() < mbd::DSM) __trap();
  unsigned char* const scr = reinterpret_cast<unsigned char*>(scratch);
  bf16_t* const h = reinterpret_cast<bf16_t*>(scr + OFF_HL);
  GridBarriers<NBAR_L, BARW, LayerSlots> bar;  // the launch's slot: claimed by the mixer's body

  // the mixer: h = x + mixer(norm(x))
  const Smem sm{stage, red, ssq, qsh, ksh, vsh, ysh, gred, gate};
  mixer<xt, 0>(x, w_in, s_in, b_in, params, conv_state, state_in, w_out, s_out, b_out, h, conv_state_out,
               state_out, scratch, eps_in, eps_qk, eps_norm, sm, bar);
  bar.arrive(JOIN);  // h written (the block waits in its phase A)

  // the block: out = h + block(norm(h)), h read through L2
  mbd::block<JOIN, true>(h, MBD_WEIGHT_ARGS,
                         out, reinterpret_cast<unsigned*>(scr + OFF_BLOCK), normalize, eps_post,
                         mbd::Smem{reinterpret_cast<gdn_u16 (*)[mbd::D]>(stage), red, ssq, rinds, rscores, dsm}, bar);
}
