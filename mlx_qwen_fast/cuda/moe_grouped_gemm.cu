// Grouped expert GEMM with fused 4-bit affine dequantisation (prefill MoE),
// mma.sync build (the "mma" build of kernels/moe_grouped_gemm.py; the "wgmma"
// build, moe_grouped_gemm_wgmma.cu, takes the same work items).
//
// Weights: MLX affine 4-bit, group 64: packed uint32 W [E, O, K/8] (eight
// nibbles per word, lowest nibble = lowest input index), bf16 scales and
// biases [E, O, K/64]; w[o, i] = bf16(scale * q + bias), one rounding (MLX's
// CUDA mx.dequantize). Dequantised tiles live only in shared memory.
//
// Work items come from the block map of ops.moe.block_map (tile rows = MOE_BM):
// CTA (blockIdx.x = item, blockIdx.y = column tile) computes rows
// [offsets[e] + t*BM, min(+BM, offsets[e+1])) of the grouped order times
// BN = 64 output columns of expert e; (-1, -1) items return at once.
// Tensor cores: mma.sync m16n8k16 bf16 -> fp32, MOE_WM x MOE_WN warps, each
// warp a BM/MOE_WM x BN/MOE_WN block of every output matrix, fragments
// loaded with ldmatrix.x4. K step 64 (= one quantisation group).
//
// MOE_KIND 0 (gate + up + SwiGLU):
//   inputs x [N, K] bf16, wg, sg, bg, wu, su, bu, order [NK] int32,
//   offsets [E+1] int32, bmap [T, 2] int32; output h [NK, O] bf16 in grouped
//   order: h[r] = bf16(silu(bf16(x[order[r]/k] . Wg[e])) * bf16(x . Wu[e])).
//   scalars: int K, int O, int topk.
// MOE_KIND 1 (down, routing weight):
//   inputs h [NK, K] bf16 (grouped order), wd, sd, bd, order, offsets, bmap,
//   scores [NK] float (assignment order); output y [NK, O] MOE_YT in
//   ASSIGNMENT order: y[order[r]] = scores[order[r]] * bf16(h[r] . Wd[e]).
//   scalars: int K, int O, int topk (unused).
// The caller sums y over the k assignments of each token (fp32).
//
// Dequantisation: nibbles OR-ed into the mantissa of bf16 128.0 (0x4300 | q
// = 128 + q, exact), minus 128 (exact), then one fma.rn.bf16x2. Nibbles j and
// j+4 of a word share one bf16x2 register, so the weight tiles store K in the
// order (0,4,1,5,2,6,3,7) within every 8 inputs, and the A tile (x or h) is
// staged in the same order (4 prmt per 16 bytes): the dot products are
// unchanged.
// Pipeline: one shared-memory stage, two barriers per K step; the next K
// step's global words (x/h rows, packed weights, scales, biases) are fetched
// into registers before the current step's mma and stored (dequantised)
// after it.
//
// Requirements (the Python wrapper checks them): K % 64 == 0, O % 64 == 0,
// 16-byte aligned rows (K % 8 == 0 holds). Launch: grid (T*NT, O/64, 1)
// threads, NT = 32 * MOE_WM * MOE_WN per block.
//
// Build macros: KNAME, MOE_KIND, MOE_BM (32, 64 or 128), MOE_YT (down output
// type), MOE_MINB (optional: __launch_bounds__ minimum CTAs per SM), and
//   MOE_WV   0: each thread fetches WPT single words of different rows and
//               their scales/biases (8 threads load the same scale); 1 (needs
//               WPT == 4, i.e. NT == 128): a thread fetches half a row of a K
//               step (4 words, one 16-byte load) and the row's scale and bias
//               once, loads all B fragments of a k16 slice before its
//               (non-volatile) mma, and down's two columns of a thread leave
//               in one store (8 bytes fp32, 4 bytes bf16).
//   MOE_WM, MOE_WN: warps along rows and columns (default 2 x 2); threads
//               per CTA = 32 * MOE_WM * MOE_WN (the launch must match).
#include "gdn_common.cuh"

