"""``mlx_qwen_fast.patching``: patched vs stock mlx-lm model on the tiny
random checkpoint (and its other quantisations); install(), the off switch.

(The report's table of ops and the kernels declined for weights they do not
read: tests/test_patch_report.py; the CLIs: tests/test_cli.py; the switches
themselves: tests/test_config.py.)
"""

import warnings

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.qwen3_5 import Qwen3_5TextModel
from mlx_lm.models.qwen3_next import Qwen3NextAttention

import mlx_qwen_fast
from compare import BF16_EPS, assert_close, tolerance
from mlx_qwen_fast import config
from mlx_qwen_fast.checkpoint import build_model
from mlx_qwen_fast.kernels import _cuda_build as cb
from mlx_qwen_fast.layers import FAST_CLASSES, FastAttention, FastHead
from mlx_qwen_fast.patching import enabled, patch, patched_copy, unpatch
from quant_variants import VARIANTS


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return mlx_lm.load(str(tiny_checkpoint))


def _prefill_logits(model, tokens, step):
    """Logits of every position, fed in chunks of ``step`` through one cache."""
    cache = make_prompt_cache(model)
    outs = []
    for i in range(0, tokens.size, step):
        outs.append(model(tokens[None, i : i + step], cache=cache).astype(mx.float32))
        mx.eval(outs[-1])
    return mx.concatenate(outs, axis=1)[0]


