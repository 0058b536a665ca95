"""Argument checks and the contracts the package's paths share.

* the shape / dtype checks of the recurrence's arguments
  (:func:`_check_inputs`; never evaluates an array) and the expected
  descriptions ``kernels._checks.check_arrays`` reports;
* the layer's and the cache's layout as every fast path reads them
  (:func:`_heads`, :func:`_states`, :func:`_store`, :data:`_PROJECTIONS`,
  :data:`_STEP_ARRAYS`);
* the decode kernel between the projections called as modules
  (:func:`_decode_modules`): the CUDA kernel
  (:mod:`mlx_qwen_fast.kernels.gated_delta_decode`) and its Metal port
  (:mod:`mlx_qwen_fast.kernels.gated_delta_decode_metal`) share one contract
  (:mod:`mlx_qwen_fast.kernels.gated_delta_contract`), so the CUDA and Metal
  paths call it with their own kernel.
"""

from __future__ import annotations

from typing import Optional, Tuple

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache as _ArraysCache
from mlx_lm.models.qwen3_5 import GatedDeltaNet as _GatedDeltaNet

from ...kernels import gated_delta_contract as _k_contract
from ...kernels._checks import ArraySpec, check_arrays, describe
from .._checks import FLOATS as _FLOATS
from .._checks import is_int


# --------------------------------------------------------------------------
# validation (shape / dtype checks only; never evaluates an array)
# --------------------------------------------------------------------------


def _shape(x) -> Tuple[int, ...]:
    return tuple(x.shape)


#: What each array argument of this package's functions must be, for the
#: messages of ``kernels._checks.check_arrays`` (state and mask may be None).
_EXPECTED = {
    "q": "[B, T, Hk, Dk] (float)", "k": "[B, T, Hk, Dk] (float)", "v": "[B, T, Hv, Dv] (float)",
    "g": "[B, T, Hv] (float)", "beta": "[B, T, Hv] (float)", "a": "[B, T, Hv] (float)",
    "b": "[B, T, Hv] (float)", "A_log": "[Hv] (float)", "dt_bias": "[Hv] (float)",
    "state": "[B, Hv, Dv, Dk] float32", "mask": "[B, T] (bool)", "inputs": "[B, S, D] (float)",
}


def _specs(*names: str) -> Tuple[ArraySpec, ...]:
    return tuple((n, _EXPECTED[n], n in ("state", "mask")) for n in names)


_RECURRENCE_ARRAYS = _specs("q", "k", "v", "g", "beta", "state", "mask")
_GATE_ARRAYS = _specs("a", "b", "A_log", "dt_bias")
_UPDATE_ARRAYS = _specs("q", "k", "v", "a", "b", "A_log", "dt_bias", "state", "mask")
_LAYER_ARRAYS = _specs("inputs", "mask")


