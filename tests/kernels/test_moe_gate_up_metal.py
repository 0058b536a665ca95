"""The Metal gate+up SwiGLU kernel of the decode MoE
(``kernels/moe_gate_up_metal.py``), run on the CPU through
``tests/metal_check.py`` (MLX's generated source as C++, one fiber per GPU
thread, guard pages, outputs poisoned with NaN: an h row of a pair that no
threadgroup writes fails the comparison), against the fp32 host reference
``references.moe_decode_reference`` (weights ``s*q + b`` in fp32, rounding
to the activations' dtype where mlx-lm's SwitchGLU rounds), fresh random
weights and inputs per case.

Bounds (compare.tolerance): float32, FP32_TOL (kernel and reference differ
in the order of their fp32 sums only). bfloat16, h: roundings=2 (the gate
and up outputs, then SwiGLU, are rounded by both: at each point a value may
land one ulp apart); the shared-expert gate: its logit, recovered from the
kernel's sigmoid, within one rounding (roundings=1) of the unrounded fp32
logit.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import metal_check as mc
from compare import FP32_TOL, assert_close, npa, tolerance
from moe_blocks import make_arrays, make_routing, x_tokens
from references import dequant_f32, moe_decode_reference
from mlx_qwen_fast.kernels import moe_gate_up_metal as gum

pytestmark = pytest.mark.skipif(mc.CXX is None, reason="no C++ compiler (g++) to build the Metal sources")

MODULE = "mlx_qwen_fast.kernels.moe_gate_up_metal"


def gate_logit(x, expert_gate):
    """The shared-expert gate's logit x . w in fp32, unrounded: [N]."""
    gw, gs, gb, bits = expert_gate
    w = npa(gw) if bits == 16 else dequant_f32(gw, gs, gb, bits=bits)
    return (w @ npa(x).T)[0]


def check(x, inds, experts, shared, eg):
    with mc.simulated_modules(MODULE) as (m,):
        h, sgate = m.gate_up_swiglu_metal(x, inds, experts, shared, eg)
        assert m._kernel().calls == 1
    n, k = inds.shape
    I = experts[0][0].shape[1]
    assert h.shape == (n * k + n, I) and h.dtype == x.dtype
    assert sgate.shape == (n,) and sgate.dtype == mx.float32
    h_ref, sg_ref, _ = moe_decode_reference(x, inds, mx.ones((n, k)), experts, shared, eg, dtype=x.dtype)
    if x.dtype == mx.float32:
        assert_close(h, h_ref, FP32_TOL, "h")
        assert_close(sgate, sg_ref, FP32_TOL, "sgate")
    else:
        assert_close(h, h_ref, tolerance(mx.bfloat16, roundings=2), "h")
        s = npa(sgate).astype(np.float64)
        assert np.all((s > 0) & (s < 1)), s
        assert_close(np.log(s / (1 - s)), gate_logit(x, eg), tolerance(mx.bfloat16, roundings=1), "gate logit")
    return h, sgate


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("n, k, E, D, I, gate_bits", [
    (1, 8, 32, 256, 128, 8),   # one token, the checkpoint's 8-bit shared-expert gate
    (4, 8, 64, 512, 128, 8),   # four tokens sharing experts, N*k = 32 pairs (the most)
    (2, 2, 32, 576, 192, 4),   # D = 512 + 64: the second pass over the inputs has 4 lanes; 4-bit gate
    (3, 1, 32, 256, 64, 16),   # top-1, one threadgroup row block per item, a bf16 gate
])
def test_gate_up_matches_reference(dtype, n, k, E, D, I, gate_bits):
    seed = 7 * n + k + D
    experts, shared, eg = make_arrays(E, D, I, seed=seed, gate_bits=gate_bits)
    x = x_tokens(n, D, seed + 1).astype(dtype)
    inds, _ = make_routing(n, k, E, seed + 2, special=k > 1)  # tokens overlap; the last picks experts 0 and E-1
    check(x, inds, experts, shared, eg)


def test_gate_up_every_token_the_same_experts():
    """All four tokens pick the same 8 experts (each computed once, its h
    row written for every pair), uint32 ids the same bits as int32."""
    experts, shared, eg = make_arrays(32, 256, 128, seed=21)
    x = x_tokens(4, 256, 22)
    inds = mx.array(np.tile(np.array([[5, 0, 31, 17, 9, 30, 2, 11]], np.int32), (4, 1)))
    h, sgate = check(x, inds, experts, shared, eg)
    with mc.simulated_modules(MODULE) as (m,):
        h2, sgate2 = m.gate_up_swiglu_metal(x, inds.astype(mx.uint32), experts, shared, eg)
    assert mx.array_equal(h2, h).item() and mx.array_equal(sgate2, sgate).item()


def test_gate_up_argument_checks():
    """Refused by name before any kernel is built (no Metal needed): the
    contract's shapes and dtypes, ids out of range."""
    experts, shared, eg = make_arrays(32, 256, 128, seed=3)
    x = x_tokens(2, 256, 4)
    inds, _ = make_routing(2, 8, 32, 5)
    assert gum.problem(x, inds, experts, shared, eg) is None
    assert gum.problem(x.astype(mx.float32), inds, experts, shared, eg) is None

    def refused(match, *args):
        with pytest.raises(ValueError, match="gate_up_swiglu_metal: .*" + match):
            gum.gate_up_swiglu_metal(*args)

    refused(r"x must be float32/bfloat16 \[N, D\]", x.astype(mx.float16), inds, experts, shared, eg)
    refused(r"x must be", x[None], inds, experts, shared, eg)
    refused(r"x must have 1\.\.4 tokens, got N=5", x_tokens(5, 256, 0), make_routing(5, 2, 32, 0)[0], experts, shared, eg)
    refused(r"D must be a positive multiple of 64, got D=96", x[:, :96], inds, experts, shared, eg)
    refused(r"inds must be int32/uint32 \[N=2, k\]", x, inds[:1], experts, shared, eg)
    refused(r"inds must be", x, inds.astype(mx.float32), experts, shared, eg)
    refused(r"N\*k must be in \[1, 32\], got N=2, k=17", x, mx.zeros((2, 17), mx.int32), experts, shared, eg)
    refused(r"experts must be \(gate, up, down\)", x, inds, experts[:2], shared, eg)
    bad8 = tuple(mx.quantize(mx.zeros((32, 128, 256)), group_size=64, bits=8))
    refused(r"experts gate/up must be 4-bit group-64", x, inds, (bad8, experts[1], experts[2]), shared, eg)
    refused(r"experts down must be", x, inds, (experts[0], experts[1], experts[0]), shared, eg)
    refused(r"expert width I must be a positive multiple of 64, got I=96", x, inds,
            tuple(tuple(a[:, :96] for a in q) for q in experts), shared, eg)
    refused(r"shared expert must be 4-bit", x, inds, experts, (shared[1], shared[0], shared[0]), eg)
    refused(r"expert_gate must be", x, inds, experts, shared, (eg[0], eg[1], eg[2], 3))
    refused(r"inds must lie in \[0, E=32\), got values in \[0, 32\]", x, inds.at[1, 3].add(32 - inds[1, 3]),
            experts, shared, eg)
    refused(r"inds must lie in \[0, E=32\)", x, inds.at[0, 0].add(-1 - inds[0, 0]), experts, shared, eg)
