"""The argument contract of the Gated DeltaNet decode step that the CUDA and the Metal kernels share.

One token per row, head dims :data:`D` = 128, a depthwise conv of width
:data:`KW` = 4, between the layer's input projections (one packed array,
:func:`packed_width`) and ``out_proj`` (CUDA:
:mod:`~mlx_qwen_fast.kernels.gated_delta_decode`; Metal:
:mod:`~mlx_qwen_fast.kernels.gated_delta_decode_metal`; the whole mixer's
:mod:`~mlx_qwen_fast.kernels.gdn_mixer_decode` reads the same constants):
the layer's constants as one float32 array (:func:`decode_params`,
:func:`params_width`) and the argument checks of one step
(:func:`check_step`). Backend-neutral: no kernel, no backend check, no
host synchronisation.
"""

from __future__ import annotations

import mlx.core as mx

from . import _checks

__all__ = ["D", "FLOAT_DTYPES", "KW", "check_step", "decode_params", "packed_width", "params_width"]

#: Head dimension (keys and values).
D = 128
#: Width of the depthwise conv (the conv state holds KW - 1 earlier inputs).
KW = 4
#: The activations' dtypes the kernels take.
FLOAT_DTYPES = (mx.bfloat16, mx.float16, mx.float32)
_PARAM_ARRAYS = (("conv_weight", f"[C, {KW}, 1] (float)", False), ("A_log", "[Hv] (float)", False),
                 ("dt_bias", "[Hv] (float)", False), ("norm_weight", f"[{D}] (float)", False))
_STEP_ARRAYS = (("proj", "[B, 1, P] (float)", False), ("params", "[params_width] float32", False),
                ("conv_state", f"[B, {KW - 1}, C]", True), ("state", f"[B, Hv, {D}, {D}] float32", True))


def packed_width(num_k_heads: int, num_v_heads: int) -> int:
    """Last-axis size of a decode step's ``proj`` (:func:`check_step`):
    (2 Hk + Hv) * 128 + Hv * 128 + 2 Hv (qkv | z | a | b)."""
    return (2 * num_k_heads + num_v_heads) * D + num_v_heads * D + 2 * num_v_heads


def params_width(num_k_heads: int, num_v_heads: int) -> int:
    """Size of :func:`decode_params`' array: C*4 + 2*Hv + 128, C = (2 Hk + Hv) * 128."""
    return (2 * num_k_heads + num_v_heads) * D * KW + 2 * num_v_heads + D


def decode_params(conv_weight: mx.array, A_log: mx.array, dt_bias: mx.array, norm_weight: mx.array) -> mx.array:
    """A layer's decode-step constants as one float32 array, for the
    decode kernels (CUDA and Metal): ``[conv_weight (C*4) | A_log (Hv) |
    dt_bias (Hv) | norm_weight (128)]``. Every float type converts to float32
    exactly, so the kernel's results do not change; build it once per layer
    (one graph input instead of four: MLX's host cost per node grows with its
    inputs, bench/node_cost.py measures it).

    Args:
      conv_weight: [C, 4, 1] (or [C, 4]), C a multiple of 128; A_log,
        dt_bias: [Hv]; norm_weight: [128]; any float dtype.

    Returns:
      float32 [C*4 + 2*Hv + 128].

    Raises:
      ValueError: an argument that is not an mx.array, a non-float array or
        one of another shape (names it).
    """
    _checks.check_arrays("decode_params", _PARAM_ARRAYS, conv_weight, A_log, dt_bias, norm_weight)
    for (name, _, _), t in zip(_PARAM_ARRAYS, (conv_weight, A_log, dt_bias, norm_weight)):
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be a float array, got {t.dtype}")
    C = conv_weight.shape[0] if conv_weight.ndim else 0
    if conv_weight.shape not in ((C, KW, 1), (C, KW)) or C == 0 or C % D:
        raise ValueError(f"conv_weight must have shape [C, {KW}, 1] or [C, {KW}] with C a multiple of {D}, "
                         f"got {tuple(conv_weight.shape)}")
    if A_log.ndim != 1 or dt_bias.shape != A_log.shape:
        raise ValueError(f"A_log and dt_bias must both have shape [Hv], got {tuple(A_log.shape)} "
                         f"and {tuple(dt_bias.shape)}")
    if norm_weight.shape != (D,):
        raise ValueError(f"norm_weight must have shape [{D}], got {tuple(norm_weight.shape)}")
    return mx.concatenate([t.reshape(-1).astype(mx.float32) for t in (conv_weight, A_log, dt_bias, norm_weight)])


