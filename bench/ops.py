"""Per-op benchmark: every implementation of each op family at the model's shapes.

Op families and the implementations run (discovered from each ops module's
dispatch table by :func:`implementations`, plus mlx-lm's own code as the
stock baseline; names for another backend -- "metal" or "cuda" in the name --
are left out):

* ``gated_delta.prefill`` / ``gated_delta.decode``: the recurrence alone,
  ``fn(q, k, v, g, beta, state, mask)`` (``mlx_qwen_fast.ops.gated_delta``;
  "stock-loop" = ``mlx_lm.models.gated_delta.gated_delta_ops``). Bytes: q, k,
  v, g, beta, y, state read + written; FLOPs 6 Hv Dk Dv per token.
* ``gated_delta.prefill_step``: the work of one Gated DeltaNet layer between
  its input projections and the gated norm for T tokens (conv state + conv +
  SiLU + q/k L2 norm + gates, then the recurrence), ``fn(layer, qkv, a, b,
  conv_state, state)``: "stock" = mlx-lm's functions in the order its
  ``GatedDeltaNet.__call__`` runs them (the recurrence: its per-token
  ``gated_delta_ops`` on CUDA), "cuda-kernel" = the front-end kernel then
  the scan kernel, as the patched layer runs them. Chained as ``gated_delta.prefill``
  (conv state and state feed the next call; the next conv state also waits
  for this call's y through a 3-element link, so that, as between the
  model's layers, the next front end cannot overlap this recurrence). Bytes: qkv, a, b read, q, k,
  v, g, beta written and read (the two-kernel form's round trip), y
  written, states read + written; FLOPs 6 Hv Dk Dv per token.
* ``gated_delta.decode_step``: the work of one Gated DeltaNet layer between
  its input projections and ``out_proj`` for one token (conv state update,
  conv + SiLU, q/k L2 norm, gates, state update and readout, gated RMSNorm:
  the scope of the fused CUDA decode kernel), ``fn(layer, qkv, z, a, b,
  conv_state, state)``: "stock" = mlx-lm's functions in the order its
  ``GatedDeltaNet.__call__`` runs them, "cuda-kernel" = the fused kernel
  (``kernels.gated_delta_decode``) in the patched layer's form: one input
  [qkv | z | a | b] (in the model, one concatenated projection's output) and
  the layer's constants from ``decode_params``, both built once, the kernel
  ``mx.compile``d. Chained ``--layer-chain``
  steps per timed call (conv state and state feed the next step); ms per
  step. Bytes: conv state and state read + written, qkv, z, a, b, out.
* ``gated_delta.decode_layer``: the whole Gated DeltaNet layer of the model
  (projections included) for one token with a cache, ``fn(layer, x,
  cache)``: "stock" = mlx-lm's ``GatedDeltaNet``, "patched" = the fast layer
  (on CUDA: one ``mx.compile``-traced kernel between the projections). Each
  timed call chains ``--layer-chain`` steps (default 30, the model's GDN
  layers per token) in one graph, as a decode step does; ms and rates are per
  step. Bytes: the layer's weights, conv state and recurrent state read and
  written, x and y; FLOPs 2 x weights + 6 Hv Dk Dv. Both decode chains also
  report ``ms_steady`` per step: (t_300 - t_100) / 200 over chains of 100
  and 300 steps (:data:`DECODE_STEADY`), which span several of MLX's CUDA
  graph commits, so the host encodes while the GPU runs, as in the model's
  decode; ``ms`` (one 30-step chain, one graph) adds the two.
* ``moe.prefill`` / ``moe.decode``: the sparse MoE block of layer 0 (the real
  router, experts and shared expert, quantised as the checkpoint),
  ``fn(block, x)``. FLOPs 2 T (k + 1) 3 D I + router 2 T D (E + 1); bytes =
  the weights of the experts touched (k per token, expected distinct ones
  for T tokens under uniform routing), shared expert, routers, x and y.
* ``attention.prefill`` / ``attention.decode``: the first full-attention
  layer, ``fn(module, x, mask, cache)``, mlx-lm's own (the package keeps
  attention stock: these rows give its share of a layer); prefill from an empty KV cache
  (causal), decode one token against a cache of ``--decode-context`` tokens.
  Bytes: weights, KV read and written, x, y; FLOPs: projections + 4 H hd per
  (query, key) pair.

``--defaults-only`` keeps, per op and shape, mlx-lm's code and the
implementation the patched model runs there (``default`` in the record).

Each point: warm-up, then ``--repeats`` timed calls (``mx.eval`` of the
outputs, ``mx.synchronize``), median ms; for ``gated_delta.prefill``,
``gated_delta.prefill_step`` and ``moe.prefill`` the ms is the steady-state
marginal latency of one call in chains of dependent calls (state or output
feeding the next call: what a layer costs inside the model's prefill graph),
(t_48 - t_16) / 32 (:data:`CHAIN_STEADY`: both chains span several of the CUDA
graphs MLX launches per evaluation, so host work overlaps GPU work as in the
model); ``ms_chain_short``, (t_4 - t_1) / 3, also holds one call's host cost
(all of a 4-call chain is one graph, launched after it is all encoded), and
``ms_single``, one call per evaluation, adds MLX's per-evaluation cost, ~0.1-0.3 ms on the H200; GB/s and TFLOP/s from the byte and
FLOP counts; ``roofline_frac`` = max(GB/s / copy_gbps, TFLOP/s / bf16_tflops),
the fraction of the nearer ceiling (``bw_frac`` and ``compute_frac`` apart).

    python -m bench.ops --preset qwen3.6-35b-a3b [--ops gated_delta,moe.decode]
        [--prefill-tokens 512,2k,4k] [--decode-context 4k,32k] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten

from . import ceilings as ceilings_mod
from . import common

FAMILIES = ("gated_delta", "moe", "attention")
OPS = tuple(f"{f}.{p}" for f in FAMILIES for p in ("prefill", "decode")) + (
    "gated_delta.prefill_step", "gated_delta.decode_step", "gated_delta.decode_layer")
# family key of the layer op (its implementations are the two layer classes)
_LAYER = "gated_delta_layer"
# family keys of the step ops (mlx-lm's functions vs the fused kernels)
_STEP = "gated_delta_step"
_PSTEP = "gated_delta_prefill_step"


# ---------------------------------------------------------------------------
# Implementations
# ---------------------------------------------------------------------------


#: Families without an ops module: mlx-lm's code is the only implementation.
_STOCK_ONLY = ("attention",)


def _ops_module(family: str):
    import importlib

    return importlib.import_module(f"mlx_qwen_fast.ops.{family}")


def dispatch_table(family: str) -> Dict[str, Callable]:
    """The ops module's table name -> function: its ``IMPLEMENTATIONS`` dict,
    or ``_TABLE`` where ``IMPLEMENTATIONS`` only lists the names."""
    module = _ops_module(family)
    for attr in ("IMPLEMENTATIONS", "_TABLE"):
        table = getattr(module, attr, None)
        if isinstance(table, dict):
            return dict(table)
    raise RuntimeError(f"mlx_qwen_fast.ops.{family} has no dispatch table "
                       "(IMPLEMENTATIONS or _TABLE dict)")


def _stock_baselines() -> Dict[str, Tuple[str, Callable]]:
    from mlx_lm.models.gated_delta import gated_delta_ops
    from mlx_lm.models.qwen3_next import Qwen3NextAttention, Qwen3NextSparseMoeBlock

    return {
        "gated_delta": ("stock-loop", gated_delta_ops),
        "moe": ("stock", Qwen3NextSparseMoeBlock.__call__),
        "attention": ("stock", lambda m, x, mask=None, cache=None:
                      Qwen3NextAttention.__call__(m, x, mask=mask, cache=cache)),
    }


def _runs_on(name: str, backend: str) -> bool:
    lowered = name.lower()
    for other in ("metal", "cuda"):
        if other in lowered and backend != other:
            return False
    return True


def _layer_implementations() -> Dict[str, Callable]:
    from mlx_lm.models.qwen3_5 import GatedDeltaNet

    from mlx_qwen_fast.layers import FastGatedDeltaNet, rebind

    fast = {}  # id(stock layer) -> its fast twin (same arrays), built once

    def patched(m, x, cache):
        twin = fast.get(id(m))
        if twin is None:
            twin = fast[id(m)] = (m, rebind(m, FastGatedDeltaNet))
        return twin[1](x, cache=cache)

    return {
        "stock": lambda m, x, cache: GatedDeltaNet.__call__(m, x, cache=cache),
        "patched": patched,
    }


def _stock_prefill_step(m, qkv, a, b, conv_state, state):
    """mlx-lm's prefill between the projections and the gated norm: its own
    modules and functions in the order ``qwen3_5.GatedDeltaNet.__call__``
    applies them (no mask). Returns (y, state, conv state)."""
    import mlx.nn as nn
    from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

    B, T, _ = qkv.shape
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    new_conv = mx.contiguous(conv_input[:, -(m.conv_kernel_size - 1):, :])
    conv_out = nn.silu(m.conv1d(conv_input))
    q, k, v = [t.reshape(B, T, h, d) for t, h, d in zip(
        mx.split(conv_out, [m.key_dim, 2 * m.key_dim], -1),
        [m.num_k_heads, m.num_k_heads, m.num_v_heads],
        [m.head_k_dim, m.head_k_dim, m.head_v_dim])]
    q, k = normalize_qk(q, k, inv_scale=m.head_k_dim**-0.5, eps=1e-6)
    y, state = gated_delta_update(q, k, v, a, b, m.A_log, m.dt_bias, state)
    return y, state, new_conv


def _stock_decode_step(m, qkv, z, a, b, conv_state, state):
    """mlx-lm's decode step between the projections: :func:`_stock_prefill_step`
    for T=1, then the layer's gated ``norm`` with z, as ``qwen3_5.GatedDeltaNet.__call__``."""
    B = qkv.shape[0]
    y, state, new_conv = _stock_prefill_step(m, qkv, a, b, conv_state, state)
    out = m.norm(y, z.reshape(B, 1, m.num_v_heads, m.head_v_dim))
    return out.reshape(B, 1, -1), new_conv, state


