"""numpy host references of the MoE kernels (moved here unchanged in
behaviour from the package, where they served only the tests):

* :func:`unpack_affine_4bit`, :func:`bf16_round`, :func:`bf16_round_f64`
  (were ``mlx_qwen_fast.kernels.moe_grouped_gemm.unpack_affine_4bit``,
  ``bf16_round``, ``_bf16_round_f64``): the grouped GEMMs' dequantisation;
* :func:`dequant_f32`, :func:`moe_decode_reference` (were
  ``mlx_qwen_fast.kernels.moe_decode_gemv.dequant_f32`` and ``reference``):
  the decode kernels' fp32 reference;
* :func:`decode_gemv_reference`: the decode GEMV's (``quantized_gemv``)
  float64 reference with the kernel's bf16 rounding points;
* :func:`moe_prefill_reference`: the Metal grouped GEMMs' fp32 reference
  (``kernels/moe_grouped_gemm_metal.py``), any activation dtype.

Their own tests: tests/test_references.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

__all__ = ["bf16_round", "bf16_round_f64", "decode_gemv_reference", "dequant_f32", "moe_decode_reference",
           "moe_prefill_reference", "round_to", "unpack_affine_4bit"]


def _np32(a) -> np.ndarray:
    if isinstance(a, mx.array):
        return np.asarray(a.astype(mx.float32))
    return np.asarray(a, dtype=np.float32)


def _np(a) -> np.ndarray:
    if isinstance(a, mx.array):
        return np.asarray(a.astype(mx.float32) if a.dtype in (mx.bfloat16, mx.float16) else a)
    return np.asarray(a)


# ---------------------------------------------------------------------------
# rounding and the grouped GEMMs' dequantisation
# ---------------------------------------------------------------------------


def bf16_round(a) -> np.ndarray:
    """Round float32 to the nearest bf16 (ties to even), kept as float32."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    u = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return u.view(np.float32)


def bf16_round_f64(a: np.ndarray) -> np.ndarray:
    """Round float64 to the nearest bf16 (ties to even) in one step, as float32.

    For values in bf16's normal range (bf16 subnormals are not modelled)."""
    u = np.ascontiguousarray(a, dtype=np.float64).view(np.uint64)
    drop = np.uint64(45)  # 52 - 7 mantissa bits
    half = np.uint64((1 << 44) - 1)
    u = (u + half + ((u >> drop) & np.uint64(1))) & ~np.uint64((1 << 45) - 1)
    return u.view(np.float64).astype(np.float32)  # exact: 8 significant bits


