"""The Gated DeltaNet layer's decode step on the Metal kernel.

:func:`_metal_decode` runs the Metal decode kernel
(:mod:`mlx_qwen_fast.kernels.gated_delta_decode_metal`, the CUDA decode
kernel's contract) between the projections called as modules, where
:func:`_layer_takes_metal_decode`; the recurrence itself (prefill) runs on
mlx-lm's own Metal kernels through the dispatcher's "mlx-lm-metal".
"""

from __future__ import annotations

import mlx.core as mx

from ... import backend as _backend
from ... import config
from ...compiled import StepPlans
from ...kernels import gated_delta_contract as _k_contract
from ...kernels import gated_delta_decode_metal as _k_decode_metal
from .checks import _STEP_ARRAYS, _decode_modules, _decode_params, _states


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
    if layer.head_k_dim != _k_contract.D or layer.head_v_dim != _k_contract.D or \
            layer.num_v_heads % layer.num_k_heads:
        return None
    _, params = StepPlans.of(layer).get(("metal-params",), layer, lambda: (_STEP_ARRAYS, _metal_params(layer)))
    if params is None:  # inside an mx.compile trace of the module's arrays: the reference runs
        return None
    conv_state, state = _states(cache)
    return _decode_modules(layer, inputs, _k_decode_metal.gated_delta_decode_metal, params, conv_state, state,
                           cache)


def _metal_params(layer):
    params = _decode_params(layer)
    mx.eval(params)
    return params
