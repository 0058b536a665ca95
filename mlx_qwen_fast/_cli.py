"""Run one of mlx-lm's command-line entry points with the fast path installed."""

import os
import sys

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


def _check_local_model(argv) -> None:
    """Exit with a clear message (code 2) when ``--model`` is written as a
    local path (absolute, ``./``, ``../`` or ``~``) that does not exist; mlx-lm
    would take it for a Hugging Face repo id and fail with a validation
    traceback. Other values (repo ids, existing paths) go to mlx-lm as given."""
    model = _model_arg(argv)
    if not model or not model.startswith(("/", "./", "../", "~")):
        return
    if not os.path.exists(os.path.expanduser(model)):
        raise SystemExit(f"mlx_qwen_fast: --model {model}: no such file or directory "
                         "(a local checkpoint folder; a Hugging Face repo is written namespace/name)")


def run_mlx_lm_main(main, argv=None) -> None:
    """Call ``main()`` (an mlx-lm CLI) with :func:`install` applied.

    ``--stock`` anywhere in ``argv`` skips the install, so the same command
    runs stock mlx-lm for an A/B comparison.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    stock = "--stock" in argv
    argv = [a for a in argv if a != "--stock"]
    _check_local_model(argv)
    if "-h" in argv or "--help" in argv:
        print("mlx_qwen_fast: mlx-lm's own flags follow; add --stock to run stock mlx-lm "
              "(MLX_QWEN_FAST=0 does the same).\n")
    if stock:
        print("mlx_qwen_fast: --stock: running stock mlx-lm", file=sys.stderr)
    else:
        install(verbose=True)
    sys.argv = [sys.argv[0]] + argv
    main()
