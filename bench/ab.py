"""End-to-end A/B: stock mlx-lm vs the mlx_qwen_fast patched twin, same weights.

One process holds one checkpoint and two engines that share every weight
array: ``stock`` (the model as mlx-lm builds it) and ``patched``
(``mlx_qwen_fast.patched_copy``). See bench/README.md for the method.

Prefill: for each prompt length, random token ids (fixed seed, never 0) are
fed exactly as ``mlx_lm.generate_step`` feeds them -- chunks of
``min(prefill_step_size, remaining - 1)`` tokens through ``model(x, cache)``
with ``mx.eval`` of the cache state (and ``mx.clear_cache``) after each, then
the last token, whose logits give the first generated token. tok/s = prompt
length / time to that token (evaluated). A run that passes ``--max-seconds``
is stopped at the next chunk boundary (status "timeout", with the tokens and
time reached); longer lengths of an engine that timed out are recorded as
"timeout" without running. Allocation failures give status "oom".

Decode: for each context length, the cache is filled once by the fill engine
(default patched); each engine then decodes ``--decode-steps`` greedy tokens
from its own copy of that cache (``mx.array`` copies of every cache array),
pipelined as ``generate_step`` does (``mx.async_eval`` of step n+1 before
``.item()`` of step n). tok/s = steps / time. Before the timed rounds each
engine runs the same steps synchronously once, which gives the host/device
split: ``host_ms_per_token`` = median time to build one step's graph (the
model call and argmax, no evaluation); ``device_ms_per_token`` = median time
of the ``mx.eval`` of that step alone, nothing else in flight.

Warm-up (:func:`warm_until_stable`): before its timed rounds, each engine
repeats the measured run (prefill: the shortest prompt with the same chunk
shapes, once per new set of shapes; decode: the pipelined steps, after the
synchronous pass) until two consecutive runs' rates agree within
``--warmup-tolerance`` (|a - b| <= tol * min(a, b)), at most
``--warmup-max-runs`` runs and ``--warmup-max-seconds`` of warm-up per
engine and point. One warm-up run is not enough: the first run of a process
pays first-use compilation, and a stock decode measured 30 tok/s in its
first timed round and 50 in its second after a single warm-up. The records
keep the warm-up runs' rates (``warmup_tok_s``), how many there were
(``warmup_runs``) and whether they converged (``warmup_converged``).

Each measurement: warm-up first, then ``--rounds`` rounds, engines in
alternating order (stock, patched, then patched, stock, ...); the record
holds the median and the min-max over rounds and the peak memory.

    python -m bench.ab --preset qwen3.6-35b-a3b --prefill 256,512,1k --decode 4k \\
        [--rounds 3] [--max-seconds 120] [--out FILE [--append]]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx.utils import tree_map

from . import ceilings as ceilings_mod
from . import common

DEFAULT_LENGTHS = "256,512,1k,2k,4k,8k,16k,32k,64k,128k"
ENGINES = ("stock", "patched")


def log(*parts) -> None:
    print(*parts, flush=True)


# ---------------------------------------------------------------------------
# One prefill, one decode
# ---------------------------------------------------------------------------


def chunk_sizes(n: int, step: int) -> List[int]:
    """Token counts of the model calls ``generate_step`` makes for an
    ``n``-token prompt: chunks of ``min(step, remaining - 1)`` while more than
    one token remains, then the last token."""
    sizes, remaining = [], n
    while remaining > 1:
        c = min(step, remaining - 1)
        sizes.append(c)
        remaining -= c
    sizes.append(remaining)
    return sizes


def warmup_length(n: int, step: int) -> int:
    """Shortest prompt whose chunk sizes are those of an ``n``-token prompt:
    ``n`` itself when it needs at most 3 calls, else one full chunk + the
    tail chunk + the last token."""
    sizes = chunk_sizes(n, step)
    return n if len(sizes) <= 3 else step + sizes[-2] + 1


@dataclasses.dataclass
class Run:
    """Outcome of one prefill or one decode run."""

    status: str
    seconds: float
    tokens_done: int
    peak_gb: Optional[float] = None
    error: Optional[str] = None
    host_s: Optional[List[float]] = None  # decode: per-step graph-build times
    device_s: Optional[List[float]] = None  # decode (sync pass): per-step eval times


def _failure(exc: Exception, t0: float, done: int) -> Run:
    status = "oom" if common.is_oom(exc) else "error"
    return Run(status, time.perf_counter() - t0, done, error=f"{type(exc).__name__}: {exc}"[:500])


def prefill(
    model,
    prompt: mx.array,
    step: int,
    max_seconds: Optional[float] = None,
    cache: Optional[List[Any]] = None,
) -> Tuple[Run, Optional[List[Any]], Optional[mx.array]]:
    """Prefill ``prompt`` (1-D token ids) as ``generate_step`` does.

    ``cache``: continue an existing prompt cache (extended in place) instead
    of starting from an empty one. Returns ``(run, cache, first_token)``;
    cache and token are None unless the run is "ok". ``max_seconds`` is
    checked at chunk boundaries.
    """
    from mlx_lm.models.cache import make_prompt_cache

    n = prompt.size
    done = 0
    common.free_memory()
    common.reset_peak()
    t0 = time.perf_counter()
    try:
        cache = make_prompt_cache(model) if cache is None else cache
        for c in chunk_sizes(n, step)[:-1]:
            model(prompt[done : done + c][None], cache=cache)
            mx.eval([layer.state for layer in cache])
            done += c
            mx.clear_cache()
            elapsed = time.perf_counter() - t0
            if max_seconds is not None and elapsed > max_seconds:
                return Run("timeout", elapsed, done, common.peak_gb()), None, None
        logits = model(prompt[done:][None], cache=cache)[:, -1, :]
        token = mx.argmax(logits, axis=-1)
        mx.eval(token)
        seconds = time.perf_counter() - t0
        return Run("ok", seconds, n, common.peak_gb()), cache, token
    except Exception as exc:  # OOM -> "oom"; anything else -> "error"
        run = _failure(exc, t0, done)
        del cache
        common.free_memory()
        return run, None, None


def copy_cache(cache: List[Any]) -> List[Any]:
    """A deep copy of an mlx-lm prompt cache: same classes, every array copied
    (``mx.array(x)``) and evaluated."""
    out = []
    for layer in cache:
        new = copy.copy(layer)
        new.state = tree_map(lambda x: mx.array(x) if isinstance(x, mx.array) else x, layer.state)
        out.append(new)
    mx.eval([layer.state for layer in out])
    return out


def _decode_step(model, token: mx.array, cache) -> mx.array:
    """The graph of one greedy step, as ``generate_step._step`` builds it."""
    logits = model(token[None], cache=cache)[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    return mx.argmax(logprobs, axis=-1)


def decode_sync(model, cache, token, steps: int, max_seconds: Optional[float] = None) -> Run:
    """``steps`` greedy steps, each built then evaluated alone (the warm-up
    pass); records per-step build and eval times."""
    host, device = [], []
    common.reset_peak()
    t0 = time.perf_counter()
    try:
        for i in range(steps):
            a = time.perf_counter()
            token = _decode_step(model, token, cache)
            b = time.perf_counter()
            mx.eval(token)
            c = time.perf_counter()
            host.append(b - a)
            device.append(c - b)
            if max_seconds is not None and c - t0 > max_seconds and i < steps - 1:
                return Run("timeout", c - t0, i + 1, common.peak_gb(), host_s=host, device_s=device)
        return Run("ok", time.perf_counter() - t0, steps, common.peak_gb(), host_s=host, device_s=device)
    except Exception as exc:
        return _failure(exc, t0, len(host))


def decode_pipelined(model, cache, token, steps: int, max_seconds: Optional[float] = None) -> Run:
    """``steps`` greedy steps pipelined as ``generate_step``: step n+1 is built
    and ``mx.async_eval``-ed before step n's token is read with ``.item()``."""
    host = []
    common.reset_peak()
    t0 = time.perf_counter()
    try:
        a = time.perf_counter()
        nxt = _decode_step(model, token, cache)
        host.append(time.perf_counter() - a)
        mx.async_eval(nxt)
        for i in range(steps):
            token = nxt
            if i < steps - 1:
                a = time.perf_counter()
                nxt = _decode_step(model, token, cache)
                host.append(time.perf_counter() - a)
                mx.async_eval(nxt)
            token.item()
            elapsed = time.perf_counter() - t0
            if max_seconds is not None and elapsed > max_seconds and i < steps - 1:
                mx.eval(nxt)
                return Run("timeout", elapsed, i + 1, common.peak_gb(), host_s=host)
        return Run("ok", time.perf_counter() - t0, steps, common.peak_gb(), host_s=host)
    except Exception as exc:
        return _failure(exc, t0, len(host))


