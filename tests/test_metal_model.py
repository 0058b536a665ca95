"""The whole patched model through the CPU-executed Metal kernels
(``metal_model.py``: the package on "Metal", MLX on the CPU, every
``mx.fast.metal_kernel`` run from MLX's generated source by the Metal
checker), against stock mlx-lm on the CPU (plain MLX ops, no kernel):
greedy generation with mlx-lm's ``generate_step``, fp32, the same tokens
and logits within the fp32 bound (``compare.FP32_TOL``).

The kernels are not listed here. The test holds the run against the
:class:`~mlx_qwen_fast.patch_report.PatchReport` both ways
(``metal_model.kernel_problems``): every op the report gives a Metal
implementation ran a kernel of its family in its phase (prefill / decode),
and every kernel that ran is one the report names. A Metal kernel added to
the package (``mlx_qwen_fast/kernels/*metal*.py``, reported by the patch)
is picked up with no change to this file: it must run here, give stock's
tokens and logits, and be reported -- its shapes permitting
(``metal_model.model_config``: GDN heads of 128, attention head_dim 256).
Today that is the Gated DeltaNet decode step (the package's kernel), the
attention layer's decode step (its decode-attention kernels, and the
residual add fused with the post-attention RMSNorm: "linear.decode"), the
prompt's GDN recurrence (mlx-lm's own Metal kernel, "mlx-lm-metal") and the
prompt's sparse MoE blocks ("metal-prefill": routing, grouping and the
grouped 4-bit GEMMs; the model's fp32 scales are a format they read).

The same model in bf16 over a 257-token prompt
(:func:`test_bf16_model_through_every_metal_decode_kernel`) adds the MoE
decode kernels ("metal-decode", bf16 only) and the split-K attention
(a context past one 256-position block), held to the bf16 bound of
tests/test_patch.py against the fp32 reference.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx
import numpy as np
import pytest

import metal_check as mc
import metal_model as mm
from compare import FP32_TOL, assert_close
from mlx_qwen_fast import backend, config, patched_copy
from mlx_qwen_fast.checkpoint import DEMO_LM_HEAD_SCALE
from mlx_qwen_fast.kernels import add_rms_norm_metal as arn
from mlx_qwen_fast.kernels import gated_delta_decode_metal as gdm
from mlx_qwen_fast.ops import gated_delta as gated_delta_ops
from mlx_qwen_fast.ops import linear as linear_ops
from mlx_qwen_fast.ops import moe as moe_ops

pytestmark = pytest.mark.skipif(mc.CXX is None, reason="no C++ compiler (g++) to build the Metal sources")

PROMPT = 12  # tokens of the prompt: 11 in the prefill call, the last one as the first decode call
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def stock():
    """The model (seed 4, fp32, 4-bit as the checkpoint; logits far from
    flat), the prompt, and stock's tokens and logits on the CPU."""
    model, _ = mm.build(seed=4, lm_head_scale=DEMO_LM_HEAD_SCALE)
    prompt = mx.array(np.random.default_rng(3).integers(1, 1000, size=PROMPT), dtype=mx.int32)
    tokens, logits = mm.generate_tokens(model, prompt, NEW_TOKENS)
    return model, prompt, tokens, logits


def _patched_run(env, stock, new_tokens=NEW_TOKENS, inside=None):
    """The patched twin of stock's model under ``metal_backend``: (report,
    run, tokens, logits). ``inside(run)``: called in the context before the
    patch (the planted bugs); its return value is called on the way out."""
    model, prompt = stock[:2]
    with mm.metal_backend(env) as run:
        undo = inside(run) if inside is not None else None
        try:
            fast, report = patched_copy(model, warn=False)
            tokens, logits = mm.generate_tokens(run.model(fast), prompt, new_tokens, cache_model=fast)
        finally:
            if undo is not None:
                undo()
    return report, run, tokens, logits


def _check_against_stock(stock, tokens, logits):
    """Stock's tokens, and each step's logits within FP32_TOL of stock's."""
    s_tokens, s_logits = stock[2][:len(tokens)], stock[3][:len(tokens)]
    assert len(tokens) == len(s_tokens) > 0
    for i, (a, b) in enumerate(zip(logits, s_logits)):
        assert_close(a, b, FP32_TOL, f"logits of generated token {i}")
        assert tokens[i] == s_tokens[i], f"generated token {i}: {tokens[i]} vs stock's {s_tokens[i]}"


