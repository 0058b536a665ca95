// MoE routing on the GPU after the router matmul: softmax, top-k, grouping of
// the N*k assignments by expert and the (expert, row tile) block map, with no
// host synchronisation and grids that depend only on N (never on the data).
//
// Contract: mlx_qwen_fast/ops/moe/naive.py (route, group_by_expert, block_map).
//
// One source, three kernels, chosen by MOE_STAGE:
//
// MOE_STAGE 1 (route): one warp per token, 8 tokens per 256-thread block.
//   fp32 softmax over E logits (max-subtracted expf, one division), then k
//   rounds of a warp arg-max (ties: lower expert id first), renormalised by
//   the sum of the k probabilities when `normalize`. Slots are written in
//   decreasing probability.
//   Inputs: logits [N, E] (MOE_LT). Outputs: inds [N, K] int32,
//   scores [N, K] float. Scalars: int N, int normalize.
//   With MOE_SHARED (the shared expert as one more expert of every token):
//   K + 1 slots per token, slot K holding expert id E (one past the routed
//   ids) with weight sigmoid(logit) in fp32, outputs inds / scores
//   [N, K + 1]; the shared expert's gate logit comes from a second input
//   [N] (MOE_SHARED 1) or from column E of the logits, whose rows are then
//   E + 32 wide (MOE_SHARED 2: the router and the gate as one padded matmul).
//   Launch: ceil(N/8)*256 threads, 256 per block.
//
// MOE_STAGE 2 (count) and 3 (scatter): the grouping, over C CTAs of 1024
//   threads, CTA c taking the assignments [c*chunk, (c+1)*chunk).
//   count: a shared-memory histogram of the CTA's chunk -> part [C, E].
//   scatter: every CTA sums part's columns (all chunks -> counts, the chunks
//   before its own -> its start within each expert), scans the counts over
//   the experts (-> offsets), and places its chunk's assignments: `order`
//   groups assignments by expert, chunk by chunk, but is NOT stable within a
//   chunk (the order among one expert's assignments of one chunk is whatever
//   the shared atomics give; the set is exact). CTA 0 also writes counts,
//   offsets [E+1] and the block map [max_tiles, 2] of (expert, tile), (-1,
//   -1) past the end (tiles per expert ceil(count/tile), scanned). Both
//   stages are warp-aggregated: the lanes of a warp holding the same expert
//   (one ballot per bit of the id) share one shared-memory atomic, which a
//   skewed router (a few experts taking most rows) would otherwise
//   serialise.
//   Inputs: inds [NK] int32 (values in [0, E); others are undefined
//   behaviour, as in ops.moe.group_by_expert); scatter also part.
//   Outputs (scatter): counts [E], offsets [E+1], order [NK],
//   sorted_experts [NK], inverse [NK] (grouped row of each assignment),
//   block_map [max_tiles, 2], all int32. Scalars: int NK, int chunk (a
//   multiple of 1024), scatter also int tile, int max_tiles. Launch: C * 1024
//   threads, 1024 per block, C = ceil(NK / chunk) (>= 1), the same C for both.
//   cuda-check: order-free outputs 2, 4 (scatter's order and inverse follow
//   the order of the shared atomics; tests/cuda_check.py compares them between
//   thread schedules as sets)
//
// Build macros: KNAME, MOE_STAGE, MOE_E (experts, multiple of 32, <= 1024),
// MOE_K (top-k, stage 1), MOE_LT (logit type, stage 1), MOE_SHARED (stage 1,
// 0, 1 or 2: the shared expert's slot and where its logit is; K + 1 <= 32, and
// the grouping then counts E rounded up to the next multiple of 32 experts,
// at most 1024: E <= 992).
#include "moe_route_common.cuh"

#ifndef MOE_E
#define MOE_E 256
#endif

#if MOE_STAGE == 1

#ifndef MOE_SHARED
#define MOE_SHARED 0
#endif
typedef MOE_LT lt;
constexpr int E = MOE_E;
constexpr int K = MOE_K;
constexpr int KS = K + (MOE_SHARED ? 1 : 0);  // slots per token
constexpr int LD = MOE_SHARED == 2 ? E + 32 : E;  // logits per row
static_assert(KS <= 32, "top-k plus the shared slot must fit one warp");

extern "C" __global__ void __launch_bounds__(256) KNAME(
    const lt* __restrict__ logits,
#if MOE_SHARED == 1
    const lt* __restrict__ shared_logits,
#endif
    int* __restrict__ inds,
    float* __restrict__ scores,
    int N,
    int normalize) {
  const int lane = threadIdx.x & 31;
  const int n = blockIdx.x * 8 + (threadIdx.x >> 5);
  if (n >= N) {
    return;  // whole warp leaves together
  }
  const lt* row = logits + (size_t)n * LD;
  int my_i;
  float my_s;
  route_row<E, K>(row, normalize != 0, my_i, my_s);
  if (lane < K) {
    inds[(size_t)n * KS + lane] = my_i;
    scores[(size_t)n * KS + lane] = my_s;
  }
#if MOE_SHARED
  if (lane == K) {
#if MOE_SHARED == 1
    const float sl = to_f(shared_logits[n]);
#else
    const float sl = to_f(row[E]);
#endif
    inds[(size_t)n * KS + K] = E;
    scores[(size_t)n * KS + K] = 1.0f / (1.0f + expf(-sl));
  }
#endif
}

