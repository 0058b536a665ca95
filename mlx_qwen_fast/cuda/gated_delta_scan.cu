// Gated DeltaNet prefill scan, register-resident state.
//
// Recurrence (per batch b, value head h, token t; Dk = Dv = 128; key head
// hk = h / (HV / HK), so q and k are shared by HV/HK value heads, never copied):
//   S   <- g_t * S                       S: [Dv, Dk] fp32
//   kv  =  S k_t                         [Dv]
//   d   =  beta_t * (v_t - kv)
//   S   <- S + d k_t^T
//   y_t =  S q_t
// Evaluated as (one reduction phase per token instead of two dependent ones):
//   sk = S_old k_t, sq = S_old q_t       (both dots read the old state)
//   d  = beta_t * (v_t - g_t sk)
//   y_t = g_t sq + d (k_t . q_t)
//   S  <- g_t S_old + d k_t^T
// k_t . q_t is computed once per token and block, off the critical path (per
// stage, 8 tokens per warp).
//
// Layout: a block owns RB consecutive value rows of one (b, h) and keeps them in
// registers for the whole call: L consecutive lanes share one row (each holds
// E = 128 / L columns, in 16-byte chunks interleaved across the L lanes so the
// shared-memory reads are conflict-free) and each lane holds R rows. The two
// dots of a row are summed over its L lanes with xor shuffles. q, k, v, g and
// beta of TB tokens are staged in shared memory with cp.async (double
// buffered: the next stage loads while this one computes); y goes through a
// shared tile and leaves in 16-byte stores.
//
// Token blocking (GDN_U > 1): the dots of U consecutive tokens are all taken
// against the state at the start of the group (2U independent dots per row, one
// batched shuffle phase instead of U dependent ones); a short scalar recurrence
// per row then recovers the exact per-token values from the decayed Gram
// entries k_i.k_j and k_i.q_j (computed once per group and block):
//   s_j . k_j = G_j a_j + sum_{i<j} c_ij d_i (k_i . k_j),   a_j = s_0 . k_j
//   s_j . q_j = G_j b_j + sum_{i<j} c_ij d_i (k_i . q_j),   b_j = s_0 . q_j
//   d_j = beta_j (v_j - g_j s_j.k_j),  y_j = g_j s_j.q_j + d_j (k_j . q_j)
//   s_U = G_U s_0 + sum_i c_iU d_i k_i
// with G_j = g_0..g_{j-1} and c_ij = g_{i+1}..g_{j-1} (no divisions). The state
// update costs 1 + U FMAs per element per U tokens instead of 2 per token.
// Padding tokens of the last group (past T) are identities (g = 1, beta = 0,
// k = q = 0).
//
// Variants (build macros):
//   GDN_KQF32 (0/1): convert the staged k and q rows to fp32 in shared memory
//     once per stage instead of in every lane and token.
//   GDN_U (1, 2, 4): tokens per group, as above.
// Build macros: KNAME, GDN_X (bf16_t | f16_t | float), GDN_HV, GDN_HK, GDN_L,
// GDN_R, GDN_NW (warps per block), GDN_TB (tokens per stage, a multiple of 4
// and of GDN_U; of 8 when GDN_U == 1), GDN_KQF32, GDN_U.
// Launch: grid = B * HV * (128 / RB) blocks of GDN_NW * 32 threads,
// dynamic shared memory = smem_bytes of kernels/gated_delta_scan.py.
// Parameters: inputs q, k, v, g, beta, state_in; outputs y, state_out; int T.
#include "gdn_common.cuh"

#ifndef GDN_KQF32
#define GDN_KQF32 0
#endif
#ifndef GDN_U
#define GDN_U 1
#endif

typedef GDN_X xt;

