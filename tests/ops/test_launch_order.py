"""ops._launch_order: the offer of an ordering input to the first
grid-barrier launch of a trace."""

import mlx.core as mx
import pytest

from mlx_qwen_fast.ops import _launch_order as lo


def test_first_take_gets_the_offer_then_none():
    a = mx.array([1.0])
    assert lo.take() is None  # nothing offered
    with lo.first_launch_after(a):
        assert lo.take() is a
        assert lo.take() is None
    assert lo.take() is None


def test_nested_offers_and_the_end_of_a_block():
    a, b = mx.array([1.0]), mx.array([2.0])
    with lo.first_launch_after(a):
        with lo.first_launch_after(b):
            assert lo.take() is b
        assert lo.take() is a  # the outer offer is still there: the inner launch took its own
    with pytest.raises(RuntimeError):
        with lo.first_launch_after(a):
            raise RuntimeError("a failing trace")
    assert lo.take() is None  # the offer ended with the failing block


def test_offer_reaches_a_nested_compiled_function():
    """Inside an ``mx.compile``d function, a compiled function it calls is
    traced inline: the offer made in the outer trace reaches it, and each
    call binds its own array (no constant captured)."""
    @mx.compile
    def inner(x):
        t = lo.take()
        return x if t is None else x + t

    def outer(x, t):
        with lo.first_launch_after(t):
            return inner(x)

    fn = mx.compile(outer)
    one = mx.array([1.0])
    assert fn(one, mx.array([2.0])).item() == 3.0
    assert fn(one, mx.array([5.0])).item() == 6.0
    assert inner(one).item() == 1.0
