"""The Metal grouping kernels of the prefill MoE (``kernels/moe_group_metal.py``:
per-chunk histogram, then scans, block map and the stable scatter), run on
the CPU through ``tests/metal_check.py`` (MLX's generated source as C++, one
fiber per GPU thread, guard pages, outputs and threadgroup arrays poisoned:
an unwritten entry reads -1, which the exact comparison catches), against
the plain-MLX reference :func:`mlx_qwen_fast.ops.moe.group_by_expert` and
:func:`~mlx_qwen_fast.ops.moe.block_map`: every output equal, the order
included (the kernels' order is the stable one). Fresh random ids per case.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import metal_check as mc
from mlx_qwen_fast.kernels import moe_group_metal as gm
from mlx_qwen_fast.ops import moe

pytestmark = pytest.mark.skipif(mc.CXX is None, reason="no C++ compiler (g++) to build the Metal sources")

MODULE = "mlx_qwen_fast.kernels.moe_group_metal"
FIELDS = ("counts", "offsets", "order", "sorted_experts", "inverse")


def random_inds(n, k, E, seed, skip=()):
    """[n, k] int32: k distinct experts per token, none of ``skip``."""
    rng = np.random.default_rng(seed)
    pool = np.array([e for e in range(E) if e not in skip])
    return mx.array(np.stack([rng.choice(pool, k, replace=False) for _ in range(n)]).reshape(n, k).astype(np.int32))


def check(inds, E, tile):
    with mc.simulated_modules(MODULE) as (m,):
        groups, bmap = m.group_metal(inds, E, tile)
        assert [m._kernel(s).calls for s in ("count", "scatter")] == [1, 1]
    ref = moe.group_by_expert(inds, E)
    for f in FIELDS:
        got, want = getattr(groups, f), getattr(ref, f)
        assert got.dtype == mx.int32, f
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f)
    assert groups.top_k == inds.shape[1]
    assert bmap.dtype == mx.int32
    np.testing.assert_array_equal(np.asarray(bmap), np.asarray(moe.block_map(ref, tile)), err_msg="block_map")
    return groups, bmap


@pytest.mark.parametrize("n, k, E, tile", [
    (1, 2, 8, 16),       # one token: one chunk, one SIMD group, most experts empty
    (3, 2, 8, 1),        # a tile per row
    (70, 2, 8, 16),      # ~70 tokens over 8 experts: ragged last tiles
    (70, 8, 32, 32),     # the test model's router: 560 assignments in 3 chunks
    (40, 8, 256, 16),    # the model's 256 experts (8 SIMD groups), most of them empty
    (1, 8, 1000, 32),    # E not a multiple of 32: the last SIMD group part idle
])
def test_group_matches_reference(n, k, E, tile):
    check(random_inds(n, k, E, seed=n * 131 + E + tile), E, tile)


def test_group_empty_and_crowded_experts():
    """Experts 0, 3 and the last take no token (empty groups between full
    ones), every token lists expert 5 (a crowded group across chunks:
    1200 assignments in 5 chunks), uint32 ids the same results."""
    inds = np.asarray(random_inds(600, 1, 16, seed=7, skip=(0, 3, 5, 15)))
    inds = mx.array(np.concatenate([inds, np.full((600, 1), 5, np.int32)], axis=1))
    assert gm.chunks(1200) == 5
    groups, bmap = check(inds, 16, 32)
    assert np.asarray(groups.counts)[[0, 3, 15]].tolist() == [0, 0, 0]
    with mc.simulated_modules(MODULE) as (m,):
        g32, b32 = m.group_metal(inds.astype(mx.uint32), 16, 32)
    for f in FIELDS:
        assert mx.array_equal(getattr(g32, f), getattr(groups, f)).item(), f
    assert mx.array_equal(b32, bmap).item()


def test_route_and_group_metal():
    """The routing kernel then the grouping: the Routing the grouped GEMMs
    read, its groups those of the reference on the routing's ids."""
    logits = 2.0 * mx.random.normal((9, 64), key=mx.random.key(3))
    with mc.simulated_modules("mlx_qwen_fast.kernels.moe_route_metal", MODULE) as (rm, m):
        r = m.route_and_group_metal(logits, 4, 16, normalize=False)
        assert rm._kernel().calls == 1
    assert r.tile_rows == 16 and r.shared_id is None
    assert r.inds.shape == (9, 4) and r.scores.shape == (9, 4)
    ref = moe.group_by_expert(r.inds, 64)
    for f in FIELDS:
        assert mx.array_equal(getattr(r.groups, f), getattr(ref, f)).item(), f
    assert mx.array_equal(r.block_map, moe.block_map(ref, 16)).item()


def test_group_argument_checks():
    """Refused by name before any kernel is built (no Metal needed); no
    tokens: empty groups and an all -1 map without a launch."""
    inds = random_inds(4, 2, 8, seed=1)

    def refused(match, *args):
        with pytest.raises(ValueError, match="group_metal: .*" + match):
            gm.group_metal(*args)

    refused(r"inds must be an int32/uint32 .*\[N, k\]", inds.astype(mx.float32), 8, 16)
    refused(r"inds must be", inds.reshape(-1), 8, 16)
    refused(r"inds must be", np.zeros((4, 2), np.int32), 8, 16)
    for bad in (0, 1025, 8.0, True):
        refused(r"num_experts must be an int in \[1, 1024\]", inds, bad, 16)
    for bad in (0, 2**16 + 1, None):
        refused(r"tile_rows must be an int in \[1, 65536\]", inds, 8, bad)
    refused(r"1 <= k <= num_experts=8, got k=9", mx.zeros((2, 9), mx.int32), 8, 16)
    refused(r"inds must lie in \[0, num_experts=8\), got values in \[0, 8\]", inds.at[1, 1].add(8 - inds[1, 1]), 8, 16)
    refused(r"inds must lie in \[0, num_experts=8\), got values in \[-1,", inds.at[0, 0].add(-1 - inds[0, 0]), 8, 16)
    with pytest.raises(ValueError, match=r"route_and_group_metal: tile_rows"):
        gm.route_and_group_metal(mx.zeros((2, 64)), 2, 0)
    with pytest.raises(ValueError, match=r"route_and_group_metal: logits must be an mx.array \[N, E\]"):
        gm.route_and_group_metal(mx.zeros((1, 2, 64)), 2, 16)
    with pytest.raises(ValueError, match=r"chunks: num_assignments"):
        gm.chunks(-1)
    assert [gm.chunks(v) for v in (0, 1, 256, 257, 64 * 256, 10**6)] == [1, 1, 1, 2, 64, 64]
    groups, bmap = gm.group_metal(mx.zeros((0, 2), mx.int32), 8, 16)
    assert [getattr(groups, f).shape for f in FIELDS] == [(8,), (9,), (0,), (0,), (0,)]
    assert bmap.shape == (8, 2) and np.all(np.asarray(bmap) == -1)