namespace {
constexpr int D = 128;
constexpr int HV = GDN_HV;
constexpr int HK = GDN_HK;
constexpr int GQA = HV / HK;
constexpr int L = GDN_L;
constexpr int R = GDN_R;
constexpr int NW = GDN_NW;
constexpr int TB = GDN_TB;
constexpr int NT = NW * 32;
constexpr int RG = 32 / L;        // row groups per warp
constexpr int RPW = RG * R;       // rows per warp
constexpr int RB = NW * RPW;      // rows per block
constexpr int U = GDN_U;          // tokens per group
// fp32 copies of the staged k/q rows (zero rows past the last token).
constexpr bool KQF = GDN_KQF32 && sizeof(xt) != 4;
typedef typename Pick<KQF, float, xt>::type kt;     // k/q element type read by the lanes
constexpr int CH = Vec16<kt>::N;  // elements per 16-byte chunk read by a lane
constexpr int XCH = Vec16<xt>::N; // elements per 16-byte chunk of the inputs
constexpr int E = D / L;          // columns per lane
constexpr int NCH = E / CH;       // chunks per lane and row
constexpr int BPH = D / RB;       // blocks per value head
static_assert(HV % HK == 0, "HV must be a multiple of HK");
static_assert(32 % L == 0 && L >= 1, "L must divide 32");
static_assert(E % CH == 0, "each lane must own whole 16-byte chunks");
static_assert(D % RB == 0, "a block must stay inside one value head");
static_assert(RB % XCH == 0, "v/y tile rows must be whole 16-byte chunks");
static_assert(NT >= TB, "one thread per token for the gate copies");
static_assert(TB % U == 0 && TB % 4 == 0, "TB must be a multiple of 4 and of U");
static_assert(U != 1 || TB % 8 == 0, "U == 1 needs TB a multiple of 8 (k.q of 8 tokens per warp)");
static_assert(U == 1 || U == 2 || U == 4, "U must be 1, 2 or 4");
constexpr int NG = TB / U;                       // groups per stage
constexpr int NDOT = U * (U - 1) / 2 + U * (U + 1) / 2;  // KK (i<j) + KQ (i<=j)
static_assert(NDOT <= 16, "the Gram pass reduces at most 16 dots per group");
constexpr int GSTR = 16;                         // floats per group in gram[]

// State column held by lane j for its element e.
__device__ __forceinline__ int col_of(int j, int e) {
  return ((e / CH) * L + j) * CH + (e % CH);
}
} // namespace

