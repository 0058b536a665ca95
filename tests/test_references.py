"""The numpy host references of the kernel tests (``references.py``) against
MLX's own ops: they must be right before anything is checked against them."""

import mlx.core as mx
import numpy as np
import pytest

import moe_blocks
from compare import assert_close, npa, tolerance
from moe_blocks import x_tokens
from references import (bf16_round, bf16_round_f64, decode_gemv_reference, dequant_f32, moe_decode_reference,
                        unpack_affine_4bit)
from mlx_qwen_fast.ops import moe


def test_bf16_round_is_mlx_cast():
    """Round to nearest, ties to even: MLX's own float32 -> bfloat16 cast."""
    rng = np.random.default_rng()
    x = (rng.standard_normal(4096) * np.exp2(rng.integers(-20, 20, 4096))).astype(np.float32)
    ties = (np.arange(64, dtype=np.uint32) << np.uint32(16) | np.uint32(0x8000)) + np.uint32(0x3F800000)
    x = np.concatenate([x, ties.view(np.float32)])
    want = np.asarray(mx.array(x).astype(mx.bfloat16).astype(mx.float32))
    assert np.array_equal(bf16_round(x), want)


@pytest.mark.parametrize("K", [64, 192, 320, 2048])
def test_unpack_matches_mx_dequantize(K):
    w = (mx.random.normal((4, 64, K), key=mx.random.key(K)) * 3).astype(mx.bfloat16)
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    # MLX's CPU dequantize rounds twice, bf16(bf16(s * q) + b); its CUDA
    # backend rounds once (measured on the H200, 2026-12-01), so the
    # bit-exact reference is taken on the CPU stream.
    ref = npa(mx.dequantize(wq, s, b, group_size=64, bits=4, stream=mx.cpu))
    got = unpack_affine_4bit(wq, s, b)
    assert got.shape == ref.shape
    assert np.array_equal(got, ref)  # bit-exact, low nibble first
    # the other nibble order is clearly wrong (guards the test itself)
    wn = np.asarray(wq).astype(np.uint32)
    swapped = ((wn & 0x0F0F0F0F) << 4) | ((wn >> 4) & 0x0F0F0F0F)
    assert not np.array_equal(unpack_affine_4bit(swapped, s, b), ref)


def _bf16_once_f64(v):
    """float64 -> nearest bf16 (8 significant bits, ties to even), as float64."""
    m, e = np.frexp(np.asarray(v, dtype=np.float64))  # v = m * 2**e, 0.5 <= |m| < 1
    return np.ldexp(np.round(m * 256.0), e - 8)  # np.round: half to even


@pytest.mark.parametrize("K", [64, 320, 2048])
def test_unpack_once_rounding(K):
    """rounding="once" (the kernels): bf16(s*q + b) from the exact value."""
    w = (mx.random.normal((4, 64, K), key=mx.random.key(K + 1)) * 3).astype(mx.bfloat16)
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    got = unpack_affine_4bit(wq, s, b, rounding="once")
    wn = np.asarray(wq).astype(np.uint64)
    q = np.stack([(wn >> np.uint64(4 * j)) & np.uint64(15) for j in range(8)], -1)
    q = q.reshape(*wn.shape[:-1], K).astype(np.float64)
    s64 = np.repeat(npa(s).astype(np.float64), 64, axis=-1)
    b64 = np.repeat(npa(b).astype(np.float64), 64, axis=-1)
    ref = _bf16_once_f64(s64 * q + b64)
    assert got.dtype == np.float32 and got.shape == ref.shape
    assert np.array_equal(got.astype(np.float64), ref)
    # the two roundings differ somewhere (guards the test itself), by at most
    # half an ulp of bf16(s*q) (the extra rounding) plus one ulp of the result
    twice = unpack_affine_4bit(wq, s, b, rounding="twice").astype(np.float64)
    if K >= 320:
        assert not np.array_equal(got, twice)
    assert np.all(np.abs(ref - twice) <= np.abs(s64 * q) * 2.0**-8 + np.abs(ref) * 2.0**-7)
    with pytest.raises(ValueError, match="rounding"):
        unpack_affine_4bit(wq, s, b, rounding="thrice")


