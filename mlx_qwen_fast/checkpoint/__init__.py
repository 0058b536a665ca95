"""Random-weight Qwen3.5/3.6-MoE checkpoints in the mlx-community layout.

The package is developed and tested without the real 19 GB checkpoint: this
package builds models of the exact Qwen3.6-35B-A3B shape (or a tiny one with the
same structure) with random but non-trivial weights, quantized the way
``mlx_lm.convert -q`` quantizes the real model (by default affine 4-bit, group
64, router and shared-expert gates 8-bit; other bits, group sizes, modes and
per-part settings on request), and writes them as a checkpoint that stock
``mlx_lm.load`` loads strictly.

Python API::

    model, config = build_model("tiny", seed=0)        # in memory, evaluated
    path = write_checkpoint("ckpt", "tiny", seed=0)     # streamed to disk
    make_tokenizer("ckpt")                              # tokenizer files only

Command line::

    python -m mlx_qwen_fast.checkpoint --preset tiny-dflash --out /tmp/tiny-dflash  # a DFlash drafter
    python -m mlx_qwen_fast.checkpoint --preset tiny --out /tmp/tiny \\
        [--seed N] [--router-skew S] [--lm-head-scale X] \\
        [--bits B] [--group-size G] [--mode affine|mxfp4|nvfp4|mxfp8] \\
        [--part-bits experts=3,attention=8,shared_expert=8] \\
        [--part-group-size PART=G,...] [--part-mode PART=MODE,...] \\
        [--recipe mixed_3_4|...]

Importing the module is light (MLX, no mlx-lm, no tqdm): the functions that
build or write a model import mlx-lm when called, so the command line checks
its arguments (one line, exit code 2, on any error) before importing it.

Modules: :mod:`.presets` (the model presets, :data:`PRESETS`),
:mod:`.quantization` (quantisation plans: bits, group sizes, modes, parts,
mlx-lm's recipes), :mod:`.weights` (the random weights and their
distributions), :mod:`.model` (:func:`build_model`, :func:`weight_shapes`,
:func:`checkpoint_nbytes`), :mod:`.writer` (:func:`write_checkpoint`, the
streamed shards), :mod:`.tokenizer` (:func:`make_tokenizer` and its
corpus), :mod:`.cli` (the command line, :func:`main`).
"""

from .cli import checked_out_dir, existing_checkpoint_files, main, parse_parts
from .model import build_model, checkpoint_nbytes, weight_shapes
from .presets import PRESETS, preset_config
from .quantization import (
    AFFINE_BITS,
    AFFINE_GROUP_SIZES,
    PARTS,
    QUANT_BITS,
    QUANT_GROUP_SIZE,
    QUANT_MODE,
    QUANT_MODES,
    QUANT_RECIPES,
    Quantization,
    _part_of,
    quantization_plan,
)
from .tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, TOKENIZER_VOCAB_SIZE, make_tokenizer
from .weights import DEMO_LM_HEAD_SCALE, _matrix, _normal
from .writer import MAX_FILE_SIZE_GB, SHARD_GLOB, write_checkpoint

# The private names above are used by mlx_qwen_fast.dflash.presets
# (_matrix, _normal: the same weight draws as the targets') and by
# tests/test_checkpoint.py (_part_of).
__all__ = [
    "AFFINE_BITS",
    "AFFINE_GROUP_SIZES",
    "CHAT_TEMPLATE",
    "DEMO_LM_HEAD_SCALE",
    "MAX_FILE_SIZE_GB",
    "PARTS",
    "PRESETS",
    "QUANT_BITS",
    "QUANT_GROUP_SIZE",
    "QUANT_MODE",
    "QUANT_MODES",
    "QUANT_RECIPES",
    "Quantization",
    "SHARD_GLOB",
    "SPECIAL_TOKENS",
    "TOKENIZER_VOCAB_SIZE",
    "build_model",
    "checked_out_dir",
    "checkpoint_nbytes",
    "existing_checkpoint_files",
    "main",
    "make_tokenizer",
    "parse_parts",
    "preset_config",
    "quantization_plan",
    "weight_shapes",
    "write_checkpoint",
]