# ---------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------


def _ms(values: Optional[Sequence[float]]) -> Optional[float]:
    return common.stats(values or [])["median"] * 1e3 if values else None


def _summary(runs: List[Run], units: int) -> Dict:
    """Fields common to prefill and decode records from the runs of one engine
    at one point; ``units`` = tokens per complete run."""
    ok = [r for r in runs if r.status == "ok"]
    bad = [r for r in runs if r.status != "ok"]
    rec: Dict[str, Any] = {"rounds_ok": len(ok), "rounds_run": len(runs)}
    if ok:
        rates = [units / r.seconds for r in ok]
        s = common.stats(rates)
        rec.update(status="ok", tok_s=s["median"], tok_s_min=s["min"], tok_s_max=s["max"],
                   seconds=common.stats([r.seconds for r in ok])["median"], tokens_done=units)
        if bad:
            rec["note"] = f"{len(bad)} of {len(runs)} runs ended with status {bad[0].status}"
    else:
        r = bad[0] if bad else Run("error", 0.0, 0, error="no run")
        rate = r.tokens_done / r.seconds if r.status == "timeout" and r.seconds > 0 else None
        rec.update(status=r.status, tok_s=rate, tok_s_min=rate, tok_s_max=rate,
                   seconds=r.seconds, tokens_done=r.tokens_done)
        if r.status == "timeout":
            rec["note"] = "stopped by --max-seconds; tok_s is the rate reached so far"
    peaks = [r.peak_gb for r in runs if r.peak_gb is not None]
    rec["peak_gb"] = max(peaks) if peaks else None
    errors = [r.error for r in runs if r.error]
    if errors:
        rec["error"] = errors[0]
    return rec


