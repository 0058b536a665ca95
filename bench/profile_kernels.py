"""Latency of the prefill kernels as the model sees them, and launches for ncu.

Sections (one per process call, ``python3 bench/profile_kernels.py SECTION``;
``chain`` takes an optional comma list of parts: scan, gdn, moe, qmm,
decode):

* ``chain``: ``n`` *dependent* calls in one evaluation (each call reads what the
  previous one wrote, as consecutive layers do), so neither MLX's per-evaluation
  cost nor overlap of independent launches enters the per-call time:
  the GDN scan (state feeds the next call) at B=1, T=4096 and T=16 (the
  per-call cost with almost no GPU work), the GDN front end + scan as the
  layer runs them (conv state and state feed the next call), the fused
  front end + scan kernel, the front end alone, the MoE expert GEMMs (gate+up -> down -> combine -> the next
  call's x) at T=4096 per variant and pflv without its register cap, and
  (part ``qmm``) stock dense 4-bit ``quantized_matmul`` vs bf16 ``matmul`` at
  the model's projection shapes, M=4096; (part ``decode``) the GDN decode
  step in 30 dependent steps, graph building and evaluation apart, beside
  one-op MLX chains (MLX's cost per graph node). Printed: ms per call for chain lengths 1 and ``n`` (their difference / (n-1)
  is the marginal latency of one call).
* ``block``: for ncu ``--profile-from-start off``: the whole patched sparse
  MoE block of the full-size preset (layer 0: router matmul, routing, x
  permutation, expert GEMMs, combine, shared expert and its gate), one call
  at T=4096 and one at T=1, each after a warm-up call, inside
  ``cuProfilerStart``/``cuProfilerStop``: every kernel of one block call, so
  the routing's share of the block is measured, not estimated.
  ``block T,T,... shared_min_tokens=N``: the shared expert through the
  grouped kernels from N tokens (``moe_grouped_gemm.SHARED_GEMM_MIN_TOKENS``
  and ``SHARED_SLOT_MIN_TOKENS``) instead of the package's thresholds; with ``MLX_QWEN_FAST_MOE_SHARED_GEMM``
  (0: dense beside the kernels, "group": its own one-expert launches, else
  the routing's shared slot) this times each form of issue 5's "shared
  expert fused in or run alongside". (Until the thirteenth session a
  ``shared beside|inside`` section measured a prototype of the slot form on
  weights copied into an extended expert array.)
* ``ncu``: one launch of each profiled kernel (the GDN front end, three GDN
  decode steps, the MoE decode kernels at one token, the scan
  configurations of ``SCAN_CONFIGS``, gate+up and down of ``MOE_VARIANTS``,
  at T=4096) for ncu.

Run on the device (bench/h200.sh ``profile``); CUDA only.
"""
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402

from bench.device_script import build_eval_times, chain_latency  # noqa: E402
from bench.gdn_cuda import HV, D, gates, qkv_inputs, scan_chain  # noqa: E402
from bench.moe_cuda import E, K, experts_chain, make_inputs, make_switch  # noqa: E402


def _report(label, make, n, steady=(16, 48)):
    """Print one chain_latency line; returns the steady-state marginal
    latency (seconds) when measured, else the short-chain one."""
    r = chain_latency(make, n, steady=steady)
    tail = f" | steady {r['steady'] * 1e3:8.3f} ms" if "steady" in r else ""
    print(f"{label:48s} 1 call/eval {r['single'] * 1e3:8.3f} ms | {n} chained {r['per_call'] * 1e3:8.3f} ms/call"
          f" | marginal {r['marginal'] * 1e3:8.3f} ms{tail}", flush=True)
    return r.get("steady", r["marginal"])


SCAN_CONFIGS = [None, (8, 2, 4, 64, 0, 1), (8, 2, 4, 16, 0, 1)]
MOE_VARIANTS = ("pflv", "wg")


def _uncapped(variant_config):
    """``variant_config`` without the MOE_MINB register cap (an experiment:
    pflv's 16-byte fetches at the uncapped register count)."""
    def cfg(*args, **kw):
        d = dict(variant_config(*args, **kw))
        d.pop("MOE_MINB", None)
        return d
    return cfg


