"""The Metal routing kernel (``kernels/moe_route_metal.py``: softmax, top-k,
renormalisation, one SIMD group per token), run on the CPU through
``tests/metal_check.py`` (MLX's generated source as C++, one fiber per GPU
thread, guard pages, outputs poisoned: an unwritten id reads -1, an
unwritten score NaN), against a numpy fp32 host reference with the
contract's selection rule (decreasing probability, the lower expert id on
ties): ids exact, scores (float32 results) within FP32_TOL whatever the
logits' dtype (the reference reads the same rounded logits).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import metal_check as mc
from compare import FP32_TOL, assert_close, npa
from mlx_qwen_fast.kernels import moe_route_metal as rm

pytestmark = pytest.mark.skipif(mc.CXX is None, reason="no C++ compiler (g++) to build the Metal sources")

MODULE = "mlx_qwen_fast.kernels.moe_route_metal"


def route_reference(logits, k, normalize):
    """(inds [N, k] int64, scores [N, k] float32): fp32 softmax, the k
    largest probabilities in decreasing order, ties to the lower id."""
    lg = npa(logits).astype(np.float32).reshape(-1, logits.shape[-1])
    p = np.exp(lg - lg.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    ids = np.arange(lg.shape[-1])
    inds = np.stack([np.lexsort((ids, -row))[:k] for row in p])
    scores = np.take_along_axis(p, inds, -1)
    if normalize:
        scores = scores / scores.sum(-1, keepdims=True)
    return inds, scores.astype(np.float32)


def check(logits, k, normalize=True):
    with mc.simulated_modules(MODULE) as (m,):
        inds, scores = m.route_metal(logits, k, normalize=normalize)
        assert m._kernel().calls == 1
    lead = tuple(logits.shape[:-1])
    assert inds.shape == (*lead, k) and inds.dtype == mx.int32
    assert scores.shape == (*lead, k) and scores.dtype == mx.float32
    ref_i, ref_s = route_reference(logits, k, normalize)
    np.testing.assert_array_equal(np.asarray(inds).reshape(-1, k), ref_i)
    assert_close(scores.reshape(-1, k), ref_s, FP32_TOL, "scores")
    return inds, scores


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("n, E, k, normalize", [
    (1, 32, 1, True),     # one expert per lane, one round
    (4, 64, 8, True),     # two logits per lane
    (2, 256, 8, True),    # the model's router: 256 experts, top-8
    (3, 64, 2, False),    # the softmax probabilities themselves
    (1, 64, 32, True),    # every lane holds a slot
])
def test_route_matches_reference(dtype, n, E, k, normalize):
    logits = (2.0 * mx.random.normal((n, E), key=mx.random.key(E + 7 * n + k))).astype(dtype)
    check(logits, k, normalize)


def test_route_ties_go_to_the_lower_id():
    """Logits of a few distinct values (every selection breaks ties), a row
    of equal logits (the first k ids, equal weights), leading axes."""
    rng = np.random.default_rng(11)
    rows = rng.integers(0, 3, size=(3, 64)).astype(np.float32)
    rows = np.concatenate([rows, np.full((1, 64), 0.5, np.float32)])
    logits = mx.array(rows).reshape(2, 2, 64)
    inds, scores = check(logits, 8)
    np.testing.assert_array_equal(np.asarray(inds)[1, 1], np.arange(8))
    assert_close(scores[1, 1], mx.full((8,), 1 / 8), FP32_TOL, "equal weights")
    check(mx.array(rows).astype(mx.bfloat16), 5, normalize=False)


def test_route_argument_checks():
    """Refused by name before any kernel is built (no Metal needed); no
    tokens: empty results without a launch."""
    good = mx.zeros((2, 64))
    with pytest.raises(ValueError, match=r"route_metal: logits must be .*\[\.\.\., E\].*got \S*int32 \(2, 64\)"):
        rm.route_metal(good.astype(mx.int32), 2)
    with pytest.raises(ValueError, match=r"multiple of 32.*got \S*float32 \(2, 48\)"):
        rm.route_metal(mx.zeros((2, 48)), 2)
    with pytest.raises(ValueError, match=r"\[32, 1024\].*\(1, 2048\)"):
        rm.route_metal(mx.zeros((1, 2048)), 2)
    with pytest.raises(ValueError, match="logits must"):
        rm.route_metal(np.zeros((2, 64), np.float32), 2)
    for bad in (0, 33, 2.0, True, None):
        with pytest.raises(ValueError, match=r"top_k must be an int in \[1, min\(32, E=64\)\]"):
            rm.route_metal(good, bad)
    with pytest.raises(ValueError, match=r"top_k .*E=32"):
        rm.route_metal(mx.zeros((1, 32)), 33)
    inds, scores = rm.route_metal(mx.zeros((0, 3, 64)), 4)
    assert inds.shape == scores.shape == (0, 3, 4) and inds.dtype == mx.int32 and scores.dtype == mx.float32