#else  // MOE_STAGE 2 (count) and 3 (scatter)

constexpr int E = MOE_E;
constexpr int NT = 1024;
static_assert(E <= NT, "E must be <= 1024");
constexpr int EBITS = E <= 32 ? 5 : E <= 64 ? 6 : E <= 128 ? 7 : E <= 256 ? 8 : E <= 512 ? 9 : 10;

// Lanes of this warp holding the same expert e (valid lanes only; every lane
// must call it). Built from one ballot per bit of e: cheaper than
// __match_any_sync, and it lets a warp take one shared atomic per distinct
// expert instead of one per assignment (a skewed router sends most of a
// warp's assignments to a few experts, whose atomics would serialise).
__device__ __forceinline__ unsigned expert_peers(int e, bool valid) {
  const unsigned v = __ballot_sync(0xffffffffu, valid);
  unsigned m = valid ? v : 0u;
#pragma unroll
  for (int b = 0; b < EBITS; ++b) {
    const bool bit = (e >> b) & 1;
    const unsigned bb = __ballot_sync(0xffffffffu, bit);
    m &= bit ? bb : ~bb;
  }
  return m;
}

#if MOE_STAGE == 2

// count: part[c, e] = number of assignments to expert e in CTA c's chunk.
extern "C" __global__ void __launch_bounds__(1024) KNAME(
    const int* __restrict__ inds,
    int* __restrict__ part,
    int NK,
    int chunk) {
  __shared__ int hist[E];
  const int tid = threadIdx.x, lane = tid & 31;
  if (tid < E) hist[tid] = 0;
  __syncthreads();
  // CTA c's assignments [c*chunk, min(NK, (c+1)*chunk)), one per thread per
  // round; every thread runs the same rounds (the ballots need whole warps).
  const int cbeg = blockIdx.x * chunk, cend = min(NK, cbeg + chunk);
  for (int a0 = cbeg; a0 < cend; a0 += NT) {
    const int a = a0 + tid;
    const bool valid = a < cend;
    const int e = valid ? inds[a] : 0;
    const unsigned peers = expert_peers(e, valid);
    if (valid && lane == __ffs(peers) - 1) atomicAdd(&hist[e], __popc(peers));
  }
  __syncthreads();
  if (tid < E) part[(size_t)blockIdx.x * E + tid] = hist[tid];
}

#elif MOE_STAGE == 3

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

// scatter: every CTA sums the count table's columns (all chunks, and the
// chunks before its own), scans them over the experts, and places its
// chunk's assignments from there; CTA 0 also writes counts, offsets and the
// block map.
extern "C" __global__ void __launch_bounds__(1024) KNAME(
    const int* __restrict__ inds,
    const int* __restrict__ part,
    int* __restrict__ counts,
    int* __restrict__ offsets,
    int* __restrict__ order,
    int* __restrict__ sorted_experts,
    int* __restrict__ inverse,
    int* __restrict__ bmap,
    int NK,
    int chunk,
    int tile,
    int max_tiles) {
  __shared__ int cursor[E];
  __shared__ int tend[E];
  __shared__ int wsum[32];
  const int tid = threadIdx.x, lane = tid & 31;
  const int my = blockIdx.x, nchunks = gridDim.x;
  int c = 0, before = 0;
  if (tid < E) {
    for (int j = 0; j < nchunks; ++j) {
      const int v = part[(size_t)j * E + tid];
      c += v;
      before += j < my ? v : 0;
    }
  }
  const int incl = block_incl_scan(c, wsum);
  if (tid < E) cursor[tid] = incl - c + before;

  if (my == 0) {
    const int ntile = (c + tile - 1) / tile;
    const int tincl = block_incl_scan(ntile, wsum);
    if (tid < E) {
      counts[tid] = c;
      offsets[tid + 1] = incl;
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
        t = i - (e > 0 ? tend[e - 1] : 0);
      }
      bmap[2 * i] = e;
      bmap[2 * i + 1] = t;
    }
  }
  __syncthreads();

  // The warp's leader for an expert takes __popc(peers) slots with one
  // atomic; each peer's slot is the leader's old cursor plus its rank among
  // the peers (lanes below it).
  const unsigned below = (1u << lane) - 1u;
  const int cbeg = my * chunk, cend = min(NK, cbeg + chunk);
  for (int a0 = cbeg; a0 < cend; a0 += NT) {
    const int a = a0 + tid;
    const bool valid = a < cend;
    const int e = valid ? inds[a] : 0;
    const unsigned peers = expert_peers(e, valid);
    const int leader = valid ? __ffs(peers) - 1 : 0;
    int base = 0;
    if (valid && lane == leader) base = atomicAdd(&cursor[e], __popc(peers));
    base = __shfl_sync(0xffffffffu, base, leader);
    if (valid) {
      const int pos = base + __popc(peers & below);
      order[pos] = a;
      sorted_experts[pos] = e;
      inverse[a] = pos;
    }
  }
}

#else
#error "MOE_STAGE must be 1 (route), 2 (count) or 3 (scatter)"
#endif
#endif

