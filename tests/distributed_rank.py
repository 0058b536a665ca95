"""One rank of tests/test_distributed.py, run by ``mlx.launch`` (ring backend).

``python distributed_rank.py CHECKPOINT TOKENS MODE`` on each rank: load the
checkpoint with fp32 activations, split it over the launched group (MODE
"tensor": ``model.shard(group)``; "pipeline": ``model.model.pipeline(group)``,
two stages), ``mlx_qwen_fast.patch(model)``, then ``TOKENS`` greedy tokens;
then (tensor only) the same checkpoint through ``install()`` and
``mlx_lm.utils.sharded_load``.
Prints one line ``RESULT {json}`` with both reports, the warnings each
raised, whether any fast module is left, and the greedy tokens.
"""

import json
import sys
import warnings

import mlx.core as mx
import mlx_lm
import mlx_lm.utils
from mlx_lm.generate import generate_step

import mlx_qwen_fast

PROMPT = [1, 5, 9, 200, 33, 7, 81, 12]


def _report(model, caught):
    r = model.patch_report
    return {"patched": r.patched, "reason": r.reason, "is_patched": mlx_qwen_fast.is_patched(model),
            "warnings": [str(w.message) for w in caught if issubclass(w.category, UserWarning)]}


def main(path, n, mode="tensor"):
    group = mx.distributed.init(strict=True, backend="ring")
    model, _ = mlx_lm.load(path)
    model.set_dtype(mx.float32)
    if mode == "pipeline":
        model.model.pipeline(group)
    else:
        model.shard(group)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mlx_qwen_fast.patch(model)
    out = {"rank": group.rank(), "size": group.size(), "patch": _report(model, caught)}
    tokens = []
    for (tok, _), _ in zip(generate_step(mx.array(PROMPT), model, max_tokens=n), range(n)):
        tokens.append(int(tok))
    out["tokens"] = tokens
    if mode == "pipeline":
        print("RESULT " + json.dumps(out), flush=True)
        return

    mlx_qwen_fast.install()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded, _ = mlx_lm.utils.sharded_load(path)
        out["sharded_load"] = _report(loaded, caught)
    finally:
        mlx_qwen_fast.uninstall()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:4])
