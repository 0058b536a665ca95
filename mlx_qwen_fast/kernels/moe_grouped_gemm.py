"""Grouped expert GEMM with fused 4-bit dequantisation (prefill MoE) on CUDA.

Replaces the three ``mx.gather_qmm`` calls of mlx-lm's ``SwitchGLU`` for the
prefill shapes. Two kernels on the grouped (by-expert) order of the
assignments, work items from the block map of
:func:`mlx_qwen_fast.kernels.moe_routing.group` (or ``ops.moe.block_map``):

- :func:`gate_up_swiglu`: gathers each item's rows of ``x`` (token
  ``order[r] // k``), dequantises the gate and up weight tiles into shared
  memory, runs both GEMMs on tensor cores (``mma.sync`` m16n8k16 bf16, fp32
  accumulation) and writes ``silu(gate) * up`` (each rounded to bf16 first,
  as ``SwitchGLU`` on bf16 does) in grouped order.
- :func:`down_weighted`: the down projection of those rows times the
  assignment's routing weight, written back in *assignment* order
  (``[N*k, D]``), so the combine is ``y.reshape(N, k, D).sum(1)``: exact and
  deterministic (no atomics).

Weights: MLX affine quantisation, 4 bits, group 64: ``weight [E, O, K/8]``
uint32 (eight nibbles, lowest nibble = lowest input index), ``scales`` and
``biases [E, O, K/64]`` bf16. The baseline variant computes
``w = bf16(bf16(scale * q) + bias)`` as the CPU ``mx.dequantize`` does; the
other variants ``w = bf16(scale * q + bias)`` (one rounding, as MLX's CUDA
``mx.dequantize``): see :func:`unpack_affine_4bit`, the host reference of the
kernels' unpacking, and :data:`VARIANT_ROUNDING`. No bf16 copy of a weight is
ever written to global memory.

Variants (keyword ``variant``, default :data:`DEFAULT_VARIANT`; build macros
of the source in parentheses):

- ``"base"``: the first kernel: scalar fp32 dequantisation, 4 warps, tile
  BM x 64, load -> sync -> mma -> sync (MOE_DEQ=0, MOE_PF=0).
- ``"deq"``: packed bf16x2 dequantisation, magic-number nibble unpacking, one
  fma per two weights (MOE_DEQ=1).
- ``"pf"``: ``deq`` plus a register prefetch of the next K step's global words
  during the current step's mma (MOE_PF=1).
- ``"pfl"``: ``pf`` plus ldmatrix.x4 fragment loads (MOE_LDM=1).
- ``"pflv"``: ``pfl`` with 16-byte weight fetches (a thread takes half a
  weight row of a K step, 4 packed words, and the row's scale and bias once,
  instead of 4 single words of 4 rows and 4 scale/bias pairs that 8 threads
  each load again) and 8-byte fp32 stores in down (MOE_WV=1; BM 32/64 only,
  BM 128 builds as ``pfl``); gate+up at BM 64 capped at 128 registers
  (MOE_MINB=4: 4 CTAs per SM, no spills with nvcc 13.0).
- ``"big"``: ``pfl`` with 8 warps and 128-column tiles (MOE_BN=128,
  MOE_WM x MOE_WN = 2 x 4) where the output width allows and the 48 KB of
  static shared memory holds them (gate+up at BM 32/64, down at every BM).
- ``"wg"`` (own source, ``moe_grouped_gemm_wgmma.cu``): Hopper warpgroup
  MMA (``wgmma``, sm_90a) on the transposed problem: the 4-bit weights are
  the A operand, dequantised by each thread straight into its own A
  fragment registers (a shift, lop3, sub and fma per two weights), the
  activation rows the B operand, copied with ``cp.async`` into a ring of
  128-byte-swizzled shared-memory slots (:data:`WG_TUNE` ``["stages"]``);
  256 threads = two warpgroups per CTA, 128 (gate+up) or 256 (down) output
  features per CTA. Needs K a multiple of 128 and the activations in the
  kernel's K order within each 128 inputs (:func:`permute_k`): the wrappers
  permute ``x`` once and the gate+up kernel writes ``h`` in that order for the
  down kernel (the public functions take and return natural order). One
  rounding, as ``deq``. Only on GPUs with compute capability 9.0.
- ``"async"`` (own source, ``moe_grouped_gemm_async.cu``): a :data:`ASYNC_TUNE` ``["stages"]``-deep ring of
  ``cp.async`` copies (raw x/h rows, raw 4-bit words, scale/bias chunks) in
  dynamic shared memory, one ``__syncthreads`` per K step, each warp
  dequantising its own packed words from shared memory straight into mma B
  fragments (K permuted inside each step so that every A and B register is a
  natural input pair of one word: no ldmatrix, no shuffles); 8 warps along
  the columns (16 at BM 128), 128-column tiles for gate+up and down where the
  width allows (:data:`ASYNC_TUNE`). One rounding, as ``deq``.

Every variant takes tile rows 32, 64 or 128 (``routing.tile_rows``); BM=128
runs 8 warps (4 x 2) in the mma.sync variants.

Source: ``mlx_qwen_fast/cuda/moe_grouped_gemm.cu`` (``async``:
``moe_grouped_gemm_async.cu``, ``wg``: ``moe_grouped_gemm_wgmma.cu``).
Status (bench/results/moe-cuda-log.md): every variant checked and timed on
the H200. ``wg`` is the default where it runs (:func:`default_variant`;
elsewhere ``pflv``): experts + combine at T=4096 1.11-1.16 ms as the steady
latency of one call in a chain of dependent calls (178-186 TFLOP/s) against
1.35-1.38 ms for ``pflv`` in the same runs (2026-12-02, sixth session); the
two ``wg`` GEMMs alone, GPU time of one block call under ncu with the
preset's skewed router, 0.830 ms = 248 TFLOP/s useful (ninth session:
wgmma scale-d starts in down, one lop3 per dequantised register);
``async`` is slower than ``pfl`` for gate+up and faster for down, not used
by default.

The shared expert of a sparse MoE block runs through the same "wg"
kernels (:func:`shared_form`): by default in a (k+1)-th routing slot of
every token (``moe_routing.route_and_group(..., shared_logits=...)`` or its
``shared_column``), one more expert group of the same two launches whose
work items read the shared expert's arrays as a second pointer set
(:func:`moe_experts` with ``shared_expert``); or as a one-expert group of
launches of its own on the same permuted ``x`` (:func:`moe_experts_and_shared`,
:func:`single_expert_routing`). ncu GPU time of one MoE block call on the
H200 (bench/results/moe-cuda-log.md, thirteenth session), slot / own group /
MLX's dense quantised matmuls beside the kernels: T=4096 1,153.6 / 1,244.2 /
1,354.1 us, T=128 236.3 / 307.5 / 373.7 us.
"""

