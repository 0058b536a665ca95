"""Build, check and time the CUDA MoE kernels: routing and grouped expert GEMM (device script).

Run on the GPU machine:

    source .mlxcuda/boot.sh && PYTHONPATH=. python3 bench/moe_cuda.py --out $OUT

Sections, each in its own process (a kernel fault cannot take the others
down): build (first-use compile into an empty cubin cache, then a process
loading from the cache), check (fresh random data, outputs poisoned with NaN,
fp32 references; every grouped-GEMM variant of ``moe_grouped_gemm.VARIANTS``
at tile rows 32, 64 and 128, the unverified "async" included), time (T = 512, 2048, 4096 tokens, E = 256,
D = 2048, I = 512, k = 8: routing and every grouped-GEMM variant against
stock mlx-lm's ``SwitchGLU`` / ``gather_qmm``; tiles 32/64 at T = 512, 64/128
above; a few ``ASYNC_TUNE`` settings of "async" at its own tile). FLOPs of the expert GEMMs: 2*T*k*3*D*I,
against the 624 TFLOP/s dense bf16 ceiling. Logs and a JSON of every number
go to --out ($OUT); a short table is printed last.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.device_script import build_lines, finite, log, rel, run_sections, timed_builds  # noqa: E402
from bench.device_script import timeit as _timeit  # noqa: E402

E, D, I, K = 256, 2048, 512, 8
T_LIST = [512, 2048, 4096]
PEAK_BF16 = 624e12


def _mx():
    import mlx.core as mx

    return mx



# one call per evaluation, as the model runs them: several independent calls
# in one evaluation may overlap on the GPU and time throughput, not latency
# (until 2026-12-01 this was batch=3: ~10% lower times at T=4096)
timeit = partial(_timeit, n=15, batch=1)


def make_switch(seed=0, e=E, d=D, i=I):
    """mlx-lm SwitchGLU, 4-bit affine group 64, bf16 scales (the checkpoint's layout)."""
    mx = _mx()
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchGLU

    mx.random.seed(seed)
    sm = SwitchGLU(d, i, e, bias=False)
    nn.quantize(sm, group_size=64, bits=4)
    sm.set_dtype(mx.bfloat16)
    mx.eval(sm.parameters())
    return sm


def experts_chain(sm, r, x, variant):
    """``make(m)`` for ``device_script.chain_latency``: ``m`` dependent
    ``moe_experts`` calls (each one's output is the next one's x), as
    consecutive layers run them."""
    from mlx_qwen_fast.kernels import moe_grouped_gemm as gg

    def make(m):
        def f():
            y = x
            for _ in range(m):
                y = gg.moe_experts(y, r, sm.gate_proj, sm.up_proj, sm.down_proj, variant=variant)
            return y
        return f
    return make


def make_inputs(t, seed, e=E, d=D, skew=1.0):
    mx = _mx()
    ks = mx.random.split(mx.random.key(seed), 3)
    x = mx.random.normal((t, d), key=ks[0]).astype(mx.bfloat16)
    bias = mx.random.normal((e,), key=ks[2]) * skew  # uneven expert popularity
    logits = (mx.random.normal((t, e), key=ks[1]) * 2.0 + bias).astype(mx.bfloat16)
    mx.eval(x, logits)
    return x, logits


# --------------------------------------------------------------------------
# sections
# --------------------------------------------------------------------------

_BUILD_SNIPPET = r"""
import json, time
t0 = time.perf_counter()
import mlx.core as mx
from mlx_qwen_fast.kernels import _cuda_build as cb
from mlx_qwen_fast.kernels import moe_routing as mr, moe_grouped_gemm as gg
t1 = time.perf_counter()
res = {}
ks = [("route", mr._kernel(1, MOE_E=256, MOE_K=8, MOE_LT="bf16_t")), ("group", mr._kernel(2, MOE_E=256)),
      ("gate_up64", gg._kernel(0, 64)[0]), ("gate_up32", gg._kernel(0, 32)[0]),
      ("down64", gg._kernel(1, 64, "float", out_cols=2048)[0]), ("down32", gg._kernel(1, 32, "float", out_cols=2048)[0])]
ks += [(f"gate_up128_{v}", gg._kernel(0, 128, variant=v)[0]) for v in gg.VARIANTS if v != "base"]
for name, k in ks:
    t = time.perf_counter(); k.cubin; res[name] = time.perf_counter() - t
print("BUILDJSON" + json.dumps(dict(import_s=t1 - t0, build_s=res, stats=cb.build_stats, compiler=cb.compiler_id())))
"""


def section_build(args):
    return timed_builds(_BUILD_SNIPPET, ROOT)


def dense_reference(x, r, sm):
    """fp32 math on mx.dequantize-d weights, bf16 rounding where SwitchGLU rounds."""
    mx = _mx()
    deq = lambda p: mx.dequantize(p.weight, p.scales, p.biases, group_size=64, bits=4)  # noqa: E731
    k = r.groups.top_k
    bf = lambda t: t.astype(mx.bfloat16).astype(mx.float32)  # noqa: E731
    order, ex = r.groups.order, r.groups.sorted_experts
    xr = x[order // k].astype(mx.float32)
    n = x.shape[0]
    wg, wu, wd = deq(sm.gate_proj), deq(sm.up_proj), deq(sm.down_proj)  # bf16, exact
    # chunks of 256 rows bound the per-row weight gathers ([256, out, in] fp32)
    outs = []
    for s in range(0, n * k, 256):
        e = ex[s:s + 256]
        xs = xr[s:s + 256][:, None, :]
        g = bf((xs @ wg[e].astype(mx.float32).swapaxes(-1, -2))[:, 0])
        u = bf((xs @ wu[e].astype(mx.float32).swapaxes(-1, -2))[:, 0])
        h = bf(g * mx.sigmoid(g) * u)
        o = bf((h[:, None, :] @ wd[e].astype(mx.float32).swapaxes(-1, -2))[:, 0])
        mx.eval(o)
        outs.append(o)
    o = mx.concatenate(outs)
    y = mx.zeros((n * k, x.shape[1]), mx.float32).at[order].add(o * r.scores.reshape(-1)[order][:, None])
    return y.reshape(n, k, -1).sum(1)


def section_check(args):
    mx = _mx()
    from mlx_qwen_fast.kernels import _cuda_build as cb
    from mlx_qwen_fast.kernels import moe_grouped_gemm as gg
    from mlx_qwen_fast.kernels import moe_routing as mr
    from mlx_qwen_fast.ops import moe

    cb.set_poison(True)
    checks = []
    sm = make_switch(1)
    for t in (1, 7, 300, 2049):
        x, logits = make_inputs(t, seed=100 + t)
        refs = {}  # token-space references: the same for every tile and variant
        for tile in gg.TILE_CHOICES:
            r = mr.route_and_group(logits.astype(mx.float32), K, tile)
            ri, rs = moe.route(logits.astype(mx.float32), K)
            g = moe.group_by_expert(r.inds, E)
            c0 = dict(t=t, tile=tile)
            # bf16 logits tie often: a tie may pick another expert id with the
            # same probability, so compare the selected probabilities
            probs = mx.softmax(logits.astype(mx.float32), axis=-1, precise=True)
            pick = lambda i: mx.sort(mx.take_along_axis(probs, i.astype(mx.int32), 1), 1)  # noqa: E731
            c0["inds_same"] = bool(mx.array_equal(pick(r.inds), pick(ri)).item())
            c0["scores_maxabs"] = mx.max(mx.abs(mx.sort(r.scores, 1) - mx.sort(rs, 1))).item()
            c0["counts_same"] = bool(mx.array_equal(r.groups.counts, g.counts).item())
            c0["bmap_same"] = bool(mx.array_equal(r.block_map, moe.block_map(g, tile)).item())
            c0["sorted_experts_same"] = bool(mx.array_equal(r.groups.sorted_experts, g.sorted_experts).item())
            if not refs:
                refs["inds"], refs["scores"] = r.inds, r.scores
                if t <= 300:
                    refs["dense"] = dense_reference(x, r, sm)
                refs["stock"] = moe.combine(moe.expert_swiglu(x, g, sm.gate_proj, sm.up_proj, sm.down_proj),
                                            r.scores, dtype=mx.float32)
                mx.eval(refs)
            # the references hold for this routing only if it is the same one
            c0["routing_as_ref"] = bool(mx.array_equal(r.inds, refs["inds"]).item()
                                        and mx.array_equal(r.scores, refs["scores"]).item())
            for variant in gg.VARIANTS:
                c = dict(c0, variant=variant)
                got = gg.moe_experts(x, r, sm.gate_proj, sm.up_proj, sm.down_proj, out_dtype=mx.float32,
                                     variant=variant)
                c["finite"] = finite(got)
                if "dense" in refs:
                    c["rel_vs_dense_fp32"] = rel(got, refs["dense"])
                c["rel_vs_gather_qmm"] = rel(got, refs["stock"])
                # every size: against the checked baseline kernel (differs by the
                # dequantisation rounding and summation order only)
                if variant == "base":
                    base_out = got
                c["rel_vs_base"] = rel(got, base_out)
                c["ok"] = (c["inds_same"] and c["counts_same"] and c["bmap_same"] and c["sorted_experts_same"]
                           and c["routing_as_ref"] and c["finite"] and c["scores_maxabs"] < 1e-5
                           and c["rel_vs_gather_qmm"] < 0.06 and c.get("rel_vs_dense_fp32", 0.0) < 0.016
                           and c["rel_vs_base"] < 0.016)
                log(f"[check] {c}")
                checks.append(c)
    cb.set_poison(False)
    return {"checks": checks}


def section_time(args):
    mx = _mx()
    from mlx_qwen_fast.kernels import moe_grouped_gemm as gg
    from mlx_qwen_fast.kernels import moe_routing as mr
    from mlx_qwen_fast.ops import moe

    sm = make_switch(2)
    arr = lambda p: (p.weight, p.scales, p.biases)  # noqa: E731
    tl = [512, 2048] if args.quick else T_LIST
    timings, rows = {}, []
    for t in tl:
        x, logits = make_inputs(t, seed=t)
        flops = 2 * t * K * 3 * D * I

        def stock_route():
            inds, scores = moe.route(logits, K)
            return inds, scores

        def ref_route_group():
            inds, scores = moe.route(logits, K)
            g = moe.group_by_expert(inds, E)
            return g.order, moe.block_map(g, 64), scores

        inds_s, scores_s = moe.route(logits, K)
        mx.eval(inds_s, scores_s)

        def stock_experts():  # mlx-lm SwitchGLU (sorts, 3 gather_qmm, unsorts) + combine
            y = sm(x, inds_s)
            return (y * scores_s[..., None].astype(y.dtype)).sum(-2)

        res = {
            "route_stock_ops(softmax+argpartition)": timeit(stock_route),
            "route+group+block_map_reference_ops": timeit(ref_route_group),
            "route+group_kernels": timeit(lambda: tuple(mr.route_and_group(logits, K, 64)[:2])),
            "experts_stock_SwitchGLU": timeit(stock_experts),
        }
        for tile in ((32, 64) if t <= 512 else (64, 128)):
            r = mr.route_and_group(logits, K, tile)
            mx.eval(r.inds, r.scores, r.groups.order, r.block_map)
            for v in gg.VARIANTS:
                h = gg.gate_up_swiglu(x, r, arr(sm.gate_proj), arr(sm.up_proj), variant=v)
                mx.eval(h)
                res[f"gate_up_kernel_{v}_tile{tile}"] = timeit(
                    lambda: gg.gate_up_swiglu(x, r, arr(sm.gate_proj), arr(sm.up_proj), variant=v))
                res[f"down_kernel_{v}_tile{tile}_f32"] = timeit(lambda: gg.down_weighted(h, r, arr(sm.down_proj), variant=v))
                if v in ("base", "async"):
                    res[f"down_kernel_{v}_tile{tile}_bf16"] = timeit(
                        lambda: gg.down_weighted(h, r, arr(sm.down_proj), out_dtype=mx.bfloat16, variant=v))
                res[f"experts_kernels_{v}_tile{tile}(+combine)"] = timeit(
                    lambda: gg.moe_experts(x, r, sm.gate_proj, sm.up_proj, sm.down_proj, variant=v))
        # "async" tunings (gg.ASYNC_TUNE) at the tile it picks: cp.async depth,
        # column tile of gate+up (64: 100 registers, 2 CTAs/SM) and of down
        tc = gg.choose_tile_rows(t * K, E, "async")
        r = mr.route_and_group(logits, K, tc)
        mx.eval(r.inds, r.scores, r.groups.order, r.block_map)
        saved = dict(gg.ASYNC_TUNE)
        for tune in ({"stages": 3}, {"stages": 5}, {"gate_up_bn": 64}, {"down_bn": 256}, {"down_bn_bm32": 128},
                     {"cols_fast": True}):
            if "down_bn_bm32" in tune and tc != 32:
                continue
            gg.ASYNC_TUNE.update(tune)
            tag = "async[" + ",".join(f"{a}={b}" for a, b in tune.items()) + "]"
            try:
                h = gg.gate_up_swiglu(x, r, arr(sm.gate_proj), arr(sm.up_proj), variant="async")
                mx.eval(h)
                res[f"gate_up_kernel_{tag}_tile{tc}"] = timeit(
                    lambda: gg.gate_up_swiglu(x, r, arr(sm.gate_proj), arr(sm.up_proj), variant="async"))
                res[f"down_kernel_{tag}_tile{tc}_f32"] = timeit(
                    lambda: gg.down_weighted(h, r, arr(sm.down_proj), variant="async"))
                res[f"experts_kernels_{tag}_tile{tc}(+combine)"] = timeit(
                    lambda: gg.moe_experts(x, r, sm.gate_proj, sm.up_proj, sm.down_proj, variant="async"))
            finally:
                gg.ASYNC_TUNE.clear()
                gg.ASYNC_TUNE.update(saved)
        for v in gg.VARIANTS:  # routing + experts at the variant's own tile choice
            tc = gg.choose_tile_rows(t * K, E, v)
            res[f"route+experts_kernels_{v}_tile{tc}"] = timeit(
                lambda: gg.moe_experts(x, mr.route_and_group(logits, K, tc), sm.gate_proj, sm.up_proj,
                                       sm.down_proj, variant=v))
        for name, s in res.items():
            f = flops if ("experts" in name) else (flops * 2 / 3 if "gate_up" in name else flops / 3 if "down" in name else 0)
            rate = f / s / 1e12 if f else 0.0
            timings[f"T={t} {name}"] = {"ms": s * 1e3, "tflops": rate, "pct_peak": 100 * rate * 1e12 / PEAK_BF16}
            rows.append((t, name, s * 1e3, rate))
            log(f"[time] T={t:5d} {name:45s} {s * 1e3:9.3f} ms  {rate:7.1f} TFLOP/s")
    return {"timings": timings}


SECTIONS = {"build": section_build, "check": section_check, "time": section_time}


def main():
    run_sections(__file__, "moe", SECTIONS, summary, __doc__.splitlines()[0],
                 "build,check,time", "T = 512, 2048 only")


def summary(results):
    lines = ["", "=== CUDA MoE kernels: summary ==="]
    lines += build_lines(results)
    ch = results.get("check", {}).get("checks", [])
    bad = [c for c in ch if not c.get("ok")]
    lines.append(f"check: {len(ch) - len(bad)}/{len(ch)} pass" + (f"  FAILED: {bad[:3]}" if bad else ""))
    if ch:
        lines.append("   worst rel vs gather_qmm %.2e, vs dense fp32 %.2e" % (
            max(c.get("rel_vs_gather_qmm", 0) for c in ch), max(c.get("rel_vs_dense_fp32", 0) for c in ch)))
    if ch:
        by_v = {}
        for c in ch:
            if "variant" in c:
                b = by_v.setdefault(c["variant"], [0, 0, 0.0])
                b[0] += bool(c.get("ok"))
                b[1] += 1
                b[2] = max(b[2], c.get("rel_vs_dense_fp32", 0.0))
        lines.append("   per variant: " + ", ".join(f"{v} {a}/{n} (dense {m:.2e})" for v, (a, n, m) in by_v.items()))
    tm = results.get("time", {}).get("timings", {})
    if tm:  # one row per (variant, tile): gate_up / down / experts ms per T
        lines.append("grouped GEMM variants: gate_up ms / down f32 ms / experts(+combine) ms [TFLOP/s] per T")
        rows = {}
        for key, v in tm.items():
            t, name = key.split(" ", 1)
            for part, pre in (("gu", "gate_up_kernel_"), ("dn", "down_kernel_"), ("ex", "experts_kernels_")):
                if name.startswith(pre):
                    rest = name[len(pre):].replace("_f32", "").replace("(+combine)", "")
                    if rest.endswith("_bf16"):
                        continue
                    rows.setdefault(rest, {}).setdefault(int(t[2:]), {})[part] = v
        ts = sorted({tt for r in rows.values() for tt in r})
        lines.append(f"{'variant_tile':16s}" + "".join(f" | {'T=' + str(tt):>30s}" for tt in ts))
        from mlx_qwen_fast.kernels.moe_grouped_gemm import VARIANTS

        def _order(n):
            v, tile = n.rsplit("_tile", 1)
            return (VARIANTS.index(v) if v in VARIANTS else len(VARIANTS), v, int(tile) if tile.isdigit() else 0)

        for name in sorted(rows, key=_order):
            cells = []
            for tt in ts:
                d = rows[name].get(tt)
                if not d or "ex" not in d:
                    cells.append(f" | {'-':>30s}")
                    continue
                cells.append(" | %7.3f %7.3f %7.3f [%5.1f]" % (
                    d.get("gu", {}).get("ms", float("nan")), d.get("dn", {}).get("ms", float("nan")),
                    d["ex"]["ms"], d["ex"]["tflops"]))
            lines.append(f"{name:16s}" + "".join(cells))
    lines.append(f"{'T':>5s} {'variant':45s} {'ms':>9s} {'TFLOP/s':>8s} {'% of 624':>8s}")
    for key, v in results.get("time", {}).get("timings", {}).items():
        t, name = key.split(" ", 1)
        lines.append(f"{t[2:]:>5s} {name:45s} {v['ms']:9.3f} {v['tflops']:8.1f} {v['pct_peak']:8.1f}")
    log("\n".join(lines))


if __name__ == "__main__":
    main()
