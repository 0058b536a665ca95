"""Fused decode MoE (N <= 4 tokens) on CUDA: two launches per layer.

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
``mx.dequantize``); :func:`reference` is the fp32 host reference (weights
``s * q + b`` in fp32, bf16 roundings where mlx-lm rounds).

Numerics against the stock block (bf16): the routing weights and the combine
stay fp32 (stock rounds probabilities, weighted outputs and the sum to bf16),
the shared gate's sigmoid is not rounded, selection uses fp32 probabilities
(:func:`mlx_qwen_fast.kernels.moe_routing.route`).

Status: compiled with nvcc 13.0 for sm_90a (no spills: gate+up 79-80
registers, 3 CTAs/SM, 40-52 KB of dynamic shared memory; down 150-164
registers). On the H200 (2026-12-03, CUDA graph of 64 layers over 40 layers'
weights, kernels alone): 13.4 us per layer at N = 1 (gate+up 7.3, down 5.9;
35% of the 3,382 GB/s copy rate), down from 14.8 (the gate+up weights staged
through cp.async, computed in two halves, one down warp per item at one token); a
kernel that only reads the same bytes the same way takes 6.0 us in one
launch and 8.1 us as two (bench/cuda/decode_read_floor.cu). N = 4: 32.4 us
(2026-12-01, before these changes). tests/test_cuda_moe_decode.py passes.
The patched model runs them by default on CUDA through
:func:`moe_decode_step` (``MLX_QWEN_FAST_MOE_DECODE_KERNEL=0`` keeps stock;
``MLX_QWEN_FAST_MOE_DECODE_FUSED=1`` takes :mod:`.moe_decode_fused` instead;
bench/results/moe-cuda-log.md). The down kernel keeps one mma chain per
128-input block, adds them in block order, and sums the items' weighted
outputs in slot order (the one-launch kernel does the same: both give the
same bits).
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from . import _cuda_build as cb
from .moe_grouped_gemm import bf16_round  # host reference rounding, shared

__all__ = [
    "moe_decode",
    "moe_decode_step",
    "moe_decode_arrays",
    "gate_up_swiglu",
    "down_combine",
    "supports",
    "plan",
    "supports_arrays",
    "block_arrays",
    "reference",
    "MAX_TOKENS",
]

MAX_TOKENS = 4
NT = 256  # threads per CTA
RB = 16  # weight rows per CTA
SMEM_LIMIT = 46 * 1024  # static shared memory of the down kernel
_kernels: Dict[tuple, cb.CudaKernel] = {}

Q3 = Tuple[mx.array, mx.array, mx.array]  # (weight uint32, scales bf16, biases bf16)


# ---------------------------------------------------------------------------
# shape checks (pure, CPU-callable)
# ---------------------------------------------------------------------------


def _q_ok(q, lead: Tuple[int, ...], O: int, K: int) -> bool:
    """4-bit group-64 arrays of ``lead + (O, K)`` with bf16 scales/biases."""
    try:
        w, s, b = q
        return (
            w.dtype == mx.uint32 and s.dtype == mx.bfloat16 and b.dtype == mx.bfloat16
            and tuple(w.shape) == (*lead, O, K // 8)
            and tuple(s.shape) == (*lead, O, K // 64) and tuple(b.shape) == tuple(s.shape)
        )
    except (TypeError, ValueError, AttributeError):
        return False


def _gate_bits(expert_gate, D: int) -> int:
    """Bits of the shared-expert gate arrays (4, 8, 16 = bf16), 0 if unusable."""
    try:
        w, s, b, bits = expert_gate
        if bits == 16:
            return 16 if (w.dtype == mx.bfloat16 and tuple(w.shape) == (1, D)) else 0
        if bits in (4, 8) and w.dtype == mx.uint32 and tuple(w.shape) == (1, D * bits // 32):
            ok = (s.dtype == mx.bfloat16 and b.dtype == mx.bfloat16
                  and tuple(s.shape) == (1, D // 64) and tuple(b.shape) == (1, D // 64))
            return bits if ok else 0
    except (TypeError, ValueError, AttributeError):
        pass
    return 0


def down_warps(n: int, k: int, I: int) -> int:
    """Warps per CTA of the down kernel for ``n`` tokens, top-``k``, expert width ``I``.

    One warp per item (``n*k`` pair slots + the shared expert) at one token
    when that is at most 12 warps and ``I <= 768`` (the kernel then needs at
    most 168 registers, so one CTA per SM still fits without spills; nvcc
    13.0 spills at I = 1024 with 9 warps), so no warp computes two items in
    series (k = 8: 9 warps, measured 6.5 -> 5.9 us per layer,
    bench/results/moe-cuda-log.md, 2026-12-03); 8 otherwise.
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