def _rel_l2(a, b):
    return (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item()


def test_patch_swaps_every_module_and_shares_arrays(tiny):
    model, _ = tiny
    stock_params = dict(tree_flatten(model.parameters()))
    fast, report = patched_copy(model)
    assert report.patched and report.reason is None
    n_layers = len(model.layers)
    n_attn = sum(not l.is_linear for l in model.layers)
    assert report.swapped == {
        "linear_attn": n_layers - n_attn,
        "mlp": n_layers,
        "self_attn": n_attn,
        "decoder_layer": n_layers,
        "layer_stack": 1,
        "lm_head": 1,
    }  # the gated attention's fast class takes its prefill; its decode step is the layer's
    assert type(fast.language_model.lm_head) is FastHead and type(model.language_model.lm_head) is nn.QuantizedLinear
    assert all(type(l.self_attn) is FastAttention for l in fast.layers if not l.is_linear)
    assert all(type(l.self_attn) is Qwen3NextAttention for l in model.layers if not l.is_linear)
    assert set(report.ops) >= {"gated_delta.prefill", "gated_delta.decode"}
    assert report.ops["attention.prefill"] == ("cuda-kernel" if cb.cuda_available() else "stock")
    assert report.ops["attention.decode"] == "compiled-layer"
    assert fast.patch_report is report
    fast_params = dict(tree_flatten(fast.parameters()))
    assert fast_params.keys() == stock_params.keys()
    # Same arrays, not copies: identical buffers (same id of the underlying array).
    assert all(fast_params[k] is stock_params[k] for k in stock_params)
    # The original stays stock.
    assert not mlx_qwen_fast.is_patched(model) and mlx_qwen_fast.is_patched(fast)


def test_unpatch_restores_stock_classes(tiny):
    model, _ = tiny
    fast, _ = patched_copy(model)
    assert fast.patch_report.patched
    counts = unpatch(fast)
    n_modules = sum(
        hasattr(l, s) for l in fast.layers for s in ("linear_attn", "mlp", "self_attn")
    )
    assert counts.pop("decoder_layer") == len(fast.layers)
    assert counts.pop("layer_stack") == 1
    assert counts.pop("lm_head") == 1 and type(fast.language_model.lm_head) is nn.QuantizedLinear
    assert sum(counts.values()) == n_modules
    assert not mlx_qwen_fast.is_patched(fast)
    assert type(fast.model) is Qwen3_5TextModel
    stock_types = set(FAST_CLASSES)  # Qwen3NextAttention among them
    assert all(
        type(getattr(l, s)) in stock_types
        for l in fast.layers
        for s in ("linear_attn", "self_attn", "mlp")
        if hasattr(l, s)
    )
    # the report follows: the model says it is stock now
    assert not fast.patch_report.patched and "unpatch" in fast.patch_report.reason
    # Patching twice is a no-op the second time, and the model keeps the first report.
    first = patch(fast)
    assert fast.patch_report is first and first.swapped
    assert patch(fast).swapped == {}
    assert fast.patch_report is first


def _fp32(model):
    """The same checkpoint with fp32 activations (4-bit weights unchanged,
    quantisation scales/biases and norms upcast)."""
    model.set_dtype(mx.float32)
    return model


@pytest.mark.parametrize("length", [1, 3, 63, 64, 65, 2049])
def test_patched_logits_match_stock(tiny_checkpoint, length):
    """fp32: the patched model computes stock's function to fp32 rounding.

    bf16: the patched model's error against the fp32 logits is within the
    rounding bound below (twice stock's plus four times bf16's unit
    roundoff; the README states it).
    On random weights the bf16 error itself is chaotic (near-tie expert
    choices flip; re-rounding stock's own GDN output by 1e-7 moves its logits
    by 2-7e-2), so the bf16 check compares errors against the fp32 reference
    rather than the two bf16 paths with each other.
    """
    rng = np.random.default_rng(length)
    step = 2048  # mlx-lm's prefill_step_size: 2049 crosses a chunk boundary
    bf16, _ = mlx_lm.load(str(tiny_checkpoint))
    vocab = bf16.args.text_config["vocab_size"]
    tokens = mx.array(rng.integers(0, vocab, size=length), dtype=mx.int32)

    ref32 = _fp32(mlx_lm.load(str(tiny_checkpoint))[0])
    fast32, _ = patched_copy(ref32)
    exact = _prefill_logits(ref32, tokens, step)
    err32 = _rel_l2(_prefill_logits(fast32, tokens, step), exact)
    assert err32 < 1e-4, f"T={length}: fp32 patched vs stock rel L2 {err32:.2e}"

    if length > 65:  # CPU bf16 matmuls are ~10x slower than fp32: keep CI short
        return
    fast16, _ = patched_copy(bf16)
    err_stock = _rel_l2(_prefill_logits(bf16, tokens, step), exact)
    err_fast = _rel_l2(_prefill_logits(fast16, tokens, step), exact)
    # Stock's own bf16 error varies up to ~2x between equally valid roundings
    # of the same weights (tests/test_transformers_parity.py); allow that.
    assert err_fast <= 2 * err_stock + 4 * BF16_EPS, (
        f"T={length}: bf16 error vs fp32: patched {err_fast:.2e}, stock {err_stock:.2e}"
    )


def _greedy(model, prompt, n):
    tokens, logits = [], []
    for (tok, logprobs), _ in zip(generate_step(prompt, model, max_tokens=n), range(n)):
        tokens.append(int(tok))
        logits.append(logprobs)
    return tokens, logits


def test_greedy_tokens_identical_for_64_steps(demo_checkpoint):
    # fp32 activations: in bf16 on random weights two code paths that round
    # differently pick different greedy tokens at near-ties (DESIGN-NOTES 8;
    # mlx_qwen_fast/checkpoint/weights.py measured 79-85% bf16-vs-fp32
    # agreement at any lm_head scale), so only fp32 makes token identity a
    # real check.
    model, tokenizer = mlx_lm.load(str(demo_checkpoint))
    model = _fp32(model)
    fast, _ = patched_copy(model)
    prompt = mx.array(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "Write a short poem about the sea."}],
            add_generation_prompt=True,
        )
    )
    a, logits_a = _greedy(model, prompt, 64)
    b, _ = _greedy(fast, prompt, 64)
    if a != b:
        i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        top2 = mx.sort(logits_a[i])[-2:]
        margin = (top2[1] - top2[0]).item()
        pytest.fail(
            f"greedy tokens diverge at step {i}: stock {a[i]} vs patched {b[i]}; "
            f"stock top-1/top-2 log-prob margin there: {margin:.4f}"
        )


def test_unsupported_model_stays_stock_with_warning():
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=32,
        num_hidden_layers=1,
        intermediate_size=64,
        num_attention_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=64,
        num_key_value_heads=2,
    )
    model = llama.Model(args)
    before = {id(l): dict(l.items()) for l in model.layers}
    with pytest.warns(UserWarning, match="left on the stock path: model_type 'llama'"):
        report = patch(model)
    assert not report.patched and "llama" in report.reason
    assert {id(l): dict(l.items()) for l in model.layers} == before
    assert not mlx_qwen_fast.is_patched(model)


