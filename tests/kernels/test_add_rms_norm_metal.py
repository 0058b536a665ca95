"""The Metal residual add + RMSNorm kernel (``kernels/add_rms_norm_metal.py``),
run on the CPU through ``tests/metal_check.py`` (MLX's generated source as
C++, one fiber per GPU thread, guard pages, outputs poisoned with NaN).

``h`` is checked bit for bit against MLX's own ``x + y`` (the contract's
rounding). ``normed`` against a float64 reference of ``rms_norm(h, weight,
eps)`` from that same rounded ``h``: the kernel rounds twice to the output
dtype (the normalised value, its product with the weight), the reference
nowhere, so the bound is ``tolerance(out dtype, 2)`` (FP32_TOL for float32
outputs). Against ``mx.fast.rms_norm(h, weight, eps)`` itself: both are
within two roundings of that reference, so within four of each other.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import metal_check as mc
from compare import assert_close, finite, npa, tolerance
from mlx_qwen_fast.kernels import add_rms_norm_metal as arn

MODULE = arn.__name__
needs_cxx = pytest.mark.skipif(mc.CXX is None, reason="no C++ compiler (g++) to build the Metal sources")


def _inputs(shape, dtype, wdtype=None, seed=0):
    ks = mx.random.split(mx.random.key(seed), 3)
    x = (2.0 * mx.random.normal(shape, key=ks[0])).astype(dtype)
    y = mx.random.normal(shape, key=ks[1]).astype(dtype)
    w = (1.0 + 0.3 * mx.random.normal((shape[-1],), key=ks[2])).astype(wdtype or dtype)
    return x, y, w


def norm_reference(h, w, eps):
    """float64 ``h * rsqrt(mean(h^2) + eps) * w`` over the last axis."""
    hf, wf = npa(h).astype(np.float64), npa(w).astype(np.float64)
    return hf / np.sqrt((hf * hf).mean(-1, keepdims=True) + eps) * wf


def check(x, y, w, eps=1e-6):
    """Run the kernel once; h exact against MLX's add, normed within the
    module docstring's bounds. Returns (h, normed)."""
    with mc.simulated_modules(MODULE) as (m,):
        h, normed = m.add_rms_norm_metal(x, y, w, eps)
        assert m._kernel().calls == 1
    out = mx.result_type(x, w)
    assert h.shape == normed.shape == x.shape and h.dtype == x.dtype and normed.dtype == out
    assert finite(h, normed)
    assert_close(h, x + y, 0.0, "h vs MLX's add")
    assert_close(normed, norm_reference(x + y, w, eps), tolerance(out, 2), "normed vs the float64 reference")
    assert_close(normed, mx.fast.rms_norm(x + y, w, eps), tolerance(out, 4), "normed vs mx.fast.rms_norm")
    return h, normed


@needs_cxx
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("B", [1, 2, 3, 4])
def test_model_width_decode_rows(B, dtype):
    """The model's D = 2048 (256 threads, 8 elements each), decode rows [B, 1, D]."""
    assert arn.threads_per_row(2048) == 256
    check(*_inputs((B, 1, 2048), dtype, seed=B))


@needs_cxx
@pytest.mark.parametrize("shape, dtype", [
    ((3, 1000), mx.bfloat16),   # 96 threads: D not a multiple of the threadgroup, [N, D] rows
    ((2, 1, 100), mx.float32),  # one SIMD group, 4 elements per thread, 28 slots idle
    ((1, 1, 1), mx.float16),    # one element per row
    ((2, 32), mx.bfloat16),     # one element per thread of one SIMD group
    ((1, 1, 4096), mx.bfloat16),  # 512 threads: 16 SIMD-group partials
    ((2, 2, 1, 520), mx.float32),  # leading axes; 64 threads, the last of 9 elements partial
])
def test_other_widths_and_shapes(shape, dtype):
    check(*_inputs(shape, dtype, seed=shape[-1]))


@needs_cxx
@pytest.mark.parametrize("dtype, wdtype", [(mx.bfloat16, mx.float32), (mx.float16, mx.bfloat16),
                                           (mx.float32, mx.bfloat16)])
def test_weight_of_another_dtype_promotes_the_output(dtype, wdtype):
    """``normed`` in MLX's promotion of the two dtypes (float32 here), as
    ``mx.fast.rms_norm`` returns it; ``h`` stays in x's dtype."""
    assert mx.result_type(dtype, wdtype) == mx.float32
    check(*_inputs((2, 1, 2048), dtype, wdtype, seed=7))


