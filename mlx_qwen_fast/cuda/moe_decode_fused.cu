// The whole decode MoE block (N <= 4 tokens) in one launch: router GEMV,
// softmax + top-k, gate + up + SwiGLU of the selected and the shared experts,
// down + routing weights + shared-expert gate + combine.
//
// One persistent grid of G CTAs (G <= the number of SMs, so that every CTA is
// resident at once) runs three phases separated by two grid-wide barriers
// (a counter and a generation word in `sync`, a persistent uint32[64] buffer
// that starts at zero and that every launch leaves with count 0; 256 bytes,
// so that MLX's allocator gives it device memory, not its managed pool for
// allocations of <= 8 bytes, where the barrier's atomics crawl):
//
//   A  router logits (one warp per expert row, the row's weights loaded while
//      x is staged in shared memory; logit = bf16(fp32 dot), as the router's
//      bf16 quantised matmul); the shared-expert gate's logit (the same dot on
//      row "E"): sgate = sigmoid(bf16(x . w)); the shared expert's gate + up
//      (it does not depend on the routing). CTAs [0, RC) take the router rows,
//      the last I/16 CTAs the shared expert's row tiles.
//   -- barrier 1 --
//   B  every CTA reads the N x E logits back (L2) and routes each token with
//      one warp (route_warp: the routing kernel's own softmax and top-k, so
//      the selection is the same as moe_routing.route on these logits); the
//      distinct experts in order of first appearance are the items. Each CTA
//      issues L2 bulk prefetches (cp.async.bulk.prefetch) of its phase-C down
//      rows of every item and of its later gate+up tiles, then computes its
//      gate + up tiles (item, 16 rows) u = c, c + G, ... with the next tile's
//      weights loaded while the current one is multiplied; h rows go to global
//      memory. Before barrier 2 each warp loads its first two down items into
//      registers (the down weights do not depend on h).
//   -- barrier 2 --
//   C  CTA c < D/16: output rows [16c, +16) of y: h staged in shared memory,
//      the down GEMVs of every item, coef * bf16(out) summed in fp32 in a
//      fixed order (deterministic, no atomics), stored as bf16.
//
// The gate+up and down tile arithmetic is that of moe_decode_gemv.cu (same
// dequantisation, mma.sync m16n8k16 with permuted k order, same roundings and
// summation order per tile), so y equals the two-kernel path's given the same
// inds and scores. Reads of data written by other CTAs in this launch (logits,
// h, sgate) use ld.global.cg (L2); the barriers fence at GPU scope.
//
// A CTA that waits on a barrier for ~1 s (a grid that is not resident at once)
// traps: the launch fails instead of hanging.
//
// inputs: x [N, D] bf16; rw, rs, rb (router: uint32 [E, D*RBITS/32], bf16
//   [E, D/64] x2); wg, sg, bg, wu, su, bu ([E, I, D/8], [E, I, D/64]); wd, sd,
//   bd ([E, D, I/8], [E, D, I/64]); xwg, xsg, xbg, xwu, xsu, xbu, xwd, xsd, xbd
//   (shared expert, the same without E); gw, gs, gb (shared-expert gate, as in
//   moe_decode_gemv.cu, MDG_SGB 4/8/16); sync uint32 [64] (written).
// outputs: y [N, D] bf16; logits [N, E] float (bf16 values); inds [N, K]
//   int32; scores [N, K] float; h [N*K + N, I] bf16 (scratch); sgate [N] float.
// Launch: G * 256 threads, 256 per CTA, G <= number of SMs.
//
// Build macros: KNAME, MDG_N (1..4), MDG_K, MDG_E (multiple of 32, <= 1024),
// MDG_D (% 256), MDG_I (% 128), MDG_RBITS (4, 8), MDG_SGB (4, 8, 16),
// MDG_NORM (1: scores renormalised over the K selected).
#include "moe_decode_common.cuh"
#include "moe_route_common.cuh"

