"""The sparse MoE block on the CUDA kernels.

* prefill (:func:`_cuda_prefill`): the routing kernels and grouped expert
  GEMMs (:mod:`mlx_qwen_fast.kernels.moe_routing`,
  :mod:`mlx_qwen_fast.kernels.moe_grouped_gemm`), the shared expert in a
  routing slot where it fits (:func:`_shared_in_slot`,
  :func:`router_with_shared_gate`);
* decode (:func:`_cuda_decode`): the router and two fused GEMV kernels, the
  first routing the tokens itself, in one ``mx.compile``d step
  (:func:`_compiled_decode_step`, shared by every layer; the one-launch
  block where :func:`_block_kernel_takes`), planned once per layer and call
  signature (:func:`_decode_step_plan`,
  :class:`mlx_qwen_fast.compiled.StepPlans`); :func:`moe_decode`, the same
  computation op by op.

Each runs the stock block where its kernels do not take the call; the
dispatcher (:func:`mlx_qwen_fast.ops.moe.sparse_moe`) picks them.
"""

from __future__ import annotations

from typing import Callable, Dict, NamedTuple, Optional

import mlx.core as mx

from ... import config
from ...compiled import StepPlans, apply_linear, concat_linears, linear_arrays, linear_paths
from ...kernels._checks import describe as _describe
from ...kernels import moe_block_decode as _k_block
from ...kernels import moe_decode_gemv as _decode_gemv
from ...kernels import moe_grouped_gemm as _grouped_gemm
from ...kernels import moe_grouped_gemm_builds as _gemm_builds
from ...kernels import moe_routing as _routing
from .. import _launch_order
from .. import linear as linear_ops
from .checks import _DECODE_CHILDREN, _EXPERT_PATHS, _decode_rows, decode_arrays
from .naive import _check_block_input, _shared_expert, _stock


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
    variant = _gemm_builds.default_variant(d, i_dim)
    n, k, e = tokens.shape[0], block.top_k, block.num_experts
    if _shared_in_slot(block, n, d, i_dim, variant):
        tile = _gemm_builds.choose_tile_rows(n * (k + 1), e + 1, variant)
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
        y = _grouped_gemm.moe_experts_unchecked(tokens, routing, sm.gate_proj, sm.up_proj, sm.down_proj,
                                       shared_expert=block.shared_expert, variant=variant)
        return y.reshape(*lead, d)
    tile = _gemm_builds.choose_tile_rows(n * k, e, variant)
    routing = _routing.route_and_group(logits, k, tile, normalize=block.norm_topk_prob)
    y = _grouped_gemm.moe_experts_unchecked(tokens, routing, sm.gate_proj, sm.up_proj, sm.down_proj, variant=variant)
    return y.reshape(*lead, d) + _shared_expert(block, x)


# ---------------------------------------------------------------------------
# CUDA decode: router + two fused GEMV kernels (the first routes), compiled
# ---------------------------------------------------------------------------


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


_decode_steps: Dict[tuple, Callable] = {}


class BlockSettings(NamedTuple):
    """What a one-launch MoE block step (:func:`_compiled_decode_step` with
    ``one_launch``) bakes in."""

    top_k: int
    normalize: bool
    router_group_size: int
    router_bits: int
    n_router: int  # the router's arrays
    shared_gate_bits: int
    norm_eps: float  # the post-attention RMSNorm's


def block_step_settings(fn) -> Optional[BlockSettings]:
    """The :class:`BlockSettings` of ``fn`` where it is a one-launch MoE
    block step made here (a :func:`mlx_qwen_fast.ops.moe.decode_step_parts`
    ``fn``), else None: what a layer step that runs the block inside a
    larger launch (:func:`mlx_qwen_fast.kernels.gdn_layer_decode.gdn_layer_decode`)
    needs to know."""
    for key, f in _decode_steps.items():
        if f is fn and key[-2]:
            top_k, normalize, router_static, n_router, sgb, eps = key[:6]
            return BlockSettings(top_k, normalize, router_static[1], router_static[2], n_router, sgb, eps)
    return None


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
            return _k_block.moe_block_decode_unchecked(h, norm_weight, arrays[:n_router], (a[0:3], a[3:6], a[6:9]),
                                              (a[9:12], a[12:15], a[15:18]), (a[18], a[19], a[20], shared_gate_bits),
                                              top_k, key[5], bool(normalize), group_size, bits,
                                              after=_launch_order.take())

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
                return _decode_gemv.moe_decode_logits_unchecked(xin, logits, top_k, normalize, experts, shared, expert_gate,
                                                       residual)
            inds, scores = _routing.route(logits, top_k, normalize=normalize)
            return _decode_gemv.moe_decode_arrays_unchecked(xin, inds, scores, experts, shared, expert_gate, residual)

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
