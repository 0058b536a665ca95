"""ops.attention: the decode step's contract, its reference against mlx-lm's
own ``Qwen3NextAttention`` with a ``KVCache``, and the dispatcher's choice.

CPU: the reference equals the stock module's output and cache (fp32, fresh
random weights and cache, head_dim 64 and 256, offsets at the cache's first
position and either side of its 256-position growth). CUDA: the dispatcher
runs the kernels for head_dim 256 and the reference otherwise or when
switched off.
"""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3_next import ModelArgs, Qwen3NextAttention

from compare import FP32_TOL, assert_close
from cuda_helpers import HAS_CUDA
from mlx_qwen_fast import config
from mlx_qwen_fast.ops import attention


def _module(head_dim, hq=16, hkv=2, hidden=256, seed=0):
    args = ModelArgs(model_type="qwen3_next", hidden_size=hidden, num_hidden_layers=1, intermediate_size=64,
                     num_attention_heads=hq, num_key_value_heads=hkv, head_dim=head_dim, rms_norm_eps=1e-6,
                     vocab_size=32, rope_theta=1e7, partial_rotary_factor=0.25, max_position_embeddings=4096,
                     linear_num_value_heads=1, linear_num_key_heads=1, linear_key_head_dim=8,
                     linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=1, num_experts_per_tok=1,
                     decoder_sparse_step=1, shared_expert_intermediate_size=8, moe_intermediate_size=8,
                     norm_topk_prob=True, mlp_only_layers=[])
    mx.random.seed(seed)
    attn = Qwen3NextAttention(args)
    attn.update({"q_norm": {"weight": 1 + 0.2 * mx.random.normal((head_dim,))},
                 "k_norm": {"weight": 1 + 0.2 * mx.random.normal((head_dim,))}})
    return attn


def _settings(attn):
    return dict(num_heads=attn.num_attention_heads, num_kv_heads=attn.num_key_value_heads, scale=attn.scale,
                q_eps=attn.q_norm.eps, k_eps=attn.k_norm.eps, rope_dims=attn.rope.dims,
                rope_traditional=attn.rope.traditional, rope_base=attn.rope.base, rope_scale=attn.rope.scale)


def _proj(attn, x):
    return mx.concatenate([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], axis=-1)


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("ctx", [0, 1, 255, 256])
def test_reference_is_the_stock_module(head_dim, ctx):
    """fp32: output (before o_proj) and written cache as the module's."""
    with mx.stream(mx.cpu):
        attn = _module(head_dim, seed=ctx)
        stock, ours = KVCache(), KVCache()
        if ctx:
            pre = mx.random.normal((1, 2, ctx, head_dim), key=mx.random.key(ctx))
            stock.update_and_fetch(pre, pre * 0.5)
        x = mx.random.normal((1, 1, 256), key=mx.random.key(ctx + 7))
        seen = {}
        real = attn.o_proj

        def capture(y):  # the module's value just before o_proj
            seen["y"] = y
            return real(y)

        attn.o_proj = capture
        attn(x, None, stock)
        attn.o_proj = real
        # our buffers: the prefix, then room at the offset as the decoder step makes it
        cap = max(256, ((ctx + 1 + 255) // 256) * 256)
        keys = mx.zeros((1, 2, cap, head_dim))
        values = mx.zeros((1, 2, cap, head_dim))
        if ctx:
            keys[:, :, :ctx] = pre
            values[:, :, :ctx] = pre * 0.5
        out, k2, v2 = attention.decode_attention_reference(
            _proj(attn, x), keys, values, mx.array(ctx, mx.int32), attn.q_norm.weight, attn.k_norm.weight,
            **_settings(attn))
        assert_close(out, seen["y"], FP32_TOL, "output")
        assert_close(k2[:, :, :ctx + 1], stock.keys[:, :, :ctx + 1], FP32_TOL, "keys")
        assert_close(v2[:, :, :ctx + 1], stock.values[:, :, :ctx + 1], 0.0, "values")


def test_dispatch_off_cuda_is_the_reference(monkeypatch):
    attn = _module(256)
    x = mx.random.normal((1, 1, 256))
    keys = values = mx.zeros((1, 2, 256, 256))
    proj = _proj(attn, x)
    hd = dict(num_heads=16, num_kv_heads=2, head_dim=256)
    assert attention.decode_implementation(proj, keys, values, backend="cpu", **hd) == "reference"
    assert attention.implementation_for(1, "cpu") == "reference"
    assert attention.implementation_for(1, "metal") == "reference"
    assert attention.implementation_for(4096, "cuda") == "stock"
    with pytest.raises(ValueError, match="backend"):
        attention.implementation_for(1, "tpu")


@pytest.mark.cuda
def test_dispatch_on_cuda(env, monkeypatch):
    assert HAS_CUDA
    calls = []
    real = attention._k_decode.attention_decode
    monkeypatch.setattr(attention._k_decode, "attention_decode",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    for head_dim, kernel in ((256, True), (128, False)):
        attn = _module(head_dim)
        attn.set_dtype(mx.bfloat16)
        x = mx.random.normal((1, 1, 256)).astype(mx.bfloat16)
        keys = values = mx.zeros((1, 2, 256, head_dim), mx.bfloat16)
        calls.clear()
        out, _, _ = attention.decode_attention(_proj(attn, x), keys, values, mx.array(3, mx.int32),
                                               attn.q_norm.weight, attn.k_norm.weight, **_settings(attn))
        mx.eval(out)
        assert bool(calls) == kernel
    env.set(config.ATTENTION_DECODE_KERNEL.name, "0")
    calls.clear()
    attn = _module(256)
    keys = values = mx.zeros((1, 2, 256, 256))
    x = mx.random.normal((1, 1, 256))
    mx.eval(attention.decode_attention(_proj(attn, x), keys, values, mx.array(0, mx.int32), attn.q_norm.weight,
                                       attn.k_norm.weight, **_settings(attn)))
    assert not calls
    assert attention.implementation_for(1, "cuda") == "reference"
    assert isinstance(attn.rope, nn.RoPE)
