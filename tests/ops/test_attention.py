"""ops.attention: the decode step's contract, its reference against mlx-lm's
own ``Qwen3NextAttention`` with a ``KVCache``, and the dispatcher's choice;
the prefill attention's dispatcher and the fast attention module
(``layers.FastAttention``) that calls it.

CPU: the decode reference equals the stock module's output and cache (fp32,
fresh random weights and cache, head_dim 64 and 256, offsets at the cache's
first position and either side of its 256-position growth); the fast
module equals the stock module exactly, on its own prefill path too (made
to take it: the dispatcher then runs the reference), and leaves every other
call (one token, mask arrays, other caches) to the stock module. CUDA: the
dispatchers run the kernels for head_dim 256 and the reference otherwise or
when switched off; the fast module and a patched model's prefill against
stock within the bf16 bound of tests/test_patch.py. Metal (simulated by
``tests/metal_check.py``): the decode dispatcher runs the Metal kernels only
with ``MLX_QWEN_FAST_METAL`` on and for the shapes they take.
"""

import copy

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.models.qwen3_next import ModelArgs, Qwen3NextAttention

from compare import BF16_EPS, FP32_TOL, assert_close, finite, rel_err
from cuda_helpers import HAS_CUDA
from mlx_qwen_fast import config, layers, patched_copy
from mlx_qwen_fast.checkpoint import build_model
from mlx_qwen_fast.ops import attention


def _module(head_dim, hq=16, hkv=2, hidden=256, seed=0):
    args = ModelArgs(model_type="qwen3_next", hidden_size=hidden, num_hidden_layers=1, intermediate_size=64,
                     num_attention_heads=hq, num_key_value_heads=hkv, head_dim=head_dim, rms_norm_eps=1e-6,
                     vocab_size=32, rope_theta=1e7, partial_rotary_factor=0.25, max_position_embeddings=4096,
                     linear_num_value_heads=1, linear_num_key_heads=1, linear_key_head_dim=8,
                     linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=1, num_experts_per_tok=1,
                     decoder_sparse_step=1, shared_expert_intermediate_size=8, moe_intermediate_size=8,
                     norm_topk_prob=True, mlp_only_layers=[])
    mx.random.seed(seed)
    attn = Qwen3NextAttention(args)
    attn.update({"q_norm": {"weight": 1 + 0.2 * mx.random.normal((head_dim,))},
                 "k_norm": {"weight": 1 + 0.2 * mx.random.normal((head_dim,))}})
    return attn


def _settings(attn):
    return dict(num_heads=attn.num_attention_heads, num_kv_heads=attn.num_key_value_heads, scale=attn.scale,
                q_eps=attn.q_norm.eps, k_eps=attn.k_norm.eps, rope_dims=attn.rope.dims,
                rope_traditional=attn.rope.traditional, rope_base=attn.rope.base, rope_scale=attn.rope.scale)


