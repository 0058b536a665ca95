"""Random-weight DFlash drafter checkpoints in z-lab's layout.

Like :mod:`mlx_qwen_fast.checkpoint` for the targets: a drafter of the
published shape (or a tiny one for the ``tiny`` target) with random
weights, written as a folder :func:`~mlx_qwen_fast.dflash.drafter.load_drafter`
loads (``config.json`` with z-lab's keys, ``model.safetensors`` with
z-lab's weight names, bf16 and unquantised as published). Random weights
draft badly (acceptance near 0): exactness and plumbing, not speed-ups,
are what they test; the benchmark's stand-ins give chosen acceptances.

Presets (:data:`PRESETS`):

* ``qwen3.6-35b-a3b-dflash``: z-lab/Qwen3.6-35B-A3B-DFlash's shape: 8
  Qwen3 layers, hidden 2048, intermediate 6144, 32 query / 4 KV heads of
  128, block 16, ``dflash_config`` ``{"mask_token_id": 248070,
  "target_layer_ids": [1, 10, 19, 28, 37]}``, vocabulary 248320, yarn RoPE
  (theta 1e7; the yarn factor and original length here are those of
  z-lab's other Qwen3.6 drafters' configs: not read from this one);
* ``tiny-dflash``: for the ``tiny`` target (hidden 256, 8 layers,
  vocabulary 1280): 2 layers, intermediate 512, 4 / 2 heads of 64, block
  16, target layers ``[1, 3, 5]``, mask token 1279 (past the tiny
  tokenizer's tokens, as 248070 is a special token of Qwen's), yarn RoPE.

Weights: every matrix zero-mean uniform with std ``1/sqrt(fan_in)`` (the
projections into the residual stream, ``o_proj`` and ``down_proj``, further
by ``sqrt(1/L)``), norms ``1 + 0.1 N(0, 1)``, each from its own key (seed and
path, as in :mod:`mlx_qwen_fast.checkpoint`).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Dict, Optional, Union

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

__all__ = ["PRESETS", "build_drafter", "preset_config", "write_drafter"]


def _config(*, hidden_size, num_hidden_layers, intermediate_size, num_attention_heads, num_key_value_heads,
            head_dim, vocab_size, block_size, mask_token_id, target_layer_ids, num_target_layers,
            rope_scaling, max_position_embeddings, rope_theta=10000000) -> dict:
    """A config.json dict with the keys of z-lab's DFlash drafter configs."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
        "dtype": "bfloat16",
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "layer_types": ["full_attention"] * num_hidden_layers,
        "max_position_embeddings": max_position_embeddings,
        "num_attention_heads": num_attention_heads,
        "num_hidden_layers": num_hidden_layers,
        "num_key_value_heads": num_key_value_heads,
        "num_target_layers": num_target_layers,
        "rms_norm_eps": 1e-6,
        "rope_scaling": rope_scaling,
        "rope_theta": rope_theta,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }


#: Config dicts of the presets (read-only: :func:`preset_config` copies).
PRESETS: Dict[str, dict] = {
    "qwen3.6-35b-a3b-dflash": _config(
        hidden_size=2048, num_hidden_layers=8, intermediate_size=6144, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, vocab_size=248320, block_size=16, mask_token_id=248070,
        target_layer_ids=[1, 10, 19, 28, 37], num_target_layers=40, max_position_embeddings=262144,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                      "original_max_position_embeddings": 8192},
    ),
    "tiny-dflash": _config(
        hidden_size=256, num_hidden_layers=2, intermediate_size=512, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=1280, block_size=16, mask_token_id=1279,
        target_layer_ids=[1, 3, 5], num_target_layers=8, max_position_embeddings=32768,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192},
    ),
}


def preset_config(preset: str) -> dict:
    """A deep copy of ``PRESETS[preset]``.

    Raises:
        ValueError: ``preset`` is not a key of :data:`PRESETS`.
    """
    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r}: expected one of {sorted(PRESETS)}")
    return copy.deepcopy(PRESETS[preset])


