// Causal flash-attention prefill for head_dim 256 with GQA: one launch per
// attention call of a chunk of T query tokens.
//
// What it computes (mlx-lm's scaled_dot_product_attention(q, k, v,
// mask="causal") inside Qwen3NextAttention, the chunk's queries at positions
// offset .. offset + T - 1 of the cache):
//   out[b, t, h] = sum_{j <= offset + t} p_j v[b, kvh, j],
//   p = softmax_j(scale * q[b, h, t] . k[b, kvh, j]),   kvh = h / (hq / hkv)
// K/V are read once per block from shared memory for all its query rows;
// the query heads of one KV head read the same K/V rows (no repeat).
//
// Algorithm: FlashAttention-2's loop order (Dao, "FlashAttention-2: Faster
// Attention with Better Parallelism and Work Partitioning", 2023): a block
// owns BM = 64 query rows of one (b, h) and walks the key positions in tiles
// of BN = 64, keeping its output in registers and never materialising the
// T x L scores; the softmax is the online softmax of Milakov & Gimelshein
// (arXiv 1805.02867) in base 2: per row a running max m (of scale*log2(e)*s)
// and sum l, the accumulator rescaled by 2^(m_old - m_new) when m grows,
// divided by l once at the end. Tiles past the diagonal are never loaded;
// only tiles that straddle it are masked.
//
// Per block: 4 warps, warp w owns query rows [16w, 16w + 16) of the tile.
// Per key tile, a warp computes its 16 x 64 scores S = Q K^T with
// mma.sync m16n8k16 (fp32 accumulate; Q and K fragments by ldmatrix from
// shared memory), takes the online-softmax step on them in registers, packs
// P = 2^(S' - m) to the input type (the one rounding the kernel adds) and
// accumulates O += P V (V fragments by ldmatrix.trans), O a 16 x 256 fp32
// tile in registers (128 floats per thread). Shared memory: Q, K and V tiles
// of 64 rows x 256, rows padded by 16 bytes (528-byte stride: the 8 rows of
// each ldmatrix phase fall in distinct banks), 99 KB in all: two blocks per
// SM. K and V are copied with cp.async, staggered: V_j loads while S_j is
// computed, K_{j+1} while P_j V_j is (one buffer each, two barriers per tile).
// The output goes through the warp's own Q rows in shared memory and leaves
// in 16-byte stores, as [B, T, HQ, DH].
//
// Cost, for the reference model's 10 attention layers (HQ 16, HKV 2) over a
// 4K prompt prefilled in two chunks of 2048 (mlx-lm's prefill_step_size):
// 4 * HQ * DH FLOPs per (query, key) pair, 2.1 M pairs for the first chunk
// and 6.3 M for the second: 1.4e11 FLOPs per layer, 1.4 TFLOP in all
// (diagonal tiles add under 2%). Bytes: K/V of a layer's chunk are at most
// 8 MB and Q/O 32 MB, read from HBM once; each block's K/V re-reads (about
// 1.6 GB per layer for the second chunk) come from L2, where the 8 query
// heads of a KV head that run together find them. So the kernel is bound by
// mma.sync issue, not bytes; no scratch memory beyond the output at any
// prompt length. Expected: 240-270 TFLOP/s at long context; at short
// context the causal triangle leaves few blocks of uneven length (512 for
// the first chunk, two resident per SM) and the rate falls. Measured rates
// and memory: bench/results/INDEX.md, the attention prefill kernel's rows.
//
// Layouts: q [B, HQ, T, DH]; k, v [B, HKV, cap, DH] with cap >= offset + T
// (positions >= offset + T are never read); out [B, T, HQ, DH].
// Launch: grid = nqt * B * HQ blocks of 128 threads, nqt = ceil(T / BM),
// dynamic shared memory SMEM_BYTES (= smem_bytes() of
// kernels/attention_prefill.py). Block i takes query tile nqt - 1 - i / (B *
// HQ) (the tiles with the most keys first) of (b, h) = (i % (B * HQ)) / HQ,
// % HQ. Parameters: inputs q, k, v; output out; int T, cap, offset, hq,
// hkv; float scale_log2 (= scale * log2(e)).
// Build macros: KNAME, ATT_X (bf16_t | f16_t: the element type of q, k, v
// and out).
#include "gdn_common.cuh"

