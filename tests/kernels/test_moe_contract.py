"""The MoE kernels' shared argument contract (``kernels/moe_contract.py``):
the 4-bit group-64 predicate, the shared-expert gate's bits, the decode
weights' check, the expert-id check and the grouped routing's checks, on
the CPU with fresh random arrays; bad input answers False / 0 / a message
naming the argument, or raises ValueError naming it."""

import mlx.core as mx
import numpy as np
import pytest

import moe_blocks
from mlx_qwen_fast.kernels import moe_contract as mc
from mlx_qwen_fast.kernels import moe_decode_gemv as md
from mlx_qwen_fast.kernels import moe_down_metal as mdm
from mlx_qwen_fast.kernels import moe_gate_up_metal as mgm


def _quantized(shape, seed, dtype=mx.bfloat16, bits=4):
    """(weight, scales, biases) of a fresh random ``shape`` matrix in ``dtype``, group 64."""
    w = mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)
    return tuple(mx.quantize(w, group_size=64, bits=bits))


def test_the_decode_kernels_share_the_token_limit():
    assert md.MAX_TOKENS == mgm.MAX_TOKENS == mdm.MAX_TOKENS == mc.DECODE_MAX_TOKENS


@pytest.mark.parametrize("lead, O, K", [((5,), 32, 128), ((), 64, 192), ((2,), 8, 64)])
def test_is_4bit_group64_takes_quantized_arrays(lead, O, K):
    q = _quantized((*lead, O, K), seed=len(lead) * 100 + O + K)
    assert mc.is_4bit_group64(q, lead, O, K)
    assert not mc.is_4bit_group64(q, lead, O + 1, K)
    assert not mc.is_4bit_group64(q, lead, O, K + 64)
    assert not mc.is_4bit_group64(q, (*lead, 1), O, K)
    q32 = _quantized((*lead, O, K), seed=7, dtype=mx.float32)
    assert not mc.is_4bit_group64(q32, lead, O, K)  # float32 scales: not the default's
    assert mc.is_4bit_group64(q32, lead, O, K, scale_dtypes=(mx.float32, mx.bfloat16))


def test_is_4bit_group64_answers_false_for_anything_else():
    w, s, b = _quantized((4, 32, 128), seed=3)
    as_numpy = tuple(np.array(a.astype(mx.float32)) for a in (w, s, b))
    for q in [(w, s), (w, s, b, b), None, 3, (w.astype(mx.int32), s, b), (w, s[..., :1], b), (w, s, b[:2]),
              (w, s.astype(mx.float16), b), as_numpy, (w, None, b), _quantized((4, 32, 128), seed=4, bits=8)]:
        assert mc.is_4bit_group64(q, (4,), 32, 128) is False


@pytest.mark.parametrize("bits", [4, 8])
def test_shared_gate_bits_of_a_quantized_gate(bits):
    D = 256
    w, s, b = _quantized((1, D), seed=bits, bits=bits)
    assert mc.shared_gate_bits((w, s, b, bits), D) == bits
    assert mc.shared_gate_bits((w, s, b, 12 - bits), D) == 0  # the other width's shape
    assert mc.shared_gate_bits((w, s, b, bits), D + 64) == 0
    assert mc.shared_gate_bits((w, s.astype(mx.float32), b, bits), D) == 0
    assert mc.shared_gate_bits((w, s, b[:, :1], bits), D) == 0


def test_shared_gate_bits_of_a_plain_gate_and_of_bad_input():
    D = 128
    w = mx.random.normal((1, D), key=mx.random.key(11)).astype(mx.bfloat16)
    assert mc.shared_gate_bits((w, w, w, 16), D) == 16
    assert mc.shared_gate_bits((w.astype(mx.float32), w, w, 16), D) == 0
    assert mc.shared_gate_bits((w, w, w, 16), 2 * D) == 0
    for bad in [None, (w, w, w), (w, w, w, 3), "gate", (None, None, None, 4), (w, None, None, 16), (w, 1, "a", 16),
                (w, w, w, True)]:
        assert mc.shared_gate_bits(bad, D) == 0


def test_decode_weights_problem_takes_the_decode_arrays():
    for gate_bits in (4, 8, 16):
        experts, shared, eg = moe_blocks.make_arrays(E=8, D=128, I=64, seed=gate_bits, gate_bits=gate_bits)
        assert mc.decode_weights_problem(experts, shared, eg, 128) is None


def test_decode_weights_problem_names_the_argument():
    D, I, E = 128, 64, 8
    experts, shared, eg = moe_blocks.make_arrays(E=E, D=D, I=I, seed=21)
    gate, up, down = experts
    wrong_up = _quantized((E, I, 2 * D), seed=22)
    cases = [
        (((gate, up), shared, eg), "experts must be (gate, up, down)"),
        ((None, shared, eg), "experts must be (gate, up, down)"),
        (((gate, wrong_up, down), shared, eg), "experts gate/up must be 4-bit group-64"),
        (((gate, up, _quantized((E, D, 2 * I), seed=23)), shared, eg), "experts down must be 4-bit group-64"),
        ((experts, shared[:2], eg), "shared must be (gate, up, down)"),
        ((experts, (shared[0], shared[1], _quantized((D, 2 * I), seed=24)), eg), "shared expert must be 4-bit"),
        ((experts, shared, (*eg[:3], 16)), "expert_gate must be (weight, scales, biases, bits)"),
        (({0: gate}, shared, eg), "experts must be (gate, up, down)"),
        ((((gate[0][:, :0], gate[1][:, :0], gate[2][:, :0]), up, down), shared, eg),
         "experts must hold at least one expert"),
    ]
    for args, want in cases:
        problem = mc.decode_weights_problem(*args, D)
        assert problem is not None and problem.startswith(want), (want, problem)
    assert mc.decode_weights_problem(experts, shared, eg, 2 * D).startswith("experts gate/up")


