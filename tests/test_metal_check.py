"""tests/metal_check.py: MLX's generated Metal sources run on the CPU.

Proved on mlx-lm's own Metal kernels against plain-MLX references (fresh
random inputs, several shapes, partial threadgroups), on a simdgroup_matrix
GEMM of this file against numpy (edges in M, N and K, transposed loads,
float / half / bfloat), and on planted bugs it must catch: a write past a
buffer's end, a barrier some threads return before, lanes of a SIMD group
at different synchronisation points (simd_* and simdgroup_matrix
operations), a missing barrier where the schedule shows it, unwritten
outputs, a simdgroup_load or simdgroup_store past the end of its buffer or
threadgroup array, a simdgroup_matrix operation without all 32 lanes, an
address-space mismatch (threadgroup memory where device or constant memory
is read, a device value for a constant reference).
"""

import mlx.core as mx
import numpy as np
import pytest

import metal_check as mc
from compare import FP32_TOL, assert_close, finite, tolerance

pytestmark = pytest.mark.skipif(mc.CXX is None, reason="no C++ compiler (g++) to build the Metal sources")


def _rms(x, eps):
    x = x.astype(mx.float32)
    return x * mx.rsqrt((x * x).mean(-1, keepdims=True) + eps)


@pytest.mark.parametrize("tokens,hq,hk,d,dtype", [(1, 4, 2, 64, mx.float32), (3, 16, 2, 64, mx.float32),
                                                  (5, 3, 1, 96, mx.bfloat16), (2, 2, 2, 40, mx.float32)])
def test_mlx_lm_qk_norm(tokens, hq, hk, d, dtype):
    """One SIMD group per head row; grids that leave the last threadgroup
    partial (rows * 32 not a multiple of 256), D not a multiple of 32."""
    with mc.simulated_modules("mlx_lm.kernels.qk_norm") as (m,):
        x = mx.random.normal((tokens, 2 * (hq + hk) * d)).astype(dtype)
        q, k = m.qk_norm(x, n_heads=hq, n_kv_heads=hk, head_dim=d, eps=1e-6, query_scale=0.125)
    ref = _rms(x.reshape(tokens, 2 * (hq + hk), d)[:, : hq + hk], 1e-6)
    tol = tolerance(dtype, 2)
    assert finite(q, k)
    assert_close(q, (ref[:, :hq].astype(dtype).astype(mx.float32) * 0.125), tol, "q")
    assert_close(k, ref[:, hq:], tol, "k")


@pytest.mark.parametrize("B,H,L,D", [(1, 4, 1, 64), (2, 3, 5, 128)])
def test_mlx_lm_rms_norm_sigmoid_gate_strided(B, H, L, D):
    """Strided input (the attention output transposed, not copied: the
    kernel reads x_strides / g_strides)."""
    with mc.simulated_modules("mlx_lm.kernels.rms_norm_sigmoid_gate") as (m,):
        x = mx.random.normal((B, L, H, D)).transpose(0, 2, 1, 3)
        g = mx.random.normal((B, L, H * D))
        out = m.rms_norm_sigmoid_gate(x, g, eps=1e-5)
    ref = (_rms(x, 1e-5).transpose(0, 2, 1, 3).reshape(B, L, H * D)) * mx.sigmoid(g)
    assert finite(out)
    assert_close(out, ref, FP32_TOL, "norm * sigmoid(gate)")


