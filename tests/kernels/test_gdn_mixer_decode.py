"""The one-launch Gated DeltaNet mixer (``kernels/gdn_mixer_decode.py``:
RMSNorm + input projection, the GDN decode step, out_proj + residual, with
grid barriers between the phases).

The argument checks and the constants' layout run on any backend. The
kernel, on CUDA (and the small shapes on the CPU through the CUDA check,
with every block resident and both thread schedules), against:

* the three kernels it fuses (``quantized_gemv`` with the norm,
  ``gated_delta_decode``, ``quantized_gemv`` with the residual), run on the
  same inputs: bf16 results equal bit for bit (same device code, same
  arithmetic order), chained steps each carrying its own states;
* the composition of those kernels' references (gdn_helpers.mixer_reference:
  fp32 MLX ops for fp32 activations; for bf16 the float64 GEMV reference with
  the kernel's rounding points, MLX's bf16 ``quantized_matmul`` on the CPU
  being only bf16-accurate itself).

Bounds (compare.tolerance) against the references: fp32 everything within
FP32_TOL. bf16: the projection's output may round the other way than the
reference's (1 rounding), which the conv state copies (1) and the state
follows through q/k/v's rounding (2); y takes the decode step's 5
(test_gated_delta_decode) after the projection's 1, and out adds out_proj's
result and the residual add: 8.

Outputs start as NaN (the ``poison`` fixture: MLX fills them with NaN
before the launch; unfilled otherwise), so an element the kernel does not
write fails ``finite``.
"""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest

from compare import assert_close, finite, tolerance
from gdn_helpers import NOT_ARRAYS, MixerArrays, mixer_arrays, mixer_reference
from launches_at_once import check_launches_at_once
from mlx_qwen_fast.kernels import _cuda_build as cb
from mlx_qwen_fast.kernels import gated_delta_contract as gdc
from mlx_qwen_fast.kernels import gated_delta_decode as gdd
from mlx_qwen_fast.kernels import gdn_mixer_decode as gm
from mlx_qwen_fast.kernels import quantized_gemv as qg

EPS = 1e-6
#: small structure: hidden 256, 2 key heads / 4 value heads of 128, out_proj 512 -> 256
SMALL = dict(K=256, hk=2, hv=4)
#: two warps per GEMV tile in both projections (hidden 1024, out_proj 1024 -> 1024)
TEAMS = dict(K=1024, hk=2, hv=8)
#: Qwen3.6-35B-A3B's layer
FULL = dict(K=2048, hk=16, hv=32)


def _arrays(shape, B, dtype, seed):
    return mixer_arrays(seed, B, shape["K"], shape["hk"], shape["hv"], dtype)


def _params(a: MixerArrays):
    return gm.mixer_params(a.conv_weight, a.A_log, a.dt_bias, a.norm_weight, a.input_norm_weight)


def _fused(a: MixerArrays, params, conv_state, state, x=None):
    return gm.gdn_mixer_decode(a.x if x is None else x, a.in_proj, params, conv_state, state, a.out_proj,
                               num_k_heads=a.hk, num_v_heads=a.hv, input_norm_eps=EPS)


def _three_kernels(a: MixerArrays, conv_state, state, x=None):
    """The same step as three launches (bf16 only: the GEMV takes bf16)."""
    x = a.x if x is None else x
    proj = qg.quantized_gemv(x, *a.in_proj, group_size=64, bits=4, norm_weight=a.input_norm_weight,
                             norm_eps=EPS)
    params = gdc.decode_params(a.conv_weight, a.A_log, a.dt_bias, a.norm_weight)
    y, conv_state, state = gdd.gated_delta_decode(proj, params, conv_state, state, num_k_heads=a.hk,
                                                  num_v_heads=a.hv)
    return qg.quantized_gemv(y, *a.out_proj, group_size=64, bits=4, residual=x), conv_state, state


