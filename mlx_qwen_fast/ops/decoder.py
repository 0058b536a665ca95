"""The decode planner, and one decoder layer's decode step (one token per
row) as one ``mx.compile``d call.

Which route a decode token takes is decided here alone, from the switches
(:mod:`mlx_qwen_fast.config`, read per call): the whole layer stack as one
compiled call (:func:`model_step` -> :func:`decode_model`), else each layer
as one (:func:`layer_step` -> :func:`decode_layer`), else each module's own
dispatch entry (:func:`mlx_qwen_fast.ops.gated_delta.gated_delta_net`,
:func:`mlx_qwen_fast.ops.moe.sparse_moe`,
:func:`mlx_qwen_fast.ops.attention.gated_attention`), else stock. Each
step's kernels are chosen by its op family when the step is planned
(``decode_step_parts`` of each family) and baked into the compiled step
that the layer's plan holds (:class:`LinearStepPlan`,
:class:`AttentionStepPlan`: named fields).
:func:`decode_routes` names the routes and kernels for the patch report
(:func:`mlx_qwen_fast.patching.op_implementations`) from the same switches
and the families' dispatchers.

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
  step (:func:`mlx_qwen_fast.ops.moe.decode_step_parts`).
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
  masked), ``o_proj``, the residual, then the MoE step as above. The trace
  depends on the buffer's capacity, which grows to multiples of
  :data:`KV_GROWTH` positions (mlx-lm grows by 256), not on the offset.

Where a part has no decode step (a CPU or Metal backend, a LoRA-wrapped or
sharded module, a cache other than mlx-lm's plain ``KVCache`` /
``ArraysCache``, batched prompts with per-row lengths, a quantised KV
cache), that part runs as the stock layer runs it: the attention step
without the MoE, or the whole stock layer (None from :func:`decode_layer`).
"""

from __future__ import annotations

import operator
import weakref
from typing import Callable, Dict, NamedTuple, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from .. import backend as _backend
from .. import config
from ..compiled import StepPlans
from . import attention as attention_ops
from . import gated_delta as gated_delta_ops
from . import linear as linear_ops
from . import moe as moe_ops

__all__ = ["AttentionStepPlan", "DecodeRoutes", "LinearStepPlan", "decode_layer", "decode_layer_reference",
           "decode_model", "decode_routes", "layer_step", "model_step", "reserve_kv"]


def decode_layer_reference(layer, x: mx.array, cache) -> mx.array:
    """mlx-lm's ``DecoderLayer.__call__(x, None, cache)`` (the stock layer,
    its modules as they are: fast or stock)."""
    from mlx_lm.models.qwen3_5 import DecoderLayer

    return DecoderLayer.__call__(layer, x, None, cache)


def _kv_cache_type():
    from mlx_lm.models.cache import KVCache

    return KVCache


def _arrays_cache_type():
    from mlx_lm.models.cache import ArraysCache

    return ArraysCache


# ---------------------------------------------------------------------------
# KV buffers
# ---------------------------------------------------------------------------

#: Positions a KV buffer grows to a multiple of when the decode step needs
#: room (mlx-lm grows by ``KVCache.step``, 256). The compiled step traces
#: again for every new buffer shape (a whole-stack trace: one slow token,
#: bench.decode_split --boundary), so growing in larger steps makes that
#: token 16 times rarer, for at most 4095 spare positions per attention
#: layer (20 KB a position at the reference model's 2 KV heads of 256 in
#: bf16: 80 MB over its 10 layers at batch 1).
KV_GROWTH = 4096

#: Most positions past a cache's offset that a reservation
#: (:func:`reserve_kv`) adds at once: 32768 positions are ~650 MB over the
#: reference model's 10 attention layers at batch 1 (20 KB a position).
KV_RESERVE_MAX = 32768

_RESERVE_ATTR = "_mqf_kv_reserve"  # a KVCache's reserved capacity (positions), set by reserve_kv


