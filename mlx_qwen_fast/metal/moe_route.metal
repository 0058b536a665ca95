// MoE routing of decode tokens: softmax over the router logits, top-k,
// optional renormalisation; the body of an mx.fast.metal_kernel
// (kernels/moe_route_metal.py builds it; MLX adds the signature). Same
// contract as stage 1 of cuda/moe_routing.cu without the shared slot.
//
// One threadgroup of one SIMD group (32 threads) per token: lane l holds the
// logits of experts i * 32 + l (i < E / 32) in registers. fp32 softmax (max
// subtracted, exp, one division), then K rounds of a SIMD arg-max: the
// largest probability (simd_max), then the lowest expert id holding it
// (simd_min), so ties go to the lower id; the winner's lane retires that
// entry (-1: below every probability). Slots are written in decreasing
// probability; with NORM each is divided by the sum of the K (added in slot
// order).
//
// Inputs: logits [N, E] (float, half or bfloat). Outputs: inds [N, K] int32,
// scores [N, K] float. Template: E (a multiple of 32, at most 1024), K
// (1..min(32, E)), NORM (0 or 1). Launch: grid 32 N threads, threadgroup 32.

    constexpr int EPL = E / 32;
    uint lane = thread_index_in_simdgroup;
    uint n = threadgroup_position_in_grid.x;
    size_t row = size_t(n) * E;

    float p[EPL];
    float m = -metal::numeric_limits<float>::infinity();
    for (int i = 0; i < EPL; i++) {
        p[i] = static_cast<float>(logits[row + i * 32 + lane]);
        m = metal::max(m, p[i]);
    }
    m = simd_max(m);
    float s = 0.0f;
    for (int i = 0; i < EPL; i++) {
        p[i] = metal::exp(p[i] - m);
        s += p[i];
    }
    s = simd_sum(s);
    float inv = 1.0f / s;
    for (int i = 0; i < EPL; i++) {
        p[i] = p[i] * inv;
    }

    int my_i = 0;
    float my_p = 0.0f;
    float tot = 0.0f;
    for (int j = 0; j < K; j++) {
        float bp = p[0];
        uint bi = lane;
        for (int i = 1; i < EPL; i++) {
            if (p[i] > bp) {  // strict: the lower id wins a tie within the lane
                bp = p[i];
                bi = uint(i) * 32 + lane;
            }
        }
        float best = simd_max(bp);
        uint id = simd_min(bp == best ? bi : 0xFFFFFFFFu);
        tot += best;
        if (lane == uint(j)) {
            my_i = int(id);
            my_p = best;
        }
        if (lane == id % 32) {
            for (int i = 0; i < EPL; i++) {  // constant indices: p stays in registers
                if (uint(i) == id / 32) {
                    p[i] = -1.0f;
                }
            }
        }
    }
    if (lane < uint(K)) {
        inds[size_t(n) * K + lane] = my_i;
        scores[size_t(n) * K + lane] = NORM ? my_p / tot : my_p;
    }
