"""The MoE routing kernels (``kernels/moe_routing.py``: softmax + top-k,
grouping by expert, block map, the shared expert's slot) vs the reference
ops of ``ops.moe`` (``route``, ``group_by_expert``, ``block_map``).

Launch plans, argument checks and the launch's shapes (a recorded stand-in
kernel) run on any backend; the kernels on CUDA, outputs poisoned with NaN
before every launch, fresh random logits. Routing outputs are integers
(compared exactly) and fp32 probabilities (``rtol=2e-6``: the kernel's and
MLX's fp32 softmax differ in summation order only).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from moe_blocks import make_logits
from mlx_qwen_fast.kernels import moe_routing as mr
from mlx_qwen_fast.ops import moe

#: The CPU-run parameter sets (tests/cuda_check.py): the small token counts.
CPU = pytest.mark.cpu_check("moe_routing.cu")

# ---------------------------------------------------------------------------
# host side (any backend)
# ---------------------------------------------------------------------------


def test_plan_and_tiles():
    p = mr.plan(4096, 8, 256, 64)
    assert p["num_assignments"] == 32768
    assert p["max_tiles"] == 32768 // 64 + 256 == moe.max_tiles(32768, 256, 64)
    assert p["route_grid"] == (512 * 256, 1, 1)
    assert mr.plan(7, 8, 256, 32)["max_tiles"] == 2 + 256
    assert mr.plan(0, 8, 256, 32)["route_grid"][0] == 256
    # grouping: chunks of 1024 assignments up to GROUP_MAX_CTAS CTAs, then longer chunks
    assert (p["group_chunk"], p["group_grid"], p["group_block"]) == (1024, (32 * 1024, 1, 1), (1024, 1, 1))
    assert mr.plan(1, 8, 256, 32)["group_grid"] == (1024, 1, 1)
    assert mr.plan(0, 8, 256, 32)["group_grid"] == (1024, 1, 1)
    big = mr.plan(16385, 8, 256, 64)  # 131080 assignments > 128 * 1024
    assert big["group_chunk"] == 2048 and big["group_grid"][0] == 65 * 1024
    # the largest call: 32-bit grids, chunk ends and block-map indices stay in range
    top = mr.plan(mr.MAX_TOKENS, mr.MAX_ASSIGNMENTS // mr.MAX_TOKENS, 1024, 1)
    assert top["group_grid"][0] // 1024 <= mr.GROUP_MAX_CTAS
    assert top["group_grid"][0] // 1024 * top["group_chunk"] < 2**31 and 2 * top["max_tiles"] < 2**31
    assert mr.plan(mr.MAX_TOKENS, 1, 256, 64)["route_grid"][0] < 2**31
    for bad in [(mr.MAX_TOKENS + 1, 1, 256, 64), (mr.MAX_TOKENS, mr.MAX_ASSIGNMENTS // mr.MAX_TOKENS + 1, 256, 64),
                (4, 8, 256, mr.MAX_TILE_ROWS + 1), (4.5, 8, 256, 32), (4, 8.0, 256, 32)]:
        with pytest.raises(ValueError, match="plan"):
            mr.plan(*bad)
    with pytest.raises(ValueError, match="tile_rows"):
        mr.plan(4, 8, 256, 0)


def test_routing_argument_errors():
    # checked before any GPU work: ValueError naming the argument, on any backend
    inds = mx.zeros((2, 8), mx.int32)
    for call, name in [
        (lambda: mr.route(mx.array(1.0), 1), "logits"),
        (lambda: mr.route([[0.0] * 64], 1), "logits"),
        (lambda: mr.route(mx.zeros((2, 64)), 2.0), "top_k"),
        (lambda: mr.route(mx.zeros((2, 48)), 2), "logits must"),
        (lambda: mr.route(mx.zeros((2, 64)), 33), "top_k must"),  # the logits are fine: top_k is named alone
        (lambda: mr.route(mx.zeros((2, 64)), 0), "top_k must"),
        (lambda: mr.group(inds, 256, 2**31 - 1), "tile_rows"),
        (lambda: mr.group(inds, 256, 1.5), "tile_rows"),
        (lambda: mr.group(inds, 256.0, 32), "num_experts"),
        (lambda: mr.group(mx.zeros((2, 0), mx.int32), 256, 32), "k"),
        (lambda: mr.group(mx.zeros((2, 8), mx.float32), 256, 32), "inds"),
        (lambda: mr.group([[1] * 8], 256, 32), "inds"),
    ]:
        with pytest.raises(ValueError, match=name):
            call()
    assert not mr.supports(mx.array(1.0), 1)


def test_supports_is_false_off_cuda():
    from mlx_qwen_fast.kernels import _cuda_build as cb

    if cb.cuda_available():
        pytest.skip("checks the answer without a CUDA device")
    assert not mr.supports(mx.zeros((3, 256)), 8)


def test_shared_slot_sizes():
    """The shared slot's grouping counts E rounded up to the next multiple of
    32 above E; the slot fits while a token's k + 1 slots fit a warp and the
    grouping's 1,024 experts hold E + 32."""
    assert [mr.shared_group_experts(e) for e in (32, 64, 256, 255)] == [64, 96, 288, 256]
    assert [mr.shared_slot_fits(E, k) for E, k in ((256, 8), (992, 31), (1024, 8), (256, 32))] == [
        True, True, False, False]


