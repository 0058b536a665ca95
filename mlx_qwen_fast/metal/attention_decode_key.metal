// Gated attention decode, the new key: rms_norm + rope of each KV head's key
// at the cache offset (the body of an mx.fast.metal_kernel;
// kernels/attention_decode_metal.py builds it with attention_decode.h as its
// header; MLX adds the signature). Same contract as ATT_KIND 0 of
// cuda/attention_decode.cu.
//
// One SIMD group (32 threads) per (row b, KV head j); lane l owns dims
// l + 32 e (e < 8). Inputs: proj [B, P] (T), P = 2*HQ*256 + 2*HKV*256 (per row
// HQ x (query 256 | gate 256), then HKV keys, then HKV values), k_norm_weight
// [256] (W), offset (int32, 0-d), cap (int32, 0-d: the cache's capacity),
// cfg float32 [5] (q_eps, k_eps, scale * log2(e), log2(rope_base),
// rope_scale). Outputs: k_new [B, HKV, 1, 256] (T) and at (int32 [1]): the
// offset clamped to [0, cap), the row the caller's slice updates write (MLX's
// dynamic slice update does not bound its start). Template: T, W, HQ, HKV,
// ROPE_DIMS, ROPE_TRAD.

    constexpr int P = 2 * HQ * MQF_DH + 2 * HKV * MQF_DH;
    threadgroup float sh[MQF_DH];

    const uint lane = thread_index_in_simdgroup;
    const uint bj = threadgroup_position_in_grid.x;  // b * HKV + j
    const uint b = bj / HKV;
    const uint j = bj % HKV;
    const int off = offset;
    if (bj == 0 && lane == 0) {
        at[0] = metal::clamp(off, 0, cap - 1);
    }
    const device T* src = proj + size_t(b) * P + 2 * HQ * MQF_DH + j * MQF_DH + lane;
    float x[MQF_EL];
    for (int e = 0; e < MQF_EL; e++) {
        x[e] = static_cast<float>(src[32 * e]);
    }
    mqf_norm_rope<T, W, ROPE_DIMS, ROPE_TRAD>(x, k_norm_weight, cfg[1], cfg[4] * float(off), cfg[3], sh, lane);
    device T* dst = k_new + size_t(bj) * MQF_DH + lane;
    for (int e = 0; e < MQF_EL; e++) {
        dst[32 * e] = static_cast<T>(sh[lane + 32 * e]);
    }
