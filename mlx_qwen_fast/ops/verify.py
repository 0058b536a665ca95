"""A forward of S = 2..16 tokens per row with a cache (a speculative verify)
as one ``mx.compile``d call over the whole layer stack.

Contract: :func:`verify_model` computes what mlx-lm's
``qwen3_5.Qwen3_5TextModel.__call__(inputs, cache)`` computes for ``inputs``
of shape ``[B, S]``, 2 <= S <= :data:`MAX_TOKENS`, on a prompt cache of plain
``KVCache`` (attention layers) and ``ArraysCache`` (Gated DeltaNet layers)
entries without per-row lengths or left padding -- the token embedding,
every ``DecoderLayer`` (``h = x + mixer(input_layernorm(x)); out = h +
mlp(post_attention_layernorm(h))``) with the causal mask inside the block,
the final RMSNorm -- and advances every cache by S positions, as the stock
call does. The reference is that stock call (the fast modules of
:mod:`mlx_qwen_fast.layers` compute the same within fp32 rounding).

Why: S > 1 tokens otherwise run mlx-lm's Python loop over the layers,
module by module: host-bound (~15 ms of host work per call at S = 2 on the
reference model against ~5 ms for the whole one-token step,
bench/results/INDEX.md, the ``bench.verify_pass`` rows). Here the
Python runs once per input signature (B, S, the KV buffers' capacity, the
dtypes) and each later call replays the traced graph from C++, as
:func:`mlx_qwen_fast.ops.model_plan.decode_model` does for S = 1.

Per layer, inside the trace (the layers' parameters are constants of the
trace, captured, not inputs: the plan holds only while every one of them is
the same object, :class:`_VerifyPlan`):

* Gated DeltaNet: the layer's own module call on a stand-in
  ``ArraysCache`` holding the traced states (on CUDA the prefill kernels:
  front end, chunked scan, gated RMSNorm, :func:`~mlx_qwen_fast.ops.
  gated_delta.gated_delta_net`; on the CPU the chunked form). Inside
  :func:`mlx_qwen_fast.speculative.rollback` (the cache a
  ``RollbackArraysCache``, S <= its ``max_steps``) the step also returns
  the layer's input, and the call is recorded as
  :func:`mlx_qwen_fast.speculative.forward` records it (the states before
  it and that input, replayed only by a trim that ends inside the call).
* Gated attention (mlx-lm's ``Qwen3NextAttention``): the q/k/v projections
  (the modules), q/k RMSNorm, RoPE at the cache offset -- a 0-d int32
  input, so one trace serves every offset --, the S new K/V rows written
  into the cache's buffers at the offset (``kernels._cache_rows``; the
  buffers donated; room made before the call, in
  :data:`~mlx_qwen_fast.ops.kv_buffers.KV_GROWTH` steps as the decode step
  makes it), the attention of the S queries over the whole buffer with
  query t masked to positions ``<= offset + t`` (MLX's
  ``scaled_dot_product_attention`` with a boolean mask: the flash prefill
  kernel takes its offset as a launch constant, not as data), the sigmoid
  gate, ``o_proj``.
* MoE block: where :func:`mlx_qwen_fast.ops.moe.decode_step_parts` takes
  B*S rows (CUDA, up to ``DECODE_MAX_TOKENS`` rows) its fused step (norm,
  router, experts, residual); otherwise the module's own dispatch for B*S
  rows (stock ``gather_qmm`` there and on the CPU).

Where any layer or cache does not fit (another cache class, a quantised or
rotating KV cache, per-row lengths or left padding, an empty state, a KV
buffer of another batch, head count or dtype, a sharded or pipelined model,
a layer class other than mlx-lm's ``DecoderLayer``, an MoE block that would
run the prefill kernels) :func:`verify_model` returns None before touching
the cache, and the caller runs mlx-lm's loop.
"""

from __future__ import annotations

import operator
import weakref
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .. import config
from ..compiled import _links, gather
from ..kernels._cache_rows import row_index, write_rows
from ..kernels._checks import describe
from . import _launch_order, kv_buffers, model_plan
from . import gated_delta as gated_delta_ops
from . import moe as moe_ops
from ._checks import check_attention_module, fail, is_int

