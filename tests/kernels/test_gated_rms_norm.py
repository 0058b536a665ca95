"""The gated RMSNorm kernel (``kernels/gated_rms_norm.py``) vs mlx-lm's
``Qwen3NextRMSNormGated``.

Bounds (compare.tolerance): against the fp32 module, the kernel rounds where
mlx-lm rounds in the activation dtype (the normalised value, times the
weight, the output: roundings=3); against mlx-lm's module in the same dtype
both round at the same points, so a value may land one ulp apart at one of
them (roundings=1).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.qwen3_next import Qwen3NextRMSNormGated

from compare import assert_close, finite, tolerance
from gdn_helpers import D, HV

pytestmark = [pytest.mark.cuda, pytest.mark.cpu_check("gated_rms_norm.cu"), pytest.mark.usefixtures("poison")]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_gated_rms_norm_matches_mlx_lm(dtype):
    from mlx_qwen_fast.kernels.gated_rms_norm import gated_rms_norm

    ks = mx.random.split(mx.random.key(5), 3)
    y = mx.random.normal((2, 37, HV, D), key=ks[0]).astype(dtype)
    z = mx.random.normal(y.shape, key=ks[1]).astype(dtype)
    w = (1 + 0.3 * mx.random.normal((D,), key=ks[2])).astype(dtype)
    m = Qwen3NextRMSNormGated(D, eps=1e-6)
    m.weight = w
    out, ref = gated_rms_norm(y, z, w, 1e-6), m(y, z)
    assert out.dtype == dtype and finite(out)
    assert_close(out, ref, tolerance(dtype, roundings=1), "vs mlx-lm in the same dtype")
    m.weight = w.astype(mx.float32)
    ref32 = m(y.astype(mx.float32), z.astype(mx.float32))
    assert_close(out, ref32, tolerance(dtype, roundings=3), "vs mlx-lm in fp32")
