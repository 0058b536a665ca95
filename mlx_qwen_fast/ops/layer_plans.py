"""One decoder layer's decode step (one token per row) as one
``mx.compile``d call: the layer plans (:class:`LinearStepPlan`,
:class:`AttentionStepPlan`: named fields) and :func:`decode_layer`. Which
route a token takes is :mod:`mlx_qwen_fast.ops.decoder`'s decision; this
module is the layer step it reaches.

Each step's kernels are chosen by its op family when the step is planned
(``decode_step_parts`` of each family) and baked into the compiled step
that the layer's plan holds.

Contract: :func:`decode_layer` computes what mlx-lm's
``qwen3_5.DecoderLayer.__call__`` computes for ``x`` of shape ``[B, 1, D]``
with no mask -- ``h = x + mixer(input_layernorm(x)); out = h +
mlp(post_attention_layernorm(h))`` -- and advances the layer's cache by one
position, as the stock layer does. The reference is that stock call
(:func:`decode_layer_reference`).

Why: a patched decode token is host-bound. Its graph holds ~785 nodes
(bench/results/INDEX.md, "nodes"), 44 of them in each gated-attention
layer, and the Python that builds them runs once per layer per token; a
layer whose whole step is one compiled call pays that Python once per input
signature and replays the traced graph from C++ afterwards
(:mod:`mlx_qwen_fast.compiled`'s rules: every array is an input).

Per layer kind:

* Gated DeltaNet layer: both RMSNorms, the layer's decode step
  (:func:`mlx_qwen_fast.ops.gated_delta.decode_step_parts`: packed input
  projection, decode kernel, ``out_proj``; with
  :data:`mlx_qwen_fast.config.GDN_MIXER_KERNEL` these with the input norm
  and the residual as one launch), the residuals and the MoE block's decode
  step (:func:`mlx_qwen_fast.ops.moe.decode_step_parts`). Where both parts
  are one launch each (the mixer and the one-launch MoE block), with
  :data:`mlx_qwen_fast.config.GDN_LAYER_KERNEL` the whole layer is one
  launch (:func:`mlx_qwen_fast.kernels.gdn_layer_decode.gdn_layer_decode`:
  the two launches' results bit for bit).
* Gated attention layer (mlx-lm's ``Qwen3NextAttention``): RMSNorm, one
  quantised matmul over the concatenated q|k|v projections, then
  :func:`mlx_qwen_fast.ops.attention.decode_attention` (through
  :func:`mlx_qwen_fast.ops.attention.decode_step`; q/k RMSNorm, RoPE at
  the cache offset -- passed as an array, so one trace serves every
  position --, the new K/V row written into the cache's buffers in place:
  at the offset (``kernels._cache_rows``), the buffers donated; attention over
  the buffer up to the offset; the sigmoid output gate: on CUDA at head_dim
  256 its kernels, on Metal with :data:`mlx_qwen_fast.config.METAL_KERNELS`
  on its Metal kernels, else MLX's ops with the positions past the offset
  masked), ``o_proj``, the residual, then the MoE step as above; where the
  MoE block has no decode step (CPU, Metal) the step ends at the residual,
  and on Metal with :data:`mlx_qwen_fast.config.METAL_KERNELS` on it hands
  the post-attention RMSNorm's rows on too, the residual add and that norm
  as one kernel (:func:`mlx_qwen_fast.ops.linear.add_rms_norm`). The trace
  depends on the buffer's capacity, which grows to multiples of
  :data:`mlx_qwen_fast.ops.kv_buffers.KV_GROWTH` positions (mlx-lm grows by
  256), not on the offset.

Where a part has no decode step (a CPU or Metal backend, a LoRA-wrapped or
sharded module, a cache other than mlx-lm's plain ``KVCache`` /
``ArraysCache``, batched prompts with per-row lengths, a quantised KV
cache), that part runs as the stock layer runs it: the attention step
without the MoE, or the whole stock layer (None from :func:`decode_layer`).
"""

from __future__ import annotations

from typing import Callable, Dict, NamedTuple, Optional, Tuple, Union

import mlx.core as mx

from .. import config
from ..compiled import StepPlans
from ..kernels import gdn_layer_decode as gdn_layer_kernel
from . import _launch_order
from . import attention as attention_ops
from . import gated_delta as gated_delta_ops
from . import kv_buffers
from . import linear as linear_ops
from . import moe as moe_ops

__all__ = ["AttentionStepPlan", "LayerEntry", "LinearStepPlan", "decode_layer", "decode_layer_reference",
           "layer_entry", "takes"]


