"""The sparse MoE block's reference, stage by stage, in plain MLX ops.

* :func:`route` -- fp32 softmax over the router logits, top-k, renormalise;
* :func:`group_by_expert`, :func:`block_map` -- the assignments grouped by
  expert (:class:`ExpertGroups`) and a grouped GEMM's work items;
* :func:`expert_swiglu`, :func:`combine`, :func:`shared_expert` -- the
  experts' outputs and their weighted sum;
* :func:`sparse_moe_block` -- the whole block from those stages (the
  "reference" implementation); :func:`_stock` -- mlx-lm's block.

The kernels' contracts are these stages' (:mod:`mlx_qwen_fast.ops.moe`).
"""

from __future__ import annotations

import numbers
from typing import Optional, Tuple

import mlx.core as mx
from mlx_lm.models.activations import swiglu
from mlx_lm.models.qwen3_next import Qwen3NextSparseMoeBlock
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from ...kernels._checks import describe as _describe
from ...moe_types import ExpertGroups, max_tiles

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


def _check_experts_agree(gate_proj, up_proj, down_proj) -> None:
    """The three projections hold the same experts, and up's outputs are
    gate's (the SwiGLU product): an expert id valid for one is valid for
    all, so the grouped matmuls index inside every weight (shapes only)."""
    e = gate_proj["weight"].shape[0]
    for name, proj in (("up_proj", up_proj), ("down_proj", down_proj)):
        if proj["weight"].shape[0] != e:
            raise ValueError(f"expert_swiglu: {name} must hold the {e} experts of gate_proj, "
                             f"got {proj['weight'].shape[0]}")
    if up_proj.output_dims != gate_proj.output_dims:
        raise ValueError(f"expert_swiglu: up_proj must have gate_proj's output size {gate_proj.output_dims}, "
                         f"got {up_proj.output_dims}")


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
        ValueError: ``x`` not a 2-D float array; ``groups`` not an
            :class:`ExpertGroups`; ``N*k`` differs from the groups' size; a
            projection's input size differs from its input or is not a
            multiple of its quantization ``group_size``; the projections
            holding different expert counts, or up's output size not
            gate's (checked with or without ``check``); with
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
    if not isinstance(groups, ExpertGroups):
        raise ValueError(f"expert_swiglu: groups must be an ExpertGroups (group_by_expert), got {type(groups).__name__}")
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
    _check_experts_agree(gate_proj, up_proj, down_proj)
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
        dtype: output dtype (float32, float16 or bfloat16), default
            ``expert_out.dtype``.

    Returns:
        ``[..., D]``.

    Raises:
        ValueError: ``expert_out`` not a float array of rank >= 2,
            ``scores`` not a float array of shape ``expert_out.shape[:-1]``,
            ``dtype`` not None or a float mlx dtype.
    """
    if not isinstance(expert_out, mx.array) or expert_out.ndim < 2 or expert_out.dtype not in _FLOATS:
        raise ValueError(f"combine: expert_out must be a float mx.array of shape [..., k, D], got {_describe(expert_out)}")
    if not isinstance(scores, mx.array) or scores.dtype not in _FLOATS:
        raise ValueError(f"combine: scores must be a float mx.array of shape {tuple(expert_out.shape[:-1])}, "
                         f"got {_describe(scores)}")
    if dtype is not None and dtype not in _FLOATS:
        raise ValueError(f"combine: dtype must be None or a float mlx dtype (mx.float32, mx.float16, "
                         f"mx.bfloat16), got {dtype!r}")
    if tuple(scores.shape) != tuple(expert_out.shape[:-1]):
        raise ValueError(
            f"combine: scores must have shape {tuple(expert_out.shape[:-1])} "
            f"(expert_out [..., k, D] without D), got {tuple(scores.shape)}"
        )
    y = (expert_out * scores[..., None]).sum(axis=-2)
    return y.astype(dtype or expert_out.dtype)


def shared_expert(block, x: mx.array) -> mx.array:
    """``sigmoid(shared_expert_gate(x)) * shared_expert(x)``: ``[..., D]``.

    Raises:
        ValueError: ``block`` not a ``Qwen3NextSparseMoeBlock``, ``x`` not a
            float ``[..., D]`` with D the block's hidden size (as
            :func:`sparse_moe_block`).
    """
    _check_block_input("shared_expert", block, x)
    return _shared_expert(block, x)


def _shared_expert(block, x: mx.array) -> mx.array:
    """:func:`shared_expert` of checked arguments (the dispatch's paths)."""
    if x.size == 0:  # no rows: MLX's quantised matmul cannot take them (as sparse_moe)
        return mx.zeros(x.shape, x.dtype)
    return mx.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)


# ---------------------------------------------------------------------------
# 4. The whole block and its dispatch
# 4. The whole block (reference)
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
    if x.size == 0:  # no tokens: nothing to route (MLX's quantised matmul does not take 0 rows)
        return mx.zeros(x.shape, x.dtype)
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
    y = y + _shared_expert(block, x)

    if group is not None:
        y = mx.distributed.all_sum(y, group=group)
    return y


def _stock(block, x: mx.array) -> mx.array:
    # The stock class's function, not ``block(x)``: the fast module that calls
    # :func:`sparse_moe` may itself be the block (a subclass or a wrapper).
    return Qwen3NextSparseMoeBlock.__call__(block, x)
