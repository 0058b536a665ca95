"""Random-weight Qwen3.5/3.6-MoE checkpoints in the mlx-community layout.

The package is developed and tested without the real 19 GB checkpoint: this
module builds models of the exact Qwen3.6-35B-A3B shape (or a tiny one with the
same structure) with random but non-trivial weights, quantized the way
``mlx_lm.convert -q`` quantizes the real model (by default affine 4-bit, group
64, router and shared-expert gates 8-bit; other bits, group sizes, modes and
per-part settings on request), and writes them as a checkpoint that stock
``mlx_lm.load`` loads strictly.

Python API::

    model, config = build_model("tiny", seed=0)        # in memory, evaluated
    path = write_checkpoint("ckpt", "tiny", seed=0)     # streamed to disk
    make_tokenizer("ckpt")                              # tokenizer files only

Command line::

    python -m mlx_qwen_fast.checkpoint --preset tiny-dflash --out /tmp/tiny-dflash  # a DFlash drafter
    python -m mlx_qwen_fast.checkpoint --preset tiny --out /tmp/tiny \\
        [--seed N] [--router-skew S] [--lm-head-scale X] \\
        [--bits B] [--group-size G] [--mode affine|mxfp4|nvfp4|mxfp8] \\
        [--part-bits experts=3,attention=8,shared_expert=8] \\
        [--part-group-size PART=G,...] [--part-mode PART=MODE,...] \\
        [--recipe mixed_3_4|...]

Importing the module is light (MLX, no mlx-lm, no tqdm): the functions that
build or write a model import mlx-lm when called, so the command line checks
its arguments (one line, exit code 2, on any error) before importing it.

Quantisation: by default mlx-community's 4-bit layout (affine 4-bit group
64, router and shared-expert gate 8-bit); every other layout is made with
MLX's ``nn.quantize`` through mlx-lm's ``quantize_model`` (see
:func:`build_model` and :func:`quantization_plan`), so config.json's
``quantization`` block is the one ``mlx_lm.convert`` writes and stock
``mlx_lm.load`` loads it.

Every parameter is drawn from its own key, derived from ``seed`` and the
parameter's path, so the weights do not depend on the order in which they are
generated: ``build_model`` and the streaming ``write_checkpoint`` produce
identical arrays for the same arguments.

Weight distributions (``H`` = hidden size, ``L`` = number of layers). Matrices
are zero-mean uniform with the stated standard deviation (uniform like
``nn.Linear``'s own init, and ~5x cheaper than normals on the CPU):

- embeddings std 1; every RMSNorm weight (input, post-attention, final, q/k
  norms and the gated norm of Gated DeltaNet) ``1 + 0.1 N(0, 1)``, stored in
  mlx layout (used as is, so mlx-lm's ``sanitize`` changes nothing);
- linear and expert weights std ``1/sqrt(fan_in)``; the projections that write
  into the residual stream (``o_proj``, ``out_proj``, expert and shared-expert
  ``down_proj``) further scaled by ``sqrt(4 / L)``, so the residual stream
  stays O(1) (RMS ~1.1 after the embedding, ~1.7 after the last layer);
- ``in_proj_a`` scaled by 0.5; ``A_log = log(U(0.1, 8))``; ``dt_bias`` chosen
  per head so that the decay ``g = exp(-exp(A_log) * softplus(a + dt_bias))``
  is ``U(0.5, 0.99)`` across heads at ``a = 0`` (on real activations its
  10/50/90% quantiles are about 0.5/0.8/0.97);
- depthwise conv1d ``N(0, 1/kernel)``, shape ``(conv_dim, kernel, 1)``;
- router std ``1/sqrt(H)``, optionally skewed (``router_skew``);
- ``lm_head`` std ``lm_head_scale / sqrt(H)``.
"""

import contextlib
import copy
import hashlib
import io
import json
import math
import numbers
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List, Mapping, NamedTuple, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ._cli import ArgumentParser, finite_number, one_line_warnings, whole_number

# mlx-lm (which imports transformers) is imported inside the functions that
# use it, so that importing this module, and the CLI's argument checks, stay
# light. Its constants this module needs are written out below, and
# tests/test_checkpoint.py checks they are still mlx-lm's.

#: mlx-lm's mixed per-layer quantisation recipes (``mlx_lm.convert.QUANT_RECIPES``).
QUANT_RECIPES = ("mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6")

#: mlx-lm's shard size limit in GB (``mlx_lm.utils.MAX_FILE_SIZE_GB``), the
#: default of :func:`write_checkpoint`'s ``max_shard_bytes``.
MAX_FILE_SIZE_GB = 5

#: The default quantisation (mlx-community's 4-bit checkpoints): what the
#: CUDA kernels read. Other quantisations: ``bits``, ``group_size``,
#: ``mode``, ``parts`` and ``recipe`` of :func:`build_model`.
QUANT_GROUP_SIZE = 64
QUANT_BITS = 4
QUANT_MODE = "affine"

# Multiplier of the lm_head weights for the demo and token-identity tests.
# With scale 1 the logits of a random model are flat (std ~1), and mlx-lm's
# sampler takes the argmax of bf16 log-probabilities around -ln(vocab), where
# the bf16 spacing is 0.03-0.06: near-ties are settled by rounding, and even
# one-shot vs step-by-step decoding of stock mlx-lm disagree on some tokens.
# With 16 the logits have std ~16 and the top-1/top-2 margins are many bf16
# ulps (bench/results/package-figures.md, "Random checkpoints").
# A uniform scale cannot help against noise in the hidden state itself: margin
# and noise scale together, so bf16 vs fp32 (or two bf16 implementations with
# different rounding) still pick different top-1 tokens where the float32
# margin is small (tiny preset: 79-85% agreement at any scale). Compare such
# paths in fp32, or report the margin where they diverge.
DEMO_LM_HEAD_SCALE = 16.0