def _shape_problem(x, inds, scores, experts, shared, expert_gate, down_smem: bool = True) -> Optional[str]:
    """None when the arrays fit the kernels, else what is wrong (one line).
    ``down_smem=False`` skips the down kernel's shared-memory limit (for
    callers that do not run it)."""
    if not isinstance(x, mx.array) or x.ndim != 2 or x.dtype != mx.bfloat16:
        return f"x must be bfloat16 [N, D], got {getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}"
    n, D = x.shape
    if not 1 <= n <= MAX_TOKENS:
        return f"x must have 1..{MAX_TOKENS} tokens, got N={n}"
    if not isinstance(inds, mx.array) or inds.ndim != 2 or inds.shape[0] != n or inds.dtype not in (mx.int32, mx.uint32):
        return f"inds must be int32/uint32 [N={n}, k], got {getattr(inds, 'dtype', None)} {tuple(getattr(inds, 'shape', ()))}"
    k = inds.shape[1]
    if not 1 <= k or n * k > 32:
        return f"N*k must be in [1, 32], got N={n}, k={k}"
    if scores is not None and (
        not isinstance(scores, mx.array) or tuple(scores.shape) != (n, k) or scores.dtype != mx.float32
    ):
        return f"scores must be float32 [{n}, {k}], got {getattr(scores, 'dtype', None)} {tuple(getattr(scores, 'shape', ()))}"
    if D % 256:
        return f"D must be a multiple of 256, got D={D}"
    try:
        gate, up, down = experts
        E, I = gate[0].shape[0], gate[0].shape[1]
    except (TypeError, ValueError, AttributeError, IndexError):
        return "experts must be (gate, up, down), each (weight, scales, biases)"
    if I % 128:
        return f"expert intermediate size I must be a multiple of 128, got I={I}"
    if not (_q_ok(gate, (E,), I, D) and _q_ok(up, (E,), I, D)):
        return f"experts gate/up must be 4-bit group-64 (uint32 [E, {I}, {D // 8}], bf16 [E, {I}, {D // 64}] x2)"
    if not _q_ok(down, (E,), D, I):
        return f"experts down must be 4-bit group-64 (uint32 [E, {D}, {I // 8}], bf16 [E, {D}, {I // 64}] x2)"
    try:
        sg, su, sd = shared
    except (TypeError, ValueError):
        return "shared must be (gate, up, down), each (weight, scales, biases)"
    if not (_q_ok(sg, (), I, D) and _q_ok(su, (), I, D) and _q_ok(sd, (), D, I)):
        return (f"shared expert must be 4-bit group-64 with the experts' sizes "
                f"(gate/up uint32 [{I}, {D // 8}], down uint32 [{D}, {I // 8}], bf16 scales/biases)")
    if not _gate_bits(expert_gate, D):
        return f"expert_gate must be (weight, scales, biases, bits): bits 4/8 group 64 uint32 [1, D*bits/32], or bits 16 with bf16 weight [1, {D}]"
    if down_smem and smem_bytes(n, k, I) > SMEM_LIMIT:
        return f"(N*k + N) * I too large for the down kernel's shared memory (N={n}, k={k}, I={I})"
    return None


def supports_arrays(x, inds, experts, shared, expert_gate, scores=None) -> bool:
    """Shape/dtype check of :func:`moe_decode_arrays` without the backend check."""
    return _shape_problem(x, inds, scores, experts, shared, expert_gate) is None


