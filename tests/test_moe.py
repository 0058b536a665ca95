"""Sparse MoE stages (mlx_qwen_fast.ops.moe) vs numpy formulas and stock mlx-lm.

Small quantized blocks built with mlx-lm's own classes and ``nn.quantize``
(experts 4-bit group 64, router and shared-expert gate 8-bit, as in the
checkpoint). References are float64 numpy on the dequantized weights
(``mx.dequantize``), so the only error left is fp32 rounding. Fresh random
inputs each run.
"""

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.qwen3_next import Qwen3NextSparseMoeBlock

from mlx_qwen_fast.ops import moe
from moe_blocks import make_block  # tests/ is on sys.path

BF16_EPS = 2.0**-8  # unit roundoff of bfloat16
TOKEN_COUNTS = [1, 2, 4, 7, 64, 2049, 4099]  # 4099 * 8 = 32,792 > 32,768, not % 64


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def deq(layer):
    """Dequantized weight of a QuantizedLinear / QuantizedSwitchLinear, float64."""
    w = mx.dequantize(
        layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits
    )
    return np.array(w.astype(mx.float32)).astype(np.float64)


def experts_f64(switch_glu):
    return [deq(p) for p in (switch_glu.gate_proj, switch_glu.up_proj, switch_glu.down_proj)]


def np_silu(x):
    return x / (1.0 + np.exp(-x))


def np_experts(x, inds, gate_w, up_w, down_w):
    """Naive per-assignment SwiGLU: y[n, j] = down_e(silu(gate_e x_n) * up_e x_n)."""
    n, k = inds.shape
    y = np.zeros((n, k, down_w.shape[1]))
    for e in np.unique(inds):
        rows, slots = np.nonzero(inds == e)
        xe = x[rows]
        h = np_silu(xe @ gate_w[e].T) * (xe @ up_w[e].T)
        y[rows, slots] = h @ down_w[e].T
    return y


def np_softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(axis=-1, keepdims=True)


def np_block(block, x):
    """Naive float64 Qwen3NextSparseMoeBlock. Returns (y, inds, gap) where gap is
    the probability gap between the k-th and (k+1)-th expert of each token."""
    k = block.top_k
    probs = np_softmax(x @ deq(block.gate).T)
    order = np.argsort(-probs, axis=-1, kind="stable")
    inds = order[:, :k]
    srt = np.take_along_axis(probs, order, axis=-1)
    gap = srt[:, k - 1] - srt[:, k] if k < probs.shape[-1] else np.full(len(x), np.inf)
    scores = np.take_along_axis(probs, inds, axis=-1)
    scores /= scores.sum(-1, keepdims=True)
    sm = block.switch_mlp
    ye = np_experts(x, inds, *experts_f64(sm))
    y = (ye * scores[..., None]).sum(1)
    se = block.shared_expert
    shared = np_experts(x, np.zeros((len(x), 1), np.int64), *(
        deq(l)[None] for l in (se.gate_proj, se.up_proj, se.down_proj)
    ))[:, 0]
    sg = 1.0 / (1.0 + np.exp(-(x @ deq(block.shared_expert_gate).T)))
    return y + sg * shared, inds, gap


