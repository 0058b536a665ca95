"""Tests of mlx_qwen_fast.checkpoint (CPU, tiny preset; the full preset only
through its shapes and sizes)."""

import json
import math
import re

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.switch_layers import QuantizedSwitchLinear
from mlx_lm.sample_utils import make_sampler

from mlx_qwen_fast import checkpoint as ckpt
from mlx_qwen_fast.checkpoint import (
    DEMO_LM_HEAD_SCALE,
    PARTS,
    PRESETS,
    build_model,
    checkpoint_nbytes,
    make_tokenizer,
    quantization_plan,
    weight_shapes,
    write_checkpoint,
)
from cli_run import run_module
from quant_variants import VARIANTS

FULL = "qwen3.6-35b-a3b"


@pytest.fixture(scope="module")
def tiny_model():
    return build_model("tiny", seed=0)


def _params(model):
    return dict(tree_flatten(model.parameters()))


def _assert_same_params(a, b):
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert pa[k].dtype == pb[k].dtype, k
        assert mx.array_equal(pa[k], pb[k]).item(), k


def _prompt(tokenizer):
    messages = [{"role": "user", "content": "What time is the next train?"}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


# ---------------------------------------------------------------------------
# The written checkpoint


def test_tiny_checkpoint_loads_and_generates(tiny_checkpoint, tiny_model):
    model, tokenizer = mlx_lm.load(str(tiny_checkpoint))  # strict
    assert type(model).__module__ == "mlx_lm.models.qwen3_5_moe"

    # The streamed checkpoint holds exactly build_model's arrays.
    _assert_same_params(model, tiny_model[0])

    prompt = _prompt(tokenizer)
    vocab = PRESETS["tiny"]["text_config"]["vocab_size"]
    tokens = [
        int(t)
        for (t, _), _ in zip(
            generate_step(mx.array(prompt), model, sampler=make_sampler(0.0)), range(5)
        )
    ]
    assert len(tokens) == 5 and all(0 <= t < vocab for t in tokens)
    text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=4)
    assert isinstance(text, str)