def chain_scan(n=8, configs=SCAN_CONFIGS):
    from mlx_qwen_fast.kernels import gated_delta_scan as S

    for T, cfg in [(16, None)] + [(4096, c) for c in configs]:
        cfg = S.ScanConfig(*cfg) if cfg else S.DEFAULT_CONFIG
        key = mx.random.key(T)
        k1, k2, k3 = mx.random.split(key, 3)
        q, k, v = qkv_inputs(1, T, k1, mx.bfloat16)
        g, beta = gates(1, T, "weak", k2)
        s0 = 0.5 * mx.random.normal((1, HV, D, D), key=k3)
        mx.eval(q, k, v, g, beta, s0)
        _report(f"gdn scan B=1 T={T} cfg={list(cfg)}", scan_chain(q, k, v, g, beta, s0, cfg), n)


def chain_prefill_gdn(n=8, fe_tokens_per_warp=(16,)):
    """Front end (conv + SiLU + norms + gates) then scan, as the layer runs
    them: the conv state and the recurrent state feed the next call; the
    front end also alone, and both at each of ``fe_tokens_per_warp``."""
    from bench.gdn_cuda import HK, fe_params
    from mlx_qwen_fast.kernels import gated_delta_scan as S
    from mlx_qwen_fast.kernels.gated_delta_frontend import gated_delta_frontend

    T, C = 4096, (2 * HK + HV) * D
    k1, k2, k3, k4 = mx.random.split(mx.random.key(7), 4)
    w, A_log, dt_bias = fe_params(k4, mx.bfloat16)
    qkv = mx.random.normal((1, T, C), key=k1).astype(mx.bfloat16)
    a = mx.random.normal((1, T, HV), key=k2).astype(mx.bfloat16)
    cs0 = mx.random.normal((1, 3, C), key=k3).astype(mx.bfloat16)
    s0 = 0.1 * mx.random.normal((1, HV, D, D), key=k3)
    mx.eval(qkv, a, cs0, s0, w, A_log, dt_bias)

    def two_kernels(linked):
        # linked: the next front end also waits for this scan's y (a
        # 3-element link), as the next layer waits for this one in the model
        def make(m):
            def f():
                cs, st, y = cs0, s0, None
                for _ in range(m):
                    if linked and y is not None:
                        cs = cs + (y[:, -3:, 0, :1] * 0).astype(cs.dtype)
                    q, k, v, g, beta, cs = gated_delta_frontend(qkv, a, a, w, cs, A_log, dt_bias,
                                                                num_k_heads=HK, num_v_heads=HV)
                    y, st = S.gated_delta_scan(q, k, v, g, beta, st)
                return y, st, cs
            return f
        return make

    def run_fe(m):  # the front end alone, the conv state carried
        def f():
            cs, outs = cs0, None
            for _ in range(m):
                *outs, cs = gated_delta_frontend(qkv, a, a, w, cs, A_log, dt_bias,
                                                 num_k_heads=HK, num_v_heads=HV)
            return (*outs, cs)
        return f

    from mlx_qwen_fast.kernels import gated_delta_frontend as FE

    default_tt = FE.TT
    for tt in (default_tt,) + tuple(t for t in fe_tokens_per_warp if t != default_tt):
        FE.TT = tt  # the front end's tokens per warp (a build macro); default first
        FE._kernels.clear()
        tag = "" if tt == default_tt else f" [front end TT={tt}]"
        if tt == default_tt:
            _report(f"gdn front end + scan B=1 T={T}", two_kernels(False), n)
        _report(f"gdn front end + scan, linked, B=1 T={T}{tag}", two_kernels(True), n)
        _report(f"gdn front end alone B=1 T={T}{tag}", run_fe, n)
    FE.TT = default_tt
    FE._kernels.clear()

    from mlx_qwen_fast.kernels.gated_delta_prefill import gated_delta_prefill

    def run_fused(per_sm):  # front end + scan in one launch
        def make(m):
            def f():
                cs, st, y = cs0, s0, None
                for _ in range(m):
                    y, st, cs = gated_delta_prefill(qkv, a, a, w, cs, A_log, dt_bias, st, num_k_heads=HK,
                                                    num_v_heads=HV, fe_blocks_per_sm=per_sm)
                return y, st, cs
            return f
        return make

    _report(f"gdn fused front end + scan B=1 T={T} fe/SM=1", run_fused(1), n)


