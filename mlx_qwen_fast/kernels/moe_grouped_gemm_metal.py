"""Grouped expert GEMMs of the prefill MoE with fused 4-bit dequantisation, on Metal.

The contract of :mod:`mlx_qwen_fast.kernels.moe_grouped_gemm` (the CUDA
prefill kernels), two launches on the grouped (by-expert) order of the
assignments, work items from the block map of a
:class:`~mlx_qwen_fast.moe_types.Routing`
(:func:`mlx_qwen_fast.kernels.moe_group_metal.route_and_group_metal`):

- :func:`gate_up_swiglu_metal` (``metal/moe_gemm_gate_up.metal``): each
  item's rows of ``x`` (token ``order[r] // k``) times the gate and up
  weights, ``T(silu(T(g)) * T(u))`` in grouped order (``T`` = x's dtype:
  the roundings of mlx-lm's ``SwitchGLU``; none for float32);
- :func:`down_weighted_metal` (``metal/moe_gemm_down.metal``): the down
  projection of those rows, rounded to ``T``, times the assignment's routing
  weight, in fp32, written in *assignment* order ``[N*k, D]``, so the
  combine (:func:`moe_experts_metal`) is ``y.reshape(N, k, D).sum(1)``:
  a fixed order, no atomics.

Weights: MLX affine quantisation (``mx.quantize``), 4 bits, group 64:
``weight [E, O, K/8]`` uint32 (eight values per word, the lowest nibble the
lowest input), ``scales`` and ``biases [E, O, K/64]`` float32, float16 or
bfloat16; dequantised tile by tile in threadgroup memory as ``s * q + b`` in
fp32 (never rounded: the Metal decode kernels' numerics), fp32
accumulation. Activations float32, float16 or bfloat16.

Tiles: a threadgroup of 128 threads (4 SIMD groups, 2 x 2) computes one work
item -- :data:`TILE_CHOICES` rows (``routing.tile_rows``) of one expert --
times :data:`BN` = 32 output features; each SIMD group a (rows / 2) x 16
block as fp32 8x8 ``simdgroup_matrix`` accumulators; K steps of 32 inputs
(gate+up, two matrices) or 64 (down), the dequantised weight tiles and the
activation rows staged in threadgroup memory as fp32 (at most 23 KB). A
SIMD group whose rows all lie past its expert's last row skips its
multiplies (ragged tiles); unused block-map items return at once (empty
experts have none). D and I must be multiples of 64 (the quantisation group,
the K steps and the 32 output features); anything else is refused with a
ValueError. The tile layout is that of MLX's own quantised matmul
(``affine_qmm_t``: 32 x 32 output tiles over 2 x 2 SIMD groups, weights
dequantised into threadgroup memory), on grouped rows.

Verified only by running MLX's generated source on the CPU
(``tests/metal_check.py``) against the fp32 host reference and the
plain-MLX reference (:func:`mlx_qwen_fast.ops.moe.expert_swiglu`,
:func:`~mlx_qwen_fast.ops.moe.combine`); never run on an Apple GPU, never
timed.
"""

from __future__ import annotations

import numbers
from pathlib import Path
from typing import Dict, Optional, Sequence

import mlx.core as mx

from ..moe_types import Routing
from ._checks import describe as _describe
from .moe_contract import check_down_weights, check_routing_arrays, check_routing_values, is_4bit_group64
from .moe_group_metal import stage_kernel

__all__ = ["gate_up_swiglu_metal", "down_weighted_metal", "moe_experts_metal", "moe_experts_metal_unchecked", "problem", "choose_tile_rows",
           "SOURCE_FILES", "TILE_CHOICES", "BN", "THREADS"]

