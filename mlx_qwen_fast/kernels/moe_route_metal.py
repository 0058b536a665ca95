"""MoE routing on Metal: softmax, top-k and renormalisation in one launch.

The contract of :func:`mlx_qwen_fast.kernels.moe_routing.route` (the CUDA
routing kernel) without its shared-expert slot: fp32 softmax over the
router logits, the ``top_k`` largest probabilities in decreasing order
(ties: the lower expert id first), divided by their sum when ``normalize``.
One threadgroup of one SIMD group (32 threads) per token, lane l holding
the logits of experts ``i * 32 + l`` in registers, ``top_k`` rounds of a
SIMD arg-max (``simd_max`` of the probabilities, ``simd_min`` of the ids
holding the maximum): the layout of the published engine's router
(pplx-garden ``lily/``, one threadgroup per token, repeated arg-max with
the lowest id on ties) on the CUDA kernel's one-warp form.
Source: ``mlx_qwen_fast/metal/moe_route.metal`` (the kernel body;
``mx.fast.metal_kernel`` writes the signature).

Verified only by running MLX's generated source on the CPU
(``tests/metal_check.py``) against the fp32 host reference; never run on an
Apple GPU, never timed.
"""

from __future__ import annotations

import numbers
from pathlib import Path
from typing import Tuple

import mlx.core as mx

from ._checks import describe as _describe

__all__ = ["route_metal", "SOURCE_FILE", "MAX_EXPERTS", "MAX_TOP_K"]

SOURCE_FILE = Path(__file__).resolve().parents[1] / "metal" / "moe_route.metal"
MAX_EXPERTS = 1024  # 32 logits per lane
MAX_TOP_K = 32  # one slot per lane
_LOGITS = (mx.float32, mx.float16, mx.bfloat16)
_KERNEL = None  # built on first use: only a call needs Metal


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = mx.fast.metal_kernel(
            name="mqf_moe_route",
            input_names=["logits"],
            output_names=["inds", "scores"],
            source=SOURCE_FILE.read_text(),
        )
    return _KERNEL


def route_metal(logits: mx.array, top_k: int, *, normalize: bool = True) -> Tuple[mx.array, mx.array]:
    """Top-k experts per token from router logits, on Metal.

    Args:
        logits: ``[..., E]`` float32 / float16 / bfloat16 (every leading
            index a token), E a multiple of 32 in ``[32, 1024]``.
        top_k: experts per token, an int in ``[1, min(32, E)]``.
        normalize: divide the k probabilities by their sum.

    Returns:
        ``(inds [..., k] int32, scores [..., k] float32)``, slots in
        decreasing probability (ties: lower expert id first).

    Raises:
        ValueError: ``logits`` not such an array, or ``top_k`` out of range
            (the argument named with what it must be).
        RuntimeError: MLX has no Metal back-end here (raised by MLX).
    """
    if (not isinstance(logits, mx.array) or logits.ndim < 1 or logits.dtype not in _LOGITS
            or logits.shape[-1] % 32 or not 32 <= logits.shape[-1] <= MAX_EXPERTS):
        raise ValueError("route_metal: logits must be a float32/float16/bfloat16 mx.array [..., E] with E a "
                         f"multiple of 32 in [32, {MAX_EXPERTS}], got {_describe(logits)}")
    e = logits.shape[-1]
    if not isinstance(top_k, numbers.Integral) or isinstance(top_k, bool) or not 1 <= top_k <= min(MAX_TOP_K, e):
        raise ValueError(f"route_metal: top_k must be an int in [1, min({MAX_TOP_K}, E={e})], got top_k={top_k!r}")
    k = int(top_k)
    lead = tuple(logits.shape[:-1])
    n = logits.size // e
    if n == 0:
        return mx.zeros((*lead, k), mx.int32), mx.zeros((*lead, k), mx.float32)
    inds, scores = _kernel()(
        inputs=[logits],
        template=[("E", e), ("K", k), ("NORM", int(bool(normalize)))],
        grid=(32 * n, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(*lead, k), (*lead, k)],
        output_dtypes=[mx.int32, mx.float32],
    )
    return inds, scores
