"""A residual add fused with the next RMSNorm, on Metal: one launch per call.

A decoder layer adds each block's output to its residual stream and then
normalises the sum for the next block (``h = x + attn(...)``, then
``post_attention_layernorm(h)``): two kernels and a round trip of ``h``
through memory in MLX's ops. This kernel returns both ``h`` and the
normalised rows from one read of ``x`` and ``y``, with MLX's rounding:
``h = x + y`` in x's dtype (the correctly rounded sum, as MLX's add) and
``mx.fast.rms_norm(h, weight, eps)`` (sum of squares in fp32, the
normalised value rounded to the output dtype, then its product with the
weight). One threadgroup per row, each thread holding ``ceil(D / TG)``
elements in registers between the sum and the normalisation: the layout of
the published engine's fused residual add + RMSNorm (pplx-garden ``lily/``,
``add_rmsnorm_bf16``: 256 threads per row of 2048, 8 elements each), for
any D and with MLX's two roundings of the result where that kernel rounds
once; the threadgroup width from D as mlx-lm 0.32.2's
``mlx_lm/kernels/norm_add_norm.py`` chooses it (:func:`threads_per_row`).
Source: ``mlx_qwen_fast/metal/add_rms_norm.metal`` (the kernel body;
``mx.fast.metal_kernel`` writes the signature).

Verified only by running MLX's generated source on the CPU
(``tests/metal_check.py``) against the fp32 reference; never run on an
Apple GPU, never timed.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Tuple

import mlx.core as mx

from ._checks import check_eps, describe

__all__ = ["add_rms_norm_metal", "supports", "threads_per_row", "MAX_D", "SOURCE_FILE"]

SOURCE_FILE = Path(__file__).resolve().parents[1] / "metal" / "add_rms_norm.metal"
MAX_D = 32768  # at most 32 elements of a row per thread (1024 threads)
_FLOAT = (mx.float32, mx.float16, mx.bfloat16)


@functools.lru_cache(maxsize=1)
def _kernel():
    """The kernel, built on first use (only a call needs Metal; reloading this module builds it anew)."""
    return mx.fast.metal_kernel(name="mqf_add_rms_norm", input_names=["x", "y", "weight", "eps"],
                                output_names=["h", "normed"], source=SOURCE_FILE.read_text())


def threads_per_row(d: int) -> int:
    """The threadgroup width for rows of ``d`` elements: ``d // 8`` rounded
    down to a multiple of 32, within [32, 1024] (8 or more elements per
    thread from D = 256 up; mlx-lm's ``row_threads``)."""
    return min(1024, max(32, d // 8 // 32 * 32))


def _problem(x, y, weight) -> str:
    """Why ``(x, y, weight)`` is outside the kernel's contract ("" if not)."""
    if not isinstance(x, mx.array) or x.dtype not in _FLOAT or x.ndim < 1 or not 1 <= x.shape[-1] <= MAX_D:
        return f"x must be a float32/float16/bfloat16 mx.array [..., D] with D in [1, {MAX_D}], got {describe(x)}"
    if not isinstance(y, mx.array) or y.shape != x.shape or y.dtype != x.dtype:
        return f"y must be an mx.array of x's shape and dtype ({describe(x)}), got {describe(y)}"
    if not isinstance(weight, mx.array) or weight.dtype not in _FLOAT or weight.shape != (x.shape[-1],):
        return (f"weight must be a float32/float16/bfloat16 mx.array of shape [{x.shape[-1]}] (x's last axis), "
                f"got {describe(weight)}")
    return ""


def supports(x, y, weight) -> bool:
    """True when :func:`add_rms_norm_metal` takes these arguments on this
    machine: MLX's Metal backend, and arrays within its contract (below).
    Shape and dtype checks only (nothing is evaluated)."""
    return mx.metal.is_available() and not _problem(x, y, weight)


def add_rms_norm_metal(x: mx.array, y: mx.array, weight: mx.array, eps: float = 1e-6) -> Tuple[mx.array, mx.array]:
    """``h = x + y`` and ``mx.fast.rms_norm(h, weight, eps)`` in one Metal launch.

    Args:
        x: ``[..., D]`` float32 / float16 / bfloat16 (e.g. the decode step's
            ``[B, 1, D]`` residual stream, or ``[N, D]``), D in
            ``[1, MAX_D]``.
        y: x's shape and dtype (the block output added to it).
        weight: ``[D]`` float32 / float16 / bfloat16, the RMSNorm's weight.
        eps: the RMSNorm's epsilon, a float in (0, 1).

    Returns:
        ``(h, normed)``: ``h`` of x's shape and dtype, ``x + y`` rounded as
        MLX's add rounds it; ``normed`` of x's shape in MLX's promotion of
        x's and the weight's dtypes (``mx.fast.rms_norm``'s output dtype),
        ``h * rsqrt(mean(h^2) + eps)`` (fp32 sum of squares) rounded to it,
        times the weight, rounded again.

    Raises:
        ValueError: an argument outside the above (named, with what was
            passed).
        RuntimeError: MLX has no Metal back-end here (raised by MLX).
    """
    problem = _problem(x, y, weight)
    if problem:
        raise ValueError(f"add_rms_norm_metal: {problem}")
    eps = check_eps("add_rms_norm_metal", "eps", eps)
    d = x.shape[-1]
    out = mx.result_type(x, weight)
    n = x.size // d
    if n == 0:
        return mx.zeros(x.shape, x.dtype), mx.zeros(x.shape, out)
    tg = threads_per_row(d)
    h, normed = _kernel()(
        inputs=[x.reshape(n, d), y.reshape(n, d), weight, mx.array(eps, dtype=mx.float32)],
        template=[("T", x.dtype), ("OT", out), ("D", d), ("TG", tg), ("R", -(-d // tg))],
        grid=(tg * n, 1, 1),
        threadgroup=(tg, 1, 1),
        output_shapes=[(n, d), (n, d)],
        output_dtypes=[x.dtype, out],
    )
    return h.reshape(x.shape), normed.reshape(x.shape)
