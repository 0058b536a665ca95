"""mlx_qwen_fast: fast prefill and decode for Qwen3.5/3.6-MoE models in MLX.

Usage::

    import mlx_lm, mlx_qwen_fast
    model, tokenizer = mlx_lm.load("mlx-community/Qwen3.6-35B-A3B-4bit")
    print(mlx_qwen_fast.patch(model))      # PatchReport
    # or: mlx_qwen_fast.install() before any mlx_lm.load / CLI entry point
"""

from . import backend as _backend
from . import config as _config

# before MLX's first GPU evaluation and first run-time compile: see its docstring
_config.apply_process_settings(_backend.current())

from .models import register as _register  # noqa: E402
from .patch import (  # noqa: E402
    PatchReport,
    install,
    is_patched,
    op_implementations,
    patch,
    patched_copy,
    uninstall,
    unpatch,
)

__version__ = "0.1.0"

__all__ = [
    "PatchReport",
    "install",
    "is_patched",
    "op_implementations",
    "patch",
    "patched_copy",
    "uninstall",
    "unpatch",
]

_register()
