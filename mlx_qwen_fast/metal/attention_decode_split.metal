// Gated attention decode, split-K: the partial attention of one block of
// BLOCK cache positions (the body of an mx.fast.metal_kernel;
// kernels/attention_decode_metal.py builds it with attention_decode.h as its
// header; attention_decode_combine.metal merges the blocks).
//
// One threadgroup of G = HQ / HKV SIMD groups per (row b, KV head j, block s),
// NS = ceil(cap / BLOCK) blocks per KV head; SIMD group g is query head
// h = j * G + g: its rms_norm + rope at the offset, then mqf_attend over the
// block's positions up to min(offset, cap - 1) (each K/V row read once per
// threadgroup, for all G heads). A block past the offset writes an empty
// partial (m = -inf, l = 0, acc = 0) without reading anything. Inputs: as
// attention_decode_single.metal. Output: part float32 [B * HQ, NS, 258],
// row (b * HQ + h, s) = the unnormalised acc (256), then m and l in log2
// units. Template: T, W, HQ, HKV, ROPE_DIMS, ROPE_TRAD, BLOCK.

    constexpr int G = HQ / HKV;
    constexpr int P = 2 * HQ * MQF_DH + 2 * HKV * MQF_DH;
    constexpr int TILE = 16384 / (MQF_DH * int(sizeof(T)));  // 16 KB of K or V rows: 32 (16-bit T) or 16
    threadgroup T kv[TILE * MQF_ROW];
    threadgroup float qs[G * MQF_DH];
    threadgroup float ps[G * TILE];

    const uint tid = thread_index_in_threadgroup;
    const uint lane = thread_index_in_simdgroup;
    const uint sg = simdgroup_index_in_threadgroup;
    const int cap = keys_shape[2];
    const int ns = (cap + BLOCK - 1) / BLOCK;
    const uint grp = threadgroup_position_in_grid.x;  // (b * HKV + j) * NS + s
    const int s = int(grp % uint(ns));
    const uint bj = grp / uint(ns);
    const uint b = bj / HKV;
    const uint h = (bj % HKV) * G + sg;
    const int off = offset;
    const int lo = s * BLOCK;
    const int hi = metal::min(lo + BLOCK, metal::min(off, cap - 1) + 1);
    device float* row = part + (size_t(b * HQ + h) * ns + s) * (MQF_DH + 2);

    if (lo >= hi) {  // the whole threadgroup leaves, before any barrier
        for (int e = 0; e < MQF_EL; e++) {
            row[lane + 32 * e] = 0.0f;
        }
        if (lane == 0) {
            row[MQF_DH] = -metal::numeric_limits<float>::infinity();
            row[MQF_DH + 1] = 0.0f;
        }
        return;
    }
    const device T* qrow = proj + size_t(b) * P + h * 2 * MQF_DH;
    float x[MQF_EL];
    for (int e = 0; e < MQF_EL; e++) {
        x[e] = static_cast<float>(qrow[lane + 32 * e]);
    }
    threadgroup float* q = qs + sg * MQF_DH;
    mqf_norm_rope<T, W, ROPE_DIMS, ROPE_TRAD>(x, q_norm_weight, cfg[0], cfg[4] * float(off), cfg[3], q, lane);

    float m, l, acc[MQF_EL];
    const size_t head = size_t(bj) * cap * MQF_DH;
    mqf_attend<T, G, TILE>(keys + head, values + head, lo, hi, q, cfg[2], kv, ps, tid, sg, lane, m, l, acc);

    for (int e = 0; e < MQF_EL; e++) {
        row[lane + 32 * e] = acc[e];
    }
    if (lane == 0) {
        row[MQF_DH] = m;
        row[MQF_DH + 1] = l;
    }
