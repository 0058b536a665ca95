"""First use of the CLI on a machine: where the seconds go before the first token.

Runs ``python -m mlx_qwen_fast.generate --model CK --prompt P -m N`` (or with
``--stock``) in fresh processes, one after the other, as a user would type
it. The first run starts with empty compile caches of its own (MLX's
``MLX_PTX_CACHE_DIR`` and this package's ``MLX_QWEN_FAST_CACHE``, fresh
temporary folders), the later runs reuse them. For each run it records:

* ``wall_s``: the process's wall time; ``first_token_s``: seconds from the
  start until the first generated character reached stdout;
* mlx-lm's own ``Prompt: ... tokens-per-sec`` / ``Generation: ...`` / peak
  memory lines;
* ``compiles``: every file that appeared in the two caches while the process
  ran, with the second it appeared at and its size (MLX writes one file per
  JIT-compiled module, so the gaps between files are its compile times);
* ``stderr_lines``: what the process printed to stderr, each line with the
  second it was read.

    python -m bench.first_use --model CK [--runs 2] [--stock] [--cache-root DIR] --out FILE

``--cache-root DIR`` puts the two caches in ``DIR/mlx-ptx`` and
``DIR/kernels`` (created; refused unless empty) instead of temporary folders
and leaves them filled, so that a benchmark run next on the same machine with
``MLX_PTX_CACHE_DIR=DIR/mlx-ptx MLX_QWEN_FAST_CACHE=DIR/kernels`` reuses
what the first run compiled.

Writes a JSON of ``kind`` "first_use" and prints one line per run.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List

from . import common

_PROMPT_RE = re.compile(r"Prompt: (\d+) tokens, ([\d.]+) tokens-per-sec")
_GEN_RE = re.compile(r"Generation: (\d+) tokens, ([\d.]+) tokens-per-sec")
_PEAK_RE = re.compile(r"Peak memory: ([\d.]+) GB")


def _watch(dirs: List[Path], t0: float, stop: threading.Event, seen: Dict[str, dict]) -> None:
    """Poll ``dirs`` every 0.1 s; record each new file's first-seen second and size."""
    while True:
        for d in dirs:
            try:
                entries = list(os.scandir(d))
            except OSError:
                continue
            for e in entries:
                key = f"{d.name}/{e.name}"
                if key not in seen and e.is_file() and not e.name.endswith(".tmp"):
                    try:
                        size = e.stat().st_size
                    except OSError:
                        continue
                    seen[key] = {"file": key, "t": round(time.perf_counter() - t0, 2), "bytes": size}
        if stop.is_set():
            return
        time.sleep(0.1)