def test_registered_model_type_loads_patched(tiny_checkpoint):
    model, _ = mlx_lm.load(
        str(tiny_checkpoint), model_config={"model_type": "qwen3_5_moe_fast"}
    )
    assert mlx_qwen_fast.is_patched(model)
    assert model.patch_report.patched
    # the head, quantised by mlx-lm after construction, is swapped too (the patch after load_weights)
    assert type(model.language_model.lm_head) is FastHead
    n_attn = sum(not l.is_linear for l in model.layers)
    assert model.patch_report.swapped == {"linear_attn": len(model.layers) - n_attn, "mlp": len(model.layers),
                                          "self_attn": n_attn, "decoder_layer": len(model.layers),
                                          "layer_stack": 1, "lm_head": 1}
    stock, _ = mlx_lm.load(str(tiny_checkpoint))
    tokens = mx.array([[1, 2, 3, 4, 5]])
    assert _rel_l2(model(tokens).astype(mx.float32), stock(tokens).astype(mx.float32)) < BF16_EPS * 8


def test_install_patches_mlx_lm_load_and_env_switch(tiny_checkpoint, env):
    try:
        assert mlx_qwen_fast.install()
        model, _ = mlx_lm.load(str(tiny_checkpoint))
        assert mlx_qwen_fast.is_patched(model)
        env.set("MLX_QWEN_FAST", "0")
        model, _ = mlx_lm.load(str(tiny_checkpoint))
        assert not mlx_qwen_fast.is_patched(model)
    finally:
        mlx_qwen_fast.uninstall()
    model, _ = mlx_lm.load(str(tiny_checkpoint))
    assert not mlx_qwen_fast.is_patched(model)


def test_install_verbose_says_left_stock_in_one_line(tiny_checkpoint, monkeypatch, capsys):
    """install(verbose=True) (the CLIs): a model left stock is said by its
    report's line alone, not by the line and patch()'s warning too."""
    from mlx_qwen_fast import patching

    monkeypatch.setattr(patching, "_unsupported_reason", lambda model: "a test reason")
    try:
        assert mlx_qwen_fast.install(verbose=True)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            model, _ = mlx_lm.load(str(tiny_checkpoint))
    finally:
        mlx_qwen_fast.uninstall()
    assert not mlx_qwen_fast.is_patched(model)
    said = [line for line in capsys.readouterr().err.splitlines() if "a test reason" in line]
    assert said == ["mlx_qwen_fast: left stock (a test reason)"]
    assert not [w for w in seen if "a test reason" in str(w.message)]


def test_install_twice_wraps_once_and_uninstall_restores_mlx_lms(tiny_checkpoint, capsys):
    """A second install() wraps nothing more (one report per load), and
    honours the verbose it asks for; uninstall() puts mlx-lm's own
    load_model back, and a second uninstall changes nothing."""
    original = mlx_lm.utils.load_model
    try:
        assert mlx_qwen_fast.install()
        assert mlx_qwen_fast.install(verbose=True)
        assert mlx_lm.utils.load_model._wrapped is original
        model, _ = mlx_lm.load(str(tiny_checkpoint))
        assert mlx_qwen_fast.is_patched(model)
        reports = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mlx_qwen_fast:")]
        assert reports == [str(model.patch_report)] and "nothing new" not in reports[0]
    finally:
        mlx_qwen_fast.uninstall()
    assert mlx_lm.utils.load_model is original
    mlx_qwen_fast.uninstall()
    assert mlx_lm.utils.load_model is original


def test_install_keeps_the_report_of_a_model_its_class_patched(tiny_checkpoint, capsys):
    """Model type qwen3_5_moe_fast patches itself when built: install's
    wrapper does not patch it again, and says the first patch's report."""
    try:
        assert mlx_qwen_fast.install(verbose=True)
        model, _ = mlx_lm.load(str(tiny_checkpoint), model_config={"model_type": "qwen3_5_moe_fast"})
    finally:
        mlx_qwen_fast.uninstall()
    assert model.patch_report.patched and model.patch_report.swapped
    reports = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mlx_qwen_fast:")]
    assert reports == [str(model.patch_report)]


