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
// k_t . q_t is computed once per token and block, off the critical path.
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
// Variants (build macros, both 0 or 1):
//   GDN_KQF32: convert the staged k and q rows to fp32 in shared memory once per
//     stage (in the k.q pass) instead of in every lane and token.
//   GDN_LAZY: keep S = G * Sh with a per-block scalar G (the product of the
//     gates since the last fold), so the per-element update is one FFMA,
//     Sh += (d / G') k, instead of an FMUL and an FFMA. When G' = G * g_t falls
//     under 2^-60 the token uses the plain update Sh <- G' Sh + d k and G is
//     reset to 1 (a uniform branch; all rows of a block share g_t).
//
// Build macros: KNAME, GDN_X (bf16_t | f16_t | float), GDN_HV, GDN_HK, GDN_L,
// GDN_R, GDN_NW (warps per block), GDN_TB (tokens per stage), GDN_KQF32,
// GDN_LAZY.
// Launch: grid = B * HV * (128 / RB) blocks of GDN_NW * 32 threads,
// dynamic shared memory = gdn_scan_smem_bytes (see the Python wrapper).
// Parameters: inputs q, k, v, g, beta, state_in; outputs y, state_out; int T.
#include "gdn_common.cuh"

#ifndef GDN_KQF32
#define GDN_KQF32 0
#endif
#ifndef GDN_LAZY
#define GDN_LAZY 0
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
constexpr bool KQF = GDN_KQF32 && sizeof(xt) != 4;  // fp32 k/q copies in smem
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
  float* kf32 = kqs + TB;                                  // [TB][D] if KQF
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
  float G = 1.0f;  // GDN_LAZY: true state = G * S

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
    // k_t . q_t for the tokens of this stage, one warp per token (and the
    // fp32 copies of k and q when KQF).
    for (int t = warp; t < nt; t += NW) {
      const xt* kr = ks + (buf * TB + t) * D + lane * 4;
      const xt* qr = qs + (buf * TB + t) * D + lane * 4;
      float kv4[4], qv4[4];
      load4(kr, kv4);
      load4(qr, qv4);
      float acc = kv4[0] * qv4[0];
      acc = fmaf(kv4[1], qv4[1], acc);
      acc = fmaf(kv4[2], qv4[2], acc);
      acc = fmaf(kv4[3], qv4[3], acc);
      if (KQF) {
        store4(kf32 + t * D + lane * 4, kv4);
        store4(qf32 + t * D + lane * 4, qv4);
      }
      acc = warp_sum(acc);
      if (lane == 0) {
        kqs[t] = acc;
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
      // Decay of the stored state for this token (G' in the notes above).
      const float gs_t = GDN_LAZY ? G * gt : gt;
      const bool lazy = GDN_LAZY && gs_t >= 8.673617e-19f;  // 2^-60
      const float inv = lazy ? 1.0f / gs_t : 0.0f;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float vr = to_f(vst[i * RB + rloc[r]]);
        const float d = bt * (vr - gs_t * sk[r]);
        if (j == 0) {
          yst[i * RB + rloc[r]] = from_f<xt>(fmaf(gs_t, sq[r], d * kqt));
        }
        if (lazy) {
          const float dd = d * inv;
#pragma unroll
          for (int e = 0; e < E; ++e) {
            S[r][e] = fmaf(dd, kf[e], S[r][e]);
          }
        } else {
#pragma unroll
          for (int e = 0; e < E; ++e) {
            S[r][e] = fmaf(S[r][e], gs_t, d * kf[e]);
          }
        }
      }
      G = lazy ? gs_t : 1.0f;
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
          make_float4(G * S[r][e], G * S[r][e + 1], G * S[r][e + 2], G * S[r][e + 3]);
    }
  }
}
