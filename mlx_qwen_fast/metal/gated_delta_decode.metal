// Gated DeltaNet decode step (one token), the body of an mx.fast.metal_kernel
// (kernels/gated_delta_decode_metal.py builds it; MLX adds the signature).
// Same contract as cuda/gated_delta_decode.cu: conv state update, depthwise
// conv + SiLU, q/k L2 norm (q scaled by D^-1/2), gates, the gated delta rule
// update and readout, the gated RMSNorm with z -- fp32 arithmetic.
//
// One threadgroup of 128 threads per (batch row b, value head h); thread t
// owns row t of the head's fp32 state [128 x 128] (value index t, all key
// indices) and channel t of q, k (the head's key head) and v.
// Inputs: proj [B, P] (T), params float32 [C*4 | A_log Hv | dt_bias Hv |
// norm_weight 128], conv_state [B, 3, C] (T), state [B, Hv, 128, 128] float32,
// eps float32 [2] (qk_eps, norm_eps). Outputs: out [B, Hv*128] (T),
// new_conv [B, 3, C] (T), new_state like state. Template: T, HK, HV.

    constexpr int D = 128;
    constexpr int KW = 4;
    constexpr int C = (2 * HK + HV) * D;
    constexpr int P = C + HV * D + 2 * HV;
    threadgroup float red[2][4];
    threadgroup float qs[D];
    threadgroup float ks[D];

    uint t = thread_position_in_threadgroup.x;
    uint lane = thread_index_in_simdgroup;
    uint sg = simdgroup_index_in_threadgroup;
    uint grp = threadgroup_position_in_grid.x;
    uint b = grp / HV;
    uint h = grp % HV;
    uint hk = h / (HV / HK);
    const device T* row = proj + size_t(b) * P;
    const device T* cs = conv_state + size_t(b) * (KW - 1) * C;
    device T* ncs = new_conv + size_t(b) * (KW - 1) * C;

    // depthwise conv over the 3 kept inputs and the new one, then SiLU; the
    // new conv state keeps the last 3 inputs
    uint chan[3] = {hk * D + t, HK * D + hk * D + t, 2 * HK * D + h * D + t};
    float act[3];
    for (int c = 0; c < 3; c++) {
        uint ch = chan[c];
        float acc = 0.0f;
        for (int j = 0; j < KW - 1; j++) {
            acc += params[ch * KW + j] * static_cast<float>(cs[j * C + ch]);
        }
        acc += params[ch * KW + KW - 1] * static_cast<float>(row[ch]);
        act[c] = acc / (1.0f + metal::exp(-acc));
        bool owner = (c == 2) || (h % (HV / HK) == 0);  // q/k channels: the key head's first value head
        if (owner) {
            for (int j = 0; j < KW - 2; j++) {
                ncs[j * C + ch] = cs[(j + 1) * C + ch];
            }
            ncs[(KW - 2) * C + ch] = row[ch];
        }
    }

    // q/k L2 norms over the head (4 SIMD groups of 32)
    float sq = simd_sum(act[0] * act[0]);
    float sk = simd_sum(act[1] * act[1]);
    if (lane == 0) {
        red[0][sg] = sq;
        red[1][sg] = sk;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    sq = red[0][0] + red[0][1] + red[0][2] + red[0][3];
    sk = red[1][0] + red[1][1] + red[1][2] + red[1][3];
    float qn = act[0] * metal::precise::rsqrt(sq + eps[0]) * metal::precise::rsqrt(float(D));
    float kn = act[1] * metal::precise::rsqrt(sk + eps[0]);
    qs[t] = static_cast<float>(static_cast<T>(qn));  // q, k, v rounded to T, as the layer stores them
    ks[t] = static_cast<float>(static_cast<T>(kn));
    float v = static_cast<float>(static_cast<T>(act[2]));
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // gates
    float a = static_cast<float>(row[C + HV * D + h]);
    float bb = static_cast<float>(row[C + HV * D + HV + h]);
    float A_log = params[C * KW + h];
    float dt_bias = params[C * KW + HV + h];
    float x = a + dt_bias;
    float softplus = x > 20.0f ? x : metal::log(1.0f + metal::exp(x));
    float g = metal::exp(-metal::exp(A_log) * softplus);
    float beta = 1.0f / (1.0f + metal::exp(-bb));

    // the gated delta rule on state row t
    size_t srow = ((size_t(b) * HV + h) * D + t) * D;
    float kv_mem = 0.0f;
    for (int j = 0; j < D; j++) {
        kv_mem += g * state[srow + j] * ks[j];
    }
    float delta = (v - kv_mem) * beta;
    float y = 0.0f;
    for (int j = 0; j < D; j++) {
        float s = g * state[srow + j] + ks[j] * delta;
        new_state[srow + j] = s;
        y += s * qs[j];
    }

    // gated RMSNorm: rms_norm(y) * weight * silu(z), y rounded to T first
    float yt = static_cast<float>(static_cast<T>(y));
    float ss = simd_sum(yt * yt);
    if (lane == 0) {  // every read of red[0] above precedes the barrier after qs/ks
        red[0][sg] = ss;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    ss = red[0][0] + red[0][1] + red[0][2] + red[0][3];
    float z = static_cast<float>(row[C + h * D + t]);
    float n = yt * metal::precise::rsqrt(ss / D + eps[1]) * params[C * KW + 2 * HV + t];
    out[size_t(b) * HV * D + h * D + t] = static_cast<T>(n * (z / (1.0f + metal::exp(-z))));