def _not_run(status: str, note: str) -> Dict:
    return {"status": status, "tok_s": None, "tok_s_min": None, "tok_s_max": None,
            "seconds": 0.0, "tokens_done": 0, "peak_gb": None, "rounds_ok": 0,
            "rounds_run": 0, "skipped": True, "note": note}


def _order(names: Sequence[str], round_index: int) -> List[str]:
    return list(names) if round_index % 2 == 0 else list(reversed(names))


# ---------------------------------------------------------------------------
# Sweeps
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Context:
    """What a sweep needs besides the engines."""

    roofline: common.Roofline
    ceilings: Optional[Dict]
    vocab: int
    prompt_seed: int
    step: int
    rounds: int
    max_seconds: Optional[float]
    warmup_max_seconds: Optional[float] = None  # warm-up budget per engine and point
    warmup_max_runs: int = 6  # warm-up runs per engine and point, at most
    warmup_tolerance: float = 0.05  # two consecutive warm-up rates agree within this
    run_index: int = 0
    save: Any = None  # callable(records) after each point


@dataclasses.dataclass
class Warmup:
    """The warm-up runs of one engine at one point (:func:`warm_until_stable`)."""

    rates: List[float]  # tok/s of each completed warm-up run, in order
    seconds: float  # wall time of the whole warm-up
    converged: bool  # the last two rates agree within the tolerance
    failed: Optional[Run] = None  # the run that ended the warm-up with a failure

    def fields(self) -> Dict:
        """The record fields: ``warmup_runs``, ``warmup_tok_s``,
        ``warmup_converged``, ``warmup_seconds``."""
        return {"warmup_runs": len(self.rates), "warmup_tok_s": list(self.rates),
                "warmup_converged": self.converged, "warmup_seconds": self.seconds}


NO_WARMUP = {"warmup_runs": 0, "warmup_tok_s": [], "warmup_converged": None, "warmup_seconds": 0.0}


def rates_agree(a: float, b: float, tolerance: float) -> bool:
    """Two rates agree when ``|a - b| <= tolerance * min(a, b)``."""
    return abs(a - b) <= tolerance * min(a, b)