def check_step(fn: str, proj, params, conv_state, state, num_k_heads: int, num_v_heads: int,
               norm_eps: float, qk_eps: float):
    """The argument checks of one decode step (the CUDA kernel's
    :func:`~mlx_qwen_fast.kernels.gated_delta_decode.gated_delta_decode`,
    the Metal kernel's
    :func:`~mlx_qwen_fast.kernels.gated_delta_decode_metal.gated_delta_decode_metal`).

    Args:
      fn: the caller's name, first in the messages of the array and eps
        checks.
      proj: ``[B, 1, P]`` or ``[B, P]`` float (:data:`FLOAT_DTYPES`), P =
        :func:`packed_width` ``(num_k_heads, num_v_heads)``.
      params: float32 ``[params_width(num_k_heads, num_v_heads)]``
        (:func:`decode_params`).
      conv_state: ``[B, 3, C]`` float, C = (2 Hk + Hv) * 128, or None.
      state: float32 ``[B, Hv, 128, 128]``, or None.
      num_k_heads, num_v_heads: Hk > 0, Hv a multiple of Hk.
      norm_eps, qk_eps: finite floats in ``(0, 1)``.

    Returns:
      ``(B, activation dtype, C, conv_state, state, (qk_eps, norm_eps))``
      with None states replaced by zeros and the conv state cast to the
      activation dtype.

    Raises:
      ValueError: naming the first argument that is not an mx.array or is
        outside the above.
    """
    _checks.check_arrays(fn, _STEP_ARRAYS, proj, params, conv_state, state)
    eps = (_checks.check_eps(fn, "qk_eps", qk_eps), _checks.check_eps(fn, "norm_eps", norm_eps))
    Hk, Hv = num_k_heads, num_v_heads
    if Hk <= 0 or Hv % Hk:
        raise ValueError(f"num_v_heads ({Hv}) must be a multiple of num_k_heads ({Hk})")
    C, P = (2 * Hk + Hv) * D, packed_width(Hk, Hv)
    if not (proj.ndim == 2 or (proj.ndim == 3 and proj.shape[1] == 1)) or proj.dtype not in FLOAT_DTYPES or (
        proj.shape[-1] != P
    ):
        raise ValueError(f"proj must be a float array of shape [B, 1, {P}], got {proj.dtype} {tuple(proj.shape)}")
    if params.dtype != mx.float32 or params.shape != (params_width(Hk, Hv),):
        raise ValueError(f"params must be float32 of shape [{params_width(Hk, Hv)}] (decode_params), "
                         f"got {params.dtype} {tuple(params.shape)}")
    B, x = proj.shape[0], proj.dtype
    _check_states(conv_state, state, B, C, Hv)
    if conv_state is None:
        conv_state = mx.zeros((B, KW - 1, C), dtype=x)
    elif conv_state.dtype not in FLOAT_DTYPES:
        raise ValueError(f"conv_state must be a float array, got {conv_state.dtype}")
    elif conv_state.dtype != x:  # the kernel reads it in the activation dtype
        conv_state = conv_state.astype(x)
    if state is None:
        state = mx.zeros((B, Hv, D, D), dtype=mx.float32)
    return B, x, C, conv_state, state, eps


def _check_states(conv_state, state, B, C, Hv):
    """Raise ValueError for a conv state or state (None allowed) outside the contract."""
    if conv_state is not None and conv_state.shape != (B, KW - 1, C):
        raise ValueError(f"conv_state must have shape [{B}, {KW - 1}, {C}], got {tuple(conv_state.shape)}")
    if state is not None and (state.shape != (B, Hv, D, D) or state.dtype != mx.float32):
        raise ValueError(
            f"state must be float32 of shape [{B}, {Hv}, {D}, {D}], got {state.dtype} {tuple(state.shape)}"
        )
