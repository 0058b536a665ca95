"""Argument checks shared by the kernel wrappers, CUDA and Metal alike.

Each names the argument, what it must be and what was passed
(:func:`describe`), in one line. They read only types, shapes and Python
numbers, so they hold on every backend and run before any CUDA-only step;
the ``supports()`` functions use :func:`is_array` to answer False, never an
error. The op families' checks (:mod:`mlx_qwen_fast.ops._checks`) build on
them.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

__all__ = ["ArraySpec", "arrays_problem", "check_arrays", "check_eps", "describe", "is_array"]


def describe(value) -> str:
    """An argument as an error message names what was passed: ``bfloat16
    (2, 3)`` for an mx.array, else its type (``numpy.ndarray float32 (2,
    3)``, ``list``, ``None``)."""
    import mlx.core as mx

    if isinstance(value, mx.array):
        return f"{value.dtype} {tuple(value.shape)}"
    if value is None:
        return "None"
    kind = type(value)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    return f"{name} {dtype} {tuple(shape)}" if isinstance(shape, tuple) and dtype is not None else name


def is_array(value, *, optional: bool = False) -> bool:
    """Whether ``value`` is an mx.array (or None, where ``optional``): the
    ``supports()`` functions answer False, never an error, for anything else."""
    import mlx.core as mx

    return isinstance(value, mx.array) or (optional and value is None)


#: An array argument as :func:`arrays_problem` checks it: its name, what it
#: must be (shape and dtype, e.g. ``"[B, T, Hv] (float)"``), and whether None
#: stands for a default.
ArraySpec = Tuple[str, str, bool]


def arrays_problem(specs: Sequence[ArraySpec], *values) -> Optional[str]:
    """None when each of ``values`` is an mx.array (or None, where its spec
    allows), else one line naming the first that is not, what it must be and
    what was passed. ``specs`` run parallel to ``values``."""
    import mlx.core as mx

    for value, (name, expected, optional) in zip(values, specs):
        if not isinstance(value, mx.array) and not (optional and value is None):
            return (f"{name} must be an mx.array {expected}{' or None' if optional else ''}, "
                    f"got {describe(value)}")
    return None


def check_arrays(fn: Optional[str], specs: Sequence[ArraySpec], *values) -> None:
    """Raise ValueError (``fn: `` first where given) with
    :func:`arrays_problem`'s message. Run before any attribute of the
    arguments is read, and before any CUDA-only step, so it holds on every
    backend."""
    problem = arrays_problem(specs, *values)
    if problem is not None:
        raise ValueError(f"{fn}: {problem}" if fn else problem)


def check_eps(fn: str, name: str, value) -> float:
    """``value`` as a float if it is a finite number in ``(0, 1)`` (an
    epsilon added to a mean or sum of squares), else ValueError naming it."""
    import math
    import numbers

    if (not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value)
            or not 0 < value < 1):
        raise ValueError(f"{fn}: {name} must be a finite float in (0, 1), got {value!r}")
    return float(value)
