"""The Metal decode-step kernel (``kernels/gated_delta_decode_metal.py``),
run on the CPU through ``tests/metal_check.py`` (MLX's generated source as
C++, one fiber per GPU thread, guard pages, poisoned outputs), against the
same fp32 references and bounds as the CUDA kernel's tests
(``test_gated_delta_decode.py``: roundings=1 for the state, 5 for the
output, the conv state exact).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
import metal_check as mc
from compare import assert_close
from gdn_helpers import C, D, HK, HV, assert_decode_step, decode_reference, decode_step_inputs, fe_params
from mlx_qwen_fast.kernels.gated_delta_contract import decode_params

pytestmark = pytest.mark.skipif(mc.CXX is None, reason="no C++ compiler (g++) to build the Metal sources")


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("B", [1, 2])
def test_metal_decode_matches_reference(B, dtype):
    """Two chained steps (the second from the kernel's own states), the
    model's head counts (16 key, 32 value heads of 128)."""
    w, A_log, dt_bias = fe_params(300 + B, dtype)
    ks = mx.random.split(mx.random.key(400 + B), 4)
    cs = mx.random.normal((B, 3, C), key=ks[0]).astype(dtype)
    s0 = 0.5 * mx.random.normal((B, HV, D, D), key=ks[1])
    wn = (1 + 0.3 * mx.random.normal((D,), key=ks[2])).astype(dtype)
    params = decode_params(w, A_log, dt_bias, wn)
    with mc.simulated_modules("mlx_qwen_fast.kernels.gated_delta_decode_metal") as (gdm,):
        for step in range(2):
            qkv, z, a, b = decode_step_inputs(mx.random.split(ks[3], 2)[step], B, dtype)
            proj = mx.concatenate([qkv, z, a, b], axis=-1)
            out, ncs, ns = gdm.gated_delta_decode_metal(proj, params, cs, s0, num_k_heads=HK, num_v_heads=HV)
            ro, rcs, rs = decode_reference(qkv, z, a, b, w, cs, A_log, dt_bias, s0, wn, dtype)
            assert_decode_step((out, ncs, ns), (ro, rcs, rs), dtype)
            cs, s0 = ncs, ns
        assert gdm._kernel().calls == 2


def test_metal_decode_from_none_states_and_empty_batch():
    """None states are zeros (the first token of a layer); B = 0 gives empty
    outputs without a launch; bad input is refused by name before any
    kernel is built (no Metal needed for that)."""
    dtype = mx.float32
    w, A_log, dt_bias = fe_params(7, dtype)
    params = decode_params(w, A_log, dt_bias, mx.ones((D,)))
    qkv, z, a, b = decode_step_inputs(mx.random.key(9), 1, dtype)
    proj = mx.concatenate([qkv, z, a, b], axis=-1)
    with mc.simulated_modules("mlx_qwen_fast.kernels.gated_delta_decode_metal") as (gdm,):
        got = gdm.gated_delta_decode_metal(proj, params, None, None, num_k_heads=HK, num_v_heads=HV)
        ref = gdm.gated_delta_decode_metal(proj, params, mx.zeros((1, 3, C)), mx.zeros((1, HV, D, D)),
                                           num_k_heads=HK, num_v_heads=HV)
    for g_, r_ in zip(got, ref):
        assert_close(g_, r_, 0.0, "None states vs zeros")
    empty = gdm.gated_delta_decode_metal(proj[:0], params, None, None, num_k_heads=HK, num_v_heads=HV)
    assert [e.shape for e in empty] == [(0, 1, HV * D), (0, 3, C), (0, HV, D, D)]
    with pytest.raises(ValueError, match="gated_delta_decode_metal.*proj|proj must"):
        gdm.gated_delta_decode_metal(proj[..., 1:], params, None, None, num_k_heads=HK, num_v_heads=HV)
    with pytest.raises(ValueError, match="num_v_heads"):
        gdm.gated_delta_decode_metal(proj, params, None, None, num_k_heads=3, num_v_heads=HV)
