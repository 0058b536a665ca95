// Decode MoE experts in one launch (one token, N*k + 1 items small enough for
// shared memory): the two kernels of moe_decode_gemv.cu in one grid, the down
// weights fetched into L2 while gate + up runs.
//
// Fuses: gate + up + SwiGLU (+ shared expert, + shared-expert gate) and down
// + routing weights + shared expert + combine, i.e. moe_decode_gemv.cu's
// MDG_KIND 0 and 1, with the same tile arithmetic and the same summation
// order (equal bits, tests/test_cuda_moe_decode_overlap.py).
//
// Grid: GU = (I/16) (NK + 2) CTAs of 256 threads, CTA c the gate+up tile of
// moe_decode_gate_up.cuh (rb = c % (I/16), item = c / (I/16)); CTAs c < DN =
// D/16 also compute y rows [16 c, +16):
//   1. first of all (the down weights depend on inds only) warp 0 issues
//      cp.async.bulk.prefetch.L2 of its items' 16 down rows, scales and
//      biases (one lane per item: 4 KB + 2 x 256 B at I = 512);
//   2. the gate+up tile; then every CTA adds 1 to a counter (release:
//      __syncthreads, then thread 0's __threadfence and atomicAdd);
//   3. thread 0 polls the counter with ld.acquire.gpu until it reads GU; the
//      CTA copies the items' rows from L2 into its (now free) shared memory,
//      stages h and sgate through L2 (ld.global.cg), computes the items and
//      stores y; the last of the DN CTAs resets the counter to zero (the next
//      launch, later in the stream, sees zero).
// A first version with DN separate down CTAs that copied their rows into
// shared memory at once was slower than the two kernels (14.3 vs 13.4 us per
// layer, H200): their copies issued behind the gate+up CTAs' (~5 us late)
// and the 448 CTAs did not fit one wave (bench/results/moe-cuda-log.md).
//
// No deadlock whatever the CTA dispatch order: only the DN CTAs wait, after
// their own tile, and they cannot hold every slot of the GPU (the wrapper
// checks DN < the SM count); the others never wait.
//
// sync: uint32 [64] persistent, zero before the first launch (the block's
// barrier buffer of moe_decode_fused, words SY_GU and SY_DN here).
//
// Down shared memory (dynamic; reuses the gate+up tile's, which is done):
//   dw  [NK + 1][RB][DROW] bytes: the items' 16 weight rows (I/2 bytes
//       each, rows padded to DROW = I/2 + 64 bytes: conflict-free LDS.128)
//   dsb [NK + 1][2][RB][I/64] bf16: scales (0), biases (1)
//   hs  [NK + N][I] bf16: h
//   ired [NK + 1][RB][N] float: each item's weighted output, summed in slot
//        order (as moe_decode_gemv.cu's down kernel)
//
// Inputs: x [N, D] bf16, inds [N*k] int32/uint32, scores [N*k] float, the
// routed experts (wg, sg, bg, wu, su, bu, wd, sd, bd), the shared expert
// (xwg, xsg, xbg, xwu, xsu, xbu, xwd, xsd, xbd), the shared-expert gate (gw,
// gs, gb), sync. Outputs: h [NK + N, I] bf16 (workspace), sgate [N] float,
// y [N, D] bf16.
//
// Build macros: KNAME, MDG_N, MDG_K, MDG_D, MDG_I, MDG_SGB as
// moe_decode_gemv.cu; MDG_TIMING: phase stamps (benchmarks).
#include "moe_decode_common.cuh"

constexpr int N = MDG_N;
constexpr int TOPK = MDG_K;
constexpr int NK = N * TOPK;
constexpr int D = MDG_D;
constexpr int I = MDG_I;
constexpr int NW = 8;
constexpr int NT = 32 * NW;
constexpr int RB = 16;
typedef bf16_t yt;
static_assert(N >= 1 && N <= 4 && NK < 32, "1 <= N <= 4, N * k < 32 (slot N*k is a bit of a 32-bit mask)");
static_assert(D % 256 == 0 && I % 128 == 0, "D % 256 == 0 and I % 128 == 0");


#include "moe_decode_gate_up.cuh"

