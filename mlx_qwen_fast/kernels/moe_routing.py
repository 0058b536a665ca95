"""MoE routing on CUDA: softmax + top-k, grouping by expert, block map.

Replaces the chain of MLX ops of :func:`mlx_qwen_fast.ops.moe.route`,
:func:`~mlx_qwen_fast.ops.moe.group_by_expert` and
:func:`~mlx_qwen_fast.ops.moe.block_map` (softmax, argpartition, scatter-add,
cumsum, argsort, ...) by two kernels, with no host synchronisation and grids
that depend only on ``N`` (CUDA-graph friendly):

1. ``route``: one warp per token: fp32 softmax, k rounds of warp arg-max
   (ties to the lower expert id), renormalisation. The decode gate+up
   kernel routes with the same device code
   (:func:`mlx_qwen_fast.kernels.moe_decode_gemv.route_gate_up_swiglu`).
2. ``group``: two kernels over up to :data:`GROUP_MAX_CTAS` CTAs of 1024
   threads, each CTA taking a chunk of the assignments: ``count`` (the
   chunk's per-expert histogram) and ``scatter`` (column sums and scans of
   the chunk histograms, block map, then each chunk's assignments to their
   grouped slots); warp-aggregated shared atomics (one per distinct expert
   per warp).

Difference from the reference contract: ``order`` groups the assignments by
expert but is **not stable** within an expert (chunk by chunk, and within a
chunk shared-memory atomics decide the order among one expert's
assignments). ``counts``, ``offsets``,
``block_map`` and ``sorted_experts`` are exact; ``order`` is a permutation
whose restriction to each expert's rows is the same *set* as the reference's,
and ``inverse`` is its exact inverse. Consumers that need only the grouping
(the grouped GEMM, which writes results back by assignment id) are unaffected.
The k slots of a token are in decreasing probability (the reference's
``argpartition`` leaves them unordered).

The shared expert of a Qwen3-Next/Qwen3.5 MoE block can take a (k+1)-th
slot of every token (``shared_logits``, or ``shared_column`` when the router
and the shared expert's gate ran as one matmul): expert id E, weight
sigmoid(gate logit), grouped over :func:`shared_group_experts` experts, so
that the grouped GEMM runs it as one more group (``Routing.shared_id``).

Source: ``mlx_qwen_fast/cuda/moe_routing.cu``. Several CTAs rather than one
block for the grouping: bench/results/package-figures.md, "MoE routing kernels".
"""

from __future__ import annotations

import numbers
from typing import Dict, Optional, Tuple

import mlx.core as mx

from ..moe_types import ExpertGroups, Routing, max_tiles
from . import _cuda_build as cb

__all__ = ["Routing", "route", "group", "route_and_group", "supports", "plan", "shared_group_experts",
           "shared_slot_fits", "SHARED_COLUMN_PAD"]

_LOGIT = (mx.float32, mx.bfloat16, mx.float16)
_INTS = (mx.int32, mx.uint32)
_kernels: Dict[tuple, cb.CudaKernel] = {}

#: Most CTAs of the grouping kernels; each takes a chunk of a multiple of
#: 1024 assignments (1024 up to 128K assignments, i.e. 16K tokens at k = 8).
GROUP_MAX_CTAS = 128

#: Largest N, N*k and ``tile_rows`` (grids in threads, assignment indices,
#: chunk ends and block-map entries are 32-bit ints in MLX and the kernels).
MAX_TOKENS = 2**24
MAX_ASSIGNMENTS = 2**28
MAX_TILE_ROWS = 2**16


#: Extra logit columns of ``route(..., shared_column=True)``: the router's E,
#: then the shared expert's gate and zeros up to a multiple of 32 (the
#: kernel's MOE_SHARED 2 rows are E + 32 wide).
SHARED_COLUMN_PAD = 32


