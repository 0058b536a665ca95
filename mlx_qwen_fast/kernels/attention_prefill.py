"""Causal flash-attention prefill on CUDA for head_dim 256: one launch per call.

Replaces, for a chunk of T query tokens, the attention that mlx-lm's
``Qwen3NextAttention`` runs through ``mx.fast.scaled_dot_product_attention``
with ``mask="causal"``: MLX's CUDA backend has no fused kernel for head_dim
256 and materialises the T x L scores of every head (a 2048-token chunk at
128K context: 16 GB of fp32 scores per layer). The kernel walks the keys in
tiles with the online softmax (Milakov & Gimelshein, arXiv 1805.02867) in
FlashAttention-2's loop order (Dao, 2023), on the tensor cores (mma.sync
m16n8k16, fp32 accumulators); its only memory is the output.

Source: ``mlx_qwen_fast/cuda/attention_prefill.cu`` (design, tile sizes and
the cost of a 4K prefill in its header).
"""

from __future__ import annotations

import math
from typing import Dict

import mlx.core as mx

from . import _checks
from . import _cuda_build as cb

__all__ = ["BLOCK_M", "attention_prefill", "smem_bytes", "supports"]

DH = 256
#: Query rows per block (and key positions per tile), as BM / BN in the source.
BLOCK_M = 64
_THREADS = 128
_DTYPES = (mx.bfloat16, mx.float16)
_kernels: Dict[object, cb.CudaKernel] = {}
_ARRAYS = (("queries", f"[B, Hq, T, {DH}] (bf16/f16)", False), ("keys", f"[B, Hkv, L, {DH}]", False),
           ("values", f"[B, Hkv, L, {DH}]", False))


def smem_bytes() -> int:
    """Dynamic shared memory of one block: the Q, K and V tiles, 64 rows of
    256 elements each, rows padded by 16 bytes (``SMEM_BYTES`` in the source)."""
    return 3 * BLOCK_M * (DH + 8) * 2


def _shape_problem(queries, keys, values, offset) -> "str | None":
    """None when the arrays fit the kernel's contract (see
    :func:`attention_prefill`), else what does not (naming the argument)."""
    if queries.ndim != 4 or queries.shape[3] != DH or queries.dtype not in _DTYPES:
        return f"queries must be bf16 or f16 of shape [B, Hq, T, {DH}], got {_checks.describe(queries)}"
    B, hq, T = queries.shape[:3]
    for name, t in (("keys", keys), ("values", values)):
        if t.ndim != 4 or t.shape[0] != B or t.shape[3] != DH or t.dtype != queries.dtype:
            return (f"{name} must be {queries.dtype} of shape [{B}, Hkv, L, {DH}], got {_checks.describe(t)}")
    if tuple(values.shape) != tuple(keys.shape):
        return f"values must have the shape of keys {tuple(keys.shape)}, got {tuple(values.shape)}"
    hkv, L = keys.shape[1], keys.shape[2]
    if hkv < 1 or hq % hkv:
        return f"queries' heads ({hq}) must be a multiple of keys' heads ({hkv})"
    if not (isinstance(offset, int) and not isinstance(offset, bool) and 0 <= offset and offset + T <= L):
        return f"offset must be an int in [0, L - T] = [0, {L - T}], got {offset!r}"
    return None


def supports(queries, keys, values, *, offset=None) -> bool:
    """True when :func:`attention_prefill` takes these arrays: the CUDA
    backend, queries [B, Hq, T, 256] bf16 or f16, keys and values [B, Hkv,
    L, 256] of the same dtype with Hq a multiple of Hkv, and ``offset``
    (default ``L - T``) an int with ``offset + T <= L``. Shape checks only
    (nothing is evaluated)."""
    if not cb.cuda_available() or not all(_checks.is_array(a) for a in (queries, keys, values)):
        return False
    if offset is None and queries.ndim == 4 and keys.ndim == 4:
        offset = keys.shape[2] - queries.shape[2]
    return _shape_problem(queries, keys, values, offset) is None


def _kernel(dtype) -> cb.CudaKernel:
    kern = _kernels.get(dtype)
    if kern is None:
        kern = _kernels[dtype] = cb.CudaKernel("attention_prefill.cu", "mqf_attn_prefill",
                                               dict(ATT_X=cb.dtype_macro(dtype)))
    return kern


def attention_prefill(queries: mx.array, keys: mx.array, values: mx.array, *, scale: float,
                      offset: int) -> mx.array:
    """Causal attention of a chunk of queries over a KV cache (the reference:
    :func:`mlx_qwen_fast.ops.attention.prefill_attention_reference`).

    Query ``t`` sits at position ``offset + t`` and attends the key
    positions ``0 .. offset + t``; query head ``h`` reads KV head ``h // (Hq
    / Hkv)`` (GQA: K/V are never repeated).

    Args:
      queries: [B, Hq, T, 256] bf16 or f16 (normalised and rotated, as the
        attention module hands them to SDPA).
      keys, values: [B, Hkv, L, 256] in queries' dtype, ``Hq % Hkv == 0``:
        the cache with this chunk's rows at ``offset .. offset + T - 1``; L
        may exceed ``offset + T`` (e.g. the cache's whole buffer): positions
        from ``offset + T`` on are never read.
      scale: the softmax scale (``head_dim ** -0.5`` in the model), a
        finite number > 0.
      offset: int, the position of the chunk's first query, ``0 <= offset
        <= L - T``.

    Returns:
      [B, Hq, T, 256] in queries' dtype: ``softmax(scale * q k^T + causal
      mask) v`` per head, the fp32 accumulation rounded once. Its memory is
      laid out as [B, T, Hq, 256] (the array is that buffer transposed), so
      the module's ``transpose(0, 2, 1, 3).reshape(B, T, -1)`` copies
      nothing.

    Raises:
      ValueError: an argument that is not an mx.array, or shapes, dtypes,
        ``scale`` or ``offset`` outside the above (names the argument and
        the expected shape/dtype).
      RuntimeError: no CUDA compiler could build the kernel.
    """
    fn = "attention_prefill"
    _checks.check_arrays(fn, _ARRAYS, queries, keys, values)
    problem = _shape_problem(queries, keys, values, offset)
    if problem is not None:
        raise ValueError(f"{fn}: {problem}")
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale)
            and scale > 0):
        raise ValueError(f"{fn}: scale must be a finite number > 0, got {scale!r}")
    B, hq, T = queries.shape[:3]
    hkv, L = keys.shape[1], keys.shape[2]
    if B == 0 or T == 0:  # no rows: a launch of an empty grid is an error
        return mx.zeros((B, hq, T, DH), queries.dtype)
    nqt = -(-T // BLOCK_M)
    (out,) = _kernel(queries.dtype)(
        [queries, keys, values], [(B, T, hq, DH)], [queries.dtype],
        (nqt * B * hq * _THREADS, 1, 1), (_THREADS, 1, 1),
        (T, L, offset, hq, hkv, float(scale) * math.log2(math.e)),
        shared_memory=smem_bytes())
    return out.transpose(0, 2, 1, 3)
