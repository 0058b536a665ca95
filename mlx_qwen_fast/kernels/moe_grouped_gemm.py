"""Grouped expert GEMMs with fused 4-bit dequantisation (prefill MoE) on CUDA.

Replaces the three ``mx.gather_qmm`` calls of mlx-lm's ``SwitchGLU`` for
prefill. Two kernels on the grouped (by-expert) order of the assignments,
work items from the block map of
:func:`mlx_qwen_fast.kernels.moe_routing.route_and_group`:

- :func:`gate_up_swiglu`: gathers each item's rows of ``x`` (token
  ``order[r] // k``), multiplies them by the gate and up weights,
  dequantised tile by tile on chip (fp32 accumulation), and writes
  ``bf16(silu(bf16(g)) * bf16(u))`` in grouped order (the roundings of
  ``SwitchGLU`` on bf16);
- :func:`down_weighted`: the down projection of those rows, rounded to bf16,
  times the assignment's routing weight, written back in *assignment* order
  (``[N*k, D]``), so the combine is ``y.reshape(N, k, D).sum(1)``: exact and
  deterministic (no atomics).

Weights: MLX affine quantisation, 4 bits, group 64: ``weight [E, O, K/8]``
uint32 (eight nibbles, lowest nibble = lowest input index), ``scales`` and
``biases [E, O, K/64]`` bf16; dequantised as ``bf16(scale * q + bias)`` (one
rounding, as MLX's CUDA ``mx.dequantize``). No bf16 copy of a weight is ever
written to global memory. The checks the Metal port shares (the weight
format, the routing's arrays and values):
:mod:`~mlx_qwen_fast.kernels.moe_contract`.

Two builds, "wgmma" (Hopper warpgroup MMA, compute capability 9.0) and
"mma" (``mma.sync``, other GPUs), one source file each: their choice, tile
rules, build macros and the "wgmma" build's K order of the activations are
in :mod:`~mlx_qwen_fast.kernels.moe_grouped_gemm_builds`. The public
functions take and return natural K order.

The shared expert of a Qwen3-Next MoE block can run as one more expert group
of the same two "wgmma" launches: the routing gives every token a (k+1)-th
slot for it (``routing.shared_id``) and :func:`moe_experts` takes its arrays
(``shared_expert``). Measured speed of both builds and of the shared slot:
bench/results/INDEX.md (kinds "moe_cuda", "ncu" of the MoE block).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import mlx.core as mx

from . import _cuda_build as cb
from ..moe_types import Routing
from .moe_contract import check_routing_arrays, check_routing_values, is_4bit_group64
from .moe_grouped_gemm_builds import (BK, BN, TILE_CHOICES, WG_KC, check_variant, down_feature_tiles,
                                      get_kernel, is_sm90, launch_kw, permute_k, unpermute_k,
                                      wgmma_shapes_ok)
from .moe_routing import shared_group_experts

__all__ = [
    "moe_experts_unchecked",
    "gate_up_swiglu",
    "down_weighted",
    "moe_experts",
    "supports",
    "supports_arrays",
    "shared_slot_supported",
]


def _q_arrays(proj) -> Tuple[mx.array, mx.array, mx.array]:
    return proj["weight"], proj["scales"], proj["biases"]


def _q_ok(w, s, b, E=None, O=None, K=None, one: bool = False) -> bool:
    """:func:`~.moe_contract.is_4bit_group64` of ``(w, s, b)`` at the sizes
    ``w`` holds, ``[E, O, K/8]`` (``one``: one expert's ``[O, K/8]``, as a
    ``QuantizedLinear`` holds them), those sizes the given ones where given,
    O and K multiples of the kernels' tiles (:data:`BN`, :data:`BK`)."""
    if getattr(w, "ndim", None) != (2 if one else 3):
        return False
    e, o, kw = (1, *w.shape) if one else w.shape
    return (
        is_4bit_group64((w, s, b), () if one else (e,), o, kw * 8)
        and (E is None or e == E) and (O is None or o == O) and (K is None or kw * 8 == K)
        and o % BN == 0 and (kw * 8) % BK == 0
    )


