"""The sparse MoE op family (``mlx_qwen_fast.ops.moe``): the reference
stages vs numpy formulas and stock mlx-lm, the dispatch, the CUDA
implementations' block-level paths ("cuda-prefill", "cuda-decode") and the
Metal one ("metal-decode", its kernels run on the CPU by
``tests/metal_check.py``).

Small quantized blocks built with mlx-lm's own classes and ``nn.quantize``
(experts 4-bit group 64, router and shared-expert gate 8-bit, as in the
checkpoint). References of the stages are float64 numpy on the dequantized
weights (``mx.dequantize``), so the only error left is fp32 rounding. Fresh
random inputs each run.

The decode step's plumbing (the arrays passed to the compiled step, their
order, the per-block plan cache) is checked on any backend with stand-ins
for the kernels; the kernels themselves run in the ``cuda`` tests (bounds
from compare.py; the kernels' own tests: tests/kernels/test_moe_*.py).
"""

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.qwen3_next import Qwen3NextSparseMoeBlock

import moe_blocks
from compare import FP32_TOL, GATHER_QMM_TOL, assert_close, finite, npa, tolerance
from moe_blocks import make_block
from references import moe_decode_reference
from mlx_qwen_fast import config
from mlx_qwen_fast.kernels import _cuda_build as cb
from mlx_qwen_fast.kernels import moe_decode_gemv as md
from mlx_qwen_fast.kernels import moe_grouped_gemm as gg
from mlx_qwen_fast.kernels import moe_routing as mr
from mlx_qwen_fast.ops import moe

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


def test_dispatch_stock_except_cuda(env, monkeypatch):
    env.unset(config.MOE_PREFILL_KERNEL.name)
    env.unset(config.MOE_DECODE_KERNEL.name)
    env.unset(config.METAL_KERNELS.name)  # Metal's kernels are opt-in: off by default
    monkeypatch.setattr(cb, "cuda_available", lambda: True)  # the table for a machine with a CUDA device
    assert set(moe.IMPLEMENTATIONS) == {"stock", "reference", "cuda-prefill", "cuda-decode", "metal-decode",
                                        "metal-prefill"}
    for b in ("cpu", "cuda", "metal"):
        for n in (1, 4, 5, 7, 2048, 65536):
            want = "stock"
            if b == "cuda" and n >= moe.PREFILL_MIN_TOKENS:
                want = "cuda-prefill"
            elif b == "cuda" and n <= moe.DECODE_MAX_TOKENS:
                want = "cuda-decode"
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
        g = moe.group_by_expert(inds, 16, check_range=False)
        y = moe.expert_swiglu(x, g, sm.gate_proj, sm.up_proj, sm.down_proj, check=False)
        return moe.combine(y, scores), moe.block_map(g, 32, check=False), g.offsets, g.inverse

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
    with pytest.raises(ValueError, match=r"got \S*int32 \(3, 64\)"):
        moe.sparse_moe_block(block, mx.zeros((3, 64), mx.int32))
    with pytest.raises(ValueError, match=r"hidden size 64"):
        moe.sparse_moe(block, mx.zeros((3, 65)))
    with pytest.raises(ValueError, match=r"top_k .*E=16"):
        moe.route(mx.zeros((3, 16)), 17)
    with pytest.raises(ValueError, match=r"logits"):
        moe.route(mx.zeros((3, 16), mx.int32), 2)
    with pytest.raises(ValueError, match="top_k must"):
        moe.route(mx.zeros((2, 8)), 2.5)
    with pytest.raises(ValueError, match="logits must"):
        moe.route(np.zeros((2, 8), np.float32), 2)
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
    for bad in (mx.int32, mx.uint8, mx.bool_, "float32"):
        with pytest.raises(ValueError, match=r"combine: dtype must be None or a float mlx dtype"):
            moe.combine(mx.zeros((4, 2, 64)), mx.zeros((4, 2)), dtype=bad)
    assert moe.combine(mx.ones((4, 2, 64)), mx.ones((4, 2)), dtype=mx.float16).dtype == mx.float16


def test_dispatch_by_backend_and_env(env, monkeypatch):
    env.unset(config.MOE_PREFILL_KERNEL.name)
    env.unset(config.MOE_DECODE_KERNEL.name)
    monkeypatch.setattr(cb, "cuda_available", lambda: False)  # "cuda" asked for without a CUDA device
    assert moe.implementation_for(4096, "cuda") == "stock" and moe.implementation_for(1, "cuda") == "stock"
    monkeypatch.setattr(cb, "cuda_available", lambda: True)
    n = moe.PREFILL_MIN_TOKENS
    assert moe.implementation_for(4096, "cuda") == "cuda-prefill"
    assert moe.implementation_for(n, "cuda") == "cuda-prefill"
    # below the prefill threshold: the decode kernels up to their maximum, stock between
    assert moe.implementation_for(1, "cuda") == "cuda-decode"
    assert moe.implementation_for(moe.DECODE_MAX_TOKENS, "cuda") == "cuda-decode"
    assert moe.implementation_for(moe.DECODE_MAX_TOKENS + 1, "cuda") == "stock"
    assert moe.implementation_for(n - 1, "cuda") == "stock"
    assert moe.DECODE_MAX_TOKENS == md.MAX_TOKENS  # the kernels' limit
    for b in ("cpu", "metal"):
        assert moe.implementation_for(4096, b) == "stock"
        assert moe.implementation_for(1, b) == "stock"
    env.set(config.MOE_PREFILL_KERNEL.name, "0")  # the A/B switch of the prefill kernels
    assert moe.implementation_for(4096, "cuda") == "stock"
    assert moe.implementation_for(1, "cuda") == "cuda-decode"
    env.set(config.MOE_PREFILL_KERNEL.name, "1")
    assert moe.implementation_for(4096, "cuda") == "cuda-prefill"
    env.set(config.MOE_DECODE_KERNEL.name, "0")  # the decode kernels' switch
    assert moe.implementation_for(1, "cuda") == "stock"
    assert moe.implementation_for(4096, "cuda") == "cuda-prefill"
    env.set(config.MOE_DECODE_KERNEL.name, "1")
    assert moe.implementation_for(1, "cuda") == "cuda-decode"


def test_forced_kernel_implementations_fall_back_to_stock():
    """A block the kernels do not take (fp32 activations and scales) runs
    stock mlx-lm's block under the kernel implementations' names, bit for bit."""
    block = make_block(D=128, H=64, E=32, k=4, dtype=mx.float32)
    x = mx.random.normal((2, 5, 128), key=mx.random.key(0))
    a = moe.sparse_moe(block, x, implementation="cuda-prefill")
    b = moe.sparse_moe(block, x, implementation="stock")
    assert mx.array_equal(a, b).item()
    x1 = x[:, :1]  # decode-sized call through the decode kernels' entry
    a1 = moe.sparse_moe(block, x1, implementation="cuda-decode")
    assert mx.array_equal(a1, moe.sparse_moe(block, x1, implementation="stock")).item()