def _next_x(a: MixerArrays, step: int):
    return (3.0 * mx.random.normal(a.x.shape, key=mx.random.key(1000 + step))).astype(a.x.dtype)


def _check_against_reference(a: MixerArrays, got, conv_state, state, x):
    out, ncs, ns = got
    ro, rcs, rs = mixer_reference(a, conv_state, state, x=x, input_norm_eps=EPS)
    dt = x.dtype
    assert out.shape == x.shape and out.dtype == dt and ncs.dtype == dt and ns.dtype == mx.float32
    assert finite(out, ncs, ns)
    assert_close(ncs, rcs, tolerance(dt, 1), "conv state")
    assert_close(ns, rs, tolerance(dt, 2), "state")
    assert_close(out, ro, tolerance(dt, 8), "out")


# ---------------------------------------------------------------------------
# host side (any backend)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_mixer_params_layout(dtype):
    """decode_params' array followed by the input RMSNorm weight, exact
    float32 copies at the offsets the kernel reads (params + C*4 + 2 Hv +
    128)."""
    a = _arrays(SMALL, 1, dtype, 1)
    p = _params(a)
    dp = gdc.decode_params(a.conv_weight, a.A_log, a.dt_bias, a.norm_weight)
    assert p.dtype == mx.float32 and p.shape == (gm.mixer_params_width(2, 4, 256),)
    assert mx.array_equal(p[:dp.size], dp).item()
    assert mx.array_equal(p[dp.size:], a.input_norm_weight.astype(mx.float32)).item()
    with pytest.raises(ValueError, match="input_norm_weight"):
        gm.mixer_params(a.conv_weight, a.A_log, a.dt_bias, a.norm_weight, a.input_norm_weight.reshape(2, -1))
    with pytest.raises(ValueError, match="input_norm_weight"):
        gm.mixer_params(a.conv_weight, a.A_log, a.dt_bias, a.norm_weight, [1.0])
    with pytest.raises(ValueError, match="conv_weight"):
        gm.mixer_params(a.conv_weight[:100], a.A_log, a.dt_bias, a.norm_weight, a.input_norm_weight)


def _bad_calls(a: MixerArrays, params):
    """(positional arguments, keyword arguments, the name the error must say)."""
    x, (w, s, b), (wo, so, bo) = a.x, a.in_proj, a.out_proj
    cs, st = a.conv_state, a.state
    heads = dict(num_k_heads=a.hk, num_v_heads=a.hv, input_norm_eps=EPS)

    def call(**kw):
        args = dict(x=x, in_proj=(w, s, b), params=params, conv_state=cs, state=st, out_proj=(wo, so, bo))
        return args | {k: v for k, v in kw.items() if k in args}, heads | {k: v for k, v in kw.items()
                                                                           if k not in args}

    return [
        (call(x=x.astype(mx.float16)), "x"),
        (call(x=mx.zeros((5, 1, 256), x.dtype)), "x"),
        (call(x=mx.zeros((2, 2, 256), x.dtype)), "x"),
        (call(x=x[..., :200]), "x"),
        (call(x=mx.zeros((4, 1, 8192), x.dtype)), "x"),
        (call(in_proj=(w, s)), "in_proj"),
        (call(in_proj=w), "in_proj"),
        (call(in_proj=(w[:-1], s, b)), r"in_proj\[0\]"),
        (call(in_proj=(w.astype(mx.int32), s, b)), r"in_proj\[0\]"),
        (call(in_proj=(w, s.astype(mx.float16), b)), r"in_proj\[1\]"),
        (call(in_proj=(w, s, b[:, :2])), r"in_proj\[2\]"),
        (call(out_proj=(wo[:, :8], so, bo)), r"out_proj\[0\]"),
        (call(out_proj=(wo, so[:-1], bo)), r"out_proj\[1\]"),
        (call(out_proj=(wo, so, bo.astype(mx.float16))), r"out_proj\[2\]"),
        (call(params=params[1:]), "params"),
        (call(params=params.astype(mx.bfloat16)), "params"),
        (call(conv_state=cs[:, :2]), "conv_state"),
        (call(conv_state=cs.astype(mx.int32)), "conv_state"),
        (call(state=st.astype(mx.bfloat16)), "state"),
        (call(state=st[:, :2]), "state"),
        (call(num_k_heads=3), "num_v_heads"),
        (call(num_k_heads=0), "num_v_heads"),
        (call(input_norm_eps=0.0), "input_norm_eps"),
        (call(norm_eps=1.5), "norm_eps"),
        (call(qk_eps=float("nan")), "qk_eps"),
        (call(bits=8), "bits"),
        (call(group_size=32), "group_size"),
        (call(after=[1.0]), "after"),
    ]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_bad_input_names_the_argument(no_launch, dtype):
    """Every argument outside the contract: a ValueError naming it, before
    any launch; the valid call reaches the launch."""
    a = _arrays(SMALL, 2, dtype, 2)
    params = _params(a)
    for (args, kw), name in _bad_calls(a, params):
        with pytest.raises(ValueError, match=name):
            gm.gdn_mixer_decode(**args, **kw)
    with pytest.raises(AssertionError, match="launched mqf_gdn_mixer"):
        _fused(a, params, a.conv_state, a.state)


