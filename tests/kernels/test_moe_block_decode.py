"""The one-launch MoE block decode step (``kernels/moe_block_decode.py``:
RMSNorm + router GEMV, routing + gate/up SwiGLU, down + routing weights +
shared expert + combine + residual, with grid barriers between the phases).

The argument checks and the launch's sizes run on any backend. The kernel,
on CUDA (and the small shapes on the CPU through the CUDA check, with every
block resident and both thread schedules), against the three kernels it
fuses (``quantized_gemv`` with the norm and ``normed_out``, then
``moe_decode_gemv.moe_decode_logits_unchecked`` with the residual), run on the same
inputs: the output equals theirs bit for bit (bf16 only: the same device
code in the same arithmetic order), and so do the phases' intermediates in
the scratch output (logits, the SwiGLU rows of the selected pairs, the
shared gate). Chained steps feed each output back as the next input.
(Against the fp32 host reference: the fused kernels' own tests,
test_quantized_gemv.py and test_moe_decode_gemv.py.)

Outputs start as NaN (the ``poison`` fixture), so an element the kernel does
not write fails ``finite``.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
import pytest

from compare import finite
from launches_at_once import check_launches_at_once
from moe_blocks import make_arrays, quant
from mlx_qwen_fast.kernels import _cuda_build as cb
from mlx_qwen_fast.kernels import moe_block_decode as mb
from mlx_qwen_fast.kernels import moe_decode_gemv as md
from mlx_qwen_fast.kernels import quantized_gemv as qg

EPS = 1e-6
CPU = pytest.mark.cpu_check("moe_block_decode.cu", "quantized_gemv.cu", "moe_decode_gemv.cu")


@functools.lru_cache(maxsize=4)
def _weights(E, D, I, gate_bits, router_bits, seed):
    """(router, experts, shared, expert_gate, norm_weight), built once per
    argument set (never modified)."""
    experts, shared, eg = make_arrays(E, D, I, seed=seed, gate_bits=gate_bits)
    router = quant((E, D), seed + 50, scale=3.0, bits=router_bits)
    nw = (1.0 + 0.2 * mx.random.normal((D,), key=mx.random.key(seed + 60))).astype(mx.bfloat16)
    return router, experts, shared, eg, nw


def _x(n, D, seed):
    return (2.0 * mx.random.normal((n, 1, D), key=mx.random.key(seed))).astype(mx.bfloat16)


def _fused(x, w, k, rbits, normalize=True):
    router, experts, shared, eg, nw = w
    return mb.moe_block_decode_unchecked(x, nw, router, experts, shared, eg, k, EPS, normalize, 64, rbits,
                                return_scratch=True)


def _three(x, w, k, rbits, normalize=True):
    """The same step as three launches: (out, logits, xn, h, sgate)."""
    router, experts, shared, eg, nw = w
    logits, xn = qg.quantized_gemv(x, *router, group_size=64, bits=rbits, norm_weight=nw, norm_eps=EPS,
                                   normed_out=True)
    h, sgate, inds, scores = md._launch_route_gate_up(xn, logits, k, normalize, experts, shared, eg)
    out = md._launch_down(h, inds, scores, sgate, experts[2], shared[2], x)
    return out, logits, h, sgate, inds


def _scratch_parts(scratch, n, k, E, I):
    """(logits [n, E] bf16, h [n*k + n, I] bf16, sgate [n] f32) from the scratch words."""
    b = np.asarray(scratch).view(np.uint8)
    off_h = -(-n * E * 2 // 16) * 16
    off_sg = off_h + -(-(n * k + n) * I * 2 // 16) * 16
    logits = mx.array(b[:n * E * 2].view(np.uint16).reshape(n, E)).view(mx.bfloat16)
    h = mx.array(b[off_h:off_h + (n * k + n) * I * 2].view(np.uint16).reshape(n * k + n, I)).view(mx.bfloat16)
    sg = mx.array(b[off_sg:off_sg + 4 * n].view(np.float32))
    return logits, h, sg


def _check_equal(n, k, E, D, I, gate_bits=8, rbits=8, seed=0, steps=2, normalize=True):
    w = _weights(E, D, I, gate_bits, rbits, seed)
    x = _x(n, D, seed + 1)
    for step in range(steps):
        out, scratch = _fused(x, w, k, rbits, normalize)
        want, logits, h, sgate, inds = _three(x, w, k, rbits, normalize)
        mx.eval(out, scratch, want, logits, h, sgate, inds)
        assert out.shape == x.shape and out.dtype == mx.bfloat16
        assert finite(out)
        assert mx.array_equal(out, want).item(), f"step {step}: out differs from the three kernels'"
        s_logits, s_h, s_sg = _scratch_parts(scratch, n, k, E, I)
        assert mx.array_equal(s_logits, logits.reshape(n, E)).item(), f"step {step}: logits"
        assert mx.array_equal(s_sg, sgate).item(), f"step {step}: shared gate"
        # h: every row the down phase reads (each pair's row, the shared expert's)
        assert mx.array_equal(s_h, h).item(), f"step {step}: SwiGLU rows"
        x = out  # the next layer's input (the residual stream)


# ---------------------------------------------------------------------------
# host side (any backend)
# ---------------------------------------------------------------------------


def test_grid_blocks_and_sizes():
    """One block per SM at most, no more than any phase can use; the
    scratch and shared-memory sizes of the source's layout."""
    # 8 router blocks + 17 for the 33 shared items (phase A); 256 routed items over two teams, 128 down tiles
    assert mb.grid_blocks(1, 8, 256, 2048, 512, 8, 132) == 128
    assert mb.grid_blocks(1, 8, 256, 2048, 512, 4, 132) == 128  # 4 router blocks of 4 teams
    assert mb.grid_blocks(2, 8, 256, 2048, 512, 8, 132) == 132  # 512 routed items
    assert mb.grid_blocks(4, 8, 256, 2048, 512, 8, 80) == 80
    assert mb.grid_blocks(2, 4, 32, 256, 128, 8, 132) == 32  # 8 tiles x 8 distinct experts / 2 teams
    assert mb.grid_blocks(1, 1, 32, 256, 128, 8, 132) == 16  # 1 + 9 / 2 blocks in A, 8 / 2 in B < 16 down tiles
    assert mb.grid_blocks(1, 2, 64, 2048, 128, 8, 132) == 128  # D / 16 down tiles
    assert mb.grid_blocks(1, 8, 256, 2048, 512, 8, 3) == 3
    assert mb.scratch_words(1, 8, 256, 512) == (512 + 9 * 1024 + 16) // 4
    assert mb.smem_bytes(1, 8, 512) == 2 * (36864 + 4096)
    assert mb.smem_bytes(4, 8, 512) == 2 * (36864 + 4 * 4096)


