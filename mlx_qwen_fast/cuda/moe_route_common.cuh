// Softmax + top-k of one token's router logits by one warp (MoE routing).
// route_row is the whole per-token routing; the routing kernel's stage 1
// (moe_routing.cu), the decode gate+up kernel's in-kernel routing
// (moe_decode_gemv.cu, MDG_ROUTE) and the one-launch MoE block
// (moe_block_decode.cu, through route_row_ld: logits read through L2) all
// call it, so that all select the same experts with the same weights, bit
// for bit.
// All 32 lanes of the warp call these together (warp shuffles and reductions).
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
  // the sum with add.rn: never contracted with the exponential's last
  // multiply, whatever kernel this is inlined into (the same bits in each)
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    p[i] = expf(p[i] - m);
    s = __fadd_rn(s, p[i]);
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
  // keys: probability bits + 1 (p >= 0: the bits order as the values), read
  // as 0 once taken. The taken experts are a bit mask (bit i: expert
  // i * 32 + lane), so that the keys are never written at a run-time index
  // (which puts the array in local memory).
  unsigned key[EPL];
#pragma unroll
  for (int i = 0; i < EPL; ++i) key[i] = __float_as_uint(p[i]) + 1u;
  unsigned taken = 0u;
  unsigned bk;
  int bi;  // the lane's best: the lowest i among its largest keys
  auto lane_best = [&]() {
    bk = (taken & 1u) ? 0u : key[0];
    bi = 0;
#pragma unroll
    for (int i = 1; i < EPL; ++i) {
      const unsigned ki = ((taken >> i) & 1u) ? 0u : key[i];
      if (ki > bk) {
        bk = ki;
        bi = i;
      }
    }
  };
  lane_best();
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
      taken |= 1u << (id >> 5);
      lane_best();
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

// One token's routing from its E logits, logit i read as ld(i) (fp32): lane
// l loads logits l, l + 32, ..., route_warp, then with normalize each of the
// K probabilities divided by their sum (one IEEE division). On return lane
// j < K holds slot j (decreasing probability, ties: lower expert id first):
// expert my_i, weight my_s.
template <int E, int K, class LD>
__device__ __forceinline__ void route_row_ld(LD ld, bool normalize, int& my_i, float& my_s) {
  constexpr int EPL = E / 32;
  const int lane = threadIdx.x & 31;
  float p[EPL];
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    p[i] = ld(i * 32 + lane);
  }
  float my_p, tot;
  route_warp<E, K>(p, my_i, my_p, tot);
  my_s = normalize ? my_p / tot : my_p;
}

// route_row_ld from a row of E logits of type LT (float, bf16_t or f16_t).
template <int E, int K, class LT>
__device__ __forceinline__ void route_row(const LT* __restrict__ row, bool normalize, int& my_i, float& my_s) {
  route_row_ld<E, K>([&](int i) { return to_f(row[i]); }, normalize, my_i, my_s);
}
