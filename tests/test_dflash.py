"""``mlx_qwen_fast.dflash``: the DFlash drafter, the target's hidden-state
capture, and the speculative loop.

All in fp32 on the CPU with the tiny target (non-flat logits) and the
``tiny-dflash`` drafter preset. Greedy DFlash decoding gives plain greedy
decoding's tokens with a random drafter (drafts rejected), an oracle
stand-in (every block accepted) and a planted stand-in that gets exactly k
of 15 drafts right in its k-th block (every accepted length 0..15); with
temperature, the first tokens' distribution is the target's (chi-square).
"""

import json
import math
import random

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from compare import FP32_TOL, assert_close
from mlx_qwen_fast import config, dflash
from mlx_qwen_fast.checkpoint import DEMO_LM_HEAD_SCALE, build_model
from mlx_qwen_fast.dflash import capture, presets
from mlx_qwen_fast.dflash.drafter import DrafterArgs, build_target_layer_ids
from mlx_qwen_fast.ops import verify as verify_ops
from mlx_qwen_fast.patching import patched_copy

PROMPTS = ([1, 5, 9, 33, 100, 7, 8, 200, 300, 11], [42], [3, 1, 4, 1, 5, 9, 2, 6])


@pytest.fixture(scope="module")
def tiny():
    """(stock fp32 tiny target, its patched twin)."""
    stock, _ = build_model("tiny", seed=0, dtype=mx.float32, lm_head_scale=DEMO_LM_HEAD_SCALE)
    fast, report = patched_copy(stock)
    assert report.patched
    return stock, fast


@pytest.fixture(scope="module")
def drafter():
    model, _ = presets.build_drafter("tiny-dflash", seed=0, dtype=mx.float32)
    return model


def _plain(model, prompt, n):
    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


class Planted:
    """A drafter stand-in that knows the target's greedy continuation
    ``ref`` of a prompt of ``P`` tokens and, in its i-th block, proposes
    ``right[i]`` correct tokens, then wrong ones (``right`` cycles).
    ``right = [block - 1]`` is the oracle."""

    is_dflash_drafter = True  # mlx-lm's speculative entry points route it to the DFlash loop

    def __init__(self, ref, P, right, block=16, vocab=1280):
        self.ref, self.P, self.right, self.block_size, self.vocab = ref, P, list(right), block, vocab
        self.target_layer_ids = ()
        self.calls = 0

    def make_cache(self):
        return []

    def add_context(self, hidden, position, cache):
        raise AssertionError("no layer ids: no context")

    def propose(self, model, last_token, position, num, cache):
        k = self.right[self.calls % len(self.right)]
        self.calls += 1
        i = position - self.P + 1  # ref index of the first draft
        assert self.ref[i - 1] == last_token.item()
        out = [self.ref[i + j] if j < k else (self.ref[i + j] + 1) % self.vocab for j in range(num)]
        return mx.array(out, mx.uint32)


# --- the drafter ------------------------------------------------------------


def _reference_drafter(d, emb, ctx, position):
    """The drafter's output written from the architecture description
    (z-lab/dflash model.py): context c = hidden_norm(fc(h)); per layer,
    q from the normed block, k/v from [c; normed block] (k_norm on both),
    RoPE at the sequence positions, softmax attention over all keys (no
    mask), o_proj, residual, SwiGLU MLP, residual; final norm."""
    a = d.args
    c = d.hidden_norm(d.fc(ctx))
    S, L = ctx.shape[1], emb.shape[1]
    x = emb
    for layer in d.layers:
        at = layer.self_attn
        xn = layer.input_layernorm(x)
        q = at.q_norm(at.q_proj(xn).reshape(1, L, a.num_attention_heads, a.head_dim)).transpose(0, 2, 1, 3)
        kv_in = mx.concatenate([c, xn], axis=1)
        k = at.k_norm(at.k_proj(kv_in).reshape(1, S + L, a.num_key_value_heads, a.head_dim)).transpose(0, 2, 1, 3)
        v = at.v_proj(kv_in).reshape(1, S + L, a.num_key_value_heads, a.head_dim).transpose(0, 2, 1, 3)
        q = at.rope(q, offset=position - S + S)
        k = at.rope(k, offset=position - S)
        rep = a.num_attention_heads // a.num_key_value_heads
        k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
        w = mx.softmax((q @ k.transpose(0, 1, 3, 2)) * a.head_dim ** -0.5, axis=-1)
        o = (w @ v).transpose(0, 2, 1, 3).reshape(1, L, -1)
        h = x + at.o_proj(o)
        m = layer.mlp
        x = h + m.down_proj(nn.silu(m.gate_proj(layer.post_attention_layernorm(h))) *
                            m.up_proj(layer.post_attention_layernorm(h)))
    return d.norm(x)