def test_bad_input_names_the_argument(no_launch):
    """Every argument outside the contract: a ValueError naming it, before
    any launch; the valid call reaches the launch."""
    router, experts, shared, eg, nw = _weights(32, 256, 128, 8, 8, 3)
    x = _x(2, 256, 4)
    w, s, b = router
    kw = dict(top_k=4, norm_eps=EPS)

    def call(**over):
        args = dict(x=x, norm_weight=nw, router=router, experts=experts, shared=shared, expert_gate=eg) | {
            k: v for k, v in over.items() if k in ("x", "norm_weight", "router", "experts", "shared", "expert_gate")}
        return mb.moe_block_decode(**args, **(kw | {k: v for k, v in over.items() if k not in args}))

    for over, name in [
        (dict(x=x.astype(mx.float32)), "x"),
        (dict(x=mx.zeros((5, 1, 256), mx.bfloat16)), "x"),
        (dict(x=[1.0]), "x"),
        (dict(norm_weight=nw[:128]), "norm_weight"),
        (dict(norm_weight=nw.astype(mx.int32)), "norm_weight"),
        (dict(router=(w, s)), "router"),
        (dict(router=(w[:, :8], s, b)), r"router\[0\]"),
        (dict(router=(w, s.astype(mx.float16), b)), r"router\[1\]"),
        (dict(router=(w, s, b[:-1])), r"router\[2\]"),
        (dict(router_bits=3), "router_bits"),
        (dict(router_group_size=48), "router_group_size"),
        # values equal to a valid int but not ints: they would build (and cache) a broken kernel
        (dict(router_bits=8.0), "router_bits"),
        (dict(router_bits=mx.array(8)), "router_bits"),
        (dict(router_group_size=64.0), "router_group_size"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=33), "top_k"),
        (dict(top_k=17), "top_k"),  # rows * top_k > 32
        (dict(experts=experts[:2]), "experts"),
        (dict(shared=shared[:1]), "shared"),
        (dict(expert_gate=(eg[0], eg[1], eg[2], 3)), "expert_gate"),
        (dict(expert_gate=(eg[0], None, None, 16)), "expert_gate"),  # 16-bit: scales, biases still arrays
        (dict(experts={}), "experts"),
        (dict(norm_eps=0.0), "norm_eps"),
        (dict(norm_eps=float("nan")), "norm_eps"),
        (dict(after=[1.0]), "after"),
    ]:
        with pytest.raises(ValueError, match=name):
            call(**over)
    with pytest.raises(AssertionError, match="launched mqf_moe_block"):
        call()