typedef ATT_X xt;

namespace {
constexpr int DH = 256;
constexpr int BM = 64;                 // query rows per block
constexpr int BN = 64;                 // key positions per tile
constexpr int NWARP = BM / 16;         // one warp per 16 query rows
constexpr int NT = NWARP * 32;         // threads per block
constexpr int ROW = DH + 8;            // shared row stride in elements (16 bytes of padding)
constexpr int ROWB = ROW * 2;          // ... in bytes
constexpr int TILE_BYTES = BM * ROWB;  // one tile (BM == BN rows)
constexpr int SMEM_BYTES = 3 * TILE_BYTES;
constexpr int CHUNKS = DH * 2 / 16;    // 16-byte chunks per row
static_assert(BM == BN, "Q, K and V tiles share one shape");
// two blocks per SM: 228 KB of shared memory per SM, 1 KB of it reserved per block
static_assert(2 * (SMEM_BYTES + 1024) <= 228 * 1024, "two blocks per SM");
static_assert(sizeof(xt) == 2, "the tensor-core path takes 2-byte types");
static_assert(NT % CHUNKS == 0 && BM % (NT / CHUNKS) == 0, "whole rows per pass of the block");

// ---- tensor-core primitives (PTX ISA: ldmatrix, mma.sync m16n8k16) --------

// The tensor-core steps of one element type (ptx.cuh): c[16x8] += a[16x16]
// b[16x8] with fp32 accumulators, and (lo, hi) packed to two elements,
// rounded to nearest even, lo in the low half.
template <typename T>
struct Mma;
template <>
struct Mma<bf16_t> {
  static __device__ __forceinline__ void run(float* c, const unsigned* a, unsigned b0, unsigned b1 MQF_PTX_SITE) {
#ifdef MQF_CPU_CHECK
    mma_bf16_m16n8k16_nv(c, a, b0, b1, mqf_site);
#else
    mma_bf16_m16n8k16_nv(c, a, b0, b1);
#endif
  }
  static __device__ __forceinline__ unsigned pack(float lo, float hi) {
    return cvt_rn_bf16x2_f32(hi, lo);
  }
};
template <>
struct Mma<f16_t> {
  static __device__ __forceinline__ void run(float* c, const unsigned* a, unsigned b0, unsigned b1 MQF_PTX_SITE) {
#ifdef MQF_CPU_CHECK
    mma_f16_m16n8k16_nv(c, a, b0, b1, mqf_site);
#else
    mma_f16_m16n8k16_nv(c, a, b0, b1);
#endif
  }
  static __device__ __forceinline__ unsigned pack(float lo, float hi) {
    return cvt_rn_f16x2_f32(hi, lo);
  }
};

__device__ __forceinline__ float neg_inf() {
  return __int_as_float(0xff800000);
}

// Rows [row0, row0 + BM) of a [rows, DH] matrix into a shared tile at
// `dst`, 16 bytes per cp.async; rows >= n_rows are zero-filled (their source
// address stays on row 0, which is never out of bounds). A thread copies one
// 16-byte column of every (NT / CHUNKS)-th row: one pointer plus constant
// offsets.
__device__ __forceinline__ void load_tile(unsigned dst, const xt* src, int row0, int n_rows) {
  constexpr int RSTEP = NT / CHUNKS;
  const int c = threadIdx.x % CHUNKS, r0 = threadIdx.x / CHUNKS;
  const xt* g = src + (size_t)(row0 + r0) * DH + c * 8;
  const unsigned d = dst + r0 * ROWB + c * 16;
  const int left = n_rows - row0 - r0;  // rows of this thread's column still in the matrix
#pragma unroll
  for (int i = 0; i < BM / RSTEP; ++i) {
    const bool in = i * RSTEP < left;
    cp_async16_zfill(d + i * RSTEP * ROWB, in ? g + i * RSTEP * DH : src, in ? 16u : 0u);
  }
}
} // namespace

