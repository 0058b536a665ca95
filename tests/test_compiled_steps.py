"""The mx.compile'd decode steps' plumbing, on any backend.

The CUDA kernels run only on the H200 (tests/test_cuda_layers.py,
tests/test_cuda_moe_decode.py compare the compiled steps with the eager
launches there). Here the kernel calls are replaced by stand-ins that read
every argument, so that the compiled step -- the arrays passed in, their
order, the linear layers' static settings, the per-layer plan cache -- can be
checked against the eager path wherever the tests run.
"""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.qwen3_5 import GatedDeltaNet, TextModelArgs

import moe_blocks  # tests/ is on sys.path
from mlx_qwen_fast import layers
from mlx_qwen_fast.compiled import StepPlans, apply_linear, concat_linears, gather, linear_arrays, linear_paths
from mlx_qwen_fast.kernels import gated_delta_decode as k_decode
from mlx_qwen_fast.kernels import moe_decode_fused as mf
from mlx_qwen_fast.kernels import moe_decode_gemv as md
from mlx_qwen_fast.ops import gated_delta as gated_delta_ops
from mlx_qwen_fast.ops import moe


@pytest.fixture(autouse=True)
def _cpu_device():
    """These tests check the compiled steps' plumbing with fake kernels, bit
    for bit against eager calls, which holds on the CPU. On CUDA (H200,
    2026-12-02) a dense fp32 matmul of concatenated projection weights rounds
    differently from the separate ones (relative differences up to 5e-5), so
    the packed step's results are not comparable bit for bit there: run on
    the CPU device everywhere."""
    old = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(old)


@pytest.mark.parametrize("kind", ["linear", "linear-bias", "q4", "q8-bias"])
def test_apply_linear_equals_module(kind):
    m = nn.Linear(128, 96, bias=kind.endswith("bias"))
    if kind.startswith("q"):
        m = nn.QuantizedLinear.from_linear(m, group_size=64, bits=int(kind[1]))
    x = mx.random.normal((2, 3, 128))
    arrays, static = linear_arrays(m)
    assert mx.array_equal(apply_linear(x, arrays, static), m(x)).item()
    assert gather(m, [p[1:] for p in linear_paths(("m",), (arrays, static))]) == arrays
    assert linear_arrays(nn.RMSNorm(8)) is None


@pytest.mark.parametrize("kind", ["linear", "linear-bias", "q4", "q8-bias"])
def test_concat_linears_equals_concatenated_outputs(kind):
    """One layer over the stacked weights gives every layer's output, bit for
    bit (each output row is computed from the same numbers); layers with
    other settings are refused."""
    mods = []
    for out in (96, 32, 64):
        m = nn.Linear(128, out, bias=kind.endswith("bias"))
        if kind.startswith("q"):
            m = nn.QuantizedLinear.from_linear(m, group_size=64, bits=int(kind[1]))
        mods.append(m)
    x = mx.random.normal((2, 1, 128))
    arrays, static = concat_linears([linear_arrays(m) for m in mods])
    assert static == linear_arrays(mods[0])[1]
    y = apply_linear(x, arrays, static)
    assert y.shape == (2, 1, 192)
    assert mx.array_equal(y, mx.concatenate([m(x) for m in mods], axis=-1)).item()
    other = nn.Linear(128, 32, bias=not kind.endswith("bias"))
    assert concat_linears([linear_arrays(mods[0]), linear_arrays(other)]) is None
    wider = nn.Linear(256, 32, bias=kind.endswith("bias"))
    if kind.startswith("q"):
        wider = nn.QuantizedLinear.from_linear(wider, group_size=64, bits=int(kind[1]))
    assert concat_linears([linear_arrays(mods[0]), linear_arrays(wider)]) is None  # another input size
    assert concat_linears([]) is None


def test_step_plans_reuse_and_replan():
    m = nn.Linear(8, 4)
    calls = []

    def make():
        calls.append(1)
        return [("weight",), ("bias",)], len(calls)

    plans = StepPlans.of(m)
    assert StepPlans.of(m) is plans and "_mqf_step_plans" not in m  # not a parameter
    objs, plan = plans.get("k", m, make)
    assert plan == 1 and objs[0] is m.weight
    assert plans.get("k", m, make)[1] == 1  # cached
    assert plans.get("other", m, make)[1] == 2  # another key
    m.weight = m.weight * 2  # a replaced array is re-planned
    objs, plan = plans.get("k", m, make)
    assert plan == 3 and objs[0] is m.weight
    del m["bias"]  # a missing one too (make now lists what exists)
    with pytest.raises(KeyError):
        plans.get("k", m, make)


