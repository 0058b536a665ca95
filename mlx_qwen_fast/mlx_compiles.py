"""MLX's run-time compiles of a model's first use, ahead of time and in parallel.

On CUDA, MLX compiles some of its kernels with NVRTC the first time a
process needs them, one after another, in the thread that evaluates the
graph, and keeps each in its compile cache (``MLX_PTX_CACHE_DIR``, one
``<module>.ptx`` with its ``.txt`` kernel list per module): its quantised
matmuls (a module per tile class of rows, bit width, group size and mode:
tens of seconds each), its gathers and scatters (a module per dtype pair).
A first ``generate`` of the reference model on a fresh machine waited for
them in turn: minutes before its first token (bench/results/
package-figures.md, "First use", with and without the workers).

:func:`start` compiles those modules in worker processes at once, while the
calling process imports mlx-lm and loads the checkpoint: each worker runs
one :class:`Job` -- a few MLX ops at shapes that make MLX build the modules
a first use needs (:func:`jobs_for`, from the checkpoint's ``config.json``:
its quantisation classes and dtype) -- into a compile cache of its own;
each worker's files are published into the shared cache when it ends (the
kernel list before the PTX, each by an atomic rename: MLX reads and writes
that folder without locks, and a file it finds must be whole), and
:meth:`Ahead.wait` waits for them all.
A worker that fails or runs out of time only means that the caller compiles
that module itself, as it would have. The job list follows MLX 0.32's
dispatch (``mlx/backend/cuda/quantized/quantized.cpp``: rows below 8 take
the precompiled GEMV; else ``qmm_sm80`` for 4/8-bit weights whose outputs
are a multiple of 128 and ``qmm_naive`` otherwise, the tile's rows the next
power of two of the rows in [16, 64]; gathers keyed by value and index
dtype); the fused elementwise kernels of ``mx.compile`` and this package's
own kernels (quick to build) are not among them.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from . import config

__all__ = ["Ahead", "Job", "done_line", "done_marker", "jobs_for", "quantization_classes", "run_job", "start", "started_line", "worker_count"]

#: Rows of the quantised matmuls the jobs run: one per tile class of MLX's
#: ``qmm_sm80`` / ``qmm_naive`` (64: prompts of 33 tokens or more below the
#: package's prefill GEMM, and the projections it leaves to MLX; 32; 16).
QMM_ROWS = (64, 32, 16)
#: Seconds a worker may take before it is stopped, several times the slowest
#: module's compile (bench/results/package-figures.md, "First use"): the most
#: a first use waits after loading for modules it would otherwise compile
#: itself, one after another.
WORKER_TIMEOUT_S = 120.0
#: Host memory a worker may take while NVRTC compiles a quantised matmul
#: (bytes), for :func:`worker_count`.
WORKER_HOST_BYTES = 3 << 30


@dataclass(frozen=True)
class Job:
    """One worker's work: ``ops`` run in order (each a dict for
    :func:`run_op`), named for the messages."""

    name: str
    ops: Tuple[dict, ...]


def quantization_classes(config: dict) -> List[Tuple[int, int, str]]:
    """The distinct ``(bits, group_size, mode)`` of a checkpoint's
    ``config.json`` ``quantization`` entry (the global one and every
    per-layer dict, as ``mlx_lm.convert`` writes them), sorted; empty for an
    unquantised checkpoint."""
    q = config.get("quantization") or config.get("quantization_config")
    if not isinstance(q, dict) or "quant_method" in q:  # quant_method: another library's (GPTQ, AWQ, ...)
        return []
    found = set()
    for entry in [q] + [v for v in q.values() if isinstance(v, dict)]:
        bits, gs = entry.get("bits", q.get("bits")), entry.get("group_size", q.get("group_size"))
        mode = entry.get("mode", q.get("mode", "affine"))
        if type(bits) is int and type(gs) is int and isinstance(mode, str):
            found.add((bits, gs, mode))
    return sorted(found)


def _dtype_of(config: dict) -> str:
    """The checkpoint's activation dtype: its text config's ``dtype`` /
    ``torch_dtype``, else the top level's, else bfloat16."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for c in (text, config):
        for key in ("dtype", "torch_dtype"):
            if c.get(key) in ("bfloat16", "float16", "float32"):
                return c[key]
    return "bfloat16"


