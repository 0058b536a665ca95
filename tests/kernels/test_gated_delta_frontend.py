"""The prefill front-end kernel (``kernels/gated_delta_frontend.py``: conv +
SiLU + q/k L2 norm + gates) vs mlx-lm's expressions in fp32.

Outputs are poisoned with NaN before every launch; inputs are fresh random
data. Bounds (compare.tolerance): q, k, v are computed in fp32 and rounded
once to the activation dtype (roundings=1); g and beta are fp32; the new conv
state is a copy of inputs (exact).
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from compare import assert_close, finite, tolerance
from gdn_helpers import C, HK, HV, fe_params, ref_frontend

pytestmark = [pytest.mark.cuda, pytest.mark.cpu_check("gated_delta_frontend.cu"), pytest.mark.usefixtures("poison")]


# T: one token, a few, the edges of a 16- and an 8-token tile, ragged ends.
@pytest.mark.parametrize("tt", [16, 8])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("B,T", [(1, 1), (2, 2), (1, 3), (1, 7), (1, 8), (1, 9), (1, 15), (1, 16),
                                 (1, 17), (2, 65), (1, 1000)])
def test_frontend_matches_reference(B, T, dtype, tt, monkeypatch):
    from mlx_qwen_fast.kernels import gated_delta_frontend as fe
    from mlx_qwen_fast.kernels.gated_delta_frontend import gated_delta_frontend, supports

    monkeypatch.setattr(fe, "TT", tt)  # tokens per warp (kernels are keyed by it)
    w, A_log, dt_bias = fe_params(T, dtype)
    ks = mx.random.split(mx.random.key(100 + T), 4)
    qkv = mx.random.normal((B, T, C), key=ks[0]).astype(dtype)
    a = mx.random.normal((B, T, HV), key=ks[1]).astype(dtype)
    b = mx.random.normal((B, T, HV), key=ks[2]).astype(dtype)
    cs = mx.random.normal((B, 3, C), key=ks[3]).astype(dtype)
    assert supports(qkv, cs, w, num_k_heads=HK, num_v_heads=HV)
    out = gated_delta_frontend(qkv, a, b, w, cs, A_log, dt_bias, num_k_heads=HK, num_v_heads=HV)
    ref = ref_frontend(qkv, a, b, w, cs, A_log, dt_bias)
    assert finite(*out)
    for name, o, r in zip(("q", "k", "v"), out[:3], ref[:3]):
        assert o.dtype == dtype and o.shape == r.shape, name
        assert_close(o, r, tolerance(dtype, roundings=1), name)
    assert_close(out[3], ref[3], tolerance(mx.float32), "g")
    assert_close(out[4], ref[4], tolerance(mx.float32), "beta")
    assert_close(out[5], ref[5], 0.0, "conv state (exact)")


@pytest.mark.parametrize("layout", ["fp32 weight", "unaligned weight"])
def test_frontend_weight_layouts(layout):
    """The conv weight read with 16-byte loads (fp32 taps beside bf16
    activations) and with the scalar fallback (a row-contiguous view 8 bytes
    past a 16-byte boundary): both equal the reference, and the fallback is
    bit-identical to the vector path on the same values."""
    from mlx_qwen_fast.kernels.gated_delta_frontend import gated_delta_frontend

    T, dtype = 37, mx.bfloat16
    w, A_log, dt_bias = fe_params(900, dtype)
    ks = mx.random.split(mx.random.key(901), 4)
    qkv = mx.random.normal((1, T, C), key=ks[0]).astype(dtype)
    a = mx.random.normal((1, T, HV), key=ks[1]).astype(dtype)
    b = mx.random.normal((1, T, HV), key=ks[2]).astype(dtype)
    cs = mx.random.normal((1, 3, C), key=ks[3]).astype(dtype)
    kw = dict(num_k_heads=HK, num_v_heads=HV)
    if layout == "fp32 weight":
        w_test = w.astype(mx.float32)
    else:
        padded = mx.concatenate([mx.zeros((1, 4, 1), dtype), w])
        mx.eval(padded)
        w_test = padded[1:]  # a row-contiguous view 8 bytes past the buffer's start
    out = gated_delta_frontend(qkv, a, b, w_test, cs, A_log, dt_bias, **kw)
    ref = ref_frontend(qkv, a, b, w, cs, A_log, dt_bias)
    assert finite(*out)
    for name, o, r in zip(("q", "k", "v"), out[:3], ref[:3]):
        assert_close(o, r, tolerance(dtype, roundings=1), name)
    if layout == "unaligned weight":
        base = gated_delta_frontend(qkv, a, b, w, cs, A_log, dt_bias, **kw)
        for i, (o, r) in enumerate(zip(out, base)):
            assert mx.array_equal(o, r).item(), i
