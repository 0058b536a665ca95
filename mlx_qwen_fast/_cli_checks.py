"""The checks of mlx-lm's command-line arguments made before mlx-lm is imported.

The arguments a user most often gets wrong are checked here, before
anything heavy is imported (mlx-lm, transformers), each failure one line
naming the argument and what was expected, exit code 2
(:func:`~mlx_qwen_fast._cli_parser.usage_error`): the ``--model`` folder
(exists, is a folder, parseable ``config.json``, complete safetensors
weights, a tokenizer; a repo id that is not in an offline Hugging Face
cache) and the counts (``--max-tokens``, ``--num-draft-tokens``,
``--prefill-step-size``, benchmark's ``-p/-g/-b/-n``), and
an empty prompt (given, or read from stdin for ``--prompt -``).
:func:`check_arguments` runs them all; the folder checks
(:func:`check_checkpoint_folder`, :func:`folder_config`,
:func:`weights_problem`) also serve the package's own CLIs.
"""

from __future__ import annotations

import io
import json
import os
import re
import struct
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ._cli_parser import usage_error

__all__ = ["check_arguments", "check_checkpoint_folder", "expand_model", "flag_values", "folder_config",
           "weights_problem"]

#: argv flag spellings -> the name used in messages, per kind of check.
_COUNT_FLAGS = {
    "generate": {"--max-tokens": "--max-tokens", "-m": "--max-tokens", "--num-draft-tokens": "--num-draft-tokens",
                 "--prefill-step-size": "--prefill-step-size"},
    "chat": {"--max-tokens": "--max-tokens", "-m": "--max-tokens", "--prefill-step-size": "--prefill-step-size"},
    "server": {"--max-tokens": "--max-tokens", "--num-draft-tokens": "--num-draft-tokens",
               "--prefill-step-size": "--prefill-step-size"},
    "benchmark": {"--prompt-tokens": "--prompt-tokens", "-p": "--prompt-tokens",
                  "--generation-tokens": "--generation-tokens", "-g": "--generation-tokens",
                  "--batch-size": "--batch-size", "-b": "--batch-size",
                  "--num-trials": "--num-trials", "-n": "--num-trials",
                  "--prefill-step-size": "--prefill-step-size"},
}
_PROMPT_FLAGS = {"generate": ("--prompt", "-p"), "cache_prompt": ("--prompt",)}
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json")


def flag_values(argv: Sequence[str], names: Sequence[str]) -> List[str]:
    """Every value given to one of the flags ``names``, in each spelling
    argparse takes: ``--flag v``, ``--flag=v``, an abbreviation of a long
    flag (``--max-tok v``, argparse's ``allow_abbrev``), ``-m v``, ``-m5``,
    ``-m=5``."""
    longs = [n for n in names if n.startswith("--")]
    shorts = [n for n in names if not n.startswith("--")]
    out = []
    for i, a in enumerate(argv):
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if a.startswith("--") and len(a) > 2:
            flag, eq, value = a.partition("=")
            hits = [n for n in longs if n == flag] or [n for n in longs if n.startswith(flag)]
            if len(hits) == 1:
                if eq:
                    out.append(value)
                elif nxt is not None:
                    out.append(nxt)
        elif a.startswith("-") and not a.startswith("--"):
            for n in shorts:
                if a == n:
                    if nxt is not None:
                        out.append(nxt)
                elif a.startswith(n) and len(a) > len(n):
                    out.append(a[len(n):].removeprefix("="))
    return out


def _check_counts(command: str, argv: Sequence[str]) -> None:
    flags = _COUNT_FLAGS.get(command, {})
    by_name: Dict[str, List[str]] = {}
    for spelling, name in flags.items():
        by_name.setdefault(name, []).append(spelling)
    for name, spellings in by_name.items():
        for v in flag_values(argv, spellings):
            try:
                n = int(v)
            except ValueError:
                usage_error(f"{name} {v}: expected a whole number >= 1")
            if n < 1:
                usage_error(f"{name} {v}: expected a whole number >= 1")


def _check_prompt(command: str, argv: Sequence[str]) -> None:
    """An empty ``--prompt`` is a usage error; so is ``--prompt -`` (the
    last value is the one argparse keeps) with nothing but blanks on stdin,
    which is read here and then handed on to mlx-lm as ``sys.stdin``."""
    values = flag_values(argv, _PROMPT_FLAGS.get(command, ()))
    for v in values:
        if v != "-" and not v.strip():
            usage_error("--prompt is empty: expected the text to continue (or - to read it from stdin)")
    if values and values[-1] == "-":
        text = sys.stdin.read() if sys.stdin is not None else ""
        if not text.strip():
            usage_error("--prompt -: stdin held no prompt (empty or only blanks): expected the text to continue")
        sys.stdin = io.StringIO(text)  # mlx-lm reads it again


def weights_problem(files) -> Optional[str]:
    """None when ``files`` (a folder's safetensors weights) is not empty and
    every file's header is whole (:func:`_safetensors_problem`), else what is
    wrong (one line)."""
    if not files:
        return "no weights (model*.safetensors) in the folder"
    for f in files:
        problem = _safetensors_problem(f)
        if problem:
            return problem
    return None