# Calibration of ``router_skew``: the router row of the expert of popularity
# rank r (1 = most popular) is multiplied by ``r ** (-router_skew * 0.4)``.
_SKEW_EXPONENT = 0.4

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_VOCAB_SIZE = 1280  # upper bound of the BPE trainer, specials included

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Pre-tokenizer regex of the Qwen3.5 tokenizer (transformers' Qwen3_5Tokenizer
# installs this one whatever tokenizer.json says, so use the same).
_QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _make_config(
    *,
    hidden_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    mrope_section: List[int],
    linear_num_key_heads: int,
    linear_num_value_heads: int,
    linear_key_head_dim: int,
    linear_value_head_dim: int,
    num_experts: int,
    num_experts_per_tok: int,
    moe_intermediate_size: int,
    shared_expert_intermediate_size: int,
    vocab_size: int,
) -> dict:
    """A config.json dict shaped like the real Qwen3.6-35B-A3B one."""
    interval = 4
    text_config = {
        "model_type": "qwen3_5_moe_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "decoder_sparse_step": 1,
        "dtype": "bfloat16",
        "eos_token_id": SPECIAL_TOKENS.index("<|endoftext|>"),
        "full_attention_interval": interval,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "layer_types": [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(num_hidden_layers)
        ],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": linear_key_head_dim,
        "linear_num_key_heads": linear_num_key_heads,
        "linear_num_value_heads": linear_num_value_heads,
        "linear_value_head_dim": linear_value_head_dim,
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "moe_intermediate_size": moe_intermediate_size,
        "norm_topk_prob": True,
        "num_attention_heads": num_attention_heads,
        "num_experts": num_experts,
        "num_experts_per_tok": num_experts_per_tok,
        "num_hidden_layers": num_hidden_layers,
        "num_key_value_heads": num_key_value_heads,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": mrope_section,
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
        },
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": shared_expert_intermediate_size,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text_config,
        "tie_word_embeddings": False,
    }


#: The "tiny" preset's arguments (also the draft preset's, with fewer layers).
_TINY = dict(
    hidden_size=256,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=64,
    mrope_section=[3, 3, 2],
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    num_experts=32,
    num_experts_per_tok=8,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=128,
    vocab_size=TOKENIZER_VOCAB_SIZE,  # the tokenizer's ~1.2K tokens, rounded up
)

# Config dicts (config.json before quantization) of the presets. Read-only:
# use ``preset_config`` for a copy.
PRESETS: Dict[str, dict] = {
    # Text part of Qwen3.6-35B-A3B (Qwen3.5-35B-A3B is identical).
    "qwen3.6-35b-a3b": _make_config(
        hidden_size=2048,
        num_hidden_layers=40,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        mrope_section=[11, 11, 10],
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        vocab_size=248320,
    ),
    # Same structure, scaled down: GQA 8:1 with 2 KV heads, Hv = 2 * Hk,
    # partial rotary, 8 layers (2 full attention), top-8 routing, every input
    # dimension a multiple of the quantization group (64).
    "tiny": _make_config(**_TINY),
    # A draft model for speculative decoding with "tiny" as the target: the
    # tiny shape with 4 layers (3 Gated DeltaNet, 1 full attention), the same
    # vocabulary and tokenizer (mlx-lm's speculative loop feeds the target's
    # tokens to the draft).
    "tiny-draft": _make_config(**dict(_TINY, num_hidden_layers=4)),
}


def preset_config(preset: str = "tiny") -> dict:
    """Return a deep copy of ``PRESETS[preset]``.

    Raises:
        ValueError: if ``preset`` is not a key of ``PRESETS``.
    """
    if preset not in PRESETS:
        raise ValueError(
            f"Unknown preset={preset!r}; expected one of {sorted(PRESETS)}."
        )
    return copy.deepcopy(PRESETS[preset])


def _check_args(preset, seed, router_skew, lm_head_scale):
    preset_config(preset)
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got seed={seed!r}.")
    if not (isinstance(router_skew, numbers.Real) and math.isfinite(router_skew)):
        raise ValueError(f"router_skew must be a finite number, got {router_skew!r}.")
    if router_skew < 0:
        raise ValueError(f"router_skew must be >= 0, got router_skew={router_skew}.")
    if lm_head_scale is not None and not (
        isinstance(lm_head_scale, numbers.Real)
        and math.isfinite(lm_head_scale)
        and lm_head_scale > 0
    ):
        raise ValueError(
            f"lm_head_scale must be a positive finite number or None, "
            f"got lm_head_scale={lm_head_scale!r}."
        )


# ---------------------------------------------------------------------------
# Quantisation options

#: MLX's quantisation modes (``mx.quantize``, MLX 0.32) -> their default
#: ``(group_size, bits)``. "affine" takes :data:`AFFINE_BITS` and
#: :data:`AFFINE_GROUP_SIZES`; each of the others only its default pair.
QUANT_MODES: Dict[str, Tuple[int, int]] = {
    "affine": (64, 4),
    "mxfp4": (32, 4),
    "nvfp4": (16, 4),
    "mxfp8": (32, 8),
}
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUP_SIZES = (32, 64, 128)

#: Parts a per-part override names -> the module paths (suffixes of the
#: checkpoint's module paths) each covers; every quantised module of the
#: model is in exactly one part.
PARTS: Dict[str, Tuple[str, ...]] = {
    "experts": tuple(f"mlp.switch_mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")),
    "shared_expert": tuple(f"mlp.shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj")),
    "router": ("mlp.gate",),
    "shared_expert_gate": ("mlp.shared_expert_gate",),
    "attention": tuple(f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
    "linear_attention": tuple(
        f"linear_attn.{p}" for p in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")
    ),
    "embed_tokens": ("model.embed_tokens",),
    "lm_head": ("lm_head",),
}

#: Parts the model's own ``quant_predicate`` quantises 8-bit affine group 64
#: whatever the rest (``mlx_lm.convert`` writes them so): their default.
_GATE_PARTS = ("router", "shared_expert_gate")
_GATE_SPEC = (64, 8, "affine")

_PART_KEYS = ("bits", "group_size", "mode")


class Quantization(NamedTuple):
    """A checked quantisation plan (:func:`quantization_plan`).

    ``group_size``, ``bits``, ``mode``: the top-level setting (config.json's
    ``quantization`` block); ``parts``: part name -> ``(group_size, bits,
    mode)`` for the parts given an override; ``recipe``: an mlx-lm recipe
    name or None.
    """

    group_size: int
    bits: int
    mode: str
    parts: Dict[str, Tuple[int, int, str]]
    recipe: Optional[str]


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _check_spec(group_size, bits, mode, what: Dict[str, str]) -> Tuple[int, int, str]:
    """``(group_size, bits, mode)`` if MLX takes that combination, else
    ValueError naming the argument through ``what`` (key -> how to name it:
    ``what["bits"]`` etc.; each message shows the value given)."""
    if mode not in QUANT_MODES:
        raise ValueError(f"{what['mode']}={mode!r}: expected one of {', '.join(QUANT_MODES)}")
    if mode == "affine":
        if not _is_int(bits) or bits not in AFFINE_BITS:
            raise ValueError(f"{what['bits']}={bits!r}: mode 'affine' takes bits "
                             f"{', '.join(map(str, AFFINE_BITS))}")
        if not _is_int(group_size) or group_size not in AFFINE_GROUP_SIZES:
            raise ValueError(f"{what['group_size']}={group_size!r}: mode 'affine' takes group sizes "
                             f"{', '.join(map(str, AFFINE_GROUP_SIZES))}")
    else:
        g, b = QUANT_MODES[mode]
        if bits != b or not _is_int(bits):
            raise ValueError(f"{what['bits']}={bits!r}: mode {mode!r} takes bits {b} only")
        if group_size != g or not _is_int(group_size):
            raise ValueError(f"{what['group_size']}={group_size!r}: mode {mode!r} takes group size {g} only")
    return int(group_size), int(bits), mode


