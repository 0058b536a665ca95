"""The wgmma grouped expert GEMM ("wg" variant): check it, time it against "pflv" (device script).

Run on the GPU machine:

    source .mlxcuda/boot.sh && PYTHONPATH=. python3 bench/moe_wgmma.py --out $OUT [--sections check,time]
    source .mlxcuda/boot.sh && PYTHONPATH=. python3 bench/moe_wgmma.py --section ncu   # one launch each, for ncu

Sections, each in its own process:

* ``check``: fresh random data, outputs poisoned with NaN. The "wg" kernels
  against "pflv" (checked against fp32 on this GPU before) and, at T <= 300,
  the fp32 dense reference, for tile rows 32/64/128 at T = 7, 300, 4099 on the
  model's shape (E=256, D=2048, I=512, k=8, skewed router). On a mismatch the
  error pattern is logged: which rows of a tile (mod the tile) and which
  columns (mod 128, the K-order period) are off, to tell a fragment-layout
  bug from a descriptor/swizzle or pipeline bug.
* ``time``: chained (dependent) experts + combine calls, steady-state per-call
  latency (chains of 16 and 48 spanning several MLX graph commits, as the
  model's prefill runs; ``device_script.chain_latency``), and the down kernel
  alone, for "pflv" and "wg" at its tile choices, T = 512, 2048, 4096. FLOPs
  2*T*k*3*D*I over the latency: useful TFLOP/s.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.device_script import chain_latency, finite, log, rel, run_sections  # noqa: E402
from bench.moe_cuda import D, E, I, K, dense_reference, experts_chain, make_inputs, make_switch  # noqa: E402


def _arr(p):
    return (p.weight, p.scales, p.biases)


def _pattern(a, b, tile):
    """Where two [rows, cols] arrays differ beyond bf16 noise: rows mod tile,
    cols mod 128 (as short lists)."""
    import mlx.core as mx

    d = mx.abs(a.astype(mx.float32) - b.astype(mx.float32))
    tol = 0.05 * mx.maximum(mx.abs(b.astype(mx.float32)), 0.05)
    bad = d > tol
    rows = mx.any(bad, axis=1)
    cols = mx.any(bad, axis=0)
    import numpy as np

    r = np.nonzero(np.asarray(rows))[0]
    c = np.nonzero(np.asarray(cols))[0]
    return {
        "bad_frac": float(mx.mean(bad.astype(mx.float32)).item()),
        "rows_mod_tile": sorted(set((r % tile).tolist()))[:24],
        "cols_mod_128": sorted(set((c % 128).tolist()))[:40],
        "n_bad_rows": int(r.size), "n_bad_cols": int(c.size),
    }


def section_check(args):
    import mlx.core as mx

    from mlx_qwen_fast.kernels import _cuda_build as cb
    from mlx_qwen_fast.kernels import moe_grouped_gemm as gg
    from mlx_qwen_fast.kernels import moe_routing as mr

    cb.set_poison(True)
    sm = make_switch(1)
    checks = []
    for t in (7, 300, 4099):
        x, logits = make_inputs(t, seed=200 + t)
        dense = dense_reference(x, mr.route_and_group(logits.astype(mx.float32), K, 64), sm) if t <= 300 else None
        for tile in (32, 64, 128):
            r = mr.route_and_group(logits.astype(mx.float32), K, tile)
            c = dict(t=t, tile=tile)
            try:
                h_wg = gg.gate_up_swiglu(x, r, _arr(sm.gate_proj), _arr(sm.up_proj), variant="wg")
                h_pf = gg.gate_up_swiglu(x, r, _arr(sm.gate_proj), _arr(sm.up_proj), variant="pflv")
                y_wg = gg.down_weighted(h_pf, r, _arr(sm.down_proj), variant="wg")
                y_pf = gg.down_weighted(h_pf, r, _arr(sm.down_proj), variant="pflv")
                ex = gg.moe_experts(x, r, sm.gate_proj, sm.up_proj, sm.down_proj, out_dtype=mx.float32, variant="wg")
                mx.eval(h_wg, h_pf, y_wg, y_pf, ex)
                c["finite"] = finite(h_wg) and finite(y_wg) and finite(ex)
                c["h_rel_vs_pflv"] = rel(h_wg, h_pf)
                c["down_rel_vs_pflv"] = rel(y_wg, y_pf)
                if dense is not None:
                    c["experts_rel_vs_dense_fp32"] = rel(ex, dense)
                c["ok"] = (c["finite"] and c["h_rel_vs_pflv"] < 0.008 and c["down_rel_vs_pflv"] < 0.008
                           and c.get("experts_rel_vs_dense_fp32", 0.0) < 0.016)
                if not c["ok"]:
                    c["h_pattern"] = _pattern(h_wg, h_pf, tile)
                    c["down_pattern"] = _pattern(y_wg, y_pf, tile)
            except Exception as exc:  # a trap or a build error: keep going, report it
                c["ok"] = False
                c["error"] = f"{type(exc).__name__}: {exc}"[:400]
            log(f"[check] {c}")
            checks.append(c)
    cb.set_poison(False)
    return {"checks": checks}


def _chain_down(gg, sm, r, h, variant):
    """make(m): m dependent down-kernel calls (a cheap elementwise link makes
    the next h wait for this y)."""
    import mlx.core as mx

    def make(m):
        def f():
            hh, y = h, None
            for _ in range(m):
                y = gg._down(hh, r, _arr(sm.down_proj), mx.float32, variant)
                hh = (hh + y[:, : hh.shape[1]].astype(hh.dtype) * 0).astype(hh.dtype)
            return y
        return f
    return make


def section_time(args):
    import mlx.core as mx

    from mlx_qwen_fast.kernels import moe_grouped_gemm as gg
    from mlx_qwen_fast.kernels import moe_routing as mr

    sm = make_switch(2)
    rows = []
    for t in ((512, 2048) if args.quick else (512, 2048, 4096)):
        x, logits = make_inputs(t, seed=t)
        flops = 2 * t * K * 3 * D * I
        specs = [("pflv", gg.choose_tile_rows(t * K, E, "pflv"), {})]
        auto = gg.choose_tile_rows(t * K, E, "wg")
        specs += [("wg", tile, tune) for tile, tune in (
            ((auto, {}), (64, {})) if t <= 512 else ((auto, {}), (64 if auto == 32 else 32, {}), (128, {})))]
        for v, tile, tune in specs:
            saved = dict(gg.WG_TUNE)
            gg.WG_TUNE.update(tune)
            try:
                r = mr.route_and_group(logits, K, tile)
                mx.eval(r.inds, r.scores, r.groups.order, r.block_map)
                res = chain_latency(experts_chain(sm, r, x, v), n=6)
                h = gg._gate_up(x, r, _arr(sm.gate_proj), _arr(sm.up_proj), v)
                mx.eval(h)
                rd = chain_latency(_chain_down(gg, sm, r, h, v), n=6)
            finally:
                gg.WG_TUNE.clear()
                gg.WG_TUNE.update(saved)
            name = v + "".join(f",{a}={b}" for a, b in tune.items())
            row = dict(t=t, variant=name, tile=tile, experts_steady_ms=res["steady"] * 1e3,
                       experts_marginal_ms=res["marginal"] * 1e3, down_steady_ms=rd["steady"] * 1e3,
                       tflops=flops / res["steady"] / 1e12)
            log(f"[time] {row}")
            rows.append(row)
    return {"rows": rows}


def section_ncu(args):
    """One launch of each kernel at T=4096 (tile 64) for ncu: pflv, then wg."""
    import mlx.core as mx

    from mlx_qwen_fast.kernels import moe_grouped_gemm as gg
    from mlx_qwen_fast.kernels import moe_routing as mr

    sm = make_switch(2)
    x, logits = make_inputs(4096, seed=4096)
    r = mr.route_and_group(logits, K, 64)
    mx.eval(r.inds, r.scores, r.groups.order, r.block_map)
    for v in ("pflv", "wg"):
        mx.eval(gg.moe_experts(x, r, sm.gate_proj, sm.up_proj, sm.down_proj, variant=v))
    mx.synchronize()
    return {}


SECTIONS = {"check": section_check, "time": section_time, "ncu": section_ncu}


def summary(results):
    lines = ["", "=== wgmma grouped GEMM: summary ==="]
    ch = results.get("check", {}).get("checks", [])
    bad = [c for c in ch if not c.get("ok")]
    lines.append(f"check: {len(ch) - len(bad)}/{len(ch)} pass")
    for c in ch:
        lines.append("  T=%-5d tile %-3d ok=%s h %.2e down %.2e dense %s %s" % (
            c["t"], c["tile"], c.get("ok"), c.get("h_rel_vs_pflv", float("nan")),
            c.get("down_rel_vs_pflv", float("nan")),
            "%.2e" % c["experts_rel_vs_dense_fp32"] if "experts_rel_vs_dense_fp32" in c else "-",
            c.get("error", "")[:120]))
    tm = results.get("time", {}).get("rows", [])
    if tm:
        lines.append(f"{'T':>5s} {'variant':14s} {'tile':>4s} {'experts ms':>10s} {'TFLOP/s':>8s} {'down ms':>8s}")
        for r in tm:
            lines.append(f"{r['t']:5d} {r['variant']:14s} {r['tile']:4d} {r['experts_steady_ms']:10.3f} "
                         f"{r['tflops']:8.1f} {r['down_steady_ms']:8.3f}")
    log("\n".join(lines))


def main():
    run_sections(__file__, "wgmma", SECTIONS, summary, __doc__.splitlines()[0], "check,time", "T = 512, 2048 only")


if __name__ == "__main__":
    main()
