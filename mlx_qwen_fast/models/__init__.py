"""mlx-lm model modules registered by this package (see :func:`register`)."""

import importlib
import importlib.abc
import importlib.util
import sys

#: mlx-lm module name -> this package's module that provides it.
_ALIASES = {"mlx_lm.models.qwen3_5_moe_fast": "mlx_qwen_fast.models.qwen3_5_moe_fast"}


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module):
        pass  # already executed as self.target


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds the modules of :data:`_ALIASES` (mlx-lm imports a model type's
    module by name, ``mlx_lm.models.<model_type>``, when it loads a model)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in _ALIASES:
            return importlib.util.spec_from_loader(fullname, _AliasLoader(_ALIASES[fullname]))
        return None


def register() -> None:
    """Make ``mlx_lm.models.qwen3_5_moe_fast`` importable (for ``mlx_lm.load``)
    without importing mlx-lm now: a finder on ``sys.meta_path`` resolves the
    name to :mod:`mlx_qwen_fast.models.qwen3_5_moe_fast` when mlx-lm asks.
    Idempotent."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())