def _qlinear_ok(m, bits=(4,)) -> bool:
    return (
        type(m).__name__ in ("QuantizedLinear", "QuantizedSwitchLinear")
        and getattr(m, "bits", None) in bits and getattr(m, "group_size", None) == 64
        and getattr(m, "mode", "affine") in ("affine", None)
        and "biases" in m and "bias" not in m
        and m["scales"].dtype == mx.bfloat16
    )


def block_arrays(block):
    """``(experts, shared, expert_gate)`` of a ``Qwen3NextSparseMoeBlock``.

    Returns the tuples :func:`moe_decode_arrays` takes, or None when a module
    is not quantised the way the kernels need (routed and shared experts
    4-bit group 64 affine with bf16 scales; shared gate 4/8-bit group 64 or a
    bias-free bf16 ``nn.Linear``).
    """
    try:
        sm, se, sgm = block.switch_mlp, block.shared_expert, block.shared_expert_gate
        mods = (sm.gate_proj, sm.up_proj, sm.down_proj, se.gate_proj, se.up_proj, se.down_proj)
    except AttributeError:
        return None
    if not all(_qlinear_ok(m) for m in mods):
        return None
    q = lambda m: (m["weight"], m["scales"], m["biases"])  # noqa: E731
    if _qlinear_ok(sgm, bits=(4, 8)):
        eg = (sgm["weight"], sgm["scales"], sgm["biases"], sgm.bits)
    elif type(sgm).__name__ == "Linear" and "bias" not in sgm and sgm["weight"].dtype == mx.bfloat16:
        w = sgm["weight"]
        eg = (w, w, w, 16)
    else:
        return None
    return tuple(q(m) for m in mods[:3]), tuple(q(m) for m in mods[3:]), eg


def supports(block, x) -> bool:
    """True when :func:`moe_decode` can run ``block`` on ``x``. Never compiles.

    Needs MLX's CUDA backend, an unsharded ``Qwen3NextSparseMoeBlock`` whose
    experts and shared expert are 4-bit group-64 affine with bf16 scales (shared
    gate 4/8-bit or bf16), ``x [..., D]`` bf16 with 1..4 tokens, ``N*k <= 32``,
    ``D % 256 == 0``, ``I % 128 == 0``, the shared expert's size equal to the
    experts', and E a multiple of 32 (<= 1024) for the routing kernel.
    """
    return plan(block, x) is not None


def plan(block, x) -> Optional[tuple]:
    """The arrays :func:`moe_decode` runs ``block`` on ``x`` with
    (:func:`block_arrays`, shapes checked), or None where :func:`supports`
    is False. Never compiles."""
    if not cb.cuda_available():
        return None
    return _plan_shapes(block, x)


def _supports_shapes(block, x) -> bool:
    """:func:`supports` without the backend check (CPU-testable)."""
    return _plan_shapes(block, x) is not None


def _plan_shapes(block, x) -> Optional[tuple]:
    try:
        if getattr(block, "sharding_group", None) is not None:
            return None
        if not isinstance(x, mx.array) or x.ndim < 1 or x.dtype != mx.bfloat16:
            return None
        n = math.prod(x.shape[:-1])
        if not 1 <= n <= MAX_TOKENS:
            return None
        E, k = block.num_experts, block.top_k
        if E % 32 or E > 1024 or not 1 <= k <= min(32, E):
            return None
        arrs = block_arrays(block)
        if arrs is None:
            return None
        tok = mx.zeros((n, x.shape[-1]), mx.bfloat16)  # shape only, never evaluated
        inds = mx.zeros((n, k), mx.int32)
        return arrs if supports_arrays(tok, inds, *arrs) else None
    except (AttributeError, TypeError, ValueError):
        return None


# ---------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------


def _kernel(kind: int, n: int, k: int, D: int, I: int, sgb: int = 8, yt: str = "bf16_t") -> cb.CudaKernel:
    key = (kind, n, k, D, I, sgb, yt)
    kern = _kernels.get(key)
    if kern is None:
        defs = dict(MDG_KIND=kind, MDG_N=n, MDG_K=k, MDG_D=D, MDG_I=I)
        if kind == 0:
            defs["MDG_SGB"] = sgb
        else:
            defs["MDG_YT"] = yt
            defs["MDG_DNW"] = down_warps(n, k, I)
        kern = cb.CudaKernel(
            "moe_decode_gemv.cu", "mqf_moe_dec_gate_up" if kind == 0 else "mqf_moe_dec_down", defs
        )
        _kernels[key] = kern
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
        inds: ``[N, k]`` int32/uint32 expert ids in ``[0, E)`` (out of range:
            undefined behaviour, as ``gather_qmm``), N*k <= 32.
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
    return _launch_gate_up(x, inds, experts, shared, expert_gate)


