// Softmax + top-k of one token's router logits by one warp (MoE routing):
// the routing kernel's stage 1 (moe_routing.cu) as a device function, for any
// kernel that routes inside itself.
// All 32 lanes of the warp call it together (warp shuffles and reductions).
#pragma once
#include "gdn_common.cuh"

// p: the lane's logits, p[i] = logit of expert i * 32 + lane (E % 32 == 0).
// fp32 softmax over the E logits (max-subtracted expf, one division), then K
// rounds of a warp arg-max (ties: lower expert id first; sm_80+: two redux.sync
// per round on (probability bits, expert id)). On return lane j < K
// holds slot j (decreasing probability): expert my_i, probability my_p; tot
// (every lane) is the sum of the K probabilities. p is overwritten.
template <int E, int K>
__device__ __forceinline__ void route_warp(float (&p)[E / 32], int& my_i, float& my_p, float& tot) {
  static_assert(E % 32 == 0, "E must be a multiple of 32");
  static_assert(K >= 1 && K <= 32 && K <= E, "1 <= K <= min(32, E)");
  constexpr int EPL = E / 32;
  const int lane = threadIdx.x & 31;
  float m = __int_as_float(0xff800000);  // -inf
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    m = fmaxf(m, p[i]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  }
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    p[i] = expf(p[i] - m);
    s += p[i];
  }
  s = warp_sum(s);
  const float inv = 1.0f / s;
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    p[i] = p[i] * inv;  // >= 0; taken entries become -1
  }
  my_p = 0.0f;
  tot = 0.0f;
  my_i = 0;
#if __CUDA_ARCH__ >= 800
  // keys: probability bits + 1 (p >= 0: the bits order as the values), 0 once taken
  unsigned key[EPL];
#pragma unroll
  for (int i = 0; i < EPL; ++i) key[i] = __float_as_uint(p[i]) + 1u;
  unsigned bk = key[0];
  int bi = 0;  // the lane's best: the lowest i among its largest keys
#pragma unroll
  for (int i = 1; i < EPL; ++i)
    if (key[i] > bk) {
      bk = key[i];
      bi = i;
    }
#pragma unroll 1
  for (int j = 0; j < K; ++j) {
    const unsigned m = __reduce_max_sync(0xffffffffu, bk);
    // the lowest expert id (i * 32 + lane) among the lanes holding the maximum
    const unsigned id = __reduce_min_sync(0xffffffffu, bk == m ? (unsigned)(bi * 32 + lane) : 0xffffffffu);
    const float bp = __uint_as_float(m - 1u);
    tot += bp;
    if (lane == j) {
      my_p = bp;
      my_i = (int)id;
    }
    if (lane == (int)(id & 31u)) {
#pragma unroll
      for (int i = 0; i < EPL; ++i)
        if (i == (int)(id >> 5)) key[i] = 0u;
      bk = key[0];
      bi = 0;
#pragma unroll
      for (int i = 1; i < EPL; ++i)
        if (key[i] > bk) {
          bk = key[i];
          bi = i;
        }
    }
  }
#else
#pragma unroll
  for (int j = 0; j < K; ++j) {
    float bp = p[0];
    int bi = lane;
#pragma unroll
    for (int i = 1; i < EPL; ++i) {
      if (p[i] > bp) {  // strict: the lower id wins ties within a lane
        bp = p[i];
        bi = i * 32 + lane;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float op = __shfl_xor_sync(0xffffffffu, bp, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (op > bp || (op == bp && oi < bi)) {
        bp = op;
        bi = oi;
      }
    }
    // every lane now holds the same (bp, bi)
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      if (bi == i * 32 + lane) {
        p[i] = -1.0f;
      }
    }
    tot += bp;
    if (lane == j) {
      my_p = bp;
      my_i = bi;
    }
  }
#endif
}
