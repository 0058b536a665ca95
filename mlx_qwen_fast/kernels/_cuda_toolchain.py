"""The CUDA compiler that turns a kernel source into a cubin: NVRTC, else nvcc.

NVRTC is looked up once per process, best first: the library named by
:data:`mlx_qwen_fast.config.NVRTC`, the ``libnvrtc`` MLX's CUDA backend
already loaded (its exact version), then by soname, pip's nvidia-* folders
(next to mlx, then on ``sys.path``), a CUDA toolkit's. Its builtins library
is loaded from its own folder first (a pip install is not on the loader's
search path). Without NVRTC, ``nvcc`` on ``PATH`` builds the cubin.

:func:`compiler_id` names the compiler for the cubin cache's key
(:mod:`mlx_qwen_fast.kernels._cuda_build`); :func:`lib_dirs` and
:func:`load_first` also find nvFatbin
(:mod:`mlx_qwen_fast.kernels._cuda_fatbin`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .. import config

__all__ = ["Nvrtc", "compile_cubin", "compiler_id", "get_nvrtc", "lib_dirs", "load_first"]


def lib_dirs(subdirs: Sequence[str]) -> List[str]:
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


def load_first(candidates: Sequence[str], symbol: str) -> Optional[Tuple[ctypes.CDLL, str]]:
    """(library, path) of the first candidate that loads and has ``symbol``, or None."""
    for cand in candidates:
        try:
            lib = ctypes.CDLL(cand)
            getattr(lib, symbol)
        except (OSError, AttributeError):
            continue
        return lib, cand
    return None


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
    for d in lib_dirs(("nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib", "nvidia/cu12/lib")):
        out += sorted(glob.glob(os.path.join(d, "libnvrtc.so*")))
    found = ctypes.util.find_library("nvrtc")
    if found:
        out.append(found)
    return [p for p in out if "builtins" not in p and "alt" not in os.path.basename(p)]


class Nvrtc:
    """ctypes binding of NVRTC: one program compiled to a cubin per call."""

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
        """The cubin of ``source`` (``headers``: in-memory ``#include``
        files by name); RuntimeError with NVRTC's log when it fails."""
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


_nvrtc: Optional[Nvrtc] = None
_nvrtc_searched = False


def get_nvrtc() -> Optional[Nvrtc]:
    """The NVRTC library, or None where none loads; looked up once per process."""
    global _nvrtc, _nvrtc_searched
    if not _nvrtc_searched:
        _nvrtc_searched = True
        found = load_first(_nvrtc_candidates(), "nvrtcVersion")
        if found is not None:
            _preload_builtins(found[1])
            _nvrtc = Nvrtc(*found)
    return _nvrtc


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
    nv = get_nvrtc()
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


def compile_cubin(source: str, name: str, headers: Dict[str, str], options: List[str],
                  source_path: Path, arch: str) -> bytes:
    """The cubin of one kernel build for ``arch`` (e.g. "sm_90a"): NVRTC on
    ``source`` with ``headers`` in memory and ``options``, else nvcc on
    ``source_path`` with the ``-D`` options of ``options``.

    Raises:
      RuntimeError: the compiler failed (its log), or there is none.
    """
    nv = get_nvrtc()
    if nv is not None:
        return nv.compile(source, name, headers, options)
    if shutil.which("nvcc"):
        return _compile_nvcc(source_path, options, arch)
    raise RuntimeError(
        "No CUDA compiler found: need libnvrtc (pip package nvidia-cuda-nvrtc, "
        "which mlx[cuda13] installs) or nvcc on PATH; set MLX_QWEN_FAST_NVRTC "
        "to a libnvrtc.so path to choose one."
    )
