"""Public ops given arguments outside their contracts: each raises one
ValueError whose message starts with the function's name and names the
argument, or (the unchecked entries of traced steps) returns without
writing or reading outside its buffers. The calls run in a subprocess
(``_CASES`` below, one line of output per case), so a call that corrupts
memory, aborts or segfaults fails the test instead of the test run; a case
that returns where it should raise fails too.

Each case is named ``"<module>.<function>: <what>"`` (a module of
``mlx_qwen_fast.ops``); :func:`test_every_public_op_has_a_case` fails when
a name in the ``__all__`` of a module of :data:`_EXEMPT` has neither a case
nor an exemption with its reason.
"""

import importlib
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = r'''
import json, sys
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache
from mlx_lm.models.switch_layers import SwitchGLU
from mlx_qwen_fast.checkpoint import build_model
from mlx_qwen_fast.compiled import linear_arrays
from mlx_qwen_fast.ops import attention, linear, moe, verify
from mlx_qwen_fast.ops import gated_delta as gd

def heap_serves():
    return mx.random.normal((1 << 16,)).sum().item() is not None

# --- attention -------------------------------------------------------------

def attn_args(cap=8, offset=0, hq=4, hkv=2, dh=64, B=1):
    mx.random.seed(0)
    proj = mx.random.normal((B, 1, 2 * (hq + hkv) * dh))
    keys = mx.random.normal((B, hkv, cap, dh))
    values = mx.random.normal((B, hkv, cap, dh))
    w = mx.ones((dh,))
    settings = dict(num_heads=hq, num_kv_heads=hkv, scale=dh ** -0.5, q_eps=1e-6, k_eps=1e-6, rope_dims=dh // 4)
    return (proj, keys, values, mx.array(offset, mx.int32), w, w), settings

def decode(offset):
    args, settings = attn_args(offset=offset)
    return attention.decode_attention(*args, **settings)

def clamped(keys, k2, rows):
    """Whether the buffer k2 equals keys outside ``rows`` (the clamped rows written)."""
    others = [i for i in range(keys.shape[2]) if i not in rows]
    kept = mx.array_equal(k2[:, :, others], keys[:, :, others]).item()
    return "clamped" if kept and heap_serves() else "wrote outside the clamped rows"

def decode_unchecked(offset, fn=attention.decode_attention_unchecked):
    args, settings = attn_args(offset=offset)
    keys = args[1]
    out, k2, v2 = fn(*args, **settings)
    mx.eval(out, k2, v2)
    return clamped(keys, k2, [min(max(offset, 0), keys.shape[2] - 1)])

def prefill(offset, T=4, L=8):
    q = mx.zeros((1, 4, T, 64)); k = mx.zeros((1, 2, L, 64))
    return attention.prefill_attention(q, k, k, scale=0.125, offset=offset)

# --- the tiny model's modules --------------------------------------------

_model = []
def full():
    if not _model:
        model, _ = build_model("tiny", seed=0, dtype=mx.float32)
        _model.append(model)
    return _model[0]

_bf16 = []
def block():
    """The tiny model's first MoE block in bfloat16 (moe_decode's dtype)."""
    if not _bf16:
        model, _ = build_model("tiny", seed=0, dtype=mx.bfloat16)
        _bf16.append(model.language_model.model.layers[0].mlp)
    return _bf16[0]

def text():
    return full().language_model.model

def gdn_layer():
    return next(l for l in text().layers if l.is_linear).linear_attn

def attn_layer():
    return next(l for l in text().layers if not l.is_linear).self_attn

def fblock():
    return text().layers[0].mlp

# --- gated_delta -----------------------------------------------------------

def gdn(B=1, T=3, Hk=2, Hv=4, Dk=8, Dv=8, **over):
    mx.random.seed(0)
    d = dict(q=mx.random.normal((B, T, Hk, Dk)), k=mx.random.normal((B, T, Hk, Dk)),
             v=mx.random.normal((B, T, Hv, Dv)), g=mx.full((B, T, Hv), 0.9), beta=mx.full((B, T, Hv), 0.5),
             state=mx.zeros((B, Hv, Dv, Dk)), mask=None)
    d.update(over)
    return d

def steps(**over):
    d = gdn(**over)
    d.pop("mask")
    return gd.gated_delta_recurrent_steps(**d)

def gates(B=1, T=3, Hv=4, **over):
    d = dict(a=mx.zeros((B, T, Hv)), b=mx.zeros((B, T, Hv)), A_log=mx.zeros((Hv,)), dt_bias=mx.zeros((Hv,)))
    d.update(over)
    return d

def update(**over):
    d = gdn()
    d.pop("g"); d.pop("beta")
    d.update(gates())
    d.update(over)
    return gd.gated_delta_update(**d)

def gdn_cache(B=1, conv=None, state=None):
    c, L = ArraysCache(2), gdn_layer()
    c[0] = mx.zeros((B, L.conv_kernel_size - 1, L.conv_dim)) if conv is None else conv
    c[1] = mx.zeros((B, L.num_v_heads, L.head_v_dim, L.head_k_dim)) if state is None else state
    return c

def net(inputs=None, mask=None, cache=None, layer=None):
    return gd.gated_delta_net(gdn_layer() if layer is None else layer,
                              mx.zeros((1, 2, 256)) if inputs is None else inputs, mask, cache)

def net_steps(inputs=None, cache=None, layer=None):
    return gd.gated_delta_net_steps(gdn_layer() if layer is None else layer,
                                    mx.zeros((1, 2, 256)) if inputs is None else inputs,
                                    gdn_cache() if cache is None else cache)

# --- moe -------------------------------------------------------------------

def groups(N=3, k=2, E=4):
    mx.random.seed(3)
    inds, _ = moe.route(mx.random.normal((N, E)), k)
    return moe.group_by_expert(inds, E)

def bad_groups():
    g = groups()
    return g._replace(order=g.order + 100)

def switch(E=4, D=64, H=32):
    mx.random.seed(1)
    return SwitchGLU(D, H, E)

def swiglu(x=None, grouped=None, gate=None, up=None, down=None, check=True):
    sw = switch()
    return moe.expert_swiglu(mx.zeros((3, 64)) if x is None else x, groups() if grouped is None else grouped,
                             gate or sw.gate_proj, up or sw.up_proj, down or sw.down_proj, check=check)

# --- linear ----------------------------------------------------------------

def lin(K=128, N=32, quant=True):
    mx.random.seed(2)
    l = nn.Linear(K, N, bias=False)
    if quant:
        l = nn.QuantizedLinear.from_linear(l, group_size=64, bits=4)
    return linear_arrays(l)

def qlayer(K=128, N=32):
    mx.random.seed(2)
    return nn.QuantizedLinear.from_linear(nn.Linear(K, N, bias=False), group_size=64, bits=4)

def dl(fn="decode_linear", x=None, arrays=None, static=None, **kw):
    a, s = lin()
    return getattr(linear, fn)(mx.zeros((1, 1, 128)) if x is None else x, a if arrays is None else arrays,
                               s if static is None else static, **kw)

def arn(fn="add_rms_norm", x=None, y=None, weight=None, eps=1e-6):
    x = mx.zeros((2, 1, 64)) if x is None else x
    return getattr(linear, fn)(x, mx.zeros((2, 1, 64)) if y is None else y,
                               mx.ones((64,)) if weight is None else weight, eps)

# --- verify ----------------------------------------------------------------

def vattn(attn=None, x=None, keys=None, values=None, offset=None):
    at = attn_layer()
    keys = mx.zeros((1, at.num_key_value_heads, 8, at.head_dim)) if keys is None else keys
    return verify.verify_attention(at if attn is None else attn, mx.zeros((1, 2, 256)) if x is None else x, keys,
                                   keys if values is None else values,
                                   mx.array(0, mx.int32) if offset is None else offset)

def vattn_unchecked(offset):
    at = attn_layer()
    mx.random.seed(4)
    keys = mx.random.normal((1, at.num_key_value_heads, 8, at.head_dim))
    out, k2, v2 = verify.verify_attention(at, mx.random.normal((1, 2, 256)), keys, keys, mx.array(offset, mx.int32))
    mx.eval(out, k2, v2)
    rows = [min(max(offset + s, 0), 7) for s in range(2)]
    return clamped(keys, k2, rows)

def prefilled():
    cache = make_prompt_cache(full())
    mx.eval(full()(mx.array([[1, 2, 3]]), cache=cache))
    return cache

def vmodel(inputs=None, fn="verify_model", **kw):
    return getattr(verify, fn)(text(), mx.array([[4, 5]]) if inputs is None else inputs, prefilled(), **kw)

def vmodel_ids(bad, same):
    """verify_model on an id outside the vocabulary: the result of the id
    clamped into it (``same``), no read outside the table."""
    a = verify.verify_model(text(), mx.array([[4, bad]]), prefilled())
    b = verify.verify_model(text(), mx.array([[4, same]]), prefilled())
    ok = a is not None and b is not None and mx.array_equal(a, b).item()
    return "clamped" if ok and heap_serves() else "not the clamped id's result"

def vocab():
    return text().embed_tokens.weight.shape[0]

CASES = {
    # attention
    "attention.decode_attention: offset 8": lambda: decode(8),
    "attention.decode_attention: offset 20": lambda: decode(20),
    "attention.decode_attention: offset -1": lambda: decode(-1),
    "attention.decode_attention: offset 9": lambda: decode(9),
    "attention.decode_attention: offset 1000": lambda: decode(1000),
    "attention.decode_attention: offset float": lambda: attention.decode_attention(*(lambda a, s: (a[:3] + (mx.array(1.5),) + a[4:]))(*attn_args()), **attn_args()[1]),
    "attention.decode_attention: proj width": lambda: attention.decode_attention(*(lambda a: (a[0][..., :-1],) + a[1:])(attn_args()[0]), **attn_args()[1]),
    "attention.decode_attention: heads": lambda: attention.decode_attention(*attn_args()[0], **{**attn_args()[1], "num_heads": 3}),
    "attention.decode_attention: heads bool": lambda: attention.decode_attention(*attn_args()[0], **{**attn_args()[1], "num_heads": True, "num_kv_heads": True}),
    "attention.decode_attention: rope_dims odd": lambda: attention.decode_attention(*attn_args()[0], **{**attn_args()[1], "rope_dims": 3}),
    "attention.decode_attention: rope_dims float": lambda: attention.decode_attention(*attn_args()[0], **{**attn_args()[1], "rope_dims": 16.0}),
    "attention.decode_attention: scale str": lambda: attention.decode_attention(*attn_args()[0], **{**attn_args()[1], "scale": "0.1"}),
    "attention.decode_attention: scale nan": lambda: attention.decode_attention(*attn_args()[0], **{**attn_args()[1], "scale": float("nan")}),
    "attention.decode_attention: q_eps negative": lambda: attention.decode_attention(*attn_args()[0], **{**attn_args()[1], "q_eps": -1.0}),
    "attention.decode_attention: unknown setting": lambda: attention.decode_attention(*attn_args()[0], **{**attn_args()[1], "window": 4}),
    "attention.decode_attention: batch 0": lambda: attention.decode_attention(*(a[:0] if i < 3 else a for i, a in enumerate(attn_args()[0])), **attn_args()[1]),
    "attention.decode_attention_unchecked: offset 8": lambda: decode_unchecked(8),
    "attention.decode_attention_unchecked: offset 1000": lambda: decode_unchecked(1000),
    "attention.decode_attention_unchecked: offset -1": lambda: decode_unchecked(-1),
    "attention.decode_attention_reference: offset 1000": lambda: decode_unchecked(1000, attention.decode_attention_reference),
    "attention.decode_attention_reference: offset -1": lambda: decode_unchecked(-1, attention.decode_attention_reference),
    "attention.prefill_attention: offset -3": lambda: prefill(-3),
    "attention.prefill_attention: offset past keys": lambda: prefill(5),
    "attention.prefill_attention: offset float": lambda: prefill(1.0),
    "attention.prefill_attention: keys batch": lambda: attention.prefill_attention(mx.zeros((2, 4, 4, 64)), mx.zeros((1, 2, 8, 64)), mx.zeros((1, 2, 8, 64)), scale=0.1, offset=0),
    # gated_delta
    "gated_delta.implementation_for: T a str": lambda: gd.implementation_for("x"),
    "gated_delta.implementation_for: T -1": lambda: gd.implementation_for(-1),
    "gated_delta.gated_delta_recurrent: q rank 3": lambda: gd.gated_delta_recurrent(**gdn(q=mx.zeros((1, 3, 16)))),
    "gated_delta.gated_delta_recurrent: v's T": lambda: gd.gated_delta_recurrent(**gdn(v=mx.zeros((1, 2, 4, 8)))),
    "gated_delta.gated_delta_recurrent: state shape": lambda: gd.gated_delta_recurrent(**gdn(state=mx.zeros((1, 4, 8, 9)))),
    "gated_delta.gated_delta_recurrent: state a list": lambda: gd.gated_delta_recurrent(**gdn(state=[0.0])),
    "gated_delta.gated_delta_recurrent: mask shape": lambda: gd.gated_delta_recurrent(**gdn(mask=mx.ones((1, 4), mx.bool_))),
    "gated_delta.gated_delta_recurrent: g int32": lambda: gd.gated_delta_recurrent(**gdn(g=mx.ones((1, 3, 4), mx.int32))),
    "gated_delta.gated_delta_recurrent: beta's B": lambda: gd.gated_delta_recurrent(**gdn(beta=mx.ones((2, 3, 4)))),
    "gated_delta.gated_delta_recurrent_steps: state bfloat16": lambda: steps(state=mx.zeros((1, 4, 8, 8), mx.bfloat16)),
    "gated_delta.gated_delta_recurrent_steps: k's Dk": lambda: steps(k=mx.zeros((1, 3, 2, 7))),
    "gated_delta.gated_delta_chunked: chunk_size 0": lambda: gd.gated_delta_chunked(**gdn(), chunk_size=0),
    "gated_delta.gated_delta_chunked: chunk_size -64": lambda: gd.gated_delta_chunked(**gdn(), chunk_size=-64),
    "gated_delta.gated_delta_chunked: chunk_size 48": lambda: gd.gated_delta_chunked(**gdn(), chunk_size=48),
    "gated_delta.gated_delta_chunked: chunk_size True": lambda: gd.gated_delta_chunked(**gdn(), chunk_size=True),
    "gated_delta.gated_delta_chunked: chunk_size 64.0": lambda: gd.gated_delta_chunked(**gdn(), chunk_size=64.0),
    "gated_delta.gated_delta_chunked: g's Hv": lambda: gd.gated_delta_chunked(**gdn(g=mx.ones((1, 3, 5)))),
    "gated_delta.compute_gates: a rank 2": lambda: gd.compute_gates(**gates(a=mx.zeros((3, 4)))),
    "gated_delta.compute_gates: A_log size": lambda: gd.compute_gates(**gates(A_log=mx.zeros((5,)))),
    "gated_delta.compute_gates: a int32": lambda: gd.compute_gates(**gates(a=mx.zeros((1, 3, 4), mx.int32), b=mx.zeros((1, 3, 4), mx.int32))),
    "gated_delta.gated_delta_update: q a list": lambda: update(q=[0.0]),
    "gated_delta.gated_delta_update: a's T": lambda: update(a=mx.zeros((1, 4, 4)), b=mx.zeros((1, 4, 4))),
    "gated_delta.gated_delta_update: a's Hv": lambda: update(a=mx.zeros((1, 3, 2)), b=mx.zeros((1, 3, 2)), A_log=mx.zeros((2,)), dt_bias=mx.zeros((2,))),
    "gated_delta.gated_delta_update: state shape": lambda: update(state=mx.zeros((1, 4, 8, 7))),
    "gated_delta.gated_delta_update: A_log size": lambda: update(A_log=mx.zeros((3,))),
    "gated_delta.gated_delta_update: lower_bound a str": lambda: update(lower_bound="x"),
    "gated_delta.gated_delta_update: lower_bound nan": lambda: update(lower_bound=float("nan")),
    "gated_delta.gated_delta_update: use_kernel a str": lambda: update(use_kernel="no"),
    "gated_delta.gated_delta_net: layer a Linear": lambda: net(layer=nn.Linear(4, 4)),
    "gated_delta.gated_delta_net: hidden size": lambda: net(inputs=mx.zeros((1, 2, 100))),
    "gated_delta.gated_delta_net: inputs int32": lambda: net(inputs=mx.zeros((1, 2, 256), mx.int32)),
    "gated_delta.gated_delta_net: inputs rank 2": lambda: net(inputs=mx.zeros((2, 256))),
    "gated_delta.gated_delta_net: mask's S": lambda: net(mask=mx.ones((1, 3), mx.bool_)),
    "gated_delta.gated_delta_net: mask's B": lambda: net(inputs=mx.zeros((2, 2, 256)), mask=mx.ones((1, 2), mx.bool_)),
    "gated_delta.gated_delta_net: cache a KVCache": lambda: net(cache=KVCache()),
    "gated_delta.gated_delta_net: conv state's B": lambda: net(cache=gdn_cache(conv=mx.zeros((2, 3, 1024)))),
    "gated_delta.gated_delta_net: state shape": lambda: net(cache=gdn_cache(state=mx.zeros((1, 8, 64, 32)))),
    "gated_delta.gated_delta_net_steps: hidden size": lambda: net_steps(inputs=mx.zeros((1, 2, 100))),
    "gated_delta.gated_delta_net_steps: layer a Linear": lambda: net_steps(layer=nn.Linear(4, 4)),
    "gated_delta.gated_delta_net_steps: state shape": lambda: net_steps(cache=gdn_cache(state=mx.zeros((1, 8, 64, 32)))),
    "gated_delta.gated_delta_net_steps: no tokens": lambda: net_steps(inputs=mx.zeros((1, 0, 256))),
    "gated_delta.gated_delta_net_steps: cache None": lambda: gd.gated_delta_net_steps(gdn_layer(), mx.zeros((1, 2, 256)), None),
    # moe
    "moe.route: top_k 0": lambda: moe.route(mx.zeros((2, 4)), 0),
    "moe.route: top_k 5 of 4 experts": lambda: moe.route(mx.zeros((2, 4)), 5),
    "moe.route: logits int32": lambda: moe.route(mx.zeros((2, 4), mx.int32), 2),
    "moe.group_by_expert: id 9 of 4 experts": lambda: moe.group_by_expert(mx.array([[0, 9]]), 4),
    "moe.group_by_expert: id -1": lambda: moe.group_by_expert(mx.array([[0, -1]]), 4),
    "moe.group_by_expert: inds float": lambda: moe.group_by_expert(mx.zeros((2, 2)), 4),
    "moe.group_by_expert: inds rank 1": lambda: moe.group_by_expert(mx.zeros((4,), mx.int32), 4),
    "moe.group_by_expert: num_experts 0": lambda: moe.group_by_expert(mx.zeros((2, 2), mx.int32), 0),
    "moe.block_map: tile_rows 0": lambda: moe.block_map(groups(), 0),
    "moe.block_map: groups a tuple": lambda: moe.block_map(tuple(groups()), 4),
    "moe.block_map: groups out of range": lambda: moe.block_map(bad_groups(), 4),
    "moe.expert_swiglu: x rank 3": lambda: swiglu(x=mx.zeros((3, 1, 64))),
    "moe.expert_swiglu: hidden size": lambda: swiglu(x=mx.zeros((3, 32))),
    "moe.expert_swiglu: N*k": lambda: swiglu(x=mx.zeros((4, 64))),
    "moe.expert_swiglu: groups a tuple": lambda: swiglu(grouped=tuple(groups())),
    "moe.expert_swiglu: groups out of range": lambda: swiglu(grouped=bad_groups()),
    "moe.expert_swiglu: gate_proj a Linear": lambda: swiglu(gate=nn.Linear(64, 32)),
    "moe.expert_swiglu: up_proj with fewer experts": lambda: swiglu(up=switch(E=2).up_proj),
    "moe.expert_swiglu: up_proj with fewer experts, unchecked": lambda: swiglu(up=switch(E=2).up_proj, check=False),
    "moe.expert_swiglu: down_proj with fewer experts": lambda: swiglu(down=switch(E=2).down_proj),
    "moe.expert_swiglu: up_proj width": lambda: swiglu(up=switch(H=16).up_proj),
    "moe.combine: scores shape": lambda: moe.combine(mx.zeros((3, 2, 8)), mx.zeros((3, 3))),
    "moe.combine: expert_out a list": lambda: moe.combine([0.0], mx.zeros((3, 2))),
    "moe.combine: expert_out rank 1": lambda: moe.combine(mx.zeros((3,)), mx.zeros(())),
    "moe.combine: dtype a str": lambda: moe.combine(mx.zeros((3, 2, 8)), mx.zeros((3, 2)), dtype="float32"),
    "moe.combine: scores int32": lambda: moe.combine(mx.zeros((3, 2, 8)), mx.zeros((3, 2), mx.int32)),
    "moe.shared_expert: hidden size": lambda: moe.shared_expert(fblock(), mx.zeros((1, 2, 100))),
    "moe.shared_expert: block a Linear": lambda: moe.shared_expert(nn.Linear(4, 4), mx.zeros((1, 2, 4))),
    "moe.shared_expert: x int32": lambda: moe.shared_expert(fblock(), mx.zeros((1, 2, 256), mx.int32)),
    "moe.sparse_moe_block: hidden size": lambda: moe.sparse_moe_block(fblock(), mx.zeros((1, 2, 100))),
    "moe.sparse_moe_block: x rank 1": lambda: moe.sparse_moe_block(fblock(), mx.zeros((256,))),
    "moe.sparse_moe_block: block a Linear": lambda: moe.sparse_moe_block(nn.Linear(4, 4), mx.zeros((1, 2, 4))),
    "moe.sparse_moe: implementation cuda-kernel": lambda: moe.sparse_moe(block(), mx.zeros((1, 1, 256), mx.bfloat16), implementation="cuda-kernel"),
    "moe.sparse_moe: implementation a list": lambda: moe.sparse_moe(block(), mx.zeros((1, 1, 256), mx.bfloat16), implementation=["stock"]),
    "moe.sparse_moe: block a Linear": lambda: moe.sparse_moe(nn.Linear(4, 4), mx.zeros((1, 2, 4))),
    "moe.sparse_moe: hidden size": lambda: moe.sparse_moe(block(), mx.zeros((1, 2, 100), mx.bfloat16)),
    "moe.moe_decode: hidden size": lambda: moe.moe_decode(block(), mx.zeros((1, 1, 100), mx.bfloat16)),
    "moe.moe_decode: x float32": lambda: moe.moe_decode(block(), mx.zeros((1, 1, 256), mx.float32)),
    "moe.moe_decode: 9 tokens": lambda: moe.moe_decode(block(), mx.zeros((1, 9, 256), mx.bfloat16)),
    "moe.quantization_problem: bits an int": lambda: moe.quantization_problem(nn.Linear(4, 4), bits=4),
    "moe.decide_kernels: block an int": lambda: moe.decide_kernels(3),
    "moe.decide_kernels: block None": lambda: moe.decide_kernels(None),
    # linear
    "linear.decode_linear: x's K": lambda: dl(x=mx.zeros((1, 1, 100))),
    "linear.decode_linear: dense x's K": lambda: linear.decode_linear(mx.zeros((1, 1, 100)), *lin(quant=False)),
    "linear.decode_linear: x int32": lambda: dl(x=mx.zeros((1, 1, 128), mx.int32)),
    "linear.decode_linear: static unknown": lambda: dl(static=("foo",)),
    "linear.decode_linear: static short": lambda: dl(static=("quantized", 64)),
    "linear.decode_linear: arrays short": lambda: dl(arrays=lin()[0][:1]),
    "linear.decode_linear: arrays of floats": lambda: dl(arrays=[0.0, 1.0, 2.0]),
    "linear.decode_linear: residual's rows": lambda: dl(residual=mx.zeros((2, 1, 32))),
    "linear.decode_linear: residual's width": lambda: dl(residual=mx.zeros((1, 1, 33))),
    "linear.decode_linear: norm weight size": lambda: dl(norm=(mx.ones((64,)), 1e-6)),
    "linear.decode_linear: norm eps -1": lambda: dl(norm=(mx.ones((128,)), -1.0)),
    "linear.decode_linear: norm not a pair": lambda: dl(norm=mx.ones((128,))),
    "linear.decode_linear: normed_out without norm": lambda: dl(normed_out=True),
    "linear.decode_linear_reference: x's K": lambda: dl("decode_linear_reference", x=mx.zeros((1, 1, 100))),
    "linear.decode_linear_reference: residual's rows": lambda: dl("decode_linear_reference", residual=mx.zeros((2, 1, 32))),
    "linear.decode_linear_reference: normed_out without norm": lambda: dl("decode_linear_reference", normed_out=True),
    "linear.decode_linear_reference: static unknown": lambda: dl("decode_linear_reference", static=("foo",)),
    "linear.add_rms_norm: x int32": lambda: arn(x=mx.zeros((2, 1, 64), mx.int32)),
    "linear.prefill_linear: x's K": lambda: linear.prefill_linear(qlayer(), mx.zeros((1, 4, 100))),
    "linear.prefill_linear: x int32": lambda: linear.prefill_linear(qlayer(), mx.zeros((1, 4, 128), mx.int32)),
    "linear.prefill_linear: layer not callable": lambda: linear.prefill_linear("q_proj", mx.zeros((1, 4, 128))),
    "linear.prefill_linear_reference: x's K": lambda: linear.prefill_linear_reference(qlayer(), mx.zeros((4, 64))),
    "linear.add_rms_norm: x 0-d": lambda: arn(x=mx.array(1.0)),
    "linear.add_rms_norm: y's shape": lambda: arn(y=mx.zeros((2, 1, 32))),
    "linear.add_rms_norm: y's dtype": lambda: arn(y=mx.zeros((2, 1, 64), mx.bfloat16)),
    "linear.add_rms_norm: weight's size": lambda: arn(weight=mx.ones((32,))),
    "linear.add_rms_norm: weight a list": lambda: arn(weight=[1.0] * 64),
    "linear.add_rms_norm: eps 0": lambda: arn(eps=0.0),
    "linear.add_rms_norm_reference: y's shape": lambda: arn("add_rms_norm_reference", y=mx.zeros((1, 1, 64))),
    "linear.add_rms_norm_reference: eps a str": lambda: arn("add_rms_norm_reference", eps="1e-6"),
    # verify
    "verify.verify_attention: hidden size": lambda: vattn(x=mx.zeros((1, 2, 100))),
    "verify.verify_attention: x rank 2": lambda: vattn(x=mx.zeros((2, 256))),
    "verify.verify_attention: keys' heads": lambda: vattn(keys=mx.zeros((1, 3, 8, 64))),
    "verify.verify_attention: keys' head_dim": lambda: vattn(keys=mx.zeros((1, 2, 8, 32))),
    "verify.verify_attention: capacity 1 < S": lambda: vattn(keys=mx.zeros((1, 2, 1, 64))),
    "verify.verify_attention: values shape": lambda: vattn(values=mx.zeros((1, 2, 4, 64))),
    "verify.verify_attention: keys bfloat16": lambda: vattn(keys=mx.zeros((1, 2, 8, 64), mx.bfloat16)),
    "verify.verify_attention: offset an int": lambda: vattn(offset=3),
    "verify.verify_attention: offset float": lambda: vattn(offset=mx.array(1.5)),
    "verify.verify_attention: attn a Linear": lambda: vattn(attn=nn.Linear(256, 4)),
    "attention.gated_attention: attn a Linear": lambda: attention.gated_attention(nn.Linear(256, 4), mx.zeros((1, 2, 256))),
    "attention.gated_attention: hidden size": lambda: attention.gated_attention(attn_layer(), mx.zeros((1, 2, 100))),
    "attention.gated_attention: x rank 2": lambda: attention.gated_attention(attn_layer(), mx.zeros((2, 256))),
    "attention.gated_attention: no tokens": lambda: attention.gated_attention(attn_layer(), mx.zeros((1, 0, 256))),
    "attention.gated_attention: no rows": lambda: attention.gated_attention(attn_layer(), mx.zeros((0, 2, 256))),
    "attention.decode_step_parts: attn an int": lambda: attention.decode_step_parts(3),
    "verify.verify_attention: offset 1000": lambda: vattn_unchecked(1000),
    "verify.verify_attention: offset -5": lambda: vattn_unchecked(-5),
    "verify.verify_model: inputs float": lambda: vmodel(inputs=mx.zeros((1, 2))),
    "verify.verify_model: model a Linear": lambda: verify.verify_model(nn.Linear(4, 4), mx.array([[4, 5]]), []),
    "verify.verify_model: id past the vocabulary": lambda: vmodel_ids(1 << 20, vocab() - 1),
    "verify.verify_model: id -5": lambda: vmodel_ids(-5, 0),
    "verify.verify_model: 1 token": lambda: vmodel(inputs=mx.array([[4]])),
    "verify.verify_model: 17 tokens": lambda: vmodel(inputs=mx.ones((1, 17), mx.int32)),
    "verify.verify_model_hidden: layer_ids empty": lambda: vmodel(fn="verify_model_hidden", layer_ids=[]),
    "verify.verify_model_hidden: layer 100 of 8": lambda: vmodel(fn="verify_model_hidden", layer_ids=[100]),
    "verify.verify_model_hidden: layer 1.5": lambda: vmodel(fn="verify_model_hidden", layer_ids=[1.5]),
    "verify.verify_model_hidden: layer_ids a str": lambda: vmodel(fn="verify_model_hidden", layer_ids="ab"),
    "verify.verify_model_hidden: layer_ids an int": lambda: vmodel(fn="verify_model_hidden", layer_ids=3),
    "verify.verify_model_hidden: layer True": lambda: vmodel(fn="verify_model_hidden", layer_ids=[True]),
    "verify.verify_model_hidden: layer_ids repeated": lambda: vmodel(fn="verify_model_hidden", layer_ids=[1, 1]),
    "verify.verify_model_hidden: inputs float": lambda: vmodel(inputs=mx.zeros((1, 2)), fn="verify_model_hidden", layer_ids=[0]),
}

for name in sys.argv[1:]:
    print(json.dumps({"case": name, "start": True}), flush=True)
    try:
        out = CASES[name]()
        if isinstance(out, (tuple, list)):
            mx.eval(*[o for o in out if isinstance(o, mx.array)])
        elif isinstance(out, mx.array):
            mx.eval(out)
        result = {"case": name, "returned": out if isinstance(out, str) else type(out).__name__}
    except ValueError as exc:
        result = {"case": name, "raised": "ValueError", "message": str(exc)}
    except Exception as exc:
        result = {"case": name, "raised": type(exc).__name__, "message": str(exc)}
    print(json.dumps(result), flush=True)
'''

