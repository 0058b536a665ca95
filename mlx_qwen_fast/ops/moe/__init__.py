"""Sparse mixture-of-experts block of Qwen3.5/3.6-MoE (``Qwen3NextSparseMoeBlock``).

Source: ``mlx_lm/models/qwen3_next.py`` (``Qwen3NextSparseMoeBlock.__call__``)
and ``mlx_lm/models/switch_layers.py`` (``SwitchGLU``, ``QuantizedSwitchLinear``),
mlx-lm 0.32.2. Shapes for Qwen3.6-35B-A3B: hidden D = 2048, E = 256 experts,
top-k = 8, expert SwiGLU D -> 512 -> D (affine 4-bit, group 64), router
D -> E and shared-expert gate D -> 1 (8-bit), one shared SwiGLU expert.

The block is split into the stages a grouped-GEMM kernel needs, each with a
contract (shapes, dtypes) and a reference in plain MLX ops:

1. :func:`route`: fp32 softmax over the router logits, top-k, renormalise.
2. :func:`group_by_expert`: histogram of the ``N*k`` assignments per expert,
   exclusive prefix scan to offsets, the stable permutation that groups
   assignments by expert, and its inverse (:class:`ExpertGroups`);
   :func:`block_map` lists the (expert, row tile) work items of a grouped GEMM
   in a fixed-size array.
3. :func:`expert_swiglu`: per-assignment expert outputs; :func:`combine`:
   weighted sum over the k experts of each token.
4. :func:`sparse_moe_block`: the whole block from those stages (reference);
   :func:`sparse_moe`: the dispatch entry the fast module calls,
   :func:`implementation_for`, the one place that decides which
   implementation runs for a call (backend, token count, switches), and
   :func:`decide_kernels`, which declines the kernels, once per block at
   patch time, for a block whose weights are not the one format they read
   (:data:`KERNEL_QUANTIZATION`; :func:`kernel_problems` says why).

Nothing here synchronises with the host or produces a shape that depends on
the data: every shape follows from ``N``, ``k``, ``E`` and the tile size, so
the graph can be recorded once (CUDA graphs, ``mx.compile``).

Implementations (:data:`IMPLEMENTATIONS`): "stock" (mlx-lm's block: the
reference adds sorting work that the stock ``SwitchGLU`` does not need, so
backends without a kernel keep stock), "reference", "cuda-prefill" (routing
kernels + grouped expert GEMMs, :mod:`mlx_qwen_fast.kernels.moe_routing`,
:mod:`~mlx_qwen_fast.kernels.moe_grouped_gemm`) and "cuda-decode" (router +
two fused GEMV kernels, the first routing the tokens itself, in one
``mx.compile``d step: three launches; a router of more than
:data:`~mlx_qwen_fast.kernels.moe_decode_gemv.ROUTE_MAX_EXPERTS` experts
keeps the routing kernel's launch between them,
:mod:`~mlx_qwen_fast.kernels.moe_decode_gemv`) and, on Metal with
:data:`mlx_qwen_fast.config.METAL_KERNELS` on, "metal-decode" (the router,
then three Metal kernels of the CUDA decode kernels' contract: routing,
gate+up SwiGLU, down + combine; :func:`_metal_decode`) and "metal-prefill"
(the router, then the Metal routing, grouping and grouped-GEMM kernels of
the CUDA prefill kernels' contract, the shared expert on MLX's ops;
:func:`_metal_prefill`). Each falls back to stock for a block its kernels
do not take (sharded, other quantisation, other dtypes).

Layout (that of :mod:`mlx_qwen_fast.ops.gated_delta`)
-----------------------------------------------------
* :mod:`.naive` -- the reference of record: the stages (:func:`route`,
  :func:`group_by_expert`, :func:`block_map`, :func:`expert_swiglu`,
  :func:`combine`, :func:`shared_expert`), the whole block from them
  (:func:`sparse_moe_block`) and mlx-lm's block (``_stock``);
* :mod:`.checks` -- the weight format the kernels read
  (:data:`KERNEL_QUANTIZATION`, :func:`quantization_problem`,
  :func:`kernel_problems`) and the decode kernels' arrays
  (:func:`decode_arrays`), shared by the CUDA and Metal paths;
* :mod:`.cuda` -- the block on the CUDA kernels (prefill; the compiled
  decode step, :func:`moe_decode`, :func:`router_with_shared_gate`,
  :func:`block_takes_weights`);
* :mod:`.metal` -- the block's decode and prefill on the Metal kernels
  (:func:`metal_decode_plan`, :func:`metal_prefill_plan`);
* this package -- the dispatch: :func:`sparse_moe`,
  :func:`implementation_for`, :func:`decide_kernels`,
  :func:`decode_step_parts`.

The dispatch looks its paths up in this package's namespace, so a name
replaced here (``implementation_for``, ...) takes effect in
:func:`sparse_moe` and :func:`decode_step_parts`; the submodules' own state
and helpers (the compiled decode steps ``cuda._decode_steps``, the prefill's
``cuda._shared_in_slot``) are read in the submodule that defines them.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Optional

import mlx.core as mx
import mlx.nn as nn

from ... import backend as _backend
from ... import config
from ...kernels import _cuda_build
from ...kernels import moe_contract as _moe_contract
from ...moe_types import ExpertGroups, max_tiles  # noqa: F401 (part of this package's API)
from .checks import KERNEL_QUANTIZATION, _DECLINED, kernel_problems, quantization_problem
from .cuda import _cuda_decode, _cuda_prefill, _decode_step_plan
from .metal import _metal_decode, _metal_prefill
from .naive import _check_block_input, _stock, sparse_moe_block
from .naive import block_map, combine, expert_swiglu, group_by_expert, route, shared_expert

# read from this package by the patch, the tests and the benchmarks
from .checks import decode_arrays  # noqa: F401
from .cuda import block_takes_weights, decode_plan, moe_decode, router_with_shared_gate  # noqa: F401
from .cuda import _compiled_decode_step  # noqa: F401
# read by the layer plans (ops/layer_plans.py: the one-launch decoder layer)
from .cuda import BlockSettings, block_step_settings  # noqa: F401
from .metal import metal_decode_plan, metal_prefill_plan  # noqa: F401

__all__ = [
    "ExpertGroups",
    "block_takes_weights",
    "route",
    "group_by_expert",
    "block_map",
    "expert_swiglu",
    "combine",
    "shared_expert",
    "sparse_moe_block",
    "sparse_moe",
    "implementation_for",
    "IMPLEMENTATIONS",
    "KERNEL_QUANTIZATION",
    "quantization_problem",
    "kernel_problems",
    "decide_kernels",
]


# ---------------------------------------------------------------------------
# dispatch
# ---------------------------------------------------------------------------


def decide_kernels(block) -> Dict[str, str]:
    """Decide, from ``block``'s modules, which kernel implementations
    :func:`sparse_moe` may pick for it, and keep that on the block.

    Called by :func:`mlx_qwen_fast.patching.patch` for every MoE block it
    makes fast (again on every patch). :func:`sparse_moe` then runs "stock"
    wherever :func:`implementation_for` would pick a declined kernel. A
    block never decided (built and called directly) keeps the per-call
    checks alone, which decline the same quantisations.

    Returns:
        :func:`kernel_problems` of ``block``.

    Raises:
        ValueError: ``block`` is not an ``mlx.nn.Module`` (the answer is
            kept on it).
    """
    if not isinstance(block, nn.Module):
        raise ValueError(f"decide_kernels: block must be a Qwen3NextSparseMoeBlock (an mlx.nn.Module), "
                         f"got {type(block).__name__}")
    problems = kernel_problems(block)
    object.__setattr__(block, _DECLINED, dict(problems))
    return problems


def decode_step_parts(block, x: mx.array, norm_eps: Optional[float] = None):
    """The compiled decode step of ``block``, for a caller that traces it
    inside its own compiled function
    (:func:`mlx_qwen_fast.ops.layer_plans.decode_layer`); None where
    :func:`sparse_moe` would not run it (not "cuda-decode" for this many
    tokens, declined for the block's quantisation, modules the kernels do
    not take).

    Args:
        block: a ``Qwen3NextSparseMoeBlock``.
        x: ``[..., D]`` (only its shape and dtype are read).
        norm_eps: None, or the eps of the decoder layer's RMSNorm before the
            block: then the step takes the un-normalised ``h`` and that
            norm's weight and returns ``h + block(rms_norm(h))`` (the norm
            fused into the router's GEMV, which also hands the normalised
            rows to the experts: :func:`mlx_qwen_fast.ops.linear.decode_linear`).

    Returns:
        ``(paths, fn)``: ``fn(x, *arrays) -> [..., D]`` (with ``norm_eps``:
        ``fn(h, norm_weight, *arrays)``), ``arrays`` the objects at
        ``paths`` under ``block``.
    """
    if implementation_for(math.prod(x.shape[:-1])) != "cuda-decode" \
            or "cuda-decode" in block.__dict__.get(_DECLINED, ()):
        return None
    paths, fn = _decode_step_plan(block, x, norm_eps)
    if fn is None:
        return None
    return tuple(paths), fn


#: name -> fn(block, x). :func:`implementation_for` picks one per call.
IMPLEMENTATIONS: Dict[str, Callable[..., mx.array]] = {
    "stock": _stock,
    "reference": sparse_moe_block,
    "cuda-prefill": _cuda_prefill,
    "cuda-decode": _cuda_decode,
    "metal-decode": _metal_decode,
    "metal-prefill": _metal_prefill,
}

#: Fewest tokens per call that take the prefill kernels on CUDA; fewer
#: tokens above :data:`DECODE_MAX_TOKENS` keep mlx-lm's block (the kernels'
#: and stock's times near the crossover: bench/results/INDEX.md, "ops").
PREFILL_MIN_TOKENS = 128

#: Most tokens per call that take the decode kernels on CUDA and on Metal
#: (the kernels' limit, :data:`mlx_qwen_fast.kernels.moe_contract.DECODE_MAX_TOKENS`).
DECODE_MAX_TOKENS = _moe_contract.DECODE_MAX_TOKENS


def implementation_for(num_tokens: int, backend: Optional[str] = None) -> str:
    """Name in :data:`IMPLEMENTATIONS` used for ``num_tokens`` on ``backend``.

    On CUDA (where MLX has a CUDA device): "cuda-prefill" for
    ``num_tokens >= PREFILL_MIN_TOKENS`` unless
    :data:`mlx_qwen_fast.config.MOE_PREFILL_KERNEL` is off; "cuda-decode"
    for 1 to :data:`DECODE_MAX_TOKENS` tokens unless
    :data:`~mlx_qwen_fast.config.MOE_DECODE_KERNEL` is off; "stock"
    otherwise. On Metal (where MLX has a Metal device), when
    :data:`~mlx_qwen_fast.config.METAL_KERNELS` is on: "metal-decode" for 1
    to :data:`DECODE_MAX_TOKENS` tokens, "metal-prefill" for more (no
    crossover: the Metal kernels have never been timed); "stock" with the
    switch off, and on the CPU.

    Args:
        num_tokens: tokens in the call (product of ``x``'s leading axes).
        backend: ``"cpu" | "cuda" | "metal"``; default
            :func:`mlx_qwen_fast.backend.current`.

    Raises:
        ValueError: unknown backend.
    """
    name = _backend.resolve(backend)
    if name == _backend.METAL:
        if num_tokens > 0 and config.METAL_KERNELS.get() and mx.metal.is_available():
            return "metal-decode" if num_tokens <= DECODE_MAX_TOKENS else "metal-prefill"
        return "stock"
    if name != _backend.CUDA or not _cuda_build.cuda_available():
        return "stock"
    if num_tokens >= PREFILL_MIN_TOKENS and config.MOE_PREFILL_KERNEL.get():
        return "cuda-prefill"
    if 0 < num_tokens <= DECODE_MAX_TOKENS and config.MOE_DECODE_KERNEL.get():
        return "cuda-decode"
    return "stock"


def sparse_moe(block, x: mx.array, *, implementation: Optional[str] = None) -> mx.array:
    """Dispatch entry for the sparse MoE block (what the fast module calls).

    Args:
        block: a ``Qwen3NextSparseMoeBlock``.
        x: ``[..., D]`` float.
        implementation: force a name from :data:`IMPLEMENTATIONS` (a CUDA
            one where MLX has no CUDA device, a Metal one where it has no
            Metal device, runs "stock"); default
            :func:`implementation_for` the token count and current backend,
            or "stock" where that is a kernel :func:`decide_kernels`
            declined for this block's quantisation.

    Returns:
        ``[..., D]``, as ``Qwen3NextSparseMoeBlock.__call__``.

    Raises:
        ValueError: bad ``x`` (see :func:`sparse_moe_block`) or unknown
            ``implementation``.
    """
    _check_block_input("sparse_moe", block, x)
    if implementation is not None and (not isinstance(implementation, str) or implementation not in IMPLEMENTATIONS):
        raise ValueError(f"sparse_moe: implementation must be one of {sorted(IMPLEMENTATIONS)}, "
                         f"got {implementation!r}")
    if x.size == 0:  # no tokens: nothing to route (MLX's quantised matmul does not take 0 rows)
        return mx.zeros(x.shape, x.dtype)
    if implementation is None:
        implementation = implementation_for(math.prod(x.shape[:-1]))
        if implementation in block.__dict__.get(_DECLINED, ()):  # decide_kernels, at patch time
            implementation = "stock"
    elif isinstance(implementation, str) and implementation.startswith("cuda-") and not _cuda_build.cuda_available():
        implementation = "stock"  # a CUDA implementation asked for where MLX has no CUDA device
    elif isinstance(implementation, str) and implementation.startswith("metal-") and not mx.metal.is_available():
        implementation = "stock"  # a Metal implementation asked for where MLX has no Metal device
    return IMPLEMENTATIONS[implementation](block, x)
