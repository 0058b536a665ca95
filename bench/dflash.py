"""DFlash speculative decoding vs plain patched decoding: tokens/s by acceptance.

``python -m bench.dflash [--model PATH | --preset P --dtype D] --context 4096
[--tokens 128] [--accept oracle,0.6,0.8,0.9] [--block 16] [--repeats 2]
[--oracle-rounds 4] [--drafter DIR | --drafter-preset NAME] [--out FILE]``

On the patched target (``--model``, or a random-weight ``--preset``), after a
prompt of ``--context`` random tokens:

- **plain**: mlx-lm's ``generate_step`` (greedy), ``--tokens`` tokens; its
  tokens are the reference continuation;
- **the loop's own continuation**: in bf16 on a GPU the verify's greedy
  tokens are not plain decoding's (an S-token pass rounds differently, and
  a random-weight model's top logits are near ties), so a stand-in that
  proposed plain decoding's tokens would be rejected from the first
  difference on. The reference of the stand-ins is therefore the loop's own
  output, found as a fixed point (:func:`loop_reference`): run the loop
  with the oracle proposing the current reference, take its output as the
  next reference, until the output equals what was proposed (then every
  draft was accepted) or ``--oracle-rounds`` runs (untimed) are spent. On
  the CPU in fp32 it is plain decoding's continuation at once;
- **DFlash with stand-in drafters** (:func:`mlx_qwen_fast.dflash.dflash_generate_step`,
  greedy, block ``--block``): ``oracle`` proposes that reference
  continuation (every draft accepted once the fixed point is reached);
  ``p`` (a float) proposes the reference token with probability p per
  position, else a wrong one (accepted length per block geometric: E =
  sum_{k<b} p^k - 1 drafts, where the verify's tokens after a rejection
  keep to the reference). A stand-in drafts for free (a
  host-side lookup), so these rows time the verify passes, the target's
  hidden-state capture and the rollback: the loop's cost without the
  drafter;
- **the drafter's own cost**: a random-weight DFlash drafter of the
  target's shape (``--drafter-preset``, default ``tiny-dflash`` for the tiny
  target and ``qwen3.6-35b-a3b-dflash`` for the full one; or ``--drafter
  DIR``), its context cache holding ``--context`` rows: ms per block
  (``add_context`` of a block's accepted rows + ``propose``), and per mode
  the tokens/s the loop would reach with it
  (``tokens / (seconds + blocks * block_ms)``, as drafting and verifying
  run one after the other).

Each timed run starts from a fresh cache (the prefill is not timed:
decode tokens/s = tokens after the first / seconds from the first token to
the last). Records: mode, tok_s (median over ``--repeats``), speedup over
plain, measured acceptance and tokens per verify pass, whether the run's
tokens are plain decoding's (``exact``) and the reference's
(``as_reference``); the reference's rounds and whether it is plain
decoding's. Writes a JSON result (kind "dflash") with ``--out``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from typing import Dict, List, Optional

import mlx.core as mx

from bench import common


class StandIn:
    """A drafter stand-in (the protocol of ``dflash_generate_step``) that
    proposes the reference continuation ``ref`` of a ``P``-token prompt,
    each token right with probability ``p`` (1.0: the oracle), else
    ``(ref + 1) % vocab``. It asks for the drafter's target layers so the
    verify captures them as with a real drafter, and drops them."""

    is_dflash_drafter = True

    def __init__(self, ref: List[int], P: int, p: float, block: int, layer_ids, vocab: int, seed: int = 0):
        self.ref, self.P, self.p, self.block_size = ref, P, p, block
        self.target_layer_ids, self.vocab = tuple(layer_ids), vocab
        self.rng = random.Random(seed)

    def make_cache(self):
        return []

    def add_context(self, hidden, position, cache):
        pass

    def propose(self, model, last_token, position, num, cache):
        i = position - self.P + 1
        out = []
        for j in range(num):
            r = self.ref[i + j] if i + j < len(self.ref) else 0
            out.append(r if self.rng.random() < self.p else (r + 1) % self.vocab)
        return mx.array(out, mx.uint32)


def loop_reference(prompt, model, start: List[int], block: int, layer_ids, vocab: int, tokens: int,
                   rounds: int):
    """The DFlash loop's own greedy continuation of ``prompt`` (``tokens``
    tokens), as a fixed point: the oracle stand-in proposes the current
    reference (first ``start``, plain decoding's), the loop's output becomes
    the next one, until the output is what was proposed or ``rounds`` runs
    are spent. Returns ``(reference, runs made, fixed point reached)``."""
    from mlx_qwen_fast import dflash

    cur = list(start)
    for r in range(1, rounds + 1):
        stand = StandIn(cur + [0] * block, prompt.size, 1.0, block, layer_ids, vocab)
        out = [t for t, _ in dflash.dflash_generate_step(prompt, model, stand, max_tokens=tokens,
                                                         block_size=block)]
        if out == cur:
            return cur, r, True
        cur = out
    return cur, rounds, False


def _timed(gen, n: int):
    """Run generator ``gen`` for ``n`` tokens: (tokens, seconds from the
    first token to the last)."""
    tokens, t0 = [], None
    for tok, _ in gen:
        tokens.append(tok)
        if t0 is None:
            t0 = time.perf_counter()
        if len(tokens) == n:
            break
    return tokens, time.perf_counter() - t0


def drafter_block_ms(drafter, model, context: int, block: int, rows: int, iters: int = 5) -> float:
    """Median ms of one block of the real drafter: ``add_context`` of
    ``rows`` rows, then ``propose`` of ``block - 1`` tokens, its cache
    holding ``context`` rows (random hidden states)."""
    from mlx_qwen_fast.dflash import capture

    H = capture.text_parts(model).hidden_size
    k = len(drafter.target_layer_ids)
    dtype = capture.text_parts(model).embed_tokens(mx.array([[1]])).dtype
    cache = drafter.make_cache()
    step = 2048
    for s in range(0, context, step):  # the context, in chunks as a prefill adds it
        n = min(step, context - s)
        drafter.add_context(mx.random.normal((1, n, k * H)).astype(dtype), s, cache)
        mx.eval([c.keys for c in cache])
    times = []
    pos = context
    for _ in range(iters + 1):
        hid = mx.random.normal((1, rows, k * H)).astype(dtype)
        mx.eval(hid)
        t = time.perf_counter()
        drafter.add_context(hid, pos, cache)
        d = drafter.propose(model, mx.array([1], mx.uint32), pos + rows, block - 1, cache)
        mx.eval(d, [c.keys for c in cache])
        times.append(time.perf_counter() - t)
        for c in cache:
            c.trim(rows)
    return 1e3 * statistics.median(times[1:])


def _drafter(args, model):
    from mlx_qwen_fast.dflash import load_drafter, presets

    if args.drafter:
        return load_drafter(args.drafter), args.drafter
    name = args.drafter_preset or ("tiny-dflash" if common.text_args(model).hidden_size == 256
                                   else "qwen3.6-35b-a3b-dflash")
    dtype = getattr(mx, getattr(args, "dtype", "bfloat16"))
    d, _ = presets.build_drafter(name, seed=0, dtype=dtype)
    return d, name


def parse_accept(text: str) -> List[str]:
    """``"oracle,0.6,0.8"`` -> ``["oracle", "0.6", "0.8"]``; each a float in
    [0, 1] or "oracle"; else ValueError naming the item."""
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        if item != "oracle":
            try:
                v = float(item)
            except ValueError:
                raise ValueError(f"--accept {item!r}: expected 'oracle' or a probability in [0, 1]") from None
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"--accept {item!r}: expected a probability in [0, 1]")
        out.append(item)
    if not out:
        raise ValueError("--accept: expected at least one mode")
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.dflash", description=__doc__.split("\n\n")[0])
    common.add_checkpoint_args(p)
    p.add_argument("--context", type=int, default=4096, help="prompt tokens before decoding (default 4096)")
    p.add_argument("--tokens", type=int, default=128, help="decode tokens timed per run (default 128)")
    p.add_argument("--accept", default="oracle,0.6,0.8,0.9", help="stand-in modes (default %(default)s)")
    p.add_argument("--block", type=int, default=16, help="verify block size, drafts + 1 (default 16)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per mode (median; default 2)")
    p.add_argument("--oracle-rounds", type=int, default=4,
                   help="untimed runs to find the loop's own continuation (default 4)")
    p.add_argument("--drafter", default=None, help="a DFlash drafter folder for the drafter-cost row")
    p.add_argument("--drafter-preset", default=None, help="random drafter preset (default: the target's shape)")
    p.add_argument("--out", default=None, help="result JSON (default: no file)")
    args = p.parse_args(argv)
    try:
        modes = parse_accept(args.accept)
    except ValueError as e:
        p.error(str(e))
    if args.context < 1 or args.tokens < 2 or args.block < 2 or args.repeats < 1 or args.oracle_rounds < 1:
        p.error("--context >= 1, --tokens >= 2, --block >= 2, --repeats >= 1 and --oracle-rounds >= 1 are required")

    from mlx_lm.generate import generate_step

    from mlx_qwen_fast import dflash, patch

    model, _, _ = common.load_checkpoint(args)
    report = patch(model)
    if not report.patched:
        print(f"bench.dflash: the fast path declined the model: {report.reason}", file=sys.stderr)
        return 2
    vocab = common.text_args(model).vocab_size
    prompt = common.random_tokens(args.context, vocab, seed=args.seed)
    drafter, drafter_name = _drafter(args, model)
    block = min(args.block, drafter.block_size)
    ids = drafter.target_layer_ids

    records: List[Dict] = []
    ref, plain_runs = None, []
    for _ in range(args.repeats):
        toks, sec = _timed(generate_step(prompt, model, max_tokens=args.tokens), args.tokens)
        ref = ref or toks
        plain_runs.append((len(toks) - 1) / sec)
    plain = statistics.median(plain_runs)
    records.append({"mode": "plain", "context": args.context, "tokens": args.tokens, "tok_s": plain,
                    "tok_s_runs": plain_runs, "speedup": 1.0, "acceptance": None, "tokens_per_block": 1.0,
                    "blocks": args.tokens - 1, "exact": True})
    print(f"plain: {plain:.2f} tok/s", flush=True)

    loop_ref, rounds, fixed = loop_reference(prompt, model, ref, block, ids, vocab, args.tokens,
                                             args.oracle_rounds)
    reference = {"rounds": rounds, "fixed_point": fixed, "is_plain": loop_ref == ref}
    print(f"reference: the loop's own continuation after {rounds} run(s) "
          f"({'a fixed point' if fixed else 'no fixed point'}; "
          f"{'plain decoding' + chr(39) + 's' if loop_ref == ref else 'not plain decoding' + chr(39) + 's'})",
          flush=True)

    rows_per_block = {}
    for mode in modes:
        prob = 1.0 if mode == "oracle" else float(mode)
        runs, st = [], None
        for r in range(args.repeats):
            stand = StandIn(loop_ref + [0] * block, args.context, prob, block, ids, vocab, seed=r)
            st = dflash.DFlashStats()
            gen = dflash.dflash_generate_step(prompt, model, stand, max_tokens=args.tokens, block_size=block,
                                              stats=st)
            toks, sec = _timed(gen, args.tokens)
            runs.append((len(toks) - 1) / sec)
        tok_s = statistics.median(runs)
        rows_per_block[mode] = st.tokens_per_block
        records.append({"mode": mode, "context": args.context, "tokens": args.tokens, "tok_s": tok_s,
                        "tok_s_runs": runs, "speedup": tok_s / plain, "acceptance": st.acceptance,
                        "tokens_per_block": st.tokens_per_block, "blocks": st.blocks, "exact": toks == ref,
                        "as_reference": toks == loop_ref, "seconds": (len(toks) - 1) / tok_s})
        print(f"{mode}: {tok_s:.2f} tok/s ({tok_s / plain:.2f}x), acceptance {100 * st.acceptance:.0f}%, "
              f"{st.tokens_per_block:.2f} tokens per pass", flush=True)

    block_ms = drafter_block_ms(drafter, model, args.context, block,
                                rows=max(1, round(statistics.mean(rows_per_block.values()))))
    for r in records[1:]:
        r["tok_s_with_drafter"] = (args.tokens - 1) / (r["seconds"] + r["blocks"] * block_ms / 1e3)
    drafter_rec = {"drafter": drafter_name, "block": block, "context": args.context, "block_ms": block_ms}
    print(f"drafter {drafter_name}: {block_ms:.2f} ms per block at context {args.context}", flush=True)

    if args.out:
        data = common.result_header("dflash", args, **common.checkpoint_fields(args))
        data.update(records=records, drafter=drafter_rec, reference=reference)
        common.write_json(args.out, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
