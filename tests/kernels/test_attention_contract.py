"""The gated attention decode kernels' shared argument contract
(``kernels/attention_contract.py``): the projection's width and one step's
checks, on the CPU with fresh random arrays; bad input raises ValueError
with the caller's name first and the argument named."""

import mlx.core as mx
import pytest

from mlx_qwen_fast.kernels import attention_contract as ac

DH = ac.DH


def _step(B, hq, hkv, cap, dtype, seed, wdtype=None):
    """Valid arguments of one step, as a dict of check_step's keywords."""
    ks = mx.random.split(mx.random.key(seed), 6)
    wdtype = wdtype or dtype
    return dict(
        proj=mx.random.normal((B, 1, ac.proj_width(hq, hkv)), key=ks[0]).astype(dtype),
        keys=mx.random.normal((B, hkv, cap, DH), key=ks[1]).astype(dtype),
        values=mx.random.normal((B, hkv, cap, DH), key=ks[2]).astype(dtype),
        offset=mx.random.randint(0, cap, (), key=ks[3]).astype(mx.int32),
        q_norm_weight=(1.0 + 0.1 * mx.random.normal((DH,), key=ks[4])).astype(wdtype),
        k_norm_weight=(1.0 + 0.1 * mx.random.normal((DH,), key=ks[5])).astype(wdtype),
        hq=hq, hkv=hkv, scale=DH ** -0.5, q_eps=1e-6, k_eps=2e-6, rope_dims=64, rope_base=1e7, rope_scale=1.0,
    )


def _check(args, max_group=16):
    return ac.check_step("f", **args, max_group=max_group)


def test_proj_width_is_query_gate_keys_values():
    assert ac.proj_width(16, 2) == 16 * 2 * 256 + 2 * 2 * 256
    assert ac.proj_width(1, 1) == 4 * DH


@pytest.mark.parametrize("B, hq, hkv, cap, dtype, wdtype", [
    (1, 16, 2, 8, mx.bfloat16, None), (3, 4, 4, 1, mx.float32, mx.bfloat16), (0, 8, 1, 5, mx.float16, None)])
def test_check_step_passes_valid_steps(B, hq, hkv, cap, dtype, wdtype):
    eps = _check(_step(B, hq, hkv, cap, dtype, seed=B + hq + cap, wdtype=wdtype))
    assert eps == (1e-6, 2e-6) and all(type(e) is float for e in eps)


def test_check_step_takes_the_callers_group_limit():
    args = _step(1, 16, 2, 4, mx.bfloat16, seed=1)
    assert _check(args, max_group=8) == (1e-6, 2e-6)
    with pytest.raises(ValueError, match=r"^f: num_heads \(16\) must be a multiple of num_kv_heads \(2\), "
                                         r"at most 4 query heads per KV head$"):
        _check(args, max_group=4)


def _bad_steps():
    """(what to change, the argument named) of steps outside the contract."""
    def f(**change):
        return change
    a = _step(2, 8, 2, 6, mx.float32, seed=0)
    return [
        (f(proj=a["proj"][..., 1:]), "proj"), (f(proj=a["proj"].reshape(2, -1)), "proj"),
        (f(proj=a["proj"].astype(mx.int32)), "proj"), (f(proj=[1.0]), "proj"),
        (f(keys=a["keys"][..., :128]), "keys"), (f(keys=a["keys"].astype(mx.bfloat16)), "keys"),
        (f(keys=a["keys"][:, :, :0]), "keys"), (f(keys=a["keys"][:1]), "keys"),
        (f(values=a["values"][:, :, :4]), "values"), (f(values=None), "values"),
        (f(offset=mx.array([3], mx.int32)), "offset"), (f(offset=mx.array(3.0)), "offset"), (f(offset=3), "offset"),
        (f(q_norm_weight=a["q_norm_weight"][:64]), "q_norm_weight"),
        (f(q_norm_weight=a["q_norm_weight"].astype(mx.int32)), "q_norm_weight"),
        (f(k_norm_weight=a["k_norm_weight"].reshape(1, DH)), "k_norm_weight"),
        (f(k_norm_weight=a["k_norm_weight"].astype(mx.bfloat16)), "q_norm_weight"),  # "... and k_norm_weight"
        (f(hkv=3), "num_heads"), (f(hkv=0), "num_heads"), (f(hq=8.0), "num_heads"),
        (f(q_eps=0.0), "q_eps"), (f(k_eps=float("nan")), "k_eps"),
        (f(rope_dims=63), "rope_dims"), (f(rope_dims=512), "rope_dims"), (f(rope_dims=64.0), "rope_dims"),
        (f(scale=-1.0), "scale"), (f(rope_base=float("inf")), "rope_base"), (f(rope_scale=0), "rope_scale"),
    ]


@pytest.mark.parametrize("change, name", _bad_steps())
def test_check_step_names_the_argument(change, name):
    args = {**_step(2, 8, 2, 6, mx.float32, seed=0), **change}
    with pytest.raises(ValueError) as err:
        _check(args)
    message = str(err.value)
    assert message.startswith(f"f: {name} ") and "\n" not in message, message
