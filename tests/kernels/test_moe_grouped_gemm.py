"""The grouped expert GEMM kernels (``kernels/moe_grouped_gemm.py``: gate+up
SwiGLU and down + routing weight, builds "wgmma" and "mma", the shared
expert in the routing's slot) vs fp32 references.

Shape checks and argument errors run on any backend; the kernels on CUDA,
outputs poisoned with NaN before every launch, fresh random weights and
activations. The builds (configurations, tile rules, the "wgmma" K order):
``test_moe_grouped_gemm_builds.py``.

References: :func:`dense_ref`, fp32 matmuls on the weights as the kernels
dequantise them (``bf16(s * q + b)``, one rounding, both builds), rounding
to bf16 where ``SwitchGLU`` rounds. Bounds (compare.tolerance, bf16): h
(gate, up, then SwiGLU, each rounded: a flipped rounding of g or u plus h's
own) roundings=2; the down output alone on the reference h (its rounding
and the weighted sum's) roundings=2; the whole chain roundings=4; vs the
stock ``gather_qmm`` path, compare.GATHER_QMM_TOL.
"""

from __future__ import annotations

from collections import OrderedDict

import mlx.core as mx
import numpy as np
import pytest

import cuda_check
import moe_blocks
from compare import GATHER_QMM_TOL, assert_close, finite, tolerance
from moe_blocks import make_logits, qproj
from references import unpack_affine_4bit
from mlx_qwen_fast.kernels import moe_grouped_gemm as gg
from mlx_qwen_fast.kernels import moe_grouped_gemm_builds as ggb
from mlx_qwen_fast.kernels import moe_routing as mr
from mlx_qwen_fast.ops import moe

BF = mx.bfloat16
large = pytest.mark.large


def arr(p):
    return (p.weight, p.scales, p.biases)


# ---------------------------------------------------------------------------
# host side (any backend)
# ---------------------------------------------------------------------------


def test_supports_arrays_shapes():
    from cuda_helpers import HAS_CUDA

    E, D, I = 4, 192, 128
    x = mx.zeros((5, D), BF)
    g, u, d = (qproj(E, I, D, 1), qproj(E, I, D, 2), qproj(E, D, I, 3))
    assert gg.supports_arrays(x, arr(g), arr(u), arr(d))
    assert not gg.supports_arrays(x.astype(mx.float32), arr(g), arr(u), arr(d))
    # I = 96: output columns not a multiple of the 64-column tile -> refused
    g96, u96 = qproj(E, 96, D, 4), qproj(E, 96, D, 5)
    assert not gg.supports_arrays(x, arr(g96), arr(u96), arr(d))
    assert not gg.supports_arrays(x, arr(g), arr(u96), arr(d))  # gate/up mismatch
    d_bad = qproj(E, 256, I, 6)  # down output != D
    assert not gg.supports_arrays(x, arr(g), arr(u), arr(d_bad))
    if not HAS_CUDA:
        assert not gg.supports(x, g, u, d)


def test_shared_slot_supported_checks_the_modules():
    """The shared expert runs in the routing's slot only as three 4-bit
    group-64 QuantizedLinear of the routed experts' sizes, on shapes the
    "wgmma" build takes (any backend: nothing compiles)."""
    block = moe_blocks.make_block(D=256, H=128, E=32, k=8, dtype=BF)
    assert gg.shared_slot_supported(block.shared_expert, 256, 128)
    assert not gg.shared_slot_supported(block.shared_expert, 256, 256)  # routed experts of another size
    assert not gg.shared_slot_supported(block.shared_expert, 512, 128)  # another hidden size
    assert not gg.shared_slot_supported(block.switch_mlp, 256, 128)  # 3-D switch weights
    assert not gg.shared_slot_supported(object(), 256, 128)
    narrow = moe_blocks.make_block(D=256, H=64, E=32, k=8, dtype=BF)
    assert not gg.shared_slot_supported(narrow.shared_expert, 256, 64)  # I = 64: no "wgmma" build


