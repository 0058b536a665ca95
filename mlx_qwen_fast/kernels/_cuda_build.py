"""Build CUDA kernels once per machine and launch them through MLX.

The one place where the package turns CUDA source (``mlx_qwen_fast/cuda/*.cu``)
into machine code.  Every CUDA kernel of the package is built here:

1. The source file is read and compiled with NVRTC (the ``libnvrtc`` that MLX's
   CUDA backend itself loaded, else one found on disk; ``nvcc`` as a last
   resort) for the GPU's exact architecture (``sm_90a`` on Hopper), with the
   kernel's configuration passed as ``-D`` macros.
2. The cubin is cached on disk under ``$MLX_QWEN_FAST_CACHE`` or
   ``$XDG_CACHE_HOME/mlx_qwen_fast`` (default ``~/.cache/mlx_qwen_fast``),
   keyed by a hash of the source and headers, the options, the GPU
   architecture, the compiler version and the MLX version.  A second process
   (or a second run of the same program) loads the cubin instead of compiling.
3. The cubin is wrapped in a compressed fatbin with NVIDIA's nvFatbin
   library (pip package nvidia-nvfatbin, or a CUDA toolkit's) when one is
   found: MLX hashes the whole binary it is given on every launch
   (``std::hash`` for the JIT module's name: a host cost per KiB, measured by
   bench/node_cost.py), and compression makes it several times smaller; the
   driver unpacks it once at module load.  Compression: nvFatbin's default
   (ZSTD in nvFatbin 13) where the driver is CUDA 13 or newer, LZ4
   (``-compress-mode=speed``, the older format) otherwise.  Without nvFatbin, or if it fails, the plain cubin is
   used (same kernel, same results).
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

Switches (:mod:`mlx_qwen_fast.config`): ``KERNEL_CACHE`` (cache folder),
``NVRTC`` (the libnvrtc to use), ``NVFATBIN`` (the libnvfatbin, or off),
``ARCH`` (build target instead of asking the driver), ``POISON`` (fill
kernel outputs with NaN before each launch).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import config

__all__ = [
    "CUDA_SOURCE_DIR",
    "CudaKernel",
    "build_stats",
    "cache_dir",
    "cuda_available",
    "fatbin_id",
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


def _driver_version() -> int:
    """The CUDA driver's version as 1000 * major + 10 * minor (13000 for
    CUDA 13.0), or 0 without a driver."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int()
        return v.value if lib.cuDriverGetVersion(ctypes.byref(v)) == 0 else 0
    except (OSError, AttributeError):
        return 0


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
# NVRTC
# ---------------------------------------------------------------------------


def _lib_dirs(subdirs: Sequence[str]) -> List[str]:
    """pip's nvidia-* library folders (next to mlx, then on sys.path) and a CUDA toolkit's."""
    roots = list(sys.path)
    try:
        import mlx

        roots.insert(0, str(Path(mlx.__file__).resolve().parent.parent))
    except Exception:
        pass
    out = [os.path.join(r, sub) for r in roots for sub in subdirs]
    out += config.cuda_toolkit_lib_dirs()
    return out + ["/usr/local/cuda/lib64"]


def _nvrtc_candidates() -> List[str]:
    """Places to look for libnvrtc, best first."""
    out: List[str] = []
    chosen = config.NVRTC.get()
    if chosen:
        out.append(chosen)
    # The library MLX's CUDA backend already loaded (its exact version).
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                m = re.search(r"(/\S*libnvrtc\.so[.\d]*)$", line.strip())
                if m and "builtins" not in m.group(1):
                    out.append(m.group(1))
    except OSError:
        pass
    # By soname (also returns an already-loaded copy).
    out += ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    # pip's nvidia-cuda-nvrtc packages, a CUDA toolkit.
    for d in _lib_dirs(("nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib", "nvidia/cu12/lib")):
        out += sorted(glob.glob(os.path.join(d, "libnvrtc.so*")))
    found = ctypes.util.find_library("nvrtc")
    if found:
        out.append(found)
    return [p for p in out if "builtins" not in p and "alt" not in os.path.basename(p)]