extern "C" __global__ void __launch_bounds__(NT) KNAME(
    const xt* __restrict__ q,
    const xt* __restrict__ k,
    const xt* __restrict__ v,
    const float* __restrict__ g,
    const float* __restrict__ beta,
    const float* __restrict__ state_in,
    xt* __restrict__ y,
    float* __restrict__ state_out,
    int T) {
  extern __shared__ __align__(16) unsigned char smem[];
  // Shared memory layout (the wrapper computes the same total).
  xt* ks = reinterpret_cast<xt*>(smem);  // [2][TB][D] staged k
  xt* qs = ks + 2 * TB * D;              // [2][TB][D] staged q
  xt* vs = qs + 2 * TB * D;              // [2][TB][RB] staged v rows
  xt* ys = vs + 2 * TB * RB;             // [2][TB][RB] y tile
  float* gs = reinterpret_cast<float*>(ys + 2 * TB * RB);  // [2][TB]
  float* bs = gs + 2 * TB;                                 // [2][TB]
  float* kqs = bs + 2 * TB;                                // [TB]
  float* gram = kqs + TB;                                  // [NG][16] if U > 1
  float* kf32 = gram + (U > 1 ? NG * GSTR : 0);            // [TB][D] if KQF
  float* qf32 = kf32 + (KQF ? TB * D : 0);                 // [TB][D] if KQF

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int blk = blockIdx.x;
  const int row0 = (blk % BPH) * RB;
  const int bh = blk / BPH;  // b * HV + h
  const int h = bh % HV;
  const int b = bh / HV;
  const int hk = h / GQA;
  const int rg = lane / L;
  const int j = lane % L;

  int rloc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    rloc[r] = warp * RPW + r * RG + rg;
  }

  // Load this lane's part of the state once.
  float S[R][E];
  const float* s_in = state_in + ((size_t)bh * D + row0) * D;
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int e = 0; e < E; e += 4) {
      load16(s_in + rloc[r] * D + col_of(j, e), &S[r][e]);
    }
  }

  const size_t qk_tstride = (size_t)HK * D;
  const size_t v_tstride = (size_t)HV * D;
  const xt* kb = k + ((size_t)b * T * HK + hk) * D;
  const xt* qb = q + ((size_t)b * T * HK + hk) * D;
  const xt* vb = v + ((size_t)b * T * HV + h) * D + row0;
  const float* gb = g + (size_t)b * T * HV + h;
  const float* bb = beta + (size_t)b * T * HV + h;
  xt* yb = y + ((size_t)b * T * HV + h) * D + row0;

  constexpr int KC = D / XCH;   // 16-byte chunks per q/k row
  constexpr int VC = RB / XCH;  // 16-byte chunks per v/y tile row
  const int nstages = (T + TB - 1) / TB;

  auto issue = [&](int s) {
    const int t0 = s * TB;
    const int nt = min(TB, T - t0);
    const int buf = s & 1;
    for (int i = tid; i < nt * KC; i += NT) {
      const int t = i / KC, c = i % KC;
      cp_async16(ks + (buf * TB + t) * D + c * XCH, kb + (t0 + t) * qk_tstride + c * XCH);
      cp_async16(qs + (buf * TB + t) * D + c * XCH, qb + (t0 + t) * qk_tstride + c * XCH);
    }
    for (int i = tid; i < nt * VC; i += NT) {
      const int t = i / VC, c = i % VC;
      cp_async16(vs + (buf * TB + t) * RB + c * XCH, vb + (t0 + t) * v_tstride + c * XCH);
    }
    if (tid < nt) {
      cp_async4(gs + buf * TB + tid, gb + (size_t)(t0 + tid) * HV);
      cp_async4(bs + buf * TB + tid, bb + (size_t)(t0 + tid) * HV);
    }
    cp_async_commit();
  };

  auto store_y = [&](int s) {
    const int t0 = s * TB;
    const int nt = min(TB, T - t0);
    const int buf = s & 1;
    for (int i = tid; i < nt * VC; i += NT) {
      const int t = i / VC, c = i % VC;
      *reinterpret_cast<uint4*>(yb + (t0 + t) * v_tstride + c * XCH) =
          *reinterpret_cast<const uint4*>(ys + (buf * TB + t) * RB + c * XCH);
    }
  };

  if (nstages > 0) {
    issue(0);
  }
  for (int s = 0; s < nstages; ++s) {
    const int nt = min(TB, T - s * TB);
    const int buf = s & 1;
    cp_async_wait_all();
    __syncthreads();  // stage s is in shared memory; stage s-1 is finished
    if (s + 1 < nstages) {
      issue(s + 1);
    }
    if (s > 0) {
      store_y(s - 1);
    }
    // Per-stage prologue, one warp per work item: the fp32 copies of k and q
    // (zero rows past the last token) and k_t . q_t (U == 1) or the Gram
    // entries of each group (U > 1).
    constexpr int NCONV = KQF ? TB : 0;
    constexpr int NPAD = (U > 1 && !KQF) ? U - 1 : 0;  // zero rows nt.. of the last group
    constexpr int NDOTW = U == 1 ? TB / 8 : NG;  // U == 1: 8 tokens per item
    for (int w = warp; w < NPAD + NCONV + NDOTW; w += NW) {
      if (w < NPAD) {
        const int t = nt + w;
        if (t < ((nt + U - 1) / U) * U) {
          const float z4[4] = {0.f, 0.f, 0.f, 0.f};
          store4(ks + (buf * TB + t) * D + lane * 4, z4);
          store4(qs + (buf * TB + t) * D + lane * 4, z4);
        }
        continue;
      }
      const int wi = w - NPAD;
      if (wi < NCONV) {
        const int t = wi;
        float kv4[4] = {0.f, 0.f, 0.f, 0.f}, qv4[4] = {0.f, 0.f, 0.f, 0.f};
        if (t < nt) {
          load4(ks + (buf * TB + t) * D + lane * 4, kv4);
          load4(qs + (buf * TB + t) * D + lane * 4, qv4);
        }
        store4(kf32 + t * D + lane * 4, kv4);
        store4(qf32 + t * D + lane * 4, qv4);
      } else if (U == 1) {
        // k_t . q_t of 8 tokens: lanes 4i..4i+3 share token t0 + i, each
        // summing 32 of its 128 products (16-byte chunks c*4 + j of the row),
        // then two shuffle levels (a whole warp per token would need five)
        const int t = (wi - NCONV) * 8 + (lane >> 2);
        const int jq = lane & 3;
        float acc0 = 0.0f, acc1 = 0.0f;
        if (t < nt) {
#pragma unroll
          for (int c = 0; c < D / (4 * XCH); ++c) {
            float kv[XCH], qv[XCH];
            load16(ks + (buf * TB + t) * D + (c * 4 + jq) * XCH, kv);
            load16(qs + (buf * TB + t) * D + (c * 4 + jq) * XCH, qv);
#pragma unroll
            for (int e = 0; e < XCH; e += 2) {
              acc0 = fmaf(kv[e], qv[e], acc0);
              acc1 = fmaf(kv[e + 1], qv[e + 1], acc1);
            }
          }
        }
        float acc = acc0 + acc1;
        acc += __shfl_xor_sync(0xffffffffu, acc, 1);
        acc += __shfl_xor_sync(0xffffffffu, acc, 2);
        if (jq == 0 && t < nt) {
          kqs[t] = acc;
        }
      } else {
        // Group m: KK[i][j] (i < j) then KQ[i][j] (i <= j), NDOT <= 16 dots.
        const int m = wi - NCONV;
        float kv[U][4], qv[U][4];
#pragma unroll
        for (int i = 0; i < U; ++i) {
          const int t = m * U + i;
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            kv[i][c] = 0.f;
            qv[i][c] = 0.f;
          }
          if (t < nt) {
            load4(ks + (buf * TB + t) * D + lane * 4, kv[i]);
            load4(qs + (buf * TB + t) * D + lane * 4, qv[i]);
          }
        }
        float p[16];
#pragma unroll
        for (int n = 0; n < 16; ++n) {
          p[n] = 0.f;
        }
#pragma unroll
        for (int i = 0; i < U; ++i) {
#pragma unroll
          for (int jj = i; jj < U; ++jj) {
            if (jj > i) {  // KK(i, jj)
              p[i * (2 * U - i - 1) / 2 + (jj - i - 1)] = kv[i][0] * kv[jj][0] +
                  kv[i][1] * kv[jj][1] + kv[i][2] * kv[jj][2] + kv[i][3] * kv[jj][3];
            }
            // KQ(i, jj)
            p[U * (U - 1) / 2 + i * (2 * U - i + 1) / 2 + (jj - i)] = kv[i][0] * qv[jj][0] +
                kv[i][1] * qv[jj][1] + kv[i][2] * qv[jj][2] + kv[i][3] * qv[jj][3];
          }
        }
        // Reduce-scatter over the warp: after the xor-16/8/4/2 levels lane l
        // holds the partial of dot (l >> 1) summed over 16 lanes; xor 1 ends it.
#pragma unroll
        for (int lvl = 0; lvl < 4; ++lvl) {
          const int o = 16 >> lvl;
          const int h = 8 >> lvl;
          const bool up = lane & o;
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            if (i < h) {
              const float send = up ? p[i] : p[i + h];
              const float keep = up ? p[i + h] : p[i];
              p[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
            }
          }
        }
        p[0] += __shfl_xor_sync(0xffffffffu, p[0], 1);
        if ((lane & 1) == 0) {
          gram[m * GSTR + (lane >> 1)] = p[0];
        }
      }
    }
    __syncthreads();

    const kt* kst = KQF ? reinterpret_cast<const kt*>(kf32)
                        : reinterpret_cast<const kt*>(ks + buf * TB * D);
    const kt* qst = KQF ? reinterpret_cast<const kt*>(qf32)
                        : reinterpret_cast<const kt*>(qs + buf * TB * D);
    const xt* vst = vs + buf * TB * RB;
    xt* yst = ys + buf * TB * RB;
    const float* gst = gs + buf * TB;
    const float* bst = bs + buf * TB;
    if constexpr (U == 1) {
#pragma unroll 2
      for (int i = 0; i < nt; ++i) {
        float kf[E], qf[E];
#pragma unroll
        for (int c = 0; c < NCH; ++c) {
          load16(kst + i * D + (c * L + j) * CH, &kf[c * CH]);
          load16(qst + i * D + (c * L + j) * CH, &qf[c * CH]);
        }
        const float gt = gst[i];
        const float bt = bst[i];
        const float kqt = kqs[i];
        float sk[R], sq[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float a0 = 0.0f, a1 = 0.0f, c0 = 0.0f, c1 = 0.0f;
#pragma unroll
          for (int e = 0; e < E; e += 2) {
            a0 = fmaf(S[r][e], kf[e], a0);
            a1 = fmaf(S[r][e + 1], kf[e + 1], a1);
            c0 = fmaf(S[r][e], qf[e], c0);
            c1 = fmaf(S[r][e + 1], qf[e + 1], c1);
          }
          sk[r] = a0 + a1;
          sq[r] = c0 + c1;
        }
#pragma unroll
        for (int o = 1; o < L; o <<= 1) {
#pragma unroll
          for (int r = 0; r < R; ++r) {
            sk[r] += __shfl_xor_sync(0xffffffffu, sk[r], o);
            sq[r] += __shfl_xor_sync(0xffffffffu, sq[r], o);
          }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const float vr = to_f(vst[i * RB + rloc[r]]);
          const float d = bt * (vr - gt * sk[r]);
          if (j == 0) {
            yst[i * RB + rloc[r]] = from_f<xt>(fmaf(gt, sq[r], d * kqt));
          }
#pragma unroll
          for (int e = 0; e < E; ++e) {
            S[r][e] = fmaf(S[r][e], gt, d * kf[e]);
          }
        }
      }
    } else {
      const int ngroups = (nt + U - 1) / U;
      for (int m = 0; m < ngroups; ++m) {
        const int i0 = m * U;
        float kf[U][E];
        float a[R][U], bq[R][U];
        {
          float qf[U][E];
#pragma unroll
          for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int c = 0; c < NCH; ++c) {
              load16(kst + (i0 + u) * D + (c * L + j) * CH, &kf[u][c * CH]);
              load16(qst + (i0 + u) * D + (c * L + j) * CH, &qf[u][c * CH]);
            }
          }
          // 2RU independent dots against the group-start state.
#pragma unroll
          for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
              float a0 = 0.0f, a1 = 0.0f, c0 = 0.0f, c1 = 0.0f;
#pragma unroll
              for (int e = 0; e < E; e += 2) {
                a0 = fmaf(S[r][e], kf[u][e], a0);
                a1 = fmaf(S[r][e + 1], kf[u][e + 1], a1);
                c0 = fmaf(S[r][e], qf[u][e], c0);
                c1 = fmaf(S[r][e + 1], qf[u][e + 1], c1);
              }
              a[r][u] = a0 + a1;
              bq[r][u] = c0 + c1;
            }
          }
        }
