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
   :func:`sparse_moe`: the dispatch entry the fast module calls,
   :func:`implementation_for`, the one place that decides which
   implementation runs for a call (backend, token count, switches), and
   :func:`decide_kernels`, which declines the kernels, once per block at
   patch time, for a block whose weights are not the one format they read
   (:data:`KERNEL_QUANTIZATION`; :func:`kernel_problems` says why).

Nothing here synchronises with the host or produces a shape that depends on
the data: every shape follows from ``N``, ``k``, ``E`` and the tile size, so
the graph can be recorded once (CUDA graphs, ``mx.compile``).

Implementations (:data:`IMPLEMENTATIONS`): "stock" (mlx-lm's block: the
reference adds sorting work that the stock ``SwitchGLU`` does not need, so
backends without a kernel keep stock), "reference", "cuda-prefill" (routing
kernels + grouped expert GEMMs, :mod:`mlx_qwen_fast.kernels.moe_routing`,
:mod:`~mlx_qwen_fast.kernels.moe_grouped_gemm`) and "cuda-decode" (router +
two fused GEMV kernels, the first routing the tokens itself, in one
``mx.compile``d step: three launches; a router of more than
:data:`~mlx_qwen_fast.kernels.moe_decode_gemv.ROUTE_MAX_EXPERTS` experts
keeps the routing kernel's launch between them,
:mod:`~mlx_qwen_fast.kernels.moe_decode_gemv`) and, on Metal with
:data:`mlx_qwen_fast.config.METAL_KERNELS` on, "metal-decode" (the router,
then three Metal kernels of the CUDA decode kernels' contract: routing,
gate+up SwiGLU, down + combine; :func:`_metal_decode`). Each falls back to
stock for a block its kernels do not take (sharded, other quantisation,
other dtypes).
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx
from mlx_lm.models.activations import swiglu
from mlx_lm.models.qwen3_next import Qwen3NextSparseMoeBlock
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from .. import backend as _backend
from .. import config
from ..compiled import StepPlans, apply_linear, concat_linears, linear_arrays, linear_paths
from ..kernels import _cuda_build
from ..kernels._cuda_build import describe as _describe
from ..kernels import moe_block_decode as _k_block
from ..kernels import moe_decode_gemv as _decode_gemv
from ..kernels import moe_down_metal as _down_metal
from ..kernels import moe_gate_up_metal as _gate_up_metal
from ..kernels import moe_grouped_gemm as _grouped_gemm
from ..kernels import moe_route_metal as _route_metal
from ..kernels import moe_routing as _routing
from ..moe_types import ExpertGroups, max_tiles  # noqa: F401 (part of this module's API)
from . import linear as linear_ops

