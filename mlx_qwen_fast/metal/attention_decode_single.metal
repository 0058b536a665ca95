// Gated attention decode, single pass: attention over the whole cache and
// the sigmoid output gate in one launch (the body of an mx.fast.metal_kernel;
// kernels/attention_decode_metal.py builds it with attention_decode.h as its
// header and runs it for caches of at most SINGLE_PASS_MAX positions).
//
// One threadgroup of G = HQ / HKV SIMD groups per (row b, KV head j); SIMD
// group g is query head h = j * G + g: its rms_norm + rope at the offset,
// then mqf_attend over positions [0, min(offset, cap - 1)] (each K/V row
// read from device memory once per threadgroup, for all G heads), then
// out = round(round(acc / l) * sigmoid(gate)). Inputs: proj [B, P] (T),
// keys, values [B, HKV, cap, 256] (T, this token's row written at the
// offset), offset (int32, 0-d), q_norm_weight [256] (W), cfg float32 [5]
// (q_eps, k_eps, scale * log2(e), log2(rope_base), rope_scale). Output: out
// [B, HQ * 256] (T). Template: T, W, HQ, HKV, ROPE_DIMS, ROPE_TRAD.
// Positions >= cap are never read, whatever the offset holds.

    constexpr int G = HQ / HKV;
    constexpr int P = 2 * HQ * MQF_DH + 2 * HKV * MQF_DH;
    constexpr int TILE = 16384 / (MQF_DH * int(sizeof(T)));  // 16 KB of K or V rows: 32 (16-bit T) or 16
    threadgroup T kv[TILE * MQF_ROW];
    threadgroup float qs[G * MQF_DH];
    threadgroup float ps[G * TILE];

    const uint tid = thread_index_in_threadgroup;
    const uint lane = thread_index_in_simdgroup;
    const uint sg = simdgroup_index_in_threadgroup;
    const uint bj = threadgroup_position_in_grid.x;  // b * HKV + j
    const uint b = bj / HKV;
    const uint h = (bj % HKV) * G + sg;
    const int cap = keys_shape[2];
    const int off = offset;
    const int hi = metal::min(off, cap - 1) + 1;

    const device T* qrow = proj + size_t(b) * P + h * 2 * MQF_DH;
    float x[MQF_EL];
    for (int e = 0; e < MQF_EL; e++) {
        x[e] = static_cast<float>(qrow[lane + 32 * e]);
    }
    threadgroup float* q = qs + sg * MQF_DH;
    mqf_norm_rope<T, W, ROPE_DIMS, ROPE_TRAD>(x, q_norm_weight, cfg[0], cfg[4] * float(off), cfg[3], q, lane);

    float m, l, acc[MQF_EL];
    const size_t head = size_t(bj) * cap * MQF_DH;
    mqf_attend<T, G, TILE>(keys + head, values + head, 0, hi, q, cfg[2], kv, ps, tid, sg, lane, m, l, acc);

    device T* o = out + size_t(b) * HQ * MQF_DH + h * MQF_DH + lane;
    for (int e = 0; e < MQF_EL; e++) {
        const float a = static_cast<float>(static_cast<T>(acc[e] / l));
        const float g = static_cast<float>(qrow[MQF_DH + lane + 32 * e]);
        o[32 * e] = static_cast<T>(a / (1.0f + metal::exp(-g)));
    }