# ---------------------------------------------------------------------------
# Gated DeltaNet: the compiled step (projections + kernel + out_proj)
# ---------------------------------------------------------------------------

ARGS = TextModelArgs(
    model_type="qwen3_5_moe_text", hidden_size=256, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=1, head_dim=64, vocab_size=64,
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4,
)


def fake_decode_kernel(qkv, z, a, b, conv_weight, conv_state, A_log, dt_bias, norm_weight, state,
                       *, num_k_heads, num_v_heads, norm_eps=1e-6, qk_eps=1e-6, compiled=False):
    """Stands in for the CUDA kernel: the contract's shapes, every input used."""
    B, C = qkv.shape[0], qkv.shape[-1]
    x = qkv.reshape(B, 1, C)
    new_conv = mx.concatenate([conv_state[:, 1:], x], axis=1)
    mixed = (mx.concatenate([conv_state, x], axis=1) * conv_weight.reshape(C, -1).T).sum(1)
    hv = num_v_heads * 128
    gate = (a.reshape(B, -1) * A_log + b.reshape(B, -1) * dt_bias).sum(-1, keepdims=True)
    out = mixed[:, -hv:] * z.reshape(B, hv) * mx.tile(norm_weight, num_v_heads) + gate + norm_eps
    new_state = state * 0.5 + out.reshape(B, num_v_heads, 128, 1).astype(mx.float32)
    return out.reshape(B, 1, hv), new_conv, new_state


def fake_decode_kernel_packed(proj, params, conv_state, state,
                              *, num_k_heads, num_v_heads, norm_eps=1e-6, qk_eps=1e-6):
    """Stands in for the packed CUDA kernel: the pieces of proj and of params
    (``decode_params``' layout) at their offsets."""
    C, hv = (2 * num_k_heads + num_v_heads) * 128, num_v_heads * 128
    assert proj.shape[-1] == C + hv + 2 * num_v_heads
    assert params.dtype == mx.float32 and params.shape == (4 * C + 2 * num_v_heads + 128,)
    qkv, z = proj[..., :C], proj[..., C:C + hv]
    a, b = proj[..., C + hv:C + hv + num_v_heads], proj[..., C + hv + num_v_heads:]
    conv_weight, A_log = params[:4 * C].reshape(C, 4, 1), params[4 * C:4 * C + num_v_heads]
    dt_bias, norm_weight = params[4 * C + num_v_heads:4 * C + 2 * num_v_heads], params[4 * C + 2 * num_v_heads:]
    return fake_decode_kernel(qkv, z, a, b, conv_weight, conv_state, A_log, dt_bias, norm_weight, state,
                              num_k_heads=num_k_heads, num_v_heads=num_v_heads, norm_eps=norm_eps)


@pytest.fixture
def cpu_fused(monkeypatch):
    monkeypatch.setattr(gated_delta_ops, "implementation_for", lambda *_a, **_k: gated_delta_ops.CUDA_KERNEL)
    monkeypatch.setattr(k_decode, "supports", lambda *_a, **_k: True)
    monkeypatch.setattr(k_decode, "gated_delta_decode", fake_decode_kernel)
    monkeypatch.setattr(k_decode, "gated_delta_decode_packed", fake_decode_kernel_packed)


def gdn_layer(seed, quantize):
    mx.random.seed(seed)
    layer = GatedDeltaNet(ARGS)
    if quantize:
        nn.quantize(layer, group_size=64, bits=4, class_predicate=lambda _p, m: isinstance(m, nn.Linear)
                    and m.weight.shape[0] % 32 == 0)
    mx.eval(layer.parameters())
    return layers.rebind(layer, layers.FastGatedDeltaNet)


