"""The one-launch decode MoE block (kernels/moe_decode_fused.py) vs references.

Host-side parts (argument checks, the fp32 reference against MLX's CPU ops)
run everywhere; the kernel tests are marked ``cuda``. Outputs are poisoned with
NaN before every launch; weights and tokens are fresh random draws.

What is compared, and how tightly:

- router logits vs the fp32 reference ``bf16(x . (s*q + b))``: at most one
  bf16 ulp apart (the fp32 sums differ in order; the bf16 rounding may then
  fall on either side);
- ``inds`` / ``scores`` vs :func:`moe_routing.route` on the kernel's own
  logits: equal (the same device code on the same numbers);
- ``h`` vs :func:`moe_decode_gemv.gate_up_swiglu` on the kernel's ``inds``:
  equal bits (the same tile arithmetic); ``y`` vs
  :func:`moe_decode_gemv.down_combine` on the kernel's ``h``, ``inds``,
  ``scores``, ``sgate``: equal bits;
- ``y`` vs the fp32 reference on the kernel's routing: ``2 * BF16_EPS``
  relative L2 (as tests/test_cuda_moe_decode.py);
- the grid size (1 CTA .. the SM count) does not change a bit of ``y``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_qwen_fast.kernels import moe_decode_fused as mf
from mlx_qwen_fast.kernels import moe_decode_gemv as md
from mlx_qwen_fast.ops import moe

import moe_blocks  # tests/ is on sys.path
from cuda_helpers import BF16_EPS, GATHER_QMM_TOL, HAS_CUDA, cuda, finite, needs_cuda, npa, rel
from test_cuda_moe_decode import make_arrays, quant, x_tokens


def make_router(E, D, seed, bits=8, scale=8.0):
    return quant((E, D), seed, scale=scale, bits=bits)


def bf16_ulp(v: np.ndarray) -> np.ndarray:
    """Spacing of bf16 numbers at |v| (8 significand bits)."""
    v = np.maximum(np.abs(v), np.float32(2.0**-126))
    return np.exp2(np.floor(np.log2(v)) - 7).astype(np.float32)


# ---------------------------------------------------------------------------
# host side (runs everywhere)
# ---------------------------------------------------------------------------


def test_router_arrays_and_problems():
    block = moe_blocks.make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16)
    rq = mf.router_arrays(block.gate)
    assert rq is not None and rq[0].dtype == mx.uint32 and rq[0].shape == (32, 256 * 8 // 32)
    arrs = md.block_arrays(block)
    x = mx.zeros((1, 1, 256), mx.bfloat16)
    assert mf.router_problem(x, rq, *arrs, 8) is None
    assert "N*k" in mf.router_problem(x, rq, *arrs, 33)  # (E >= 32 and N*k <= 32: top_k <= E always)
    assert "top_k" in mf.router_problem(x, rq, *arrs, True)  # bool is not a count
    assert "1..4 tokens" in mf.router_problem(mx.zeros((1, 0, 256), mx.bfloat16), rq, *arrs, 8)
    assert "D=512" in mf.router_problem(mx.zeros((1, 512), mx.bfloat16), rq, *arrs, 8)
    assert "router" in mf.router_problem(x, (rq[0][:, :16], rq[1], rq[2]), *arrs, 8)
    assert "1..4 tokens" in mf.router_problem(mx.zeros((5, 256), mx.bfloat16), rq, *arrs, 8)
    assert "bfloat16" in mf.router_problem(x.astype(mx.float32), rq, *arrs, 8)
    assert "N*k" in mf.router_problem(mx.zeros((2, 256), mx.bfloat16), rq, *arrs, 17)
    # an unquantised router is not taken
    assert mf.router_arrays(moe_blocks.make_block(D=64, H=64, E=16).switch_mlp) is None


def test_bad_arguments_raise_before_compiling():
    experts, shared, eg = make_arrays(32, 256, 128, seed=1)
    router = make_router(32, 256, 2)
    x = x_tokens(1, 256, 3)
    with pytest.raises(ValueError, match="moe_decode_fused: x must be bfloat16"):
        mf.moe_decode_fused(x.astype(mx.float16), router, experts, shared, eg, 8)
    with pytest.raises(ValueError, match="router"):
        mf.moe_decode_fused(x, router[:2] + (router[2].astype(mx.float32),), experts, shared, eg, 8)
    with pytest.raises(ValueError, match="E must equal"):
        mf.moe_decode_fused(x, make_router(64, 256, 4), experts, shared, eg, 8)
    # sync and ctas are checked before anything asks the GPU
    with pytest.raises(ValueError, match="sync must be"):
        mf.moe_decode_fused(x, router, experts, shared, eg, 8, sync=mx.zeros((64,), mx.float32))
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="ctas"):
            mf.moe_decode_fused(x, router, experts, shared, eg, 8, ctas=bad)
    with pytest.raises(ValueError, match="router"):
        mf.reference(x, (router[0][:, :16], router[1], router[2]), 8, True, experts, shared, eg)
    with pytest.raises(ValueError, match="positive int"):
        mf.smem_bytes(0, 8, 2048, 512)


def test_reference_matches_mlx_cpu_ops():
    """The fp32 reference against MLX's own ops on CPU in fp32 (the block's
    bf16 arrays upcast): the router's quantised matmul, ops.moe's routing,
    and the whole block."""
    block = moe_blocks.make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16, seed=20)  # a seed with a tie
    x = x_tokens(3, 256, 5)
    rq = mf.router_arrays(block.gate)
    logits, inds, scores, y = mf.reference(x, rq, 8, True, *md.block_arrays(block))
    block.set_dtype(mx.float32)  # same values, fp32 math in MLX's ops
    xf = x.astype(mx.float32)
    with mx.stream(mx.cpu):
        ref_logits = npa(block.gate(xf))
        assert np.all(np.abs(logits - ref_logits) <= bf16_ulp(ref_logits) + 1e-6)  # one bf16 rounding
        i2, s2 = moe.route(mx.array(logits), 8)  # slots in another order; ties broken otherwise
        np.testing.assert_allclose(np.sort(npa(s2), -1), np.sort(scores, -1), rtol=1e-6)
        kth = -np.sort(-logits, -1)
        clear = kth[:, 7] != kth[:, 8]  # no tie across the top-8 boundary: the same experts
        np.testing.assert_array_equal(np.sort(npa(i2), -1)[clear], np.sort(inds, -1)[clear])
        sm = block.switch_mlp  # the experts on the reference's own routing (ties decided as the kernel does)
        ri, rs = mx.array(inds), mx.array(scores)
        ref = moe.combine(moe.expert_swiglu(xf, moe.group_by_expert(ri, 32), sm.gate_proj, sm.up_proj,
                                            sm.down_proj), rs)
        ref = ref + moe.shared_expert(block, xf)
    assert rel(y, ref) < 2 * BF16_EPS


# ---------------------------------------------------------------------------
# kernel (CUDA)
# ---------------------------------------------------------------------------


def check_fused(n, E=64, D=2048, I=512, k=8, seed=0, gate_bits=8, router_bits=8, normalize=True,
                x=None, ctas=None):
    from mlx_qwen_fast.kernels import moe_routing as mr

    experts, shared, eg = make_arrays(E, D, I, seed=seed, gate_bits=gate_bits)
    router = make_router(E, D, seed + 50, bits=router_bits)
    x = x_tokens(n, D, seed + 100) if x is None else x
    y, logits, inds, scores, h, sgate = mf.moe_decode_fused(
        x, router, experts, shared, eg, k, normalize, sync=mf.new_sync(), ctas=ctas, return_all=True)
    mx.eval(y, logits, inds, scores, h, sgate)
    assert y.shape == (n, D) and y.dtype == mx.bfloat16
    assert logits.shape == (n, E) and inds.shape == (n, k) and scores.shape == (n, k)
    assert finite(y, logits, scores, h, sgate)  # every element written (outputs were NaN)
    ref_logits, _, _, _ = mf.reference(x, router, k, normalize, experts, shared, eg)
    lg = npa(logits)
    assert np.all(np.abs(lg - ref_logits) <= bf16_ulp(ref_logits) + 1e-6)
    # the routing kernel on these logits: the same selection and weights
    i2, s2 = mr.route(logits, k, normalize=normalize)
    assert mx.array_equal(i2, inds).item() and mx.array_equal(s2, scores).item()
    # the two-kernel path on this routing: the same h and y bits
    h2, sg2 = md.gate_up_swiglu(x, inds, experts, shared, eg)
    assert mx.array_equal(h2, h).item()
    np.testing.assert_allclose(npa(sgate), npa(sg2), atol=4e-3)  # bf16 logit may round apart
    y2 = md.down_combine(h, inds, scores, sgate, experts[2], shared[2])
    assert mx.array_equal(y2, y).item()
    # fp32 reference on the kernel's routing
    _, _, y_ref = md.reference(x, inds, scores, experts, shared, eg)
    assert rel(y, y_ref) < 2 * BF16_EPS
    return x, router, experts, shared, eg, y


@cuda
@needs_cuda
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_fused_vs_references(poison, n):
    check_fused(n, seed=10 * n)


@cuda
@needs_cuda
def test_fused_full_size_router():
    check_fused(1, E=256, seed=3)
    check_fused(4, E=256, seed=4)


@cuda
@needs_cuda
@pytest.mark.parametrize("gate_bits,router_bits,normalize", [(4, 4, True), (16, 8, False)])
def test_fused_bit_widths_and_no_normalize(poison, gate_bits, router_bits, normalize):
    check_fused(2, seed=7, gate_bits=gate_bits, router_bits=router_bits, normalize=normalize)


@cuda
@needs_cuda
def test_fused_small_shape(poison):
    """D = 256, I = 128: fewer down row blocks (16) and shared tiles (8) than CTAs."""
    check_fused(3, E=32, D=256, I=128, seed=4)


@cuda
@needs_cuda
def test_fused_all_tokens_same_experts(poison):
    """Four identical tokens pick the same experts: each computed once for all."""
    x = mx.broadcast_to(x_tokens(1, 2048, 22), (4, 2048))
    check_fused(4, seed=21, x=mx.array(np.ascontiguousarray(npa(x))).astype(mx.bfloat16))


@cuda
@needs_cuda
@pytest.mark.parametrize("n,k", [(1, 32), (2, 16)])
def test_fused_32_pairs(poison, n, k):
    check_fused(n, k=k, seed=40 + n)


@cuda
@needs_cuda
def test_fused_grid_size_does_not_change_bits(poison):
    """1 CTA (every phase on one CTA), a few, and the SM count: equal y; the
    barrier buffer's 64-bit counter grows by 2 * BARW per launch, whatever the grid."""
    from mlx_qwen_fast.kernels import _cuda_build as cb

    experts, shared, eg = make_arrays(64, 2048, 512, seed=61)
    router = make_router(64, 2048, 62)
    x = x_tokens(2, 2048, 63)
    sync = mf.new_sync()
    ys = []
    for launch, ctas in enumerate((None, 1, 7, 33, cb.sm_count())):
        ys.append(mf.moe_decode_fused(x, router, experts, shared, eg, 8, sync=sync, ctas=ctas))
        mx.eval(ys[-1])
        s = np.asarray(sync)
        assert int(s[:2].view(np.uint64)[0]) == 2 * mf.BARW * (launch + 1) and not s[2:].any()
    assert all(mx.array_equal(y, ys[0]).item() for y in ys[1:])
    with pytest.raises(ValueError, match="ctas"):
        mf.moe_decode_fused(x, router, experts, shared, eg, 8, ctas=cb.sm_count() + 1)


