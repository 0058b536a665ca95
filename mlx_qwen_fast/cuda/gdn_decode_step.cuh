// The Gated DeltaNet decode step (T = 1) of one (batch row, value head) by
// one block of 512 threads: the device code of gated_delta_decode.cu, shared
// with gdn_mixer_decode.cu (which runs it between its two GEMV phases).
//
// For one token (mlx_lm/models/qwen3_5.py GatedDeltaNet.__call__):
//   conv: x = silu(sum_i w[c,i] * [conv_state ; qkv][i, c]),  new conv_state
//   q = x_q / sqrt(sum x_q^2 + eps) * D^-0.5,  k = x_k / sqrt(sum x_k^2 + eps)
//   g = exp(-exp(A_log) softplus(a + dt_bias)),  beta = sigmoid(b)
//   S <- g S;  d = beta (v - S k);  S <- S + d k^T;  y = S q
//   out = silu(z) * (w_n * rms_norm(y))            (Qwen3NextRMSNormGated)
// q, k, v and y are rounded to the activation type where the reference path
// stores them in that type, so the step equals the prefill kernels at T = 1.
//
// Work split of a block (b, h), bh = b * HV + h: thread groups of 4 lanes own
// one state row (32 columns per lane, in 16-byte chunks: col_of). The block
// first issues the loads of its 128x128 fp32 state rows
// (gdn_step_state_loads), then computes the conv/norm/gates of the channels
// it needs while those loads are in flight (gdn_step): q and k of key head
// h / (HV/HK) (recomputed by each value head of the group; the first one
// writes their conv state) and v of head h. Then the rows are updated as in
// the prefill scan (sk = S k, sq = S q from the old state) and the gated
// RMSNorm runs over the head's 128 outputs.
//
// Arrays (element offsets as gated_delta_decode.cu documents them): proj
// [B, P] = [qkv | z | a | b] rows; params [C*4 + 2*HV + D] fp32 = [conv_w |
// A_log | dt_bias | norm_w]; conv_state / conv_state_out [B, 3, C]; state_in
// / state_out [B, HV, D, D] fp32; out [B, HV*D]. The block's shared arrays
// come from the kernel (qsh, ksh 16-byte aligned; red [4][3], gate [2]).
// proj is read through PL::get (a struct with a static `float get(const xt*)`):
// GdnProjLoad for an input of the launch; a kernel whose other blocks wrote
// proj earlier in the same launch passes loads that bypass the non-coherent
// read-only path.
//
// Build macros: GDN_X (activation type of proj, conv state, out), GDN_HV,
// GDN_HK.
#pragma once
#include "gdn_common.cuh"

typedef GDN_X xt;

namespace {
constexpr int D = 128;
constexpr int HV = GDN_HV;
constexpr int HK = GDN_HK;
constexpr int GQA = HV / HK;
constexpr int C = (2 * HK + HV) * D;
constexpr int KW = 4;
// Row stride of proj and offsets (elements) of z, a, b in its rows (qkv at 0).
constexpr int P = C + HV * D + 2 * HV;
constexpr int OFF_Z = C;
constexpr int OFF_A = C + HV * D;
constexpr int OFF_B = C + HV * D + HV;
constexpr int NT = 512;
constexpr int L = 4;       // lanes per state row
constexpr int E = D / L;   // 32 columns per lane
constexpr int CH = 4;      // fp32 chunk
static_assert(NT / 32 * (32 / L) == D, "one row per lane group");

__device__ __forceinline__ int col_of(int j, int e) {
  return ((e / CH) * L + j) * CH + (e % CH);
}

// silu(conv) of channel c for batch b: taps over [conv_state rows 0..2 ; x].
__device__ __forceinline__ float conv_silu(
    const xt* conv_state, const float* conv_w, int b, int c, float x, float* s) {
  float acc = 0.0f;
#pragma unroll
  for (int i = 0; i < KW - 1; ++i) {
    s[i] = to_f(conv_state[((size_t)b * (KW - 1) + i) * C + c]);
    acc = fmaf(s[i], conv_w[c * KW + i], acc);
  }
  acc = fmaf(x, conv_w[c * KW + KW - 1], acc);
  return silu_f(acc);
}

__device__ __forceinline__ void write_conv_state(
    xt* conv_state_out, int b, int c, const float* s, float x) {
  xt* o = conv_state_out + (size_t)b * (KW - 1) * C + c;
  o[0] = from_f<xt>(s[1]);
  o[(size_t)C] = from_f<xt>(s[2]);
  o[(size_t)2 * C] = from_f<xt>(x);
}
} // namespace

// proj read with plain loads (an input of the launch).
struct GdnProjLoad {
  static __device__ __forceinline__ float get(const xt* p) {
    return to_f(*p);
  }
};

// 1. The state loads of block (b, h) = bh: this thread's row and columns.
__device__ __forceinline__ void gdn_step_state_loads(const float* __restrict__ state_in, int bh, float (&S)[E]) {
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int row = warp * (32 / L) + lane / L;
  const int j = lane % L;
  const float* s_in = state_in + ((size_t)bh * D + row) * D;
#pragma unroll
  for (int e = 0; e < E; e += 4) {
    load16(s_in + col_of(j, e), &S[e]);
  }
}

