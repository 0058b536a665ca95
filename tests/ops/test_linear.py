"""ops.linear: a decoder layer's projection at decode with its RMSNorm and
residual (contract, reference, the one dispatcher)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from compare import FP32_TOL, assert_close, tolerance
from cuda_helpers import HAS_CUDA
from mlx_qwen_fast import config
from mlx_qwen_fast.compiled import linear_arrays
from mlx_qwen_fast.ops import linear as linear_ops


def _layer(K, N, bits, gs, dtype, seed):
    mx.random.seed(seed)
    lin = nn.Linear(K, N, bias=False)
    lin.set_dtype(dtype)
    q = nn.QuantizedLinear.from_linear(lin, group_size=gs, bits=bits)
    return q, linear_arrays(q)


def _rows(M, K, dtype, seed):
    ks = mx.random.split(mx.random.key(seed), 3)
    x = (2.0 * mx.random.normal((M, 1, K), key=ks[0])).astype(dtype)
    nw = (1.0 + 0.1 * mx.random.normal((K,), key=ks[1])).astype(dtype)
    return x, nw, ks[2]


@pytest.mark.parametrize("bits,gs", [(4, 64), (8, 64), (4, 32)])
@pytest.mark.parametrize("M", [1, 3])
def test_reference_is_the_stock_ops(bits, gs, M):
    """fp32: the reference equals the module calls it stands for
    (``rms_norm``, the layer, ``+``), and hands back the normalised rows."""
    q, (arrays, static) = _layer(256, 48, bits, gs, mx.float32, bits + M)
    x, nw, k = _rows(M, 256, mx.float32, M)
    res = mx.random.normal((M, 1, 48), key=k)
    xin = mx.fast.rms_norm(x, nw, 1e-6)
    out, got_x = linear_ops.decode_linear_reference(x, arrays, static, norm=(nw, 1e-6), residual=res,
                                                    normed_out=True)
    assert_close(out, res + q(xin), FP32_TOL, "out")
    assert_close(got_x, xin, 0.0, "normalised rows")
    assert_close(linear_ops.decode_linear_reference(x, arrays, static), q(x), 0.0, "plain")
    with pytest.raises(ValueError, match="normed_out"):
        linear_ops.decode_linear_reference(x, arrays, static, normed_out=True)


def test_dispatch_off_cuda_and_declined_layers():
    """The reference where the kernel does not apply: another backend, fp32
    activations, a dense or biased layer, the switch off."""
    q, (arrays, static) = _layer(128, 32, 4, 64, mx.bfloat16, 0)
    x, nw, _ = _rows(1, 128, mx.bfloat16, 0)
    assert linear_ops.decode_implementation(x, arrays, static, backend="cpu") == "reference"
    assert linear_ops.decode_implementation(x.astype(mx.float32), arrays, static) == "reference"
    dense = nn.Linear(128, 32)
    d_arrays, d_static = linear_arrays(dense)
    assert linear_ops.decode_implementation(x, d_arrays, d_static, backend="cuda") == "reference"
    out = linear_ops.decode_linear(x, arrays, static, norm=(nw, 1e-6))
    if not HAS_CUDA:
        assert_close(out, q(mx.fast.rms_norm(x, nw, 1e-6)), 0.0, "the reference on this backend")


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("bits", [4, 8])
def test_cuda_kernel_within_bf16_of_stock(env, bits):
    """bf16 on CUDA: the fused kernel runs (4 and 8 bits), and its result is
    within bf16 rounding of the stock ops; with the switch off the dispatcher
    runs the stock ops themselves."""
    q, (arrays, static) = _layer(2048, 512, bits, 64, mx.bfloat16, bits)
    x, nw, k = _rows(2, 2048, mx.bfloat16, bits)
    res = mx.random.normal((2, 1, 512), key=k).astype(mx.bfloat16)
    assert linear_ops.decode_implementation(x, arrays, static, norm=(nw, 1e-6), residual=res) == "cuda-kernel"
    out = linear_ops.decode_linear(x, arrays, static, norm=(nw, 1e-6), residual=res)
    ref = res + q(mx.fast.rms_norm(x, nw, 1e-6))
    # the kernel and the stock matmul each round the GEMV's result and the
    # sum once, from fp32 sums in different orders (and stock's CUDA
    # quantized matmul may keep the dequantised weights unrounded): 4 roundings apart
    assert_close(out, ref, tolerance(mx.bfloat16, 4), "kernel vs stock ops")
    env.set(config.DECODE_GEMV_KERNEL.name, "0")
    assert linear_ops.decode_implementation(x, arrays, static) == "reference"
    off = linear_ops.decode_linear(x, arrays, static, norm=(nw, 1e-6), residual=res)
    assert_close(off, ref, 0.0, "switch off: the stock ops")
    assert np.isfinite(np.asarray(out.astype(mx.float32))).all()


# ---------------------------------------------------------------------------
# the residual add with the next RMSNorm


def _add_norm_inputs(shape, dtype, seed):
    ks = mx.random.split(mx.random.key(seed), 3)
    x = (2.0 * mx.random.normal(shape, key=ks[0])).astype(dtype)
    y = mx.random.normal(shape, key=ks[1]).astype(dtype)
    w = (1.0 + 0.3 * mx.random.normal((shape[-1],), key=ks[2])).astype(dtype)
    return x, y, w


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_add_rms_norm_reference_is_the_stock_ops(env, dtype):
    """The reference, and the dispatcher off Metal or with the Metal switch
    off (its default), are the decoder layer's two ops (the add,
    ``mx.fast.rms_norm``), bit for bit."""
    env.unset(config.METAL_KERNELS.name)
    x, y, w = _add_norm_inputs((3, 1, 256), dtype, 1)
    h, normed = linear_ops.add_rms_norm_reference(x, y, w, 1e-6)
    assert_close(h, x + y, 0.0, "h")
    assert_close(normed, mx.fast.rms_norm(x + y, w, 1e-6), 0.0, "normed")
    for b in ("cpu", "cuda", "metal"):
        assert linear_ops.add_rms_norm_implementation(x, y, w, backend=b) == "reference"
    got = linear_ops.add_rms_norm(x, y, w, 1e-6)
    assert_close(got[0], h, 0.0, "dispatched h")
    assert_close(got[1], normed, 0.0, "dispatched normed")


def test_add_rms_norm_on_metal_takes_the_kernel(env, monkeypatch):
    """Metal, simulated (``tests/metal_check.py``: MLX's generated source run
    on the CPU, Metal seen as available): the kernel only with
    ``MLX_QWEN_FAST_METAL`` on and on the Metal backend, for rows it takes
    (D up to its MAX_D); the dispatcher's call runs it once and agrees with
    the reference (h bit for bit, fp32 normed rows within FP32_TOL); the
    report's decode projections name it."""
    import metal_check as mc
    from mlx_qwen_fast import backend, op_implementations
    from mlx_qwen_fast.kernels import add_rms_norm_metal as arn

    if mc.CXX is None:
        pytest.skip("no C++ compiler (g++) to build the Metal sources")
    x, y, w = _add_norm_inputs((2, 1, 2048), mx.float32, 2)
    big = mx.zeros((1, arn.MAX_D + 1))
    with mc.simulated_modules(arn.__name__) as (m,):
        assert linear_ops.add_rms_norm_implementation(x, y, w, backend="metal") == "reference"
        assert linear_ops.implementation_for(1, "metal") == "reference"
        env.set(config.METAL_KERNELS.name, "1")
        assert linear_ops.add_rms_norm_implementation(x, y, w, backend="metal") == "metal-kernel"
        assert linear_ops.implementation_for(1, "metal") == "metal-kernel"
        assert op_implementations("metal")["linear.decode"] == "compiled-layer+metal-kernel"
        assert linear_ops.add_rms_norm_implementation(x, y, w, backend="cpu") == "reference"
        assert linear_ops.add_rms_norm_implementation(big, big, mx.ones((arn.MAX_D + 1,)),
                                                      backend="metal") == "reference"
        monkeypatch.setattr(backend, "current", lambda: backend.METAL)
        h, normed = linear_ops.add_rms_norm(x, y, w, 1e-6)
        mx.eval(h, normed)
        assert m._kernel().calls == 1
        ref_h, ref_n = linear_ops.add_rms_norm_reference(x, y, w, 1e-6)
        assert_close(h, ref_h, 0.0, "h")
        assert_close(normed, ref_n, FP32_TOL, "normed")
        env.set(config.METAL_KERNELS.name, "0")
        mx.eval(linear_ops.add_rms_norm(x, y, w, 1e-6))
        assert m._kernel().calls == 1
    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    env.set(config.METAL_KERNELS.name, "1")
    assert linear_ops.implementation_for(1, "metal") == "reference"  # no Metal device: what would run here
