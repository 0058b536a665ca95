"""Fast-path modules for mlx-lm's Qwen3.5/3.6 layers.

Each class subclasses the stock mlx-lm module and only replaces ``__call__``:
the parameters (quantised or not) stay the same arrays under the same paths,
so ``model.parameters()``, saving, ``load_weights`` and sharding are unchanged.
:func:`rebind` moves an existing module instance to another class without
copying anything; :mod:`mlx_qwen_fast.patch` uses it in both directions.
"""

import os
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import sum_gradients
from mlx_lm.models.gated_delta import normalize_qk
from mlx_lm.models.qwen3_5 import GatedDeltaNet
from mlx_lm.models.qwen3_next import Qwen3NextAttention, Qwen3NextSparseMoeBlock

from .compiled import StepPlans, apply_linear, concat_linears, linear_arrays, linear_paths
from .kernels import gated_delta_decode as k_decode
from .kernels import gated_delta_frontend as k_frontend
from .kernels import gated_delta_prefill as k_prefill
from .kernels import gated_delta_scan as k_scan
from .kernels import gated_rms_norm as k_norm
from .ops import attention as attention_ops
from .ops import gated_delta as gated_delta_ops
from .ops import moe as moe_ops


#: ``MLX_QWEN_FAST_GDN_FUSED=1`` runs the GDN prefill front end and scan as
#: one fused kernel (``kernels/gated_delta_prefill``, B = 1) instead of two.
#: Off by default: measured on the H200 (bench/results/gdn-cuda-log.md), the
#: fused kernel is at most 1-2% faster as a kernel (0.983 vs 0.993-1.001 ms
#: per 4K call at steady state, chained as layers), and the patched model's
#: 4K prefill is not faster with it (2026-12-01: 12,657-13,295 vs
#: 13,539-14,179 tok/s; 2026-12-02: 12,496-12,697 vs 12,601-12,722).
GDN_FUSED_ENV = "MLX_QWEN_FAST_GDN_FUSED"

#: ``MLX_QWEN_FAST_GDN_PACKED_DECODE=0`` keeps the GDN decode step's four input
#: projections as four quantised matmuls. By default (on CUDA) they run as
#: one, over the four layers' weights concatenated once per layer (one graph
#: node instead of four per token: each costs ~10 us of MLX host work; the
#: copy costs ~14 MB of GPU memory per layer, 0.4 GB for the 30 layers of
#: Qwen3.6-35B-A3B), and the decode kernel reads the pieces at their offsets.
GDN_PACKED_ENV = "MLX_QWEN_FAST_GDN_PACKED_DECODE"


def rebind(module: nn.Module, cls: type) -> nn.Module:
    """Return a module of class ``cls`` sharing every array and child of ``module``.

    ``cls`` must be ``type(module)``'s subclass or base class with the same
    attributes (the fast classes below and their stock parents).
    """
    new = cls.__new__(cls)
    dict.update(new, module)
    new.__dict__.update(module.__dict__)
    return new