def _launch_gate_up(x, inds, experts, shared, expert_gate):
    """:func:`gate_up_swiglu` on arguments already checked (x ``[..., D]``,
    inds ``[..., k]``: the kernel reads them as ``[N, D]``, ``[N, k]``)."""
    D = x.shape[-1]
    n, k = x.size // D, inds.shape[-1]
    (wg, sg, bg), (wu, su, bu), _ = experts
    I = wg.shape[1]
    (xwg, xsg, xbg), (xwu, xsu, xbu), _ = shared
    gw, gs, gb, bits = expert_gate
    nk = n * k
    kern = _kernel(0, n, k, D, I, int(bits))
    h, sgate = kern(
        inputs=[x, inds, wg, sg, bg, wu, su, bu, xwg, xsg, xbg, xwu, xsu, xbu, gw, gs, gb],
        output_shapes=[(nk + n, I), (n,)],
        output_dtypes=[mx.bfloat16, mx.float32],
        grid=((I // RB) * NT, nk + 2, 1),
        threadgroup=(NT, 1, 1),
        shared_memory=gate_up_smem_bytes(n),
    )
    return h, sgate


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
        raise ValueError(f"down_combine: inds must be int32/uint32 [N, k], got {getattr(inds, 'shape', None)}")
    n, k = inds.shape
    if not 1 <= n <= MAX_TOKENS or n * k > 32:
        raise ValueError(f"down_combine: need 1 <= N <= {MAX_TOKENS} and N*k <= 32, got N={n}, k={k}")
    if not isinstance(h, mx.array) or h.ndim != 2 or h.dtype != mx.bfloat16 or h.shape[0] != n * k + n or h.shape[1] % 128:
        raise ValueError(f"down_combine: h must be bfloat16 [N*k + N = {n * k + n}, I] with I % 128 == 0, "
                         f"got {getattr(h, 'dtype', None)} {tuple(getattr(h, 'shape', ()))}")
    I = h.shape[1]
    if not isinstance(scores, mx.array) or tuple(scores.shape) != (n, k) or scores.dtype != mx.float32:
        raise ValueError(f"down_combine: scores must be float32 [{n}, {k}], got {getattr(scores, 'dtype', None)} "
                         f"{tuple(getattr(scores, 'shape', ()))}")
    if not isinstance(sgate, mx.array) or tuple(sgate.shape) != (n,) or sgate.dtype != mx.float32:
        raise ValueError(f"down_combine: sgate must be float32 [{n}], got {tuple(getattr(sgate, 'shape', ()))}")
    try:
        E, D = down[0].shape[0], down[0].shape[1]
    except (TypeError, IndexError, AttributeError):
        raise ValueError("down_combine: down must be (weight, scales, biases)") from None
    if D % 256 or not _q_ok(down, (E,), D, I):
        raise ValueError(f"down_combine: down must be 4-bit group-64 uint32 [E, D, {I // 8}] with D % 256 == 0, "
                         f"bf16 scales/biases [E, D, {I // 64}], got {[(a.dtype, tuple(a.shape)) for a in down]}")
    if not _q_ok(shared_down, (), D, I):
        raise ValueError(f"down_combine: shared_down must be uint32 [{D}, {I // 8}] + bf16 [{D}, {I // 64}] x2")
    if smem_bytes(n, k, I) > SMEM_LIMIT:
        raise ValueError(f"down_combine: (N*k + N) * I too large (N={n}, k={k}, I={I})")
    return _launch_down(h, inds, scores, sgate, down, shared_down)


def _launch_down(h, inds, scores, sgate, down, shared_down):
    """:func:`down_combine` on arguments already checked; y is shaped
    ``inds.shape[:-1] + (D,)`` (``[N, D]`` for ``[N, k]`` inds)."""
    k = inds.shape[-1]
    n = inds.size // k
    D, I = down[0].shape[1], h.shape[1]
    kern = _kernel(1, n, k, D, I)
    nt = 32 * down_warps(n, k, I)
    (y,) = kern(
        inputs=[h, inds, scores, sgate, *down, *shared_down],
        output_shapes=[(*inds.shape[:-1], D)],
        output_dtypes=[mx.bfloat16],
        grid=((D // RB) * nt, 1, 1),
        threadgroup=(nt, 1, 1),
    )
    return y


def moe_decode_arrays(
    x: mx.array, inds: mx.array, scores: mx.array, experts: Sequence, shared: Sequence, expert_gate: Sequence
) -> mx.array:
    """The MoE block's output for routed ``(inds, scores)``: ``[N, D]`` bfloat16.

    ``sum_j scores[n, j] * expert_{inds[n, j]}(x[n])
    + sigmoid(shared_gate(x[n])) * shared_expert(x[n])``: two launches
    (:func:`gate_up_swiglu`, :func:`down_combine`). Arguments as those.

    Raises:
        ValueError: a shape/dtype the kernels do not take (named).
    """
    _check("moe_decode_arrays", _shape_problem(x, inds, scores, experts, shared, expert_gate))
    return _launch_both(x, inds, scores, experts, shared, expert_gate)


def _launch_both(x, inds, scores, experts, shared, expert_gate):
    h, sgate = _launch_gate_up(x, inds, experts, shared, expert_gate)
    return _launch_down(h, inds, scores, sgate, experts[2], shared[2])


def moe_decode(block, x: mx.array, arrays: Optional[tuple] = None) -> mx.array:
    """``Qwen3NextSparseMoeBlock(x)`` for 1..4 tokens: router, routing kernel, two MoE kernels.

    Four graph nodes: ``block.gate`` (quantised matmul), the routing kernel
    (:func:`mlx_qwen_fast.kernels.moe_routing.route`: fp32 softmax, top-k,
    renormalised as ``block.norm_topk_prob``), :func:`gate_up_swiglu`,
    :func:`down_combine`. Call only where :func:`supports` is True.
    :func:`moe_decode_step` is the same computation traced once with
    ``mx.compile`` (what the patched model runs).

    Args:
        block: a quantised ``Qwen3NextSparseMoeBlock`` (see :func:`supports`).
        x: ``[..., D]`` bfloat16, 1..4 tokens.
        arrays: ``plan(block, x)`` when the caller has it (the checks then
            are not repeated); None: planned here.

    Returns:
        ``[..., D]`` bfloat16.

    Raises:
        ValueError: the block's modules are not quantised as the kernels need,
            or ``x`` does not fit.
    """
    from . import moe_routing as mr

    arrs = plan(block, x) if arrays is None else arrays
    if arrs is None:
        raise ValueError("moe_decode: the block's modules or x do not fit the kernels (see supports)")
    lead, d = x.shape[:-1], x.shape[-1]
    tokens = x.reshape(-1, d)
    inds, scores = mr.route(block.gate(tokens), block.top_k, normalize=block.norm_topk_prob)
    return _launch_both(tokens, inds, scores, *arrs).reshape(*lead, d)


_CHILDREN = ("gate", "shared_expert_gate", "switch_mlp", "shared_expert")
_EXPERT_PATHS = tuple((parent, proj, leaf) for parent in ("switch_mlp", "shared_expert")
                      for proj in ("gate_proj", "up_proj", "down_proj")
                      for leaf in ("weight", "scales", "biases"))


def _step_plan(block, x):
    """``(paths, (compiled step, fused))`` of ``block`` for inputs like ``x``
    (see :class:`mlx_qwen_fast.compiled.StepPlans`); ``(children, None)``
    where :func:`plan` declines. Path order = the compiled step's array order:
    router, routed experts gate/up/down, shared expert gate/up/down (weight,
    scales, biases each), shared-expert gate (weight, scales, biases).
    ``fused``: the step is :func:`.moe_decode_fused.moe_decode_fused` (one
    launch; the caller appends the block's barrier buffer), chosen where the
    router is 4/8-bit group 64, the GPU is compute capability 9.0+ and
    ``MLX_QWEN_FAST_MOE_DECODE_FUSED=1``; else
    router matmul, routing kernel and the two kernels here (the default)."""
    from ..compiled import linear_arrays, linear_paths
    from . import moe_decode_fused as mf

    declined = [(c,) for c in _CHILDREN if c in block], None
    router = linear_arrays(block.gate) if "gate" in block else None
    arrs = plan(block, x)
    if router is None or arrs is None:
        return declined
    bits = arrs[2][3]
    gate = (("shared_expert_gate", "weight"),) * 3 if bits == 16 else tuple(
        ("shared_expert_gate", n) for n in ("weight", "scales", "biases"))
    rq = mf.router_arrays(block.gate)
    if (rq is not None and mf.fused_enabled() and mf.supported_gpu()
            and mf.router_problem(x, rq, *arrs, block.top_k) is None):
        paths = tuple(("gate", n) for n in ("weight", "scales", "biases")) + _EXPERT_PATHS + gate
        return paths, (_compiled_fused_step(block.top_k, block.norm_topk_prob, bits, cb.sm_count()), True)
    paths = linear_paths(("gate",), router) + _EXPERT_PATHS + gate
    return paths, (_compiled_step(block.top_k, block.norm_topk_prob, router[1], len(router[0]), bits), False)


_steps: Dict[tuple, object] = {}


def _compiled_step(top_k: int, normalize: bool, router_static: tuple, n_router: int, gate_bits: int):
    """The ``mx.compile``d decode step for one static setting (shared by all layers)."""
    key = (top_k, bool(normalize), router_static, n_router, gate_bits)
    fn = _steps.get(key)
    if fn is None:
        from ..compiled import apply_linear
        from . import moe_routing as mr

        def step(x, *arrays):
            logits = apply_linear(x, arrays[:n_router], router_static)
            inds, scores = mr.route(logits, top_k, normalize=normalize)
            a = arrays[n_router:]
            experts, shared = (a[0:3], a[3:6], a[6:9]), (a[9:12], a[12:15], a[15:18])
            return _launch_both(x, inds, scores, experts, shared, (a[18], a[19], a[20], gate_bits))

        fn = _steps[key] = mx.compile(step)
    return fn


def _compiled_fused_step(top_k: int, normalize: bool, gate_bits: int, ctas: int):
    """The ``mx.compile``d one-launch step (:mod:`.moe_decode_fused`) for one static setting."""
    key = ("fused", top_k, bool(normalize), gate_bits, ctas)
    fn = _steps.get(key)
    if fn is None:
        from . import moe_decode_fused as mf

        def step(x, *a):
            experts, shared = (a[3:6], a[6:9], a[9:12]), (a[12:15], a[15:18], a[18:21])
            return mf._launch(x, a[0:3], experts, shared, (a[21], a[22], a[23], gate_bits), top_k,
                              normalize, a[24], ctas)[0]

        fn = _steps[key] = mx.compile(step)
    return fn


def block_sync(block) -> mx.array:
    """The block's own barrier buffer for the one-launch step (created on first use)."""
    sync = block.__dict__.get("_mqf_moe_sync")
    if sync is None:
        from . import moe_decode_fused as mf

        sync = mf.new_sync()
        object.__setattr__(block, "_mqf_moe_sync", sync)
    return sync


def moe_decode_step(block, x: mx.array) -> Optional[mx.array]:
    """The block's decode step traced once with ``mx.compile``, or None where it does not apply.

    By default the computation of :func:`moe_decode` (same kernels, bit for
    bit); with ``MLX_QWEN_FAST_MOE_DECODE_FUSED=1`` one launch
    (:func:`.moe_decode_fused.moe_decode_fused`) where the router is 4/8-bit
    group 64. The block's arrays are inputs of the compiled function, so one trace
    per token count serves every layer. The :func:`plan` checks run once per
    layer and input signature (cached on the block, re-run when one of its
    arrays is replaced), so a call costs the array lookups and the compiled
    call.

    Args:
        block: a ``Qwen3NextSparseMoeBlock``.
        x: ``[..., D]``, 1..4 tokens.

    Returns:
        ``[..., D]`` bfloat16, or None when :func:`supports` is False (the
        caller runs another implementation).
    """
    from ..compiled import StepPlans
    from . import moe_decode_fused as mf

    key = (tuple(x.shape), x.dtype, mf.fused_enabled())
    arrays, p = StepPlans.of(block).get(key, block, lambda: _step_plan(block, x))
    if p is None:
        return None
    fn, fused = p
    if fused:
        return fn(x, *arrays, block_sync(block))
    return fn(x, *arrays)  # [..., D] in and out: the kernels need no reshape node


# ---------------------------------------------------------------------------
# host reference (numpy fp32)
# ---------------------------------------------------------------------------


def _np(a) -> np.ndarray:
    if isinstance(a, mx.array):
        return np.asarray(a.astype(mx.float32) if a.dtype in (mx.bfloat16, mx.float16) else a)
    return np.asarray(a)


def dequant_f32(w, s, b, bits: int = 4, group_size: int = 64) -> np.ndarray:
    """``s * q + b`` in fp32 (no bf16 rounding) from packed affine arrays."""
    w = _np(w).astype(np.uint32)
    per = 32 // bits
    shifts = bits * np.arange(per, dtype=np.uint32)
    q = (w[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    q = q.reshape(*w.shape[:-1], w.shape[-1] * per).astype(np.float32)
    s = np.repeat(_np(s).astype(np.float32), group_size, axis=-1)
    b = np.repeat(_np(b).astype(np.float32), group_size, axis=-1)
    return s * q + b


def _silu(v):
    return v / (1.0 + np.exp(-v))


def reference(x, inds, scores, experts, shared, expert_gate):
    """fp32 host reference of :func:`moe_decode_arrays` (numpy).

    Weights ``s * q + b`` in fp32; bf16 rounding where mlx-lm rounds: the
    gate and up outputs, ``silu(g) * u``, each expert's (and the shared
    expert's) down output, the shared gate's logit; routing weights, sigmoid
    and the sums in fp32.

    Returns:
        ``(h [N*k + N, I], sgate [N], y [N, D])`` float32 numpy arrays (y not
        rounded; the kernel stores ``bf16(y)``).
    """
    xf = _np(x).astype(np.float32)
    ii = _np(inds).astype(np.int64)
    sc = _np(scores).astype(np.float32)
    n, k = ii.shape
    (wg, sg, bg), (wu, su, bu), (wd, sd, bd) = experts
    cache = {}

    def mats(e):
        if e not in cache:
            if e < 0:
                (a, b_, c), (d_, f, g_), (h_, i_, j_) = shared
                cache[e] = (dequant_f32(a, b_, c), dequant_f32(d_, f, g_), dequant_f32(h_, i_, j_))
            else:
                cache[e] = (dequant_f32(wg[e], sg[e], bg[e]), dequant_f32(wu[e], su[e], bu[e]),
                            dequant_f32(wd[e], sd[e], bd[e]))
        return cache[e]

    I = wg.shape[1]
    h = np.zeros((n * k + n, I), np.float32)
    outs = np.zeros((n * k + n, xf.shape[1]), np.float32)
    for row in range(n * k + n):
        tok, e = (row // k, int(ii[row // k, row % k])) if row < n * k else (row - n * k, -1)
        g_, u_, d_ = mats(e)
        gt = bf16_round(g_ @ xf[tok])
        up = bf16_round(u_ @ xf[tok])
        h[row] = bf16_round(_silu(gt) * up)
        outs[row] = bf16_round(d_ @ h[row])
    gw, gs, gb, bits = expert_gate
    wgate = _np(gw).astype(np.float32) if bits == 16 else dequant_f32(gw, gs, gb, bits=bits)
    logit = bf16_round((wgate @ xf.T)[0])
    sgate = (1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    y = np.zeros_like(xf)
    for tok in range(n):
        for j in range(k):
            y[tok] += sc[tok, j] * outs[tok * k + j]
        y[tok] += sgate[tok] * outs[n * k + tok]
    return h, sgate, y
