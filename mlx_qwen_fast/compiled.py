"""Decode steps traced once with ``mx.compile``, every array passed in.

A decode step of the model is a few hundred small graph nodes per token; on
MLX's CUDA backend the Python that builds them (module dispatch, shape checks,
kernel wrappers) costs as much as the GPU work (bench/results/package-figures.md,
"Host time per decode token"). A layer whose decode step is one
``mx.compile``d function pays that Python once per input signature; each
later call replays the traced graph from C++.

Rules the fast layers follow here:

* Every array the step reads is an *input* of the compiled function (weights
  included), never a closure capture: one trace serves every layer of a model
  with the same shapes, and a weight replaced later (``model.update``,
  ``load_weights``) is read as it is at call time.
* The checks that decide whether a layer can take the fast step run once per
  layer and input signature; :class:`StepPlans` keeps their outcome on the
  layer, keyed by that signature and checked against the identity of the
  layer's current arrays, so a replaced weight is re-checked.

Linear layers are passed as :func:`linear_arrays` tuples and applied with
:func:`apply_linear`, which computes exactly what ``nn.Linear`` /
``nn.QuantizedLinear.__call__`` compute.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Dict, Hashable, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

__all__ = ["StepPlans", "apply_linear", "concat_linears", "gather", "linear_arrays", "linear_paths"]

#: (arrays, static) of one linear layer; static is hashable (part of a trace key).
LinearArrays = Tuple[Tuple[mx.array, ...], Tuple]


def linear_arrays(module) -> Optional[LinearArrays]:
    """The arrays and static settings of an ``nn.Linear`` or ``nn.QuantizedLinear``.

    Returns:
        ``(arrays, static)``: ``arrays`` = (weight[, scales[, biases]][, bias])
        as the module holds them; ``static`` = ("dense", has_bias) or
        ("quantized", group_size, bits, mode, has_biases, has_bias). None for
        any other module (the caller keeps the module's own call).
    """
    if isinstance(module, nn.QuantizedLinear):
        static = ("quantized", module.group_size, module.bits, module.mode,
                  "biases" in module, "bias" in module)
    elif type(module) is nn.Linear:
        static = ("dense", "bias" in module)
    else:
        return None
    return tuple(module[n] for n in _linear_names(static)), static


def concat_linears(linears: Sequence[LinearArrays]) -> Optional[LinearArrays]:
    """One linear layer computing several that read the same input: their
    outputs concatenated along the last axis.

    ``apply_linear(x, *concat_linears([a, b]))`` equals
    ``concatenate([apply_linear(x, *a), apply_linear(x, *b)], -1)``: weights
    (packed 4-bit rows included: quantisation groups run along the input
    axis), scales, biases and bias are stacked along the output axis, so
    every output row is computed from the same numbers. The arrays are new
    (evaluated here, the sources are left as they are).

    Args:
        linears: :func:`linear_arrays` tuples of layers with the same static
            settings (quantisation, bias) and the same input size.

    Returns:
        ``(arrays, static)``, or None when the settings or input sizes differ.
    """
    if not linears:
        return None
    static = linears[0][1]
    if any(lin[1] != static for lin in linears):
        return None
    shapes = [tuple(a.shape[1:]) for a in linears[0][0]]
    for lin in linears:
        if [tuple(a.shape[1:]) for a in lin[0]] != shapes or any(
            a.dtype != b.dtype for a, b in zip(lin[0], linears[0][0])
        ):
            return None
    arrays = tuple(mx.concatenate([lin[0][i] for lin in linears], axis=0) for i in range(len(shapes)))
    mx.eval(arrays)
    return arrays, static


def _linear_names(static: Tuple) -> Tuple[str, ...]:
    """Parameter names of a linear layer, in :func:`linear_arrays` order."""
    if static[0] == "dense":
        return ("weight", "bias") if static[1] else ("weight",)
    return ("weight", "scales") + (("biases",) if static[4] else ()) + (("bias",) if static[5] else ())


def apply_linear(x: mx.array, arrays: Sequence[mx.array], static: Tuple) -> mx.array:
    """``module(x)`` for the module :func:`linear_arrays` described (same ops)."""
    if static[0] == "dense":
        if static[1]:
            return mx.addmm(arrays[1], x, arrays[0].T)
        return x @ arrays[0].T
    _, group_size, bits, mode, has_biases, has_bias = static
    if 0 in x.shape[:-1]:  # no rows: MLX's quantized_matmul divides by zero on them (SIGFPE)
        dtypes = (x, arrays[1], arrays[-1]) if has_bias else (x, arrays[1])
        return mx.zeros(x.shape[:-1] + (arrays[0].shape[0],), mx.result_type(*dtypes))
    biases = arrays[2] if has_biases else None
    y = mx.quantized_matmul(x, arrays[0], scales=arrays[1], biases=biases, transpose=True,
                            group_size=group_size, bits=bits, mode=mode)
    if has_bias:
        y = y + arrays[-1]
    return y


Path = Tuple[str, ...]
_ATTR = "_mqf_step_plans"  # the module attribute holding its StepPlans
_TRACING = "during function transformations"  # MLX's error for an eval inside compile / vmap


def gather(module, paths: Sequence[Path]) -> Tuple[Any, ...]:
    """The objects at ``paths`` under ``module`` (plain dict lookups: modules
    are dicts of their parameters and children). Raises KeyError, TypeError."""
    out = []
    for path in paths:
        obj = module
        for key in path:
            obj = dict.__getitem__(obj, key)
        out.append(obj)
    return tuple(out)


def _links(module, paths: Sequence[Path]) -> Tuple[tuple, tuple, tuple]:
    """The distinct (parent, key, child) links of ``paths`` under ``module``,
    as three tuples: a path's objects are the same as when these were taken
    exactly when every link still holds (``parent[key] is child``), a check
    that costs one dict lookup per link and no Python loop."""
    seen: Dict[Tuple[int, str], None] = {}
    parents, names, children = [], [], []
    for path in paths:
        obj = module
        for key in path:
            child = dict.__getitem__(obj, key)
            if (id(obj), key) not in seen:
                seen[(id(obj), key)] = None
                parents.append(obj)
                names.append(key)
                children.append(child)
            obj = child
    return tuple(parents), tuple(names), tuple(children)


def linear_paths(prefix: Path, arrays_static: LinearArrays) -> Tuple[Path, ...]:
    """Paths (under the parent) of the arrays :func:`linear_arrays` returned
    for the child at ``prefix``, in the same order."""
    return tuple(prefix + (n,) for n in _linear_names(arrays_static[1]))


class StepPlans:
    """Per-layer cache of a fast step's plan, keyed by the input signature.

    ``get(key, module, make)``: ``make()`` returns ``(paths, plan)``, the
    paths (under ``module``) of every object the plan depends on -- the arrays
    the step reads, or, for a plan that declines (None), the child modules
    that decided it. A later call with the same ``key`` reuses the plan when
    every link of those paths (each container's entry, down to the arrays)
    is the same object as when it was made -- one C-level pass of dict
    lookups over the distinct links, about a microsecond per layer; a
    replaced weight, child module or container (or a missing one) makes it
    call ``make()`` again.

    Returns ``(objects at paths, plan)``; ``((), None)`` (declined, not
    cached) when ``make()`` would have to evaluate arrays inside an
    ``mx.compile`` / ``vmap`` trace.

    Held as a plain attribute of the layer (not a parameter), so it lives and
    dies with the layer and never appears in ``parameters()``. The objects of
    the last plan stay referenced (compared by identity on the next call).
    """

    __slots__ = ("_plans",)

    def __init__(self):
        # key -> (objects at the paths, plan, parents, names, children of their links)
        self._plans: Dict[Hashable, Tuple[Tuple, Any, tuple, tuple, tuple]] = {}

    def __deepcopy__(self, memo):
        return StepPlans()  # a cache: a copied module plans again (its keys hold MLX dtypes, not copyable)

    def __reduce__(self):
        return (StepPlans, ())

    @staticmethod
    def drop(module) -> None:
        """Forget the module's cached plans (and the arrays they hold)."""
        module.__dict__.pop(_ATTR, None)

    def get(self, key: Hashable, module, make: Callable[[], Tuple[Sequence[Path], Any]]):
        hit = self._plans.get(key)
        if hit is not None:
            objs, plan, parents, names, children = hit
            try:  # every link of every path the same object as when planned: one C-level pass
                same = all(map(operator.is_, map(dict.__getitem__, parents, names), children))
            except (KeyError, TypeError):
                same = False
            if same:
                return objs, plan
        try:
            paths, plan = make()
        except ValueError as exc:
            if _TRACING not in str(exc):
                raise
            # inside mx.compile / vmap with the module's arrays as traced inputs
            # (mx.compile(fn, inputs=model.state)): a plan cannot evaluate its
            # arrays there, and one made of tracers would outlive the trace, so
            # the call declines (the stock path runs) and nothing is cached
            return (), None
        paths = tuple(tuple(p) for p in paths)
        objs = gather(module, paths)
        self._plans[key] = (objs, plan) + _links(module, paths)
        return objs, plan

    def links(self, key: Hashable) -> Tuple[tuple, tuple, tuple]:
        """The ``(parents, names, children)`` links the plan cached under
        ``key`` was made from (see :meth:`get`): a caller that keeps the plan
        elsewhere checks them the same way. Raises KeyError for a key that
        has no plan."""
        return self._plans[key][2:]

    @staticmethod
    def of(module) -> "StepPlans":
        """The module's cache (created on first use)."""
        plans = module.__dict__.get(_ATTR)
        if plans is None:
            plans = StepPlans()
            object.__setattr__(module, _ATTR, plans)
        return plans
