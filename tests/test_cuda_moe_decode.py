"""Fused decode MoE kernels (kernels/moe_decode_gemv.py) vs fp32 references.

Kernel tests are marked ``cuda`` and skipped where MLX has no CUDA backend; the
host-side parts (shape checks, ``supports``, the fp32 reference itself, and a
numpy emulation of the kernels' mma fragment mapping) run everywhere. On the
GPU machine:

    source .mlxcuda/boot.sh && PYTHONPATH=. python3 -m pytest -q tests/test_cuda_moe_decode.py

Outputs are poisoned with NaN before every launch (``set_poison``); weights
and inputs are fresh random draws. Tolerances:

- vs :func:`moe_decode_gemv.reference` (fp32 math on ``s*q+b``, bf16 rounding
  where mlx-lm rounds): ``2 * BF16_EPS`` relative L2. The kernels' only other
  difference is the bf16 rounding of each dequantised weight (one rounding,
  ~2^-9 relative per weight, averaged over 512-2048 inputs) and the
  accumulation order; the bf16 rounding points then flip by one ulp at a
  few elements.
- vs the ops/stock path (``gather_qmm`` on the same routing, bf16 routing
  weights and sums): ``GATHER_QMM_TOL = 0.06``, as tests/test_cuda_moe.py
  (gather_qmm's bf16 result is itself ~1.6e-2 from fp32 math per projection).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_qwen_fast.kernels import moe_decode_gemv as md
from mlx_qwen_fast.ops import moe

import moe_blocks  # tests/ is on sys.path
from cuda_helpers import BF16_EPS, GATHER_QMM_TOL, HAS_CUDA, cuda, finite, needs_cuda, npa, rel


def quant(shape, seed, scale=1.0, bits=4):
    """(weight, scales, biases) of a fresh bf16 random matrix, affine group 64."""
    K = shape[-1]
    w = mx.random.normal(shape, key=mx.random.key(seed)) * (scale / K**0.5)
    out = mx.quantize(w.astype(mx.bfloat16), group_size=64, bits=bits)
    mx.eval(*out)
    return tuple(out)


def make_arrays(E=64, D=2048, I=512, seed=0, gate_bits=8):
    experts = (quant((E, I, D), seed + 1), quant((E, I, D), seed + 2), quant((E, D, I), seed + 3))
    shared = (quant((I, D), seed + 4), quant((I, D), seed + 5), quant((D, I), seed + 6))
    if gate_bits == 16:
        w = (mx.random.normal((1, D), key=mx.random.key(seed + 7)) / D**0.5).astype(mx.bfloat16)
        eg = (w, w, w, 16)
    else:
        eg = (*quant((1, D), seed + 7, scale=2.0, bits=gate_bits), gate_bits)
    return experts, shared, eg


def make_routing(n, k, E, seed, special=True):
    """Distinct experts per token; tokens share experts; one token has 0 and E-1."""
    rng = np.random.default_rng(seed)
    rows = []
    for t in range(n):
        if t > 0 and special:  # overlap with token 0: duplicates across tokens
            keep = list(rng.choice(rows[0], size=min(3, k), replace=False))
            rest = [e for e in rng.permutation(E) if e not in keep][: k - len(keep)]
            row = keep + rest
        else:
            row = list(rng.choice(E, size=k, replace=False))
        rng.shuffle(row)
        rows.append(row)
    if special:  # the last token picks expert 0 and expert E-1
        r = rows[-1]
        for want, slot in ((0, 0), (E - 1, k - 1)):
            if want in r:
                r.remove(want)
            else:
                r.pop(slot if slot < len(r) else -1)
            r.insert(slot if slot < len(r) else len(r), want)
        assert len(set(r)) == k and 0 in r and E - 1 in r
    inds = mx.array(np.array(rows, dtype=np.int32))
    s = rng.random((n, k)).astype(np.float32) + 0.05
    scores = mx.array(s / s.sum(1, keepdims=True))
    return inds, scores


def x_tokens(n, D, seed):
    return (mx.random.normal((n, D), key=mx.random.key(seed)) * 1.5).astype(mx.bfloat16)


# ---------------------------------------------------------------------------
# host side (runs everywhere)
# ---------------------------------------------------------------------------


def test_dequant_f32_matches_mx_dequantize():
    for bits in (4, 8):
        w = mx.random.normal((3, 64, 256), key=mx.random.key(bits))
        wq, s, b = mx.quantize(w, group_size=64, bits=bits)  # fp32 scales
        ref = np.asarray(mx.dequantize(wq, s, b, group_size=64, bits=bits, stream=mx.cpu))
        np.testing.assert_allclose(md.dequant_f32(wq, s, b, bits=bits), ref, rtol=1e-6, atol=1e-6)


def test_reference_matches_fp32_ops():
    """The reference, with the block's bf16 arrays, is fp32 math up to bf16 rounding points."""
    block = moe_blocks.make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16)
    arrs = md.block_arrays(block)
    assert arrs is not None and arrs[2][3] == 8
    x = x_tokens(3, 256, 5)
    inds, scores = moe.route(block.gate(x), 8)
    h, sgate, y = md.reference(x, inds, scores, *arrs)
    block.set_dtype(mx.float32)  # same values, fp32 math in the ops path
    xf = x.astype(mx.float32)
    sm = block.switch_mlp
    groups = moe.group_by_expert(inds, 32)
    ref = moe.combine(moe.expert_swiglu(xf, groups, sm.gate_proj, sm.up_proj, sm.down_proj), scores)
    ref = ref + moe.shared_expert(block, xf)
    assert rel(y, ref) < 2 * BF16_EPS
    sg = mx.sigmoid(block.shared_expert_gate(xf))[:, 0]
    np.testing.assert_allclose(sgate, npa(sg), atol=4e-3)


