"""Gated DeltaNet recurrence: reference, chunkwise-parallel form, dispatch.

Replaces ``mlx_lm.models.gated_delta.gated_delta_update``.  On Apple GPUs
mlx-lm runs the recurrence with Metal kernels; on CUDA and CPU it falls back
to ``gated_delta_ops``, a Python loop over every token (about 40 graph nodes
per token per layer, ~90% of stock prefill time on CUDA).  This module keeps
the Metal path and replaces the fallback with

* :func:`gated_delta_recurrent` -- the per-token recurrence in plain MLX ops,
  fp32 math (the reference of record; also the decode path, T small);
* :func:`gated_delta_chunked` -- the chunkwise-parallel (WY / UT transform)
  form of Yang, Kautz & Hatamizadeh, "Gated Delta Networks: Improving Mamba2
  with Delta Rule" (arXiv 2412.06464) and Yang et al., "Parallelizing Linear
  Transformers with the Delta Rule over Sequence Length" (arXiv 2406.06484):
  matmuls within a chunk, a short loop over chunks for the state.

Contract (the same as mlx-lm's)
-------------------------------
===========  ====================  =========================================
argument     shape                 dtype / meaning
===========  ====================  =========================================
q, k         [B, T, Hk, Dk]        any float; already L2-normalised, the
                                   ``Dk**-0.5`` scale folded into q
                                   (``mlx_lm...gated_delta.normalize_qk``)
v            [B, T, Hv, Dv]        any float; Hv a multiple of Hk, value
                                   head h reads key head ``h // (Hv // Hk)``
g            [B, T, Hv]            decay per step and value head, in (0, 1]
                                   (float32 from :func:`compute_gates`)
beta         [B, T, Hv]            write strength, in [0, 1] (sigmoid)
state        [B, Hv, Dv, Dk]       float32; ``None`` means zeros
mask         [B, T]                bool; False = padding step: the state
                                   passes through unchanged and y is 0
returns y    [B, T, Hv, Dv]        q.dtype
new state    [B, Hv, Dv, Dk]       float32
===========  ====================  =========================================

Recurrence per value head (S is Dv x Dk):
``S <- g_t S;  kv = S k_t;  delta = beta_t (v_t - kv);  S <- S + delta k_t^T;
y_t = S q_t``.  All arithmetic is fp32 whatever the input dtype, as in
mlx-lm's ``_gated_delta_step_ops`` (which promotes to the fp32 state).

Masked steps: the state is left unchanged and y is 0 there (what mlx-lm's
Metal kernel writes; mlx-lm's ops fallback writes ``S' q_t`` for a state it
then discards; in mlx-lm's models q is 0 at padded steps, so both give 0).
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gated_delta as _stock

from .. import backend as _backend
from ..compiled import StepPlans, concat_linears, linear_arrays, linear_paths
from ..kernels import _cuda_build
from .. import config
from ..kernels import gated_delta_decode as _k_decode
from ..kernels import gated_delta_decode_metal as _k_decode_metal
from ..kernels import gated_delta_frontend as _k_frontend
from ..kernels import gated_delta_scan as _k_scan
from ..kernels import gated_rms_norm as _k_norm
from ..kernels import gdn_mixer_decode as _k_mixer
from . import linear as linear_ops

__all__ = [
    "gated_delta_recurrent",
    "gated_delta_recurrent_steps",
    "gated_delta_chunked",
    "compute_gates",
    "gated_delta_update",
    "gated_delta_net",
    "gated_delta_net_steps",
    "decide_kernels",
    "implementation_for",
    "IMPLEMENTATIONS",
    "RECURRENT_MAX_T",
    "CHUNK_SIZE",
    "DEFAULT_CHUNK_SIZE",
]

DEFAULT_CHUNK_SIZE = 64

# Largest T that the dispatcher sends to the per-token recurrence on the CPU;
# longer inputs go to the chunked form.  Decode (T=1) takes the recurrence
# (one compiled graph, fewest nodes; all forms are bound by the state's
# bytes there); from T=4 the chunked form is faster, T=2-3 is a tie
# (bench/results/package-figures.md, "GDN recurrence on the CPU").
RECURRENT_MAX_T = 1

# Chunk size the dispatcher uses per backend.  Per token the chunked form
# spends ~6*Dk*Dv flops carrying the state between chunks and ~8*C*D on the
# intra-chunk matmuls, so a small chunk costs fewer flops: on the CPU, where
# MLX's matmuls are slow, C=16 is the fastest (same file, "chunk size").
# On a GPU flops are cheap and the chunk loop is sequential, so the usual
# C=64 (fla's choice) keeps the loop short.
CHUNK_SIZE = {_backend.CPU: 16, _backend.CUDA: 64, _backend.METAL: 64}


# --------------------------------------------------------------------------
# validation (shape / dtype checks only; never evaluates an array)
# --------------------------------------------------------------------------


def _shape(x) -> Tuple[int, ...]:
    return tuple(x.shape)


#: What each array argument of this module's functions must be, for the
#: messages of ``_cuda_build.check_arrays`` (state and mask may be None).
_EXPECTED = {
    "q": "[B, T, Hk, Dk] (float)", "k": "[B, T, Hk, Dk] (float)", "v": "[B, T, Hv, Dv] (float)",
    "g": "[B, T, Hv] (float)", "beta": "[B, T, Hv] (float)", "a": "[B, T, Hv] (float)",
    "b": "[B, T, Hv] (float)", "A_log": "[Hv] (float)", "dt_bias": "[Hv] (float)",
    "state": "[B, Hv, Dv, Dk] float32", "mask": "[B, T] (bool)", "inputs": "[B, S, D] (float)",
}


def _specs(*names: str) -> Tuple[_cuda_build.ArraySpec, ...]:
    return tuple((n, _EXPECTED[n], n in ("state", "mask")) for n in names)


_RECURRENCE_ARRAYS = _specs("q", "k", "v", "g", "beta", "state", "mask")
_GATE_ARRAYS = _specs("a", "b", "A_log", "dt_bias")
_UPDATE_ARRAYS = _specs("q", "k", "v", "a", "b", "A_log", "dt_bias", "state", "mask")
_LAYER_ARRAYS = _specs("inputs", "mask")


def _check_inputs(q, k, v, g, beta, state, mask):
    """Check the contract's shapes; returns (B, T, Hk, Dk, Hv, Dv).

    Raises ValueError naming the argument, the expected shape/dtype and what
    was passed.
    """
    _cuda_build.check_arrays(None, _RECURRENCE_ARRAYS, q, k, v, g, beta, state, mask)
    if q.ndim != 4:
        raise ValueError(
            f"q must have shape [B, T, Hk, Dk] (rank 4), got shape {_shape(q)}"
        )
    B, T, Hk, Dk = q.shape
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not mx.issubdtype(x.dtype, mx.floating):
            raise ValueError(
                f"{name} must be a floating mx.array (bfloat16, float16 or float32), got {x.dtype}"
            )
    if k.ndim != 4:
        raise ValueError(
            f"k must have shape [B, T, Hk, Dk] (rank 4), got shape {_shape(k)}"
        )
    if k.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"k must have shape [B, T, Hk, Dk] = {(B, T, Hk, Dk)} like q "
            f"(mismatched B/T), got {_shape(k)}"
        )
    if k.shape[3] != Dk:
        raise ValueError(
            f"k must have the same key dim Dk={Dk} as q (shape {(B, T, Hk, Dk)}),"
            f" got Dk={k.shape[3]} (shape {_shape(k)})"
        )
    if k.shape[2] != Hk:
        raise ValueError(
            f"k must have the same key head count Hk={Hk} as q "
            f"(shape {(B, T, Hk, Dk)}), got {_shape(k)}"
        )
    if v.ndim != 4:
        raise ValueError(
            f"v must have shape [B, T, Hv, Dv] (rank 4), got shape {_shape(v)}"
        )
    if v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"v must have shape [B, T, Hv, Dv] with B={B}, T={T} as q "
            f"(mismatched B/T), got {_shape(v)}"
        )
    Hv, Dv = v.shape[2], v.shape[3]
    if Hk == 0 or Hv % Hk != 0:
        raise ValueError(
            f"v's head count Hv={Hv} must be a positive multiple of the key "
            f"head count Hk={Hk} (v shape {_shape(v)}, q shape {_shape(q)})"
        )
    if _shape(g) != (B, T, Hv):
        raise ValueError(
            f"g must have shape [B, T, Hv] = {(B, T, Hv)} (one scalar decay per "
            f"step and value head), got {_shape(g)}"
        )
    if _shape(beta) != (B, T, Hv):
        raise ValueError(f"beta must have shape [B, T, Hv] = {(B, T, Hv)}, got {_shape(beta)}")
    if state is not None:
        if _shape(state) != (B, Hv, Dv, Dk):
            raise ValueError(
                f"state must have shape [B, Hv, Dv, Dk] = {(B, Hv, Dv, Dk)}, "
                f"got {_shape(state)}"
            )
        if state.dtype != mx.float32:
            raise ValueError(
                f"state must have dtype float32 (a bf16/fp16 state drifts), "
                f"got {state.dtype}"
            )
    if mask is not None and _shape(mask) != (B, T):
        raise ValueError(
            f"mask must have shape [B, T] = {(B, T)} (bool, False = padding), "
            f"got {_shape(mask)}"
        )
    return B, T, Hk, Dk, Hv, Dv


def _as_bool(mask):
    return mask if mask.dtype == mx.bool_ else mask != 0


# --------------------------------------------------------------------------
# 1. per-token recurrence (reference of record)
# --------------------------------------------------------------------------


@mx.compile
def _step(q, k, v, g, beta, state):
    """One recurrent step, fp32, value heads grouped by key head.

    q, k: [B, Hk, 1, Dk] f32; v: [B, Hk, R, Dv] f32; g, beta: [B, Hk, R] f32;
    state: [B, Hk, R, Dv, Dk] f32.  Returns y [B, Hk, R, Dv], new state.
    """
    kk = k[..., None, :]  # [B, Hk, 1, 1, Dk]
    state = state * g[..., None, None]
    kv = (state * kk).sum(axis=-1)  # [B, Hk, R, Dv]
    delta = (v - kv) * beta[..., None]
    state = state + kk * delta[..., None]
    y = (state * q[..., None, :]).sum(axis=-1)
    return y, state


@mx.compile
def _step_masked(q, k, v, g, beta, state, m):
    """:func:`_step` with a bool mask ``m`` [B]: False keeps the state, y = 0."""
    y, new_state = _step(q, k, v, g, beta, state)
    m = m.reshape(m.shape[0], 1, 1, 1)
    y = mx.where(m, y, 0.0)  # y: [B, Hk, R, Dv]
    new_state = mx.where(m[..., None], new_state, state)
    return y, new_state


def gated_delta_recurrent(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: Optional[mx.array] = None,
    mask: Optional[mx.array] = None,
) -> Tuple[mx.array, mx.array]:
    """Gated delta rule, one token at a time, in plain MLX ops (fp32 math).

    The reference of record for :func:`gated_delta_chunked`, and the decode
    path (T small).  Same step math as mlx-lm's ``_gated_delta_step_ops``
    (mlx_lm/models/gated_delta.py), with every operand cast to float32 and
    the GQA head sharing done by broadcasting (q/k are not repeated).

    Args:
      q, k: [B, T, Hk, Dk], any float dtype (L2-normalised; q pre-scaled).
      v: [B, T, Hv, Dv], any float dtype; Hv % Hk == 0.
      g: [B, T, Hv] decay in (0, 1] (dimensionless, per step).
      beta: [B, T, Hv] write strength.
      state: [B, Hv, Dv, Dk] float32, or None for zeros.
      mask: [B, T] bool or None; False steps leave the state unchanged and
        give y = 0.

    Returns:
      (y [B, T, Hv, Dv] in q.dtype, state [B, Hv, Dv, Dk] float32).

    Raises:
      ValueError: on a wrong rank/shape of any argument, Hv not a multiple of
        Hk, or a state that is not float32 (see module docstring).
    """
    B, T, Hk, Dk, Hv, Dv = _check_inputs(q, k, v, g, beta, state, mask)
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if mask is not None:
        mask = _as_bool(mask)
    if T == 0:
        return mx.zeros((B, 0, Hv, Dv), q.dtype), state
    if T == 1:  # decode: one compiled graph, no slicing
        if mask is None:
            return _recurrent_one(q, k, v, g, beta, state)
        return _recurrent_one_masked(q, k, v, g, beta, state, mask)
    y, states = _recurrent_loop(q, k, v, g, beta, state, mask, keep_steps=False)
    return y, states[-1]


def gated_delta_recurrent_steps(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: Optional[mx.array] = None,
) -> Tuple[mx.array, List[mx.array]]:
    """:func:`gated_delta_recurrent` that also returns the state after every step.

    The same per-token loop as :func:`gated_delta_recurrent` for T > 1 (the
    same compiled step, the same fp32 arithmetic; no mask), keeping each
    step's state: what a speculative verify needs to put the state back at
    any accepted prefix (:mod:`mlx_qwen_fast.speculative`). Memory: T states
    of ``B * Hv * Dv * Dk * 4`` bytes (2 MiB per state at Qwen3.6's Hv = 32,
    Dv = Dk = 128, B = 1).

    Args:
      q, k, v, g, beta, state: as :func:`gated_delta_recurrent`.

    Returns:
      (y [B, T, Hv, Dv] in q.dtype, states): ``states[t]`` is the float32
      state [B, Hv, Dv, Dk] after step t (t = 0 .. T-1); empty for T = 0.

    Raises:
      ValueError: as :func:`gated_delta_recurrent`.
    """
    B, T, Hk, Dk, Hv, Dv = _check_inputs(q, k, v, g, beta, state, None)
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if T == 0:
        return mx.zeros((B, 0, Hv, Dv), q.dtype), []
    return _recurrent_loop(q, k, v, g, beta, state, None, keep_steps=True)


def _recurrent_loop(q, k, v, g, beta, state, mask, keep_steps: bool):
    """The per-token loop of checked arguments (T >= 1, state an array):
    ``(y, states)``, states the state after every step when ``keep_steps``,
    else only the last one (a one-element list)."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    R = Hv // Hk
    f32 = mx.float32
    S = state.reshape(B, Hk, R, Dv, Dk)
    qf = q.astype(f32)[:, :, :, None, :]  # [B, T, Hk, 1, Dk]
    kf = k.astype(f32)[:, :, :, None, :]
    vf = v.astype(f32).reshape(B, T, Hk, R, Dv)
    gf = g.astype(f32).reshape(B, T, Hk, R)
    bf = beta.astype(f32).reshape(B, T, Hk, R)
    ys, states = [], []
    for t in range(T):
        if mask is None:
            y, S = _step(qf[:, t], kf[:, t], vf[:, t], gf[:, t], bf[:, t], S)
        else:
            y, S = _step_masked(
                qf[:, t], kf[:, t], vf[:, t], gf[:, t], bf[:, t], S, mask[:, t]
            )
        ys.append(y)
        if keep_steps:
            states.append(S.reshape(B, Hv, Dv, Dk))
    y = mx.stack(ys, axis=1).reshape(B, T, Hv, Dv).astype(q.dtype)
    return y, states if keep_steps else [S.reshape(B, Hv, Dv, Dk)]


