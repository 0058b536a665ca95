"""ops.verify: a forward of S = 2..16 tokens per row with a cache as one
compiled call over the whole layer stack, against the same model's
module-by-module path (the switch off: mlx-lm's loop over the fast layers)
and against stock mlx-lm.

fp32 on the CPU: every layer takes the step (GDN: the chunked form through
the layer's own module call; attention: the masked SDPA over the whole
buffer; MoE: the block's stock dispatch). bf16 on CUDA, CPU-checked at
S = 2: the GDN prefill kernels and the MoE decode kernels traced inside
the step.
"""

import contextlib
import copy

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

from compare import FP32_TOL, assert_close, finite, tolerance
from mlx_qwen_fast import config, speculative
from mlx_qwen_fast.checkpoint import DEMO_LM_HEAD_SCALE, build_model
from mlx_qwen_fast.ops import kv_buffers, verify
from mlx_qwen_fast.patching import patched_copy



@pytest.fixture(scope="module")
def fp32_models():
    stock, _ = build_model("tiny", seed=0, dtype=mx.float32, lm_head_scale=DEMO_LM_HEAD_SCALE)
    fast, report = patched_copy(stock, warn=False)
    assert report.patched
    return stock, fast


def _prefilled(model, prompt):
    cache = make_prompt_cache(model)
    mx.eval(model(prompt, cache=cache))
    return cache


def _valid(c):
    """A cache entry's arrays that a forward defines: a KV cache's rows up
    to its offset (the step grows buffers in larger steps than stock), a
    GDN cache's two states."""
    if isinstance(c, KVCache):
        return [c.keys[..., :c.offset, :], c.values[..., :c.offset, :]]
    return [c[0], c[1]]


def _assert_caches_close(a, b, what):
    for i, (x, y) in enumerate(zip(a, b)):
        assert type(x) is type(y)
        if isinstance(x, KVCache):
            assert x.offset == y.offset, f"{what}: layer {i} offset"
        for u, v in zip(_valid(x), _valid(y)):
            assert u.shape == v.shape and u.dtype == v.dtype
            assert_close(u, v, FP32_TOL, f"{what}: layer {i} cache")


def _snapshot(cache):
    return [(getattr(c, "offset", None), type(c), [id(a) for a in _valid_ids(c)]) for c in cache]


def _valid_ids(c):
    if isinstance(c, (KVCache, QuantizedKVCache, RotatingKVCache)):
        return [a for a in tree_flatten(c.state) if isinstance(a, mx.array)] + [c.keys]
    return list(c.cache)


class _Counts:
    def __init__(self, monkeypatch):
        self.plans, self.steps = 0, 0
        real_plan, real_verify = verify._plan, verify.verify_model

        def plan(*a):
            self.plans += 1
            return real_plan(*a)

        def verify_model(*a):
            out = real_verify(*a)
            self.steps += out is not None
            return out

        monkeypatch.setattr(verify, "_plan", plan)
        monkeypatch.setattr(verify, "verify_model", verify_model)


PROMPT_LEN = KVCache.step - 6  # the third call of 3+ tokens crosses the stock buffer's end


@pytest.fixture(scope="module")
def long_caches(fp32_models):
    """Per batch size, the fast and the stock model's caches after the same
    prompt of PROMPT_LEN tokens (made once: a CPU prefill of 250 tokens
    takes seconds); tests take deep copies."""
    stock, fast = fp32_models
    out = {}
    for B in (1, 2):
        prompt = mx.random.randint(1, 1000, (B, PROMPT_LEN), key=mx.random.key(B))
        out[B] = (_prefilled(fast, prompt), _prefilled(stock, prompt))
    return out


