"""``python -m mlx_qwen_fast.checkpoint``: :func:`mlx_qwen_fast.checkpoint.cli.main`."""

from .cli import main

if __name__ == "__main__":
    main()
