// A gated-attention decoder layer's whole decode step (1 to 4 token rows,
// bf16, head_dim 256) in one launch:
//
//   h   = x + o_proj(attention(rms_norm(x, w_in)))   (ops/attention.py decode_step)
//   out = h + block(rms_norm(h, w_post))              (moe_block_decode.cu)
//
// A persistent grid of G <= SM-count blocks of 512 threads (one per SM), all
// resident at once, on six grid barriers of one slot (grid_sync.cuh's
// GridBarriers):
//   start  each block issues the copies of its first attention item's first
//          two K/V tiles of the cache into shared memory: positions before
//          this token are known before the projection, so their loads run
//          under phase A;
//   A      proj = rms_norm(x) @ W_qkv.T (quantized_gemv.cu's tiles,
//          qgemv_tile.cuh) into scratch;                               barrier 1
//   B      split-K attention of the items (b, j, s) (row, KV head, split of
//          the positions; items over the grid): attention_decode.cu's
//          ATT_KIND 1 per item, except that this token's key (ATT_KIND 0's
//          RMSNorm + RoPE) and value go into the tile row of its position
//          from proj, so the cache buffers are only read; item s = 0 of
//          each (b, j) also writes them to kv_new, for the caller's cache
//          writes after the launch;                                 barrier 2
//   C      combine of each (b, query head) over the splits and the sigmoid
//          gate (attention_body.cuh's combine_head) into y;            barrier 3
//   D      h = x + y @ W_o.T (the o_proj tiles' weights loaded during the
//          barrier wait) into scratch;                                 barrier 4 (join)
//   the MoE block body (moe_block_body.cuh) on h, read through L2; its two
//   barriers 5, 6.
//
// Splits: attention_decode.py's (ns splits of split_len positions per (b,
// j), from the capacity), so that every output equals the launches of
// ops/attention.py's decode_step and moe_block_decode.cu bit for bit (the
// CUDA check shows it on the CPU) where 0 <= off < cap; another offset gives
// an unspecified result, but nothing outside the buffers is read.
//
// Inputs: x [M, K] bf16; w_in [K] (the input RMSNorm, AL_IW); w_qkv uint32
// [P, K/8], s_qkv, b_qkv bf16 [P, K/64] (the concatenated q|k|v projection,
// attention_decode.cu's proj layout); w_q, w_k [256] (ATT_W); keys, values
// [M, HKV, cap, 256] bf16 (positions < off hold the earlier tokens); offset
// int32 (0-d); w_o uint32 [K, HQ*256/8], s_o, b_o bf16 [K, HQ*256/64]; then
// the MoE block's after its x (moe_block_decode.cu's: norm_w the
// post-attention RMSNorm weight, the router, the routed and shared experts,
// the shared-expert gate); after (any array, never read). Outputs: out [M, K]
// bf16; kv_new bf16 [2, M, HKV, 256] (this token's keys, then values); at
// int32 [1] (off clamped into [0, cap): the row the caller writes); scratch
// uint32 (attention_layer_decode.py's scratch_words: proj, partials, y, h,
// the block's). Scalars: eps_in, cap, ns, split_len, eps_q, eps_k, scale_log2 (softmax
// scale * log2(e)), log2_base, rope_scale, normalize, eps_post. Dynamic
// shared memory: DSM bytes (the kernel traps when given less).
//
// Launch contract: as the one-launch mixer's (G blocks of 512 threads, G <=
// the SMs and <= BARW, every block resident at once; a
// barrier slot per running launch; `after` orders a launch after its writer).
//
// Build macros: KNAME; attention_body.cuh's (ATT_X = bf16_t, ATT_W, ATT_HQ,
// ATT_HKV, ATT_ROPE_DIMS, ATT_ROPE_TRAD); AL_K (hidden size), AL_M (rows),
// AL_IW (the input norm weight's type); the block's (MBD_N = AL_M, MBD_K,
// MBD_E, MBD_D = AL_K, MBD_I, MBD_SGB, MBD_RBITS, MBD_RGS, MBD_WT).
#include "attention_body.cuh"
#include "moe_block_body.cuh"

typedef AL_IW iwt;

