// The whole decode MoE block (N <= 4 tokens) in one launch: router GEMV,
// softmax + top-k, gate + up + SwiGLU of the selected and the shared experts,
// down + routing weights + shared-expert gate + combine.
//
// Clusters of CL = 8 CTAs (compile-time __cluster_dims__), no grid-wide
// barrier: every cluster computes the router itself, so the only waits are
// cluster barriers (hardware, ~0.1-0.3 us) and one counter per output slice.
// CTA rank r of a cluster owns the output rows [r * DR, (r + 1) * DR), DR = D / 8.
//
//   A  (before the routing is known) each cluster: the router logits, one
//      warp per expert row over the cluster's 64 warps (8-bit rows loaded at
//      the kernel's start, fp32 dot, bf16 logit as the router's quantised
//      matmul), the shared-expert gate's logit (row "E"), pushed into every
//      CTA of the cluster (distributed shared memory); and the cluster's
//      slices of the shared expert: slice s = 32 rows of its intermediate
//      width (clusters take s = cluster, + clusters, ...), CTA r computes 4 of
//      them (8 warps = 4 gate + 4 up rows), h = bf16(silu(bf16 g) * bf16 u)
//      pushed into every CTA; after a cluster barrier, each CTA multiplies its
//      DR down rows by the slice's 32 h values (one thread per row): split-K,
//      added into the CTA's fp32 output rows yl with the shared gate's weight.
//   B  every CTA routes each token with one warp (route_warp, the routing
//      kernel's own code: the same selection and weights as
//      moe_routing.route on these logits); the distinct experts in order of
//      first appearance are the items; a unit is (item, UR = 8 * RB rows of
//      the intermediate width), units u = cluster, + clusters, ... . For each
//      unit CTA r streams gate and up rows [r * RB, +RB) of the unit (TMA
//      bulk copies, one per 16-row half and matrix row, rows padded by 16
//      bytes in shared memory so the mma operand loads do not conflict) and
//      its down block (rows [r * DR, +DR), the unit's UR inputs: cp.async,
//      rows padded likewise), all requested as soon as the routing is known;
//      h of its RB rows goes to every CTA of the cluster; after a cluster
//      barrier each CTA multiplies its DR down rows by the unit's UR h values
//      (mma.sync, split-K) and adds coef * partial into yl (fp32).
//   C  each CTA adds yl into the fp32 accumulator acc (red.global.add.v4.f32)
//      and counts itself into its slice's counter (acq_rel); the last of the
//      clusters' rank-r CTAs writes y rows [r * DR, +DR) as bf16 and leaves
//      acc and the counter at zero for the next launch.
//
// Numerics: the routed experts' gate + up tiles are moe_decode_gemv.cu's
// arithmetic (same dequantisation, mma order and roundings: their h rows are
// bit-identical); the shared expert's h and every down product are fp32 dot
// products / mma sums over split K, weighted in fp32 (no bf16 rounding of an
// expert's output before its weight), summed over slices and clusters by fp32
// atomics: y = bf16(sum) within fp32 rounding of the fp32 reference on the
// same routing; the atomics' order makes the last bits of y vary between runs.
//
// inputs: x [N, D] bf16; rw, rs, rb (router: uint32 [E, D*RBITS/32], bf16
//   [E, D/64] x2); wg, sg, bg, wu, su, bu ([E, I, D/8], [E, I, D/64]); wd, sd,
//   bd ([E, D, I/8], [E, D, I/64]); xwg ... xbd (shared expert, the same
//   without E); gw, gs, gb (shared-expert gate, MDG_SGB 4/8/16);
//   ws uint32 [64 + 4 * D] workspace (zero before the first launch; every
//   launch leaves it zero): words 0..7 the slice counters, float acc [N, D]
//   from word 64.
// outputs: y [N, D] bf16; logits [N, E] float (bf16 values); inds [N, K]
//   int32; scores [N, K] float; h [N*K + N, I] bf16 (rows of the pairs, then
//   the shared expert's per token); sgate [N] float.
// Launch: G * 256 threads, G a multiple of 8 (clusters); any number of
// clusters (none waits for another); dynamic shared memory smem_bytes() of
// kernels/moe_decode_fused.py.
//
// Build macros: KNAME, MDG_N (1..4), MDG_K, MDG_E (multiple of 32, <= 1024),
// MDG_D (% 256, <= 2048), MDG_I (% 128), MDG_RBITS (4, 8), MDG_SGB (4, 8, 16),
// MDG_NORM (1: scores renormalised over the K selected), MDG_GU_SLOTS (1, 2);
// MDG_TIMING: an extra output [G, 8] uint64 of %globaltimer stamps.
#include "moe_decode_common.cuh"
#include "moe_route_common.cuh"

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
#define MDG_GU_SLOTS 2
#endif

