"""A Gated DeltaNet layer's whole mixer for one decode step on CUDA, in one
launch.

Computes, for 1 to 4 token rows ``x`` (mlx-lm's ``DecoderLayer`` around
``GatedDeltaNet.__call__`` at T = 1)::

    proj = rms_norm(x, input_norm_weight, input_norm_eps) @ W_in.T   # [qkv | z | a | b]
    y, conv_state, state = the GDN step (conv, q/k norms, gates, gated
                           delta rule, gated RMSNorm with z) on proj
    out  = x + y @ W_out.T

what three launches compute today (``quantized_gemv`` with the norm,
``gated_delta_decode``, ``quantized_gemv`` with the residual): one graph
node instead of three. W_in is the layer's four input projections
concatenated along the output axis (``compiled.concat_linears``), W_out its
``out_proj``; both affine 4-bit, group 64. For bf16 activations each phase
runs those kernels' device code in their arithmetic order, so the results
equal the three launches' bit for bit; for fp32 activations everything is
fp32 (fp32 scales and biases, dot products on the CUDA cores).

The kernel is persistent: ``min(SM count, work)`` blocks of 512 threads
(:func:`grid_blocks`), all resident at once, meeting at two grid barriers
on a slot of the kernel's module (``grid_sync.cuh``: each running launch
claims one by its grid id; zero when the module loads, never reset), so no
output needs filling before a launch; the
projection and GDN outputs pass between phases through a scratch output.
The projections' 16-row tiles go team-major over the grid (tile
``team * blocks + block``), so the tiles of a last, partial round fall one
per block before any block gets a second one.
One block fills an SM. Launches that MLX runs at once (graphs that do not
depend on each other, evaluated together) keep apart on their own barrier
slots; a grid that cannot be resident traps (a CUDA error) rather than
hang. Source: ``mlx_qwen_fast/cuda/gdn_mixer_decode.cu``.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import mlx.core as mx

from . import _checks
from . import _cuda_build as cb
from . import quantized_gemv as qg
from .gated_delta_contract import D, KW, decode_params, packed_width, params_width

__all__ = ["MAX_ROWS", "PHASE_MARKS", "checked_arguments", "gdn_mixer_decode", "grid_blocks", "mixer_params", "mixer_params_width", "scratch_words",
           "supports"]

#: Token rows per call at most (the GEMV tiles' B columns).
MAX_ROWS = 4
GROUP_SIZE = 64
BITS = 4
#: Bytes of shared memory for the staged rows of either GEMV.
_STAGE_BYTES = 32768
#: Blocks of 512 threads; the barrier weight of the source (BARW) bounds the grid.
_THREADS = 512
_MAX_BLOCKS = 1024
_FLOAT = (mx.bfloat16, mx.float32)
_kernels: Dict[tuple, cb.CudaKernel] = {}
_ARRAYS = (("x", "[B, 1, K] or [B, K] (bfloat16 / float32)", False),
           ("in_proj[0] (weight)", "[P, K / 8] uint32", False), ("in_proj[1] (scales)", "[P, K / 64]", False),
           ("in_proj[2] (biases)", "[P, K / 64]", False), ("params", "[mixer_params_width] float32", False),
           ("conv_state", f"[B, {KW - 1}, C]", True), ("state", f"[B, Hv, {D}, {D}] float32", True),
           ("out_proj[0] (weight)", "[K, Hv * 128 / 8] uint32", False),
           ("out_proj[1] (scales)", "[K, Hv * 128 / 64]", False), ("out_proj[2] (biases)", "[K, Hv * 128 / 64]", False))
_PARAM_ARRAYS = (("input_norm_weight", "[K] (float)", False),)


def mixer_params_width(num_k_heads: int, num_v_heads: int, hidden: int) -> int:
    """Size of :func:`mixer_params`' array: ``params_width`` of
    ``gated_delta_contract`` (C*4 + 2*Hv + 128) plus ``hidden``."""
    return params_width(num_k_heads, num_v_heads) + hidden


def mixer_params(conv_weight: mx.array, A_log: mx.array, dt_bias: mx.array, norm_weight: mx.array,
                 input_norm_weight: mx.array) -> mx.array:
    """A layer's constants for :func:`gdn_mixer_decode` as one float32 array:
    ``gated_delta_contract.decode_params(conv_weight, A_log, dt_bias,
    norm_weight)`` followed by the decoder layer's input RMSNorm weight.
    Every float type converts to float32 exactly (build it once per layer).

    Args:
      conv_weight: [C, 4, 1] (or [C, 4]); A_log, dt_bias: [Hv]; norm_weight:
        [128]; input_norm_weight: [K]; any float dtype.

    Returns:
      float32 [C*4 + 2*Hv + 128 + K].

    Raises:
      ValueError: an argument that is not an mx.array, not a float array or
        of another shape (names it).
    """
    params = decode_params(conv_weight, A_log, dt_bias, norm_weight)
    _checks.check_arrays("mixer_params", _PARAM_ARRAYS, input_norm_weight)
    if input_norm_weight.dtype not in (mx.bfloat16, mx.float16, mx.float32) or input_norm_weight.ndim != 1 or \
            input_norm_weight.size == 0:
        raise ValueError(f"input_norm_weight must be a float array of shape [K], got {input_norm_weight.dtype} "
                         f"{tuple(input_norm_weight.shape)}")
    return mx.concatenate([params, input_norm_weight.astype(mx.float32)])


def _rows(x) -> int:
    return x.shape[0] if x.ndim in (2, 3) else 0


def _projections(in_proj, out_proj) -> Optional[str]:
    """None when in_proj and out_proj are sequences of three arrays."""
    for name, p in (("in_proj", in_proj), ("out_proj", out_proj)):
        if not isinstance(p, (tuple, list)) or len(p) != 3:
            return (f"{name} must be (weight, scales, biases) of an affine {BITS}-bit group-{GROUP_SIZE} "
                    f"quantised linear layer, got {_checks.describe(p)}")
    return None


def _problem(x, in_proj, params, conv_state, state, out_proj, Hk, Hv, group_size, bits) -> Optional[str]:
    """None when the kernel takes these (array) arguments, else what does not
    fit (params None: not checked)."""
    if bits != BITS or group_size != GROUP_SIZE:
        return f"bits and group_size must be {BITS} and {GROUP_SIZE}, got {bits!r} and {group_size!r}"
    if not (isinstance(Hk, int) and isinstance(Hv, int)) or Hk <= 0 or Hv <= 0 or Hv % Hk:
        return f"num_v_heads ({Hv!r}) must be a positive multiple of num_k_heads ({Hk!r})"
    if x.dtype not in _FLOAT or not (x.ndim == 2 or (x.ndim == 3 and x.shape[1] == 1)):
        return f"x must be bfloat16 or float32 of shape [B, 1, K] or [B, K], got {x.dtype} {tuple(x.shape)}"
    B, K = _rows(x), x.shape[-1]
    es = 2 if x.dtype == mx.bfloat16 else 4
    if not 1 <= B <= MAX_ROWS:
        return f"x must hold 1 to {MAX_ROWS} rows, got {tuple(x.shape)}"
    if K % GROUP_SIZE or K == 0 or B * K * es > _STAGE_BYTES:
        return (f"x's last axis ({K}) must be a positive multiple of {GROUP_SIZE} with rows * K * itemsize <= "
                f"{_STAGE_BYTES}, got {x.dtype} {tuple(x.shape)}")
    if x.dtype == mx.bfloat16 and B * Hv * D * 2 > _STAGE_BYTES:
        return f"rows * num_v_heads * {D} * 2 must be at most {_STAGE_BYTES} (bfloat16), got {B} rows, {Hv} heads"
    C, P, KO = (2 * Hk + Hv) * D, packed_width(Hk, Hv), Hv * D
    for name, proj, n, k in (("in_proj", in_proj, P, K), ("out_proj", out_proj, K, KO)):
        problem = qg.projection_problem(name, proj, n, k, BITS, GROUP_SIZE, x.dtype)
        if problem is not None:
            return problem + " (scales and biases in x's dtype)"
    pw = mixer_params_width(Hk, Hv, K)
    if params is not None and (params.dtype != mx.float32 or tuple(params.shape) != (pw,)):
        return f"params must be float32 [{pw}] (mixer_params), got {params.dtype} {tuple(params.shape)}"
    if conv_state is not None and (conv_state.dtype not in (mx.bfloat16, mx.float16, mx.float32)
                                   or tuple(conv_state.shape) != (B, KW - 1, C)):
        return f"conv_state must be a float array of shape [{B}, {KW - 1}, {C}], got {conv_state.dtype} " \
               f"{tuple(conv_state.shape)}"
    if state is not None and (state.dtype != mx.float32 or tuple(state.shape) != (B, Hv, D, D)):
        return f"state must be float32 of shape [{B}, {Hv}, {D}, {D}], got {state.dtype} {tuple(state.shape)}"
    return None


def supports(x, in_proj: Sequence, out_proj: Sequence, state=None, *, num_k_heads: int, num_v_heads: int,
             group_size: int = GROUP_SIZE, bits: int = BITS, mode: str = "affine") -> bool:
    """True when :func:`gdn_mixer_decode` takes a layer's step with these
    arrays on this machine: the CUDA backend, 1 to 4 rows of bfloat16 or
    float32, head dims 128, affine 4-bit group-64 projections (biases, no
    bias) with scales in x's dtype, the shapes of its docstring. Shape
    checks only (nothing is evaluated or compiled); the constants are not
    looked at."""
    if not cb.cuda_available() or mode != "affine" or _projections(in_proj, out_proj) is not None:
        return False
    if not all(_checks.is_array(a) for a in (x, *in_proj, *out_proj)) or not _checks.is_array(state, optional=True):
        return False
    return _problem(x, in_proj, None, None, state, out_proj, num_k_heads, num_v_heads, group_size, bits) is None


def _kernel(x_dtype, Hv: int, Hk: int, K: int, B: int, phase_clock: bool = False) -> cb.CudaKernel:
    key = (x_dtype, Hv, Hk, K, B, phase_clock)
    kern = _kernels.get(key)
    if kern is None:
        defines = dict(GDN_X=cb.dtype_macro(x_dtype), GDN_HV=Hv, GDN_HK=Hk, GM_K=K, GM_M=B)
        if phase_clock:
            defines["MQF_PHASE_CLOCK"] = 1
        kern = _kernels[key] = cb.CudaKernel("gdn_mixer_decode.cu", "mqf_gdn_mixer", defines)
    return kern


#: Phase marks of the diagnostic build (``phase_clock=True``), in order:
#: cycles from the block's start to the end of the input projection (A),
#: to the first grid barrier's end, to the end of the GDN step (B), to the
#: second barrier's end, to the end of the out_proj (C).
PHASE_MARKS = ("start", "A done", "barrier 1", "B done", "barrier 2", "end")
_PC_SLOTS = 8  # phase_clock.cuh


def _round16(n: int) -> int:
    return -(-n // 16) * 16


def _tile_warps(k: int) -> int:
    """Warps per GEMV tile (``quantized_gemv.warps`` at 4 bits)."""
    return max(1, min(16, -(-k // 512)))


def grid_blocks(B: int, Hk: int, Hv: int, K: int, sm_count: int) -> int:
    """Blocks of the launch: the most that any phase can use (tiles of the
    input projection per block's teams, (row, value head) items, out_proj
    tiles), at most ``sm_count`` (every block resident) and the source's
    barrier weight (1024)."""
    tiles_a, tiles_c = -(-packed_width(Hk, Hv) // 16), -(-K // 16)
    teams_a, teams_c = 16 // _tile_warps(K), 16 // _tile_warps(Hv * D)
    work = max(-(-tiles_a // teams_a), B * Hv, -(-tiles_c // teams_c))
    return max(1, min(work, sm_count, _MAX_BLOCKS))


def scratch_words(B: int, Hk: int, Hv: int, x_dtype) -> int:
    """uint32 words of the scratch output: proj [B, P] and y [B, Hv*128] in
    x's dtype, each 16-byte aligned."""
    es = 2 if x_dtype == mx.bfloat16 else 4
    return (_round16(B * packed_width(Hk, Hv) * es) + _round16(B * Hv * D * es)) // 4