def test_patched_model_through_metal_kernels_matches_stock(env, stock):
    """Prompt of 12 tokens, 16 generated: stock's tokens, logits within
    FP32_TOL at every step; the report on "metal" names the Metal
    implementations and agrees with the kernels that ran, each of which ran;
    the GDN decode kernel once per GDN layer and decode call, the residual
    add + RMSNorm kernel once per attention layer and decode call (inside
    its layer step), each MoE prefill kernel once per layer in the prefill
    call."""
    report, run, tokens, logits = _patched_run(env, stock)
    assert len(tokens) == NEW_TOKENS
    _check_against_stock(stock, tokens, logits)
    assert report.patched and report.backend == backend.METAL
    ops = mm.metal_ops(report)
    # today's Metal implementations, at least (the others join through the report)
    assert ops.get("gated_delta.decode") == "metal-kernel" and ops.get("gated_delta.prefill") == "mlx-lm-metal"
    assert ops.get("moe.prefill") == "metal-prefill" and ops.get("linear.decode") == "compiled-layer+metal-kernel"
    assert mm.kernel_problems(report, run) == []
    ran = {k for phase in mm.PHASES for k in run.ran(phase)}
    assert ran and all(k.calls > 0 for k in ran)
    model = stock[0]
    n_gdn = sum(layer.is_linear for layer in model.layers)
    assert run.model_calls == {"prefill": 1, "decode": NEW_TOKENS + 1}  # generate_step computes one ahead
    decode = [k for k in run.ran("decode") if k.origin == gdm.__name__]
    assert len(decode) == 1 and run.ran("decode")[decode[0]] == n_gdn * run.model_calls["decode"]
    add_norm = [k for k in run.ran("decode") if k.origin == arn.__name__]
    n_attn = len(model.layers) - n_gdn
    assert len(add_norm) == 1 and run.ran("decode")[add_norm[0]] == n_attn * run.model_calls["decode"]
    moe_prefill = {k.name: n for k, n in run.ran("prefill").items() if k.origin.startswith("mlx_qwen_fast.kernels.moe")}
    assert moe_prefill == {name: len(model.layers) for name in mm.MOE_PREFILL_KERNELS}


def _stock_moe_prefill():
    """The "metal-prefill" MoE block replaced by mlx-lm's (stock's numbers;
    the report still names it). Returns the undo."""
    real = moe_ops.IMPLEMENTATIONS["metal-prefill"]
    moe_ops.IMPLEMENTATIONS["metal-prefill"] = moe_ops._stock
    return lambda: moe_ops.IMPLEMENTATIONS.__setitem__("metal-prefill", real)


def test_a_broken_or_skipped_metal_kernel_fails(env, stock):
    """The test can fail: the GDN decode kernel's output off by 1%
    (through the same SimKernel) fails the logits; the Metal decode
    declined (the layer's reference runs, its recurrence on mlx-lm's
    kernel: stock's numbers), and the residual add + RMSNorm kernel
    declined (the stock ops), fail the report's accounting. (The prompt's
    MoE blocks run mlx-lm's block here: the point is the GDN kernel, and
    the MoE prefill kernels cost most of a run in the checker.)"""
    def wrong_output(run):
        real = gdm.gated_delta_decode_metal

        def broken(*args, **kwargs):
            out, conv_state, state = real(*args, **kwargs)
            return out * 1.01, conv_state, state

        gdm.gated_delta_decode_metal = broken
        undo = _stock_moe_prefill()
        return lambda: (setattr(gdm, "gated_delta_decode_metal", real), undo())

    report, run, tokens, logits = _patched_run(env, stock, new_tokens=2, inside=wrong_output)
    with pytest.raises(AssertionError, match="logits of generated token 0"):
        _check_against_stock(stock, tokens, logits)

    def skipped(run):
        real, real_add_norm = gated_delta_ops._metal_decode, linear_ops.add_rms_norm_implementation
        gated_delta_ops._metal_decode = lambda *a, **k: None
        linear_ops.add_rms_norm_implementation = lambda *a, **k: "reference"
        undo = _stock_moe_prefill()
        return lambda: (setattr(gated_delta_ops, "_metal_decode", real),
                        setattr(linear_ops, "add_rms_norm_implementation", real_add_norm), undo())

    report, run, tokens, logits = _patched_run(env, stock, new_tokens=2, inside=skipped)
    _check_against_stock(stock, tokens, logits)  # the numbers alone do not show it
    problems = mm.kernel_problems(report, run)
    assert any(p.startswith("gated_delta.decode = 'metal-kernel' in the report, but no") for p in problems)
    assert any("mlx_lm.models.gated_delta) ran" in p and "in decode" in p for p in problems)
    assert any(p.startswith("linear.decode = 'compiled-layer+metal-kernel' in the report, but no") for p in problems)


