"""kernels/gdn_layer_decode.py: a Gated DeltaNet decoder layer's decode step
(the one-launch mixer, then the one-launch MoE block) in one launch.

Its contract is the two launches' results bit for bit, so each test compares
with ``gdn_mixer_decode`` followed by ``moe_block_decode`` on fresh random
inputs (those two are checked against their fp32 references in their own
test files); outputs are poisoned before each launch (the ``poison``
fixture). The CUDA check runs the marked sets on the CPU.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from compare import finite
from gdn_helpers import mixer_arrays
from launches_at_once import check_launches_at_once
from moe_blocks import make_arrays, quant
from mlx_qwen_fast.kernels import _cuda_build as cb
from mlx_qwen_fast.kernels import gdn_layer_decode as gl
from mlx_qwen_fast.kernels import gdn_mixer_decode as gm
from mlx_qwen_fast.kernels import moe_block_decode as mb

EPS_IN, EPS_POST = 1e-6, 1e-5
CPU = pytest.mark.cpu_check("gdn_layer_decode.cu", "gdn_mixer_decode.cu", "moe_block_decode.cu")


def _layer(B, K, hk, hv, E, I, k, seed, gate_bits=8, rbits=8):
    """(mixer arrays, its params, MoE block arguments) of one random layer."""
    a = mixer_arrays(seed, B, K, hk, hv, mx.bfloat16)
    params = gm.mixer_params(a.conv_weight, a.A_log, a.dt_bias, a.norm_weight, a.input_norm_weight)
    experts, shared, eg = make_arrays(E, K, I, seed=seed + 1, gate_bits=gate_bits)
    router = quant((E, K), seed + 2, scale=3.0, bits=rbits)
    post = (1.0 + 0.2 * mx.random.normal((K,), key=mx.random.key(seed + 3))).astype(mx.bfloat16)
    return a, params, dict(norm_weight=post, router=router, experts=experts, shared=shared, expert_gate=eg,
                           top_k=k, router_bits=rbits)


def _two(a, params, blk, x, cs, st):
    h, cs2, st2 = gm.gdn_mixer_decode(x, a.in_proj, params, cs, st, a.out_proj, num_k_heads=a.hk,
                                      num_v_heads=a.hv, input_norm_eps=EPS_IN)
    out = mb.moe_block_decode(h, blk["norm_weight"], blk["router"], blk["experts"], blk["shared"],
                              blk["expert_gate"], top_k=blk["top_k"], norm_eps=EPS_POST,
                              router_bits=blk["router_bits"])
    return out, cs2, st2


def _one(a, params, blk, x, cs, st, **kw):
    return gl.gdn_layer_decode(x, a.in_proj, params, cs, st, a.out_proj, blk["norm_weight"], blk["router"],
                               blk["experts"], blk["shared"], blk["expert_gate"], num_k_heads=a.hk, num_v_heads=a.hv,
                               input_norm_eps=EPS_IN, top_k=blk["top_k"], post_norm_eps=EPS_POST,
                               router_bits=blk["router_bits"], **kw)


def _check_steps(B, K, hk, hv, E, I, k, seed, steps=2, **kw):
    """``steps`` chained steps (the states carried from the one launch's
    last step, a new x each step): out and both states equal the two
    launches' bit for bit."""
    a, params, blk = _layer(B, K, hk, hv, E, I, k, seed, **kw)
    x, cs, st = a.x, a.conv_state, a.state
    for step in range(steps):
        got = _one(a, params, blk, x, cs, st)
        want = _two(a, params, blk, x, cs, st)
        assert finite(got[0])
        for name, g, w in zip(("out", "conv_state", "state"), got, want):
            assert g.shape == w.shape and g.dtype == w.dtype, name
            assert mx.array_equal(g, w).item(), f"step {step}: {name}"
        _, cs, st = got
        x = (2.0 * mx.random.normal(x.shape, key=mx.random.key(seed + 10 + step))).astype(mx.bfloat16)


def test_sizes():
    """The grid is the larger of the two kernels'; the scratch holds the
    mixer's, h and the block's, each 16-byte aligned."""
    assert gl.grid_blocks(1, 16, 32, 2048, 8, 256, 512, 8, 132) == 132
    assert gl.grid_blocks(1, 2, 4, 256, 4, 32, 128, 8, 3) == 3
    assert gl.grid_blocks(1, 2, 4, 256, 4, 32, 128, 8, 132) == max(gm.grid_blocks(1, 2, 4, 256, 132),
                                                                    mb.grid_blocks(1, 4, 32, 256, 128, 8, 132))
    want = gm.scratch_words(2, 2, 4, mx.bfloat16) + (2 * 256 * 2) // 4 + mb.scratch_words(2, 4, 32, 128)
    assert gl.scratch_words(2, 2, 4, 256, 4, 32, 128) == want


