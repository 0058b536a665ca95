"""The patched Gated DeltaNet layer on CUDA (fused kernels) vs the stock layer.

Real Qwen3.6-35B-A3B layer shapes, 4-bit quantised projections; prefill
across chunk boundaries with the cache carried, then decode steps. Runs only
where MLX's CUDA backend is available (the H200), skipped elsewhere.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.qwen3_5 import GatedDeltaNet, TextModelArgs

from mlx_qwen_fast.layers import FastGatedDeltaNet, rebind
from mlx_qwen_fast.ops import gated_delta as gated_delta_ops

pytestmark = pytest.mark.cuda

if not (hasattr(mx, "cuda") and mx.cuda.is_available()):
    pytest.skip("needs MLX's CUDA backend", allow_module_level=True)

ARGS = TextModelArgs(
    model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=4,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256, vocab_size=256,
    linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4,
)


def _layer(seed, dtype):
    mx.random.seed(seed)
    layer = GatedDeltaNet(ARGS)
    new = []
    for name, p in tree_flatten(layer.parameters()):
        if name.endswith("A_log"):
            new.append((name, mx.log(mx.random.uniform(0.1, 8.0, p.shape))))
        elif name.endswith("dt_bias"):
            new.append((name, mx.random.uniform(-1.0, 1.0, p.shape)))
        elif "norm" in name:
            new.append((name, 1.0 + 0.1 * mx.random.normal(p.shape)))
        elif "conv1d" in name:
            new.append((name, mx.random.normal(p.shape) * 0.5))
        else:
            new.append((name, mx.random.normal(p.shape) * p.shape[-1] ** -0.5))
    layer.update(tree_unflatten(new))
    nn.quantize(layer, group_size=64, bits=4)
    A_log = layer.A_log  # mlx-lm keeps A_log in float32 (cast_predicate)
    layer.set_dtype(dtype)
    layer.A_log = A_log
    mx.eval(layer.parameters())
    return layer


def _run(layer, x, pieces):
    cache = ArraysCache(size=2)
    outs, start = [], 0
    for n in pieces:
        outs.append(layer(x[:, start : start + n], cache=cache))
        start += n
    mx.eval(outs, cache.state)
    return mx.concatenate(outs, axis=1).astype(mx.float32), cache


def _rel(a, b):
    return (mx.linalg.norm(a.astype(mx.float32) - b.astype(mx.float32))
            / mx.linalg.norm(b.astype(mx.float32))).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("B,pieces", [(1, [1]), (1, [3, 1, 1]), (2, [64, 1]),
                                      (1, [65, 2, 1, 1]), (1, [2048, 1, 1])])
def test_fused_layer_matches_stock(dtype, B, pieces):
    assert gated_delta_ops.implementation_for(64) == gated_delta_ops.CUDA_KERNEL
    seed = int(np.random.default_rng().integers(1 << 30))
    stock = _layer(seed, dtype)
    fast = rebind(stock, FastGatedDeltaNet)
    x = (mx.random.normal((B, sum(pieces), ARGS.hidden_size)) * 0.5).astype(dtype)
    y_stock, c_stock = _run(stock, x, pieces)
    y_fast, c_fast = _run(fast, x, pieces)
    # fp32: both compute the same function with fp32 accumulation in another
    # order. bf16: the stock layer rounds softplus/gates and intermediates to
    # bf16 where the kernels keep fp32, so allow a few bf16 ulps (eps 2^-8).
    tol = 1e-4 if dtype == mx.float32 else 4 * 2.0**-8
    assert _rel(y_fast, y_stock) < tol, f"seed {seed}: output"
    assert _rel(c_fast[1], c_stock[1]) < tol, f"seed {seed}: recurrent state"
    assert _rel(c_fast[0], c_stock[0]) < tol, f"seed {seed}: conv state"
    assert c_fast[1].dtype == mx.float32


@pytest.mark.parametrize("pieces", [[65, 2, 1, 1], [2048, 1, 1]])
def test_fused_prefill_layer_matches_stock(pieces, monkeypatch):
    """The layer with the opt-in fused front end + scan kernel (B = 1)."""
    from mlx_qwen_fast.kernels import gated_delta_prefill as k_prefill
    from mlx_qwen_fast.layers import GDN_FUSED_ENV

    calls = []
    real = k_prefill.gated_delta_prefill
    monkeypatch.setattr(k_prefill, "gated_delta_prefill", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv(GDN_FUSED_ENV, "1")
    test_fused_layer_matches_stock(mx.bfloat16, 1, pieces)
    assert len(calls) == sum(n > 1 for n in pieces)  # every prefill piece took the fused kernel


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("B", [1, 2])
def test_compiled_decode_step_equals_eager(dtype, B, packed, monkeypatch):
    """The layer's mx.compile'd decode step (projections + kernel + out_proj;
    packed: the four input projections as one concatenated projection read
    in place by the kernel) gives the eager launches' results (four
    projections, the unpacked kernel) bit for bit, two layers through one
    trace, state carried over steps; a replaced weight is read."""
    from mlx_qwen_fast.layers import GDN_PACKED_ENV

    monkeypatch.setenv(GDN_PACKED_ENV, "1" if packed else "0")
    seed = int(np.random.default_rng().integers(1 << 30))
    layers = [rebind(_layer(seed + i, dtype), FastGatedDeltaNet) for i in range(2)]
    xs = (mx.random.normal((3, B, 1, ARGS.hidden_size)) * 0.5).astype(dtype)
    for layer in layers:
        c_fast, c_eager = ArraysCache(size=2), ArraysCache(size=2)
        for x in xs:
            y = layer(x, cache=c_fast)
            conv = c_eager[0] if c_eager[0] is not None else mx.zeros((B, 3, layer.conv_dim), dtype)
            st = c_eager[1] if c_eager[1] is not None else mx.zeros((B, 32, 128, 128), mx.float32)
            y_ref = layer._decode_cuda_eager(x, conv, st, c_eager)
            mx.eval(y, y_ref, c_fast.state, c_eager.state)
            assert mx.array_equal(y, y_ref).item(), f"seed {seed}"
            assert mx.array_equal(c_fast[1], c_eager[1]).item() and mx.array_equal(c_fast[0], c_eager[0]).item()
    layer = layers[0]
    x = xs[0]
    y0 = layer(x, cache=ArraysCache(size=2))
    # doubling scales and biases doubles every dequantised weight exactly
    layer.out_proj.scales = layer.out_proj.scales * 2
    layer.out_proj.biases = layer.out_proj.biases * 2
    y1 = layer(x, cache=ArraysCache(size=2))
    mx.eval(y0, y1)
    assert mx.array_equal(y1, 2 * y0).item()
    # an input projection replaced: the packed plan re-concatenates it
    layer.in_proj_z.scales = layer.in_proj_z.scales * 2
    layer.in_proj_z.biases = layer.in_proj_z.biases * 2
    zero_conv = mx.zeros((B, 3, layer.conv_dim), dtype)
    zero_state = mx.zeros((B, 32, 128, 128), mx.float32)
    y2 = layer(x, cache=ArraysCache(size=2))
    y2_ref = layer._decode_cuda_eager(x, zero_conv, zero_state, ArraysCache(size=2))
    mx.eval(y2, y2_ref)
    assert mx.array_equal(y2, y2_ref).item() and not mx.array_equal(y2, y1).item()
