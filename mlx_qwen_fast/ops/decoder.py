"""The decode planner: which route a decode token (one token per row)
takes, decided here alone from the switches (:mod:`mlx_qwen_fast.config`,
read per call): the whole layer stack as one compiled call
(:func:`model_step` -> :func:`mlx_qwen_fast.ops.model_plan.decode_model`),
else each layer as one (:func:`layer_step` ->
:func:`mlx_qwen_fast.ops.layer_plans.decode_layer`), else each module's own
dispatch entry (:func:`mlx_qwen_fast.ops.gated_delta.gated_delta_net`,
:func:`mlx_qwen_fast.ops.moe.sparse_moe`,
:func:`mlx_qwen_fast.ops.attention.gated_attention`), else stock. Each
step's kernels are chosen by its op family when the step is planned
(``decode_step_parts`` of each family) and baked into the compiled step
that the layer's plan holds (:mod:`mlx_qwen_fast.ops.layer_plans`).
:func:`decode_routes` names the routes and kernels for the patch report
(:func:`mlx_qwen_fast.patch_report.op_implementations`) from the same switches
and the families' dispatchers. The KV buffers the compiled steps write
are :mod:`mlx_qwen_fast.ops.kv_buffers`'.
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional

import mlx.core as mx

from .. import backend as _backend
from .. import config
from . import attention as attention_ops
from . import gated_delta as gated_delta_ops
from . import linear as linear_ops
from . import moe as moe_ops
from .layer_plans import decode_layer
from .model_plan import decode_model

__all__ = ["DecodeRoutes", "decode_routes", "layer_step", "model_step"]


# ---------------------------------------------------------------------------
# the routes
# ---------------------------------------------------------------------------


def layer_step(layer, x: mx.array, mask=None, cache=None) -> Optional[mx.array]:
    """The route of a fast decoder layer's call
    (:class:`mlx_qwen_fast.layers.FastDecoderLayer`): :func:`~mlx_qwen_fast.ops.layer_plans.decode_layer`
    for a call with a cache and no mask while
    :data:`mlx_qwen_fast.config.DECODE_LAYER_STEP` is on; None otherwise,
    and where :func:`~mlx_qwen_fast.ops.layer_plans.decode_layer` declines (the caller runs mlx-lm's layer,
    whose fast modules take their own dispatch entries).

    Args:
        layer, x, cache: as :func:`~mlx_qwen_fast.ops.layer_plans.decode_layer` (any ``x``: the shape is
            checked there).
        mask: the stock call's mask; not None declines.

    Returns:
        ``[B, 1, D]`` as :func:`~mlx_qwen_fast.ops.layer_plans.decode_layer`, or None.
    """
    if mask is not None or cache is None or not _layer_step_on():
        return None
    return decode_layer(layer, x, cache)


def model_step(model, inputs: mx.array, cache=None, input_embeddings: Optional[mx.array] = None
               ) -> Optional[mx.array]:
    """The decode route of a fast layer stack's call
    (:class:`mlx_qwen_fast.layers.FastTextModel`): :func:`~mlx_qwen_fast.ops.model_plan.decode_model` for
    a call with a cache and no embeddings while
    :data:`mlx_qwen_fast.config.DECODE_MODEL_STEP` and
    :data:`~mlx_qwen_fast.config.DECODE_LAYER_STEP` are on; None otherwise,
    and where :func:`~mlx_qwen_fast.ops.model_plan.decode_model` declines (the caller tries the verify
    step, then mlx-lm's loop over the layers, each taking
    :func:`layer_step`).

    Args:
        model, inputs, cache: as :func:`~mlx_qwen_fast.ops.model_plan.decode_model` (any ``inputs``: the
            shape is checked there).
        input_embeddings: the stock call's argument; not None declines.

    Returns:
        ``[B, 1, D]`` as :func:`~mlx_qwen_fast.ops.model_plan.decode_model`, or None.
    """
    if input_embeddings is not None or cache is None or not _model_step_on():
        return None
    return decode_model(model, inputs, cache)


def _layer_step_on() -> bool:
    """Whether decoder layers take :func:`~mlx_qwen_fast.ops.layer_plans.decode_layer` (the switch)."""
    return config.DECODE_LAYER_STEP.get()


def _model_step_on() -> bool:
    """Whether layer stacks take :func:`~mlx_qwen_fast.ops.model_plan.decode_model` (both switches: the
    whole-stack step is made of the layer steps)."""
    return config.DECODE_MODEL_STEP.get() and config.DECODE_LAYER_STEP.get()


class DecodeRoutes(NamedTuple):
    """What a decode token (one token per row) runs on a backend: the route
    (whole stack, layer, module, stock) and the kernels it reaches, as the
    patch report names them (:meth:`table`)."""

    #: "compiled-model" (:func:`model_step`), "compiled-layer" (:func:`layer_step`) or "stock"
    model: str
    #: the Gated DeltaNet layer's: "cuda-mixer" (one launch, inside the layer
    #: step), "cuda-kernel", "metal-kernel", "mlx-lm-metal" or "recurrent"
    gated_delta: str
    #: the MoE block's: "cuda-block" (one launch, inside the layer step),
    #: "cuda-decode", "metal-decode" or "stock"
    moe: str
    #: the gated attention's: "compiled-layer" (the layer step with MLX's
    #: ops), "compiled-layer+cuda-kernel" / "compiled-layer+metal-kernel", or "stock"
    attention: str
    #: the layer step's projections with their norms and residuals: "compiled-layer+cuda-kernel"
    #: (the fused GEMV), "compiled-layer+metal-kernel" (the residual add with the post-attention
    #: RMSNorm as one kernel) or "stock"
    linear: str
    #: the language-model head's decode rows: "cuda-kernel" or "stock"
    lm_head: str

    def table(self) -> Dict[str, str]:
        """``{"<op>.decode": implementation}``: the report's decode rows."""
        return {"gated_delta.decode": self.gated_delta, "moe.decode": self.moe, "attention.decode": self.attention,
                "linear.decode": self.linear, "lm_head.decode": self.lm_head, "model.decode": self.model}


