"""Graph nodes of one decode token, by primitive and by layer kind.

MLX evaluates a decode token as the graph its model call built; on the CUDA
backend each node of that graph costs host time when the graph is encoded
(bench/results/package-figures.md, "Host time per decode token"), so the
count of nodes per token is the quantity a few-node decode step must bring
down (issue: decode at >= 600 tok/s, "at most 60 nodes per token").

Method: for each engine (stock mlx-lm, patched) a prompt cache is made at
``--context`` positions without running a prefill (attention layers: K/V
buffers of ``--context`` rounded up to mlx-lm's step of 256, plus one step
when full, offset = context; linear-attention layers: zero conv and
recurrent states), then one greedy step (the graph
``mlx_lm.generate.generate_step`` builds: model call, log-softmax, argmax)
is built and **not** evaluated. ``mx.export_to_dot`` of the step's token and
every cache array lists the graph's nodes; each node's primitive name is
counted. The same is done for one decoder layer of each kind alone (its
input an evaluated array), so the table splits the step into layers and
the rest (embedding, final norm, LM head, sampling).

Nodes are counted two ways: ``nodes`` (every primitive) and ``launching``
(without the primitives that MLX evaluates as views or no-ops on the GPU:
reshapes, broadcasts, slices, transposes and the like, :data:`VIEWS`).
A node that ``mx.compile`` fused shows as one ``Compiled...`` primitive.
The counts are of the graph as built on the backend the script runs on:
on the CPU MLX's ``mx.fast`` ops decompose into several primitives, so only
counts taken on the GPU describe a GPU decode.

    python -m bench.nodes --preset qwen3.6-35b-a3b [--context 4096] [--out FILE]
    python -m bench.nodes --preset tiny --dtype float32        # CPU smoke run
"""

from __future__ import annotations

import argparse
import collections
import io
import re
from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx

from . import common

#: Primitives that MLX evaluates without a kernel launch where the input is
#: contiguous (views, shape changes, graph-only markers).
VIEWS = frozenset({
    "Reshape", "Broadcast", "BroadcastAxes", "ExpandDims", "Squeeze", "Transpose", "Slice",
    "AsStrided", "StopGradient", "Split", "Depends", "Flatten", "Unflatten", "NumberOfElements",
})

_LABEL = re.compile(r'label ="([^"]+)", shape=rectangle')


def graph_primitives(outputs: Sequence[mx.array]) -> List[str]:
    """Primitive names of every node in the (unevaluated) graph of ``outputs``.

    Evaluated arrays are leaves (MLX detaches an array from its primitive
    once it is evaluated), so only the nodes that evaluating ``outputs``
    would run are listed; a primitive with several outputs is one node.
    """
    buf = io.StringIO()
    mx.export_to_dot(buf, *outputs)
    return _LABEL.findall(buf.getvalue())


def count(prims: Sequence[str]) -> Dict[str, Any]:
    """``{"nodes", "launching", "by_primitive"}`` of a list of primitive names."""
    by = collections.Counter(prims)
    return {
        "nodes": len(prims),
        "launching": sum(n for p, n in by.items() if p not in VIEWS),
        "by_primitive": dict(by.most_common()),
    }


def _cache_arrays(cache) -> List[mx.array]:
    out = []
    for c in cache:
        for a in (c.state if isinstance(c.state, (list, tuple)) else [c.state]):
            if isinstance(a, (list, tuple)):
                out.extend(x for x in a if isinstance(x, mx.array))
            elif isinstance(a, mx.array):
                out.append(a)
    return out


def _act_dtype(model):
    return model.layers[0].input_layernorm.weight.dtype


