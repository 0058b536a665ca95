// MoE routing on the GPU after the router matmul: softmax, top-k, grouping of
// the N*k assignments by expert and the (expert, row tile) block map, with no
// host synchronisation and grids that depend only on N (never on the data).
//
// Contract: mlx_qwen_fast/ops/moe.py (route, group_by_expert, block_map).
//
// One source, two kernels, chosen by MOE_STAGE:
//
// MOE_STAGE 1 (route): one warp per token, 8 tokens per 256-thread block.
//   fp32 softmax over E logits (max-subtracted expf, one division), then k
//   rounds of a warp arg-max (ties: lower expert id first), renormalised by
//   the sum of the k probabilities when `normalize`. Slots are written in
//   decreasing probability.
//   Inputs: logits [N, E] (MOE_LT). Outputs: inds [N, K] int32,
//   scores [N, K] float. Scalars: int N, int normalize.
//   Launch: ceil(N/8)*256 threads, 256 per block.
//
// MOE_STAGE 2 (group): a single 1024-thread block.
//   shared-memory histogram (atomics) -> counts [E]; block scan ->
//   offsets [E+1]; tiles per expert ceil(count/tile) and their scan -> the
//   block map [max_tiles, 2] of (expert, tile), (-1, -1) past the end; then
//   the scatter: each assignment takes the next slot of its expert from a
//   shared cursor, so `order` groups assignments by expert but is NOT stable
//   within an expert (the order of one expert's assignments is whatever the
//   atomics give; the set is exact). Histogram and scatter are
//   warp-aggregated: the lanes of a warp holding the same expert
//   (__match_any_sync) share one shared-memory atomic, which the skewed
//   routers of real models (a few experts taking most rows) would otherwise
//   serialise. Also writes sorted_experts [N*K] and
//   inverse [N*K] (grouped row of each assignment).
//   Inputs: inds [N*K] int32 (values in [0, E); others are undefined
//   behaviour, as in ops.moe.group_by_expert). Outputs: counts [E],
//   offsets [E+1], order [NK], sorted_experts [NK], inverse [NK],
//   block_map [max_tiles, 2], all int32. Scalars: int NK, int tile,
//   int max_tiles. Launch: 1024 threads, one block.
//
// Build macros: KNAME, MOE_STAGE, MOE_E (experts, multiple of 32, <= 1024),
// MOE_K (top-k, stage 1), MOE_LT (logit type, stage 1).
#include "moe_route_common.cuh"

#ifndef MOE_E
#define MOE_E 256
#endif

#if MOE_STAGE == 1

typedef MOE_LT lt;
constexpr int E = MOE_E;
constexpr int K = MOE_K;
constexpr int EPL = E / 32;  // logits per lane

extern "C" __global__ void __launch_bounds__(256) KNAME(
    const lt* __restrict__ logits,
    int* __restrict__ inds,
    float* __restrict__ scores,
    int N,
    int normalize) {
  const int lane = threadIdx.x & 31;
  const int n = blockIdx.x * 8 + (threadIdx.x >> 5);
  if (n >= N) {
    return;  // whole warp leaves together
  }
  const lt* row = logits + (size_t)n * E;
  float p[EPL];
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    p[i] = to_f(row[i * 32 + lane]);
  }
  int my_i;
  float my_p, tot;
  route_warp<E, K>(p, my_i, my_p, tot);
  if (lane < K) {
    inds[(size_t)n * K + lane] = my_i;
    scores[(size_t)n * K + lane] = normalize ? my_p / tot : my_p;
  }
}

#elif MOE_STAGE == 2

constexpr int E = MOE_E;
constexpr int NT = 1024;
static_assert(E <= NT, "E must be <= 1024");