__all__ = ["MAX_TOKENS", "MIN_TOKENS", "step_count", "trace_count", "verify_attention", "verify_model",
           "verify_model_hidden", "verify_step"]

#: Fewest tokens per row the step takes (one token is :func:`decode_model`'s).
MIN_TOKENS = 2
#: Most tokens per row the step takes (a verify of 15 draft tokens and the last one).
MAX_TOKENS = 16

_traces = [0]  # incremented by the traced Python: one count per trace
_steps_run = [0]  # incremented by every call of verify_model that ran the step


def trace_count() -> int:
    """How many times the whole-stack step's Python has run (once per
    trace under ``mx.compile``; every call where compilation is disabled)."""
    return _traces[0]


def step_count() -> int:
    """How many calls of :func:`verify_model` in this process ran the
    compiled step (did not return None): for benchmarks and tests."""
    return _steps_run[0]


def verify_attention(attn, x: mx.array, keys: mx.array, values: mx.array, offset: mx.array):
    """mlx-lm's ``Qwen3NextAttention.__call__(x, "causal", cache)`` for S
    tokens per row with the cache as arrays: the new rows written at a 0-d
    offset array (traceable; one trace serves every offset).

    Args:
        attn: an mlx-lm ``Qwen3NextAttention`` (its projections called as
            modules, its ``rope`` an ``nn.RoPE``).
        x: ``[B, S, D]`` the normalised hidden states, float.
        keys, values: ``[B, Hkv, capacity, Dh]`` the cache buffers in x's
            dtype, positions ``[0, offset)`` written; ``capacity >= offset +
            S`` (the caller checks; rows past the end are clamped onto the
            last one, never written outside the buffer).
        offset: 0-d int32, the first new token's position.

    Returns:
        ``(out [B, S, D], keys, values)``: the module's output and the
        buffers with the S new rows at ``offset .. offset + S - 1``.

    Raises:
        ValueError: ``attn`` not a ``Qwen3NextAttention``, ``x`` not a float
            ``[B, S, D]`` (D the projections' input size where they say),
            ``keys`` / ``values`` not ``[B, num_key_value_heads, capacity
            >= S, head_dim]`` in x's dtype, ``offset`` not a 0-d integer
            mx.array. Shapes and dtypes only (this runs inside the verify
            step's trace): ``offset``'s value is not read, an offset past
            ``capacity - S`` writes the clamped rows.
    """
    _check_attention(attn, x, keys, values, offset)
    B, S, _ = x.shape
    queries, gate = mx.split(attn.q_proj(x).reshape(B, S, attn.num_attention_heads, -1), 2, axis=-1)
    gate = gate.reshape(B, S, -1)
    k = attn.k_proj(x).reshape(B, S, attn.num_key_value_heads, -1)
    v = attn.v_proj(x).reshape(B, S, attn.num_key_value_heads, -1)
    queries = attn.rope(attn.q_norm(queries).transpose(0, 2, 1, 3), offset=offset)
    k = attn.rope(attn.k_norm(k).transpose(0, 2, 1, 3), offset=offset)
    v = v.transpose(0, 2, 1, 3)
    index = row_index(offset, S, keys.shape[2])
    keys, values = write_rows(keys, k, index), write_rows(values, v, index)
    # query t (position offset + t) reads positions 0 .. offset + t: stock's causal mask over the valid rows
    mask = mx.arange(keys.shape[2])[None, :] <= (offset + mx.arange(S))[:, None]
    out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=attn.scale, mask=mask)
    out = out.transpose(0, 2, 1, 3).reshape(B, S, -1)
    return attn.o_proj(out * mx.sigmoid(gate)), keys, values