def decode_layer_reference(layer, x: mx.array, cache) -> mx.array:
    """mlx-lm's ``DecoderLayer.__call__(x, None, cache)`` (the stock layer,
    its modules as they are: fast or stock)."""
    from mlx_lm.models.qwen3_5 import DecoderLayer

    return DecoderLayer.__call__(layer, x, None, cache)


def _arrays_cache_type():
    from mlx_lm.models.cache import ArraysCache

    return ArraysCache


# ---------------------------------------------------------------------------
# the layer plans and their compiled steps
# ---------------------------------------------------------------------------

_NORMS = (("input_layernorm", "weight"), ("post_attention_layernorm", "weight"))
_steps: Dict[tuple, Callable] = {}


def _prefixed(prefix: str, paths) -> Tuple[Tuple[str, ...], ...]:
    return tuple((prefix,) + tuple(p) for p in paths)


def _moe_parts(layer, x):
    """``(paths under the layer, compiled MoE step)`` or None; the step takes
    ``(h, post_attention_layernorm weight, *arrays)`` and returns
    ``h + mlp(post_attention_layernorm(h))``."""
    parts = moe_ops.decode_step_parts(layer.mlp, x, norm_eps=layer.post_attention_layernorm.eps)
    if parts is None:
        return None
    paths, fn = parts
    return _prefixed("mlp", paths), fn


class LinearStepPlan(NamedTuple):
    """A Gated DeltaNet layer's compiled decode step, as planned for one
    input signature (kept by :class:`StepPlans` with the arrays it reads)."""

    kind: str  # "linear"
    #: ``fn(x, conv_state, state, *arrays[:n_in], *extra) -> (out, conv_state, state)``, compiled
    fn: Callable
    #: arrays the plan made (the concatenated input projection, packed constants)
    extra: Tuple[mx.array, ...]
    #: how many of the arrays at the plan's paths the step reads (the rest decide the plan)
    n_in: int
    #: ``fn`` before ``mx.compile`` (traced inside the whole-stack step)
    raw: Callable


class AttentionStepPlan(NamedTuple):
    """A gated-attention layer's compiled decode step, as planned for one
    input signature (kept by :class:`StepPlans` with the arrays it reads)."""

    kind: str  # "attention"
    #: ``fn(x, keys, values, offset, *arrays[:n_in], *extra) -> (out, keys, values[, normed])``, compiled
    fn: Callable
    #: the concatenated q|k|v arrays
    extra: Tuple[mx.array, ...]
    #: how many of the arrays at the plan's paths the step reads (the rest decide the plan)
    n_in: int
    #: whether the step includes the MoE block (else the caller runs the layer's ``mlp``)
    has_moe: bool
    #: whether ``fn`` also returns ``post_attention_layernorm(out)`` (the residual add
    #: fused with that norm: :func:`mlx_qwen_fast.ops.linear.add_rms_norm`), for the
    #: caller's ``mlp``; only without the MoE block
    normed: bool
    #: the KV cache's heads and head size the step writes
    kv_heads: int
    head_dim: int
    #: ``fn`` before ``mx.compile`` (traced inside the whole-stack step)
    raw: Callable


LayerStepPlan = Union[LinearStepPlan, AttentionStepPlan]


def _block_arrays(m, blk) -> tuple:
    """The one-launch MoE block's array arguments (router, experts, shared,
    expert gate) from its step's arrays ``m``
    (:func:`mlx_qwen_fast.ops.moe.decode_step_parts`' order)."""
    r = blk.n_router
    return (m[:r], (m[r:r + 3], m[r + 3:r + 6], m[r + 6:r + 9]), (m[r + 9:r + 12], m[r + 12:r + 15], m[r + 15:r + 18]),
            (m[r + 18], m[r + 19], m[r + 20], blk.shared_gate_bits))