def supports_arrays(x: mx.array, gate: Sequence, up: Sequence, down: Sequence) -> bool:
    """Shape/dtype check without the backend check (pure, CPU-callable).

    ``x [N, D]`` bf16; ``gate``, ``up``: ``(weight [E, I, D/8] uint32,
    scales [E, I, D/64] bf16, biases)``; ``down``: ``(weight [E, D, I/8], ...)``;
    ``D`` and ``I`` multiples of 64.
    """
    try:
        if x.ndim != 2 or x.dtype != mx.bfloat16:
            return False
        d = x.shape[1]
        e, i = gate[0].shape[0], gate[0].shape[1]
        return (
            _q_ok(*gate, E=e, K=d) and _q_ok(*up, E=e, O=i, K=d)
            and _q_ok(*down, E=e, O=d, K=i) and d % BK == 0
        )
    except (AttributeError, IndexError, TypeError):
        return False


def supports(x: mx.array, gate_proj, up_proj, down_proj) -> bool:
    """True when the kernels can run ``SwitchGLU`` projections on ``x``.

    Needs MLX's CUDA backend, ``x [N, D]`` bf16, and three
    ``QuantizedSwitchLinear`` with mode "affine", 4 bits, group 64, bf16
    scales and biases, no bias term, and D, I multiples of 64. Never compiles.
    """
    if not cb.cuda_available():
        return False
    if not all(_affine4(p) for p in (gate_proj, up_proj, down_proj)):
        return False
    return supports_arrays(x, _q_arrays(gate_proj), _q_arrays(up_proj), _q_arrays(down_proj))


def _affine4(p) -> bool:
    """A quantised linear layer of mode "affine", 4 bits, group 64, no bias term."""
    return (
        getattr(p, "bits", None) == 4 and getattr(p, "group_size", None) == 64
        and getattr(p, "mode", "affine") in ("affine", None)
        and "biases" in p and "bias" not in p
    )


def shared_slot_supported(shared_expert, d: int, i_dim: int) -> bool:
    """True when :func:`moe_experts` can run ``shared_expert`` in the routing's
    shared slot next to routed experts of size ``i_dim`` on hidden size
    ``d``: its ``gate_proj``, ``up_proj`` (``d -> i_dim``) and ``down_proj``
    (``i_dim -> d``) are 4-bit group-64 affine ``QuantizedLinear`` with bf16
    scales and biases and no bias term (one kernel build serves both weight
    sets), and ``(d, i_dim)`` fit the "wgmma" kernels. Pure, CPU-callable."""
    try:
        projs = (shared_expert.gate_proj, shared_expert.up_proj, shared_expert.down_proj)
        if not all(_affine4(p) for p in projs):
            return False
        g, u, dn = (_q_arrays(p) for p in projs)
    except (AttributeError, KeyError, TypeError, ValueError, IndexError):
        return False
    return (wgmma_shapes_ok(d, i_dim) and _q_ok(*g, O=i_dim, K=d, one=True)
            and _q_ok(*u, O=i_dim, K=d, one=True) and _q_ok(*dn, O=d, K=i_dim, one=True))


def _check_wgmma(fn: str, d: int, i_dim: int, *sizes: int) -> None:
    if not wgmma_shapes_ok(d, i_dim):
        raise ValueError(
            f"{fn}: the wgmma build needs D % 256 == 0 and I % 128 == 0, got D={d}, I={i_dim}"
        )
    if max(sizes) >= 2**31:  # 32-bit element offsets in the kernel
        raise ValueError(f"{fn}: the wgmma build needs arrays of fewer than 2**31 elements, got {max(sizes)}")
    if not is_sm90():
        raise ValueError(f"{fn}: the wgmma build needs a GPU of compute capability 9.0")


