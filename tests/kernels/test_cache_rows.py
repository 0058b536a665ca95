"""kernels._cache_rows: K/V rows written at a traced position, against numpy."""

import numpy as np
import pytest

import mlx.core as mx

from mlx_qwen_fast.kernels._cache_rows import row_index, write_rows


def _expect(buf: np.ndarray, rows: np.ndarray, start: int) -> np.ndarray:
    out = buf.copy()
    L = buf.shape[2]
    for s in range(rows.shape[2]):
        out[:, :, min(max(start + s, 0), L - 1)] = rows[:, :, s]
    return out


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("B,H,L,D,S", [(1, 2, 256, 256, 1), (2, 2, 300, 64, 3), (3, 1, 17, 8, 16), (1, 4, 1, 4, 1)])
def test_rows_land_at_start(dtype, B, H, L, D, S):
    """Fresh random buffers and rows: every start that fits (the edges
    included) writes exactly rows start .. start + S - 1, eagerly and inside
    mx.compile with the start as a traced input."""
    rng = np.random.default_rng(B * 1000 + L + S)
    buf = rng.standard_normal((B, H, L, D)).astype(np.float32)
    rows = rng.standard_normal((B, H, S, D)).astype(np.float32)
    buf_mx, rows_mx = mx.array(buf).astype(dtype), mx.array(rows).astype(dtype)
    # the values as the dtype holds them: the write itself must be exact
    buf_q, rows_q = np.array(buf_mx.astype(mx.float32)), np.array(rows_mx.astype(mx.float32))

    @mx.compile
    def traced(b, r, start):
        return write_rows(b, r, row_index(start, S, L))

    starts = sorted({0, L - S, (L - S) // 2})  # the first, the middle and the last start that fit
    for start in starts:
        for fn in (lambda b, r, s: write_rows(b, r, row_index(s, S, L)), traced):
            got = fn(buf_mx, rows_mx, mx.array(start, mx.int32))
            assert got.dtype == dtype and got.shape == buf.shape
            np.testing.assert_array_equal(np.array(got.astype(mx.float32)), _expect(buf_q, rows_q, start))


@pytest.mark.parametrize("start", [-5, -1, 250, 255, 256, 10**6])
def test_out_of_range_start_is_clamped(start):
    """A start outside the buffer writes the clamped rows and nothing outside
    the buffer (the rows not addressed keep their values)."""
    B, H, L, D, S = 1, 2, 256, 8, 4
    rng = np.random.default_rng(7)
    buf = rng.standard_normal((B, H, L, D)).astype(np.float32)
    rows = rng.standard_normal((B, H, S, D)).astype(np.float32)
    idx = row_index(mx.array([start], mx.int32), S, L)
    assert idx.shape == (1, 1, S, 1) and idx.dtype == mx.int32
    pos = np.clip(start + np.arange(S), 0, L - 1)
    np.testing.assert_array_equal(np.array(idx).reshape(-1), pos)
    got = np.array(write_rows(mx.array(buf), mx.array(rows), idx))
    untouched = np.setdiff1d(np.arange(L), pos)
    np.testing.assert_array_equal(got[:, :, untouched], buf[:, :, untouched])
    for p in np.unique(pos):  # each addressed row holds one of the rows sent there
        sent = [s for s in range(S) if pos[s] == p]
        assert any(np.array_equal(got[:, :, p], rows[:, :, s]) for s in sent)


def test_rows_cast_to_buffer_dtype_and_broadcast_index():
    """Rows of another dtype are cast (as the cache stores them); one index
    serves every batch row and head (strided rows, e.g. a transposed view)."""
    B, H, L, D = 2, 3, 10, 4
    buf = mx.zeros((B, H, L, D), mx.bfloat16)
    rows = mx.arange(B * 1 * H * D, dtype=mx.float32).reshape(B, 1, H, D).transpose(0, 2, 1, 3)
    got = write_rows(buf, rows, row_index(mx.array(6, mx.int32), 1, L))
    assert got.dtype == mx.bfloat16
    exp = np.zeros((B, H, L, D), np.float32)
    exp[:, :, 6] = np.array(rows)[:, :, 0]
    np.testing.assert_array_equal(np.array(got.astype(mx.float32)), exp)