def rel_max(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def check_groups(g, inds, E):
    flat = np.array(inds).reshape(-1).astype(np.int64)
    nk = flat.size
    counts, offsets, order = np.array(g.counts), np.array(g.offsets), np.array(g.order)
    assert g.counts.dtype == g.offsets.dtype == g.order.dtype == mx.int32
    assert g.inverse.dtype == g.sorted_experts.dtype == mx.int32
    assert counts.shape == (E,) and offsets.shape == (E + 1,) and order.shape == (nk,)
    np.testing.assert_array_equal(counts, np.bincount(flat, minlength=E))
    np.testing.assert_array_equal(offsets, np.concatenate([[0], np.cumsum(counts)]))
    assert offsets[-1] == nk
    # a permutation, experts non-decreasing along it, stable within an expert
    np.testing.assert_array_equal(np.sort(order), np.arange(nk))
    se = flat[order]
    assert np.all(np.diff(se) >= 0)
    np.testing.assert_array_equal(order, np.argsort(flat, kind="stable"))
    np.testing.assert_array_equal(np.array(g.sorted_experts), se)
    inv = np.array(g.inverse)
    np.testing.assert_array_equal(order[inv], np.arange(nk))
    for e in range(E):  # expert e owns rows [offsets[e], offsets[e+1])
        assert np.all(se[offsets[e] : offsets[e + 1]] == e)


def skewed_inds(rng, n, k, E, kind):
    """[n, k] distinct experts per token with a chosen load shape."""
    if kind == "uniform":
        w = np.ones(E)
    elif kind == "skewed":  # Zipf-like: expert 0 takes most, tail nearly empty
        w = 1.0 / np.arange(1, E + 1) ** 2
    elif kind == "empty":  # half the experts never chosen
        w = np.where(np.arange(E) % 2 == 0, 1.0, 0.0)
    w = w / w.sum()
    kk = min(k, int((w > 0).sum()))
    out = np.stack([rng.choice(E, size=kk, replace=False, p=w) for _ in range(n)])
    return out.astype(np.int32)


# ---------------------------------------------------------------------------
# route
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("E,k", [(16, 8), (256, 8), (8, 1), (8, 8)])
@pytest.mark.parametrize("normalize", [True, False])
def test_route_vs_numpy(E, k, normalize):
    rng = np.random.default_rng()
    logits = rng.normal(scale=3.0, size=(37, E)).astype(np.float32)
    inds, scores = moe.route(mx.array(logits), k, normalize=normalize)
    assert inds.shape == scores.shape == (37, k)
    assert inds.dtype in (mx.uint32, mx.int32) and scores.dtype == mx.float32

    p = np_softmax(logits.astype(np.float64))
    ref_inds = np.sort(np.argsort(-p, axis=-1, kind="stable")[:, :k], axis=-1)
    got = np.array(inds)
    np.testing.assert_array_equal(np.sort(got, axis=-1), ref_inds)
    ref_scores = np.take_along_axis(p, got.astype(np.int64), axis=-1)
    if normalize:
        ref_scores /= ref_scores.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.array(scores), ref_scores, rtol=2e-6, atol=1e-7)


def test_route_bf16_logits_fp32_softmax():
    rng = np.random.default_rng()
    logits = mx.array(rng.normal(scale=3.0, size=(50, 32))).astype(mx.bfloat16)
    inds, scores = moe.route(logits, 4)
    assert scores.dtype == mx.float32
    p = np_softmax(np.array(logits.astype(mx.float32)).astype(np.float64))
    ref = np.take_along_axis(p, np.array(inds).astype(np.int64), -1)
    np.testing.assert_allclose(np.array(scores), ref / ref.sum(-1, keepdims=True), rtol=2e-6)


# ---------------------------------------------------------------------------
# group_by_expert / block_map
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", TOKEN_COUNTS)
@pytest.mark.parametrize("kind", ["uniform", "skewed", "empty"])
def test_group_by_expert(n, kind):
    rng = np.random.default_rng()
    E, k = 32, 8
    inds = skewed_inds(rng, n, k, E, kind)
    g = moe.group_by_expert(mx.array(inds), E)
    check_groups(g, inds, E)
    assert g.top_k == inds.shape[1]
    if kind == "empty":
        assert np.all(np.array(g.counts)[1::2] == 0)


def test_group_by_expert_uint32_and_all_to_one():
    E = 16
    # every row to one expert (k = 1), forced by the logits
    logits = mx.zeros((300, E)).at[:, 5].add(30.0)
    inds, scores = moe.route(logits, 1)
    assert inds.dtype == mx.uint32
    g = moe.group_by_expert(inds, E)
    check_groups(g, np.array(inds), E)
    assert np.array(g.counts)[5] == 300 and np.array(g.counts).sum() == 300
    np.testing.assert_allclose(np.array(scores), 1.0)
    # top-8, all tokens forced onto the same 8 experts; 8 empty experts
    logits = mx.zeros((129, E)).at[:, 3:11].add(30.0)
    inds, _ = moe.route(logits, 8)
    g = moe.group_by_expert(inds, E)
    check_groups(g, np.array(inds), E)
    counts = np.array(g.counts)
    assert np.all(counts[3:11] == 129) and counts.sum() == 129 * 8


