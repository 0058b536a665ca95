"""The CUDA compiler (``kernels/_cuda_toolchain.py``): NVRTC where a libnvrtc
is installed (the test extra's ``nvidia-cuda-nvrtc``), else nvcc, else one
error saying what to install.

NVRTC builds for a named target without a GPU, so these run on the CPU
(skipped where no libnvrtc loads).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mlx_qwen_fast.kernels import _cuda_toolchain

ELF_MAGIC = b"\x7fELF"
SOURCE = '#include "half.cuh"\nextern "C" __global__ void KNAME(float* y) { y[threadIdx.x] = HALF; }\n'


def _nvrtc():
    nv = _cuda_toolchain.get_nvrtc()
    if nv is None:
        pytest.skip("no libnvrtc (the test extra's nvidia-cuda-nvrtc) installed")
    return nv


def test_nvrtc_builds_with_in_memory_headers():
    """A source that includes a header handed over in memory builds to a
    cubin for sm_90a; the compiler is named with NVRTC's version."""
    nv = _nvrtc()
    name = "mqf_toolchain_test"
    cubin = _cuda_toolchain.compile_cubin(SOURCE, name, {"half.cuh": "#define HALF 0.5f\n"},
                                          ["--gpu-architecture=sm_90a", f"-DKNAME={name}"],
                                          Path("unused.cu"), "sm_90a")
    assert cubin[:4] == ELF_MAGIC
    assert _cuda_toolchain.compiler_id() == f"nvrtc-{nv.version[0]}.{nv.version[1]}"


def test_nvrtc_failure_carries_its_log():
    """A source NVRTC rejects raises RuntimeError naming the kernel, with
    NVRTC's log (here: the missing header)."""
    _nvrtc()
    with pytest.raises(RuntimeError, match=r"NVRTC failed to compile mqf_broken(.|\n)*half\.cuh"):
        _cuda_toolchain.compile_cubin(SOURCE, "mqf_broken", {}, ["--gpu-architecture=sm_90a", "-DKNAME=k"],
                                      Path("unused.cu"), "sm_90a")


def test_no_compiler_is_one_error_saying_what_to_install(monkeypatch):
    """Neither NVRTC nor nvcc: the build fails naming both and the switch
    that chooses a libnvrtc; the compiler id is "none"."""
    monkeypatch.setattr(_cuda_toolchain, "get_nvrtc", lambda: None)
    monkeypatch.setattr(_cuda_toolchain.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="No CUDA compiler found: need libnvrtc .* or nvcc on PATH; "
                                           "set MLX_QWEN_FAST_NVRTC"):
        _cuda_toolchain.compile_cubin(SOURCE, "k", {}, [], Path("unused.cu"), "sm_90a")
    assert _cuda_toolchain.compiler_id() == "none"
