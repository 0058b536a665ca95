"""The Metal A/B on a Mac in one command: stock mlx-lm against the package
with its Metal kernels on, and one table to report.

    python -m bench.mac                    # the tiny preset, then the full-size one
    python -m bench.mac --presets tiny     # the tiny preset alone: a shorter check
        [--out DIR] [--checkpoints DIR] [--user-view-args "..."] [--ab-args "..."] [--plan]

For each preset (``tiny``; ``qwen3.6-35b-a3b``, whose random checkpoint is
19.5 GB, written once by :mod:`bench.user_view` into its default folder
under ``~/.cache/mlx_qwen_fast/user_view/``, or ``--checkpoints
DIR/<preset>``, and reused; :mod:`bench.ab` builds the same weights in
memory, 19.5 GB at the full size) it runs, with
``MLX_QWEN_FAST_METAL=1`` in every process (the patched engine takes the
package's Metal kernels; the stock engine is mlx-lm's either way):

1. :mod:`bench.user_view` (mlx-lm's own ``benchmark`` command in fresh
   processes, stock and patched alternating; default ``--configs b1``: a 4K
   prompt, 128 generated tokens, batch 1) -> ``DIR/user_view-<preset>.json``;
2. :mod:`bench.ab` (both engines in one process sharing the weights, each
   warmed up until two runs agree; default ``--prefill 4k --decode 4k``)
   -> ``DIR/ab-<preset>.json``.

Each prints its own tables as it goes. Last this prints one markdown table
-- per preset and measurement the stock and patched tok/s and their ratio,
under the machine, versions and commit the result files record -- and
writes it to ``DIR/report.md``: the text to paste into an issue. A step
that fails (its exit code, or no result file) is reported as such and the
others still run; the exit code is 1 when any failed.

``--user-view-args`` / ``--ab-args`` replace the default measurement
arguments of that tool (not the preset, checkpoint or output, which this
sets); ``--plan`` prints the commands without running them. Default
``DIR``: ``bench/results/<date>-<device>-mac``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from . import common

PRESETS = ("tiny", "qwen3.6-35b-a3b")
USER_VIEW_ARGS = "--configs b1"
AB_ARGS = "--prefill 4k --decode 4k --decode-steps 32 --rounds 3 --no-plots"
#: The switch every process of the A/B runs under (mlx_qwen_fast.config.METAL_KERNELS).
METAL_ENV = {"MLX_QWEN_FAST_METAL": "1"}


def commands(preset: str, out: Path, user_view_args: str = USER_VIEW_ARGS, ab_args: str = AB_ARGS,
             checkpoints: Optional[Path] = None, python: str = sys.executable) -> Dict[str, List[str]]:
    """``{"user_view": argv, "ab": argv}`` of one preset's two runs, writing
    ``out/user_view-<preset>.json`` and ``out/ab-<preset>.json``
    (bench.user_view's checkpoint in ``checkpoints/<preset>``, or its default
    folder where None)."""
    ckpt = [] if checkpoints is None else ["--checkpoint", str(Path(checkpoints) / preset)]
    return {
        "user_view": [python, "-m", "bench.user_view", "--preset", preset, *ckpt, *shlex.split(user_view_args),
                      "--out", str(out / f"user_view-{preset}.json")],
        "ab": [python, "-m", "bench.ab", "--preset", preset, *shlex.split(ab_args),
               "--out", str(out / f"ab-{preset}.json")],
    }


def _ratio(patched: Optional[float], stock: Optional[float]) -> Optional[float]:
    return patched / stock if patched and stock else None


def report_rows(preset: str, user_view: Optional[Dict], ab: Optional[Dict],
                failed: Sequence[str] = ()) -> List[Dict]:
    """The report's rows of one preset: ``preset``, ``tool``, ``measure``,
    ``stock`` and ``patched`` tok/s (medians; None where not measured),
    ``ratio`` (patched / stock) and ``note`` (statuses other than "ok", or
    the step's failure). ``user_view`` / ``ab``: the tools' result files
    (None where a step wrote none); ``failed``: the steps that failed."""
    rows = []
    for tool in ("user_view", "ab"):
        if tool in failed:
            rows.append({"preset": preset, "tool": tool, "measure": "-", "stock": None, "patched": None,
                         "ratio": None, "note": "failed (see its output above)"})
    by_config: Dict[str, Dict[str, Dict]] = {}
    for r in (user_view or {}).get("summary", []):
        by_config.setdefault(r["config"], {})[r["engine"]] = r
    for config, engines in by_config.items():
        s, p = engines.get("stock", {}), engines.get("patched", {})
        note = ", ".join(f"{e} {r['n_ok']}/{r['n']} ok" for e, r in engines.items() if r["n_ok"] < r["n"])
        for measure, key in (("prompt", "prompt_tps"), ("generation", "generation_tps")):
            rows.append({"preset": preset, "tool": "user_view", "measure": f"{config} {measure}",
                         "stock": s.get(key), "patched": p.get(key), "ratio": _ratio(p.get(key), s.get(key)),
                         "note": note})
    for phase, length in (("prefill", "tokens"), ("decode", "context")):
        points: Dict[int, Dict[str, Dict]] = {}
        for r in (ab or {}).get(phase, []):
            points.setdefault(r[length], {})[r["engine"]] = r
        for n, engines in sorted(points.items()):
            s, p = engines.get("stock", {}), engines.get("patched", {})
            note = ", ".join(f"{e} {r.get('status')}" for e, r in engines.items() if r.get("status") != "ok")
            measure = f"decode at {n}" if phase == "decode" else f"prefill {n}"
            rows.append({"preset": preset, "tool": "ab", "measure": measure,
                         "stock": s.get("tok_s"), "patched": p.get("tok_s"),
                         "ratio": _ratio(p.get("tok_s"), s.get("tok_s")), "note": note})
    return rows


def _num(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:,.1f}"


def format_report(rows: Sequence[Dict], headers: Sequence[Dict]) -> str:
    """Markdown: the machine and versions of the result files ``headers``
    (their ``device``, ``backend``, ``mlx_version``, ``mlx_lm_version``,
    ``commit``, ``date``; each distinct line once), then the table of
    ``rows`` (:func:`report_rows`)."""
    keys = ("device", "backend", "mlx_version", "mlx_lm_version", "commit", "date")
    lines, seen = [], set()
    for h in headers:
        line = ", ".join(f"{k} {h.get(k)}" for k in keys if h.get(k) is not None)
        if line and line not in seen:
            seen.add(line)
            lines.append(f"- {line}")
    lines += ["", "| preset | tool | measure | stock tok/s | patched tok/s | patched / stock | note |",
              "|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        lines.append(f"| {r['preset']} | {r['tool']} | {r['measure']} | {_num(r['stock'])} | "
                     f"{_num(r['patched'])} | {ratio} | {r['note']} |")
    return "\n".join(lines) + "\n"


def _read(path: Path) -> Optional[Dict]:
    try:
        return common.read_json(path)
    except (OSError, ValueError):
        return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.mac", description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default=",".join(PRESETS),
                   help=f"comma-separated, of {', '.join(PRESETS)} (default: both, tiny first)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="result folder (default bench/results/<date>-<device>-mac)")
    p.add_argument("--checkpoints", default=None, metavar="DIR",
                   help="bench.user_view's checkpoints in DIR/<preset> (default: its own cache folder)")
    p.add_argument("--user-view-args", default=USER_VIEW_ARGS,
                   help=f"bench.user_view's (default {USER_VIEW_ARGS!r})")
    p.add_argument("--ab-args", default=AB_ARGS, help=f"bench.ab's (default {AB_ARGS!r})")
    p.add_argument("--plan", action="store_true", help="print the commands, run nothing")
    return p


def main(argv=None) -> int:
    """Run the A/B as the module docstring says; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    if not presets or any(p not in PRESETS for p in presets):
        parser.error(f"--presets: each of {', '.join(PRESETS)}, got {args.presets!r}")
    out = Path(args.out) if args.out else common.default_out("mac").with_suffix("")
    env = dict(os.environ, **METAL_ENV)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(common.REPO_ROOT), env.get("PYTHONPATH")]))
    plan = {p: commands(p, out, args.user_view_args, args.ab_args, args.checkpoints) for p in presets}
    if args.plan:
        for p, cmds in plan.items():
            for argv_ in cmds.values():
                print(" ".join(f"{k}={v}" for k, v in METAL_ENV.items()), shlex.join(argv_))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    rows, headers, any_failed = [], [], False
    for p, cmds in plan.items():
        failed = []
        for tool, argv_ in cmds.items():
            print(f"== {p}: {shlex.join(argv_)}", flush=True)
            if subprocess.run(argv_, env=env, cwd=common.REPO_ROOT).returncode != 0:
                failed.append(tool)
        results = {tool: _read(out / f"{tool}-{p}.json") for tool in cmds}
        failed += [t for t, r in results.items() if r is None and t not in failed]
        any_failed |= bool(failed)
        headers += [r for r in results.values() if r is not None]
        rows += report_rows(p, results["user_view"], results["ab"], failed)
    text = format_report(rows, headers)
    (out / "report.md").write_text(text)
    print(f"\n== report (also in {out / 'report.md'}):\n\n{text}", flush=True)
    return 1 if any_failed else 0


if __name__ == "__main__":
    sys.exit(main())
