"""ops.decoder (the decode planner), ops.layer_plans and ops.model_plan (the
layer and whole-stack steps it reaches), ops.kv_buffers (their KV room): a
decoder layer's one-token step as one compiled call, against the stock
layer (mlx-lm's ``DecoderLayer.__call__``) on fresh random models.

CPU: the gated-attention layers take the compiled step (its MoE block as a
module call); the Gated DeltaNet layers have no kernel there and stay stock.
CUDA: both kinds take it, the MoE decode step inside the same call. Metal
(simulated by ``tests/metal_check.py``): the attention step with the Metal
decode-attention kernels.
"""

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

from compare import BF16_EPS, FP32_TOL, GATHER_QMM_TOL, assert_close, finite, rel_err
from mlx_qwen_fast import config, patched_copy
from mlx_qwen_fast.checkpoint import build_model
from mlx_qwen_fast.ops import attention as attention_ops
from mlx_qwen_fast.ops import decoder, kv_buffers, layer_plans, model_plan

from cuda_helpers import HAS_CUDA


def _models(seed, dtype=mx.float32, preset="tiny"):
    model, _ = build_model(preset, seed=seed, dtype=dtype)
    fast, report = patched_copy(model, warn=False)
    assert report.patched and report.swapped.get("decoder_layer") == len(model.layers)
    return model, fast


def _arrays(cache):
    return [v for c in cache for _, v in tree_flatten(c.state) if isinstance(v, mx.array)]


def _valid(cache):
    """The cache with each KVCache's buffers cut to its offset (the decode
    step grows them in larger steps than stock: ops.kv_buffers.KV_GROWTH)."""
    out = []
    for c in cache:
        if isinstance(c, KVCache) and c.keys is not None:
            v = KVCache()
            v.keys, v.values, v.offset = c.keys[..., :c.offset, :], c.values[..., :c.offset, :], c.offset
            c = v
        out.append(c)
    return out


def _spy(monkeypatch):
    """Count the compiled layer steps that ran, by layer kind."""
    taken = {"linear": 0, "attention": 0}
    real = decoder.decode_layer

    def spy(layer, x, cache):
        out = real(layer, x, cache)
        if out is not None:
            taken["linear" if layer.is_linear else "attention"] += 1
        return out

    monkeypatch.setattr(decoder, "decode_layer", spy)
    return taken


def _attention_inputs(stock, fast, ctx, kv_dtype=mx.float32, seed=1):
    """The first attention layer's index, a KV cache per engine holding the
    same ``ctx`` random rows (``kv_dtype``), and one fresh fp32 token's input."""
    i = next(j for j, l in enumerate(fast.layers) if not l.is_linear)
    c1, c2 = KVCache(), KVCache()
    pre = mx.random.normal((1, 2, ctx, 64), key=mx.random.key(seed)).astype(kv_dtype)
    c1.update_and_fetch(pre, pre)
    c2.update_and_fetch(mx.array(pre), mx.array(pre))
    return i, c1, c2, mx.random.normal((1, 1, 256), key=mx.random.key(seed + 1))


def _decode_pair(stock, fast, prompt_len, steps, batch=1, seed=0, make_cache=make_prompt_cache):
    """Prefill the same random prompt in both engines, then decode ``steps``
    tokens teacher-forced (both fed stock's greedy token); returns the two
    logits per step and the two caches."""
    vocab = stock.language_model.args.vocab_size
    prompt = mx.random.randint(1, vocab, (batch, prompt_len), key=mx.random.key(seed))
    cs, cf = make_cache(stock), make_cache(fast)
    a, b = stock(prompt, cache=cs), fast(prompt, cache=cf)
    mx.eval(a, b, _arrays(cs), _arrays(cf))
    tok = mx.argmax(a[:, -1], -1)
    out = []
    for _ in range(steps):
        a, b = stock(tok[:, None], cache=cs), fast(tok[:, None], cache=cf)
        mx.eval(a, b)
        out.append((a, b))
        tok = mx.argmax(a[:, -1], -1)
    return out, cs, cf


