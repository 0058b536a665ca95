"""The reference of record: the per-token recurrence and the gates, in plain MLX ops.

:func:`gated_delta_recurrent` runs the recurrence one token at a time in
fp32 (the reference every other form and kernel is held against, and the
CPU's decode path); :func:`gated_delta_recurrent_steps` keeps the state
after every step; :func:`compute_gates` computes the decay and write
strength as mlx-lm does. Contract: :mod:`mlx_qwen_fast.ops.gated_delta`.
"""

from __future__ import annotations

from functools import partial
from typing import List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from .checks import _as_bool, _check_gates, _check_inputs


# --------------------------------------------------------------------------
# per-token recurrence (reference of record)
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
      ValueError (the message starts with the function's name): an
        argument that is not an mx.array, not floating point (mask aside)
        or of a wrong rank/shape, Hv not a multiple of Hk, or a state that
        is not float32 (see the package docstring).
    """
    B, T, Hk, Dk, Hv, Dv = _check_inputs(q, k, v, g, beta, state, mask, "gated_delta_recurrent")
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
    B, T, Hk, Dk, Hv, Dv = _check_inputs(q, k, v, g, beta, state, None, "gated_delta_recurrent_steps")
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
# gates
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
      ValueError: an argument that is not a floating mx.array, ``a`` not of
        rank 3, ``b`` not of ``a``'s shape, or ``A_log`` / ``dt_bias`` not
        ``[Hv]`` (Hv = ``a.shape[-1]``); the compiled gate expression is
        shapeless and would broadcast them.
    """
    _check_gates("compute_gates", a, b, A_log, dt_bias)
    return _compute_g(A_log, a, dt_bias), mx.sigmoid(b)