def test_uninstall_leaves_a_wrapper_put_around_installs(tiny_checkpoint):
    """Another tool wrapped install's load_model (functools.wraps copies its
    attributes): install() does not wrap again, uninstall() keeps the other
    wrapper (install's then passes models through stock), install() turns
    it back on."""
    import functools

    original = mlx_lm.utils.load_model
    calls = []
    try:
        assert mlx_qwen_fast.install()
        ours = mlx_lm.utils.load_model

        @functools.wraps(ours)
        def theirs(*args, **kwargs):
            calls.append(1)
            return ours(*args, **kwargs)

        mlx_lm.utils.load_model = theirs
        assert mlx_qwen_fast.install() and mlx_lm.utils.load_model is theirs
        mlx_qwen_fast.uninstall()
        assert mlx_lm.utils.load_model is theirs
        assert not mlx_qwen_fast.is_patched(mlx_lm.load(str(tiny_checkpoint))[0]) and calls
        assert mlx_qwen_fast.install() and mlx_lm.utils.load_model is theirs
        assert mlx_qwen_fast.is_patched(mlx_lm.load(str(tiny_checkpoint))[0])
    finally:
        mlx_qwen_fast.uninstall()  # puts mlx-lm's sharded_load back (load_model keeps theirs until the next line)
        mlx_lm.utils.load_model = original


def test_install_is_off_when_env_says_so(env):
    env.set("MLX_QWEN_FAST", "0")
    assert mlx_qwen_fast.install() is False
    assert not getattr(mlx_lm.utils.load_model, "_mlx_qwen_fast", False)


@pytest.mark.parametrize("bad", [None, "path/to/model", 3, [1, 2]])
@pytest.mark.parametrize("fn", ["patch", "unpatch", "is_patched"])
def test_non_module_input_is_a_type_error(fn, bad):
    with pytest.raises(TypeError, match=f"{fn} expects a loaded mlx-lm model"):
        getattr(mlx_qwen_fast, fn)(bad)


def test_load_tuple_gets_a_hint(tiny):
    with pytest.raises(TypeError, match=r"mlx_lm.load returns \(model, tokenizer\)"):
        mlx_qwen_fast.patch(tiny)  # the (model, tokenizer) pair itself
    with pytest.raises(TypeError, match="patched_copy expects"):
        patched_copy((None, None))


@pytest.mark.parametrize("value", ["0", "false", "OFF", " no "])
def test_env_switch_leaves_patch_stock(tiny, env, value):
    tiny, _ = tiny
    env.set("MLX_QWEN_FAST", value)
    with pytest.warns(UserWarning, match="disabled by the environment"):
        report = mlx_qwen_fast.patch(tiny)
    assert not report.patched and "MLX_QWEN_FAST" in report.reason
    assert not mlx_qwen_fast.is_patched(tiny)
    assert tiny.patch_report is report
    env.set("MLX_QWEN_FAST", "1")
    assert mlx_qwen_fast.patch(tiny).patched
    mlx_qwen_fast.unpatch(tiny)


def test_a_stock_warning_names_the_callers_line(tiny, env):
    """patch() and patched_copy() warn once per call, at the caller's line
    (not at a line inside the package)."""
    env.set("MLX_QWEN_FAST", "0")
    for fn in (mlx_qwen_fast.patch, patched_copy):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            fn(tiny[0])
        assert [(w.category, w.filename) for w in seen] == [(UserWarning, __file__)], fn
        assert "left on the stock path" in str(seen[0].message)


def _with_lora(model, seed):
    """LoRA on every linear and switch layer (mlx-lm's tuner), non-zero B so it matters."""
    from mlx.utils import tree_map_with_path
    from mlx_lm.tuner.utils import linear_to_lora_layers

    linear_to_lora_layers(model, len(model.layers), {"rank": 4, "scale": 2.0, "dropout": 0.0})
    key = [mx.random.key(seed)]

    def fill(path, a):
        if path.endswith("lora_b"):
            key[0], k = mx.random.split(key[0])
            return 0.05 * mx.random.normal(a.shape, key=k).astype(a.dtype)
        return a

    model.update(tree_map_with_path(fill, model.parameters()))
    mx.eval(model.parameters())
    return model


