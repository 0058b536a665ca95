"""Check and time the prefill MoE kernels: routing and the grouped expert GEMMs (device script).

Run on the GPU machine:

    source .mlxcuda/boot.sh && PYTHONPATH=. python3 bench/moe_cuda.py --out $OUT [--sections check,time] [--quick]

The model's shape throughout: E = 256 experts, D = 2048, I = 512, top-k 8,
4-bit group-64 experts with bf16 scales (the checkpoint's layout). The
grouped GEMM builds are those of ``moe_grouped_gemm_builds.VARIANTS``: "wgmma"
(Hopper warpgroup MMA, the default on compute capability 9.0) and "mma"
(``mma.sync``, the default elsewhere); "wgmma" is left out on other GPUs.

Sections, each in its own process (a kernel fault cannot take the others
down; ``bench/device_script.py``):

* ``check``: fresh random data, outputs poisoned with NaN. Routing kernels
  against the reference ops of ``ops.moe`` (selected probabilities, counts,
  block map, grouped order); each variant's experts + combine at every tile
  of ``TILE_CHOICES`` against ``gather_qmm`` (the stock experts), the fp32
  dense reference (T <= 300) and, for "wgmma", the "mma" output; on a
  mismatch the error pattern (rows mod the tile, columns mod 128, the K-order
  period: a fragment-layout bug vs a swizzle or pipeline one). Then the
  whole block as the patched model runs it (``ops.moe`` "cuda-prefill":
  router and shared gate as one matmul, the shared expert in the routing's
  slot where it fits) against ``ops.moe.sparse_moe_block``.
* ``time``: T = 512, 2048, 4096 (``--quick``: 512, 2048). One call per
  evaluation (as the model runs them: independent calls in one evaluation
  overlap and time throughput): stock routing ops vs the routing kernels,
  stock ``SwitchGLU`` + combine vs each variant's gate+up, down and
  experts + combine at every tile (the kernels' host check of the routing
  off, as the package's own calls run them). Chained (dependent calls, steady state
  over chains of 16 and 48 that span several of MLX's graph commits:
  ``device_script.chain_latency``) at each variant's own tile choice: the
  experts + combine and the down kernel alone. Last the whole block, stock
  (``Qwen3NextSparseMoeBlock``) vs "cuda-prefill" (the default path).
  FLOPs of the expert GEMMs 2*T*k*3*D*I; TFLOP/s against the dense bf16
  peak (``PEAK_BF16``).

Logs and one JSON per section go to --out; a summary table is printed last.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.device_script import chain_latency, finite, log, rel, run_sections  # noqa: E402
from bench.device_script import timeit as _timeit  # noqa: E402

E, D, I, K = 256, 2048, 512, 8
T_LIST = [512, 2048, 4096]
PEAK_BF16 = 624e12  # H200 dense bf16 tensor-core peak (FLOP/s)

# one call per evaluation, as the model runs them
timeit = partial(_timeit, n=15, batch=1)


def _mx():
    import mlx.core as mx

    return mx


def variants():
    """The grouped-GEMM builds that run on this GPU ("wgmma" needs compute capability 9.0)."""
    from mlx_qwen_fast.kernels import moe_grouped_gemm_builds as ggb

    return [v for v in ggb.VARIANTS if v != "wgmma" or ggb.wgmma_shapes_ok(D, I) and ggb.is_sm90()]


def make_switch(seed=0, e=E, d=D, i=I):
    """mlx-lm ``SwitchGLU``, 4-bit affine group 64, bf16 scales (the checkpoint's layout)."""
    mx = _mx()
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchGLU

    mx.random.seed(seed)
    sm = SwitchGLU(d, i, e, bias=False)
    nn.quantize(sm, group_size=64, bits=4)
    sm.set_dtype(mx.bfloat16)
    mx.eval(sm.parameters())
    return sm


def make_block(seed=0, e=E, d=D, i=I, k=K, router_scale=8.0):
    """A bf16 ``Qwen3NextSparseMoeBlock`` of the model's shape, quantised as the
    checkpoint: experts and shared expert 4-bit, router and shared-expert gate
    8-bit, group 64; random weights from ``seed``, router weights scaled by
    ``router_scale`` (decisive routing)."""
    mx = _mx()
    import mlx.nn as nn
    from mlx_lm.models.qwen3_next import ModelArgs, Qwen3NextSparseMoeBlock

    args = ModelArgs(
        model_type="qwen3_next", hidden_size=d, num_hidden_layers=1, intermediate_size=i,
        num_attention_heads=2, linear_num_value_heads=2, linear_num_key_heads=1,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        num_experts=e, num_experts_per_tok=k, decoder_sparse_step=1,
        shared_expert_intermediate_size=i, mlp_only_layers=[], moe_intermediate_size=i,
        rms_norm_eps=1e-6, vocab_size=16, num_key_value_heads=1, rope_theta=1e4,
        partial_rotary_factor=0.25, max_position_embeddings=128, head_dim=8, norm_topk_prob=True,
    )
    mx.random.seed(seed)
    block = Qwen3NextSparseMoeBlock(args)
    block.gate.weight = block.gate.weight * router_scale

    def predicate(path, m):
        if not hasattr(m, "to_quantized"):
            return False
        if path == "gate" or path.endswith("shared_expert_gate"):
            return {"group_size": 64, "bits": 8}
        return True

    nn.quantize(block, group_size=64, bits=4, class_predicate=predicate)
    block.set_dtype(mx.bfloat16)
    mx.eval(block.parameters())
    return block


def make_inputs(t, seed, e=E, d=D, skew=1.0):
    """``x [t, d]`` bf16 and router logits ``[t, e]`` bf16 with uneven expert popularity."""
    mx = _mx()
    ks = mx.random.split(mx.random.key(seed), 3)
    x = mx.random.normal((t, d), key=ks[0]).astype(mx.bfloat16)
    bias = mx.random.normal((e,), key=ks[2]) * skew
    logits = (mx.random.normal((t, e), key=ks[1]) * 2.0 + bias).astype(mx.bfloat16)
    mx.eval(x, logits)
    return x, logits


def _arr(p):
    return (p.weight, p.scales, p.biases)


def experts_chain(sm, r, x, variant):
    """``make(m)`` for ``device_script.chain_latency``: ``m`` dependent
    ``moe_experts`` calls (each one's output is the next one's x), as
    consecutive layers run them."""
    from mlx_qwen_fast.kernels import moe_grouped_gemm as gg

    def make(m):
        def f():
            y = x
            for _ in range(m):
                y = gg.moe_experts_unchecked(y, r, sm.gate_proj, sm.up_proj, sm.down_proj, variant=variant)
            return y
        return f
    return make


def down_chain(sm, r, h, variant):
    """``make(m)``: ``m`` dependent down-kernel calls on a fixed ``h`` (a cheap
    elementwise link makes each next ``h`` wait for this call's output)."""
    from mlx_qwen_fast.kernels import moe_grouped_gemm as gg

    def make(m):
        def f():
            hh, y = h, None
            for _ in range(m):
                y = gg._down_weighted(hh, r, _arr(sm.down_proj), variant=variant)
                hh = (hh + y[:, : hh.shape[1]].astype(hh.dtype) * 0).astype(hh.dtype)
            return y
        return f
    return make


def block_chain(block, x, implementation):
    """``make(m)``: ``m`` dependent calls of the whole block through ``ops.moe.sparse_moe``."""
    from mlx_qwen_fast.ops import moe

    def make(m):
        def f():
            y = x
            for _ in range(m):
                y = moe.sparse_moe(block, y, implementation=implementation)
            return y
        return f
    return make


def dense_reference(x, r, sm):
    """fp32 math on ``mx.dequantize``-d weights, bf16 rounding where ``SwitchGLU`` rounds."""
    mx = _mx()
    deq = lambda p: mx.dequantize(p.weight, p.scales, p.biases, group_size=64, bits=4)  # noqa: E731
    k = r.groups.top_k
    bf = lambda t: t.astype(mx.bfloat16).astype(mx.float32)  # noqa: E731
    order, ex = r.groups.order, r.groups.sorted_experts
    xr = x[order // k].astype(mx.float32)
    n = x.shape[0]
    wg, wu, wd = deq(sm.gate_proj), deq(sm.up_proj), deq(sm.down_proj)
    outs = []  # chunks of 256 rows bound the per-row weight gathers ([256, out, in] fp32)
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


def error_pattern(a, b, tile):
    """Where two ``[rows, cols]`` arrays differ beyond bf16 noise: rows mod
    ``tile`` and columns mod 128 (short lists), the fraction of bad entries."""
    mx = _mx()
    import numpy as np

    d = mx.abs(a.astype(mx.float32) - b.astype(mx.float32))
    bad = d > 0.05 * mx.maximum(mx.abs(b.astype(mx.float32)), 0.05)
    r = np.nonzero(np.asarray(mx.any(bad, axis=1)))[0]
    c = np.nonzero(np.asarray(mx.any(bad, axis=0)))[0]
    return {"bad_frac": float(mx.mean(bad.astype(mx.float32)).item()),
            "rows_mod_tile": sorted(set((r % tile).tolist()))[:24],
            "cols_mod_128": sorted(set((c % 128).tolist()))[:40],
            "n_bad_rows": int(r.size), "n_bad_cols": int(c.size)}


# --------------------------------------------------------------------------
# sections
# --------------------------------------------------------------------------


def section_check(args):
    mx = _mx()
    from mlx_qwen_fast.kernels import _cuda_build as cb
    from mlx_qwen_fast.kernels import moe_grouped_gemm as gg
    from mlx_qwen_fast.kernels import moe_grouped_gemm_builds as ggb
    from mlx_qwen_fast.kernels import moe_routing as mr
    from mlx_qwen_fast.ops import moe

    cb.set_poison(True)
    checks = []
    vs = variants()
    sm = make_switch(1)
    for t in (1, 7, 300, 2049):
        x, logits = make_inputs(t, seed=100 + t)
        refs = {}  # token-space references: the same for every tile and variant
        for tile in ggb.TILE_CHOICES:
            r = mr.route_and_group(logits.astype(mx.float32), K, tile)
            ri, rs = moe.route(logits.astype(mx.float32), K)
            g = moe.group_by_expert(r.inds, E, check_range=False)
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
            outs = {}
            for variant in vs:
                c = dict(c0, variant=variant)
                try:
                    got = outs[variant] = gg.moe_experts(x, r, sm.gate_proj, sm.up_proj, sm.down_proj,
                                                         out_dtype=mx.float32, variant=variant)
                    c["finite"] = finite(got)
                    if "dense" in refs:
                        c["rel_vs_dense_fp32"] = rel(got, refs["dense"])
                    c["rel_vs_gather_qmm"] = rel(got, refs["stock"])
                    if variant != "mma" and "mma" in outs:
                        c["rel_vs_mma"] = rel(got, outs["mma"])
                    c["ok"] = (c["inds_same"] and c["counts_same"] and c["bmap_same"] and c["sorted_experts_same"]
                               and c["routing_as_ref"] and c["finite"] and c["scores_maxabs"] < 1e-5
                               and c["rel_vs_gather_qmm"] < 0.06 and c.get("rel_vs_dense_fp32", 0.0) < 0.016
                               and c.get("rel_vs_mma", 0.0) < 0.016)
                    if not c["ok"] and t > 1:
                        h = gg.gate_up_swiglu(x, r, _arr(sm.gate_proj), _arr(sm.up_proj), variant=variant)
                        h_mma = gg.gate_up_swiglu(x, r, _arr(sm.gate_proj), _arr(sm.up_proj), variant="mma")
                        c["h_pattern_vs_mma"] = error_pattern(h, h_mma, tile)
                        c["y_pattern_vs_gather_qmm"] = error_pattern(got, refs["stock"], tile)
                except Exception as exc:  # a trap or a build error: keep going, report it
                    c.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:400])
                log(f"[check] {c}")
                checks.append(c)
    # the whole block as the patched model runs it (shared expert in the routing's slot where it fits)
    block = make_block(5)
    for t in (128, 300, 2049):
        x = (mx.random.normal((1, t, D), key=mx.random.key(700 + t)) * 1.5).astype(mx.bfloat16)
        c = dict(t=t, block=True)
        try:
            got = moe.sparse_moe(block, x, implementation="cuda-prefill")
            ref = moe.sparse_moe(block, x, implementation="reference")
            c.update(finite=finite(got), rel_vs_reference=rel(got, ref))
            c["ok"] = c["finite"] and c["rel_vs_reference"] < 0.06
        except Exception as exc:
            c.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:400])
        log(f"[check] {c}")
        checks.append(c)
    cb.set_poison(False)
    return {"checks": checks, "variants": vs}


