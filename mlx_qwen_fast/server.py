"""`python -m mlx_qwen_fast.server`: `mlx_lm.server` with the fast path installed.

Takes exactly ``mlx_lm.server``'s flags, plus ``--stock`` to run stock
mlx-lm and ``--version``; see :func:`mlx_qwen_fast._cli.run_mlx_lm_main`.
"""

from ._cli import run_mlx_lm_main


def main() -> None:
    run_mlx_lm_main("mlx_lm.server")


if __name__ == "__main__":
    main()