#ifndef MDG_N
#define MDG_N 1
#endif
#ifndef MDG_K
#define MDG_K 8
#endif
#ifndef MDG_E
#define MDG_E 256
#endif
#ifndef MDG_D
#define MDG_D 2048
#endif
#ifndef MDG_I
#define MDG_I 512
#endif
#ifndef MDG_RBITS
#define MDG_RBITS 8
#endif
#ifndef MDG_SGB
#define MDG_SGB 8
#endif
#ifndef MDG_NORM
#define MDG_NORM 1
#endif
#ifndef MDG_PREFETCH
#define MDG_PREFETCH 1  // 0: no L2 bulk prefetches (measurement builds)
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
constexpr int CPW = (NCH + NW - 1) / NW;   // chunks per warp
constexpr int NU = I / 128;                // down: 16-byte words per lane per row
constexpr int UT = I / RB;                 // gate/up tiles per expert
static_assert(N >= 1 && N <= 4, "1 <= N <= 4 tokens");
static_assert(NK <= 32, "N * top_k must fit one warp");
static_assert(D % 256 == 0 && I % 128 == 0, "D % 256 == 0 and I % 128 == 0");
static_assert(E % 32 == 0 && E <= 1024, "E must be a multiple of 32, <= 1024");
static_assert(MDG_RBITS == 4 || MDG_RBITS == 8, "router bits 4 or 8");
static_assert(2 * (N * D > HROWS * I ? N * D : HROWS * I) + 4 * 2 * NW * RB * N + 8 * 33 <= 46 * 1024,
              "tokens / h rows over the 48 KB static shared-memory limit");

// ---- grid barrier ----------------------------------------------------------------

__device__ __forceinline__ unsigned ld_acquire_u32(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// All G CTAs meet; writes before it (any thread) are visible after it.
// sync[0] counts arrivals, sync[GEN] (another 128-byte line) is the
// generation; the last arrival resets the count, then bumps the generation.
constexpr int GEN = 32;
__device__ void grid_barrier(unsigned* sync) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned gen = ld_acquire_u32(sync + GEN);
    __threadfence();
    const unsigned arrived = atomicAdd(sync, 1u);
    if (arrived == gridDim.x - 1) {
      atomicExch(sync, 0u);
      __threadfence();
      atomicAdd(sync + GEN, 1u);
    } else {
      unsigned spins = 0;
      while (ld_acquire_u32(sync + GEN) == gen) {
        if (++spins > 4096u) sleep_ns(256);
        if (spins > (1u << 22)) __trap();  // ~1 s: the grid is not co-resident
      }
    }
    __threadfence();
  }
  __syncthreads();
}

// ---- L2-coherent loads and bulk L2 prefetch ----------------------------------------

__device__ __forceinline__ float ldcg_f(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ uint4 ldcg16(const void* p) {
  uint4 r;
  asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}
// bytes: a multiple of 16, p 16-byte aligned.
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
  if (MDG_PREFETCH) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// ---- shared memory ----------------------------------------------------------------

struct Smem {
  union {
    gdn_u16 x[N][D];          // phases A, B: the tokens
    gdn_u16 h[HROWS][I];      // phase C: every h row
  } u;
  float red[NW][2][RB][N];    // warp partial sums
  int inds[NK];
  float scores[NK];
  int items[NK + 1];          // distinct routed experts, then -1 (shared)
  int nitems;
};

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
          const uint4 v = *reinterpret_cast<const uint4*>(&sm.u.x[n][k0 + i]);
          unpack_bf16x2(v.x, xv[0], xv[1]);
          unpack_bf16x2(v.y, xv[2], xv[3]);
          unpack_bf16x2(v.z, xv[4], xv[5]);
          unpack_bf16x2(v.w, xv[6], xv[7]);
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
        const uint4 v = *reinterpret_cast<const uint4*>(&sm.u.x[n][8 * (lane + 32 * j)]);
        unpack_bf16x2(v.x, xv[0], xv[1]);
        unpack_bf16x2(v.y, xv[2], xv[3]);
        unpack_bf16x2(v.z, xv[4], xv[5]);
        unpack_bf16x2(v.w, xv[6], xv[7]);
#pragma unroll
        for (int q = 0; q < 8; ++q) out[n] = fmaf(xv[q], wv[q], out[n]);
      }
    }
#pragma unroll
    for (int n = 0; n < N; ++n) out[n] = warp_sum(out[n]);
  }
};
typedef Pick<MDG_SGB == 16, RowRegsBf16, RowRegs<(MDG_SGB == 16 ? 8 : MDG_SGB)>>::type GateRegs;

// ---- gate + up tile (16 rows of both matrices, one expert) ------------------------

struct GUPtr {
  const unsigned *W0, *W1;
  const bf16_t *S0, *S1, *B0, *B1;
};

