"""``mlx_qwen_fast.speculative``: the patched model's Gated DeltaNet caches
roll back, so mlx-lm's own speculative decoding runs on it.

All in fp32 on the CPU with the tiny model. A verify over S tokens trimmed
to every accepted length 0..S-1 leaves the caches (conv, recurrent, KV)
where sequential one-token decoding of the accepted tokens leaves them, and
decoding goes on from there with the same logits and greedy tokens;
mlx-lm's ``generate(..., draft_model=...)`` gives plain greedy generation's
text, where stock mlx-lm refuses the model; plain decoding records nothing.
"""

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, KVCache, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from compare import FP32_TOL, assert_close, rel_err
from mlx_qwen_fast import speculative
from mlx_qwen_fast.checkpoint import DEMO_LM_HEAD_SCALE, build_model
from mlx_qwen_fast.ops import gated_delta as gated_delta_ops
from mlx_qwen_fast.patching import patched_copy

PROMPT = [1, 5, 9, 33, 100, 7, 8, 200, 300, 11]
S = 5  # verify length: 1 + 4 draft tokens


@pytest.fixture(scope="module")
def tiny():
    """(stock fp32 tiny model, its patched twin); non-flat logits."""
    stock, _ = build_model("tiny", seed=0, dtype=mx.float32, lm_head_scale=DEMO_LM_HEAD_SCALE)
    fast, report = patched_copy(stock)
    assert report.patched
    return stock, fast


@pytest.fixture(scope="module")
def draft():
    """A patched draft that agrees with the tiny target on part of its
    greedy tokens (the same weights, routed differently): verifies accept
    some drafts and reject others."""
    model, _ = build_model("tiny", seed=0, dtype=mx.float32, lm_head_scale=DEMO_LM_HEAD_SCALE, router_skew=0.5)
    fast, report = patched_copy(model)
    assert report.patched
    return fast


def _prefilled(model):
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(PROMPT)[None], cache=cache))
    return cache


def _states(cache):
    """Every array a later step reads: GDN (conv, recurrent), KV up to the offset."""
    out = []
    for c in cache:
        if isinstance(c, KVCache):
            out += [c.keys[..., :c.offset, :], c.values[..., :c.offset, :]]
        else:
            out += [c[0], c[1]]
    return out


def _offsets(cache):
    return [c.offset for c in cache if isinstance(c, KVCache)]


def _tokens(model, n):
    """The model's greedy continuation of PROMPT, n tokens."""
    return [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=n)]


@pytest.fixture(scope="module")
def sequential(tiny):
    """One token per call after the prompt: the caches after each of the S
    continuation tokens (deep-copied states) and the logits of each call."""
    _, fast = tiny
    xs = _tokens(fast, S)
    cache = _prefilled(fast)
    states, logits = [[mx.array(a) for a in _states(cache)] + [_offsets(cache)]], []
    for x in xs:
        logits.append(fast(mx.array([[x]]), cache=cache)[0, -1])
        mx.eval(logits[-1], _states(cache))
        states.append([mx.array(a) for a in _states(cache)] + [_offsets(cache)])
    return xs, states, logits


def _assert_at(cache, snapshot, what):
    """The cache holds ``snapshot``'s states bit for bit: on the CPU the
    verify's arithmetic per token is sequential decoding's (the recurrence
    step by step in fp32; MLX's CPU matmuls and attention give each row the
    same bits whatever the row count)."""
    *arrays, offsets = snapshot
    assert _offsets(cache) == offsets, what
    got = _states(cache)
    assert len(got) == len(arrays)
    for i, (a, b) in enumerate(zip(got, arrays)):
        assert a.shape == b.shape and a.dtype == b.dtype, (what, i)
        assert mx.array_equal(a, b).item(), (what, i, rel_err(a, b))


