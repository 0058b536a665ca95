"""Gated full attention of Qwen3.5/3.6-MoE (``Qwen3NextAttention``).

Source: ``mlx_lm/models/qwen3_next.py`` (``Qwen3NextAttention.__call__``),
``mlx_lm/models/base.py`` (``scaled_dot_product_attention``),
``mlx_lm/models/rope_utils.py`` (``initialize_rope``), mlx-lm 0.32.2.
Shapes for Qwen3.6-35B-A3B: hidden D = 2048, 16 query heads, 2 KV heads
(8 query heads per KV head), head_dim 256, partial rotary over the first 64
dims (non-traditional, theta 1e7), RMSNorm on q and k per head, and an output
gate: ``q_proj`` emits, per head, ``head_dim`` query values followed by
``head_dim`` gate values; the layer returns ``o_proj(attn * sigmoid(gate))``.

Pieces, each a reference in plain MLX ops with its contract:
:func:`split_query_gate`, :func:`qk_norm`, :func:`partial_rope`,
:func:`sdpa` (and :func:`sdpa_chunked`, online softmax over key blocks so
scratch memory stays ``O(L_q * key_block)`` per head at long context),
:func:`output_gate`; :func:`gated_attention_reference` is the whole layer
from them, and :func:`gated_attention` is the dispatch entry the fast module
calls. Until a kernel exists the dispatch runs the stock layer on every
backend.

Layout: ``B`` batch, ``L`` new tokens, ``H`` query heads, ``Hkv`` KV heads,
``hd`` head_dim, ``Lk`` keys (cached + new). Positions are token indices.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable, Dict, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3_next import Qwen3NextAttention

from .. import backend as _backend

__all__ = [
    "split_query_gate",
    "qk_norm",
    "partial_rope",
    "sdpa",
    "sdpa_chunked",
    "output_gate",
    "gated_attention_reference",
    "gated_attention",
    "implementation_for",
    "IMPLEMENTATIONS",
]

_FLOATS = (mx.float32, mx.float16, mx.bfloat16)

Mask = Union[None, str, mx.array]


def _check_float(fn: str, name: str, x: mx.array, shape: str, ndim: int):
    if x.ndim != ndim or x.dtype not in _FLOATS:
        raise ValueError(
            f"{fn}: {name} must be a float32/float16/bfloat16 array of shape "
            f"{shape}, got shape {tuple(x.shape)} dtype {x.dtype}"
        )


# ---------------------------------------------------------------------------
# Pieces
# ---------------------------------------------------------------------------


def split_query_gate(
    q_proj_out: mx.array, num_heads: int, head_dim: int
) -> Tuple[mx.array, mx.array]:
    """Split ``q_proj``'s output into per-head queries and the output gate.

    The projection is laid out head by head, each head holding ``head_dim``
    query values then ``head_dim`` gate values (not all queries then all
    gates).

    Args:
        q_proj_out: ``[B, L, 2 * H * hd]`` float.
        num_heads: ``H``.
        head_dim: ``hd``.

    Returns:
        ``(queries [B, L, H, hd], gate [B, L, H * hd])``, dtype of the input.

    Raises:
        ValueError: not a 3-D float array with last axis ``2 * H * hd``.
    """
    width = 2 * num_heads * head_dim
    _check_float("split_query_gate", "q_proj_out", q_proj_out, f"[B, L, {width}]", 3)
    if q_proj_out.shape[-1] != width:
        raise ValueError(
            f"split_query_gate: q_proj_out must have shape [B, L, {width}] "
            f"(2 * num_heads={num_heads} * head_dim={head_dim}), "
            f"got {tuple(q_proj_out.shape)}"
        )
    B, L, _ = q_proj_out.shape
    queries, gate = mx.split(q_proj_out.reshape(B, L, num_heads, 2 * head_dim), 2, axis=-1)
    return queries, gate.reshape(B, L, -1)


def qk_norm(
    queries: mx.array,
    keys: mx.array,
    q_weight: mx.array,
    k_weight: mx.array,
    eps: float,
) -> Tuple[mx.array, mx.array]:
    """RMSNorm of each query and key head over ``head_dim``.

    ``y = x / sqrt(mean(x^2) + eps) * weight`` (``mx.fast.rms_norm``, fp32
    statistics), as ``nn.RMSNorm`` in the stock layer.

    Args:
        queries: ``[B, L, H, hd]`` float.
        keys: ``[B, L, Hkv, hd]`` float.
        q_weight, k_weight: ``[hd]`` (``q_norm.weight``, ``k_norm.weight``).
        eps: ``rms_norm_eps`` (1e-6 in the checkpoint).

    Returns:
        ``(queries, keys)``, same shapes and dtypes.

    Raises:
        ValueError: wrong ranks, head dims that differ, or weights not ``[hd]``.
    """
    _check_float("qk_norm", "queries", queries, "[B, L, H, hd]", 4)
    _check_float("qk_norm", "keys", keys, "[B, L, Hkv, hd]", 4)
    hd = queries.shape[-1]
    if keys.shape[-1] != hd or keys.shape[:2] != queries.shape[:2]:
        raise ValueError(
            f"qk_norm: keys must have shape [B, L, Hkv, {hd}] matching queries "
            f"{tuple(queries.shape)}, got {tuple(keys.shape)}"
        )
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if tuple(w.shape) != (hd,):
            raise ValueError(
                f"qk_norm: {name} must have shape [{hd}], got {tuple(w.shape)}"
            )
    return mx.fast.rms_norm(queries, q_weight, eps), mx.fast.rms_norm(keys, k_weight, eps)


def _rope_dims(rope) -> int:
    for attr in ("dims", "dim", "_dims"):
        if hasattr(rope, attr):
            return int(getattr(rope, attr))
    raise ValueError(f"partial_rope: cannot tell the rotary dims of {type(rope).__name__}")


def partial_rope(x: mx.array, rope: Callable, offset: Union[int, mx.array] = 0) -> mx.array:
    """Rotary embedding on the first ``rope.dims`` dims of each head.

    Calls mlx-lm's rope module (``initialize_rope(int(hd * 0.25), theta,
    traditional=False, ...)``, an ``nn.RoPE`` for this model, i.e.
    ``mx.fast.rope``). Non-traditional: with ``d = rope.dims``,
    ``f_i = base ** (-2 i / d)``, angle ``a = (offset + t) * f_i`` at position
    ``offset + t``, and for ``i < d/2``::

        y[i]       = x[i] * cos(a) - x[i + d/2] * sin(a)
        y[i + d/2] = x[i + d/2] * cos(a) + x[i] * sin(a)

    Dims ``>= d`` pass through unchanged.

    Args:
        x: ``[B, heads, L, hd]`` float (heads before tokens).
        rope: the layer's ``rope`` module.
        offset: position of token 0 (``cache.offset``): int, or an int32 array
            of shape ``[]`` / ``[B]`` for batched caches.

    Returns:
        ``[B, heads, L, hd]``, dtype of ``x``.

    Raises:
        ValueError: ``x`` not 4-D float, or ``hd < rope.dims``.
    """
    _check_float("partial_rope", "x", x, "[B, heads, L, hd]", 4)
    dims = _rope_dims(rope)
    if x.shape[-1] < dims:
        raise ValueError(
            f"partial_rope: x [B, heads, L, hd] needs hd >= rope dims {dims}, "
            f"got shape {tuple(x.shape)}"
        )
    return rope(x, offset=offset)


def output_gate(attn: mx.array, gate: mx.array) -> mx.array:
    """``attn * sigmoid(gate)``, both ``[B, L, H * hd]``.

    Raises:
        ValueError: shapes differ.
    """
    if tuple(attn.shape) != tuple(gate.shape):
        raise ValueError(
            f"output_gate: gate must have the shape of attn {tuple(attn.shape)} "
            f"([B, L, H * hd]), got {tuple(gate.shape)}"
        )
    return attn * mx.sigmoid(gate)


# ---------------------------------------------------------------------------
# Scaled dot-product attention references
# ---------------------------------------------------------------------------


def _is_quantized(cache) -> bool:
    return cache is not None and hasattr(cache, "bits")


def _dequantize_kv(kv, cache):
    """A quantized cache's ``(w, scales, biases)`` -> float32 ``[..., L, d]``."""
    w, scales, biases = kv
    f32 = mx.float32
    return mx.dequantize(
        w, scales.astype(f32), biases.astype(f32), cache.group_size, cache.bits
    )


