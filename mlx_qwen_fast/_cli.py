"""Run one of mlx-lm's command-line entry points with the fast path installed."""

import os
import sys

from . import config
from .patch import install


def _model_arg(argv):
    """The value of ``--model`` in argv (mlx-lm's flag; its ``-m`` is
    ``--max-tokens``), or None."""
    for i, a in enumerate(argv):
        if a == "--model" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--model="):
            return a.split("=", 1)[1]
    return None


def _usage_error(message: str) -> None:
    """Print ``message`` to stderr and exit with code 2 (argparse's usage-error code)."""
    print(f"mlx_qwen_fast: {message}", file=sys.stderr)
    raise SystemExit(2)


def _check_local_model(argv) -> None:
    """Exit with a clear message (code 2) when ``--model`` is written as a
    local path (absolute, ``./``, ``../`` or ``~``) that is not a checkpoint
    folder (missing, or without ``config.json``); mlx-lm would take a missing
    one for a Hugging Face repo id and fail with a validation traceback, and
    fail deep inside its loader on a folder without a config. Other values
    (repo ids, checkpoint folders) go to mlx-lm as given."""
    model = _model_arg(argv)
    if not model or not model.startswith(("/", "./", "../", "~")):
        return
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        _usage_error(f"--model {model}: no such file or directory "
                     "(a local checkpoint folder; a Hugging Face repo is written namespace/name)")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        _usage_error(f"--model {model}: not a checkpoint folder (no config.json in it)")


def check_subcommand(argv) -> None:
    """Exit with a usage message (code 2) when ``python -m mlx_qwen_fast``
    has no subcommand, or one that is not an mlx-lm CLI module
    (``mlx_lm.<name>`` or ``mlx_lm.quant.<name>``); mlx-lm's dispatcher would
    raise a ValueError traceback. ``-h``, ``--help``, ``--version`` pass."""
    import importlib.util

    usage = ("usage: python -m mlx_qwen_fast SUBCOMMAND [--stock] [mlx-lm flags], SUBCOMMAND one of "
             "mlx-lm's (generate, chat, server, benchmark, ...; --help lists them)")
    if not argv:
        _usage_error(f"a subcommand is needed\n{usage}")
    sub = argv[0]
    if sub in ("-h", "--help", "--version"):
        return
    known = not sub.startswith("-") and sub.isidentifier() and any(
        importlib.util.find_spec(f"{pkg}.{sub}") is not None for pkg in ("mlx_lm", "mlx_lm.quant"))
    if not known:
        _usage_error(f"unknown subcommand {sub!r}\n{usage}")


def run_mlx_lm_main(main, argv=None) -> None:
    """Call ``main()`` (an mlx-lm CLI) with :func:`install` applied.

    ``--stock`` anywhere in ``argv`` skips the install and undoes what the
    import set in the environment (``config.restore_process_settings``), so
    the same command runs stock mlx-lm for an A/B comparison.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    stock = "--stock" in argv
    argv = [a for a in argv if a != "--stock"]
    _check_local_model(argv)
    if "-h" in argv or "--help" in argv:
        print("mlx_qwen_fast: mlx-lm's own flags follow; add --stock to run stock mlx-lm "
              "(MLX_QWEN_FAST=0 does the same).\n")
    if stock:
        config.restore_process_settings()
        print("mlx_qwen_fast: --stock: running stock mlx-lm", file=sys.stderr)
    else:
        install(verbose=True)
    sys.argv = [sys.argv[0]] + argv
    main()