namespace {
static_assert(SameType<xt, bf16_t>::value, "the one-launch attention layer is bf16 only (as the MoE block)");
static_assert(!MQF_PHASE_CLOCK, "no phase-clock build of the one-launch attention layer");
constexpr int NT = 512, NW = NT / 32;
constexpr int HID = AL_K, M = AL_M;
constexpr int KO = HQ * DH;  // o_proj's K
static_assert(M == mbd::N && HID == mbd::D, "AL_M == MBD_N and AL_K == MBD_D");
static_assert(M >= 1 && M <= 4 && HID % 64 == 0, "1 to 4 rows, K a multiple of 64");
static_assert(G < NW, "a warp past the query heads computes this token's key");
constexpr int KWA = qg_tile_warps(HID), KWC = qg_tile_warps(KO);
constexpr int TA = NW / KWA, TC = NW / KWC;
constexpr int TILES_A = (P + 15) / 16, TILES_C = (HID + 15) / 16;
typedef QgCfg<4, 64, HID, M, KWA> CfgA;
typedef QgCfg<4, 64, KO, M, KWC> CfgC;
// bf16 staging: xn [M][HID] (A), y [M][KO] (D), the block's xn [M][HID].
constexpr int STAGE = M * KO * 2 > M * HID * 2 ? M * KO * 2 : M * HID * 2;
static_assert(STAGE <= 32768, "the staged rows fit 32 KB of shared memory");
static_assert(mbd::N * mbd::D * 2 <= STAGE, "the block's staged rows fit the staging array");

// Dynamic shared memory: phase B's two stages of a K and a V tile, G + 1 rows
// of DH floats (the query heads' and the new key's norm + rope), the new key
// and value rows (xt); phase C's split weights (reuse); the block's (reuse).
constexpr int STAGE_BYTES = 2 * TILE * DH * (int)sizeof(xt);
constexpr int OFF_QSH = 2 * STAGE_BYTES;
constexpr int OFF_KVNEW = OFF_QSH + (G + 1) * DH * 4;
constexpr int PART_BYTES = OFF_KVNEW + 2 * DH * (int)sizeof(xt);
constexpr int DSM = PART_BYTES > mbd::DSM ? PART_BYTES : mbd::DSM;  // attention_layer_decode.py's smem_bytes

constexpr unsigned long long NBAR = 6;  // A, B, C, the join (after D), the block's 2
constexpr unsigned JOIN = 4;
constexpr unsigned long long BARW = 1024;  // barrier weight, >= gridDim.x
__device__ GridSlot attn_layer_slots[GRID_SLOTS];
struct AttnLayerSlots {
  static __device__ __forceinline__ GridSlot* table() { return attn_layer_slots; }
};

__host__ __device__ constexpr int round16(int n) {
  return (n + 15) / 16 * 16;
}
// Scratch (bytes): proj [M][P] bf16, the partials (M * HQ * ns rows of DH
// floats, then their (max, sum) pairs), y [M][KO] bf16, h [M][HID] bf16, the
// block's scratch; the partials' size depends on ns.
constexpr int OFF_PROJ = 0;
constexpr int OFF_PART = OFF_PROJ + round16(M * P * 2);
__device__ __forceinline__ int off_y(int ns) {
  return OFF_PART + round16(M * HQ * ns * (DH + 2) * 4);
}
}  // namespace

