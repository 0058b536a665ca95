"""Build, check and time the fused decode MoE kernels (N <= 4 tokens) (device script).

Run on the GPU machine (about 2 minutes):

    source .mlxcuda/boot.sh && PYTHONPATH=. python3 bench/moe_decode_cuda.py --out $OUT

Sections, each in its own process: build (first-use compile into an empty
cubin cache, then a cached load; SASS summary with cuobjdump when present;
the two kernels of ``kernels/moe_decode_gemv.py`` and the one-launch kernel
of ``kernels/moe_decode_fused.py``, plus its timing build), check (fresh
random weights at the model's shape, E = 256, D = 2048, I = 512, k = 8,
N = 1..4; outputs poisoned with NaN; fp32 host reference; the one-launch
kernel through ``tests/test_cuda_moe_decode_fused.check_fused``), time
(through MLX: stock mlx-lm ``Qwen3NextSparseMoeBlock`` vs ``moe_decode`` vs the
two kernels on precomputed routing vs the compiled four-node and one-launch
steps, N = 1 and 4, 32 calls per evaluation over 4 layers x 16 inputs so the
weights come from HBM, not L2), raw (the same cubins launched through CuPy,
64 layers per CUDA graph, CUDA-event timing: kernel time without MLX's
per-node cost; the one-launch kernel's %globaltimer stamps at its phase
points; plus a device copy for the bandwidth ceiling).

Bytes per layer: the distinct experts of the call x 3 matrices x (packed
weights + bf16 scales + biases) + the shared expert + its gate: at N = 1 ~15.1
MB; GB/s = bytes / time, against the measured 3,382 GB/s copy rate. Logs and
a JSON of every number go to --out; a short table is printed last.
"""

from __future__ import annotations

import json
import os
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

E, D, I, K = 256, 2048, 512, 8
COPY_GBS = 3382.0  # measured device copy rate (read + write), the brief's ceiling
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


def make_block(seed):
    """Stock Qwen3NextSparseMoeBlock at full size, 4-bit group 64 (router and shared gate 8-bit), bf16."""
    mx = _mx()
    from tests.moe_blocks import make_block as _make

    return _make(D=D, H=I, E=E, k=K, dtype=mx.bfloat16, router_scale=8.0, seed=seed)


# --------------------------------------------------------------------------
# sections
# --------------------------------------------------------------------------

_BUILD_SNIPPET = r"""
import json, time
t0 = time.perf_counter()
import mlx.core as mx
from mlx_qwen_fast.kernels import _cuda_build as cb
from mlx_qwen_fast.kernels import moe_decode_gemv as md
t1 = time.perf_counter()
res, names = {}, {}
for n in (1, 2, 3, 4):
    for kind in (0, 1):
        k = md._kernel(kind, n, 8, 2048, 512, 8)
        t = time.perf_counter(); cub = k.cubin; res[f"k{kind}_n{n}"] = time.perf_counter() - t
        names[f"k{kind}_n{n}"] = k.name
        open(f"{OUTDIR}/k{kind}_n{n}.cubin", "wb").write(cub)
for tag, kind, extra in (("k0t", 0, dict(MDG_TIMING=1)), ("k1t", 1, dict(MDG_TIMING=1)), ("k1w8", 1, dict(MDG_DNW=8)),
                         ("k1w8t", 1, dict(MDG_DNW=8, MDG_TIMING=1))):
    k = md._kernel(kind, 1, 8, 2048, 512, 8)
    kx = cb.CudaKernel("moe_decode_gemv.cu", k.base_name + "_" + tag, dict(k.defines, **extra))
    names[f"{tag}_n1"] = kx.name
    open(f"{OUTDIR}/{tag}_n1.cubin", "wb").write(kx.cubin)
from mlx_qwen_fast.kernels import moe_decode_fused as mf
for n in (1, 2, 4):
    k = mf._kernel(n, 8, 256, 2048, 512, 8, 8, True)
    t = time.perf_counter(); cub = k.cubin; res[f"fused_n{n}"] = time.perf_counter() - t
    names[f"fused_n{n}"] = k.name
    open(f"{OUTDIR}/fused_n{n}.cubin", "wb").write(cub)
    for tag, extra in (("fusedt", dict(MDG_TIMING=1)),):
        kx = cb.CudaKernel("moe_decode_fused.cu", "mqf_moe_dec_" + tag, dict(k.defines, **extra))
        names[f"{tag}_n{n}"] = kx.name
        open(f"{OUTDIR}/{tag}_n{n}.cubin", "wb").write(kx.cubin)
print("BUILDJSON" + json.dumps(dict(import_s=t1 - t0, build_s=res, names=names, compiler=cb.compiler_id())))
"""