from __future__ import annotations

import functools
from typing import Dict, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from . import _cuda_build as cb
from ..ops.moe import ExpertGroups
from .moe_routing import Routing, shared_group_experts, shared_slot_fits

__all__ = [
    "gate_up_swiglu",
    "down_weighted",
    "moe_experts",
    "supports",
    "supports_arrays",
    "unpack_affine_4bit",
    "bf16_round",
    "choose_tile_rows",
    "TILE_CHOICES",
    "VARIANTS",
    "DEFAULT_VARIANT",
    "FALLBACK_VARIANT",
    "default_variant",
    "VARIANT_ROUNDING",
    "variant_config",
    "ASYNC_TUNE",
    "WG_TUNE",
    "permute_k",
    "unpermute_k",
    "moe_experts_and_shared",
    "shared_in_gemm",
    "shared_form",
    "shared_expert_supported",
    "shared_slot_supported",
    "single_expert_routing",
    "single_expert_tile_rows",
    "SHARED_GEMM_ENV",
    "SHARED_GEMM_MIN_TOKENS",
    "SHARED_SLOT_MIN_TOKENS",
    "wg_shapes_ok",
    "wg_down_ft",
]

BK = 64  # K step = quantisation group
BN = 64  # output columns per CTA
NT = 128  # threads per CTA of the baseline variant
TILE_CHOICES = (32, 64, 128)
VARIANTS = ("base", "deq", "pf", "pfl", "pflv", "big", "async", "wg")
#: The variant the public functions use when ``variant`` is None (see
#: :func:`default_variant`): "wg". H200, experts + combine as the steady
#: latency of one call in a chain of dependent calls, same runs
#: (bench/results/moe-cuda-log.md, 2026-12-02, sixth session): T=4096 wg 1.108
#: ms against pflv 1.346 ms; T=2048 0.661 vs 0.864; T=512 0.340 vs 0.49.
#: Before it, "pflv" (1.40-1.44 ms against pfl's 1.55-1.61 ms, third session).
DEFAULT_VARIANT = "wg"
#: The variant used instead of :data:`DEFAULT_VARIANT` where that one cannot
#: run (:func:`default_variant`): "wg" needs compute capability 9.0 and the
#: shapes of :func:`wg_shapes_ok`.
FALLBACK_VARIANT = "pflv"
#: Dequantisation rounding of each variant (``rounding`` of unpack_affine_4bit).
VARIANT_ROUNDING = {"base": "twice", "deq": "once", "pf": "once", "pfl": "once", "pflv": "once", "big": "once",
                    "async": "once", "wg": "once"}
#: Tuning of the "async" variant (timed on the H200, 2026-12-01: none of the
#: swept settings beats "pfl" for the whole block; moe-cuda-log.md):
#: cp.async ring depth, and the widest column tile per matrix for gate+up and
#: down at BM <= 64 (narrowed to the largest of 256/128/64 dividing the
#: output width; BM 128 uses 64 / 128 so that 512 threads fit 128 registers).
#: nvcc 13.0 sm_90a, 0 spills: gate+up BM 64 x 128: 150 registers (1 CTA/SM),
#: BM 64 x 64: 100; down BM 64 x 128: 101, x 256: 146 (bench/results/moe-cuda-log.md).
#: "cols_fast": launch the column tiles of one work item next to each other
#: (grid x = column tile) instead of all items of one column tile.
ASYNC_TUNE = {"stages": 4, "gate_up_bn": 128, "down_bn": 128, "down_bn_bm32": 256, "cols_fast": False}
#: Tuning of the "wg" variant: cp.async ring depth (K chunks of 128 inputs
#: in flight: stages - 2 ahead of the one being multiplied); "rows64_from" /
#: "rows128_from": rows per expert on average from which work items take 64 /
#: 128 rows (None: never; below: 32); "minb": a register cap for that many
#: CTAs per SM (None: none; 2 measured slower at T=4096, 2026-12-02: gate+up
#: 597 vs 548 us, down 347 vs 335, with spills); "down_ft": feature tiles of 256 per down CTA
#: with the item's h resident in shared memory (used at tile rows 32/64 where
#: I <= 128 * stages and D % (256 * down_ft) == 0; tile 128 builds take one:
#: with several, 2 of 2 test cases gave wrong rows, not understood), or
#: "auto": 8 from 64 rows per expert on average, else 1.
#: Measured on the H200 (bench/results/moe-cuda-log.md, 2026-12-02, sixth
#: session), experts + combine, steady chained latency, ms: T=512 tile 32
#: 0.340 (down_ft 8: 0.361); T=2048 tile 32 down_ft 8 0.661, tile 64 0.793,
#: tile 64 down_ft 4 0.761; T=4096 tile 64 down_ft 8 1.108, tile 64 1.205,
#: tile 128 1.146, tile 32 down_ft 8 1.143.
WG_TUNE = {"stages": 4, "rows64_from": 128, "rows128_from": None, "minb": None, "down_ft": "auto"}
#: Output features per CTA of the "wg" kernels: gate+up (two warpgroups x 64
#: features of both matrices), down (two warpgroups x two 64-row tiles).
WG_FEAT = {0: 128, 1: 256}
WG_KC = 128  # inputs per K chunk of the "wg" kernels (the K-order period)
_kernels: Dict[tuple, cb.CudaKernel] = {}


# ---------------------------------------------------------------------------
# host-side helpers (CPU-testable)
# ---------------------------------------------------------------------------


def unpack_affine_4bit(w, scales, biases, group_size: int = 64, rounding: str = "twice") -> np.ndarray:
    """Host reference of the kernels' dequantisation, as numpy float32.

    Args:
        w: ``[..., O, K/8]`` uint32 (numpy or MLX) packed weights.
        scales, biases: ``[..., O, K/group_size]`` bf16 (numpy float32 or MLX).
        group_size: inputs per scale/bias.
        rounding: ``"twice"``: ``bf16(bf16(scale * q) + bias)``, the baseline
            kernel (MOE_DEQ=0) and MLX's CPU ``mx.dequantize`` (bit-exact with
            it, tests/test_cuda_moe.py); ``"once"``: ``bf16(scale * q + bias)``
            rounded once from the exact value, the packed kernels (MOE_DEQ=1:
            ``q`` made exact in bf16, then one ``fma.rn.bf16x2``) and MLX's
            CUDA ``mx.dequantize``. :data:`VARIANT_ROUNDING` maps variants.

    Returns:
        ``[..., O, K]`` float32 holding bf16 values, ``q = (w >> 4*j) & 15``
        for input ``8*word + j`` (low nibble first). (MOE_DEQ=1 keeps K in
        the order 0,4,1,5,2,6,3,7 within each 8 inputs in shared memory, for
        weights and activations alike; the values and dot products are these.)

    Raises:
        ValueError: unknown ``rounding``.
    """
    if rounding not in ("twice", "once"):
        raise ValueError(f"unpack_affine_4bit: rounding must be 'twice' or 'once', got {rounding!r}")
    w = np.asarray(w).astype(np.uint32)
    s, b = _np32(scales), _np32(biases)
    shifts = 4 * np.arange(8, dtype=np.uint32)
    q = (w[..., None] >> shifts) & np.uint32(15)  # [..., O, K/8, 8]
    q = q.reshape(*w.shape[:-1], w.shape[-1] * 8).astype(np.float32)
    s = np.repeat(s, group_size, axis=-1)
    b = np.repeat(b, group_size, axis=-1)
    if rounding == "twice":
        return bf16_round(bf16_round(s * q) + b)
    # s * q is exact in fp32 (8 x 4 significant bits); the sum is exact in
    # float64 (aligned spans far below 53 bits); one rounding to bf16.
    return _bf16_round_f64(s.astype(np.float64) * q + b)


