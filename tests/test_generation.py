"""``mlx_qwen_fast.generation`` and ``ops.kv_buffers.reserve_kv``: mlx-lm's
generator on a patched model sizes the KV buffers once, so the compiled
decode step's inputs keep their shape for the whole generation.

fp32 on the CPU with the tiny model: the tokens are stock mlx-lm's, the
attention caches' capacity is set on the first decode token and never
changes (crossing stock's 256-position growth and the decode step's own
``KV_GROWTH``), a reused cache grows before its prefill, a stock model's
cache is left as mlx-lm leaves it.
"""

import importlib

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

from mlx_qwen_fast import generation
from mlx_qwen_fast.checkpoint import DEMO_LM_HEAD_SCALE, build_model
from mlx_qwen_fast.ops import kv_buffers
from mlx_qwen_fast.patching import patched_copy

PROMPT = [1, 5, 9, 33, 100, 7, 8, 200, 300, 11]


@pytest.fixture(scope="module")
def tiny():
    """(stock fp32 tiny model, its patched twin); non-flat logits."""
    stock, _ = build_model("tiny", seed=1, dtype=mx.float32, lm_head_scale=DEMO_LM_HEAD_SCALE)
    fast, report = patched_copy(stock)
    assert report.patched
    return stock, fast


def _gen_module():
    return importlib.import_module("mlx_lm.generate")


def _tokens(model, prompt, max_tokens, cache, on_token=None):
    out = []
    gen = _gen_module().generate_step(mx.array(prompt), model, max_tokens=max_tokens, prompt_cache=cache)
    for tok, _ in gen:
        out.append(tok)
        if on_token is not None:
            on_token()
    return out


def _kv(cache):
    return [c for c in cache if type(c) is KVCache]


def test_patch_installs_the_wrapper(tiny):
    mod = _gen_module()
    assert getattr(mod.generate_step, "_mqf_stock", None) is generation.stock_generate_step()
    before = mod.generate_step
    generation.install()  # idempotent
    assert mod.generate_step is before


