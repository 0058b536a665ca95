"""Start-up cost of the patched model: first use vs cached kernels.

Two fresh processes share one empty kernel cache (``MLX_QWEN_FAST_CACHE``,
through :func:`bench.device_script.timed_builds`). Each builds the checkpoint,
patches it, then times its first prefill of ``--prompt`` tokens (in
``--prefill-step-size`` chunks, as ``mlx_lm.generate_step``) and its first
decode step. In the first process every CUDA kernel is compiled by NVRTC
("first_use"); the second loads the cubins from disk ("cached"). The model
build and ``import`` are reported apart, so the numbers are what a user pays
for the package's kernels on the first request.

    python -m bench.startup --preset qwen3.6-35b-a3b --router-skew 1.0 --out FILE

Writes a JSON with ``kind`` "startup": per run ``import_s``, ``build_model_s``,
``first_prefill_s``, ``second_prefill_s``, ``first_decode_s``,
``second_decode_s`` (seconds), ``kernels_compiled``, ``kernels_cached``, the
per-kernel build seconds and, per kernel, [cubin bytes, launched image bytes,
seconds spent compressing it] (``image``: fatbin or plain cubin).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Dict

from . import common
from .device_script import timed_builds

_SNIPPET = r"""
import json, time
t0 = time.perf_counter()
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
import mlx_qwen_fast
from mlx_qwen_fast.checkpoint import build_model
from mlx_qwen_fast.kernels import _cuda_build as cb
from mlx_qwen_fast.kernels import _cuda_fatbin, _cuda_toolchain
t1 = time.perf_counter()
model, _ = build_model({preset!r}, seed={seed}, router_skew={skew})
mx.eval(model.parameters())
t2 = time.perf_counter()
report = mlx_qwen_fast.patch(model)
tokens = mx.random.randint(1, 1000, ({prompt},), key=mx.random.key(0))

def prefill():
    cache = make_prompt_cache(model)
    t = time.perf_counter()
    for s in range(0, {prompt} - 1, {step}):
        model(tokens[None, s:min(s + {step}, {prompt} - 1)], cache=cache)
        mx.eval([c.state for c in cache])
    logits = model(tokens[None, -1:], cache=cache)
    mx.eval(logits)
    return time.perf_counter() - t, cache, logits

def decode(cache, logits):
    t = time.perf_counter()
    y = mx.argmax(logits[:, -1], axis=-1)
    mx.eval(model(y[None], cache=cache))
    return time.perf_counter() - t

p1, cache, logits = prefill()
d1 = decode(cache, logits)
p2, cache, logits = prefill()
d2 = decode(cache, logits)
st = cb.build_stats
print("BUILDJSON" + json.dumps(dict(
    import_s=t1 - t0, build_model_s=t2 - t1, first_prefill_s=p1, second_prefill_s=p2,
    first_decode_s=d1, second_decode_s=d2, patch=str(report),
    kernels_compiled=sum(1 for v in st.values() if v.get("source") == "compiled"),
    kernels_cached=sum(1 for v in st.values() if v.get("source") == "cache"),
    build_s={{k: v.get("seconds") for k, v in st.items()}}, compiler=_cuda_toolchain.compiler_id(),
    image=_cuda_fatbin.fatbin_id(),
    image_bytes={{k: [v.get("cubin_bytes"), v.get("image_bytes"), v.get("fatbin_seconds")] for k, v in st.items()}})))
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3.6-35b-a3b", choices=common.PRESET_NAMES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--router-skew", type=float, default=1.0)
    p.add_argument("--prompt", type=common.lengths_arg, default=[4096],
                   help="prompt tokens of the timed prefill (default 4k)")
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--out", default=None,
                   help="result JSON (default bench/results/<date>-<device>-startup.json)")
    return p


def main(argv=None) -> Dict:
    args = build_parser().parse_args(argv)
    prompt = args.prompt[0]
    if prompt < 2:
        raise SystemExit(f"--prompt: need at least 2 tokens, got {prompt}")
    snippet = _SNIPPET.format(preset=args.preset, seed=args.seed, skew=args.router_skew,
                              prompt=prompt, step=args.prefill_step_size)
    t0 = time.perf_counter()
    runs = timed_builds(snippet, Path(__file__).resolve().parent.parent)
    result = {
        **common.result_header("startup", args),
        "preset": args.preset, "seed": args.seed, "router_skew": args.router_skew,
        "prompt": prompt, "prefill_step_size": args.prefill_step_size,
        "runs": runs, "wall_seconds": time.perf_counter() - t0,
    }
    out = Path(args.out) if args.out else common.default_out("startup")
    common.write_json(out, result)
    keys = ("import_s", "build_model_s", "first_prefill_s", "second_prefill_s",
            "first_decode_s", "second_decode_s", "kernels_compiled", "kernels_cached", "image")
    for label, r in runs.items():
        print(f"{label:9s} rc={r.get('rc')} " + " ".join(
            f"{k}={r[k]:.3f}" if isinstance(r.get(k), float) else f"{k}={r.get(k)}"
            for k in keys), flush=True)
    print("wrote", out, json.dumps({k: runs[k].get("first_prefill_s") for k in runs}), flush=True)
    return result


if __name__ == "__main__":
    main()