def _check_attention(attn, x, keys, values, offset) -> None:
    fn = "verify_attention"
    check_attention_module(fn, attn, x, rows="S")
    B, S = x.shape[0], x.shape[1]
    hkv, dh = attn.num_key_value_heads, attn.head_dim
    if (not isinstance(keys, mx.array) or keys.ndim != 4 or keys.shape[:2] != (B, hkv) or keys.shape[3] != dh
            or keys.shape[2] < S or keys.dtype != x.dtype):
        fail(fn, f"keys must be {x.dtype} of shape [{B}, {hkv}, capacity >= {S}, {dh}] (x's rows, the module's KV "
                 f"heads and head_dim, room for the {S} new rows), got {describe(keys)}")
    if not isinstance(values, mx.array) or values.shape != keys.shape or values.dtype != keys.dtype:
        fail(fn, f"values must be {keys.dtype} of the shape of keys {tuple(keys.shape)}, got {describe(values)}")
    if not isinstance(offset, mx.array) or offset.ndim != 0 or not mx.issubdtype(offset.dtype, mx.integer):
        fail(fn, f"offset must be a 0-d int32 mx.array (the first new row's position), got {describe(offset)}")


# ---------------------------------------------------------------------------
# the plan
# ---------------------------------------------------------------------------

_PLAN_ATTR = "_mqf_verify_plan"  # the text model's attribute holding its _VerifyPlan
_STEPS_KEPT = 4  # compiled steps a model keeps (the newest), each holding its arrays
_call_ref = weakref.ref.__call__


def _cache_types():
    from mlx_lm.models.cache import ArraysCache, KVCache

    from ..speculative import RollbackArraysCache

    return KVCache, ArraysCache, RollbackArraysCache


def _sig(h: mx.array) -> tuple:
    """What a plan bakes in besides the layers: the hidden states' shape and
    dtype, every boolean switch (the dispatchers traced inside read them)."""
    return (tuple(h.shape), h.dtype) + tuple(s.get() for s in config.SWITCHES if s.kind == "bool")


def _param_paths(module) -> Optional[tuple]:
    """Paths (tuples of dict keys) of every parameter under ``module``, or
    None where one runs through a list (not checkable by dict lookups)."""
    paths = tuple(tuple(k.split(".")) for k, _ in tree_flatten(module.parameters()))
    if any(part.isdigit() for p in paths for part in p):
        return None
    return paths


def _moe_step(layer, x: mx.array) -> Optional[tuple]:
    """``("parts", fn, arrays)`` where the MoE block's fused decode step
    takes ``x``'s rows, ``("module",)`` where the block's own dispatch runs
    traceably (stock on every backend but the decode kernels'), None where
    it would run the prefill or Metal kernels (not traced here)."""
    from mlx_lm.models.qwen3_next import Qwen3NextSparseMoeBlock

    block = layer.mlp
    n = x.shape[0] * x.shape[1]
    if isinstance(block, Qwen3NextSparseMoeBlock):
        impl = moe_ops.implementation_for(n)
        if impl == "cuda-decode":
            parts = moe_ops.decode_step_parts(block, x, norm_eps=layer.post_attention_layernorm.eps)
            if parts is not None:
                paths, fn = parts
                return "parts", fn, gather(block, paths)
        elif impl != "stock":
            return None
    return ("module",)


def _layer_fits(layer) -> bool:
    from mlx_lm.models.qwen3_5 import DecoderLayer
    from mlx_lm.models.qwen3_next import Qwen3NextAttention

    from ..layers import FastDecoderLayer

    if type(layer).__call__ not in (DecoderLayer.__call__, FastDecoderLayer.__call__):
        return False
    if type(layer.input_layernorm) is not nn.RMSNorm or type(layer.post_attention_layernorm) is not nn.RMSNorm:
        return False
    mixer = layer.linear_attn if layer.is_linear else layer.self_attn
    if getattr(mixer, "sharding_group", None) is not None or getattr(layer.mlp, "sharding_group", None) is not None:
        return False
    return layer.is_linear or (isinstance(layer.self_attn, Qwen3NextAttention) and type(layer.self_attn.rope) is nn.RoPE)


