"""Where a prefill's GPU time goes: per-kernel times of one prompt, grouped.

Two steps (CUDA only; ncu, not nsys, which does not run on our H200 host):

1. ``run``: build the model (``--preset``/``--model``), patch it (or not,
   ``--engine stock``), prefill one warm-up prompt, then one timed prompt of
   ``--tokens`` tokens as ``bench.ab.prefill`` feeds it, with the CUDA
   profiler switched on (``cuProfilerStart``/``Stop`` of the driver) only
   around the timed prompt, so that under
   ``ncu --profile-from-start off --metrics gpu__time_duration.sum --csv``
   only its kernels are measured (each one serialised, caches warm).
2. ``summary CSV``: reads that ncu CSV and prints the GPU time per kernel
   family (names matched by :data:`FAMILIES`, first match wins), its share,
   kernel count, the serialised total and the top kernels (``run`` prints
   the profiled prompt's wall time on stderr).

    ncu --profile-from-start off --metrics gpu__time_duration.sum --csv \\
        python3 bench/prefill_profile.py run --preset qwen3.6-35b-a3b --tokens 4096 > k.csv
    python3 bench/prefill_profile.py summary k.csv

The sum of serialised kernel times is not the prompt's latency (no overlap,
no launch gaps), but it says which kernels own the GPU time.
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
sys.path.insert(0, str(ROOT))

#: (family, regex on the kernel name), first match wins. Our kernels are
#: named ``mqf_<base>_<hash>`` (kernels/_cuda_build.py).
FAMILIES = (
    ("moe grouped GEMM (ours)", r"^mqf_moe_(gate_up|down)_"),
    ("moe routing (ours)", r"^mqf_moe_(route|group|hist|scan|scatter|block|topk)"),
    ("moe decode GEMV (ours)", r"^mqf_moe_dec"),
    ("gdn prefill, fused front end + scan (ours)", r"^mqf_gdn_prefill_"),
    ("gdn scan (ours)", r"^mqf_gdn_scan_"),
    ("gdn front end (ours)", r"^mqf_gdn_frontend_"),
    ("gdn decode (ours)", r"^mqf_gdn_decode"),
    ("gated rms norm (ours)", r"^mqf_.*norm"),
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


def run(argv) -> None:
    import mlx.core as mx

    from bench import ab, common

    p = argparse.ArgumentParser(prog="prefill_profile.py run")
    common.add_checkpoint_args(p)
    p.add_argument("--tokens", type=common.lengths_arg, default=[4096])
    p.add_argument("--engine", choices=("patched", "stock"), default="patched")
    p.add_argument("--step", type=int, default=2048, help="prefill_step_size (mlx-lm default 2048)")
    args = p.parse_args(argv)
    from mlx_qwen_fast.kernels import _cuda_build as cb

    if not cb.cuda_available():
        raise SystemExit("prefill_profile.py run: needs MLX's CUDA backend and an NVIDIA GPU (none here)")
    model, _, _ = common.load_checkpoint(args)
    if args.engine == "patched":
        from mlx_qwen_fast.patch import patched_copy

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


def summary(path: str) -> None:
    rows = []
    try:
        with open(path, newline="") as f:
            lines = [ln for ln in f if ln.startswith('"')]
    except OSError as exc:
        raise SystemExit(f"prefill_profile.py summary: cannot read {path!r}: {exc.strerror}")
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
    print(f"{'family':44s} {'GPU ms':>9s} {'share':>6s} {'kernels':>7s}")
    for fam, ms in sorted(fam_ms.items(), key=lambda kv: -kv[1]):
        print(f"{fam:44s} {ms:9.2f} {ms / total:6.1%} {fam_n[fam]:7d}")
    print(f"{'total (serialised)':44s} {total:9.2f}        {len(rows):7d}")
    print("\ntop kernels by GPU time:")
    for name, ms in sorted(names.items(), key=lambda kv: -kv[1])[:15]:
        print(f"  {ms:8.2f} ms  {name}")


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("run", "summary"):
        raise SystemExit(f"usage: {sys.argv[0]} run [checkpoint args] [--tokens N] | summary CSV")
    if sys.argv[1] == "run":
        run(sys.argv[2:])
    else:
        if len(sys.argv) != 3 or sys.argv[2].startswith("-"):
            raise SystemExit(f"usage: {sys.argv[0]} summary CSV")
        summary(sys.argv[2])
