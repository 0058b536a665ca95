"""CUDA Gated DeltaNet kernels vs fp32 references (needs an NVIDIA GPU).

Every test is marked ``cuda`` and skipped where MLX has no CUDA backend (CI).
Run on the GPU machine:

    source .mlxcuda/boot.sh && PYTHONPATH=. python3 -m pytest -q -m cuda tests/test_cuda_gated_delta.py

Outputs are poisoned with NaN before every launch (``set_poison``), inputs are
fresh random data, and the references are plain MLX ops in float32:
``ops.gated_delta.gated_delta_recurrent`` for the recurrence, mlx-lm's own
expressions for the conv / norms / gates.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from cuda_helpers import cuda, finite, needs_cuda, rel

pytestmark = [cuda, needs_cuda, pytest.mark.usefixtures("poison")]

D, HK, HV = 128, 16, 32
C = (2 * HK + HV) * D


def reference(q, k, v, g, beta, state, mask=None):
    f = mx.float32
    try:
        from mlx_qwen_fast.ops.gated_delta import gated_delta_recurrent as ref
    except Exception:  # ops.gated_delta missing or broken: mlx-lm fp32
        from mlx_lm.models.gated_delta import gated_delta_ops as ref
    return ref(q.astype(f), k.astype(f), v.astype(f), g, beta, state, mask)


def make_scan_inputs(B, T, decay, seed, dtype=mx.bfloat16):
    ks = mx.random.split(mx.random.key(seed), 6)
    q = mx.random.normal((B, T, HK, D), key=ks[0])
    k = mx.random.normal((B, T, HK, D), key=ks[1])
    q = q / mx.linalg.norm(q, axis=-1, keepdims=True) * D**-0.5
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((B, T, HV, D), key=ks[2])
    if decay == "strong":
        g = mx.random.uniform(0.05, 0.6, (B, T, HV), key=ks[3])
    elif decay == "mixed":  # weak decay with gates of 0, 1e-6, 1e-3 and 1e-2 scattered in
        g = 1.0 - mx.random.uniform(1e-4, 1e-2, (B, T, HV), key=ks[3])
        pick = mx.random.randint(0, 40, (B, T, HV), key=mx.random.key(seed + 1))
        for code, val in ((0, 0.0), (1, 1e-6), (2, 1e-3), (3, 1e-2), (4, 0.0099)):
            g = mx.where(pick == code, val, g)
    else:
        g = 1.0 - mx.random.uniform(1e-4, 1e-2, (B, T, HV), key=ks[3])
    beta = mx.random.uniform(0, 1, (B, T, HV), key=ks[4])
    s0 = 0.5 * mx.random.normal((B, HV, D, D), key=ks[5])
    # bf16-exact values, so fp32 and bf16 kernel runs see the same numbers
    q, k, v = (x.astype(mx.bfloat16).astype(dtype) for x in (q, k, v))
    return q, k, v, g, beta, s0


# ---------------------------------------------------------------------------
# scan
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("decay", ["strong", "weak"])
@pytest.mark.parametrize("B,T", [(1, 1), (1, 3), (2, 64), (1, 65), (2, 300), (1, 4096)])
def test_scan_matches_reference(B, T, decay, dtype):
    from mlx_qwen_fast.kernels.gated_delta_scan import gated_delta_scan, supports

    q, k, v, g, beta, s0 = make_scan_inputs(B, T, decay, seed=T * 7 + B, dtype=dtype)
    assert supports(q, k, v, g, beta, s0)
    y, s = gated_delta_scan(q, k, v, g, beta, s0)
    yr, sr = reference(q, k, v, g, beta, s0)
    mx.eval(y, s, yr, sr)
    assert y.dtype == dtype and s.dtype == mx.float32
    assert finite(y, s)
    assert rel(s, sr) < 1e-4
    assert rel(y, yr) < (1e-4 if dtype == mx.float32 else 1e-2)


EXTRA_CONFIGS = [(8, 2, 4, 32, 1, 1), (8, 2, 4, 64, 0, 1), (8, 2, 4, 32, 0, 4)]


@pytest.mark.parametrize(
    "config", [(8, 2, 4, 32, 1, 1), (8, 2, 4, 32, 0, 4), (8, 2, 4, 32, 1, 2), (16, 2, 8, 16, 1, 4),
               (8, 2, 4, 64, 0, 1), (8, 1, 4, 8, 0, 1)]
)
def test_scan_other_variants(config):
    from mlx_qwen_fast.kernels.gated_delta_scan import gated_delta_scan

    q, k, v, g, beta, s0 = make_scan_inputs(2, 67, "strong", seed=17, dtype=mx.float32)
    y, s = gated_delta_scan(q, k, v, g, beta, s0, config=config)
    yb, sb = gated_delta_scan(*(x.astype(mx.bfloat16) for x in (q, k, v)), g, beta, s0, config=config)
    yr, sr = reference(q, k, v, g, beta, s0)
    assert finite(y, s, yb, sb)
    assert rel(s, sr) < 1e-4 and rel(y, yr) < 1e-4
    assert rel(sb, sr) < 1e-4 and rel(yb, yr) < 1e-2


@pytest.mark.parametrize("config", [None] + EXTRA_CONFIGS)
@pytest.mark.parametrize("decay", ["mixed", "strong"])
@pytest.mark.parametrize("T", [7, 8, 9, 33, 200])
def test_scan_extreme_gates(config, decay, T):
    """Gates of exactly 0, 1e-6 and 1e-3 among weak ones, at stage and
    8-token boundaries (fp32 tolerances as everywhere)."""
    from mlx_qwen_fast.kernels.gated_delta_scan import gated_delta_scan

    q, k, v, g, beta, s0 = make_scan_inputs(1, T, decay, seed=T * 13 + 5, dtype=mx.float32)
    y, s = gated_delta_scan(q, k, v, g, beta, s0, config=config)
    yr, sr = reference(q, k, v, g, beta, s0)
    assert finite(y, s)
    assert rel(s, sr) < 1e-4 and rel(y, yr) < 1e-4


def test_scan_carry_over_two_calls():
    from mlx_qwen_fast.kernels.gated_delta_scan import gated_delta_scan

    q, k, v, g, beta, s0 = make_scan_inputs(2, 130, "weak", seed=3)
    ya, sa = gated_delta_scan(q[:, :67], k[:, :67], v[:, :67], g[:, :67], beta[:, :67], s0)
    yb, sb = gated_delta_scan(q[:, 67:], k[:, 67:], v[:, 67:], g[:, 67:], beta[:, 67:], sa)
    yr, sr = reference(q, k, v, g, beta, s0)
    assert rel(mx.concatenate([ya, yb], axis=1), yr) < 1e-2
    assert rel(sb, sr) < 1e-4


def test_scan_mask_and_zero_state():
    from mlx_qwen_fast.kernels.gated_delta_scan import gated_delta_scan

    q, k, v, g, beta, _ = make_scan_inputs(2, 40, "strong", seed=11, dtype=mx.float32)
    mask = mx.array([[False] * 6 + [True] * 34, [True] * 40])
    y, s = gated_delta_scan(q, k, v, g, beta, None, mask)
    yr, sr = reference(q, k, v, g, beta, mx.zeros((2, HV, D, D)), mask)
    assert rel(s, sr) < 1e-4 and rel(y, yr) < 1e-4
    assert mx.max(mx.abs(y[0, :6])).item() == 0.0


def test_scan_rejects_bad_shapes():
    from mlx_qwen_fast.kernels.gated_delta_scan import gated_delta_scan, supports

    q, k, v, g, beta, s0 = make_scan_inputs(1, 4, "weak", seed=1)
    with pytest.raises(ValueError, match="beta"):
        gated_delta_scan(q, k, v, g, beta[:, :, :16], s0)
    with pytest.raises(ValueError, match="state"):
        gated_delta_scan(q, k, v, g, beta, s0.astype(mx.bfloat16))
    q64 = mx.zeros((1, 4, HK, 64), mx.bfloat16)
    assert not supports(q64, q64, mx.zeros((1, 4, HV, 64), mx.bfloat16), g, beta, None)
    assert not supports(q, k, v, mx.zeros((1, 4, HV, D)), beta, s0)  # vector gates


# ---------------------------------------------------------------------------
# front end, gated norm
# ---------------------------------------------------------------------------


def fe_params(seed, dtype):
    ks = mx.random.split(mx.random.key(seed), 3)
    w = (0.5 * mx.random.normal((C, 4, 1), key=ks[0])).astype(dtype)
    A_log = mx.log(mx.random.uniform(0.1, 8.0, (HV,), key=ks[1]))
    dt_bias = mx.random.uniform(-1.0, 1.0, (HV,), key=ks[2]).astype(dtype)
    return w, A_log, dt_bias


def ref_frontend(qkv, a, b, w, cs, A_log, dt_bias, eps=1e-6):
    f = mx.float32
    B, T, _ = qkv.shape
    x = mx.concatenate([cs.astype(f), qkv.astype(f)], axis=1)
    conv = nn.Conv1d(C, C, 4, groups=C, bias=False)
    conv.weight = w.astype(f)
    o = nn.silu(conv(x))
    q = o[..., : HK * D].reshape(B, T, HK, D)
    k = o[..., HK * D: 2 * HK * D].reshape(B, T, HK, D)
    v = o[..., 2 * HK * D:].reshape(B, T, HV, D)
    q = q * mx.rsqrt((q * q).sum(-1, keepdims=True) + eps) * D**-0.5
    k = k * mx.rsqrt((k * k).sum(-1, keepdims=True) + eps)
    g = mx.exp(-mx.exp(A_log.astype(f)) * nn.softplus(a.astype(f) + dt_bias.astype(f)))
    return q, k, v, g, mx.sigmoid(b.astype(f)), x[:, -3:]


# T: one token, a few, the edges of a 16- and an 8-token tile, ragged ends.
@pytest.mark.parametrize("tt", [16, 8])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("B,T", [(1, 1), (2, 2), (1, 3), (1, 7), (1, 8), (1, 9), (1, 15), (1, 16),
                                 (1, 17), (2, 65), (1, 1000)])
def test_frontend_matches_reference(B, T, dtype, tt, monkeypatch):
    from mlx_qwen_fast.kernels import gated_delta_frontend as fe
    from mlx_qwen_fast.kernels.gated_delta_frontend import gated_delta_frontend, supports

    monkeypatch.setattr(fe, "TT", tt)  # tokens per warp (kernels are keyed by it)
    w, A_log, dt_bias = fe_params(T, dtype)
    ks = mx.random.split(mx.random.key(100 + T), 4)
    qkv = mx.random.normal((B, T, C), key=ks[0]).astype(dtype)
    a = mx.random.normal((B, T, HV), key=ks[1]).astype(dtype)
    b = mx.random.normal((B, T, HV), key=ks[2]).astype(dtype)
    cs = mx.random.normal((B, 3, C), key=ks[3]).astype(dtype)
    assert supports(qkv, cs, w, num_k_heads=HK, num_v_heads=HV)
    out = gated_delta_frontend(qkv, a, b, w, cs, A_log, dt_bias, num_k_heads=HK, num_v_heads=HV)
    ref = ref_frontend(qkv, a, b, w, cs, A_log, dt_bias)
    assert finite(*out)
    tol = 1e-5 if dtype == mx.float32 else 1e-2
    for name, o, r in zip(("q", "k", "v"), out[:3], ref[:3]):
        assert o.dtype == dtype and o.shape == r.shape, name
        assert rel(o, r) < tol, name
    assert rel(out[3], ref[3]) < 1e-5 and rel(out[4], ref[4]) < 1e-5
    assert rel(out[5], ref[5]) == 0.0


@pytest.mark.parametrize("layout", ["fp32 weight", "unaligned weight"])
def test_frontend_weight_layouts(layout):
    """The conv weight read with 16-byte loads (fp32 taps beside bf16
    activations) and with the scalar fallback (a row-contiguous view 8 bytes
    past a 16-byte boundary): both equal the reference, and the fallback is
    bit-identical to the vector path on the same values."""
    from mlx_qwen_fast.kernels.gated_delta_frontend import gated_delta_frontend

    T, dtype = 37, mx.bfloat16
    w, A_log, dt_bias = fe_params(900, dtype)
    ks = mx.random.split(mx.random.key(901), 4)
    qkv = mx.random.normal((1, T, C), key=ks[0]).astype(dtype)
    a = mx.random.normal((1, T, HV), key=ks[1]).astype(dtype)
    b = mx.random.normal((1, T, HV), key=ks[2]).astype(dtype)
    cs = mx.random.normal((1, 3, C), key=ks[3]).astype(dtype)
    kw = dict(num_k_heads=HK, num_v_heads=HV)
    if layout == "fp32 weight":
        w_test = w.astype(mx.float32)
    else:
        padded = mx.concatenate([mx.zeros((1, 4, 1), dtype), w])
        mx.eval(padded)
        w_test = padded[1:]  # a row-contiguous view 8 bytes past the buffer's start
    out = gated_delta_frontend(qkv, a, b, w_test, cs, A_log, dt_bias, **kw)
    ref = ref_frontend(qkv, a, b, w, cs, A_log, dt_bias)
    assert finite(*out)
    for name, o, r in zip(("q", "k", "v"), out[:3], ref[:3]):
        assert rel(o, r) < 1e-2, name
    if layout == "unaligned weight":
        base = gated_delta_frontend(qkv, a, b, w, cs, A_log, dt_bias, **kw)
        for i, (o, r) in enumerate(zip(out, base)):
            assert mx.array_equal(o, r).item(), i


# T: one token, one front-end tile (16) and its edges, a scan stage (32) and
# its edges, many stages with a ragged end, the model's 4K prompt.
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("T", [1, 2, 15, 16, 17, 31, 33, 64, 65, 1000, 4096])
def test_fused_prefill_equals_two_kernels(T, dtype):
    """Front end + scan in one launch: bit-identical to the two kernels (the
    same device code), over two chained calls (conv state and state carried),
    with None states first."""
    from mlx_qwen_fast.kernels.gated_delta_frontend import gated_delta_frontend
    from mlx_qwen_fast.kernels.gated_delta_prefill import gated_delta_prefill, supports
    from mlx_qwen_fast.kernels.gated_delta_scan import gated_delta_scan

    w, A_log, dt_bias = fe_params(400 + T, dtype)
    kw = dict(num_k_heads=HK, num_v_heads=HV)
    cs2 = st2 = cs1 = st1 = None
    for call in range(2):
        ks = mx.random.split(mx.random.key(500 + 7 * T + call), 3)
        qkv = mx.random.normal((1, T, C), key=ks[0]).astype(dtype)
        a = mx.random.normal((1, T, HV), key=ks[1]).astype(dtype)
        b = mx.random.normal((1, T, HV), key=ks[2]).astype(dtype)
        assert supports(qkv, cs1, w, st1, **kw)
        y1, st1, cs1 = gated_delta_prefill(qkv, a, b, w, cs1, A_log, dt_bias, st1, **kw)
        q, k, v, g, beta, cs2 = gated_delta_frontend(qkv, a, b, w, cs2, A_log, dt_bias, **kw)
        y2, st2 = gated_delta_scan(q, k, v, g, beta, st2)
        assert finite(y1, st1, cs1)
        for name, x, y in (("y", y1, y2), ("state", st1, st2), ("conv_state", cs1, cs2)):
            assert x.shape == y.shape and x.dtype == y.dtype, name
            assert mx.array_equal(x, y).item(), name


def test_fused_prefill_refuses_what_it_cannot_take():
    from mlx_qwen_fast.kernels import _cuda_build as cb
    from mlx_qwen_fast.kernels.gated_delta_prefill import gated_delta_prefill, supports

    w, A_log, dt_bias = fe_params(1, mx.bfloat16)
    kw = dict(num_k_heads=HK, num_v_heads=HV)
    B = cb.sm_count() // 128 + 1  # more scan blocks (128 per sequence) than SMs
    qkv = mx.zeros((B, 8, C), mx.bfloat16)
    ab = mx.zeros((B, 8, HV), mx.bfloat16)
    assert not supports(qkv, None, w, None, **kw)
    with pytest.raises(ValueError, match="SMs"):
        gated_delta_prefill(qkv, ab, ab, w, None, A_log, dt_bias, None, **kw)
    one = qkv[:1]
    assert not supports(one, None, w, mx.zeros((1, HV, D, D), mx.bfloat16), **kw)
    with pytest.raises(ValueError, match="state"):
        gated_delta_prefill(one, ab[:1], ab[:1], w, None, A_log, dt_bias, mx.zeros((1, HV, D, 64)), **kw)
    with pytest.raises(ValueError, match="qkv"):
        gated_delta_prefill(one[..., :64], ab[:1], ab[:1], w, None, A_log, dt_bias, None, **kw)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_gated_rms_norm_matches_mlx_lm(dtype):
    from mlx_lm.models.qwen3_next import Qwen3NextRMSNormGated

    from mlx_qwen_fast.kernels.gated_rms_norm import gated_rms_norm

    ks = mx.random.split(mx.random.key(5), 3)
    y = mx.random.normal((2, 37, HV, D), key=ks[0]).astype(dtype)
    z = mx.random.normal(y.shape, key=ks[1]).astype(dtype)
    w = (1 + 0.3 * mx.random.normal((D,), key=ks[2])).astype(dtype)
    m = Qwen3NextRMSNormGated(D, eps=1e-6)
    m.weight = w
    out, ref = gated_rms_norm(y, z, w, 1e-6), m(y, z)
    assert out.dtype == dtype and finite(out)
    assert rel(out, ref) < (1e-5 if dtype == mx.float32 else 4e-3)


# ---------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("B", [1, 2])
def test_decode_matches_reference(B, dtype):
    from mlx_lm.models.qwen3_next import Qwen3NextRMSNormGated

    from mlx_qwen_fast.kernels.gated_delta_decode import gated_delta_decode, supports

    w, A_log, dt_bias = fe_params(B, dtype)
    ks = mx.random.split(mx.random.key(200 + B), 7)
    qkv = mx.random.normal((B, 1, C), key=ks[0]).astype(dtype)
    z = mx.random.normal((B, 1, HV * D), key=ks[1]).astype(dtype)
    a = mx.random.normal((B, 1, HV), key=ks[2]).astype(dtype)
    b = mx.random.normal((B, 1, HV), key=ks[3]).astype(dtype)
    cs = mx.random.normal((B, 3, C), key=ks[4]).astype(dtype)
    s0 = 0.5 * mx.random.normal((B, HV, D, D), key=ks[5])
    wn = (1 + 0.3 * mx.random.normal((D,), key=ks[6])).astype(dtype)
    assert supports(qkv, s0, num_k_heads=HK, num_v_heads=HV)
    out, ncs, ns = gated_delta_decode(qkv, z, a, b, w, cs, A_log, dt_bias, wn, s0, num_k_heads=HK, num_v_heads=HV)
    q, k, v, g, beta, rcs = ref_frontend(qkv, a, b, w, cs, A_log, dt_bias)
    q, k, v = (x.astype(dtype) for x in (q, k, v))  # the kernel stores them in dtype
    y, rs = reference(q, k, v, g, beta, s0)
    m = Qwen3NextRMSNormGated(D, eps=1e-6)
    m.weight = wn
    ro = m(y.astype(dtype), z.reshape(B, 1, HV, D)).reshape(B, 1, HV * D)
    assert out.shape == (B, 1, HV * D) and out.dtype == dtype
    assert finite(out, ns, ncs)
    assert rel(ncs, rcs) == 0.0
    assert rel(ns, rs) < (1e-5 if dtype == mx.float32 else 1e-3)
    assert rel(out, ro) < (1e-4 if dtype == mx.float32 else 1.5e-2)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("B", [1, 2])
def test_decode_packed_equals_separate(B, dtype):
    """qkv, z, a, b read from one concatenated row (the packed input
    projection) and the constants from decode_params' fp32 array: bit for
    bit the kernel on the separate arrays (any float type of the constants),
    over two steps with the states carried; wrong proj widths and params
    are refused by name."""
    from mlx_qwen_fast.kernels.gated_delta_decode import (
        decode_params, gated_delta_decode, gated_delta_decode_packed, packed_width)

    w, A_log, dt_bias = fe_params(70 + B, dtype)
    nw = (1.0 + 0.1 * mx.random.normal((D,), key=mx.random.key(71))).astype(dtype)
    kw = dict(num_k_heads=HK, num_v_heads=HV)
    assert packed_width(HK, HV) == C + HV * D + 2 * HV
    cs1 = cs2 = st1 = st2 = None
    for step in range(2):
        proj = mx.random.normal((B, 1, packed_width(HK, HV)), key=mx.random.key(72 + 10 * B + step)).astype(dtype)
        qkv, z = proj[..., :C], proj[..., C:C + HV * D]
        a, b = proj[..., C + HV * D:C + HV * D + HV], proj[..., C + HV * D + HV:]
        o1, cs1, st1 = gated_delta_decode_packed(proj, decode_params(w, A_log, dt_bias, nw), cs1, st1, **kw)
        o2, cs2, st2 = gated_delta_decode(qkv, z, a, b, w, cs2, A_log, dt_bias, nw, st2, **kw)
        assert finite(o1, cs1, st1)
        for name, u, v in (("out", o1, o2), ("conv_state", cs1, cs2), ("state", st1, st2)):
            assert u.shape == v.shape and u.dtype == v.dtype, name
            assert mx.array_equal(u, v).item(), name
    params = decode_params(w, A_log, dt_bias, nw)
    with pytest.raises(ValueError, match="proj"):
        gated_delta_decode_packed(proj[..., 1:], params, None, None, **kw)
    with pytest.raises(ValueError, match="params"):
        gated_delta_decode_packed(proj, params[1:], None, None, **kw)
    with pytest.raises(ValueError, match="params"):
        gated_delta_decode_packed(proj, params.astype(mx.bfloat16), None, None, **kw)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("B", [1, 2])
def test_decode_compiled_equals_eager(B, dtype):
    """The mx.compile'd step is the same kernel: bit-identical results, over
    several chained steps (state and conv state carried), and None states."""
    from mlx_qwen_fast.kernels.gated_delta_decode import gated_delta_decode

    w, A_log, dt_bias = fe_params(B, dtype)
    ks = mx.random.split(mx.random.key(300 + B), 5)
    wn = (1 + 0.3 * mx.random.normal((D,), key=ks[0])).astype(dtype)
    kw = dict(num_k_heads=HK, num_v_heads=HV)
    ce, se, cc, sc = None, None, None, None
    for t in range(3):
        kt = mx.random.split(ks[1 + t], 4)
        qkv = mx.random.normal((B, 1, C), key=kt[0]).astype(dtype)
        z = mx.random.normal((B, 1, HV * D), key=kt[1]).astype(dtype)
        a = mx.random.normal((B, 1, HV), key=kt[2]).astype(dtype)
        b = mx.random.normal((B, 1, HV), key=kt[3]).astype(dtype)
        oe, ce, se = gated_delta_decode(qkv, z, a, b, w, ce, A_log, dt_bias, wn, se, **kw)
        oc, cc, sc = gated_delta_decode(qkv, z, a, b, w, cc, A_log, dt_bias, wn, sc, compiled=True, **kw)
        assert finite(oc, cc, sc)
        for x, y in ((oe, oc), (ce, cc), (se, sc)):
            assert x.shape == y.shape and x.dtype == y.dtype
            assert mx.array_equal(x, y).item()
    with pytest.raises(ValueError, match="state"):
        gated_delta_decode(qkv, z, a, b, w, cc, A_log, dt_bias, wn, sc[:, :4], compiled=True, **kw)
