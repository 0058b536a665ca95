"""Helpers for the transformers-parity tests (tests/test_transformers_parity.py).

Builds a tiny random-weight Qwen3.5-MoE text model in transformers (PyTorch,
fp32, eager attention), saves it the way mlx-lm can read it, loads it back in
mlx-lm, and computes teacher-forced logits on both sides plus the error
metrics the tests report.

Facts this relies on (DESIGN-NOTES section 8, ../shared/docs/ outside this repository):
- ``save_pretrained(..., save_original_format=False)``: the default writes one
  key per expert, which mlx-lm's ``sanitize`` does not read.
- a causal-LM config says ``model_type: qwen3_5_moe_text``; mlx-lm loads it with
  ``model_config={"model_type": "qwen3_5_moe"}``.
- HF main RMSNorms apply ``1 + w``; mlx-lm's sanitize adds the 1 when it sees
  the HF conv1d layout. The gated norm is a plain multiply.
- ``rope_theta`` must sit inside ``rope_parameters``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np

import mlx.core as mx
import torch

# --------------------------------------------------------------------------
# Tiny configuration
# --------------------------------------------------------------------------

# Shapes are small, but every structural feature of the real model is kept:
# both layer kinds (full attention at layers 3 and 7), GQA (8 q / 2 kv heads),
# partial rotary 0.25 (16 of 64 dims), GDN with Hv = 2 * Hk, conv kernel 4,
# top-4-of-16 routed experts with renormalised weights and a gated shared
# expert, untied lm_head.
TINY_CONFIG: Dict = dict(
    vocab_size=384,
    hidden_size=128,
    num_hidden_layers=8,
    full_attention_interval=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
)


def make_hf_config(**overrides):
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import (
        Qwen3_5MoeTextConfig,
    )

    kw = dict(TINY_CONFIG)
    kw["rope_parameters"] = dict(kw["rope_parameters"])
    kw.update(overrides)
    cfg = Qwen3_5MoeTextConfig(**kw)
    cfg._attn_implementation = "eager"
    # Reference loop over experts: no grouped-mm kernels in the reference.
    try:
        cfg._experts_implementation = "eager"
    except Exception:  # pragma: no cover - older/newer attribute spelling
        pass
    return cfg


# --------------------------------------------------------------------------
# Random weights with non-trivial values
# --------------------------------------------------------------------------


# Router weight variance x fan_in (see randomize_weights_).
ROUTER_VAR = 3.0


def _inv_softplus(y: torch.Tensor) -> torch.Tensor:
    return torch.log(torch.expm1(y))


@torch.no_grad()
def randomize_weights_(model, seed: int) -> None:
    """Overwrite every parameter of an HF Qwen3_5MoeForCausalLM in place.

    Deterministic for a given ``seed`` (a fresh ``torch.Generator``), and chosen
    so that a wrong convention shows up as an O(1e-2..1) error instead of
    hiding in the noise:

    - linear weights ~ N(0, 1/fan_in): activations stay O(1) through 8 layers;
    - main RMSNorm weights (HF stores the offset, applied as ``1 + w``)
      ~ U(-0.4, 0.4): a missing or doubled ``+1`` is visible;
    - gated-norm weights (plain multiply) ~ U(0.6, 1.4);
    - conv1d weights ~ N(0, 0.5): not an identity or a moving average;
    - A_log = log U(0.1, 8); dt_bias chosen per head so that the decay
      exp(-exp(A_log) * softplus(dt_bias)) at a = 0 spans ~0.5..0.99, and
      in_proj_a is scaled so a moves it around that point;
    - router ~ N(0, 3/hidden): decisive routing (few near-ties between the
      k-th and k+1-th expert), all experts used over a sequence;
    - lm_head ~ N(0, 4/hidden): logits are not flat, so top-1 is meaningful.
    """
    g = torch.Generator().manual_seed(seed)
    cfg = model.config

    def normal(shape, std):
        return torch.randn(shape, generator=g, dtype=torch.float32) * std

    def uniform(shape, lo, hi):
        return torch.rand(shape, generator=g, dtype=torch.float32) * (hi - lo) + lo

    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        if name.endswith("embed_tokens.weight"):
            val = normal(shape, 1.0)
        elif name == "lm_head.weight":
            val = normal(shape, 2.0 / math.sqrt(cfg.hidden_size))
        elif name.endswith("linear_attn.norm.weight"):
            val = uniform(shape, 0.6, 1.4)
        elif name.endswith("norm.weight"):
            # input_layernorm, post_attention_layernorm, q_norm, k_norm, model.norm
            val = uniform(shape, -0.4, 0.4)
        elif name.endswith("conv1d.weight"):
            val = normal(shape, 0.5)
        elif name.endswith("A_log"):
            val = torch.log(uniform(shape, 0.1, 8.0))
        elif name.endswith("dt_bias"):
            continue  # set below, needs A_log of the same layer
        elif name.endswith("mlp.gate.weight"):
            val = normal(shape, math.sqrt(ROUTER_VAR / shape[-1]))
        elif name.endswith("experts.gate_up_proj"):
            val = normal(shape, 1.0 / math.sqrt(shape[-1]))
        elif name.endswith("experts.down_proj"):
            val = normal(shape, 1.0 / math.sqrt(shape[-1]))
        elif name.endswith("in_proj_a.weight"):
            val = normal(shape, 0.3 / math.sqrt(shape[-1]))
        elif p.ndim == 2:
            val = normal(shape, 1.0 / math.sqrt(shape[-1]))
        else:
            raise AssertionError(f"unhandled parameter {name} {shape}")
        p.copy_(val)

    # dt_bias: target decay d in U(0.5, 0.99) at a == 0
    # => A * softplus(dt_bias) = -log d  => dt_bias = softplus^-1(-log(d) / A)
    for name, mod in model.named_modules():
        if hasattr(mod, "dt_bias") and hasattr(mod, "A_log"):
            A = mod.A_log.exp()
            d = uniform(tuple(A.shape), 0.5, 0.99)
            mod.dt_bias.copy_(_inv_softplus(-torch.log(d) / A))


def build_hf_model(seed: int, **config_overrides):
    from transformers import Qwen3_5MoeForCausalLM

    torch.manual_seed(seed)
    cfg = make_hf_config(**config_overrides)
    with torch_single_thread():
        model = Qwen3_5MoeForCausalLM(cfg).to(torch.float32).eval()
        randomize_weights_(model, seed)
    return model


def save_hf_model(model, path) -> Path:
    path = Path(path)
    model.save_pretrained(path, save_original_format=False)
    cfg = json.loads((path / "config.json").read_text())
    # Guard against a transformers version that drops these on save.
    assert "rope_theta" in cfg.get("rope_parameters", {}), cfg.get("rope_parameters")
    return path


# --------------------------------------------------------------------------
# mlx-lm side
# --------------------------------------------------------------------------


def load_mlx(path):
    """Load the saved HF checkpoint in mlx-lm as fp32 (weights are fp32 on disk)."""
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(path), model_config={"model_type": "qwen3_5_moe"})
    for _, v in _flat_params(model):
        assert v.dtype == mx.float32, v.dtype
    return model


def _flat_params(model):
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())


def cast_mlx(model, dtype=mx.bfloat16):
    """Cast floating parameters to ``dtype`` as mlx_lm.convert does: paths the
    model's ``cast_predicate`` refuses (A_log for qwen3_5) stay fp32."""
    from mlx.utils import tree_map_with_path

    pred = getattr(model, "cast_predicate", lambda _: True)

    def f(k, v):
        if pred(k) and mx.issubdtype(v.dtype, mx.floating):
            return v.astype(dtype)
        return v

    model.update(tree_map_with_path(f, model.parameters()))
    mx.eval(model.parameters())
    return model


