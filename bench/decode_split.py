"""Where a decode token's host time goes: build, encode, wait, pipelined rate.

``python -m bench.decode_split --preset qwen3.6-35b-a3b --context 4096
[--steps 40] [--pipelined 100] [--repeats 2] [--boundary] [--profile N]
[--engine patched|stock] [--switch VARIABLE] [--out FILE]``

For one engine (default the patched twin of the checkpoint), on mlx-lm's
prompt cache filled as if ``--context`` tokens had been prefilled
(:func:`bench.nodes.synthetic_cache`), greedy steps built as mlx-lm's
``generate_step`` builds them (:func:`bench.ab._decode_step`):

- **synchronous split** (``--steps`` tokens, medians in ms): ``build`` = the
  Python call that returns the step's lazy graph; ``encode`` =
  ``mx.async_eval`` of it (on MLX's CUDA backend the host encodes every
  kernel of the graph into CUDA graphs before it returns); ``wait`` = from
  there until the token is read (``.item()``: the GPU finishing);
- **pipelined** (``--pipelined`` tokens): tok/s with step n+1 built and
  queued before token n is read, as ``generate_step`` does; a host-bound
  engine runs at about 1 / (build + encode);
- ``--boundary``: per-token times (synchronous) for the tokens around the
  point where the KV buffers grow (every 256 positions for stock, whose
  ``KVCache.step`` it is; every ``ops.kv_buffers.KV_GROWTH`` for the patched
  step): a compiled whole-stack step traces again for each new buffer
  capacity, and this shows what that token costs;
- ``--profile N``: cProfile of N builds (top entries by own time);
- ``--nodes``: the step's graph nodes (:func:`bench.nodes.measure_engine`:
  the whole token, one layer of each kind, the rest), counted in this
  process instead of another model build;
- the launched kernel images of the package (bytes per kernel, and their
  sum over the step's kernels), since MLX hashes a launched image on every
  launch (bench/results/package-figures.md, "Kernel builds").

``--switch VARIABLE`` (a boolean switch of :mod:`mlx_qwen_fast.config`):
each repeat runs the split twice, the switch off and on (the order
alternating between repeats), in this process, and the medians per value
follow: an A/B free of the 2x host-time differences seen between processes
(the plans follow the switch: each value traces its own step once, in the
warm-up tokens).

Each ``--repeats`` starts from a fresh cache. Host-side figures vary with
the machine's CPU: compare engines or switches in the same process or in
alternating processes of one device call. Writes a JSON result (kind
"decode_split") with ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from typing import Dict, List

import mlx.core as mx

from bench import common, nodes
from bench.ab import _decode_step


def _ms(values: List[float]) -> float:
    return statistics.median(values) * 1e3


def split(model, context: int, steps: int, pipelined: int, warmup: int = 8) -> Dict:
    """One synchronous split and one pipelined rate on a fresh cache
    (see the module docstring); times in ms, rate in tok/s."""
    cache = nodes.synthetic_cache(model, context)
    tok = mx.array([1], mx.uint32)
    t0 = time.perf_counter()
    for _ in range(warmup):
        tok = _decode_step(model, tok, cache)
        mx.eval(tok)
    warm_s = time.perf_counter() - t0
    build, encode, wait = [], [], []
    for _ in range(steps):
        a = time.perf_counter()
        y = _decode_step(model, tok, cache)
        b = time.perf_counter()
        mx.async_eval(y)
        c = time.perf_counter()
        y.item()
        d = time.perf_counter()
        build.append(b - a)
        encode.append(c - b)
        wait.append(d - c)
        tok = y
    t0 = time.perf_counter()
    nxt = _decode_step(model, tok, cache)
    mx.async_eval(nxt)
    for i in range(pipelined):
        tok = nxt
        if i < pipelined - 1:
            nxt = _decode_step(model, tok, cache)
            mx.async_eval(nxt)
        tok.item()
    rate = pipelined / (time.perf_counter() - t0)
    return {"warmup_s": warm_s, "build_ms": _ms(build), "encode_ms": _ms(encode), "wait_ms": _ms(wait),
            "pipelined_tok_s": rate}


def boundary(model, context: int, before: int = 4, after: int = 6) -> Dict:
    """Synchronous per-token ms from ``before`` tokens ahead of the first KV
    buffer growth past ``context`` to ``after`` tokens beyond it."""
    cache = nodes.synthetic_cache(model, context)
    kv = [c for c in cache if hasattr(c, "keys") and getattr(c, "keys", None) is not None]
    if not kv:
        return {}
    cap = kv[0].keys.shape[2]
    start = cap - before
    for c in kv:
        c.offset = start
    tok = mx.array([1], mx.uint32)
    for _ in range(3):  # the step's trace at this capacity, outside the timed tokens
        for c in kv:
            c.offset = start
        tok = _decode_step(model, tok, cache)
        mx.eval(tok)
    for c in kv:
        c.offset = start
    times = []
    for _ in range(before + after):
        a = time.perf_counter()
        tok = _decode_step(model, tok, cache)
        mx.eval(tok)
        times.append((time.perf_counter() - a) * 1e3)
    return {"capacity": cap, "first_offset": start, "ms_per_token": times,
            "capacity_after": kv[0].keys.shape[2]}


def profile(model, context: int, n: int, top: int = 25) -> str:
    """cProfile of ``n`` step builds, by own time."""
    cache = nodes.synthetic_cache(model, context)
    tok = mx.array([1], mx.uint32)
    for _ in range(5):
        tok = _decode_step(model, tok, cache)
        mx.eval(tok)
    pr = cProfile.Profile()
    for _ in range(n):
        pr.enable()
        y = _decode_step(model, tok, cache)
        pr.disable()
        mx.eval(y)
        tok = y
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def images() -> Dict[str, int]:
    """Bytes of each launched image of the package's kernels in this process."""
    try:
        from mlx_qwen_fast.kernels import _cuda_build as cb
    except ImportError:
        return {}
    return {name: len(img) for name, img in sorted(cb._images.items())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_checkpoint_args(p)
    p.add_argument("--context", type=int, default=4096, help="positions in the cache before the timed tokens")
    p.add_argument("--engine", choices=("patched", "stock"), default="patched")
    p.add_argument("--steps", type=int, default=40, help="synchronous tokens of the split")
    p.add_argument("--pipelined", type=int, default=100, help="pipelined tokens of the rate")
    p.add_argument("--repeats", type=int, default=2, help="splits, each on a fresh cache")
    p.add_argument("--boundary", action="store_true", help="also time the tokens around a KV buffer growth")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile of N step builds")
    p.add_argument("--nodes", action="store_true", help="also count the step's graph nodes (bench.nodes)")
    p.add_argument("--switch", default=None, metavar="VARIABLE",
                   help="a boolean switch of mlx_qwen_fast.config (its environment variable): each repeat runs "
                        "the split with it off and on, in alternating order, in this process")
    p.add_argument("--out", default=None, help="JSON result file")
    args = p.parse_args(argv)
    config = None
    if args.switch is not None:
        from mlx_qwen_fast import config  # only here: the import applies the package's process settings

        if not any(sw.name == args.switch and sw.kind == "bool" for sw in config.SWITCHES):
            p.error(f"--switch must name a boolean switch of mlx_qwen_fast.config, got {args.switch!r}")
    for name, v in (("--context", args.context), ("--steps", args.steps), ("--pipelined", args.pipelined),
                    ("--repeats", args.repeats)):
        if v < 1:
            p.error(f"{name} must be >= 1, got {v}")
    model, _config, _tok = common.load_checkpoint(args)
    if args.engine == "patched":
        from mlx_qwen_fast import patched_copy

        model, report = patched_copy(model)
        print(f"# ops: {getattr(report, 'ops', report)}", flush=True)
    values = [None] if args.switch is None else ["0", "1"]
    switch = None if args.switch is None else next(sw for sw in config.SWITCHES if sw.name == args.switch)

    def set_switch(v):
        if v is not None:
            os.environ[args.switch] = v
            config.reload()  # the package parses each switch once: read the environment again

    result_nodes = {}
    if args.nodes:
        for v in values:
            set_switch(v)
            counted = result_nodes[v] = nodes.measure_engine(model, args.context)
            st = counted["step"]
            kinds = ", ".join(f"{k} {r['nodes']} ({r['launching']}) x{r['layers']}" for k, r in counted["layers"].items())
            out = counted["outside_layers"]
            tag = "" if v is None else f" {args.switch}={v}"
            print(f"nodes per token{tag}: {st['nodes']} ({st['launching']} launching); per layer: {kinds}; "
                  f"outside the layers {out['nodes']} ({out['launching']})", flush=True)
    runs = []
    for i in range(args.repeats):
        for v in values if i % 2 == 0 else values[::-1]:
            set_switch(v)
            r = split(model, args.context, args.steps, args.pipelined)
            if v is not None:
                r["switch"] = {args.switch: v}
                r["switch_read"] = switch.get()  # what the package's plans read during this split
            runs.append(r)
            tag = "" if v is None else f" {args.switch}={v}"
            print(f"split {i}{tag}: warm-up {r['warmup_s']:.1f} s  build {r['build_ms']:.2f} ms  encode {r['encode_ms']:.2f} ms"
              f"  wait {r['wait_ms']:.2f} ms  pipelined {r['pipelined_tok_s']:.1f} tok/s", flush=True)
    for v in values if args.switch is not None else ():
        mine = [r for r in runs if r["switch"][args.switch] == v]
        print(f"median {args.switch}={v}: " + "  ".join(
            f"{k} {statistics.median(r[k] for r in mine):.2f}" for k in ("build_ms", "encode_ms", "wait_ms",
                                                                         "pipelined_tok_s")), flush=True)
    result = common.result_header("decode_split", args, engine=args.engine, context=args.context, runs=runs)
    if result_nodes:
        result["nodes"] = result_nodes[None] if args.switch is None else result_nodes
    if args.boundary:
        result["boundary"] = b = boundary(model, args.context)
        if b:
            print(f"boundary: capacity {b['capacity']} -> {b['capacity_after']}, tokens from offset {b['first_offset']}:"
                  f" {' '.join(f'{t:.1f}' for t in b['ms_per_token'])} ms", flush=True)
    imgs = images()
    result["kernel_images"] = imgs
    if imgs:
        print(f"kernel images: {len(imgs)} kernels, {sum(imgs.values()) / 1024:.0f} KiB in all, largest "
              + ", ".join(f"{k} {v / 1024:.0f} KiB" for k, v in sorted(imgs.items(), key=lambda kv: -kv[1])[:6]),
              flush=True)
    if args.profile:
        result["profile"] = text = profile(model, args.context, args.profile)
        print("\n".join(text.splitlines()[:45]))
    if args.out:
        common.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
