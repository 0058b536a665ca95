"""The chunkwise-parallel (WY / UT transform) form of the gated delta rule, in plain MLX ops.

:func:`gated_delta_chunked`: matmuls within a chunk, a short loop over
chunks for the state (Yang, Kautz & Hatamizadeh, arXiv 2412.06464; Yang et
al., arXiv 2406.06484). Agrees with the reference of record
(:func:`mlx_qwen_fast.ops.gated_delta.naive.gated_delta_recurrent`) to fp32
rounding. Contract: :mod:`mlx_qwen_fast.ops.gated_delta`.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import mlx.core as mx

from ... import backend as _backend
from .checks import _as_bool, _check_chunk_size, _check_inputs

DEFAULT_CHUNK_SIZE = 64


# x86 CPUs handle subnormal floats through microcode assists, ~100x slower
# than normal ones (MLX does not set flush-to-zero).  Decay ratios across a
# chunk (g^C) and products of small UT-transform entries land there easily
# (bench/results/package-figures.md: a whole call several times slower).  So on
# CPU every matmul operand is flushed to 0 below _FTZ = 2^-60 (~8.7e-19):
# a product of two kept values is then >= 2^-120, still a normal float.
# The operands are O(1)-scaled (unit keys, activations, ratios <= 1), so the
# dropped magnitudes are ~1e-12 of an fp32 ulp.  GPUs run subnormals at full
# speed; there the flush is left out (fewer kernels).
_FTZ = 2.0**-60
_LOG_FTZ = -60 * 0.6931471805599453  # log(_FTZ)


def _ftz(x: mx.array) -> mx.array:
    return mx.where(mx.abs(x) < _FTZ, 0.0, x)


def _no_ftz(x: mx.array) -> mx.array:
    return x


def _flush_subnormals() -> bool:
    """Whether the chunked form flushes tiny operands (CPU backend only)."""
    return _backend.current() == _backend.CPU


def _unit_lower_inverse(A: mx.array, ftz: Callable = _no_ftz) -> mx.array:
    """(I + A)^-1 for strictly lower-triangular A [..., C, C], C a power of 2.

    Recursive block doubling with matmuls only (runs on any backend; MLX's
    linalg solvers are CPU-only): start from the 1x1 diagonal blocks (all 1),
    and at each level merge neighbouring s x s inverses Xa, Xb into the
    2s x 2s inverse [[Xa, 0], [-Xb A21 Xa, Xb]], where A21 is the s x s
    block of A below the diagonal inside each 2s block.  log2(C) levels of
    two small batched matmuls (s x s) and a few copies each, ~C^3/3 flops in
    all; exact algebra, no series truncation (recursive triangular inversion,
    cf. Du Croz & Higham, IMA J. Numer. Anal. 12 (1992)); the chunked form's
    error against a float64 loop stays at fp32 rounding level even for
    strongly correlated keys (the op's tests check it).  ``ftz`` is applied
    to each new off-diagonal block (see _FTZ).
    """
    C = A.shape[-1]
    lead = A.shape[:-2]
    nd = len(lead)
    X = mx.ones((*lead, C, 1, 1), dtype=A.dtype)  # inverses of 1x1 blocks
    s = 1
    while s < C:
        n = C // (2 * s)
        # diagonal 2s x 2s blocks of A: [..., n, 2s, 2s]
        blk = mx.diagonal(A.reshape(*lead, n, 2 * s, n, 2 * s), 0, nd, nd + 2)
        blk = mx.moveaxis(blk, -1, nd)
        A21 = blk[..., s:, :s]
        Xp = X.reshape(*lead, n, 2, s, s)
        Xa = Xp[..., 0, :, :]
        Xb = Xp[..., 1, :, :]
        off = ftz(-(ftz(Xb @ A21) @ Xa))
        top = mx.concatenate([Xa, mx.zeros_like(Xa)], axis=-1)
        bot = mx.concatenate([off, Xb], axis=-1)
        X = mx.concatenate([top, bot], axis=-2)
        s *= 2
    return X.reshape(*lead, C, C)


def _make_chunk_fns(flush: bool):
    """Compiled (prepare, step) of the chunked form, with or without _FTZ."""
    ftz = _ftz if flush else _no_ftz

    @mx.compile
    def prepare(q, k, v, lg, beta):
        """Everything that is parallel over chunks.

        q, k: [N, B, Hk, 1, C, Dk]; v: [N, B, Hk, R, C, Dv]; lg (log decay,
        0 on identity steps), beta: [N, B, Hk, R, C]; all float32 (N =
        chunk count).

        Per chunk and value head, with b_i = sum_{l<=i} lg_l (gamma_i =
        exp(b_i) is the decay from the chunk start through step i) and
        ratio_ij = gamma_i / gamma_j = exp(sum_{j<l<=i} lg_l) (segment sums,
        not differences of cumulative sums, for accuracy under strong decay):

          A      = strictly_lower(diag(beta) K K^T * ratio)
          Tm     = (I + A)^-1                        (UT / WY transform)
          U      = Tm diag(beta) V,  W = Tm diag(beta * gamma) K
          Attn   = Q K^T * ratio  (lower incl. diagonal)
          delta  = U - W S0^T                        (per-step writes)
          y      = gamma * Q S0^T + Attn delta
                 = Attn U + (gamma * Q - Attn W) S0^T
          S_end  = gamma_C S0 + delta^T (ratio_{C,:} * K)

        Returns WQ = [W ; gamma Q - Attn W] [N, ..., 2C, Dk], UY = [U ;
        Attn U] [N, ..., 2C, Dv], Kd = ratio_{C,:} * K [N, ..., C, Dk] and
        gamma_C [N, ..., 1, 1].
        """
        C = q.shape[-2]
        idx = mx.arange(C)
        lower_strict = idx[:, None] > idx[None, :]
        lower_incl = idx[:, None] >= idx[None, :]
        # segment sums: seg[i, j] = sum_{j < l <= i} lg_l  (i >= j)
        seg = mx.cumsum(mx.where(lower_strict, lg[..., :, None], 0.0), axis=-2)
        b = mx.cumsum(lg, axis=-1)
        if flush:  # exp() never returns a subnormal, ratios < _FTZ are 0
            ratio = mx.where(
                lower_incl & (seg > _LOG_FTZ), mx.exp(mx.maximum(seg, _LOG_FTZ)), 0.0
            )
            gamma = mx.where(b > _LOG_FTZ, mx.exp(mx.maximum(b, _LOG_FTZ)), 0.0)
        else:
            ratio = mx.where(lower_incl, mx.exp(seg), 0.0)  # [.., C, C]
            gamma = mx.exp(b)  # [.., C]
        ratio_last = ratio[..., -1, :]  # gamma_C / gamma_j

        kt = mx.swapaxes(k, -1, -2)
        KK = k @ kt  # [N, B, Hk, 1, C, C], shared by the R value heads
        QK = q @ kt
        A = ftz(mx.where(lower_strict, beta[..., :, None] * KK * ratio, 0.0))
        Tm = _unit_lower_inverse(A, ftz)
        U = ftz(Tm @ ftz(beta[..., None] * v))
        W = ftz(Tm @ ftz((beta * gamma)[..., None] * k))
        Attn = ftz(QK * ratio)
        UY = mx.concatenate([U, Attn @ U], axis=-2)
        WQ = mx.concatenate([W, ftz(gamma[..., None] * q - Attn @ W)], axis=-2)
        Kd = ftz(ratio_last[..., None] * k)
        g_last = gamma[..., -1:, None]
        return WQ, UY, Kd, g_last

    @mx.compile
    def step(S, WQ, UY, Kd, g_last):
        """Carry the state over one chunk.

        S [B, Hk, R, Dv, Dk]; WQ [B, Hk, R, 2C, Dk]; UY [B, Hk, R, 2C, Dv];
        Kd [B, Hk, R, C, Dk]; g_last [B, Hk, R, 1, 1].  Returns y_chunk
        [B, Hk, R, C, Dv] and the state after the chunk.
        """
        C = Kd.shape[-2]
        P = WQ @ mx.swapaxes(S, -1, -2)  # [.., 2C, Dv]
        delta = ftz(UY[..., :C, :] - P[..., :C, :])
        y = UY[..., C:, :] + P[..., C:, :]
        S = ftz(g_last * S + mx.swapaxes(delta, -1, -2) @ Kd)
        return y, S

    return prepare, step


_CHUNK_FNS = {flush: _make_chunk_fns(flush) for flush in (False, True)}


def gated_delta_chunked(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: Optional[mx.array] = None,
    mask: Optional[mx.array] = None,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tuple[mx.array, mx.array]:
    """Gated delta rule in chunkwise-parallel form (plain MLX ops, fp32).

    Algorithm: the chunkwise WY/UT form of the gated delta rule (Yang, Kautz,
    Hatamizadeh, arXiv 2412.06464; the DeltaNet chunkwise form of Yang et
    al., arXiv 2406.06484): inside each chunk of ``chunk_size``
    steps, cumulative log-decay (as segment sums), the UT transform
    ``(I + strictly_lower(diag(beta) K K^T * decay ratios))^-1`` (inverted by
    matmul-only block doubling, see :func:`_unit_lower_inverse`), the w/u
    vectors, intra-chunk attention with the decay mask; then a loop over
    chunks (two matmuls each) carries the state.  No per-token loop; graph
    size is independent of T apart from the chunk loop.

    T not a multiple of the chunk is padded with identity steps (beta=0,
    g=1); masked steps (mask False) are made identity steps too, and their y
    set to 0.  When T < chunk_size the chunk shrinks to the next power of two
    >= T.  Scratch memory grows linearly with T (roughly
    T * Hv * (5 * D + 4 * C) * 4 bytes: ~0.2 GB at T=2048 for Hv=32, D=128,
    C=64); callers bound it by prefilling in pieces, as mlx-lm does.

    Args:
      q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; g, beta: [B, T, Hv];
      state: [B, Hv, Dv, Dk] float32 or None; mask: [B, T] bool or None --
        as in the package docstring (:mod:`mlx_qwen_fast.ops.gated_delta`).
      chunk_size: steps per chunk, a power of two (default 64).

    Returns:
      (y [B, T, Hv, Dv] in q.dtype, state [B, Hv, Dv, Dk] float32).  Agrees
      with :func:`gated_delta_recurrent` to fp32 rounding (relative L2 error
      ~1e-6 on y and state for fp32 inputs).

    Raises:
      ValueError: shape/dtype errors as for :func:`gated_delta_recurrent`,
        or ``chunk_size`` not an int (a bool is not) that is a positive
        power of two.
    """
    _check_chunk_size("gated_delta_chunked", chunk_size)
    B, T, Hk, Dk, Hv, Dv = _check_inputs(q, k, v, g, beta, state, mask, "gated_delta_chunked")
    R = Hv // Hk
    f32 = mx.float32
    if T == 0:
        st = mx.zeros((B, Hv, Dv, Dk), f32) if state is None else state
        return mx.zeros((B, 0, Hv, Dv), q.dtype), st

    C = min(chunk_size, 1 << (T - 1).bit_length())
    N = -(-T // C)
    Tp = N * C

    lg = mx.log(g.astype(f32))
    bt = beta.astype(f32)
    if mask is not None:
        mask = _as_bool(mask)
        lg = mx.where(mask[..., None], lg, 0.0)
        bt = mx.where(mask[..., None], bt, 0.0)
    qf, kf, vf = q.astype(f32), k.astype(f32), v.astype(f32)
    if Tp != T:
        pad = Tp - T
        qf = mx.pad(qf, [(0, 0), (0, pad), (0, 0), (0, 0)])
        kf = mx.pad(kf, [(0, 0), (0, pad), (0, 0), (0, 0)])
        vf = mx.pad(vf, [(0, 0), (0, pad), (0, 0), (0, 0)])
        lg = mx.pad(lg, [(0, 0), (0, pad), (0, 0)])
        bt = mx.pad(bt, [(0, 0), (0, pad), (0, 0)])

    # chunk-major layouts: [N, B, Hk, R|1, C, D]
    qc = qf.reshape(B, N, C, Hk, 1, Dk).transpose(1, 0, 3, 4, 2, 5)
    kc = kf.reshape(B, N, C, Hk, 1, Dk).transpose(1, 0, 3, 4, 2, 5)
    vc = vf.reshape(B, N, C, Hk, R, Dv).transpose(1, 0, 3, 4, 2, 5)
    lgc = lg.reshape(B, N, C, Hk, R).transpose(1, 0, 3, 4, 2)
    btc = bt.reshape(B, N, C, Hk, R).transpose(1, 0, 3, 4, 2)

    prepare, step = _CHUNK_FNS[_flush_subnormals()]
    WQ, UY, Kd, g_last = prepare(qc, kc, vc, lgc, btc)

    if state is None:
        S = mx.zeros((B, Hk, R, Dv, Dk), dtype=f32)
    else:
        S = state.reshape(B, Hk, R, Dv, Dk)
    ys = []
    for c in range(N):
        y, S = step(S, WQ[c], UY[c], Kd[c], g_last[c])
        ys.append(y)
    y = ys[0] if N == 1 else mx.stack(ys, axis=0)
    # [N, B, Hk, R, C, Dv] -> [B, N, C, Hk, R, Dv]
    y = y.reshape(N, B, Hk, R, C, Dv).transpose(1, 0, 4, 2, 3, 5)
    y = y.reshape(B, Tp, Hv, Dv)
    if Tp != T:
        y = y[:, :T]
    if mask is not None:
        y = mx.where(mask[:, :, None, None], y, 0.0)
    return y.astype(q.dtype), S.reshape(B, Hv, Dv, Dk)
