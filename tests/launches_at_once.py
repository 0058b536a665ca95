"""The check of launches at once shared by the one-launch kernels' tests."""

from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx


def check_launches_at_once(calls: Sequence[Callable[[], tuple]], rounds: int = 8) -> None:
    """``calls``: launches (each returns a tuple of outputs) that share no
    buffer. Each is evaluated alone, then all of them in one ``mx.eval`` for
    ``rounds`` rounds (MLX may run them at the same time; each takes a
    barrier slot of its own, grid_sync.cuh); AssertionError naming the round
    and the launch where an output differs in any bit. Grids of 3 blocks fit
    beside each other on the GPU, so launches at once overlap there; grids
    of every SM run one after another as the GPU dispatches them. (GPU only:
    the CUDA check runs launches one at a time; test_cuda_check.py's
    grid_slots tests run the slots' protocol with launches at once.)"""
    want = []
    for call in calls:
        got = call()
        mx.eval(got)
        want.append(got)
    for r in range(rounds):
        outs = [call() for call in calls]
        mx.eval(outs)
        for i, (got, w) in enumerate(zip(outs, want)):
            assert all(mx.array_equal(g, v).item() for g, v in zip(got, w)), f"round {r}, launch {i}"