@cuda
@needs_cuda
@pytest.mark.parametrize("n", [1, 4])
def test_fused_step_opt_in_equals_eager(poison, n, monkeypatch):
    """With MLX_QWEN_FAST_MOE_DECODE_FUSED=1, moe_decode_step (what the patched
    model runs) takes the one-launch kernel: equal to the eager launch, close
    to the two-kernel path and to stock; unset, the two-kernel path."""
    monkeypatch.setenv(mf.FUSED_ENV, "1")
    block = moe_blocks.make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16, seed=5)
    x = (mx.random.normal((1, n, 256), key=mx.random.key(n)) * 1.5).astype(mx.bfloat16)
    got = md.moe_decode_step(block, x)
    assert got is not None and got.shape == x.shape and finite(got)
    eager = mf.moe_decode_fused(x, mf.router_arrays(block.gate), *md.block_arrays(block), 8,
                                block.norm_topk_prob, sync=md.block_sync(block))
    assert mx.array_equal(got, eager).item()
    assert mx.array_equal(got, moe.sparse_moe(block, x)).item()  # the default dispatch
    two = md.moe_decode(block, x)
    from mlx_qwen_fast.kernels import moe_routing as mr

    _, logits, inds, _, _, _ = mf.moe_decode_fused(x, mf.router_arrays(block.gate), *md.block_arrays(block), 8,
                                                   block.norm_topk_prob, return_all=True)
    if mx.array_equal(inds, mr.route(block.gate(x.reshape(n, 256)), 8)[0]).item():
        assert rel(got, two) < 2 * BF16_EPS  # same experts: close (router logits may round apart)
    assert rel(got, moe.sparse_moe(block, x, implementation="stock")) < 2 * GATHER_QMM_TOL
    monkeypatch.delenv(mf.FUSED_ENV)
    assert mx.array_equal(md.moe_decode_step(block, x), two).item()