class _VerifyPlan(model_plan.KeptPlan):
    """The whole stack's S-token step planned for one model, prompt cache and
    input signature. It holds (:meth:`holds`) while the model's layers and
    the cache's entries are the same objects (the entries through weak
    references) of the same classes, the hidden states' shape and dtype and
    the switches are unchanged, every parameter of every layer and the final
    norm's weight is the same object (links checked by identity, one pass),
    each KV cache's buffers keep their shape and dtype with room for S more
    positions, and each Gated DeltaNet cache holds states without per-row
    lengths or left padding (inside a rollback: ``max_steps >= S``)."""

    __slots__ = ("sig", "layers", "cache_refs", "cache_types", "kinds", "kv_shapes", "parents", "names",
                 "children", "fn", "kept", "capture", "prev")

    def holds(self, model, h: mx.array, cache, capture: tuple) -> bool:
        if capture != self.capture or _sig(h) != self.sig or len(cache) != len(self.cache_refs) or len(model.layers) != len(self.layers):
            return False
        if not (all(map(operator.is_, model.layers, self.layers))
                and all(map(operator.is_, map(_call_ref, self.cache_refs), cache))
                and all(map(operator.is_, map(type, cache), self.cache_types))):
            return False
        if not self.links_hold():
            return False
        S = h.shape[1]
        kv = iter(self.kv_shapes)
        for c, kind in zip(cache, self.kinds):
            if kind == "attention":
                shape, dtype = next(kv)
                k, v = c.keys, c.values
                if (k is None or v is None or k.shape != shape or v.shape != shape or k.dtype != dtype
                        or v.dtype != dtype or c.offset + S > shape[2]):
                    return False
            elif not _gdn_cache_fits(c, kind, S, h):
                return False
        return True


def _gdn_cache_fits(c, kind: str, S: int, h: mx.array) -> bool:
    if c.lengths is not None or c.left_padding is not None or c[0] is None or c[1] is None:
        return False
    if c[0].ndim != 3 or c[0].shape[0] != h.shape[0] or c[1].ndim != 4 or c[1].shape[0] != h.shape[0]:
        return False
    return kind not in ("linear-replay", "linear-exact") or S <= c.max_steps


def _layer_kind(layer, c, types) -> Optional[str]:
    kv_type, arrays_type, rollback_type = types
    if layer.is_linear:
        if type(c) is arrays_type:
            return "linear"
        if type(c) is rollback_type and isinstance(layer.linear_attn, _fast_gdn()):
            from ..speculative import replays

            return "linear-replay" if replays() else "linear-exact"
        return None
    return "attention" if type(c) is kv_type else None


def _fast_gdn():
    from ..layers import FastGatedDeltaNet

    return FastGatedDeltaNet


def _plan(model, h: mx.array, cache, kept: Optional[dict], capture: tuple) -> Optional[_VerifyPlan]:
    """A :class:`_VerifyPlan`, or None where a layer or cache does not fit
    (nothing changed then). May grow KV buffers after every check passed
    (:func:`mlx_qwen_fast.ops.kv_buffers.make_room`, as ``KVCache.update_and_fetch``
    grows them before writing): invisible to the caller."""
    types = _cache_types()
    B, S = h.shape[0], h.shape[1]
    kinds, moes, paths = [], [], []
    for layer, c in zip(model.layers, cache):
        kind = None if c is None or not _layer_fits(layer) else _layer_kind(layer, c, types)
        if kind is None:
            return None
        if kind == "attention":
            attn = layer.self_attn
            k, v = c.keys, c.values
            want = (B, attn.num_key_value_heads)
            if (k is None or v is None or k.ndim != 4 or tuple(k.shape[:2]) != want or k.shape[3] != attn.head_dim
                    or tuple(v.shape) != tuple(k.shape) or k.dtype != h.dtype or v.dtype != h.dtype):
                return None
        elif not _gdn_cache_fits(c, kind, S, h):
            return None
        moe = _moe_step(layer, h)
        p = _param_paths(layer)
        if moe is None or p is None:
            return None
        kinds.append(kind)
        moes.append(moe)
        paths.append(p)
    for layer, c, kind in zip(model.layers, cache, kinds):
        if kind == "attention" and not kv_buffers.make_room(c, h.dtype, B, layer.self_attn.num_key_value_heads,
                                                         layer.self_attn.head_dim, S):
            return None
    parents, names, children = [model, model.norm], ["norm", "weight"], [model.norm, model.norm.weight]
    arrays: List[mx.array] = [model.norm.weight]
    for layer, p, moe in zip(model.layers, paths, moes):
        lp, ln, lc = _links(layer, p)
        parents += lp
        names += ln
        children += lc
        arrays += [a for a in lc if isinstance(a, mx.array)]
        if moe[0] == "parts":
            arrays += moe[2]
    vp = _VerifyPlan()
    vp.sig = _sig(h)
    vp.layers = tuple(model.layers)
    vp.cache_refs = tuple(weakref.ref(c) for c in cache)
    vp.cache_types = tuple(type(c) for c in cache)
    vp.kinds = tuple(kinds)
    vp.kv_shapes = tuple((tuple(c.keys.shape), c.keys.dtype) for c, k in zip(cache, kinds) if k == "attention")
    vp.parents, vp.names, vp.children = tuple(parents), tuple(names), tuple(children)
    vp.kept = {} if kept is None else kept
    vp.capture = capture
    vp.fn = _kept_step(vp.kept, model, vp.kinds, tuple(moes), tuple(arrays), capture)
    vp.prev = None
    return vp


