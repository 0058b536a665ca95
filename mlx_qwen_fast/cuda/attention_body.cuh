// Gated attention decode's device code for head_dim 256 (constants from the
// ATT_* build macros, the helpers, the per-tile online softmax, the combine):
// shared by attention_decode.cu (its three launches) and
// attention_layer_decode.cu (an attention decoder layer as one launch). What
// it computes and its rounding points: attention_decode.cu's header.
#pragma once
#include "gdn_common.cuh"

typedef ATT_X xt;
typedef ATT_W wt;

namespace {
constexpr int DH = 256;
constexpr int HQ = ATT_HQ;
constexpr int HKV = ATT_HKV;
constexpr int G = HQ / HKV;
constexpr int EL = DH / 32;  // dims per lane
constexpr int P = 2 * HQ * DH + 2 * HKV * DH;
constexpr int OFF_K = 2 * HQ * DH;
constexpr int OFF_V = 2 * HQ * DH + HKV * DH;
constexpr int ROPE_DIMS = ATT_ROPE_DIMS;
constexpr int ROPE_HALF = ROPE_DIMS / 2;
constexpr bool ROPE_TRAD = ATT_ROPE_TRAD != 0;
// K and V tiles of 16 KB each in the activation type.
constexpr int TILE = 16384 / (DH * (int)sizeof(xt));
static_assert(HQ % HKV == 0 && G >= 1 && G <= 16, "1 to 16 query heads per KV head");
static_assert(ROPE_DIMS % 2 == 0 && ROPE_DIMS <= DH, "rope dims even and <= head_dim");
static_assert(TILE <= 32, "one score per lane");
constexpr int VEC = 16 / (int)sizeof(xt);  // elements per 16-byte load
static_assert(EL % VEC == 0, "a lane's dims are whole 16-byte chunks");

template <typename T>
__device__ __forceinline__ void load_lane(const T* p, float* o) {
#pragma unroll
  for (int c = 0; c < EL; c += VEC) {
    load16(p + c, o + c);
  }
}

// -inf without math.h (NVRTC builds with no headers: gdn_common.cuh).
__device__ __forceinline__ float neg_inf() {
  return __int_as_float(0xff800000);
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  }
  return v;
}

// rms_norm then rope of one head held by a warp, EL dims per lane (v, raw
// values in, the rounded rotated values out). sh: DH floats of this warp.
__device__ __forceinline__ void norm_rope(float* v, const wt* w, float eps, int off,
                                          float log2_base, float rope_scale, float* sh) {
  const int lane = threadIdx.x & 31;
  float ss = 0.0f;
#pragma unroll
  for (int e = 0; e < EL; ++e) {
    ss = fmaf(v[e], v[e], ss);
  }
  const float r = rsqrtf(warp_sum(ss) / (float)DH + eps);
#pragma unroll
  for (int e = 0; e < EL; ++e) {
    const int d = lane * EL + e;
    v[e] = from_f_round<xt>(to_f(w[d]) * from_f_round<xt>(v[e] * r));
    sh[d] = v[e];
  }
  __syncwarp();
  // One lane per rotated pair: a single sincos call site keeps the image
  // small (MLX hashes the launched image on every launch).
  const float L = rope_scale * (float)off;
#pragma unroll 1
  for (int i = lane; i < ROPE_HALF; i += 32) {
    const int d1 = ROPE_TRAD ? 2 * i : i;
    const int d2 = ROPE_TRAD ? 2 * i + 1 : i + ROPE_HALF;
    const float theta = L * exp2f(-((float)i / (float)ROPE_HALF) * log2_base);
    const float c = cosf(theta), s = sinf(theta);
    const float x1 = sh[d1], x2 = sh[d2];
    sh[d1] = from_f_round<xt>(x1 * c - x2 * s);
    sh[d2] = from_f_round<xt>(x1 * s + x2 * c);
  }
  __syncwarp();
#pragma unroll
  for (int e = 0; e < EL; ++e) {
    v[e] = sh[lane * EL + e];
  }
  __syncwarp();
}

