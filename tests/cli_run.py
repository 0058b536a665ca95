"""Run one of the package's modules as ``python -m MODULE ARGS`` in a fresh
interpreter and report, with its exit code and output, which modules it had
imported when it exited (to check that argument errors come before mlx-lm
is imported); or run the interpreter with any arguments (:func:`run_python`)."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import FrozenSet, NamedTuple

REPO = Path(__file__).resolve().parent.parent

#: Modules a usage error must not have imported: mlx-lm and what it imports
#: (transformers, and through it PyTorch).
HEAVY = ("mlx_lm", "transformers", "torch")

# Runs the module as `python -m` does (runpy, as __main__, sys.argv[0] the
# module's file), then writes the names in sys.modules to the report file
# however the module exits; its exit code and exceptions pass through.
_WRAPPER = """\
import json, runpy, sys
report, module = sys.argv[1], sys.argv[2]
sys.argv = [module] + sys.argv[3:]
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
finally:
    with open(report, "w") as f:
        json.dump(sorted(sys.modules), f)
"""


class CliRun(NamedTuple):
    """What :func:`run_module` saw: exit code, stdout, stderr, and the names
    of the modules imported by the end of the run."""

    returncode: int
    stdout: str
    stderr: str
    modules: FrozenSet[str]

    def heavy(self):
        """The modules of :data:`HEAVY` (or their submodules) that were imported."""
        return sorted(m for m in self.modules if m.split(".")[0] in HEAVY)


def _environment(extra=None) -> dict:
    """This process's environment with ``extra`` and the repository first on ``PYTHONPATH``."""
    return dict(os.environ, **(extra or {}), PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def run_python(*args: str, timeout: float = 120, env=None, stdin=None) -> subprocess.CompletedProcess:
    """``python args...`` in a subprocess (the repository first on
    ``PYTHONPATH``; ``env``: extra environment variables; ``stdin``: text
    fed to it), its output captured as text."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=_environment(env),
                          timeout=timeout, input=stdin)


def run_module(module: str, *args: str, env=None, timeout: float = 120) -> CliRun:
    """``python -m module args...`` in a subprocess (the repository first on
    ``PYTHONPATH``; ``env``: extra environment variables)."""
    env = _environment(env)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "modules.json"
        r = subprocess.run([sys.executable, "-c", _WRAPPER, str(report), module, *args],
                           capture_output=True, text=True, env=env, timeout=timeout)
        if not report.exists():  # the interpreter died before the wrapper's `finally`
            raise AssertionError(f"python -m {module} wrote no module report: rc {r.returncode}\n{r.stderr}")
        modules = frozenset(json.loads(report.read_text()))
    return CliRun(r.returncode, r.stdout, r.stderr, modules)
