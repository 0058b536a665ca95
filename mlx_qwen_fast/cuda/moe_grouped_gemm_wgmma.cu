// Grouped expert GEMM with fused 4-bit dequantisation on Hopper's warpgroup
// tensor-core instructions (wgmma): the "wgmma" build of the prefill MoE
// kernels (kernels/moe_grouped_gemm.py; moe_grouped_gemm.cu is the mma.sync
// build of the same contract, on the natural K order).
//
// The GEMM is computed transposed, out^T[features, rows] = W[features, K] .
// A^T[K, rows], so that the quantised weights are wgmma's A operand, taken
// from registers: each thread dequantises only the weight elements of its
// own A fragments (no dequantised tile is ever stored anywhere), and the
// activation rows (x or h) are wgmma's B operand, copied with cp.async into a
// ring of shared-memory slots in the 128-byte-swizzled K-major layout that
// wgmma reads through a matrix descriptor. Rows of a work item are wgmma's N
// (MOE_BM = 32, 64 or 128 = the routing's tile rows).
//
// K order. A thread's A fragment of one k16 step holds, for weight rows g and
// g+8 of its warp's 16, the inputs at fragment slots 2q, 2q+1 (reg 0 / 1) and
// 2q+8, 2q+9 (reg 2 / 3), q = lane % 4. Within each K chunk of 128 inputs
// (two quantisation groups) thread q owns packed words 4q..4q+3 of each of its
// rows (natural inputs 32q..32q+31: one 16-byte load per row and chunk) and
// k16 step s (0..7) uses word s/2: slot 2q + 8hs + j holds the nibble
// 2(s%2) + hs + 4j of that word (j = 0, 1 the bf16 halves of the register),
// so one register is one nibble pair (a, a+4) of one word: a shift, one lop3
// (OR into the mantissa of bf16 128), one sub.bf16x2 and one fma.bf16x2
// (w = bf16(s * q + b), one rounding, as MLX's CUDA mx.dequantize). That
// fixes the activation's K order: chunk position P = 16s + 8hs + 2q + j holds
// natural input 32q + 8(s/2) + 2(s%2) + hs + 4j. The caller passes x in that
// order (kernels/moe_grouped_gemm.py: permute_k), and the gate+up kernel
// writes h in that order for the down kernel. Dot products are those of the
// natural order (only the fp32 summation order differs).
//
// MOE_KIND 0 (gate + up + SwiGLU): inputs xp [N, K] bf16 (K-permuted),
//   wg, sg, bg, wu, su, bu [E, O, K/8] / [E, O, K/64], order [NK], offsets
//   [E+1], bmap [items, 2]; output h [NK, O] bf16, grouped row order, columns
//   K-permuted per 128: h[r] = bf16(silu(bf16(x[order[r]/k] . Wg[e])) *
//   bf16(x . Wu[e])). CTA = (item, 128 output features); warpgroup w takes
//   features [64w, 64w+64) of both matrices (two wgmma per k16 step, the
//   SwiGLU in registers).
// MOE_KIND 1 (down, routing weight): inputs hp [NK, K] bf16 (grouped rows,
//   K-permuted), wd, sd, bd, order, offsets, bmap, scores [NK] f32; output y
//   [NK, O] MOE_YT in assignment order, natural columns: y[order[r]] =
//   scores[order[r]] * bf16(h[r] . Wd[e]). CTA = (item, 256 output features);
//   warpgroup w takes features [128w, 128w+128) as two 64-row wgmma tiles.
// The caller sums y over the k assignments of each token.
//
// Pipeline: MOE_STAGES ring slots, one K chunk each (BM rows x 256 bytes: two
// 64-input swizzle atoms). Chunk c+S-2 is copied while chunk c is multiplied;
// the weight words of chunk c+1 are loaded into registers meanwhile. Per
// k16 step: dequantise, wgmma.fence, two wgmma, commit, wait until at most
// this step's group is in flight (the A registers of the previous step are
// free again). Gate+up epilogue
// through shared memory (the ring's space): 16-byte coalesced row stores.
// Down: stores straight from the accumulators (each warp store covers 8
// consecutive features of 4 rows: whole 32-byte sectors in fp32); with
// MOE_FT > 1 a CTA keeps its item's whole h tile in the ring (K <= 128 *
// MOE_STAGES) and computes MOE_FT feature tiles of 256 in turn, the weight
// loads running on across tile boundaries.
//
// Requirements (the wrapper checks): K % 128 == 0, O % 128 == 0 (gate+up) or
// % (256 * MOE_FT) == 0 (down), K <= 128 * MOE_STAGES when MOE_FT > 1, every
// weight array < 2^31 elements (32-bit offsets), dynamic shared memory >=
// SMEM_BYTES (checked here: trap). Launch: grid (items * 256, O / (FEAT *
// MOE_FT), 1) threads, 256 threads per CTA.
//
// The shared expert as one more group (MOE_SHARED 1): its weights are a
// second pointer set (one expert, the routed experts' O and K) and work items
// of expert id >= `es` read it; the routing gives every token a last slot of
// id es with the shared gate as its weight (kernels/moe_routing.py), so the
// shared expert's rows run in the same launches as the routed ones.
//
// Build macros: KNAME, MOE_KIND, MOE_BM (32/64/128), MOE_STAGES (3..6),
// MOE_YT (down output type), MOE_FT (down: feature tiles per CTA; tile rows
// 32/64 only), MOE_SHARED (0/1).
#include "gdn_common.cuh"

