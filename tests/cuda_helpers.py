"""Whether MLX's CUDA backend is here, for the suite's run rules (conftest.py)
and the few CPU tests whose expectation depends on it.

CUDA tests are marked ``@pytest.mark.cuda`` (or ``pytestmark``) and nothing
else: conftest.py skips them without a GPU. The comparison of kernel
results lives in ``compare.py``.
"""

import mlx.core as mx

__all__ = ["HAS_CUDA"]

HAS_CUDA = bool(getattr(mx, "cuda", None)) and mx.cuda.is_available()
