"""`python -m mlx_qwen_fast.generate`: `mlx_lm.generate` with the fast path installed.

Takes exactly ``mlx_lm.generate``'s flags, plus ``--stock`` to run stock
mlx-lm and ``--version``; see :func:`mlx_qwen_fast._cli.run_mlx_lm_main`.
"""

from ._cli import run_mlx_lm_main


def main() -> None:
    run_mlx_lm_main("mlx_lm.generate")


if __name__ == "__main__":
    main()