def _resolve_part(base: Tuple[int, int, str], override: Mapping) -> Tuple[int, int, str]:
    """The part's ``(group_size, bits, mode)``: the override's keys, the rest
    from ``base`` when the mode stays the same, else the new mode's defaults."""
    mode = override.get("mode", base[2])
    g, b = (base[0], base[1]) if mode == base[2] else QUANT_MODES.get(mode, (None, None))
    return override.get("group_size", g), override.get("bits", b), mode


def quantization_plan(
    bits: Optional[int] = None,
    group_size: Optional[int] = None,
    mode: str = QUANT_MODE,
    parts: Optional[Mapping[str, Mapping[str, object]]] = None,
    recipe: Optional[str] = None,
    *,
    names: Optional[Mapping[str, str]] = None,
) -> Quantization:
    """Check a quantisation request and resolve its defaults.

    Args:
        bits: top-level bits; None = the mode's default (4 for "affine").
        group_size: top-level group size; None = the mode's default (64 for
            "affine").
        mode: a key of :data:`QUANT_MODES`.
        parts: part name (a key of :data:`PARTS`) -> override, a mapping with
            any of ``"bits"``, ``"group_size"``, ``"mode"``. Keys not given
            come from the part's default setting if the mode stays the same
            (the top level; 8-bit affine group 64 for the router and the
            shared-expert gate), else from the new mode's defaults.
        recipe: one of mlx-lm's ``QUANT_RECIPES`` ("mixed_2_6", "mixed_3_4",
            "mixed_3_6", "mixed_4_6"): its per-layer mixed bit widths, built
            by mlx-lm's own ``mixed_quant_predicate_builder`` as
            ``mlx_lm.convert --quant-predicate`` builds them (mode "affine"
            only, no parts; the recipe also sets the router's and the
            shared-expert gate's bits, as in ``mlx_lm.convert``).
        names: how error messages name the arguments (keys "bits",
            "group_size", "mode", "recipe", "parts", "part.bits",
            "part.group_size", "part.mode"; ``{part}`` in a "part.*" name
            stands for the part's name); default the Python names.

    Returns:
        :class:`Quantization`.

    Raises:
        ValueError: a combination MLX does not implement (e.g. mode "mxfp4"
            with bits 8), bits or group size outside :data:`AFFINE_BITS` /
            :data:`AFFINE_GROUP_SIZES`, an unknown part, mode or recipe, a
            recipe with another mode or with parts; the message names the
            argument and the value.
    """
    n = {"bits": "bits", "group_size": "group_size", "mode": "mode", "recipe": "recipe", "parts": "parts"}
    n.update(names or {})
    if mode not in QUANT_MODES:
        raise ValueError(f"{n['mode']}={mode!r}: expected one of {', '.join(QUANT_MODES)}")
    g0, b0 = QUANT_MODES[mode]
    top = _check_spec(g0 if group_size is None else group_size, b0 if bits is None else bits, mode, n)
    if recipe is not None:
        if recipe not in QUANT_RECIPES:
            raise ValueError(f"{n['recipe']}={recipe!r}: expected one of {', '.join(QUANT_RECIPES)}")
        if mode != "affine":
            raise ValueError(f"{n['recipe']}={recipe!r}: mlx-lm's recipes are affine only, got {n['mode']}={mode!r}")
        if parts:
            raise ValueError(f"{n['recipe']}={recipe!r} cannot be combined with {n['parts']}")
    resolved = {}
    for part, override in (parts or {}).items():
        if part not in PARTS:
            raise ValueError(f"{n['parts']}: unknown part {part!r}; expected one of {', '.join(PARTS)}")
        if not isinstance(override, Mapping) or not set(override) <= set(_PART_KEYS):
            raise ValueError(f"{n['parts']}[{part!r}]: expected a mapping with keys among "
                             f"{', '.join(_PART_KEYS)}, got {override!r}")
        what = {k: n.get(f"part.{k}", f"{n['parts']}[{part!r}][{k!r}]") for k in _PART_KEYS}
        what = {k: v.replace("{part}", part) for k, v in what.items()}
        base = _GATE_SPEC if part in _GATE_PARTS else top
        resolved[part] = _check_spec(*_resolve_part(base, override), what)
    return Quantization(*top, resolved, recipe)


def _part_of(path: str) -> Optional[str]:
    """The part (key of :data:`PARTS`) of a module path, or None."""
    for part, suffixes in PARTS.items():
        if any(path == s or path.endswith("." + s) for s in suffixes):
            return part
    return None


def _quant_predicate(model: nn.Module, plan: Quantization):
    """The ``quant_predicate`` for ``mlx_lm.utils.quantize_model``: None
    where the plan has no parts and no recipe (mlx-lm then takes the model's
    own: 8-bit router and shared-expert gate, the rest at the top-level
    setting), else the recipe's, or the model's with the parts' overrides on
    top. A
    part at the top-level setting returns True (no per-path entry in
    config.json), a gate part at its default the model's own entry, any
    other override its full ``{"group_size", "bits", "mode"}`` entry."""
    if not plan.parts and plan.recipe is None:
        return None
    if plan.recipe is not None:
        from mlx_lm.convert import mixed_quant_predicate_builder

        return mixed_quant_predicate_builder(plan.recipe, model, plan.group_size)
    own = model.quant_predicate
    top = (plan.group_size, plan.bits, plan.mode)

    def predicate(path, module):
        part = _part_of(path)
        if part not in plan.parts:
            return own(path, module)
        spec = plan.parts[part]
        if part in _GATE_PARTS and spec == _GATE_SPEC:
            return own(path, module)
        if part not in _GATE_PARTS and spec == top:
            return True
        g, b, m = spec
        return {"group_size": g, "bits": b, "mode": m}

    return predicate


# ---------------------------------------------------------------------------
# Random weights


