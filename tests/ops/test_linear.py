"""ops.linear: a decoder layer's projection at decode with its RMSNorm and
residual (contract, reference, the one dispatcher)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from compare import FP32_TOL, assert_close, rel_err, tolerance
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


# ---------------------------------------------------------------------------
# prefill: a projection of many rows


def test_prefill_reference_is_the_module_call_and_errors_name_arguments():
    q, _ = _layer(256, 64, 4, 64, mx.float32, 3)
    x = mx.random.normal((2, 5, 256), key=mx.random.key(4))
    assert_close(linear_ops.prefill_linear_reference(q, x), q(x), 0.0, "reference")
    assert_close(linear_ops.prefill_linear(q, x), q(x), 0.0, "off CUDA: the module's call")
    with pytest.raises(ValueError, match=r"prefill_linear: x must be \[\.\.\., 256\]"):
        linear_ops.prefill_linear(q, mx.zeros((3, 128)))
    with pytest.raises(ValueError, match="prefill_linear: x must be a float32"):
        linear_ops.prefill_linear(q, mx.zeros((3, 256), mx.int32))
    with pytest.raises(ValueError, match="prefill_linear_reference: layer must be a module"):
        linear_ops.prefill_linear_reference(3, x)
    # another callable module (an adapter around a projection) runs its own call
    wrapped = nn.Sequential(q)
    assert_close(linear_ops.prefill_linear(wrapped, x), q(x), 0.0, "a wrapper's own call")


@pytest.mark.parametrize("shape", [(0, 256), (1, 0, 256), (0, 1, 256)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_no_rows(shape, dtype):
    """Inputs without rows (MLX's quantised matmul takes none: it divides by
    zero): every entry returns an empty ``[..., N]`` of the dtype of the
    layer's call on one row, and a row count the module's call gives (the
    dense layer's own call)."""
    q, (arrays, static) = _layer(256, 48, 4, 64, dtype, 3)
    x = mx.zeros(shape, dtype)
    want = (*shape[:-1], 48)
    one = q(mx.zeros((1, 256), dtype))
    for name, got in (("prefill_linear", linear_ops.prefill_linear(q, x)),
                      ("prefill_linear_reference", linear_ops.prefill_linear_reference(q, x)),
                      ("decode_linear", linear_ops.decode_linear(x, arrays, static)),
                      ("decode_linear_reference", linear_ops.decode_linear_reference(x, arrays, static))):
        mx.eval(got)
        assert got.shape == want and got.dtype == one.dtype, (name, got.shape, got.dtype)
    dense = nn.Linear(256, 48)
    dense.set_dtype(dtype)
    got = linear_ops.prefill_linear(dense, x)
    assert got.shape == dense(x).shape == want


def test_prefill_dispatch(env):
    """The kernel only on CUDA, with the switch on, from PREFILL_GEMM_MIN_ROWS
    rows and PREFILL_GEMM_MIN_FEATURES outputs, for bf16 rows and 4-bit
    group-64 affine layers without a bias."""
    import cuda_check

    feats = linear_ops.PREFILL_GEMM_MIN_FEATURES
    q, _ = _layer(256, feats, 4, 64, mx.bfloat16, 5)
    rows = linear_ops.PREFILL_GEMM_MIN_ROWS
    x = mx.zeros((1, rows, 256), mx.bfloat16)
    assert linear_ops.prefill_implementation(q, x, backend="cpu") == "reference"
    with cuda_check.simulated():
        env.set(config.PREFILL_GEMM_KERNEL.name, "0")
        assert linear_ops.prefill_implementation(q, x) == "reference"
        assert linear_ops.prefill_implementation_for(rows, "cuda") == "stock"
        env.set(config.PREFILL_GEMM_KERNEL.name, "1")
        assert linear_ops.prefill_implementation_for(rows, "cuda") == "cuda-kernel"
        assert linear_ops.prefill_implementation_for(rows - 1, "cuda") == "stock"
        assert linear_ops.prefill_implementation(q, x) == "cuda-kernel"
        assert linear_ops.prefill_implementation(q, x[:, 1:]) == "reference"  # too few rows
        narrow, _ = _layer(256, feats - 256, 4, 64, mx.bfloat16, 6)
        assert linear_ops.prefill_implementation(narrow, x) == "reference"  # too few outputs
        assert linear_ops.prefill_implementation(q, x.astype(mx.float32)) == "reference"
        for bits, gs in ((8, 64), (4, 32)):
            other, _ = _layer(256, feats, bits, gs, mx.bfloat16, 6)
            assert linear_ops.prefill_implementation(other, x) == "reference"
        biased = nn.QuantizedLinear(256, feats, bias=True, group_size=64, bits=4)
        assert linear_ops.prefill_implementation(biased, x) == "reference"
        assert linear_ops.prefill_implementation(nn.Linear(256, 256), x) == "reference"


@pytest.mark.cuda
@pytest.mark.cpu_check("moe_grouped_gemm_wgmma.cu")
@pytest.mark.usefixtures("poison")
def test_prefill_kernel_within_bf16_of_the_module(env, monkeypatch):
    """With the switch on, a chunk's projection runs the GEMM kernel and
    agrees with the module's own call (MLX's quantized matmul) to bf16
    rounding; off, it is that call. (A small chunk: the dispatch's size
    thresholds lowered, which only decide speed.)"""
    monkeypatch.setattr(linear_ops, "PREFILL_GEMM_MIN_ROWS", 128)
    monkeypatch.setattr(linear_ops, "PREFILL_GEMM_MIN_FEATURES", 512)
    q, _ = _layer(384, 512, 4, 64, mx.bfloat16, 7)
    x = mx.random.normal((1, 130, 384), key=mx.random.key(8)).astype(mx.bfloat16)
    env.set(config.PREFILL_GEMM_KERNEL.name, "1")
    assert linear_ops.prefill_implementation(q, x) == "cuda-kernel"
    out = linear_ops.prefill_linear(q, x)
    assert out.shape == (1, 130, 512) and out.dtype == mx.bfloat16
    assert np.isfinite(np.asarray(out.astype(mx.float32))).all()
    # fp32 product on the weights as the kernel dequantises them (bf16(s * q + b), one rounding)
    w = mx.dequantize(q.weight, q.scales.astype(mx.float32), q.biases.astype(mx.float32), group_size=64, bits=4)
    exact = x.astype(mx.float32) @ w.astype(mx.bfloat16).astype(mx.float32).T
    # the result's rounding and a flipped one (fp32 sums in another order)
    assert_close(out, exact, tolerance(mx.bfloat16, 2), "kernel vs fp32")
    ref = q(x)
    # the module (MLX's quantized matmul) to its own accuracy: on the CPU it
    # rounds the dequantised weights twice and is further from fp32 than bf16
    assert_close(out, ref, rel_err(ref, exact) + tolerance(mx.bfloat16, 2), "kernel vs the module")
    env.set(config.PREFILL_GEMM_KERNEL.name, "0")
    assert_close(linear_ops.prefill_linear(q, x), ref, 0.0, "switch off: the module's call")
