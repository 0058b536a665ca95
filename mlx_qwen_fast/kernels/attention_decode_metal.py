"""Gated attention decode on Metal for head_dim 256: two or three kernels per layer.

The contract of :func:`mlx_qwen_fast.kernels.attention_decode.attention_decode`
(the CUDA kernels; same arguments, checks
(:func:`~mlx_qwen_fast.kernels.attention_contract.check_step`) and outputs,
at most :data:`MAX_GROUP` query heads per KV head): for one query token per row, the
q/k RMSNorms, RoPE at the cache offset (a 0-d int32 array), the KV cache
write, attention over the cache and the sigmoid output gate, between the
concatenated q|k|v projection and ``o_proj``:

1. the new key: RMSNorm + RoPE of each KV head (one SIMD group per head,
   ``metal/attention_decode_key.metal``), and the offset clamped into the
   buffer;
2. two row writes into the cache buffers at that row (``_cache_rows``: in place when
   the buffers are donated, as mlx-lm's ``KVCache`` and the decoder layer
   step write them);
3. attention: one threadgroup per (row, KV head[, block]) with one SIMD
   group per query head of that KV head; each computes its query's RMSNorm
   + RoPE, and the threadgroup streams the K/V rows through threadgroup
   memory in tiles of 16 KB, each row read from device memory once for all
   the KV head's query heads (GQA packing, as the published engine's decode
   attention: pplx-garden ``lily/``, whose folded-GQA split decode reuses
   each K/V row across query heads). Online softmax in fp32 (Milakov &
   Gimelshein, arXiv 1805.02867), scores in log2 units.

   * capacity <= :data:`SINGLE_PASS_MAX`: one pass over the cache with the
     output gate (``metal/attention_decode_single.metal``);
   * above it, split-K over fixed blocks of :data:`BLOCK` positions
     (``metal/attention_decode_split.metal``: unnormalised partials with
     their max and sum; blocks past the offset write empty ones), then the
     log-sum-exp combine with the gate (``metal/attention_decode_combine.metal``;
     the flash-decoding split of Dao et al., "Flash-Decoding for long-context
     inference", 2023). The scratch between them is ``B * Hq * blocks * 258``
     floats, 1 KB per query head and block.

Every kernel takes ``metal/attention_decode.h`` as its header (the shared
norm + RoPE and the tiled online softmax). The choice between 3a and 3b
depends on the buffer's capacity (a shape), not on the offset (an array):
one trace of the compiled decoder step serves every position of a capacity.

Verified only by running MLX's generated source on the CPU
(``tests/metal_check.py``) against the fp32 reference; never run on an
Apple GPU, never timed: :data:`SINGLE_PASS_MAX` and :data:`BLOCK` come from
the byte and occupancy arithmetic below, not from a measurement.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, Tuple

import mlx.core as mx

from . import _checks
from ._cache_rows import write_rows
from .attention_contract import DH, FLOAT_DTYPES, check_step, proj_width

__all__ = ["attention_decode_metal", "blocks", "supports", "BLOCK", "MAX_GROUP", "SINGLE_PASS_MAX", "SOURCE_DIR"]

SOURCE_DIR = Path(__file__).resolve().parents[1] / "metal"

#: Query heads per KV head at most: one SIMD group each, so a threadgroup
#: has at most 256 threads, and its threadgroup memory stays at 16.5 KB of
#: K/V tile + 8 KB of queries + 1 KB of weights (25.5 KB of the 32 KB).
MAX_GROUP = 8

#: Cache positions per split-K block. A block's partials are 1 KB per query
#: head (256 fp32 accumulators, max, sum), written and read once: against
#: the block's 256 KB of K/V rows per KV head in bf16 (1 KB per position)
#: that is 8 KB per 256 KB at the model's 8 query heads per KV head (3%),
#: where 64-position blocks would make it 13%. It is also mlx-lm's
#: ``KVCache.step``: a grown buffer always ends on a block boundary.
BLOCK = 256

#: Largest capacity that runs as one pass (no partials, no combine launch).
#: Why one block: the single pass has B * Hkv threadgroups (2 for the
#: model's layer at batch 1), each streaming capacity * 1 KB of bf16 K/V
#: rows through one GPU core. Apple's GPUs have 8 to 80 cores on 68 to
#: 800 GB/s, 8-14 GB/s of DRAM bandwidth per core (M1 to M4, Apple's
#: figures): even at four times that share a 256-position block keeps a
#: core ~5-30 us, while the split path adds one dispatch (a few us) and its
#: partials (33 KB written and read per row at 16 query heads). Up to one
#: block the split would run the same threadgroups plus the combine, so one
#: pass wins; from the second block on it runs the blocks on separate
#: cores at once, saving a block's streaming time, more than the combine
#: costs, per block added.
SINGLE_PASS_MAX = BLOCK

_ARGS = ("T", "W", "HQ", "HKV", "ROPE_DIMS", "ROPE_TRAD")
_SPECS = {
    "key": (["proj", "k_norm_weight", "offset", "cap", "cfg"], ["k_new", "at"]),
    "single": (["proj", "keys", "values", "offset", "q_norm_weight", "cfg"], ["out"]),
    "split": (["proj", "keys", "values", "offset", "q_norm_weight", "cfg"], ["part"]),
    "combine": (["part", "proj"], ["out"]),
}
_KERNELS: Dict[str, object] = {}  # built on first use: only a call needs Metal


def _kernel(kind: str):
    kern = _KERNELS.get(kind)
    if kern is None:
        inputs, outputs = _SPECS[kind]
        kern = _KERNELS[kind] = mx.fast.metal_kernel(
            name=f"mqf_attention_decode_{kind}", input_names=inputs, output_names=outputs,
            source=(SOURCE_DIR / f"attention_decode_{kind}.metal").read_text(),
            header=(SOURCE_DIR / "attention_decode.h").read_text())
    return kern


def blocks(capacity: int) -> int:
    """Split-K blocks of a cache of ``capacity`` positions: 0 where it runs
    as one pass (capacity <= :data:`SINGLE_PASS_MAX`), else
    ``ceil(capacity / BLOCK)``."""
    return 0 if capacity <= SINGLE_PASS_MAX else -(-capacity // BLOCK)


def supports(proj, keys, values, *, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """True when :func:`attention_decode_metal` takes this step: MLX's Metal
    backend, head_dim 256, ``num_heads`` a multiple of ``num_kv_heads`` with
    at most :data:`MAX_GROUP` query heads per KV head, one token (``proj``
    [B, 1, P]) and cache buffers [B, Hkv, capacity >= 1, 256] of proj's
    float dtype. Shape checks only (nothing is evaluated)."""
    if not mx.metal.is_available() or head_dim != DH:
        return False
    if not all(_checks.is_array(a) for a in (proj, keys, values)):
        return False
    if not (isinstance(num_heads, int) and isinstance(num_kv_heads, int)) or num_kv_heads <= 0 or (
            num_heads % num_kv_heads or not 0 < num_heads // num_kv_heads <= MAX_GROUP):
        return False
    if proj.ndim != 3 or proj.shape[1] != 1 or proj.shape[-1] != proj_width(num_heads, num_kv_heads):
        return False
    B = proj.shape[0]
    if proj.dtype not in FLOAT_DTYPES or keys.dtype != proj.dtype or values.dtype != proj.dtype:
        return False
    return keys.ndim == 4 and tuple(keys.shape) == tuple(values.shape) and B > 0 and (
        tuple(keys.shape[:2]) == (B, num_kv_heads) and keys.shape[2] >= 1 and keys.shape[3] == DH)


def attention_decode_metal(
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
    q|k|v projection, on Metal (the reference:
    :func:`mlx_qwen_fast.ops.attention.decode_attention_reference`).

    Args:
      proj: [B, 1, 2*Hq*256 + 2*Hkv*256] bf16/f16/f32: per row, for each
        query head its query (256) then its gate (256), then the keys and
        the values of the KV heads (256 each).
      keys, values: [B, Hkv, capacity, 256] in proj's dtype: the cache
        buffers; positions ``[0, offset)`` hold the earlier tokens.
      offset: 0-d int32, this token's position, in ``[0, capacity)``. Out of
        that range the result is unspecified, but nothing outside the
        buffers is read or written (the row written is the offset clamped
        into the buffer).
      q_norm_weight, k_norm_weight: [256], one float dtype (the normalised
        values are rounded to proj's dtype, as the CUDA kernels do).
      num_heads, num_kv_heads: Hq, Hkv (Hq / Hkv <= :data:`MAX_GROUP`).
      scale: the softmax scale; q_eps, k_eps: the RMSNorms' eps;
      rope_dims, rope_traditional, rope_base, rope_scale: ``nn.RoPE``'s.

    Returns:
      ``(out, keys, values)``: out [B, 1, Hq*256] in proj's dtype (attention
      output times ``sigmoid(gate)``, before ``o_proj``); the buffers with
      this token's key (normalised, rotated) and value at ``offset``.

    Raises:
      ValueError: as the CUDA kernels' checks (the argument named), and
        more than :data:`MAX_GROUP` query heads per KV head (``num_heads``).
      RuntimeError: MLX has no Metal back-end here (raised by MLX).
    """
    hq, hkv = num_heads, num_kv_heads
    eps_q, eps_k = check_step(
        "attention_decode_metal", proj, keys, values, offset, q_norm_weight, k_norm_weight, hq, hkv, scale,
        q_eps, k_eps, rope_dims, rope_base, rope_scale, max_group=MAX_GROUP)
    B, x, w, cap = proj.shape[0], proj.dtype, q_norm_weight.dtype, keys.shape[2]
    if B == 0:
        return mx.zeros((0, 1, hq * DH), x), keys, values
    flat = proj.reshape(B, -1)
    cfg = mx.array([eps_q, eps_k, float(scale) * math.log2(math.e), math.log2(rope_base), float(rope_scale)],
                   mx.float32)
    template = list(zip(_ARGS, (x, w, hq, hkv, rope_dims, bool(rope_traditional))))
    k_new, at = _kernel("key")(
        inputs=[flat, k_norm_weight, offset, mx.array(cap, mx.int32), cfg], template=template,
        grid=(B * hkv * 32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(B, hkv, 1, DH), (1,)],
        output_dtypes=[x, mx.int32])
    v_new = proj[:, :, 2 * hq * DH + hkv * DH:].reshape(B, 1, hkv, DH).transpose(0, 2, 1, 3)
    index = at.reshape(1, 1, 1, 1)  # the kernel's offset, clamped into the buffer
    keys, values = write_rows(keys, k_new, index), write_rows(values, v_new, index)
    g = hq // hkv
    ns = blocks(cap)
    inputs = [flat, keys, values, offset, q_norm_weight, cfg]
    if ns == 0:
        (out,) = _kernel("single")(
            inputs=inputs, template=template, grid=(B * hkv * g * 32, 1, 1), threadgroup=(g * 32, 1, 1),
            output_shapes=[(B, hq * DH)], output_dtypes=[x])
    else:
        (part,) = _kernel("split")(
            inputs=inputs, template=template + [("BLOCK", BLOCK)], grid=(B * hkv * ns * g * 32, 1, 1),
            threadgroup=(g * 32, 1, 1), output_shapes=[(B * hq, ns, DH + 2)], output_dtypes=[mx.float32])
        (out,) = _kernel("combine")(
            inputs=[part, flat], template=[("T", x), ("HQ", hq), ("HKV", hkv)], grid=(B * hq * DH, 1, 1),
            threadgroup=(DH, 1, 1), output_shapes=[(B, hq * DH)], output_dtypes=[x])
    return out.reshape(B, 1, hq * DH), keys, values
