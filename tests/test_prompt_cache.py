"""``mlx_qwen_fast.prompt_cache``: a speculative generation records its
prompt's end on every cache entry, and the server's LRU starts a request
that shares that prefix from there (the Gated DeltaNet states put back, the
KV caches trimmed), where mlx-lm's own LRU cannot trim a hybrid model's
entry. fp32 on the CPU with the tiny model: the resumed cache gives the
logits and states of a fresh prefill of the new prompt."""

import copy
import importlib

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, LRUPromptCache, make_prompt_cache

from compare import FP32_TOL, assert_close
from mlx_qwen_fast import prompt_cache
from mlx_qwen_fast.checkpoint import DEMO_LM_HEAD_SCALE, build_model
from mlx_qwen_fast.dflash import presets
from mlx_qwen_fast.patching import patched_copy

PROMPT = [1, 5, 9, 33, 100, 7, 8, 200, 300, 11, 42, 17]


@pytest.fixture(scope="module")
def models():
    """(patched fp32 tiny target, a patched draft of the same family)."""
    target, _ = build_model("tiny", seed=0, dtype=mx.float32, lm_head_scale=DEMO_LM_HEAD_SCALE)
    draft, _ = build_model("tiny", seed=0, dtype=mx.float32, lm_head_scale=DEMO_LM_HEAD_SCALE, router_skew=0.5)
    return patched_copy(target, warn=False)[0], patched_copy(draft, warn=False)[0]


def _states(cache):
    out = []
    for c in cache:
        if isinstance(c, KVCache):
            out += [c.keys[..., :c.offset, :], c.values[..., :c.offset, :]]
        else:
            out += [c[0], c[1]]
    return out


def _generate(model, prompt, cache, draft_model=None, **kw):
    """Greedy tokens of mlx-lm's generator (plain, or speculative with
    ``draft_model``: the function mlx-lm's stream_generate calls, as
    installed) on ``cache``."""
    gen = importlib.import_module("mlx_lm.generate")  # the module: mlx_lm.generate is also a function
    if draft_model is None:
        steps = gen.generate_step(mx.array(prompt), model, max_tokens=6, prompt_cache=cache)
    else:
        steps = gen.speculative_generate_step(mx.array(prompt), model, draft_model, max_tokens=6,
                                              prompt_cache=cache, **kw)
    return [int(t) for t, *_ in steps]


def _fresh(model, tokens):
    cache = make_prompt_cache(model)
    logits = model(mx.array(tokens)[None], cache=cache)
    mx.eval(logits)
    return logits, cache


@pytest.mark.parametrize("kind", ["draft-model", "dflash"])
def test_a_new_request_resumes_at_the_prompts_end(models, kind):
    """After a speculative generation (mlx-lm's draft-model loop or the
    DFlash loop) the entry of prompt + answer, inserted into the LRU,
    serves a request that shares the prompt and then differs: mlx-lm's LRU
    reuses nothing (the entry cannot be trimmed); ours resumes at the
    recorded checkpoint (the prompt minus its last token for mlx-lm's loop,
    the whole prompt for DFlash's), and the next tokens' logits and every
    state equal a fresh prefill's (fp32)."""
    target, draft = models
    if kind == "dflash":
        drafter, _ = presets.build_drafter("tiny-dflash", seed=0, dtype=mx.float32)
        cache = make_prompt_cache(target) + drafter.make_cache()
        answer = _generate(target, PROMPT, cache, draft_model=drafter)
        q = len(PROMPT)
    else:
        cache = make_prompt_cache(target) + make_prompt_cache(draft)
        answer = _generate(target, PROMPT, cache, draft_model=draft, num_draft_tokens=3)
        q = len(PROMPT) - 1
    assert prompt_cache.checkpoint_position(cache) == q
    key = PROMPT + answer
    new = PROMPT + [(answer[0] + 1) % 1000, 77, 78, 79]  # the answer edited, then more

    stock_lru, lru = LRUPromptCache(), prompt_cache.CheckpointPromptCache()
    for c in (stock_lru, lru):
        c.insert_cache("m", key, cache)
    got, rest = stock_lru.fetch_nearest_cache("m", new)
    assert got is None and rest == new
    got, rest = lru.fetch_nearest_cache("m", new)
    assert got is not None and rest == new[q:]
    assert prompt_cache.checkpoint_position(got) is None  # removed on restore
    assert prompt_cache.checkpoint_position(cache) == q  # the stored entry keeps it

    n = len(target.layers)
    logits = target(mx.array(rest)[None], cache=got[:n])
    ref, ref_cache = _fresh(target, new)
    assert_close(logits[:, -1], ref[:, -1], FP32_TOL, "next token's logits")
    for a, b in zip(_states(got[:n]), _states(ref_cache)):
        assert a.shape == b.shape
        assert_close(a, b, FP32_TOL, "states")
    if kind == "draft-model":  # the draft's entries resume at the same position
        d_logits = draft(mx.array(rest)[None], cache=got[n:])
        d_ref, _ = _fresh(draft, new)
        assert_close(d_logits[:, -1], d_ref[:, -1], FP32_TOL, "draft's logits")