def _bf16x2_dequant(word, s, b):
    """Kernel's dequant_word: 4 pairs (w[nib j], w[nib j+4]), w = bf16(s*q + b)."""
    q = np.array([(int(word) >> (4 * j)) & 15 for j in range(8)], np.float32)
    w = md.bf16_round(np.float32(s) * q + np.float32(b)).reshape(-1)
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
    wdeq = md.bf16_round(np.float32(1.0) * md.dequant_f32(w, s, b))  # bf16(s*q + b)
    want = wdeq.astype(np.float64) @ X.T.astype(np.float64)
    np.testing.assert_allclose(C[:, :n_tok], want, rtol=1e-5, atol=1e-4)
    assert np.all(C[:, n_tok:] == 0)


def test_supports_shapes_and_backend():
    block = moe_blocks.make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16)
    for n in (1, 2, 3, 4):
        assert md._supports_shapes(block, mx.zeros((n, 256), mx.bfloat16))
    assert md._supports_shapes(block, mx.zeros((1, 2, 256), mx.bfloat16))
    assert not md._supports_shapes(block, mx.zeros((5, 256), mx.bfloat16))  # N > 4
    assert not md._supports_shapes(block, mx.zeros((2, 256), mx.float32))  # not bf16
    small = moe_blocks.make_block(D=128, H=128, E=32, k=8, dtype=mx.bfloat16)
    assert not md._supports_shapes(small, mx.zeros((1, 128), mx.bfloat16))  # D % 256
    odd = moe_blocks.make_block(D=256, H=64, E=32, k=8, dtype=mx.bfloat16)
    assert not md._supports_shapes(odd, mx.zeros((1, 256), mx.bfloat16))  # I % 128
    f32 = moe_blocks.make_block(D=256, H=128, E=32, k=8, dtype=mx.float32)
    assert not md._supports_shapes(f32, mx.zeros((1, 256), mx.bfloat16))  # fp32 scales
    block.sharding_group = object()
    assert not md._supports_shapes(block, mx.zeros((1, 256), mx.bfloat16))
    block.sharding_group = None
    if not HAS_CUDA:
        assert not md.supports(block, mx.zeros((1, 256), mx.bfloat16))


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
    h_ref, sg_ref, y_ref = md.reference(x, inds, scores, experts, shared, eg)
    assert rel(h, h_ref) < 2 * BF16_EPS
    np.testing.assert_allclose(npa(sgate), sg_ref, atol=4e-3)  # bf16 logit may round apart
    assert rel(y, y_ref) < 2 * BF16_EPS
    # the down kernel alone on the reference h and gate: only its own rounding
    y2 = md.down_combine(mx.array(h_ref).astype(mx.bfloat16), inds, scores, mx.array(sg_ref), experts[2], shared[2])
    assert rel(y2, y_ref) < 2 * BF16_EPS
    # deterministic: same bits on a second run
    y3 = md.moe_decode_arrays(x, inds, scores, experts, shared, eg)
    assert mx.array_equal(y3, y).item()
    # uint32 ids give the same result
    y4 = md.moe_decode_arrays(x, inds.astype(mx.uint32), scores, experts, shared, eg)
    assert mx.array_equal(y4, y).item()
    return x, inds, scores, experts, shared, eg, y