constexpr int CL = 8;                      // CTAs per cluster
constexpr int N = MDG_N;
constexpr int TOPK = MDG_K;
constexpr int NK = N * TOPK;
constexpr int E = MDG_E;
constexpr int D = MDG_D;
constexpr int I = MDG_I;
constexpr int NW = 8;
constexpr int NT = 32 * NW;
constexpr int RB = I % 256 == 0 ? 32 : 16;  // gate/up rows per CTA and unit
constexpr int MT = RB / 16;                 // their 16-row mma tiles
constexpr int UR = CL * RB;                 // intermediate rows per unit
constexpr int UPE = I / UR;                 // units per expert
constexpr int NUB = UR / 128;               // 128-input blocks of a unit's down K
constexpr int UG = UR / 64;                 // quantisation groups of a unit's down K
constexpr int DR = D / CL;                  // output rows per CTA
constexpr int NDT = DR / 16;                // their 16-row mma tiles
constexpr int KW = D / 8, KG = D / 64;      // gate/up row: packed words, groups
constexpr int DKW = I / 8, DKG = I / 64;    // down row
constexpr int NCH = D / 256;                // gate/up K chunks of 256 inputs
constexpr int SR = 32;                      // shared-expert rows per slice (4 per CTA)
constexpr int NSL = I / SR;                 // shared-expert slices
constexpr int RPW = (E + CL * NW - 1) / (CL * NW);  // router rows per warp (at most)
constexpr int GUS = MDG_GU_SLOTS;
// gate+up slot (bytes): gate rows | up rows (each row KW words + 16 bytes) | gate scales | gate biases | up scales | up biases
constexpr int GU_RS = KW * 4 + 16;
constexpr int GU_W = RB * GU_RS, GU_S = RB * KG * 2;
constexpr int GU_SLOT = 2 * GU_W + 4 * GU_S;
// down slot: DR rows of UR/2 bytes (+16) | scales [DR][UG] | biases [DR][UG]
constexpr int DN_RS = UR / 2 + 16;
constexpr int DN_W = DR * DN_RS, DN_S = DR * UG * 2;
constexpr int DN_SLOT = DN_W + 2 * DN_S;
constexpr int WS_ACC = 64;                  // acc's first word in ws
static_assert(N >= 1 && N <= 4, "1 <= N <= 4 tokens");
static_assert(NK <= 32, "N * top_k must fit one warp");
static_assert(D % 256 == 0 && D <= 2048 && I % 128 == 0, "D % 256 == 0, D <= 2048, I % 128 == 0");
static_assert(E % 32 == 0 && E <= 1024, "E must be a multiple of 32, <= 1024");
static_assert(MDG_RBITS == 4 || MDG_RBITS == 8, "router bits 4 or 8");
static_assert(GUS == 1 || GUS == 2, "one or two gate+up slots");
static_assert(GU_SLOT % 128 == 0 && DN_SLOT % 16 == 0, "slot alignment");

// ---- shared memory ----------------------------------------------------------------

