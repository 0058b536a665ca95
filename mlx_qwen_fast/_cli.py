"""Run one of mlx-lm's command-line entry points with the fast path installed."""

import sys

from .patch import install


def run_mlx_lm_main(main, argv=None) -> None:
    """Call ``main()`` (an mlx-lm CLI) with :func:`install` applied.

    ``--stock`` anywhere in ``argv`` skips the install, so the same command
    runs stock mlx-lm for an A/B comparison.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    stock = "--stock" in argv
    argv = [a for a in argv if a != "--stock"]
    if "-h" in argv or "--help" in argv:
        print("mlx_qwen_fast: mlx-lm's own flags follow; add --stock to run stock mlx-lm "
              "(MLX_QWEN_FAST=0 does the same).\n")
    if stock:
        print("mlx_qwen_fast: --stock: running stock mlx-lm", file=sys.stderr)
    else:
        install(verbose=True)
    sys.argv = [sys.argv[0]] + argv
    main()