def section_build(args):
    cubdir = Path(args.out) / "cubins"
    cubdir.mkdir(parents=True, exist_ok=True)
    out = timed_builds(_BUILD_SNIPPET.replace("{OUTDIR}", str(cubdir)), ROOT, tail=1500)
    # SASS: registers, loads issued before the first HMMA, local memory
    if shutil.which("cuobjdump"):
        sass = {}
        for f in sorted(cubdir.glob("*.cubin")):
            r = subprocess.run(["cuobjdump", "--dump-sass", str(f)], capture_output=True, text=True)
            lines = r.stdout.splitlines()
            first_mma = next((i for i, l in enumerate(lines) if "HMMA" in l), len(lines))
            sass[f.stem] = dict(
                ldg128_before_first_hmma=sum("LDG.E.128" in l or "LDG.E.ENL2.128" in l for l in lines[:first_mma]),
                ldg_total=sum("LDG" in l for l in lines), hmma=sum("HMMA" in l for l in lines),
                local_mem=sum(("LDL" in l or "STL" in l) for l in lines), instructions=len(lines))
            (cubdir / f"{f.stem}.sass").write_text(r.stdout)
        out["sass"] = sass
        log(f"[build] sass {json.dumps(sass)}")
    return out


def section_check(args):
    mx = _mx()
    from mlx_qwen_fast.kernels import _cuda_build as cb
    from mlx_qwen_fast.kernels import moe_decode_gemv as md

    sys.path.insert(0, str(ROOT / "tests"))
    import test_cuda_moe_decode as t  # noqa: E402  (array builders and routing)

    cb.set_poison(True)
    experts, shared, eg = t.make_arrays(E, D, I, seed=1)
    checks = []
    for n in (1, 2, 3, 4):
        for special in (True, False):
            x = t.x_tokens(n, D, 200 + n)
            inds, scores = t.make_routing(n, K, E, 300 + n, special=special)
            h, sg = md.gate_up_swiglu(x, inds, experts, shared, eg)
            y = md.down_combine(h, inds, scores, sg, experts[2], shared[2])
            mx.eval(h, sg, y)
            h_ref, sg_ref, y_ref = md.reference(x, inds, scores, experts, shared, eg)
            y2 = md.moe_decode_arrays(x, inds, scores, experts, shared, eg)
            c = dict(n=n, dup_experts=special, finite=finite(h) and finite(sg) and finite(y),
                     rel_h=rel(h, mx.array(h_ref)), rel_y=rel(y, mx.array(y_ref)),
                     sgate_maxabs=float(abs(t.npa(sg) - sg_ref).max()),
                     deterministic=bool(mx.array_equal(y, y2).item()))
            c["ok"] = (c["finite"] and c["rel_h"] < 2 * t.BF16_EPS and c["rel_y"] < 2 * t.BF16_EPS
                       and c["sgate_maxabs"] < 4e-3 and c["deterministic"])
            log(f"[check] {c}")
            checks.append(c)
    # the whole block vs the stock block (same module, its own routing)
    from mlx_qwen_fast.ops import moe

    block = make_block(5)
    for n in (1, 4):
        x = t.x_tokens(n, D, 400 + n)
        got = md.moe_decode(block, x)
        stock = moe.sparse_moe(block, x, implementation="stock")
        c = dict(n=n, block=True, finite=finite(got), rel_vs_stock=rel(got, stock))
        c["ok"] = c["finite"] and c["rel_vs_stock"] < 0.12
        log(f"[check] {c}")
        checks.append(c)
    # the one-launch kernel (kernels/moe_decode_fused.py) at full size, its own routing
    import test_cuda_moe_decode_fused as tf  # noqa: E402

    for n in (1, 2, 3, 4):
        c = dict(n=n, fused=True)
        try:
            tf.check_fused(n, E=E, seed=500 + n)  # asserts: bits vs the two kernels, rel vs fp32
            c["ok"] = True
        except AssertionError as e:
            c.update(ok=False, error=str(e)[:300])
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

    from mlx_qwen_fast.kernels import moe_decode_fused as mf
    from mlx_qwen_fast.kernels import moe_decode_gemv as md
    from mlx_qwen_fast.kernels import moe_routing as mr
    from mlx_qwen_fast.ops import moe

    L, R = 4, 16
    blocks = [make_block(10 + i) for i in range(L)]
    arrs = [md.block_arrays(b) for b in blocks]
    timings = {}
    for n in (1, 4):
        xs = [(mx.random.normal((1, n, D), key=mx.random.key(1000 * n + r)) * 1.5).astype(mx.bfloat16) for r in range(R)]
        routes = [mr.route(blocks[r % L].gate(xs[r].reshape(n, D)), K) for r in range(R)]
        mx.eval(xs, routes)
        nbytes = float(np.mean([layer_bytes(_unique(routes[r][0]), n) for r in range(R)]))
        it = {"i": 0}

        def nxt():
            i = it["i"] = it["i"] + 1
            return i % L, i % R

        def stock():
            b, r = nxt()
            return moe.sparse_moe(blocks[b], xs[r], implementation="stock")

        def fused():
            b, r = nxt()
            return md.moe_decode(blocks[b], xs[r])

        def kernels_only():
            b, r = nxt()
            return md.moe_decode_arrays(xs[r].reshape(n, D), *routes[r], *arrs[b])

        def gate_up_only():
            b, r = nxt()
            return md.gate_up_swiglu(xs[r].reshape(n, D), routes[r][0], *arrs[b])[0]

        def step(env):
            def fn():
                os.environ[mf.FUSED_ENV] = env
                b, r = nxt()
                return md.moe_decode_step(blocks[b], xs[r])
            return fn

        for name, fn in (("stock_block", stock), ("moe_decode(router+route+2 kernels)", fused),
                         ("2 kernels (routing given)", kernels_only), ("gate_up kernel only", gate_up_only),
                         ("step: 4 nodes, compiled", step("0")), ("step: 1 launch (fused), compiled", step("1")),
                         ("step: 4 nodes, compiled (again)", step("0")),
                         ("step: 1 launch (fused), compiled (again)", step("1"))):
            s = timeit(fn)
            b = nbytes * (2 / 3 if "gate_up" in name else 1.0) + (ROUTER_BYTES if ("step" in name or "router" in name) else 0)
            gbs = b / s / 1e9
            timings[f"N={n} {name}"] = {"us": s * 1e6, "GBps": gbs, "frac_copy": gbs / COPY_GBS, "bytes": b}
            log(f"[time] N={n} {name:40s} {s * 1e6:8.1f} us  {gbs:7.0f} GB/s  {gbs / COPY_GBS:5.2f} of copy")
    return {"timings": timings}