def _kept_step(kept: Dict[tuple, Callable], model, kinds: tuple, moes: tuple, arrays: tuple,
               capture: tuple) -> Callable:
    """The compiled step for these layers, kinds and arrays from ``kept``
    (keyed by the kinds and the arrays' identities: a new prompt cache or a
    regrown KV buffer with the same weights reuses the step and its traces),
    made and kept there if missing; only steps of these very arrays stay."""
    ids = tuple(map(id, arrays))  # every kept step holds its arrays (the closure): their ids are not reused
    for stale in [k for k in kept if k[1] != ids]:
        del kept[stale]
    key = (kinds, ids, tuple(map(id, model.layers)), capture)
    fn = kept.pop(key, None)
    if fn is None:
        fn = _stack_step(model, kinds, moes, arrays, capture)
    kept[key] = fn
    while len(kept) > _STEPS_KEPT:
        del kept[next(iter(kept))]
    return fn


def _stack_step(model, kinds: tuple, moes: tuple, arrays: tuple, capture: tuple) -> Callable:
    """``mx.compile``d ``fn(h, prev, *states) -> (rms_norm(layers(h)), [hidden,]
    *new states)``: ``prev`` the previous call's output (or ``h``), the first
    grid-barrier launch's ``after`` input (:mod:`mlx_qwen_fast.ops._launch_order`); ``hidden`` (only where ``capture`` names layers) the
    outputs of the layers ``capture`` concatenated on the last axis in that
    order; ``states`` per layer (GDN: conv state, recurrent state;
    attention: keys, values, offset); new states per layer (GDN: conv,
    recurrent, and inside a rollback the layer's input; attention: keys,
    values).
    ``arrays`` only keeps the captured parameters alive with the step."""
    from mlx_lm.models.cache import ArraysCache

    layers = tuple(model.layers)
    norm = model.norm
    where = {i: n for n, i in enumerate(capture)}

    def step(h, prev, *states_in):
        _traces[0] += 1
        s, out = 0, []
        kept = [None] * len(capture)
        with _launch_order.first_launch_after(prev):  # the previous call's output: see _launch_order
            for i, (layer, kind, moe) in enumerate(zip(layers, kinds, moes)):
                x = layer.input_layernorm(h)
                if kind == "attention":
                    r, keys, values = verify_attention(layer.self_attn, x, *states_in[s:s + 3])
                    out += (keys, values)
                    s += 3
                else:
                    tmp = ArraysCache(2)
                    tmp[0], tmp[1] = states_in[s], states_in[s + 1]
                    if kind == "linear-exact":  # the recurrence token by token: every token's states
                        r, after = gated_delta_ops.gated_delta_net_steps(layer.linear_attn, x, tmp)
                        out += [c for c, _ in after] + [st for _, st in after]
                    else:
                        r = layer.linear_attn(x, None, tmp)
                        out += (tmp[0], tmp[1])
                        if kind == "linear-replay":  # the layer's input: a trim inside this call replays it
                            out.append(x)
                    s += 2
                h = h + r
                if moe[0] == "parts":
                    h = moe[1](h, layer.post_attention_layernorm.weight, *moe[2])
                else:
                    h = h + layer.mlp(layer.post_attention_layernorm(h))
                if i in where:
                    kept[where[i]] = h
        if capture:
            return (norm(h), mx.concatenate(kept, axis=-1), *out)
        return (norm(h), *out)

    step.arrays = arrays
    return mx.compile(step)


