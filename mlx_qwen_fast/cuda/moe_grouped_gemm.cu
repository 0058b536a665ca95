// Grouped expert GEMM with fused 4-bit affine dequantisation (prefill MoE).
//
// Weights: MLX affine 4-bit, group 64: packed uint32 W [E, O, K/8] (eight
// nibbles per word, lowest nibble = lowest input index), bf16 scales and
// biases [E, O, K/64]; w[o, i] = bf16(bf16(scale * q) + bias), the two bf16
// roundings of mx.dequantize (checked bit-exact on CPU against its output). Dequantised tiles live only in shared memory.
//
// Work items come from the block map of ops.moe.block_map (tile rows = MOE_BM):
// CTA (blockIdx.x = item, blockIdx.y = column tile) computes rows
// [offsets[e] + t*BM, min(+BM, offsets[e+1])) of the grouped order times
// BN output columns of expert e; (-1, -1) items return at once.
// Tensor cores: mma.sync m16n8k16 bf16 -> fp32, 4 warps (2 x 2), each warp a
// 32 x 32 block of every output matrix. K step 64 (= one quantisation group),
// single shared-memory stage (no pipelining yet: correctness first).
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
// Requirements (the Python wrapper checks them): K % 64 == 0, O % MOE_BN == 0,
// 16-byte aligned rows (K % 8 == 0 holds). Launch: grid (T*128, O/BN, 1)
// threads, 128 per block.
//
// Build macros: KNAME, MOE_KIND, MOE_BM (64 or 32), MOE_BN (64), MOE_YT.
#include "gdn_common.cuh"

#ifndef MOE_BM
#define MOE_BM 64
#endif
#ifndef MOE_BN
#define MOE_BN 64
#endif
#ifndef MOE_YT
#define MOE_YT float
#endif

constexpr int BM = MOE_BM;
constexpr int BN = MOE_BN;
constexpr int BK = 64;
constexpr int LDS = BK + 8;  // padded row (halves): conflict-free fragment loads
constexpr int NT = 128;
constexpr int NMAT = MOE_KIND == 0 ? 2 : 1;
constexpr int WM = BM / 2;  // rows per warp
constexpr int WN = BN / 2;  // cols per warp
constexpr int MT = WM / 16;
constexpr int NTL = WN / 8;
static_assert(BM == 32 || BM == 64, "BM must be 32 or 64");
static_assert(BN == 64, "BN must be 64");
typedef MOE_YT yt;

__device__ __forceinline__ void mma_bf16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
  return (unsigned)from_f<bf16_t>(lo).x | ((unsigned)from_f<bf16_t>(hi).x << 16);
}

// Dequantise BN rows x 64 inputs of one expert matrix into ws (bf16).
__device__ __forceinline__ void load_w(
    gdn_u16 (*ws)[LDS], const unsigned* __restrict__ W, const bf16_t* __restrict__ S,
    const bf16_t* __restrict__ B, int e, int n0, int k0, int K, int O) {
  const int kw = K >> 3, kg = K >> 6;
#pragma unroll
  for (int i = threadIdx.x; i < BN * 8; i += NT) {
    const int rr = i >> 3, wq = i & 7;
    const size_t row = (size_t)e * O + n0 + rr;
    const unsigned word = W[row * kw + (k0 >> 3) + wq];
    const float s = to_f(S[row * kg + (k0 >> 6)]);
    const float b = to_f(B[row * kg + (k0 >> 6)]);
    uint4 v;
    unsigned* pv = &v.x;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float q0 = (float)((word >> (8 * j)) & 15u);
      const float q1 = (float)((word >> (8 * j + 4)) & 15u);
      // bf16 arithmetic as mx.dequantize: round(round(s * q) + b)
      pv[j] = pack_bf16(from_f_round<bf16_t>(s * q0) + b, from_f_round<bf16_t>(s * q1) + b);
    }
    *reinterpret_cast<uint4*>(&ws[rr][wq * 8]) = v;
  }
}

extern "C" __global__ void __launch_bounds__(NT) KNAME(
    const bf16_t* __restrict__ x,
    const unsigned* __restrict__ w0,
    const bf16_t* __restrict__ s0,
    const bf16_t* __restrict__ b0,
#if MOE_KIND == 0
    const unsigned* __restrict__ w1,
    const bf16_t* __restrict__ s1,
    const bf16_t* __restrict__ b1,
#endif
    const int* __restrict__ order,
    const int* __restrict__ offsets,
    const int* __restrict__ bmap,
#if MOE_KIND == 1
    const float* __restrict__ scores,
    yt* __restrict__ y,
#else
    bf16_t* __restrict__ y,
#endif
    int K,
    int O,
    int topk) {
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
  const int wm = warp >> 1, wn = warp & 1;

  float acc[NMAT][MT][NTL][4];
#pragma unroll
  for (int m = 0; m < NMAT; ++m)
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int j = 0; j < NTL; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[m][i][j][c] = 0.0f;

  for (int k0 = 0; k0 < K; k0 += BK) {
#pragma unroll
    for (int i = tid; i < BM * 8; i += NT) {
      const int r = i >> 3, c = (i & 7) * 8;
      const int sr = src[r];
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (sr >= 0) v = *reinterpret_cast<const uint4*>(x + (size_t)sr * K + k0 + c);
      *reinterpret_cast<uint4*>(&xs[r][c]) = v;
    }
    load_w(ws[0], w0, s0, b0, e, n0, k0, K, O);
#if MOE_KIND == 0
    load_w(ws[1], w1, s1, b1, e, n0, k0, K, O);
#endif
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      unsigned a[MT][4];
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        const int r = wm * WM + i * 16 + g;
        const int c = kk + 2 * tq;
        a[i][0] = *reinterpret_cast<const unsigned*>(&xs[r][c]);
        a[i][1] = *reinterpret_cast<const unsigned*>(&xs[r + 8][c]);
        a[i][2] = *reinterpret_cast<const unsigned*>(&xs[r][c + 8]);
        a[i][3] = *reinterpret_cast<const unsigned*>(&xs[r + 8][c + 8]);
      }
#pragma unroll
      for (int m = 0; m < NMAT; ++m)
#pragma unroll
        for (int j = 0; j < NTL; ++j) {
          const int n = wn * WN + j * 8 + g;
          const unsigned bb0 = *reinterpret_cast<const unsigned*>(&ws[m][n][kk + 2 * tq]);
          const unsigned bb1 = *reinterpret_cast<const unsigned*>(&ws[m][n][kk + 2 * tq + 8]);
#pragma unroll
          for (int i = 0; i < MT; ++i) mma_bf16(acc[m][i][j], a[i], bb0, bb1);
        }
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
        dst[0] = from_f<yt>(v0);
        dst[1] = from_f<yt>(v1);
#endif
      }
    }
}