def warm_until_stable(run_once, units: int, ctx: Context, label: str,
                      spent: float = 0.0) -> Warmup:
    """Warm an engine up with the run it will be timed on.

    ``run_once(max_seconds) -> Run`` runs once (``units`` tokens when
    complete). Runs repeat until the rates (``units / seconds``) of the last
    two agree within ``ctx.warmup_tolerance`` (:func:`rates_agree`), or
    ``ctx.warmup_max_runs`` runs were made, or the budget
    ``ctx.warmup_max_seconds`` (of which ``spent`` seconds are already used,
    e.g. by decode's synchronous pass) would not hold another run as long as
    the last one. Each run gets the budget left as its ``max_seconds``. A
    first run that does not finish ("timeout", "oom", "error") fails the
    warm-up (``failed``: the engine is not timed at this point); a later run
    that times out only ends it (not converged), any other failure fails it.
    ``ctx.warmup_max_runs == 1`` is a single warm-up run (never converged).
    """
    t0 = time.perf_counter() - spent
    budget, tol = ctx.warmup_max_seconds, ctx.warmup_tolerance
    rates: List[float] = []
    last = 0.0
    converged = False
    for i in range(max(1, ctx.warmup_max_runs)):
        left = None if budget is None else budget - (time.perf_counter() - t0)
        if i > 0 and left is not None and left < last:
            log(f"  {label} warm-up: {left:.1f} s of budget left, less than the last run ({last:.1f} s)")
            break
        run = run_once(left)
        if run.status != "ok":
            log(f"  {label} warm-up run {i}: {run.status} after {run.seconds:.1f} s")
            if i == 0 or run.status != "timeout":
                return Warmup(rates, time.perf_counter() - t0, False, failed=run)
            break
        rates.append(units / run.seconds)
        last = run.seconds
        log(f"  {label} warm-up run {i}: {rates[-1]:.2f} tok/s ({run.seconds:.2f} s)")
        if len(rates) >= 2 and rates_agree(rates[-2], rates[-1], tol):
            converged = True
            break
    if not converged and ctx.warmup_max_runs > 1:
        log(f"  {label} warm-up: no two consecutive runs within {tol:.0%} after {len(rates)} runs")
    return Warmup(rates, time.perf_counter() - t0, converged)


def prefill_sweep(engines: Dict[str, Any], lengths: Sequence[int], ctx: Context,
                  timed_out: Optional[Dict[str, int]] = None) -> List[Dict]:
    """One record per (length, engine). ``timed_out`` maps engine -> the
    length at which it already timed out (updated in place)."""
    timed_out = {} if timed_out is None else timed_out
    warmed = {name: set() for name in engines}
    records: List[Dict] = []
    for n in lengths:
        prompt = common.random_tokens(n, ctx.vocab, ctx.prompt_seed + n)
        runs: Dict[str, List[Run]] = {name: [] for name in engines}
        done: Dict[str, Dict] = {}
        for name in engines:
            if name in timed_out and n > timed_out[name]:
                done[name] = _not_run(
                    "timeout", f"not run: {name} already timed out at {timed_out[name]} tokens")
        # warm-up: once per set of chunk shapes not seen yet by this engine
        warm: Dict[str, Dict] = {}
        for name, model in engines.items():
            if name in done or set(chunk_sizes(n, ctx.step)) <= warmed[name]:
                continue
            w = warmup_length(n, ctx.step)
            # The first warm-up of a process also pays MLX's first-use kernel
            # compilation (minutes on CUDA), so it has its own budget.
            wu = warm_until_stable(lambda left, model=model, w=w: prefill(model, prompt[:w], ctx.step, left)[0],
                                   w, ctx, f"prefill {common.fmt_len(n):>5} {name:8} ({w} tokens)")
            warm[name] = wu.fields()
            if wu.failed is None:
                warmed[name] |= set(chunk_sizes(w, ctx.step))
            else:
                done[name] = {**_summary([wu.failed], n), "skipped": True, **wu.fields()}
                done[name]["note"] = f"warm-up prefill of {w} tokens ended with {wu.failed.status}"
        for r in range(ctx.rounds):
            for name in _order(list(engines), r):
                if name in done or any(x.status != "ok" for x in runs[name]):
                    continue
                run, _, _ = prefill(engines[name], prompt, ctx.step, ctx.max_seconds)
                runs[name].append(run)
                log(f"  prefill {common.fmt_len(n):>5} {name:8} round {r}: {run.status} "
                    f"{n / run.seconds if run.status == 'ok' else float('nan'):9.1f} tok/s "
                    f"({run.seconds:.2f} s, peak {run.peak_gb or 0:.2f} GB)")
        flops = ctx.roofline.prefill_flops_per_token(n)
        for name in engines:
            rec = done.get(name) or {**_summary(runs[name], n), **warm.get(name, NO_WARMUP)}
            if rec["status"] == "timeout" and not rec.get("skipped"):
                timed_out[name] = min(timed_out.get(name, n), n)
            rec = {"tokens": n, "engine": name, **NO_WARMUP, **rec, "flops_per_token": flops,
                   "roofline_frac": _prefill_frac(rec, flops, ctx.ceilings),
                   "run": ctx.run_index}
            records.append(rec)
        _log_pair("prefill", n, records[-len(engines):])
        if ctx.save:
            ctx.save(records)
        common.free_memory()
    return records