@pytest.mark.parametrize("packed", ["1", "0"])
@pytest.mark.parametrize("quantize", [False, True])
def test_gdn_compiled_step_equals_eager(cpu_fused, quantize, packed, monkeypatch):
    """Two layers through one trace, state carried over three steps. Packed
    (the default): the four input projections as one where they are alike
    (dense here; quantised, in_proj_a/b stay dense, so the step keeps four)."""
    monkeypatch.setenv(layers.GDN_PACKED_ENV, packed)
    for seed in (1, 2):
        layer = gdn_layer(seed, quantize)
        c_step, c_eager = ArraysCache(size=2), ArraysCache(size=2)
        for t in range(3):
            x = mx.random.normal((2, 1, ARGS.hidden_size), key=mx.random.key(10 * seed + t))
            y = layer(x, cache=c_step)
            conv = c_eager[0] if c_eager[0] is not None else mx.zeros((2, 3, layer.conv_dim))
            st = c_eager[1] if c_eager[1] is not None else mx.zeros((2, 4, 128, 128))
            y_ref = layer._decode_cuda_eager(x, conv, st, c_eager)
            assert mx.allclose(y, y_ref, rtol=1e-5, atol=1e-5).item()
            assert mx.allclose(c_step[1], c_eager[1], rtol=1e-5, atol=1e-5).item()
            assert mx.array_equal(c_step[0], c_eager[0]).item()
    plan = next(iter(layers.StepPlans.of(layer)._plans.values()))[2]
    # decode_params' array and the concatenated weight
    assert len(plan[2]) == (2 if packed == "1" and not quantize else 0)
    # a replaced weight is read by the next call
    x = mx.random.normal((2, 1, ARGS.hidden_size))
    y1 = layer(x, cache=ArraysCache(size=2))
    for mod, name in ((layer.norm, "weight"), (layer.conv1d, "weight"), (layer, "A_log"), (layer, "dt_bias")):
        # each of the constants decode_params packs (a copy)
        y0 = y1
        setattr(mod, name, getattr(mod, name) * 3 + 0.5)
        y1 = layer(x, cache=ArraysCache(size=2))
        assert not mx.allclose(y0, y1).item(), name
        c = ArraysCache(size=2)
        y_ref = layer._decode_cuda_eager(x, mx.zeros((2, 3, layer.conv_dim)), mx.zeros((2, 4, 128, 128)), c)
        assert mx.allclose(y1, y_ref, rtol=1e-5, atol=1e-5).item(), name
    layer.in_proj_z.weight = layer.in_proj_z.weight * 2  # an input projection too
    y2 = layer(x, cache=ArraysCache(size=2))
    y_ref = layer._decode_cuda_eager(x, mx.zeros((2, 3, layer.conv_dim)), mx.zeros((2, 4, 128, 128)),
                                     ArraysCache(size=2))
    assert not mx.allclose(y1, y2).item() and mx.allclose(y2, y_ref, rtol=1e-5, atol=1e-5).item()


def test_gdn_other_projection_kind_runs_eager(cpu_fused):
    layer = gdn_layer(3, quantize=False)
    layer.in_proj_a = nn.Sequential(layer.in_proj_a)  # not a plain linear layer
    x = mx.random.normal((1, 1, ARGS.hidden_size))
    c1, c2 = ArraysCache(size=2), ArraysCache(size=2)
    y = layer(x, cache=c1)
    y_ref = layer._decode_cuda_eager(x, mx.zeros((1, 3, layer.conv_dim)), mx.zeros((1, 4, 128, 128)), c2)
    assert mx.array_equal(y, y_ref).item()  # the same eager launches


# ---------------------------------------------------------------------------
# sparse MoE: the compiled decode step
# ---------------------------------------------------------------------------


def fake_launch_both(x, inds, scores, experts, shared, expert_gate):
    """Stands in for the two CUDA kernels: every array used, shapes as theirs."""
    def mean(t):
        if t.dtype == mx.uint32:
            t = (t & 0xF).astype(mx.float32)
        return t.astype(mx.float32).mean()

    arrays = [t for q in (*experts, *shared) for t in q] + list(expert_gate[:3])
    total = sum(mean(t) * (j + 1) for j, t in enumerate(arrays))
    mix = (scores[..., None] * inds[..., None].astype(mx.float32)).sum(-2)  # over the k slots
    return (x.astype(mx.float32) * mix + total).astype(x.dtype)