# ---------------------------------------------------------------------------
# CUDA prefill: the block's pieces (any backend)
# ---------------------------------------------------------------------------


def test_router_with_shared_gate_is_both_layers():
    """The joint router: its columns are the router's and the gate's outputs
    (then zeros), built once, rebuilt when a weight is replaced; None for
    layers of other kinds (any backend)."""
    from mlx_qwen_fast.compiled import apply_linear

    E, D = 32, 256
    block = moe_blocks.make_block(D=D, H=128, E=E, k=8, dtype=mx.bfloat16, seed=9)
    x = mx.random.normal((5, D), key=mx.random.key(2)).astype(mx.bfloat16)
    joint = moe.router_with_shared_gate(block)
    assert joint is not None and joint[0][0].shape[0] == E + 32
    out = apply_linear(x, *joint)
    assert out.shape == (5, E + 32)
    # the same numbers, one matmul instead of two: bf16 outputs may round apart (roundings=1)
    assert_close(out[:, :E], block.gate(x), tolerance(mx.bfloat16), "router columns")
    assert_close(out[:, E:E + 1], block.shared_expert_gate(x), tolerance(mx.bfloat16), "gate column")
    assert not np.asarray(out[:, E + 1:].astype(mx.float32)).any()
    assert moe.router_with_shared_gate(block) is joint  # cached
    g = block.shared_expert_gate
    g.weight = mx.array(g.weight)  # a replaced array (as load_weights does): rebuilt
    again = moe.router_with_shared_gate(block)
    assert again is not joint and mx.array_equal(again[0][0], joint[0][0]).item()
    block.shared_expert_gate = nn.Linear(D, 1, bias=False)  # another kind than the router
    assert moe.router_with_shared_gate(block) is None


def test_shared_expert_in_the_routing_slot_where_it_fits():
    """The prefill kernels put the shared expert in a (k+1)-th routing slot
    with the "wgmma" build, where the routing has room (k + 1 <= 32 slots,
    E + 32 <= 1024 grouped experts) and the shared expert has the routed
    experts' quantisation and sizes; else MLX's dense matmuls beside them."""
    block = moe_blocks.make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16)
    n = 4096
    assert moe.cuda._shared_in_slot(block, n, 256, 128, "wgmma")
    assert not moe.cuda._shared_in_slot(block, n, 256, 128, "mma")
    assert not moe.cuda._shared_in_slot(block, n, 256, 256, "wgmma")  # routed experts of another size
    block.top_k = 31
    assert moe.cuda._shared_in_slot(block, n, 256, 128, "wgmma")
    block.top_k = 32  # 33 slots: more than a warp holds
    assert not moe.cuda._shared_in_slot(block, n, 256, 128, "wgmma")
    block.top_k, block.num_experts = 8, 992
    assert moe.cuda._shared_in_slot(block, n, 256, 128, "wgmma")
    block.num_experts = 1024  # 1,056 grouped experts
    assert not moe.cuda._shared_in_slot(block, n, 256, 128, "wgmma")
    narrow = moe_blocks.make_block(D=256, H=64, E=32, k=8, dtype=mx.bfloat16)
    assert not moe.cuda._shared_in_slot(narrow, n, 256, 64, "wgmma")  # no "wgmma" build for I = 64


# ---------------------------------------------------------------------------
# CUDA decode: the plan and the compiled step (any backend)
# ---------------------------------------------------------------------------


def test_decode_plan_shapes():
    """The decode kernels take 1..4 bf16 tokens of a 4-bit group-64 block with
    bf16 scales, D a multiple of 256 and I of 128, unsharded (pure shape
    checks: no backend check, nothing compiled)."""
    block = moe_blocks.make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16)
    for n in (1, 2, 3, 4):
        assert moe.decode_plan(block, mx.zeros((n, 256), mx.bfloat16)) is not None
    assert moe.decode_plan(block, mx.zeros((1, 2, 256), mx.bfloat16)) is not None
    assert moe.decode_plan(block, mx.zeros((5, 256), mx.bfloat16)) is None  # N > 4
    assert moe.decode_plan(block, mx.zeros((2, 256), mx.float32)) is None  # not bf16
    small = moe_blocks.make_block(D=128, H=128, E=32, k=8, dtype=mx.bfloat16)
    assert moe.decode_plan(small, mx.zeros((1, 128), mx.bfloat16)) is None  # D % 256
    odd = moe_blocks.make_block(D=256, H=64, E=32, k=8, dtype=mx.bfloat16)
    assert moe.decode_plan(odd, mx.zeros((1, 256), mx.bfloat16)) is None  # I % 128
    f32 = moe_blocks.make_block(D=256, H=128, E=32, k=8, dtype=mx.float32)
    assert moe.decode_plan(f32, mx.zeros((1, 256), mx.bfloat16)) is None  # fp32 scales
    block.sharding_group = object()
    assert moe.decode_plan(block, mx.zeros((1, 256), mx.bfloat16)) is None
    block.sharding_group = None
    arrs = moe.decode_arrays(block)
    assert arrs is not None and arrs[2][3] == 8  # the 8-bit shared-expert gate
    assert moe.decode_arrays(f32) is None


def test_cuda_decode_declines_to_stock():
    """The stock block's own result where the kernels do not apply: more
    than 4 tokens, fp32 activations."""
    block = moe_blocks.make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16)
    x = mx.random.normal((1, 5, 256), key=mx.random.key(4)).astype(mx.bfloat16)
    assert mx.array_equal(moe._cuda_decode(block, x), moe._stock(block, x)).item()
    x1 = x[:, :1].astype(mx.float32)
    assert mx.array_equal(moe._cuda_decode(block, x1), moe._stock(block, x1)).item()


# ---------------------------------------------------------------------------
# the weight format the kernels read: decided per block at patch time
# ---------------------------------------------------------------------------

