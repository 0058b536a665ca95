"""Gated DeltaNet decode step on CUDA: one kernel per layer and token.

Fuses everything of mlx-lm's ``GatedDeltaNet.__call__`` (mlx_lm/models/
qwen3_5.py) between the input projections and ``out_proj`` for T = 1: conv
state update, depthwise conv + SiLU, q/k L2 normalisation, gates, the gated
delta rule state update and readout, and the gated RMSNorm with z -- one
graph node instead of ~40. The four input projections' outputs come as one
array (the layer runs them as one concatenated quantised matmul:
``compiled.concat_linears``) and the layer's constants as another
(:func:`decode_params`, built once per layer), so the node has four inputs.
Each block owns one (batch, value head) and issues its 64 KB of state loads
before the front-end arithmetic so the two overlap.
Source: ``mlx_qwen_fast/cuda/gated_delta_decode.cu``.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import mlx.core as mx

from . import _checks
from . import _cuda_build as cb

__all__ = ["check_step", "decode_params", "gated_delta_decode", "packed_width", "params_width", "supports"]

D = 128
KW = 4
_FLOAT = (mx.bfloat16, mx.float16, mx.float32)
_kernels: Dict[tuple, cb.CudaKernel] = {}
_PARAM_ARRAYS = (("conv_weight", f"[C, {KW}, 1] (float)", False), ("A_log", "[Hv] (float)", False),
                 ("dt_bias", "[Hv] (float)", False), ("norm_weight", f"[{D}] (float)", False))
_STEP_ARRAYS = (("proj", "[B, 1, P] (float)", False), ("params", "[params_width] float32", False),
                ("conv_state", f"[B, {KW - 1}, C]", True), ("state", f"[B, Hv, {D}, {D}] float32", True))


def supports(
    qkv: mx.array,
    state: Optional[mx.array],
    *,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int = D,
    head_v_dim: int = D,
    mask: Optional[mx.array] = None,
) -> bool:
    """True when :func:`gated_delta_decode` can run a layer's step whose
    ``in_proj_qkv`` output is ``qkv``.

    Needs the CUDA backend, one token (qkv [B, 1, C] or [B, C], C = (2 Hk +
    Hv) * 128), head dims 128, Hv a multiple of Hk, a float32 state
    [B, Hv, 128, 128] (or None) and no mask. Pure shape checks (``qkv`` is
    never evaluated).
    """
    if not cb.cuda_available() or mask is not None:
        return False
    if not (_checks.is_array(qkv) and _checks.is_array(state, optional=True)):
        return False
    if head_k_dim != D or head_v_dim != D or num_k_heads <= 0 or num_v_heads % num_k_heads:
        return False
    if not (qkv.ndim == 2 or (qkv.ndim == 3 and qkv.shape[1] == 1)):
        return False
    C = (2 * num_k_heads + num_v_heads) * D
    if qkv.dtype not in _FLOAT or qkv.shape[-1] != C:
        return False
    B = qkv.shape[0]
    if state is not None and (state.shape != (B, num_v_heads, D, D) or state.dtype != mx.float32):
        return False
    return True


def _check_states(conv_state, state, B, C, Hv):
    """Raise ValueError for a conv state or state (None allowed) outside the contract."""
    if conv_state is not None and conv_state.shape != (B, KW - 1, C):
        raise ValueError(f"conv_state must have shape [{B}, {KW - 1}, {C}], got {tuple(conv_state.shape)}")
    if state is not None and (state.shape != (B, Hv, D, D) or state.dtype != mx.float32):
        raise ValueError(
            f"state must be float32 of shape [{B}, {Hv}, {D}, {D}], got {state.dtype} {tuple(state.shape)}"
        )


def _kernel(x, Hv: int, Hk: int) -> cb.CudaKernel:
    key = (x, Hv, Hk)
    kern = _kernels.get(key)
    if kern is None:
        kern = _kernels[key] = cb.CudaKernel(
            "gated_delta_decode.cu", "mqf_gdn_decode", dict(GDN_X=cb.dtype_macro(x), GDN_HV=Hv, GDN_HK=Hk),
        )
    return kern


def packed_width(num_k_heads: int, num_v_heads: int) -> int:
    """Last-axis size of :func:`gated_delta_decode`'s ``proj``:
    (2 Hk + Hv) * 128 + Hv * 128 + 2 Hv (qkv | z | a | b)."""
    return (2 * num_k_heads + num_v_heads) * D + num_v_heads * D + 2 * num_v_heads


def params_width(num_k_heads: int, num_v_heads: int) -> int:
    """Size of :func:`decode_params`' array: C*4 + 2*Hv + 128, C = (2 Hk + Hv) * 128."""
    return (2 * num_k_heads + num_v_heads) * D * KW + 2 * num_v_heads + D