@pytest.mark.parametrize("rows,D", [(1, 256), (3, 1000), (2, 2048)])
def test_mlx_lm_norm_add_norm_threadgroup_memory(rows, D):
    """Threadgroups of up to 1024 threads sharing a threadgroup array across
    barriers (block sums), D not a multiple of the threadgroup."""
    import mlx.nn as nn

    with mc.simulated_modules("mlx_lm.kernels.norm_add_norm") as (m,):
        branch = mx.random.normal((rows, D))
        stream = mx.random.normal((rows, D))
        alpha, beta = mx.random.uniform(0.5, 1.5, (D,)), mx.random.uniform(0.5, 1.5, (D,))
        w = mx.random.uniform(0.5, 1.5, (D,))
        norm = nn.RMSNorm(D, eps=1e-6)
        norm.weight = mx.random.uniform(0.5, 1.5, (D,))
        new_stream, normed = m.norm_add_norm(branch, stream, alpha=alpha, beta=beta, post_weight=w,
                                             post_eps=1e-5, next_norm=norm)
    ref_stream = alpha * stream + beta * _rms(w * branch, 1e-5)
    assert finite(new_stream, normed)
    assert_close(new_stream, ref_stream, FP32_TOL, "stream")
    assert_close(normed, _rms(ref_stream, 1e-6) * norm.weight, FP32_TOL, "normed")


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("B,T,Hk,Hv", [(1, 1, 1, 2), (2, 3, 2, 4)])
def test_mlx_lm_gated_delta_kernel(packed, B, T, Hk, Hv):
    """mlx-lm's Gated DeltaNet recurrence kernels (packed: 4 state elements
    per lane, Dk = 128) against its own ops reference."""
    Dk, Dv = 128, 64
    with mc.simulated_modules("mlx_lm.models.gated_delta") as (m,):
        q = mx.random.normal((B, T, Hk, Dk)) * 0.1
        k = mx.random.normal((B, T, Hk, Dk)) * 0.1
        v = mx.random.normal((B, T, Hv, Dv))
        g = mx.random.uniform(0.5, 1.0, (B, T, Hv))
        beta = mx.random.uniform(0.0, 1.0, (B, T, Hv))
        state = mx.random.normal((B, Hv, Dv, Dk)) * 0.1
        run = m.gated_delta_kernel if packed else m.gated_delta_kernel_unpacked
        y, s = run(q, k, v, g, beta, state)
        ran = m._gated_delta_kernel_packed if packed else m._gated_delta_kernel
        assert ran.calls == 1
        ry, rs = m.gated_delta_ops(q, k, v, g, beta, state)
    assert finite(y, s)
    assert_close(y, ry, FP32_TOL, "y")
    assert_close(s, rs, FP32_TOL, "state")


def _kernel(source, header="", **call):
    with mc.simulated() as built:
        k = mx.fast.metal_kernel(name="planted", input_names=["x"], output_names=["out"], source=source,
                                 header=header)
    return k


def _run(k, x, grid, tg, n=None):
    return k(inputs=[x], grid=grid, threadgroup=tg, output_shapes=[(n or x.size,)],
             output_dtypes=[mx.float32])[0]


def test_planted_write_past_the_end_is_caught():
    k = _kernel("uint i = thread_position_in_grid.x; out[i + 1] = x[i];")
    with pytest.raises(mc.MetalCheckError, match=r"out-of-bounds access of buffer 'out'"):
        _run(k, mx.ones((1024,)), (1024, 1, 1), (256, 1, 1))
    ok = _kernel("uint i = thread_position_in_grid.x; out[i] = x[i] * 2;")
    assert_close(_run(ok, mx.arange(1024).astype(mx.float32), (1024, 1, 1), (256, 1, 1)),
                 mx.arange(1024).astype(mx.float32) * 2, 0.0)


def test_planted_divergent_barrier_is_caught():
    k = _kernel("""
        uint t = thread_position_in_threadgroup.x;
        if (t >= 16) { return; }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[thread_position_in_grid.x] = x[thread_position_in_grid.x];""")
    with pytest.raises(mc.MetalCheckError, match="barrier not reached by every thread"):
        _run(k, mx.ones((64,)), (64, 1, 1), (64, 1, 1))


def test_planted_divergent_simd_collective_is_caught():
    k = _kernel("""
        uint lane = thread_index_in_simdgroup;
        float v = x[thread_position_in_grid.x];
        if (lane < 16) { v = simd_sum(v); } else { threadgroup_barrier(mem_flags::mem_threadgroup); }
        out[thread_position_in_grid.x] = v;""")
    with pytest.raises(mc.MetalCheckError, match="SIMD group diverged"):
        _run(k, mx.ones((32,)), (32, 1, 1), (32, 1, 1))


def test_planted_missing_barrier_shows_as_poison():
    """Each thread writes its slot of a threadgroup array and reads its
    neighbour's: without the barrier the neighbour's slot is still poison
    when read; with it the result is exact."""
    body = """
        threadgroup float buf[64];
        uint t = thread_position_in_threadgroup.x;
        buf[t] = x[thread_position_in_grid.x];
        {BARRIER}
        out[thread_position_in_grid.x] = buf[(t + 1) % 64];"""
    x = mx.arange(128).astype(mx.float32)
    bad = _run(_kernel(body.replace("{BARRIER}", "")), x, (128, 1, 1), (64, 1, 1))
    assert not finite(bad)
    good = _run(_kernel(body.replace("{BARRIER}", "threadgroup_barrier(mem_flags::mem_threadgroup);")),
                x, (128, 1, 1), (64, 1, 1))
    ref = mx.concatenate([mx.roll(x[:64], -1), mx.roll(x[64:], -1)])
    assert_close(good, ref, 0.0, "neighbour's value")


