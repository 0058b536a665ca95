"""Argument checks shared by the op families (shape / dtype / Python-int
checks only: nothing here evaluates an array, so they hold inside
``mx.compile`` traces and cost a few attribute reads on a per-token path).

Every check raises one ``ValueError`` whose message starts with the public
function's name, then names the argument, what it must be and what was
passed (the style of :func:`mlx_qwen_fast.kernels._checks.check_arrays`,
whose :func:`~mlx_qwen_fast.kernels._checks.describe` names the value).
The op families' own checks live next to them
(:mod:`mlx_qwen_fast.ops.gated_delta.checks`,
:mod:`mlx_qwen_fast.ops.moe.checks`).
"""

from __future__ import annotations

import numbers
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..kernels._checks import describe

FLOATS = (mx.float32, mx.float16, mx.bfloat16)


def fail(fn: str, message: str):
    """Raise ``ValueError("<fn>: <message>")``."""
    raise ValueError(f"{fn}: {message}")


def is_int(value) -> bool:
    """A Python (or numpy) integer that is not a bool."""
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def check_int(fn: str, name: str, value, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    """``value`` as an int if it is an integer (not a bool) in ``[lo, hi]``
    (either bound may be None), else ValueError naming it."""
    if not is_int(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = (f" in [{lo}, {hi}]" if lo is not None and hi is not None
                  else f" >= {lo}" if lo is not None else f" <= {hi}" if hi is not None else "")
        fail(fn, f"{name} must be an int{bounds}, got {value!r}")
    return int(value)


def check_float_array(fn: str, name: str, value, expected: str, ndim: Optional[int] = None,
                      min_ndim: int = 0) -> None:
    """ValueError unless ``value`` is a float32/float16/bfloat16 mx.array of
    rank ``ndim`` (or at least ``min_ndim``); ``expected`` describes the
    shape for the message (``"[B, S, D]"``)."""
    if (not isinstance(value, mx.array) or value.dtype not in FLOATS
            or (ndim is not None and value.ndim != ndim) or value.ndim < min_ndim):
        fail(fn, f"{name} must be a float32/float16/bfloat16 mx.array {expected}, got {describe(value)}")


def linear_input_size(module) -> Optional[int]:
    """Input size of an ``nn.Linear`` / ``nn.QuantizedLinear`` (read from its
    weight's shape; packed ``bits``-bit rows for a quantised one), or None
    for any other module (a LoRA wrapper, a sharded layer: it checks its
    own input)."""
    if isinstance(module, nn.QuantizedLinear):
        w = module.get("weight")
        bits = getattr(module, "bits", None)
        if isinstance(w, mx.array) and w.ndim == 2 and is_int(bits) and bits > 0:
            return w.shape[1] * 32 // bits
        return None
    if type(module) is nn.Linear:
        w = module.get("weight")
        return w.shape[1] if isinstance(w, mx.array) and w.ndim == 2 else None
    return None


def check_attention_module(fn: str, attn, x=None, rows: str = "T") -> None:
    """``attn`` an mlx-lm ``Qwen3NextAttention`` and, where given, ``x`` a
    float ``[B, <rows>, D]`` of its projections' input size, B and <rows>
    at least 1; else ValueError naming the argument."""
    from mlx_lm.models.qwen3_next import Qwen3NextAttention

    if not isinstance(attn, Qwen3NextAttention):
        fail(fn, f"attn must be an mlx-lm Qwen3NextAttention, got {type(attn).__name__}")
    if x is None:
        return
    d = linear_input_size(attn.q_proj)
    check_float_array(fn, "x", x, f"[B, {rows}, {d or 'D'}]", ndim=3)
    if d is not None and x.shape[2] != d:
        fail(fn, f"x must have shape [B, {rows}, {d}] (the projections' input size), got {describe(x)}")
    if x.shape[0] == 0 or x.shape[1] == 0:
        fail(fn, f"x must hold at least one row and one token ([B >= 1, {rows} >= 1, {x.shape[2]}]), got {describe(x)}")