def np_block_map(counts, tile, size):
    items = [(e, t) for e, c in enumerate(counts) for t in range(-(-c // tile))]
    items += [(-1, -1)] * (size - len(items))
    return np.array(items, np.int32).reshape(size, 2)


@pytest.mark.parametrize("tile", [1, 32, 128])
@pytest.mark.parametrize(
    "n,kind", [(1, "uniform"), (7, "skewed"), (2049, "empty"), (4099, "skewed")]
)
def test_block_map(tile, n, kind):
    rng = np.random.default_rng()
    E, k = 32, 8
    inds = skewed_inds(rng, n, k, E, kind)
    g = moe.group_by_expert(mx.array(inds), E)
    bm = moe.block_map(g, tile)
    size = math.ceil(n * k / tile) + E
    assert bm.shape == (size, 2) and bm.dtype == mx.int32
    assert moe.max_tiles(n * k, E, tile) == size
    counts, offsets, bmn = np.array(g.counts), np.array(g.offsets), np.array(bm)
    np.testing.assert_array_equal(bmn, np_block_map(counts, tile, size))
    # the valid tiles cover each grouped row exactly once
    e, t = bmn[bmn[:, 0] >= 0].T
    lo = offsets[e] + t * tile
    hi = np.minimum(lo + tile, offsets[e + 1])
    assert np.all(lo < hi)
    covered = np.zeros(n * k + 1, np.int64)
    np.add.at(covered, lo, 1)
    np.add.at(covered, hi, -1)
    assert np.all(np.cumsum(covered)[:-1] == 1)


# ---------------------------------------------------------------------------
# expert_swiglu / combine vs naive formula
# ---------------------------------------------------------------------------


# 4099 tokens go through expert_swiglu in test_block_large_vs_naive_and_stock
@pytest.mark.parametrize("n", TOKEN_COUNTS[:-1])
def test_expert_swiglu_vs_naive(n):
    rng = np.random.default_rng()
    block = make_block(D=64, H=64, E=16)
    sm = block.switch_mlp
    kind = ["uniform", "skewed", "empty"][n % 3]
    inds = skewed_inds(rng, n, 8, 16, kind)
    x = rng.normal(size=(n, 64)).astype(np.float32)
    g = moe.group_by_expert(mx.array(inds), 16)
    y = moe.expert_swiglu(mx.array(x), g, sm.gate_proj, sm.up_proj, sm.down_proj)
    assert y.shape == (n, 8, 64) and y.dtype == mx.float32
    ref = np_experts(x.astype(np.float64), inds, *experts_f64(sm))
    err = rel_max(y, ref)
    assert err < 2e-5, f"n={n}: max rel err {err:.2e}"

    scores = rng.random(size=(n, 8)).astype(np.float32)
    out = moe.combine(y, mx.array(scores))
    np.testing.assert_allclose(
        np.array(out), (ref * scores[..., None]).sum(1), atol=2e-5 * np.abs(ref).max()
    )


def test_expert_swiglu_odd_multiple_of_64():
    """K = 64 * 3 into the gate/up projections and K = 64 * 5 into down."""
    rng = np.random.default_rng()
    block = make_block(D=192, H=320, E=8)
    sm = block.switch_mlp
    for n in (7, 64, 65):
        inds = skewed_inds(rng, n, 8, 8, "uniform")
        x = rng.normal(size=(n, 192)).astype(np.float32)
        g = moe.group_by_expert(mx.array(inds), 8)
        y = moe.expert_swiglu(mx.array(x), g, sm.gate_proj, sm.up_proj, sm.down_proj)
        ref = np_experts(x.astype(np.float64), inds, *experts_f64(sm))
        assert rel_max(y, ref) < 2e-5


# ---------------------------------------------------------------------------
# whole block vs naive formula and stock module
# ---------------------------------------------------------------------------


def test_block_large_vs_naive_and_stock():
    """N*k = 32,792 (> 32,768, not a multiple of 64): reference, stock and
    stock-in-chunks all equal the float64 formula."""
    rng = np.random.default_rng()
    n = 4099
    block = make_block(D=64, H=64, E=16)
    x = rng.normal(size=(n, 64)).astype(np.float32)
    ref, _, gap = np_block(block, x.astype(np.float64))
    ok = gap > 1e-6  # fp32 probabilities can swap experts closer than this
    assert ok.mean() > 0.99
    xm = mx.array(x)
    ours = moe.sparse_moe_block(block, xm)
    stock = block(xm)
    chunked = mx.concatenate([block(xm[:2048]), block(xm[2048:])])
    for name, y in (("reference", ours), ("stock", stock), ("stock chunked", chunked)):
        err = rel_max(np.array(y)[ok], ref[ok])
        assert err < 2e-5, f"{name}: max rel err {err:.2e} at N*k = {n * 8}"


@pytest.mark.parametrize(
    "shape", [(1, 64), (2, 64), (4, 64), (7, 64), (64, 64), (2, 33, 64), (1, 1, 64)]
)
def test_block_vs_stock_fp32(shape):
    block = make_block(D=64, H=64, E=16)
    x = mx.random.normal(shape)
    ours = moe.sparse_moe_block(block, x)
    stock = block(x)
    assert ours.shape == stock.shape == x.shape and ours.dtype == stock.dtype
    assert rel_max(ours, stock) < 1e-6


def test_block_vs_stock_fp32_256_experts():
    block = make_block(D=128, H=64, E=256)
    x = mx.random.normal((2, 40, 128))
    assert rel_max(moe.sparse_moe_block(block, x), block(x)) < 1e-6


def test_block_vs_stock_bf16():
    """bf16 is noise, not a gate: the reference keeps routing weights and the
    combine in fp32 and selects on fp32 probabilities, stock rounds them to
    bf16. Tokens with the same expert set agree to a few bf16 ulps; tokens whose
    set differs must be bf16 near-ties."""
    block = make_block(D=128, H=64, E=32, dtype=mx.bfloat16)
    x = mx.random.normal((200, 128)).astype(mx.bfloat16)
    ours = moe.sparse_moe_block(block, x)
    stock = block(x)
    assert ours.dtype == stock.dtype == mx.bfloat16

    logits = block.gate(x)
    p = np.array(mx.softmax(logits.astype(mx.float32), axis=-1))
    ours_set = np.sort(np.array(moe.route(logits, 8)[0]), -1)
    # stock's own rule: top-k of the probabilities rounded to bf16
    stock_probs = mx.softmax(logits, axis=-1, precise=True)
    stock_set = np.sort(np.array(mx.argpartition(stock_probs, kth=-8, axis=-1)[:, -8:]), -1)
    same = (ours_set == stock_set).all(-1)

    err = np.abs(np.array((ours - stock).astype(mx.float32))).max(-1)
    scale = np.abs(np.array(stock.astype(mx.float32))).max()
    tol = 8 * BF16_EPS * scale
    assert err[same].max() <= tol, f"same-set tokens: {err[same].max():.3g} > {tol:.3g}"
    # where the sets differ the k-th and (k+1)-th probabilities tie in bf16
    srt = -np.sort(-p, -1)
    gap = (srt[:, 7] - srt[:, 8]) / srt[:, 7]
    assert np.all(gap[~same] <= 2 * BF16_EPS), gap[~same]
    assert (~same).mean() < 0.05


# ---------------------------------------------------------------------------
# dispatch, graph properties, validation
# ---------------------------------------------------------------------------


def test_dispatch_stock_except_cuda(monkeypatch):
    from mlx_qwen_fast.kernels import _cuda_build as cb

    monkeypatch.delenv(moe.MOE_KERNEL_ENV, raising=False)
    monkeypatch.delenv(moe.MOE_DECODE_KERNEL_ENV, raising=False)
    monkeypatch.setattr(cb, "cuda_available", lambda: True)  # the table for a machine with a CUDA device
    assert {"stock", "reference", "cuda-kernel", "cuda-decode-kernel"} <= set(moe.IMPLEMENTATIONS)
    for b in ("cpu", "cuda", "metal"):
        for n in (1, 4, 5, 7, 2048, 65536):
            want = "stock"
            if b == "cuda" and n >= moe.MOE_KERNEL_MIN_TOKENS:
                want = "cuda-kernel"
            elif b == "cuda" and n <= moe.MOE_DECODE_KERNEL_MAX_TOKENS:
                want = "cuda-decode-kernel"
            assert moe.implementation_for(n, b) == want
    assert moe.implementation_for(1) in moe.IMPLEMENTATIONS
    with pytest.raises(ValueError, match="backend"):
        moe.implementation_for(1, "tpu")


def test_sparse_moe_from_a_subclass_calls_stock_math():
    class Fast(Qwen3NextSparseMoeBlock):
        def __call__(self, x):
            return moe.sparse_moe(self, x)

    block = make_block(D=64, H=64, E=16)
    x = mx.random.normal((3, 70, 64))
    stock = block(x)
    block.__class__ = Fast  # what the patch does; must not recurse
    assert mx.array_equal(block(x), stock)
    ref = moe.sparse_moe(block, x, implementation="reference")
    assert rel_max(ref, stock) < 1e-6
    with pytest.raises(ValueError, match="implementation"):
        moe.sparse_moe(block, x, implementation="nope")


def test_no_host_sync(tmp_path):
    """Tracing (mx.export_function, as mx.compile does, without compiling CPU
    kernels) refuses .item() and data-dependent shapes; the traced graph gives
    the eager result."""
    block = make_block(D=64, H=64, E=16)
    sm = block.switch_mlp

    def stages(x):
        inds, scores = moe.route(block.gate(x), 8)
        g = moe.group_by_expert(inds, 16)
        y = moe.expert_swiglu(x, g, sm.gate_proj, sm.up_proj, sm.down_proj)
        return moe.combine(y, scores), moe.block_map(g, 32), g.offsets, g.inverse

    x = mx.random.normal((100, 64))
    mx.export_function(str(tmp_path / "stages.mlxfn"), stages, x)
    traced = mx.import_function(str(tmp_path / "stages.mlxfn"))(x)
    for a, b in zip(traced, stages(x)):
        assert mx.array_equal(a, b)
    mx.export_function(str(tmp_path / "block.mlxfn"), lambda x: moe.sparse_moe_block(block, x), x)
    full = mx.import_function(str(tmp_path / "block.mlxfn"))(x)[0]
    assert rel_max(full, block(x)) < 1e-6
    with pytest.raises(ValueError, match="eval"):  # the check itself works
        mx.export_function(
            str(tmp_path / "bad.mlxfn"),
            lambda i: moe.group_by_expert(i, 16, check_range=True).order,
            mx.zeros((4, 2), mx.int32),
        )


def test_validation_errors():
    block = make_block(D=64, H=64, E=16)
    sm = block.switch_mlp
    with pytest.raises(ValueError, match=r"x must .*\[\.\.\., 64\]"):
        moe.sparse_moe_block(block, mx.zeros((64,)))  # no token axis
    with pytest.raises(ValueError, match=r"dtype .*int32"):
        moe.sparse_moe_block(block, mx.zeros((3, 64), mx.int32))
    with pytest.raises(ValueError, match=r"hidden size 64"):
        moe.sparse_moe(block, mx.zeros((3, 65)))
    with pytest.raises(ValueError, match=r"top_k .*E=16"):
        moe.route(mx.zeros((3, 16)), 17)
    with pytest.raises(ValueError, match=r"logits"):
        moe.route(mx.zeros((3, 16), mx.int32), 2)
    with pytest.raises(ValueError, match=r"inds .*\[N, k\]"):
        moe.group_by_expert(mx.zeros((3, 2, 2), mx.int32), 16)
    with pytest.raises(ValueError, match=r"inds .*\[N, k\]"):
        moe.group_by_expert(mx.zeros((3, 2)), 16)
    with pytest.raises(ValueError, match=r"inds must lie in \[0, num_experts=16\)"):
        moe.group_by_expert(mx.array([[0, 16]]), 16, check_range=True)
    with pytest.raises(ValueError, match=r"inds must lie"):
        moe.group_by_expert(mx.array([[-1, 3]]), 16, check_range=True)
    with pytest.raises(ValueError, match=r"k=17 > num_experts=16"):
        moe.group_by_expert(mx.zeros((1, 17), mx.int32), 16)
    with pytest.raises(ValueError, match="tile_rows"):
        moe.block_map(moe.group_by_expert(mx.zeros((1, 2), mx.int32), 16), 0)
    g = moe.group_by_expert(mx.zeros((4, 2), mx.int32), 16)
    with pytest.raises(ValueError, match=r"x must .*\[N, D\]"):
        moe.expert_swiglu(mx.zeros((4, 1, 64)), g, sm.gate_proj, sm.up_proj, sm.down_proj)
    with pytest.raises(ValueError, match=r"N\*k"):
        moe.expert_swiglu(mx.zeros((5, 64)), g, sm.gate_proj, sm.up_proj, sm.down_proj)
    with pytest.raises(ValueError, match=r"K=96 must be a multiple .*group_size=64"):
        moe.expert_swiglu(mx.zeros((4, 96)), g, sm.gate_proj, sm.up_proj, sm.down_proj)
    with pytest.raises(ValueError, match=r"expects inputs of size 64, got 128"):
        moe.expert_swiglu(mx.zeros((4, 128)), g, sm.gate_proj, sm.up_proj, sm.down_proj)
    with pytest.raises(ValueError, match=r"scores must have shape \(4, 2\)"):
        moe.combine(mx.zeros((4, 2, 64)), mx.zeros((4, 3)))