def _random_weights(model, seed: int) -> Dict[str, mx.array]:
    from ..checkpoint import _matrix, _normal

    L = model.args.num_hidden_layers
    out = {}
    for path, p in tree_flatten(model.parameters()):
        module = path.rsplit(".", 2)[-2]
        if "norm" in module:
            w = _normal(seed, path, p.shape, std=0.1, mean=1.0)
        else:
            std = 1.0 / math.sqrt(p.shape[-1])
            if module in ("o_proj", "down_proj"):
                std *= math.sqrt(1.0 / L)
            w = _matrix(seed, path, p.shape, std=std)
        out[path] = w
    return out


def build_drafter(preset: str = "tiny-dflash", *, seed: int = 0, dtype: mx.Dtype = mx.bfloat16):
    """A random-weight drafter of ``preset``, evaluated, in memory.

    Args:
        preset: a key of :data:`PRESETS`.
        seed: int >= 0; the same seed gives the same weights as
            :func:`write_drafter`'s (in bf16).
        dtype: floating dtype of the weights.

    Returns:
        ``(drafter, config)``: a :class:`~mlx_qwen_fast.dflash.drafter.DFlashDrafter`
        and its config dict.

    Raises:
        ValueError: unknown ``preset``, a negative ``seed``, a non-floating
            ``dtype``.
    """
    from .drafter import DFlashDrafter, DrafterArgs

    config = preset_config(preset)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    if not isinstance(dtype, mx.Dtype) or not mx.issubdtype(dtype, mx.floating):
        raise ValueError(f"dtype must be a floating mx.Dtype, got {dtype!r}")
    model = DFlashDrafter(DrafterArgs.from_dict(config, f"preset {preset}"))
    weights = {k: v.astype(dtype) for k, v in _random_weights(model, seed).items()}
    model.update(tree_unflatten(list(weights.items())))
    mx.eval(model.parameters())
    model.eval()
    return model, config


def write_drafter(out_dir: Union[str, Path], preset: str = "tiny-dflash", *, seed: int = 0) -> Path:
    """Write a random-weight drafter folder in z-lab's layout.

    Files: ``config.json`` (:data:`PRESETS`' dict) and ``model.safetensors``
    (bf16, z-lab's weight names); other files of the folder are left as
    they are.

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: as :func:`build_drafter`.
    """
    model, config = build_drafter(preset, seed=seed, dtype=mx.bfloat16)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def is_preset(name: Optional[str]) -> bool:
    """Whether ``name`` is a drafter preset (the checkpoint CLI's dispatch)."""
    return name in PRESETS


#: The checkpoint CLI's flags that a drafter preset does not take (target-only settings).
_TARGET_FLAGS = ("--router-skew", "--lm-head-scale", "--bits", "--group-size", "--mode", "--part-bits",
                 "--part-group-size", "--part-mode", "--recipe")


def cli_write(parser, args, argv) -> None:
    """``python -m mlx_qwen_fast.checkpoint --preset *-dflash``: check
    ``--out`` as for a target (one line, exit code 2: a file, or a folder
    already holding a checkpoint without ``--overwrite``; a target-only flag
    given), then :func:`write_drafter` with ``--seed``."""
    import sys

    from ..checkpoint import checked_out_dir

    given = [a.split("=", 1)[0] for a in (sys.argv[1:] if argv is None else argv)]
    extra = [f for f in _TARGET_FLAGS if f in given]
    if extra:
        parser.error(f"--preset {args.preset} is a DFlash drafter: {', '.join(extra)} apply to target presets "
                     f"only (a drafter takes --out, --overwrite and --seed)")
    out = checked_out_dir(parser, args.out, args.overwrite)
    for stale in out.glob("model*.safetensors") if out.is_dir() else ():
        stale.unlink()  # load_drafter reads every such file
    try:
        write_drafter(out, args.preset, seed=args.seed)
    except OSError as e:
        parser.error(f"--out {args.out}: {e.strerror or e}")
    n = sum(v.size for v in mx.load(str(out / "model.safetensors")).values())
    print(f"{out}: DFlash drafter {args.preset}, {n:,} parameters (bf16)", flush=True)