struct Smem {  // arrays read 16 bytes at a time first (every size here is a multiple of 16 bytes)
  gdn_u16 x[N][D];            // the tokens
  gdn_u16 hb[2][N][UR];       // a unit's h (the cluster's UR rows), by unit parity
  float lg[N][E];             // router logits (pushed by the cluster's warps)
  float red[NW][2][RB][N];    // gate/up warp partial sums
  float yl[N][DR];            // this CTA's output rows, fp32
  gdn_u16 hs[2][N][SR];       // a shared slice's h, by slice parity
  float gus[2][4][N];         // a shared slice's 4 gate and 4 up sums
  float sg[N];                // sigmoid(shared-gate logit)
  int inds[NK];
  float scores[NK];
  int items[NK];              // distinct routed experts, order of first appearance
  int nitems;
  int last;
};
static_assert((N * D * 2) % 16 == 0 && (2 * N * UR * 2) % 16 == 0 && (N * E * 4) % 16 == 0 &&
                  (NW * 2 * RB * N * 4) % 16 == 0,
              "x, hb, lg, red fill whole 16-byte units: hb and yl (read 16 bytes at a time) stay aligned");
// dynamic shared memory: [gate+up slots][down slot][mbarriers: MT per gate+up slot][Smem]
constexpr int OFF_DN = GUS * GU_SLOT;
constexpr int OFF_BAR = OFF_DN + DN_SLOT;
constexpr int OFF_SM = (OFF_BAR + 8 * GUS * MT + 127) / 128 * 128;
constexpr unsigned SMEM_BYTES = OFF_SM + (unsigned)sizeof(Smem);  // = smem_bytes() of the wrapper

// ---- cluster, TMA, atomics -----------------------------------------------------------

__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ unsigned cluster_id() {
  unsigned r;
  asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r));
  return r;
}
__device__ __forceinline__ unsigned cluster_count() {
  unsigned r;
  asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_sync() {
  cluster_arrive();
  cluster_wait();
}
// Address of shared variable `p` (this CTA's) in CTA `rank` of the cluster.
__device__ __forceinline__ unsigned peer_addr(const void* p, unsigned rank) {
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(smem_addr(p)), "r"(rank));
  return r;
}
// Store v at `p` in every CTA of the cluster.
__device__ __forceinline__ void push_f32(const float* p, float v) {
#pragma unroll
  for (unsigned q = 0; q < CL; ++q) asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(peer_addr(p, q)), "f"(v) : "memory");
}
__device__ __forceinline__ void push_u16(const gdn_u16* p, gdn_u16 v) {
#pragma unroll
  for (unsigned q = 0; q < CL; ++q) asm volatile("st.shared::cluster.u16 [%0], %1;" ::"r"(peer_addr(p, q)), "h"(v) : "memory");
}

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
// bytes: a multiple of 16; both addresses 16-byte aligned.
__device__ __forceinline__ void bulk_g2s(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
// Order earlier generic-proxy reads of a slot before the async-proxy refill.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void cp_async8(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_addr(smem)), "l"(gmem) : "memory");
}
__device__ __forceinline__ void red_add_v4(float* p, float a, float b, float c, float d) {
  asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
}
__device__ __forceinline__ unsigned atom_add_acq_rel(unsigned* p, unsigned v) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
__device__ __forceinline__ float ldcg_f(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

// ---- row dot products (router, shared-expert gate, shared-expert gate/up rows) -------

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
          load16(reinterpret_cast<const bf16_t*>(&sm.x[n][k0 + i]), xv);
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
        load16(reinterpret_cast<const bf16_t*>(&sm.x[n][8 * (lane + 32 * j)]), xv);
#pragma unroll
        for (int q = 0; q < 8; ++q) out[n] = fmaf(xv[q], wv[q], out[n]);
      }
    }
#pragma unroll
    for (int n = 0; n < N; ++n) out[n] = warp_sum(out[n]);
  }
};
typedef Pick<MDG_SGB == 16, RowRegsBf16, RowRegs<(MDG_SGB == 16 ? 8 : MDG_SGB)>>::type GateRegs;