constexpr int GU = (I / RB) * (NK + 2);  // gate+up CTAs
constexpr int DN = D / RB;               // down CTAs
constexpr int ITEMS = NK + 1;
constexpr int NU = I / 128;      // 16-byte words per lane per row (down)
constexpr int DKW = I / 8;       // packed words per down row
constexpr int DKG = I / 64;      // groups per down row
constexpr int DROW = I / 2 + 64;  // padded row bytes in shared memory
constexpr int OFF_DSB = ITEMS * RB * DROW;
constexpr int OFF_H = OFF_DSB + ITEMS * 2 * RB * DKG * 2;
constexpr int OFF_IRED = OFF_H + (NK + N) * I * 2;
constexpr int DN_SMEM = OFF_IRED + ITEMS * RB * N * 4;
constexpr int SMEM = DN_SMEM > GU_SMEM ? DN_SMEM : GU_SMEM;  // = smem_bytes() of kernels/moe_decode_overlap.py
constexpr int SY_GU = 32, SY_DN = 33;  // words of sync
static_assert(DN <= GU, "the first D/16 CTAs compute the down rows");
static_assert(OFF_DSB % 16 == 0 && OFF_H % 16 == 0 && OFF_IRED % 16 == 0, "16-byte aligned regions");

// Fetch [p, p + bytes) into L2 (bytes a multiple of 16, p 16-byte aligned; sm_90).
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
}