@needs_cxx
def test_a_zero_sum_row_and_a_large_eps():
    """A row where y = -x: h is exactly 0 and the norm 0 (rsqrt(eps) finite);
    the other row normalised with eps = 0.5."""
    x, y, w = _inputs((2, 1, 256), mx.bfloat16, seed=3)
    y = mx.concatenate([-x[:1], y[1:]])
    h, normed = check(x, y, w, eps=0.5)
    assert not np.any(npa(h[0])) and not np.any(npa(normed[0]))


def _planted(tmp_path, old, new):
    text = arn.SOURCE_FILE.read_text()
    assert text.count(old) == 1
    path = tmp_path / "add_rms_norm.metal"
    path.write_text(text.replace(old, new))
    return path


@needs_cxx
def test_planted_bugs_are_caught(tmp_path, monkeypatch):
    """The checks above fail a kernel without its barrier (the partials of
    the other SIMD groups read before they are written: poison, or outputs
    that depend on the thread schedule) and one without its edge guard (a
    read past the end of x, which the checker names)."""
    x, y, w = _inputs((2, 1, 2048), mx.float32, seed=5)
    src = _planted(tmp_path, "threadgroup_barrier(mem_flags::mem_threadgroup);", "")
    with mc.simulated_modules(MODULE) as (m,):
        monkeypatch.setattr(m, "SOURCE_FILE", src)
        try:
            _, normed = m.add_rms_norm_metal(x, y, w)
            caught = not finite(normed)
        except mc.MetalCheckError as e:
            caught = "depends on the order threads run in" in str(e)
    assert caught
    x, y, w = _inputs((3, 1000), mx.float32, seed=6)
    (tmp_path / "edge").mkdir()
    src = _planted(tmp_path / "edge", "        v[i] = 0.0f;\n        if (d < D) {", "        v[i] = 0.0f;\n        {")
    with mc.simulated_modules(MODULE) as (m,):
        monkeypatch.setattr(m, "SOURCE_FILE", src)
        with pytest.raises(mc.MetalCheckError, match="out-of-bounds access of buffer 'x'"):
            m.add_rms_norm_metal(x, y, w)


def test_argument_checks_and_no_rows():
    """Refused by name before any kernel is built (no Metal needed); no rows:
    empty results without a launch; ``supports`` only on Metal."""
    x, y, w = _inputs((2, 1, 64), mx.float32)
    with mc.simulated_modules(MODULE) as (m,):
        for args, pattern in [
            ((x.astype(mx.int32), y, w), r"x must be a float32/float16/bfloat16 mx.array \[\.\.\., D\].*int32"),
            ((np.zeros((2, 64), np.float32), y, w), "x must be"),
            ((mx.zeros((1, 40000)), mx.zeros((1, 40000)), mx.ones((40000,))),
             r"x must be .* with D in \[1, 32768\], got \S*float32 \(1, 40000\)"),
            ((x, y[..., :32], w), r"y must be an mx.array of x's shape and dtype \(\S*float32 \(2, 1, 64\)\), "
                                  r"got \S*float32 \(2, 1, 32\)"),
            ((x, y.astype(mx.bfloat16), w), "y must be"),
            ((x, y, w[:32]), r"weight must be .*of shape \[64\]"),
            ((x, y, w.astype(mx.int32)), "weight must be"),
            ((x, y, None), "weight must be .* got None"),
        ]:
            with pytest.raises(ValueError, match="add_rms_norm_metal: " + pattern):
                m.add_rms_norm_metal(*args)
        for eps in (0.0, -1e-6, 1.0, float("nan"), "1e-6", True):
            with pytest.raises(ValueError, match="add_rms_norm_metal: eps must be a finite float in"):
                m.add_rms_norm_metal(x, y, w, eps)
        h, normed = m.add_rms_norm_metal(x[:0], y[:0], w.astype(mx.bfloat16))
        assert h.shape == normed.shape == (0, 1, 64) and h.dtype == normed.dtype == mx.float32
        assert m._kernel.cache_info().currsize == 0  # never built
        assert m.supports(x, y, w) and not m.supports(x, y[..., :32], w)
    assert arn.supports(x, y, w) == mx.metal.is_available()
    assert [arn.threads_per_row(d) for d in (1, 255, 256, 1000, 2048, 8192, 32768)] == [32, 32, 32, 96, 256, 1024,
                                                                                        1024]
