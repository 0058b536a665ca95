"""The kernel build path (``kernels/_cuda_build.py``): its switches and the
disk cache of cubins. The launched image: ``test_cuda_fatbin.py``.

The CPU tests check the switches with stand-ins; the ``cuda`` one builds a
real kernel.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_qwen_fast import config
from mlx_qwen_fast.kernels import _cuda_build as cb

HK, HV = 16, 32


def test_cache_dir_follows_the_switch(env, tmp_path):
    """The cubin cache: MLX_QWEN_FAST_CACHE where set, else
    $XDG_CACHE_HOME/mlx_qwen_fast."""
    env.set(config.KERNEL_CACHE.name, str(tmp_path / "kernels"))
    assert cb.cache_dir() == tmp_path / "kernels"
    env.unset(config.KERNEL_CACHE.name)
    env.set("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cb.cache_dir() == tmp_path / "xdg" / "mlx_qwen_fast"


@pytest.mark.parametrize("arch", ["sm_90a", "sm_89", "sm_100"])
def test_arch_switch_builds_without_asking_the_driver(env, monkeypatch, arch):
    """MLX_QWEN_FAST_ARCH names the build target; the driver is not asked."""

    def no_driver():
        raise AssertionError("the driver must not be asked")

    monkeypatch.setattr(cb, "gpu_arch", no_driver)
    env.set(config.ARCH.name, arch)
    assert cb._arch_option() == arch


@pytest.mark.cuda
def test_disk_cache_is_reused(env, monkeypatch, tmp_path):
    """A second process (here: the in-memory caches cleared) loads the cubin
    from the disk cache instead of compiling, byte for byte the same."""
    from mlx_qwen_fast.kernels import gated_delta_decode as kd

    env.set(config.KERNEL_CACHE.name, str(tmp_path))
    cfg = dict(kd._kernel(mx.bfloat16, HV, HK).defines, MQF_TEST_CACHE=1)  # an extra macro: a fresh name
    first = cb.CudaKernel("gated_delta_decode.cu", "mqf_gdn_decode", cfg)
    data = first.cubin
    assert cb.build_stats[first.name]["source"] == "compiled"
    assert len(list(tmp_path.glob(f"{first.name}-*.cubin"))) == 1
    monkeypatch.delitem(cb._cubins, first.name)
    monkeypatch.delitem(cb._images, first.name, raising=False)
    second = cb.CudaKernel("gated_delta_decode.cu", "mqf_gdn_decode", cfg)
    assert second.name == first.name and second.cubin == data
    assert cb.build_stats[second.name]["source"] == "cache"
