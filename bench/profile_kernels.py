"""Launches of the default fast paths for Nsight Compute (ncu), and ncu CSV summaries.

Subcommands (CUDA only, except ``summary``):

* ``kernels``: one launch of each kernel the patched model runs, after a
  warm-up launch, at the model's shape: the GDN front end, scan and gated
  RMSNorm at T = 4096, three GDN decode steps, the MoE decode kernels at one
  token, and the MoE routing and grouped GEMMs at T = 4096 for each
  grouped-GEMM build that runs here. For ``ncu --set full -k regex:mqf_``
  (every counter of our kernels; kernels are named ``mqf_<base>_<hash>``).
* ``block [--tokens T,T,...]``: the whole patched sparse MoE block (a
  random-weight block of the model's shape, as ``ops.moe.sparse_moe``
  dispatches it: router, routing, grouped GEMMs or decode kernels, shared
  expert, combine), one warm-up call and then one call per T between
  ``cuProfilerStart``/``cuProfilerStop``: with ``ncu --profile-from-start
  off`` every kernel of one block call is measured.
* ``prefill [checkpoint args] [--tokens N] [--engine patched|stock]``: build
  the model, prefill one warm-up prompt, then one prompt of ``--tokens``
  tokens as ``bench.ab.prefill`` feeds it, with the profiler on only around
  that prompt (its wall time goes to stderr).
* ``decode [checkpoint args] [--context N] [--tokens-profiled K]``: build the
  model (patched unless ``--engine stock``), a prompt cache filled as if
  ``--context`` tokens had been prefilled (:func:`bench.nodes.synthetic_cache`),
  warm-up greedy steps (the traces, the kernel loads), then ``K`` greedy
  steps as mlx-lm's ``generate_step`` builds them, each evaluated alone,
  with the profiler on: every kernel of K decode tokens. ``summary --per K``
  then gives GPU ms per token, the floor under a decode token that no host
  work can lower.
* ``summary CSV [--per K]``: an ``ncu --csv --metrics gpu__time_duration.sum`` file ->
  GPU ms per kernel family (names matched by :data:`FAMILIES`, first match
  wins), share, kernel count, the serialised total and the top kernels. The
  sum of serialised kernel times is not a latency (no overlap, no launch
  gaps), but it says which kernels own the GPU time.

    ncu --profile-from-start off --metrics gpu__time_duration.sum --csv \\
        python3 bench/profile_kernels.py prefill --preset qwen3.6-35b-a3b --tokens 4k > k.csv
    python3 bench/profile_kernels.py summary k.csv
    ncu --set full -k regex:mqf_ -o prof python3 bench/profile_kernels.py kernels
"""
from __future__ import annotations

import argparse
import csv
import ctypes
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: (family, regex on the kernel name), first match wins. Our kernels are
#: named ``mqf_<base>_<hash>`` (kernels/_cuda_build.py).
FAMILIES = (
    ("moe grouped GEMM (ours)", r"^mqf_moe_(gate_up|down)_"),
    ("moe routing (ours)", r"^mqf_moe_(route|count|scatter)"),
    ("moe decode GEMV (ours)", r"^mqf_moe_dec"),
    ("gdn scan (ours)", r"^mqf_gdn_scan_"),
    ("gdn front end (ours)", r"^mqf_gdn_frontend_"),
    ("gdn decode (ours)", r"^mqf_gdn_decode"),
    ("gated rms norm (ours)", r"^mqf_gated_rms_norm"),
    ("other ours", r"^mqf_"),
    ("quantized matmul / GEMV / dequantize (MLX)", r"qmm|qmv|quantized|affine_(q|deq)|gemv"),
    ("attention (MLX sdpa)", r"sdpa|attention|flash"),
    ("dense GEMM (cuBLAS/CUTLASS)", r"gemm|cutlass|sm90_xmma|cublas|nvjet"),
    ("copy / concat / slice / gather", r"copy|Copy|concat|slice|gather|scatter"),
    ("elementwise / unary / binary", r"unary|binary|ternary|elementwise|compiled|fused"),
    ("reductions / softmax / norms", r"reduce|softmax|rms|layer_norm|norm|arg"),
    ("sort / top-k", r"sort|topk|partition"),
)

