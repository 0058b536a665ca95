"""kernels/attention_layer_decode.py: a gated-attention decoder layer's
decode step (q|k|v projection with the input norm, attention over the KV
cache with the cache write, o_proj with the residual, then the one-launch
MoE block) in one launch.

Its contract is the launches it replaces, bit for bit, so each test
compares with ``quantized_gemv`` (q|k|v, the input norm fused) ->
``attention_decode`` -> ``quantized_gemv`` (o_proj, the residual) ->
``moe_block_decode`` on fresh random inputs (each checked against its fp32
reference in its own test file): the output and both cache buffers; outputs
are poisoned before each launch (the ``poison`` fixture). The CUDA check
runs the marked sets on the CPU.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import pytest

from compare import finite
from launches_at_once import check_launches_at_once
from moe_blocks import make_arrays, quant
from mlx_qwen_fast.kernels import _cuda_build as cb
from mlx_qwen_fast.kernels import attention_decode as ad
from mlx_qwen_fast.kernels import attention_layer_decode as al
from mlx_qwen_fast.kernels import moe_block_decode as mb
from mlx_qwen_fast.kernels import quantized_gemv as qg
from mlx_qwen_fast.kernels.attention_contract import DH, proj_width

EPS_IN, EPS_Q, EPS_POST = 1e-6, 1e-6, 1e-5
CPU = pytest.mark.cpu_check("attention_layer_decode.cu", "attention_decode.cu", "quantized_gemv.cu",
                            "moe_block_decode.cu")


class Layer(NamedTuple):
    x: mx.array
    w_in: mx.array
    qkv: tuple
    qn: mx.array
    kn: mx.array
    keys: mx.array
    values: mx.array
    o_proj: tuple
    blk: dict
    hq: int
    hkv: int
    rope_dims: int


def _layer(B, K, hq, hkv, cap, E, I, k, seed, gate_bits=8, rbits=8, rope_dims=64) -> Layer:
    """One random layer: x, the attention weights, cache buffers of
    ``cap`` positions (random everywhere: the positions past the offset must
    not matter), the MoE block's arguments."""
    def norm_w(s, n):
        return (1.0 + 0.2 * mx.random.normal((n,), key=mx.random.key(s))).astype(mx.bfloat16)

    x = (2.0 * mx.random.normal((B, 1, K), key=mx.random.key(seed))).astype(mx.bfloat16)
    kv = [mx.random.normal((B, hkv, cap, DH), key=mx.random.key(seed + i)).astype(mx.bfloat16) for i in (1, 2)]
    experts, shared, eg = make_arrays(E, K, I, seed=seed + 3, gate_bits=gate_bits)
    blk = dict(norm_weight=norm_w(seed + 4, K), router=quant((E, K), seed + 5, scale=3.0, bits=rbits),
               experts=experts, shared=shared, expert_gate=eg, top_k=k, router_bits=rbits)
    return Layer(x, norm_w(seed + 6, K), quant((proj_width(hq, hkv), K), seed + 7, scale=4.0), norm_w(seed + 8, DH),
                 norm_w(seed + 9, DH), kv[0], kv[1], quant((K, hq * DH), seed + 10, scale=2.0), blk, hq, hkv,
                 rope_dims)


_ATT = dict(scale=DH ** -0.5, q_eps=EPS_Q, k_eps=EPS_Q, rope_base=10000.0, rope_scale=1.0)


def _launches(a: Layer, x, keys, values, offset):
    """The launches the layer replaces: (out, keys, values, h)."""
    B = x.shape[0]
    proj = qg.quantized_gemv(x, *a.qkv, group_size=64, bits=4, norm_weight=a.w_in, norm_eps=EPS_IN)
    att, keys, values = ad.attention_decode(proj.reshape(B, 1, -1), keys, values, offset, a.qn, a.kn,
                                            num_heads=a.hq, num_kv_heads=a.hkv, rope_dims=a.rope_dims, **_ATT)
    h = qg.quantized_gemv(att, *a.o_proj, group_size=64, bits=4, residual=x)
    b = a.blk
    out = mb.moe_block_decode(h, b["norm_weight"], b["router"], b["experts"], b["shared"], b["expert_gate"],
                              top_k=b["top_k"], norm_eps=EPS_POST, router_bits=b["router_bits"])
    return out, keys, values, h


def _one(a: Layer, x, keys, values, offset, **kw):
    b = a.blk
    return al.attention_layer_decode(x, a.w_in, a.qkv, a.qn, a.kn, keys, values, offset, a.o_proj, b["norm_weight"],
                                     b["router"], b["experts"], b["shared"], b["expert_gate"], num_heads=a.hq,
                                     num_kv_heads=a.hkv, input_norm_eps=EPS_IN, rope_dims=a.rope_dims,
                                     top_k=b["top_k"], post_norm_eps=EPS_POST, router_bits=b["router_bits"],
                                     **_ATT, **kw)


