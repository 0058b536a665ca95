"""Time the dense 4-bit prefill GEMM against MLX's quantized matmul at the
model's projection shapes (device script).

Run on the GPU machine:

    source .mlxcuda/boot.sh && PYTHONPATH=. python3 -m bench.prefill_gemm --out $OUT [--tokens 512,2048,4096]

For each prompt chunk of T rows and each prefill projection of
Qwen3.6-35B-A3B that ``ops.linear.prefill_linear`` serves (:data:`SHAPES`:
output and input width, layers using it), on fresh random 4-bit group-64
weights with bf16 scales: the stock product (``mx.quantized_matmul``, what
``nn.QuantizedLinear`` runs) and
:func:`mlx_qwen_fast.kernels.quantized_gemm.quantized_gemm` at its own tile
choice and at every tile of ``TILE_CHOICES``; each checked against the stock
result (relative L2 error), timed as the median of one call per evaluation
(``bench.device_script.timeit``). TFLOP/s = 2*T*O*K / time. Last, per T, the
projections of the whole model (each shape times its layer count) for stock
and for the kernel at its own tile: the milliseconds a prefill of T tokens
would save. A JSON of every row goes to ``--out``; the table to stdout.

``--model-ab R`` (after the table): the full-size random preset
(``--router-skew``), its patched twin, a ``--prompt`` token prefill as
``generate_step`` runs it (``bench.ab.prefill``, chunks of 2048) in this one
process with ``MLX_QWEN_FAST_PREFILL_GEMM`` off and on, R rounds, the order
alternating, after one warm-up prefill per value: tok/s median and range per
value. An explanation, not a headline (that is ``bench.user_view``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.device_script import log, rel, timeit  # noqa: E402

#: (name, O, K, layers) of the prefill projections of Qwen3.6-35B-A3B:
#: 30 Gated DeltaNet layers (in_proj_qkv, in_proj_z, out_proj) and 10 gated
#: attention layers (q_proj with the gate, k_proj, v_proj, o_proj).
SHAPES = (
    ("gdn.in_proj_qkv", 8192, 2048, 30),
    ("gdn.in_proj_z", 4096, 2048, 30),
    ("gdn.out_proj", 2048, 4096, 30),
    ("attn.q_proj", 8192, 2048, 10),
    ("attn.k_proj", 512, 2048, 10),
    ("attn.v_proj", 512, 2048, 10),
    ("attn.o_proj", 2048, 4096, 10),
)


def _weights(O, K, seed):
    import mlx.core as mx

    w = mx.random.normal((O, K), key=mx.random.key(seed)) * K**-0.5
    q = mx.quantize(w.astype(mx.bfloat16), group_size=64, bits=4)
    mx.eval(q)
    return q


def run(tokens, n, out_path=None):
    import mlx.core as mx

    from mlx_qwen_fast.kernels import _cuda_build as cb
    from mlx_qwen_fast.kernels import quantized_gemm as qg
    from mlx_qwen_fast.kernels.moe_grouped_gemm_builds import TILE_CHOICES

    rows, totals = [], {}
    for T in tokens:
        for i, (name, O, K, layers) in enumerate(SHAPES):
            w, s, b = _weights(O, K, i)
            x = mx.random.normal((T, K), key=mx.random.key(T + i)).astype(mx.bfloat16)
            mx.eval(x)
            stock = lambda: mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4)  # noqa: E731
            ref = stock()
            t_stock = timeit(stock, n=n)
            flops = 2.0 * T * O * K
            variant = qg.variant_for(O, K)
            own = qg.choose_tile_rows(T, O, variant, cb.sm_count())
            rec = dict(T=T, name=name, O=O, K=K, layers=layers, variant=variant, own_tile=own,
                       stock_ms=t_stock * 1e3, stock_tflops=flops / t_stock / 1e12, tiles={})
            for tile in (None,) + tuple(TILE_CHOICES):
                fn = lambda tile=tile: qg.quantized_gemm(x, w, s, b, tile_rows=tile)  # noqa: E731
                y = fn()
                err = rel(y, ref)
                t = timeit(fn, n=n)
                rec["tiles"][str(tile or "own")] = dict(ms=t * 1e3, tflops=flops / t / 1e12, err_vs_stock=err)
            rows.append(rec)
            k = rec["tiles"]["own"]
            log(f"T={T:5d} {name:16s} O={O:5d} K={K:5d} stock {t_stock * 1e3:7.3f} ms "
                f"({rec['stock_tflops']:5.0f} TF/s)  kernel[{variant},{own}] {k['ms']:7.3f} ms "
                f"({k['tflops']:5.0f} TF/s, err {k['err_vs_stock']:.1e})  tiles "
                + " ".join(f"{t}:{v['ms']:.3f}" for t, v in rec["tiles"].items() if t != "own"))
            tot = totals.setdefault(T, dict(stock_ms=0.0, kernel_ms=0.0, best_tile_ms=0.0))
            tot["stock_ms"] += layers * t_stock * 1e3
            tot["kernel_ms"] += layers * k["ms"]
            tot["best_tile_ms"] += layers * min(v["ms"] for v in rec["tiles"].values())
    print("\nwhole model's prefill projections per chunk (sum over layers):")
    print(f"{'T':>6} {'stock ms':>9} {'kernel ms':>10} {'best-tile ms':>12} {'saved ms':>9}")
    for T, t in totals.items():
        print(f"{T:6d} {t['stock_ms']:9.2f} {t['kernel_ms']:10.2f} {t['best_tile_ms']:12.2f} "
              f"{t['stock_ms'] - t['kernel_ms']:9.2f}")
    if out_path:
        Path(out_path).write_text(json.dumps(dict(rows=rows, totals=totals), indent=1))
    return rows, totals


def model_ab(rounds, prompt_len, skew, out_path=None, preset="qwen3.6-35b-a3b"):
    """The patched model's prefill with the switch off and on, alternating
    (see the module docstring); returns ``{value: [tok/s, ...]}``."""
    import os

    import mlx.core as mx

    from bench import ab, common
    from mlx_qwen_fast import config, patched_copy
    from mlx_qwen_fast.checkpoint import build_model

    model, cfg = build_model(preset, seed=0, router_skew=skew, dtype=mx.bfloat16)
    fast, report = patched_copy(model, warn=False)
    del model
    prompt = common.random_tokens(prompt_len, common.ModelShape.from_config(cfg).vocab, seed=1)
    rates = {"0": [], "1": []}

    def one(value, keep):
        os.environ[config.PREFILL_GEMM_KERNEL.name] = value
        config.reload()
        run, cache, _ = ab.prefill(fast, prompt, 2048)
        del cache
        if run.status != "ok":
            raise RuntimeError(f"prefill with the switch {value}: {run.status} {run.error}")
        if keep:
            rates[value].append(prompt_len / run.seconds)
        log(f"switch {value}: {prompt_len / run.seconds:9.0f} tok/s ({run.seconds * 1e3:.1f} ms, "
            f"peak {run.peak_gb:.1f} GB){'' if keep else ' (warm-up)'}")

    for v in ("1", "0"):
        one(v, False)
    for r in range(rounds):
        for v in (("0", "1") if r % 2 == 0 else ("1", "0")):
            one(v, True)
    import numpy as np

    print(f"\nprefill of {prompt_len} tokens, patched, {config.PREFILL_GEMM_KERNEL.name} off vs on:")
    for v, xs in rates.items():
        print(f"  {v}: median {np.median(xs):9.0f} tok/s  range {min(xs):.0f}-{max(xs):.0f}  n={len(xs)}")
    print(f"  on/off: {np.median(rates['1']) / np.median(rates['0']):.2f}x")
    if out_path:
        Path(out_path).write_text(json.dumps(dict(prompt=prompt_len, router_skew=skew, rates=rates,
                                                  report=str(report)), indent=1))
    return rates


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="512,2048,4096", help="chunk rows T, comma-separated")
    p.add_argument("--n", type=int, default=15, help="timed evaluations per row (median)")
    p.add_argument("--out", default=None, help="folder for prefill-gemm.json (and prefill-gemm-model.json)")
    p.add_argument("--model-ab", type=int, default=0, metavar="R", help="rounds of the model A/B (0: none)")
    p.add_argument("--prompt", type=int, default=4096, help="prompt tokens of the model A/B")
    p.add_argument("--router-skew", type=float, default=1.0, help="router skew of the model A/B's preset")
    p.add_argument("--skip-table", action="store_true", help="only the model A/B")
    a = p.parse_args(argv)
    from mlx_qwen_fast.kernels import _cuda_build as cb

    if not cb.cuda_available():
        sys.exit("bench.prefill_gemm: needs MLX's CUDA backend (an NVIDIA GPU); nothing to time here")
    out = None
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        out = str(Path(a.out) / "prefill-gemm.json")
    if not a.skip_table:
        run([int(t) for t in a.tokens.split(",")], a.n, out)
    if a.model_ab:
        model_ab(a.model_ab, a.prompt, a.router_skew,
                 str(Path(a.out) / "prefill-gemm-model.json") if a.out else None)


if __name__ == "__main__":
    main()
