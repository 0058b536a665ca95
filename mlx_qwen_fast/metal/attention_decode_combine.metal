// Gated attention decode, the combine of the split-K blocks with the sigmoid
// output gate (the body of an mx.fast.metal_kernel; kernels/
// attention_decode_metal.py builds it with attention_decode.h as its header).
//
// One threadgroup of 256 threads per (row b, query head h), thread t = dim t:
// M = max_s m_s, L = sum_s l_s 2^(m_s - M), o = sum_s acc_s[t] 2^(m_s - M) / L
// (the log-sum-exp merge of the blocks; empty blocks, m_s = -inf, weigh 0),
// out = round(round(o) * sigmoid(gate)). Every thread walks the NS blocks
// itself (no barriers). Inputs: part float32 [B * HQ, NS, 258] (attention_
// decode_split.metal), proj [B, P] (T). Output: out [B, HQ * 256] (T).
// Template: T, HQ, HKV.

    constexpr int P = 2 * HQ * MQF_DH + 2 * HKV * MQF_DH;
    constexpr int R = MQF_DH + 2;
    const uint t = thread_position_in_threadgroup.x;
    const uint bh = threadgroup_position_in_grid.x;  // b * HQ + h
    const uint b = bh / HQ;
    const uint h = bh % HQ;
    const int ns = part_shape[1];
    const device float* rows = part + size_t(bh) * ns * R;
    float M = -metal::numeric_limits<float>::infinity();
    for (int s = 0; s < ns; s++) {
        M = metal::max(M, rows[s * R + MQF_DH]);
    }
    float L = 0.0f;
    float o = 0.0f;
    for (int s = 0; s < ns; s++) {
        const float w = metal::exp2(rows[s * R + MQF_DH] - M);
        L += w * rows[s * R + MQF_DH + 1];
        o += w * rows[s * R + t];
    }
    const float a = static_cast<float>(static_cast<T>(o / L));
    const float g = static_cast<float>(proj[size_t(b) * P + h * 2 * MQF_DH + MQF_DH + t]);
    out[size_t(bh) * MQF_DH + t] = static_cast<T>(a / (1.0f + metal::exp(-g)));