struct GURegs {
  uint4 A[CPW][2][2][2];     // [chunk][mat][row g / g+8][u]
  unsigned sb[CPW][2][2][2];
  __device__ __forceinline__ void load(const GUPtr& p, int row0) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int cc = 0; cc < CPW; ++cc) {
      const int ch = warp + NW * cc;
      if (ch >= NCH) break;
      const int kb = ch * 256;
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const size_t row = (size_t)(row0 + g + 8 * hh);
          const unsigned* Wm = m ? p.W1 : p.W0;
          const bf16_t* Sm = m ? p.S1 : p.S0;
          const bf16_t* Bm = m ? p.B1 : p.B0;
#pragma unroll
          for (int u = 0; u < 2; ++u) {
            A[cc][m][hh][u] = ldg_stream16(Wm + row * KW + (kb >> 3) + 16 * u + 4 * t);
            const size_t gi = row * KG + (kb >> 6) + 2 * u + (t >> 1);
            sb[cc][m][hh][u] = load_sb(Sm + gi, Bm + gi);
          }
        }
    }
  }
};

// The tile's gate and up dot products for every token; the warps' partial sums
// meet in sm.red and thread (r, n) < RB * N gets h = bf16(silu(bf16 g) * bf16 u)
// of row r, token n (moe_decode_gemv.cu's order and roundings).
__device__ __forceinline__ float gate_up_tile(const GURegs& R, Smem& sm) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  float acc[2][4];
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[m][c] = 0.0f;
#pragma unroll
  for (int cc = 0; cc < CPW; ++cc) {
    const int ch = warp + NW * cc;
    if (ch >= NCH) break;
    const int kb = ch * 256;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      unsigned s2[2][2], b2[2][2];
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          s2[m][hh] = splat_s(R.sb[cc][m][hh][u]);
          b2[m][hh] = splat_b(R.sb[cc][m][hh][u]);
        }
#pragma unroll
      for (int wd = 0; wd < 4; ++wd) {
        unsigned bb[4] = {0u, 0u, 0u, 0u};
        if (g < N) b_pairs(*reinterpret_cast<const uint4*>(&sm.u.x[g][kb + 128 * u + 32 * t + 8 * wd]), bb);
#pragma unroll
        for (int m = 0; m < 2; ++m)
          mma_word(acc[m], w4(R.A[cc][m][0][u], wd), w4(R.A[cc][m][1][u], wd), s2[m][0], b2[m][0],
                   s2[m][1], b2[m][1], bb);
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
  __syncthreads();  // sm.red is reused by the next tile
  return hv;
}

// ---- down tile (16 output rows, one item) -------------------------------------------

struct DownRegs {
  uint4 A[2][NU];
  unsigned sb[2][NU];
  __device__ __forceinline__ void load(const unsigned* W, const bf16_t* S, const bf16_t* B, int row0) {
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const size_t row = (size_t)(row0 + g + 8 * hh);
#pragma unroll
      for (int u = 0; u < NU; ++u) {
        A[hh][u] = ldg_stream16(W + row * DKW + 16 * u + 4 * t);
        const size_t gi = row * DKG + 2 * u + (t >> 1);
        sb[hh][u] = load_sb(S + gi, B + gi);
      }
    }
  }
};

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
#ifdef MDG_TIMING
    , unsigned long long* tim  // [G, 8] %globaltimer (ns) at the phase points, thread 0
#endif
    ) {
  __shared__ __align__(16) Smem sm;
#ifdef MDG_TIMING
#define STAMP(i) \
  if (threadIdx.x == 0) { unsigned long long t_; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_)); tim[blockIdx.x * 8 + (i)] = t_; }
