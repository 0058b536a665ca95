"""Gated attention pieces (mlx_qwen_fast.ops.attention) vs numpy formulas and stock.

Pieces are checked in fp32 against float64 numpy formulas (1 token, causal
prefill with a cache offset, GQA 8:1, head_dim 256 and small head dims); the
whole layer against mlx-lm's ``Qwen3NextAttention`` through a ``KVCache`` over
prefill and decode steps. Fresh random inputs each run.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_map
from mlx_lm.models.base import (
    create_attention_mask,
    quantized_scaled_dot_product_attention,
)
from mlx_lm.models.cache import KVCache, QuantizedKVCache
from mlx_lm.models.qwen3_next import ModelArgs, Qwen3NextAttention
from mlx_lm.models.rope_utils import initialize_rope

from mlx_qwen_fast.ops import attention as A

BF16_EPS = 2.0**-8  # unit roundoff of bfloat16

# (H, Hkv, head_dim): the checkpoint's 16/2/256 (GQA 8:1), and small ones
HEADS = [(16, 2, 256), (4, 2, 32), (8, 1, 16)]


def rel_max(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def make_attention(H, Hkv, hd, D=64, theta=1e7):
    args = ModelArgs(
        model_type="qwen3_next",
        hidden_size=D,
        num_hidden_layers=1,
        intermediate_size=64,
        num_attention_heads=H,
        linear_num_value_heads=2,
        linear_num_key_heads=1,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=64,
        mlp_only_layers=[],
        moe_intermediate_size=64,
        rms_norm_eps=1e-6,
        vocab_size=16,
        num_key_value_heads=Hkv,
        rope_theta=theta,
        partial_rotary_factor=0.25,
        max_position_embeddings=4096,
        head_dim=hd,
    )
    m = Qwen3NextAttention(args)
    # non-trivial norm weights so a missing / swapped norm shows
    m.q_norm.weight = 1.0 + 0.5 * mx.random.normal((hd,))
    m.k_norm.weight = 1.0 + 0.5 * mx.random.normal((hd,))
    mx.eval(m.parameters())
    return m


# ---------------------------------------------------------------------------
# numpy formulas
# ---------------------------------------------------------------------------


def np_rms_norm(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def np_rope(x, dims, base, offset):
    """Non-traditional partial RoPE on [B, heads, L, hd] (float64 formula)."""
    x = x.astype(np.float64)
    L = x.shape[-2]
    half = dims // 2
    freqs = base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)  # [half]
    ang = (offset + np.arange(L, dtype=np.float64))[:, None] * freqs[None]
    cos, sin = np.cos(ang), np.sin(ang)
    a, b = x[..., :half], x[..., half:dims]
    out = x.copy()
    out[..., :half] = a * cos - b * sin
    out[..., half:dims] = b * cos + a * sin
    return out


def np_sdpa(q, k, v, scale, mask=None):
    """q [B,H,Lq,d], k/v [B,Hkv,Lk,d]; mask "causal", bool or additive [.., Lq, Lk]."""
    q, k, v = (t.astype(np.float64) for t in (q, k, v))
    B, H, Lq, _ = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    rep = H // Hkv
    k = np.repeat(k, rep, axis=1)
    v = np.repeat(v, rep, axis=1)
    s = scale * q @ k.swapaxes(-1, -2)
    if isinstance(mask, str):
        mask = (np.arange(Lk - Lq, Lk)[:, None] >= np.arange(Lk)[None])
    if mask is not None:
        mask = np.asarray(mask)
        s = np.where(mask, s, -np.inf) if mask.dtype == bool else s + mask
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    return (p / p.sum(-1, keepdims=True)) @ v


# ---------------------------------------------------------------------------
# pieces
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("H,Hkv,hd", HEADS)
@pytest.mark.parametrize("L", [1, 9])
def test_split_query_gate(H, Hkv, hd, L):
    x = np.random.default_rng().normal(size=(2, L, 2 * H * hd)).astype(np.float32)
    q, g = A.split_query_gate(mx.array(x), H, hd)
    assert q.shape == (2, L, H, hd) and g.shape == (2, L, H * hd)
    per_head = x.reshape(2, L, H, 2 * hd)  # each head: hd queries, then hd gates
    np.testing.assert_array_equal(np.array(q), per_head[..., :hd])
    np.testing.assert_array_equal(np.array(g), per_head[..., hd:].reshape(2, L, H * hd))


@pytest.mark.parametrize("H,Hkv,hd", HEADS)
@pytest.mark.parametrize("L", [1, 9])
def test_qk_norm(H, Hkv, hd, L):
    rng = np.random.default_rng()
    q = rng.normal(scale=3.0, size=(2, L, H, hd)).astype(np.float32)
    k = rng.normal(scale=0.1, size=(2, L, Hkv, hd)).astype(np.float32)
    wq = rng.normal(size=hd).astype(np.float32)
    wk = rng.normal(size=hd).astype(np.float32)
    qn, kn = A.qk_norm(mx.array(q), mx.array(k), mx.array(wq), mx.array(wk), 1e-6)
    assert qn.dtype == kn.dtype == mx.float32
    assert rel_max(qn, np_rms_norm(q, wq, 1e-6)) < 1e-6
    assert rel_max(kn, np_rms_norm(k, wk, 1e-6)) < 1e-6


@pytest.mark.parametrize("H,Hkv,hd", HEADS)
@pytest.mark.parametrize("L,offset", [(1, 0), (1, 37), (11, 0), (11, 300), (3, 4000)])
def test_partial_rope(H, Hkv, hd, L, offset):
    dims = int(hd * 0.25)
    rope = initialize_rope(dims, base=1e7, traditional=False)
    x = np.random.default_rng().normal(size=(2, H, L, hd)).astype(np.float32)
    y = np.array(A.partial_rope(mx.array(x), rope, offset))
    ref = np_rope(x, dims, 1e7, offset)
    # fp32 angle = position * freq: relative rounding ~1e-7 of the angle
    tol = 1e-6 + 3e-7 * (offset + L)
    assert np.abs(y - ref).max() <= tol * np.abs(x).max()
    np.testing.assert_array_equal(y[..., dims:], x[..., dims:])  # pass-through


def test_partial_rope_small_theta():
    """theta 1e4 makes every rotary pair turn (a traditional/non-traditional
    or half-split mix-up shows at once)."""
    rope = initialize_rope(8, base=1e4, traditional=False)
    x = np.random.default_rng().normal(size=(1, 2, 6, 32)).astype(np.float32)
    y = np.array(A.partial_rope(mx.array(x), rope, 5))
    assert np.abs(y - np_rope(x, 8, 1e4, 5)).max() < 1e-5


def test_output_gate():
    rng = np.random.default_rng()
    a = rng.normal(size=(2, 3, 64)).astype(np.float32)
    g = rng.normal(scale=4, size=(2, 3, 64)).astype(np.float32)
    out = A.output_gate(mx.array(a), mx.array(g))
    assert rel_max(out, a / (1 + np.exp(-g.astype(np.float64)))) < 1e-6


SDPA_CASES = [
    # (Lq, Lk, mask): decode, causal prefill, a chunk of queries against a longer cache
    (1, 1, None),
    (1, 37, None),
    (19, 19, "causal"),
    (7, 40, "causal"),
    (5, 23, "bool"),
    (5, 23, "additive"),
]


def _mask(kind, H, Lq, Lk, rng):
    if kind == "bool":  # per-head mask, every row keeps its own last key
        m = rng.random((1, H, Lq, Lk)) < 0.6
        m[..., -1] = True
        return m
    if kind == "additive":
        return rng.normal(size=(Lq, Lk)).astype(np.float32)
    return kind


@pytest.mark.parametrize("H,Hkv,hd", HEADS)
@pytest.mark.parametrize("Lq,Lk,mask", SDPA_CASES)
def test_sdpa_vs_numpy(H, Hkv, hd, Lq, Lk, mask):
    rng = np.random.default_rng()
    q = rng.normal(size=(2, H, Lq, hd)).astype(np.float32)
    k = rng.normal(size=(2, Hkv, Lk, hd)).astype(np.float32)
    v = rng.normal(size=(2, Hkv, Lk, hd)).astype(np.float32)
    m = _mask(mask, H, Lq, Lk, rng)
    mm = mx.array(m) if isinstance(m, np.ndarray) else m
    scale = hd**-0.5
    ref = np_sdpa(q, k, v, scale, m)
    args = (mx.array(q), mx.array(k), mx.array(v))
    out = A.sdpa(*args, scale=scale, mask=mm)
    assert out.shape == (2, H, Lq, hd) and out.dtype == mx.float32
    assert rel_max(out, ref) < 1e-5
    fast = mx.fast.scaled_dot_product_attention(*args, scale=scale, mask=mm)
    assert rel_max(fast, ref) < 1e-5
    for block in (1, 7, 1024):
        out_c = A.sdpa_chunked(*args, scale=scale, mask=mm, key_block=block)
        assert rel_max(out_c, ref) < 1e-5, f"key_block={block}"


@pytest.mark.parametrize("key_block", [1024, 4096])
def test_sdpa_chunked_long_context(key_block):
    """A 16-query chunk at the end of a 5000-key cache, GQA 8:1, head_dim 256."""
    rng = np.random.default_rng()
    H, Hkv, hd, Lq, Lk = 16, 2, 256, 16, 5000
    q = mx.array(rng.normal(size=(1, H, Lq, hd)).astype(np.float32))
    k = mx.array(rng.normal(size=(1, Hkv, Lk, hd)).astype(np.float32))
    v = mx.array(rng.normal(size=(1, Hkv, Lk, hd)).astype(np.float32))
    plain = A.sdpa(q, k, v, scale=hd**-0.5, mask="causal")
    chunked = A.sdpa_chunked(q, k, v, scale=hd**-0.5, mask="causal", key_block=key_block)
    assert rel_max(chunked, plain) < 1e-5


def test_sdpa_chunked_fully_masked_block_rows():
    """Rows whose keys are all masked inside one block (sliding window) and
    additive -inf masks stay exact across blocks."""
    rng = np.random.default_rng()
    H, Hkv, hd, Lq, Lk = 4, 2, 32, 6, 40
    q, k, v = (
        rng.normal(size=s).astype(np.float32)
        for s in ((1, H, Lq, hd), (1, Hkv, Lk, hd), (1, Hkv, Lk, hd))
    )
    pos = np.arange(Lk - Lq, Lk)[:, None]
    window = (np.arange(Lk)[None] <= pos) & (np.arange(Lk)[None] > pos - 5)
    additive = np.where(window, 0.0, -np.inf).astype(np.float32)
    for m in (window, additive):
        ref = np_sdpa(q, k, v, 0.3, m)
        args = (mx.array(q), mx.array(k), mx.array(v))
        for block in (4, 16):
            out = A.sdpa_chunked(*args, scale=0.3, mask=mx.array(m), key_block=block)
            assert rel_max(out, ref) < 1e-5
        assert rel_max(A.sdpa(*args, scale=0.3, mask=mx.array(m)), ref) < 1e-5


def test_sdpa_quantized_cache():
    rng = np.random.default_rng()
    H, Hkv, hd, Lq, Lk = 16, 2, 256, 3, 50
    cache = QuantizedKVCache(group_size=64, bits=8)
    q = mx.array(rng.normal(size=(1, H, Lq, hd)).astype(np.float32))
    k = mx.array(rng.normal(size=(1, Hkv, Lk, hd)).astype(np.float32))
    v = mx.array(rng.normal(size=(1, Hkv, Lk, hd)).astype(np.float32))
    qk, qv = cache.update_and_fetch(k, v)
    # mlx-lm's function does `queries *= scale`, which rescales the caller's
    # array in place: hand it a copy
    ref = quantized_scaled_dot_product_attention(
        mx.array(q), qk, qv, scale=hd**-0.5, mask="causal", group_size=64, bits=8
    )
    out = A.sdpa(q, qk, qv, scale=hd**-0.5, mask="causal", cache=cache)
    out_c = A.sdpa_chunked(q, qk, qv, scale=hd**-0.5, mask="causal", cache=cache, key_block=16)
    assert rel_max(out, ref) < 1e-5
    assert rel_max(out_c, ref) < 1e-5


# ---------------------------------------------------------------------------
# whole layer vs stock
# ---------------------------------------------------------------------------

STEPS = [13, 1, 1, 6, 1]  # prefill, two decodes, a second prefill chunk, decode


def _run_layer(m, fn, steps, xs, cache):
    outs = []
    for x in xs:
        mask = create_attention_mask(x, cache)
        outs.append(fn(m, x, mask, cache))
        mx.eval(outs[-1])
    return outs


@pytest.mark.parametrize("H,Hkv,hd", HEADS)
def test_gated_attention_vs_stock_fp32(H, Hkv, hd):
    m = make_attention(H, Hkv, hd)
    xs = [mx.random.normal((2, L, 64)) for L in STEPS]
    stock = _run_layer(m, lambda m, x, mask, c: m(x, mask, c), STEPS, xs, KVCache())
    for impl in ("reference", "reference_chunked", "stock"):
        cache = KVCache()
        ours = _run_layer(
            m, lambda m, x, mask, c: A.gated_attention(m, x, mask, c, implementation=impl),
            STEPS, xs, cache,
        )
        assert cache.offset == sum(STEPS)
        # fp32 sums of hd products in another order than stock's: a few times
        # the typical rounding error sqrt(hd) * 2^-24 (2.4e-7 .. 3.8e-6)
        tol = 4 * hd**0.5 * 2.0**-24
        for i, (a, b) in enumerate(zip(ours, stock)):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert rel_max(a, b) < tol, f"{impl}, step {i}"
    # small key blocks exercise the online softmax across the cache
    ours = _run_layer(
        m, lambda m, x, mask, c: A.gated_attention_reference(m, x, mask, c, key_block=4),
        STEPS, xs, KVCache(),
    )
    for a, b in zip(ours, stock):
        assert rel_max(a, b) < 1e-5


def test_gated_attention_no_cache():
    m = make_attention(16, 2, 256)
    x = mx.random.normal((1, 9, 64))
    for mask in (None, "causal"):
        assert rel_max(A.gated_attention_reference(m, x, mask), m(x, mask)) < 1e-6


def rel_l2(a, b):
    a = np.array(a.astype(mx.float32), np.float64)
    b = np.array(b.astype(mx.float32), np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_gated_attention_quantized_bf16():
    """4-bit projections, bf16 activations, bf16 and 8-bit KV caches: noise
    check only. Against the same weights in fp32 the reference's error must
    not exceed stock's by more than rounding (both are dominated by CPU bf16
    matmuls, ~7% relative L2 here)."""
    m = make_attention(16, 2, 256)
    nn.quantize(m, group_size=64, bits=4)
    mb = make_attention(16, 2, 256)
    nn.quantize(mb, group_size=64, bits=4)
    mb.update(m.parameters())
    mb.set_dtype(mx.bfloat16)
    # fp32 truth: the bf16 module's exact weights
    to_f32 = lambda a: a.astype(mx.float32) if a.dtype == mx.bfloat16 else a
    m.update(tree_map(to_f32, mb.parameters()))
    xs = [mx.random.normal((1, L, 64)).astype(mx.bfloat16) for L in STEPS]
    for make_cache in (KVCache, lambda: QuantizedKVCache(group_size=64, bits=8)):
        truth = _run_layer(
            m, lambda m, x, mask, c: m(x.astype(mx.float32), mask, c), STEPS, xs, make_cache()
        )
        stock = _run_layer(mb, lambda m, x, mask, c: m(x, mask, c), STEPS, xs, make_cache())
        ours = _run_layer(mb, A.gated_attention_reference, STEPS, xs, make_cache())
        for t, a, b in zip(truth, ours, stock):
            assert a.dtype == b.dtype == mx.bfloat16
            assert rel_l2(a, t) <= 1.25 * rel_l2(b, t) + 4 * BF16_EPS


# ---------------------------------------------------------------------------
# dispatch, graph properties, validation
# ---------------------------------------------------------------------------


def test_dispatch_is_stock_everywhere():
    assert {"stock", "reference", "reference_chunked"} <= set(A.IMPLEMENTATIONS)
    for b in ("cpu", "cuda", "metal"):
        for n in (1, 2048):
            assert A.implementation_for(n, b) == "stock"
    with pytest.raises(ValueError, match="backend"):
        A.implementation_for(1, "tpu")


def test_gated_attention_from_a_subclass_calls_stock_math():
    class Fast(Qwen3NextAttention):
        def __call__(self, x, mask=None, cache=None):
            return A.gated_attention(self, x, mask=mask, cache=cache)

    m = make_attention(4, 2, 32)
    x = mx.random.normal((1, 5, 64))
    stock = m(x, "causal")
    m.__class__ = Fast  # what the patch does; must not recurse
    assert mx.array_equal(m(x, "causal"), stock)
    with pytest.raises(ValueError, match="implementation"):
        A.gated_attention(m, x, implementation="nope")


def test_no_host_sync(tmp_path):
    """Both references trace (mx.export_function, as mx.compile does) and the
    traced graphs give the eager results."""
    q = mx.random.normal((1, 4, 5, 32))
    k = mx.random.normal((1, 2, 20, 32))
    v = mx.random.normal((1, 2, 20, 32))
    fns = {
        "plain": lambda q, k, v: A.sdpa(q, k, v, scale=0.2, mask="causal"),
        "chunked": lambda q, k, v: A.sdpa_chunked(q, k, v, scale=0.2, mask="causal", key_block=8),
    }
    for name, fn in fns.items():
        path = str(tmp_path / f"{name}.mlxfn")
        mx.export_function(path, fn, q, k, v)
        assert mx.array_equal(mx.import_function(path)(q, k, v)[0], fn(q, k, v))


def test_validation_errors():
    m = make_attention(4, 2, 32)
    with pytest.raises(ValueError, match=r"x must .*\[B, L, 64\]"):
        A.gated_attention(m, mx.zeros((5, 64)))
    with pytest.raises(ValueError, match=r"\[B, L, 64\].*got shape \(1, 5, 63\)"):
        A.gated_attention_reference(m, mx.zeros((1, 5, 63)))
    with pytest.raises(ValueError, match=r"int32"):
        A.gated_attention(m, mx.zeros((1, 5, 64), mx.int32))
    with pytest.raises(ValueError, match=r"q_proj_out .*\[B, L, 256\]"):
        A.split_query_gate(mx.zeros((1, 2, 255)), 4, 32)
    with pytest.raises(ValueError, match=r"keys .*\[B, L, Hkv, 32\]"):
        A.qk_norm(mx.zeros((1, 2, 4, 32)), mx.zeros((1, 2, 2, 16)), mx.ones(32), mx.ones(16), 1e-6)
    with pytest.raises(ValueError, match=r"k_weight .*\[32\]"):
        A.qk_norm(mx.zeros((1, 2, 4, 32)), mx.zeros((1, 2, 2, 32)), mx.ones(32), mx.ones(16), 1e-6)
    with pytest.raises(ValueError, match=r"hd >= rope dims 64"):
        A.partial_rope(mx.zeros((1, 2, 3, 32)), nn.RoPE(64), 0)
    with pytest.raises(ValueError, match=r"multiple of Hkv"):
        A.sdpa(mx.zeros((1, 4, 2, 8)), mx.zeros((1, 3, 5, 8)), mx.zeros((1, 3, 5, 8)), scale=1.0)
    with pytest.raises(ValueError, match=r"values must have shape"):
        A.sdpa(mx.zeros((1, 4, 2, 8)), mx.zeros((1, 2, 5, 8)), mx.zeros((1, 2, 6, 8)), scale=1.0)
    q, k = mx.zeros((1, 4, 2, 8)), mx.zeros((1, 2, 5, 8))
    with pytest.raises(ValueError, match=r"mask must"):
        A.sdpa(q, k, k, scale=1.0, mask="window")
    with pytest.raises(ValueError, match=r"key_block"):
        A.sdpa_chunked(q, k, k, scale=1.0, key_block=0)
    with pytest.raises(ValueError, match=r"gate must have the shape"):
        A.output_gate(mx.zeros((1, 2, 8)), mx.zeros((1, 2, 4)))


def test_sdpa_chunked_memory_is_bounded():
    """Peak scratch of the chunked reference does not grow with the context;
    the plain one holds all [H, Lq, Lk] scores."""
    H, Hkv, hd, Lq, block = 8, 1, 64, 64, 256

    def peak(fn, Lk):
        q = mx.random.normal((1, H, Lq, hd))
        k = mx.random.normal((1, Hkv, Lk, hd))
        v = mx.random.normal((1, Hkv, Lk, hd))
        mx.eval(q, k, v)
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(fn(q, k, v, scale=0.125, mask="causal"))
        return mx.get_peak_memory() - base

    chunked = lambda *a, **kw: A.sdpa_chunked(*a, **kw, key_block=block)
    small, large = peak(chunked, 2048), peak(chunked, 8192)
    block_scores = H * Lq * block * 4
    assert large <= small + 2 * block_scores, (small, large)
    assert peak(A.sdpa, 8192) >= H * Lq * 8192 * 4 > 2 * large
