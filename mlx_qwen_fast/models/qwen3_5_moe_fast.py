"""Model type ``qwen3_5_moe_fast``: mlx-lm's ``qwen3_5_moe`` with the fast path.

Registered as ``mlx_lm.models.qwen3_5_moe_fast`` when ``mlx_qwen_fast`` is
imported, so ``mlx_lm.load(path, model_config={"model_type":
"qwen3_5_moe_fast"})`` or a config.json naming this type loads a patched model.
The classes are mlx-lm's own; the fast modules are swapped in at construction
(same parameter names, so the checkpoint loads unchanged).
"""

import dataclasses

from mlx_lm.models.qwen3_5_moe import Model as _StockModel
from mlx_lm.models.qwen3_5_moe import ModelArgs

from ..patching import _set_report, patch

__all__ = ["Model", "ModelArgs"]


class Model(_StockModel):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        patch(self)  # keeps its report as self.patch_report

    def load_weights(self, *args, **kwargs):
        """mlx-lm's ``load_weights``, then the patch again: mlx-lm quantises
        the model between construction and this call (``nn.quantize``
        replaces the lm_head's ``nn.Linear`` the constructor's patch saw with
        a stock ``QuantizedLinear``), so the head is swapped and the kernel
        decisions are made on the quantised modules here (no second warning);
        the report counts the modules both patches swapped."""
        out = super().load_weights(*args, **kwargs)
        first = getattr(self, "patch_report", None)
        report = patch(self, warn=False)
        if report is not first and getattr(first, "patched", False) and report.patched:
            swapped = dict(first.swapped)
            for slot, n in report.swapped.items():
                swapped[slot] = swapped.get(slot, 0) + n
            _set_report(self, dataclasses.replace(report, swapped=swapped))
        return out
