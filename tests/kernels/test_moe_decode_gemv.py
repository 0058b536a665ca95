"""The decode MoE kernels (``kernels/moe_decode_gemv.py``: gate+up SwiGLU,
then down + routing weights + shared expert + combine, N <= 4 tokens) vs the
fp32 host reference (``references.moe_decode_reference``); the gate+up
build that routes the tokens itself vs the routing kernel
(``kernels/moe_routing.py`` ``route``), bit for bit, and the plain-MLX
softmax.

Shape checks, the launch rule's limits and a numpy emulation of the kernels'
mma fragment mapping run on any backend; the kernels on CUDA, outputs
poisoned with NaN before every launch, fresh random weights and inputs. (The
block-level decode path, ``ops.moe``'s "cuda-decode": tests/ops/test_moe.py.)

Bounds (compare.tolerance, bf16): the reference computes with the weights
``s*q+b`` in fp32 and rounds to bf16 where mlx-lm rounds; the kernels also
round each dequantised weight to bf16 once, and at the bf16 rounding points
(gate, up, SwiGLU, down outputs) a value may land one ulp apart: h, y and
the down kernel alone, roundings=2.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
import pytest

from compare import assert_close, finite, npa, tolerance
from moe_blocks import make_arrays, make_logits, make_routing, quant, x_tokens
from references import bf16_round, dequant_f32, moe_decode_reference
from mlx_qwen_fast.kernels import moe_decode_gemv as md
from mlx_qwen_fast.kernels import moe_routing as mr

TOL = tolerance(mx.bfloat16, roundings=2)


# ---------------------------------------------------------------------------
# host side (any backend)
# ---------------------------------------------------------------------------


def _bf16x2_dequant(word, s, b):
    """Kernel's dequant_word: 4 pairs (w[nib j], w[nib j+4]), w = bf16(s*q + b)."""
    q = np.array([(int(word) >> (4 * j)) & 15 for j in range(8)], np.float32)
    w = bf16_round(np.float32(s) * q + np.float32(b)).reshape(-1)
    return [(w[j], w[j + 4]) for j in range(4)]


