"""Build, check and time the decode MoE kernels (N <= 4 tokens) (device script).

Run on the GPU machine (about 2 minutes):

    source .mlxcuda/boot.sh && PYTHONPATH=. python3 bench/moe_decode_cuda.py --out $OUT [--sections build,check,time,raw]

The two kernels of ``kernels/moe_decode_gemv.py`` (gate+up with SwiGLU and
the shared-expert gate; down + routing weights + shared expert + combine),
as the patched model runs them for 1..4 tokens (``ops.moe`` "cuda-decode":
router, routing kernel and the two kernels in one ``mx.compile``d step), at
the model's shape: E = 256, D = 2048, I = 512, k = 8. Sections, each in its
own process:

* ``build``: first-use compile into an empty kernel cache, then a cached
  load (``device_script.timed_builds``), N = 1..4; the cubins are kept for
  ``raw``; a SASS summary when ``cuobjdump`` is there (16-byte loads issued
  before the first HMMA, local memory).
* ``check``: outputs poisoned with NaN; per N the op-by-op path
  (``ops.moe.moe_decode``) finite, equal bit for bit to the compiled step,
  near the grouped ``gather_qmm`` reference on the same routing and near the
  stock block (its own bf16 routing).
* ``time``: through MLX, 32 calls per evaluation cycling over 4 layers x 16
  inputs (the weights come from HBM, not L2), N = 1 and 4: the stock block,
  the step's composition uncompiled (router, routing kernel, the two
  kernels), the two kernels on given routing, the gate+up kernel alone and
  the compiled step (the default path); the wrappers' host check of the ids
  off, as in the compiled step.
* ``raw``: the built cubins launched through CuPy in CUDA graphs of 64
  layers (CUDA-event timing): kernel time without MLX's per-node host cost,
  N = 1, 2, 4; plus a 1 GiB device copy for the bandwidth ceiling.

Bytes per layer: the distinct experts of the call x 3 matrices x (packed
weights + bf16 scales + biases) + the shared expert + its gate + x, h, y; at
N = 1 ~15.1 MB. GB/s = bytes / time, against the copy rate measured in the
same process (``raw``) and the H200's :data:`COPY_GBS`. Logs and one JSON per
section go to --out; a summary table is printed last.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.device_script import build_lines, finite, log, rel, run_sections, timed_builds  # noqa: E402
from bench.device_script import timeit as _timeit  # noqa: E402
from bench.moe_cuda import D, E, I, K, make_block  # noqa: E402

COPY_GBS = 3382.0  # H200 device copy rate (read + write), measured through MLX (bench.ceilings)
MAT_BYTES = I * D // 2 + 2 * 2 * I * (D // 64)  # one 4-bit matrix + bf16 scales/biases
GATE_BYTES = D + 2 * 2 * (D // 64)  # 8-bit shared-expert gate
ROUTER_BYTES = E * D + 2 * 2 * E * (D // 64)  # 8-bit router
timeit = partial(_timeit, n=9, batch=32, warm=2)


def _mx():
    import mlx.core as mx

    return mx


def layer_bytes(n_unique: int, n: int) -> int:
    """Bytes a layer must read: distinct experts + shared expert, 3 matrices each, + gate, x, h, y."""
    return (n_unique + 1) * 3 * MAT_BYTES + GATE_BYTES + n * D * 2 * 2 + (K * n + n) * I * 2 * 2


# --------------------------------------------------------------------------
# sections
# --------------------------------------------------------------------------

_BUILD_SNIPPET = r"""
import json, time
t0 = time.perf_counter()
import mlx.core as mx
from mlx_qwen_fast.kernels import _cuda_toolchain
from mlx_qwen_fast.kernels import moe_decode_gemv as md
t1 = time.perf_counter()
res, names = {}, {}
for n in (1, 2, 3, 4):
    for stage in ("gate_up", "down"):
        k = md._kernel(stage, n, 8, 2048, 512, 8)
        t = time.perf_counter(); cub = k.cubin; res[f"{stage}_n{n}"] = time.perf_counter() - t
        names[f"{stage}_n{n}"] = k.name
        open(f"{OUTDIR}/{stage}_n{n}.cubin", "wb").write(cub)
print("BUILDJSON" + json.dumps(dict(import_s=t1 - t0, build_s=res, names=names,
                                    compiler=_cuda_toolchain.compiler_id())))