def checked_arguments(fn: str, x, in_proj, params, conv_state, state, out_proj, num_k_heads, num_v_heads,
                      input_norm_eps, norm_eps, qk_eps, group_size, bits):
    """:func:`gdn_mixer_decode`'s argument checks (ValueError naming the
    argument, ``fn: `` first); returns ``(conv_state, state, (input_norm_eps,
    qk_eps, norm_eps))`` with None states as zeros and the conv state in x's
    dtype (as the kernel reads it)."""
    problem = _projections(in_proj, out_proj)
    if problem is not None:
        raise ValueError(f"{fn}: {problem}")
    _checks.check_arrays(fn, _ARRAYS, x, *in_proj, params, conv_state, state, *out_proj)
    Hk, Hv = num_k_heads, num_v_heads
    problem = _problem(x, in_proj, params, conv_state, state, out_proj, Hk, Hv, group_size, bits)
    if problem is not None:
        raise ValueError(f"{fn}: {problem}")
    eps = (_checks.check_eps(fn, "input_norm_eps", input_norm_eps), _checks.check_eps(fn, "qk_eps", qk_eps),
           _checks.check_eps(fn, "norm_eps", norm_eps))
    B, dt = _rows(x), x.dtype
    C = (2 * Hk + Hv) * D
    if conv_state is None:
        conv_state = mx.zeros((B, KW - 1, C), dtype=dt)
    elif conv_state.dtype != dt:  # the kernel reads it in the activation dtype
        conv_state = conv_state.astype(dt)
    if state is None:
        state = mx.zeros((B, Hv, D, D), dtype=mx.float32)
    return conv_state, state, eps