_EXPERTS = ("gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize(
    "quant, prefill, decode",
    [
        (None, None, None),  # the checkpoint's layout: both kernels
        ({"switch_mlp": {"bits": 3, "group_size": 64}}, "moe experts: 3-bit weights (switch_mlp.gate_proj)", "same"),
        ({"switch_mlp": {"bits": 8, "group_size": 64}}, "moe experts: 8-bit weights", "same"),
        ({"switch_mlp.down_proj": {"bits": 6, "group_size": 64}}, "6-bit weights (switch_mlp.down_proj)", "same"),
        ({"switch_mlp": {"bits": 4, "group_size": 32}}, "moe experts: group size 32", "same"),
        ({"switch_mlp": {"bits": 4, "group_size": 128}}, "moe experts: group size 128", "same"),
        ({"switch_mlp": {"mode": "mxfp4", "group_size": 32}}, "moe experts: mxfp4 weights", "same"),
        ({"switch_mlp": {"mode": "nvfp4", "group_size": 16}}, "moe experts: nvfp4 weights", "same"),
        ({"switch_mlp": False}, "moe experts: unquantised weights", "same"),
        ({"shared_expert": {"bits": 8, "group_size": 64}}, None, "moe shared expert: 8-bit weights"),
        ({"shared_expert.up_proj": {"mode": "mxfp4", "group_size": 32}}, None, "mxfp4 weights (shared_expert.up_proj)"),
        ({"shared_expert_gate": {"bits": 4, "group_size": 64}}, None, None),  # the decode kernels read 4 or 8
        ({"shared_expert_gate": {"bits": 3, "group_size": 64}}, None, "moe shared-expert gate: 3-bit weights"),
        ({"shared_expert_gate": False}, None, None),  # a bias-free bf16 nn.Linear: read as such
        ({"gate": {"bits": 3, "group_size": 64}}, None, None),  # the router: any quantisation
        ({"gate": {"mode": "mxfp4", "group_size": 32}}, None, None),
    ],
)
def test_kernel_problems_name_the_quantisation(quant, prefill, decode):
    """Each kernel implementation accepts the blocks whose weights are the
    format it reads and names what differs in every other; the kernels'
    own per-call checks agree on every case (the patch-time decision never
    admits a block they would refuse, nor refuses one they take)."""
    decode = prefill if decode == "same" else decode
    block = make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16, seed=0, quant=quant)
    problems = moe.kernel_problems(block)
    want = {name: r for name, r in (("cuda-prefill", prefill), ("cuda-decode", decode), ("metal-decode", decode),
                                    ("metal-prefill", prefill)) if r}
    assert set(problems) == set(want), problems
    for name, reason in want.items():
        assert reason in problems[name], problems[name]
    sm = block.switch_mlp
    projs = [getattr(sm, n) for n in _EXPERTS]
    prefill_ok = all(gg._affine4(p) for p in projs) and gg.supports_arrays(
        mx.zeros((256, 256), mx.bfloat16), *(gg._q_arrays(p) for p in projs))
    assert prefill_ok == ("cuda-prefill" not in problems)
    assert (moe.decode_plan(block, mx.zeros((1, 256), mx.bfloat16)) is None) == ("cuda-decode" in problems)
    assert (moe.metal_decode_plan(block, mx.zeros((1, 256), mx.bfloat16)) is None) == ("metal-decode" in problems)
    assert (moe.metal_prefill_plan(block, mx.zeros((8, 256), mx.bfloat16)) is None) == ("metal-prefill" in problems)


def test_kernel_problems_scales_dtype_and_layers():
    """fp32 or fp16 scales (a model cast with set_dtype), a bias term, a
    wrapped layer: named; a module that is no quantised linear layer at all
    is named by its class. The Metal prefill reads float32 and float16
    scales too (and the plan takes those blocks)."""
    f32 = make_block(D=256, H=128, E=32, k=8, dtype=mx.float32, seed=0)
    assert moe.kernel_problems(f32)["cuda-prefill"] == "moe experts: float32 scales (switch_mlp.gate_proj)"
    f16 = make_block(D=256, H=128, E=32, k=8, dtype=mx.float16, seed=0)
    assert "float16 scales" in moe.kernel_problems(f16)["cuda-decode"]
    for b in (f32, f16):
        assert "metal-prefill" not in moe.kernel_problems(b)
        assert moe.metal_prefill_plan(b, mx.zeros((8, 256), mx.float32)) is not None
    block = make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16, seed=0)
    block.switch_mlp.up_proj.bias = mx.zeros((32, 128), mx.bfloat16)
    assert moe.kernel_problems(block)["cuda-prefill"] == "moe experts: a bias term (switch_mlp.up_proj)"
    assert moe.kernel_problems(block)["metal-prefill"] == "moe experts: a bias term (switch_mlp.up_proj)"
    assert moe.metal_prefill_plan(block, mx.zeros((8, 256), mx.bfloat16)) is None
    block = make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16, seed=0)
    block.shared_expert.down_proj = nn.Sequential(block.shared_expert.down_proj)
    reason = "moe shared expert: a Sequential layer (shared_expert.down_proj)"
    assert moe.kernel_problems(block) == {"cuda-decode": reason, "metal-decode": reason}
    block = make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16, seed=0)
    block.gate = nn.Sequential(block.gate)  # the Metal decode calls the router as a module: any layer
    assert moe.kernel_problems(block) == {"cuda-decode": "moe router: a Sequential layer (gate)"}
    assert moe.quantization_problem(object()) == "a object layer"
    assert moe.quantization_problem(block.switch_mlp.gate_proj) is None


@pytest.fixture
def cuda_machine(monkeypatch):
    """The dispatch as on a machine with a CUDA device (every kernel entry
    replaced by one that fails: a test under it must never reach one)."""
    from mlx_qwen_fast import backend

    monkeypatch.setattr(backend, "current", lambda: "cuda")
    monkeypatch.setattr(cb, "cuda_available", lambda: True)

    def kernel(block, x):
        raise AssertionError("a CUDA kernel implementation was called")

    for name in ("cuda-prefill", "cuda-decode"):
        monkeypatch.setitem(moe.IMPLEMENTATIONS, name, kernel)


def test_declined_block_runs_stock_where_the_kernels_would(cuda_machine, env):
    """A block whose experts are 3-bit: decide_kernels declines both
    kernels and sparse_moe runs mlx-lm's block for every token count where
    implementation_for picks a kernel; a 4-bit block is sent to them."""
    env.unset(config.MOE_PREFILL_KERNEL.name)
    env.unset(config.MOE_DECODE_KERNEL.name)
    block = make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16, seed=1,
                       quant={"switch_mlp": {"bits": 3, "group_size": 64}})
    assert set(moe.decide_kernels(block)) == {"cuda-prefill", "cuda-decode", "metal-decode", "metal-prefill"}
    for n in (1, moe.DECODE_MAX_TOKENS, moe.PREFILL_MIN_TOKENS):
        assert moe.implementation_for(n) != "stock"
        x = mx.random.normal((1, n, 256), key=mx.random.key(n)).astype(mx.bfloat16)
        assert mx.array_equal(moe.sparse_moe(block, x), moe._stock(block, x)).item()
    ok = make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16, seed=1)
    assert moe.decide_kernels(ok) == {}
    with pytest.raises(AssertionError, match="CUDA kernel"):
        moe.sparse_moe(ok, mx.zeros((1, 1, 256), mx.bfloat16))


@pytest.fixture
def cpu_device():
    """The stand-in kernels' results are compared bit for bit with eager
    calls, which holds on the CPU device (on CUDA a matmul of concatenated
    weights may round differently from the separate ones): run there."""
    old = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(old)


FAKE_CALLS = []  # (stand-in, checked entry point or not), one per call while tracing or eager


def fake_moe_decode_arrays(x, inds, scores, experts, shared, expert_gate, residual=None, *, checked=False):
    """Stands in for the two CUDA kernels: every array used, shapes as
    theirs, the residual added as the down kernel adds it."""
    FAKE_CALLS.append(("arrays", checked))
    return _fake_y(x, inds, scores, experts, shared, expert_gate, residual)


