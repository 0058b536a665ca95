// Dependent read floor of the one-token decode MoE block in one launch
// (bench/moe_decode_cuda.py, section "floor"): the block's bytes read in the
// order the data dependencies allow, with the grid-wide barriers a one-launch
// kernel needs, and no arithmetic beyond the routing itself. What this kernel
// takes bounds any one-launch kernel of this structure from below.
//
// G = 128 CTAs of 256 threads, one per SM (all resident), every byte moved by
// TMA bulk copies (cp.async.bulk) into shared memory:
//   phase A  CTA c: router rows [2c, +2) (8-bit, 4 KB + scales), requested at
//            entry with the shared expert's gate/up rows [4c, +4) and down rows
//            [16c, +16) (no dependency); "logits" of its two rows (a hash of
//            the rows' XOR fold, so the selection depends on the loaded bytes
//            and is spread over the experts) to global memory.
//   -- barrier 1 (DEP_BARRIERS >= 1) --
//   phase B  warp 0 reads the 256 logits back (L2) and selects 8 experts with
//            the routing kernel's route_warp (DEP_ROUTE 1) or reads them from
//            `inds` (DEP_ROUTE 0); CTA c then requests the gate and up rows
//            [32 (c % 16), +32) of selected expert c / 16 (64 KB + 8 KB of
//            scales/biases) and the down rows [16c, +16) of all 8 (32 KB + 4 KB);
//            once the gate/up rows land, 32 "h" values to global memory.
//   -- barrier 2 (DEP_BARRIERS == 2) --
//   phase C  the 9 x 512 h values read back (L2); once the down rows land, the
//            CTA's 16 output rows (written only if the fold equals a magic value).
// Bytes: router 0.56 MB, shared expert 1.77 MB, routed 14.16 MB (as FLOOR_BYTES
// of bench/moe_decode_cuda.py up to the scales' layout).
//
// Arguments: weights as decode_read_floor.cu; inds int32 [8] (DEP_ROUTE 0);
// seed (per launch, mixed into the logits); logits u64 [256] ({tag, float}),
// hbuf u32 [9 * 512] ({tag, value}) (scratch, zero at first use); sync uint32 [64] (persistent barrier counter, zero at
// first use, one buffer per build); out uint32 [128 * 256]; tim uint64 [128, 8]
// (%globaltimer at the phase points, thread 0). Dynamic shared memory SMEM_BYTES.
// DEP_FLAGS 1: no counter barriers; the exchanged values carry the launch's
// epoch (flags in the data): logits as u64 {epoch, float bits}, h as u32
// {epoch & 0xffff, value}; readers poll until every tag is this launch's, so
// each exchange costs one write and one polled read instead of a release,
// an acquire poll and a read. epoch = exits / G + 1 (sync's u64 counter: each
// CTA adds 1 with red at exit; a launch starts after the previous one's
// exits landed).
// Build macros: KNAME, DEP_BARRIERS (0, 1, 2), DEP_ROUTE (0, 1), DEP_FLAGS.
#include "grid_sync.cuh"
#include "moe_route_common.cuh"

#ifndef DEP_BARRIERS
#define DEP_BARRIERS 2
#endif
#ifndef DEP_ROUTE
#define DEP_ROUTE 1
#endif
#ifndef DEP_FLAGS
#define DEP_FLAGS 0
#endif