class FastGatedDeltaNet(GatedDeltaNet):
    """``qwen3_5.GatedDeltaNet`` with the recurrence from :mod:`ops.gated_delta`.

    Where :func:`ops.gated_delta.implementation_for` picks the CUDA kernels
    (and the call has no padding mask, no per-row cache lengths and no
    sharding), the layer runs fused: for prefill the front end (conv1d + SiLU
    + q/k L2 norm + gates), the register-resident scan and the gated RMSNorm;
    for decode one kernel for everything between the input projections and
    ``out_proj``. Otherwise the projections, conv1d, normalisation and output
    are mlx-lm's and only the gated delta rule is dispatched (chunkwise-parallel
    form on CPU/CUDA instead of stock's per-token loop, mlx-lm's own kernel on
    Metal).
    """

    stock_class = GatedDeltaNet

    def __call__(
        self,
        inputs: mx.array,
        mask: Optional[mx.array] = None,
        cache: Optional[Any] = None,
    ) -> mx.array:
        S = inputs.shape[1]
        if (
            mask is None
            and self.sharding_group is None
            and (cache is None or cache.lengths is None)
            and gated_delta_ops.implementation_for(S) == gated_delta_ops.CUDA_KERNEL
        ):
            fused = self._decode_cuda if S == 1 else self._prefill_cuda
            out = fused(inputs, cache)
            if out is not None:
                return out
        return self._reference(inputs, mask, cache)

    def _heads(self):
        return dict(num_k_heads=self.num_k_heads, num_v_heads=self.num_v_heads)

    def _states(self, cache):
        conv_state = cache[0] if cache is not None else None
        state = cache[1] if cache is not None else None
        return conv_state, state

    def _store(self, cache, conv_state, state, S):
        if cache is not None:
            cache[0] = conv_state
            cache[1] = state
            cache.advance(S)

    def _prefill_cuda(self, inputs, cache):
        """Front end + scan (two kernels, or one fused kernel with
        ``MLX_QWEN_FAST_GDN_FUSED=1``) + gated norm kernels; None if a kernel
        can't take the call."""
        B, S, _ = inputs.shape
        qkv = self.in_proj_qkv(inputs)
        conv_state, state = self._states(cache)
        dims = dict(head_k_dim=self.head_k_dim, head_v_dim=self.head_v_dim)
        if conv_state is None:
            conv_state = mx.zeros((B, self.conv_kernel_size - 1, self.conv_dim), qkv.dtype)
        if not k_frontend.supports(qkv, conv_state, self.conv1d.weight, **self._heads(), **dims):
            return None
        z = self.in_proj_z(inputs).reshape(B, S, self.num_v_heads, self.head_v_dim)
        a, b = self.in_proj_a(inputs), self.in_proj_b(inputs)
        if os.environ.get(GDN_FUSED_ENV, "") == "1" and k_prefill.supports(
            qkv, conv_state, self.conv1d.weight, state, **self._heads(), **dims
        ):
            y, state, conv_state = k_prefill.gated_delta_prefill(
                qkv, a, b, self.conv1d.weight, conv_state, self.A_log, self.dt_bias, state,
                **self._heads(),
            )
        else:
            q, k, v, g, beta, conv_state = k_frontend.gated_delta_frontend(
                qkv, a, b, self.conv1d.weight, conv_state, self.A_log, self.dt_bias, **self._heads(),
            )
            if not k_scan.supports(q, k, v, g, beta, state):
                return None
            y, state = k_scan.gated_delta_scan(q, k, v, g, beta, state)
        self._store(cache, conv_state, state, S)
        if k_norm.supports(y, z, self.norm.weight):
            out = k_norm.gated_rms_norm(y, z, self.norm.weight, self.norm.eps)
        else:
            out = self.norm(y, z)
        return self.out_proj(out.reshape(B, S, -1))

    def _decode_cuda(self, inputs, cache):
        """The whole step, projections included, in one ``mx.compile``d call
        (:func:`_gdn_decode_step`: the input projections, the fused kernel
        for everything between them and ``out_proj``, ``out_proj``); the
        eager launches where a projection is not a plain (quantised) linear
        layer. None where the kernel does not take the call."""
        conv_state, state = self._states(cache)
        B = inputs.shape[0]
        if conv_state is None:
            conv_state = mx.zeros((B, self.conv_kernel_size - 1, self.conv_dim), inputs.dtype)
        if state is None:
            state = mx.zeros((B, self.num_v_heads, self.head_v_dim, self.head_k_dim), mx.float32)
        packed = os.environ.get(GDN_PACKED_ENV, "1") != "0"
        key = (tuple(inputs.shape), inputs.dtype, conv_state.dtype, state.dtype, packed)
        arrays, plan = StepPlans.of(self).get(key, self, lambda: self._decode_plan(inputs, state, packed))
        if plan is None:
            return None
        if isinstance(plan, str):  # "eager"
            return self._decode_cuda_eager(inputs, conv_state, state, cache)
        fn, n_used, extra = plan
        out, conv_state, state = fn(inputs, conv_state, state, *arrays[:n_used], *extra)
        self._store(cache, conv_state, state, 1)
        return out

    _PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")
    _STEP_ARRAYS = (("conv1d", "weight"), ("A_log",), ("dt_bias",), ("norm", "weight"))

    def _decode_plan(self, inputs, state, packed: bool):
        """``(paths, plan)`` for :class:`StepPlans`: plan = ``(compiled step,
        number of the gathered arrays it takes, extra arrays)``, "eager" (a
        projection of another kind) or None (the kernel does not apply).

        With ``packed``, and the four input projections alike (same
        quantisation), the step takes out_proj's arrays, the layer's constants
        packed by ``decode_params`` and one concatenated input projection
        (:func:`concat_linears`), the last two as the extra arrays; their
        sources stay in the paths, so replacing one rebuilds the plan. Both
        are copies: an array changed in place (``layer.A_log[0] = v``, the
        same object) is not seen; assign a new array (as ``update`` and
        ``load_weights`` do), or set ``MLX_QWEN_FAST_GDN_PACKED_DECODE=0``."""
        qkv = mx.zeros((inputs.shape[0], 1, self.conv_dim), inputs.dtype)  # shape only, never evaluated
        children = [(n,) for n in self._PROJECTIONS]
        if not k_decode.supports(
            qkv, state, **self._heads(), head_k_dim=self.head_k_dim, head_v_dim=self.head_v_dim
        ):
            return children, None
        lins = [linear_arrays(getattr(self, n)) for n in self._PROJECTIONS]
        if any(lin is None for lin in lins):
            return children, "eager"
        in_proj = concat_linears(lins[:4]) if packed else None
        if in_proj is not None:
            paths = linear_paths(("out_proj",), lins[4])
            n_used = len(paths)
            paths += self._STEP_ARRAYS + tuple(
                p for n, lin in zip(self._PROJECTIONS[:4], lins) for p in linear_paths((n,), lin))
            params = k_decode.decode_params(self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight)
            mx.eval(params)  # built once, outside the first step's graph
            fn = _gdn_decode_step_packed(self.num_k_heads, self.num_v_heads, self.norm.eps,
                                         (len(lins[4][0]), lins[4][1]), (len(in_proj[0]), in_proj[1]))
            return paths, (fn, n_used, (params,) + tuple(in_proj[0]))
        paths = self._STEP_ARRAYS + tuple(
            p for n, lin in zip(self._PROJECTIONS, lins) for p in linear_paths((n,), lin))
        statics = tuple((len(lin[0]), lin[1]) for lin in lins)
        return paths, (_gdn_decode_step(self.num_k_heads, self.num_v_heads, self.norm.eps, statics),
                       len(paths), ())

    def _decode_cuda_eager(self, inputs, conv_state, state, cache):
        """One kernel between the projections, the projections called as modules."""
        qkv = self.in_proj_qkv(inputs)
        if not k_decode.supports(
            qkv, state, **self._heads(), head_k_dim=self.head_k_dim, head_v_dim=self.head_v_dim
        ):
            return None
        out, conv_state, state = k_decode.gated_delta_decode(
            qkv, self.in_proj_z(inputs), self.in_proj_a(inputs), self.in_proj_b(inputs),
            self.conv1d.weight, conv_state, self.A_log, self.dt_bias, self.norm.weight,
            state, **self._heads(), norm_eps=self.norm.eps, compiled=True,
        )
        self._store(cache, conv_state, state, 1)
        return self.out_proj(out)

    def _reference(self, inputs, mask, cache):
        B, S, _ = inputs.shape
        if self.sharding_group is not None:
            inputs = sum_gradients(self.sharding_group)(inputs)

        qkv = self.in_proj_qkv(inputs)
        z = self.in_proj_z(inputs).reshape(B, S, self.num_v_heads, self.head_v_dim)
        b = self.in_proj_b(inputs)
        a = self.in_proj_a(inputs)

        if cache is not None and cache[0] is not None:
            conv_state = cache[0]
        else:
            conv_state = mx.zeros(
                (B, self.conv_kernel_size - 1, self.conv_dim), dtype=inputs.dtype
            )
        if mask is not None:
            qkv = mx.where(mask[..., None], qkv, 0)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        if cache is not None:
            n_keep = self.conv_kernel_size - 1
            if cache.lengths is not None:
                ends = mx.clip(cache.lengths, 0, S)
                positions = (ends[:, None] + mx.arange(n_keep))[..., None]
                cache[0] = mx.take_along_axis(conv_input, positions, axis=1)
            else:
                cache[0] = mx.contiguous(conv_input[:, -n_keep:, :])
        conv_out = nn.silu(self.conv1d(conv_input))

        q, k, v = [
            t.reshape(B, S, h, d)
            for t, h, d in zip(
                mx.split(conv_out, [self.key_dim, 2 * self.key_dim], -1),
                [self.num_k_heads, self.num_k_heads, self.num_v_heads],
                [self.head_k_dim, self.head_k_dim, self.head_v_dim],
            )
        ]
        q, k = normalize_qk(q, k, inv_scale=self.head_k_dim**-0.5, eps=1e-6)

        state = cache[1] if cache else None
        out, state = gated_delta_ops.gated_delta_update(
            q, k, v, a, b, self.A_log, self.dt_bias, state, mask
        )
        if cache is not None:
            cache[1] = state
            cache.advance(S)

        out = self.norm(out, z)
        out = self.out_proj(out.reshape(B, S, -1))
        if self.sharding_group is not None:
            out = mx.distributed.all_sum(out, group=self.sharding_group)
        return out


