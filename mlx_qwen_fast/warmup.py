"""Compile the GPU kernels of a model's first run ahead of time.

On CUDA, MLX compiles many of its kernels at run time the first time a
process needs them (its quantised matmuls by tile class and bit width,
gathers, fused elementwise kernels) and keeps them in its compile cache
(``MLX_PTX_CACHE_DIR``; the package points it at a folder that outlives
``/tmp``: :data:`mlx_qwen_fast.config.MLX_PTX_CACHE`). Some of those take
half a minute each, so a first ``generate`` on a fresh machine waits minutes
for its first token (bench/results/package-figures.md, "First use").
:func:`warmup` runs those kernels once, ahead of time: it first compiles
MLX's quantised-matmul and gather modules in worker processes
(:mod:`mlx_qwen_fast.mlx_compiles`, with
:data:`mlx_qwen_fast.config.MLX_COMPILES_AHEAD` on), then loads the
checkpoint lazily, keeps its first Gated DeltaNet and first attention layer
(with the embedding, norms and lm_head), patches it, and runs mlx-lm's
``generate_step`` on prompts of :data:`PROMPT_TOKENS` tokens plus a few
decode steps and a batch-of-4 decode step; then it writes a marker for the
model's configuration into the compile cache (:func:`mark_warm`), which the
CLIs read to say, in one line, when a model's first run will compile. A CLI
run that printed that line and completed writes the marker too: its run
compiled what a first use needs, so the line does not come back.

``python -m mlx_qwen_fast warmup --model PATH`` runs it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Dict, Optional, Sequence

from . import backend, config
from ._cli import one_line_warnings

#: Prompt lengths run: 1..4 (the decode kernels), 12, 27, 60, 100 (MLX's
#: small-M quantised matmul tiles, MoE below the prefill kernels), 300 (the
#: prefill kernels) and 2,100 (two prefill chunks of mlx-lm's default 2,048:
#: attention over a cache).
PROMPT_TOKENS = (1, 3, 12, 27, 60, 100, 300, 2100)
_MARKER_PREFIX = "mlx_qwen_fast-warm-"


def _model_key(model_path: Path) -> str:
    """A hash of what decides the kernels a model needs: its config.json,
    the package's and MLX's versions, the GPU."""
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
    the environment does not name one (MLX's own default)."""
    value = config.mlx_ptx_cache_dir()
    return Path(value) if value else None


def marker_path(model_path) -> Optional[Path]:
    """The file that says a warm-up of this model's kernels completed, or
    None without a known compile cache folder."""
    cache = ptx_cache_dir()
    return None if cache is None else cache / f"{_MARKER_PREFIX}{_model_key(Path(model_path))}"


def is_warm(model_path) -> bool:
    """True when ``model_path``'s configuration was warmed up into the
    current compile cache, or there is nothing to warm up (not on CUDA, or
    no known cache folder)."""
    if backend.current() != backend.CUDA:
        return True
    marker = marker_path(model_path)
    return marker is None or marker.is_file()


def mark_warm(model_path, how: str) -> Optional[Path]:
    """Write the marker of ``model_path``'s configuration into the current
    compile cache (``how``: what compiled its kernels, kept in the marker).
    Returns the marker's path, or None without a known cache folder."""
    marker = marker_path(model_path)
    if marker is not None:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"model": str(model_path), "by": how}))
    return marker


def _run_model(model_path: Path, lengths: Sequence[int]) -> None:
    """The model cut to one layer of each kind, patched, run on prompts of
    ``lengths`` tokens and decoded a few steps, then a batch of 4."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    from .patching import patch

    model, _ = load_model(model_path, lazy=True)
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


def warmup(model_path, *, lengths: Sequence[int] = PROMPT_TOKENS) -> Dict:
    """Run the kernels a first use of ``model_path`` compiles (see the
    module docstring) and write the marker.

    Args:
        model_path: a local checkpoint folder (config.json, safetensors).
        lengths: prompt lengths to run.

    Returns:
        ``{"seconds", "ran"}`` (``ran`` False when there is nothing to do:
        not on CUDA).

    Raises:
        FileNotFoundError: ``model_path`` has no config.json.
    """
    model_path = Path(model_path)
    if not (model_path / "config.json").is_file():
        raise FileNotFoundError(f"warmup: {model_path} is not a checkpoint folder (no config.json)")
    if backend.current() != backend.CUDA:
        return {"seconds": 0.0, "ran": False}
    t0 = time.perf_counter()
    if config.MLX_COMPILES_AHEAD.get():  # MLX's slow modules in parallel first (mlx_compiles)
        from .mlx_compiles import start

        ahead = start(model_path)
        if ahead is not None:
            ahead.wait()
    _run_model(model_path, lengths)
    mark_warm(model_path, f"warmup, prompt lengths {list(lengths)}")
    return {"seconds": time.perf_counter() - t0, "ran": True}


@one_line_warnings()
def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m mlx_qwen_fast warmup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="local checkpoint folder")
    args = p.parse_args(argv)
    from ._cli_checks import check_checkpoint_folder
    from ._cli_parser import usage_error

    problem = check_checkpoint_folder(Path(os.path.expanduser(args.model)))
    if problem:
        usage_error(f"--model {args.model}: {problem}")
    if backend.current() == backend.CUDA:
        print("mlx_qwen_fast: compiling the GPU kernels of this model's first run (once per machine)",
              file=sys.stderr)
    result = warmup(os.path.expanduser(args.model))
    if not result["ran"]:
        print(f"mlx_qwen_fast: nothing to warm up on {backend.current()} "
              "(MLX compiles kernels at run time on CUDA only)", file=sys.stderr)
        return
    print(f"mlx_qwen_fast: warm-up of {args.model} done in {result['seconds']:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