def test_drafter_is_the_published_architecture(drafter):
    """The module's output (context added in two chunks, then a block) is
    the reference written out from the description, and other relative
    positions change it (RoPE is applied; a uniform shift would not)."""
    mx.random.seed(1)
    ctx = mx.random.normal((1, 9, 3 * 256))
    emb = mx.random.normal((1, 16, 256))
    cache = drafter.make_cache()
    drafter.add_context(ctx[:, :4], 20, cache)
    drafter.add_context(ctx[:, 4:], 24, cache)
    got = drafter(emb, 29, cache)
    want = _reference_drafter(drafter, emb, ctx, 29)
    assert_close(got, want, FP32_TOL, "drafter vs reference")
    moved = drafter.make_cache()
    drafter.add_context(ctx, 0, moved)
    assert mx.allclose(drafter(emb, 9, moved), want, atol=1e-4).item()  # shifted by 20: the same
    assert not mx.allclose(drafter(emb, 29, moved), want, atol=1e-3).item()  # a gap of 20: not
    assert type(drafter.layers[0].self_attn.rope).__name__ == "YarnRoPE"


def test_drafter_matches_dflash_mlx_when_installed(drafter):
    """Where the dflash-mlx package is installed, its drafter module on the
    same weights gives the same output."""
    ref_mod = pytest.importorskip("dflash_mlx.model")
    args = ref_mod.DFlashDraftModelArgs.from_dict(dict(drafter.args.config))
    ref = ref_mod.DFlashDraftModel(args)
    ref.load_weights(tree_flatten(drafter.parameters()))
    mx.random.seed(2)
    ctx, emb = mx.random.normal((1, 7, 768)), mx.random.normal((1, 16, 256))
    want = ref(noise_embedding=emb, target_hidden=ctx, cache=[ref_mod.FullContextDraftKVCache() for _ in ref.layers])
    cache = drafter.make_cache()
    drafter.add_context(ctx, 0, cache)
    assert_close(drafter(emb, 7, cache), want, FP32_TOL, "vs dflash-mlx")


def test_build_target_layer_ids_is_the_reference_rule():
    assert build_target_layer_ids(40, 5) == [1, 10, 19, 28, 37]
    assert build_target_layer_ids(8, 1) == [4]


@pytest.mark.parametrize("change, match", [
    (lambda c: c.pop("dflash_config"), "lacks 'dflash_config'"),
    (lambda c: c["dflash_config"].pop("mask_token_id"), "dflash_config.mask_token_id"),
    (lambda c: c.pop("hidden_size"), "lacks 'hidden_size'"),
    (lambda c: c.update(block_size=1), "'block_size' must be a whole number >= 2"),
    (lambda c: c.update(num_key_value_heads=3), "not a multiple"),
    (lambda c: c["dflash_config"].update(mask_token_id=5000), "outside the vocabulary"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[]), "target_layer_ids must be a non-empty list"),
    (lambda c: (c["dflash_config"].pop("target_layer_ids"), c.pop("num_target_layers")), "num_target_layers"),
    (lambda c: c.update(layer_types=["sliding_attention"] * 2), "only full"),
    (lambda c: c.pop("rope_theta"), "rope_theta"),
])
def test_config_errors_name_the_key(change, match):
    cfg = presets.preset_config("tiny-dflash")
    change(cfg)
    with pytest.raises(ValueError, match=match):
        DrafterArgs.from_dict(cfg, "here")