// One thread's down row of a shared slice: 32 inputs (16 bytes), one group's scale and bias.
struct SliceDown {
  uint4 w;
  unsigned sb;
  __device__ __forceinline__ void load(const unsigned* W, const bf16_t* S, const bf16_t* B, int d, int s) {
    w = ldg_stream16(W + (size_t)d * DKW + 4 * s);
    const size_t gi = (size_t)d * DKG + s / 2;
    sb = load_sb(S + gi, B + gi);
  }
  // sum_k (s * q_k + b) * h[n][k] for every token
  __device__ __forceinline__ void dot(const gdn_u16 (&h)[N][SR], float* out) const {
    const float s = __uint_as_float(sb << 16), b = __uint_as_float(sb & 0xffff0000u);
    const unsigned ww[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int n = 0; n < N; ++n) out[n] = 0.0f;
#pragma unroll
    for (int k = 0; k < SR; ++k) {
      const float wv = fmaf(s, (float)((ww[k / 8] >> (4 * (k % 8))) & 15u), b);
#pragma unroll
      for (int n = 0; n < N; ++n) out[n] = fmaf(wv, __uint_as_float((unsigned)h[n][k] << 16), out[n]);
    }
  }
};

// ---- a unit's gate + up rows -----------------------------------------------------------

struct GUPtr {
  const unsigned *W0, *W1;
  const bf16_t *S0, *S1, *B0, *B1;
};

// Warp 0: the unit's gate and up rows [row0, +RB) of p into slot `dst`, one
// mbarrier per 16-row half (the first also counts the scales and biases).
__device__ __forceinline__ void issue_unit(unsigned dst, unsigned bar, const GUPtr& p, int row0) {
  const int lane = threadIdx.x & 31;
  if (lane == 0) {
    fence_proxy_async();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) mbar_expect_tx(bar + 8 * mt, 2 * 16 * KW * 4 + (mt == 0 ? 4 * GU_S : 0));
  }
  __syncwarp();
  if (lane < 4) {
    const bf16_t* src = lane == 0 ? p.S0 : lane == 1 ? p.B0 : lane == 2 ? p.S1 : p.B1;
    bulk_g2s(dst + 2 * GU_W + lane * GU_S, src + (size_t)row0 * KG, GU_S, bar);
  }
  for (int q = lane; q < 2 * RB; q += 32) {  // matrix m = q / RB, row r = q % RB
    const int m = q / RB, r = q % RB;
    bulk_g2s(dst + m * GU_W + r * GU_RS, (m ? p.W1 : p.W0) + (size_t)(row0 + r) * KW, KW * 4, bar + 8 * (r / 16));
  }
}

// The unit's gate and up dot products for every token (weights from the
// slot, tile by tile as the halves land); the warps' partial sums meet in
// sm.red and thread (r, n) < RB * N returns h = silu(bf16 g) * bf16 u of row
// r, token n (moe_decode_gemv.cu's order and roundings, per 16-row tile).
__device__ __forceinline__ float gate_up_unit(const unsigned char* slot, unsigned bar, unsigned parity, Smem& sm) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    mbar_wait(bar + 8 * mt, parity);
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
            const int row = 16 * mt + g + 8 * hh;
            A[m][hh] = *reinterpret_cast<const uint4*>(slot + m * GU_W + row * GU_RS + (kb >> 1) + 64 * u + 16 * t);
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
          if (g < N) b_pairs(*reinterpret_cast<const uint4*>(&sm.x[g][kb + 128 * u + 32 * t + 8 * wd]), bb);
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
        if (tok < N) sm.red[warp][m][16 * mt + g + 8 * (c >> 1)][tok] = acc[m][c];
      }
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
  return hv;
}

// ---- a unit's down block (split-K) ------------------------------------------------------