def _safetensors_problem(path: Path) -> Optional[str]:
    """None when ``path`` is a complete safetensors file (its header parses
    and the file holds every byte the header's tensors span), else why not.
    Reads the header only."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path.name} is empty or truncated ({size} bytes)"
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100 << 20:
                return f"{path.name} is not a safetensors file or is truncated (header of {n} bytes, file {size})"
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        return f"{path.name} is not a readable safetensors file ({exc})"
    try:
        end = max((int(t["data_offsets"][1]) for k, t in header.items()
                   if k != "__metadata__" and isinstance(t, dict) and "data_offsets" in t), default=0)
    except (AttributeError, TypeError, ValueError, IndexError, KeyError, OverflowError):
        return f"{path.name} is not a safetensors file (its header does not describe tensors)"
    if 8 + n + end > size:
        return f"{path.name} is truncated: {size} bytes, its header needs {8 + n + end}"
    return None


def folder_config(path: Path, kind: str, holds: str):
    """``(config.json's contents, None)`` where ``path`` is a folder with a
    readable JSON ``config.json``, else ``(None, what is wrong)`` (one line;
    ``kind`` names the folder, e.g. "checkpoint", ``holds`` what it should
    hold)."""
    if not path.exists():
        return None, "no such folder"
    if not path.is_dir():
        return None, f"is a file; expected a {kind} folder ({holds})"
    cfg = path / "config.json"
    if not cfg.is_file():
        return None, f"not a {kind} folder (no config.json in it)"
    try:
        return json.loads(cfg.read_text()), None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        return None, f"config.json is not valid JSON ({exc})"


def check_checkpoint_folder(path: Path) -> Optional[str]:
    """None when ``path`` looks like a loadable mlx-lm checkpoint folder, else
    what is wrong (one line, without the flag name). Reads config.json, the
    safetensors headers and the tokenizer's file names; loads nothing."""
    data, problem = folder_config(path, "checkpoint", "config.json, *.safetensors, tokenizer")
    if problem:
        return problem
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        return "config.json has no \"model_type\" (not an mlx-lm / Hugging Face model config)"
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            if not all(isinstance(n, str) for n in names):
                raise TypeError("weight_map values must be file names")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return f"model.safetensors.index.json is not a valid weight index ({exc})"
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            return f"weight file {missing[0]} named by model.safetensors.index.json is missing"
        files = [path / n for n in names]
    else:
        files = sorted(path.glob("model*.safetensors"))
    problem = weights_problem(files)
    if problem:
        return problem
    if not any((path / n).is_file() for n in _TOKENIZER_FILES):
        return f"no tokenizer in the folder (expected one of {', '.join(_TOKENIZER_FILES)})"
    tok = path / "tokenizer.json"
    if tok.is_file():
        try:
            vocab = json.loads(tok.read_text()).get("model", {}).get("vocab")
        except (OSError, ValueError, UnicodeDecodeError, AttributeError) as exc:
            return f"tokenizer.json is not valid JSON ({exc})"
        if vocab is not None and (not isinstance(vocab, (dict, list)) or len(vocab) == 0):
            return "tokenizer.json has no usable vocabulary"
    return None


def _hub_cached(repo: str) -> Optional[bool]:
    """True/False: the repo's config.json is / is not in the Hugging Face
    cache; None when huggingface_hub cannot tell."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        return isinstance(try_to_load_from_cache(repo, "config.json"), str)
    except Exception:  # an id huggingface_hub rejects: mlx-lm will say so
        return None


def _hub_offline() -> bool:
    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


def _check_model(argv: Sequence[str]) -> None:
    for model in flag_values(argv, ("--model",)):
        if not model.strip():
            usage_error("--model is empty: expected a checkpoint folder or a Hugging Face repo id")
        path = Path(os.path.expanduser(model))
        if path.exists() or model.startswith(("/", "./", "../", "~")):
            problem = check_checkpoint_folder(path)
            if problem:
                usage_error(f"--model {model}: {problem}")
            continue
        if not _REPO_ID.fullmatch(model):
            usage_error(f"--model {model}: no such folder (a Hugging Face repo id is written namespace/name)")
        if _hub_cached(model) is False and _hub_offline():
            usage_error(f"--model {model}: not a folder, and not in the Hugging Face cache (HF_HUB_OFFLINE is set)")


def expand_model(argv: List[str]) -> List[str]:
    """``argv`` with a ``--model ~/...`` value written as the path it names
    (a quoted ``~`` reaches the program unexpanded, and mlx-lm would take it
    for a repo id)."""
    out = list(argv)
    for i, a in enumerate(out):
        if a == "--model" and i + 1 < len(out) and out[i + 1].startswith("~"):
            out[i + 1] = os.path.expanduser(out[i + 1])
        elif a.startswith("--model=~"):
            out[i] = "--model=" + os.path.expanduser(a.split("=", 1)[1])
    return out


def check_arguments(command: str, argv: Sequence[str]) -> None:
    """Exit with one line and code 2 for the usage errors this module checks
    (see the module docstring) in ``argv`` of mlx-lm's ``command`` (e.g.
    "generate", "benchmark", "server"). Imports nothing heavy; for
    ``--prompt -`` reads stdin (and puts what it read back as ``sys.stdin``)."""
    if "-h" in argv or "--help" in argv:
        return
    _check_model(argv)
    _check_counts(command, argv)
    _check_prompt(command, argv)