def _key(seed: int, path: str) -> mx.array:
    """A PRNG key that depends only on the seed and the parameter path."""
    digest = hashlib.sha256(f"{int(seed)}/{path}".encode()).digest()
    return mx.random.key(int.from_bytes(digest[:7], "little"))


def _normal(seed, path, shape, std=1.0, mean=0.0):
    return mean + std * mx.random.normal(shape, key=_key(seed, path))


def _matrix(seed, path, shape, std):
    """Zero-mean uniform with standard deviation ``std`` (uniform like
    ``nn.Linear``'s init, and ~5x cheaper than a normal on the CPU)."""
    bound = math.sqrt(3.0) * std
    return mx.random.uniform(-bound, bound, shape, key=_key(seed, path))


def _uniform(seed, path, shape, low, high):
    return mx.random.uniform(low, high, shape, key=_key(seed, path))


def _router_row_scale(seed, path, num_experts, router_skew):
    """Per-expert row multiplier of a router, shape (num_experts, 1)."""
    # A random permutation of 1..E is a random assignment of ranks.
    rank = mx.random.permutation(num_experts, key=_key(seed, path + "#rank")) + 1
    return mx.power(rank.astype(mx.float32), -_SKEW_EXPONENT * router_skew)[:, None]


def _random_weights(
    model: nn.Module,
    args,
    seed: int,
    router_skew: float,
    lm_head_scale: float,
) -> Dict[str, mx.array]:
    """Lazy float32 arrays for every parameter of an unquantized ``model``."""
    n_layers = args.num_hidden_layers
    residual_scale = math.sqrt(4.0 / n_layers)
    kernel = args.linear_conv_kernel_dim
    H = args.hidden_size
    residual_writers = ("o_proj", "out_proj", "down_proj")

    weights = {}
    for path, p in tree_flatten(model.parameters()):
        shape = p.shape
        name = path.rsplit(".", 2)
        module, leaf = name[-2], name[-1]
        if path.endswith("embed_tokens.weight"):
            w = _matrix(seed, path, shape, std=1.0)
        elif path.endswith("lm_head.weight"):
            w = _matrix(seed, path, shape, std=lm_head_scale / math.sqrt(H))
        elif "norm" in module and leaf == "weight":
            w = _normal(seed, path, shape, std=0.1, mean=1.0)
        elif module == "conv1d":
            w = _normal(seed, path, shape, std=1.0 / math.sqrt(kernel))
        elif leaf == "A_log":
            w = mx.log(_uniform(seed, path, shape, 0.1, 8.0))
        elif leaf == "dt_bias":
            # softplus(dt_bias) * exp(A_log) = -log(g0): decay g0 at a = 0.
            a_log_path = path[: -len("dt_bias")] + "A_log"
            A = _uniform(seed, a_log_path, shape, 0.1, 8.0)
            g0 = _uniform(seed, path, shape, 0.5, 0.99)
            s = -mx.log(g0) / A
            w = mx.log(mx.expm1(s))  # inverse softplus
        elif leaf == "weight" and p.ndim in (2, 3):  # linear and expert weights
            std = 1.0 / math.sqrt(shape[-1])
            if module in residual_writers:
                std *= residual_scale
            elif module == "in_proj_a":
                std *= 0.5
            w = _matrix(seed, path, shape, std=std)
            if path.endswith("mlp.gate.weight") and router_skew > 0:
                w = w * _router_row_scale(seed, path, shape[0], router_skew)
        else:
            raise ValueError(f"No initializer for parameter {path} {shape}")
        weights[path] = w
    return weights


def _lazy_model(
    preset: str,
    seed: int,
    router_skew: float,
    lm_head_scale: Optional[float],
    dtype: mx.Dtype,
    quantize: bool,
    plan: Optional[Quantization] = None,
) -> Tuple[nn.Module, dict]:
    """The model with lazy (unevaluated) random, cast and quantized weights
    (``plan``: :func:`quantization_plan`, default the 4-bit layout).

    Nothing is computed here: every array is a graph that generates, casts and
    quantizes one parameter, so evaluating a subset of the parameters only
    costs that subset's memory.
    """
    from mlx_lm.models import qwen3_5_moe
    from mlx_lm.utils import quantize_model

    plan = plan or quantization_plan()
    config = preset_config(preset)
    model_args = qwen3_5_moe.ModelArgs.from_dict(copy.deepcopy(config))
    model = qwen3_5_moe.Model(model_args)
    args = model.language_model.args

    scale = 1.0 if lm_head_scale is None else float(lm_head_scale)
    weights = _random_weights(model, args, seed, router_skew, scale)
    cast = model.cast_predicate
    weights = {
        k: v.astype(dtype) if cast(k) else v for k, v in weights.items()
    }
    model.update(tree_unflatten(list(weights.items())))
    del weights
    model.eval()

    if quantize:
        with contextlib.redirect_stdout(io.StringIO()):  # its bits/weight print
            model, config = quantize_model(
                model,
                config,
                group_size=plan.group_size,
                bits=plan.bits,
                mode=plan.mode,
                quant_predicate=_quant_predicate(model, plan),
            )
    return model, config


def _param_groups(model: nn.Module) -> Iterator[Tuple[str, Dict[str, mx.array]]]:
    """Flattened parameters in checkpoint order, one group per evaluation unit:
    the embedding, each decoder layer, the final norm and the lm_head."""
    lm = model.language_model
    units = [("model.embed_tokens", lm.model.embed_tokens)]
    units += [(f"model.layers.{i}", layer) for i, layer in enumerate(lm.model.layers)]
    units += [("model.norm", lm.model.norm), ("lm_head", lm.lm_head)]
    for name, module in units:
        prefix = f"language_model.{name}"
        yield name, {f"{prefix}.{k}": v for k, v in tree_flatten(module.parameters())}


def _eval_by_module(params: Dict[str, mx.array]) -> None:
    """Evaluate flattened parameters one module at a time (the random float32
    draws of one module are the only transient memory, ~1.6 GB for the 256
    experts of one projection)."""
    modules = {}
    for k, v in params.items():
        modules.setdefault(k.rsplit(".", 1)[0], []).append(v)
    for arrays in modules.values():
        mx.eval(arrays)


