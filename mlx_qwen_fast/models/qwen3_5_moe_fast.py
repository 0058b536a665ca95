"""Model type ``qwen3_5_moe_fast``: mlx-lm's ``qwen3_5_moe`` with the fast path.

Registered as ``mlx_lm.models.qwen3_5_moe_fast`` when ``mlx_qwen_fast`` is
imported, so ``mlx_lm.load(path, model_config={"model_type":
"qwen3_5_moe_fast"})`` or a config.json naming this type loads a patched model.
The classes are mlx-lm's own; the fast modules are swapped in at construction
(same parameter names, so the checkpoint loads unchanged).
"""

from mlx_lm.models.qwen3_5_moe import Model as _StockModel
from mlx_lm.models.qwen3_5_moe import ModelArgs

from ..patching import patch

__all__ = ["Model", "ModelArgs"]


class Model(_StockModel):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        patch(self)  # keeps its report as self.patch_report
