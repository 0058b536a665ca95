// Gated attention decode (one query token per row), head_dim 256, GQA,
// split-K over the KV cache: the three launches of one layer's step.
//
// What they compute, for each row b (mlx_lm/models/qwen3_next.py
// Qwen3NextAttention.__call__ at T = 1, cache offset `off`):
//   q_h  = rope(rms_norm(proj_q[h], w_q), off)        (h < HQ)
//   k    = rope(rms_norm(proj_k[j], w_k), off)        (j < HKV)
//   o_h  = softmax(scale q_h . K_j[0..off]) V_j[0..off],  j = h / (HQ / HKV)
//   out_h = o_h * sigmoid(gate_h)
// where K_j[off], V_j[off] are this token's k and v (written into the cache
// buffers by the caller between the launches). The rounding points are the
// stock path's: rms_norm rounds x * rsqrt(mean(x^2) + eps) to the activation
// type and then its product with the weight (MLX's rms_norm); rope rounds its
// result; the attention output is rounded before the gate; everything else
// is fp32. RoPE as MLX's fast.rope: the first ROPE_DIMS dims of a head
// rotate, pairs (i, i + ROPE_DIMS/2) (or (2i, 2i+1) when traditional), angle
// rope_scale * off * 2^(-(i / (ROPE_DIMS/2)) * log2(base)); the rest pass.
//
// proj [B, P], P = 2*HQ*DH + 2*HKV*DH: one row of the concatenated q|k|v
// projection, [HQ x (q DH | gate DH) | HKV x k DH | HKV x v DH] (mlx-lm splits
// q_proj's output per head into query and gate).
//
// ATT_KIND 0, the new key: grid B*HKV warps. Inputs proj, w_k [DH], off
//   (int32, 0-d). Outputs k_new [B, HKV, 1, DH] and at (int32 [1]): off
//   clamped to [0, cap), the row the caller's slice updates write (MLX's
//   dynamic slice update does not bound its start). Scalars cap, eps_k,
//   log2_base, rope_scale.
// ATT_KIND 1, partial attention: grid B*HKV*NS blocks of G = HQ/HKV warps,
//   block (b, j, s) covers positions [s*split_len, (s+1)*split_len) that are
//   <= off, warp w is query head j*G + w. K/V rows go through shared memory
//   in tiles of TILE positions, two stages (cp.async: tile t + 1 is copied
//   while tile t is read; every warp reads every row); each lane owns DH/32
//   consecutive dims of q and of the accumulator; a tile's dot products are
//   summed across the warp by a transposed reduction that leaves one score
//   per lane (lane = position), so the online softmax rescales once per
//   tile. Dynamic shared memory: smem_bytes(G) of the wrapper. Inputs proj, keys, values [B, HKV, cap,
//   DH] (the buffers with this token's row written at off), off, w_q [DH].
//   Output part float32 [B*HQ*NS*(DH + 2)]: the unnormalised accumulators
//   [B*HQ*NS, DH] then (max, sum) in log2 units [B*HQ*NS, 2]. Scalars cap,
//   ns, split_len, eps_q, scale_log2 (= scale * log2(e)), log2_base,
//   rope_scale. Positions >= cap are never read, whatever off holds.
// ATT_KIND 2, combine and gate: grid B*HQ blocks of DH threads. Inputs part,
//   proj. Output out [B, 1, HQ*DH]. Scalar ns.
//
// Build macros: KNAME, ATT_KIND, ATT_X (activation/cache type), ATT_W (norm
// weight type), ATT_HQ, ATT_HKV, ATT_ROPE_DIMS, ATT_ROPE_TRAD.
#include "attention_body.cuh"

#if ATT_KIND == 0

extern "C" __global__ void __launch_bounds__(32) KNAME(
    const xt* __restrict__ proj,
    const wt* __restrict__ w_k,
    const int* __restrict__ offset,
    xt* __restrict__ k_new,
    int* __restrict__ at,
    int cap,
    float eps_k,
    float log2_base,
    float rope_scale) {
  __shared__ float sh[DH];
  const int lane = threadIdx.x;
  const int bj = blockIdx.x;  // b * HKV + j
  const int b = bj / HKV, j = bj % HKV;
  if (bj == 0 && lane == 0) {
    at[0] = min(max(*offset, 0), cap - 1);
  }
  float v[EL];
  load_lane(proj + (size_t)b * P + OFF_K + j * DH + lane * EL, v);
  norm_rope(v, w_k, eps_k, *offset, log2_base, rope_scale, sh);
  xt* o = k_new + (size_t)bj * DH + lane * EL;
#pragma unroll
  for (int e = 0; e < EL; e += 4) {
    store4(o + e, v + e);
  }
}