_METAL = Path(__file__).resolve().parents[1] / "metal"
#: The two kernels' sources (stage -> file).
SOURCE_FILES = {"gate_up": _METAL / "moe_gemm_gate_up.metal", "down": _METAL / "moe_gemm_down.metal"}
#: Rows per work item the kernels take (``Routing.tile_rows``): two SIMD
#: groups of 8 or 16 rows each.
TILE_CHOICES = (16, 32)
BN = 32  # output features per threadgroup
THREADS = 128  # 4 SIMD groups
_FLOATS = (mx.float32, mx.float16, mx.bfloat16)
_KERNELS: Dict[str, object] = {}  # built on first use: only a call needs Metal

_INPUTS = {"gate_up": ["x", "wg", "sg", "bg", "wu", "su", "bu", "order", "offsets", "block_map"],
           "down": ["h", "wd", "sd", "bd", "order", "offsets", "block_map", "scores"]}
_OUTPUTS = {"gate_up": ["h"], "down": ["y"]}


def _kernel(stage: str):
    return stage_kernel(_KERNELS, "mqf_moe_gemm", stage, _INPUTS, _OUTPUTS, SOURCE_FILES)


def choose_tile_rows(num_assignments: int, num_experts: int) -> int:
    """Rows per work item (one of :data:`TILE_CHOICES`): 16 while experts
    average fewer than 32 rows (``num_assignments < 32 * num_experts``: a
    32-row tile would be mostly padding, which costs the dequantisation of
    a whole weight tile), else 32. A rule from the padding alone: the
    kernels have never been timed.

    Raises:
        ValueError: ``num_assignments`` not an int >= 0, ``num_experts`` not
            an int >= 1.
    """
    ok = all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in (num_assignments, num_experts))
    if not ok or num_assignments < 0 or num_experts < 1:
        raise ValueError(f"choose_tile_rows: need ints num_assignments >= 0 and num_experts >= 1, "
                         f"got {num_assignments!r}, {num_experts!r}")
    return 16 if num_assignments < 32 * num_experts else 32


def _q(q, lead, O, K) -> bool:
    """4-bit group-64 arrays of ``lead + (O, K)``, float scales/biases."""
    return is_4bit_group64(q, lead, O, K, scale_dtypes=_FLOATS)


def problem(x, experts) -> Optional[str]:
    """None when ``x`` and ``experts`` fit the kernels, else what is wrong
    (one line, the argument named). Pure: reads shapes and dtypes only.

    ``x [N, D]`` float32/float16/bfloat16; ``experts = (gate, up, down)``,
    each ``(weight, scales, biases)``: gate/up ``uint32 [E, I, D/8]`` and
    ``[E, I, D/64]``, down ``uint32 [E, D, I/8]`` and ``[E, D, I/64]``,
    scales and biases float32/float16/bfloat16; D and I positive multiples
    of 64."""
    try:
        gate, up, down = experts
    except (TypeError, ValueError):
        return "experts must be (gate, up, down), each (weight, scales, biases)"
    p = _gate_up_problem(x, gate, up)
    if p is not None:
        return p
    (E, I), D = gate[0].shape[:2], x.shape[1]
    if not _q(down, (E,), D, I):
        return (f"experts down must be 4-bit group-64 (uint32 [{E}, {D}, {I // 8}], "
                f"float scales/biases [{E}, {D}, {I // 64}])")
    return None


def _gate_up_problem(x, gate, up) -> Optional[str]:
    """:func:`problem` of the gate+up kernel's arguments."""
    if not isinstance(x, mx.array) or x.ndim != 2 or x.dtype not in _FLOATS:
        return f"x must be float32/float16/bfloat16 [N, D], got {_describe(x)}"
    D = x.shape[1]
    if D == 0 or D % 64:
        return f"x [N, D]: D must be a positive multiple of 64 (the quantisation group and K step), got D={D}"
    try:
        E, I = gate[0].shape[0], gate[0].shape[1]
    except (TypeError, AttributeError, IndexError):
        return "experts must be (gate, up, down), each (weight, scales, biases)"
    if I == 0 or I % 64:
        return f"experts: the expert width I must be a positive multiple of 64, got I={I}"
    if not (_q(gate, (E,), I, D) and _q(up, (E,), I, D)):
        return (f"experts gate/up must be 4-bit group-64 (uint32 [E, {I}, {D // 8}], "
                f"float scales/biases [E, {I}, {D // 64}])")
    return None