def test_supports(monkeypatch):
    """True for a valid call exactly where CUDA is available; False (never an
    error) outside the contract; asked as if on CUDA for the rest."""
    router, experts, shared, eg, nw = _weights(32, 256, 128, 8, 8, 3)
    x = _x(2, 256, 4)
    assert mb.supports(x, nw, router, experts, shared, eg, top_k=4) == cb.cuda_available()
    monkeypatch.setattr(cb, "cuda_available", lambda: True)
    assert mb.supports(x, nw, router, experts, shared, eg, top_k=4)
    assert not mb.supports(x.astype(mx.float32), nw, router, experts, shared, eg, top_k=4)
    assert not mb.supports(x, nw, router[:2], experts, shared, eg, top_k=4)
    assert not mb.supports(x, nw, router, experts, shared, eg, top_k=4, router_bits=4)
    assert not mb.supports(x, nw, router, experts, shared, eg, top_k=17)
    assert not mb.supports(x, None, router, experts, shared, eg, top_k=4)
    assert not mb.supports(x, nw, router, {}, shared, eg, top_k=4)
    assert not mb.supports(x, nw, router, experts, shared, eg, top_k=4, router_bits=8.0)


# ---------------------------------------------------------------------------
# the kernel (CUDA; the small shapes also on the CPU through the CUDA check)
# ---------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("n,k,E,D,I,gate_bits,rbits", [
    pytest.param(1, 4, 32, 256, 128, 8, 8, marks=CPU),
    pytest.param(2, 4, 32, 256, 128, 4, 8, marks=CPU),
    pytest.param(3, 2, 64, 256, 128, 16, 4, marks=CPU),
    pytest.param(4, 2, 32, 256, 128, 8, 8, marks=CPU),
    (4, 8, 32, 256, 128, 8, 8),
    (1, 8, 256, 2048, 512, 8, 8),
    (2, 8, 256, 2048, 512, 8, 8),
    (4, 8, 256, 2048, 512, 8, 8),
])
def test_equals_three_kernels(n, k, E, D, I, gate_bits, rbits):
    """The output and the intermediates equal the three launches' bit for
    bit over two chained steps: 1 to 4 rows, 4- and 8-bit routers, the three
    shared-gate widths, tokens sharing experts (E = 32: one tile serving
    several pairs); GPU only: N*k = 32 on a full grid (on the CPU:
    test_few_blocks; the check runs a full grid of 512-thread blocks too,
    in minutes) and Qwen3.6-35B-A3B's block."""
    _check_equal(n, k, E, D, I, gate_bits, rbits, seed=10 * n + k)


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("n,k,E,D,sms", [
    pytest.param(2, 4, 32, 256, 3, marks=CPU),
    pytest.param(4, 8, 32, 256, 3, marks=CPU),
    pytest.param(1, 4, 32, 256, 1, marks=CPU),
    pytest.param(1, 2, 64, 2048, 3, marks=CPU),
    pytest.param(2, 2, 64, 2048, 1, marks=CPU),
])
def test_few_blocks(monkeypatch, n, k, E, D, sms):
    """Grids of 1 to 3 blocks (as on a GPU of that many SMs): each team
    several gate+up items, each block several down tiles, at 4 rows x top-8
    (N*k = 32: every lane of the routing a slot, several items per warp in
    the down phase); the shared expert's items where phase A has too few
    blocks for them: 3 blocks at E = 32 (block 0 the router's tiles, blocks
    1-2 four of the nine shared items, five left to phase B), one block (the
    router, then every shared item in phase B), D = 2048 with E = 64 (the
    router's two 8-warp teams per block as at the model's shapes: blocks 0-1
    the router, block 2 two shared items; one block: the router's tiles in
    two rounds); the same bits."""
    monkeypatch.setattr(cb, "sm_count", lambda: sms)
    assert mb.grid_blocks(n, k, E, D, 128, 8, cb.sm_count()) == sms
    _check_equal(n, k, E, D, 128, seed=40 + n, steps=1)


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("normalize", [pytest.param(False, marks=CPU), True])
def test_unnormalised_and_tied_logits(normalize):
    """normalize off (the raw top-k probabilities), and a zero router (every
    logit tied: the lowest ids win, as the routing kernel picks)."""
    _check_equal(2, 4, 32, 256, 128, seed=50, steps=1, normalize=normalize)
    router, experts, shared, eg, nw = _weights(32, 256, 128, 8, 8, 50)
    zero = tuple(mx.zeros_like(a) for a in router)
    w = (zero, experts, shared, eg, nw)
    x = _x(2, 256, 51)
    out, _ = _fused(x, w, 4, 8, normalize)
    want, *_ = _three(x, w, 4, 8, normalize)
    assert mx.array_equal(out, want).item()


