"""`python -m mlx_qwen_fast SUBCOMMAND ...`: any mlx-lm subcommand with the fast path.

E.g. ``python -m mlx_qwen_fast benchmark --model PATH -p 4096 -g 128`` runs
``mlx_lm.benchmark`` on the patched model; add ``--stock`` for stock mlx-lm.
"""

import sys

from mlx_lm.cli import main as _mlx_lm_cli

from ._cli import check_subcommand, run_mlx_lm_main

if __name__ == "__main__":
    check_subcommand(sys.argv[1:])
    run_mlx_lm_main(_mlx_lm_cli)
