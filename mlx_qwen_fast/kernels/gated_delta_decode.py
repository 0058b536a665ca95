"""Gated DeltaNet decode step on CUDA: one kernel per layer and token.

Fuses everything of mlx-lm's ``GatedDeltaNet.__call__`` (mlx_lm/models/
qwen3_5.py) between the input projections and ``out_proj`` for T = 1: conv
state update, depthwise conv + SiLU, q/k L2 normalisation, gates, the gated
delta rule state update and readout, and the gated RMSNorm with z -- one
graph node instead of ~40.  Each block owns one (batch, value head) and issues
its 64 KB of state loads before the front-end arithmetic so the two overlap.
Source: ``mlx_qwen_fast/cuda/gated_delta_decode.cu``.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx

from . import _cuda_build as cb

__all__ = ["decode_params", "gated_delta_decode", "gated_delta_decode_packed", "packed_width", "params_width",
           "supports"]

D = 128
KW = 4
_FLOAT = (mx.bfloat16, mx.float16, mx.float32)
_kernels: Dict[tuple, cb.CudaKernel] = {}


def supports(
    qkv: mx.array,
    state: Optional[mx.array],
    *,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int = D,
    head_v_dim: int = D,
    mask: Optional[mx.array] = None,
) -> bool:
    """True when :func:`gated_delta_decode` can run this call.

    Needs the CUDA backend, one token (qkv [B, 1, C] or [B, C]), head dims
    128, Hv a multiple of Hk, a float32 state [B, Hv, 128, 128] (or None) and
    no mask.
    """
    if not cb.cuda_available() or mask is not None:
        return False
    try:
        if head_k_dim != D or head_v_dim != D or num_k_heads <= 0 or num_v_heads % num_k_heads:
            return False
        C = (2 * num_k_heads + num_v_heads) * D
        if qkv.dtype not in _FLOAT or qkv.shape[-1] != C:
            return False
        if not (qkv.ndim == 2 or (qkv.ndim == 3 and qkv.shape[1] == 1)):
            return False
        B = qkv.shape[0]
        if state is not None and (state.shape != (B, num_v_heads, D, D) or state.dtype != mx.float32):
            return False
    except AttributeError:
        return False
    return True


def gated_delta_decode(
    qkv: mx.array,
    z: mx.array,
    a: mx.array,
    b: mx.array,
    conv_weight: mx.array,
    conv_state: Optional[mx.array],
    A_log: mx.array,
    dt_bias: mx.array,
    norm_weight: mx.array,
    state: Optional[mx.array],
    *,
    num_k_heads: int,
    num_v_heads: int,
    norm_eps: float = 1e-6,
    qk_eps: float = 1e-6,
    compiled: bool = False,
) -> Tuple[mx.array, mx.array, mx.array]:
    """One decode step of a Gated DeltaNet layer, up to ``out_proj``.

    Args:
      qkv: [B, 1, C] (or [B, C]) ``in_proj_qkv`` output, C = (2 Hk + Hv) * 128.
      z: [B, 1, Hv*128] (or [B, 1, Hv, 128], [B, Hv*128]) ``in_proj_z`` output.
      a, b: [B, 1, Hv] (or [B, Hv]) ``in_proj_a`` / ``in_proj_b`` outputs.
      conv_weight: ``conv1d.weight`` [C, 4, 1] (or [C, 4]).
      conv_state: [B, 3, C] previous conv inputs, or None for zeros.
      A_log, dt_bias: [Hv]; norm_weight: [128] (the gated norm's weight).
      state: [B, Hv, 128, 128] float32 recurrent state, or None for zeros.
      num_k_heads, num_v_heads: Hk, Hv.
      norm_eps: the gated RMSNorm's eps (``rms_norm_eps``).
      qk_eps: the q/k L2-norm eps (mlx-lm: 1e-6).
      compiled: run the step traced once per shape with ``mx.compile``: the
        same kernel and results (bit for bit), but the Python wrapper (checks,
        casts, launch plan: ~12 us per call) runs only when a new shape is
        traced. Measured on the H200 (bench/results/gdn-cuda-log.md): 30
        chained steps cost 16.9 us per layer compiled vs 27.0 us eager (B=1).

    Returns:
      (out [B, 1, Hv*128] in qkv's dtype -- the input of ``out_proj`` --,
       new conv state [B, 3, C] in qkv's dtype,
       new state [B, Hv, 128, 128] float32).

    Raises:
      ValueError: shapes/dtypes outside the above (names the argument).
      RuntimeError: no CUDA compiler could build the kernel.
    """
    if compiled:
        B, C = qkv.shape[0], qkv.shape[-1]
        if conv_state is None:
            conv_state = mx.zeros((B, KW - 1, C), dtype=qkv.dtype)
        if state is None:
            state = mx.zeros((B, num_v_heads, D, D), dtype=mx.float32)
        out, new_conv, new_state = _compiled_step(num_k_heads, num_v_heads, norm_eps, qk_eps)(
            qkv, z, a, b, conv_weight, conv_state, A_log, dt_bias, norm_weight, state
        )
        return out, new_conv, new_state
    sig = (
        qkv.shape, qkv.dtype, z.shape, z.dtype, a.shape, a.dtype, b.shape, b.dtype,
        conv_weight.shape, conv_weight.dtype,
        None if conv_state is None else (conv_state.shape, conv_state.dtype),
        A_log.shape, A_log.dtype, dt_bias.shape, dt_bias.dtype,
        norm_weight.shape, norm_weight.dtype,
        None if state is None else (state.shape, state.dtype),
        num_k_heads, num_v_heads,
    )
    plan = _plans.get(sig)
    if plan is None:
        plan = _plan(qkv, z, a, b, conv_weight, conv_state, A_log, dt_bias, norm_weight, state,
                     num_k_heads, num_v_heads)
        _plans[sig] = plan
    kern, B, C, Hv, x, out_shapes, out_dtypes, grid, cast = plan
    if conv_state is None:
        conv_state = mx.zeros((B, KW - 1, C), dtype=x)
    if state is None:
        state = mx.zeros((B, Hv, D, D), dtype=mx.float32)
    if cast:  # the kernel reads these in the activation dtype
        z, a, b, conv_state = (t.astype(x) for t in (z, a, b, conv_state))
    # passed in their own shapes: the kernel reads row-contiguous memory
    # (sizes checked in _plan), and a reshape would be one more graph node
    out, new_conv, new_state = kern(
        [qkv, z, a, b, conv_weight, conv_state, A_log, dt_bias, norm_weight, state],
        out_shapes, out_dtypes, grid, (512, 1, 1), (qk_eps, norm_eps),
    )
    return out, new_conv, new_state


_plans: Dict[tuple, tuple] = {}
_compiled: Dict[tuple, Callable] = {}


def _compiled_step(num_k_heads: int, num_v_heads: int, norm_eps: float, qk_eps: float) -> Callable:
    """The ``mx.compile``d :func:`gated_delta_decode` for one head/eps setting
    (all arrays passed in, nothing captured: one trace per input shape/dtype,
    shared by every layer of a model)."""
    key = (int(num_k_heads), int(num_v_heads), float(norm_eps), float(qk_eps))
    fn = _compiled.get(key)
    if fn is None:

        def step(*arrays):
            return gated_delta_decode(
                *arrays, num_k_heads=key[0], num_v_heads=key[1], norm_eps=key[2], qk_eps=key[3]
            )

        fn = _compiled[key] = mx.compile(step)
    return fn


def _plan(qkv, z, a, b, conv_weight, conv_state, A_log, dt_bias, norm_weight, state, Hk, Hv):
    """Validate one call signature; returns what the launch needs."""
    if Hk <= 0 or Hv % Hk:
        raise ValueError(f"num_v_heads ({Hv}) must be a multiple of num_k_heads ({Hk})")
    C = (2 * Hk + Hv) * D
    if qkv.dtype not in _FLOAT or qkv.shape[-1] != C or not (
        qkv.ndim == 2 or (qkv.ndim == 3 and qkv.shape[1] == 1)
    ):
        raise ValueError(f"qkv must be a float array of shape [B, 1, {C}], got {qkv.dtype} {tuple(qkv.shape)}")
    B = qkv.shape[0]
    x = qkv.dtype
    if z.size != B * Hv * D:
        raise ValueError(f"z must have shape [{B}, 1, {Hv * D}], got {tuple(z.shape)}")
    for name, t in (("a", a), ("b", b)):
        if t.size != B * Hv:
            raise ValueError(f"{name} must have shape [{B}, 1, {Hv}], got {tuple(t.shape)}")
    _check_params(conv_weight, conv_state, A_log, dt_bias, norm_weight, state, B, C, Hv)
    cast = any(t.dtype != x for t in (z, a, b)) or (conv_state is not None and conv_state.dtype != x)
    kern = _kernel(x, conv_weight.dtype, A_log.dtype, dt_bias.dtype, norm_weight.dtype, Hv, Hk, False)
    out_shapes = [(B, 1, Hv * D), (B, KW - 1, C), (B, Hv, D, D)]
    out_dtypes = [x, x, mx.float32]
    return kern, B, C, Hv, x, out_shapes, out_dtypes, (B * Hv * 512, 1, 1), cast


def _check_params(conv_weight, conv_state, A_log, dt_bias, norm_weight, state, B, C, Hv):
    """Raise ValueError (naming the argument) for a parameter or state outside the contract."""
    if conv_weight.size != C * KW or conv_weight.dtype not in _FLOAT:
        raise ValueError(f"conv_weight must have shape [{C}, {KW}, 1] (float), got {tuple(conv_weight.shape)}")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t.shape != (Hv,) or t.dtype not in _FLOAT:
            raise ValueError(f"{name} must have shape [{Hv}] (float), got {t.dtype} {tuple(t.shape)}")
    if norm_weight.shape != (D,) or norm_weight.dtype not in _FLOAT:
        raise ValueError(f"norm_weight must have shape [{D}] (float), got {tuple(norm_weight.shape)}")
    _check_states(conv_state, state, B, C, Hv)


def _check_states(conv_state, state, B, C, Hv):
    """Raise ValueError for a conv state or state (None allowed) outside the contract."""
    if conv_state is not None and conv_state.shape != (B, KW - 1, C):
        raise ValueError(f"conv_state must have shape [{B}, {KW - 1}, {C}], got {tuple(conv_state.shape)}")
    if state is not None and (state.shape != (B, Hv, D, D) or state.dtype != mx.float32):
        raise ValueError(
            f"state must be float32 of shape [{B}, {Hv}, {D}, {D}], got {state.dtype} {tuple(state.shape)}"
        )


def _kernel(x, w, A_log, dt_bias, norm_w, Hv: int, Hk: int, packed: bool) -> cb.CudaKernel:
    key = (x, w, A_log, dt_bias, norm_w, Hv, Hk, packed)
    kern = _kernels.get(key)
    if kern is None:
        kern = cb.CudaKernel(
            "gated_delta_decode.cu", "mqf_gdn_decode",
            dict(
                GDN_X=cb.dtype_macro(x), GDN_W=cb.dtype_macro(w), GDN_A=cb.dtype_macro(A_log),
                GDN_DT=cb.dtype_macro(dt_bias), GDN_N=cb.dtype_macro(norm_w), GDN_HV=Hv, GDN_HK=Hk,
                GDN_PACKED=int(packed),
            ),
        )
        _kernels[key] = kern
    return kern


def packed_width(num_k_heads: int, num_v_heads: int) -> int:
    """Last-axis size of :func:`gated_delta_decode_packed`'s ``proj``:
    (2 Hk + Hv) * 128 + Hv * 128 + 2 Hv (qkv | z | a | b)."""
    return (2 * num_k_heads + num_v_heads) * D + num_v_heads * D + 2 * num_v_heads


def params_width(num_k_heads: int, num_v_heads: int) -> int:
    """Size of :func:`decode_params`' array: C*4 + 2*Hv + 128, C = (2 Hk + Hv) * 128."""
    return (2 * num_k_heads + num_v_heads) * D * KW + 2 * num_v_heads + D


def decode_params(conv_weight: mx.array, A_log: mx.array, dt_bias: mx.array, norm_weight: mx.array) -> mx.array:
    """A layer's decode-step constants as one float32 array, for
    :func:`gated_delta_decode_packed`: ``[conv_weight (C*4) | A_log (Hv) |
    dt_bias (Hv) | norm_weight (128)]``. Every float type converts to float32
    exactly, so the kernel's results do not change; build it once per layer
    (one graph input instead of four: MLX's host cost per node grows with its
    inputs, bench/node_cost.py).

    Args:
      conv_weight: [C, 4, 1] (or [C, 4]), C a multiple of 128; A_log,
        dt_bias: [Hv]; norm_weight: [128]; any float dtype.

    Returns:
      float32 [C*4 + 2*Hv + 128].

    Raises:
      ValueError: a non-float array or one of another shape (names it).
    """
    for name, t in (("conv_weight", conv_weight), ("A_log", A_log), ("dt_bias", dt_bias),
                    ("norm_weight", norm_weight)):
        if t.dtype not in _FLOAT:
            raise ValueError(f"{name} must be a float array, got {t.dtype}")
    C = conv_weight.shape[0] if conv_weight.ndim else 0
    if conv_weight.shape not in ((C, KW, 1), (C, KW)) or C == 0 or C % D:
        raise ValueError(f"conv_weight must have shape [C, {KW}, 1] or [C, {KW}] with C a multiple of {D}, "
                         f"got {tuple(conv_weight.shape)}")
    if A_log.ndim != 1 or dt_bias.shape != A_log.shape:
        raise ValueError(f"A_log and dt_bias must both have shape [Hv], got {tuple(A_log.shape)} "
                         f"and {tuple(dt_bias.shape)}")
    if norm_weight.shape != (D,):
        raise ValueError(f"norm_weight must have shape [{D}], got {tuple(norm_weight.shape)}")
    return mx.concatenate([t.reshape(-1).astype(mx.float32) for t in (conv_weight, A_log, dt_bias, norm_weight)])


def gated_delta_decode_packed(
    proj: mx.array,
    params: mx.array,
    conv_state: Optional[mx.array],
    state: Optional[mx.array],
    *,
    num_k_heads: int,
    num_v_heads: int,
    norm_eps: float = 1e-6,
    qk_eps: float = 1e-6,
) -> Tuple[mx.array, mx.array, mx.array]:
    """:func:`gated_delta_decode` as a four-input graph node: qkv, z, a and b
    read from one array, the layer's constants from another.

    The same arithmetic as :func:`gated_delta_decode` on the separate arrays
    (bit for bit), for a layer whose four input projections run as one
    concatenated projection (one quantised matmul instead of four in the
    decode graph: ``compiled.concat_linears``) and whose constants were
    packed once by :func:`decode_params`. The kernel reads each piece at its
    offset, so no slice enters the graph.

    Args:
      proj: [B, 1, P] (or [B, P]) in bfloat16/float16/float32, P =
        :func:`packed_width` = C + Hv*128 + 2*Hv, each row = concat(qkv, z,
        a, b) as ``in_proj_qkv``, ``in_proj_z``, ``in_proj_a``,
        ``in_proj_b`` give them; C = (2 Hk + Hv) * 128.
      params: float32 [:func:`params_width`], from :func:`decode_params`.
      conv_state: [B, 3, C] previous conv inputs (cast to proj's dtype), or None for zeros.
      state: [B, Hv, 128, 128] float32, or None for zeros.
      num_k_heads, num_v_heads, norm_eps, qk_eps: as :func:`gated_delta_decode`.

    Returns:
      (out [B, 1, Hv*128] in proj's dtype, new conv state [B, 3, C], new
       state [B, Hv, 128, 128] float32).

    Raises:
      ValueError: shapes/dtypes outside the above (names the argument).
      RuntimeError: no CUDA compiler could build the kernel.
    """
    Hk, Hv = num_k_heads, num_v_heads
    if Hk <= 0 or Hv % Hk:
        raise ValueError(f"num_v_heads ({Hv}) must be a multiple of num_k_heads ({Hk})")
    C, P = (2 * Hk + Hv) * D, packed_width(Hk, Hv)
    if proj.dtype not in _FLOAT or proj.shape[-1] != P or not (
        proj.ndim == 2 or (proj.ndim == 3 and proj.shape[1] == 1)
    ):
        raise ValueError(f"proj must be a float array of shape [B, 1, {P}], got {proj.dtype} {tuple(proj.shape)}")
    if params.dtype != mx.float32 or params.shape != (params_width(Hk, Hv),):
        raise ValueError(f"params must be float32 of shape [{params_width(Hk, Hv)}] (decode_params), "
                         f"got {params.dtype} {tuple(params.shape)}")
    B, x = proj.shape[0], proj.dtype
    _check_states(conv_state, state, B, C, Hv)
    if conv_state is None:
        conv_state = mx.zeros((B, KW - 1, C), dtype=x)
    elif conv_state.dtype not in _FLOAT:
        raise ValueError(f"conv_state must be a float array, got {conv_state.dtype}")
    elif conv_state.dtype != x:  # the kernel reads it in the activation dtype
        conv_state = conv_state.astype(x)
    if state is None:
        state = mx.zeros((B, Hv, D, D), dtype=mx.float32)
    kern = _kernel(x, mx.float32, mx.float32, mx.float32, mx.float32, Hv, Hk, True)
    out, new_conv, new_state = kern(
        [proj, params, conv_state, state],
        [(B, 1, Hv * D), (B, KW - 1, C), (B, Hv, D, D)], [x, x, mx.float32],
        (B * Hv * 512, 1, 1), (512, 1, 1), (qk_eps, norm_eps),
    )
    return out, new_conv, new_state
