"""The presets: config.json dicts (before quantization) shaped like the real
Qwen3.6-35B-A3B one, for the full model and for small models of the same
structure, and the check of a random model's arguments."""

import copy
import math
import numbers
from typing import Dict, List

from .tokenizer import SPECIAL_TOKENS, TOKENIZER_VOCAB_SIZE


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