#: case -> ("raise", words the message must hold after "<function>: ") or
#: ("return", the value returned: a string the case computes, or the
#: returned object's type name)
_CASES = {
    "attention.decode_attention: offset 8": ("raise", "offset must be in [0, 8)"),
    "attention.decode_attention: offset 20": ("raise", "offset must be in [0, 8)"),
    "attention.decode_attention: offset -1": ("raise", "offset must be in [0, 8)"),
    "attention.decode_attention: offset 9": ("raise", "offset must be in [0, 8)"),
    "attention.decode_attention: offset 1000": ("raise", "offset must be in [0, 8)"),
    "attention.decode_attention: offset float": ("raise", "offset must be a 0-d int32 array"),
    "attention.decode_attention: proj width": ("raise", "proj must be"),
    "attention.decode_attention: heads": ("raise", "num_heads (3) must be a positive multiple of num_kv_heads (2)"),
    "attention.decode_attention: heads bool": ("raise", "num_heads (True) must be a positive multiple of num_kv_heads (True)"),
    "attention.decode_attention: rope_dims odd": ("raise", "rope_dims must be even"),
    "attention.decode_attention: rope_dims float": ("raise", "rope_dims must be an int in [2, "),
    "attention.decode_attention: scale str": ("raise", "scale must be a finite number > 0, got '0.1'"),
    "attention.decode_attention: scale nan": ("raise", "scale must be a finite number > 0, got nan"),
    "attention.decode_attention: q_eps negative": ("raise", "q_eps must be a finite float in (0, 1)"),
    "attention.decode_attention: unknown setting": ("raise", "unknown setting(s) ['window']"),
    "attention.decode_attention: batch 0": ("raise", "keys must be a float array of shape [B >= 1"),
    "attention.decode_attention_unchecked: offset 8": ("return", "clamped"),
    "attention.decode_attention_unchecked: offset 1000": ("return", "clamped"),
    "attention.decode_attention_unchecked: offset -1": ("return", "clamped"),
    "attention.decode_attention_reference: offset 1000": ("return", "clamped"),
    "attention.decode_attention_reference: offset -1": ("return", "clamped"),
    "attention.prefill_attention: offset -3": ("raise", "offset must be an int with 0 <= offset"),
    "attention.prefill_attention: offset past keys": (
        "raise", "offset must be an int with 0 <= offset and offset + 4 (queries) <= 8"),
    "attention.prefill_attention: offset float": ("raise", "offset must be an int"),
    "attention.prefill_attention: keys batch": ("raise", "keys must be"),
    "gated_delta.implementation_for: T a str": ("raise", "T must be an int >= 0, got 'x'"),
    "gated_delta.implementation_for: T -1": ("raise", "T must be an int >= 0, got -1"),
    "gated_delta.gated_delta_recurrent: q rank 3": ("raise", "q must have shape [B, T, Hk, Dk] (rank 4)"),
    "gated_delta.gated_delta_recurrent: v's T": ("raise", "v must have shape [B, T, Hv, Dv] with B=1, T=3 as q"),
    "gated_delta.gated_delta_recurrent: state shape": ("raise", "state must have shape [B, Hv, Dv, Dk] = (1, 4, 8, 8)"),
    "gated_delta.gated_delta_recurrent: state a list": ("raise", "state must be an mx.array [B, Hv, Dv, Dk]"),
    "gated_delta.gated_delta_recurrent: mask shape": ("raise", "mask must have shape [B, T] = (1, 3)"),
    "gated_delta.gated_delta_recurrent: g int32": ("raise", "g must be a floating mx.array"),
    "gated_delta.gated_delta_recurrent: beta's B": ("raise", "beta must have shape [B, T, Hv] = (1, 3, 4)"),
    "gated_delta.gated_delta_recurrent_steps: state bfloat16": ("raise", "state must have dtype float32"),
    "gated_delta.gated_delta_recurrent_steps: k's Dk": ("raise", "k must have the same key dim Dk=8 as q"),
    "gated_delta.gated_delta_chunked: chunk_size 0": ("raise", "chunk_size must be a positive power of two, got 0"),
    "gated_delta.gated_delta_chunked: chunk_size -64": ("raise", "chunk_size must be a positive power of two"),
    "gated_delta.gated_delta_chunked: chunk_size 48": ("raise", "chunk_size must be a positive power of two"),
    "gated_delta.gated_delta_chunked: chunk_size True": ("raise", "chunk_size must be a positive power of two, got True"),
    "gated_delta.gated_delta_chunked: chunk_size 64.0": ("raise", "chunk_size must be a positive power of two"),
    "gated_delta.gated_delta_chunked: g's Hv": ("raise", "g must have shape [B, T, Hv] = (1, 3, 4)"),
    "gated_delta.compute_gates: a rank 2": ("raise", "a must have shape [B, T, Hv]"),
    "gated_delta.compute_gates: A_log size": ("raise", "A_log must have shape [Hv] = (4,)"),
    "gated_delta.compute_gates: a int32": ("raise", "a must be a floating mx.array"),
    "gated_delta.gated_delta_update: q a list": ("raise", "q must be an mx.array [B, T, Hk, Dk]"),
    "gated_delta.gated_delta_update: a's T": ("raise", "a must have shape [B, T, Hv] = (1, 3, 4)"),
    "gated_delta.gated_delta_update: a's Hv": ("raise", "a must have shape [B, T, Hv] = (1, 3, 4)"),
    "gated_delta.gated_delta_update: state shape": ("raise", "state must have shape [B, Hv, Dv, Dk] = (1, 4, 8, 8)"),
    "gated_delta.gated_delta_update: A_log size": ("raise", "A_log must have shape [Hv] = (4,)"),
    "gated_delta.gated_delta_update: lower_bound a str": ("raise", "lower_bound must be None or a finite number"),
    "gated_delta.gated_delta_update: lower_bound nan": ("raise", "lower_bound must be None or a finite number, got nan"),
    "gated_delta.gated_delta_update: use_kernel a str": ("raise", "use_kernel must be a bool, got 'no'"),
    "gated_delta.gated_delta_net: layer a Linear": ("raise", "layer must be an mlx-lm GatedDeltaNet"),
    "gated_delta.gated_delta_net: hidden size": ("raise", "inputs must have shape [B, S, D] with D = 256"),
    "gated_delta.gated_delta_net: inputs int32": ("raise", "inputs must have shape [B, S, D] with D = 256"),
    "gated_delta.gated_delta_net: inputs rank 2": ("raise", "inputs must have shape [B, S, D]"),
    "gated_delta.gated_delta_net: mask's S": ("raise", "mask must have shape [B, S] = (1, 2)"),
    "gated_delta.gated_delta_net: mask's B": ("raise", "mask must have shape [B, S] = (2, 2)"),
    "gated_delta.gated_delta_net: cache a KVCache": ("raise", "cache must be None or the layer's mlx-lm ArraysCache"),
    "gated_delta.gated_delta_net: conv state's B": ("raise", "cache[0] (the conv state) must be None or of shape"),
    "gated_delta.gated_delta_net: state shape": ("raise", "cache[1] (the recurrent state) must be None or of shape"),
    "gated_delta.gated_delta_net_steps: hidden size": ("raise", "inputs must have shape [B, S, D] with D = 256"),
    "gated_delta.gated_delta_net_steps: layer a Linear": ("raise", "layer must be an mlx-lm GatedDeltaNet"),
    "gated_delta.gated_delta_net_steps: state shape": ("raise", "cache[1] (the recurrent state)"),
    "gated_delta.gated_delta_net_steps: no tokens": ("raise", "inputs must have shape [B, S, D] with B, S >= 1"),
    "gated_delta.gated_delta_net_steps: cache None": ("raise", "cache must be the layer's ArraysCache"),
    "moe.route: top_k 0": ("raise", "top_k must be an int in [1, E=4]"),
    "moe.route: top_k 5 of 4 experts": ("raise", "top_k must be an int in [1, E=4]"),
    "moe.route: logits int32": ("raise", "logits must be a float32/float16/bfloat16 mx.array"),
    "moe.group_by_expert: id 9 of 4 experts": ("raise", "inds must lie in [0, num_experts=4)"),
    "moe.group_by_expert: id -1": ("raise", "inds must lie in [0, num_experts=4)"),
    "moe.group_by_expert: inds float": ("raise", "inds must be an integer mx.array of shape [N, k]"),
    "moe.group_by_expert: inds rank 1": ("raise", "inds must be an integer mx.array of shape [N, k]"),
    "moe.group_by_expert: num_experts 0": ("raise", "num_experts must be an int >= 1"),
    "moe.block_map: tile_rows 0": ("raise", "tile_rows must be an int in [1, 65536]"),
    "moe.block_map: groups a tuple": ("raise", "groups must be an ExpertGroups"),
    "moe.block_map: groups out of range": ("raise", "groups' values are out of range"),
    "moe.expert_swiglu: x rank 3": ("raise", "x must be a float mx.array of shape [N, D]"),
    "moe.expert_swiglu: hidden size": ("raise", "gate_proj expects inputs of size 64, got 32"),
    "moe.expert_swiglu: N*k": ("raise", "x [N=4, D] does not match groups of 6 assignments"),
    "moe.expert_swiglu: groups a tuple": ("raise", "groups must be an ExpertGroups"),
    "moe.expert_swiglu: groups out of range": ("raise", "groups' values are out of range"),
    "moe.expert_swiglu: gate_proj a Linear": ("raise", "gate_proj must be a SwitchLinear or QuantizedSwitchLinear"),
    "moe.expert_swiglu: up_proj with fewer experts": ("raise", "up_proj must hold the 4 experts of gate_proj, got 2"),
    "moe.expert_swiglu: up_proj with fewer experts, unchecked": ("raise", "up_proj must hold the 4 experts"),
    "moe.expert_swiglu: down_proj with fewer experts": ("raise", "down_proj must hold the 4 experts of gate_proj"),
    "moe.expert_swiglu: up_proj width": ("raise", "up_proj must have gate_proj's output size 32, got 16"),
    "moe.combine: scores shape": ("raise", "scores must have shape (3, 2)"),
    "moe.combine: expert_out a list": ("raise", "expert_out must be a float mx.array of shape [..., k, D], got list"),
    "moe.combine: expert_out rank 1": ("raise", "expert_out must be a float mx.array of shape [..., k, D]"),
    "moe.combine: dtype a str": ("raise", "dtype must be None or a float mlx dtype"),
    "moe.combine: scores int32": ("raise", "scores must be a float mx.array"),
    "moe.shared_expert: hidden size": ("raise", "x must be a float32/float16/bfloat16 mx.array of shape [..., 256]"),
    "moe.shared_expert: block a Linear": ("raise", "block must be a Qwen3NextSparseMoeBlock"),
    "moe.shared_expert: x int32": ("raise", "x must be a float32/float16/bfloat16 mx.array"),
    "moe.sparse_moe_block: hidden size": ("raise", "x must be a float32/float16/bfloat16 mx.array of shape [..., 256]"),
    "moe.sparse_moe_block: x rank 1": ("raise", "x must be a float32/float16/bfloat16 mx.array"),
    "moe.sparse_moe_block: block a Linear": ("raise", "block must be a Qwen3NextSparseMoeBlock"),
    "moe.sparse_moe: implementation cuda-kernel": ("raise", "implementation must be one of"),
    "moe.sparse_moe: implementation a list": ("raise", "implementation must be one of"),
    "moe.sparse_moe: block a Linear": ("raise", "block must be a Qwen3NextSparseMoeBlock"),
    "moe.sparse_moe: hidden size": ("raise", "x must be a float32/float16/bfloat16 mx.array of shape [..., 256]"),
    "moe.moe_decode: hidden size": ("raise", "x must be"),
    "moe.moe_decode: x float32": ("raise", "x must be bfloat16"),
    "moe.moe_decode: 9 tokens": ("raise", "x must be bfloat16 with 1..4 tokens"),
    "moe.quantization_problem: bits an int": ("raise", "bits must be a tuple of ints"),
    "moe.decide_kernels: block an int": ("raise", "block must be a Qwen3NextSparseMoeBlock (an mlx.nn.Module), got int"),
    "moe.decide_kernels: block None": ("raise", "block must be a Qwen3NextSparseMoeBlock"),
    "linear.decode_linear: x's K": ("raise", "x must have shape [..., 128] (the layer's input size)"),
    "linear.decode_linear: dense x's K": ("raise", "x must have shape [..., 128] (the layer's input size)"),
    "linear.decode_linear: x int32": ("raise", "x must be a float32/float16/bfloat16 mx.array [..., 128]"),
    "linear.decode_linear: static unknown": ("raise", "static must be linear_arrays' settings"),
    "linear.decode_linear: static short": ("raise", "static must be linear_arrays' settings"),
    "linear.decode_linear: arrays short": ("raise", "arrays must be 3 mx.arrays"),
    "linear.decode_linear: arrays of floats": ("raise", "arrays must be 3 mx.arrays"),
    "linear.decode_linear: residual's rows": ("raise", "residual must be None or an mx.array of shape [1, 1, 32]"),
    "linear.decode_linear: residual's width": ("raise", "residual must be None or an mx.array of shape [1, 1, 32]"),
    "linear.decode_linear: norm weight size": ("raise", "norm's weight must be a float mx.array of shape [128]"),
    "linear.decode_linear: norm eps -1": ("raise", "norm's eps must be a finite float in (0, 1)"),
    "linear.decode_linear: norm not a pair": ("raise", "norm must be None or (weight [128], eps)"),
    "linear.decode_linear: normed_out without norm": ("raise", "normed_out needs norm"),
    "linear.decode_linear_reference: x's K": ("raise", "x must have shape [..., 128]"),
    "linear.decode_linear_reference: residual's rows": ("raise", "residual must be None or an mx.array of shape"),
    "linear.decode_linear_reference: normed_out without norm": ("raise", "normed_out needs norm"),
    "linear.decode_linear_reference: static unknown": ("raise", "static must be linear_arrays' settings"),
    "linear.add_rms_norm: x int32": ("raise", "x must be a float32/float16/bfloat16 mx.array [..., D]"),
    "linear.prefill_linear: x's K": ("raise", "x must be [..., 128] (the layer's input size)"),
    "linear.prefill_linear: x int32": ("raise", "x must be a float32/float16/bfloat16 mx.array"),
    "linear.prefill_linear: layer not callable": ("raise", "layer must be a module"),
    "linear.prefill_linear_reference: x's K": ("raise", "prefill_linear_reference: x must be [..., 128]"),
    "linear.add_rms_norm: x 0-d": ("raise", "x must be a float32/float16/bfloat16 mx.array [..., D]"),
    "linear.add_rms_norm: y's shape": ("raise", "y must be an mx.array of x's shape and dtype"),
    "linear.add_rms_norm: y's dtype": ("raise", "y must be an mx.array of x's shape and dtype"),
    "linear.add_rms_norm: weight's size": ("raise", "weight must be a float32/float16/bfloat16 mx.array of shape [64]"),
    "linear.add_rms_norm: weight a list": ("raise", "weight must be a float32/float16/bfloat16 mx.array of shape [64]"),
    "linear.add_rms_norm: eps 0": ("raise", "eps must be a finite float in (0, 1)"),
    "linear.add_rms_norm_reference: y's shape": ("raise", "y must be an mx.array of x's shape and dtype"),
    "linear.add_rms_norm_reference: eps a str": ("raise", "eps must be a finite float in (0, 1)"),
    "verify.verify_attention: hidden size": ("raise", "x must have shape [B, S, 256]"),
    "verify.verify_attention: x rank 2": ("raise", "x must be a float32/float16/bfloat16 mx.array [B, S, 256]"),
    "verify.verify_attention: keys' heads": ("raise", "keys must be mlx.core.float32 of shape [1, 2, capacity >= 2, 64]"),
    "verify.verify_attention: keys' head_dim": ("raise", "keys must be mlx.core.float32 of shape [1, 2, capacity >= 2, 64]"),
    "verify.verify_attention: capacity 1 < S": ("raise", "keys must be mlx.core.float32 of shape [1, 2, capacity >= 2, 64]"),
    "verify.verify_attention: values shape": ("raise", "values must be mlx.core.float32 of the shape of keys"),
    "verify.verify_attention: keys bfloat16": ("raise", "keys must be mlx.core.float32"),
    "verify.verify_attention: offset an int": ("raise", "offset must be a 0-d int32 mx.array"),
    "verify.verify_attention: offset float": ("raise", "offset must be a 0-d int32 mx.array"),
    "verify.verify_attention: attn a Linear": ("raise", "attn must be an mlx-lm Qwen3NextAttention"),
    "attention.gated_attention: attn a Linear": ("raise", "gated_attention: attn must be an mlx-lm Qwen3NextAttention"),
    "attention.gated_attention: hidden size": ("raise", "gated_attention: x must have shape [B, T, 256]"),
    "attention.gated_attention: x rank 2": ("raise", "gated_attention: x must be a float32/float16/bfloat16"),
    "attention.gated_attention: no tokens": ("raise", "x must hold at least one row and one token ([B >= 1, T >= 1, 256])"),
    "attention.gated_attention: no rows": ("raise", "x must hold at least one row and one token ([B >= 1, T >= 1, 256])"),
    "attention.decode_step_parts: attn an int": ("raise", "decode_step_parts: attn must be an mlx-lm Qwen3NextAttention"),
    "verify.verify_attention: offset 1000": ("return", "clamped"),
    "verify.verify_attention: offset -5": ("return", "clamped"),
    "verify.verify_model: inputs float": ("raise", "inputs must be integer token ids"),
    "verify.verify_model: model a Linear": ("raise", "model must be an mlx-lm Qwen3_5TextModel"),
    "verify.verify_model: id past the vocabulary": ("return", "clamped"),
    "verify.verify_model: id -5": ("return", "clamped"),
    "verify.verify_model: 1 token": ("return", "NoneType"),  # by contract: the caller runs mlx-lm's loop
    "verify.verify_model: 17 tokens": ("return", "NoneType"),
    "verify.verify_model_hidden: layer_ids empty": ("raise", "layer_ids must be 1 or more distinct layer indices (ints) in [0, 8)"),
    "verify.verify_model_hidden: layer 100 of 8": ("raise", "layer_ids must be 1 or more distinct layer indices (ints) in [0, 8)"),
    "verify.verify_model_hidden: layer 1.5": ("raise", "layer_ids must be 1 or more distinct layer indices (ints)"),
    "verify.verify_model_hidden: layer_ids a str": ("raise", "layer_ids must be 1 or more distinct layer indices (ints)"),
    "verify.verify_model_hidden: layer_ids an int": ("raise", "layer_ids must be 1 or more distinct layer indices (ints)"),
    "verify.verify_model_hidden: layer True": ("raise", "layer_ids must be 1 or more distinct layer indices (ints)"),
    "verify.verify_model_hidden: layer_ids repeated": ("raise", "layer_ids must be 1 or more distinct layer indices (ints) in [0, 8), got [1, 1]"),
    "verify.verify_model_hidden: inputs float": ("raise", "inputs must be integer token ids"),
}

