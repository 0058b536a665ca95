"""The random-weight model in memory (:func:`build_model`), and the names,
shapes and sizes of a checkpoint's tensors without generating any weight
(:func:`weight_shapes`, :func:`checkpoint_nbytes`)."""

import contextlib
import copy
import io
import math
from typing import Dict, Iterator, Mapping, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .presets import _check_args, preset_config
from .quantization import QUANT_MODE, Quantization, _quant_predicate, quantization_plan
from .weights import _random_weights


def _lazy_model(
    preset: str,
    seed: int,
    router_skew: float,
    lm_head_scale: Optional[float],
    dtype: mx.Dtype,
    quantize: bool,
    plan: Optional[Quantization] = None,
) -> Tuple[nn.Module, dict]:
    """The model with lazy (unevaluated) random, cast and quantized weights
    (``plan``: :func:`quantization_plan`, default the 4-bit layout).

    Nothing is computed here: every array is a graph that generates, casts and
    quantizes one parameter, so evaluating a subset of the parameters only
    costs that subset's memory.
    """
    from mlx_lm.models import qwen3_5_moe
    from mlx_lm.utils import quantize_model

    plan = plan or quantization_plan()
    config = preset_config(preset)
    model_args = qwen3_5_moe.ModelArgs.from_dict(copy.deepcopy(config))
    model = qwen3_5_moe.Model(model_args)
    args = model.language_model.args

    scale = 1.0 if lm_head_scale is None else float(lm_head_scale)
    weights = _random_weights(model, args, seed, router_skew, scale)
    cast = model.cast_predicate
    weights = {
        k: v.astype(dtype) if cast(k) else v for k, v in weights.items()
    }
    model.update(tree_unflatten(list(weights.items())))
    del weights
    model.eval()

    if quantize:
        with contextlib.redirect_stdout(io.StringIO()):  # its bits/weight print
            model, config = quantize_model(
                model,
                config,
                group_size=plan.group_size,
                bits=plan.bits,
                mode=plan.mode,
                quant_predicate=_quant_predicate(model, plan),
            )
    return model, config


def _param_groups(model: nn.Module) -> Iterator[Tuple[str, Dict[str, mx.array]]]:
    """Flattened parameters in checkpoint order, one group per evaluation unit:
    the embedding, each decoder layer, the final norm and the lm_head."""
    lm = model.language_model
    units = [("model.embed_tokens", lm.model.embed_tokens)]
    units += [(f"model.layers.{i}", layer) for i, layer in enumerate(lm.model.layers)]
    units += [("model.norm", lm.model.norm), ("lm_head", lm.lm_head)]
    for name, module in units:
        prefix = f"language_model.{name}"
        yield name, {f"{prefix}.{k}": v for k, v in tree_flatten(module.parameters())}


def _eval_by_module(params: Dict[str, mx.array]) -> None:
    """Evaluate flattened parameters one module at a time (the random float32
    draws of one module are the only transient memory, ~1.6 GB for the 256
    experts of one projection)."""
    modules = {}
    for k, v in params.items():
        modules.setdefault(k.rsplit(".", 1)[0], []).append(v)
    for arrays in modules.values():
        mx.eval(arrays)


