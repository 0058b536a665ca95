"""What a user measures: mlx-lm's own ``benchmark`` command, stock vs patched.

Every speed claim of the project comes from this script. It

1. writes a random-weight checkpoint with the package's CLI
   (``python -m mlx_qwen_fast.checkpoint --preset P --out DIR --seed N
   --router-skew S``), or reuses the one already in ``DIR`` when its marker
   file (:data:`MARKER`, written beside the weights once the CLI has finished)
   names the same preset, seed and router skew and every weight file still
   has the size recorded there; ``--model DIR`` benchmarks an existing
   checkpoint instead and writes nothing;
2. runs ``python -m mlx_qwen_fast benchmark --model DIR -p P -g G -b B -n N``
   (mlx-lm's ``mlx_lm.benchmark`` on the patched model) and the same command
   with ``--stock`` (plain mlx-lm), each in a fresh process, ``--processes``
   processes per engine and configuration, alternating: with the default
   ``--order stock-first`` each pair is stock then patched (``abba``: stock
   first in even pairs, patched first in odd ones). mlx-lm runs one warm-up
   generation (which absorbs MLX's one-time JIT compilation and the
   package's kernel builds) and then ``-n`` timed trials, printing
   ``Trial i:  prompt_tps=..., generation_tps=..., peak_memory=...,
   total_time=...`` per trial and ``Averages: ...`` at the end;
3. parses each process's output into one record (:func:`parse_benchmark_output`)
   and writes the result JSON after every process (a device call cut short
   keeps what finished); last it prints a table per configuration and
   engine: median and min-max over the processes of prompt and generation
   tok/s, peak memory, and the patched/stock ratio of the medians.

What the numbers mean (mlx-lm's definitions): ``prompt_tps`` = prompt tokens
of all ``B`` sequences / the prefill's seconds (up to the first generated
token); ``generation_tps`` = generated tokens of all sequences / the decode's
seconds (``B`` > 1 runs ``batch_generate``, whose rates are aggregates over
the batch); ``peak_memory`` = ``mx.get_peak_memory()`` in GB (1e9 B) since the
process started, weights included. A record's ``prompt_tps`` and
``generation_tps`` are the mean over its trials (mlx-lm's ``Averages``),
``peak_memory_gb`` the largest trial value.

Configurations (``--configs``, comma-separated; default ``b1,b4,32k,128k``):

=======  ============  ==========  =====  ===============
name     prompt        generated   batch  engines
=======  ============  ==========  =====  ===============
b1       4096          128         1      stock, patched
b4       4096          128         4      stock, patched
32k      32768         128         1      patched (stock cannot finish in time)
128k     131072        128         1      patched
=======  ============  ==========  =====  ===============

An entry may also be written ``PxGxB[:engines]`` (``8kx128x1:patched``,
engines joined by ``+``), or the cross product of ``--prompt``, ``--gen`` and
``--batch`` lists given instead of ``--configs`` (lengths as ``4096``, ``4k``,
``32K``). ``--engines`` restricts every configuration to those engines.

Process records (``runs``): ``config``, ``engine`` ("stock" | "patched"),
``prompt_tokens``, ``generation_tokens``, ``batch_size``, ``num_trials``,
``process`` (index within its configuration and engine), ``order`` (position
in the whole file's run sequence), ``first_in_pair``, ``status`` ("ok",
"timeout", "oom", "error"), ``prompt_tps``, ``generation_tps``,
``peak_memory_gb`` (null when no trial finished), ``trials`` (per trial:
``prompt_tps``, ``generation_tps``, ``peak_memory_gb``, ``total_time_s``),
``mlx_averages`` (the ``Averages`` line), ``wall_s``, ``startup_s`` (start to
"Running warmup..": import + load), ``warmup_s``, ``rc``, ``timeout_s``,
``budget_clipped``, ``error``, ``stderr_tail``, ``patch_line`` (the patched
CLI's one-line report of what it swapped), ``cmd``, ``commit``,
``invocation``. Top level: :func:`bench.common.result_header`'s keys (of the
latest invocation, taken in a child process so that this one never imports
the package or touches the GPU), ``preset``, ``seed``, ``router_skew``,
``model`` (the checkpoint folder), ``checkpoint`` (written or reused, seconds),
``num_trials``, ``configs``, ``invocations`` (date, commit, arguments of each
call that added to the file), ``summary`` (the printed table's rows).

Child processes get this process's environment as it was when the module
was imported, with ``PYTHONUNBUFFERED=1`` and the repository root prepended
to ``PYTHONPATH``: MLX's compile cache (``MLX_PTX_CACHE_DIR``) and the
package's (``MLX_QWEN_FAST_CACHE``) are inherited, so a warm machine's caches
are reused. ``MLX_QWEN_FAST=0`` (or another off value) is refused: the
"patched" processes would run stock.

Status per process: "timeout" when it passed ``--timeout`` seconds (or what
was left of ``--budget-s``; ``budget_clipped`` says which) and was killed;
"oom" when stdout/stderr show an allocation failure (also after a timeout:
MLX's CUDA backend can hang after one), or when the process died of SIGKILL
that this script did not send (Linux's OOM killer); "error" for any other
non-zero exit, or an exit 0 with fewer trial lines than asked for (truncated
output); else "ok". ``stderr_tail`` keeps the last lines of stderr. Each
child runs in its own session; when this script is interrupted (Ctrl-C, or
SIGTERM from ``timeout``) it kills the running child's process group first.

Resuming (``--resume FILE``): reads FILE (same preset, seed, router skew and
``-n`` required), skips every (configuration, engine, process) that already
has an "ok" record there, reruns the rest, and writes the merged result back
to FILE (or ``--out``). With ``--budget-s S`` no process is started that is
not expected to finish within S seconds of the start (expected: the
shortest earlier "ok" wall time of the same configuration and engine in the
file, else the H200 model below), and each process's timeout is clipped to
what is left; what is not run is left for the next ``--resume``. Exit code 0:
every planned process ran and is "ok"; 1: some are not "ok"; 3: some were
left for a resume (budget). ``--plan`` prints the plan with the model's H200
seconds per process and runs nothing.

    python -m bench.user_view --preset qwen3.6-35b-a3b --checkpoint /tmp/uv-ckpt \\
        --configs b1 --out /tmp/out/user_view.json --budget-s 540
    python -m bench.user_view --preset qwen3.6-35b-a3b --checkpoint /tmp/uv-ckpt \\
        --configs b4,32k,128k --resume /tmp/out/user_view.json --budget-s 540
    python -m bench.user_view --preset tiny --checkpoint /tmp/uv-tiny \\
        --prompt 32 --gen 4 --batch 1 --processes 1 -n 1 --out /tmp/uv.json

Runtime of the default sweep on an H200 (estimated from measured parts: the
full checkpoint writes in ~42 s; a fresh process spends ~11 s importing
(transformers pulls in torch) and ~8 s loading the 19 GB model; stock prefills
~300 tok/s and decodes ~53 tok/s at 4K; patched prefills ~13,000 tok/s at
4K, ~11,600 at 32K, ~6,300 at 128K and decodes ~110-160 tok/s at 4K (60.6 at
128K context, README); the first stock process on a fresh machine spends
~170 s more in MLX's JIT compilation, cached afterwards in MLX's PTX cache;
``bench.first_use``: the patched CLI alone on empty caches spends ~150 s
there). Per process, with the default ``-n 2`` (warm-up + 2 trials = 3
generations) and 4K prompts: stock b1 19 + 3 x (13.7 + 2.4) = ~67 s;
patched b1 19 + 3 x (0.3 + 1.2) = ~24 s. Stock b4 is not measured: if its
per-token GDN loop runs the 4 sequences in the time of one (plus ~7 s of
``gather_qmm`` for 16K tokens) ~90 s per process, if its prefill time
grows linearly with the batch ~190 s; patched b4 ~27 s. Patched 32K:
19 + 3 x (2.8 + 1.2) = ~31 s; 128K: 19 + 3 x (20.8 + 2.1) = ~88 s. With 3
processes per engine:

* b1: 3 x 67 + 3 x 24 = ~275 s, + 42 s checkpoint + 170 s stock JIT on a
  fresh machine (+ the patched engine's own first-use compiles, assumed
  ~30 s once stock has filled the shared cache) = ~520 s;
* b4: ~350 s (batch-parallel stock) to ~650 s (linear), + 42 + 170 on a fresh
  machine;
* 32k + 128k: 3 x 31 + 3 x 88 = ~360 s, + 42 s checkpoint + ~150 s of the
  patched engine's first-use compiles on a fresh machine;
* all on one warm machine: ~1,000-1,300 s of benchmark processes.

``--plan`` prints this model's figures for any plan (:func:`estimate_process_s`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from . import common

REPO_ROOT = Path(__file__).resolve().parents[1]

#: The environment as it was when this module was imported: the base of
#: every child's environment (before anything here could import the package,
#: whose import sets MLX variables in its own process on CUDA).
_ENV_AT_IMPORT: Dict[str, str] = dict(os.environ)

ENGINES = ("stock", "patched")
ORDERS = ("stock-first", "patched-first", "abba")

#: Marker file written into a checkpoint folder by :func:`ensure_checkpoint`.
MARKER = "user_view_checkpoint.json"

#: Lines of stderr kept in a process record.
STDERR_TAIL_LINES = 30

_OFF_VALUES = ("0", "false", "no", "off")


# ---------------------------------------------------------------------------
# Configurations and the plan
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    """One benchmark configuration: ``-p``, ``-g``, ``-b`` and the engines run."""

    name: str
    prompt_tokens: int
    generation_tokens: int
    batch_size: int
    engines: Tuple[str, ...]

    @property
    def key(self) -> Tuple[int, int, int]:
        """``(prompt_tokens, generation_tokens, batch_size)``."""
        return (self.prompt_tokens, self.generation_tokens, self.batch_size)


NAMED_CONFIGS: Dict[str, Config] = {
    "b1": Config("b1", 4096, 128, 1, ENGINES),
    "b4": Config("b4", 4096, 128, 4, ENGINES),
    "32k": Config("32k", 32768, 128, 1, ("patched",)),
    "128k": Config("128k", 131072, 128, 1, ("patched",)),
}
DEFAULT_CONFIGS = "b1,b4,32k,128k"


def config_name(prompt: int, gen: int, batch: int) -> str:
    """Label of an explicit configuration, e.g. ``"p4K-g128-b1"``."""
    return f"p{common.fmt_len(prompt)}-g{gen}-b{batch}"


def _engines_arg(text: str) -> Tuple[str, ...]:
    names = tuple(e.strip() for e in re.split(r"[,+]", text) if e.strip())
    bad = [e for e in names if e not in ENGINES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"engines must be among {ENGINES}, got {text!r}")
    return tuple(e for e in ENGINES if e in names)


def parse_configs(text: str) -> List[Config]:
    """``"b1,b4,8kx128x1:patched"`` -> the :class:`Config` list, in order.

    Entries are names of :data:`NAMED_CONFIGS` or ``PxGxB`` (lengths as
    accepted by :func:`bench.common.parse_lengths`) with an optional
    ``:engine[+engine]`` suffix (default both engines).

    Raises:
        argparse.ArgumentTypeError: an unknown name or a malformed entry.
    """
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if part.lower() in NAMED_CONFIGS:
            out.append(NAMED_CONFIGS[part.lower()])
            continue
        spec, _, engines = part.partition(":")
        fields = spec.lower().split("x")
        if len(fields) != 3:
            raise argparse.ArgumentTypeError(
                f"configuration {part!r}: a name of {sorted(NAMED_CONFIGS)} or PxGxB[:engines]")
        try:
            p, g, b = (common.parse_lengths(f)[0] if f else None for f in fields)
        except (ValueError, IndexError, argparse.ArgumentTypeError):
            p = g = b = None
        if not (p and g and b):
            raise argparse.ArgumentTypeError(f"configuration {part!r}: P, G and B must be >= 1")
        out.append(Config(config_name(p, g, b), p, g, b,
                          _engines_arg(engines) if engines else ENGINES))
    if not out:
        raise argparse.ArgumentTypeError("no configuration given")
    return out


def explicit_configs(prompts: Sequence[int], gens: Sequence[int], batches: Sequence[int],
                     engines: Sequence[str] = ENGINES) -> List[Config]:
    """The cross product of prompt lengths x generated tokens x batch sizes
    (prompt outermost), each run on ``engines``."""
    return [Config(config_name(p, g, b), p, g, b, tuple(engines))
            for p in prompts for g in gens for b in batches]


@dataclasses.dataclass(frozen=True)
class Job:
    """One planned process: a configuration, an engine, its process index
    (within that configuration and engine) and whether it opens its pair."""

    config: Config
    engine: str
    process: int
    first_in_pair: bool

    @property
    def key(self) -> Tuple[int, int, int, str, int]:
        return (*self.config.key, self.engine, self.process)


def build_plan(configs: Sequence[Config], processes: int, order: str = "stock-first") -> List[Job]:
    """Every process to run, in run order: configuration by configuration,
    ``processes`` pairs each; in a pair the engines alternate as ``order``
    says (:data:`ORDERS`); a one-engine configuration runs its processes in a row.

    Raises:
        ValueError: ``processes < 1`` or an unknown ``order``.
    """
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    plan = []
    for cfg in configs:
        for i in range(processes):
            engines = list(cfg.engines)
            if order == "patched-first" or (order == "abba" and i % 2 == 1):
                engines.reverse()
            for j, e in enumerate(engines):
                plan.append(Job(cfg, e, i, j == 0))
    return plan


# ---------------------------------------------------------------------------
# Time model (H200)
# ---------------------------------------------------------------------------

#: Measured H200 figures (see the module docstring) behind :func:`estimate_process_s`.
H200 = {
    "import_s": 11.0,
    "load_s": 8.0,
    "checkpoint_s": 42.0,
    "stock_jit_s": 170.0,
    "patched_jit_s": 150.0,  # patched alone on empty caches (bench.first_use)
    "patched_jit_after_stock_s": 30.0,  # assumed, not measured
    "stock_prefill_tps": {4096: 300.0, 8192: 214.0},
    "stock_decode_tps": {4096: 53.0, 131072: 28.3},
    "patched_prefill_tps": {256: 3320.0, 4096: 13000.0, 32768: 11600.0, 131072: 6300.0},
    "patched_decode_tps": {4096: 110.0, 131072: 60.6},
}


def _interp_log(table: Mapping[int, float], n: int) -> float:
    """Value of ``table`` (length -> rate) at ``n``, linear in log(length),
    clamped at both ends."""
    xs = sorted(table)
    if n <= xs[0]:
        return table[xs[0]]
    if n >= xs[-1]:
        return table[xs[-1]]
    for a, b in zip(xs, xs[1:]):
        if a <= n <= b:
            t = (math.log(n) - math.log(a)) / (math.log(b) - math.log(a))
            return table[a] + t * (table[b] - table[a])
    return table[xs[-1]]


def estimate_process_s(prompt: int, gen: int, batch: int, engine: str, trials: int, *,
                       jit_s: float = 0.0, facts: Mapping = H200) -> float:
    """Seconds one benchmark process of the full model takes on an H200.

    import + load, then (1 warm-up + ``trials``) generations of prefill
    (``batch * prompt`` tokens at the engine's rate for that length: linear
    in the batch, an upper bound) + decode (``gen`` steps at the engine's
    single-sequence rate: a step of ``batch`` sequences assumed to cost one
    step), + ``jit_s`` of first-use compilation.
    """
    prefill = facts[f"{engine}_prefill_tps"]
    decode = facts[f"{engine}_decode_tps"]
    one = batch * prompt / _interp_log(prefill, prompt) + gen / _interp_log(decode, prompt)
    return facts["import_s"] + facts["load_s"] + (trials + 1) * one + jit_s


def default_ptx_dir(env: Mapping[str, str]) -> Path:
    """MLX's PTX cache folder: ``$MLX_PTX_CACHE_DIR`` or ``/tmp/mlx/<version>/ptx``."""
    if env.get("MLX_PTX_CACHE_DIR"):
        return Path(env["MLX_PTX_CACHE_DIR"])
    import mlx.core as mx

    return Path("/tmp/mlx") / mx.__version__ / "ptx"