@pytest.mark.parametrize("prompt_len,steps,batch", [(1, 3, 1), (250, 12, 1), (255, 2, 1), (256, 2, 1), (40, 6, 2)])
def test_attention_layer_step_matches_stock(monkeypatch, prompt_len, steps, batch):
    """fp32: logits and every cache array as stock's, across the cache's
    256-position growth (prompt 250 + 12 steps, 255 + 2, 256 + 2) and for
    two rows; the compiled step ran for every attention layer and step."""
    taken = _spy(monkeypatch)
    stock, fast = _models(seed=prompt_len)
    pairs, cs, cf = _decode_pair(stock, fast, prompt_len, steps, batch, seed=steps)
    for i, (a, b) in enumerate(pairs):
        assert finite(b)
        assert_close(b, a, FP32_TOL, f"logits at step {i}")
        assert (mx.argmax(a[:, -1], -1) == mx.argmax(b[:, -1], -1)).all().item()
    n_attn = sum(not l.is_linear for l in fast.layers)
    assert taken["attention"] == n_attn * steps
    for x, y in zip(_arrays(_valid(cs)), _arrays(_valid(cf))):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert_close(y, x, FP32_TOL, "cache array")
    kv = [(c1, c2) for c1, c2 in zip(cs, cf) if isinstance(c1, KVCache)]
    assert all(c1.offset == c2.offset == prompt_len + steps for c1, c2 in kv)
    for c1, c2 in kv:  # grown as stock grows it where stock's buffer had room, else to KV_GROWTH multiples
        cap = c1.keys.shape[2]
        grown = -(-c2.offset // kv_buffers.KV_GROWTH) * kv_buffers.KV_GROWTH
        assert c2.keys.shape[2] in (cap, grown) and c2.keys.shape[:2] == c1.keys.shape[:2]


def test_layer_step_outputs_and_stock_layer_agree_bf16():
    """bf16 (the checkpoint's dtype): the compiled attention step within
    bf16 rounding of the stock layer, one layer alone, fresh inputs."""
    stock, fast = _models(seed=7, dtype=mx.bfloat16)
    i = next(j for j, l in enumerate(fast.layers) if not l.is_linear)
    for ctx in (1, 255, 256, 257):
        c1, c2 = KVCache(), KVCache()
        kv = mx.random.normal((1, 2, ctx, 64), key=mx.random.key(ctx)).astype(mx.bfloat16)
        c1.update_and_fetch(kv, kv * 0.5)
        c2.update_and_fetch(mx.array(kv), mx.array(kv * 0.5))
        x = mx.random.normal((1, 1, 256), key=mx.random.key(ctx + 1)).astype(mx.bfloat16)
        ref = layer_plans.decode_layer_reference(stock.layers[i], x, c1)
        got = layer_plans.decode_layer(fast.layers[i], x, c2)
        assert got is not None
        mx.eval(ref, got)
        assert_close(got, ref, GATHER_QMM_TOL, f"context {ctx}")
        assert_close(c2.keys[..., : ctx + 1, :], c1.keys[..., : ctx + 1, :], 0.0, "keys written")


@pytest.mark.parametrize("kind", ["rotating", "quantized", "mask", "prefill", "switch-off", "no-cache"])
def test_other_calls_take_the_stock_layer(monkeypatch, env, kind):
    """Caches other than the plain KVCache (``--max-kv-size``, ``kv_bits``),
    a mask, several tokens, the switch off, no cache: the stock layer runs,
    outputs identical to the stock model's."""
    taken = _spy(monkeypatch)
    stock, fast = _models(seed=3)
    i = next(j for j, l in enumerate(fast.layers) if not l.is_linear)
    x = mx.random.normal((1, 4 if kind == "prefill" else 1, 256), key=mx.random.key(2))
    mask = None

    def cache():
        if kind == "rotating":
            return RotatingKVCache(max_size=8)
        if kind == "quantized":
            return QuantizedKVCache(group_size=32, bits=8)
        return KVCache()

    if kind == "switch-off":
        env.set(config.DECODE_LAYER_STEP.name, "0")
    c1, c2 = cache(), cache()
    if kind != "no-cache":
        pre = mx.random.normal((1, 2, 5, 64), key=mx.random.key(4))
        c1.update_and_fetch(pre, pre)
        c2.update_and_fetch(mx.array(pre), mx.array(pre))
    else:
        c1 = c2 = None
    if kind == "mask":
        mask = mx.ones((1, 1, 1, 6), dtype=mx.bool_)
    ref = stock.layers[i](x, mask, c1)
    got = fast.layers[i](x, mask, c2)
    mx.eval(ref, got)
    assert taken["attention"] == 0
    assert_close(got, ref, 0.0, kind)


def test_replaced_weights_are_read(monkeypatch):
    """A projection replaced after the first step (``update``) is what the
    next step reads: the plan is rebuilt, output as stock's with the new weights."""
    stock, fast = _models(seed=11)
    i, c1, c2, x = _attention_inputs(stock, fast, 3)
    mx.eval(fast.layers[i](x, None, c2), stock.layers[i](x, None, c1))
    new = {k: v * 1.5 for k, v in tree_flatten(stock.layers[i].self_attn.k_proj.parameters())
           if k != "weight"}  # new scales and biases (the packed weight stays): new arrays, new values
    stock.layers[i].self_attn.k_proj.update(new)
    fast.layers[i].self_attn.k_proj.update(dict(new))
    ref, got = stock.layers[i](x, None, c1), fast.layers[i](x, None, c2)
    mx.eval(ref, got)
    assert_close(got, ref, FP32_TOL, "after update")


def test_compile_over_the_model_state_takes_the_stock_layer():
    """``mx.compile(fn, inputs=model.state)`` traces the model's arrays: a
    plan cannot be made from tracers, so the call runs the stock layer
    (result as stock's) and the model works as before afterwards."""
    stock, fast = _models(seed=6)
    toks = mx.array([[5, 9, 17, 33, 2, 8]])
    got = []
    for m in (stock, fast):
        def score(t, m=m):
            c = make_prompt_cache(m)
            m(t[:, :-1], cache=c)
            return m(t[:, -1:], cache=c)[:, -1]

        got.append(mx.compile(score, inputs=m.state, outputs=m.state)(toks))
    assert_close(got[1], got[0], FP32_TOL, "compiled over the state")
    pairs, _, _ = _decode_pair(stock, fast, 7, 3)  # and the fast path still runs after the trace
    for a, b in pairs:
        assert_close(b, a, FP32_TOL, "after the trace")


def test_replaced_rope_scale_or_eps_make_a_new_plan():
    """Settings the compiled step bakes in that are not arrays (the RoPE
    module, the attention scale, the norms' eps): changed after a step, the
    next step follows them, as stock does."""
    import mlx.nn as nn

    stock, fast = _models(seed=12)
    i, c1, c2, x = _attention_inputs(stock, fast, 3)

    def step(what):
        ref, got = stock.layers[i](x, None, c1), fast.layers[i](x, None, c2)
        mx.eval(ref, got)
        assert_close(got, ref, FP32_TOL, what)

    step("first")
    for m in (stock, fast):
        r = m.layers[i].self_attn.rope
        m.layers[i].self_attn.rope = nn.RoPE(r.dims, traditional=r.traditional, base=r.base, scale=0.25)
    step("new RoPE")
    for m in (stock, fast):
        m.layers[i].self_attn.scale = 0.5
        m.layers[i].post_attention_layernorm.eps = 1e-2
    step("new scale and eps")


def test_deepcopy_and_unpatch_after_decoding():
    """The cached plans are dropped by unpatch and not copied by deepcopy
    (mlx-lm's dynamic quantisation deep-copies models)."""
    import copy

    from mlx_lm.generate import generate_step

    from mlx_qwen_fast import unpatch

    stock, fast = _models(seed=13)
    next(generate_step(mx.array([1, 2, 3]), fast))
    twin = copy.deepcopy(fast)
    pairs, _, _ = _decode_pair(stock, twin, 5, 2)
    for a, b in pairs:
        assert_close(b, a, FP32_TOL, "deep copy")
    unpatch(fast)
    assert not any("_mqf_step_plans" in m.__dict__ for l in fast.layers
                   for m in [l] + [getattr(l, n) for n in ("linear_attn", "self_attn", "mlp") if hasattr(l, n)])
    copy.deepcopy(fast)


def test_a_cache_of_another_dtype_grows_as_stock_grows_it():
    """A bf16 K/V cache under fp32 activations (a bf16-saved prompt cache in
    an fp32 model): at the 256-position growth stock promotes the buffers
    to fp32; so does the step."""
    stock, fast = _models(seed=14)
    i, c1, c2, x = _attention_inputs(stock, fast, 256, mx.bfloat16)
    ref, got = stock.layers[i](x, None, c1), fast.layers[i](x, None, c2)
    mx.eval(ref, got)
    assert c2.keys.dtype == c1.keys.dtype == mx.float32 and c2.keys.shape[2] == kv_buffers.KV_GROWTH
    assert_close(got, ref, FP32_TOL, "after growth")
    assert_close(c2.keys[..., :c2.offset, :], c1.keys[..., :c1.offset, :], FP32_TOL, "keys")


@pytest.mark.parametrize("prev,cap,step,want", [(256, 256, 256, 4096), (4096, 4096, 256, 8192),
                                                (300, 300, 256, 4096), (5000, 5000, 8192, 8192), (10, 12, 256, 12)])
def test_room_grows_to_multiples_of_kv_growth(prev, cap, step, want):
    """A full buffer grows to the next multiple of max(KV_GROWTH, step)
    (cut to the offset first where stock's buffer was not a multiple), the
    rows before the offset kept, zeros after; a buffer with room is left
    alone."""
    c = KVCache()
    c.step = step
    k = mx.random.normal((1, 2, cap, 8), key=mx.random.key(prev))
    c.keys, c.values, c.offset = k, 2 * k, prev
    assert kv_buffers.make_room(c, mx.float32, 1, 2, 8)
    assert c.keys.shape == c.values.shape == (1, 2, want, 8) and c.offset == prev
    assert mx.array_equal(c.keys[..., :prev, :], k[..., :prev, :]).item()
    assert mx.array_equal(c.values[..., :prev, :], 2 * k[..., :prev, :]).item()
    if want != cap:
        assert not mx.any(c.keys[..., prev:, :]).item()
    assert c.keys_and_values()[0].shape[2] == prev  # what mlx-lm's attention reads: up to the offset
    assert not kv_buffers.make_room(c, mx.float32, 2, 2, 8)  # another batch: nothing changes


def test_unpatch_restores_the_stock_layer_class():
    from mlx_lm.models.qwen3_5 import DecoderLayer

    from mlx_qwen_fast import unpatch

    _, fast = _models(seed=1)
    assert all(type(l) is not DecoderLayer for l in fast.layers)
    assert unpatch(fast)["decoder_layer"] == len(fast.layers)
    assert all(type(l) is DecoderLayer for l in fast.layers)


def test_linear_layer_step_composes_its_parts(monkeypatch):
    """The Gated DeltaNet layer's compiled step (CUDA parts on the GPU) with
    stand-in parts on the CPU: the norms, residuals, the arrays each part
    reads in their order, its extra arrays, the new cache states and the
    offset; an array that only decides the plan (here the GDN norm weight),
    replaced, makes a new plan."""
    from mlx_qwen_fast.ops import decoder as dec

    made = []

    eps_seen = []

    def gdn_parts(layer, x, cache, input_norm_eps, input_norm_weight=None):
        made.append("gdn")
        eps_seen.append(input_norm_eps)

        def fn(x, cs, st, n1, a_log, dt_bias, e):  # x + mixer(rms_norm(x)) with the layer's own eps
            return x + mx.fast.rms_norm(x, n1, input_norm_eps) * a_log.sum() + dt_bias.sum() + e, cs + 1, st * 0.5

        return (("A_log",), ("dt_bias",), ("norm", "weight")), fn, 2, (mx.array(3.0),)

    def moe_parts(block, x, norm_eps):
        eps_seen.append(norm_eps)
        return (("shared_expert_gate", "weight"),), lambda h, n2, w: h + 3 * mx.fast.rms_norm(h, n2, norm_eps) + 0 * w.sum()

    monkeypatch.setattr(dec.gated_delta_ops, "decode_step_parts", gdn_parts)
    monkeypatch.setattr(dec.moe_ops, "decode_step_parts", moe_parts)
    _, fast = _models(seed=15)
    layer = next(l for l in fast.layers if l.is_linear)
    la = layer.linear_attn
    cache = make_prompt_cache(fast)[0]
    cs, st = mx.random.normal((1, 3, la.conv_dim)), mx.random.normal((1, la.num_v_heads, la.head_v_dim, la.head_k_dim))
    cache[0], cache[1] = cs, st
    x = mx.random.normal((1, 1, 256), key=mx.random.key(3))
    rms = lambda v, n: mx.fast.rms_norm(v, n.weight, n.eps)  # noqa: E731
    h = x + rms(x, layer.input_layernorm) * la.A_log.sum() + la.dt_bias.sum() + 3.0
    ref = h + 3 * rms(h, layer.post_attention_layernorm)
    got = dec.decode_layer(layer, x, cache)
    assert_close(got, ref, FP32_TOL, "composed step")
    assert_close(cache[0], cs + 1, 0.0, "conv state")
    assert_close(cache[1], st * 0.5, 0.0, "state")
    assert made == ["gdn"]
    assert sorted(eps_seen) == sorted([layer.input_layernorm.eps, layer.post_attention_layernorm.eps])
    dec.decode_layer(layer, x, cache)
    assert made == ["gdn"]  # the plan is reused
    la.norm.weight = la.norm.weight * 1.0
    dec.decode_layer(layer, x, cache)
    assert made == ["gdn", "gdn"]


def test_bad_input_declines():
    """Not an array, rank other than 3, more than one token, no rows: None
    (the stock layer then raises or runs as it would)."""
    _, fast = _models(seed=2)
    layer = next(l for l in fast.layers if not l.is_linear)
    c = KVCache()
    assert layer_plans.decode_layer(layer, [[1.0]], c) is None
    assert layer_plans.decode_layer(layer, mx.zeros((1, 256)), c) is None
    assert layer_plans.decode_layer(layer, mx.zeros((1, 2, 256)), c) is None
    assert layer_plans.decode_layer(layer, mx.zeros((0, 1, 256)), c) is None
    assert layer_plans.decode_layer(layer, mx.zeros((1, 1, 256)), c) is None  # empty cache: stock's first write


def test_metal_attention_layer_step_takes_the_metal_kernels(monkeypatch, env, kernel_heads, tmp_path):
    """Metal (the backend seen as Metal, MLX's Metal device as available),
    fp32, the model's attention heads (16 / 2 of 256): with
    ``MLX_QWEN_FAST_METAL=1`` the attention layer's step is planned and
    traced anew and calls the Metal kernels: decode attention, and the
    residual add fused with the post-attention RMSNorm, whose rows the step
    hands on (``plan.normed``). Its compiled form traces them (exported:
    nothing here runs Metal); run uncompiled through the checker
    (``tests/metal_check.py`` runs a kernel outside ``mx.compile`` only) it
    equals the step with the switch off (MLX's ops; the norm then the
    caller's), one-pass and split-K capacities."""
    import metal_check as mc
    from mlx_qwen_fast import backend
    from mlx_qwen_fast.kernels import add_rms_norm_metal as arn
    from mlx_qwen_fast.kernels import attention_decode_metal as adm

    if mc.CXX is None:
        pytest.skip("no C++ compiler (g++) to build the Metal sources")
    monkeypatch.setattr(backend, "current", lambda: backend.METAL)
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)  # the kernels' supports() ask it
    _, fast = _models(seed=9, preset=kernel_heads)
    i = next(j for j, l in enumerate(fast.layers) if not l.is_linear)
    layer = fast.layers[i]
    for ctx, kind in ((200, "single"), (300, "split")):
        cache = KVCache()
        pre = mx.random.normal((1, 2, ctx, 256), key=mx.random.key(ctx))
        cache.update_and_fetch(pre, pre * 0.5)
        x = mx.random.normal((1, 1, 256), key=mx.random.key(ctx + 1))
        steps, normed = {}, {}
        for on in ("0", "1"):
            env.set(config.METAL_KERNELS.name, on)
            key, arrays, plan = layer_plans.layer_entry(layer, x, cache)
            normed[on] = plan.normed
            assert kv_buffers.make_room(cache, x.dtype, 1, plan.kv_heads, plan.head_dim)
            steps[on] = (key, plan.fn, plan.raw, (x, cache.keys, cache.values, mx.array(ctx, mx.int32),
                                                  *arrays[:plan.n_in], *plan.extra))
        assert steps["0"][0] != steps["1"][0] and steps["0"][1] is not steps["1"][1]  # a plan and trace each
        assert normed == {"0": False, "1": True}
        _, _, raw_off, args = steps["0"]
        env.set(config.METAL_KERNELS.name, "0")  # the switch is read while the step runs (or traces)
        ref = raw_off(*args)
        mx.eval(ref)
        env.set(config.METAL_KERNELS.name, "1")
        _, compiled, raw_on, args = steps["1"]
        traced, real, real_add_norm = [], adm.attention_decode_metal, arn.add_rms_norm_metal
        with monkeypatch.context() as m:
            m.setattr(adm, "attention_decode_metal", lambda *a, **k: traced.append("attention") or real(*a, **k))
            m.setattr(arn, "add_rms_norm_metal", lambda *a, **k: traced.append("add_norm") or real_add_norm(*a, **k))
            mx.export_function(str(tmp_path / f"step{ctx}.mlxfn"), compiled, *args)  # traced, not run
        assert traced == ["attention", "add_norm"]
        with mc.simulated_modules(adm.__name__, arn.__name__) as (sim, sim_arn):
            got = raw_on(*args)
            mx.eval(got)
            assert sim._KERNELS[kind].calls == 1 and sim_arn._kernel().calls == 1
        assert len(got) == 4 and finite(got[0], got[3])
        assert_close(got[0], ref[0], FP32_TOL, f"layer output at context {ctx + 1}")
        assert_close(got[1], ref[1], FP32_TOL, "keys")
        assert_close(got[2], ref[2], 0.0, "values")
        assert_close(got[3], layer.post_attention_layernorm(ref[0]), FP32_TOL, "post-attention RMSNorm rows")


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("batch", [1, 2])
def test_cuda_whole_layer_steps_match_module_path(monkeypatch, env, kernel_heads, batch):
    """CUDA, bf16: both layer kinds take the compiled step (GDN decode kernel,
    decode-attention kernels and MoE decode kernels inside); logits over 40
    teacher-forced steps (the cache crosses 256 positions) within bf16
    rounding of the same model with the step off (the modules one by one)
    and with the attention kernels off; against stock, the bound of
    tests/test_patch.py: the error against the fp32 model (the same weights,
    fp32 activations, the same tokens) at most twice stock's bf16 error plus
    four unit roundoffs, as root mean squares over the 40 steps (on random
    weights one step's bf16 error is chaotic, so neither the two bf16 paths
    nor single steps are compared directly)."""
    assert HAS_CUDA
    env.set(config.DECODE_MODEL_STEP.name, "0")  # the layer steps one by one (the model step: below)
    taken = _spy(monkeypatch)
    kernel_calls = []
    real = attention_ops._k_decode.attention_decode
    monkeypatch.setattr(attention_ops._k_decode, "attention_decode",
                        lambda *a, **k: kernel_calls.append(1) or real(*a, **k))
    stock, fast = _models(seed=5, dtype=mx.bfloat16, preset=kernel_heads)
    assert fast.layers[3].self_attn.head_dim == 256
    pairs, _, _ = _decode_pair(stock, fast, 230, 40, batch, seed=batch)
    n_linear = sum(l.is_linear for l in fast.layers)
    assert taken == {"linear": n_linear * 40, "attention": (len(fast.layers) - n_linear) * 40}
    assert kernel_calls  # traced into the attention layer's step
    env.set(config.ATTENTION_DECODE_KERNEL.name, "0")
    _, no_kernel = _models(seed=5, dtype=mx.bfloat16, preset=kernel_heads)
    pairs_nk, _, _ = _decode_pair(stock, no_kernel, 230, 40, batch, seed=batch)
    env.set(config.DECODE_LAYER_STEP.name, "0")
    _, off = _models(seed=5, dtype=mx.bfloat16, preset=kernel_heads)
    pairs_off, _, _ = _decode_pair(stock, off, 230, 40, batch, seed=batch)
    stock32 = copy.deepcopy(stock)
    stock32.set_dtype(mx.float32)
    pairs32, _, _ = _decode_pair(stock, stock32, 230, 40, batch, seed=batch)  # stock's tokens again
    err_fast, err_stock = [], []
    for i, ((a, b), (_, c), (_, d), (_, e)) in enumerate(zip(pairs, pairs_off, pairs_nk, pairs32)):
        assert finite(b)
        assert_close(b, c, GATHER_QMM_TOL, f"step {i}: layer step vs modules")
        assert_close(b, d, GATHER_QMM_TOL, f"step {i}: attention kernels vs MLX's ops")
        err_fast.append(rel_err(b, e))
        err_stock.append(rel_err(a, e))
    # over the 40 steps (one step's error is chaotic: a near-tie expert choice flips)
    rms_fast, rms_stock = float(np.sqrt(np.mean(np.square(err_fast)))), float(np.sqrt(np.mean(np.square(err_stock))))
    assert rms_fast <= 2 * rms_stock + 4 * BF16_EPS, (
        f"bf16 error vs fp32 over the steps (rms): layer step {rms_fast:.2e}, stock {rms_stock:.2e}; per step "
        f"layer step {np.round(err_fast, 4).tolist()}, stock {np.round(err_stock, 4).tolist()}")