def _fake_y(x, inds, scores, experts, shared, expert_gate, residual):
    def mean(t):
        if t.dtype == mx.uint32:
            t = (t & 0xF).astype(mx.float32)
        return t.astype(mx.float32).mean()

    arrays = [t for q in (*experts, *shared) for t in q] + list(expert_gate[:3])
    total = sum(mean(t) * (j + 1) for j, t in enumerate(arrays))
    mix = (scores[..., None] * inds[..., None].astype(mx.float32)).sum(-2)  # over the k slots
    y = (x.astype(mx.float32) * mix + total).astype(x.dtype)
    return y if residual is None else residual + y


def fake_moe_decode_logits(x, logits, top_k, normalize, experts, shared, expert_gate, residual=None, *,
                           checked=False):
    """Stands in for the two kernels that route in the first: the
    reference routing, then :func:`fake_moe_decode_arrays`'s result."""
    FAKE_CALLS.append(("logits", checked))
    inds, scores = moe.route(logits, top_k, normalize=normalize)
    return _fake_y(x, inds, scores, experts, shared, expert_gate, residual)


def fake_route(logits, k, normalize=True):
    """Stands in for the routing kernel: the reference routing."""
    FAKE_CALLS.append(("route", True))
    return moe.route(logits, k, normalize=normalize)


@pytest.fixture
def fake_decode_kernels(cpu_device, monkeypatch, env):
    """Stand-ins for the three MoE decode launches (the one-launch block,
    which has none, off)."""
    env.set(config.MOE_BLOCK_KERNEL.name, "0")
    monkeypatch.setattr(md, "moe_decode_arrays", fake_moe_decode_arrays)
    monkeypatch.setattr(md, "moe_decode_arrays_unchecked", lambda *a: fake_moe_decode_arrays(*a, checked=True))
    monkeypatch.setattr(md, "moe_decode_logits", lambda x, logits, top_k, experts, shared, expert_gate, normalize=True:
                        fake_moe_decode_logits(x, logits, top_k, normalize, experts, shared, expert_gate))
    monkeypatch.setattr(md, "moe_decode_logits_unchecked", lambda *a: fake_moe_decode_logits(*a, checked=True))
    monkeypatch.setattr(mr, "route", fake_route)
    monkeypatch.setattr(moe.cuda, "_decode_steps", {})  # traces of the fakes stay out of the real cache
    monkeypatch.setattr(moe._cuda_build, "cuda_available", lambda: True)  # the fakes stand in for the GPU
    FAKE_CALLS.clear()


def test_forced_cuda_decode_without_cuda_runs_stock(cpu_device):
    """sparse_moe(..., implementation="cuda-decode") where MLX has no CUDA
    device gives the stock block's result instead of failing in the kernels."""
    block = moe_blocks.make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16, seed=3)
    x = mx.random.normal((1, 1, 256)).astype(mx.bfloat16)
    if moe._cuda_build.cuda_available():
        pytest.skip("needs a process without a CUDA device")
    assert mx.array_equal(moe.sparse_moe(block, x, implementation="cuda-decode"), moe._stock(block, x)).item()


def test_decode_compiled_step_equals_eager(fake_decode_kernels):
    """The compiled step (the block's router, routing and kernels traced
    once, every array an input) gives the eager composition's result, two
    blocks through one trace; a replaced array is read; a child the kernels
    do not take makes the step decline to the stock block."""
    blocks = [moe_blocks.make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16, seed=s) for s in (5, 6)]
    for n in (1, 3):
        for i, block in enumerate(blocks):
            x = mx.random.normal((1, n, 256), key=mx.random.key(n + 7 * i)).astype(mx.bfloat16)
            assert mx.array_equal(moe._cuda_decode(block, x), moe.moe_decode(block, x)).item()
    assert len(moe.cuda._decode_steps) == 1  # one trace for both blocks and token counts
    block = blocks[0]
    x = mx.random.normal((1, 1, 256)).astype(mx.bfloat16)
    y0 = moe._cuda_decode(block, x)
    block.shared_expert.down_proj.biases = block.shared_expert.down_proj.biases + 1
    y1 = moe._cuda_decode(block, x)
    assert not mx.array_equal(y0, y1).item()
    assert mx.array_equal(y1, moe.moe_decode(block, x)).item()
    # a child replaced by one the kernels do not take: the step declines to stock
    block.shared_expert_gate = nn.Sequential(block.shared_expert_gate)
    FAKE_CALLS.clear()
    assert mx.array_equal(moe._cuda_decode(block, x), moe._stock(block, x)).item()
    assert FAKE_CALLS == []
    with pytest.raises(ValueError, match="decode_plan"):
        moe.moe_decode(block, x)


def test_decode_step_with_the_norm_and_residual(fake_decode_kernels, monkeypatch):
    """decode_step_parts(norm_eps=...): the step takes the un-normalised h
    and the norm's weight and gives ``h + block(rms_norm(h))``, the router
    reading the normalised rows and the kernels those same rows."""
    monkeypatch.setattr(moe, "implementation_for", lambda n, backend=None: "cuda-decode")
    block = moe_blocks.make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16, seed=9)
    h = mx.random.normal((1, 1, 256), key=mx.random.key(2)).astype(mx.bfloat16)
    nw = (1.0 + 0.1 * mx.random.normal((256,), key=mx.random.key(3))).astype(mx.bfloat16)
    paths, fn = moe.decode_step_parts(block, h, norm_eps=1e-5)
    from mlx_qwen_fast.compiled import gather

    got = fn(h, nw, *gather(block, paths))
    want = h + moe.moe_decode(block, mx.fast.rms_norm(h, nw, 1e-5))
    assert mx.array_equal(got, want).item()
    assert moe.decode_step_parts(block, h) is not None and len(moe.cuda._decode_steps) == 2  # unfused: its own trace


@pytest.mark.parametrize("E", [32, 512, 544, 1024])
def test_decode_step_routes_in_the_gate_up_kernel_up_to_512_experts(fake_decode_kernels, E):
    """The compiled step (traced with stand-in kernels that record their
    calls) and its eager form give the router's logits to the gate+up
    kernel that routes (``moe_decode_logits_unchecked``: three launches) for E up to
    ROUTE_MAX_EXPERTS = 512, and keep the routing kernel's launch before
    the kernels that take its ids above (shape-only: any backend)."""
    block = moe_blocks.make_block(D=256, H=128, E=E, k=8, dtype=mx.bfloat16, seed=E)
    x = mx.random.normal((1, 2, 256), key=mx.random.key(E)).astype(mx.bfloat16)
    fused = E <= 512
    assert md.route_fits(block.num_experts, block.top_k) == fused
    FAKE_CALLS.clear()
    got = moe._cuda_decode(block, x)
    assert FAKE_CALLS == ([("logits", True)] if fused else [("route", True), ("arrays", True)])
    steps = moe.cuda._decode_steps
    assert len(steps) == 1 and next(iter(steps))[-1] == fused  # the step's key says which
    FAKE_CALLS.clear()
    assert mx.array_equal(got, moe.moe_decode(block, x)).item()
    assert FAKE_CALLS == ([("logits", False)] if fused else [("route", True), ("arrays", False)])


