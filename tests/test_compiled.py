"""``mlx_qwen_fast.compiled``: linear layers as arrays for the compiled
decode steps (``linear_arrays``, ``apply_linear``, ``concat_linears``,
``gather``/``linear_paths``) and the per-layer plan cache (``StepPlans``).

The compiled steps that use them: tests/ops/test_gated_delta.py and
tests/ops/test_moe.py.
"""

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_qwen_fast.compiled import StepPlans, apply_linear, concat_linears, gather, linear_arrays, linear_paths


@pytest.fixture(autouse=True)
def _cpu_device():
    """Results are compared bit for bit with the modules' own calls, which
    holds on the CPU. On CUDA (H200, 2026-12-02) a dense fp32 matmul of
    concatenated weights rounds differently from the separate ones (relative
    differences up to 5e-5): run on the CPU device everywhere."""
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
