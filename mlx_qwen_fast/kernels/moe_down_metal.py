"""Down GEMVs, routing weights, shared expert and combine of the decode MoE on Metal: one launch.

The contract of :func:`mlx_qwen_fast.kernels.moe_decode_gemv.down_combine`
(the CUDA kernel; same arguments and output), with ``h`` float32 or
bfloat16 and I, D multiples of 64::

    y[n] = sum_j scores[n, j] * T(h[n*k + j] . Wd[inds[n, j]])
           + sgate[n] * T(h[N*k + n] . Wd_shared)

``T`` = h's dtype (each expert's output rounded where mlx-lm rounds; nothing
for float32), the 4-bit weights dequantised in registers, fp32 sums in a
fixed order (no atomics: the same bits on every run), ``y`` stored as ``T``.

Layout: ``D/4`` threadgroups of :func:`simd_groups` SIMD groups; threadgroup
t computes output rows ``[4 t, +4)`` for every token. The items (the pair
slots whose expert no lower slot lists, then the shared expert) are spread
over the SIMD groups, slot s to SIMD group ``s mod NW``; each SIMD group
reads its items' 4 weight rows once for every token that uses them (lane l
inputs ``[16 l + 512 c, +16)``, one ``simd_sum`` per row), and the items'
weighted outputs meet in threadgroup memory, added in slot order. The
published engine's fused down + combine (pplx-garden ``lily/``: a few
output rows per threadgroup, the slots' weighted outputs summed in slot
order inside the kernel, the shared expert's gate applied there) with the
slots spread over SIMD groups as the CUDA kernel spreads them over warps.
Source: ``mlx_qwen_fast/metal/moe_down.metal`` (the kernel body;
``mx.fast.metal_kernel`` writes the signature).

Verified only by running MLX's generated source on the CPU
(``tests/metal_check.py``) against the fp32 host reference; never run on an
Apple GPU, never timed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import mlx.core as mx

from ._checks import describe as _describe
from .moe_contract import DECODE_MAX_TOKENS, check_down_weights, check_expert_ids, is_4bit_group64

__all__ = ["down_combine_metal", "down_combine_metal_unchecked", "simd_groups", "SOURCE_FILE", "MAX_TOKENS", "MAX_PAIRS", "MAX_SIMD_GROUPS"]

SOURCE_FILE = Path(__file__).resolve().parents[1] / "metal" / "moe_down.metal"
MAX_TOKENS = DECODE_MAX_TOKENS
MAX_PAIRS = 32  # N*k: the kernel's threadgroup array holds N*k + 1 slots
MAX_SIMD_GROUPS = 16
ROWS = 4  # output rows per threadgroup
_H = (mx.float32, mx.bfloat16)
_KERNEL = None  # built on first use: only a call needs Metal


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = mx.fast.metal_kernel(
            name="mqf_moe_down",
            input_names=["h", "inds", "scores", "sgate", "wd", "sd", "bd", "xwd", "xsd", "xbd"],
            output_names=["y"],
            source=SOURCE_FILE.read_text(),
        )
    return _KERNEL


def simd_groups(n: int, k: int) -> int:
    """SIMD groups per threadgroup of the down kernel for ``n`` tokens,
    top-``k``: one per item (``n*k`` pair slots + the shared expert), so
    that no SIMD group computes two items in series, up to
    :data:`MAX_SIMD_GROUPS` (512 threads)."""
    return min(n * k + 1, MAX_SIMD_GROUPS)


def down_combine_metal(
    h: mx.array, inds: mx.array, scores: mx.array, sgate: mx.array, down: Sequence, shared_down: Sequence
) -> mx.array:
    """Down GEMVs, routing weights, shared expert and combine: ``y [N, D]``, on Metal.

    Args:
        h, sgate: from :func:`mlx_qwen_fast.kernels.moe_gate_up_metal.gate_up_swiglu_metal`
            on the same ``inds``: ``h [N*k + N, I]`` float32/bfloat16 with
            I % 64 == 0, ``sgate [N]`` float32.
        inds: ``[N, k]`` int32/uint32 expert ids in ``[0, E)`` (checked: one
            host synchronisation), 1 <= N <= 4, N*k <= 32.
        scores: ``[N, k]`` float32 routing weights.
        down: ``(weight uint32 [E, D, I/8], scales, biases bf16 [E, D, I/64])``, D % 64 == 0.
        shared_down: ``(weight uint32 [D, I/8], scales, biases bf16 [D, I/64])``.

    Returns:
        ``y [N, D]`` in h's dtype.

    Raises:
        ValueError: a shape/dtype the kernel does not take, or an id out of
            range (the argument named).
        RuntimeError: MLX has no Metal back-end here (raised by MLX).
    """
    fn = "down_combine_metal"
    if not isinstance(inds, mx.array) or inds.ndim != 2 or inds.dtype not in (mx.int32, mx.uint32):
        raise ValueError(f"{fn}: inds must be int32/uint32 [N, k], got {_describe(inds)}")
    n, k = inds.shape
    if not 1 <= n <= MAX_TOKENS or not 1 <= n * k <= MAX_PAIRS:
        raise ValueError(f"{fn}: inds [N, k] needs 1 <= N <= {MAX_TOKENS} and 1 <= N*k <= {MAX_PAIRS}, "
                         f"got N={n}, k={k}")
    if (not isinstance(h, mx.array) or h.ndim != 2 or h.dtype not in _H or h.shape[0] != n * k + n
            or h.shape[1] == 0 or h.shape[1] % 64):
        raise ValueError(f"{fn}: h must be float32/bfloat16 [N*k + N = {n * k + n}, I] with I a positive "
                         f"multiple of 64, got {_describe(h)}")
    I = h.shape[1]
    if not isinstance(scores, mx.array) or tuple(scores.shape) != (n, k) or scores.dtype != mx.float32:
        raise ValueError(f"{fn}: scores must be float32 [{n}, {k}], got {_describe(scores)}")
    if not isinstance(sgate, mx.array) or tuple(sgate.shape) != (n,) or sgate.dtype != mx.float32:
        raise ValueError(f"{fn}: sgate must be float32 [{n}], got {_describe(sgate)}")
    E, D = check_down_weights(fn, down, I)
    if not is_4bit_group64(shared_down, (), D, I):
        raise ValueError(f"{fn}: shared_down must be uint32 [{D}, {I // 8}] + bf16 [{D}, {I // 64}] x2")
    check_expert_ids(fn, inds, E)
    return down_combine_metal_unchecked(h, inds, scores, sgate, down, shared_down)


def down_combine_metal_unchecked(h, inds, scores, sgate, down, shared_down):
    """:func:`down_combine_metal` on arguments already checked."""
    if inds.dtype != mx.int32:
        inds = inds.astype(mx.int32)  # ids < E <= 2**31: the same values
    n, k = inds.shape
    D = down[0].shape[1]
    nt = 32 * simd_groups(n, k)
    (y,) = _kernel()(
        inputs=[h, inds, scores, sgate, *down, *shared_down],
        template=[("T", h.dtype), ("N", n)],
        grid=((D // ROWS) * nt, 1, 1),
        threadgroup=(nt, 1, 1),
        output_shapes=[(n, D)],
        output_dtypes=[h.dtype],
    )
    return y
