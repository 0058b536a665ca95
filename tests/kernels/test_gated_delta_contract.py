"""The Gated DeltaNet decode kernels' shared argument contract
(``kernels/gated_delta_contract.py``): the packed projection's width, the
layer's constants as one float32 array and one step's checks, on the CPU
with fresh random arrays; bad input raises ValueError naming the argument."""

import mlx.core as mx
import pytest

from gdn_helpers import C, D, HK, HV
from mlx_qwen_fast.kernels import gated_delta_contract as gc
from mlx_qwen_fast.kernels.gated_delta_contract import decode_params, packed_width, params_width


def test_the_contracts_sizes():
    assert (gc.D, gc.KW) == (128, 4)
    assert params_width(HK, HV) == C * gc.KW + 2 * HV + D


def test_packed_width_is_the_four_projections():
    """proj = concat(qkv, z, a, b): (2 Hk + Hv) * 128 + Hv * 128 + 2 Hv."""
    assert packed_width(HK, HV) == C + HV * D + 2 * HV


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("Hk,Hv", [(16, 32), (2, 4), (1, 1)])
def test_decode_params_layout(Hk, Hv, dtype):
    """[conv_weight | A_log | dt_bias | norm_weight] as exact float32 copies,
    at the offsets the kernel reads (gated_delta_decode.cu, GDN_PACKED 1)."""
    C_ = (2 * Hk + Hv) * 128
    ks = mx.random.split(mx.random.key(Hk * 100 + Hv), 4)
    w = mx.random.normal((C_, 4, 1), key=ks[0]).astype(dtype)
    A_log = mx.random.normal((Hv,), key=ks[1]).astype(dtype)
    dt_bias = mx.random.normal((Hv,), key=ks[2]).astype(dtype)
    nw = mx.random.normal((128,), key=ks[3]).astype(dtype)
    p = decode_params(w, A_log, dt_bias, nw)
    assert p.dtype == mx.float32 and p.shape == (params_width(Hk, Hv),)
    for t, lo in ((w, 0), (A_log, 4 * C_), (dt_bias, 4 * C_ + Hv), (nw, 4 * C_ + 2 * Hv)):
        assert mx.array_equal(p[lo:lo + t.size], t.reshape(-1).astype(mx.float32)).item()
    assert mx.array_equal(decode_params(w.reshape(C_, 4), A_log, dt_bias, nw), p).item()


def test_decode_params_names_the_argument():
    Hk, Hv = 2, 4
    C_ = (2 * Hk + Hv) * 128
    w, v, nw = mx.zeros((C_, 4, 1)), mx.zeros((Hv,)), mx.zeros((128,))
    for args, name in (((w.reshape(1, 4, C_), v, v, nw), "conv_weight"),
                       ((w[:100], v, v, nw), "conv_weight"),
                       ((w.astype(mx.int32), v, v, nw), "conv_weight"),
                       ((w.tolist(), v, v, nw), "conv_weight"),
                       ((w, v[:3], v, nw), "A_log"),
                       ((w, v.reshape(2, 2), v.reshape(2, 2), nw), "A_log"),
                       ((w, v, None, nw), "dt_bias"),
                       ((w, v, v, nw[:64]), "norm_weight")):
        with pytest.raises(ValueError, match=name):
            decode_params(*args)


def _step(B, dtype, seed, conv_dtype=None):
    """Valid arguments of one step (check_step's keywords), fresh random data."""
    ks = mx.random.split(mx.random.key(seed), 6)
    params = decode_params(mx.random.normal((C, 4, 1), key=ks[0]), mx.random.normal((HV,), key=ks[1]),
                           mx.random.normal((HV,), key=ks[2]), mx.random.normal((D,), key=ks[3]))
    return dict(
        proj=mx.random.normal((B, 1, packed_width(HK, HV)), key=ks[4]).astype(dtype), params=params,
        conv_state=mx.random.normal((B, gc.KW - 1, C), key=ks[5]).astype(conv_dtype or dtype),
        state=mx.zeros((B, HV, D, D), mx.float32), num_k_heads=HK, num_v_heads=HV, norm_eps=1e-5, qk_eps=1e-6)


@pytest.mark.parametrize("B, dtype, conv_dtype", [(1, mx.bfloat16, None), (3, mx.float32, mx.bfloat16),
                                                  (0, mx.float16, None)])
def test_check_step_passes_valid_steps(B, dtype, conv_dtype):
    args = _step(B, dtype, seed=B, conv_dtype=conv_dtype)
    got_B, x, C_, conv_state, state, eps = gc.check_step("f", **args)
    assert (got_B, x, C_, eps) == (B, dtype, C, (1e-6, 1e-5))
    assert conv_state.dtype == dtype and conv_state.shape == (B, gc.KW - 1, C)  # cast to the activations'
    assert mx.array_equal(conv_state, args["conv_state"].astype(dtype)).item() and state is args["state"]


def test_check_step_makes_zero_states_for_none():
    args = {**_step(2, mx.bfloat16, seed=5), "conv_state": None, "state": None}
    _, _, _, conv_state, state, _ = gc.check_step("f", **args)
    assert conv_state.dtype == mx.bfloat16 and conv_state.shape == (2, gc.KW - 1, C) and not conv_state.any().item()
    assert state.dtype == mx.float32 and state.shape == (2, HV, D, D) and not state.any().item()
    args["proj"] = args["proj"].reshape(2, -1)  # [B, P] as well as [B, 1, P]
    assert gc.check_step("f", **args)[0] == 2


@pytest.mark.parametrize("change, name", [
    (dict(proj=mx.zeros((1, 1, 10))), "proj"), (dict(proj=mx.zeros((1, 2, packed_width(HK, HV)))), "proj"),
    (dict(proj=None), "proj"), (dict(params=mx.zeros((5,))), "params"),
    (dict(params=mx.zeros((params_width(HK, HV),), mx.bfloat16)), "params"),
    (dict(conv_state=mx.zeros((1, 3, C - 1))), "conv_state"),
    (dict(conv_state=mx.zeros((1, 3, C), mx.int32)), "conv_state"), (dict(conv_state=[0.0]), "conv_state"),
    (dict(state=mx.zeros((1, HV, D, D), mx.bfloat16)), "state"),
    (dict(state=mx.zeros((2, HV, D, D))), "state"), (dict(num_k_heads=3), "num_v_heads"),
    (dict(num_k_heads=0), "num_v_heads"), (dict(norm_eps=0.0), "norm_eps"), (dict(qk_eps=1.5), "qk_eps"),
])
def test_check_step_names_the_argument(change, name):
    args = {**_step(1, mx.float32, seed=9), **change}
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        gc.check_step("f", **args)