def test_config_derives_layer_ids_from_num_target_layers():
    cfg = presets.preset_config("qwen3.6-35b-a3b-dflash")
    del cfg["dflash_config"]["target_layer_ids"]
    # the reference's rule: one target layer per drafter layer (8 here), spread over [1, 37]
    assert DrafterArgs.from_dict(cfg).target_layer_ids == (1, 6, 11, 16, 22, 27, 32, 37)


def test_load_drafter(tmp_path, drafter):
    """A written preset loads strictly with the same weights (bf16); a
    quantised folder (mlx-lm's quantization block) loads quantised; bad
    folders are ValueErrors naming the folder."""
    path = presets.write_drafter(tmp_path / "d", "tiny-dflash", seed=0)
    loaded = dflash.load_drafter(path)
    want, _ = presets.build_drafter("tiny-dflash", seed=0, dtype=mx.bfloat16)
    for (k, a), (k2, b) in zip(tree_flatten(loaded.parameters()), tree_flatten(want.parameters())):
        assert k == k2 and mx.array_equal(a, b).item(), k
    # quantised: nn.quantize, saved with the quantization block mlx-lm writes
    q, cfg = presets.build_drafter("tiny-dflash", seed=0)
    nn.quantize(q, group_size=64, bits=4)
    qdir = tmp_path / "q"
    qdir.mkdir()
    mx.save_safetensors(str(qdir / "model.safetensors"), dict(tree_flatten(q.parameters())))
    cfg["quantization"] = {"group_size": 64, "bits": 4, "mode": "affine"}
    (qdir / "config.json").write_text(json.dumps(cfg))
    ql = dflash.load_drafter(qdir)
    assert isinstance(ql.layers[0].mlp.up_proj, nn.QuantizedLinear) and isinstance(ql.fc, nn.QuantizedLinear)
    with pytest.raises(ValueError, match="not a folder"):
        dflash.load_drafter(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        dflash.load_drafter(tmp_path / "empty")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 8}))
    with pytest.raises(ValueError, match=f"dflash drafter {bad}: config.json lacks"):
        dflash.load_drafter(bad)
    shape = tmp_path / "shape"
    shape.mkdir()
    cfg = presets.preset_config("tiny-dflash")
    cfg["intermediate_size"] = 256
    (shape / "config.json").write_text(json.dumps(cfg))
    (shape / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=f"dflash drafter {shape}"):
        dflash.load_drafter(shape)


# --- the capture --------------------------------------------------------------


def test_forward_returns_the_layer_outputs_in_the_same_pass(tiny):
    """capture.forward's logits are the model's; its hidden states are the
    outputs of the named layers (the residual stream after each), in order."""
    _, fast = tiny
    x = mx.array([[1, 5, 9, 33, 100, 7]])
    c1, c2 = make_prompt_cache(fast), make_prompt_cache(fast)
    want = fast(x, cache=c1)
    logits, hidden = capture.forward(fast, x, c2, [5, 1])
    assert_close(logits, want, FP32_TOL, "logits")
    tm = fast.language_model.model
    h, outs = tm.embed_tokens(x), []
    from mlx_lm.models.base import create_attention_mask, create_ssm_mask

    fa, ssm = create_attention_mask(h, None), create_ssm_mask(h, None)
    for layer in tm.layers:
        h = layer(h, mask=ssm if layer.is_linear else fa, cache=None)
        outs.append(h)
    assert hidden.shape == (1, 6, 512)
    assert_close(hidden, mx.concatenate([outs[5], outs[1]], axis=-1), FP32_TOL, "hidden")
    last, _ = capture.forward(fast, x, make_prompt_cache(fast), [1], last_only=True)
    assert last.shape == (1, 1, want.shape[-1])
    assert_close(last[0, 0], want[0, -1], FP32_TOL, "last_only")


