"""The whole decode MoE block (1..4 tokens) in one CUDA launch.

Fuses, for decode-sized calls of ``Qwen3NextSparseMoeBlock``, the router's
quantised matmul, the routing (fp32 softmax, top-k, renormalisation), the gate
and up GEMVs with SwiGLU of the selected experts and of the shared expert, the
shared expert's sigmoid gate, the down GEMVs, the routing weights and the
combine: one graph node instead of four (router, routing kernel and the two
kernels of :mod:`.moe_decode_gemv`), and the expert weights stream from memory
as soon as the routing is known instead of after two kernel boundaries.

Source ``mlx_qwen_fast/cuda/moe_decode_fused.cu``: a persistent grid of one
CTA per SM with two grid-wide barriers (router logits -> every CTA routes and
computes its gate+up tiles -> down and combine). The expert weights stream by
TMA bulk copies into shared-memory rings (gate+up tiles of 36 KB, down items
of 4.5 KB), requested as soon as the routing is known. The barriers need
every CTA resident at once, so the grid is at most the GPU's SM count
(:func:`mlx_qwen_fast.kernels._cuda_build.sm_count`); a CTA that waits about
a second traps (the launch fails instead of hanging). The barrier state is a
persistent ``uint32 [64]`` buffer (:func:`new_sync`) holding a 64-bit arrival
counter; concurrent launches must not share one (the patched model keeps one
per MoE block).

Numerics: the gate+up and down tiles are those of :mod:`.moe_decode_gemv`
(same dequantisation, roundings and summation order): given the same
``inds`` and ``scores``, ``h`` and ``y`` are bit-identical. The router logits
are fp32 dot products of ``x`` with ``s * q + b`` rounded to bf16 (the
router's bf16 quantised matmul), and the selection is the routing kernel's
own code (:func:`.moe_routing.route` on these logits gives the same ``inds``
and ``scores``).

Status (2026-12-02, H200): correct (tests/test_cuda_moe_decode_fused.py, all
N, grids of 1..132 CTAs); nvcc 13.0 sm_90a, 0 spills, 84 / 154 registers at
N = 1 / 4, 162-194 KB of dynamic shared memory. 18.5 us per layer at one
token in a CUDA graph (router included; the two kernels of
:mod:`.moe_decode_gemv` take 15.5 us without the router and the routing
kernel), 41.7 us at four tokens; through MLX as host-bound as the four-node
step. So it is opt-in (``MLX_QWEN_FAST_MOE_DECODE_FUSED=1``). Phase times and
the next steps: bench/results/moe-cuda-log.md ("seventh session").
"""

from __future__ import annotations

import os
from typing import Dict, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from . import _cuda_build as cb
from . import moe_decode_gemv as md

__all__ = [
    "moe_decode_fused",
    "new_sync",
    "router_arrays",
    "router_problem",
    "reference",
    "smem_bytes",
    "FUSED_ENV",
]

NT = 256  # threads per CTA
#: ``MLX_QWEN_FAST_MOE_DECODE_FUSED=1`` makes the patched model's decode step
#: this one launch; unset (the default) keeps the four-node step (router
#: matmul, routing kernel, the two kernels of :mod:`.moe_decode_gemv`). Not
#: the default: on the H200 (2026-12-02) the one launch takes 18.5 us per layer
#: at one token in a CUDA graph, about what the four nodes take, and through
#: MLX the step is host-bound at the same ~100 us per call
#: (bench/results/moe-cuda-log.md, "seventh session").
FUSED_ENV = "MLX_QWEN_FAST_MOE_DECODE_FUSED"
_kernels: Dict[tuple, cb.CudaKernel] = {}
_default_sync: Optional[mx.array] = None


SYNC_WORDS = 64  # 256 bytes: MLX keeps allocations of <= 8 bytes in managed memory


BARW = 1024  # barrier counter units per barrier (the kernel's BARW; >= the grid)
GU_SLOTS, DN_SLOTS = 3, 9  # shared-memory slots: gate+up tiles, down items (passed as MDG_GU_SLOTS / MDG_DN_SLOTS)
SMEM_MAX = 227 * 1024  # dynamic shared memory one CTA may use on sm_90


