"""Gated RMSNorm of the Gated DeltaNet output on CUDA, one pass.

Fuses mlx-lm's ``Qwen3NextRMSNormGated`` (``mx.fast.rms_norm`` then
``precise_swiglu``; mlx_lm/models/qwen3_next.py, activations.py) into one
kernel: ``out = silu(z) * (w * rms_norm(y))``, rounding to the activation type
where the reference does (after the normalisation, after the weight, at the
end).  Source: ``mlx_qwen_fast/cuda/gated_rms_norm.cu``.
"""

from __future__ import annotations

from typing import Dict

import mlx.core as mx

from . import _checks
from . import _cuda_build as cb

__all__ = ["gated_rms_norm", "supports"]

D = 128
_FLOAT = (mx.bfloat16, mx.float16, mx.float32)
_kernels: Dict[tuple, cb.CudaKernel] = {}
_ARRAYS = (("y", f"[..., {D}] (float)", False), ("z", "like y", False), ("weight", f"[{D}] (float)", False))


def supports(y: mx.array, z: mx.array, weight: mx.array) -> bool:
    """True for y, z of one float dtype and shape [..., 128] and weight [128]."""
    if not cb.cuda_available() or _checks.arrays_problem(_ARRAYS, y, z, weight) is not None:
        return False
    return (
        y.shape == z.shape and y.ndim >= 1 and y.shape[-1] == D
        and y.dtype == z.dtype and y.dtype in _FLOAT
        and weight.shape == (D,) and weight.dtype in _FLOAT
    )


def gated_rms_norm(y: mx.array, z: mx.array, weight: mx.array, eps: float) -> mx.array:
    """``silu(z) * (weight * rms_norm(y))`` over the last axis (128).

    Args:
      y: [..., 128] recurrence output (bfloat16/float16/float32).
      z: same shape and dtype as y (``in_proj_z`` output, per value head).
      weight: [128] norm weight (any float dtype).
      eps: added to mean(y^2) (the layer's ``rms_norm_eps``).

    Returns:
      [..., 128] in y's dtype (empty, without a launch, when y is).

    Raises:
      ValueError: an argument that is not an mx.array, mismatched
        shapes/dtypes (names the argument), an eps outside (0, 1).
    """
    _checks.check_arrays("gated_rms_norm", _ARRAYS, y, z, weight)
    eps = _checks.check_eps("gated_rms_norm", "eps", eps)
    if y.ndim < 1 or y.shape[-1] != D or y.dtype not in _FLOAT:
        raise ValueError(f"y must be a float array of shape [..., {D}], got {y.dtype} {tuple(y.shape)}")
    if z.shape != y.shape or z.dtype != y.dtype:
        raise ValueError(
            f"z must match y ({y.dtype} {tuple(y.shape)}), got {z.dtype} {tuple(z.shape)}"
        )
    if weight.shape != (D,) or weight.dtype not in _FLOAT:
        raise ValueError(f"weight must have shape [{D}] (float), got {weight.dtype} {tuple(weight.shape)}")
    N = y.size // D
    if N == 0:  # no rows: a launch of an empty grid is an error
        return mx.zeros(y.shape, dtype=y.dtype)
    key = (y.dtype, weight.dtype)
    kern = _kernels.get(key)
    if kern is None:
        kern = cb.CudaKernel(
            "gated_rms_norm.cu", "mqf_gated_rms_norm",
            dict(GDN_X=cb.dtype_macro(y.dtype), GDN_N=cb.dtype_macro(weight.dtype)),
        )
        _kernels[key] = kern
    nthreads = N * 16
    (out,) = kern(
        inputs=[y, z, weight],
        output_shapes=[tuple(y.shape)],
        output_dtypes=[y.dtype],
        grid=(-(-nthreads // 256) * 256, 1, 1),
        threadgroup=(256, 1, 1),
        scalars=[N, eps],
    )
    return out
