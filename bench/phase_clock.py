"""Where a persistent decode kernel's time goes: SM cycles per phase.

``python -m bench.phase_clock [--launches 30] [--copies 6] [--rows 1]
[--sm-mhz 1980] [--out FILE]`` (CUDA only)

Runs the diagnostic builds (``phase_clock=True``, ``cuda/phase_clock.cuh``)
of the one-launch GDN mixer (``kernels.gdn_mixer_decode``) and MoE block
(``kernels.moe_block_decode``) at Qwen3.6-35B-A3B's shapes on random
weights, cycling over ``--copies`` copies of the weights so that each
launch reads them from DRAM as the decode step does (one copy would stay
in L2). Every block of a launch records ``clock64()`` at each phase mark;
per mark the table gives the cycles since the block's start (median and
maximum over blocks, median over launches) and the increment from the
previous mark, in us at ``--sm-mhz`` (nvidia-smi's SM clock: the cycles
are the SM's). The increments say which phase (or grid barrier wait) owns
the kernel's time; a barrier's increment is the wait for the slowest
block's previous phase plus the exchange itself.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "tests"):  # the tests' builders of full-size random weights
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def _table(name, marks, clocks, mhz):
    """Rows per mark from a list of int64 [blocks, 8] arrays (one per launch)."""
    import numpy as np

    c = np.stack([np.array(x) for x in clocks])[:, :, :len(marks)].astype(np.float64)  # launch, block, mark
    med_blocks = np.median(c, axis=1)  # launch, mark
    max_blocks = c.max(axis=1)
    rows, prev = [], 0.0
    for i, m in enumerate(marks):
        med = float(np.median(med_blocks[:, i]))
        mx_ = float(np.median(max_blocks[:, i]))
        rows.append({"kernel": name, "mark": m, "cycles_median_block": med, "cycles_max_block": mx_,
                     "us_median_block": med / mhz, "us_max_block": mx_ / mhz, "us_step_max": (mx_ - prev) / mhz})
        prev = mx_
    return rows


def run(args) -> list:
    import mlx.core as mx

    from gdn_helpers import mixer_arrays
    from mlx_qwen_fast.kernels import gdn_mixer_decode as gm
    from mlx_qwen_fast.kernels import moe_block_decode as mb
    from moe_blocks import make_arrays, quant

    B, eps = args.rows, 1e-6
    rows = []
    mixers = [mixer_arrays(100 + i, B, 2048, 16, 32, mx.bfloat16) for i in range(args.copies)]
    params = [gm.mixer_params(a.conv_weight, a.A_log, a.dt_bias, a.norm_weight, a.input_norm_weight) for a in mixers]
    mx.eval(mixers, params)
    clocks = []
    for i in range(args.launches + 3):
        a, p = mixers[i % args.copies], params[i % args.copies]
        *_, clk = gm.gdn_mixer_decode(a.x, a.in_proj, p, a.conv_state, a.state, a.out_proj, num_k_heads=16,
                                      num_v_heads=32, input_norm_eps=eps, phase_clock=True)
        mx.eval(clk)
        if i >= 3:
            clocks.append(clk)
    rows += _table("gdn_mixer", gm.PHASE_MARKS, clocks, args.sm_mhz)
    del mixers, params

    blocks = []
    for i in range(args.copies):
        experts, shared, eg = make_arrays(256, 2048, 512, seed=200 + 10 * i)
        router = quant((256, 2048), 300 + i, scale=3.0, bits=8)
        nw = (1.0 + 0.2 * mx.random.normal((2048,), key=mx.random.key(400 + i))).astype(mx.bfloat16)
        x = (2.0 * mx.random.normal((B, 1, 2048), key=mx.random.key(500 + i))).astype(mx.bfloat16)
        mx.eval(experts, shared, eg[:3], router, nw, x)
        blocks.append((x, nw, router, experts, shared, eg))
    clocks = []
    for i in range(args.launches + 3):
        x, nw, router, experts, shared, eg = blocks[i % args.copies]
        _, clk = mb.moe_block_decode_unchecked(x, nw, router, experts, shared, eg, 8, eps, True, 64, 8, phase_clock=True)
        mx.eval(clk)
        if i >= 3:
            clocks.append(clk)
    rows += _table("moe_block", mb.PHASE_MARKS, clocks, args.sm_mhz)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launches", type=int, default=30, help="timed launches per kernel (after 3 warm-up)")
    p.add_argument("--copies", type=int, default=6, help="weight copies cycled over (6: > the L2 of an H100/H200)")
    p.add_argument("--rows", type=int, default=1, help="token rows per launch (1-4)")
    p.add_argument("--sm-mhz", type=float, default=1980.0, help="the SM clock the cycles are converted at")
    p.add_argument("--out", default=None, help="write the rows as JSON")
    args = p.parse_args(argv)
    from mlx_qwen_fast.kernels import _cuda_build as cb

    if not cb.cuda_available():
        print("bench.phase_clock: needs MLX's CUDA backend and an NVIDIA GPU (none here)", file=sys.stderr)
        return 2
    rows = run(args)
    print(f"{'kernel':16s} {'mark':10s} {'us (median block)':>18s} {'us (last block)':>16s} {'step us':>8s}")
    for r in rows:
        print(f"{r['kernel']:16s} {r['mark']:10s} {r['us_median_block']:18.2f} {r['us_max_block']:16.2f} "
              f"{r['us_step_max']:8.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"kind": "phase_clock", "sm_mhz": args.sm_mhz, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