typedef unsigned short u16;
constexpr int E = 256, D = 2048, I = 512, NK = 8, G = 128;
constexpr unsigned long long BARW = 256;
// shared-memory regions (bytes): router | shared gate+up | shared down | routed gate+up | routed down | mbarriers
constexpr int RW = 2 * D, RS = 2 * (D / 64) * 2;                      // 2 rows, 8-bit; scales, biases
constexpr int SW = 4 * D / 2, SS = 4 * (D / 64) * 2;                  // 4 rows per matrix, 4-bit
constexpr int SDW = 16 * I / 2, SDS = 16 * (I / 64) * 2;              // 16 down rows
constexpr int GW = 32 * D / 2, GS = 32 * (D / 64) * 2;                // 32 rows per matrix
constexpr int DW = 16 * I / 2, DS = 16 * (I / 64) * 2;                // per expert
constexpr int OFF_R = 0, R_BYTES = RW + 2 * RS;
constexpr int OFF_S = OFF_R + R_BYTES, S_BYTES = 2 * SW + 4 * SS;
constexpr int OFF_SD = OFF_S + S_BYTES, SD_BYTES = SDW + 2 * SDS;
constexpr int OFF_G = OFF_SD + SD_BYTES, G_BYTES = 2 * GW + 4 * GS;
constexpr int OFF_D = OFF_G + G_BYTES, D_BYTES = NK * (DW + 2 * DS);
constexpr int OFF_BAR = OFF_D + D_BYTES;
constexpr unsigned SMEM_BYTES = OFF_BAR + 4 * 8 + 8 * NK * 4;
static_assert(OFF_S % 128 == 0 && OFF_SD % 128 == 0 && OFF_G % 128 == 0 && OFF_D % 128 == 0 &&
              OFF_BAR % 128 == 0, "regions 128-byte aligned");