def _proj(attn, x):
    return mx.concatenate([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], axis=-1)


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("ctx", [0, 1, 255, 256])
def test_reference_is_the_stock_module(head_dim, ctx):
    """fp32: output (before o_proj) and written cache as the module's."""
    with mx.stream(mx.cpu):
        attn = _module(head_dim, seed=ctx)
        stock, ours = KVCache(), KVCache()
        if ctx:
            pre = mx.random.normal((1, 2, ctx, head_dim), key=mx.random.key(ctx))
            stock.update_and_fetch(pre, pre * 0.5)
        x = mx.random.normal((1, 1, 256), key=mx.random.key(ctx + 7))
        seen = {}
        real = attn.o_proj

        def capture(y):  # the module's value just before o_proj
            seen["y"] = y
            return real(y)

        attn.o_proj = capture
        attn(x, None, stock)
        attn.o_proj = real
        # our buffers: the prefix, then room at the offset as the decoder step makes it
        cap = max(256, ((ctx + 1 + 255) // 256) * 256)
        keys = mx.zeros((1, 2, cap, head_dim))
        values = mx.zeros((1, 2, cap, head_dim))
        if ctx:
            keys[:, :, :ctx] = pre
            values[:, :, :ctx] = pre * 0.5
        out, k2, v2 = attention.decode_attention_reference(
            _proj(attn, x), keys, values, mx.array(ctx, mx.int32), attn.q_norm.weight, attn.k_norm.weight,
            **_settings(attn))
        assert_close(out, seen["y"], FP32_TOL, "output")
        assert_close(k2[:, :, :ctx + 1], stock.keys[:, :, :ctx + 1], FP32_TOL, "keys")
        assert_close(v2[:, :, :ctx + 1], stock.values[:, :, :ctx + 1], 0.0, "values")


def test_dispatch_off_cuda_is_the_reference(monkeypatch):
    attn = _module(256)
    x = mx.random.normal((1, 1, 256))
    keys = values = mx.zeros((1, 2, 256, 256))
    proj = _proj(attn, x)
    hd = dict(num_heads=16, num_kv_heads=2, head_dim=256)
    assert attention.decode_implementation(proj, keys, values, backend="cpu", **hd) == "reference"
    assert attention.implementation_for(1, "cpu") == "reference"
    assert attention.implementation_for(1, "metal") == "reference"
    assert attention.implementation_for(4096, "cpu") == "stock"
    assert attention.implementation_for(4096, "metal") == "stock"
    # "cuda" where MLX has no CUDA device: what would run here
    assert attention.implementation_for(4096, "cuda") == ("cuda-kernel" if HAS_CUDA else "stock")
    with pytest.raises(ValueError, match="backend"):
        attention.implementation_for(1, "tpu")


@pytest.mark.cuda
def test_dispatch_on_cuda(env, monkeypatch):
    assert HAS_CUDA
    calls = []
    real = attention._k_decode.attention_decode
    monkeypatch.setattr(attention._k_decode, "attention_decode",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    for head_dim, kernel in ((256, True), (128, False)):
        attn = _module(head_dim)
        attn.set_dtype(mx.bfloat16)
        x = mx.random.normal((1, 1, 256)).astype(mx.bfloat16)
        keys = values = mx.zeros((1, 2, 256, head_dim), mx.bfloat16)
        calls.clear()
        out, _, _ = attention.decode_attention(_proj(attn, x), keys, values, mx.array(3, mx.int32),
                                               attn.q_norm.weight, attn.k_norm.weight, **_settings(attn))
        mx.eval(out)
        assert bool(calls) == kernel
    env.set(config.ATTENTION_DECODE_KERNEL.name, "0")
    calls.clear()
    attn = _module(256)
    keys = values = mx.zeros((1, 2, 256, 256))
    x = mx.random.normal((1, 1, 256))
    mx.eval(attention.decode_attention(_proj(attn, x), keys, values, mx.array(0, mx.int32), attn.q_norm.weight,
                                       attn.k_norm.weight, **_settings(attn)))
    assert not calls
    assert attention.implementation_for(1, "cuda") == "reference"
    assert isinstance(attn.rope, nn.RoPE)


def test_dispatch_on_metal_needs_the_switch(env, monkeypatch):
    """Metal, simulated (``tests/metal_check.py``: MLX's generated source run
    on the CPU, Metal seen as available): the Metal kernels only with
    ``MLX_QWEN_FAST_METAL`` on, on the Metal backend and for the shapes they
    take (head_dim 256, at most 8 query heads per KV head); the dispatcher's
    call runs them (split-K at this capacity) and agrees with the reference
    in fp32; switched off again, the reference runs."""
    import metal_check as mc
    from mlx_qwen_fast import backend, op_implementations
    from mlx_qwen_fast.kernels import attention_decode_metal as adm

    if mc.CXX is None:
        pytest.skip("no C++ compiler (g++) to build the Metal sources")
    attn = _module(256)
    x = mx.random.normal((1, 1, 256), key=mx.random.key(5))
    keys = mx.random.normal((1, 2, 512, 256), key=mx.random.key(6))
    values = mx.random.normal((1, 2, 512, 256), key=mx.random.key(7))
    proj, off = _proj(attn, x), mx.array(300, mx.int32)
    hd = dict(num_heads=16, num_kv_heads=2, head_dim=256)
    args = (proj, keys, values, off, attn.q_norm.weight, attn.k_norm.weight)
    with mc.simulated_modules(adm.__name__) as (m,):
        assert attention.decode_implementation(proj, keys, values, backend="metal", **hd) == "reference"
        assert attention.implementation_for(1, "metal") == "reference"
        env.set(config.METAL_KERNELS.name, "1")
        assert attention.decode_implementation(proj, keys, values, backend="metal", **hd) == "metal-kernel"
        assert attention.implementation_for(1, "metal") == "metal-kernel"
        assert op_implementations("metal")["attention.decode"] == "compiled-layer+metal-kernel"
        assert attention.implementation_for(4096, "metal") == "stock"
        assert attention.decode_implementation(proj, keys, values, backend="cpu", **hd) == "reference"
        assert attention.decode_implementation(proj, keys, values, backend="metal",
                                               **{**hd, "head_dim": 128}) == "reference"
        p32 = mx.zeros((1, 1, 2 * 32 * 256 + 2 * 2 * 256))
        assert attention.decode_implementation(p32, keys, values, backend="metal", num_heads=32, num_kv_heads=2,
                                               head_dim=256) == "reference"
        monkeypatch.setattr(backend, "current", lambda: backend.METAL)
        out, k2, _ = attention.decode_attention(*args, **_settings(attn))
        mx.eval(out, k2)
        assert {kind: k.calls for kind, k in m._KERNELS.items()} == {"key": 1, "split": 1, "combine": 1}
        ref, rk, _ = attention.decode_attention_reference(*args, **_settings(attn))
        assert_close(out, ref, FP32_TOL, "output")
        assert_close(k2, rk, FP32_TOL, "keys")
        env.set(config.METAL_KERNELS.name, "0")
        mx.eval(attention.decode_attention(*args, **_settings(attn)))
        assert m._KERNELS["key"].calls == 1


# ---------------------------------------------------------------------------
# prefill: the dispatcher and the fast attention module
# ---------------------------------------------------------------------------


def _filled_caches(head_dim, ctx, dtype=mx.float32, seed=0, n=2, batch=1):
    """``n`` KVCaches holding the same ``ctx`` random rows (none when ctx is 0)."""
    caches = [KVCache() for _ in range(n)]
    if ctx:
        pre = mx.random.normal((batch, 2, ctx, head_dim), key=mx.random.key(seed)).astype(dtype)
        for c in caches:
            c.update_and_fetch(mx.array(pre), mx.array(pre * 0.5))
    return caches


def _force_fast_path(monkeypatch):
    """The fast module takes its prefill path here as on CUDA (the
    dispatcher still chooses by backend: the reference on the CPU); returns
    the calls of the dispatcher it made."""
    calls = []
    real_for, real_prefill = attention.implementation_for, attention.prefill_attention
    monkeypatch.setattr(attention, "implementation_for",
                        lambda n, backend=None: "cuda-kernel" if n > 1 else real_for(n, backend))
    monkeypatch.setattr(attention, "prefill_attention",
                        lambda *a, **k: calls.append(k["offset"]) or real_prefill(*a, **k))
    return calls


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("ctx,T", [(0, 2), (0, 65), (30, 7), (250, 7), (256, 64)])
def test_fast_attention_prefill_path_is_the_stock_module(monkeypatch, head_dim, ctx, T):
    """fp32, CPU: the fast module's own prefill path (q/k/v, RoPE at the
    offset, the cache write, the dispatcher over the whole buffers with the
    offset) gives the stock module's output and cache exactly, across the
    cache's 256-position growth; and with no cache."""
    calls = _force_fast_path(monkeypatch)
    with mx.stream(mx.cpu):
        stock = _module(head_dim, seed=ctx + T)
        fast = layers.rebind(stock, layers.FastAttention)
        x = mx.random.normal((1, T, 256), key=mx.random.key(ctx + 3))
        cs, cf = _filled_caches(head_dim, ctx, seed=ctx)
        want = Qwen3NextAttention.__call__(stock, x, "causal", cs)
        got = fast(x, "causal", cf)
        assert calls == [ctx]
        assert_close(got, want, 0.0, "output")
        assert cf.offset == cs.offset == ctx + T and cf.keys.shape == cs.keys.shape
        assert_close(cf.keys, cs.keys, 0.0, "keys")
        assert_close(cf.values, cs.values, 0.0, "values")
        assert_close(fast(x, "causal", None), Qwen3NextAttention.__call__(stock, x, "causal", None), 0.0,
                     "no cache")


def _other_calls(head_dim=64, T=5):
    """(x, mask, cache pair) of every call the fast module leaves to the
    stock module: one token, a mask array, and the caches other than a
    plain KVCache (quantised, rotating, batched with left padding)."""
    x = mx.random.normal((2, T, 256), key=mx.random.key(1))
    arr = create_causal_mask(T, offset=9)
    pre = mx.random.normal((2, 2, 9, head_dim), key=mx.random.key(2))
    out = [(x[:, :1], None, _filled_caches(head_dim, 9, batch=2)), (x, arr, _filled_caches(head_dim, 9, batch=2))]
    for make in (lambda: QuantizedKVCache(group_size=32, bits=8), lambda: RotatingKVCache(max_size=64)):
        pair = [make(), make()]
        for c in pair:
            c.update_and_fetch(mx.array(pre), mx.array(pre))
        out.append((x, "causal", pair))
    pair = [BatchKVCache([0, 2]), BatchKVCache([0, 2])]
    out.append((x, pair[0].make_mask(T), pair))
    return out


def test_fast_attention_leaves_other_calls_to_the_stock_module(monkeypatch):
    """One token (the decoder layer's step runs those), mask arrays,
    quantised, rotating and batched caches: the stock module's call, exactly,
    even where the backend would take the fast path."""
    calls = _force_fast_path(monkeypatch)
    with mx.stream(mx.cpu):
        stock = _module(64, seed=4)
        fast = layers.rebind(stock, layers.FastAttention)
        for i, (x, mask, (cs, cf)) in enumerate(_other_calls()):
            want = Qwen3NextAttention.__call__(stock, x, mask, cs)
            got = fast(x, mask, cf)
            assert_close(got, want, 0.0, f"call {i}")
    assert calls == []


@pytest.mark.parametrize("where", ["cpu", "switch off"])
def test_fast_attention_stays_stock_off_cuda(monkeypatch, env, where):
    """Without the CUDA kernel (the CPU, or on any backend the switch off)
    even a plain prompt is the stock module's call: the dispatcher is not
    asked."""
    calls = []
    monkeypatch.setattr(attention, "prefill_attention", lambda *a, **k: calls.append(1))
    if where == "switch off":
        env.set(config.ATTENTION_PREFILL_KERNEL.name, "0")
    with mx.stream(mx.cpu if where == "cpu" else mx.default_device()):
        stock = _module(256, seed=2)
        fast = layers.rebind(stock, layers.FastAttention)
        x = mx.random.normal((1, 9, 256), key=mx.random.key(9))
        assert_close(fast(x, "causal", KVCache()), stock(x, "causal", KVCache()), 0.0, "output")
    assert calls == []


def test_prefill_reference_is_mlx_causal_attention():
    """The reference over a longer buffer, with the chunk's offset, is MLX's
    causal attention over the cache's view (the stock call)."""
    with mx.stream(mx.cpu):
        q = mx.random.normal((2, 8, 7, 64), key=mx.random.key(0))
        k = mx.random.normal((2, 2, 300, 64), key=mx.random.key(1))
        v = mx.random.normal((2, 2, 300, 64), key=mx.random.key(2))
        want = mx.fast.scaled_dot_product_attention(q, k[:, :, :37], v[:, :, :37], scale=0.125, mask="causal")
        got = attention.prefill_attention_reference(q, k, v, scale=0.125, offset=30)
        assert_close(got, want, 0.0, "reference")
        assert attention.prefill_implementation(q, k, v, offset=30, backend="cpu") == "reference"
        assert_close(attention.prefill_attention(q, k, v, scale=0.125, offset=30), want, 0.0, "dispatch")


def test_prefill_switch_off(env):
    env.set(config.ATTENTION_PREFILL_KERNEL.name, "0")
    assert attention.implementation_for(2048, "cuda") == "stock"
    q = mx.zeros((1, 16, 4, 256), mx.bfloat16)
    kv = mx.zeros((1, 2, 10, 256), mx.bfloat16)
    assert attention.prefill_implementation(q, kv, kv, offset=6, backend="cuda") == "reference"
    assert attention.implementation_for(1, "cpu") == "reference"  # decode untouched


@pytest.mark.cuda
def test_prefill_dispatch_on_cuda(env, monkeypatch):
    """The kernel for head_dim 256 in bf16/f16; the reference for head_dim
    128, for fp32, and with the switch off."""
    assert HAS_CUDA
    calls = []
    real = attention._k_prefill.attention_prefill
    monkeypatch.setattr(attention._k_prefill, "attention_prefill",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    for dh, dtype, kernel in ((256, mx.bfloat16, True), (256, mx.float16, True), (128, mx.bfloat16, False),
                              (256, mx.float32, False)):
        q = mx.random.normal((1, 16, 9, dh)).astype(dtype)
        kv = mx.random.normal((1, 2, 20, dh)).astype(dtype)
        calls.clear()
        out = attention.prefill_attention(q, kv, kv, scale=dh ** -0.5, offset=11)
        mx.eval(out)
        assert bool(calls) == kernel and out.shape == q.shape and out.dtype == dtype
    env.set(config.ATTENTION_PREFILL_KERNEL.name, "0")
    calls.clear()
    q = mx.random.normal((1, 16, 9, 256)).astype(mx.bfloat16)
    kv = mx.random.normal((1, 2, 20, 256)).astype(mx.bfloat16)
    mx.eval(attention.prefill_attention(q, kv, kv, scale=0.0625, offset=11))
    assert not calls and attention.implementation_for(2048, "cuda") == "stock"


def _bf16_bound(err_fast, err_stock, what):
    """tests/test_patch.py's bound: the fast path's bf16 error against fp32
    at most twice stock's plus four unit roundoffs."""
    assert err_fast <= 2 * err_stock + 4 * BF16_EPS, (
        f"{what}: bf16 error vs fp32: fast {err_fast:.2e}, stock {err_stock:.2e}")


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("ctx,T", [(0, 64), (30, 7), (250, 130), (4101, 2048)])
def test_cuda_fast_attention_module_against_stock(monkeypatch, ctx, T):
    """bf16, the model's heads (16 / 2, head_dim 256): the fast module's
    output (after o_proj) and cache against the fp32 module on the same
    inputs, within the bf16 bound of stock's own error; the kernel ran; the
    cache's keys and values are stock's bit for bit (the same write)."""
    assert HAS_CUDA
    calls = []
    real = attention._k_prefill.attention_prefill
    monkeypatch.setattr(attention._k_prefill, "attention_prefill",
                        lambda *a, **k: calls.append(k["offset"]) or real(*a, **k))
    stock = _module(256, seed=ctx + T)
    stock32 = copy.deepcopy(stock)
    stock.set_dtype(mx.bfloat16)
    fast = layers.rebind(stock, layers.FastAttention)
    x = mx.random.normal((1, T, 256), key=mx.random.key(ctx)).astype(mx.bfloat16)
    cs, cf = _filled_caches(256, ctx, mx.bfloat16, seed=ctx)
    (c32,) = _filled_caches(256, ctx, mx.float32, seed=ctx, n=1)
    if ctx:  # the fp32 cache holds the bf16 rows
        c32.keys, c32.values = cs.keys.astype(mx.float32), cs.values.astype(mx.float32)
    want = stock32(x.astype(mx.float32), "causal", c32)
    got_stock = stock(x, "causal", cs)
    got = fast(x, "causal", cf)
    mx.eval(want, got_stock, got)
    assert calls == [ctx] and finite(got)
    _bf16_bound(rel_err(got, want), rel_err(got_stock, want), f"ctx {ctx}, T {T}")
    assert_close(cf.keys[:, :, :ctx + T], cs.keys[:, :, :ctx + T], 0.0, "keys")
    assert_close(cf.values[:, :, :ctx + T], cs.values[:, :, :ctx + T], 0.0, "values")


def _prefill_logits(model, tokens, step):
    """Logits of every position, the prompt fed in chunks of ``step`` through one cache."""
    cache = make_prompt_cache(model)
    outs = []
    for i in range(0, tokens.shape[1], step):
        outs.append(model(tokens[:, i:i + step], cache=cache).astype(mx.float32))
        mx.eval(outs[-1])
    return mx.concatenate(outs, axis=1)


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("gemm,batch", [
    ("0", 1), ("0", 2), pytest.param("1", 1, marks=pytest.mark.cpu_check("moe_grouped_gemm_wgmma.cu")), ("1", 2)])
def test_cuda_patched_prefill_matches_stock(monkeypatch, env, kernel_heads, batch, gemm):
    """bf16, a random model with the model's attention heads: a 300-token
    prompt prefilled in chunks of 128 (offsets 0, 128, 256; the cache
    grows past 256) by the patched model, its attention layers through the
    kernel, against the fp32 model within the bf16 bound of stock's own
    error (tests/test_patch.py's), over the logits of every position; with
    the prefill GEMM off and on (``MLX_QWEN_FAST_PREFILL_GEMM``: the
    projections of the 128-token chunks, attention's and the Gated
    DeltaNet layers', through the fused-dequantisation GEMM). Batch 1 with
    the GEMM on also runs on the CPU through the CUDA check (every kernel
    of the patched prefill executed there)."""
    from mlx_qwen_fast.kernels import _cuda_build

    assert _cuda_build.cuda_available()  # a GPU, or the CUDA check's simulated one
    env.set(config.PREFILL_GEMM_KERNEL.name, gemm)
    from mlx_qwen_fast.ops import linear as linear_ops

    # every projection of the 128-token chunks on the GEMM: the dispatch's size thresholds (speed only) lowered
    monkeypatch.setattr(linear_ops, "PREFILL_GEMM_MIN_ROWS", 128)
    monkeypatch.setattr(linear_ops, "PREFILL_GEMM_MIN_FEATURES", 0)
    calls = []
    real = attention._k_prefill.attention_prefill
    monkeypatch.setattr(attention._k_prefill, "attention_prefill",
                        lambda *a, **k: calls.append(k["offset"]) or real(*a, **k))
    stock, _ = build_model(kernel_heads, seed=3, dtype=mx.bfloat16)
    fast, report = patched_copy(stock, warn=False)
    assert report.ops["attention.prefill"] == "cuda-kernel"
    assert all(type(l.self_attn) is layers.FastAttention for l in fast.layers if not l.is_linear)
    stock32 = copy.deepcopy(stock)
    stock32.set_dtype(mx.float32)
    vocab = stock.language_model.args.vocab_size
    tokens = mx.random.randint(1, vocab, (batch, 300), key=mx.random.key(batch))
    exact = _prefill_logits(stock32, tokens, 128)
    err_stock = rel_err(_prefill_logits(stock, tokens, 128), exact)
    gemms = []
    real_gemm = linear_ops._k_gemm.quantized_gemm_unchecked
    monkeypatch.setattr(linear_ops._k_gemm, "quantized_gemm_unchecked",
                        lambda *a, **k: gemms.append(a[0].shape) or real_gemm(*a, **k))
    got = _prefill_logits(fast, tokens, 128)
    n_attn = sum(not l.is_linear for l in fast.layers)
    assert sorted(calls) == sorted([0, 128, 256] * n_attn) and finite(got)
    # the two 128-token chunks' projections: 4 per attention layer, 3 per Gated DeltaNet layer
    n_gdn = len(fast.layers) - n_attn
    assert len(gemms) == (2 * (4 * n_attn + 3 * n_gdn) if gemm == "1" else 0), gemms
    _bf16_bound(rel_err(got, exact), err_stock, f"batch {batch}")
