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
#: The Metal kernels of a sparse MoE block's prefill ("metal-prefill").
MOE_PREFILL_KERNELS = ("mqf_moe_route", "mqf_moe_group_count", "mqf_moe_group_scatter", "mqf_moe_gemm_gate_up",
                       "mqf_moe_gemm_down")
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
    assert moe_prefill == {name: len(model.layers) for name in MOE_PREFILL_KERNELS}


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