#: ncu's time units (short and long names) in milliseconds.
_UNIT_MS = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0,
            "msecond": 1.0, "s": 1e3, "second": 1e3}


def _needs_cuda(what: str) -> None:
    from mlx_qwen_fast.kernels import _cuda_build as cb

    if not cb.cuda_available():
        raise SystemExit(f"profile_kernels.py {what}: needs MLX's CUDA backend and an NVIDIA GPU (none here)")


def _profiler(on: bool) -> None:
    """cuProfilerStart/Stop on device 0's primary context (made current on
    this thread first: MLX may drive the GPU from another thread)."""
    lib = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    for what, rc in (("cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)),
                     ("cuCtxSetCurrent", lib.cuCtxSetCurrent(ctx)),
                     ("cuProfilerStart" if on else "cuProfilerStop",
                      (lib.cuProfilerStart if on else lib.cuProfilerStop)())):
        if rc != 0:
            raise RuntimeError(f"{what} returned CUDA error {rc}")


def _profile_once(mx, run) -> None:
    """Evaluate ``run()`` once with the profiler on (the caller warmed it up)."""
    mx.synchronize()
    _profiler(True)
    mx.eval(run())
    mx.synchronize()
    _profiler(False)


def kernels(args) -> None:
    import mlx.core as mx

    from bench.gdn_cuda import HK, HV, D, fe_params, gates, qkv_inputs
    from bench.moe_cuda import E, K, make_block, make_inputs, make_switch, variants
    from mlx_qwen_fast.kernels import gated_delta_contract as kc
    from mlx_qwen_fast.kernels import gated_delta_decode as kd
    from mlx_qwen_fast.kernels import moe_grouped_gemm as gg
    from mlx_qwen_fast.kernels import moe_grouped_gemm_builds as ggb
    from mlx_qwen_fast.kernels import moe_routing as mr
    from mlx_qwen_fast.kernels.gated_delta_frontend import gated_delta_frontend
    from mlx_qwen_fast.kernels.gated_delta_scan import gated_delta_scan
    from mlx_qwen_fast.kernels.gated_rms_norm import gated_rms_norm
    from mlx_qwen_fast.ops import moe

    def twice(fn):  # a warm-up launch (builds, loads), then the one ncu should look at
        for _ in range(2):
            mx.eval(fn())

    T, C = 4096, (2 * HK + HV) * D
    k1, k2, k3 = mx.random.split(mx.random.key(1), 3)
    w, A_log, dt_bias = fe_params(k1, mx.bfloat16)
    qkv = mx.random.normal((1, T, C), key=k2).astype(mx.bfloat16)
    ab = mx.random.normal((1, T, HV), key=k3).astype(mx.bfloat16)
    q, k, v = qkv_inputs(1, T, k1, mx.bfloat16)
    g, beta = gates(1, T, "weak", k2)
    s0 = 0.5 * mx.random.normal((1, HV, D, D), key=k3)
    nw = mx.ones((D,), mx.bfloat16)
    mx.eval(w, A_log, dt_bias, qkv, ab, q, k, v, g, beta, s0)
    twice(lambda: gated_delta_frontend(qkv, ab, ab, w, None, A_log, dt_bias, num_k_heads=HK, num_v_heads=HV))
    twice(lambda: gated_delta_scan(q, k, v, g, beta, s0))
    twice(lambda: gated_rms_norm(v, v, nw, 1e-6))
    params = kc.decode_params(w, A_log, dt_bias, nw)
    proj = mx.random.normal((1, 1, kc.packed_width(HK, HV)), key=k1).astype(mx.bfloat16)
    st, cs = s0, None
    for _ in range(3):  # the decode kernel, a few dependent steps
        _, cs, st = kd.gated_delta_decode(proj, params, cs, st, num_k_heads=HK, num_v_heads=HV)
    mx.eval(st)
    blk = make_block(3)  # the MoE decode kernels at one token (the compiled step)
    xd = mx.random.normal((1, 1, blk.switch_mlp.gate_proj.input_dims), key=k1).astype(mx.bfloat16)
    twice(lambda: moe.sparse_moe(blk, xd, implementation="cuda-decode"))
    sm = make_switch(2)
    x, logits = make_inputs(T, seed=T)
    for variant in variants():
        tile = ggb.choose_tile_rows(T * K, E, variant)
        twice(lambda: gg.moe_experts_unchecked(x, mr.route_and_group(logits, K, tile), sm.gate_proj, sm.up_proj,
                                      sm.down_proj, variant=variant))
    mx.synchronize()
    print("kernels: launched", flush=True)


def block(args) -> None:
    import mlx.core as mx

    from bench.moe_cuda import make_block
    from mlx_qwen_fast.ops import moe

    blk = make_block(0)
    d = blk.switch_mlp.gate_proj.input_dims
    for T in args.tokens:
        x = mx.random.normal((1, T, d), key=mx.random.key(T)).astype(mx.bfloat16)
        mx.eval(x)
        mx.eval(moe.sparse_moe(blk, x))  # warm-up: builds and loads the kernels
        _profile_once(mx, lambda: moe.sparse_moe(blk, x))
        print(f"block T={T}: profiled one call ({moe.implementation_for(T)})", flush=True)


def prefill(args) -> None:
    import mlx.core as mx

    from bench import ab, common

    model, _, _ = common.load_checkpoint(args)
    if args.engine == "patched":
        from mlx_qwen_fast import patched_copy

        model, _ = patched_copy(model)
    n = args.tokens[0]
    prompt = mx.random.randint(1, 1000, (n,), key=mx.random.key(0)).astype(mx.uint32)
    ab.prefill(model, prompt, args.step)  # warm-up: kernel builds, first-use compiles
    mx.synchronize()
    _profiler(True)
    t0 = time.perf_counter()
    r, _, _ = ab.prefill(model, prompt, args.step)
    mx.synchronize()
    wall = time.perf_counter() - t0
    _profiler(False)
    print(f"# prefill {n} tokens ({args.engine}): {r.status}, {wall * 1e3:.1f} ms wall "
          f"(profiled, kernels serialised)", file=sys.stderr, flush=True)


def _tie_layers(model) -> None:
    """Every Gated DeltaNet layer takes the first one's mixer module and
    every layer the first layer's MoE block (the same arrays), so that from
    the second layer on a kernel finds its weights in L2 where they fit: the
    GPU time of a layer with its weights L2-resident, against the untied
    model's (an upper bound for prefetching the next layer's weights)."""
    layers = model.layers
    gdn = [l for l in layers if getattr(l, "is_linear", False)]
    for l in gdn[1:]:
        l.linear_attn = gdn[0].linear_attn
    for l in layers[1:]:
        l.mlp = layers[0].mlp


def decode(args) -> None:
    import mlx.core as mx

    from bench import common, nodes
    from bench.ab import _decode_step

    model, _, _ = common.load_checkpoint(args)
    if args.tie_layers:
        _tie_layers(model)
    if args.engine == "patched":
        from mlx_qwen_fast import patched_copy

        model, _ = patched_copy(model)
    cache = nodes.synthetic_cache(model, args.context)
    tok = mx.array([1], mx.uint32)
    for _ in range(args.warmup):
        tok = _decode_step(model, tok, cache)
        mx.eval(tok)
    mx.synchronize()
    _profiler(True)
    t0 = time.perf_counter()
    for _ in range(args.tokens_profiled):
        tok = _decode_step(model, tok, cache)
        mx.eval(tok)
    mx.synchronize()
    wall = time.perf_counter() - t0
    _profiler(False)
    print(f"# decode at context {args.context} ({args.engine}): {args.tokens_profiled} tokens profiled, "
          f"{wall * 1e3:.1f} ms wall (kernels serialised)", file=sys.stderr, flush=True)


def summary(path: str, per: int = 1) -> None:
    rows = []
    try:
        with open(path, newline="") as f:
            lines = [ln for ln in f if ln.startswith('"')]
    except OSError as exc:
        raise SystemExit(f"profile_kernels.py summary: cannot read {path!r}: {exc.strerror}")
    for rec in csv.DictReader(lines):
        if rec.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(rec["Metric Value"].replace(",", ""))
        unit = rec.get("Metric Unit", "")
        if unit not in _UNIT_MS:
            raise SystemExit(f"{path}: unknown time unit {unit!r} (known: {sorted(_UNIT_MS)})")
        rows.append((rec["Kernel Name"], value * _UNIT_MS[unit]))
    if not rows:
        raise SystemExit(f"{path}: no gpu__time_duration.sum rows (was it ncu --csv output?)")
    fam_ms, fam_n = defaultdict(float), defaultdict(int)
    names = defaultdict(float)
    for name, ms in rows:
        fam = next((f for f, rx in FAMILIES if re.search(rx, name)), "other")
        fam_ms[fam] += ms
        fam_n[fam] += 1
        names[name[:90]] += ms
    total = sum(fam_ms.values())
    unit = "GPU ms" if per == 1 else f"ms / {per}"
    print(f"{'family':44s} {unit:>9s} {'share':>6s} {'kernels':>7s}")
    for fam, ms in sorted(fam_ms.items(), key=lambda kv: -kv[1]):
        print(f"{fam:44s} {ms / per:9.3f} {ms / total:6.1%} {fam_n[fam] / per:7g}")
    print(f"{'total (serialised)':44s} {total / per:9.3f}        {len(rows) / per:7g}")
    print(f"\ntop kernels by GPU time ({unit}):")
    for name, ms in sorted(names.items(), key=lambda kv: -kv[1])[:15]:
        print(f"  {ms / per:8.3f} ms  {name}")


def build_parser() -> argparse.ArgumentParser:
    from bench import common

    p = argparse.ArgumentParser(prog="python3 bench/profile_kernels.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("kernels", help="one launch of each default kernel (for ncu --set full)")
    b = sub.add_parser("block", help="one profiled call of the patched MoE block per T")
    b.add_argument("--tokens", type=common.lengths_arg, default=[4096, 1],
                   help="tokens per call (default 4096,1)")
    r = sub.add_parser("prefill", help="one profiled prefill of the (patched) model")
    common.add_checkpoint_args(r)
    r.add_argument("--tokens", type=common.lengths_arg, default=[4096], help="prompt tokens (default 4k)")
    r.add_argument("--engine", choices=("patched", "stock"), default="patched")
    r.add_argument("--step", type=int, default=2048, help="prefill_step_size (mlx-lm's default 2048)")
    d = sub.add_parser("decode", help="the kernels of K profiled greedy decode tokens")
    common.add_checkpoint_args(d)
    d.add_argument("--context", type=int, default=4096, help="positions in the cache (default 4096)")
    d.add_argument("--tokens-profiled", type=int, default=2, metavar="K", help="tokens profiled (default 2)")
    d.add_argument("--warmup", type=int, default=8, help="greedy steps before the profiled ones (default 8)")
    d.add_argument("--engine", choices=("patched", "stock"), default="patched")
    d.add_argument("--tie-layers", action="store_true",
                   help="every GDN layer and MoE block shares the first one's weights (L2-resident from the "
                        "second layer on where they fit)")
    s = sub.add_parser("summary", help="GPU ms per kernel family of an ncu CSV")
    s.add_argument("csv", help="ncu --csv --metrics gpu__time_duration.sum output")
    s.add_argument("--per", type=int, default=1, metavar="K",
                   help="divide every figure by K (the decode tokens profiled): ms per token")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.what == "summary":
        if args.per < 1:
            raise SystemExit(f"--per must be >= 1 (got {args.per})")
        summary(args.csv, args.per)
        return
    _needs_cuda(args.what)
    {"kernels": kernels, "block": block, "prefill": prefill, "decode": decode}[args.what](args)


if __name__ == "__main__":
    main()
