"""The argument contract of gated attention decode that the CUDA and the Metal kernels share.

One query token per row, head_dim :data:`DH` = 256, after the
concatenated q|k|v projection (CUDA:
:mod:`~mlx_qwen_fast.kernels.attention_decode`; Metal:
:mod:`~mlx_qwen_fast.kernels.attention_decode_metal`): the projection's
width (:func:`proj_width`) and the argument checks of one step
(:func:`check_step`). Backend-neutral: reads only types, shapes, dtypes and
Python numbers; no kernel, no backend check, no host synchronisation.
"""

from __future__ import annotations

import math
from typing import Tuple

import mlx.core as mx

from . import _checks

__all__ = ["DH", "FLOAT_DTYPES", "check_cache_step", "check_heads", "check_step", "heads_ok", "proj_width"]

#: The head dimension the kernels take.
DH = 256
#: The activations' and cache buffers' dtypes the kernels take.
FLOAT_DTYPES = (mx.bfloat16, mx.float16, mx.float32)
_ARRAYS = (("proj", "[B, 1, P] (float)", False), ("keys", f"[B, Hkv, capacity, {DH}]", False),
           ("values", f"[B, Hkv, capacity, {DH}]", False), ("offset", "int32 scalar", False),
           ("q_norm_weight", f"[{DH}] (float)", False), ("k_norm_weight", f"[{DH}] (float)", False))


def proj_width(num_heads: int, num_kv_heads: int) -> int:
    """Last-axis size of the concatenated projection: query and gate
    (``2 * Hq * 256``), then keys and values (``Hkv * 256`` each)."""
    return 2 * num_heads * DH + 2 * num_kv_heads * DH


def check_step(fn: str, proj, keys, values, offset, q_norm_weight, k_norm_weight, hq, hkv, scale, q_eps,
               k_eps, rope_dims, rope_base, rope_scale, *, max_group: int) -> Tuple[float, float]:
    """The argument checks of one decode step (the CUDA kernels'
    :func:`~mlx_qwen_fast.kernels.attention_decode.attention_decode`, the
    Metal kernels' :func:`~mlx_qwen_fast.kernels.attention_decode_metal.attention_decode_metal`).

    Args:
      fn: the caller's name, first in every message.
      proj: ``[B, 1, proj_width(hq, hkv)]`` float (:data:`FLOAT_DTYPES`).
      keys, values: ``[B, hkv, capacity >= 1, 256]`` of proj's dtype, one shape.
      offset: 0-d int32.
      q_norm_weight, k_norm_weight: ``[256]``, one float dtype.
      hq, hkv: query and KV heads, ints, ``hq`` a multiple of ``hkv > 0``
        with at most ``max_group`` query heads per KV head (the kernel's
        limit: 16 on CUDA, 8 on Metal).
      scale, rope_base, rope_scale: finite numbers > 0.
      q_eps, k_eps: finite floats in ``(0, 1)``.
      rope_dims: an even int in ``[2, 256]``.

    Returns:
      ``(q_eps, k_eps)`` as floats.

    Raises:
      ValueError: ``fn: `` first, naming the first argument that is not an
        mx.array or is outside the above (``num_heads`` for ``hq``/``hkv``).
    """
    _checks.check_arrays(fn, _ARRAYS, proj, keys, values, offset, q_norm_weight, k_norm_weight)
    check_heads(fn, hq, hkv, max_group)
    P = proj_width(hq, hkv)
    if proj.ndim != 3 or proj.shape[1] != 1 or proj.shape[2] != P or proj.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{fn}: proj must be a float array of shape [B, 1, {P}], got "
                         f"{proj.dtype} {tuple(proj.shape)}")
    return _check_cache(fn, proj.shape[0], proj.dtype, keys, values, offset, q_norm_weight, k_norm_weight, hkv,
                        scale, q_eps, k_eps, rope_dims, rope_base, rope_scale)


def heads_ok(hq, hkv, max_group: int) -> bool:
    """Whether ``hq`` query and ``hkv`` KV heads are positive ints (not
    bools: a kernel's build takes them as macros), ``hq`` a multiple of
    ``hkv`` with at most ``max_group`` query heads per KV head."""
    return type(hq) is int and type(hkv) is int and hq > 0 and hkv > 0 and hq % hkv == 0 and hq // hkv <= max_group


def check_heads(fn: str, hq, hkv, max_group: int) -> None:
    """ValueError naming ``num_heads`` (``fn: `` first) where not
    :func:`heads_ok`."""
    if not heads_ok(hq, hkv, max_group):
        raise ValueError(f"{fn}: num_heads ({hq!r}) must be a multiple of num_kv_heads ({hkv!r}), "
                         f"at most {max_group} query heads per KV head")


def check_cache_step(fn: str, B: int, dtype, keys, values, offset, q_norm_weight, k_norm_weight, hq, hkv, scale,
                     q_eps, k_eps, rope_dims, rope_base, rope_scale, *, max_group: int) -> Tuple[float, float]:
    """:func:`check_step` for a caller whose projection is not an argument
    (a kernel that computes it: ``B`` rows of ``dtype``): the same checks of
    every other argument, the same errors. Returns ``(q_eps, k_eps)``."""
    _checks.check_arrays(fn, _ARRAYS[1:], keys, values, offset, q_norm_weight, k_norm_weight)
    check_heads(fn, hq, hkv, max_group)
    return _check_cache(fn, B, dtype, keys, values, offset, q_norm_weight, k_norm_weight, hkv, scale, q_eps, k_eps,
                        rope_dims, rope_base, rope_scale)


def _check_cache(fn, B, dtype, keys, values, offset, q_norm_weight, k_norm_weight, hkv, scale, q_eps, k_eps,
                 rope_dims, rope_base, rope_scale) -> Tuple[float, float]:
    eps = (_checks.check_eps(fn, "q_eps", q_eps), _checks.check_eps(fn, "k_eps", k_eps))
    for name, t in (("keys", keys), ("values", values)):
        if t.ndim != 4 or tuple(t.shape[:2]) != (B, hkv) or t.shape[3] != DH or t.shape[2] < 1 or (
                t.dtype != dtype):
            raise ValueError(f"{fn}: {name} must be {dtype} of shape [{B}, {hkv}, capacity >= 1, {DH}], "
                             f"got {t.dtype} {tuple(t.shape)}")
    if values.shape != keys.shape:
        raise ValueError(f"{fn}: values must have the shape of keys {tuple(keys.shape)}, got {tuple(values.shape)}")
    if offset.ndim != 0 or offset.dtype != mx.int32:
        raise ValueError(f"{fn}: offset must be a 0-d int32 array, got {offset.dtype} {tuple(offset.shape)}")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w.shape != (DH,) or w.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{fn}: {name} must be a float array of shape [{DH}], got {w.dtype} {tuple(w.shape)}")
    if q_norm_weight.dtype != k_norm_weight.dtype:
        raise ValueError(f"{fn}: q_norm_weight and k_norm_weight must share a dtype, got "
                         f"{q_norm_weight.dtype} and {k_norm_weight.dtype}")
    if not (isinstance(rope_dims, int) and 0 < rope_dims <= DH and rope_dims % 2 == 0):
        raise ValueError(f"{fn}: rope_dims must be an even int in [2, {DH}], got {rope_dims!r}")
    for name, v in (("scale", scale), ("rope_base", rope_base), ("rope_scale", rope_scale)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"{fn}: {name} must be a finite number > 0, got {v!r}")
    return eps