def verify_model(model, inputs: mx.array, cache) -> Optional[mx.array]:
    """mlx-lm's ``Qwen3_5TextModel.__call__(inputs, cache)`` for S = 2 ..
    :data:`MAX_TOKENS` tokens per row with every layer in one
    ``mx.compile``d call (see the module docstring); None (nothing changed:
    the caller runs mlx-lm's loop) where the input, a layer or a cache does
    not fit.

    Args:
        model: an mlx-lm ``Qwen3_5TextModel`` (``model.language_model.model``).
        inputs: ``[B, S]`` token ids, B >= 1, 2 <= S <= 16.
        cache: mlx-lm's prompt cache, one entry per layer: ``KVCache`` for
            the attention layers, ``ArraysCache`` (or, inside
            :func:`mlx_qwen_fast.speculative.rollback`, its
            ``RollbackArraysCache``) holding both states for the Gated
            DeltaNet layers; updated in place and advanced by S positions
            (a recording cache also records the states before each token).

    Returns:
        ``[B, S, D]`` hidden states after the final norm (activation dtype),
        as the stock call returns; or None.

    Raises:
        ValueError: ``model`` not an mlx-lm ``Qwen3_5TextModel``; ``inputs``
            an mx.array that is not of an integer dtype. Token ids are not
            read (that would synchronise): an id outside ``[0, vocab)`` is
            clamped into the embedding table (a meaningless row, never a
            read outside it).
    """
    _check_model("verify_model", model, inputs)
    out = _verify(model, inputs, cache, ())
    return None if out is None else out[0]


def verify_step(model, inputs: mx.array, cache, input_embeddings: Optional[mx.array] = None) -> Optional[mx.array]:
    """The route of a fast layer stack's call of several tokens per row
    (:class:`mlx_qwen_fast.layers.FastTextModel`): :func:`verify_model`
    where :data:`mlx_qwen_fast.config.VERIFY_MODEL_STEP` is on, a cache is
    given and no embeddings are; None (nothing changed: the caller runs
    mlx-lm's loop) otherwise, and where :func:`verify_model` declines.

    Args:
        model, inputs, cache: as :func:`verify_model` (any ``inputs``: the
            shape is checked there).
        input_embeddings: the stock call's argument; not None declines.

    Returns:
        ``[B, S, D]`` as :func:`verify_model`, or None.
    """
    if input_embeddings is not None or cache is None or not config.VERIFY_MODEL_STEP.get():
        return None
    return verify_model(model, inputs, cache)


def verify_model_hidden(model, inputs: mx.array, cache, layer_ids: Sequence[int]):
    """:func:`verify_model` that also returns the outputs of the decoder
    layers ``layer_ids`` (a DFlash drafter's context:
    :func:`mlx_qwen_fast.dflash.capture.forward` computes the same with
    mlx-lm's loop), from the same compiled call.

    Args:
        model, inputs, cache: as :func:`verify_model`.
        layer_ids: 1 or more layer indices (0-based, each in ``[0,
            len(model.layers))``), in the order their outputs are
            concatenated.

    Returns:
        ``(out, hidden)``: ``out`` as :func:`verify_model`; ``hidden``
        ``[B, S, len(layer_ids) * D]`` in the activation dtype, the residual
        stream after each named layer (before the final norm); or None
        where :func:`verify_model` returns None.

    Raises:
        ValueError: as :func:`verify_model`; ``layer_ids`` not a sequence
            of 1 or more distinct ints (bools are not) naming layers the
            model has.
    """
    fn = "verify_model_hidden"
    _check_model(fn, model, inputs)
    n = len(model.layers)
    if (not isinstance(layer_ids, Sequence) or isinstance(layer_ids, str) or not layer_ids
            or not all(is_int(i) and 0 <= i < n for i in layer_ids) or len(set(layer_ids)) != len(layer_ids)):
        fail(fn, f"layer_ids must be 1 or more distinct layer indices (ints) in [0, {n}), got {layer_ids!r}")
    return _verify(model, inputs, cache, tuple(int(i) for i in layer_ids))