def _dims(get) -> Tuple[Optional[int], Optional[int]]:
    """(D, I) from ``get()``, or (None, None) where the arguments are too
    malformed to tell (the shape checks that follow name the argument)."""
    try:
        d, i = get()
        return int(d), int(i)
    except (AttributeError, IndexError, KeyError, TypeError):
        return None, None


def _check_experts(fn: str, routing: Routing, e: int, shared, variant: str) -> None:
    """The routing's expert count against the weights' ``e`` (with the shared
    slot: :func:`~.moe_routing.shared_group_experts` ``(e)`` and
    ``shared_id == e``); the shared weights given exactly when the routing
    has the slot, and only to the "wgmma" kernels."""
    sid = routing.shared_id
    if (sid is None) != (shared is None):
        raise ValueError(
            f"{fn}: the shared expert's weights go with a routing that has its slot "
            f"(route_and_group(..., shared_logits=...)); routing.shared_id={sid}, "
            f"shared weights {'given' if shared is not None else 'missing'}"
        )
    want = e if sid is None else shared_group_experts(e)
    if routing.groups.counts.shape[0] != want or (sid is not None and sid != e):
        raise ValueError(f"{fn}: routing has {routing.groups.counts.shape[0]} experts (shared_id {sid}), "
                         f"weights have {e}")
    if shared is not None and variant != "wgmma":
        raise ValueError(f"{fn}: the shared expert's slot needs the wgmma build, got {variant!r}")


def gate_up_swiglu(
    x: mx.array, routing: Routing, gate: Sequence, up: Sequence, *, variant: Optional[str] = None,
) -> mx.array:
    """``silu(x W_gate^T) * (x W_up^T)`` per assignment, in grouped order.

    Args:
        x: ``[N, D]`` bfloat16 tokens (D a multiple of 64).
        routing: from :func:`moe_routing.route_and_group` on these N tokens
            (``tile_rows`` in :data:`TILE_CHOICES`; ``k`` from
            ``routing.groups.top_k``).
        gate, up: ``(weight [E, I, D/8] uint32, scales [E, I, D/64] bf16,
            biases [E, I, D/64] bf16)``, I a multiple of 64.
        variant: one of :data:`~.moe_grouped_gemm_builds.VARIANTS` (None:
            :func:`~.moe_grouped_gemm_builds.default_variant`).

    Returns:
        ``[N*k, I]`` bfloat16; row ``r`` belongs to assignment
        ``routing.groups.order[r]``.

    Raises:
        ValueError: bad shape/dtype of an argument (named in the message);
            a routing whose index arrays would send the kernel outside its
            arrays (:func:`~.moe_contract.check_routing_values`, one host synchronisation;
            :func:`_gate_up_swiglu` is the unchecked entry point for
            routings the routing kernels made).
    """
    return _gate_up_swiglu(x, routing, gate, up, variant=variant, check=True)


def _gate_up_swiglu(x: mx.array, routing: Routing, gate: Sequence, up: Sequence, *,
                    variant: Optional[str] = None, check: bool = False) -> mx.array:
    """:func:`gate_up_swiglu`, the routing's values checked only with ``check``."""
    v = check_variant("gate_up_swiglu", variant, *_dims(lambda: (x.shape[-1], gate[0].shape[1])))
    h = _gate_up(x, routing, gate, up, v, check=check)
    return unpermute_k(h) if v == "wgmma" else h


