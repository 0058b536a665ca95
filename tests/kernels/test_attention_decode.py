"""The gated-attention decode kernels (``kernels/attention_decode.py``: q/k
RMSNorm + RoPE, the cache write, split-K attention over the cache and the
sigmoid gate, for head_dim 256).

The argument checks and the split policy run on any backend; the kernels
against a float64 reference on CUDA, outputs poisoned with NaN before every
launch, inputs fresh random data.

Bounds (compare.tolerance): the reference rounds where the kernel rounds
(the RMSNorm's normalised value and its product with the weight, RoPE's
result, the attention output before the gate, the result), everything else
in float64; RoPE's angle is taken in fp32 as MLX's ``fast.rope`` takes it.
A value near a rounding boundary can round one way in the kernel and the
other in the reference, once per rounding point on the path: the new key
has 3 (norm twice, RoPE), the output 5 (the query's 3, the attention
output, the result); fp32 results: FP32_TOL (tolerance's fp32 case).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from compare import assert_close, finite, npa, tolerance
from mlx_qwen_fast.kernels import attention_decode as ad
from mlx_qwen_fast.kernels.attention_contract import DH, proj_width


def _round(a: np.ndarray, dtype) -> np.ndarray:
    """``a`` as ``dtype`` holds it (round to nearest even), back in float64."""
    return npa(mx.array(np.asarray(a, np.float32)).astype(dtype)).astype(np.float64)


def _rope(x, off, dims, traditional, base, scale, dtype):
    """MLX's fast.rope on the last axis of ``x`` (float64 values of ``dtype``)."""
    half = dims // 2
    i = np.arange(half, dtype=np.float32)
    inv = np.exp2(-(i / np.float32(half)) * np.float32(math.log2(base))).astype(np.float32)
    theta = (np.float32(scale) * np.float32(off) * inv).astype(np.float32).astype(np.float64)
    c, s = np.cos(theta), np.sin(theta)
    d1 = 2 * np.arange(half) if traditional else np.arange(half)
    d2 = d1 + 1 if traditional else d1 + half
    x1, x2 = x[..., d1], x[..., d2]
    out = x.copy()
    out[..., d1] = _round(x1 * c - x2 * s, dtype)
    out[..., d2] = _round(x1 * s + x2 * c, dtype)
    return out


def _norm(x, w, eps, dtype):
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return _round(w * _round(x * r, dtype), dtype)