// 2.-4. The rest of the step of block bh, S from gdn_step_state_loads.
template <class PL>
__device__ __forceinline__ void gdn_step(
    const xt* __restrict__ proj,
    const float* __restrict__ params,
    const xt* __restrict__ conv_state,
    const float (&S)[E],
    xt* __restrict__ out,
    xt* __restrict__ conv_state_out,
    float* __restrict__ state_out,
    float eps_qk,
    float eps_norm,
    int bh,
    float* qsh,
    float* ksh,
    float* vsh,
    float* ysh,
    float (*red)[3],
    float* gate) {
  const float* const conv_w = params;
  const float* const A_log = params + C * KW;
  const float* const dt_bias = params + C * KW + HV;
  const float* const norm_w = params + C * KW + 2 * HV;

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int h = bh % HV;
  const int b = bh / HV;
  const int hk = h / GQA;
  const int row = warp * (32 / L) + lane / L;
  const int j = lane % L;

  float zv = 0.0f;
  if (tid < D) {
    zv = PL::get(proj + (size_t)b * P + OFF_Z + h * D + tid);
  }

  // 2. Front end for the channels of this head.
  float qv = 0.0f, kv = 0.0f;
  if (tid < D) {
    const int cq = hk * D + tid;
    const int ck = HK * D + hk * D + tid;
    const float xq = PL::get(proj + (size_t)b * P + cq);
    const float xk = PL::get(proj + (size_t)b * P + ck);
    float sq_[KW - 1], sk_[KW - 1];
    qv = conv_silu(conv_state, conv_w, b, cq, xq, sq_);
    kv = conv_silu(conv_state, conv_w, b, ck, xk, sk_);
    if (h % GQA == 0) {
      write_conv_state(conv_state_out, b, cq, sq_, xq);
      write_conv_state(conv_state_out, b, ck, sk_, xk);
    }
    float p0 = warp_sum(qv * qv);
    float p1 = warp_sum(kv * kv);
    if (lane == 0) {
      red[warp][0] = p0;
      red[warp][1] = p1;
    }
  } else if (tid < 2 * D) {
    const int cv = 2 * HK * D + h * D + (tid - D);
    const float xv = PL::get(proj + (size_t)b * P + cv);
    float sv_[KW - 1];
    const float vv = conv_silu(conv_state, conv_w, b, cv, xv, sv_);
    write_conv_state(conv_state_out, b, cv, sv_, xv);
    vsh[tid - D] = from_f_round<xt>(vv);
  } else if (tid == 2 * D) {
    const float A = expf(A_log[h]);
    const float sp = softplus_f(PL::get(proj + (size_t)b * P + OFF_A + h) + dt_bias[h]);
    gate[0] = expf(-A * sp);
    gate[1] = sigmoid_f(PL::get(proj + (size_t)b * P + OFF_B + h));
  }
  __syncthreads();
  if (tid < D) {
    const float ssq = red[0][0] + red[1][0] + red[2][0] + red[3][0];
    const float ssk = red[0][1] + red[1][1] + red[2][1] + red[3][1];
    qsh[tid] = from_f_round<xt>(qv * (rsqrtf(ssq + eps_qk) * rsqrtf((float)D)));
    ksh[tid] = from_f_round<xt>(kv * rsqrtf(ssk + eps_qk));
  }
  __syncthreads();

  // 3. Recurrence for this lane's row and columns.
  float kf[E], qf[E];
#pragma unroll
  for (int e = 0; e < E; e += 4) {
    load16(ksh + col_of(j, e), &kf[e]);
    load16(qsh + col_of(j, e), &qf[e]);
  }
  const float gt = gate[0];
  const float bt = gate[1];
  float sk0 = 0.0f, sk1 = 0.0f, sq0 = 0.0f, sq1 = 0.0f, kq = 0.0f;
#pragma unroll
  for (int e = 0; e < E; e += 2) {
    sk0 = fmaf(S[e], kf[e], sk0);
    sk1 = fmaf(S[e + 1], kf[e + 1], sk1);
    sq0 = fmaf(S[e], qf[e], sq0);
    sq1 = fmaf(S[e + 1], qf[e + 1], sq1);
    kq = fmaf(kf[e], qf[e], kq);
    kq = fmaf(kf[e + 1], qf[e + 1], kq);
  }
  float sk = sk0 + sk1, sq = sq0 + sq1;
#pragma unroll
  for (int o = 1; o < L; o <<= 1) {
    sk += __shfl_xor_sync(0xffffffffu, sk, o);
    sq += __shfl_xor_sync(0xffffffffu, sq, o);
    kq += __shfl_xor_sync(0xffffffffu, kq, o);
  }
  const float d = bt * (vsh[row] - gt * sk);
  const float yv = fmaf(gt, sq, d * kq);
  float* s_out = state_out + ((size_t)bh * D + row) * D;
#pragma unroll
  for (int e = 0; e < E; e += 4) {
    float4 o;
    o.x = fmaf(S[e], gt, d * kf[e]);
    o.y = fmaf(S[e + 1], gt, d * kf[e + 1]);
    o.z = fmaf(S[e + 2], gt, d * kf[e + 2]);
    o.w = fmaf(S[e + 3], gt, d * kf[e + 3]);
    *reinterpret_cast<float4*>(s_out + col_of(j, e)) = o;
  }
  if (j == 0) {
    ysh[row] = from_f_round<xt>(yv);
  }
  __syncthreads();

  // 4. Gated RMSNorm over the head's 128 outputs (threads 0..127).
  float yr = 0.0f;
  if (tid < D) {
    yr = ysh[tid];
    const float p = warp_sum(yr * yr);
    if (lane == 0) {
      red[warp][2] = p;
    }
  }
  __syncthreads();
  if (tid < D) {
    const float ss = red[0][2] + red[1][2] + red[2][2] + red[3][2];
    const float rstd = rsqrtf(ss / D + eps_norm);
    const float n = from_f_round<xt>(yr * rstd);
    const float wn = from_f_round<xt>(norm_w[tid] * n);
    out[(size_t)b * HV * D + h * D + tid] = from_f<xt>(silu_f(zv) * wn);
  }
}
