"""`python -m mlx_qwen_fast.demo`: stock vs patched greedy generation, side by side.

With no arguments it builds the tiny random-weight checkpoint (with the
non-flat lm_head scale of :data:`mlx_qwen_fast.checkpoint.DEMO_LM_HEAD_SCALE`,
so greedy choices are not near-ties) in a cache folder if absent, then runs
stock mlx-lm and the patched model (sharing the same weight arrays) on a chat
prompt, prints both texts, whether the tokens are identical, and prefill /
decode tok/s for each. Exit code 1 when the tokens differ.

``--model PATH`` runs the same comparison on any Qwen3.5/3.6 checkpoint.

Activations run in float32 by default (``--dtype bfloat16`` for the stored
dtype): on random weights, two code paths whose bf16 rounding differs pick
different greedy tokens at near-ties whatever the lm_head scale (bf16 vs fp32
of the *same* stock model agree on only ~80% of the tiny model's tokens), so
only fp32 makes token identity a check of the code rather than of rounding.

The arguments are checked before mlx-lm is imported: each usage error is one
line, exit code 2 (:class:`mlx_qwen_fast._cli_parser.ArgumentParser`).
"""

import sys
from pathlib import Path

import mlx.core as mx

from . import config
from ._cli import one_line_warnings
from ._cli_checks import check_checkpoint_folder
from ._cli_parser import ArgumentParser, whole_number
from .checkpoint import DEMO_LM_HEAD_SCALE, SHARD_GLOB, write_checkpoint

# mlx-lm and .patching (which imports it) are imported where they are used,
# after the arguments are checked.

DEFAULT_PROMPT = "Explain in one paragraph why the sky looks blue during the day."


def default_checkpoint_dir() -> Path:
    """Cache folder of the demo checkpoint (``tiny-demo`` under
    :func:`mlx_qwen_fast.config.cache_root`)."""
    return config.cache_root() / "tiny-demo"


def ensure_demo_checkpoint(path: Path) -> Path:
    """Write the tiny demo checkpoint to ``path`` unless it is already there
    (its config, tokenizer and weights; anything missing is rewritten)."""
    complete = all((path / n).exists() for n in ("config.json", "tokenizer.json", "tokenizer_config.json"))
    if not complete or not any(path.glob(SHARD_GLOB)):
        print(f"Creating the tiny demo checkpoint in {path} ...")
        write_checkpoint(path, preset="tiny", seed=0, lm_head_scale=DEMO_LM_HEAD_SCALE)
    return path


def run(model, tokenizer, prompt, max_tokens):
    """Greedy generation; returns (token ids, text, last GenerationResponse)."""
    from mlx_lm.generate import stream_generate

    tokens, text, last = [], "", None
    for response in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        tokens.append(response.token)
        text += response.text
        last = response
    return tokens, text, last


@one_line_warnings()
def main(argv=None) -> int:
    """``python -m mlx_qwen_fast.demo``: check the arguments, then compare
    stock and patched greedy generation (see the module docstring). Returns
    the exit code: 0 when the tokens are identical, else 1."""
    parser = ArgumentParser(prog="python -m mlx_qwen_fast.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="checkpoint directory (default: tiny demo)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-tokens", type=whole_number(1), default=64)
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32",
        help="activation dtype (default float32: bf16 rounding alone flips greedy tokens at near-ties "
             "on random weights, so only fp32 makes token identity a check of the code)",
    )
    args = parser.parse_args(argv)
    if args.model is not None:
        problem = check_checkpoint_folder(args.model)
        if problem:
            parser.error(f"--model {args.model}: {problem}")
    if not args.prompt.strip():
        parser.error("--prompt is empty: expected the text to continue")

    import mlx_lm

    from .patching import patched_copy

    path = args.model or ensure_demo_checkpoint(default_checkpoint_dir())
    try:
        stock, tokenizer = mlx_lm.load(str(path))
    except (RuntimeError, ValueError, OSError) as exc:
        if args.model is not None:  # e.g. a config.json that is not JSON, no weight files
            parser.error(f"--model {args.model}: could not load a checkpoint from it "
                         f"({type(exc).__name__}: {exc})")
        raise SystemExit(f"could not load the demo checkpoint in {path} ({exc}); it may be damaged "
                         f"(an interrupted first run): delete that folder and run the demo again") from exc
    if args.dtype == "float32":
        stock.set_dtype(mx.float32)  # 4-bit weights stay; scales, norms upcast
    fast, report = patched_copy(stock, warn=False)  # said once, by one of the two lines below
    if report.patched:
        print(report)
    else:
        print(f"note: the fast path is not in use ({report.reason}): both runs below are stock mlx-lm")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": args.prompt}], add_generation_prompt=True
    )

    run(stock, tokenizer, prompt, 4)  # warm-up (compiles, allocates)
    run(fast, tokenizer, prompt, 4)
    results = {}
    for name, model in (("stock", stock), ("patched", fast)):
        results[name] = run(model, tokenizer, prompt, args.max_tokens)
        _, text, r = results[name]
        label = name if name == "stock" or report.patched else "patched (left stock)"
        print(f"\n=== {label} ===\n{text}")
        print(
            f"[{name}] prompt {r.prompt_tokens} tokens at {r.prompt_tps:.1f} tok/s, "
            f"{r.generation_tokens} generated at {r.generation_tps:.1f} tok/s, "
            f"peak {r.peak_memory:.3f} GB"
        )

    a, b = results["stock"][0], results["patched"][0]
    same = a == b
    print(f"\ndevice: {mx.default_device()}  dtype: {args.dtype}  tokens identical: {same}")
    if not same:
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print(f"first difference at generated token {first}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
