"""Fused decode MoE (N <= 4 tokens) on CUDA: two launches per layer after the router.

Replaces, for decode-sized calls, the three ``mx.gather_qmm`` of mlx-lm's
``SwitchGLU``, the weighted sum over the k experts, the shared expert MLP (three
``quantized_matmul``), its sigmoid gate and the final add of
``Qwen3NextSparseMoeBlock`` (about 15 graph nodes) by two kernels (source
``mlx_qwen_fast/cuda/moe_decode_gemv.cu``):

- :func:`gate_up_swiglu`: for every distinct expert among the ``N*k``
  selected (token, slot) pairs, plus the shared expert, the gate and up
  GEMVs on tensor cores (``mma.sync`` m16n8k16, the N tokens as B columns)
  with the 4-bit weights dequantised in registers, fp32 accumulation, and
  ``bf16(silu(bf16(g)) * bf16(u))`` (the roundings of ``SwitchGLU`` on bf16);
  one more CTA computes ``sigmoid(bf16(x . w_shared_gate))``.
  :func:`route_gate_up_swiglu` is the same kernel taking the router's
  logits instead of the ids: every routed CTA first routes the N tokens
  (softmax, top-k, normalisation) with the routing kernel's own device code
  (``route_row``, ``mlx_qwen_fast/cuda/moe_route_common.cuh``: the same
  ids and weights as :func:`mlx_qwen_fast.kernels.moe_routing.route`, bit
  for bit), and one CTA writes that routing for the down kernel; for E up to
  :data:`ROUTE_MAX_EXPERTS` (:func:`route_fits`).
- :func:`down_combine`: the down GEMVs of the same experts, each output
  rounded to bf16, times its routing weight (the shared expert's times its
  sigmoid gate), summed in fp32 in a fixed order (no atomics: deterministic)
  and stored in bf16: the MoE block's output ``y [N, D]``.

A pair whose expert another token of the call also picked is computed once
(the weights are read once per call and per expert). Grids: gate+up
``(I/16) x (N*k + 2)`` CTAs of 256 threads (weights, scales and x staged in
dynamic shared memory through ``cp.async``, :func:`gate_up_smem_bytes`), down
``D/16`` CTAs of :func:`down_warps` warps.

Weights: MLX affine quantisation, 4 bits, group 64, bf16 scales and biases
(the routed experts ``[E, O, K/8]``, the shared expert ``[O, K/8]``); the
shared-expert gate (``D -> 1``) 4- or 8-bit group 64, or plain bf16.
Dequantised as ``bf16(s * q + b)``, one rounding (MLX's CUDA
``mx.dequantize``). The checks the Metal port shares (the weight format,
the shared-expert gate, the ids, :data:`MAX_TOKENS`):
:mod:`~mlx_qwen_fast.kernels.moe_contract`. The tests' fp32 host reference takes the weights as
``s * q + b`` in fp32 and rounds to bf16 where mlx-lm rounds.

Numerics against the stock block (bf16): the routing weights and the combine
stay fp32 (stock rounds probabilities, weighted outputs and the sum to bf16),
the shared gate's sigmoid is not rounded, selection uses fp32 probabilities
(:func:`mlx_qwen_fast.kernels.moe_routing.route`).

The patched model runs them from :mod:`mlx_qwen_fast.ops.moe` ("cuda-decode":
the router's GEMV and these two kernels, the first routing, as one
``mx.compile``-d step, :func:`moe_decode_logits`; for a router wider than
:data:`ROUTE_MAX_EXPERTS` the routing kernel between them,
:func:`moe_decode_arrays`): its module call (:func:`~mlx_qwen_fast.ops.moe.sparse_moe`)
and the decoder layer's step (:func:`~mlx_qwen_fast.ops.moe.decode_step_parts`,
traced by :mod:`mlx_qwen_fast.ops.layer_plans`), where the one-launch block
(:mod:`mlx_qwen_fast.kernels.moe_block_decode`, the default there) is off or
does not take the router. The down kernel keeps one mma chain per 128-input
block, adds them in block order, and sums the items' weighted outputs in
slot order. Measured GPU times and the block's read floor:
bench/results/INDEX.md (kind "moe_decode").
"""