#else
#define STAMP(i)
#endif
  STAMP(0);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int c = blockIdx.x, G = gridDim.x;
  constexpr int SU = I / RB;  // shared-expert gate+up tiles
  // CTAs [0, RC): router rows (E of them, + row E = the shared gate); the last
  // SU CTAs: the shared expert's tiles (everything on every CTA when G is small)
  const int RC = G >= 2 * SU ? G - SU : G;

  // ======================= phase A ===========================================
  {
    // router / shared-gate row of this warp: loads first
    const int r0 = c < RC ? c + RC * warp : E + 1;
    RowRegs<MDG_RBITS> rr;
    GateRegs gr;
    if (r0 < E) rr.load(rw, rs, rbias, r0);
    else if (r0 == E) gr.load(gw, gs, gb, 0);
    // the shared expert's first tile
    const int s0 = G - 1 - c;
    GURegs sr;
    const GUPtr sp{xwg, xwu, xsg, xsu, xbg, xbu};
    const bool sh = G >= 2 * SU ? s0 < SU : true;
    const int sfirst = G >= 2 * SU ? s0 : c;
    if (sh && sfirst < SU) sr.load(sp, sfirst * RB);
    // this CTA's shared-expert down rows (phase C) into L2
    if (tid == 0) {
      for (int rb = c; rb < D / RB; rb += G) {
        prefetch_l2(xwd + (size_t)rb * RB * DKW, RB * DKW * 4);
        prefetch_l2(xsd + (size_t)rb * RB * DKG, RB * DKG * 2);
        prefetch_l2(xbd + (size_t)rb * RB * DKG, RB * DKG * 2);
      }
    }
    for (int i = tid; i < N * D / 8; i += NT)
      *reinterpret_cast<uint4*>(&sm.u.x[0][0] + 8 * i) = ldg16(x + 8 * i);
    __syncthreads();
    STAMP(1);
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
    if (sh) {
      for (int s = sfirst; s < SU; s += G) {
        if (s != sfirst) sr.load(sp, s * RB);
        const float hv = gate_up_tile(sr, sm);
        if (tid < RB * N) {
          const int r = tid % RB, n = tid / RB;
          hbuf[(size_t)(NK + n) * I + s * RB + r] = from_f<bf16_t>(hv);
        }
      }
    }
  }
  STAMP(2);
  grid_barrier(sync);
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
  auto tile_ptr = [&](int u) -> GUPtr {
    const int e = sm.items[u / UT];
    const size_t ow = (size_t)e * I * KW, og = (size_t)e * I * KG;
    return GUPtr{wg + ow, wu + ow, sg + og, su + og, bg + og, bu + og};
  };
  if (tid == 0) {
    // phase C's down rows of every routed item, then the gate+up tiles after the first two
    for (int rb = c; rb < D / RB; rb += G)
      for (int it = 0; it < nrouted; ++it) {
        const size_t e = (size_t)sm.items[it];
        prefetch_l2(wd + (e * D + (size_t)rb * RB) * DKW, RB * DKW * 4);
        prefetch_l2(sd + (e * D + (size_t)rb * RB) * DKG, RB * DKG * 2);
        prefetch_l2(bd + (e * D + (size_t)rb * RB) * DKG, RB * DKG * 2);
      }
    for (int u = c + 2 * G; u < ntiles; u += G) {
      const GUPtr p = tile_ptr(u);
      const size_t r0 = (size_t)(u % UT) * RB;
      prefetch_l2(p.W0 + r0 * KW, RB * KW * 4);
      prefetch_l2(p.W1 + r0 * KW, RB * KW * 4);
      prefetch_l2(p.S0 + r0 * KG, RB * KG * 2);
      prefetch_l2(p.S1 + r0 * KG, RB * KG * 2);
      prefetch_l2(p.B0 + r0 * KG, RB * KG * 2);
      prefetch_l2(p.B1 + r0 * KG, RB * KG * 2);
    }
  }
  {
    GURegs ra, rb_;
    int u = c;
    if (u < ntiles) ra.load(tile_ptr(u), (u % UT) * RB);
    while (u < ntiles) {
      if (u + G < ntiles) rb_.load(tile_ptr(u + G), ((u + G) % UT) * RB);
      {
        const int e = sm.items[u / UT], row0 = (u % UT) * RB;
        const float hv = gate_up_tile(ra, sm);
        if (tid < RB * N) {
          const int r = tid % RB, n = tid / RB;
          const bf16_t hb = from_f<bf16_t>(hv);
#pragma unroll
          for (int j = 0; j < TOPK; ++j)
            if (sm.inds[n * TOPK + j] == e) hbuf[(size_t)(n * TOPK + j) * I + row0 + r] = hb;
        }
      }
      u += G;
      if (u >= ntiles) break;
      if (u + G < ntiles) ra.load(tile_ptr(u + G), ((u + G) % UT) * RB);
      {
        const int e = sm.items[u / UT], row0 = (u % UT) * RB;
        const float hv = gate_up_tile(rb_, sm);
        if (tid < RB * N) {
          const int r = tid % RB, n = tid / RB;
          const bf16_t hb = from_f<bf16_t>(hv);
#pragma unroll
          for (int j = 0; j < TOPK; ++j)
            if (sm.inds[n * TOPK + j] == e) hbuf[(size_t)(n * TOPK + j) * I + row0 + r] = hb;
        }
      }
      u += G;
    }
  }

  // ======================= phase C (weights first, then barrier 2) ==============
  auto item_ptrs = [&](int it, const unsigned*& W, const bf16_t*& S, const bf16_t*& B) {
    const int e = sm.items[it];
    if (e < 0) {
      W = xwd; S = xsd; B = xbd;
    } else {
      W = wd + (size_t)e * D * DKW; S = sd + (size_t)e * D * DKG; B = bd + (size_t)e * D * DKG;
    }
  };
  STAMP(5);
  DownRegs RA, RB2;
  const unsigned* W;
  const bf16_t *S, *B;
  int rbk = c;
  if (rbk < D / RB) {
    if (warp < nitems) { item_ptrs(warp, W, S, B); RA.load(W, S, B, rbk * RB); }
    if (warp + NW < nitems) { item_ptrs(warp + NW, W, S, B); RB2.load(W, S, B, rbk * RB); }
  }
  grid_barrier(sync);
  STAMP(6);
  if (rbk >= D / RB) return;
  const int g = lane >> 2, t = lane & 3;
  for (int i = tid; i < HROWS * I / 8; i += NT) cp_async16(&sm.u.h[0][0] + 8 * i, hbuf + 8 * i);  // L2, all in flight
  cp_async_commit();
  cp_async_wait_all();
  float sgv[N];
