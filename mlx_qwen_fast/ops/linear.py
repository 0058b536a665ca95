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

At prefill, a projection of many token rows (:func:`prefill_linear`: the
module's own call, ``layer(x)``, is the reference,
:func:`prefill_linear_reference`) runs on
:func:`mlx_qwen_fast.kernels.quantized_gemm.quantized_gemm` where it
applies -- CUDA, bf16, at least :data:`PREFILL_GEMM_MIN_ROWS` rows and
:data:`PREFILL_GEMM_MIN_FEATURES` outputs, a 4-bit
group-64 affine ``QuantizedLinear`` without a bias term,
:data:`mlx_qwen_fast.config.PREFILL_GEMM_KERNEL` on: the same rounding
points, fp32 sums in another order.

Between two projections a decoder layer adds a block's output to the
residual stream and normalises the sum for the next block (``h = x +
attn(...)``, then ``post_attention_layernorm(h)``): :func:`add_rms_norm`
returns both, ``(x + y, mx.fast.rms_norm(x + y, weight, eps))``;
:func:`add_rms_norm_reference` is those two stock ops, and the dispatcher
runs :func:`mlx_qwen_fast.kernels.add_rms_norm_metal.add_rms_norm_metal`
(one launch, the same rounding points) on Metal with
:data:`mlx_qwen_fast.config.METAL_KERNELS` on, the reference elsewhere.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import mlx.core as mx

from .. import backend as _backend
from .. import config
from ..compiled import apply_linear, linear_arrays
from ..kernels import _cuda_build
from ..kernels import add_rms_norm_metal as _k_add_norm_metal
from ..kernels import quantized_gemm as _k_gemm
from ..kernels import quantized_gemv as _k_gemv
from ..kernels._checks import check_eps, describe
from ._checks import FLOATS, check_float_array, fail, is_int

__all__ = ["ADD_NORM_IMPLEMENTATIONS", "IMPLEMENTATIONS", "add_rms_norm", "add_rms_norm_implementation",
           "add_rms_norm_reference", "decode_linear", "decode_linear_reference", "decode_linear_unchecked",
           "decode_implementation", "implementation_for", "PREFILL_GEMM_MIN_FEATURES", "PREFILL_GEMM_MIN_ROWS",
           "prefill_implementation",
           "prefill_implementation_for", "prefill_linear", "prefill_linear_reference"]

#: What :func:`decode_linear` can run: the fused kernel or the reference ops.
IMPLEMENTATIONS = ("cuda-kernel", "reference")

Norm = Optional[Tuple[mx.array, float]]


def decode_linear_reference(x: mx.array, arrays: Sequence[mx.array], static: tuple, *, norm: Norm = None,
                            residual: Optional[mx.array] = None,
                            normed_out: bool = False) -> Union[mx.array, Tuple[mx.array, mx.array]]:
    """The contract above in stock ops: ``xin = mx.fast.rms_norm(x, *norm)``
    (or x), ``y = apply_linear(xin, arrays, static)``, ``residual + y``;
    ``(out, xin)`` with ``normed_out``.

    Raises:
        ValueError: an argument outside the contract (:func:`decode_linear`'s
            checks), e.g. normed_out without a norm.
    """
    _check_call("decode_linear_reference", x, arrays, static, norm, residual, normed_out)
    return _reference(x, arrays, static, norm, residual, normed_out)


def _reference(x, arrays, static, norm, residual, normed_out):
    """:func:`decode_linear_reference` of checked arguments."""
    xin = x if norm is None else mx.fast.rms_norm(x, norm[0], norm[1])
    y = apply_linear(xin, arrays, static)
    if residual is not None:
        y = residual + y
    return (y, xin) if normed_out else y