from __future__ import annotations

import numbers
from typing import Dict, Optional, Sequence, Tuple

import mlx.core as mx

from . import _cuda_build as cb
from ._checks import describe as _describe
from .moe_contract import DECODE_MAX_TOKENS as MAX_TOKENS
from .moe_contract import check_expert_ids, decode_weights_problem, is_4bit_group64

__all__ = [
    "moe_decode_arrays_unchecked",
    "moe_decode_logits_unchecked",
    "moe_decode_arrays",
    "moe_decode_logits",
    "gate_up_swiglu",
    "route_gate_up_swiglu",
    "down_combine",
    "supports_arrays",
    "weights_problem",
    "route_fits",
    "down_warps",
    "MAX_TOKENS",
    "ROUTE_MAX_EXPERTS",
]

#: Most experts the gate+up kernel routes itself (:func:`route_fits`): every
#: routed CTA repeats the routing (E/32 logits per lane, k rounds of two warp
#: reductions) before its first weight load, a cost that grows with E; wider
#: routers keep the routing kernel's launch.
ROUTE_MAX_EXPERTS = 512
_LOGITS = (mx.float32, mx.bfloat16, mx.float16)
NT = 256  # threads per CTA
RB = 16  # weight rows per CTA
SMEM_LIMIT = 46 * 1024  # static shared memory of the down kernel
_kernels: Dict[tuple, cb.CudaKernel] = {}

Q3 = Tuple[mx.array, mx.array, mx.array]  # (weight uint32, scales bf16, biases bf16)


# ---------------------------------------------------------------------------
# shape checks (pure, CPU-callable)
# ---------------------------------------------------------------------------


def down_warps(n: int, k: int, I: int) -> int:
    """Warps per CTA of the down kernel for ``n`` tokens, top-``k``, expert width ``I``.

    One warp per item (``n*k`` pair slots + the shared expert) at one token
    when that is at most 12 warps and ``I <= 768`` (the kernel then needs at
    most 168 registers, so one CTA per SM still fits without spills; nvcc
    13.0 spills at I = 1024 with 9 warps), so no warp computes two items in
    series (faster than 8 warps at k = 8: bench/results/package-figures.md,
    "Decode MoE down kernel"); 8 otherwise.
    """
    return n * k + 1 if n == 1 and k + 1 <= 12 and I <= 768 else 8


def smem_bytes(n: int, k: int, I: int) -> int:
    """Static shared memory of the down kernel: h rows + each item's output."""
    return 2 * (n * k + n) * I + 4 * (n * k + 1) * RB * n


def gate_up_smem_bytes(n: int) -> int:
    """Dynamic shared memory of the gate+up kernel for ``n`` tokens (bytes):
    8 warps x (4 KB of weights + 512 B of scales/biases + 512 n B of x),
    as ``GU_SMEM`` in ``moe_decode_gemv.cu``."""
    return 36864 + 4096 * n


def _is_int(v) -> bool:
    """A Python or numpy integer (not a bool)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def route_fits(num_experts, top_k) -> bool:
    """True when the gate+up kernel routes the tokens itself
    (:func:`route_gate_up_swiglu`): ``num_experts`` an int multiple of 32 in
    ``[32, ROUTE_MAX_EXPERTS]`` and ``top_k`` an int in ``[1, min(32,
    num_experts)]``. Pure (no backend check, never compiles). Where it is
    False the decode step keeps the routing kernel's launch
    (:func:`mlx_qwen_fast.kernels.moe_routing.route`)."""
    return (_is_int(num_experts) and _is_int(top_k) and num_experts % 32 == 0
            and 32 <= num_experts <= ROUTE_MAX_EXPERTS and 1 <= top_k <= min(32, num_experts))


def _x_problem(x) -> Optional[str]:
    """The tokens' part of the checks: x bfloat16 ``[N, D]``, 1 <= N <= 4."""
    if not isinstance(x, mx.array) or x.ndim != 2 or x.dtype != mx.bfloat16:
        return f"x must be bfloat16 [N, D], got {_describe(x)}"
    if not 1 <= x.shape[0] <= MAX_TOKENS:
        return f"x must have 1..{MAX_TOKENS} tokens, got N={x.shape[0]}"
    return None