def test_bad_input_names_the_argument(no_launch):
    """An argument outside either kernel's contract: a ValueError naming
    it, before any launch; the valid call reaches the launch."""
    a, params, blk = _layer(2, 256, 2, 4, 32, 128, 4, 3)
    cases = [
        (dict(x=a.x.astype(mx.float32)), "x"),
        (dict(in_proj=a.in_proj[:2]), "in_proj"),
        (dict(state=mx.zeros((2, 4, 128, 64))), "state"),
        (dict(norm_weight=blk["norm_weight"][:128]), "norm_weight"),
        (dict(router=blk["router"][:2]), "router"),
        (dict(top_k=0), "top_k"),
        (dict(post_norm_eps=0.0), "post_norm_eps"),
        (dict(norm_eps=0.0), r"\bnorm_eps"),
        (dict(input_norm_eps=2.0), "input_norm_eps"),
        (dict(after=[1.0]), "after"),
    ]
    for over, name in cases:
        args = dict(x=a.x, in_proj=a.in_proj, params=params, conv_state=a.conv_state, state=a.state,
                    out_proj=a.out_proj, norm_weight=blk["norm_weight"], router=blk["router"],
                    experts=blk["experts"], shared=blk["shared"], expert_gate=blk["expert_gate"])
        kw = dict(num_k_heads=a.hk, num_v_heads=a.hv, input_norm_eps=EPS_IN, top_k=blk["top_k"],
                  post_norm_eps=EPS_POST)
        for key, v in over.items():
            (args if key in args else kw)[key] = v
        with pytest.raises(ValueError, match=name):
            gl.gdn_layer_decode(**args, **kw)
    with pytest.raises(AssertionError, match="launched mqf_gdn_layer"):
        _one(a, params, blk, a.x, a.conv_state, a.state)


def test_shared_memory_bound():
    """The static arrays (18,624 bytes at one row, hidden 2048, 32 value
    heads, top-8: ptxas's count for sm_90a, within the 64 bytes of
    alignment allowed) and the MoE block's dynamic memory must fit 227 KB
    together: a width the block alone would take but the one launch not
    is declined, naming what is too large."""
    assert 18624 <= gl._static_smem(1, 2048, 32, 8) <= 18624 + 64
    assert gl.smem_problem(1, 2048, 32, 8, 512) is None
    msg = gl.smem_problem(1, 256, 4, 8, 12288)
    assert msg is not None and "shared memory" in msg
    assert mb.smem_bytes(1, 8, 12288) + mb._static_smem(1, 256) <= mb._SMEM_LIMIT  # the block alone fits


def test_supports(monkeypatch):
    """True where both kernels take the arrays and x is bfloat16 (on
    CUDA); False for float32 rows, and off CUDA."""
    a, params, blk = _layer(1, 256, 2, 4, 32, 128, 4, 5)
    args = (a.in_proj, a.out_proj, a.state, blk["norm_weight"], blk["router"], blk["experts"], blk["shared"],
            blk["expert_gate"])
    kw = dict(num_k_heads=a.hk, num_v_heads=a.hv, top_k=4)
    monkeypatch.setattr(cb, "cuda_available", lambda: True)
    assert gl.supports(a.x, *args, **kw)
    assert not gl.supports(a.x.astype(mx.float32), *args, **kw)
    assert not gl.supports(a.x, *args, num_k_heads=a.hk, num_v_heads=a.hv, top_k=33)
    monkeypatch.setattr(cb, "cuda_available", lambda: False)
    assert not gl.supports(a.x, *args, **kw)


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("B,sms", [pytest.param(1, 3, marks=CPU), pytest.param(2, 1, marks=CPU),
                                   pytest.param(4, 5, marks=CPU), (1, None), (3, None)])
def test_equals_two_launches(monkeypatch, B, sms):
    """Two chained steps at 1-4 rows, on grids of 1, 3 and 5 blocks (the
    phases' rounds, the router and shared items on few blocks) and on the
    machine's own: the two launches' out, conv state and state bit for
    bit."""
    if sms is not None:
        monkeypatch.setattr(cb, "sm_count", lambda: sms)
    _check_steps(B, 256, 2, 4, 32, 128, 4, seed=40 + B)


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("gate_bits,rbits", [pytest.param(16, 4, marks=CPU), (4, 8)])
def test_other_gate_and_router_bits(monkeypatch, gate_bits, rbits):
    """The shared-expert gate in bf16 or 4-bit and a 4-bit router: bit for
    bit as the two launches (3-block grid)."""
    monkeypatch.setattr(cb, "sm_count", lambda: 3)
    _check_steps(2, 256, 2, 4, 32, 128, 4, seed=60, steps=1, gate_bits=gate_bits, rbits=rbits)


@pytest.mark.cuda
@pytest.mark.cpu_check("gdn_layer_decode.cu")
@pytest.mark.usefixtures("poison")
def test_after_changes_no_bit(monkeypatch):
    """``after`` (an input never read) leaves every output's bits as the
    launch without it gives them."""
    monkeypatch.setattr(cb, "sm_count", lambda: 3)
    a, params, blk = _layer(2, 256, 2, 4, 32, 128, 4, 70)
    want = _one(a, params, blk, a.x, a.conv_state, a.state)
    got = _one(a, params, blk, a.x, a.conv_state, a.state, after=mx.arange(5))
    for g, w in zip(got, want):
        assert mx.array_equal(g, w).item()


@pytest.mark.cuda
@pytest.mark.parametrize("launches,sms", [(8, 3), (6, None)])
def test_launches_at_once(monkeypatch, launches, sms):
    """Launches that nothing orders (evaluated together) each take a
    barrier slot of their own: every output as each launch alone."""
    if sms is not None:
        monkeypatch.setattr(cb, "sm_count", lambda: sms)
    layers = [_layer(2, 256, 2, 4, 32, 128, 4, 80 + i) for i in range(launches)]
    check_launches_at_once([lambda lay=lay: _one(*lay, lay[0].x, lay[0].conv_state, lay[0].state)
                            for lay in layers])