def run_generate(cmd: List[str], env: Dict[str, str], watch: List[Path], timeout: float) -> Dict:
    """Run ``cmd``, timing its first generated character and the cache files it writes."""
    seen: Dict[str, dict] = {}
    stop = threading.Event()
    t0 = time.perf_counter()
    watcher = threading.Thread(target=_watch, args=(watch, t0, stop, seen), daemon=True)
    watcher.start()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err_lines: List[dict] = []

    def read_err():
        for raw in proc.stderr:
            err_lines.append({"t": round(time.perf_counter() - t0, 2),
                              "line": raw.decode(errors="replace").rstrip()[:400]})

    err_thread = threading.Thread(target=read_err, daemon=True)
    err_thread.start()
    out = bytearray()
    first_token_s = None
    status = "ok"
    deadline = t0 + timeout
    while True:
        if time.perf_counter() > deadline:
            proc.kill()
            status = "timeout"
            break
        chunk = proc.stdout.read1(4096) if hasattr(proc.stdout, "read1") else proc.stdout.read(1)
        if not chunk:
            break
        out += chunk
        if first_token_s is None:
            text = out.decode(errors="replace")
            head = text.find("=" * 10 + "\n")
            if head >= 0 and len(text) > head + 11:
                first_token_s = round(time.perf_counter() - t0, 2)
    rc = proc.wait()
    wall = time.perf_counter() - t0
    err_thread.join(timeout=5)
    stop.set()
    watcher.join(timeout=5)
    text = out.decode(errors="replace")
    if status == "ok" and rc != 0:
        status = "error"
    rec = {"cmd": cmd[2:], "rc": rc, "status": status, "wall_s": round(wall, 2),
           "first_token_s": first_token_s, "stdout_tail": text[-1500:],
           "stderr_lines": err_lines[-60:],
           "compiles": sorted(seen.values(), key=lambda r: r["t"])}
    for key, regex in (("prompt", _PROMPT_RE), ("generation", _GEN_RE)):
        m = regex.search(text)
        if m:
            rec[f"{key}_tokens"], rec[f"{key}_tps"] = int(m.group(1)), float(m.group(2))
    m = _PEAK_RE.search(text)
    if m:
        rec["peak_memory_gb"] = float(m.group(1))
    return rec


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.first_use", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint folder (python -m mlx_qwen_fast.checkpoint)")
    p.add_argument("--prompt", default="Write a haiku about the sea.")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--runs", type=int, default=2, help="processes, the first with empty caches")
    p.add_argument("--stock", action="store_true", help="pass --stock (stock mlx-lm)")
    p.add_argument("--timeout", type=float, default=400.0, help="seconds per process")
    p.add_argument("--profile-last", default=None, metavar="FILE",
                   help="run the last process under cProfile, stats to FILE (a summary beside it, FILE.txt)")
    p.add_argument("--cache-root", default=None, metavar="DIR",
                   help="empty or new folder for the two compile caches (kept after the runs) instead of "
                        "temporary folders")
    p.add_argument("--out", default=None)
    return p


def _cache_dirs(root):
    """The (MLX PTX, package kernel) cache folders: fresh temporary ones, or empty ones under ``root``."""
    if root is None:
        return Path(tempfile.mkdtemp(prefix="mlx_ptx_")), Path(tempfile.mkdtemp(prefix="mqf_kernels_"))
    dirs = Path(root) / "mlx-ptx", Path(root) / "kernels"
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        if any(d.iterdir()):
            raise SystemExit(f"--cache-root: {d} is not empty (a first use needs empty compile caches)")
    return dirs


def main(argv=None) -> Dict:
    args = build_parser().parse_args(argv)
    ptx, kernels = _cache_dirs(args.cache_root)
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, MLX_PTX_CACHE_DIR=str(ptx), MLX_QWEN_FAST_CACHE=str(kernels),
               PYTHONUNBUFFERED="1",
               PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "mlx_qwen_fast.generate", "--model", args.model,
           "--prompt", args.prompt, "-m", str(args.max_tokens)] + (["--stock"] if args.stock else [])
    runs = []
    for i in range(args.runs):
        last = args.profile_last and i == args.runs - 1
        run_cmd = ([sys.executable, "-m", "cProfile", "-o", args.profile_last] + cmd[1:]) if last else cmd
        rec = run_generate(run_cmd, env, [ptx, kernels], args.timeout)
        rec["run"] = i
        runs.append(rec)
        print(f"run {i}: rc={rec['rc']} wall={rec['wall_s']}s first_token={rec['first_token_s']}s "
              f"prompt_tps={rec.get('prompt_tps')} gen_tps={rec.get('generation_tps')} "
              f"new cache files={len(rec['compiles'])}", flush=True)
        prev = 0.0
        gaps = []
        for c in rec["compiles"]:
            gaps.append((c["t"] - prev, c["t"], c["file"], c["bytes"]))
            prev = c["t"]
        for gap, t, name, size in sorted(gaps, reverse=True)[:15]:
            print(f"    +{gap:6.1f}s at {t:6.1f}s  {name[:90]} ({size} B)", flush=True)
    if args.profile_last and os.path.isfile(args.profile_last):
        import pstats

        with open(args.profile_last + ".txt", "w") as f:
            pstats.Stats(args.profile_last, stream=f).sort_stats("cumulative").print_stats(40)
    result = {**common.result_header("first_use", args), "runs": runs}
    out = Path(args.out) if args.out else common.default_out("first_use")
    common.write_json(out, result)
    print("wrote", out)
    return result


if __name__ == "__main__":
    main()
