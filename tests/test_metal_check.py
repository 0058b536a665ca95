"""tests/metal_check.py: MLX's generated Metal sources run on the CPU.

Proved on mlx-lm's own Metal kernels against plain-MLX references (fresh
random inputs, several shapes, partial threadgroups), and on planted bugs
it must catch: a write past a buffer's end, a barrier some threads return
before, lanes of a SIMD group at different synchronisation points, a
missing barrier where the schedule shows it, unwritten outputs.
"""

import mlx.core as mx
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
