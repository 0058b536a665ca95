"""The Gated DeltaNet layer on the CUDA kernels.

* prefill (:func:`_cuda_prefill`): the front-end kernel (conv1d, SiLU,
  L2 norm, gates), the scan and the gated RMSNorm between the projections
  (``in_proj_qkv``, ``in_proj_z`` and ``out_proj`` through
  :func:`mlx_qwen_fast.ops.linear.prefill_linear`; ``in_proj_a``/``_b``
  mlx-lm's);
* decode (:func:`_cuda_decode`): one ``mx.compile``d step per layer
  (:func:`_decode_step`: the four input projections as one matmul, the
  decode kernel, ``out_proj``; or the one-launch mixer,
  :func:`_mixer_step`), planned once per layer and call signature
  (:func:`_decode_plan`, :class:`mlx_qwen_fast.compiled.StepPlans`).

Each returns None where a kernel does not take the call; the dispatcher
(:func:`mlx_qwen_fast.ops.gated_delta.gated_delta_net`) then runs the
reference layer.
"""

from __future__ import annotations

from typing import Callable, Dict, NamedTuple, Optional

import mlx.core as mx

from ... import config
from ...compiled import StepPlans, concat_linears, linear_arrays, linear_paths
from ...kernels import gated_delta_decode as _k_decode
from ...kernels import gated_delta_frontend as _k_frontend
from ...kernels import gated_delta_scan as _k_scan
from ...kernels import gated_rms_norm as _k_norm
from ...kernels import gdn_mixer_decode as _k_mixer
from .. import _launch_order
from .. import linear as linear_ops
from .checks import _PROJECTIONS, _STEP_ARRAYS, _decode_modules, _decode_params, _heads, _states, _store


# --------------------------------------------------------------------------
# prefill
# --------------------------------------------------------------------------


def _cuda_prefill(layer, inputs, cache):
    """Front end + scan + gated-norm kernels between mlx-lm's projections;
    None (before touching the cache) where a kernel does not take the call."""
    B, S, _ = inputs.shape
    qkv = linear_ops.prefill_linear(layer.in_proj_qkv, inputs)
    conv_state, state = _states(cache)
    if conv_state is None:
        conv_state = mx.zeros((B, layer.conv_kernel_size - 1, layer.conv_dim), qkv.dtype)
    if not _k_frontend.supports(qkv, conv_state, layer.conv1d.weight, **_heads(layer),
                                head_k_dim=layer.head_k_dim, head_v_dim=layer.head_v_dim):
        return None
    z = linear_ops.prefill_linear(layer.in_proj_z, inputs).reshape(B, S, layer.num_v_heads, layer.head_v_dim)
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
    return linear_ops.prefill_linear(layer.out_proj, out.reshape(B, S, -1))


# --------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------


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
    params = _decode_params(layer)
    mx.eval(params)  # built once, outside the first step's graph
    fn = _decode_step(layer.num_k_heads, layer.num_v_heads, layer.norm.eps,
                      (len(lins[4][0]), lins[4][1]), (len(in_proj[0]), in_proj[1]), input_norm_eps)
    return paths, (fn, n_used, (params,) + tuple(in_proj[0]))


def _cuda_decode_modules(layer, inputs, conv_state, state, cache):
    """The decode kernel between the projections called as modules (LoRA
    layers): their outputs concatenated as the kernel reads them."""
    return _decode_modules(layer, inputs, _k_decode.gated_delta_decode, _decode_params(layer), conv_state, state,
                           cache)


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


class MixerSettings(NamedTuple):
    """What a one-launch mixer step (:func:`_mixer_step`) bakes in."""

    num_k_heads: int
    num_v_heads: int
    norm_eps: float
    n_out: int  # out_proj's arrays
    input_norm_eps: float


def mixer_step_settings(fn) -> Optional[MixerSettings]:
    """The :class:`MixerSettings` of ``fn`` where it is a one-launch mixer
    step made here (a :func:`decode_step_parts` ``fn``), else None: what a
    layer step that runs the mixer inside a larger launch
    (:func:`mlx_qwen_fast.kernels.gdn_layer_decode.gdn_layer_decode`)
    needs to know."""
    for key, f in _decode_steps.items():
        if f is fn and key[0] == "mixer":
            return MixerSettings(*key[1:])
    return None


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
                num_v_heads=key[2], input_norm_eps=key[5], norm_eps=key[3], after=_launch_order.take())

        fn = _decode_steps[key] = mx.compile(step)
    return fn