def _linear_plan(layer, x, cache):
    children = [("linear_attn",), ("mlp",), ("input_layernorm",), ("post_attention_layernorm",)]
    gdn = gated_delta_ops.decode_step_parts(layer.linear_attn, x, cache,
                                            input_norm_eps=layer.input_layernorm.eps,
                                            input_norm_weight=layer.input_layernorm.weight)
    moe = _moe_parts(layer, x)
    if gdn is None or moe is None:
        return children, None
    g_paths, g_fn, g_used, g_extra = gdn
    m_paths, m_fn = moe
    eps = _norm_eps(layer)
    n_m = len(m_paths)
    mix, blk = gated_delta_ops.mixer_step_settings(g_fn), moe_ops.block_step_settings(m_fn)
    one_launch = config.GDN_LAYER_KERNEL.get() and mix is not None and blk is not None
    key = ("linear", g_fn, m_fn, eps, g_used, n_m, len(g_extra), one_launch)
    fn = _steps.get(key)
    if fn is None and one_launch:

        def step(x, conv_state, state, *flat):  # flat: norms, out_proj, MoE arrays, params, in_proj
            m = flat[2 + g_used:2 + g_used + n_m]
            ge = flat[2 + g_used + n_m:]
            return gdn_layer_kernel.gdn_layer_decode(
                x, ge[1:], ge[0], conv_state, state, flat[2:2 + g_used], flat[1], *_block_arrays(m, blk),
                num_k_heads=mix.num_k_heads,
                num_v_heads=mix.num_v_heads, input_norm_eps=mix.input_norm_eps, norm_eps=mix.norm_eps,
                top_k=blk.top_k, post_norm_eps=blk.norm_eps, normalize=blk.normalize,
                router_group_size=blk.router_group_size, router_bits=blk.router_bits, after=_launch_order.take())

        fn = _steps[key] = (mx.compile(step), step)
    if fn is None:

        def step(x, conv_state, state, *flat):  # flat: norms, GDN arrays read, MoE arrays, GDN extra
            n1, n2 = flat[0], flat[1]
            g = flat[2:2 + g_used]
            m = flat[2 + g_used:2 + g_used + n_m]
            ge = flat[2 + g_used + n_m:]
            h, conv_state, state = g_fn(x, conv_state, state, n1, *g, *ge)  # x + mixer(norm(x))
            return m_fn(h, n2, *m), conv_state, state  # h + mlp(norm(h))

        fn = _steps[key] = (mx.compile(step), step)
    # the arrays the step reads first; the rest only decide whether the plan still holds
    g_paths = _prefixed("linear_attn", g_paths)
    paths = _NORMS + g_paths[:g_used] + m_paths + g_paths[g_used:]
    return paths, LinearStepPlan("linear", fn[0], g_extra, 2 + g_used + n_m, fn[1])


def _attention_plan(layer, x, cache):
    children = [("self_attn",), ("mlp",), ("input_layernorm",), ("post_attention_layernorm",)]
    attn = attention_ops.decode_step_parts(layer.self_attn)
    if attn is None:
        return children, None
    a_paths, a_extra, a_static = attn
    moe = _moe_parts(layer, x)
    m_paths, m_fn = moe if moe is not None else ((), None)
    eps = _norm_eps(layer)
    n_m, n_o = len(m_paths), a_static.o_proj[0]
    n_read = 2 + n_o  # q/k norm weights and o_proj's arrays; the q/k/v sources only decide the plan
    # without the MoE step, the post-attention norm joins the residual add where that runs as a kernel
    normed = m_fn is None and linear_ops.add_rms_norm_implementation(
        x, x, layer.post_attention_layernorm.weight) != "reference"
    # the attention kernels' switches are read while tracing: a trace per value
    key = ("attention", a_static, m_fn, eps, n_m, len(a_extra), config.ATTENTION_DECODE_KERNEL.get(),
           config.METAL_KERNELS.get(), config.DECODE_GEMV_KERNEL.get(), normed)
    fn = _steps.get(key)
    if fn is None:

        def step(x, keys, values, offset, *flat):  # flat: norms, q/k norms, o_proj, MoE arrays, q|k|v
            n1, n2 = flat[0], flat[1]
            qn_w, kn_w = flat[2], flat[3]
            o = flat[4:4 + n_o]
            m = flat[2 + n_read:2 + n_read + n_m]
            qkv = flat[2 + n_read + n_m:]
            h, keys, values = attention_ops.decode_step(a_static, x, (n1, eps[0]), keys, values, offset, qn_w,
                                                        kn_w, tuple(o) + tuple(qkv), residual=not normed)
            if normed:
                h, rows = _add_norm(x, h, n2, eps[1])
                return h, keys, values, rows
            if m_fn is None:
                return h, keys, values
            return m_fn(h, n2, *m), keys, values

        fn = _steps[key] = (mx.compile(step), step)
    a_paths = _prefixed("self_attn", a_paths)
    paths = _NORMS + a_paths[:n_read] + m_paths + a_paths[n_read:]
    return paths, AttentionStepPlan("attention", fn[0], a_extra, 2 + n_read + n_m, m_fn is not None,
                                    normed, a_static.num_kv_heads, a_static.head_dim, fn[1])


