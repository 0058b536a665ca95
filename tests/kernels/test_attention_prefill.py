"""The flash-attention prefill kernel (``kernels/attention_prefill.py``:
causal attention of a chunk of queries over a KV cache, head_dim 256, GQA).

The argument checks, ``supports`` and the empty cases run on any backend
(no launch); the kernel on CUDA against an fp32 reference, outputs poisoned
with NaN before every launch, inputs fresh random data, the cache's
positions past the chunk filled with NaN (the kernel must never read them).

Reference: explicit fp32 softmax over the masked scores, computed by numpy
from fp32 copies of the same inputs (query rows in blocks, so the scores of
the large case stay small). Bound (compare.tolerance): the kernel
rounds twice where the reference does not -- the unnormalised softmax
weights to the input type before the P V product, and the result -- so 2
roundings; every sum is fp32 in both.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

import cuda_check
from compare import assert_close, finite, npa, tolerance
from gdn_helpers import NOT_ARRAYS
from mlx_qwen_fast.kernels import _cuda_build as cb
from mlx_qwen_fast.kernels import attention_prefill as ap

DH = 256
SCALE = DH ** -0.5


def reference(queries, keys, values, scale, offset, rows=512):
    """fp32 [B, Hq, T, DH] (numpy): softmax(scale q k^T, keys past each
    query's position excluded) v, per query head over its KV head, by
    numpy's BLAS (MLX's CPU matmul is several times slower) in blocks of
    query rows."""
    q, k, v = npa(queries), npa(keys), npa(values)
    B, hq, T, _ = q.shape
    g = hq // k.shape[1]
    end = offset + T
    out = np.empty((B, hq, T, DH), np.float32)
    for b in range(B):
        for h in range(hq):
            kh, vh = k[b, h // g, :end], v[b, h // g, :end]
            for t0 in range(0, T, rows):
                s = (q[b, h, t0:t0 + rows] @ kh.T) * np.float32(scale)
                pos = offset + t0 + np.arange(s.shape[0])
                s[np.arange(end)[None, :] > pos[:, None]] = -np.inf
                p = np.exp(s - s.max(axis=-1, keepdims=True))
                out[b, h, t0:t0 + rows] = (p / p.sum(axis=-1, keepdims=True)) @ vh
    return out


def _inputs(B, hq, hkv, T, offset, pad, dtype, seed):
    """queries [B, hq, T, DH]; keys/values [B, hkv, offset + T + pad, DH]
    whose last ``pad`` positions are NaN."""
    ks = mx.random.split(mx.random.key(seed), 3)
    L = offset + T + pad
    q = mx.random.normal((B, hq, T, DH), key=ks[0]).astype(dtype)
    past = mx.arange(L)[None, None, :, None] >= offset + T
    k = mx.where(past, mx.nan, mx.random.normal((B, hkv, L, DH), key=ks[1])).astype(dtype)
    v = mx.where(past, mx.nan, mx.random.normal((B, hkv, L, DH), key=ks[2])).astype(dtype)
    mx.eval(q, k, v)
    return q, k, v


# ---------------------------------------------------------------------------
# host side (any backend)
# ---------------------------------------------------------------------------


def _good(B=1, hq=16, hkv=2, T=5, L=40, dtype=mx.bfloat16):
    return (mx.zeros((B, hq, T, DH), dtype), mx.zeros((B, hkv, L, DH), dtype), mx.zeros((B, hkv, L, DH), dtype))


def test_bad_input_names_the_argument(no_launch):
    q, k, v = _good()
    cases = [
        ((q[..., :128], k, v), 35, "queries"),
        ((q[0], k, v), 35, "queries"),
        ((q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32)), 35, "queries"),
        ((q.astype(mx.int32), k, v), 35, "queries"),
        ((q, k[..., :128], v), 35, "keys"),
        ((q, k.astype(mx.float16), v), 35, "keys"),
        ((q, k[:, :, :, None], v), 35, "keys"),
        ((q, mx.zeros((2, 2, 40, DH), mx.bfloat16), v), 35, "keys"),
        ((q, k, v[:, :, :39]), 35, "values"),
        ((q, k, v.astype(mx.float16)), 35, "values"),
        ((q, mx.repeat(k[:, :1], 3, axis=1), mx.repeat(v[:, :1], 3, axis=1)), 35, "heads"),
        ((q, k, v), 36, "offset"),  # offset + T > L
        ((q, k, v), -1, "offset"),
        ((q, k, v), 3.0, "offset"),
        ((q, k, v), True, "offset"),
        ((q, k, v), None, "offset"),
        ((q, k, v), mx.array(3), "offset"),
    ]
    for args, offset, name in cases:
        with pytest.raises(ValueError, match=name):
            ap.attention_prefill(*args, scale=SCALE, offset=offset)
    for scale in (0.0, -1.0, float("inf"), float("nan"), "0.1", None):
        with pytest.raises(ValueError, match="scale"):
            ap.attention_prefill(q, k, v, scale=scale, offset=35)


@pytest.mark.parametrize("arg", ["queries", "keys", "values"])
@pytest.mark.parametrize("bad", sorted(NOT_ARRAYS))
def test_an_argument_that_is_not_an_array_is_named(no_launch, arg, bad):
    arrays = dict(zip(("queries", "keys", "values"), _good(dtype=mx.float16)))
    make, got = NOT_ARRAYS[bad]
    arrays[arg] = make(arrays[arg])
    with pytest.raises(ValueError, match=rf"\b{arg} must be an mx.array .*, got {got}"):
        ap.attention_prefill(**arrays, scale=SCALE, offset=35)


def test_valid_arguments_reach_the_launch(no_launch):
    """The arguments the checks above start from are valid (also the
    largest offset, and fp16)."""
    for dtype in (mx.bfloat16, mx.float16):
        for offset in (0, 35):
            with pytest.raises(AssertionError, match="launched"):
                ap.attention_prefill(*_good(dtype=dtype), scale=SCALE, offset=offset)


@pytest.mark.parametrize("B, T", [(0, 4), (1, 0), (0, 0)])
def test_empty_results_without_a_launch(no_launch, B, T):
    out = ap.attention_prefill(*_good(B=B, T=T), scale=SCALE, offset=3)
    assert out.shape == (B, 16, T, DH) and out.dtype == mx.bfloat16


def test_supports(monkeypatch):
    q, k, v = _good(dtype=mx.float16)
    assert ap.supports(q, k, v) == cb.cuda_available()
    monkeypatch.setattr(cb, "cuda_available", lambda: True)
    assert ap.supports(q, k, v) and ap.supports(q, k, v, offset=0) and ap.supports(q, k, v, offset=35)
    assert ap.supports(*_good(hq=8, hkv=8), offset=0)
    assert not ap.supports(q, k, v, offset=36)
    assert not ap.supports(q, k, v, offset=-1)
    assert not ap.supports(*_good(T=41))  # more queries than cache positions
    assert not ap.supports(*_good(dtype=mx.float32))
    assert not ap.supports(q[..., :128], k[..., :128], v[..., :128])
    assert not ap.supports(q, k.astype(mx.bfloat16), v)
    assert not ap.supports(*_good(hq=16, hkv=3))
    assert not ap.supports(q, k, v[:, :, :39])
    for bad in ("list", "numpy"):
        assert not ap.supports(NOT_ARRAYS[bad][0](q), k, v)
        assert not ap.supports(q, k, NOT_ARRAYS[bad][0](v))
    monkeypatch.setattr(cb, "cuda_available", lambda: False)
    assert not ap.supports(q, k, v)


def test_two_blocks_fit_an_sm():
    """The tiles of one block (Q, K, V: 64 rows of 256 two-byte elements,
    rows padded by 16 bytes) leave room for two blocks in a Hopper SM's
    228 KB of shared memory (1 KB of it reserved per block)."""
    assert ap.smem_bytes() == 3 * 64 * 528
    assert 2 * (ap.smem_bytes() + 1024) <= 228 * 1024


def test_the_reference_is_mlx_causal_attention():
    """The test's reference equals MLX's own causal attention in fp32 (so
    it states the contract), with the chunk at the end of the cache."""
    with mx.stream(mx.cpu):
        q, k, v = _inputs(2, 8, 2, 9, 20, 0, mx.float32, seed=3)
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask="causal")
    assert_close(reference(q, k, v, SCALE, 20, rows=4), want, tolerance(mx.float32), "reference")


# ---------------------------------------------------------------------------
# the kernel (CUDA)
# ---------------------------------------------------------------------------


def _check(B, hq, hkv, T, offset, pad, dtype, seed):
    q, k, v = _inputs(B, hq, hkv, T, offset, pad, dtype, seed)
    out = ap.attention_prefill(q, k, v, scale=SCALE, offset=offset)
    mx.eval(out)
    assert out.shape == (B, hq, T, DH) and out.dtype == dtype
    assert finite(out)
    assert_close(out, reference(q, k, v, SCALE, offset), tolerance(dtype, 2), "out")


#: The CPU-run parameter sets (tests/cuda_check.py): short chunks, short caches.
CPU = pytest.mark.cpu_check("attention_prefill.cu")


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("B,hq,hkv", [pytest.param(1, 16, 2, marks=CPU), (2, 16, 2), (1, 8, 8),
                                      pytest.param(2, 8, 8, marks=CPU)])
@pytest.mark.parametrize("offset", [0, 30, 4096 + 5])
@pytest.mark.parametrize("T", [2, 7, 64, 65, 2048])
def test_kernel_matches_reference(B, hq, hkv, T, offset):
    if cuda_check.active() and (T > 65 or offset > 30):
        pytest.skip("the CPU check runs the short chunks and caches")
    """bf16; the cache 3 positions longer than the chunk's end (NaN there)."""
    _check(B, hq, hkv, T, offset, 3, mx.bfloat16, seed=T * 7 + offset + B + hq)


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("B,hq,hkv,T,offset,pad", [pytest.param(1, 16, 2, 65, 30, 0, marks=CPU), (2, 8, 8, 130, 4101, 61),
                                                  (1, 16, 2, 2048, 0, 0)])