def test_shared_slot_argument_errors():
    """Bad shared logits and a slot that does not fit are named before
    anything compiles (any backend)."""
    n, E, k = 40, 32, 8
    logits = mx.zeros((n, E), mx.bfloat16)
    with pytest.raises(ValueError, match="shared_logits"):
        mr.route(logits, k, shared_logits=mx.zeros((n, 1), mx.float32))  # another dtype
    with pytest.raises(ValueError, match="shared_logits"):
        mr.route(logits, k, shared_logits=mx.zeros((n, 2), mx.bfloat16))
    with pytest.raises(ValueError, match="top_k < 32"):
        mr.route(mx.zeros((n, 64), mx.bfloat16), 32, shared_logits=mx.zeros((n, 1), mx.bfloat16))  # 33 slots
    with pytest.raises(ValueError, match="E <= 992"):  # 1,056 grouped experts: more than the grouping takes
        mr.route(mx.zeros((n, 1024), mx.bfloat16), k, shared_logits=mx.zeros((n, 1), mx.bfloat16))
    with pytest.raises(ValueError, match="E \\+ 32"):
        mr.route(mx.zeros((n, E + 16), mx.bfloat16), k, shared_column=True)  # E + 32 columns needed
    with pytest.raises(ValueError, match="not both"):
        mr.route(mx.zeros((n, E + 32), mx.bfloat16), k, shared_column=True, shared_logits=mx.zeros((n, 1), mx.bfloat16))


@pytest.mark.parametrize("mode", ["plain", "input", "column"])
def test_route_launch_counts_tokens(monkeypatch, mode):
    """route() launches one warp per token with N = the rows of the logits,
    whatever their width (the shared column's E + 32 included: an N taken
    from E alone once made the kernel write rows past its outputs on the
    H200), and asks for [N, k (+1)] outputs (any backend: the launch is
    recorded, not run)."""
    seen = {}

    class Recorder:
        def __call__(self, inputs, output_shapes, output_dtypes, grid, threadgroup, scalars):
            seen.update(inputs=inputs, shapes=output_shapes, grid=grid, scalars=scalars)
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

    monkeypatch.setattr(mr, "_kernel", lambda stage, **defs: seen.update(defs=defs) or Recorder())
    n, E, k = 37, 64, 8
    logits = mx.zeros((n, E + (32 if mode == "column" else 0)), mx.bfloat16)
    kw = {"shared_column": True} if mode == "column" else (
        {"shared_logits": mx.zeros((n, 1), mx.bfloat16)} if mode == "input" else {})
    inds, scores = mr.route(logits, k, **kw)
    slots = k + (mode != "plain")
    assert seen["scalars"][0] == n and seen["grid"] == mr.plan(n, slots, E, 1)["route_grid"]
    assert seen["shapes"] == [(n, slots), (n, slots)] and inds.shape == (n, slots)
    assert seen["defs"]["MOE_E"] == E and seen["defs"].get("MOE_SHARED", 0) == {"plain": 0, "input": 1,
                                                                                  "column": 2}[mode]
    assert len(seen["inputs"]) == (2 if mode == "input" else 1)


# ---------------------------------------------------------------------------
# kernels (CUDA)
# ---------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
def test_route_takes_leading_axes():
    """route on [B, L, E] logits: the [B*L, E] result in [B, L, k] (no
    reshape node in the decode step); an empty leading axis gives empty."""
    logits = mx.random.normal((2, 3, 256), key=mx.random.key(31))
    i3, s3 = mr.route(logits, 8)
    i2, s2 = mr.route(logits.reshape(6, 256), 8)
    assert i3.shape == (2, 3, 8) and s3.shape == (2, 3, 8)
    assert mx.array_equal(i3.reshape(6, 8), i2).item() and mx.array_equal(s3.reshape(6, 8), s2).item()
    e_i, e_s = mr.route(mx.zeros((1, 0, 256)), 8)
    assert e_i.shape == (1, 0, 8) and e_s.shape == (1, 0, 8)


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("E,k", [pytest.param(256, 8, marks=CPU), pytest.param(64, 4, marks=CPU),
                                 pytest.param(992, 31, marks=CPU)])
