"""A gated-attention decoder layer's whole decode step on CUDA, in one launch.

Computes, for 1 to 4 token rows ``x`` (bfloat16; mlx-lm's
``qwen3_5.DecoderLayer`` at one token per row, its mixer a
``Qwen3NextAttention`` with head_dim 256 and its MLP a
``Qwen3NextSparseMoeBlock``)::

    h   = x + o_proj(attention(rms_norm(x, input_layernorm)))  # ops/attention.py decode_step
    out = h + block(rms_norm(h, post_attention_layernorm))      # moe_block_decode

and the KV cache buffers with this token's key and value written at the
offset: what :func:`mlx_qwen_fast.kernels.quantized_gemv.quantized_gemv`
(q|k|v with the input norm), :func:`mlx_qwen_fast.kernels.attention_decode.attention_decode`,
``quantized_gemv`` (o_proj with the residual) and
:func:`mlx_qwen_fast.kernels.moe_block_decode.moe_block_decode` compute, bit
for bit, as one launch and the two row writes of the cache (instead of
eight launching nodes). Source: ``mlx_qwen_fast/cuda/attention_layer_decode.cu``
(its header: the phases, the grid barriers, the loads of the cache issued
before the projection).

No decode path runs it: as its own launch it is slower than the launches
it replaces. It is the tested single-launch form of the attention layer's
body.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple

import mlx.core as mx

from . import _checks
from . import _cuda_build as cb
from . import moe_block_decode as mb
from . import quantized_gemv as qg
from ._cache_rows import write_rows
from .attention_contract import DH, check_cache_step, check_heads, heads_ok, proj_width
from .attention_decode import MAX_GROUP, splits

__all__ = ["MAX_HEADS_PER_KV", "attention_layer_decode", "attention_layer_decode_unchecked", "grid_blocks", "scratch_words",
           "smem_bytes", "smem_problem", "supports"]

_THREADS = 512
#: The projections' quantisation (the kernel's tiles: quantized_gemv.cu's 4-bit path).
BITS, GROUP_SIZE = 4, 64
#: Query heads per KV head at most: one warp each, and a warp past them for this token's key.
MAX_HEADS_PER_KV = MAX_GROUP - 1
#: Most blocks of a launch (the source's barrier weight).
_MAX_BLOCKS = 1024
_kernels: Dict[tuple, cb.CudaKernel] = {}


def _round16(n: int) -> int:
    return -(-n // 16) * 16


def grid_blocks(sm_count: int) -> int:
    """Blocks of the launch: one per SM (every phase uses as many as it
    has: the projection's tiles, the attention items, the MoE block's
    phases, whose own grid is at most the SMs), at most the barrier
    weight."""
    return max(1, min(sm_count, _MAX_BLOCKS))


def scratch_words(B: int, hq: int, hkv: int, K: int, ns: int, top_k: int, E: int, I: int) -> int:
    """uint32 words of the scratch output: proj [B, P] bf16, the partials
    (B * hq * ns rows of 256 floats, then their (max, sum) pairs), y [B, hq
    * 256] bf16, h [B, K] bf16, the MoE block's scratch; each part 16-byte
    aligned."""
    return (_round16(B * proj_width(hq, hkv) * 2) + _round16(B * hq * ns * (DH + 2) * 4) + _round16(B * hq * DH * 2)
            + _round16(B * K * 2)) // 4 + mb.scratch_words(B, top_k, E, I)


def smem_bytes(B: int, hq: int, hkv: int, top_k: int, I: int) -> int:
    """Dynamic shared memory of the launch (``DSM`` of the source): the
    attention items' two stages of a K and a V tile (16 KB each), hq / hkv
    + 1 rows of 256 floats and this token's key and value rows, or the MoE
    block's (:func:`mb.smem_bytes`), the larger."""
    part = 2 * 2 * 16384 + (hq // hkv + 1) * DH * 4 + 2 * DH * 2
    return max(part, mb.smem_bytes(B, top_k, I))


def _static_smem(B: int, K: int, hq: int, top_k: int) -> int:
    """Static shared memory, bytes (the source's arrays: the staging of x,
    y and the block's normalised rows, the GEMV reductions, the combine's
    reductions, the routing's ids and weights), plus 64 for alignment."""
    return max(B * K * 2, B * hq * DH * 2) + 16 * 32 * 4 * 4 + 16 * B * 4 + (DH // 32 + 2) * 4 + 2 * B * top_k * 4 + 64


def smem_problem(B: int, K: int, hq: int, hkv: int, top_k: int, I: int) -> Optional[str]:
    """None when the launch's shared memory (static and dynamic) fits one
    block of sm_90 (227 KB) and its staged rows fit 32 KB, else a line
    naming the arguments that make it too large."""
    if max(B * K * 2, B * hq * DH * 2) > 32768:
        return (f"x and num_heads: rows * max(hidden {K}, num_heads * {DH}) * 2 must be at most 32768, got rows "
                f"{B}, heads {hq}")
    need = _static_smem(B, K, hq, top_k) + smem_bytes(B, hq, hkv, top_k, I)
    if need > mb._SMEM_LIMIT:
        return (f"experts and top_k: the one launch needs {need} bytes of shared memory, more than "
                f"{mb._SMEM_LIMIT} (rows {B}, hidden {K}, heads {hq}/{hkv}, top_k {top_k}, expert width I {I})")
    return None


def _problem(x, input_norm_weight, qkv, keys, o_proj, hq, hkv) -> Optional[str]:
    """None when the attention part takes these arrays (x, the input norm,
    the projections, the buffers' rows), else what does not fit."""
    if x.dtype != mx.bfloat16 or not (x.ndim == 2 or (x.ndim == 3 and x.shape[1] == 1)):
        return f"x must be bfloat16 of shape [B, 1, K] or [B, K], got {x.dtype} {tuple(x.shape)}"
    B, K = mb._rows(x), x.shape[-1]
    if not 1 <= B <= mb.MAX_ROWS or K % GROUP_SIZE or K == 0:
        return f"x must hold 1 to {mb.MAX_ROWS} rows of a positive multiple of {GROUP_SIZE}, got {tuple(x.shape)}"
    if input_norm_weight.dtype not in (mx.bfloat16, mx.float16, mx.float32) or input_norm_weight.shape != (K,):
        return (f"input_norm_weight must be a float array of shape [{K}], got {input_norm_weight.dtype} "
                f"{tuple(input_norm_weight.shape)}")
    for name, proj, n, k in (("qkv", qkv, proj_width(hq, hkv), K), ("o_proj", o_proj, K, hq * DH)):
        problem = qg.projection_problem(name, proj, n, k, BITS, GROUP_SIZE, mx.bfloat16)
        if problem is not None:
            return problem
    if keys.ndim != 4 or keys.shape[0] != B:
        return f"keys must hold x's {B} rows, got {tuple(keys.shape)}"
    return None


def supports(x, input_norm_weight, qkv: Sequence, keys, values, o_proj: Sequence, norm_weight, router: Sequence,
             experts: Sequence, shared: Sequence, expert_gate: Sequence, *, num_heads: int, num_kv_heads: int,
             top_k: int, router_group_size: int = 64, router_bits: int = 8) -> bool:
    """True when :func:`attention_layer_decode` takes these arrays on this
    machine: the CUDA backend, bfloat16 rows, head_dim 256 with at most 15
    query heads per KV head (a warp past them computes the new key), 4-bit
    group-64 projections, cache buffers of x's dtype, a MoE block that
    :func:`mb.supports` takes, the shared memory within a block's. Shape
    checks only."""
    if not cb.cuda_available() or not all(_checks.is_array(a) for a in (x, input_norm_weight, keys, values,
                                                                        norm_weight)):
        return False
    if not heads_ok(num_heads, num_kv_heads, MAX_HEADS_PER_KV):
        return False
    if _problem(x, input_norm_weight, qkv, keys, o_proj, num_heads, num_kv_heads) is not None:
        return False
    B = mb._rows(x)
    if keys.dtype != x.dtype or values.dtype != x.dtype or tuple(keys.shape) != tuple(values.shape) or (
            tuple(keys.shape[:2]) != (B, num_kv_heads) or keys.shape[3] != DH or keys.shape[2] < 1):
        return False
    if not mb.supports(x, norm_weight, router, experts, shared, expert_gate, top_k=top_k,
                       router_group_size=router_group_size, router_bits=router_bits):
        return False
    return smem_problem(B, x.shape[-1], num_heads, num_kv_heads, top_k, experts[0][0].shape[1]) is None


def _kernel(B, K, hq, hkv, rope_dims, traditional, in_dtype, qk_dtype, k, E, I, sgb, rbits, rgs,
            post_dtype) -> cb.CudaKernel:
    key = (B, K, hq, hkv, rope_dims, traditional, in_dtype, qk_dtype, k, E, I, sgb, rbits, rgs, post_dtype)
    kern = _kernels.get(key)
    if kern is None:
        defines = dict(ATT_X="bf16_t", ATT_W=cb.dtype_macro(qk_dtype), ATT_HQ=hq, ATT_HKV=hkv,
                       ATT_ROPE_DIMS=rope_dims, ATT_ROPE_TRAD=int(bool(traditional)), AL_K=K, AL_M=B,
                       AL_IW=cb.dtype_macro(in_dtype), MBD_N=B, MBD_K=k, MBD_E=E, MBD_D=K, MBD_I=I, MBD_SGB=sgb,
                       MBD_RBITS=rbits, MBD_RGS=rgs, MBD_WT=cb.dtype_macro(post_dtype))
        kern = _kernels[key] = cb.CudaKernel("attention_layer_decode.cu", "mqf_attn_layer", defines)
    return kern


def attention_layer_decode(
    x: mx.array,
    input_norm_weight: mx.array,
    qkv: Sequence[mx.array],
    q_norm_weight: mx.array,
    k_norm_weight: mx.array,
    keys: mx.array,
    values: mx.array,
    offset: mx.array,
    o_proj: Sequence[mx.array],
    norm_weight: mx.array,
    router: Sequence[mx.array],
    experts: Sequence,
    shared: Sequence,
    expert_gate: Sequence,
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    input_norm_eps: float,
    q_eps: float,
    k_eps: float,
    rope_dims: int,
    top_k: int,
    post_norm_eps: float,
    rope_traditional: bool = False,
    rope_base: float = 10000.0,
    rope_scale: float = 1.0,
    normalize: bool = True,
    router_group_size: int = 64,
    router_bits: int = 8,
    after: Optional[mx.array] = None,
) -> Tuple[mx.array, mx.array, mx.array]:
    """A gated-attention decoder layer's decode step (attention, then MoE
    block) for one token per row, in one launch.

    Args:
      x: [B, 1, K] or [B, K] bfloat16, 1 <= B <= 4.
      input_norm_weight: [K] float, the input RMSNorm's weight
        (``input_norm_eps`` its eps).
      qkv: (weight uint32 [P, K/8], scales, biases bf16 [P, K/64]) of the
        concatenated q|k|v projection, P = :func:`~.attention_contract.proj_width`
        (``num_heads``, ``num_kv_heads``): per query head its query then
        its gate, then the keys and the values (affine 4-bit, group 64).
      q_norm_weight, k_norm_weight, keys, values, offset, num_heads,
        num_kv_heads, scale, q_eps, k_eps, rope_*: as
        :func:`mlx_qwen_fast.kernels.attention_decode.attention_decode`'s
        (keys and values bfloat16; at most 15 query heads per KV head).
      o_proj: (weight uint32 [K, num_heads*256/8], scales, biases bf16
        [K, num_heads*256/64]).
      norm_weight, router, experts, shared, expert_gate, top_k, normalize,
        router_group_size, router_bits: as
        :func:`mlx_qwen_fast.kernels.moe_block_decode.moe_block_decode`'s
        (``norm_weight``: the post-attention RMSNorm's weight,
        ``post_norm_eps`` its eps).
      after: any array, never read: the launch runs after its writer (the
        persistent kernels' launch contract).

    Returns:
      ``(out, keys, values)``: out with x's shape, bfloat16; the buffers
      with this token's key (normalised, rotated) and value written at
      ``offset`` (in place when they are donated). Bit for bit the results
      of the launches named in the module docstring, for an offset in
      ``[0, capacity)``; another offset gives an unspecified result (the
      row written is the offset clamped into the buffers).

    Raises:
      ValueError: an argument outside the above (named).
      RuntimeError: no CUDA compiler could build the kernel.
    """
    fn = "attention_layer_decode"
    _checks.check_arrays(fn, (("x", "[B, 1, K] bfloat16", False), ("input_norm_weight", "[K] (float)", False)),
                         x, input_norm_weight)
    hq, hkv = num_heads, num_kv_heads
    check_heads(fn, hq, hkv, MAX_HEADS_PER_KV)
    _checks.check_arrays(fn, (("keys", f"[B, Hkv, capacity, {DH}]", False),), keys)
    problem = _problem(x, input_norm_weight, qkv, keys, o_proj, hq, hkv)
    if problem is not None:
        raise ValueError(f"{fn}: {problem}")
    B = mb._rows(x)
    qk_eps = check_cache_step(fn, B, x.dtype, keys, values, offset, q_norm_weight, k_norm_weight, hq, hkv, scale,
                              q_eps, k_eps, rope_dims, rope_base, rope_scale, max_group=MAX_HEADS_PER_KV)
    in_eps = _checks.check_eps(fn, "input_norm_eps", input_norm_eps)
    post_eps = _checks.check_eps(fn, "post_norm_eps", post_norm_eps)
    mb.checked_arguments(fn, x, norm_weight, router, experts, shared, expert_gate, top_k, post_eps,
                         router_group_size, router_bits)
    problem = smem_problem(B, x.shape[-1], hq, hkv, int(top_k), experts[0][0].shape[1])
    if problem is not None:
        raise ValueError(f"{fn}: {problem}")
    if after is not None and not _checks.is_array(after):
        raise ValueError(f"{fn}: after must be an mx.array or None, got {_checks.describe(after)}")
    return attention_layer_decode_unchecked(
        x, input_norm_weight, qkv, q_norm_weight, k_norm_weight, keys, values, offset, o_proj, norm_weight, router,
        experts, shared, expert_gate, hq, hkv, float(scale), in_eps, qk_eps, int(rope_dims), bool(rope_traditional),
        float(rope_base), float(rope_scale), int(top_k), post_eps, bool(normalize), router_group_size, router_bits,
        after)


def attention_layer_decode_unchecked(x, input_norm_weight, qkv, q_norm_weight, k_norm_weight, keys, values, offset,
                                     o_proj, norm_weight, router, experts, shared, expert_gate, num_heads,
                                     num_kv_heads, scale, input_norm_eps, qk_eps, rope_dims, rope_traditional,
                                     rope_base, rope_scale, top_k, post_norm_eps, normalize, router_group_size,
                                     router_bits, after=None, return_scratch=False):
    """:func:`attention_layer_decode` on arguments already checked (the
    compiled decode step's entry point): ``qk_eps`` = (q_eps, k_eps);
    ``return_scratch``: also the scratch output (tests read h from it)."""
    B, K = mb._rows(x), x.shape[-1]
    hq, hkv = num_heads, num_kv_heads
    (wg, sg, bg), (wu, su, bu), (wd, sd, bd) = experts
    E, I = wg.shape[0], wg.shape[1]
    gw, gs, gb, sgb = expert_gate
    cap = keys.shape[2]
    ns, split_len = splits(cap, B, hkv)
    kern = _kernel(B, K, hq, hkv, rope_dims, rope_traditional, input_norm_weight.dtype, q_norm_weight.dtype, top_k,
                   E, I, int(sgb), router_bits, router_group_size, norm_weight.dtype)
    blocks = grid_blocks(cb.sm_count())
    out, kv_new, at, scratch = kern(
        inputs=[x, input_norm_weight, *qkv, q_norm_weight, k_norm_weight, keys, values, offset, *o_proj, norm_weight,
                *router, wg, sg, bg, wu, su, bu, wd, sd, bd, *shared[0], *shared[1], *shared[2], gw, gs, gb,
                x if after is None else after],
        output_shapes=[tuple(x.shape), (2, B, hkv, 1, DH), (1,), (scratch_words(B, hq, hkv, K, ns, top_k, E, I),)],
        output_dtypes=[mx.bfloat16, mx.bfloat16, mx.int32, mx.uint32],
        grid=(blocks * _THREADS, 1, 1),
        threadgroup=(_THREADS, 1, 1),
        shared_memory=smem_bytes(B, hq, hkv, top_k, I),
        scalars=[input_norm_eps, cap, ns, split_len, *qk_eps, scale * math.log2(math.e), math.log2(rope_base),
                 rope_scale, int(normalize), post_norm_eps],
    )
    index = at.reshape(1, 1, 1, 1)  # the kernel's offset, clamped into the buffers
    keys, values = write_rows(keys, kv_new[0], index), write_rows(values, kv_new[1], index)
    return (out, keys, values, scratch) if return_scratch else (out, keys, values)
