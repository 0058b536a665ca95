"""Gated attention decode on CUDA for head_dim 256: three launches per layer.

Replaces, for one query token per row, what mlx-lm's ``Qwen3NextAttention``
runs between the q|k|v projection and ``o_proj``: the q/k RMSNorms, RoPE at
the cache offset, the KV cache write, scaled dot-product attention over the
cache (MLX's CUDA backend has no fused kernel for head_dim 256 and runs two
matmuls and a softmax over a masked buffer) and the sigmoid output gate:
about 13 launching graph nodes (bench/results/INDEX.md, "nodes") become

1. the new key: RMSNorm + RoPE of each KV head (one warp per head);
2. two row writes into the cache buffers at the offset (``_cache_rows``: in
   place when the buffers are donated, as mlx-lm's ``KVCache`` writes them);
3. split-K attention: each block takes one (row, KV head, split of the
   positions) and all the query heads of that KV head (GQA without repeating
   K/V: each K/V row is read once per block from shared memory), computes
   those heads' RMSNorm + RoPE itself, and writes unnormalised partial
   outputs with their running max and sum (the flash-decoding split of Dao
   et al., "Flash-Decoding for long-context inference", 2023; online softmax
   of Milakov & Gimelshein, arXiv 1805.02867);
4. the combine of the splits with the output gate.

Source: ``mlx_qwen_fast/cuda/attention_decode.cu`` (ATT_KIND 0, 1, 2). The
scratch between 3 and 4 is ``B * Hq * splits * 258`` floats: at most 256
blocks per call (:func:`splits`), independent of the context length.
"""

from __future__ import annotations

import math
from typing import Dict, Tuple

import mlx.core as mx

from . import _checks
from . import _cuda_build as cb
from ._cache_rows import write_rows
from .attention_contract import DH, FLOAT_DTYPES, check_step, proj_width

__all__ = ["attention_decode", "splits", "supports", "MAX_GROUP"]

#: Query heads per KV head at most: a block of the partial-attention kernel
#: takes all of a KV head's query heads, one warp each (512 threads at most).
MAX_GROUP = 16
_kernels: Dict[tuple, cb.CudaKernel] = {}
#: Positions per split at least; blocks per call at most (about two per SM on an H200).
MIN_SPLIT = 64
MAX_BLOCKS = 256
_NAMES = {0: "mqf_attn_dec_key", 1: "mqf_attn_dec_part", 2: "mqf_attn_dec_combine"}