def _check_sdpa(fn, queries, keys, values, cache):
    _check_float(fn, "queries", queries, "[B, H, Lq, hd]", 4)
    if _is_quantized(cache):
        kshape, vshape = keys[0].shape, values[0].shape
        if len(kshape) != 4 or len(vshape) != 4:
            raise ValueError(f"{fn}: quantized keys/values must be 4-D (w, scales, biases)")
        kshape = (*kshape[:3], queries.shape[-1])
        vshape = tuple(vshape[:3])
    else:
        _check_float(fn, "keys", keys, "[B, Hkv, Lk, hd]", 4)
        _check_float(fn, "values", values, "[B, Hkv, Lk, hdv]", 4)
        kshape, vshape = keys.shape, values.shape[:3]
    B, H, _, hd = queries.shape
    if kshape[0] != B or kshape[-1] != hd or kshape[1] < 1 or H % kshape[1] != 0:
        raise ValueError(
            f"{fn}: keys must have shape [B={B}, Hkv, Lk, hd={hd}] with H={H} a "
            f"multiple of Hkv, got {tuple(kshape)}"
        )
    if tuple(vshape) != tuple(kshape[:3]):
        raise ValueError(
            f"{fn}: values must have shape [{kshape[0]}, {kshape[1]}, {kshape[2]}, hdv] "
            f"like keys, got {tuple(vshape)}"
        )