def test_plain_generation_records_nothing_and_mlx_lms_rules_stay(models):
    """Plain decoding records no checkpoint; the LRU then answers as
    mlx-lm's does (an exact entry, a stored prefix)."""
    target, _ = models
    cache = make_prompt_cache(target)
    answer = _generate(target, PROMPT, cache)
    assert prompt_cache.checkpoint_position(cache) is None
    lru = prompt_cache.CheckpointPromptCache()
    lru.insert_cache("m", PROMPT + answer, cache)
    got, rest = lru.fetch_nearest_cache("m", PROMPT + [999])
    assert got is None and rest == PROMPT + [999]
    got, rest = lru.fetch_nearest_cache("m", PROMPT + answer + [5, 6])
    assert got is not None and rest == [5, 6]


def test_a_checkpoint_past_the_shared_prefix_is_not_used(models):
    """A request that shares fewer tokens than the checkpoint's position
    (it differs inside the prompt) does not resume from it."""
    target, draft = models
    cache = make_prompt_cache(target) + make_prompt_cache(draft)
    answer = _generate(target, PROMPT, cache, draft_model=draft, num_draft_tokens=2)
    lru = prompt_cache.CheckpointPromptCache()
    lru.insert_cache("m", PROMPT + answer, cache)
    new = PROMPT[:5] + [999, 998]
    got, rest = lru.fetch_nearest_cache("m", new)
    assert got is None and rest == new


def test_record_refuses_what_it_cannot_put_back():
    """``record`` leaves no checkpoint where an entry cannot be put back at
    q: no KV entry, q past the offset, a plain GDN cache behind q's state,
    a recording cache that no longer holds it."""
    from mlx_qwen_fast.speculative import RollbackArraysCache, Segment

    kv = KVCache()
    kv.update_and_fetch(mx.zeros((1, 2, 5, 4)), mx.zeros((1, 2, 5, 4)))
    gdn = ArraysCache(2)
    gdn[0], gdn[1] = mx.zeros((1, 3, 8)), mx.zeros((1, 2, 4, 4))
    assert not prompt_cache.record([gdn], 0)  # no KV entry: the position is unknown
    assert not prompt_cache.record([kv, gdn], 6)  # past the offset
    assert not prompt_cache.record([kv, gdn], 3)  # a plain cache holds only its current state
    assert prompt_cache.checkpoint_position([kv, gdn]) is None
    rec = copy.deepcopy(gdn)
    rec.__class__ = RollbackArraysCache
    rec.max_steps, rec.steps = 4, [Segment(mx.ones((1, 3, 8)), mx.ones((1, 2, 4, 4)), 1)] * 2
    assert not prompt_cache.record([kv, rec], 2)  # 3 tokens back, 2 held
    assert prompt_cache.record([kv, rec], 3)
    assert prompt_cache.checkpoint_position([kv, rec]) == 3
    restored = prompt_cache.restore([kv, rec])
    assert kv.offset == 3 and restored[1][0] is rec.steps[0].conv