def shared_group_experts(num_experts: int) -> int:
    """Experts the grouping counts when every token also takes the shared
    expert as id ``num_experts``: the next multiple of 32 above
    ``num_experts`` (the grouping kernels' expert count is a multiple of 32)."""
    return 32 * (num_experts // 32 + 1)


def shared_slot_fits(num_experts: int, top_k: int) -> bool:
    """True when the routing can give every token the shared expert's slot:
    ``top_k + 1 <= 32`` (one warp holds a token's slots) and
    :func:`shared_group_experts` ``(num_experts) <= 1024`` (the grouping's
    limit), i.e. E <= 992 for E a multiple of 32."""
    return _is_int(num_experts) and _is_int(top_k) and top_k < 32 and shared_group_experts(num_experts) <= 1024


def plan(num_tokens: int, top_k: int, num_experts: int, tile_rows: int) -> dict:
    """Launch plan (pure Python, no GPU): grids in threads, as MLX counts them.

    Returns a dict with ``num_assignments`` (N*k), ``max_tiles``
    (``ceil(N*k / tile_rows) + E``), ``route_grid`` / ``route_block``,
    ``group_chunk`` (assignments per CTA of the grouping kernels, a multiple
    of 1024) and ``group_grid`` / ``group_block`` (3-tuples; the same for
    both grouping kernels).

    Raises:
        ValueError: a count that is not an int, a negative count,
            ``tile_rows`` outside ``[1, MAX_TILE_ROWS]``, ``top_k < 1``,
            ``num_tokens > MAX_TOKENS`` or ``num_tokens * top_k >
            MAX_ASSIGNMENTS``.
    """
    args = dict(num_tokens=num_tokens, top_k=top_k, num_experts=num_experts, tile_rows=tile_rows)
    bad = [f"{k}={v!r}" for k, v in args.items() if not _is_int(v)]
    if bad:
        raise ValueError(f"plan: counts must be ints, got {', '.join(bad)}")
    num_tokens, top_k, num_experts, tile_rows = (int(v) for v in args.values())
    if num_tokens < 0 or top_k < 1 or num_experts < 1 or not 1 <= tile_rows <= MAX_TILE_ROWS:
        raise ValueError(
            f"plan: need num_tokens >= 0, top_k >= 1, num_experts >= 1, 1 <= tile_rows <= {MAX_TILE_ROWS}, "
            f"got {num_tokens}, {top_k}, {num_experts}, {tile_rows}"
        )
    nk = num_tokens * top_k
    if num_tokens > MAX_TOKENS or nk > MAX_ASSIGNMENTS:
        raise ValueError(
            f"plan: {num_tokens} tokens x top_k {top_k} is more than the kernels index "
            f"({MAX_TOKENS} tokens, {MAX_ASSIGNMENTS} assignments); route fewer tokens per call"
        )
    chunk = 1024 * max(1, -(-nk // (1024 * GROUP_MAX_CTAS)))
    ctas = max(1, -(-nk // chunk))
    return dict(
        num_assignments=nk,
        max_tiles=max_tiles(nk, num_experts, tile_rows),
        route_grid=(max(1, -(-num_tokens // 8)) * 256, 1, 1),
        route_block=(256, 1, 1),
        group_chunk=chunk,
        group_grid=(ctas * 1024, 1, 1),
        group_block=(1024, 1, 1),
    )


def supports(logits: mx.array, top_k: int) -> bool:
    """True for ``logits [N, E]`` float32/bfloat16/float16 with E a multiple of
    32, ``E <= 1024`` and ``1 <= top_k <= min(32, E)``, on MLX's CUDA backend
    (the shared expert's slot needs :func:`shared_slot_fits` too). Never
    compiles."""
    if not cb.cuda_available():
        return False
    return _shape_ok(logits, top_k)


def _is_int(v) -> bool:
    """A Python or numpy integer (not a bool)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _shape_ok(logits, top_k, pad: int = 0) -> bool:
    if not isinstance(logits, mx.array) or logits.ndim < 1 or logits.dtype not in _LOGIT:
        return False
    if not _is_int(top_k):
        return False
    e = logits.shape[-1] - pad
    return e % 32 == 0 and 32 <= e <= 1024 and 1 <= top_k <= min(32, e)


def _kernel(stage: int, **defs) -> cb.CudaKernel:
    key = (stage,) + tuple(sorted(defs.items()))
    k = _kernels.get(key)
    if k is None:
        name = {1: "mqf_moe_route", 2: "mqf_moe_count", 3: "mqf_moe_scatter"}[stage]
        k = cb.CudaKernel("moe_routing.cu", name, dict(MOE_STAGE=stage, **defs))
        _kernels[key] = k
    return k


def route(logits: mx.array, top_k: int, *, normalize: bool = True,
          shared_logits: Optional[mx.array] = None, shared_column: bool = False) -> Tuple[mx.array, mx.array]:
    """Top-k experts per token (the contract of :func:`ops.moe.route`).

    Args:
        logits: ``[N, E]`` (or ``[..., E]``: every leading index is a token)
            float32/bfloat16/float16 router outputs; E a multiple of 32, at
            most 1024.
        top_k: experts per token, ``1 <= top_k <= min(32, E)``.
        normalize: divide the k probabilities by their sum.
        shared_logits: None, or the shared expert's gate logits ``[..., 1]``
            (``shared_expert_gate(x)``) in ``logits``' dtype: one more slot
            per token (``top_k < 32``), expert id ``E`` with weight
            ``sigmoid(logit)`` in fp32 (Qwen3-Next/Qwen3.5 MoE: the shared
            expert's output is scaled by that gate and added).
        shared_column: the same slot, its logit read from ``logits`` itself:
            rows of ``E + 32`` columns, ``[0, E)`` the router's, column ``E``
            the shared expert's gate, the rest unused (the router and the
            gate run as one matmul padded to a multiple of 32 outputs:
            ``ops.moe``). Not with ``shared_logits``.

    Returns:
        ``(inds [N, k] int32, scores [N, k] float32)`` (``[..., k]`` for
        ``[..., E]`` logits: no reshape node), slots in decreasing
        probability (ties: lower expert id first); with ``shared_logits`` or
        ``shared_column`` ``[..., k + 1]``, the shared slot last.

    Raises:
        ValueError: bad ``logits`` shape/dtype or ``top_k`` (names them), bad
            ``shared_logits``, a shared slot where :func:`shared_slot_fits`
            is False (``top_k >= 32`` or ``E > 992``), or more than
            ``MAX_TOKENS`` tokens.
    """
    pad = SHARED_COLUMN_PAD if shared_column else 0
    if not _shape_ok(logits, top_k, pad):
        if _shape_ok(logits, 1, pad):  # the logits are fine: top_k is not
            e = logits.shape[-1] - pad
            raise ValueError(f"route: top_k must be an int in [1, min(32, E={e})], got top_k={top_k!r}")
        got = (f"{logits.dtype} {tuple(logits.shape)}" if isinstance(logits, mx.array)
               else type(logits).__name__)
        raise ValueError(
            f"route: logits must be an mx.array [..., E{f' + {pad}' if pad else ''}] float32/bfloat16/float16 "
            f"with E a multiple of 32 (<= 1024), got logits {got}"
        )
    if shared_column and shared_logits is not None:
        raise ValueError("route: give the shared expert's logits either as shared_logits or in logits "
                         "(shared_column=True), not both")
    top_k = int(top_k)
    e = logits.shape[-1] - pad
    n = logits.size // logits.shape[-1]  # tokens (rows of E + pad logits)
    lead = tuple(logits.shape[:-1])
    if shared_logits is not None and (
            not isinstance(shared_logits, mx.array) or shared_logits.dtype != logits.dtype
            or tuple(shared_logits.shape) != (*lead, 1)):
        got = (f"{shared_logits.dtype} {tuple(shared_logits.shape)}" if isinstance(shared_logits, mx.array)
               else type(shared_logits).__name__)
        raise ValueError(f"route: shared_logits must be an mx.array {(*lead, 1)} in logits' dtype "
                         f"{logits.dtype}, got {got}")
    mode = 2 if shared_column else int(shared_logits is not None)
    if mode and not shared_slot_fits(e, top_k):
        raise ValueError(f"route: the shared expert's slot needs top_k < 32 and E <= 992 "
                         f"(shared_slot_fits), got top_k={top_k}, E={e}")
    slots = top_k + int(mode > 0)
    if n == 0:
        return mx.zeros((*lead, slots), mx.int32), mx.zeros((*lead, slots), mx.float32)
    p = plan(n, slots, e, 1)
    kern = _kernel(1, MOE_E=e, MOE_K=top_k, MOE_LT=cb.dtype_macro(logits.dtype),
                   **({"MOE_SHARED": mode} if mode else {}))
    inds, scores = kern(
        inputs=[logits, shared_logits] if mode == 1 else [logits],
        output_shapes=[(*lead, slots), (*lead, slots)],
        output_dtypes=[mx.int32, mx.float32],
        grid=p["route_grid"],
        threadgroup=p["route_block"],
        scalars=[n, int(bool(normalize))],
    )
    return inds, scores


def group(inds: mx.array, num_experts: int, tile_rows: int) -> Tuple[ExpertGroups, mx.array]:
    """Group assignments by expert and list the grouped GEMM's work items.

    Args:
        inds: ``[N, k]`` int32/uint32 expert ids in ``[0, num_experts)``.
        num_experts: ``E``, a multiple of 32, at most 1024.
        tile_rows: rows per work item, ``>= 1``.

    Returns:
        ``(groups, block_map)``: :class:`ExpertGroups` (int32; ``order`` not
        stable within an expert, see the module docstring) and
        ``block_map [ceil(N*k / tile_rows) + E, 2]`` int32 as
        :func:`ops.moe.block_map`.

    Raises:
        ValueError: ``inds`` not a 2-D int32/uint32 array, ``num_experts`` not
            an int multiple of 32 in [32, 1024], ``tile_rows`` not an int in
            ``[1, MAX_TILE_ROWS]``, ``k`` not in ``[1, E]``, ``N >
            MAX_TOKENS`` or ``N*k > MAX_ASSIGNMENTS``; an id out of range
            (the values found are named). The ids are checked against
            ``[0, num_experts)`` first (two values read back to the host:
            one synchronisation), because the kernels index shared and
            global memory by them; :func:`_group` is the unchecked entry
            point for ids :func:`route` produced (:func:`route_and_group`).
    """
    return _group(inds, num_experts, tile_rows, check_range=True)


def _group(inds: mx.array, num_experts: int, tile_rows: int, *,
           check_range: bool = False) -> Tuple[ExpertGroups, mx.array]:
    """:func:`group`, the ids checked only with ``check_range``."""
    if not isinstance(inds, mx.array) or inds.ndim != 2 or inds.dtype not in _INTS:
        got = f"{inds.dtype} {tuple(inds.shape)}" if isinstance(inds, mx.array) else type(inds).__name__
        raise ValueError(f"group: inds must be an int32/uint32 mx.array of shape [N, k], got {got}")
    if not _is_int(num_experts) or num_experts % 32 != 0 or not 32 <= num_experts <= 1024:
        raise ValueError(f"group: num_experts must be an int multiple of 32 in [32, 1024], got {num_experts!r}")
    if not _is_int(tile_rows) or not 1 <= tile_rows <= MAX_TILE_ROWS:
        raise ValueError(f"group: tile_rows must be an int in [1, {MAX_TILE_ROWS}], got {tile_rows!r}")
    num_experts, tile_rows = int(num_experts), int(tile_rows)
    n, k = inds.shape
    if not 1 <= k <= num_experts:
        raise ValueError(f"group: inds [N, k] needs 1 <= k <= num_experts={num_experts}, got k={k}")
    p = plan(n, k, num_experts, tile_rows)
    nk, mt = p["num_assignments"], p["max_tiles"]
    if nk == 0:
        z = mx.zeros((0,), mx.int32)
        groups = ExpertGroups(
            mx.zeros((num_experts,), mx.int32), mx.zeros((num_experts + 1,), mx.int32), z, z, z, k
        )
        return groups, mx.full((mt, 2), -1, mx.int32)
    if check_range:
        lo, hi = mx.min(inds).item(), mx.max(inds).item()
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"group: inds must lie in [0, num_experts={num_experts}), "
                             f"got values in [{lo}, {hi}]")
    flat = inds.reshape(-1).astype(mx.int32)
    chunk, grid, block = p["group_chunk"], p["group_grid"], p["group_block"]
    (part,) = _kernel(2, MOE_E=num_experts)(
        inputs=[flat],
        output_shapes=[(grid[0] // block[0], num_experts)],
        output_dtypes=[mx.int32],
        grid=grid,
        threadgroup=block,
        scalars=[nk, chunk],
    )
    counts, offsets, order, sorted_experts, inverse, bmap = _kernel(3, MOE_E=num_experts)(
        inputs=[flat, part],
        output_shapes=[(num_experts,), (num_experts + 1,), (nk,), (nk,), (nk,), (mt, 2)],
        output_dtypes=[mx.int32] * 6,
        grid=grid,
        threadgroup=block,
        scalars=[nk, chunk, tile_rows, mt],
    )
    return ExpertGroups(counts, offsets, order, sorted_experts, inverse, k), bmap


def route_and_group(
    logits: mx.array, top_k: int, tile_rows: int, *, normalize: bool = True,
    shared_logits: Optional[mx.array] = None, shared_column: bool = False,
) -> Routing:
    """:func:`route` then :func:`group` (three launches). Args/errors as those.

    With ``shared_logits`` or ``shared_column`` every token gets ``top_k + 1``
    slots, the last the shared expert as expert ``E`` (``Routing.shared_id``),
    grouped over :func:`shared_group_experts` ``(E)`` experts: the grouped
    GEMM then runs the shared expert as one more group of the same launches
    (``moe_grouped_gemm.moe_experts`` with ``shared_expert``)."""
    if not _is_int(tile_rows) or not 1 <= tile_rows <= MAX_TILE_ROWS:  # before any launch
        raise ValueError(f"route_and_group: tile_rows must be an int in [1, {MAX_TILE_ROWS}], got {tile_rows!r}")
    inds, scores = route(logits, top_k, normalize=normalize, shared_logits=shared_logits,
                         shared_column=shared_column)
    shared = shared_logits is not None or shared_column
    e = logits.shape[-1] - (SHARED_COLUMN_PAD if shared_column else 0)
    groups, bmap = _group(inds, shared_group_experts(e) if shared else e, tile_rows)
    return Routing(inds, scores, groups, bmap, tile_rows, e if shared else None)