def _prefill_step_implementations(backend: str) -> Dict[str, Callable]:
    impls = {"stock": _stock_prefill_step}
    if backend == "cuda":
        from mlx_qwen_fast.kernels import gated_delta_frontend as k_fe
        from mlx_qwen_fast.kernels import gated_delta_scan as k_scan

        def two_kernels(m, qkv, a, b, conv_state, state):
            q, k, v, g, beta, cs = k_fe.gated_delta_frontend(
                qkv, a, b, m.conv1d.weight, conv_state, m.A_log, m.dt_bias,
                num_k_heads=m.num_k_heads, num_v_heads=m.num_v_heads)
            y, st = k_scan.gated_delta_scan(q, k, v, g, beta, state)
            return y, st, cs

        impls["cuda-kernel"] = two_kernels
    return impls


def _step_implementations(backend: str) -> Dict[str, Callable]:
    impls = {"stock": _stock_decode_step}
    if backend == "cuda":
        from mlx_qwen_fast.kernels import gated_delta_contract as k_contract
        from mlx_qwen_fast.kernels import gated_delta_decode as k_decode

        packed_inputs: Dict[tuple, tuple] = {}
        packed_steps: Dict[tuple, Callable] = {}

        def kernel(m, qkv, z, a, b, conv_state, state):
            # the layer's form: proj = [qkv | z | a | b] (in the model, one
            # projection's output) and decode_params' constants, each built
            # once per (layer, inputs) here, outside the steps' graph nodes
            key = (id(m), id(qkv), id(z), id(a), id(b))
            if key not in packed_inputs:
                B = qkv.shape[0]
                proj = mx.concatenate([t.reshape(B, 1, -1) for t in (qkv, z, a, b)], axis=-1)
                params = k_contract.decode_params(m.conv1d.weight, m.A_log, m.dt_bias, m.norm.weight)
                mx.eval(proj, params)
                packed_inputs.clear()
                packed_inputs[key] = (proj, params, (m, qkv, z, a, b))  # held: ids stay unique
            proj, params, _ = packed_inputs[key]
            step_key = (m.num_k_heads, m.num_v_heads, m.norm.eps)
            if step_key not in packed_steps:  # traced once, as in the layer's compiled step
                packed_steps[step_key] = mx.compile(
                    lambda p, prm, cs, st: k_decode.gated_delta_decode(
                        p, prm, cs, st, num_k_heads=step_key[0], num_v_heads=step_key[1],
                        norm_eps=step_key[2]))
            return packed_steps[step_key](proj, params, conv_state, state)

        impls["cuda-kernel"] = kernel
    return impls