def _check_steps(B, K, hq, hkv, cap, E, I, k, offsets, seed, **kw):
    """Chained steps at ``offsets`` (the caches carried from the one
    launch's step, a new x each step): out and both buffers equal the
    launches' bit for bit."""
    a = _layer(B, K, hq, hkv, cap, E, I, k, seed, **kw)
    x, keys, values = a.x, a.keys, a.values
    for step, off in enumerate(offsets):
        offset = mx.array(off, mx.int32)
        want = _launches(a, x, keys, values, offset)
        got = _one(a, x, keys, values, offset)
        assert finite(got[0])
        for name, g, w in zip(("out", "keys", "values"), got, want):
            assert g.shape == w.shape and g.dtype == w.dtype, name
            assert mx.array_equal(g, w).item(), f"step {step} (offset {off}): {name}"
        _, keys, values = got
        x = (2.0 * mx.random.normal(x.shape, key=mx.random.key(seed + 20 + step))).astype(mx.bfloat16)


def test_sizes():
    """The scratch holds proj, the partials, y and h (16-byte aligned) and
    the block's; the dynamic shared memory is the larger of the attention
    items' and the block's; the grid is one block per SM."""
    ns = 7
    words = al.scratch_words(2, 4, 2, 256, ns, 4, 32, 128)
    parts = [2 * proj_width(4, 2) * 2, 2 * 4 * ns * (DH + 2) * 4, 2 * 4 * DH * 2, 2 * 256 * 2]
    assert words * 4 == sum(-(-p // 16) * 16 for p in parts) + mb.scratch_words(2, 4, 32, 128) * 4
    assert al.smem_bytes(1, 16, 2, 8, 512) == max(65536 + 9 * DH * 4 + 4 * DH, mb.smem_bytes(1, 8, 512))
    assert al.grid_blocks(132) == 132
    assert al.smem_problem(4, 2048, 16, 2, 8, 512) is None
    assert "32768" in al.smem_problem(4, 2048, 32, 2, 8, 512)


def test_bad_input_names_the_argument(no_launch):
    """Each bad argument raises ValueError naming it, before any launch."""
    a = _layer(1, 256, 4, 2, 64, 32, 128, 4, 1)
    off = mx.array(3, mx.int32)
    cases = [
        (dict(x=a.x.astype(mx.float32)), r"\bx\b"),
        (dict(x=[1.0]), r"\bx\b"),
        (dict(w_in=a.w_in[:128]), "input_norm_weight"),
        (dict(qkv=a.qkv[:2]), "qkv"),
        (dict(qkv=quant((proj_width(4, 2) - 16, 256), 3)), "qkv"),
        (dict(o_proj=quant((256, 3 * DH), 4)), "o_proj"),
        (dict(keys=a.keys[:, :1]), "keys"),
        (dict(values=a.values[..., :128]), "values"),
        (dict(offset=mx.array([3], mx.int32)), "offset"),
        (dict(qn=a.qn[:128]), "q_norm_weight"),
        (dict(hkv=3), "num_heads"),
        (dict(hq=32, hkv=2), "num_heads"),
        (dict(hq=True, hkv=True), "num_heads"),  # == 1: would build a kernel with ATT_HQ=True
        (dict(hq=0), "num_heads"),
        (dict(router=a.blk["router"][:2]), "router"),
        (dict(q_eps=0.0), "q_eps"),
        (dict(input_norm_eps=2.0), "input_norm_eps"),
        (dict(post_norm_eps=0.0), "post_norm_eps"),
        (dict(top_k=0), "top_k"),
        (dict(after=[1.0]), "after"),
    ]
    for over, name in cases:
        layer = a._replace(**{k: v for k, v in over.items() if k in Layer._fields})
        if "router" in over:
            layer = layer._replace(blk={**a.blk, "router": over["router"]})
        if "top_k" in over:
            layer = layer._replace(blk={**a.blk, "top_k": over["top_k"]})
        kw = {k: v for k, v in over.items() if k not in Layer._fields and k not in ("router", "top_k", "q_eps",
                                                                                      "offset")}
        att = dict(_ATT, q_eps=over.get("q_eps", EPS_Q))
        with pytest.raises(ValueError, match=name):
            b = layer.blk
            al.attention_layer_decode(layer.x, layer.w_in, layer.qkv, layer.qn, layer.kn, layer.keys, layer.values,
                                      over.get("offset", off), layer.o_proj, b["norm_weight"], b["router"],
                                      b["experts"], b["shared"], b["expert_gate"], num_heads=layer.hq,
                                      num_kv_heads=layer.hkv, input_norm_eps=kw.pop("input_norm_eps", EPS_IN),
                                      rope_dims=layer.rope_dims, top_k=b["top_k"],
                                      post_norm_eps=kw.pop("post_norm_eps", EPS_POST), router_bits=b["router_bits"],
                                      **att, **kw)


def test_supports(monkeypatch):
    """supports(): True for the layer's arrays on a CUDA machine; False for
    float32 rows, 16 query heads per KV head, a cache of another dtype, 5
    rows, and off CUDA."""
    monkeypatch.setattr(cb, "cuda_available", lambda: True)
    a = _layer(1, 256, 4, 2, 64, 32, 128, 4, 2)
    b = a.blk

    def sup(x=a.x, keys=a.keys, values=a.values, hq=a.hq, hkv=a.hkv):
        return al.supports(x, a.w_in, a.qkv, keys, values, a.o_proj, b["norm_weight"], b["router"], b["experts"],
                           b["shared"], b["expert_gate"], num_heads=hq, num_kv_heads=hkv, top_k=b["top_k"])

    assert sup()
    assert not sup(x=a.x.astype(mx.float32))
    assert not sup(hq=32, hkv=2)
    assert not sup(keys=a.keys.astype(mx.float16), values=a.values.astype(mx.float16))
    assert not sup(x=mx.zeros((5, 1, 256), mx.bfloat16))
    monkeypatch.setattr(cb, "cuda_available", lambda: False)
    assert not sup()


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("B,sms,cap,offsets", [
    pytest.param(1, 3, 96, (0, 1, 40), marks=CPU),  # the first position, a split's edge, several tiles
    pytest.param(2, 5, 160, (63, 64, 159), marks=CPU),  # the last position of the buffer
    pytest.param(4, 1, 64, (17,), marks=CPU),  # every item on one block
    (1, None, 4096, (0, 2049, 4095)),
    (3, None, 700, (333, 334)),
])
def test_equals_the_launches(monkeypatch, B, sms, cap, offsets):
    """Chained steps at 1-4 rows on grids of 1, 3 and 5 blocks (the items'
    and tiles' rounds) and the machine's own: out and both cache buffers as
    the launches give them, bit for bit."""
    if sms is not None:
        monkeypatch.setattr(cb, "sm_count", lambda: sms)
    _check_steps(B, 256, 4, 2, cap, 32, 128, 4, offsets, seed=40 + B)


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("hq,hkv,rope_dims,gate_bits,rbits", [
    pytest.param(15, 1, 256, 16, 4, marks=CPU),  # 15 query heads per KV head, RoPE over the whole head
    pytest.param(2, 2, 2, 4, 8, marks=CPU),  # one query head per KV head, the smallest RoPE
    (16, 2, 64, 8, 8),  # the model's heads
])
def test_other_heads_rope_and_bits(monkeypatch, hq, hkv, rope_dims, gate_bits, rbits):
    """Other head groupings, RoPE widths, shared-gate and router widths:
    bit for bit as the launches (3-block grid)."""
    monkeypatch.setattr(cb, "sm_count", lambda: 3)
    _check_steps(2, 256, hq, hkv, 80, 32, 128, 4, (37, 79), seed=60 + hq, gate_bits=gate_bits, rbits=rbits,
                 rope_dims=rope_dims)


@pytest.mark.cuda
@pytest.mark.cpu_check("attention_layer_decode.cu")
@pytest.mark.usefixtures("poison")
def test_after_changes_no_bit(monkeypatch):
    """``after`` (an input never read) leaves every output's bits as the
    launch without it gives them."""
    monkeypatch.setattr(cb, "sm_count", lambda: 3)
    a = _layer(2, 256, 4, 2, 64, 32, 128, 4, 70)
    off = mx.array(9, mx.int32)
    want = _one(a, a.x, a.keys, a.values, off)
    got = _one(a, a.x, a.keys, a.values, off, after=mx.arange(5))
    for g, w in zip(got, want):
        assert mx.array_equal(g, w).item()


@pytest.mark.cuda
@pytest.mark.parametrize("launches,sms", [(6, 3), (4, None)])
def test_launches_at_once(monkeypatch, launches, sms):
    """Launches that nothing orders (evaluated together) each take a
    barrier slot of their own: every output as each launch alone."""
    if sms is not None:
        monkeypatch.setattr(cb, "sm_count", lambda: sms)
    layers = [_layer(2, 256, 4, 2, 64, 32, 128, 4, 80 + i) for i in range(launches)]
    off = mx.array(11, mx.int32)
    check_launches_at_once([lambda lay=lay: _one(lay, lay.x, lay.keys, lay.values, off) for lay in layers])
