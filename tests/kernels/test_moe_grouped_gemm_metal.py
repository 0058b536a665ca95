"""The Metal grouped GEMMs of the prefill MoE (``kernels/moe_grouped_gemm_metal.py``:
gate+up with SwiGLU, down with the routing weights; simdgroup_matrix 8x8
tiles, 4-bit weights dequantised in threadgroup memory), run on the CPU
through ``tests/metal_check.py`` (MLX's generated source as C++, one fiber per
GPU thread, guard pages, outputs and threadgroup arrays poisoned with NaN: a
row no threadgroup writes, or a matrix element read before it is staged,
fails the comparison), fresh random weights, ids and activations per case.
The routings come from the plain-MLX reference (``ops.moe.group_by_expert``,
``block_map``: the grouping kernels' own values, tested in
``test_moe_group_metal.py``).

References: ``references.moe_prefill_reference`` (fp32 host matmuls on the
weights ``s * q + b`` in fp32, rounding to the activations' dtype where
SwitchGLU rounds) and, for the chain, the package's plain-MLX reference
``ops.moe.expert_swiglu`` + ``combine``. Bounds (compare.tolerance):
float32 results FP32_TOL (the order of the fp32 sums differs). bf16/fp16 h:
roundings=2 (g and u, then SwiGLU, rounded by both: at each point a value
may land one ulp apart); down on the reference h: roundings=1 (its output's
rounding); the chain from x: roundings=3 (h's two, then the down output's).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import metal_check as mc
from compare import FP32_TOL, assert_close, tolerance
from moe_blocks import quant, x_tokens
from references import moe_prefill_reference
from mlx_qwen_fast.kernels import moe_grouped_gemm_metal as gm
from mlx_qwen_fast.moe_types import Routing
from mlx_qwen_fast.ops import moe

pytestmark = pytest.mark.skipif(mc.CXX is None, reason="no C++ compiler (g++) to build the Metal sources")

MODULE = "mlx_qwen_fast.kernels.moe_grouped_gemm_metal"


def tol(dtype, roundings):
    return FP32_TOL if dtype == mx.float32 else tolerance(dtype, roundings=roundings)


def make_experts(E, D, I, seed, scale_dtype):
    """(gate, up, down) 4-bit group-64 arrays, scales/biases in scale_dtype."""
    return tuple(tuple(a if a.dtype == mx.uint32 else a.astype(scale_dtype) for a in quant(shape, seed + j))
                 for j, shape in enumerate(((E, I, D), (E, I, D), (E, D, I))))


def make_routing(inds, E, tile, seed):
    """The reference's Routing of ``inds`` with random weights summing to 1."""
    n, k = inds.shape
    s = np.random.default_rng(seed).random((n, k)).astype(np.float32) + 0.05
    g = moe.group_by_expert(inds, E)
    return Routing(inds, mx.array(s / s.sum(1, keepdims=True)), g, moe.block_map(g, tile), tile)


def random_inds(n, k, E, seed, skip=()):
    rng = np.random.default_rng(seed)
    pool = np.array([e for e in range(E) if e not in skip])
    return mx.array(np.stack([rng.choice(pool, k, replace=False) for _ in range(n)]).reshape(n, k).astype(np.int32))


def case(n, k, E, D, I, tile, dtype, seed, skip=()):
    scale_dtype = mx.float32 if dtype == mx.float32 else mx.bfloat16
    experts = make_experts(E, D, I, seed, scale_dtype)
    x = x_tokens(n, D, seed + 7).astype(dtype)
    routing = make_routing(random_inds(n, k, E, seed + 8, skip), E, tile, seed + 9)
    return x, routing, experts


def run(x, routing, experts):
    """h (grouped order), y (from the reference's h: the down kernel's own
    arithmetic) and the chain's [N, D] through the checker."""
    _, _, ref_out = ref = moe_prefill_reference(x, routing.inds, routing.scores, experts, x.dtype)
    h_ref = mx.array(ref[0][np.asarray(routing.groups.order)]).astype(x.dtype)  # grouped order
    with mc.simulated_modules(MODULE) as (m,):
        h = m.gate_up_swiglu_metal(x, routing, experts[0], experts[1])
        y = m.down_weighted_metal(h_ref, routing, experts[2])
        out = m.moe_experts_metal(x, routing, experts)
        assert [m._kernel(s).calls for s in ("gate_up", "down")] == [2, 2]
    nk = routing.inds.size
    assert h.shape == (nk, experts[0][0].shape[1]) and h.dtype == x.dtype
    assert y.shape == (nk, x.shape[1]) and y.dtype == mx.float32
    assert out.shape == x.shape and out.dtype == x.dtype
    return h, y, out, ref