@pytest.mark.parametrize("accepted", range(S))
def test_verify_trimmed_to_every_accepted_length_is_sequential_decoding(tiny, sequential, accepted):
    """A verify over S tokens, trimmed by S - 1 - accepted as mlx-lm trims
    (the accepted drafts and the bonus token's input stay): every state as
    after 1 + accepted one-token calls, and the next call's logits and
    greedy token as sequential decoding's."""
    _, fast = tiny
    xs, states, logits = sequential
    cache = _prefilled(fast)
    with speculative.rollback(fast, cache, max_steps=S) as made:
        assert len(made) == 6 and can_trim_prompt_cache(cache)
        verify = fast(mx.array(xs)[None], cache=cache)[0]
        for t in range(S):
            assert_close(verify[t], logits[t], FP32_TOL, f"verify logits {t}")
            assert mx.argmax(verify[t]).item() == mx.argmax(logits[t]).item()
        keep = accepted + 1
        assert trim_prompt_cache(cache, S - keep) == S - keep
        _assert_at(cache, states[keep], f"accepted {accepted}")
        if keep < S:  # decoding goes on from the accepted prefix
            nxt = fast(mx.array([[xs[keep]]]), cache=cache)[0, -1]
            assert_close(nxt, logits[keep], FP32_TOL, "next logits")
            assert mx.argmax(nxt).item() == mx.argmax(logits[keep]).item()
            _assert_at(cache, states[keep + 1], "next step")
    assert all(type(c) is ArraysCache for c in cache if not isinstance(c, KVCache))
    assert not can_trim_prompt_cache(cache)


def test_draft_calls_roll_back_across_calls(tiny, sequential):
    """The draft's pattern: a call over two tokens, then one-token calls,
    then a trim reaching back over several calls."""
    _, fast = tiny
    xs, states, _ = sequential
    cache = _prefilled(fast)
    with speculative.rollback(fast, cache, max_steps=S):
        fast(mx.array(xs[:2])[None], cache=cache)
        for x in xs[2:]:
            fast(mx.array([[x]]), cache=cache)
        pos = S
        for keep in (S - 1, 3, 1, 0):
            assert trim_prompt_cache(cache, pos - keep) == pos - keep
            pos = keep
            _assert_at(cache, states[keep], f"trimmed back to {keep}")


def test_per_step_states_are_the_recurrences(tiny):
    """The recorded recurrent states are the reference recurrence's, step
    by step, bit for bit (same arithmetic), and the conv states the input
    windows."""
    _, fast = tiny
    layer = fast.layers[0].linear_attn
    mx.random.seed(3)
    x = mx.random.normal((1, 4, 256))
    cache = ArraysCache(size=2)
    layer(mx.random.normal((1, 6, 256)), cache=cache)
    before = (cache[0], cache[1])
    out, steps = gated_delta_ops.gated_delta_net_steps(layer, x, cache)
    assert len(steps) == 4 and steps[-1][0] is cache[0] and steps[-1][1] is cache[1]
    for t in range(1, 5):  # the same call over the first t tokens ends in step t - 1's states
        c = ArraysCache(size=2)
        c[0], c[1] = before
        y, part = gated_delta_ops.gated_delta_net_steps(layer, x[:, :t], c)
        assert mx.array_equal(part[-1][1], steps[t - 1][1]), t
        assert mx.array_equal(part[-1][0], steps[t - 1][0]), t
        assert_close(y, out[:, :t], FP32_TOL, f"output over {t} tokens")


def test_trim_refuses_more_than_recorded(tiny):
    _, fast = tiny
    cache = _prefilled(fast)
    with speculative.rollback(fast, cache, max_steps=3):
        c = cache[0]
        assert c.trim(0) == 0
        with pytest.raises(ValueError, match="n=1 tokens asked, but only the states before the last 0"):
            c.trim(1)
        fast(mx.array([[3, 4]]), cache=cache)
        with pytest.raises(ValueError, match="n=3 tokens asked"):
            c.trim(3)
        for bad in (-1, 1.0, True):
            with pytest.raises(ValueError, match="n must be an int >= 0"):
                c.trim(bad)
        assert c.trim(2) == 2 and len(c.steps) == 0
        fast(mx.array([[3, 4, 5]]), cache=cache)
        assert len(c.steps) == 3
        fast(mx.array([[6, 7, 8, 9]]), cache=cache)  # more than max_steps: not recorded, the steps dropped
        assert c.steps == []
        with pytest.raises(ValueError, match="only the states before the last 0 tokens"):
            trim_prompt_cache(cache, 1)
        for _ in range(5):  # at most max_steps kept
            fast(mx.array([[1]]), cache=cache)
        assert len(c.steps) == 3


def test_rollback_checks_its_arguments(tiny):
    _, fast = tiny
    cache = make_prompt_cache(fast)
    for bad in (0, -2, 2.0, None):
        with pytest.raises(ValueError, match="max_steps must be an int >= 1"):
            with speculative.rollback(fast, cache, bad):
                pass
    with pytest.raises(ValueError, match="one entry per layer"):
        with speculative.rollback(fast, cache[:3], 2):
            pass
    with pytest.raises(RuntimeError):  # an exception inside: the caches are plain again
        with speculative.rollback(fast, cache, 2) as made:
            assert made and all(type(c) is speculative.RollbackArraysCache for c in made)
            raise RuntimeError
    assert all(type(c) in (ArraysCache, KVCache) and not hasattr(c, "steps") for c in cache)


