"""Gated attention: contracts, references and dispatch of the decode step
(one query token per row) and of the prefill's causal attention.

Decode: the part of mlx-lm's ``Qwen3NextAttention.__call__`` (mlx_lm/models/
qwen3_next.py, used by qwen3_5) between the concatenated q|k|v projection
and ``o_proj``, for T = 1 with a plain ``KVCache`` whose buffers have room
at the offset:

=================  =========================  ================================
argument           shape                      dtype / meaning
=================  =========================  ================================
proj               [B, 1, 2*Hq*Dh + 2*Hkv*Dh]  float; per row: each query
                                              head's query (Dh) then its gate
                                              (Dh), then the KV heads' keys
                                              and values (Dh each)
keys, values       [B, Hkv, capacity, Dh]     proj's dtype; the cache buffers,
                                              positions [0, offset) written
offset             0-d                        int32; this token's position,
                                              in [0, capacity)
q/k_norm_weight    [Dh]                       the q/k RMSNorm weights
returns out        [B, 1, Hq*Dh]              proj's dtype: attention output
                                              times sigmoid(gate)
returns keys,      [B, Hkv, capacity, Dh]     the buffers with this token's
values                                        key and value at ``offset``
=================  =========================  ================================

``q = rope(rms_norm(query)), k = rope(rms_norm(key))`` at position
``offset``, ``o = softmax(scale * q K[0..offset]^T) V[0..offset]`` (query
head h reads KV head ``h // (Hq / Hkv)``), ``out = o * sigmoid(gate)``.

:func:`decode_attention_reference` is that computation in MLX ops, as the
stock module runs it (each op rounding to the activation dtype). The one
dispatcher, :func:`decode_attention`, runs the CUDA kernels of
:mod:`mlx_qwen_fast.kernels.attention_decode` where they apply (head_dim
256, :data:`mlx_qwen_fast.config.ATTENTION_DECODE_KERNEL` on), the Metal
kernels of :mod:`mlx_qwen_fast.kernels.attention_decode_metal` where those
apply (head_dim 256, at most 8 query heads per KV head,
:data:`mlx_qwen_fast.config.METAL_KERNELS` on) and the reference elsewhere.

The module: :func:`gated_attention` is the dispatch entry of the fast
gated-attention module (:class:`mlx_qwen_fast.layers.FastAttention`), as
:func:`mlx_qwen_fast.ops.gated_delta.gated_delta_net` and
:func:`mlx_qwen_fast.ops.moe.sparse_moe` are of theirs: the prefill's
kernel where it applies, mlx-lm's module elsewhere. Its one-token step
runs inside the decoder layer's compiled step
(:mod:`mlx_qwen_fast.ops.decoder`), from :func:`decode_step_parts` (which
modules take it, their arrays and settings) and :func:`decode_step` (the
step, the input RMSNorm and the residual included).

Prefill (a chunk of T queries per row): the scaled dot-product attention
that ``Qwen3NextAttention.__call__`` runs with ``mask="causal"`` once q/k/v
are normalised, rotated and written into the cache:

=================  =========================  ================================
argument           shape                      dtype / meaning
=================  =========================  ================================
queries            [B, Hq, T, Dh]             float; the chunk's queries at
                                              positions offset .. offset+T-1
keys, values       [B, Hkv, L, Dh]            queries' dtype; the cache, this
                                              chunk's rows included; L >=
                                              offset + T (positions from
                                              offset + T on are ignored)
offset             int                        the first query's position
scale              float                      the softmax scale
returns            [B, Hq, T, Dh]             queries' dtype
=================  =========================  ================================

``out[t] = softmax(scale * q[t] K[0..offset+t]^T) V[0..offset+t]`` per head
(query head h reads KV head ``h // (Hq / Hkv)``). With ``L == offset + T``
this is exactly ``mx.fast.scaled_dot_product_attention(..., mask="causal")``
(MLX aligns a causal mask's queries with the last keys), which
:func:`prefill_attention_reference` runs; :func:`prefill_attention` runs
the flash-attention kernel of :mod:`mlx_qwen_fast.kernels.attention_prefill`
where it applies (CUDA, head_dim 256, bf16/f16,
:data:`mlx_qwen_fast.config.ATTENTION_PREFILL_KERNEL` on) and the reference
elsewhere.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3_next import Qwen3NextAttention

from .. import backend as _backend
from .. import config
from ..compiled import concat_linears, linear_arrays, linear_paths
from . import linear as linear_ops
from ._checks import check_attention_module, check_int, is_int
from ..kernels import _cuda_build
from ..kernels._cache_rows import row_index, write_rows
from ..kernels._checks import check_eps
from ..kernels import attention_decode as _k_decode
from ..kernels import attention_decode_metal as _k_decode_metal
from ..kernels import attention_prefill as _k_prefill

__all__ = ["IMPLEMENTATIONS", "DecodeStatic", "DecodeStepParts", "decode_attention", "decode_attention_reference",
           "decode_attention_unchecked", "decode_implementation", "decode_step", "decode_step_parts",
           "gated_attention", "implementation_for", "prefill_attention", "prefill_attention_reference",
           "prefill_implementation"]

def _describe(a) -> str:
    return f"{a.dtype} {tuple(a.shape)}" if isinstance(a, mx.array) else type(a).__name__


#: What :func:`decode_attention` and :func:`prefill_attention` can run: the
#: kernels (the Metal ones for decode only) or the reference ops.
IMPLEMENTATIONS = ("cuda-kernel", "metal-kernel", "reference")


def decode_attention_reference(
    proj: mx.array,
    keys: mx.array,
    values: mx.array,
    offset: mx.array,
    q_norm_weight: mx.array,
    k_norm_weight: mx.array,
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    q_eps: float,
    k_eps: float,
    rope_dims: int,
    rope_traditional: bool = False,
    rope_base: float = 10000.0,
    rope_scale: float = 1.0,
) -> Tuple[mx.array, mx.array, mx.array]:
    """The module's contract (above) in MLX ops: the ops and roundings of
    ``Qwen3NextAttention.__call__`` (mlx-lm 0.32.2), the cache written at
    ``offset`` (``kernels._cache_rows``) and the attention taken over the
    whole buffer with the positions past ``offset`` masked. Any head_dim;
    the buffers' capacity is the only shape the graph depends on. Unchecked
    (traceable): an ``offset`` outside ``[0, capacity)`` gives an
    unspecified result, but the row written is the offset clamped into the
    buffers, as in the kernels, so nothing outside them is written."""
    B, dh = proj.shape[0], keys.shape[-1]
    nq, nk = 2 * num_heads * dh, num_kv_heads * dh
    queries, gate = mx.split(proj[..., :nq].reshape(B, 1, num_heads, -1), 2, axis=-1)
    gate = gate.reshape(B, 1, -1)
    k = proj[..., nq:nq + nk].reshape(B, 1, num_kv_heads, -1)
    v = proj[..., nq + nk:].reshape(B, 1, num_kv_heads, -1)
    queries = mx.fast.rms_norm(queries, q_norm_weight, q_eps).transpose(0, 2, 1, 3)
    k = mx.fast.rms_norm(k, k_norm_weight, k_eps).transpose(0, 2, 1, 3)
    v = v.transpose(0, 2, 1, 3)
    rope = dict(traditional=rope_traditional, base=rope_base, scale=rope_scale, offset=offset)
    queries = mx.fast.rope(queries, rope_dims, **rope)
    k = mx.fast.rope(k, rope_dims, **rope)
    # the row written is the offset clamped into the buffer, as the kernels write it
    index = row_index(offset, 1, keys.shape[2])
    keys, values = write_rows(keys, k, index), write_rows(values, v, index)
    mask = mx.arange(keys.shape[2]) <= offset  # the positions written so far, this one included
    out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    out = out.transpose(0, 2, 1, 3).reshape(B, 1, -1)
    return out * mx.sigmoid(gate), keys, values


def decode_implementation(proj, keys, values, *, num_heads: int, num_kv_heads: int, head_dim: int,
                          backend: Optional[str] = None) -> str:
    """The name in :data:`IMPLEMENTATIONS` that :func:`decode_attention`
    runs for these arrays (shape checks only: nothing is evaluated)."""
    name = _backend.resolve(backend)
    heads = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    if (name == _backend.CUDA and config.ATTENTION_DECODE_KERNEL.get()
            and _k_decode.supports(proj, keys, values, **heads)):
        return "cuda-kernel"
    if (name == _backend.METAL and config.METAL_KERNELS.get()
            and _k_decode_metal.supports(proj, keys, values, **heads)):
        return "metal-kernel"
    return "reference"


def decode_attention(proj, keys, values, offset, q_norm_weight, k_norm_weight, **settings):
    """The contract above, by :func:`decode_implementation`'s choice: the
    CUDA kernels (:func:`mlx_qwen_fast.kernels.attention_decode.attention_decode`),
    the Metal kernels
    (:func:`mlx_qwen_fast.kernels.attention_decode_metal.attention_decode_metal`)
    or :func:`decode_attention_reference`. ``settings``: the keyword
    arguments of :func:`decode_attention_reference` (``num_heads``,
    ``num_kv_heads``, ``scale``, ``q_eps``, ``k_eps``, ``rope_dims`` required).

    The arguments are checked first, ``offset``'s value included (it is
    evaluated: not for use inside ``mx.compile``; the traced decode step
    calls :func:`decode_attention_unchecked`).

    Raises:
      ValueError: an argument outside the contract (named): not an
        mx.array, a shape, dtype or head count that does not fit, ``offset``
        not a 0-d integer array in ``[0, capacity)``, a missing setting.
    """
    _check_decode(proj, keys, values, offset, q_norm_weight, k_norm_weight, settings)
    return decode_attention_unchecked(proj, keys, values, offset, q_norm_weight, k_norm_weight, **settings)


def _check_decode(proj, keys, values, offset, q_norm_weight, k_norm_weight, settings) -> None:
    fn = "decode_attention"
    named = (("proj", proj), ("keys", keys), ("values", values), ("offset", offset),
             ("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight))
    for name, a in named:
        if not isinstance(a, mx.array):
            raise ValueError(f"{fn}: {name} must be an mx.array, got {type(a).__name__}")
    for name in ("num_heads", "num_kv_heads", "scale", "q_eps", "k_eps", "rope_dims"):
        if name not in settings:
            raise ValueError(f"{fn}: the setting {name} is required")
    unknown = sorted(set(settings) - _DECODE_SETTINGS)
    if unknown:
        raise ValueError(f"{fn}: unknown setting(s) {unknown}; the settings are {sorted(_DECODE_SETTINGS)}")
    hq, hkv = settings["num_heads"], settings["num_kv_heads"]
    if not (is_int(hq) and is_int(hkv) and hkv > 0 and hq > 0 and hq % hkv == 0):
        raise ValueError(f"{fn}: num_heads ({hq!r}) must be a positive multiple of num_kv_heads ({hkv!r}), "
                         "both ints")
    if keys.ndim != 4 or keys.shape[0] < 1 or keys.shape[2] < 1 or keys.shape[1] != hkv or keys.dtype not in _FLOATS:
        raise ValueError(f"{fn}: keys must be a float array of shape [B >= 1, {hkv}, capacity >= 1, head_dim], "
                         f"got {keys.dtype} {tuple(keys.shape)}")
    B, dh = keys.shape[0], keys.shape[3]
    scale = settings["scale"]
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{fn}: scale must be a finite number > 0, got {scale!r}")
    check_eps(fn, "q_eps", settings["q_eps"])
    check_eps(fn, "k_eps", settings["k_eps"])
    check_int(fn, "rope_dims", settings["rope_dims"], 2, dh)
    if settings["rope_dims"] % 2:
        raise ValueError(f"{fn}: rope_dims must be even (RoPE rotates pairs), got {settings['rope_dims']!r}")
    width = 2 * (hq + hkv) * dh
    if proj.shape != (B, 1, width) or proj.dtype != keys.dtype:
        raise ValueError(f"{fn}: proj must be {keys.dtype} of shape [{B}, 1, {width}] (2 * (num_heads + "
                         f"num_kv_heads) * head_dim), got {proj.dtype} {tuple(proj.shape)}")
    if values.shape != keys.shape or values.dtype != keys.dtype:
        raise ValueError(f"{fn}: values must be {keys.dtype} of the shape of keys {tuple(keys.shape)}, got "
                         f"{values.dtype} {tuple(values.shape)}")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w.shape != (dh,) or w.dtype not in _FLOATS:
            raise ValueError(f"{fn}: {name} must be a float array of shape [{dh}], got {w.dtype} {tuple(w.shape)}")
    if offset.ndim != 0 or offset.dtype != mx.int32:
        raise ValueError(f"{fn}: offset must be a 0-d int32 array, got {offset.dtype} {tuple(offset.shape)}")
    at = offset.item()
    if not 0 <= at < keys.shape[2]:
        raise ValueError(f"{fn}: offset must be in [0, {keys.shape[2]}) (the buffers' capacity: the caller makes "
                         f"room), got {at}")


_FLOATS = (mx.float32, mx.float16, mx.bfloat16)
#: The keyword settings of :func:`decode_attention_reference` (the decode contract's).
_DECODE_SETTINGS = frozenset({"num_heads", "num_kv_heads", "scale", "q_eps", "k_eps", "rope_dims",
                              "rope_traditional", "rope_base", "rope_scale"})


def decode_attention_unchecked(proj, keys, values, offset, q_norm_weight, k_norm_weight, **settings):
    """:func:`decode_attention` without its argument checks, for a traced
    step (``offset`` cannot be read there): the kernels check shapes
    themselves; an ``offset`` outside ``[0, capacity)`` gives an unspecified
    result but writes nothing outside the buffers (every implementation
    clamps the row it writes)."""
    impl = decode_implementation(proj, keys, values, num_heads=settings.get("num_heads"),
                                 num_kv_heads=settings.get("num_kv_heads"),
                                 head_dim=keys.shape[-1] if isinstance(keys, mx.array) and keys.ndim else 0)
    fn = {"cuda-kernel": _k_decode.attention_decode,
          "metal-kernel": _k_decode_metal.attention_decode_metal}.get(impl, decode_attention_reference)
    return fn(proj, keys, values, offset, q_norm_weight, k_norm_weight, **settings)


def prefill_attention_reference(queries: mx.array, keys: mx.array, values: mx.array, *, scale: float,
                                offset: int) -> mx.array:
    """The prefill contract (above) in MLX ops: MLX's fused attention entry
    with the causal mask over the first ``offset + T`` positions, which is
    the stock module's call when the cache holds exactly those. Any head_dim
    and dtype."""
    end = offset + queries.shape[2]
    if keys.shape[2] != end:
        keys, values = keys[:, :, :end], values[:, :, :end]
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask="causal")


def prefill_implementation(queries, keys, values, *, offset: int, backend: Optional[str] = None) -> str:
    """The name in :data:`IMPLEMENTATIONS` that :func:`prefill_attention`
    runs for these arrays (shape checks only: nothing is evaluated)."""
    if (_backend.resolve(backend) == _backend.CUDA and config.ATTENTION_PREFILL_KERNEL.get()
            and _k_prefill.supports(queries, keys, values, offset=offset)):
        return "cuda-kernel"
    return "reference"


def prefill_attention(queries, keys, values, *, scale: float, offset: int) -> mx.array:
    """The prefill contract above, by :func:`prefill_implementation`'s
    choice: the flash-attention kernel
    (:func:`mlx_qwen_fast.kernels.attention_prefill.attention_prefill`) or
    :func:`prefill_attention_reference`. Returns [B, Hq, T, Dh] in
    queries' dtype (the kernel's is a transposed view of a [B, T, Hq, Dh]
    buffer).

    Raises:
      ValueError: an argument outside the contract (named): not an
        mx.array, shapes that do not fit (4-d, one batch and head_dim, query
        heads a multiple of KV heads), ``offset`` not an int with ``0 <=
        offset`` and ``offset + T <= L``, ``scale`` not a finite number > 0.
    """
    fn = "prefill_attention"
    for name, a in (("queries", queries), ("keys", keys), ("values", values)):
        if not isinstance(a, mx.array) or a.ndim != 4 or a.dtype not in _FLOATS:
            raise ValueError(f"{fn}: {name} must be a 4-d float mx.array, got {_describe(a)}")
    B, hq, T, dh = queries.shape
    if (keys.shape[0] != B or keys.shape[3] != dh or keys.shape[1] < 1 or hq % keys.shape[1]
            or keys.dtype != queries.dtype):
        raise ValueError(f"{fn}: keys must be {queries.dtype} of shape [{B}, Hkv, L, {dh}] with {hq} query heads "
                         f"a multiple of Hkv, got {_describe(keys)}")
    if values.shape != keys.shape or values.dtype != keys.dtype:
        raise ValueError(f"{fn}: values must be {keys.dtype} of the shape of keys {tuple(keys.shape)}, got "
                         f"{_describe(values)}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0 or offset + T > keys.shape[2]:
        raise ValueError(f"{fn}: offset must be an int with 0 <= offset and offset + {T} (queries) <= "
                         f"{keys.shape[2]} (keys), got {offset!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{fn}: scale must be a finite number > 0, got {scale!r}")
    if prefill_implementation(queries, keys, values, offset=offset) == "cuda-kernel":
        return _k_prefill.attention_prefill(queries, keys, values, scale=scale, offset=offset)
    return prefill_attention_reference(queries, keys, values, scale=scale, offset=offset)


def implementation_for(num_tokens: int, backend: Optional[str] = None) -> str:
    """The implementation a head_dim-256 model's gated attention gets on
    ``backend`` for calls of ``num_tokens`` tokens per row: decode (1) is
    "cuda-kernel", "metal-kernel" (up to 8 query heads per KV head, as the
    model's 16 / 2) or "reference" (the decoder layer step's); prefill
    (more) is "cuda-kernel" (:class:`mlx_qwen_fast.layers.FastAttention`
    with the flash-attention kernel) or "stock" (mlx-lm's module). Raises
    ValueError for an unknown backend."""
    name = _backend.resolve(backend)
    cuda = name == _backend.CUDA and _cuda_build.cuda_available()
    if num_tokens != 1:
        return "cuda-kernel" if cuda and config.ATTENTION_PREFILL_KERNEL.get() else "stock"
    if cuda and config.ATTENTION_DECODE_KERNEL.get():
        return "cuda-kernel"
    if name == _backend.METAL and mx.metal.is_available() and config.METAL_KERNELS.get():
        return "metal-kernel"
    return "reference"


# ---------------------------------------------------------------------------
# the gated-attention module: its dispatch entry and its decode step's parts
# ---------------------------------------------------------------------------


def gated_attention(attn, x: mx.array, mask: Optional[Any] = None, cache: Optional[Any] = None) -> mx.array:
    """``Qwen3NextAttention.__call__`` (mlx_lm/models/qwen3_next.py) through
    this module: the dispatch entry of :class:`mlx_qwen_fast.layers.FastAttention`.

    A prefill chunk -- more than one token per row, the causal mask (the
    string ``"causal"``, as mlx-lm's ``create_attention_mask`` gives a plain
    prompt), no cache or a plain ``KVCache``, and
    :func:`implementation_for` naming the kernel (CUDA, the switch on) --
    computes q, k and v as the stock module does (projections, q/k RMSNorm,
    RoPE at the cache offset, ``cache.update_and_fetch``) and its attention
    with :func:`prefill_attention` over the cache's whole buffers at the
    chunk's offset; the gate and ``o_proj`` follow as in stock (the four
    projections through :func:`mlx_qwen_fast.ops.linear.prefill_linear`). Every other
    call -- one token per row (the decoder layer's compiled step,
    :func:`mlx_qwen_fast.ops.layer_plans.decode_layer`, runs those through
    :func:`decode_step_parts`; where it declines, the stock module), a mask
    array, quantised, rotating or batched caches, the CPU and Metal -- is
    mlx-lm's own ``__call__``.

    Args:
        attn: an mlx-lm ``Qwen3NextAttention``.
        x: ``[B, T, D]`` hidden states.
        mask: None, ``"causal"`` or a mask array, as mlx-lm passes it.
        cache: None or the layer's mlx-lm cache; updated in place and
            advanced by T, as the stock call does.

    Returns:
        ``[B, T, D]``, as ``Qwen3NextAttention.__call__``.

    Raises:
        ValueError: ``attn`` not a ``Qwen3NextAttention``, ``x`` not a float
            ``[B, T, D]`` of the projections' input size (named).
    """
    check_attention_module("gated_attention", attn, x)
    B, T, _ = x.shape
    if not (T > 1 and isinstance(mask, str) and mask == "causal"
            and (cache is None or type(cache) is KVCache)
            and implementation_for(T) == "cuda-kernel"):
        return Qwen3NextAttention.__call__(attn, x, mask, cache)
    queries, gate = mx.split(linear_ops.prefill_linear(attn.q_proj, x).reshape(B, T, attn.num_attention_heads, -1), 2, axis=-1)
    gate = gate.reshape(B, T, -1)
    keys, values = linear_ops.prefill_linear(attn.k_proj, x), linear_ops.prefill_linear(attn.v_proj, x)
    queries = attn.q_norm(queries).transpose(0, 2, 1, 3)
    keys = attn.k_norm(keys.reshape(B, T, attn.num_key_value_heads, -1)).transpose(0, 2, 1, 3)
    values = values.reshape(B, T, attn.num_key_value_heads, -1).transpose(0, 2, 1, 3)
    offset = 0 if cache is None else cache.offset
    queries = attn.rope(queries, offset=offset)
    keys = attn.rope(keys, offset=offset)
    if cache is not None:
        cache.update_and_fetch(keys, values)
        keys, values = cache.keys, cache.values  # positions [0, offset + T) hold the context
    output = prefill_attention(queries, keys, values, scale=attn.scale, offset=offset)
    output = output.transpose(0, 2, 1, 3).reshape(B, T, -1)
    return linear_ops.prefill_linear(attn.o_proj, output * mx.sigmoid(gate))


class DecodeStatic(NamedTuple):
    """The settings a gated-attention decode step bakes into its trace
    (hashable: part of the compiled step's key)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_eps: float
    k_eps: float
    scale: float
    #: (dims, traditional, base, scale) of the module's ``nn.RoPE``
    rope: Tuple[int, bool, float, float]
    #: (number of arrays, linear static) of the concatenated q|k|v projection
    qkv: Tuple[int, tuple]
    #: (number of arrays, linear static) of ``o_proj``
    o_proj: Tuple[int, tuple]


class DecodeStepParts(NamedTuple):
    """What :func:`decode_step_parts` found for one module."""

    #: paths (under the module) of the arrays read at call time: q/k norm
    #: weights, ``o_proj``'s arrays (the first ``2 + static.o_proj[0]``),
    #: then the three projections' arrays, which only decide the plan
    paths: Tuple[Tuple[str, ...], ...]
    #: the concatenated q|k|v arrays (new arrays: ~ the three projections' bytes again)
    extra: Tuple[mx.array, ...]
    static: DecodeStatic


_PROJ = ("q_proj", "k_proj", "v_proj")


def decode_step_parts(attn) -> Optional[DecodeStepParts]:
    """The arrays and static settings of a gated-attention module's decode
    step (:func:`decode_step`), for a caller that traces it inside its own
    compiled function (:func:`mlx_qwen_fast.ops.layer_plans.decode_layer`); None
    where the step does not apply: a projection that is not a plain or
    quantised linear layer (LoRA), q/k/v of unlike quantisation, a RoPE
    other than ``nn.RoPE``, a sharded module. Evaluates the concatenated
    projection (new arrays). Raises ValueError when ``attn`` is not an
    mlx-lm ``Qwen3NextAttention``."""
    check_attention_module("decode_step_parts", attn)
    if getattr(attn, "sharding_group", None) is not None or type(attn.rope) is not nn.RoPE:
        return None
    lins = [linear_arrays(getattr(attn, n)) for n in _PROJ + ("o_proj",)]
    if any(lin is None for lin in lins):
        return None
    qkv = concat_linears(lins[:3])
    if qkv is None:
        return None
    rope = attn.rope
    static = DecodeStatic(
        int(attn.num_attention_heads), int(attn.num_key_value_heads), int(attn.head_dim),
        float(attn.q_norm.eps), float(attn.k_norm.eps), float(attn.scale),
        (int(rope.dims), bool(rope.traditional), float(rope.base), float(rope.scale)),
        (len(qkv[0]), qkv[1]), (len(lins[3][0]), lins[3][1]),
    )
    paths = (("q_norm", "weight"), ("k_norm", "weight")) + linear_paths(("o_proj",), lins[3])
    paths += tuple(p for n, lin in zip(_PROJ, lins[:3]) for p in linear_paths((n,), lin))
    return DecodeStepParts(paths, tuple(qkv[0]), static)


def decode_step(static: DecodeStatic, x: mx.array, norm: Tuple[mx.array, float], keys: mx.array,
                values: mx.array, offset: mx.array, q_norm_weight: mx.array, k_norm_weight: mx.array,
                flat: Tuple[mx.array, ...], residual: bool = True) -> Tuple[mx.array, mx.array, mx.array]:
    """The gated attention of one token per row with its residual (traced:
    the offset is data; nothing is checked).

    Args:
        static: :class:`DecodeStatic` of the module.
        x: ``[B, 1, D]`` hidden states before the layer's input RMSNorm.
        norm: (the input RMSNorm's weight ``[D]``, eps).
        keys, values: ``[B, Hkv, capacity, Dh]`` the KV cache's buffers.
        offset: 0-d int32, this token's position, in ``[0, capacity)``.
        q_norm_weight, k_norm_weight: ``[Dh]``.
        flat: ``o_proj``'s arrays, then the concatenated q|k|v arrays.
        residual: add ``x`` to the result (False: ``o_proj``'s output
            alone, for a caller that adds it with the next RMSNorm:
            :func:`mlx_qwen_fast.ops.linear.add_rms_norm`).

    Returns:
        ``(x + o_proj(attention(rms_norm(x, *norm))) [B, 1, D], keys,
        values)`` (without ``x +`` where ``residual`` is False) with the new
        K/V row written at ``offset``. The norm is fused into the q|k|v GEMV
        and the residual into ``o_proj``'s
        (:func:`mlx_qwen_fast.ops.linear.decode_linear`); the part between
        the projections is :func:`decode_attention_unchecked`.
    """
    (dims, traditional, base, rscale), (n_qkv, qkv_s), (n_o, o_s) = static.rope, static.qkv, static.o_proj
    proj = linear_ops.decode_linear(x, flat[n_o:n_o + n_qkv], qkv_s, norm=norm)
    out, keys, values = decode_attention_unchecked(
        proj, keys, values, offset, q_norm_weight, k_norm_weight, num_heads=static.num_heads,
        num_kv_heads=static.num_kv_heads, scale=static.scale, q_eps=static.q_eps, k_eps=static.k_eps,
        rope_dims=dims, rope_traditional=traditional, rope_base=base, rope_scale=rscale)
    return linear_ops.decode_linear(out, flat[:n_o], o_s, residual=x if residual else None), keys, values