def synthetic_cache(model, context: int) -> List[Any]:
    """mlx-lm's prompt cache for ``model`` as if ``context`` tokens had been
    prefilled (zeros; evaluated): KV buffers of ``context`` rounded up to the
    cache's step, one step more when that is full, so the next token is
    written in place as in a real decode."""
    from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

    cache = make_prompt_cache(model)
    layers = model.layers
    dtype = _act_dtype(model)
    for c, layer in zip(cache, layers):
        if isinstance(c, KVCache):
            attn = layer.self_attn
            step = c.step
            cap = ((context + step - 1) // step) * step
            if cap <= context:
                cap += step
            shape = (1, attn.num_key_value_heads, cap, attn.head_dim)
            c.keys, c.values = mx.zeros(shape, dtype), mx.zeros(shape, dtype)
            c.offset = context
        elif isinstance(c, ArraysCache):
            mixer = layer.linear_attn
            c[0] = mx.zeros((1, mixer.conv_kernel_size - 1, mixer.conv_dim), dtype)
            c[1] = mx.zeros((1, mixer.num_v_heads, mixer.head_v_dim, mixer.head_k_dim), mx.float32)
        else:
            raise TypeError(f"synthetic_cache: cache of type {type(c).__name__} is not supported")
    mx.eval(_cache_arrays(cache))
    return cache


def step_graph(model, cache, token: int = 1) -> List[mx.array]:
    """The outputs of one greedy decode step (as ``generate_step`` builds it),
    not evaluated: ``[token, *cache arrays]``."""
    logits = model(mx.array([[token]]), cache=cache)[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    return [mx.argmax(logprobs, axis=-1)] + _cache_arrays(cache)


def layer_graph(model, cache, index: int) -> List[mx.array]:
    """The outputs of decoder layer ``index`` alone for one token (input:
    an evaluated ``[1, 1, hidden]`` array), not evaluated."""
    layer = model.layers[index]
    h = mx.zeros((1, 1, common.text_args(model).hidden_size), _act_dtype(model))
    mx.eval(h)
    out = layer(h, None, cache[index])
    return [out] + _cache_arrays([cache[index]])


def measure_engine(model, context: int) -> Dict[str, Any]:
    """Counts of one engine: the whole step and one layer of each kind."""
    step = count(graph_primitives(step_graph(model, synthetic_cache(model, context))))
    kinds: Dict[str, Dict[str, Any]] = {}
    n_layers = len(model.layers)
    for i, layer in enumerate(model.layers):
        kind = "linear_attention" if getattr(layer, "is_linear", False) else "full_attention"
        if kind in kinds:
            kinds[kind]["layers"] += 1
            continue
        rec = count(graph_primitives(layer_graph(model, synthetic_cache(model, context), i)))
        rec["layers"] = 1
        rec["index"] = i
        kinds[kind] = rec
    in_layers = sum(r["nodes"] * r["layers"] for r in kinds.values())
    in_layers_l = sum(r["launching"] * r["layers"] for r in kinds.values())
    return {
        "step": step,
        "layers": kinds,
        "num_layers": n_layers,
        "outside_layers": {"nodes": step["nodes"] - in_layers, "launching": step["launching"] - in_layers_l},
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.nodes", description=__doc__.split("\n\n")[0])
    common.add_checkpoint_args(p)
    p.add_argument("--context", type=int, default=4096, help="positions in the cache (default %(default)s)")
    p.add_argument("--engines", default="stock,patched", help="comma list of stock, patched")
    p.add_argument("--out", default=None, help="result JSON (default: none written)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    args = build_parser().parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for e in engines:
        if e not in ("stock", "patched"):
            raise SystemExit(f"bench.nodes: --engines takes stock and/or patched, got {e!r}")
    model, _config, _tok = common.load_checkpoint(args)
    models = {"stock": model}
    if "patched" in engines:
        from mlx_qwen_fast import patched_copy

        models["patched"], _report = patched_copy(model)
    result = common.result_header("nodes", args, **common.checkpoint_fields(args))
    result["context"] = args.context
    result["engines"] = {}
    for e in engines:
        result["engines"][e] = measure_engine(models[e], args.context)
    rows = []
    for e, rec in result["engines"].items():
        rows.append({"engine": e, "part": "whole step", "layers": rec["num_layers"],
                     "nodes": rec["step"]["nodes"], "launching": rec["step"]["launching"]})
        for kind, k in rec["layers"].items():
            rows.append({"engine": e, "part": f"one {kind} layer", "layers": k["layers"],
                         "nodes": k["nodes"], "launching": k["launching"]})
        rows.append({"engine": e, "part": "outside the layers", "layers": "",
                     "nodes": rec["outside_layers"]["nodes"], "launching": rec["outside_layers"]["launching"]})
    common.print_table(rows, ["engine", "part", "layers", "nodes", "launching"])
    for e, rec in result["engines"].items():
        top = ", ".join(f"{p} {n}" for p, n in list(rec["step"]["by_primitive"].items())[:12])
        print(f"{e}: {top}")
    if args.out:
        common.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
