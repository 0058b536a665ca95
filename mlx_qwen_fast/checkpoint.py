"""Random-weight Qwen3.5/3.6-MoE checkpoints in the mlx-community layout.

The package is developed and tested without the real 19 GB checkpoint: this
module builds models of the exact Qwen3.6-35B-A3B shape (or a tiny one with the
same structure) with random but non-trivial weights, quantized the way
``mlx_lm.convert -q`` quantizes the real model (affine 4-bit, group 64, router
and shared-expert gates 8-bit), and writes them as a checkpoint that stock
``mlx_lm.load`` loads strictly.

Python API::

    model, config = build_model("tiny", seed=0)        # in memory, evaluated
    path = write_checkpoint("ckpt", "tiny", seed=0)     # streamed to disk
    make_tokenizer("ckpt")                              # tokenizer files only

Command line::

    python -m mlx_qwen_fast.checkpoint --preset tiny --out /tmp/tiny \\
        [--seed N] [--router-skew S] [--lm-head-scale X]

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

import argparse
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
from typing import Dict, Iterator, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import qwen3_5_moe
from mlx_lm.utils import (
    MAX_FILE_SIZE_GB,
    get_total_parameters,
    quantize_model,
    save_config,
)
from tqdm import tqdm

from ._cli import one_line_warnings

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
    "tiny": _make_config(
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
    ),
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
) -> Tuple[nn.Module, dict]:
    """The model with lazy (unevaluated) random, cast and quantized weights.

    Nothing is computed here: every array is a graph that generates, casts and
    quantizes one parameter, so evaluating a subset of the parameters only
    costs that subset's memory.
    """
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
                group_size=QUANT_GROUP_SIZE,
                bits=QUANT_BITS,
                mode=QUANT_MODE,
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
) -> Tuple[nn.Module, dict]:
    """Build an evaluated random-weight model in memory.

    The model is the class ``mlx_lm.load`` produces for this config
    (``mlx_lm.models.qwen3_5_moe.Model``), in eval mode. With ``quantize=True``
    it holds exactly the arrays ``write_checkpoint`` writes for the same
    arguments: linear layers and the embedding affine 4-bit with group size 64
    (``uint32`` packed weights ``(out, in/8)``, ``dtype`` scales and biases
    ``(out, in/64)``; experts with a leading expert axis), the router
    (``mlp.gate``) and ``mlp.shared_expert_gate`` 8-bit. Norms, conv1d and
    ``dt_bias`` are ``dtype``; ``A_log`` stays float32 (mlx-lm's
    ``cast_predicate``).

    Weights are generated, cast, quantized and evaluated one module at a time,
    so peak memory stays near the final size plus one module's float32 draws
    (19.5 GB + ~3 GB for the full preset).

    Args:
        preset: a key of ``PRESETS`` (``"tiny"`` or ``"qwen3.6-35b-a3b"``).
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
            weight in ``dtype``.

    Returns:
        ``(model, config)``: ``config`` is the dict ``write_checkpoint`` writes
        to config.json (with the ``quantization`` block when ``quantize``).

    Raises:
        ValueError: unknown ``preset``, negative ``seed``, negative or
            non-finite ``router_skew``, non-positive ``lm_head_scale``, or a
            non-floating ``dtype``.
    """
    _check_args(preset, seed, router_skew, lm_head_scale)
    if not isinstance(dtype, mx.Dtype) or not mx.issubdtype(dtype, mx.floating):
        raise ValueError(f"dtype must be a floating mx.Dtype, got dtype={dtype!r}.")
    model, config = _lazy_model(
        preset, seed, router_skew, lm_head_scale, dtype, quantize
    )
    for _, group in _param_groups(model):
        _eval_by_module(group)
    return model, config


# ---------------------------------------------------------------------------
# Checkpoint shapes and sizes (no weights generated)


def weight_shapes(
    preset: str = "tiny", *, quantize: bool = True
) -> Dict[str, Tuple[Tuple[int, ...], mx.Dtype]]:
    """Names, shapes and dtypes of the tensors a checkpoint holds.

    Computed from the lazy model, without generating any weight (cheap even for
    the full preset). Keys are the safetensors names, e.g.
    ``language_model.model.layers.0.mlp.switch_mlp.gate_proj.weight``; values
    are ``(shape, dtype)``. With ``quantize=False``: the shapes of the
    unquantized bf16 model instead.

    Raises:
        ValueError: unknown ``preset``.
    """
    _check_args(preset, 0, 0.0, None)
    model, _ = _lazy_model(preset, 0, 0.0, None, mx.bfloat16, quantize)
    return {k: (tuple(v.shape), v.dtype) for k, v in tree_flatten(model.parameters())}


def checkpoint_nbytes(preset: str = "tiny") -> int:
    """Bytes of tensor data in the quantized checkpoint of ``preset``.

    19,508,789,376 (19.5 GB, 18.2 GiB) for ``qwen3.6-35b-a3b``, about the
    size of the mlx-community 4-bit checkpoint (~19.4 GB); 17.8e6 for ``tiny``.

    Raises:
        ValueError: unknown ``preset``.
    """
    return sum(
        math.prod(shape) * dtype.size for shape, dtype in weight_shapes(preset).values()
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
) -> Path:
    """Write a random-weight quantized checkpoint that ``mlx_lm.load`` loads.

    Layout (as ``mlx_lm.convert`` writes it): ``config.json`` (``model_type``
    ``qwen3_5_moe``, text fields under ``text_config``, ``quantization`` and
    ``quantization_config`` blocks with per-path 8-bit entries for every
    ``mlp.gate`` and ``mlp.shared_expert_gate``),
    ``model-0000N-of-0000M.safetensors`` shards of at most ``max_shard_bytes``
    (mlx-lm's 5 GB by default; a unit larger than that gets its own shard),
    ``model.safetensors.index.json``, ``generation_config.json`` and the
    tokenizer files of ``make_tokenizer``. Tensors are bf16 / uint32 (packed
    4- and 8-bit weights) / float32 (``A_log``), exactly ``build_model``'s
    arrays for the same arguments.

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

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: bad ``preset``, ``seed``, ``router_skew``,
            ``lm_head_scale`` or ``max_shard_bytes``.
    """
    _check_args(preset, seed, router_skew, lm_head_scale)
    if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ValueError(
            f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}."
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob(SHARD_GLOB):
        stale.unlink()
    tic = time.perf_counter()

    model, config = _lazy_model(
        preset, seed, router_skew, lm_head_scale, mx.bfloat16, quantize=True
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


@one_line_warnings()
def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        description="Write a random-weight Qwen3.5/3.6-MoE checkpoint "
        "(mlx-community 4-bit layout) that mlx_lm.load can load."
    )
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--out", required=True, help="Output directory.")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="Replace a checkpoint already in --out (its config.json and model*.safetensors).",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--router-skew",
        type=float,
        default=0.0,
        help="Expert popularity skew S >= 0 (0 = uniform; ~1 Zipf-like).",
    )
    parser.add_argument(
        "--lm-head-scale",
        type=float,
        default=None,
        help=f"Multiplier of the lm_head weights (demo: {DEMO_LM_HEAD_SCALE}).",
    )
    args = parser.parse_args(argv)
    try:
        _check_args(args.preset, args.seed, args.router_skew, args.lm_head_scale)
    except ValueError as e:
        parser.error(str(e))
    if not args.out.strip():
        parser.error("--out must name a directory, got an empty string")
    out = Path(args.out)
    held = existing_checkpoint_files(out)
    if held and not args.overwrite:
        parser.error(
            f"--out {out} already holds a checkpoint ({', '.join(held[:3])}"
            f"{', ...' if len(held) > 3 else ''}); pass --overwrite to replace it"
        )
    try:
        write_checkpoint(
            out,
            args.preset,
            seed=args.seed,
            router_skew=args.router_skew,
            lm_head_scale=args.lm_head_scale,
            verbose=True,
        )
    except ValueError as e:
        parser.error(str(e))
    except OSError as e:  # --out is a file, or a folder that can't be made
        parser.error(f"--out {args.out}: {e.strerror or e}")


if __name__ == "__main__":
    main()