def _check_routing(fn: str, routing, nk: int, num_experts: int, check: bool) -> None:
    """The routing's arrays for ``nk`` assignments over the weights'
    ``num_experts``, no shared slot; with ``check`` its values too (one
    host synchronisation)."""
    if not isinstance(routing, Routing):
        raise ValueError(f"{fn}: routing must be a Routing (moe_group_metal.route_and_group_metal), "
                         f"got {type(routing).__name__}")
    check_routing_arrays(fn, routing, nk, TILE_CHOICES)
    if routing.groups.counts.shape[0] != num_experts or routing.shared_id is not None:
        raise ValueError(f"{fn}: routing has {routing.groups.counts.shape[0]} experts (shared_id "
                         f"{routing.shared_id}), the weights {num_experts} (no shared slot)")
    if check:
        check_routing_values(fn, routing, nk)


def gate_up_swiglu_metal(x: mx.array, routing: Routing, gate: Sequence, up: Sequence) -> mx.array:
    """``T(silu(T(x W_gate^T)) * T(x W_up^T))`` per assignment, grouped order, on Metal.

    Args:
        x: ``[N, D]`` float32/float16/bfloat16 tokens, D a multiple of 64.
        routing: a :class:`~mlx_qwen_fast.moe_types.Routing` of these N
            tokens (``tile_rows`` in :data:`TILE_CHOICES`; ``k`` =
            ``routing.groups.top_k``), e.g. from
            :func:`mlx_qwen_fast.kernels.moe_group_metal.route_and_group_metal`;
            its index arrays are checked (one host synchronisation).
        gate, up: ``(weight uint32 [E, I, D/8], scales [E, I, D/64],
            biases [E, I, D/64])``, float scales/biases, I a multiple of 64.

    Returns:
        ``[N*k, I]`` in x's dtype; row ``r`` belongs to assignment
        ``routing.groups.order[r]``.

    Raises:
        ValueError: a shape, dtype or routing the kernel does not take (the
            argument named).
        RuntimeError: MLX has no Metal back-end here (raised by MLX).
    """
    return _gate_up(x, routing, gate, up, check=True)