#ifndef MOE_BM
#define MOE_BM 64
#endif
#ifndef MOE_YT
#define MOE_YT float
#endif
#ifndef MOE_WV
#define MOE_WV 0
#endif
#ifndef MOE_WM
#define MOE_WM 2
#endif
#ifndef MOE_WN
#define MOE_WN 2
#endif

constexpr int BM = MOE_BM;
constexpr int BN = 64;  // output columns per CTA
constexpr int BK = 64;
constexpr int LDS = BK + 8;  // padded row (halves): conflict-free fragment loads
constexpr int NT = 32 * MOE_WM * MOE_WN;
constexpr int NMAT = MOE_KIND == 0 ? 2 : 1;
constexpr int WM = BM / MOE_WM;  // rows per warp
constexpr int WN = BN / MOE_WN;  // cols per warp
constexpr int MT = WM / 16;
constexpr int NTL = WN / 8;
constexpr int XPT = BM * 8 / NT;  // 16-byte x chunks per thread per K step
constexpr int WPT = BN * 8 / NT;  // packed words per thread per matrix per K step
static_assert(BM == 32 || BM == 64 || BM == 128, "BM must be 32, 64 or 128");
static_assert(WM % 16 == 0 && WN % 8 == 0, "warp tile must be a multiple of 16 x 8");
static_assert(XPT >= 1 && XPT * NT == BM * 8 && WPT >= 1 && WPT * NT == BN * 8, "loads must split evenly");
static_assert(!MOE_WV || WPT == 4, "MOE_WV needs 4 words per thread (BN == NT / 2)");
constexpr int SPT = MOE_WV ? 1 : WPT;  // scales (and biases) per thread per matrix per K step
static_assert(NTL % 2 == 0, "ldmatrix B path loads two n-tiles at once");
static_assert(sizeof(gdn_u16) * LDS * (BM + NMAT * BN) <= 48 * 1024, "static shared memory over 48 KB");
typedef MOE_YT yt;
#include "moe_gemm_common.cuh"

// (the tensor-core steps: mma_bf16_m16n8k16, its not-volatile form
// mma_bf16_m16n8k16_nv, which the compiler may move past the (volatile)
// ldmatrix of the next slice so that shared-memory loads run ahead of the
// tensor cores (MOE_WV 1), and ldmatrix_x4: ptx.cuh)

// One packed word (8 nibbles) -> 8 bf16 in shared memory, in the order
// (q0,q4),(q1,q5),(q2,q6),(q3,q7), each bf16(s * q + b) (one fma).
__device__ __forceinline__ uint4 dequant_word(unsigned word, gdn_u16 sb, gdn_u16 bb) {
  uint4 v;
  unsigned* pv = &v.x;
  const unsigned s2 = (unsigned)sb | ((unsigned)sb << 16);
  const unsigned b2 = (unsigned)bb | ((unsigned)bb << 16);
  const unsigned magic = 0x43004300u;  // bf16x2 (128, 128)
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    // nibble j -> low half, nibble j + 4 -> high half; OR into 128's mantissa
    const unsigned m = ((word >> (4 * j)) & 0x000F000Fu) | magic;  // one lop3
    unsigned q, w;
    q = sub_rn_bf16x2(m, magic);  // exact: q
    w = fma_rn_bf16x2(q, s2, b2);
    pv[j] = w;
  }
  return v;
}

// 8 consecutive bf16 of an A row, in the shared-memory K order of the weights.
__device__ __forceinline__ uint4 a_order(uint4 v) {
  uint4 r;
  r.x = prmt(v.x, v.z, 0x5410u);  // (e0, e4)
  r.y = prmt(v.x, v.z, 0x7632u);  // (e1, e5)
  r.z = prmt(v.y, v.w, 0x5410u);  // (e2, e6)
  r.w = prmt(v.y, v.w, 0x7632u);  // (e3, e7)
  return r;
}

// Registers of one K step.
struct Stage {
  uint4 x[XPT];
  unsigned w[NMAT][WPT];
  gdn_u16 s[NMAT][SPT], b[NMAT][SPT];
};