#pragma unroll
  for (int n = 0; n < N; ++n) sgv[n] = ldcg_f(sgate + n);
  __syncthreads();

  for (; rbk < D / RB; rbk += G) {
    const int row0 = rbk * RB;
    if (rbk != c) {  // a further row block (G < D / 16): its first items now
      if (warp < nitems) { item_ptrs(warp, W, S, B); RA.load(W, S, B, row0); }
      if (warp + NW < nitems) { item_ptrs(warp + NW, W, S, B); RB2.load(W, S, B, row0); }
    }
    float yacc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    auto compute_item = [&](const DownRegs& R, int it) {
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
          for (int j = 0; j < TOPK; ++j)
            if (sm.inds[n * TOPK + j] == e) {
              if (p < 0) p = n * TOPK + j;
              sc += sm.scores[n * TOPK + j];
            }
        }
        if (p >= 0) {
          if (g == n) hrow = p;
          if (2 * t == n) cf0 = sc;
          if (2 * t + 1 == n) cf1 = sc;
        }
      }
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int u = 0; u < NU; ++u) {
        const unsigned s0 = splat_s(R.sb[0][u]), b0 = splat_b(R.sb[0][u]);
        const unsigned s1 = splat_s(R.sb[1][u]), b1 = splat_b(R.sb[1][u]);
#pragma unroll
        for (int wq = 0; wq < 4; ++wq) {
          unsigned bb[4] = {0u, 0u, 0u, 0u};
          if (hrow >= 0) b_pairs(*reinterpret_cast<const uint4*>(&sm.u.h[hrow][128 * u + 32 * t + 8 * wq]), bb);
          mma_word(acc, w4(R.A[0][u], wq), w4(R.A[1][u], wq), s0, b0, s1, b1, bb);
        }
      }
      yacc[0] += from_f_round<bf16_t>(acc[0]) * cf0;
      yacc[1] += from_f_round<bf16_t>(acc[1]) * cf1;
      yacc[2] += from_f_round<bf16_t>(acc[2]) * cf0;
      yacc[3] += from_f_round<bf16_t>(acc[3]) * cf1;
    };
    int it = warp;
    while (it < nitems) {
      compute_item(RA, it);
      if (it + 2 * NW < nitems) { item_ptrs(it + 2 * NW, W, S, B); RA.load(W, S, B, row0); }
      if (it + NW >= nitems) break;
      compute_item(RB2, it + NW);
      if (it + 3 * NW < nitems) { item_ptrs(it + 3 * NW, W, S, B); RB2.load(W, S, B, row0); }
      it += 2 * NW;
    }
#pragma unroll
    for (int cc = 0; cc < 4; ++cc) {
      const int tok = 2 * t + (cc & 1);
      if (tok < N) sm.red[warp][0][g + 8 * (cc >> 1)][tok] = yacc[cc];
    }
    __syncthreads();
    if (tid < RB * N) {
      const int r = tid % RB, n = tid / RB;
      float v = 0.0f;
#pragma unroll
      for (int w = 0; w < NW; ++w) v += sm.red[w][0][r][n];
      y[(size_t)n * D + row0 + r] = from_f<bf16_t>(v);
    }
    __syncthreads();
  }
  STAMP(7);
}
