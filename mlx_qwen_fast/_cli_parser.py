"""The package's command-line parsing: one-line usage errors and typed flags.

Every usage error of the package's CLIs prints ``PROG: error: MESSAGE`` on
one line to stderr and exits with code 2 (argparse's usage-error code):
:func:`usage_error` for the checks made before argparse runs,
:class:`ArgumentParser` for the package's own CLIs (``python -m
mlx_qwen_fast.demo``, ``.checkpoint``), whose values :func:`whole_number`
and :func:`finite_number` type. :func:`take_flag` takes one of the
package's flags out of an argv that mlx-lm parses afterwards. Imports
nothing heavy.
"""

from __future__ import annotations

import argparse
import difflib
import math
import sys
from typing import Sequence

__all__ = ["ArgumentParser", "finite_number", "take_flag", "usage_error", "whole_number"]


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
