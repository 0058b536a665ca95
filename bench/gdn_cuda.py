"""Check and time the CUDA Gated DeltaNet kernels (device script).

Run on the GPU machine:

    source .mlxcuda/boot.sh && PYTHONPATH=. python3 bench/gdn_cuda.py --out $OUT [--sections scan,frontend,decode] [--quick]

The kernels the patched layer runs, at the model's heads (Hk = 16, Hv = 32,
head dims 128): the prefill scan (``kernels/gated_delta_scan.py``, its
default configuration), the front end (conv + SiLU + q/k norms + gates,
``kernels/gated_delta_frontend.py``), the gated RMSNorm
(``kernels/gated_rms_norm.py``) and the decode step
(``kernels/gated_delta_decode.py``: one packed input [qkv | z | a | b] and the
layer's constants from ``decode_params``). Sections, each in its own
process (a kernel fault cannot take the others down):

* ``scan``: against the fp32 per-token recurrence (``ops.gated_delta``) on
  fresh random data, outputs poisoned with NaN: B = 1, 2, strong and weak
  decay, fp32 and bf16, T from 1 to 4096, a call carried over from another,
  a padding mask. Times: chained calls (the state feeds the next call, as
  consecutive layers), marginal latency, beside one call per evaluation,
  and the plain-MLX chunked form.
* ``frontend``: the front end and the gated norm against fp32 references
  (mlx-lm's ``Qwen3NextRMSNormGated`` for the norm); times against mlx-lm's
  ops for the same work.
* ``decode``: the decode step against the fp32 front end + recurrence +
  mlx-lm's gated norm; 8 decode steps against the prefill kernels over the
  same 8 tokens; times of 30 layers per token (the model's GDN layers, each
  its own state) eager and ``mx.compile``d, 50 chained steps, a pipelined
  token loop (``mx.async_eval``), and the same step in plain MLX ops.

Logs and one JSON per section go to --out; a summary table is printed last.
"""

from __future__ import annotations

import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.device_script import chain_latency, finite, log, rel, run_sections, timeit  # noqa: E402

D = 128
HK, HV = 16, 32
C = (2 * HK + HV) * D

# --------------------------------------------------------------------------
# helpers (MLX imported lazily: the driver itself needs none)
# --------------------------------------------------------------------------


def _mx():
    import mlx.core as mx

    return mx


def maxabs(a, b):
    mx = _mx()
    return mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))).item()


def gates(B, T, decay, key):
    """g in (0, 1], beta in (0, 1): 'strong' g ~ 0.05-0.6, 'weak' ~ 0.99-0.9999."""
    mx = _mx()
    k1, k2 = mx.random.split(key)
    if decay == "strong":
        g = mx.random.uniform(0.05, 0.6, (B, T, HV), key=k1)
    else:
        g = 1.0 - mx.random.uniform(1e-4, 1e-2, (B, T, HV), key=k1)
    beta = mx.random.uniform(0.0, 1.0, (B, T, HV), key=k2)
    return g.astype(mx.float32), beta.astype(mx.float32)


def qkv_inputs(B, T, key, dtype):
    """q, k L2-normalised (q scaled by D^-0.5), v ~ N(0,1), rounded to dtype."""
    mx = _mx()
    k1, k2, k3 = mx.random.split(key, 3)
    q = mx.random.normal((B, T, HK, D), key=k1)
    k = mx.random.normal((B, T, HK, D), key=k2)
    v = mx.random.normal((B, T, HV, D), key=k3)
    q = q / mx.sqrt((q * q).sum(-1, keepdims=True)) * D**-0.5
    k = k / mx.sqrt((k * k).sum(-1, keepdims=True))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def reference_recurrent():
    """``(fn, name)``: the fp32 per-token reference ``ops.gated_delta.gated_delta_recurrent``
    with q, k, v cast to fp32."""
    mx = _mx()
    from mlx_qwen_fast.ops.gated_delta import gated_delta_recurrent

    def ref(q, k, v, g, beta, state, mask=None):
        f = mx.float32
        return gated_delta_recurrent(q.astype(f), k.astype(f), v.astype(f), g, beta, state, mask)

    return ref, "ops.gated_delta.gated_delta_recurrent"


# --------------------------------------------------------------------------
# section: scan
# --------------------------------------------------------------------------

