// Grouped down GEMM of the prefill MoE with the routing weights, 4-bit
// weights dequantised on chip; the body of an mx.fast.metal_kernel
// (kernels/moe_grouped_gemm_metal.py builds it; MLX adds the signature).
// Same contract as MOE_KIND 1 of cuda/moe_grouped_gemm.cu (float output),
// with the weights s q + b in fp32 and h of any float type:
//   y[order[r]] = scores[order[r]] * T(h[r] . Wd[e])   (fp32; T = h's type)
// written in ASSIGNMENT order, so the combine is y.reshape(N, K, D).sum(1)
// (exact order, no atomics).
//
// Weights: Wd [E, D, I/8] uint32, scales and biases [E, D, I/64] (float,
// half or bfloat), MLX affine 4-bit group 64.
//
// Work items and threadgroups as moe_gemm_gate_up.metal (block-map entry
// (e, t) in x: grouped rows [offsets[e] + t BM, min(+BM, offsets[e + 1]));
// y: output features [32 y, +32)), 128 threads = 4 SIMD groups in 2 x 2,
// fp32 8x8 simdgroup_matrix accumulators (BM/16 x 2 per SIMD group). K steps
// of BK = 64 (one quantisation group): the h rows to threadgroup memory as
// fp32 (rows past the item's end: zeros), the weight tile [32 features][64
// inputs] dequantised to fp32 s q + b (thread i: feature i / 4, 16 inputs =
// two words), BK / 8 rounds of multiply-accumulates (B = W^T, loaded
// transposed). A SIMD group whose rows all lie past the item's end skips its
// multiplies. Epilogue through threadgroup memory: the item's rows only.
//
// Inputs: h [NK, I] (T, grouped order), wd, sd, bd (as above), order [NK],
// offsets [E + 1], block_map [MT, 2] int32, scores [NK] float (assignment
// order). Output: y [NK, D] float. Template: T, BM (16 or 32). I, D from
// the inputs' shapes (I a multiple of 64, D of 32). Launch: grid (MT 128,
// D / 32) threads, threadgroup 128.

    constexpr int BN = 32;  // output features per threadgroup
    constexpr int BK = 64;  // inputs per K step (one quantisation group)
    constexpr int LD = BK + 4;
    constexpr int LC = BN + 4;
    constexpr int FM = BM / 16;
    threadgroup float xs[BM * LD];
    threadgroup float ws[BN * LD];
    threadgroup float cs[BM * LC];

    const int I = int(h_shape[1]);
    const int D = int(wd_shape[1]);
    const int IW = I / 8;
    const int IG = I / 64;
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

    simdgroup_float8x8 acc[FM][2];
    for (int i = 0; i < FM; i++) {
        for (int j = 0; j < 2; j++) {
            acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        }
    }
    const int wrow = t / 4;
    const int wcol = 16 * (t % 4);
    const size_t wbase = (size_t(e) * D + n0 + wrow) * IW;
    const size_t gbase = (size_t(e) * D + n0 + wrow) * IG;

    for (int k0 = 0; k0 < I; k0 += BK) {
        for (int i = t; i < BM * BK; i += 128) {
            const int r = i / BK;
            const int col = i % BK;
            xs[r * LD + col] = r < rows ? static_cast<float>(h[size_t(row0 + r) * I + k0 + col]) : 0.0f;
        }
        {
            const size_t wo = wbase + (k0 + wcol) / 8;
            const uint w0 = wd[wo];
            const uint w1 = wd[wo + 1];
            const float s = static_cast<float>(sd[gbase + k0 / 64]);
            const float b = static_cast<float>(bd[gbase + k0 / 64]);
            threadgroup float* dst = ws + wrow * LD + wcol;
            for (int i = 0; i < 8; i++) {
                dst[i] = s * float((w0 >> (4 * i)) & 15u) + b;
                dst[8 + i] = s * float((w1 >> (4 * i)) & 15u) + b;
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (active) {
            for (int kk = 0; kk < BK; kk += 8) {
                simdgroup_float8x8 a[FM];
                simdgroup_float8x8 bt[2];
                for (int i = 0; i < FM; i++) {
                    simdgroup_load(a[i], xs + (wm * (BM / 2) + 8 * i) * LD + kk, LD);
                }
                for (int j = 0; j < 2; j++) {
                    simdgroup_load(bt[j], ws + (16 * wn + 8 * j) * LD + kk, LD, ulong2(0, 0), true);
                }
                for (int i = 0; i < FM; i++) {
                    for (int j = 0; j < 2; j++) {
                        simdgroup_multiply_accumulate(acc[i][j], a[i], bt[j], acc[i][j]);
                    }
                }
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }

    if (active) {
        for (int i = 0; i < FM; i++) {
            for (int j = 0; j < 2; j++) {
                simdgroup_store(acc[i][j], cs + (wm * (BM / 2) + 8 * i) * LC + 16 * wn + 8 * j, LC);
            }
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int i = t; i < rows * BN; i += 128) {
        const int r = i / BN;
        const int col = i % BN;
        const int a = order[row0 + r];
        const float v = static_cast<float>(static_cast<T>(cs[r * LC + col]));
        y[size_t(a) * D + n0 + col] = scores[a] * v;
    }