def _cache_is_cold(env: Mapping[str, str]) -> bool:
    d = default_ptx_dir(env)
    try:
        return not any(d.iterdir())
    except OSError:
        return True


def plan_estimate(plan: Sequence[Job], trials: int, *, fresh: bool,
                  write_checkpoint: bool, facts: Mapping = H200) -> List[float]:
    """Per-job H200 seconds of ``plan`` (:func:`estimate_process_s`), the first
    stock and first patched job charged their first-use compilation when
    ``fresh``, the first job the checkpoint's writing when ``write_checkpoint``."""
    out = []
    seen = set()
    for i, job in enumerate(plan):
        jit = 0.0
        if fresh and job.engine not in seen:
            if job.engine == "stock":
                jit = facts["stock_jit_s"]
            else:
                jit = facts["patched_jit_after_stock_s" if "stock" in seen else "patched_jit_s"]
        seen.add(job.engine)
        c = job.config
        s = estimate_process_s(c.prompt_tokens, c.generation_tokens, c.batch_size, job.engine,
                               trials, jit_s=jit, facts=facts)
        if i == 0 and write_checkpoint:
            s += facts["checkpoint_s"]
        out.append(s)
    return out


# ---------------------------------------------------------------------------
# Child processes
# ---------------------------------------------------------------------------