def new_sync() -> mx.array:
    """A fresh barrier buffer for :func:`moe_decode_fused`: ``uint32 [64]`` zeros, evaluated.

    Words 0-1 hold a 64-bit arrival counter that grows by ``2 * BARW`` per
    launch. 256 bytes, not 8: MLX's CUDA allocator serves allocations of at
    most 8 bytes from a managed-memory pool, where the barrier's atomics took
    ~0.4 ms each (H200, 2026-12-02).
    """
    s = mx.zeros((SYNC_WORDS,), mx.uint32)
    mx.eval(s)
    return s


def router_arrays(module) -> Optional[Tuple[mx.array, mx.array, mx.array]]:
    """``(weight, scales, biases)`` of a router the kernel reads, else None.

    The kernel takes ``nn.QuantizedLinear`` routers, affine 4- or 8-bit,
    group 64, bf16 scales and biases, no bias (the mlx-community Qwen3.5/3.6
    checkpoints quantise the router to 8 bits).
    """
    if not (
        type(module).__name__ == "QuantizedLinear"
        and getattr(module, "bits", None) in (4, 8) and getattr(module, "group_size", None) == 64
        and getattr(module, "mode", "affine") in ("affine", None)
        and "biases" in module and "bias" not in module
        and module["scales"].dtype == mx.bfloat16
    ):
        return None
    return module["weight"], module["scales"], module["biases"]