def test_metal_backend_leaves_nothing_behind(env):
    """On the way out -- normally or by an exception -- the backend, MLX's
    metal_kernel and is_available, the kernel modules (their real kernels:
    None without Metal), the switch, the default device and mx.compile are
    as before."""
    from mlx_lm.models import gated_delta as stock_gd

    real_kernel, real_available = mx.fast.metal_kernel, mx.metal.is_available
    device = mx.default_device()
    before = (backend.current(), config.METAL_KERNELS.get(), stock_gd._gated_delta_kernel_packed, gdm._KERNEL)
    for fail in (False, True):
        with pytest.raises(RuntimeError, match="planted") if fail else contextlib.nullcontext():
            with mm.metal_backend(env) as run:
                assert backend.current() == backend.METAL and config.METAL_KERNELS.get()
                assert isinstance(stock_gd._gated_delta_kernel_packed, mc.SimKernel)
                assert mx.default_device() == mx.cpu and run.modules == mm.kernel_modules()
                if fail:
                    raise RuntimeError("planted")
        assert mx.fast.metal_kernel is real_kernel and mx.metal.is_available is real_available
        assert mx.default_device() == device
        after = (backend.current(), config.METAL_KERNELS.get(), stock_gd._gated_delta_kernel_packed, gdm._KERNEL)
        assert after == before
        traces = []

        @mx.compile
        def f(x):
            traces.append(1)
            return x + 1

        f(mx.array(1.0))
        f(mx.array(2.0))
        assert len(traces) == 1  # compiled again: traced once


def test_the_model_is_the_kernel_heads_fixtures(kernel_heads):
    """``metal_model.model_config`` is conftest's ``kernel_heads`` model
    (every decode kernel's shape: GDN heads of 128, attention head_dim 256),
    as a function, for the module-scoped ``stock`` fixture."""
    from mlx_qwen_fast import checkpoint

    assert mm.model_config() == checkpoint.preset_config(kernel_heads)
    assert mm.PRESET not in checkpoint.PRESETS  # registered only while mm.build builds


# --- bf16: the MoE decode kernels and the split-K attention -----------------

#: Prompt of the bf16 run: its first :data:`BF16_CHUNKS` ``[0]`` tokens in one
#: prefill call, the next ``[1]`` in a second, the last as the first decode
#: call, at position 256: one past mlx-lm's first KV buffer (256 positions,
#: ``KVCache.step``), so that step grows the buffer past
#: ``attention_decode_metal.SINGLE_PASS_MAX`` and every decode call takes
#: the split-K attention (its first block full, the second partly filled).
BF16_CHUNKS = (248, 8)
BF16_PROMPT = sum(BF16_CHUNKS) + 1
BF16_STEPS = 6  # decode calls
#: The Metal kernels of a sparse MoE block's decode ("metal-decode", bf16 only).
MOE_DECODE_KERNELS = ("mqf_moe_route", "mqf_moe_gate_up", "mqf_moe_down")


@contextlib.contextmanager
def _moe_prefill_on_stock():
    """Within: :func:`_stock_moe_prefill`."""
    undo = _stock_moe_prefill()
    try:
        yield
    finally:
        undo()