def _gate_up(x: mx.array, routing: Routing, gate: Sequence, up: Sequence, variant: str,
             x_kernel_order: bool = False, shared: Optional[Tuple[Sequence, Sequence]] = None,
             check: bool = False) -> mx.array:
    """:func:`gate_up_swiglu` with ``h`` as the kernel writes it (for "wgmma":
    columns in :func:`permute_k` order); ``x_kernel_order``: ``x`` is already
    ``permute_k(x)`` (one permutation serves the routed and the shared experts);
    ``shared``: the shared expert's (gate, up) arrays (``[I, D/8]``, ...: one
    expert), for a routing with the shared slot."""
    if x.ndim != 2 or x.dtype != mx.bfloat16 or x.shape[1] % BK:
        raise ValueError(f"gate_up_swiglu: x must be bfloat16 [N, D] with D % 64 == 0, got {x.dtype} {tuple(x.shape)}")
    n, d = x.shape
    if not _q_ok(*gate, K=d):
        raise ValueError(
            "gate_up_swiglu: gate must be (uint32 [E, I, D/8], bf16 [E, I, D/64], bf16 [E, I, D/64]) "
            f"with D={d} and I % 64 == 0, got {[(a.dtype, tuple(a.shape)) for a in gate]}"
        )
    e, i_dim = gate[0].shape[0], gate[0].shape[1]
    if not _q_ok(*up, E=e, O=i_dim, K=d):
        raise ValueError(
            f"gate_up_swiglu: up must match gate (uint32 [{e}, {i_dim}, {d // 8}], bf16 scales/biases), "
            f"got {[(a.dtype, tuple(a.shape)) for a in up]}"
        )
    k = routing.groups.top_k
    nk = n * k
    check_routing_arrays("gate_up_swiglu", routing, nk, TILE_CHOICES)
    if check:
        check_routing_values("gate_up_swiglu", routing, nk)
    _check_experts("gate_up_swiglu", routing, e, shared, variant)
    if shared is not None and not (_q_ok(*shared[0], O=i_dim, K=d, one=True)
                                   and _q_ok(*shared[1], O=i_dim, K=d, one=True)):
        raise ValueError(f"gate_up_swiglu: the shared expert's gate and up must be one expert's arrays "
                         f"(uint32 [{i_dim}, {d // 8}], bf16 scales/biases) as the routed experts'")
    if variant == "wgmma":
        _check_wgmma("gate_up_swiglu", d, i_dim, x.size, gate[0].size, up[0].size)
    if nk == 0:
        return mx.zeros((0, i_dim), mx.bfloat16)
    mt = routing.block_map.shape[0]
    kern, cfg = get_kernel("gate_up", routing.tile_rows, variant=variant, out_cols=i_dim, in_cols=d,
                           shared=shared is not None)
    if variant == "wgmma" and not x_kernel_order:
        x = permute_k(x)
    extra, es = ([*shared[0], *shared[1]], [e]) if shared is not None else ([], [])
    (h,) = kern(
        inputs=[x, *gate, *up, *extra, routing.groups.order, routing.groups.offsets, routing.block_map],
        output_shapes=[(nk, i_dim)],
        output_dtypes=[mx.bfloat16],
        scalars=[d, i_dim, k, *es],
        **launch_kw(cfg, mt, i_dim // cfg["bn"]),
    )
    return h


def down_weighted(
    h: mx.array, routing: Routing, down: Sequence, *, out_dtype: mx.Dtype = mx.float32,
    variant: Optional[str] = None,
) -> mx.array:
    """``scores[a] * (h[r] W_down^T)`` written to row ``a = order[r]``.

    Args:
        h: ``[N*k, I]`` bfloat16 in grouped order (:func:`gate_up_swiglu`).
        routing: the same routing.
        down: ``(weight [E, D, I/8] uint32, scales [E, D, I/64] bf16, biases)``.
        out_dtype: float32 (default) or bfloat16.
        variant: one of :data:`~.moe_grouped_gemm_builds.VARIANTS` (None:
            :func:`~.moe_grouped_gemm_builds.default_variant`).

    Returns:
        ``[N*k, D]`` in ``out_dtype``, assignment order (``a = n*k + j``);
        each expert output is rounded to bf16 before the routing weight is
        applied (as ``SwitchGLU`` on bf16 does).

    Raises:
        ValueError: bad shape/dtype of an argument (named in the message);
            a routing whose index arrays would send the kernel outside its
            arrays (:func:`~.moe_contract.check_routing_values`, one host synchronisation;
            :func:`_down_weighted` is the unchecked entry point).
    """
    return _down_weighted(h, routing, down, out_dtype=out_dtype, variant=variant, check=True)


def _down_weighted(h: mx.array, routing: Routing, down: Sequence, *, out_dtype: mx.Dtype = mx.float32,
                   variant: Optional[str] = None, check: bool = False) -> mx.array:
    """:func:`down_weighted`, the routing's values checked only with ``check``."""
    v = check_variant("down_weighted", variant, *_dims(lambda: (down[0].shape[1], h.shape[-1])))
    if v == "wgmma" and h.ndim == 2 and h.shape[-1] % WG_KC == 0:
        h = permute_k(h)
    return _down(h, routing, down, out_dtype, v, check=check)


def _down(h: mx.array, routing: Routing, down: Sequence, out_dtype: mx.Dtype, variant: str,
          down_ft: Optional[int] = None, shared: Optional[Sequence] = None, check: bool = False) -> mx.array:
    """:func:`down_weighted` on ``h`` as the gate+up kernel wrote it (for
    "wgmma": columns in :func:`permute_k` order); ``down_ft``: the "wgmma"
    feature tiles per CTA (None: :func:`down_feature_tiles` of the call); ``shared``: the
    shared expert's down arrays (``[D, I/8]``, ...: one expert), for a routing with the shared slot."""
    if h.ndim != 2 or h.dtype != mx.bfloat16 or h.shape[1] % BK:
        raise ValueError(f"down_weighted: h must be bfloat16 [N*k, I] with I % 64 == 0, got {h.dtype} {tuple(h.shape)}")
    nk, i_dim = h.shape
    if not _q_ok(*down, K=i_dim):
        raise ValueError(
            "down_weighted: down must be (uint32 [E, D, I/8], bf16 [E, D, I/64], bf16 [E, D, I/64]) "
            f"with I={i_dim} and D % 64 == 0, got {[(a.dtype, tuple(a.shape)) for a in down]}"
        )
    if out_dtype not in (mx.float32, mx.bfloat16):
        raise ValueError(f"down_weighted: out_dtype must be float32 or bfloat16, got {out_dtype}")
    check_routing_arrays("down_weighted", routing, nk, TILE_CHOICES)
    if check:
        check_routing_values("down_weighted", routing, nk)
    scores = routing.scores.reshape(-1)
    if scores.shape != (nk,) or scores.dtype != mx.float32:
        raise ValueError(f"down_weighted: routing.scores must be float32 with {nk} entries, got {scores.dtype} {tuple(routing.scores.shape)}")
    e, d = down[0].shape[0], down[0].shape[1]
    _check_experts("down_weighted", routing, e, shared, variant)
    if shared is not None and not _q_ok(*shared, O=d, K=i_dim, one=True):
        raise ValueError(f"down_weighted: the shared expert's down must be one expert's arrays "
                         f"(uint32 [{d}, {i_dim // 8}], bf16 scales/biases) as the routed experts'")
    if variant == "wgmma":
        _check_wgmma("down_weighted", d, i_dim, h.size, down[0].size)
    if nk == 0:
        return mx.zeros((0, d), out_dtype)
    mt = routing.block_map.shape[0]
    groups = e + (shared is not None)  # experts with rows: the shared one is one more
    kern, cfg = get_kernel("down", routing.tile_rows, "float" if out_dtype == mx.float32 else "bf16_t",
                           variant=variant, out_cols=d, in_cols=i_dim,
                           down_ft=(down_ft or down_feature_tiles(nk, groups)) if variant == "wgmma" else 1,
                           shared=shared is not None)
    extra, es = (list(shared), [e]) if shared is not None else ([], [])
    (y,) = kern(
        inputs=[h, *down, *extra, routing.groups.order, routing.groups.offsets, routing.block_map, scores],
        output_shapes=[(nk, d)],
        output_dtypes=[out_dtype],
        scalars=[i_dim, d, routing.groups.top_k, *es],
        **launch_kw(cfg, mt, d // cfg["bn"]),
    )
    return y


def moe_experts(
    x: mx.array, routing: Routing, gate_proj, up_proj, down_proj,
    *, shared_expert=None, out_dtype: Optional[mx.Dtype] = None, variant: Optional[str] = None,
) -> mx.array:
    """Routed-expert part of the sparse MoE block: ``[N, D]``.

    ``sum_j scores[n, j] * expert_{inds[n, j]}(x[n])`` from the three
    ``QuantizedSwitchLinear`` of a ``SwitchGLU`` (see :func:`supports`),
    combined in fp32 and returned in ``out_dtype`` (default ``x.dtype``).
    ``variant``: one of :data:`~.moe_grouped_gemm_builds.VARIANTS` for both
    kernels (None: :func:`~.moe_grouped_gemm_builds.default_variant`). The
    routing's index arrays are validated first (:func:`~.moe_contract.check_routing_values`;
    one host synchronisation): :func:`moe_experts_unchecked` is the unchecked entry
    point the package's MoE block uses, its routing coming from the routing
    kernels.

    With a routing that has the shared slot (``routing.shared_id``, from
    ``route_and_group(..., shared_logits=...)`` or ``shared_column=True``), ``shared_expert`` (an
    mlx-lm MLP of three 4-bit group-64 ``QuantizedLinear``, the routed
    experts' sizes: :func:`shared_slot_supported`) runs as one more expert
    group of the same two "wgmma" launches, its sigmoid gate as the slot's
    weight: the block's experts + gated shared expert, each expert output
    rounded to bf16 and all summed in fp32.

    Raises:
        ValueError: as :func:`gate_up_swiglu` / :func:`down_weighted`; a
            shared slot without ``shared_expert`` or the reverse, a shared
            expert of other sizes, a variant other than "wgmma" with it.
    """
    return moe_experts_unchecked(x, routing, gate_proj, up_proj, down_proj, shared_expert=shared_expert,
                        out_dtype=out_dtype, variant=variant, check=True)


def moe_experts_unchecked(x: mx.array, routing: Routing, gate_proj, up_proj, down_proj, *, shared_expert=None,
                 out_dtype: Optional[mx.Dtype] = None, variant: Optional[str] = None,
                 check: bool = False) -> mx.array:
    """:func:`moe_experts`, the routing's values checked only with ``check``."""
    v = check_variant("moe_experts", variant, *_dims(lambda: (x.shape[-1], gate_proj["weight"].shape[1])))
    n, d = x.shape
    sgu = sd = None
    if shared_expert is not None:
        i_dim = gate_proj["weight"].shape[1]
        if not shared_slot_supported(shared_expert, d, i_dim):
            raise ValueError(
                "moe_experts: shared_expert must have gate_proj, up_proj (D -> I) and down_proj (I -> D) "
                f"as 4-bit group-64 affine QuantizedLinear with bf16 scales/biases, D={d}, I={i_dim} "
                "(the routed experts' sizes)"
            )
        sgu = (_q_arrays(shared_expert.gate_proj), _q_arrays(shared_expert.up_proj))
        sd = _q_arrays(shared_expert.down_proj)  # 2-D: the kernels read expert 0's rows
    h = _gate_up(x, routing, _q_arrays(gate_proj), _q_arrays(up_proj), v, shared=sgu, check=check)
    y = _down(h, routing, _q_arrays(down_proj), mx.float32, v, shared=sd)
    k = routing.groups.top_k
    return y.reshape(n, k, d).sum(axis=1).astype(out_dtype or x.dtype)
