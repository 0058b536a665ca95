"""Shared pytest fixtures (keep this file small)."""

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Path of the tiny random-weight checkpoint (seed 0), written once per session.

    Load it with ``mlx_lm.load(tiny_checkpoint)``; ``build_model("tiny", seed=0)``
    gives the same arrays in memory.
    """
    from mlx_qwen_fast.checkpoint import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("tiny_checkpoint"), "tiny", seed=0)


@pytest.fixture(scope="session")
def demo_checkpoint(tmp_path_factory):
    """Tiny checkpoint (seed 0) with ``lm_head_scale=DEMO_LM_HEAD_SCALE``: logits
    far from flat, so greedy tokens of two code paths can be compared."""
    from mlx_qwen_fast.checkpoint import DEMO_LM_HEAD_SCALE, write_checkpoint

    return write_checkpoint(
        tmp_path_factory.mktemp("demo_checkpoint"),
        "tiny",
        seed=0,
        lm_head_scale=DEMO_LM_HEAD_SCALE,
    )


@pytest.fixture
def poison():
    """Fill every CUDA kernel output with NaN before the launch (a row the
    kernel forgets to write then fails the ``finite`` checks)."""
    from mlx_qwen_fast.kernels import _cuda_build as cb

    cb.set_poison(True)
    yield
    cb.set_poison(False)