def test_stock_layers_are_not_made_trimmable(tiny):
    stock, _ = tiny
    cache = make_prompt_cache(stock)
    with speculative.rollback(stock, cache, 2) as made:
        assert made == [] and not can_trim_prompt_cache(cache)


def test_plain_decoding_records_nothing(tiny, monkeypatch):
    """Prefill and one-token decoding outside a speculative loop never reach
    the recording paths (made to fail here), and the caches stay mlx-lm's
    plain, untrimmable ArraysCache."""
    _, fast = tiny

    def fail(*args, **kwargs):
        raise AssertionError("recorded outside a speculative loop")

    monkeypatch.setattr(speculative, "forward", fail)
    monkeypatch.setattr(gated_delta_ops, "gated_delta_net_steps", fail)
    cache = make_prompt_cache(fast)
    tokens = [t for t, _ in generate_step(mx.array(PROMPT), fast, max_tokens=6, prompt_cache=cache)]
    assert len(tokens) == 6
    fast(mx.array([[1, 2, 3]]), cache=cache)  # a multi-token call on a cache that holds state
    gdn = [c for c in cache if not isinstance(c, KVCache)]
    assert len(gdn) == 6 and all(type(c) is ArraysCache and not hasattr(c, "steps") for c in gdn)
    assert not can_trim_prompt_cache(cache)
    with speculative.rollback(fast, cache, 4):  # the check can fail: a recording call reaches `fail`
        with pytest.raises(AssertionError, match="recorded outside"):
            fast(mx.array([[1]]), cache=cache)


def test_mlx_lm_speculative_generation_is_plain_greedy(tiny, draft):
    """``speculative_generate_step`` (mlx-lm's loop, through the installed
    wrapper) on the patched target and draft yields the target's plain
    greedy tokens, for several draft lengths, with drafts both accepted and
    rejected; afterwards the caches are plain again."""
    _, fast = tiny
    import sys

    step = sys.modules["mlx_lm.generate"].speculative_generate_step
    want = _tokens(fast, 24)
    for k in (1, 3, 4):
        cache = make_prompt_cache(fast) + make_prompt_cache(draft)
        got = list(step(mx.array(PROMPT), fast, draft, num_draft_tokens=k, max_tokens=24, prompt_cache=cache))
        assert [t for t, _, _ in got] == want, k
        from_draft = sum(d for _, _, d in got)
        assert 0 < from_draft < 24 - 24 // (k + 1), (k, from_draft)  # some drafts accepted, some rejected
        assert all(type(c) in (ArraysCache, KVCache) and not hasattr(c, "steps") for c in cache)


def test_generate_with_a_draft_model_is_plain_generate(tiny, draft, demo_checkpoint):
    """``mlx_lm.generate(..., draft_model=...)``: the text of plain greedy
    generation; the tiny-draft preset as the draft too. Stock mlx-lm
    refuses the unpatched model, and mlx-lm's own function (not wrapped)
    refuses even the patched one: the rollback is what makes it run."""
    stock, fast = tiny
    _, tok = mlx_lm.load(str(demo_checkpoint))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me about rivers."}],
                                     add_generation_prompt=True)
    want = mlx_lm.generate(fast, tok, prompt, max_tokens=20)
    assert mlx_lm.generate(fast, tok, prompt, max_tokens=20, draft_model=draft, num_draft_tokens=3) == want
    small, _ = build_model("tiny-draft", seed=1, dtype=mx.float32)
    assert len(small.layers) == 4
    small_fast, _ = patched_copy(small)
    assert mlx_lm.generate(fast, tok, prompt, max_tokens=12, draft_model=small_fast, num_draft_tokens=2) == \
        mlx_lm.generate(fast, tok, prompt, max_tokens=12)
    with pytest.raises(ValueError, match="requires a trimmable prompt cache"):
        mlx_lm.generate(stock, tok, prompt, max_tokens=4, draft_model=small)
    with pytest.raises(ValueError, match="requires a trimmable prompt cache"):
        list(speculative.stock_speculative_generate_step()(mx.array(prompt), fast, draft, max_tokens=4))