def perturb_rounding_(model, seed: int, rel: float = 2.0**-11):
    """Multiply every floating parameter except A_log by ``1 + rel * N(0, 1)``
    (deterministic for ``seed``). With ``rel`` = 2**-11, a quarter of bf16's
    relative spacing, a later bf16 cast gives a *different but equally valid*
    bf16 rounding of the same fp32 weights (about 1 weight in 4 moves by one
    bf16 ulp); fp32 logits move by ~1e-3 relative, far below the bf16 error.
    Used to measure how much the bf16-vs-fp32 error varies between equally
    good roundings."""
    from mlx.utils import tree_flatten

    rng = np.random.default_rng(seed)
    new = []
    for k, v in tree_flatten(model.parameters()):
        if k.endswith("A_log") or not mx.issubdtype(v.dtype, mx.floating):
            continue
        noise = rng.standard_normal(v.shape, dtype=np.float32) * np.float32(rel)
        new.append((k, v * (1 + mx.array(noise))))
    model.load_weights(new, strict=False)
    mx.eval(model.parameters())
    return model


@contextlib.contextmanager
def fp32_accumulating_gather_mm():
    """mlx's CPU ``gather_mm`` only accepts float32 ("[GatherMM::eval] Currently
    only supports float32"), so an unquantised bf16 MoE cannot run on CPU.
    Inside this context ``mx.gather_mm`` with non-fp32 inputs computes in fp32
    and rounds the result to the inputs' dtype -- what a GPU bf16 GEMM does
    (fp32 accumulate, bf16 output). Stock and patched models both see the
    same substitute (any module calling ``mx.gather_mm``), so the bf16
    comparison between them stays fair. A no-op for fp32 inputs."""
    orig = mx.gather_mm

    def gather_mm(a, b, *args, **kwargs):
        if a.dtype == mx.float32 and b.dtype == mx.float32:
            return orig(a, b, *args, **kwargs)
        # same dtype -> keep it; a mix with fp32 promotes to fp32
        out_dtype = a.dtype if a.dtype == b.dtype else mx.float32
        out = orig(a.astype(mx.float32), b.astype(mx.float32), *args, **kwargs)
        return out.astype(out_dtype)

    mx.gather_mm = gather_mm
    try:
        yield
    finally:
        mx.gather_mm = orig


