"""Public ops given arguments outside their contracts: each raises one
ValueError naming the argument, or (the unchecked entries of traced steps)
returns without writing outside its buffers. The calls run in a subprocess
(``_CASES`` below, one line of output per case), so a call that corrupts
memory, aborts or segfaults fails the test instead of the test run; a case
that returns where it should raise fails too.

Covered: the cases a new user found (issue "first hour, second pass"):
``decode_attention`` with ``offset`` outside ``[0, capacity)``,
``prefill_attention`` with a negative offset or one past the keys,
``sparse_moe`` with an implementation name that does not exist,
``moe_decode`` with a wrong hidden size; and the unchecked decode attention
at such offsets, which must write only the clamped row.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = r'''
import json, sys
import mlx.core as mx
from mlx_qwen_fast.ops import attention, moe
from mlx_qwen_fast.checkpoint import build_model

def attn_args(cap=8, offset=0, hq=4, hkv=2, dh=64, B=1):
    mx.random.seed(0)
    proj = mx.random.normal((B, 1, 2 * (hq + hkv) * dh))
    keys = mx.random.normal((B, hkv, cap, dh))
    values = mx.random.normal((B, hkv, cap, dh))
    w = mx.ones((dh,))
    settings = dict(num_heads=hq, num_kv_heads=hkv, scale=dh ** -0.5, q_eps=1e-6, k_eps=1e-6, rope_dims=dh // 4)
    return (proj, keys, values, mx.array(offset, mx.int32), w, w), settings

def decode(offset):
    args, settings = attn_args(offset=offset)
    return attention.decode_attention(*args, **settings)

def decode_unchecked(offset):
    args, settings = attn_args(offset=offset)
    keys = args[1]
    out, k2, v2 = attention.decode_attention_unchecked(*args, **settings)
    mx.eval(out, k2, v2)
    row = min(max(offset, 0), keys.shape[2] - 1)
    others = [i for i in range(keys.shape[2]) if i != row]
    kept = mx.array_equal(k2[:, :, others], keys[:, :, others]).item()
    _ = mx.random.normal((1 << 16,)).sum().item()  # the heap still serves
    return "clamped" if kept else "wrote outside the clamped row"

def prefill(offset, T=4, L=8):
    q = mx.zeros((1, 4, T, 64)); k = mx.zeros((1, 2, L, 64))
    return attention.prefill_attention(q, k, k, scale=0.125, offset=offset)

_block = []
def block():
    if not _block:
        model, _ = build_model("tiny", seed=0, dtype=mx.bfloat16)
        _block.append(model.language_model.model.layers[0].mlp)
    return _block[0]

CASES = {
    "decode offset 8": lambda: decode(8),
    "decode offset 20": lambda: decode(20),
    "decode offset -1": lambda: decode(-1),
    "decode offset 9": lambda: decode(9),
    "decode offset 1000": lambda: decode(1000),
    "decode offset float": lambda: attention.decode_attention(*(lambda a, s: (a[:3] + (mx.array(1.5),) + a[4:]))(*attn_args()), **attn_args()[1]),
    "decode proj width": lambda: attention.decode_attention(*(lambda a: (a[0][..., :-1],) + a[1:])(attn_args()[0]), **attn_args()[1]),
    "decode heads": lambda: attention.decode_attention(*attn_args()[0], **{**attn_args()[1], "num_heads": 3}),
    "unchecked offset 8": lambda: decode_unchecked(8),
    "unchecked offset 1000": lambda: decode_unchecked(1000),
    "unchecked offset -1": lambda: decode_unchecked(-1),
    "prefill offset -3": lambda: prefill(-3),
    "prefill offset past keys": lambda: prefill(5),
    "prefill offset float": lambda: prefill(1.0),
    "prefill keys batch": lambda: attention.prefill_attention(mx.zeros((2, 4, 4, 64)), mx.zeros((1, 2, 8, 64)), mx.zeros((1, 2, 8, 64)), scale=0.1, offset=0),
    "sparse_moe implementation": lambda: moe.sparse_moe(block(), mx.zeros((1, 1, 256), mx.bfloat16), implementation="cuda-kernel"),
    "sparse_moe implementation list": lambda: moe.sparse_moe(block(), mx.zeros((1, 1, 256), mx.bfloat16), implementation=["stock"]),
    "moe_decode hidden size": lambda: moe.moe_decode(block(), mx.zeros((1, 1, 100), mx.bfloat16)),
    "moe_decode dtype": lambda: moe.moe_decode(block(), mx.zeros((1, 1, 256), mx.float32)),
    "moe_decode tokens": lambda: moe.moe_decode(block(), mx.zeros((1, 9, 256), mx.bfloat16)),
}

for name in sys.argv[1:]:
    print(json.dumps({"case": name, "start": True}), flush=True)
    try:
        out = CASES[name]()
        if isinstance(out, (tuple, list)):
            mx.eval(*[o for o in out if isinstance(o, mx.array)])
        elif isinstance(out, mx.array):
            mx.eval(out)
        result = {"case": name, "returned": out if isinstance(out, str) else type(out).__name__}
    except ValueError as exc:
        result = {"case": name, "raised": "ValueError", "message": str(exc)}
    except Exception as exc:
        result = {"case": name, "raised": type(exc).__name__, "message": str(exc)}
    print(json.dumps(result), flush=True)
'''

#: case -> ("raise", words the message must hold) or ("return", the value returned)
_CASES = {
    "decode offset 8": ("raise", "offset must be in [0, 8)"),
    "decode offset 20": ("raise", "offset must be in [0, 8)"),
    "decode offset -1": ("raise", "offset must be in [0, 8)"),
    "decode offset 9": ("raise", "offset must be in [0, 8)"),
    "decode offset 1000": ("raise", "offset must be in [0, 8)"),
    "decode offset float": ("raise", "offset must be a 0-d int32 array"),
    "decode proj width": ("raise", "proj must be"),
    "decode heads": ("raise", "num_heads (3) must be a positive multiple of num_kv_heads (2)"),
    "unchecked offset 8": ("return", "clamped"),
    "unchecked offset 1000": ("return", "clamped"),
    "unchecked offset -1": ("return", "clamped"),
    "prefill offset -3": ("raise", "offset must be an int with 0 <= offset"),
    "prefill offset past keys": ("raise", "offset must be an int with 0 <= offset and offset + 4 (queries) <= 8"),
    "prefill offset float": ("raise", "offset must be an int"),
    "prefill keys batch": ("raise", "keys must be"),
    "sparse_moe implementation": ("raise", "implementation must be one of"),
    "sparse_moe implementation list": ("raise", "implementation must be one of"),
    "moe_decode hidden size": ("raise", "x must be"),
    "moe_decode dtype": ("raise", "moe_decode: x must be bfloat16"),
    "moe_decode tokens": ("raise", "moe_decode: x must be bfloat16 with 1..4 tokens"),
}


@pytest.fixture(scope="module")
def results():
    """Every case's outcome, from one subprocess (a case that kills it is
    found by the line it started without finishing; the rest rerun)."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    todo, out = list(_CASES), {}
    while todo:
        r = subprocess.run([sys.executable, "-c", _SCRIPT, *todo], capture_output=True, text=True, env=env,
                           timeout=600)
        lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
        done = {d["case"]: d for d in lines if "start" not in d}
        out.update(done)
        started = [d["case"] for d in lines if "start" in d]
        crashed = [c for c in started if c not in done]
        for c in crashed:  # the process died in this case: its exit code and the end of stderr
            out[c] = {"case": c, "died": r.returncode, "stderr": r.stderr[-2000:]}
        todo = [c for c in todo if c not in out]
        if todo and not crashed:
            raise AssertionError(f"the case script stopped before {todo}: rc {r.returncode}\n{r.stderr[-4000:]}")
    return out


@pytest.mark.parametrize("case", list(_CASES))
def test_bad_argument(results, case):
    kind, want = _CASES[case]
    got = results[case]
    assert "died" not in got, f"the process died (exit code {got.get('died')}): {got.get('stderr')}"
    if kind == "raise":
        assert got.get("raised") == "ValueError", got
        assert want in got["message"], got
        assert "\n" not in got["message"]
    else:
        assert got.get("returned") == want, got