def _prefill_frac(rec, flops, ceilings):
    if rec["status"] != "ok" or not ceilings:
        return None
    return common.roofline_frac(rec["tok_s"] * flops / 1e12, ceilings.get("bf16_tflops"))


def decode_sweep(engines: Dict[str, Any], contexts: Sequence[int], ctx: Context, *,
                 steps: int, fill_engine: str, fill_model, fill_max_seconds: Optional[float],
                 timed_out: Optional[Dict[str, int]] = None) -> List[Dict]:
    """One record per (context, engine)."""
    timed_out = {} if timed_out is None else timed_out
    fill_failed: Optional[Tuple[int, str]] = None
    records: List[Dict] = []
    # One growing context: the fill cache is extended from one context length
    # to the next (each engine decodes from its own copy), so the fill costs
    # max(contexts) tokens in all rather than their sum.
    contexts = sorted(contexts)
    full_prompt = common.random_tokens(max(contexts), ctx.vocab, ctx.prompt_seed)
    fill_cache, filled = None, 0
    for n in contexts:
        done: Dict[str, Dict] = {}
        for name in engines:
            if name in timed_out and n > timed_out[name]:
                done[name] = _not_run(
                    "timeout", f"not run: {name} already timed out at context {timed_out[name]}")
        cache = token = None
        fill = None
        if len(done) < len(engines):
            if fill_failed:
                note = f"not run: the cache fill already ended with {fill_failed[1]} at {fill_failed[0]}"
                for name in engines:
                    done.setdefault(name, _not_run(fill_failed[1], note))
            else:
                fill, fill_cache, token = prefill(fill_model, full_prompt[filled:n], ctx.step,
                                                  fill_max_seconds, cache=fill_cache)
                filled, cache = n, fill_cache
                log(f"  decode {common.fmt_len(n):>5} cache fill ({fill_engine}): {fill.status} "
                    f"{fill.seconds:.1f} s")
                if fill.status != "ok":
                    fill_failed = (n, fill.status)
                    note = (f"cache fill ({fill_engine} prefill of {n} tokens) ended with "
                            f"{fill.status} after {fill.seconds:.1f} s at {fill.tokens_done} tokens")
                    for name in engines:
                        done.setdefault(name, {**_not_run(fill.status, note), "error": fill.error})
        runs: Dict[str, List[Run]] = {name: [] for name in engines}
        sync: Dict[str, Run] = {}
        warm: Dict[str, Dict] = {}
        if cache is not None:
            for name, model in engines.items():
                if name in done:
                    continue
                # warm-up, first synchronous (the host/device split; it may include
                # first-use kernel compilation, hence the warm-up budget), then
                # pipelined as the timed rounds until two runs agree
                t0 = time.perf_counter()
                sync[name] = decode_sync(model, copy_cache(cache), token, steps,
                                         ctx.warmup_max_seconds)
                common.free_memory()
                if sync[name].status != "ok":
                    done[name] = {**_summary([sync[name]], steps), **NO_WARMUP}
                    done[name]["note"] = f"warm-up decode ended with {sync[name].status}"
                    continue

                def once(left, model=model, cache=cache):
                    run = decode_pipelined(model, copy_cache(cache), token, steps, left)
                    common.free_memory()
                    return run

                wu = warm_until_stable(once, steps, ctx, f"decode {common.fmt_len(n):>5} {name:8}",
                                       spent=time.perf_counter() - t0)
                warm[name] = wu.fields()
                if wu.failed is not None:
                    done[name] = {**_summary([wu.failed], steps), **wu.fields()}
                    done[name]["note"] = f"warm-up decode ended with {wu.failed.status}"
            for r in range(ctx.rounds):
                for name in _order(list(engines), r):
                    if name in done or any(x.status != "ok" for x in runs[name]):
                        continue
                    run = decode_pipelined(engines[name], copy_cache(cache), token, steps,
                                           ctx.max_seconds)
                    runs[name].append(run)
                    common.free_memory()
                    log(f"  decode {common.fmt_len(n):>5} {name:8} round {r}: {run.status} "
                        f"{steps / run.seconds if run.status == 'ok' else float('nan'):8.2f} tok/s")
        del cache
        nbytes = ctx.roofline.decode_bytes_per_token(n + (steps + 1) / 2)
        for name in engines:
            rec = done.get(name) or {**_summary(runs[name], steps), **warm.get(name, NO_WARMUP)}
            if rec["status"] == "timeout" and not rec.get("skipped"):
                timed_out[name] = min(timed_out.get(name, n), n)
            s = sync.get(name)
            host_pipelined = [h for x in runs[name] for h in (x.host_s or [])]
            rec = {
                "context": n, "engine": name, **NO_WARMUP, **rec,
                "steps": steps,
                "bytes_per_token": nbytes,
                "roofline_frac": _decode_frac(rec, nbytes, ctx.ceilings),
                "host_ms_per_token": _ms(s.host_s) if s else None,
                "device_ms_per_token": _ms(s.device_s) if s else None,
                "sync_tok_s": (steps / s.seconds) if s and s.status == "ok" else None,
                "pipelined_host_ms_per_token": _ms(host_pipelined),
                "fill_engine": fill_engine,
                "fill_seconds": fill.seconds if fill else None,
                "run": ctx.run_index,
            }
            records.append(rec)
        _log_pair("decode", n, records[-len(engines):])
        if ctx.save:
            ctx.save(records)
        common.free_memory()
    return records