def reference(proj, keys, values, off, qw, kw, *, hq, hkv, scale, eps, rope_dims, traditional, base, rscale):
    """float64 ``(out [B, 1, Hq*DH], keys, values)`` with the kernel's rounding points."""
    dtype = proj.dtype
    p = npa(proj)[:, 0].astype(np.float64)
    B = p.shape[0]
    K, V = npa(keys).astype(np.float64).copy(), npa(values).astype(np.float64).copy()
    qw, kw = npa(qw).astype(np.float64), npa(kw).astype(np.float64)
    qg = p[:, :2 * hq * DH].reshape(B, hq, 2, DH)
    query, gate = qg[:, :, 0], qg[:, :, 1]
    k = p[:, 2 * hq * DH:2 * hq * DH + hkv * DH].reshape(B, hkv, DH)
    v = p[:, 2 * hq * DH + hkv * DH:].reshape(B, hkv, DH)
    rope = dict(dims=rope_dims, traditional=traditional, base=base, scale=rscale, dtype=dtype)
    q = _rope(_norm(query, qw, eps, dtype), off, **rope)
    kn = _rope(_norm(k, kw, eps, dtype), off, **rope)
    K[:, :, off], V[:, :, off] = kn, v
    g = hq // hkv
    out = np.zeros((B, hq, DH))
    for b in range(B):
        for h in range(hq):
            s = scale * (K[b, h // g, :off + 1] @ q[b, h])
            e = np.exp(s - s.max())
            out[b, h] = _round((e / e.sum()) @ V[b, h // g, :off + 1], dtype)
    out = out / (1.0 + np.exp(-gate))
    return out.reshape(B, 1, hq * DH), K, V


def _inputs(B, hq, hkv, cap, dtype, wdtype, seed):
    ks = mx.random.split(mx.random.key(seed), 5)
    proj = (2.0 * mx.random.normal((B, 1, proj_width(hq, hkv)), key=ks[0])).astype(dtype)
    keys = mx.random.normal((B, hkv, cap, DH), key=ks[1]).astype(dtype)
    values = mx.random.normal((B, hkv, cap, DH), key=ks[2]).astype(dtype)
    qw = (1.0 + 0.3 * mx.random.normal((DH,), key=ks[3])).astype(wdtype)
    kw = (1.0 + 0.3 * mx.random.normal((DH,), key=ks[4])).astype(wdtype)
    return proj, keys, values, qw, kw


# ---------------------------------------------------------------------------
# host side (any backend)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("cap", [1, 63, 64, 65, 256, 300, 4096, 131072])
@pytest.mark.parametrize("B,hkv", [(1, 2), (4, 2), (1, 8), (64, 8)])
def test_splits_cover_the_cache(cap, B, hkv):
    """Every position in exactly one split; at least MIN_SPLIT positions per
    split where the cache has them; at most MAX_BLOCKS blocks (or one split)."""
    ns, length = ad.splits(cap, B, hkv)
    assert ns >= 1 and ns * length >= cap > (ns - 1) * length
    assert length >= min(cap, ad.MIN_SPLIT)
    assert ns == 1 or B * hkv * ns <= ad.MAX_BLOCKS


def test_bad_input_names_the_argument():
    proj, keys, values, qw, kw = _inputs(1, 16, 2, 8, mx.float32, mx.float32, 0)
    off = mx.array(3, mx.int32)
    kw_ = dict(num_heads=16, num_kv_heads=2, scale=DH ** -0.5, q_eps=1e-6, k_eps=1e-6, rope_dims=64,
               rope_base=1e7)
    good = (proj, keys, values, off, qw, kw)
    cases = [
        ((proj[..., 1:],) + good[1:], "proj"),
        ((proj.reshape(1, -1),) + good[1:], "proj"),
        ((proj.astype(mx.int32),) + good[1:], "proj"),
        ((proj, keys[..., :128], values, off, qw, kw), "keys"),
        ((proj, keys.astype(mx.bfloat16), values, off, qw, kw), "keys"),
        ((proj, keys, values[:, :, :4], off, qw, kw), "values"),
        ((proj, keys, values, mx.array([3], mx.int32), qw, kw), "offset"),
        ((proj, keys, values, mx.array(3.0), qw, kw), "offset"),
        ((proj, keys, values, 3, qw, kw), "offset"),
        ((proj, keys, values, off, qw[:64], kw), "q_norm_weight"),
        ((proj, keys, values, off, qw, kw.astype(mx.bfloat16)), "k_norm_weight"),
        ((proj, keys, values, off, qw, None), "k_norm_weight"),
    ]
    for args, name in cases:
        with pytest.raises(ValueError, match=name):
            ad.attention_decode(*args, **kw_)
    for change, name in ((dict(num_kv_heads=3), "num_heads"), (dict(q_eps=0.0), "q_eps"),
                         (dict(rope_dims=63), "rope_dims"), (dict(scale=-1.0), "scale"),
                         (dict(rope_base=float("inf")), "rope_base")):
        with pytest.raises(ValueError, match=name):
            ad.attention_decode(*good, **{**kw_, **change})


def test_supports_only_cuda_head_dim_256():
    proj, keys, values, _, _ = _inputs(1, 16, 2, 8, mx.bfloat16, mx.bfloat16, 1)
    kw = dict(num_heads=16, num_kv_heads=2, head_dim=DH)
    from mlx_qwen_fast.kernels import _cuda_build

    assert ad.supports(proj, keys, values, **kw) == _cuda_build.cuda_available()
    assert not ad.supports(proj, keys, values, **{**kw, "head_dim": 128})
    assert not ad.supports(proj, keys.astype(mx.float32), values, **kw)
    assert not ad.supports(proj[:, :, :-1], keys, values, **kw)
    assert not ad.supports(proj, keys, values, num_heads=34, num_kv_heads=2, head_dim=DH)


# ---------------------------------------------------------------------------
# the kernels (CUDA)
# ---------------------------------------------------------------------------

CASES = [
    # B, hq, hkv, cap, off, dtype, weight dtype, rope dims, traditional, rope scale
    (1, 16, 2, 4096, 4095, mx.bfloat16, mx.bfloat16, 64, False, 1.0),  # the model's layer, 4K context
    (1, 16, 2, 4352, 4100, mx.bfloat16, mx.bfloat16, 64, False, 1.0),  # past a 256 growth
    (2, 16, 2, 300, 257, mx.bfloat16, mx.float32, 64, False, 1.0),  # splits not a multiple of the tile
    (1, 16, 2, 1, 0, mx.float16, mx.float16, 64, False, 1.0),  # the first position
    (3, 4, 4, 65, 64, mx.float32, mx.float32, 256, True, 1.0),  # one query head per KV head
    (1, 32, 2, 1000, 500, mx.bfloat16, mx.bfloat16, 64, False, 0.5),  # 16 query heads per KV head
    (2, 8, 2, 130, 31, mx.float32, mx.bfloat16, 32, False, 1.0),  # most of the buffer unwritten
]


@pytest.mark.cuda
@pytest.mark.cpu_check("attention_decode.cu")
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("B,hq,hkv,cap,off,dtype,wdtype,dims,trad,rscale", CASES)
def test_kernels_match_reference(B, hq, hkv, cap, off, dtype, wdtype, dims, trad, rscale):
    proj, keys, values, qw, kw = _inputs(B, hq, hkv, cap, dtype, wdtype, seed=cap + off + B)
    settings = dict(num_heads=hq, num_kv_heads=hkv, scale=DH ** -0.5, q_eps=1e-6, k_eps=1e-6, rope_dims=dims,
                    rope_traditional=trad, rope_base=1e7, rope_scale=rscale)
    old_k, old_v = npa(keys).copy(), npa(values).copy()  # values before the call, whatever it writes
    out, k2, v2 = ad.attention_decode(proj, keys, values, mx.array(off, mx.int32), qw, kw, **settings)
    mx.eval(out, k2, v2)
    assert out.shape == (B, 1, hq * DH) and out.dtype == dtype and k2.shape == keys.shape
    assert finite(out, k2, v2)
    ref, rk, rv = reference(proj, old_k, old_v, off, qw, kw, hq=hq, hkv=hkv, scale=DH ** -0.5, eps=1e-6,
                            rope_dims=dims, traditional=trad, base=1e7, rscale=rscale)
    assert_close(out, ref, tolerance(dtype, 5), "out")
    assert_close(k2[:, :, off], rk[:, :, off], tolerance(dtype, 3), "new key row")
    assert_close(v2[:, :, off], rv[:, :, off], 0.0, "new value row (a copy)")
    others = np.arange(cap) != off
    assert_close(npa(k2)[:, :, others], npa(old_k)[:, :, others], 0.0, "other key rows")
    assert_close(npa(v2)[:, :, others], npa(old_v)[:, :, others], 0.0, "other value rows")


@pytest.mark.cuda
@pytest.mark.cpu_check("attention_decode.cu")
@pytest.mark.usefixtures("poison")
def test_offset_past_the_buffer_stays_inside_it():
    """An offset outside [0, capacity): the result is unspecified, but the
    row written is inside the buffer and nothing else changes."""
    proj, keys, values, qw, kw = _inputs(1, 16, 2, 70, mx.bfloat16, mx.bfloat16, 3)
    old = mx.array(keys)
    mx.eval(old)
    settings = dict(num_heads=16, num_kv_heads=2, scale=DH ** -0.5, q_eps=1e-6, k_eps=1e-6, rope_dims=64)
    for off, row in ((70, 69), (10_000, 69), (-5, 0)):
        _, k2, _ = ad.attention_decode(proj, mx.array(old), values, mx.array(off, mx.int32), qw, kw, **settings)
        mx.eval(k2)
        others = np.arange(70) != row
        assert_close(npa(k2)[:, :, others], npa(old)[:, :, others], 0.0, f"offset {off}: other rows")


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
def test_chained_steps_equal_fresh_calls():
    """Steps chained through the returned buffers (the cache as the model
    runs it) give at each step what one call on the written buffer gives."""
    B, hq, hkv, cap = 1, 16, 2, 96
    proj, keys, values, qw, kw = _inputs(B, hq, hkv, cap, mx.bfloat16, mx.bfloat16, 9)
    settings = dict(num_heads=hq, num_kv_heads=hkv, scale=DH ** -0.5, q_eps=1e-6, k_eps=1e-6, rope_dims=64,
                    rope_base=1e7)
    for off in range(60, 70):
        p = (2.0 * mx.random.normal(proj.shape, key=mx.random.key(off))).astype(mx.bfloat16)
        before_k, before_v = npa(keys).copy(), npa(values).copy()
        out, keys, values = ad.attention_decode(p, keys, values, mx.array(off, mx.int32), qw, kw, **settings)
        mx.eval(out, keys, values)
        ref, _, _ = reference(p, before_k, before_v, off, qw, kw, hq=hq, hkv=hkv, scale=DH ** -0.5, eps=1e-6,
                              rope_dims=64, traditional=False, base=1e7, rscale=1.0)
        assert_close(npa(keys)[:, :, :off], before_k[:, :, :off], 0.0, f"offset {off}: earlier key rows")
        assert_close(out, ref, tolerance(mx.bfloat16, 5), f"offset {off}")
