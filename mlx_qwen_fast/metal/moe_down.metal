// Down GEMVs, routing weights, the sigmoid-gated shared expert and the
// combine of the decode MoE; the body of an mx.fast.metal_kernel
// (kernels/moe_down_metal.py builds it; MLX adds the signature). Same
// contract as MDG_KIND 1 of cuda/moe_decode_gemv.cu (without the residual).
//
// Weights: MLX affine 4-bit, group 64, dequantised in registers as in
// moe_gate_up.metal: s * sum(q h) + b * sum(h) over a lane's 16 inputs, fp32.
//
// Grid: D / 4 threadgroups of NW SIMD groups (the launch chooses NW; any
// NW >= 1 gives the same bits). Threadgroup t: output rows [4 t, +4) of y
// for every token. Items: slot s < NK = N K is pair s (expert inds[s]),
// slot NK the shared expert; SIMD group g takes slots g, g + NW, ... For a
// slot whose expert a lower slot also lists, every entry is 0; otherwise,
// per token n and row, coef[n] * T(h[hrow[n]] . Wd[row]) with coef[n] the
// sum of n's scores for that expert (0 if n did not pick it, both if n
// listed it twice) and hrow[n] n's first pair with it (the shared expert:
// sgate[n], row NK + n). Lane l takes inputs [16 l + 512 c, +16) (I needs
// only to be a multiple of 64); one simd_sum per row (a float4 holding the
// tokens). The entries meet in threadgroup memory and are added in slot
// order in fp32 (fixed order, no atomics), then stored as T.
// Expert ids are clamped into [0, E) for addressing (the wrapper checks
// them).
//
// Inputs: h [NK + N, I] (T), inds [N, K] int32, scores [N, K] float, sgate
// [N] float, wd, sd, bd (routed [E, D, I/8] uint32 / [E, D, I/64] bf16), xwd,
// xsd, xbd (shared [D, I/8] / [D, I/64]). Output: y [N, D] (T).
// Template: T (float or bfloat), N (1..4); K, I, D and E from the inputs'
// shapes (NK <= 32).

    constexpr int RD = 4;  // output rows per threadgroup
    const int K = inds_shape[1];
    const int NK = N * K;
    const int I = h_shape[1];
    const int E = wd_shape[0];
    const int D = wd_shape[1];
    const int IW = I / 8;
    const int IG = I / 64;
    threadgroup float part[33][RD][N];  // [slot][row][token]: NK + 1 <= 33 slots

    uint lane = thread_index_in_simdgroup;
    uint sgi = simdgroup_index_in_threadgroup;
    uint nsg = simdgroups_per_threadgroup;
    int row0 = int(threadgroup_position_in_grid.x) * RD;

    for (int s = int(sgi); s <= NK; s += int(nsg)) {
        float coef[N];
        int hrow[N];
        uint mask = 0u;
        int e = -1;  // -1: the shared expert
        if (s < NK) {
            e = inds[s];
            bool dup = false;
            for (int q = 0; q < s; q++) {
                dup = dup || inds[q] == e;
            }
            for (int n = 0; n < N; n++) {
                coef[n] = 0.0f;
                hrow[n] = 0;
                for (int j = K - 1; j >= 0; j--) {  // downwards: hrow ends at the first pair
                    int q = n * K + j;
                    if (!dup && inds[q] == e) {
                        coef[n] += scores[q];
                        hrow[n] = q;
                        mask |= 1u << n;
                    }
                }
            }
        } else {
            for (int n = 0; n < N; n++) {
                coef[n] = sgate[n];
                hrow[n] = NK + n;
            }
            mask = (1u << N) - 1u;
        }
        if (mask == 0u) {  // a duplicate slot (the whole SIMD group): its entries are 0
            for (int r = 0; r < RD; r++) {
                for (int n = 0; n < N; n++) {
                    if (lane == uint(r * N + n)) {
                        part[s][r][n] = 0.0f;
                    }
                }
            }
            continue;
        }
        size_t ew = 0;
        size_t eg = 0;
        if (e >= 0) {
            uint ec = metal::min(uint(e), uint(E - 1));
            ew = size_t(ec) * D * IW;
            eg = size_t(ec) * D * IG;
        }
        const device uint32_t* wp = e >= 0 ? wd + ew : xwd;
        const device bfloat16_t* sp = e >= 0 ? sd + eg : xsd;
        const device bfloat16_t* bp = e >= 0 ? bd + eg : xbd;

        float4 acc[RD];
        for (int r = 0; r < RD; r++) {
            acc[r] = float4(0.0f);
        }
        for (int k0 = int(lane) * 16; k0 < I; k0 += 512) {
            float hv[N][16];
            float hs[N];
            for (int n = 0; n < N; n++) {
                hs[n] = 0.0f;
                if (mask & (1u << n)) {
                    for (int i = 0; i < 16; i++) {
                        hv[n][i] = static_cast<float>(h[size_t(hrow[n]) * I + k0 + i]);
                        hs[n] += hv[n][i];
                    }
                }
            }
            for (int r = 0; r < RD; r++) {
                size_t wo = size_t(row0 + r) * IW + k0 / 8;
                size_t go = size_t(row0 + r) * IG + k0 / 64;
                uint w0 = wp[wo];
                uint w1 = wp[wo + 1];
                float sc = static_cast<float>(sp[go]);
                float bi = static_cast<float>(bp[go]);
                float q[16];
                for (int i = 0; i < 8; i++) {
                    q[i] = float((w0 >> (4 * i)) & 15u);
                    q[8 + i] = float((w1 >> (4 * i)) & 15u);
                }
                for (int n = 0; n < N; n++) {
                    if (mask & (1u << n)) {
                        float d = 0.0f;
                        for (int i = 0; i < 16; i++) {
                            d += q[i] * hv[n][i];
                        }
                        acc[r][n] += sc * d + bi * hs[n];
                    }
                }
            }
        }
        for (int r = 0; r < RD; r++) {
            acc[r] = simd_sum(acc[r]);
        }
        for (int r = 0; r < RD; r++) {  // lane r N + n stores entry (r, n)
            for (int n = 0; n < N; n++) {
                if (lane == uint(r * N + n)) {
                    float v = static_cast<float>(static_cast<T>(acc[r][n]));
                    part[s][r][n] = (mask & (1u << n)) ? coef[n] * v : 0.0f;
                }
            }
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    uint t = thread_index_in_threadgroup;
    for (int r = 0; r < RD; r++) {
        for (int n = 0; n < N; n++) {
            if (t == uint(r * N + n)) {
                float sum = 0.0f;
                for (int s = 0; s <= NK; s++) {
                    sum += part[s][r][n];
                }
                y[size_t(n) * D + row0 + r] = static_cast<T>(sum);
            }
        }
    }