__device__ __forceinline__ unsigned ld_acquire_u32(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

extern "C" __global__ void __launch_bounds__(NT, 3) KNAME(
    const bf16_t* __restrict__ x,
    const int* __restrict__ inds,
    const float* __restrict__ scores,
    const unsigned* __restrict__ wg, const bf16_t* __restrict__ sg, const bf16_t* __restrict__ bg,
    const unsigned* __restrict__ wu, const bf16_t* __restrict__ su, const bf16_t* __restrict__ bu,
    const unsigned* __restrict__ wd, const bf16_t* __restrict__ sd, const bf16_t* __restrict__ bd,
    const unsigned* __restrict__ xwg, const bf16_t* __restrict__ xsg, const bf16_t* __restrict__ xbg,
    const unsigned* __restrict__ xwu, const bf16_t* __restrict__ xsu, const bf16_t* __restrict__ xbu,
    const unsigned* __restrict__ xwd, const bf16_t* __restrict__ xsd, const bf16_t* __restrict__ xbd,
    const void* __restrict__ gw, const bf16_t* __restrict__ gs, const bf16_t* __restrict__ gb,
    const unsigned* sync_in,
    bf16_t* h,
    float* sgate,
    yt* __restrict__ y TIMING_ARG) {
  extern __shared__ __align__(16) unsigned char dsm[];
  unsigned* sync = const_cast<unsigned*>(sync_in);  // a persistent buffer the kernel owns
  {
    unsigned dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (dyn < SMEM) __trap();
  }
  const int c = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const bool dn = c < DN;  // this CTA also computes y rows [16 c, +16)
  const int row0 = c * RB;

  // ---- down CTA: its items, and their rows into L2 before anything else ----
  // items: the pair slots whose expert no lower slot lists, then the shared
  // expert (slot NK), as moe_decode_gemv.cu's down kernel
  int my_e = -1;
  unsigned items = 0;
  if (dn) {
    my_e = lane < NK ? inds[lane] : -1;
    const unsigned same = __match_any_sync(0xffffffffu, my_e);
    items = __ballot_sync(0xffffffffu, lane < NK && __ffs(same) - 1 == lane) | (1u << NK);
    if (warp == 0 && lane < ITEMS && ((items >> lane) & 1u)) {  // lane = slot
      const unsigned* W = lane == NK ? xwd : wd + (size_t)my_e * D * DKW;
      const bf16_t* S = lane == NK ? xsd : sd + (size_t)my_e * D * DKG;
      const bf16_t* B = lane == NK ? xbd : bd + (size_t)my_e * D * DKG;
      prefetch_l2(W + (size_t)row0 * DKW, RB * DKW * 4);
      prefetch_l2(S + (size_t)row0 * DKG, RB * DKG * 2);
      prefetch_l2(B + (size_t)row0 * DKG, RB * DKG * 2);
    }
  }

  // ---- gate + up: the tile of moe_decode_gemv.cu, then arrive ---------------
  {
    const GateUpArgs a{x, inds, wg, wu, xwg, xwu, sg, bg, su, bu, xsg, xbg, xsu, xbu, gw, gs, gb, h, sgate
#ifdef MDG_TIMING
                       , tim
#endif
    };
    gate_up_cta(a, c / (I / RB), c % (I / RB), dsm);
  }
  __syncthreads();  // every store of the CTA (h rows, sgate) is made; its shared memory is free
  if (tid == 0) {
    __threadfence();
    atomicAdd(sync + SY_GU, 1u);
  }
  if (!dn) return;

  // ---- down rows [16 c, +16) of y -------------------------------------------
  unsigned char* dw = dsm;
  gdn_u16 (*dsb)[2][RB][DKG] = reinterpret_cast<gdn_u16 (*)[2][RB][DKG]>(dsm + OFF_DSB);
  gdn_u16 (*hs)[I] = reinterpret_cast<gdn_u16 (*)[I]>(dsm + OFF_H);
  float (*ired)[RB][N] = reinterpret_cast<float (*)[RB][N]>(dsm + OFF_IRED);
  const float my_s = lane < NK ? scores[lane] : 0.0f;
  // wait for every gate+up CTA (~2 s without progress: a broken buffer or
  // launch, fail loudly)
  if (tid == 0) {
    unsigned spins = 0;
    while (ld_acquire_u32(sync + SY_GU) < (unsigned)GU) {
      __nanosleep(64);
      if (++spins == (1u << 25)) __trap();
    }
  }
  __syncthreads();
  STAMP(6);  // h ready
  // the items' rows, scales, biases (from L2 by now) -> shared memory
#pragma unroll 1
  for (int sl = 0; sl < ITEMS; ++sl) {
    if (!((items >> sl) & 1u)) continue;
    const int e = sl == NK ? -1 : __shfl_sync(0xffffffffu, my_e, sl);
    const unsigned* W = e < 0 ? xwd : wd + (size_t)e * D * DKW;
    const bf16_t* S = e < 0 ? xsd : sd + (size_t)e * D * DKG;
    const bf16_t* B = e < 0 ? xbd : bd + (size_t)e * D * DKG;
    for (int p = tid; p < RB * (I / 32); p += NT) {  // 16-byte pieces of the rows
      const int r = p / (I / 32), q = p % (I / 32);
      cp_async16(dw + (sl * RB + r) * DROW + 16 * q, W + (size_t)(row0 + r) * DKW + 4 * q);
    }
    for (int p = tid; p < 2 * RB * (DKG / 2); p += NT) {  // scales, biases: 4 bytes = 2 groups
      const int arr = p / (RB * (DKG / 2)), r = (p / (DKG / 2)) % RB, q = p % (DKG / 2);
      cp_async4(&dsb[sl][arr][r][2 * q], (arr ? B : S) + (size_t)(row0 + r) * DKG + 2 * q);
    }
  }
  cp_async_commit();
  // h and sgate through L2 (written by other CTAs of this launch)
  for (int i = tid; i < (NK + N) * I / 8; i += NT)
    *reinterpret_cast<uint4*>(&hs[0][0] + 8 * i) = __ldcg(reinterpret_cast<const uint4*>(h) + i);
  float sgv[N];
#pragma unroll
  for (int n = 0; n < N; ++n) sgv[n] = __ldcg(sgate + n);
  cp_async_wait_all();
  __syncthreads();

  // warp w computes slots w, w + NW, ... from shared memory
#pragma unroll 1
  for (int sl = warp; sl < ITEMS; sl += NW) {
    if (!((items >> sl) & 1u)) continue;
    const int e = sl == NK ? -1 : __shfl_sync(0xffffffffu, my_e, sl);
    int hrow;
    float cf0, cf1;
    item_coefs<N, TOPK>(e, my_e, my_s, [&](int n) { return sgv[n]; }, lane, g, t, hrow, cf0, cf1);
    float yacc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    down_item<NU>(
        yacc,
        [&](int u, uint4(&A)[2], unsigned(&s2)[2], unsigned(&b2)[2]) {
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int r = g + 8 * hh;
            A[hh] = *reinterpret_cast<const uint4*>(dw + (sl * RB + r) * DROW + 64 * u + 16 * t);
            const unsigned sv = dsb[sl][0][r][2 * u + (t >> 1)], bv = dsb[sl][1][r][2 * u + (t >> 1)];
            s2[hh] = sv | (sv << 16);
            b2[hh] = bv | (bv << 16);
          }
        },
        hrow >= 0 ? &hs[hrow][0] : nullptr, t, cf0, cf1);
#pragma unroll
    for (int cc = 0; cc < 4; ++cc) {
      const int tok = 2 * t + (cc & 1);
      if (tok < N) ired[sl][g + 8 * (cc >> 1)][tok] = yacc[cc];
    }
  }
  __syncthreads();
  if (tid < RB * N) {
    const int r = tid % RB, n = tid / RB;
    float v = 0.0f;
#pragma unroll 1
    for (int sl = 0; sl < ITEMS; ++sl)
      if ((items >> sl) & 1u) v += ired[sl][r][n];
    y[(size_t)n * D + row0 + r] = from_f<yt>(v);
  }
  STAMP(7);  // y stored
  // the last down CTA resets the counters for the next launch
  if (tid == 0) {
    if (atomicAdd(sync + SY_DN, 1u) == (unsigned)DN - 1u) {
      sync[SY_GU] = 0u;
      sync[SY_DN] = 0u;
      __threadfence();
    }
  }
}
