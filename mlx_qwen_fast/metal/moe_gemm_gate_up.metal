// Grouped gate + up GEMM with SwiGLU of the prefill MoE, 4-bit weights
// dequantised on chip; the body of an mx.fast.metal_kernel
// (kernels/moe_grouped_gemm_metal.py builds it; MLX adds the signature).
// Same contract as MOE_KIND 0 of cuda/moe_grouped_gemm.cu, with the weights
// s q + b in fp32 (the Metal decode kernels' numerics) and x of any float type.
//
// Weights: MLX affine 4-bit, group 64: W [E, I, D/8] uint32 (eight nibbles
// per word, the lowest nibble the lowest input), scales and biases
// [E, I, D/64] (float, half or bfloat).
//
// Work item (threadgroup x) = block-map entry (e, t): grouped rows
// [offsets[e] + t BM, min(+BM, offsets[e + 1])) (the rows past the expert's
// end are zeros, never written); threadgroup y: output features
// [32 y, +32) of both matrices. (-1, -1) items return at once.
// 128 threads = 4 SIMD groups in 2 x 2: SIMD group (wm, wn) owns rows
// [wm BM/2, +BM/2) and features [16 wn, +16) of the tile, as BM/16 x 2
// fp32 8x8 simdgroup_matrix accumulators per matrix. K steps of BK = 32:
// the x rows (token order[r] / K of grouped row r) to threadgroup memory
// as fp32 (exact); the gate and up weight tiles [32 features][32 inputs]
// dequantised to fp32 s q + b (thread i: matrix i / 64, feature (i % 64) / 2,
// 16 inputs = two words); then BK / 8 rounds of simdgroup multiply-
// accumulates (the weight tile loaded transposed: B = W^T). A SIMD group
// whose rows all lie past the item's end skips its multiplies (uniform
// within it). Epilogue: the accumulators through threadgroup memory, then
// h[r] = T(silu(T(g)) T(u)) for the item's rows (SwitchGLU's roundings; T =
// x's type, none for float).
// Expert ids of the block map are used as given (the wrapper checks the
// routing, or it came from the grouping kernels).
//
// Inputs: x [N, D] (T), wg, sg, bg, wu, su, bu (as above), order [NK],
// offsets [E + 1], block_map [MT, 2] int32. Output: h [NK, I] (T), grouped
// order. Template: T, BM (16 or 32), K (top-k). D, I from the inputs' shapes
// (D a multiple of 64, I of 32). Launch: grid (MT 128, I / 32) threads,
// threadgroup 128.

    constexpr int BN = 32;  // output features per threadgroup (each matrix)
    constexpr int BK = 32;  // inputs per K step (half a quantisation group)
    constexpr int LD = BK + 4;  // padded rows of the x and weight tiles
    constexpr int LC = BN + 4;  // padded rows of the output staging
    constexpr int FM = BM / 16;  // 8-row fragments per SIMD group
    threadgroup float xs[BM * LD];
    threadgroup float ws[2 * BN * LD];
    threadgroup float cs[2 * BM * LC];
    threadgroup int tok[BM];

    const int D = int(x_shape[1]);
    const int I = int(wg_shape[1]);
    const int DW = D / 8;
    const int DG = D / 64;
    const int item = int(threadgroup_position_in_grid.x);
    const int e = block_map[2 * item];
    if (e < 0) {
        return;  // an unused item (the whole threadgroup)
    }
    const int t = int(thread_index_in_threadgroup);
    const int sgi = int(simdgroup_index_in_threadgroup);
    const int wm = sgi / 2;
    const int wn = sgi % 2;
    const int row0 = offsets[e] + block_map[2 * item + 1] * BM;
    const int rows = metal::min(BM, offsets[e + 1] - row0);
    const int n0 = int(threadgroup_position_in_grid.y) * BN;
    const bool active = wm * (BM / 2) < rows;

    if (t < BM) {
        tok[t] = t < rows ? order[row0 + t] / K : -1;
    }
    simdgroup_float8x8 acc[2][FM][2];
    for (int m = 0; m < 2; m++) {
        for (int i = 0; i < FM; i++) {
            for (int j = 0; j < 2; j++) {
                acc[m][i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
            }
        }
    }
    // this thread's weight row and inputs in every K step
    const int wmat = t / 64;
    const int wrow = (t % 64) / 2;
    const int wcol = 16 * (t % 2);
    const size_t wbase = (size_t(e) * I + n0 + wrow) * DW;
    const size_t gbase = (size_t(e) * I + n0 + wrow) * DG;
    threadgroup_barrier(mem_flags::mem_threadgroup);

    for (int k0 = 0; k0 < D; k0 += BK) {
        for (int i = t; i < BM * BK; i += 128) {
            const int r = i / BK;
            const int col = i % BK;
            const int tk = tok[r];
            xs[r * LD + col] = tk >= 0 ? static_cast<float>(x[size_t(tk) * D + k0 + col]) : 0.0f;
        }
        {
            const size_t wo = wbase + (k0 + wcol) / 8;
            const size_t go = gbase + k0 / 64;
            const uint w0 = wmat == 0 ? wg[wo] : wu[wo];
            const uint w1 = wmat == 0 ? wg[wo + 1] : wu[wo + 1];
            const float s = wmat == 0 ? static_cast<float>(sg[go]) : static_cast<float>(su[go]);
            const float b = wmat == 0 ? static_cast<float>(bg[go]) : static_cast<float>(bu[go]);
            threadgroup float* dst = ws + (wmat * BN + wrow) * LD + wcol;
            for (int i = 0; i < 8; i++) {
                dst[i] = s * float((w0 >> (4 * i)) & 15u) + b;
                dst[8 + i] = s * float((w1 >> (4 * i)) & 15u) + b;
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (active) {
            for (int kk = 0; kk < BK; kk += 8) {
                simdgroup_float8x8 a[FM];
                simdgroup_float8x8 bt[2][2];
                for (int i = 0; i < FM; i++) {
                    simdgroup_load(a[i], xs + (wm * (BM / 2) + 8 * i) * LD + kk, LD);
                }
                for (int m = 0; m < 2; m++) {
                    for (int j = 0; j < 2; j++) {
                        simdgroup_load(bt[m][j], ws + (m * BN + 16 * wn + 8 * j) * LD + kk, LD, ulong2(0, 0), true);
                    }
                }
                for (int m = 0; m < 2; m++) {
                    for (int i = 0; i < FM; i++) {
                        for (int j = 0; j < 2; j++) {
                            simdgroup_multiply_accumulate(acc[m][i][j], a[i], bt[m][j], acc[m][i][j]);
                        }
                    }
                }
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }

    if (active) {
        for (int m = 0; m < 2; m++) {
            for (int i = 0; i < FM; i++) {
                for (int j = 0; j < 2; j++) {
                    simdgroup_store(acc[m][i][j], cs + m * BM * LC + (wm * (BM / 2) + 8 * i) * LC + 16 * wn + 8 * j, LC);
                }
            }
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int i = t; i < rows * BN; i += 128) {
        const int r = i / BN;
        const int col = i % BN;
        const float g = static_cast<float>(static_cast<T>(cs[r * LC + col]));
        const float u = static_cast<float>(static_cast<T>(cs[BM * LC + r * LC + col]));
        h[size_t(row0 + r) * I + n0 + col] = static_cast<T>(g / (1.0f + metal::exp(-g)) * u);
    }