#elif ATT_KIND == 1

// The block's K/V tiles: stage t & 1 holds tile t while tile t + 1 is copied into the other.
constexpr int STAGE_BYTES = 2 * TILE * DH * (int)sizeof(xt);  // one K tile and one V tile

extern "C" __global__ void __launch_bounds__(G * 32) KNAME(
    const xt* __restrict__ proj,
    const xt* __restrict__ keys,
    const xt* __restrict__ values,
    const int* __restrict__ offset,
    const wt* __restrict__ w_q,
    float* __restrict__ part,
    int cap,
    int ns,
    int split_len,
    float eps_q,
    float scale_log2,
    float log2_base,
    float rope_scale) {
  // dynamic shared memory: 2 stages x (K tile, V tile) [TILE][DH] xt, then G rows of DH floats
  extern __shared__ __align__(16) unsigned char smem[];
  float* qsh = reinterpret_cast<float*>(smem + 2 * STAGE_BYTES);
  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int s = blockIdx.x % ns;
  const int bj = blockIdx.x / ns;  // b * HKV + j
  const int b = bj / HKV, j = bj % HKV;
  const int h = j * G + warp;
  const int off = *offset;

  // Positions of this split: [lo, hi), none past the query or the buffer.
  const int lo = s * split_len;
  const int hi = min(min(lo + split_len, off + 1), cap);
  const int tiles = hi > lo ? (hi - lo + TILE - 1) / TILE : 0;
  const size_t row0 = (size_t)bj * cap;
  // Tile t into stage st: rows past the split's end are zero-filled (no read), so every row of a
  // stage holds finite values.
  auto copy_tile = [&](int t, int st) {
    xt* kt = reinterpret_cast<xt*>(smem + st * STAGE_BYTES);
    copy_kv_tile<G * 32>(kt, kt + TILE * DH, keys, values, row0, lo + t * TILE, min(TILE, hi - (lo + t * TILE)), tid);
  };
  if (tiles > 0) {
    copy_tile(0, 0);  // in flight during the query's norm and rope
  }

  float q[EL];
  load_lane(proj + (size_t)b * P + h * 2 * DH + lane * EL, q);
  norm_rope(q, w_q, eps_q, off, log2_base, rope_scale, qsh + warp * DH);
#pragma unroll
  for (int e = 0; e < EL; ++e) {
    q[e] *= scale_log2;
  }

  float m = neg_inf(), l = 0.0f, acc[EL];
#pragma unroll
  for (int e = 0; e < EL; ++e) {
    acc[e] = 0.0f;
  }
  for (int t = 0; t < tiles; ++t) {
    const int st = t & 1;
    if (t + 1 < tiles) {
      copy_tile(t + 1, st ^ 1);  // the stage tile t - 1 used: freed by the barrier ending t - 1
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const xt* kt = reinterpret_cast<const xt*>(smem + st * STAGE_BYTES);
    const xt* vt = kt + TILE * DH;
    const int n = min(TILE, hi - (lo + t * TILE));
    tile_update(q, m, l, acc, kt, vt, n, lane);
    __syncthreads();
  }
  const size_t row = ((size_t)b * HQ + h) * ns + s;
  float* pa = part + row * DH + lane * EL;
#pragma unroll
  for (int e = 0; e < EL; e += 4) {
    store4(pa + e, acc + e);
  }
  if (lane == 0) {  // (max, sum) after all B*HQ*NS accumulators (= gridDim.x * G rows)
    float* ml = part + (size_t)gridDim.x * G * DH + row * 2;
    ml[0] = m;
    ml[1] = l;
  }
}

#elif ATT_KIND == 2

extern "C" __global__ void __launch_bounds__(DH) KNAME(
    const float* __restrict__ part,
    const xt* __restrict__ proj,
    xt* __restrict__ out,
    int ns) {
  extern __shared__ float wsh[];  // ns weights 2^(m_s - M)
  __shared__ float red[DH / 32];
  __shared__ float tot[2];
  combine_head<DH, PlainLoad>(part, (size_t)gridDim.x * ns, proj, out, ns, blockIdx.x, wsh, red, tot);
}

#endif
