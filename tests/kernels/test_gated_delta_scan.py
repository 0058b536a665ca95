"""The prefill scan kernel (``kernels/gated_delta_scan.py``) vs the fp32
recurrence (``ops.gated_delta.gated_delta_recurrent``).

Outputs are poisoned with NaN before every launch, inputs are fresh random
data (q/k/v bf16-exact, so fp32 and bf16 kernel runs see the same numbers).
Bounds (compare.tolerance): the state is fp32 throughout; y is rounded once
to the activation dtype (roundings=1).
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from compare import assert_close, finite, tolerance
from gdn_helpers import D, HK, HV, make_scan_inputs, reference
from mlx_qwen_fast.kernels.gated_delta_scan import DEFAULT_CONFIG, ScanConfig, gated_delta_scan, supports

F32 = tolerance(mx.float32)

#: The CPU-run parameter sets (tests/cuda_check.py): the short ones.
CPU = pytest.mark.cpu_check("gated_delta_scan.cu")
EXTRA_CONFIGS = [(8, 2, 4, 32, 1, 1), (8, 2, 4, 64, 0, 1), (8, 2, 4, 32, 0, 4)]


# ---------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad, field", [
    (dict(L=0), "L"), (dict(L=3), "L"), (dict(L=8.0), "L"), (dict(R=-1), "R"),
    (dict(warps=3), "rows per block"), (dict(tb=7), "tb"), (dict(tb=4), "tb"), (dict(tb=256), "tb"),
    (dict(u=3), "u"), (dict(kqf32=5), "kqf32"),
])
def test_scan_config_rejects_bad_fields(bad, field):
    """The scan's configuration is checked where it is built (CPU), with the
    field named, instead of failing in the compiler on a GPU."""
    with pytest.raises(ValueError, match=field):
        ScanConfig(**bad)
    assert ScanConfig() == DEFAULT_CONFIG == (8, 2, 4, 32, 0, 1)
    assert ScanConfig(8, 2, 4, 64, 0, 1).rows_per_block == 32
    assert ScanConfig(16, 2, 8, 16, 1, 4).rows_per_block == 32


# ---------------------------------------------------------------------------
# kernel
# ---------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("decay", ["strong", "weak"])
@pytest.mark.parametrize("B,T", [pytest.param(1, 1, marks=CPU), pytest.param(1, 3, marks=CPU),
                                 pytest.param(2, 64, marks=CPU), pytest.param(1, 65, marks=CPU), (2, 300), (1, 4096)])
def test_scan_matches_reference(B, T, decay, dtype):
    q, k, v, g, beta, s0 = make_scan_inputs(B, T, decay, seed=T * 7 + B, dtype=dtype)
    assert supports(q, k, v, g, beta, s0)
    y, s = gated_delta_scan(q, k, v, g, beta, s0)
    yr, sr = reference(q, k, v, g, beta, s0)
    mx.eval(y, s, yr, sr)
    assert y.dtype == dtype and s.dtype == mx.float32
    assert finite(y, s)
    assert_close(s, sr, F32, "state")
    assert_close(y, yr, tolerance(dtype, roundings=1), "y")


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize(
    "config", [(8, 2, 4, 32, 1, 1), (8, 2, 4, 32, 0, 4), (8, 2, 4, 32, 1, 2), (16, 2, 8, 16, 1, 4),
               (8, 2, 4, 64, 0, 1), (8, 1, 4, 8, 0, 1)]
)
@pytest.mark.parametrize("B,T", [(2, 67), pytest.param(1, 19, marks=CPU)])
def test_scan_other_variants(config, B, T):
    q, k, v, g, beta, s0 = make_scan_inputs(B, T, "strong", seed=17, dtype=mx.float32)
    y, s = gated_delta_scan(q, k, v, g, beta, s0, config=config)
    yb, sb = gated_delta_scan(*(x.astype(mx.bfloat16) for x in (q, k, v)), g, beta, s0, config=config)
    yr, sr = reference(q, k, v, g, beta, s0)
    assert finite(y, s, yb, sb)
    assert_close(s, sr, F32, "state")
    assert_close(y, yr, F32, "y")
    assert_close(sb, sr, F32, "state (bf16 inputs)")
    assert_close(yb, yr, tolerance(mx.bfloat16, roundings=1), "y (bf16)")


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("config", [None] + EXTRA_CONFIGS)
@pytest.mark.parametrize("decay", ["mixed", "strong"])
@pytest.mark.parametrize("T", [pytest.param(7, marks=CPU), 8, 9, pytest.param(33, marks=CPU), 200])
def test_scan_extreme_gates(config, decay, T):
    """Gates of exactly 0, 1e-6 and 1e-3 among weak ones, at stage and
    8-token boundaries (fp32 bounds as everywhere)."""
    q, k, v, g, beta, s0 = make_scan_inputs(1, T, decay, seed=T * 13 + 5, dtype=mx.float32)
    y, s = gated_delta_scan(q, k, v, g, beta, s0, config=config)
    yr, sr = reference(q, k, v, g, beta, s0)
    assert finite(y, s)
    assert_close(s, sr, F32, "state")
    assert_close(y, yr, F32, "y")


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
def test_scan_carry_over_two_calls():
    q, k, v, g, beta, s0 = make_scan_inputs(2, 130, "weak", seed=3)
    ya, sa = gated_delta_scan(q[:, :67], k[:, :67], v[:, :67], g[:, :67], beta[:, :67], s0)
    yb, sb = gated_delta_scan(q[:, 67:], k[:, 67:], v[:, 67:], g[:, 67:], beta[:, 67:], sa)
    yr, sr = reference(q, k, v, g, beta, s0)
    assert_close(mx.concatenate([ya, yb], axis=1), yr, tolerance(mx.bfloat16, roundings=1), "y")
    assert_close(sb, sr, F32, "state")


@pytest.mark.cuda
@pytest.mark.cpu_check("gated_delta_scan.cu")
@pytest.mark.usefixtures("poison")
def test_scan_mask_and_zero_state():
    q, k, v, g, beta, _ = make_scan_inputs(2, 40, "strong", seed=11, dtype=mx.float32)
    mask = mx.array([[False] * 6 + [True] * 34, [True] * 40])
    y, s = gated_delta_scan(q, k, v, g, beta, None, mask)
    yr, sr = reference(q, k, v, g, beta, mx.zeros((2, HV, D, D)), mask)
    assert_close(s, sr, F32, "state")
    assert_close(y, yr, F32, "y")
    assert mx.max(mx.abs(y[0, :6])).item() == 0.0


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
def test_scan_rejects_bad_shapes():
    q, k, v, g, beta, s0 = make_scan_inputs(1, 4, "weak", seed=1)
    with pytest.raises(ValueError, match="beta"):
        gated_delta_scan(q, k, v, g, beta[:, :, :16], s0)
    with pytest.raises(ValueError, match="state"):
        gated_delta_scan(q, k, v, g, beta, s0.astype(mx.bfloat16))
    q64 = mx.zeros((1, 4, HK, 64), mx.bfloat16)
    assert not supports(q64, q64, mx.zeros((1, 4, HV, 64), mx.bfloat16), g, beta, None)
    assert not supports(q, k, v, mx.zeros((1, 4, HV, D)), beta, s0)  # vector gates