__all__ = [
    "ExpertGroups",
    "block_takes_weights",
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
    "KERNEL_QUANTIZATION",
    "quantization_problem",
    "kernel_problems",
    "decide_kernels",
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
            f"[..., E], got {_describe(logits)}"
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


def group_by_expert(
    inds: mx.array, num_experts: int, *, check_range: bool = True
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
        check_range: check that every id is in range before grouping. This
            reads two values back to the host (one synchronisation; not
            allowed inside ``mx.compile``); callers whose ids come from
            :func:`route` pass False. Without the check an out-of-range id
            is clamped into range before any indexing (memory stays safe;
            the result is then meaningless).

    Returns:
        :class:`ExpertGroups`.

    Raises:
        ValueError: ``inds`` is not a 2-D integer array; ``num_experts`` is
            not an int >= 1; ``k > num_experts``; with ``check_range``, an id
            outside ``[0, num_experts)`` (the offending range is named).
    """
    if not isinstance(inds, mx.array) or inds.ndim != 2 or inds.dtype not in _INTS:
        raise ValueError(
            "group_by_expert: inds must be an integer mx.array of shape [N, k], "
            f"got {_describe(inds)}"
        )
    if not isinstance(num_experts, numbers.Integral) or isinstance(num_experts, bool) or num_experts < 1:
        raise ValueError(f"group_by_expert: num_experts must be an int >= 1, got {num_experts!r}")
    n, k = inds.shape
    if k > num_experts:
        raise ValueError(
            f"group_by_expert: inds [N, k] has k={k} > num_experts={num_experts}"
        )
    if check_range and inds.size > 0:
        lo, hi = mx.min(inds).item(), mx.max(inds).item()
        if lo < 0 or hi >= num_experts:
            raise ValueError(
                f"group_by_expert: inds must lie in [0, num_experts={num_experts}), "
                f"got values in [{lo}, {hi}]"
            )

    nk = n * k
    flat = mx.clip(inds.reshape(-1).astype(mx.int64), 0, num_experts - 1).astype(mx.int32)
    counts = mx.zeros((num_experts,), mx.int32).at[flat].add(mx.ones_like(flat))
    offsets = mx.concatenate([mx.zeros((1,), mx.int32), mx.cumsum(counts)])

    key_dtype = mx.int32 if num_experts * max(nk, 1) < 2**31 else mx.int64
    arange = mx.arange(nk, dtype=mx.int32)
    key = flat.astype(key_dtype) * nk + arange.astype(key_dtype)
    order = mx.argsort(key).astype(mx.int32)
    sorted_experts = flat[order]
    inverse = mx.put_along_axis(mx.zeros((nk,), mx.int32), order, arange, axis=0)
    return ExpertGroups(counts, offsets, order, sorted_experts, inverse, k)


def _check_groups(fn: str, groups: ExpertGroups, num_experts: Optional[int] = None) -> None:
    """Raise ValueError unless ``groups`` is an :class:`ExpertGroups` whose
    arrays are int32 of the contract's shapes and whose values stay in range
    (``counts`` >= 0 summing to ``N*k``, ``offsets`` its prefix sum,
    ``order`` / ``inverse`` in ``[0, N*k)``, ``sorted_experts`` in ``[0, E)``;
    E at most ``num_experts``, the weights' count). One host synchronisation."""
    if not isinstance(groups, ExpertGroups):
        raise ValueError(f"{fn}: groups must be an ExpertGroups (group_by_expert), got {type(groups).__name__}")
    arrays = dict(counts=groups.counts, offsets=groups.offsets, order=groups.order,
                  sorted_experts=groups.sorted_experts, inverse=groups.inverse)
    for name, a in arrays.items():
        if not isinstance(a, mx.array) or a.ndim != 1 or a.dtype != mx.int32:
            raise ValueError(f"{fn}: groups.{name} must be a 1-D int32 mx.array")
    e, nk = groups.counts.shape[0], groups.order.shape[0]
    if (groups.offsets.shape[0] != e + 1 or groups.sorted_experts.shape[0] != nk
            or groups.inverse.shape[0] != nk):
        raise ValueError(f"{fn}: groups' arrays disagree in size (counts [{e}], offsets "
                         f"[{groups.offsets.shape[0]}], order [{nk}])")
    if num_experts is not None and e > num_experts:
        raise ValueError(f"{fn}: groups count {e} experts, the weights hold {num_experts}")
    if nk == 0:
        return
    c64, o64 = groups.counts.astype(mx.int64), groups.offsets.astype(mx.int64)
    ok = mx.all(c64 >= 0) & (mx.sum(c64) == nk) & (o64[0] == 0) & mx.all(o64[1:] - o64[:-1] == c64)
    for name in ("order", "inverse"):
        ok = ok & (mx.min(arrays[name]) >= 0) & (mx.max(arrays[name]) < nk)
    ok = ok & (mx.min(groups.sorted_experts) >= 0) & (mx.max(groups.sorted_experts) < e)
    if not ok.item():
        raise ValueError(f"{fn}: groups' values are out of range for {nk} assignments over {e} experts "
                         "(build them with group_by_expert)")


def block_map(groups: ExpertGroups, tile_rows: int, *, check: bool = True) -> mx.array:
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
        ValueError: ``tile_rows`` not an int in ``[1, 2**16]`` (larger ones
            would overflow the int32 tile arithmetic); with ``check``
            (default; one host synchronisation), groups whose values leave
            their ranges.
    """
    if not isinstance(tile_rows, numbers.Integral) or isinstance(tile_rows, bool) or not 1 <= tile_rows <= 2**16:
        raise ValueError(f"block_map: tile_rows must be an int in [1, 65536], got {tile_rows!r}")
    if check:
        _check_groups("block_map", groups)
    num_experts = groups.num_experts
    size = max_tiles(groups.num_assignments, num_experts, tile_rows)
    counts = groups.counts if check else mx.clip(groups.counts, 0, groups.num_assignments)
    tiles = (counts + (tile_rows - 1)) // tile_rows
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
    *,
    check: bool = True,
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
            is not a multiple of its quantization ``group_size``; with
            ``check`` (default; one host synchronisation, not inside
            ``mx.compile``), groups whose index arrays leave their ranges
            or name more experts than the weights hold. Without the check
            the indices are clamped into range (memory stays safe; the
            result of bad groups is then meaningless).
    """
    if not isinstance(x, mx.array) or x.ndim != 2 or x.dtype not in _FLOATS:
        raise ValueError(
            "expert_swiglu: x must be a float mx.array of shape [N, D], got "
            f"{_describe(x)}"
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
    if check:
        _check_groups("expert_swiglu", groups, gate_proj["weight"].shape[0])
        experts, order, inverse = groups.sorted_experts, groups.order, groups.inverse
    else:  # clamped into range, so that bad groups give a meaningless result, never an access outside
        nk, e = max(n * k, 1), gate_proj["weight"].shape[0]
        experts = mx.clip(groups.sorted_experts, 0, e - 1)
        order, inverse = mx.clip(groups.order, 0, nk - 1), mx.clip(groups.inverse, 0, nk - 1)
    rows = mx.expand_dims(x[order // k], -2)  # [N*k, 1, D]
    up = _switch_linear(up_proj, rows, experts)
    gate = _switch_linear(gate_proj, rows, experts)
    out = _switch_linear(down_proj, swiglu(gate, up), experts)  # [N*k, 1, D]
    return out[inverse].reshape(n, k, -1)


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
    if not all(hasattr(block, n) for n in ("gate", "switch_mlp", "shared_expert", "shared_expert_gate")):
        raise ValueError(f"{fn}: block must be a Qwen3NextSparseMoeBlock (gate, switch_mlp, shared_expert, "
                         f"shared_expert_gate), got {type(block).__name__}")
    d = _hidden_size(block)
    if (not isinstance(x, mx.array) or x.ndim < 2 or x.dtype not in _FLOATS
            or (d is not None and x.shape[-1] != d)):
        raise ValueError(
            f"{fn}: x must be a float32/float16/bfloat16 mx.array of shape [..., {d}] "
            f"(at least one token axis, last axis = hidden size {d}), "
            f"got {_describe(x)}"
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
    groups = group_by_expert(inds.reshape(tokens.shape[0], -1), block.num_experts, check_range=False)
    sm = block.switch_mlp
    y = expert_swiglu(tokens, groups, sm.gate_proj, sm.up_proj, sm.down_proj, check=False)
    y = combine(y, scores.reshape(tokens.shape[0], -1)).reshape(*lead, d)
    y = y + shared_expert(block, x)

    if group is not None:
        y = mx.distributed.all_sum(y, group=group)
    return y


def _stock(block, x: mx.array) -> mx.array:
    # The stock class's function, not ``block(x)``: the fast module that calls
    # :func:`sparse_moe` may itself be the block (a subclass or a wrapper).
    return Qwen3NextSparseMoeBlock.__call__(block, x)


# ---------------------------------------------------------------------------
# The weight format the kernels read, decided per block at patch time
# ---------------------------------------------------------------------------

#: The one weight format of the CUDA MoE kernels (grouped GEMMs and decode
#: GEMVs): MLX affine quantisation, 4 bits, groups of 64 inputs, bf16 scales
#: and biases, no bias term. The kernels unpack eight 4-bit values per uint32
#: word and one scale/bias pair per 64 inputs; any other layout would be read
#: as garbage, so every other format runs stock.
KERNEL_QUANTIZATION = "affine 4-bit group 64 with bfloat16 scales and biases"

_QUANTIZED_CLASSES = ("QuantizedLinear", "QuantizedSwitchLinear")
_DECLINED = "_mqf_declined"  # block attribute: {implementation: reason} from decide_kernels


def _dtype_name(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def quantization_problem(m, bits: Tuple[int, ...] = (4,)) -> Optional[str]:
    """Why the CUDA MoE kernels cannot read the (switch) linear layer ``m``,
    or None when they can.

    Read from the module's own attributes and array dtypes (nothing is
    evaluated): it must be an ``nn.QuantizedLinear`` or mlx-lm
    ``QuantizedSwitchLinear`` with ``mode`` "affine", ``bits`` in ``bits``,
    ``group_size`` 64, ``scales`` and ``biases`` bfloat16 and no ``bias``
    term.

    Args:
        m: any module (or object).
        bits: the bit widths accepted (4 for expert weights; the decode
            kernels also read an 8-bit shared-expert gate).

    Returns:
        None, or the first difference in a few words: "3-bit weights",
        "mxfp4 weights", "group size 32", "float32 scales", "unquantised
        weights", "a LoRASwitchLinear layer", ...
    """
    name = type(m).__name__
    if name not in _QUANTIZED_CLASSES:
        return "unquantised weights" if name in ("Linear", "SwitchLinear") else f"a {name} layer"
    mode = getattr(m, "mode", None) or "affine"
    if mode != "affine":
        return f"{mode} weights"
    if getattr(m, "bits", None) not in bits:
        return f"{getattr(m, 'bits', None)}-bit weights"
    if getattr(m, "group_size", None) != 64:
        return f"group size {getattr(m, 'group_size', None)}"
    if "biases" not in m or "scales" not in m:
        return "no affine scales and biases"
    if "bias" in m:
        return "a bias term"
    for leaf in ("scales", "biases"):
        if m[leaf].dtype != mx.bfloat16:
            return f"{_dtype_name(m[leaf].dtype)} {leaf}"
    return None


def _first_problem(part: str, block, child: str, names: Tuple[str, ...]) -> Optional[str]:
    """``"<part>: <problem> (<child>.<name>)"`` for the first module
    ``block.<child>.<name>`` (``name`` in ``names``) that the kernels cannot
    read as 4-bit (:func:`quantization_problem`), or None."""
    parent = getattr(block, child, None)
    for n in names:
        p = quantization_problem(getattr(parent, n, None))
        if p is not None:
            return f"{part}: {p} ({child}.{n})"
    return None


_PROJS = ("gate_proj", "up_proj", "down_proj")


def kernel_problems(block) -> Dict[str, str]:
    """The kernel implementations that cannot run ``block`` for the way its
    modules are quantised, each with the reason.

    * "cuda-prefill" reads the routed experts (``switch_mlp.gate_proj``,
      ``up_proj``, ``down_proj``): they must be :data:`KERNEL_QUANTIZATION`.
      The router and the shared expert may be quantised any way (they run on
      MLX's quantised matmuls when they differ from the experts).
    * "cuda-decode" reads the routed experts and the shared expert
      (``shared_expert.gate_proj``, ...), both :data:`KERNEL_QUANTIZATION`,
      and the shared-expert gate: 4- or 8-bit affine group 64 with bf16
      scales and biases, or a bias-free bf16 ``nn.Linear``. The router may be
      any ``nn.Linear`` / ``nn.QuantizedLinear`` (the step applies it with
      ``mx.quantized_matmul`` at its own settings).
    * "metal-decode" reads what "cuda-decode" reads but the router, which
      it calls as the module it is (any layer).

    Pure: reads module attributes and dtypes only, on every backend. Shapes
    and activation dtypes are still checked per call, where the kernels
    decline anything else to the stock block.

    Args:
        block: a ``Qwen3NextSparseMoeBlock`` (or the fast subclass).

    Returns:
        ``{implementation name: reason}`` for the implementations that do
        not apply, e.g. ``{"cuda-prefill": "moe experts: 3-bit weights
        (switch_mlp.gate_proj)", "cuda-decode": ..., "metal-decode": ...}``;
        empty when all apply.
    """
    experts = _first_problem("moe experts", block, "switch_mlp", _PROJS)
    if experts is not None:
        return {"cuda-prefill": experts, "cuda-decode": experts, "metal-decode": experts}
    decode = _first_problem("moe shared expert", block, "shared_expert", _PROJS)
    if decode is None:
        sg = getattr(block, "shared_expert_gate", None)
        gate = quantization_problem(sg, bits=(4, 8))
        dense_bf16 = (type(sg).__name__ == "Linear" and "bias" not in sg
                      and sg["weight"].dtype == mx.bfloat16)
        if gate is not None and not dense_bf16:
            decode = f"moe shared-expert gate: {gate} (shared_expert_gate)"
    if decode is not None:
        return {"cuda-decode": decode, "metal-decode": decode}
    if linear_arrays(getattr(block, "gate", None)) is None:
        return {"cuda-decode": f"moe router: a {type(getattr(block, 'gate', None)).__name__} layer (gate)"}
    return {}


def decide_kernels(block) -> Dict[str, str]:
    """Decide, from ``block``'s modules, which kernel implementations
    :func:`sparse_moe` may pick for it, and keep that on the block.

    Called by :func:`mlx_qwen_fast.patching.patch` for every MoE block it
    makes fast (again on every patch). :func:`sparse_moe` then runs "stock"
    wherever :func:`implementation_for` would pick a declined kernel. A
    block never decided (built and called directly) keeps the per-call
    checks alone, which decline the same quantisations.

    Returns:
        :func:`kernel_problems` of ``block``.
    """
    problems = kernel_problems(block)
    object.__setattr__(block, _DECLINED, dict(problems))
    return problems


# ---------------------------------------------------------------------------
# CUDA prefill: routing kernels + grouped expert GEMMs
# ---------------------------------------------------------------------------

_JOINT_ROUTER = ("joint-router",)  # StepPlans key of router_with_shared_gate


def router_with_shared_gate(block):
    """The router (``block.gate``, D -> E) and the shared expert's gate
    (``block.shared_expert_gate``, D -> 1) as one linear layer D -> E + 32:
    ``(arrays, static)`` for :func:`compiled.apply_linear`, whose output
    columns ``[0, E)`` are the router's logits, column E the gate's and the
    rest zeros (rows of zero weights, scales and biases: the width a
    multiple of 32, as the routing kernel's ``shared_column`` reads it).
    Every output column comes from the same numbers as the two layers'; one
    matmul instead of two saves the gate's own launch (bench/results/INDEX.md,
    "ncu" of the MoE block).

    Built once per block (``StepPlans``: rebuilt when either layer's arrays
    are replaced, e.g. by ``load_weights``; an array changed in place is not
    seen). None when the two are not plain (quantised) linear layers with
    the same settings, or E is not a multiple of 32: the caller runs them
    apart."""
    def make():
        lins = [linear_arrays(block.gate), linear_arrays(block.shared_expert_gate)]
        if any(lin is None for lin in lins):
            return [("gate",), ("shared_expert_gate",)], None
        # the arrays themselves, also when declining: replacing one re-decides
        paths = linear_paths(("gate",), lins[0]) + linear_paths(("shared_expert_gate",), lins[1])
        (r_arr, r_static), (g_arr, _) = lins
        if r_arr[0].shape[0] % 32 or g_arr[0].shape[0] != 1:
            return paths, None
        pad = _routing.SHARED_COLUMN_PAD - 1
        zeros = (tuple(mx.zeros((pad,) + a.shape[1:], a.dtype) for a in g_arr), r_static)
        return paths, concat_linears([lins[0], lins[1], zeros])  # None: settings or sizes differ

    _, plan = StepPlans.of(block).get(_JOINT_ROUTER, block, make)
    return plan


def _shared_in_slot(block, num_tokens: int, d: int, i_dim: int, variant: str) -> bool:
    """Whether the prefill kernels run the shared expert in a (k+1)-th
    routing slot of every token (one more expert group of the same two
    "wgmma" launches, its sigmoid gate the slot's weight) rather than on
    MLX's dense quantised matmuls beside them: where the routing has room
    for the slot, the build is "wgmma" and the shared expert has the routed
    experts' quantisation and sizes. Faster from the smallest call the
    prefill kernels take (bench/results/INDEX.md, "ncu" of the MoE block)."""
    return (variant == "wgmma" and _routing.shared_slot_fits(block.num_experts, block.top_k)
            and _grouped_gemm.shared_slot_supported(block.shared_expert, d, i_dim))


def _cuda_prefill(block, x: mx.array) -> mx.array:
    """Routing + grouped expert GEMM kernels; the stock block wherever they
    do not apply (sharded block, non-bf16 activations, other quantisation).

    Numerics as :func:`sparse_moe_block` (fp32 selection, routing weights and
    combine), expert outputs rounded to bf16 as ``SwitchGLU``; the shared
    expert in the routing's slot where :func:`_shared_in_slot` (the router
    and its gate as one matmul: :func:`router_with_shared_gate`), else
    :func:`shared_expert` on MLX's dense quantised matmuls.
    """
    sm = block.switch_mlp
    lead, d = x.shape[:-1], x.shape[-1]
    tokens = x.reshape(-1, d)
    if getattr(block, "sharding_group", None) is not None or not _grouped_gemm.supports(
        tokens, sm.gate_proj, sm.up_proj, sm.down_proj
    ):
        return _stock(block, x)
    logits = block.gate(tokens)
    if not _routing.supports(logits, block.top_k):
        return _stock(block, x)
    i_dim = sm.gate_proj["weight"].shape[1]
    variant = _grouped_gemm.default_variant(d, i_dim)
    n, k, e = tokens.shape[0], block.top_k, block.num_experts
    if _shared_in_slot(block, n, d, i_dim, variant):
        tile = _grouped_gemm.choose_tile_rows(n * (k + 1), e + 1, variant)
        joint = router_with_shared_gate(block)
        if joint is not None:
            routing = _routing.route_and_group(apply_linear(tokens, *joint), k, tile,
                                               normalize=block.norm_topk_prob, shared_column=True)
        else:
            shared_logits = block.shared_expert_gate(tokens)
            if shared_logits.dtype != logits.dtype:
                shared_logits = shared_logits.astype(logits.dtype)
            routing = _routing.route_and_group(logits, k, tile, normalize=block.norm_topk_prob,
                                               shared_logits=shared_logits)
        y = _grouped_gemm._moe_experts(tokens, routing, sm.gate_proj, sm.up_proj, sm.down_proj,
                                       shared_expert=block.shared_expert, variant=variant)
        return y.reshape(*lead, d)
    tile = _grouped_gemm.choose_tile_rows(n * k, e, variant)
    routing = _routing.route_and_group(logits, k, tile, normalize=block.norm_topk_prob)
    y = _grouped_gemm._moe_experts(tokens, routing, sm.gate_proj, sm.up_proj, sm.down_proj, variant=variant)
    return y.reshape(*lead, d) + shared_expert(block, x)


# ---------------------------------------------------------------------------
# CUDA decode: router + two fused GEMV kernels (the first routes), compiled
# ---------------------------------------------------------------------------


def _quantized_ok(m, bits=(4,)) -> bool:
    """An affine group-64 quantised (switch) linear layer of one of ``bits``,
    bf16 scales and biases, no bias term (:func:`quantization_problem`)."""
    return quantization_problem(m, bits) is None


def decode_arrays(block):
    """``(experts, shared, expert_gate)`` of a ``Qwen3NextSparseMoeBlock`` as
    :func:`mlx_qwen_fast.kernels.moe_decode_gemv.moe_decode_arrays` takes them,
    or None when a module is not quantised the way the kernels need (routed
    and shared experts 4-bit group 64 affine with bf16 scales; shared gate
    4/8-bit group 64 or a bias-free bf16 ``nn.Linear``)."""
    try:
        sm, se, sgm = block.switch_mlp, block.shared_expert, block.shared_expert_gate
        mods = (sm.gate_proj, sm.up_proj, sm.down_proj, se.gate_proj, se.up_proj, se.down_proj)
    except AttributeError:
        return None
    if not all(_quantized_ok(m) for m in mods):
        return None
    q = lambda m: (m["weight"], m["scales"], m["biases"])  # noqa: E731
    if _quantized_ok(sgm, bits=(4, 8)):
        eg = (sgm["weight"], sgm["scales"], sgm["biases"], sgm.bits)
    elif type(sgm).__name__ == "Linear" and "bias" not in sgm and sgm["weight"].dtype == mx.bfloat16:
        w = sgm["weight"]
        eg = (w, w, w, 16)
    else:
        return None
    return tuple(q(m) for m in mods[:3]), tuple(q(m) for m in mods[3:]), eg


def _decode_rows(block, x) -> Optional[int]:
    """The token rows of ``x`` where both decode kernels' plans may apply --
    an unsharded block, ``x`` bf16 ``[..., D]`` with 1 to
    ``MAX_TOKENS`` rows -- else None."""
    if getattr(block, "sharding_group", None) is not None:
        return None
    if not isinstance(x, mx.array) or x.ndim < 1 or x.dtype != mx.bfloat16:
        return None
    n = math.prod(x.shape[:-1])
    return n if 1 <= n <= _decode_gemv.MAX_TOKENS else None


def decode_plan(block, x) -> Optional[tuple]:
    """The arrays (:func:`decode_arrays`) the decode kernels run ``block`` on
    ``x`` with, or None where they do not apply: a sharded block, ``x`` not
    bf16 ``[..., D]`` with 1..4 tokens, E not a multiple of 32 (<= 1024),
    ``top_k`` not in ``[1, min(32, E)]``, or arrays the kernels do not take
    (:func:`mlx_qwen_fast.kernels.moe_decode_gemv.supports_arrays`). Pure
    (no backend check, never compiles)."""
    try:
        n = _decode_rows(block, x)
        if n is None:
            return None
        E, k = block.num_experts, block.top_k
        if E % 32 or E > 1024 or not 1 <= k <= min(32, E):
            return None
        arrs = decode_arrays(block)
        if arrs is None:
            return None
        tok = mx.zeros((n, x.shape[-1]), mx.bfloat16)  # shape only, never evaluated
        inds = mx.zeros((n, k), mx.int32)
        return arrs if _decode_gemv.supports_arrays(tok, inds, *arrs) else None
    except (AttributeError, TypeError, ValueError):
        return None


def moe_decode(block, x: mx.array) -> mx.array:
    """``Qwen3NextSparseMoeBlock(x)`` for 1..4 tokens through the decode
    kernels, op by op (what :func:`_cuda_decode` runs as one compiled step):
    ``block.gate`` (quantised matmul), the gate+up SwiGLU kernel routing the
    tokens itself (fp32 softmax, top-k, renormalised as
    ``block.norm_topk_prob``), the down + routing weights + shared expert +
    combine kernel; where :func:`~mlx_qwen_fast.kernels.moe_decode_gemv.route_fits`
    is False for the block's experts, the routing kernel before a gate+up
    kernel that takes its ids (the same results).

    Args:
        block: a quantised ``Qwen3NextSparseMoeBlock`` (see :func:`decode_plan`).
        x: ``[..., D]`` bfloat16, 1..4 tokens.

    Returns:
        ``[..., D]`` bfloat16.

    Raises:
        ValueError: the block or ``x`` does not fit the kernels.
    """
    arrs = decode_plan(block, x)
    if arrs is None:
        _check_block_input("moe_decode", block, x)
        if x.dtype != mx.bfloat16 or _decode_rows(block, x) is None:
            raise ValueError(f"moe_decode: x must be bfloat16 with 1..{_decode_gemv.MAX_TOKENS} tokens "
                             f"(the decode kernels'), got {_describe(x)}")
        raise ValueError("moe_decode: block does not fit the decode kernels (sharded, its expert count or top_k, "
                         "or its arrays' quantisation: see decode_plan)")
    lead, d = x.shape[:-1], x.shape[-1]
    tokens = x.reshape(-1, d)
    logits = block.gate(tokens)
    if _decode_gemv.route_fits(block.num_experts, block.top_k):
        y = _decode_gemv.moe_decode_logits(tokens, logits, block.top_k, *arrs, normalize=block.norm_topk_prob)
    else:
        inds, scores = _routing.route(logits, block.top_k, normalize=block.norm_topk_prob)
        y = _decode_gemv.moe_decode_arrays(tokens, inds, scores, *arrs)
    return y.reshape(*lead, d)


_DECODE_CHILDREN = ("gate", "shared_expert_gate", "switch_mlp", "shared_expert")
_EXPERT_PATHS = tuple((parent, proj, leaf) for parent in ("switch_mlp", "shared_expert")
                      for proj in ("gate_proj", "up_proj", "down_proj")
                      for leaf in ("weight", "scales", "biases"))


def _decode_step_plan(block, x, norm_eps: Optional[float] = None):
    """``(paths, compiled step)`` of ``block`` for inputs like ``x`` (see
    :class:`mlx_qwen_fast.compiled.StepPlans`); ``(children, None)`` where
    :func:`decode_plan` declines. Path order = the compiled step's array
    order: router, routed experts gate/up/down, shared expert gate/up/down
    (weight, scales, biases each), shared-expert gate (weight, scales,
    biases). ``norm_eps``: as :func:`decode_step_parts`. The step routes
    inside the gate+up kernel where
    :func:`~mlx_qwen_fast.kernels.moe_decode_gemv.route_fits` the block's
    experts and top-k, else with the routing kernel."""
    declined = [(c,) for c in _DECODE_CHILDREN if c in block], None
    router = linear_arrays(block.gate) if "gate" in block else None
    arrs = decode_plan(block, x)
    if router is None or arrs is None:
        return declined
    bits = arrs[2][3]
    gate = (("shared_expert_gate", "weight"),) * 3 if bits == 16 else tuple(
        ("shared_expert_gate", n) for n in ("weight", "scales", "biases"))
    paths = linear_paths(("gate",), router) + _EXPERT_PATHS + gate
    route_in_kernel = _decode_gemv.route_fits(block.num_experts, block.top_k)
    one_launch = _block_kernel_takes(block, x, router, arrs, norm_eps)
    return paths, _compiled_decode_step(block.top_k, block.norm_topk_prob, router[1], len(router[0]), bits,
                                        route_in_kernel, norm_eps, one_launch)


def _block_kernel_takes(block, x, router, arrs, norm_eps) -> bool:
    """Whether the fused decode step (``norm_eps`` given) runs the one-launch
    MoE block (:func:`mlx_qwen_fast.kernels.moe_block_decode.moe_block_decode`):
    its switch and the fused GEMV's on, the router affine 4/8-bit with
    biases and no bias, the kernel's shapes (its ``supports``; the norm
    weight's shape stands in as [D] bf16: the kernel takes every float
    dtype)."""
    if norm_eps is None or not (config.MOE_BLOCK_KERNEL.get() and config.DECODE_GEMV_KERNEL.get()):
        return False
    static = router[1]
    if not _block_router_fits(router):
        return False
    norm_like = mx.zeros((x.shape[-1],), mx.bfloat16)  # shape only, never evaluated
    return _k_block.supports(x, norm_like, router[0], *arrs, top_k=block.top_k, router_group_size=static[1],
                             router_bits=static[2])


def _block_router_fits(router) -> bool:
    """Whether a router's ``linear_arrays`` are in the one-launch block's
    format: affine quantised with biases and no bias, the kernel's bits and
    group sizes."""
    static = router[1]
    return (static[0] == "quantized" and static[3] == "affine" and bool(static[4]) and not static[5]
            and len(router[0]) == 3 and static[2] in _k_block.ROUTER_BITS and static[1] in _k_block.ROUTER_GROUPS)


def block_takes_weights(block) -> bool:
    """Whether ``block``'s (a ``Qwen3NextSparseMoeBlock``) router is in the
    one-launch MoE block's format (affine 4- or 8-bit with biases and no
    bias, group 32/64/128): settings only, for the report
    (:func:`mlx_qwen_fast.patching.patch`); the experts' format is the MoE
    decode kernels' (declined with them), and the decode step also checks
    the call's shapes and switches."""
    router = linear_arrays(getattr(block, "gate", None))
    return router is not None and _block_router_fits(router)


def decode_step_parts(block, x: mx.array, norm_eps: Optional[float] = None):
    """The compiled decode step of ``block``, for a caller that traces it
    inside its own compiled function
    (:func:`mlx_qwen_fast.ops.decoder.decode_layer`); None where
    :func:`sparse_moe` would not run it (not "cuda-decode" for this many
    tokens, declined for the block's quantisation, modules the kernels do
    not take).

    Args:
        block: a ``Qwen3NextSparseMoeBlock``.
        x: ``[..., D]`` (only its shape and dtype are read).
        norm_eps: None, or the eps of the decoder layer's RMSNorm before the
            block: then the step takes the un-normalised ``h`` and that
            norm's weight and returns ``h + block(rms_norm(h))`` (the norm
            fused into the router's GEMV, which also hands the normalised
            rows to the experts: :func:`mlx_qwen_fast.ops.linear.decode_linear`).

    Returns:
        ``(paths, fn)``: ``fn(x, *arrays) -> [..., D]`` (with ``norm_eps``:
        ``fn(h, norm_weight, *arrays)``), ``arrays`` the objects at
        ``paths`` under ``block``.
    """
    if implementation_for(math.prod(x.shape[:-1])) != "cuda-decode" \
            or "cuda-decode" in block.__dict__.get(_DECLINED, ()):
        return None
    paths, fn = _decode_step_plan(block, x, norm_eps)
    if fn is None:
        return None
    return tuple(paths), fn


_decode_steps: Dict[tuple, Callable] = {}


def _compiled_decode_step(top_k: int, normalize: bool, router_static: tuple, n_router: int,
                          shared_gate_bits: int, route_in_kernel: bool, norm_eps: Optional[float] = None,
                          one_launch: bool = False):
    """The ``mx.compile``d decode step for one static setting (one trace per
    input signature, shared by every layer: all arrays are inputs); with
    ``norm_eps``, the fused form of :func:`decode_step_parts`. The router
    goes through :func:`mlx_qwen_fast.ops.linear.decode_linear`; with
    ``route_in_kernel`` its logits go to the gate+up kernel, which routes
    (:func:`mlx_qwen_fast.kernels.moe_decode_gemv.moe_decode_logits`: three
    launches), else to the routing kernel first (four launches, the same
    results bit for bit). ``one_launch`` (fused form only,
    :func:`_block_kernel_takes`): the whole step as one launch
    (:func:`mlx_qwen_fast.kernels.moe_block_decode.moe_block_decode`: the
    three launches' results bit for bit)."""
    fused = norm_eps is not None
    key = (top_k, bool(normalize), router_static, n_router, shared_gate_bits, float(norm_eps) if fused else None,
           config.DECODE_GEMV_KERNEL.get(), bool(one_launch and fused), bool(route_in_kernel))
    fn = _decode_steps.get(key)
    if fn is None and key[-2]:
        _, group_size, bits = router_static[:3]

        def step(h, norm_weight, *arrays):
            a = arrays[n_router:]
            return _k_block._moe_block_decode(h, norm_weight, arrays[:n_router], (a[0:3], a[3:6], a[6:9]),
                                              (a[9:12], a[12:15], a[15:18]), (a[18], a[19], a[20], shared_gate_bits),
                                              top_k, key[5], bool(normalize), group_size, bits)

        fn = _decode_steps[key] = mx.compile(step)
    if fn is None:

        def core(x, norm, arrays):
            if norm is None:
                logits = linear_ops.decode_linear(x, arrays[:n_router], router_static)
                xin = x
            else:
                logits, xin = linear_ops.decode_linear(x, arrays[:n_router], router_static, norm=norm,
                                                       normed_out=True)
            a = arrays[n_router:]
            experts, shared = (a[0:3], a[3:6], a[6:9]), (a[9:12], a[12:15], a[15:18])
            expert_gate = (a[18], a[19], a[20], shared_gate_bits)
            # fused: the residual added by the down kernel (h + bf16(block(norm(h))), stock's roundings)
            residual = None if norm is None else x
            if route_in_kernel:
                return _decode_gemv._moe_decode_logits(xin, logits, top_k, normalize, experts, shared, expert_gate,
                                                       residual)
            inds, scores = _routing.route(logits, top_k, normalize=normalize)
            return _decode_gemv._moe_decode_arrays(xin, inds, scores, experts, shared, expert_gate, residual)

        if fused:
            def step(h, norm_weight, *arrays):
                return core(h, (norm_weight, key[5]), arrays)
        else:
            def step(x, *arrays):
                return core(x, None, arrays)

        fn = _decode_steps[key] = mx.compile(step)
    return fn


def _cuda_decode(block, x: mx.array) -> mx.array:
    """The block's decode step (:func:`moe_decode`'s computation, bit for bit)
    traced once with ``mx.compile``; the stock block where the kernels do
    not apply (:func:`decode_plan` declines). Called where MLX has a CUDA
    device (:func:`sparse_moe` sees to it). The block's arrays are inputs of the
    compiled function, so one trace per token count serves every layer; the
    :func:`decode_plan` checks run once per layer and input signature
    (cached on the block, re-run when one of its arrays is replaced), so a
    call costs the array lookups and the compiled call."""
    key = (tuple(x.shape), x.dtype, config.DECODE_GEMV_KERNEL.get())  # the GEMV switch is read while tracing
    arrays, fn = StepPlans.of(block).get(key, block, lambda: _decode_step_plan(block, x))
    if fn is None:
        return _stock(block, x)
    return fn(x, *arrays)  # [..., D] in and out: the kernels need no reshape node


# ---------------------------------------------------------------------------
# Metal decode: the router, then the routing, gate+up and down Metal kernels
# ---------------------------------------------------------------------------


def metal_decode_plan(block, x) -> Optional[tuple]:
    """The arrays (:func:`decode_arrays`) the Metal decode kernels run
    ``block`` on ``x`` with, or None where they do not apply: a sharded
    block, ``x`` not bf16 ``[..., D]`` with 1..4 tokens, E not a multiple of
    32 in ``[32, 1024]``, ``top_k`` not in ``[1, min(32, E)]``, more than 32
    (token, expert) pairs, or arrays the kernels do not take
    (:func:`mlx_qwen_fast.kernels.moe_gate_up_metal.problem`: D and I
    multiples of 64). Pure (no backend check, never builds a kernel)."""
    try:
        n = _decode_rows(block, x)
        if n is None:
            return None
        E, k = block.num_experts, block.top_k
        if E % 32 or not 32 <= E <= _route_metal.MAX_EXPERTS or not 1 <= k <= min(_route_metal.MAX_TOP_K, E):
            return None
        arrs = decode_arrays(block)
        if arrs is None:
            return None
        tok = mx.zeros((n, x.shape[-1]), mx.bfloat16)  # shapes only, never evaluated
        inds = mx.zeros((n, k), mx.int32)
        return arrs if _gate_up_metal.problem(tok, inds, *arrs) is None else None
    except (AttributeError, TypeError, ValueError):
        return None


def _metal_plan(block, x):
    """``(paths, shared-gate bits)`` of the Metal decode for inputs like
    ``x`` (:class:`mlx_qwen_fast.compiled.StepPlans`; path order = the
    kernels' array order, as :func:`_decode_step_plan` without the router,
    which the step calls as a module); ``(children, None)`` where
    :func:`metal_decode_plan` declines."""
    arrs = metal_decode_plan(block, x)
    if arrs is None:
        return [(c,) for c in _DECODE_CHILDREN if c in block], None
    bits = arrs[2][3]
    gate = (("shared_expert_gate", "weight"),) * 3 if bits == 16 else tuple(
        ("shared_expert_gate", n) for n in ("weight", "scales", "biases"))
    return _EXPERT_PATHS + gate, bits


def _metal_decode(block, x: mx.array) -> mx.array:
    """The block for 1..4 tokens on Metal: ``block.gate`` (the module: MLX's
    quantised matmul), the routing kernel (fp32 softmax, top-k,
    renormalised as ``block.norm_topk_prob``), the gate+up SwiGLU kernel and
    the down + routing weights + shared expert + combine kernel
    (:mod:`~mlx_qwen_fast.kernels.moe_route_metal`,
    :mod:`~mlx_qwen_fast.kernels.moe_gate_up_metal`,
    :mod:`~mlx_qwen_fast.kernels.moe_down_metal`); four graph nodes, no host
    synchronisation. The stock block where :func:`metal_decode_plan`
    declines. The plan's checks run once per layer and input signature
    (cached on the block, re-run when one of its arrays is replaced).

    Numerics as "cuda-decode": selection, routing weights and the combine
    in fp32, expert outputs rounded to bf16 where ``SwitchGLU`` rounds, the
    weights ``s * q + b`` in fp32 (never rounded)."""
    arrays, bits = StepPlans.of(block).get(("metal-decode", tuple(x.shape), x.dtype), block,
                                           lambda: _metal_plan(block, x))
    if bits is None:
        return _stock(block, x)
    lead, d = x.shape[:-1], x.shape[-1]
    tokens = x.reshape(-1, d)
    inds, scores = _route_metal.route_metal(block.gate(tokens), block.top_k, normalize=block.norm_topk_prob)
    a = arrays
    experts, shared = (a[0:3], a[3:6], a[6:9]), (a[9:12], a[12:15], a[15:18])
    h, sgate = _gate_up_metal._launch(tokens, inds, experts, shared, (a[18], a[19], a[20], bits))
    y = _down_metal._launch(h, inds, scores, sgate, experts[2], shared[2])
    return y.reshape(*lead, d)


# ---------------------------------------------------------------------------
# dispatch
# ---------------------------------------------------------------------------

#: name -> fn(block, x). :func:`implementation_for` picks one per call.
IMPLEMENTATIONS: Dict[str, Callable[..., mx.array]] = {
    "stock": _stock,
    "reference": sparse_moe_block,
    "cuda-prefill": _cuda_prefill,
    "cuda-decode": _cuda_decode,
    "metal-decode": _metal_decode,
}

#: Fewest tokens per call that take the prefill kernels on CUDA; fewer
#: tokens above :data:`DECODE_MAX_TOKENS` keep mlx-lm's block (the kernels'
#: and stock's times near the crossover: bench/results/INDEX.md, "ops").
PREFILL_MIN_TOKENS = 128

#: Most tokens per call that take the decode kernels on CUDA and on Metal
#: (the kernels' limit, :data:`mlx_qwen_fast.kernels.moe_decode_gemv.MAX_TOKENS`,
#: :data:`mlx_qwen_fast.kernels.moe_gate_up_metal.MAX_TOKENS`).
DECODE_MAX_TOKENS = _decode_gemv.MAX_TOKENS


def implementation_for(num_tokens: int, backend: Optional[str] = None) -> str:
    """Name in :data:`IMPLEMENTATIONS` used for ``num_tokens`` on ``backend``.

    On CUDA (where MLX has a CUDA device): "cuda-prefill" for
    ``num_tokens >= PREFILL_MIN_TOKENS`` unless
    :data:`mlx_qwen_fast.config.MOE_PREFILL_KERNEL` is off; "cuda-decode"
    for 1 to :data:`DECODE_MAX_TOKENS` tokens unless
    :data:`~mlx_qwen_fast.config.MOE_DECODE_KERNEL` is off; "stock"
    otherwise. On Metal (where MLX has a Metal device): "metal-decode" for
    1 to :data:`DECODE_MAX_TOKENS` tokens when
    :data:`~mlx_qwen_fast.config.METAL_KERNELS` is on; "stock" otherwise,
    and on the CPU.

    Args:
        num_tokens: tokens in the call (product of ``x``'s leading axes).
        backend: ``"cpu" | "cuda" | "metal"``; default
            :func:`mlx_qwen_fast.backend.current`.

    Raises:
        ValueError: unknown backend.
    """
    name = _backend.resolve(backend)
    if name == _backend.METAL:
        if 0 < num_tokens <= DECODE_MAX_TOKENS and config.METAL_KERNELS.get() and mx.metal.is_available():
            return "metal-decode"
        return "stock"
    if name != _backend.CUDA or not _cuda_build.cuda_available():
        return "stock"
    if num_tokens >= PREFILL_MIN_TOKENS and config.MOE_PREFILL_KERNEL.get():
        return "cuda-prefill"
    if 0 < num_tokens <= DECODE_MAX_TOKENS and config.MOE_DECODE_KERNEL.get():
        return "cuda-decode"
    return "stock"


def sparse_moe(block, x: mx.array, *, implementation: Optional[str] = None) -> mx.array:
    """Dispatch entry for the sparse MoE block (what the fast module calls).

    Args:
        block: a ``Qwen3NextSparseMoeBlock``.
        x: ``[..., D]`` float.
        implementation: force a name from :data:`IMPLEMENTATIONS` (a CUDA
            one where MLX has no CUDA device, a Metal one where it has no
            Metal device, runs "stock"); default
            :func:`implementation_for` the token count and current backend,
            or "stock" where that is a kernel :func:`decide_kernels`
            declined for this block's quantisation.

    Returns:
        ``[..., D]``, as ``Qwen3NextSparseMoeBlock.__call__``.

    Raises:
        ValueError: bad ``x`` (see :func:`sparse_moe_block`) or unknown
            ``implementation``.
    """
    _check_block_input("sparse_moe", block, x)
    if implementation is not None and (not isinstance(implementation, str) or implementation not in IMPLEMENTATIONS):
        raise ValueError(f"sparse_moe: implementation must be one of {sorted(IMPLEMENTATIONS)}, "
                         f"got {implementation!r}")
    if x.size == 0:  # no tokens: nothing to route (MLX's quantised matmul does not take 0 rows)
        return mx.zeros(x.shape, x.dtype)
    if implementation is None:
        implementation = implementation_for(math.prod(x.shape[:-1]))
        if implementation in block.__dict__.get(_DECLINED, ()):  # decide_kernels, at patch time
            implementation = "stock"
    elif isinstance(implementation, str) and implementation.startswith("cuda-") and not _cuda_build.cuda_available():
        implementation = "stock"  # a CUDA implementation asked for where MLX has no CUDA device
    elif isinstance(implementation, str) and implementation.startswith("metal-") and not mx.metal.is_available():
        implementation = "stock"  # a Metal implementation asked for where MLX has no Metal device
    return IMPLEMENTATIONS[implementation](block, x)
