"""Gated DeltaNet recurrence: reference, chunkwise-parallel form, dispatch.

Replaces ``mlx_lm.models.gated_delta.gated_delta_update``.  On Apple GPUs
mlx-lm runs the recurrence with Metal kernels; on CUDA and CPU it falls back
to ``gated_delta_ops``, a Python loop over every token (about 40 graph nodes
per token per layer, ~90% of stock prefill time on CUDA).  This package keeps
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

Layout (that of flash-linear-attention's ``fla/ops/gated_delta_rule``)
----------------------------------------------------------------------
* :mod:`.naive` -- the reference of record: the per-token recurrence
  (:func:`gated_delta_recurrent`, :func:`gated_delta_recurrent_steps`) and
  the gates (:func:`compute_gates`);
* :mod:`.chunk` -- the chunkwise-parallel form (:func:`gated_delta_chunked`);
* :mod:`.checks` -- argument checks, and the layer's and cache's layout and
  the decode kernel between the projections, shared by the CUDA and Metal
  paths;
* :mod:`.cuda` -- the layer on the CUDA kernels (prefill; the compiled
  decode step, the one-launch mixer);
* :mod:`.metal` -- the layer's decode step on the Metal kernel;
* this package -- the dispatch: :func:`gated_delta_update`,
  :func:`gated_delta_net` and the functions callers use.

The dispatch looks its paths up in this package's namespace, so a name
replaced here (``implementation_for``, ``decode_step_parts``,
``_metal_decode``, ...) takes effect; the submodules' own state (the
compiled decode steps ``cuda._decode_steps``, the chunked form's
``chunk._flush_subnormals``) is read in the submodule that defines it.
"""

from __future__ import annotations

import math

from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gated_delta as _stock

from ... import backend as _backend
from ...kernels import _cuda_build
from ...kernels import gated_delta_scan as _k_scan
from ...kernels._checks import check_arrays
from .._checks import check_int
from .checks import _LAYER_ARRAYS, _UPDATE_ARRAYS, _check_gates, _check_inputs, _check_layer_call, _states
from .chunk import DEFAULT_CHUNK_SIZE, gated_delta_chunked
from .cuda import _cuda_decode, _cuda_prefill, _decode_plan
from .metal import _layer_takes_metal_decode, _metal_decode
from .naive import compute_gates, gated_delta_recurrent, gated_delta_recurrent_steps

# read from this package by the patch report and the tests
from .checks import _PROJECTIONS, _store  # noqa: F401
from .cuda import _cuda_decode_modules, mixer_takes_weights  # noqa: F401
# read by the layer plans (ops/layer_plans.py: the one-launch decoder layer)
from .cuda import MixerSettings, mixer_step_settings  # noqa: F401

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
# dispatch of the recurrence
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
      ValueError: for an unknown backend name, or ``T`` not an int >= 0.
    """
    if type(T) is not int or T < 0:
        check_int("implementation_for", "T", T, 0)
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
      ValueError (the message starts with ``gated_delta_update``): an
        argument that is not an mx.array; as :func:`compute_gates` for
        ``a``, ``b``, ``A_log`` and ``dt_bias``, ``a`` and ``b`` not of the
        ``[B, T, Hv]`` of q and v; as :func:`gated_delta_recurrent` for the
        rest; ``lower_bound`` not None or a finite number; ``use_kernel``
        or ``allow_neg_eigval`` not a bool. Vector gates (``a`` of
        rank 4) are mlx-lm's and checked there.
    """
    fn = "gated_delta_update"
    check_arrays(fn, _UPDATE_ARRAYS, q, k, v, a, b, A_log, dt_bias, state, mask)
    if lower_bound is not None and (isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float))
                                    or not math.isfinite(lower_bound)):
        raise ValueError(f"{fn}: lower_bound must be None or a finite number, got {lower_bound!r}")
    for name, flag in (("use_kernel", use_kernel), ("allow_neg_eigval", allow_neg_eigval)):
        if not isinstance(flag, bool):
            raise ValueError(f"{fn}: {name} must be a bool, got {flag!r}")
    if a.ndim != 4:
        _check_gates(fn, a, b, A_log, dt_bias)
        _check_inputs(q, k, v, a, b, state, mask, fn, gates=("a", "b"))
    return _update(q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel=use_kernel, lower_bound=lower_bound,
                   allow_neg_eigval=allow_neg_eigval)


def _update(q, k, v, a, b, A_log, dt_bias, state, mask, *, use_kernel: bool = True,
            lower_bound: Optional[float] = None, allow_neg_eigval: bool = False):
    """:func:`gated_delta_update` of arguments known to be arrays (the
    layer's own: the per-token path skips that check; the gates' and the
    recurrence's shape checks still run)."""
    if a.ndim == 4:  # vector gating: not this package's contract
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
        _check_inputs(q, k, v, g, beta, state, mask, "gated_delta_update")
    return _TABLE[name](q, k, v, g, beta, state, mask)


# --------------------------------------------------------------------------
# the whole layer (mlx-lm's GatedDeltaNet) and its dispatch
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
    package: the dispatch entry of the fast layer.

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
        ValueError: ``layer`` not an mlx-lm ``GatedDeltaNet``; ``inputs``
            (or ``mask``) not an mx.array; ``inputs`` not a float ``[B, S,
            D]`` with D the layer's hidden size; ``mask`` not ``[B, S]``;
            ``cache`` not None or an ``ArraysCache``, or holding states of
            other shapes than the layer's for B rows (shape checks only).
    """
    _check_layer_call("gated_delta_net", layer, inputs, mask, cache)
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
        ValueError: as :func:`gated_delta_net`, and ``inputs`` with B or S
            0, ``cache`` None or with per-row lengths / left padding.
    """
    fn = "gated_delta_net_steps"
    if cache is None or getattr(cache, "lengths", None) is not None \
            or getattr(cache, "left_padding", None) is not None:
        raise ValueError(f"{fn}: cache must be the layer's ArraysCache without per-row lengths "
                         f"or left padding, got {cache!r}")
    if not isinstance(inputs, mx.array):
        check_arrays(fn, _LAYER_ARRAYS, inputs, None)
    if inputs.ndim != 3 or inputs.shape[0] < 1 or inputs.shape[1] < 1:
        raise ValueError(f"{fn}: inputs must have shape [B, S, D] with B, S >= 1, got {tuple(inputs.shape)}")
    _check_layer_call(fn, layer, inputs, None, cache)
    steps: List[Tuple[mx.array, mx.array]] = []
    out = _layer_reference(layer, inputs, None, cache, steps)
    return out, steps


def decode_step_parts(layer, inputs: mx.array, cache, input_norm_eps: Optional[float] = None,
                      input_norm_weight: Optional[mx.array] = None):
    """The compiled decode step of ``layer`` for one token per row, for a
    caller that traces it inside its own compiled function
    (:func:`mlx_qwen_fast.ops.layer_plans.decode_layer`); None where
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
