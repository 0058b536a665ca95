"""`python -m mlx_qwen_fast.generate`: `mlx_lm.generate` with the fast path installed.

Takes exactly ``mlx_lm.generate``'s flags, plus ``--stock`` to run stock
mlx-lm, ``--version``, and ``--dflash-drafter DIR`` to decode with a DFlash
block drafter (:mod:`mlx_qwen_fast.dflash.cli`); see
:func:`mlx_qwen_fast._cli.run_mlx_lm_main`.
"""


def main() -> None:
    from .dflash import cli as dflash_cli

    dflash_cli.run("mlx_lm.generate", dflash_cli.hook_generate)


if __name__ == "__main__":
    main()