def param_dtypes(model) -> Dict[str, str]:
    return {k: str(v.dtype) for k, v in _flat_params(model)}


def mlx_logits(model, tokens: np.ndarray) -> np.ndarray:
    """One-shot teacher-forced logits, no cache: [T, V] float32."""
    x = mx.array(tokens[None].astype(np.int32))
    out = model(x)
    out = out.astype(mx.float32)
    mx.eval(out)
    return np.array(out[0])


def mlx_cached_logits(
    model, tokens: np.ndarray, prefill_chunks: Sequence[int]
) -> np.ndarray:
    """Prefill ``tokens[:sum(prefill_chunks)]`` in the given chunks through an
    mlx-lm cache (state carried across calls), then decode the remaining tokens
    one at a time. Returns logits for positions ``sum(prefill_chunks)-1 ..
    T-1`` (the last prefill position plus every decoded one): [T-N+1, V]."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    N = int(sum(prefill_chunks))
    T = len(tokens)
    assert 0 < N < T
    toks = tokens.astype(np.int32)
    pos = 0
    last = None
    for n in prefill_chunks:
        out = model(mx.array(toks[None, pos : pos + n]), cache=cache)
        last = out[0, -1].astype(mx.float32)
        mx.eval(last, [c.state for c in cache])
        pos += n
    rows = [np.array(last)]
    for t in range(N, T):
        out = model(mx.array(toks[None, t : t + 1]), cache=cache)
        row = out[0, -1].astype(mx.float32)
        mx.eval(row)
        rows.append(np.array(row))
    return np.stack(rows)


# --------------------------------------------------------------------------
# HF side
# --------------------------------------------------------------------------


@contextlib.contextmanager
def torch_single_thread():
    """Tiny models run no slower on one torch thread, and on a shared 2-core
    machine a multi-threaded torch forward is 10x slower under load (measured
    0.2 s vs 2 s with load average ~5)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@torch.no_grad()
def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    ids = torch.from_numpy(tokens.astype(np.int64))[None]
    with torch_single_thread():
        out = model(input_ids=ids, use_cache=False)
    return out.logits[0].to(torch.float32).numpy()


# --------------------------------------------------------------------------
# Metrics and reporting
# --------------------------------------------------------------------------


def rel_l2(a: np.ndarray, ref: np.ndarray) -> float:
    a = np.asarray(a, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def top1_agreement(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.mean(np.argmax(a, -1) == np.argmax(ref, -1)))


def top1_margin_at_misses(a: np.ndarray, ref: np.ndarray) -> List[float]:
    """For positions where the top-1 differs: the reference's top-1 minus
    top-2 logit gap (small gaps = near-ties, not bugs)."""
    miss = np.nonzero(np.argmax(a, -1) != np.argmax(ref, -1))[0]
    out = []
    for i in miss:
        s = np.sort(ref[i])
        out.append(float(s[-1] - s[-2]))
    return out


def compare(name: str, a: np.ndarray, ref: np.ndarray) -> Dict:
    assert a.shape == ref.shape, (name, a.shape, ref.shape)
    assert np.all(np.isfinite(a)), f"{name}: non-finite logits"
    m = {
        "pair": name,
        "rel_l2": rel_l2(a, ref),
        "max_abs": float(np.max(np.abs(a.astype(np.float64) - ref))),
        "top1": top1_agreement(a, ref),
        "positions": int(a.shape[0]),
    }
    margins = top1_margin_at_misses(a, ref)
    if margins:
        m["ref_top1_top2_gap_at_misses"] = [round(x, 5) for x in margins[:10]]
    return m


def fmt(m: Dict) -> str:
    if "rel_l2_all" in m:
        return (
            f"{m['pair']}: rel_l2 " + ", ".join(f"{e:.3e}" for e in m["rel_l2_all"])
            + f" (max {m['rel_l2_max']:.3e}; patched bf16 bound"
            f" {m['bound_for_patched']:.3e})"
        )
    s = (
        f"{m['pair']}: rel_l2={m['rel_l2']:.3e} max_abs={m['max_abs']:.3e} "
        f"top1={100 * m['top1']:.2f}% over {m['positions']} positions"
    )
    if "ref_top1_top2_gap_at_misses" in m:
        s += f" (ref top1-top2 gap at misses: {m['ref_top1_top2_gap_at_misses']})"
    return s


REPORT_PATH = Path(
    os.environ.get(
        "MLX_QWEN_FAST_PARITY_REPORT",
        os.path.join(tempfile.gettempdir(), "mlx_qwen_fast_transformers_parity.json"),
    )
)