def _shape_problem(x, inds, scores, experts, shared, expert_gate, down_smem: bool = True) -> Optional[str]:
    """None when the arrays fit the kernels, else what is wrong (one line).
    ``down_smem=False`` skips the down kernel's shared-memory limit (for
    callers that do not run it)."""
    problem = _x_problem(x)
    if problem is not None:
        return problem
    n, D = x.shape
    if not isinstance(inds, mx.array) or inds.ndim != 2 or inds.shape[0] != n or inds.dtype not in (mx.int32, mx.uint32):
        return f"inds must be int32/uint32 [N={n}, k], got {_describe(inds)}"
    k = inds.shape[1]
    if not 1 <= k or n * k > 32:
        return f"N*k must be in [1, 32], got N={n}, k={k}"
    if scores is not None and (
        not isinstance(scores, mx.array) or tuple(scores.shape) != (n, k) or scores.dtype != mx.float32
    ):
        return f"scores must be float32 [{n}, {k}], got {_describe(scores)}"
    return weights_problem(n, D, k, experts, shared, expert_gate, down_smem)


def _route_problem(x, logits, top_k, experts, shared, expert_gate, down_smem: bool = True) -> Optional[str]:
    """:func:`_shape_problem` for the kernels that route (``logits`` and
    ``top_k`` in place of ``inds`` and ``scores``)."""
    problem = _x_problem(x)
    if problem is not None:
        return problem
    n, D = x.shape
    if not isinstance(logits, mx.array) or logits.ndim != 2 or logits.shape[0] != n or logits.dtype not in _LOGITS:
        return f"logits must be float32/bfloat16/float16 [N={n}, E], got {_describe(logits)}"
    E = logits.shape[1]
    if E % 32 or not 32 <= E <= ROUTE_MAX_EXPERTS:
        return (f"logits must have E columns, E a multiple of 32 in [32, ROUTE_MAX_EXPERTS={ROUTE_MAX_EXPERTS}], "
                f"got E={E}")
    if not _is_int(top_k) or not 1 <= top_k <= min(32, E):
        return f"top_k must be an int in [1, min(32, E={E})], got top_k={top_k!r}"
    if n * top_k > 32:
        return f"N*k must be in [1, 32], got N={n}, k={top_k}"
    problem = weights_problem(n, D, int(top_k), experts, shared, expert_gate, down_smem)
    if problem is not None:
        return problem
    if experts[0][0].shape[0] != E:
        return f"logits must have one column per expert (E={experts[0][0].shape[0]}), got E={E}"
    return None


def weights_problem(n: int, D: int, k: int, experts, shared, expert_gate, down_smem: bool = True) -> Optional[str]:
    """None when these kernels take a MoE block's weights for ``n`` tokens
    of width ``D``, top-``k``, else what is wrong (one line, the argument
    named): D a multiple of 256, the expert width I a multiple of 128, the
    arrays of :func:`~mlx_qwen_fast.kernels.moe_contract.decode_weights_problem`
    and, with ``down_smem``, ``(N*k + N) * I`` within the down kernel's
    shared memory (:func:`smem_bytes`). Pure: reads shapes and dtypes only
    (the weights' part of :func:`supports_arrays`; the one-launch block
    :mod:`~mlx_qwen_fast.kernels.moe_block_decode` checks its weights with
    it, ``down_smem=False``)."""
    if D % 256:
        return f"D must be a multiple of 256, got D={D}"
    try:
        gate, _, _ = experts
        I = gate[0].shape[1]
    except (TypeError, ValueError, AttributeError, IndexError):
        return "experts must be (gate, up, down), each (weight, scales, biases)"
    if I % 128:
        return f"expert intermediate size I must be a multiple of 128, got I={I}"
    problem = decode_weights_problem(experts, shared, expert_gate, D)
    if problem is not None:
        return problem
    if down_smem and smem_bytes(n, k, I) > SMEM_LIMIT:
        return f"(N*k + N) * I too large for the down kernel's shared memory (N={n}, k={k}, I={I})"
    return None


