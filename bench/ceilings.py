"""Measured ceilings of the device, through MLX: copy bandwidth and bf16 matmul rate.

``copy_gbps``: a large device-to-device copy (``mx.array(x)``, MLX's copy
kernel), bytes read + written per second, median over repeats; the
elementwise ``x + 1`` on the same array is measured too and the faster of the
two is the ceiling (``copy_methods`` has both). ``bf16_tflops``: ``a @ b`` of
bf16 ``n x n`` matrices, ``2 n^3`` FLOPs per product, median.

Defaults: on a GPU a 2 GiB array and n = 8192; on the CPU 256 MiB and n = 1024.

    python -m bench.ceilings [--copy-mib N] [--matmul-n N] [--repeats R] [--out FILE]

or ``measure_ceilings()`` / ``copy_bandwidth()`` / ``matmul_tflops()``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Dict, Optional

import mlx.core as mx

from . import common


def _on_gpu() -> bool:
    return common.backend_name() != "cpu"


def copy_bandwidth(nbytes: Optional[int] = None, repeats: int = 10) -> Dict:
    """Copy rate of an ``nbytes`` (default 2 GiB GPU / 256 MiB CPU) bf16 array.

    Returns ``{"copy_gbps", "copy_methods": {"copy": GB/s, "add": GB/s},
    "bytes"}``; GB/s = (bytes read + bytes written) / median seconds / 1e9.
    """
    if nbytes is None:
        nbytes = (2 << 30) if _on_gpu() else (256 << 20)
    n = max(1, nbytes // 2)
    x = mx.random.uniform(shape=(n,)).astype(mx.bfloat16)
    mx.eval(x)
    methods = {"copy": lambda: mx.array(x), "add": lambda: x + 1}
    rates = {}
    for name, fn in methods.items():
        t = common.stats(common.measure(fn, warmup=2, repeats=repeats))["median"]
        rates[name] = 2 * x.nbytes / t / common.GB
    del x
    common.free_memory()
    return {"copy_gbps": max(rates.values()), "copy_methods": rates, "bytes": 2 * n}


def matmul_tflops(n: Optional[int] = None, repeats: int = 10) -> Dict:
    """bf16 ``n x n @ n x n`` rate (default n = 8192 GPU / 1024 CPU).

    Returns ``{"bf16_tflops", "matmul_n"}``.
    """
    if n is None:
        n = 8192 if _on_gpu() else 1024
    a = mx.random.normal((n, n)).astype(mx.bfloat16)
    b = mx.random.normal((n, n)).astype(mx.bfloat16)
    mx.eval(a, b)
    t = common.stats(common.measure(lambda: a @ b, warmup=2, repeats=repeats))["median"]
    del a, b
    common.free_memory()
    return {"bf16_tflops": 2 * n**3 / t / 1e12, "matmul_n": n}


def measure_ceilings(
    copy_bytes: Optional[int] = None, matmul_n: Optional[int] = None, repeats: int = 10
) -> Dict:
    """``{"copy_gbps", "bf16_tflops", ...details}``, both measured now."""
    out = copy_bandwidth(copy_bytes, repeats)
    out.update(matmul_tflops(matmul_n, repeats))
    return out


def add_ceiling_args(parser: argparse.ArgumentParser) -> None:
    """``--copy-mib``, ``--matmul-n`` (shared by the scripts that measure ceilings)."""
    g = parser.add_argument_group("ceilings")
    g.add_argument("--copy-mib", type=int, default=None,
                   help="size of the copied array in MiB (default 2048 GPU, 256 CPU)")
    g.add_argument("--matmul-n", type=int, default=None,
                   help="bf16 matmul size n (default 8192 GPU, 1024 CPU)")


def from_args(args) -> Dict:
    nbytes = args.copy_mib << 20 if args.copy_mib else None
    return measure_ceilings(nbytes, args.matmul_n, getattr(args, "ceiling_repeats", 10))


def main(argv=None) -> Dict:
    p = argparse.ArgumentParser(prog="python -m bench.ceilings", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_ceiling_args(p)
    p.add_argument("--ceiling-repeats", type=int, default=10, help="timed repeats (median)")
    p.add_argument("--out", default=None,
                   help="also write a result JSON here (kind 'ceilings'); '-' = no file "
                        "(default: print only)")
    args = p.parse_args(argv)
    ceilings = from_args(args)
    print(f"copy {ceilings['copy_gbps']:.1f} GB/s "
          f"({', '.join(f'{k} {v:.1f}' for k, v in ceilings['copy_methods'].items())}); "
          f"bf16 matmul n={ceilings['matmul_n']}: {ceilings['bf16_tflops']:.2f} TFLOP/s")
    if args.out and args.out != "-":
        result = common.result_header("ceilings", args)
        result["ceilings"] = ceilings
        print("wrote", common.write_json(args.out, result))
    sys.stdout.flush()
    return ceilings


if __name__ == "__main__":
    main()