def _router_bits(router, D: int) -> int:
    """4 or 8 when ``router`` is ``(uint32 [E, D*bits/32], bf16 [E, D/64] x2)``, else 0."""
    try:
        w, s, b = router
        E = w.shape[0]
        if w.dtype != mx.uint32 or w.ndim != 2 or s.dtype != mx.bfloat16 or b.dtype != mx.bfloat16:
            return 0
        if tuple(s.shape) != (E, D // 64) or tuple(b.shape) != (E, D // 64):
            return 0
        return next((bits for bits in (4, 8) if w.shape[1] * 32 == D * bits), 0)
    except (TypeError, ValueError, AttributeError):
        return 0


def router_problem(x, router, experts, shared, expert_gate, top_k) -> Optional[str]:
    """None when :func:`moe_decode_fused` takes these arrays, else what is wrong (one line)."""
    if not isinstance(x, mx.array) or x.dtype != mx.bfloat16 or x.ndim < 1:
        return (f"x must be bfloat16 [..., D], got {getattr(x, 'dtype', type(x))} "
                f"{tuple(getattr(x, 'shape', ()))}")
    D = x.shape[-1]
    n = x.size // D if D else 0
    if not 1 <= n <= md.MAX_TOKENS:
        return f"x must hold 1..{md.MAX_TOKENS} tokens, got {n} (shape {tuple(x.shape)})"
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        return f"top_k must be a positive int, got {top_k!r}"
    try:
        d_experts = experts[0][0].shape[-1] * 8
    except (TypeError, IndexError, AttributeError):
        d_experts = None
    if d_experts is not None and d_experts != D:
        return f"x's last axis D={D} does not match the experts' input size D={d_experts}"
    tok = mx.zeros((n, D), mx.bfloat16)  # shapes only, never evaluated
    inds = mx.zeros((n, top_k), mx.int32)
    problem = md._shape_problem(tok, inds, None, experts, shared, expert_gate, down_smem=False)
    if problem is not None:
        return problem
    if not _router_bits(router, D):
        return (f"router must be (weight uint32 [E, D*bits/32], scales, biases bf16 [E, {D // 64}]) "
                f"with bits 4 or 8, group 64")
    E = router[0].shape[0]
    if E % 32 or E > 1024 or E != experts[0][0].shape[0]:
        return f"the router's E must equal the experts' and be a multiple of 32 <= 1024, got {E}"
    if top_k > E:
        return f"top_k must be <= E = {E}, got {top_k}"
    I = experts[0][0].shape[1]
    if smem_bytes(n, top_k, D, I) > SMEM_MAX:
        return (f"D, I or (N*k + N) * I too large for the kernel's shared memory "
                f"({smem_bytes(n, top_k, D, I)} > {SMEM_MAX} bytes; N={n}, k={top_k}, D={D}, I={I})")
    return None


def smem_bytes(n: int, k: int, D: int, I: int) -> int:
    """Dynamic shared memory of the kernel (bytes) for N = ``n`` tokens, top-``k``,
    sizes D and I: its layout, computed as the source does (the kernel traps
    when launched with less).

    Raises:
        ValueError: a size that is not a positive int.
    """
    for name, v in (("n", n), ("k", k), ("D", D), ("I", I)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"smem_bytes: {name} must be a positive int, got {v!r}")
    rb, nw = 16, 8
    gu_slot = 2 * rb * (D // 8) * 4 + 4 * rb * (D // 64) * 2
    dn_slot = rb * (I // 8) * 4 + 2 * rb * (I // 64) * 2
    ds = min(DN_SLOTS, n * k + 1)
    off_bar = GU_SLOTS * gu_slot + ds * dn_slot
    off_sm = -(-(off_bar + 8 * (GU_SLOTS + ds)) // 128) * 128
    nk = n * k
    sm = 2 * max(n * D, (nk + n) * I) + 4 * (nw * 2 * rb * n + (nk + 1) * rb * n + nk + nk + nk + 1 + 1)
    return off_sm + sm


def _kernel(n, k, E, D, I, rbits, sgb, normalize) -> cb.CudaKernel:
    key = (n, k, E, D, I, rbits, sgb, bool(normalize))
    kern = _kernels.get(key)
    if kern is None:
        defs = dict(MDG_N=n, MDG_K=k, MDG_E=E, MDG_D=D, MDG_I=I, MDG_RBITS=rbits, MDG_SGB=sgb,
                    MDG_NORM=int(bool(normalize)), MDG_GU_SLOTS=GU_SLOTS, MDG_DN_SLOTS=DN_SLOTS)
        kern = _kernels[key] = cb.CudaKernel("moe_decode_fused.cu", "mqf_moe_dec_fused", defs)
    return kern


def moe_decode_fused(
    x: mx.array,
    router: Sequence[mx.array],
    experts: Sequence,
    shared: Sequence,
    expert_gate: Sequence,
    top_k: int,
    normalize: bool = True,
    *,
    sync: Optional[mx.array] = None,
    ctas: Optional[int] = None,
    return_all: bool = False,
):
    """The decode MoE block's output in one launch: ``[..., D]`` bfloat16.

    ``y[n] = sum_j scores[n, j] * expert_{inds[n, j]}(x[n])
    + sigmoid(bf16(x[n] . w_gate)) * shared_expert(x[n])``, with
    ``(inds, scores)`` = top-``top_k`` of ``softmax(bf16(x[n] W_router^T))``
    (fp32; ties to the lower expert id; renormalised over the k when
    ``normalize``).

    Args:
        x: ``[..., D]`` bfloat16, 1..4 tokens, D % 256 == 0.
        router: ``(weight uint32 [E, D*bits/32], scales, biases bf16 [E, D/64])``,
            bits 4 or 8, group 64 (:func:`router_arrays`).
        experts, shared, expert_gate: as :func:`.moe_decode_gemv.gate_up_swiglu`
            (routed experts ``[E, I, D/8]`` ..., 4-bit group 64).
        top_k: experts per token (N * top_k <= 32).
        normalize: renormalise the k probabilities (``norm_topk_prob``).
        sync: the barrier buffer (:func:`new_sync`); default one module-wide
            buffer (fine while launches run one after another on one stream).
        ctas: grid size; default the SM count. Must not exceed it (the
            barriers need every CTA resident; more traps after ~1 s) nor 1024.
        return_all: also return the router logits ``[N, E]`` float32 (bf16
            values), ``inds [N, k]`` int32, ``scores [N, k]`` float32 and
            the intermediates ``h [N*k + N, I]`` bfloat16 (row ``n*k + j`` of
            pair (n, j), row ``N*k + n`` the shared expert's) and
            ``sgate [N]`` float32, as :func:`.moe_decode_gemv.gate_up_swiglu`.

    Returns:
        ``y`` shaped like ``x``, or ``(y, logits, inds, scores, h, sgate)``.

    Raises:
        ValueError: a shape/dtype the kernel does not take (named), or
            ``ctas`` outside ``[1, SM count]``.
        RuntimeError: no CUDA GPU of compute capability 9.0 or newer.
    """
    problem = router_problem(x, router, experts, shared, expert_gate, top_k)
    if problem is not None:
        raise ValueError(f"moe_decode_fused: {problem}")
    if sync is not None and (
        not isinstance(sync, mx.array) or sync.dtype != mx.uint32 or tuple(sync.shape) != (SYNC_WORDS,)
    ):
        raise ValueError(f"moe_decode_fused: sync must be the uint32 [{SYNC_WORDS}] buffer of new_sync(), got "
                         f"{getattr(sync, 'dtype', type(sync))} {tuple(getattr(sync, 'shape', ()))}")
    if ctas is not None and (isinstance(ctas, bool) or not isinstance(ctas, int) or ctas < 1):
        raise ValueError(f"moe_decode_fused: ctas must be a positive int (at most the SM count), got {ctas!r}")
    if not supported_gpu():
        raise RuntimeError("moe_decode_fused: needs an NVIDIA GPU of compute capability 9.0 or newer "
                           "(TMA bulk copies, ~190 KB of shared memory per CTA)")
    sms = min(cb.sm_count(), BARW)
    if ctas is not None and ctas > sms:
        raise ValueError(f"moe_decode_fused: ctas must be at most {sms} (the SM count), got {ctas}")
    if sync is None:
        global _default_sync
        if _default_sync is None:
            _default_sync = new_sync()
        sync = _default_sync
    out = _launch(x, router, experts, shared, expert_gate, top_k, normalize, sync, ctas or sms)
    return out if return_all else out[0]


def _launch(x, router, experts, shared, expert_gate, top_k, normalize, sync, ctas):
    """:func:`moe_decode_fused` on checked arguments; returns ``(y, logits, inds, scores, h, sgate)``."""
    D = x.shape[-1]
    n = x.size // D
    E, I = router[0].shape[0], experts[0][0].shape[1]
    gw, gs, gb, bits = expert_gate
    kern = _kernel(n, top_k, E, D, I, _router_bits(router, D), int(bits), normalize)
    nk = n * top_k
    return kern(
        inputs=[x, *router, *(a for m in experts for a in m), *(a for m in shared for a in m), gw, gs, gb, sync],
        output_shapes=[x.shape, (n, E), (n, top_k), (n, top_k), (nk + n, I), (n,)],
        output_dtypes=[mx.bfloat16, mx.float32, mx.int32, mx.float32, mx.bfloat16, mx.float32],
        grid=(ctas * NT, 1, 1),
        threadgroup=(NT, 1, 1),
        shared_memory=smem_bytes(n, top_k, D, I),
    )


def supported_gpu() -> bool:
    """True on a CUDA GPU of compute capability 9.0 or newer (the kernel's TMA
    copies and shared-memory size); False without one."""
    try:
        return cb.cuda_available() and cb.gpu_arch() >= (9, 0)
    except RuntimeError:
        return False


def fused_enabled() -> bool:
    """True when the environment sets ``MLX_QWEN_FAST_MOE_DECODE_FUSED=1`` (opt-in)."""
    return os.environ.get(FUSED_ENV, "") == "1"


# ---------------------------------------------------------------------------
# host reference (numpy fp32)
# ---------------------------------------------------------------------------


def reference(x, router, top_k, normalize, experts, shared, expert_gate):
    """fp32 host reference of :func:`moe_decode_fused` (numpy).

    Router logits ``bf16(x . (s * q + b))`` (fp32 dot); fp32 softmax, top-k
    (ties to the lower id), renormalised when ``normalize``; then
    :func:`.moe_decode_gemv.reference` on that routing.

    Returns:
        ``(logits [N, E], inds [N, k], scores [N, k], y [N, D])`` numpy arrays
        (y fp32, not rounded).

    Raises:
        ValueError: a router that is not 4/8-bit group 64 over D inputs.
    """
    w, s, b = router
    D = x.shape[-1]
    xf = md._np(x).reshape(-1, D).astype(np.float32)
    bits = _router_bits(router, D)
    if not bits:
        raise ValueError(f"reference: router must be (weight uint32 [E, D*bits/32], scales, biases bf16 "
                         f"[E, {D // 64}]) with bits 4 or 8 and D={D}")
    logits = md.bf16_round(xf @ md.dequant_f32(w, s, b, bits=bits).T)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    inds = np.argsort(-p, axis=-1, kind="stable")[:, :top_k].astype(np.int32)
    sc = np.take_along_axis(p, inds, -1)
    if normalize:
        sc = sc / sc.sum(-1, keepdims=True)
    _, _, y = md.reference(xf, inds, sc.astype(np.float32), experts, shared, expert_gate)
    return logits, inds, sc.astype(np.float32), y
