"""Gated DeltaNet prefill on CUDA in one launch: front end + scan.

Fuses the two prefill kernels -- the front end (``gated_delta_frontend``:
conv state + depthwise causal conv1d + SiLU + q/k L2 norm + gates) and the
register-resident scan (``gated_delta_scan``) -- into one grid. The scan
blocks come first; the blocks after them run the front end over token tiles
in order (persistent blocks, :data:`FE_BLOCKS_PER_SM` per SM, each warp
walking the work items) and count finished tiles in progress flags; a scan
block waits for a stage's tiles before it copies them into shared memory.
The front end thus runs beside the scan's first stages instead of before it
(one launch, no dependency wait between two kernels). q, k, v, g and beta
still go through global memory (mostly L2): they are outputs of the call, as
the two kernels'.

Measured on the H200 (bench/results/gdn-cuda-log.md): 0.983-0.989 ms per
4K call at steady state in a chain of layers, the two kernels 0.993-1.001
(2026-12-02); the patched model's 4K prefill was 2-11% slower with it on
2026-12-01 and equal within noise on 2026-12-02 (front end at 123 instead of
149 registers), so the layer uses it only with ``MLX_QWEN_FAST_GDN_FUSED=1``
(``layers.GDN_FUSED_ENV``).

Scan blocks wait on front-end blocks, never the other way round; the grid
cannot deadlock as long as some front-end block can become resident while
every scan block waits. :func:`supports` therefore takes only calls whose
scan blocks fit one per SM (B * Hv * 128 / rows per block <= SM count: B = 1
for the model, 128 blocks on the H200's 132 SMs); larger batches run the
two kernels.

Contract: :func:`gated_delta_frontend` followed by :func:`gated_delta_scan`
(same arithmetic, bit for bit: the same device code). Source:
``mlx_qwen_fast/cuda/gated_delta_scan.cu`` built with ``GDN_FUSED=1``, and
``gdn_frontend.cuh``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import mlx.core as mx

from . import _cuda_build as cb
from . import gated_delta_frontend as fe
from . import gated_delta_scan as scan

__all__ = ["gated_delta_prefill", "supports"]

D = fe.D
#: Persistent front-end blocks per SM (beside each SM's one scan block).
FE_BLOCKS_PER_SM = 1


def _scan_blocks(B: int, Hv: int, cfg: scan.ScanConfig) -> int:
    """Scan blocks of a call: one per (sequence, value head, row block)."""
    return B * Hv * (D // cfg.rows_per_block)


def supports(
    qkv: mx.array,
    conv_state: Optional[mx.array],
    conv_weight: mx.array,
    state: Optional[mx.array],
    *,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int = D,
    head_v_dim: int = D,
    mask: Optional[mx.array] = None,
) -> bool:
    """True when :func:`gated_delta_prefill` can run this call: what
    ``gated_delta_frontend.supports`` needs, a float32 state
    [B, Hv, 128, 128] or None, and at most one scan block per SM (see the
    module docstring; the default config's blocks are 32 state rows)."""
    if not fe.supports(qkv, conv_state, conv_weight, num_k_heads=num_k_heads,
                       num_v_heads=num_v_heads, head_k_dim=head_k_dim,
                       head_v_dim=head_v_dim, mask=mask):
        return False
    B = qkv.shape[0]
    if _scan_blocks(B, num_v_heads, scan.DEFAULT_CONFIG) > cb.sm_count():
        return False
    return state is None or (state.shape == (B, num_v_heads, D, D) and state.dtype == mx.float32)


def gated_delta_prefill(
    qkv: mx.array,
    a: mx.array,
    b: mx.array,
    conv_weight: mx.array,
    conv_state: Optional[mx.array],
    A_log: mx.array,
    dt_bias: mx.array,
    state: Optional[mx.array],
    *,
    num_k_heads: int,
    num_v_heads: int,
    eps: float = 1e-6,
    config: Optional[scan.ScanConfig] = None,
    fe_blocks_per_sm: int = FE_BLOCKS_PER_SM,
) -> Tuple[mx.array, mx.array, mx.array]:
    """Front end and gated delta rule over T tokens, one CUDA launch.

    Args:
      qkv, a, b, conv_weight, conv_state, A_log, dt_bias, num_k_heads,
        num_v_heads, eps: as :func:`gated_delta_frontend.gated_delta_frontend`
        (qkv [B, T, (2 Hk + Hv) * 128], a/b [B, T, Hv], conv state [B, 3, C]
        or None).
      state: [B, Hv, 128, 128] float32 recurrent state, or None for zeros.
      config: scan variant (``gated_delta_scan.ScanConfig``); default
        ``gated_delta_scan.DEFAULT_CONFIG``.
      fe_blocks_per_sm: persistent front-end blocks per SM (>= 1; each warp
        walks the work items in token order).

    Returns:
      (y [B, T, Hv, 128] in qkv's dtype, new state [B, Hv, 128, 128] float32,
       new conv state [B, 3, C] in qkv's dtype).

    Raises:
      ValueError: shapes or dtypes outside the above (names the argument).
      RuntimeError: no CUDA compiler could build the kernel.
    """
    if not isinstance(fe_blocks_per_sm, int) or isinstance(fe_blocks_per_sm, bool) or fe_blocks_per_sm < 1:
        raise ValueError(f"fe_blocks_per_sm must be an int >= 1, got {fe_blocks_per_sm!r}")
    Hk, Hv = num_k_heads, num_v_heads
    B, T, C, a, b, conv_state = fe.prepare(qkv, a, b, conv_weight, conv_state, A_log, dt_bias, Hk, Hv)
    if state is None:
        state = mx.zeros((B, Hv, D, D), dtype=mx.float32)
    elif state.shape != (B, Hv, D, D) or state.dtype != mx.float32:
        raise ValueError(f"state must be float32 of shape [{B}, {Hv}, {D}, {D}], got "
                         f"{state.dtype} {tuple(state.shape)}")
    cfg = scan.ScanConfig(*config) if config is not None else scan.DEFAULT_CONFIG
    n_scan = _scan_blocks(B, Hv, cfg)
    if n_scan > cb.sm_count():
        raise ValueError(f"gated_delta_prefill: {n_scan} scan blocks (B={B}) exceed the "
                         f"{cb.sm_count()} SMs (see supports())")
    kern = scan.kernel(qkv.dtype, Hv, Hk, cfg,
                       fused=fe.defines(qkv.dtype, conv_weight.dtype, A_log.dtype, dt_bias.dtype, Hv, Hk))
    nthreads = cfg[2] * 32
    ntiles = -(-T // fe.TT)
    items = B * ntiles * (2 * Hk + Hv)  # front-end work items (one warp each)
    n_fe = min(-(-items // cfg[2]), fe_blocks_per_sm * cb.sm_count())
    flags = mx.zeros((B * ntiles,), dtype=mx.int32)  # scratch the kernel counts in
    x, f32 = qkv.dtype, mx.float32
    outs = kern(
        inputs=[qkv, a, b, conv_weight.reshape(C, fe.KW), conv_state, A_log, dt_bias, state, flags],
        output_shapes=[(B, T, Hk, D), (B, T, Hk, D), (B, T, Hv, D), (B, T, Hv), (B, T, Hv),
                       (B, fe.KW - 1, C), (B, T, Hv, D), (B, Hv, D, D)],
        output_dtypes=[x, x, x, f32, f32, x, x, f32],
        grid=((n_scan + n_fe) * nthreads, 1, 1),
        threadgroup=(nthreads, 1, 1),
        scalars=[B, T, eps],
        shared_memory=scan.smem_bytes(x, cfg),
    )
    new_conv, y, new_state = outs[5:]
    return y, new_state, new_conv