// Weight row and first word (of the K step) that thread i's word u lands on.
__device__ __forceinline__ int w_row(int u) {
  return MOE_WV ? (threadIdx.x >> 1) : ((threadIdx.x + u * NT) >> 3);
}
__device__ __forceinline__ int w_word(int u) {
  return MOE_WV ? (threadIdx.x & 1) * 4 + u : ((threadIdx.x + u * NT) & 7);
}

__device__ __forceinline__ void fetch_w(
    Stage& st, int m, const unsigned* __restrict__ W, const bf16_t* __restrict__ S,
    const bf16_t* __restrict__ B, int e, int n0, int k0, int K, int O) {
  const int kw = K >> 3, kg = K >> 6;
#if MOE_WV
  const size_t row = (size_t)e * O + n0 + w_row(0);
  const uint4 v = *reinterpret_cast<const uint4*>(W + row * kw + (k0 >> 3) + w_word(0));
  st.w[m][0] = v.x;
  st.w[m][1] = v.y;
  st.w[m][2] = v.z;
  st.w[m][3] = v.w;
  st.s[m][0] = S[row * kg + (k0 >> 6)].x;
  st.b[m][0] = B[row * kg + (k0 >> 6)].x;
#else
#pragma unroll
  for (int u = 0; u < WPT; ++u) {
    const int i = threadIdx.x + u * NT;
    const int rr = i >> 3, wq = i & 7;
    const size_t row = (size_t)e * O + n0 + rr;
    st.w[m][u] = W[row * kw + (k0 >> 3) + wq];
    st.s[m][u] = S[row * kg + (k0 >> 6)].x;
    st.b[m][u] = B[row * kg + (k0 >> 6)].x;
  }
#endif
}