def bf16_round(a) -> np.ndarray:
    """Round float32 to the nearest bf16 (ties to even), kept as float32."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    u = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return u.view(np.float32)


def _bf16_round_f64(a: np.ndarray) -> np.ndarray:
    """Round float64 to the nearest bf16 (ties to even) in one step, as float32.

    For values in bf16's normal range (bf16 subnormals are not modelled)."""
    u = np.ascontiguousarray(a, dtype=np.float64).view(np.uint64)
    drop = np.uint64(45)  # 52 - 7 mantissa bits
    half = np.uint64((1 << 44) - 1)
    u = (u + half + ((u >> drop) & np.uint64(1))) & ~np.uint64((1 << 45) - 1)
    return u.view(np.float64).astype(np.float32)  # exact: 8 significant bits


def _k_chunks(fn: str, a: mx.array, dims: Tuple[int, ...], order: Tuple[int, ...]) -> mx.array:
    """``a [..., K]`` with each chunk of 128 inputs viewed as ``dims`` and its
    axes put in ``order``."""
    if a.ndim < 1 or a.shape[-1] % WG_KC:
        raise ValueError(f"{fn}: the last axis must be a multiple of {WG_KC}, got shape {tuple(a.shape)}")
    lead, k = a.shape[:-1], a.shape[-1]
    nl = len(lead) + 1
    t = a.reshape(*lead, k // WG_KC, *dims)
    return t.transpose(*range(nl), *(nl + i for i in order)).reshape(*lead, k)


def permute_k(a: mx.array) -> mx.array:
    """The "wg" kernels' activation K order: ``[..., K]`` -> ``[..., K]``.

    Within each chunk of 128 inputs, position ``P = 32w + 16u + 8hs + 2q + j``
    holds natural input ``k = 32q + 8w + 4j + 2u + hs`` (q, w in 0..3; j, u, hs
    in 0..1): k16 step ``s = 2w + u`` of thread ``q`` of a quad reads nibbles
    ``2u + hs`` and ``2u + hs + 4`` of its packed word ``w``
    (``cuda/moe_grouped_gemm_wgmma.cu``). A pure permutation (exact, any
    dtype); :func:`unpermute_k` is its inverse.

    Raises:
        ValueError: ``a`` has no last axis or it is not a multiple of 128.
    """
    # natural (q, w, j, u, hs) -> kernel (w, u, hs, q, j)
    return _k_chunks("permute_k", a, (4, 4, 2, 2, 2), (1, 3, 4, 0, 2))


def unpermute_k(a: mx.array) -> mx.array:
    """Inverse of :func:`permute_k` (kernel K order -> natural order).

    Raises:
        ValueError: as :func:`permute_k`.
    """
    # kernel (w, u, hs, q, j) -> natural (q, w, j, u, hs)
    return _k_chunks("unpermute_k", a, (4, 2, 2, 4, 2), (3, 0, 4, 1, 2))


def wg_down_ft(num_assignments: int, num_experts: int) -> int:
    """Feature tiles per down CTA of the "wg" variant for a call:
    ``WG_TUNE["down_ft"]`` when it is an int, else ("auto") 8 once experts
    average 64 rows or more (few CTAs otherwise: T=512 measured slower with
    8), else 1."""
    ft = WG_TUNE.get("down_ft", "auto")
    if isinstance(ft, int):
        return ft
    return 8 if num_assignments >= 64 * num_experts else 1


def wg_shapes_ok(d: int, i: int) -> bool:
    """True when the "wg" kernels take hidden size ``d`` and expert size ``i``:
    ``i`` a multiple of 128 (gate+up features per CTA; also the K chunk of
    down) and ``d`` of 256 (down features per CTA; a whole number of K chunks
    of gate+up)."""
    return i % WG_FEAT[0] == 0 and d % WG_FEAT[1] == 0


def _np32(a) -> np.ndarray:
    if isinstance(a, mx.array):
        return np.asarray(a.astype(mx.float32))
    return np.asarray(a, dtype=np.float32)


def choose_tile_rows(num_assignments: int, num_experts: int, variant: Optional[str] = None) -> int:
    """Rows per work item (one of :data:`TILE_CHOICES`) for ``variant``.

    32 when experts average fewer than 64 rows, else 64; the "big" variant
    takes 128 once experts average 128 rows or more. ``num_assignments = N*k``.
    Measured on the H200 (E=256, D=2048, I=512, k=8, bench/moe_cuda.py,
    2026-12-01), experts + combine, ms:

    ======  =============  =============  ==============
    T       pfl, 32 rows   pfl, 64 rows   big, 128 rows
    ======  =============  =============  ==============
    512     0.626          0.665          --
    2048    --             1.076          1.186
    4096    --             1.634          1.668
    ======  =============  =============  ==============

    (three independent calls per evaluation, i.e. throughput: the ratios
    between tile sizes hold, the absolute times are below one call's latency.)

    Raises:
        ValueError: a negative or non-integer ``num_assignments``, fewer than
            one expert, or an unknown ``variant``.
    """
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (num_assignments, num_experts)):
        raise ValueError(
            f"choose_tile_rows: num_assignments and num_experts must be ints, got "
            f"{num_assignments!r}, {num_experts!r}"
        )
    if num_assignments < 0 or num_experts < 1:
        raise ValueError(
            f"choose_tile_rows: need num_assignments >= 0 and num_experts >= 1, "
            f"got {num_assignments}, {num_experts}"
        )
    variant = _check_variant("choose_tile_rows", variant)
    if num_assignments < 64 * num_experts:
        return 32
    if variant == "async":  # 64 at every size from 64 rows/expert (unverified)
        return 64
    if variant == "wg":
        r128, r64 = WG_TUNE.get("rows128_from"), WG_TUNE.get("rows64_from")
        if r128 and num_assignments >= r128 * num_experts:
            return 128
        return 64 if r64 is None or num_assignments >= r64 * num_experts else 32
    if variant != "big" or num_assignments < 128 * num_experts:
        return 64
    return 128