def test_planted_race_between_simd_groups_is_caught():
    """A threadgroup array reused without a barrier: each SIMD group's lane 0
    overwrites its slot while the other group may not have read it yet. The
    first schedule happens to run every read first; the second lets a SIMD
    group run on as soon as its collective completes, and the outputs
    differ: caught as a schedule-dependent output. With the barrier: exact."""
    body = """
        threadgroup float buf[2];
        uint lane = thread_index_in_simdgroup, sg = simdgroup_index_in_threadgroup;
        uint i = thread_position_in_grid.x;
        float v = simd_sum(x[i]);
        if (lane == 0) { buf[sg] = v; }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        float r = buf[0] + buf[1];
        {BARRIER}
        float w = simd_sum(r);
        if (lane == 0) { buf[sg] = w; }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[i] = r + buf[sg ^ 1];"""
    x = mx.random.uniform(0.5, 1.5, (64,), key=mx.random.key(11))  # positive: no cancelling sum
    with pytest.raises(mc.MetalCheckError, match="depends on the order threads run in"):
        _run(_kernel(body.replace("{BARRIER}", "")), x, (64, 1, 1), (64, 1, 1))
    good = _run(_kernel(body.replace("{BARRIER}", "threadgroup_barrier(mem_flags::mem_threadgroup);")),
                x, (64, 1, 1), (64, 1, 1))
    total = x.sum()
    assert_close(good, mx.full((64,), total + 32 * total), FP32_TOL, "sums (in another order)")


def test_unwritten_outputs_stay_poisoned_and_edge_groups_are_partial():
    """Threads past the grid do not exist (the last threadgroup of 100
    threads in groups of 64 has 36): a kernel writing out[i] for each thread
    leaves the rest of a larger output NaN."""
    k = _kernel("out[thread_position_in_grid.x] = float(threads_per_threadgroup.x);")
    out = _run(k, mx.ones((100,)), (100, 1, 1), (64, 1, 1), n=128)
    assert_close(out[:100], mx.concatenate([mx.full((64,), 64.0), mx.full((36,), 36.0)]), 0.0)
    assert not finite(out[100:]) and mx.isnan(out[100:]).all().item()


def test_shim_gap_is_a_clear_error():
    k = _kernel("out[0] = metal::unknown_function(x[0]);")
    with pytest.raises(mc.MetalCheckError, match="does not compile against metal_shim.h"):
        _run(k, mx.ones((4,)), (1, 1, 1), (1, 1, 1))


# ---- address spaces ----------------------------------------------------------

_SUM_HEADER = """
inline float sum8({space} const float* p) {{
  float s = 0.0f;
  for (int i = 0; i < 8; ++i) s += p[i];
  return s;
}}
inline float scaled(const constant float& c, float v) {{ return c * v; }}
"""
_SUM_BODY = """
    uint i = thread_position_in_threadgroup.x;
    threadgroup float t[8];
    t[i] = x[i];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (i == 0) out[0] = sum8(t) + {extra};
"""


@pytest.mark.skipif(mc.address_space_problems("") is None, reason="no libclang (the test extra's) to parse with")
@pytest.mark.parametrize("space,extra,message", [
    ("threadgroup", "0.0f", None),  # the right space: runs
    ("device", "0.0f", r"no matching function for call to 'sum8'"),  # threadgroup memory where device is read
    ("constant", "0.0f", r"no matching function for call to 'sum8'"),
    ("threadgroup", "scaled(x[1], 1.0f)", r"no matching function for call to 'scaled'"),  # device for constant
])
def test_planted_address_space_mismatch_is_caught(space, extra, message):
    """A pointer (or reference) of one address space given where another is
    expected: the C++ build erases the qualifiers and would run it; the
    source read as C++ for OpenCL names the call."""
    k = _kernel(_SUM_BODY.format(extra=extra), header=_SUM_HEADER.format(space=space))
    x = mx.arange(8).astype(mx.float32)
    if message is None:
        assert _run(k, x, (8, 1, 1), (8, 1, 1), n=1).item() == 28.0
        return
    with pytest.raises(mc.MetalCheckError, match=r"address spaces(.|\n)*" + message):
        _run(k, x, (8, 1, 1), (8, 1, 1), n=1)


