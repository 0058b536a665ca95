"""Compile the GPU kernels of a model's first run ahead of time, in parallel.

On CUDA, MLX compiles many of its kernels at run time the first time a
process needs them (its quantised matmuls by tile class and bit width,
gathers, fused elementwise kernels) and keeps them in its compile cache
(``MLX_PTX_CACHE_DIR``; the package points it at a folder that outlives
``/tmp``: :data:`mlx_qwen_fast.config.MLX_PTX_CACHE`). Some of those compile
for half a minute each, one after the other, so a first ``generate`` on a
fresh machine waits minutes for its first token (bench/results/
package-figures.md, "First use"). This module runs the same kernels from
several processes at once, so their compiles overlap:

* each worker loads the checkpoint lazily, keeps its first Gated DeltaNet
  and first attention layer (the embedding, norms and lm_head too), patches
  it and runs mlx-lm's ``generate_step`` on prompts of some of
  :data:`PROMPT_TOKENS` tokens (one per tile class of MLX's quantised-matmul
  dispatch, the prefill kernels' range and a second prefill chunk) plus a
  few decode steps, and a batch-of-4 decode step;
* every worker writes into a cache folder of its own; the parent publishes
  the finished files into the shared cache (the kernel list before the
  binary, each by an atomic rename, since MLX reads and writes that folder
  without locks), then writes a marker for the model's configuration.

``python -m mlx_qwen_fast warmup --model PATH`` runs it; the package's CLIs
start it in the background on first use of a model on a machine (when
:data:`mlx_qwen_fast.config.WARMUP` is on and the marker is missing) and
wait for it before the model's first forward pass.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from . import backend, config

#: Prompt lengths the workers run: 1..4 (the decode kernels), 12, 27, 60,
#: 100 (MLX's small-M quantised matmul tiles, MoE below the prefill
#: kernels), 300 (the prefill kernels) and 2,100 (two prefill chunks of
#: mlx-lm's default 2,048: attention over a cache).
PROMPT_TOKENS = (1, 3, 12, 27, 60, 100, 300, 2100)
#: GPU memory one worker may take (bytes): two layers, the embedding and the
#: lm_head of Qwen3.6-35B-A3B at 4 bits, MLX's buffers and the prompts.
WORKER_BYTES = 4 << 30
#: Seconds after which :meth:`Warmup.wait` stops waiting for its workers (the
#: longest single compile measured is about half a minute).
TIMEOUT_S = 300.0
_MARKER_PREFIX = "mlx_qwen_fast-warm-"


def _model_key(model_path: Path) -> str:
    """A hash of what decides the kernels a model needs: its config.json,
    the package's and MLX's versions, the GPU architecture."""
    from . import __version__

    h = hashlib.sha256()
    h.update((model_path / "config.json").read_bytes())
    h.update(__version__.encode())
    try:
        import mlx.core as mx

        h.update(mx.__version__.encode())
        h.update(str(mx.device_info().get("device_name", "")).encode())
    except Exception:  # the key only needs to change when these do
        pass
    return h.hexdigest()[:20]


def ptx_cache_dir() -> Optional[Path]:
    """MLX's compile cache folder as this process will use it, or None when
    the environment does not name one (then MLX uses its own default,
    which the package does not write into)."""
    value = config.mlx_ptx_cache_dir()
    return Path(value) if value else None


def marker_path(model_path: Path) -> Optional[Path]:
    """The file that says a warm-up of this model's kernels completed, or
    None without a known compile cache folder."""
    cache = ptx_cache_dir()
    return None if cache is None else cache / f"{_MARKER_PREFIX}{_model_key(Path(model_path))}"


def is_warm(model_path) -> bool:
    """True when the kernels of ``model_path``'s configuration were warmed up
    into the current compile cache (or there is nothing to warm up: not on
    CUDA, or no known cache folder)."""
    if backend.current() != backend.CUDA:
        return True
    marker = marker_path(Path(model_path))
    return marker is None or marker.is_file()


def _jobs(requested: Optional[int], model_path: Path) -> int:
    """Workers to run: ``requested``, else half the CPU cores, at most one
    per prompt group and as many as fit in the GPU memory next to the model
    itself (0: none fit)."""
    n = requested or max(1, (os.cpu_count() or 2) // 2)
    n = min(n, len(PROMPT_TOKENS))
    try:
        import mlx.core as mx

        total = int(mx.device_info().get("total_memory", 0))
    except Exception:
        total = 0
    if total:
        weights = sum(f.stat().st_size for f in model_path.glob("*.safetensors"))
        n = min(n, max(0, (total - weights - (2 << 30)) // WORKER_BYTES))
    return int(n)


def _split(items: Sequence[int], parts: int) -> List[List[int]]:
    """``items`` dealt round-robin into ``parts`` non-empty lists (longest first)."""
    ordered = sorted(items, reverse=True)
    out = [ordered[i::parts] for i in range(parts)]
    return [o for o in out if o]


class Warmup:
    """Worker processes compiling a model's kernels (see the module docstring).

    ``Warmup(model_path, jobs).start()`` launches them; :meth:`wait` joins
    them, publishes their compile caches into the shared one and writes the
    marker. Worker failures (out of memory, a crash) are reported and
    skipped: the main process then compiles what is missing itself.
    """

    def __init__(self, model_path, jobs: Optional[int] = None):
        self.model_path = Path(model_path)
        self.cache = ptx_cache_dir()
        self.jobs = _jobs(jobs, self.model_path) if self.cache is not None else 0
        self.procs: List[tuple] = []
        self.started = 0.0

    def start(self) -> "Warmup":
        self.started = time.perf_counter()
        root = Path(__file__).resolve().parent.parent
        for lengths in _split(PROMPT_TOKENS, self.jobs):
            private = Path(tempfile.mkdtemp(prefix="mlx_qwen_fast_warmup_"))
            env = config.child_environment(MLX_PTX_CACHE_DIR=str(private))
            env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
            cmd = [sys.executable, "-m", "mlx_qwen_fast.warmup", "--worker", str(self.model_path),
                   "--lengths", ",".join(map(str, lengths))]
            log = tempfile.TemporaryFile()
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            self.procs.append((proc, private, log, lengths))
        return self

    def wait(self, progress: bool = True, timeout: float = TIMEOUT_S) -> Dict:
        """Join the workers (a tqdm bar on stderr when ``progress``), publish
        their caches, write the marker. A worker still running ``timeout``
        seconds after the start is killed and counted as failed. Returns
        ``{"seconds", "workers", "failed", "published"}``."""
        from tqdm import tqdm

        failed, published = [], 0
        with tqdm(total=len(self.procs), desc="compiling GPU kernels (once per machine)", unit="job",
                  disable=not progress or not self.procs, file=sys.stderr) as bar:
            for proc, private, log, lengths in self.procs:
                left = max(1.0, timeout - (time.perf_counter() - self.started))
                try:
                    rc = proc.wait(timeout=left)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    rc = proc.wait()
                if rc != 0:
                    log.seek(0)
                    tail = log.read().decode(errors="replace").strip().splitlines()[-1:]
                    failed.append({"lengths": lengths, "rc": rc, "last_line": tail[0][:300] if tail else ""})
                published += _publish(private, self.cache)
                shutil.rmtree(private, ignore_errors=True)
                log.close()
                bar.update(1)
        if self.procs and not failed and self.cache is not None:
            marker = marker_path(self.model_path)
            marker.write_text(json.dumps({"model": str(self.model_path), "lengths": list(PROMPT_TOKENS)}))
        for f in failed:
            print(f"mlx_qwen_fast: warm-up worker for prompts {f['lengths']} failed (rc {f['rc']}): "
                  f"{f['last_line']}", file=sys.stderr)
        return {"seconds": time.perf_counter() - self.started, "workers": len(self.procs),
                "failed": failed, "published": published}


def _publish(src: Path, dst: Optional[Path]) -> int:
    """Move the compile-cache files of ``src`` into ``dst`` (those ``dst``
    lacks): per module the ``.txt`` (kernel names) and ``.cu`` first, the
    binary ``.ptx`` last, each by an atomic rename, so a process reading
    ``dst`` meanwhile sees a module either complete or absent. Returns the
    number of modules published."""
    if dst is None or not src.is_dir():
        return 0
    dst.mkdir(parents=True, exist_ok=True)
    count = 0
    for ptx in sorted(src.rglob("*.ptx")):
        rel = ptx.relative_to(src)
        target = dst / rel
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        for ext in (".txt", ".cu", ".ptx"):
            part = ptx.with_suffix(ext)
            if part.exists():
                tmp = target.with_suffix(ext + f".{os.getpid()}.tmp")
                shutil.copyfile(part, tmp)
                os.replace(tmp, target.with_suffix(ext))
        count += 1
    return count


def _worker(model_path: str, lengths: Sequence[int]) -> None:
    """One worker: the model cut to one layer of each kind, patched, run on
    prompts of ``lengths`` tokens and decoded a few steps, then a batch of 4."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    from .patching import patch

    model, _ = load_model(Path(model_path), lazy=True)
    text = model.language_model.model if hasattr(model, "language_model") else model.model
    linear = next(i for i, layer in enumerate(text.layers) if layer.is_linear)
    full = next(i for i, layer in enumerate(text.layers) if not layer.is_linear)
    text.layers = [text.layers[linear], text.layers[full]]
    text.ssm_idx, text.fa_idx = 0, 1
    patch(model, warn=False)
    vocab = text.embed_tokens.weight.shape[0]
    for n in lengths:
        prompt = mx.random.randint(0, vocab, (n,), key=mx.random.key(n))
        for _ in zip(range(3), generate_step(prompt, model, max_tokens=3)):
            pass
    cache = make_prompt_cache(model)
    tokens = mx.random.randint(0, vocab, (4, 8), key=mx.random.key(0))
    mx.eval(model(tokens, cache=cache))
    mx.eval(mx.argmax(model(tokens[:, :1], cache=cache)[:, -1], axis=-1))