def section_time(args):
    mx = _mx()
    from mlx_lm.models.qwen3_next import Qwen3NextSparseMoeBlock

    from mlx_qwen_fast.kernels import moe_grouped_gemm as gg
    from mlx_qwen_fast.kernels import moe_grouped_gemm_builds as ggb
    from mlx_qwen_fast.kernels import moe_routing as mr
    from mlx_qwen_fast.ops import moe

    vs = variants()
    sm = make_switch(2)
    block = make_block(3)
    timings, chains = {}, []
    for t in (T_LIST[:2] if args.quick else T_LIST):
        x, logits = make_inputs(t, seed=t)
        flops = 2 * t * K * 3 * D * I
        inds_s, scores_s = moe.route(logits, K)
        mx.eval(inds_s, scores_s)

        def ref_route_group():
            inds, scores = moe.route(logits, K)
            g = moe.group_by_expert(inds, E, check_range=False)
            return g.order, moe.block_map(g, 64), scores

        def stock_experts():  # mlx-lm SwitchGLU (sorts, 3 gather_qmm, unsorts) + combine
            y = sm(x, inds_s)
            return (y * scores_s[..., None].astype(y.dtype)).sum(-2)

        res = {
            "route_stock_ops(softmax+argpartition)": timeit(lambda: moe.route(logits, K)),
            "route+group+block_map_reference_ops": timeit(ref_route_group),
            "route+group_kernels": timeit(lambda: tuple(mr.route_and_group(logits, K, 64)[:2])),
            "experts_stock_SwitchGLU": timeit(stock_experts),
        }
        for tile in ggb.TILE_CHOICES:
            r = mr.route_and_group(logits, K, tile)
            mx.eval(r.inds, r.scores, r.groups.order, r.block_map)
            for v in vs:
                h = gg.gate_up_swiglu(x, r, _arr(sm.gate_proj), _arr(sm.up_proj), variant=v)
                mx.eval(h)
                res[f"gate_up_kernel_{v}_tile{tile}"] = timeit(
                    lambda: gg._gate_up_swiglu(x, r, _arr(sm.gate_proj), _arr(sm.up_proj), variant=v))
                res[f"down_kernel_{v}_tile{tile}_f32"] = timeit(
                    lambda: gg._down_weighted(h, r, _arr(sm.down_proj), variant=v))
                res[f"experts_kernels_{v}_tile{tile}(+combine)"] = timeit(
                    lambda: gg.moe_experts_unchecked(x, r, sm.gate_proj, sm.up_proj, sm.down_proj, variant=v))
        for v in vs:  # routing + experts at the variant's own tile choice
            tc = ggb.choose_tile_rows(t * K, E, v)
            res[f"route+experts_kernels_{v}_tile{tc}"] = timeit(
                lambda: gg.moe_experts_unchecked(x, mr.route_and_group(logits, K, tc), sm.gate_proj, sm.up_proj,
                                        sm.down_proj, variant=v))
        xb = x[None]
        res["block_stock"] = timeit(lambda: Qwen3NextSparseMoeBlock.__call__(block, xb))
        res["block_cuda-prefill"] = timeit(lambda: moe.sparse_moe(block, xb, implementation="cuda-prefill"))
        for name, s in res.items():
            f = (flops if "experts" in name else flops * 2 / 3 if "gate_up" in name
                 else flops / 3 if "down" in name else 0)
            rate = f / s / 1e12 if f else 0.0
            timings[f"T={t} {name}"] = {"ms": s * 1e3, "tflops": rate, "pct_peak": 100 * rate * 1e12 / PEAK_BF16}
            log(f"[time] T={t:5d} {name:45s} {s * 1e3:9.3f} ms  {rate:7.1f} TFLOP/s")
        # chained, steady state: as consecutive layers of a prefill run them
        for v in vs:
            tc = ggb.choose_tile_rows(t * K, E, v)
            r = mr.route_and_group(logits, K, tc)
            mx.eval(r.inds, r.scores, r.groups.order, r.block_map)
            ex = chain_latency(experts_chain(sm, r, x, v), n=6)
            h = gg.gate_up_swiglu(x, r, _arr(sm.gate_proj), _arr(sm.up_proj), variant=v)
            mx.eval(h)
            dn = chain_latency(down_chain(sm, r, h, v), n=6)
            row = dict(t=t, what=f"experts+combine {v}", tile=tc, steady_ms=ex["steady"] * 1e3,
                       marginal_ms=ex["marginal"] * 1e3, single_ms=ex["single"] * 1e3,
                       down_steady_ms=dn["steady"] * 1e3, tflops=flops / ex["steady"] / 1e12)
            log(f"[chain] {row}")
            chains.append(row)
        blk = chain_latency(block_chain(block, xb, "cuda-prefill"), n=6)
        row = dict(t=t, what="block cuda-prefill", steady_ms=blk["steady"] * 1e3,
                   marginal_ms=blk["marginal"] * 1e3, single_ms=blk["single"] * 1e3)
        log(f"[chain] {row}")
        chains.append(row)
    return {"timings": timings, "chains": chains, "variants": vs}