def test_checkpoint_files_and_config(tiny_checkpoint):
    files = sorted(p.name for p in tiny_checkpoint.iterdir())
    for name in [
        "config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]:
        assert name in files
    shards = [f for f in files if f.endswith(".safetensors")]
    assert shards == ["model-00001-of-00001.safetensors"]

    config = json.loads((tiny_checkpoint / "config.json").read_text())
    text = config["text_config"]
    assert config["model_type"] == "qwen3_5_moe"
    assert text["model_type"] == "qwen3_5_moe_text"
    assert text["rope_parameters"]["rope_theta"] == 10000000
    assert text["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert config["tie_word_embeddings"] is False

    # The quantization block mlx_lm.convert writes for this model: 4-bit
    # affine, group 64, and an 8-bit entry for every router and shared-expert
    # gate (the model's quant_predicate), nothing else.
    q = config["quantization"]
    expected = {"group_size": 64, "bits": 4, "mode": "affine"}
    for i in range(text["num_hidden_layers"]):
        for gate in ("mlp.gate", "mlp.shared_expert_gate"):
            expected[f"language_model.model.layers.{i}.{gate}"] = {
                "group_size": 64,
                "bits": 8,
            }
    assert q == expected
    assert config["quantization_config"] == q

    index = json.loads((tiny_checkpoint / "model.safetensors.index.json").read_text())
    weights = mx.load(str(tiny_checkpoint / shards[0]))
    assert set(index["weight_map"]) == set(weights)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in weights.values())
    assert index["metadata"]["total_size"] == checkpoint_nbytes("tiny")

    # Layout details that mlx-lm's sanitize relies on: it must change nothing.
    prefix = "language_model.model.layers.0."
    assert weights[prefix + "linear_attn.conv1d.weight"].shape[-1] == 1
    assert weights[prefix + "linear_attn.A_log"].dtype == mx.float32
    assert weights[prefix + "mlp.gate.weight"].dtype == mx.uint32
    assert weights[prefix + "mlp.gate.scales"].dtype == mx.bfloat16
    model, _ = mlx_lm.utils.load_model(tiny_checkpoint, lazy=True)
    sanitized = model.sanitize(dict(weights))
    assert sanitized.keys() == weights.keys()
    for k, v in weights.items():
        assert mx.array_equal(sanitized[k], v).item(), k


def test_loaded_modules_quantized_as_config_says(tiny_checkpoint):
    model, _ = mlx_lm.utils.load_model(tiny_checkpoint, lazy=True)
    layer = model.layers[0]
    assert isinstance(layer.mlp.gate, nn.QuantizedLinear) and layer.mlp.gate.bits == 8
    assert layer.mlp.shared_expert_gate.bits == 8
    assert isinstance(layer.mlp.switch_mlp.gate_proj, QuantizedSwitchLinear)
    assert layer.mlp.switch_mlp.down_proj.bits == 4
    assert layer.linear_attn.in_proj_qkv.bits == 4
    assert model.layers[3].self_attn.q_proj.group_size == 64
    assert isinstance(model.language_model.model.embed_tokens, nn.QuantizedEmbedding)
    assert model.language_model.lm_head.bits == 4


def test_streaming_shards(tmp_path, tiny_checkpoint):
    """Small shard limit: several shards, one unit (layer) never split, same
    tensors and logits as the single-shard checkpoint."""
    out = write_checkpoint(tmp_path / "sharded", "tiny", seed=0, max_shard_bytes=3 << 20)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(shards)
    assert n > 3
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    layer_of = {}
    for name, shard in index["weight_map"].items():
        unit = re.match(
            r"language_model\.(model\.layers\.\d+|model\.embed_tokens|model\.norm"
            r"|lm_head)\.",
            name,
        )[1]
        assert layer_of.setdefault(unit, shard) == shard, name
    assert list(index["weight_map"]) == sorted(index["weight_map"])

    a, _ = mlx_lm.load(str(out))
    b, _ = mlx_lm.load(str(tiny_checkpoint))
    _assert_same_params(a, b)
    x = mx.array([[1, 50, 300, 7, 900]])
    assert mx.array_equal(a(x), b(x)).item()

    # Rewriting the directory leaves no stale shard behind.
    write_checkpoint(out, "tiny", seed=1)
    assert [p.name for p in out.glob("*.safetensors")] == [
        "model-00001-of-00001.safetensors"
    ]
    mlx_lm.load(str(out))


# ---------------------------------------------------------------------------
# Quantisations


def _quantized_modules(model):
    """``{module path: (group_size, bits, mode)}`` of every quantised module."""
    return {p: (m.group_size, m.bits, m.mode) for p, m in model.named_modules() if hasattr(m, "bits")}


def test_default_quantization_is_the_4bit_layout(demo_checkpoint, quant_checkpoint):
    """The default arguments and the same setting spelled out write the very
    files of the default checkpoint (the layout the kernels read)."""
    plan = quantization_plan()
    assert (plan.group_size, plan.bits, plan.mode, plan.parts, plan.recipe) == (64, 4, "affine", {}, None)
    explicit = quant_checkpoint("affine4")
    for name in ("config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json"):
        assert (explicit / name).read_bytes() == (demo_checkpoint / name).read_bytes(), name
    spelled = quantization_plan(4, 64, "affine", {"router": {"bits": 8}, "experts": {"bits": 4}})
    assert spelled.parts == {"router": (64, 8, "affine"), "experts": (64, 4, "affine")}  # and change nothing:
    model, config = build_model("tiny", seed=0, lm_head_scale=DEMO_LM_HEAD_SCALE, bits=4, group_size=64,
                                parts={"router": {"bits": 8}, "experts": {"bits": 4}})
    _assert_same_params(model, mlx_lm.load(str(demo_checkpoint))[0])
    assert config["quantization"] == json.loads((demo_checkpoint / "config.json").read_text())["quantization"]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_quantized_variant_loads_as_asked(quant_checkpoint, name):
    """Each variant loads strictly with stock mlx_lm.load; every quantised
    module has its part's (group_size, bits, mode); config.json's
    quantization block is mlx_lm.convert's: the top level plus an entry for
    exactly the modules that differ from it, each the module's setting."""
    kwargs, expected = VARIANTS[name]
    path = quant_checkpoint(name)
    model, _ = mlx_lm.load(str(path))  # strict
    got = _quantized_modules(model)
    parts = {p: ckpt._part_of(p) for p in got}
    assert None not in parts.values(), [p for p, part in parts.items() if part is None]
    assert set(parts.values()) == set(PARTS)
    for p, spec in got.items():
        assert spec == expected[parts[p]], (p, spec)

    q = json.loads((path / "config.json").read_text())["quantization"]
    top = (q["group_size"], q["bits"], q["mode"])
    plan = quantization_plan(**kwargs)
    assert top == (plan.group_size, plan.bits, plan.mode)
    entries = {k: v for k, v in q.items() if isinstance(v, dict)}
    differ = {p for p, spec in got.items() if spec != top}
    assert set(entries) == differ | {p for p in got if parts[p] in ("router", "shared_expert_gate")}
    for p, e in entries.items():
        assert (e["group_size"], e["bits"], e.get("mode", "affine")) == got[p], p

    # the checkpoint's tensors are build_model's, and weight_shapes knows them
    built, config = build_model("tiny", seed=0, lm_head_scale=DEMO_LM_HEAD_SCALE, **kwargs)
    assert config["quantization"] == q
    assert {k: (tuple(v.shape), v.dtype) for k, v in _params(built).items()} == weight_shapes("tiny", **kwargs)
    _assert_same_params(built, model)


def test_recipe_is_mlx_lm_convert_mixed_layout(tmp_path):
    """--recipe: mlx-lm's own mixed predicate (mixed_3_4: 3 bits, 4 in the
    first and last eighth of the layers and every third between for the
    down projections, the lm_head 4): per-path entries for every module, as
    mlx_lm.convert writes them, and a model stock mlx_lm.load loads so."""
    out = write_checkpoint(tmp_path / "mixed", "tiny", seed=0, recipe="mixed_3_4")
    model, _ = mlx_lm.load(str(out))
    got = _quantized_modules(model)
    q = json.loads((out / "config.json").read_text())["quantization"]
    assert {k: (v["group_size"], v["bits"], v["mode"]) for k, v in q.items() if isinstance(v, dict)} == got
    lm = "language_model.model.layers"
    down = {i: got[f"{lm}.{i}.mlp.switch_mlp.down_proj"][1] for i in range(8)}
    assert down == {0: 4, 1: 3, 2: 3, 3: 4, 4: 3, 5: 3, 6: 4, 7: 4}  # mlx-lm's use_more_bits for 8 layers
    assert {got[f"{lm}.{i}.mlp.switch_mlp.gate_proj"][1] for i in range(8)} == {3}
    assert got[f"{lm}.0.mlp.gate"][1] == 3  # the recipe sets the router too, as mlx_lm.convert does
    assert got["language_model.lm_head"][1] == 4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"bits": 7}, "bits=7: mode 'affine' takes bits 2, 3, 4, 5, 6, 8"),
        ({"bits": True}, "bits=True"),
        ({"group_size": 48}, "group_size=48: mode 'affine' takes group sizes 32, 64, 128"),
        ({"mode": "int4"}, "mode='int4': expected one of affine, mxfp4, nvfp4, mxfp8"),
        ({"mode": "mxfp4", "bits": 8}, "bits=8: mode 'mxfp4' takes bits 4 only"),
        ({"mode": "nvfp4", "group_size": 32}, "group_size=32: mode 'nvfp4' takes group size 16 only"),
        ({"parts": {"expert": {"bits": 3}}}, "unknown part 'expert'"),
        ({"parts": {"experts": {"bitz": 3}}}, "parts['experts']: expected a mapping"),
        ({"parts": {"experts": 3}}, "parts['experts']: expected a mapping"),
        ({"parts": {"experts": {"bits": 9}}}, "parts['experts']['bits']=9"),
        ({"mode": "mxfp4", "parts": {"attention": {"bits": 8}}}, "parts['attention']['bits']=8: mode 'mxfp4'"),
        ({"recipe": "mixed_9_9"}, "recipe='mixed_9_9'"),
        ({"recipe": "mixed_3_4", "mode": "mxfp4"}, "affine only"),
        ({"recipe": "mixed_3_4", "parts": {"experts": {"bits": 3}}}, "cannot be combined"),
    ],
)
def test_bad_quantization_arguments(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build_model(**kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        write_checkpoint(tmp_path, "tiny", **kwargs)
    assert not list(tmp_path.iterdir())  # nothing written


def test_quant_modes_are_mlx_defaults():
    """QUANT_MODES holds MLX's own default (group size, bits) of each mode."""
    for mode, (group_size, bits) in ckpt.QUANT_MODES.items():
        q = nn.QuantizedLinear(64, 8, bias=False, mode=mode)
        assert (q.group_size, q.bits, q.mode) == (group_size, bits, mode)


def test_part_mode_change_takes_the_modes_defaults():
    plan = quantization_plan(parts={"experts": {"mode": "mxfp4"}, "router": {"mode": "affine", "bits": 4},
                                    "attention": {"bits": 8}})
    assert plan.parts == {"experts": (32, 4, "mxfp4"), "router": (64, 4, "affine"), "attention": (64, 8, "affine")}
    top_mx = quantization_plan(mode="mxfp4", parts={"lm_head": {"mode": "affine"}, "router": {"mode": "mxfp8"}})
    assert (top_mx.group_size, top_mx.bits) == (32, 4)
    assert top_mx.parts == {"lm_head": (64, 4, "affine"), "router": (32, 8, "mxfp8")}


# ---------------------------------------------------------------------------
# build_model


def test_deterministic_per_seed(tiny_model):
    again, config = build_model("tiny", seed=0)
    _assert_same_params(again, tiny_model[0])
    assert config == tiny_model[1]

    other, _ = build_model("tiny", seed=1)
    pa, pb = _params(tiny_model[0]), _params(other)
    key = "language_model.model.layers.0.mlp.switch_mlp.up_proj.weight"
    assert not mx.array_equal(pa[key], pb[key]).item()


def test_weights_are_nontrivial():
    model, _ = build_model("tiny", seed=0, quantize=False, dtype=mx.float32)
    p = _params(model)
    layer = "language_model.model.layers.0."
    for name in [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "linear_attn.norm.weight",
    ]:
        w = p[layer + name]
        assert abs(w.mean().item() - 1.0) < 0.05 and 0.05 < w.std().item() < 0.2
    assert p["language_model.model.layers.3.self_attn.q_norm.weight"].std().item() > 0.05
    conv = p[layer + "linear_attn.conv1d.weight"]
    assert conv.shape[-1] == 1 and conv.std().item() > 0.3

    # Decays g = exp(-exp(A_log) * softplus(a + dt_bias)) on real activations.
    gdn = model.layers[0].linear_attn
    A = mx.exp(p[layer + "linear_attn.A_log"])
    assert A.min().item() >= 0.1 and A.max().item() <= 8.0
    x = mx.random.normal((512, 256), key=mx.random.key(3))
    a = gdn.in_proj_a(model.layers[0].input_layernorm(x))
    g = mx.exp(-A * nn.softplus(a + gdn.dt_bias))
    q = np.quantile(np.array(g), [0.1, 0.5, 0.9])
    assert 0.3 < q[0] and q[0] < q[1] < q[2] < 1.0
    assert 0.6 < q[1] < 0.95


def test_unquantized_fp32(tiny_model):
    model, config = build_model("tiny", seed=0, quantize=False, dtype=mx.float32)
    assert "quantization" not in config
    params = _params(model)
    assert all(v.dtype == mx.float32 for v in params.values())
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())

    # Same random draws: the fp32 logits follow the 4-bit bf16 model's (4-bit
    # quantization of every matrix moves them by ~30% relative L2).
    x = mx.array([[1, 50, 300, 7, 900, 12, 4]])
    ref = model(x).flatten()
    out = tiny_model[0](x).astype(mx.float32).flatten()
    cos = (ref @ out / (mx.linalg.norm(ref) * mx.linalg.norm(out))).item()
    assert cos > 0.9, cos


def test_activations_stay_order_one(tiny_model):
    model = tiny_model[0]
    h = model.language_model.model.embed_tokens(mx.array([[5, 60, 700, 80, 9, 1000]]))
    for layer in model.layers:
        h = layer(h, mask=None if layer.is_linear else "causal")
        rms = mx.sqrt(mx.mean(h.astype(mx.float32) ** 2)).item()
        assert 0.5 < rms < 4.0


# ---------------------------------------------------------------------------
# Router skew and lm_head scale


def _router_shares(model, n_tokens=4096):
    """Selection share of each expert (sorted, descending) per layer, from the
    routers of ``model`` (dequantized, fp32) on isotropic random inputs."""
    mlp = model.layers[0].mlp
    k, E = mlp.top_k, mlp.num_experts
    x = mx.random.normal((n_tokens, model.language_model.args.hidden_size), key=mx.random.key(7))
    shares = []
    for layer in model.layers:
        gate = layer.mlp.gate
        w = mx.dequantize(gate.weight, gate.scales, gate.biases, gate.group_size, gate.bits)
        logits = x @ w.astype(mx.float32).T
        top = mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k]
        counts = np.bincount(np.array(top).ravel(), minlength=E)
        shares.append(np.sort(counts)[::-1] / (n_tokens * k))
    return np.array(shares)