// Inclusive scan of one int per thread over the 1024-thread block.
__device__ __forceinline__ int block_incl_scan(int v, int* wsum) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int t = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += t;
  }
  if (lane == 31) wsum[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int w = wsum[lane];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int t = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += t;
    }
    wsum[lane] = w;
  }
  __syncthreads();
  if (warp > 0) v += wsum[warp - 1];
  __syncthreads();  // wsum is reused by the next scan
  return v;
}

constexpr int U = 8;  // 32-assignment chunks per warp per pass (loads in flight)

// Experts of assignments a0 + u*32 + lane (u < U); -1 past NK.
__device__ __forceinline__ void load_experts(const int* __restrict__ inds, int NK, int a0, int (&ev)[U]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int a = a0 + u * 32 + lane;
    ev[u] = a < NK ? inds[a] : -1;
  }
}

extern "C" __global__ void __launch_bounds__(1024) KNAME(
    const int* __restrict__ inds,
    int* __restrict__ counts,
    int* __restrict__ offsets,
    int* __restrict__ order,
    int* __restrict__ sorted_experts,
    int* __restrict__ inverse,
    int* __restrict__ bmap,
    int NK,
    int tile,
    int max_tiles) {
  __shared__ int hist[E];
  __shared__ int cursor[E];
  __shared__ int tend[E];
  __shared__ int wsum[32];
  const int tid = threadIdx.x, lane = tid & 31;
  for (int e = tid; e < E; e += NT) hist[e] = 0;
  __syncthreads();
  // Histogram: U coalesced loads in flight per thread, then one shared atomic
  // per distinct expert per warp (its peers' count), not one per assignment.
  for (int a0 = (tid >> 5) * 32 * U; a0 < NK; a0 += NT * U) {
    int ev[U];
    load_experts(inds, NK, a0, ev);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const unsigned peers = __match_any_sync(0xffffffffu, ev[u]);
      if (ev[u] >= 0 && lane == __ffs(peers) - 1) atomicAdd(&hist[ev[u]], __popc(peers));
    }
  }
  __syncthreads();

  const int c = tid < E ? hist[tid] : 0;
  const int incl = block_incl_scan(c, wsum);
  const int ntile = (c + tile - 1) / tile;
  const int tincl = block_incl_scan(ntile, wsum);
  if (tid < E) {
    counts[tid] = c;
    offsets[tid + 1] = incl;
    cursor[tid] = incl - c;
    tend[tid] = tincl;
  }
  if (tid == 0) offsets[0] = 0;
  __syncthreads();

  const int total = tend[E - 1];
  for (int i = tid; i < max_tiles; i += NT) {
    int e = -1, t = -1;
    if (i < total) {
      // first expert whose tiles end after item i
      int lo = 0, hi = E - 1;
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (tend[mid] > i) hi = mid; else lo = mid + 1;
      }
      e = lo;
      const int start = e > 0 ? tend[e - 1] : 0;
      t = i - start;
    }
    bmap[2 * i] = e;
    bmap[2 * i + 1] = t;
  }

  // Scatter, aggregated the same way: the warp's leader for an expert takes
  // __popc(peers) slots with one atomic; each peer's slot is the leader's old
  // cursor plus its rank among the peers (lanes below it).
  const unsigned below = (1u << lane) - 1u;
  for (int a0 = (tid >> 5) * 32 * U; a0 < NK; a0 += NT * U) {
    int ev[U];
    load_experts(inds, NK, a0, ev);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int e = ev[u];
      const unsigned peers = __match_any_sync(0xffffffffu, e);
      const int leader = __ffs(peers) - 1;
      int base = 0;
      if (e >= 0 && lane == leader) base = atomicAdd(&cursor[e], __popc(peers));
      base = __shfl_sync(0xffffffffu, base, leader);
      if (e >= 0) {
        const int a = a0 + u * 32 + lane;
        const int pos = base + __popc(peers & below);
        order[pos] = a;
        sorted_experts[pos] = e;
        inverse[a] = pos;
      }
    }
  }
}

#else
#error "MOE_STAGE must be 1 (route) or 2 (group)"
#endif