def test_install_is_idempotent():
    import sys

    module = sys.modules["mlx_lm.generate"]
    speculative.install()
    first = module.speculative_generate_step
    speculative.install()
    assert module.speculative_generate_step is first
    assert speculative.stock_speculative_generate_step() is first._mqf_stock
    assert not hasattr(first._mqf_stock, "_mqf_stock")


# --- the replay form (a GPU's: the verify runs the layer's own path whole) ----


@pytest.fixture
def replay(monkeypatch):
    """Recorded calls of several tokens replay on trim on this machine too
    (the CPU runs the GPU's form: speculative.REPLAY_BACKENDS)."""
    from mlx_qwen_fast import backend

    monkeypatch.setattr(speculative, "REPLAY_BACKENDS", (backend.current(),))
    assert speculative.replays()


def _assert_near(cache, snapshot, what):
    """The cache holds ``snapshot``'s states within the fp32 bound (the
    verify ran the chunked form, sequential decoding the recurrence)."""
    *arrays, offsets = snapshot
    assert _offsets(cache) == offsets, what
    got = _states(cache)
    assert len(got) == len(arrays)
    for i, (a, b) in enumerate(zip(got, arrays)):
        assert a.shape == b.shape and a.dtype == b.dtype, (what, i)
        assert_close(a, b, FP32_TOL, f"{what}: state {i}")


@pytest.mark.parametrize("accepted", range(S))
def test_replay_trimmed_to_every_accepted_length(tiny, sequential, replay, accepted):
    """The replay form: the verify is one recorded call (its states before
    and its input kept, one segment per layer), a trim to any accepted
    length replays the kept tokens; states, the next logits and greedy
    tokens as sequential decoding's within the fp32 bound."""
    _, fast = tiny
    xs, states, logits = sequential
    cache = _prefilled(fast)
    with speculative.rollback(fast, cache, max_steps=S) as made:
        verify = fast(mx.array(xs)[None], cache=cache)[0]
        assert all(len(c.steps) == 1 and c.steps[0].tokens == S and c.steps[0].inputs is not None for c in made)
        for t in range(S):
            assert_close(verify[t], logits[t], FP32_TOL, f"verify logits {t}")
            assert mx.argmax(verify[t]).item() == mx.argmax(logits[t]).item()
        keep = accepted + 1
        assert trim_prompt_cache(cache, S - keep) == S - keep
        assert all(c.recorded() == (keep if keep < S else S) for c in made)
        _assert_near(cache, states[keep], f"accepted {accepted}")
        if keep < S:
            nxt = fast(mx.array([[xs[keep]]]), cache=cache)[0, -1]
            assert mx.argmax(nxt).item() == mx.argmax(logits[keep]).item()
            _assert_near(cache, states[keep + 1], "next step")
            assert trim_prompt_cache(cache, 2) == 2  # back over the one-token call and into the verify's
            _assert_near(cache, states[keep - 1], "two back")


def test_replay_state_at_changes_nothing(tiny, sequential, replay):
    """state_at(n) gives the states n tokens back (replaying inside a call)
    without changing the cache; out of range it raises as trim does."""
    _, fast = tiny
    xs, states, _ = sequential
    cache = _prefilled(fast)
    with speculative.rollback(fast, cache, max_steps=S) as made:
        fast(mx.array(xs)[None], cache=cache)
        c = made[0]
        i = next(j for j, e in enumerate(cache) if e is c)
        before = (c[0], c[1])
        for n in range(S + 1):
            conv, rec = c.state_at(n)
            ref = states[S - n]
            k = [j for j, e in enumerate(cache) if not isinstance(e, KVCache)].index(i)
            assert_close(conv, ref[2 * k], FP32_TOL, f"conv {n} back")
            assert_close(rec, ref[2 * k + 1], FP32_TOL, f"recurrent {n} back")
        assert (c[0], c[1]) == before and c.recorded() == S
        with pytest.raises(ValueError, match="only the states before the last"):
            c.state_at(S + 1)


def test_replay_generation_is_plain_greedy(tiny, draft, replay):
    """mlx-lm's speculative generation on the replay form: plain greedy tokens."""
    _, fast = tiny
    import importlib

    gen = importlib.import_module("mlx_lm.generate")
    want = _tokens(fast, 20)
    got = [t for t, *_ in gen.speculative_generate_step(mx.array(PROMPT), fast, draft, max_tokens=20,
                                                         num_draft_tokens=4)]
    assert got == want
