"""The Gated DeltaNet op family (``mlx_qwen_fast.ops.gated_delta``): the
recurrence's reference forms vs a float64 loop and mlx-lm, the dispatch, and
the layer's fast paths (``gated_delta_net``).

Every reference test draws fresh random inputs from a generator seeded by
the test's own node id (different for every parametrised case, reproducible
on a rerun).

Tolerances come from the dtype, never tuned to pass:

* fp32 (y or state computed in fp32 math): relative L2 error <= FP32_RTOL
  = compare.FP32_TOL = 128 fp32 eps = 2**-16 ~ 1.5e-5.
* bf16 outputs: both sides compute in fp32 and round to bf16 once, so an
  element may differ by one bf16 ulp of its magnitude plus the fp32-level
  difference (FP32_RTOL * max |ref|).

The layer's decode step (the compiled call: projections, kernel, out_proj)
is checked on any backend with a stand-in for the kernel; the kernels and
the whole layer against stock mlx-lm in the ``cuda`` tests (bounds from
compare.py).
"""

import zlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.qwen3_5 import GatedDeltaNet, TextModelArgs

from compare import FP32_TOL, assert_close, tolerance
from gdn_helpers import FULL_ARGS, NOT_ARRAYS, full_size_layer
from mlx_lm.models import gated_delta as stock
from mlx_qwen_fast import layers
from mlx_qwen_fast.compiled import StepPlans, gather
from mlx_qwen_fast.kernels import _cuda_build as cb
from mlx_qwen_fast.kernels import gated_delta_contract as k_contract
from mlx_qwen_fast.kernels import gated_delta_decode as k_decode
from mlx_qwen_fast.ops import gated_delta as gd

EPS_BF16 = 2.0**-7  # bf16 has 8 significant bits (7 stored): one ulp at 1
FP32_RTOL = FP32_TOL  # 128 fp32 eps = 2**-16 ~ 1.5e-5


# ----------------------------------------------------------------- helpers