def child_env(base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """Environment of a child process: ``base`` (default: the environment at
    this module's import) with ``PYTHONUNBUFFERED=1`` and :data:`REPO_ROOT`
    first on ``PYTHONPATH``; every other variable (``MLX_PTX_CACHE_DIR``,
    ``MLX_QWEN_FAST_CACHE``, ...) passes through unchanged."""
    env = dict(_ENV_AT_IMPORT if base is None else base)
    env["PYTHONUNBUFFERED"] = "1"
    old = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in old if p != str(REPO_ROOT)])
    return env


@dataclasses.dataclass
class ProcessOutput:
    """What :func:`run_process` saw: exit code (None when killed by us),
    whether it timed out, wall seconds, stdout text, stderr lines, and the
    second (from the start) each stdout line arrived."""

    rc: Optional[int]
    timed_out: bool
    wall_s: float
    stdout: str
    stderr: str
    stdout_times: List[Tuple[float, str]]


def run_process(cmd: Sequence[str], env: Mapping[str, str], timeout_s: float,
                cwd: Optional[Path] = None) -> ProcessOutput:
    """Run ``cmd`` (in ``cwd``, default the current folder) in its own session,
    killing its process group after ``timeout_s`` seconds; stdout and stderr
    are read as they come."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(list(cmd), env=dict(env), cwd=None if cwd is None else str(cwd),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    out_lines: List[Tuple[float, str]] = []
    err_chunks: List[str] = []

    def read_out():
        for raw in proc.stdout:
            out_lines.append((round(time.perf_counter() - t0, 2), raw.decode(errors="replace")))

    def read_err():
        for raw in proc.stderr:
            err_chunks.append(raw.decode(errors="replace"))

    threads = [threading.Thread(target=read_out, daemon=True),
               threading.Thread(target=read_err, daemon=True)]
    for t in threads:
        t.start()
    def kill():
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
        proc.wait()

    timed_out = False
    try:
        rc: Optional[int] = proc.wait(timeout=max(timeout_s, 0.1))
    except subprocess.TimeoutExpired:
        timed_out = True
        kill()
        rc = None
    except BaseException:  # Ctrl-C, or SIGTERM via _on_sigterm: the child (own session) goes too
        kill()
        raise
    wall = time.perf_counter() - t0
    for t in threads:
        t.join(timeout=10)
    return ProcessOutput(rc, timed_out, round(wall, 2), "".join(l for _, l in out_lines),
                         "".join(err_chunks), [(t, l.rstrip("\n")) for t, l in out_lines])


# ---------------------------------------------------------------------------
# Parsing mlx-lm's benchmark output
# ---------------------------------------------------------------------------

_TRIAL_RE = re.compile(r"^Trial (\d+):\s*(.*)$")
_AVG_RE = re.compile(r"^Averages:\s*(.*)$")
_KV_RE = re.compile(r"(\w+)=([-+0-9.eE]+|nan|inf)")
_PATCH_RE = re.compile(r"^mlx_qwen_fast: patched .*$", re.M)

#: Lower-case fragments of allocation-failure messages (MLX's CPU/Metal/CUDA
#: allocators, CUDA's runtime, C++ and Python).
OOM_PATTERNS = ("out of memory", "outofmemory", "unable to allocate", "failed to allocate",
                "could not allocate", "std::bad_alloc", "memoryerror",
                "maximum allowed buffer size", "cudaerrormemoryallocation",
                "insufficient memory")


def _kv(text: str) -> Dict[str, float]:
    return {k: float(v) for k, v in _KV_RE.findall(text)}


def looks_oom(text: str) -> bool:
    """True when ``text`` holds an allocation-failure message (:data:`OOM_PATTERNS`)."""
    low = text.lower()
    return any(p in low for p in OOM_PATTERNS)


def _last_error_line(stderr: str) -> Optional[str]:
    lines = [l.strip() for l in stderr.splitlines() if l.strip()]
    for l in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|error)\b", l) or "error" in l.lower() \
                or looks_oom(l) or l.startswith("terminate called"):
            return l[:500]
    return lines[-1][:500] if lines else None


def parse_benchmark_output(stdout: str, stderr: str = "", *, rc: Optional[int] = 0,
                           timed_out: bool = False,
                           num_trials: Optional[int] = None) -> Dict:
    """One process record's measured fields from ``mlx_lm.benchmark`` output.

    Args:
        stdout: the process's stdout (``Running warmup..``, ``Timing with
            ...``, ``Trial i:  prompt_tps=..., generation_tps=...,
            peak_memory=..., total_time=...``, ``Averages: ...``).
        stderr: its stderr (searched for allocation failures; tail kept).
        rc: exit code; None or negative when killed by a signal (``-9``:
            SIGKILL, read as the OOM killer when ``timed_out`` is False).
        timed_out: the process was killed at its timeout.
        num_trials: trials asked for (``-n``); with ``rc == 0`` fewer trial
            lines, or no ``Averages`` line, make the status "error".

    Returns:
        ``status`` ("ok" | "timeout" | "oom" | "error"), ``error`` (None or a
        message), ``trials`` (list of dicts, one per ``Trial`` line:
        ``trial``, ``prompt_tps``, ``generation_tps`` (tok/s),
        ``peak_memory_gb`` (GB), ``total_time_s``), ``prompt_tps`` and
        ``generation_tps`` (mean over the trials; None without trials),
        ``peak_memory_gb`` (max over trials), ``mlx_averages`` (the
        ``Averages`` line's values or None), ``timing`` (mlx-lm's ``Timing
        with`` values or None), ``patch_line``, ``stderr_tail``.
    """
    trials: List[Dict] = []
    averages = None
    timing = None
    for line in stdout.splitlines():
        line = line.strip()
        m = _TRIAL_RE.match(line)
        if m:
            kv = _kv(m.group(2))
            if "prompt_tps" in kv and "generation_tps" in kv:
                trials.append({"trial": int(m.group(1)), "prompt_tps": kv["prompt_tps"],
                               "generation_tps": kv["generation_tps"],
                               "peak_memory_gb": kv.get("peak_memory"),
                               "total_time_s": kv.get("total_time")})
            continue
        m = _AVG_RE.match(line)
        if m:
            averages = _kv(m.group(1)) or None
            continue
        if line.startswith("Timing with"):
            timing = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)} or None

    def mean(key):
        vals = [t[key] for t in trials if t.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    peaks = [t["peak_memory_gb"] for t in trials if t.get("peak_memory_gb") is not None]
    error = None
    oom = looks_oom(stderr) or looks_oom(stdout)
    if timed_out:
        status = "oom" if oom else "timeout"
        error = "allocation failure, then no exit before the timeout" if oom else \
            f"killed at the timeout after {len(trials)} trial(s)"
    elif rc != 0:
        if oom:
            status = "oom"
        elif rc is not None and rc == -signal.SIGKILL:
            status, oom = "oom", True
            error = "killed by SIGKILL not sent by this script (Linux OOM killer?)"
        else:
            status = "error"
        error = error or _last_error_line(stderr) or f"exit code {rc}"
    elif (num_trials is not None and len(trials) < num_trials) or averages is None:
        status = "error"
        error = (f"exit 0 but output truncated: {len(trials)} trial line(s)"
                 f"{'' if num_trials is None else f' of {num_trials}'}"
                 f"{'' if averages is not None else ', no Averages line'}")
    else:
        status = "ok"
    m = _PATCH_RE.search(stderr) or _PATCH_RE.search(stdout)
    return {
        "status": status,
        "error": error,
        "trials": trials,
        "prompt_tps": mean("prompt_tps"),
        "generation_tps": mean("generation_tps"),
        "peak_memory_gb": max(peaks) if peaks else None,
        "mlx_averages": averages,
        "timing": timing,
        "patch_line": m.group(0) if m else None,
        "stderr_tail": stderr.splitlines()[-STDERR_TAIL_LINES:],
    }


def _event_times(times: Sequence[Tuple[float, str]]) -> Dict[str, Optional[float]]:
    """``startup_s`` (first "Running warmup" line) and ``warmup_s`` (from it to
    "Timing with") from the stdout line times."""
    start = timing = None
    for t, line in times:
        if start is None and line.startswith("Running warmup"):
            start = t
        if timing is None and line.startswith("Timing with"):
            timing = t
    return {"startup_s": start,
            "warmup_s": round(timing - start, 2) if start is not None and timing is not None
            else None}


def benchmark_cmd(model: str, job: Job, trials: int, extra: Sequence[str] = ()) -> List[str]:
    """The command of one process: ``python -m mlx_qwen_fast benchmark --model
    MODEL -p P -g G -b B -n TRIALS [extra] [--stock]``."""
    c = job.config
    cmd = [sys.executable, "-m", "mlx_qwen_fast", "benchmark", "--model", str(model),
           "-p", str(c.prompt_tokens), "-g", str(c.generation_tokens),
           "-b", str(c.batch_size), "-n", str(trials), *extra]
    if job.engine == "stock":
        cmd.append("--stock")
    return cmd


def run_job(model: str, job: Job, trials: int, env: Mapping[str, str], timeout_s: float,
            extra: Sequence[str] = ()) -> Dict:
    """Run one benchmark process and return its record (without ``order``,
    ``invocation`` and ``commit``, which the caller adds)."""
    cmd = benchmark_cmd(model, job, trials, extra)
    out = run_process(cmd, env, timeout_s)
    parsed = parse_benchmark_output(out.stdout, out.stderr, rc=out.rc, timed_out=out.timed_out,
                                    num_trials=trials)
    c = job.config
    rec = {"config": c.name, "engine": job.engine, "prompt_tokens": c.prompt_tokens,
           "generation_tokens": c.generation_tokens, "batch_size": c.batch_size,
           "num_trials": trials, "process": job.process, "first_in_pair": job.first_in_pair,
           "status": parsed["status"], "prompt_tps": parsed["prompt_tps"],
           "generation_tps": parsed["generation_tps"],
           "peak_memory_gb": parsed["peak_memory_gb"], "wall_s": out.wall_s,
           **_event_times(out.stdout_times), "rc": out.rc, "timeout_s": round(timeout_s, 1),
           "error": parsed["error"], "trials": parsed["trials"],
           "mlx_averages": parsed["mlx_averages"], "patch_line": parsed["patch_line"],
           "stderr_tail": parsed["stderr_tail"], "cmd": cmd[1:]}
    if parsed["status"] != "ok":
        rec["stdout_tail"] = out.stdout[-2000:]
    return rec


# ---------------------------------------------------------------------------
# Checkpoint
# ---------------------------------------------------------------------------


def _weight_files(folder: Path) -> List[str]:
    index = folder / "model.safetensors.index.json"
    names = set()
    if index.is_file():
        try:
            names = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError):
            names = set()
    names |= {p.name for p in folder.glob("model*.safetensors")}
    return sorted(names)


def checkpoint_files(folder) -> Dict[str, Optional[int]]:
    """Sizes in bytes of ``config.json``, the index and every weight shard of
    the checkpoint in ``folder`` (None for a listed file that is missing)."""
    folder = Path(folder)
    names = ["config.json"] + (["model.safetensors.index.json"]
                               if (folder / "model.safetensors.index.json").exists() else [])
    names += _weight_files(folder)
    out = {}
    for n in names:
        try:
            out[n] = (folder / n).stat().st_size
        except OSError:
            out[n] = None
    return out


def marker_matches(folder, want: Mapping) -> Tuple[bool, str]:
    """Whether ``folder`` holds the checkpoint that :data:`MARKER` describes
    with the fields of ``want`` (``preset``, ``seed``, ``router_skew``), every
    file at its recorded size. Returns ``(matches, reason)``."""
    folder = Path(folder)
    try:
        marker = json.loads((folder / MARKER).read_text())
    except FileNotFoundError:
        return False, "no marker"
    except (OSError, ValueError) as e:
        return False, f"unreadable marker ({e})"
    for k, v in want.items():
        if marker.get(k) != v:
            return False, f"marker has {k}={marker.get(k)!r}, want {v!r}"
    files = marker.get("files") or {}
    if not files or "config.json" not in files:
        return False, "marker lists no files"
    now = checkpoint_files(folder)
    if now != files:
        diff = sorted(set(files) ^ set(now)) or sorted(k for k in files if files[k] != now.get(k))
        return False, f"files differ from the marker: {diff[:4]}"
    return True, "same preset, seed and router skew; files as written"


def ensure_checkpoint(folder, preset: str, seed: int, router_skew: float, *,
                      env: Mapping[str, str], timeout_s: float = 900.0,
                      overwrite: bool = False) -> Dict:
    """Reuse or write the random-weight checkpoint in ``folder``.

    Reused when :func:`marker_matches`. Else written by ``python -m
    mlx_qwen_fast.checkpoint`` (``--overwrite`` when the folder holds a
    checkpoint that a marker says this script wrote, or ``overwrite``), and
    the marker written after it succeeds.

    Returns:
        ``{"path", "reused", "write_s", "reason"}``.

    Raises:
        RuntimeError: the folder holds a checkpoint without a marker and
            ``overwrite`` is False, or the CLI fails or times out (its
            stderr tail in the message).
    """
    folder = Path(folder)
    want = {"preset": preset, "seed": seed, "router_skew": float(router_skew)}
    ok, reason = marker_matches(folder, want)
    if ok:
        return {"path": str(folder), "reused": True, "write_s": 0.0, "reason": reason}
    held = (folder / "config.json").exists() or any(folder.glob("model*.safetensors"))
    ours = (folder / MARKER).exists()
    if held and not (ours or overwrite):
        raise RuntimeError(
            f"{folder} holds a checkpoint this script did not write ({reason}); pass "
            "--overwrite-checkpoint to replace it, or --model to benchmark it as it is")
    if ours:
        (folder / MARKER).unlink()
    cmd = [sys.executable, "-m", "mlx_qwen_fast.checkpoint", "--preset", preset,
           "--out", str(folder), "--seed", str(seed), "--router-skew", repr(float(router_skew))]
    if held:
        cmd.append("--overwrite")
    out = run_process(cmd, env, timeout_s)
    if out.timed_out or out.rc != 0:
        tail = "\n".join(out.stderr.splitlines()[-10:])
        raise RuntimeError(f"{' '.join(cmd[1:])}: "
                           f"{'timed out' if out.timed_out else f'exit code {out.rc}'}\n{tail}")
    marker = {**want, "lm_head_scale": None, "written_by": cmd[1:],
              "files": checkpoint_files(folder)}
    common.write_json(folder / MARKER, marker)
    return {"path": str(folder), "reused": False, "write_s": out.wall_s,
            "reason": f"written ({reason})"}


# ---------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """``a / b`` when both are positive numbers, else None."""
    if a is None or b is None or not (a > 0 and b > 0):
        return None
    return a / b


def summarize(runs: Iterable[Mapping]) -> List[Dict]:
    """Rows per (configuration, engine), in first-seen order of the
    configurations, stock before patched.

    Over the "ok" records of each group: ``prompt_tps`` / ``generation_tps``
    median, min and max (tok/s), ``peak_memory_gb`` (max, GB); ``n_ok`` and
    ``n`` (all records); on the patched row ``prompt_ratio`` and
    ``generation_ratio`` = patched median / stock median where both engines
    have "ok" records (None elsewhere). Records group by (prompt tokens,
    generated tokens, batch size), labelled by their ``config``.
    """
    groups: Dict[Tuple, Dict] = {}
    for r in runs:
        key = (r["prompt_tokens"], r["generation_tokens"], r["batch_size"])
        g = groups.setdefault(key, {"config": r.get("config") or config_name(*key),
                                    "engines": {}})
        g["engines"].setdefault(r["engine"], []).append(r)
    rows = []
    for key, g in groups.items():
        med = {}
        cfg_rows = []
        for engine in ENGINES:
            recs = g["engines"].get(engine)
            if not recs:
                continue
            ok = [r for r in recs if r.get("status") == "ok"]
            p = common.stats(r["prompt_tps"] for r in ok if r.get("prompt_tps") is not None)
            d = common.stats(r["generation_tps"] for r in ok if r.get("generation_tps") is not None)
            peaks = [r["peak_memory_gb"] for r in ok if r.get("peak_memory_gb") is not None]
            med[engine] = (p["median"], d["median"])
            cfg_rows.append({
                "config": g["config"], "engine": engine, "prompt_tokens": key[0],
                "generation_tokens": key[1], "batch_size": key[2],
                "n_ok": len(ok), "n": len(recs),
                "statuses": sorted({r.get("status") for r in recs} - {"ok"}),
                "prompt_tps": p["median"], "prompt_tps_min": p["min"], "prompt_tps_max": p["max"],
                "generation_tps": d["median"], "generation_tps_min": d["min"],
                "generation_tps_max": d["max"],
                "peak_memory_gb": max(peaks) if peaks else None,
                "prompt_ratio": None, "generation_ratio": None,
            })
        for row in cfg_rows:
            if row["engine"] == "patched" and "stock" in med:
                row["prompt_ratio"] = ratio(med["patched"][0], med["stock"][0])
                row["generation_ratio"] = ratio(med["patched"][1], med["stock"][1])
        rows.extend(cfg_rows)
    return rows


def _num(v: Optional[float]) -> str:
    if v is None:
        return "-"
    if v >= 100:
        return f"{v:,.0f}"
    return f"{v:.3g}" if v < 10 else f"{v:.1f}"


def format_summary(rows: Sequence[Mapping]) -> List[str]:
    """The summary table as text lines (one header line, one line per row)."""
    table = [["config", "engine", "ok/n", "prompt tok/s", "(min-max)", "gen tok/s",
              "(min-max)", "peak GB", "prompt x", "gen x"]]
    for r in rows:
        bad = ",".join(r.get("statuses") or [])
        table.append([
            r["config"], r["engine"], f"{r['n_ok']}/{r['n']}" + (f" {bad}" if bad else ""),
            _num(r["prompt_tps"]), f"({_num(r['prompt_tps_min'])}-{_num(r['prompt_tps_max'])})",
            _num(r["generation_tps"]),
            f"({_num(r['generation_tps_min'])}-{_num(r['generation_tps_max'])})",
            "-" if r["peak_memory_gb"] is None else
            f"{r['peak_memory_gb']:.2f}" if r["peak_memory_gb"] >= 1 else f"{r['peak_memory_gb']:.3g}",
            "-" if r["prompt_ratio"] is None else f"{r['prompt_ratio']:.2f}x",
            "-" if r["generation_ratio"] is None else f"{r['generation_ratio']:.2f}x",
        ])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return ["  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in
                      enumerate(zip(row, widths))).rstrip() for row in table]


# ---------------------------------------------------------------------------
# Result file
# ---------------------------------------------------------------------------

_PROBE = ("import json, sys; from bench import common; "
          "sys.stdout.write('\\n' + json.dumps(common.result_header('user_view')) + '\\n')")


def probe_header(env: Mapping[str, str], timeout_s: float = 300.0) -> Dict:
    """:func:`bench.common.result_header` computed in a child process (so that
    this process never imports the package or initialises the GPU). On
    failure a header of unknowns with ``header_error``."""
    out = run_process([sys.executable, "-c", _PROBE], env, timeout_s)
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                break
    head = {k: None for k in common.HEADER_KEYS}
    head.update(kind="user_view", device="unknown", commit=common.git_commit(),
                header_error="\n".join(out.stderr.splitlines()[-10:])
                or ("timed out" if out.timed_out else f"exit code {out.rc}"))
    return head


def run_key(rec: Mapping) -> Tuple:
    """``(prompt_tokens, generation_tokens, batch_size, engine, process)``."""
    return (rec["prompt_tokens"], rec["generation_tokens"], rec["batch_size"],
            rec["engine"], rec["process"])


def check_resumable(old: Mapping, want: Mapping) -> None:
    """Raise ValueError when ``old`` (a result file) is not a ``user_view``
    file of the same ``preset``, ``seed``, ``router_skew`` and ``num_trials``
    as ``want``."""
    if old.get("kind") != "user_view":
        raise ValueError(f"not a user_view result (kind {old.get('kind')!r})")
    for k in ("preset", "seed", "router_skew", "num_trials"):
        if old.get(k) != want.get(k):
            raise ValueError(f"{k} differs: the file has {old.get(k)!r}, this run {want.get(k)!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.user_view", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("checkpoint")
    g.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="folder of the random-weight checkpoint (written, or reused when its "
                        "marker matches; default $XDG_CACHE_HOME/mlx_qwen_fast/user_view/"
                        "PRESET-seedN-skewS)")
    g.add_argument("--model", default=None, metavar="DIR",
                   help="benchmark this existing checkpoint as it is (no writing; preset, seed "
                        "and router skew are then null)")
    g.add_argument("--preset", default="qwen3.6-35b-a3b", choices=("qwen3.6-35b-a3b", "tiny"))
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--router-skew", type=float, default=1.0,
                   help="expert popularity skew of the checkpoint (default %(default)s, as "
                        "bench/h200.sh's A/B runs)")
    g.add_argument("--overwrite-checkpoint", action="store_true",
                   help="replace a checkpoint in --checkpoint that has no matching marker")
    g.add_argument("--checkpoint-timeout", type=float, default=900.0)
    g = p.add_argument_group("what runs")
    g.add_argument("--configs", default=None,
                   help=f"comma-separated names ({', '.join(NAMED_CONFIGS)}) or PxGxB[:engines] "
                        f"(default {DEFAULT_CONFIGS})")
    g.add_argument("--prompt", type=common.lengths_arg, default=None,
                   help="prompt lengths (instead of --configs; cross product with --gen, --batch)")
    g.add_argument("--gen", type=common.lengths_arg, default=None, help="generated tokens (128)")
    g.add_argument("--batch", type=common.lengths_arg, default=None, help="batch sizes (1)")
    g.add_argument("--engines", type=_engines_arg, default=ENGINES,
                   help="engines to run (default stock,patched; restricts --configs)")
    g.add_argument("--processes", type=int, default=3, help="processes per engine and configuration")
    g.add_argument("-n", "--trials", type=int, default=2,
                   help="mlx_lm.benchmark -n: timed trials per process, after its warm-up")
    g.add_argument("--order", choices=ORDERS, default="stock-first")
    g.add_argument("--extra-args", default="",
                   help="more mlx_lm.benchmark flags, one string (e.g. '--prefill-step-size 4096')")
    g = p.add_argument_group("limits and files")
    g.add_argument("--timeout", type=float, default=480.0, help="seconds per process")
    g.add_argument("--budget-s", type=float, default=None,
                   help="start no process not expected to end within this many seconds of the "
                        "start; clip timeouts to it (the rest is left for --resume)")
    g.add_argument("--out", default=None, help="result JSON (default bench/results/"
                                               "DATE-DEVICE-user_view.json, or the --resume file)")
    g.add_argument("--resume", default=None, metavar="FILE",
                   help="add to FILE: skip processes it holds as ok, rerun the rest")
    g.add_argument("--plan", action="store_true",
                   help="print the plan with H200 estimates and run nothing")
    return p


def _configs_from_args(args, parser) -> List[Config]:
    explicit = any(x is not None for x in (args.prompt, args.gen, args.batch))
    if explicit and args.configs:
        parser.error("give --configs or --prompt/--gen/--batch, not both")
    if explicit:
        configs = explicit_configs(args.prompt or [4096], args.gen or [128], args.batch or [1],
                                   args.engines)
    else:
        try:
            configs = parse_configs(args.configs or DEFAULT_CONFIGS)
        except argparse.ArgumentTypeError as e:
            parser.error(str(e))
        configs = [dataclasses.replace(c, engines=tuple(e for e in c.engines if e in args.engines))
                   for c in configs]
    return [c for c in configs if c.engines]


def _default_checkpoint(args) -> Path:
    root = Path(_ENV_AT_IMPORT.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "mlx_qwen_fast" / "user_view" / f"{args.preset}-seed{args.seed}-skew{args.router_skew:g}"


def _on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    """Run the benchmark as the module docstring describes; returns the exit code."""
    if threading.current_thread() is threading.main_thread():
        # SIGTERM (e.g. from `timeout`) becomes SystemExit, so that run_process
        # kills the running child's process group before this process exits.
        signal.signal(signal.SIGTERM, _on_sigterm)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.processes < 1 or args.trials < 1:
        parser.error("--processes and --trials must be >= 1")
    fast = _ENV_AT_IMPORT.get("MLX_QWEN_FAST")
    if fast is not None and fast.strip().lower() in _OFF_VALUES:
        parser.error(f"MLX_QWEN_FAST={fast} in the environment: the patched processes would run stock")
    configs = _configs_from_args(args, parser)
    if not configs:
        parser.error("no configuration left to run (check --engines)")
    env = child_env()
    plan = build_plan(configs, args.processes, args.order)
    extra = shlex.split(args.extra_args)

    if args.model:
        preset = seed = skew = None
        model_dir = Path(args.model).expanduser().absolute()
    else:
        preset, seed, skew = args.preset, args.seed, float(args.router_skew)
        model_dir = (Path(args.checkpoint) if args.checkpoint
                     else _default_checkpoint(args)).expanduser().absolute()
    want = {"preset": preset, "seed": seed, "router_skew": skew, "num_trials": args.trials}

    old: Dict = {}
    if args.resume:
        try:
            old = common.read_json(args.resume)
            check_resumable(old, want)
        except (OSError, ValueError) as e:
            parser.error(f"--resume {args.resume}: {e}")
    old_runs: List[Dict] = list(old.get("runs", []))
    done = {run_key(r) for r in old_runs if r.get("status") == "ok"}
    todo = [j for j in plan if j.key not in done]

    if args.plan:
        fresh = _cache_is_cold(env)
        write = not args.model and not marker_matches(model_dir, {k: want[k] for k in
                                                                  ("preset", "seed", "router_skew")})[0]
        est = plan_estimate(todo, args.trials, fresh=fresh, write_checkpoint=write)
        print(f"{len(todo)} processes ({len(plan) - len(todo)} already ok in --resume); "
              f"H200 estimate (fresh caches: {fresh}, checkpoint to write: {write}):")
        for j, s in zip(todo, est):
            print(f"  {j.config.name:>10} {j.engine:>7} #{j.process}  ~{s:6.0f} s")
        print(f"  total ~{sum(est):.0f} s")
        return 0

    t_start = time.perf_counter()
    header: Dict = {}
    probe = threading.Thread(target=lambda: header.update(probe_header(env)), daemon=True)
    probe.start()
    if args.model:
        if not (model_dir / "config.json").is_file():
            parser.error(f"--model {model_dir}: no config.json there")
        ckpt = {"path": str(model_dir), "reused": True, "write_s": 0.0, "reason": "--model"}
    else:
        try:
            ckpt = ensure_checkpoint(model_dir, preset, seed, skew, env=env,
                                     timeout_s=args.checkpoint_timeout,
                                     overwrite=args.overwrite_checkpoint)
        except RuntimeError as e:
            probe.join()
            print(f"user_view: checkpoint: {e}", file=sys.stderr)
            return 2
    print(f"checkpoint {ckpt['path']}: {ckpt['reason']}"
          + ("" if ckpt["reused"] else f" in {ckpt['write_s']:.1f} s"), flush=True)
    probe.join()
    if header.get("header_error"):
        print(f"user_view: header probe failed: {header['header_error']}", file=sys.stderr)

    out = Path(args.out or args.resume or common.default_out("user_view", header.get("device")))
    invocations = list(old.get("invocations", []))
    inv = {"date": header.get("date"), "commit": header.get("commit"),
           "device": header.get("device"), "argv": list(sys.argv[1:] if argv is None else argv),
           "checkpoint": ckpt, "planned": len(todo), "ran": 0}
    invocations.append(inv)
    commits = {i.get("commit") for i in invocations}
    if len(commits) > 1:
        print(f"user_view: the file now mixes commits {sorted(map(str, commits))}", file=sys.stderr)
    runs = list(old_runs)
    next_order = 1 + max((r.get("order", -1) for r in runs), default=-1)
    all_configs = {c["name"]: c for c in old.get("configs", [])}
    all_configs.update({c.name: dataclasses.asdict(c) for c in configs})

    def save():
        result = {**header, "config": common.jsonable(vars(args)), "preset": preset,
                  "seed": seed, "router_skew": skew, "model": str(model_dir),
                  "checkpoint": ckpt, "num_trials": args.trials, "processes": args.processes,
                  "order": args.order, "extra_args": extra,
                  "configs": list(all_configs.values()), "invocations": invocations,
                  "runs": runs, "summary": summarize(runs)}
        common.write_json(out, result)

    save()
    left = 0
    for i, job in enumerate(todo):
        elapsed = time.perf_counter() - t_start
        timeout = args.timeout
        clipped = False
        if args.budget_s is not None:
            remaining = args.budget_s - elapsed
            same = [r["wall_s"] for r in runs if r.get("status") == "ok"
                    and run_key(r)[:4] == job.key[:4]]
            if same:
                expect = min(same) * 1.1
            else:
                c = job.config
                expect = estimate_process_s(c.prompt_tokens, c.generation_tokens, c.batch_size,
                                            job.engine, args.trials)
            if remaining < 30 or expect > remaining:
                left = len(todo) - i
                print(f"budget: {remaining:.0f} s left, next process expected ~{expect:.0f} s: "
                      f"{left} process(es) left for --resume {out}", flush=True)
                break
            if remaining < timeout:
                timeout, clipped = remaining, True
        rec = run_job(str(model_dir), job, args.trials, env, timeout, extra)
        rec.update(order=next_order, invocation=len(invocations) - 1,
                   commit=header.get("commit"), budget_clipped=clipped)
        next_order += 1
        runs = common.merge_records(runs, [rec], run_key)
        inv["ran"] += 1
        save()
        print(f"[{job.config.name} {job.engine} #{job.process}] {rec['status']} "
              f"wall={rec['wall_s']:.1f}s startup={rec['startup_s']} warmup={rec['warmup_s']} "
              f"prompt_tps={_num(rec['prompt_tps'])} gen_tps={_num(rec['generation_tps'])} "
              f"peak={rec['peak_memory_gb']}"
              + (f"  {rec['error']}" if rec["error"] else ""), flush=True)

    print("wrote", out)
    print(f"{header.get('device')}, commit {header.get('commit')}, preset {preset}, "
          f"router_skew {skew}, -n {args.trials}, wall {time.perf_counter() - t_start:.0f} s")
    for line in format_summary(summarize(runs)):
        print(line)
    sys.stdout.flush()
    if left:
        return 3
    mine = [r for r in runs if run_key(r) in {j.key for j in plan}]
    return 0 if all(r.get("status") == "ok" for r in mine) else 1


if __name__ == "__main__":
    sys.exit(main())
