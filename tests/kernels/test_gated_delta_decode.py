"""The decode-step kernel (``kernels/gated_delta_decode.py``: conv + norms +
gates + state update + gated RMSNorm of one token, inputs read from one
packed projection row and one array of the layer's constants).

The argument checks run on any backend (the contract's own cases, and the
constants' layout: tests/kernels/test_gated_delta_contract.py); the kernel
against fp32 references on CUDA. Outputs are poisoned with NaN
before every launch; inputs are fresh random data.

Bounds (compare.tolerance): in fp32 everything is fp32. In bf16 the kernel
stores q, k, v in the activation dtype before the recurrence, as the
reference here does, so the fp32 state follows one independent rounding
(roundings=1); the output adds y's rounding and the gated norm's three (the
normalised value, times the weight, the output: roundings=5); the new conv
state is a copy of inputs (exact).
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from compare import finite
from gdn_helpers import C, D, HK, HV, assert_decode_step, decode_reference, decode_step_inputs, fe_params
from mlx_qwen_fast.kernels.gated_delta_contract import decode_params, packed_width
from mlx_qwen_fast.kernels.gated_delta_decode import gated_delta_decode, supports

# ---------------------------------------------------------------------------
# host side (any backend)
# ---------------------------------------------------------------------------


def test_step_refuses_bad_input():
    """The checks run in the wrapper, before anything CUDA-only (the
    contract's own cases: tests/kernels/test_gated_delta_contract.py)."""
    Hk, Hv = 2, 4
    C_ = (2 * Hk + Hv) * 128
    w, v, nw = mx.zeros((C_, 4, 1)), mx.zeros((Hv,)), mx.zeros((128,))
    params = decode_params(w, v, v, nw)
    proj = mx.zeros((1, 1, packed_width(Hk, Hv)))
    kw = dict(num_k_heads=Hk, num_v_heads=Hv)
    for args, name in (((proj[..., 1:], params, None, None), "proj"),
                       ((proj.astype(mx.int32), params, None, None), "proj"),
                       ((proj, params[1:], None, None), "params"),
                       ((proj, params.astype(mx.bfloat16), None, None), "params"),
                       ((proj, params, mx.zeros((1, 3, C_ - 1)), None), "conv_state"),
                       ((proj, params, mx.zeros((1, 3, C_), mx.int32), None), "conv_state"),
                       ((proj, params, None, mx.zeros((1, Hv, 128, 128), mx.bfloat16)), "state"),
                       ((proj, params, None, mx.zeros((2, Hv, 128, 128))), "state")):
        with pytest.raises(ValueError, match=name):
            gated_delta_decode(*args, **kw)
    with pytest.raises(ValueError, match="num_v_heads"):
        gated_delta_decode(proj, params, None, None, num_k_heads=3, num_v_heads=4)


# ---------------------------------------------------------------------------
# kernel (CUDA)
# ---------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.cpu_check("gated_delta_decode.cu")
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("B", [1, 2])
def test_decode_matches_reference(B, dtype):
    """Two steps, the states carried from the kernel's first step: each
    against fp32 conv + norms + gates (mlx-lm's expressions), the fp32
    recurrence and mlx-lm's gated norm; the four projections read from one
    packed row and the constants from decode_params' array."""
    w, A_log, dt_bias = fe_params(B, dtype)
    ks = mx.random.split(mx.random.key(200 + B), 4)
    cs = mx.random.normal((B, 3, C), key=ks[0]).astype(dtype)
    s0 = 0.5 * mx.random.normal((B, HV, D, D), key=ks[1])
    wn = (1 + 0.3 * mx.random.normal((D,), key=ks[2])).astype(dtype)
    params = decode_params(w, A_log, dt_bias, wn)
    for step in range(2):
        qkv, z, a, b = decode_step_inputs(mx.random.split(ks[3], 2)[step], B, dtype)
        proj = mx.concatenate([qkv, z, a, b], axis=-1)
        assert supports(qkv, s0, num_k_heads=HK, num_v_heads=HV)
        out, ncs, ns = gated_delta_decode(proj, params, cs, s0, num_k_heads=HK, num_v_heads=HV)
        ro, rcs, rs = decode_reference(qkv, z, a, b, w, cs, A_log, dt_bias, s0, wn, dtype)
        assert_decode_step((out, ncs, ns), (ro, rcs, rs), dtype)
        cs, s0 = ncs, ns


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("B", [1, 2])
def test_decode_compiled_equals_eager(B, dtype):
    """Inside mx.compile (as the layer's decode step runs it) the kernel gives
    the eager launch's bits, over several chained steps (state and conv state
    carried) from None states; a bad state is still refused by name."""
    w, A_log, dt_bias = fe_params(B, dtype)
    ks = mx.random.split(mx.random.key(300 + B), 5)
    wn = (1 + 0.3 * mx.random.normal((D,), key=ks[0])).astype(dtype)
    params = decode_params(w, A_log, dt_bias, wn)
    kw = dict(num_k_heads=HK, num_v_heads=HV)
    compiled = mx.compile(lambda p, prm, c, s: gated_delta_decode(p, prm, c, s, **kw))
    ce, se, cc, sc = None, None, None, None
    for t in range(3):
        proj = mx.concatenate(decode_step_inputs(ks[1 + t], B, dtype), axis=-1)
        oe, ce, se = gated_delta_decode(proj, params, ce, se, **kw)
        if cc is None:  # mx.compile takes arrays only: the first step's zeros as the kernel makes them
            cc, sc = mx.zeros((B, 3, C), dtype), mx.zeros((B, HV, D, D), mx.float32)
        oc, cc, sc = compiled(proj, params, cc, sc)
        assert finite(oc, cc, sc)
        for x, y in ((oe, oc), (ce, cc), (se, sc)):
            assert x.shape == y.shape and x.dtype == y.dtype
            assert mx.array_equal(x, y).item()
    with pytest.raises(ValueError, match="state"):
        compiled(proj, params, cc, sc[:, :4])