@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("S", [2, 3, 5, 8, 16])
def test_step_matches_modules_and_stock(monkeypatch, env, fp32_models, long_caches, S, B):
    """fp32, CPU: three S-token calls (the cache crossing the KV buffer's
    256-position end) through the compiled step give the logits and cache
    states of the module-by-module path and of stock mlx-lm within the fp32
    bound; the step ran every call, planned once per KV capacity and traced
    once per capacity (the offset is data)."""
    stock, fast = fp32_models
    fast = copy.deepcopy(fast)  # a model of this test alone: its plan and traces start empty
    counts = _Counts(monkeypatch)
    c_fast, c_stock = long_caches[B]
    c_step, c_mod, c_stock = copy.deepcopy(c_fast), copy.deepcopy(c_fast), copy.deepcopy(c_stock)
    traces0, capacities = verify.trace_count(), set()
    for i in range(3):
        tokens = mx.random.randint(1, 1000, (B, S), key=mx.random.key(100 * S + 10 * B + i))
        env.set(config.VERIFY_MODEL_STEP.name, "1")
        a = fast(tokens, cache=c_step)
        capacities.add(next(c.keys.shape[2] for c in c_step if isinstance(c, KVCache)))
        env.set(config.VERIFY_MODEL_STEP.name, "0")
        b = fast(tokens, cache=c_mod)
        ref = stock(tokens, cache=c_stock)
        mx.eval(a, b, ref)
        assert counts.steps == i + 1
        assert a.shape == (B, S, ref.shape[-1]) and finite(a)
        assert_close(a, b, FP32_TOL, f"call {i}: step vs modules")
        assert_close(a, ref, FP32_TOL, f"call {i}: step vs stock")
        _assert_caches_close(c_step, c_mod, f"call {i}: step vs modules")
        _assert_caches_close(c_step, c_stock, f"call {i}: step vs stock")
    # the capacity each call ran at: the stock buffer's 256 while the call fits, then one grown by the step
    want = {KVCache.step if PROMPT_LEN + (i + 1) * S <= KVCache.step else kv_buffers.KV_GROWTH for i in range(3)}
    assert capacities == want
    assert counts.plans == len(capacities)  # kept between calls; a grown buffer plans again
    assert verify.trace_count() - traces0 == len(capacities)


def test_one_trace_serves_every_offset(monkeypatch, env, fp32_models):
    """With the KV buffers sized once (``reserve_kv``), S-token calls at
    five offsets plan once and trace once; S = 3 and B = 2 are new input
    signatures: a trace each."""
    _, fast = fp32_models
    fast = copy.deepcopy(fast)
    cache = _prefilled(fast, mx.array([[3, 1, 4, 1, 5]]))
    kv_buffers.reserve_kv(cache, 200)
    counts = _Counts(monkeypatch)
    env.set(config.VERIFY_MODEL_STEP.name, "1")
    t0 = verify.trace_count()
    for i in range(5):
        mx.eval(fast(mx.array([[7 + i, 8, 9, 10]]), cache=cache))
    assert counts.steps == 5 and counts.plans == 1 and verify.trace_count() - t0 == 1
    mx.eval(fast(mx.array([[7, 8, 9]]), cache=cache))
    assert counts.plans == 2 and verify.trace_count() - t0 == 2
    env.set(config.VERIFY_MODEL_STEP.name, "0")
    cache2 = _prefilled(fast, mx.array([[3, 1, 4], [1, 5, 9]]))
    kv_buffers.reserve_kv(cache2, 200)
    env.set(config.VERIFY_MODEL_STEP.name, "1")
    mx.eval(fast(mx.array([[7, 8, 9], [1, 2, 3]]), cache=cache2))
    assert counts.steps == 7 and counts.plans == 3 and verify.trace_count() - t0 == 3


def test_replaced_weight_plans_again(env, fp32_models):
    """A weight replaced between calls is read by the next call (a new plan
    over the new arrays), as the module path reads it."""
    _, fast = fp32_models
    fast = copy.deepcopy(fast)
    m = fast.language_model.model
    cache = _prefilled(fast, mx.array([[2, 7, 1, 8]]))
    tokens = mx.array([[3, 4, 5]])
    env.set(config.VERIFY_MODEL_STEP.name, "1")
    first = fast(tokens, cache=copy.deepcopy(cache))
    plan = m.__dict__[verify._PLAN_ATTR]
    layer = next(l for l in m.layers if l.is_linear)
    layer.linear_attn.A_log = layer.linear_attn.A_log * 0.5
    second = fast(tokens, cache=copy.deepcopy(cache))
    assert m.__dict__[verify._PLAN_ATTR] is not plan
    env.set(config.VERIFY_MODEL_STEP.name, "0")
    ref = fast(tokens, cache=copy.deepcopy(cache))
    mx.eval(first, second, ref)
    assert float(mx.abs(second - first).max()) > 0
    assert_close(second, ref, FP32_TOL, "after the update")