// All threads: the down rows [d0, +DR) of expert matrix W/S/B, inputs [k0, +UR), into the down slot.
__device__ __forceinline__ void issue_down(unsigned char* dsl, const unsigned* W, const bf16_t* S, const bf16_t* B,
                                           int d0, int k0) {
  constexpr int CPR = UR / 32;  // 16-byte chunks per row
  for (int i = threadIdx.x; i < DR * CPR; i += NT) {
    const int r = i / CPR, c = i % CPR;
    cp_async16(dsl + r * DN_RS + 16 * c, W + (size_t)(d0 + r) * DKW + k0 / 8 + 4 * c);
  }
  for (int i = threadIdx.x; i < 2 * DR; i += NT) {
    const int r = i % DR, which = i / DR;
    const bf16_t* src = (which ? B : S) + (size_t)(d0 + r) * DKG + k0 / 64;
    unsigned char* dst = dsl + DN_W + which * DN_S + r * UG * 2;
    if (UG == 4) cp_async8(dst, src);
    else cp_async4(dst, src);
  }
  cp_async_commit();
}

// yl[n][row] += coef[n] * sum_k W[row, k] h[n][k] over the unit's UR inputs, rows by 16-row tiles over the warps.
__device__ __forceinline__ void down_unit(const unsigned char* dsl, const gdn_u16 (&h)[N][UR], const float* coef,
                                          Smem& sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  unsigned bb[NUB][4][4];
#pragma unroll
  for (int ub = 0; ub < NUB; ++ub)
#pragma unroll
    for (int wq = 0; wq < 4; ++wq) {
#pragma unroll
      for (int i = 0; i < 4; ++i) bb[ub][wq][i] = 0u;
      if (g < N) b_pairs(*reinterpret_cast<const uint4*>(&h[g][128 * ub + 32 * t + 8 * wq]), bb[ub][wq]);
    }
  const gdn_u16* scl = reinterpret_cast<const gdn_u16*>(dsl + DN_W);
  const gdn_u16* bis = reinterpret_cast<const gdn_u16*>(dsl + DN_W + DN_S);
  float c0 = 0.0f, c1 = 0.0f;  // the lane's tokens 2t, 2t + 1
#pragma unroll
  for (int n = 0; n < N; ++n) {
    if (n == 2 * t) c0 = coef[n];
    if (n == 2 * t + 1) c1 = coef[n];
  }
#pragma unroll 1
  for (int dt = warp; dt < NDT; dt += NW) {
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int ub = 0; ub < NUB; ++ub) {
      uint4 A[2];
      unsigned s2[2], b2[2];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int row = 16 * dt + g + 8 * hh;
        A[hh] = *reinterpret_cast<const uint4*>(dsl + row * DN_RS + 64 * ub + 16 * t);
        const int gi = row * UG + 2 * ub + (t >> 1);
        const unsigned sb = (unsigned)scl[gi] | ((unsigned)bis[gi] << 16);
        s2[hh] = splat_s(sb);
        b2[hh] = splat_b(sb);
      }
#pragma unroll
      for (int wq = 0; wq < 4; ++wq) mma_word(acc, w4(A[0], wq), w4(A[1], wq), s2[0], b2[0], s2[1], b2[1], bb[ub][wq]);
    }
    const int r0 = 16 * dt + g;
    if (2 * t < N) {
      sm.yl[2 * t][r0] += c0 * acc[0];
      sm.yl[2 * t][r0 + 8] += c0 * acc[2];
    }
    if (2 * t + 1 < N) {
      sm.yl[2 * t + 1][r0] += c1 * acc[1];
      sm.yl[2 * t + 1][r0 + 8] += c1 * acc[3];
    }
  }
}