def test_shared_slot_argument_errors():
    """A shared slot without the shared expert's weights, the weights without
    the slot, another module as the shared expert and the "mma" build with
    the slot are named before anything compiles (any backend: the routings
    here come from the reference grouping ops)."""
    E, k, n, D, I = 32, 8, 40, 256, 128
    block = moe_blocks.make_block(D=D, H=I, E=E, k=k, dtype=BF)
    sm, se = block.switch_mlp, block.shared_expert
    x = mx.zeros((n, D), BF)
    inds = mx.random.randint(0, E, (n, k)).astype(mx.int32)
    scores = mx.ones((n, k), mx.float32)
    plain_groups = moe.group_by_expert(inds, E)
    plain = mr.Routing(inds, scores, plain_groups, moe.block_map(plain_groups, 32), 32)
    inds9 = mx.concatenate([inds, mx.full((n, 1), E, mx.int32)], axis=1)
    slot_groups = moe.group_by_expert(inds9, mr.shared_group_experts(E))
    slot = mr.Routing(inds9, mx.ones((n, k + 1), mx.float32), slot_groups, moe.block_map(slot_groups, 32), 32, E)
    args = (sm.gate_proj, sm.up_proj, sm.down_proj)
    with pytest.raises(ValueError, match="shared"):
        gg.moe_experts(x, plain, *args, shared_expert=se, variant="wgmma")
    with pytest.raises(ValueError, match="shared"):
        gg.moe_experts(x, slot, *args, variant="wgmma")
    with pytest.raises(ValueError, match="shared_expert must"):
        gg.moe_experts(x, slot, *args, shared_expert=sm, variant="wgmma")
    with pytest.raises(ValueError, match="needs the wgmma build"):
        gg.moe_experts(x, slot, *args, shared_expert=se, variant="mma")


# ---------------------------------------------------------------------------
# fp32 reference on the weights as the kernels dequantise them
# ---------------------------------------------------------------------------

#: The last dequantised weight sets (a GEMM's gate, up and down): bounded, so
#: a test process keeps at most three fp32 copies (3 GB at E = 256, I = 512,
#: D = 2048) alive.
_dequantized: "OrderedDict[tuple, tuple]" = OrderedDict()
_DEQUANTIZED_MAX = 3


def dequant(p, rounding):
    """fp32 weights [E, O, K] as the kernels dequantise them, on the default
    device with MLX ops: ``bf16(s * q + b)`` ("once", both builds and
    mx.dequantize on CUDA) or ``bf16(bf16(s * q) + b)`` ("twice",
    mx.dequantize on CPU); ``s * q`` is exact in fp32."""
    key = (id(p), rounding)
    hit = _dequantized.get(key)
    if hit is not None and hit[0] is p:
        _dequantized.move_to_end(key)
        return hit[1]
    E, O, KW = p.weight.shape
    shifts = mx.arange(8, dtype=mx.uint32) * 4
    q = ((p.weight[..., None] >> shifts) & 15).reshape(E, O, KW * 8).astype(mx.float32)
    sc = mx.repeat(p.scales.astype(mx.float32), 64, axis=-1)
    bi = mx.repeat(p.biases.astype(mx.float32), 64, axis=-1)
    bf = lambda t: t.astype(BF).astype(mx.float32)  # noqa: E731
    w = bf(bf(sc * q) + bi) if rounding == "twice" else bf(sc * q + bi)
    mx.eval(w)
    _dequantized[key] = (p, w)  # the GEMM cases share their weights
    while len(_dequantized) > _DEQUANTIZED_MAX:
        _dequantized.popitem(last=False)
    return w


@pytest.mark.parametrize("rounding", ["twice", "once"])
def test_dequant_helper_matches_host_unpack(rounding):
    """The device-side test helper dequantises as the host reference."""
    p = qproj(3, 64, 192, 11, scale=3.0)
    got = np.asarray(dequant(p, rounding))
    want = unpack_affine_4bit(p.weight, p.scales, p.biases, rounding=rounding)
    assert np.array_equal(got, want)