def test_lora_adapters_before_or_after_patch(tiny_checkpoint):
    """mlx-lm LoRA layers (what --adapter-path and fine-tuning add) work on the
    patched model whether added before patching or after (install() patches
    at load, before mlx-lm applies an adapter): same logits as stock + LoRA,
    prefill and decode."""
    tokens = mx.array(np.random.default_rng(3).integers(1, 200, size=70), dtype=mx.int32)

    def load_fp32():
        m, _ = mlx_lm.load(str(tiny_checkpoint))
        m.set_dtype(mx.float32)
        return m

    stock = _with_lora(load_fp32(), 1)
    ref = _prefill_logits(stock, tokens, 32)
    before, report = patched_copy(stock)
    assert report.patched
    after = load_fp32()
    patch(after)
    after = _with_lora(after, 1)
    after.update(stock.parameters())  # the same LoRA A (drawn at random by mlx-lm) and B
    for model in (before, after):
        assert mlx_qwen_fast.is_patched(model)
        got = _prefill_logits(model, tokens, 32)  # chunks of 32, then decode-sized tails
        assert _rel_l2(got, ref) < 1e-4
        one = _prefill_logits(model, tokens[:3], 1)  # token by token: the decode path
        assert _rel_l2(one, _prefill_logits(stock, tokens[:3], 1)) < 1e-4


def test_enabled_follows_the_switch(env):
    """MLX_QWEN_FAST: off values switch the fast path off, on values and
    unset leave it on silently, anything else is on with a warning that
    names the value."""
    for value, on in (("0", False), (" Off ", False), ("1", True), ("yes", True), ("", True)):
        env.set("MLX_QWEN_FAST", value)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert enabled() is on
    env.unset("MLX_QWEN_FAST")
    assert enabled() is True
    env.set("MLX_QWEN_FAST", "banana")
    with pytest.warns(RuntimeWarning, match="'banana'.*not understood"):
        assert enabled() is True


@pytest.mark.parametrize("layer_on, model_on", [(1, 1), (1, 0), (0, 1)])
def test_decode_token_takes_the_planned_route(monkeypatch, env, layer_on, model_on):
    """On this machine a patched model's decode token takes the route the
    planner names: the layer stack's step is asked first while both step
    switches are on, each layer's step while the layer switch is on (every
    layer here: the CPU has no whole-stack step), neither when it is off."""
    from mlx_qwen_fast.ops import decoder

    env.set(config.DECODE_LAYER_STEP.name, str(layer_on))
    env.set(config.DECODE_MODEL_STEP.name, str(model_on))
    model, _ = build_model("tiny", seed=0)
    patch(model, warn=False)
    asked = {"model": 0, "layer": 0}
    real_model, real_layer = decoder.decode_model, decoder.decode_layer
    monkeypatch.setattr(decoder, "decode_model",
                        lambda m, i, c: asked.__setitem__("model", asked["model"] + 1) or real_model(m, i, c))
    monkeypatch.setattr(decoder, "decode_layer",
                        lambda l, x, c: asked.__setitem__("layer", asked["layer"] + 1) or real_layer(l, x, c))
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1, 2, 3]]), cache=cache))
    asked.update(model=0, layer=0)
    mx.eval(model(mx.array([[4]]), cache=cache))
    route = decoder.decode_routes().model
    assert route == ("compiled-layer" if layer_on else "stock")
    assert asked == {"model": int(bool(layer_on and model_on)),
                     "layer": len(model.layers) if route == "compiled-layer" else 0}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_quantised_variant_patched_matches_stock(quant_checkpoint, name):
    """Every quantisation variant, loaded by stock mlx_lm.load, in fp32: the
    patched model's logits (prefill in chunks, then token by token) are
    stock's to fp32 rounding, and 16 greedy tokens are the same."""
    path = quant_checkpoint(name)
    stock = _fp32(mlx_lm.load(str(path))[0])
    fast, report = patched_copy(stock)
    assert report.patched
    tokens = mx.array(np.random.default_rng(5).integers(0, 1200, size=70), dtype=mx.int32)
    assert_close(_prefill_logits(fast, tokens, 32), _prefill_logits(stock, tokens, 32),
                 tolerance(mx.float32), f"{name}: prefill logits")
    assert_close(_prefill_logits(fast, tokens[:4], 1), _prefill_logits(stock, tokens[:4], 1),
                 tolerance(mx.float32), f"{name}: decode logits")
    prompt = tokens[:12]
    a, logits = _greedy(stock, prompt, 16)
    b, _ = _greedy(fast, prompt, 16)
    if a != b:
        i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        top2 = mx.sort(logits[i])[-2:]
        pytest.fail(f"{name}: greedy tokens diverge at step {i}: stock {a[i]} vs patched {b[i]} "
                    f"(stock top-1/top-2 log-prob margin {(top2[1] - top2[0]).item():.4f})")
