// Grouped expert GEMM with fused 4-bit dequantisation: the "async" variant
// (multi-stage cp.async ring, dequantisation from shared memory straight into
// mma B fragments). UNVERIFIED: compiled with nvcc (sm_90a), never run on a
// GPU yet (bench/results/moe-cuda-log.md, 2026-12-01).
//
// Same contract as moe_grouped_gemm.cu (MOE_KIND 0: gate + up + SwiGLU, h in
// grouped order; MOE_KIND 1: down times the routing weight, y in assignment
// order; the same parameters in the same order, the same block map), with
// the one-rounding dequantisation w = bf16(s * q + b) (MOE_DEQ 1 there).
//
// Pipeline: MOE_STAGES slots of dynamic shared memory; one slot holds one
// K step (64 inputs = one quantisation group) of
//   A  : BM rows x 64 bf16 (x rows gathered by token, or h rows), raw, rows
//        padded to 144 B (conflict-free 16-byte fragment loads);
//   W  : NMAT x BN rows x 8 packed words (32 B per row), raw 4-bit;
//   SB : NMAT x BN rows x (4-byte scale chunk, 4-byte bias chunk), the aligned
//        pair of bf16 that holds the row's group (which half: parity).
// All of it is copied with cp.async (16-byte .cg for A and W, zero-fill for
// rows past the item's end; 4-byte .ca for scales/biases). Per K step:
// cp.async.wait_group(STAGES-2), one __syncthreads, issue the copies of step
// kt+STAGES-1 into the slot freed by step kt-1, then the mma of step kt.
//
// K order: within each K step, thread tq of a quad owns packed words 2tq and
// 2tq+1 of its weight row (16 inputs), and the mma k16 slices are a
// permutation of K chosen so that every register of a thread's A and B
// fragments is one natural pair of inputs (2i, 2i+1) of one of those words:
// mma slice kk (0..3), fragment half p (b0/a0a1: 0, b1/a2a3: 1) of thread tq
// holds physical inputs 8*(2tq + kk/2) + 2*(2*(kk%2) + p) + {0, 1}. So
//   - a thread's A registers for the whole K step are 2 x 16-byte shared loads
//     per row (rows g and g+8 of each m-tile), no shuffles;
//   - a thread dequantises only its own 2 words per (matrix, n-tile): word ->
//     v = w & 0x0F0F0F0F, u = (w >> 4) & 0x0F0F0F0F, then per pair i one prmt
//     (bytes v_i, 0, u_i, 0), OR 0x43004300 (bf16 128 + q, exact), sub.bf16x2
//     128 (exact q), fma.rn.bf16x2 (s, b): 19 instructions per 8 weights,
//     each weight dequantised once per warp (a warp owns all BM/MOE_WM rows of
//     its n-tiles).
// The dot products are those of the natural K order (summation order inside
// the fp32 accumulators differs).
//
// Warps: MOE_WM x MOE_WN; warp tile (BM/MOE_WM) rows x (BN/MOE_WN) columns of
// every matrix. Requirements (the wrapper checks): K % 64 == 0, O % BN == 0,
// dynamic shared memory >= MOE_STAGES * STAGE_BYTES (checked here: trap).
// Launch: grid (T*NT, O/BN, 1) threads, NT = 32 * MOE_WM * MOE_WN; with
// MOE_COLS_FAST 1 the grid is (O/BN * NT, T, 1) (column tiles of an item
// adjacent in launch order: its A rows stay hot in L2).
//
// Build macros: KNAME, MOE_KIND, MOE_BM (32/64/128), MOE_BN (64/128/256),
// MOE_WM, MOE_WN, MOE_STAGES (2..6), MOE_YT (down output type), MOE_MINB
// (optional __launch_bounds__ minimum CTAs per SM), MOE_DEQ (must be 1; kept
// for the wrapper's bookkeeping).
#include "gdn_common.cuh"

#ifndef MOE_BM
#define MOE_BM 64
#endif
#ifndef MOE_BN
#define MOE_BN 128
#endif
#ifndef MOE_YT
#define MOE_YT float
#endif
#ifndef MOE_WM
#define MOE_WM 1
#endif
#ifndef MOE_WN
#define MOE_WN 8
#endif
#ifndef MOE_COLS_FAST
#define MOE_COLS_FAST 0
#endif
#ifndef MOE_STAGES
#define MOE_STAGES 4
#endif
#if defined(MOE_DEQ) && MOE_DEQ != 1
#error "moe_grouped_gemm_async.cu: one-rounding dequantisation only (MOE_DEQ 1)"
#endif