@pytest.fixture
def cpu_moe(monkeypatch):
    from mlx_qwen_fast.kernels import _cuda_build as cb
    from mlx_qwen_fast.kernels import moe_routing as mr

    monkeypatch.setattr(cb, "cuda_available", lambda: True)
    monkeypatch.setattr(md, "_launch_both", fake_launch_both)
    monkeypatch.setattr(mr, "route", lambda logits, k, normalize=True: moe.route(logits, k, normalize=normalize))
    monkeypatch.setenv(mf.FUSED_ENV, "0")  # the four-node step; the one-launch step: cpu_moe_fused
    monkeypatch.setattr(md, "_steps", {})  # traces of the fakes stay out of the real cache


def fake_launch_fused(x, router, experts, shared, expert_gate, top_k, normalize, sync, ctas):
    """Stands in for the one-launch kernel: the router through MLX's quantised
    matmul, ops.moe's routing, then fake_launch_both; sync and ctas recorded."""
    FUSED_CALLS.append((sync, ctas))
    logits = mx.quantized_matmul(x, *router, transpose=True, group_size=64, bits=router[0].shape[-1] * 32 // x.shape[-1])
    inds, scores = moe.route(logits, top_k, normalize=normalize)
    y = fake_launch_both(x, inds, scores, experts, shared, expert_gate)
    return y, logits, inds, scores, None, None


FUSED_CALLS = []


@pytest.fixture
def cpu_moe_fused(cpu_moe, monkeypatch):
    from mlx_qwen_fast.kernels import _cuda_build as cb

    monkeypatch.setenv(mf.FUSED_ENV, "1")
    monkeypatch.setattr(cb, "sm_count", lambda: 132)
    monkeypatch.setattr(mf, "supported_gpu", lambda: True)
    monkeypatch.setattr(mf, "_launch", fake_launch_fused)
    FUSED_CALLS.clear()


def test_moe_fused_step_plumbing(cpu_moe_fused):
    """The one-launch step: traced once, the block's router and expert arrays
    in, the block's own barrier buffer appended, the SM count as the grid;
    without MLX_QWEN_FAST_MOE_DECODE_FUSED=1 a block takes the four nodes."""
    import os

    blocks = [moe_blocks.make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16, seed=s) for s in (5, 6)]
    for i, block in enumerate(blocks):
        x = mx.random.normal((1, 2, 256), key=mx.random.key(3 + i)).astype(mx.bfloat16)
        got = md.moe_decode_step(block, x)
        want = fake_launch_fused(x, mf.router_arrays(block.gate), *md.block_arrays(block), 8, True, None, None)[0]
        assert mx.array_equal(got, want).item()
    syncs = [c[0] for c in FUSED_CALLS if c[1] == 132]
    assert syncs and all(s.dtype == mx.uint32 and s.shape == (mf.SYNC_WORDS,) for s in syncs)
    assert md.block_sync(blocks[0]) is not md.block_sync(blocks[1])  # one buffer per block
    os.environ[mf.FUSED_ENV] = "0"
    x = mx.random.normal((1, 1, 256)).astype(mx.bfloat16)
    n = len(FUSED_CALLS)
    assert mx.array_equal(md.moe_decode_step(blocks[0], x), md.moe_decode(blocks[0], x)).item()
    assert len(FUSED_CALLS) == n


def test_moe_compiled_step_equals_eager(cpu_moe):
    blocks = [moe_blocks.make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16, seed=s) for s in (5, 6)]
    for n in (1, 3):
        for i, block in enumerate(blocks):
            x = mx.random.normal((1, n, 256), key=mx.random.key(n + 7 * i)).astype(mx.bfloat16)
            assert mx.array_equal(md.moe_decode_step(block, x), md.moe_decode(block, x)).item()
    block = blocks[0]
    x = mx.random.normal((1, 1, 256)).astype(mx.bfloat16)
    y0 = md.moe_decode_step(block, x)
    block.shared_expert.down_proj.biases = block.shared_expert.down_proj.biases + 1
    y1 = md.moe_decode_step(block, x)
    assert not mx.array_equal(y0, y1).item()
    assert mx.array_equal(y1, md.moe_decode(block, x)).item()
    # a child replaced by one the kernels do not take: the step declines
    block.shared_expert_gate = nn.Sequential(block.shared_expert_gate)
    assert md.moe_decode_step(block, x) is None
