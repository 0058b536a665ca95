"""Which MLX backend the current default device runs on.

Every op module asks :func:`current` to choose its implementation, so one place
decides between the CUDA kernels, Metal (where mlx-lm's own kernels stay in
place) and the plain-MLX reference ops (CPU, and GPUs without a kernel).
"""

import mlx.core as mx

CPU = "cpu"
CUDA = "cuda"
METAL = "metal"


def current() -> str:
    """Backend of ``mx.default_device()``: ``"cpu"``, ``"cuda"`` or ``"metal"``."""
    if mx.default_device() == mx.cpu:
        return CPU
    if mx.metal.is_available():
        return METAL
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return CUDA
    return CPU


BACKENDS = (CPU, CUDA, METAL)


def resolve(name=None) -> str:
    """``name`` checked against :data:`BACKENDS`, or :func:`current` when None.

    Raises:
        ValueError: ``name`` is not "cpu", "cuda" or "metal".
    """
    if name is None:
        return current()
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    return name
