"""The DFlash block drafter: a small Qwen3 decoder that drafts a block of
tokens in one forward, conditioned on the target's hidden states.

Architecture (DFlash, Chen et al., "DFlash: Block Diffusion for Flash
Speculative Decoding", arXiv 2602.06036; z-lab/dflash ``dflash/model.py``,
whose checkpoints this module loads):

* context: the target's hidden states after the layers
  ``target_layer_ids`` (each ``[S, H]``), concatenated on the feature axis
  (``[S, len(ids) * H]``), projected by ``fc`` (no bias) to ``H`` and
  normalised by ``hidden_norm`` (RMSNorm): ``c = hidden_norm(fc(h))``. The
  same ``c`` feeds every drafter layer;
* block: the embeddings (the target's ``embed_tokens``; the drafter has
  none) of ``[last accepted token, mask, ..., mask]`` (``block_size``
  tokens, ``mask_token_id``);
* each of the ``num_hidden_layers`` layers is a Qwen3 decoder layer
  (RMSNorm, attention with q/k RMSNorm and RoPE, RMSNorm, SwiGLU MLP,
  residuals) whose attention takes its queries from the block and its keys
  and values from ``[context; block]``: ``k_proj``/``v_proj`` (and
  ``k_norm``) applied to ``c`` for the context rows (without the layer's
  input norm) and to the normed block for the block rows; no mask (the
  block attends to all of itself and to all context: non-causal);
* RoPE positions: the context rows at their own positions in the sequence,
  the block from the position of the last accepted token on;
* the output: the final ``norm``; logits come from the target's
  ``lm_head`` (the drafter has none). Position ``i > 0`` of the block
  predicts the token ``i`` places after the last accepted one.

The context rows' keys and values depend only on ``c``, so each layer keeps
them in an mlx-lm ``KVCache`` (:meth:`DFlashDrafter.add_context`), appended
once per accepted position, as the reference keeps them; a block's own
keys and values are never cached.

Checkpoint layout (z-lab): ``config.json`` (Qwen3 keys: ``hidden_size``,
``num_hidden_layers``, ``intermediate_size``, ``num_attention_heads``,
``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``, ``vocab_size``,
``rope_theta`` / ``rope_scaling`` or ``rope_parameters``,
``max_position_embeddings``; ``block_size``; ``dflash_config``:
``{"mask_token_id", "target_layer_ids"}``) and ``model*.safetensors`` with
``fc.weight``, ``hidden_norm.weight``, ``norm.weight`` and
``layers.{i}.{self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
mlp.{gate,up,down}_proj, input_layernorm, post_attention_layernorm}.weight``;
quantised the way ``mlx_lm.convert`` quantises (a ``quantization`` block)
or not. The layers, attention projections, MLP and RoPE (default, or yarn
through ``mlx_lm.models.rope_utils``) are mlx-lm's Qwen3 pieces
(``mlx_lm.models.qwen3``).
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

__all__ = ["DrafterArgs", "DFlashDrafter", "build_target_layer_ids", "load_drafter"]

#: config.json keys a drafter folder must hold (top level).
REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                 "num_key_value_heads", "vocab_size", "block_size")


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> List[int]:
    """The reference's default ``target_layer_ids`` when a config names none
    (z-lab/dflash ``build_target_layer_ids``): ``num_draft_layers`` layers
    spread evenly over ``[1, num_target_layers - 3]``, or the middle layer
    for a one-layer drafter."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _whole(config: dict, key: str, where: str, minimum: int = 1) -> int:
    v = config.get(key)
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < minimum:
        raise ValueError(f"{where}: config.json {key!r} must be a whole number >= {minimum}, got {v!r}")
    return int(v)


