"""The builds of the grouped expert GEMMs (:mod:`~mlx_qwen_fast.kernels.moe_grouped_gemm`):
which one runs, its tile rules, build macros and launch shape.

Two builds (:data:`VARIANTS`), one source file each; :func:`default_variant`
takes the first that runs on this GPU:

- ``"wgmma"`` (``cuda/moe_grouped_gemm_wgmma.cu``, compute capability 9.0):
  Hopper warpgroup MMA on the transposed problem. The 4-bit weights are the
  A operand, dequantised by each thread straight into its A fragment
  registers; the activation rows are the B operand, copied with ``cp.async``
  into a ring of :data:`WGMMA_STAGES` 128-byte-swizzled shared-memory slots.
  256 threads (two warpgroups) per CTA, 128 (gate+up) or 256 x
  :func:`down_feature_tiles` (down) output features per CTA. Needs K a
  multiple of 128 and the activations in the kernel's K order within each
  128 inputs (:func:`permute_k`): the wrappers permute ``x`` once, and the
  gate+up kernel writes ``h`` in that order for the down kernel (the public
  functions take and return natural order).
- ``"mma"`` (``cuda/moe_grouped_gemm.cu``, other GPUs): ``mma.sync``
  m16n8k16 on tiles of 32/64/128 rows x 64 columns, packed bf16x2
  dequantisation into shared memory, a register prefetch of the next K
  step's weights, ``ldmatrix`` fragment loads and 16-byte weight fetches.

Rows per work item: :func:`choose_tile_rows` (one of :data:`TILE_CHOICES`).
Each configuration is built once per process (:func:`get_kernel`).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import mlx.core as mx

from . import _cuda_build as cb

__all__ = [
    "BK",
    "BN",
    "STAGES",
    "TILE_CHOICES",
    "VARIANTS",
    "WGMMA_FEATURES",
    "WGMMA_STAGES",
    "WG_KC",
    "build_config",
    "check_variant",
    "choose_tile_rows",
    "default_variant",
    "down_feature_tiles",
    "get_kernel",
    "is_sm90",
    "launch_kw",
    "permute_k",
    "unpermute_k",
    "wgmma_shapes_ok",
]

BK = 64  # K step = quantisation group
BN = 64  # output columns per CTA of the "mma" build
TILE_CHOICES = (32, 64, 128)
#: The builds, in order of preference (see :func:`default_variant`).
VARIANTS = ("wgmma", "mma")
#: The two kernels of each build (the sources' ``MOE_KIND``).
STAGES = {"gate_up": 0, "down": 1}
#: ``cp.async`` ring depth of the "wgmma" kernels: K chunks of 128 inputs in
#: flight (``WGMMA_STAGES - 2`` ahead of the one being multiplied).
WGMMA_STAGES = 4
#: Output features per CTA of the "wgmma" kernels: gate+up (two warpgroups x
#: 64 features of both matrices), down (two warpgroups x two 64-row tiles).
WGMMA_FEATURES = {"gate_up": 128, "down": 256}
WG_KC = 128  # inputs per K chunk of the "wgmma" kernels (the K-order period)
_kernels: Dict[tuple, cb.CudaKernel] = {}


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
    """The "wgmma" kernels' activation K order: ``[..., K]`` -> ``[..., K]``.

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


def down_feature_tiles(num_assignments: int, num_experts: int) -> int:
    """Feature tiles of 256 per down CTA of the "wgmma" build for a call: 8
    once experts average 64 rows or more, else 1 (few CTAs otherwise).
    With several tiles the item's ``h`` stays resident in shared memory."""
    return 8 if num_assignments >= 64 * num_experts else 1


def wgmma_shapes_ok(d: int, i: int) -> bool:
    """True when the "wgmma" kernels take hidden size ``d`` and expert size
    ``i``: ``i`` a multiple of 128 (gate+up features per CTA; also the K
    chunk of down) and ``d`` of 256 (down features per CTA; a whole number
    of K chunks of gate+up)."""
    return i % WGMMA_FEATURES["gate_up"] == 0 and d % WGMMA_FEATURES["down"] == 0


