"""Time the decode-attention step with each partial-attention build (device script).

Run on the GPU machine:

    source .mlxcuda/boot.sh && PYTHONPATH=. python3 -m bench.attention_partials [--contexts 4096,32768,131072]

For each context (the cache's capacity; this token at its last position),
at the reference model's attention shape (B = 1, 16 query and 2 KV heads of
256, bf16, 64 rotated dims), on fresh random data:
:func:`mlx_qwen_fast.kernels.attention_decode.attention_decode` with
``partials="scalar"`` and ``"mma"`` (the same three launches but the
partial-attention one), each checked against the other (relative L2
error) and timed as the median of one call per evaluation, the builds
alternating (``bench.device_script.timeit``). The difference is the partial
kernels' difference: the other two launches and the cache writes are the
same. Prints one row per context; ``--out`` writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.device_script import rel, timeit  # noqa: E402


def run(contexts, n, rounds=2):
    import mlx.core as mx

    from mlx_qwen_fast.kernels import attention_decode as ad
    from mlx_qwen_fast.kernels.attention_contract import proj_width

    B, hq, hkv, DH = 1, 16, 2, 256
    rows = []
    for cap in contexts:
        ks = mx.random.split(mx.random.key(cap), 5)
        proj = mx.random.normal((B, 1, proj_width(hq, hkv)), key=ks[0]).astype(mx.bfloat16)
        keys = mx.random.normal((B, hkv, cap, DH), key=ks[1]).astype(mx.bfloat16)
        values = mx.random.normal((B, hkv, cap, DH), key=ks[2]).astype(mx.bfloat16)
        qw = (1.0 + 0.3 * mx.random.normal((DH,), key=ks[3])).astype(mx.bfloat16)
        kw = (1.0 + 0.3 * mx.random.normal((DH,), key=ks[4])).astype(mx.bfloat16)
        off = mx.array(cap - 1, mx.int32)
        mx.eval(proj, keys, values, qw, kw)

        def call(build):
            return ad.attention_decode(proj, keys, values, off, qw, kw, num_heads=hq, num_kv_heads=hkv,
                                       scale=DH ** -0.5, q_eps=1e-6, k_eps=1e-6, rope_dims=64,
                                       partials=build)[0]

        err = rel(call("mma"), call("scalar"))
        times = {"scalar": [], "mma": []}
        for r in range(rounds):
            for build in (("scalar", "mma") if r % 2 == 0 else ("mma", "scalar")):
                times[build].append(timeit(lambda: call(build), n=n))
        rec = dict(context=cap, err_mma_vs_scalar=err, **{f"{b}_us": min(t) * 1e6 for b, t in times.items()})
        rows.append(rec)
        print(f"context {cap:7d}: scalar {rec['scalar_us']:8.1f} us  mma {rec['mma_us']:8.1f} us  "
              f"saved {rec['scalar_us'] - rec['mma_us']:8.1f} us  (mma vs scalar err {err:.1e})", flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="4096,32768,131072", help="cache capacities, comma-separated")
    p.add_argument("--n", type=int, default=30, help="timed evaluations per build and round (median)")
    p.add_argument("--out", default=None, help="JSON file of the rows")
    a = p.parse_args(argv)
    from mlx_qwen_fast.kernels import _cuda_build as cb

    if not cb.cuda_available():
        sys.exit("bench.attention_partials: needs MLX's CUDA backend (an NVIDIA GPU); nothing to time here")
    rows = run([int(c) for c in a.contexts.split(",")], a.n)
    if a.out:
        Path(a.out).write_text(json.dumps(dict(rows=rows), indent=1))


if __name__ == "__main__":
    main()
