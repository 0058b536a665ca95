"""Run one of mlx-lm's command-line entry points with the fast path installed.

The package's CLIs (``python -m mlx_qwen_fast.generate``, ``.server`` and
``python -m mlx_qwen_fast SUBCOMMAND``) take exactly mlx-lm's flags plus
``--stock`` and ``--dtype {bfloat16,float16,float32}`` (the dtype the loaded
model computes in, :func:`cast_model`; default the checkpoint's). Before anything heavy is imported (mlx-lm, transformers) the
arguments a user most often gets wrong are checked here, each failure one
line naming the argument and what was expected, exit code 2 (argparse's
usage-error code): the ``--model`` folder (exists, is a folder, parseable
``config.json``, complete safetensors weights, a tokenizer) and the counts
(``--max-tokens``, benchmark's ``-p/-g/-b/-n``), and an empty prompt (given,
or read from stdin for ``--prompt -``). An
error raised while mlx-lm loads the checkpoint (weights that do not fit the
config, a repo id that cannot be fetched) is printed as one line too, and so
is each warning of the package (:func:`one_line_warnings`).

The package's own CLIs (``python -m mlx_qwen_fast.demo``, ``.checkpoint``)
parse their flags with :class:`ArgumentParser`, which reports argparse's
usage errors the same way (one line, exit code 2, no usage block), and
type their values with :func:`whole_number` and :func:`finite_number`.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib.util
import io
import json
import math
import os
import re
import struct
import sys
import traceback
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from . import config

#: argv flag spellings -> the name used in messages, per kind of check.
_COUNT_FLAGS = {
    "generate": {"--max-tokens": "--max-tokens", "-m": "--max-tokens"},
    "chat": {"--max-tokens": "--max-tokens", "-m": "--max-tokens"},
    "server": {"--max-tokens": "--max-tokens"},
    "benchmark": {"--prompt-tokens": "--prompt-tokens", "-p": "--prompt-tokens",
                  "--generation-tokens": "--generation-tokens", "-g": "--generation-tokens",
                  "--batch-size": "--batch-size", "-b": "--batch-size",
                  "--num-trials": "--num-trials", "-n": "--num-trials"},
}
_PROMPT_FLAGS = {"generate": ("--prompt", "-p"), "cache_prompt": ("--prompt",)}
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json")


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _package_warning(filename: str, text: str) -> bool:
    """Whether a warning is this package's: raised from its code (``filename``,
    where ``stacklevel`` put it) or naming it in its text."""
    try:
        inside = os.path.commonpath([os.path.abspath(filename), _PACKAGE_DIR]) == _PACKAGE_DIR
    except ValueError:  # another drive, or a pseudo file name such as "<string>"
        inside = False
    return inside or text.lower().startswith("mlx_qwen_fast")


@contextlib.contextmanager
def one_line_warnings():
    """Within it (a context manager, or a decorator of a CLI's ``main``),
    each warning of this package prints as one line on stderr,
    ``mlx_qwen_fast: warning: MESSAGE``, without Python's file:line and
    source line, and once per distinct message; other packages' warnings
    keep Python's format. Only the CLIs use it: a library caller of
    :func:`mlx_qwen_fast.patch` gets the ordinary ``warnings.warn``."""
    seen = set()
    with warnings.catch_warnings():  # restores warnings.showwarning on exit
        python_show = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            text = " ".join(str(message).split())
            if not _package_warning(filename, text):
                python_show(message, category, filename, lineno, file, line)
                return
            text = text.removeprefix("mlx_qwen_fast:").strip()
            if text not in seen:
                seen.add(text)
                print(f"mlx_qwen_fast: warning: {text}", file=sys.stderr if file is None else file)

        warnings.showwarning = show
        yield


def usage_error(message: str, prog: str = "mlx_qwen_fast") -> None:
    """Print ``PROG: error: message`` to stderr and exit with code 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors are one line.

    Each error (an unknown flag, a value its ``type`` or ``choices``
    reject, a missing required flag, or a message the CLI passes to
    :meth:`error`) prints ``PROG: error: MESSAGE`` on stderr, with any
    whitespace run (newlines included) as one space, and exits with code 2;
    there is no usage block (``-h`` prints the whole help). Unknown flags
    are reported before missing required ones, so a mistyped required flag
    is named as unknown (with the closest known flag when there is one)
    rather than as missing; a missing flag is named with what it takes
    (``--preset {a,b}``, ``--out OUT``).
    """

    #: The required actions that the first pass of :meth:`parse_args` made
    #: optional, until it restores them.
    _unrequired: Sequence[argparse.Action] = ()

    def error(self, message: str):
        """Print ``message`` as one line (see the class) and exit with code 2."""
        usage_error(" ".join(str(message).split()), prog=self.prog)

    def parse_args(self, args=None, namespace=None):
        """argparse's ``parse_args``, with the errors in the order the class
        describes: a first pass with every flag optional collects the
        arguments no flag takes, then the missing required flags are named,
        then argparse's own pass parses."""
        args = sys.argv[1:] if args is None else list(args)
        required = [a for a in self._actions if a.required]
        self._unrequired = required
        for a in required:
            a.required = False
        try:
            seen, extras = self.parse_known_args(args, argparse.Namespace())
        finally:
            self._restore_required()
        if extras:
            self.error(self._unrecognized(extras))
        missing = [a for a in required if getattr(seen, a.dest, a.default) is a.default]
        if missing:
            self.error("the following arguments are required: " + ", ".join(map(self._expected, missing)))
        return super().parse_args(args, namespace)

    def format_help(self) -> str:
        """argparse's help; when the first pass of :meth:`parse_args` meets
        ``-h``, the required flags are shown as required all the same."""
        self._restore_required()
        return super().format_help()

    def _restore_required(self) -> None:
        for a in self._unrequired:
            a.required = True
        self._unrequired = ()

    @staticmethod
    def _expected(action: argparse.Action) -> str:
        """A flag with what it takes: ``--preset {a,b}``, ``--out OUT``."""
        flag = max(action.option_strings, key=len) if action.option_strings else action.dest
        if action.nargs == 0:
            return flag
        if action.choices is not None:
            return f"{flag} {{{','.join(map(str, action.choices))}}}"
        return f"{flag} {action.metavar or action.dest.upper()}"

    def _unrecognized(self, extras: Sequence[str]) -> str:
        # compared without the leading "--", which every long flag shares
        known = [s[2:] for a in self._actions for s in a.option_strings if s.startswith("--")]
        for e in extras:
            if e.startswith("--"):
                close = difflib.get_close_matches(e[2:].split("=", 1)[0], known, n=1)
                if close:
                    return f"unrecognized arguments: {' '.join(extras)} (did you mean --{close[0]}?)"
        return f"unrecognized arguments: {' '.join(extras)} ({self.prog} --help lists the flags)"


def whole_number(minimum: int):
    """An argparse ``type``: the value as an int, at least ``minimum``, else
    ``argparse.ArgumentTypeError`` ("expected a whole number >= MINIMUM, got
    VALUE"; argparse puts the flag's name in front)."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {value}")
        return value

    return convert


def finite_number(minimum: float, *, inclusive: bool = True):
    """An argparse ``type``: the value as a finite float, ``>= minimum``
    (``> minimum`` when not ``inclusive``), else ``argparse.ArgumentTypeError``
    ("expected a finite number >= MINIMUM, got VALUE")."""
    expected = f"expected a finite number {'>=' if inclusive else '>'} {minimum:g}"

    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{expected}, got {text!r}") from None
        if not math.isfinite(value) or value < minimum or (value == minimum and not inclusive):
            raise argparse.ArgumentTypeError(f"{expected}, got {text}")
        return value

    return convert


def _flag_values(argv: Sequence[str], names: Sequence[str]) -> List[str]:
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
        for v in _flag_values(argv, spellings):
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
    values = _flag_values(argv, _PROMPT_FLAGS.get(command, ()))
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
    for model in _flag_values(argv, ("--model",)):
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


def _expand_model(argv: List[str]) -> List[str]:
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


#: ``--dtype`` values: the activation dtype the loaded model computes in.
DTYPES = ("bfloat16", "float16", "float32")
DTYPE_HELP = ("--dtype {bfloat16,float16,float32}: the dtype the model computes in (default: the checkpoint's); "
              "on a CPU float32 is several times faster than bfloat16 and makes patched and --stock tokens "
              "comparable.")


def take_flag(argv: Sequence[str], flag: str, expected: str):
    """``argv`` without ``flag VALUE`` / ``flag=VALUE``, and VALUE (None
    when the flag is absent): for the package's own flags, taken out before
    mlx-lm parses the rest. The flag without a value (``expected`` says
    what it takes) or given twice: usage error (one line, exit code 2)."""
    out, found = [], []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == flag:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                usage_error(f"{flag}: expected {expected} after it")
            found.append(argv[i + 1])
            i += 2
            continue
        if a.startswith(flag + "="):
            found.append(a.split("=", 1)[1])
        else:
            out.append(a)
        i += 1
    if len(found) > 1:
        usage_error(f"{flag} given {len(found)} times: expected one")
    return out, (found[0] if found else None)


def take_dtype(argv: Sequence[str]):
    """``argv`` without ``--dtype D`` / ``--dtype=D``, and D (None when
    absent). A missing or unknown value, or the flag twice: usage error
    (one line, exit code 2)."""
    out, found = take_flag(argv, "--dtype", f"one of {', '.join(DTYPES)}")
    if found is not None and found not in DTYPES:
        usage_error(f"--dtype: expected one of {', '.join(DTYPES)}, got {found!r}")
    return out, found


def cast_model(model, dtype) -> None:
    """Put ``model``'s floating parameters in ``dtype`` (an mx.Dtype), in
    place: for float32 every floating parameter; for bfloat16 / float16 the
    16-bit ones (parameters a checkpoint keeps in float32, such as the Gated
    DeltaNet's ``A_log``, stay float32, as mlx-lm loads them). Quantised
    weights (integer arrays) are untouched; their scales and biases follow
    the rule above."""
    import mlx.core as mx

    if dtype == mx.float32:
        model.set_dtype(dtype, lambda t: mx.issubdtype(t, mx.floating))
    else:
        model.set_dtype(dtype, lambda t: t in (mx.bfloat16, mx.float16))


def install_dtype(name: str) -> None:
    """Make every ``mlx_lm.load`` in this process cast the loaded model to
    the dtype ``name`` (:func:`cast_model`), before the fast path's wrapper
    (installed after this) patches it: ``mlx_lm.utils.load_model`` is
    wrapped."""
    import functools

    import mlx.core as mx
    import mlx_lm.utils

    dtype = getattr(mx, name)
    stock = mlx_lm.utils.load_model

    @functools.wraps(stock)
    def load_model(*args, **kwargs):
        model, model_config = stock(*args, **kwargs)
        cast_model(model, dtype)
        return model, model_config

    mlx_lm.utils.load_model = load_model


def versions() -> str:
    """``mlx_qwen_fast X (mlx Y, mlx-lm Z)``, read from the installed packages' metadata."""
    from importlib.metadata import PackageNotFoundError, version

    from . import __version__

    def ver(dist):
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"

    return f"mlx_qwen_fast {__version__} (mlx {ver('mlx')}, mlx-lm {ver('mlx-lm')})"


def _mlx_lm_dir() -> Optional[Path]:
    spec = importlib.util.find_spec("mlx_lm")  # locates the package without importing it
    return Path(spec.origin).parent if spec and spec.origin else None


def _has_main(path: Path) -> bool:
    """An mlx-lm module that is a CLI (defines ``main``), read as text."""
    try:
        return path.is_file() and "\ndef main(" in path.read_text()
    except (OSError, UnicodeDecodeError):
        return False


def subcommands() -> List[str]:
    """mlx-lm's CLI modules (``mlx_lm/<name>.py`` or ``mlx_lm/quant/<name>.py``
    defining ``main``), found without importing mlx-lm."""
    root = _mlx_lm_dir()
    if root is None:
        return []
    found = {p.stem for d in (root, root / "quant") for p in d.glob("*.py") if _has_main(p)}
    return sorted(n for n in found if n.isidentifier() and not n.startswith("_") and n != "cli")


def check_subcommand(argv) -> None:
    """Exit with a usage message (code 2) when ``python -m mlx_qwen_fast``
    has no subcommand, or one that is not an mlx-lm CLI module
    (``mlx_lm/<name>.py`` or ``mlx_lm/quant/<name>.py``); mlx-lm's dispatcher
    would raise a ValueError traceback. ``-h``, ``--help`` and ``--version``
    pass. Imports nothing heavy."""
    usage = ("usage: python -m mlx_qwen_fast SUBCOMMAND [--stock] [mlx-lm flags], SUBCOMMAND warmup or one "
             "of mlx-lm's (python -m mlx_qwen_fast --help lists them)")
    if not argv:
        usage_error(f"a subcommand is needed\n{usage}")
    sub = argv[0]
    if sub in ("-h", "--help", "--version"):
        return
    root = _mlx_lm_dir()
    known = (not sub.startswith("-") and sub.isidentifier() and root is not None
             and any(_has_main(root / p / f"{sub}.py") for p in ("", "quant")))
    if not known:
        usage_error(f"unknown subcommand {sub!r}\n{usage}")


def _first_use_notice(argv: Sequence[str]) -> Optional[Path]:
    """One line when the ``--model`` folder's kernels were not warmed up into
    MLX's compile cache on this machine (CUDA only): its first run then
    spends minutes in MLX's run-time compiles. Returns the folder when it
    printed the line (the caller marks it warm once the run completes), else
    None."""
    models = _flag_values(argv, ("--model",))
    if not models:
        return None
    path = Path(os.path.expanduser(models[0]))
    from . import backend

    if not path.is_dir() or backend.current() != backend.CUDA:
        return None
    from .warmup import is_warm

    if is_warm(path):
        return None
    print(f"mlx_qwen_fast: MLX may compile CUDA kernels for this model for a few minutes before its first "
              f"token (once per machine; `python -m mlx_qwen_fast warmup --model {models[0]}` does it ahead "
              f"of time)", file=sys.stderr)
    return path


def _loading_error(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while mlx-lm located or loaded a checkpoint
    (mlx_lm.utils / tokenizer_utils, huggingface_hub, safetensors), as
    opposed to a failure of the run itself."""
    files = [f.filename.replace("\\", "/") for f in traceback.extract_tb(exc.__traceback__)]
    return any(("/mlx_lm/utils.py" in f or "/mlx_lm/tokenizer_utils.py" in f or "/huggingface_hub/" in f
                or "/safetensors/" in f or "/transformers/" in f) for f in files)


@one_line_warnings()
def run_mlx_lm_main(module: str, argv=None, *, before_main=None) -> None:
    """Run mlx-lm's CLI ``module`` (e.g. "mlx_lm.generate") with :func:`install` applied.

    ``--stock`` anywhere in ``argv`` skips the install and undoes what the
    import set in the environment (``config.restore_process_settings``), so
    the same command runs stock mlx-lm for an A/B comparison. ``--version``
    prints this package's version with mlx's and mlx-lm's. The arguments
    are checked first (:func:`check_arguments`); an error while mlx-lm loads
    the checkpoint is printed as one line (exit code 2). For
    "mlx_lm.server" (without ``--stock``) ``GET /v1/models`` is answered by
    :func:`mlx_qwen_fast.server.handle_models_request`. ``before_main``,
    when given, is called with the imported mlx-lm module just before its
    ``main`` runs (the fast path installed), e.g. to hook its functions.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--version" in argv:
        print(versions())
        return
    stock = "--stock" in argv
    argv = [a for a in argv if a != "--stock"]
    command = module.rsplit(".", 1)[-1]
    argv, dtype = take_dtype(argv)
    argv = _expand_model(argv)
    check_arguments(command, argv)
    if "-h" in argv or "--help" in argv:
        print("mlx_qwen_fast: mlx-lm's own flags follow; add --stock to run stock mlx-lm "
              f"(MLX_QWEN_FAST=0 does the same). {DTYPE_HELP}\n")
    if stock:
        config.restore_process_settings()
        print("mlx_qwen_fast: --stock: running stock mlx-lm", file=sys.stderr)
    if dtype is not None:
        install_dtype(dtype)  # before the fast path's wrapper: the model is cast, then patched
    cold = None
    if not stock:
        from .patching import install

        cold = _first_use_notice(argv)
        install(verbose=True)
    mod = importlib.import_module(module)
    if module == "mlx_lm.server" and not stock:
        from .server import install as install_server  # GET /v1/models lists the loaded model

        install_server(mod)
    if before_main is not None:
        before_main(mod)
    main = mod.main
    prog = sys.argv[0] if " " in sys.argv[0] else f"mlx_qwen_fast.{command}"  # argparse's usage lines
    sys.argv = [prog] + argv
    try:
        main()
    except (ValueError, OSError, KeyError, RuntimeError, TypeError) as exc:  # TypeError: config fields
        if not _loading_error(exc):
            raise
        model = (_flag_values(argv, ("--model",)) or ["not given, mlx-lm's default model"])[0]
        text = " ".join(str(exc).split()) or type(exc).__name__  # the whole message, on one line
        text = text if len(text) <= 300 else text[:297] + "..."
        usage_error(f"--model {model}: mlx-lm could not load it: {type(exc).__name__}: {text}")
    if cold is not None:  # this run compiled what a first use needs: no notice next time
        from .warmup import mark_warm

        mark_warm(cold, f"python -m mlx_qwen_fast.{command}")