# ---------------------------------------------------------------------------
# the whole layer stack in one compiled call
# ---------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("mixer", ["0", "1"])
def test_cuda_model_step_matches_the_layer_steps(monkeypatch, env, kernel_heads, batch, mixer):
    """CUDA, bf16, every kernel inside: the whole stack in one compiled call
    gives the logits of one compiled call per layer within bf16 rounding at
    each of 40 teacher-forced steps (the cache crossing 256 positions), and
    it ran for every decode token (the prompt took mlx-lm's stack). With
    ``mixer`` the stack runs the one-launch GDN mixer
    (``config.GDN_MIXER_KERNEL``) inside the one-launch layer
    (``config.GDN_LAYER_KERNEL``), and the layer steps its three
    launches."""
    assert HAS_CUDA
    env.set(config.GDN_MIXER_KERNEL.name, mixer)
    env.set(config.GDN_LAYER_KERNEL.name, mixer)  # with the mixer: the one-launch layer
    ran = []
    real = decoder.decode_model

    def spy(m, inputs, cache):
        out = real(m, inputs, cache)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(decoder, "decode_model", spy)
    stock, fast = _models(seed=5, dtype=mx.bfloat16, preset=kernel_heads)
    pairs, cs, cf = _decode_pair(stock, fast, 230, 40, batch, seed=batch)
    assert ran.count(True) == 40 and ran[0] is False  # the prompt: not a decode call
    env.set(config.DECODE_MODEL_STEP.name, "0")
    env.set(config.GDN_MIXER_KERNEL.name, "0")
    _, off = _models(seed=5, dtype=mx.bfloat16, preset=kernel_heads)
    pairs_off, _, co = _decode_pair(stock, off, 230, 40, batch, seed=batch)
    for i, ((_, b), (_, c)) in enumerate(zip(pairs, pairs_off)):
        assert finite(b)
        assert_close(b, c, GATHER_QMM_TOL, f"step {i}: model step vs layer steps")
    for x, y in zip(_arrays(cf), _arrays(co)):
        assert x.shape == y.shape and x.dtype == y.dtype