#: The ops modules whose public names (``__all__``) the cases must cover:
#: module -> {name: why it has no case}. (``ops.decoder`` is not walked yet.)
_EXEMPT = {
    "attention": {
        "IMPLEMENTATIONS": "constant",
        "decode_implementation": "query: names the implementation decode_attention would run (shape checks only)",
        "prefill_implementation": "query: names the implementation prefill_attention would run (shape checks only)",
        "DecodeStatic": "a NamedTuple type: decode_step_parts builds it from a checked module",
        "DecodeStepParts": "a NamedTuple type: decode_step_parts' result",
        "decode_step": "traced inside the compiled decode steps on a plan decode_step_parts made (unchecked by contract)",
        "implementation_for": "query: the implementation for a token count and backend",
        "prefill_attention_reference": "unchecked reference of prefill_attention (which checks); not checked itself yet",
    },
    "gated_delta": {
        "IMPLEMENTATIONS": "constant",
        "RECURRENT_MAX_T": "constant",
        "CHUNK_SIZE": "constant",
        "DEFAULT_CHUNK_SIZE": "constant",
        "decide_kernels": "query: {} for every layer (the GDN kernels decline no quantisation)",
    },
    "moe": {
        "IMPLEMENTATIONS": "constant",
        "KERNEL_QUANTIZATION": "constant",
        "ExpertGroups": "a NamedTuple type: block_map and expert_swiglu check the groups they are given",
        "implementation_for": "query: the implementation for a token count and backend",
        "block_takes_weights": "query: False for anything that is not a block in the kernel's format",
        "kernel_problems": "query: the reasons the kernels decline any object (read with getattr)",
    },
    "linear": {
        "ADD_NORM_IMPLEMENTATIONS": "constant",
        "IMPLEMENTATIONS": "constant",
        "add_rms_norm_implementation": "query: names the implementation add_rms_norm would run (which checks)",
        "decode_implementation": "query: names the implementation decode_linear would run (which checks)",
        "decode_linear_unchecked": "unchecked by contract: the hot entry for arguments a checked call had (FastHead)",
        "implementation_for": "query: the implementation for a token count and backend",
        "PREFILL_GEMM_MIN_FEATURES": "constant",
        "PREFILL_GEMM_MIN_ROWS": "constant",
        "prefill_implementation": "query: names the implementation prefill_linear would run (which checks)",
        "prefill_implementation_for": "query: the implementation for a token count and backend",
    },
    "verify": {
        "MIN_TOKENS": "constant",
        "MAX_TOKENS": "constant",
        "step_count": "takes no arguments",
        "trace_count": "takes no arguments",
        "verify_step": "a route: returns None or verify_model's result (verify_model checks; its cases)",
    },
}


