"""Gated DeltaNet prefill front end on CUDA: conv + SiLU + q/k norm + gates.

One kernel replaces what mlx-lm's ``GatedDeltaNet.__call__`` does between the
input projections and the recurrence (mlx_lm/models/qwen3_5.py): concatenate
the conv state and the new qkv rows, depthwise causal conv1d (kernel 4, no
bias), SiLU, split into q/k/v, L2-normalise q and k (``normalize_qk``:
``q / sqrt(sum q^2 + eps) * Dk**-0.5``, ``k / sqrt(sum k^2 + eps)``), the gates
``g = exp(-exp(A_log) * softplus(a + dt_bias))`` and ``beta = sigmoid(b)``, and
the new conv state (the last 3 rows of the concatenation).  Reads qkv once,
writes q, k, v, g, beta once; fp32 arithmetic, one rounding per output.
Source: ``mlx_qwen_fast/cuda/gated_delta_frontend.cu``.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import mlx.core as mx

from . import _checks
from . import _cuda_build as cb

__all__ = ["gated_delta_frontend", "supports", "prepare", "defines"]

D = 128
KW = 4
TT = 16  # tokens per warp (the source's GDN_TT)
_FLOAT = (mx.bfloat16, mx.float16, mx.float32)
_kernels: Dict[tuple, cb.CudaKernel] = {}
_ARRAYS = (("qkv", "[B, T, C] (float)", False), ("a", "[B, T, Hv]", False), ("b", "[B, T, Hv]", False),
           ("conv_weight", f"[C, {KW}, 1] (float)", False), ("conv_state", f"[B, {KW - 1}, C]", True),
           ("A_log", "[Hv] (float)", False), ("dt_bias", "[Hv] (float)", False))


def defines(x, w, A_log, dt_bias, Hv, Hk) -> dict:
    """Build macros of the front end (``gated_delta_frontend.cu``) for these dtypes
    and head counts."""
    return dict(
        GDN_X=cb.dtype_macro(x), GDN_W=cb.dtype_macro(w),
        GDN_A=cb.dtype_macro(A_log), GDN_DT=cb.dtype_macro(dt_bias),
        GDN_HV=Hv, GDN_HK=Hk, GDN_TT=TT,
    )


def _kernel(x, w, A_log, dt_bias, Hv, Hk) -> cb.CudaKernel:
    key = (x, w, A_log, dt_bias, Hv, Hk, TT)
    kern = _kernels.get(key)
    if kern is None:
        kern = cb.CudaKernel("gated_delta_frontend.cu", "mqf_gdn_frontend",
                             defines(x, w, A_log, dt_bias, Hv, Hk))
        _kernels[key] = kern
    return kern


def supports(
    qkv: mx.array,
    conv_state: Optional[mx.array],
    conv_weight: mx.array,
    *,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int = D,
    head_v_dim: int = D,
    mask: Optional[mx.array] = None,
) -> bool:
    """True when :func:`gated_delta_frontend` can run this layer's call.

    Needs the CUDA backend, head dims 128, a conv kernel of width 4, qkv
    [B, T, (2 Hk + Hv) * 128] in bfloat16/float16/float32, a conv state of
    qkv's dtype (or None) and no padding mask (masked batches keep mlx-lm's
    path, which zeroes padded qkv rows before the conv).
    """
    if not cb.cuda_available() or mask is not None:
        return False
    if not (_checks.is_array(qkv) and _checks.is_array(conv_weight) and _checks.is_array(conv_state, optional=True)):
        return False
    if head_k_dim != D or head_v_dim != D or num_k_heads <= 0:
        return False
    if num_v_heads % num_k_heads:
        return False
    C = (2 * num_k_heads + num_v_heads) * D
    if qkv.ndim != 3 or qkv.shape[2] != C or qkv.dtype not in _FLOAT:
        return False
    if tuple(conv_weight.shape) not in ((C, KW, 1), (C, KW)) or conv_weight.dtype not in _FLOAT:
        return False
    if conv_state is not None and (
        conv_state.shape != (qkv.shape[0], KW - 1, C) or conv_state.dtype != qkv.dtype
    ):
        return False
    return True


def gated_delta_frontend(
    qkv: mx.array,
    a: mx.array,
    b: mx.array,
    conv_weight: mx.array,
    conv_state: Optional[mx.array],
    A_log: mx.array,
    dt_bias: mx.array,
    *,
    num_k_heads: int,
    num_v_heads: int,
    eps: float = 1e-6,
) -> Tuple[mx.array, mx.array, mx.array, mx.array, mx.array, mx.array]:
    """Everything between the GDN input projections and the recurrence.

    Args:
      qkv: [B, T, C] output of ``in_proj_qkv``, C = (2 Hk + Hv) * 128,
        channels ordered q | k | v as mlx-lm splits them.
      a: [B, T, Hv] output of ``in_proj_a``; b: [B, T, Hv] of ``in_proj_b``.
      conv_weight: ``conv1d.weight`` [C, 4, 1] (or [C, 4]), taps oldest first.
      conv_state: [B, 3, C] previous inputs (qkv's dtype), or None for zeros.
      A_log, dt_bias: [Hv] per-head parameters (any float dtype).
      num_k_heads, num_v_heads: Hk and Hv.
      eps: the L2-norm epsilon added to sum(x^2) (mlx-lm passes 1e-6).

    Returns:
      (q [B, T, Hk, 128], k [B, T, Hk, 128], v [B, T, Hv, 128] in qkv's dtype
       -- q, k normalised, q scaled by 128**-0.5, ready for the recurrence --,
       g [B, T, Hv] float32 decay in (0, 1], beta [B, T, Hv] float32,
       new conv state [B, 3, C] in qkv's dtype). For B = 0 or T = 0 the
       empty arrays and the conv state unchanged, without a launch.

    Raises:
      ValueError: an argument that is not an mx.array, shapes or dtypes
        outside the above (names the argument and the expected
        shape/dtype), an eps outside (0, 1).
      RuntimeError: no CUDA compiler could build the kernel.
    """
    Hk, Hv = num_k_heads, num_v_heads
    eps = _checks.check_eps("gated_delta_frontend", "eps", eps)
    B, T, C, a, b, conv_state = prepare(qkv, a, b, conv_weight, conv_state, A_log, dt_bias, Hk, Hv)
    f32 = mx.float32
    if B == 0 or T == 0:  # nothing to compute: a launch of an empty grid is an error
        x = qkv.dtype
        return (mx.zeros((B, T, Hk, D), x), mx.zeros((B, T, Hk, D), x), mx.zeros((B, T, Hv, D), x),
                mx.zeros((B, T, Hv), f32), mx.zeros((B, T, Hv), f32), conv_state)
    kern = _kernel(qkv.dtype, conv_weight.dtype, A_log.dtype, dt_bias.dtype, Hv, Hk)
    nwarps = B * (-(-T // TT)) * (2 * Hk + Hv)
    nblocks = -(-nwarps // 4)
    q, k, v, g, beta, new_conv = kern(
        inputs=[qkv, a, b, conv_weight.reshape(C, KW), conv_state, A_log, dt_bias],
        output_shapes=[(B, T, Hk, D), (B, T, Hk, D), (B, T, Hv, D), (B, T, Hv), (B, T, Hv), (B, KW - 1, C)],
        output_dtypes=[qkv.dtype, qkv.dtype, qkv.dtype, f32, f32, qkv.dtype],
        grid=(nblocks * 128, 1, 1),
        threadgroup=(128, 1, 1),
        scalars=[B, T, eps],
    )
    return q, k, v, g, beta, new_conv


def prepare(qkv, a, b, conv_weight, conv_state, A_log, dt_bias, Hk: int, Hv: int):
    """Check the front end's arguments (as :func:`gated_delta_frontend`
    documents them) and return ``(B, T, C, a, b, conv_state)`` with a, b and
    the conv state (zeros for None) in qkv's dtype.

    Raises:
      ValueError: an argument that is not an mx.array, a shape or dtype
        outside the contract (names the argument).
    """
    _checks.check_arrays("gated_delta_frontend", _ARRAYS, qkv, a, b, conv_weight, conv_state, A_log, dt_bias)
    if Hk <= 0 or Hv % Hk:
        raise ValueError(f"num_v_heads ({Hv}) must be a multiple of num_k_heads ({Hk})")
    C = (2 * Hk + Hv) * D
    if qkv.ndim != 3 or qkv.shape[2] != C:
        raise ValueError(f"qkv must have shape [B, T, {C}], got {tuple(qkv.shape)}")
    if qkv.dtype not in _FLOAT:
        raise ValueError(f"qkv must be bfloat16, float16 or float32, got {qkv.dtype}")
    B, T, _ = qkv.shape
    for name, x in (("a", a), ("b", b)):
        if x.shape != (B, T, Hv):
            raise ValueError(f"{name} must have shape [{B}, {T}, {Hv}], got {tuple(x.shape)}")
    if tuple(conv_weight.shape) not in ((C, KW, 1), (C, KW)) or conv_weight.dtype not in _FLOAT:
        raise ValueError(
            f"conv_weight must have shape [{C}, {KW}, 1] (float), got "
            f"{conv_weight.dtype} {tuple(conv_weight.shape)}"
        )
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        if x.shape != (Hv,) or x.dtype not in _FLOAT:
            raise ValueError(f"{name} must have shape [{Hv}] (float), got {x.dtype} {tuple(x.shape)}")
    if conv_state is None:
        conv_state = mx.zeros((B, KW - 1, C), dtype=qkv.dtype)
    elif conv_state.shape != (B, KW - 1, C):
        raise ValueError(
            f"conv_state must have shape [{B}, {KW - 1}, {C}], got {tuple(conv_state.shape)}"
        )
    elif conv_state.dtype != qkv.dtype:
        conv_state = conv_state.astype(qkv.dtype)
    return B, T, C, a.astype(qkv.dtype), b.astype(qkv.dtype), conv_state