_gdn_steps = {}


def _gdn_decode_step(num_k_heads: int, num_v_heads: int, norm_eps: float, statics: tuple):
    """The ``mx.compile``d decode step of a Gated DeltaNet layer, projections
    included, for one static setting (all arrays are inputs: one trace per
    input signature, shared by every layer)::

        fn(x, conv_state, state, conv_weight, A_log, dt_bias, norm_weight,
           *in_proj_qkv, *in_proj_z, *in_proj_a, *in_proj_b, *out_proj)
        -> (y [B, 1, D], new conv_state, new state)

    ``statics``: ``(number of arrays, linear_arrays static)`` per projection.
    """
    key = (int(num_k_heads), int(num_v_heads), float(norm_eps), statics)
    fn = _gdn_steps.get(key)
    if fn is None:

        def step(x, conv_state, state, conv_weight, A_log, dt_bias, norm_weight, *flat):
            outs, i = [], 0
            for n, static in statics[:4]:
                outs.append(apply_linear(x, flat[i:i + n], static))
                i += n
            qkv, z, a, b = outs
            out, conv_state, state = k_decode.gated_delta_decode(
                qkv, z, a, b, conv_weight, conv_state, A_log, dt_bias, norm_weight, state,
                num_k_heads=key[0], num_v_heads=key[1], norm_eps=key[2],
            )
            return apply_linear(out, flat[i:], statics[4][1]), conv_state, state

        fn = _gdn_steps[key] = mx.compile(step)
    return fn


