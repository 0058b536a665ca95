"""PNG plots from a result JSON (matplotlib; no MLX needed).

    python -m bench.plots RESULT.json [RESULT2.json ...]

For an ``ab`` result: ``<stem>-prefill.png`` (prefill tok/s vs prompt length)
and ``<stem>-decode.png`` (decode tok/s vs context), next to the JSON. Both
engines, median with min-max bars, log-scale axes, the patched/stock speed-up
written at every length where both runs are "ok". Timed-out points are drawn
hollow at the rate they had reached; points not run are left out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List

COLORS = {"stock": "tab:gray", "patched": "tab:blue"}


def _fmt_len(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _plot_sweep(records: List[Dict], x_key: str, title: str, xlabel: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    by_engine: Dict[str, List[Dict]] = {}
    for r in records:
        by_engine.setdefault(r["engine"], []).append(r)
    for engine, recs in sorted(by_engine.items()):
        recs = sorted(recs, key=lambda r: r[x_key])
        color = COLORS.get(engine)
        ok = [r for r in recs if r["status"] == "ok" and r.get("tok_s")]
        if ok:
            xs = [r[x_key] for r in ok]
            ys = [r["tok_s"] for r in ok]
            lo = [r["tok_s"] - (r.get("tok_s_min") or r["tok_s"]) for r in ok]
            hi = [(r.get("tok_s_max") or r["tok_s"]) - r["tok_s"] for r in ok]
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", color=color, label=engine,
                        capsize=3)
        partial = [r for r in recs if r["status"] == "timeout" and r.get("tok_s")]
        if partial:
            ax.scatter([r[x_key] for r in partial], [r["tok_s"] for r in partial],
                       facecolors="none", edgecolors=color, marker="o", s=60,
                       label=f"{engine} (timeout: rate reached)")
        for r in recs:
            if r["status"] in ("oom", "error"):
                ax.annotate(r["status"], (r[x_key], 1), xycoords=("data", "axes fraction"),
                            xytext=(0, -14), textcoords="offset points", ha="center",
                            fontsize=8, color=color)
    stock = {r[x_key]: r for r in by_engine.get("stock", []) if r["status"] == "ok"}
    for r in by_engine.get("patched", []):
        s = stock.get(r[x_key])
        if r["status"] == "ok" and s and s.get("tok_s") and r.get("tok_s"):
            ax.annotate(f"{r['tok_s'] / s['tok_s']:.2f}x", (r[x_key], r["tok_s"]),
                        xytext=(0, 8), textcoords="offset points", ha="center", fontsize=8)
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    xs = sorted({r[x_key] for r in records})
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [_fmt_len(x) for x in xs])
    ax.xaxis.set_minor_locator(NullLocator())
    rates = [v for r in records for v in (r.get("tok_s"), r.get("tok_s_min"), r.get("tok_s_max"))
             if v]
    if rates:
        ax.set_yscale("log")
        ax.set_ylim(min(rates) / 1.6, max(rates) * 1.6)
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_locator(NullLocator())
    ax.set_xlabel(xlabel)
    ax.set_ylabel("tokens / s")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    if by_engine:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _title(result: Dict, what: str) -> str:
    ckpt = result.get("preset") or result.get("model") or "?"
    skew = result.get("router_skew")
    skew = f", router skew {skew}" if skew else ""
    return (f"{what}: {ckpt}{skew} on {result.get('device', '?')}\n"
            f"mlx {result.get('mlx_version')}, mlx-lm {result.get('mlx_lm_version')}, "
            f"commit {str(result.get('commit', '?'))[:12]}")


def plot_ab(result: Dict, stem: Path) -> List[Path]:
    """The prefill and decode plots of an ``ab`` result; returns the files written."""
    out = []
    if result.get("prefill"):
        out.append(_plot_sweep(result["prefill"], "tokens", _title(result, "prefill"),
                               "prompt length (tokens)", Path(f"{stem}-prefill.png")))
    if result.get("decode"):
        out.append(_plot_sweep(result["decode"], "context", _title(result, "decode"),
                               "context length (tokens)", Path(f"{stem}-decode.png")))
    return out


def plot_file(path) -> List[Path]:
    """Plots of the result JSON at ``path``, next to it. Kinds other than
    ``ab`` have no plots (an empty list)."""
    path = Path(path)
    with open(path) as f:
        result = json.load(f)
    stem = path.with_suffix("")
    if result.get("kind") == "ab":
        return plot_ab(result, stem)
    return []


def plot_file_or_hint(path) -> List[Path]:
    """:func:`plot_file`, or a hint to run it elsewhere when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"matplotlib is not installed: plot later with "
              f"`python -m bench.plots {path}`", flush=True)
        return []
    files = plot_file(path)
    for f in files:
        print("wrote", f, flush=True)
    return files


def main(argv=None) -> List[Path]:
    p = argparse.ArgumentParser(prog="python -m bench.plots", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="result JSON files")
    args = p.parse_args(argv)
    written = []
    for path in args.results:
        files = plot_file(path)
        if not files:
            print(f"{path}: nothing to plot", file=sys.stderr)
        for f in files:
            print("wrote", f)
        written += files
    return written


if __name__ == "__main__":
    main()