def _decode_frac(rec, nbytes, ceilings):
    if rec["status"] != "ok" or not ceilings:
        return None
    return common.roofline_frac(rec["tok_s"] * nbytes / common.GB, ceilings.get("copy_gbps"))


def _log_pair(kind: str, n: int, recs: List[Dict]) -> None:
    parts = [f"{r['engine']} {r['status']}"
             + (f" {r['tok_s']:.1f} tok/s" if r.get("tok_s") else "") for r in recs]
    by = {r["engine"]: r for r in recs}
    if all(by.get(e, {}).get("status") == "ok" for e in ENGINES):
        parts.append(f"speed-up {by['patched']['tok_s'] / by['stock']['tok_s']:.2f}x")
    log(f"{kind} {common.fmt_len(n):>5}: " + "; ".join(parts))


# ---------------------------------------------------------------------------
# Result file
# ---------------------------------------------------------------------------

def prefill_key(rec: Dict):
    return rec["tokens"], rec["engine"]


def decode_key(rec: Dict):
    return rec["context"], rec["engine"]


_IDENTITY = ("kind", "device", "model", "preset", "seed", "router_skew", "dtype")


def check_identity(a: Dict, b: Dict, what: str) -> None:
    """Refuse to merge results of different devices or checkpoints."""
    for key in _IDENTITY:
        if a.get(key) != b.get(key):
            raise SystemExit(f"{what}: {key}={a.get(key)!r} differs from {b.get(key)!r}")


def merge_results(base: Dict, other: Dict) -> Dict:
    """``other``'s runs and records merged into ``base`` (same device and
    checkpoint; a point in both keeps ``other``'s record)."""
    check_identity(base, other, "merge")
    offset = len(base.setdefault("runs", []))
    base["runs"] += other.get("runs", [])
    for key, key_fn in (("prefill", prefill_key), ("decode", decode_key)):
        recs = [{**r, "run": r.get("run", 0) + offset} for r in other.get(key, [])]
        base[key] = common.merge_records(base.get(key, []), recs, key_fn)
    base["ceilings"] = base.get("ceilings") or other.get("ceilings")
    return base


def fill_not_run(result: Dict) -> Dict:
    """Add the records an engine would have had if the runs had been one: for
    an engine that timed out at length L, every longer length that another
    engine has but it lacks gets a "timeout" record marked not run."""
    for key, length in (("prefill", "tokens"), ("decode", "context")):
        recs = result.get(key, [])
        have = {(r[length], r["engine"]) for r in recs}
        by_length = {r[length]: r for r in recs}
        for engine, first in _earlier_timeouts(recs, length).items():
            for n in sorted(by_length):
                if n > first and (n, engine) not in have:
                    other = by_length[n]
                    rec = {length: n, "engine": engine,
                           **_not_run("timeout", f"not run: {engine} already timed out at "
                                                 f"{first} ({key})"),
                           "roofline_frac": None, "run": None}
                    for extra in ("flops_per_token", "bytes_per_token", "steps"):
                        if extra in other:
                            rec[extra] = other[extra]
                    if key == "decode":
                        rec.update(host_ms_per_token=None, device_ms_per_token=None)
                    recs.append(rec)
        result[key] = sorted(recs, key=lambda r: (r[length], r["engine"]))
    return result