extern "C" __global__ void __launch_bounds__(NT, 2) KNAME(
    const xt* __restrict__ q,
    const xt* __restrict__ k,
    const xt* __restrict__ v,
    xt* __restrict__ out,
    int T,
    int cap,
    int offset,
    int hq,
    int hkv,
    float scale_log2) {
  extern __shared__ __align__(16) unsigned char smem[];
  const unsigned qs = smem_addr(smem);
  const unsigned ks = qs + TILE_BYTES;
  const unsigned vs = qs + 2 * TILE_BYTES;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;  // the mma fragments' row group and column pair

  const int nqt = (T + BM - 1) / BM;
  const int bh_count = gridDim.x / nqt;  // B * hq
  const int bh = blockIdx.x % bh_count;
  const int qt = nqt - 1 - (int)(blockIdx.x / bh_count);
  const int b = bh / hq, h = bh % hq;
  const int kvh = h / (hq / hkv);
  const int q0 = qt * BM;
  // keys this block needs: [0, kv_end); tiles below j_diag need no mask
  const int kv_end = offset + min(q0 + BM, T);
  const int n_tiles = (kv_end + BN - 1) / BN;
  const int j_diag = (offset + q0) / BN;

  const xt* qb = q + ((size_t)bh * T) * DH;
  const xt* kb = k + ((size_t)(b * hkv + kvh) * cap) * DH;
  const xt* vb = v + ((size_t)(b * hkv + kvh) * cap) * DH;

  load_tile(qs, qb, q0, T);
  load_tile(ks, kb, 0, kv_end);
  cp_async_commit();

  // ldmatrix row addresses of this lane (see the fragment layouts of
  // mma.m16n8k16 in the PTX ISA): Q as A (rows of the warp, 16 dims per
  // step), K as B (8 keys x 16 dims per pair of registers), V as B through
  // the transposing load (16 keys x 8 dims per pair of registers).
  const unsigned qa = qs + (warp * 16 + (lane & 15)) * ROWB + (lane >> 4) * 16;
  const unsigned ka = ks + ((lane & 7) + ((lane >> 4) << 3)) * ROWB + ((lane >> 3) & 1) * 16;
  const unsigned va = vs + ((lane & 7) + (((lane >> 3) & 1) << 3)) * ROWB + (lane >> 4) * 16;

  // query positions of this thread's two rows (g and g + 8 of the warp's 16)
  const int qp0 = offset + q0 + warp * 16 + g;
  float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.0f, 0.0f};
  float o[DH / 8][4];
#pragma unroll
  for (int n = 0; n < DH / 8; ++n) {
    o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  }

#pragma unroll 1
  for (int j = 0; j < n_tiles; ++j) {
    cp_async_wait<0>();
    __syncthreads();  // K_j (and Q) in place; every warp done with V_{j-1}
    load_tile(vs, vb, j * BN, kv_end);
    cp_async_commit();

    float s[BN / 8][4];
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
    }