def _one_token_args(q, k, v, g, beta, state):
    B, _, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    R = Hv // Hk
    f32 = mx.float32
    return (
        q.astype(f32).reshape(B, Hk, 1, Dk),
        k.astype(f32).reshape(B, Hk, 1, Dk),
        v.astype(f32).reshape(B, Hk, R, Dv),
        g.astype(f32).reshape(B, Hk, R),
        beta.astype(f32).reshape(B, Hk, R),
        state.reshape(B, Hk, R, Dv, Dk),
    )


@mx.compile
def _recurrent_one(q, k, v, g, beta, state):
    """T == 1 without mask: casts, reshapes and the step in one compiled graph."""
    y, S = _step(*_one_token_args(q, k, v, g, beta, state))
    return y.reshape(v.shape).astype(q.dtype), S.reshape(state.shape)


@mx.compile
def _recurrent_one_masked(q, k, v, g, beta, state, mask):
    """T == 1 with a [B, 1] bool mask."""
    y, S = _step_masked(*_one_token_args(q, k, v, g, beta, state), mask[:, 0])
    return y.reshape(v.shape).astype(q.dtype), S.reshape(state.shape)


# --------------------------------------------------------------------------
# 2. chunkwise-parallel form
# --------------------------------------------------------------------------


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


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


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
        as in the module docstring.
      chunk_size: steps per chunk, a power of two (default 64).

    Returns:
      (y [B, T, Hv, Dv] in q.dtype, state [B, Hv, Dv, Dk] float32).  Agrees
      with :func:`gated_delta_recurrent` to fp32 rounding (relative L2 error
      ~1e-6 on y and state for fp32 inputs).

    Raises:
      ValueError: shape/dtype errors as for :func:`gated_delta_recurrent`,
        or ``chunk_size`` not a positive power of two.
    """
    if not isinstance(chunk_size, int) or not _is_pow2(chunk_size):
        raise ValueError(
            f"chunk_size must be a positive power of two, got {chunk_size!r}"
        )
    B, T, Hk, Dk, Hv, Dv = _check_inputs(q, k, v, g, beta, state, mask)
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


# --------------------------------------------------------------------------
# 3. gates
# --------------------------------------------------------------------------


@partial(mx.compile, shapeless=True)
def _compute_g(A_log, a, dt_bias):
    # identical expression to mlx_lm.models.gated_delta.compute_g
    return mx.exp(-mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias))


def compute_gates(
    a: mx.array, b: mx.array, A_log: mx.array, dt_bias: mx.array
) -> Tuple[mx.array, mx.array]:
    """Decay and write strength of the gated delta rule.

    ``g = exp(-exp(A_log) * softplus(a + dt_bias))`` and ``beta = sigmoid(b)``,
    the same expressions (and so the same bits) as mlx-lm's ``compute_g``
    and ``mx.sigmoid(b)``: ``a + dt_bias`` and its softplus are evaluated in
    their own dtype, the product and exponentials in float32.

    Args:
      a: [B, T, Hv] (the ``in_proj_a`` output); b: [B, T, Hv] (``in_proj_b``).
      A_log, dt_bias: [Hv] per-head parameters.

    Returns:
      (g [B, T, Hv] float32 in (0, 1] (decay per step, dimensionless),
       beta [B, T, Hv] in b's dtype, in (0, 1)).

    Raises:
      ValueError: an argument that is not an mx.array, ``a`` not of rank 3,
        ``b`` not of ``a``'s shape, or ``A_log`` / ``dt_bias`` not ``[Hv]``
        (Hv = ``a.shape[-1]``); the compiled gate expression is shapeless
        and would broadcast them.
    """
    _cuda_build.check_arrays("compute_gates", _GATE_ARRAYS, a, b, A_log, dt_bias)
    if a.ndim != 3:
        raise ValueError(f"compute_gates: a must have shape [B, T, Hv], got {tuple(a.shape)}")
    hv = a.shape[-1]
    if b.shape != a.shape:
        raise ValueError(f"compute_gates: b must have a's shape {tuple(a.shape)}, got {tuple(b.shape)}")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t.shape != (hv,):
            raise ValueError(f"compute_gates: {name} must have shape [Hv] = ({hv},), got {tuple(t.shape)}")
    return _compute_g(A_log, a, dt_bias), mx.sigmoid(b)


# --------------------------------------------------------------------------
# 4. dispatch
# --------------------------------------------------------------------------


def _mlx_lm_metal(q, k, v, g, beta, state, mask):
    """mlx-lm's own Metal kernels (Apple GPU), the stock fast path."""
    if k.shape[-1] % 32 != 0:  # mlx-lm's kernels need Dk a multiple of 32
        return gated_delta_chunked(q, k, v, g, beta, state, mask)
    if state is None:
        B, _, _, Dk = q.shape
        Hv, Dv = v.shape[-2:]
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    return _stock.gated_delta_kernel(q, k, v, g, beta, state, mask)


def _chunked_for_backend(q, k, v, g, beta, state, mask):
    """:func:`gated_delta_chunked` with the chunk size of the current backend."""
    size = CHUNK_SIZE.get(_backend.current(), DEFAULT_CHUNK_SIZE)
    return gated_delta_chunked(q, k, v, g, beta, state, mask, chunk_size=size)


def _cuda_kernel(q, k, v, g, beta, state, mask):
    """The register-resident CUDA scan (``kernels/gated_delta_scan``); the
    chunked form for calls it does not support (head dims other than 128)."""
    if _k_scan.supports(q, k, v, g, beta, state, mask):
        return _k_scan.gated_delta_scan(q, k, v, g, beta, state, mask)
    return _chunked_for_backend(q, k, v, g, beta, state, mask)


#: Name of the CUDA-kernel implementation (the GDN layer then also uses the
#: fused front-end, gated-norm and decode kernels).
CUDA_KERNEL = "cuda-kernel"

# name -> fn(q, k, v, g, beta, state, mask) -> (y, state), chosen in
# implementation_for().
_TABLE: Dict[str, Callable] = {
    "mlx-lm-metal": _mlx_lm_metal,
    "recurrent": gated_delta_recurrent,
    "chunked": _chunked_for_backend,
    CUDA_KERNEL: _cuda_kernel,
}

#: Names of the implementations, for the patch report.
IMPLEMENTATIONS: Tuple[str, ...] = tuple(_TABLE)


def implementation_for(T: int, backend: Optional[str] = None) -> str:
    """Name (a key of the dispatch table) of the implementation used for T steps.

    Args:
      T: number of steps in the call (1 while decoding).
      backend: "cpu" | "cuda" | "metal"; None means
        :func:`mlx_qwen_fast.backend.current`.

    metal -> "mlx-lm-metal"; cuda -> "cuda-kernel"; cpu -> "recurrent" for T <= RECURRENT_MAX_T, else
    "chunked" (chunk size ``CHUNK_SIZE[backend]``).

    Raises:
      ValueError: for an unknown backend name.
    """
    backend = _backend.resolve(backend)
    if backend == _backend.METAL:
        return "mlx-lm-metal"
    if backend == _backend.CUDA and _cuda_build.cuda_available():
        return CUDA_KERNEL
    return "recurrent" if T <= RECURRENT_MAX_T else "chunked"


def gated_delta_update(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: Optional[mx.array] = None,
    mask: Optional[mx.array] = None,
    *,
    use_kernel: bool = True,
    lower_bound: Optional[float] = None,
    allow_neg_eigval: bool = False,
) -> Tuple[mx.array, mx.array]:
    """Drop-in replacement for ``mlx_lm.models.gated_delta.gated_delta_update``.

    Computes the gates (:func:`compute_gates`) and runs the recurrence with
    the implementation :func:`implementation_for` picks for T and the
    current backend.  The keyword arguments mirror mlx-lm's:
    ``use_kernel=False`` (training) avoids the Metal kernels, which have no
    gradient (our plain-op paths do); ``lower_bound`` selects mlx-lm's
    ``compute_lower_bound_g``; ``allow_neg_eigval`` doubles beta.  Vector
    gates (``a`` of rank 4) go to mlx-lm's own function unchanged.

    Args:
      q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; a, b: [B, T, Hv];
      A_log, dt_bias: [Hv]; state: [B, Hv, Dv, Dk] float32 or None;
      mask: [B, T] bool or None.

    Returns:
      (y [B, T, Hv, Dv] in q.dtype, state [B, Hv, Dv, Dk] float32).

    Raises:
      ValueError: an argument that is not an mx.array; as
        :func:`compute_gates` for ``a``, ``b``, ``A_log`` and ``dt_bias``,
        and as :func:`gated_delta_recurrent` for the rest.
    """
    _cuda_build.check_arrays(None, _UPDATE_ARRAYS, q, k, v, a, b, A_log, dt_bias, state, mask)
    return _update(q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel=use_kernel, lower_bound=lower_bound,
                   allow_neg_eigval=allow_neg_eigval)


def _update(q, k, v, a, b, A_log, dt_bias, state, mask, *, use_kernel: bool = True,
            lower_bound: Optional[float] = None, allow_neg_eigval: bool = False):
    """:func:`gated_delta_update` of arguments known to be arrays (the
    layer's own: the per-token path skips that check; the gates' and the
    recurrence's shape checks still run)."""
    if a.ndim == 4:  # vector gating: not this module's contract
        return _stock.gated_delta_update(
            q, k, v, a, b, A_log, dt_bias, state, mask,
            use_kernel=use_kernel, lower_bound=lower_bound,
            allow_neg_eigval=allow_neg_eigval,
        )
    if lower_bound is None:
        g, beta = compute_gates(a, b, A_log, dt_bias)
    else:
        g = _stock.compute_lower_bound_g(A_log, a, dt_bias, lower_bound)
        beta = mx.sigmoid(b)
    if allow_neg_eigval:
        beta = beta * 2.0
    T = q.shape[1] if q.ndim == 4 else 0
    name = implementation_for(T)
    if name == "mlx-lm-metal" and not use_kernel:
        name = "recurrent" if T <= RECURRENT_MAX_T else "chunked"
    if name == "mlx-lm-metal":
        _check_inputs(q, k, v, g, beta, state, mask)
    return _TABLE[name](q, k, v, g, beta, state, mask)


# --------------------------------------------------------------------------
# 5. the whole layer (mlx-lm's GatedDeltaNet) and its dispatch
# --------------------------------------------------------------------------


def _layer_takes_kernels(layer, num_tokens: int, mask, cache) -> bool:
    """Whether a layer call runs the fused CUDA kernels (front end + scan +
    gated norm for prefill, :func:`_cuda_decode` for one token): the
    recurrence's implementation is "cuda-kernel" and the call has no padding
    mask, no per-row cache lengths (batched prompts of unequal length) and
    no tensor-parallel sharding. Elsewhere :func:`_layer_reference` runs."""
    return (
        mask is None
        and getattr(layer, "sharding_group", None) is None
        and (cache is None or cache.lengths is None)
        and implementation_for(num_tokens) == CUDA_KERNEL
    )


def decide_kernels(layer) -> Dict[str, str]:
    """The kernel implementations that cannot run ``layer`` for the way its
    weights are quantised: none, for every quantisation (the counterpart of
    :func:`mlx_qwen_fast.ops.moe.decide_kernels`, called by
    :func:`mlx_qwen_fast.patching.patch` for every layer it makes fast).

    The Gated DeltaNet kernels (front end, scan, gated RMSNorm, decode) read
    activations, the conv1d weight, ``A_log``, ``dt_bias`` and the norm
    weight, none of which MLX quantises; the projections around them run on
    MLX's own matmuls at each layer's bits, group size and mode (the decode
    step's packed input projection too: :func:`compiled.concat_linears` joins
    only layers of identical settings, otherwise the step calls the modules).

    Returns:
        ``{}`` (no implementation declined).
    """
    return {}


def gated_delta_net(layer, inputs: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
    """``GatedDeltaNet.__call__`` (mlx_lm/models/qwen3_5.py) through this
    module: the dispatch entry of the fast layer.

    Where :func:`_layer_takes_kernels`, the fused CUDA kernels (prefill:
    front end, scan, gated RMSNorm; decode: one compiled step, projections
    included); where a kernel declines the shapes, and on every other
    backend, mlx-lm's layer math with :func:`gated_delta_update` for the
    recurrence.

    Args:
        layer: an mlx-lm ``GatedDeltaNet`` (possibly quantised, LoRA-wrapped
            or sharded).
        inputs: ``[B, S, D]`` hidden states.
        mask: ``[B, S]`` bool or None (padding of batched prompts).
        cache: mlx-lm's ``ArraysCache`` of the layer (conv state, recurrent
            state) or None; updated in place and advanced by S.

    Returns:
        ``[B, S, D]`` in the activation dtype; for B = 0 or S = 0 the empty
        array (the cache untouched), as there is nothing to project (MLX's
        quantised matmul does not take 0 rows).

    Raises:
        ValueError: ``inputs`` (or ``mask``) is not an mx.array, or
            ``inputs`` is not of rank 3.
    """
    if not isinstance(inputs, mx.array) or not (mask is None or isinstance(mask, mx.array)):  # per token: inline
        _cuda_build.check_arrays("gated_delta_net", _LAYER_ARRAYS, inputs, mask)
    if inputs.ndim != 3:
        raise ValueError(f"gated_delta_net: inputs must have shape [B, S, D], got {_shape(inputs)}")
    if inputs.size == 0:
        return mx.zeros(inputs.shape, inputs.dtype)
    S = inputs.shape[1]
    if S == 1 and _layer_takes_metal_decode(layer, mask, cache):
        out = _metal_decode(layer, inputs, cache)
        if out is not None:
            return out
    if _layer_takes_kernels(layer, S, mask, cache):
        out = (_cuda_decode if S == 1 else _cuda_prefill)(layer, inputs, cache)
        if out is not None:
            return out
    return _layer_reference(layer, inputs, mask, cache)


def gated_delta_net_steps(layer, inputs: mx.array, cache) -> Tuple[mx.array, List[Tuple[mx.array, mx.array]]]:
    """:func:`gated_delta_net` that also returns the cache's states after
    every token: mlx-lm's layer math (:func:`_layer_reference`) with the
    recurrence one token at a time (:func:`gated_delta_recurrent_steps`,
    fp32, the reference of record) on every backend. A speculative verify
    runs the layer this way (:mod:`mlx_qwen_fast.speculative`); on CUDA the
    prefill kernels (front end + chunked scan) do not expose per-step
    states, so such a call takes this reference path instead of them.

    Args:
        layer: an mlx-lm ``GatedDeltaNet``.
        inputs: ``[B, S, D]`` hidden states, S >= 1.
        cache: the layer's ``ArraysCache`` (conv state, recurrent state; None
            entries mean zeros) without per-row lengths or left padding;
            updated in place and advanced by S, as :func:`gated_delta_net`.

    Returns:
        ``(out [B, S, D], steps)``: ``steps[j]`` = ``(conv state [B,
        conv_kernel_size - 1, conv_dim] in the activation dtype, recurrent
        state [B, Hv, Dv, Dk] float32)`` after token j (j = 0 .. S-1);
        ``steps[-1]`` are the arrays the cache then holds. Memory: S
        recurrent states (2 MiB each at Qwen3.6's shapes, B = 1).

    Raises:
        ValueError: ``inputs`` not an mx.array of rank 3 with S >= 1 and
            B >= 1, ``cache`` None or with per-row lengths / left padding.
    """
    if not isinstance(inputs, mx.array):
        _cuda_build.check_arrays("gated_delta_net_steps", _LAYER_ARRAYS, inputs, None)
    if inputs.ndim != 3 or inputs.shape[0] < 1 or inputs.shape[1] < 1:
        raise ValueError(f"gated_delta_net_steps: inputs must have shape [B, S, D] with B, S >= 1, "
                         f"got {_shape(inputs)}")
    if cache is None or getattr(cache, "lengths", None) is not None \
            or getattr(cache, "left_padding", None) is not None:
        raise ValueError("gated_delta_net_steps: cache must be the layer's ArraysCache without per-row lengths "
                         f"or left padding, got {cache!r}")
    steps: List[Tuple[mx.array, mx.array]] = []
    out = _layer_reference(layer, inputs, None, cache, steps)
    return out, steps


def _heads(layer) -> dict:
    return dict(num_k_heads=layer.num_k_heads, num_v_heads=layer.num_v_heads)


def _states(cache):
    return (cache[0], cache[1]) if cache is not None else (None, None)


def _store(cache, conv_state, state, S: int) -> None:
    if cache is not None:
        cache[0] = conv_state
        cache[1] = state
        cache.advance(S)


def _cuda_prefill(layer, inputs, cache):
    """Front end + scan + gated-norm kernels between mlx-lm's projections;
    None (before touching the cache) where a kernel does not take the call."""
    B, S, _ = inputs.shape
    qkv = layer.in_proj_qkv(inputs)
    conv_state, state = _states(cache)
    if conv_state is None:
        conv_state = mx.zeros((B, layer.conv_kernel_size - 1, layer.conv_dim), qkv.dtype)
    if not _k_frontend.supports(qkv, conv_state, layer.conv1d.weight, **_heads(layer),
                                head_k_dim=layer.head_k_dim, head_v_dim=layer.head_v_dim):
        return None
    z = layer.in_proj_z(inputs).reshape(B, S, layer.num_v_heads, layer.head_v_dim)
    a, b = layer.in_proj_a(inputs), layer.in_proj_b(inputs)
    q, k, v, g, beta, conv_state = _k_frontend.gated_delta_frontend(
        qkv, a, b, layer.conv1d.weight, conv_state, layer.A_log, layer.dt_bias, **_heads(layer),
    )
    if not _k_scan.supports(q, k, v, g, beta, state):
        return None
    y, state = _k_scan.gated_delta_scan(q, k, v, g, beta, state)
    _store(cache, conv_state, state, S)
    if _k_norm.supports(y, z, layer.norm.weight):
        out = _k_norm.gated_rms_norm(y, z, layer.norm.weight, layer.norm.eps)
    else:
        out = layer.norm(y, z)
    return layer.out_proj(out.reshape(B, S, -1))


_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")
_STEP_ARRAYS = (("conv1d", "weight"), ("A_log",), ("dt_bias",), ("norm", "weight"))


def _cuda_decode(layer, inputs, cache):
    """The layer's decode step in one ``mx.compile``d call
    (:func:`_decode_step`: the four input projections as one quantised
    matmul over their concatenated weights, the decode kernel, ``out_proj``);
    the kernel between module calls where a projection is not a plain
    (quantised) linear layer (LoRA). None where the kernel does not take
    the call."""
    conv_state, state = _states(cache)
    B = inputs.shape[0]
    if conv_state is None:
        conv_state = mx.zeros((B, layer.conv_kernel_size - 1, layer.conv_dim), inputs.dtype)
    if state is None:
        state = mx.zeros((B, layer.num_v_heads, layer.head_v_dim, layer.head_k_dim), mx.float32)
    # the GEMV switch is read while tracing: a plan per value
    key = (tuple(inputs.shape), inputs.dtype, conv_state.dtype, state.dtype, config.DECODE_GEMV_KERNEL.get())
    arrays, plan = StepPlans.of(layer).get(key, layer, lambda: _decode_plan(layer, inputs, state))
    if plan is None:
        return None
    if plan == "modules":
        return _cuda_decode_modules(layer, inputs, conv_state, state, cache)
    fn, n_used, extra = plan
    out, conv_state, state = fn(inputs, conv_state, state, *arrays[:n_used], *extra)
    _store(cache, conv_state, state, 1)
    return out


def decode_step_parts(layer, inputs: mx.array, cache, input_norm_eps: Optional[float] = None,
                      input_norm_weight: Optional[mx.array] = None):
    """The compiled decode step of ``layer`` for one token per row, for a
    caller that traces it inside its own compiled function
    (:func:`mlx_qwen_fast.ops.decoder.decode_layer`); None where
    :func:`gated_delta_net` would not run it (no CUDA kernel for the call,
    no cache state yet, a LoRA-wrapped projection).

    Args:
        layer: an mlx-lm ``GatedDeltaNet``.
        inputs: ``[B, 1, D]`` (only its shape and dtype are read).
        cache: the layer's ``ArraysCache`` holding (conv state, recurrent state).
        input_norm_eps: None, or the eps of the decoder layer's RMSNorm
            before this layer: then the step also takes that norm's weight
            and the residual, and computes ``x + layer(rms_norm(x))`` (the
            norm fused into the input projection, the add into
            ``out_proj``: :func:`mlx_qwen_fast.ops.linear.decode_linear`).
        input_norm_weight: that norm's weight ([D]), read only to build the
            one-launch mixer's constants (:data:`config.GDN_MIXER_KERNEL`:
            :func:`mlx_qwen_fast.kernels.gdn_mixer_decode.gdn_mixer_decode`
            replaces the three launches; ``fn`` then ignores its
            ``norm_weight`` argument, the caller's plan holding the weight
            it was built from). None: the three launches.

    Returns:
        ``(paths, fn, n_used, extra)``: ``fn(x, conv_state, state,
        *arrays[:n_used], *extra) -> (y, conv_state, state)`` (with
        ``input_norm_eps``: ``fn(x, conv_state, state, norm_weight, ...)
        -> (x + y, ...)``), where ``arrays`` are the objects at ``paths``
        under ``layer`` (the remaining ones decide the plan and are not
        read by ``fn``).
    """
    if not _layer_takes_kernels(layer, 1, None, cache):
        return None
    conv_state, state = _states(cache)
    if conv_state is None or state is None:
        return None
    paths, plan = _decode_plan(layer, inputs, state, input_norm_eps, input_norm_weight)
    if plan is None or plan == "modules":
        return None
    fn, n_used, extra = plan
    return tuple(paths), fn, n_used, extra


def _decode_plan(layer, inputs, state, input_norm_eps: Optional[float] = None,
                 input_norm_weight: Optional[mx.array] = None):
    """``(paths, plan)`` for :class:`StepPlans`: plan = ``(compiled step,
    number of the gathered arrays it takes, extra arrays)``, "modules" (a
    projection of another kind, or four that do not concatenate) or None
    (the kernel does not apply).

    The step takes out_proj's arrays, the layer's constants packed by
    ``decode_params`` and one concatenated input projection
    (:func:`concat_linears`: ~14 MB more GPU memory per Qwen3.6 layer), the
    last two as the extra arrays; their sources stay in the paths, so
    replacing one (``update``, ``load_weights``) rebuilds the plan. Both are
    copies: an array changed in place (``layer.A_log[0] = v``, the same
    object) is not seen."""
    qkv = mx.zeros((inputs.shape[0], 1, layer.conv_dim), inputs.dtype)  # shape only, never evaluated
    children = [(n,) for n in _PROJECTIONS]
    if not _k_decode.supports(qkv, state, **_heads(layer), head_k_dim=layer.head_k_dim,
                              head_v_dim=layer.head_v_dim):
        return children, None
    lins = [linear_arrays(getattr(layer, n)) for n in _PROJECTIONS]
    in_proj = None if any(lin is None for lin in lins) else concat_linears(lins[:4])
    if in_proj is None:
        return children, "modules"
    paths = linear_paths(("out_proj",), lins[4])
    n_used = len(paths)
    paths += _STEP_ARRAYS + tuple(p for n, lin in zip(_PROJECTIONS[:4], lins) for p in linear_paths((n,), lin))
    heads = (layer.num_k_heads, layer.num_v_heads)
    if _mixer_takes(inputs, in_proj, lins[4], state, heads, input_norm_eps, input_norm_weight):
        params = _k_mixer.mixer_params(layer.conv1d.weight, layer.A_log, layer.dt_bias, layer.norm.weight,
                                       input_norm_weight)
        mx.eval(params)
        fn = _mixer_step(*heads, layer.norm.eps, len(lins[4][0]), input_norm_eps)
        return paths, (fn, n_used, (params,) + tuple(in_proj[0]))
    params = _k_decode.decode_params(layer.conv1d.weight, layer.A_log, layer.dt_bias, layer.norm.weight)
    mx.eval(params)  # built once, outside the first step's graph
    fn = _decode_step(layer.num_k_heads, layer.num_v_heads, layer.norm.eps,
                      (len(lins[4][0]), lins[4][1]), (len(in_proj[0]), in_proj[1]), input_norm_eps)
    return paths, (fn, n_used, (params,) + tuple(in_proj[0]))


def _layer_takes_metal_decode(layer, mask, cache) -> bool:
    """Whether a one-token call runs the Metal decode kernel: on Metal with
    :data:`mlx_qwen_fast.config.METAL_KERNELS` on, no padding mask, no
    per-row cache lengths, no sharding."""
    return (
        mask is None
        and _backend.current() == _backend.METAL
        and config.METAL_KERNELS.get()
        and getattr(layer, "sharding_group", None) is None
        and (cache is None or cache.lengths is None)
    )


def _metal_decode(layer, inputs, cache):
    """The Metal decode kernel (``kernels/gated_delta_decode_metal``, the
    CUDA decode kernel's contract) between the projections called as
    modules; its constants packed once per layer (:class:`StepPlans`). None
    where the kernel's shapes do not hold (head dims other than 128, Hv not a
    multiple of Hk)."""
    if layer.head_k_dim != _k_decode.D or layer.head_v_dim != _k_decode.D or \
            layer.num_v_heads % layer.num_k_heads:
        return None
    _, params = StepPlans.of(layer).get(("metal-params",), layer, lambda: (_STEP_ARRAYS, _metal_params(layer)))
    if params is None:  # inside an mx.compile trace of the module's arrays: the reference runs
        return None
    conv_state, state = _states(cache)
    proj = mx.concatenate([getattr(layer, n)(inputs) for n in _PROJECTIONS[:4]], axis=-1)
    out, conv_state, state = _k_decode_metal.gated_delta_decode_metal(
        proj, params, conv_state, state, **_heads(layer), norm_eps=layer.norm.eps)
    _store(cache, conv_state, state, 1)
    return layer.out_proj(out)


def _metal_params(layer):
    params = _k_decode.decode_params(layer.conv1d.weight, layer.A_log, layer.dt_bias, layer.norm.weight)
    mx.eval(params)
    return params


def _cuda_decode_modules(layer, inputs, conv_state, state, cache):
    """The decode kernel between the projections called as modules (LoRA
    layers): their outputs concatenated as the kernel reads them."""
    proj = mx.concatenate([getattr(layer, n)(inputs) for n in _PROJECTIONS[:4]], axis=-1)
    params = _k_decode.decode_params(layer.conv1d.weight, layer.A_log, layer.dt_bias, layer.norm.weight)
    out, conv_state, state = _k_decode.gated_delta_decode(
        proj, params, conv_state, state, **_heads(layer), norm_eps=layer.norm.eps)
    _store(cache, conv_state, state, 1)
    return layer.out_proj(out)


_decode_steps: Dict[tuple, Callable] = {}


def _decode_step(num_k_heads: int, num_v_heads: int, norm_eps: float, out_static: tuple, in_static: tuple,
                 input_norm_eps: Optional[float] = None):
    """The ``mx.compile``d decode step of a Gated DeltaNet layer for one
    static setting (all arrays are inputs: one trace per input signature,
    shared by every layer)::

        fn(x, conv_state, state, *out_proj, params, *in_proj_concatenated)
        -> (y [B, 1, D], conv_state, state)

    or, with ``input_norm_eps`` (see :func:`decode_step_parts`),
    ``fn(x, conv_state, state, norm_weight, *out_proj, params, *in_proj)
    -> (x + y, conv_state, state)``. The projections go through
    :func:`mlx_qwen_fast.ops.linear.decode_linear` (the fused GEMV on CUDA).
    ``out_static`` / ``in_static``: ``(number of arrays, linear_arrays static)``.
    """
    fused = input_norm_eps is not None
    key = (int(num_k_heads), int(num_v_heads), float(norm_eps), out_static, in_static,
           float(input_norm_eps) if fused else None, config.DECODE_GEMV_KERNEL.get())
    fn = _decode_steps.get(key)
    if fn is None:
        n_out = out_static[0]

        def core(x, conv_state, state, norm, flat):
            proj = linear_ops.decode_linear(x, flat[n_out + 1:], in_static[1], norm=norm)
            out, conv_state, state = _k_decode.gated_delta_decode(
                proj, flat[n_out], conv_state, state,
                num_k_heads=key[0], num_v_heads=key[1], norm_eps=key[2],
            )
            residual = x if norm is not None else None
            return linear_ops.decode_linear(out, flat[:n_out], out_static[1], residual=residual), conv_state, state

        if fused:
            def step(x, conv_state, state, norm_weight, *flat):
                return core(x, conv_state, state, (norm_weight, key[5]), flat)
        else:
            def step(x, conv_state, state, *flat):
                return core(x, conv_state, state, None, flat)

        fn = _decode_steps[key] = mx.compile(step)
    return fn


#: ``compiled.linear_arrays``' static settings of a projection the one-launch mixer reads.
_MIXER_STATIC = ("quantized", _k_mixer.GROUP_SIZE, _k_mixer.BITS, "affine", True, False)


def mixer_takes_weights(layer) -> bool:
    """Whether ``layer``'s (an mlx-lm ``GatedDeltaNet``) five projections
    are in the one-launch decode mixer's format (affine 4-bit, group 64,
    with biases, no bias): shapes and settings only, for the report
    (:func:`mlx_qwen_fast.patching.patch`); the decode step also checks the
    call's shapes and switches."""
    lins = [linear_arrays(getattr(layer, n, None)) for n in _PROJECTIONS]
    return all(lin is not None and lin[1] == _MIXER_STATIC for lin in lins)


def _mixer_takes(inputs, in_proj, out_proj, state, heads, input_norm_eps, input_norm_weight) -> bool:
    """Whether the decode step runs the one-launch mixer: its switch and the
    fused GEMV's on, the input norm fused (its weight given), both
    projections affine 4-bit group-64 with biases and no bias, the kernel's
    shapes (:func:`mlx_qwen_fast.kernels.gdn_mixer_decode.supports`)."""
    if not (config.GDN_MIXER_KERNEL.get() and config.DECODE_GEMV_KERNEL.get()):
        return False
    if input_norm_eps is None or input_norm_weight is None:
        return False
    if in_proj[1] != _MIXER_STATIC or out_proj[1] != _MIXER_STATIC:
        return False
    return _k_mixer.supports(inputs, in_proj[0], out_proj[0], state, num_k_heads=heads[0], num_v_heads=heads[1])


def _mixer_step(num_k_heads: int, num_v_heads: int, norm_eps: float, n_out: int, input_norm_eps: float):
    """The ``mx.compile``d decode step on the one-launch mixer, with
    :func:`_decode_step`'s fused signature: ``fn(x, conv_state, state,
    norm_weight, *out_proj, mixer_params, *in_proj) -> (x + y, conv_state,
    state)``; ``norm_weight`` is not read (``mixer_params`` holds it)."""
    key = ("mixer", int(num_k_heads), int(num_v_heads), float(norm_eps), int(n_out), float(input_norm_eps))
    fn = _decode_steps.get(key)
    if fn is None:

        def step(x, conv_state, state, norm_weight, *flat):
            return _k_mixer.gdn_mixer_decode(
                x, flat[n_out + 1:], flat[n_out], conv_state, state, flat[:n_out], num_k_heads=key[1],
                num_v_heads=key[2], input_norm_eps=key[5], norm_eps=key[3])

        fn = _decode_steps[key] = mx.compile(step)
    return fn


def _layer_reference(layer, inputs, mask, cache, steps: Optional[list] = None):
    """mlx-lm's ``GatedDeltaNet.__call__`` (0.32.2) with the recurrence
    through :func:`gated_delta_update`: sharding collectives, padding masks
    and per-row cache lengths included. With a list ``steps`` (no mask, a
    cache without per-row lengths: :func:`gated_delta_net_steps` checks) the
    recurrence is :func:`gated_delta_recurrent_steps` and ``(conv state,
    recurrent state)`` after each of the S tokens is appended to it."""
    from mlx.nn.layers.distributed import sum_gradients
    from mlx_lm.models.gated_delta import normalize_qk

    B, S, _ = inputs.shape
    if layer.sharding_group is not None:
        inputs = sum_gradients(layer.sharding_group)(inputs)

    qkv = layer.in_proj_qkv(inputs)
    z = layer.in_proj_z(inputs).reshape(B, S, layer.num_v_heads, layer.head_v_dim)
    b = layer.in_proj_b(inputs)
    a = layer.in_proj_a(inputs)

    if cache is not None and cache[0] is not None:
        conv_state = cache[0]
    else:
        conv_state = mx.zeros((B, layer.conv_kernel_size - 1, layer.conv_dim), dtype=inputs.dtype)
    if mask is not None:
        qkv = mx.where(mask[..., None], qkv, 0)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    if cache is not None:
        n_keep = layer.conv_kernel_size - 1
        if cache.lengths is not None:
            ends = mx.clip(cache.lengths, 0, S)
            positions = (ends[:, None] + mx.arange(n_keep))[..., None]
            cache[0] = mx.take_along_axis(conv_input, positions, axis=1)
        else:
            cache[0] = mx.contiguous(conv_input[:, -n_keep:, :])
    conv_out = nn.silu(layer.conv1d(conv_input))

    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [layer.key_dim, 2 * layer.key_dim], -1),
            [layer.num_k_heads, layer.num_k_heads, layer.num_v_heads],
            [layer.head_k_dim, layer.head_k_dim, layer.head_v_dim],
        )
    ]
    q, k = normalize_qk(q, k, inv_scale=layer.head_k_dim**-0.5, eps=1e-6)

    state = cache[1] if cache else None
    if steps is None:
        out, state = _update(q, k, v, a, b, layer.A_log, layer.dt_bias, state, mask)
    else:
        g, beta = compute_gates(a, b, layer.A_log, layer.dt_bias)
        out, states = gated_delta_recurrent_steps(q, k, v, g, beta, state)
        state = states[-1]
        # after token j the conv state is the window conv_input[j : j + n_keep]
        # (the last one is the cache's own, stored above)
        n_keep = layer.conv_kernel_size - 1
        steps.extend((conv_input[:, j:j + n_keep, :], s) for j, s in zip(range(1, S), states))
        steps.append((cache[0], state))
    if cache is not None:
        cache[1] = state
        cache.advance(S)

    out = layer.norm(out, z)
    out = layer.out_proj(out.reshape(B, S, -1))
    if layer.sharding_group is not None:
        out = mx.distributed.all_sum(out, group=layer.sharding_group)
    return out