# ---- simdgroup_matrix -------------------------------------------------------

def _mk(source, inputs, outputs, header=""):
    with mc.simulated():
        return mx.fast.metal_kernel(name="sgm", input_names=list(inputs), output_names=list(outputs),
                                    source=source, header=header)


def _frag_coord(lane):
    """MLX's BaseMMAFrag<T, 8, 8>::get_coord (steel/gemm/mma.h), as (row, col):
    lane holds elements (row, col) and (row, col + 1)."""
    qid = lane // 4
    return (qid & 4) + (lane // 2) % 4, (qid & 2) * 2 + (lane % 2) * 2


#: C (M x N) = A (M x K) . B, row-major; B is K x N, or with BT N x K (C =
#: A . B^T). One SIMD group per 8x8 tile of C, SG of them per threadgroup.
#: The kernel's own edge code: a step whose A or B tile lies inside its
#: matrix loads it straight from device memory (A and B at a matrix_origin
#: (column, row); B^T transposed from an offset pointer); one that crosses M,
#: N or K (K % 8 != 0 included) is copied, zero-padded, into a threadgroup
#: tile (rows of 9 elements; B^T in its stored layout, loaded transposed). An
#: output tile inside C is stored at an origin; an edge one goes through a
#: threadgroup tile whose in-range part the lanes copy out. Every branch is
#: uniform over a SIMD group (it depends on the tile only). EDGES false is
#: the planted bug: every step takes the direct path.
_GEMM = """
    threadgroup T a_tile[SG][8 * 9];
    threadgroup T b_tile[SG][8 * 9];
    threadgroup ACC c_tile[SG][8 * 8];
    uint sg = simdgroup_index_in_threadgroup, lane = thread_index_in_simdgroup;
    uint tile = threadgroup_position_in_grid.x * SG + sg;
    uint i0 = tile / ((N + 7) / 8) * 8, j0 = tile % ((N + 7) / 8) * 8;
    simdgroup_matrix<ACC, 8, 8> acc = make_filled_simdgroup_matrix<ACC, 8, 8>(ACC(0));
    for (uint k0 = 0; k0 < K; k0 += 8) {
      simdgroup_matrix<T, 8, 8> a, b;
      if (!EDGES || (i0 + 8 <= M && k0 + 8 <= K)) {
        simdgroup_load(a, A, K, ulong2(k0, i0));
      } else {
        for (uint e = lane; e < 64; e += 32) {
          uint r = e / 8, c = e % 8;
          a_tile[sg][r * 9 + c] = (i0 + r < M && k0 + c < K) ? A[(i0 + r) * K + k0 + c] : T(0);
        }
        simdgroup_barrier(mem_flags::mem_threadgroup);
        simdgroup_load(a, a_tile[sg], 9);
      }
      if (!EDGES || (j0 + 8 <= N && k0 + 8 <= K)) {
        if (BT) {
          simdgroup_load(b, B + j0 * K + k0, K, ulong2(0, 0), true);
        } else {
          simdgroup_load(b, B, N, ulong2(j0, k0));
        }
      } else {
        for (uint e = lane; e < 64; e += 32) {
          uint r = e / 8, c = e % 8;  // B^T: r counts N, c counts K (the stored layout); B: r counts K, c N
          b_tile[sg][r * 9 + c] = BT ? ((j0 + r < N && k0 + c < K) ? B[(j0 + r) * K + k0 + c] : T(0))
                                     : ((k0 + r < K && j0 + c < N) ? B[(k0 + r) * N + j0 + c] : T(0));
        }
        simdgroup_barrier(mem_flags::mem_threadgroup);
        simdgroup_load(b, b_tile[sg], 9, ulong2(0, 0), BT);
      }
      simdgroup_multiply_accumulate(acc, a, b, acc);
      simdgroup_barrier(mem_flags::mem_threadgroup);  // the tiles are rewritten by the next step
    }
    if (!EDGES || (i0 + 8 <= M && j0 + 8 <= N)) {
      simdgroup_store(acc, C, N, ulong2(j0, i0));
    } else {
      simdgroup_store(acc, c_tile[sg], 8);
      simdgroup_barrier(mem_flags::mem_threadgroup);
      for (uint e = lane; e < 64; e += 32) {
        if (i0 + e / 8 < M && j0 + e % 8 < N) { C[(i0 + e / 8) * N + j0 + e % 8] = c_tile[sg][e]; }
      }
    }"""

#: (M, N, K): whole tiles only (8 steps of K); every edge (M, N and K, none a
#: multiple of 8; 6 tiles in threadgroups of 4 SIMD groups, the second one
#: partial); K below 8 and one partial tile.
GEMM_SHAPES = [(16, 24, 64), (13, 20, 21), (5, 8, 3)]


def _gemm(a, b, acc_dtype, bt, edges=True):
    """C = A . B (B: K x N), or A . B^T with bt (B: N x K), by _GEMM."""
    (M, K), N = a.shape, b.shape[0] if bt else b.shape[1]
    k = _mk(_GEMM, ["A", "B"], ["C"])
    tiles = -(-M // 8) * -(-N // 8)
    return k(inputs=[a, b], template=[("T", a.dtype), ("ACC", acc_dtype), ("M", M), ("N", N), ("K", K),
                                      ("BT", bt), ("EDGES", edges), ("SG", 4)],
             grid=(32 * tiles, 1, 1), threadgroup=(128, 1, 1), output_shapes=[(M, N)], output_dtypes=[acc_dtype])[0]


def _ref_matmul(a, b, bt=False):
    """numpy's float32 product of the inputs as they are (already rounded to their dtype)."""
    an, bn = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    return mx.array(an @ (bn.T if bt else bn))


def _gemm_inputs(M, N, K, dtype, bt, draw):
    ks = mx.random.split(mx.random.key(M * 10000 + N * 100 + K), 2)
    return draw((M, K), ks[0]).astype(dtype), draw((N, K) if bt else (K, N), ks[1]).astype(dtype)


@pytest.mark.parametrize("bt", [False, True], ids=["B", "BT"])
@pytest.mark.parametrize("M,N,K", GEMM_SHAPES)
@pytest.mark.parametrize("dtype,acc", [(mx.float32, mx.float32), (mx.float16, mx.float32),
                                       (mx.bfloat16, mx.float32), (mx.float16, mx.float16),
                                       (mx.bfloat16, mx.bfloat16)],
                         ids=["f32", "f16-f32acc", "bf16-f32acc", "f16", "bf16"])
def test_simdgroup_matrix_gemm(dtype, acc, M, N, K, bt):
    """_GEMM against numpy's float32 product of the same rounded inputs.
    fp32 accumulator: FP32_TOL (the same fp32 sums in another order; half
    and bfloat products are exact in fp32). half / bfloat accumulator: the
    shim rounds d = a * b + c once per call, ceil(K / 8) calls; inputs in
    [0.5, 1.5), so every partial sum is at most the final one and each
    rounding moves the result by at most one unit roundoff of it:
    roundings = ceil(K / 8)."""
    a, b = _gemm_inputs(M, N, K, dtype, bt, lambda shape, key: mx.random.uniform(0.5, 1.5, shape, key=key))
    got = _gemm(a, b, acc, bt)
    assert got.dtype == acc and got.shape == (M, N) and finite(got)
    tol = FP32_TOL if acc == mx.float32 else tolerance(acc, -(-K // 8))
    assert_close(got, _ref_matmul(a, b, bt), tol, "C")


@pytest.mark.parametrize("bt", [False, True], ids=["B", "BT"])
@pytest.mark.parametrize("M,N,K", GEMM_SHAPES[:2])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_simdgroup_matrix_gemm_exact_on_integers(dtype, M, N, K, bt):
    """Integers in [-2, 2], K <= 64: every product and partial sum is an
    integer of magnitude at most 256, exact in each format (the accumulator
    is the input's type), so the result is exact whatever the order: a
    misplaced, dropped or doubled element, or a padding that is not zero,
    shows."""
    a, b = _gemm_inputs(M, N, K, dtype, bt, lambda shape, key: mx.random.randint(-2, 3, shape, key=key))
    assert_close(_gemm(a, b, dtype, bt), _ref_matmul(a, b, bt), 0.0, "C")


@pytest.mark.parametrize("M,N,K,buffer,element,nbytes", [
    (16, 24, 21, "A", r"row 7, column [5-7]", 16 * 21 * 4),  # K's edge: A's last row runs past its end
    (13, 24, 16, "A", r"row [5-7], column \d", 13 * 16 * 4),  # M's: the second tile row has 5 rows of 8
    (16, 20, 16, "B", r"row 7, column [4-7]", 16 * 20 * 4),  # N's: the last tile column runs off B's last row
], ids=["K-edge", "M-edge", "N-edge"])
def test_planted_gemm_without_its_edge_code_is_caught(M, N, K, buffer, element, nbytes):
    """_GEMM with EDGES false (every step loads straight from device memory,
    as if the shape were whole tiles): a load past the end of A or B is
    caught, naming the buffer, the matrix element and its size. (Loads that
    wrap into the next row stay inside the buffer and are not errors, only
    wrong numbers.) With its edge code: correct at the same shape."""
    a, b = _gemm_inputs(M, N, K, mx.float32, False, lambda shape, key: mx.random.uniform(0.5, 1.5, shape, key=key))
    with pytest.raises(mc.MetalCheckError, match=rf"simdgroup_load: element \({element}\) lies outside "
                                                 rf"buffer '{buffer}' \(size {nbytes} bytes\)"):
        _gemm(a, b, mx.float32, False, edges=False)
    assert_close(_gemm(a, b, mx.float32, False), _ref_matmul(a, b), FP32_TOL, "C")


def test_simdgroup_matrix_transpose_and_origin():
    """X is 12 x 16, row-major. P: a transposed load from device memory
    (offset in the pointer); Q: that matrix stored transposed; R's left
    half: a transposed load from a threadgroup copy of X's first 10 columns;
    its right half: a load at matrix_origin (column 5, row 3) (an explicit
    ulong2(uint2) conversion), stored at origin (column 8, row 0)."""
    src = """
        threadgroup float tile[8 * 10];
        uint lane = thread_index_in_simdgroup;
        for (uint e = lane; e < 80; e += 32) tile[e] = X[(e / 10) * 16 + e % 10];
        simdgroup_barrier(mem_flags::mem_threadgroup);
        simdgroup_float8x8 m, t, u;
        simdgroup_load(m, X + 4, 16, ulong2(0, 0), true);
        simdgroup_store(m, P, 8);
        simdgroup_store(m, Q, 8, 0, true);
        simdgroup_load(t, tile + 1, 10, 0, true);
        simdgroup_store(t, R, 16);
        simdgroup_load(u, X, 16, ulong2(uint2(5, 3)));
        simdgroup_store(u, R, 16, ulong2(8, 0));"""
    x = mx.arange(12 * 16).astype(mx.float32).reshape(12, 16)
    k = _mk(src, ["X"], ["P", "Q", "R"])
    p, q, r = k(inputs=[x], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(8, 8), (8, 8), (8, 16)],
                output_dtypes=[mx.float32] * 3)
    assert_close(p, x[:8, 4:12].T, 0.0, "transposed load")
    assert_close(q, x[:8, 4:12], 0.0, "transposed store")
    assert_close(r[:, :8], x[:8, 1:9].T, 0.0, "transposed load from threadgroup memory")
    assert_close(r[:, 8:], x[3:11, 5:13], 0.0, "load at an origin (column, row)")


def test_simdgroup_matrix_thread_elements_mapping():
    """thread_elements() holds each lane's 2 elements at MLX's BaseMMAFrag
    coordinates, both ways: read after a load, and written (as MLX's
    BaseMMAFrag::mma writes them, through a reinterpret_cast to
    metal::vec<T, 2>) before a store. Also the MSL constructors: diagonal,
    filled, and a matrix never assigned (NaN)."""
    src = """
        uint lane = thread_index_in_simdgroup;
        simdgroup_float8x8 m, w, unset;
        simdgroup_load(m, X, 8);
        E[lane * 2] = m.thread_elements()[0];
        E[lane * 2 + 1] = m.thread_elements()[1];
        reinterpret_cast<thread metal::vec<float, 2>&>(w.thread_elements()) =
            metal::vec<float, 2>(Y[lane * 2], Y[lane * 2 + 1]);
        simdgroup_store(w, W, 8);
        simdgroup_store(simdgroup_float8x8(3.0f), D, 8);
        simdgroup_store(make_filled_simdgroup_matrix<float, 8, 8>(-2.0f), F, 8);
        simdgroup_store(unset, U, 8);"""
    ks = mx.random.split(mx.random.key(3), 2)
    x, y = mx.random.normal((8, 8), key=ks[0]), mx.random.normal((64,), key=ks[1])
    k = _mk(src, ["X", "Y"], ["E", "W", "D", "F", "U"])
    e, w, d, f, u = k(inputs=[x, y], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                      output_shapes=[(64,), (8, 8), (8, 8), (8, 8), (8, 8)], output_dtypes=[mx.float32] * 5)
    xn, yn = np.array(x), np.array(y)
    want_e, want_w = np.empty(64, np.float32), np.full((8, 8), np.nan, np.float32)
    for lane in range(32):
        row, col = _frag_coord(lane)
        for i in range(2):
            want_e[2 * lane + i] = xn[row, col + i]
            want_w[row, col + i] = yn[2 * lane + i]
    assert_close(e, mx.array(want_e), 0.0, "thread_elements after a load")
    assert finite(w)  # the mapping covers all 64 elements
    assert_close(w, mx.array(want_w), 0.0, "store of thread_elements")
    assert_close(d, 3 * mx.eye(8), 0.0, "diagonal")
    assert_close(f, mx.full((8, 8), -2.0), 0.0, "filled")
    assert mx.isnan(u).all().item()


def test_simdgroup_multiply_and_the_typedefs():
    """simdgroup_multiply (d = a * b: d's earlier value, filled with 5, is
    overwritten) with simdgroup_half8x8 inputs into a simdgroup_float8x8,
    and with simdgroup_bfloat8x8 throughout. Integers in [-2, 2]: every
    product and sum is exact in each format, so the result is exact."""
    src = """
        simdgroup_half8x8 a, b;
        simdgroup_bfloat8x8 c, e, f = make_filled_simdgroup_matrix<bfloat, 8, 8>(bfloat(5.0f));
        simdgroup_float8x8 d = make_filled_simdgroup_matrix<float, 8, 8>(5.0f);
        simdgroup_load(a, A, 8);
        simdgroup_load(b, B, 8);
        simdgroup_load(c, C, 8);
        simdgroup_load(e, E, 8);
        simdgroup_multiply(d, a, b);
        simdgroup_multiply(f, c, e);
        simdgroup_store(d, D, 8);
        simdgroup_store(f, F, 8);"""
    ks = mx.random.split(mx.random.key(7), 4)
    a, b = (mx.random.randint(-2, 3, (8, 8), key=k).astype(mx.float16) for k in ks[:2])
    c, e = (mx.random.randint(-2, 3, (8, 8), key=k).astype(mx.bfloat16) for k in ks[2:])
    k = _mk(src, ["A", "B", "C", "E"], ["D", "F"])
    d, f = k(inputs=[a, b, c, e], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(8, 8), (8, 8)],
             output_dtypes=[mx.float32, mx.bfloat16])
    assert d.dtype == mx.float32 and f.dtype == mx.bfloat16
    assert_close(d, _ref_matmul(a, b), 0.0, "half inputs, float result")
    assert_close(f, _ref_matmul(c, e), 0.0, "bfloat")


_LOAD_8X8 = """
    simdgroup_float8x8 m;
    simdgroup_load(m, X, {EPR});
    simdgroup_store(m, out, 8);"""


def test_planted_simdgroup_load_past_buffer_end_is_caught():
    """X holds one 8x8 matrix: read with 9 elements per row, its last row
    runs past X's end. With 8: exact."""
    x = mx.random.normal((8, 8), key=mx.random.key(1))
    run = lambda epr: _mk(_LOAD_8X8.replace("{EPR}", epr), ["X"], ["out"])(
        inputs=[x], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(8, 8)], output_dtypes=[mx.float32])[0]
    with pytest.raises(mc.MetalCheckError, match=r"simdgroup_load: element \(row 7, column \d\) lies outside "
                                                 r"buffer 'X' \(size 256 bytes\)"):
        run("9")
    assert_close(run("8"), x, 0.0, "8x8 load")


def test_planted_simdgroup_store_past_threadgroup_array_is_caught():
    """An 8x8 store at origin (column 1, row 0) into a threadgroup array of
    64 floats runs past its end (into whatever follows it in memory): caught
    by the array's name. At origin 0: exact."""
    src = """
        threadgroup float t[64];
        threadgroup float after[64];
        simdgroup_float8x8 m;
        simdgroup_load(m, X, 8);
        simdgroup_store(m, t, 8, ulong2(ORIGIN, 0));
        simdgroup_load(m, t, 8);
        simdgroup_store(m, out, 8);
        after[thread_index_in_simdgroup] = 0.0f;"""
    x = mx.random.normal((8, 8), key=mx.random.key(2))
    run = lambda origin: _mk(src.replace("ORIGIN", origin), ["X"], ["out"])(
        inputs=[x], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(8, 8)], output_dtypes=[mx.float32])[0]
    with pytest.raises(mc.MetalCheckError, match=r"simdgroup_store: element \(row 7, column \d\) lies outside "
                                                 r"threadgroup array 't' \(size 256 bytes\)"):
        run("1")
    assert_close(run("0"), x, 0.0, "through threadgroup memory")


