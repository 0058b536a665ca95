// Gated attention decode (one query token per row), head_dim 256: the
// constants and device functions shared by the kernels
// attention_decode_{key,single,split,combine}.metal (kernels/
// attention_decode_metal.py passes this file as each mx.fast.metal_kernel's
// header).
//
// Rounding points are the stock path's (mlx_lm Qwen3NextAttention.__call__
// with MLX's fast ops): rms_norm rounds x * rsqrt(mean(x^2) + eps) to the
// activation type T, then its product with the weight; rope rounds its
// result; everything else is fp32. RoPE as MLX's fast.rope: the first
// ROPE_DIMS dims of a head rotate in pairs (i, i + ROPE_DIMS/2) (or (2i,
// 2i+1) when traditional) by the angle pos * 2^(-(i / (ROPE_DIMS/2)) *
// log2(base)), pos = rope_scale * offset; the other dims pass.

constant constexpr int MQF_DH = 256;  // head_dim
// dims per lane: lane l owns l, l + 32, ..., l + 224 (consecutive lanes, consecutive
// addresses: coalesced device accesses, conflict-free threadgroup ones)
constant constexpr int MQF_EL = MQF_DH / 32;
// A tile row in threadgroup memory: the head's 256 elements and 2 of
// padding, so that 32 lanes reading one column of 32 rows hit 32 banks.
constant constexpr int MQF_ROW = MQF_DH + 2;

// rms_norm then rope of one head held by one SIMD group (x: this lane's
// MQF_EL raw values). The rotated values, rounded to T, end in sh[0, 256)
// (threadgroup memory of this SIMD group). Contains threadgroup barriers:
// every thread of the threadgroup calls it once, at the same point.
template <typename T, typename W, int ROPE_DIMS, bool TRAD>
inline void mqf_norm_rope(thread const float* x, const device W* w, float eps, float pos, float log2_base,
                          threadgroup float* sh, uint lane) {
    float ss = 0.0f;
    for (int e = 0; e < MQF_EL; e++) {
        ss += x[e] * x[e];
    }
    ss = simd_sum(ss);
    const float r = metal::precise::rsqrt(ss / float(MQF_DH) + eps);
    for (int e = 0; e < MQF_EL; e++) {
        const int d = int(lane) + 32 * e;
        sh[d] = static_cast<float>(static_cast<T>(
            static_cast<float>(w[d]) * static_cast<float>(static_cast<T>(x[e] * r))));
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    constexpr int HALF = ROPE_DIMS / 2;
    for (int i = int(lane); i < HALF; i += 32) {
        const int d1 = TRAD ? 2 * i : i;
        const int d2 = TRAD ? 2 * i + 1 : i + HALF;
        const float theta = pos * metal::exp2(-(float(i) / float(HALF)) * log2_base);
        const float c = metal::cos(theta);
        const float s = metal::sin(theta);
        const float x1 = sh[d1];
        const float x2 = sh[d2];
        sh[d1] = static_cast<float>(static_cast<T>(x1 * c - x2 * s));
        sh[d2] = static_cast<float>(static_cast<T>(x1 * s + x2 * c));
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
}

// Rows [0, n) of a [*, 256] slab of device memory into a tile of MQF_ROW-wide
// rows, by the NT threads of the threadgroup (consecutive threads read
// consecutive elements).
template <typename T>
inline void mqf_load_rows(const device T* src, int n, threadgroup T* tile, uint tid, uint nt) {
    for (int i = int(tid); i < n * MQF_DH; i += int(nt)) {
        tile[(i / MQF_DH) * MQF_ROW + i % MQF_DH] = src[i];
    }
}

// Online softmax attention of the threadgroup's G query heads (SIMD group g
// is head g of the KV head) over positions [lo, hi) of one KV head's cache
// rows kh, vh ([cap, 256] each; hi <= cap), in tiles of TILE positions:
// the tile's K rows go to threadgroup memory once for all G heads; lane r
// (with LPP = 32 / TILE lanes per row, lane r * LPP + part) takes the dot
// product of row r with its head's query, so a tile costs each SIMD group
// one simd_max and one simd_sum (and one simd_shuffle_xor for LPP = 2); then the tile's V rows replace the K rows
// and each lane accumulates its MQF_EL dims over the tile. Scores in log2
// units (q . k * scale * log2(e), sl2 = scale * log2(e)).
//   q:   this SIMD group's query (256 floats, threadgroup memory, rounded)
//   kv:  TILE * MQF_ROW elements; ps: G * TILE floats (threadgroup memory)
// Out: m (max score), l (sum of 2^(score - m)), acc (this lane's MQF_EL
// dims of sum 2^(score - m) v), unnormalised; m = -inf, l = 0, acc = 0
// when lo >= hi. Contains threadgroup barriers (uniform lo, hi).
template <typename T, int G, int TILE>
inline void mqf_attend(const device T* kh, const device T* vh, int lo, int hi, const threadgroup float* q,
                       float sl2, threadgroup T* kv, threadgroup float* ps, uint tid, uint sg, uint lane,
                       thread float& m, thread float& l, thread float* acc) {
    constexpr int LPP = 32 / TILE;
    const int r = int(lane) / LPP;
    const int part = int(lane) % LPP;
    m = -metal::numeric_limits<float>::infinity();
    l = 0.0f;
    for (int e = 0; e < MQF_EL; e++) {
        acc[e] = 0.0f;
    }
    threadgroup float* pw = ps + sg * TILE;
    for (int t0 = lo; t0 < hi; t0 += TILE) {
        const int n = metal::min(TILE, hi - t0);
        mqf_load_rows(kh + size_t(t0) * MQF_DH, n, kv, tid, G * 32);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        float sc = -metal::numeric_limits<float>::infinity();
        if (r < n) {
            // the LPP lanes of a row take interleaved dims: bank-conflict free
            // for fp32 rows (LPP = 2) as for 16-bit ones (LPP = 1)
            const threadgroup T* kr = kv + r * MQF_ROW;
            float d = 0.0f;
            for (int i = part; i < MQF_DH; i += LPP) {
                d += q[i] * static_cast<float>(kr[i]);
            }
            sc = d;
        }
        if (LPP > 1) {
            sc += simd_shuffle_xor(sc, ushort(1));
        }
        sc *= sl2;
        const float mn = metal::max(m, simd_max(sc));
        const float alpha = metal::exp2(m - mn);  // 0 for the first tile (m = -inf)
        const float p = r < n ? metal::exp2(sc - mn) : 0.0f;
        l = l * alpha + simd_sum(part == 0 ? p : 0.0f);
        m = mn;
        if (part == 0) {
            pw[r] = p;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);  // K rows read; the weights visible
        mqf_load_rows(vh + size_t(t0) * MQF_DH, n, kv, tid, G * 32);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (int e = 0; e < MQF_EL; e++) {
            acc[e] *= alpha;
        }
        for (int j = 0; j < n; j++) {
            const float wj = pw[j];
            const threadgroup T* vr = kv + j * MQF_ROW + lane;
            for (int e = 0; e < MQF_EL; e++) {
                acc[e] += wj * static_cast<float>(vr[32 * e]);
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);  // V rows read before the next K rows
    }
}
