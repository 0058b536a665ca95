"""The decode quantised GEMV (``kernels/quantized_gemv.py``: RMSNorm, 4/8-bit
GEMV and residual add in one launch).

The argument checks and the warp policy run on any backend; the kernel
against a float64 reference on CUDA, outputs poisoned with NaN before every
launch, inputs fresh random data.

Bounds (compare.tolerance): the reference rounds where the kernel rounds
(the RMSNorm's normalised value and its product with the weight, each
weight dequantised to bf16(s * q + b), the GEMV's result, the residual
add), everything else in float64. A value next to a rounding boundary can
round the other way in the kernel (fp32 sums in another order): once per
rounding point on the path of a result, so 1 for the GEMV, 2 with the
residual, 2 for the normalised rows.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from compare import assert_close, finite, tolerance
from references import decode_gemv_reference as reference
from mlx_qwen_fast.kernels import quantized_gemv as qg


def _inputs(M, K, N, bits, gs, seed, norm_dtype=mx.bfloat16):
    ks = mx.random.split(mx.random.key(seed), 5)
    W = (0.05 * mx.random.normal((N, K), key=ks[0])).astype(mx.bfloat16)
    w, scales, biases = mx.quantize(W, group_size=gs, bits=bits)
    x = (3.0 * mx.random.normal((M, K), key=ks[1])).astype(mx.bfloat16)
    nw = (1.0 + 0.2 * mx.random.normal((K,), key=ks[2])).astype(norm_dtype)
    res = mx.random.normal((M, N), key=ks[3]).astype(mx.bfloat16)
    return x, w, scales, biases, nw, res


# ---------------------------------------------------------------------------
# host side (any backend)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("K,bits", [(64, 4), (2048, 4), (4096, 4), (2048, 8), (4096, 8), (65536, 4)])
def test_warps_split_k(K, bits):
    """1 to 16 warps; each holds at most four 128-input blocks up to K =
    8192 (4-bit) / 4096 (8-bit), and every block belongs to a warp."""
    nw = qg.warps(K, bits)
    blocks = -(-K // 128)
    assert 1 <= nw <= 16 and nw * -(-blocks // nw) >= blocks
    if K <= (8192 if bits == 4 else 4096):
        assert -(-blocks // nw) <= 4


def test_bad_input_names_the_argument():
    x, w, s, b, nw, res = _inputs(2, 256, 40, 4, 64, 0)
    kw = dict(group_size=64, bits=4)
    cases = [
        ((x.astype(mx.float32), w, s, b), {}, "x"),
        ((mx.zeros((5, 256), mx.bfloat16), w, s, b), {}, "x"),
        ((x[:, :200], w, s, b), {}, "x"),
        ((x, w[:, :16], s, b), {}, "w"),
        ((x, w.astype(mx.int32), s, b), {}, "w"),
        ((x, w, s[:, :2], b), {}, "scales"),
        ((x, w, s, b.astype(mx.float32)), {}, "biases"),
        ((x, w, s, b), dict(norm_weight=nw[:128], norm_eps=1e-6), "norm_weight"),
        ((x, w, s, b), dict(norm_weight=nw, norm_eps=0.0), "norm_eps"),
        ((x, w, s, b), dict(norm_weight=nw), "norm_eps"),
        ((x, w, s, b), dict(residual=res[:, :8]), "residual"),
        ((x, w, s, b), dict(residual=res.astype(mx.float32)), "residual"),
        ((x, w, s, b), dict(normed_out=True), "normed_out"),
        ((x, np.zeros((40, 32), np.uint32), s, b), {}, "w"),
    ]
    for args, extra, name in cases:
        with pytest.raises(ValueError, match=name):
            qg.quantized_gemv(*args, **kw, **extra)
    with pytest.raises(ValueError, match="bits"):
        qg.quantized_gemv(x, w, s, b, group_size=64, bits=3)
    with pytest.raises(ValueError, match="group_size"):
        qg.quantized_gemv(x, w, s, b, group_size=48, bits=4)


def test_supports():
    x, w, s, b, nw, res = _inputs(1, 256, 32, 4, 64, 1)
    from mlx_qwen_fast.kernels import _cuda_build

    kw = dict(group_size=64, bits=4)
    assert qg.supports(x, w, s, b, **kw) == _cuda_build.cuda_available()
    assert not qg.supports(x, w, s, b, group_size=64, bits=4, mode="mxfp4")
    assert not qg.supports(x.astype(mx.float16), w, s, b, **kw)
    assert not qg.supports(mx.zeros((5, 256), mx.bfloat16), w, s, b, **kw)
    assert not qg.supports(x, w, s, b, **kw, residual=res[:, :4])
    assert not qg.supports(x, w, s, b, **kw, norm_weight=[1.0])


# ---------------------------------------------------------------------------
# the kernel (CUDA)
# ---------------------------------------------------------------------------

CASES = [
    # M, K, N, bits, group, norm, residual, normed out, norm weight dtype
    (1, 2048, 12352, 4, 64, True, False, False, mx.bfloat16),  # GDN input projection
    (1, 4096, 2048, 4, 64, False, True, False, mx.bfloat16),  # out_proj / o_proj with the residual
    (1, 2048, 256, 8, 64, True, False, True, mx.bfloat16),  # the router, handing on the normed rows
    (4, 2048, 9216, 4, 64, True, False, False, mx.float32),  # q|k|v at batch 4, fp32 norm weight
    (2, 960, 40, 4, 32, True, True, True, mx.bfloat16),  # K % 128 = 64, N % 16 != 0
    (3, 192, 17, 8, 64, False, True, False, mx.bfloat16),  # 1.5 blocks of 128 inputs
    (1, 64, 1, 4, 64, True, True, True, mx.bfloat16),  # one output, half a block
    (2, 4096, 100, 8, 128, True, True, True, mx.bfloat16),  # 16 warps
]


@pytest.mark.cuda
@pytest.mark.cpu_check("quantized_gemv.cu")
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("M,K,N,bits,gs,norm,res,xn,ndt", CASES)
def test_kernel_matches_reference(M, K, N, bits, gs, norm, res, xn, ndt):
    x, w, s, b, nw, r = _inputs(M, K, N, bits, gs, seed=K + N + M, norm_dtype=ndt)
    kw = dict(group_size=gs, bits=bits, norm_weight=nw if norm else None, norm_eps=1e-6 if norm else None,
              residual=r if res else None, normed_out=xn)
    got = qg.quantized_gemv(x, w, s, b, **kw)
    out, xin = got if xn else (got, None)
    mx.eval(out, xin) if xn else mx.eval(out)
    assert out.shape == (M, N) and out.dtype == mx.bfloat16 and finite(out)
    ref, ref_x = reference(x, w, s, b, bits, gs, nw if norm else None, 1e-6, r if res else None)
    assert_close(out, ref, tolerance(mx.bfloat16, 2 if res else 1), "out")
    if xn:
        assert xin.shape == (M, K) and finite(xin)
        assert_close(xin, ref_x, tolerance(mx.bfloat16, 2), "normalised rows")


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
def test_leading_axes_and_compile():
    """[B, 1, K] rows (the decoder's shape) give [B, 1, N]; inside
    mx.compile the same values as eager."""
    x, w, s, b, nw, r = _inputs(2, 2048, 300, 4, 64, 7)
    x3, r3 = x.reshape(2, 1, 2048), r.reshape(2, 1, 300)
    kw = dict(group_size=64, bits=4, norm_weight=nw, norm_eps=1e-5, residual=r3)
    eager = qg.quantized_gemv(x3, w, s, b, **kw)
    traced = mx.compile(lambda *a: qg.quantized_gemv(*a, **kw))(x3, w, s, b)
    mx.eval(eager, traced)
    assert eager.shape == (2, 1, 300)
    assert_close(traced, eager, 0.0, "compiled vs eager")
    ref, _ = reference(x, w, s, b, 4, 64, nw, 1e-5, r)
    assert_close(eager.reshape(2, 300), ref, tolerance(mx.bfloat16, 2), "out")