@cuda
@needs_cuda
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_kernels_vs_reference(poison, n):
    check_kernels(n, seed=10 * n)


@cuda
@needs_cuda
@pytest.mark.parametrize("gate_bits", [4, 16])
def test_kernels_shared_gate_variants(poison, gate_bits):
    check_kernels(2, seed=7, gate_bits=gate_bits)


@cuda
@needs_cuda
def test_kernels_full_expert_count_and_small_shape(poison):
    check_kernels(4, E=256, seed=3)
    check_kernels(3, E=32, D=256, I=128, seed=4)


@cuda
@needs_cuda
def test_kernels_all_tokens_same_experts(poison):
    """Every token picks the same 8 experts: each expert computed once for all tokens."""
    experts, shared, eg = make_arrays(64, 2048, 512, seed=21)
    x = x_tokens(4, 2048, 22)
    inds = mx.array(np.tile(np.array([[5, 0, 63, 17, 9, 33, 2, 40]], np.int32), (4, 1))[:, ::-1].copy())
    scores = mx.array(np.full((4, 8), 1 / 8, np.float32))
    y = md.moe_decode_arrays(x, inds, scores, experts, shared, eg)
    assert finite(y)
    assert rel(y, md.reference(x, inds, scores, experts, shared, eg)[2]) < 2 * BF16_EPS


@cuda
@needs_cuda
@pytest.mark.parametrize("k", [4, 11])
def test_kernels_one_token_warp_per_item(poison, k):
    """One token: the down kernel runs k + 1 warps (5 and 12 here), one per item."""
    assert md.down_warps(1, k, 512) == k + 1
    check_kernels(1, k=k, seed=50 + k)


@pytest.mark.parametrize("n,k,I,warps", [(1, 8, 512, 9), (1, 4, 512, 5), (1, 11, 512, 12), (1, 11, 768, 12),
                                         (1, 12, 512, 8), (1, 8, 1024, 8), (2, 4, 512, 8), (4, 8, 512, 8)])
def test_down_warps(n, k, I, warps):
    """Host rule (no GPU): one warp per item at one token up to 12 warps and I <= 768, else 8."""
    assert md.down_warps(n, k, I) == warps


@cuda
@needs_cuda
@pytest.mark.parametrize("n,k", [(1, 32), (2, 16)])
def test_kernels_32_pairs(poison, n, k):
    """N*k = 32: every lane a pair; k = 32 takes the whole ballot as token 0's mask."""
    check_kernels(n, k=k, seed=40 + n)