#ifndef MOE_BM
#define MOE_BM 64
#endif
#ifndef MOE_STAGES
#define MOE_STAGES 4
#endif
#ifndef MOE_YT
#define MOE_YT float
#endif
#ifndef MOE_FT
#define MOE_FT 1  // down: feature tiles of FEAT per CTA, h resident (needs K / 128 <= MOE_STAGES)
#endif

constexpr int BM = MOE_BM;  // rows of a work item = wgmma N
constexpr int S = MOE_STAGES;
constexpr int NT = 256;  // two warpgroups
constexpr int KC = 128;  // inputs per ring slot (8 k16 steps, 2 quantisation groups)
constexpr int FEAT = MOE_KIND == 0 ? 128 : 256;  // output features per CTA
constexpr int ATOM = BM * 128;  // bytes of one 64-input swizzle atom
constexpr int SLOT = 2 * ATOM;
constexpr int RING = S * SLOT;
constexpr int OUT_LD = (FEAT + 8) * 2;  // gate+up epilogue staging row (bf16), bytes
constexpr int STAGING = MOE_KIND == 0 ? BM * OUT_LD : 0;  // down stores straight from registers
constexpr int SMEM_BYTES = (RING > STAGING ? RING : STAGING) + 1024;  // + alignment to 1024
constexpr int CPT = BM * 16 / NT;  // 16-byte copies per thread per chunk
constexpr int NACC = BM / 2;       // fp32 accumulators per thread per 64-row tile
static_assert(BM == 32 || BM == 64 || BM == 128, "MOE_BM must be 32, 64 or 128");
static_assert(S >= 3 && S <= 6, "MOE_STAGES must be 3..6");
static_assert(CPT * NT == BM * 16, "copies must split evenly");
static_assert(OUT_LD % 16 == 0, "staging rows must stay 16-byte aligned");
static_assert(MOE_FT >= 1 && (MOE_KIND == 1 || MOE_FT == 1), "MOE_FT > 1 is for the down kernel");
static_assert(MOE_FT == 1 || BM <= 64, "MOE_FT > 1 only at 32/64 rows (wrong rows at 128: bench/results/moe-cuda-log.md)");
typedef MOE_YT yt;
#include "moe_gemm_common.cuh"

// ---- wgmma (wgmma_n32/_n64/_n128, wgmma_fence/_commit/_wait, fence_acc,
// fence_proxy_async: ptx.cuh) ---------------------------------------------------

__device__ __forceinline__ void wgmma_tile(float* d, const unsigned* a, unsigned long long desc_b, int scale_d) {
  if constexpr (BM == 32) {
    wgmma_n32(d, a, desc_b, scale_d);
  } else if constexpr (BM == 64) {
    wgmma_n64(d, a, desc_b, scale_d);
  } else {
    wgmma_n128(d, a, desc_b, scale_d);
  }
}