def supports_arrays(x, inds, experts, shared, expert_gate, scores=None) -> bool:
    """Shape/dtype check of :func:`moe_decode_arrays` without the backend check."""
    return _shape_problem(x, inds, scores, experts, shared, expert_gate) is None


# ---------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------


_STAGES = {"gate_up": 0, "down": 1}  # the source's MDG_KIND


def _kernel(stage: str, n: int, k: int, D: int, I: int, shared_gate_bits: int = 8,
            yt: str = "bf16_t", residual: bool = False, route_experts: int = 0,
            logit_type: str = "bf16_t") -> cb.CudaKernel:
    """One build of ``moe_decode_gemv.cu``: ``stage`` "gate_up" (with the
    shared-expert gate's bit width; with ``route_experts`` = E, the build
    that routes the tokens from logits of C type ``logit_type``) or "down"
    (with or without the residual input); cached per configuration."""
    key = (stage, n, k, D, I, shared_gate_bits, yt, residual, route_experts, logit_type)
    kern = _kernels.get(key)
    if kern is None:
        defs = dict(MDG_KIND=_STAGES[stage], MDG_N=n, MDG_K=k, MDG_D=D, MDG_I=I)
        if stage == "gate_up":
            defs["MDG_SGB"] = shared_gate_bits
            if route_experts:
                defs.update(MDG_ROUTE=1, MDG_E=route_experts, MDG_LT=logit_type)
            name = "mqf_moe_dec_route_gate_up" if route_experts else "mqf_moe_dec_gate_up"
        else:
            defs["MDG_YT"] = yt
            defs["MDG_DNW"] = down_warps(n, k, I)
            if residual:
                defs["MDG_RES"] = 1
            name = "mqf_moe_dec_down"
        kern = _kernels[key] = cb.CudaKernel("moe_decode_gemv.cu", name, defs)
    return kern


def _check(fn: str, problem: Optional[str]):
    if problem is not None:
        raise ValueError(f"{fn}: {problem}")


def gate_up_swiglu(
    x: mx.array, inds: mx.array, experts: Sequence, shared: Sequence, expert_gate: Sequence
) -> Tuple[mx.array, mx.array]:
    """Gate + up GEMVs and SwiGLU of the selected and the shared experts.

    Args:
        x: ``[N, D]`` bfloat16, 1 <= N <= 4, D % 256 == 0.
        inds: ``[N, k]`` int32/uint32 expert ids in ``[0, E)`` (checked: one
            host synchronisation), N*k <= 32.
        experts: ``(gate, up, down)`` of the routed experts, each
            ``(weight, scales, biases)``: gate/up ``uint32 [E, I, D/8]``,
            ``bf16 [E, I, D/64]``; down ``uint32 [E, D, I/8]``, ``bf16 [E, D, I/64]``
            (down is only checked here).
        shared: ``(gate, up, down)`` of the shared expert (``[I, D/8]`` ...).
        expert_gate: ``(weight, scales, biases, bits)`` of the shared-expert
            gate ``D -> 1`` (bits 4/8, group 64; or bits 16: bf16 ``[1, D]``).

    Returns:
        ``(h, sgate)``: ``h [N*k + N, I]`` bfloat16, row ``n*k + j`` =
        ``bf16(silu(bf16(x[n] Wg^T)) * bf16(x[n] Wu^T))`` of expert
        ``inds[n, j]``, row ``N*k + n`` the shared expert's;
        ``sgate [N]`` float32 = ``sigmoid(bf16(x[n] . w_gate))``.

    Raises:
        ValueError: a shape/dtype the kernel does not take (named).
    """
    _check("gate_up_swiglu", _shape_problem(x, inds, None, experts, shared, expert_gate))
    check_expert_ids("gate_up_swiglu", inds, experts[0][0].shape[0])
    return _launch_gate_up(x, inds, experts, shared, expert_gate)