def _emulate_rows(W, S, Bi, X, n_tok):
    """Numpy emulation of the kernels' lane/fragment mapping (mma_word, b_pairs).

    W [16, K/8] uint32, S/Bi [16, K/64] float32 (bf16 values), X [n_tok, K].
    Builds A (16x16), B (16x8) per mma from per-lane registers using the PTX
    m16n8k16 fragment layout and returns C = sum A @ B: [16, 8].
    """
    K = W.shape[1] * 8
    C = np.zeros((16, 8), np.float64)
    for u in range(K // 128):
        for wd in range(4):
            for half in range(2):
                A = np.zeros((16, 16))
                B = np.zeros((16, 8))
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    col = 16 * u + 4 * t + wd  # word index
                    grp = 2 * u + (t >> 1)
                    p0 = _bf16x2_dequant(W[g, col], S[g, grp], Bi[g, grp])
                    p1 = _bf16x2_dequant(W[g + 8, col], S[g + 8, grp], Bi[g + 8, grp])
                    j0 = 2 * half
                    A[g, 2 * t: 2 * t + 2] = p0[j0]          # a0
                    A[g + 8, 2 * t: 2 * t + 2] = p1[j0]      # a1
                    A[g, 2 * t + 8: 2 * t + 10] = p0[j0 + 1]  # a2
                    A[g + 8, 2 * t + 8: 2 * t + 10] = p1[j0 + 1]  # a3
                    if g < n_tok:
                        v = X[g, 128 * u + 32 * t + 8 * wd: 128 * u + 32 * t + 8 * wd + 8]
                        bb = [(v[0], v[4]), (v[1], v[5]), (v[2], v[6]), (v[3], v[7])]
                        B[2 * t: 2 * t + 2, g] = bb[j0]            # b0
                        B[2 * t + 8: 2 * t + 10, g] = bb[j0 + 1]   # b1
                C += A @ B
    return C


@pytest.mark.parametrize("n_tok", [1, 4])
def test_fragment_mapping_emulation(n_tok):
    """The permuted k order of the kernels' mma gives the plain dot products."""
    K = 256
    w, s, b = quant((16, K), seed=3 + n_tok)
    X = npa(x_tokens(n_tok, K, 9))
    W, S, Bi = np.asarray(w), npa(s), npa(b)
    C = _emulate_rows(W, S, Bi, X, n_tok)
    wdeq = bf16_round(np.float32(1.0) * dequant_f32(w, s, b))  # bf16(s*q + b)
    want = wdeq.astype(np.float64) @ X.T.astype(np.float64)
    np.testing.assert_allclose(C[:, :n_tok], want, rtol=1e-5, atol=1e-4)
    assert np.all(C[:, n_tok:] == 0)


def test_shape_errors_raise_before_compiling():
    experts, shared, eg = make_arrays(E=32, D=256, I=128)
    x = x_tokens(2, 256, 0)
    inds, scores = make_routing(2, 8, 32, 0)
    assert md.supports_arrays(x, inds, experts, shared, eg, scores)
    with pytest.raises(ValueError, match="x must be bfloat16"):
        md.gate_up_swiglu(x.astype(mx.float32), inds, experts, shared, eg)
    with pytest.raises(ValueError, match="1..4 tokens"):
        md.gate_up_swiglu(x_tokens(5, 256, 0), make_routing(5, 4, 32, 0)[0], experts, shared, eg)
    with pytest.raises(ValueError, match="inds"):
        md.gate_up_swiglu(x, inds[:1], experts, shared, eg)
    with pytest.raises(ValueError, match="N\\*k"):
        md.gate_up_swiglu(x, mx.zeros((2, 17), mx.int32), experts, shared, eg)
    with pytest.raises(ValueError, match="scores"):
        md.moe_decode_arrays(x, inds, scores.astype(mx.bfloat16), experts, shared, eg)
    with pytest.raises(ValueError, match="expert_gate"):
        md.gate_up_swiglu(x, inds, experts, shared, (eg[0], eg[1], eg[2], 3))
    bad8 = tuple(mx.quantize(mx.zeros((32, 128, 256)), group_size=64, bits=8))
    with pytest.raises(ValueError, match="experts gate/up"):
        md.gate_up_swiglu(x, inds, (bad8, experts[1], experts[2]), shared, eg)
    h = mx.zeros((2 * 8 + 2, 128), mx.bfloat16)
    sg = mx.zeros((2,), mx.float32)
    with pytest.raises(ValueError, match="h must be"):
        md.down_combine(h[:-1], inds, scores, sg, experts[2], shared[2])
    with pytest.raises(ValueError, match="sgate"):
        md.down_combine(h, inds, scores, sg[:1], experts[2], shared[2])
    with pytest.raises(ValueError, match="shared_down"):
        md.down_combine(h, inds, scores, sg, experts[2], shared[0])


def test_route_fits_limits():
    """The gate+up kernel routes for E a multiple of 32 up to
    ROUTE_MAX_EXPERTS = 512 and 1 <= top_k <= min(32, E); not above, not
    for other counts or non-int arguments."""
    assert md.ROUTE_MAX_EXPERTS == 512
    fits = {E: md.route_fits(E, 8) for E in (32, 96, 160, 256, 512, 544, 1024, 48, 0, -32)}
    assert fits == {32: True, 96: True, 160: True, 256: True, 512: True, 544: False, 1024: False, 48: False,
                    0: False, -32: False}
    assert md.route_fits(32, 32) and md.route_fits(256, 1) and md.route_fits(np.int64(256), np.int32(8))
    assert not md.route_fits(32, 33) and not md.route_fits(256, 0) and not md.route_fits(512, 33)
    assert not md.route_fits(256.0, 8) and not md.route_fits(256, 8.0) and not md.route_fits(256, True)


def test_route_gate_up_argument_errors(monkeypatch):
    """route_gate_up_swiglu / moe_decode_logits name the argument that does
    not fit before anything is built or launched (any backend)."""
    def no_build(*a, **k):
        raise AssertionError("a kernel was built for bad input")

    monkeypatch.setattr(md, "_kernel", no_build)
    experts, shared, eg = make_arrays(E=32, D=256, I=128)
    x = x_tokens(2, 256, 0)
    lg = mx.zeros((2, 32), mx.bfloat16)
    for fn in ("route_gate_up_swiglu", "moe_decode_logits"):
        call = getattr(md, fn)
        for args, match in [
            ((x.astype(mx.float32), lg, 8), "x must be bfloat16"),
            ((x[0], lg, 8), "x must be bfloat16"),
            ((x_tokens(5, 256, 0), mx.zeros((5, 32), mx.bfloat16), 4), "x must have 1..4 tokens"),
            ((x, lg.astype(mx.int32), 8), "logits must be float32/bfloat16/float16 \\[N=2, E\\]"),
            ((x, lg[:1], 8), "logits must be float32/bfloat16/float16 \\[N=2, E\\]"),
            ((x, lg.reshape(-1), 8), "logits must be"),
            ((x, [[0.0] * 32] * 2, 8), "logits must be"),
            ((x, mx.zeros((2, 48), mx.bfloat16), 8), "logits must have E columns"),
            ((x, mx.zeros((2, 544), mx.bfloat16), 8), "logits must have E columns.*ROUTE_MAX_EXPERTS=512\\], got E=544"),
            ((x, mx.zeros((2, 64), mx.bfloat16), 8), "logits must have one column per expert \\(E=32\\)"),
            ((x, lg, 0), "top_k must be an int"),
            ((x, lg, 33), "top_k must be an int"),
            ((x, lg, 8.0), "top_k must be an int"),
            ((x, lg, None), "top_k must be an int"),
            ((x, lg, 17), "N\\*k must be in \\[1, 32\\]"),
        ]:
            with pytest.raises(ValueError, match=f"{fn}: {match}"):
                call(*args, experts, shared, eg)
        with pytest.raises(ValueError, match=f"{fn}: expert_gate"):
            call(x, lg, 8, experts, shared, (eg[0], eg[1], eg[2], 3))
        bad8 = tuple(mx.quantize(mx.zeros((32, 128, 256)), group_size=64, bits=8))
        with pytest.raises(ValueError, match=f"{fn}: experts gate/up"):
            call(x, lg, 8, (bad8, experts[1], experts[2]), shared, eg)
        with pytest.raises(ValueError, match=f"{fn}: shared expert"):
            call(x, lg, 8, experts, (shared[2], shared[1], shared[2]), eg)


def test_route_gate_up_launch(monkeypatch):
    """The launches of the routing gate+up build and the down kernel after
    it (recorded stand-in kernels, any backend): the build's macros, logits
    as the second input, inds and scores as extra outputs shaped like the
    logits' rows (no reshape node for [N, 1, E]), ``normalize`` as the one
    scalar; the down kernel reads exactly those outputs. E = 544 is left to
    the routing kernel, and a [N*k + N, I] too large for the down kernel is
    only moe_decode_logits' error."""
    built, calls = [], []

    class Recorder:
        def __init__(self, filename, name, defs):
            self.name, self.defs = name, defs
            built.append(self)

        def __call__(self, inputs, output_shapes, output_dtypes, grid, threadgroup, shared_memory=0, scalars=()):
            outs = [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]
            calls.append(dict(kern=self, inputs=inputs, shapes=output_shapes, dtypes=output_dtypes, grid=grid,
                              block=threadgroup, smem=shared_memory, scalars=list(scalars), outs=outs))
            return outs

    monkeypatch.setattr(md.cb, "CudaKernel", Recorder)
    monkeypatch.setattr(md, "_kernels", {})
    n, k, E, D, I = 3, 8, 256, 256, 128
    experts, shared, eg = make_arrays(E=E, D=D, I=I)
    x = x_tokens(n, D, 1)
    logits = mx.zeros((n, E), mx.float32)
    h, sg, inds, scores = md.route_gate_up_swiglu(x, logits, k, experts, shared, eg, normalize=False)
    (c,) = calls
    assert c["kern"].name == "mqf_moe_dec_route_gate_up"
    assert c["kern"].defs == dict(MDG_KIND=0, MDG_N=n, MDG_K=k, MDG_D=D, MDG_I=I, MDG_SGB=8, MDG_ROUTE=1,
                                  MDG_E=E, MDG_LT="float")
    assert c["inputs"][0] is x and c["inputs"][1] is logits and len(c["inputs"]) == 17
    assert c["shapes"] == [(n * k + n, I), (n,), (n, k), (n, k)]
    assert c["dtypes"] == [mx.bfloat16, mx.float32, mx.int32, mx.float32]
    assert c["grid"] == ((I // 16) * 256, n * k + 2, 1) and c["block"] == (256, 1, 1)
    assert c["smem"] == md.gate_up_smem_bytes(n) and c["scalars"] == [0]
    assert all(a is b for a, b in zip((h, sg, inds, scores), c["outs"]))
    # the whole step on [N, 1, D] rows with the residual: one routing build, then the down kernel on its outputs
    calls.clear()
    res = mx.zeros((n, 1, D), mx.bfloat16)
    y = md.moe_decode_logits_unchecked(x[:, None], logits.astype(mx.bfloat16)[:, None], k, True, experts, shared, eg, res)
    gu, dn = calls
    assert gu["kern"].defs["MDG_LT"] == "bf16_t" and gu["scalars"] == [1]
    assert gu["shapes"][2:] == [(n, 1, k), (n, 1, k)]
    assert dn["kern"].name == "mqf_moe_dec_down" and dn["kern"].defs["MDG_RES"] == 1
    hh, sgg, ii, ss = gu["outs"]
    assert dn["inputs"][0] is hh and dn["inputs"][1] is ii and dn["inputs"][2] is ss and dn["inputs"][3] is sgg
    assert dn["inputs"][-1] is res and y.shape == (n, 1, D)
    # the gate+up alone takes a width the down kernel's shared memory does not
    calls.clear()
    wide = make_arrays(E=32, D=256, I=768)
    x4 = x_tokens(4, 256, 2)
    md.route_gate_up_swiglu(x4, mx.zeros((4, 32), mx.bfloat16), 8, *wide)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="moe_decode_logits: \\(N\\*k \\+ N\\) \\* I too large"):
        md.moe_decode_logits(x4, mx.zeros((4, 32), mx.bfloat16), 8, *wide)
    assert len(calls) == 1


def test_down_launch_fits_a_cta():
    """The down kernel's CTA (down_warps warps) is a valid launch for every
    call the kernels take: 1 to 32 warps (at most 1024 threads)."""
    for n in range(1, md.MAX_TOKENS + 1):
        for k in range(1, 32 // n + 1):
            for I in (128, 512, 768, 1024):
                w = md.down_warps(n, k, I)
                assert isinstance(w, int) and 1 <= w <= 32, (n, k, I, w)


# ---------------------------------------------------------------------------
# kernels (CUDA)
# ---------------------------------------------------------------------------


def check_kernels(n, E=64, D=2048, I=512, k=8, seed=0, gate_bits=8):
    experts, shared, eg = make_arrays(E, D, I, seed=seed, gate_bits=gate_bits)
    x = x_tokens(n, D, seed + 100)
    inds, scores = make_routing(n, k, E, seed + n)
    h, sgate = md.gate_up_swiglu(x, inds, experts, shared, eg)
    y = md.down_combine(h, inds, scores, sgate, experts[2], shared[2])
    mx.eval(h, sgate, y)
    assert h.shape == (n * k + n, I) and h.dtype == mx.bfloat16
    assert sgate.shape == (n,) and sgate.dtype == mx.float32
    assert y.shape == (n, D) and y.dtype == mx.bfloat16
    assert finite(h, sgate, y)  # every element written (outputs were NaN)
    h_ref, sg_ref, y_ref = moe_decode_reference(x, inds, scores, experts, shared, eg)
    assert_close(h, h_ref, TOL, "h")
    np.testing.assert_allclose(npa(sgate), sg_ref, atol=4e-3)  # bf16 logit may round apart
    assert_close(y, y_ref, TOL, "y")
    # the down kernel alone on the reference h and gate: only its own rounding
    y2 = md.down_combine(mx.array(h_ref).astype(mx.bfloat16), inds, scores, mx.array(sg_ref), experts[2], shared[2])
    assert_close(y2, y_ref, TOL, "y (down alone)")
    # deterministic: same bits on a second run
    y3 = md.moe_decode_arrays(x, inds, scores, experts, shared, eg)
    assert mx.array_equal(y3, y).item()
    # uint32 ids give the same result
    y4 = md.moe_decode_arrays(x, inds.astype(mx.uint32), scores, experts, shared, eg)
    assert mx.array_equal(y4, y).item()
    return x, inds, scores, experts, shared, eg, y


@pytest.mark.cuda
@pytest.mark.cpu_check("moe_decode_gemv.cu")
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("n,k,E,D,I,gate_bits", [(1, 8, 32, 256, 128, 8), (2, 8, 32, 256, 128, 4),
                                                 (3, 4, 16, 256, 256, 16), (4, 8, 32, 512, 128, 8),
                                                 (1, 11, 16, 256, 128, 8), (1, 32, 64, 256, 128, 8),
                                                 (2, 16, 32, 256, 128, 8)])
def test_kernels_small_shapes(n, k, E, D, I, gate_bits):
    """The small shapes the CPU check runs too (tests/cuda_check.py): 1-4
    tokens, top-k 4 to 32 (the down kernel's widest CTAs, every lane a
    pair), the three shared-gate widths, few experts."""
    check_kernels(n, E=E, D=D, I=I, k=k, seed=60 + n + k, gate_bits=gate_bits)


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_kernels_vs_reference(n):
    check_kernels(n, seed=10 * n)


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("gate_bits", [4, 16])
def test_kernels_shared_gate_variants(gate_bits):
    check_kernels(2, seed=7, gate_bits=gate_bits)


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
def test_kernels_full_expert_count_and_small_shape():
    check_kernels(4, E=256, seed=3)
    check_kernels(3, E=32, D=256, I=128, seed=4)


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
def test_kernels_all_tokens_same_experts():
    """Every token picks the same 8 experts: each expert computed once for all tokens."""
    experts, shared, eg = make_arrays(64, 2048, 512, seed=21)
    x = x_tokens(4, 2048, 22)
    inds = mx.array(np.tile(np.array([[5, 0, 63, 17, 9, 33, 2, 40]], np.int32), (4, 1))[:, ::-1].copy())
    scores = mx.array(np.full((4, 8), 1 / 8, np.float32))
    y = md.moe_decode_arrays(x, inds, scores, experts, shared, eg)
    assert finite(y)
    assert_close(y, moe_decode_reference(x, inds, scores, experts, shared, eg)[2], TOL, "y")


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("k", [4, 11])
def test_kernels_one_token_many_items(k):
    """One token with k + 1 items (5 and 12 here: the down kernel's widest CTAs)."""
    check_kernels(1, k=k, seed=50 + k)


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("n,k", [(1, 32), (2, 16)])
def test_kernels_32_pairs(n, k):
    """N*k = 32: every lane a pair; k = 32 takes the whole ballot as token 0's mask."""
    check_kernels(n, k=k, seed=40 + n)


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
def test_kernels_expert_repeated_within_token():
    """A token listing one expert twice (or three times): as gather_qmm, every
    pair counts (every h row written, the down output weighted by the sum)."""
    experts, shared, eg = make_arrays(64, 2048, 512, seed=51)
    x = x_tokens(2, 2048, 52)
    inds = mx.array(np.array([[7, 3, 7, 50, 3, 3, 0, 63], [3, 9, 9, 1, 2, 4, 5, 6]], np.int32))
    s = np.random.default_rng(53).random((2, 8)).astype(np.float32) + 0.05
    scores = mx.array(s / s.sum(1, keepdims=True))
    h, sgate = md.gate_up_swiglu(x, inds, experts, shared, eg)
    y = md.down_combine(h, inds, scores, sgate, experts[2], shared[2])
    assert finite(h, y)  # every h row written (outputs were NaN)
    h_ref, _, y_ref = moe_decode_reference(x, inds, scores, experts, shared, eg)
    assert_close(h, h_ref, TOL, "h")
    assert_close(y, y_ref, TOL, "y")


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("n", [1, 3])
def test_down_with_the_residual(n):
    """The down kernel's residual input (the decoder layer's ``h``): exactly
    ``bf16(h + y)`` of the same kernel's ``y`` without it (the same sums,
    one more rounding), for [n, D] and the decoder's [n, 1, D] rows."""
    x, inds, scores, experts, shared, eg, y = check_kernels(n, seed=40 + n)
    res = (4.0 * mx.random.normal(y.shape, key=mx.random.key(n))).astype(mx.bfloat16)
    got = md.moe_decode_arrays_unchecked(x, inds, scores, experts, shared, eg, res)
    want = (res.astype(mx.float32) + y.astype(mx.float32)).astype(mx.bfloat16)
    mx.eval(got, want)
    assert finite(got) and mx.array_equal(got, want).item()
    got3 = md.moe_decode_arrays_unchecked(x[:, None], inds[:, None], scores[:, None], experts, shared, eg, res[:, None])
    assert got3.shape == (n, 1, y.shape[-1]) and mx.array_equal(got3[:, 0], want).item()


# ---------------------------------------------------------------------------
# the gate+up build that routes (CUDA)
# ---------------------------------------------------------------------------

#: E -> (D, I) of the routing tests' weights: 256 the model's shape; 160 and
#: 96 not powers of two; the D = 256, I = 128 ones small enough for the CPU
#: check.
ROUTE_SHAPES = {256: (2048, 512), 128: (256, 128), 160: (512, 256), 96: (256, 128), 32: (256, 128),
                64: (256, 128), 512: (256, 128)}

#: The CPU-run parameter sets (tests/cuda_check.py) of the routing build:
#: check_routed launches it and the routing kernel it is compared with.
CPU_ROUTE = pytest.mark.cpu_check("moe_decode_gemv.cu", "moe_routing.cu")


@functools.lru_cache(maxsize=4)
def route_arrays(E):
    """Random decode-kernel weights for E experts (ROUTE_SHAPES), built once
    per process and expert count (the tests never modify them)."""
    D, I = ROUTE_SHAPES[E]
    return make_arrays(E, D, I, seed=E)


def route_logits(n, E, kind, seed, dtype=mx.bfloat16):
    """Router logits [n, E]: "skewed" (random, a few popular experts: the
    tokens share some), "ties" (values from {0, 1, 2, 3}, token 0's all
    equal: exact ties everywhere), "same" (one random row for every token:
    all tokens pick the same experts)."""
    if kind == "skewed":
        return make_logits(n, E, "skewed", seed, dtype)
    rng = np.random.default_rng(seed)
    if kind == "ties":
        lg = rng.integers(0, 4, size=(n, E)).astype(np.float32)
        lg[0] = 0.0
    else:
        lg = np.tile(rng.normal(size=(1, E)).astype(np.float32) * 2.0, (n, 1))
    return mx.array(lg).astype(dtype)


def check_routed(n, k, E, kind, seed, dtype=mx.bfloat16, normalize=True):
    """route_gate_up_swiglu and moe_decode_logits on fresh logits vs the
    routing kernel then the id-taking kernels (bit for bit), the plain-MLX
    softmax (the selection is a top-k, the weights its probabilities) and
    the fp32 host reference of the block's output."""
    experts, shared, eg = route_arrays(E)
    D = ROUTE_SHAPES[E][0]
    x = x_tokens(n, D, seed + 1)
    logits = route_logits(n, E, kind, seed, dtype)
    h, sg, inds, scores = md.route_gate_up_swiglu(x, logits, k, experts, shared, eg, normalize=normalize)
    ri, rs = mr.route(logits, k, normalize=normalize)
    mx.eval(h, sg, inds, scores, ri, rs)
    assert inds.shape == (n, k) and inds.dtype == mx.int32 and scores.shape == (n, k) and scores.dtype == mx.float32
    assert finite(h, sg, scores)  # every element written (outputs were NaN)
    ii = np.asarray(inds)
    assert ii.min() >= 0 and ii.max() < E and all(len(set(row)) == k for row in ii.tolist())
    # the routing kernel's selection and weights, bit for bit; then the same h and sgate
    assert np.array_equal(ii, np.asarray(ri)), (kind, ii, np.asarray(ri))
    assert mx.array_equal(scores, rs).item()
    h4, sg4 = md.gate_up_swiglu(x, ri, experts, shared, eg)
    assert mx.array_equal(h, h4).item() and mx.array_equal(sg, sg4).item()
    # the whole step (two launches) = the routing kernel + the two kernels (three), bit for bit
    y = md.moe_decode_logits(x, logits, k, experts, shared, eg, normalize=normalize)
    y4 = md.moe_decode_arrays(x, ri, rs, experts, shared, eg)
    assert finite(y) and mx.array_equal(y, y4).item()
    # plain MLX: a top-k of the fp32 softmax in decreasing order, weights = its probabilities
    probs = np.asarray(mx.softmax(logits.astype(mx.float32), axis=-1, precise=True))
    sel = np.take_along_axis(probs, ii, 1)
    if k < E:
        rest = probs.copy()
        np.put_along_axis(rest, ii, -1.0, 1)
        assert np.all(sel.min(1) >= rest.max(1) * (1 - 4e-6))
    want = sel / sel.sum(1, keepdims=True) if normalize else sel
    np.testing.assert_allclose(npa(scores), want, rtol=2e-6, atol=1e-7)
    assert np.all(np.diff(npa(scores), axis=1) <= 0)
    if kind == "ties":  # (logit descending, id ascending)
        lg = npa(logits)
        assert np.array_equal(ii, np.stack([np.lexsort((np.arange(E), -row))[:k] for row in lg]))
    if kind == "same":
        assert np.all(ii == ii[0])
    assert_close(y, moe_decode_reference(x, inds, scores, experts, shared, eg)[2], TOL, "y")
    return x, logits, ri, rs, y


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("E", [256, 128, 160])
@pytest.mark.parametrize("k", [8, 1, 3])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_route_in_gate_up_equals_the_routing_kernel(n, k, E):
    for i, kind in enumerate(("skewed", "ties", "same")):
        check_routed(n, k, E, kind, seed=1000 * n + 10 * k + E + i)


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("n,k,E", [pytest.param(n, k, E, marks=CPU_ROUTE if cpu else ()) for n, k, E, cpu in [
    (1, 1, 64, True), (1, 4, 32, False), (1, 8, 64, True), (2, 1, 32, False), (2, 4, 64, False),
    (2, 8, 128, True), (3, 1, 64, False), (3, 4, 128, True), (3, 8, 32, True), (4, 1, 64, True),
    (4, 4, 32, False), (4, 8, 64, False)]])
def test_route_in_gate_up_small_shapes(n, k, E):
    """The small shapes (half of them run by the CPU check too): every token
    count with top-k 1, 4 and 8, 32 to 128 experts (1 to 4 logits per lane),
    skewed logits, exact ties and tokens that all pick the same experts."""
    for i, kind in enumerate(("skewed", "ties", "same")):
        check_routed(n, k, E, kind, seed=500 * n + 10 * k + E + i)


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("n,k,E", [pytest.param(n, k, E, marks=CPU_ROUTE)
                                   for n, k, E in [(1, 32, 96), (1, 32, 32), (2, 16, 32), (4, 8, 512), (4, 2, 32)]])
def test_route_in_gate_up_limits(n, k, E):
    """N*k = 32 (top-k 32: every lane of a routing warp a slot; with E = 32
    every expert taken), the smallest and the largest expert count the
    build takes."""
    for i, kind in enumerate(("skewed", "ties", "same")):
        check_routed(n, k, E, kind, seed=7 * n + k + E + i)


CPU_ROUTE_BOTH = pytest.mark.cpu_check("moe_decode_gemv.cu", "moe_routing.cu")


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("dtype,normalize", [pytest.param(mx.float32, True, marks=CPU_ROUTE_BOTH),
                                             pytest.param(mx.float16, True, marks=CPU_ROUTE_BOTH),
                                             pytest.param(mx.bfloat16, False, marks=CPU_ROUTE_BOTH),
                                             (mx.float32, False), (mx.float16, False), (mx.bfloat16, True)])
def test_route_in_gate_up_logit_dtypes(dtype, normalize):
    for i, kind in enumerate(("skewed", "ties")):
        check_routed(3, 8, 128, kind, seed=31 + i, dtype=dtype, normalize=normalize)


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("n,E", [pytest.param(1, 64, marks=CPU_ROUTE), pytest.param(4, 64, marks=CPU_ROUTE),
                                 (1, 256), (4, 256)])
def test_route_in_gate_up_with_the_residual(n, E):
    """The decode step's form: [N, 1, D] rows, [N, 1, E] logits and the
    decoder layer's residual added by the down kernel, bit for bit the
    routing kernel's path of the same form."""
    x, logits, ri, rs, y = check_routed(n, 8, E, "skewed", seed=77 + n)
    experts, shared, eg = route_arrays(E)
    res = (4.0 * mx.random.normal((n, 1, y.shape[-1]), key=mx.random.key(n))).astype(mx.bfloat16)
    got = md.moe_decode_logits_unchecked(x[:, None], logits[:, None], 8, True, experts, shared, eg, res)
    want = md.moe_decode_arrays_unchecked(x[:, None], ri[:, None], rs[:, None], experts, shared, eg, res)
    mx.eval(got, want)
    assert got.shape == (n, 1, y.shape[-1]) and finite(got) and mx.array_equal(got, want).item()
    assert mx.array_equal(got[:, 0], (res[:, 0].astype(mx.float32) + y.astype(mx.float32)).astype(mx.bfloat16)).item()
