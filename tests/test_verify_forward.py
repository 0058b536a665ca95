"""A verify forward: S tokens per row in one call with a cache, on the
patched model, against S one-token calls and against stock mlx-lm.

fp32 on the CPU (every op family's CPU path; the tight fp32 bound) and
bf16 on CUDA (at S = 2 also through the CUDA check, ``cpu_check``: the
tiny model's MoE blocks on the decode kernels, which take up to 4 tokens;
from 5 tokens to ``PREFILL_MIN_TOKENS`` the block is stock; the one-token
steps on the compiled decode step with the fused GEMV; its Gated DeltaNet
(head dim 64) and attention (head dim 64) keep the reference paths, which
the kernels' own tests cover).
"""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from compare import FP32_TOL, assert_close, tolerance
from mlx_qwen_fast.checkpoint import DEMO_LM_HEAD_SCALE, build_model
from mlx_qwen_fast.ops import moe
from mlx_qwen_fast.patching import patched_copy

PROMPT = [1, 5, 9, 33, 100, 7, 8, 200, 300, 11]


def _prefilled(model, batch):
    cache = make_prompt_cache(model)
    prompt = mx.array([PROMPT[i:] + PROMPT[:i] for i in range(batch)])
    mx.eval(model(prompt, cache=cache))
    return cache


def _forwards(model, tokens):
    """(logits of one call over tokens [B, S], of S one-token calls
    [B, S, V]), each on its own copy of the prefilled cache."""
    B, S = tokens.shape
    cache = _prefilled(model, B)
    once = model(tokens, cache=cache)
    cache = _prefilled(model, B)
    steps = mx.concatenate([model(tokens[:, t:t + 1], cache=cache) for t in range(S)], axis=1)
    mx.eval(once, steps)
    return once, steps


def _tokens(B, S, seed):
    return mx.random.randint(1, 1000, (B, S), key=mx.random.key(seed))


@pytest.fixture(scope="module")
def fp32_models():
    stock, _ = build_model("tiny", seed=0, dtype=mx.float32, lm_head_scale=DEMO_LM_HEAD_SCALE)
    fast, report = patched_copy(stock)
    assert report.patched
    return stock, fast


@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("S", [2, 5, 8, 16])
def test_verify_forward_fp32_is_steps_and_stock(fp32_models, S, B):
    """fp32, CPU: the patched model's S-token call = its S one-token calls
    = stock's S-token call, to the fp32 bound (the same math in another
    order: chunked vs recurrent Gated DeltaNet, attention over S queries)."""
    stock, fast = fp32_models
    tokens = _tokens(B, S, 10 * S + B)
    once, steps = _forwards(fast, tokens)
    assert once.shape == steps.shape == (B, S, once.shape[-1])
    assert_close(once, steps, FP32_TOL, "one call vs S one-token calls")
    ref = stock(tokens, cache=_prefilled(stock, B))
    assert_close(once, ref, FP32_TOL, "patched vs stock")


#: The bf16 runs' bound on the logits: the tiny model's 8 layers, each with
#: the points where the two paths round to bf16 independently on its longest
#: path (the MoE block's four, counted as its kernel tests count them, the
#: mixer's and the residual adds' in stock's ops: six per layer), and the
#: final norm and head (two).
LAYERS = 8
BF16_LOGITS_TOL = tolerance(mx.bfloat16, roundings=6 * LAYERS + 2)


@pytest.fixture(scope="module")
def bf16_models():
    stock, _ = build_model("tiny", seed=0, dtype=mx.bfloat16, lm_head_scale=DEMO_LM_HEAD_SCALE)
    return stock


@pytest.mark.cuda
@pytest.mark.parametrize("S,B", [
    pytest.param(2, 1, marks=pytest.mark.cpu_check("moe_decode_gemv.cu")),
    (5, 1),  # GPU only from here: the MoE blocks stock, the check has no kernel of theirs to run
    (8, 2),
    (16, 1),
])
def test_verify_forward_bf16_on_the_kernels(bf16_models, S, B):
    """bf16 on CUDA (CPU-checked): the patched model's S-token call (its
    MoE blocks on the kernel of B*S tokens) against its S one-token calls
    (the compiled decode step) and against stock's S-token call, within the
    bf16 bound of the logits (relative L2 over the whole [B, S, V])."""
    stock = bf16_models
    fast, report = patched_copy(stock)
    assert report.ops["moe.decode"] in ("cuda-decode", "cuda-block")
    n = S * B
    assert moe.implementation_for(n) == ("cuda-decode" if n <= moe.DECODE_MAX_TOKENS else
                                         "cuda-prefill" if n >= moe.PREFILL_MIN_TOKENS else "stock")
    tokens = _tokens(B, S, 100 + 10 * S + B)
    once, steps = _forwards(fast, tokens)
    assert_close(once, steps, BF16_LOGITS_TOL, "one call vs S one-token calls")
    ref = stock(tokens, cache=_prefilled(stock, B))
    assert_close(once, ref, BF16_LOGITS_TOL, "patched vs stock")