class _Nvrtc:
    def __init__(self, lib: ctypes.CDLL, path: str):
        self.lib = lib
        self.path = path
        c = ctypes
        lib.nvrtcGetErrorString.restype = c.c_char_p
        major, minor = c.c_int(), c.c_int()
        lib.nvrtcVersion(c.byref(major), c.byref(minor))
        self.version = (major.value, minor.value)

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = self.lib.nvrtcGetErrorString(rc).decode()
            raise RuntimeError(f"{what} failed: {msg}")

    def compile(
        self, source: str, name: str, headers: Dict[str, str], options: List[str]
    ) -> bytes:
        c = ctypes
        prog = c.c_void_p()
        hn = list(headers)
        h_src = (c.c_char_p * len(hn))(*[headers[n].encode() for n in hn])
        h_names = (c.c_char_p * len(hn))(*[n.encode() for n in hn])
        self._check(
            self.lib.nvrtcCreateProgram(
                c.byref(prog), source.encode(), (name + ".cu").encode(),
                len(hn), h_src, h_names,
            ),
            "nvrtcCreateProgram",
        )
        try:
            opts = (c.c_char_p * len(options))(*[o.encode() for o in options])
            rc = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            if rc != 0:
                size = c.c_size_t()
                self.lib.nvrtcGetProgramLogSize(prog, c.byref(size))
                log = c.create_string_buffer(size.value + 1)
                self.lib.nvrtcGetProgramLog(prog, log)
                raise RuntimeError(
                    f"NVRTC failed to compile {name}:\n{log.value.decode(errors='replace')}"
                )
            size = c.c_size_t()
            self._check(self.lib.nvrtcGetCUBINSize(prog, c.byref(size)), "nvrtcGetCUBINSize")
            buf = c.create_string_buffer(size.value)
            self._check(self.lib.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
            return buf.raw[: size.value]
        finally:
            self.lib.nvrtcDestroyProgram(c.byref(prog))


_nvrtc: Optional[_Nvrtc] = None
_nvrtc_searched = False


def _get_nvrtc() -> Optional[_Nvrtc]:
    global _nvrtc, _nvrtc_searched
    if not _nvrtc_searched:
        _nvrtc_searched = True
        found = _load_first(_nvrtc_candidates(), "nvrtcVersion")
        if found is not None:
            _preload_builtins(found[1])
            _nvrtc = _Nvrtc(*found)
    return _nvrtc


def _load_first(candidates: Sequence[str], symbol: str) -> Optional[Tuple[ctypes.CDLL, str]]:
    """(library, path) of the first candidate that loads and has ``symbol``, or None."""
    for cand in candidates:
        try:
            lib = ctypes.CDLL(cand)
            getattr(lib, symbol)
        except (OSError, AttributeError):
            continue
        return lib, cand
    return None


def _loaded_path(soname_prefix: str) -> Optional[str]:
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                p = line.strip().split()[-1]
                if os.path.basename(p).startswith(soname_prefix):
                    return p
    except OSError:
        pass
    return None


def _preload_builtins(nvrtc_path: str) -> None:
    """Load libnvrtc-builtins from libnvrtc's own folder.

    NVRTC dlopens its builtins library by soname at the first compile; a pip
    install (nvidia/cu13/lib) is not on the loader's search path, so load it
    here first (a later dlopen by soname finds the loaded copy).
    """
    path = nvrtc_path if os.path.isabs(nvrtc_path) else _loaded_path("libnvrtc.so")
    if not path:
        return
    for cand in sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so*"))):
        if ".alt." in os.path.basename(cand):
            continue
        try:
            ctypes.CDLL(cand, mode=ctypes.RTLD_GLOBAL)
            return
        except OSError:
            continue


def compiler_id() -> str:
    """Which compiler builds kernels here, e.g. ``nvrtc-13.0`` or ``nvcc``."""
    nv = _get_nvrtc()
    if nv is not None:
        return f"nvrtc-{nv.version[0]}.{nv.version[1]}"
    if shutil.which("nvcc"):
        return "nvcc-" + _nvcc_version()
    return "none"


def _nvcc_version() -> str:
    try:
        out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
        m = re.search(r"release ([\d.]+)", out)
        return m.group(1) if m else "?"
    except OSError:
        return "?"


def _compile_nvcc(source_path: Path, options: List[str], arch: str) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "k.cubin")
        num = arch[3:]
        cmd = [
            "nvcc", "-cubin", "-std=c++17", "-O3",
            f"-gencode=arch=compute_{num},code={arch}",
            f"-I{source_path.parent}", "-o", out, str(source_path),
        ] + [o for o in options if o.startswith("-D")]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"nvcc failed for {source_path.name}:\n{r.stderr}")
        return Path(out).read_bytes()


# ---------------------------------------------------------------------------
# nvFatbin: the launched image as a compressed fatbin
# ---------------------------------------------------------------------------