def test_planted_simdgroup_ops_in_divergent_branches_are_caught():
    """Half the lanes multiply a * b, the others b * a: each call has 16
    lanes on a GPU, and the two calls are the same count of collectives
    into the kernel: caught by call site. The uniform form: a @ b."""
    src = """
        uint lane = thread_index_in_simdgroup;
        simdgroup_float8x8 a, b, c = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        simdgroup_load(a, A, 8);
        simdgroup_load(b, B, 8);
        if (COND) { simdgroup_multiply_accumulate(c, a, b, c); } else { simdgroup_multiply_accumulate(c, b, a, c); }
        simdgroup_store(c, out, 8);"""
    ks = mx.random.split(mx.random.key(4), 2)
    a, b = mx.random.normal((8, 8), key=ks[0]), mx.random.normal((8, 8), key=ks[1])
    run = lambda cond: _mk(src.replace("COND", cond), ["A", "B"], ["out"])(
        inputs=[a, b], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(8, 8)], output_dtypes=[mx.float32])[0]
    with pytest.raises(mc.MetalCheckError, match="SIMD group diverged: lanes wait at different simd_\\* collectives"):
        run("lane < 16")
    assert_close(run("simdgroup_index_in_threadgroup == 0"), _ref_matmul(a, b), FP32_TOL, "a @ b")