@pytest.mark.cuda
@pytest.mark.cpu_check("moe_block_decode.cu")
def test_after_input_is_not_read(monkeypatch):
    """``after`` only orders the launch (MLX's graph edge from its writer):
    an array of another shape and dtype there leaves the output's bits as
    they are (a 3-block grid, as test_few_blocks)."""
    monkeypatch.setattr(cb, "sm_count", lambda: 3)
    w = _weights(32, 256, 128, 8, 8, 5)
    x = _x(2, 256, 6)
    router, experts, shared, eg, nw = w
    want = mb.moe_block_decode(x, nw, router, experts, shared, eg, top_k=4, norm_eps=EPS)
    got = mb.moe_block_decode(x, nw, router, experts, shared, eg, top_k=4, norm_eps=EPS, after=mx.arange(7))
    assert finite(got) and mx.array_equal(got, want).item()


@pytest.mark.cuda
@pytest.mark.cpu_check("moe_block_decode.cu")
def test_launches_in_a_row_need_no_filled_output(monkeypatch):
    """The barrier counter lives in the kernel's module and carries over
    launches on a GPU: five launches in a row, grids of 3 blocks and of every
    SM alternating, outputs left as allocated or filled with NaN: the same
    bits. (The CUDA check runs each launch in a process of its own.)"""
    w = _weights(32, 256, 128, 8, 8, 60)
    x = _x(2, 256, 61)
    results = []
    try:
        for sms, poison in ((3, False), (None, False), (3, True), (None, True), (3, False)):
            if sms is not None:
                monkeypatch.setattr(cb, "sm_count", lambda: sms)
            else:
                monkeypatch.undo()
            cb.set_poison(poison)
            out, _ = _fused(x, w, 4, 8)
            mx.eval(out)
            results.append(out)
    finally:
        cb.set_poison(None)
    for out in results:
        assert finite(out) and mx.array_equal(out, results[0]).item()


@pytest.mark.cuda
@pytest.mark.parametrize("n,E,D,I,launches,sms", [(2, 32, 256, 128, 12, 3), (2, 32, 256, 128, 6, None),
                                                  (1, 256, 2048, 512, 4, None), (4, 256, 2048, 512, 4, None)])
def test_launches_at_once(monkeypatch, n, E, D, I, launches, sms):
    """Independent launches of the MoE block in one ``mx.eval``, each equal
    to its launch alone (:func:`launches_at_once.check_launches_at_once`)."""
    if sms is not None:
        monkeypatch.setattr(cb, "sm_count", lambda: sms)
    w = _weights(E, D, I, 8, 8, 80)
    check_launches_at_once([lambda x=x: (_fused(x, w, 8, 8)[0],) for x in (_x(n, D, 81 + i) for i in range(launches))])


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
def test_compiled_equals_eager():
    """Inside mx.compile (as the decode step runs it) the eager launch's bits."""
    router, experts, shared, eg, nw = w = _weights(256, 2048, 512, 8, 8, 70)
    x = _x(2, 2048, 71)

    def step(x, nw, *a):
        return mb.moe_block_decode_unchecked(x, nw, a[:3], (a[3:6], a[6:9], a[9:12]), (a[12:15], a[15:18], a[18:21]),
                                    (a[21], a[22], a[23], eg[3]), 8, EPS, True, 64, 8)

    flat = [*router, *[t for e in experts for t in e], *[t for e in shared for t in e], *eg[:3]]
    compiled = mx.compile(step)
    for _ in range(2):
        got, want = compiled(x, nw, *flat), _fused(x, w, 8, 8)[0]
        assert mx.array_equal(got, want).item()
        x = got


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("n,k", [pytest.param(2, 4, marks=pytest.mark.cpu_check("moe_block_decode.cu"))])
def test_phase_clock_build(monkeypatch, n, k):
    """The diagnostic build (phase_clock=True): the default build's output
    bit for bit, and per block the seven marks' cycle counts from mark 0,
    non-decreasing (strictly on the CPU check, whose clock ticks once per
    read), the unused slot -1."""
    monkeypatch.setattr(cb, "sm_count", lambda: 3)
    w = _weights(32, 256, 128, 8, 8, 70)
    x = _x(n, 256, 71)
    router, experts, shared, eg, nw = w
    want, _ = _fused(x, w, k, 8)
    got, clocks = mb.moe_block_decode_unchecked(x, nw, router, experts, shared, eg, k, EPS, True, 64, 8, phase_clock=True)
    assert mx.array_equal(got, want).item()
    blocks = mb.grid_blocks(n, k, 32, 256, 128, 8, cb.sm_count())
    assert clocks.shape == (blocks, 8) and clocks.dtype == mx.int64
    c = np.array(clocks)
    m = len(mb.PHASE_MARKS)
    assert (c[:, 0] == 0).all() and (np.diff(c[:, :m], axis=1) >= 0).all() and (c[:, m:] == -1).all()
    if not cb.cuda_available():
        assert (np.diff(c[:, :m], axis=1) > 0).all()