def dense_ref(x, r, gate, up, down, rounding="once"):
    """fp32 reference on the weights as the kernel dequantises them
    (:func:`dequant`), rounding where SwitchGLU does (gate, up, swiglu and
    down outputs to bf16). Returns (h in grouped order, y [N*k, D] weighted
    in assignment order). One plain matmul per expert's rows (``gather_mm``
    with repeated sorted indices gave wrong rows on CUDA, 2026-12-01)."""
    wg, wu, wd = (dequant(p, rounding) for p in (gate, up, down))
    k = r.groups.top_k
    order = r.groups.order
    off = np.asarray(r.groups.offsets).tolist()
    xr = x[order // k].astype(mx.float32)  # [NK, D] in grouped order
    bf = lambda t: t.astype(BF).astype(mx.float32)  # noqa: E731
    hs, os_ = [], []
    for e in range(len(off) - 1):
        if off[e + 1] == off[e]:
            continue
        xe = xr[off[e]:off[e + 1]]
        g = bf(xe @ wg[e].T)
        u = bf(xe @ wu[e].T)
        hh = bf(g * mx.sigmoid(g) * u)
        hs.append(hh)
        os_.append(bf(hh @ wd[e].T))
    h, o = mx.concatenate(hs), mx.concatenate(os_)
    y = mx.zeros_like(o).at[order].add(o * r.scores.reshape(-1)[order][:, None])
    mx.eval(h, y)
    return h, y


H_TOL = tolerance(BF, roundings=2)
Y_TOL = tolerance(BF, roundings=4)
DOWN_TOL = tolerance(BF, roundings=2)


# ---------------------------------------------------------------------------
# kernels (CUDA)
# ---------------------------------------------------------------------------

FULL = pytest.param(2048, 512, 256, marks=large, id="2048-512-256")
#: The CPU-run parameter sets (tests/cuda_check.py): the small shapes.
CPU_MMA = pytest.mark.cpu_check("moe_grouped_gemm.cu")
CPU_WGMMA = pytest.mark.cpu_check("moe_grouped_gemm_wgmma.cu")


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("D,I,E", [(192, 128, 32), (320, 64, 32), FULL])
@pytest.mark.parametrize("n", [1, 7, 64, 300])
@pytest.mark.parametrize("variant,tile", [
    pytest.param("mma", 32, marks=CPU_MMA), ("mma", 64), pytest.param("mma", 128, marks=CPU_MMA),
    ("wgmma", 32), ("wgmma", 64), ("wgmma", 128),
])
def test_grouped_gemm_vs_reference(D, I, E, n, variant, tile):
    if cuda_check.active() and (n > 7 or D > 320):
        pytest.skip("the CPU check runs the small shapes")
    k = 8
    gate, up, down = qproj(E, I, D, 1), qproj(E, I, D, 2), qproj(E, D, I, 3)
    x = mx.random.normal((n, D), key=mx.random.key(n + D)).astype(BF)
    logits = make_logits(n, E, "skewed", seed=n, dtype=mx.float32)
    r = mr.route_and_group(logits, k, tile)
    if variant == "wgmma" and not ggb.wgmma_shapes_ok(D, I):  # refused with a clear error, never run
        with pytest.raises(ValueError, match="the wgmma build needs D % 256 == 0 and I % 128 == 0"):
            gg.gate_up_swiglu(x, r, arr(gate), arr(up), variant=variant)
        with pytest.raises(ValueError, match="the wgmma build needs"):
            gg.moe_experts(x, r, gate, up, down, variant=variant)
        return
    h = gg.gate_up_swiglu(x, r, arr(gate), arr(up), variant=variant)
    y = gg.down_weighted(h, r, arr(down), variant=variant)
    assert h.shape == (n * k, I) and h.dtype == BF
    assert y.shape == (n * k, D) and y.dtype == mx.float32
    assert finite(h, y)  # every row written (outputs were NaN)
    h_ref, y_ref = dense_ref(x, r, gate, up, down, "once")
    assert_close(h, h_ref, H_TOL, "h")
    assert_close(y, y_ref, Y_TOL, "y")
    # the down kernel alone on the reference h: only its own rounding differs
    y2 = gg.down_weighted(h_ref.astype(BF), r, arr(down), variant=variant)
    assert_close(y2, y_ref, DOWN_TOL, "y (down alone)")
    # vs the stock-path reference (gather_qmm), combined per token
    groups = moe.group_by_expert(r.inds, E)
    ref = moe.combine(moe.expert_swiglu(x, groups, gate, up, down), r.scores, dtype=mx.float32)
    got = gg.moe_experts(x, r, gate, up, down, out_dtype=mx.float32, variant=variant)
    # gather_qmm's own error is not bf16-tight (1.6e-2 per projection on CPU)
    assert_close(got, ref, GATHER_QMM_TOL, "vs gather_qmm")


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("D,I,E", [(256, 128, 32), (512, 256, 64), FULL])
@pytest.mark.parametrize("n,kind", [pytest.param(1, "random", marks=CPU_WGMMA), (2, "random"),
                                    pytest.param(4, "skewed", marks=CPU_WGMMA), (64, "empty"), (300, "one"),
                                    (2049, "skewed"), (4099, "skewed")])
@pytest.mark.parametrize("tile", [32, 64, 128])
def test_wgmma_grouped_gemm_vs_reference(D, I, E, n, kind, tile):
    if cuda_check.active() and D > 256:
        pytest.skip("the CPU check runs the small shapes")
    """The wgmma kernels on shapes they take (K chunks of 128, 128 / 256
    features per CTA): ragged item ends (n*k not a multiple of the tile),
    empty experts, all rows on one expert, n*k > 32,768 and not a multiple of
    64 (n = 4099); h in natural order from the public function, the down
    kernel alone on the reference h, both output dtypes."""
    k = 8
    gate, up, down = qproj(E, I, D, 11), qproj(E, I, D, 12), qproj(E, D, I, 13)
    x = mx.random.normal((n, D), key=mx.random.key(7 * n + D)).astype(BF)
    r = mr.route_and_group(make_logits(n, E, kind, seed=n + 3, dtype=mx.float32), k, tile)
    h = gg.gate_up_swiglu(x, r, arr(gate), arr(up), variant="wgmma")
    y = gg.down_weighted(h, r, arr(down), variant="wgmma")
    assert h.shape == (n * k, I) and h.dtype == BF
    assert y.shape == (n * k, D) and y.dtype == mx.float32
    assert finite(h, y)
    h_ref, y_ref = dense_ref(x, r, gate, up, down, "once")
    assert_close(h, h_ref, H_TOL, "h")
    assert_close(y, y_ref, Y_TOL, "y")
    y2 = gg.down_weighted(h_ref.astype(BF), r, arr(down), variant="wgmma")
    assert_close(y2, y_ref, DOWN_TOL, "y (down alone)")
    y3 = gg.down_weighted(h_ref.astype(BF), r, arr(down), out_dtype=BF, variant="wgmma")
    assert y3.dtype == BF and finite(y3)
    assert_close(y3, y_ref, DOWN_TOL, "y (down alone, bf16 out)")
    got = gg.moe_experts(x, r, gate, up, down, out_dtype=mx.float32, variant="wgmma")
    want = y_ref.reshape(n, k, D).sum(axis=1)
    assert_close(got, want, Y_TOL, "moe_experts")
    # the same function as the mma.sync kernel (same one-rounding dequantisation)
    assert_close(got, gg.moe_experts(x, r, gate, up, down, out_dtype=mx.float32, variant="mma"), Y_TOL,
                 "wgmma vs mma")


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("down_ft", [1, 2, 4, 8])
@pytest.mark.parametrize("D,I,E,n,tile", [pytest.param(2048, 512, 256, 300, 64, marks=large),
                                          pytest.param(2048, 512, 256, 4099, 128, marks=large),
                                          (512, 256, 64, 77, 32), (1024, 640, 32, 40, 64)])
def test_wgmma_down_feature_tiles_vs_reference(down_ft, D, I, E, n, tile):
    """Several feature tiles per down CTA with h resident (where I fits the
    ring and D splits evenly; else the build takes one) compute the same
    function as the reference; the public entry (its own choice) too."""
    k = 8
    gate, up, down = qproj(E, I, D, 21), qproj(E, I, D, 22), qproj(E, D, I, 23)
    x = mx.random.normal((n, D), key=mx.random.key(n + 5)).astype(BF)
    r = mr.route_and_group(make_logits(n, E, "skewed", seed=n, dtype=mx.float32), k, tile)
    h_ref, y_ref = dense_ref(x, r, gate, up, down, "once")
    for out_dtype in (mx.float32, BF):
        # the kernel reads h in permute_k order (what gate_up_swiglu writes for it)
        y = gg._down(ggb.permute_k(h_ref.astype(BF)), r, arr(down), out_dtype, "wgmma", down_ft=down_ft)
        assert y.dtype == out_dtype and finite(y)
        assert_close(y, y_ref, DOWN_TOL, f"y ({out_dtype})")
    got = gg.moe_experts(x, r, gate, up, down, out_dtype=mx.float32, variant="wgmma")
    assert finite(got)
    assert_close(got, y_ref.reshape(n, k, D).sum(axis=1), Y_TOL, "moe_experts")


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
def test_grouped_gemm_refuses_unsupported():
    E, D = 32, 192
    x = mx.zeros((4, D), BF)
    # I = 96 is not a multiple of the kernels' 64-column tiles (a down
    # projection with 96 inputs cannot be quantised with group 64 at all, so
    # the check sees one of 128 inputs: refused for the gate/up size alone)
    g96, u96 = qproj(E, 96, D, 1), qproj(E, 96, D, 2)
    d = qproj(E, D, 128, 3)
    assert not gg.supports(x, g96, u96, d)
    r = mr.route_and_group(make_logits(4, E, "random", 0, mx.float32), 8, 32)
    with pytest.raises(ValueError, match="gate"):
        gg.gate_up_swiglu(x, r, arr(g96), arr(u96))
    with pytest.raises(ValueError, match="x must be bfloat16"):
        gg.gate_up_swiglu(x.astype(mx.float32), r, arr(g96), arr(u96))


def _shared_fp32(x, se, gate):
    """``gate * shared_expert(x)`` in fp32 on the dequantised weights, bf16
    roundings where the kernels (and SwitchGLU) round: g, u, silu(g) * u and the
    down output."""
    def deq(p):
        return mx.dequantize(p["weight"], p["scales"], p["biases"], group_size=64, bits=4).astype(mx.float32)

    def bf(a):
        return a.astype(BF).astype(mx.float32)

    xf = x.astype(mx.float32)
    g = bf(xf @ deq(se.gate_proj).T)
    u = bf(xf @ deq(se.up_proj).T)
    h = bf(g * mx.sigmoid(g) * u)
    return gate * bf(h @ deq(se.down_proj).T)


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("n,tile,D,I", [(1, None, 2048, 512), (65, None, 2048, 512), (1000, None, 2048, 512),
                                        (2049, 32, 2048, 512), (2049, 64, 2048, 512), (2049, 128, 2048, 512),
                                        (4099, None, 2048, 512), (1000, None, 2048, 1024), (333, None, 1024, 640)])
def test_moe_experts_with_shared_slot_vs_fp32(n, tile, D, I):
    """The shared expert in the routing's shared slot (one more group of the
    routed experts' two launches) = the routed kernels' output + the shared
    expert in fp32 (ragged N; every tile size at N = 2049; I = 1024, whose
    down kernel takes one feature tile per CTA, and I = 640, an odd number
    of K chunks), and the same with its logit read from column E."""
    E, k = 64, 8
    block = moe_blocks.make_block(D=D, H=I, E=E, k=k, dtype=BF, seed=n + 11)
    sm, se = block.switch_mlp, block.shared_expert
    assert gg.shared_slot_supported(se, D, I)
    x = (mx.random.normal((n, D), key=mx.random.key(3 * n)) * 1.5).astype(BF)
    logits, sl = block.gate(x), block.shared_expert_gate(x)
    tile = tile or ggb.choose_tile_rows(n * (k + 1), E + 1, "wgmma")
    slot = mr.route_and_group(logits, k, tile, shared_logits=sl)
    got = gg.moe_experts(x, slot, sm.gate_proj, sm.up_proj, sm.down_proj, shared_expert=se, variant="wgmma",
                         out_dtype=mx.float32)
    plain = mr.route_and_group(logits, k, tile)
    routed = gg.moe_experts(x, plain, sm.gate_proj, sm.up_proj, sm.down_proj, out_dtype=mx.float32,
                            variant="wgmma")
    gate = mx.sigmoid(sl.astype(mx.float32))
    want = routed + _shared_fp32(x, se, gate)
    assert got.shape == (n, D) and got.dtype == mx.float32 and finite(got)
    assert_close(got, want, tolerance(BF, roundings=2), "routed + shared")
    assert_close(got - routed, want - routed, tolerance(BF, roundings=4), "the shared expert's part alone")
    wide = mx.concatenate([logits, sl, mx.zeros((n, 31), logits.dtype)], axis=1)
    column = mr.route_and_group(wide, k, tile, shared_column=True)
    got_c = gg.moe_experts(x, column, sm.gate_proj, sm.up_proj, sm.down_proj, shared_expert=se,
                           variant="wgmma", out_dtype=mx.float32)
    assert mx.array_equal(column.inds, slot.inds).item() and finite(got_c)
    # the same routing; rows of one group may be placed in another order
    assert_close(got_c, got, tolerance(BF, roundings=2), "logit from column E")
