"""The sparse MoE block on the Metal kernels ("metal-decode", "metal-prefill").

* decode: :func:`_metal_decode` runs the router (the module), then the
  routing, gate+up SwiGLU and down + combine Metal kernels
  (:mod:`mlx_qwen_fast.kernels.moe_route_metal`,
  :mod:`mlx_qwen_fast.kernels.moe_gate_up_metal`,
  :mod:`mlx_qwen_fast.kernels.moe_down_metal`: the CUDA decode kernels'
  contract) where :func:`metal_decode_plan` takes the call;
* prefill: :func:`_metal_prefill` runs the router (the module), the routing
  and grouping kernels and the grouped GEMMs
  (:mod:`~mlx_qwen_fast.kernels.moe_route_metal`,
  :mod:`~mlx_qwen_fast.kernels.moe_group_metal`,
  :mod:`~mlx_qwen_fast.kernels.moe_grouped_gemm_metal`: the CUDA prefill
  kernels' contract), the shared expert on MLX's ops, where
  :func:`metal_prefill_plan` takes the call.

Each runs the stock block otherwise.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from ...compiled import StepPlans
from ...kernels import moe_down_metal as _down_metal
from ...kernels import moe_gate_up_metal as _gate_up_metal
from ...kernels import moe_group_metal as _group_metal
from ...kernels import moe_grouped_gemm_metal as _gemm_metal
from ...kernels import moe_route_metal as _route_metal
from .checks import _DECODE_CHILDREN, _EXPERT_PATHS, _METAL_PREFILL_SCALES, _decode_rows, decode_arrays, quantization_problem
from .naive import _shared_expert, _stock


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
    h, sgate = _gate_up_metal.gate_up_swiglu_metal_unchecked(tokens, inds, experts, shared, (a[18], a[19], a[20], bits))
    y = _down_metal.down_combine_metal_unchecked(h, inds, scores, sgate, experts[2], shared[2])
    return y.reshape(*lead, d)


def metal_prefill_plan(block, x) -> Optional[tuple]:
    """The routed experts' arrays ``(gate, up, down)``, each ``(weight,
    scales, biases)``, that the Metal prefill kernels run ``block`` on ``x``
    with, or None where they do not apply: a sharded block, ``x`` not a
    float32/float16/bfloat16 ``[..., D]``, E not a multiple of 32 in
    ``[32, 1024]`` or ``top_k`` not in ``[1, min(32, E)]`` (the routing
    kernel's), or experts the grouped GEMMs do not take
    (:func:`mlx_qwen_fast.kernels.moe_grouped_gemm_metal.problem`: 4-bit
    affine group 64 without a bias term, float scales and biases, D and I
    multiples of 64). Pure (no backend check, never builds a kernel)."""
    try:
        if getattr(block, "sharding_group", None) is not None or not isinstance(x, mx.array) or x.ndim < 1:
            return None
        E, k = block.num_experts, block.top_k
        if E % 32 or not 32 <= E <= _route_metal.MAX_EXPERTS or not 1 <= k <= min(_route_metal.MAX_TOP_K, E):
            return None
        sm = block.switch_mlp
        projs = (sm.gate_proj, sm.up_proj, sm.down_proj)
        if any(quantization_problem(p, scales=_METAL_PREFILL_SCALES) is not None for p in projs):
            return None
        experts = tuple((p["weight"], p["scales"], p["biases"]) for p in projs)
        tok = mx.zeros((1, x.shape[-1]), x.dtype)  # shape and dtype only, never evaluated
        return experts if _gemm_metal.problem(tok, experts) is None else None
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def _metal_prefill(block, x: mx.array) -> mx.array:
    """The block for a prefill chunk on Metal: ``block.gate`` (the module:
    MLX's quantised matmul), the routing kernel (fp32 softmax, top-k,
    renormalised as ``block.norm_topk_prob``), the grouping kernels (counts,
    offsets, the stable order, the block map), the gate+up SwiGLU and down +
    routing-weight grouped GEMMs, the sum over each token's k in fp32, and
    :func:`shared_expert` on MLX's ops (the module); five kernel launches,
    no host synchronisation. The stock block where
    :func:`metal_prefill_plan` declines.

    Numerics as "cuda-prefill": selection, routing weights and the combine
    in fp32, expert outputs rounded to x's dtype where ``SwitchGLU`` rounds,
    the weights ``s * q + b`` in fp32 (never rounded)."""
    experts = metal_prefill_plan(block, x)
    if experts is None:
        return _stock(block, x)
    lead, d = x.shape[:-1], x.shape[-1]
    tokens = x.reshape(-1, d)
    n, k = tokens.shape[0], block.top_k
    tile = _gemm_metal.choose_tile_rows(n * k, block.num_experts)
    routing = _group_metal.route_and_group_metal(block.gate(tokens), k, tile, normalize=block.norm_topk_prob)
    y = _gemm_metal.moe_experts_metal_unchecked(tokens, routing, experts)
    return y.reshape(*lead, d) + _shared_expert(block, x)
