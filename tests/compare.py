"""The one comparison of the kernel tests: relative L2 error against an fp32
reference, bounded by a tolerance that follows from the result's dtype.

In the manner of llama.cpp's ``test-backend-ops`` (each backend's result is
compared with the CPU's by its normalised mean squared error against a
per-op bound): every kernel test computes a reference in fp32 (or float64)
from the same inputs and checks, with :func:`assert_close`,

    err = ||got - ref||_2 / ||ref||_2   (in float64; the square root of the NMSE)
    err <= tolerance(dtype, roundings)

:func:`tolerance`:

* fp32 results (fp32 inputs, fp32 arithmetic): :data:`FP32_TOL` = 2**-16
  (~1.5e-5, 256 units of roundoff of fp32). Kernel and reference then differ
  only in the order of their fp32 operations; the relative error of an
  n-term sum taken in another order grows like sqrt(n) * u (the
  probabilistic bound of Higham & Mary, SIAM J. Sci. Comput. 41 (2019)), and
  sqrt(n) * 2**-24 <= 2**-16 for every n <= 2**16 = 65,536: longer than any
  reduction of these tests (K <= 2048 inputs, T <= 4096 recurrence steps).
* bf16 / fp16 results: ``roundings * u + FP32_TOL``, ``u`` the format's unit
  roundoff (:data:`UNIT_ROUNDOFF`: 2**-8 for bf16, 2**-11 for fp16). One
  rounding to the format moves each element by at most ``u`` of its
  magnitude, so by at most ``u`` in relative L2; ``roundings`` counts the
  points on the longest path from the inputs to the result where the kernel
  and the reference round to the format independently (e.g. SwitchGLU's
  gate, up, SwiGLU and down outputs: a value that rounds one way in the
  kernel and the other in the reference moves what follows by at most ``u``
  relative). The reductions themselves accumulate in fp32 (the FP32_TOL term).

Each test states its ``roundings`` where it calls :func:`tolerance`. Bounds
follow from the format and the computation's structure; none is chosen from
a measurement, and none may be widened to make a test pass.

Comparisons against MLX's own bf16 path (stock ``gather_qmm``) rather than an
fp32 reference use :data:`GATHER_QMM_TOL` (the reference itself is only
bf16-accurate there).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

#: Unit roundoff (half the spacing of the numbers at 1) per dtype.
UNIT_ROUNDOFF = {mx.float32: 2.0**-24, mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8}
#: bf16's unit roundoff: relative error of one rounding.
BF16_EPS = UNIT_ROUNDOFF[mx.bfloat16]
#: Bound for fp32 results (see the module docstring).
FP32_TOL = 2.0**-16
#: vs the stock gather_qmm path (a bf16 reference): its bf16 quantized matmul
#: is itself ~1.6e-2 (relative L2) from fp32 math on the dequantized weights
#: per projection on CPU, and SwitchGLU chains three of them (3 x 1.6e-2 =
#: 0.048); the tight checks are against fp32 math on the weights as the
#: kernel dequantises them.
GATHER_QMM_TOL = 0.06


def unit_roundoff(dtype) -> float:
    """Unit roundoff of ``dtype`` (float32, float16, bfloat16)."""
    try:
        return UNIT_ROUNDOFF[dtype]
    except KeyError:
        raise ValueError(f"unit_roundoff: no floating-point format {dtype!r}") from None


def tolerance(dtype, roundings: int = 1) -> float:
    """Bound on the relative L2 error of a result of ``dtype`` against its
    fp32 reference: :data:`FP32_TOL` for float32, ``roundings * u +
    FP32_TOL`` for bfloat16 / float16 (see the module docstring)."""
    if dtype == mx.float32:
        return FP32_TOL
    if not isinstance(roundings, int) or roundings < 1:
        raise ValueError(f"tolerance: roundings must be an int >= 1, got {roundings!r}")
    return roundings * unit_roundoff(dtype) + FP32_TOL


def npa(a) -> np.ndarray:
    """numpy view of an MLX (bf16/fp16 upcast to fp32) or numpy array."""
    if isinstance(a, mx.array):
        return np.asarray(a.astype(mx.float32) if a.dtype in (mx.bfloat16, mx.float16) else a)
    return np.asarray(a)


def rel_err(got, ref) -> float:
    """Relative L2 error ``||got - ref|| / ||ref||`` in float64 (0 when both
    are zero, inf when only ``ref`` is)."""
    a, b = npa(got).astype(np.float64), npa(ref).astype(np.float64)
    if a.shape != b.shape:
        raise ValueError(f"rel_err: shapes differ: {a.shape} vs {b.shape}")
    num, den = float(np.linalg.norm(a - b)), float(np.linalg.norm(b))
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def assert_close(got, ref, tol: float, what: str = "") -> float:
    """Assert ``rel_err(got, ref) <= tol`` (``tol`` from :func:`tolerance`,
    :data:`GATHER_QMM_TOL`, or 0.0 for exact agreement); NaN fails. Returns
    the error."""
    err = rel_err(got, ref)
    assert err <= tol, f"{what or 'result'}: relative L2 error {err:.3e} > bound {tol:.3e}"
    return err


def finite(*xs) -> bool:
    """True when every element of every array is finite (poisoned outputs
    that a kernel did not write stay NaN)."""
    return all(bool(mx.all(mx.isfinite(x.astype(mx.float32))).item()) for x in xs)
