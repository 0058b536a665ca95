"""A Gated DeltaNet decoder layer's whole decode step on CUDA, in one launch.

Computes, for 1 to 4 token rows ``x`` (bfloat16; mlx-lm's
``qwen3_5.DecoderLayer`` at one token per row, its mixer a ``GatedDeltaNet``
and its MLP a ``Qwen3NextSparseMoeBlock``)::

    h   = x + mixer(rms_norm(x, input_layernorm))           # gdn_mixer_decode
    out = h + block(rms_norm(h, post_attention_layernorm))  # moe_block_decode

and the layer's new conv and recurrent states: what
:func:`mlx_qwen_fast.kernels.gdn_mixer_decode.gdn_mixer_decode` followed by
:func:`mlx_qwen_fast.kernels.moe_block_decode.moe_block_decode` compute, bit
for bit, as one graph node instead of two (the two kernels' device code in
one persistent grid, the mixer's output passed through a scratch output,
five grid barriers on one slot). Source:
``mlx_qwen_fast/cuda/gdn_layer_decode.cu``.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import mlx.core as mx

from . import _checks
from . import _cuda_build as cb
from . import gdn_mixer_decode as gm
from . import moe_block_decode as mb
from .gated_delta_contract import D, KW

__all__ = ["gdn_layer_decode", "gdn_layer_decode_unchecked", "grid_blocks", "scratch_words", "smem_problem",
           "supports"]

_THREADS = 512
_kernels: Dict[tuple, cb.CudaKernel] = {}


def _round16(n: int) -> int:
    return -(-n // 16) * 16


def grid_blocks(B: int, Hk: int, Hv: int, K: int, top_k: int, E: int, I: int, router_bits: int,
                sm_count: int) -> int:
    """Blocks of the launch: the larger of the two kernels' grids
    (:func:`gm.grid_blocks`, :func:`mb.grid_blocks`: each at most
    ``sm_count``)."""
    return max(gm.grid_blocks(B, Hk, Hv, K, sm_count), mb.grid_blocks(B, top_k, E, K, I, router_bits, sm_count))


def scratch_words(B: int, Hk: int, Hv: int, K: int, top_k: int, E: int, I: int) -> int:
    """uint32 words of the scratch output: the mixer's (proj, y), h [B, K]
    bf16, the MoE block's (logits, SwiGLU rows, shared gate), each part
    16-byte aligned."""
    return gm.scratch_words(B, Hk, Hv, mx.bfloat16) + _round16(B * K * 2) // 4 + mb.scratch_words(B, top_k, E, I)


def _static_smem(B: int, K: int, Hv: int, top_k: int) -> int:
    """Static shared memory of the launch, bytes (the source's arrays: the
    mixer's staging, reduction, GDN step and gate arrays, the routing's ids
    and weights), plus 64 for their alignment."""
    stage = max(B * K * 2, B * Hv * D * 2)
    return stage + 16 * 32 * 4 * 4 + 16 * B * 4 + 4 * D * 4 + 4 * 3 * 4 + 2 * 4 + 2 * B * top_k * 4 + 64


def smem_problem(B: int, K: int, Hv: int, top_k: int, I: int) -> Optional[str]:
    """None when the launch's shared memory (static, :func:`_static_smem`,
    and the MoE block's dynamic, :func:`mb.smem_bytes`) fits one block of
    sm_90 (227 KB), else a line saying what is too large."""
    need = _static_smem(B, K, Hv, top_k) + mb.smem_bytes(B, top_k, I)
    if need > mb._SMEM_LIMIT:
        return (f"the one launch needs {need} bytes of shared memory, more than {mb._SMEM_LIMIT} (rows {B}, "
                f"hidden {K}, value heads {Hv}, top_k {top_k}, expert width I {I})")
    return None


def supports(x, in_proj: Sequence, out_proj: Sequence, state, norm_weight, router: Sequence, experts: Sequence,
             shared: Sequence, expert_gate: Sequence, *, num_k_heads: int, num_v_heads: int, top_k: int,
             router_group_size: int = 64, router_bits: int = 8) -> bool:
    """True when :func:`gdn_layer_decode` takes these arrays on this
    machine: bfloat16 rows that both kernels take (:func:`gm.supports`,
    :func:`mb.supports`). Shape checks only."""
    if not (_checks.is_array(x) and x.dtype == mx.bfloat16):
        return False
    if not (gm.supports(x, in_proj, out_proj, state, num_k_heads=num_k_heads, num_v_heads=num_v_heads)
            and mb.supports(x, norm_weight, router, experts, shared, expert_gate, top_k=top_k,
                            router_group_size=router_group_size, router_bits=router_bits)):
        return False
    return smem_problem(mb._rows(x), x.shape[-1], num_v_heads, top_k, experts[0][0].shape[1]) is None


def _kernel(B, Hv, Hk, K, k, E, I, sgb, rbits, rgs, norm_dtype) -> cb.CudaKernel:
    key = (B, Hv, Hk, K, k, E, I, sgb, rbits, rgs, norm_dtype)
    kern = _kernels.get(key)
    if kern is None:
        defines = dict(GDN_X="bf16_t", GDN_HV=Hv, GDN_HK=Hk, GM_K=K, GM_M=B, MBD_N=B, MBD_K=k, MBD_E=E, MBD_D=K,
                       MBD_I=I, MBD_SGB=sgb, MBD_RBITS=rbits, MBD_RGS=rgs, MBD_WT=cb.dtype_macro(norm_dtype))
        kern = _kernels[key] = cb.CudaKernel("gdn_layer_decode.cu", "mqf_gdn_layer", defines)
    return kern


def gdn_layer_decode(
    x: mx.array,
    in_proj: Sequence[mx.array],
    params: mx.array,
    conv_state: Optional[mx.array],
    state: Optional[mx.array],
    out_proj: Sequence[mx.array],
    norm_weight: mx.array,
    router: Sequence[mx.array],
    experts: Sequence,
    shared: Sequence,
    expert_gate: Sequence,
    *,
    num_k_heads: int,
    num_v_heads: int,
    input_norm_eps: float,
    top_k: int,
    post_norm_eps: float,
    norm_eps: float = 1e-6,
    qk_eps: float = 1e-6,
    normalize: bool = True,
    router_group_size: int = 64,
    router_bits: int = 8,
    after: Optional[mx.array] = None,
):
    """A Gated DeltaNet decoder layer's decode step (mixer, then MoE block)
    for one token per row, in one launch.

    Args:
      x: [B, 1, K] or [B, K] bfloat16, 1 <= B <= 4 (the two kernels' limits).
      in_proj, params, conv_state, state, out_proj, num_k_heads,
        num_v_heads, input_norm_eps, norm_eps, qk_eps: as
        :func:`mlx_qwen_fast.kernels.gdn_mixer_decode.gdn_mixer_decode`'s.
      norm_weight, router, experts, shared, expert_gate, top_k, normalize,
        router_group_size, router_bits: as
        :func:`mlx_qwen_fast.kernels.moe_block_decode.moe_block_decode`'s
        (``norm_weight``: the post-attention RMSNorm's weight);
        ``post_norm_eps``: that norm's eps (the block's ``norm_eps``).
      after: any array, never read: the launch runs after its writer (the
        kernels' launch contract).

    Returns:
      (out with x's shape, bfloat16; conv_state [B, 3, C] bfloat16; state
      [B, Hv, 128, 128] float32): the two launches' results bit for bit.

    Raises:
      ValueError: an argument outside the above (named, with the kernel
        whose contract it breaks).
      RuntimeError: no CUDA compiler could build the kernel.
    """
    fn = "gdn_layer_decode"
    if not (_checks.is_array(x) and x.dtype == mx.bfloat16):
        raise ValueError(f"{fn}: x must be an mx.array of dtype bfloat16, got {_checks.describe(x)}")
    conv_state, state, mixer_eps = gm.checked_arguments(fn, x, in_proj, params, conv_state, state, out_proj,
                                                        num_k_heads, num_v_heads, input_norm_eps, norm_eps, qk_eps,
                                                        gm.GROUP_SIZE, gm.BITS)
    post_eps = _checks.check_eps(fn, "post_norm_eps", post_norm_eps)
    mb.checked_arguments(fn, x, norm_weight, router, experts, shared, expert_gate, top_k, post_eps,
                         router_group_size, router_bits)
    problem = smem_problem(mb._rows(x), x.shape[-1], num_v_heads, int(top_k), experts[0][0].shape[1])
    if problem is not None:
        raise ValueError(f"{fn}: experts: {problem}")
    if after is not None and not _checks.is_array(after):
        raise ValueError(f"{fn}: after must be an mx.array or None, got {_checks.describe(after)}")
    return gdn_layer_decode_unchecked(x, in_proj, params, conv_state, state, out_proj, norm_weight, router, experts,
                                      shared, expert_gate, num_k_heads, num_v_heads, mixer_eps, int(top_k),
                                      post_eps, bool(normalize), router_group_size, router_bits, after)


def gdn_layer_decode_unchecked(x, in_proj, params, conv_state, state, out_proj, norm_weight, router, experts, shared,
                               expert_gate, num_k_heads, num_v_heads, mixer_eps, top_k, post_eps, normalize,
                               router_group_size, router_bits, after=None):
    """:func:`gdn_layer_decode` on arguments already checked (the compiled
    decode step's entry point): ``conv_state`` and ``state`` arrays (the
    conv state in bfloat16), ``mixer_eps`` = (input_norm_eps, qk_eps,
    norm_eps)."""
    B, K = mb._rows(x), x.shape[-1]
    Hk, Hv = num_k_heads, num_v_heads
    (wg, sg, bg), (wu, su, bu), (wd, sd, bd) = experts
    E, I = wg.shape[0], wg.shape[1]
    gw, gs, gb, sgb = expert_gate
    C = (2 * Hk + Hv) * D
    kern = _kernel(B, Hv, Hk, K, top_k, E, I, int(sgb), router_bits, router_group_size, norm_weight.dtype)
    blocks = grid_blocks(B, Hk, Hv, K, top_k, E, I, router_bits, cb.sm_count())
    out, new_conv, new_state, _ = kern(
        inputs=[x, *in_proj, params, conv_state, state, *out_proj, norm_weight, *router, wg, sg, bg, wu, su, bu,
                wd, sd, bd, *shared[0], *shared[1], *shared[2], gw, gs, gb, x if after is None else after],
        output_shapes=[tuple(x.shape), (B, KW - 1, C), (B, Hv, D, D),
                       (scratch_words(B, Hk, Hv, K, top_k, E, I),)],
        output_dtypes=[mx.bfloat16, mx.bfloat16, mx.float32, mx.uint32],
        grid=(blocks * _THREADS, 1, 1),
        threadgroup=(_THREADS, 1, 1),
        shared_memory=mb.smem_bytes(B, top_k, I),
        scalars=[*mixer_eps, int(normalize), post_eps],
    )
    return out, new_conv, new_state