def merge_files(paths: Sequence[str], out) -> Dict:
    """Merge several ab result files (first = base) into ``out``; then
    :func:`fill_not_run`."""
    result = common.read_json(paths[0])
    for path in paths[1:]:
        merge_results(result, common.read_json(path))
    fill_not_run(result)
    common.write_json(out, result)
    return result


def _earlier_timeouts(records: Sequence[Dict], length_key: str) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for r in records:
        if r.get("status") == "timeout" and not r.get("skipped"):
            out[r["engine"]] = min(out.get(r["engine"], r[length_key]), r[length_key])
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_checkpoint_args(p)
    g = p.add_argument_group("sweeps (neither given: both, with the default lengths)")
    g.add_argument("--prefill", type=common.lengths_arg, default=None, metavar="LENGTHS",
                   help=f"prompt lengths, e.g. 256,1k,4k (k = 1024; default {DEFAULT_LENGTHS}); "
                        "'' or none: no prefill sweep")
    g.add_argument("--decode", type=common.lengths_arg, default=None, metavar="CONTEXTS",
                   help="decode context lengths (same syntax and default)")
    g.add_argument("--prefill-step-size", type=int, default=2048,
                   help="prefill chunk, as mlx_lm.generate_step (default %(default)s)")
    g.add_argument("--decode-steps", type=int, default=64, help="greedy steps per decode run")
    g.add_argument("--rounds", type=int, default=3, help="timed rounds per point (default 3)")
    g.add_argument("--max-seconds", type=float, default=120.0,
                   help="time budget of one prefill or decode run (default %(default)s s); "
                        "0 = none")
    g.add_argument("--warmup-max-seconds", type=float, default=600.0,
                   help="time budget of one engine's warm-up at one point, which includes "
                        "first-use kernel compilation (default %(default)s s); 0 = none")
    g.add_argument("--warmup-max-runs", type=int, default=6,
                   help="warm-up runs per engine and point, at most (default %(default)s; "
                        "1 = a single warm-up run)")
    g.add_argument("--warmup-tolerance", type=float, default=0.05,
                   help="warm-up ends once two consecutive runs' rates agree within this "
                        "relative difference (default %(default)s)")
    g.add_argument("--fill-max-seconds", type=float, default=300.0,
                   help="time budget of the decode cache fill (default %(default)s s)")
    g.add_argument("--engines", default="stock,patched",
                   help="engines to run: stock,patched (default) or one of them")
    g.add_argument("--fill-engine", default="patched", choices=ENGINES,
                   help="engine that fills the decode cache (default patched, the faster)")
    g.add_argument("--prompt-seed", type=int, default=0, help="seed of the random prompts")
    o = p.add_argument_group("output")
    o.add_argument("--out", default=None,
                   help="result JSON (default bench/results/<date>-<device>-ab.json)")
    o.add_argument("--append", action="store_true",
                   help="merge into an existing --out file (same device and checkpoint): "
                        "a point measured again replaces the old record")
    o.add_argument("--merge", nargs="+", metavar="FILE", default=None,
                   help="run nothing: merge these ab result files (same device and "
                        "checkpoint; later files win on a repeated point) into --out, "
                        "then plot")
    o.add_argument("--no-plots", action="store_true", help="do not write the PNG plots")
    o.add_argument("--no-ceilings", action="store_true",
                   help="skip measuring copy bandwidth / matmul rate (ceilings: null, "
                        "or those of the file appended to)")
    ceilings_mod.add_ceiling_args(p)
    return p


def _lengths(value) -> List[int]:
    return common.parse_lengths(DEFAULT_LENGTHS) if value is None else value


