"""The one-launch decode experts (kernels/moe_decode_overlap.py) vs the two kernels.

Host-side parts (shared-memory size, the shapes it declines, argument checks)
run everywhere; the kernel tests are marked ``cuda``. Outputs are poisoned
with NaN before every launch; weights and tokens are fresh random draws.

- ``y``, ``h`` and ``sgate`` equal the two kernels' of
  :mod:`mlx_qwen_fast.kernels.moe_decode_gemv` bit for bit (same tile
  arithmetic, items summed in the same slot order), for one token and for
  several tokens that share experts, k from 2 to 10, the model's and a small
  shape;
- ``y`` vs the fp32 reference: ``2 * BF16_EPS`` relative L2;
- the counter words of the barrier buffer are zero after every launch, and
  repeated launches on one buffer give the same bits.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_qwen_fast.kernels import moe_decode_fused as mf
from mlx_qwen_fast.kernels import moe_decode_gemv as md
from mlx_qwen_fast.kernels import moe_decode_overlap as mo

from cuda_helpers import BF16_EPS, HAS_CUDA, cuda, finite, needs_cuda, rel
from test_cuda_moe_decode import make_arrays, make_routing, x_tokens


def test_smem_bytes_matches_the_layout():
    """The model's shape: 9 items x 16 rows x (256 + 64) B, scales/biases, h, outputs."""
    assert mo.smem_bytes(1, 8, 2048, 512) == 9 * 16 * 320 + 9 * 2 * 16 * 8 * 2 + 9 * 512 * 2 + 9 * 16 * 4
    assert mo.smem_bytes(1, 8, 2048, 512) == 60480
    # the gate+up tile's size where it is the larger one
    assert mo.smem_bytes(1, 1, 2048, 128) == md.gate_up_smem_bytes(1)


@pytest.mark.parametrize("n,k,D,I,why", [
    (1, 32, 2048, 512, "N*k"), (4, 8, 2048, 512, "N*k"), (2, 8, 2048, 512, "shared memory"),
    (1, 8, 2048, 1024, "shared memory"), (1, 8, 2000, 512, "D % 256"), (1, 8, 2048, 500, "I % 128"),
    (5, 1, 2048, 512, "N*k"), (1, 1, 2048, 128, "down row blocks"),
])
def test_problem_names_the_reason(n, k, D, I, why):
    assert why in mo.problem(n, k, D, I)


def test_problem_without_cuda_or_with_too_many_down_ctas(monkeypatch):
    from mlx_qwen_fast.kernels import _cuda_build as cb

    monkeypatch.setattr(cb, "cuda_available", lambda: False)
    assert "CUDA GPU" in mo.problem(1, 8, 2048, 512)
    monkeypatch.setattr(cb, "cuda_available", lambda: True)
    monkeypatch.setattr(cb, "gpu_arch", lambda: (8, 0))
    assert "9.0" in mo.problem(1, 8, 2048, 512)
    monkeypatch.setattr(cb, "gpu_arch", lambda: (9, 0))
    monkeypatch.setattr(cb, "sm_count", lambda: 128)
    assert "fewer than the 128 SMs" in mo.problem(1, 8, 2048, 512)
    monkeypatch.setattr(cb, "sm_count", lambda: 132)
    assert mo.problem(1, 8, 2048, 512) is None


def test_bad_arguments_are_named():
    experts, shared, eg = make_arrays(16, 256, 128, seed=1)
    x = x_tokens(1, 256, 2)
    inds, scores = make_routing(1, 4, 16, 3)
    with pytest.raises(ValueError, match="moe_decode_overlap"):
        mo.moe_decode_overlap(x.astype(mx.float32), inds, scores, experts, shared, eg, mf.new_sync())
    if HAS_CUDA:
        with pytest.raises(ValueError, match="sync must be uint32"):
            mo.moe_decode_overlap(x, inds, scores, experts, shared, eg, mx.zeros((64,), mx.int32))
        with pytest.raises(ValueError, match="N\\*k"):
            mo.moe_decode_overlap(x, mx.zeros((1, 32), mx.int32), mx.zeros((1, 32)), experts, shared, eg,
                                  mf.new_sync())
    else:
        with pytest.raises(ValueError, match="CUDA GPU"):
            mo.moe_decode_overlap(x, inds, scores, experts, shared, eg, mf.new_sync())


def check_overlap(n, k, E=64, D=2048, I=512, seed=0, gate_bits=8, sync=None):
    experts, shared, eg = make_arrays(E, D, I, seed=seed, gate_bits=gate_bits)
    x = x_tokens(n, D, seed + 100)
    inds, scores = make_routing(n, k, E, seed + n)
    sync = mf.new_sync() if sync is None else sync
    y, h, sg = mo._launch(x, inds, scores, experts, shared, eg, sync)
    h2, sg2 = md.gate_up_swiglu(x, inds, experts, shared, eg)
    y2 = md.down_combine(h2, inds, scores, sg2, experts[2], shared[2])
    mx.eval(y, h, sg, y2, h2, sg2, sync)
    assert y.shape == (n, D) and y.dtype == mx.bfloat16 and finite(y, h, sg)
    assert mx.array_equal(h, h2).item() and mx.array_equal(sg, sg2).item()
    assert mx.array_equal(y, y2).item()
    assert rel(y, md.reference(x, inds, scores, experts, shared, eg)[2]) < 2 * BF16_EPS
    assert int(sync[32].item()) == 0 and int(sync[33].item()) == 0  # counters reset for the next launch
    return y


@cuda
@needs_cuda
@pytest.mark.parametrize("n,k", [(1, 8), (1, 2), (1, 10), (2, 4), (3, 2)])
def test_overlap_equals_two_kernels(poison, n, k):
    check_overlap(n, k, seed=10 * n + k)


@cuda
@needs_cuda
def test_overlap_model_shape_and_small_shape(poison):
    check_overlap(1, 8, E=256, seed=5)
    check_overlap(1, 4, E=32, D=256, I=128, seed=6, gate_bits=16)
    check_overlap(2, 3, E=32, D=256, I=128, seed=7, gate_bits=4)


@cuda
@needs_cuda
def test_overlap_repeated_on_one_buffer(poison):
    """Ten launches on one barrier buffer, mixed with other sizes: same bits."""
    sync = mf.new_sync()
    ys = [check_overlap(1, 8, seed=3, sync=sync) for _ in range(5)]
    check_overlap(2, 4, seed=4, sync=sync)
    ys += [check_overlap(1, 8, seed=3, sync=sync) for _ in range(5)]
    assert all(mx.array_equal(y, ys[0]).item() for y in ys[1:])
    assert not np.any(np.asarray(sync[32:34]))