"""


def section_build(args):
    cubdir = Path(args.out) / "cubins"
    cubdir.mkdir(parents=True, exist_ok=True)
    out = timed_builds(_BUILD_SNIPPET.replace("{OUTDIR}", str(cubdir)), ROOT, tail=1500)
    if shutil.which("cuobjdump"):
        sass = {}
        for f in sorted(cubdir.glob("*.cubin")):
            r = subprocess.run(["cuobjdump", "--dump-sass", str(f)], capture_output=True, text=True)
            lines = r.stdout.splitlines()
            first_mma = next((i for i, ln in enumerate(lines) if "HMMA" in ln), len(lines))
            sass[f.stem] = dict(
                ldg128_before_first_hmma=sum("LDG.E.128" in ln or "LDG.E.ENL2.128" in ln for ln in lines[:first_mma]),
                ldg_total=sum("LDG" in ln for ln in lines), hmma=sum("HMMA" in ln for ln in lines),
                local_mem=sum(("LDL" in ln or "STL" in ln) for ln in lines), instructions=len(lines))
        out["sass"] = sass
        log(f"[build] sass {json.dumps(sass)}")
    return out


def section_check(args):
    mx = _mx()
    from mlx_qwen_fast.kernels import _cuda_build as cb
    from mlx_qwen_fast.kernels import moe_routing as mr
    from mlx_qwen_fast.ops import moe

    cb.set_poison(True)
    block = make_block(5)
    sm = block.switch_mlp
    checks = []
    for n in (1, 2, 3, 4):
        x = (mx.random.normal((1, n, D), key=mx.random.key(400 + n)) * 1.5).astype(mx.bfloat16)
        c = dict(n=n)
        try:
            got = moe.moe_decode(block, x)
            step = moe.sparse_moe(block, x, implementation="cuda-decode")
            tok = x.reshape(n, D)
            inds, scores = mr.route(block.gate(tok), K)
            groups = moe.group_by_expert(inds, E, check_range=False)
            ref = moe.combine(moe.expert_swiglu(tok, groups, sm.gate_proj, sm.up_proj, sm.down_proj),
                              scores, dtype=mx.float32) + moe.shared_expert(block, tok).astype(mx.float32)
            stock = moe.sparse_moe(block, x, implementation="stock")
            c.update(finite=finite(got), step_equals_ops=bool(mx.array_equal(got, step).item()),
                     rel_vs_gather_qmm=rel(got.reshape(n, D), ref), rel_vs_stock=rel(got, stock))
            c["ok"] = (c["finite"] and c["step_equals_ops"] and c["rel_vs_gather_qmm"] < 0.06
                       and c["rel_vs_stock"] < 0.12)
        except Exception as exc:
            c.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:400])
        log(f"[check] {c}")
        checks.append(c)
    cb.set_poison(False)
    return {"checks": checks}


def _unique(inds) -> int:
    import numpy as np

    return len(np.unique(np.asarray(inds)))


def section_time(args):
    mx = _mx()
    import numpy as np

    from mlx_qwen_fast.kernels import moe_decode_gemv as md
    from mlx_qwen_fast.kernels import moe_routing as mr
    from mlx_qwen_fast.ops import moe

    L, R = 4, 16
    blocks = [make_block(10 + i) for i in range(L)]
    arrs = [moe.decode_arrays(b) for b in blocks]
    timings = {}
    for n in (1, 4):
        xs = [(mx.random.normal((1, n, D), key=mx.random.key(1000 * n + r)) * 1.5).astype(mx.bfloat16)
              for r in range(R)]
        routes = [mr.route(blocks[r % L].gate(xs[r].reshape(n, D)), K) for r in range(R)]
        mx.eval(xs, routes)
        nbytes = float(np.mean([layer_bytes(_unique(routes[r][0]), n) for r in range(R)]))
        it = {"i": 0}

        def nxt():
            i = it["i"] = it["i"] + 1
            return i % L, i % R

        def call(impl):
            def fn():
                b, r = nxt()
                return moe.sparse_moe(blocks[b], xs[r], implementation=impl)
            return fn

        # the ids come from the routing kernel: the wrappers' host check of
        # them is off (the unchecked entry point), as in the compiled step
        def eager_step():
            b, r = nxt()
            tok = xs[r].reshape(n, D)
            inds, scores = mr.route(blocks[b].gate(tok), K)
            return md.moe_decode_arrays_unchecked(tok, inds, scores, *arrs[b])

        def kernels_only():
            b, r = nxt()
            return md.moe_decode_arrays_unchecked(xs[r].reshape(n, D), *routes[r], *arrs[b])

        def gate_up_only():  # the launch alone (gate_up_swiglu would add its id check)
            b, r = nxt()
            return md._launch_gate_up(xs[r].reshape(n, D), routes[r][0], *arrs[b])[0]

        for name, fn, with_router in (
                ("stock block", call("stock"), True),
                ("eager step (router + routing + 2 kernels)", eager_step, True),
                ("2 kernels (routing given)", kernels_only, False),
                ("gate+up kernel only", gate_up_only, False),
                ("compiled step (the default path)", call("cuda-decode"), True)):
            s = timeit(fn)
            b = nbytes * (2 / 3 if "gate+up" in name else 1.0) + (ROUTER_BYTES if with_router else 0)
            gbs = b / s / 1e9
            timings[f"N={n} {name}"] = {"us": s * 1e6, "GBps": gbs, "frac_copy": gbs / COPY_GBS, "bytes": b}
            log(f"[time] N={n} {name:42s} {s * 1e6:8.1f} us  {gbs:7.0f} GB/s  {gbs / COPY_GBS:5.2f} of copy")
    return {"timings": timings}


def _set_smem(cp, fn, nbytes):
    """Let a CuPy-loaded kernel take ``nbytes`` (> 48 KB) of dynamic shared memory."""
    try:
        fn.max_dynamic_shared_size_bytes = nbytes
    except AttributeError:
        cp.cuda.driver.funcSetAttribute(fn.ptr, 8, nbytes)  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


def _graph_us(cp, stream, launches, R, reps=7):
    """Median us per layer of a CUDA graph of ``R`` layers, ``launches(r)`` issuing layer r's kernels."""
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    with stream:
        for r in range(R):
            launches(r)
        stream.synchronize()
        stream.begin_capture()
        for r in range(R):
            launches(r)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        ts = []
        for _ in range(reps):
            e0.record(stream)
            graph.launch(stream)
            e1.record(stream)
            e1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / R)
    return sorted(ts)[len(ts) // 2]


def section_raw(args):
    """Kernel-only times: the built cubins through CuPy, 64 layers per CUDA graph."""
    import cupy as cp
    import numpy as np

    from mlx_qwen_fast.kernels import moe_decode_gemv as md

    cubdir = Path(args.out) / "cubins"
    build = Path(args.out) / "moe_decode_build.json"
    if not build.exists():
        raise SystemExit("raw: run the build section first (its cubins and kernel names)")
    names = json.loads(build.read_text())["cached"]["names"]
    rng = np.random.default_rng(0)

    def bf16_bits(a):
        return cp.asarray((np.asarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16))

    def qmat(lead, O, Kd):
        w = cp.random.randint(0, 2**31, size=(*lead, O, Kd // 8), dtype=cp.int64).astype(cp.uint32) * 2 + 1
        s = rng.uniform(0.002, 0.02, size=(*lead, O, Kd // 64)).astype(np.float32)
        return w, bf16_bits(s), bf16_bits(-8 * s)

    L, R = 4, 64
    layers = [dict(g=qmat((E,), I, D), u=qmat((E,), I, D), d=qmat((E,), D, I),
                   sg=qmat((), I, D), su=qmat((), I, D), sd=qmat((), D, I),
                   gw=cp.random.randint(0, 2**31, size=(1, D // 4), dtype=cp.int64).astype(cp.uint32),
                   gs=bf16_bits(np.full((1, D // 64), 0.01)), gb=bf16_bits(np.full((1, D // 64), -1.0)))
              for _ in range(L)]
    stream = cp.cuda.Stream(non_blocking=True)
    res = {}
    a = cp.empty(1 << 30, dtype=cp.uint8)
    b2 = cp.empty_like(a)
    res["copy_GBps"] = 2 * a.nbytes / (_graph_us(cp, stream, lambda r, a=a, b2=b2: b2.__setitem__(Ellipsis, a), 4)
                                       * 1e-6) / 1e9
    del a, b2
    log(f"[raw] copy 1 GiB: {res['copy_GBps']:.0f} GB/s")
    for n in (1, 2, 4):
        k0 = cp.RawModule(path=str(cubdir / f"gate_up_n{n}.cubin")).get_function(names[f"gate_up_n{n}"])
        k1 = cp.RawModule(path=str(cubdir / f"down_n{n}.cubin")).get_function(names[f"down_n{n}"])
        gus, dnt = md.gate_up_smem_bytes(n), 32 * md.down_warps(n, K, I)
        _set_smem(cp, k0, gus)
        xs = [bf16_bits(rng.standard_normal((n, D))) for _ in range(R)]
        inds = [cp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(n)]).astype(np.int32))
                for _ in range(R)]
        sc = [cp.full((n, K), 1.0 / K, dtype=cp.float32) for _ in range(R)]
        hs = [cp.empty((n * K + n, I), dtype=cp.uint16) for _ in range(R)]
        sgs = [cp.empty((n,), dtype=cp.float32) for _ in range(R)]
        ys = [cp.empty((n, D), dtype=cp.uint16) for _ in range(R)]
        nbytes = float(np.mean([layer_bytes(len(np.unique(cp.asnumpy(i))), n) for i in inds]))

        def gate_up(r):
            ly = layers[r % L]
            k0(((I // 16), n * K + 2, 1), (256, 1, 1),
               (xs[r], inds[r], *ly["g"], *ly["u"], *ly["sg"], *ly["su"], ly["gw"], ly["gs"], ly["gb"], hs[r], sgs[r]),
               shared_mem=gus)

        def down(r):
            ly = layers[r % L]
            k1(((D // 16), 1, 1), (dnt, 1, 1), (hs[r], inds[r], sc[r], sgs[r], *ly["d"], *ly["sd"], ys[r]))

        def both(r):
            gate_up(r)
            down(r)

        with stream:  # h and sgate for the down kernel alone
            for r in range(R):
                both(r)
            stream.synchronize()
        for name, fn, frac in (("gate+up | down", both, 1.0), ("gate+up", gate_up, 2 / 3), ("down", down, 1 / 3)):
            us = _graph_us(cp, stream, fn, R)
            ok = bool(np.isfinite((cp.asnumpy(ys[0]).astype(np.uint32) << 16).view(np.float32)).all())
            gbs = nbytes * frac / us / 1e3
            res[f"N={n} {name}"] = {"us": us, "GBps": gbs, "frac_copy": gbs / COPY_GBS,
                                    "frac_copy_here": gbs / res["copy_GBps"], "y_finite": ok}
            log(f"[raw] N={n} {name:16s} {us:7.2f} us/layer  {gbs:6.0f} GB/s  {gbs / COPY_GBS:5.2f} of {COPY_GBS:.0f}  "
                f"{gbs / res['copy_GBps']:5.2f} of copy here  finite={ok}")
    return {"raw": res}


SECTIONS = {"build": section_build, "check": section_check, "time": section_time, "raw": section_raw}


def main():
    run_sections(__file__, "moe_decode", SECTIONS, summary, __doc__.splitlines()[0],
                 "build,check,time,raw", "unused")


def summary(results):
    lines = ["", "=== decode MoE kernels: summary ==="]
    lines += build_lines(results)
    sass = results.get("build", {}).get("sass")
    if sass:
        lines.append("sass: " + ", ".join(f"{k}: {v['ldg128_before_first_hmma']} LDG.128 before HMMA, "
                                          f"{v['local_mem']} LDL/STL" for k, v in sass.items()))
    ch = results.get("check", {}).get("checks", [])
    bad = [c for c in ch if not c.get("ok")]
    lines.append(f"check: {len(ch) - len(bad)}/{len(ch)} pass" + (f"  FAILED: {bad[:3]}" if bad else ""))
    if ch and not bad:
        lines.append("   worst rel vs gather_qmm %.2e, vs stock %.2e" % (
            max(c["rel_vs_gather_qmm"] for c in ch), max(c["rel_vs_stock"] for c in ch)))
    tm = results.get("time", {}).get("timings", {})
    if tm:
        lines.append(f"{'through MLX, 32 calls/eval':48s} {'us/layer':>9s} {'GB/s':>7s} {'of copy':>8s}")
        for key, v in tm.items():
            lines.append(f"{key:48s} {v['us']:9.1f} {v['GBps']:7.0f} {v['frac_copy']:8.2f}")
    raw = results.get("raw", {}).get("raw", {})
    if raw:
        lines.append(f"{'kernels only (CuPy graph of 64 layers)':48s} {'us/layer':>9s} {'GB/s':>7s} {'of copy':>8s}"
                     f"   copy here: {raw.get('copy_GBps', 0):.0f} GB/s")
        for key, v in raw.items():
            if isinstance(v, dict):
                lines.append(f"{key:48s} {v['us']:9.2f} {v['GBps']:7.0f} {v['frac_copy_here']:8.2f}")
    log("\n".join(lines))


if __name__ == "__main__":
    main()