@pytest.mark.parametrize("bad", sorted(NOT_ARRAYS))
def test_arguments_that_are_not_arrays_are_named(no_launch, bad):
    """A list, a numpy array or None where an mx.array is required (None
    allowed for the two states): a ValueError naming the argument and what
    it got."""
    a = _arrays(SMALL, 1, mx.float32, 3)  # (numpy takes no bfloat16)
    params = _params(a)
    make, got = NOT_ARRAYS[bad]
    args = dict(x=a.x, in_proj=a.in_proj, params=params, conv_state=a.conv_state, state=a.state,
                out_proj=a.out_proj)
    names = ["x", "params", "conv_state", "state"] + [f"{p}[{i}]" for p in ("in_proj", "out_proj") for i in range(3)]
    for name in names:
        if bad == "None" and name in ("conv_state", "state"):
            continue
        kw = dict(args)
        if "[" in name:
            p, i = name[:-3], int(name[-2])
            kw[p] = tuple(make(t) if j == i else t for j, t in enumerate(args[p]))
        else:
            kw[name] = make(args[name])
        with pytest.raises(ValueError, match=rf"{re.escape(name)}.* must be an mx.array .*got {got}"):
            gm.gdn_mixer_decode(**kw, num_k_heads=a.hk, num_v_heads=a.hv, input_norm_eps=EPS)


def test_supports(monkeypatch):
    """True for a valid call exactly where CUDA is available; False (never
    an error) outside the contract; asked as if on CUDA for the rest."""
    a = _arrays(SMALL, 2, mx.bfloat16, 4)
    heads = dict(num_k_heads=a.hk, num_v_heads=a.hv)
    assert gm.supports(a.x, a.in_proj, a.out_proj, a.state, **heads) == cb.cuda_available()
    monkeypatch.setattr(cb, "cuda_available", lambda: True)
    assert gm.supports(a.x, a.in_proj, a.out_proj, a.state, **heads)
    assert gm.supports(a.x, a.in_proj, a.out_proj, None, **heads)
    f32 = _arrays(SMALL, 2, mx.float32, 4)
    assert gm.supports(f32.x, f32.in_proj, f32.out_proj, f32.state, **heads)
    w, s, b = a.in_proj
    for x, inp, outp, st, kw in [
        (a.x.astype(mx.float16), a.in_proj, a.out_proj, a.state, {}),
        (mx.zeros((5, 1, 256), mx.bfloat16), a.in_proj, a.out_proj, None, {}),
        (a.x, (w, s), a.out_proj, a.state, {}),
        (a.x, (np.asarray(w), s, b), a.out_proj, a.state, {}),
        (a.x, a.in_proj, f32.out_proj, a.state, {}),
        (a.x, a.in_proj, a.out_proj, a.state[:1], {}),
        (a.x, a.in_proj, a.out_proj, [1.0], {}),
        (a.x, a.in_proj, a.out_proj, a.state, dict(bits=8)),
        (a.x, a.in_proj, a.out_proj, a.state, dict(mode="mxfp4")),
        (a.x, a.in_proj, a.out_proj, a.state, dict(num_k_heads=3)),
    ]:
        assert not gm.supports(x, inp, outp, st, **(heads | kw))