// Rows [0, TILE) of a tile, one partial dot product per row in each lane (d), summed across the
// warp so that lane L ends with row L % TILE's total in d[0]: at each level the lanes that differ
// in bit o exchange half of their rows (Hillis-Steele transposed reduction: 31 shuffles for 32
// rows where a butterfly per row takes 160).
template <int O>
__device__ __forceinline__ void transpose_level(float* d, int lane) {  // 2*O rows in, O out
  const bool up = (lane & O) != 0;
#pragma unroll
  for (int i = 0; i < O; ++i) {
    const float send = up ? d[i] : d[i + O];
    const float keep = up ? d[i + O] : d[i];
    d[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
  }
  if constexpr (O > 1) {
    transpose_level<O / 2>(d, lane);
  }
}
template <int N>
__device__ __forceinline__ void transpose_sum(float* d, int lane) {
  static_assert(N == 16 || N == 32, "16 or 32 rows");
  if constexpr (N < 32) {  // fewer rows than lanes: the halves of the warp add first
#pragma unroll
    for (int r = 0; r < N; ++r) {
      d[r] += __shfl_xor_sync(0xffffffffu, d[r], 16);
    }
  }
  transpose_level<N / 2>(d, lane);
}

// The cp.async copies (one commit group) of a tile of TILE cache positions
// [t0, t0 + n) of KV head row0 / cap (row0 = (b * HKV + j) * cap) into kt,
// vt [TILE][DH] of shared memory, by the block's first NTH threads (thread
// tid); rows past n zero-filled (no read), so that every row holds finite
// values.
template <int NTH>
__device__ __forceinline__ void copy_kv_tile(xt* kt, xt* vt, const xt* keys, const xt* values, size_t row0, int t0,
                                             int n, int tid) {
  constexpr int CHUNKS = TILE * DH / VEC;  // 16-byte chunks per tile and tensor
  for (int c = tid; c < CHUNKS; c += NTH) {
    const int r = c / (DH / VEC), col = (c % (DH / VEC)) * VEC;
    const size_t g = (row0 + t0 + (r < n ? r : 0)) * DH + col;
    const unsigned bytes = r < n ? 16u : 0u;
    cp_async16_zfill(smem_addr(kt + r * DH + col), keys + g, bytes);
    cp_async16_zfill(smem_addr(vt + r * DH + col), values + g, bytes);
  }
  cp_async_commit();
}

// One K/V tile of TILE rows in shared memory (kt, vt: [TILE][DH]; rows past n
// hold finite values) folded into a warp's online softmax: the query q (EL
// dims per lane, scaled by scale * log2(e)), the running max m and sum l in
// log2 units, the accumulator acc (EL dims per lane).
__device__ __forceinline__ void tile_update(const float* q, float& m, float& l, float* acc, const xt* kt,
                                            const xt* vt, int n, int lane) {
  float d[TILE];
#pragma unroll
  for (int r = 0; r < TILE; ++r) {
    float kv[EL];
    load_lane(kt + r * DH + lane * EL, kv);
    float x = 0.0f;
#pragma unroll
    for (int e = 0; e < EL; ++e) {
      x = fmaf(q[e], kv[e], x);
    }
    d[r] = x;
  }
  transpose_sum<TILE>(d, lane);
  const float sc = lane < n ? d[0] : neg_inf();  // lane r's score: position lo + t * TILE + r
  const float m_new = fmaxf(m, warp_max(sc));
  const float alpha = exp2f(m - m_new);  // 0 for the first tile (m = -inf)
  const float p = lane < n ? exp2f(sc - m_new) : 0.0f;
  l = l * alpha + warp_sum(p);
  m = m_new;
#pragma unroll
  for (int e = 0; e < EL; ++e) {
    acc[e] *= alpha;
  }
#pragma unroll
  for (int r = 0; r < TILE; ++r) {  // rows past n: p = 0 and zero-filled values
    const float pr = __shfl_sync(0xffffffffu, p, r);
    float vv[EL];
    load_lane(vt + r * DH + lane * EL, vv);
#pragma unroll
    for (int e = 0; e < EL; ++e) {
      acc[e] = fmaf(pr, vv[e], acc[e]);
    }
  }
}

// The combine of head bh = b * HQ + h over its ns splits, and the output
// gate: out[bh][t] = (sum_s 2^(m_s - M) acc_s[t] / sum_s 2^(m_s - M) l_s) *
// sigmoid(gate_h[t]), rounded to xt before the gate. part: the partials of
// all `rows` = B * HQ * ns (split) rows, then their (max, sum) pairs. A block
// of NTH >= DH threads calls it (every thread: its __syncthreads); threads
// past DH take no part. wsh [ns], red [DH / 32], tot [2]: shared. LD: the
// loads of part and proj (LD::f, LD::x).
template <int NTH, class LD>
__device__ __forceinline__ void combine_head(const float* part, size_t rows, const xt* proj, xt* out, int ns, int bh,
                                             float* wsh, float* red, float* tot) {
  const int t = threadIdx.x;
  const int b = bh / HQ, h = bh % HQ;
  const float* ml = part + rows * DH + (size_t)bh * ns * 2;
  float mx_ = neg_inf();
  for (int s = t; s < (NTH > DH && t >= DH ? 0 : ns); s += DH) {
    mx_ = fmaxf(mx_, LD::f(ml + 2 * s));
  }
  mx_ = warp_max(mx_);
  if ((t & 31) == 0 && t < DH) {
    red[t >> 5] = mx_;
  }
  __syncthreads();
  if (t == 0) {
    float v = red[0];
    for (int i = 1; i < DH / 32; ++i) {
      v = fmaxf(v, red[i]);
    }
    tot[0] = v;
  }
  __syncthreads();
  const float M = tot[0];
  float lsum = 0.0f;
  for (int s = t; s < (NTH > DH && t >= DH ? 0 : ns); s += DH) {
    const float ms = LD::f(ml + 2 * s);
    const float w = ms == neg_inf() ? 0.0f : exp2f(ms - M);
    wsh[s] = w;
    lsum = fmaf(w, LD::f(ml + 2 * s + 1), lsum);
  }
  lsum = warp_sum(lsum);
  __syncthreads();
  if ((t & 31) == 0 && t < DH) {
    red[t >> 5] = lsum;
  }
  __syncthreads();
  if (t == 0) {
    float v = 0.0f;
    for (int i = 0; i < DH / 32; ++i) {
      v += red[i];
    }
    tot[1] = v;
  }
  __syncthreads();
  if (NTH > DH && t >= DH) return;  // after the last __syncthreads
  const float* pa = part + (size_t)bh * ns * DH + t;
  float acc = 0.0f;
#pragma unroll 8
  for (int s = 0; s < ns; ++s) {  // unrolled: the loads of 8 splits in flight together, the sum in split order
    acc = fmaf(wsh[s], LD::f(pa + (size_t)s * DH), acc);
  }
  const float o = from_f_round<xt>(acc / tot[1]);
  const float g = LD::x(proj + (size_t)b * P + h * 2 * DH + DH + t);
  out[(size_t)bh * DH + t] = from_f<xt>(o * sigmoid_f(g));
}

// A lane's EL dims of a head row written earlier in the same launch by other
// blocks: through L2 only (ld.global.cg).
__device__ __forceinline__ void load_lane_cg(const xt* p, float* o) {
#pragma unroll
  for (int c = 0; c < EL; c += VEC) {
    const uint4 v = ldcg16(p + c);
    load16(reinterpret_cast<const xt*>(&v), o + c);
  }
}

// The loads of combine_head: through L2 only (part and proj written in the same launch).
struct L2Load {
  static __device__ __forceinline__ float f(const float* p) {
    return ldcg_f(p);
  }
  static __device__ __forceinline__ float x(const xt* p) {
    if constexpr (sizeof(xt) == 2) {
      const unsigned u = ldcg_u16(p);
      const unsigned short h = (unsigned short)u;
      return to_f(*reinterpret_cast<const xt*>(&h));
    } else {
      return ldcg_f(reinterpret_cast<const float*>(p));
    }
  }
};

// The loads of combine_head: plain (a separate launch wrote part and proj).
struct PlainLoad {
  static __device__ __forceinline__ float f(const float* p) {
    return *p;
  }
  static __device__ __forceinline__ float x(const xt* p) {
    return to_f(*p);
  }
};
}  // namespace