#pragma unroll
        for (int o = 1; o < L; o <<= 1) {
#pragma unroll
          for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
              a[r][u] += __shfl_xor_sync(0xffffffffu, a[r][u], o);
              bq[r][u] += __shfl_xor_sync(0xffffffffu, bq[r][u], o);
            }
          }
        }
        // Group scalars (identical in every lane): gates, decay products, Gram.
        float gg[U], bb[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const bool ok = i0 + u < nt;
          gg[u] = ok ? gst[i0 + u] : 1.0f;
          bb[u] = ok ? bst[i0 + u] : 0.0f;
        }
        float gr[16];
#pragma unroll
        for (int n = 0; n < 16; n += 4) {
          load16(gram + m * GSTR + n, &gr[n]);
        }
        // c[i][j] = g_{i+1} ... g_{j-1} (j <= U); Gs[j] = g_0 ... g_{j-1}.
        float cdec[U][U + 1];
        float Gs[U + 1];
        Gs[0] = 1.0f;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          Gs[u + 1] = Gs[u] * gg[u];
        }
#pragma unroll
        for (int i = 0; i < U; ++i) {
          float c = 1.0f;
#pragma unroll
          for (int jj = i + 1; jj <= U; ++jj) {
            cdec[i][jj] = c;
            if (jj < U) {
              c *= gg[jj];
            }
          }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float d[U];
#pragma unroll
          for (int u = 0; u < U; ++u) {
            float sk = Gs[u] * a[r][u];
            float sq = Gs[u] * bq[r][u];
#pragma unroll
            for (int i = 0; i < u; ++i) {
              // KK(i,u) index: pairs (i', j') with i' < j', row-major.
              const int kk = i * (2 * U - i - 1) / 2 + (u - i - 1);
              // KQ(i,u) index: U(U-1)/2 + pairs (i', j') with i' <= j'.
              const int kq = U * (U - 1) / 2 + i * (2 * U - i + 1) / 2 + (u - i);
              const float cd = cdec[i][u] * d[i];
              sk = fmaf(cd, gr[kk], sk);
              sq = fmaf(cd, gr[kq], sq);
            }
            const float vr = (i0 + u < nt) ? to_f(vst[(i0 + u) * RB + rloc[r]]) : 0.0f;
            d[u] = bb[u] * (vr - gg[u] * sk);
            const int kqd = U * (U - 1) / 2 + u * (2 * U - u + 1) / 2;  // KQ(u,u)
            if (j == 0 && i0 + u < nt) {
              yst[(i0 + u) * RB + rloc[r]] = from_f<xt>(fmaf(gg[u], sq, d[u] * gr[kqd]));
            }
          }
          float cf[U];
#pragma unroll
          for (int i = 0; i < U; ++i) {
            cf[i] = cdec[i][U] * d[i];
          }
#pragma unroll
          for (int e = 0; e < E; ++e) {
            float sv = S[r][e] * Gs[U];
#pragma unroll
            for (int i = 0; i < U; ++i) {
              sv = fmaf(cf[i], kf[i][e], sv);
            }
            S[r][e] = sv;
          }
        }
      }
    }
  }
  __syncthreads();
  if (nstages > 0) {
    store_y(nstages - 1);
  }

  float* s_out = state_out + ((size_t)bh * D + row0) * D;
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int e = 0; e < E; e += 4) {
      *reinterpret_cast<float4*>(s_out + rloc[r] * D + col_of(j, e)) =
          make_float4(S[r][e], S[r][e + 1], S[r][e + 2], S[r][e + 3]);
    }
  }
}