# ---------------------------------------------------------------------------
# the block through the CUDA implementations (CUDA)
# ---------------------------------------------------------------------------


def _cuda_block(D=128, H=64, E=32, k=8, dtype=mx.bfloat16, router_scale=4.0):
    return moe_blocks.make_block(D=D, H=H, E=E, k=k, dtype=dtype, router_scale=router_scale)


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("n", [16, 128, 333, 1100])
def test_block_cuda_prefill_vs_reference(n):
    block = _cuda_block(D=256, H=128, E=64, k=8)
    x = mx.random.normal((1, n, 256), key=mx.random.key(n)).astype(mx.bfloat16)
    assert gg.supports(x.reshape(n, 256), block.switch_mlp.gate_proj,
                       block.switch_mlp.up_proj, block.switch_mlp.down_proj)
    got = moe.sparse_moe(block, x, implementation="cuda-prefill")
    ref = moe.sparse_moe(block, x, implementation="reference")
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert finite(got)
    # Tokens whose k-th and (k+1)-th router probabilities tie exactly (bf16
    # logits of 64 experts tie often enough) may pick either expert, in the
    # kernel (lower id) as in the reference (argpartition): compare the rest.
    probs = np.asarray(mx.softmax(block.gate(x.reshape(n, 256)).astype(mx.float32), axis=-1, precise=True))
    top = -np.sort(-probs, axis=1)
    keep = top[:, block.top_k - 1] > top[:, block.top_k]
    assert keep.sum() >= n // 2
    assert_close(npa(got.reshape(n, 256))[keep], npa(ref.reshape(n, 256))[keep], GATHER_QMM_TOL,
                 "vs the reference block (gather_qmm)")


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
def test_block_shared_expert_in_slot_or_dense(monkeypatch):
    """The block's shared expert: in the routing's shared slot (router and
    gate as one matmul, the logit read from its column; a gate of another
    kind: its logits passed apart), from the smallest call the prefill
    kernels take; where the slot does not apply, MLX's dense matmuls beside
    the routed kernels. All are the same block (dense: bf16 products, slot:
    fp32)."""
    n = 1029
    block = moe_blocks.make_block(D=256, H=128, E=64, k=8, dtype=mx.bfloat16, seed=3)
    x = mx.random.normal((1, n, 256), key=mx.random.key(5)).astype(mx.bfloat16)
    calls = []
    real_experts, real_route = gg.moe_experts_unchecked, mr.route_and_group  # what the block calls (unchecked entry)

    def counted_experts(*a, **k):
        calls.append(("slot" if k.get("shared_expert") is not None else "routed", a[0].shape[0]))
        return real_experts(*a, **k)

    def counted_route(*a, **k):
        calls.append(("column" if k.get("shared_column") else "logits" if k.get("shared_logits") is not None
                      else "plain", a[0].shape[0]))
        return real_route(*a, **k)

    monkeypatch.setattr(gg, "moe_experts_unchecked", counted_experts)
    monkeypatch.setattr(mr, "route_and_group", counted_route)

    def run(tokens):
        calls.clear()
        return moe.sparse_moe(block, x[:, :tokens], implementation="cuda-prefill")

    slot = run(n)
    assert calls == [("column", n), ("slot", n)]
    # a shared gate unlike the router (dense fp32): no joint matmul, its logits cast and passed apart
    joint_gate = block.shared_expert_gate
    block.shared_expert_gate = nn.Linear(256, 1, bias=False)
    block.shared_expert_gate.weight = mx.random.normal((1, 256), key=mx.random.key(8)) * 0.05
    apart = run(n)
    assert calls == [("logits", n), ("slot", n)]
    dense_gate = moe.sparse_moe(block, x, implementation="reference")
    assert finite(apart)
    assert_close(apart, dense_gate, GATHER_QMM_TOL, "gate apart vs the reference block")
    block.shared_expert_gate = joint_gate
    s = moe.PREFILL_MIN_TOKENS
    run(s)
    assert calls == [("column", s), ("slot", s)]
    monkeypatch.setattr(moe.cuda, "_shared_in_slot", lambda *a, **k: False)  # where the slot does not apply
    dense = run(n)
    assert calls == [("plain", n), ("routed", n)]
    assert finite(slot, dense)
    assert_close(slot, dense, GATHER_QMM_TOL, "slot vs dense shared expert")


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("n", [1, 4])
def test_moe_decode_block_vs_ops_and_stock(n):
    block = moe_blocks.make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16)
    x = (mx.random.normal((1, n, 256), key=mx.random.key(n)) * 1.5).astype(mx.bfloat16)
    assert moe.decode_plan(block, x) is not None and moe.implementation_for(n) == "cuda-decode"
    got = moe.moe_decode(block, x)
    assert got.shape == x.shape and got.dtype == mx.bfloat16 and finite(got)
    # same routing through the ops path (gather_qmm, fp32 combine)
    tok = x.reshape(n, 256)
    inds, scores = mr.route(block.gate(tok), 8)
    sm = block.switch_mlp
    groups = moe.group_by_expert(inds, 32)
    ref = moe.combine(moe.expert_swiglu(tok, groups, sm.gate_proj, sm.up_proj, sm.down_proj), scores, dtype=mx.float32)
    ref = ref + moe.shared_expert(block, tok).astype(mx.float32)
    assert_close(got.reshape(n, 256), ref, GATHER_QMM_TOL, "vs the ops path (gather_qmm)")
    host = moe_decode_reference(tok, inds, scores, *moe.decode_arrays(block))[2]
    assert_close(got.reshape(n, 256), host, tolerance(mx.bfloat16, roundings=2), "vs the fp32 host reference")
    # stock mlx-lm block (its own bf16 routing: may differ on near-ties)
    stock = moe.sparse_moe(block, x, implementation="stock")
    assert_close(got, stock, 2 * GATHER_QMM_TOL, "vs stock")


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("n", [1, 2, 4])
def test_moe_decode_step_compiled_equals_eager(n):
    """The mx.compile'd step = the eager launches, bit for bit, for several
    layers through one trace; a replaced weight is read."""
    blocks = [moe_blocks.make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16, seed=s) for s in (3, 4)]
    for i, block in enumerate(blocks):
        x = (mx.random.normal((1, n, 256), key=mx.random.key(10 * n + i)) * 1.5).astype(mx.bfloat16)
        got = moe._cuda_decode(block, x)
        assert got.shape == x.shape and finite(got)
        assert mx.array_equal(got, moe.moe_decode(block, x)).item()
        assert mx.array_equal(got, moe.sparse_moe(block, x)).item()  # the default dispatch
    # replace the routed experts' down projection of block 0: the step must follow
    block = blocks[0]
    x = (mx.random.normal((1, n, 256), key=mx.random.key(99)) * 1.5).astype(mx.bfloat16)
    before = moe._cuda_decode(block, x)
    block.switch_mlp.down_proj.scales = block.switch_mlp.down_proj.scales * 2
    after = moe._cuda_decode(block, x)
    assert mx.array_equal(after, moe.moe_decode(block, x)).item()
    assert not mx.array_equal(after, before).item()


