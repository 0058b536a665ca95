"""``--dflash-drafter DIR`` for the package's generate CLI.

``python -m mlx_qwen_fast.generate --model TARGET --dflash-drafter DIR
[mlx-lm's generate flags]`` runs ``mlx_lm.generate``'s own CLI with the
fast path, its generation going through the DFlash loop
(:func:`mlx_qwen_fast.dflash.loop.speculative_step`, reached through
mlx-lm's draft-model path). The flag is taken out of the arguments before
mlx-lm parses them; the folder is checked first (one line, exit code 2,
before mlx-lm is imported: a missing folder, no or bad config.json, a
config that is not a DFlash drafter's, no weights), then loaded and
checked against the target once mlx-lm has loaded it (a drafter that does
not fit the target: one line, exit code 2). With ``--verbose`` the
acceptance is printed after mlx-lm's timing lines. ``--draft-model`` and
``--stock`` cannot go with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from .._cli import _safetensors_problem, folder_config, usage_error

FLAG = "--dflash-drafter"
HELP = (f"{FLAG} DIR: speculative decoding with a DFlash block drafter (a folder in z-lab's layout: config.json "
        "and model*.safetensors); the drafter's block size replaces --num-draft-tokens.")


def take(argv: Sequence[str]) -> Tuple[List[str], Optional[str]]:
    """``argv`` without ``--dflash-drafter DIR`` / ``--dflash-drafter=DIR``,
    and DIR (None when the flag is absent). The flag given twice, or
    without a value: usage error (exit code 2)."""
    out, found = [], []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == FLAG:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                usage_error(f"{FLAG}: expected a drafter folder after it")
            found.append(argv[i + 1])
            i += 2
            continue
        if a.startswith(FLAG + "="):
            found.append(a.split("=", 1)[1])
        else:
            out.append(a)
        i += 1
    if len(found) > 1:
        usage_error(f"{FLAG} given {len(found)} times: expected one drafter folder")
    return out, (found[0] if found else None)


def folder_problem(path: Path) -> Optional[str]:
    """None when ``path`` looks like a DFlash drafter folder, else what is
    wrong (one line). Reads config.json and the safetensors headers only."""
    from .drafter import DrafterArgs

    config, problem = folder_config(path, "drafter", "config.json, model*.safetensors")
    if problem:
        return problem
    try:
        DrafterArgs.from_dict(config, "x", light=True)
    except ValueError as exc:
        return str(exc).split(": ", 1)[1]
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        return "no weights (model*.safetensors) in the folder"
    for f in files:
        problem = _safetensors_problem(f)
        if problem:
            return problem
    return None


def check(argv: Sequence[str], folder: str) -> None:
    """The usage errors of ``--dflash-drafter`` (exit code 2, one line):
    a bad folder, ``--draft-model`` or ``--stock`` with it."""
    if "--stock" in argv:
        usage_error(f"{FLAG} needs the fast path (its Gated DeltaNet caches roll back): drop --stock")
    if any(a == "--draft-model" or a.startswith("--draft-model=") for a in argv):
        usage_error(f"{FLAG} and --draft-model cannot both be given (one speculative drafter)")
    problem = folder_problem(Path(folder).expanduser())
    if problem:
        usage_error(f"{FLAG} {folder}: {problem}")


def hook_generate(module, folder: str) -> None:
    """Make ``module`` (``mlx_lm.generate``)'s ``generate``, as its ``main``
    calls it, load the drafter from ``folder``, check it against the loaded
    target, and decode with it (mlx-lm's ``draft_model``)."""
    import sys

    from . import capture
    from .drafter import load_drafter
    from .loop import DFlashStats

    stock = module.generate

    def generate(model, tokenizer, prompt, verbose=False, **kwargs):
        try:
            drafter = load_drafter(Path(folder).expanduser())
            capture.check_target(model, drafter)
        except ValueError as exc:
            usage_error(f"{FLAG} {folder}: {' '.join(str(exc).split())}")
        stats = DFlashStats()
        kwargs.update(draft_model=drafter, stats=stats)
        text = stock(model, tokenizer, prompt, verbose=verbose, **kwargs)
        if verbose:
            print(f"DFlash: {stats.blocks} verify passes, {100 * stats.acceptance:.1f}% of drafts accepted, "
                  f"{stats.tokens_per_block:.2f} tokens per pass", file=sys.stdout)
        return text

    module.generate = generate