def choose_tile_rows(num_assignments: int, num_experts: int, variant: Optional[str] = None) -> int:
    """Rows per work item (one of :data:`TILE_CHOICES`): 32 when experts
    average fewer than 64 rows (``num_assignments < 64 * num_experts``,
    ``num_assignments = N*k``), else 64. The timings behind the rule:
    bench/results/INDEX.md (kind "moe_cuda").

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
    check_variant("choose_tile_rows", variant)
    return 32 if num_assignments < 64 * num_experts else 64


def is_sm90() -> bool:
    """Whether the GPU has compute capability 9.0 (False without one)."""
    try:
        return cb.gpu_arch() == (9, 0)
    except RuntimeError:
        return False


def default_variant(d: int, i: int) -> str:
    """The build the public functions run when ``variant`` is None, for hidden
    size ``d`` and expert size ``i``: "wgmma" on a GPU of compute capability
    9.0 where :func:`wgmma_shapes_ok`, else "mma". Never compiles."""
    return "wgmma" if wgmma_shapes_ok(d, i) and is_sm90() else "mma"


def check_variant(fn: str, variant: Optional[str], d: Optional[int] = None, i: Optional[int] = None) -> str:
    """``variant`` if it is one of :data:`VARIANTS`, else ValueError naming
    ``fn``; None: :func:`default_variant` for hidden size ``d`` and expert
    size ``i`` where both are given, else the first of :data:`VARIANTS`."""
    if variant is None and d is not None and i is not None:
        return default_variant(d, i)
    v = VARIANTS[0] if variant is None else variant
    if v not in VARIANTS:
        raise ValueError(f"{fn}: variant must be one of {VARIANTS}, got {variant!r}")
    return v


def build_config(variant: str, stage: str, bm: int, out_cols: int, in_cols: Optional[int] = None,
                 down_ft: int = 1) -> dict:
    """Build macros and launch shape of one kernel.

    Args:
        variant: one of :data:`VARIANTS`.
        stage: "gate_up" or "down".
        bm: tile rows, one of :data:`TILE_CHOICES`.
        out_cols: the output width O (a multiple of 64; for "wgmma" of
            :data:`WGMMA_FEATURES` ``[stage]``).
        in_cols: the input width K ("wgmma" down: the whole ``h`` tile stays
            resident, so ``down_ft`` tiles need ``K <= 128 * WGMMA_STAGES``).
        down_ft: "wgmma" down feature tiles per CTA (:func:`down_feature_tiles`;
            used where ``bm <= 64``, K fits and the width splits evenly).

    Returns:
        dict of ``defines`` (the source's MOE_* macros but MOE_KIND / MOE_YT
        / MOE_SHARED), ``threads`` per CTA, ``bn`` (output columns per CTA),
        ``source`` (the .cu file) and ``smem`` (bytes of dynamic shared
        memory; 0: static shared memory only).

    Raises:
        ValueError: an unknown ``variant`` or ``stage``, ``bm`` not in
            :data:`TILE_CHOICES`, ``out_cols`` not a positive multiple of 64
            (of the "wgmma" feature tile for that build).
    """
    variant = check_variant("build_config", variant)
    if stage not in STAGES:
        raise ValueError(f"build_config: stage must be one of {tuple(STAGES)}, got {stage!r}")
    if not isinstance(bm, int) or bm not in TILE_CHOICES:
        raise ValueError(f"build_config: bm must be one of {TILE_CHOICES}, got {bm!r}")
    if not isinstance(out_cols, int) or out_cols <= 0 or out_cols % 64:
        raise ValueError(f"build_config: out_cols must be a positive multiple of 64, got {out_cols!r}")
    if variant == "wgmma":
        return _wgmma_config(stage, bm, out_cols, in_cols, down_ft)
    d = dict(MOE_BM=bm)
    wm, wn = (4, 2) if bm == 128 else (2, 2)
    if bm != 128:  # 16-byte weight fetches: BN 64 = half of 128 threads
        d["MOE_WV"] = 1
        if stage == "gate_up" and bm == 64:  # 128 registers, no spills: 4 CTAs/SM instead of 3
            d["MOE_MINB"] = 4
    if (wm, wn) != (2, 2):
        d["MOE_WM"], d["MOE_WN"] = wm, wn
    return dict(defines=d, threads=32 * wm * wn, bn=BN, source="moe_grouped_gemm.cu", smem=0)


def _wgmma_config(stage: str, bm: int, out_cols: int, in_cols: Optional[int], down_ft: int) -> dict:
    feat = WGMMA_FEATURES[stage]
    if out_cols % feat:
        raise ValueError(f"build_config: the wgmma {stage} kernel needs out_cols a multiple of {feat}, "
                         f"got {out_cols}")
    ring = WGMMA_STAGES * bm * 2 * WG_KC
    d = dict(MOE_BM=bm, MOE_STAGES=WGMMA_STAGES)
    if (stage == "down" and down_ft > 1 and bm <= 64 and in_cols is not None
            and in_cols <= WG_KC * WGMMA_STAGES and out_cols % (feat * down_ft) == 0):
        d["MOE_FT"] = int(down_ft)
        feat *= down_ft
    staging = bm * (feat + 8) * 2 if stage == "gate_up" else 0  # down stores from registers
    return dict(defines=d, threads=256, bn=feat, source="moe_grouped_gemm_wgmma.cu",
                smem=max(ring, staging) + 1024)


def get_kernel(stage: str, bm: int, yt: str = "bf16_t", variant: Optional[str] = None,
               out_cols: int = 512, in_cols: Optional[int] = None,
               down_ft: int = 1, shared: bool = False) -> Tuple[cb.CudaKernel, dict]:
    """(kernel, build_config) of one build; cached per configuration.
    ``shared``: the "wgmma" build that also takes the shared expert's weights
    (MOE_SHARED)."""
    cfg = build_config(check_variant("get_kernel", variant), stage, bm, out_cols, in_cols, down_ft)
    defs = dict(cfg["defines"], MOE_KIND=STAGES[stage])
    if shared:
        defs["MOE_SHARED"] = 1
    if stage == "down":
        defs["MOE_YT"] = yt
    key = (cfg["source"],) + tuple(sorted(defs.items()))
    k = _kernels.get(key)
    if k is None:
        k = _kernels[key] = cb.CudaKernel(cfg["source"], f"mqf_moe_{stage}", defs)
    return k, cfg


def launch_kw(cfg: dict, items: int, col_tiles: int) -> dict:
    """Grid (in threads, MLX's convention: one CTA per work item and column
    tile), threadgroup and, for builds with dynamic shared memory,
    ``shared_memory`` (MLX raises the kernel's limit itself above 48 KB)."""
    nt = cfg["threads"]
    kw = dict(grid=(items * nt, col_tiles, 1), threadgroup=(nt, 1, 1))
    if cfg["smem"]:
        kw["shared_memory"] = cfg["smem"]
    return kw