#: The CPU-run parameter sets (tests/cuda_check.py) of the decode step that
#: routes in the gate+up kernel, compared with (or falling back to) the
#: routing kernel's launch.
CPU_ROUTE = pytest.mark.cpu_check("moe_decode_gemv.cu", "moe_routing.cu")


def assert_step_equals_eager(block, x, env):
    """The block's compiled decode step (``_cuda_decode``) = the eager
    launches, bit for bit: with the GEMV switch on, the decode kernels on
    the step's router logits (the fused GEMV's, whose sums agree with
    MLX's matmul to bf16 rounding, not bit for bit: ops/linear.py); with it
    off, :func:`moe.moe_decode` (the router by MLX's matmul in both).
    Leaves the switch off (``env`` restores it after the test)."""
    from mlx_qwen_fast.compiled import linear_arrays
    from mlx_qwen_fast.ops import linear as linear_ops

    got = moe._cuda_decode(block, x)
    d, E, k = x.shape[-1], block.num_experts, block.top_k
    tok = x.reshape(-1, d)
    logits = linear_ops.decode_linear(tok, *linear_arrays(block.gate))
    arrs = moe.decode_arrays(block)
    if md.route_fits(E, k):
        want = md.moe_decode_logits(tok, logits, k, *arrs, normalize=block.norm_topk_prob)
    else:
        inds, scores = mr.route(logits, k, normalize=block.norm_topk_prob)
        want = md.moe_decode_arrays(tok, inds, scores, *arrs)
    assert got.shape == x.shape and finite(got) and mx.array_equal(got.reshape(-1, d), want).item()
    env.set(config.DECODE_GEMV_KERNEL.name, "0")
    assert mx.array_equal(moe._cuda_decode(block, x), moe.moe_decode(block, x)).item()


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("n,E", [pytest.param(n, 64, marks=CPU_ROUTE) for n in (1, 2, 3, 4)]
                         + [(n, 160) for n in (1, 2, 3, 4)])
def test_decode_step_routing_in_the_kernel_equals_the_routing_launch(n, E, env):
    """The compiled decode step routing inside the gate+up kernel (router,
    gate+up, down: three launches) = the same step with the routing
    kernel's launch (four), bit for bit, plain and with the decoder layer's
    norm and residual; the block's plan takes the former, and equals the
    eager launches. (The one-launch block, which routes in its kernel
    too, off: its own test is test_block_switch_runs_the_one_launch_block.)"""
    from mlx_qwen_fast.compiled import gather, linear_arrays

    env.set(config.MOE_BLOCK_KERNEL.name, "0")
    block = moe_blocks.make_block(D=256, H=128, E=E, k=8, dtype=mx.bfloat16, seed=n + E)
    x = (mx.random.normal((1, n, 256), key=mx.random.key(n + E)) * 1.5).astype(mx.bfloat16)
    nw = (1.0 + 0.1 * mx.random.normal((256,), key=mx.random.key(E))).astype(mx.bfloat16)
    router = linear_arrays(block.gate)
    bits = moe.decode_arrays(block)[2][3]
    for norm_eps in (None, 1e-6):
        paths, fn = moe._decode_step_plan(block, x, norm_eps)
        routed, apart = (moe._compiled_decode_step(block.top_k, block.norm_topk_prob, router[1], len(router[0]),
                                                   bits, in_kernel, norm_eps) for in_kernel in (True, False))
        assert fn is routed
        args = (x,) if norm_eps is None else (x, nw)
        got, want = routed(*args, *gather(block, paths)), apart(*args, *gather(block, paths))
        mx.eval(got, want)
        assert got.shape == x.shape and finite(got) and mx.array_equal(got, want).item()
    assert_step_equals_eager(block, x, env)


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("n", [pytest.param(1, marks=CPU_ROUTE), pytest.param(4, marks=CPU_ROUTE)])
def test_decode_step_with_more_experts_than_the_kernel_routes(n, env):
    """E = 544 > ROUTE_MAX_EXPERTS: the step keeps the routing kernel's
    launch (its key says so); compiled = eager bit for bit, and the fp32
    host reference on the routing kernel's ids within the decode kernels'
    bound."""
    block = moe_blocks.make_block(D=256, H=128, E=544, k=8, dtype=mx.bfloat16, seed=n)
    x = (mx.random.normal((1, n, 256), key=mx.random.key(n)) * 1.5).astype(mx.bfloat16)
    assert not md.route_fits(block.num_experts, block.top_k)
    from mlx_qwen_fast.compiled import linear_arrays

    router = linear_arrays(block.gate)
    bits = moe.decode_arrays(block)[2][3]
    assert moe._decode_step_plan(block, x)[1] is moe._compiled_decode_step(
        block.top_k, block.norm_topk_prob, router[1], len(router[0]), bits, False)
    assert_step_equals_eager(block, x, env)
    tok = x.reshape(n, 256)
    inds, scores = mr.route(block.gate(tok), 8)
    host = moe_decode_reference(tok, inds, scores, *moe.decode_arrays(block))[2]
    assert_close(moe.moe_decode(block, x).reshape(n, 256), host, tolerance(mx.bfloat16, roundings=2),
                 "vs the fp32 host reference")


# ---------------------------------------------------------------------------
# Metal decode: the dispatch (any backend) and the block on simulated Metal
# ---------------------------------------------------------------------------

METAL_MODULES = ("mlx_qwen_fast.kernels.moe_route_metal", "mlx_qwen_fast.kernels.moe_gate_up_metal",
                 "mlx_qwen_fast.kernels.moe_down_metal")


def test_metal_dispatch(env, monkeypatch):
    """On Metal "metal-decode" for 1..4 tokens and "metal-prefill" for more
    when MLX_QWEN_FAST_METAL=1 (stock otherwise, and without a Metal
    device); the patch report names them; forced where MLX has no Metal
    device, the stock block runs."""
    from mlx_qwen_fast import patch_report

    monkeypatch.setattr(mx.metal, "is_available", lambda: True)  # the table for a machine with Metal
    env.unset(config.METAL_KERNELS.name)
    assert [moe.implementation_for(n, "metal") for n in (1, 4, 5, 2048)] == ["stock"] * 4  # opt-in
    env.set(config.METAL_KERNELS.name, "1")
    for n in (0, 1, 2, 3, 4, 5, moe.PREFILL_MIN_TOKENS, 4096):
        want = "stock" if n == 0 else "metal-decode" if n <= 4 else "metal-prefill"
        assert moe.implementation_for(n, "metal") == want, n
        assert moe.implementation_for(n, "cpu") == "stock"
    ops = patch_report.op_implementations("metal")
    assert ops["moe.decode"] == "metal-decode" and ops["moe.prefill"] == "metal-prefill"
    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    assert moe.implementation_for(1, "metal") == moe.implementation_for(5, "metal") == "stock"
    block = make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16, seed=3)
    for n, name in ((1, "metal-decode"), (6, "metal-prefill")):
        x = mx.random.normal((1, n, 256), key=mx.random.key(2)).astype(mx.bfloat16)
        assert mx.array_equal(moe.sparse_moe(block, x, implementation=name), moe._stock(block, x)).item()