@dataclass
class DrafterArgs:
    """A DFlash drafter's config.json, checked (:meth:`from_dict`).

    Attributes:
        hidden_size, num_hidden_layers, intermediate_size,
        num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps,
        vocab_size, max_position_embeddings: the Qwen3 fields.
        block_size: tokens per drafted block, the last accepted one
            included (16 for z-lab's drafters): ``block_size - 1`` drafts.
        mask_token_id: the token id that fills the block's undrafted places.
        target_layer_ids: the target layers whose outputs form the context.
        qwen3: the config as ``mlx_lm.models.qwen3.ModelArgs`` (RoPE: its
            ``rope_theta`` and ``rope_scaling``, ``rope_parameters`` read
            as mlx-lm reads them).
        config: the config.json dict as given.
    """

    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    max_position_embeddings: int
    block_size: int
    mask_token_id: int
    target_layer_ids: Tuple[int, ...]
    qwen3: Any = field(repr=False)
    config: dict = field(repr=False)

    @classmethod
    def from_dict(cls, config: dict, where: str = "drafter", *, light: bool = False) -> Optional["DrafterArgs"]:
        """Check a drafter config.json dict and read it.

        Args:
            config: the parsed config.json.
            where: how error messages name the drafter (e.g. its folder).
            light: check only, without importing mlx-lm (the CLIs' argument
                checks); returns None.

        Raises:
            ValueError: a required key missing or of the wrong type
                (:data:`REQUIRED_KEYS`, ``dflash_config.mask_token_id``,
                ``dflash_config.target_layer_ids`` -- or
                ``num_target_layers`` to derive them --, ``rope_theta``),
                heads that do not divide, attention bias, sliding-window or
                causal layers (the published Qwen3.6 drafter has none; this
                module implements full non-causal attention only), a
                ``block_size`` below 2; the message names the key.
        """
        if not isinstance(config, dict):
            raise ValueError(f"{where}: config.json must hold a JSON object, got {type(config).__name__}")
        missing = [k for k in REQUIRED_KEYS if k not in config]
        dflash = config.get("dflash_config")
        if not isinstance(dflash, dict):
            missing.append("dflash_config")
            dflash = {}
        elif "mask_token_id" not in dflash:
            missing.append("dflash_config.mask_token_id")
        if missing:
            raise ValueError(f"{where}: config.json lacks {', '.join(map(repr, missing))} "
                             f"(not a DFlash drafter in the z-lab layout)")
        H = _whole(config, "hidden_size", where)
        n_layers = _whole(config, "num_hidden_layers", where)
        heads = _whole(config, "num_attention_heads", where)
        kv_heads = _whole(config, "num_key_value_heads", where)
        if heads % kv_heads:
            raise ValueError(f"{where}: config.json num_attention_heads={heads} is not a multiple of "
                             f"num_key_value_heads={kv_heads}")
        head_dim = _whole(config, "head_dim", where) if "head_dim" in config else H // heads
        block = _whole(config, "block_size", where, minimum=2)
        vocab = _whole(config, "vocab_size", where)
        mask = _whole(dflash, "mask_token_id", f"{where}: dflash_config", minimum=0)
        if mask >= vocab:
            raise ValueError(f"{where}: config.json dflash_config.mask_token_id={mask} is outside the "
                             f"vocabulary (vocab_size={vocab})")
        ids = dflash.get("target_layer_ids")
        if ids is None:
            if "num_target_layers" not in config:
                raise ValueError(f"{where}: config.json lacks 'dflash_config.target_layer_ids' "
                                 f"(and 'num_target_layers' to derive them)")
            ids = build_target_layer_ids(_whole(config, "num_target_layers", where), n_layers)
        if (not isinstance(ids, (list, tuple)) or not ids
                or not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) and i >= 0 for i in ids)):
            raise ValueError(f"{where}: config.json dflash_config.target_layer_ids must be a non-empty list "
                             f"of layer indices >= 0, got {ids!r}")
        if config.get("attention_bias"):
            raise ValueError(f"{where}: config.json attention_bias=true is not supported (Qwen3 drafters "
                             f"have no attention bias)")
        types = config.get("layer_types") or ()
        if any(t != "full_attention" for t in types) or config.get("use_sliding_window"):
            raise ValueError(f"{where}: config.json layer_types={list(types)!r} / use_sliding_window: only "
                             f"full (non-causal) attention layers are supported")
        if config.get("is_causal"):
            raise ValueError(f"{where}: config.json is_causal=true: DFlash drafters attend non-causally")
        rope = config.get("rope_parameters")
        if config.get("rope_theta") is None and not (isinstance(rope, dict) and rope.get("rope_theta") is not None):
            raise ValueError(f"{where}: config.json lacks 'rope_theta' (or 'rope_parameters.rope_theta')")
        if light:
            return None
        from mlx_lm.models import qwen3

        q = dict(model_type="qwen3", rms_norm_eps=1e-6, max_position_embeddings=262144,
                 tie_word_embeddings=False, head_dim=head_dim)
        q.update({k: v for k, v in config.items() if k != "head_dim"})
        try:
            qargs = qwen3.ModelArgs.from_dict(q)
        except (ValueError, TypeError) as exc:  # no rope_theta, or a field of the wrong type
            raise ValueError(f"{where}: config.json: {exc}") from None
        return cls(hidden_size=H, num_hidden_layers=n_layers,
                   intermediate_size=_whole(config, "intermediate_size", where),
                   num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                   rms_norm_eps=float(qargs.rms_norm_eps), vocab_size=vocab,
                   max_position_embeddings=int(qargs.max_position_embeddings), block_size=block,
                   mask_token_id=mask, target_layer_ids=tuple(int(i) for i in ids), qwen3=qargs,
                   config=config)


