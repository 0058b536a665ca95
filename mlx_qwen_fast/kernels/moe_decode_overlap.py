"""Decode MoE experts in one launch, the down weights streaming under gate + up.

Fuses the two kernels of :mod:`.moe_decode_gemv` (:func:`~.moe_decode_gemv.gate_up_swiglu`
and :func:`~.moe_decode_gemv.down_combine`) into one grid (source
``mlx_qwen_fast/cuda/moe_decode_overlap.cu``): the CTAs are those of the
first kernel; the first D/16 of them fetch their down rows into L2 as soon as
they know the routing, run their gate+up tile, wait on a counter for every
tile's ``h`` (no grid barrier: the other CTAs never wait) and then compute
the down rows from L2. One launch gap and the down weights' DRAM time leave
the chain. Same tile arithmetic and summation order as the two kernels:
equal bits.

Where: one token's worth of items (``N*k + 1`` of them, each 16 rows x I/2
bytes per down CTA) must fit the down CTA's shared memory with three CTAs per
SM (:func:`problem`); the model's shape (N = 1, k = 8, D = 2048, I = 512)
takes 60,480 bytes. Larger calls keep the two kernels.

The counter lives in the block's barrier buffer (:func:`.moe_decode_fused.new_sync`,
words 32-33, zero between launches: the last down CTA resets them).
"""

from __future__ import annotations

import os
from typing import Dict, Optional, Sequence

import mlx.core as mx

from . import _cuda_build as cb
from . import moe_decode_gemv as md

__all__ = ["moe_decode_overlap", "smem_bytes", "problem", "enabled", "OVERLAP_ENV"]

#: ``MLX_QWEN_FAST_MOE_DECODE_OVERLAP=0`` keeps the two launches of
#: :mod:`.moe_decode_gemv` in the patched model's decode step.
OVERLAP_ENV = "MLX_QWEN_FAST_MOE_DECODE_OVERLAP"
NT, RB = 256, 16
SMEM_3_PER_SM = 75 * 1024  # three CTAs per SM (228 KB per SM, 1 KB reserved per CTA)
_kernels: Dict[tuple, cb.CudaKernel] = {}


