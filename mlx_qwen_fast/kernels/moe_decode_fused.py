"""The whole decode MoE block (1..4 tokens) in one CUDA launch.

Fuses, for decode-sized calls of ``Qwen3NextSparseMoeBlock``, the router's
quantised matmul, the routing (fp32 softmax, top-k, renormalisation), the gate
and up GEMVs with SwiGLU of the selected experts and of the shared expert, the
shared expert's sigmoid gate, the down GEMVs, the routing weights and the
combine: one graph node instead of four (router, routing kernel and the two
kernels of :mod:`.moe_decode_gemv`), and the expert weights stream from memory
as soon as the routing is known, with no grid-wide barrier.

Source ``mlx_qwen_fast/cuda/moe_decode_fused.cu``: clusters of 8 CTAs (one per
SM). Each cluster computes the router logits itself and shares them through
distributed shared memory, so the routing is known after one cluster barrier;
meanwhile it computes its slices of the shared expert (which do not depend on
the routing). Then a cluster takes units of (selected expert, 256 rows of the
intermediate width): each CTA streams 32 gate and up rows (TMA bulk copies)
and the down block of its 256 output rows (cp.async), shares its h rows with
the cluster, and multiplies its down block by the unit's h (split-K). The
CTAs add their fp32 output rows into an accumulator with vector atomics; the
last CTA of each output slice (a counter per slice) writes ``y`` as bf16 and
leaves the accumulator and the counter at zero. That accumulator is a
persistent ``uint32 [64 + 4 * D]`` workspace (:func:`new_workspace`); launches
that may overlap must not share one (the patched model keeps one per MoE
block; launches on one stream run one after another).

Numerics: the routed experts' h rows are :mod:`.moe_decode_gemv`'s bits
(same tile arithmetic) given the same routing; the down products are summed
over split K and weighted in fp32 (no bf16 rounding of an expert's output
before its weight, unlike the two-kernel path and stock MLX), so ``y`` is
within fp32 rounding of the fp32 reference before its bf16 rounding; the order
of the atomics varies, so the last bit of ``y`` may differ between runs. The
router logits are fp32 dot products of ``x`` with ``s * q + b`` rounded to bf16
(the router's bf16 quantised matmul), and the selection is the routing
kernel's own code (:func:`.moe_routing.route` on these logits gives the same
``inds`` and ``scores``).

Status and measurements: bench/results/moe-cuda-log.md ("fourteenth session").
Opt-in (``MLX_QWEN_FAST_MOE_DECODE_FUSED=1``) until measured faster than the
four-node step.
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
    "new_workspace",
    "default_ctas",
    "router_arrays",
    "router_problem",
    "reference",
    "smem_bytes",
    "FUSED_ENV",
]

NT = 256  # threads per CTA
CLUSTER = 8  # CTAs per cluster (the kernel's __cluster_dims__)
#: ``MLX_QWEN_FAST_MOE_DECODE_FUSED=1`` makes the patched model's decode step
#: this one launch; unset (the default) keeps the four-node step (router
#: matmul, routing kernel, the two kernels of :mod:`.moe_decode_gemv`).
FUSED_ENV = "MLX_QWEN_FAST_MOE_DECODE_FUSED"
_kernels: Dict[tuple, cb.CudaKernel] = {}
_default_ws: Dict[int, mx.array] = {}

WS_ACC = 64  # the accumulator's first word in the workspace (words 0..7: the slice counters)
SMEM_MAX = 227 * 1024  # dynamic shared memory one CTA may use on sm_90


def workspace_words(d: int) -> int:
    """Words of the workspace for model width ``d``: 64 + 4 * d (counters, fp32 accumulator [4, d])."""
    return WS_ACC + md.MAX_TOKENS * d


def new_workspace(d: int) -> mx.array:
    """A fresh workspace for :func:`moe_decode_fused` at model width ``d``:
    ``uint32 [64 + 4 * d]`` zeros, evaluated.

    Words 0..7 count the CTAs done per output slice; the fp32 accumulator
    ``[N, d]`` starts at word 64. Every launch leaves it zero again.

    Raises:
        ValueError: ``d`` not a positive int.
    """
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        raise ValueError(f"new_workspace: d must be a positive int, got {d!r}")
    s = mx.zeros((workspace_words(d),), mx.uint32)
    mx.eval(s)
    return s


def default_ctas() -> int:
    """The grid the patched model launches: 8 CTAs per cluster, as many
    clusters as the SMs hold one CTA each (128 on the H200's 132 SMs)."""
    return CLUSTER * max(1, cb.sm_count() // CLUSTER)


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
    if D > 2048:
        return f"D must be at most 2048 for the kernel's shared memory, got D={D}"
    if smem_bytes(n, top_k, D, I, E, 1) > SMEM_MAX:
        return (f"the kernel's shared memory does not fit "
                f"({smem_bytes(n, top_k, D, I, E, 1)} > {SMEM_MAX} bytes; N={n}, k={top_k}, D={D}, I={I}, E={E})")
    return None


def _tile_rows(I: int) -> int:
    """Gate/up rows per CTA and unit: 32 where I % 256 == 0, else 16."""
    return 32 if I % 256 == 0 else 16


def smem_bytes(n: int, k: int, D: int, I: int, E: int, gu_slots: int = 2) -> int:
    """Dynamic shared memory of the kernel (bytes) for N = ``n`` tokens,
    top-``k``, sizes D, I, E and ``gu_slots`` gate+up slots: its layout,
    computed as the source does (the kernel traps when launched with less).

    Raises:
        ValueError: a size that is not a positive int.
    """
    for name, v in (("n", n), ("k", k), ("D", D), ("I", I), ("E", E), ("gu_slots", gu_slots)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"smem_bytes: {name} must be a positive int, got {v!r}")
    rb, nw = _tile_rows(I), 8
    ur, dr = CLUSTER * rb, D // CLUSTER
    gu_slot = 2 * rb * (D // 2 + 16) + 4 * rb * (D // 64) * 2
    dn_slot = dr * (ur // 2 + 16) + 2 * dr * (ur // 64) * 2
    off_bar = gu_slots * gu_slot + dn_slot
    off_sm = -(-(off_bar + 8 * gu_slots * (rb // 16)) // 128) * 128
    nk = n * k
    sm = (2 * n * D + 4 * n * E + 4 * n + 4 * nw * 2 * rb * n + 4 * 2 * 4 * n + 2 * 2 * n * ur
          + 2 * 2 * n * 32 + 4 * n * dr + 4 * 3 * nk + 4 + 4)
    return off_sm + sm


def _gu_slots(n, k, D, I, E) -> int:
    """Two gate+up slots where they fit in shared memory, else one."""
    return 2 if smem_bytes(n, k, D, I, E, 2) <= SMEM_MAX else 1


def _kernel(n, k, E, D, I, rbits, sgb, normalize) -> cb.CudaKernel:
    key = (n, k, E, D, I, rbits, sgb, bool(normalize))
    kern = _kernels.get(key)
    if kern is None:
        defs = dict(MDG_N=n, MDG_K=k, MDG_E=E, MDG_D=D, MDG_I=I, MDG_RBITS=rbits, MDG_SGB=sgb,
                    MDG_NORM=int(bool(normalize)), MDG_GU_SLOTS=_gu_slots(n, k, D, I, E))
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
    workspace: Optional[mx.array] = None,
    ctas: Optional[int] = None,
    return_all: bool = False,
):
    """The decode MoE block's output in one launch: ``[..., D]`` bfloat16.

    ``y[n] = sum_j scores[n, j] * expert_{inds[n, j]}(x[n])
    + sigmoid(bf16(x[n] . w_gate)) * shared_expert(x[n])``, with
    ``(inds, scores)`` = top-``top_k`` of ``softmax(bf16(x[n] W_router^T))``
    (fp32; ties to the lower expert id; renormalised over the k when
    ``normalize``); h = bf16(silu(bf16 g) * bf16 u) per expert, the down
    products and the weighted sum in fp32, one bf16 rounding at the end.

    Args:
        x: ``[..., D]`` bfloat16, 1..4 tokens, D % 256 == 0, D <= 2048.
        router: ``(weight uint32 [E, D*bits/32], scales, biases bf16 [E, D/64])``,
            bits 4 or 8, group 64 (:func:`router_arrays`).
        experts, shared, expert_gate: as :func:`.moe_decode_gemv.gate_up_swiglu`
            (routed experts ``[E, I, D/8]`` ..., 4-bit group 64; the shared
            expert of the same sizes).
        top_k: experts per token (N * top_k <= 32).
        normalize: renormalise the k probabilities (``norm_topk_prob``).
        workspace: :func:`new_workspace` ``(D)``; default one module-wide
            workspace per D (fine while launches run one after another on one
            stream).
        ctas: grid size, a positive multiple of 8 (clusters of 8 CTAs);
            default :func:`default_ctas`.
        return_all: also return the router logits ``[N, E]`` float32 (bf16
            values), ``inds [N, k]`` int32, ``scores [N, k]`` float32, the
            intermediates ``h [N*k + N, I]`` bfloat16 (row ``n*k + j`` of pair
            (n, j), row ``N*k + n`` the shared expert's) and ``sgate [N]``
            float32, as :func:`.moe_decode_gemv.gate_up_swiglu`.

    Returns:
        ``y`` shaped like ``x``, or ``(y, logits, inds, scores, h, sgate)``.

    Raises:
        ValueError: a shape/dtype the kernel does not take (named), a
            workspace that is not ``uint32 [64 + 4 * D]``, or ``ctas`` not a
            positive multiple of 8.
        RuntimeError: no CUDA GPU of compute capability 9.0 or newer.
    """
    problem = router_problem(x, router, experts, shared, expert_gate, top_k)
    if problem is not None:
        raise ValueError(f"moe_decode_fused: {problem}")
    D = x.shape[-1]
    if workspace is not None and (
        not isinstance(workspace, mx.array) or workspace.dtype != mx.uint32
        or tuple(workspace.shape) != (workspace_words(D),)
    ):
        raise ValueError(f"moe_decode_fused: workspace must be the uint32 [{workspace_words(D)}] array of "
                         f"new_workspace({D}), got {getattr(workspace, 'dtype', type(workspace))} "
                         f"{tuple(getattr(workspace, 'shape', ()))}")
    if ctas is not None and (isinstance(ctas, bool) or not isinstance(ctas, int) or ctas < CLUSTER
                             or ctas % CLUSTER):
        raise ValueError(f"moe_decode_fused: ctas must be a positive multiple of {CLUSTER} "
                         f"(clusters of {CLUSTER} CTAs), got {ctas!r}")
    if not supported_gpu():
        raise RuntimeError("moe_decode_fused: needs an NVIDIA GPU of compute capability 9.0 or newer "
                           "(thread-block clusters, TMA bulk copies, ~200 KB of shared memory per CTA)")
    if workspace is None:
        workspace = _default_ws.get(D)
        if workspace is None:
            workspace = _default_ws[D] = new_workspace(D)
    out = _launch(x, router, experts, shared, expert_gate, top_k, normalize, workspace, ctas or default_ctas())
    return out if return_all else out[0]


def _launch(x, router, experts, shared, expert_gate, top_k, normalize, workspace, ctas):
    """:func:`moe_decode_fused` on checked arguments; returns ``(y, logits, inds, scores, h, sgate)``."""
    D = x.shape[-1]
    n = x.size // D
    E, I = router[0].shape[0], experts[0][0].shape[1]
    gw, gs, gb, bits = expert_gate
    kern = _kernel(n, top_k, E, D, I, _router_bits(router, D), int(bits), normalize)
    nk = n * top_k
    return kern(
        inputs=[x, *router, *(a for m in experts for a in m), *(a for m in shared for a in m), gw, gs, gb,
                workspace],
        output_shapes=[x.shape, (n, E), (n, top_k), (n, top_k), (nk + n, I), (n,)],
        output_dtypes=[mx.bfloat16, mx.float32, mx.int32, mx.float32, mx.bfloat16, mx.float32],
        grid=(ctas * NT, 1, 1),
        threadgroup=(NT, 1, 1),
        shared_memory=smem_bytes(n, top_k, D, I, E, _gu_slots(n, top_k, D, I, E)),
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