def _fold_heads(x: mx.array, num_kv_heads: int) -> mx.array:
    """``[B, H, L, d]`` -> ``[B, Hkv, (H/Hkv)*L, d]``: the query heads sharing a
    KV head (h // (H/Hkv)) become rows of one matmul against that head."""
    B, H, L, d = x.shape
    return x.reshape(B, num_kv_heads, (H // num_kv_heads) * L, d)


def _grouped_mask(mask: mx.array, num_heads: int, num_kv_heads: int) -> mx.array:
    """Array mask broadcastable to ``[B, H, Lq, Lk]`` -> to ``[B, Hkv, rep, Lq, Lk]``."""
    while mask.ndim < 4:
        mask = mx.expand_dims(mask, 0)
    b, h, lq, lk = mask.shape
    if h == 1:
        return mask.reshape(b, 1, 1, lq, lk)
    if h != num_heads:
        raise ValueError(
            f"sdpa: mask must broadcast to [B, H={num_heads}, Lq, Lk], got {tuple(mask.shape)}"
        )
    return mask.reshape(b, num_kv_heads, num_heads // num_kv_heads, lq, lk)


def _apply_mask(scores: mx.array, mask: Optional[mx.array]) -> mx.array:
    if mask is None:
        return scores
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, mx.finfo(scores.dtype).min)
    return scores + mask.astype(scores.dtype)


def _causal(q_pos: mx.array, k_start: int, k_end: int) -> mx.array:
    return q_pos[:, None] >= mx.arange(k_start, k_end)[None]


def sdpa(
    queries: mx.array,
    keys,
    values,
    *,
    scale: float,
    mask: Mask = None,
    cache: Optional[Any] = None,
) -> mx.array:
    """Scaled dot-product attention with grouped KV heads (reference).

    ``out = softmax(scale * q k^T + mask) v`` per query head ``h``, against
    KV head ``h // (H / Hkv)``. Scores, softmax and the value product are
    fp32; the result is cast to the queries' dtype. Same contract as
    ``mlx_lm.models.base.scaled_dot_product_attention``.

    Args:
        queries: ``[B, H, Lq, hd]`` float.
        keys: ``[B, Hkv, Lk, hd]``; with a quantized cache, the cache's
            ``(w, scales, biases)`` tuple (dequantized here).
        values: ``[B, Hkv, Lk, hdv]``, or a tuple as ``keys``.
        scale: multiplies ``q k^T`` (``head_dim ** -0.5``).
        mask: ``None``; ``"causal"`` (query ``i`` sits at position
            ``Lk - Lq + i`` and sees keys ``0..Lk - Lq + i``, i.e. the cached
            prefix plus itself); or an array broadcastable to
            ``[B, H, Lq, Lk]``: bool (True = attend) or additive float.
        cache: the layer's KV cache; only used to detect a quantized cache
            (``bits``, ``group_size``).

    Returns:
        ``[B, H, Lq, hdv]``, dtype of ``queries``.

    Raises:
        ValueError: ranks, batch, head counts (``H % Hkv``) or head dims
            that do not match; a mask that does not broadcast.
    """
    _check_sdpa("sdpa", queries, keys, values, cache)
    if _is_quantized(cache):
        keys = _dequantize_kv(keys, cache)
        values = _dequantize_kv(values, cache)
    B, H, Lq, _ = queries.shape
    Hkv, Lk = keys.shape[1], keys.shape[2]

    rep = H // Hkv
    q = _fold_heads(queries.astype(mx.float32) * scale, Hkv)  # [B, Hkv, rep*Lq, hd]
    scores = q @ keys.astype(mx.float32).swapaxes(-1, -2)
    scores = scores.reshape(B, Hkv, rep, Lq, Lk)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"sdpa: mask must be None, 'causal' or an array, got {mask!r}")
        scores = _apply_mask(scores, _causal(mx.arange(Lk - Lq, Lk), 0, Lk))
    elif mask is not None:
        scores = _apply_mask(scores, _grouped_mask(mask, H, Hkv))
    probs = mx.softmax(scores, axis=-1, precise=True).reshape(B, Hkv, rep * Lq, Lk)
    out = probs @ values.astype(mx.float32)  # [B, Hkv, rep*Lq, hdv]
    return out.reshape(B, H, Lq, -1).astype(queries.dtype)


def sdpa_chunked(
    queries: mx.array,
    keys,
    values,
    *,
    scale: float,
    mask: Mask = None,
    cache: Optional[Any] = None,
    key_block: int = 4096,
) -> mx.array:
    """:func:`sdpa` over blocks of ``key_block`` keys with an online softmax.

    Same contract and result as :func:`sdpa` (up to fp32 rounding), but only
    ``[B, H, Lq, key_block]`` fp32 scores exist per block: a running maximum
    ``m``, normaliser ``l`` and fp32 accumulator are rescaled by
    ``exp(m_old - m_new)`` as each block arrives, and the output is
    ``acc / l`` (flash-attention recurrence). Each block is ordered after
    the previous block's update (``mx.depends``: graph order, no host
    synchronisation), so the lazy graph holds one block of scratch at a time
    and peak memory does not grow with ``Lk``. A quantized cache is
    dequantized one block at a time. Keys masked by a bool mask get the
    finite ``finfo(float32).min`` as in :func:`sdpa`, so a row that is fully
    masked inside one block but not overall stays exact.

    Args:
        queries, keys, values, scale, mask, cache: as :func:`sdpa`.
        key_block: keys per block, ``>= 1`` (e.g. 1024 or 4096).

    Returns:
        ``[B, H, Lq, hdv]``, dtype of ``queries``.

    Raises:
        ValueError: as :func:`sdpa`; ``key_block < 1``; ``Lk == 0``.
    """
    _check_sdpa("sdpa_chunked", queries, keys, values, cache)
    if key_block < 1:
        raise ValueError(f"sdpa_chunked: key_block must be >= 1, got {key_block}")
    quantized = _is_quantized(cache)
    B, H, Lq, _ = queries.shape
    Hkv, Lk = (keys[0] if quantized else keys).shape[1:3]
    if isinstance(mask, str) and mask != "causal":
        raise ValueError(f"sdpa_chunked: mask must be None, 'causal' or an array, got {mask!r}")
    causal = isinstance(mask, str)
    if mask is not None and not causal:
        mask = _grouped_mask(mask, H, Hkv)
    if Lk < 1:
        raise ValueError("sdpa_chunked: keys must hold at least one key (Lk >= 1)")
    q_pos = mx.arange(Lk - Lq, Lk)

    rep = H // Hkv
    q = _fold_heads(queries.astype(mx.float32) * scale, Hkv)  # [B, Hkv, rep*Lq, hd]
    m = mx.full((B, Hkv, rep, Lq, 1), -math.inf, mx.float32)
    l = mx.zeros_like(m)
    acc = None
    for start in range(0, Lk, key_block):
        end = min(start + key_block, Lk)
        if quantized:
            kb = _dequantize_kv(tuple(a[..., start:end, :] for a in keys), cache)
            vb = _dequantize_kv(tuple(a[..., start:end, :] for a in values), cache)
        else:
            kb = keys[..., start:end, :].astype(mx.float32)
            vb = values[..., start:end, :].astype(mx.float32)
        if acc is not None:
            # Order, not data: start this block once the previous one is folded
            # in, so a lazy graph holds one block of scores at a time.
            kb, vb = mx.depends([kb, vb], [acc, l])
        s = (q @ kb.swapaxes(-1, -2)).reshape(B, Hkv, rep, Lq, end - start)
        if causal:
            s = _apply_mask(s, _causal(q_pos, start, end))
        elif mask is not None:
            mb = mask[..., start:end] if mask.shape[-1] != 1 else mask
            s = _apply_mask(s, mb)
        m_new = mx.maximum(m, s.max(axis=-1, keepdims=True))
        # rows with only -inf so far (additive -inf masks): exp(-inf - 0) = 0
        m_ref = mx.where(m_new == -math.inf, 0.0, m_new)
        p = mx.exp(s - m_ref)
        corr = mx.exp(m - m_ref)
        pv = (p.reshape(B, Hkv, rep * Lq, -1) @ vb).reshape(B, Hkv, rep, Lq, -1)
        l = l * corr + p.sum(axis=-1, keepdims=True)
        acc = pv if acc is None else acc * corr + pv
        m = m_new
    out = acc / l
    return out.reshape(B, H, Lq, -1).astype(queries.dtype)


# ---------------------------------------------------------------------------
# The whole layer and its dispatch
# ---------------------------------------------------------------------------


def _input_dims(linear) -> Optional[int]:
    """Input size of a (quantised) linear layer, or of the base layer a
    wrapper holds as ``.linear`` (mlx-lm's LoRA/DoRA layers); None when it
    does not say (the layer then checks its input itself)."""
    linear = getattr(linear, "linear", linear)
    if isinstance(linear, nn.QuantizedLinear):
        return linear.scales.shape[-1] * linear.group_size
    if isinstance(linear, nn.Module) and "weight" in linear:
        return linear.weight.shape[-1]
    return None


def _check_layer_input(fn: str, module, x: mx.array):
    d = _input_dims(module.q_proj)
    if x.ndim != 3 or x.dtype not in _FLOATS or (d is not None and x.shape[-1] != d):
        raise ValueError(
            f"{fn}: x must be a float32/float16/bfloat16 array of shape [B, L, {d}] "
            f"(last axis = hidden size), got shape {tuple(x.shape)} dtype {x.dtype}"
        )


def gated_attention_reference(
    module,
    x: mx.array,
    mask: Mask = None,
    cache: Optional[Any] = None,
    *,
    key_block: Optional[int] = None,
) -> mx.array:
    """The whole gated attention layer from the pieces of this module.

    ``q_proj`` -> :func:`split_query_gate`; ``k_proj``, ``v_proj``;
    :func:`qk_norm`; heads before tokens; :func:`partial_rope` at
    ``cache.offset``; ``cache.update_and_fetch``; :func:`sdpa` (or
    :func:`sdpa_chunked` when ``key_block`` is given); :func:`output_gate`;
    ``o_proj``. Computes what ``Qwen3NextAttention.__call__`` computes.

    Args:
        module: a ``Qwen3NextAttention`` (mlx-lm), possibly quantized.
        x: ``[B, L, D]`` float.
        mask: as :func:`sdpa` (mlx-lm passes ``"causal"`` for prefill,
            ``None`` for one token, or an array).
        cache: a ``KVCache`` / ``QuantizedKVCache`` (updated in place), or None.
        key_block: use :func:`sdpa_chunked` with this block size.

    Returns:
        ``[B, L, D]``, dtype of the projections' output.

    Raises:
        ValueError: ``x`` not ``[B, L, D]`` float with D the hidden size.
    """
    _check_layer_input("gated_attention_reference", module, x)
    B, L, _ = x.shape
    H, Hkv, hd = module.num_attention_heads, module.num_key_value_heads, module.head_dim

    queries, gate = split_query_gate(module.q_proj(x), H, hd)
    keys = module.k_proj(x).reshape(B, L, Hkv, hd)
    values = module.v_proj(x).reshape(B, L, Hkv, -1)
    queries, keys = qk_norm(
        queries, keys, module.q_norm.weight, module.k_norm.weight, module.q_norm.eps
    )
    queries = queries.transpose(0, 2, 1, 3)
    keys = keys.transpose(0, 2, 1, 3)
    values = values.transpose(0, 2, 1, 3)

    offset = cache.offset if cache is not None else 0
    queries = partial_rope(queries, module.rope, offset)
    keys = partial_rope(keys, module.rope, offset)
    if cache is not None:
        keys, values = cache.update_and_fetch(keys, values)

    if key_block is None:
        out = sdpa(queries, keys, values, scale=module.scale, mask=mask, cache=cache)
    else:
        out = sdpa_chunked(
            queries, keys, values, scale=module.scale, mask=mask, cache=cache,
            key_block=key_block,
        )
    out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
    return module.o_proj(output_gate(out, gate))


def _stock(module, x, mask=None, cache=None):
    # The stock class's function, not ``module(x)``: the fast module that calls
    # :func:`gated_attention` is a subclass of the stock one.
    return Qwen3NextAttention.__call__(module, x, mask=mask, cache=cache)


#: name -> fn(module, x, mask, cache). Add a kernel here and pick it in ``_BY_BACKEND``.
IMPLEMENTATIONS: Dict[str, Callable[..., mx.array]] = {
    "stock": _stock,
    "reference": gated_attention_reference,
    "reference_chunked": partial(gated_attention_reference, key_block=4096),
}

# backend -> implementation name (all stock until a kernel beats it).
_BY_BACKEND = {
    _backend.CPU: "stock",
    _backend.CUDA: "stock",
    _backend.METAL: "stock",
}


def implementation_for(num_tokens: int, backend: Optional[str] = None) -> str:
    """Name in :data:`IMPLEMENTATIONS` used for ``num_tokens`` new tokens on ``backend``.

    Args:
        num_tokens: ``B * L`` of the call.
        backend: ``"cpu" | "cuda" | "metal"``; default
            :func:`mlx_qwen_fast.backend.current`.

    Raises:
        ValueError: unknown backend.
    """
    return _BY_BACKEND[_backend.resolve(backend)]


def gated_attention(
    module,
    x: mx.array,
    mask: Mask = None,
    cache: Optional[Any] = None,
    *,
    implementation: Optional[str] = None,
) -> mx.array:
    """Dispatch entry for the gated attention layer (what the fast module calls).

    Args:
        module: a ``Qwen3NextAttention``.
        x: ``[B, L, D]`` float.
        mask, cache: as ``Qwen3NextAttention.__call__``.
        implementation: force a name from :data:`IMPLEMENTATIONS`; default
            :func:`implementation_for` the token count and current backend.

    Returns:
        ``[B, L, D]``, as ``Qwen3NextAttention.__call__``.

    Raises:
        ValueError: bad ``x`` or unknown ``implementation``.
    """
    _check_layer_input("gated_attention", module, x)
    if implementation is None:
        implementation = implementation_for(x.shape[0] * x.shape[1])
    try:
        fn = IMPLEMENTATIONS[implementation]
    except KeyError:
        raise ValueError(
            f"gated_attention: implementation must be one of "
            f"{sorted(IMPLEMENTATIONS)}, got {implementation!r}"
        ) from None
    return fn(module, x, mask, cache)
