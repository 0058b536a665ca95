"""Run one of mlx-lm's command-line entry points with the fast path installed.

The package's CLIs (``python -m mlx_qwen_fast.generate``, ``.server`` and
``python -m mlx_qwen_fast SUBCOMMAND``) take exactly mlx-lm's flags plus
``--stock`` and ``--dtype {bfloat16,float16,float32}`` (the dtype the loaded
model computes in, :func:`cast_model`; default the checkpoint's).
:func:`run_mlx_lm_main` runs one: the arguments a user most often gets
wrong are checked first, before anything heavy is imported
(:mod:`mlx_qwen_fast._cli_checks`), each failure one line, exit code 2. An
error raised while mlx-lm loads the checkpoint (weights that do not fit the
config, a repo id that cannot be fetched) is printed as one line too, and so
is each warning of the package (:func:`one_line_warnings`, which the
package's own CLIs use as well). :func:`subcommands` and
:func:`check_subcommand` find mlx-lm's CLI modules without importing it.

The package's own CLIs (``python -m mlx_qwen_fast.demo``, ``.checkpoint``)
parse their flags with :class:`mlx_qwen_fast._cli_parser.ArgumentParser`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import List, Optional, Sequence

from . import config
from ._cli_checks import check_arguments, expand_model, flag_values
from ._cli_parser import take_flag, usage_error

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


#: ``--dtype`` values: the activation dtype the loaded model computes in.
DTYPES = ("bfloat16", "float16", "float32")
DTYPE_HELP = ("--dtype {bfloat16,float16,float32}: the dtype the model computes in (default: the checkpoint's); "
              "on a CPU float32 is several times faster than bfloat16 and makes patched and --stock tokens "
              "comparable.")


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


def _first_use_notice(argv: Sequence[str], dtype: Optional[str] = None):
    """When the ``--model`` folder's kernels were not warmed up into MLX's
    compile cache on this machine (CUDA only), start compiling MLX's modules
    of a first use in worker processes (:func:`mlx_qwen_fast.mlx_compiles.start`,
    with :data:`mlx_qwen_fast.config.MLX_COMPILES_AHEAD` on) and say so in one
    line. Returns ``(folder, workers)``: the folder when it printed the line
    (the caller marks it warm once the run completes) and the started
    :class:`~mlx_qwen_fast.mlx_compiles.Ahead` (to wait for after loading),
    each None where not."""
    models = flag_values(argv, ("--model",))
    if not models:
        return None, None
    path = Path(os.path.expanduser(models[0]))
    from . import backend

    if not path.is_dir() or backend.current() != backend.CUDA:
        return None, None
    from .warmup import is_warm

    if is_warm(path):
        return None, None
    ahead = None
    if config.MLX_COMPILES_AHEAD.get():
        from .mlx_compiles import start

        ahead = start(path, dtype)
    if ahead is not None:
        from .mlx_compiles import started_line

        print(started_line(ahead, while_loading=True), file=sys.stderr)
    else:
        print(f"mlx_qwen_fast: MLX may compile CUDA kernels for this model for a few minutes before its first "
              f"token (once per machine; `python -m mlx_qwen_fast warmup --model {models[0]}` does it ahead "
              f"of time)", file=sys.stderr)
    return path, ahead


def _wait_ahead(ahead) -> None:
    """Wait for the MLX compiles :func:`_first_use_notice` started (called
    once the checkpoint is loaded) and say how long they took."""
    from .mlx_compiles import done_line

    print(done_line(ahead.wait()), file=sys.stderr)


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
    argv = expand_model(argv)
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

        cold, ahead = _first_use_notice(argv, dtype)
        install(verbose=True, after_load=None if ahead is None else functools.partial(_wait_ahead, ahead))
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
        model = (flag_values(argv, ("--model",)) or ["not given, mlx-lm's default model"])[0]
        text = " ".join(str(exc).split()) or type(exc).__name__  # the whole message, on one line
        text = text if len(text) <= 300 else text[:297] + "..."
        usage_error(f"--model {model}: mlx-lm could not load it: {type(exc).__name__}: {text}")
    if cold is not None:  # this run compiled what a first use needs: no notice next time
        from .warmup import mark_warm

        mark_warm(cold, f"python -m mlx_qwen_fast.{command}")
