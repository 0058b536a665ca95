"""Repeat one routing case many times: the shared slot's logit read from
column E of ``[N, E + 32]`` logits that were just concatenated in the same
graph ("lazy"), or evaluated first ("evaluated"), against the plain routing.

Why: in the thirteenth session one of 16 cases of
``tests/test_cuda_moe.py::test_route_and_group_with_shared_slot`` (column,
bf16, N = 4099) returned garbage in the first rows of ``inds`` once on the
H200. This counts how often each form differs, to tell a fault of the route
kernel (both forms fail) from one of the concatenation's graph ordering
(only "lazy" fails). CUDA only; prints one line per form.

    python3 bench/route_column_check.py [repeats]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from mlx_qwen_fast.kernels import _cuda_build as cb  # noqa: E402
from mlx_qwen_fast.kernels import moe_routing as mr  # noqa: E402


def main(repeats: int) -> None:
    n, E, k, tile = 4099, 256, 8, 64
    for poison in (True, False):
        cb.set_poison(poison)
        for form in ("lazy", "evaluated", "input"):
            bad = 0
            for i in range(repeats):
                key = mx.random.key(1000 + i)
                logits = (mx.random.normal((n, E), key=key) * 2.0).astype(mx.bfloat16)
                sl = (mx.random.normal((n, 1), key=mx.random.key(i)) * 4).astype(mx.bfloat16)
                mx.eval(logits, sl)
                if form == "input":
                    r = mr.route_and_group(logits, k, tile, shared_logits=sl)
                else:
                    wide = mx.concatenate([logits, sl, mx.full((n, 31), 1e4, mx.bfloat16)], axis=1)
                    if form == "evaluated":
                        mx.eval(wide)
                    r = mr.route_and_group(wide, k, tile, shared_column=True)
                plain = mr.route_and_group(logits, k, tile)
                same = mx.array_equal(r.inds[:, :k], plain.inds).item()
                if not same:
                    rows = mx.any(r.inds[:, :k] != plain.inds, axis=1)
                    first = int(mx.argmax(rows).item())
                    print(f"  poison={poison} {form} repeat {i}: {int(rows.sum().item())} rows differ, "
                          f"first {first}: {r.inds[first].tolist()} vs {plain.inds[first].tolist()}")
                    bad += 1
            print(f"poison={poison} {form}: {bad} of {repeats} differ", flush=True)
    cb.set_poison(False)


if __name__ == "__main__":
    if not cb.cuda_available():
        raise SystemExit("needs MLX's CUDA backend")
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