def jobs_for(config: dict, dtype: Optional[str] = None) -> List[Job]:
    """The jobs a first use of a checkpoint with ``config`` (its parsed
    ``config.json``) needs compiled, in activations of ``dtype`` (default
    the checkpoint's; "bfloat16", "float16" or "float32").

    First the gathers and scatters by int32 and by uint32 ids (the
    embedding's ``take``, the router's ``take_along_axis``, the KV rows'
    ``put_along_axis``: every first use needs them); then, per affine
    quantisation class and tile class of rows (:data:`QMM_ROWS`, the class
    of most prompts first), a quantised matmul whose outputs are a multiple
    of 128 and, for 4 and 8 bits in 16-bit activations, one whose outputs
    are not (MLX's two kernels). The experts' stock ``gather_qmm`` (one row per assignment)
    builds the 16-row class's module, so it needs no job of its own
    (bench/results/package-figures.md, "First use"). Other quantisation
    modes (mxfp4, nvfp4) take MLX's other kernels and get no job."""
    dtype = dtype or _dtype_of(config)
    jobs: List[Job] = []
    for ids in ("int32", "uint32"):
        jobs.append(Job(f"gathers by {ids} ids", (
            dict(op="take", dtype=dtype, index_dtype=ids), dict(op="take", dtype="uint32", index_dtype=ids),
            dict(op="take_along_axis", dtype=dtype, index_dtype=ids),
            dict(op="put_along_axis", dtype=dtype, index_dtype=ids))))
    classes = [c for c in quantization_classes(config) if c[2] == "affine"]
    for rows in QMM_ROWS:
        for bits, gs, mode in classes:
            base = dict(op="quantized_matmul", rows=rows, k=4 * max(64, gs), bits=bits, group_size=gs, mode=mode,
                        dtype=dtype)
            jobs.append(Job(f"quantized matmul {bits}-bit g{gs}, {rows} rows", (dict(base, n=128),)))
            if bits in (4, 8) and dtype != "float32":  # qmm_sm80 takes 16-bit activations only
                jobs.append(Job(f"quantized matmul {bits}-bit g{gs}, {rows} rows, 64 outputs", (dict(base, n=64),)))
    return jobs


def run_op(op: dict) -> None:
    """Evaluate one op of a :class:`Job` on zeros of its shapes (the
    compile is the point; the values are not read).

    Raises:
        ValueError: an unknown ``op["op"]``.
    """
    import mlx.core as mx

    kind, dt = op["op"], getattr(mx, op.get("dtype", "bfloat16"))
    if kind == "quantized_matmul":
        w, s, b = mx.quantize(mx.zeros((op["n"], op["k"]), dt), group_size=op["group_size"], bits=op["bits"],
                              mode=op["mode"])
        out = mx.quantized_matmul(mx.zeros((op["rows"], op["k"]), dt), w, s, b, transpose=True,
                                  group_size=op["group_size"], bits=op["bits"], mode=op["mode"])
    elif kind == "take":
        out = mx.take(mx.zeros((64, 8), getattr(mx, op["dtype"])), mx.zeros((4,), getattr(mx, op["index_dtype"])),
                      axis=0)
    elif kind == "take_along_axis":
        out = mx.take_along_axis(mx.zeros((4, 64), dt), mx.zeros((4, 8), getattr(mx, op["index_dtype"])), axis=-1)
    elif kind == "put_along_axis":
        out = mx.put_along_axis(mx.zeros((1, 2, 64, 8), dt), mx.zeros((1, 1, 1, 1), getattr(mx, op["index_dtype"])),
                                mx.ones((1, 2, 1, 8), dt), axis=2)
    else:
        raise ValueError(f"run_op: unknown op {kind!r}")
    mx.eval(out)


def run_job(job: Job) -> None:
    """Run every op of ``job`` in this process (the worker's body)."""
    for op in job.ops:
        run_op(op)


