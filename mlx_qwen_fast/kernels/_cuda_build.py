"""Build CUDA kernels once per machine and launch them through MLX.

The one place where the package turns CUDA source (``mlx_qwen_fast/cuda/*.cu``)
into machine code: :class:`CudaKernel`, one build of one source file, is
what every CUDA kernel wrapper holds and calls.

1. The source file is read and compiled with NVRTC (the ``libnvrtc`` that MLX's
   CUDA backend itself loaded, else one found on disk; ``nvcc`` as a last
   resort: :mod:`~mlx_qwen_fast.kernels._cuda_toolchain`) for the GPU's
   exact architecture (``sm_90a`` on Hopper), with the kernel's
   configuration passed as ``-D`` macros.
2. The cubin is cached on disk under ``$MLX_QWEN_FAST_CACHE`` or
   ``$XDG_CACHE_HOME/mlx_qwen_fast`` (default ``~/.cache/mlx_qwen_fast``),
   keyed by a hash of the source and headers, the options, the GPU
   architecture, the compiler version and the MLX version.  A second process
   (or a second run of the same program) loads the cubin instead of compiling.
3. The cubin is wrapped in a compressed fatbin with NVIDIA's nvFatbin
   library where one is found, which makes the binary MLX hashes on every
   launch several times smaller; without it, or if it fails, the plain cubin
   is used (same kernel, same results):
   :mod:`~mlx_qwen_fast.kernels._cuda_fatbin`.
4. Launches go through ``mx.fast.precompiled_cuda_kernel``: the kernel is an
   ``extern "C" __global__`` function whose parameters are the input arrays,
   the output arrays, then int/float scalars (MLX's calling convention for
   precompiled kernels).  Float scalars are rounded to fp32 here (MLX rejects
   a Python float that is not exactly an fp32 value).

A first use compiles each kernel in well under a second (the sources include
no headers but the package's own); a process that finds the cubins cached
only loads them.  MLX's own ``mx.fast.cuda_kernel`` compiles in every
process.  Figures: bench/results/package-figures.md, "Kernel builds".

Kernel names: every distinct build (source + options) gets its own name,
``<base>_<hash>``, passed to the source as the ``KNAME`` macro.  MLX keeps a
loaded module for the life of the process under the kernel's name and a hash
of the binary (mlx/backend/cuda/custom_kernel.cpp), so a cubin and its fatbin
are two modules.

Sources must be self-contained: NVRTC runs with no include path (the mlx-cuda
wheel ships no CUDA headers), so kernels include only this package's own
``*.cuh`` files from ``mlx_qwen_fast/cuda/``, which are handed to NVRTC as
in-memory headers.

Also here: the device queries the wrappers size their launches by
(:func:`cuda_available`, :func:`gpu_arch`, :func:`sm_count`) and
:func:`dtype_macro`. The wrappers' argument checks are in
:mod:`~mlx_qwen_fast.kernels._checks`.

Switches (:mod:`mlx_qwen_fast.config`): ``KERNEL_CACHE`` (cache folder),
``NVRTC`` (the libnvrtc to use), ``NVFATBIN`` (the libnvfatbin, or off),
``ARCH`` (build target instead of asking the driver), ``POISON`` (fill
kernel outputs with NaN before each launch).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import config
from . import _cuda_fatbin, _cuda_toolchain

__all__ = [
    "CUDA_SOURCE_DIR",
    "CudaKernel",
    "build_stats",
    "cache_dir",
    "cuda_available",
    "dtype_macro",
    "gpu_arch",
    "poisoning",
    "sm_count",
    "set_poison",
]

CUDA_SOURCE_DIR = Path(__file__).resolve().parent.parent / "cuda"

_lock = threading.Lock()
_poison: Optional[bool] = None  # set_poison's override of config.POISON

#: Per-kernel build records: name -> dict(seconds, source="compiled"|"cache").
build_stats: Dict[str, dict] = {}


def set_poison(on: Optional[bool]) -> None:
    """Fill every output with NaN before each launch (tests only: costs a
    pass); None goes back to :data:`mlx_qwen_fast.config.POISON`."""
    global _poison
    _poison = None if on is None else bool(on)


def poisoning() -> bool:
    """Whether launches fill their outputs with NaN first (:func:`set_poison`,
    else :data:`mlx_qwen_fast.config.POISON`)."""
    return config.POISON.get() if _poison is None else _poison


def cuda_available() -> bool:
    """True when MLX's default device is a CUDA GPU."""
    try:
        import mlx.core as mx
    except ImportError:
        return False
    cuda = getattr(mx, "cuda", None)
    if cuda is None or not cuda.is_available():
        return False
    return mx.default_device() == mx.gpu


