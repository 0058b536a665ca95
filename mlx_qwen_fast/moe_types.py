"""Plain types shared by the MoE op family (:mod:`mlx_qwen_fast.ops.moe`) and
its kernels (:mod:`mlx_qwen_fast.kernels`): the grouping of assignments by
expert, and everything a grouped GEMM reads. A leaf module: it imports only MLX.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import mlx.core as mx

__all__ = ["ExpertGroups", "Routing", "max_tiles"]


class ExpertGroups(NamedTuple):
    """Assignments of ``N`` tokens to their ``k`` experts, grouped by expert.

    Assignment ``a = n * k + j`` is slot ``j`` of token ``n`` (row-major
    ``inds [N, k]``). All arrays are int32 and live on the device; a kernel
    that fills this contract must produce the same values.

    Fields:
        counts: ``[E]`` assignments per expert (histogram); sums to ``N*k``.
        offsets: ``[E+1]`` exclusive prefix sum of ``counts``;
            ``offsets[0] = 0``, ``offsets[E] = N*k``. Expert ``e`` owns grouped
            rows ``[offsets[e], offsets[e+1])``.
        order: ``[N*k]`` grouped row ``r`` holds assignment ``order[r]``.
            Experts are non-decreasing along it and assignments of one expert
            keep their original (increasing) order: the stable sort of
            ``inds.flatten()``. The token of row ``r`` is ``order[r] // k``.
        sorted_experts: ``[N*k]`` expert of grouped row ``r``
            (``inds.flatten()[order]``).
        inverse: ``[N*k]`` grouped row of assignment ``a``
            (``order[inverse[a]] == a``).
        top_k: ``k`` (a Python int, from the shape of ``inds``).
    """

    counts: mx.array
    offsets: mx.array
    order: mx.array
    sorted_experts: mx.array
    inverse: mx.array
    top_k: int

    @property
    def num_experts(self) -> int:
        return self.counts.shape[0]

    @property
    def num_assignments(self) -> int:
        return self.order.shape[0]


class Routing(NamedTuple):
    """Everything the grouped GEMM needs, all on the device.

    Fields: ``inds [N, k]`` int32, ``scores [N, k]`` float32 (k the slots
    per token), ``groups`` (:class:`ExpertGroups`,
    int32 arrays, ``order`` not stable within an expert), ``block_map
    [max_tiles, 2]`` int32, ``tile_rows`` (Python int), ``shared_id``: None,
    or the expert id that the last slot of every token carries for the
    shared expert (:func:`mlx_qwen_fast.kernels.moe_routing.route_and_group` with ``shared_logits`` or
    ``shared_column``: the routed expert count E, the slots then top_k + 1;
    ``groups`` counts :func:`mlx_qwen_fast.kernels.moe_routing.shared_group_experts` experts, the ids above E
    empty).
    """

    inds: mx.array
    scores: mx.array
    groups: ExpertGroups
    block_map: mx.array
    tile_rows: int
    shared_id: Optional[int] = None


def max_tiles(num_assignments: int, num_experts: int, tile_rows: int) -> int:
    """Worst-case number of row tiles of a grouped GEMM: ``ceil(N*k / tile_rows) + E``."""
    return -(-num_assignments // tile_rows) + num_experts