def chain_moe(n=6, variants=MOE_VARIANTS):
    from mlx_qwen_fast.kernels import moe_grouped_gemm as gg
    from mlx_qwen_fast.kernels import moe_routing as mr

    sm = make_switch(2)
    T = 4096
    x, logits = make_inputs(T, seed=T)
    flops = 2 * T * K * 3 * 2048 * 512
    for v in variants:
        r = mr.route_and_group(logits, K, gg.choose_tile_rows(T * K, E, v))
        mx.eval(r.inds, r.scores, r.groups.order, r.block_map)

        marg = _report(f"moe experts+combine T={T} {v}", experts_chain(sm, r, x, v), n)
        print(f"{'':48s} -> {flops / marg / 1e12:.1f} TFLOP/s (marginal)", flush=True)
        arr = lambda p: (p.weight, p.scales, p.biases)  # noqa: E731

        def run_bf16y(m):  # the same with down writing bf16 y (half the bytes of y)
            def f():
                y = x
                for _ in range(m):
                    h = gg.gate_up_swiglu(y, r, arr(sm.gate_proj), arr(sm.up_proj), variant=v)
                    yd = gg.down_weighted(h, r, arr(sm.down_proj), out_dtype=mx.bfloat16, variant=v)
                    y = yd.reshape(T, K, -1).sum(axis=1).astype(mx.bfloat16)
                return y
            return f

        marg = _report(f"moe experts+combine, bf16 y, T={T} {v}", run_bf16y, n)
        print(f"{'':48s} -> {flops / marg / 1e12:.1f} TFLOP/s (marginal)", flush=True)
        # down alone on a fixed h (gate+up's time = experts above minus this)
        h = gg.gate_up_swiglu(x, r, arr(sm.gate_proj), arr(sm.up_proj), variant=v)
        mx.eval(h)

        def run_down(m):
            def f():
                hh, outs = h, []
                for _ in range(m):
                    yd = gg.down_weighted(hh, r, arr(sm.down_proj), variant=v)
                    # next h depends on this output (a cheap elementwise link)
                    hh = (hh + yd[:, :512].astype(hh.dtype) * 0).astype(hh.dtype)
                    outs.append(yd)
                return outs[-1]
            return f

        _report(f"moe down (+link) T={T} {v}", run_down, n)

    # experiment: pflv without the 128-register cap of gate+up (MOE_MINB)
    capped = gg.variant_config
    gg.variant_config = _uncapped(capped)
    try:
        r = mr.route_and_group(logits, K, gg.choose_tile_rows(T * K, E, "pflv"))

        ref = gg.moe_experts(x, r, sm.gate_proj, sm.up_proj, sm.down_proj, variant="pflv")
        gg.variant_config = capped
        want = gg.moe_experts(x, r, sm.gate_proj, sm.up_proj, sm.down_proj, variant="pflv")
        gg.variant_config = _uncapped(capped)
        diff = mx.abs(ref.astype(mx.float32) - want.astype(mx.float32)).max().item()
        print(f"{'':48s} pflv uncapped vs capped: max |diff| {diff:.3g}", flush=True)
        marg = _report(f"moe experts+combine T={T} pflv uncapped", experts_chain(sm, r, x, "pflv"), n)
        print(f"{'':48s} -> {flops / marg / 1e12:.1f} TFLOP/s (marginal)", flush=True)
    finally:
        gg.variant_config = capped