def _add_norm(x, y, weight, eps):
    """``(x + y, rms_norm(x + y, weight, eps))`` inside a traced step:
    :func:`mlx_qwen_fast.ops.linear.add_rms_norm` where ``y`` (``o_proj``'s
    output) has x's dtype, else the stock ops (MLX's add promotes, as the
    stock layer's does)."""
    if y.dtype == x.dtype:
        return linear_ops.add_rms_norm(x, y, weight, eps)
    h = x + y
    return h, mx.fast.rms_norm(h, weight, eps)


def _norm_eps(layer) -> tuple:
    return (layer.input_layernorm.eps, layer.post_attention_layernorm.eps)


class LayerEntry(NamedTuple):
    """A layer's planned step: its :class:`StepPlans` key (what the trace
    bakes in), the objects at the plan's paths (the arrays the step reads
    first), the plan."""

    key: tuple
    arrays: tuple
    plan: LayerStepPlan


def layer_entry(layer, x: mx.array, cache) -> Optional[LayerEntry]:
    """The :class:`LayerEntry` of the layer's compiled step for ``x`` and
    ``cache``, or None where the step does not apply. Reads the cache, never
    changes it."""
    if layer.is_linear:
        if type(cache) is not _arrays_cache_type() or cache.lengths is not None or cache[0] is None \
                or cache[1] is None:
            return None
        key = ("linear", tuple(x.shape), x.dtype, cache[0].dtype, cache[1].dtype, _norm_eps(layer),
               config.DECODE_GEMV_KERNEL.get(), config.GDN_MIXER_KERNEL.get(), config.MOE_BLOCK_KERNEL.get(),
               config.GDN_LAYER_KERNEL.get())
        arrays, plan = StepPlans.of(layer).get(key, layer, lambda: _linear_plan(layer, x, cache))
    else:
        if type(cache) is not kv_buffers.kv_cache_type() or cache.keys is None:
            return None
        attn = layer.self_attn
        # the settings the trace bakes in that are not arrays: a replaced RoPE or
        # a changed scale or eps makes a new plan
        key = ("attention", tuple(x.shape), x.dtype, cache.keys.dtype, _norm_eps(layer), id(attn.rope),
               attn.scale, attn.q_norm.eps, attn.k_norm.eps, config.ATTENTION_DECODE_KERNEL.get(),
               config.METAL_KERNELS.get(), config.DECODE_GEMV_KERNEL.get(), config.MOE_BLOCK_KERNEL.get())
        arrays, plan = StepPlans.of(layer).get(key, layer, lambda: _attention_plan(layer, x, cache))
    return None if plan is None else LayerEntry(key, arrays, plan)


def takes(x) -> bool:
    """Whether ``x`` has a decode step's shape: an array ``[B, 1, D]``, B > 0."""
    return isinstance(x, mx.array) and x.ndim == 3 and x.shape[1] == 1 and x.shape[0] > 0


def decode_layer(layer, x: mx.array, cache) -> Optional[mx.array]:
    """The decode step of mlx-lm's ``qwen3_5.DecoderLayer`` as one compiled
    call (see this module's docstring); None where it does not apply, before
    touching the cache (the caller runs the stock layer).

    Args:
        layer: an mlx-lm ``qwen3_5.DecoderLayer`` with a sparse MoE block.
        x: ``[B, 1, D]`` hidden states (bf16 or fp32), evaluated or not.
        cache: the layer's mlx-lm cache: ``ArraysCache`` (conv and recurrent
            state) for a Gated DeltaNet layer, ``KVCache`` for an attention
            layer; updated in place and advanced by one position.

    Returns:
        ``[B, 1, D]``, as ``DecoderLayer.__call__(x, None, cache)``; or None.
    """
    if cache is None or not takes(x):
        return None
    entry = layer_entry(layer, x, cache)
    if entry is None:
        return None
    arrays, plan = entry.arrays, entry.plan
    if plan.kind == "linear":
        out, conv_state, state = plan.fn(x, cache[0], cache[1], *arrays[:plan.n_in], *plan.extra)
        cache[0] = conv_state
        cache[1] = state
        cache.advance(1)
        return out
    if not kv_buffers.make_room(cache, x.dtype, x.shape[0], plan.kv_heads, plan.head_dim):
        return None
    keys, values = cache.keys, cache.values
    cache.keys = cache.values = None  # the step's inputs alone hold the buffers: they are donated
    try:
        out, keys, values, *normed = plan.fn(x, keys, values, mx.array(cache.offset, mx.int32),
                                             *arrays[:plan.n_in], *plan.extra)
    finally:
        cache.keys, cache.values = keys, values
    cache.offset += 1
    if not plan.has_moe:
        out = out + layer.mlp(normed[0] if plan.normed else layer.post_attention_layernorm(out))
    return out
