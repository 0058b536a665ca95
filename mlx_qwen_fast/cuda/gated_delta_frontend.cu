// Gated DeltaNet prefill front end, one pass over the qkv projection.
//
// Fuses what mlx-lm's GatedDeltaNet.__call__ does between the projections and
// the recurrence (mlx_lm/models/qwen3_5.py, gated_delta.py):
//   conv_input = concat(conv_state, qkv)           [B, 3 + T, C]
//   x = silu(depthwise_conv1d(conv_input, w))      kernel 4, no bias
//   q, k, v = split(x)                              [HK*D | HK*D | HV*D]
//   q = q / sqrt(sum(q^2) + eps) * D^-0.5           (normalize_qk)
//   k = k / sqrt(sum(k^2) + eps)
//   g = exp(-exp(A_log) * softplus(a + dt_bias)),  beta = sigmoid(b)
//   new conv_state = conv_input[:, -3:]
// All arithmetic in fp32 (SiLU with the hardware exp and reciprocal:
// silu_fast, gdn_common.cuh); q, k, v are rounded once to the activation type.
//
// Work split: one warp per (b, 128-channel head slice, tile of TT tokens); a
// lane owns 4 consecutive channels and walks the tile keeping the previous
// three input rows in registers, so each input row is read once (plus a
// 3-row halo per tile). The L2 norms are warp sums. Warps of v slices also
// compute g and beta of their head for their tokens (lane = token).
//
// Build macros: KNAME, GDN_X (activations: qkv, a, b, conv state, q/k/v out),
// GDN_W (conv weight), GDN_A (A_log), GDN_DT (dt_bias), GDN_HV, GDN_HK, GDN_TT.
// Parameters: inputs qkv [B,T,C], a [B,T,HV], b [B,T,HV], conv_w [C,4],
// conv_state [B,3,C], A_log [HV], dt_bias [HV]; outputs q [B,T,HK,D],
// k [B,T,HK,D], v [B,T,HV,D], g [B,T,HV] f32, beta [B,T,HV] f32,
// conv_state_out [B,3,C]; scalars int B, int T, float eps.
// Launch: B * ceil(T / TT) * (2 HK + HV) warps, 4 warps per block.
#include "gdn_common.cuh"

typedef GDN_X xt;
typedef GDN_W wt;
typedef GDN_A at;
typedef GDN_DT dtt;
constexpr int D = 128;
constexpr int HV = GDN_HV;
constexpr int HK = GDN_HK;
constexpr int NHC = 2 * HK + HV;  // 128-channel slices
constexpr int C = NHC * D;        // conv channels
constexpr int TT = GDN_TT;        // tokens per warp
constexpr int KW = 4;             // conv kernel width
static_assert(TT <= 32, "gate lanes: one token per lane");