def build_model(
    preset: str = "tiny",
    *,
    seed: int = 0,
    router_skew: float = 0.0,
    lm_head_scale: Optional[float] = None,
    dtype: mx.Dtype = mx.bfloat16,
    quantize: bool = True,
    bits: Optional[int] = None,
    group_size: Optional[int] = None,
    mode: str = QUANT_MODE,
    parts: Optional[Mapping[str, Mapping[str, object]]] = None,
    recipe: Optional[str] = None,
) -> Tuple[nn.Module, dict]:
    """Build an evaluated random-weight model in memory.

    The model is the class ``mlx_lm.load`` produces for this config
    (``mlx_lm.models.qwen3_5_moe.Model``), in eval mode. With ``quantize=True``
    it holds exactly the arrays ``write_checkpoint`` writes for the same
    arguments. By default (mlx-community's 4-bit layout): linear layers and
    the embedding affine 4-bit with group size 64 (``uint32`` packed weights
    ``(out, in/8)``, ``dtype`` scales and biases ``(out, in/64)``; experts
    with a leading expert axis), the router (``mlp.gate``) and
    ``mlp.shared_expert_gate`` 8-bit. Norms, conv1d and ``dt_bias`` are
    ``dtype``; ``A_log`` stays float32 (mlx-lm's ``cast_predicate``).

    Other quantisations (``bits``, ``group_size``, ``mode``, ``parts``,
    ``recipe``; checked by :func:`quantization_plan`) are made with mlx-lm's
    ``quantize_model`` (``nn.quantize`` with a class predicate), which
    writes config.json's ``quantization`` block as ``mlx_lm.convert`` does:
    the top-level ``{"group_size", "bits", "mode"}`` and one entry per
    module path whose setting differs. Packed weights are ``uint32 (out,
    in*bits/32)``; "affine" keeps ``dtype`` scales and biases ``(out,
    in/group_size)``; "mxfp4", "nvfp4" and "mxfp8" have ``uint8`` scales and
    no biases.

    Weights are generated, cast, quantized and evaluated one module at a time,
    so peak memory stays near the final size plus one module's float32 draws
    (19.5 GB + ~3 GB for the full preset).

    Args:
        preset: a key of ``PRESETS`` (``"tiny"``, ``"tiny-draft"`` or ``"qwen3.6-35b-a3b"``).
        seed: non-negative int; same seed, same weights.
        router_skew: ``S >= 0``, expert popularity skew (see
            ``write_checkpoint``); 0 gives statistically uniform routing.
        lm_head_scale: multiplier of the ``lm_head`` weights (``None`` = 1.0);
            use ``DEMO_LM_HEAD_SCALE`` for non-flat logits.
        dtype: floating dtype of the unquantized arrays and of the quantization
            scales/biases. ``mx.float32`` with ``quantize=False`` for fp32
            parity tests (mlx's CPU ``gather_mm`` accepts float32 only).
            ``mx.float32`` with ``quantize=True`` quantizes the float32 draws
            (not their bf16 rounding), so its 4-bit values differ slightly
            from the checkpoint's; on the CPU backend it runs much faster
            than bf16 (MLX's CPU bf16 quantised matmuls are slow). To run the checkpoint's exact weights in fp32, cast
            the floating arrays of the bf16 model (bf16 -> fp32 is exact).
        quantize: quantize as the checkpoint does; ``False`` keeps every
            weight in ``dtype`` (the quantisation arguments are then still
            checked, and unused).
        bits, group_size, mode: the top-level quantisation; None = the
            mode's default (:data:`QUANT_MODES`: affine 4-bit group 64).
        parts: per-part overrides, part (a key of :data:`PARTS`: "experts",
            "shared_expert", "router", "shared_expert_gate", "attention",
            "linear_attention", "embed_tokens", "lm_head") -> a mapping with
            any of "bits", "group_size", "mode", e.g. ``{"experts": {"bits":
            3}, "attention": {"bits": 8}}``.
        recipe: an mlx-lm mixed recipe ("mixed_3_4", ...), see
            :func:`quantization_plan`.

    Returns:
        ``(model, config)``: ``config`` is the dict ``write_checkpoint`` writes
        to config.json (with the ``quantization`` block when ``quantize``).

    Raises:
        ValueError: unknown ``preset``, negative ``seed``, negative or
            non-finite ``router_skew``, non-positive ``lm_head_scale``, a
            non-floating ``dtype``, or a quantisation MLX does not implement
            (:func:`quantization_plan`).
    """
    _check_args(preset, seed, router_skew, lm_head_scale)
    if not isinstance(dtype, mx.Dtype) or not mx.issubdtype(dtype, mx.floating):
        raise ValueError(f"dtype must be a floating mx.Dtype, got dtype={dtype!r}.")
    plan = quantization_plan(bits, group_size, mode, parts, recipe)
    model, config = _lazy_model(
        preset, seed, router_skew, lm_head_scale, dtype, quantize, plan
    )
    for _, group in _param_groups(model):
        _eval_by_module(group)
    return model, config


# ---------------------------------------------------------------------------
# Checkpoint shapes and sizes (no weights generated)


def weight_shapes(
    preset: str = "tiny", *, quantize: bool = True, **quantization
) -> Dict[str, Tuple[Tuple[int, ...], mx.Dtype]]:
    """Names, shapes and dtypes of the tensors a checkpoint holds.

    Computed from the lazy model, without generating any weight (cheap even for
    the full preset). Keys are the safetensors names, e.g.
    ``language_model.model.layers.0.mlp.switch_mlp.gate_proj.weight``; values
    are ``(shape, dtype)``. With ``quantize=False``: the shapes of the
    unquantized bf16 model instead. ``quantization``: the keyword arguments
    ``bits``, ``group_size``, ``mode``, ``parts``, ``recipe`` of
    :func:`build_model` (default the 4-bit layout).

    Raises:
        ValueError: unknown ``preset``, or a quantisation
            :func:`quantization_plan` rejects.
        TypeError: another keyword argument.
    """
    _check_args(preset, 0, 0.0, None)
    plan = quantization_plan(**quantization)
    model, _ = _lazy_model(preset, 0, 0.0, None, mx.bfloat16, quantize, plan)
    return {k: (tuple(v.shape), v.dtype) for k, v in tree_flatten(model.parameters())}


def checkpoint_nbytes(preset: str = "tiny", **quantization) -> int:
    """Bytes of tensor data in the quantized checkpoint of ``preset``
    (``quantization`` as for :func:`weight_shapes`).

    For the default 4-bit layout: 19,508,789,376 (19.5 GB, 18.2 GiB) for
    ``qwen3.6-35b-a3b``, about the size of the mlx-community 4-bit
    checkpoint (~19.4 GB); 17.8e6 for ``tiny``.

    Raises:
        ValueError, TypeError: as :func:`weight_shapes`.
    """
    return sum(
        math.prod(shape) * dtype.size
        for shape, dtype in weight_shapes(preset, **quantization).values()
    )