class _NvFatbin:
    """ctypes binding of nvFatbin (nvFatbin.h): one compressed fatbin per cubin."""

    def __init__(self, lib: ctypes.CDLL, path: str):
        c = ctypes
        self.lib, self.path = lib, path
        lib.nvFatbinCreate.argtypes = [c.POINTER(c.c_void_p), c.POINTER(c.c_char_p), c.c_size_t]
        lib.nvFatbinAddCubin.argtypes = [c.c_void_p, c.c_void_p, c.c_size_t, c.c_char_p, c.c_char_p]
        lib.nvFatbinSize.argtypes = [c.c_void_p, c.POINTER(c.c_size_t)]
        lib.nvFatbinGet.argtypes = [c.c_void_p, c.c_void_p]
        lib.nvFatbinDestroy.argtypes = [c.POINTER(c.c_void_p)]
        lib.nvFatbinVersion.argtypes = [c.POINTER(c.c_uint), c.POINTER(c.c_uint)]
        lib.nvFatbinGetErrorString.argtypes = [c.c_int]
        lib.nvFatbinGetErrorString.restype = c.c_char_p
        major, minor = c.c_uint(), c.c_uint()
        self._check(lib.nvFatbinVersion(c.byref(major), c.byref(minor)), "nvFatbinVersion")
        self.version = (major.value, minor.value)
        # nvFatbin 13's default compression is ZSTD, which CUDA 13 drivers
        # read; elsewhere LZ4, which drivers have read for far longer (the
        # fatbin is unpacked by the driver at module load)
        self.mode = "zstd" if _driver_version() >= 13000 and self.version[0] >= 13 else "lz4"

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = self.lib.nvFatbinGetErrorString(rc)
            raise RuntimeError(f"{what} failed: {msg.decode() if msg else 'nvFatbinResult ' + str(rc)} "
                               f"({self.path})")

    def compress(self, cubin: bytes, arch: str) -> bytes:
        """A fatbin holding ``cubin`` (built for ``arch``, e.g. "sm_90a"),
        compressed whatever its size (``-compress-all``; ZSTD or LZ4, see
        :attr:`mode`).

        Raises:
          RuntimeError: an nvFatbin call failed (the call and nvFatbin's
            error string are named, e.g. an empty ``cubin`` or one built for
            another arch than ``arch``).
        """
        c, lib = ctypes, self.lib
        opts = [b"-compress-all"] + ([b"-compress-mode=speed"] if self.mode == "lz4" else [])
        h = c.c_void_p()
        rc = lib.nvFatbinCreate(c.byref(h), (c.c_char_p * len(opts))(*opts), len(opts))
        if rc != 0 and len(opts) > 1:  # a library older than -compress-mode: its default is LZ4
            rc = lib.nvFatbinCreate(c.byref(h), (c.c_char_p * 1)(opts[0]), 1)
        self._check(rc, "nvFatbinCreate")
        try:
            self._check(lib.nvFatbinAddCubin(h, cubin, len(cubin), arch.removeprefix("sm_").encode(), b"k"),
                        f"nvFatbinAddCubin ({len(cubin)} bytes for {arch})")
            size = c.c_size_t()
            self._check(lib.nvFatbinSize(h, c.byref(size)), "nvFatbinSize")
            buf = c.create_string_buffer(size.value)
            self._check(lib.nvFatbinGet(h, buf), "nvFatbinGet")
            return buf.raw[: size.value]
        finally:
            lib.nvFatbinDestroy(c.byref(h))


@functools.lru_cache(maxsize=None)
def _get_nvfatbin() -> Optional[_NvFatbin]:
    """The nvFatbin library, or None (not installed, or ``config.NVFATBIN`` off);
    looked up once per process."""
    chosen = config.NVFATBIN.get()
    if chosen is False:
        return None
    found = _load_first([chosen], "nvFatbinAddCubin") if chosen else None
    if chosen and found is None:
        warnings.warn(f"{config.NVFATBIN.name}={chosen!r} is not a loadable libnvfatbin; searching the usual places",
                      RuntimeWarning)
    if found is None:
        cands = ["libnvfatbin.so.13", "libnvfatbin.so.12", "libnvfatbin.so"]
        for d in _lib_dirs(("nvidia/cu13/lib", "nvidia/nvfatbin/lib", "nvidia/cu12/lib")):
            cands += sorted(glob.glob(os.path.join(d, "libnvfatbin.so*")))
        found = _load_first(cands, "nvFatbinAddCubin")
    try:
        return _NvFatbin(*found) if found is not None else None
    except (AttributeError, RuntimeError) as exc:  # an nvFatbin without the calls used here
        warnings.warn(f"nvFatbin at {found[1]} is not usable ({exc}); launching plain cubins", RuntimeWarning)
        return None


#: Why compression was turned off for this process after a failure (None: it was not).
_fatbin_failed: Optional[str] = None