def _check_inputs(q, k, v, g, beta, state, mask, fn: Optional[str] = None, gates: Tuple[str, str] = ("g", "beta")):
    """Check the contract's shapes; returns (B, T, Hk, Dk, Hv, Dv).

    Raises ValueError naming the argument, the expected shape/dtype and what
    was passed, ``fn: `` first where given. ``gates``: the names of the
    arguments passed as ``g`` and ``beta`` (``("a", "b")`` for
    :func:`gated_delta_update`, whose gate inputs have their shapes).
    """
    p = f"{fn}: " if fn else ""
    gn, bn = gates
    check_arrays(fn, _RECURRENCE_ARRAYS if gates == ("g", "beta") else _specs("q", "k", "v", gn, bn,
                                                                                          "state", "mask"),
                             q, k, v, g, beta, state, mask)
    if q.ndim != 4:
        raise ValueError(
            f"{p}q must have shape [B, T, Hk, Dk] (rank 4), got shape {_shape(q)}"
        )
    B, T, Hk, Dk = q.shape
    for name, x in (("q", q), ("k", k), ("v", v), (gn, g), (bn, beta)):
        if not mx.issubdtype(x.dtype, mx.floating):
            raise ValueError(
                f"{p}{name} must be a floating mx.array (bfloat16, float16 or float32), got {x.dtype}"
            )
    if k.ndim != 4:
        raise ValueError(
            f"{p}k must have shape [B, T, Hk, Dk] (rank 4), got shape {_shape(k)}"
        )
    if k.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"{p}k must have shape [B, T, Hk, Dk] = {(B, T, Hk, Dk)} like q "
            f"(mismatched B/T), got {_shape(k)}"
        )
    if k.shape[3] != Dk:
        raise ValueError(
            f"{p}k must have the same key dim Dk={Dk} as q (shape {(B, T, Hk, Dk)}),"
            f" got Dk={k.shape[3]} (shape {_shape(k)})"
        )
    if k.shape[2] != Hk:
        raise ValueError(
            f"{p}k must have the same key head count Hk={Hk} as q "
            f"(shape {(B, T, Hk, Dk)}), got {_shape(k)}"
        )
    if v.ndim != 4:
        raise ValueError(
            f"{p}v must have shape [B, T, Hv, Dv] (rank 4), got shape {_shape(v)}"
        )
    if v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"{p}v must have shape [B, T, Hv, Dv] with B={B}, T={T} as q "
            f"(mismatched B/T), got {_shape(v)}"
        )
    Hv, Dv = v.shape[2], v.shape[3]
    if Hk == 0 or Hv % Hk != 0:
        raise ValueError(
            f"{p}v's head count Hv={Hv} must be a positive multiple of the key "
            f"head count Hk={Hk} (v shape {_shape(v)}, q shape {_shape(q)})"
        )
    if _shape(g) != (B, T, Hv):
        raise ValueError(
            f"{p}{gn} must have shape [B, T, Hv] = {(B, T, Hv)} (one scalar per "
            f"step and value head), got {_shape(g)}"
        )
    if _shape(beta) != (B, T, Hv):
        raise ValueError(f"{p}{bn} must have shape [B, T, Hv] = {(B, T, Hv)}, got {_shape(beta)}")
    if state is not None:
        if _shape(state) != (B, Hv, Dv, Dk):
            raise ValueError(
                f"{p}state must have shape [B, Hv, Dv, Dk] = {(B, Hv, Dv, Dk)}, "
                f"got {_shape(state)}"
            )
        if state.dtype != mx.float32:
            raise ValueError(
                f"{p}state must have dtype float32 (a bf16/fp16 state drifts), "
                f"got {state.dtype}"
            )
    if mask is not None and _shape(mask) != (B, T):
        raise ValueError(
            f"{p}mask must have shape [B, T] = {(B, T)} (bool, False = padding), "
            f"got {_shape(mask)}"
        )
    return B, T, Hk, Dk, Hv, Dv