def test_switch_off_is_the_module_path(monkeypatch, env, fp32_models):
    """Switch off (the default): ``verify_model`` is never called and the
    model computes what mlx-lm's loop computes; on: it runs."""
    _, fast = fp32_models
    assert config.VERIFY_MODEL_STEP.default is False
    calls = []
    real = verify.verify_model
    monkeypatch.setattr(verify, "verify_model", lambda *a: calls.append(1) or real(*a))
    env.unset(config.VERIFY_MODEL_STEP.name)
    cache = _prefilled(fast, mx.array([[1, 2, 3]]))
    mx.eval(fast(mx.array([[4, 5]]), cache=cache))
    assert calls == []
    env.set(config.VERIFY_MODEL_STEP.name, "1")
    mx.eval(fast(mx.array([[4, 5]]), cache=cache))
    assert calls == [1]


FALLBACKS = ["one-token", "seventeen", "rank", "no-rows", "list-ids", "short-cache", "rotating", "quantized",
             "lengths", "left-padding", "empty-state", "kv-dtype", "pipelined", "rollback-too-long",
             "moe-prefill-kernels", "stock-layer-class"]


@pytest.mark.parametrize("kind", FALLBACKS)
def test_fallbacks_decline_and_leave_the_cache(monkeypatch, env, fp32_models, kind):
    """Every condition the step does not take: None before any change to the
    cache (offsets, classes and arrays the same objects), no plan kept; the
    model's call then runs mlx-lm's loop and still computes stock's
    result."""
    stock, fast = fp32_models
    fast = copy.deepcopy(fast)
    m = fast.language_model.model
    prompt = mx.array([[5, 3, 8, 2]])
    cache = _prefilled(fast, prompt)
    tokens = mx.array([[6, 1, 7]])
    lin = next(i for i, c in enumerate(cache) if isinstance(c, ArraysCache))
    att = next(i for i, c in enumerate(cache) if isinstance(c, KVCache))
    ctx = None
    if kind == "one-token":
        tokens = tokens[:, :1]
    elif kind == "seventeen":
        tokens = mx.ones((1, verify.MAX_TOKENS + 1), mx.int32)
    elif kind == "rank":
        tokens = tokens[0]
    elif kind == "no-rows":
        tokens = mx.zeros((0, 3), mx.int32)
    elif kind == "list-ids":
        tokens = [[6, 1, 7]]
    elif kind == "short-cache":
        cache = cache[:-1]
    elif kind == "rotating":
        r = RotatingKVCache(max_size=64)
        r.update_and_fetch(cache[att].keys[..., :4, :], cache[att].values[..., :4, :])
        cache[att] = r
    elif kind == "quantized":
        cache[att] = cache[att].to_quantized(group_size=32, bits=8)
    elif kind == "lengths":
        cache[lin].lengths = mx.array([4])
    elif kind == "left-padding":
        cache[lin].left_padding = mx.array([0])
    elif kind == "empty-state":
        cache[lin][1] = None
    elif kind == "kv-dtype":
        cache[att].keys = cache[att].keys.astype(mx.bfloat16)
        cache[att].values = cache[att].values.astype(mx.bfloat16)
    elif kind == "pipelined":
        m.pipeline_size = 2  # this test's copy of the model
    elif kind == "rollback-too-long":
        ctx = speculative.rollback(m, cache, 2)  # records 2 steps: a call of 3 does not fit
        ctx.__enter__()
    elif kind == "moe-prefill-kernels":
        monkeypatch.setattr(verify.moe_ops, "implementation_for", lambda n, backend=None: "cuda-prefill")
    elif kind == "stock-layer-class":
        from mlx_lm.models.qwen3_5 import DecoderLayer

        m.layers[2].__class__ = type("Wrapped", (DecoderLayer,), {"__call__": lambda self, *a, **k:
                                                                  DecoderLayer.__call__(self, *a, **k)})
    before = _snapshot(cache)
    try:
        assert verify.verify_model(m, tokens, cache) is None
        assert _snapshot(cache) == before
        assert m.__dict__.get(verify._PLAN_ATTR) is None
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    if kind in ("lengths", "left-padding", "pipelined", "short-cache", "list-ids", "no-rows", "rank"):
        return  # the model's own call of these is mlx-lm's business (or raises there)
    env.set(config.VERIFY_MODEL_STEP.name, "1")
    c_stock = _prefilled(stock, prompt)
    if kind in ("rotating", "quantized", "kv-dtype", "empty-state"):
        return  # another cache than stock's: declining (above) is the contract checked here
    out = fast(tokens, cache=cache)
    ref = stock(tokens, cache=c_stock)
    assert_close(out, ref, FP32_TOL, "the declined call vs stock")