def _bf16_decode(model, prompt, *, tokens=None, cache_model=None, first_chunk=contextlib.nullcontext):
    """The prompt in the :data:`BF16_CHUNKS` prefill calls (the first inside
    ``first_chunk()``), then :data:`BF16_STEPS` one-token calls on a fresh
    prompt cache of ``cache_model`` (default ``model``): the last prompt
    token, then ``tokens[i]`` (default: greedy, each call's argmax).
    Returns (tokens, the fp32 logits ``[V]`` of each call)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(cache_model if cache_model is not None else model)
    first, second = BF16_CHUNKS
    with first_chunk():
        model(prompt[None, :first], cache=cache)
        mx.eval([c.state for c in cache])
    model(prompt[None, first:first + second], cache=cache)
    mx.eval([c.state for c in cache])
    chosen, logits, x = [], [], int(prompt[-1])
    for i in range(BF16_STEPS):
        row = model(mx.array([[x]]), cache=cache)[0, -1].astype(mx.float32)
        mx.eval(row)
        logits.append(row)
        chosen.append(int(mx.argmax(row)) if tokens is None else tokens[i])
        x = chosen[-1]
    return chosen, logits


def test_bf16_model_through_every_metal_decode_kernel(env):
    """bf16, a prompt of 257 tokens: every Metal kernel the report claims
    ran, and each decode call's logits are within the bf16 rounding bound.

    The fp32 test above leaves the MoE decode kernels (bf16 activations
    only) on stock and its 28 positions in one attention pass; here, on the
    same model in bf16, each decode call runs the routing, gate+up SwiGLU
    and down + combine kernels in every layer, and the split-K attention
    (split and combine kernels, never the single pass): the first decode
    call, at position 256, grows the KV buffers past one 256-position
    block. Checked:

    * accounting: the report on "metal" gives the MoE decode
      "metal-decode", and ``metal_model.kernel_problems`` finds it and the
      kernels that ran in agreement both ways (every Metal op's family ran
      a kernel in its phase, and nothing else ran); each MoE decode kernel
      ran once per layer and decode call, the attention's split and combine
      kernels once per attention layer and decode call, the MoE prefill
      kernels in the second prefill call;
    * numbers, teacher-forced on stock's greedy tokens (one bf16 flip at a
      near-tie would otherwise make the runs incomparable after it): at
      each decode call the patched logits' relative L2 error against the
      fp32 reference (``model.set_dtype(mx.float32)`` on the same 4-bit
      weights: bench/numerics.py's reference) is at most twice stock's own
      plus four times bf16's unit roundoff -- tests/test_patch.py's bound,
      the README's. Tokens are not compared here: on this random-weight
      model stock's own bf16 error is 5-11% (near-tie expert choices flip),
      which allows logit differences wider than every top-2 margin; token
      identity on the Metal path is checked in fp32 (above, and
      tests/test_metal_speculative.py).

    The first 248 prompt positions run the MoE blocks on mlx-lm's ops
    (``_stock_moe_prefill``, in both runs' first call alike): the grouped
    GEMM kernels cost ~0.25 s per token and layer in the checker; the
    second prefill call (8 tokens) runs them."""
    from mlx_qwen_fast.patching import clone_modules

    from compare import BF16_EPS, rel_err

    model, _ = mm.build(seed=4, lm_head_scale=DEMO_LM_HEAD_SCALE, dtype=mx.bfloat16)
    prompt = mx.array(np.random.default_rng(3).integers(1, 1000, size=BF16_PROMPT), dtype=mx.int32)
    tokens, stock_logits = _bf16_decode(model, prompt, first_chunk=_moe_prefill_on_stock)
    ref = clone_modules(model)
    ref.set_dtype(mx.float32)
    _, ref_logits = _bf16_decode(ref, prompt, tokens=tokens, first_chunk=_moe_prefill_on_stock)
    del ref
    with mm.metal_backend(env) as run:
        fast, report = patched_copy(model, warn=False)
        _, logits = _bf16_decode(run.model(fast), prompt, tokens=tokens, cache_model=fast,
                                 first_chunk=_moe_prefill_on_stock)

    ops = mm.metal_ops(report)
    assert ops.get("moe.decode") == "metal-decode" and ops.get("moe.prefill") == "metal-prefill"
    assert ops.get("attention.decode") == "compiled-layer+metal-kernel"
    assert mm.kernel_problems(report, run) == []
    assert run.model_calls == {"prefill": 2, "decode": BF16_STEPS}
    n_layers = len(model.layers)
    n_attn = sum(not layer.is_linear for layer in model.layers)
    decode = {k.name: n for k, n in run.ran("decode").items()}
    for name in MOE_DECODE_KERNELS:
        assert decode.get(name) == n_layers * BF16_STEPS, (name, decode)
    assert decode.get("mqf_attention_decode_split") == decode.get("mqf_attention_decode_combine") \
        == n_attn * BF16_STEPS and "mqf_attention_decode_single" not in decode, decode
    prefill = {k.name: n for k, n in run.ran("prefill").items() if k.origin.startswith("mlx_qwen_fast.kernels.moe")}
    assert prefill == {name: n_layers for name in mm.MOE_PREFILL_KERNELS}

    for i, (got, want, ref32) in enumerate(zip(logits, stock_logits, ref_logits)):
        e_stock, e_fast = rel_err(want, ref32), rel_err(got, ref32)
        bound = 2 * e_stock + 4 * BF16_EPS
        assert e_fast <= bound, f"decode call {i}: bf16 error vs fp32: patched {e_fast:.3e} > {bound:.3e} " \
                                f"(stock {e_stock:.3e})"
