"""Gate + up GEMVs and SwiGLU of the decode MoE (N <= 4 tokens) on Metal: one launch.

The contract of :func:`mlx_qwen_fast.kernels.moe_decode_gemv.gate_up_swiglu`
(the CUDA kernel; same arguments and outputs), with ``x`` float32 or
bfloat16 and the shapes the Metal kernel takes (D and I multiples of 64):
for every distinct expert among the ``N*k`` selected (token, slot) pairs,
plus the shared expert, the gate and up GEMVs with the 4-bit weights
dequantised in registers (fp32: ``s * sum(q x) + b * sum(x)`` over a lane's
16 inputs of one group), fp32 accumulation, and ``T(silu(T(g)) * T(u))``
rounded where mlx-lm's ``SwitchGLU`` rounds (``T`` = x's dtype; nothing is
rounded for float32); one more threadgroup computes ``sigmoid(T(x .
w_shared_gate))``. A pair whose expert a lower pair also lists is
computed by that pair's threadgroups (the weights are read once per call
and per expert).

Layout: threadgroups ``(I/8) x (N*k + 2)`` of 64 threads (2 SIMD groups);
SIMD group g of threadgroup (rb, item) computes rows ``[8 rb + 4 g, +4)`` of
the item's gate and up matrices for the tokens that use the expert, lane l
reading inputs ``[16 l + 512 c, +16)``, one ``simd_sum`` per row and matrix
(the published engine's expert GEMV, pplx-garden ``lily/``: one SIMD group
per row block, 16 inputs per lane, one scale per lane and block; MLX's
``qmv_fast`` has the same per-SIMD-group tile of 4 rows).
Source: ``mlx_qwen_fast/metal/moe_gate_up.metal`` (the kernel body;
``mx.fast.metal_kernel`` writes the signature).

Verified only by running MLX's generated source on the CPU
(``tests/metal_check.py``) against the fp32 host reference; never run on an
Apple GPU, never timed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence, Tuple

import mlx.core as mx

from ._checks import describe as _describe
from .moe_contract import DECODE_MAX_TOKENS, check_expert_ids, decode_weights_problem

__all__ = ["gate_up_swiglu_metal", "gate_up_swiglu_metal_unchecked", "problem", "SOURCE_FILE", "MAX_TOKENS", "MAX_PAIRS"]

SOURCE_FILE = Path(__file__).resolve().parents[1] / "metal" / "moe_gate_up.metal"
MAX_TOKENS = DECODE_MAX_TOKENS  # tokens per call (a float4 of partial sums per row)
MAX_PAIRS = 32  # N*k: the down kernel's threadgroup array holds N*k + 1 slots
ROWS = 8  # gate/up rows per threadgroup
THREADS = 64
_X = (mx.float32, mx.bfloat16)
_KERNEL = None  # built on first use: only a call needs Metal


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = mx.fast.metal_kernel(
            name="mqf_moe_gate_up",
            input_names=["x", "inds", "wg", "sg", "bg", "wu", "su", "bu",
                         "xwg", "xsg", "xbg", "xwu", "xsu", "xbu", "gw", "gs", "gb"],
            output_names=["h", "sgate"],
            source=SOURCE_FILE.read_text(),
        )
    return _KERNEL


def problem(x, inds, experts, shared, expert_gate) -> Optional[str]:
    """None when the arrays fit the Metal decode kernels (this one and
    :mod:`~mlx_qwen_fast.kernels.moe_down_metal`), else what is wrong (one
    line, the argument named). Pure: reads shapes and dtypes only."""
    if not isinstance(x, mx.array) or x.ndim != 2 or x.dtype not in _X:
        return f"x must be float32/bfloat16 [N, D], got {_describe(x)}"
    n, D = x.shape
    if not 1 <= n <= MAX_TOKENS:
        return f"x must have 1..{MAX_TOKENS} tokens, got N={n}"
    if D == 0 or D % 64:
        return f"x [N, D]: D must be a positive multiple of 64, got D={D}"
    if not isinstance(inds, mx.array) or inds.ndim != 2 or inds.shape[0] != n or inds.dtype not in (
            mx.int32, mx.uint32):
        return f"inds must be int32/uint32 [N={n}, k], got {_describe(inds)}"
    k = inds.shape[1]
    if not 1 <= k or n * k > MAX_PAIRS:
        return f"inds [N, k]: N*k must be in [1, {MAX_PAIRS}], got N={n}, k={k}"
    try:
        gate, _, _ = experts
        I = gate[0].shape[1]
    except (TypeError, ValueError, AttributeError, IndexError):
        return "experts must be (gate, up, down), each (weight, scales, biases)"
    if I == 0 or I % 64:
        return f"experts: the expert width I must be a positive multiple of 64, got I={I}"
    return decode_weights_problem(experts, shared, expert_gate, D)


def gate_up_swiglu_metal(
    x: mx.array, inds: mx.array, experts: Sequence, shared: Sequence, expert_gate: Sequence
) -> Tuple[mx.array, mx.array]:
    """Gate + up GEMVs and SwiGLU of the selected and the shared experts, on Metal.

    Args:
        x: ``[N, D]`` float32 or bfloat16, 1 <= N <= 4, D % 64 == 0.
        inds: ``[N, k]`` int32/uint32 expert ids in ``[0, E)`` (checked: one
            host synchronisation), N*k <= 32.
        experts: ``(gate, up, down)`` of the routed experts, each
            ``(weight, scales, biases)``: gate/up ``uint32 [E, I, D/8]``,
            ``bf16 [E, I, D/64]``; down ``uint32 [E, D, I/8]``, ``bf16 [E, D,
            I/64]`` (down only checked here); I % 64 == 0.
        shared: ``(gate, up, down)`` of the shared expert (``[I, D/8]`` ...).
        expert_gate: ``(weight, scales, biases, bits)`` of the shared-expert
            gate ``D -> 1`` (bits 4/8, group 64; or bits 16: bf16 ``[1, D]``).

    Returns:
        ``(h, sgate)``: ``h [N*k + N, I]`` in x's dtype, row ``n*k + j`` =
        ``T(silu(T(x[n] Wg^T)) * T(x[n] Wu^T))`` of expert ``inds[n, j]``,
        row ``N*k + n`` the shared expert's; ``sgate [N]`` float32 =
        ``sigmoid(T(x[n] . w_gate))``.

    Raises:
        ValueError: a shape/dtype the kernel does not take, or an id out of
            range (the argument named).
        RuntimeError: MLX has no Metal back-end here (raised by MLX).
    """
    p = problem(x, inds, experts, shared, expert_gate)
    if p is not None:
        raise ValueError(f"gate_up_swiglu_metal: {p}")
    check_expert_ids("gate_up_swiglu_metal", inds, experts[0][0].shape[0])
    return gate_up_swiglu_metal_unchecked(x, inds, experts, shared, expert_gate)


def gate_up_swiglu_metal_unchecked(x, inds, experts, shared, expert_gate):
    """:func:`gate_up_swiglu_metal` on arguments already checked."""
    if inds.dtype != mx.int32:
        inds = inds.astype(mx.int32)  # ids < E <= 2**31: the same values
    n, k = inds.shape
    (wg, sg, bg), (wu, su, bu), _ = experts
    I = wg.shape[1]
    (xwg, xsg, xbg), (xwu, xsu, xbu), _ = shared
    gw, gs, gb, bits = expert_gate
    nk = n * k
    h, sgate = _kernel()(
        inputs=[x, inds, wg, sg, bg, wu, su, bu, xwg, xsg, xbg, xwu, xsu, xbu, gw, gs, gb],
        template=[("T", x.dtype), ("N", n), ("SGB", int(bits))],
        grid=((I // ROWS) * THREADS, nk + 2, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(nk + n, I), (n,)],
        output_dtypes=[x.dtype, mx.float32],
    )
    return h, sgate