// Descriptor of a K-major, 128-byte-swizzled operand tile at shared address
// `addr` (the swizzle atom's base 1024-aligned; a k16 step inside the atom
// adds 32 bytes): start >> 4, leading offset 16 B (unused), stride 1024 B
// between 8-row groups, layout 1 = 128-byte swizzle.
__device__ __forceinline__ unsigned long long sw128_desc(unsigned addr) {
  return (unsigned long long)((addr & 0x3FFFFu) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

__device__ __forceinline__ unsigned word_of_rt(const uint4& v, int i) {  // i a compile-time constant after unrolling
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// K-permuted position (within a 128 chunk) of natural input k (0..127).
__device__ __forceinline__ int perm_pos(int k) {
  const int q = k >> 5, w = (k >> 3) & 3, j = (k >> 2) & 1, u = (k >> 1) & 1, hs = k & 1;
  return 32 * w + 16 * u + 8 * hs + 2 * q + j;
}

// Weight registers of one K chunk: [matrix / 64-row tile m][row g, g+8],
// kept as loaded (no arithmetic on them until the chunk is multiplied, so a
// load in flight never stalls the chunk before).
struct WChunk {
  uint4 w[2][2];
  unsigned short s[2][2], b[2][2];  // the rows' scale and bias (bf16 bits)
};

extern "C" __global__ void MOE_LB KNAME(MOE_GEMM_PARAMS) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ int s_src[BM];  // source row of each tile row (-1: past the item's end)
#if MOE_KIND == 1
  __shared__ int s_aid[BM];
  __shared__ float s_score[BM];
#endif

  const int item = blockIdx.x;
  const int e = bmap[2 * item];
  if (e < 0) return;
  if (dynamic_smem_size() < (unsigned)SMEM_BYTES) __trap();  // launched with too little shared memory
  const int row0 = offsets[e] + bmap[2 * item + 1] * BM;
  const int rows = min(BM, offsets[e + 1] - row0);
  const int f0 = blockIdx.y * FEAT * MOE_FT;
  const int tid = threadIdx.x;
  if (tid < BM) {
    const bool ok = tid < rows;
    const int r = row0 + tid;
#if MOE_KIND == 0
    s_src[tid] = ok ? order[r] / topk : -1;  // token of the row
#else
    s_src[tid] = ok ? r : -1;  // h is in grouped order already
    const int a = ok ? order[r] : 0;
    s_aid[tid] = a;
    s_score[tid] = ok ? scores[a] : 0.0f;
#endif
  }
  __syncthreads();

  const unsigned raw = smem_addr(smem_raw);
  const unsigned base = (raw + 1023u) & ~1023u;  // swizzle atoms need 1024-byte alignment
#if MOE_KIND == 0
  unsigned char* const sm = smem_raw + (base - raw);  // the epilogue's staging area
#endif
  const int nch = K / KC;

  // ---- activation copies: thread's 16-byte pieces of a chunk (fixed rows) ----
  unsigned cp_dst[CPT], cp_src[CPT], cp_n[CPT];
#pragma unroll
  for (int u = 0; u < CPT; ++u) {
    const int i = tid + u * NT;
    const int r = i >> 4, j = i & 15;
    cp_dst[u] = (unsigned)((j >> 3) * ATOM + r * 128 + (((j & 7) ^ (r & 7)) << 4));
    const int sr = s_src[r];
    cp_src[u] = (unsigned)(sr >= 0 ? sr : 0) * (unsigned)K + (unsigned)(j * 8);
    cp_n[u] = sr >= 0 ? 16u : 0u;  // 0: zero fill
  }
  auto issue = [&](int c) {
    const unsigned slot = base + (unsigned)((c % S) * SLOT);
#pragma unroll
    for (int u = 0; u < CPT; ++u) cp_async16_zfill(slot + cp_dst[u], x + cp_src[u] + c * KC, cp_n[u]);
  };

  // ---- weight rows of this thread ----
  const int lane = tid & 31, warp = (tid >> 5) & 3, wgi = tid >> 7;
  const int g = lane >> 2, q = lane & 3;
  const int kw = K >> 3, kg = K >> 6;
  // the item's weight set: a routed expert's slice, or the shared expert's arrays
#if MOE_SHARED
  const bool sh = e >= es;
#define PICK(routed, shared) (sh ? (shared) : (routed))
#else
#define PICK(routed, shared) (routed)
#endif
  const unsigned ew = PICK((unsigned)e, 0u);
  const unsigned* const W0 = PICK(w0, ws0);
  const bf16_t* const S0 = PICK(s0, ss0);
  const bf16_t* const B0 = PICK(b0, bs0);
#if MOE_KIND == 0
  const unsigned* const W1 = PICK(w1, ws1);
  const bf16_t* const S1 = PICK(s1, ss1);
  const bf16_t* const B1 = PICK(b1, bs1);
#endif
#undef PICK
  unsigned w_off[2][2], s_off[2][2];
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
#if MOE_KIND == 0
      const int row = f0 + 64 * wgi + 16 * warp + g + 8 * rh;  // same row of gate (m 0) and up (m 1)
#else
      const int row = f0 + 128 * wgi + 64 * m + 16 * warp + g + 8 * rh;
#endif
      const unsigned grow = ew * (unsigned)O + (unsigned)row;
      w_off[m][rh] = grow * (unsigned)kw + 4u * q;
      s_off[m][rh] = grow * (unsigned)kg + (q >> 1);
    }
  // Weights of K chunk c of feature tile ft (ft > 0 only with MOE_FT > 1).
  auto load_w = [&](WChunk& wc, int c, int ft) {
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int rh = 0; rh < 2; ++rh) {
#if MOE_KIND == 0
        const unsigned* W = m == 0 ? W0 : W1;
        const bf16_t* Sc = m == 0 ? S0 : S1;
        const bf16_t* Bi = m == 0 ? B0 : B1;
#else
        const unsigned* W = W0;
        const bf16_t* Sc = S0;
        const bf16_t* Bi = B0;
#endif
        const unsigned wo = w_off[m][rh] + (unsigned)(ft * FEAT * kw) + 16u * c;
        const unsigned so = s_off[m][rh] + (unsigned)(ft * FEAT * kg) + 2u * c;
        wc.w[m][rh] = *reinterpret_cast<const uint4*>(W + wo);
        wc.s[m][rh] = Sc[so].x;
        wc.b[m][rh] = Bi[so].x;
      }
  };

  float acc[2][NACC];
  auto zero_acc = [&]() {
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int i = 0; i < NACC; ++i) acc[m][i] = 0.0f;
  };
  auto drain = [&]() {  // every wgmma done, accumulators final
    wgmma_wait<0>();
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int i = 0; i < NACC; ++i) fence_acc(acc[m][i]);
  };

  // The 8 k16 steps of one K chunk: activations from ring slot `slot`,
  // weights from `use`; `fresh` != 0: the chunk starts the accumulation
  // (its first step overwrites the accumulators).
  auto mma_chunk = [&](const WChunk& use, unsigned slot, int fresh) {
    unsigned s2[2][2], b2[2][2];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int rh = 0; rh < 2; ++rh) {
        const unsigned sv = use.s[m][rh], bv = use.b[m][rh];
        s2[m][rh] = sv | (sv << 16);
        b2[m][rh] = bv | (bv << 16);
      }