@pytest.fixture
def rng(request):
    """numpy Generator seeded from this test case's node id."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def _unit(x, axis=-1):
    return x / np.linalg.norm(x, axis=axis, keepdims=True)


def make_inputs(
    rng,
    B=1,
    T=8,
    Hk=2,
    Hv=4,
    Dk=32,
    Dv=32,
    g_range=(0.5, 1.0),
    beta_range=(0.0, 1.0),
    key_corr=0.0,
    with_state=True,
):
    """Contract-shaped inputs as float32 numpy arrays (q, k, v, g, beta, S)."""
    base = rng.standard_normal((B, 1, Hk, Dk)) * key_corr
    q = _unit(base + rng.standard_normal((B, T, Hk, Dk))) * Dk**-0.5
    k = _unit(base + rng.standard_normal((B, T, Hk, Dk)))
    v = rng.standard_normal((B, T, Hv, Dv))
    g = rng.uniform(*g_range, (B, T, Hv))
    beta = rng.uniform(*beta_range, (B, T, Hv))
    S = rng.standard_normal((B, Hv, Dv, Dk)) * 0.3 if with_state else None
    out = [x.astype(np.float32) for x in (q, k, v, g, beta)]
    out.append(None if S is None else S.astype(np.float32))
    return out


def to_mx(arrs, dtype=mx.float32):
    """q, k, v (and beta) in ``dtype``; g and state stay float32."""
    q, k, v, g, beta, S = arrs
    conv = lambda x, dt: mx.array(x).astype(dt)  # noqa: E731
    return (
        conv(q, dtype),
        conv(k, dtype),
        conv(v, dtype),
        conv(g, mx.float32),
        conv(beta, dtype),
        None if S is None else conv(S, mx.float32),
    )


def np64(x):
    return np.asarray(x.astype(mx.float32) if isinstance(x, mx.array) else x, np.float64)


def naive(q, k, v, g, beta, S=None, mask=None):
    """Independent float64 numpy loop over tokens (vectorised over B, heads)."""
    q, k, v, g, beta = (np64(x) for x in (q, k, v, g, beta))
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    R = Hv // Hk
    S = np.zeros((B, Hv, Dv, Dk)) if S is None else np64(S).copy()
    qr, kr = np.repeat(q, R, axis=2), np.repeat(k, R, axis=2)
    y = np.zeros((B, T, Hv, Dv))
    m = np.ones((B, T), bool) if mask is None else np.asarray(mask, bool)
    for t in range(T):
        Sn = S * g[:, t, :, None, None]
        kv = np.einsum("bhvk,bhk->bhv", Sn, kr[:, t])
        d = beta[:, t, :, None] * (v[:, t] - kv)
        Sn = Sn + d[..., None] * kr[:, t, :, None, :]
        yt = np.einsum("bhvk,bhk->bhv", Sn, qr[:, t])
        sel = m[:, t]
        S[sel] = Sn[sel]
        y[sel, t] = yt[sel]
    return y, S


def rel_l2(a, ref):
    """||a - ref|| / ||ref||; an all-zero ref demands an exact zero."""
    a, ref = np64(a), np64(ref)
    num, den = np.linalg.norm(a - ref), np.linalg.norm(ref)
    if den == 0:
        return 0.0 if num == 0 else float("inf")
    return float(num / den)


def assert_fp32_close(a, ref, what):
    err = rel_l2(a, ref)
    assert err <= FP32_RTOL, f"{what}: relative L2 error {err:.3e} > {FP32_RTOL:.3e}"


def assert_bf16_close(a, ref, what):
    """a (bf16) vs ref: <= 1 bf16 ulp of the magnitude + fp32-level slack."""
    a, ref = np64(a), np64(ref)
    mag = np.maximum(np.abs(a), np.abs(ref))
    ulp = EPS_BF16 * np.exp2(np.floor(np.log2(np.maximum(mag, 1e-30))))
    bound = ulp + FP32_RTOL * np.abs(ref).max()
    bad = np.abs(a - ref) > bound
    assert not bad.any(), (
        f"{what}: {bad.sum()} of {bad.size} elements beyond 1 bf16 ulp; "
        f"max |diff| {np.abs(a - ref).max():.3e}"
    )


def assert_y_close(y, ref, what):
    if y.dtype == mx.bfloat16:
        assert_bf16_close(y, ref, what)
    else:
        assert_fp32_close(y, ref, what)


def mlx_ref_inputs(arrs_mx):
    """The values the mlx implementations actually see, as float64 numpy."""
    return [None if x is None else np64(x) for x in arrs_mx]


# ----------------------------------------------------- recurrence vs numpy


@pytest.mark.parametrize("B,T,Hk,Hv", [(1, 1, 2, 4), (2, 3, 1, 3), (2, 40, 2, 2)])
def test_recurrent_matches_float64_loop(rng, B, T, Hk, Hv):
    arrs = make_inputs(rng, B=B, T=T, Hk=Hk, Hv=Hv, Dk=32, Dv=16)
    y, S = gd.gated_delta_recurrent(*to_mx(arrs))
    y_ref, S_ref = naive(*arrs)
    assert y.shape == (B, T, Hv, 16) and y.dtype == mx.float32
    assert S.shape == (B, Hv, 16, 32) and S.dtype == mx.float32
    assert_fp32_close(y, y_ref, "y")
    assert_fp32_close(S, S_ref, "state")


# ------------------------------------------------- chunked vs recurrence


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk", [16, 32, 64])
@pytest.mark.parametrize("T", [1, 2, 3, 63, 64, 65])
@pytest.mark.parametrize("B", [1, 2])
def test_chunked_matches_recurrent(rng, B, T, chunk, dtype):
    arrs = make_inputs(rng, B=B, T=T, Hk=2, Hv=4, Dk=32, Dv=16)
    inp = to_mx(arrs, dtype)
    y_c, S_c = gd.gated_delta_chunked(*inp, chunk_size=chunk)
    y_r, S_r = gd.gated_delta_recurrent(*inp)
    assert y_c.dtype == dtype and S_c.dtype == mx.float32
    assert y_c.shape == (B, T, 4, 16) and S_c.shape == (B, 4, 16, 32)
    assert_y_close(y_c, y_r, "chunked y vs recurrent")
    assert_fp32_close(S_c, S_r, "chunked state vs recurrent")
    # and both against the float64 loop on the values they saw
    y_n, S_n = naive(*mlx_ref_inputs(inp))
    assert_y_close(y_c, y_n, "chunked y vs float64 loop")
    assert_fp32_close(S_c, S_n, "chunked state vs float64 loop")


def test_chunked_long_sequence(rng):
    """T = 2049 (not a multiple of any chunk), small head count."""
    arrs = make_inputs(rng, B=1, T=2049, Hk=1, Hv=2, Dk=32, Dv=32)
    inp = to_mx(arrs)
    y_c, S_c = gd.gated_delta_chunked(*inp)
    y_r, S_r = gd.gated_delta_recurrent(*inp)
    y_n, S_n = naive(*arrs)
    assert_fp32_close(y_c, y_n, "chunked y vs float64 loop")
    assert_fp32_close(S_c, S_n, "chunked state vs float64 loop")
    assert_fp32_close(y_r, y_n, "recurrent y vs float64 loop")
    assert_fp32_close(S_r, S_n, "recurrent state vs float64 loop")


def test_chunked_real_head_dims(rng):
    """Dk = Dv = 128, GQA 2 value heads per key head (the model's layout)."""
    arrs = make_inputs(rng, B=1, T=70, Hk=2, Hv=4, Dk=128, Dv=128)
    y_c, S_c = gd.gated_delta_chunked(*to_mx(arrs))
    y_n, S_n = naive(*arrs)
    assert_fp32_close(y_c, y_n, "y")
    assert_fp32_close(S_c, S_n, "state")


@pytest.mark.parametrize(
    "g_range,beta_range,key_corr",
    [
        ((0.005, 0.02), (0.0, 1.0), 0.0),  # strong decay
        ((0.999, 1.0), (0.0, 1.0), 0.0),  # weak decay
        ((0.999, 1.0), (0.999, 1.0), 3.0),  # weak decay, beta ~ 1, correlated keys
        ((0.5, 1.0), (0.0, 1e-3), 0.0),  # beta ~ 0
        ((0.005, 0.02), (0.999, 1.0), 3.0),  # strong decay, beta ~ 1
    ],
    ids=["strong-decay", "weak-decay", "weak-beta1-corr", "beta0", "strong-beta1-corr"],
)
@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_decay_extremes(rng, g_range, beta_range, key_corr, chunk):
    arrs = make_inputs(
        rng, B=2, T=130, Hk=2, Hv=4, Dk=64, Dv=32,
        g_range=g_range, beta_range=beta_range, key_corr=key_corr,
    )
    if g_range[1] == 1.0:
        arrs[3][:, ::7] = 1.0  # exact g = 1 steps
    y_c, S_c = gd.gated_delta_chunked(*to_mx(arrs), chunk_size=chunk)
    y_r, S_r = gd.gated_delta_recurrent(*to_mx(arrs))
    y_n, S_n = naive(*arrs)
    assert_fp32_close(y_c, y_n, "chunked y")
    assert_fp32_close(S_c, S_n, "chunked state")
    assert_fp32_close(y_r, y_n, "recurrent y")
    assert_fp32_close(S_r, S_n, "recurrent state")


@pytest.mark.parametrize("flush", [False, True], ids=["gpu-variant", "cpu-flush"])
@pytest.mark.parametrize("g_range", [(1e-12, 1e-6), (0.2, 0.4)], ids=["g~1e-9", "g~0.3"])
def test_chunked_flush_variants(rng, monkeypatch, flush, g_range):
    """Both compiled variants (CPU flushes operands < 2^-60, GPU does not)
    match the float64 loop where decays across a chunk underflow."""
    monkeypatch.setattr(gd.chunk, "_flush_subnormals", lambda: flush)
    arrs = make_inputs(rng, B=1, T=150, Hk=2, Hv=4, g_range=g_range, key_corr=1.0)
    y_c, S_c = gd.gated_delta_chunked(*to_mx(arrs), chunk_size=64)
    y_n, S_n = naive(*arrs)
    assert_fp32_close(y_c, y_n, "y")
    assert_fp32_close(S_c, S_n, "state")


def test_decay_underflow_to_zero(rng):
    """g that underflowed to exactly 0 (huge A_log) resets the state, no NaN."""
    arrs = make_inputs(rng, B=1, T=70, Hk=1, Hv=2)
    arrs[3][0, [0, 5, 64, 69], :] = 0.0
    y_c, S_c = gd.gated_delta_chunked(*to_mx(arrs))
    y_n, S_n = naive(*arrs)
    assert np.isfinite(np64(y_c)).all() and np.isfinite(np64(S_c)).all()
    assert_fp32_close(y_c, y_n, "y")
    assert_fp32_close(S_c, S_n, "state")


def test_state_none_is_zeros(rng):
    arrs = make_inputs(rng, B=2, T=20, with_state=False)
    inp = to_mx(arrs)
    zeros = mx.zeros((2, 4, 32, 32), mx.float32)
    for fn in (gd.gated_delta_chunked, gd.gated_delta_recurrent):
        y0, S0 = fn(*inp[:5], None)
        y1, S1 = fn(*inp[:5], zeros)
        assert np.array_equal(np64(y0), np64(y1)) and np.array_equal(np64(S0), np64(S1))
    y_n, S_n = naive(*arrs)
    assert_fp32_close(y0, y_n, "y")


def test_empty_sequence(rng):
    arrs = make_inputs(rng, B=2, T=0)
    inp = to_mx(arrs)
    for fn in (gd.gated_delta_chunked, gd.gated_delta_recurrent):
        y, S = fn(*inp)
        assert y.shape == (2, 0, 4, 32) and y.dtype == mx.float32
        assert np.array_equal(np64(S), arrs[5].astype(np.float64))


@pytest.mark.parametrize("T", [1, 2, 33])
@pytest.mark.parametrize("masked", [False, True])
def test_dispatch_table_entries_agree(rng, T, masked):
    """Every CPU-runnable table entry equals the reference, with int masks too."""
    arrs = make_inputs(rng, B=2, T=T, Hk=1, Hv=2)
    inp = to_mx(arrs)
    mask = mx.array((rng.uniform(size=(2, T)) > 0.3).astype(np.int32)) if masked else None
    y_ref, S_ref = gd.gated_delta_recurrent(*inp, mask)
    for name in gd.IMPLEMENTATIONS:
        if name == "mlx-lm-metal" and gd._backend.current() != "metal":
            continue
        y, S = gd._TABLE[name](*inp, mask)
        assert_fp32_close(y, y_ref, f"{name} y")
        assert_fp32_close(S, S_ref, f"{name} state")


@pytest.mark.parametrize("split", [1, 37, 64, 100])
def test_state_carried_across_calls(rng, split):
    """Two calls with the carried state equal one call (and the recurrence)."""
    T = 101
    arrs = make_inputs(rng, B=2, T=T, Hk=2, Hv=4)
    q, k, v, g, beta, S = to_mx(arrs)
    first = lambda x: x[:, :split]  # noqa: E731
    second = lambda x: x[:, split:]  # noqa: E731
    y_all, S_all = gd.gated_delta_chunked(q, k, v, g, beta, S)
    y1, S1 = gd.gated_delta_chunked(*map(first, (q, k, v, g, beta)), S)
    y2, S2 = gd.gated_delta_chunked(*map(second, (q, k, v, g, beta)), S1)
    assert_fp32_close(mx.concatenate([y1, y2], axis=1), y_all, "y")
    assert_fp32_close(S2, S_all, "state")
    # prefill in chunked form, then decode steps with the recurrence
    y3, S3 = gd.gated_delta_chunked(*map(first, (q, k, v, g, beta)), S)
    ys = [y3]
    for t in range(split, T):
        sl = lambda x: x[:, t : t + 1]  # noqa: E731
        yt, S3 = gd.gated_delta_recurrent(*map(sl, (q, k, v, g, beta)), S3)
        ys.append(yt)
    assert_fp32_close(mx.concatenate(ys, axis=1), y_all, "prefill+decode y")
    assert_fp32_close(S3, S_all, "prefill+decode state")


# ------------------------------------------------------------------ masks


def _left_pad_mask(B, T, pads):
    pos = np.arange(T)[None, :]
    return pos >= np.asarray(pads)[:, None]


@pytest.mark.parametrize(
    "pads,T,chunk",
    [([0, 5], 21, 16), ([3, 70], 130, 64), ([64, 1], 65, 32), ([2, 0], 1 + 2, 64)],
)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
def test_left_padding_mask(rng, pads, T, chunk, dtype):
    """Padded steps leave the state unchanged and give y = 0; the unmasked
    positions equal the recurrence run on the unpadded sequence alone."""
    B = len(pads)
    arrs = make_inputs(rng, B=B, T=T, Hk=2, Hv=4)
    inp = to_mx(arrs, dtype)
    mask_np = _left_pad_mask(B, T, pads)
    mask = mx.array(mask_np)
    y_c, S_c = gd.gated_delta_chunked(*inp, mask, chunk_size=chunk)
    y_r, S_r = gd.gated_delta_recurrent(*inp, mask)
    for y, S, name in ((y_c, S_c, "chunked"), (y_r, S_r, "recurrent")):
        assert not np64(y)[~mask_np].any(), f"{name}: y must be 0 at padded steps"
        for b in range(B):
            p = pads[b]
            sub = [x[b : b + 1, p:] for x in inp[:5]] + [inp[5][b : b + 1]]
            y_ref, S_ref = gd.gated_delta_recurrent(*sub)
            if T - p > 0:
                assert_y_close(y[b : b + 1, p:], y_ref, f"{name} y, row {b}")
            assert_fp32_close(S[b : b + 1], S_ref, f"{name} state, row {b}")
    y_n, S_n = naive(*mlx_ref_inputs(inp), mask=mask_np)
    assert_y_close(y_c, y_n, "chunked y vs float64 loop")
    assert_fp32_close(S_c, S_n, "chunked state vs float64 loop")


def test_arbitrary_mask_and_stock_ops(rng):
    """Holes and right padding too; unmasked y and the state equal mlx-lm's
    ops fallback (which writes a discarded readout at masked steps)."""
    B, T = 2, 90
    arrs = make_inputs(rng, B=B, T=T, Hk=2, Hv=4)
    inp = to_mx(arrs)
    mask_np = rng.uniform(size=(B, T)) > 0.3
    mask_np[1, 80:] = False
    mask = mx.array(mask_np)
    y_c, S_c = gd.gated_delta_chunked(*inp, mask, chunk_size=32)
    y_s, S_s = stock.gated_delta_ops(*inp, mask)
    assert_fp32_close(np64(y_c)[mask_np], np64(y_s)[mask_np], "y (unmasked)")
    assert_fp32_close(S_c, S_s, "state")
    assert not np64(y_c)[~mask_np].any()


def test_all_masked_keeps_state(rng):
    arrs = make_inputs(rng, B=1, T=33, Hk=1, Hv=2)
    inp = to_mx(arrs)
    mask = mx.zeros((1, 33), dtype=mx.bool_)
    for fn in (gd.gated_delta_chunked, gd.gated_delta_recurrent):
        y, S = fn(*inp, mask)
        assert np.array_equal(np64(S), arrs[5].astype(np.float64))
        assert not np64(y).any()


# ---------------------------------------------- drop-in vs mlx-lm's stock


def _gate_inputs(rng, B, T, Hv, dtype):
    a = mx.array(rng.standard_normal((B, T, Hv)).astype(np.float32)).astype(dtype)
    b = mx.array(rng.standard_normal((B, T, Hv)).astype(np.float32)).astype(dtype)
    A_log = mx.array(np.log(rng.uniform(0.1, 8.0, Hv)).astype(np.float32))
    dt_bias = mx.array(rng.uniform(-1, 1, Hv).astype(np.float32)).astype(dtype)
    return a, b, A_log, dt_bias


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,masked", [(1, False), (1, True), (70, False), (70, True)])
def test_update_matches_stock(rng, T, masked, dtype):
    B, Hk, Hv = 2, 2, 4
    arrs = make_inputs(rng, B=B, T=T, Hk=Hk, Hv=Hv)
    q, k, v, _, _, S = to_mx(arrs, dtype)
    gates = _gate_inputs(rng, B, T, Hv, dtype)
    mask = None
    if masked:
        mask_np = _left_pad_mask(B, T, [0, min(T - 1, 9)]) if T > 1 else np.array([[True], [False]])
        mask = mx.array(mask_np)
    y, S_out = gd.gated_delta_update(q, k, v, *gates, S, mask)
    y_s, S_s = stock.gated_delta_update(q, k, v, *gates, S, mask)
    assert y.dtype == y_s.dtype == dtype and S_out.dtype == mx.float32
    assert y.shape == y_s.shape and S_out.shape == S_s.shape
    if masked:  # stock's ops fallback writes a discarded readout at padding
        keep = np.asarray(mask_np)
        y, y_s = np64(y)[keep], np64(y_s)[keep]
    if dtype == mx.bfloat16:
        assert_bf16_close(y, y_s, "y")
    else:
        assert_fp32_close(y, y_s, "y")
    assert_fp32_close(S_out, S_s, "state")


def test_update_kwargs_match_stock(rng):
    """lower_bound / allow_neg_eigval / use_kernel / state=None pass through."""
    B, T, Hk, Hv = 1, 40, 1, 2
    q, k, v, _, _, _ = to_mx(make_inputs(rng, B=B, T=T, Hk=Hk, Hv=Hv))
    gates = _gate_inputs(rng, B, T, Hv, mx.float32)
    kw = dict(lower_bound=-5.0, allow_neg_eigval=True, use_kernel=False)
    y, S = gd.gated_delta_update(q, k, v, *gates, None, None, **kw)
    y_s, S_s = stock.gated_delta_update(q, k, v, *gates, None, None, **kw)
    assert_fp32_close(y, y_s, "y")
    assert_fp32_close(S, S_s, "state")


def test_update_vector_gates_delegate_to_stock(rng):
    B, T, Hk, Hv, D = 1, 5, 1, 2, 32
    q, k, v, _, _, S = to_mx(make_inputs(rng, B=B, T=T, Hk=Hk, Hv=Hv, Dk=D, Dv=D))
    a = mx.array(rng.standard_normal((B, T, Hv, D)).astype(np.float32))
    b = mx.array(rng.standard_normal((B, T, Hv)).astype(np.float32))
    A_log = mx.array(np.log(rng.uniform(0.1, 8.0, (Hv, D))).astype(np.float32))
    dt_bias = mx.array(rng.uniform(-1, 1, (Hv, D)).astype(np.float32))
    y, St = gd.gated_delta_update(q, k, v, a, b, A_log, dt_bias, S)
    y_s, S_s = stock.gated_delta_update(q, k, v, a, b, A_log, dt_bias, S)
    assert np.array_equal(np64(y), np64(y_s)) and np.array_equal(np64(St), np64(S_s))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
def test_compute_gates_bitwise_stock(rng, dtype):
    a, b, A_log, dt_bias = _gate_inputs(rng, 2, 9, 4, dtype)
    g, beta = gd.compute_gates(a, b, A_log, dt_bias)
    assert g.dtype == mx.float32 and g.shape == (2, 9, 4)
    assert np.array_equal(np64(g), np64(stock.compute_g(A_log, a, dt_bias)))
    assert np.array_equal(np64(beta), np64(mx.sigmoid(b)))
    gn = np.asarray(g)
    assert ((gn > 0) & (gn <= 1)).all()


def test_compute_gates_names_bad_shapes(rng):
    """Wrong gate shapes are named, after a valid call too (the compiled gate
    expression is shapeless and would broadcast them into wrong numbers)."""
    a, b, A_log, dt_bias = _gate_inputs(rng, 1, 5, 4, mx.float32)
    mx.eval(gd.compute_gates(a, b, A_log, dt_bias))  # a valid call first: the compiled trace exists
    with pytest.raises(ValueError, match="dt_bias"):
        gd.compute_gates(a, b, A_log, dt_bias[:3])
    with pytest.raises(ValueError, match="A_log"):
        gd.compute_gates(a, b, mx.concatenate([A_log, A_log[:3]]), dt_bias)
    with pytest.raises(ValueError, match="b must"):
        gd.compute_gates(a, b[..., :3], A_log, dt_bias)
    with pytest.raises(ValueError, match="a must"):
        gd.compute_gates(a[0], b[0], A_log, dt_bias)
    q = mx.zeros((1, 5, 2, 8))
    v = mx.zeros((1, 5, 4, 8))
    with pytest.raises(ValueError, match="dt_bias"):
        gd.gated_delta_update(q, q, v, a, b, A_log, dt_bias[:3])


# ------------------------------------------------------------------ dispatch


def test_implementation_for(monkeypatch):
    assert set(gd.IMPLEMENTATIONS) == set(gd._TABLE)
    assert gd.implementation_for(1, "metal") == "mlx-lm-metal"
    assert gd.implementation_for(4096, "metal") == "mlx-lm-metal"
    monkeypatch.setattr(cb, "cuda_available", lambda: False)  # "cuda" without a CUDA device: as the CPU
    for be in ("cpu", "cuda"):
        assert gd.implementation_for(1, be) == "recurrent"
        assert gd.implementation_for(gd.RECURRENT_MAX_T, be) == "recurrent"
        assert gd.implementation_for(gd.RECURRENT_MAX_T + 1, be) == "chunked"
        assert gd.implementation_for(2048, be) == "chunked"
    monkeypatch.setattr(cb, "cuda_available", lambda: True)
    assert gd.implementation_for(1, "cuda") == gd.implementation_for(2048, "cuda") == gd.CUDA_KERNEL
    assert gd.implementation_for(2048, "cpu") == "chunked"
    for T in (1, 2048):
        assert gd.implementation_for(T) in gd.IMPLEMENTATIONS
    with pytest.raises(ValueError, match="backend"):
        gd.implementation_for(1, "tpu")


# -------------------------------------------------------------- validation


def _good(B=2, T=5, Hk=2, Hv=4, Dk=8, Dv=6):
    z = lambda *s: mx.zeros(s, mx.float32)  # noqa: E731
    return dict(
        q=z(B, T, Hk, Dk), k=z(B, T, Hk, Dk), v=z(B, T, Hv, Dv), g=z(B, T, Hv),
        beta=z(B, T, Hv), state=z(B, Hv, Dv, Dk), mask=mx.ones((B, T), mx.bool_),
    )


@pytest.mark.parametrize(
    "field,value,pattern",
    [
        ("q", mx.zeros((2, 5, 16)), r"q must have shape \[B, T, Hk, Dk\]"),
        ("k", mx.zeros((2, 5, 2, 8, 1)), r"k must have shape \[B, T, Hk, Dk\]"),
        ("k", mx.zeros((2, 4, 2, 8)), r"k must have shape .*mismatched B/T"),
        ("k", mx.zeros((2, 5, 2, 7)), r"k must have the same key dim Dk=8"),
        ("k", mx.zeros((2, 5, 1, 8)), r"k must have the same key head count"),
        ("v", mx.zeros((2, 5, 24)), r"v must have shape \[B, T, Hv, Dv\]"),
        ("v", mx.zeros((1, 5, 4, 6)), r"v must have shape .*mismatched B/T"),
        ("v", mx.zeros((2, 5, 3, 6)), r"Hv=3 must be a positive multiple of .*Hk=2"),
        ("g", mx.zeros((2, 5, 4, 8)), r"g must have shape \[B, T, Hv\] = \(2, 5, 4\)"),
        ("g", None, r"g must be an mx.array \[B, T, Hv\] \(float\), got None"),
        ("beta", None, r"beta must be an mx.array \[B, T, Hv\] \(float\), got None"),
        ("beta", mx.zeros((2, 5, 2)), r"beta must have shape \[B, T, Hv\] = \(2, 5, 4\)"),
        ("state", mx.zeros((2, 4, 8, 6)), r"state must have shape \[B, Hv, Dv, Dk\] = \(2, 4, 6, 8\)"),
        ("state", mx.zeros((2, 4, 6, 8), mx.bfloat16), r"state must have dtype float32"),
        ("mask", mx.ones((2, 4), mx.bool_), r"mask must have shape \[B, T\] = \(2, 5\)"),
        ("q", mx.zeros((2, 5, 2, 8), mx.int32), r"q must be a floating mx.array"),
        ("v", np.zeros((2, 5, 4, 6), np.float32),
         r"v must be an mx.array \[B, T, Hv, Dv\] \(float\), got numpy.ndarray float32 \(2, 5, 4, 6\)"),
    ],
)
@pytest.mark.parametrize("fn", ["gated_delta_recurrent", "gated_delta_chunked"])
def test_validation_errors(fn, field, value, pattern):
    args = _good()
    args[field] = value
    with pytest.raises(ValueError, match=pattern):
        getattr(gd, fn)(**args)


def _gate_args(B=2, T=5, Hv=4):
    return dict(a=mx.zeros((B, T, Hv)), b=mx.zeros((B, T, Hv)), A_log=mx.zeros((Hv,)), dt_bias=mx.zeros((Hv,)))


def _public_calls():
    """name -> (function, its array arguments (valid ones)) of the family's
    public functions that take arrays (gated_delta_net: its layer fixed)."""
    good, gates = _good(), _gate_args()
    update = dict(good, **gates)
    del update["g"], update["beta"]
    layer = gdn_layer(0, quantize=False)
    return {
        "gated_delta_recurrent": (gd.gated_delta_recurrent, good),
        "gated_delta_chunked": (gd.gated_delta_chunked, dict(good)),
        "gated_delta_update": (gd.gated_delta_update, update),
        "compute_gates": (gd.compute_gates, gates),
        "gated_delta_net": (lambda **kw: gd.gated_delta_net(layer, **kw),
                            dict(inputs=mx.zeros((2, 3, SMALL_ARGS.hidden_size)), mask=mx.ones((2, 3), mx.bool_))),
    }


@pytest.mark.parametrize("fn, arg, bad", [
    (fn, arg, bad) for fn, arrays in (
        ("gated_delta_recurrent", _good()), ("gated_delta_chunked", _good()),
        ("gated_delta_update", dict(q=0, k=0, v=0, a=0, b=0, A_log=0, dt_bias=0, state=0, mask=0)),
        ("compute_gates", _gate_args()), ("gated_delta_net", dict(inputs=0, mask=0)))
    for arg in arrays for bad in NOT_ARRAYS if not (bad == "None" and arg in ("state", "mask"))])
def test_public_functions_name_an_argument_that_is_not_an_array(fn, arg, bad):
    """A list, a numpy array or None where an mx.array is required: a
    ValueError naming the argument, its expected shape and what it got,
    not an AttributeError from inside."""
    function, arrays = _public_calls()[fn]
    make, got = NOT_ARRAYS[bad]
    arrays[arg] = make(arrays[arg])
    with pytest.raises(ValueError, match=rf"\b{arg} must be an mx.array \[.*\].*, got {got}"):
        function(**arrays)


def test_public_functions_take_the_valid_arguments_above():
    """The arguments the test above starts from pass every check."""
    for fn, (function, arrays) in _public_calls().items():
        mx.eval(function(**arrays))


@pytest.mark.parametrize("B, T", [(0, 5), (0, 1), (0, 0), (0, 40), (2, 0)])
def test_empty_batch_or_sequence_gives_empty_results(B, T):
    """B = 0 rows or T = 0 tokens through the public functions and the
    dispatch entries (but the CUDA kernel's: tests/kernels/test_input_checks.py):
    results of the contract's shapes and dtypes, with and without a state."""
    good, gates = _good(B=B, T=T), _gate_args(B=B, T=T)
    inp = [good[n] for n in ("q", "k", "v", "g", "beta", "state", "mask")]
    calls = [(n, f) for n, f in gd._TABLE.items() if n != gd.CUDA_KERNEL]
    calls += [("update", lambda q, k, v, g, beta, state, mask: gd.gated_delta_update(
        q, k, v, gates["a"], gates["b"], gates["A_log"], gates["dt_bias"], state, mask))]
    for name, fn in calls:
        for state, mask in ((inp[5], inp[6]), (None, None)):
            y, S = fn(*inp[:5], state, mask)
            mx.eval(y, S)
            assert y.shape == (B, T, 4, 6) and y.dtype == mx.float32, name
            assert S.shape == (B, 4, 6, 8) and S.dtype == mx.float32, name
    g, beta = gd.compute_gates(**gates)
    assert g.shape == beta.shape == (B, T, 4)


@pytest.mark.parametrize("B, S", [(0, 3), (2, 0), (0, 1)])
def test_layer_with_no_rows_or_no_tokens(B, S):
    """gated_delta_net on an empty batch or an empty sequence: the empty
    [B, S, D] output and the cache untouched (stock mlx-lm's layer raises
    from a reshape or the conv)."""
    layer = gdn_layer(0, quantize=True)
    cache = ArraysCache(size=2)
    out = gd.gated_delta_net(layer, mx.zeros((B, S, SMALL_ARGS.hidden_size)), cache=cache)
    assert out.shape == (B, S, SMALL_ARGS.hidden_size)
    assert cache[0] is None and cache[1] is None
    with pytest.raises(ValueError, match=r"inputs must have shape \[B, S, D\]"):
        gd.gated_delta_net(layer, mx.zeros((S, SMALL_ARGS.hidden_size)))


def test_validation_update_and_chunk_size():
    args = _good()
    with pytest.raises(ValueError, match="chunk_size must be a positive power of two"):
        gd.gated_delta_chunked(**args, chunk_size=48)
    a = mx.zeros((2, 5, 4))
    with pytest.raises(ValueError, match=r"state must have dtype float32"):
        gd.gated_delta_update(
            args["q"], args["k"], args["v"], a, a, mx.zeros((4,)), mx.zeros((4,)),
            args["state"].astype(mx.float16),
        )
    with pytest.raises(ValueError, match=r"b must have a's shape"):  # the argument, not the computed beta
        gd.gated_delta_update(
            args["q"], args["k"], args["v"], a, mx.zeros((2, 5, 3)),
            mx.zeros((4,)), mx.zeros((4,)),
        )


# ---------------------------------------------------------------------------
# the layer's decode step: plumbing with a stand-in kernel (any backend)
# ---------------------------------------------------------------------------

SMALL_ARGS = TextModelArgs(
    model_type="qwen3_5_moe_text", hidden_size=256, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=1, head_dim=64, vocab_size=64,
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4,
)


def _fake_kernel_math(qkv, z, a, b, conv_weight, conv_state, A_log, dt_bias, norm_weight, state,
                      *, num_v_heads, norm_eps):
    """The stand-in's arithmetic: the contract's shapes, every input used."""
    B, C = qkv.shape[0], qkv.shape[-1]
    x = qkv.reshape(B, 1, C)
    new_conv = mx.concatenate([conv_state[:, 1:], x], axis=1)
    mixed = (mx.concatenate([conv_state, x], axis=1) * conv_weight.reshape(C, -1).T).sum(1)
    hv = num_v_heads * 128
    gate = (a.reshape(B, -1) * A_log + b.reshape(B, -1) * dt_bias).sum(-1, keepdims=True)
    out = mixed[:, -hv:] * z.reshape(B, hv) * mx.tile(norm_weight, num_v_heads) + gate + norm_eps
    new_state = state * 0.5 + out.reshape(B, num_v_heads, 128, 1).astype(mx.float32)
    return out.reshape(B, 1, hv), new_conv, new_state


def fake_decode_kernel(proj, params, conv_state, state, *, num_k_heads, num_v_heads, norm_eps=1e-6, qk_eps=1e-6):
    """Stands in for the CUDA decode kernel: the pieces of proj and of params
    (``decode_params``' layout) at their offsets."""
    C, hv = (2 * num_k_heads + num_v_heads) * 128, num_v_heads * 128
    assert proj.shape[-1] == C + hv + 2 * num_v_heads
    assert params.dtype == mx.float32 and params.shape == (4 * C + 2 * num_v_heads + 128,)
    qkv, z = proj[..., :C], proj[..., C:C + hv]
    a, b = proj[..., C + hv:C + hv + num_v_heads], proj[..., C + hv + num_v_heads:]
    conv_weight, A_log = params[:4 * C].reshape(C, 4, 1), params[4 * C:4 * C + num_v_heads]
    dt_bias, norm_weight = params[4 * C + num_v_heads:4 * C + 2 * num_v_heads], params[4 * C + 2 * num_v_heads:]
    return _fake_kernel_math(qkv, z, a, b, conv_weight, conv_state, A_log, dt_bias, norm_weight, state,
                             num_v_heads=num_v_heads, norm_eps=norm_eps)


@pytest.fixture
def cpu_device():
    """The stand-in's results are compared with eager calls to fp32 rounding,
    which holds on the CPU device (on CUDA a dense fp32 matmul of
    concatenated projection weights rounds differently from the separate
    ones: relative differences up to 5e-5 on the H200): run there."""
    old = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(old)


@pytest.fixture
def fake_decode(cpu_device, monkeypatch):
    monkeypatch.setattr(gd, "implementation_for", lambda *_a, **_k: gd.CUDA_KERNEL)
    monkeypatch.setattr(k_decode, "supports", lambda *_a, **_k: True)
    monkeypatch.setattr(k_decode, "gated_delta_decode", fake_decode_kernel)
    monkeypatch.setattr(gd.cuda, "_decode_steps", {})  # traces of the stand-in stay out of the real cache


def gdn_layer(seed, quantize):
    mx.random.seed(seed)
    layer = GatedDeltaNet(SMALL_ARGS)
    if quantize:
        nn.quantize(layer, group_size=64, bits=4, class_predicate=lambda _p, m: isinstance(m, nn.Linear)
                    and m.weight.shape[0] % 32 == 0)
    mx.eval(layer.parameters())
    return layers.rebind(layer, layers.FastGatedDeltaNet)


def _eager(layer, x, cache, B=2):
    """The kernel between the projections called as modules (the reference of the compiled step)."""
    conv = cache[0] if cache[0] is not None else mx.zeros((B, 3, layer.conv_dim))
    st = cache[1] if cache[1] is not None else mx.zeros((B, 4, 128, 128))
    return gd._cuda_decode_modules(layer, x, conv, st, cache)


@pytest.mark.parametrize("quantize", [False, True])
def test_gdn_compiled_step_equals_eager(fake_decode, quantize):
    """Two layers through one trace, state carried over three steps. The four
    input projections run as one where they are alike (dense here; quantised,
    in_proj_a/b stay dense, so the step calls the projections as modules)."""
    for seed in (1, 2):
        layer = gdn_layer(seed, quantize)
        c_step, c_eager = ArraysCache(size=2), ArraysCache(size=2)
        for t in range(3):
            x = mx.random.normal((2, 1, SMALL_ARGS.hidden_size), key=mx.random.key(10 * seed + t))
            y = layer(x, cache=c_step)
            y_ref = _eager(layer, x, c_eager)
            assert mx.allclose(y, y_ref, rtol=1e-5, atol=1e-5).item()
            assert mx.allclose(c_step[1], c_eager[1], rtol=1e-5, atol=1e-5).item()
            assert mx.array_equal(c_step[0], c_eager[0]).item()
    plan = next(iter(StepPlans.of(layer)._plans.values()))[1]  # (objects, plan, links...)
    if quantize:
        assert plan == "modules"
    else:  # decode_params' array and the concatenated weight
        assert len(plan[2]) == 2
    # a replaced weight is read by the next call
    x = mx.random.normal((2, 1, SMALL_ARGS.hidden_size))
    y1 = layer(x, cache=ArraysCache(size=2))
    for mod, name in ((layer.norm, "weight"), (layer.conv1d, "weight"), (layer, "A_log"), (layer, "dt_bias")):
        # each of the constants decode_params packs (a copy)
        y0 = y1
        setattr(mod, name, getattr(mod, name) * 3 + 0.5)
        y1 = layer(x, cache=ArraysCache(size=2))
        assert not mx.allclose(y0, y1).item(), name
        y_ref = _eager(layer, x, ArraysCache(size=2))
        assert mx.allclose(y1, y_ref, rtol=1e-5, atol=1e-5).item(), name
    layer.in_proj_z.weight = layer.in_proj_z.weight * 2  # an input projection too
    y2 = layer(x, cache=ArraysCache(size=2))
    y_ref = _eager(layer, x, ArraysCache(size=2))
    assert not mx.allclose(y1, y2).item() and mx.allclose(y2, y_ref, rtol=1e-5, atol=1e-5).item()


def test_gdn_other_projection_kind_runs_the_modules(fake_decode):
    layer = gdn_layer(3, quantize=False)
    layer.in_proj_a = nn.Sequential(layer.in_proj_a)  # not a plain linear layer
    x = mx.random.normal((1, 1, SMALL_ARGS.hidden_size))
    y = layer(x, cache=ArraysCache(size=2))
    y_ref = _eager(layer, x, ArraysCache(size=2), B=1)
    assert mx.array_equal(y, y_ref).item()  # the same calls


def test_layer_takes_kernels_only_where_they_apply(monkeypatch):
    """The fused kernels run for a layer call only with the CUDA recurrence
    and no padding mask, no per-row cache lengths, no sharding."""
    layer = gdn_layer(4, quantize=False)
    monkeypatch.setattr(gd, "implementation_for", lambda *_a, **_k: gd.CUDA_KERNEL)
    cache = ArraysCache(size=2)
    assert gd._layer_takes_kernels(layer, 1, None, None)
    assert gd._layer_takes_kernels(layer, 64, None, cache)
    assert not gd._layer_takes_kernels(layer, 64, mx.ones((1, 64), mx.bool_), cache)
    cache.lengths = mx.array([3])
    assert not gd._layer_takes_kernels(layer, 64, None, cache)
    layer.sharding_group = object()
    assert not gd._layer_takes_kernels(layer, 64, None, None)
    layer.sharding_group = None
    monkeypatch.setattr(gd, "implementation_for", lambda *_a, **_k: "chunked")
    assert not gd._layer_takes_kernels(layer, 64, None, None)


# ---------------------------------------------------------------------------
# the whole layer on CUDA vs the stock layer (fused kernels)
# ---------------------------------------------------------------------------


def _run(layer, x, pieces):
    cache = ArraysCache(size=2)
    outs, start = [], 0
    for n in pieces:
        outs.append(layer(x[:, start : start + n], cache=cache))
        start += n
    mx.eval(outs, cache.state)
    return mx.concatenate(outs, axis=1).astype(mx.float32), cache


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("B,pieces", [(1, [1]), (1, [3, 1, 1]), (2, [64, 1]),
                                      (1, [65, 2, 1, 1]), (1, [2048, 1, 1])])
def test_fused_layer_matches_stock(dtype, B, pieces):
    """Real Qwen3.6-35B-A3B layer shapes, 4-bit projections: prefill across
    chunk boundaries with the cache carried, then decode steps. fp32: both
    compute the same function with fp32 accumulation in another order
    (compare.FP32_TOL). bf16: the stock layer rounds softplus/gates and
    intermediates to bf16 where the kernels keep fp32 (roundings=4)."""
    assert gd.implementation_for(64) == gd.CUDA_KERNEL
    seed = int(np.random.default_rng().integers(1 << 30))
    stock_layer = full_size_layer(seed, dtype)
    fast = layers.rebind(stock_layer, layers.FastGatedDeltaNet)
    x = (mx.random.normal((B, sum(pieces), FULL_ARGS.hidden_size)) * 0.5).astype(dtype)
    y_stock, c_stock = _run(stock_layer, x, pieces)
    y_fast, c_fast = _run(fast, x, pieces)
    tol = tolerance(dtype, roundings=4)
    assert_close(y_fast, y_stock, tol, f"seed {seed}: output")
    assert_close(c_fast[1], c_stock[1], tol, f"seed {seed}: recurrent state")
    assert_close(c_fast[0], c_stock[0], tol, f"seed {seed}: conv state")
    assert c_fast[1].dtype == mx.float32


def _eager_decode(layer, x, conv, st, cache):
    """The decode step's launches one by one, outside any trace: the four
    input projections as one concatenated projection, the decode kernel,
    out_proj, each projection through ops.linear's dispatcher (the fused
    GEMV where it applies, else the quantised matmul the modules call)."""
    from mlx_qwen_fast.compiled import concat_linears, linear_arrays
    from mlx_qwen_fast.ops import linear as linear_ops

    lins = [linear_arrays(getattr(layer, n)) for n in gd._PROJECTIONS]
    proj = linear_ops.decode_linear(x, *concat_linears(lins[:4]))
    params = k_contract.decode_params(layer.conv1d.weight, layer.A_log, layer.dt_bias, layer.norm.weight)
    out, conv, st = k_decode.gated_delta_decode(proj, params, conv, st, num_k_heads=layer.num_k_heads,
                                                num_v_heads=layer.num_v_heads, norm_eps=layer.norm.eps)
    gd._store(cache, conv, st, 1)
    return linear_ops.decode_linear(out, *lins[4])


@pytest.mark.cuda
@pytest.mark.parametrize("gemv", ["1", "0"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("B", [1, 2])
def test_compiled_decode_step_equals_eager(env, gemv, dtype, B):
    """The layer's mx.compile'd decode step (the four input projections as one
    concatenated projection, the kernel, then out_proj) gives the eager
    launches' results bit for bit, two layers through one trace, state
    carried over steps; a replaced weight is read. With the fused GEMV off
    the eager side is the projections called as modules (mlx-lm's
    quantised matmuls, concatenated), with it on the same GEMV launched
    eagerly."""
    env.set("MLX_QWEN_FAST_GEMV_KERNEL", gemv)
    eager = gd._cuda_decode_modules if gemv == "0" else _eager_decode
    seed = int(np.random.default_rng().integers(1 << 30))
    lays = [layers.rebind(full_size_layer(seed + i, dtype), layers.FastGatedDeltaNet) for i in range(2)]
    xs = (mx.random.normal((3, B, 1, FULL_ARGS.hidden_size)) * 0.5).astype(dtype)
    hv, dv, dk = lays[0].num_v_heads, lays[0].head_v_dim, lays[0].head_k_dim
    for layer in lays:
        c_fast, c_eager = ArraysCache(size=2), ArraysCache(size=2)
        for x in xs:
            y = layer(x, cache=c_fast)
            conv = c_eager[0] if c_eager[0] is not None else mx.zeros((B, 3, layer.conv_dim), dtype)
            st = c_eager[1] if c_eager[1] is not None else mx.zeros((B, hv, dv, dk), mx.float32)
            y_ref = eager(layer, x, conv, st, c_eager)
            mx.eval(y, y_ref, c_fast.state, c_eager.state)
            assert mx.array_equal(y, y_ref).item(), f"seed {seed}"
            assert mx.array_equal(c_fast[1], c_eager[1]).item() and mx.array_equal(c_fast[0], c_eager[0]).item()
    layer = lays[0]
    x = xs[0]
    y0 = layer(x, cache=ArraysCache(size=2))
    # doubling scales and biases doubles every dequantised weight exactly
    layer.out_proj.scales = layer.out_proj.scales * 2
    layer.out_proj.biases = layer.out_proj.biases * 2
    y1 = layer(x, cache=ArraysCache(size=2))
    mx.eval(y0, y1)
    assert mx.array_equal(y1, 2 * y0).item()
    # an input projection replaced: the plan re-concatenates it
    layer.in_proj_z.scales = layer.in_proj_z.scales * 2
    layer.in_proj_z.biases = layer.in_proj_z.biases * 2
    zero_conv = mx.zeros((B, 3, layer.conv_dim), dtype)
    zero_state = mx.zeros((B, hv, dv, dk), mx.float32)
    y2 = layer(x, cache=ArraysCache(size=2))
    y2_ref = eager(layer, x, zero_conv, zero_state, ArraysCache(size=2))
    mx.eval(y2, y2_ref)
    assert mx.array_equal(y2, y2_ref).item() and not mx.array_equal(y2, y1).item()


def _mixer_step_run(layer, norm_weight, xs, conv, st):
    """The layer's decode step from :func:`gd.decode_step_parts` (input norm
    fused) over the rows of ``xs``, states carried: (outputs, conv, state)."""
    cache = ArraysCache(size=2)
    cache[0], cache[1] = conv, st
    paths, fn, n_used, extra = gd.decode_step_parts(layer, xs[0], cache, input_norm_eps=1e-6,
                                                    input_norm_weight=norm_weight)
    arrays = gather(layer, paths[:n_used])
    ys = []
    for x in xs:
        y, conv, st = fn(x, conv, st, norm_weight, *arrays, *extra)
        mx.eval(y, conv, st)
        ys.append(y)
    return ys, conv, st


_MIXER_SOURCES = ("gdn_mixer_decode.cu", "gated_delta_decode.cu")


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("dtype", [
    pytest.param(mx.bfloat16, marks=pytest.mark.cpu_check(*_MIXER_SOURCES, "quantized_gemv.cu")),
    pytest.param(mx.float32, marks=pytest.mark.cpu_check(*_MIXER_SOURCES)),
])
@pytest.mark.parametrize("B", [1, 3])
def test_mixer_switch_runs_the_one_launch_mixer(env, monkeypatch, dtype, B):
    """With ``config.GDN_MIXER_KERNEL`` on, the layer's decode step
    (:func:`gd.decode_step_parts` with the decoder layer's input norm) runs
    the one-launch mixer; over three chained steps from random states its
    outputs and states equal the three launches' (the switch off): bf16 bit
    for bit (the same device code in the same order), fp32 within FP32_TOL
    (the three launches project on MLX's quantised matmul). With the fused
    GEMV off the switch is ignored."""
    from mlx_qwen_fast import config
    from mlx_qwen_fast.kernels import gdn_mixer_decode as k_mixer

    seed = int(np.random.default_rng().integers(1 << 30))
    layer = full_size_layer(seed, dtype, SMALL_ARGS)
    K, C = SMALL_ARGS.hidden_size, layer.conv_dim
    key = mx.random.key(seed)
    ks = mx.random.split(key, 4)
    norm_weight = (1.0 + 0.1 * mx.random.normal((K,), key=ks[0])).astype(dtype)
    xs = (2.0 * mx.random.normal((3, B, 1, K), key=ks[1])).astype(dtype)
    conv = mx.random.normal((B, 3, C), key=ks[2]).astype(dtype)
    st = 0.1 * mx.random.normal((B, layer.num_v_heads, 128, 128), key=ks[3])
    launched = []
    real = k_mixer.gdn_mixer_decode
    monkeypatch.setattr(k_mixer, "gdn_mixer_decode", lambda *a, **k: launched.append(1) or real(*a, **k))
    monkeypatch.setattr(gd.cuda, "_decode_steps", {})
    runs = {}
    for mixer, gemv in (("1", "1"), ("0", "1"), ("1", "0")):
        env.set(config.GDN_MIXER_KERNEL.name, mixer)
        env.set(config.DECODE_GEMV_KERNEL.name, gemv)
        launched.clear()
        runs[mixer, gemv] = _mixer_step_run(layer, norm_weight, xs, conv, st)
        assert bool(launched) == (mixer == gemv == "1"), (mixer, gemv, launched)
    (ys, c1, s1), (ys_ref, c_ref, s_ref) = runs["1", "1"], runs["0", "1"]
    tol = 0.0 if dtype == mx.bfloat16 else FP32_TOL
    for i, (y, y_ref) in enumerate(zip(ys, ys_ref)):
        assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
        assert_close(y, y_ref, tol, f"seed {seed}: step {i} output")
    assert_close(c1, c_ref, tol, f"seed {seed}: conv state")
    assert_close(s1, s_ref, tol, f"seed {seed}: recurrent state")
    assert s1.dtype == mx.float32


def test_metal_decode_kernel_runs_the_whole_tiny_model(env, gdn128):
    """Metal, simulated on the CPU (``tests/metal_model.py``'s
    ``metal_backend``: the backend seen as Metal, ``MLX_QWEN_FAST_METAL=1``,
    every ``metal_kernel`` -- the package's decode kernel and mlx-lm's
    recurrence kernels of the prompt -- run from MLX's generated source).
    The patched tiny model (128-wide GDN heads) called directly decodes 6
    greedy fp32 tokens identical to stock's (plain MLX ops), logits within
    fp32 tolerance; the decode kernel ran once per GDN layer and token, the
    prompt's recurrence on mlx-lm's kernel once per GDN layer. (Through
    ``generate_step``, with the report's accounting: ``test_metal_model.py``.)"""
    import metal_model as mm
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_qwen_fast import patched_copy
    from mlx_qwen_fast.checkpoint import build_model
    from mlx_qwen_fast.kernels import gated_delta_decode_metal as gdm

    if mm.metal_check.CXX is None:
        pytest.skip("no C++ compiler (g++) to build the Metal sources")
    stock_model, _ = build_model(gdn128, seed=4, dtype=mx.float32)
    prompt = mx.random.randint(1, 1000, (1, 9), key=mx.random.key(3))
    with mm.metal_backend(env) as run:
        fast, report = patched_copy(stock_model, warn=False)
        assert report.ops["gated_delta.decode"] == "metal-kernel"
        cs, cf = make_prompt_cache(stock_model), make_prompt_cache(fast)
        a, b = stock_model(prompt, cache=cs), fast(prompt, cache=cf)
        tok = mx.argmax(a[:, -1], -1)
        assert (tok == mx.argmax(b[:, -1], -1)).all().item()
        kernel = gdm._kernel()
        for step in range(6):
            a, b = stock_model(tok[:, None], cache=cs), fast(tok[:, None], cache=cf)
            mx.eval(a, b)
            assert_close(b, a, FP32_TOL, f"logits at step {step}")
            nxt = mx.argmax(a[:, -1], -1)
            assert (nxt == mx.argmax(b[:, -1], -1)).all().item(), f"token at step {step}"
            tok = nxt
    n_linear = sum(l.is_linear for l in fast.layers)
    prompt_kernels = [k for k in run.kernels if k.origin == "mlx_lm.models.gated_delta"]
    assert sum(k.calls for k in prompt_kernels) == n_linear  # the prompt: mlx-lm's Metal kernel once per GDN layer
    assert kernel.calls == 6 * n_linear


# ---------------------------------------------------------------------------
# per-step states (the speculative verify's rollback: mlx_qwen_fast/speculative.py)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("B, T", [(1, 1), (2, 2), (1, 6)])
def test_recurrent_steps_are_the_recurrence_after_every_token(rng, B, T):
    """gated_delta_recurrent_steps: y and the last state bit for bit
    gated_delta_recurrent's (the same loop; T = 1 there is a separately
    compiled graph: fp32 tolerance), and every step's state the float64
    loop's over that prefix."""
    arrs = make_inputs(rng, B=B, T=T, Hk=2, Hv=4, Dk=32, Dv=16)
    q, k, v, g, beta, S0 = to_mx(arrs)
    y, states = gd.gated_delta_recurrent_steps(q, k, v, g, beta, S0)
    y_ref, S_ref = gd.gated_delta_recurrent(q, k, v, g, beta, S0)
    assert len(states) == T and all(s.shape == S0.shape and s.dtype == mx.float32 for s in states)
    if T > 1:
        assert mx.array_equal(y, y_ref).item() and mx.array_equal(states[-1], S_ref).item()
    assert_fp32_close(y, y_ref, "y")
    for t in range(T):
        _, S_t = naive(*(x[:, :t + 1] for x in arrs[:5]), arrs[5])
        assert_fp32_close(states[t], S_t, f"state after step {t}")
    y0, none = gd.gated_delta_recurrent_steps(q[:, :0], k[:, :0], v[:, :0], g[:, :0], beta[:, :0], S0)
    assert y0.shape == (B, 0, 4, 16) and none == []
    with pytest.raises(ValueError, match=r"q must have shape \[B, T, Hk, Dk\]"):
        gd.gated_delta_recurrent_steps(q[0], k, v, g, beta, S0)
    with pytest.raises(ValueError, match=r"state must have dtype float32"):
        gd.gated_delta_recurrent_steps(q, k, v, g, beta, S0.astype(mx.bfloat16))


def test_layer_steps_are_the_layer_after_every_token():
    """gated_delta_net_steps: the layer's output and final cache as
    gated_delta_net's (fp32: recurrence vs chunked form), and each step's
    (conv, recurrent) state what gated_delta_net leaves after that many
    tokens; bad arguments are a ValueError naming them."""
    layer = gdn_layer(0, quantize=True)
    mx.random.seed(7)
    x = mx.random.normal((2, 5, SMALL_ARGS.hidden_size))
    warm = mx.random.normal((2, 3, SMALL_ARGS.hidden_size))

    def primed():
        c = ArraysCache(size=2)
        gd.gated_delta_net(layer, warm, cache=c)
        return c

    cache = primed()
    out, steps = gd.gated_delta_net_steps(layer, x, cache)
    assert len(steps) == 5 and steps[-1][0] is cache[0] and steps[-1][1] is cache[1]
    for t in range(1, 6):
        ref = primed()
        ref_out = gd.gated_delta_net(layer, x[:, :t], cache=ref)
        assert_close(out[:, :t], ref_out, FP32_TOL, f"output over {t} tokens")
        assert mx.array_equal(steps[t - 1][0], ref[0]).item(), t  # conv windows: the same values
        assert_close(steps[t - 1][1], ref[1], FP32_TOL, f"state after {t} tokens")
    with pytest.raises(ValueError, match="cache must be the layer's ArraysCache"):
        gd.gated_delta_net_steps(layer, x, None)
    padded = primed()
    padded.lengths = mx.array([5, 4])
    with pytest.raises(ValueError, match="cache must be the layer's ArraysCache without per-row lengths"):
        gd.gated_delta_net_steps(layer, x, padded)
    for bad in (x[0], x[:, :0]):
        with pytest.raises(ValueError, match=r"inputs must have shape \[B, S, D\] with B, S >= 1"):
            gd.gated_delta_net_steps(layer, bad, primed())
    with pytest.raises(ValueError, match=r"inputs must be an mx.array"):
        gd.gated_delta_net_steps(layer, [[0.0]], primed())
