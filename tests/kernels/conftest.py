"""Fixtures of the kernel wrappers' tests."""

from __future__ import annotations

import pytest

from mlx_qwen_fast.kernels import _cuda_build as cb


@pytest.fixture
def no_launch(monkeypatch):
    """Any kernel launch fails loudly, so a check that lets bad input through
    is seen; nothing is compiled, and grids are sized for 132 SMs, with or
    without a GPU."""
    def launch(self, *args, **kwargs):
        raise AssertionError(f"launched {self.base_name} with bad input")

    monkeypatch.setattr(cb.CudaKernel, "__call__", launch)
    monkeypatch.setattr(cb.CudaKernel, "image", property(lambda self: b""))
    monkeypatch.setattr(cb, "sm_count", lambda: 132)