def _check_static(fn: str, arrays, static) -> Tuple[int, int]:
    """``(K, N)`` (input and output size) of the layer :func:`linear_arrays`
    described, after checking ``static`` and ``arrays`` agree: ("dense",
    has_bias) with (weight [N, K][, bias [N]]), or ("quantized", group_size,
    bits, mode, has_biases, has_bias) with (weight [N, K * bits / 32],
    scales[, biases][, bias])."""
    known = _STATICS.get(static) if isinstance(static, tuple) and all(map(_hashable, static)) else None
    if known is None:
        known = _static_layout(fn, static)
        if len(_STATICS) < 64:
            _STATICS[static] = known
    n_arrays, bits = known
    if (not isinstance(arrays, (tuple, list)) or len(arrays) != n_arrays
            or not all(isinstance(a, mx.array) for a in arrays)):
        fail(fn, f"arrays must be {n_arrays} mx.arrays (linear_arrays' arrays for static {static!r}), got "
                 f"{describe(arrays) if not isinstance(arrays, (tuple, list)) else [describe(a) for a in arrays]}")
    w = arrays[0]
    if w.ndim != 2:
        fail(fn, f"arrays[0] (the weight) must be 2-d, got {describe(w)}")
    K = w.shape[1] if bits is None else w.shape[1] * 32 // bits
    return K, w.shape[0]


#: static -> (array count, bits or None) of the settings checked so far
_STATICS: dict = {}


def _hashable(v) -> bool:
    return isinstance(v, (str, int, bool, type(None)))


def _static_layout(fn: str, static) -> Tuple[int, Optional[int]]:
    """(array count, bits or None) of a valid ``static``, else ValueError."""
    if isinstance(static, tuple) and len(static) == 2 and static[0] == "dense" and isinstance(static[1], bool):
        return 1 + static[1], None
    if (isinstance(static, tuple) and len(static) == 6 and static[0] == "quantized" and is_int(static[1])
            and static[1] > 0 and is_int(static[2]) and 0 < static[2] <= 32 and isinstance(static[3], str)
            and isinstance(static[4], bool) and isinstance(static[5], bool)):
        return 2 + static[4] + static[5], static[2]
    fail(fn, f"static must be linear_arrays' settings, (\"dense\", has_bias) or (\"quantized\", group_size, "
             f"bits, mode, has_biases, has_bias), got {static!r}")


def _check_call(fn: str, x, arrays, static, norm, residual, normed_out) -> None:
    """The arguments of :func:`decode_linear` / :func:`decode_linear_reference`
    (shapes, dtypes and Python values only: traced inside the decode steps)."""
    K, N = _check_static(fn, arrays, static)
    if not isinstance(x, mx.array) or x.dtype not in FLOATS or x.ndim < 1:
        check_float_array(fn, "x", x, f"[..., {K}]", min_ndim=1)
    if x.shape[-1] != K:
        fail(fn, f"x must have shape [..., {K}] (the layer's input size), got {describe(x)}")
    if norm is not None:
        if not isinstance(norm, (tuple, list)) or len(norm) != 2:
            fail(fn, f"norm must be None or (weight [{K}], eps), got {describe(norm)}")
        if not isinstance(norm[0], mx.array) or norm[0].dtype not in FLOATS or norm[0].shape != (K,):
            fail(fn, f"norm's weight must be a float mx.array of shape [{K}], got {describe(norm[0])}")
        check_eps(fn, "norm's eps", norm[1])
    if residual is not None and (not isinstance(residual, mx.array) or residual.shape[:-1] != x.shape[:-1]
                                 or residual.shape[-1:] != (N,)):
        fail(fn, f"residual must be None or an mx.array of shape {list(x.shape[:-1]) + [N]} (x's rows, the "
                 f"layer's {N} outputs), got {describe(residual)}")
    if normed_out is not False and normed_out is not True:
        fail(fn, f"normed_out must be a bool, got {normed_out!r}")
    if normed_out and norm is None:
        fail(fn, "normed_out needs norm (the normalised rows)")


