"""Run the package's CUDA kernels on the CPU, checked (no GPU needed).

What it does, for one launch of a :class:`mlx_qwen_fast.kernels._cuda_build.CudaKernel`:

1. **The kernel's own source.** The ``.cu`` file and the package's ``*.cuh``
   headers, with the launch's build macros (``KNAME`` and the wrapper's
   ``defines``) and ``__CUDA_ARCH__`` of the simulated GPU (:data:`ARCH`),
   compiled by the system C++ compiler as C++20 against
   ``cuda_shim.h`` (the CUDA subset the kernels use, read on the CPU) with
   ``MQF_CPU_CHECK`` defined, which selects the CPU bodies of the PTX helpers
   in ``mlx_qwen_fast/cuda/ptx.cuh``. Each ``__shared__`` declaration is
   rewritten into a call that places the array in the block's shared-memory
   arena (:func:`rewrite`); nothing else of the source changes.
2. **The wrapper's launch.** Inside :func:`simulated`, every
   ``CudaKernel.__call__`` runs here instead of through MLX, with the grid,
   block, dynamic shared memory and scalars the wrapper computed, on its
   input arrays (evaluated on the CPU). The kernel's parameter list is
   checked against the launch (arrays, then int32/fp32 scalars, MLX's
   convention), the block against ``__launch_bounds__``.
3. **Run** as a separate process (``cuda_run.h``): one fiber per GPU thread
   (a 256 KB stack each, under a guard page for the first 8,192 threads of a
   launch, above a checked canary for the rest: a guard page per thread of a
   whole resident grid would pass the machine's limit on memory mappings),
   barriers and warp collectives with CUDA's rules checked, guard pages after
   every array (global and shared), outputs poisoned (0xFF bytes: NaN in
   every float format), twice, under two thread schedules (ascending thread
   and block order; descending), whose outputs must agree bit for bit;
   the inputs must come back unchanged. Kernels that include ``grid_sync.cuh``
   run with every block resident at once (its grid barrier needs that).

``MQF_CUDA_CHECK_RECORD=FILE`` appends every launched configuration
(source file, build macros) to FILE as JSON lines (the input of
``bench/cubin_identity.py``).

Where a libnvrtc is installed (the test extra's ``nvidia-cuda-nvrtc``),
every kernel configuration launched inside :func:`simulated` is also
compiled by NVRTC for the simulated target, as a GPU machine builds it at
first use (:func:`nvrtc_compile`): NVRTC rejects some source nvcc accepts.

It fails (:class:`CudaCheckError`, with the kernel, block and thread named) on:
an access outside an array (which one, at which byte), a thread's stack
overflow, a write before a
shared array's start, a ``__syncthreads`` that not every thread of the block
reaches or that threads reach at different call sites, a warp collective
whose mask is wrong (leaves the caller out, names missing lanes, is not
met by every lane it names, reads a lane outside it), a ``cp.async`` wait
with nothing to wait for being read early (seen as differing outputs), a
grid barrier that never completes, ``__trap()``, a float output element
never written (still poisoned; outputs a source declares ``cuda-check:
unwritten outputs N`` excepted), a launch that does not fit
the kernel's parameters or limits, outputs that depend on the schedule (a
race), an input the kernel wrote.

What a pass proves: for the shapes run, the kernel's arithmetic under a C++
reading of CUDA and of the PTX helpers' ISA semantics, that NVRTC builds it
(where installed), and the absence of the errors above. What it cannot:
anything about speed, register or shared
memory pressure beyond the 227 KB per block, the GPU's weak memory model
(threads here never run at once; races show only where the two schedules
order them differently), bit-exact GPU arithmetic (fp32 sums in another
order; fast-math intrinsics exact here; ``mma`` accumulates in double),
reads before an array's first byte that stay within its page.

Usage::

    with cuda_check.simulated():
        out = some_wrapper(...)        # the wrapper's kernels run here, checked
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from array_bytes import NP, from_bytes, to_bytes

from mlx_qwen_fast import backend
from mlx_qwen_fast.kernels import _cuda_build as cb
from mlx_qwen_fast.kernels import _cuda_toolchain

HERE = Path(__file__).resolve().parent
SHIM = HERE / "cuda_shim.h"
RUNNER = HERE / "cuda_run.h"
SOURCES = cb.CUDA_SOURCE_DIR
CXX = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
CXXFLAGS = ["-std=c++20", "-O1", "-w", "-fno-strict-aliasing", "-fwrapv"]

#: The thread schedules every launch runs under (cuda_shim.h): 0 ascending,
#: 1 descending; outputs must agree bit for bit.
SCHEDULES = (0, 1)

#: SMs the simulated GPU reports (``_cuda_build.sm_count``): an H100 SXM's.
SM_COUNT = 132

#: The simulated GPU's compute capability (``_cuda_build.gpu_arch``): an
#: H100's. The CPU builds define ``__CUDA_ARCH__`` from it (900), as nvcc and
#: NVRTC do for the device pass, so that a kernel's ``#if __CUDA_ARCH__``
#: branches run as on that GPU (undefined, the macro reads as 0: the oldest
#: branch).
ARCH = (9, 0)
_arch = ARCH  # the architecture builds are made for now (simulated(arch=...))


class CudaCheckError(AssertionError):
    """The kernel did something the checker catches (message from the run)."""


#: Every launch run here in this process: (source file, kernel name) in order.
launches: List[Tuple[str, str]] = []
#: The build macros of every kernel name launched here.
defines_of: Dict[str, Dict[str, object]] = {}


def _cache_dir() -> Path:
    d = Path(os.environ.get("MQF_CUDA_CHECK_CACHE", Path(tempfile.gettempdir()) / "mqf-cuda-check"))
    d.mkdir(parents=True, exist_ok=True)
    return d


# ---------------------------------------------------------------------------
# source rewrite
# ---------------------------------------------------------------------------

_SHARED = re.compile(
    r"(?P<extern>\bextern\s+)?\b__shared__\s+(?:__align__\((?P<align>\d+)\)\s+)?"
    r"(?P<type>[A-Za-z_][\w:<>]*(?:\s+[A-Za-z_][\w:<>]*)*?)\s+(?P<name>[A-Za-z_]\w*)\s*"
    r"(?P<dims>(?:\[[^\];]*\])*)\s*;")


def rewrite(text: str) -> str:
    """``text`` with each ``__shared__`` declaration made a reference into the
    block's shared-memory arena (cuda_shim.h ``shared_static`` /
    ``shared_dynamic``); raises CudaCheckError for one it cannot read."""

    def one(m: re.Match) -> str:
        t, name, dims, align = m.group("type").strip(), m.group("name"), m.group("dims"), m.group("align") or "0"
        if m.group("extern"):
            if dims != "[]":
                raise CudaCheckError(f"extern __shared__ {name} must be an unsized array")
            return f"{t}* const {name} = static_cast<{t}*>(mqf::shared_dynamic({align}));"
        return (f"typedef {t} mqf_t_{name}{dims}; static const char mqf_site_{name} = 0; "
                f"auto& {name} = *mqf::shared_static<mqf_t_{name}>(&mqf_site_{name}, \"{name}\", {align});")

    out = _SHARED.sub(one, text)
    if "__shared__" in re.sub(r"//.*", "", out):
        line = next(l for l in out.splitlines() if "__shared__" in re.sub(r"//.*", "", l))
        raise CudaCheckError(f"__shared__ declaration not understood: {line.strip()!r}")
    return out


def launch_bound(preprocessed: str, name: str) -> str:
    """The first argument of the ``__launch_bounds__`` of kernel ``name`` in
    preprocessed source (macros expanded, ``#if`` branches chosen), or "0"."""
    m = re.search(r"__launch_bounds__\s*\(([^;{}]*?)\)\s*" + re.escape(name) + r"\s*\(", preprocessed)
    if m is None:
        return "0"
    arg, depth = m.group(1), 0
    for i, c in enumerate(arg):  # up to a top-level comma (the optional second argument)
        depth += c == "("
        depth -= c == ")"
        if c == "," and depth == 0:
            return arg[:i].strip()
    return arg.strip()


def _includes(text: str) -> List[str]:
    return re.findall(r'^\s*#\s*include\s+"([^"]+)"', text, re.M)


#: Source texts that replace a file's for the builds inside :func:`planted`.
_planted: Dict[str, str] = {}
#: Folders searched for kernel sources and headers, in order (tests add theirs).
SOURCE_DIRS: List[Path] = [SOURCES]


def _path(name: str) -> Optional[Path]:
    for d in SOURCE_DIRS:
        if (d / name).is_file():
            return d / name
    return None


def _read(name: str) -> str:
    if name in _planted:
        return _planted[name]
    p = _path(name)
    if p is None:
        raise CudaCheckError(f"no kernel source {name!r} in {[str(d) for d in SOURCE_DIRS]}")
    return p.read_text()


@contextlib.contextmanager
def planted(filename: str, old: str, new: str, index: Optional[int] = None):
    """Within: builds read ``filename`` with ``old`` replaced by ``new`` (a
    bug planted, to show the check catches it): its one occurrence, or
    occurrence ``index`` (0-based). Plants nest. Raises CudaCheckError when
    ``old`` does not occur once (or ``index`` times and more)."""
    text = _read(filename)
    count = text.count(old)
    if (index is None and count != 1) or (index is not None and not 0 <= index < count):
        raise CudaCheckError(f"{filename}: {old!r} occurs {count} times (index {index})")
    pos = -1
    for _ in range((index or 0) + 1):
        pos = text.index(old, pos + 1)
    before = _planted.get(filename)
    _planted[filename] = text[:pos] + new + text[pos + len(old):]
    try:
        yield
    finally:
        if before is None:
            del _planted[filename]
        else:
            _planted[filename] = before


def order_free_outputs(filename: str) -> set:
    """Output indices whose element order the kernel's contract leaves open
    (e.g. the order of atomics), declared in its source by a comment line
    ``cuda-check: order-free outputs 2, 4``: between the two schedules they
    must hold the same elements, in any order."""
    m = re.search(r"cuda-check:\s*order-free outputs\s+([\d ,]+)", _read(filename))
    return {int(v) for v in re.findall(r"\d+", m.group(1))} if m else set()


def unwritten_ok(filename: str) -> set:
    """Float output indices the kernel's contract lets it leave partly
    unwritten, declared in its source by a comment line ``cuda-check:
    unwritten outputs 1`` (every other float output must be written
    everywhere: a poisoned element left over fails the launch)."""
    m = re.search(r"cuda-check:\s*unwritten outputs\s+([\d ,]+)", _read(filename))
    return {int(v) for v in re.findall(r"\d+", m.group(1))} if m else set()


def _closure(filename: str) -> List[str]:
    """``filename`` and the kernel headers it includes, transitively."""
    seen, todo = [], [filename]
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.append(f)
        todo += [h for h in _includes(_read(f)) if _path(h) is not None]
    return seen


def build(filename: str, defines: Dict[str, object]) -> Path:
    """The checker's executable for ``filename`` built with ``defines``
    (cached by a hash of everything that goes into it)."""
    if CXX is None:
        raise CudaCheckError("no C++ compiler (g++) on PATH")
    files = _closure(filename)
    texts = {f: rewrite(_read(f)) for f in files}
    defs = [f"-D{k}={v}" for k, v in sorted(defines.items())] + [f"-D__CUDA_ARCH__={_arch[0] * 100 + _arch[1] * 10}"]
    h = hashlib.sha256()
    for part in [*(f + "\0" + texts[f] for f in sorted(texts)), SHIM.read_text(), RUNNER.read_text(), *defs,
                 *CXXFLAGS, CXX]:
        h.update(part.encode() + b"\0")
    key = h.hexdigest()[:24]
    exe = _cache_dir() / f"{Path(filename).stem}-{key}"
    if exe.exists():
        return exe
    # per-process names: two suites sharing the cache folder may build the same kernel at once
    tag = f"{os.getpid()}.{threading.get_ident()}"
    src_dir = _cache_dir() / f"src-{key}.{tag}"
    src_dir.mkdir()
    try:
        for f, t in texts.items():
            (src_dir / f).write_text(t)
        main_cpp = src_dir / (Path(filename).stem + ".cpp")
        main_cpp.write_text(f'#include "{filename}"\n')
        r = subprocess.run([CXX, "-E", "-P", "-std=c++20", "-DMQF_CPU_CHECK", f"-I{src_dir}", *defs, str(main_cpp)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise CudaCheckError(f"{filename} does not preprocess:\n" + r.stderr[-4000:])
        bound = launch_bound(r.stdout, str(defines["KNAME"]))
        main_cpp.write_text(f'#include "{filename}"\n#define MQF_LAUNCH_BOUND ({bound})\n#include "{RUNNER}"\n')
        tmp = Path(f"{exe}.{tag}.tmp")
        r = subprocess.run([CXX, *CXXFLAGS, "-include", str(SHIM), f"-I{src_dir}", *defs, "-o", str(tmp),
                            str(main_cpp)], capture_output=True, text=True)
        if r.returncode != 0:
            raise CudaCheckError(f"{filename} does not compile against cuda_shim.h:\n" + r.stderr[-4000:])
        os.replace(tmp, exe)
    finally:
        shutil.rmtree(src_dir, ignore_errors=True)
    return exe


# ---------------------------------------------------------------------------
# a launch
# ---------------------------------------------------------------------------


def _scalar_line(s) -> str:
    if isinstance(s, bool) or not isinstance(s, (int, float)):
        raise CudaCheckError(f"scalar {s!r}: the launch takes Python ints and floats only")
    if isinstance(s, int):
        if not -2**31 <= s < 2**31:
            raise CudaCheckError(f"int scalar {s} does not fit int32")
        return f"i {s}"
    return f"f {int(np.float32(s).view(np.uint32)):08x}"


def launch(filename: str, name: str, defines: Dict[str, object], inputs: Sequence[mx.array],
           output_shapes: Sequence[Tuple[int, ...]], output_dtypes: Sequence, grid: Tuple[int, int, int],
           threadgroup: Tuple[int, int, int], scalars: Sequence = (), shared_memory: int = 0,
           init_value: Optional[float] = None) -> List[mx.array]:
    """Run one launch of kernel source ``filename`` on the CPU, checked
    (module docstring). ``grid`` counts threads, as MLX's; blocks are
    ``ceil(grid / threadgroup)`` per dimension. Outputs start as 0xFF bytes
    (``init_value`` None) or filled with ``init_value``.

    Returns the outputs as mx.arrays; raises CudaCheckError."""
    arrays = [x if isinstance(x, mx.array) else mx.array(x) for x in inputs]
    mx.eval(arrays)
    if len(grid) != 3 or len(threadgroup) != 3 or min(threadgroup) < 1 or min(grid) < 1:
        raise CudaCheckError(f"{name}: grid {grid} / threadgroup {threadgroup} must be three positive counts")
    blocks = [-(-int(g) // int(t)) for g, t in zip(grid, threadgroup)]
    defines = dict(defines)
    defines.setdefault("KNAME", name)
    exe = build(filename, defines)
    launches.append((filename, name))
    defines_of[name] = defines
    record = os.environ.get("MQF_CUDA_CHECK_RECORD")
    if record:  # the configurations run, for bench/cubin_identity.py
        with open(record, "a") as f:
            f.write(json.dumps([filename, {k: str(v) for k, v in defines.items() if k != "KNAME"}]) + "\n")
    d = Path(tempfile.mkdtemp(prefix="mqf-cuda-run-"))
    try:
        manifest, ins = [], []
        for i, a in enumerate(arrays):
            data = to_bytes(a)
            ins.append(data)
            (d / f"{i}.bin").write_bytes(data)
            manifest.append(f"in{i} {len(data)}")
        for j, (shape, dt) in enumerate(zip(output_shapes, output_dtypes)):
            n = int(np.prod(shape)) * dt.size
            data = b"\xff" * n if init_value is None else to_bytes(mx.full(tuple(shape), init_value, dt))
            (d / f"{len(arrays) + j}.bin").write_bytes(data)
            manifest.append(f"out{j} {n}")
        (d / "manifest").write_text("\n".join(manifest) + "\n")
        (d / "scalars").write_text("".join(_scalar_line(s) + "\n" for s in scalars))
        coop = int(any("grid_sync.cuh" in _includes(_read(f)) for f in _closure(filename)))
        runs = []
        for schedule in SCHEDULES:
            rd = d / f"s{schedule}"
            rd.mkdir()
            for f in d.iterdir():
                if f.is_file():
                    shutil.copy(f, rd / f.name)
            args = [str(exe), str(rd), *map(str, blocks), *map(str, threadgroup), str(int(shared_memory)),
                    str(schedule), str(coop), Path(filename).stem]
            runs.append((rd, subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
        results = []
        for rd, p in runs:
            out, err = p.communicate(timeout=900)
            if p.returncode != 0:
                msg = err.strip() or f"exit code {p.returncode}"
                for other_rd, other in runs:
                    if other.poll() is None:
                        other.kill()
                raise CudaCheckError(msg.replace(f"{Path(filename).stem}:", f"{filename} ({name}):", 1))
            results.append([(rd / f"{i}.out").read_bytes() for i in range(len(arrays) + len(output_shapes))])
        for i, data in enumerate(ins):
            if any(r[i] != data for r in results):
                raise CudaCheckError(f"{filename} ({name}): the kernel wrote input {i}")
        free = order_free_outputs(filename)
        for j in range(len(output_shapes)):
            k = len(arrays) + j
            if j in free:  # the contract leaves the order open: the same elements, in any order
                item = NP[output_dtypes[j]]
                if any(not np.array_equal(np.sort(np.frombuffer(r[k], item)), np.sort(np.frombuffer(results[0][k], item)))
                       for r in results[1:]):
                    raise CudaCheckError(f"{filename} ({name}): order-free output {j} holds other elements under "
                                         f"another schedule")
                continue
            if any(r[k] != results[0][k] for r in results[1:]):
                raise CudaCheckError(
                    f"{filename} ({name}): output {j} depends on the order threads and blocks run in (schedules "
                    f"{SCHEDULES}): a thread reads memory another writes with no barrier between (or a cp.async "
                    f"destination before its wait)")
        if init_value is None:  # poisoned outputs: a float element still all 0xFF bytes was never written
            # (or computed from poison: the CPU's NaN arithmetic keeps the pattern)
            for j, (shape, dt) in enumerate(zip(output_shapes, output_dtypes)):
                if dt not in (mx.float32, mx.float16, mx.bfloat16) or j in unwritten_ok(filename):
                    continue
                words = np.frombuffer(results[0][len(arrays) + j], NP[dt]).view(f"u{dt.size}")
                left = np.flatnonzero(words == np.iinfo(f"u{dt.size}").max)
                if left.size:
                    at = tuple(int(i) for i in np.unravel_index(int(left[0]), shape))
                    raise CudaCheckError(
                        f"{filename} ({name}): output {j} {tuple(shape)}: {left.size} elements hold the poison "
                        f"pattern (never written, or computed from never-written memory), the first at flat index "
                        f"{int(left[0])} (index {at})")
        return [from_bytes(results[0][len(arrays) + j], tuple(s), dt)
                for j, (s, dt) in enumerate(zip(output_shapes, output_dtypes))]
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------------------
# the package's launches, redirected
# ---------------------------------------------------------------------------


#: Kernel names NVRTC has compiled in this process (:func:`nvrtc_compile`).
_nvrtc_done: set = set()


def nvrtc_compile(kernel) -> bool:
    """Compile ``kernel`` (a CudaKernel) with NVRTC for the simulated GPU's
    target, as a GPU machine builds it at first use, where a libnvrtc is
    installed (the test extra's ``nvidia-cuda-nvrtc``); False where none is.
    NVRTC rejects some source nvcc accepts (a function without an execution
    space is a host function, and JIT mode has none). Raises CudaCheckError
    with NVRTC's log."""
    if _cuda_toolchain.get_nvrtc() is None:
        return False
    if kernel.name in _nvrtc_done:
        return True
    try:
        kernel.cubin
    except RuntimeError as exc:
        raise CudaCheckError(f"{kernel.filename} ({kernel.name}): {exc}") from None
    _nvrtc_done.add(kernel.name)
    return True


def _simulated_call(self, inputs, output_shapes, output_dtypes, grid, threadgroup, scalars=(), shared_memory=0):
    nvrtc_compile(self)
    return launch(self.filename, self.name, self.defines, inputs, output_shapes, output_dtypes, grid, threadgroup,
                  scalars, shared_memory)  # outputs start as 0xFF bytes: NaN, poisoning or not


_active = 0


def active() -> bool:
    """True inside :func:`simulated`."""
    return _active > 0


@contextlib.contextmanager
def simulated(sm_count: int = SM_COUNT, arch: Tuple[int, int] = ARCH):
    """Within: the package sees a CUDA GPU (``backend.current()`` is "cuda",
    ``_cuda_build.cuda_available()`` True, compute capability ``arch`` (sm_90
    by default) with ``sm_count`` SMs) and every CudaKernel launch runs on
    the CPU through :func:`launch`, built with ``__CUDA_ARCH__`` of ``arch``.
    MLX's own ops run on the CPU, uncompiled (``mx.compile`` would trace the
    kernels' inputs, which the checker must evaluate)."""
    global _active, _arch
    saved = (cb.CudaKernel.__call__, cb.cuda_available, cb.gpu_arch, cb.sm_count, backend.current, _arch)
    device = mx.default_device()
    cb.CudaKernel.__call__ = _simulated_call
    saved_build = (cb._arch_option, cb.cache_dir)
    cb._arch_option = lambda: f"sm_{arch[0]}{arch[1]}" + ("a" if tuple(arch) == (9, 0) else "")
    cb.cache_dir = lambda: _cache_dir() / "nvrtc"  # the check's cubins stay out of the user's cache
    cb.cuda_available = lambda: True
    cb.gpu_arch = lambda: tuple(arch)
    cb.sm_count = lambda: sm_count
    backend.current = lambda: backend.CUDA
    _arch = tuple(arch)
    mx.set_default_device(mx.cpu)
    mx.disable_compile()
    _active += 1
    try:
        yield
    finally:
        _active -= 1
        mx.enable_compile()
        mx.set_default_device(device)
        cb.CudaKernel.__call__, cb.cuda_available, cb.gpu_arch, cb.sm_count, backend.current, _arch = saved
        cb._arch_option, cb.cache_dir = saved_build