#pragma unroll
    for (int kd = 0; kd < DH / 16; ++kd) {
      unsigned a[4];
      ldmatrix_x4(qa + kd * 32, a);
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        unsigned bk[4];
        ldmatrix_x4(ka + np * 16 * ROWB + kd * 32, bk);
        Mma<xt>::run(s[2 * np], a, bk[0], bk[1]);
        Mma<xt>::run(s[2 * np + 1], a, bk[2], bk[3]);
      }
    }
    if (j >= j_diag) {  // keys past a row's position do not count
#pragma unroll
      for (int n = 0; n < BN / 8; ++n) {
        const int kp = j * BN + n * 8 + 2 * t4;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (kp + (e & 1) > qp0 + (e >> 1) * 8) {
            s[n][e] = neg_inf();
          }
        }
      }
    }
    // online softmax, rows r = 0 (g), 1 (g + 8): the 4 lanes of a quad hold a row
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx_ = neg_inf();
#pragma unroll
      for (int n = 0; n < BN / 8; ++n) {
        mx_ = fmaxf(mx_, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
      }
      mx_ = fmaxf(mx_, __shfl_xor_sync(0xffffffffu, mx_, 1));
      mx_ = fmaxf(mx_, __shfl_xor_sync(0xffffffffu, mx_, 2));
      // key 0 is in tile 0 and before every row's position: m is finite from
      // the first tile on, so alpha is 0 there (m = -inf) and never NaN
      const float m_new = fmaxf(m[r], mx_ * scale_log2);
      const float alpha = exp2f(m[r] - m_new);
      m[r] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int n = 0; n < BN / 8; ++n) {
        s[n][2 * r] = exp2f(fmaf(s[n][2 * r], scale_log2, -m_new));
        s[n][2 * r + 1] = exp2f(fmaf(s[n][2 * r + 1], scale_log2, -m_new));
        sum += s[n][2 * r] + s[n][2 * r + 1];
      }
      l[r] = l[r] * alpha + sum;  // this lane's share of the row; the quad adds them at the end
#pragma unroll
      for (int n = 0; n < DH / 8; ++n) {
        o[n][2 * r] *= alpha;
        o[n][2 * r + 1] *= alpha;
      }
    }

    // P in the input type: the accumulators of key blocks 2kk, 2kk+1 are
    // the A fragment of keys [16kk, 16kk + 16)
    unsigned p[BN / 16][4];
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      p[kk][0] = Mma<xt>::pack(s[2 * kk][0], s[2 * kk][1]);
      p[kk][1] = Mma<xt>::pack(s[2 * kk][2], s[2 * kk][3]);
      p[kk][2] = Mma<xt>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      p[kk][3] = Mma<xt>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }

    cp_async_wait<0>();
    __syncthreads();  // V_j in place; every warp done with K_j
    if (j + 1 < n_tiles) {
      load_tile(ks, kb, (j + 1) * BN, kv_end);
      cp_async_commit();
    }
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
      for (int nd = 0; nd < DH / 16; ++nd) {
        unsigned bv[4];
        ldmatrix_x4_trans(va + kk * 16 * ROWB + nd * 32, bv);
        Mma<xt>::run(o[2 * nd], p[kk], bv[0], bv[1]);
        Mma<xt>::run(o[2 * nd + 1], p[kk], bv[2], bv[3]);
      }
    }
  }

  // normalise, round, and stage the warp's 16 rows in its own Q rows (no
  // other warp reads them), then 16-byte stores of whole rows
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    l[r] = 1.0f / l[r];
  }
  unsigned char* stage = smem + (warp * 16) * ROWB;
#pragma unroll
  for (int n = 0; n < DH / 8; ++n) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      *reinterpret_cast<unsigned*>(stage + (g + 8 * r) * ROWB + (n * 8 + 2 * t4) * 2) =
          Mma<xt>::pack(o[n][2 * r] * l[r], o[n][2 * r + 1] * l[r]);
    }
  }
  __syncwarp();
#pragma unroll
  for (int i = 0; i < 16 * CHUNKS / 32; ++i) {
    const int c = lane + i * 32;
    const int r = c / CHUNKS, col = (c % CHUNKS) * 8;
    const int t = q0 + warp * 16 + r;
    if (t < T) {
      *reinterpret_cast<uint4*>(out + ((size_t)(b * T + t) * hq + h) * DH + col) =
          *reinterpret_cast<const uint4*>(stage + r * ROWB + col * 2);
    }
  }
}