__device__ __forceinline__ unsigned hash32(unsigned x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  return x ^ (x >> 16);
}
// XOR fold of n bytes of shared memory, spread over the threads of the CTA.
__device__ __forceinline__ unsigned fold_smem(const unsigned char* p, int n) {
  unsigned a = 0;
  for (int i = 16 * threadIdx.x; i < n; i += 16 * 256) {
    const uint4 v = *reinterpret_cast<const uint4*>(p + i);
    a ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  return a;
}
__device__ __forceinline__ unsigned warp_xor(unsigned v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v ^= __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ unsigned long long ld_relaxed_b64(const void* p) {
  unsigned long long v;
  asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint4 ld_relaxed_v4(const void* p) {
  uint4 v;
  asm volatile("ld.relaxed.gpu.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_relaxed_b64(void* p, unsigned long long v) {
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_u32(void* p, unsigned v) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void stamp(unsigned long long* tim, int i) {
  if (threadIdx.x == 0) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    tim[blockIdx.x * 8 + i] = t;
  }
}

extern "C" __global__ void __launch_bounds__(256, 1) KNAME(
    const unsigned char* __restrict__ rw, const u16* __restrict__ rs, const u16* __restrict__ rbias,
    const unsigned char* __restrict__ wg, const u16* __restrict__ sg, const u16* __restrict__ bg,
    const unsigned char* __restrict__ wu, const u16* __restrict__ su, const u16* __restrict__ bu,
    const unsigned char* __restrict__ wd, const u16* __restrict__ sd, const u16* __restrict__ bd,
    const unsigned char* __restrict__ xwg, const u16* __restrict__ xsg, const u16* __restrict__ xbg,
    const unsigned char* __restrict__ xwu, const u16* __restrict__ xsu, const u16* __restrict__ xbu,
    const unsigned char* __restrict__ xwd, const u16* __restrict__ xsd, const u16* __restrict__ xbd,
    const int* __restrict__ inds, unsigned seed, unsigned long long* __restrict__ logits,
    unsigned* __restrict__ hbuf, unsigned* __restrict__ sync, unsigned* __restrict__ out,
    unsigned long long* __restrict__ tim) {
  extern __shared__ __align__(128) unsigned char dsm[];
  const unsigned sb = smem_addr(dsm), bar_r = sb + OFF_BAR, bar_s = bar_r + 8, bar_g = bar_r + 16,
                 bar_d = bar_r + 24;
  int* ids = reinterpret_cast<int*>(dsm + OFF_BAR + 32);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, c = blockIdx.x;
  unsigned long long* ctr = reinterpret_cast<unsigned long long*>(sync);
  if (gridDim.x != G || blockDim.x != 256) __trap();
  stamp(tim, 0);
#if DEP_FLAGS
  const unsigned ep = (unsigned)(ld_relaxed_u64(ctr) / G) + 1u;  // this launch's tag
#else
  const unsigned ep = 0;
#endif
  unsigned long long base = 0;
  if (tid == 0) {
    mbar_init(bar_r, 1);
    mbar_init(bar_s, 1);
    mbar_init(bar_g, 1);
    mbar_init(bar_d, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    mbar_expect_tx(bar_r, R_BYTES);
    bulk_g2s(sb + OFF_R, rw + (size_t)2 * c * D, RW, bar_r);
    bulk_g2s(sb + OFF_R + RW, rs + 2 * c * (D / 64), RS, bar_r);
    bulk_g2s(sb + OFF_R + RW + RS, rbias + 2 * c * (D / 64), RS, bar_r);
    mbar_expect_tx(bar_s, S_BYTES + SD_BYTES);
    bulk_g2s(sb + OFF_S, xwg + (size_t)4 * c * (D / 2), SW, bar_s);
    bulk_g2s(sb + OFF_S + SW, xwu + (size_t)4 * c * (D / 2), SW, bar_s);
    bulk_g2s(sb + OFF_S + 2 * SW, xsg + 4 * c * (D / 64), SS, bar_s);
    bulk_g2s(sb + OFF_S + 2 * SW + SS, xbg + 4 * c * (D / 64), SS, bar_s);
    bulk_g2s(sb + OFF_S + 2 * SW + 2 * SS, xsu + 4 * c * (D / 64), SS, bar_s);
    bulk_g2s(sb + OFF_S + 2 * SW + 3 * SS, xbu + 4 * c * (D / 64), SS, bar_s);
    bulk_g2s(sb + OFF_SD, xwd + (size_t)16 * c * (I / 2), SDW, bar_s);
    bulk_g2s(sb + OFF_SD + SDW, xsd + 16 * c * (I / 64), SDS, bar_s);
    bulk_g2s(sb + OFF_SD + SDW + SDS, xbd + 16 * c * (I / 64), SDS, bar_s);
#if !DEP_FLAGS
    base = ld_relaxed_u64(ctr);
#endif
  }
  __syncthreads();  // mbarriers initialised

  // ---- phase A: the router rows -> two logits ----
  mbar_wait(bar_r, 0);
  stamp(tim, 1);
  if (warp < 2) {
    const unsigned char* row = dsm + OFF_R + warp * D;
    unsigned a = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint4 v = *reinterpret_cast<const uint4*>(row + 16 * (lane + 32 * j));
      a ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    a ^= *reinterpret_cast<const unsigned*>(dsm + OFF_R + RW + 4 * lane);
    a = warp_xor(a);
    const float lg = (hash32(a ^ seed ^ (2 * c + warp) * 0x9e3779b9u) >> 8) * (8.0f / 16777216.0f);
    if (lane == 0) st_relaxed_b64(logits + 2 * c + warp, ((unsigned long long)__float_as_uint(lg) << 32) | ep);
  }
#if DEP_BARRIERS >= 1 && !DEP_FLAGS
  grid_arrive<BARW>(ctr);
  if (tid == 0) base -= base % ((unsigned long long)DEP_BARRIERS * BARW);
  grid_wait(ctr, base + BARW);
#endif

  // ---- phase B: route, request the routed rows ----
  if (warp == 0) {
#if DEP_ROUTE
    float p[E / 32];
    unsigned spins = 0;
    for (;;) {  // DEP_FLAGS: until every logit carries this launch's tag
      bool ok = true;
#pragma unroll
      for (int i = 0; i < E / 32; ++i) {
        const unsigned long long v = ld_relaxed_b64(logits + 32 * i + lane);
        p[i] = __uint_as_float((unsigned)(v >> 32));
        ok &= !DEP_FLAGS || (unsigned)v == ep;
      }
      if (__all_sync(0xffffffffu, ok)) break;
      if (++spins > (1u << 22)) __trap();
    }
    stamp(tim, 2);
    int my_i;
    float my_p, tot;
    route_warp<E, NK>(p, my_i, my_p, tot);
    if (lane < NK) ids[lane] = my_i;
#else
    stamp(tim, 2);
    if (lane < NK) ids[lane] = inds[lane];
#endif
  }
  __syncthreads();
  stamp(tim, 3);
  if (warp == 0) {
    const int item = c / 16, rb = c % 16;
    if (lane == 0) {
      mbar_expect_tx(bar_g, G_BYTES);
      mbar_expect_tx(bar_d, D_BYTES);
    }
    __syncwarp();
    if (lane < 6) {
      const size_t r0 = (size_t)ids[item] * I + 32 * rb;
      const unsigned char* src = lane == 0 ? wg + r0 * (D / 2) : lane == 1 ? wu + r0 * (D / 2)
          : reinterpret_cast<const unsigned char*>((lane == 2 ? sg : lane == 3 ? bg : lane == 4 ? su : bu) + r0 * (D / 64));
      const int off = lane < 2 ? lane * GW : 2 * GW + (lane - 2) * GS;
      bulk_g2s(sb + OFF_G + off, src, lane < 2 ? GW : GS, bar_g);
    } else if (lane >= 8) {
      const int j = (lane - 8) / 3, part = (lane - 8) % 3;  // expert slot, rows | scales | biases
      const size_t r0 = (size_t)ids[j] * D + 16 * c;
      const unsigned char* src = part == 0 ? wd + r0 * (I / 2)
                                           : reinterpret_cast<const unsigned char*>((part == 1 ? sd : bd) + r0 * (I / 64));
      bulk_g2s(sb + OFF_D + j * (DW + 2 * DS) + (part == 0 ? 0 : DW + (part - 1) * DS), src,
               part == 0 ? DW : DS, bar_d);
    }
  }
  // the shared expert's 4 gate/up rows -> 4 "h" values
  mbar_wait(bar_s, 0);
  unsigned acc = fold_smem(dsm + OFF_S, S_BYTES);
  if (tid < 4) st_relaxed_u32(hbuf + NK * I + 4 * c + tid, (ep << 16) | ((acc ^ tid) & 0xffffu));
  mbar_wait(bar_g, 0);
  stamp(tim, 4);
  acc ^= fold_smem(dsm + OFF_G, G_BYTES);
  acc = warp_xor(acc);
  // the CTA's 32 h values (rows [32 (c % 16), +32) of its expert): 4 per warp
  if (lane < 4) st_relaxed_u32(hbuf + (c / 16) * I + 32 * (c % 16) + 4 * warp + lane, (ep << 16) | ((acc ^ lane) & 0xffffu));
#if DEP_BARRIERS == 2 && !DEP_FLAGS
  grid_arrive<BARW>(ctr);
  grid_wait(ctr, base + 2 * BARW);
#endif

  // ---- phase C: h back (DEP_FLAGS: until every value carries this launch's tag), the down rows ----
  {
    constexpr int HV = (NK + 1) * I / 4, PER = (HV + 255) / 256;  // 16-byte h vectors, per thread
    const unsigned t16 = ep & 0xffffu;
    unsigned spins = 0;
    for (;;) {  // all of the thread's vectors in flight at once: one round trip per poll
      bool ok = true;
      unsigned a = 0;
#pragma unroll
      for (int j = 0; j < PER; ++j) {
        const int i = tid + 256 * j;
        if (i < HV) {
          const uint4 v = ld_relaxed_v4(hbuf + 4 * i);
          ok &= !DEP_FLAGS || ((v.x >> 16) == t16 && (v.y >> 16) == t16 && (v.z >> 16) == t16 && (v.w >> 16) == t16);
          a ^= v.x ^ v.y ^ v.z ^ v.w;
        }
      }
      if (ok) {
        acc ^= a;
        break;
      }
      if (++spins > (1u << 22)) __trap();
    }
  }
  __syncthreads();
  stamp(tim, 5);
  mbar_wait(bar_d, 0);
  stamp(tim, 6);
  acc ^= fold_smem(dsm + OFF_D, D_BYTES) ^ fold_smem(dsm + OFF_SD, SD_BYTES);
  if (acc == 0x9e3779b9u) out[c * 256 + tid] = acc;
#if DEP_FLAGS
  if (tid == 0) asm volatile("red.relaxed.gpu.global.add.u64 [%0], 1;" ::"l"(ctr) : "memory");
#endif
  stamp(tim, 7);
}