@pytest.mark.cuda
def test_unpack_once_matches_cuda_dequantize():
    w = (mx.random.normal((4, 64, 2048), key=mx.random.key(5)) * 3).astype(mx.bfloat16)
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    ref = npa(mx.dequantize(wq, s, b, group_size=64, bits=4))  # GPU stream
    assert np.array_equal(unpack_affine_4bit(wq, s, b, rounding="once"), ref)


def test_dequant_f32_matches_mx_dequantize():
    for bits in (4, 8):
        w = mx.random.normal((3, 64, 256), key=mx.random.key(bits))
        wq, s, b = mx.quantize(w, group_size=64, bits=bits)  # fp32 scales
        ref = np.asarray(mx.dequantize(wq, s, b, group_size=64, bits=bits, stream=mx.cpu))
        np.testing.assert_allclose(dequant_f32(wq, s, b, bits=bits), ref, rtol=1e-6, atol=1e-6)


def test_moe_decode_reference_matches_fp32_ops():
    """The decode reference, with the block's bf16 arrays, is fp32 math up to
    bf16 rounding points (gate, up, SwiGLU and down outputs rounded:
    roundings=2, as for the kernels)."""
    block = moe_blocks.make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16)
    arrs = moe.decode_arrays(block)
    assert arrs is not None and arrs[2][3] == 8
    x = x_tokens(3, 256, 5)
    inds, scores = moe.route(block.gate(x), 8)
    h, sgate, y = moe_decode_reference(x, inds, scores, *arrs)
    block.set_dtype(mx.float32)  # same values, fp32 math in the ops path
    xf = x.astype(mx.float32)
    sm = block.switch_mlp
    groups = moe.group_by_expert(inds, 32)
    ref = moe.combine(moe.expert_swiglu(xf, groups, sm.gate_proj, sm.up_proj, sm.down_proj), scores)
    ref = ref + moe.shared_expert(block, xf)
    assert_close(y, ref, tolerance(mx.bfloat16, roundings=2), "y")
    sg = mx.sigmoid(block.shared_expert_gate(xf))[:, 0]
    np.testing.assert_allclose(sgate, npa(sg), atol=4e-3)
    # float32 activations: nothing rounded, fp32 math to fp32 rounding
    h32, sgate32, y32 = moe_decode_reference(xf, inds, scores, *arrs, dtype=mx.float32)
    assert_close(y32, ref, tolerance(mx.float32), "y (float32)")
    assert_close(sgate32, sg, tolerance(mx.float32), "sgate (float32)")
    assert not np.array_equal(y32, y)
    with pytest.raises(ValueError, match="dtype must be bfloat16 or float32"):
        moe_decode_reference(xf, inds, scores, *arrs, dtype=mx.float16)


def test_decode_gemv_reference_matches_mlx_ops():
    """The decode GEMV's float64 reference: its normalised rows are MLX's
    bf16 ``rms_norm`` bit for bit, and its output is the float64 product of
    those rows with the weights dequantised once to bf16
    (``unpack_affine_4bit(rounding="once")``), rounded to bf16, plus the
    residual, rounded again."""
    M, K, N = 3, 256, 48
    ks = mx.random.split(mx.random.key(5), 4)
    w, s, b = mx.quantize((0.05 * mx.random.normal((N, K), key=ks[0])).astype(mx.bfloat16), group_size=64, bits=4)
    x = (3.0 * mx.random.normal((M, K), key=ks[1])).astype(mx.bfloat16)
    nw = (1.0 + 0.2 * mx.random.normal((K,), key=ks[2])).astype(mx.bfloat16)
    res = mx.random.normal((M, N), key=ks[3]).astype(mx.bfloat16)
    out, xin = decode_gemv_reference(x, w, s, b, 4, 64, nw, 1e-6, res)
    assert np.array_equal(xin, npa(mx.fast.rms_norm(x, nw, 1e-6)).astype(np.float64))
    W = unpack_affine_4bit(w, s, b, 64, rounding="once").astype(np.float64)
    want = bf16_round_f64(npa(res).astype(np.float64) + bf16_round_f64(xin @ W.T).astype(np.float64))
    assert np.array_equal(out, want.astype(np.float64))
    plain, _ = decode_gemv_reference(x, w, s, b, 4, 64)
    assert np.array_equal(plain, bf16_round_f64(npa(x).astype(np.float64) @ W.T).astype(np.float64))