extern "C" __global__ void __launch_bounds__(NT, 1) KNAME(
    const xt* __restrict__ x,
    const iwt* __restrict__ w_in,
    const unsigned* __restrict__ w_qkv, const xt* __restrict__ s_qkv, const xt* __restrict__ b_qkv,
    const wt* __restrict__ w_q,
    const wt* __restrict__ w_k,
    const xt* __restrict__ keys,
    const xt* __restrict__ values,
    const int* __restrict__ offset,
    const unsigned* __restrict__ w_o, const xt* __restrict__ s_o, const xt* __restrict__ b_o,
    MBD_WEIGHT_PARAMS,
    const void* __restrict__ after,  // never read (the launch contract)
    xt* __restrict__ out,
    xt* __restrict__ kv_new,
    int* __restrict__ at,
    unsigned* __restrict__ scratch,
    float eps_in,
    int cap,
    int ns,
    int split_len,
    float eps_q,
    float eps_k,
    float scale_log2,
    float log2_base,
    float rope_scale,
    int normalize,
    float eps_post) {
  extern __shared__ __align__(16) unsigned char dsm[];
  __shared__ __align__(16) unsigned char stage[STAGE];  // xn (A), y (D), the block's xn
  __shared__ float red[NW][32][4];
  __shared__ float ssq[NW][M];
  __shared__ float cred[DH / 32];
  __shared__ float ctot[2];
  __shared__ int rinds[mbd::NK];
  __shared__ float rscores[mbd::NK];
  if (dynamic_smem_size() < DSM) __trap();
  unsigned char* const scr = reinterpret_cast<unsigned char*>(scratch);
  xt* const proj = reinterpret_cast<xt*>(scr + OFF_PROJ);
  float* const part = reinterpret_cast<float*>(scr + OFF_PART);
  xt* const y = reinterpret_cast<xt*>(scr + off_y(ns));
  xt* const h = reinterpret_cast<xt*>(scr + off_y(ns) + round16(M * KO * 2));
  unsigned* const bscr = reinterpret_cast<unsigned*>(scr + off_y(ns) + round16(M * KO * 2) + round16(M * HID * 2));
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  GridBarriers<NBAR, BARW, AttnLayerSlots> bar;
  bar.claim();

  // ---- the block's first item's first two K/V tiles (before the projection) ----------------
  const int off = *offset;
  const int n_items = M * HKV * ns;
  // Item `it` (b, j, s): positions [lo, hi) of split s, none past the query or the buffer. Split-major
  // order: the items that hold positions (the low splits) come first, one per block in the first
  // round, whose tiles are copied before the projection.
  struct Item {
    int s, bj, lo, hi, tiles;
  };
  auto item_at = [&](int it) {
    Item r;
    r.s = it / (M * HKV);
    r.bj = it % (M * HKV);  // b * HKV + j
    r.lo = r.s * split_len;
    r.hi = min(min(r.lo + split_len, off + 1), cap);
    r.tiles = r.hi > r.lo ? (r.hi - r.lo + TILE - 1) / TILE : 0;
    return r;
  };
  // Tile t of item q into stage st; rows past the item's end zero-filled (no read).
  auto copy_tile = [&](const Item& q, int t, int st) {
    xt* kt = reinterpret_cast<xt*>(dsm + st * STAGE_BYTES);
    copy_kv_tile<NT>(kt, kt + TILE * DH, keys, values, (size_t)q.bj * cap, q.lo + t * TILE,
                     min(TILE, q.hi - (q.lo + t * TILE)), tid);
  };
  if ((int)blockIdx.x < n_items) {  // positions before this token are known before the projection
    const Item q0 = item_at(blockIdx.x);
    if (q0.tiles > 0) copy_tile(q0, 0, 0);
    if (q0.tiles > 1) copy_tile(q0, 1, 1);
  }

  // ---- A: proj = rms_norm(x) @ W_qkv.T ------------------------------------------------------
  {
    gdn_u16 (*xs)[HID] = reinterpret_cast<gdn_u16 (*)[HID]>(stage);
    const int team = warp / KWA, wt_ = warp - team * KWA;
    const int tile = qg_tile0<TA, true>(team);
    QgA<CfgA> A;
    QgSB<CfgA> sb;
    if (team < TA && tile < TILES_A)  // weight loads first, as quantized_gemv.cu
      qg_load<CfgA>(A, sb, w_qkv, s_qkv, b_qkv, tile * 16, P, wt_ * CfgA::BPW, lane >> 2, lane & 3);
    qg_stage_norm<M, HID, KWA, NT>(xs, ssq, x, w_in, eps_in);
    qg_tiles<CfgA, KWA, TA, TILES_A, false, true>(A, sb, xs, w_qkv, s_qkv, b_qkv, proj, nullptr, P, red);
  }
  bar.arrive(1);
  bar.wait(1);

  // ---- B: the items' partial attention (attention_decode.cu's ATT_KIND 1 per item) ----------
  for (int it = blockIdx.x; it < n_items; it += gridDim.x) {
    const Item q0 = item_at(it);
    const int b = q0.bj / HKV, j = q0.bj % HKV;
    const bool first = it == (int)blockIdx.x;  // its tiles 0 and 1 were issued at the start
    const bool holds_off = q0.hi > q0.lo && off == q0.hi - 1;  // this token's position is the item's last
    if (!first && q0.tiles > 0) copy_tile(q0, 0, 0);
    float* qsh = reinterpret_cast<float*>(dsm + OFF_QSH);
    xt* knew = reinterpret_cast<xt*>(dsm + OFF_KVNEW);
    xt* vnew = knew + DH;
    float q[EL];
    if (warp < G) {
      load_lane_cg(proj + (size_t)b * P + (j * G + warp) * 2 * DH + lane * EL, q);
      norm_rope(q, w_q, eps_q, off, log2_base, rope_scale, qsh + warp * DH);
#pragma unroll
      for (int e = 0; e < EL; ++e) q[e] *= scale_log2;
    } else if (warp == G && (holds_off || q0.s == 0)) {  // this token's key (ATT_KIND 0's) and value
      float kv[EL], vv[EL];
      load_lane_cg(proj + (size_t)b * P + OFF_K + j * DH + lane * EL, kv);
      norm_rope(kv, w_k, eps_k, off, log2_base, rope_scale, qsh + G * DH);
      load_lane_cg(proj + (size_t)b * P + OFF_V + j * DH + lane * EL, vv);
#pragma unroll
      for (int e = 0; e < EL; e += 4) {
        store4(knew + lane * EL + e, kv + e);
        store4(vnew + lane * EL + e, vv + e);
      }
      if (q0.s == 0) {  // the caller writes them into the buffers at `at`
#pragma unroll
        for (int e = 0; e < EL; e += 4) {
          store4(kv_new + (size_t)q0.bj * DH + lane * EL + e, kv + e);
          store4(kv_new + ((size_t)M * HKV + q0.bj) * DH + lane * EL + e, vv + e);
        }
        if (q0.bj == 0 && lane == 0) at[0] = min(max(off, 0), cap - 1);
      }
    }
    float m = neg_inf(), l = 0.0f, acc[EL];
#pragma unroll
    for (int e = 0; e < EL; ++e) acc[e] = 0.0f;
    for (int t = 0; t < q0.tiles; ++t) {
      const int st = t & 1;
      if ((t >= 1 || !first) && t + 1 < q0.tiles) copy_tile(q0, t + 1, st ^ 1);
      if (t + 1 < q0.tiles) {
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
      xt* kt = reinterpret_cast<xt*>(dsm + st * STAGE_BYTES);
      xt* vt = kt + TILE * DH;
      const int n = min(TILE, q0.hi - (q0.lo + t * TILE));
      if (holds_off && t == q0.tiles - 1) {  // this token's row: from proj (the buffer's is not written yet)
        for (int i = tid; i < DH; i += NT) {
          kt[(n - 1) * DH + i] = knew[i];
          vt[(n - 1) * DH + i] = vnew[i];
        }
        __syncthreads();
      }
      if (warp < G) tile_update(q, m, l, acc, kt, vt, n, lane);
      __syncthreads();
    }
    if (warp < G) {
      const size_t row = ((size_t)b * HQ + j * G + warp) * ns + q0.s;
      float* pa = part + row * DH + lane * EL;
#pragma unroll
      for (int e = 0; e < EL; e += 4) store4(pa + e, acc + e);
      if (lane == 0) {  // (max, sum) after all M * HQ * ns accumulators
        float* ml = part + (size_t)M * HQ * ns * DH + row * 2;
        ml[0] = m;
        ml[1] = l;
      }
    }
    __syncthreads();  // qsh, knew and the stages free for the next item
  }
  bar.arrive(2);
  bar.wait(2);

  // ---- C: combine and gate of each (b, query head) (attention_decode.cu's ATT_KIND 2) ----------
  for (int bh = blockIdx.x; bh < M * HQ; bh += gridDim.x) {
    combine_head<NT, L2Load>(part, (size_t)M * HQ * ns, proj, y, ns, bh, reinterpret_cast<float*>(dsm), cred, ctot);
    __syncthreads();  // the split weights free for the next head
  }

  // ---- D: h = x + y @ W_o.T -----------------------------------------------------------------
  {
    const int team = warp / KWC, wt_ = warp - team * KWC;
    const int tile = qg_tile0<TC, true>(team);
    QgA<CfgC> A;
    QgSB<CfgC> sb;
    bar.arrive(3);
    if (team < TC && tile < TILES_C)  // loaded while the grid meets
      qg_load<CfgC>(A, sb, w_o, s_o, b_o, tile * 16, HID, wt_ * CfgC::BPW, lane >> 2, lane & 3);
    bar.wait(3);
    gdn_u16 (*ys)[KO] = reinterpret_cast<gdn_u16 (*)[KO]>(stage);
    for (int i = tid; i < M * KO / 8; i += NT)
      *reinterpret_cast<uint4*>(&ys[0][0] + 8 * i) = ldcg16(y + 8 * i);
    __syncthreads();
    qg_tiles<CfgC, KWC, TC, TILES_C, true, true>(A, sb, ys, w_o, s_o, b_o, h, x, HID, red);
  }
  bar.arrive(JOIN);  // h written (the block waits in its phase A)

  // ---- the MoE block: out = h + block(norm(h)), h read through L2 -----------------------------
  mbd::block<JOIN, true>(h, MBD_WEIGHT_ARGS,
                         out, bscr, normalize, eps_post,
                         mbd::Smem{reinterpret_cast<gdn_u16 (*)[mbd::D]>(stage), red, ssq, rinds, rscores, dsm}, bar);
}
