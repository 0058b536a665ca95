"""Run MLX's generated Metal kernel sources on the CPU, checked (no Metal needed).

What it does, for one ``mx.fast.metal_kernel`` call:

1. **The exact source.** The call is traced with ``mx.export_function`` with
   ``verbose=True`` (mlx >= 0.32 traces metal_kernel calls on Linux), which
   prints the source MLX generates: the ``[[kernel]]`` signature (inputs as
   ``device`` or ``constant`` buffers, ``*_shape`` / ``*_strides`` /
   ``*_ndim`` and the thread attributes only where the body names them),
   the body, the template instantiation. MLX compiles its utils header,
   then the kernel's ``header``, then that text; here the utils header is
   ``metal_shim.h`` (a C++20 reading of the MSL subset, listed there).
2. **Compiled as C++20** by g++ with that shim; threadgroup arrays declared
   in the body are made shared by the threadgroup's threads and poisoned
   (0xFF bytes) at the start of each threadgroup.
3. **Run** as a separate process (``metal_run.h``): one cooperative fiber
   per GPU thread, one threadgroup at a time, edge threadgroups as
   ``dispatchThreads`` makes them (MLX dispatches ``min(threadgroup,
   grid)``); ``threadgroup_barrier`` and the ``simd_*`` collectives (32
   lanes) wait for their group; twice, under two thread schedules
   (:data:`SCHEDULES`), whose outputs must agree bit for bit. Every buffer
   ends where an inaccessible page starts, outputs start poisoned (NaN)
   unless ``init_value``.

4. **Address spaces** (where libclang is installed: the test extra's
   ``libclang``): the same source, its utils header replaced by
   ``metal_clcpp.h`` (declarations of the MSL subset), is parsed by clang as
   C++ for OpenCL, where ``device``, ``constant``, ``threadgroup`` and
   ``thread`` are address spaces (:func:`address_space_problems`): a
   pointer or reference of one given where another is expected is an error,
   as in Apple's compiler; the C++ build above erases the qualifiers.

It fails (:class:`MetalCheckError`, the program's message) on: an access
past the end of a buffer (named), an address-space mismatch (clang's
message and line), a barrier that some threads of a group
return without reaching, lanes of a SIMD group waiting at different
synchronisation points, outputs that differ between the two schedules (a
read of memory another thread writes with no barrier between), an MSL
construct the shim lacks (a compile error).
Unwritten outputs stay NaN for the caller's comparison to catch.

What this proves: for the shapes run, the kernel's numbers under a C++
reading of MSL, the absence of the bounds and barrier errors above, and that
every pointer and reference keeps its address space (for the template
arguments instantiated).
What it cannot: that Apple's compiler accepts the source, anything about
speed, Apple's memory model (threads of one group never run concurrently
here, so a missing barrier shows only where one of the two schedules
exposes it), SIMD lockstep within a lane group
between collectives, bit-exact reductions (float sums here are sequential),
reads before a buffer's start that stay within its page.

Usage::

    with metal_check.simulated():             # mx.fast.metal_kernel -> CPU-run kernels
        mod = importlib.reload(kernel_module)  # kernels built at import are rebuilt
        out = mod.some_kernel(...)             # runs on the CPU, returns mx.arrays
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from array_bytes import from_bytes, to_bytes

HERE = Path(__file__).resolve().parent
SHIM = HERE / "metal_shim.h"
RUNNER = HERE / "metal_run.h"
CXX = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")

#: Thread attributes the runner provides (name -> expression on the fiber's attributes).
ATTRIBUTES = {
    "thread_position_in_grid": "a.thread_position_in_grid",
    "threads_per_grid": "a.threads_per_grid",
    "thread_position_in_threadgroup": "a.thread_position_in_threadgroup",
    "threads_per_threadgroup": "a.threads_per_threadgroup",
    "threadgroup_position_in_grid": "a.threadgroup_position_in_grid",
    "threadgroups_per_grid": "a.threadgroups_per_grid",
    "thread_index_in_threadgroup": "a.thread_index_in_threadgroup",
    "thread_index_in_simdgroup": "a.thread_index_in_simdgroup",
    "simdgroup_index_in_threadgroup": "a.simdgroup_index_in_threadgroup",
    "threads_per_simdgroup": "a.threads_per_simdgroup",
    "simdgroups_per_threadgroup": "a.simdgroups_per_threadgroup",
}


#: The thread schedules every kernel runs under (``metal_run.h``): 0 runs each
#: runnable thread in turn until it blocks; 1 runs the lowest-numbered one
#: and lets a SIMD group run on as soon as its collective completes. Outputs
#: must agree bit for bit.
SCHEDULES = (0, 1)


class MetalCheckError(AssertionError):
    """The kernel did something the checker catches (message from the run)."""


def _cache_dir() -> Path:
    d = Path(os.environ.get("MQF_METAL_CHECK_CACHE", Path(tempfile.gettempdir()) / "mqf-metal-check"))
    d.mkdir(parents=True, exist_ok=True)
    return d


@contextlib.contextmanager
def _stdout_to(path: Path):
    """Redirect file descriptor 1 (MLX prints the source from C++) to ``path``."""
    import sys

    sys.stdout.flush()
    saved = os.dup(1)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 1)
        try:
            yield
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)


_SIG = re.compile(r"\[\[kernel\]\]\s+void\s+(\w+)\s*\((.*?)\)\s*\{", re.S)
_INST = re.compile(r"^template\s+\[\[host_name.*?decltype\((\w+)(<.*?>)?\)\s*\w+(?:<.*?>)?;\s*$", re.M | re.S)
_PARAM = re.compile(r"^(.*?)\s*\b(\w+)\s*\[\[(\w+)(?:\((\d+)\))?\]\]$", re.S)
_TG_ARRAY = re.compile(r"\bthreadgroup\s+([A-Za-z_][\w:<>, ]*?)\s+([A-Za-z_]\w*)\s*((?:\[[^\];]+\])+)\s*;")


def generated_source(kernel, call: Dict[str, Any], inputs: Sequence[mx.array]) -> str:
    """The source MLX generates for ``kernel(**call)`` (``mx.export_function``
    trace with ``verbose=True``); raises MetalCheckError if none is printed."""
    d = Path(tempfile.mkdtemp(prefix="mqf-src-"))
    try:
        def fn(*arrays):
            return kernel(inputs=list(arrays), verbose=True, **call)

        log = d / "stdout.txt"
        with _stdout_to(log):
            mx.export_function(str(d / "k.mlxfn"), fn, *inputs)
        text = log.read_text()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    m = re.search(r"```\n(.*?)```", text, re.S)
    if not m:
        raise MetalCheckError(f"MLX printed no generated source for {kernel!r}: {text[:300]!r}")
    return m.group(1)


def _program(source: str) -> tuple:
    """C++ program text for a generated source; returns (text, params)."""
    sig = _SIG.search(source)
    inst = _INST.search(source)
    if not sig:
        raise MetalCheckError("generated source without the expected [[kernel]] signature")
    # a templated kernel ends with its explicit instantiation; the call below instantiates it instead
    fname, targs = sig.group(1), (inst.group(2) or "") if inst else ""
    params = []
    for p in [p.strip() for p in sig.group(2).split(",\n")]:
        m = _PARAM.match(p)
        if not m:
            raise MetalCheckError(f"kernel parameter not understood: {p!r}")
        ctype, name, attr, index = m.group(1).strip(), m.group(2), m.group(3), m.group(4)
        params.append((ctype, name, attr, None if index is None else int(index)))
    body = source[: inst.start()] if inst else source

    def tg_array(m):
        t, n, dims = m.group(1), m.group(2), m.group(3)
        return (f"static {t} {n}{dims}; static long {n}__seen = -1; "
                f'mqf::tg_poison({n}, sizeof({n}), &{n}__seen, "{n}");')

    body = _TG_ARRAY.sub(tg_array, body)  # the printed source holds the kernel's header too
    nbuf = sum(1 for p in params if p[2] == "buffer")
    args = []
    for ctype, name, attr, index in params:
        if attr == "buffer":
            if ctype.endswith("&"):
                args.append(f"*({ctype[:-1].strip()}*)mqf_buf[{index}]")
            else:
                args.append(f"({ctype})mqf_buf[{index}]")
        elif attr in ATTRIBUTES:
            args.append(f"{ctype}({ATTRIBUTES[attr]})" if "3" not in ctype and "2" not in ctype
                        else ATTRIBUTES[attr])
        else:
            raise MetalCheckError(f"thread attribute [[{attr}]] is not simulated")
    text = "\n".join([
        f'#include "{SHIM}"',
        body,
        f"static void* mqf_buf[{max(nbuf, 1)}];",
        "static void mqf_body() {",
        "  auto& a = mqf::cur->a;",
        f"  {fname}{targs}({', '.join(args)});",
        "}",
        f'#include "{RUNNER}"',
    ])
    return text, params


def _build(text: str) -> Path:
    if CXX is None:
        raise MetalCheckError("no C++ compiler (g++) on PATH")
    key = hashlib.sha256((text + SHIM.read_text() + RUNNER.read_text()).encode()).hexdigest()[:24]
    exe = _cache_dir() / f"k-{key}"
    if exe.exists():
        return exe
    # per-process names: two suites sharing the cache folder may build the same kernel at once
    tag = f".{os.getpid()}.{threading.get_ident()}"
    src = Path(str(exe) + tag + ".cpp")
    src.write_text(text)
    r = subprocess.run([CXX, "-std=c++20", "-O1", "-w", "-fno-strict-aliasing", "-o", str(exe) + tag + ".tmp",
                        str(src)], capture_output=True, text=True)
    src.unlink(missing_ok=True)
    if r.returncode != 0:
        raise MetalCheckError("the generated source does not compile against metal_shim.h:\n" + r.stderr[-3000:])
    os.replace(str(exe) + tag + ".tmp", exe)
    return exe


CLCPP_PRELUDE = HERE / "metal_clcpp.h"
_VEC_CTOR = re.compile(r"\b((?:u?(?:char|short|int|long)|float|half|bool)[234]|(?:metal::)?vec<[^<>()]*>)\(")
_INSTANTIATION_ATTRS = re.compile(r"^template \[\[host_name\([^)]*\)\]\] \[\[kernel\]\] ", re.M)
_as_checked: Dict[str, List[str]] = {}


def _vector_ctors(src: str) -> str:
    """Metal's vector constructors as clang's vector types take them: of
    several arguments, ``float4(a, b, c, d)``, as list initialisation
    ``float4{a, b, c, d}``; of one (a splat, or a conversion between element
    types, which clang does not make implicitly), as ``mqf_vcast<float4>(x)``
    (metal_clcpp.h)."""
    out, i = [], 0
    for m in _VEC_CTOR.finditer(src):
        if m.start() < i:
            continue
        j, depth = m.end(), 1
        while depth:
            depth += {"(": 1, ")": -1}.get(src[j], 0)
            j += 1
        args = _vector_ctors(src[m.end():j - 1])
        depth, comma = 0, False
        for ch in args:
            depth += {"(": 1, ")": -1, "[": 1, "]": -1, "{": 1, "}": -1}.get(ch, 0)
            comma |= ch == "," and depth == 0
        out.append(src[i:m.start()] + (m.group(1) + "{" + args + "}" if comma else f"mqf_vcast<{m.group(1)}>({args})"))
        i = j
    out.append(src[i:])
    return "".join(out)


def clcpp_source(source: str) -> str:
    """A generated Metal source as clang's C++ for OpenCL reads it: after
    ``metal_clcpp.h``; function-scope threadgroup arrays as pointers into
    threadgroup memory (OpenCL keeps ``__local`` variables to kernels, and
    Metal's ``[[kernel]]`` is an ignored attribute here); the explicit
    instantiation without its attributes; vector constructors as list
    initialisation. Address-space qualifiers stay as written."""
    def tg_array(m):
        t, n, dims = m.group(1), m.group(2), m.group(3)
        inner = dims[dims.index("]") + 1:]
        return f"threadgroup {t} (*{n}){inner} = (threadgroup {t} (*){inner})mqf_tg();"

    src = _TG_ARRAY.sub(tg_array, source)
    src = _INSTANTIATION_ATTRS.sub("template ", src).replace("[[kernel]]", "")
    return f'#include "{CLCPP_PRELUDE.name}"\nthreadgroup void* mqf_tg();\n' + _vector_ctors(src)


def address_space_problems(source: str) -> Optional[List[str]]:
    """clang's errors (``line: message | source line``) for a generated Metal
    source read as C++ for OpenCL (:func:`clcpp_source`), where the four
    address spaces are distinct: an empty list when it parses cleanly;
    None where libclang is not installed. Parsing only (``-fsyntax-only``),
    each source once per process."""
    if source in _as_checked:
        return _as_checked[source]
    try:
        import clang.cindex as ci
    except ImportError:
        return None
    text = clcpp_source(source)
    tu = ci.Index.create().parse(
        "kernel.clcpp", unsaved_files=[("kernel.clcpp", text)],
        args=["-x", "clcpp", "-cl-std=clc++1.0", "-cl-ext=+cl_khr_fp16", "-cl-no-stdinc", "-fsyntax-only",
              f"-I{HERE}", "-Wno-unknown-attributes", "-ferror-limit=8"])
    lines = text.splitlines()
    problems = []
    for d in tu.diagnostics:
        if d.severity < ci.Diagnostic.Error:
            continue
        loc = d.location
        here = loc.file is not None and loc.file.name == "kernel.clcpp" and 0 < loc.line <= len(lines)
        where = lines[loc.line - 1].strip() if here else f"{loc.file}:{loc.line}"
        problems.append(f"{loc.line}: {d.spelling} | {where}")
    _as_checked[source] = problems
    return problems


class SimKernel:
    """An ``mx.fast.metal_kernel`` whose calls run on the CPU through the checker."""

    def __init__(self, real_factory, name, input_names, output_names, source, header="",
                 ensure_row_contiguous=True, atomic_outputs=False):
        self.real = real_factory(name=name, input_names=input_names, output_names=output_names,
                                 source=source, header=header, ensure_row_contiguous=ensure_row_contiguous,
                                 atomic_outputs=atomic_outputs)
        self.name, self.input_names, self.output_names = name, list(input_names), list(output_names)
        self.header = header
        self.calls = 0
        self.origin = "?"  # the module that built it (set by simulated())

    def __call__(self, *, inputs, template=None, grid, threadgroup, output_shapes, output_dtypes,
                 init_value=None, verbose=False, stream=None):
        arrays = [x if isinstance(x, mx.array) else mx.array(x) for x in inputs]
        mx.eval(arrays)
        call = dict(template=template or [], grid=tuple(grid), threadgroup=tuple(threadgroup),
                    output_shapes=[tuple(s) for s in output_shapes], output_dtypes=list(output_dtypes))
        if init_value is not None:
            call["init_value"] = init_value
        source = generated_source(self.real, call, arrays)
        text, params = _program(source)
        exe = _build(text)
        problems = address_space_problems(source)
        if problems:  # (metal_clcpp.h declares what metal_shim.h defines: a gap there shows here too)
            raise MetalCheckError(f"{self.name}: address spaces (the source read as C++ for OpenCL):\n"
                                  + "\n".join(problems))
        return self._run(exe, params, arrays, call, init_value)

    def _run(self, exe, params, arrays, call, init_value):
        self.calls += 1
        by_name = dict(zip(self.input_names, arrays))
        outs = {n: (tuple(s), dt) for n, s, dt in zip(self.output_names, call["output_shapes"],
                                                       call["output_dtypes"])}
        d = Path(tempfile.mkdtemp(prefix="mqf-run-"))
        try:
            manifest, order = [], []
            for ctype, name, attr, index in sorted((p for p in params if p[2] == "buffer"), key=lambda p: p[3]):
                if name in by_name:
                    data = to_bytes(by_name[name])
                elif name in outs:
                    shape, dt = outs[name]
                    n = int(np.prod(shape)) * dt.size
                    if init_value is None:
                        data = b"\xff" * n
                    else:
                        data = to_bytes(mx.full(shape, init_value, dt))
                elif name.endswith(("_shape", "_strides", "_ndim")):
                    base, kind = name.rsplit("_", 1)
                    x = by_name[base]
                    strides = [int(np.prod(x.shape[i + 1:])) for i in range(x.ndim)]
                    vals = {"shape": list(x.shape), "strides": strides, "ndim": [x.ndim]}[kind]
                    dt = np.int64 if "int64" in ctype else np.int32
                    data = np.array(vals or [0], dtype=dt).tobytes()
                else:
                    raise MetalCheckError(f"buffer parameter {name!r} matches no input or output")
                (d / f"{len(order)}.bin").write_bytes(data)
                manifest.append(f"{name} {len(data)}")
                order.append(name)
            (d / "manifest").write_text("\n".join(manifest) + "\n")
            g, t = call["grid"], call["threadgroup"]
            written = []
            for schedule in SCHEDULES:
                r = subprocess.run([str(exe), str(d), *map(str, g), *map(str, t), str(schedule)],
                                   capture_output=True, text=True, timeout=600)
                if r.returncode != 0:
                    raise MetalCheckError(f"{self.name}: " + (r.stderr.strip() or f"exit code {r.returncode}"))
                written.append({n: (d / f"{order.index(n)}.out").read_bytes() for n in self.output_names})
            for n in self.output_names:
                if any(w[n] != written[0][n] for w in written[1:]):
                    raise MetalCheckError(
                        f"{self.name}: output '{n}' depends on the order threads run in (schedules "
                        f"{SCHEDULES}): a thread reads memory another writes with no barrier between")
            return [from_bytes(written[0][n], *outs[n]) for n in self.output_names]
        finally:
            shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def simulated_modules(*names: str):
    """:func:`simulated`, with the modules ``names`` reloaded inside (their
    kernels built at import become SimKernels) and again after
    (the real kernels back). Yields the modules."""
    import importlib

    mods = [importlib.import_module(n) for n in names]
    try:
        with simulated():
            yield [importlib.reload(m) for m in mods]
    finally:
        for m in mods:
            importlib.reload(m)


@contextlib.contextmanager
def simulated():
    """Within: ``mx.fast.metal_kernel(...)`` builds SimKernels.
    Yields the list of kernels built (for call counts); each kernel's
    ``origin`` is the ``__name__`` of the module whose code called
    ``mx.fast.metal_kernel`` (e.g. ``"mlx_lm.models.gated_delta"``)."""
    real = mx.fast.metal_kernel
    built: List[SimKernel] = []

    def factory(origin, **kw):
        k = SimKernel(real, **kw)
        k.origin = origin
        built.append(k)
        return k

    def metal_kernel(name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                     atomic_outputs=False):
        origin = sys._getframe(1).f_globals.get("__name__", "?")
        return factory(origin, name=name, input_names=input_names, output_names=output_names, source=source,
                       header=header, ensure_row_contiguous=ensure_row_contiguous, atomic_outputs=atomic_outputs)

    is_available = mx.metal.is_available
    mx.fast.metal_kernel = metal_kernel
    mx.metal.is_available = lambda: True  # modules that build their kernels only "on Metal"
    try:
        yield built
    finally:
        mx.fast.metal_kernel = real
        mx.metal.is_available = is_available