extern "C" __global__ void __cluster_dims__(CL, 1, 1) __launch_bounds__(NT, 1) KNAME(
    const bf16_t* __restrict__ x,
    const unsigned* __restrict__ rw, const bf16_t* __restrict__ rs, const bf16_t* __restrict__ rbias,
    const unsigned* __restrict__ wg, const bf16_t* __restrict__ sg, const bf16_t* __restrict__ bg,
    const unsigned* __restrict__ wu, const bf16_t* __restrict__ su, const bf16_t* __restrict__ bu,
    const unsigned* __restrict__ wd, const bf16_t* __restrict__ sd, const bf16_t* __restrict__ bd,
    const unsigned* __restrict__ xwg, const bf16_t* __restrict__ xsg, const bf16_t* __restrict__ xbg,
    const unsigned* __restrict__ xwu, const bf16_t* __restrict__ xsu, const bf16_t* __restrict__ xbu,
    const unsigned* __restrict__ xwd, const bf16_t* __restrict__ xsd, const bf16_t* __restrict__ xbd,
    const void* __restrict__ gw, const bf16_t* __restrict__ gs, const bf16_t* __restrict__ gb,
    unsigned* ws,
    bf16_t* __restrict__ y,
    float* __restrict__ logits_out,
    int* __restrict__ inds_out,
    float* __restrict__ scores_out,
    bf16_t* __restrict__ hbuf,
    float* __restrict__ sgate_out
#ifdef MDG_TIMING
    , unsigned long long* tim  // [G, 8] %globaltimer (ns) at the phase points, thread 0
#endif
    ) {
  extern __shared__ __align__(128) unsigned char dsm[];
  Smem& sm = *reinterpret_cast<Smem*>(dsm + OFF_SM);
  const unsigned sbase = smem_addr(dsm);
  const unsigned gu_bar = sbase + OFF_BAR;
#ifdef MDG_TIMING
#define STAMP(i) \
  if (threadIdx.x == 0) { unsigned long long t_; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_)); tim[blockIdx.x * 8 + (i)] = t_; }
