"""The kernel wrappers' public functions reject input that would send a kernel
outside its arrays before anything is built or launched (so these run on
the CPU too: a launch there would fail with "no CUDA", not with the
ValueError the tests expect): ids out of range, damaged routings, arguments
that are not arrays; and an empty batch returns empty results without a
launch (an empty grid is a CUDA launch error)."""

import mlx.core as mx
import pytest

import moe_blocks
from gdn_helpers import NOT_ARRAYS
from mlx_qwen_fast.kernels import _checks
from mlx_qwen_fast.kernels import _cuda_build as cb
from mlx_qwen_fast.kernels import gated_delta_contract as gdc
from mlx_qwen_fast.kernels import gated_delta_decode as gdd
from mlx_qwen_fast.kernels import gated_delta_frontend as gdf
from mlx_qwen_fast.kernels import gated_delta_scan as gds
from mlx_qwen_fast.kernels import gated_rms_norm as grn
from mlx_qwen_fast.kernels import moe_decode_gemv as md
from mlx_qwen_fast.kernels import moe_grouped_gemm as gg
from mlx_qwen_fast.kernels import moe_routing as mr
from mlx_qwen_fast.moe_types import ExpertGroups
from mlx_qwen_fast.ops import moe


@pytest.mark.parametrize("bad", [[[0, 32]], [[-1, 3]], [[2**31 + 5, 1]]])
def test_group_rejects_ids_out_of_range(no_launch, bad):
    dtype = mx.uint32 if max(max(r) for r in bad) >= 2**31 else mx.int32
    with pytest.raises(ValueError, match=r"inds must lie in \[0, num_experts=32\)"):
        mr.group(mx.array(bad, dtype), 32, 32)


@pytest.mark.parametrize("tile_rows", [0, None, 2**17, 2.5])
def test_route_and_group_checks_tile_rows_before_routing(no_launch, tile_rows):
    with pytest.raises(ValueError, match="tile_rows"):
        mr.route_and_group(mx.zeros((4, 32)), 8, tile_rows)


def test_grouped_gemm_public_entry_points_check_the_routing(no_launch):
    d, i, e = 128, 64, 32
    x = moe_blocks.x_tokens(6, d, 1)
    gate, up, down = (moe_blocks.quant((e, i, d), 2), moe_blocks.quant((e, i, d), 3),
                      moe_blocks.quant((e, d, i), 4))
    r = moe_blocks.grouped_routing()
    bad = r._replace(groups=r.groups._replace(order=mx.full((12,), 10**6, mx.int32)))
    with pytest.raises(ValueError, match="gate_up_swiglu: routing is not a grouping"):
        gg.gate_up_swiglu(x, bad, gate, up, variant="mma")
    h = mx.zeros((12, i), mx.bfloat16)
    with pytest.raises(ValueError, match="down_weighted: routing is not a grouping"):
        gg.down_weighted(h, bad, down, variant="mma")


def test_decode_gemv_public_entry_points_check_ids(no_launch):
    experts, shared, eg = moe_blocks.make_arrays(E=32, D=256, I=128)
    x = moe_blocks.x_tokens(1, 256, 5)
    for inds in (mx.array([[0, 1, 2, 32]], mx.int32), mx.array([[0, 1, 2, -1]], mx.int32)):
        scores = mx.full(inds.shape, 0.25)
        with pytest.raises(ValueError, match=r"inds must lie in \[0, E=32\)"):
            md.moe_decode_arrays(x, inds, scores, experts, shared, eg)
        with pytest.raises(ValueError, match=r"inds must lie in \[0, E=32\)"):
            md.gate_up_swiglu(x, inds, experts, shared, eg)


@pytest.mark.parametrize("eps", [None, float("nan"), -1e-6, 0.0, float("inf"), 1.0, "x", True])
def test_check_eps(eps):
    with pytest.raises(ValueError, match="eps must be a finite float"):
        _checks.check_eps("f", "eps", eps)
    assert _checks.check_eps("f", "eps", 1e-6) == 1e-6


def test_expert_groups_of_another_size_are_rejected():
    g = moe.group_by_expert(mx.array([[0, 1]], mx.int32), 4)
    broken = ExpertGroups(g.counts, g.offsets[:-1], g.order, g.sorted_experts, g.inverse, 2)
    with pytest.raises(ValueError, match="disagree in size"):
        moe.block_map(broken, 4)


# ---------------------------------------------------------------------------
# the Gated DeltaNet wrappers: arguments that are not arrays, empty batches
# ---------------------------------------------------------------------------

_HK, _HV, _D = 1, 2, 128
_C = (2 * _HK + _HV) * _D
_HEADS = dict(num_k_heads=_HK, num_v_heads=_HV)