def _gate_up_call(kern, x, sel, k, experts, shared, expert_gate, routing_shape=None, scalars=()):
    """Launch a gate+up build: ``sel`` (the kernel's second input) is inds,
    or the logits for a routing build, which also returns inds and scores
    of ``routing_shape``."""
    n = x.size // x.shape[-1]
    (wg, sg, bg), (wu, su, bu), _ = experts
    I = wg.shape[1]
    (xwg, xsg, xbg), (xwu, xsu, xbu), _ = shared
    gw, gs, gb, _ = expert_gate
    nk = n * k
    routing = [] if routing_shape is None else [routing_shape, routing_shape]
    return kern(
        inputs=[x, sel, wg, sg, bg, wu, su, bu, xwg, xsg, xbg, xwu, xsu, xbu, gw, gs, gb],
        output_shapes=[(nk + n, I), (n,)] + routing,
        output_dtypes=[mx.bfloat16, mx.float32] + ([mx.int32, mx.float32] if routing else []),
        grid=((I // RB) * NT, nk + 2, 1),
        threadgroup=(NT, 1, 1),
        shared_memory=gate_up_smem_bytes(n),
        scalars=list(scalars),
    )


def _launch_gate_up(x, inds, experts, shared, expert_gate):
    """:func:`gate_up_swiglu` on arguments already checked (x ``[..., D]``,
    inds ``[..., k]``: the kernel reads them as ``[N, D]``, ``[N, k]``)."""
    D, k = x.shape[-1], inds.shape[-1]
    kern = _kernel("gate_up", x.size // D, k, D, experts[0][0].shape[1], int(expert_gate[3]))
    h, sgate = _gate_up_call(kern, x, inds, k, experts, shared, expert_gate)
    return h, sgate


def route_gate_up_swiglu(
    x: mx.array, logits: mx.array, top_k: int, experts: Sequence, shared: Sequence, expert_gate: Sequence,
    *, normalize: bool = True,
) -> Tuple[mx.array, mx.array, mx.array, mx.array]:
    """The tokens' routing, then :func:`gate_up_swiglu` of the experts it
    selects, in one launch.

    Every routed CTA of the gate+up kernel first routes the N tokens with
    the routing kernel's device code (``route_row`` in
    ``mlx_qwen_fast/cuda/moe_route_common.cuh``): fp32 softmax of the
    logits, top-k by probability (ties: the lower expert id first),
    divided by the k probabilities' sum with ``normalize``. The selection
    and the weights are those of
    :func:`mlx_qwen_fast.kernels.moe_routing.route` on the same logits, bit
    for bit, and ``h``, ``sgate`` those of :func:`gate_up_swiglu` on its ids.

    Args:
        x: ``[N, D]`` bfloat16, 1 <= N <= 4, D % 256 == 0.
        logits: ``[N, E]`` float32/bfloat16/float16 router outputs, E a
            multiple of 32 in ``[32, ROUTE_MAX_EXPERTS]`` and the experts'
            count.
        top_k: experts per token, an int in ``[1, min(32, E)]``, N*k <= 32.
        experts, shared, expert_gate: as :func:`gate_up_swiglu`.
        normalize: divide the k probabilities by their sum
            (``norm_topk_prob``).

    Returns:
        ``(h, sgate, inds, scores)``: ``h [N*k + N, I]`` bfloat16 and
        ``sgate [N]`` float32 as :func:`gate_up_swiglu`; ``inds [N, k]``
        int32 (slots in decreasing probability) and ``scores [N, k]``
        float32 as :func:`~mlx_qwen_fast.kernels.moe_routing.route`.

    Raises:
        ValueError: a shape/dtype the kernel does not take, ``top_k`` out of
            range, or logits whose E is not the experts' (named).
    """
    _check("route_gate_up_swiglu", _route_problem(x, logits, top_k, experts, shared, expert_gate,
                                                  down_smem=False))
    return _launch_route_gate_up(x, logits, int(top_k), normalize, experts, shared, expert_gate)


def _launch_route_gate_up(x, logits, top_k, normalize, experts, shared, expert_gate):
    """:func:`route_gate_up_swiglu` on arguments already checked (x
    ``[..., D]``, logits ``[..., E]``: read as ``[N, D]``, ``[N, E]``); inds
    and scores are shaped ``logits.shape[:-1] + (top_k,)``."""
    D = x.shape[-1]
    kern = _kernel("gate_up", x.size // D, top_k, D, experts[0][0].shape[1], int(expert_gate[3]),
                   route_experts=logits.shape[-1], logit_type=cb.dtype_macro(logits.dtype))
    h, sgate, inds, scores = _gate_up_call(kern, x, logits, top_k, experts, shared, expert_gate,
                                           routing_shape=(*logits.shape[:-1], top_k),
                                           scalars=[int(bool(normalize))])
    return h, sgate, inds, scores


def down_combine(
    h: mx.array, inds: mx.array, scores: mx.array, sgate: mx.array, down: Sequence, shared_down: Sequence
) -> mx.array:
    """Down GEMVs, routing weights, shared expert and combine: ``y [N, D]``.

    ``y[n] = sum_j scores[n, j] * bf16(h[n*k + j] Wd[inds[n, j]]^T)
    + sgate[n] * bf16(h[N*k + n] Wd_shared^T)``, fp32 sums in a fixed order,
    stored as bfloat16.

    Args:
        h, sgate: from :func:`gate_up_swiglu` on the same ``inds``.
        inds: ``[N, k]`` int32/uint32; scores: ``[N, k]`` float32.
        down: ``(weight uint32 [E, D, I/8], scales, biases bf16 [E, D, I/64])``.
        shared_down: ``(weight uint32 [D, I/8], scales, biases bf16 [D, I/64])``.

    Raises:
        ValueError: a shape/dtype the kernel does not take (named).
    """
    if not isinstance(inds, mx.array) or inds.ndim != 2 or inds.dtype not in (mx.int32, mx.uint32):
        raise ValueError(f"down_combine: inds must be int32/uint32 [N, k], got {_describe(inds)}")
    n, k = inds.shape
    if not 1 <= n <= MAX_TOKENS or n * k > 32:
        raise ValueError(f"down_combine: need 1 <= N <= {MAX_TOKENS} and N*k <= 32, got N={n}, k={k}")
    if not isinstance(h, mx.array) or h.ndim != 2 or h.dtype != mx.bfloat16 or h.shape[0] != n * k + n or h.shape[1] % 128:
        raise ValueError(f"down_combine: h must be bfloat16 [N*k + N = {n * k + n}, I] with I % 128 == 0, "
                         f"got {_describe(h)}")
    I = h.shape[1]
    if not isinstance(scores, mx.array) or tuple(scores.shape) != (n, k) or scores.dtype != mx.float32:
        raise ValueError(f"down_combine: scores must be float32 [{n}, {k}], got {_describe(scores)}")
    if not isinstance(sgate, mx.array) or tuple(sgate.shape) != (n,) or sgate.dtype != mx.float32:
        raise ValueError(f"down_combine: sgate must be float32 [{n}], got {_describe(sgate)}")
    try:
        E, D = down[0].shape[0], down[0].shape[1]
    except (TypeError, IndexError, AttributeError):
        raise ValueError("down_combine: down must be (weight, scales, biases)") from None
    if D % 256 or not is_4bit_group64(down, (E,), D, I):
        raise ValueError(f"down_combine: down must be 4-bit group-64 uint32 [E, D, {I // 8}] with D % 256 == 0, "
                         f"bf16 scales/biases [E, D, {I // 64}], got {[(a.dtype, tuple(a.shape)) for a in down]}")
    if not is_4bit_group64(shared_down, (), D, I):
        raise ValueError(f"down_combine: shared_down must be uint32 [{D}, {I // 8}] + bf16 [{D}, {I // 64}] x2")
    if smem_bytes(n, k, I) > SMEM_LIMIT:
        raise ValueError(f"down_combine: (N*k + N) * I too large (N={n}, k={k}, I={I})")
    check_expert_ids("down_combine", inds, E)
    return _launch_down(h, inds, scores, sgate, down, shared_down)


def _launch_down(h, inds, scores, sgate, down, shared_down, residual=None):
    """:func:`down_combine` on arguments already checked; y is shaped
    ``inds.shape[:-1] + (D,)`` (``[N, D]`` for ``[N, k]`` inds);
    ``residual`` (bf16, y's shape) is added (``residual + bf16(y)``)."""
    k = inds.shape[-1]
    n = inds.size // k
    D, I = down[0].shape[1], h.shape[1]
    kern = _kernel("down", n, k, D, I, residual=residual is not None)
    nt = 32 * down_warps(n, k, I)
    (y,) = kern(
        inputs=[h, inds, scores, sgate, *down, *shared_down] + ([] if residual is None else [residual]),
        output_shapes=[(*inds.shape[:-1], D)],
        output_dtypes=[mx.bfloat16],
        grid=((D // RB) * nt, 1, 1),
        threadgroup=(nt, 1, 1),
    )
    return y


def moe_decode_arrays(
    x: mx.array, inds: mx.array, scores: mx.array, experts: Sequence, shared: Sequence, expert_gate: Sequence,
) -> mx.array:
    """The MoE block's output for routed ``(inds, scores)``: ``[N, D]`` bfloat16.

    ``sum_j scores[n, j] * expert_{inds[n, j]}(x[n])
    + sigmoid(shared_gate(x[n])) * shared_expert(x[n])``: two launches
    (:func:`gate_up_swiglu`, :func:`down_combine`). Arguments as those,
    shapes and ids checked (one host synchronisation);
    :func:`moe_decode_arrays_unchecked` is the unchecked entry point of the compiled
    decode step, whose shapes were checked by :func:`supports_arrays` and
    whose ids come from the routing kernel.

    Raises:
        ValueError: a shape/dtype the kernels do not take, or an id out of range (named).
    """
    _check("moe_decode_arrays", _shape_problem(x, inds, scores, experts, shared, expert_gate))
    check_expert_ids("moe_decode_arrays", inds, experts[0][0].shape[0])
    return moe_decode_arrays_unchecked(x, inds, scores, experts, shared, expert_gate)


def moe_decode_arrays_unchecked(x, inds, scores, experts, shared, expert_gate, residual=None):
    """:func:`moe_decode_arrays` without the checks. ``x`` may be ``[..., D]``
    with ``inds [..., k]`` (read as ``[N, D]``, ``[N, k]``); y is shaped
    ``inds.shape[:-1] + (D,)``. ``residual`` (bf16, y's shape: the decoder
    layer's ``h``): returns ``residual + bf16(y)`` from the down kernel."""
    h, sgate = _launch_gate_up(x, inds, experts, shared, expert_gate)
    return _launch_down(h, inds, scores, sgate, experts[2], shared[2], residual)


def moe_decode_logits(
    x: mx.array, logits: mx.array, top_k: int, experts: Sequence, shared: Sequence, expert_gate: Sequence,
    *, normalize: bool = True,
) -> mx.array:
    """The MoE block's output from the router's logits: ``[N, D]`` bfloat16.

    Two launches (:func:`route_gate_up_swiglu`, which routes, then
    :func:`down_combine` on its ids and weights); the result is that of
    :func:`mlx_qwen_fast.kernels.moe_routing.route` followed by
    :func:`moe_decode_arrays` (three launches), bit for bit. Arguments as
    :func:`route_gate_up_swiglu`; no host synchronisation (the ids come
    from the kernel). :func:`moe_decode_logits_unchecked` is the unchecked entry
    point of the compiled decode step.

    Raises:
        ValueError: a shape/dtype the kernels do not take, ``top_k`` out of
            range, or logits whose E is not the experts' (named).
    """
    _check("moe_decode_logits", _route_problem(x, logits, top_k, experts, shared, expert_gate))
    return moe_decode_logits_unchecked(x, logits, int(top_k), normalize, experts, shared, expert_gate)


def moe_decode_logits_unchecked(x, logits, top_k, normalize, experts, shared, expert_gate, residual=None):
    """:func:`moe_decode_logits` without the checks. ``x`` may be ``[..., D]``
    with ``logits [..., E]`` (read as ``[N, D]``, ``[N, E]``); y is shaped
    ``logits.shape[:-1] + (D,)``. ``residual`` as :func:`moe_decode_arrays_unchecked`."""
    h, sgate, inds, scores = _launch_route_gate_up(x, logits, top_k, normalize, experts, shared, expert_gate)
    return _launch_down(h, inds, scores, sgate, experts[2], shared[2], residual)