def fatbin_id() -> str:
    """What kernels are launched as: ``fatbin-zstd (nvfatbin X.Y)``,
    ``fatbin-lz4 (...)``, or ``cubin`` (no nvFatbin, or it failed in this
    process: then with the reason)."""
    if _fatbin_failed:
        return f"cubin (nvFatbin failed: {_fatbin_failed})"
    nf = _get_nvfatbin()
    return f"fatbin-{nf.mode} (nvfatbin {nf.version[0]}.{nf.version[1]})" if nf else "cubin"


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
            comp = compiler_id()
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
        is available (see the module docstring), else the cubin itself."""
        global _fatbin_failed
        if self._image is not None:
            return self._image
        cubin = self.cubin
        with _lock:
            if self.name in _images:
                self._image = _images[self.name]
                return self._image
            nf = None if _fatbin_failed else _get_nvfatbin()
            image = cubin
            if nf is not None:
                t0 = time.perf_counter()
                try:
                    packed = nf.compress(cubin, build_stats[self.name]["arch"])
                    image = packed if len(packed) < len(cubin) else cubin
                except RuntimeError as exc:  # the plain cubin runs the same kernel
                    _fatbin_failed = str(exc)
                    warnings.warn(f"{self.name}: launching plain cubins in this process ({exc})", RuntimeWarning)
                build_stats[self.name]["fatbin_seconds"] = time.perf_counter() - t0
            build_stats[self.name].update(cubin_bytes=len(cubin), image_bytes=len(image),
                                          image="cubin" if image is cubin else f"fatbin-{nf.mode}")
            _images[self.name] = self._image = image
            return image

    def _compile(self, arch: str) -> bytes:
        opts = [f"--gpu-architecture={arch}", f"-DKNAME={self.name}"] + self._base_opts
        nv = _get_nvrtc()
        if nv is not None:
            return nv.compile(self._src, self.name, self._headers, opts)
        if shutil.which("nvcc"):
            return _compile_nvcc(CUDA_SOURCE_DIR / self.filename, opts, arch)
        raise RuntimeError(
            "No CUDA compiler found: need libnvrtc (pip package nvidia-cuda-nvrtc, "
            "which mlx[cuda13] installs) or nvcc on PATH; set MLX_QWEN_FAST_NVRTC "
            "to a libnvrtc.so path to choose one."
        )

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


def describe(value) -> str:
    """An argument as an error message names what was passed: ``bfloat16
    (2, 3)`` for an mx.array, else its type (``numpy.ndarray float32 (2,
    3)``, ``list``, ``None``)."""
    import mlx.core as mx

    if isinstance(value, mx.array):
        return f"{value.dtype} {tuple(value.shape)}"
    if value is None:
        return "None"
    kind = type(value)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    return f"{name} {dtype} {tuple(shape)}" if isinstance(shape, tuple) and dtype is not None else name


def is_array(value, *, optional: bool = False) -> bool:
    """Whether ``value`` is an mx.array (or None, where ``optional``): the
    ``supports()`` functions answer False, never an error, for anything else."""
    import mlx.core as mx

    return isinstance(value, mx.array) or (optional and value is None)


#: An array argument as :func:`arrays_problem` checks it: its name, what it
#: must be (shape and dtype, e.g. ``"[B, T, Hv] (float)"``), and whether None
#: stands for a default.
ArraySpec = Tuple[str, str, bool]


def arrays_problem(specs: Sequence[ArraySpec], *values) -> Optional[str]:
    """None when each of ``values`` is an mx.array (or None, where its spec
    allows), else one line naming the first that is not, what it must be and
    what was passed. ``specs`` run parallel to ``values``."""
    import mlx.core as mx

    for value, (name, expected, optional) in zip(values, specs):
        if not isinstance(value, mx.array) and not (optional and value is None):
            return (f"{name} must be an mx.array {expected}{' or None' if optional else ''}, "
                    f"got {describe(value)}")
    return None


def check_arrays(fn: Optional[str], specs: Sequence[ArraySpec], *values) -> None:
    """Raise ValueError (``fn: `` first where given) with
    :func:`arrays_problem`'s message. Run before any attribute of the
    arguments is read, and before any CUDA-only step, so it holds on every
    backend."""
    problem = arrays_problem(specs, *values)
    if problem is not None:
        raise ValueError(f"{fn}: {problem}" if fn else problem)


def check_eps(fn: str, name: str, value) -> float:
    """``value`` as a float if it is a finite number in ``(0, 1)`` (an
    epsilon added to a mean or sum of squares), else ValueError naming it."""
    import math
    import numbers

    if (not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value)
            or not 0 < value < 1):
        raise ValueError(f"{fn}: {name} must be a finite float in (0, 1), got {value!r}")
    return float(value)


def dtype_macro(dtype) -> str:
    """C type of an MLX float dtype in the kernel sources (gdn_common.cuh)."""
    import mlx.core as mx

    table = {mx.bfloat16: "bf16_t", mx.float16: "f16_t", mx.float32: "float"}
    if dtype not in table:
        raise ValueError(f"unsupported dtype {dtype}: expected bfloat16, float16 or float32")
    return table[dtype]
