"""`python -m mlx_qwen_fast SUBCOMMAND ...`: any mlx-lm subcommand with the fast path.

E.g. ``python -m mlx_qwen_fast benchmark --model PATH -p 4096 -g 128`` runs
``mlx_lm.benchmark`` on the patched model; add ``--stock`` for stock mlx-lm.
``python -m mlx_qwen_fast warmup --model PATH`` compiles the GPU kernels a
first run would compile (:mod:`mlx_qwen_fast.warmup`); ``--version`` prints
this package's version with mlx's and mlx-lm's.
"""

import sys

from ._cli import check_subcommand, run_mlx_lm_main, subcommands, versions


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--version"]:
        print(versions())
        return
    if argv[:1] == ["warmup"]:
        from .warmup import main as warmup_main

        warmup_main(argv[1:])
        return
    check_subcommand(argv)
    if argv[0] in ("-h", "--help"):
        print("usage: python -m mlx_qwen_fast SUBCOMMAND [--stock] [mlx-lm flags]\n"
              "  SUBCOMMAND: warmup (this package: compile the GPU kernels ahead of the first run),\n"
              f"  or one of mlx-lm's: {', '.join(subcommands())}\n"
              "  python -m mlx_qwen_fast SUBCOMMAND --help: that subcommand's flags")
        return
    sub = argv[0]
    module = f"mlx_lm.quant.{sub}" if sub in ("awq", "dwq", "dynamic_quant", "gptq") else f"mlx_lm.{sub}"
    sys.argv = [f"mlx_qwen_fast {sub}"]  # argparse's prog in mlx-lm's usage lines
    run_mlx_lm_main(module, argv[1:])


if __name__ == "__main__":
    main()