def smem_bytes(n: int, k: int, D: int, I: int) -> int:
    """Dynamic shared memory of the kernel (bytes), as ``SMEM`` in the source:
    the larger of the gate+up tile's (:func:`.moe_decode_gemv.gate_up_smem_bytes`)
    and the down CTA's (items' rows padded to ``I/2 + 64`` bytes, scales and
    biases, h, each item's output)."""
    items = n * k + 1
    dn = items * RB * (I // 2 + 64) + items * 2 * RB * (I // 64) * 2 + (n * k + n) * I * 2 + items * RB * n * 4
    return max(dn, md.gate_up_smem_bytes(n))


def problem(n: int, k: int, D: int, I: int) -> Optional[str]:
    """None when the kernel runs this call shape, else why not (one line).

    Needs N*k < 32, D % 256 == 0, I % 128 == 0, D/16 <= (I/16) (N*k + 2)
    (the first D/16 of the gate+up CTAs compute the down rows), shared memory
    for three CTAs per SM, fewer than D/16 SMs (the deadlock-freedom argument
    of the source), and a CUDA GPU of compute capability 9.0+ (its L2 bulk
    prefetch).
    """
    if not (1 <= n <= md.MAX_TOKENS and 1 <= k and n * k < 32):
        return f"N*k must be < 32 with 1 <= N <= {md.MAX_TOKENS}, got N={n}, k={k}"
    if D % 256 or I % 128:
        return f"D % 256 == 0 and I % 128 == 0 needed, got D={D}, I={I}"
    if D // RB > (I // RB) * (n * k + 2):
        return f"D/16 = {D // RB} down row blocks > the {(I // RB) * (n * k + 2)} gate+up CTAs"
    if smem_bytes(n, k, D, I) > SMEM_3_PER_SM:
        return f"{smem_bytes(n, k, D, I)} bytes of shared memory per CTA (> {SMEM_3_PER_SM}: fewer than 3 CTAs/SM)"
    try:
        if not cb.cuda_available() or cb.gpu_arch() < (9, 0):
            return "needs a CUDA GPU of compute capability 9.0 or newer"
        if D // RB >= cb.sm_count():
            return f"D/16 = {D // RB} down CTAs must be fewer than the {cb.sm_count()} SMs"
    except RuntimeError as exc:
        return str(exc)
    return None


def enabled() -> bool:
    """False when the environment sets ``MLX_QWEN_FAST_MOE_DECODE_OVERLAP=0``."""
    return os.environ.get(OVERLAP_ENV, "1") != "0"


def _kernel(n: int, k: int, D: int, I: int, sgb: int, timing: bool = False) -> cb.CudaKernel:
    key = (n, k, D, I, sgb, timing)
    kern = _kernels.get(key)
    if kern is None:
        defs = dict(MDG_N=n, MDG_K=k, MDG_D=D, MDG_I=I, MDG_SGB=sgb)
        if timing:
            defs["MDG_TIMING"] = 1
        kern = _kernels[key] = cb.CudaKernel("moe_decode_overlap.cu", "mqf_moe_dec_overlap", defs)
    return kern


def moe_decode_overlap(
    x: mx.array, inds: mx.array, scores: mx.array, experts: Sequence, shared: Sequence,
    expert_gate: Sequence, sync: mx.array,
) -> mx.array:
    """The MoE block's output for routed ``(inds, scores)`` in one launch: ``[N, D]`` bfloat16.

    Same contract and bits as :func:`.moe_decode_gemv.moe_decode_arrays`
    (arguments as there), plus ``sync``: the block's barrier buffer
    (:func:`.moe_decode_fused.new_sync`, ``uint32 [64]``, zero words 32-33
    between launches; never run two launches on one buffer at once).

    Raises:
        ValueError: a shape/dtype the kernels do not take, a call shape this
            kernel does not run (:func:`problem`), or a bad ``sync`` (named).
    """
    md._check("moe_decode_overlap", md._shape_problem(x, inds, scores, experts, shared, expert_gate))
    D, k = x.shape[-1], inds.shape[-1]
    n, I = x.size // D, experts[0][0].shape[1]
    why = problem(n, k, D, I)
    if why is not None:
        raise ValueError(f"moe_decode_overlap: {why}")
    if not isinstance(sync, mx.array) or sync.dtype != mx.uint32 or sync.size < 64:
        raise ValueError(f"moe_decode_overlap: sync must be uint32 [64] (new_sync()), got "
                         f"{getattr(sync, 'dtype', type(sync))} {tuple(getattr(sync, 'shape', ()))}")
    return _launch(x, inds, scores, experts, shared, expert_gate, sync)[0]


def _launch(x, inds, scores, experts, shared, expert_gate, sync, timing: bool = False):
    """The kernel on checked arguments: ``(y [N, D], h, sgate)`` (h, sgate: its workspaces)."""
    D = x.shape[-1]
    k = inds.shape[-1]
    n = x.size // D
    (wg, sg, bg), (wu, su, bu), (wd, sd, bd) = experts
    (xwg, xsg, xbg), (xwu, xsu, xbu), (xwd, xsd, xbd) = shared
    gw, gs, gb, bits = expert_gate
    I = wg.shape[1]
    ctas = (I // RB) * (n * k + 2)
    kern = _kernel(n, k, D, I, int(bits), timing)
    outs = kern(
        inputs=[x, inds, scores, wg, sg, bg, wu, su, bu, wd, sd, bd, xwg, xsg, xbg, xwu, xsu, xbu,
                xwd, xsd, xbd, gw, gs, gb, sync],
        output_shapes=[(n * k + n, I), (n,), (*inds.shape[:-1], D)] + ([(ctas * 8,)] if timing else []),
        output_dtypes=[mx.bfloat16, mx.float32, mx.bfloat16] + ([mx.uint64] if timing else []),
        grid=(ctas * NT, 1, 1),
        threadgroup=(NT, 1, 1),
        shared_memory=smem_bytes(n, k, D, I),
    )
    return (outs[2], outs[0], outs[1]) + tuple(outs[3:])
