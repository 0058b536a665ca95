"""MLX's host cost of one custom-kernel graph node, by what the node carries.

A decode step of one layer is a handful of graph nodes, and on the H200 they
cost more host time than GPU time (a patched token's graph takes ms of host
time to build, its MoE kernels ~0.5 ms of GPU time: bench/results/
package-figures.md, "Host time per decode token"). This script separates the
parts MLX's ``CustomKernel::eval_gpu`` (mlx/backend/cuda/custom_kernel.cpp)
spends per launch, with a trivial kernel (``out0 = in0 + 1`` on 32 floats)
built in variants:

* inputs: 1, 4, 10 arrays (the GDN decode kernel takes 4, the MoE decode
  kernels 17 and 10);
* outputs: 1 or 3;
* cubin size: padded with an initialised ``__device__`` array, since MLX
  hashes the whole ``compiled_source`` on every launch (``std::hash`` of the
  cubin, for the JIT module's name); the padded builds also as the
  compressed fatbin the package launches when nvFatbin is installed
  (``_cuda_build``; the zero padding compresses to almost nothing);
* called directly (``mx.fast.precompiled_cuda_kernel``), through the
  package's :class:`CudaKernel` wrapper, and ``mx.compile``d.

Each row: ``n`` dependent calls (output 0 feeds input 0) in one evaluation,
split into graph building and evaluation (median of 10), microseconds per
call. Then the real GDN decode step (the layer's kernel: one packed input
and ``decode_params``) in the same forms.

Usage (H200): python3 bench/node_cost.py [n]  (n dependent calls per evaluation, default 30)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from bench.device_script import build_eval_times  # noqa: E402
from mlx_qwen_fast.kernels import _cuda_build as cb  # noqa: E402
from mlx_qwen_fast.kernels import _cuda_fatbin, _cuda_toolchain  # noqa: E402


def _source(ni: int, no: int, pad: int) -> str:
    ins = ", ".join(f"const float* __restrict__ in{i}" for i in range(ni))
    outs = ", ".join(f"float* __restrict__ out{i}" for i in range(no))
    extra = "".join(f" out{i}[t] = 0.f;" for i in range(1, no))
    pad_decl = f"__device__ unsigned char pad_bytes[{pad}] = {{1}};\n" if pad else ""
    touch = " if (t == 1000000) out0[0] = pad_bytes[t & 7];" if pad else ""
    return (f"{pad_decl}extern \"C\" __global__ void KNAME({ins}, {outs}) {{\n"
            f"  int t = threadIdx.x; out0[t] = in0[t] + 1.f;{extra}{touch}\n}}\n")


def _build(ni: int, no: int, pad: int):
    name = f"mqf_nodecost_{ni}_{no}_{pad}"
    nv = _cuda_toolchain.get_nvrtc()
    cubin = nv.compile(_source(ni, no, pad), name, {}, [f"--gpu-architecture={cb._arch_option()}",
                                                          f"-DKNAME={name}", "-std=c++17"])
    return name, cubin


def synthetic_rows(n: int):
    x0 = mx.zeros((32,))
    consts = [mx.full((32,), float(i)) for i in range(1, 10)]
    mx.eval(x0, *consts)
    rows = []
    for ni, no, pad in ((1, 1, 0), (4, 1, 0), (10, 1, 0), (10, 3, 0), (1, 1, 20000), (1, 1, 45000),
                        (1, 1, 95000)):
        name, cubin = _build(ni, no, pad)
        shapes, dtypes = [(32,)] * no, [mx.float32] * no
        images = [("cubin", cubin)]
        nf = _cuda_fatbin.get_nvfatbin()
        if pad and nf is not None:
            images.append(("fatbin", nf.compress(cubin, cb._arch_option())))
        for kind, image in images:
            def call(x, name=name, image=image, ni=ni, shapes=shapes, dtypes=dtypes):
                return mx.fast.precompiled_cuda_kernel(
                    name=name, compiled_source=image, inputs=[x] + consts[: ni - 1], output_shapes=shapes,
                    output_dtypes=dtypes, scalars=[], grid=(32, 1, 1), threadgroup=(32, 1, 1))[0]

            comp = mx.compile(call)

            def chain(f):
                def build():
                    x = x0
                    for _ in range(n):
                        x = f(x)
                    return x
                return build

            for form, f in (("direct", call), ("mx.compile", comp)):
                tb, te = build_eval_times(chain(f))
                rows.append((f"kernel in={ni:2d} out={no} {kind}={len(image) / 1024:5.1f}KB {form}", tb, te))
    add = lambda x: x + 1.0  # noqa: E731
    for form, f in (("mlx add (32 floats)", add), ("mlx add, mx.compile", mx.compile(add))):
        def build(f=f):
            x = x0
            for _ in range(n):
                x = f(x)
            return x
        tb, te = build_eval_times(build)
        rows.append((form, tb, te))
    return rows


def gdn_rows(n: int):
    """The GDN decode step of the full-size layer shape (one packed input,
    ``decode_params``): bare launches of the cubin and of the launched
    image, the package's wrapper eager and ``mx.compile``d."""
    from bench.gdn_cuda import HK, HV, D, fe_params
    from mlx_qwen_fast.kernels import gated_delta_contract as kc
    from mlx_qwen_fast.kernels import gated_delta_decode as kd

    C, P = (2 * HK + HV) * D, kc.packed_width(HK, HV)
    ks = mx.random.split(mx.random.key(5), 5)
    w, A_log, dt_bias = fe_params(ks[0], mx.bfloat16)
    proj = mx.random.normal((1, 1, P), key=ks[1]).astype(mx.bfloat16)
    nw = (1.0 + 0.1 * mx.random.normal((D,), key=ks[2])).astype(mx.bfloat16)
    cs0 = mx.random.normal((1, 3, C), key=ks[3]).astype(mx.bfloat16)
    s0 = 0.1 * mx.random.normal((1, HV, D, D), key=ks[4])
    mx.eval(w, A_log, dt_bias, proj, nw, cs0, s0)
    params = kc.decode_params(w, A_log, dt_bias, nw)
    mx.eval(params)
    kern = kd._kernel(proj.dtype, HV, HK)
    cubin, image = kern.cubin, kern.image
    shapes, dtypes = [(1, 1, HV * D), (1, 3, C), (1, HV, D, D)], [proj.dtype, proj.dtype, mx.float32]
    eps = [cb._f32(1e-6), cb._f32(1e-6)]

    def bare(cs, st, binary=cubin):
        return mx.fast.precompiled_cuda_kernel(
            name=kern.name, compiled_source=binary, inputs=[proj, params, cs, st],
            output_shapes=shapes, output_dtypes=dtypes, scalars=eps, grid=(HV * 512, 1, 1),
            threadgroup=(512, 1, 1))

    def bare_image(cs, st):
        return bare(cs, st, image)

    def wrapped(cs, st):
        return kd.gated_delta_decode(proj, params, cs, st, num_k_heads=HK, num_v_heads=HV)

    comp = mx.compile(lambda p, prm, cs, st: kd.gated_delta_decode(
        p, prm, cs, st, num_k_heads=HK, num_v_heads=HV))

    def compiled(cs, st):
        return comp(proj, params, cs, st)

    rows = []
    print(f"gdn decode cubin: {len(cubin)} bytes, launched image ({_cuda_fatbin.fatbin_id()}): {len(image)} bytes",
          flush=True)
    for form, f in (("bare launch, cubin", bare), ("bare launch, image", bare_image),
                    ("package wrapper, eager", wrapped), ("package wrapper, mx.compile", compiled)):
        def build(f=f):
            cs, st, out = cs0, s0, None
            for _ in range(n):
                out, cs, st = f(cs, st)
            return out, cs, st
        tb, te = build_eval_times(build)
        rows.append((f"gdn decode step, {form}", tb, te))
    return rows


def main(argv):
    p = argparse.ArgumentParser(prog="bench/node_cost.py", description=__doc__.splitlines()[0])
    p.add_argument("n", nargs="?", type=int, default=30, help="dependent calls per evaluation (default 30)")
    n = p.parse_args(argv).n
    if n < 1:
        p.error(f"n must be >= 1, got {n}")
    if not cb.cuda_available():
        raise SystemExit("bench/node_cost.py: needs MLX's CUDA backend and an NVIDIA GPU (none here)")
    rows = synthetic_rows(n) + gdn_rows(n)
    print(f"\n{'node':58s} {'build':>8s} {'eval':>8s} {'total':>8s}   (us per call, {n} chained)")
    for label, tb, te in rows:
        print(f"{label:58s} {tb / n * 1e6:8.1f} {te / n * 1e6:8.1f} {(tb + te) / n * 1e6:8.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