def test_check_target_refuses(tiny, drafter):
    stock, fast = tiny
    with pytest.raises(ValueError, match="model: its Gated DeltaNet layers are not the fast path's"):
        capture.check_target(stock, drafter)
    with pytest.raises(ValueError, match="model: .* is not a Qwen3.5/3.6 model"):
        capture.check_target(nn.Linear(2, 2))
    other, _ = presets.build_drafter("tiny-dflash", dtype=mx.float32)
    other.args.hidden_size = 512
    with pytest.raises(ValueError, match="drafter: hidden_size 512 does not match the target's 256"):
        capture.check_target(fast, other)
    other.args.hidden_size, other.args.vocab_size = 256, 2048
    with pytest.raises(ValueError, match="drafter: vocab_size 2048"):
        capture.check_target(fast, other)
    stand_in = Planted([0], 1, [0])
    stand_in.target_layer_ids = (1, 8)
    with pytest.raises(ValueError, match=r"drafter: target_layer_ids \[1, 8\] name layer\(s\) \[8\]"):
        capture.check_target(fast, stand_in)


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_size=1), "block_size: expected an int in"),
    (dict(block_size=17), "block_size: expected an int in"),
    (dict(kv_bits=4), "kv_bits"),
    (dict(max_kv_size=64), "max_kv_size"),
    (dict(max_tokens=-2), "max_tokens"),
    (dict(prefill_step_size=0), "prefill_step_size"),
])
def test_bad_arguments(tiny, drafter, kwargs, match):
    _, fast = tiny
    with pytest.raises(ValueError, match=match):
        list(dflash.dflash_generate_step(mx.array(PROMPTS[0]), fast, drafter, **kwargs))
    with pytest.raises(ValueError, match="prompt"):
        list(dflash.dflash_generate_step(mx.array([], mx.uint32), fast, drafter))


# --- exactness ---------------------------------------------------------------


@pytest.mark.parametrize("prompt, n, block", [(PROMPTS[0], 24, 16), (PROMPTS[1], 9, 4), (PROMPTS[2], 23, 4),
                                              (PROMPTS[2], 1, 16), (PROMPTS[0], 2, 16)])
@pytest.mark.parametrize("step", ["0", "1"])
def test_greedy_with_the_random_drafter_is_plain_greedy(env, tiny, drafter, prompt, n, block, step):
    """Greedy tokens are plain decoding's, the verify through mlx-lm's layer
    loop (``step`` 0) or the whole-stack compiled step (1)."""
    _, fast = tiny
    env.set(config.VERIFY_MODEL_STEP.name, step)
    stats = dflash.DFlashStats()
    got = [t for t, _ in dflash.dflash_generate_step(mx.array(prompt), fast, drafter, max_tokens=n,
                                                     block_size=block, stats=stats)]
    assert got == _plain(fast, prompt, n)
    assert sum(stats.accepted) + stats.blocks + 1 == n  # every token from the prefill or a verify


def test_greedy_logprobs_are_the_targets(tiny, drafter):
    """The yielded log-probabilities are plain decoding's at each position."""
    _, fast = tiny
    want = list(generate_step(mx.array(PROMPTS[0]), fast, max_tokens=6))
    got = list(dflash.dflash_generate_step(mx.array(PROMPTS[0]), fast, drafter, max_tokens=6, block_size=4))
    for (t, lp), (t2, lp2) in zip(got, want):
        assert t == t2
        assert_close(lp, lp2, FP32_TOL, "logprobs")


def test_oracle_accepts_every_block(tiny):
    _, fast = tiny
    prompt, n = PROMPTS[0], 50
    ref = _plain(fast, prompt, n + 16)
    stats = dflash.DFlashStats()
    oracle = Planted(ref, len(prompt), [15])
    got = [t for t, _ in dflash.dflash_generate_step(mx.array(prompt), fast, oracle, max_tokens=n, stats=stats)]
    assert got == ref[:n]
    assert stats.accepted == [15, 15, 15, 0] and stats.drafted == [15, 15, 15, 0]  # the last: one token left


