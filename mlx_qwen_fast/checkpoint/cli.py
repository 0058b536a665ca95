"""``python -m mlx_qwen_fast.checkpoint``: the command line of
:func:`write_checkpoint` (and of the DFlash drafter presets,
:mod:`mlx_qwen_fast.dflash.presets`)."""

from pathlib import Path
from typing import Dict, List, Mapping, Optional

from .._cli import one_line_warnings
from .._cli_parser import ArgumentParser, finite_number, whole_number
from .presets import PRESETS, _check_args
from .quantization import (
    AFFINE_BITS,
    AFFINE_GROUP_SIZES,
    PARTS,
    QUANT_MODE,
    QUANT_MODES,
    QUANT_RECIPES,
    quantization_plan,
)
from .weights import DEMO_LM_HEAD_SCALE
from .writer import SHARD_GLOB, write_checkpoint


def existing_checkpoint_files(out_dir: Path) -> List[str]:
    """Names of the files in ``out_dir`` that :func:`write_checkpoint` would
    replace or delete (``config.json``, ``model*.safetensors``); [] when the
    directory is absent or is not a directory."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    names = sorted(p.name for p in out_dir.glob(SHARD_GLOB))
    if (out_dir / "config.json").exists():
        names.insert(0, "config.json")
    return names


#: CLI flag of each per-part key, and how a value is read.
_PART_FLAGS = {"bits": ("--part-bits", int), "group_size": ("--part-group-size", int), "mode": ("--part-mode", str)}

#: How :func:`quantization_plan`'s messages name the CLI's arguments.
_CLI_NAMES = {
    "bits": "--bits", "group_size": "--group-size", "mode": "--mode", "recipe": "--recipe",
    "parts": "--part-bits/--part-group-size/--part-mode",
    **{f"part.{k}": f"{flag} {{part}}" for k, (flag, _) in _PART_FLAGS.items()},
}


def parse_parts(values: Mapping[str, Optional[List[str]]]) -> Dict[str, Dict[str, object]]:
    """The ``parts`` argument of :func:`build_model` from the CLI's
    ``--part-bits``, ``--part-group-size`` and ``--part-mode`` values.

    Args:
        values: key ("bits", "group_size", "mode") -> the flag's values as
            given (each ``NAME=VALUE[,NAME=VALUE...]``; a flag may be
            repeated), or None where the flag was not given.

    Returns:
        part name -> ``{key: value}`` (bits and group sizes as ints).

    Raises:
        ValueError: an item that is not ``NAME=VALUE``, an unknown part name,
            a value that is not a whole number (bits, group size), or a part
            given twice to one flag; the message names the flag and the item.
    """
    parts: Dict[str, Dict[str, object]] = {}
    for key, (flag, convert) in _PART_FLAGS.items():
        for value in values.get(key) or ():
            for item in value.split(","):
                name, eq, v = (t.strip() for t in item.partition("="))
                if not eq or not name or not v:
                    raise ValueError(f"{flag} {item!r}: expected NAME=VALUE, NAME one of {', '.join(PARTS)}")
                if name not in PARTS:
                    raise ValueError(f"{flag} {item}: unknown part {name!r}; expected one of {', '.join(PARTS)}")
                if key in parts.get(name, {}):
                    raise ValueError(f"{flag} {item}: part {name!r} given twice")
                try:
                    parts.setdefault(name, {})[key] = convert(v)
                except ValueError:
                    raise ValueError(f"{flag} {item}: expected a whole number after '='") from None
    return parts


def _out_problem(out: Path) -> Optional[str]:
    """Why ``out`` cannot be the output folder (it, or the nearest of its
    parents that exists, is not a folder), else None. Creates nothing."""
    existing = next((p for p in (out, *out.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        where = "is a file" if existing == out else f"{existing} is a file"
        return f"{where}; expected a folder (created if absent)"
    return None


@one_line_warnings()
def checked_out_dir(parser, out: str, overwrite: bool) -> Path:
    """The CLI's ``--out`` as a Path, or ``parser.error`` (exit code 2, one
    line) where it is empty, not a usable folder (:func:`_out_problem`), or
    holds a checkpoint already and ``overwrite`` is off."""
    if not out.strip():
        parser.error("--out must name a directory, got an empty string")
    path = Path(out)
    problem = _out_problem(path)
    if problem:
        parser.error(f"--out {path}: {problem}")
    held = existing_checkpoint_files(path)
    if held and not overwrite:
        parser.error(f"--out {path} already holds a checkpoint ({', '.join(held[:3])}"
                     f"{', ...' if len(held) > 3 else ''}); pass --overwrite to replace it")
    return path


def main(argv: Optional[List[str]] = None) -> None:
    """``python -m mlx_qwen_fast.checkpoint``: check the arguments (each
    usage error one line, exit code 2, before mlx-lm is imported), then
    :func:`write_checkpoint` to ``--out``."""
    parser = ArgumentParser(
        prog="python -m mlx_qwen_fast.checkpoint",
        description="Write a random-weight Qwen3.5/3.6-MoE checkpoint that mlx_lm.load can load "
        "(default: mlx-community's 4-bit layout, affine 4-bit group 64 with 8-bit router and "
        "shared-expert gates; other quantisations with --bits, --group-size, --mode, --part-*, --recipe)."
    )
    from ..dflash.presets import PRESETS as DRAFTER_PRESETS, cli_write as write_drafter_preset

    parser.add_argument("--preset", required=True, choices=sorted(PRESETS) + sorted(DRAFTER_PRESETS),
                        help="A target (Qwen3.5/3.6-MoE) or a DFlash drafter (*-dflash: z-lab's layout; takes "
                        "--out, --overwrite and --seed only).")
    parser.add_argument("--out", required=True, help="Output directory.")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="Replace a checkpoint already in --out (its config.json and model*.safetensors).",
    )
    parser.add_argument("--seed", type=whole_number(0), default=0)
    parser.add_argument(
        "--router-skew",
        type=finite_number(0.0),
        default=0.0,
        help="Expert popularity skew S >= 0 (0 = uniform; ~1 Zipf-like).",
    )
    parser.add_argument(
        "--lm-head-scale",
        type=finite_number(0.0, inclusive=False),
        default=None,
        help=f"Multiplier of the lm_head weights (demo: {DEMO_LM_HEAD_SCALE}).",
    )
    quant = parser.add_argument_group(
        "quantisation",
        "What nn.quantize makes of the random weights, written to config.json as mlx_lm.convert "
        "writes it. Parts: " + ", ".join(PARTS) + ". A part's unset keys come from its default "
        "(the top level; affine 8-bit group 64 for router and shared_expert_gate), or from the "
        "mode's defaults where --part-mode changes the mode. The CUDA MoE kernels read affine "
        "4-bit group 64 experts (decode: the shared expert too) only; with anything else the "
        "MoE runs stock.",
    )
    quant.add_argument("--bits", type=int, default=None,
                       help=f"Bits of every quantised layer: {', '.join(map(str, AFFINE_BITS))} for affine "
                       "(default: the mode's, 4 for affine).")
    quant.add_argument("--group-size", type=int, default=None,
                       help=f"Group size: {', '.join(map(str, AFFINE_GROUP_SIZES))} for affine "
                       "(default: the mode's, 64 for affine).")
    quant.add_argument("--mode", default=QUANT_MODE, choices=list(QUANT_MODES),
                       help="MLX quantisation mode; mxfp4 is 4-bit group 32, nvfp4 4-bit group 16, "
                       "mxfp8 8-bit group 32 (default: %(default)s).")
    quant.add_argument("--part-bits", action="append", metavar="PART=BITS[,PART=BITS...]",
                       help="Per-part bits, e.g. experts=3,attention=8,shared_expert=8.")
    quant.add_argument("--part-group-size", action="append", metavar="PART=SIZE[,...]",
                       help="Per-part group size, e.g. experts=32.")
    quant.add_argument("--part-mode", action="append", metavar="PART=MODE[,...]",
                       help="Per-part mode, e.g. experts=mxfp4.")
    quant.add_argument("--recipe", default=None, choices=list(QUANT_RECIPES),
                       help="mlx-lm's mixed per-layer recipe (mlx_lm.convert --quant-predicate; affine).")
    args = parser.parse_args(argv)
    if args.preset in DRAFTER_PRESETS:
        write_drafter_preset(parser, args, argv)
        return
    try:
        _check_args(args.preset, args.seed, args.router_skew, args.lm_head_scale)
        parts = parse_parts({"bits": args.part_bits, "group_size": args.part_group_size,
                             "mode": args.part_mode})
        quantization_plan(args.bits, args.group_size, args.mode, parts, args.recipe, names=_CLI_NAMES)
    except ValueError as e:
        parser.error(str(e))
    out = checked_out_dir(parser, args.out, args.overwrite)
    try:
        write_checkpoint(
            out,
            args.preset,
            seed=args.seed,
            router_skew=args.router_skew,
            lm_head_scale=args.lm_head_scale,
            verbose=True,
            bits=args.bits,
            group_size=args.group_size,
            mode=args.mode,
            parts=parts,
            recipe=args.recipe,
        )
    except ValueError as e:
        parser.error(str(e))
    except OSError as e:  # --out is a file, or a folder that can't be made
        parser.error(f"--out {args.out}: {e.strerror or e}")