def _is_sm90() -> bool:
    try:
        return cb.gpu_arch() == (9, 0)
    except RuntimeError:
        return False


def default_variant(d: int, i: int) -> str:
    """The variant the public functions run when ``variant`` is None, for
    hidden size ``d`` and expert size ``i``: :data:`DEFAULT_VARIANT` where it
    runs (for "wg": a GPU of compute capability 9.0 and :func:`wg_shapes_ok`),
    else :data:`FALLBACK_VARIANT`. Never compiles."""
    if DEFAULT_VARIANT == "wg" and not (wg_shapes_ok(d, i) and _is_sm90()):
        return FALLBACK_VARIANT
    return DEFAULT_VARIANT


def _check_variant(fn: str, variant: Optional[str], d: Optional[int] = None, i: Optional[int] = None) -> str:
    if variant is None and d is not None and i is not None:
        return default_variant(d, i)
    v = DEFAULT_VARIANT if variant is None else variant
    if v not in VARIANTS:
        raise ValueError(f"{fn}: variant must be one of {VARIANTS}, got {variant!r}")
    return v


def variant_config(variant: str, kind: int, bm: int, out_cols: int, in_cols: Optional[int] = None,
                   down_ft: Optional[int] = None) -> dict:
    """Build macros and launch shape of one kernel: dict of ``defines``
    (MOE_* macros without MOE_KIND / MOE_YT), ``threads`` per CTA and ``bn``
    (output columns per CTA). ``kind`` 0 = gate+up, 1 = down; ``bm`` the
    tile rows; ``out_cols`` the output width O (a multiple of 64).
    The "async" variant adds ``source`` (its .cu file) and ``smem`` (bytes of
    dynamic shared memory per CTA); the others use static shared memory only
    (no ``smem`` key). ``in_cols`` (K) and ``down_ft`` are used by "wg"
    only: its down kernel keeps the whole h tile resident and computes
    ``down_ft`` feature tiles per CTA (None: ``WG_TUNE["down_ft"]`` when it
    is an int, else 1) when K fits the ring and the width splits evenly.

    Raises:
        ValueError: an unknown ``variant``, ``kind`` not 0/1, ``bm`` not in
            :data:`TILE_CHOICES`, ``out_cols`` not a positive multiple of 64."""
    variant = _check_variant("variant_config", variant)
    if not isinstance(bm, int) or bm not in TILE_CHOICES:
        raise ValueError(f"variant_config: bm must be one of {TILE_CHOICES}, got {bm!r}")
    if kind not in (0, 1):
        raise ValueError(f"variant_config: kind must be 0 (gate+up) or 1 (down), got {kind!r}")
    if not isinstance(out_cols, int) or out_cols <= 0 or out_cols % 64:
        raise ValueError(f"variant_config: out_cols must be a positive multiple of 64, got {out_cols!r}")
    if variant == "async":
        return _async_config(kind, bm, out_cols)
    if variant == "wg":
        return _wg_config(kind, bm, out_cols, in_cols, down_ft)
    d = dict(MOE_BM=bm, MOE_BN=BN)
    wm, wn = (4, 2) if bm == 128 else (2, 2)
    if variant != "base":
        d["MOE_DEQ"] = 1
    if variant in ("pf", "pfl", "pflv", "big"):
        d["MOE_PF"] = 1
    if variant in ("pfl", "pflv", "big"):
        d["MOE_LDM"] = 1
    if variant == "pflv" and bm != 128:  # 16-byte weight fetch: BN 64 = half of 128 threads
        d["MOE_WV"] = 1
        if kind == 0 and bm == 64:  # 163 -> 128 registers, 0 spills: 4 CTAs/SM instead of 3
            d["MOE_MINB"] = 4
    # 128 columns: 8 warps; gate+up holds two weight tiles, so only BM <= 64
    # fits 48 KB of static shared memory (xs BM x 72 + 2 x 128 x 72 halves)
    if variant == "big" and out_cols % 128 == 0 and (kind == 1 or bm <= 64):
        d["MOE_BN"] = 128
        if bm == 128:  # down, 4 x 2 warps of 32 x 64; cap at 2 CTAs/SM (126 regs, no spills)
            wm, wn = 4, 2
            d["MOE_MINB"] = 2
        else:
            wm, wn = 2, 4
    if (wm, wn) != (2, 2):
        d["MOE_WM"], d["MOE_WN"] = wm, wn
    return dict(defines=d, threads=32 * wm * wn, bn=d["MOE_BN"])


def _async_config(kind: int, bm: int, out_cols: int) -> dict:
    stages = int(ASYNC_TUNE["stages"])
    if bm == 128:
        want, wm = (64 if kind == 0 else 128), 2
    else:
        want = ASYNC_TUNE["gate_up_bn"] if kind == 0 else (
            ASYNC_TUNE["down_bn_bm32"] if bm == 32 else ASYNC_TUNE["down_bn"])
        wm = 1
    bn = next(b for b in (256, 128, 64) if b <= want and out_cols % b == 0)
    nmat = 2 if kind == 0 else 1
    d = dict(MOE_BM=bm, MOE_BN=bn, MOE_DEQ=1, MOE_WM=wm, MOE_WN=8, MOE_STAGES=stages)
    if ASYNC_TUNE.get("cols_fast"):
        d["MOE_COLS_FAST"] = 1
    smem = stages * (bm * 144 + nmat * bn * 40)  # A rows (144 B) + W (32 B) + scale/bias (8 B) per row
    return dict(defines=d, threads=32 * wm * 8, bn=bn, source="moe_grouped_gemm_async.cu", smem=smem)


def _wg_config(kind: int, bm: int, out_cols: int, in_cols: Optional[int] = None,
               down_ft: Optional[int] = None) -> dict:
    feat = WG_FEAT[kind]
    if out_cols % feat:
        raise ValueError(f"variant_config: variant 'wg' needs out_cols a multiple of {feat} for kind {kind}, got {out_cols}")
    stages = int(WG_TUNE["stages"])
    ring = stages * bm * 2 * WG_KC
    d = dict(MOE_BM=bm, MOE_STAGES=stages)
    if WG_TUNE.get("minb"):
        d["MOE_MINB"] = int(WG_TUNE["minb"])
    if down_ft is None:
        down_ft = WG_TUNE.get("down_ft", 1)
        down_ft = down_ft if isinstance(down_ft, int) else 1
    ft = int(down_ft)
    if (kind == 1 and ft > 1 and bm <= 64 and in_cols is not None and in_cols <= WG_KC * stages
            and out_cols % (feat * ft) == 0):
        d["MOE_FT"] = ft
        feat *= ft
    staging = bm * (feat + 8) * 2 if kind == 0 else 0  # down stores from registers
    return dict(defines=d, threads=256, bn=feat, source="moe_grouped_gemm_wgmma.cu",
                smem=max(ring, staging) + 1024)


