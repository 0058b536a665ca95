"""`python -m mlx_qwen_fast.server`: `mlx_lm.server` with the fast path installed.

Takes exactly ``mlx_lm.server``'s flags, plus ``--stock`` to run stock mlx-lm.
"""

from mlx_lm.server import main as _main

from ._cli import run_mlx_lm_main


def main() -> None:
    run_mlx_lm_main(_main)


if __name__ == "__main__":
    main()
