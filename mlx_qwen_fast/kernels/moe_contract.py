"""The argument contracts the CUDA and the Metal MoE kernels share.

Backend-neutral: no kernel, no backend check. The predicates and
:func:`decode_weights_problem` read only types, shapes and dtypes (never an
error: False, 0 or a message); :func:`check_expert_ids` and
:func:`check_routing_values` read array values (one host synchronisation
each), :func:`check_routing_arrays` only shapes and dtypes.

The weight format: MLX affine quantisation, 4 bits, group 64
(:func:`is_4bit_group64`): ``weight [..., O, K/8]`` uint32, ``scales`` and
``biases [..., O, K/64]``.

Decode, 1 to :data:`DECODE_MAX_TOKENS` tokens (CUDA:
:mod:`~mlx_qwen_fast.kernels.moe_decode_gemv`; Metal:
:mod:`~mlx_qwen_fast.kernels.moe_gate_up_metal`,
:mod:`~mlx_qwen_fast.kernels.moe_down_metal`): the routed and shared
experts' arrays (:func:`decode_weights_problem`), the shared-expert gate
(:func:`shared_gate_bits`), the expert ids (:func:`check_expert_ids`).

Prefill, the grouped GEMMs (CUDA:
:mod:`~mlx_qwen_fast.kernels.moe_grouped_gemm`; Metal:
:mod:`~mlx_qwen_fast.kernels.moe_grouped_gemm_metal`): a
:class:`~mlx_qwen_fast.moe_types.Routing`'s arrays
(:func:`check_routing_arrays`) and values (:func:`check_routing_values`).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import mlx.core as mx

from ..moe_types import Routing
from ._checks import describe

__all__ = [
    "DECODE_MAX_TOKENS",
    "check_down_weights",
    "check_expert_ids",
    "check_routing_arrays",
    "check_routing_values",
    "decode_weights_problem",
    "is_4bit_group64",
    "shared_gate_bits",
]

#: Tokens per call of the decode kernels at most, CUDA and Metal (the Metal
#: kernels keep a float4 of partial sums per row).
DECODE_MAX_TOKENS = 4


def is_4bit_group64(q, lead: Tuple[int, ...], O: int, K: int, scale_dtypes: Tuple = (mx.bfloat16,)) -> bool:
    """Whether ``q = (weight, scales, biases)`` holds ``lead + (O, K)``
    weights in 4-bit group-64 affine quantisation: ``weight`` uint32 of
    shape ``lead + (O, K // 8)``, ``scales`` and ``biases`` of shape ``lead
    + (O, K // 64)`` with dtypes in ``scale_dtypes`` (default bfloat16, the
    CUDA kernels'). ``lead`` is ``(E,)`` for the routed experts, ``()`` for
    one expert (a ``QuantizedLinear``'s arrays).

    Returns False, never raises, for anything else (not a triple, not
    arrays, other shapes or dtypes)."""
    try:
        w, s, b = q
        return (
            w.dtype == mx.uint32 and s.dtype in scale_dtypes and b.dtype in scale_dtypes
            and tuple(w.shape) == (*lead, O, K // 8)
            and tuple(s.shape) == (*lead, O, K // 64) and tuple(b.shape) == tuple(s.shape)
        )
    except (TypeError, ValueError, AttributeError):
        return False


def shared_gate_bits(expert_gate, D: int) -> int:
    """The bit width of the shared-expert gate ``D -> 1``, 0 where the
    decode kernels cannot read it.

    ``expert_gate = (weight, scales, biases, bits)``: bits 4 or 8 with
    ``weight`` uint32 ``[1, D * bits / 32]`` and bfloat16 ``scales``,
    ``biases [1, D / 64]`` (group 64); or bits 16 with a bfloat16 ``weight
    [1, D]`` (a plain ``Linear``; scales and biases are not read, but
    must be arrays: the kernels take them as inputs).

    Returns 4, 8 or 16; 0, never raises, for anything else."""
    try:
        w, s, b, bits = expert_gate
        if not all(isinstance(a, mx.array) for a in (w, s, b)) or isinstance(bits, bool):
            return 0
        if bits == 16:
            return 16 if (w.dtype == mx.bfloat16 and tuple(w.shape) == (1, D)) else 0
        if bits in (4, 8) and w.dtype == mx.uint32 and tuple(w.shape) == (1, D * bits // 32):
            ok = (s.dtype == mx.bfloat16 and b.dtype == mx.bfloat16
                  and tuple(s.shape) == (1, D // 64) and tuple(b.shape) == (1, D // 64))
            return bits if ok else 0
    except (TypeError, ValueError, AttributeError):
        pass
    return 0


def decode_weights_problem(experts: Sequence, shared: Sequence, expert_gate: Sequence, D: int) -> Optional[str]:
    """None when the decode kernels can read the weights of a MoE block of
    hidden size ``D``, else what is wrong (one line, the argument named).

    ``experts = (gate, up, down)`` of the routed experts, each ``(weight,
    scales, biases)``: gate/up ``uint32 [E, I, D/8]``, ``bf16 [E, I,
    D/64]``; down ``uint32 [E, D, I/8]``, ``bf16 [E, D, I/64]``. ``shared``:
    the shared expert's ``(gate, up, down)``, one expert of the same sizes
    (``[I, D/8]`` ...). ``expert_gate``: as :func:`shared_gate_bits`.

    The kernels' own limits on D and I (multiples of 256 and 128 on CUDA,
    of 64 on Metal) are the callers' to check. Pure: reads shapes and
    dtypes only."""
    try:
        gate, up, down = experts
        E, I = gate[0].shape[0], gate[0].shape[1]
        if E < 1 or I < 1:
            return f"experts must hold at least one expert of width I >= 1, got E={E}, I={I}"
    except (TypeError, ValueError, AttributeError, IndexError, KeyError):
        return "experts must be (gate, up, down), each (weight, scales, biases)"
    if not (is_4bit_group64(gate, (E,), I, D) and is_4bit_group64(up, (E,), I, D)):
        return f"experts gate/up must be 4-bit group-64 (uint32 [E, {I}, {D // 8}], bf16 [E, {I}, {D // 64}] x2)"
    if not is_4bit_group64(down, (E,), D, I):
        return f"experts down must be 4-bit group-64 (uint32 [E, {D}, {I // 8}], bf16 [E, {D}, {I // 64}] x2)"
    try:
        sg, su, sd = shared
    except (TypeError, ValueError):
        return "shared must be (gate, up, down), each (weight, scales, biases)"
    if not (is_4bit_group64(sg, (), I, D) and is_4bit_group64(su, (), I, D) and is_4bit_group64(sd, (), D, I)):
        return (f"shared expert must be 4-bit group-64 with the experts' sizes "
                f"(gate/up uint32 [{I}, {D // 8}], down uint32 [{D}, {I // 8}], bf16 scales/biases)")
    if not shared_gate_bits(expert_gate, D):
        return ("expert_gate must be (weight, scales, biases, bits): bits 4/8 group 64 uint32 "
                f"[1, D*bits/32], or bits 16 with bf16 weight [1, {D}]")
    return None


def check_down_weights(fn: str, down, I: int, scale_dtypes: Tuple = (mx.bfloat16,)) -> Tuple[int, int]:
    """``(E, D)`` of the experts' down projection ``down = (weight uint32
    [E, D, I/8], scales, biases [E, D, I/64])``, 4-bit group-64 with scales
    and biases in ``scale_dtypes`` (:func:`is_4bit_group64`) and D a
    positive multiple of 64; else ValueError (``fn: `` first, naming
    ``down``). Shapes and dtypes only."""
    try:
        E, D = down[0].shape[0], down[0].shape[1]
    except (TypeError, IndexError, AttributeError, KeyError):
        raise ValueError(f"{fn}: down must be (weight, scales, biases) of shapes [E, D, I/8], [E, D, I/64] x2") \
            from None
    if D == 0 or D % 64 or not is_4bit_group64(down, (E,), D, I, scale_dtypes):
        kinds = "bf16" if tuple(scale_dtypes) == (mx.bfloat16,) else "float"
        raise ValueError(f"{fn}: down must be 4-bit group-64 uint32 [E, D, {I // 8}] with D a positive multiple "
                         f"of 64, {kinds} scales/biases [E, D, {I // 64}], got {[describe(a) for a in down]}")
    return E, D


def check_expert_ids(fn: str, inds: mx.array, num_experts: int) -> None:
    """Raise ValueError (``fn: `` first, naming ``inds``) unless every id of
    ``inds`` (an int32/uint32 mx.array of any shape, e.g. ``[N, k]``) lies
    in ``[0, num_experts)``: the kernels index the experts' weights by it.

    One host synchronisation (the ids' min and max); nothing for an empty
    ``inds``. The compiled decode steps, whose ids come from the routing
    kernel, skip it."""
    if inds.size:
        lo, hi = mx.min(inds).item(), mx.max(inds).item()
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"{fn}: inds must lie in [0, E={num_experts}), got values in [{lo}, {hi}]")


def check_routing_arrays(fn: str, routing: Routing, nk: int, tiles: Tuple[int, ...]) -> None:
    """Raise ValueError (``fn: `` first, the field named) unless the
    routing's arrays have the shapes and dtypes of a grouping of ``nk``
    assignments over E experts (E = ``routing.groups.counts.shape[0]``):
    ``tile_rows`` one of ``tiles`` (the kernels' tile sizes),
    ``groups.order`` int32 ``[nk]``, ``block_map`` int32
    ``[ceil(nk / tile_rows) + E, 2]``, ``groups.offsets`` int32 ``[E + 1]``.
    Reads shapes only (``routing`` must be a
    :class:`~mlx_qwen_fast.moe_types.Routing`); the values are
    :func:`check_routing_values`'."""
    if routing.tile_rows not in tiles:
        raise ValueError(f"{fn}: routing.tile_rows must be one of {tiles}, got {routing.tile_rows}")
    g = routing.groups
    if g.order.shape != (nk,) or g.order.dtype != mx.int32:
        raise ValueError(f"{fn}: routing.groups.order must be int32 [{nk}], got {g.order.dtype} {tuple(g.order.shape)}")
    e = g.counts.shape[0]
    mt = -(-nk // routing.tile_rows) + e
    if routing.block_map.shape != (mt, 2) or routing.block_map.dtype != mx.int32:
        raise ValueError(
            f"{fn}: routing.block_map must be int32 [{mt}, 2] (ceil(N*k/tile_rows) + E), "
            f"got {routing.block_map.dtype} {tuple(routing.block_map.shape)}"
        )
    if g.offsets.shape != (e + 1,) or g.offsets.dtype != mx.int32:
        raise ValueError(f"{fn}: routing.groups.offsets must be int32 [{e + 1}], got {tuple(g.offsets.shape)}")


def check_routing_values(fn: str, routing: Routing, nk: int) -> None:
    """Raise ValueError (``fn: `` first, naming ``routing``) unless the
    routing's index arrays are a grouping the kernels can follow without
    leaving their arrays: ``offsets`` runs from 0 to ``nk`` without
    decreasing, every ``order`` entry is in ``[0, nk)``, and every used
    block-map item ``(e, t)`` names an expert of the routing and a tile that
    starts inside that expert's rows (unused items are ``(-1, -1)``).

    Run after :func:`check_routing_arrays` (the shapes it reads). One host
    synchronisation; the routing kernels' own output always passes, so the
    package's hot path does not call this."""
    g = routing.groups
    e = g.counts.shape[0]
    ex, tile = routing.block_map[:, 0], routing.block_map[:, 1]
    used = ex >= 0
    offs = g.offsets
    ok = (offs[0] == 0) & (offs[-1] == nk) & mx.all(offs[1:] >= offs[:-1])
    ok = ok & mx.all(mx.where(used, (ex < e) & (tile >= 0), (ex == -1) & (tile == -1)))
    first = mx.clip(ex, 0, e - 1)
    # in int64: the kernels compute the tile's first row in int32, so a tile
    # index whose product overflows must be refused, not wrapped
    start = offs[first].astype(mx.int64) + tile.astype(mx.int64) * routing.tile_rows
    ok = ok & mx.all(mx.where(used, (start >= offs[first]) & (start < offs[first + 1]), True))
    if nk:
        ok = ok & (mx.min(g.order) >= 0) & (mx.max(g.order) < nk)
    if not ok.item():
        raise ValueError(f"{fn}: routing is not a grouping of {nk} assignments over {e} experts "
                         "(offsets, block_map or order out of range); build it with "
                         "moe_routing.route_and_group")