def _q_arrays(proj) -> Tuple[mx.array, mx.array, mx.array]:
    return proj["weight"], proj["scales"], proj["biases"]


def _q_ok(w, s, b, E=None, O=None, K=None, one: bool = False) -> bool:
    """4-bit group-64 arrays ``[E, O, K/8]`` / ``[E, O, K/64]`` (``one``: one
    expert's ``[O, K/8]`` / ``[O, K/64]``, as a ``QuantizedLinear`` holds
    them) of the given sizes."""
    try:
        if w.ndim != (2 if one else 3) or w.dtype != mx.uint32 or s.dtype != mx.bfloat16 or b.dtype != mx.bfloat16:
            return False
        e, o, kw = (1, *w.shape) if one else w.shape
        if s.shape != tuple(w.shape[:-1]) + (kw * 8 // 64,) or b.shape != s.shape:
            return False
        return (
            (E is None or e == E) and (O is None or o == O) and (K is None or kw * 8 == K)
            and o % BN == 0 and (kw * 8) % BK == 0
        )
    except AttributeError:
        return False


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


def shared_expert_supported(shared_expert, d: int) -> bool:
    """True when :func:`moe_experts_and_shared` can run ``shared_expert`` on
    hidden size ``d``: its ``gate_proj``, ``up_proj`` (``d -> I_s``) and
    ``down_proj`` (``I_s -> d``) are 4-bit group-64 affine ``QuantizedLinear``
    with bf16 scales and biases and no bias term, and ``(d, I_s)`` fit the
    "wg" kernels (:func:`wg_shapes_ok`); ``I_s`` may differ from the routed
    experts' size. Pure, CPU-callable."""
    try:
        projs = (shared_expert.gate_proj, shared_expert.up_proj, shared_expert.down_proj)
        if not all(_affine4(p) for p in projs):
            return False
        g, u, dn = (_q_arrays(p) for p in projs)
        i_s = g[0].shape[0]
    except (AttributeError, KeyError, TypeError, ValueError, IndexError):
        return False
    return (wg_shapes_ok(d, i_s) and _q_ok(*g, O=i_s, K=d, one=True) and _q_ok(*u, O=i_s, K=d, one=True)
            and _q_ok(*dn, O=d, K=i_s, one=True))


def shared_slot_supported(shared_expert, d: int, i_dim: int) -> bool:
    """True when :func:`moe_experts` can run ``shared_expert`` in the routing's
    shared slot next to routed experts of size ``i_dim`` on hidden size
    ``d``: :func:`shared_expert_supported` and its intermediate size is
    ``i_dim`` (one kernel build serves both weight sets). Pure, CPU-callable."""
    return shared_expert_supported(shared_expert, d) and shared_expert.gate_proj["weight"].shape[0] == i_dim


def _kernel(kind: int, bm: int, yt: str = "bf16_t", variant: Optional[str] = None,
            out_cols: int = 512, in_cols: Optional[int] = None,
            down_ft: Optional[int] = None, shared: bool = False) -> Tuple[cb.CudaKernel, dict]:
    """(kernel, variant_config) of one build; cached per configuration.
    ``shared``: the "wg" build that also takes the shared expert's weights
    (MOE_SHARED)."""
    cfg = variant_config(_check_variant("_kernel", variant), kind, bm, out_cols, in_cols, down_ft)
    defs = dict(cfg["defines"], MOE_KIND=kind)
    if shared:
        defs["MOE_SHARED"] = 1
    if kind == 1:
        defs["MOE_YT"] = yt
    src = cfg.get("source", "moe_grouped_gemm.cu")
    key = (src,) + tuple(sorted(defs.items()))
    k = _kernels.get(key)
    if k is None:
        k = cb.CudaKernel(
            src, "mqf_moe_gate_up" if kind == 0 else "mqf_moe_down", defs
        )
        _kernels[key] = k
    return k, cfg


def _grid(cfg: dict, items: int, col_tiles: int) -> Tuple[int, int, int]:
    """Launch grid in threads: (items, column tiles), or (column tiles, items)
    for an "async" build with MOE_COLS_FAST."""
    nt = cfg["threads"]
    if cfg["defines"].get("MOE_COLS_FAST"):
        if items > 65535:  # CUDA's limit on gridDim.y
            raise ValueError(f"MOE_COLS_FAST launches one work item per grid row: at most 65535, got {items}")
        return (col_tiles * nt, items, 1)
    return (items * nt, col_tiles, 1)


def _smem_kw(cfg: dict) -> dict:
    """``shared_memory=`` for variants with dynamic shared memory only, so the
    other variants launch exactly as before (MLX raises the kernel's dynamic
    limit itself above 48 KB: cuFuncSetAttribute in its CustomKernel)."""
    return {"shared_memory": cfg["smem"]} if cfg.get("smem") else {}


def _check_async_sizes(fn: str, *sizes: int) -> None:
    # the "async" kernel keeps 32-bit element offsets (bit 31 of the A offset
    # is a flag)
    if max(sizes) >= 2**31:
        raise ValueError(f"{fn}: variant 'async' needs arrays of fewer than 2**31 elements, got {max(sizes)}")


def _check_wg(fn: str, d: int, i_dim: int, *sizes: int) -> None:
    if not wg_shapes_ok(d, i_dim):
        raise ValueError(
            f"{fn}: variant 'wg' needs D % 256 == 0 and I % 128 == 0, got D={d}, I={i_dim}"
        )
    if max(sizes) >= 2**31:  # 32-bit element offsets in the kernel
        raise ValueError(f"{fn}: variant 'wg' needs arrays of fewer than 2**31 elements, got {max(sizes)}")
    if not _is_sm90():
        raise ValueError(f"{fn}: variant 'wg' needs a GPU of compute capability 9.0 (wgmma)")


def _dims(get) -> Tuple[Optional[int], Optional[int]]:
    """(D, I) from ``get()``, or (None, None) where the arguments are too
    malformed to tell (the shape checks that follow name the argument)."""
    try:
        d, i = get()
        return int(d), int(i)
    except (AttributeError, IndexError, KeyError, TypeError):
        return None, None


def _check_routing(fn: str, routing: Routing, nk: int):
    if routing.tile_rows not in TILE_CHOICES:
        raise ValueError(f"{fn}: routing.tile_rows must be one of {TILE_CHOICES}, got {routing.tile_rows}")
    g = routing.groups
    if g.order.shape != (nk,) or g.order.dtype != mx.int32:
        raise ValueError(f"{fn}: routing.groups.order must be int32 [{nk}], got {g.order.dtype} {tuple(g.order.shape)}")
    e = g.counts.shape[0]
    mt = -(-nk // routing.tile_rows) + e
    if routing.block_map.shape != (mt, 2) or routing.block_map.dtype != mx.int32:
        raise ValueError(
            f"{fn}: routing.block_map must be int32 [{mt}, 2] (ceil(N*k/tile_rows) + E), "
            f"got {routing.block_map.dtype} {tuple(routing.block_map.shape)}"
        )
    if g.offsets.shape != (e + 1,) or g.offsets.dtype != mx.int32:
        raise ValueError(f"{fn}: routing.groups.offsets must be int32 [{e + 1}], got {tuple(g.offsets.shape)}")


def _check_experts(fn: str, routing: Routing, e: int, shared, variant: str) -> None:
    """The routing's expert count against the weights' ``e`` (with the shared
    slot: :func:`~.moe_routing.shared_group_experts` ``(e)`` and
    ``shared_id == e``); the shared weights given exactly when the routing
    has the slot, and only to the "wg" kernels."""
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
    if shared is not None and variant != "wg":
        raise ValueError(f"{fn}: the shared expert's slot needs variant 'wg', got {variant!r}")


def gate_up_swiglu(
    x: mx.array, routing: Routing, gate: Sequence, up: Sequence, *, variant: Optional[str] = None
) -> mx.array:
    """``silu(x W_gate^T) * (x W_up^T)`` per assignment, in grouped order.

    Args:
        x: ``[N, D]`` bfloat16 tokens (D a multiple of 64).
        routing: from :func:`moe_routing.route_and_group` on these N tokens
            (``tile_rows`` in :data:`TILE_CHOICES`; ``k`` from
            ``routing.groups.top_k``).
        gate, up: ``(weight [E, I, D/8] uint32, scales [E, I, D/64] bf16,
            biases [E, I, D/64] bf16)``, I a multiple of 64.
        variant: one of :data:`VARIANTS` (None: :func:`default_variant`).

    Returns:
        ``[N*k, I]`` bfloat16; row ``r`` belongs to assignment
        ``routing.groups.order[r]``.

    Raises:
        ValueError: bad shape/dtype of an argument (named in the message).
    """
    v = _check_variant("gate_up_swiglu", variant, *_dims(lambda: (x.shape[-1], gate[0].shape[1])))
    h = _gate_up(x, routing, gate, up, v)
    return unpermute_k(h) if v == "wg" else h


def _gate_up(x: mx.array, routing: Routing, gate: Sequence, up: Sequence, variant: str,
             x_kernel_order: bool = False, shared: Optional[Tuple[Sequence, Sequence]] = None) -> mx.array:
    """:func:`gate_up_swiglu` with ``h`` as the kernel writes it (for "wg":
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
    _check_routing("gate_up_swiglu", routing, nk)
    _check_experts("gate_up_swiglu", routing, e, shared, variant)
    if shared is not None and not (_q_ok(*shared[0], O=i_dim, K=d, one=True)
                                   and _q_ok(*shared[1], O=i_dim, K=d, one=True)):
        raise ValueError(f"gate_up_swiglu: the shared expert's gate and up must be one expert's arrays "
                         f"(uint32 [{i_dim}, {d // 8}], bf16 scales/biases) as the routed experts'")
    if variant == "wg":
        _check_wg("gate_up_swiglu", d, i_dim, x.size, gate[0].size, up[0].size)
    if nk == 0:
        return mx.zeros((0, i_dim), mx.bfloat16)
    mt = routing.block_map.shape[0]
    kern, cfg = _kernel(0, routing.tile_rows, variant=variant, out_cols=i_dim, in_cols=d,
                        shared=shared is not None)
    nt = cfg["threads"]
    if variant == "async":
        _check_async_sizes("gate_up_swiglu", x.size, gate[0].size, up[0].size)
    if variant == "wg" and not x_kernel_order:
        x = permute_k(x)
    extra, es = ([*shared[0], *shared[1]], [e]) if shared is not None else ([], [])
    (h,) = kern(
        inputs=[x, *gate, *up, *extra, routing.groups.order, routing.groups.offsets, routing.block_map],
        output_shapes=[(nk, i_dim)],
        output_dtypes=[mx.bfloat16],
        grid=_grid(cfg, mt, i_dim // cfg["bn"]),
        threadgroup=(nt, 1, 1),
        scalars=[d, i_dim, k, *es],
        **_smem_kw(cfg),
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
        variant: one of :data:`VARIANTS` (None: :func:`default_variant`).

    Returns:
        ``[N*k, D]`` in ``out_dtype``, assignment order (``a = n*k + j``);
        each expert output is rounded to bf16 before the routing weight is
        applied (as ``SwitchGLU`` on bf16 does).

    Raises:
        ValueError: bad shape/dtype of an argument (named in the message).
    """
    v = _check_variant("down_weighted", variant, *_dims(lambda: (down[0].shape[1], h.shape[-1])))
    if v == "wg" and h.ndim == 2 and h.shape[-1] % WG_KC == 0:
        h = permute_k(h)
    return _down(h, routing, down, out_dtype, v)


def _down(h: mx.array, routing: Routing, down: Sequence, out_dtype: mx.Dtype, variant: str,
          down_ft: Optional[int] = None, shared: Optional[Sequence] = None) -> mx.array:
    """:func:`down_weighted` on ``h`` as the gate+up kernel wrote it (for
    "wg": columns in :func:`permute_k` order); ``down_ft``: the "wg" feature
    tiles per CTA (None: :func:`wg_down_ft` of the call); ``shared``: the
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
    _check_routing("down_weighted", routing, nk)
    scores = routing.scores.reshape(-1)
    if scores.shape != (nk,) or scores.dtype != mx.float32:
        raise ValueError(f"down_weighted: routing.scores must be float32 with {nk} entries, got {scores.dtype} {tuple(routing.scores.shape)}")
    e, d = down[0].shape[0], down[0].shape[1]
    _check_experts("down_weighted", routing, e, shared, variant)
    if shared is not None and not _q_ok(*shared, O=d, K=i_dim, one=True):
        raise ValueError(f"down_weighted: the shared expert's down must be one expert's arrays "
                         f"(uint32 [{d}, {i_dim // 8}], bf16 scales/biases) as the routed experts'")
    if variant == "wg":
        _check_wg("down_weighted", d, i_dim, h.size, down[0].size)
    if nk == 0:
        return mx.zeros((0, d), out_dtype)
    mt = routing.block_map.shape[0]
    groups = e + (shared is not None)  # experts with rows: the shared one is one more
    kern, cfg = _kernel(1, routing.tile_rows, "float" if out_dtype == mx.float32 else "bf16_t",
                        variant=variant, out_cols=d, in_cols=i_dim,
                        down_ft=(down_ft or wg_down_ft(nk, groups)) if variant == "wg" else None,
                        shared=shared is not None)
    nt = cfg["threads"]
    if variant == "async":
        _check_async_sizes("down_weighted", h.size, down[0].size)
    extra, es = (list(shared), [e]) if shared is not None else ([], [])
    (y,) = kern(
        inputs=[h, *down, *extra, routing.groups.order, routing.groups.offsets, routing.block_map, scores],
        output_shapes=[(nk, d)],
        output_dtypes=[out_dtype],
        grid=_grid(cfg, mt, d // cfg["bn"]),
        threadgroup=(nt, 1, 1),
        scalars=[i_dim, d, routing.groups.top_k, *es],
        **_smem_kw(cfg),
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
    ``variant``: one of :data:`VARIANTS` for both kernels (None:
    :func:`default_variant`).

    With a routing that has the shared slot (``routing.shared_id``, from
    ``route_and_group(..., shared_logits=...)`` or ``shared_column=True``), ``shared_expert`` (an
    mlx-lm MLP of three 4-bit group-64 ``QuantizedLinear``, the routed
    experts' sizes: :func:`shared_slot_supported`) runs as one more expert
    group of the same two "wg" launches, its sigmoid gate as the slot's
    weight: the block's experts + gated shared expert, each expert output
    rounded to bf16 and all summed in fp32. Measured against the shared
    expert as its own one-expert launches (:func:`moe_experts_and_shared`)
    in bench/results/moe-cuda-log.md (thirteenth session).

    Raises:
        ValueError: as :func:`gate_up_swiglu` / :func:`down_weighted`; a
            shared slot without ``shared_expert`` or the reverse, a shared
            expert of other sizes, a variant other than "wg" with it.
    """
    v = _check_variant("moe_experts", variant, *_dims(lambda: (x.shape[-1], gate_proj["weight"].shape[1])))
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
    h = _gate_up(x, routing, _q_arrays(gate_proj), _q_arrays(up_proj), v, shared=sgu)
    y = _down(h, routing, _q_arrays(down_proj), mx.float32, v, shared=sd)
    k = routing.groups.top_k
    return y.reshape(n, k, d).sum(axis=1).astype(out_dtype or x.dtype)


# ---------------------------------------------------------------------------
# the shared expert through the same kernels
# ---------------------------------------------------------------------------

#: ``MLX_QWEN_FAST_MOE_SHARED_GEMM=0`` keeps the shared expert on MLX's dense
#: quantised matmuls (three ``quantized_matmul`` + elementwise) beside the
#: grouped GEMMs; otherwise it runs through the "wg" grouped kernels
#: (:func:`shared_form`): from :data:`SHARED_SLOT_MIN_TOKENS` tokens in the
#: routing's shared slot, one more group of the routed experts' launches
#: (:func:`moe_experts` with ``shared_expert``), or, with the value "group"
#: (and for a shared expert of another size or a routing without room for
#: the slot), from :data:`SHARED_GEMM_MIN_TOKENS` tokens as a one-expert
#: group of launches of its own (:func:`moe_experts_and_shared`). Only "0"
#: and "group" (exactly) are recognised; any other value is the default.
SHARED_GEMM_ENV = "MLX_QWEN_FAST_MOE_SHARED_GEMM"
#: Fewest tokens for which the shared expert runs through the grouped kernels
#: as a one-expert group of its own launches (bench/results/moe-cuda-log.md,
#: eleventh session).
SHARED_GEMM_MIN_TOKENS = 1024
#: Fewest tokens for which it runs in the routing's shared slot: 128, the
#: smallest call measured (also ``ops.moe.MOE_KERNEL_MIN_TOKENS``, below which
#: the block runs stock anyway). ncu GPU time of
#: one block call on the H200 (thirteenth session, moe-cuda-log.md), slot
#: (router and gate apart) / one-expert group / dense, us: T=4096 1,184.8 /
#: 1,244.2 / 1,354.1; 2048 742.2 / 784.8 / 845.2; 1024 508.4 / 559.1 /
#: 601.2; 512 379.6 / 422.2 / 475.5; 256 298.6 / 342.3 / 413.1; with the
#: router and gate as one matmul: slot 4096 1,153.6, 1024 475.7, 256 281.7,
#: 128 236.3 against group 307.5 and dense 373.7 at 128.
SHARED_SLOT_MIN_TOKENS = 128


def shared_form(num_tokens: int, d: int, i_dim: int, shared_expert, *, num_experts: int,
                top_k: int) -> Optional[str]:
    """How the patched MoE block runs its shared expert for a call: None
    (MLX's dense matmuls beside the grouped GEMMs), ``"slot"`` (the routing's
    shared slot: :func:`moe_experts` with ``shared_expert``) or ``"group"``
    (its own one-expert launches: :func:`moe_experts_and_shared`).

    "slot" from :data:`SHARED_SLOT_MIN_TOKENS` tokens where
    :func:`shared_slot_supported`, the routing has room for the slot
    (``moe_routing.shared_slot_fits(num_experts, top_k)``), the "wg" variant
    is the default and :data:`SHARED_GEMM_ENV` is neither "0" nor "group";
    otherwise "group" where :func:`shared_in_gemm` and
    :func:`shared_expert_supported`; else None. The environment is read on
    every call. Never compiles.
    """
    import os

    env = os.environ.get(SHARED_GEMM_ENV, "1")
    if (env not in ("0", "group") and num_tokens >= SHARED_SLOT_MIN_TOKENS
            and shared_slot_fits(num_experts, top_k)
            and default_variant(d, i_dim) == "wg" and shared_slot_supported(shared_expert, d, i_dim)):
        return "slot"
    if shared_in_gemm(num_tokens, d, i_dim) and shared_expert_supported(shared_expert, d):
        return "group"
    return None


def shared_in_gemm(num_tokens: int, d: int, i_dim: int) -> bool:
    """Whether the one-expert-group form (:func:`moe_experts_and_shared`,
    :func:`shared_form`'s "group") applies to a call: the "wg"
    variant is the default for hidden size ``d`` and the routed experts' size
    ``i_dim`` (a compute capability 9.0 GPU), ``num_tokens >=``
    :data:`SHARED_GEMM_MIN_TOKENS`, and :data:`SHARED_GEMM_ENV` is not "0"
    (read on every call). Never compiles; False without a CUDA GPU."""
    import os

    return (os.environ.get(SHARED_GEMM_ENV, "1") != "0" and num_tokens >= SHARED_GEMM_MIN_TOKENS
            and default_variant(d, i_dim) == "wg")


def single_expert_tile_rows(num_tokens: int, i_dim: int) -> int:
    """Row tile of a one-expert call (:func:`single_expert_routing`) of
    ``num_tokens`` rows and expert size ``i_dim``: the largest of
    :data:`TILE_CHOICES` whose "wg" gate+up grid (``ceil(N / tile) * I / 128``
    CTAs) still fills 90% of the SMs, else the smallest.

    Raises:
        RuntimeError: no CUDA driver or device (the SM count is asked for).
    """
    sms = cb.sm_count()
    for tile in sorted(TILE_CHOICES, reverse=True):
        if -(-num_tokens // tile) * (i_dim // WG_FEAT[0]) >= 0.9 * sms:
            return tile
    return min(TILE_CHOICES)


@functools.lru_cache(maxsize=32)
def _single_expert_groups(num_tokens: int, tile_rows: int):
    n, t = num_tokens, tile_rows
    rows = np.arange(n, dtype=np.int32)
    tiles = -(-n // t)
    bmap = np.full((tiles + 1, 2), -1, np.int32)
    bmap[:tiles, 0] = 0
    bmap[:tiles, 1] = np.arange(tiles, dtype=np.int32)
    zeros = np.zeros(n, np.int32)
    groups = ExpertGroups(
        mx.array(np.array([n], np.int32)), mx.array(np.array([0, n], np.int32)), mx.array(rows),
        mx.array(zeros), mx.array(rows), 1,
    )
    return groups, mx.array(bmap), mx.array(zeros.reshape(n, 1))


def single_expert_routing(scores: mx.array, tile_rows: int) -> Routing:
    """The routing of every row to expert 0 of a one-expert group, weighted by ``scores``.

    ``groups`` and ``block_map`` are what :func:`mlx_qwen_fast.ops.moe.group_by_expert`
    and :func:`~mlx_qwen_fast.ops.moe.block_map` give for ``inds = zeros([N, 1])``
    and one expert (counts ``[N]``, offsets ``[0, N]``, the identity order,
    tiles ``(0, t)`` for ``t < ceil(N / tile_rows)`` and one ``(-1, -1)``),
    built once per ``(N, tile_rows)`` on the host from numpy: no routing
    kernels run.

    Args:
        scores: ``[N, 1]`` float32 routing weights (the shared expert's
            sigmoid gate).
        tile_rows: one of :data:`TILE_CHOICES`.

    Raises:
        ValueError: ``scores`` not float32 ``[N, 1]`` or a bad ``tile_rows``.
    """
    if not isinstance(scores, mx.array) or scores.ndim != 2 or scores.shape[1] != 1 or scores.dtype != mx.float32:
        raise ValueError(f"single_expert_routing: scores must be float32 [N, 1], got "
                         f"{getattr(scores, 'dtype', type(scores).__name__)} {tuple(getattr(scores, 'shape', ()))}")
    if tile_rows not in TILE_CHOICES:
        raise ValueError(f"single_expert_routing: tile_rows must be one of {TILE_CHOICES}, got {tile_rows!r}")
    groups, bmap, inds = _single_expert_groups(int(scores.shape[0]), int(tile_rows))
    return Routing(inds, scores, groups, bmap, int(tile_rows))


def _one_expert(proj) -> Tuple[mx.array, mx.array, mx.array]:
    """A ``QuantizedLinear``'s arrays as a one-expert group ``[1, O, ...]`` (views)."""
    return tuple(a[None] for a in _q_arrays(proj))


def moe_experts_and_shared(
    x: mx.array, routing: Routing, gate_proj, up_proj, down_proj, shared_expert, shared_scores: mx.array,
    *, out_dtype: Optional[mx.Dtype] = None,
) -> mx.array:
    """Routed experts plus the gated shared expert, all through the "wg" kernels: ``[N, D]``.

    ``sum_j scores[n, j] * expert_{inds[n, j]}(x[n]) + shared_scores[n] *
    shared_expert(x[n])``. The shared expert (an mlx-lm MLP of three 4-bit
    group-64 ``QuantizedLinear``) runs as a one-expert grouped GEMM
    (:func:`single_expert_routing`, down with one feature tile per CTA) on the
    same permuted ``x`` as the routed experts, instead of three dense
    quantised matmuls and their elementwise ops; its output is rounded to
    bf16 before the weight is applied, as the routed experts' are, and both
    are summed in fp32 (stock: bf16 products and sums).

    Args:
        x: ``[N, D]`` bfloat16; routing, gate_proj, up_proj, down_proj: as
            :func:`moe_experts`.
        shared_expert: a module with ``gate_proj``, ``up_proj`` (``D -> I_s``),
            ``down_proj`` (``I_s -> D``) ``QuantizedLinear`` (4 bits, group 64,
            bf16 scales and biases; ``I_s`` a multiple of 128, not
            necessarily the routed experts' size): see
            :func:`shared_expert_supported`.
        shared_scores: ``[N, 1]`` float32, the shared expert's gate
            (``sigmoid(shared_expert_gate(x))``).
        out_dtype: default ``x.dtype``.

    Raises:
        ValueError: a shape/dtype the kernels do not take (the argument
            named), or a GPU other than compute capability 9.0.
        RuntimeError: no CUDA driver or device.
    """
    if not isinstance(x, mx.array) or x.ndim != 2 or x.dtype != mx.bfloat16:
        raise ValueError(f"moe_experts_and_shared: x must be bfloat16 [N, D], got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    n, d = x.shape
    if (not isinstance(shared_scores, mx.array) or tuple(shared_scores.shape) != (n, 1)
            or shared_scores.dtype != mx.float32):
        raise ValueError(f"moe_experts_and_shared: shared_scores must be float32 [N={n}, 1], got "
                         f"{getattr(shared_scores, 'dtype', type(shared_scores).__name__)} "
                         f"{tuple(getattr(shared_scores, 'shape', ()))}")
    if not shared_expert_supported(shared_expert, d):
        raise ValueError(
            "moe_experts_and_shared: shared_expert must have gate_proj, up_proj (D -> I_s) and down_proj "
            f"(I_s -> D) as 4-bit group-64 affine QuantizedLinear with bf16 scales/biases, D={d}, I_s % 128 == 0"
        )
    xp = permute_k(x)
    h = _gate_up(xp, routing, _q_arrays(gate_proj), _q_arrays(up_proj), "wg", x_kernel_order=True)
    y = _down(h, routing, _q_arrays(down_proj), mx.float32, "wg")
    i_s = shared_expert.gate_proj["weight"].shape[0]
    sr = single_expert_routing(shared_scores, single_expert_tile_rows(n, i_s))
    hs = _gate_up(xp, sr, _one_expert(shared_expert.gate_proj), _one_expert(shared_expert.up_proj), "wg",
                  x_kernel_order=True)
    ys = _down(hs, sr, _one_expert(shared_expert.down_proj), mx.float32, "wg", down_ft=1)
    k = routing.groups.top_k
    return (y.reshape(n, k, d).sum(axis=1) + ys).astype(out_dtype or x.dtype)
