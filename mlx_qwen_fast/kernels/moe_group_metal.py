"""MoE prefill routing on Metal: grouping of the assignments by expert and the block map.

The contract of :func:`mlx_qwen_fast.kernels.moe_routing.group` (the CUDA
grouping kernels: :class:`~mlx_qwen_fast.moe_types.ExpertGroups` and the
block map of a grouped GEMM), with a stable ``order``: the values of
:func:`mlx_qwen_fast.ops.moe.group_by_expert` and
:func:`~mlx_qwen_fast.ops.moe.block_map` exactly (the CUDA kernels' order is
a permutation within each expert). Two launches over the same C chunks of
the ``N*k`` assignments, one threadgroup of ``32 * ceil(E / 32)`` threads
per chunk, thread ``e`` standing for expert ``e``:

1. ``count`` (``metal/moe_group_count.metal``): chunk c's histogram
   ``part [C, E]``; each thread counts its expert in the chunk's ids staged
   in threadgroup memory (no atomics);
2. ``scatter`` (``metal/moe_group_scatter.metal``): the column sums of
   ``part`` (totals, and the chunks before c), exclusive scans over the
   experts (SIMD prefix sums, then the SIMD groups' totals), counts,
   offsets, the block map, and chunk c's assignments to their grouped rows,
   each thread walking the staged ids in order (hence stable).

The histogram / scan / scatter split of the CUDA grouping
(``cuda/moe_routing.cu``, stages 2 and 3) with one thread per expert
instead of shared-memory atomics, so that the order is stable and the same
on every run. :func:`route_and_group_metal` puts the Metal routing kernel
(:func:`mlx_qwen_fast.kernels.moe_route_metal.route_metal`: softmax, top-k)
in front: the :class:`~mlx_qwen_fast.moe_types.Routing` the Metal grouped
GEMMs (:mod:`~mlx_qwen_fast.kernels.moe_grouped_gemm_metal`) read.

Verified only by running MLX's generated source on the CPU
(``tests/metal_check.py``) against the plain-MLX reference; never run on an
Apple GPU, never timed.
"""

from __future__ import annotations

import numbers
from pathlib import Path
from typing import Dict, Tuple

import mlx.core as mx

from ..moe_types import ExpertGroups, Routing, max_tiles
from ._checks import describe as _describe
from . import moe_route_metal as _route_metal

__all__ = ["group_metal", "stage_kernel", "route_and_group_metal", "chunks", "SOURCE_FILES", "MAX_EXPERTS", "MAX_CHUNKS",
           "MIN_CHUNK", "MAX_ASSIGNMENTS", "MAX_TILE_ROWS"]

_METAL = Path(__file__).resolve().parents[1] / "metal"
#: The two kernels' sources (stage -> file).
SOURCE_FILES = {"count": _METAL / "moe_group_count.metal", "scatter": _METAL / "moe_group_scatter.metal"}
MAX_EXPERTS = 1024  # one thread per expert, one threadgroup of at most 1024 threads
#: Most chunks (threadgroups): the scatter's threads each add one column of
#: ``part`` ([C, E]), C values.
MAX_CHUNKS = 64
#: Fewest assignments per chunk (below it, fewer threadgroups).
MIN_CHUNK = 256
#: Largest N*k and tile_rows (int32 indices and block-map entries in the kernels).
MAX_ASSIGNMENTS = 2**28
MAX_TILE_ROWS = 2**16
_INDS = (mx.int32, mx.uint32)
_KERNELS: Dict[str, object] = {}  # built on first use: only a call needs Metal

_OUTPUTS = {"count": ["part"], "scatter": ["counts", "offsets", "order", "sorted_experts", "inverse", "block_map"]}
_INPUTS = {"count": ["inds"], "scatter": ["inds", "part"]}


def _kernel(stage: str):
    return stage_kernel(_KERNELS, "mqf_moe_group", stage, _INPUTS, _OUTPUTS, SOURCE_FILES)