def test_router_skew_changes_histogram(tiny_model):
    skewed, _ = build_model("tiny", seed=0, router_skew=1.5)
    uniform = _router_shares(tiny_model[0]).mean(0)
    zipf = _router_shares(skewed).mean(0)
    E = len(uniform)
    print(
        f"\nmost popular expert share (uniform {1 / E:.4f}): S=0 {uniform[0]:.4f}, "
        f"S=1.5 {zipf[0]:.4f}; least popular: {uniform[-1]:.4f} vs {zipf[-1]:.4f}"
    )
    assert uniform[0] < 1.3 / E
    assert zipf[0] > 1.5 * uniform[0]
    assert zipf[-1] < 0.6 * uniform[-1]
    # Popular experts are spread over expert ids, differently in each layer.
    row_norms = [
        mx.linalg.norm(
            mx.dequantize(g.weight, g.scales, g.biases, g.group_size, g.bits).astype(
                mx.float32
            ),
            axis=-1,
        )
        for g in (skewed.layers[0].mlp.gate, skewed.layers[1].mlp.gate)
    ]
    assert mx.argmax(row_norms[0]).item() != mx.argmax(row_norms[1]).item()


def test_lm_head_scale_sharpens_logits(demo_checkpoint, tiny_checkpoint):
    model, tokenizer = mlx_lm.load(str(demo_checkpoint))
    flat, _ = mlx_lm.load(str(tiny_checkpoint))
    p_demo, p_flat = _params(model), _params(flat)
    # Only the lm_head differs from the default checkpoint.
    differ = [k for k in p_flat if not mx.array_equal(p_flat[k], p_demo[k]).item()]
    assert differ and all(k.startswith("language_model.lm_head.") for k in differ)

    x = mx.array([_prompt(tokenizer)])
    demo, base = model(x)[0].astype(mx.float32), flat(x)[0].astype(mx.float32)
    ratio = (demo.std(-1) / base.std(-1)).mean().item()
    assert abs(ratio - DEMO_LM_HEAD_SCALE) < 0.05 * DEMO_LM_HEAD_SCALE

    def margins(logits):
        top2 = mx.sort(logits, -1)[:, -2:]
        return np.array(top2[:, 1] - top2[:, 0])

    m_demo, m_flat = margins(demo), margins(base)
    print(
        f"\ntop-1/top-2 logit margin, median: scale 1 {np.median(m_flat):.3f}, "
        f"scale {DEMO_LM_HEAD_SCALE} {np.median(m_demo):.3f}"
    )
    # Median margin well above the bf16 spacing of the logits themselves.
    spacing = 2.0 ** (np.floor(np.log2(np.abs(np.array(demo.max(-1))))) - 7)
    assert np.median(m_demo / spacing) > 4
    assert np.median(m_demo) > 1.0


