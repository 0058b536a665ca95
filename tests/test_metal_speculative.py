"""mlx-lm's speculative decoding on the patched model through the
CPU-executed Metal kernels (``metal_model.py``: the package on "Metal",
MLX on the CPU, every ``mx.fast.metal_kernel`` run from MLX's generated
source by the Metal checker), fp32.

A verify of S tokens runs the target over the last accepted token and the
S - 1 drafts in one call: on Metal with ``MLX_QWEN_FAST_METAL=1`` its
sparse MoE blocks take "metal-prefill" (the routing, grouping and grouped
GEMM kernels) for S > ``ops.moe.DECODE_MAX_TOKENS`` (4) and "metal-decode"
otherwise (bf16 only: stock in fp32); its Gated DeltaNet layers run their
own call and roll back by replay (``speculative.REPLAY_BACKENDS``), the
draft's one-token calls the Metal decode kernels. The greedy tokens must be
plain stock decoding's.
"""

from __future__ import annotations

import math
import sys

import mlx.core as mx
import numpy as np
import pytest

import metal_check as mc
import metal_model as mm
from compare import FP32_TOL, assert_close
from mlx_qwen_fast import patched_copy
from mlx_qwen_fast.checkpoint import DEMO_LM_HEAD_SCALE
from mlx_qwen_fast.ops import moe as moe_ops

pytestmark = pytest.mark.skipif(mc.CXX is None, reason="no C++ compiler (g++) to build the Metal sources")

#: Prompt tokens: its prefill (all but the last) is 4 tokens, which keeps
#: the MoE prefill kernels (~1.5 s per call and layer in the checker) for
#: the verifies.
PROMPT = 5
#: Draft tokens per round: verifies of 8 tokens, and fewer where the last
#: round has fewer tokens left to make.
NUM_DRAFT = 7
NEW_TOKENS = 10


def test_speculative_verify_through_metal_kernels_is_plain_greedy(env, monkeypatch):
    """``speculative_generate_step`` (mlx-lm's loop, through the package's
    wrapper) with the patched target and a patched draft (the target's
    weights routed differently: it agrees on part of the tokens), 7 draft
    tokens a round, 10 tokens: the target's plain stock greedy tokens;
    drafts both accepted and rejected (verifies trimmed inside, the Gated
    DeltaNet layers replaying the accepted prefix); every MoE call of the
    target of 5 to 8 rows (a verify: the prompt's prefill has 4) launched
    each "metal-prefill" kernel once, and such verifies happened."""
    model, _ = mm.build(seed=4, lm_head_scale=DEMO_LM_HEAD_SCALE)
    draft_model, _ = mm.build(seed=4, lm_head_scale=DEMO_LM_HEAD_SCALE, router_skew=0.5)
    prompt = mx.array(np.random.default_rng(3).integers(1, 1000, size=PROMPT), dtype=mx.int32)
    want, want_logits = mm.generate_tokens(model, prompt, NEW_TOKENS)

    calls = []  # (block, rows, {kernel name: launches}) of each "metal-prefill" call
    with mm.metal_backend(env) as run:
        fast, _ = patched_copy(model, warn=False)
        draft, _ = patched_copy(draft_model, warn=False)
        real = moe_ops.IMPLEMENTATIONS["metal-prefill"]

        def counted(block, x):
            launched = {}
            try:
                with run.launches() as launched:
                    return real(block, x)
            finally:
                calls.append((block, math.prod(x.shape[:-1]), {k.name: n for k, n in launched.items()}))

        monkeypatch.setitem(moe_ops.IMPLEMENTATIONS, "metal-prefill", counted)
        step = sys.modules["mlx_lm.generate"].speculative_generate_step  # the package's wrapper (patch installs it)
        got = list(step(prompt, fast, draft, num_draft_tokens=NUM_DRAFT, max_tokens=NEW_TOKENS, stream=mx.cpu))

    assert [int(t) for t, _, _ in got] == want
    for i, ((_, logprobs, _), logits) in enumerate(zip(got, want_logits)):
        assert_close(logprobs, logits - mx.logsumexp(logits), FP32_TOL, f"log-probabilities of token {i}")
    from_draft = sum(d for _, _, d in got)
    assert 0 < from_draft < NEW_TOKENS - 1, from_draft  # some drafts accepted, some rejected
    blocks = {id(layer.mlp) for layer in fast.layers}
    verifies = [(rows, launched) for block, rows, launched in calls if id(block) in blocks]
    assert len(verifies) >= len(fast.layers) and all(moe_ops.DECODE_MAX_TOKENS < rows <= NUM_DRAFT + 1
                                                     for rows, _ in verifies), [r for r, _ in verifies]
    for rows, launched in verifies:
        assert launched == {name: 1 for name in mm.MOE_PREFILL_KERNELS}, (rows, launched)