constexpr int BM = MOE_BM;
constexpr int BN = MOE_BN;
constexpr int BK = 64;
constexpr int S = MOE_STAGES;
constexpr int NT = 32 * MOE_WM * MOE_WN;
constexpr int NMAT = MOE_KIND == 0 ? 2 : 1;
constexpr int WMR = BM / MOE_WM;  // rows per warp
constexpr int WNC = BN / MOE_WN;  // columns per warp (per matrix)
constexpr int MT = WMR / 16;
constexpr int NTL = WNC / 8;
constexpr int A_LD = 144;  // bytes per A row in shared memory (128 + 16 pad)
constexpr int A_BYTES = BM * A_LD;
constexpr int W_BYTES = NMAT * BN * 32;
constexpr int SB_BYTES = NMAT * BN * 8;
constexpr int STAGE_BYTES = A_BYTES + W_BYTES + SB_BYTES;
constexpr int A_CH = BM * 8;         // 16-byte A chunks per stage
constexpr int W_CH = NMAT * BN * 2;  // 16-byte W chunks per stage
constexpr int SB_CH = NMAT * BN * 2; // 4-byte scale/bias chunks per stage
constexpr int XPT = (A_CH + NT - 1) / NT;
constexpr int WPT = (W_CH + NT - 1) / NT;
constexpr int SPT = (SB_CH + NT - 1) / NT;
static_assert(BM == 32 || BM == 64 || BM == 128, "BM must be 32, 64 or 128");
static_assert(BN == 64 || BN == 128 || BN == 256, "BN must be 64, 128 or 256");
static_assert(WMR % 16 == 0 && WNC % 8 == 0 && MT >= 1 && NTL >= 1, "warp tile must be a multiple of 16 x 8");
static_assert(S >= 2 && S <= 6, "MOE_STAGES must be 2..6");
static_assert(STAGE_BYTES % 16 == 0, "stage must keep 16-byte alignment");
static_assert(S * STAGE_BYTES <= 227 * 1024, "dynamic shared memory over 227 KB");
typedef MOE_YT yt;
#include "moe_gemm_common.cuh"

__device__ __forceinline__ void mma_bf16(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void cp_async16_s(unsigned dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async4_s(unsigned dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}

// One packed word (nibble j = input j) -> 4 bf16x2 registers, natural pairs
// (inputs 2i, 2i+1), each bf16(s * q + b) with one rounding.
__device__ __forceinline__ void dequant_pairs(unsigned w, unsigned s2, unsigned b2, unsigned* p) {
  const unsigned v = w & 0x0F0F0F0Fu;         // q0 q2 q4 q6 (bytes)
  const unsigned u = (w >> 4) & 0x0F0F0F0Fu;  // q1 q3 q5 q7
  const unsigned magic = 0x43004300u;         // bf16x2 (128, 128)
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    // bytes (v_i, 0, u_i, 0): selector nibbles i, 8|i (sign of v_i = 0), 4+i, 8|(4+i)
    const unsigned sel = (unsigned)i | ((8u | i) << 4) | ((4u + i) << 8) | ((12u + i) << 12);
    const unsigned m = prmt(v, u, sel) | magic;  // 128 + q exactly
    unsigned q, r;
    asm("sub.rn.bf16x2 %0, %1, %2;" : "=r"(q) : "r"(m), "r"(magic));
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(q), "r"(s2), "r"(b2));
    p[i] = r;
  }
}

__device__ __forceinline__ void store2(float* dst, float a, float b) {
  *reinterpret_cast<float2*>(dst) = make_float2(a, b);
}
__device__ __forceinline__ void store2(bf16_t* dst, float a, float b) {
  *reinterpret_cast<unsigned*>(dst) = pack_bf16(a, b);
}