def chain_dense_qmm(n=6, M=4096):
    """Stock ``mx.quantized_matmul`` (4-bit, group 64, as the checkpoint's
    dense projections) at the model's prefill shapes, against bf16
    ``mx.matmul``: pairs K->N->K chained (each output feeds the next call),
    marginal ms per pair and TFLOP/s."""
    for K_, N_ in ((2048, 8192), (2048, 4096), (2048, 512)):
        ks = mx.random.split(mx.random.key(N_), 3)
        x = mx.random.normal((M, K_), key=ks[0]).astype(mx.bfloat16)
        w1 = (0.02 * mx.random.normal((N_, K_), key=ks[1])).astype(mx.bfloat16)
        w2 = (0.02 * mx.random.normal((K_, N_), key=ks[2])).astype(mx.bfloat16)
        q1, q2 = mx.quantize(w1, 64, 4), mx.quantize(w2, 64, 4)
        mx.eval(x, w1, w2, *q1, *q2)
        flops = 2 * 2 * M * K_ * N_

        def run_q(m):
            def f():
                y = x
                for _ in range(m):
                    h = mx.quantized_matmul(y, *q1, transpose=True, group_size=64, bits=4)
                    y = mx.quantized_matmul(h, *q2, transpose=True, group_size=64, bits=4)
                return y
            return f

        def run_b(m):
            def f():
                y = x
                for _ in range(m):
                    y = (y @ w1.T) @ w2.T
                return y
            return f

        for label, run in (("qmm 4-bit", run_q), ("bf16 matmul", run_b)):
            marg = _report(f"dense {label} M={M} {K_}->{N_}->{K_}", run, n)
            print(f"{'':48s} -> {flops / marg / 1e12:.1f} TFLOP/s (marginal)", flush=True)


def chain_decode_gdn(n=30):
    """Where a GDN decode step's time goes: ``n`` dependent steps (conv state
    and state feed the next, as consecutive tokens) in one evaluation, split
    into graph building and evaluation, for the fused decode kernel compiled
    (as the layer runs it) and eager, and for one-op MLX chains (an add on an
    array of the state's size, and on a 32-element one: MLX's own cost per
    graph node). Printed per step, in microseconds."""
    from bench.gdn_cuda import HK, fe_params
    from mlx_qwen_fast.kernels.gated_delta_decode import gated_delta_decode

    C = (2 * HK + HV) * D
    ks = mx.random.split(mx.random.key(11), 7)
    w, A_log, dt_bias = fe_params(ks[0], mx.bfloat16)
    qkv = mx.random.normal((1, 1, C), key=ks[1]).astype(mx.bfloat16)
    z = mx.random.normal((1, 1, HV * D), key=ks[2]).astype(mx.bfloat16)
    ab = mx.random.normal((1, 1, HV), key=ks[3]).astype(mx.bfloat16)
    nw = (1.0 + 0.1 * mx.random.normal((D,), key=ks[4])).astype(mx.bfloat16)
    cs0 = mx.random.normal((1, 3, C), key=ks[5]).astype(mx.bfloat16)
    s0 = 0.1 * mx.random.normal((1, HV, D, D), key=ks[6])
    small = mx.zeros((1, 32))
    mx.eval(w, A_log, dt_bias, qkv, z, ab, nw, cs0, s0, small)

    def steps(compiled):
        def build():
            cs, st, out = cs0, s0, None
            for _ in range(n):
                out, cs, st = gated_delta_decode(qkv, z, ab, ab, w, cs, A_log, dt_bias, nw, st,
                                                 num_k_heads=HK, num_v_heads=HV, compiled=compiled)
            return out, cs, st
        return build

    def adds(x0):
        def build():
            x = x0
            for _ in range(n):
                x = x + 1.0
            return x
        return build

    @mx.compile
    def step_with_reshapes(qkv, z, a, b, w, cs, A_log, dt_bias, nw, st):
        # the compiled step as it was through 2026-12-01: 5 reshapes (graph
        # nodes without a kernel) before the kernel
        B = qkv.shape[0]
        return gated_delta_decode(qkv.reshape(B, C), z.reshape(B, HV * D), a.reshape(B, HV),
                                  b.reshape(B, HV), w.reshape(C, 4), cs, A_log, dt_bias, nw, st,
                                  num_k_heads=HK, num_v_heads=HV)

    def steps_with_reshapes():
        cs, st, out = cs0, s0, None
        for _ in range(n):
            out, cs, st = step_with_reshapes(qkv, z, ab, ab, w, cs, A_log, dt_bias, nw, st)
        return out, cs, st

    def reshapes():
        x = s0
        for i in range(n):
            x = x.reshape((1, HV * D, D) if i % 2 == 0 else (1, HV, D, D))
        return x

    add1 = mx.compile(lambda x: x + 1.0)

    def compiled_adds():
        x = s0
        for _ in range(n):
            x = add1(x)
        return x

    for label, build in (("gdn decode step, compiled (the layer's path)", steps(True)),
                         ("gdn decode step, compiled, 5 reshapes first", steps_with_reshapes),
                         ("gdn decode step, eager", steps(False)),
                         ("mlx reshape (no kernel) on the state", reshapes),
                         ("mlx add on the state's size (2 MB fp32)", adds(s0)),
                         ("mlx add on the state's size, mx.compile'd", compiled_adds),
                         ("mlx add on 32 floats", adds(small))):
        tb, te = build_eval_times(build)
        print(f"decode {label:48s} per step: build {tb / n * 1e6:7.1f} us + eval {te / n * 1e6:7.1f} us"
              f" = {(tb + te) / n * 1e6:7.1f} us  ({n} chained)", flush=True)


