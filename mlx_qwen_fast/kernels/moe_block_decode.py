"""A MoE block's whole decode step on CUDA, in one launch.

Computes, for 1 to 4 token rows ``x`` (mlx-lm's ``DecoderLayer`` around
``Qwen3NextSparseMoeBlock.__call__`` at one token per row)::

    xn     = rms_norm(x, norm_weight, norm_eps)
    logits = xn @ W_router.T                                   # [N, E]
    ids, w = top-k of softmax(logits) (renormalised with ``normalize``)
    out    = x + sum_j w_j * expert_{ids_j}(xn) + sigmoid(xn . w_gate) * shared_expert(xn)

what three launches compute in the compiled decode step today
(``quantized_gemv`` with the norm and ``normed_out``,
``moe_decode_gemv.route_gate_up_swiglu``, ``moe_decode_gemv`` down with the
residual): one graph node instead of three. Each phase runs those kernels'
device code in their arithmetic order, so the output equals the three
launches' bit for bit (bf16 activations only, as those kernels take).

The kernel is persistent: ``min(SM count, work)`` blocks of 512 threads
(:func:`grid_blocks`), all resident at once, meeting at two grid barriers
on a slot of the kernel's module (``grid_sync.cuh``: each running launch
claims one by its grid id; zero when the module loads, never reset), so no
output needs filling before a launch; the
logits, the experts' SwiGLU rows and the shared gate pass between phases
through a scratch output. The shared expert's gate+up work (independent of
the routing) runs beside the router, on the blocks the router leaves idle;
every block then routes the tokens itself from the logits, and the selected
experts' gate+up work follows (at Qwen3.6-35B-A3B's shapes and one token: 256
items, one round of 128 blocks' two teams). One block fills an SM. Launches
that MLX runs at once (graphs that do not depend on each other, evaluated
together) keep apart on their own barrier slots; a grid that cannot be
resident traps (a CUDA error) rather than hang. Source:
``mlx_qwen_fast/cuda/moe_block_decode.cu``.
"""

from __future__ import annotations

import numbers
from typing import Dict, Optional, Sequence

import mlx.core as mx

from . import _checks
from . import _cuda_build as cb
from . import moe_decode_gemv as md

__all__ = ["MAX_ROWS", "checked_arguments", "grid_blocks", "moe_block_decode", "moe_block_decode_unchecked", "scratch_words", "smem_bytes", "supports"]

#: Token rows per call at most.
MAX_ROWS = md.MAX_TOKENS
_THREADS = 512
_MAX_BLOCKS = 1024  # the source's barrier weight (BARW)
#: The router quantisations the kernel reads (affine, with biases): bits and group sizes.
ROUTER_BITS = (4, 8)
ROUTER_GROUPS = (32, 64, 128)
_NORM_DTYPES = (mx.bfloat16, mx.float16, mx.float32)
#: Shared memory of one block on sm_90 (static + dynamic).
_SMEM_LIMIT = 227 * 1024
_kernels: Dict[tuple, cb.CudaKernel] = {}
_ARRAYS = (("x", "[..., D] bfloat16", False), ("norm_weight", "[D] (float)", False),
           ("router[0] (weight)", "[E, D * bits / 32] uint32", False),
           ("router[1] (scales)", "[E, D / group_size] bfloat16", False),
           ("router[2] (biases)", "[E, D / group_size] bfloat16", False))