def warmup(model_path, *, jobs: Optional[int] = None, progress: bool = True) -> Dict:
    """Warm up the compile cache for ``model_path`` (see the module docstring).

    Args:
        model_path: a local checkpoint folder (config.json, safetensors).
        jobs: worker processes (default: half the CPU cores, as many as fit
            in GPU memory beside the model, at most one per prompt group).
        progress: show a tqdm bar on stderr.

    Returns:
        ``{"seconds", "workers", "failed", "published"}`` (``workers`` 0 when
        there is nothing to do: not on CUDA, or no compile cache folder).

    Raises:
        FileNotFoundError: ``model_path`` has no config.json.
    """
    model_path = Path(model_path)
    if not (model_path / "config.json").is_file():
        raise FileNotFoundError(f"warmup: {model_path} is not a checkpoint folder (no config.json)")
    if backend.current() != backend.CUDA:
        return {"seconds": 0.0, "workers": 0, "failed": [], "published": 0}
    return Warmup(model_path, jobs).start().wait(progress)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m mlx_qwen_fast warmup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="local checkpoint folder")
    p.add_argument("--jobs", type=int, default=None, help="worker processes (default: see warmup())")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--lengths", help=argparse.SUPPRESS)
    if argv is not None and "--worker" in argv:
        args = p.parse_args(argv + ["--model", "-"])
    else:
        args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker, [int(x) for x in args.lengths.split(",")])
        return
    from ._cli import check_checkpoint_folder, usage_error

    problem = check_checkpoint_folder(Path(os.path.expanduser(args.model)))
    if problem:
        usage_error(f"--model {args.model}: {problem}")
    if args.jobs is not None and args.jobs < 1:
        usage_error(f"--jobs {args.jobs}: expected a whole number >= 1")
    result = warmup(os.path.expanduser(args.model), jobs=args.jobs)
    if result["workers"] == 0:
        print(f"mlx_qwen_fast: nothing to warm up on {backend.current()} "
              "(MLX compiles kernels at run time on CUDA only)", file=sys.stderr)
        return
    print(f"mlx_qwen_fast: warm-up of {args.model}: {result['workers']} workers, "
          f"{result['published']} kernel modules cached, {result['seconds']:.1f} s"
          + (f", {len(result['failed'])} failed" if result["failed"] else ""), file=sys.stderr)
    if result["failed"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