def test_metal_decode_plan_shapes():
    """The Metal decode kernels take 1..4 bf16 tokens of a 4-bit group-64
    block with bf16 scales, D and I multiples of 64 (blocks the CUDA
    kernels decline among them), E a multiple of 32, at most 32 (token,
    expert) pairs, unsharded (pure: nothing built)."""
    block = make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16)
    for n in (1, 2, 3, 4):
        assert moe.metal_decode_plan(block, mx.zeros((n, 256), mx.bfloat16)) is not None
    assert moe.metal_decode_plan(block, mx.zeros((1, 2, 256), mx.bfloat16)) is not None
    assert moe.metal_decode_plan(block, mx.zeros((5, 256), mx.bfloat16)) is None  # N > 4
    assert moe.metal_decode_plan(block, mx.zeros((1, 256), mx.float32)) is None  # not bf16
    narrow = make_block(D=192, H=64, E=32, k=8, dtype=mx.bfloat16)
    x = mx.zeros((1, 192), mx.bfloat16)
    assert moe.metal_decode_plan(narrow, x) is not None and moe.decode_plan(narrow, x) is None
    assert moe.metal_decode_plan(make_block(D=128, H=128, E=16, k=4, dtype=mx.bfloat16),
                                 mx.zeros((1, 128), mx.bfloat16)) is None  # E % 32
    wide = make_block(D=128, H=64, E=32, k=16, dtype=mx.bfloat16)
    assert moe.metal_decode_plan(wide, mx.zeros((2, 128), mx.bfloat16)) is not None
    assert moe.metal_decode_plan(wide, mx.zeros((3, 128), mx.bfloat16)) is None  # 48 pairs > 32
    f32 = make_block(D=256, H=128, E=32, k=8, dtype=mx.float32)
    assert moe.metal_decode_plan(f32, mx.zeros((1, 256), mx.bfloat16)) is None  # fp32 scales
    block.sharding_group = object()
    assert moe.metal_decode_plan(block, mx.zeros((1, 256), mx.bfloat16)) is None


@pytest.fixture
def metal(monkeypatch, env):
    """The dispatch as on Apple silicon with MLX_QWEN_FAST_METAL=1, every
    Metal kernel of the MoE run from MLX's generated source on the CPU
    (tests/metal_check.py). Yields the three kernel modules."""
    import metal_check as mc

    from mlx_qwen_fast import backend

    if mc.CXX is None:
        pytest.skip("no C++ compiler (g++) to build the Metal sources")
    env.set(config.METAL_KERNELS.name, "1")
    with mc.simulated_modules(*METAL_MODULES) as mods:
        monkeypatch.setattr(backend, "current", lambda: backend.METAL)
        yield mods


@pytest.mark.parametrize("n", [1, 4])
def test_metal_decode_block_vs_reference(metal, n):
    """The block through the default dispatch on (simulated) Metal: one
    launch of each kernel, every output written; within the bf16 bound of
    the fp32 host reference on the kernels' routing, and of the reference
    block (bf16 gather_qmm: GATHER_QMM_TOL), whose fp32 selection is the
    same experts where no two logits tie at the top-k boundary (bf16
    logits tie often; the kernels then take the lower id, the reference any:
    the seeds give no such tie, asserted); a second call reuses the plan,
    the same bits."""
    block = make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16, seed=40 + n)
    assert moe.decide_kernels(block) == {}
    x = (mx.random.normal((1, n, 256), key=mx.random.key(50 + n)) * 1.5).astype(mx.bfloat16)
    assert moe.implementation_for(n) == "metal-decode"
    got = moe.sparse_moe(block, x)
    assert [m._kernel().calls for m in metal] == [1, 1, 1]
    assert got.shape == x.shape and got.dtype == mx.bfloat16 and finite(got)
    assert mx.array_equal(moe.sparse_moe(block, x), got).item()
    assert [m._kernel().calls for m in metal] == [2, 2, 2]
    tok = x.reshape(n, 256)
    logits = block.gate(tok)
    inds, scores = metal[0].route_metal(logits, 8)
    host = moe_decode_reference(tok, inds, scores, *moe.decode_arrays(block))[2]
    assert_close(got.reshape(n, 256), host, tolerance(mx.bfloat16, roundings=2), "vs the fp32 host reference")
    lg = -np.sort(-npa(logits), axis=-1)  # the softmax orders as the logits
    assert np.all(lg[:, 7] > lg[:, 8]), "a tie at the top-k boundary: pick another seed"
    ref_inds, _ = moe.route(logits, 8)
    assert np.array_equal(np.sort(np.asarray(inds), -1), np.sort(np.asarray(ref_inds).astype(np.int32), -1))
    assert_close(got, moe.sparse_moe_block(block, x), GATHER_QMM_TOL, "vs the reference block")


def test_metal_decode_declines_to_stock(metal):
    """The stock block's own result, no Metal kernel launched: a block
    whose experts are 3-bit (declined at decide time), fp32 activations,
    more than 4 tokens."""
    odd = make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16, seed=5,
                     quant={"switch_mlp": {"bits": 3, "group_size": 64}})
    assert "metal-decode" in moe.decide_kernels(odd)
    x = mx.random.normal((1, 2, 256), key=mx.random.key(6)).astype(mx.bfloat16)
    assert mx.array_equal(moe.sparse_moe(odd, x), moe._stock(odd, x)).item()
    block = make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16, seed=5)
    x32 = x.astype(mx.float32)
    assert mx.array_equal(moe._metal_decode(block, x32), moe._stock(block, x32)).item()
    assert [m._kernel().calls for m in metal] == [0, 0, 0]


# ---------------------------------------------------------------------------
# Metal prefill: the block on simulated Metal
# ---------------------------------------------------------------------------

METAL_PREFILL_MODULES = ("mlx_qwen_fast.kernels.moe_route_metal", "mlx_qwen_fast.kernels.moe_group_metal",
                         "mlx_qwen_fast.kernels.moe_grouped_gemm_metal")


