"""Gated DeltaNet decode step on CUDA: one kernel per layer and token.

Fuses everything of mlx-lm's ``GatedDeltaNet.__call__`` (mlx_lm/models/
qwen3_5.py) between the input projections and ``out_proj`` for T = 1: conv
state update, depthwise conv + SiLU, q/k L2 normalisation, gates, the gated
delta rule state update and readout, and the gated RMSNorm with z -- one
graph node instead of ~40. The four input projections' outputs come as one
array (the layer runs them as one concatenated quantised matmul:
``compiled.concat_linears``) and the layer's constants as another
(:func:`~mlx_qwen_fast.kernels.gated_delta_contract.decode_params`, built
once per layer), so the node has four inputs. The argument checks and
the constants' layout, which the Metal kernel shares:
:mod:`~mlx_qwen_fast.kernels.gated_delta_contract`.
Each block owns one (batch, value head) and issues its 64 KB of state loads
before the front-end arithmetic so the two overlap.
Source: ``mlx_qwen_fast/cuda/gated_delta_decode.cu``.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import mlx.core as mx

from . import _checks
from . import _cuda_build as cb
from .gated_delta_contract import D, FLOAT_DTYPES, KW, check_step

__all__ = ["gated_delta_decode", "supports"]

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
    """True when :func:`gated_delta_decode` can run a layer's step whose
    ``in_proj_qkv`` output is ``qkv``.

    Needs the CUDA backend, one token (qkv [B, 1, C] or [B, C], C = (2 Hk +
    Hv) * 128), head dims 128, Hv a multiple of Hk, a float32 state
    [B, Hv, 128, 128] (or None) and no mask. Pure shape checks (``qkv`` is
    never evaluated).
    """
    if not cb.cuda_available() or mask is not None:
        return False
    if not (_checks.is_array(qkv) and _checks.is_array(state, optional=True)):
        return False
    if head_k_dim != D or head_v_dim != D or num_k_heads <= 0 or num_v_heads % num_k_heads:
        return False
    if not (qkv.ndim == 2 or (qkv.ndim == 3 and qkv.shape[1] == 1)):
        return False
    C = (2 * num_k_heads + num_v_heads) * D
    if qkv.dtype not in FLOAT_DTYPES or qkv.shape[-1] != C:
        return False
    B = qkv.shape[0]
    if state is not None and (state.shape != (B, num_v_heads, D, D) or state.dtype != mx.float32):
        return False
    return True


def _kernel(x, Hv: int, Hk: int) -> cb.CudaKernel:
    key = (x, Hv, Hk)
    kern = _kernels.get(key)
    if kern is None:
        kern = _kernels[key] = cb.CudaKernel(
            "gated_delta_decode.cu", "mqf_gdn_decode", dict(GDN_X=cb.dtype_macro(x), GDN_HV=Hv, GDN_HK=Hk),
        )
    return kern


def gated_delta_decode(
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
    """One decode step of a Gated DeltaNet layer, up to ``out_proj``.

    qkv, z, a and b are read from one array at their offsets (no slice
    enters the graph), the layer's constants from
    :func:`~.gated_delta_contract.decode_params`.
    All arithmetic in fp32; the conv state is read in the activation dtype.

    Args:
      proj: [B, 1, P] (or [B, P]) in bfloat16/float16/float32, P =
        :func:`~.gated_delta_contract.packed_width` = C + Hv*128 + 2*Hv,
        each row = concat(qkv, z, a, b) as ``in_proj_qkv``, ``in_proj_z``,
        ``in_proj_a``, ``in_proj_b`` give them; C = (2 Hk + Hv) * 128.
      params: float32 [:func:`~.gated_delta_contract.params_width`], from
        :func:`~.gated_delta_contract.decode_params`.
      conv_state: [B, 3, C] previous conv inputs (cast to proj's dtype), or None for zeros.
      state: [B, Hv, 128, 128] float32, or None for zeros.
      num_k_heads, num_v_heads: Hk, Hv.
      norm_eps: the gated RMSNorm's eps (``rms_norm_eps``).
      qk_eps: the q/k L2-norm eps (mlx-lm: 1e-6).

    Returns:
      (out [B, 1, Hv*128] in proj's dtype, new conv state [B, 3, C], new
       state [B, Hv, 128, 128] float32); for B = 0 the empty arrays,
       without a launch.

    Raises:
      ValueError: an argument that is not an mx.array, shapes/dtypes
        outside the above (names the argument), an eps outside (0, 1).
      RuntimeError: no CUDA compiler could build the kernel.
    """
    B, x, C, conv_state, state, eps = check_step("gated_delta_decode", proj, params, conv_state, state,
                                                 num_k_heads, num_v_heads, norm_eps, qk_eps)
    Hk, Hv = num_k_heads, num_v_heads
    if B == 0:  # no rows: a launch of an empty grid is an error
        return mx.zeros((0, 1, Hv * D), x), conv_state, state
    kern = _kernel(x, Hv, Hk)
    out, new_conv, new_state = kern(
        [proj, params, conv_state, state],
        [(B, 1, Hv * D), (B, KW - 1, C), (B, Hv, D, D)], [x, x, mx.float32],
        (B * Hv * 512, 1, 1), (512, 1, 1), eps,
    )
    return out, new_conv, new_state
