"""``mlx_qwen_fast.layers``: the fast subclasses of mlx-lm's modules share
the stock module's arrays (``rebind``) and compute its function through
their op family's dispatch.

On this backend (CPU in CI) the layers take the plain-MLX paths; the CUDA
paths of the same layers: tests/ops/test_gated_delta.py (the whole Gated
DeltaNet layer vs stock on CUDA) and tests/ops/test_moe.py.
"""

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.qwen3_5 import GatedDeltaNet, TextModelArgs
from mlx_lm.models.qwen3_next import Qwen3NextAttention, Qwen3NextSparseMoeBlock

from compare import assert_close, tolerance
from mlx_qwen_fast import layers

ARGS = TextModelArgs(
    model_type="qwen3_5_moe_text", hidden_size=128, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=1, head_dim=64, vocab_size=64,
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
    linear_value_head_dim=32, linear_conv_kernel_dim=4,
)


def test_fast_classes_pair_with_their_stock_class():
    assert layers.FAST_CLASSES == {GatedDeltaNet: layers.FastGatedDeltaNet,
                                   Qwen3NextSparseMoeBlock: layers.FastSparseMoeBlock,
                                   Qwen3NextAttention: layers.FastAttention}
    for stock, fast in layers.FAST_CLASSES.items():
        assert issubclass(fast, stock) and fast.stock_class is stock


def test_rebind_shares_every_array_both_ways():
    mx.random.seed(0)
    stock = GatedDeltaNet(ARGS)
    fast = layers.rebind(stock, layers.FastGatedDeltaNet)
    assert type(fast) is layers.FastGatedDeltaNet and type(stock) is GatedDeltaNet
    a, b = dict(tree_flatten(stock.parameters())), dict(tree_flatten(fast.parameters()))
    assert a.keys() == b.keys() and all(a[k] is b[k] for k in a)
    assert fast.in_proj_qkv is stock.in_proj_qkv  # children shared, not copied
    back = layers.rebind(fast, fast.stock_class)
    assert type(back) is GatedDeltaNet
    assert all(v is a[k] for k, v in tree_flatten(back.parameters()))


def _run(layer, x, pieces):
    cache = ArraysCache(size=2)
    outs, start = [], 0
    for n in pieces:
        outs.append(layer(x[:, start:start + n], cache=cache))
        start += n
    mx.eval(outs, cache.state)
    return mx.concatenate(outs, axis=1), cache


def test_fast_gated_delta_net_computes_the_stock_layer():
    """Prefill in pieces (the chunked form) then decode steps (the
    recurrence), the cache carried: the stock layer's outputs and states to
    fp32 rounding (compare.FP32_TOL)."""
    mx.random.seed(1)
    stock = GatedDeltaNet(ARGS)
    fast = layers.rebind(stock, layers.FastGatedDeltaNet)
    x = mx.random.normal((2, 70, ARGS.hidden_size)) * 0.5
    pieces = [65, 3, 1, 1]
    y_s, c_s = _run(stock, x, pieces)
    y_f, c_f = _run(fast, x, pieces)
    tol = tolerance(mx.float32)
    assert_close(y_f, y_s, tol, "output")
    assert_close(c_f[1], c_s[1], tol, "recurrent state")
    assert_close(c_f[0], c_s[0], tol, "conv state")


@pytest.mark.parametrize("rows", [(1, 1), (4, 1), (2, 2), (1, 5), (1, 64)])
def test_fast_head_dispatches_decode_rows(monkeypatch, env, rows):
    """FastHead: 1 to 4 token rows go to the kernel path where
    ops.linear.decode_implementation chooses it (stood in for here: this
    CPU has none): the first call of a shape through the checked
    decode_linear, later ones through decode_linear_unchecked; everything
    else (5+ rows, the reference chosen, the switch off) is the stock
    module's call, bit for bit; the same arrays are read either way."""
    import mlx.nn as nn

    from mlx_qwen_fast import config
    from mlx_qwen_fast.ops import linear as linear_ops

    head = nn.QuantizedLinear(64, 300, bias=False, group_size=32, bits=4)
    x = mx.random.normal((*rows, 64), key=mx.random.key(sum(rows))).astype(mx.bfloat16)
    want = head(x)
    head.__class__ = layers.FastHead
    calls = []
    real = linear_ops.decode_implementation

    def impl(x, arrays, static, **kw):
        assert real(x, arrays, static, **kw) == "reference"  # no CUDA kernel here
        calls.append("decide")
        return "cuda-kernel" if math.prod(x.shape[:-1]) <= 4 and config.DECODE_GEMV_KERNEL.get() else "reference"

    def kernel(name):
        def run(x, arrays, static, *rest, **kw):
            calls.append(name)
            assert arrays[0] is head.weight and arrays[1] is head.scales and static[0] == "quantized"
            return linear_ops.decode_linear_reference(x, arrays, static)
        return run

    monkeypatch.setattr(linear_ops, "decode_implementation", impl)
    monkeypatch.setattr(linear_ops, "decode_linear", kernel("checked"))
    monkeypatch.setattr(linear_ops, "decode_linear_unchecked", kernel("unchecked"))
    small = math.prod(rows) <= 4
    for _ in range(3):
        got = head(x)
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)))
    assert calls == (["decide", "checked", "unchecked", "unchecked", "unchecked"] if small else ["decide"])
    calls.clear()
    env.set(config.DECODE_GEMV_KERNEL.name, "0")  # a new key: decided again, and stock now
    np.testing.assert_array_equal(np.array(head(x).astype(mx.float32)), np.array(want.astype(mx.float32)))
    assert calls == ["decide"]