def decode_routes(backend: Optional[str] = None, model=None) -> DecodeRoutes:
    """The decode routes on ``backend`` from the switches
    (:mod:`mlx_qwen_fast.config`, read now) and the op families'
    dispatchers (``implementation_for(1, backend)`` of
    :mod:`~mlx_qwen_fast.ops.gated_delta`, :mod:`~mlx_qwen_fast.ops.moe`,
    :mod:`~mlx_qwen_fast.ops.attention`, :mod:`~mlx_qwen_fast.ops.linear`):
    the ones :func:`model_step`, :func:`layer_step` and the modules' entries
    take for a model whose layers all take them. Names only: nothing is
    planned, traced or evaluated.

    Args:
        backend: ``"cpu" | "cuda" | "metal"`` (what would run there on this
            machine: a GPU backend without its device falls back as the ops
            do), or None for :func:`mlx_qwen_fast.backend.current`.
        model: None, or a model (anything with ``layers``) whose weights
            narrow the one-launch kernels: "cuda-mixer" only where every
            Gated DeltaNet layer's projections are in its format
            (:func:`mlx_qwen_fast.ops.gated_delta.mixer_takes_weights`),
            "cuda-block" only where every fast MoE block's router is
            (:func:`mlx_qwen_fast.ops.moe.block_takes_weights`); else the
            three launches. The kernels the op families decline for a
            layer's quantisation (``decide_kernels``) are not applied here.

    Returns:
        :class:`DecodeRoutes`.

    Raises:
        ValueError: an unknown backend name (the empty string included).
    """
    b = _backend.resolve(backend)
    layer_on = _layer_step_on()
    lin = linear_ops.implementation_for(1, b)
    gemv = layer_on and lin == "cuda-kernel"  # inside the layer step
    gdn = gated_delta_ops.implementation_for(1, b)
    if b == _backend.METAL and config.METAL_KERNELS.get():  # the layer's decode, not the recurrence alone
        gdn = "metal-kernel"
    moe = moe_ops.implementation_for(1, b)
    gdn_kernel, moe_kernel = gdn == "cuda-kernel", moe == "cuda-decode"
    layers = () if model is None else getattr(model, "layers", ())
    if gdn_kernel and gemv and config.GDN_MIXER_KERNEL.get() and all(
            gated_delta_ops.mixer_takes_weights(layer.linear_attn) for layer in layers
            if getattr(layer, "is_linear", False)):
        gdn = "cuda-mixer"  # else the three launches, for projections of another format
    if moe_kernel and gemv and config.MOE_BLOCK_KERNEL.get() and all(
            moe_ops.block_takes_weights(layer.mlp) for layer in layers
            if getattr(getattr(layer, "mlp", None), "ops", None) is moe_ops):
        moe = "cuda-block"  # else the three launches, for a router of another format
    kernel = attention_ops.implementation_for(1, b)
    attention = "stock" if not layer_on else "compiled-layer" if kernel == "reference" else f"compiled-layer+{kernel}"
    # every layer in one compiled call: only where both layer kinds take their whole step
    route = "compiled-model" if _model_step_on() and gdn_kernel and moe_kernel else (
        "compiled-layer" if layer_on else "stock")
    return DecodeRoutes(
        model=route, gated_delta=gdn, moe=moe, attention=attention,
        linear=f"compiled-layer+{lin}" if layer_on and lin != "reference" else "stock",
        lm_head="cuda-kernel" if lin == "cuda-kernel" else "stock")