def _attention_class():
    from mlx_lm.models.base import scaled_dot_product_attention
    from mlx_lm.models.qwen3 import Attention

    class DrafterAttention(Attention):
        """mlx-lm's Qwen3 attention, its queries from the block and its keys
        and values from ``[cached context; block]``, without a mask."""

        def context_kv(self, c: mx.array, position: int) -> Tuple[mx.array, mx.array]:
            """Keys (k_norm, RoPE from ``position``) and values of context rows
            ``c`` ``[B, S, H]``: ``[B, Hkv, S, Dh]`` each."""
            B, S, _ = c.shape
            k = self.k_norm(self.k_proj(c).reshape(B, S, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
            v = self.v_proj(c).reshape(B, S, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
            return self.rope(k, offset=position), v

        def __call__(self, x: mx.array, cache, position: int) -> mx.array:
            B, L, _ = x.shape
            q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
            k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
            v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
            q = self.rope(q, offset=position)
            k = self.rope(k, offset=position)
            if cache is not None and cache.offset > 0:
                ck, cv = cache.keys_and_values()
                k, v = mx.concatenate([ck, k], axis=2), mx.concatenate([cv, v], axis=2)
            out = scaled_dot_product_attention(q, k, v, cache=None, scale=self.scale, mask=None)
            return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    return DrafterAttention


class DrafterLayer(nn.Module):
    """One drafter layer: mlx-lm's Qwen3 ``TransformerBlock`` parts
    (``self_attn``, ``mlp``, ``input_layernorm``,
    ``post_attention_layernorm``), the attention over ``[context; block]``."""

    def __init__(self, args: DrafterArgs):
        super().__init__()
        from mlx_lm.models.qwen3 import MLP

        self.self_attn = _attention_class()(args.qwen3)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cache, position: int) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache, position)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    """The DFlash drafter (see the module docstring for the architecture).

    Build it from a checked config (:class:`DrafterArgs`) or load a
    published folder with :func:`load_drafter`. It holds no embedding and
    no LM head: :meth:`propose` takes the target's.

    Attributes:
        args: the :class:`DrafterArgs`.
        block_size, mask_token_id, target_layer_ids: the config's.
    """

    #: Marks a drafter for the speculative wrapper (:mod:`mlx_qwen_fast.speculative`).
    is_dflash_drafter = True

    def __init__(self, args: DrafterArgs):
        super().__init__()
        self.args = args
        H = args.hidden_size
        self.fc = nn.Linear(len(args.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.layers = [DrafterLayer(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)

    @property
    def block_size(self) -> int:
        return self.args.block_size

    @property
    def mask_token_id(self) -> int:
        return self.args.mask_token_id

    @property
    def target_layer_ids(self) -> Tuple[int, ...]:
        return self.args.target_layer_ids

    def make_cache(self) -> List[Any]:
        """One mlx-lm ``KVCache`` per layer, for the context rows' keys and values."""
        from mlx_lm.models.cache import KVCache

        return [KVCache() for _ in self.layers]

    def add_context(self, hidden: mx.array, position: int, cache: Sequence[Any]) -> None:
        """Append context rows to every layer's cache.

        Args:
            hidden: ``[B, S, len(target_layer_ids) * H]``, the target's
                hidden states at positions ``position .. position + S - 1``
                (:func:`mlx_qwen_fast.dflash.capture.forward`), in the
                target's activation dtype.
            position: int >= 0, the sequence position of the first row
                (RoPE).
            cache: :meth:`make_cache`'s list; each ``KVCache`` grows by S.
        """
        if hidden.shape[1] == 0:
            return
        c = self.hidden_norm(self.fc(hidden))
        for layer, lc in zip(self.layers, cache):
            k, v = layer.self_attn.context_kv(c, position)
            lc.update_and_fetch(k, v)

    def __call__(self, embeddings: mx.array, position: int, cache: Optional[Sequence[Any]]) -> mx.array:
        """The drafter over a block.

        Args:
            embeddings: ``[B, L, H]``, the target's embeddings of the block
                (last accepted token, then mask tokens).
            position: the sequence position of the block's first token.
            cache: the context caches (:meth:`add_context`), or None for
                no context.

        Returns:
            ``[B, L, H]``, the final norm's output (the target's
            ``lm_head`` makes logits of it).
        """
        h = embeddings
        for i, layer in enumerate(self.layers):
            h = layer(h, None if cache is None else cache[i], position)
        return self.norm(h)

    def propose(self, model, last_token: mx.array, position: int, num: int, cache) -> mx.array:
        """Draft ``num`` tokens after ``last_token`` (greedy: the argmax of
        each block position's logits, as the reference drafts).

        Args:
            model: the target (its ``embed_tokens`` and ``lm_head`` are used;
                :func:`mlx_qwen_fast.dflash.capture.text_parts`).
            last_token: ``[1]`` uint32, the last accepted token.
            position: its sequence position.
            num: 1 <= num <= ``block_size - 1``.
            cache: the context caches.

        Returns:
            ``[num]`` uint32 (lazy).
        """
        from .capture import text_parts

        parts = text_parts(model)
        block = mx.concatenate([last_token.astype(mx.uint32),
                                mx.full((num,), self.mask_token_id, dtype=mx.uint32)])
        h = self(parts.embed_tokens(block[None]), position, cache)
        logits = parts.lm_head(h[:, 1:])
        return mx.argmax(logits[0], axis=-1).astype(mx.uint32)


def load_drafter(path: Union[str, Path], *, lazy: bool = False) -> DFlashDrafter:
    """Load a DFlash drafter from a folder in the z-lab layout.

    The weights are loaded by mlx-lm's ``load_model`` (strict: every weight
    present and of the config's shape; a ``quantization`` block quantises as
    for any mlx-lm checkpoint), with :class:`DFlashDrafter` as the model
    class.

    Args:
        path: the folder (config.json, model*.safetensors).
        lazy: leave the weights unevaluated (mlx-lm's ``lazy``).

    Returns:
        The drafter, in eval mode.

    Raises:
        ValueError: ``path`` is not a folder, has no or an unreadable
            config.json, no safetensors, a config :class:`DrafterArgs`
            rejects, or weights that do not fit the config (missing,
            unexpected or of the wrong shape); the message names the folder.
    """
    path = Path(path)
    where = f"dflash drafter {path}"
    if not path.is_dir():
        raise ValueError(f"{where}: not a folder")
    cfg = path / "config.json"
    if not cfg.is_file():
        raise ValueError(f"{where}: no config.json in it")
    try:
        config = json.loads(cfg.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where}: config.json is not valid JSON ({exc})") from None
    DrafterArgs.from_dict(config, where)  # the config's own errors, named, before any weight is read
    if not list(path.glob("model*.safetensors")):
        raise ValueError(f"{where}: no weights (model*.safetensors) in it")
    import inspect

    import mlx_lm.utils

    load_model = inspect.unwrap(mlx_lm.utils.load_model)  # mlx-lm's own: install()'s wrapper patches targets

    def classes(config):
        return DFlashDrafter, _ArgsReader(where)

    try:
        model, _ = load_model(path, lazy=lazy, strict=True, get_model_classes=classes)
    except ValueError as exc:
        raise ValueError(f"{where}: {' '.join(str(exc).split())}") from None
    return model


class _ArgsReader:
    """``model_args_class`` for mlx-lm's ``load_model``: ``from_dict`` is
    :meth:`DrafterArgs.from_dict` naming the folder in its errors."""

    def __init__(self, where: str):
        self.where = where

    def from_dict(self, config: dict) -> DrafterArgs:
        return DrafterArgs.from_dict(config, self.where)