extern "C" __global__ void __launch_bounds__(128) KNAME(
    const xt* __restrict__ qkv,
    const xt* __restrict__ a_in,
    const xt* __restrict__ b_in,
    const wt* __restrict__ conv_w,
    const xt* __restrict__ conv_state,
    const at* __restrict__ A_log,
    const dtt* __restrict__ dt_bias,
    xt* __restrict__ q_out,
    xt* __restrict__ k_out,
    xt* __restrict__ v_out,
    float* __restrict__ g_out,
    float* __restrict__ beta_out,
    xt* __restrict__ conv_state_out,
    int B,
    int T,
    float eps) {
  // The warp's work item gw in [0, B * ceil(T / TT) * (2 HK + HV)): slice
  // fastest, then token tile, then batch; all 32 lanes share it (the L2 norms
  // are warp sums) and an item past the end (b >= B) does nothing.
  const int gw = blockIdx.x * 4 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  const int ntiles = (T + TT - 1) / TT;
  const int hc = gw % NHC;
  const int tile = (gw / NHC) % ntiles;
  const int b = gw / (NHC * ntiles);
  if (b >= B || T <= 0) {
    return;
  }
  const int t0 = tile * TT;
  const int t1 = min(T, t0 + TT);
  const int c0 = hc * D + lane * 4;  // first of this lane's 4 channels

  // Gates: the warps of v slices, one token per lane.
  if (hc >= 2 * HK) {
    const int h = hc - 2 * HK;
    const int t = t0 + lane;
    if (t < t1) {
      const size_t i = ((size_t)b * T + t) * HV + h;
      const float A = expf(to_f(A_log[h]));
      const float sp = softplus_f(to_f(a_in[i]) + to_f(dt_bias[h]));
      g_out[i] = expf(-A * sp);
      beta_out[i] = sigmoid_f(to_f(b_in[i]));
    }
  }

  // Conv taps of the lane's 4 channels: 4 x KW contiguous elements, read
  // with 16-byte loads when the weight array is 16-byte aligned (2 loads for
  // a 2-byte type instead of 16 scalar ones, each of which touched a sector
  // of its own per lane).
  float w[4][KW];  // [channel][tap]
  {
    const wt* wp = conv_w + (size_t)c0 * KW;
    float* wf = &w[0][0];
    if ((reinterpret_cast<size_t>(conv_w) & 15) == 0) {
      constexpr int N = Vec16<wt>::N;
#pragma unroll
      for (int j = 0; j < 4 * KW; j += N) {
        load16(wp + j, wf + j);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 4 * KW; ++j) {
        wf[j] = to_f(wp[j]);
      }
    }
  }

  // Row u of conv_input (u = t + 3 for token t); rows u < 3 come from the state.
  const xt* xb = qkv + (size_t)b * T * C + c0;
  const xt* sb = conv_state + (size_t)b * (KW - 1) * C + c0;
  auto row_ptr = [&](int u) {
    return u < KW - 1 ? sb + (size_t)u * C : xb + (size_t)(u - (KW - 1)) * C;
  };
  auto row = [&](int u, float* o) { load4(row_ptr(u), o); };

  // Issue every load of the tile first (3 halo rows + TT rows). The tile's
  // rows stay as loaded (Raw4: 2 registers per row for a 2-byte type) until
  // used, so the warp keeps all TT + 3 loads in flight in fewer registers.
  float win[KW - 1][4];  // rows t-3, t-2, t-1
#pragma unroll
  for (int i = 0; i < KW - 1; ++i) {
    row(t0 + i, win[i]);
  }
  Raw4<xt> xs[TT];
#pragma unroll
  for (int i = 0; i < TT; ++i) {
    if (t0 + i < t1) {
      xs[i].load(row_ptr(t0 + i + KW - 1));
    }
  }

  const bool is_q = hc < HK;
  const bool is_k = hc >= HK && hc < 2 * HK;
  const float qscale = rsqrtf((float)D);
  xt* ob;
  size_t ostride;
  if (is_q) {
    ob = q_out + ((size_t)b * T * HK + hc) * D + lane * 4;
    ostride = (size_t)HK * D;
  } else if (is_k) {
    ob = k_out + ((size_t)b * T * HK + (hc - HK)) * D + lane * 4;
    ostride = (size_t)HK * D;
  } else {
    ob = v_out + ((size_t)b * T * HV + (hc - 2 * HK)) * D + lane * 4;
    ostride = (size_t)HV * D;
  }

#pragma unroll
  for (int i = 0; i < TT; ++i) {
    if (t0 + i < t1) {  // warp-uniform
      float o[4], x[4];
      xs[i].get(x);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        float acc = win[0][c] * w[c][0];
        acc = fmaf(win[1][c], w[c][1], acc);
        acc = fmaf(win[2][c], w[c][2], acc);
        acc = fmaf(x[c], w[c][3], acc);
        o[c] = silu_fast(acc);
        win[0][c] = win[1][c];
        win[1][c] = win[2][c];
        win[2][c] = x[c];
      }
      if (is_q || is_k) {
        float ss = o[0] * o[0];
        ss = fmaf(o[1], o[1], ss);
        ss = fmaf(o[2], o[2], ss);
        ss = fmaf(o[3], o[3], ss);
        ss = warp_sum(ss);
        float sc = rsqrtf(ss + eps);
        if (is_q) {
          sc *= qscale;
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          o[c] *= sc;
        }
      }
      store4(ob + (size_t)(t0 + i) * ostride, o);
    }
  }

  // The tile holding the last token writes the new conv state:
  // new_state[r] = conv_input[T + r], r = 0..2.
  if (t1 == T) {
    xt* so = conv_state_out + (size_t)b * (KW - 1) * C + c0;
#pragma unroll
    for (int r = 0; r < KW - 1; ++r) {
      float o[4];
      row(T + r, o);
      store4(so + (size_t)r * C, o);
    }
  }
}