def _round16(n: int) -> int:
    return -(-n // 16) * 16


def _rows(x) -> int:
    n = 1
    for s in x.shape[:-1]:
        n *= s
    return n


def router_warps(D: int, bits: int) -> int:
    """Warps per router tile (``quantized_gemv.warps``)."""
    per = 512 if bits == 4 else 256
    return max(1, min(16, -(-D // per)))


def grid_blocks(n: int, k: int, E: int, D: int, I: int, router_bits: int, sm_count: int) -> int:
    """Blocks of the launch: the most that any phase can use (phase A: the
    blocks holding router tiles -- E/16 tiles over each block's teams --
    then the shared expert's I/16 gate+up tiles and its gate over two teams
    per block; phase B: the routed gate+up items, distinct experts x I/16
    tiles, over two teams per block; phase C: down tiles D/16), at most
    ``sm_count`` (every block resident) and the barrier weight."""
    tiles_r = -(-E // 16)
    router_blocks = -(-tiles_r // (16 // router_warps(D, router_bits)))
    shared_items = I // 16 + 1
    routed_items = (I // 16) * min(n * k, E)
    work = max(router_blocks + -(-shared_items // 2), -(-routed_items // 2), D // 16)
    return max(1, min(work, sm_count, _MAX_BLOCKS))


def scratch_words(n: int, k: int, E: int, I: int) -> int:
    """uint32 words of the scratch output: logits [n, E] bf16, h [n*k + n,
    I] bf16, sgate [n] float32, each 16-byte aligned."""
    return (_round16(n * E * 2) + _round16((n * k + n) * I * 2) + _round16(n * 4)) // 4


def smem_bytes(n: int, k: int, I: int) -> int:
    """Dynamic shared memory of the launch (``DSM`` of the source): two
    gate+up teams' staging (2 x (36864 + 4096 n)) or the down phase's h rows
    and item outputs, the larger."""
    gate_up = 2 * md.gate_up_smem_bytes(n)
    down = _round16((n * k + n) * I * 2) + (n * k + 1) * 16 * n * 4
    return max(gate_up, down)


def _static_smem(n: int, D: int) -> int:
    return n * D * 2 + 16 * 32 * 4 * 4 + 16 * n * 4 + 2 * 4 * 32


def _is_int(v) -> bool:
    """An integer that builds a kernel (the build's macros and cache key):
    not a bool, a float or an array that compares equal to one."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _router_problem(x, norm_weight, router, group_size, bits, E) -> Optional[str]:
    if not _is_int(bits) or bits not in ROUTER_BITS:
        return f"router_bits must be one of {ROUTER_BITS}, got {bits!r}"
    if not _is_int(group_size) or group_size not in ROUTER_GROUPS:
        return f"router_group_size must be one of {ROUTER_GROUPS}, got {group_size!r}"
    D = x.shape[-1]
    if norm_weight.dtype not in _NORM_DTYPES or tuple(norm_weight.shape) != (D,):
        return f"norm_weight must be a float array of shape [{D}], got {norm_weight.dtype} {tuple(norm_weight.shape)}"
    if D % group_size:
        return f"x's last axis ({D}) must be a multiple of router_group_size ({group_size})"
    w, s, b = router
    if w.dtype != mx.uint32 or tuple(w.shape) != (E, D * bits // 32):
        return f"router[0] (weight) must be uint32 [{E}, {D * bits // 32}], got {w.dtype} {tuple(w.shape)}"
    for part, a in (("1] (scales)", s), ("2] (biases)", b)):
        if a.dtype != mx.bfloat16 or tuple(a.shape) != (E, D // group_size):
            return f"router[{part} must be bfloat16 [{E}, {D // group_size}], got {a.dtype} {tuple(a.shape)}"
    return None


def _problem(x, norm_weight, router, experts, shared, expert_gate, top_k, group_size, bits) -> Optional[str]:
    """None when the kernel takes these (array) arguments, else what does not fit."""
    if x.dtype != mx.bfloat16 or x.ndim < 2:
        return f"x must be bfloat16 [..., D] with 1 to {MAX_ROWS} rows, got {x.dtype} {tuple(x.shape)}"
    n, D = _rows(x), x.shape[-1]
    if not 1 <= n <= MAX_ROWS:
        return f"x must hold 1 to {MAX_ROWS} rows (the product of its leading axes), got {tuple(x.shape)}"
    if n * D * 2 > 32768:
        return f"x's rows * D * 2 must be at most 32768, got {tuple(x.shape)}"
    try:
        E = experts[0][0].shape[0]
    except (TypeError, IndexError, AttributeError, KeyError):
        return "experts must be (gate, up, down), each (weight, scales, biases)"
    if not md.route_fits(E, top_k):
        return (f"top_k ({top_k!r}) and the experts' count ({E}) must fit the in-kernel routing: E a multiple of 32 "
                f"in [32, {md.ROUTE_MAX_EXPERTS}], 1 <= top_k <= min(32, E)")
    if n * top_k > 32:
        return f"rows * top_k must be at most 32, got {n} rows, top_k {top_k}"
    problem = md.weights_problem(n, D, int(top_k), experts, shared, expert_gate, down_smem=False)
    if problem is not None:
        return problem
    problem = _router_problem(x, norm_weight, router, group_size, bits, E)
    if problem is not None:
        return problem
    I = experts[0][0].shape[1]
    if smem_bytes(n, int(top_k), I) + _static_smem(n, D) > _SMEM_LIMIT:
        return f"(rows * top_k + rows) * I too large for one block's shared memory (rows {n}, top_k {top_k}, I {I})"
    return None


def supports(x, norm_weight, router: Sequence, experts: Sequence, shared: Sequence, expert_gate: Sequence, *,
             top_k: int, router_group_size: int = 64, router_bits: int = 8) -> bool:
    """True when :func:`moe_block_decode` takes these arrays on this
    machine: the CUDA backend and the shapes of its docstring. Shape checks
    only (nothing is evaluated or compiled)."""
    if not cb.cuda_available():
        return False
    try:
        if not (_checks.is_array(x) and _checks.is_array(norm_weight) and len(router) == 3
                and all(_checks.is_array(a) for a in router)):
            return False
        return _problem(x, norm_weight, router, experts, shared, expert_gate, top_k, router_group_size,
                        router_bits) is None
    except (TypeError, ValueError, AttributeError, KeyError):
        return False


def _kernel(n, k, E, D, I, sgb, rbits, rgs, norm_dtype, phase_clock=False) -> cb.CudaKernel:
    key = (n, k, E, D, I, sgb, rbits, rgs, norm_dtype, phase_clock)
    kern = _kernels.get(key)
    if kern is None:
        defines = dict(MBD_N=n, MBD_K=k, MBD_E=E, MBD_D=D, MBD_I=I, MBD_SGB=sgb, MBD_RBITS=rbits, MBD_RGS=rgs,
                       MBD_WT=cb.dtype_macro(norm_dtype))
        if phase_clock:
            defines["MQF_PHASE_CLOCK"] = 1
        kern = _kernels[key] = cb.CudaKernel("moe_block_decode.cu", "mqf_moe_block", defines)
    return kern


#: Phase marks of the diagnostic build (``moe_block_decode_unchecked(..., phase_clock=True)``),
#: in order: cycles from the block's start to phase A's end (the block's
#: router tiles, or its shared-expert gate+up item), the first grid
#: barrier's end, the routing's end, phase B's end (the routed experts'
#: gate+up items, and the shared items phase A had no block for), the
#: second barrier's end, the down phase's end (C).
PHASE_MARKS = ("start", "A done", "barrier 1", "routed", "B done", "barrier 2", "end")
_PC_SLOTS = 8  # phase_clock.cuh


def checked_arguments(fn: str, x, norm_weight, router, experts, shared, expert_gate, top_k, norm_eps,
                      router_group_size, router_bits) -> float:
    """:func:`moe_block_decode`'s argument checks (ValueError naming the
    argument, ``fn: `` first); returns ``norm_eps`` as a float."""
    if not isinstance(router, (tuple, list)) or len(router) != 3:
        raise ValueError(f"{fn}: router must be (weight, scales, biases), got {_checks.describe(router)}")
    _checks.check_arrays(fn, _ARRAYS, x, norm_weight, *router)
    problem = _problem(x, norm_weight, router, experts, shared, expert_gate, top_k, router_group_size,
                       router_bits)
    if problem is not None:
        raise ValueError(f"{fn}: {problem}")
    return _checks.check_eps(fn, "norm_eps", norm_eps)


def moe_block_decode(
    x: mx.array,
    norm_weight: mx.array,
    router: Sequence[mx.array],
    experts: Sequence,
    shared: Sequence,
    expert_gate: Sequence,
    *,
    top_k: int,
    norm_eps: float,
    normalize: bool = True,
    router_group_size: int = 64,
    router_bits: int = 8,
    after: Optional[mx.array] = None,
) -> mx.array:
    """``x + block(rms_norm(x))`` of a quantised Qwen3-Next MoE block for one
    token per row, in one launch.

    Args:
      x: ``[..., D]`` bfloat16, 1 to 4 rows (the product of the leading
        axes), D a multiple of 256 with rows * D * 2 <= 32768.
      norm_weight: ``[D]`` (bfloat16, float16 or float32): the decoder
        layer's post-attention RMSNorm weight.
      router: ``(weight uint32 [E, D * bits / 32], scales, biases bfloat16
        [E, D / group_size])``: ``mx.quantize`` (affine) of the router
        (``block.gate``).
      experts, shared, expert_gate: as
        :func:`mlx_qwen_fast.kernels.moe_decode_gemv.gate_up_swiglu` (4-bit
        group-64 experts ``[E, I, D / 8]`` ..., the shared expert of the same
        width I, the shared-expert gate 4/8-bit or bf16).
      top_k: experts per token; E a multiple of 32 in ``[32, 512]``, ``1 <=
        top_k <= min(32, E)``, rows * top_k <= 32.
      norm_eps: the RMSNorm's eps, in (0, 1).
      normalize: divide the k probabilities by their sum (``norm_topk_prob``).
      router_group_size, router_bits: the router's quantisation (32/64/128,
        4/8).
      after: any array, never read: the launch runs after whatever wrote it
        (MLX orders a launch after the writers of its inputs). Launches of
        this kernel that nothing orders may run at once, each on a barrier
        slot of its own (the source's launch contract); pass an output of
        the launch that should come first to keep two in order. None: no
        such input.

    Returns:
      x's shape, bfloat16: ``quantized_gemv`` (norm, router) then
      ``moe_decode_gemv.moe_decode_logits_unchecked`` with x as the residual, bit for
      bit.

    Raises:
      ValueError: an argument outside the above (named).
      RuntimeError: no CUDA compiler could build the kernel.
    """
    fn = "moe_block_decode"
    eps = checked_arguments(fn, x, norm_weight, router, experts, shared, expert_gate, top_k, norm_eps,
                            router_group_size, router_bits)
    if after is not None and not _checks.is_array(after):
        raise ValueError(f"{fn}: after must be an mx.array or None, got {_checks.describe(after)}")
    return moe_block_decode_unchecked(x, norm_weight, router, experts, shared, expert_gate, int(top_k), eps,
                             bool(normalize), router_group_size, router_bits, after=after)


def moe_block_decode_unchecked(x, norm_weight, router, experts, shared, expert_gate, top_k, eps, normalize,
                      router_group_size, router_bits, return_scratch=False, phase_clock=False, after=None):
    """:func:`moe_block_decode` on arguments already checked (the compiled
    decode step's entry point); ``return_scratch``: also the scratch output
    (tests read the phases' intermediates from it); ``phase_clock``: the
    diagnostic build (``cuda/phase_clock.cuh``), returning ``(out, clocks
    int64 [blocks, 8])``: each block's SM cycles from mark 0 at the
    :data:`PHASE_MARKS` (-1 past them), for bench/profile_kernels.py phases;
    ``after``: as :func:`moe_block_decode`'s (None: x)."""
    n, D = _rows(x), x.shape[-1]
    (wg, sg, bg), (wu, su, bu), (wd, sd, bd) = experts
    E, I = wg.shape[0], wg.shape[1]
    (xwg, xsg, xbg), (xwu, xsu, xbu), (xwd, xsd, xbd) = shared
    gw, gs, gb, sgb = expert_gate
    kern = _kernel(n, top_k, E, D, I, int(sgb), router_bits, router_group_size, norm_weight.dtype, phase_clock)
    blocks = grid_blocks(n, top_k, E, D, I, router_bits, cb.sm_count())
    words = scratch_words(n, top_k, E, I)
    out, scratch = kern(
        inputs=[x, norm_weight, *router, wg, sg, bg, wu, su, bu, wd, sd, bd, xwg, xsg, xbg, xwu, xsu, xbu,
                xwd, xsd, xbd, gw, gs, gb, x if after is None else after],
        output_shapes=[tuple(x.shape), (words + (blocks * _PC_SLOTS * 2 if phase_clock else 0),)],
        output_dtypes=[mx.bfloat16, mx.uint32],
        grid=(blocks * _THREADS, 1, 1),
        threadgroup=(_THREADS, 1, 1),
        shared_memory=smem_bytes(n, top_k, I),
        scalars=[int(normalize), eps],
    )
    if phase_clock:
        return out, scratch[words:].view(mx.int64).reshape(blocks, _PC_SLOTS)
    return (out, scratch) if return_scratch else out
