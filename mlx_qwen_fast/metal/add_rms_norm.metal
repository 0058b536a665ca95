// A residual add and the RMSNorm that follows it, in one pass over the row;
// the body of an mx.fast.metal_kernel (kernels/add_rms_norm_metal.py builds
// it; MLX adds the signature).
//
//   h = x + y                                (rounded to T, as MLX's add)
//   normed = OT(OT(h * rsqrt(mean(h^2) + eps)) * weight)
//
// which is what mx.fast.rms_norm(h, weight, eps) computes: the sum of squares
// of h (as stored, in T) in fp32, h times the inverse root rounded to the
// output type, then the product with the weight rounded again. One add of
// two T values in fp32 rounded once to T is the correctly rounded T sum
// (fp32 carries at least 2p + 2 bits of a p-bit format), as MLX's add.
//
// One threadgroup of TG threads per row: thread t holds elements t + i * TG
// (i < R, coalesced reads) in registers between the sum of squares and the
// normalisation, so each row is read once. Sum: per-thread, then simd_sum,
// then one partial per SIMD group through threadgroup memory, added by every
// thread in SIMD-group order (the same total in every thread).
//
// Inputs: x, y [N, D] (T), weight [D] (any float type), eps (0-d float).
// Outputs: h [N, D] (T), normed [N, D] (OT, MLX's promotion of T and the
// weight's type). Template: T, OT, D, TG (a multiple of 32, at most 1024),
// R = ceil(D / TG). Launch: grid TG * N threads, threadgroup TG.

    constexpr int SG = TG / 32;
    uint t = thread_position_in_threadgroup.x;
    uint lane = thread_index_in_simdgroup;
    uint sg = simdgroup_index_in_threadgroup;
    size_t base = size_t(threadgroup_position_in_grid.x) * D;
    threadgroup float partial[SG];

    float v[R];
    float sum_sq = 0.0f;
    for (int i = 0; i < R; i++) {
        int d = int(t) + i * TG;
        v[i] = 0.0f;
        if (d < D) {
            T s = static_cast<T>(static_cast<float>(x[base + d]) + static_cast<float>(y[base + d]));
            h[base + d] = s;
            v[i] = static_cast<float>(s);
        }
        sum_sq += v[i] * v[i];
    }
    sum_sq = simd_sum(sum_sq);
    if (lane == 0) {
        partial[sg] = sum_sq;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float total = 0.0f;
    for (int s = 0; s < SG; s++) {
        total += partial[s];
    }
    float inv = metal::precise::rsqrt(total / D + eps);
    for (int i = 0; i < R; i++) {
        int d = int(t) + i * TG;
        if (d < D) {
            OT n = static_cast<OT>(v[i] * inv);
            normed[base + d] = static_cast<OT>(static_cast<float>(n) * static_cast<float>(weight[d]));
        }
    }
