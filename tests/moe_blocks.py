"""Small quantized MoE blocks for the MoE tests (CPU reference and CUDA kernels)."""

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3_next import ModelArgs, Qwen3NextSparseMoeBlock


def make_block(D=64, H=64, E=16, k=8, dtype=mx.float32, router_scale=4.0, seed=None):
    """A quantized Qwen3NextSparseMoeBlock with the checkpoint's bit widths
    (experts and shared expert 4-bit, router and shared-expert gate 8-bit,
    group 64); ``seed`` seeds MLX's global generator first. Also used by
    bench/moe_decode_cuda.py at the full model size."""
    args = ModelArgs(
        model_type="qwen3_next",
        hidden_size=D,
        num_hidden_layers=1,
        intermediate_size=H,
        num_attention_heads=2,
        linear_num_value_heads=2,
        linear_num_key_heads=1,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        num_experts=E,
        num_experts_per_tok=k,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=H,
        mlp_only_layers=[],
        moe_intermediate_size=H,
        rms_norm_eps=1e-6,
        vocab_size=16,
        num_key_value_heads=1,
        rope_theta=1e4,
        partial_rotary_factor=0.25,
        max_position_embeddings=128,
        head_dim=8,
        norm_topk_prob=True,
    )
    if seed is not None:
        mx.random.seed(seed)
    block = Qwen3NextSparseMoeBlock(args)
    # decisive routing: logits spread over a few units, not all near zero
    block.gate.weight = block.gate.weight * router_scale

    def predicate(path, m):
        if not hasattr(m, "to_quantized"):
            return False
        if path == "gate" or path.endswith("shared_expert_gate"):
            return {"group_size": 64, "bits": 8}
        return True

    nn.quantize(block, group_size=64, bits=4, class_predicate=predicate)
    block.set_dtype(dtype)
    mx.eval(block.parameters())
    return block
