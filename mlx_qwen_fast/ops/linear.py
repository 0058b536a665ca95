"""A decoder layer's projections at decode: contract, reference, dispatch.

What mlx-lm's ``qwen3_5.DecoderLayer`` runs around each of its projections
for one token per row, as one op:

=============  ============  ==========================================
argument       shape         dtype / meaning
=============  ============  ==========================================
x              [..., K]      float activations (1 to a few rows)
arrays,        --            :func:`mlx_qwen_fast.compiled.linear_arrays`
static                       of an ``nn.Linear`` / ``nn.QuantizedLinear``
norm           ([K], eps)    the RMSNorm before the projection, or None
residual       [..., N]      added to the projection's result, or None
normed_out     bool          also return the normalised rows
returns        [..., N]      ``residual + linear(rms_norm(x))``, x's dtype
=============  ============  ==========================================

:func:`decode_linear_reference` is that computation in the stock ops
(``mx.fast.rms_norm``, the module's matmul, ``+``), each rounding to the
activation dtype. The one dispatcher, :func:`decode_linear`, runs
:func:`mlx_qwen_fast.kernels.quantized_gemv.quantized_gemv` (one launch for
the norm, the 4- or 8-bit GEMV and the add) where it applies -- CUDA, bf16,
1 to 4 rows, affine 4/8-bit weights without a bias,
:data:`mlx_qwen_fast.config.DECODE_GEMV_KERNEL` on -- and the reference
elsewhere. Both give the stock rounding points; the kernel's sums run in
another order (tensor cores, fp32), so results agree to bf16 rounding, not
bit for bit.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import mlx.core as mx

from .. import backend as _backend
from .. import config
from ..compiled import apply_linear
from ..kernels import _cuda_build
from ..kernels import quantized_gemv as _k_gemv

__all__ = ["IMPLEMENTATIONS", "decode_linear", "decode_linear_reference", "decode_implementation",
           "implementation_for"]

#: What :func:`decode_linear` can run: the fused kernel or the reference ops.
IMPLEMENTATIONS = ("cuda-kernel", "reference")

Norm = Optional[Tuple[mx.array, float]]


def decode_linear_reference(x: mx.array, arrays: Sequence[mx.array], static: tuple, *, norm: Norm = None,
                            residual: Optional[mx.array] = None,
                            normed_out: bool = False) -> Union[mx.array, Tuple[mx.array, mx.array]]:
    """The contract above in stock ops: ``xin = mx.fast.rms_norm(x, *norm)``
    (or x), ``y = apply_linear(xin, arrays, static)``, ``residual + y``;
    ``(out, xin)`` with ``normed_out``. Raises ValueError for normed_out
    without a norm."""
    if normed_out and norm is None:
        raise ValueError("decode_linear: normed_out needs norm (the normalised rows)")
    xin = x if norm is None else mx.fast.rms_norm(x, norm[0], norm[1])
    y = apply_linear(xin, arrays, static)
    if residual is not None:
        y = residual + y
    return (y, xin) if normed_out else y


def _kernel_args(static: tuple) -> Optional[Tuple[int, int]]:
    """(group_size, bits) of a quantised layer the kernel takes (affine,
    with biases, no bias), else None."""
    if static[0] != "quantized":
        return None
    _, group_size, bits, mode, has_biases, has_bias = static
    if mode != "affine" or not has_biases or has_bias:
        return None
    return group_size, bits


def decode_implementation(x, arrays: Sequence[mx.array], static: tuple, *, norm: Norm = None,
                          residual: Optional[mx.array] = None, backend: Optional[str] = None) -> str:
    """The name in :data:`IMPLEMENTATIONS` that :func:`decode_linear` runs
    for these arguments (shape checks only: nothing is evaluated)."""
    args = _kernel_args(static)
    if args is None or _backend.resolve(backend) != _backend.CUDA or not config.DECODE_GEMV_KERNEL.get():
        return "reference"
    w, scales, biases = arrays[:3]
    ok = _k_gemv.supports(x, w, scales, biases, group_size=args[0], bits=args[1],
                          norm_weight=None if norm is None else norm[0], residual=residual)
    return "cuda-kernel" if ok else "reference"


def decode_linear(x: mx.array, arrays: Sequence[mx.array], static: tuple, *, norm: Norm = None,
                  residual: Optional[mx.array] = None,
                  normed_out: bool = False) -> Union[mx.array, Tuple[mx.array, mx.array]]:
    """The contract above, by :func:`decode_implementation`'s choice: the
    fused kernel (which raises ValueError naming an argument outside its
    contract) or :func:`decode_linear_reference`."""
    if decode_implementation(x, arrays, static, norm=norm, residual=residual) == "reference":
        return decode_linear_reference(x, arrays, static, norm=norm, residual=residual, normed_out=normed_out)
    group_size, bits = _kernel_args(static)
    w, scales, biases = arrays[:3]
    return _k_gemv.quantized_gemv(x, w, scales, biases, group_size=group_size, bits=bits,
                                  norm_weight=None if norm is None else norm[0],
                                  norm_eps=None if norm is None else norm[1], residual=residual,
                                  normed_out=normed_out)


def implementation_for(num_tokens: int, backend: Optional[str] = None) -> str:
    """What a 4-bit bf16 model's projections get inside the decode layer
    step on ``backend``: "cuda-kernel" for 1 to
    :data:`mlx_qwen_fast.kernels.quantized_gemv.MAX_ROWS` token rows on CUDA
    with the switch on, else "reference" (the stock ops). Raises ValueError
    for an unknown backend."""
    name = _backend.resolve(backend)
    if (name == _backend.CUDA and 1 <= num_tokens <= _k_gemv.MAX_ROWS and _cuda_build.cuda_available()
            and config.DECODE_GEMV_KERNEL.get()):
        return "cuda-kernel"
    return "reference"