def worker_count(n_jobs: int) -> int:
    """Workers to run ``n_jobs`` with: one per job, at most one fewer than
    the CPUs and as many as the host memory holds at
    :data:`WORKER_HOST_BYTES` each (at least 1)."""
    cpus = os.cpu_count() or 2
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 16 << 30
    return max(1, min(n_jobs, cpus - 1, ram // WORKER_HOST_BYTES))


def _publish(private: Path, cache: Path) -> List[str]:
    """Move a worker's modules into ``cache`` (``private`` is a folder
    inside it: the same file system): for each ``<module>.ptx``, the
    ``.cu`` and ``.txt`` first, the ``.ptx`` last, each by an atomic rename;
    a module ``cache`` already holds is left alone. Only for a worker that
    exited with code 0: MLX writes a module's ``.txt`` last, so a worker
    stopped inside that write leaves a module MLX would read as having no
    kernels. Returns the modules published."""
    done = []
    for ptx in sorted(private.glob("*.ptx")):
        if (cache / ptx.name).exists():
            continue
        for ext in (".cu", ".txt", ".ptx"):
            src = ptx.with_suffix(ext)
            if src.exists():
                os.replace(src, cache / src.name)
        done.append(ptx.stem)
    return done


_ROOT_PREFIX = ".mqf-ahead-"  # + the parent's pid + "-": the workers' folders inside the cache


def _remove_stale_roots(cache: Path) -> None:
    """Remove the workers' folders that a process no longer running left in
    ``cache`` (one killed before it could remove them)."""
    for d in cache.glob(_ROOT_PREFIX + "*"):
        try:
            pid = int(d.name[len(_ROOT_PREFIX):].split("-", 1)[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except (ValueError, OSError):  # not ours, or a live process of another user
            continue


def _last_line(path: Path) -> str:
    """The last non-empty line of the file's last 4 KB ("" when none)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1][:200] if lines else ""


class Ahead:
    """Workers compiling a first use's MLX modules (made by :func:`start`).

    At most :func:`worker_count` run at once, started and watched by a
    daemon thread; each worker's modules are published as soon as it exits
    with code 0. The workers are stopped and their folders removed by
    :meth:`close`, which also runs when the process exits normally (a load
    error, Ctrl-C); a worker whose parent dies otherwise is killed by the
    kernel (Linux: ``PR_SET_PDEATHSIG``, set by :func:`main`), and a later
    :func:`start` removes the folders such a parent left.

    ``marker``: a file written when every job ran to its end (:func:`done_marker`:
    :func:`start` does not start them again for that configuration).

    Raises:
        OSError: the workers' folder cannot be made in ``cache``.
    """

    def __init__(self, jobs: Sequence[Job], cache: Path, *, timeout_s: float = WORKER_TIMEOUT_S,
                 command: Optional[Sequence[str]] = None, marker: Optional[Path] = None):
        self.jobs, self.cache, self.timeout_s, self.marker = list(jobs), Path(cache), timeout_s, marker
        self.workers = worker_count(len(self.jobs))
        self._command = list(command) if command is not None else [sys.executable, "-m", __name__, "--job"]
        self._root = Path(tempfile.mkdtemp(prefix=f"{_ROOT_PREFIX}{os.getpid()}-", dir=self.cache))
        self._lock = threading.Lock()
        self._running: Dict[int, Tuple[subprocess.Popen, float]] = {}
        self._closed = False
        self._done = threading.Event()
        self.published: List[str] = []
        self.failed: List[str] = []
        self._finished = 0  # jobs done (published or failed)
        self.t0 = time.perf_counter()
        atexit.register(self.close)
        self._thread = threading.Thread(target=self._schedule, name="mqf-ahead", daemon=True)
        self._thread.start()

    def _launch(self, i: int) -> None:
        job = self.jobs[i]
        private = self._root / str(i)
        env = config.child_environment(**{config.MLX_PTX_CACHE.name: str(private)})
        spec = json.dumps({"name": job.name, "ops": list(job.ops), "parent": os.getpid()})
        try:
            private.mkdir()
            with open(private / "stderr.txt", "wb") as err:  # a file: a pipe nobody reads could fill
                proc = subprocess.Popen(self._command + [spec], env=env, stdout=subprocess.DEVNULL, stderr=err)
        except (OSError, ValueError, TypeError) as e:  # TypeError: no sys.executable
            self._finish(i, f"not started: {e}")
            return
        with self._lock:
            if self._closed:  # close() ran while it started: its snapshot missed this one
                proc.kill()
                proc.wait()
                return
            self._running[i] = (proc, time.perf_counter())

    def _finish(self, i: int, why: Optional[str]) -> None:
        private = self._root / str(i)
        done = []
        if why is None and not self._closed:
            try:
                done = _publish(private, self.cache)
            except OSError:  # the cache folder gone or not writable: the caller compiles them itself
                why = "not published"
        with self._lock:
            self.published += done
            self._finished += 1
            if why is not None:
                self.failed.append(f"{self.jobs[i].name} ({why})")
        shutil.rmtree(private, ignore_errors=True)

    def _schedule(self) -> None:
        try:
            queue = list(range(len(self.jobs)))
            while (queue or self._running) and not self._closed:
                while queue and len(self._running) < self.workers and not self._closed:
                    self._launch(queue.pop(0))
                for i, (proc, t_start) in list(self._running.items()):
                    rc, why = proc.poll(), None
                    if rc is None:
                        if time.perf_counter() - t_start < self.timeout_s:
                            continue
                        proc.kill()
                        proc.wait()
                        why = f"stopped after {self.timeout_s:g} s"
                    elif rc != 0:
                        last = _last_line(self._root / str(i) / "stderr.txt")
                        why = f"exit code {rc}" + (f": {last}" if last else "")
                    with self._lock:
                        self._running.pop(i, None)
                    self._finish(i, why)
                time.sleep(0.05)
        finally:
            self._done.set()

    def wait(self) -> Dict:
        """Wait for every worker (each stops at ``timeout_s``), remove their
        folders. Returns ``{"seconds", "published", "failed"}``: seconds
        since the start, the modules published, each failed job's name with
        the reason."""
        self._done.wait()
        self.close()
        with self._lock:
            r = {"seconds": round(time.perf_counter() - self.t0, 1), "published": sorted(self.published),
                 "failed": list(self.failed)}
        # every job ran to its end: a failed one would fail again (its module compiles in the caller,
        # as without the workers), so later processes do not wait for workers on each load
        if self.marker is not None and self._finished == len(self.jobs):
            try:
                self.marker.write_text(json.dumps({"jobs": [j.name for j in self.jobs], "failed": r["failed"]}))
            except OSError:
                pass
        return r

    def close(self) -> None:
        """Stop the workers still running (their modules unpublished), wait
        for the scheduler, remove the workers' folders. Idempotent."""
        with self._lock:
            self._closed = True
            running = [p for p, _ in self._running.values()]
        for proc in running:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        shutil.rmtree(self._root, ignore_errors=True)
        atexit.unregister(self.close)


def done_marker(model_path) -> Optional[Path]:
    """The file that says the workers compiled a first use's modules of
    ``model_path``'s configuration into the current compile cache (written
    by :func:`start`'s workers when every job ran to its end), or None without a
    known cache folder."""
    from .warmup import marker_path

    m = marker_path(model_path)
    return None if m is None else m.with_name(m.name + "-ahead")


def started_line(ahead: Ahead, while_loading: bool) -> str:
    """The line the CLIs and ``mlx_lm.load`` print when they start ``ahead``."""
    when = " while it loads" if while_loading else ""
    return (f"mlx_qwen_fast: first use of this model on this machine: {len(ahead.jobs)} of MLX's CUDA kernel "
            f"modules compile in {ahead.workers} processes{when} (once per machine)")


def done_line(result: Dict) -> str:
    """The line they print with :meth:`Ahead.wait`'s ``result``."""
    failed = f"; not done: {', '.join(result['failed'])}" if result["failed"] else ""
    return (f"mlx_qwen_fast: {len(result['published'])} MLX kernel modules compiled ahead, {result['seconds']} s "
            f"since the start{failed}")


def start(model_path, dtype: Optional[str] = None) -> Optional[Ahead]:
    """Start the workers for a first use of ``model_path`` (a checkpoint
    folder), or return None where there is nothing to do: not on CUDA, no
    known compile cache folder (``MLX_PTX_CACHE_DIR`` unset), the model
    already warmed up into it (:func:`mlx_qwen_fast.warmup.is_warm`) or its
    modules compiled by earlier workers (:func:`done_marker`), no
    readable ``config.json``, no job for its quantisation, or a cache
    folder that cannot be written."""
    from . import backend
    from .warmup import is_warm

    cache = config.mlx_ptx_cache_dir()
    if backend.current() != backend.CUDA or not cache or is_warm(model_path) or done_marker(model_path).is_file():
        return None
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    jobs = jobs_for(cfg, dtype) if isinstance(cfg, dict) else []
    if not jobs:
        return None
    try:
        Path(cache).mkdir(parents=True, exist_ok=True)
        _remove_stale_roots(Path(cache))
        return Ahead(jobs, Path(cache), marker=done_marker(model_path))
    except OSError:  # a cache folder that cannot be written: MLX compiles as it would (and caches nothing)
        return None


def _die_with_parent(parent: Optional[int]) -> None:
    """Linux: have the kernel kill this worker when its parent (pid
    ``parent``) dies, since a SIGTERM or SIGKILL skips the parent's
    clean-up; exit at once if it already has. Elsewhere nothing."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent is not None and os.getppid() != parent:  # it died before the call took effect
        sys.exit(1)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog=f"python -m {__name__}", description="a worker of mlx_qwen_fast.mlx_compiles")
    p.add_argument("--job", required=True, help="a Job as JSON ({'name', 'ops', 'parent'})")
    args = p.parse_args(argv)
    spec = json.loads(args.job)
    _die_with_parent(spec.get("parent"))
    run_job(Job(spec["name"], tuple(spec["ops"])))


if __name__ == "__main__":
    main(sys.argv[1:])