def ncu_launches():
    from mlx_qwen_fast.kernels import gated_delta_scan as S
    from mlx_qwen_fast.kernels import moe_grouped_gemm as gg
    from mlx_qwen_fast.kernels import moe_routing as mr

    T = 4096
    k1, k2, k3 = mx.random.split(mx.random.key(1), 3)
    q, k, v = qkv_inputs(1, T, k1, mx.bfloat16)
    g, beta = gates(1, T, "weak", k2)
    s0 = 0.5 * mx.random.normal((1, HV, D, D), key=k3)
    mx.eval(q, k, v, g, beta, s0)
    from bench.gdn_cuda import HK, fe_params
    from mlx_qwen_fast.kernels.gated_delta_frontend import gated_delta_frontend

    w, A_log, dt_bias = fe_params(k1, mx.bfloat16)
    qkv = mx.random.normal((1, T, (2 * HK + HV) * D), key=k2).astype(mx.bfloat16)
    ab = mx.random.normal((1, T, HV), key=k3).astype(mx.bfloat16)
    mx.eval(qkv, ab, w, A_log, dt_bias)
    mx.eval(gated_delta_frontend(qkv, ab, ab, w, None, A_log, dt_bias, num_k_heads=HK, num_v_heads=HV))
    from mlx_qwen_fast.kernels.gated_delta_decode import gated_delta_decode

    nw = mx.ones((D,), mx.bfloat16)
    st = s0
    for _ in range(3):  # the decode kernel, a few dependent steps
        st = gated_delta_decode(qkv[:, :1], qkv[:, 1, : HV * D], ab[:, :1], ab[:, :1], w, None, A_log,
                                dt_bias, nw, st, num_k_heads=HK, num_v_heads=HV)[2]
    mx.eval(st)
    from bench.moe_decode_cuda import D as DM
    from bench.moe_decode_cuda import make_block
    from mlx_qwen_fast.kernels import moe_decode_gemv as md

    blk = make_block(3)  # the MoE decode kernels at one token
    xd = mx.random.normal((1, DM), key=k1).astype(mx.bfloat16)
    inds, scores = mr.route(blk.gate(xd), K)
    mx.eval(md.moe_decode_arrays(xd, inds, scores, *md.block_arrays(blk)))
    for cfg in SCAN_CONFIGS:
        mx.eval(S.gated_delta_scan(q, k, v, g, beta, s0, config=cfg))
    sm = make_switch(2)
    x, logits = make_inputs(T, seed=T)
    for variant in MOE_VARIANTS:
        r = mr.route_and_group(logits, K, gg.choose_tile_rows(T * K, E, variant))
        mx.eval(r.inds, r.scores, r.groups.order, r.block_map)
        mx.eval(gg.moe_experts(x, r, sm.gate_proj, sm.up_proj, sm.down_proj, variant=variant))
    mx.synchronize()