def _gdn_calls(B=1, T=3):
    """name -> (wrapper, its array arguments (valid ones), its other
    arguments), for B rows of T tokens (decode: one token)."""
    def z(*shape, dtype=mx.float32):
        return mx.zeros(shape, dtype)

    frontend = dict(qkv=z(B, T, _C), a=z(B, T, _HV), b=z(B, T, _HV), conv_weight=z(_C, 4, 1),
                    conv_state=z(B, 3, _C), A_log=z(_HV), dt_bias=z(_HV))
    return {
        "gated_delta_scan": (gds.gated_delta_scan, dict(
            q=z(B, T, _HK, _D), k=z(B, T, _HK, _D), v=z(B, T, _HV, _D), g=z(B, T, _HV), beta=z(B, T, _HV),
            state=z(B, _HV, _D, _D), mask=mx.ones((B, T), mx.bool_)), {}),
        "gated_delta_frontend": (gdf.gated_delta_frontend, frontend, _HEADS),
        "prepare": (gdf.prepare, dict(frontend), dict(Hk=_HK, Hv=_HV)),
        "gated_delta_decode": (gdd.gated_delta_decode, dict(
            proj=z(B, 1, gdc.packed_width(_HK, _HV)), params=z(gdc.params_width(_HK, _HV)),
            conv_state=z(B, 3, _C), state=z(B, _HV, _D, _D)), _HEADS),
        "decode_params": (gdc.decode_params, dict(conv_weight=z(_C, 4, 1), A_log=z(_HV), dt_bias=z(_HV),
                                                  norm_weight=z(_D)), {}),
        "gated_rms_norm": (grn.gated_rms_norm, dict(y=z(B, T, _HV, _D), z=z(B, T, _HV, _D), weight=z(_D)),
                           dict(eps=1e-6)),
    }


_OPTIONAL_ARGS = {"state", "mask", "conv_state"}
_GDN_CASES = [(fn, arg, bad) for fn, (_, arrays, _) in _gdn_calls().items() for arg in arrays
              for bad in NOT_ARRAYS if not (bad == "None" and arg in _OPTIONAL_ARGS)]


@pytest.mark.parametrize("fn, arg, bad", _GDN_CASES)
def test_gdn_wrappers_name_an_argument_that_is_not_an_array(no_launch, fn, arg, bad):
    """A list, a numpy array or None where an mx.array is required: a
    ValueError naming the argument, what it must be and what it got (not an
    AttributeError from inside), before anything CUDA-only."""
    wrapper, arrays, other = _gdn_calls()[fn]
    make, got = NOT_ARRAYS[bad]
    arrays[arg] = make(arrays[arg])
    with pytest.raises(ValueError, match=rf"\b{arg} must be an mx.array (\[|like).*, got {got}"):
        wrapper(**arrays, **other)


@pytest.mark.parametrize("fn", ["gated_delta_scan", "gated_delta_frontend", "gated_delta_decode", "gated_rms_norm"])
def test_gdn_wrappers_valid_arguments_reach_the_launch(no_launch, fn):
    """The arguments the two tests around this one start from are valid: they
    pass every check and reach the kernel's launch."""
    wrapper, arrays, other = _gdn_calls()[fn]
    with pytest.raises(AssertionError, match="launched"):
        wrapper(**arrays, **other)


@pytest.mark.parametrize("B, T", [(0, 3), (1, 0), (0, 0)])
def test_gdn_wrappers_return_empty_results_without_a_launch(no_launch, B, T):
    """No rows (B = 0) or no tokens (T = 0): empty results of the contract's
    shapes, the states handed back as they came, and no launch (an empty
    grid is a CUDA launch error)."""
    calls = _gdn_calls(B, T)
    wrapper, arrays, _ = calls["gated_delta_scan"]
    y, state = wrapper(**arrays)
    assert y.shape == (B, T, _HV, _D) and state is arrays["state"]
    wrapper, arrays, other = calls["gated_delta_frontend"]
    out = wrapper(**arrays, **other)
    assert [o.shape for o in out] == [(B, T, _HK, _D), (B, T, _HK, _D), (B, T, _HV, _D), (B, T, _HV), (B, T, _HV),
                                      (B, 3, _C)]
    assert [o.dtype for o in out[3:5]] == [mx.float32, mx.float32]
    assert mx.array_equal(out[5], arrays["conv_state"]).item()
    wrapper, arrays, _ = calls["gated_rms_norm"]
    assert wrapper(**arrays, eps=1e-6).shape == (B, T, _HV, _D)
    if B == 0:  # one token per row: only an empty batch is empty
        wrapper, arrays, other = calls["gated_delta_decode"]
        out, conv, state = wrapper(**arrays, **other)
        assert out.shape == (0, 1, _HV * _D) and conv.shape == (0, 3, _C) and state.shape == (0, _HV, _D, _D)
        out, conv, state = wrapper(arrays["proj"], arrays["params"], None, None, **other)
        assert conv.shape == (0, 3, _C) and state.shape == (0, _HV, _D, _D)


def test_gdn_supports_answer_false_for_non_arrays(monkeypatch):
    """``supports()`` (asked as if on CUDA) answers False, never an error,
    for a list or a numpy array in place of an mx.array."""
    monkeypatch.setattr(cb, "cuda_available", lambda: True)
    _, scan, _ = _gdn_calls()["gated_delta_scan"]
    _, fe, _ = _gdn_calls()["gated_delta_frontend"]
    qkv1 = mx.zeros((1, 1, _C))
    _, norm, _ = _gdn_calls()["gated_rms_norm"]
    asks = [
        (gds.supports, scan, {}),
        (lambda qkv, conv_state, conv_weight: gdf.supports(qkv, conv_state, conv_weight, **_HEADS),
         dict(qkv=fe["qkv"], conv_state=fe["conv_state"], conv_weight=fe["conv_weight"]), {}),
        (lambda qkv, state: gdd.supports(qkv, state, **_HEADS), dict(qkv=qkv1, state=scan["state"]), {}),
        (grn.supports, norm, {}),
    ]
    for fn, arrays, other in asks:
        assert fn(**arrays, **other) is True
        for arg in arrays:
            for bad in ("list", "numpy"):
                assert fn(**dict(arrays, **{arg: NOT_ARRAYS[bad][0](arrays[arg])}), **other) is False, (fn, arg, bad)