def test_demo_greedy_decode_matches_one_shot(demo_checkpoint):
    """Step-by-step greedy decode and one forward pass over the same tokens pick
    the same argmax at every position (logits are not flat)."""
    model, tokenizer = mlx_lm.load(str(demo_checkpoint))
    prompt = _prompt(tokenizer)
    n = 16
    tokens = [
        int(t)
        for (t, _), _ in zip(
            generate_step(mx.array(prompt), model, sampler=make_sampler(0.0)), range(n)
        )
    ]
    logits = model(mx.array([prompt + tokens]))[0, len(prompt) - 1 : -1]
    assert mx.argmax(logits, -1).tolist() == tokens


# ---------------------------------------------------------------------------
# Full preset: shapes and sizes only


def test_full_preset_config_matches_design_notes():
    t = PRESETS[FULL]["text_config"]
    assert PRESETS[FULL]["model_type"] == "qwen3_5_moe"
    expected = {
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "full_attention_interval": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "vocab_size": 248320,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
    }
    assert {k: t[k] for k in expected} == expected
    assert t["rope_parameters"]["rope_theta"] == 1e7
    assert t["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert t["layer_types"].count("full_attention") == 10
    assert t["layer_types"][3] == "full_attention"

    # mlx-lm reads the nested text config as these arguments.
    from mlx_lm.models.qwen3_5 import TextModelArgs

    args = TextModelArgs.from_dict(ckpt.preset_config(FULL)["text_config"])
    assert args.rope_theta == 1e7 and args.partial_rotary_factor == 0.25


def _qlinear(out_dims, in_dims, bits=4, experts=None):
    lead = () if experts is None else (experts,)
    return {
        "weight": (lead + (out_dims, in_dims * bits // 32), mx.uint32),
        "scales": (lead + (out_dims, in_dims // 64), mx.bfloat16),
        "biases": (lead + (out_dims, in_dims // 64), mx.bfloat16),
    }


def test_full_preset_shapes_and_size():
    shapes = weight_shapes(FULL)

    def layer(i):
        prefix = f"language_model.model.layers.{i}."
        return {k[len(prefix) :]: v for k, v in shapes.items() if k.startswith(prefix)}

    bf16 = mx.bfloat16
    mlp = {}
    for name, spec in [
        ("mlp.gate", _qlinear(256, 2048, bits=8)),
        ("mlp.shared_expert_gate", _qlinear(1, 2048, bits=8)),
        ("mlp.shared_expert.gate_proj", _qlinear(512, 2048)),
        ("mlp.shared_expert.up_proj", _qlinear(512, 2048)),
        ("mlp.shared_expert.down_proj", _qlinear(2048, 512)),
        ("mlp.switch_mlp.gate_proj", _qlinear(512, 2048, experts=256)),
        ("mlp.switch_mlp.up_proj", _qlinear(512, 2048, experts=256)),
        ("mlp.switch_mlp.down_proj", _qlinear(2048, 512, experts=256)),
    ]:
        mlp.update({f"{name}.{k}": v for k, v in spec.items()})
    norms = {
        "input_layernorm.weight": ((2048,), bf16),
        "post_attention_layernorm.weight": ((2048,), bf16),
    }

    gdn = dict(norms, **mlp)
    for name, spec in [
        ("in_proj_qkv", _qlinear(8192, 2048)),
        ("in_proj_z", _qlinear(4096, 2048)),
        ("in_proj_b", _qlinear(32, 2048)),
        ("in_proj_a", _qlinear(32, 2048)),
        ("out_proj", _qlinear(2048, 4096)),
    ]:
        gdn.update({f"linear_attn.{name}.{k}": v for k, v in spec.items()})
    gdn["linear_attn.conv1d.weight"] = ((8192, 4, 1), bf16)
    gdn["linear_attn.A_log"] = ((32,), mx.float32)
    gdn["linear_attn.dt_bias"] = ((32,), bf16)
    gdn["linear_attn.norm.weight"] = ((128,), bf16)
    assert layer(0) == gdn
    assert layer(38) == gdn

    attn = dict(norms, **mlp)
    for name, spec in [
        ("q_proj", _qlinear(8192, 2048)),
        ("k_proj", _qlinear(512, 2048)),
        ("v_proj", _qlinear(512, 2048)),
        ("o_proj", _qlinear(2048, 4096)),
    ]:
        attn.update({f"self_attn.{name}.{k}": v for k, v in spec.items()})
    attn["self_attn.q_norm.weight"] = ((256,), bf16)
    attn["self_attn.k_norm.weight"] = ((256,), bf16)
    assert layer(3) == attn
    assert layer(39) == attn

    def nbytes(spec):
        return sum(math.prod(s) * d.size for s, d in spec.values())

    head = 2 * nbytes(_qlinear(248320, 2048)) + 2048 * 2  # embed, lm_head, norm
    total = 30 * nbytes(gdn) + 10 * nbytes(attn) + head
    assert len(shapes) == 30 * len(gdn) + 10 * len(attn) + 7
    assert checkpoint_nbytes(FULL) == total
    assert 19.3e9 < total < 19.6e9  # the mlx-community checkpoint: ~19.4 GB


# ---------------------------------------------------------------------------
# Tokenizer


def test_tokenizer(tmp_path, tiny_checkpoint):
    _, tokenizer = mlx_lm.load(str(tiny_checkpoint))
    n = len(tokenizer._tokenizer)
    assert 1000 <= n <= min(p["text_config"]["vocab_size"] for p in PRESETS.values())
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id in tokenizer.eos_token_ids

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello, river!"},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHello, river!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer.encode(text)
    im_start, im_end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>"))
    assert ids.count(im_start) == 3 and ids.count(im_end) == 2
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(tokenizer.encode("Größe 42 — naïve café")) == "Größe 42 — naïve café"

    # Same files on every call.
    make_tokenizer(tmp_path)
    for name in ["tokenizer.json", "tokenizer_config.json"]:
        assert (tmp_path / name).read_bytes() == (tiny_checkpoint / name).read_bytes()


# ---------------------------------------------------------------------------
# Arguments and command line


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"preset": "qwen3-35b"}, "preset"),
        ({"router_skew": -0.5}, "router_skew"),
        ({"router_skew": float("nan")}, "router_skew"),
        ({"lm_head_scale": 0.0}, "lm_head_scale"),
        ({"seed": -1}, "seed"),
        ({"dtype": mx.int32}, "dtype"),
    ],
)
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        build_model(**kwargs)


def test_write_checkpoint_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="preset"):
        write_checkpoint(tmp_path, "nope")
    with pytest.raises(ValueError, match="router_skew"):
        write_checkpoint(tmp_path, "tiny", router_skew=-1)
    with pytest.raises(ValueError, match="max_shard_bytes"):
        write_checkpoint(tmp_path, "tiny", max_shard_bytes=0)
    assert not list(tmp_path.iterdir())


def test_cli(tmp_path, tiny_checkpoint, capsys):
    out = tmp_path / "cli"
    ckpt.main(["--preset", "tiny", "--out", str(out), "--seed", "0"])
    assert "1 shards" in capsys.readouterr().out
    for name in ["model-00001-of-00001.safetensors", "config.json", "tokenizer.json"]:
        assert (out / name).read_bytes() == (tiny_checkpoint / name).read_bytes()

    with pytest.raises(SystemExit):
        ckpt.main(["--preset", "tiny", "--out", str(out), "--router-skew", "-1"])
    assert "argument --router-skew: expected a finite number >= 0, got -1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ckpt.main(["--preset", "big", "--out", str(out)])
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(SystemExit):
        ckpt.main(["--preset", "tiny", "--out", str(a_file)])
    assert f"--out {a_file}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ckpt.main(["--preset", "tiny", "--out", ""])
    assert "empty" in capsys.readouterr().err

    # an existing checkpoint is never replaced without --overwrite
    (out / "model-00001-of-00002.safetensors").write_bytes(b"someone else's shard")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(SystemExit):
        ckpt.main(["--preset", "tiny", "--out", str(out), "--seed", "1"])
    assert "--overwrite" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    ckpt.main(["--preset", "tiny", "--out", str(out), "--seed", "0", "--overwrite"])
    assert not (out / "model-00001-of-00002.safetensors").exists()
    assert (out / "config.json").read_bytes() == (tiny_checkpoint / "config.json").read_bytes()


def test_cli_quantization(tmp_path, quant_checkpoint, capsys):
    """--bits/--group-size/--mode/--part-*: the files of write_checkpoint
    with the same quantisation."""
    out = tmp_path / "cli"
    ckpt.main(["--preset", "tiny", "--out", str(out), "--lm-head-scale", str(DEMO_LM_HEAD_SCALE),
               "--part-bits", "experts=3,attention=8", "--part-bits", "shared_expert=8"])
    ref = quant_checkpoint("experts3")
    for name in ("config.json", "model-00001-of-00001.safetensors"):
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    ckpt.main(["--preset", "tiny", "--out", str(out), "--overwrite", "--lm-head-scale", str(DEMO_LM_HEAD_SCALE),
               "--part-mode", "experts=nvfp4", "--part-bits", "router=6"])
    ref = quant_checkpoint("nvfp4-experts-6bit-router")
    assert (out / "config.json").read_bytes() == (ref / "config.json").read_bytes()
    capsys.readouterr()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--bits", "7"], "--bits=7: mode 'affine' takes bits 2, 3, 4, 5, 6, 8"),
        (["--bits", "four"], "argument --bits: invalid int value"),
        (["--group-size", "48"], "--group-size=48: mode 'affine' takes group sizes"),
        (["--mode", "int4"], "argument --mode: invalid choice"),
        (["--mode", "mxfp4", "--bits", "8"], "--bits=8: mode 'mxfp4' takes bits 4 only"),
        (["--part-bits", "expert=3"], "--part-bits expert=3: unknown part 'expert'"),
        (["--part-bits", "experts"], "--part-bits 'experts': expected NAME=VALUE"),
        (["--part-bits", "experts=x"], "--part-bits experts=x: expected a whole number"),
        (["--part-bits", "experts=3,experts=4"], "part 'experts' given twice"),
        (["--part-bits", "experts=7"], "--part-bits experts=7: mode 'affine' takes bits"),
        (["--part-group-size", "experts=48"], "--part-group-size experts=48: mode 'affine' takes group sizes"),
        (["--part-mode", "experts=int4"], "--part-mode experts='int4': expected one of"),
        (["--part-mode", "experts=mxfp4", "--part-bits", "experts=8"], "--part-bits experts=8: mode 'mxfp4'"),
        (["--recipe", "mixed_3_4", "--mode", "mxfp4"], "--recipe='mixed_3_4': mlx-lm's recipes are affine only"),
        (["--recipe", "mixed_3_4", "--part-bits", "experts=3"], "cannot be combined"),
    ],
)
def test_cli_bad_quantization(tmp_path, capsys, argv, message):
    """One line naming the argument, exit code 2, nothing written."""
    out = tmp_path / "cli"
    with pytest.raises(SystemExit) as exc:
        ckpt.main(["--preset", "tiny", "--out", str(out)] + argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert len([line for line in err.splitlines() if "error:" in line]) == 1
    assert not out.exists()


def test_mlx_lm_constants_are_mlx_lms():
    """The constants of mlx-lm written out in mlx_qwen_fast/checkpoint/ (so that
    importing it does not import mlx-lm) are still mlx-lm's."""
    import importlib

    convert = importlib.import_module("mlx_lm.convert")  # mlx_lm.convert is also a function's name
    utils = importlib.import_module("mlx_lm.utils")
    assert list(ckpt.QUANT_RECIPES) == list(convert.QUANT_RECIPES)
    assert ckpt.MAX_FILE_SIZE_GB == utils.MAX_FILE_SIZE_GB
    assert ckpt.write_checkpoint.__kwdefaults__["max_shard_bytes"] == utils.MAX_FILE_SIZE_GB << 30


CLI = "python -m mlx_qwen_fast.checkpoint"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--bogus"], "unrecognized arguments: --bogus (python -m mlx_qwen_fast.checkpoint --help lists the flags)"),
        (["--presett", "tiny", "--out", "{out}"], "unrecognized arguments: --presett tiny (did you mean --preset?)"),
        ([], "the following arguments are required: --preset {qwen3.6-35b-a3b,tiny,tiny-draft,qwen3.6-35b-a3b-dflash,tiny-dflash}, --out OUT"),
        (["--out", "{out}"], "the following arguments are required: --preset {qwen3.6-35b-a3b,tiny,tiny-draft,qwen3.6-35b-a3b-dflash,tiny-dflash}"),
        (["--preset", "big", "--out", "{out}"], "argument --preset: invalid choice: 'big'"),
        (["--preset", "tiny", "--out", "{out}", "--seed", "-1"],
         "argument --seed: expected a whole number >= 0, got -1"),
        (["--preset", "tiny", "--out", "{out}", "--seed", "x"],
         "argument --seed: expected a whole number >= 0, got 'x'"),
        (["--preset", "tiny", "--out", "{out}", "--seed"], "argument --seed: expected one argument"),
        (["--preset", "tiny", "--out", "{out}", "--router-skew", "nan"],
         "argument --router-skew: expected a finite number >= 0, got nan"),
        (["--preset", "tiny", "--out", "{out}", "--lm-head-scale", "0"],
         "argument --lm-head-scale: expected a finite number > 0, got 0"),
        (["--preset", "tiny", "--out", "{out}", "--bits", "7"], "--bits=7: mode 'affine' takes bits 2, 3, 4, 5, 6, 8"),
        (["--preset", "tiny", "--out", "{out}", "--recipe", "mixed_9"], "argument --recipe: invalid choice: 'mixed_9'"),
        (["--preset", "tiny", "--out", "{file}"], "--out {file}: is a file; expected a folder"),
        (["--preset", "tiny", "--out", "{file}/sub"], "--out {file}/sub: {file} is a file; expected a folder"),
        (["--preset", "tiny", "--out", "{held}"],
         "--out {held} already holds a checkpoint (config.json); pass --overwrite"),
    ],
)
def test_cli_usage_errors_are_one_line_before_mlx_lm(tmp_path, argv, message):
    """`python -m mlx_qwen_fast.checkpoint` with a bad argument: one line
    naming it, exit code 2, no usage block, nothing written, and mlx-lm
    never imported."""
    out, a_file, held = tmp_path / "out", tmp_path / "a_file", tmp_path / "held"
    a_file.write_text("x")
    held.mkdir()
    (held / "config.json").write_text("{}")

    def fill(text):
        return text.replace("{out}", str(out)).replace("{file}", str(a_file)).replace("{held}", str(held))

    r = run_module("mlx_qwen_fast.checkpoint", *map(fill, argv))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{CLI}: error: "), r.stderr
    assert fill(message) in lines[0], r.stderr
    assert r.stdout == ""
    assert r.heavy() == []
    assert not out.exists() and sorted(p.name for p in held.iterdir()) == ["config.json"]