#else
#define STAMP(i)
#endif
  STAMP(0);
  {
    unsigned dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (dyn < SMEM_BYTES) __trap();  // launched with too little dynamic shared memory
  }
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int rank = (int)cluster_rank(), cid = (int)cluster_id(), ncl = (int)cluster_count();
  const int gwarp = rank * NW + warp;  // the warp's index in the cluster
  float* acc_g = reinterpret_cast<float*>(ws + WS_ACC);
  cluster_arrive();  // paired with the wait before the first push: every CTA of the cluster has started

  if (tid == 0) {
#pragma unroll 1
    for (int i = 0; i < GUS * MT; ++i) mbar_init(gu_bar + 8 * i, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }

  // ======================= phase A ===========================================
  // loads first: router rows, the gate row, the first shared slice's rows
  RowRegs<MDG_RBITS> rr[RPW];
#pragma unroll
  for (int i = 0; i < RPW; ++i) {
    const int r = gwarp + CL * NW * i;
    if (r < E) rr[i].load(rw, rs, rbias, r);
  }
  const bool has_gate = gwarp == E % (CL * NW);
  GateRegs gr;
  if (has_gate) gr.load(gw, gs, gb, 0);
  const int s0 = cid;  // this cluster's slices: s0, s0 + ncl, ...
  RowRegs<4> srow;
  SliceDown sdn[(DR + NT - 1) / NT];
  const int srow_i = 4 * rank + (warp & 3);  // this warp's row in a slice
  auto load_slice = [&](int s) {
    if (warp < 4) srow.load(xwg, xsg, xbg, s * SR + srow_i);
    else srow.load(xwu, xsu, xbu, s * SR + srow_i);
#pragma unroll
    for (int j = 0; j < (DR + NT - 1) / NT; ++j)
      if (tid + NT * j < DR) sdn[j].load(xwd, xsd, xbd, rank * DR + tid + NT * j, s);
  };
  if (s0 < NSL) load_slice(s0);
  for (int i = tid; i < N * D / 8; i += NT)
    *reinterpret_cast<uint4*>(&sm.x[0][0] + 8 * i) = ldg16(x + 8 * i);
  for (int i = tid; i < N * DR; i += NT) (&sm.yl[0][0])[i] = 0.0f;
  __syncthreads();  // x staged; the mbarriers initialised
  STAMP(1);
  cluster_wait();   // every CTA of the cluster runs: pushes may start

#pragma unroll
  for (int i = 0; i < RPW; ++i) {
    const int r = gwarp + CL * NW * i;
    if (r < E) {
      float out[N];
      rr[i].dot(sm, out);
#pragma unroll
      for (int n = 0; n < N; ++n)
        if (lane == n) push_f32(&sm.lg[n][r], from_f_round<bf16_t>(out[n]));
    }
  }
  if (has_gate) {
    float out[N];
    gr.dot(sm, out);
#pragma unroll
    for (int n = 0; n < N; ++n)
      if (lane == n) push_f32(&sm.sg[n], sigmoid_f(from_f_round<bf16_t>(out[n])));
  }
  STAMP(2);

  // the cluster's shared-expert slices (each ends with a cluster barrier; the
  // first also publishes the logits)
  int si = 0;
#pragma unroll 1
  for (int s = s0; s < NSL; s += ncl, ++si) {
    if (si > 0) load_slice(s);
    float out[N];
    srow.dot(sm, out);
#pragma unroll
    for (int n = 0; n < N; ++n)
      if (lane == n) sm.gus[warp >> 2][warp & 3][n] = out[n];
    __syncthreads();
    if (tid < 4 * N) {
      const int r = tid & 3, n = tid >> 2;
      const float gt = from_f_round<bf16_t>(sm.gus[0][r][n]), up = from_f_round<bf16_t>(sm.gus[1][r][n]);
      const bf16_t hb = from_f<bf16_t>(silu_f(gt) * up);
      const gdn_u16 hu = *reinterpret_cast<const gdn_u16*>(&hb);
      push_u16(&sm.hs[si & 1][n][4 * rank + r], hu);
      hbuf[(size_t)(NK + n) * I + s * SR + 4 * rank + r] = hb;
    }
    cluster_sync();
    float sgv[N];
#pragma unroll
    for (int n = 0; n < N; ++n) sgv[n] = sm.sg[n];
#pragma unroll
    for (int j = 0; j < (DR + NT - 1) / NT; ++j)
      if (tid + NT * j < DR) {
        float o[N];
        sdn[j].dot(sm.hs[si & 1], o);
#pragma unroll
        for (int n = 0; n < N; ++n) sm.yl[n][tid + NT * j] += sgv[n] * o[n];
      }
  }
  if (si == 0) cluster_sync();  // no slice: the logits still need the barrier
  STAMP(3);

  // ======================= phase B ===========================================
  if (warp < N) {
    float p[E / 32];
#pragma unroll
    for (int i = 0; i < E / 32; ++i) p[i] = sm.lg[warp][i * 32 + lane];
    int my_i;
    float my_p, tot;
    route_warp<E, TOPK>(p, my_i, my_p, tot);
    if (lane < TOPK) {
      const float sc = MDG_NORM ? my_p / tot : my_p;
      sm.inds[warp * TOPK + lane] = my_i;
      sm.scores[warp * TOPK + lane] = sc;
      if (blockIdx.x == 0) {
        inds_out[warp * TOPK + lane] = my_i;
        scores_out[warp * TOPK + lane] = sc;
      }
    }
  }
  __syncthreads();
  if (warp == 0) {
    // distinct experts in order of first appearance
    const int my_e = lane < NK ? sm.inds[lane] : -1;
    bool first = lane < NK;
    for (int q = 0; q < NK; ++q) {
      const int eq = __shfl_sync(0xffffffffu, my_e, q);
      if (q < lane && eq == my_e) first = false;
    }
    const unsigned fmask = __ballot_sync(0xffffffffu, first);
    if (first) sm.items[__popc(fmask & ((1u << lane) - 1u))] = my_e;
    if (lane == 0) sm.nitems = __popc(fmask);
  }
  __syncthreads();
  const int nunits = sm.nitems * UPE;
  const int nmine = cid < nunits ? (nunits - 1 - cid) / ncl + 1 : 0;  // units cid, cid + ncl, ...
  auto unit_gu = [&](int j, GUPtr& p) {  // j-th unit of this cluster -> pointers, first gate/up row
    const int u = cid + j * ncl;
    const int e = sm.items[u / UPE];
    const size_t ow = (size_t)e * I * KW, og = (size_t)e * I * KG;
    p = GUPtr{wg + ow, wu + ow, sg + og, su + og, bg + og, bu + og};
    return (u % UPE) * UR + rank * RB;
  };
  auto unit_down = [&](int j) {
    const int u = cid + j * ncl;
    const size_t e = (size_t)sm.items[u / UPE];
    issue_down(dsm + OFF_DN, wd + e * D * DKW, sd + e * D * DKG, bd + e * D * DKG, rank * DR, (u % UPE) * UR);
  };
  if (warp == 0) {
#pragma unroll 1
    for (int j = 0; j < nmine && j < GUS; ++j) {
      GUPtr p;
      const int row0 = unit_gu(j, p);
      issue_unit(sbase + j * GU_SLOT, gu_bar + 8 * MT * j, p, row0);
    }
  }
  if (nmine > 0) unit_down(0);
  if (blockIdx.x == 0) {
    for (int i = tid; i < N * E; i += NT) logits_out[i] = (&sm.lg[0][0])[i];
    if (tid < N) sgate_out[tid] = sm.sg[tid];
  }
  STAMP(4);

#pragma unroll 1
  for (int j = 0; j < nmine; ++j) {
    const int u = cid + j * ncl;
    const int e = sm.items[u / UPE], hf = u % UPE;
    const float hv = gate_up_unit(dsm + (j % GUS) * GU_SLOT, gu_bar + 8 * MT * (j % GUS), (j / GUS) & 1, sm);
    if (tid < RB * N) {
      const int r = tid % RB, n = tid / RB;
      const bf16_t hb = from_f<bf16_t>(hv);
      push_u16(&sm.hb[j & 1][n][rank * RB + r], *reinterpret_cast<const gdn_u16*>(&hb));
#pragma unroll
      for (int q = 0; q < TOPK; ++q)
        if (sm.inds[n * TOPK + q] == e) hbuf[(size_t)(n * TOPK + q) * I + hf * UR + rank * RB + r] = hb;
    }
    __syncthreads();  // the slot and sm.red are free again
    if (warp == 0 && j + GUS < nmine) {
      GUPtr p;
      const int row0 = unit_gu(j + GUS, p);
      issue_unit(sbase + (j % GUS) * GU_SLOT, gu_bar + 8 * MT * (j % GUS), p, row0);
    }
    cluster_sync();  // the unit's h in every CTA
    if (j == 0) STAMP(5);
    float coef[N];
#pragma unroll
    for (int n = 0; n < N; ++n) {
      coef[n] = 0.0f;
#pragma unroll
      for (int q = 0; q < TOPK; ++q)
        if (sm.inds[n * TOPK + q] == e) coef[n] += sm.scores[n * TOPK + q];
    }
    cp_async_wait_all();
    __syncthreads();  // the down slot landed (every thread's copies)
    down_unit(dsm + OFF_DN, sm.hb[j & 1], coef, sm);
    __syncthreads();  // the down slot is read
    if (j + 1 < nmine) unit_down(j + 1);
  }
  STAMP(6);

  // ======================= phase C ===========================================
  __syncthreads();  // yl complete
  for (int i = tid; i < N * DR / 4; i += NT) {
    const int n = i / (DR / 4), c = 4 * (i % (DR / 4));
    red_add_v4(acc_g + (size_t)n * D + rank * DR + c, sm.yl[n][c], sm.yl[n][c + 1], sm.yl[n][c + 2], sm.yl[n][c + 3]);
  }
  __syncthreads();
  if (tid == 0) sm.last = atom_add_acq_rel(ws + rank, 1u) == (unsigned)(ncl - 1);
  __syncthreads();
  if (sm.last) {
    for (int i = tid; i < N * DR; i += NT) {
      const int n = i / DR, c = i % DR;
      float* a = acc_g + (size_t)n * D + rank * DR + c;
      y[(size_t)n * D + rank * DR + c] = from_f<bf16_t>(ldcg_f(a));
      *a = 0.0f;
    }
    if (tid == 0) ws[rank] = 0u;
  }
  STAMP(7);
}