def test_grid_blocks():
    """One block per SM at most, no more than any phase can use: the
    model's layer fills an H100 (132 SMs); the small one takes its (row,
    head) items or its input-projection tiles over 16 one-warp teams."""
    assert gm.grid_blocks(1, 16, 32, 2048, 132) == 132
    assert gm.grid_blocks(4, 16, 32, 2048, 80) == 80
    assert gm.grid_blocks(1, 2, 4, 256, 132) == 7  # ceil(ceil(1544 / 16) / 16)
    assert gm.grid_blocks(4, 2, 4, 256, 132) == 16  # 4 rows x 4 heads
    assert gm.grid_blocks(1, 2, 4, 256, 3) == 3


# ---------------------------------------------------------------------------
# the kernel (CUDA; the small shapes also on the CPU through the CUDA check)
# ---------------------------------------------------------------------------


def _two_chained_steps(a):
    """Two steps of the fused kernel, the states carried from its first step
    and a new x each step, each checked against the references."""
    params = _params(a)
    cs, st, x = a.conv_state, a.state, a.x
    for step in range(2):
        got = _fused(a, params, cs, st, x)
        _check_against_reference(a, got, cs, st, x)
        _, cs, st = got
        x = _next_x(a, step)


@pytest.mark.cuda
@pytest.mark.cpu_check("gdn_mixer_decode.cu")
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("B", [1, 2, 3, 4])
def test_matches_reference(B, dtype):
    """Two chained steps (the states carried from the kernel's first step,
    a new x each step): each against the composition of the three fused
    kernels' references from the same inputs."""
    _two_chained_steps(_arrays(SMALL, B, dtype, 10 + B))


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("shape,B", [
    pytest.param(SMALL, 1, marks=pytest.mark.cpu_check("gdn_mixer_decode.cu", "quantized_gemv.cu",
                                                        "gated_delta_decode.cu")),
    pytest.param(SMALL, 4, marks=pytest.mark.cpu_check("gdn_mixer_decode.cu", "quantized_gemv.cu",
                                                        "gated_delta_decode.cu")),
    pytest.param(TEAMS, 3, marks=pytest.mark.cpu_check("gdn_mixer_decode.cu", "quantized_gemv.cu",
                                                        "gated_delta_decode.cu")),
    (FULL, 1),
    (FULL, 4),
])
def test_equals_three_kernels(shape, B):
    """bf16: the three launches' outputs bit for bit, over three chained
    steps where each path carries its own states (starting from none)."""
    a = _arrays(shape, B, mx.bfloat16, 20 + B)
    params = _params(a)
    fused, three = (None, None), (None, None)
    x = a.x
    for step in range(3):
        out_f, *fused = _fused(a, params, *fused, x=x)
        out_t, *three = _three_kernels(a, *three, x=x)
        assert finite(out_f, *fused)
        for what, f, t in (("out", out_f, out_t), ("conv state", fused[0], three[0]), ("state", fused[1], three[1])):
            assert f.shape == t.shape and f.dtype == t.dtype, what
            assert mx.array_equal(f, t).item(), f"step {step}: {what} differs from the three kernels'"
        x = _next_x(a, step)


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("dtype", [
    pytest.param(mx.float32, marks=pytest.mark.cpu_check("gdn_mixer_decode.cu")),
    pytest.param(mx.bfloat16, marks=pytest.mark.cpu_check("gdn_mixer_decode.cu", "quantized_gemv.cu",
                                                           "gated_delta_decode.cu")),
])
def test_few_blocks(monkeypatch, dtype):
    """A grid of 3 blocks (as on a GPU of 3 SMs): the teams take several
    input-projection tiles each (the next one's weights loaded while the
    last is summed), each block several (row, head) items; same results
    (bf16: the three kernels' bits; fp32: the references)."""
    monkeypatch.setattr(cb, "sm_count", lambda: 3)
    a = _arrays(SMALL, 3, dtype, 30)
    assert gm.grid_blocks(3, a.hk, a.hv, 256, cb.sm_count()) == 3
    got = _fused(a, _params(a), a.conv_state, a.state)
    if dtype == mx.bfloat16:
        want = _three_kernels(a, a.conv_state, a.state)
        assert all(mx.array_equal(g, w).item() for g, w in zip(got, want))
    else:
        _check_against_reference(a, got, a.conv_state, a.state, a.x)


