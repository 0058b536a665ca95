"""`python -m mlx_qwen_fast.generate`: `mlx_lm.generate` with the fast path installed.

Takes exactly ``mlx_lm.generate``'s flags, plus ``--stock`` to run stock
mlx-lm, ``--version``, and ``--dflash-drafter DIR`` to decode with a DFlash
block drafter (:mod:`mlx_qwen_fast.dflash.cli`); see
:func:`mlx_qwen_fast._cli.run_mlx_lm_main`.
"""

import sys

from ._cli import run_mlx_lm_main


def main() -> None:
    from .dflash import cli as dflash_cli

    argv, drafter = dflash_cli.take(sys.argv[1:])
    if "-h" in argv or "--help" in argv:
        print(f"mlx_qwen_fast: {dflash_cli.HELP}")
    elif drafter is not None:
        dflash_cli.check(argv, drafter)
    hook = None if drafter is None else (lambda module: dflash_cli.hook_generate(module, drafter))
    run_mlx_lm_main("mlx_lm.generate", argv, before_main=hook)


if __name__ == "__main__":
    main()
