"""The Python host cost of the whole-stack decode step, measured on a CPU.

``python -m bench.decode_host_cpu [--layers 40] [--tokens 50]``

On the CPU the Gated DeltaNet and MoE parts have no compiled decode step, so
:func:`mlx_qwen_fast.ops.model_plan.decode_model` would decline; here they are
replaced by stand-ins with the real steps' argument counts (the GDN step's
10 arrays, the MoE step's 21, each a few cheap ops), so that every layer of
a tiny-preset model with ``--layers`` layers takes the whole-stack step. Per
token (medians after 10 warm-up tokens): the time of the ``decode_model``
call, the part inside the compiled call, and the rest -- the Python that
plans, checks and builds the arguments, the quantity the stack's kept plan
reduces. The GPU work and MLX's encoding are not in it; the figures compare
trees or changes on one machine (run an older tree with ``PYTHONPATH`` at
its checkout), not CPU with GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import mlx.core as mx

_GDN_NAMES = (("A_log",), ("dt_bias",), ("norm", "weight"), ("conv1d", "weight"),
              ("in_proj_qkv", "weight"), ("in_proj_qkv", "scales"), ("in_proj_qkv", "biases"),
              ("out_proj", "weight"), ("out_proj", "scales"), ("out_proj", "biases"))
_MOE_NAMES = (tuple(("gate", n) for n in ("weight", "scales", "biases"))
              + tuple(("switch_mlp", p, n) for p in ("gate_proj", "up_proj", "down_proj")
                      for n in ("weight", "scales", "biases"))
              + tuple(("shared_expert", p, n) for p in ("gate_proj", "up_proj", "down_proj")
                      for n in ("weight", "scales", "biases"))
              + tuple(("shared_expert_gate", n) for n in ("weight", "scales", "biases")))


def _stand_ins(decoder) -> None:
    """Replace the GDN and MoE decode-step parts with stand-ins (see the module docstring)."""

    def gdn_parts(layer, x, cache, input_norm_eps, input_norm_weight=None):
        def fn(x, cs, st, n1, *arrays):
            return x + mx.fast.rms_norm(x, n1, input_norm_eps), cs * 0.5, st * 0.9

        return _GDN_NAMES, fn, len(_GDN_NAMES), (mx.array(0.25), mx.array(0.5))

    def moe_parts(block, x, norm_eps):
        def fn(h, n2, *arrays):
            return h + mx.fast.rms_norm(h, n2, norm_eps)

        return _MOE_NAMES, fn

    decoder.gated_delta_ops.decode_step_parts = gdn_parts
    decoder.moe_ops.decode_step_parts = moe_parts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=40, help="decoder layers (every fourth full attention)")
    p.add_argument("--tokens", type=int, default=50, help="timed tokens")
    args = p.parse_args(argv)
    if args.layers < 1 or args.tokens < 1:
        p.error("--layers and --tokens must be >= 1")
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_qwen_fast import checkpoint, patched_copy
    from mlx_qwen_fast.ops import decoder, model_plan

    _stand_ins(decoder)
    config = checkpoint.preset_config("tiny")
    config["text_config"]["num_hidden_layers"] = args.layers
    saved = checkpoint.PRESETS["tiny"]
    checkpoint.PRESETS["tiny"] = config
    try:
        model, _ = checkpoint.build_model("tiny", seed=1, dtype=mx.float32)
    finally:
        checkpoint.PRESETS["tiny"] = saved
    fast, _ = patched_copy(model, warn=False)
    text = fast.language_model.model
    cache = make_prompt_cache(fast)
    mx.eval(fast(mx.array([[1, 2, 3]]), cache=cache))
    inside = [0.0]
    real_step = model_plan._model_step

    def timed_step(*a):
        fn = real_step(*a)

        def call(*args):
            t = time.perf_counter()
            out = fn(*args)
            inside[0] += time.perf_counter() - t
            return out

        return call

    model_plan._model_step = timed_step
    tok = mx.array([[4]])
    total, compiled = [], []
    for i in range(10 + args.tokens):
        inside[0] = 0.0
        t = time.perf_counter()
        out = model_plan.decode_model(text, tok, cache)
        dt = time.perf_counter() - t
        if out is None:
            print("decode_model declined: the stand-ins do not fit this tree", file=sys.stderr)
            return 1
        mx.eval(out, [c.state for c in cache])
        if i >= 10:
            total.append(dt)
            compiled.append(inside[0])
    med = statistics.median
    print(f"decode_model {med(total) * 1e3:.3f} ms per token, of which the compiled call "
          f"{med(compiled) * 1e3:.3f} ms, the rest {med([a - b for a, b in zip(total, compiled)]) * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
