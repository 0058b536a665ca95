"""Gated DeltaNet prefill scan on CUDA: one kernel, state in registers.

Fuses the whole token loop of the gated delta rule (mlx-lm's
``gated_delta_ops`` runs it as ~40 graph nodes per token) into one kernel:
each block keeps 32 rows of one value head's 128x128 fp32 state in registers
for the whole call, reads q/k/v/g/beta through double-buffered shared memory
(cp.async) and writes y and the final state once.  Source and layout notes:
``mlx_qwen_fast/cuda/gated_delta_scan.cu``.

Contract: the one of ``mlx_qwen_fast.ops.gated_delta`` (and of mlx-lm's
``gated_delta_kernel``): ``fn(q, k, v, g, beta, state, mask) -> (y, state)``,
scalar gates only, Dk = Dv = 128.  Algorithm: the gated delta rule of Yang,
Kautz & Hatamizadeh, "Gated Delta Networks" (arXiv 2412.06464), eq. (10), in
its sequential (recurrent) form.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import mlx.core as mx

from . import _checks
from . import _cuda_build as cb

__all__ = ["gated_delta_scan", "supports", "DEFAULT_CONFIG", "ScanConfig"]

D = 128


class ScanConfig(tuple):
    """Kernel variant: (L lanes per state row, R rows per lane, warps per
    block, TB tokens per shared-memory stage, fp32 k/q copies 0/1, U tokens
    per group 1/2/4; keywords L, R, warps, tb, kqf32, u) -- see
    gated_delta_scan.cu.  Constraints: L divides 32,
    warps * (32 / L) * R divides 128, TB a multiple of 4 and of U (of 8
    when U = 1)."""

    __slots__ = ()

    def __new__(cls, L=8, R=2, warps=4, tb=32, kqf32=0, u=1):
        """Raises ValueError (naming the field) when the constraints above fail."""
        vals = dict(L=L, R=R, warps=warps, tb=tb, kqf32=kqf32, u=u)
        for name, v in vals.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"ScanConfig: {name} must be a non-negative int, got {v!r}")
        if L < 1 or 32 % L:
            raise ValueError(f"ScanConfig: L must divide 32, got {L}")
        if R < 1 or warps < 1 or D % (warps * (32 // L) * R):
            raise ValueError(
                f"ScanConfig: rows per block warps * (32 / L) * R = {warps * (32 // L) * R} "
                f"must divide {D} (R >= 1, warps >= 1)"
            )
        if u not in (1, 2, 4) or kqf32 not in (0, 1):
            raise ValueError(f"ScanConfig: u must be 1, 2 or 4 and kqf32 0 or 1, got u={u}, kqf32={kqf32}")
        if tb < 4 or tb % 4 or tb % u or (u == 1 and tb % 8) or tb > warps * 32:
            raise ValueError(
                f"ScanConfig: tb must be a multiple of 4 and of u (of 8 when u = 1), at most "
                f"warps * 32 = {warps * 32}, got tb={tb}"
            )
        return super().__new__(cls, (L, R, warps, tb, kqf32, u))

    @property
    def rows_per_block(self) -> int:
        L, R, W = self[0], self[1], self[2]
        return W * (32 // L) * R


#: The build the layers use: the fastest of the measured configurations at
#: B=1, T=4096, bf16 (bench/results/gdn-cuda-log.md, the scan sweep).
DEFAULT_CONFIG = ScanConfig(8, 2, 4, 32, 0, 1)

_kernels: Dict[tuple, cb.CudaKernel] = {}


def kernel(dtype, Hv: int, Hk: int, cfg: ScanConfig) -> cb.CudaKernel:
    """The scan kernel for these dtypes/heads/config, built once per process
    (and cached on disk)."""
    key = (dtype, Hv, Hk, tuple(cfg))
    kern = _kernels.get(key)
    if kern is None:
        L, R, W, TB, KQF, U = cfg
        defs = dict(
            GDN_X=cb.dtype_macro(dtype), GDN_HV=Hv, GDN_HK=Hk, GDN_L=L,
            GDN_R=R, GDN_NW=W, GDN_TB=TB, GDN_KQF32=KQF, GDN_U=U,
        )
        kern = cb.CudaKernel("gated_delta_scan.cu", "mqf_gdn_scan", defs)
        _kernels[key] = kern
    return kern


def smem_bytes(dtype, cfg: ScanConfig) -> int:
    """Dynamic shared memory of one block (the layout in the .cu file)."""
    L, R, W, TB, KQF, U = cfg
    RB = cfg.rows_per_block
    xs = dtype.size
    n = xs * (2 * TB * D * 2 + 2 * TB * RB * 2)  # k, q, v, y tiles
    n += 4 * (2 * TB * 2 + TB)  # g, beta, k.q
    if U > 1:
        n += 4 * (TB // U) * 16  # Gram entries per group
    if KQF and xs != 4:
        n += 4 * 2 * TB * D  # fp32 copies of k and q
    return n


def supports(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: Optional[mx.array] = None,
    mask: Optional[mx.array] = None,
) -> bool:
    """True when :func:`gated_delta_scan` can run these arguments.

    Needs MLX's CUDA backend as the default device, q/k [B, T, Hk, 128] and
    v [B, T, Hv, 128] of one dtype among bfloat16/float16/float32 with Hv a
    multiple of Hk, scalar gates g/beta [B, T, Hv] (any float dtype), a float32
    state [B, Hv, 128, 128] or None, and a [B, T] mask or None.  Anything else
    (vector gates, other head dims, a non-fp32 state) stays on the reference
    path.  Never compiles or evaluates anything.
    """
    if not cb.cuda_available():
        return False
    return _problem(q, k, v, g, beta, state, mask) is None


_ARRAYS = (("q", f"[B, T, Hk, {D}] (float)", False), ("k", f"[B, T, Hk, {D}] (float)", False),
           ("v", f"[B, T, Hv, {D}] (float)", False), ("g", "[B, T, Hv] (float)", False),
           ("beta", "[B, T, Hv] (float)", False), ("state", f"[B, Hv, {D}, {D}] float32", True),
           ("mask", "[B, T] (bool)", True))


def _problem(q, k, v, g, beta, state, mask) -> Optional[str]:
    """None when the arguments fit the kernel, else what does not (one line)."""
    problem = _checks.arrays_problem(_ARRAYS, q, k, v, g, beta, state, mask)
    if problem is not None:
        return problem
    if q.ndim != 4 or q.shape[3] != D:
        return f"q must have shape [B, T, Hk, {D}], got {tuple(q.shape)}"
    B, T, Hk, _ = q.shape
    if k.shape != q.shape:
        return f"k must have shape {tuple(q.shape)} (like q), got {tuple(k.shape)}"
    if v.ndim != 4 or v.shape[:2] != (B, T) or v.shape[3] != D:
        return f"v must have shape [{B}, {T}, Hv, {D}], got {tuple(v.shape)}"
    Hv = v.shape[2]
    if Hk == 0 or Hv == 0 or Hv % Hk:
        return f"v's head count Hv={Hv} must be a positive multiple of Hk={Hk}"
    if q.dtype not in (mx.bfloat16, mx.float16, mx.float32) or not (q.dtype == k.dtype == v.dtype):
        return f"q, k, v must share one dtype among bfloat16/float16/float32, got {q.dtype}, {k.dtype}, {v.dtype}"
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (B, T, Hv) or not mx.issubdtype(x.dtype, mx.floating):
            return f"{name} must be a float array of shape [{B}, {T}, {Hv}], got {x.dtype} {tuple(x.shape)}"
    if state is not None and (state.shape != (B, Hv, D, D) or state.dtype != mx.float32):
        return f"state must be float32 of shape [{B}, {Hv}, {D}, {D}], got {state.dtype} {tuple(state.shape)}"
    if mask is not None and mask.shape != (B, T):
        return f"mask must have shape [{B}, {T}], got {tuple(mask.shape)}"
    return None


def _check(q, k, v, g, beta, state, mask):
    problem = _problem(q, k, v, g, beta, state, mask)
    if problem is not None:
        raise ValueError(problem)
    return q.shape[0], q.shape[1], q.shape[2], v.shape[2]


def gated_delta_scan(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: Optional[mx.array] = None,
    mask: Optional[mx.array] = None,
    *,
    config: Optional[ScanConfig] = None,
) -> Tuple[mx.array, mx.array]:
    """Run the gated delta rule over T tokens in one CUDA kernel.

    Args:
      q, k: [B, T, Hk, 128], bfloat16/float16/float32 (L2-normalised, q
        already scaled by 128**-0.5, as ``normalize_qk`` leaves them).
      v: [B, T, Hv, 128], same dtype; Hv a multiple of Hk (value head h reads
        key head h // (Hv // Hk); q and k are not copied).
      g: [B, T, Hv] decay per token and value head, in (0, 1]; any float
        dtype (used as float32).
      beta: [B, T, Hv] write strength; any float dtype (used as float32).
      state: [B, Hv, 128(Dv), 128(Dk)] float32, or None for zeros.
      mask: [B, T] bool (or 0/1) or None.  False marks a padding step: the
        state passes through unchanged and y is 0 there (done by setting
        g = 1, beta = 0 for those steps, then zeroing y).
      config: kernel variant (tests and benchmarks); default DEFAULT_CONFIG.

    Returns:
      (y [B, T, Hv, 128] in q's dtype, new state [B, Hv, 128, 128] float32).
      All arithmetic is fp32; y is rounded once. For B = 0 or T = 0 the
      empty y and the state unchanged, without a launch.

    Raises:
      ValueError: an argument that is not an mx.array, a shape or dtype
        outside the contract above (the message names the argument and the
        expected shape/dtype).
      RuntimeError: no CUDA compiler could build the kernel.
    """
    B, T, Hk, Hv = _check(q, k, v, g, beta, state, mask)
    cfg = ScanConfig(*config) if config is not None else DEFAULT_CONFIG
    if state is None:
        state = mx.zeros((B, Hv, D, D), dtype=mx.float32)
    g = g.astype(mx.float32)
    beta = beta.astype(mx.float32)
    if mask is not None:
        m = (mask if mask.dtype == mx.bool_ else mask != 0)[..., None]
        g = mx.where(m, g, 1.0)
        beta = mx.where(m, beta, 0.0)
    if B == 0 or T == 0:  # nothing to scan: a launch of an empty grid is an error
        return mx.zeros((B, T, Hv, D), dtype=q.dtype), state
    kern = kernel(q.dtype, Hv, Hk, cfg)
    nthreads = cfg[2] * 32
    nblocks = B * Hv * (D // cfg.rows_per_block)
    y, new_state = kern(
        inputs=[q, k, v, g, beta, state],
        output_shapes=[(B, T, Hv, D), (B, Hv, D, D)],
        output_dtypes=[q.dtype, mx.float32],
        grid=(nblocks * nthreads, 1, 1),
        threadgroup=(nthreads, 1, 1),
        scalars=[T],
        shared_memory=smem_bytes(q.dtype, cfg),
    )
    if mask is not None:
        y = mx.where(m[..., None], y, 0)
    return y, new_state