SECTIONS = {"check": section_check, "time": section_time}


def main():
    run_sections(__file__, "moe", SECTIONS, summary, __doc__.splitlines()[0],
                 "check,time", "T = 512, 2048 only")


def summary(results):
    lines = ["", "=== prefill MoE kernels: summary ==="]
    ch = results.get("check", {}).get("checks", [])
    bad = [c for c in ch if not c.get("ok")]
    lines.append(f"check: {len(ch) - len(bad)}/{len(ch)} pass" + (f"  FAILED: {bad[:3]}" if bad else ""))
    by_v = {}
    for c in ch:
        key = "block" if c.get("block") else c.get("variant")
        b = by_v.setdefault(key, [0, 0, 0.0])
        b[0] += bool(c.get("ok"))
        b[1] += 1
        b[2] = max(b[2], c.get("rel_vs_gather_qmm", c.get("rel_vs_reference", 0.0)))
    if by_v:
        lines.append("   per variant: " + ", ".join(f"{v} {a}/{n} (worst rel {m:.2e})" for v, (a, n, m) in by_v.items()))
    tm = results.get("time", {}).get("timings", {})
    if tm:
        lines.append(f"{'T':>5s} {'one call per evaluation':45s} {'ms':>9s} {'TFLOP/s':>8s} {'% peak':>7s}")
        for key, v in tm.items():
            t, name = key.split(" ", 1)
            lines.append(f"{t[2:]:>5s} {name:45s} {v['ms']:9.3f} {v['tflops']:8.1f} {v['pct_peak']:7.1f}")
    rows = results.get("time", {}).get("chains", [])
    if rows:
        lines.append(f"{'T':>5s} {'chained (steady state)':24s} {'tile':>4s} {'ms':>8s} {'TFLOP/s':>8s} {'down ms':>8s}")
        for r in rows:
            lines.append(f"{r['t']:5d} {r['what']:24s} {str(r.get('tile', '-')):>4s} {r['steady_ms']:8.3f} "
                         f"{r.get('tflops', float('nan')):8.1f} {r.get('down_steady_ms', float('nan')):8.3f}")
    log("\n".join(lines))


if __name__ == "__main__":
    main()