def main(argv=None) -> Dict:
    args = build_parser().parse_args(argv)
    if args.merge:
        if not args.out:
            raise SystemExit("--merge needs --out")
        result = merge_files(args.merge, args.out)
        log(f"wrote {args.out}")
        _print_tables(result)
        if not args.no_plots:
            from . import plots

            plots.plot_file_or_hint(args.out)
        return result
    if args.prefill is None and args.decode is None:
        args.prefill = args.decode = _lengths(None)
    prefill_lengths = args.prefill or []
    decode_contexts = args.decode or []
    names = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not names or any(e not in ENGINES for e in names):
        raise SystemExit(f"--engines must name some of {ENGINES}, got {args.engines!r}")
    if args.warmup_max_runs < 1 or not args.warmup_tolerance > 0:
        raise SystemExit(f"--warmup-max-runs must be >= 1 and --warmup-tolerance > 0, got "
                         f"{args.warmup_max_runs}, {args.warmup_tolerance}")
    max_s = args.max_seconds or None
    out = Path(args.out) if args.out else common.default_out("ab")

    existing = None
    if args.append and out.exists():
        existing = common.read_json(out)

    t_start = time.perf_counter()
    ceil = None
    if not args.no_ceilings:
        ceil = ceilings_mod.from_args(args)
        log(f"ceilings: copy {ceil['copy_gbps']:.1f} GB/s, bf16 {ceil['bf16_tflops']:.2f} TFLOP/s")

    model, config, _ = common.load_checkpoint(args)
    from mlx_qwen_fast import patched_copy

    fast, report = patched_copy(model)
    log(str(report))
    log(f"checkpoint ready in {time.perf_counter() - t_start:.1f} s")
    all_engines = {"stock": model, "patched": fast}
    engines = {name: all_engines[name] for name in names}
    roof = common.Roofline.from_config(config)

    run_info = common.result_header("ab", args)
    header = {
        **run_info,
        **common.checkpoint_fields(args),
        "patch_report": dataclasses.asdict(report),
        "roofline": roof.summary(),
        "ceilings": ceil,
    }
    if existing is not None:
        check_identity(existing, header, f"--append to {out}")
        result = existing
        result["ceilings"] = ceil or existing.get("ceilings")
    else:
        result = {**header, "prefill": [], "decode": [], "runs": []}
    run_index = len(result.setdefault("runs", []))
    result["runs"].append({
        "date": run_info["date"], "commit": run_info["commit"], "config": run_info["config"],
        "ceilings": ceil, "patch_report": header["patch_report"],
    })

    old_prefill = list(result.get("prefill", []))
    old_decode = list(result.get("decode", []))

    def save_prefill(records):
        result["prefill"] = common.merge_records(old_prefill, records, prefill_key)
        common.write_json(out, result)

    def save_decode(records):
        result["decode"] = common.merge_records(old_decode, records, decode_key)
        common.write_json(out, result)

    ctx = Context(
        roofline=roof, ceilings=result["ceilings"], vocab=common.ModelShape.from_config(config).vocab,
        prompt_seed=args.prompt_seed, step=args.prefill_step_size, rounds=args.rounds,
        max_seconds=max_s, warmup_max_seconds=args.warmup_max_seconds or None,
        warmup_max_runs=args.warmup_max_runs, warmup_tolerance=args.warmup_tolerance,
        run_index=run_index,
    )
    common.write_json(out, result)
    if prefill_lengths:
        ctx.save = save_prefill
        prefill_sweep(engines, prefill_lengths, ctx,
                      timed_out=_earlier_timeouts(old_prefill, "tokens"))
    if decode_contexts:
        ctx.save = save_decode
        decode_sweep(engines, decode_contexts, ctx, steps=args.decode_steps,
                     fill_engine=args.fill_engine, fill_model=all_engines[args.fill_engine],
                     fill_max_seconds=args.fill_max_seconds or None,
                     timed_out=_earlier_timeouts(old_decode, "context"))
    result["runs"][run_index]["wall_seconds"] = time.perf_counter() - t_start
    common.write_json(out, result)
    log(f"wrote {out} ({time.perf_counter() - t_start:.0f} s)")
    _print_tables(result)
    if not args.no_plots:
        from . import plots

        plots.plot_file_or_hint(out)
    return result


def _print_tables(result: Dict) -> None:
    if result.get("prefill"):
        log("prefill:")
        common.print_table(sorted(result["prefill"], key=lambda r: (r["tokens"], r["engine"])),
                           ["tokens", "engine", "status", "tok_s", "tok_s_min", "tok_s_max",
                            "peak_gb", "roofline_frac", "warmup_runs"])
    if result.get("decode"):
        log("decode:")
        common.print_table(sorted(result["decode"], key=lambda r: (r["context"], r["engine"])),
                           ["context", "engine", "status", "tok_s", "tok_s_min", "tok_s_max",
                            "peak_gb", "roofline_frac", "host_ms_per_token",
                            "device_ms_per_token", "warmup_runs"])


if __name__ == "__main__":
    main()