def cache_dir() -> Path:
    """Directory of the cubin cache (created on first write;
    :func:`mlx_qwen_fast.config.kernel_cache_dir`)."""
    return config.kernel_cache_dir()


# ---------------------------------------------------------------------------
# GPU architecture (CUDA driver API through ctypes)
# ---------------------------------------------------------------------------

_arch: Optional[Tuple[int, int]] = None
_sms: Optional[int] = None


def gpu_arch() -> Tuple[int, int]:
    """(major, minor) compute capability of CUDA device 0 (MLX's GPU).

    Raises:
      RuntimeError: no usable CUDA driver or device.
    """
    global _arch, _sms
    if _arch is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise RuntimeError(f"no CUDA driver (libcuda.so.1): the CUDA kernels need an NVIDIA GPU ({exc})") from exc
        if lib.cuInit(0) != 0:
            raise RuntimeError("cuInit failed: no usable CUDA driver")
        dev = ctypes.c_int()
        if lib.cuDeviceGet(ctypes.byref(dev), 0) != 0:
            raise RuntimeError("cuDeviceGet(0) failed")
        major, minor = ctypes.c_int(), ctypes.c_int()
        # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR
        lib.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)
        lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)
        sms = ctypes.c_int()
        lib.cuDeviceGetAttribute(ctypes.byref(sms), 16, dev)  # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
        _arch, _sms = (major.value, minor.value), sms.value
    return _arch


def sm_count() -> int:
    """Number of SMs of CUDA device 0 (e.g. 132 on an H200).

    Raises:
      RuntimeError: as :func:`gpu_arch`.
    """
    gpu_arch()
    return _sms


def _arch_option() -> str:
    forced = config.ARCH.get()
    if forced:  # e.g. "sm_90a": build without a GPU (cache warming, CI)
        return forced
    major, minor = gpu_arch()
    # sm_90a: the arch-specific Hopper target (wgmma, setmaxnreg); plain sm_XY
    # elsewhere.
    suffix = "a" if (major, minor) == (9, 0) else ""
    return f"sm_{major}{minor}{suffix}"


# ---------------------------------------------------------------------------
# sources, cache, kernels
# ---------------------------------------------------------------------------


def _read_sources(filename: str) -> Tuple[str, Dict[str, str]]:
    src = (CUDA_SOURCE_DIR / filename).read_text()
    headers = {p.name: p.read_text() for p in sorted(CUDA_SOURCE_DIR.glob("*.cuh"))}
    return src, headers


def _mlx_version() -> str:
    try:
        import mlx.core as mx

        return mx.__version__
    except Exception:
        return "?"


_cubins: Dict[str, bytes] = {}
_images: Dict[str, bytes] = {}