def gdn_mixer_decode(
    x: mx.array,
    in_proj: Sequence[mx.array],
    params: mx.array,
    conv_state: Optional[mx.array],
    state: Optional[mx.array],
    out_proj: Sequence[mx.array],
    *,
    num_k_heads: int,
    num_v_heads: int,
    input_norm_eps: float,
    norm_eps: float = 1e-6,
    qk_eps: float = 1e-6,
    group_size: int = GROUP_SIZE,
    bits: int = BITS,
    phase_clock: bool = False,
    after: Optional[mx.array] = None,
):
    """``x + mixer(rms_norm(x))`` of a Gated DeltaNet decoder layer for one
    token per row, and the layer's new conv and recurrent states, in one
    launch.

    Args:
      x: [B, 1, K] or [B, K], bfloat16 or float32, 1 <= B <= 4; K a multiple
        of 64 with B * K * itemsize <= 32768 (and, in bfloat16, B * Hv * 128
        * 2 <= 32768).
      in_proj: (weight uint32 [P, K / 8], scales, biases [P, K / 64] in x's
        dtype): ``mx.quantize`` (affine, 4 bits, group 64) of the four input
        projections concatenated along the output axis, [qkv | z | a | b],
        P = (2 Hk + Hv) * 128 + Hv * 128 + 2 Hv.
      params: float32 [:func:`mixer_params_width`] from :func:`mixer_params`.
      conv_state: [B, 3, C] (any float dtype, cast to x's), C = (2 Hk + Hv)
        * 128; None for zeros.
      state: [B, Hv, 128, 128] float32, or None for zeros.
      out_proj: (weight uint32 [K, Hv * 16], scales, biases [K, Hv * 2] in
        x's dtype): the layer's ``out_proj``, quantised as in_proj.
      num_k_heads, num_v_heads: Hk, Hv (Hv a multiple of Hk); head dims 128.
      input_norm_eps: the decoder layer's input RMSNorm eps.
      norm_eps: the gated RMSNorm's eps; qk_eps: the q/k L2-norm eps.
      group_size, bits: 64 and 4 (the only quantisation taken).
      phase_clock: a diagnostic build (``cuda/phase_clock.cuh``) that also
        returns each block's SM cycle counts at the :data:`PHASE_MARKS`
        (bench/profile_kernels.py phases); same results otherwise.
      after: any array, never read: the launch runs after whatever wrote it
        (MLX orders a launch after the writers of its inputs). Launches of
        this kernel that nothing orders may run at once, each on a barrier
        slot of its own (the source's launch contract); pass an output of
        the launch that should come first to keep two in order. None: no
        such input.

    Returns:
      (out with x's shape and dtype, conv_state [B, 3, C] in x's dtype,
      state [B, Hv, 128, 128] float32); with ``phase_clock`` a fourth,
      int64 [blocks, 8]: cycles from mark 0 per block and mark (-1 past the
      six marks).

    Raises:
      ValueError: an argument outside the above (named), an eps outside
        (0, 1).
      RuntimeError: no CUDA compiler could build the kernel.
    """
    fn = "gdn_mixer_decode"
    conv_state, state, eps = checked_arguments(fn, x, in_proj, params, conv_state, state, out_proj, num_k_heads,
                                               num_v_heads, input_norm_eps, norm_eps, qk_eps, group_size, bits)
    Hk, Hv = num_k_heads, num_v_heads
    B, K, dt = _rows(x), x.shape[-1], x.dtype
    C = (2 * Hk + Hv) * D
    if not isinstance(phase_clock, bool):
        raise ValueError(f"{fn}: phase_clock must be a bool, got {phase_clock!r}")
    if after is not None and not _checks.is_array(after):
        raise ValueError(f"{fn}: after must be an mx.array or None, got {_checks.describe(after)}")
    blocks = grid_blocks(B, Hk, Hv, K, cb.sm_count())
    kern = _kernel(dt, Hv, Hk, K, B, phase_clock)
    words = scratch_words(B, Hk, Hv, dt)
    clock_words = blocks * _PC_SLOTS * 2 if phase_clock else 0
    out, new_conv, new_state, scratch = kern(
        [x, *in_proj, params, conv_state, state, *out_proj, x if after is None else after],
        [tuple(x.shape), (B, KW - 1, C), (B, Hv, D, D), (words + clock_words,)],
        [dt, dt, mx.float32, mx.uint32], (blocks * _THREADS, 1, 1), (_THREADS, 1, 1), eps,
    )
    if phase_clock:
        return out, new_conv, new_state, scratch[words:].view(mx.int64).reshape(blocks, _PC_SLOTS)
    return out, new_conv, new_state