def _kernel_args(static: tuple) -> Optional[Tuple[int, int]]:
    """(group_size, bits) of a quantised layer the kernel takes (affine,
    with biases, no bias), else None."""
    if static[0] != "quantized" or len(static) != 6:
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
    fused kernel or :func:`decode_linear_reference`.

    Raises:
        ValueError: an argument outside the contract, named: ``static`` not
            :func:`~mlx_qwen_fast.compiled.linear_arrays`' settings,
            ``arrays`` not its arrays for them, ``x`` not a float ``[...,
            K]`` (K the layer's input size), ``norm`` not None or ``(weight
            [K], eps in (0, 1))``, ``residual`` not None or ``[..., N]``
            (x's rows), ``normed_out`` without ``norm``. Shape checks only
            (traced inside the decode steps).
    """
    _check_call("decode_linear", x, arrays, static, norm, residual, normed_out)
    if decode_implementation(x, arrays, static, norm=norm, residual=residual) == "reference":
        return _reference(x, arrays, static, norm, residual, normed_out)
    group_size, bits = _kernel_args(static)
    w, scales, biases = arrays[:3]
    return _k_gemv.quantized_gemv(x, w, scales, biases, group_size=group_size, bits=bits,
                                  norm_weight=None if norm is None else norm[0],
                                  norm_eps=None if norm is None else norm[1], residual=residual,
                                  normed_out=normed_out)


def decode_linear_unchecked(x: mx.array, arrays: Sequence[mx.array], static: tuple, implementation: str) -> mx.array:
    """:func:`decode_linear` without norm or residual and without its checks,
    for a caller that checked a call of the same shapes, dtypes and settings
    before and kept :func:`decode_implementation`'s answer for it (the
    language-model head of each decode token: ``layers.FastHead``). Runs
    ``implementation`` ("cuda-kernel" or "reference") as given; arguments
    outside what was checked are undefined behaviour."""
    if implementation == "reference":
        return _reference(x, arrays, static, None, None, False)
    group_size, bits = _kernel_args(static)
    return _k_gemv.quantized_gemv_unchecked(x, arrays[0], arrays[1], arrays[2], group_size, bits, None, 1e-6, None, False)


def implementation_for(num_tokens: int, backend: Optional[str] = None) -> str:
    """What a 4-bit bf16 model's projections, with their norms and
    residuals, get inside the decode layer step on ``backend``:
    "cuda-kernel" (the fused GEMV) for 1 to
    :data:`mlx_qwen_fast.kernels.quantized_gemv.MAX_ROWS` token rows on CUDA
    with :data:`mlx_qwen_fast.config.DECODE_GEMV_KERNEL` on; "metal-kernel"
    (the projections on MLX's ops, the residual add before the
    post-attention RMSNorm as one kernel with it: :func:`add_rms_norm`) for
    1 or more rows on Metal, where MLX has a Metal device, with
    :data:`~mlx_qwen_fast.config.METAL_KERNELS` on; else "reference" (the
    stock ops). Raises ValueError for an unknown backend."""
    name = _backend.resolve(backend)
    if (name == _backend.CUDA and 1 <= num_tokens <= _k_gemv.MAX_ROWS and _cuda_build.cuda_available()
            and config.DECODE_GEMV_KERNEL.get()):
        return "cuda-kernel"
    if name == _backend.METAL and num_tokens >= 1 and mx.metal.is_available() and config.METAL_KERNELS.get():
        return "metal-kernel"
    return "reference"


# ---------------------------------------------------------------------------
# prefill: a projection of many rows
# ---------------------------------------------------------------------------

#: Fewest token rows a prefill projection runs on the GEMM kernel with (below,
#: MLX's quantized matmul), and fewest output features: below either, MLX's matmul
#: is the faster (the crossovers per projection: bench/results/prefill-gemm-log.md).
PREFILL_GEMM_MIN_ROWS = 1024
PREFILL_GEMM_MIN_FEATURES = 2048


def _check_prefill(fn: str, layer, x) -> Optional[tuple]:
    """``linear_arrays(layer)`` after checking the arguments (``x`` a float
    ``[..., K]`` of the layer's input size); None for another callable
    module (its own call is the contract)."""
    lin = linear_arrays(layer)
    if lin is None:
        if not callable(layer):
            fail(fn, f"layer must be a module (nn.Linear, nn.QuantizedLinear or another callable), got {describe(layer)}")
        return None
    k = _check_static(fn, *lin)[0]
    check_float_array(fn, "x", x, f"[..., {k}]", min_ndim=1)
    if x.shape[-1] != k:
        fail(fn, f"x must be [..., {k}] (the layer's input size), got {describe(x)}")
    return lin


def prefill_linear_reference(layer, x: mx.array) -> mx.array:
    """``layer(x)``: the module's own call (``mx.quantized_matmul`` for an
    ``nn.QuantizedLinear``). Arguments, returns and errors as
    :func:`prefill_linear`."""
    lin = _check_prefill("prefill_linear_reference", layer, x)
    if lin is not None and 0 in x.shape[:-1]:  # no rows: the module's quantised matmul cannot take them
        return apply_linear(x, *lin)
    return layer(x)


def prefill_implementation_for(num_tokens: int, backend: Optional[str] = None) -> str:
    """What a 4-bit group-64 model's prefill projections of ``num_tokens``
    rows get on ``backend`` (the patch report's ``linear.prefill`` row):
    "cuda-kernel" on CUDA with :data:`mlx_qwen_fast.config.PREFILL_GEMM_KERNEL`
    on and at least :data:`PREFILL_GEMM_MIN_ROWS` rows, else "stock" (the
    modules' own calls). Raises ValueError for an unknown backend."""
    if (_backend.resolve(backend) == _backend.CUDA and num_tokens >= PREFILL_GEMM_MIN_ROWS
            and _cuda_build.cuda_available() and config.PREFILL_GEMM_KERNEL.get()):
        return "cuda-kernel"
    return "stock"


def prefill_implementation(layer, x, *, backend: Optional[str] = None) -> str:
    """The name in :data:`IMPLEMENTATIONS` that :func:`prefill_linear` runs
    for these arguments on ``backend``: "cuda-kernel" on CUDA with
    :data:`mlx_qwen_fast.config.PREFILL_GEMM_KERNEL` on, at least
    :data:`PREFILL_GEMM_MIN_ROWS` rows, a layer the kernel takes (an
    ``nn.QuantizedLinear``, 4-bit group-64 affine with biases, no bias term,
    at least :data:`PREFILL_GEMM_MIN_FEATURES` outputs)
    and :func:`mlx_qwen_fast.kernels.quantized_gemm.supports`; else
    "reference". Shapes only: nothing is evaluated."""
    if not isinstance(x, mx.array) or x.ndim < 1:
        return "reference"
    return _prefill_choice(linear_arrays(layer), x, backend)


def _prefill_choice(lin, x, backend=None) -> str:
    """:func:`prefill_implementation` of ``lin = linear_arrays(layer)`` (None:
    not a linear module) and an mx.array ``x`` of rank >= 1."""
    if prefill_implementation_for(x.size // max(x.shape[-1], 1), backend) != "cuda-kernel":
        return "reference"
    if lin is None or _kernel_args(lin[1]) != (64, 4):
        return "reference"
    w, scales, biases = lin[0][:3]
    if w.ndim != 2 or w.shape[0] < PREFILL_GEMM_MIN_FEATURES:
        return "reference"
    return "cuda-kernel" if _k_gemm.supports(x, w, scales, biases) else "reference"


def prefill_linear(layer, x: mx.array) -> mx.array:
    """``layer(x)`` for a prefill chunk, by :func:`prefill_implementation`'s
    choice: the fused-dequantisation GEMM or the module's own call.

    Args:
        layer: mlx-lm's projection: an ``nn.QuantizedLinear`` or
            ``nn.Linear``; any other callable module (an adapter wrapping
            one) runs its own call.
        x: ``[..., K]`` float rows, K the linear layer's input size.

    Returns:
        ``[..., N]`` as ``layer(x)``; from the kernel bf16 within bf16
        rounding of it (one rounding of each dequantised weight and of the
        result; fp32 sums in another order).

    Raises:
        ValueError: ``layer`` not callable, ``x`` not a float ``[..., K]``
            of a linear layer's input size (named).
    """
    lin = _check_prefill("prefill_linear", layer, x)
    if lin is not None and 0 in x.shape[:-1]:  # no rows: the module's quantised matmul cannot take them
        return apply_linear(x, *lin)
    if lin is None or _prefill_choice(lin, x) == "reference":
        return layer(x)
    w, scales, biases = lin[0][:3]
    return _k_gemm.quantized_gemm_unchecked(x, w, scales, biases, _k_gemm.variant_for(w.shape[0], x.shape[-1]))


# ---------------------------------------------------------------------------
# the residual add with the next RMSNorm
# ---------------------------------------------------------------------------

#: What :func:`add_rms_norm` can run: the Metal kernel or the reference ops.
ADD_NORM_IMPLEMENTATIONS = ("metal-kernel", "reference")


def _check_add_norm(fn: str, x, y, weight, eps) -> None:
    """The arguments of :func:`add_rms_norm` / :func:`add_rms_norm_reference`
    (shapes, dtypes and Python values only: traced inside the decode steps)."""
    check_float_array(fn, "x", x, "[..., D]", min_ndim=1)
    if not isinstance(y, mx.array) or y.shape != x.shape or y.dtype != x.dtype:
        fail(fn, f"y must be an mx.array of x's shape and dtype ({describe(x)}), got {describe(y)}")
    if not isinstance(weight, mx.array) or weight.dtype not in FLOATS or weight.shape != (x.shape[-1],):
        fail(fn, f"weight must be a float32/float16/bfloat16 mx.array of shape [{x.shape[-1]}] (x's last axis), "
                 f"got {describe(weight)}")
    check_eps(fn, "eps", eps)


def add_rms_norm_reference(x: mx.array, y: mx.array, weight: mx.array, eps: float) -> Tuple[mx.array, mx.array]:
    """``h = x + y`` and ``mx.fast.rms_norm(h, weight, eps)``: the two stock
    ops the decoder layer runs (mlx-lm's ``DecoderLayer``: the residual add,
    then ``post_attention_layernorm``). Arguments, returns and errors as
    :func:`add_rms_norm`."""
    _check_add_norm("add_rms_norm_reference", x, y, weight, eps)
    return _stock_add_norm(x, y, weight, eps)


def _stock_add_norm(x, y, weight, eps):
    """:func:`add_rms_norm_reference` of checked arguments."""
    h = x + y
    return h, mx.fast.rms_norm(h, weight, eps)


def add_rms_norm_implementation(x, y, weight, *, backend: Optional[str] = None) -> str:
    """The name in :data:`ADD_NORM_IMPLEMENTATIONS` that :func:`add_rms_norm`
    runs for these arguments on ``backend`` (default
    :func:`mlx_qwen_fast.backend.current`): "metal-kernel" on Metal with
    :data:`mlx_qwen_fast.config.METAL_KERNELS` on where the kernel takes
    the arrays (:func:`mlx_qwen_fast.kernels.add_rms_norm_metal.supports`:
    MLX's Metal backend, D up to its ``MAX_D``), else "reference". Shape
    checks only (nothing is evaluated); arguments outside the contract get
    "reference" (whose checks name them)."""
    if _backend.resolve(backend) != _backend.METAL or not config.METAL_KERNELS.get():
        return "reference"
    return "metal-kernel" if _k_add_norm_metal.supports(x, y, weight) else "reference"


def add_rms_norm(x: mx.array, y: mx.array, weight: mx.array, eps: float) -> Tuple[mx.array, mx.array]:
    """A residual add and the RMSNorm after it, by
    :func:`add_rms_norm_implementation`'s choice: the Metal kernel or
    :func:`add_rms_norm_reference`.

    Args:
        x: ``[..., D]`` float32 / float16 / bfloat16 (the residual stream,
            ``[B, 1, D]`` in a decode step).
        y: x's shape and dtype (the block output added to it).
        weight: ``[D]`` float, the RMSNorm's weight.
        eps: the RMSNorm's epsilon, a float in (0, 1).

    Returns:
        ``(h, normed)``: ``h = x + y`` in x's dtype, rounded as MLX's add;
        ``normed`` = ``mx.fast.rms_norm(h, weight, eps)`` (fp32 sum of
        squares; MLX's promotion of x's and the weight's dtypes). The kernel
        rounds where those ops round; its fp32 sum runs in another order,
        so ``normed`` agrees to its dtype's rounding, ``h`` bit for bit.

    Raises:
        ValueError: an argument outside the above, named (shape checks
            only: traced inside the decode steps).
    """
    _check_add_norm("add_rms_norm", x, y, weight, eps)
    if add_rms_norm_implementation(x, y, weight) == "reference":
        return _stock_add_norm(x, y, weight, eps)
    return _k_add_norm_metal.add_rms_norm_metal(x, y, weight, eps)
