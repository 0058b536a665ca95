"""The streaming checkpoint writer (:func:`write_checkpoint`): the model's
tensors generated, quantized and written shard by shard, with config.json,
the index and the tokenizer files."""

import json
import sys
import time
from pathlib import Path
from typing import List, Mapping, Optional, Tuple, Union

import mlx.core as mx

from .model import _eval_by_module, _lazy_model, _param_groups
from .presets import _check_args
from .quantization import QUANT_MODE, quantization_plan
from .tokenizer import make_tokenizer

# mlx-lm (which imports transformers) is imported inside the functions that
# use it, so that importing this package, and the CLI's argument checks, stay
# light. Its constants this module needs are written out below, and
# tests/test_checkpoint.py checks they are still mlx-lm's.

#: mlx-lm's shard size limit in GB (``mlx_lm.utils.MAX_FILE_SIZE_GB``), the
#: default of :func:`write_checkpoint`'s ``max_shard_bytes``.
MAX_FILE_SIZE_GB = 5


def _plan_shards(groups: List[Tuple[str, int]], max_shard_bytes: int) -> List[List[str]]:
    """Split evaluation units into shards as ``mlx_lm.utils.make_shards`` splits
    tensors: greedily, a new shard when the next unit would exceed the limit."""
    shards, size = [], 0
    for name, nbytes in groups:
        if not shards or size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


#: Weight shards mlx-lm loads from a checkpoint folder (every one it finds).
SHARD_GLOB = "model*.safetensors"


def write_checkpoint(
    out_dir: Union[str, Path],
    preset: str = "tiny",
    *,
    seed: int = 0,
    router_skew: float = 0.0,
    lm_head_scale: Optional[float] = None,
    max_shard_bytes: int = MAX_FILE_SIZE_GB << 30,
    verbose: bool = False,
    bits: Optional[int] = None,
    group_size: Optional[int] = None,
    mode: str = QUANT_MODE,
    parts: Optional[Mapping[str, Mapping[str, object]]] = None,
    recipe: Optional[str] = None,
) -> Path:
    """Write a random-weight quantized checkpoint that ``mlx_lm.load`` loads.

    Layout (as ``mlx_lm.convert`` writes it): ``config.json`` (``model_type``
    ``qwen3_5_moe``, text fields under ``text_config``, ``quantization`` and
    ``quantization_config`` blocks: the top-level setting and one entry per
    module path that differs from it, by default the 8-bit entries of every
    ``mlp.gate`` and ``mlp.shared_expert_gate``),
    ``model-0000N-of-0000M.safetensors`` shards of at most ``max_shard_bytes``
    (mlx-lm's 5 GB by default; a unit larger than that gets its own shard),
    ``model.safetensors.index.json``, ``generation_config.json`` and the
    tokenizer files of ``make_tokenizer``. Tensors are bf16 / uint32 (packed
    weights) / uint8 (scales of the mxfp4, nvfp4 and mxfp8 modes) / float32
    (``A_log``), exactly ``build_model``'s arrays for the same arguments.

    Streams: the embedding, each decoder layer, the final norm and the lm_head
    are generated, quantized and evaluated one module at a time and dropped as
    soon as their shard is written, so memory peaks at about one shard plus
    one module's float32 draws (time and memory for the full preset:
    bench/results/package-figures.md, "Random checkpoints").

    ``router_skew`` (``S >= 0``) makes expert popularity uneven, Zipf-like: in
    each layer the experts get popularity ranks r = 1..E from a seeded
    permutation, and the router row of rank r is multiplied by
    ``r ** (-0.4 * S)``: its logits spread more, so it wins the top-k more
    often. The 0.4 is calibrated so that, for the full preset (256 experts,
    top-8), the selection share falls like ``rank ** -S`` over the top half of
    the ranks (Zipf exponent ~S; the measured shares:
    bench/results/package-figures.md, "Random checkpoints"). With the tiny
    preset's 32 experts, top-8, the effect is weaker. ``S = 0`` leaves the
    router untouched.

    Args:
        out_dir: directory to create or fill. Files of the same names are
            overwritten and any other ``model*.safetensors`` removed (mlx-lm
            loads every such file it finds).
        preset, seed, router_skew, lm_head_scale: as in ``build_model``.
        max_shard_bytes: positive int, shard size limit in bytes.
        verbose: show progress (a tqdm bar on stderr: bytes written, time
            left) and a summary line.
        bits, group_size, mode, parts, recipe: the quantisation, as in
            ``build_model`` (default mlx-community's 4-bit layout).

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: bad ``preset``, ``seed``, ``router_skew``,
            ``lm_head_scale`` or ``max_shard_bytes``, or a quantisation
            :func:`quantization_plan` rejects (nothing is written then).
    """
    _check_args(preset, seed, router_skew, lm_head_scale)
    if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ValueError(
            f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}."
        )
    plan = quantization_plan(bits, group_size, mode, parts, recipe)
    from mlx_lm.utils import get_total_parameters, save_config
    from tqdm import tqdm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob(SHARD_GLOB):
        stale.unlink()
    tic = time.perf_counter()

    model, config = _lazy_model(
        preset, seed, router_skew, lm_head_scale, mx.bfloat16, quantize=True, plan=plan
    )
    total_parameters = get_total_parameters(model)
    groups = dict(_param_groups(model))
    del model  # the lazy arrays in ``groups`` are now the only references

    group_bytes = [(n, sum(v.nbytes for v in g.values())) for n, g in groups.items()]
    total_size = sum(nbytes for _, nbytes in group_bytes)
    shards = _plan_shards(group_bytes, max_shard_bytes)

    weight_map = {}
    sizes = dict(group_bytes)
    # the weights are drawn and quantised module by module (the slow part),
    # then each shard is written: progress in bytes, with the time left
    with tqdm(total=total_size, unit="B", unit_scale=True, desc=f"writing {out_dir.name}",
              disable=not verbose, file=sys.stderr) as bar:
        for i, shard_groups in enumerate(shards):
            shard_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            shard = {}
            for name in shard_groups:
                group = groups.pop(name)
                bar.set_postfix_str(name, refresh=False)
                _eval_by_module(group)
                shard.update(group)
                del group
                bar.update(sizes[name])
            bar.set_postfix_str(f"saving {shard_name}")
            mx.save_safetensors(str(out_dir / shard_name), shard, metadata={"format": "mlx"})
            weight_map.update({k: shard_name for k in shard})
            del shard
            mx.clear_cache()

    index = {
        "metadata": {"total_size": total_size, "total_parameters": total_parameters},
        "weight_map": dict(sorted(weight_map.items())),
    }
    with open(out_dir / "model.safetensors.index.json", "w") as f:
        json.dump(index, f, indent=4)
    save_config(config, config_path=out_dir / "config.json")
    make_tokenizer(out_dir)
    if verbose:
        print(
            f"[{time.perf_counter() - tic:7.1f}s] {out_dir}: {len(shards)} shards, "
            f"{total_size / 1e9:.3f} GB, {total_parameters:,} parameters",
            flush=True,
        )
    return out_dir