@pytest.mark.parametrize("S,max_steps", [(2, 3), (3, 3), (5, 8)])
def test_rollback_records_every_step(env, fp32_models, S, max_steps):
    """Inside ``speculative.rollback``: the step returns the states after
    every token, stored as ``speculative.forward`` stores them; logits,
    states and recorded steps equal the module path's (fp32), and a trim of
    any n puts back the same states."""
    _, fast = fp32_models
    fast = copy.deepcopy(fast)
    m = fast.language_model.model
    prompt = mx.array([[9, 4, 6, 2, 8]])
    c_step, c_mod = _prefilled(fast, prompt), _prefilled(fast, prompt)
    with speculative.rollback(m, c_step, max_steps), speculative.rollback(m, c_mod, max_steps):
        for i in range(2):
            tokens = mx.random.randint(1, 1000, (1, S), key=mx.random.key(S + i))
            env.set(config.VERIFY_MODEL_STEP.name, "1")
            a = verify.verify_model(m, tokens, c_step)
            assert a is not None
            env.set(config.VERIFY_MODEL_STEP.name, "0")
            b = m(tokens, cache=c_mod)
            mx.eval(a, b)
            assert_close(a, b, FP32_TOL, f"call {i}: step vs modules")
            _assert_caches_close(c_step, c_mod, f"call {i}")
            for x, y in zip(c_step, c_mod):
                if isinstance(x, speculative.RollbackArraysCache):
                    assert len(x.steps) == len(y.steps) == min(max_steps, (i + 1) * S)
                    for a, b in zip(x.steps, y.steps):
                        assert a.tokens == b.tokens
                        assert_close(a.conv, b.conv, FP32_TOL, "recorded conv state")
                        assert_close(a.rec, b.rec, FP32_TOL, "recorded recurrent state")
        for n in range(1, min(max_steps, 2 * S) + 1):
            xs, ys = copy.deepcopy(c_step), copy.deepcopy(c_mod)
            for x, y in zip(xs, ys):
                assert x.trim(n) == y.trim(n) == n
            _assert_caches_close(xs, ys, f"trim {n}")


@pytest.mark.parametrize("S", [2, 5])
def test_replay_records_the_call(monkeypatch, env, fp32_models, S):
    """The replay form (a GPU's, forced here): inside a rollback the step
    runs each Gated DeltaNet layer's own path and records the call (the
    states before it, the layer's input) as the module path records it;
    logits, states and every trim back over both calls agree (fp32)."""
    from mlx_qwen_fast import backend

    monkeypatch.setattr(speculative, "REPLAY_BACKENDS", (backend.current(),))
    _, fast = fp32_models
    fast = copy.deepcopy(fast)
    m = fast.language_model.model
    prompt = mx.array([[9, 4, 6, 2, 8]])
    c_step, c_mod = _prefilled(fast, prompt), _prefilled(fast, prompt)
    with speculative.rollback(m, c_step, 16), speculative.rollback(m, c_mod, 16):
        for i in range(2):
            tokens = mx.random.randint(1, 1000, (1, S), key=mx.random.key(31 * S + i))
            before = verify.step_count()
            env.set(config.VERIFY_MODEL_STEP.name, "1")
            a = m(tokens, cache=c_step)
            assert verify.step_count() == before + 1
            env.set(config.VERIFY_MODEL_STEP.name, "0")
            b = m(tokens, cache=c_mod)
            mx.eval(a, b)
            assert_close(a, b, FP32_TOL, f"call {i}: step vs modules")
            _assert_caches_close(c_step, c_mod, f"call {i}")
            for x, y in zip(c_step, c_mod):
                if isinstance(x, speculative.RollbackArraysCache):
                    assert [g.tokens for g in x.steps] == [g.tokens for g in y.steps] == [S] * (i + 1)
                    assert_close(x.steps[-1].inputs, y.steps[-1].inputs, FP32_TOL, "recorded input")
        for n in range(1, 2 * S + 1):
            xs, ys = copy.deepcopy(c_step), copy.deepcopy(c_mod)
            for x, y in zip(xs, ys):
                assert x.trim(n) == y.trim(n) == n
            _assert_caches_close(xs, ys, f"trim {n}")