@pytest.mark.cuda
@pytest.mark.cpu_check("gdn_mixer_decode.cu")
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("sms", [3, 5])
def test_partial_last_round_matches_reference(monkeypatch, sms):
    """bf16, grids of 3 and 5 blocks: several rounds of input-projection
    tiles over the grid's teams (team-major, team * blocks + block), the
    last one partial (out_proj's single round too), so some blocks' teams
    run a tile fewer; against the references."""
    monkeypatch.setattr(cb, "sm_count", lambda: sms)
    a = _arrays(SMALL, 2, mx.bfloat16, 40 + sms)
    assert gm.grid_blocks(2, a.hk, a.hv, 256, cb.sm_count()) == sms
    teams = sms * 16  # 16 one-warp teams per block at K = 256 and out_proj's K = 512
    tiles_a, tiles_c = -(-gdc.packed_width(a.hk, a.hv) // 16), 256 // 16
    assert tiles_a > teams and tiles_a % teams and tiles_c % teams  # rounds, the last partial
    _check_against_reference(a, _fused(a, _params(a), a.conv_state, a.state), a.conv_state, a.state, a.x)


@pytest.mark.cuda
@pytest.mark.cpu_check("gdn_mixer_decode.cu")
def test_after_input_is_not_read():
    """``after`` only orders the launch (MLX's graph edge from its writer):
    an array of another shape and dtype there leaves every output's bits as
    they are."""
    a = _arrays(SMALL, 1, mx.bfloat16, 41)
    params = _params(a)
    want = _fused(a, params, a.conv_state, a.state)
    got = gm.gdn_mixer_decode(a.x, a.in_proj, params, a.conv_state, a.state, a.out_proj, num_k_heads=a.hk,
                              num_v_heads=a.hv, input_norm_eps=EPS, after=mx.arange(7))
    assert finite(*got)
    assert all(g.shape == w.shape and mx.array_equal(g, w).item() for g, w in zip(got, want))


@pytest.mark.cuda
@pytest.mark.cpu_check("gdn_mixer_decode.cu")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_launches_in_a_row_need_no_filled_output(monkeypatch, dtype):
    """The barrier counter lives in the kernel's module and carries over
    launches on a GPU: five launches of one build in a row, with grids of 3
    blocks and of every SM alternating and the outputs left as allocated (no
    poison) or filled with NaN, give the same bits. (The CUDA check runs
    each launch in a process of its own: there the counter starts at zero
    every time.)"""
    a = _arrays(SMALL, 2, dtype, 40)
    params = _params(a)
    results = []
    try:
        for sms, poison in ((3, False), (None, False), (3, True), (None, True), (3, False)):
            if sms is not None:
                monkeypatch.setattr(cb, "sm_count", lambda: sms)
            else:
                monkeypatch.undo()
            cb.set_poison(poison)
            got = _fused(a, params, a.conv_state, a.state)
            mx.eval(got)
            results.append(got)
    finally:
        cb.set_poison(None)
    for got in results:
        assert finite(*got)
        assert all(mx.array_equal(g, w).item() for g, w in zip(got, results[0]))


@pytest.mark.cuda
@pytest.mark.parametrize("shape,launches,sms", [(SMALL, 12, 3), (SMALL, 6, None), (FULL, 4, None)])
def test_launches_at_once(monkeypatch, shape, launches, sms):
    """Independent launches of the mixer in one ``mx.eval``, each equal to
    its launch alone (:func:`launches_at_once.check_launches_at_once`)."""
    if sms is not None:
        monkeypatch.setattr(cb, "sm_count", lambda: sms)
    a = _arrays(shape, 2, mx.bfloat16, 42)
    params = _params(a)
    xs = [_next_x(a, i) for i in range(launches)]
    check_launches_at_once([lambda x=x: tuple(_fused(a, params, a.conv_state, a.state, x=x)) for x in xs])


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("B", [1, 4])
def test_full_size_matches_reference(B, dtype):
    """Qwen3.6-35B-A3B's layer (hidden 2048, 16 / 32 heads, P = 12352, 132
    blocks on an H100), two chained steps against the references."""
    _two_chained_steps(_arrays(FULL, B, dtype, 50 + B))


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_compiled_equals_eager(dtype):
    """Inside mx.compile (as a decode step runs it) the eager launch's bits,
    over chained steps."""
    a = _arrays(FULL, 2, dtype, 60)
    params = _params(a)
    kw = dict(num_k_heads=a.hk, num_v_heads=a.hv, input_norm_eps=EPS)
    compiled = mx.compile(lambda x, p, c, s, *w: gm.gdn_mixer_decode(x, w[:3], p, c, s, w[3:], **kw))
    ce = cc = a.conv_state
    se = sc = a.state
    x = a.x
    for step in range(3):
        oe, ce, se = gm.gdn_mixer_decode(x, a.in_proj, params, ce, se, a.out_proj, **kw)
        oc, cc, sc = compiled(x, params, cc, sc, *a.in_proj, *a.out_proj)
        for e, c in ((oe, oc), (ce, cc), (se, sc)):
            assert mx.array_equal(e, c).item()
        x = _next_x(a, step)


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("dtype", [
    pytest.param(mx.float32, marks=pytest.mark.cpu_check("gdn_mixer_decode.cu")),
    pytest.param(mx.bfloat16, marks=pytest.mark.cpu_check("gdn_mixer_decode.cu")),
])
def test_phase_clock_build(dtype):
    """The diagnostic build (phase_clock=True): the default build's results
    bit for bit, and per block the six marks' cycle counts from mark 0,
    non-decreasing (strictly on the CPU check, whose clock ticks once per
    read), the unused slots -1."""
    a = _arrays(SMALL, 2, dtype, 50)
    params = _params(a)
    want = _fused(a, params, a.conv_state, a.state)
    *got, clocks = gm.gdn_mixer_decode(a.x, a.in_proj, params, a.conv_state, a.state, a.out_proj,
                                       num_k_heads=a.hk, num_v_heads=a.hv, input_norm_eps=EPS, phase_clock=True)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype and mx.array_equal(g, w).item()
    blocks = gm.grid_blocks(2, a.hk, a.hv, a.x.shape[-1], cb.sm_count())
    assert clocks.shape == (blocks, 8) and clocks.dtype == mx.int64
    c = np.array(clocks)
    n = len(gm.PHASE_MARKS)
    assert (c[:, 0] == 0).all() and (np.diff(c[:, :n], axis=1) >= 0).all() and (c[:, n:] == -1).all()
    if not cb.cuda_available():
        assert (np.diff(c[:, :n], axis=1) > 0).all()
    with pytest.raises(ValueError, match="phase_clock must be a bool"):
        gm.gdn_mixer_decode(a.x, a.in_proj, params, a.conv_state, a.state, a.out_proj, num_k_heads=a.hk,
                            num_v_heads=a.hv, input_norm_eps=EPS, phase_clock=1)
