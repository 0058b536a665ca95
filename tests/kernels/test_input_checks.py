"""The kernel wrappers' public functions reject input that would send a kernel
outside its arrays before anything is built or launched (so these run on
the CPU too: a launch there would fail with "no CUDA", not with the
ValueError the tests expect)."""

import mlx.core as mx
import numpy as np
import pytest

import moe_blocks
from mlx_qwen_fast.kernels import _cuda_build as cb
from mlx_qwen_fast.kernels import moe_decode_gemv as md
from mlx_qwen_fast.kernels import moe_grouped_gemm as gg
from mlx_qwen_fast.kernels import moe_routing as mr
from mlx_qwen_fast.moe_types import ExpertGroups, Routing
from mlx_qwen_fast.ops import moe


@pytest.fixture
def no_launch(monkeypatch):
    """Any kernel launch fails loudly: a check that lets bad input through is seen."""
    def launch(self, *a, **k):
        raise AssertionError(f"launched {self.base_name} with bad input")

    monkeypatch.setattr(cb.CudaKernel, "__call__", launch)
    monkeypatch.setattr(cb.CudaKernel, "image", property(lambda self: b""))


@pytest.mark.parametrize("bad", [[[0, 32]], [[-1, 3]], [[2**31 + 5, 1]]])
def test_group_rejects_ids_out_of_range(no_launch, bad):
    dtype = mx.uint32 if max(max(r) for r in bad) >= 2**31 else mx.int32
    with pytest.raises(ValueError, match=r"inds must lie in \[0, num_experts=32\)"):
        mr.group(mx.array(bad, dtype), 32, 32)


@pytest.mark.parametrize("tile_rows", [0, None, 2**17, 2.5])
def test_route_and_group_checks_tile_rows_before_routing(no_launch, tile_rows):
    with pytest.raises(ValueError, match="tile_rows"):
        mr.route_and_group(mx.zeros((4, 32)), 8, tile_rows)


def _routing(n=6, k=2, e=32, tile=32, seed=0):
    """A valid routing built by the reference ops (the kernels' contract)."""
    rng = np.random.default_rng(seed)
    inds = mx.array(np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32))
    g = moe.group_by_expert(inds, e)
    return Routing(inds, mx.ones((n, k), mx.float32), g, moe.block_map(g, tile), tile)


def test_check_routing_values_passes_a_valid_routing():
    r = _routing()
    gg.check_routing_values("t", r, 12)


@pytest.mark.parametrize("damage", ["order_high", "order_negative", "offsets", "expert", "tile_overflow",
                                    "tile_past_the_end", "unused_half"])
def test_check_routing_values_rejects_a_damaged_routing(damage):
    r = _routing()
    g, bm = r.groups, np.array(r.block_map)
    if damage == "order_high":
        g = g._replace(order=mx.full(g.order.shape, 10**6, mx.int32))
    elif damage == "order_negative":
        g = g._replace(order=g.order - 1)
    elif damage == "offsets":
        g = g._replace(offsets=g.offsets * 2)
    elif damage == "expert":
        bm[0, 0] = 40
    elif damage == "tile_overflow":  # offsets[e] + t * tile wraps in int32
        bm[0, 1] = 3 * 2**25
    elif damage == "tile_past_the_end":
        bm[0, 1] = 5
    else:
        bm[-1, 0] = -1
        bm[-1, 1] = 0
    bad = r._replace(groups=g, block_map=mx.array(bm))
    with pytest.raises(ValueError, match="not a grouping"):
        gg.check_routing_values("t", bad, 12)


def test_grouped_gemm_public_entry_points_check_the_routing(no_launch):
    d, i, e = 128, 64, 32
    x = moe_blocks.x_tokens(6, d, 1)
    gate, up, down = (moe_blocks.quant((e, i, d), 2), moe_blocks.quant((e, i, d), 3),
                      moe_blocks.quant((e, d, i), 4))
    r = _routing()
    bad = r._replace(groups=r.groups._replace(order=mx.full((12,), 10**6, mx.int32)))
    with pytest.raises(ValueError, match="gate_up_swiglu: routing is not a grouping"):
        gg.gate_up_swiglu(x, bad, gate, up, variant="mma")
    h = mx.zeros((12, i), mx.bfloat16)
    with pytest.raises(ValueError, match="down_weighted: routing is not a grouping"):
        gg.down_weighted(h, bad, down, variant="mma")


def test_decode_gemv_public_entry_points_check_ids(no_launch):
    experts, shared, eg = moe_blocks.make_arrays(E=32, D=256, I=128)
    x = moe_blocks.x_tokens(1, 256, 5)
    for inds in (mx.array([[0, 1, 2, 32]], mx.int32), mx.array([[0, 1, 2, -1]], mx.int32)):
        scores = mx.full(inds.shape, 0.25)
        with pytest.raises(ValueError, match=r"inds must lie in \[0, E=32\)"):
            md.moe_decode_arrays(x, inds, scores, experts, shared, eg)
        with pytest.raises(ValueError, match=r"inds must lie in \[0, E=32\)"):
            md.gate_up_swiglu(x, inds, experts, shared, eg)


@pytest.mark.parametrize("eps", [None, float("nan"), -1e-6, 0.0, float("inf"), 1.0, "x", True])
def test_check_eps(eps):
    with pytest.raises(ValueError, match="eps must be a finite float"):
        cb.check_eps("f", "eps", eps)
    assert cb.check_eps("f", "eps", 1e-6) == 1e-6


def test_expert_groups_of_another_size_are_rejected():
    g = moe.group_by_expert(mx.array([[0, 1]], mx.int32), 4)
    broken = ExpertGroups(g.counts, g.offsets[:-1], g.order, g.sorted_experts, g.inverse, 2)
    with pytest.raises(ValueError, match="disagree in size"):
        moe.block_map(broken, 4)
