"""The Metal down + routing weights + shared expert + combine kernel of the
decode MoE (``kernels/moe_down_metal.py``), run on the CPU through
``tests/metal_check.py`` (MLX's generated source as C++, one fiber per GPU
thread, guard pages, outputs and threadgroup arrays poisoned with NaN: an
output row or a slot's entry that nothing writes fails the comparison),
against the fp32 host reference ``references.moe_decode_reference``, fresh
random weights and inputs per case. The kernel reads the reference's own
``h`` and gate (so only its own arithmetic is compared), and once the Metal
gate+up kernel's.

Bounds (compare.tolerance): float32, FP32_TOL (the order of the fp32 sums
differs). bfloat16, roundings=2: y is stored rounded (the reference's is
not), and each expert's output is rounded by both, where a value may land
one ulp apart.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import metal_check as mc
from compare import FP32_TOL, assert_close, tolerance
from moe_blocks import make_arrays, make_routing, x_tokens
from references import moe_decode_reference
from mlx_qwen_fast.kernels import moe_down_metal as dm

pytestmark = pytest.mark.skipif(mc.CXX is None, reason="no C++ compiler (g++) to build the Metal sources")

MODULE = "mlx_qwen_fast.kernels.moe_down_metal"


def tol(dtype):
    return FP32_TOL if dtype == mx.float32 else tolerance(mx.bfloat16, roundings=2)


def inputs(n, k, E, D, I, seed, dtype, inds=None, scores=None):
    experts, shared, eg = make_arrays(E, D, I, seed=seed)
    x = x_tokens(n, D, seed + 1).astype(dtype)
    if inds is None:
        inds, scores = make_routing(n, k, E, seed + 2, special=k > 1)
    h, sg, y = moe_decode_reference(x, inds, scores, experts, shared, eg, dtype=dtype)
    return x, inds, scores, experts, shared, eg, mx.array(h).astype(dtype), mx.array(sg), y


def run_down(h, inds, scores, sg, experts, shared):
    with mc.simulated_modules(MODULE) as (m,):
        y = m.down_combine_metal(h, inds, scores, sg, experts[2], shared[2])
        assert m._kernel().calls == 1
    assert y.shape == (inds.shape[0], experts[2][0].shape[1]) and y.dtype == h.dtype
    return y


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("n, k, E, D, I", [
    (1, 8, 32, 256, 128),   # one token: 9 items, one SIMD group each
    (4, 8, 64, 256, 192),   # 33 items over 16 SIMD groups; I = 192: lanes 12..31 idle
    (2, 3, 32, 320, 576),   # I = 512 + 64: a second pass over the inputs by 4 lanes
])
def test_down_matches_reference(dtype, n, k, E, D, I):
    _, inds, scores, experts, shared, _, h, sg, y_ref = inputs(n, k, E, D, I, 5 * n + k + I, dtype)
    y = run_down(h, inds, scores, sg, experts, shared)
    assert_close(y, y_ref, tol(dtype), "y")


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_down_shared_and_repeated_experts(dtype):
    """Every token picks experts 3 and 7; token 1 lists expert 3 twice
    (its coefficient the sum of both scores); token 2 also picks the
    last expert."""
    inds = mx.array(np.array([[3, 7, 0], [3, 3, 7], [7, 31, 3]], np.int32))
    scores = mx.array(np.array([[0.5, 0.3, 0.2], [0.25, 0.35, 0.4], [0.6, 0.1, 0.3]], np.float32))
    _, _, _, experts, shared, _, h, sg, y_ref = inputs(3, 3, 32, 256, 128, 41, dtype, inds, scores)
    y = run_down(h, inds, scores, sg, experts, shared)
    assert_close(y, y_ref, tol(dtype), "y")


def test_down_same_bits_for_any_simd_group_count(monkeypatch):
    """The items spread over 1, 3 or the launch's SIMD groups: the same
    bits (fixed summation order); uint32 ids too."""
    _, inds, scores, experts, shared, _, h, sg, _ = inputs(2, 4, 32, 256, 128, 9, mx.bfloat16)
    with mc.simulated_modules(MODULE) as (m,):
        y = m.down_combine_metal(h, inds, scores, sg, experts[2], shared[2])
        for nw in (1, 3):
            monkeypatch.setattr(m, "simd_groups", lambda n, k, nw=nw: nw)
            assert mx.array_equal(m.down_combine_metal(h, inds, scores, sg, experts[2], shared[2]), y).item()
        y32 = m.down_combine_metal(h, inds.astype(mx.uint32), scores, sg, experts[2], shared[2])
        assert mx.array_equal(y32, y).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_gate_up_then_down(dtype):
    """The two decode kernels chained (h and the gate from the gate+up
    kernel) against the reference's y."""
    x, inds, scores, experts, shared, eg, _, _, y_ref = inputs(2, 8, 32, 256, 128, 13, dtype)
    with mc.simulated_modules("mlx_qwen_fast.kernels.moe_gate_up_metal", MODULE) as (gum, m):
        h, sg = gum.gate_up_swiglu_metal(x, inds, experts, shared, eg)
        y = m.down_combine_metal(h, inds, scores, sg, experts[2], shared[2])
    assert_close(y, y_ref, tol(dtype), "y")


def test_down_argument_checks():
    """Refused by name before any kernel is built (no Metal needed)."""
    experts, shared, _ = make_arrays(32, 256, 128, seed=3)
    inds, scores = make_routing(2, 8, 32, 5)
    h = mx.zeros((18, 128), mx.bfloat16)
    sg = mx.zeros((2,), mx.float32)
    down, sdown = experts[2], shared[2]
    assert dm.simd_groups(1, 8) == 9 and dm.simd_groups(4, 8) == dm.MAX_SIMD_GROUPS == 16

    def refused(match, *args):
        with pytest.raises(ValueError, match="down_combine_metal: .*" + match):
            dm.down_combine_metal(*args)

    refused(r"inds must be int32/uint32 \[N, k\]", h, inds.astype(mx.float32), scores, sg, down, sdown)
    refused(r"1 <= N <= 4 and 1 <= N\*k <= 32, got N=5", mx.zeros((10, 128)), mx.zeros((5, 1), mx.int32),
            mx.zeros((5, 1)), mx.zeros((5,)), down, sdown)
    refused(r"N\*k <= 32, got N=2, k=17", mx.zeros((36, 128)), mx.zeros((2, 17), mx.int32), mx.zeros((2, 17)),
            sg, down, sdown)
    refused(r"h must be float32/bfloat16 \[N\*k \+ N = 18, I\]", h[:-1], inds, scores, sg, down, sdown)
    refused(r"h must be", h.astype(mx.float16), inds, scores, sg, down, sdown)
    refused(r"positive multiple of 64, got \S*bfloat16 \(18, 96\)", h[:, :96], inds, scores, sg, down, sdown)
    refused(r"scores must be float32 \[2, 8\]", h, inds, scores.astype(mx.bfloat16), sg, down, sdown)
    refused(r"sgate must be float32 \[2\]", h, inds, scores, sg[:1], down, sdown)
    refused(r"down must be \(weight, scales, biases\)", h, inds, scores, sg, None, sdown)
    refused(r"down must be 4-bit group-64", h, inds, scores, sg, experts[0], sdown)
    refused(r"shared_down must be", h, inds, scores, sg, down, shared[0])
    refused(r"inds must lie in \[0, E=32\), got values in \[0, 40\]", h, inds.at[0, 0].add(40 - inds[0, 0]),
            scores, sg, down, sdown)