def build_model(
    preset: str = "tiny",
    *,
    seed: int = 0,
    router_skew: float = 0.0,
    lm_head_scale: Optional[float] = None,
    dtype: mx.Dtype = mx.bfloat16,
    quantize: bool = True,
    bits: Optional[int] = None,
    group_size: Optional[int] = None,
    mode: str = QUANT_MODE,
    parts: Optional[Mapping[str, Mapping[str, object]]] = None,
    recipe: Optional[str] = None,
) -> Tuple[nn.Module, dict]:
    """Build an evaluated random-weight model in memory.

    The model is the class ``mlx_lm.load`` produces for this config
    (``mlx_lm.models.qwen3_5_moe.Model``), in eval mode. With ``quantize=True``
    it holds exactly the arrays ``write_checkpoint`` writes for the same
    arguments. By default (mlx-community's 4-bit layout): linear layers and
    the embedding affine 4-bit with group size 64 (``uint32`` packed weights
    ``(out, in/8)``, ``dtype`` scales and biases ``(out, in/64)``; experts
    with a leading expert axis), the router (``mlp.gate``) and
    ``mlp.shared_expert_gate`` 8-bit. Norms, conv1d and ``dt_bias`` are
    ``dtype``; ``A_log`` stays float32 (mlx-lm's ``cast_predicate``).

    Other quantisations (``bits``, ``group_size``, ``mode``, ``parts``,
    ``recipe``; checked by :func:`quantization_plan`) are made with mlx-lm's
    ``quantize_model`` (``nn.quantize`` with a class predicate), which
    writes config.json's ``quantization`` block as ``mlx_lm.convert`` does:
    the top-level ``{"group_size", "bits", "mode"}`` and one entry per
    module path whose setting differs. Packed weights are ``uint32 (out,
    in*bits/32)``; "affine" keeps ``dtype`` scales and biases ``(out,
    in/group_size)``; "mxfp4", "nvfp4" and "mxfp8" have ``uint8`` scales and
    no biases.

    Weights are generated, cast, quantized and evaluated one module at a time,
    so peak memory stays near the final size plus one module's float32 draws
    (19.5 GB + ~3 GB for the full preset).

    Args:
        preset: a key of ``PRESETS`` (``"tiny"``, ``"tiny-draft"`` or ``"qwen3.6-35b-a3b"``).
        seed: non-negative int; same seed, same weights.
        router_skew: ``S >= 0``, expert popularity skew (see
            ``write_checkpoint``); 0 gives statistically uniform routing.
        lm_head_scale: multiplier of the ``lm_head`` weights (``None`` = 1.0);
            use ``DEMO_LM_HEAD_SCALE`` for non-flat logits.
        dtype: floating dtype of the unquantized arrays and of the quantization
            scales/biases. ``mx.float32`` with ``quantize=False`` for fp32
            parity tests (mlx's CPU ``gather_mm`` accepts float32 only).
            ``mx.float32`` with ``quantize=True`` quantizes the float32 draws
            (not their bf16 rounding), so its 4-bit values differ slightly
            from the checkpoint's; on the CPU backend it runs much faster
            than bf16 (MLX's CPU bf16 quantised matmuls are slow). To run the checkpoint's exact weights in fp32, cast
            the floating arrays of the bf16 model (bf16 -> fp32 is exact).
        quantize: quantize as the checkpoint does; ``False`` keeps every
            weight in ``dtype`` (the quantisation arguments are then still
            checked, and unused).
        bits, group_size, mode: the top-level quantisation; None = the
            mode's default (:data:`QUANT_MODES`: affine 4-bit group 64).
        parts: per-part overrides, part (a key of :data:`PARTS`: "experts",
            "shared_expert", "router", "shared_expert_gate", "attention",
            "linear_attention", "embed_tokens", "lm_head") -> a mapping with
            any of "bits", "group_size", "mode", e.g. ``{"experts": {"bits":
            3}, "attention": {"bits": 8}}``.
        recipe: an mlx-lm mixed recipe ("mixed_3_4", ...), see
            :func:`quantization_plan`.

    Returns:
        ``(model, config)``: ``config`` is the dict ``write_checkpoint`` writes
        to config.json (with the ``quantization`` block when ``quantize``).

    Raises:
        ValueError: unknown ``preset``, negative ``seed``, negative or
            non-finite ``router_skew``, non-positive ``lm_head_scale``, a
            non-floating ``dtype``, or a quantisation MLX does not implement
            (:func:`quantization_plan`).
    """
    _check_args(preset, seed, router_skew, lm_head_scale)
    if not isinstance(dtype, mx.Dtype) or not mx.issubdtype(dtype, mx.floating):
        raise ValueError(f"dtype must be a floating mx.Dtype, got dtype={dtype!r}.")
    plan = quantization_plan(bits, group_size, mode, parts, recipe)
    model, config = _lazy_model(
        preset, seed, router_skew, lm_head_scale, dtype, quantize, plan
    )
    for _, group in _param_groups(model):
        _eval_by_module(group)
    return model, config


# ---------------------------------------------------------------------------
# Checkpoint shapes and sizes (no weights generated)


def weight_shapes(
    preset: str = "tiny", *, quantize: bool = True, **quantization
) -> Dict[str, Tuple[Tuple[int, ...], mx.Dtype]]:
    """Names, shapes and dtypes of the tensors a checkpoint holds.

    Computed from the lazy model, without generating any weight (cheap even for
    the full preset). Keys are the safetensors names, e.g.
    ``language_model.model.layers.0.mlp.switch_mlp.gate_proj.weight``; values
    are ``(shape, dtype)``. With ``quantize=False``: the shapes of the
    unquantized bf16 model instead. ``quantization``: the keyword arguments
    ``bits``, ``group_size``, ``mode``, ``parts``, ``recipe`` of
    :func:`build_model` (default the 4-bit layout).

    Raises:
        ValueError: unknown ``preset``, or a quantisation
            :func:`quantization_plan` rejects.
        TypeError: another keyword argument.
    """
    _check_args(preset, 0, 0.0, None)
    plan = quantization_plan(**quantization)
    model, _ = _lazy_model(preset, 0, 0.0, None, mx.bfloat16, quantize, plan)
    return {k: (tuple(v.shape), v.dtype) for k, v in tree_flatten(model.parameters())}


def checkpoint_nbytes(preset: str = "tiny", **quantization) -> int:
    """Bytes of tensor data in the quantized checkpoint of ``preset``
    (``quantization`` as for :func:`weight_shapes`).

    For the default 4-bit layout: 19,508,789,376 (19.5 GB, 18.2 GiB) for
    ``qwen3.6-35b-a3b``, about the size of the mlx-community 4-bit
    checkpoint (~19.4 GB); 17.8e6 for ``tiny``.

    Raises:
        ValueError, TypeError: as :func:`weight_shapes`.
    """
    return sum(
        math.prod(shape) * dtype.size
        for shape, dtype in weight_shapes(preset, **quantization).values()
    )