def _stand_in_parts(monkeypatch):
    """Stand-ins for the CUDA-only GDN and MoE decode steps, so that every
    layer takes its whole compiled step on the CPU; returns the list of
    the GDN plans made."""
    from mlx_qwen_fast.ops import decoder as dec

    made = []

    def gdn_parts(layer, x, cache, input_norm_eps, input_norm_weight=None):
        made.append("gdn")

        def fn(x, cs, st, n1, a_log, dt_bias, e):
            y = mx.fast.rms_norm(x, n1, input_norm_eps) * a_log.sum() + dt_bias.sum() * st.mean() + e
            return x + y, cs * 0.5 + x.sum(), st * 0.9 + cs.mean()

        return (("A_log",), ("dt_bias",), ("norm", "weight")), fn, 2, (mx.array(0.25),)

    def moe_parts(block, x, norm_eps):
        def fn(h, n2, w):
            return h + mx.tanh(mx.fast.rms_norm(h, n2, norm_eps) * (1.0 + w.mean()))

        return (("shared_expert_gate", "scales"),), fn  # a float array of the (quantised) gate

    monkeypatch.setattr(dec.gated_delta_ops, "decode_step_parts", gdn_parts)
    monkeypatch.setattr(dec.moe_ops, "decode_step_parts", moe_parts)
    return made