T_LIST = [1, 2, 3, 63, 64, 65, 1000, 4096]


def scan_chain(q, k, v, g, beta, s0):
    """``make(m)`` for :func:`device_script.chain_latency`: m scans over the
    same tokens, each starting from the state the previous one left."""
    from mlx_qwen_fast.kernels import gated_delta_scan as S

    def make(m):
        def f():
            st, y = s0, None
            for _ in range(m):
                y, st = S.gated_delta_scan(q, k, v, g, beta, st)
            return y, st
        return f
    return make


def section_scan(args):
    mx = _mx()
    from mlx_qwen_fast.kernels import _cuda_build as cb
    from mlx_qwen_fast.kernels import gated_delta_scan as S

    cb.set_poison(True)
    ref, ref_name = reference_recurrent()
    res = {"reference": ref_name, "checks": [], "timings": {}}
    tl = [t for t in T_LIST if t <= 1000] if args.quick else list(T_LIST)
    tmax = tl[-1]
    key = mx.random.key(int(time.time()) & 0xFFFF)
    for B in (1, 2):
        for decay in ("strong", "weak"):
            key, k1, k2, k3 = mx.random.split(key, 4)
            qb, kb, vb = qkv_inputs(B, tmax, k1, mx.bfloat16)  # bf16-exact values
            g, beta = gates(B, tmax, decay, k2)
            s0 = 0.5 * mx.random.normal((B, HV, D, D), key=k3)
            # reference: segment-wise, state recorded at each boundary
            t_ref = time.perf_counter()
            ys, states, st, prev = [], {}, s0, 0
            for T in tl:
                y, st = ref(qb[:, prev:T], kb[:, prev:T], vb[:, prev:T], g[:, prev:T], beta[:, prev:T], st)
                mx.eval(y, st)
                ys.append(y)
                states[T] = st
                prev = T
            yref = mx.concatenate(ys, axis=1)
            mx.eval(yref)
            res.setdefault("reference_seconds", []).append(time.perf_counter() - t_ref)
            for dt in (mx.float32, mx.bfloat16):
                q, k, v = (x.astype(dt) for x in (qb, kb, vb))
                for T in tl:
                    y, s1 = S.gated_delta_scan(q[:, :T], k[:, :T], v[:, :T], g[:, :T], beta[:, :T], s0)
                    mx.eval(y, s1)
                    yr = yref[:, :T]
                    rec = dict(B=B, T=T, decay=decay, dtype=str(dt),
                               y_rel=rel(y, yr), y_maxabs=maxabs(y, yr), y_refmax=mx.max(mx.abs(yr)).item(),
                               s_rel=rel(s1, states[T]), finite=finite(y) and finite(s1))
                    ytol = 1e-4 if dt == mx.float32 else 1e-2
                    rec["ok"] = rec["finite"] and rec["y_rel"] < ytol and rec["s_rel"] < 1e-4
                    res["checks"].append(rec)
                    if not rec["ok"]:
                        log(f"[scan] FAIL {rec}")
                # two calls carried over
                T1 = min(1000, tmax // 2)
                ya, sa = S.gated_delta_scan(q[:, :T1], k[:, :T1], v[:, :T1], g[:, :T1], beta[:, :T1], s0)
                yb, sb = S.gated_delta_scan(q[:, T1:], k[:, T1:], v[:, T1:], g[:, T1:], beta[:, T1:], sa)
                y2 = mx.concatenate([ya, yb], axis=1)
                rec = dict(B=B, T=f"{T1}+{tmax - T1}", decay=decay, dtype=str(dt), case="carry",
                           y_rel=rel(y2, yref), s_rel=rel(sb, states[tmax]), finite=finite(y2) and finite(sb))
                rec["ok"] = rec["finite"] and rec["y_rel"] < (1e-4 if dt == mx.float32 else 1e-2) and rec["s_rel"] < 1e-4
                res["checks"].append(rec)
    # mask: B=2, left padding of 5 and 0 steps, T=65
    key, k1, k2, k3 = mx.random.split(key, 4)
    T = 65
    q, k, v = qkv_inputs(2, T, k1, mx.float32)
    g, beta = gates(2, T, "strong", k2)
    s0 = 0.5 * mx.random.normal((2, HV, D, D), key=k3)
    mask = mx.array([[False] * 5 + [True] * (T - 5), [True] * T])
    yr, sr = ref(q, k, v, g, beta, s0, mask)
    y, s1 = S.gated_delta_scan(q, k, v, g, beta, s0, mask)
    mx.eval(y, s1, yr, sr)
    rec = dict(B=2, T=T, decay="strong", dtype="float32", case="mask", y_rel=rel(y, yr),
               y_pad_max=mx.max(mx.abs(y[0, :5])).item(), s_rel=rel(s1, sr), finite=finite(y) and finite(s1))
    rec["ok"] = rec["finite"] and rec["y_rel"] < 1e-4 and rec["s_rel"] < 1e-4 and rec["y_pad_max"] == 0.0
    res["checks"].append(rec)

    # ---- timings (poison off) ----
    cb.set_poison(False)
    for B, T in ((1, 4096), (1, 2048), (2, 4096)):
        key, k1, k2, k3 = mx.random.split(key, 4)
        q, k, v = qkv_inputs(B, T, k1, mx.bfloat16)
        g, beta = gates(B, T, "weak", k2)
        s0 = 0.5 * mx.random.normal((B, HV, D, D), key=k3)
        mx.eval(q, k, v, g, beta, s0)
        # latency as a layer sees it: 8 calls chained through the state in one
        # evaluation, marginal time of one more call (independent calls in one
        # evaluation run concurrently and time throughput; one call per
        # evaluation adds MLX's per-evaluation cost)
        r = chain_latency(scan_chain(q, k, v, g, beta, s0), n=8, evals=7)
        res["timings"][f"scan B={B} T={T}"] = r["marginal"]
        res["timings"][f"scan single-call B={B} T={T}"] = r["single"]
        log(f"[scan] B={B} T={T}: {r['marginal'] * 1e3:.3f} ms chained "
            f"({r['single'] * 1e3:.3f} ms one call per evaluation)")
    # the chunkwise plain-MLX form (tensor-core matmuls) for comparison
    try:
        from mlx_qwen_fast.ops.gated_delta import gated_delta_chunked

        key, k1, k2, k3 = mx.random.split(key, 4)
        q, k, v = qkv_inputs(1, 4096, k1, mx.bfloat16)
        g, beta = gates(1, 4096, "weak", k2)
        s0 = 0.5 * mx.random.normal((1, HV, D, D), key=k3)
        mx.eval(q, k, v, g, beta, s0)
        t = timeit(lambda: gated_delta_chunked(q, k, v, g, beta, s0), n=5, batch=1, warm=2)
        res["timings"]["chunked (ops, plain MLX) B=1 T=4096"] = t
        log(f"[scan] ops.gated_delta_chunked B=1 T=4096: {t * 1e3:.3f} ms")
    except Exception as e:  # noqa: BLE001
        log(f"[scan] chunked timing skipped: {e!r}")
    return res


# --------------------------------------------------------------------------
# section: frontend + norm
# --------------------------------------------------------------------------


def ref_frontend(qkv, a, b, w, conv_state, A_log, dt_bias, eps=1e-6):
    mx = _mx()
    import mlx.nn as nn

    f = mx.float32
    T = qkv.shape[1]
    x = mx.concatenate([conv_state.astype(f), qkv.astype(f)], axis=1)
    wf = w.astype(f).reshape(C, 4)
    o = x[:, 0:T] * wf[:, 0]
    for i in range(1, 4):
        o = o + x[:, i:i + T] * wf[:, i]
    o = o * mx.sigmoid(o)
    B = qkv.shape[0]
    q = o[..., : HK * D].reshape(B, T, HK, D)
    k = o[..., HK * D: 2 * HK * D].reshape(B, T, HK, D)
    v = o[..., 2 * HK * D:].reshape(B, T, HV, D)
    q = q * mx.rsqrt((q * q).sum(-1, keepdims=True) + eps) * D**-0.5
    k = k * mx.rsqrt((k * k).sum(-1, keepdims=True) + eps)
    g = mx.exp(-mx.exp(A_log.astype(f)) * nn.softplus(a.astype(f) + dt_bias.astype(f)))
    beta = mx.sigmoid(b.astype(f))
    return q, k, v, g, beta, x[:, -3:]


def ref_norm(y, z, w, eps):
    """mlx-lm's Qwen3NextRMSNormGated, run as in the model."""
    from mlx_lm.models.qwen3_next import Qwen3NextRMSNormGated

    m = Qwen3NextRMSNormGated(D, eps=eps)
    m.weight = w
    return m(y, z)


def fe_params(key, dtype):
    mx = _mx()
    k1, k2, k3 = mx.random.split(key, 3)
    w = (0.5 * mx.random.normal((C, 4, 1), key=k1)).astype(dtype)
    A_log = mx.log(mx.random.uniform(0.1, 8.0, (HV,), key=k2))
    dt_bias = mx.random.uniform(-1.0, 1.0, (HV,), key=k3).astype(dtype)
    return w, A_log, dt_bias


def section_frontend(args):
    mx = _mx()
    from mlx_qwen_fast.kernels import _cuda_build as cb
    from mlx_qwen_fast.kernels.gated_delta_frontend import gated_delta_frontend
    from mlx_qwen_fast.kernels.gated_rms_norm import gated_rms_norm

    cb.set_poison(True)
    res = {"checks": [], "timings": {}}
    key = mx.random.key((int(time.time()) + 7) & 0xFFFF)
    for dt in (mx.float32, mx.bfloat16):
        key, kp = mx.random.split(key)
        w, A_log, dt_bias = fe_params(kp, dt)
        for B in (1, 2):
            for T in (1, 2, 3, 64, 65, 1000):
                key, k1, k2, k3, k4 = mx.random.split(key, 5)
                qkv = mx.random.normal((B, T, C), key=k1).astype(dt)
                a = mx.random.normal((B, T, HV), key=k2).astype(dt)
                b = mx.random.normal((B, T, HV), key=k3).astype(dt)
                cs = mx.random.normal((B, 3, C), key=k4).astype(dt)
                out = gated_delta_frontend(qkv, a, b, w, cs, A_log, dt_bias, num_k_heads=HK, num_v_heads=HV)
                ref = ref_frontend(qkv, a, b, w, cs, A_log, dt_bias)
                mx.eval(out, ref)
                names = ("q", "k", "v", "g", "beta", "conv_state")
                errs = {n: rel(o, r) for n, o, r in zip(names, out, ref)}
                tol = 1e-5 if dt == mx.float32 else 1e-2
                rec = dict(B=B, T=T, dtype=str(dt), **{f"{n}_rel": e for n, e in errs.items()},
                           finite=all(finite(o) for o in out))
                rec["ok"] = rec["finite"] and all(errs[n] < tol for n in names[:3]) and errs["g"] < 1e-5 \
                    and errs["beta"] < 1e-5 and errs["conv_state"] == 0.0
                res["checks"].append(rec)
                if not rec["ok"]:
                    log(f"[frontend] FAIL {rec}")
        # gated norm
        for N in (1, 33, 4096 * HV):
            key, k1, k2, k3 = mx.random.split(key, 4)
            y = mx.random.normal((N, D), key=k1).astype(dt)
            z = mx.random.normal(y.shape, key=k2).astype(dt)
            wn = (1.0 + 0.3 * mx.random.normal((D,), key=k3)).astype(dt)
            o = gated_rms_norm(y, z, wn, 1e-6)
            r = ref_norm(y, z, wn, 1e-6)
            mx.eval(o, r)
            rec = dict(kernel="gated_rms_norm", rows=y.size // D, dtype=str(dt), rel=rel(o, r), maxabs=maxabs(o, r),
                       finite=finite(o))
            rec["ok"] = rec["finite"] and rec["rel"] < (1e-5 if dt == mx.float32 else 4e-3)
            res["checks"].append(rec)
            if not rec["ok"]:
                log(f"[norm] FAIL {rec}")

    # ---- timings ----
    cb.set_poison(False)
    import mlx.nn as nn
    from mlx_lm.models.gated_delta import compute_g, normalize_qk

    dt = mx.bfloat16
    key, kp, k1, k2, k3, k4 = mx.random.split(key, 6)
    w, A_log, dt_bias = fe_params(kp, dt)
    for T in (4096, 2048):
        B = 1
        qkv = mx.random.normal((B, T, C), key=k1).astype(dt)
        a = mx.random.normal((B, T, HV), key=k2).astype(dt)
        b = mx.random.normal((B, T, HV), key=k3).astype(dt)
        cs = mx.random.normal((B, 3, C), key=k4).astype(dt)
        mx.eval(qkv, a, b, cs)
        t = timeit(lambda: gated_delta_frontend(qkv, a, b, w, cs, A_log, dt_bias, num_k_heads=HK, num_v_heads=HV), n=15, batch=5)
        res["timings"][f"frontend B=1 T={T}"] = t
        conv = nn.Conv1d(C, C, 4, groups=C, bias=False)
        conv.weight = w

        def stock():  # mlx-lm's ops for the same work (bf16, as in the model)
            x = mx.concatenate([cs, qkv], axis=1)
            o = nn.silu(conv(x))
            q, k, v = mx.split(o, [HK * D, 2 * HK * D], -1)
            q, k = normalize_qk(q.reshape(B, T, HK, D), k.reshape(B, T, HK, D), inv_scale=D**-0.5, eps=1e-6)
            return q, k, v, compute_g(A_log, a, dt_bias), mx.sigmoid(b), x[:, -3:]

        res["timings"][f"frontend stock mlx-lm ops B=1 T={T}"] = timeit(stock, n=10, batch=2)
        y = mx.random.normal((B, T, HV, D), key=k1).astype(dt)
        z = mx.random.normal((B, T, HV, D), key=k2).astype(dt)
        wn = mx.ones((D,), dt)
        mx.eval(y, z)
        res["timings"][f"gated_rms_norm B=1 T={T}"] = timeit(lambda: gated_rms_norm(y, z, wn, 1e-6), n=15, batch=5)
        res["timings"][f"gated norm stock mlx-lm B=1 T={T}"] = timeit(lambda: ref_norm(y, z, wn, 1e-6), n=15, batch=5)
    for kk, t in res["timings"].items():
        log(f"[frontend] {kk}: {t * 1e3:.3f} ms")
    return res


# --------------------------------------------------------------------------
# section: decode
# --------------------------------------------------------------------------


def decode_inputs(B, T, key, dt):
    """qkv [B, T, C], z [B, T, Hv*D], a, b [B, T, Hv], conv state [B, 3, C], state [B, Hv, D, D]."""
    mx = _mx()
    k1, k2, k3, k4, k5, k6 = mx.random.split(key, 6)
    qkv = mx.random.normal((B, T, C), key=k1).astype(dt)
    z = mx.random.normal((B, T, HV * D), key=k2).astype(dt)
    a = mx.random.normal((B, T, HV), key=k3).astype(dt)
    b = mx.random.normal((B, T, HV), key=k4).astype(dt)
    cs = mx.random.normal((B, 3, C), key=k5).astype(dt)
    s0 = 0.5 * mx.random.normal((B, HV, D, D), key=k6)
    return qkv, z, a, b, cs, s0


def pack(qkv, z, a, b):
    """The decode kernel's one input [qkv | z | a | b] (the layer's concatenated projection)."""
    mx = _mx()
    return mx.concatenate([qkv, z, a, b], axis=-1)


def section_decode(args):
    mx = _mx()
    from mlx_qwen_fast.kernels import _cuda_build as cb
    from mlx_qwen_fast.kernels.gated_delta_contract import decode_params
    from mlx_qwen_fast.kernels.gated_delta_decode import gated_delta_decode
    from mlx_qwen_fast.kernels.gated_delta_frontend import gated_delta_frontend
    from mlx_qwen_fast.kernels.gated_delta_scan import gated_delta_scan
    from mlx_qwen_fast.kernels.gated_rms_norm import gated_rms_norm

    cb.set_poison(True)
    ref, ref_name = reference_recurrent()
    res = {"reference": ref_name, "checks": [], "timings": {}}
    step = partial(gated_delta_decode, num_k_heads=HK, num_v_heads=HV, norm_eps=1e-6)
    key = mx.random.key((int(time.time()) + 13) & 0xFFFF)
    for dt in (mx.float32, mx.bfloat16):
        key, kp, kn = mx.random.split(key, 3)
        w, A_log, dt_bias = fe_params(kp, dt)
        wn = (1.0 + 0.3 * mx.random.normal((D,), key=kn)).astype(dt)
        params = decode_params(w, A_log, dt_bias, wn)
        for B in (1, 2):
            key, k1 = mx.random.split(key)
            qkv, z, a, b, cs, s0 = decode_inputs(B, 1, k1, dt)
            out, ncs, ns = step(pack(qkv, z, a, b), params, cs, s0)
            # reference: fp32 front end, fp32 recurrence, q/k/v rounded as the
            # kernel stores them (to dt), then mlx-lm's gated norm on y in dt
            q, k, v, g, beta, rcs = ref_frontend(qkv, a, b, w, cs, A_log, dt_bias)
            q, k, v = (x.astype(dt).astype(mx.float32) for x in (q, k, v))
            y, rs = ref(q, k, v, g, beta, s0)
            ro = ref_norm(y.astype(dt), z.reshape(B, 1, HV, D), wn, 1e-6).reshape(B, 1, HV * D)
            mx.eval(out, ncs, ns, ro, rcs, rs)
            rec = dict(B=B, dtype=str(dt), out_rel=rel(out, ro), out_maxabs=maxabs(out, ro),
                       state_rel=rel(ns, rs), conv_state_rel=rel(ncs, rcs),
                       finite=finite(out) and finite(ns) and finite(ncs))
            rec["ok"] = rec["finite"] and rec["out_rel"] < (1e-4 if dt == mx.float32 else 1.5e-2) \
                and rec["state_rel"] < (1e-5 if dt == mx.float32 else 1e-3) and rec["conv_state_rel"] == 0.0
            res["checks"].append(rec)
            if not rec["ok"]:
                log(f"[decode] FAIL {rec}")
        # 8 decode steps == prefill kernels over the same 8 tokens
        B, T = 2, 8
        key, k1 = mx.random.split(key)
        qkv, z, a, b, cs, s0 = decode_inputs(B, T, k1, dt)
        proj = pack(qkv, z, a, b)
        c_, s_, outs = cs, s0, []
        for t in range(T):
            o, c_, s_ = step(proj[:, t:t + 1], params, c_, s_)
            outs.append(o)
        od = mx.concatenate(outs, axis=1)
        q, k, v, g, beta, pc = gated_delta_frontend(qkv, a, b, w, cs, A_log, dt_bias, num_k_heads=HK, num_v_heads=HV)
        y, ps = gated_delta_scan(q, k, v, g, beta, s0)
        op = gated_rms_norm(y, z.reshape(B, T, HV, D), wn, 1e-6).reshape(B, T, HV * D)
        mx.eval(od, op, c_, s_, pc, ps)
        rec = dict(B=B, T=T, dtype=str(dt), check="decode x8 vs prefill kernels", out_rel=rel(od, op),
                   state_rel=rel(s_, ps), conv_state_rel=rel(c_, pc), finite=finite(od) and finite(s_))
        rec["ok"] = rec["finite"] and rec["out_rel"] < (1e-4 if dt == mx.float32 else 1.5e-2) \
            and rec["state_rel"] < (1e-5 if dt == mx.float32 else 1e-3) and rec["conv_state_rel"] == 0.0
        res["checks"].append(rec)
        if not rec["ok"]:
            log(f"[decode] FAIL {rec}")

    # ---- timings: 30 layers per token, each its own state, as in the model ----
    cb.set_poison(False)
    dt, NL = mx.bfloat16, 30
    key, kp = mx.random.split(key)
    w, A_log, dt_bias = fe_params(kp, dt)
    wn = mx.ones((D,), dt)
    params = decode_params(w, A_log, dt_bias, wn)
    cstep = mx.compile(step)  # as the layer's compiled step runs the kernel
    for B in (1, 2):
        key, k1 = mx.random.split(key)
        qkv, z, a, b, _, _ = decode_inputs(B, 1, k1, dt)
        proj = pack(qkv, z, a, b)
        states = [0.1 * mx.random.normal((B, HV, D, D)) for _ in range(NL)]
        convs = [mx.random.normal((B, 3, C)).astype(dt) for _ in range(NL)]
        mx.eval(proj, params, states, convs)

        def token(fn):
            def run():
                outs = []
                for i in range(NL):
                    outs += list(fn(proj, params, convs[i], states[i]))
                return outs
            return run

        res["timings"][f"decode B={B}: 30 layers, eval per token, eager (per layer)"] = timeit(token(step), n=20) / NL
        res["timings"][f"decode B={B}: 30 layers, eval per token, mx.compile'd (per layer)"] = (
            timeit(token(cstep), n=20) / NL)

        def chain():  # one layer, 50 steps, each step's states feed the next
            s_, c_, o = states[0], convs[0], None
            for _ in range(50):
                o, c_, s_ = cstep(proj, params, c_, s_)
            return o, s_

        res["timings"][f"decode B={B}: 50 chained steps, mx.compile'd (per step)"] = timeit(chain, n=10) / 50
        # generate-like loop: the next token's graph is built while the GPU
        # runs this one (async_eval), states carried from token to token
        cs_, ss_ = list(convs), list(states)
        mx.eval(token(cstep)())
        mx.synchronize()
        t0 = time.perf_counter()
        ntok = 30
        for _ in range(ntok):
            outs = []
            for i in range(NL):
                o, cs_[i], ss_[i] = cstep(proj, params, cs_[i], ss_[i])
                outs += [o, cs_[i], ss_[i]]
            mx.async_eval(outs)
        mx.eval(outs)
        mx.synchronize()
        res["timings"][f"decode B={B}: async pipelined, mx.compile'd, 30 tokens (per layer)"] = (
            (time.perf_counter() - t0) / ntok / NL)
    # the same step in plain MLX ops (ops.gated_delta recurrence + mlx-lm glue), B=1
    try:
        import mlx.nn as nn
        from mlx_lm.models.gated_delta import compute_g, normalize_qk

        from mlx_qwen_fast.ops.gated_delta import gated_delta_recurrent

        conv = nn.Conv1d(C, C, 4, groups=C, bias=False)
        conv.weight = w
        key, k1 = mx.random.split(key)
        qkv, z, a, _, cs, s0 = decode_inputs(1, 1, k1, dt)
        mx.eval(qkv, z, a, cs, s0)

        def plain_layer():
            x = mx.concatenate([cs, qkv], axis=1)
            o = nn.silu(conv(x))
            q, k, v = mx.split(o, [HK * D, 2 * HK * D], -1)
            q, k = normalize_qk(q.reshape(1, 1, HK, D), k.reshape(1, 1, HK, D), inv_scale=D**-0.5, eps=1e-6)
            y, s = gated_delta_recurrent(q, k, v.reshape(1, 1, HV, D), compute_g(A_log, a, dt_bias), mx.sigmoid(a), s0)
            return ref_norm(y, z.reshape(1, 1, HV, D), wn, 1e-6), x[:, -3:], s

        res["timings"]["decode B=1: plain-ops layer (ops.recurrent + mlx-lm glue)"] = timeit(plain_layer, n=20)
    except Exception as e:  # noqa: BLE001
        log(f"[decode] plain-ops timing skipped: {e!r}")
    for kk, t in res["timings"].items():
        log(f"[decode] {kk}: {t * 1e6:.1f} us")
    return res


# --------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------



SECTIONS = {"scan": section_scan, "frontend": section_frontend, "decode": section_decode}


def main():
    run_sections(__file__, "gdn", SECTIONS, summary, __doc__.splitlines()[0],
                 "scan,frontend,decode", "T up to 1000 only")


def summary(results):
    lines = ["", "=== GDN CUDA kernels: summary ==="]
    for name in ("scan", "frontend", "decode"):
        r = results.get(name, {})
        ch = r.get("checks", [])
        bad = [c for c in ch if not c.get("ok")]
        lines.append(f"{name}: {len(ch) - len(bad)}/{len(ch)} checks pass" + (f"  FAILED: {bad[:3]}" if bad else ""))
        worst = {}
        for c in ch:
            for kk, v in c.items():
                if kk.endswith("_rel") or kk == "rel":
                    tag = (c.get("dtype"), kk)
                    worst[tag] = max(worst.get(tag, 0.0), v if isinstance(v, float) else 0.0)
        if worst:
            lines.append("   worst rel err: " + ", ".join(f"{d.split('.')[-1]}:{kk}={v:.1e}" for (d, kk), v in sorted(worst.items(), key=str)))
        for kk, t in r.get("timings", {}).items():
            lines.append(f"   {kk:70s} {t * 1e3:9.4f} ms")
    log("\n".join(lines))


if __name__ == "__main__":
    main()
