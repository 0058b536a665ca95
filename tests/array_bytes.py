"""mx.arrays as the raw bytes the kernel checkers hand their CPU-run
programs (metal_check.py, cuda_check.py), and back: row-major, bf16 as its
16-bit patterns (numpy has no bf16)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

#: The numpy type of each MLX dtype's bytes (bf16: its bit patterns).
NP = {mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16, mx.int32: np.int32,
      mx.uint32: np.uint32, mx.int64: np.int64, mx.uint64: np.uint64, mx.int16: np.int16,
      mx.uint16: np.uint16, mx.int8: np.int8, mx.uint8: np.uint8, mx.bool_: np.bool_}


def to_bytes(a: mx.array) -> bytes:
    """``a``'s elements in row-major order (evaluates it)."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.array(a)).tobytes()


def from_bytes(b: bytes, shape, dtype) -> mx.array:
    """An mx.array of ``shape`` and ``dtype`` from row-major bytes."""
    arr = np.frombuffer(b, dtype=NP[dtype]).reshape(shape)
    out = mx.array(arr)
    return out.view(mx.bfloat16) if dtype == mx.bfloat16 else out