# ---------------------------------------------------------------------------
# Streaming writer


def _plan_shards(groups: List[Tuple[str, int]], max_shard_bytes: int) -> List[List[str]]:
    """Split evaluation units into shards as ``mlx_lm.utils.make_shards`` splits
    tensors: greedily, a new shard when the next unit would exceed the limit."""
    shards, size = [], 0
    for name, nbytes in groups:
        if not shards or size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


#: Weight shards mlx-lm loads from a checkpoint folder (every one it finds).
SHARD_GLOB = "model*.safetensors"


def write_checkpoint(
    out_dir: Union[str, Path],
    preset: str = "tiny",
    *,
    seed: int = 0,
    router_skew: float = 0.0,
    lm_head_scale: Optional[float] = None,
    max_shard_bytes: int = MAX_FILE_SIZE_GB << 30,
    verbose: bool = False,
    bits: Optional[int] = None,
    group_size: Optional[int] = None,
    mode: str = QUANT_MODE,
    parts: Optional[Mapping[str, Mapping[str, object]]] = None,
    recipe: Optional[str] = None,
) -> Path:
    """Write a random-weight quantized checkpoint that ``mlx_lm.load`` loads.

    Layout (as ``mlx_lm.convert`` writes it): ``config.json`` (``model_type``
    ``qwen3_5_moe``, text fields under ``text_config``, ``quantization`` and
    ``quantization_config`` blocks: the top-level setting and one entry per
    module path that differs from it, by default the 8-bit entries of every
    ``mlp.gate`` and ``mlp.shared_expert_gate``),
    ``model-0000N-of-0000M.safetensors`` shards of at most ``max_shard_bytes``
    (mlx-lm's 5 GB by default; a unit larger than that gets its own shard),
    ``model.safetensors.index.json``, ``generation_config.json`` and the
    tokenizer files of ``make_tokenizer``. Tensors are bf16 / uint32 (packed
    weights) / uint8 (scales of the mxfp4, nvfp4 and mxfp8 modes) / float32
    (``A_log``), exactly ``build_model``'s arrays for the same arguments.

    Streams: the embedding, each decoder layer, the final norm and the lm_head
    are generated, quantized and evaluated one module at a time and dropped as
    soon as their shard is written, so memory peaks at about one shard plus
    one module's float32 draws (time and memory for the full preset:
    bench/results/package-figures.md, "Random checkpoints").

    ``router_skew`` (``S >= 0``) makes expert popularity uneven, Zipf-like: in
    each layer the experts get popularity ranks r = 1..E from a seeded
    permutation, and the router row of rank r is multiplied by
    ``r ** (-0.4 * S)``: its logits spread more, so it wins the top-k more
    often. The 0.4 is calibrated so that, for the full preset (256 experts,
    top-8), the selection share falls like ``rank ** -S`` over the top half of
    the ranks (Zipf exponent ~S; the measured shares:
    bench/results/package-figures.md, "Random checkpoints"). With the tiny
    preset's 32 experts, top-8, the effect is weaker. ``S = 0`` leaves the
    router untouched.

    Args:
        out_dir: directory to create or fill. Files of the same names are
            overwritten and any other ``model*.safetensors`` removed (mlx-lm
            loads every such file it finds).
        preset, seed, router_skew, lm_head_scale: as in ``build_model``.
        max_shard_bytes: positive int, shard size limit in bytes.
        verbose: show progress (a tqdm bar on stderr: bytes written, time
            left) and a summary line.
        bits, group_size, mode, parts, recipe: the quantisation, as in
            ``build_model`` (default mlx-community's 4-bit layout).

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: bad ``preset``, ``seed``, ``router_skew``,
            ``lm_head_scale`` or ``max_shard_bytes``, or a quantisation
            :func:`quantization_plan` rejects (nothing is written then).
    """
    _check_args(preset, seed, router_skew, lm_head_scale)
    if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ValueError(
            f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}."
        )
    plan = quantization_plan(bits, group_size, mode, parts, recipe)
    from mlx_lm.utils import get_total_parameters, save_config
    from tqdm import tqdm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob(SHARD_GLOB):
        stale.unlink()
    tic = time.perf_counter()

    model, config = _lazy_model(
        preset, seed, router_skew, lm_head_scale, mx.bfloat16, quantize=True, plan=plan
    )
    total_parameters = get_total_parameters(model)
    groups = dict(_param_groups(model))
    del model  # the lazy arrays in ``groups`` are now the only references

    group_bytes = [(n, sum(v.nbytes for v in g.values())) for n, g in groups.items()]
    total_size = sum(nbytes for _, nbytes in group_bytes)
    shards = _plan_shards(group_bytes, max_shard_bytes)

    weight_map = {}
    sizes = dict(group_bytes)
    # the weights are drawn and quantised module by module (the slow part),
    # then each shard is written: progress in bytes, with the time left
    with tqdm(total=total_size, unit="B", unit_scale=True, desc=f"writing {out_dir.name}",
              disable=not verbose, file=sys.stderr) as bar:
        for i, shard_groups in enumerate(shards):
            shard_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            shard = {}
            for name in shard_groups:
                group = groups.pop(name)
                bar.set_postfix_str(name, refresh=False)
                _eval_by_module(group)
                shard.update(group)
                del group
                bar.update(sizes[name])
            bar.set_postfix_str(f"saving {shard_name}")
            mx.save_safetensors(str(out_dir / shard_name), shard, metadata={"format": "mlx"})
            weight_map.update({k: shard_name for k in shard})
            del shard
            mx.clear_cache()

    index = {
        "metadata": {"total_size": total_size, "total_parameters": total_parameters},
        "weight_map": dict(sorted(weight_map.items())),
    }
    with open(out_dir / "model.safetensors.index.json", "w") as f:
        json.dump(index, f, indent=4)
    save_config(config, config_path=out_dir / "config.json")
    make_tokenizer(out_dir)
    if verbose:
        print(
            f"[{time.perf_counter() - tic:7.1f}s] {out_dir}: {len(shards)} shards, "
            f"{total_size / 1e9:.3f} GB, {total_parameters:,} parameters",
            flush=True,
        )
    return out_dir


# ---------------------------------------------------------------------------
# Tokenizer