extern "C" __global__ void MOE_LB KNAME(MOE_GEMM_PARAMS) {
  __shared__ __align__(16) gdn_u16 xs[BM][LDS];
  __shared__ __align__(16) gdn_u16 ws[NMAT][BN][LDS];
  __shared__ int src[BM];

  const int item = blockIdx.x;
  const int e = bmap[2 * item];
  if (e < 0) return;
  const int t = bmap[2 * item + 1];
  const int row0 = offsets[e] + t * BM;
  const int rows = min(BM, offsets[e + 1] - row0);
  const int n0 = blockIdx.y * BN;
  const int tid = threadIdx.x;
  if (tid < BM) {
    const int r = row0 + tid;
#if MOE_KIND == 0
    src[tid] = tid < rows ? order[r] / topk : -1;  // token of the row
#else
    src[tid] = tid < rows ? r : -1;  // h is already in grouped order
#endif
  }
  __syncthreads();

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

  Stage st;
  // global -> registers for the K step at k0
  auto fetch = [&](int k0) {
#pragma unroll
    for (int u = 0; u < XPT; ++u) {
      const int i = tid + u * NT;
      const int r = i >> 3, c = (i & 7) * 8;
      const int sr = src[r];
      st.x[u] = make_uint4(0u, 0u, 0u, 0u);
      if (sr >= 0) st.x[u] = *reinterpret_cast<const uint4*>(x + (size_t)sr * K + k0 + c);
    }
    fetch_w(st, 0, w0, s0, b0, e, n0, k0, K, O);
#if MOE_KIND == 0
    fetch_w(st, 1, w1, s1, b1, e, n0, k0, K, O);
#endif
  };
  // registers -> shared memory (dequantised)
  auto store = [&]() {
#pragma unroll
    for (int u = 0; u < XPT; ++u) {
      const int i = tid + u * NT;
      *reinterpret_cast<uint4*>(&xs[i >> 3][(i & 7) * 8]) = a_order(st.x[u]);
    }
#pragma unroll
    for (int m = 0; m < NMAT; ++m)
#pragma unroll
      for (int u = 0; u < WPT; ++u) {
        *reinterpret_cast<uint4*>(&ws[m][w_row(u)][w_word(u) * 8]) =
            dequant_word(st.w[m][u], st.s[m][MOE_WV ? 0 : u], st.b[m][MOE_WV ? 0 : u]);
      }
  };
  fetch(0);

  for (int k0 = 0; k0 < K; k0 += BK) {
    store();
    __syncthreads();
    if (k0 + BK < K) fetch(k0 + BK);  // in flight during this step's mma
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      unsigned a[MT][4];
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        ldmatrix_x4(smem_addr(&xs[wm * WM + i * 16 + (lane & 15)][kk + (lane >> 4) * 8]), a[i]);
      }
#if MOE_WV
      {  // all B fragments of this slice first, then its mma (non-volatile)
        unsigned bfr[NMAT][NTL / 2][4];
#pragma unroll
        for (int m = 0; m < NMAT; ++m)
#pragma unroll
          for (int j2 = 0; j2 < NTL / 2; ++j2)
            ldmatrix_x4(smem_addr(&ws[m][wn * WN + j2 * 16 + (lane & 7) + ((lane >> 4) << 3)][kk + ((lane >> 3) & 1) * 8]), bfr[m][j2]);
#pragma unroll
        for (int m = 0; m < NMAT; ++m)
#pragma unroll
          for (int j2 = 0; j2 < NTL / 2; ++j2)
#pragma unroll
            for (int i = 0; i < MT; ++i) {
              mma_bf16_m16n8k16_nv(acc[m][i][2 * j2], a[i], bfr[m][j2][0], bfr[m][j2][1]);
              mma_bf16_m16n8k16_nv(acc[m][i][2 * j2 + 1], a[i], bfr[m][j2][2], bfr[m][j2][3]);
            }
      }
#else
#pragma unroll
      for (int m = 0; m < NMAT; ++m) {
#pragma unroll
        for (int j = 0; j < NTL; j += 2) {
          unsigned bb[4];  // b0, b1 of n-tile j, then of n-tile j + 1
          ldmatrix_x4(smem_addr(&ws[m][wn * WN + j * 8 + (lane & 7) + ((lane >> 4) << 3)][kk + ((lane >> 3) & 1) * 8]), bb);
#pragma unroll
          for (int i = 0; i < MT; ++i) {
            mma_bf16_m16n8k16(acc[m][i][j], a[i], bb[0], bb[1]);
            mma_bf16_m16n8k16(acc[m][i][j + 1], a[i], bb[2], bb[3]);
          }
        }
      }
#endif  // MOE_WV
    }
    __syncthreads();
  }

  // Epilogue: c0,c1 -> (row g, cols 2tq, 2tq+1); c2,c3 -> row g + 8.
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int lr = wm * WM + i * 16 + g + 8 * h;
      if (lr >= rows) continue;
      const int r = row0 + lr;
#if MOE_KIND == 1
      const int a_id = order[r];
      const float sc = scores[a_id];
#endif
#pragma unroll
      for (int j = 0; j < NTL; ++j) {
        const int col = n0 + wn * WN + j * 8 + 2 * tq;
#if MOE_KIND == 0
        float o[2];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const float gt = from_f_round<bf16_t>(acc[0][i][j][2 * h + c]);
          const float up = from_f_round<bf16_t>(acc[1][i][j][2 * h + c]);
          o[c] = silu_f(gt) * up;
        }
        *reinterpret_cast<unsigned*>(y + (size_t)r * O + col) = pack_bf16(o[0], o[1]);
#else
        const float v0 = from_f_round<bf16_t>(acc[0][i][j][2 * h]) * sc;
        const float v1 = from_f_round<bf16_t>(acc[0][i][j][2 * h + 1]) * sc;
        yt* dst = y + (size_t)a_id * O + col;
#if MOE_WV
        if constexpr (sizeof(yt) == 4) {
          *reinterpret_cast<float2*>(dst) = make_float2(v0, v1);
        } else {
          *reinterpret_cast<unsigned*>(dst) = pack_bf16(v0, v1);
        }
#else
        dst[0] = from_f<yt>(v0);
        dst[1] = from_f<yt>(v1);
#endif
#endif
      }
    }
}