def implementations(family: str, backend: Optional[str] = None) -> Dict[str, Callable]:
    """Implementations of ``family`` runnable on ``backend`` (default: the
    current one): mlx-lm's stock code first, then the ops module's table."""
    if family == _LAYER:
        return _layer_implementations()
    backend = backend or common.backend_name()
    if family == _STEP:
        return _step_implementations(backend)
    if family == _PSTEP:
        return _prefill_step_implementations(backend)
    name, fn = _stock_baselines()[family]
    table = {name: fn}
    if family not in _STOCK_ONLY:
        for k, v in dispatch_table(family).items():
            table.setdefault(k, v)
    return {k: v for k, v in table.items() if _runs_on(k, backend)}


def applies(family: str, impl: str, tokens: int) -> bool:
    """False for an implementation that would only hand the call to another
    one (the decode MoE kernels above their token limit run stock)."""
    if family == "moe" and impl == "cuda-decode":
        return tokens <= _ops_module("moe").DECODE_MAX_TOKENS
    return True


def default_implementation(family: str, tokens: int) -> Optional[str]:
    """The name the patched model uses for ``tokens`` tokens on this backend."""
    if family == _LAYER:
        return "patched"
    if family == _STEP:
        return "cuda-kernel" if common.backend_name() == "cuda" else "stock"
    if family == _PSTEP:
        return "cuda-kernel" if common.backend_name() == "cuda" else "stock"
    if family in _STOCK_ONLY:
        return "stock"
    try:
        return _ops_module(family).implementation_for(tokens)
    except Exception:
        return None


# ---------------------------------------------------------------------------
# Inputs, bytes, FLOPs of each op
# ---------------------------------------------------------------------------