def _grow(cache, want: int, dtype) -> None:
    """Grow ``cache``'s buffers (``[B, Hkv, capacity, Dh]``, capacity <
    ``want``) to the next multiple of ``max(KV_GROWTH, cache.step)``
    positions at or above ``want``, as ``KVCache.update_and_fetch`` (mlx-lm
    0.32.2) grows them: cut to the offset where the buffer is not full,
    extended with zero rows of ``dtype``."""
    prev, keys = cache.offset, cache.keys
    growth = max(KV_GROWTH, cache.step)
    extra = -(-want // growth) * growth - prev
    B, hkv, _, dh = keys.shape
    new_k = mx.zeros((B, hkv, extra, dh), dtype)
    new_v = mx.zeros((B, hkv, extra, cache.values.shape[3]), dtype)
    if keys.shape[2] != prev:
        cache.keys, cache.values = cache.keys[..., :prev, :], cache.values[..., :prev, :]
    cache.keys = mx.concatenate([cache.keys, new_k], axis=2)
    cache.values = mx.concatenate([cache.values, new_v], axis=2)


def _wanted(cache, n: int = 1) -> int:
    """The capacity a compiled step wants of a KV cache now: ``n`` more
    positions (1 for a decode step), or its reservation (at most
    :data:`KV_RESERVE_MAX` past that)."""
    want = cache.offset + n
    reserved = cache.__dict__.get(_RESERVE_ATTR)
    if type(reserved) is int and reserved > want:
        want = min(reserved, want + KV_RESERVE_MAX)
    return want


def reserve_kv(prompt_cache, positions: int) -> int:
    """Tell the decode step how many positions the plain ``KVCache``
    entries of ``prompt_cache`` will hold, so that it sizes their buffers
    once instead of growing them as the tokens come: the compiled whole-
    stack step traces again for every new buffer shape (a slow token; see
    :data:`KV_GROWTH`), and a buffer sized for the whole generation never
    changes shape within it.

    A cache with buffers grows now (to the next multiple of
    ``max(KV_GROWTH, step)`` at or above ``positions``, at most
    :data:`KV_RESERVE_MAX` past its offset); an empty one keeps the
    number, which the decode step honours when it first plans for it (a
    prefill through mlx-lm's ``update_and_fetch`` still grows it by
    ``step`` as stock does). Other entries (``ArraysCache``,
    ``RotatingKVCache``, quantised caches, ``None``) are left alone.
    mlx-lm's own calls take any capacity (``update_and_fetch``, ``trim``
    and the attention work from the offset; ``state``, and so a saved
    prompt cache, holds the whole buffer).

    Args:
        prompt_cache: a list of mlx-lm cache objects (one per layer).
        positions: the total positions (offset included) the caches will
            hold, e.g. ``offset + prompt tokens + max_tokens``.

    Returns:
        The number of ``KVCache`` entries the reservation applies to.

    Raises:
        ValueError: ``positions`` not an int >= 0, or ``prompt_cache`` not a
            list or tuple.
    """
    if type(positions) is not int or positions < 0:
        raise ValueError(f"reserve_kv: positions must be an int >= 0, got {positions!r}")
    if not isinstance(prompt_cache, (list, tuple)):
        raise ValueError(f"reserve_kv: prompt_cache must be a list of mlx-lm caches, got "
                         f"{type(prompt_cache).__name__}")
    kv_type, n = _kv_cache_type(), 0
    for c in prompt_cache:
        if type(c) is not kv_type:
            continue
        c.__dict__[_RESERVE_ATTR] = positions
        n += 1
        k, v = c.keys, c.values
        if isinstance(k, mx.array) and isinstance(v, mx.array) and k.ndim == 4 and v.ndim == 4:
            want = _wanted(c)
            if want > k.shape[2]:
                _grow(c, want, k.dtype)
    return n


def _room(cache, x_dtype, B: int, hkv: int, dh: int, n: int = 1) -> bool:
    """Make room for ``n`` more positions in a plain ``KVCache`` (and for its
    reservation, :func:`reserve_kv`) as ``KVCache.update_and_fetch``
    (mlx-lm 0.32.2) does, in larger steps (:func:`_grow`): new rows of the
    new rows' dtype, ``x_dtype``, so that a cache of another dtype is
    promoted as stock promotes it. False (nothing changed) where the
    buffers do not match the step's batch, heads or head size."""
    keys = cache.keys
    if keys is None or keys.ndim != 4 or tuple(keys.shape[:2]) != (B, hkv) or keys.shape[3] != dh:
        return False
    if cache.values is None or tuple(cache.values.shape) != tuple(keys.shape):
        return False
    want = _wanted(cache, n)
    if want > keys.shape[2]:
        _grow(cache, want, x_dtype)
    return True


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
    #: ``fn(x, keys, values, offset, *arrays[:n_in], *extra) -> (out, keys, values)``, compiled
    fn: Callable
    #: the concatenated q|k|v arrays
    extra: Tuple[mx.array, ...]
    #: how many of the arrays at the plan's paths the step reads (the rest decide the plan)
    n_in: int
    #: whether the step includes the MoE block (else the caller runs the layer's ``mlp``)
    has_moe: bool
    #: the KV cache's heads and head size the step writes
    kv_heads: int
    head_dim: int
    #: ``fn`` before ``mx.compile`` (traced inside the whole-stack step)
    raw: Callable


LayerStepPlan = Union[LinearStepPlan, AttentionStepPlan]


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
    key = ("linear", g_fn, m_fn, eps, g_used, n_m, len(g_extra))
    fn = _steps.get(key)
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
    # the attention kernels' switches are read while tracing: a trace per value
    key = ("attention", a_static, m_fn, eps, n_m, len(a_extra), config.ATTENTION_DECODE_KERNEL.get(),
           config.METAL_KERNELS.get(), config.DECODE_GEMV_KERNEL.get())
    fn = _steps.get(key)
    if fn is None:

        def step(x, keys, values, offset, *flat):  # flat: norms, q/k norms, o_proj, MoE arrays, q|k|v
            n1, n2 = flat[0], flat[1]
            qn_w, kn_w = flat[2], flat[3]
            o = flat[4:4 + n_o]
            m = flat[2 + n_read:2 + n_read + n_m]
            qkv = flat[2 + n_read + n_m:]
            h, keys, values = attention_ops.decode_step(a_static, x, (n1, eps[0]), keys, values, offset, qn_w,
                                                        kn_w, tuple(o) + tuple(qkv))
            if m_fn is None:
                return h, keys, values
            return m_fn(h, n2, *m), keys, values

        fn = _steps[key] = (mx.compile(step), step)
    a_paths = _prefixed("self_attn", a_paths)
    paths = _NORMS + a_paths[:n_read] + m_paths + a_paths[n_read:]
    return paths, AttentionStepPlan("attention", fn[0], a_extra, 2 + n_read + n_m, m_fn is not None,
                                    a_static.num_kv_heads, a_static.head_dim, fn[1])


def _norm_eps(layer) -> tuple:
    return (layer.input_layernorm.eps, layer.post_attention_layernorm.eps)


class _LayerEntry(NamedTuple):
    """A layer's planned step: its :class:`StepPlans` key (what the trace
    bakes in), the objects at the plan's paths (the arrays the step reads
    first), the plan."""

    key: tuple
    arrays: tuple
    plan: LayerStepPlan


def _layer_entry(layer, x: mx.array, cache) -> Optional[_LayerEntry]:
    """The :class:`_LayerEntry` of the layer's compiled step for ``x`` and
    ``cache``, or None where the step does not apply. Reads the cache, never
    changes it."""
    if layer.is_linear:
        if type(cache) is not _arrays_cache_type() or cache.lengths is not None or cache[0] is None \
                or cache[1] is None:
            return None
        key = ("linear", tuple(x.shape), x.dtype, cache[0].dtype, cache[1].dtype, _norm_eps(layer),
               config.DECODE_GEMV_KERNEL.get(), config.GDN_MIXER_KERNEL.get(), config.MOE_BLOCK_KERNEL.get())
        arrays, plan = StepPlans.of(layer).get(key, layer, lambda: _linear_plan(layer, x, cache))
    else:
        if type(cache) is not _kv_cache_type() or cache.keys is None:
            return None
        attn = layer.self_attn
        # the settings the trace bakes in that are not arrays: a replaced RoPE or
        # a changed scale or eps makes a new plan
        key = ("attention", tuple(x.shape), x.dtype, cache.keys.dtype, _norm_eps(layer), id(attn.rope),
               attn.scale, attn.q_norm.eps, attn.k_norm.eps, config.ATTENTION_DECODE_KERNEL.get(),
               config.METAL_KERNELS.get(), config.DECODE_GEMV_KERNEL.get(), config.MOE_BLOCK_KERNEL.get())
        arrays, plan = StepPlans.of(layer).get(key, layer, lambda: _attention_plan(layer, x, cache))
    return None if plan is None else _LayerEntry(key, arrays, plan)


def _takes(x) -> bool:
    return isinstance(x, mx.array) and x.ndim == 3 and x.shape[1] == 1 and x.shape[0] > 0


def decode_layer(layer, x: mx.array, cache) -> Optional[mx.array]:
    """The decode step of mlx-lm's ``qwen3_5.DecoderLayer`` as one compiled
    call (see the module docstring); None where it does not apply, before
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
    if cache is None or not _takes(x):
        return None
    entry = _layer_entry(layer, x, cache)
    if entry is None:
        return None
    arrays, plan = entry.arrays, entry.plan
    if plan.kind == "linear":
        out, conv_state, state = plan.fn(x, cache[0], cache[1], *arrays[:plan.n_in], *plan.extra)
        cache[0] = conv_state
        cache[1] = state
        cache.advance(1)
        return out
    if not _room(cache, x.dtype, x.shape[0], plan.kv_heads, plan.head_dim):
        return None
    keys, values = cache.keys, cache.values
    cache.keys = cache.values = None  # the step's inputs alone hold the buffers: they are donated
    try:
        out, keys, values = plan.fn(x, keys, values, mx.array(cache.offset, mx.int32), *arrays[:plan.n_in],
                                    *plan.extra)
    finally:
        cache.keys, cache.values = keys, values
    cache.offset += 1
    if not plan.has_moe:
        out = out + layer.mlp(layer.post_attention_layernorm(out))
    return out


def layer_step(layer, x: mx.array, mask=None, cache=None) -> Optional[mx.array]:
    """The route of a fast decoder layer's call
    (:class:`mlx_qwen_fast.layers.FastDecoderLayer`): :func:`decode_layer`
    for a call with a cache and no mask while
    :data:`mlx_qwen_fast.config.DECODE_LAYER_STEP` is on; None otherwise,
    and where :func:`decode_layer` declines (the caller runs mlx-lm's layer,
    whose fast modules take their own dispatch entries).

    Args:
        layer, x, cache: as :func:`decode_layer` (any ``x``: the shape is
            checked there).
        mask: the stock call's mask; not None declines.

    Returns:
        ``[B, 1, D]`` as :func:`decode_layer`, or None.
    """
    if mask is not None or cache is None or not _layer_step_on():
        return None
    return decode_layer(layer, x, cache)


# ---------------------------------------------------------------------------
# the whole model's decode step
# ---------------------------------------------------------------------------

#: Compiled whole-stack steps a model keeps (the newest), each holding its arrays.
_MODEL_STEPS_KEPT = 4


def _model_step(layout: tuple, norm_eps: float, arrays: tuple) -> Callable:
    """The compiled decode step of a whole layer stack: ``fn(h, *states) ->
    (rms_norm(layers(h)), *new states)``; ``layout`` = per layer (kind, raw
    layer step, number of its arrays), ``states`` = per layer its states
    (GDN: conv state, recurrent state; attention: keys, values, offset),
    ``arrays`` = per layer its arrays, then the final norm's weight.

    The arrays are constants of the trace (captured, not inputs): a token's
    call passes only the ~100 states instead of ~1,400 arrays more (MLX
    checks every input of a compiled call, ~0.2 us each on the host). This
    is sound because a plan is used only while every array is the same
    object (:meth:`_ModelPlan.holds`); another array makes another plan and
    another step. One trace per input signature (the KV buffers' capacity
    among it)."""
    def step(h, *states_in):
        s, a, states = 0, 0, []
        for kind, raw, n_args in layout:
            k = 2 if kind == "linear" else 3
            h, *new = raw(h, *states_in[s:s + k], *arrays[a:a + n_args])
            states.extend(new)
            s += k
            a += n_args
        return (mx.fast.rms_norm(h, arrays[a], norm_eps), *states)

    return mx.compile(step)


def _kept_model_step(kept: Dict[tuple, Callable], layout: tuple, norm_eps: float, arrays: tuple) -> Callable:
    """:func:`_model_step` for these arguments from ``kept`` (a model's
    steps, keyed by the layout, the eps and the arrays' identities: a new
    prompt cache or a regrown KV buffer with the same weights reuses the
    step and its traces), made and kept there if missing. Only steps of
    these very arrays stay (at most :data:`_MODEL_STEPS_KEPT`): a step of
    replaced weights would keep them alive."""
    ids = tuple(map(id, arrays))  # every kept step holds its arrays: their ids are not reused
    for stale in [k for k in kept if k[2] != ids]:
        del kept[stale]
    key = (layout, norm_eps, ids)
    fn = kept.pop(key, None)
    if fn is None:
        fn = _model_step(layout, norm_eps, arrays)  # its closure holds the arrays: the ids stay theirs
    kept[key] = fn
    while len(kept) > _MODEL_STEPS_KEPT:
        del kept[next(iter(kept))]
    return fn


_PLAN_ATTR = "_mqf_model_plan"  # the text model's attribute holding its _ModelPlan
_call_ref = weakref.ref.__call__


class _ModelPlan:
    """The whole stack's decode step planned for one model, prompt cache and
    input signature: what :func:`decode_model` would rebuild each token from
    the layers' own plans (their arrays in call order, the compiled step).

    It holds while (checked by :meth:`holds`, no Python loop over the links):
    the model's layers and the cache's entries are the same objects (the
    cache entries through weak references: a dropped cache is not kept
    alive), the embedding's output has the same shape and dtype, the
    switches read while tracing are unchanged, every link (parent, key,
    child) of the layers' plans and of the final norm's weight is the same
    object, each KV cache's buffers keep their shape and dtype with room for
    one more position, and each recurrent state its dtype. Anything else
    (a replaced weight, a new cache, a full KV buffer) plans again from the
    layers' plans, which re-check themselves.
    """

    __slots__ = ("sig", "layers", "cache_refs", "linear", "kv_shapes", "state_dtypes", "parents", "names",
                 "children", "arrays", "fn", "kept")

    def __deepcopy__(self, memo):
        return None  # a copied model plans again (this holds the original's objects)

    def __reduce__(self):
        return (type(None), ())

    def holds(self, model, h: mx.array, cache) -> bool:
        if _model_sig(h) != self.sig:
            return False
        layers = model.layers
        if len(cache) != len(self.cache_refs) or len(layers) != len(self.layers):
            return False
        if not (all(map(operator.is_, layers, self.layers))
                and all(map(operator.is_, map(_call_ref, self.cache_refs), cache))):
            return False
        try:
            if not all(map(operator.is_, map(dict.__getitem__, self.parents, self.names), self.children)):
                return False
        except (KeyError, TypeError):
            return False
        for c, (shape, dtype) in zip((c for c, lin in zip(cache, self.linear) if not lin), self.kv_shapes):
            k, v = c.keys, c.values
            if (k is None or v is None or k.shape != shape or v.shape != shape or k.dtype != dtype
                    or v.dtype != dtype or c.offset + 1 > shape[2]):
                return False
        return all(c.lengths is None and c[0] is not None and c[1] is not None
                   and (c[0].dtype, c[1].dtype) == d
                   for c, d in zip((c for c, lin in zip(cache, self.linear) if lin), self.state_dtypes))


def _model_sig(h: mx.array) -> tuple:
    """What a model plan bakes in besides the layers' plans: the input's
    shape and dtype, the switches the traces read."""
    return (tuple(h.shape), h.dtype, config.DECODE_GEMV_KERNEL.get(), config.ATTENTION_DECODE_KERNEL.get(),
            config.GDN_MIXER_KERNEL.get(), config.MOE_BLOCK_KERNEL.get())


def _plan_model(model, h: mx.array, cache, kept: Optional[Dict[tuple, Callable]] = None) -> Optional[_ModelPlan]:
    """A :class:`_ModelPlan` from every layer's plan (made or checked here),
    or None where a layer does not take its whole step. May grow KV buffers
    (:func:`_room`, as ``KVCache.update_and_fetch`` does before writing, in
    larger steps): invisible to the caller, as stock's growth is."""
    layers = model.layers
    entries = []
    for layer, c in zip(layers, cache):
        entry = None if c is None else _layer_entry(layer, h, c)
        if entry is None or (entry.plan.kind == "attention" and not entry.plan.has_moe):
            return None
        entries.append(entry)
    B = h.shape[0]
    for (_, _, plan), c in zip(entries, cache):
        if plan.kind == "attention" and not _room(c, h.dtype, B, plan.kv_heads, plan.head_dim):
            return None
    parents, names, children = [model], ["norm"], [model.norm]
    parents.append(model.norm)
    names.append("weight")
    children.append(model.norm.weight)
    arrays, layout, kv_shapes, state_dtypes, linear = [], [], [], [], []
    for layer, (key, objs, plan), c in zip(layers, entries, cache):
        p, n, ch = StepPlans.of(layer).links(key)
        parents += p
        names += n
        children += ch
        if plan.kind == "linear":
            state_dtypes.append((c[0].dtype, c[1].dtype))
        else:
            kv_shapes.append((tuple(c.keys.shape), c.keys.dtype))
        linear.append(plan.kind == "linear")
        arrays += objs[:plan.n_in]
        arrays += plan.extra
        layout.append((plan.kind, plan.raw, plan.n_in + len(plan.extra)))
    arrays.append(model.norm.weight)
    mp = _ModelPlan()
    mp.sig = _model_sig(h)
    mp.layers = tuple(layers)
    mp.cache_refs = tuple(weakref.ref(c) for c in cache)
    mp.linear = tuple(linear)
    mp.kv_shapes = tuple(kv_shapes)
    mp.state_dtypes = tuple(state_dtypes)
    mp.parents, mp.names, mp.children = tuple(parents), tuple(names), tuple(children)
    mp.arrays = tuple(arrays)
    mp.kept = {} if kept is None else kept
    mp.fn = _kept_model_step(mp.kept, tuple(layout), float(model.norm.eps), mp.arrays)
    return mp


def call_donating(fn: Callable, h: mx.array, states: list, kv: list):
    """``fn(h, *states)`` with the KV caches ``kv`` (whose buffers are among
    ``states``) holding no reference to their buffers during the call, so
    that the compiled step's row writes go in place (MLX
    donates an input only its call holds); put back if the call raises.
    Returns what ``fn`` returns; the caller stores the new buffers."""
    saved = [(c.keys, c.values) for c in kv]
    for c in kv:
        c.keys = c.values = None
    try:
        return fn(h, *states)
    except BaseException:
        for c, (k, v) in zip(kv, saved):
            c.keys, c.values = k, v
        raise


def embed_ids(model, inputs: mx.array) -> mx.array:
    """``model.embed_tokens(inputs)`` with the ids clamped into the table
    (its rows, where the module's weight says how many), so that no id
    reads outside it (MLX's gather does not check bounds): one elementwise
    op more than the stock call (``mx.minimum`` for unsigned ids, which
    mlx-lm's samplers give; ``mx.clip`` otherwise)."""
    w = model.embed_tokens.get("weight") if isinstance(model.embed_tokens, nn.Module) else None
    if isinstance(w, mx.array) and w.ndim == 2 and w.shape[0] > 0:
        last = w.shape[0] - 1
        if inputs.dtype in (mx.uint8, mx.uint16, mx.uint32, mx.uint64):
            inputs = mx.minimum(inputs, last)
        else:
            inputs = mx.clip(inputs, 0, last)
    return model.embed_tokens(inputs)


def decode_model(model, inputs: mx.array, cache) -> Optional[mx.array]:
    """The decode step of mlx-lm's ``qwen3_5.Qwen3_5TextModel`` -- token
    embedding, every decoder layer, the final RMSNorm -- with all the layers
    in one ``mx.compile``d call; None (nothing changed: the caller runs the
    model as mlx-lm does) unless every layer takes its whole compiled step
    (:func:`decode_layer`'s conditions, its MoE block included) and the
    model is neither pipelined nor given embeddings.

    Why: with one compiled call per layer the host still runs 40 layer
    calls per token -- the plan checks, the argument lists, MLX's compiled-
    call entry -- in Python; here that is one call, and the plan of the
    whole stack is kept on the model (:class:`_ModelPlan`), so a token
    costs one pass of identity checks, the states' argument list and the
    compiled call (bench/results/INDEX.md, the model-step rows). The embedding
    stays the module's own call (its few nodes), the language-model head
    stays outside (mlx-lm's ``TextModel`` applies it).

    Args:
        model: an mlx-lm ``Qwen3_5TextModel`` (``model.language_model.model``).
        inputs: ``[B, 1]`` token ids.
        cache: mlx-lm's prompt cache for the model's layers (one entry per
            layer); updated in place and advanced by one position, as the
            stock call does.

    Returns:
        ``[B, 1, D]``: what ``Qwen3_5TextModel.__call__(inputs, cache)``
        returns, or None.
    """
    layers = model.layers
    if (cache is None or not isinstance(inputs, mx.array) or inputs.ndim != 2 or inputs.shape[1] != 1
            or inputs.shape[0] == 0 or len(cache) != len(layers) or getattr(model, "pipeline_size", 1) != 1
            or type(model.norm) is not nn.RMSNorm):
        return None
    h = embed_ids(model, inputs)
    if not _takes(h):
        return None
    mp = model.__dict__.get(_PLAN_ATTR)
    if mp is None or not mp.holds(model, h, cache):
        model.__dict__.pop(_PLAN_ATTR, None)
        mp = _plan_model(model, h, cache, None if mp is None else mp.kept)
        if mp is None:
            return None
        object.__setattr__(model, _PLAN_ATTR, mp)
    states, kv = [], []
    offset = None
    for c, lin in zip(cache, mp.linear):
        if lin:
            states += (c[0], c[1])
        else:
            if offset is None or offset[0] != c.offset:  # one offset array for the layers that share it
                offset = (c.offset, mx.array(c.offset, mx.int32))
            states += (c.keys, c.values, offset[1])
            kv.append(c)
    out, *new = call_donating(mp.fn, h, states, kv)
    del states
    i = 0
    for c, lin in zip(cache, mp.linear):
        if lin:
            c[0], c[1] = new[i], new[i + 1]
            c.advance(1)
        else:
            c.keys, c.values = new[i], new[i + 1]
            c.offset += 1
        i += 2
    return out


def model_step(model, inputs: mx.array, cache=None, input_embeddings: Optional[mx.array] = None
               ) -> Optional[mx.array]:
    """The decode route of a fast layer stack's call
    (:class:`mlx_qwen_fast.layers.FastTextModel`): :func:`decode_model` for
    a call with a cache and no embeddings while
    :data:`mlx_qwen_fast.config.DECODE_MODEL_STEP` and
    :data:`~mlx_qwen_fast.config.DECODE_LAYER_STEP` are on; None otherwise,
    and where :func:`decode_model` declines (the caller tries the verify
    step, then mlx-lm's loop over the layers, each taking
    :func:`layer_step`).

    Args:
        model, inputs, cache: as :func:`decode_model` (any ``inputs``: the
            shape is checked there).
        input_embeddings: the stock call's argument; not None declines.

    Returns:
        ``[B, 1, D]`` as :func:`decode_model`, or None.
    """
    if input_embeddings is not None or cache is None or not _model_step_on():
        return None
    return decode_model(model, inputs, cache)


# ---------------------------------------------------------------------------
# the routes, for the patch report
# ---------------------------------------------------------------------------


def _layer_step_on() -> bool:
    """Whether decoder layers take :func:`decode_layer` (the switch)."""
    return config.DECODE_LAYER_STEP.get()


def _model_step_on() -> bool:
    """Whether layer stacks take :func:`decode_model` (both switches: the
    whole-stack step is made of the layer steps)."""
    return config.DECODE_MODEL_STEP.get() and config.DECODE_LAYER_STEP.get()


class DecodeRoutes(NamedTuple):
    """What a decode token (one token per row) runs on a backend: the route
    (whole stack, layer, module, stock) and the kernels it reaches, as the
    patch report names them (:meth:`table`)."""

    #: "compiled-model" (:func:`model_step`), "compiled-layer" (:func:`layer_step`) or "stock"
    model: str
    #: the Gated DeltaNet layer's: "cuda-mixer" (one launch, inside the layer
    #: step), "cuda-kernel", "metal-kernel", "mlx-lm-metal" or "recurrent"
    gated_delta: str
    #: the MoE block's: "cuda-block" (one launch, inside the layer step),
    #: "cuda-decode", "metal-decode" or "stock"
    moe: str
    #: the gated attention's: "compiled-layer" (the layer step with MLX's
    #: ops), "compiled-layer+cuda-kernel" / "compiled-layer+metal-kernel", or "stock"
    attention: str
    #: the layer step's projections: "compiled-layer+cuda-kernel" (the fused GEMV) or "stock"
    linear: str
    #: the language-model head's decode rows: "cuda-kernel" or "stock"
    lm_head: str

    def table(self) -> Dict[str, str]:
        """``{"<op>.decode": implementation}``: the report's decode rows."""
        return {"gated_delta.decode": self.gated_delta, "moe.decode": self.moe, "attention.decode": self.attention,
                "linear.decode": self.linear, "lm_head.decode": self.lm_head, "model.decode": self.model}


def decode_routes(backend: Optional[str] = None, model=None) -> DecodeRoutes:
    """The decode routes on ``backend`` from the switches
    (:mod:`mlx_qwen_fast.config`, read now) and the op families'
    dispatchers (``implementation_for(1, backend)`` of
    :mod:`~mlx_qwen_fast.ops.gated_delta`, :mod:`~mlx_qwen_fast.ops.moe`,
    :mod:`~mlx_qwen_fast.ops.attention`, :mod:`~mlx_qwen_fast.ops.linear`):
    the ones :func:`model_step`, :func:`layer_step` and the modules' entries
    take for a model whose layers all take them. Names only: nothing is
    planned, traced or evaluated.

    Args:
        backend: ``"cpu" | "cuda" | "metal"`` (what would run there on this
            machine: a GPU backend without its device falls back as the ops
            do), or None for :func:`mlx_qwen_fast.backend.current`.
        model: None, or a model (anything with ``layers``) whose weights
            narrow the one-launch kernels: "cuda-mixer" only where every
            Gated DeltaNet layer's projections are in its format
            (:func:`mlx_qwen_fast.ops.gated_delta.mixer_takes_weights`),
            "cuda-block" only where every fast MoE block's router is
            (:func:`mlx_qwen_fast.ops.moe.block_takes_weights`); else the
            three launches. The kernels the op families decline for a
            layer's quantisation (``decide_kernels``) are not applied here.

    Returns:
        :class:`DecodeRoutes`.

    Raises:
        ValueError: an unknown backend name (the empty string included).
    """
    b = _backend.resolve(backend)
    layer_on = _layer_step_on()
    gemv = layer_on and linear_ops.implementation_for(1, b) == "cuda-kernel"  # inside the layer step
    gdn = gated_delta_ops.implementation_for(1, b)
    if b == _backend.METAL and config.METAL_KERNELS.get():  # the layer's decode, not the recurrence alone
        gdn = "metal-kernel"
    moe = moe_ops.implementation_for(1, b)
    gdn_kernel, moe_kernel = gdn == "cuda-kernel", moe == "cuda-decode"
    layers = () if model is None else getattr(model, "layers", ())
    if gdn_kernel and gemv and config.GDN_MIXER_KERNEL.get() and all(
            gated_delta_ops.mixer_takes_weights(layer.linear_attn) for layer in layers
            if getattr(layer, "is_linear", False)):
        gdn = "cuda-mixer"  # else the three launches, for projections of another format
    if moe_kernel and gemv and config.MOE_BLOCK_KERNEL.get() and all(
            moe_ops.block_takes_weights(layer.mlp) for layer in layers
            if getattr(getattr(layer, "mlp", None), "ops", None) is moe_ops):
        moe = "cuda-block"  # else the three launches, for a router of another format
    kernel = attention_ops.implementation_for(1, b)
    attention = "stock" if not layer_on else "compiled-layer" if kernel == "reference" else f"compiled-layer+{kernel}"
    # every layer in one compiled call: only where both layer kinds take their whole step
    route = "compiled-model" if _model_step_on() and gdn_kernel and moe_kernel else (
        "compiled-layer" if layer_on else "stock")
    return DecodeRoutes(
        model=route, gated_delta=gdn, moe=moe, attention=attention,
        linear="compiled-layer+cuda-kernel" if gemv else "stock",
        lm_head="cuda-kernel" if linear_ops.implementation_for(1, b) == "cuda-kernel" else "stock")