def decode_params(conv_weight: mx.array, A_log: mx.array, dt_bias: mx.array, norm_weight: mx.array) -> mx.array:
    """A layer's decode-step constants as one float32 array, for
    :func:`gated_delta_decode`: ``[conv_weight (C*4) | A_log (Hv) |
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
        if t.dtype not in _FLOAT:
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
    """The argument checks of :func:`gated_delta_decode` (shared by the
    Metal kernel of the same contract, ``gated_delta_decode_metal``).

    Returns ``(B, activation dtype, C, conv_state, state, (qk_eps,
    norm_eps))`` with None states replaced by zeros and the conv state cast
    to the activation dtype. Raises ValueError naming the argument.
    """
    _checks.check_arrays(fn, _STEP_ARRAYS, proj, params, conv_state, state)
    eps = (_checks.check_eps(fn, "qk_eps", qk_eps), _checks.check_eps(fn, "norm_eps", norm_eps))
    Hk, Hv = num_k_heads, num_v_heads
    if Hk <= 0 or Hv % Hk:
        raise ValueError(f"num_v_heads ({Hv}) must be a multiple of num_k_heads ({Hk})")
    C, P = (2 * Hk + Hv) * D, packed_width(Hk, Hv)
    if not (proj.ndim == 2 or (proj.ndim == 3 and proj.shape[1] == 1)) or proj.dtype not in _FLOAT or (
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
    elif conv_state.dtype not in _FLOAT:
        raise ValueError(f"conv_state must be a float array, got {conv_state.dtype}")
    elif conv_state.dtype != x:  # the kernel reads it in the activation dtype
        conv_state = conv_state.astype(x)
    if state is None:
        state = mx.zeros((B, Hv, D, D), dtype=mx.float32)
    return B, x, C, conv_state, state, eps


def gated_delta_decode(
    proj: mx.array,
    params: mx.array,
    conv_state: Optional[mx.array],
    state: Optional[mx.array],
    *,
    num_k_heads: int,
    num_v_heads: int,
    norm_eps: float = 1e-6,
    qk_eps: float = 1e-6,
) -> Tuple[mx.array, mx.array, mx.array]:
    """One decode step of a Gated DeltaNet layer, up to ``out_proj``.

    qkv, z, a and b are read from one array at their offsets (no slice
    enters the graph), the layer's constants from :func:`decode_params`.
    All arithmetic in fp32; the conv state is read in the activation dtype.

    Args:
      proj: [B, 1, P] (or [B, P]) in bfloat16/float16/float32, P =
        :func:`packed_width` = C + Hv*128 + 2*Hv, each row = concat(qkv, z,
        a, b) as ``in_proj_qkv``, ``in_proj_z``, ``in_proj_a``,
        ``in_proj_b`` give them; C = (2 Hk + Hv) * 128.
      params: float32 [:func:`params_width`], from :func:`decode_params`.
      conv_state: [B, 3, C] previous conv inputs (cast to proj's dtype), or None for zeros.
      state: [B, Hv, 128, 128] float32, or None for zeros.
      num_k_heads, num_v_heads: Hk, Hv.
      norm_eps: the gated RMSNorm's eps (``rms_norm_eps``).
      qk_eps: the q/k L2-norm eps (mlx-lm: 1e-6).

    Returns:
      (out [B, 1, Hv*128] in proj's dtype, new conv state [B, 3, C], new
       state [B, Hv, 128, 128] float32); for B = 0 the empty arrays,
       without a launch.

    Raises:
      ValueError: an argument that is not an mx.array, shapes/dtypes
        outside the above (names the argument), an eps outside (0, 1).
      RuntimeError: no CUDA compiler could build the kernel.
    """
    B, x, C, conv_state, state, eps = check_step("gated_delta_decode", proj, params, conv_state, state,
                                                 num_k_heads, num_v_heads, norm_eps, qk_eps)
    Hk, Hv = num_k_heads, num_v_heads
    if B == 0:  # no rows: a launch of an empty grid is an error
        return mx.zeros((0, 1, Hv * D), x), conv_state, state
    kern = _kernel(x, Hv, Hk)
    out, new_conv, new_state = kern(
        [proj, params, conv_state, state],
        [(B, 1, Hv * D), (B, KW - 1, C), (B, Hv, D, D)], [x, x, mx.float32],
        (B * Hv * 512, 1, 1), (512, 1, 1), eps,
    )
    return out, new_conv, new_state
