"""mlx_qwen_fast: fast prefill and decode for Qwen3.5/3.6-MoE models in MLX.

Usage::

    import mlx_lm, mlx_qwen_fast
    model, tokenizer = mlx_lm.load("mlx-community/Qwen3.6-35B-A3B-4bit")
    print(mlx_qwen_fast.patch(model))      # PatchReport
    # or: mlx_qwen_fast.install() before any mlx_lm.load / CLI entry point

Importing the package is light (MLX's core, no mlx-lm): it sets MLX's
process-wide variables (:func:`mlx_qwen_fast.config.apply_process_settings`)
and registers the model type ``qwen3_5_moe_fast`` with mlx-lm's loader; the
public functions below load :mod:`mlx_qwen_fast.patching` and
:mod:`mlx_qwen_fast.patch_report` (and so mlx-lm) on first use, so the CLIs
can check their arguments first.
"""

from . import backend as _backend
from . import config as _config

# before MLX's first GPU evaluation and first run-time compile: see its docstring
_config.apply_process_settings(_backend.current())

from .models import register as _register  # noqa: E402

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


#: The public names :mod:`.patch_report` holds; the others are :mod:`.patching`'s.
_HOMES = {"PatchReport": "patch_report", "op_implementations": "patch_report"}


def __getattr__(name):
    # PEP 562: the public API from .patching and .patch_report, imported on first access
    if name in __all__:
        import importlib

        value = getattr(importlib.import_module(f".{_HOMES.get(name, 'patching')}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mlx_qwen_fast' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


_register()