@pytest.mark.parametrize("threads,early_return", [(32, True), (48, False)])
def test_planted_simdgroup_op_without_all_lanes_is_caught(threads, early_return):
    """A simdgroup_matrix operation needs all 32 lanes: lanes that returned
    before it, or a threadgroup of 48 threads (its second SIMD group has 16)."""
    src = ("if (thread_index_in_simdgroup >= 16) { return; }" if early_return else "") + _LOAD_8X8.replace(
        "{EPR}", "8")
    x = mx.random.normal((8, 8), key=mx.random.key(6))
    k = _mk(src, ["X"], ["out"])
    with pytest.raises(mc.MetalCheckError, match="simdgroup_load executed by 16 of the 32 lanes of a SIMD group"):
        k(inputs=[x], grid=(threads, 1, 1), threadgroup=(threads, 1, 1), output_shapes=[(8, 8)],
          output_dtypes=[mx.float32])


@pytest.mark.parametrize("call,message", [
    ("simdgroup_load(m, X, 8, ulong2(1, 0), true)", "with transpose_matrix and a nonzero matrix_origin"),
    ("simdgroup_load(m, X + (thread_index_in_simdgroup % 2), 8)", "lanes pass different arguments"),
])
def test_simdgroup_unsimulated_forms_are_refused(call, message):
    """Forms the shim does not simulate (a transposed load at an origin: MSL
    leaves its coordinates open) or that have no defined meaning (arguments
    that differ between lanes) are errors, not silently wrong values."""
    k = _mk(f"simdgroup_float8x8 m; {call}; simdgroup_store(m, out, 8);", ["X"], ["out"])
    with pytest.raises(mc.MetalCheckError, match=message):
        k(inputs=[mx.ones((16, 8))], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(8, 8)],
          output_dtypes=[mx.float32])


def test_planted_simd_sum_at_two_call_sites_is_caught():
    """Lanes 0-15 and 16-31 each call simd_sum, from two branches: the same
    count of collectives, different call sites (on a GPU each sum would see
    16 lanes). The single call site: the sum of 32 values."""
    body = """
        uint lane = thread_index_in_simdgroup;
        float v = x[thread_position_in_grid.x];
        {SUM}
        out[thread_position_in_grid.x] = v;"""
    x = mx.arange(32).astype(mx.float32)
    bad = _kernel(body.replace("{SUM}", "if (lane < 16) { v = simd_sum(v); } else { v = simd_sum(2 * v); }"))
    with pytest.raises(mc.MetalCheckError, match="SIMD group diverged: lanes wait at different simd_\\* collectives"):
        _run(bad, x, (32, 1, 1), (32, 1, 1))
    good = _kernel(body.replace("{SUM}", "v = simd_sum(lane < 16 ? v : 2 * v);"))
    want = float(x[:16].sum().item() + 2 * x[16:].sum().item())
    assert_close(_run(good, x, (32, 1, 1), (32, 1, 1)), mx.full((32,), want), 0.0, "sum")
