"""Gated DeltaNet decode step on Metal: one kernel per layer and token.

The contract of :func:`mlx_qwen_fast.kernels.gated_delta_decode.gated_delta_decode`
(the CUDA kernel; same arguments, checks, outputs): conv state update,
depthwise conv + SiLU, q/k L2 norm, gates, the gated delta rule update and
readout, the gated RMSNorm with z, between the layer's input projections
(one packed array) and ``out_proj``. One threadgroup of 128 threads per
(batch row, value head), thread t owning row t of the head's fp32 state (the
published engine's decode layout: pplx-garden ``lily/``, one threadgroup per
value head, one state row per thread).
Source: ``mlx_qwen_fast/metal/gated_delta_decode.metal`` (the kernel body;
``mx.fast.metal_kernel`` writes the signature).

Verified only by running MLX's generated source on the CPU
(``tests/metal_check.py``) against the fp32 reference; never run on an
Apple GPU, never timed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx

from .gated_delta_contract import D, KW, check_step

__all__ = ["gated_delta_decode_metal", "SOURCE_FILE"]

SOURCE_FILE = Path(__file__).resolve().parents[1] / "metal" / "gated_delta_decode.metal"
_KERNEL = None  # built on first use: only a call needs Metal


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = mx.fast.metal_kernel(
            name="mqf_gated_delta_decode",
            input_names=["proj", "params", "conv_state", "state", "eps"],
            output_names=["out", "new_conv", "new_state"],
            source=SOURCE_FILE.read_text(),
        )
    return _KERNEL


def gated_delta_decode_metal(
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
    """One decode step of a Gated DeltaNet layer, up to ``out_proj``, on Metal.

    Args, returns and errors: as the CUDA kernel's
    :func:`~mlx_qwen_fast.kernels.gated_delta_decode.gated_delta_decode`
    (``proj`` [B, 1, P] or [B, P]; ``params`` from ``decode_params``;
    states or None for zeros; head dims 128). Outputs: (out [B, 1, Hv*128]
    in proj's dtype, new conv state [B, 3, C], new state [B, Hv, 128, 128]
    float32).

    Raises:
      ValueError: as the CUDA kernel's checks (the argument named).
      RuntimeError: MLX has no Metal back-end here (raised by MLX).
    """
    B, x, C, conv_state, state, eps = check_step(
        "gated_delta_decode_metal", proj, params, conv_state, state, num_k_heads, num_v_heads, norm_eps, qk_eps)
    Hk, Hv = num_k_heads, num_v_heads
    if B == 0:
        return mx.zeros((0, 1, Hv * D), x), conv_state, state
    out, new_conv, new_state = _kernel()(
        inputs=[proj.reshape(B, -1), params, conv_state, state, mx.array(eps, dtype=mx.float32)],
        template=[("T", x), ("HK", Hk), ("HV", Hv)],
        grid=(B * Hv * D, 1, 1),
        threadgroup=(D, 1, 1),
        output_shapes=[(B, Hv * D), (B, KW - 1, C), (B, Hv, D, D)],
        output_dtypes=[x, x, mx.float32],
    )
    return out.reshape(B, 1, Hv * D), new_conv, new_state