def _nbytes(module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


@dataclasses.dataclass
class Case:
    """One op at one shape: ``call(fn)`` builds the graph; ``bytes``/``flops``
    per call."""

    op: str
    shape: Dict
    call: Callable[[Callable], Any]
    bytes: float
    flops: float
    steps: int = 1  # steps chained in one call; times and rates are per step
    #: ``chain(fn, m)``: m dependent calls in one graph (each reads what the
    #: previous one wrote). When set, ``ms`` is the steady-state marginal
    #: latency of one more call, (t_n2 - t_n1) / (n2 - n1) with (n1, n2) =
    #: CHAIN_STEADY, as a layer inside the model's prefill graph sees it (no
    #: per-evaluation cost, no overlap of independent calls, the host's graph
    #: building overlapped with the GPU's work); ``ms_chain_short`` keeps the
    #: short-chain figure (t_n - t_1) / (n - 1), n = CHAIN, in which the
    #: host's cost of one call adds to the GPU's; ``ms_single`` one call per
    #: evaluation.
    chain: Optional[Callable[[Callable, int], Any]] = None
    #: ``steps_chain(fn, m)``: m chained decode steps in one evaluation (the
    #: decode_step / decode_layer ops). When set, ``ms_steady`` is
    #: (t_m2 - t_m1) / (m2 - m1) per step, (m1, m2) = DECODE_STEADY: chains
    #: long enough for MLX to commit several CUDA graphs, so the GPU runs
    #: commit i while the host encodes commit i+1, as in the model's decode
    #: (a token is ~450 graph nodes, a commit every 100). ``ms`` stays the
    #: ``steps``-long chain in one graph, whose GPU work only starts once all
    #: of it is encoded (host and GPU time add up).
    steps_chain: Optional[Callable[[Callable, int], Any]] = None


#: Short chain: every call in one CUDA graph, which MLX launches only once the
#: whole evaluation is encoded, so a call's host cost (graph building and
#: encoding, ~40-60 us per kernel on the H200) adds to its GPU time.
CHAIN = 4
#: Steady-state chains: both long enough that MLX commits several CUDA graphs
#: per evaluation (on the H200 a graph is launched every 100 nodes or 1,000 MB
#: of inputs), so the host encodes commit i+1 while the GPU runs commit i, as
#: in the model's prefill (GPU-bound: 4K-prompt wall time ~ its GPU time); the
#: difference cancels the first commit's host time.
CHAIN_STEADY = (16, 48)
#: Steady-state decode chains (steps): 100 steps of a one-node kernel scope
#: already span a commit (MLX: 100 nodes per CUDA graph on the H200).
DECODE_STEADY = (100, 300)


def _layers(model):
    return model.language_model.model.layers


def gated_delta_case(model, T: int, dtype) -> Case:
    from mlx_lm.models.gated_delta import normalize_qk

    s = common.ModelShape.from_config(common.text_args(model))
    Hk, Hv, Dk, Dv = s.gdn_k_heads, s.gdn_v_heads, s.gdn_k_dim, s.gdn_v_dim
    key = mx.random.key(T)
    k1, k2, k3, k4, k5, k6 = mx.random.split(key, 6)
    q = mx.random.normal((1, T, Hk, Dk), key=k1).astype(dtype)
    k = mx.random.normal((1, T, Hk, Dk), key=k2).astype(dtype)
    q, k = normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
    v = mx.random.normal((1, T, Hv, Dv), key=k3).astype(dtype)
    g = mx.random.uniform(0.5, 1.0, (1, T, Hv), key=k4)
    beta = mx.sigmoid(mx.random.normal((1, T, Hv), key=k5)).astype(dtype)
    state = 0.1 * mx.random.normal((1, Hv, Dv, Dk), key=k6)
    mx.eval(q, k, v, g, beta, state)
    isz = q.dtype.size
    per_token = 2 * Hk * Dk * isz + 2 * Hv * Dv * isz + Hv * 4 + Hv * isz
    nbytes = T * per_token + 2 * Hv * Dv * Dk * 4
    phase = "decode" if T == 1 else "prefill"
    def chain(fn, m):  # the state feeds the next call
        st, y = state, None
        for _ in range(m):
            y, st = fn(q, k, v, g, beta, st, None)
        return y, st

    return Case(f"gated_delta.{phase}", {"T": T, "Hk": Hk, "Hv": Hv, "Dk": Dk, "Dv": Dv},
                lambda fn: fn(q, k, v, g, beta, state, None), nbytes, 6.0 * Hv * Dk * Dv * T,
                chain=chain if T > 1 else None)


def gated_delta_layer_case(model, dtype, chain: int) -> Case:
    """One token through the first GDN layer, ``chain`` times in one graph
    (each step reads the state the previous one wrote)."""
    from mlx_lm.models.cache import ArraysCache

    layer = next(layer.linear_attn for layer in _layers(model) if hasattr(layer, "linear_attn"))
    s = common.ModelShape.from_config(common.text_args(model))
    Hk, Hv, Dk, Dv = s.gdn_k_heads, s.gdn_v_heads, s.gdn_k_dim, s.gdn_v_dim
    conv_dim = 2 * Hk * Dk + Hv * Dv
    ks = mx.random.split(mx.random.key(1), 3)
    x = mx.random.normal((1, 1, s.hidden), key=ks[0]).astype(dtype)
    conv0 = mx.random.normal((1, layer.conv_kernel_size - 1, conv_dim), key=ks[1]).astype(dtype)
    state0 = 0.1 * mx.random.normal((1, Hv, Dv, Dk), key=ks[2])
    mx.eval(x, conv0, state0)

    def run(fn, m):
        cache = ArraysCache(size=2)
        cache[0], cache[1] = conv0, state0
        y = x
        for _ in range(m):
            y = fn(layer, x, cache)
        return y, cache[0], cache[1]

    weights = _nbytes(layer)
    nbytes = weights + 2 * (conv0.nbytes + state0.nbytes) + 2 * x.nbytes
    proj = s.hidden * (conv_dim + Hv * Dv + 2 * Hv) + Hv * Dv * s.hidden
    flops = 2.0 * proj + 6.0 * Hv * Dk * Dv
    return Case("gated_delta.decode_layer", {"T": 1, "chain": chain, "Hk": Hk, "Hv": Hv},
                lambda fn: run(fn, chain), nbytes, flops, steps=chain, steps_chain=run)


def gated_delta_prefill_step_case(model, T: int, dtype) -> Case:
    """The first GDN layer's prefill between its projections and the gated
    norm for T tokens, from a random conv state and state."""
    layer = next(layer.linear_attn for layer in _layers(model) if hasattr(layer, "linear_attn"))
    Hk, Hv, Dk, Dv = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    ks = mx.random.split(mx.random.key(3 + T), 5)
    qkv = mx.random.normal((1, T, layer.conv_dim), key=ks[0]).astype(dtype)
    a = mx.random.normal((1, T, Hv), key=ks[1]).astype(dtype)
    b = mx.random.normal((1, T, Hv), key=ks[2]).astype(dtype)
    conv0 = mx.random.normal((1, layer.conv_kernel_size - 1, layer.conv_dim), key=ks[3]).astype(dtype)
    state0 = 0.1 * mx.random.normal((1, Hv, Dv, Dk), key=ks[4])
    mx.eval(qkv, a, b, conv0, state0)

    def chain(fn, m):
        # the conv state and state feed the next call, and the next call's
        # conv state also waits for this call's y (a 3-element link), as the
        # next layer's input waits for this layer's output in the model: the
        # next front end cannot overlap this call's recurrence.
        cs, st, y = conv0, state0, None
        for _ in range(m):
            if y is not None:
                cs = cs + (y[:, -3:, 0, :1] * 0).astype(cs.dtype)
            y, st, cs = fn(layer, qkv, a, b, cs, st)
        return y, st, cs

    isz = qkv.dtype.size
    per_token = layer.conv_dim * isz * 3 + 2 * Hv * isz + 2 * Hv * 4 * 2 + Hv * Dv * isz
    nbytes = T * per_token + 2 * (state0.nbytes + conv0.nbytes)
    return Case("gated_delta.prefill_step", {"T": T, "Hk": Hk, "Hv": Hv, "Dk": Dk, "Dv": Dv},
                lambda fn: fn(layer, qkv, a, b, conv0, state0), nbytes, 6.0 * Hv * Dk * Dv * T,
                chain=chain)


def gated_delta_step_case(model, dtype, chain: int) -> Case:
    """The first GDN layer's decode step between its projections, ``chain``
    steps in one graph (conv state and state feed the next step)."""
    layer = next(layer.linear_attn for layer in _layers(model) if hasattr(layer, "linear_attn"))
    Hv, Dv = layer.num_v_heads, layer.head_v_dim
    ks = mx.random.split(mx.random.key(2), 6)
    qkv = mx.random.normal((1, 1, layer.conv_dim), key=ks[0]).astype(dtype)
    z = mx.random.normal((1, 1, Hv * Dv), key=ks[1]).astype(dtype)
    a = mx.random.normal((1, 1, Hv), key=ks[2]).astype(dtype)
    b = mx.random.normal((1, 1, Hv), key=ks[3]).astype(dtype)
    conv0 = mx.random.normal((1, layer.conv_kernel_size - 1, layer.conv_dim), key=ks[4]).astype(dtype)
    state0 = 0.1 * mx.random.normal((1, Hv, Dv, layer.head_k_dim), key=ks[5])
    mx.eval(qkv, z, a, b, conv0, state0)

    def run(fn, m):
        cs, st, out = conv0, state0, None
        for _ in range(m):
            out, cs, st = fn(layer, qkv, z, a, b, cs, st)
        return out, cs, st

    nbytes = 2 * (conv0.nbytes + state0.nbytes) + qkv.nbytes + 2 * z.nbytes + a.nbytes + b.nbytes
    flops = 6.0 * Hv * layer.head_k_dim * Dv
    return Case("gated_delta.decode_step", {"T": 1, "chain": chain, "Hk": layer.num_k_heads, "Hv": Hv},
                lambda fn: run(fn, chain), nbytes, flops, steps=chain, steps_chain=run)


def moe_case(model, T: int, dtype) -> Case:
    block = _layers(model)[0].mlp
    s = common.ModelShape.from_config(common.text_args(model))
    x = mx.random.normal((1, T, s.hidden), key=mx.random.key(T)).astype(dtype)
    mx.eval(x)
    E, k = s.experts, s.top_k
    touched = E * (1.0 - (1.0 - k / E) ** T)  # expected distinct experts
    nbytes = _nbytes(block.switch_mlp) * touched / E
    nbytes += _nbytes(block.shared_expert) + _nbytes(block.gate) + _nbytes(block.shared_expert_gate)
    nbytes += 2 * x.nbytes
    flops = 2.0 * T * (k * 3 * s.hidden * s.moe_inter + 3 * s.hidden * s.shared_inter)
    flops += 2.0 * T * s.hidden * (E + 1)
    phase = "decode" if T == 1 else "prefill"
    def chain(fn, m):  # the block's output is the next call's input
        y = x
        for _ in range(m):
            y = fn(block, y).astype(x.dtype)
        return y

    return Case(f"moe.{phase}", {"T": T, "D": s.hidden, "E": E, "k": k, "I": s.moe_inter},
                lambda fn: fn(block, x), nbytes, flops, chain=chain if T > 1 else None)


def attention_case(model, T: int, context: int, dtype) -> Case:
    from mlx_lm.models.cache import KVCache

    module = next(layer.self_attn for layer in _layers(model) if hasattr(layer, "self_attn"))
    s = common.ModelShape.from_config(common.text_args(model))
    H, Hkv, hd, D = s.heads, s.kv_heads, s.head_dim, s.hidden
    x = mx.random.normal((1, T, D), key=mx.random.key(T)).astype(dtype)
    isz = x.dtype.size
    kv_row = 2 * Hkv * hd * isz  # K and V of one token
    if T == 1:
        # decode: a cache holding `context` tokens, room for the new one; the
        # offset is reset before every call so each call does the same work
        cap = context + 256
        keys = mx.random.normal((1, Hkv, cap, hd), key=mx.random.key(1)).astype(dtype)
        values = mx.random.normal((1, Hkv, cap, hd), key=mx.random.key(2)).astype(dtype)
        mx.eval(x, keys, values)
        cache = KVCache()

        def call(fn):
            # the call writes row `context` in place (as a decode step does)
            cache.keys, cache.values, cache.offset = keys, values, context
            return fn(module, x, None, cache)

        attn_flops = 4.0 * H * hd * (context + 1)
        kv_bytes = (context + 1) * kv_row + kv_row
        op, shape = "attention.decode", {"T": 1, "context": context}
    else:
        mx.eval(x)

        def call(fn):
            return fn(module, x, "causal", KVCache())

        attn_flops = 4.0 * H * hd * T * (T + 1) / 2
        kv_bytes = 2 * T * kv_row  # written, then read
        op, shape = "attention.prefill", {"T": T, "context": 0}
    proj_params = D * (2 * H * hd + 2 * Hkv * hd) + H * hd * D
    flops = 2.0 * T * proj_params + attn_flops
    nbytes = _nbytes(module) + kv_bytes + 2 * x.nbytes
    shape.update({"H": H, "Hkv": Hkv, "hd": hd})
    return Case(op, shape, call, nbytes, flops)


def cases(model, ops: List[str], prefill_tokens: List[int], decode_contexts: List[int],
          dtype, layer_chain: int = 30) -> List[Tuple[str, Case]]:
    """(family, case) for every requested op and shape."""
    out = []
    for op in ops:
        family, phase = op.split(".")
        if phase == "decode_layer":
            out.append((_LAYER, gated_delta_layer_case(model, dtype, layer_chain)))
        elif phase == "decode_step":
            out.append((_STEP, gated_delta_step_case(model, dtype, layer_chain)))
        elif phase == "prefill_step":
            out += [(_PSTEP, gated_delta_prefill_step_case(model, T, dtype)) for T in prefill_tokens]
        elif family == "attention":
            if phase == "prefill":
                out += [(family, attention_case(model, T, 0, dtype)) for T in prefill_tokens]
            else:
                out += [(family, attention_case(model, 1, c, dtype)) for c in decode_contexts]
        else:
            make = gated_delta_case if family == "gated_delta" else moe_case
            tokens = prefill_tokens if phase == "prefill" else [1]
            out += [(family, make(model, T, dtype)) for T in tokens]
    return out


# ---------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------


def run_case(case: Case, impl: str, fn: Callable, *, repeats: int, warmup: int,
             budget_s: Optional[float], ceilings: Optional[Dict], backend: str,
             default: Optional[str], chain_steady: Tuple[int, int] = CHAIN_STEADY,
             decode_steady: Tuple[int, int] = DECODE_STEADY) -> Dict:
    rec: Dict[str, Any] = {"op": case.op, "backend": backend, "impl": impl,
                           "default": impl == default, "shape": case.shape,
                           "bytes": case.bytes, "flops": case.flops}
    try:
        times = common.measure(lambda: case.call(fn), warmup=warmup, repeats=repeats,
                               budget_s=budget_s)
        if case.chain is not None:
            def chained(m):
                return common.measure(lambda: case.chain(fn, m), warmup=warmup, repeats=repeats,
                                      budget_s=budget_s)

            t1 = common.stats(times)["median"]
            t_short = common.stats(chained(CHAIN))["median"]
            n1, n2 = chain_steady
            t_n1 = common.stats(chained(n1))["median"]
            rec["ms_single"] = t1 * 1e3
            rec["ms_chain_short"] = (t_short - t1) / (CHAIN - 1) * 1e3
            rec["chain"] = CHAIN
            rec["chain_steady"] = [n1, n2]
            times = [(t - t_n1) / (n2 - n1) for t in chained(n2)]
        if case.steps_chain is not None:
            m1, m2 = decode_steady
            t_m1, t_m2 = (common.stats(common.measure(lambda m=m: case.steps_chain(fn, m), warmup=warmup,
                                                      repeats=repeats, budget_s=budget_s))["median"]
                          for m in (m1, m2))
            rec["ms_steady"] = (t_m2 - t_m1) / (m2 - m1) * 1e3
            rec["decode_steady"] = [m1, m2]
    except Exception as exc:
        common.free_memory()
        rec.update(status="oom" if common.is_oom(exc) else "error", ms=None, ms_min=None,
                   ms_max=None, gbps=None, tflops=None, roofline_frac=None,
                   error=f"{type(exc).__name__}: {exc}"[:500])
        return rec
    s = common.stats([t / case.steps for t in times])
    t = s["median"]
    gbps = case.bytes / t / common.GB
    tflops = case.flops / t / 1e12
    bw = common.roofline_frac(gbps, (ceilings or {}).get("copy_gbps"))
    comp = common.roofline_frac(tflops, (ceilings or {}).get("bf16_tflops"))
    fracs = [f for f in (bw, comp) if f is not None]
    rec.update(status="ok", ms=t * 1e3, ms_min=s["min"] * 1e3, ms_max=s["max"] * 1e3,
               repeats=s["n"], gbps=gbps, tflops=tflops,
               roofline_frac=max(fracs) if fracs else None, bw_frac=bw, compute_frac=comp)
    return rec


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.ops", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_checkpoint_args(p)
    p.add_argument("--ops", default=",".join(FAMILIES),
                   help="comma list of families (gated_delta, moe, attention) or ops "
                        "(e.g. moe.decode); default all")
    p.add_argument("--impls", default=None,
                   help="comma list of implementation names to run (default: all available)")
    p.add_argument("--defaults-only", action="store_true",
                   help="per op and shape, only mlx-lm's code (the first implementation) and the one "
                        "the patched model uses there")
    p.add_argument("--prefill-tokens", type=common.lengths_arg, default=[512, 2048, 4096],
                   help="T of the prefill ops (default 512,2k,4k; T=1 is recorded as the decode op)")
    p.add_argument("--decode-context", type=common.lengths_arg, default=[4096, 32768],
                   help="KV context of attention.decode (default 4k,32k)")
    p.add_argument("--layer-chain", type=int, default=30,
                   help="decode steps chained per timed call of gated_delta.decode_step and decode_layer "
                        "(default 30: the model's GDN layers per token)")
    p.add_argument("--chain-steady", type=common.lengths_arg, default=list(CHAIN_STEADY),
                   help="the two chain lengths n1 < n2 of the chained prefill ops' steady-state "
                        "marginal latency (t_n2 - t_n1) / (n2 - n1) (default 16,48)")
    p.add_argument("--decode-steady", type=common.lengths_arg, default=list(DECODE_STEADY),
                   help="the two step counts m1 < m2 of decode_step's and decode_layer's steady-state "
                        "ms_steady, (t_m2 - t_m1) / (m2 - m1) per step (default 100,300)")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per point (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first")
    p.add_argument("--max-seconds", type=float, default=60.0,
                   help="stop repeating a point after this much timed time (default %(default)s)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes for CI: prefill T=16, decode context 32, 2 repeats, "
                        "1 warm-up, layer chain 2, steady chains 2,3 (decode too), small ceilings (these override the "
                        "corresponding flags)")
    p.add_argument("--no-ceilings", action="store_true", help="skip the ceilings (fractions null)")
    ceilings_mod.add_ceiling_args(p)
    p.add_argument("--out", default=None,
                   help="result JSON (default bench/results/<date>-<device>-ops.json)")
    p.add_argument("--append", action="store_true",
                   help="merge into an existing --out file (same op/impl/shape replaced)")
    return p


def _selected_ops(text: str) -> List[str]:
    out = []
    for part in (x.strip() for x in text.split(",") if x.strip()):
        if part in FAMILIES:
            out += [op for op in OPS if op.split(".")[0] == part]
        elif part in OPS:
            out.append(part)
        else:
            raise ValueError(f"--ops: unknown {part!r}; use one of {FAMILIES} or {OPS}")
    return list(dict.fromkeys(out))


def _family_of(op: str) -> str:
    """Key of ``implementations`` for an op name."""
    phase = op.split(".")[1]
    return {"decode_layer": _LAYER, "decode_step": _STEP, "prefill_step": _PSTEP}.get(
        phase, op.split(".")[0])


def op_key(rec: Dict):
    return rec["op"], rec["impl"], tuple(sorted(rec["shape"].items()))


def main(argv=None) -> Dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.layer_chain < 1:
        parser.error(f"--repeats and --layer-chain must be >= 1 and --warmup >= 0, got "
                     f"{args.repeats}, {args.layer_chain}, {args.warmup}")
    for name in ("chain_steady", "decode_steady"):
        v = getattr(args, name)
        if len(v) != 2 or not 1 <= v[0] < v[1]:
            parser.error(f"--{name.replace('_', '-')} must be two lengths 1 <= n1 < n2, got {v}")
    if args.smoke:
        args.prefill_tokens, args.decode_context = [16], [32]
        args.repeats, args.warmup, args.layer_chain = 2, 1, 2
        args.chain_steady = args.decode_steady = [2, 3]
        args.copy_mib, args.matmul_n = args.copy_mib or 8, args.matmul_n or 128
    # argument checks first: the ceilings and the checkpoint take minutes on the full preset
    try:
        selected = _selected_ops(args.ops)
    except ValueError as exc:
        parser.error(str(exc))
    backend = common.backend_name()
    wanted = set(x.strip() for x in args.impls.split(",") if x.strip()) if args.impls else None
    if wanted:
        known = {impl for fam in dict.fromkeys(map(_family_of, selected))
                 for impl in implementations(fam, backend)}
        unknown = sorted(wanted - known)
        if unknown:
            parser.error(f"--impls: {unknown} run for none of the selected ops here; "
                         f"available: {sorted(known)}")
    t0 = time.perf_counter()
    ceil = None if args.no_ceilings else ceilings_mod.from_args(args)
    model, config, _ = common.load_checkpoint(args)
    dtype = mx.bfloat16 if args.dtype == "bfloat16" or args.model else mx.float32

    out = Path(args.out) if args.out else common.default_out("ops")
    old = common.read_json(out) if args.append and out.exists() else None
    records = []
    for family, case in cases(model, selected, args.prefill_tokens,
                              args.decode_context, dtype, args.layer_chain):
        default = default_implementation(family, case.shape["T"])
        impls = implementations(family, backend)
        baseline = next(iter(impls))
        for impl, fn in impls.items():
            if wanted and impl not in wanted:
                continue
            if args.defaults_only and impl not in (baseline, default):
                continue
            if not applies(family, impl, case.shape["T"]):
                continue
            rec = run_case(case, impl, fn, repeats=args.repeats, warmup=args.warmup,
                           budget_s=args.max_seconds, ceilings=ceil, backend=backend,
                           default=default, chain_steady=tuple(args.chain_steady),
                           decode_steady=tuple(args.decode_steady))
            records.append(rec)
            shape = ",".join(f"{k}={v}" for k, v in case.shape.items() if k in ("T", "context"))
            if rec["status"] == "ok":
                print(f"{case.op:24} {shape:16} {impl:18} {rec['ms']:10.3f} ms "
                      f"{rec['gbps']:9.1f} GB/s {rec['tflops']:8.3f} TFLOP/s"
                      + (f"  roofline {rec['roofline_frac']:.3f}" if rec["roofline_frac"] else "")
                      + (f"  steady {rec['ms_steady']:.4f} ms" if "ms_steady" in rec else ""),
                      flush=True)
            else:
                print(f"{case.op:24} {shape:16} {impl:18} {rec['status']}: {rec.get('error')}",
                      flush=True)
            common.free_memory()
            result = write_result(out, args, ceil, records, old, t0)  # a killed run keeps its rows
    result = write_result(out, args, ceil, records, old, t0)
    print("wrote", out, flush=True)
    return result


def write_result(out: Path, args, ceil, records: List[Dict], old: Optional[Dict],
                 t0: float) -> Dict:
    """Write the ops JSON with the records so far (merged into ``old`` with
    ``--append``) and return it."""
    result = {
        **common.result_header("ops", args),
        **common.checkpoint_fields(args),
        "ceilings": ceil,
        "op_implementations": {op: default_implementation(
            _family_of(op), 1 if "decode" in op else 2048) for op in OPS},
        "ops": records,
        "wall_seconds": time.perf_counter() - t0,
    }
    if old is not None:
        result["ops"] = common.merge_records(old.get("ops", []), records, op_key)
        result["ceilings"] = ceil or old.get("ceilings")
    common.write_json(out, result)
    return result


if __name__ == "__main__":
    main()