def test_route_ties_take_the_lowest_id_first(E, k):
    """Exact ties (logits from {0, 1, 2, 3}): slot j is the j-th expert by
    (probability descending, id ascending), every token (route_warp's rule)."""
    rng = np.random.default_rng(E + k)
    lg = rng.integers(0, 4, size=(33, E)).astype(np.float32)
    lg[0] = 0.0  # every expert tied
    inds, scores = mr.route(mx.array(lg), k)
    want = np.stack([np.lexsort((np.arange(E), -row))[:k] for row in lg])
    assert np.array_equal(np.asarray(inds), want)
    assert np.all(np.diff(np.asarray(scores), axis=1) <= 0)


def check_routing(logits, k, tile, normalize=True):
    E = logits.shape[1]
    r = mr.route_and_group(logits, k, tile, normalize=normalize)
    inds, scores = r.inds, r.scores
    assert inds.dtype == mx.int32 and scores.dtype == mx.float32
    ref_i, ref_s = moe.route(logits, k, normalize=normalize)
    ii, ss = np.asarray(inds), np.asarray(scores)
    ri, rs = np.asarray(ref_i).astype(np.int64), np.asarray(ref_s)
    # selection: the same probabilities (ties may pick different ids)
    np.testing.assert_allclose(np.sort(ss, 1), np.sort(rs, 1), rtol=2e-6, atol=1e-7)
    probs = np.asarray(mx.softmax(logits.astype(mx.float32), axis=-1, precise=True))
    sel = np.take_along_axis(probs, ii, 1)
    want = sel / sel.sum(1, keepdims=True) if normalize else sel
    np.testing.assert_allclose(ss, want, rtol=2e-6, atol=1e-7)
    assert np.all(np.diff(ss, axis=1) <= 0)  # decreasing probability
    assert all(len(set(row)) == k for row in ii.tolist())
    if logits.dtype == mx.float32:  # no ties: the same experts
        assert np.array_equal(np.sort(ii, 1), np.sort(ri, 1))
    # grouping, against the reference grouping of the kernel's own inds
    g = r.groups
    ref = moe.group_by_expert(inds, E)
    assert np.array_equal(np.asarray(g.counts), np.asarray(ref.counts))
    assert np.array_equal(np.asarray(g.offsets), np.asarray(ref.offsets))
    assert np.array_equal(np.asarray(g.sorted_experts), np.asarray(ref.sorted_experts))
    order, inv = np.asarray(g.order), np.asarray(g.inverse)
    nk = ii.size
    assert np.array_equal(np.sort(order), np.arange(nk))
    assert np.array_equal(ii.reshape(-1)[order], np.asarray(ref.sorted_experts))
    assert np.array_equal(inv[order], np.arange(nk))
    # same set per expert as the stable reference (order within is free)
    off = np.asarray(g.offsets)
    ro = np.asarray(ref.order)
    for e in np.nonzero(np.asarray(g.counts))[0][:64]:
        a, b = off[e], off[e + 1]
        assert np.array_equal(np.sort(order[a:b]), ro[a:b])
    assert np.array_equal(np.asarray(r.block_map), np.asarray(moe.block_map(ref, tile)))
    return r


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("n", [pytest.param(1, marks=CPU), pytest.param(2, marks=CPU), pytest.param(7, marks=CPU),
                               pytest.param(64, marks=CPU), 2049, 4099])
