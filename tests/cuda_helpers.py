"""Whether MLX's CUDA backend is here, for the suite's run rules (conftest.py)
and the few CPU tests whose expectation depends on it.

CUDA tests are marked ``@pytest.mark.cuda`` (or ``pytestmark``) and nothing
else: conftest.py skips them without a GPU. The comparison of kernel
results lives in ``compare.py``; its names are re-exported here for scripts
that imported them from this module (``bench/``).
"""

import mlx.core as mx

from compare import BF16_EPS, GATHER_QMM_TOL, finite, npa, rel_err  # noqa: F401 (re-exported)

__all__ = ["BF16_EPS", "GATHER_QMM_TOL", "HAS_CUDA", "finite", "npa", "rel", "rel_err"]

HAS_CUDA = bool(getattr(mx, "cuda", None)) and mx.cuda.is_available()

#: Old name of :func:`compare.rel_err`.
rel = rel_err