#pragma unroll
    for (int st = 0; st < 8; ++st) {
      unsigned a[2][4];
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        // k16 step st: word st/2 of each row, nibble pairs 2(st%2) (slots 2q, 2q+1) and 2(st%2)+1 (2q+8, 2q+9)
        const unsigned w_lo = word_of_rt(use.w[m][0], st >> 1), w_hi = word_of_rt(use.w[m][1], st >> 1);
        if (st & 1) {
          a[m][0] = dequant_nibble_pair(w_lo >> 8, s2[m][0], b2[m][0]);
          a[m][1] = dequant_nibble_pair(w_hi >> 8, s2[m][1], b2[m][1]);
          a[m][2] = dequant_nibble_pair(w_lo >> 12, s2[m][0], b2[m][0]);
          a[m][3] = dequant_nibble_pair(w_hi >> 12, s2[m][1], b2[m][1]);
        } else {
          a[m][0] = dequant_nibble_pair(w_lo, s2[m][0], b2[m][0]);
          a[m][1] = dequant_nibble_pair(w_hi, s2[m][1], b2[m][1]);
          a[m][2] = dequant_nibble_pair(w_lo >> 4, s2[m][0], b2[m][0]);
          a[m][3] = dequant_nibble_pair(w_hi >> 4, s2[m][1], b2[m][1]);
        }
      }
      const unsigned long long desc = sw128_desc(slot + (unsigned)((st >> 2) * ATOM + (st & 3) * 32));
      wgmma_fence();
      const int sd = st == 0 && fresh ? 0 : 1;
      wgmma_tile(acc[0], a[0], desc, sd);
      wgmma_tile(acc[1], a[1], desc, sd);
      wgmma_commit();
      wgmma_wait<1>();
    }
  };