def _prefilled(model, prompt, make_cache=make_prompt_cache):
    cache = make_cache(model)
    mx.eval(model(prompt, cache=cache), _arrays(cache))
    return cache


@pytest.mark.parametrize("prompt_len,steps,batch", [(3, 4, 1), (254, 4, 1), (256, 2, 1), (9, 3, 2)])
def test_model_step_equals_the_layer_steps(monkeypatch, env, prompt_len, steps, batch):
    """Every layer in one compiled call (stand-in GDN and MoE parts, the
    real attention step): the same logits and cache arrays as one compiled
    call per layer, across the KV buffers' growth and for two rows; the
    model step ran for every token and no layer step ran alone."""
    _stand_in_parts(monkeypatch)
    _, fast = _models(seed=prompt_len + batch)
    vocab = fast.language_model.args.vocab_size
    prompt = mx.random.randint(1, vocab, (batch, prompt_len), key=mx.random.key(prompt_len))
    c_model, c_layer = _prefilled(fast, prompt), _prefilled(fast, prompt)
    ran = {"model": 0, "layer": 0}
    real_model, real_layer = decoder.decode_model, decoder.decode_layer

    def spy_model(m, inputs, cache):
        out = real_model(m, inputs, cache)
        ran["model"] += out is not None
        return out

    def spy_layer(layer, x, cache):
        ran["layer"] += 1
        return real_layer(layer, x, cache)

    monkeypatch.setattr(decoder, "decode_model", spy_model)
    monkeypatch.setattr(decoder, "decode_layer", spy_layer)
    tok = mx.random.randint(1, vocab, (batch, 1), key=mx.random.key(7))
    for i in range(steps):
        env.set(config.DECODE_MODEL_STEP.name, "1")
        a = fast(tok, cache=c_model)
        mx.eval(a)
        assert ran == {"model": i + 1, "layer": i * len(fast.layers)}
        env.set(config.DECODE_MODEL_STEP.name, "0")
        b = fast(tok, cache=c_layer)
        mx.eval(b)
        assert ran["layer"] == (i + 1) * len(fast.layers)
        assert finite(a)
        assert_close(a, b, FP32_TOL, f"logits at step {i}")
        tok = mx.argmax(b[:, -1:], -1)
    for x, y in zip(_arrays(c_model), _arrays(c_layer)):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert_close(x, y, FP32_TOL, "cache array")
    assert [c.offset for c in c_model if isinstance(c, KVCache)] == [prompt_len + steps] * sum(
        isinstance(c, KVCache) for c in c_model)
    assert all(c1.keys.shape == c2.keys.shape for c1, c2 in zip(c_model, c_layer) if isinstance(c1, KVCache))


