"""Writing new K/V rows into a cache buffer at a traced position.

Every attention step of the package (decode, verify, their references)
writes this token's (or these S tokens') key and value rows into mlx-lm's
``KVCache`` buffers at the cache offset, which a compiled step takes as an
array so that one trace serves every position. The write is
``mx.put_along_axis`` (MLX's ``ScatterAxis``): one launch over the rows
written, in place when the buffer is donated.

Why not ``mx.slice_update`` at an array offset: on MLX's CUDA backend
(``copy_general_dynamic`` in ``mlx/backend/cuda/copy/copy_general_dynamic.cu``,
MLX 0.32) that write launches one thread per element of the *whole buffer*
(each thread rewriting one element of the update, indices taken modulo its
shape) plus a kernel that computes the offset: 20-40 us per write at a 4K
buffer under ncu, 0.6 ms of a 4K decode token's ~4 ms of kernels, growing
with the capacity (bench/results/INDEX.md, "Where the GPU time goes").
It also does not check bounds; the indices here are clamped.
"""

from __future__ import annotations

import mlx.core as mx


def row_index(start: mx.array, count: int, capacity: int) -> mx.array:
    """Positions ``start .. start + count - 1`` clamped into ``[0, capacity)``.

    Args:
        start: int32 array of one element (shape ``()`` or ``(1,)``), the
            first position; may be a traced value.
        count: rows to write (S >= 1).
        capacity: the buffer's length along its position axis (>= 1).

    Returns:
        ``[1, 1, count, 1]`` int32, for :func:`write_rows`. A start outside
        ``[0, capacity - count]`` gives clamped (repeated) positions: the
        buffer's content is then unspecified, but nothing outside it is
        written.
    """
    pos = start.reshape(()).astype(mx.int32) + mx.arange(count, dtype=mx.int32)
    return mx.clip(pos, 0, capacity - 1).reshape(1, 1, count, 1)


def write_rows(buffer: mx.array, rows: mx.array, index: mx.array) -> mx.array:
    """``buffer`` with ``rows`` written at the positions ``index``.

    Args:
        buffer: ``[B, H, L, D]`` a cache buffer.
        rows: ``[B, H, S, D]`` the new rows (cast to the buffer's dtype).
        index: ``[1, 1, S, 1]`` int32 positions in ``[0, L)`` (from
            :func:`row_index`, or a kernel's clamped offset reshaped).

    Returns:
        ``[B, H, L, D]``: the buffer with row ``index[s]`` of every (batch,
        head) replaced by ``rows[:, :, s]``; the other rows unchanged.
        Equal indices leave one of their rows (unspecified which).
    """
    return mx.put_along_axis(buffer, index, rows, axis=2)