def _gdn_decode_step_packed(num_k_heads: int, num_v_heads: int, norm_eps: float, out_static: tuple,
                            in_static: tuple):
    """:func:`_gdn_decode_step` with the four input projections as one
    (:func:`concat_linears`), the kernel reading its output in place and the
    layer's constants from one array (``gated_delta_decode_packed``,
    ``decode_params``)::

        fn(x, conv_state, state, *out_proj, params, *in_proj_concatenated)
        -> (y [B, 1, D], conv_state, state)

    ``out_static`` / ``in_static``: ``(number of arrays, linear_arrays static)``.
    """
    key = ("packed", int(num_k_heads), int(num_v_heads), float(norm_eps), out_static, in_static)
    fn = _gdn_steps.get(key)
    if fn is None:
        n_out = out_static[0]

        def step(x, conv_state, state, *flat):
            proj = apply_linear(x, flat[n_out + 1:], in_static[1])
            out, conv_state, state = k_decode.gated_delta_decode_packed(
                proj, flat[n_out], conv_state, state,
                num_k_heads=key[1], num_v_heads=key[2], norm_eps=key[3],
            )
            return apply_linear(out, flat[:n_out], out_static[1]), conv_state, state

        fn = _gdn_steps[key] = mx.compile(step)
    return fn


class FastAttention(Qwen3NextAttention):
    """Gated full attention dispatched through :mod:`ops.attention`."""

    stock_class = Qwen3NextAttention

    def __call__(self, x, mask=None, cache=None):
        return attention_ops.gated_attention(self, x, mask=mask, cache=cache)


class FastSparseMoeBlock(Qwen3NextSparseMoeBlock):
    """Sparse MoE block (router, top-k experts, shared expert) via :mod:`ops.moe`."""

    stock_class = Qwen3NextSparseMoeBlock

    def __call__(self, x):
        return moe_ops.sparse_moe(self, x)


FAST_CLASSES = {
    GatedDeltaNet: FastGatedDeltaNet,
    Qwen3NextAttention: FastAttention,
    Qwen3NextSparseMoeBlock: FastSparseMoeBlock,
}