def stage_kernel(cache: dict, prefix: str, stage: str, inputs: dict, outputs: dict, sources: dict):
    """The ``mx.fast.metal_kernel`` of one stage of a multi-kernel op,
    named ``<prefix>_<stage>``, built on first use and kept in ``cache``
    (the calling module's, so that reloading that module rebuilds it)."""
    k = cache.get(stage)
    if k is None:
        k = cache[stage] = mx.fast.metal_kernel(
            name=f"{prefix}_{stage}",
            input_names=inputs[stage],
            output_names=outputs[stage],
            source=sources[stage].read_text(),
        )
    return k


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def chunks(num_assignments: int) -> int:
    """Chunks (threadgroups of both kernels) for ``num_assignments`` (N*k):
    one per :data:`MIN_CHUNK` assignments, at least 1, at most
    :data:`MAX_CHUNKS`.

    Raises:
        ValueError: ``num_assignments`` not an int >= 0.
    """
    if not _is_int(num_assignments) or num_assignments < 0:
        raise ValueError(f"chunks: num_assignments must be an int >= 0, got {num_assignments!r}")
    return max(1, min(MAX_CHUNKS, -(-int(num_assignments) // MIN_CHUNK)))


def group_metal(inds: mx.array, num_experts: int, tile_rows: int) -> Tuple[ExpertGroups, mx.array]:
    """Group the assignments by expert and list a grouped GEMM's work items, on Metal.

    Args:
        inds: ``[N, k]`` int32/uint32 expert ids in ``[0, num_experts)``
            (checked first: two values read back to the host, one
            synchronisation; :func:`_group_metal` is the unchecked entry for
            ids the routing kernel produced).
        num_experts: ``E``, an int in ``[1, 1024]``.
        tile_rows: rows per work item, an int in ``[1, 65536]``.

    Returns:
        ``(groups, block_map)``: :class:`~mlx_qwen_fast.moe_types.ExpertGroups`
        (int32, ``order`` stable: the values of
        :func:`mlx_qwen_fast.ops.moe.group_by_expert`) and ``block_map
        [ceil(N*k / tile_rows) + E, 2]`` int32 (those of
        :func:`~mlx_qwen_fast.ops.moe.block_map`). No tokens: empty groups
        and an all ``-1`` map, without a launch.

    Raises:
        ValueError: an argument of the wrong type, shape or range (named),
            ``N*k > MAX_ASSIGNMENTS``, ``k > num_experts``, an id out of range
            (the values found are named).
        RuntimeError: MLX has no Metal back-end here (raised by MLX).
    """
    return _group_metal(inds, num_experts, tile_rows, check_range=True)


def _group_metal(inds: mx.array, num_experts: int, tile_rows: int, *,
                 check_range: bool = False) -> Tuple[ExpertGroups, mx.array]:
    """:func:`group_metal`, the ids checked only with ``check_range``."""
    fn = "group_metal"
    if not isinstance(inds, mx.array) or inds.ndim != 2 or inds.dtype not in _INDS:
        raise ValueError(f"{fn}: inds must be an int32/uint32 mx.array of shape [N, k], got {_describe(inds)}")
    if not _is_int(num_experts) or not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"{fn}: num_experts must be an int in [1, {MAX_EXPERTS}], got {num_experts!r}")
    if not _is_int(tile_rows) or not 1 <= tile_rows <= MAX_TILE_ROWS:
        raise ValueError(f"{fn}: tile_rows must be an int in [1, {MAX_TILE_ROWS}], got {tile_rows!r}")
    e, tile = int(num_experts), int(tile_rows)
    n, k = inds.shape
    if not 1 <= k <= e:
        raise ValueError(f"{fn}: inds [N, k] needs 1 <= k <= num_experts={e}, got k={k}")
    nk = n * k
    if nk > MAX_ASSIGNMENTS:
        raise ValueError(f"{fn}: N*k = {nk} assignments is more than the kernels index ({MAX_ASSIGNMENTS}); "
                         "route fewer tokens per call")
    mt = max_tiles(nk, e, tile)
    if nk == 0:
        z = mx.zeros((0,), mx.int32)
        groups = ExpertGroups(mx.zeros((e,), mx.int32), mx.zeros((e + 1,), mx.int32), z, z, z, k)
        return groups, mx.full((mt, 2), -1, mx.int32)
    if check_range:
        lo, hi = mx.min(inds).item(), mx.max(inds).item()
        if lo < 0 or hi >= e:
            raise ValueError(f"{fn}: inds must lie in [0, num_experts={e}), got values in [{lo}, {hi}]")
    c = chunks(nk)
    tpg = 32 * -(-e // 32)
    launch = dict(grid=(c * tpg, 1, 1), threadgroup=(tpg, 1, 1))
    (part,) = _kernel("count")(inputs=[inds], template=[("E", e)], output_shapes=[(c, e)],
                               output_dtypes=[mx.int32], **launch)
    counts, offsets, order, sorted_experts, inverse, bmap = _kernel("scatter")(
        inputs=[inds, part],
        template=[("E", e), ("BM", tile)],
        output_shapes=[(e,), (e + 1,), (nk,), (nk,), (nk,), (mt, 2)],
        output_dtypes=[mx.int32] * 6,
        **launch,
    )
    return ExpertGroups(counts, offsets, order, sorted_experts, inverse, k), bmap


def route_and_group_metal(logits: mx.array, top_k: int, tile_rows: int, *, normalize: bool = True) -> Routing:
    """:func:`~mlx_qwen_fast.kernels.moe_route_metal.route_metal` then
    :func:`group_metal` (three launches): the
    :class:`~mlx_qwen_fast.moe_types.Routing` of ``[N, E]`` logits.

    Args:
        logits: ``[N, E]`` float32/float16/bfloat16 router outputs, E a
            multiple of 32 in ``[32, 1024]`` (the routing kernel's).
        top_k: experts per token, an int in ``[1, min(32, E)]``.
        tile_rows: rows per work item of the grouped GEMMs, an int in
            ``[1, 65536]``.
        normalize: divide the k probabilities by their sum.

    Returns:
        ``Routing(inds [N, k] int32, scores [N, k] float32, groups,
        block_map, tile_rows)``; the slots of a token in decreasing
        probability (ties: the lower id).

    Raises:
        ValueError: as :func:`~mlx_qwen_fast.kernels.moe_route_metal.route_metal`
            and :func:`group_metal` (``tile_rows`` checked before any launch);
            ``logits`` not 2-D.
        RuntimeError: MLX has no Metal back-end here (raised by MLX).
    """
    fn = "route_and_group_metal"
    if not _is_int(tile_rows) or not 1 <= tile_rows <= MAX_TILE_ROWS:
        raise ValueError(f"{fn}: tile_rows must be an int in [1, {MAX_TILE_ROWS}], got {tile_rows!r}")
    if not isinstance(logits, mx.array) or logits.ndim != 2:
        raise ValueError(f"{fn}: logits must be an mx.array [N, E], got {_describe(logits)}")
    inds, scores = _route_metal.route_metal(logits, top_k, normalize=normalize)
    groups, bmap = _group_metal(inds, logits.shape[-1], int(tile_rows))
    return Routing(inds, scores, groups, bmap, int(tile_rows))