@dataclass
class CudaKernel:
    """One compiled configuration of one kernel source file.

    Args:
      filename: source file in ``mlx_qwen_fast/cuda/`` (e.g. "gated_delta_scan.cu").
      base_name: stem of the kernel's symbol; the built kernel is
        ``<base_name>_<hash>`` (the source receives it as ``KNAME``).
      defines: configuration macros, ``{"GDN_HV": 32, ...}``.
    """

    filename: str
    base_name: str
    defines: Dict[str, object] = field(default_factory=dict)

    def __post_init__(self):
        self._src, self._headers = _read_sources(self.filename)
        defs = [f"-D{k}={v}" for k, v in sorted(self.defines.items())]
        self._base_opts = ["-std=c++17"] + defs
        h = hashlib.sha256()
        h.update(self._src.encode())
        for n, t in sorted(self._headers.items()):
            h.update(n.encode() + t.encode())
        h.update(" ".join(self._base_opts).encode())
        self.name = f"{self.base_name}_{h.hexdigest()[:12]}"
        self._cubin: Optional[bytes] = None
        self._image: Optional[bytes] = None

    def _cache_key(self, arch: str, comp: str) -> str:
        h = hashlib.sha256()
        for part in (self.name, self._src, arch, comp, _mlx_version(), " ".join(self._base_opts)):
            h.update(part.encode())
            h.update(b"\0")
        for n, t in sorted(self._headers.items()):
            h.update(n.encode() + b"\0" + t.encode())
        return h.hexdigest()[:32]

    @property
    def cubin(self) -> bytes:
        """The compiled kernel, from memory, the disk cache, or a fresh build."""
        if self._cubin is not None:
            return self._cubin
        with _lock:
            if self.name in _cubins:
                self._cubin = _cubins[self.name]
                return self._cubin
            t0 = time.perf_counter()
            arch = _arch_option()
            comp = _cuda_toolchain.compiler_id()
            key = self._cache_key(arch, comp)
            path = cache_dir() / f"{self.name}-{arch}-{key}.cubin"
            data = None
            if path.is_file():
                try:
                    data = path.read_bytes()
                    origin = "cache"
                except OSError:
                    data = None
            if data is None:
                data = self._compile(arch)
                origin = "compiled"
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
                    with os.fdopen(fd, "wb") as f:
                        f.write(data)
                    os.replace(tmp, path)
                except OSError:
                    pass  # a read-only cache only costs the next process a compile
            build_stats[self.name] = {
                "seconds": time.perf_counter() - t0,
                "source": origin,
                "compiler": comp,
                "arch": arch,
            }
            _cubins[self.name] = data
            self._cubin = data
            return data

    @property
    def image(self) -> bytes:
        """What MLX launches: the cubin in a compressed fatbin when nvFatbin
        is available (:func:`~mlx_qwen_fast.kernels._cuda_fatbin.launch_image`),
        else the cubin itself."""
        if self._image is not None:
            return self._image
        cubin = self.cubin
        with _lock:
            if self.name in _images:
                self._image = _images[self.name]
                return self._image
            image, record = _cuda_fatbin.launch_image(self.name, cubin, build_stats[self.name]["arch"])
            build_stats[self.name].update(record)
            _images[self.name] = self._image = image
            return image

    def _compile(self, arch: str) -> bytes:
        opts = [f"--gpu-architecture={arch}", f"-DKNAME={self.name}"] + self._base_opts
        return _cuda_toolchain.compile_cubin(self._src, self.name, self._headers, opts,
                                             CUDA_SOURCE_DIR / self.filename, arch)

    def __call__(
        self,
        inputs: Sequence,
        output_shapes: Sequence[Tuple[int, ...]],
        output_dtypes: Sequence,
        grid: Tuple[int, int, int],
        threadgroup: Tuple[int, int, int],
        scalars: Sequence = (),
        shared_memory: int = 0,
    ) -> List:
        """Launch; ``grid`` counts threads (MLX's convention), not blocks.

        ``scalars``: Python ints (int32 parameters) and floats (fp32
        parameters, rounded here to the nearest fp32 value). Outputs start
        uninitialised, or NaN while :func:`poisoning`.
        """
        import mlx.core as mx

        image = self._image if self._image is not None else self.image
        return mx.fast.precompiled_cuda_kernel(
            name=self.name,
            compiled_source=image,
            inputs=inputs,
            output_shapes=output_shapes,
            output_dtypes=output_dtypes,
            scalars=[s if type(s) is int else _f32(s) for s in scalars],
            grid=grid,
            threadgroup=threadgroup,
            shared_memory=shared_memory,
            init_value=_NAN if poisoning() else None,
            ensure_row_contiguous=True,
        )


_NAN = float("nan")


@functools.lru_cache(maxsize=256)
def _f32(x: float) -> float:
    """Nearest fp32 value of x, as a Python float (MLX rejects others)."""
    return float(np.float32(x))


def dtype_macro(dtype) -> str:
    """C type of an MLX float dtype in the kernel sources (gdn_common.cuh)."""
    import mlx.core as mx

    table = {mx.bfloat16: "bf16_t", mx.float16: "f16_t", mx.float32: "float"}
    if dtype not in table:
        raise ValueError(f"unsupported dtype {dtype}: expected bfloat16, float16 or float32")
    return table[dtype]