def _check_model(fn: str, model, inputs) -> None:
    """``model`` a text model; ``inputs`` token ids where it is an mx.array
    (anything else is left to the fallback, mlx-lm's loop)."""
    from mlx_lm.models.qwen3_5 import Qwen3_5TextModel

    if not isinstance(model, Qwen3_5TextModel):
        fail(fn, f"model must be an mlx-lm Qwen3_5TextModel (model.language_model.model), got {type(model).__name__}")
    if isinstance(inputs, mx.array) and not mx.issubdtype(inputs.dtype, mx.integer):
        fail(fn, f"inputs must be integer token ids [B, S], got {describe(inputs)}")


def _verify(model, inputs: mx.array, cache, capture: tuple) -> Optional[tuple]:
    """The step of :func:`verify_model` capturing the layers ``capture``:
    ``(out, hidden)`` (``hidden`` None where ``capture`` is empty), or None."""
    layers = model.layers
    if (cache is None or not isinstance(inputs, mx.array) or inputs.ndim != 2
            or not MIN_TOKENS <= inputs.shape[1] <= MAX_TOKENS or inputs.shape[0] == 0
            or not isinstance(cache, (list, tuple)) or len(cache) != len(layers)
            or getattr(model, "pipeline_size", 1) != 1 or type(model.norm) is not nn.RMSNorm):
        return None
    h = model_plan.embed_ids(model, inputs)
    if not isinstance(h, mx.array) or h.ndim != 3:
        return None
    vp = model.__dict__.get(_PLAN_ATTR)
    if vp is None or not vp.holds(model, h, cache, capture):
        model.__dict__.pop(_PLAN_ATTR, None)
        vp = _plan(model, h, cache, None if vp is None else vp.kept, capture)
        if vp is None:
            return None
        object.__setattr__(model, _PLAN_ATTR, vp)
    S = h.shape[1]
    states, kv = [], []
    offset = None
    for c, kind in zip(cache, vp.kinds):
        if kind == "attention":
            if c.offset + S > c.keys.shape[2]:  # the plan checked: rows past the end would be clamped
                raise AssertionError("verify_model: KV buffer without room for the step")
            if offset is None or offset[0] != c.offset:  # one offset array for the layers that share it
                offset = (c.offset, mx.array(c.offset, mx.int32))
            states += (c.keys, c.values, offset[1])
            kv.append(c)
        else:
            states += (c[0], c[1])
    out, *new = model_plan.call_donating(vp.fn, h, [model_plan.order_input(vp.prev, h)] + states, kv)
    vp.prev = out
    del states
    hidden = new.pop(0) if capture else None
    from ..speculative import Segment, record_steps  # here: speculative imports this package's modules

    i = 0
    for layer, c, kind in zip(layers, cache, vp.kinds):
        if kind == "attention":
            c.keys, c.values = new[i], new[i + 1]
            c.offset += S
            i += 2
        elif kind == "linear":
            c[0], c[1] = new[i], new[i + 1]
            c.advance(S)
            i += 2
        elif kind == "linear-replay":  # as speculative.forward records: the states before, the input
            segment = Segment(c[0], c[1], S, layer.linear_attn, new[i + 2])
            c[0], c[1] = new[i], new[i + 1]
            c.record(segment)
            c.advance(S)
            i += 3
        else:  # linear-exact: the states before each of the S tokens
            convs, recs = new[i:i + S], new[i + S:i + 2 * S]
            record_steps(c, (c[0], c[1]), list(zip(convs, recs)))
            c[0], c[1] = convs[-1], recs[-1]
            c.advance(S)
            i += 2 * S
    _steps_run[0] += 1
    return out, hidden