@pytest.mark.parametrize("n, k, E, D, I, tile, dtype", [
    (1, 2, 8, 64, 64, 16, mx.float32),      # one token: two items of one row, most experts empty
    (4, 2, 8, 128, 64, 16, mx.float16),     # a few tokens, fp16 activations (bf16 scales)
    (70, 2, 8, 128, 64, 16, mx.bfloat16),   # ~70 tokens: ragged last tiles, several tiles per expert
    (70, 2, 8, 64, 128, 32, mx.float32),    # 32-row tiles: both SIMD-group rows active, then ragged
    (11, 8, 32, 128, 64, 16, mx.float32),   # top-8 of 32 (the test model's routing; its D=256, I=128 run
                                            # in test_metal_model.py)
])
def test_grouped_gemms_match_reference(n, k, E, D, I, tile, dtype):
    x, routing, experts = case(n, k, E, D, I, tile, dtype, seed=n + 3 * D + I + tile)
    h, y, out, (h_ref, y_ref, out_ref) = run(x, routing, experts)
    inverse = np.asarray(routing.groups.inverse)
    assert_close(np.asarray(h.astype(mx.float32))[inverse], h_ref, tol(dtype, 2), "h")
    assert_close(y, y_ref, tol(dtype, 1), "y")
    assert_close(out, out_ref, tol(dtype, 3), "combined")


def test_grouped_gemms_empty_experts_and_the_plain_mlx_reference():
    """Experts 0, 2 and 7 take no token (no block-map item: their weights
    never read), fp32 activations and scales: the chain within FP32_TOL of
    the package's plain-MLX reference (expert_swiglu on MLX's gather_qmm,
    then combine), through QuantizedSwitchLinear modules holding the arrays."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    n, k, E, D, I = 9, 2, 8, 128, 64
    x, routing, experts = case(n, k, E, D, I, 16, mx.float32, seed=21, skip=(0, 2, 7))
    assert np.asarray(routing.groups.counts)[[0, 2, 7]].tolist() == [0, 0, 0]
    _, _, out, _ = run(x, routing, experts)
    projs = []
    for (w, s, b), (i, o) in zip(experts, ((D, I), (D, I), (I, D))):
        p = QuantizedSwitchLinear(i, o, E, bias=False, group_size=64, bits=4)
        p.weight, p.scales, p.biases = w, s, b
        projs.append(p)
    ref = moe.combine(moe.expert_swiglu(x, routing.groups, *projs), routing.scores)
    assert_close(out, ref, FP32_TOL, "vs expert_swiglu + combine")


def test_grouped_gemm_argument_checks():
    """Refused by name before any kernel is built (no Metal needed); no
    assignments: empty results without a launch."""
    x, routing, experts = case(3, 2, 8, 128, 64, 16, mx.bfloat16, seed=5)
    gate, up, down = experts
    assert gm.problem(x, experts) is None
    h = mx.zeros((6, 64), mx.bfloat16)

    def refused(fn, match, *args):
        with pytest.raises(ValueError, match=f"{fn.__name__}: .*" + match):
            fn(*args)

    gu, dw, me = gm.gate_up_swiglu_metal, gm.down_weighted_metal, gm.moe_experts_metal
    refused(gu, r"x must be float32/float16/bfloat16 \[N, D\]", x.astype(mx.int32), routing, gate, up)
    refused(gu, r"D must be a positive multiple of 64 .*got D=96", x[:, :96], routing, gate, up)
    refused(gu, r"expert width I must be a positive multiple of 64, got I=32",
            x, routing, tuple(a[:, :32] for a in gate), up)
    refused(gu, r"gate/up must be 4-bit group-64", x, routing, gate, down)
    refused(gu, r"routing must be a Routing", x, tuple(routing), gate, up)
    refused(gu, r"tile_rows must be one of \(16, 32\), got 64", x, routing._replace(tile_rows=64), gate, up)
    refused(gu, r"routing has 8 experts .*the weights 4", x, routing, *(tuple(a[:4] for a in q) for q in (gate, up)))
    bad_order = routing._replace(groups=routing.groups._replace(order=routing.groups.order + 100))
    refused(gu, r"routing is not a grouping of 6 assignments", x, bad_order, gate, up)
    refused(dw, r"h must be float32/float16/bfloat16 \[N\*k, I\]", h[:, :32], routing, down)
    refused(dw, r"down must be 4-bit group-64", h, routing, gate)
    refused(dw, r"down must be \(weight, scales, biases\)", h, routing, None)
    refused(dw, r"routing.scores must be float32 with 6 entries", h,
            routing._replace(scores=routing.scores.astype(mx.bfloat16)), down)
    refused(dw, r"routing.groups.order must be int32 \[4\]", h[:4], routing, down)
    refused(me, r"experts must be \(gate, up, down\)", x, routing, experts[:2])
    refused(me, r"experts down must be 4-bit group-64", x, routing, (gate, up, gate))
    refused(me, r"out_dtype must be None or float32/float16/bfloat16", x, routing, experts, mx.int32)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="choose_tile_rows"):
            gm.choose_tile_rows(bad, 8)
    assert [gm.choose_tile_rows(v, 8) for v in (0, 255, 256, 10**6)] == [16, 16, 32, 32]
    empty = make_routing(mx.zeros((0, 2), mx.int32), 8, 16, 0)
    assert gu(x[:0], empty, gate, up).shape == (0, 64)
    assert dw(h[:0], empty, down).shape == (0, 128)
    assert me(x[:0], empty, experts).shape == (0, 128)
