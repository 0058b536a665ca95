"""Dense 4-bit GEMM with fused dequantisation for prefill on CUDA: the
projections of a prompt chunk (``QuantizedLinear`` on many token rows).

Computes, for ``x [..., K]`` bf16 and an MLX affine 4-bit group-64 weight
(``weight [O, K/8]`` uint32, ``scales``/``biases [O, K/64]`` bf16, no bias
term)::

    y = bf16(x @ W^T),   W[o, i] = bf16(scale * q + bias)   # [..., O] bf16

fp32 accumulation on the tensor cores, one rounding of each weight (as
MLX's CUDA ``mx.dequantize``) and one of the result: the function of
``mx.quantized_matmul`` on bf16 to bf16 rounding (the sums run in another
order).

A dense projection is the one-group case of the prefill MoE's grouped GEMM:
the launch is :mod:`~mlx_qwen_fast.kernels.moe_grouped_gemm`'s down kernel
(``MOE_KIND 1``, bf16 output) with one expert holding every row in order
(``order = arange(M)``, ``offsets = [0, M]``, the work items the row tiles,
every routing weight 1.0, exact). Its two builds
(:mod:`~mlx_qwen_fast.kernels.moe_grouped_gemm_builds`): "wgmma" (compute
capability 9.0, ``O % 256 == 0``, ``K % 128 == 0``; ``x`` passed in the
kernel's K order, :func:`~.moe_grouped_gemm_builds.permute_k`) and "mma"
(other GPUs and shapes, ``O % 64 == 0``, ``K % 64 == 0``). No bf16 copy of
the weight is ever written to global memory. The reference with the same
contract: :func:`mlx_qwen_fast.ops.linear.prefill_linear_reference`
(``mx.quantized_matmul``). Sources: ``cuda/moe_grouped_gemm_wgmma.cu``,
``cuda/moe_grouped_gemm.cu``.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import mlx.core as mx

from . import _cuda_build as cb
from ._checks import describe
from .moe_contract import is_4bit_group64
from .moe_grouped_gemm_builds import (BK, BN, TILE_CHOICES, WGMMA_FEATURES, WG_KC, check_variant,
                                      get_kernel, is_sm90, launch_kw, permute_k)

__all__ = ["quantized_gemm", "quantized_gemm_unchecked", "supports", "choose_tile_rows", "variant_for"]

#: Share of the SMs the tile rule's grid must give a CTA (:func:`choose_tile_rows`):
#: a grid one CTA short of every SM with larger tiles beats one of twice the CTAs
#: with smaller tiles (the per-tile timings: bench/results/prefill-gemm-log.md).
_MIN_FILL = 0.75


def variant_for(O: int, K: int) -> str:
    """The build that runs ``[M, K] x [O, K]^T``: "wgmma" on a GPU of
    compute capability 9.0 where ``O % 256 == 0`` and ``K % 128 == 0`` (the
    down kernel's feature tile and K chunk), else "mma". Never compiles."""
    return "wgmma" if O % WGMMA_FEATURES["down"] == 0 and K % WG_KC == 0 and is_sm90() else "mma"


def choose_tile_rows(M: int, O: int, variant: str, sm_count: int) -> int:
    """Rows per work item (one of :data:`TILE_CHOICES`): the largest whose
    grid (row tiles x feature tiles) still gives three SMs in four a CTA,
    else the smallest. Larger tiles read each weight tile fewer times; smaller ones
    fill a GPU that large tiles would leave idle (few rows or a narrow
    ``O``). The timings per tile: ``python -m bench.prefill_gemm``."""
    cols = O // (WGMMA_FEATURES["down"] if variant == "wgmma" else BN)
    for bm in sorted(TILE_CHOICES, reverse=True):
        if -(-M // bm) * cols >= _MIN_FILL * sm_count:
            return bm
    return min(TILE_CHOICES)


def _problem(x, w, scales, biases) -> Optional[str]:
    """Why the kernels cannot take these arguments (None: they can); reads
    only types, shapes and dtypes."""
    if not isinstance(x, mx.array) or x.ndim < 1 or x.dtype != mx.bfloat16:
        return f"x must be a bfloat16 array [..., K], got {describe(x)}"
    K = x.shape[-1]
    if not isinstance(w, mx.array) or w.ndim != 2:
        return f"w must be uint32 [O, K/8], got {describe(w)}"
    O = w.shape[0]
    if not is_4bit_group64((w, scales, biases), (), O, K):
        return (f"(w, scales, biases) must be 4-bit group-64 affine weights for K={K}: uint32 [O, {K // 8}], "
                f"bfloat16 [O, {K // 64}] twice; got {describe(w)}, {describe(scales)}, {describe(biases)}")
    if K % BK or O % BN or O == 0 or K == 0:
        return f"K and O must be positive multiples of 64, got K={K}, O={O}"
    M = math.prod(x.shape[:-1])
    if max(x.size, w.size, M * O) >= 2**31:  # 32-bit element offsets in the kernels
        return f"arrays must hold fewer than 2**31 elements, got x {x.size}, w {w.size}, output {M * O}"
    return None


def supports(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array) -> bool:
    """True when :func:`quantized_gemm` runs here on these arguments: MLX's
    CUDA backend and the contract above. Never compiles, never raises."""
    return cb.cuda_available() and _problem(x, w, scales, biases) is None


@functools.lru_cache(maxsize=32)
def _one_group(M: int, bm: int) -> Tuple[mx.array, mx.array, mx.array, mx.array]:
    """(order, offsets, block map, weights) of one expert holding rows
    0..M-1 in order, in row tiles of ``bm``: the grouped GEMM's work items of
    a dense product. Cached per (M, bm): a prompt's chunks repeat sizes."""
    tiles = -(-M // bm)
    order = mx.arange(M, dtype=mx.int32)
    offsets = mx.array([0, M], dtype=mx.int32)
    bmap = mx.stack([mx.zeros((tiles,), mx.int32), mx.arange(tiles, dtype=mx.int32)], axis=1)
    ones = mx.ones((M,), mx.float32)
    mx.eval(order, offsets, bmap, ones)
    return order, offsets, bmap, ones


def quantized_gemm(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *,
                   variant: Optional[str] = None, tile_rows: Optional[int] = None) -> mx.array:
    """``bf16(x @ dequantize(w, scales, biases).T)`` on the tensor cores.

    Args:
        x: ``[..., K]`` bfloat16 rows (M = the product of the leading axes).
        w: ``[O, K/8]`` uint32, MLX affine 4-bit packing (8 nibbles per word,
            lowest nibble = lowest input index).
        scales, biases: ``[O, K/64]`` bfloat16 (group size 64).
        variant: "wgmma" or "mma" (None: :func:`variant_for`).
        tile_rows: rows per work item, one of :data:`TILE_CHOICES` (None:
            :func:`choose_tile_rows`).

    Returns:
        ``[..., O]`` bfloat16.

    Raises:
        ValueError: an argument outside the contract (named: dtype, shape,
            quantisation, K or O not multiples of 64, arrays of 2**31
            elements or more), "wgmma" for a shape or GPU it does not take,
            a ``tile_rows`` outside :data:`TILE_CHOICES`.
        RuntimeError: no CUDA GPU (from the kernel build).
    """
    problem = _problem(x, w, scales, biases)
    if problem is not None:
        raise ValueError(f"quantized_gemm: {problem}")
    O, K = w.shape[0], x.shape[-1]
    v = check_variant("quantized_gemm", variant) if variant is not None else variant_for(O, K)
    if v == "wgmma" and (O % WGMMA_FEATURES["down"] or K % WG_KC or not is_sm90()):
        raise ValueError(f"quantized_gemm: the wgmma build needs O % 256 == 0, K % 128 == 0 and a GPU of "
                         f"compute capability 9.0, got O={O}, K={K}")
    if tile_rows is not None and (isinstance(tile_rows, bool) or tile_rows not in TILE_CHOICES):
        raise ValueError(f"quantized_gemm: tile_rows must be one of {TILE_CHOICES}, got {tile_rows!r}")
    return quantized_gemm_unchecked(x, w, scales, biases, v, tile_rows)


def quantized_gemm_unchecked(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, variant: str,
                             tile_rows: Optional[int] = None) -> mx.array:
    """:func:`quantized_gemm` on arguments that passed its checks
    (``variant`` resolved); for callers that checked them once per layer."""
    lead, K = x.shape[:-1], x.shape[-1]
    O = w.shape[0]
    M = math.prod(lead)
    if M == 0:
        return mx.zeros((*lead, O), mx.bfloat16)
    bm = tile_rows or choose_tile_rows(M, O, variant, cb.sm_count())
    order, offsets, bmap, ones = _one_group(M, bm)
    x2 = x.reshape(M, K)
    if variant == "wgmma":
        x2 = permute_k(x2)
    kern, cfg = get_kernel("down", bm, "bf16_t", variant=variant, out_cols=O, in_cols=K)
    (y,) = kern(
        inputs=[x2, w, scales, biases, order, offsets, bmap, ones],
        output_shapes=[(M, O)],
        output_dtypes=[mx.bfloat16],
        scalars=[K, O, 1],
        **launch_kw(cfg, bmap.shape[0], O // cfg["bn"]),
    )
    return y.reshape(*lead, O)