@pytest.mark.parametrize("dtype", [mx.int32, mx.uint32])
def test_check_expert_ids_passes_ids_in_range(dtype):
    E = 64
    inds = mx.random.randint(0, E, (4, 8), key=mx.random.key(31)).astype(dtype)
    mc.check_expert_ids("f", inds, E)
    mc.check_expert_ids("f", mx.array([[0, E - 1]], dtype), E)
    mc.check_expert_ids("f", mx.zeros((0, 8), dtype), E)  # nothing to read


@pytest.mark.parametrize("bad, lo, hi", [([[0, 64]], 0, 64), ([[-1, 3]], -1, 3), ([[2**31 + 5, 1]], 1, 2**31 + 5)])
def test_check_expert_ids_names_inds(bad, lo, hi):
    dtype = mx.uint32 if hi >= 2**31 else mx.int32
    with pytest.raises(ValueError, match=rf"^f: inds must lie in \[0, E=64\), got values in \[{lo}, {hi}\]$"):
        mc.check_expert_ids("f", mx.array(bad, dtype), 64)


@pytest.mark.parametrize("n, k, e, tile", [(6, 2, 32, 32), (17, 8, 64, 16), (1, 1, 4, 64)])
def test_check_routing_arrays_and_values_pass_a_routing_of_the_reference_ops(n, k, e, tile):
    r = moe_blocks.grouped_routing(n, k, e, tile, seed=n + k)
    mc.check_routing_arrays("f", r, n * k, (16, 32, 64))
    mc.check_routing_values("f", r, n * k)


def test_check_routing_arrays_names_the_field():
    r = moe_blocks.grouped_routing()
    g = r.groups
    cases = [
        (r, (16,), "routing.tile_rows must be one of (16,), got 32"),
        (r._replace(groups=g._replace(order=g.order[1:])), (32,), "routing.groups.order must be int32 [12]"),
        (r._replace(groups=g._replace(order=g.order.astype(mx.uint32))), (32,), "routing.groups.order"),
        (r._replace(block_map=r.block_map[1:]), (32,), "routing.block_map must be int32"),
        (r._replace(block_map=r.block_map.astype(mx.int64)), (32,), "routing.block_map"),
        (r._replace(groups=g._replace(offsets=g.offsets[:-1])), (32,), "routing.groups.offsets must be int32 [33]"),
    ]
    for routing, tiles, want in cases:
        with pytest.raises(ValueError) as err:
            mc.check_routing_arrays("f", routing, 12, tiles)
        assert str(err.value).startswith(f"f: {want}"), str(err.value)


@pytest.mark.parametrize("damage", ["order_high", "order_negative", "offsets", "expert", "tile_overflow",
                                    "tile_past_the_end", "unused_half"])
def test_check_routing_values_rejects_a_damaged_routing(damage):
    r = moe_blocks.grouped_routing()
    g, bm = r.groups, np.array(r.block_map)
    if damage == "order_high":
        g = g._replace(order=mx.full(g.order.shape, 10**6, mx.int32))
    elif damage == "order_negative":
        g = g._replace(order=g.order - 1)
    elif damage == "offsets":
        g = g._replace(offsets=g.offsets * 2)
    elif damage == "expert":
        bm[0, 0] = 40
    elif damage == "tile_overflow":  # offsets[e] + t * tile wraps in int32
        bm[0, 1] = 3 * 2**25
    elif damage == "tile_past_the_end":
        bm[0, 1] = 5
    else:
        bm[-1, 0] = -1
        bm[-1, 1] = 0
    bad = r._replace(groups=g, block_map=mx.array(bm))
    with pytest.raises(ValueError, match="^t: routing is not a grouping of 12 assignments over 32 experts"):
        mc.check_routing_values("t", bad, 12)


@pytest.mark.parametrize("E, D, I", [(3, 64, 128), (5, 192, 64)])
def test_check_down_weights_gives_the_sizes(E, D, I):
    down = _quantized((E, D, I), seed=E + D + I)
    assert mc.check_down_weights("f", down, I) == (E, D)
    f32 = tuple(a.astype(mx.float32) if a.dtype != mx.uint32 else a for a in down)
    assert mc.check_down_weights("f", f32, I, (mx.float32, mx.bfloat16)) == (E, D)
    with pytest.raises(ValueError, match=r"f: down must be 4-bit group-64 uint32 \[E, D, .*bf16 scales"):
        mc.check_down_weights("f", f32, I)  # float32 scales where bf16 is the contract
    with pytest.raises(ValueError, match="f: down must be 4-bit group-64"):
        mc.check_down_weights("f", down, 2 * I)  # another I
    with pytest.raises(ValueError, match=r"f: down must be \(weight, scales, biases\)"):
        mc.check_down_weights("f", None, I)
    odd = _quantized((E, 32, I), seed=1)  # D not a multiple of 64
    with pytest.raises(ValueError, match="D a positive multiple of 64"):
        mc.check_down_weights("f", odd, I)
