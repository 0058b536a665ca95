"""The image MLX launches for a cubin: a compressed fatbin, else the cubin.

MLX hashes the whole binary it is given on every launch (``std::hash`` for
the JIT module's name: a host cost per KiB, measured by bench/node_cost.py),
and compression makes it several times smaller; the driver unpacks it once
at module load. The fatbin is built with NVIDIA's nvFatbin library (pip
package nvidia-nvfatbin, or a CUDA toolkit's; :data:`mlx_qwen_fast.config.NVFATBIN`
names one or turns it off). Compression: nvFatbin's default (ZSTD in
nvFatbin 13) where the driver is CUDA 13 or newer, LZ4
(``-compress-mode=speed``, the older format) otherwise. Without nvFatbin,
or once it failed in this process, the plain cubin is launched (same
kernel, same results).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import time
import warnings
from typing import Optional, Tuple

from .. import config
from ._cuda_toolchain import lib_dirs, load_first

__all__ = ["NvFatbin", "fatbin_id", "get_nvfatbin", "launch_image"]


def _driver_version() -> int:
    """The CUDA driver's version as 1000 * major + 10 * minor (13000 for
    CUDA 13.0), or 0 without a driver."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int()
        return v.value if lib.cuDriverGetVersion(ctypes.byref(v)) == 0 else 0
    except (OSError, AttributeError):
        return 0


class NvFatbin:
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
def get_nvfatbin() -> Optional[NvFatbin]:
    """The nvFatbin library, or None (not installed, or ``config.NVFATBIN`` off);
    looked up once per process."""
    chosen = config.NVFATBIN.get()
    if chosen is False:
        return None
    found = load_first([chosen], "nvFatbinAddCubin") if chosen else None
    if chosen and found is None:
        warnings.warn(f"{config.NVFATBIN.name}={chosen!r} is not a loadable libnvfatbin; searching the usual places",
                      RuntimeWarning)
    if found is None:
        cands = ["libnvfatbin.so.13", "libnvfatbin.so.12", "libnvfatbin.so"]
        for d in lib_dirs(("nvidia/cu13/lib", "nvidia/nvfatbin/lib", "nvidia/cu12/lib")):
            cands += sorted(glob.glob(os.path.join(d, "libnvfatbin.so*")))
        found = load_first(cands, "nvFatbinAddCubin")
    try:
        return NvFatbin(*found) if found is not None else None
    except (AttributeError, RuntimeError) as exc:  # an nvFatbin without the calls used here
        warnings.warn(f"nvFatbin at {found[1]} is not usable ({exc}); launching plain cubins", RuntimeWarning)
        return None


#: Why compression was turned off for this process after a failure (None: it was not).
_failed: Optional[str] = None


def fatbin_id() -> str:
    """What kernels are launched as: ``fatbin-zstd (nvfatbin X.Y)``,
    ``fatbin-lz4 (...)``, or ``cubin`` (no nvFatbin, or it failed in this
    process: then with the reason)."""
    if _failed:
        return f"cubin (nvFatbin failed: {_failed})"
    nf = get_nvfatbin()
    return f"fatbin-{nf.mode} (nvfatbin {nf.version[0]}.{nf.version[1]})" if nf else "cubin"


def launch_image(name: str, cubin: bytes, arch: str) -> Tuple[bytes, dict]:
    """(image, build-record fields) for kernel ``name``'s ``cubin`` built for
    ``arch``: the compressed fatbin where nvFatbin is available and the
    fatbin is smaller, else the cubin itself. A failing nvFatbin is warned
    about once (naming ``name``) and not tried again in this process. The
    fields: ``cubin_bytes``, ``image_bytes``, ``image`` ("cubin" or
    "fatbin-<mode>") and, where nvFatbin was tried, ``fatbin_seconds``."""
    global _failed
    nf = None if _failed else get_nvfatbin()
    image = cubin
    record = {}
    if nf is not None:
        t0 = time.perf_counter()
        try:
            packed = nf.compress(cubin, arch)
            image = packed if len(packed) < len(cubin) else cubin
        except RuntimeError as exc:  # the plain cubin runs the same kernel
            _failed = str(exc)
            warnings.warn(f"{name}: launching plain cubins in this process ({exc})", RuntimeWarning)
        record["fatbin_seconds"] = time.perf_counter() - t0
    record.update(cubin_bytes=len(cubin), image_bytes=len(image),
                  image="cubin" if image is cubin else f"fatbin-{nf.mode}")
    return image, record
