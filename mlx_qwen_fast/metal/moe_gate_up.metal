// Gate + up GEMVs and SwiGLU of the decode MoE's selected experts and its
// shared expert, and the shared expert's sigmoid gate; the body of an
// mx.fast.metal_kernel (kernels/moe_gate_up_metal.py builds it; MLX adds the
// signature). Same contract as MDG_KIND 0 of cuda/moe_decode_gemv.cu.
//
// Weights: MLX affine 4-bit, group 64: W [.., O, D/8] uint32 (eight nibbles
// per word, the lowest nibble the lowest input), bf16 scales/biases
// [.., O, D/64]. Dequantised in registers: a lane's 16 consecutive inputs
// lie in one group, so their dot product with x is s * sum(q x) + b * sum(x)
// in fp32 (the weights s q + b never formed, never rounded).
//
// Grid: threadgroups (I / 8) x (NK + 2), NK = N K; 64 threads = 2 SIMD
// groups. Threadgroup (rb, item): SIMD group g computes rows [8 rb + 4 g, +4)
// of both the gate and the up matrix of item's expert for the tokens that
// use it; lane l takes inputs [16 l + 512 c, +16) for c = 0, 1, ... (lanes
// past D idle: D needs only to be a multiple of 64), the lanes' partial
// sums meet in one simd_sum per row and matrix (a float4 holding the tokens).
//   item < NK: pair item = n K + j, expert inds[item]. A pair whose expert a
//   lower pair also lists returns at once; the first pair of an expert
//   computes it for every token that picked it and writes the h row of
//   every pair that lists it.
//   item == NK: the shared expert, every token.
//   item == NK + 1: the shared expert's gate (threadgroup 0, SIMD group 0;
//   the rest return).
// Expert ids are clamped into [0, E): bad ids give meaningless rows, never a
// read outside the weights (the wrapper checks them).
//
// Inputs: x [N, D] (T), inds [N, K] int32, wg, sg, bg, wu, su, bu (routed
// experts [E, I, D/8] uint32 / [E, I, D/64] bf16), xwg, xsg, xbg, xwu, xsu,
// xbu (shared expert [I, D/8] / [I, D/64]), gw, gs, gb (shared-expert gate
// D -> 1: SGB 4 or 8, packed [1, D SGB/32] uint32 + bf16 [1, D/64]; SGB 16,
// bf16 weight [1, D], gs and gb unread).
// Outputs: h [NK + N, I] (T): row n K + j = T(silu(T(x[n] . Wg)) T(x[n] . Wu))
// of pair (n, j), row NK + n the shared expert's; sgate [N] float =
// sigmoid(T(x[n] . w_gate)). Template: T (float or bfloat), N (1..4), SGB.
// K, D, I and E come from the inputs' shapes.

    constexpr int RS = 4;  // rows per SIMD group
    const int K = inds_shape[1];
    const int NK = N * K;
    const int D = x_shape[1];
    const int E = wg_shape[0];
    const int I = wg_shape[1];
    const int DW = D / 8;
    const int DG = D / 64;
    uint lane = thread_index_in_simdgroup;
    uint sgi = simdgroup_index_in_threadgroup;
    int rb = int(threadgroup_position_in_grid.x);
    int item = int(threadgroup_position_in_grid.y);

    if (item == NK + 1) {  // the shared expert's gate: one row
        if (rb != 0 || sgi != 0) {
            return;
        }
        float4 acc = float4(0.0f);
        for (int k0 = int(lane) * 16; k0 < D; k0 += 512) {
            float q[16];
            if constexpr (SGB == 16) {
                for (int i = 0; i < 16; i++) {
                    q[i] = static_cast<float>(gw[k0 + i]);
                }
            } else {
                constexpr int PER = 32 / SGB;  // values per word
                constexpr uint QM = (1u << SGB) - 1u;
                float s = static_cast<float>(gs[k0 / 64]);
                float b = static_cast<float>(gb[k0 / 64]);
                for (int w = 0; w < 16 / PER; w++) {
                    uint word = static_cast<uint>(gw[k0 / PER + w]);  // (this branch: gw is uint32)
                    for (int i = 0; i < PER; i++) {
                        q[w * PER + i] = s * float((word >> (SGB * i)) & QM) + b;
                    }
                }
            }
            for (int n = 0; n < N; n++) {
                float d = 0.0f;
                for (int i = 0; i < 16; i++) {
                    d += q[i] * static_cast<float>(x[n * D + k0 + i]);
                }
                acc[n] += d;
            }
        }
        acc = simd_sum(acc);
        if (lane == 0) {
            for (int n = 0; n < N; n++) {
                float logit = static_cast<float>(static_cast<T>(acc[n]));
                sgate[n] = 1.0f / (1.0f + metal::exp(-logit));
            }
        }
        return;
    }

    // the item's expert, the tokens that use it (bit n of mask) and its weights
    uint mask = (1u << N) - 1u;
    int e = -1;  // -1: the shared expert
    if (item < NK) {
        e = inds[item];
        for (int q = 0; q < item; q++) {
            if (inds[q] == e) {
                return;  // a lower pair computes this expert (the whole threadgroup returns)
            }
        }
        mask = 0u;
        for (int q = item; q < NK; q++) {
            if (inds[q] == e) {
                mask |= 1u << (q / K);
            }
        }
    }
    size_t ew = 0;  // offset of the expert's weight words and groups
    size_t eg = 0;
    if (e >= 0) {
        uint ec = metal::min(uint(e), uint(E - 1));
        ew = size_t(ec) * I * DW;
        eg = size_t(ec) * I * DG;
    }
    const device uint32_t* wgp = e >= 0 ? wg + ew : xwg;
    const device uint32_t* wup = e >= 0 ? wu + ew : xwu;
    const device bfloat16_t* sgp = e >= 0 ? sg + eg : xsg;
    const device bfloat16_t* bgp = e >= 0 ? bg + eg : xbg;
    const device bfloat16_t* sup = e >= 0 ? su + eg : xsu;
    const device bfloat16_t* bup = e >= 0 ? bu + eg : xbu;
    int row0 = rb * 8 + int(sgi) * RS;

    float4 accg[RS];
    float4 accu[RS];
    for (int r = 0; r < RS; r++) {
        accg[r] = float4(0.0f);
        accu[r] = float4(0.0f);
    }
    for (int k0 = int(lane) * 16; k0 < D; k0 += 512) {
        float xv[N][16];
        float xs[N];
        for (int n = 0; n < N; n++) {
            xs[n] = 0.0f;
            if (mask & (1u << n)) {
                for (int i = 0; i < 16; i++) {
                    xv[n][i] = static_cast<float>(x[n * D + k0 + i]);
                    xs[n] += xv[n][i];
                }
            }
        }
        for (int r = 0; r < RS; r++) {
            size_t wo = size_t(row0 + r) * DW + k0 / 8;
            size_t go = size_t(row0 + r) * DG + k0 / 64;
            for (int mat = 0; mat < 2; mat++) {
                const device uint32_t* wp = mat == 0 ? wgp : wup;
                uint w0 = wp[wo];
                uint w1 = wp[wo + 1];
                float s = static_cast<float>(mat == 0 ? sgp[go] : sup[go]);
                float b = static_cast<float>(mat == 0 ? bgp[go] : bup[go]);
                float q[16];
                for (int i = 0; i < 8; i++) {
                    q[i] = float((w0 >> (4 * i)) & 15u);
                    q[8 + i] = float((w1 >> (4 * i)) & 15u);
                }
                for (int n = 0; n < N; n++) {
                    if (mask & (1u << n)) {
                        float d = 0.0f;
                        for (int i = 0; i < 16; i++) {
                            d += q[i] * xv[n][i];
                        }
                        float v = s * d + b * xs[n];
                        if (mat == 0) {
                            accg[r][n] += v;
                        } else {
                            accu[r][n] += v;
                        }
                    }
                }
            }
        }
    }
    for (int r = 0; r < RS; r++) {
        accg[r] = simd_sum(accg[r]);
        accu[r] = simd_sum(accu[r]);
    }

    // lane r < RS writes row row0 + r of every pair that lists the expert
    // (of every token for the shared expert), SwiGLU with SwitchGLU's roundings
    if (lane < uint(RS)) {
        int row = row0 + int(lane);
        float4 g4 = accg[0];
        float4 u4 = accu[0];
        for (int r = 1; r < RS; r++) {  // constant indices: the sums stay in registers
            if (uint(r) == lane) {
                g4 = accg[r];
                u4 = accu[r];
            }
        }
        for (int n = 0; n < N; n++) {
            if (mask & (1u << n)) {
                float g = static_cast<float>(static_cast<T>(g4[n]));
                float u = static_cast<float>(static_cast<T>(u4[n]));
                T hv = static_cast<T>(g / (1.0f + metal::exp(-g)) * u);
                if (e < 0) {
                    h[size_t(NK + n) * I + row] = hv;
                } else {
                    for (int j = 0; j < K; j++) {
                        if (inds[n * K + j] == e) {
                            h[size_t(n * K + j) * I + row] = hv;
                        }
                    }
                }
            }
        }
    }
