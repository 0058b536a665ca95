"""mlx-lm model modules registered by this package (see ``register``)."""

import sys

import mlx_lm.models


def register() -> None:
    """Make ``mlx_lm.models.qwen3_5_moe_fast`` importable (for ``mlx_lm.load``)."""
    from . import qwen3_5_moe_fast

    sys.modules.setdefault("mlx_lm.models.qwen3_5_moe_fast", qwen3_5_moe_fast)
    mlx_lm.models.qwen3_5_moe_fast = qwen3_5_moe_fast
