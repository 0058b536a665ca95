"""Shared driver of the device kernel scripts (``bench/gdn_cuda.py``,
``bench/moe_cuda.py``, ``bench/moe_decode_cuda.py``) and their timing helpers.

:func:`run_sections` runs each section of a script in its own process (a
crash or a hang in one kernel does not lose the others), writes
``<prefix>_<section>.json`` and appends to ``<prefix>_cuda.log`` under
``--out``, and the parent prints the script's summary table last.
:func:`timed_builds` runs a snippet in two fresh processes sharing an empty
kernel cache (first use, then cached; also ``bench.startup``). The timing
helpers (:func:`timeit`, :func:`chain_latency`, :func:`build_eval_times`)
synchronise around every evaluation; :func:`rel` and :func:`finite` are the
checks' error measures.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

_log_path = None


def log(msg: str) -> None:
    """Print ``msg`` and append it to the script's log file under ``--out``."""
    print(msg, flush=True)
    if _log_path is not None:
        with open(_log_path, "a") as f:
            f.write(msg + "\n")


def run_sections(script, prefix, sections, summary, description, default_sections, quick_help):
    """The ``main()`` of a device script.

    Args:
        script: the script's ``__file__`` (re-run once per section).
        prefix: file-name prefix of the log and the per-section JSON files.
        sections: name -> fn(args) -> dict of results.
        summary: fn(results by section) that ``log``s the closing table.
        description, default_sections, quick_help: argparse texts/defaults.
    """
    global _log_path
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--section", choices=list(sections), help="run one section in this process")
    ap.add_argument("--sections", default=default_sections)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--quick", action="store_true", help=quick_help)
    args = ap.parse_args()
    from mlx_qwen_fast.kernels import _cuda_build as cb

    if not cb.cuda_available():
        raise SystemExit(f"{Path(script).name}: needs MLX's CUDA backend and an NVIDIA GPU (none here)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _log_path = str(out / f"{prefix}_cuda.log")
    if args.section:
        t0 = time.perf_counter()
        r = sections[args.section](args)
        r["section_seconds"] = time.perf_counter() - t0
        (out / f"{prefix}_{args.section}.json").write_text(json.dumps(r, indent=1, default=str))
        return
    results = {}
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        cmd = [sys.executable, script, "--section", name, "--out", str(out)]
        rc = subprocess.run(cmd + (["--quick"] if args.quick else [])).returncode
        log(f"== section {name}: rc={rc} ({time.perf_counter() - t0:.1f} s)")
        p = out / f"{prefix}_{name}.json"
        results[name] = json.loads(p.read_text()) if p.exists() else {"rc": rc}
    summary(results)


def rel(a, b) -> float:
    """Relative L2 error ||a - b|| / ||b|| in fp32."""
    import mlx.core as mx

    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return mx.sqrt(mx.sum((a - b) ** 2)).item() / max(mx.sqrt(mx.sum(b**2)).item(), 1e-30)


def finite(a) -> bool:
    """True when every element of ``a`` is finite (poisoned outputs were written)."""
    import mlx.core as mx

    return bool(mx.all(mx.isfinite(a.astype(mx.float32))).item())


def timeit(fn, n=20, batch=1, warm=3) -> float:
    """Median seconds per call of ``fn``; ``batch`` calls are queued per evaluation."""
    import mlx.core as mx

    for _ in range(warm):
        mx.eval(fn())
    mx.synchronize()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        outs = [fn() for _ in range(batch)]
        mx.eval(outs)
        mx.synchronize()
        ts.append((time.perf_counter() - t0) / batch)
    ts.sort()
    return ts[len(ts) // 2]


def build_eval_times(build, evals=10, warm=3):
    """Median seconds of building ``build()``'s graph (Python and MLX graph
    construction, nothing evaluated) and of evaluating it (``mx.eval`` +
    ``mx.synchronize``), as ``(build_s, eval_s)``."""
    import mlx.core as mx

    for _ in range(warm):
        mx.eval(build())
    mx.synchronize()
    tb, te = [], []
    for _ in range(evals):
        t0 = time.perf_counter()
        out = build()
        t1 = time.perf_counter()
        mx.eval(out)
        mx.synchronize()
        tb.append(t1 - t0)
        te.append(time.perf_counter() - t1)
    return sorted(tb)[evals // 2], sorted(te)[evals // 2]


def chain_latency(make, n=8, evals=10, warm=2, steady=(16, 48)) -> dict:
    """Per-call latency of a kernel as a model layer sees it.

    ``make(m)`` returns a function that builds ``m`` *dependent* calls (each
    reads what the previous one wrote, as consecutive layers do) and returns
    the last outputs. Times one evaluation of ``make(1)`` and of ``make(n)``
    (median of ``evals``) and returns seconds: ``single`` (one call per
    evaluation, MLX's per-evaluation cost included), ``per_call`` (n chained,
    divided by n) and ``marginal`` ((t_n - t_1) / (n - 1): one more call in a
    graph, neither the evaluation's fixed cost nor overlap of independent
    launches included; a short chain is one CUDA graph, launched once all of
    it is encoded, so one call's host cost is included); with ``steady =
    (n1, n2)`` also ``steady`` = (t_n2 - t_n1) / (n2 - n1), both chains long
    enough to span several of MLX's graph commits, so host work overlaps GPU
    work as in the model's prefill (see bench/ops.py, CHAIN_STEADY).
    """
    t1 = timeit(make(1), n=evals, warm=warm)
    tn = timeit(make(n), n=evals, warm=warm)
    r = {"single": t1, "per_call": tn / n, "marginal": (tn - t1) / (n - 1), "n": n}
    if steady:
        n1, n2 = steady
        t_n1 = timeit(make(n1), n=evals, warm=warm)
        t_n2 = timeit(make(n2), n=evals, warm=warm)
        r["steady"] = (t_n2 - t_n1) / (n2 - n1)
    return r


def build_lines(results: dict) -> list:
    """Summary lines of a ``build`` section: per run (first use, cached), the
    seconds each kernel took to build or load, and the compiler."""
    lines = []
    for label, r in results.get("build", {}).items():
        if isinstance(r, dict) and "build_s" in r:
            lines.append(f"build {label:9s}: " + ", ".join(f"{k} {v:.2f}s" for k, v in r["build_s"].items())
                         + f" [{r.get('compiler')}]")
    return lines


def timed_builds(snippet: str, root, tail: int = 2000) -> dict:
    """Run ``snippet`` (a Python program that prints one ``BUILDJSON{...}``
    line) in two fresh processes sharing an empty kernel cache
    (``MLX_QWEN_FAST_CACHE``): "first_use" compiles, "cached" loads.

    Returns ``{label: {"rc", "process_wall", **BUILDJSON}}``; logs each run.
    """
    import tempfile

    env = dict(os.environ, MLX_QWEN_FAST_CACHE=tempfile.mkdtemp(prefix="mqf_cache_"),
               PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = {}
    for label in ("first_use", "cached"):
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", snippet], env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        log(f"[build:{label}] rc={r.returncode} wall={wall:.2f}s\n{r.stdout[-tail:]}\n{r.stderr[-3000:]}")
        rec = {"rc": r.returncode, "process_wall": wall}
        for line in r.stdout.splitlines():
            if line.startswith("BUILDJSON"):
                rec.update(json.loads(line[len("BUILDJSON"):]))
        out[label] = rec
    return out
