"""Time of a verify pass: a forward of S tokens per row with a cache, S = 1..16.

``python -m bench.verify_pass --preset qwen3.6-35b-a3b --router-skew 1.0
[--context 4096] [--sizes 1-16] [--batch 1] [--repeats 10] [--warmup 3]
[--stock] [--rollback] [--switch VARIABLE] [--out FILE]``

Speculative decoding verifies the last token and the draft's tokens in one
target forward (mlx-lm's ``speculative_generate_step``); its gain needs
``t(S)``, that forward's time, close to ``t(1)``, one decode step's (issue
44 aims at ``t(16) <= 1.5 t(1)`` at 4K context). For each S this script
runs ``model(tokens [B, S], cache=cache)`` on mlx-lm's prompt cache filled
as if ``--context`` tokens had been prefilled (zeros, as
:func:`bench.nodes.synthetic_cache`, with ``--batch`` rows) and evaluates
the logits and the cache (synchronous: the host waits for the GPU), then
puts the cache back (KV offsets, the Gated DeltaNet states), so that every
repeat starts at the same position. ``--warmup`` untimed passes per S (the
first traces and compiles), then the median (and min) of ``--repeats``
timed passes, in ms, and ``t(S) / t(1)``.

* ``--stock``: mlx-lm's model as loaded (the patched twin otherwise,
  :func:`mlx_qwen_fast.patched_copy`).
* ``--rollback``: the passes run inside
  :func:`mlx_qwen_fast.speculative.rollback` with ``max_steps`` = the
  largest S, as in a speculative loop: a Gated DeltaNet layer of S > 1
  tokens then records the call (on a GPU the states before it and its
  input, replayed only by a trim: :mod:`mlx_qwen_fast.speculative`; on
  the CPU every token's states), the verify's real cost (patched only:
  stock mlx-lm cannot roll its caches back). There S = 1 runs module by module too, as a draft's step in the
  loop does: the compiled whole-stack and layer steps decline the
  recording caches.
* ``--switch VARIABLE`` (a boolean switch of :mod:`mlx_qwen_fast.config`):
  every repeat of every S runs with the switch off and on, the order
  alternating, in this process (:func:`mlx_qwen_fast.config.reload` after
  each change; each value traces its own steps in the warm-up).
  ``--switch MLX_QWEN_FAST_VERIFY_STEP`` compares mlx-lm's loop with the
  compiled whole-stack step of S = 2..16 tokens
  (:mod:`mlx_qwen_fast.ops.verify`; the table's ``verify_step`` column
  counts the timed passes that ran it).

What runs for S tokens per row, B rows, with a cache, on CUDA (the patched
model, ``MLX_QWEN_FAST_VERIFY_STEP`` off; on, S = 2..16 runs the whole
stack as one compiled call: the GDN and MoE columns as below, traced
inside, the attention as MLX's masked SDPA over the KV buffer at an offset
passed as data; :func:`implementations` prints it for the run's backend):

====================  ================================  ====================================
op                    S = 1 (decode step)               S = 2..16 (verify)
====================  ================================  ====================================
layer stack           one compiled call for every       mlx-lm's ``Qwen3_5TextModel`` loop
                      layer (``decode_model``)          over the decoder layers (mlx-lm's
                                                        ``DecoderLayer``: RMSNorms and adds
                                                        as MLX ops)
dense projections     the fused RMSNorm + 4-bit GEMV    MLX's ``quantized_matmul`` (the
                      kernel (+ residual)               fused GEMV takes 1..4 rows, only
                                                        inside the decode step)
Gated DeltaNet        one persistent mixer kernel       projections (MLX), front-end kernel
                      (or GEMV + decode kernel + GEMV)  (conv + norms + gates), the chunked
                                                        scan kernel, the gated-RMSNorm kernel;
                                                        with ``--rollback``: mlx-lm's layer
                                                        math with the recurrence one token
                                                        at a time in MLX ops (fp32, every
                                                        step's state kept)
gated attention       q|k|v GEMV, decode-attention      projections (MLX), q/k RMSNorm and
                      kernels (split-K), o_proj GEMV    RoPE (MLX), the flash-attention
                                                        prefill kernel at the cache offset
                                                        (one CTA per (row, head, 64 queries):
                                                        16 CTAs for B = 1, each walking the
                                                        whole context)
sparse MoE            router GEMV + 2 fused GEMV        B*S <= 4: the decode kernels (not in
                      kernels (3 launches)              one compiled layer step); 5..127:
                                                        routing + grouped GEMMs with the
                                                        shared expert in the slot (each
                                                        selected expert read once per call:
                                                        the count in ops/moe/)
====================  ================================  ====================================

Writes a JSON result (kind "verify_pass") with ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx

from bench import common


def parse_sizes(text: str) -> List[int]:
    """``"1-16"``, ``"1,2,4,8,16"`` or a mix (``"1-4,8,16"``) -> sorted
    distinct ints >= 1. Raises ValueError naming the text otherwise."""
    sizes = set()
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part:
                lo, hi = (int(v) for v in part.split("-", 1))
                if lo > hi:
                    raise ValueError
                sizes.update(range(lo, hi + 1))
            else:
                sizes.add(int(part))
    except ValueError:
        raise ValueError(f"--sizes must be ints or ranges like 1-16, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--sizes must be ints >= 1, got {text!r}")
    return sorted(sizes)


def make_cache(model, context: int, batch: int, headroom: int) -> List[Any]:
    """mlx-lm's prompt cache for ``batch`` rows as if ``context`` tokens had
    been prefilled (zeros; evaluated), the KV buffers with room for
    ``headroom`` more tokens (rounded up to the cache's step), so that a
    pass writes them in place as a real verify does."""
    from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

    from bench.nodes import _act_dtype as act_dtype

    cache = make_prompt_cache(model)
    dtype = act_dtype(model)
    for c, layer in zip(cache, model.layers):
        if isinstance(c, KVCache):
            attn = layer.self_attn
            cap = -(-(context + headroom) // c.step) * c.step
            shape = (batch, attn.num_key_value_heads, cap, attn.head_dim)
            c.keys, c.values = mx.zeros(shape, dtype), mx.zeros(shape, dtype)
            c.offset = context
        elif isinstance(c, ArraysCache):
            mixer = layer.linear_attn
            c[0] = mx.zeros((batch, mixer.conv_kernel_size - 1, mixer.conv_dim), dtype)
            c[1] = mx.zeros((batch, mixer.num_v_heads, mixer.head_v_dim, mixer.head_k_dim), mx.float32)
        else:
            raise TypeError(f"make_cache: cache of type {type(c).__name__} is not supported")
    mx.eval([a for c in cache for a in _arrays(c)])
    return cache


def _arrays(c) -> List[mx.array]:
    if hasattr(c, "keys") and not hasattr(c, "cache"):
        return [a for a in (c.keys, c.values) if a is not None]
    return [a for a in c.cache if a is not None]


class CacheState:
    """What a pass changes in the cache, kept to put back: the KV caches'
    offsets, the Gated DeltaNet caches' arrays (a pass replaces them; the
    KV rows it writes past the offset are overwritten by the next pass)."""

    def __init__(self, cache):
        self.cache = cache
        self.saved = [(c.offset,) if hasattr(c, "offset") and not hasattr(c, "cache") else tuple(c.cache)
                      for c in cache]

    def restore(self) -> None:
        for c, s in zip(self.cache, self.saved):
            if hasattr(c, "cache"):
                c.cache = list(s)
                if hasattr(c, "steps"):
                    c.steps.clear()
            else:
                c.offset = s[0]


def one_pass(model, cache, tokens: mx.array) -> float:
    """Seconds of ``model(tokens, cache=cache)`` with its logits and the
    cache evaluated (built, run, waited for)."""
    t0 = time.perf_counter()
    logits = model(tokens, cache=cache)
    mx.eval(logits, [a for c in cache for a in _arrays(c)])
    return time.perf_counter() - t0


def implementations(sizes: Sequence[int], batch: int, rollback: bool, patched: bool,
                    switch: Optional[str] = None) -> Dict[int, Dict[str, str]]:
    """Per S: the implementation each op family's dispatcher names for a
    pass of S tokens per row and ``batch`` rows on this backend (the
    table of the module docstring, as this process would run it). With
    :data:`mlx_qwen_fast.config.VERIFY_MODEL_STEP` on (or named by
    ``switch``: "off / on") S = 2..16 runs the compiled whole-stack step
    (:mod:`mlx_qwen_fast.ops.verify`), where a layer or cache that does not
    fit still falls back to the loop (``step_runs`` of each run says
    whether it ran)."""
    out = {}
    if not patched:
        return {s: {"all": "stock"} for s in sizes}
    from mlx_qwen_fast import config, op_implementations
    from mlx_qwen_fast.ops import attention, gated_delta, linear, moe, verify

    step_on = config.VERIFY_MODEL_STEP.get()
    step_switched = switch == config.VERIFY_MODEL_STEP.name

    decode = op_implementations()
    for s in sizes:
        n = s * batch
        if s == 1:
            row = {k.split(".")[0]: v for k, v in decode.items() if k.endswith(".decode")}
        else:
            gdn = gated_delta.implementation_for(s)
            row = {
                "model": "stock-loop",
                "linear": "stock",
                "gated_delta": ("steps-reference" if rollback else
                                ("cuda-prefill-kernels" if gdn == gated_delta.CUDA_KERNEL else gdn)),
                "attention": attention.implementation_for(s),
                "moe": moe.implementation_for(n),
            }
            if (step_on or step_switched) and verify.MIN_TOKENS <= s <= verify.MAX_TOKENS:
                step = {"model": "verify-step (one compiled call)",
                        "attention": "verify-step masked SDPA over the buffer",
                        "moe": row["moe"] + " (traced in the step)"}
                for k, v in step.items():
                    row[k] = f"{row[k]} / {v}" if step_switched else v
        row["linear_rows_kernel_max"] = str(linear._k_gemv.MAX_ROWS)
        out[s] = row
    return out


def measure(model, sizes: Sequence[int], context: int, batch: int, repeats: int, warmup: int,
            rollback: bool, switch: Optional[str] = None, seed: int = 0) -> Dict[str, Any]:
    """The runs of the module docstring: ``{"runs": [{S, value, times_ms}]}``
    over one cache (put back after every pass); with ``switch``, each
    repeat of each S once with the switch off and once on, alternating."""
    from mlx_qwen_fast import config

    seen = {sw.name: sw for sw in config.SWITCHES}
    cache = make_cache(model, context, batch, max(sizes))
    values: List[Optional[str]] = [None] if switch is None else ["0", "1"]
    runs: List[Dict[str, Any]] = []
    if rollback:
        from mlx_qwen_fast import speculative

        ctx = speculative.rollback(model, cache, max(sizes))
    else:
        ctx = contextlib.nullcontext()
    vocab = common.text_args(model).vocab_size
    with ctx:
        state = CacheState(cache)
        for s in sizes:
            tokens = common.random_tokens(batch * s, vocab, seed=seed + s).reshape(batch, s)
            times = {v: [] for v in values}
            ran = {v: 0 for v in values}
            parsed = {}
            for i in range(warmup + repeats):
                for v in values if i % 2 == 0 else values[::-1]:
                    if v is not None:
                        os.environ[switch] = v
                        config.reload()  # the switches are parsed once: read the changed variable again
                        parsed[v] = seen[switch].get()
                    n0 = _steps_run()
                    t = one_pass(model, cache, tokens)
                    state.restore()
                    if i >= warmup:
                        times[v].append(t * 1e3)
                        ran[v] += _steps_run() > n0
            for v in values:
                runs.append({"S": s, "switch": None if v is None else {switch: v},
                             "switch_parsed": parsed.get(v), "times_ms": times[v],
                             "step_runs": ran[v],
                             "median_ms": statistics.median(times[v]), "min_ms": min(times[v])})
    return {"runs": runs}


def _steps_run() -> int:
    """Calls so far that ran the compiled S-token step (:mod:`mlx_qwen_fast.ops.verify`)."""
    from mlx_qwen_fast.ops import verify

    return verify.step_count()


def table(runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Rows of the printed table: per (switch value, S) the median and min
    ms, ``t(S) / t(1)`` (None without S = 1) and ms per token."""
    rows = []
    keys = []
    for r in runs:
        key = None if r["switch"] is None else tuple(r["switch"].items())
        if key not in keys:
            keys.append(key)
    for key in keys:
        mine = [r for r in runs if (None if r["switch"] is None else tuple(r["switch"].items())) == key]
        t1 = next((r["median_ms"] for r in mine if r["S"] == 1), None)
        for r in mine:
            rows.append({"switch": "" if key is None else " ".join(f"{k}={v}" for k, v in key), "S": r["S"],
                         "median_ms": round(r["median_ms"], 3), "min_ms": round(r["min_ms"], 3),
                         "ratio": None if t1 is None else round(r["median_ms"] / t1, 3),
                         "ms_per_token": round(r["median_ms"] / r["S"], 3),
                         "verify_step": f"{r.get('step_runs', 0)}/{len(r['times_ms'])}"})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_checkpoint_args(p)
    p.add_argument("--context", type=int, default=4096, help="positions in the cache before the pass")
    p.add_argument("--sizes", default="1-16", help="tokens per row of the passes, e.g. 1-16 or 1,2,4,8,16")
    p.add_argument("--batch", type=int, default=1, help="rows B of every pass")
    p.add_argument("--repeats", type=int, default=10, help="timed passes per size (median and min)")
    p.add_argument("--warmup", type=int, default=3, help="untimed passes per size before them")
    p.add_argument("--stock", action="store_true", help="mlx-lm's model instead of the patched twin")
    p.add_argument("--rollback", action="store_true",
                   help="inside mlx_qwen_fast.speculative.rollback, as in a speculative loop (patched only)")
    p.add_argument("--switch", default=None, metavar="VARIABLE",
                   help="a boolean switch of mlx_qwen_fast.config: every pass with it off and on, alternating")
    p.add_argument("--out", default=None, help="JSON result file")
    args = p.parse_args(argv)
    try:
        sizes = parse_sizes(args.sizes)
    except ValueError as e:
        p.error(str(e))
    for name, v, least in (("--context", args.context, 0), ("--batch", args.batch, 1),
                           ("--repeats", args.repeats, 1), ("--warmup", args.warmup, 0)):
        if v < least:
            p.error(f"{name} must be >= {least}, got {v}")
    if args.stock and (args.rollback or args.switch):
        p.error("--rollback and --switch need the patched model (not --stock)")
    if args.switch is not None:
        from mlx_qwen_fast import config

        if not any(sw.name == args.switch and sw.kind == "bool" for sw in config.SWITCHES):
            p.error(f"--switch must name a boolean switch of mlx_qwen_fast.config, got {args.switch!r}")
    model, _config, _tok = common.load_checkpoint(args)
    if not args.stock:
        from mlx_qwen_fast import patched_copy

        model, report = patched_copy(model)
        print(f"# {report}", flush=True)
    impls = implementations(sizes, args.batch, args.rollback, not args.stock, args.switch)
    for s in sizes:
        print(f"# S={s}: " + ", ".join(f"{k} {v}" for k, v in impls[s].items()), flush=True)
    result = measure(model, sizes, args.context, args.batch, args.repeats, args.warmup, args.rollback,
                     args.switch, seed=args.seed)
    rows = table(result["runs"])
    print(f"engine {'stock' if args.stock else 'patched'}{' (rollback)' if args.rollback else ''}, "
          f"context {args.context}, batch {args.batch}, {args.repeats} repeats after {args.warmup} warm-up "
          f"({common.device_name()})")
    common.print_table(rows, ["switch", "S", "median_ms", "min_ms", "ratio", "ms_per_token", "verify_step"])
    out = common.result_header("verify_pass", args, engine="stock" if args.stock else "patched",
                               context=args.context, batch=args.batch, sizes=sizes, rollback=args.rollback,
                               implementations={str(k): v for k, v in impls.items()}, runs=result["runs"],
                               table=rows)
    if args.out:
        common.write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