# A small English corpus for the BPE trainer (original text).
_CORPUS = """\
The river starts as a thin line of water high in the hills, where snow melts
slowly in the spring. By the time it reaches the town it is wide and brown, and
it carries leaves, branches and the sound of the mountains with it. People have
lived along its banks for a very long time. They built mills to grind grain,
bridges to cross from one market to the other, and small boats to fish in the
quiet pools below the falls.

In the morning the baker opens the shop before the sun is up. She mixes flour,
water, salt and yeast, and she waits. Bread cannot be hurried; the dough must
rest and rise, and rest again. When the first loaves come out of the oven the
whole street smells of warm crust. Children on their way to school stop at the
window, and the old men who sit by the fountain buy a roll and share it with the
pigeons.

A computer does one small thing at a time, but it does billions of them every
second. A program is a list of instructions: load a number, add another number,
store the result, compare two values, jump to a different place if they are
equal. Out of these simple steps we build editors, games, maps of the stars and
models that write text. The hard part is not the machine. The hard part is to
say exactly what we mean.

Language models read text as tokens. A token can be a whole word, a piece of a
word, a single letter or a space. The model looks at the tokens it has seen so
far and gives a score to every token it knows. The highest score wins, or one is
drawn at random in proportion to the scores, and then the whole process starts
again with one more token. Long answers are made one token after another.

"What time is it?" asked the traveller.
"Almost seven," said the guard. "The last train left an hour ago. The next one
comes at six tomorrow morning, if the weather is good."
"Then I will wait," said the traveller, and she sat down on the bench with her
bag on her knees and a book in her hands.

Weather changes quickly near the sea. A clear blue sky can turn grey in ten
minutes, and a light breeze can become a strong wind that bends the trees and
throws salt spray over the walls of the harbour. Fishermen watch the clouds and
the birds. When the gulls fly inland and the water turns dark and flat, they
pull their boats up on the shore and tie them down.

Numbers are everywhere: 1, 2, 3, 10, 42, 100, 256, 1024, 2048 and 65536. A year
has 365 days, a day has 24 hours, and an hour has 60 minutes. If a train travels
at 80 kilometres per hour for 3 hours, it covers 240 kilometres. If a shop sells
12 eggs for 3 euros, each egg costs 25 cents.

def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i * 2))

The garden behind the house is small, but it is full of life. There are beans
climbing up strings, tomatoes turning red in the late summer, and a row of herbs
by the kitchen door: mint, thyme, basil and parsley. Bees move from flower to
flower, and at night a hedgehog comes out from under the shed to look for
snails. Nobody planned it this way. It grew, a little more each year.

Good tools are simple to hold and hard to misuse. A sharp knife is safer than a
dull one, because it goes where you push it. A clear map is better than a long
list of directions. A test that fails loudly is better than one that passes
quietly when something is wrong. Measure first, then change one thing, then
measure again, and write down what you saw.

The library was quiet except for the turning of pages and the soft steps of the
librarian. Rows of shelves held books about history, science, music, cooking,
travel and the lives of people who had died long ago. A boy at the long table
was reading about volcanoes; a woman near the window was learning a new
language, repeating each word under her breath until it felt natural.
"""


def _train_tokenizer():
    """Train the byte-level BPE tokenizer (deterministic)."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(
                add_prefix_space=False, trim_offsets=False, use_regex=False
            ),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    tokenizer.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer)
    return tokenizer


def make_tokenizer(out_dir: Union[str, Path]) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` to ``out_dir``.

    A byte-level BPE (Qwen2/3 pre-tokenizer regex, NFC, byte-level decoder)
    trained with the ``tokenizers`` library on a small embedded English corpus:
    ~1.2K tokens, at most ``TOKENIZER_VOCAB_SIZE`` (1280), so every id is below
    the ``vocab_size`` of every preset (ids the model may emit beyond the
    tokenizer's vocabulary decode as "!" in mlx-lm's streaming detokenizer). Special tokens ``<|endoftext|>`` (id 0,
    also the pad token), ``<|im_start|>`` (1) and ``<|im_end|>`` (2, the eos
    token). Chat template: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per
    message, ``<|im_start|>assistant\\n`` with ``add_generation_prompt``.
    The files are byte-identical on every call.

    Returns:
        ``Path(out_dir)``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    tokenizer.save(str(out_dir / "tokenizer.json"))

    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(tokenizer.token_to_id(t)): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t in SPECIAL_TOKENS
        },
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    with open(out_dir / "tokenizer_config.json", "w") as f:
        json.dump(tokenizer_config, f, indent=2)

    generation_config = {
        "eos_token_id": [
            tokenizer.token_to_id("<|im_end|>"),
            tokenizer.token_to_id("<|endoftext|>"),
        ],
        "pad_token_id": tokenizer.token_to_id("<|endoftext|>"),
    }
    with open(out_dir / "generation_config.json", "w") as f:
        json.dump(generation_config, f, indent=2)
    return out_dir


# ---------------------------------------------------------------------------
# Command line


def existing_checkpoint_files(out_dir: Path) -> List[str]:
    """Names of the files in ``out_dir`` that :func:`write_checkpoint` would
    replace or delete (``config.json``, ``model*.safetensors``); [] when the
    directory is absent or is not a directory."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    names = sorted(p.name for p in out_dir.glob(SHARD_GLOB))
    if (out_dir / "config.json").exists():
        names.insert(0, "config.json")
    return names


#: CLI flag of each per-part key, and how a value is read.
_PART_FLAGS = {"bits": ("--part-bits", int), "group_size": ("--part-group-size", int), "mode": ("--part-mode", str)}

#: How :func:`quantization_plan`'s messages name the CLI's arguments.
_CLI_NAMES = {
    "bits": "--bits", "group_size": "--group-size", "mode": "--mode", "recipe": "--recipe",
    "parts": "--part-bits/--part-group-size/--part-mode",
    **{f"part.{k}": f"{flag} {{part}}" for k, (flag, _) in _PART_FLAGS.items()},
}


def parse_parts(values: Mapping[str, Optional[List[str]]]) -> Dict[str, Dict[str, object]]:
    """The ``parts`` argument of :func:`build_model` from the CLI's
    ``--part-bits``, ``--part-group-size`` and ``--part-mode`` values.

    Args:
        values: key ("bits", "group_size", "mode") -> the flag's values as
            given (each ``NAME=VALUE[,NAME=VALUE...]``; a flag may be
            repeated), or None where the flag was not given.

    Returns:
        part name -> ``{key: value}`` (bits and group sizes as ints).

    Raises:
        ValueError: an item that is not ``NAME=VALUE``, an unknown part name,
            a value that is not a whole number (bits, group size), or a part
            given twice to one flag; the message names the flag and the item.
    """
    parts: Dict[str, Dict[str, object]] = {}
    for key, (flag, convert) in _PART_FLAGS.items():
        for value in values.get(key) or ():
            for item in value.split(","):
                name, eq, v = (t.strip() for t in item.partition("="))
                if not eq or not name or not v:
                    raise ValueError(f"{flag} {item!r}: expected NAME=VALUE, NAME one of {', '.join(PARTS)}")
                if name not in PARTS:
                    raise ValueError(f"{flag} {item}: unknown part {name!r}; expected one of {', '.join(PARTS)}")
                if key in parts.get(name, {}):
                    raise ValueError(f"{flag} {item}: part {name!r} given twice")
                try:
                    parts.setdefault(name, {})[key] = convert(v)
                except ValueError:
                    raise ValueError(f"{flag} {item}: expected a whole number after '='") from None
    return parts