def test_model_step_reads_replaced_weights(monkeypatch):
    """A weight replaced after the first token (``model.update``) is read by
    the next token's model step: its logits change as the layer steps'."""
    made = _stand_in_parts(monkeypatch)
    _, fast = _models(seed=31)
    prompt = mx.array([[5, 6, 7]])
    cache = _prefilled(fast, prompt)
    tok = mx.array([[3]])
    first = fast(tok, cache=copy.deepcopy(cache))
    n_plans = len(made)
    layer = next(l for l in fast.layers if not l.is_linear)
    layer.post_attention_layernorm.weight = layer.post_attention_layernorm.weight * 3.0
    second = fast(tok, cache=copy.deepcopy(cache))
    mx.eval(first, second)
    assert rel_err(second, first) > 1e-3
    layer_steps = fast(tok, cache=copy.deepcopy(cache))
    assert_close(second, layer_steps, FP32_TOL, "after the update")
    assert len(made) == n_plans  # the GDN layers' plans were kept: only the changed layer planned again


@pytest.mark.parametrize("kind", ["embeddings", "prompt", "no-cache", "one-layer-stock", "switch-off",
                                  "layer-switch-off", "rotating"])
def test_other_calls_take_the_stock_stack(monkeypatch, env, kind):
    """Embeddings given, more than one token, no cache, a layer without its
    whole step, either switch off, another cache type: no model step (None
    or not called), and the call computes what the stock stack computes."""
    _stand_in_parts(monkeypatch)
    stock, fast = _models(seed=41)
    prompt = mx.array([[4, 9, 2]])
    make = make_prompt_cache
    if kind == "rotating":
        def make(m):  # noqa: E306
            return [RotatingKVCache(max_size=64) if isinstance(c, KVCache) else c for c in make_prompt_cache(m)]
    cache = _prefilled(fast, prompt, make)
    ran = []
    real = decoder.decode_model
    monkeypatch.setattr(decoder, "decode_model", lambda m, i, c: ran.append(real(m, i, c)) or ran[-1])
    tok = mx.array([[8]])
    if kind == "one-layer-stock":
        from mlx_qwen_fast.ops import decoder as dec
        monkeypatch.setattr(dec.moe_ops, "decode_step_parts", lambda block, x, norm_eps: None)
    if kind == "switch-off":
        env.set(config.DECODE_MODEL_STEP.name, "0")
    if kind == "layer-switch-off":
        env.set(config.DECODE_LAYER_STEP.name, "0")
    if kind == "embeddings":
        emb = fast.model.embed_tokens(tok)
        out = fast.model(tok, cache=cache, input_embeddings=emb)
    elif kind == "prompt":
        out = fast.model(mx.array([[8, 1]]), cache=cache)
    elif kind == "no-cache":
        out = fast.model(tok)
    else:
        out = fast.model(tok, cache=cache)
    mx.eval(out)
    assert all(r is None for r in ran)
    assert finite(out)