def _missing(modules, cases, exempt):
    """``module.name`` of every name in a module's ``__all__`` with neither a
    case (named ``"module.name: ..."``) nor an exemption; and the cases and
    exemptions that name nothing public (stale entries)."""
    covered = {case.split(":", 1)[0] for case in cases}
    missing, stale = [], []
    for mod_name, module in modules.items():
        public = set(module.__all__)
        for name in module.__all__:
            if f"{mod_name}.{name}" not in covered and name not in exempt.get(mod_name, {}):
                missing.append(f"{mod_name}.{name}")
        stale += [f"{mod_name}.{name} (exempt)" for name in exempt.get(mod_name, {}) if name not in public]
    for entry in sorted(covered):
        mod_name, _, name = entry.partition(".")
        if mod_name not in modules or not callable(getattr(modules[mod_name], name, None)):
            stale.append(f"{entry} (case)")
    return missing, stale


@pytest.fixture(scope="module")
def results():
    """Every case's outcome, from one subprocess (a case that kills it is
    found by the line it started without finishing; the rest rerun)."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    todo, out = list(_CASES), {}
    while todo:
        r = subprocess.run([sys.executable, "-c", _SCRIPT, *todo], capture_output=True, text=True, env=env,
                           timeout=600)
        lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
        done = {d["case"]: d for d in lines if "start" not in d}
        out.update(done)
        started = [d["case"] for d in lines if "start" in d]
        crashed = [c for c in started if c not in done]
        for c in crashed:  # the process died in this case: its exit code and the end of stderr
            out[c] = {"case": c, "died": r.returncode, "stderr": r.stderr[-2000:]}
        todo = [c for c in todo if c not in out]
        if todo and not crashed:
            raise AssertionError(f"the case script stopped before {todo}: rc {r.returncode}\n{r.stderr[-4000:]}")
    return out


@pytest.mark.parametrize("case", list(_CASES))
def test_bad_argument(results, case):
    kind, want = _CASES[case]
    got = results[case]
    assert "died" not in got, f"the process died (exit code {got.get('died')}): {got.get('stderr')}"
    if kind == "raise":
        function = case.split(":", 1)[0].split(".", 1)[1]
        assert got.get("raised") == "ValueError", got
        assert got["message"].startswith(f"{function}: "), got
        assert want in got["message"], got
        assert "\n" not in got["message"]
    else:
        assert got.get("returned") == want, got


def test_every_public_op_has_a_case():
    """Every name in the ``__all__`` of the walked ops modules has a case
    above or an exemption with its one-line reason; no entry is stale."""
    modules = {name: importlib.import_module(f"mlx_qwen_fast.ops.{name}") for name in _EXEMPT}
    missing, stale = _missing(modules, _CASES, _EXEMPT)
    assert not missing, f"public ops without a bad-argument case or an exemption in _EXEMPT: {missing}"
    assert not stale, f"cases or exemptions naming nothing public: {stale}"
    for mod_name, table in _EXEMPT.items():
        for name, why in table.items():
            assert why.strip() and "\n" not in why, f"{mod_name}.{name}: the exemption needs a one-line reason"


def test_the_coverage_check_can_fail():
    """Guard of the structural test: a public function with no case, an
    exemption of a name not public and a case of a missing function are
    all reported."""
    fake = types.ModuleType("fake")
    fake.__all__ = ["covered", "uncovered", "CONST"]
    fake.covered = fake.uncovered = lambda: None
    fake.CONST = 1
    missing, stale = _missing({"fake": fake}, {"fake.covered: x": None, "fake.gone: y": None},
                              {"fake": {"CONST": "constant", "old": "removed"}})
    assert missing == ["fake.uncovered"]
    assert sorted(stale) == ["fake.gone (case)", "fake.old (exempt)"]