@pytest.mark.parametrize("S,ids,rollback", [(2, (0,), False), (5, (3, 1), True), (16, (1, 2, 3), True)])
def test_hidden_is_the_layer_loops(env, fp32_models, S, ids, rollback):
    """``verify_model_hidden``: the logits' hidden states, the cache and the
    outputs of the named layers (in the order named) equal those of
    mlx-lm's loop over the same fast layers (DFlash's capture with the
    switch off), fp32, also inside a rollback (the per-step states
    recorded); a second call replays the same plan without tracing again."""
    from mlx_qwen_fast.dflash import capture

    _, fast = fp32_models
    fast = copy.deepcopy(fast)
    m = fast.language_model.model
    prompt = mx.array([[9, 4, 6, 2, 8, 1, 7]])
    c_step, c_loop = _prefilled(fast, prompt), _prefilled(fast, prompt)
    with contextlib.ExitStack() as stack:
        if rollback:
            stack.enter_context(speculative.rollback(m, c_step, MAX_STEPS))
            stack.enter_context(speculative.rollback(m, c_loop, MAX_STEPS))
        for i in range(2):
            tokens = mx.random.randint(1, 1000, (1, S), key=mx.random.key(7 * S + i))
            traces = verify.trace_count()
            got = verify.verify_model_hidden(m, tokens, c_step, ids)
            assert got is not None
            out, hidden = got
            env.set(config.VERIFY_MODEL_STEP.name, "0")
            logits, ref_hidden = capture.forward(fast, tokens, c_loop, ids)
            mx.eval(out, hidden, logits, ref_hidden)
            D = out.shape[-1]
            assert hidden.shape == (1, S, len(ids) * D) and hidden.dtype == out.dtype and finite(hidden)
            assert_close(hidden, ref_hidden, FP32_TOL, f"call {i}: layer outputs")
            assert_close(capture.text_parts(fast).lm_head(out), logits, FP32_TOL, f"call {i}: logits")
            _assert_caches_close(c_step, c_loop, f"call {i}")
            if i:
                assert verify.trace_count() == traces  # the plan and trace of the first call serve
            if rollback:
                for x, y in zip(c_step, c_loop):
                    if isinstance(x, speculative.RollbackArraysCache):
                        assert len(x.steps) == len(y.steps)
                        for a, b in zip(x.steps, y.steps):
                            assert a.tokens == b.tokens
                            assert_close(a.rec, b.rec, FP32_TOL, "recorded recurrent state")


MAX_STEPS = 16


def test_capture_forward_takes_the_step_with_the_switch(env, fp32_models):
    """DFlash's ``capture.forward`` on a patched model runs the compiled
    step when the switch is on (and not when off), with the same logits."""
    from mlx_qwen_fast.dflash import capture

    _, fast = fp32_models
    fast = copy.deepcopy(fast)
    prompt = mx.array([[3, 5, 7, 11]])
    tokens = mx.array([[2, 4, 6]])
    results = {}
    for on in ("1", "0"):
        env.set(config.VERIFY_MODEL_STEP.name, on)
        cache = _prefilled(fast, prompt)
        before = verify.step_count()
        results[on] = capture.forward(fast, tokens, cache, (0, 2))
        mx.eval(results[on])
        assert verify.step_count() - before == (on == "1")
    for a, b in zip(results["1"], results["0"]):
        assert_close(a, b, FP32_TOL, "switch on vs off")


@pytest.mark.parametrize("ids", [(), (-1,), (8,), (0, 99)])
def test_hidden_rejects_bad_layer_ids(fp32_models, ids):
    _, fast = fp32_models
    m = fast.language_model.model
    cache = _prefilled(fast, mx.array([[1, 2, 3]]))
    with pytest.raises(ValueError, match="layer_ids"):
        verify.verify_model_hidden(m, mx.array([[1, 2]]), cache, ids)


