"""The target's forward that also returns the hidden states DFlash reads.

:func:`forward` runs the layer loop of mlx-lm's ``Qwen3_5TextModel.__call__``
(embedding, the attention and Gated DeltaNet masks, each layer with its
cache, final norm, LM head) and keeps the output of the layers
``layer_ids`` on the way: the verify pass and the prefill return the
logits and the drafter's context in one pass. Each layer is called as the
model calls it, so a patched model's layers take their own fast paths
(and a Gated DeltaNet cache in rollback mode records,
:mod:`mlx_qwen_fast.speculative`). A verify of 2..16 tokens on a patched
model with :data:`mlx_qwen_fast.config.VERIFY_MODEL_STEP` on runs the
whole stack as one compiled call that returns the same layer outputs
(:func:`mlx_qwen_fast.ops.verify.verify_model_hidden`) where that step
takes the model and cache; the layer-stack's one-token step
(:func:`mlx_qwen_fast.ops.model_plan.decode_model`) is not used, as every
DFlash call but a last one-token step is several tokens.

"The output of layer i" is the residual stream after decoder layer ``i``
(0-based), before the final norm: the reference's
``hidden_states[i + 1]`` of a Hugging Face forward (z-lab/dflash
``extract_context_feature``, offset 1 for the embeddings).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

__all__ = ["TextParts", "check_target", "forward", "text_parts"]


class TextParts(NamedTuple):
    """The pieces of a Qwen3.5/3.6 model that DFlash uses.

    ``text_model``: the layer stack (``Qwen3_5TextModel``: ``embed_tokens``,
    ``layers``, ``norm``, ``fa_idx``, ``ssm_idx``); ``embed_tokens``;
    ``lm_head``: a callable ``[..., H] -> [..., V]`` (the tied embedding's
    ``as_linear`` where the model ties them); ``hidden_size``;
    ``vocab_size``.
    """

    text_model: Any
    embed_tokens: Any
    lm_head: Any
    hidden_size: int
    vocab_size: int


def text_parts(model) -> TextParts:
    """The :class:`TextParts` of an mlx-lm ``qwen3_5`` / ``qwen3_5_moe``
    model (``Model``, or its ``TextModel``).

    Raises:
        ValueError: ``model`` is not such a model (names ``model``).
    """
    lm = getattr(model, "language_model", model)
    tm = getattr(lm, "model", None)
    if tm is None or not all(hasattr(tm, a) for a in ("embed_tokens", "layers", "norm", "fa_idx", "ssm_idx")):
        raise ValueError(f"model: {type(model).__name__} is not a Qwen3.5/3.6 model of mlx-lm "
                         f"(qwen3_5 / qwen3_5_moe): DFlash needs its layer stack")
    args = getattr(lm, "args", None)
    tied = bool(getattr(args, "tie_word_embeddings", False))
    head = tm.embed_tokens.as_linear if tied else getattr(lm, "lm_head", None)
    if head is None:
        raise ValueError(f"model: {type(model).__name__} has no lm_head")
    H = int(getattr(args, "hidden_size", 0))
    V = int(getattr(args, "vocab_size", 0))
    return TextParts(tm, tm.embed_tokens, head, H, V)


def check_target(model, drafter=None) -> TextParts:
    """Check that DFlash can run on ``model`` (with ``drafter``).

    The target must be a patched Qwen3.5/3.6 model (its Gated DeltaNet
    layers the fast class, whose caches roll back:
    :func:`mlx_qwen_fast.speculative.rollback`), not pipelined or sharded
    across processes.

    Args:
        model: the target.
        drafter: a :class:`~mlx_qwen_fast.dflash.drafter.DFlashDrafter`, or a
            stand-in with ``target_layer_ids`` and ``block_size``; None
            checks the target alone.

    Returns:
        ``text_parts(model)``.

    Raises:
        ValueError: ``model`` is not a Qwen3.5/3.6 model, is not patched
            (``mlx_qwen_fast.patch(model)``) or the fast path left it stock,
            is pipelined; ``drafter``'s hidden size or vocabulary differs
            from the target's, a ``target_layer_ids`` entry is past the
            target's layers, its ``mask_token_id`` is outside the target's
            vocabulary. The message names the argument.
    """
    from .. import speculative

    parts = text_parts(model)
    tm = parts.text_model
    if getattr(tm, "pipeline_size", 1) > 1:
        raise ValueError("model: a pipelined model (mlx-lm's pipeline across processes) is not supported by DFlash")
    layers = list(tm.layers)
    linear = [bool(getattr(layer, "is_linear", False)) for layer in layers]
    rolls = speculative.rollback_layers(tm)
    if any(lin and not r for lin, r in zip(linear, rolls)):
        raise ValueError("model: its Gated DeltaNet layers are not the fast path's (call "
                         "mlx_qwen_fast.patch(model) first; a model the fast path declines cannot roll back "
                         "its recurrent state after a rejected draft)")
    if drafter is None:
        return parts
    ids = tuple(getattr(drafter, "target_layer_ids", ()))
    bad = [i for i in ids if not 0 <= i < len(layers)]
    if bad:
        raise ValueError(f"drafter: target_layer_ids {list(ids)} name layer(s) {bad} the target does not have "
                         f"({len(layers)} layers)")
    args = getattr(drafter, "args", None)
    if args is not None:
        if args.hidden_size != parts.hidden_size:
            raise ValueError(f"drafter: hidden_size {args.hidden_size} does not match the target's "
                             f"{parts.hidden_size}")
        if args.vocab_size != parts.vocab_size:
            raise ValueError(f"drafter: vocab_size {args.vocab_size} does not match the target's "
                             f"{parts.vocab_size}")
    mask = getattr(drafter, "mask_token_id", None)
    if mask is not None and not 0 <= mask < parts.vocab_size:
        raise ValueError(f"drafter: mask_token_id {mask} is outside the target's vocabulary ({parts.vocab_size})")
    return parts


def forward(model, inputs: mx.array, cache: Sequence[Any], layer_ids: Sequence[int],
            parts: Optional[TextParts] = None, *, last_only: bool = False) -> Tuple[mx.array, Optional[mx.array]]:
    """The target's forward over ``inputs`` with ``cache``, and the outputs
    of layers ``layer_ids``.

    Args:
        model: a Qwen3.5/3.6 model (patched or not: each layer runs as its
            class runs it).
        inputs: ``[B, T]`` token ids.
        cache: one entry per layer (``make_prompt_cache(model)``), updated
            in place as ``model(inputs, cache=cache)`` updates it.
        layer_ids: layer indices (0-based), in the order their outputs are
            concatenated.
        parts: ``text_parts(model)`` when the caller has it.
        last_only: compute the logits of the last position only (a
            prefill: the LM head over every position would cost
            ``T * V`` floats).

    Returns:
        ``(logits, hidden)``: logits ``[B, T, V]`` as ``model(inputs,
        cache=cache)`` returns them (``[B, 1, V]`` with ``last_only``); hidden ``[B, T, len(layer_ids) * H]`` in
        the activation dtype (the layers' outputs concatenated on the last
        axis), or None when ``layer_ids`` is empty. Lazy.
    """
    from mlx_lm.models.base import create_attention_mask, create_ssm_mask

    parts = parts or text_parts(model)
    tm = parts.text_model
    if not last_only and _verify_step_applies(tm):
        from ..ops import verify as verify_ops

        if layer_ids:
            out = verify_ops.verify_model_hidden(tm, inputs, cache, layer_ids)
        else:
            out = verify_ops.verify_model(tm, inputs, cache)
            out = None if out is None else (out, None)
        if out is not None:
            return parts.lm_head(out[0]), out[1]
    h = tm.embed_tokens(inputs)
    fa_mask = create_attention_mask(h, cache[tm.fa_idx]) if tm.fa_idx is not None else None
    ssm_mask = create_ssm_mask(h, cache[tm.ssm_idx]) if tm.ssm_idx is not None else None
    want = {i: n for n, i in enumerate(layer_ids)}
    kept = [None] * len(layer_ids)
    for i, (layer, c) in enumerate(zip(tm.layers, cache)):
        h = layer(h, mask=ssm_mask if layer.is_linear else fa_mask, cache=c)
        if i in want:
            kept[want[i]] = h
    logits = parts.lm_head(tm.norm(h[:, -1:] if last_only else h))
    hidden = mx.concatenate(kept, axis=-1) if kept else None
    return logits, hidden


def _verify_step_applies(text_model) -> bool:
    """Whether the whole-stack S-token step may run for ``text_model``: the
    patched layer stack (its own call would take that step) with the switch on."""
    from .. import config
    from ..layers import FastTextModel

    return isinstance(text_model, FastTextModel) and config.VERIFY_MODEL_STEP.get()