def _gate_up(x, routing, gate, up, check: bool = False) -> mx.array:
    """:func:`gate_up_swiglu_metal`, the routing's values checked only with ``check``."""
    fn = "gate_up_swiglu_metal"
    p = _gate_up_problem(x, gate, up)
    if p is not None:
        raise ValueError(f"{fn}: {p}")
    n, d = x.shape
    e, i_dim = gate[0].shape[0], gate[0].shape[1]
    nk = n * routing.groups.top_k if isinstance(routing, Routing) else 0
    _check_routing(fn, routing, nk, e, check)
    if nk == 0:
        return mx.zeros((0, i_dim), x.dtype)
    mt = routing.block_map.shape[0]
    (h,) = _kernel("gate_up")(
        inputs=[x, *gate, *up, routing.groups.order, routing.groups.offsets, routing.block_map],
        template=[("T", x.dtype), ("BM", routing.tile_rows), ("K", routing.groups.top_k)],
        grid=(mt * THREADS, i_dim // BN, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(nk, i_dim)],
        output_dtypes=[x.dtype],
    )
    return h


def down_weighted_metal(h: mx.array, routing: Routing, down: Sequence) -> mx.array:
    """``scores[a] * T(h[r] W_down^T)`` written to row ``a = order[r]``, on Metal.

    Args:
        h: ``[N*k, I]`` float32/float16/bfloat16 in grouped order
            (:func:`gate_up_swiglu_metal`), I a multiple of 64.
        routing: the same routing (its values checked: one host
            synchronisation); ``routing.scores [N, k]`` float32.
        down: ``(weight uint32 [E, D, I/8], scales [E, D, I/64], biases)``,
            float scales/biases, D a multiple of 64.

    Returns:
        ``[N*k, D]`` float32, assignment order (``a = n*k + j``); each expert
        output rounded to h's dtype before the routing weight is applied (as
        ``SwitchGLU``).

    Raises:
        ValueError: a shape, dtype or routing the kernel does not take (the
            argument named).
        RuntimeError: MLX has no Metal back-end here (raised by MLX).
    """
    return _down(h, routing, down, check=True)


def _down(h, routing, down, check: bool = False) -> mx.array:
    """:func:`down_weighted_metal`, the routing's values checked only with ``check``."""
    fn = "down_weighted_metal"
    if not isinstance(h, mx.array) or h.ndim != 2 or h.dtype not in _FLOATS or h.shape[1] == 0 or h.shape[1] % 64:
        raise ValueError(f"{fn}: h must be float32/float16/bfloat16 [N*k, I] with I a positive multiple of 64, "
                         f"got {_describe(h)}")
    nk, i_dim = h.shape
    e, d = check_down_weights(fn, down, i_dim, _FLOATS)
    _check_routing(fn, routing, nk, e, check)
    scores = routing.scores.reshape(-1)
    if scores.shape != (nk,) or scores.dtype != mx.float32:
        raise ValueError(f"{fn}: routing.scores must be float32 with {nk} entries, "
                         f"got {_describe(routing.scores)}")
    if nk == 0:
        return mx.zeros((0, d), mx.float32)
    mt = routing.block_map.shape[0]
    (y,) = _kernel("down")(
        inputs=[h, *down, routing.groups.order, routing.groups.offsets, routing.block_map, scores],
        template=[("T", h.dtype), ("BM", routing.tile_rows)],
        grid=(mt * THREADS, d // BN, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(nk, d)],
        output_dtypes=[mx.float32],
    )
    return y


def moe_experts_metal(x: mx.array, routing: Routing, experts: Sequence,
                      out_dtype: Optional[mx.Dtype] = None) -> mx.array:
    """Routed-expert part of the sparse MoE block on Metal: ``[N, D]``.

    ``sum_j scores[n, j] * T(expert_{inds[n, j]}(x[n]))``: the two kernels,
    then the sum over each token's k assignments in fp32 (MLX's ``sum``),
    returned in ``out_dtype`` (default x's dtype). The plain-MLX reference:
    :func:`mlx_qwen_fast.ops.moe.expert_swiglu` then
    :func:`~mlx_qwen_fast.ops.moe.combine`.

    Args:
        x: as :func:`gate_up_swiglu_metal`.
        routing: as there (values checked once: one host synchronisation).
        experts: ``(gate, up, down)``, as the two kernels take them.
        out_dtype: an mlx float dtype, or None.

    Raises:
        ValueError: as :func:`gate_up_swiglu_metal` / :func:`down_weighted_metal`;
            ``out_dtype`` not a float dtype.
        RuntimeError: MLX has no Metal back-end here (raised by MLX).
    """
    if out_dtype is not None and out_dtype not in _FLOATS:
        raise ValueError(f"moe_experts_metal: out_dtype must be None or float32/float16/bfloat16, got {out_dtype!r}")
    p = problem(x, experts)
    if p is not None:
        raise ValueError(f"moe_experts_metal: {p}")
    return moe_experts_metal_unchecked(x, routing, experts, out_dtype, check=True)


def moe_experts_metal_unchecked(x, routing, experts, out_dtype=None, check: bool = False) -> mx.array:
    """:func:`moe_experts_metal` on arguments whose shapes the caller checked
    (:func:`problem`); the routing's values checked only with ``check``."""
    gate, up, down = experts
    h = _gate_up(x, routing, gate, up, check=check)
    y = _down(h, routing, down)
    n, d = x.shape
    return y.reshape(n, routing.groups.top_k, d).sum(axis=1).astype(out_dtype or x.dtype)