# ---------------------------------------------------------------------------
# bf16 on the kernels (CUDA; CPU-checked)
# ---------------------------------------------------------------------------

_GDN_PREFILL = ("gated_delta_frontend.cu", "gated_delta_scan.cu", "gated_rms_norm.cu")


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("S,B,block", [
    # the CPU check runs the three-launch MoE step (the one-launch block's full grid of 512-thread
    # blocks takes minutes there); the GPU runs both
    pytest.param(2, 1, "0", marks=pytest.mark.cpu_check(*_GDN_PREFILL, "moe_decode_gemv.cu", "quantized_gemv.cu")),
    (2, 1, "1"),
    (4, 1, "1"),
    (8, 2, "1"),
    (16, 1, "1"),
])
def test_cuda_step_matches_modules_bf16(monkeypatch, env, kernel_heads, S, B, block):
    """bf16 on CUDA with every kernel shape (kernel_heads): the step (GDN
    prefill kernels and, for B*S <= 4 rows, the MoE decode step traced
    inside) gives the module path's logits and cache states within bf16
    rounding: the two paths round independently at the fused MoE step's
    norm and residual (two points per layer) and at the final norm."""
    env.set(config.MOE_BLOCK_KERNEL.name, block)
    stock, _ = build_model(kernel_heads, seed=3, dtype=mx.bfloat16)
    fast, _ = patched_copy(stock, warn=False)
    m = fast.language_model.model
    prompt = mx.random.randint(1, 1000, (B, 40), key=mx.random.key(S))
    c_step, c_mod = _prefilled(fast, prompt), _prefilled(fast, prompt)
    tokens = mx.random.randint(1, 1000, (B, S), key=mx.random.key(S + 1))
    env.set(config.VERIFY_MODEL_STEP.name, "1")
    a = verify.verify_model(m, tokens, c_step)
    assert a is not None
    env.set(config.VERIFY_MODEL_STEP.name, "0")
    b = m(tokens, cache=c_mod)
    mx.eval(a, b)
    assert finite(a)
    tol = tolerance(mx.bfloat16, roundings=2 * len(m.layers) + 1)
    assert_close(a, b, tol, "step vs modules")
    # the states (fp32 Gated DeltaNet states included) are made from the layers' bf16 activations,
    # which the two paths round independently at the same points as the logits: the bf16 bound
    for x, y in zip(c_step, c_mod):
        for u, v in zip(_valid(x), _valid(y)):
            assert u.shape == v.shape and u.dtype == v.dtype
            assert_close(u, v, tol, "cache state")


def test_step_orders_its_first_grid_launch_after_the_previous_call(monkeypatch, fp32_models):
    """The verify step offers the previous call's output to the first
    grid-barrier launch of its trace (ops._launch_order), as the decode step
    does: a stand-in MoE part (as the one-launch block's step takes the
    offer) records what it was offered; eagerly (compilation off), at every
    call exactly the first layer's part takes something -- the call's own
    hidden input first, then the previous call's output (S unchanged)."""
    from mlx_qwen_fast.ops import _launch_order, model_plan

    taken = []

    def stand_in(layer, x):
        def fn(h, n2):
            taken.append(_launch_order.take())
            return h + layer.mlp(layer.post_attention_layernorm(h))

        return "parts", fn, ()

    monkeypatch.setattr(verify, "_moe_step", stand_in)
    _, fast = fp32_models
    fast = copy.deepcopy(fast)
    m = fast.language_model.model
    cache = _prefilled(fast, mx.array([[3, 1, 4, 1, 5, 9, 2, 6]]))
    prev = None
    mx.disable_compile()
    try:
        for i in range(3):
            tokens = mx.array([[10 + i, 20 + i]])
            taken.clear()
            out = verify.verify_model(m, tokens, cache)
            assert out is not None
            mx.eval(out)
            assert len(taken) == len(m.layers) and taken[0] is not None, "the first part takes the offer"
            assert all(t is None for t in taken[1:])
            want = model_plan.embed_ids(m, tokens) if prev is None else prev
            assert taken[0].shape == want.shape and mx.array_equal(taken[0], want).item(), f"call {i}"
            prev = out
    finally:
        mx.enable_compile()