def _preset_moe_block(skew: float):
    """Layer 0's patched sparse MoE block of the full-size preset (random
    weights, router skew ``skew``) and the model's hidden size."""
    import mlx_qwen_fast
    from bench import common
    from mlx_qwen_fast.checkpoint import build_model

    model, _ = build_model("qwen3.6-35b-a3b", seed=0, router_skew=skew)
    mlx_qwen_fast.patch(model)
    return model.language_model.model.layers[0].mlp, common.text_args(model).hidden_size


def _profile_once(run):
    """Evaluate ``run()`` once between cuProfilerStart/Stop (for ncu
    ``--profile-from-start off``); the caller has warmed it up."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    mx.synchronize()
    cuda.cuProfilerStart()
    mx.eval(run())
    mx.synchronize()
    cuda.cuProfilerStop()


def block_launches(tokens=(4096, 1), skew=1.0, wg_tune=None, shared_min_tokens=None):
    """One warm-up call, then one profiled call of the patched MoE block of
    layer 0 per T in ``tokens`` (bf16, the full-size preset, router skew
    ``skew``); the profiled calls run between cuProfilerStart/Stop.
    ``wg_tune``: entries of ``moe_grouped_gemm.WG_TUNE`` to set first;
    ``shared_min_tokens``: ``SHARED_GEMM_MIN_TOKENS`` and
    ``SHARED_SLOT_MIN_TOKENS`` for this process."""
    from mlx_qwen_fast.kernels import moe_grouped_gemm as gg

    if shared_min_tokens is not None:
        gg.SHARED_GEMM_MIN_TOKENS = gg.SHARED_SLOT_MIN_TOKENS = int(shared_min_tokens)
    for key, value in (wg_tune or {}).items():
        if key not in gg.WG_TUNE:
            raise SystemExit(f"block: unknown WG_TUNE key {key!r}; known: {sorted(gg.WG_TUNE)}")
        gg.WG_TUNE[key] = value

    block, hidden = _preset_moe_block(skew)
    for T in tokens:
        x = mx.random.normal((1, T, hidden), key=mx.random.key(T)).astype(mx.bfloat16)
        mx.eval(x)
        mx.eval(block(x))  # warm-up: builds and loads the kernels
        _profile_once(lambda: block(x))
        print(f"block T={T}: profiled one call of {type(block).__name__}", flush=True)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "chain"
    if what not in ("chain", "ncu", "block"):
        raise SystemExit(f"usage: {sys.argv[0]} chain [scan,gdn,moe,qmm,decode] | ncu"
                         " | block [T,T,... [KEY=VALUE ...] [shared_min_tokens=N]]")
    from mlx_qwen_fast.kernels import _cuda_build as cb

    if not cb.cuda_available():
        raise SystemExit(f"{sys.argv[0]}: needs MLX's CUDA backend and an NVIDIA GPU (none here)")
    if what == "chain":
        parts = {"scan": chain_scan, "gdn": chain_prefill_gdn, "moe": chain_moe,
                 "qmm": chain_dense_qmm, "decode": chain_decode_gdn}
        sections = sys.argv[2].split(",") if len(sys.argv) > 2 else ["scan", "gdn", "moe"]
        unknown = [s for s in sections if s not in parts]
        if unknown:
            raise SystemExit(f"{sys.argv[0]}: unknown chain part(s) {unknown}; choose from {list(parts)}")
        for name in sections:
            parts[name]()
    elif what == "block":  # optional: token counts, e.g. "4096,2048,1", then WG_TUNE entries, e.g. minb=2
        tokens = tuple(int(t) for t in sys.argv[2].split(",")) if len(sys.argv) > 2 else (4096, 1)
        tune = {k: ast.literal_eval(v) for k, v in (a.split("=", 1) for a in sys.argv[3:])}
        shared_min = tune.pop("shared_min_tokens", None)
        block_launches(tokens, wg_tune=tune, shared_min_tokens=shared_min)
    else:
        ncu_launches()