def test_kernel_fp16(B, hq, hkv, T, offset, pad):
    _check(B, hq, hkv, T, offset, pad, mx.float16, seed=T + offset)


@pytest.mark.cuda
@pytest.mark.cpu_check("attention_prefill.cu")
@pytest.mark.usefixtures("poison")
def test_kernel_32_query_heads_per_kv_head():
    """GQA of another ratio (32 query heads on one KV head)."""
    _check(1, 32, 1, 100, 200, 5, mx.bfloat16, seed=11)


@pytest.mark.cuda
@pytest.mark.cpu_check("attention_prefill.cu")
@pytest.mark.usefixtures("poison")
def test_a_dominant_key_gives_its_value_row():
    """Each query is its own key times a large factor: its score (64 after
    scaling) exceeds every other by more than 40, so its softmax weight is
    1 to fp32 rounding and the output is that position's value row exactly
    (large scores, the max taken across tiles)."""
    B, hq, hkv, T, offset = 1, 16, 2, 70, 40
    L = offset + T
    base = mx.random.normal((B, hkv, L, DH), key=mx.random.key(5))
    k = (base / mx.linalg.norm(base, axis=-1, keepdims=True)).astype(mx.bfloat16)
    idx = offset + mx.arange(T)
    q = (mx.repeat(k[:, :, idx], hq // hkv, axis=1) * (64.0 / SCALE)).astype(mx.bfloat16)
    v = mx.random.normal((B, hkv, L, DH), key=mx.random.key(6)).astype(mx.bfloat16)
    out = ap.attention_prefill(q, k, v, scale=SCALE, offset=offset)
    assert finite(out)
    assert_close(out, reference(q, k, v, SCALE, offset), tolerance(mx.bfloat16, 2), "out")
    assert_close(out, mx.repeat(v[:, :, idx], hq // hkv, axis=1), 0.0, "the own value rows")


@pytest.mark.cuda
@pytest.mark.large
@pytest.mark.usefixtures("poison")
def test_kernel_long_context():
    """A 2048-token chunk at offset 30K (the model's shape: 16 query heads,
    2 KV heads)."""
    _check(1, 16, 2, 2048, 30 * 1024, 7, mx.bfloat16, seed=30)


@pytest.mark.cuda
def test_kernel_scratch_is_the_output_only():
    """MLX's peak memory over one call is the inputs plus the output and a
    small margin, not the T x L scores (here 16 heads x 2048 x 12K fp32 =
    1.6 GB)."""
    q, k, v = _inputs(1, 16, 2, 2048, 10 * 1024, 0, mx.bfloat16, seed=1)
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    out = ap.attention_prefill(q, k, v, scale=SCALE, offset=10 * 1024)
    mx.eval(out)
    mx.synchronize()
    assert mx.get_peak_memory() - base <= out.nbytes + (16 << 20)
    assert math.isfinite(float(out.astype(mx.float32).sum().item()))