def unpack_affine_4bit(w, scales, biases, group_size: int = 64, rounding: str = "twice") -> np.ndarray:
    """Host reference of the kernels' dequantisation, as numpy float32.

    Args:
        w: ``[..., O, K/8]`` uint32 (numpy or MLX) packed weights.
        scales, biases: ``[..., O, K/group_size]`` bf16 (numpy float32 or MLX).
        group_size: inputs per scale/bias.
        rounding: ``"twice"``: ``bf16(bf16(scale * q) + bias)``, MLX's CPU
            ``mx.dequantize`` (bit-exact with it); ``"once"``:
            ``bf16(scale * q + bias)`` rounded once from the exact value, the
            grouped GEMM kernels (both builds: ``q`` made exact in bf16, then
            one fused multiply-add) and MLX's CUDA ``mx.dequantize``.

    Returns:
        ``[..., O, K]`` float32 holding bf16 values, ``q = (w >> 4*j) & 15``
        for input ``8*word + j`` (low nibble first).

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
    return bf16_round_f64(s.astype(np.float64) * q + b)


# ---------------------------------------------------------------------------
# the decode kernels' fp32 reference
# ---------------------------------------------------------------------------


def dequant_f32(w, s, b, bits: int = 4, group_size: int = 64) -> np.ndarray:
    """``s * q + b`` in fp32 (no bf16 rounding) from packed affine arrays."""
    w = _np(w).astype(np.uint32)
    per = 32 // bits
    shifts = bits * np.arange(per, dtype=np.uint32)
    q = (w[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    q = q.reshape(*w.shape[:-1], w.shape[-1] * per).astype(np.float32)
    s = np.repeat(_np(s).astype(np.float32), group_size, axis=-1)
    b = np.repeat(_np(b).astype(np.float32), group_size, axis=-1)
    return s * q + b


def _silu(v):
    return v / (1.0 + np.exp(-v))


def moe_decode_reference(x, inds, scores, experts, shared, expert_gate, dtype=mx.bfloat16):
    """fp32 host reference of :func:`mlx_qwen_fast.kernels.moe_decode_gemv.moe_decode_arrays` (numpy).

    Weights ``s * q + b`` in fp32; rounding to the activations' ``dtype``
    (bfloat16, or float32: no rounding) where mlx-lm rounds: the gate and up
    outputs, ``silu(g) * u``, each expert's (and the shared expert's) down
    output, the shared gate's logit; routing weights, sigmoid and the sums in
    fp32.

    Returns:
        ``(h [N*k + N, I], sgate [N], y [N, D])`` float32 numpy arrays (y not
        rounded; the kernel stores ``bf16(y)``).
    """
    if dtype not in (mx.bfloat16, mx.float32):
        raise ValueError(f"moe_decode_reference: dtype must be bfloat16 or float32, got {dtype!r}")
    rnd = bf16_round if dtype == mx.bfloat16 else (lambda v: np.asarray(v, np.float32))
    xf = _np(x).astype(np.float32)
    ii = _np(inds).astype(np.int64)
    sc = _np(scores).astype(np.float32)
    n, k = ii.shape
    (wg, sg, bg), (wu, su, bu), (wd, sd, bd) = experts
    cache = {}

    def mats(e):
        if e not in cache:
            if e < 0:
                (a, b_, c), (d_, f, g_), (h_, i_, j_) = shared
                cache[e] = (dequant_f32(a, b_, c), dequant_f32(d_, f, g_), dequant_f32(h_, i_, j_))
            else:
                cache[e] = (dequant_f32(wg[e], sg[e], bg[e]), dequant_f32(wu[e], su[e], bu[e]),
                            dequant_f32(wd[e], sd[e], bd[e]))
        return cache[e]

    I = wg.shape[1]
    h = np.zeros((n * k + n, I), np.float32)
    outs = np.zeros((n * k + n, xf.shape[1]), np.float32)
    for row in range(n * k + n):
        tok, e = (row // k, int(ii[row // k, row % k])) if row < n * k else (row - n * k, -1)
        g_, u_, d_ = mats(e)
        gt = rnd(g_ @ xf[tok])
        up = rnd(u_ @ xf[tok])
        h[row] = rnd(_silu(gt) * up)
        outs[row] = rnd(d_ @ h[row])
    gw, gs, gb, bits = expert_gate
    wgate = _np(gw).astype(np.float32) if bits == 16 else dequant_f32(gw, gs, gb, bits=bits)
    logit = rnd((wgate @ xf.T)[0])
    sgate = (1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    y = np.zeros_like(xf)
    for tok in range(n):
        for j in range(k):
            y[tok] += sc[tok, j] * outs[tok * k + j]
        y[tok] += sgate[tok] * outs[n * k + tok]
    return h, sgate, y


# ---------------------------------------------------------------------------
# the decode GEMV (kernels/quantized_gemv.py)
# ---------------------------------------------------------------------------


def _round64(a) -> np.ndarray:
    return bf16_round_f64(np.asarray(a, np.float64)).astype(np.float64)


def decode_gemv_reference(x, w, scales, biases, bits, gs, norm_weight=None, eps=1e-6, residual=None):
    """float64 ``(out [M, N], xin [M, K])`` of ``residual + rms_norm(x) @
    dequantize(w).T`` rounded to bf16 where the decode GEMV kernel rounds:
    the RMSNorm's normalised value and its product with the weight, each
    weight dequantised to bf16(s * q + b) (one rounding), the product's
    result, the residual add; everything else in float64. x [M, K]."""
    xf = _np(x).astype(np.float64)
    if norm_weight is not None:
        r = 1.0 / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + eps)
        xf = _round64(_np(norm_weight).astype(np.float64) * _round64(xf * r))
    s64 = np.repeat(_np(scales).astype(np.float64), gs, axis=-1)
    b64 = np.repeat(_np(biases).astype(np.float64), gs, axis=-1)
    # s = 1, b = 0: the integer levels q
    q = dequant_f32(w, mx.ones(scales.shape), mx.zeros(biases.shape), bits, gs).astype(np.float64)
    W = _round64(s64 * q + b64)
    y = _round64(xf @ W.T)
    if residual is not None:
        y = _round64(_np(residual).astype(np.float64) + y)
    return y, xf


# ---------------------------------------------------------------------------
# the Metal grouped GEMMs (kernels/moe_grouped_gemm_metal.py)
# ---------------------------------------------------------------------------


def round_to(dtype):
    """float32 -> float32 rounding to ``dtype`` (bfloat16, float16; float32:
    none), as a function of numpy arrays."""
    if dtype == mx.bfloat16:
        return bf16_round
    if dtype == mx.float16:
        return lambda v: np.asarray(v, np.float32).astype(np.float16).astype(np.float32)
    if dtype == mx.float32:
        return lambda v: np.asarray(v, np.float32)
    raise ValueError(f"round_to: dtype must be float32, float16 or bfloat16, got {dtype!r}")


def moe_prefill_reference(x, inds, scores, experts, dtype):
    """fp32 host reference of the Metal grouped GEMMs (numpy), expert by expert.

    Weights ``s * q + b`` in fp32 (:func:`dequant_f32`), rounding to the
    activations' ``dtype`` (:func:`round_to`) where mlx-lm's ``SwitchGLU``
    rounds: the gate and up outputs, ``silu(g) * u``, each expert's down
    output; the routing weights and the sums in fp32.

    Args:
        x: ``[N, D]``; inds, scores: ``[N, k]``; experts: ``(gate, up,
            down)`` as the kernels take them.

    Returns:
        ``(h [N*k, I], y [N*k, D], out [N, D])`` float32 in assignment order:
        ``h`` the SwiGLU rows, ``y = scores * rounded down output``, ``out``
        its sum over each token's k (not rounded).
    """
    rnd = round_to(dtype)
    xf = _np(x).astype(np.float32)
    ii = _np(inds).astype(np.int64).reshape(-1)
    sc = _np(scores).astype(np.float32).reshape(-1)
    k = _np(inds).shape[1]
    (wg, sg, bg), (wu, su, bu), (wd, sd, bd) = experts
    nk, I, D = ii.shape[0], wg.shape[1], xf.shape[1]
    h = np.zeros((nk, I), np.float32)
    y = np.zeros((nk, D), np.float32)
    for e in np.unique(ii):
        rows = np.nonzero(ii == e)[0]
        xe = xf[rows // k]
        g = rnd(xe @ dequant_f32(wg[int(e)], sg[int(e)], bg[int(e)]).T)
        u = rnd(xe @ dequant_f32(wu[int(e)], su[int(e)], bu[int(e)]).T)
        h[rows] = rnd(_silu(g) * u)
        y[rows] = sc[rows, None] * rnd(h[rows] @ dequant_f32(wd[int(e)], sd[int(e)], bd[int(e)]).T)
    return h, y, y.reshape(-1, k, D).sum(axis=1)
