"""``--dflash-drafter DIR`` for the package's generate and server CLIs.

``python -m mlx_qwen_fast.generate --model TARGET --dflash-drafter DIR
[mlx-lm's generate flags]`` runs ``mlx_lm.generate``'s own CLI with the
fast path, its generation going through the DFlash loop
(:func:`mlx_qwen_fast.dflash.loop.speculative_step`, reached through
mlx-lm's draft-model path). ``python -m mlx_qwen_fast.server --model
TARGET --dflash-drafter DIR [mlx-lm's server flags]`` serves with it: the
drafter becomes the server's draft model each time mlx-lm loads the target
(:func:`hook_server`), so requests run mlx-lm's one-at-a-time speculative
path, as with ``--draft-model``. The flag is taken out of the arguments before
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

from .._cli_checks import folder_config, weights_problem
from .._cli_parser import take_flag, usage_error

FLAG = "--dflash-drafter"
HELP = (f"{FLAG} DIR: speculative decoding with a DFlash block drafter (a folder in z-lab's layout: config.json "
        "and model*.safetensors); the drafter's block size replaces --num-draft-tokens.")


def take(argv: Sequence[str]) -> Tuple[List[str], Optional[str]]:
    """``argv`` without ``--dflash-drafter DIR`` / ``--dflash-drafter=DIR``,
    and DIR (None when the flag is absent). The flag given twice, or
    without a value: usage error (exit code 2)."""
    return take_flag(argv, FLAG, "a drafter folder")


def run(module: str, hook) -> None:
    """Run mlx-lm's CLI ``module`` (``mlx_lm.generate`` or ``mlx_lm.server``)
    with the fast path and ``--dflash-drafter``: the flag taken out and
    checked, and ``hook(mlx_lm_module, folder)`` applied before mlx-lm's
    ``main`` when it is given (:func:`hook_generate`, :func:`hook_server`)."""
    import sys

    from .._cli import run_mlx_lm_main

    argv, drafter = take(sys.argv[1:])
    if "-h" in argv or "--help" in argv:
        print(f"mlx_qwen_fast: {HELP}")
    elif drafter is not None:
        check(argv, drafter)
    before = None if drafter is None else (lambda mod: hook(mod, drafter))
    run_mlx_lm_main(module, argv, before_main=before)


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
    return weights_problem(sorted(path.glob("model*.safetensors")))


def check(argv: Sequence[str], folder: str) -> None:
    """The usage errors of ``--dflash-drafter`` (exit code 2, one line):
    a bad folder, ``--draft-model`` or ``--stock`` with it, the fast path
    switched off by the environment (either CLI)."""
    if "--stock" in argv:
        usage_error(f"{FLAG} needs the fast path (its Gated DeltaNet caches roll back): drop --stock")
    from .. import config

    if not config.FAST_PATH.get():
        usage_error(f"{FLAG} needs the fast path (its Gated DeltaNet caches roll back): "
                    f"{config.FAST_PATH.name} switches it off in the environment")
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


class _DrafterMismatch(ValueError):
    """The drafter does not fit the target the server loaded."""


def hook_server(module, folder: str) -> None:
    """Make ``module`` (``mlx_lm.server``)'s ``ModelProvider`` load the
    drafter from ``folder`` as its draft model after each load of a target,
    checked against it (:func:`~mlx_qwen_fast.dflash.capture.check_target`):
    the server then serves one request at a time through mlx-lm's
    speculative path (``is_batchable`` False, as with ``--draft-model``),
    which runs the DFlash loop for a DFlash drafter. A drafter that does not
    fit the target loaded at start (``--model``) ends the process with one
    line (exit code 2), before the server answers anything: mlx-lm loads it
    in its generation thread, where an exception would leave the server
    up with no thread to answer. For a target a request names later it
    raises ``ValueError`` (naming ``drafter``), which mlx-lm answers as a
    failed request."""
    import os
    import sys

    from . import capture
    from .drafter import load_drafter

    provider = module.ModelProvider
    stock_load, stock_default = provider._load, provider.load_default

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        stock_load(self, model_path, adapter_path, draft_model_path)
        try:
            drafter = load_drafter(Path(folder).expanduser())
            capture.check_target(self.model, drafter)
        except ValueError as exc:
            raise _DrafterMismatch(str(exc)) from exc
        self.draft_model = drafter
        self.is_batchable = False  # mlx-lm's batch generator has no draft model
        print(f"mlx_qwen_fast: draft model: the DFlash drafter in {folder} (block {drafter.block_size}, "
              f"target layers {list(drafter.target_layer_ids)})", file=sys.stderr, flush=True)

    def load_default(self):
        try:
            stock_default(self)
        except _DrafterMismatch as exc:
            print(f"mlx_qwen_fast: error: {FLAG} {folder}: {' '.join(str(exc).split())}", file=sys.stderr,
                  flush=True)
            os._exit(2)  # from mlx-lm's generation thread: sys.exit would end that thread alone

    _load.dflash_folder = folder
    provider._load, provider.load_default = _load, load_default
