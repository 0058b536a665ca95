"""Quantised GEMV for decode on CUDA, with the RMSNorm before it and the
residual add after it fused: one launch where mlx-lm's decoder layer runs
two (``rms_norm`` then ``quantized_matmul``, or ``quantized_matmul`` then
``+``) at one token per row.

Computes, for ``x [..., K]`` of 1 to 4 token rows (bf16) and an affine
quantised weight (``mx.quantize``: 4 or 8 bits, group 32/64/128, bf16
scales and biases)::

    xin = rms_norm(x, norm_weight, norm_eps)   # when norm_weight is given
    out = xin @ dequantize(w).T (+ residual)   # [..., N] bf16

and optionally ``xin`` itself (``normed_out``), for a caller whose next
kernel reads the normalised rows (the MoE experts after the router). The
rounding points are the stock path's (MLX's ``rms_norm``, the matmul's
result, the add); each weight is dequantised to ``bf16(s * q + b)`` and the
dot products run on the tensor cores (``mma.sync`` m16n8k16, fp32
accumulation). The reference with the same contract:
:func:`mlx_qwen_fast.ops.linear.decode_linear_reference`.

Grid: ``ceil(N / 16)`` blocks, each 16 output rows for every token; its
:func:`warps` warps split K (every weight load issued before the block
stages the input rows), their sums added in warp order (deterministic).
Source: ``mlx_qwen_fast/cuda/quantized_gemv.cu``.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple, Union

import mlx.core as mx

from . import _checks
from . import _cuda_build as cb

__all__ = ["quantized_gemv", "quantized_gemv_unchecked", "supports", "warps", "MAX_ROWS"]

#: Token rows per call at most (the B columns of one m16n8 tile that the
#: staged rows' 32 KB of shared memory hold at K = 4096).
MAX_ROWS = 4
_BITS = (4, 8)
_GROUPS = (32, 64, 128)
_FLOAT = (mx.bfloat16, mx.float16, mx.float32)
_kernels: Dict[tuple, cb.CudaKernel] = {}
_ARRAYS = (("x", "[..., K] bfloat16", False), ("w", "[N, K * bits / 32] uint32", False),
           ("scales", "[N, K / group_size] bfloat16", False), ("biases", "[N, K / group_size] bfloat16", False),
           ("norm_weight", "[K] (float)", True), ("residual", "[..., N] bfloat16", True))


def warps(K: int, bits: int) -> int:
    """Warps per block: one per 512 inputs at 4 bits (256 at 8 bits: the
    same 256 bytes per row), 1 to 16 (every warp keeps at most four
    128-input blocks of both its rows in registers up to K = 8192 / 4096)."""
    per_warp = 512 if bits == 4 else 256
    return max(1, min(16, -(-K // per_warp)))


def _rows(x) -> int:
    return math.prod(x.shape[:-1]) if x.ndim >= 1 else 0


def _problem(x, w, scales, biases, norm_weight, residual, group_size, bits) -> Optional[str]:
    """None when the kernel takes these arguments, else what does not fit."""
    if bits not in _BITS:
        return f"bits must be one of {_BITS}, got {bits!r}"
    if group_size not in _GROUPS:
        return f"group_size must be one of {_GROUPS}, got {group_size!r}"
    if x.dtype != mx.bfloat16 or x.ndim < 1:
        return f"x must be bfloat16 [..., K], got {x.dtype} {tuple(x.shape)}"
    K, M = x.shape[-1], _rows(x)
    if not 1 <= M <= MAX_ROWS:
        return f"x must hold 1 to {MAX_ROWS} rows (the product of its leading axes), got {tuple(x.shape)}"
    if K % group_size or K * M * 2 > 32768:
        return (f"x's last axis ({K}) must be a multiple of group_size ({group_size}) with rows * K <= 16384, "
                f"got {tuple(x.shape)}")
    if w.dtype != mx.uint32 or w.ndim != 2 or w.shape[1] * 32 != K * bits or w.shape[0] < 1:
        return f"w must be uint32 [N, {K * bits // 32}] for K = {K} at {bits} bits, got {w.dtype} {tuple(w.shape)}"
    N = w.shape[0]
    for name, a in (("scales", scales), ("biases", biases)):
        if a.dtype != mx.bfloat16 or tuple(a.shape) != (N, K // group_size):
            return f"{name} must be bfloat16 [{N}, {K // group_size}], got {a.dtype} {tuple(a.shape)}"
    if norm_weight is not None and (norm_weight.dtype not in _FLOAT or tuple(norm_weight.shape) != (K,)):
        return f"norm_weight must be a float array of shape [{K}], got {norm_weight.dtype} {tuple(norm_weight.shape)}"
    want = tuple(x.shape[:-1]) + (N,)
    if residual is not None and (residual.dtype != mx.bfloat16 or tuple(residual.shape) != want):
        return f"residual must be bfloat16 {list(want)}, got {residual.dtype} {tuple(residual.shape)}"
    return None


def projection_problem(name: str, proj, n: int, k: int, bits: int, group_size: int, scale_dtype) -> Optional[str]:
    """None when ``proj`` is (weight, scales, biases) of an affine
    ``bits``-bit group-``group_size`` quantised linear layer of ``n`` outputs
    and ``k`` inputs (weight uint32 [n, k * bits / 32], scales and biases
    ``scale_dtype`` [n, k / group_size]), else one line naming ``name``'s
    part that does not fit (the persistent decode kernels' projections)."""
    if not isinstance(proj, (tuple, list)) or len(proj) != 3 or not all(_checks.is_array(a) for a in proj):
        return (f"{name} must be (weight, scales, biases) of an affine {bits}-bit group-{group_size} quantised "
                f"linear layer, got {_checks.describe(proj)}")
    w, sc, b = proj
    if w.dtype != mx.uint32 or tuple(w.shape) != (n, k * bits // 32):
        return f"{name}[0] (weight) must be uint32 [{n}, {k * bits // 32}], got {w.dtype} {tuple(w.shape)}"
    for part, a in (("1] (scales)", sc), ("2] (biases)", b)):
        if a.dtype != scale_dtype or tuple(a.shape) != (n, k // group_size):
            return f"{name}[{part} must be {scale_dtype} [{n}, {k // group_size}], got {a.dtype} {tuple(a.shape)}"
    return None


def supports(x, w, scales, biases, *, group_size: int, bits: int, mode: str = "affine",
             norm_weight=None, residual=None) -> bool:
    """True when :func:`quantized_gemv` takes this call on this machine: the
    CUDA backend with a compiler, mode "affine", the shapes and dtypes of its
    docstring. Shape checks only (nothing is evaluated or compiled)."""
    if not cb.cuda_available() or mode != "affine":
        return False
    if not all(_checks.is_array(a) for a in (x, w, scales, biases)) or not all(
            _checks.is_array(a, optional=True) for a in (norm_weight, residual)):
        return False
    return _problem(x, w, scales, biases, norm_weight, residual, group_size, bits) is None


def _kernel(bits, gs, K, M, norm_dtype, res, xn) -> cb.CudaKernel:
    key = (bits, gs, K, M, norm_dtype, res, xn)
    kern = _kernels.get(key)
    if kern is None:
        kern = _kernels[key] = cb.CudaKernel("quantized_gemv.cu", "mqf_qgemv", dict(
            QG_BITS=bits, QG_GS=gs, QG_K=K, QG_M=M, QG_KW=warps(K, bits), QG_NORM=int(norm_dtype is not None),
            QG_RES=int(res), QG_XN=int(xn), QG_WT=cb.dtype_macro(norm_dtype or mx.bfloat16)))
    return kern


def quantized_gemv(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    *,
    group_size: int,
    bits: int,
    norm_weight: Optional[mx.array] = None,
    norm_eps: Optional[float] = None,
    residual: Optional[mx.array] = None,
    normed_out: bool = False,
) -> Union[mx.array, Tuple[mx.array, mx.array]]:
    """``residual + rms_norm(x, norm_weight, norm_eps) @ dequantize(w).T``
    for 1 to 4 token rows, in one launch (the norm and the residual where
    given).

    Args:
      x: [..., K] bfloat16, the product of the leading axes 1 to
        :data:`MAX_ROWS`; K a multiple of ``group_size``, rows * K <= 16384.
      w, scales, biases: ``mx.quantize(W, group_size, bits)`` of W [N, K]
        (mode "affine"): uint32 [N, K * bits / 32], bfloat16 [N, K / group_size].
      group_size: 32, 64 or 128. bits: 4 or 8.
      norm_weight: [K] float (any float dtype), or None (no RMSNorm).
      norm_eps: the RMSNorm's eps, in (0, 1); required with norm_weight.
      residual: [..., N] bfloat16 added to the result, or None.
      normed_out: also return the normalised rows (requires norm_weight).

    Returns:
      out [..., N] bfloat16; with ``normed_out``, ``(out, xin [..., K]
      bfloat16)``.

    Raises:
      ValueError: an argument outside the above (named).
      RuntimeError: no CUDA compiler could build the kernel.
    """
    fn = "quantized_gemv"
    _checks.check_arrays(fn, _ARRAYS, x, w, scales, biases, norm_weight, residual)
    problem = _problem(x, w, scales, biases, norm_weight, residual, group_size, bits)
    if problem is not None:
        raise ValueError(f"{fn}: {problem}")
    eps = 1e-6
    if norm_weight is not None:
        eps = _checks.check_eps(fn, "norm_eps", norm_eps)
    elif normed_out:
        raise ValueError(f"{fn}: normed_out needs norm_weight (the normalised rows)")
    return quantized_gemv_unchecked(x, w, scales, biases, group_size, bits, norm_weight, eps, residual, normed_out)


def quantized_gemv_unchecked(x, w, scales, biases, group_size, bits, norm_weight, eps, residual, normed_out):
    """:func:`quantized_gemv` on checked arguments (the compiled decode steps
    call it with shapes their plans checked)."""
    K, M, N = x.shape[-1], _rows(x), w.shape[0]
    kern = _kernel(bits, group_size, K, M, None if norm_weight is None else norm_weight.dtype,
                   residual is not None, normed_out)
    inputs = [x, w, scales, biases] + ([norm_weight] if norm_weight is not None else []) + (
        [residual] if residual is not None else [])
    shapes = [tuple(x.shape[:-1]) + (N,)] + ([tuple(x.shape)] if normed_out else [])
    nt = 32 * warps(K, bits)
    outs = kern(inputs, shapes, [mx.bfloat16] * len(shapes), (-(-N // 16) * nt, 1, 1), (nt, 1, 1), (N, eps))
    return (outs[0], outs[1]) if normed_out else outs[0]