def _set_smem(cp, fn, nbytes):
    """Let a CuPy-loaded kernel take ``nbytes`` (> 48 KB) of dynamic shared memory."""
    try:
        fn.max_dynamic_shared_size_bytes = nbytes
    except AttributeError:
        cp.cuda.driver.funcSetAttribute(fn.ptr, 8, nbytes)  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


def section_raw(args):
    """Kernel-only times: the built cubins through CuPy, 64 layers per CUDA graph."""
    import cupy as cp
    import numpy as np

    from mlx_qwen_fast.kernels import moe_decode_fused as mf
    from mlx_qwen_fast.kernels import moe_decode_gemv as md

    cubdir = Path(args.out) / "cubins"
    names = json.loads((Path(args.out) / "moe_decode_build.json").read_text())["cached"]["names"]
    rng = np.random.default_rng(0)

    def bf16_bits(a):
        return cp.asarray((np.asarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16))

    def qmat(lead, O, Kd):
        w = cp.random.randint(0, 2**31, size=(*lead, O, Kd // 8), dtype=cp.int64).astype(cp.uint32) * 2 + 1
        s = rng.uniform(0.002, 0.02, size=(*lead, O, Kd // 64)).astype(np.float32)
        return w, bf16_bits(s), bf16_bits(-8 * s)

    L = 4
    layers = []
    for _ in range(L):
        layers.append(dict(g=qmat((E,), I, D), u=qmat((E,), I, D), d=qmat((E,), D, I),
                           sg=qmat((), I, D), su=qmat((), I, D), sd=qmat((), D, I),
                           gw=cp.random.randint(0, 2**31, size=(1, D // 4), dtype=cp.int64).astype(cp.uint32),
                           gs=bf16_bits(np.full((1, D // 64), 0.01)), gb=bf16_bits(np.full((1, D // 64), -1.0))))
    res = {}
    # copy ceiling: 1 GiB device-to-device, read + write counted
    a = cp.empty(1 << 30, dtype=cp.uint8)
    b2 = cp.empty_like(a)
    for _ in range(3):
        b2[...] = a
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    e0.record()
    for _ in range(10):
        b2[...] = a
    e1.record()
    e1.synchronize()
    res["copy_GBps"] = 2 * a.nbytes * 10 / (cp.cuda.get_elapsed_time(e0, e1) * 1e-3) / 1e9
    del a, b2
    log(f"[raw] copy {res['copy_GBps']:.0f} GB/s")

    G = cp.cuda.Device().attributes["MultiProcessorCount"]
    for ly in layers:  # 8-bit router [E, D/4]
        ly["r"] = (cp.random.randint(0, 2**31, size=(E, D // 4), dtype=cp.int64).astype(cp.uint32),
                   bf16_bits(rng.uniform(0.002, 0.02, size=(E, D // 64))), bf16_bits(np.full((E, D // 64), -0.5)))
    for n in (1, 2, 4):
        k0 = cp.RawModule(path=str(cubdir / f"k0_n{n}.cubin")).get_function(names[f"k0_n{n}"])
        k1 = cp.RawModule(path=str(cubdir / f"k1_n{n}.cubin")).get_function(names[f"k1_n{n}"])
        kf = cp.RawModule(path=str(cubdir / f"fused_n{n}.cubin")).get_function(names[f"fused_n{n}"])
        smf = mf.smem_bytes(n, K, D, I)
        _set_smem(cp, kf, smf)
        _set_smem(cp, k0, md.gate_up_smem_bytes(n))
        R = 64
        xs = [bf16_bits(rng.standard_normal((n, D))) for _ in range(R)]
        inds = [cp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(n)]).astype(np.int32)) for _ in range(R)]
        sc = [cp.full((n, K), 1.0 / K, dtype=cp.float32) for _ in range(R)]
        hs = [cp.empty((n * K + n, I), dtype=cp.uint16) for _ in range(R)]
        sgs = [cp.empty((n,), dtype=cp.float32) for _ in range(R)]
        ys = [cp.empty((n, D), dtype=cp.uint16) for _ in range(R)]
        sync = cp.zeros((64,), dtype=cp.uint32)
        fo = [(cp.empty((n, E), dtype=cp.float32), cp.empty((n, K), dtype=cp.int32), cp.empty((n, K), dtype=cp.float32))
              for _ in range(R)]
        nbytes = float(np.mean([layer_bytes(len(np.unique(cp.asnumpy(i))), n) for i in inds]))

        def launch(which, r):
            ly = layers[r % L]
            if which in ("both", "k0"):
                k0(((I // 16), n * K + 2, 1), (256, 1, 1),
                   (xs[r], inds[r], *ly["g"], *ly["u"], *ly["sg"], *ly["su"], ly["gw"], ly["gs"], ly["gb"], hs[r], sgs[r]),
                   shared_mem=md.gate_up_smem_bytes(n))
            if which in ("both", "k1"):
                k1(((D // 16), 1, 1), (32 * md.down_warps(n, K, I), 1, 1),
                   (hs[r], inds[r], sc[r], sgs[r], *ly["d"], *ly["sd"], ys[r]))
            if which == "fused":
                kf((G, 1, 1), (256, 1, 1), (xs[r], *ly["r"], *ly["g"], *ly["u"], *ly["d"], *ly["sg"], *ly["su"],
                                            *ly["sd"], ly["gw"], ly["gs"], ly["gb"], sync, ys[r], *fo[r], hs[r], sgs[r]),
                   shared_mem=smf)

        stream = cp.cuda.Stream(non_blocking=True)
        for which, frac in (("both", 1.0), ("k0", 2 / 3), ("k1", 1 / 3), ("fused", 1.0), ("both", 1.0), ("fused", 1.0)):
            with stream:
                for r in range(R):
                    launch("both", r)  # warm-up, and h / sgate for k1 alone
                stream.synchronize()
                stream.begin_capture()
                for r in range(R):
                    launch(which, r)
                graph = stream.end_capture()
                graph.launch(stream)
                stream.synchronize()
                ts = []
                for _ in range(7):
                    e0.record(stream)
                    graph.launch(stream)
                    e1.record(stream)
                    e1.synchronize()
                    ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1e-3 / R)
            s = sorted(ts)[len(ts) // 2]
            ok = bool(np.isfinite((cp.asnumpy(ys[0]).astype(np.uint32) << 16).view(np.float32)).all())
            b = nbytes * frac + (ROUTER_BYTES if which.startswith("fused") else 0)
            gbs = b / s / 1e9
            key = f"N={n} {which}" + (" (again)" if f"N={n} {which}" in res else "")
            res[key] = {"us": s * 1e6, "GBps": gbs, "frac_copy": gbs / COPY_GBS, "y_finite": ok,
                        "frac_copy_here": gbs / res["copy_GBps"]}
            if which.startswith("fused"):
                st = cp.asnumpy(sync)
                res[key]["sync_count_zero"] = bool(st[0] == 0)
            log(f"[raw] N={n} {which:10s} {s * 1e6:7.2f} us/layer  {gbs:6.0f} GB/s  {gbs / COPY_GBS:5.2f} of 3382  "
                f"{gbs / res['copy_GBps']:5.2f} of copy here  finite={ok}")
        # phase times of the one-launch kernel (timing build: %globaltimer at 8 points per CTA)
        kt = cp.RawModule(path=str(cubdir / f"fusedt_n{n}.cubin")).get_function(names[f"fusedt_n{n}"])
        _set_smem(cp, kt, smf)
        tim = cp.zeros((R, G, 8), dtype=cp.uint64)
        with stream:
            for rep in range(2):
                for r in range(R):
                    ly = layers[r % L]
                    kt((G, 1, 1), (256, 1, 1), (xs[r], *ly["r"], *ly["g"], *ly["u"], *ly["d"], *ly["sg"], *ly["su"],
                                                *ly["sd"], ly["gw"], ly["gs"], ly["gb"], sync, ys[r], *fo[r], hs[r],
                                                sgs[r], tim[r]), shared_mem=smf)
            stream.synchronize()
        t = cp.asnumpy(tim).astype(np.int64)
        t = t - t[:, :, 0].min(axis=1)[:, None, None]  # ns from the first CTA's start, per launch
        names_p = ["start", "x staged", "phase A done", "barrier 1", "routed", "gate+up done", "barrier 2", "end"]
        ph = {}
        for i, nm in enumerate(names_p):
            ti = t[:, : D // 16, i] if i == 7 else t[:, :, i]  # CTAs past D/16 stop after barrier 2
            ph[nm] = {"min_us": float(np.median(ti.min(1))) / 1e3, "median_us": float(np.median(np.median(ti, 1))) / 1e3,
                      "max_us": float(np.median(ti.max(1))) / 1e3}
        res[f"N={n} fused phases"] = ph
        log(f"[raw] N={n} fused phases (median over {R} launches of min/median/max over CTAs, us): "
            + "; ".join(f"{k} {v['min_us']:.2f}/{v['median_us']:.2f}/{v['max_us']:.2f}" for k, v in ph.items()))
    return {"raw": res}


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


def _phases(us, base, points):
    """Phase stamps -> {name: [min, median, max] over CTAs (medians over layers), us after ``base``}.

    ``points``: (name, stamps [layers, CTAs, 8] int64 ns, slot); ``base``
    [layers, 1] ns; the graph's ``us`` per layer is kept as "us/layer"."""
    import numpy as np

    ph = {"us/layer": us}
    for nm, arr, i in points:
        v = (arr[:, :, i] - base) / 1e3
        ph[nm] = [float(np.median(v.min(1))), float(np.median(np.median(v, 1))), float(np.median(v.max(1)))]
    return ph


def _phase_text(ph) -> str:
    return "; ".join(f"{k} {v[0]:.2f}/{v[1]:.2f}/{v[2]:.2f}" for k, v in ph.items() if isinstance(v, list))


# bytes of the read floor's parts (bench/cuda/decode_read_floor.cu, N = 1, k = 8)
FLOOR_BYTES = {"router": 16 * (16 * 2048 + 16 * 32 * 4), "gu": 32 * 9 * (32768 + 2 * 16 * 32 * 4),
               "dn": 128 * 9 * (16 * 256 + 16 * 8 * 4)}


DEP_SMEM = 128 * 1024 + 2 * 1024  # decode_dep_floor.cu's SMEM_BYTES (129,856) rounded up


def section_floor(args):
    """One token: a read-only kernel over the block's bytes (the floor) vs the decode kernels, 4 and 40 layers.

    ``bench/cuda/decode_read_floor.cu`` reads what the router, the gate+up and
    the down kernels read, with their CTAs and 16-byte lane addresses, and
    computes nothing. Each variant is a CuPy CUDA graph of 64 layers cycling
    over L layers' weights (uninitialised memory: neither kernel's time
    depends on the values); L = 40 is the model's layer count (no layer's
    experts in L2 when it comes round again). Needs the build section's cubins.
    """
    import cupy as cp
    import numpy as np

    from mlx_qwen_fast.kernels import _cuda_build as cb

    cubdir = Path(args.out) / "cubins"
    cubdir.mkdir(parents=True, exist_ok=True)
    names = json.loads((Path(args.out) / "moe_decode_build.json").read_text())["cached"]["names"]
    src = str(ROOT / "bench" / "cuda" / "decode_read_floor.cu")
    fns = {}
    for tag, defs in (("probe", {}), ("static", {"PROBE_STATIC": 1}), ("linear", {"PROBE_LINEAR": 1})):
        kb = cb.CudaKernel(src, "mqf_read_floor_" + tag, defs)
        (cubdir / f"floor_{tag}.cubin").write_bytes(kb.cubin)
        fns[tag] = cp.RawModule(path=str(cubdir / f"floor_{tag}.cubin")).get_function(kb.name)
    # the dependent floor (one launch, grid barriers, routing): DEP_BARRIERS / DEP_ROUTE builds
    dsrc = str(ROOT / "bench" / "cuda" / "decode_dep_floor.cu")
    deps = {}
    for tag, defs in (("b0", {"DEP_BARRIERS": 0, "DEP_ROUTE": 0}), ("b1", {"DEP_BARRIERS": 1, "DEP_ROUTE": 1}),
                      ("b2", {"DEP_BARRIERS": 2, "DEP_ROUTE": 1}), ("b2s", {"DEP_BARRIERS": 2, "DEP_ROUTE": 0}),
                      ("f", {"DEP_FLAGS": 1, "DEP_ROUTE": 1}), ("fs", {"DEP_FLAGS": 1, "DEP_ROUTE": 0})):
        kb = cb.CudaKernel(dsrc, "mqf_dep_floor_" + tag, defs)
        (cubdir / f"dep_{tag}.cubin").write_bytes(kb.cubin)
        deps[tag] = cp.RawModule(path=str(cubdir / f"dep_{tag}.cubin")).get_function(kb.name)
        _set_smem(cp, deps[tag], DEP_SMEM)
    k0 = cp.RawModule(path=str(cubdir / "k0_n1.cubin")).get_function(names["k0_n1"])
    k1 = cp.RawModule(path=str(cubdir / "k1_n1.cubin")).get_function(names["k1_n1"])
    kf = cp.RawModule(path=str(cubdir / "fused_n1.cubin")).get_function(names["fused_n1"])
    from mlx_qwen_fast.kernels import moe_decode_fused as mf
    from mlx_qwen_fast.kernels import moe_decode_gemv as md

    smf = mf.smem_bytes(1, K, D, I)
    _set_smem(cp, kf, smf)
    gus, dnt = md.gate_up_smem_bytes(1), 32 * md.down_warps(1, K, I)
    rng = np.random.default_rng(1)
    R, n = 64, 1
    res = {}
    a = cp.empty(1 << 30, dtype=cp.uint8)
    b2 = cp.empty_like(a)
    stream = cp.cuda.Stream(non_blocking=True)
    res["copy_GBps"] = 2 * a.nbytes / (_graph_us(cp, stream, lambda r: b2.__setitem__(Ellipsis, a), 4) * 1e-6) / 1e9
    del a, b2
    log(f"[floor] copy 1 GiB: {res['copy_GBps']:.0f} GB/s")
    total = sum(FLOOR_BYTES.values())
    for L in (4, 40):
        def q(lead, O, Kd, bits=4):
            return (cp.empty((*lead, O, Kd * bits // 32), cp.uint32), cp.empty((*lead, O, Kd // 64), cp.uint16),
                    cp.empty((*lead, O, Kd // 64), cp.uint16))
        layers = [dict(r=q((), E, D, 8), g=q((E,), I, D), u=q((E,), I, D), d=q((E,), D, I), sg=q((), I, D),
                       su=q((), I, D), sd=q((), D, I), gw=cp.empty((1, D // 4), cp.uint32),
                       gs=cp.empty((1, D // 64), cp.uint16), gb=cp.empty((1, D // 64), cp.uint16),
                       lin=cp.empty(432 * 32768, cp.uint8), cpy=cp.empty(total, cp.uint8)) for _ in range(L)]
        inds = [cp.asarray(rng.choice(E, K, replace=False).astype(np.int32)[None]) for _ in range(R)]
        out = cp.zeros(432 * 256, cp.uint32)
        dst = cp.empty(total, cp.uint8)
        xs = [cp.zeros((n, D), cp.uint16) for _ in range(R)]
        hs = [cp.empty((n * K + n, I), cp.uint16) for _ in range(R)]
        sgs = [cp.zeros((n,), cp.float32) for _ in range(R)]
        ys = [cp.empty((n, D), cp.uint16) for _ in range(R)]
        sc = [cp.full((n, K), 1.0 / K, dtype=cp.float32) for _ in range(R)]
        sync = cp.zeros((64,), dtype=cp.uint32)
        fo = [(cp.empty((n, E), cp.float32), cp.empty((n, K), cp.int32), cp.empty((n, K), cp.float32)) for _ in range(R)]

        def probe(tag, cta0, grid):
            def go(r):
                ly = layers[r % L]
                fns[tag]((grid, 1, 1), (256, 1, 1), (ly["lin"] if tag == "linear" else ly["r"][0], *ly["r"][1:],
                                                     *ly["g"], *ly["u"], *ly["d"], *ly["sg"], *ly["su"], *ly["sd"],
                                                     inds[r], np.int32(cta0), out))
            return go

        def real(which):
            def go(r):
                ly = layers[r % L]
                if which == "k0":
                    k0(((I // 16), n * K + 2, 1), (256, 1, 1), (xs[r], inds[r], *ly["g"], *ly["u"], *ly["sg"],
                                                                *ly["su"], ly["gw"], ly["gs"], ly["gb"], hs[r], sgs[r]),
                       shared_mem=gus)
                elif which == "k1":
                    k1(((D // 16), 1, 1), (dnt, 1, 1), (hs[r], inds[r], sc[r], sgs[r], *ly["d"], *ly["sd"], ys[r]))
                else:
                    kf((cb.sm_count(), 1, 1), (256, 1, 1),
                       (xs[r], *ly["r"], *ly["g"], *ly["u"], *ly["d"], *ly["sg"], *ly["su"], *ly["sd"], ly["gw"],
                        ly["gs"], ly["gb"], sync, ys[r], *fo[r], hs[r], sgs[r]), shared_mem=smf)
            return go

        kx = {tag: cp.RawModule(path=str(cubdir / f"{tag}_n1.cubin")).get_function(names[f"{tag}_n1"])
              for tag in ("k0t", "k1t", "k1w8", "k1w8t")}
        tim0 = cp.zeros((R, 320, 8), cp.uint64)
        tim1 = cp.zeros((R, 128, 8), cp.uint64)

        def real_x(tag, stamps=False):
            """The N = 1 benchmark builds: timing (stamps into tim0 / tim1) and the 8-warp down."""
            def go(r):
                ly = layers[r % L]
                if tag == "k0t":
                    kx[tag](((I // 16), n * K + 2, 1), (256, 1, 1),
                            (xs[r], inds[r], *ly["g"], *ly["u"], *ly["sg"], *ly["su"], ly["gw"], ly["gs"], ly["gb"],
                             hs[r], sgs[r], tim0[r]), shared_mem=gus)
                else:
                    nt = 256 if tag.startswith("k1w8") else dnt
                    kx[tag](((D // 16), 1, 1), (nt, 1, 1), (hs[r], inds[r], sc[r], sgs[r], *ly["d"], *ly["sd"], ys[r],
                                                            *((tim1[r],) if stamps else ())))
            return go

        dsync = {tag: cp.zeros((64,), dtype=cp.uint32) for tag in deps}
        dlog, dh = {t: cp.zeros((E,), cp.uint64) for t in deps}, {t: cp.zeros(((K + 1) * I,), cp.uint32) for t in deps}
        dtim = cp.zeros((R, 128, 8), cp.uint64)

        def dep(tag):
            def go(r):
                ly = layers[r % L]
                deps[tag]((128, 1, 1), (256, 1, 1), (*ly["r"], *ly["g"], *ly["u"], *ly["d"], *ly["sg"], *ly["su"],
                                                     *ly["sd"], inds[r], np.uint32(r * 7919 + L), dlog[tag], dh[tag],
                                                     dsync[tag], out, dtim[r]), shared_mem=DEP_SMEM)
            return go

        timf = cp.zeros((R, cb.sm_count(), 8), cp.uint64)
        kft = cp.RawModule(path=str(cubdir / "fusedt_n1.cubin")).get_function(names["fusedt_n1"])
        _set_smem(cp, kft, smf)

        def fused_t(r):
            ly = layers[r % L]
            kft((cb.sm_count(), 1, 1), (256, 1, 1),
                (xs[r], *ly["r"], *ly["g"], *ly["u"], *ly["d"], *ly["sg"], *ly["su"], *ly["sd"], ly["gw"],
                 ly["gs"], ly["gb"], sync, ys[r], *fo[r], hs[r], sgs[r], timf[r]), shared_mem=smf)

        def seq(*fs):
            return lambda r: [f(r) for f in fs]

        B = FLOOR_BYTES
        variants = [
            ("floor: router", probe("probe", 0, 16), B["router"]),
            ("floor: gate+up", probe("probe", 16, 288), B["gu"]),
            ("floor: down", probe("probe", 304, 128), B["dn"]),
            ("floor: all, 1 kernel", probe("probe", 0, 432), total),
            ("floor: all, 1 kernel, static ids", probe("static", 0, 432), total),
            ("floor: gate+up | down", seq(probe("probe", 16, 288), probe("probe", 304, 128)), B["gu"] + B["dn"]),
            ("floor: router+gate+up | down", seq(probe("probe", 0, 304), probe("probe", 304, 128)), total),
            ("floor: router | gate+up | down", seq(probe("probe", 0, 16), probe("probe", 16, 288),
                                                   probe("probe", 304, 128)), total),
            ("floor: contiguous 14.2 MB, lane-linear", probe("linear", 0, 432), 432 * 32768),
            ("dep floor: 1 launch, no barrier, static ids", dep("b0"), total),
            ("dep floor: router | barrier | routed", dep("b1"), total),
            ("dep floor: + barrier before down", dep("b2"), total),
            ("dep floor: 2 barriers, ids read (no top-k)", dep("b2s"), total),
            ("dep floor: flags in the data (no barrier)", dep("f"), total),
            ("dep floor: flags in the data, ids read", dep("fs"), total),
            ("copy 16.5 MB (read bytes)", lambda r: dst.__setitem__(Ellipsis, layers[r % L]["cpy"]), total),
            ("kernel: gate+up (k0)", real("k0"), B["gu"]),
            ("kernel: down (k1)", real("k1"), B["dn"]),
            ("kernel: gate+up | down", seq(real("k0"), real("k1")), B["gu"] + B["dn"]),
            ("kernel: one launch (router incl.)", real("fused"), total),
            ("kernel: down, 8 warps", real_x("k1w8"), B["dn"]),
            ("kernel: gate+up | down, 8 warps", seq(real("k0"), real_x("k1w8")), B["gu"] + B["dn"]),
            ("floor: all, 1 kernel (again)", probe("probe", 0, 432), total),
            ("kernel: gate+up | down (again)", seq(real("k0"), real("k1")), B["gu"] + B["dn"]),
        ]
        for name, fn, nb in variants:
            us = _graph_us(cp, stream, fn, R)
            gbs = nb / us / 1e3
            res[f"L={L} {name}"] = {"us": us, "bytes": nb, "GBps": gbs, "frac_copy": gbs / COPY_GBS,
                                    "frac_copy_here": gbs / res["copy_GBps"]}
            log(f"[floor] L={L:2d} {name:42s} {us:7.2f} us/layer  {nb / 1e6:5.2f} MB  {gbs:6.0f} GB/s  "
                f"{gbs / COPY_GBS:5.2f} of 3382  {gbs / res['copy_GBps']:5.2f} of copy here")
        res[f"L={L} out_untouched"] = bool(int(cp.count_nonzero(out)) == 0)
        # phase stamps: the timing builds of both kernels in one graph (ns from the first
        # CTA start of the layer's gate+up kernel; median over layers of min/median/max over CTAs)
        for k1tag in ("k1t", "k1w8t"):
            us = _graph_us(cp, stream, seq(real_x("k0t"), real_x(k1tag, stamps=True)), R)
            t0 = cp.asnumpy(tim0).astype(np.int64)[:, : 32 * (n * K + 1)]  # routed + shared CTAs
            t1 = cp.asnumpy(tim1).astype(np.int64)
            ph = _phases(us, t0[:, :, 0].min(axis=1)[:, None], (
                ("k0 start", t0, 0), ("k0 expert known", t0, 1), ("k0 weights in", t0, 2), ("k0 dots done", t0, 3),
                ("k0 all warps", t0, 4), ("k0 h stored", t0, 5), ("k1 start", t1, 0), ("k1 weights requested", t1, 1),
                ("k1 h staged", t1, 2), ("k1 first item", t1, 3), ("k1 warp 0 done", t1, 4),
                ("k1 all warps", t1, 5), ("k1 y stored", t1, 6)))
            res[f"L={L} phases ({k1tag})"] = ph
            log(f"[floor] L={L:2d} phases, k0t | {k1tag} ({us:.2f} us/layer; us from k0's first CTA, "
                "min/median/max over CTAs): " + _phase_text(ph))
        # phase stamps of the dependent floor (2 barriers, routing) and of the one-launch kernel
        dpts = ("start", "router in", "logits in", "routed", "gate+up in", "h in", "down in", "end")
        for nm_k, fn, tim, pts in (
                ("dep floor b2", dep("b2"), dtim, dpts), ("dep floor f", dep("f"), dtim, dpts),
                ("one launch (fusedt)", fused_t, timf, ("start", "x staged", "router done", "barrier 1 out",
                                                        "routed+issued", "gate+up done", "barrier 2 out", "end"))):
            us = _graph_us(cp, stream, lambda r: fn(r), R)
            t = cp.asnumpy(tim).astype(np.int64)
            ph = _phases(us, t[:, :, 0].min(axis=1)[:, None], [(nm, t, i) for i, nm in enumerate(pts)])
            res[f"L={L} phases ({nm_k})"] = ph
            log(f"[floor] L={L:2d} phases, {nm_k} ({us:.2f} us/layer; us from the first CTA's start, "
                "min/median/max over CTAs): " + _phase_text(ph))
        del layers, variants
        cp.get_default_memory_pool().free_all_blocks()
    return {"floor": res}


SECTIONS = {"build": section_build, "check": section_check, "time": section_time, "raw": section_raw,
            "floor": section_floor}


def main():
    run_sections(__file__, "moe_decode", SECTIONS, summary, __doc__.splitlines()[0],
                 "build,check,time,raw", "unused")


def summary(results):
    lines = ["", "=== fused decode MoE kernels: summary ==="]
    lines += build_lines(results)
    sass = results.get("build", {}).get("sass")
    if sass:
        lines.append("sass: " + ", ".join(f"{k}: {v['ldg128_before_first_hmma']} LDG.128 before HMMA, "
                                          f"{v['local_mem']} LDL/STL" for k, v in sass.items()))
    ch = results.get("check", {}).get("checks", [])
    bad = [c for c in ch if not c.get("ok")]
    lines.append(f"check: {len(ch) - len(bad)}/{len(ch)} pass" + (f"  FAILED: {bad[:3]}" if bad else ""))
    if ch:
        lines.append("   worst rel_h %.2e rel_y %.2e; block vs stock %s" % (
            max(c.get("rel_h", 0) for c in ch), max(c.get("rel_y", 0) for c in ch),
            [round(c["rel_vs_stock"], 4) for c in ch if "rel_vs_stock" in c]))
    lines.append(f"{'variant (through MLX, 32 calls/eval)':48s} {'us/layer':>9s} {'GB/s':>7s} {'of 3382':>8s}")
    for key, v in results.get("time", {}).get("timings", {}).items():
        lines.append(f"{key:48s} {v['us']:9.1f} {v['GBps']:7.0f} {v['frac_copy']:8.2f}")
    def graph_table(title, w, rows, phase_text):
        """A CuPy-graph section: a header, a row per timed variant, a line per phase dict."""
        if not rows:
            return
        lines.append(f"{title:{w}s} {'us/layer':>9s} {'GB/s':>7s} {'of 3382':>8s}"
                     f"   copy here: {rows.get('copy_GBps', 0):.0f} GB/s")
        for key, v in rows.items():
            if isinstance(v, dict) and "us" in v:
                lines.append(f"{key:{w}s} {v['us']:9.2f} {v['GBps']:7.0f} {v['frac_copy']:8.2f}")
            elif isinstance(v, dict):
                lines.append(f"{key}: " + "; ".join(phase_text(k, p) for k, p in v.items()))

    graph_table("kernel only (CuPy graph of 64 layers)", 48, results.get("raw", {}).get("raw", {}),
                lambda k, p: f"{k} {p['median_us']:.2f} (max {p['max_us']:.2f})")
    graph_table("read floor vs kernels, N = 1 (CuPy graph of 64 layers)", 52, results.get("floor", {}).get("floor", {}),
                lambda k, p: f"{k} {p[1]:.2f}" if isinstance(p, list) else f"{k} {p:.2f}")
    log("\n".join(lines))


if __name__ == "__main__":
    main()
