"""Teacher-forced numerics: stock and patched logits against an fp32 reference.

One fixed token sequence (random ids, fixed seed, never 0; or ``--text``
tokenised with the checkpoint's tokenizer) goes through one forward pass of
each model; at every position each model predicts the next token from the
same prefix. Three models, one set of quantised weights:

* ``stock``: the checkpoint as mlx-lm runs it (bf16 activations);
* ``patched``: the mlx_qwen_fast twin (shares every array with stock);
* ``fp32``: the *fp32 reference* -- a clone of the stock model after
  ``model.set_dtype(mx.float32)``: every floating parameter (norm weights,
  conv1d, dt_bias, the quantisation scales and biases, unquantised weights)
  is cast to fp32, so all activations run in fp32. The packed 4/8-bit
  integer weights are the same, nothing is dequantised: the reference
  removes the bf16 rounding of the computation, not the quantisation error.

Pairs reported (``a`` measured against ``b``): stock vs fp32, patched vs
fp32, patched vs stock. For each: ``top1_agree`` (fraction of positions whose
argmax agree), ``ppl_delta_pct`` (100 * (ppl_a / ppl_b - 1), perplexities of
the sequence's actual next tokens), ``mean_kl`` (mean over positions of
KL(p_b || p_a), nats), ``max_abs_dlogit`` (max |logit_a - logit_b| over
positions and vocabulary). With random weights the logits are flat (a
perplexity near the vocabulary size, near-ties), so top-1 agreement is lower
than on a trained checkpoint; ``--lm-head-scale`` spreads them.

    python -m bench.numerics --preset qwen3.6-35b-a3b [--positions 256] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Dict, List, Tuple

import mlx.core as mx

from mlx_qwen_fast.patching import clone_modules, patched_copy

from . import common

REFERENCE_NOTE = (
    "fp32 = clone of the stock model with model.set_dtype(mx.float32): floating "
    "parameters (norms, conv1d, dt_bias, quantisation scales/biases) cast to fp32, "
    "packed integer weights unchanged (not dequantised); activations in fp32. It "
    "removes bf16 rounding, not quantisation error."
)


def fp32_reference(model):
    """The fp32 reference of ``model`` (see module docstring)."""
    ref = clone_modules(model)
    ref.set_dtype(mx.float32)
    return ref


def teacher_forced_logits(model, tokens: mx.array) -> mx.array:
    """fp32 logits ``[P, V]`` predicting ``tokens[1:]`` from one forward of
    ``tokens[:-1]``."""
    logits = model(tokens[None, :-1])[0].astype(mx.float32)
    mx.eval(logits)
    return logits


def compare(a: mx.array, b: mx.array, targets: mx.array) -> Dict:
    """Metrics of logits ``a`` against reference logits ``b`` (both ``[P, V]``)."""
    lpa = a - mx.logsumexp(a, axis=-1, keepdims=True)
    lpb = b - mx.logsumexp(b, axis=-1, keepdims=True)
    top_a, top_b = mx.argmax(a, axis=-1), mx.argmax(b, axis=-1)
    agree = top_a == top_b
    nll_a = -mx.take_along_axis(lpa, targets[:, None], axis=-1).mean()
    nll_b = -mx.take_along_axis(lpb, targets[:, None], axis=-1).mean()
    kl = (mx.exp(lpb) * (lpb - lpa)).sum(axis=-1).mean()
    max_abs = mx.abs(a - b).max()
    rel_l2 = mx.sqrt(((a - b) ** 2).sum() / (b**2).sum())
    # reference's top-1/top-2 margin where the two disagree: near-ties or not?
    top2 = mx.topk(b, 2, axis=-1)
    margin = mx.abs(top2[:, 1] - top2[:, 0])
    mx.eval(agree, nll_a, nll_b, kl, max_abs, rel_l2, margin)
    ppl_a, ppl_b = float(mx.exp(nll_a)), float(mx.exp(nll_b))
    dis = [float(m) for m, ok in zip(margin.tolist(), agree.tolist()) if not ok]
    return {
        "positions": int(a.shape[0]),
        "top1_agree": float(agree.astype(mx.float32).mean()),
        "ppl_delta_pct": 100.0 * (ppl_a / ppl_b - 1.0),
        "mean_kl": float(kl),
        "max_abs_dlogit": float(max_abs),
        "ppl_a": ppl_a,
        "ppl_b": ppl_b,
        "rel_l2": float(rel_l2),
        "disagree_ref_margin_median": common.stats(dis)["median"],
    }


def sequence(args, tokenizer, vocab: int) -> Tuple[mx.array, Dict]:
    n = args.positions + 1
    if args.text:
        if tokenizer is None:
            raise SystemExit("--text needs --model (a checkpoint with a tokenizer)")
        ids = tokenizer.encode(Path(args.text).read_text())
        if len(ids) < n:
            raise SystemExit(f"--text gives {len(ids)} tokens, need {n}")
        return mx.array(ids[:n], dtype=mx.int32), {"source": str(args.text)}
    return common.random_tokens(n, vocab, args.token_seed), {
        "source": "random", "token_seed": args.token_seed}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.numerics", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_checkpoint_args(p)
    p.add_argument("--positions", type=int, default=256,
                   help="predicted positions (default %(default)s; >= 192 for a report)")
    p.add_argument("--token-seed", type=int, default=0, help="seed of the random sequence")
    p.add_argument("--text", default=None, help="text file to tokenise instead (with --model)")
    p.add_argument("--out", default=None,
                   help="result JSON (default bench/results/<date>-<device>-numerics.json)")
    return p


def main(argv=None) -> Dict:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    model, config, tokenizer = common.load_checkpoint(args)

    fast, report = patched_copy(model)
    print(report, flush=True)
    shape = common.ModelShape.from_config(config)
    tokens, seq_info = sequence(args, tokenizer, shape.vocab)
    targets = tokens[1:]

    logits = {"stock": teacher_forced_logits(model, tokens),
              "patched": teacher_forced_logits(fast, tokens)}
    errors = {}
    try:
        ref = fp32_reference(model)
        logits["fp32"] = teacher_forced_logits(ref, tokens)
        del ref
    except Exception as exc:  # e.g. an fp32 kernel missing on this backend
        errors["fp32"] = f"{type(exc).__name__}: {exc}"[:500]
        print("fp32 reference failed:", errors["fp32"], flush=True)
    pairs: List[Dict] = []
    for a, b in (("stock", "fp32"), ("patched", "fp32"), ("patched", "stock")):
        if a in logits and b in logits:
            pairs.append({"a": a, "b": b, **compare(logits[a], logits[b], targets)})

    result = {
        **common.result_header("numerics", args),
        **common.checkpoint_fields(args),
        "patch_report": dataclasses.asdict(report),
        "reference": REFERENCE_NOTE,
        "sequence": {**seq_info, "positions": args.positions},
        "note": "kl = KL(p_b || p_a); ppl_delta_pct = 100 * (ppl_a / ppl_b - 1). Random "
                "weights give flat logits (near-ties), lowering top-1 agreement.",
        "pairs": pairs,
        "errors": errors,
        "wall_seconds": time.perf_counter() - t0,
    }
    out = Path(args.out) if args.out else common.default_out("numerics")
    common.write_json(out, result)
    common.print_table(pairs, ["a", "b", "positions", "top1_agree", "ppl_delta_pct",
                               "mean_kl", "max_abs_dlogit", "rel_l2"])
    print("wrote", out, flush=True)
    return result


if __name__ == "__main__":
    main()
