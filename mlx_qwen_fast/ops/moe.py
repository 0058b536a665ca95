"""Sparse mixture-of-experts block of Qwen3.5/3.6-MoE (``Qwen3NextSparseMoeBlock``).

Source: ``mlx_lm/models/qwen3_next.py`` (``Qwen3NextSparseMoeBlock.__call__``)
and ``mlx_lm/models/switch_layers.py`` (``SwitchGLU``, ``QuantizedSwitchLinear``),
mlx-lm 0.32.2. Shapes for Qwen3.6-35B-A3B: hidden D = 2048, E = 256 experts,
top-k = 8, expert SwiGLU D -> 512 -> D (affine 4-bit, group 64), router
D -> E and shared-expert gate D -> 1 (8-bit), one shared SwiGLU expert.

The block is split into the stages a grouped-GEMM kernel needs, each with a
contract (shapes, dtypes) and a reference in plain MLX ops:

1. :func:`route`: fp32 softmax over the router logits, top-k, renormalise.
2. :func:`group_by_expert`: histogram of the ``N*k`` assignments per expert,
   exclusive prefix scan to offsets, the stable permutation that groups
   assignments by expert, and its inverse (:class:`ExpertGroups`);
   :func:`block_map` lists the (expert, row tile) work items of a grouped GEMM
   in a fixed-size array.
3. :func:`expert_swiglu`: per-assignment expert outputs; :func:`combine`:
   weighted sum over the k experts of each token.
4. :func:`sparse_moe_block`: the whole block from those stages (reference);
   :func:`sparse_moe`: the dispatch entry the fast module calls.

Nothing here synchronises with the host or produces a shape that depends on
the data: every shape follows from ``N``, ``k``, ``E`` and the tile size, so
the graph can be recorded once (CUDA graphs, ``mx.compile``).

Until a kernel exists the dispatch runs the *stock* block's own math on every
backend: the reference adds sorting work (histogram, scan, inverse
permutation) that the stock ``SwitchGLU`` does not need, so it must not make a
patched model slower. The reference stays the contract that kernels are
tested against.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import mlx.core as mx
from mlx_lm.models.activations import swiglu
from mlx_lm.models.qwen3_next import Qwen3NextSparseMoeBlock
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from .. import backend as _backend
from ..compiled import StepPlans, apply_linear, concat_linears, linear_arrays, linear_paths
from ..kernels import _cuda_build

__all__ = [
    "ExpertGroups",
    "route",
    "group_by_expert",
    "block_map",
    "expert_swiglu",
    "combine",
    "shared_expert",
    "sparse_moe_block",
    "sparse_moe",
    "implementation_for",
    "IMPLEMENTATIONS",
]

_FLOATS = (mx.float32, mx.float16, mx.bfloat16)
_INTS = (mx.int8, mx.int16, mx.int32, mx.int64, mx.uint8, mx.uint16, mx.uint32, mx.uint64)


# ---------------------------------------------------------------------------
# 1. Routing
# ---------------------------------------------------------------------------


def route(
    logits: mx.array, top_k: int, *, normalize: bool = True
) -> Tuple[mx.array, mx.array]:
    """Top-k experts per token from router logits.

    Softmax over the experts in fp32 (``precise``), the ``top_k`` largest
    probabilities (``mx.argpartition``, as the stock block does: the order of
    the k slots within a token is unspecified), and, when ``normalize`` (the
    checkpoint's ``norm_topk_prob``), division by their sum.

    Selection uses the fp32 probabilities, as Hugging Face's Qwen3-Next does.
    The stock mlx-lm block rounds the probabilities to the logits' dtype
    first, so for bf16 logits it may pick a different expert where two
    probabilities tie in bf16; for fp32 logits both agree exactly.

    Args:
        logits: ``[..., E]`` float32 / float16 / bfloat16 router outputs.
        top_k: number of experts per token, ``1 <= top_k <= E``.
        normalize: renormalise the k probabilities to sum to 1.

    Returns:
        ``(inds, scores)``: ``inds [..., k]`` uint32 expert ids in ``[0, E)``,
        ``scores [..., k]`` float32 routing weights.

    Raises:
        ValueError: ``logits`` is 0-d or not floating point; ``top_k`` is
            not in ``[1, E]``.
    """
    if not isinstance(logits, mx.array) or logits.ndim < 1 or logits.dtype not in _FLOATS:
        raise ValueError(
            "route: logits must be a float32/float16/bfloat16 mx.array of shape "
            f"[..., E], got {type(logits).__name__} of shape {tuple(getattr(logits, 'shape', ()))} "
            f"dtype {getattr(logits, 'dtype', None)}"
        )
    num_experts = logits.shape[-1]
    if not isinstance(top_k, numbers.Integral) or isinstance(top_k, bool) or not 1 <= top_k <= num_experts:
        raise ValueError(
            f"route: top_k must be an int in [1, E={num_experts}], got top_k={top_k!r}"
        )
    probs = mx.softmax(logits.astype(mx.float32), axis=-1, precise=True)
    inds = mx.stop_gradient(mx.argpartition(probs, kth=-top_k, axis=-1)[..., -top_k:])
    scores = mx.take_along_axis(probs, inds, axis=-1)
    if normalize:
        scores = scores / scores.sum(axis=-1, keepdims=True)
    return inds, scores


# ---------------------------------------------------------------------------
# 2. Grouping assignments by expert
# ---------------------------------------------------------------------------


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


def group_by_expert(
    inds: mx.array, num_experts: int, *, check_range: bool = False
) -> ExpertGroups:
    """Group the ``N*k`` (token, expert) assignments by expert.

    Histogram by scatter-add, offsets by an exclusive prefix scan, and the
    grouping permutation by one argsort of the unique key
    ``expert * N*k + assignment`` (stable by construction, whatever the sort
    algorithm; int64 keys when ``E * N*k`` would overflow int32). Correct for
    empty experts and for every assignment going to one expert.

    Args:
        inds: ``[N, k]`` integer expert ids in ``[0, num_experts)`` (the
            ``inds`` of :func:`route`, int32 or uint32).
        num_experts: ``E``.
        check_range: also check that every id is in range. This reads a
            value back to the host (a synchronisation), so it is off by
            default and meant for tests and debugging; out-of-range ids are
            otherwise undefined behaviour (as in ``mx.gather_qmm``).

    Returns:
        :class:`ExpertGroups`.

    Raises:
        ValueError: ``inds`` is not a 2-D integer array; ``num_experts < 1``;
            ``k > num_experts``; with ``check_range``, an id outside
            ``[0, num_experts)``.
    """
    if inds.ndim != 2 or inds.dtype not in _INTS:
        raise ValueError(
            "group_by_expert: inds must be an integer array of shape [N, k], "
            f"got shape {tuple(inds.shape)} dtype {inds.dtype}"
        )
    if num_experts < 1:
        raise ValueError(f"group_by_expert: num_experts must be >= 1, got {num_experts}")
    n, k = inds.shape
    if k > num_experts:
        raise ValueError(
            f"group_by_expert: inds [N, k] has k={k} > num_experts={num_experts}"
        )
    if check_range and inds.size > 0:
        bad = mx.logical_or(inds < 0, inds >= num_experts).any().item()
        if bad:
            raise ValueError(
                f"group_by_expert: inds must lie in [0, num_experts={num_experts}), "
                f"got values in [{mx.min(inds).item()}, {mx.max(inds).item()}]"
            )

    nk = n * k
    flat = inds.reshape(-1).astype(mx.int32)
    counts = mx.zeros((num_experts,), mx.int32).at[flat].add(mx.ones_like(flat))
    offsets = mx.concatenate([mx.zeros((1,), mx.int32), mx.cumsum(counts)])

    key_dtype = mx.int32 if num_experts * max(nk, 1) < 2**31 else mx.int64
    arange = mx.arange(nk, dtype=mx.int32)
    key = flat.astype(key_dtype) * nk + arange.astype(key_dtype)
    order = mx.argsort(key).astype(mx.int32)
    sorted_experts = flat[order]
    inverse = mx.put_along_axis(mx.zeros((nk,), mx.int32), order, arange, axis=0)
    return ExpertGroups(counts, offsets, order, sorted_experts, inverse, k)


def max_tiles(num_assignments: int, num_experts: int, tile_rows: int) -> int:
    """Worst-case number of row tiles: ``ceil(N*k / tile_rows) + E``."""
    return -(-num_assignments // tile_rows) + num_experts


def block_map(groups: ExpertGroups, tile_rows: int) -> mx.array:
    """Work items of a grouped GEMM over fixed row tiles, in a fixed-size array.

    Expert ``e`` needs ``ceil(counts[e] / tile_rows)`` tiles. The tiles are
    listed expert by expert, tile index increasing; item ``i`` is
    ``(e, t)``: rows ``[offsets[e] + t*tile_rows,
    min(offsets[e] + (t+1)*tile_rows, offsets[e+1]))`` of the grouped order.
    Unused items are ``(-1, -1)``. The size is the worst case
    ``ceil(N*k / tile_rows) + E`` (:func:`max_tiles`), so a kernel can launch a
    fixed grid and return early on ``-1``.

    Args:
        groups: from :func:`group_by_expert`.
        tile_rows: rows per tile, ``1 <= tile_rows <= 2**16``.

    Returns:
        ``[max_tiles, 2]`` int32.

    Raises:
        ValueError: ``tile_rows`` not in ``[1, 2**16]`` (larger ones would
            overflow the int32 tile arithmetic).
    """
    if not 1 <= tile_rows <= 2**16:
        raise ValueError(f"block_map: tile_rows must be in [1, 65536], got {tile_rows}")
    num_experts = groups.num_experts
    size = max_tiles(groups.num_assignments, num_experts, tile_rows)
    tiles = (groups.counts + (tile_rows - 1)) // tile_rows
    tile_ends = mx.cumsum(tiles)
    tile_starts = tile_ends - tiles
    # expert of item i = number of experts whose tiles end at or before i
    ends_hist = mx.zeros((size + 1,), mx.int32).at[mx.minimum(tile_ends, size)].add(
        mx.ones_like(tile_ends)
    )
    expert = mx.cumsum(ends_hist[:size])
    item = mx.arange(size, dtype=mx.int32)
    valid = item < tile_ends[-1]
    tile = item - tile_starts[mx.minimum(expert, num_experts - 1)]
    out = mx.stack([expert, tile], axis=-1)
    return mx.where(valid[:, None], out, -1).astype(mx.int32)


# ---------------------------------------------------------------------------
# 3. Expert computation and combine
# ---------------------------------------------------------------------------


def _check_switch_linear(name: str, proj, in_dims: int):
    if isinstance(proj, QuantizedSwitchLinear):
        if proj.mode == "affine" or proj.mode is None:
            packed_in = proj.weight.shape[-1] * 32 // proj.bits
            if packed_in != proj.input_dims:
                raise ValueError(
                    f"expert_swiglu: {name}.weight [E, out, in*bits/32] has "
                    f"{packed_in} inputs but {name}.scales has "
                    f"{proj.input_dims} (group_size={proj.group_size})"
                )
        if in_dims % proj.group_size != 0:
            raise ValueError(
                f"expert_swiglu: {name} input size K={in_dims} must be a multiple "
                f"of the quantization group_size={proj.group_size}"
            )
    elif not isinstance(proj, SwitchLinear):
        raise ValueError(
            f"expert_swiglu: {name} must be a SwitchLinear or QuantizedSwitchLinear, "
            f"got {type(proj).__name__}"
        )
    if in_dims != proj.input_dims:
        raise ValueError(
            f"expert_swiglu: {name} expects inputs of size {proj.input_dims}, "
            f"got {in_dims}"
        )


def _switch_linear(proj, x: mx.array, experts: mx.array) -> mx.array:
    """``x [M, 1, K]`` rows sorted by ``experts [M]`` -> ``[M, 1, out]``."""
    if isinstance(proj, QuantizedSwitchLinear):
        y = mx.gather_qmm(
            x,
            proj["weight"],
            proj["scales"],
            proj.get("biases"),
            rhs_indices=experts,
            transpose=True,
            group_size=proj.group_size,
            bits=proj.bits,
            mode=proj.mode,
            global_scale=proj.global_scale,
            sorted_indices=True,
        )
    else:
        y = mx.gather_mm(
            x,
            proj["weight"].swapaxes(-1, -2),
            rhs_indices=experts,
            sorted_indices=True,
        )
    if "bias" in proj:
        y = y + mx.expand_dims(proj["bias"][experts], -2)
    return y


def expert_swiglu(
    x: mx.array,
    groups: ExpertGroups,
    gate_proj,
    up_proj,
    down_proj,
) -> mx.array:
    """Output of each assignment's expert: ``down(silu(gate(x)) * up(x))``.

    Rows of ``x`` are gathered into the grouped order, pushed through the
    three expert projections with ``mx.gather_qmm(..., sorted_indices=True)``
    (``mx.gather_mm`` for unquantized ``SwitchLinear``), and scattered back to
    assignment order. The projections are the ``SwitchGLU`` modules of the
    block (``switch_mlp.gate_proj`` etc.); only their arrays and quantization
    parameters are used. Same per-row math as ``SwitchGLU.__call__``.

    Args:
        x: ``[N, D]`` float activations (the quantization scales' dtype; fp32
            for unquantized weights on CPU, where ``gather_mm`` is fp32-only).
        groups: from :func:`group_by_expert` on ``inds [N, k]``.
        gate_proj, up_proj: ``QuantizedSwitchLinear`` / ``SwitchLinear``
            ``E x (D -> H)``.
        down_proj: same, ``E x (H -> D)``.

    Returns:
        ``[N, k, D]`` in ``x.dtype``: entry ``[n, j]`` is expert
        ``inds[n, j]`` applied to token ``n``.

    Raises:
        ValueError: ``x`` not a 2-D float array; ``N*k`` differs from the
            groups' size; a projection's input size differs from its input or
            is not a multiple of its quantization ``group_size``.
    """
    if x.ndim != 2 or x.dtype not in _FLOATS:
        raise ValueError(
            "expert_swiglu: x must be a float array of shape [N, D], got shape "
            f"{tuple(x.shape)} dtype {x.dtype}"
        )
    n, d = x.shape
    k = groups.top_k
    if n * k != groups.num_assignments:
        raise ValueError(
            f"expert_swiglu: x [N={n}, D] does not match groups of "
            f"{groups.num_assignments} assignments with k={k} (expected N*k)"
        )
    _check_switch_linear("gate_proj", gate_proj, d)
    _check_switch_linear("up_proj", up_proj, d)
    _check_switch_linear("down_proj", down_proj, gate_proj.output_dims)

    experts = groups.sorted_experts
    rows = mx.expand_dims(x[groups.order // k], -2)  # [N*k, 1, D]
    up = _switch_linear(up_proj, rows, experts)
    gate = _switch_linear(gate_proj, rows, experts)
    out = _switch_linear(down_proj, swiglu(gate, up), experts)  # [N*k, 1, D]
    return out[groups.inverse].reshape(n, k, -1)


def combine(
    expert_out: mx.array, scores: mx.array, *, dtype: Optional[mx.Dtype] = None
) -> mx.array:
    """Weighted sum over the k experts of each token.

    ``y[n] = sum_j scores[n, j] * expert_out[n, j]``, accumulated in the
    promoted dtype of the inputs (fp32 with fp32 scores).

    Args:
        expert_out: ``[..., k, D]`` float (from :func:`expert_swiglu`).
        scores: ``[..., k]`` float (from :func:`route`, float32).
        dtype: output dtype, default ``expert_out.dtype``.

    Returns:
        ``[..., D]``.

    Raises:
        ValueError: ``scores.shape != expert_out.shape[:-1]``.
    """
    if tuple(scores.shape) != tuple(expert_out.shape[:-1]):
        raise ValueError(
            f"combine: scores must have shape {tuple(expert_out.shape[:-1])} "
            f"(expert_out [..., k, D] without D), got {tuple(scores.shape)}"
        )
    y = (expert_out * scores[..., None]).sum(axis=-2)
    return y.astype(dtype or expert_out.dtype)


def shared_expert(block, x: mx.array) -> mx.array:
    """``sigmoid(shared_expert_gate(x)) * shared_expert(x)``: ``[..., D]``."""
    return mx.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)


# ---------------------------------------------------------------------------
# 4. The whole block and its dispatch
# ---------------------------------------------------------------------------


def _hidden_size(block) -> Optional[int]:
    """Input size of the block's experts; None where the module does not say
    (a wrapper such as mlx-lm's ``LoRASwitchLinear`` without the wrapped
    layer's ``input_dims``): the wrapped modules then check their input."""
    proj = block.switch_mlp.gate_proj
    for m in (proj, getattr(proj, "linear", None)):
        d = getattr(m, "input_dims", None)
        if isinstance(d, int):
            return d
    return None


def _check_block_input(fn: str, block, x: mx.array):
    d = _hidden_size(block)
    if x.ndim < 2 or x.dtype not in _FLOATS or (d is not None and x.shape[-1] != d):
        raise ValueError(
            f"{fn}: x must be a float32/float16/bfloat16 array of shape [..., {d}] "
            f"(at least one token axis, last axis = hidden size {d}), "
            f"got shape {tuple(x.shape)} dtype {x.dtype}"
        )


def sparse_moe_block(block, x: mx.array) -> mx.array:
    """Reference sparse MoE block from the stages of this module.

    Computes what ``Qwen3NextSparseMoeBlock.__call__`` computes: router
    (``block.gate``), :func:`route` with ``block.top_k`` and
    ``block.norm_topk_prob``, :func:`group_by_expert`, :func:`expert_swiglu`
    on ``block.switch_mlp``, :func:`combine`, plus :func:`shared_expert`,
    and the tensor-parallel reduction when the block is sharded.

    Numerics: equal to stock up to fp32 rounding for fp32 inputs. For bf16
    inputs the routing weights and the combine stay fp32 (stock rounds them to
    bf16) and expert selection uses fp32 probabilities (see :func:`route`).

    Args:
        block: a ``Qwen3NextSparseMoeBlock`` (mlx-lm), possibly quantized.
        x: ``[..., D]`` float, ``D`` = hidden size.

    Returns:
        ``[..., D]`` in the dtype the stock block returns for ``x``.

    Raises:
        ValueError: ``x`` has no token axis, is not floating point, or its last
            axis is not the hidden size.
    """
    _check_block_input("sparse_moe_block", block, x)
    group = getattr(block, "sharding_group", None)
    if group is not None:
        from mlx.nn.layers.distributed import sum_gradients

        x = sum_gradients(group)(x)

    lead, d = x.shape[:-1], x.shape[-1]
    inds, scores = route(block.gate(x), block.top_k, normalize=block.norm_topk_prob)
    tokens = x.reshape(-1, d)
    groups = group_by_expert(inds.reshape(tokens.shape[0], -1), block.num_experts)
    sm = block.switch_mlp
    y = expert_swiglu(tokens, groups, sm.gate_proj, sm.up_proj, sm.down_proj)
    y = combine(y, scores.reshape(tokens.shape[0], -1)).reshape(*lead, d)
    y = y + shared_expert(block, x)

    if group is not None:
        y = mx.distributed.all_sum(y, group=group)
    return y


def _stock(block, x: mx.array) -> mx.array:
    # The stock class's function, not ``block(x)``: the fast module that calls
    # :func:`sparse_moe` may itself be the block (a subclass or a wrapper).
    return Qwen3NextSparseMoeBlock.__call__(block, x)


_JOINT_ROUTER = ("joint-router",)  # StepPlans key of router_with_shared_gate


def router_with_shared_gate(block):
    """The router (``block.gate``, D -> E) and the shared expert's gate
    (``block.shared_expert_gate``, D -> 1) as one linear layer D -> E + 32:
    ``(arrays, static)`` for :func:`compiled.apply_linear`, whose output
    columns ``[0, E)`` are the router's logits, column E the gate's and the
    rest zeros (rows of zero weights, scales and biases: the width a
    multiple of 32, as the routing kernel's ``shared_column`` reads it).
    Every output column comes from the same numbers as the two layers'.

    Built once per block (``StepPlans``: rebuilt when either layer's arrays
    are replaced, e.g. by ``load_weights``; an array changed in place is not
    seen). None when the two are not plain (quantised) linear layers with
    the same settings, or E is not a multiple of 32: the caller runs them
    apart. Source of the saving: the gate's own 8-bit matmul took 38 us of
    GPU time per block call at 256 and 4,096 tokens on the H200
    (bench/results/moe-cuda-log.md, thirteenth session)."""
    def make():
        lins = [linear_arrays(block.gate), linear_arrays(block.shared_expert_gate)]
        if any(lin is None for lin in lins):
            return [("gate",), ("shared_expert_gate",)], None
        # the arrays themselves, also when declining: replacing one re-decides
        paths = linear_paths(("gate",), lins[0]) + linear_paths(("shared_expert_gate",), lins[1])
        (r_arr, r_static), (g_arr, _) = lins
        if r_arr[0].shape[0] % 32 or g_arr[0].shape[0] != 1:
            return paths, None
        from ..kernels.moe_routing import SHARED_COLUMN_PAD

        zeros = (tuple(mx.zeros((SHARED_COLUMN_PAD - 1,) + a.shape[1:], a.dtype) for a in g_arr), r_static)
        return paths, concat_linears([lins[0], lins[1], zeros])  # None: settings or sizes differ

    _, plan = StepPlans.of(block).get(_JOINT_ROUTER, block, make)
    return plan


def _cuda_kernel(block, x: mx.array) -> mx.array:
    """Routing + grouped expert GEMM kernels (``kernels.moe_routing``,
    ``kernels.moe_grouped_gemm``); the stock block wherever they do not apply
    (sharded block, non-bf16 activations, other quantisation, no CUDA).

    Numerics as :func:`sparse_moe_block` (fp32 selection, routing weights and
    combine), expert outputs rounded to bf16 as ``SwitchGLU``. Checked on the
    H200 against fp32 math on the dequantised weights (tests/test_cuda_moe.py).
    The shared expert runs through the same kernels where
    ``moe_grouped_gemm.shared_form`` says so: from ``SHARED_SLOT_MIN_TOKENS``
    tokens in a (k+1)-th routing slot of every token, one more group of the
    routed experts' launches (its sigmoid gate in fp32 as the slot's weight;
    the router and the gate as one matmul: :func:`router_with_shared_gate`),
    or (``MLX_QWEN_FAST_MOE_SHARED_GEMM=group``, or where the slot does not
    fit) from ``SHARED_GEMM_MIN_TOKENS`` as a one-expert group of its own
    (``moe_experts_and_shared``); otherwise through :func:`shared_expert`
    (MLX's dense quantised matmuls).
    """
    from ..kernels import moe_grouped_gemm as _gg
    from ..kernels import moe_routing as _mr

    sm = block.switch_mlp
    lead, d = x.shape[:-1], x.shape[-1]
    tokens = x.reshape(-1, d)
    if getattr(block, "sharding_group", None) is not None or not _gg.supports(
        tokens, sm.gate_proj, sm.up_proj, sm.down_proj
    ):
        return _stock(block, x)
    logits = block.gate(tokens)
    if not _mr.supports(logits, block.top_k):
        return _stock(block, x)
    i_dim = sm.gate_proj["weight"].shape[1]
    variant = _gg.default_variant(d, i_dim)
    n, k, e = tokens.shape[0], block.top_k, block.num_experts
    form = _gg.shared_form(n, d, i_dim, block.shared_expert, num_experts=e, top_k=k)
    if form == "slot":
        # the shared expert in a (k+1)-th routing slot of every token: one more
        # group of the same two launches, its sigmoid gate (fp32) the slot's
        # weight; router and gate as one matmul where they are alike
        tile = _gg.choose_tile_rows(n * (k + 1), e + 1, variant)
        joint = router_with_shared_gate(block)
        if joint is not None:
            routing = _mr.route_and_group(apply_linear(tokens, *joint), k, tile,
                                          normalize=block.norm_topk_prob, shared_column=True)
        else:
            shared_logits = block.shared_expert_gate(tokens)
            if shared_logits.dtype != logits.dtype:
                shared_logits = shared_logits.astype(logits.dtype)
            routing = _mr.route_and_group(logits, k, tile, normalize=block.norm_topk_prob,
                                          shared_logits=shared_logits)
        y = _gg.moe_experts(tokens, routing, sm.gate_proj, sm.up_proj, sm.down_proj,
                            shared_expert=block.shared_expert, variant=variant)
        return y.reshape(*lead, d)
    tile = _gg.choose_tile_rows(n * k, e, variant)
    routing = _mr.route_and_group(logits, k, tile, normalize=block.norm_topk_prob)
    if form == "group":
        # the shared expert as a one-expert group of the same kernels; its gate in fp32
        gate = mx.sigmoid(block.shared_expert_gate(tokens).astype(mx.float32))
        y = _gg.moe_experts_and_shared(tokens, routing, sm.gate_proj, sm.up_proj, sm.down_proj,
                                       block.shared_expert, gate)
        return y.reshape(*lead, d)
    y = _gg.moe_experts(tokens, routing, sm.gate_proj, sm.up_proj, sm.down_proj, variant=variant)
    return y.reshape(*lead, d) + shared_expert(block, x)


def _cuda_decode_kernel(block, x: mx.array) -> mx.array:
    """Decode (1..4 tokens) through ``kernels.moe_decode_gemv``: router,
    routing kernel, fused gate+up SwiGLU GEMV and fused down + routing
    weights + shared expert + combine (4 graph nodes), traced once with
    ``mx.compile`` (``moe_decode_step``); the stock block where the kernels
    do not apply (see ``moe_decode_gemv.supports``)."""
    from ..kernels import moe_decode_gemv as _dg

    y = _dg.moe_decode_step(block, x)  # None for a sharded or unsupported block
    return _stock(block, x) if y is None else y


#: name -> fn(block, x). Add a kernel here and pick it in ``_BY_BACKEND``.
IMPLEMENTATIONS: Dict[str, Callable[..., mx.array]] = {
    "stock": _stock,
    "reference": sparse_moe_block,
    "cuda-kernel": _cuda_kernel,
    "cuda-decode-kernel": _cuda_decode_kernel,
}

#: ``MLX_QWEN_FAST_MOE_KERNEL=0`` keeps the stock block on CUDA too (A/B
#: runs, debugging); unset or any other value lets the kernels run.
MOE_KERNEL_ENV = "MLX_QWEN_FAST_MOE_KERNEL"
#: Fewest tokens per call that take the CUDA kernels (prefill); fewer tokens
#: (decode, small batches) keep mlx-lm's block. Measured on the H200 through
#: bench.ops (whole block, one call per eval): at 16 tokens stock 0.84 ms vs
#: the kernels 1.05 ms (stock faster); at 512 tokens the expert GEMMs take
#: 0.63 ms vs 5.85 ms. The crossover in between is not measured yet; 128
#: keeps every call that stock may win on stock (its gather_qmm cost grows
#: ~linearly: ~1.5 ms of experts at 128 tokens against ~0.5 ms of kernels).
MOE_KERNEL_MIN_TOKENS = 128

#: The decode kernels run on CUDA for calls of at most this many tokens;
#: ``MLX_QWEN_FAST_MOE_DECODE_KERNEL=0`` keeps the stock block there. Measured
#: on the H200 (bench/results/moe-cuda-log.md, 2026-12-01): the two kernels
#: take 15.4 us per layer at 1 token (CUDA graph, kernels alone), the stock
#: block 250 us through MLX; patched decode at 4K context 43.3 -> 63.6 tok/s.
MOE_DECODE_KERNEL_ENV = "MLX_QWEN_FAST_MOE_DECODE_KERNEL"
MOE_DECODE_KERNEL_MAX_TOKENS = 4

# backend -> implementation name for calls the kernels do not take.
_BY_BACKEND = {
    _backend.CPU: "stock",
    _backend.CUDA: "stock",
    _backend.METAL: "stock",
}


def implementation_for(num_tokens: int, backend: Optional[str] = None) -> str:
    """Name in :data:`IMPLEMENTATIONS` used for ``num_tokens`` on ``backend``.

    Args:
        num_tokens: tokens in the call (product of ``x``'s leading axes).
        backend: ``"cpu" | "cuda" | "metal"``; default
            :func:`mlx_qwen_fast.backend.current`.

    ``"cuda-kernel"`` on CUDA for ``num_tokens >= MOE_KERNEL_MIN_TOKENS``
    (prefill) unless the environment sets ``MLX_QWEN_FAST_MOE_KERNEL=0``;
    "cuda-decode-kernel" on CUDA for 1..4 tokens unless the environment
    sets ``MLX_QWEN_FAST_MOE_DECODE_KERNEL=0``; "stock" otherwise, and for
    ``"cuda"`` where MLX has no CUDA device (as ``ops.gated_delta``). Measured on the H200 (bench/results/moe-cuda-log.md):
    the expert GEMMs take 2.67 ms at T = 4096 against 43.1 ms for mlx-lm's
    ``gather_qmm``, 1.07 ms against 5.85 ms at T = 512.

    Raises:
        ValueError: unknown backend.
    """
    name = _backend.resolve(backend)
    if name == _backend.CUDA and not _cuda_build.cuda_available():
        return _BY_BACKEND[name]  # "cuda" asked for where MLX has no CUDA device: stock
    if (
        name == _backend.CUDA
        and num_tokens >= MOE_KERNEL_MIN_TOKENS
        and os.environ.get(MOE_KERNEL_ENV, "") != "0"
    ):
        return "cuda-kernel"
    if (
        name == _backend.CUDA
        and 0 < num_tokens <= MOE_DECODE_KERNEL_MAX_TOKENS
        and os.environ.get(MOE_DECODE_KERNEL_ENV, "") != "0"
    ):
        return "cuda-decode-kernel"
    return _BY_BACKEND[name]


def sparse_moe(block, x: mx.array, *, implementation: Optional[str] = None) -> mx.array:
    """Dispatch entry for the sparse MoE block (what the fast module calls).

    Args:
        block: a ``Qwen3NextSparseMoeBlock``.
        x: ``[..., D]`` float.
        implementation: force a name from :data:`IMPLEMENTATIONS`; default
            :func:`implementation_for` the token count and current backend.

    Returns:
        ``[..., D]``, as ``Qwen3NextSparseMoeBlock.__call__``.

    Raises:
        ValueError: bad ``x`` (see :func:`sparse_moe_block`) or unknown
            ``implementation``.
    """
    _check_block_input("sparse_moe", block, x)
    if implementation is None:
        implementation = implementation_for(math.prod(x.shape[:-1]))
    try:
        fn = IMPLEMENTATIONS[implementation]
    except KeyError:
        raise ValueError(
            f"sparse_moe: implementation must be one of {sorted(IMPLEMENTATIONS)}, "
            f"got {implementation!r}"
        ) from None
    return fn(block, x)