def _out_problem(out: Path) -> Optional[str]:
    """Why ``out`` cannot be the output folder (it, or the nearest of its
    parents that exists, is not a folder), else None. Creates nothing."""
    existing = next((p for p in (out, *out.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        where = "is a file" if existing == out else f"{existing} is a file"
        return f"{where}; expected a folder (created if absent)"
    return None


@one_line_warnings()
def checked_out_dir(parser, out: str, overwrite: bool) -> Path:
    """The CLI's ``--out`` as a Path, or ``parser.error`` (exit code 2, one
    line) where it is empty, not a usable folder (:func:`_out_problem`), or
    holds a checkpoint already and ``overwrite`` is off."""
    if not out.strip():
        parser.error("--out must name a directory, got an empty string")
    path = Path(out)
    problem = _out_problem(path)
    if problem:
        parser.error(f"--out {path}: {problem}")
    held = existing_checkpoint_files(path)
    if held and not overwrite:
        parser.error(f"--out {path} already holds a checkpoint ({', '.join(held[:3])}"
                     f"{', ...' if len(held) > 3 else ''}); pass --overwrite to replace it")
    return path


def main(argv: Optional[List[str]] = None) -> None:
    """``python -m mlx_qwen_fast.checkpoint``: check the arguments (each
    usage error one line, exit code 2, before mlx-lm is imported), then
    :func:`write_checkpoint` to ``--out``."""
    parser = ArgumentParser(
        prog="python -m mlx_qwen_fast.checkpoint",
        description="Write a random-weight Qwen3.5/3.6-MoE checkpoint that mlx_lm.load can load "
        "(default: mlx-community's 4-bit layout, affine 4-bit group 64 with 8-bit router and "
        "shared-expert gates; other quantisations with --bits, --group-size, --mode, --part-*, --recipe)."
    )
    from .dflash.presets import PRESETS as DRAFTER_PRESETS, cli_write as write_drafter_preset

    parser.add_argument("--preset", required=True, choices=sorted(PRESETS) + sorted(DRAFTER_PRESETS),
                        help="A target (Qwen3.5/3.6-MoE) or a DFlash drafter (*-dflash: z-lab's layout; takes "
                        "--out, --overwrite and --seed only).")
    parser.add_argument("--out", required=True, help="Output directory.")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="Replace a checkpoint already in --out (its config.json and model*.safetensors).",
    )
    parser.add_argument("--seed", type=whole_number(0), default=0)
    parser.add_argument(
        "--router-skew",
        type=finite_number(0.0),
        default=0.0,
        help="Expert popularity skew S >= 0 (0 = uniform; ~1 Zipf-like).",
    )
    parser.add_argument(
        "--lm-head-scale",
        type=finite_number(0.0, inclusive=False),
        default=None,
        help=f"Multiplier of the lm_head weights (demo: {DEMO_LM_HEAD_SCALE}).",
    )
    quant = parser.add_argument_group(
        "quantisation",
        "What nn.quantize makes of the random weights, written to config.json as mlx_lm.convert "
        "writes it. Parts: " + ", ".join(PARTS) + ". A part's unset keys come from its default "
        "(the top level; affine 8-bit group 64 for router and shared_expert_gate), or from the "
        "mode's defaults where --part-mode changes the mode. The CUDA MoE kernels read affine "
        "4-bit group 64 experts (decode: the shared expert too) only; with anything else the "
        "MoE runs stock.",
    )
    quant.add_argument("--bits", type=int, default=None,
                       help=f"Bits of every quantised layer: {', '.join(map(str, AFFINE_BITS))} for affine "
                       "(default: the mode's, 4 for affine).")
    quant.add_argument("--group-size", type=int, default=None,
                       help=f"Group size: {', '.join(map(str, AFFINE_GROUP_SIZES))} for affine "
                       "(default: the mode's, 64 for affine).")
    quant.add_argument("--mode", default=QUANT_MODE, choices=list(QUANT_MODES),
                       help="MLX quantisation mode; mxfp4 is 4-bit group 32, nvfp4 4-bit group 16, "
                       "mxfp8 8-bit group 32 (default: %(default)s).")
    quant.add_argument("--part-bits", action="append", metavar="PART=BITS[,PART=BITS...]",
                       help="Per-part bits, e.g. experts=3,attention=8,shared_expert=8.")
    quant.add_argument("--part-group-size", action="append", metavar="PART=SIZE[,...]",
                       help="Per-part group size, e.g. experts=32.")
    quant.add_argument("--part-mode", action="append", metavar="PART=MODE[,...]",
                       help="Per-part mode, e.g. experts=mxfp4.")
    quant.add_argument("--recipe", default=None, choices=list(QUANT_RECIPES),
                       help="mlx-lm's mixed per-layer recipe (mlx_lm.convert --quant-predicate; affine).")
    args = parser.parse_args(argv)
    if args.preset in DRAFTER_PRESETS:
        write_drafter_preset(parser, args, argv)
        return
    try:
        _check_args(args.preset, args.seed, args.router_skew, args.lm_head_scale)
        parts = parse_parts({"bits": args.part_bits, "group_size": args.part_group_size,
                             "mode": args.part_mode})
        quantization_plan(args.bits, args.group_size, args.mode, parts, args.recipe, names=_CLI_NAMES)
    except ValueError as e:
        parser.error(str(e))
    out = checked_out_dir(parser, args.out, args.overwrite)
    try:
        write_checkpoint(
            out,
            args.preset,
            seed=args.seed,
            router_skew=args.router_skew,
            lm_head_scale=args.lm_head_scale,
            verbose=True,
            bits=args.bits,
            group_size=args.group_size,
            mode=args.mode,
            parts=parts,
            recipe=args.recipe,
        )
    except ValueError as e:
        parser.error(str(e))
    except OSError as e:  # --out is a file, or a folder that can't be made
        parser.error(f"--out {args.out}: {e.strerror or e}")


if __name__ == "__main__":
    main()