def _check_gates(fn: str, a, b, A_log, dt_bias) -> None:
    """The gate inputs of :func:`compute_gates` (and of
    :func:`gated_delta_update`): float arrays, ``a`` of rank 3, ``b`` of
    its shape, ``A_log`` and ``dt_bias`` ``[Hv]``. The compiled gate
    expression is shapeless and would broadcast them."""
    check_arrays(fn, _GATE_ARRAYS, a, b, A_log, dt_bias)
    if a.ndim != 3:
        raise ValueError(f"{fn}: a must have shape [B, T, Hv], got {_shape(a)}")
    hv = a.shape[-1]
    if b.shape != a.shape:
        raise ValueError(f"{fn}: b must have a's shape {_shape(a)}, got {_shape(b)}")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t.shape != (hv,):
            raise ValueError(f"{fn}: {name} must have shape [Hv] = ({hv},), got {_shape(t)}")
    for name, t in (("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
        if not mx.issubdtype(t.dtype, mx.floating):
            raise ValueError(f"{fn}: {name} must be a floating mx.array (bfloat16, float16 or float32), got {t.dtype}")


def _check_chunk_size(fn: str, chunk_size) -> None:
    if not is_int(chunk_size) or chunk_size <= 0 or chunk_size & (chunk_size - 1):
        raise ValueError(f"{fn}: chunk_size must be a positive power of two, got {chunk_size!r}")


def _check_layer_call(fn: str, layer, inputs, mask, cache) -> None:
    """A call of the whole layer (:func:`gated_delta_net`,
    :func:`gated_delta_net_steps`): ``layer`` an mlx-lm ``GatedDeltaNet``,
    ``inputs`` a float ``[B, S, D]`` with D its hidden size, ``mask`` None
    or ``[B, S]``, ``cache`` None or an ``ArraysCache`` whose states (where
    set) have the layer's shapes for B rows. Attribute reads and shape
    compares only (the per-token path of the layer)."""
    if not isinstance(layer, _GatedDeltaNet):
        raise ValueError(f"{fn}: layer must be an mlx-lm GatedDeltaNet (mlx_lm.models.qwen3_5), "
                         f"got {type(layer).__name__}")
    if not isinstance(inputs, mx.array) or not (mask is None or isinstance(mask, mx.array)):
        check_arrays(fn, _LAYER_ARRAYS, inputs, mask)
    if inputs.ndim != 3 or inputs.dtype not in _FLOATS or inputs.shape[2] != layer.hidden_size:
        raise ValueError(f"{fn}: inputs must have shape [B, S, D] with D = {layer.hidden_size} (the layer's hidden "
                         f"size), float, got {inputs.dtype} {_shape(inputs)}")
    B, S = inputs.shape[0], inputs.shape[1]
    if mask is not None and mask.shape != (B, S):
        raise ValueError(f"{fn}: mask must have shape [B, S] = {(B, S)} (bool, False = padding), got {_shape(mask)}")
    if cache is None:
        return
    if not isinstance(cache, _ArraysCache):
        raise ValueError(f"{fn}: cache must be None or the layer's mlx-lm ArraysCache, got {type(cache).__name__}")
    conv, state = cache[0], cache[1]
    want = (B, layer.conv_kernel_size - 1, layer.conv_dim)
    if conv is not None and (not isinstance(conv, mx.array) or conv.shape != want):
        raise ValueError(f"{fn}: cache[0] (the conv state) must be None or of shape [B, conv_kernel_size - 1, "
                         f"conv_dim] = {want}, got {describe(conv)}")
    want = (B, layer.num_v_heads, layer.head_v_dim, layer.head_k_dim)
    if state is not None and (not isinstance(state, mx.array) or state.shape != want):
        raise ValueError(f"{fn}: cache[1] (the recurrent state) must be None or of shape [B, Hv, Dv, Dk] = {want}, "
                         f"got {describe(state)}")


def _as_bool(mask):
    return mask if mask.dtype == mx.bool_ else mask != 0

# --------------------------------------------------------------------------
# the layer and its cache, as the fast paths read them
# --------------------------------------------------------------------------


def _heads(layer) -> dict:
    return dict(num_k_heads=layer.num_k_heads, num_v_heads=layer.num_v_heads)


def _states(cache):
    return (cache[0], cache[1]) if cache is not None else (None, None)


def _store(cache, conv_state, state, S: int) -> None:
    if cache is not None:
        cache[0] = conv_state
        cache[1] = state
        cache.advance(S)


#: The layer's projections: the four inputs (in the order the decode kernels
#: read their outputs, concatenated), then ``out_proj``.
_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")
#: Paths under the layer of the constants :func:`_decode_params` packs.
_STEP_ARRAYS = (("conv1d", "weight"), ("A_log",), ("dt_bias",), ("norm", "weight"))


def _decode_params(layer):
    """The layer's constants packed as the decode kernels read them
    (:func:`mlx_qwen_fast.kernels.gated_delta_contract.decode_params`; not
    evaluated)."""
    return _k_contract.decode_params(layer.conv1d.weight, layer.A_log, layer.dt_bias, layer.norm.weight)


def _decode_modules(layer, inputs, kernel, params, conv_state, state, cache):
    """The decode kernel ``kernel`` (CUDA's ``gated_delta_decode`` or its
    Metal port, one contract) between the projections called as modules:
    the four input projections' outputs concatenated as the kernel reads
    them, then ``out_proj``; the cache updated and advanced by one token.
    ``params``: :func:`_decode_params`."""
    proj = mx.concatenate([getattr(layer, n)(inputs) for n in _PROJECTIONS[:4]], axis=-1)
    out, conv_state, state = kernel(proj, params, conv_state, state, **_heads(layer), norm_eps=layer.norm.eps)
    _store(cache, conv_state, state, 1)
    return layer.out_proj(out)