@pytest.fixture
def metal_prefill(monkeypatch, env):
    """As the ``metal`` fixture, for the prefill's kernel modules. Yields
    ``calls()``: the launches of (routing, count, scatter, gate+up, down)."""
    import metal_check as mc

    from mlx_qwen_fast import backend

    if mc.CXX is None:
        pytest.skip("no C++ compiler (g++) to build the Metal sources")
    env.set(config.METAL_KERNELS.name, "1")
    with mc.simulated_modules(*METAL_PREFILL_MODULES) as (rm, gm, gg):
        monkeypatch.setattr(backend, "current", lambda: backend.METAL)
        yield lambda: [rm._kernel().calls, gm._kernel("count").calls, gm._kernel("scatter").calls,
                       gg._kernel("gate_up").calls, gg._kernel("down").calls]


@pytest.mark.parametrize("dtype, n", [(mx.float32, 7), (mx.bfloat16, 20)])
def test_metal_prefill_block_vs_reference(metal_prefill, dtype, n):
    """The block through the default dispatch on (simulated) Metal, more than
    4 tokens: one launch of each of the five kernels, the output finite;
    fp32 (fp32 scales: the Metal prefill reads them) within FP32_TOL of the
    reference block (the same fp32 selection where no two probabilities tie
    at the top-k boundary: asserted), bf16 within GATHER_QMM_TOL of it (the
    reference's bf16 gather_qmm)."""
    block = make_block(D=128, H=64, E=32, k=4, dtype=dtype, seed=60 + n)
    assert "metal-prefill" not in moe.decide_kernels(block)
    x = (mx.random.normal((1, n, 128), key=mx.random.key(70 + n)) * 1.5).astype(dtype)
    assert moe.implementation_for(n) == "metal-prefill"
    got = moe.sparse_moe(block, x)
    assert metal_prefill() == [1] * 5
    assert got.shape == x.shape and got.dtype == dtype and finite(got)
    lg = -np.sort(-npa(block.gate(x.reshape(n, 128)).astype(mx.float32)), axis=-1)
    assert np.all(lg[:, 3] > lg[:, 4]), "a tie at the top-k boundary: pick another seed"
    ref = moe.sparse_moe_block(block, x)
    assert_close(got, ref, FP32_TOL if dtype == mx.float32 else GATHER_QMM_TOL, "vs the reference block")


def test_metal_prefill_declines_to_stock(metal_prefill):
    """The stock block's own result, no Metal kernel launched: experts
    3-bit (declined at decide time), a router of 16 experts (the routing
    kernel takes multiples of 32), unquantised experts, a sharded block
    (the plan's own checks)."""
    x = mx.random.normal((1, 6, 128), key=mx.random.key(8)).astype(mx.bfloat16)
    odd = make_block(D=128, H=64, E=32, k=4, dtype=mx.bfloat16, seed=5,
                     quant={"switch_mlp": {"bits": 3, "group_size": 64}})
    assert "metal-prefill" in moe.decide_kernels(odd)
    assert mx.array_equal(moe.sparse_moe(odd, x), moe._stock(odd, x)).item()
    dense = make_block(D=128, H=64, E=32, k=4, dtype=mx.float32, seed=5, quant={"switch_mlp": False})
    for block, xb in ((make_block(D=128, H=64, E=16, k=4, dtype=mx.bfloat16, seed=5), x),
                      (dense, x.astype(mx.float32))):  # (MLX's CPU gather_mm: fp32 only)
        assert moe.metal_prefill_plan(block, xb) is None
        assert mx.array_equal(moe._metal_prefill(block, xb), moe._stock(block, xb)).item()
    sharded = make_block(D=128, H=64, E=32, k=4, dtype=mx.bfloat16, seed=5)
    assert moe.metal_prefill_plan(sharded, x) is not None
    sharded.sharding_group = object()
    assert moe.metal_prefill_plan(sharded, x) is None
    assert metal_prefill() == [0] * 5


_BLOCK_SOURCES = ("moe_block_decode.cu", "quantized_gemv.cu", "moe_decode_gemv.cu")


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("n", [pytest.param(1, marks=pytest.mark.cpu_check(*_BLOCK_SOURCES)),
                               pytest.param(3, marks=pytest.mark.cpu_check(*_BLOCK_SOURCES))])
def test_block_switch_runs_the_one_launch_block(env, monkeypatch, n):
    """With ``config.MOE_BLOCK_KERNEL`` on, the fused decode step
    (:func:`moe.decode_step_parts` with the post-attention norm) runs the
    one-launch MoE block; over three chained steps its outputs equal the
    three launches' (the switch off) bit for bit (bf16: the same device code
    in the same order). With the fused GEMV off the switch is ignored."""
    from mlx_qwen_fast.compiled import gather
    from mlx_qwen_fast.kernels import moe_block_decode as k_block

    from cuda_helpers import HAS_CUDA

    monkeypatch.setattr(moe, "implementation_for", lambda n, backend=None: "cuda-decode")
    if not HAS_CUDA:  # the CUDA check: a grid of 8 blocks of 512 threads (fibers), not one per SM
        monkeypatch.setattr(cb, "sm_count", lambda: 8)
    seed = int(np.random.default_rng().integers(1 << 30))
    block = make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16, seed=seed % 1000)
    ks = mx.random.split(mx.random.key(seed), 2)
    nw = (1.0 + 0.1 * mx.random.normal((256,), key=ks[0])).astype(mx.bfloat16)
    h0 = (2.0 * mx.random.normal((n, 1, 256), key=ks[1])).astype(mx.bfloat16)
    launched = []
    real = k_block.moe_block_decode_unchecked
    monkeypatch.setattr(k_block, "moe_block_decode_unchecked", lambda *a, **k: launched.append(1) or real(*a, **k))
    monkeypatch.setattr(moe.cuda, "_decode_steps", {})
    runs = {}
    for one, gemv in (("1", "1"), ("0", "1"), ("1", "0")):
        env.set(config.MOE_BLOCK_KERNEL.name, one)
        env.set(config.DECODE_GEMV_KERNEL.name, gemv)
        launched.clear()
        paths, fn = moe.decode_step_parts(block, h0, norm_eps=1e-6)
        arrays = gather(block, paths)
        h, ys = h0, []
        for _ in range(3):
            h = fn(h, nw, *arrays)
            mx.eval(h)
            ys.append(h)
        runs[one, gemv] = ys
        assert bool(launched) == (one == gemv == "1"), (one, gemv, launched)
    for i, (y, y_ref) in enumerate(zip(runs["1", "1"], runs["0", "1"])):
        assert y.shape == y_ref.shape == h0.shape and y.dtype == y_ref.dtype
        assert finite(y) and mx.array_equal(y, y_ref).item(), f"seed {seed}: step {i}"


@pytest.mark.parametrize("shape", [(0, 64), (1, 0, 64)])
def test_shared_expert_and_block_without_rows(shape):
    """No rows (MLX's quantised matmul takes none: it divides by zero): the
    shared expert, the dispatcher and the reference block return an empty
    array of x's shape."""
    block = make_block(D=64, H=64, E=16)
    x = mx.zeros(shape, mx.float32)
    for got in (moe.shared_expert(block, x), moe.sparse_moe(block, x), moe.sparse_moe_block(block, x)):
        mx.eval(got)
        assert got.shape == x.shape and got.dtype == x.dtype
