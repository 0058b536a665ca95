"""The decode step of the whole layer stack as one ``mx.compile``d call
(:func:`decode_model`), planned from the layers' own plans
(:mod:`mlx_qwen_fast.ops.layer_plans`) and kept on the model
(:class:`_ModelPlan`) while it holds. Which route a token takes is
:mod:`mlx_qwen_fast.ops.decoder`'s decision; this module is the whole-stack
step it reaches, and the helpers the verify step shares with it
(:func:`embed_ids`, :func:`call_donating`).
"""

from __future__ import annotations

import operator
import weakref
from typing import Callable, Dict, Optional

import mlx.core as mx
import mlx.nn as nn

from .. import config
from ..compiled import StepPlans
from . import _launch_order, kv_buffers
from .layer_plans import layer_entry, takes

__all__ = ["KeptPlan", "call_donating", "decode_model", "embed_ids", "order_input"]


#: Compiled whole-stack steps a model keeps (the newest), each holding its arrays.
_MODEL_STEPS_KEPT = 4


def _model_step(layout: tuple, norm_eps: float, arrays: tuple) -> Callable:
    """The compiled decode step of a whole layer stack: ``fn(h, prev, *states)
    -> (rms_norm(layers(h)), *new states)``; ``prev`` the previous call's
    output (or ``h``), the first grid-barrier launch's ``after`` input
    (:mod:`mlx_qwen_fast.ops._launch_order`); ``layout`` = per layer (kind, raw
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
    def step(h, prev, *states_in):
        s, a, states = 0, 0, []
        with _launch_order.first_launch_after(prev):  # the previous call's output: see _launch_order
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


class KeptPlan:
    """Base of the plans kept on a model (:class:`_ModelPlan`, the verify
    step's): a plan holds the original's objects, so a copied or pickled
    model carries none (it plans again)."""

    __slots__ = ()

    def links_hold(self) -> bool:
        """Whether every link the plan recorded (``parents[i][names[i]] is
        children[i]``: the modules and arrays it was planned from) is still
        the same object; the subclass holds ``parents``, ``names``,
        ``children``."""
        try:
            return all(map(operator.is_, map(dict.__getitem__, self.parents, self.names), self.children))
        except (KeyError, TypeError):
            return False

    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return (type(None), ())


_PLAN_ATTR = "_mqf_model_plan"  # the text model's attribute holding its _ModelPlan
_call_ref = weakref.ref.__call__


class _ModelPlan(KeptPlan):
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
                 "children", "arrays", "fn", "kept", "prev")

    def holds(self, model, h: mx.array, cache) -> bool:
        if _model_sig(h) != self.sig:
            return False
        layers = model.layers
        if len(cache) != len(self.cache_refs) or len(layers) != len(self.layers):
            return False
        if not (all(map(operator.is_, layers, self.layers))
                and all(map(operator.is_, map(_call_ref, self.cache_refs), cache))):
            return False
        if not self.links_hold():
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
            config.GDN_MIXER_KERNEL.get(), config.MOE_BLOCK_KERNEL.get(), config.GDN_LAYER_KERNEL.get())


def _plan_model(model, h: mx.array, cache, kept: Optional[Dict[tuple, Callable]] = None) -> Optional[_ModelPlan]:
    """A :class:`_ModelPlan` from every layer's plan (made or checked here),
    or None where a layer does not take its whole step. May grow KV buffers
    (:func:`mlx_qwen_fast.ops.kv_buffers.make_room`, as ``KVCache.update_and_fetch`` does before writing, in
    larger steps): invisible to the caller, as stock's growth is."""
    layers = model.layers
    entries = []
    for layer, c in zip(layers, cache):
        entry = None if c is None else layer_entry(layer, h, c)
        if entry is None or (entry.plan.kind == "attention" and not entry.plan.has_moe):
            return None
        entries.append(entry)
    B = h.shape[0]
    for (_, _, plan), c in zip(entries, cache):
        if plan.kind == "attention" and not kv_buffers.make_room(c, h.dtype, B, plan.kv_heads, plan.head_dim):
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
    mp.prev = None
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


def order_input(prev: Optional[mx.array], h: mx.array) -> mx.array:
    """The ``prev`` input of a whole-stack step: the previous call's output
    where it has ``h``'s shape and dtype (one trace for every call), else
    ``h`` (no earlier call to order after)."""
    if prev is not None and prev.shape == h.shape and prev.dtype == h.dtype:
        return prev
    return h


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
    (:func:`mlx_qwen_fast.ops.layer_plans.decode_layer`'s conditions, its MoE block included) and the
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
    if not takes(h):
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
    out, *new = call_donating(mp.fn, h, [order_input(mp.prev, h)] + states, kv)
    mp.prev = out
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
