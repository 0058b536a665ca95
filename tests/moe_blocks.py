"""Small quantized MoE blocks and kernel-test arrays for the MoE tests (CPU
reference and CUDA kernels)."""

import functools

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.qwen3_next import ModelArgs, Qwen3NextSparseMoeBlock
from mlx_lm.models.switch_layers import QuantizedSwitchLinear


def make_block(D=64, H=64, E=16, k=8, dtype=mx.float32, router_scale=4.0, seed=None, quant=None):
    """A quantized Qwen3NextSparseMoeBlock with the checkpoint's bit widths
    (experts and shared expert 4-bit, router and shared-expert gate 8-bit,
    group 64); ``seed`` seeds MLX's global generator first. ``quant``:
    child path prefix ("switch_mlp", "shared_expert", "gate",
    "shared_expert_gate") -> ``to_quantized`` arguments for the modules
    under it (e.g. ``{"switch_mlp": {"bits": 3, "group_size": 64}}``), or
    False to leave them unquantised."""
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
        for prefix, spec in (quant or {}).items():
            if path == prefix or path.startswith(prefix + "."):
                return spec
        if path == "gate" or path.endswith("shared_expert_gate"):
            return {"group_size": 64, "bits": 8}
        return True

    nn.quantize(block, group_size=64, bits=4, class_predicate=predicate)
    block.set_dtype(dtype)
    mx.eval(block.parameters())
    return block


# ---------------------------------------------------------------------------
# arrays for the kernel tests (routing, grouped GEMM, decode GEMV)
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=6)
def qproj(E, O, K, seed, scale=1.0):
    """A bf16 4-bit QuantizedSwitchLinear E x (K -> O), random weights from
    ``seed``; built once per argument set (the tests never modify it). The
    cache holds the last 6 (two GEMMs' gate, up and down: a bounded amount
    of GPU memory per test process)."""
    p = QuantizedSwitchLinear(K, O, E, bias=False, group_size=64, bits=4)
    w = mx.random.normal((E, O, K), key=mx.random.key(seed)) * (scale / K**0.5)
    p.weight, p.scales, p.biases = mx.quantize(w.astype(mx.bfloat16), group_size=64, bits=4)
    mx.eval(p.parameters())
    return p


def make_logits(n, E, kind, seed, dtype):
    """Router logits [n, E]: "random", "skewed" (a handful of popular
    experts), "empty" (8 experts take everything), "one" (every token's
    top-1 is expert 17)."""
    z = mx.random.normal((n, E), key=mx.random.key(seed)) * 2.0
    if kind == "skewed":  # a handful of popular experts
        bias = mx.zeros((E,)).at[mx.array([3, 4, 5, 200 % E])].add(3.0)
        z = z + bias
    elif kind == "empty":  # 8 experts take everything, the rest are empty
        bias = mx.zeros((E,)).at[mx.arange(8) * 3].add(40.0)
        z = z + bias
    elif kind == "one":  # every token's top-1 is expert 17
        z = z + mx.zeros((E,)).at[17].add(60.0)
    return z.astype(dtype)


def quant(shape, seed, scale=1.0, bits=4):
    """(weight, scales, biases) of a fresh bf16 random matrix, affine group 64."""
    K = shape[-1]
    w = mx.random.normal(shape, key=mx.random.key(seed)) * (scale / K**0.5)
    out = mx.quantize(w.astype(mx.bfloat16), group_size=64, bits=bits)
    mx.eval(*out)
    return tuple(out)


def make_arrays(E=64, D=2048, I=512, seed=0, gate_bits=8):
    """(experts, shared, expert_gate) as the decode kernels take them
    (:func:`mlx_qwen_fast.kernels.moe_decode_gemv.moe_decode_arrays`)."""
    experts = (quant((E, I, D), seed + 1), quant((E, I, D), seed + 2), quant((E, D, I), seed + 3))
    shared = (quant((I, D), seed + 4), quant((I, D), seed + 5), quant((D, I), seed + 6))
    if gate_bits == 16:
        w = (mx.random.normal((1, D), key=mx.random.key(seed + 7)) / D**0.5).astype(mx.bfloat16)
        eg = (w, w, w, 16)
    else:
        eg = (*quant((1, D), seed + 7, scale=2.0, bits=gate_bits), gate_bits)
    return experts, shared, eg


def make_routing(n, k, E, seed, special=True):
    """Distinct experts per token; tokens share experts; one token has 0 and E-1."""
    rng = np.random.default_rng(seed)
    rows = []
    for t in range(n):
        if t > 0 and special:  # overlap with token 0: duplicates across tokens
            keep = list(rng.choice(rows[0], size=min(3, k), replace=False))
            rest = [e for e in rng.permutation(E) if e not in keep][: k - len(keep)]
            row = keep + rest
        else:
            row = list(rng.choice(E, size=k, replace=False))
        rng.shuffle(row)
        rows.append(row)
    if special:  # the last token picks expert 0 and expert E-1
        r = rows[-1]
        for want, slot in ((0, 0), (E - 1, k - 1)):
            if want in r:
                r.remove(want)
            else:
                r.pop(slot if slot < len(r) else -1)
            r.insert(slot if slot < len(r) else len(r), want)
        assert len(set(r)) == k and 0 in r and E - 1 in r
    inds = mx.array(np.array(rows, dtype=np.int32))
    s = rng.random((n, k)).astype(np.float32) + 0.05
    scores = mx.array(s / s.sum(1, keepdims=True))
    return inds, scores


def grouped_routing(n=6, k=2, e=32, tile=32, seed=0):
    """A valid Routing of ``n`` tokens to ``k`` distinct random experts of
    ``e`` each (``tile`` rows per work item), built by the reference ops
    (the grouped kernels' contract)."""
    from mlx_qwen_fast.moe_types import Routing
    from mlx_qwen_fast.ops import moe

    rng = np.random.default_rng(seed)
    inds = mx.array(np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32))
    g = moe.group_by_expert(inds, e)
    return Routing(inds, mx.ones((n, k), mx.float32), g, moe.block_map(g, tile), tile)


def x_tokens(n, D, seed):
    """[n, D] bf16 activations."""
    return (mx.random.normal((n, D), key=mx.random.key(seed)) * 1.5).astype(mx.bfloat16)