@pytest.mark.parametrize("max_tokens", [300, 1])
def test_generation_keeps_one_capacity(tiny, max_tokens):
    """Across stock's 256-position growth the patched generation's KV
    buffers keep the capacity its first decode token gave them (the
    reservation rounded to KV_GROWTH), and the tokens are stock's."""
    stock, fast = tiny
    cache = make_prompt_cache(fast)
    shapes = []
    got = _tokens(fast, PROMPT, max_tokens, cache, lambda: shapes.append({c.keys.shape for c in _kv(cache)}))
    want = _tokens(stock, PROMPT, max_tokens, make_prompt_cache(stock))
    assert got == want and len(got) == max_tokens
    growth, need = max(kv_buffers.KV_GROWTH, KVCache.step), len(PROMPT) + max_tokens
    # the prefill (all but the prompt's last token) leaves stock's 256 positions; more only where needed
    cap = KVCache.step if need <= KVCache.step else -(-need // growth) * growth
    assert all(s == shapes[0] for s in shapes) and len(shapes[0]) == 1
    assert next(iter(shapes[0]))[2] == cap
    assert all(c.offset == need for c in _kv(cache))  # every yielded token was fed


def test_reused_cache_grows_before_its_prefill(tiny, monkeypatch):
    """A prompt cache carried into a second generation (mlx-lm's
    multi-turn use) is sized for the second one before it starts; the
    continuation's tokens are stock's. (KV_GROWTH at stock's 256 keeps the
    prompts short.)"""
    monkeypatch.setattr(kv_buffers, "KV_GROWTH", KVCache.step)
    stock, fast = tiny
    c_fast, c_stock = make_prompt_cache(fast), make_prompt_cache(stock)
    assert _tokens(fast, PROMPT, 8, c_fast) == _tokens(stock, PROMPT, 8, c_stock)
    first = {c.keys.shape[2] for c in _kv(c_fast)}
    more = [3, 4] * 150  # past the first capacity
    seen = []
    got = _tokens(fast, more, 4, c_fast, lambda: seen.append({c.keys.shape[2] for c in _kv(c_fast)}))
    assert got == _tokens(stock, more, 4, c_stock)
    growth = max(kv_buffers.KV_GROWTH, KVCache.step)
    total = len(PROMPT) + 8 + len(more) + 4
    assert first != seen[0] and seen == [{-(-total // growth) * growth}] * 4


def test_stock_model_passes_through(tiny):
    stock, _ = tiny
    cache = make_prompt_cache(stock)
    _tokens(stock, PROMPT, 3, cache)
    for c in _kv(cache):
        assert kv_buffers._RESERVE_ATTR not in c.__dict__ and c.keys.shape[2] == KVCache.step


def test_endless_generation_passes_through(tiny):
    _, fast = tiny
    cache = make_prompt_cache(fast)
    gen = _gen_module().generate_step(mx.array(PROMPT), fast, max_tokens=-1, prompt_cache=cache)
    next(gen)
    gen.close()
    assert all(kv_buffers._RESERVE_ATTR not in c.__dict__ for c in _kv(cache))


def test_mlx_lm_generate_text_is_stock(tiny, tmp_path):
    """mlx-lm's ``generate`` (through ``stream_generate``) on the patched
    model: stock's text."""
    from mlx_lm.utils import load_tokenizer

    from mlx_qwen_fast.checkpoint import make_tokenizer

    stock, fast = tiny
    make_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    a = mlx_lm.generate(fast, tok, "hello there", max_tokens=12)
    b = mlx_lm.generate(stock, tok, "hello there", max_tokens=12)
    assert a == b


def _filled(B, cap, offset, dh=8, dtype=mx.float32):
    c = KVCache()
    k = mx.random.normal((B, 2, cap, dh), key=mx.random.key(cap + offset))
    c.keys, c.values, c.offset = k.astype(dtype), (2 * k).astype(dtype), offset
    return c, k


@pytest.mark.parametrize("cap,offset,positions,want", [
    (256, 100, 5000, 8192), (256, 256, 257, 4096), (8192, 300, 5000, 8192), (256, 10, 10 ** 9, 36864)])
def test_reserve_kv_grows_filled_buffers(cap, offset, positions, want):
    """A cache with buffers grows now to the reservation's KV_GROWTH
    multiple (at most KV_RESERVE_MAX past the offset), rows before the
    offset kept, dtype kept; one with room enough is left alone."""
    c, k = _filled(1, cap, offset, dtype=mx.bfloat16)
    other = ArraysCache(2)
    assert kv_buffers.reserve_kv([c, other, None], positions) == 1
    assert c.keys.shape == c.values.shape == (1, 2, want, 8) and c.keys.dtype == mx.bfloat16
    assert mx.array_equal(c.keys[..., :offset, :], k[..., :offset, :].astype(mx.bfloat16)).item()
    assert mx.array_equal(c.values[..., :offset, :], (2 * k)[..., :offset, :].astype(mx.bfloat16)).item()
    assert c.offset == offset and other.cache == [None, None]


def test_reserve_kv_on_an_empty_cache_waits_for_the_decode_step():
    c = KVCache()
    assert kv_buffers.reserve_kv([c], 1000) == 1 and c.keys is None
    k = mx.zeros((1, 2, 256, 8))
    c.keys, c.values, c.offset = k, k, 20  # as a prefill leaves it
    assert kv_buffers.make_room(c, mx.float32, 1, 2, 8) and c.keys.shape[2] == kv_buffers.KV_GROWTH


@pytest.mark.parametrize("bad", [-1, 1.5, "8", None, True])
def test_reserve_kv_rejects_bad_positions(bad):
    with pytest.raises(ValueError, match="positions"):
        kv_buffers.reserve_kv([KVCache()], bad)


def test_reserve_kv_rejects_a_non_list():
    with pytest.raises(ValueError, match="prompt_cache"):
        kv_buffers.reserve_kv(KVCache(), 10)