@pytest.mark.parametrize("replay", [False, True])
@pytest.mark.parametrize("step", ["0", "1"])
def test_every_accepted_length(env, monkeypatch, tiny, step, replay):
    """The planted stand-in's k-th block has exactly k right drafts: each
    accepted length 0..15 occurs, the caches roll back to each, and the
    tokens are plain greedy decoding's; the verify through mlx-lm's layer
    loop (``step`` 0) or the whole-stack compiled step (1, which ran); the
    rollback in the CPU's form or the GPU's replay form (forced here)."""
    from mlx_qwen_fast import backend, speculative

    _, fast = tiny
    env.set(config.VERIFY_MODEL_STEP.name, step)
    if replay:
        monkeypatch.setattr(speculative, "REPLAY_BACKENDS", (backend.current(),))
    steps = verify_ops.step_count()
    prompt = PROMPTS[2]
    n = 1 + sum(k + 1 for k in range(16))
    ref = _plain(fast, prompt, n + 16)
    stats = dflash.DFlashStats()
    planted = Planted(ref, len(prompt), range(16))
    got = [t for t, _ in dflash.dflash_generate_step(mx.array(prompt), fast, planted, max_tokens=n, stats=stats)]
    assert stats.accepted == list(range(16))
    assert got == ref[:n]
    assert (verify_ops.step_count() > steps) == (step == "1")


def test_mlx_lm_generate_with_a_dflash_drafter(tiny, drafter, demo_checkpoint):
    """mlx-lm's own generate(..., draft_model=drafter) (through the
    installed speculative wrapper) and dflash.generate give plain greedy
    generation's text; stream_generate marks accepted drafts."""
    _, fast = tiny
    _, tok = mlx_lm.load(str(demo_checkpoint))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me about rivers."}],
                                     add_generation_prompt=True)
    want = mlx_lm.generate(fast, tok, prompt, max_tokens=12)
    assert dflash.generate(fast, tok, prompt, drafter, max_tokens=12) == want
    assert mlx_lm.generate(fast, tok, prompt, max_tokens=12, draft_model=drafter) == want
    ref = _plain(fast, prompt, 30)
    oracle = Planted(ref, len(prompt), [15])
    responses = list(dflash.stream_generate(fast, tok, prompt, oracle, max_tokens=12))
    assert [r.token for r in responses] == ref[:len(responses)]
    assert any(r.from_draft for r in responses)


# --- temperature: the target's distribution ------------------------------------

TEMP = 1.5
N_SAMPLES = 240


def _exact_first_two(fast, prompt, temp):
    """Exact p(t1, t2) of the target's sampler at ``temp`` (softmax of
    logits / temp) for the likeliest outcomes: {(t1, t2): p}."""
    lp1 = fast(mx.array([prompt]))[0, -1] / temp
    p1 = np.array(mx.softmax(lp1).astype(mx.float32))
    out = {}
    for t1 in np.argsort(-p1)[:6]:
        lp2 = fast(mx.array([prompt + [int(t1)]]))[0, -1] / temp
        p2 = np.array(mx.softmax(lp2).astype(mx.float32))
        for t2 in np.argsort(-p2)[:6]:
            out[(int(t1), int(t2))] = float(p1[t1] * p2[t2])
    return out


def _chi2(counts, probs, n):
    """Pearson's statistic over the outcomes of ``probs`` with expected
    count >= 5 and one bin for all others; (statistic, degrees of freedom)."""
    keys = [k for k, p in probs.items() if p * n >= 5]
    rest_p = 1.0 - sum(probs[k] for k in keys)
    rest_c = n - sum(counts.get(k, 0) for k in keys)
    stat = sum((counts.get(k, 0) - n * probs[k]) ** 2 / (n * probs[k]) for k in keys)
    stat += (rest_c - n * rest_p) ** 2 / (n * rest_p) if rest_p * n >= 1 else 0.0
    return stat, len(keys)