def test_model_step_bad_input_declines(monkeypatch):
    """Ids of rank other than 2, more than one position, no rows, a cache of
    another length: None, the caches untouched."""
    _stand_in_parts(monkeypatch)
    _, fast = _models(seed=43)
    cache = _prefilled(fast, mx.array([[1, 2]]))
    before = [c.offset for c in cache if isinstance(c, KVCache)]
    m = fast.model
    assert model_plan.decode_model(m, mx.array([1]), cache) is None
    assert model_plan.decode_model(m, mx.array([[1, 2]]), cache) is None
    assert model_plan.decode_model(m, mx.zeros((0, 1), mx.int32), cache) is None
    assert model_plan.decode_model(m, mx.array([[1]]), cache[:-1]) is None
    assert model_plan.decode_model(m, [[1]], cache) is None
    assert [c.offset for c in cache if isinstance(c, KVCache)] == before
    assert model_plan.decode_model(m, mx.array([[1]]), cache) is not None


def test_model_plan_is_kept_and_replanned(monkeypatch):
    """The whole stack's plan is kept on the model: a later token with the
    same cache plans no layer; a new cache, a replaced weight, a replaced
    layer or a full KV buffer plan again, and each token computes what the
    layer steps compute."""
    _stand_in_parts(monkeypatch)
    _, fast = _models(seed=47)
    m = fast.model
    entries, inside = [], []
    real = model_plan.layer_entry

    def spy(layer, x, cache):
        if inside:  # the layer plans of the model step (not of the reference's layer steps)
            entries.append(layer)
        return real(layer, x, cache)

    monkeypatch.setattr(model_plan, "layer_entry", spy)
    n = len(m.layers)
    cap = KVCache.step
    cache = _prefilled(fast, mx.random.randint(1, 100, (1, cap - 2), key=mx.random.key(3)))
    ref_cache = copy.deepcopy(cache)
    tok = mx.array([[3]])

    def both(c_fast, c_ref):
        inside.append(1)
        a = model_plan.decode_model(m, tok, c_fast)
        inside.clear()
        assert a is not None
        b = m.norm(tok_layers(c_ref))
        mx.eval(a, b)
        assert_close(a, b, FP32_TOL, "model step vs layer steps")

    def tok_layers(c_ref):
        h = m.embed_tokens(tok)
        for layer, c in zip(m.layers, c_ref):
            h = layer(h, None, c)
        return h

    def plan():
        return m.__dict__["_mqf_model_plan"]

    both(cache, ref_cache)
    assert len(entries) == n  # planned once
    step = plan().fn
    both(cache, ref_cache)
    assert len(entries) == n  # kept: the second token planned nothing
    both(cache, ref_cache)  # offset cap: the KV buffers are full now
    assert len(entries) == 2 * n  # grown and planned again
    assert plan().fn is step  # the same weights: the same compiled step (a trace for the new capacity)
    both(cache, ref_cache)
    assert len(entries) == 2 * n
    other = copy.deepcopy(cache)
    ref_other = copy.deepcopy(ref_cache)
    both(other, ref_other)
    assert len(entries) == 3 * n  # another cache
    assert plan().fn is step and len(plan().kept) == 1
    layer = next(l for l in m.layers if l.is_linear)
    old = layer.input_layernorm.weight
    layer.input_layernorm.weight = old * 2.0
    both(other, ref_other)
    assert len(entries) == 4 * n  # a replaced weight
    # a new step over the new weight; the old step (holding the old weight) is dropped
    assert plan().fn is not step and len(plan().kept) == 1
    assert all(id(old) not in key[2] for key in plan().kept)
    m.layers[0] = copy.deepcopy(m.layers[0])
    both(other, ref_other)
    assert len(entries) == 5 * n  # a replaced layer
    assert "_mqf_model_plan" not in dict(m) and copy.deepcopy(m).__dict__.get("_mqf_model_plan") is None