#if MOE_KIND == 1
  // y[order[r]] = score * bf16(acc), features f of tile ft, straight from the accumulators.
  auto store_down = [&](int ft) {
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int j = 0; j < BM / 8; ++j)
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
          const int n = 8 * j + 2 * q + e2;
          if (n >= rows) continue;
          const float sc = s_score[n];
          yt* dst = y + (size_t)s_aid[n] * O + f0 + ft * FEAT + 128 * wgi + 64 * m + 16 * warp + g;
#pragma unroll
          for (int rh = 0; rh < 2; ++rh)
            dst[8 * rh] = from_f<yt>(from_f_round<bf16_t>(acc[m][4 * j + 2 * rh + e2]) * sc);
        }
  };
#endif

#if MOE_KIND == 1 && MOE_FT > 1
  // ---- down, h resident: copy all of the item's h once, then MOE_FT feature tiles ----
  if (nch > S) __trap();  // the wrapper sends such K to MOE_FT 1 builds
  for (int c = 0; c < nch; ++c) issue(c);
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async();
  __syncthreads();
  const int units = MOE_FT * nch;
  auto unit = [&](int u, const WChunk& use, WChunk& fill) {
    const int c = u % nch;
    if (u + 1 < units) load_w(fill, (u + 1) % nch, (u + 1) / nch);
    mma_chunk(use, base + (unsigned)(c * SLOT), c == 0);
    if (c == nch - 1) {
      drain();
      store_down(u / nch);
    }
  };
  WChunk wa, wb;
  load_w(wa, 0, 0);
  zero_acc();  // defined values only: each feature tile's first step overwrites them (scale_d 0)
  for (int u = 0; u < units; u += 2) {
    unit(u, wa, wb);
    if (u + 1 < units) unit(u + 1, wb, wa);
  }
#else
  // ---- ring: chunk c+S-2 is copied while chunk c is multiplied ----
  zero_acc();
#pragma unroll
  for (int p = 0; p < S - 2; ++p) {
    if (p < nch) issue(p);
    cp_async_commit();
  }
  // One K chunk: wait for its activation slot, refill the slot of chunk c-2,
  // load the next chunk's weights into `fill`, multiply with `use`.
  auto chunk = [&](int c, const WChunk& use, WChunk& fill) {
    cp_async_wait<S - 3>();  // this thread's copies of chunk c have landed
    fence_proxy_async();     // ... and are visible to the tensor cores
    __syncthreads();         // everyone's; and every wgmma of chunk c-2 is done
    if (c + S - 2 < nch) issue(c + S - 2);  // into chunk c-2's slot
    cp_async_commit();
    if (c + 1 < nch) load_w(fill, c + 1, 0);
    mma_chunk(use, base + (unsigned)((c % S) * SLOT), 0);
  };
  // Two weight buffers in turn (no register copies between chunks).
  WChunk wa, wb;
  load_w(wa, 0, 0);
  for (int c = 0; c < nch; c += 2) {
    chunk(c, wa, wb);
    if (c + 1 < nch) chunk(c + 1, wb, wa);
  }
  drain();
  cp_async_wait<0>();

#if MOE_KIND == 0
  // ---- gate+up epilogue: accumulator (m, 4j + 2rh + e2) = feature 16 warp + g + 8 rh, row 8j + 2q + e2
  __syncthreads();  // the ring is free: the epilogue stages its rows there
  gdn_u16* hs = reinterpret_cast<gdn_u16*>(sm);
  constexpr int LD = OUT_LD / 2;
#pragma unroll
  for (int j = 0; j < BM / 8; ++j)
#pragma unroll
    for (int rh = 0; rh < 2; ++rh)
#pragma unroll
      for (int e2 = 0; e2 < 2; ++e2) {
        const int i = 4 * j + 2 * rh + e2;
        const float gt = from_f_round<bf16_t>(acc[0][i]);
        const float up = from_f_round<bf16_t>(acc[1][i]);
        const int n = 8 * j + 2 * q + e2;
        const int fl = 64 * wgi + 16 * warp + g + 8 * rh;
        hs[n * LD + perm_pos(fl)] = from_f<bf16_t>(silu_f(gt) * up).x;
      }
  __syncthreads();
  // row n: FEAT bf16 = 16 pieces of 16 bytes
  for (int i = tid; i < BM * 16; i += NT) {
    const int n = i >> 4, pc = i & 15;
    if (n < rows)
      *reinterpret_cast<uint4*>(y + (size_t)(row0 + n) * O + f0 + pc * 8) =
          *reinterpret_cast<const uint4*>(hs + n * LD + pc * 8);
  }
#else
  store_down(0);
#endif
#endif
}