extern "C" __global__ void MOE_LB KNAME(MOE_GEMM_PARAMS) {
  extern __shared__ __align__(16) unsigned char smem[];

#if MOE_COLS_FAST  // grid (O/BN, T): the column tiles of one item run side by side
  const int item = blockIdx.y;
  const int n0 = blockIdx.x * BN;
#else
  const int item = blockIdx.x;
  const int n0 = blockIdx.y * BN;
#endif
  const int e = bmap[2 * item];
  if (e < 0) return;
  {
    unsigned dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (dyn < (unsigned)(S * STAGE_BYTES)) __trap();  // launched with too little shared memory
  }
  const int t = bmap[2 * item + 1];
  const int row0 = offsets[e] + t * BM;
  const int rows = min(BM, offsets[e + 1] - row0);
  const int tid = threadIdx.x;
  const int kw = K >> 3, kg = K >> 6, nk = K >> 6;
  const unsigned sbase = smem_addr(smem);

  // ---- per-thread copy assignments (fixed over K) ----
  // Source offsets are 32-bit element indices (every array here has < 2^31
  // elements; the wrapper checks); the array bases stay kernel parameters,
  // so no 64-bit pointer per copy is kept live across the K loop.
  unsigned a_off_g[XPT];  // element offset into x (bit 31: zero-fill row)
#pragma unroll
  for (int u = 0; u < XPT; ++u) {
    const int i = tid + u * NT;
    const int r = (i < A_CH ? i : 0) >> 3, c = i & 7;
    const bool ok = i < A_CH && r < rows;
#if MOE_KIND == 0
    const unsigned src_row = ok ? (unsigned)(order[row0 + r] / topk) : 0u;  // token of the row
#else
    const unsigned src_row = ok ? (unsigned)(row0 + r) : 0u;  // h is already in grouped order
#endif
    a_off_g[u] = (src_row * (unsigned)K + (unsigned)(c * 8)) | (ok ? 0u : 0x80000000u);
  }
  unsigned w_off_g[WPT];  // word offset into w0 / w1
#pragma unroll
  for (int u = 0; u < WPT; ++u) {
    const int i = min(tid + u * NT, W_CH - 1);
    const int rr = (i >> 1) % BN, hf = i & 1;
    w_off_g[u] = ((unsigned)(e * O + n0 + rr)) * (unsigned)kw + 4u * hf;
  }
  unsigned sb_off_g[SPT];  // element offset (row * kg) into the scales / biases
#pragma unroll
  for (int u = 0; u < SPT; ++u) {
    const int i = min(tid + u * NT, SB_CH - 1);
    const int rr = (i >> 1) % BN;
    sb_off_g[u] = ((unsigned)(e * O + n0 + rr)) * (unsigned)kg;
  }

  // copies of K step kt into its slot (always one commit group, maybe empty)
  auto issue = [&](int kt) {
    if (kt < nk) {
      const unsigned st = sbase + (unsigned)((kt % S) * STAGE_BYTES);
#pragma unroll
      for (int u = 0; u < XPT; ++u) {
        const int i = tid + u * NT;
        if (A_CH % NT == 0 || i < A_CH) {
          const unsigned o = a_off_g[u];
          const bool ok = !(o & 0x80000000u);
          cp_async16_zfill(st + (unsigned)((i >> 3) * A_LD + (i & 7) * 16),
                           x + (ok ? o + (unsigned)(kt * BK) : 0u), ok ? 16u : 0u);
        }
      }
#pragma unroll
      for (int u = 0; u < WPT; ++u) {
        const int i = tid + u * NT;
        if (W_CH % NT == 0 || i < W_CH) {
          const int m = i / (BN * 2), rr = (i >> 1) % BN, hf = i & 1;
          const unsigned* W = w0;
#if MOE_KIND == 0
          if (m) W = w1;
#endif
          cp_async16_s(st + (unsigned)(A_BYTES + (m * BN + rr) * 32 + hf * 16), W + w_off_g[u] + (unsigned)(kt * 8));
        }
      }
#pragma unroll
      for (int u = 0; u < SPT; ++u) {
        const int i = tid + u * NT;
        if (SB_CH % NT == 0 || i < SB_CH) {
          const int m = i / (BN * 2), rr = (i >> 1) % BN, which = i & 1;
          const bf16_t* P = which ? b0 : s0;
#if MOE_KIND == 0
          if (m) P = which ? b1 : s1;
#endif
          // the aligned bf16 pair holding group kt (array bases are 4-byte
          // aligned; E*O*kg is even since O % 64 == 0, so no pair runs past
          // the end)
          cp_async4_s(st + (unsigned)(A_BYTES + W_BYTES + (m * BN + rr) * 8 + which * 4),
                      P + ((sb_off_g[u] + (unsigned)kt) & ~1u));
        }
      }
    }
    cp_async_commit();
  };

  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tq = lane & 3;
  const int wm = warp / MOE_WN, wn = warp % MOE_WN;

  float acc[NMAT][MT][NTL][4];
#pragma unroll
  for (int m = 0; m < NMAT; ++m)
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int j = 0; j < NTL; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[m][i][j][c] = 0.0f;

  // shared-memory byte offsets of this thread's fragments within a slot
  const int a_off = ((wm * WMR + g) * A_LD + tq * 32);
  const int b_off = (A_BYTES + (wn * WNC + g) * 32 + tq * 8);
  const int sb_off = (A_BYTES + W_BYTES + (wn * WNC + g) * 8);
  // parity of (weight row * kg): rows e*O + n0 + n with O, n0 even, so n's
  // parity, = g's, times kg's
  const int row_par = g & kg & 1;

#pragma unroll
  for (int s = 0; s < S - 1; ++s) issue(s);

  for (int kt = 0; kt < nk; ++kt) {
    cp_async_wait<S - 2>();
    __syncthreads();  // step kt visible to all; slot of step kt-1 free
    issue(kt + S - 1);

    const unsigned char* st = smem + (kt % S) * STAGE_BYTES;
    const unsigned ssel = ((row_par + kt) & 1) ? 0x3232u : 0x1010u;
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // word 2tq + h: mma slices kk = 2h, 2h + 1
      unsigned p[NMAT][NTL][4];    // B fragments of both slices, every n-tile
#pragma unroll
      for (int m = 0; m < NMAT; ++m)
#pragma unroll
        for (int j = 0; j < NTL; ++j) {
          // words 2tq, 2tq + 1 (one 8-byte load: conflict-free), (s, b) chunks
          const uint2 wd = *reinterpret_cast<const uint2*>(st + b_off + (m * BN + j * 8) * 32);
          const uint2 sb = *reinterpret_cast<const uint2*>(st + sb_off + (m * BN + j * 8) * 8);
          dequant_pairs(h ? wd.y : wd.x, prmt(sb.x, sb.x, ssel), prmt(sb.y, sb.y, ssel), p[m][j]);
        }
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        const uint4 a0 = *reinterpret_cast<const uint4*>(st + a_off + i * 16 * A_LD + h * 16);        // row g
        const uint4 a1 = *reinterpret_cast<const uint4*>(st + a_off + (i * 16 + 8) * A_LD + h * 16);  // row g + 8
#pragma unroll
        for (int m = 0; m < NMAT; ++m)
#pragma unroll
          for (int j = 0; j < NTL; ++j) {
            mma_bf16(acc[m][i][j], a0.x, a1.x, a0.y, a1.y, p[m][j][0], p[m][j][1]);
            mma_bf16(acc[m][i][j], a0.z, a1.z, a0.w, a1.w, p[m][j][2], p[m][j][3]);
          }
      }
    }
  }
  cp_async_wait<0>();  // nothing real is pending (trailing groups are empty)

  // Epilogue: c0,c1 -> (row g, cols 2tq, 2tq+1); c2,c3 -> row g + 8.
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int lr = wm * WMR + i * 16 + g + 8 * hh;
      if (lr >= rows) continue;
      const int r = row0 + lr;
#if MOE_KIND == 1
      const int a_id = order[r];
      const float sc = scores[a_id];
#endif
#pragma unroll
      for (int j = 0; j < NTL; ++j) {
        const int col = n0 + wn * WNC + j * 8 + 2 * tq;
#if MOE_KIND == 0
        float o[2];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const float gt = from_f_round<bf16_t>(acc[0][i][j][2 * hh + c]);
          const float up = from_f_round<bf16_t>(acc[1][i][j][2 * hh + c]);
          o[c] = silu_f(gt) * up;
        }
        *reinterpret_cast<unsigned*>(y + (size_t)r * O + col) = pack_bf16(o[0], o[1]);
#else
        const float v0 = from_f_round<bf16_t>(acc[0][i][j][2 * hh]) * sc;
        const float v1 = from_f_round<bf16_t>(acc[0][i][j][2 * hh + 1]) * sc;
        store2(y + (size_t)a_id * O + col, v0, v1);
#endif
      }
    }
}