def splits(capacity: int, batch: int, num_kv_heads: int) -> Tuple[int, int]:
    """``(number of splits, positions per split)`` of a cache of
    ``capacity`` positions: at least :data:`MIN_SPLIT` positions per split,
    at most :data:`MAX_BLOCKS` blocks (``batch * num_kv_heads * splits``)."""
    ns = max(1, min(capacity // MIN_SPLIT, MAX_BLOCKS // max(1, batch * num_kv_heads)))
    return ns, -(-capacity // ns)


def part_smem_bytes(group: int) -> int:
    """Dynamic shared memory of the partial-attention kernel, bytes: two
    stages of a K and a V tile (16 KB each, whatever the dtype) and one
    256-float row per query head of the block (``group`` = Hq / Hkv)."""
    return 2 * 2 * 16384 + group * DH * 4


def supports(proj, keys, values, *, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """True when :func:`attention_decode` takes this step: the CUDA
    backend, head_dim 256, ``num_heads`` a multiple of ``num_kv_heads`` with
    at most 16 query heads per KV head, one token (``proj`` [B, 1, P]) and
    cache buffers [B, Hkv, capacity >= 1, 256] of proj's float dtype. Shape
    checks only (nothing is evaluated)."""
    if not cb.cuda_available() or head_dim != DH:
        return False
    if not all(_checks.is_array(a) for a in (proj, keys, values)):
        return False
    if num_kv_heads <= 0 or num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        return False
    if proj.ndim != 3 or proj.shape[1] != 1 or proj.shape[-1] != proj_width(num_heads, num_kv_heads):
        return False
    B = proj.shape[0]
    if proj.dtype not in FLOAT_DTYPES or keys.dtype != proj.dtype or values.dtype != proj.dtype:
        return False
    return keys.ndim == 4 and tuple(keys.shape) == tuple(values.shape) and B > 0 and (
        tuple(keys.shape[:2]) == (B, num_kv_heads) and keys.shape[2] >= 1 and keys.shape[3] == DH)


def _kernel(kind: int, x, w, hq: int, hkv: int, rope_dims: int, traditional: bool) -> cb.CudaKernel:
    key = (kind, x, w, hq, hkv, rope_dims, traditional)
    kern = _kernels.get(key)
    if kern is None:
        kern = _kernels[key] = cb.CudaKernel("attention_decode.cu", _NAMES[kind], dict(
            ATT_KIND=kind, ATT_X=cb.dtype_macro(x), ATT_W=cb.dtype_macro(w), ATT_HQ=hq, ATT_HKV=hkv,
            ATT_ROPE_DIMS=rope_dims, ATT_ROPE_TRAD=int(bool(traditional))))
    return kern


def attention_decode(
    proj: mx.array,
    keys: mx.array,
    values: mx.array,
    offset: mx.array,
    q_norm_weight: mx.array,
    k_norm_weight: mx.array,
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    q_eps: float,
    k_eps: float,
    rope_dims: int,
    rope_traditional: bool = False,
    rope_base: float = 10000.0,
    rope_scale: float = 1.0,
) -> Tuple[mx.array, mx.array, mx.array]:
    """One decode step of gated attention (``Qwen3NextAttention``) after the
    q|k|v projection: q/k RMSNorm, RoPE, the cache write, attention over the
    cache and the sigmoid gate (the reference:
    :func:`mlx_qwen_fast.ops.attention.decode_attention_reference`).

    Args:
      proj: [B, 1, :func:`~.attention_contract.proj_width`] bf16/f16/f32:
        per row, for each query head its query (256) then its gate (256),
        then the keys and the values of the KV heads (256 each), as the
        concatenated q|k|v projection gives them.
      keys, values: [B, Hkv, capacity, 256] in proj's dtype: the cache
        buffers; positions ``[0, offset)`` hold the earlier tokens.
      offset: 0-d int32, this token's position, in ``[0, capacity)`` (the
        caller makes room). Out of that range the result is unspecified, but
        nothing outside the buffers is read or written (the cache row
        written is the offset clamped into the buffer).
      q_norm_weight, k_norm_weight: [256], one float dtype.
      num_heads, num_kv_heads: Hq, Hkv (Hq / Hkv <= :data:`MAX_GROUP`).
      scale: the softmax scale (``head_dim ** -0.5`` in the model).
      q_eps, k_eps: the RMSNorms' eps.
      rope_dims, rope_traditional, rope_base, rope_scale: ``nn.RoPE``'s
        ``dims``, ``traditional``, ``base`` and ``scale``.

    Returns:
      ``(out, keys, values)``: out [B, 1, Hq*256] in proj's dtype
      (attention output times ``sigmoid(gate)``, before ``o_proj``); the
      buffers with this token's key (normalised, rotated) and value
      written at ``offset``.

    Raises:
      ValueError: an argument that is not an mx.array, or shapes/dtypes/
        settings outside the above (names the argument).
      RuntimeError: no CUDA compiler could build the kernels.
    """
    hq, hkv = num_heads, num_kv_heads
    eps_q, eps_k = check_step("attention_decode", proj, keys, values, offset, q_norm_weight, k_norm_weight, hq,
                              hkv, scale, q_eps, k_eps, rope_dims, rope_base, rope_scale, max_group=MAX_GROUP)
    B, x, w, cap = proj.shape[0], proj.dtype, q_norm_weight.dtype, keys.shape[2]
    if B == 0:  # no rows: a launch of an empty grid is an error
        return mx.zeros((0, 1, hq * DH), x), keys, values
    args = (x, w, hq, hkv, rope_dims, rope_traditional)
    log2_base = math.log2(rope_base)
    k_new, at = _kernel(0, *args)([proj, k_norm_weight, offset], [(B, hkv, 1, DH), (1,)], [x, mx.int32],
                                  (B * hkv * 32, 1, 1), (32, 1, 1), (cap, eps_k, log2_base, float(rope_scale)))
    v_new = proj[:, :, 2 * hq * DH + hkv * DH:].reshape(B, 1, hkv, DH).transpose(0, 2, 1, 3)
    index = at.reshape(1, 1, 1, 1)  # the kernel's offset, clamped into the buffer
    keys, values = write_rows(keys, k_new, index), write_rows(values, v_new, index)
    ns, split_len = splits(cap, B, hkv)
    g = hq // hkv
    (part,) = _kernel(1, *args)(
        [proj, keys, values, offset, q_norm_weight], [(B * hq * ns * (DH + 2),)], [mx.float32],
        (B * hkv * ns * g * 32, 1, 1), (g * 32, 1, 1),
        (cap, ns, split_len, eps_q, float(scale) * math.log2(math.e), log2_base, float(rope_scale)),
        shared_memory=part_smem_bytes(g))
    (out,) = _kernel(2, *args)([part, proj], [(B, 1, hq * DH)], [x], (B * hq * DH, 1, 1), (DH, 1, 1), (ns,),
                               shared_memory=4 * ns)
    return out, keys, values
