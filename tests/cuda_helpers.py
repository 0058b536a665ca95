"""Shared pieces of the CUDA kernel tests (markers, tolerances, comparisons).

The ``poison`` fixture (outputs of every kernel launch filled with NaN first)
lives in ``conftest.py``.
"""

import mlx.core as mx
import numpy as np
import pytest

HAS_CUDA = bool(getattr(mx, "cuda", None)) and mx.cuda.is_available()
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs MLX's CUDA backend")

#: bf16 unit roundoff (8 significand bits): relative error of one rounding.
BF16_EPS = 2.0**-8
#: vs the stock gather_qmm path: its bf16 quantized matmul is itself ~1.6e-2
#: (rel. norm) from fp32 math on the dequantized weights on CPU; the tight
#: checks are against fp32 math on the weights as the kernel dequantises them.
GATHER_QMM_TOL = 0.06


def npa(a) -> np.ndarray:
    """numpy view of an MLX (bf16/fp16 upcast to fp32) or numpy array."""
    if isinstance(a, mx.array):
        return np.asarray(a.astype(mx.float32) if a.dtype in (mx.bfloat16, mx.float16) else a)
    return np.asarray(a)


def rel(a, b) -> float:
    """Relative L2 error ||a - b|| / ||b|| in float64."""
    a, b = npa(a).astype(np.float64), npa(b).astype(np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def finite(*xs) -> bool:
    """True when every element of every array is finite (poisoned outputs
    that a kernel did not write stay NaN)."""
    return all(bool(mx.all(mx.isfinite(x.astype(mx.float32))).item()) for x in xs)