@cuda
@needs_cuda
def test_kernels_expert_repeated_within_token(poison):
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
    h_ref, _, y_ref = md.reference(x, inds, scores, experts, shared, eg)
    assert rel(h, h_ref) < 2 * BF16_EPS
    assert rel(y, y_ref) < 2 * BF16_EPS


@cuda
@needs_cuda
@pytest.mark.parametrize("n", [1, 4])
def test_moe_decode_block_vs_ops_and_stock(poison, n):
    block = moe_blocks.make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16)
    x = (mx.random.normal((1, n, 256), key=mx.random.key(n)) * 1.5).astype(mx.bfloat16)
    assert md.supports(block, x)
    got = md.moe_decode(block, x)
    assert got.shape == x.shape and got.dtype == mx.bfloat16 and finite(got)
    # same routing through the ops path (gather_qmm, fp32 combine)
    from mlx_qwen_fast.kernels import moe_routing as mr

    tok = x.reshape(n, 256)
    inds, scores = mr.route(block.gate(tok), 8)
    sm = block.switch_mlp
    groups = moe.group_by_expert(inds, 32)
    ref = moe.combine(moe.expert_swiglu(tok, groups, sm.gate_proj, sm.up_proj, sm.down_proj), scores, dtype=mx.float32)
    ref = ref + moe.shared_expert(block, tok).astype(mx.float32)
    assert rel(got.reshape(n, 256), ref) < GATHER_QMM_TOL
    assert rel(got.reshape(n, 256), md.reference(tok, inds, scores, *md.block_arrays(block))[2]) < 2 * BF16_EPS
    # stock mlx-lm block (its own bf16 routing: may differ on near-ties)
    stock = moe.sparse_moe(block, x, implementation="stock")
    assert rel(got, stock) < 2 * GATHER_QMM_TOL


@cuda
@needs_cuda
@pytest.mark.parametrize("n", [1, 2, 4])
def test_moe_decode_step_compiled_equals_eager(poison, n, monkeypatch):
    """The mx.compile'd four-node step (the default) = the eager launches, bit
    for bit, for several layers through one trace; a replaced weight is read.
    (The opt-in one-launch step: test_cuda_moe_decode_fused.py.)"""
    from mlx_qwen_fast.kernels import moe_decode_fused as mf

    monkeypatch.delenv(mf.FUSED_ENV, raising=False)
    blocks = [moe_blocks.make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16, seed=s) for s in (3, 4)]
    for i, block in enumerate(blocks):
        x = (mx.random.normal((1, n, 256), key=mx.random.key(10 * n + i)) * 1.5).astype(mx.bfloat16)
        got = md.moe_decode_step(block, x)
        assert got is not None and got.shape == x.shape and finite(got)
        assert mx.array_equal(got, md.moe_decode(block, x)).item()
        assert mx.array_equal(got, moe.sparse_moe(block, x)).item()  # the default dispatch
    # replace the routed experts' down projection of block 0: the step must follow
    block = blocks[0]
    x = (mx.random.normal((1, n, 256), key=mx.random.key(99)) * 1.5).astype(mx.bfloat16)
    before = md.moe_decode_step(block, x)
    block.switch_mlp.down_proj.scales = block.switch_mlp.down_proj.scales * 2
    after = md.moe_decode_step(block, x)
    assert mx.array_equal(after, md.moe_decode(block, x)).item()
    assert not mx.array_equal(after, before).item()


def test_moe_decode_step_declines_unsupported():
    """None (the caller keeps stock) where the kernels do not apply: fp32
    activations, more than 4 tokens, or no CUDA."""
    block = moe_blocks.make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16)
    x = mx.zeros((1, 5, 256), mx.bfloat16)
    assert md.moe_decode_step(block, x) is None
    assert md.moe_decode_step(block, x[:, :1].astype(mx.float32)) is None
    if not HAS_CUDA:
        assert md.moe_decode_step(block, x[:, :1]) is None