#: chi-square critical value at p = 0.001 for dof 1..15
_CHI2_999 = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26, 32.91, 34.53, 36.12,
             37.70]


def test_sampling_keeps_the_targets_distribution(tiny):
    """With temperature, the first two tokens (the first from the prefill,
    the second through a verify whose draft -- the target's argmax given the
    first -- is accepted or rejected) follow the target's joint distribution:
    Pearson's chi-square below its p = 0.001 critical value, fixed seed. The
    same bound rejects the distribution a classic bug gives (on rejection,
    a fresh draw from p instead of p without the draft), at the same N."""
    _, fast = tiny
    prompt = [3]
    probs = _exact_first_two(fast, prompt, TEMP)
    argmax = {}

    class ArgmaxDraft:
        block_size, target_layer_ids = 2, ()

        def make_cache(self):
            return []

        def propose(self, model, last_token, position, num, cache):
            t1 = last_token.item()
            if t1 not in argmax:
                argmax[t1] = mx.argmax(model(mx.array([prompt + [t1]]))[0, -1:], axis=-1).astype(mx.uint32)
            return argmax[t1]

    mx.random.seed(1234)
    sampler = make_sampler(temp=TEMP)
    counts, accepted = {}, 0
    for _ in range(N_SAMPLES):
        stats = dflash.DFlashStats()
        t = [t for t, _ in dflash.dflash_generate_step(mx.array(prompt), fast, ArgmaxDraft(), max_tokens=3,
                                                       sampler=sampler, stats=stats)]
        counts[tuple(t[:2])] = counts.get(tuple(t[:2]), 0) + 1  # max_tokens=3: the second token is drafted
        accepted += stats.accepted[0]
    assert 0.1 * N_SAMPLES < accepted < 0.9 * N_SAMPLES, accepted  # both branches taken
    stat, dof = _chi2(counts, probs, N_SAMPLES)
    assert dof >= 2
    assert stat < _CHI2_999[dof - 1], (stat, dof, counts)

    # the bound can fail: samples of the buggy rule (exact probabilities, numpy draws)
    rng = np.random.default_rng(0)
    by_t1 = {}
    for (t1, t2), p in probs.items():
        by_t1.setdefault(t1, {})[t2] = p
    buggy = {}
    for t1, row in by_t1.items():
        p1 = sum(row.values())
        d = max(row, key=row.get)
        pd = row[d] / p1
        for t2, p in row.items():
            buggy[(t1, t2)] = p1 * (pd * (t2 == d) + (1 - pd) * p / p1)
    keys = list(buggy)
    draws = rng.choice(len(keys), size=N_SAMPLES, p=np.array(list(buggy.values())) / sum(buggy.values()))
    bad_counts = {}
    for i in draws:
        bad_counts[keys[i]] = bad_counts.get(keys[i], 0) + 1
    bad_stat, bad_dof = _chi2(bad_counts, probs, N_SAMPLES)
    assert bad_stat > _CHI2_999[bad_dof - 1], (bad_stat, bad_dof)


def test_the_verify_keeps_one_shape_to_the_end(env, tiny, drafter):
    """Every verify pass is a whole block, also where fewer tokens are left
    (the extra ones trimmed): with the whole-stack step on, a generation
    whose blocks mostly accept nothing traces the step once per KV
    capacity, not once per tokens-left count; the tokens stay plain
    greedy decoding's."""
    _, fast = tiny
    env.set(config.VERIFY_MODEL_STEP.name, "1")
    prompt, n = PROMPTS[1], 30
    stats = dflash.DFlashStats()
    traces = verify_ops.trace_count()
    got = [t for t, _ in dflash.dflash_generate_step(mx.array(prompt), fast, drafter, max_tokens=n, stats=stats)]
    assert got == _plain(fast, prompt, n)
    assert stats.blocks >= 10
    assert verify_ops.trace_count() - traces <= 2, (verify_ops.trace_count() - traces, stats.accepted)
