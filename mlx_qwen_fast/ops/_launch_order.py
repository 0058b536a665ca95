"""Order a decode call's grid-barrier launches after the previous call's.

The one-launch decode kernels (``kernels.gdn_mixer_decode``,
``kernels.moe_block_decode``) need their whole grid resident. MLX runs a
launch after the launches that wrote its inputs and no others (its CUDA
graphs have an edge only from a buffer's writer to its readers). Within one
decode call every layer reads the one before it; across calls only the
caches link layer L to layer L, so the early layers of call t + 1 may run
beside the late layers of call t when the two calls do not depend on each
other otherwise -- teacher-forced tokens evaluated together (mlx-lm's own
loops sample each token from the previous call's logits, which orders
everything). Launches at once keep apart on their own barrier slots (the
kernels' launch contract); ordering the calls keeps two grids of every SM
from having to share the GPU at all.

The whole-stack steps (``ops.model_plan.decode_model``,
``ops.verify.verify_model``) therefore take the previous call's output as
one more input and, while their layers are traced, offer it here
(:func:`first_launch_after`); the first grid-barrier launch of the trace
takes it (:func:`take`) as its ``after`` input, which the kernel never reads.
Nested ``mx.compile``d functions are traced inline within the outer trace,
so the offer reaches the layers' compiled steps.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional

import mlx.core as mx

_offered: List[Optional[mx.array]] = []


@contextlib.contextmanager
def first_launch_after(dep: mx.array) -> Iterator[None]:
    """Within: the first :func:`take` returns ``dep`` (any array), later ones
    None. Nestable (the innermost offer is taken); the offer ends with the
    block whether or not a launch took it."""
    _offered.append(dep)
    try:
        yield
    finally:
        _offered.pop()


def take() -> Optional[mx.array]:
    """The array a grid-barrier launch should take as its ``after`` input
    (then no longer offered), or None outside :func:`first_launch_after` or
    once taken."""
    if not _offered:
        return None
    dep, _offered[-1] = _offered[-1], None
    return dep
