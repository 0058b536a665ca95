"""What :func:`mlx_qwen_fast.patch` reports: :class:`PatchReport`, and the
implementation each op runs (:func:`op_implementations`).

The prefill rows of the table are the op families' dispatchers' choice for
a prefill chunk (``implementation_for``); the decode rows are the decode
planner's (:func:`mlx_qwen_fast.ops.decoder.decode_routes`). For a patched
model the table is then narrowed by what each fast module's op family
decided from its weights (:func:`apply_declines`): an op whose kernels
declined every layer's weights reports "stock", and the reason with the
count of layers goes into :attr:`PatchReport.declined`, warned about once
per op and reason (:func:`warn_declined`).
"""

import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import mlx.nn as nn

from . import backend
from .ops import attention as attention_ops
from .ops import decoder as decoder_ops
from .ops import gated_delta as gated_delta_ops
from .ops import linear as linear_ops
from .ops import moe as moe_ops

__all__ = ["FAMILIES", "PatchReport", "apply_declines", "declined_text", "op_implementations", "op_table",
           "warn_declined"]

_PREFILL_TOKENS = 2048  # mlx-lm's default prefill_step_size, for the report
#: The op families whose modules decide which kernels may run for them:
#: (report name, dispatcher module).
FAMILIES = (("gated_delta", gated_delta_ops), ("moe", moe_ops))
_PHASES = (("prefill", _PREFILL_TOKENS), ("decode", 1))


@dataclass
class PatchReport:
    """What :func:`mlx_qwen_fast.patching.patch` did.

    Attributes:
        patched: True if the fast modules are in place.
        reason: why the model was left stock (None when patched).
        model_type: the model's ``model_type``.
        backend: "cpu", "cuda" or "metal" (the default device's backend).
        swapped: number of modules swapped per slot (``linear_attn``,
            ``mlp``, ``self_attn``), and of decoder layers and layer
            stacks swapped in place (``decoder_layer``, ``layer_stack``).
        ops: implementation each op uses on this backend, e.g.
            ``{"gated_delta.prefill": "chunked", "moe.decode": "stock"}``
            ("stock" also where the backend's kernel declined the weights'
            quantisation in every layer: see ``declined``).
        declined: ops whose kernel implementation on this backend declined
            this model's weights, with why and in how many layers, e.g.
            ``{"moe.prefill": "moe experts: 3-bit weights
            (switch_mlp.gate_proj) in 40 of 40 layers"}``; those layers run
            the op stock. Empty where nothing was declined, and on backends
            without kernels.
        graph_limit: on CUDA, MLX's variables that the import sets where
            the user has not, as they stand and who set them
            (:func:`mlx_qwen_fast.config.process_settings_report`); empty
            elsewhere.
    """

    patched: bool
    reason: Optional[str] = None
    model_type: str = ""
    backend: str = ""
    swapped: Dict[str, int] = field(default_factory=dict)
    ops: Dict[str, str] = field(default_factory=dict)
    graph_limit: str = ""
    declined: Dict[str, str] = field(default_factory=dict)

    def __str__(self):
        if not self.patched:
            return f"mlx_qwen_fast: left stock ({self.reason})"
        swapped = ", ".join(f"{n} {k}" for k, n in self.swapped.items()) or "nothing new"
        ops = ", ".join(f"{k}={v}" for k, v in self.ops.items())
        declined = "".join(f"; {k} kernel declined: {v}" for k, v in self.declined.items())
        tail = f"; {self.graph_limit}" if self.graph_limit else ""
        return f"mlx_qwen_fast: patched {swapped} on {self.backend}; ops: {ops}{declined}{tail}"


def op_implementations(backend_name: Optional[str] = None) -> Dict[str, str]:
    """Implementation of each op family for prefill and decode on a backend.

    The prefill rows are the op families' dispatchers' choice for a
    prefill chunk (``implementation_for``); the decode rows are the decode
    planner's (:func:`mlx_qwen_fast.ops.decoder.decode_routes`).

    Args:
        backend_name: ``"cpu" | "cuda" | "metal"`` (the implementations that
            would run there on this machine: a GPU backend without its device
            falls back as the ops do), or None for the current backend.

    Returns:
        ``{"<family>.prefill" | "<family>.decode": implementation name}``.

    Raises:
        ValueError: an unknown backend name (the empty string included).
    """
    return op_table(backend.resolve(backend_name), None)


def op_table(b: str, model: Optional[nn.Module]) -> Dict[str, str]:
    """:func:`op_implementations` on backend ``b``; with ``model``, its
    decode rows narrowed to the model's weights (see
    :func:`mlx_qwen_fast.ops.decoder.decode_routes`)."""
    decode = decoder_ops.decode_routes(b, model).table()
    table = {}
    for name, module in FAMILIES:
        table[f"{name}.prefill"] = module.implementation_for(_PREFILL_TOKENS, b)
        table[f"{name}.decode"] = decode[f"{name}.decode"]
    table["attention.prefill"] = attention_ops.implementation_for(_PREFILL_TOKENS, b)
    table["linear.prefill"] = linear_ops.prefill_implementation_for(_PREFILL_TOKENS, b)
    table.update(decode)  # the attention, projections, head and whole-step rows, in the planner's order
    return table


#: Report names decided under another implementation's name: the one-launch MoE
#: block reads the expert weights as the MoE decode kernels do, and is declined with them.
_DECIDED_AS = {"cuda-block": "cuda-decode"}


def apply_declines(table: Dict[str, str], decisions) -> Dict[str, List[Tuple[str, int, int]]]:
    """Mark the ops of ``table`` whose implementation modules declined:
    "stock" where every module of the family declined it. Returns ``{op:
    [(reason, layers declining for it, layers of the family)]}``."""
    declined = {}
    for name, _ in FAMILIES:
        per_family = [d for n, d in decisions if n == name]
        for phase, _ in _PHASES:
            key = f"{name}.{phase}"
            counts: Dict[str, int] = {}
            impl = _DECIDED_AS.get(table[key], table[key])
            for d in per_family:
                if impl in d:
                    counts[d[impl]] = counts.get(d[impl], 0) + 1
            if counts:
                declined[key] = [(r, n, len(per_family)) for r, n in counts.items()]
                if sum(counts.values()) == len(per_family):
                    table[key] = "stock"
    return declined


def warn_declined(declined: Dict[str, List[Tuple[str, int, int]]]) -> None:
    """One warning per op and reason (the layers that share a reason are
    counted in it, not warned about one by one)."""
    formats = {name: getattr(module, "KERNEL_QUANTIZATION", None) for name, module in FAMILIES}
    for op, reasons in declined.items():
        fmt = formats[op.split(".", 1)[0]]
        implement = f"; the kernels implement {fmt}" if fmt else ""
        for reason, n, total in reasons:
            # stacklevel 3: the line of patching.patch (or patched_copy) that called its _patch
            warnings.warn(f"mlx_qwen_fast: {op} runs stock in {n} of {total} layers: {reason}{implement}",
                          stacklevel=3)


def declined_text(declined: Dict[str, List[Tuple[str, int, int]]]) -> Dict[str, str]:
    """:func:`apply_declines`' result as :attr:`PatchReport.declined` holds it:
    ``{op: "reason in N of M layers; ..."}``."""
    return {op: "; ".join(f"{r} in {n} of {t} layers" for r, n, t in reasons)
            for op, reasons in declined.items()}