def test_cli_as_main_writes_what_write_checkpoint_writes(tmp_path, tiny_checkpoint):
    """Arguments that pass: `python -m mlx_qwen_fast.checkpoint` imports
    mlx-lm (what the test above checks for is seen when it happens) and
    writes the checkpoint of write_checkpoint."""
    out = tmp_path / "out"
    r = run_module("mlx_qwen_fast.checkpoint", "--preset", "tiny", "--out", str(out), timeout=600)
    assert r.returncode == 0, r.stderr
    assert "mlx_lm" in r.heavy()
    for name in ("config.json", "model-00001-of-00001.safetensors", "tokenizer.json"):
        assert (out / name).read_bytes() == (tiny_checkpoint / name).read_bytes(), name


def test_help_shows_the_required_flags(capsys):
    """-h is met by the parser's first pass (every flag optional there): the
    help still shows --preset and --out as required."""
    with pytest.raises(SystemExit) as e:
        ckpt.main(["-h"])
    assert e.value.code == 0
    usage = " ".join(capsys.readouterr().out.split("\n\n")[0].split())
    assert "--preset {qwen3.6-35b-a3b,tiny,tiny-draft,qwen3.6-35b-a3b-dflash,tiny-dflash} --out OUT [--overwrite]" in usage, usage


def test_tiny_draft_is_the_tiny_family_with_fewer_layers():
    """The draft preset: tiny's shape and vocabulary, 4 layers (3 Gated
    DeltaNet, 1 full attention)."""
    tiny, draft = PRESETS["tiny"]["text_config"], PRESETS["tiny-draft"]["text_config"]
    assert draft["num_hidden_layers"] == 4
    assert draft["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    differ = {k for k in tiny if tiny[k] != draft[k]}
    assert differ == {"num_hidden_layers", "layer_types"}, differ
