"""The decode MoE kernels (``kernels/moe_decode_gemv.py``: gate+up SwiGLU,
then down + routing weights + shared expert + combine, N <= 4 tokens) vs the
fp32 host reference (``references.moe_decode_reference``).

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

import mlx.core as mx
import numpy as np
import pytest

from compare import assert_close, finite, npa, tolerance
from moe_blocks import make_arrays, make_routing, quant, x_tokens
from references import bf16_round, dequant_f32, moe_decode_reference
from mlx_qwen_fast.kernels import moe_decode_gemv as md

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
    got = md._moe_decode_arrays(x, inds, scores, experts, shared, eg, res)
    want = (res.astype(mx.float32) + y.astype(mx.float32)).astype(mx.bfloat16)
    mx.eval(got, want)
    assert finite(got) and mx.array_equal(got, want).item()
    got3 = md._moe_decode_arrays(x[:, None], inds[:, None], scores[:, None], experts, shared, eg, res[:, None])
    assert got3.shape == (n, 1, y.shape[-1]) and mx.array_equal(got3[:, 0], want).item()