@pytest.mark.parametrize("dtype", [mx.uint32, mx.int32])
def test_embed_ids_clamp_into_the_table(dtype):
    """model_plan.embed_ids (the decode and verify steps' embedding): ids in
    the table embed as the module does, bit for bit; ids past it (and
    negative int32 ids) take the last (first) row instead of reading outside
    the table; float and quantised tables alike."""
    import mlx.nn as nn

    class M:
        pass

    for emb in (nn.Embedding(50, 16), nn.QuantizedEmbedding(50, 64, group_size=32, bits=4)):
        m = M()
        m.embed_tokens = emb
        ok = mx.array([[0, 7, 49]], dtype)
        assert mx.array_equal(model_plan.embed_ids(m, ok), emb(ok)).item()
        bad = [[50, 10**6]] + ([[-1, -(10**6)]] if dtype == mx.int32 else [])
        for row in bad:
            ids = mx.array([row], dtype)
            want = emb(mx.array([[0 if v < 0 else 49 for v in row]], dtype))
            assert mx.array_equal(model_plan.embed_ids(m, ids), want).item()


def test_model_step_orders_its_first_grid_launch_after_the_previous_call(monkeypatch, env):
    """The whole-stack step offers the previous call's output to the first
    grid-barrier launch of its trace (ops._launch_order): stand-in GDN and
    MoE parts take the offer as the kernels' steps do; eagerly (compilation
    off, so the arrays are the objects passed), at every decode call exactly
    one part takes something -- the first layer's -- and it is the call's
    own input first, then the previous call's output; the layer steps alone
    (``MLX_QWEN_FAST_DECODE_MODEL=0``) are offered nothing."""
    from mlx_qwen_fast.ops import _launch_order

    made = _stand_in_parts(monkeypatch)
    from mlx_qwen_fast.ops import decoder as dec

    gdn_parts, moe_parts = dec.gated_delta_ops.decode_step_parts, dec.moe_ops.decode_step_parts
    taken = []

    def gdn_taking(*a, **k):
        paths, fn, used, extra = gdn_parts(*a, **k)
        return paths, (lambda *x: taken.append(_launch_order.take()) or fn(*x)), used, extra

    def moe_taking(*a, **k):
        paths, fn = moe_parts(*a, **k)
        return paths, (lambda *x: taken.append(_launch_order.take()) or fn(*x))

    monkeypatch.setattr(dec.gated_delta_ops, "decode_step_parts", gdn_taking)
    monkeypatch.setattr(dec.moe_ops, "decode_step_parts", moe_taking)
    outs = []
    real_model = decoder.decode_model

    def spy_model(m, inputs, cache):
        out = real_model(m, inputs, cache)
        outs.append(out)
        return out

    monkeypatch.setattr(decoder, "decode_model", spy_model)
    _, fast = _models(seed=11)
    n_layers = len(fast.layers)
    n_parts = n_layers + sum(l.is_linear for l in fast.layers)  # every layer's MoE part, the GDN layers' mixer part
    cache = _prefilled(fast, mx.array([[1, 2, 3]]))
    tok = mx.array([[5]])
    prev = None
    mx.disable_compile()
    try:
        for i in range(3):
            taken.clear()
            outs.clear()
            mx.eval(fast(tok, cache=cache))
            assert len(outs) == 1 and outs[0] is not None
            assert len(taken) == n_parts and taken[0] is not None
            assert all(t is None for t in taken[1:]), "only the first launch of a call is ordered"
            # the previous call's output (the compiled call's wrappers are other Python objects of it):
            # its values, which no other array of this call has
            want = model_plan.embed_ids(fast.language_model.model, tok) if prev is None else prev
            assert taken[0].shape == want.shape and mx.array_equal(taken[0], want).item(), f"call {i}"
            prev = outs[0]
            tok = tok + 1
        assert made  # the stand-ins planned the steps
        env.set(config.DECODE_MODEL_STEP.name, "0")
        taken.clear()
        mx.eval(fast(tok, cache=cache))
        assert len(taken) == n_parts and all(t is None for t in taken)
    finally:
        mx.enable_compile()


@pytest.mark.parametrize("n", [-5, 1.5, True, "2"])
def test_make_room_names_a_bad_count(n):
    """kv_buffers.make_room: ``n`` (positions to make room for) an int >= 0,
    else one ValueError naming it; the cache untouched."""
    from mlx_lm.models.cache import KVCache

    c = KVCache()
    c.update_and_fetch(mx.zeros((1, 2, 3, 8)), mx.zeros((1, 2, 3, 8)))
    keys = c.keys
    with pytest.raises(ValueError, match=r"make_room: n must be an int >= 0, got"):
        kv_buffers.make_room(c, mx.float32, 1, 2, 8, n)
    assert c.keys is keys
    assert kv_buffers.make_room(c, mx.float32, 1, 2, 8, 0) and kv_buffers.make_room(c, mx.float32, 1, 2, 8, 5)
    assert c.keys.shape[2] >= 8