@pytest.mark.parametrize("kind", ["random", "skewed", "empty"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_routing_vs_reference(n, kind, dtype):
    logits = make_logits(n, 256, kind, seed=n * 7 + len(kind), dtype=dtype)
    tile = 64 if n > 1000 else 32
    r = check_routing(logits, 8, tile)
    if kind == "empty":
        counts = np.asarray(r.groups.counts)
        assert np.count_nonzero(counts) == 8 and counts.sum() == n * 8


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("n", [pytest.param(1, marks=CPU), pytest.param(64, marks=CPU), 4099])
def test_routing_all_to_one_expert(n):
    logits = make_logits(n, 256, "one", seed=n, dtype=mx.float32)
    r = check_routing(logits, 1, 32)
    counts = np.asarray(r.groups.counts)
    assert counts[17] == n and counts.sum() == n
    assert np.allclose(np.asarray(r.scores), 1.0)


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("n,max_ctas", [(16385, None), (4099, 2), pytest.param(300, 1, marks=CPU)])
def test_routing_chunked_grouping(monkeypatch, n, max_ctas):
    # chunks longer than one 1024-assignment round (ragged last round), and
    # more than GROUP_MAX_CTAS * 1024 assignments at the default
    if max_ctas is not None:
        monkeypatch.setattr(mr, "GROUP_MAX_CTAS", max_ctas)
    check_routing(make_logits(n, 256, "skewed", seed=n, dtype=mx.bfloat16), 8, 64)


@pytest.mark.cuda
@pytest.mark.cpu_check("moe_routing.cu")
@pytest.mark.usefixtures("poison")
def test_routing_unnormalized_and_other_sizes():
    check_routing(make_logits(300, 128, "random", 1, mx.float32), 4, 64, normalize=False)
    check_routing(make_logits(33, 64, "skewed", 2, mx.float16), 6, 32)


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("n", [pytest.param(1, marks=CPU), pytest.param(7, marks=CPU), 2049, 4099])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("where", ["input", "column"])
def test_route_and_group_with_shared_slot(n, dtype, where):
    """The shared slot: the first k slots are route()'s without it bit for
    bit, slot k is expert E with sigmoid(logit) in fp32; the grouping counts
    E rounded up to 32 more experts: E's group holds every token once, the
    ids above it are empty, the rest is the grouping without the slot. The
    logit as a second input or as column E of [N, E + 32] logits."""
    E, k, tile = 256, 8, 64
    logits = make_logits(n, E, "skewed", seed=n, dtype=dtype)
    sl = (mx.random.normal((n, 1), key=mx.random.key(n + 1)) * 4).astype(dtype)
    if where == "input":
        r = mr.route_and_group(logits, k, tile, shared_logits=sl)
    else:
        wide = mx.concatenate([logits, sl, mx.full((n, 31), 1e4, dtype)], axis=1)  # the rest never read
        r = mr.route_and_group(wide, k, tile, shared_column=True)
    plain = mr.route_and_group(logits, k, tile)
    assert r.shared_id == E and plain.shared_id is None
    assert r.inds.shape == (n, k + 1) and r.scores.shape == (n, k + 1) and r.groups.top_k == k + 1
    assert mx.array_equal(r.inds[:, :k], plain.inds).item() and mx.array_equal(r.scores[:, :k], plain.scores).item()
    assert np.all(np.asarray(r.inds[:, k]) == E)
    want = 1.0 / (1.0 + np.exp(-np.asarray(sl.astype(mx.float32), dtype=np.float64)))
    np.testing.assert_allclose(np.asarray(r.scores[:, k:]), want, rtol=4e-7, atol=0)
    counts = np.asarray(r.groups.counts)
    assert counts.shape == (mr.shared_group_experts(E),)
    assert np.array_equal(counts[:E], np.asarray(plain.groups.counts)) and counts[E] == n
    assert not counts[E + 1:].any()
    ref = moe.group_by_expert(r.inds, mr.shared_group_experts(E))
    assert np.array_equal(np.asarray(r.groups.offsets), np.asarray(ref.offsets))
    order = np.asarray(r.groups.order)
    assert np.array_equal(np.sort(order), np.arange(n * (k + 1)))
    assert np.array_equal(np.asarray(r.inds).reshape(-1)[order], np.asarray(ref.sorted_experts))
    assert np.array_equal(np.asarray(r.block_map), np.asarray(moe.block_map(ref, tile)))


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("E,k,dtype", [(512, 31, mx.float16), (992, 8, mx.bfloat16), (64, 1, mx.float32)])
@pytest.mark.parametrize("where", ["input", "column"])
def test_route_shared_slot_other_shapes(E, k, dtype, where):
    """The shared slot at other expert counts and top-k (the slot in lane 31,
    the grouping over 544 / 1,024 experts), float16 logits, and no tokens."""
    for n in (0, 333):
        logits = make_logits(n, E, "random", seed=E + n, dtype=dtype)
        sl = (mx.random.normal((n, 1), key=mx.random.key(n + 3)) * 4).astype(dtype)
        if where == "input":
            r = mr.route_and_group(logits, k, 32, shared_logits=sl)
        else:
            wide = mx.concatenate([logits, sl, mx.zeros((n, 31), dtype)], axis=1)
            r = mr.route_and_group(wide, k, 32, shared_column=True)
        plain = mr.route_and_group(logits, k, 32)
        assert r.inds.shape == (n, k + 1) and r.groups.counts.shape == (mr.shared_group_experts(E),)
        if n == 0:
            assert r.groups.order.shape == (0,)
            continue
        assert mx.array_equal(r.inds[:, :k], plain.inds).item()
        assert mx.array_equal(r.scores[:, :k], plain.scores).item()
        assert np.all(np.asarray(r.inds[:, k]) == E)
        want = 1.0 / (1.0 + np.exp(-np.asarray(sl.astype(mx.float32), dtype=np.float64)))
        np.testing.assert_allclose(np.asarray(r.scores[:, k:]), want, rtol=4e-7, atol=0)
        counts = np.asarray(r.groups.counts)
        assert counts[E] == n and not counts[E + 1:].any()
        ref = moe.group_by_expert(r.inds, mr.shared_group_experts(E))
        assert np.array_equal(np.asarray(r.block_map), np.asarray(moe.block_map(ref, 32)))
