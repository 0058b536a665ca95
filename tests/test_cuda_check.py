"""The CUDA check itself (tests/cuda_check.py, cuda_shim.h, cuda_run.h):
every kernel source of the package has a CPU-run test, the PTX helpers'
CPU bodies against exact references, and planted bugs in the package's own
kernels that the check must catch.

No GPU needed: everything here runs on the CPU (and compiles with nvcc
where it is installed)."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from fractions import Fraction
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import cuda_check
from cuda_check import CudaCheckError

TESTS = Path(__file__).resolve().parent
KERNELS = TESTS / "cuda_kernels"
cuda_check.SOURCE_DIRS.append(KERNELS)


@pytest.fixture
def sim():
    with cuda_check.simulated():
        yield


# ---------------------------------------------------------------------------
# coverage: every kernel the package launches has a CPU check
# ---------------------------------------------------------------------------


def _cpu_check_marks():
    """Kernel sources named by cpu_check marks anywhere under tests/."""
    named = set()
    for path in TESTS.rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "cpu_check"
                    and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "mark"):
                named |= {a.value for a in node.args if isinstance(a, ast.Constant)}
    return named


def test_every_kernel_source_has_a_cpu_check():
    """Each .cu file of mlx_qwen_fast/cuda/ is named by a cpu_check mark (the
    conftest fixture then fails the test if that source never launched)."""
    sources = {p.name for p in cuda_check.SOURCES.glob("*.cu")}
    assert sources, "no kernel sources found"
    missing = sorted(sources - _cpu_check_marks())
    assert not missing, f"kernel sources without a CPU check (a cpu_check-marked test): {missing}"


def test_kernels_use_no_inline_asm_outside_ptx_helpers():
    """Inline PTX lives in ptx.cuh only, where each instruction has a CPU body."""
    for p in sorted(cuda_check.SOURCES.glob("*.cu*")):
        if p.name == "ptx.cuh":
            continue
        code = re.sub(r"//.*", "", p.read_text())
        assert not re.search(r"\basm\b", code), f"{p.name} has inline asm outside ptx.cuh"


def test_every_ptx_helper_has_a_cpu_body():
    """Each asm statement of ptx.cuh sits in an #ifndef MQF_CPU_CHECK branch
    whose #else holds the CPU body."""
    lines = (cuda_check.SOURCES / "ptx.cuh").read_text().splitlines()
    depth_gpu = []
    for i, line in enumerate(lines):
        s = line.strip()
        if s.startswith("#ifndef MQF_CPU_CHECK"):
            depth_gpu.append(i)
        elif s.startswith("#else") and depth_gpu:
            depth_gpu[-1] = None
        elif s.startswith("#endif") and depth_gpu:
            depth_gpu.pop()
        if re.search(r"\basm\b", s.split("//")[0]):
            assert depth_gpu and depth_gpu[-1] is not None, f"ptx.cuh:{i + 1}: asm outside a GPU branch"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("source,defines", [
    ("gated_rms_norm.cu", dict(GDN_X="bf16_t", GDN_N="bf16_t")),
    ("gated_delta_decode.cu", dict(GDN_X="bf16_t", GDN_HV=32, GDN_HK=16)),
    ("gdn_mixer_decode.cu", dict(GDN_X="bf16_t", GDN_HV=32, GDN_HK=16, GM_K=2048, GM_M=4)),
    ("gdn_mixer_decode.cu", dict(GDN_X="float", GDN_HV=32, GDN_HK=16, GM_K=2048, GM_M=1)),
    ("gated_delta_frontend.cu", dict(GDN_X="bf16_t", GDN_W="bf16_t", GDN_A="bf16_t", GDN_DT="bf16_t", GDN_HV=32,
                                     GDN_HK=16, GDN_TT=16)),
    ("attention_prefill.cu", dict(ATT_X="f16_t")),
    ("moe_grouped_gemm.cu", dict(MOE_KIND=0, MOE_BM=64)),
    ("moe_grouped_gemm_wgmma.cu", dict(MOE_KIND=1, MOE_BM=64, MOE_STAGES=4)),
    ("moe_routing.cu", dict(MOE_STAGE=1, MOE_E=256, MOE_K=8, MOE_LT="bf16_t")),
    ("moe_decode_gemv.cu", dict(MDG_KIND=0, MDG_N=4, MDG_K=8, MDG_D=2048, MDG_I=512, MDG_SGB=8, MDG_ROUTE=1,
                                MDG_E=512, MDG_LT="bf16_t")),
    ("moe_block_decode.cu", dict(MBD_N=4, MBD_K=8, MBD_E=256, MBD_D=2048, MBD_I=512, MBD_SGB=8, MBD_RBITS=8,
                                 MBD_RGS=64, MBD_WT="bf16_t")),
    ("gdn_layer_decode.cu", dict(GDN_X="bf16_t", GDN_HV=32, GDN_HK=16, GM_K=2048, GM_M=1, MBD_N=1, MBD_K=8,
                                 MBD_E=256, MBD_D=2048, MBD_I=512, MBD_SGB=8, MBD_RBITS=8, MBD_RGS=64,
                                 MBD_WT="bf16_t")),
    ("attention_layer_decode.cu", dict(ATT_X="bf16_t", ATT_W="bf16_t", ATT_HQ=16, ATT_HKV=2, ATT_ROPE_DIMS=64,
                                       ATT_ROPE_TRAD=0, AL_K=2048, AL_M=1, AL_IW="bf16_t", MBD_N=1, MBD_K=8,
                                       MBD_E=256, MBD_D=2048, MBD_I=512, MBD_SGB=8, MBD_RBITS=8, MBD_RGS=64,
                                       MBD_WT="bf16_t")),
    ("tests/grid_exchange.cu", {}),
    ("tests/grid_slots.cu", {}),
])
def test_nvcc_compiles_the_gpu_branch(tmp_path, source, defines):
    """The same sources (the asm branch of ptx.cuh) compile for sm_90a."""
    folder = KERNELS if source.startswith("tests/") else cuda_check.SOURCES
    path = folder / source.removeprefix("tests/")
    defs = [f"-D{k}={v}" for k, v in {"KNAME": "k", **defines}.items()]
    r = subprocess.run(["nvcc", "-cubin", "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a",
                        f"-I{cuda_check.SOURCES}", *defs, "-o", str(tmp_path / "k.cubin"), str(path)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("n,k,E", [(1, 8, 256), (4, 8, 512), (1, 32, 96)])
def test_nvcc_routing_gate_up_fits_its_registers(tmp_path, n, k, E):
    """The gate+up build that routes (the routing's E/32 logits and keys per
    lane on top of the GEMV's registers) stays within __launch_bounds__(256,
    3)'s 80 registers with no spills or stack frame, for sm_90a."""
    defs = dict(KNAME="k", MDG_KIND=0, MDG_N=n, MDG_K=k, MDG_D=2048, MDG_I=512, MDG_SGB=8, MDG_ROUTE=1, MDG_E=E,
                MDG_LT="bf16_t")
    r = subprocess.run(["nvcc", "-cubin", "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a",
                        f"-I{cuda_check.SOURCES}", *[f"-D{a}={b}" for a, b in defs.items()], "-Xptxas", "-v",
                        "-o", str(tmp_path / "k.cubin"), str(cuda_check.SOURCES / "moe_decode_gemv.cu")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    regs = int(re.search(r"Used (\d+) registers", r.stderr).group(1))
    assert regs <= 80 and "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in r.stderr, r.stderr


def test_nvrtc_builds_what_the_check_launches(sim, tmp_path, monkeypatch):
    """Inside simulated(), each launched configuration is also compiled by
    NVRTC for sm_90a (as a GPU machine does at first use), into the check's
    own cache; a source NVRTC rejects -- here a constexpr function without an
    execution space, which nvcc takes and NVRTC's JIT mode calls a host
    function -- fails with NVRTC's message."""
    from mlx_qwen_fast.kernels import _cuda_build as cb
    from mlx_qwen_fast.kernels import _cuda_toolchain

    if _cuda_toolchain.get_nvrtc() is None:
        pytest.skip("no libnvrtc (the test extra's nvidia-cuda-nvrtc) installed")
    monkeypatch.setattr(cuda_check, "_nvrtc_done", set())
    y = _rms_norm(3)
    assert not mx.isnan(y).any().item()
    built = [n for n in cuda_check._nvrtc_done if n.startswith("mqf_gated_rms_norm")]
    assert built and all(cb.build_stats[n]["arch"] == "sm_90a" for n in built)
    src = (cuda_check.SOURCES / "gated_rms_norm.cu").read_text()
    bad = src.replace("#include \"gdn_common.cuh\"", "#include \"gdn_common.cuh\"\nconstexpr int mqf_rows(int n) { return n; }\n"
                      "__device__ int mqf_use() { return mqf_rows(2); }", 1)
    assert bad != src
    kern = cb.CudaKernel.__new__(cb.CudaKernel)
    kern.filename, kern.base_name, kern.defines = "gated_rms_norm.cu", "mqf_planted", dict(GDN_X="bf16_t", GDN_N="bf16_t")
    monkeypatch.setattr(cb, "_read_sources", lambda f: (bad, {p.name: p.read_text() for p in cuda_check.SOURCES.glob("*.cuh")}))
    kern.__post_init__()
    with pytest.raises(CudaCheckError, match="host function"):
        cuda_check.nvrtc_compile(kern)


# ---------------------------------------------------------------------------
# the source rewrite and the launch checks
# ---------------------------------------------------------------------------


def test_rewrite_places_every_shared_declaration():
    text = ("  __shared__ __align__(16) xt ks[TILE][DH];\n  __shared__ float red[K > 1 ? K : 1];\n"
            "  __shared__ int n;\n  extern __shared__ __align__(16) unsigned char smem[];\n"
            "  extern __shared__ float wsh[];  // comment __shared__\n")
    out = cuda_check.rewrite(text)
    assert "mqf::shared_static<mqf_t_ks>(&mqf_site_ks, \"ks\", 16)" in out
    assert "typedef float mqf_t_red[K > 1 ? K : 1];" in out
    assert "typedef int mqf_t_n;" in out
    assert "unsigned char* const smem = static_cast<unsigned char*>(mqf::shared_dynamic(16));" in out
    assert "float* const wsh = static_cast<float*>(mqf::shared_dynamic(0));" in out
    with pytest.raises(CudaCheckError, match="not understood"):
        cuda_check.rewrite("__shared__ float a[4], b[4];")


def test_launch_bound_of_the_chosen_branch():
    pre = "void __launch_bounds__(32) other(int);\nvoid __launch_bounds__((8 / 2) * 32, 2) mqf_x(int a);"
    assert cuda_check.launch_bound(pre, "mqf_x") == "(8 / 2) * 32"
    assert cuda_check.launch_bound("void mqf_x(int);", "mqf_x") == "0"


def _exchange(blocks, **kw):
    x = mx.random.normal((blocks * 64,), key=mx.random.key(blocks))
    return x, cuda_check.launch("grid_exchange.cu", "mqf_test_exchange", kw, [x],
                                [(1,), (blocks,), (blocks,)], [mx.uint64, mx.float32, mx.float32],
                                (blocks * 64, 1, 1), (64, 1, 1), init_value=0)


@pytest.mark.parametrize("blocks", [1, 5])
def test_grid_barrier_exchanges_partials(blocks):
    """grid_sync.cuh's barrier (all blocks resident): every block sees every
    partial; the counter ends at one barrier's weight."""
    x, (ctr, partial, total) = _exchange(blocks)
    sums = x.reshape(blocks, 64).sum(axis=1)
    assert np.allclose(np.array(partial), np.array(sums), rtol=1e-5, atol=1e-5)
    assert np.allclose(np.array(total), float(sums.sum()), rtol=1e-5, atol=1e-4)
    assert ctr.item() == 64


def test_launch_that_does_not_fit_the_kernel_is_refused():
    x = mx.zeros((64,))
    outs = ([(1,), (1,), (1,)], [mx.uint64, mx.float32, mx.float32])
    with pytest.raises(CudaCheckError, match=r"takes 4 arrays and 0 scalars; the launch passes 4 arrays .* 1 scalars"):
        cuda_check.launch("grid_exchange.cu", "mqf_test_exchange", {}, [x], *outs, (64, 1, 1), (64, 1, 1),
                          scalars=[3], init_value=0)
    with pytest.raises(CudaCheckError, match=r"128 threads exceeds the kernel's __launch_bounds__\(64\)"):
        cuda_check.launch("grid_exchange.cu", "mqf_test_exchange", {}, [x], *outs, (128, 1, 1), (128, 1, 1),
                          init_value=0)


def test_warp_and_block_collectives():
    """Shuffles (index, xor, up, down, with widths), votes, reductions,
    __match_any_sync and the _or/_and/_count barriers against numpy, two
    blocks of 64 threads."""
    n = 128
    x = np.random.default_rng(3).integers(0, 50, n).astype(np.int32)
    names = ["shfl", "xor", "up", "down", "ballot", "any", "all", "radd", "rmin", "rmax", "match", "bor", "band",
             "bcount"]
    outs = cuda_check.launch("warp_ops.cu", "mqf_test_warp", {}, [mx.array(x)], [(n,)] * len(names),
                             [mx.int32] * len(names), (n, 1, 1), (64, 1, 1))
    got = {k: np.array(o) for k, o in zip(names, outs)}
    lane = np.arange(n) % 32
    warp = np.arange(n) // 32 * 32
    blk = np.arange(n) // 64 * 64
    assert np.array_equal(got["shfl"], x[warp + (lane * 5) % 32])
    assert np.array_equal(got["xor"], x[warp + (lane ^ 5)])  # lane ^ 5 stays in its 16-lane group
    up_src = lane - 3
    assert np.array_equal(got["up"], np.where(up_src >= lane // 8 * 8, x[warp + np.maximum(up_src, 0)], x))
    down_src = lane + 2
    assert np.array_equal(got["down"], np.where(down_src < 32, x[warp + np.minimum(down_src, 31)], x))
    w = x.reshape(-1, 32)
    bits = ((w & 1).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(1).astype(np.uint32).view(np.int32)
    assert np.array_equal(got["ballot"], np.repeat(bits, 32))
    assert np.array_equal(got["any"], np.repeat((w > 40).any(1), 32).astype(np.int32))
    assert np.array_equal(got["all"], np.ones(n, np.int32))
    assert np.array_equal(got["radd"], np.repeat(w.sum(1), 32))
    assert np.array_equal(got["rmin"], np.repeat(w.min(1), 32))
    assert np.array_equal(got["rmax"], np.repeat(w.max(1), 32))
    m = w % 4
    want = [int(((m[r] == m[r, l]).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum()) for r in range(n // 32)
            for l in range(32)]
    assert np.array_equal(got["match"].view(np.uint32), np.array(want, np.uint32))
    b = x.reshape(-1, 64)
    assert np.array_equal(got["bor"], np.repeat((b == 7).any(1), 64).astype(np.int32))
    assert np.array_equal(got["band"], np.ones(n, np.int32))
    assert np.array_equal(got["bcount"], np.repeat((b % 3 == 0).sum(1), 64))
    del blk


def test_planted_cp_async_wait_before_commit(sim):
    """gated_delta_scan.cu's copies waited for before their commit: the wait
    covers no group holding them."""
    from gdn_helpers import make_scan_inputs
    from mlx_qwen_fast.kernels.gated_delta_scan import gated_delta_scan

    src = (cuda_check.SOURCES / "gated_delta_scan.cu").read_text()
    assert "cp_async_commit();" in src
    q, k, v, g, beta, s0 = make_scan_inputs(1, 9, "strong", seed=5, dtype=mx.float32)
    with cuda_check.planted("gated_delta_scan.cu", "cp_async_commit();", ";", index=0):
        with pytest.raises(CudaCheckError, match="copies issued since the last commit_group"):
            gated_delta_scan(q, k, v, g, beta, s0)


# ---------------------------------------------------------------------------
# the PTX helpers' CPU bodies against exact references
# ---------------------------------------------------------------------------


def _bf16_bits_of(values):
    """Round-to-nearest-even bf16 bits of exact rationals (Fraction) or floats."""
    out = []
    for v in values:
        v = Fraction(v)
        if v == 0:
            out.append(0)
            continue
        f = float(v)  # nearest double: then the two bf16 neighbours of v bracket it
        b = int(np.array([f], np.float32).view(np.uint32)[0]) >> 16
        cands = {(b + d) & 0xFFFF for d in (-1, 0, 1, 2)}
        cands = {c for c in cands if (c & 0x7F80) != 0x7F80 and (c >> 15) == (v < 0)}  # finite, v's sign
        best = min(cands, key=lambda c: (abs(Fraction(float(np.array([c << 16], np.uint32).view(np.float32)[0])) - v),
                                         c & 1))
        out.append(best)
    return out


def _bf16_value(bits):
    return Fraction(float(np.array([bits << 16], np.uint32).view(np.float32)[0]))


def test_ptx_helper_cpu_bodies_are_exact():
    """cvt (bf16, f16, bf16x2), prmt, lop3, sub/fma.rn.bf16x2 on random and
    edge values: conversions vs MLX's own (round to nearest even), bf16x2
    arithmetic vs exact rational arithmetic rounded once, prmt vs the ISA's
    byte table."""
    rng = np.random.default_rng(7)
    n = 300
    fa = np.concatenate([(rng.standard_normal(n - 12) * 10.0 ** rng.integers(-3, 3, n - 12)).astype(np.float32),
                         np.float32([0.0, -0.0, 1.0, 65504.0, 65520.0, 1e-8, 3.4e38, 1.00390625, 1.01171875,
                                     -2.5, 6e-5, 1e-40])])
    a = fa.view(np.uint32).copy()
    b_bf = (rng.standard_normal((n, 2)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint32)
    b = (b_bf[:, 0] | (b_bf[:, 1] << 16)).astype(np.uint32)
    b[:8] = a[:8]  # pairs with a itself (sub: exact zeros)
    c = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    c[::3] = (b_bf[::3, 1] | (b_bf[::3, 0] << 16))  # bf16 pairs for fma's addend too
    a_bf = (rng.standard_normal((n, 2)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint32)
    a2 = (a_bf[:, 0] | (a_bf[:, 1] << 16)).astype(np.uint32)
    names = ["bf16", "f16", "f16f", "pair", "perm", "sub", "fma", "lop"]
    for av in (a, a2):
        outs = cuda_check.launch("ptx_ops.cu", "mqf_test_ptx", {}, [mx.array(av), mx.array(b), mx.array(c)],
                                 [(n,)] * 8, [mx.uint32] * 8, (n, 1, 1), (128, 1, 1), scalars=[n])
        got = {k: np.array(o) for k, o in zip(names, outs)}
        f = av.view(np.float32)
        assert np.array_equal(got["bf16"], np.array(mx.array(f).astype(mx.bfloat16).view(mx.uint16)).astype(np.uint32))
        with np.errstate(over="ignore"):  # 65520 and above round to infinity, as the cvt does
            f16 = f.astype(np.float16)
        assert np.array_equal(got["f16"], f16.view(np.uint16).astype(np.uint32))
        assert np.array_equal(got["f16f"].view(np.float32), (av & 0xFFFF).astype(np.uint16).view(np.float16)
                              .astype(np.float32), equal_nan=True)
        hi = np.array(mx.array(f).astype(mx.bfloat16).view(mx.uint16)).astype(np.uint32)
        lo = np.array(mx.array(b.view(np.float32)).astype(mx.bfloat16).view(mx.uint16)).astype(np.uint32)
        assert np.array_equal(got["pair"], (hi << 16) | lo)
        assert np.array_equal(got["lop"], (av & b) | c)
        for i in range(n):
            src = int(av[i]) | int(b[i]) << 32
            want = 0
            for k in range(4):
                s = (int(c[i]) >> (4 * k)) & 0xF
                byte = (src >> (8 * (s & 7))) & 0xFF
                if s & 8:
                    byte = 0xFF if byte & 0x80 else 0
                want |= byte << (8 * k)
            assert int(got["perm"][i]) == want, i
        for h in range(2):
            def half(w):
                return (int(w) >> (16 * h)) & 0xFFFF

            def ok(bits):  # finite, and far from overflow
                return (bits & 0x7F80) != 0x7F80 and abs(_bf16_value(bits)) < 1e15

            idx = [i for i in range(n) if ok(half(av[i])) and ok(half(b[i])) and ok(half(c[i]))]
            want_sub = _bf16_bits_of([_bf16_value(half(av[i])) - _bf16_value(half(b[i])) for i in idx])
            want_fma = _bf16_bits_of([_bf16_value(half(av[i])) * _bf16_value(half(b[i])) + _bf16_value(half(c[i]))
                                      for i in idx])
            assert [half(got["sub"][i]) for i in idx] == want_sub
            assert [half(got["fma"][i]) for i in idx] == want_fma


# ---------------------------------------------------------------------------
# planted bugs in the package's own kernels: each must be caught
# ---------------------------------------------------------------------------


def _rms_norm(rows, dtype=mx.bfloat16):
    from mlx_qwen_fast.kernels.gated_rms_norm import gated_rms_norm

    ks = mx.random.split(mx.random.key(rows), 3)
    y = mx.random.normal((rows, 128), key=ks[0]).astype(dtype)
    z = mx.random.normal((rows, 128), key=ks[1]).astype(dtype)
    w = mx.random.normal((128,), key=ks[2]).astype(dtype)
    return gated_rms_norm(y, z, w, 1e-6)


def _gdn_decode():
    from gdn_helpers import D
    from mlx_qwen_fast.kernels.gated_delta_contract import decode_params
    from mlx_qwen_fast.kernels.gated_delta_decode import gated_delta_decode

    Hk, Hv, B = 1, 2, 1
    C = (2 * Hk + Hv) * D
    ks = mx.random.split(mx.random.key(3), 6)
    w = mx.random.normal((C, 4, 1), key=ks[0]) * 0.5
    params = decode_params(w, mx.random.normal((Hv,), key=ks[1]), mx.random.normal((Hv,), key=ks[2]),
                           1 + 0.3 * mx.random.normal((D,), key=ks[3]))
    proj = mx.random.normal((B, 1, C + Hv * D + 2 * Hv), key=ks[4])
    state = 0.5 * mx.random.normal((B, Hv, D, D), key=ks[5])
    return gated_delta_decode(proj, params, None, state, num_k_heads=Hk, num_v_heads=Hv)


def test_planted_store_past_the_end(sim):
    """gated_rms_norm.cu without its row guard on the store: the rows past N
    of the last block write past the output (4 rows: 64 threads of 256)."""
    assert not mx.isnan(_rms_norm(4)).any().item()
    with cuda_check.planted("gated_rms_norm.cu", "  if (ok) {\n    store4(out + base, o);", "  {\n    store4(out + base, o);"):
        # rows past N read row 0 (clamped) but store at their own row
        with cuda_check.planted("gated_rms_norm.cu", "const size_t base = (size_t)(ok ? row : 0) * D + l * 8;",
                                "const size_t base = (size_t)row * D + l * 8;"):
            with pytest.raises(CudaCheckError, match=r"out-of-bounds access of array 'in0'"):
                _rms_norm(4)


def test_planted_unwritten_output(sim):
    """gated_rms_norm.cu with one lane of every row skipping its store: the
    elements it owns stay poisoned and the launch names the first of them."""
    with cuda_check.planted("gated_rms_norm.cu", "  if (ok) {\n    store4(out + base, o);",
                            "  if (ok && l != 5) {\n    store4(out + base, o);"):
        with pytest.raises(CudaCheckError, match=r"output 0 \(3, 128\): 24 elements hold the poison pattern "
                                                 r"\(never written.*the first at flat index 40 \(index \(0, 40\)\)"):
            _rms_norm(3)


def test_planted_wrong_shuffle_mask(sim):
    """warp_sum (gdn_common.cuh) with a half-warp mask: lanes 16-31 call it
    with a mask that leaves them out."""
    with cuda_check.planted("gdn_common.cuh", "v += __shfl_xor_sync(0xffffffffu, v, o);",
                            "v += __shfl_xor_sync(0x0000ffffu, v, o);"):
        with pytest.raises(CudaCheckError, match=r"__shfl_xor_sync at gdn_common.cuh:\d+: lane \d+ calls it with mask "
                                                 r"0x0000ffff, which leaves it out"):
            _rms_norm(8)


def test_planted_missing_syncthreads(sim):
    """gated_delta_decode.cu's step (gdn_decode_step.cuh) without each of its
    barriers in turn (e.g. the one after the key/query rows are staged in
    shared memory): threads read rows others have not written (a race only
    the other schedule exposes, or poison)."""
    ok = _gdn_decode()
    assert all(not mx.isnan(o).any().item() for o in ok)
    src = (cuda_check.SOURCES / "gdn_decode_step.cuh").read_text()
    caught = 0
    n = src.count("__syncthreads();")
    assert n >= 3
    for i in range(n):  # each barrier, removed in turn
        with cuda_check.planted("gdn_decode_step.cuh", "__syncthreads();", ";", index=i):
            try:
                out = _gdn_decode()
            except CudaCheckError as e:
                assert "depends on the order" in str(e) or "poison pattern" in str(e), str(e)
                caught += 1
                continue
            # no schedule difference: then the result itself must be wrong (poison or stale data)
            assert any(not mx.array_equal(a, b).item() for a, b in zip(out, ok)), f"barrier {i} removed: not caught"
            caught += 1
    assert caught == n


def test_planted_lane_that_never_arrives(sim):
    """A lane returning before warp_sum's shuffles: the others wait for it."""
    with cuda_check.planted("gated_rms_norm.cu", "  ss = warp_sum<16>(ss);",
                            "  if (l == 3) return;\n  ss = warp_sum<16>(ss);"):
        with pytest.raises(CudaCheckError, match=r"lane 3 returned while lanes .* wait for it at __shfl_xor_sync"):
            _rms_norm(2)


def test_planted_wrong_mma_fragment_index(sim):
    """The 4-bit GEMV step (moe_decode_common.cuh's mma_word, which
    quantized_gemv.cu runs) with two A fragment registers of its mma swapped:
    the kernel runs clean but its product is wrong (the reference catches
    it; the right source matches)."""
    from mlx_qwen_fast.kernels.quantized_gemv import quantized_gemv

    K, N = 256, 64
    ks = mx.random.split(mx.random.key(11), 2)
    w, s, b = mx.quantize(mx.random.normal((N, K), key=ks[0]).astype(mx.bfloat16), group_size=64, bits=4)
    x = mx.random.normal((1, K), key=ks[1]).astype(mx.bfloat16)
    ref = x.astype(mx.float32) @ mx.dequantize(w, s, b, group_size=64, bits=4).T
    good = quantized_gemv(x, w, s, b, group_size=64, bits=4).astype(mx.float32)
    err = lambda y: (mx.linalg.norm(y - ref) / mx.linalg.norm(ref)).item()  # noqa: E731
    assert err(good) < 2**-7
    with cuda_check.planted("moe_decode_common.cuh", "mma_bf16(acc, p0[0], p1[0], p0[1], p1[1], bb[0], bb[1]);",
                            "mma_bf16(acc, p1[0], p0[0], p0[1], p1[1], bb[0], bb[1]);"):
        bad = quantized_gemv(x, w, s, b, group_size=64, bits=4).astype(mx.float32)
    assert err(bad) > 0.1


def _attention_decode(cap, off):
    from mlx_qwen_fast.kernels import attention_decode as ad
    from mlx_qwen_fast.kernels.attention_contract import proj_width

    B, hq, hkv, DH = 1, 16, 2, 256
    ks = mx.random.split(mx.random.key(cap), 5)
    proj = mx.random.normal((B, 1, proj_width(hq, hkv)), key=ks[0])
    keys = mx.random.normal((B, hkv, cap, DH), key=ks[1])
    values = mx.random.normal((B, hkv, cap, DH), key=ks[2])
    qw, kw = 1.0 + 0.3 * mx.random.normal((DH,), key=ks[3]), 1.0 + 0.3 * mx.random.normal((DH,), key=ks[4])
    return ad.attention_decode(proj, keys, values, mx.array(off, mx.int32), qw, kw, num_heads=hq, num_kv_heads=hkv,
                               scale=DH ** -0.5, q_eps=1e-6, k_eps=1e-6, rope_dims=64)


def test_planted_off_by_one_tile_edge(sim):
    """attention_decode.cu's partial kernel with its split's end one past the
    query and no longer clamped to the buffer: at a full buffer (offset =
    capacity - 1) the last head's key rows are read one past the end."""
    assert not mx.isnan(_attention_decode(64, 63)[0]).any().item()
    with cuda_check.planted("attention_decode.cu", "const int hi = min(min(lo + split_len, off + 1), cap);",
                            "const int hi = min(lo + split_len + 1, off + 2);"):
        with pytest.raises(CudaCheckError, match=r"out-of-bounds access of array 'in[12]'"):
            _attention_decode(64, 63)


def test_planted_missing_cp_async_wait(sim):
    """attention_decode.cu's partial kernel reading a K/V tile before its
    cp.async group is waited for: caught (the copies land only at a wait)."""
    out = _attention_decode(200, 150)[0]
    assert not mx.isnan(out).any().item()
    with cuda_check.planted("attention_decode.cu", "      cp_async_wait<1>();", "      (void)0;"):
        with pytest.raises(CudaCheckError):
            _attention_decode(200, 150)


def test_planted_missing_grid_barrier():
    """grid_exchange.cu without its grid barrier: blocks read partials that
    other blocks have not written yet (the two block orders differ)."""
    with pytest.raises(CudaCheckError, match="depends on the order"):
        _exchange(5, NO_GRID_BARRIER=1)
    _exchange(5)  # the same build without the plant passes


def _slot_of(tag):
    """The slot of grid_sync.cuh's table that a launch's tag takes (its Fibonacci hash)."""
    return ((tag * 0x9E3779B97F4A7C15) % 2**64 >> 58) % 64


def _slots(tags, G=4, **defines):
    L = len(tags)
    x = mx.random.normal((L * G * 64,), key=mx.random.key(L * G + sum(tags)))
    outs = cuda_check.launch("grid_slots.cu", "mqf_test_slots", {"MQF_G": G, **defines},
                             [x, mx.array(tags, dtype=mx.uint64)], [(L * G,)] * 3, [mx.float32] * 3,
                             (L * G * 64, 1, 1), (64, 1, 1))
    return x.reshape(L, G, 64), outs


@pytest.mark.parametrize("tags", [(1, 2), (1, 56), (3, 1, 56, 90), (5,)])
def test_grid_barrier_slots_keep_launches_apart(tags):
    """Launches of one grid-barrier kernel running at once (grid_slots.cu:
    several launches' CTAs in one resident grid), each on the slot its tag
    takes: distinct slots, one slot (the later waits until the earlier frees
    it), both; every launch's CTAs see their own launch's sums only."""
    assert _slot_of(1) == _slot_of(56) == _slot_of(90) != _slot_of(3)  # the cases' premise
    x, (partial, total, nxt) = _slots(tags)
    sums = np.array(x.sum(axis=-1))
    assert np.allclose(np.array(partial), sums.reshape(-1), rtol=1e-5, atol=1e-5)
    want = np.repeat(sums.sum(axis=1), x.shape[1])
    assert np.allclose(np.array(total), want, rtol=1e-5, atol=1e-4)
    assert np.array_equal(np.array(nxt), np.array(total))


def test_planted_launches_at_once_on_one_counter():
    """grid_slots.cu with every launch on one counter (NO_SLOTS: no slot
    claimed): two launches at once break its barrier."""
    with pytest.raises(CudaCheckError):
        _slots((1, 2), NO_SLOTS=1)
    _slots((1, 2))  # the same launch with slots passes


def test_planted_slot_never_freed():
    """A launch that keeps its slot: the next launch of that slot waits forever."""
    with cuda_check.planted("grid_slots.cu", "grid_free(slot_of(tag), cta);", ""):
        with pytest.raises(CudaCheckError, match=r"spin-waits at grid_sync.cuh:\d+ and no thread can make progress"):
            _slots((1, 56))
        _slots((1, 2))  # distinct slots: no launch waits


def _stacks(blocks, **defines):
    x = mx.arange(blocks * 64, dtype=mx.float32)
    (y,) = cuda_check.launch("stack_overflow.cu", "mqf_test_stack", defines, [x], [(blocks * 64,)],
                             [mx.float32], (blocks * 64, 1, 1), (64, 1, 1))
    return x, y


def test_stack_overflow_of_a_thread_is_caught():
    """A launch of more threads at once than the check gives guard pages
    (a whole resident grid of 10,240 threads; stacks past the first 8,192
    carry a canary instead): it runs, and a thread that overflows its stack
    fails it, with a guard page and with a canary."""
    x, y = _stacks(160)
    assert mx.array_equal(y, 2 * x).item()
    for thread in (5, 9000):  # a guarded stack, a canary one
        with pytest.raises(CudaCheckError, match=r"stack overflow of a thread"):
            _stacks(160, OVERFLOW_THREAD=thread)


def test_planted_grid_barrier_that_never_completes():
    """A grid barrier whose target one arrival short of reach: every block spins."""
    with cuda_check.planted("grid_exchange.cu", "grid_wait(ctr, 64);", "grid_wait(ctr, 65);"):
        with pytest.raises(CudaCheckError, match=r"spin-waits at grid_sync.cuh:\d+ and no thread can make progress"):
            _exchange(3)


# ---------------------------------------------------------------------------
# the simulated GPU's architecture branches; the in-kernel MoE routing
# ---------------------------------------------------------------------------

#: moe_route_common.cuh's sm_80+ arg-max: the taken expert's bit set in the
#: lane's mask (planted away below).
_TAKEN = "taken |= 1u << (id >> 5);"


def _route_logits(n, E, seed, dtype=mx.bfloat16):
    """Router logits [n, E]: row 0 all equal, the odd rows from {0, 1, 2, 3}
    (exact ties everywhere), the other rows random."""
    rng = np.random.default_rng(seed)
    lg = rng.normal(size=(n, E)).astype(np.float32) * 2.0
    lg[1::2] = rng.integers(0, 4, size=lg[1::2].shape)
    lg[0] = 0.0
    return mx.array(lg).astype(dtype)


def _top_k_ids(logits, k):
    """The expected selection: logits descending, ties by the lower id."""
    lg = np.asarray(logits.astype(mx.float32))
    return np.stack([np.lexsort((np.arange(lg.shape[1]), -row))[:k] for row in lg])


def test_builds_take_the_simulated_architecture_branch():
    """The CPU builds define __CUDA_ARCH__ of the simulated GPU (900 by
    default), as nvcc and NVRTC do: moe_route_common.cuh's sm_80+ arg-max
    (redux.sync over keys, the taken experts a bit mask) is what runs, so
    that with the taken mask planted away every round picks the same
    expert again; under arch (7, 5) its older shuffle arg-max runs, which
    the plant does not touch."""
    from mlx_qwen_fast.kernels import moe_routing as mr

    logits = _route_logits(4, 64, 5)
    with cuda_check.simulated():
        inds, scores = mr.route(logits, 8)
        assert np.array_equal(np.asarray(inds), _top_k_ids(logits, 8))
        with cuda_check.planted("moe_route_common.cuh", _TAKEN, ""):
            bad, _ = mr.route(logits, 8)
    assert all(len(set(row)) == 1 for row in np.asarray(bad).tolist())
    with cuda_check.simulated(arch=(7, 5)):
        with cuda_check.planted("moe_route_common.cuh", _TAKEN, ""):
            old, old_scores = mr.route(logits, 8)
    assert np.array_equal(np.asarray(old), np.asarray(inds)) and mx.array_equal(old_scores, scores).item()


@pytest.mark.parametrize("E,k,dtype", [(32, 32, mx.bfloat16), (64, 8, mx.bfloat16), (160, 3, mx.float16),
                                       (512, 8, mx.float32), (1024, 31, mx.bfloat16)])
def test_routing_branches_agree(E, k, dtype):
    """The routing's two arg-max branches (sm_80+: redux.sync on keys with a
    taken mask; older GPUs: shuffles on (probability, id)) on the same
    logits: the same experts and weights, bit for bit, ties by the lower id,
    from one logit per lane (E = 32, every expert taken) to 32 (E = 1024)."""
    from mlx_qwen_fast.kernels import moe_routing as mr

    logits = _route_logits(6, E, E + k, dtype)
    out = []
    for arch in ((9, 0), (7, 5)):
        with cuda_check.simulated(arch=arch):
            out.append([np.asarray(a) for a in mr.route(logits, k, normalize=k > 1)])
    (i9, s9), (i7, s7) = out
    assert np.array_equal(i9, _top_k_ids(logits, k))
    assert np.array_equal(i9, i7) and np.array_equal(s9.view(np.uint32), s7.view(np.uint32))


def test_planted_routing_barrier_missing_in_gate_up(sim):
    """moe_decode_gemv.cu's gate+up build that routes, without the barrier
    between the routing warps' writes of the ids to shared memory and every
    warp's read: the other warps read ids not yet written (poison), so that
    the CTA no longer agrees on whether a lower pair owns its expert (some
    warps return, the rest wait at the reduction's barrier), or a race the
    other schedule exposes."""
    from moe_blocks import make_arrays, x_tokens

    from mlx_qwen_fast.kernels import moe_decode_gemv as md

    experts, shared, eg = make_arrays(E=32, D=256, I=128, seed=3)
    x, logits = x_tokens(2, 256, 4), _route_logits(2, 32, 6)
    good = md.route_gate_up_swiglu(x, logits, 4, experts, shared, eg)
    assert not mx.isnan(good[0]).any().item()
    with cuda_check.planted("moe_decode_gemv.cu", "    __syncthreads();\n  }\n  const int* ids = rinds;",
                            "  }\n  const int* ids = rinds;"):
        try:
            bad = md.route_gate_up_swiglu(x, logits, 4, experts, shared, eg)
        except CudaCheckError as e:
            assert re.search(r"depends on the order|out-of-bounds|__syncthreads at moe_decode_gemv\.cu:\d+ after \d+ "
                             r"threads of the block returned", str(e)), str(e)
        else:
            assert any(not mx.array_equal(a, b).item() for a, b in zip(bad, good)), "missing barrier not caught"
def _mixer(shape):
    """The one-launch GDN mixer (bf16) on a grid of 3 blocks: several
    input-projection tiles per team, several (row, head) items per block."""
    from gdn_helpers import mixer_arrays
    from mlx_qwen_fast.kernels import gdn_mixer_decode as gm

    K, hk, hv = shape
    a = mixer_arrays(7, 2, K, hk, hv, mx.bfloat16)
    params = gm.mixer_params(a.conv_weight, a.A_log, a.dt_bias, a.norm_weight, a.input_norm_weight)
    with cuda_check.simulated(sm_count=3):
        out = gm.gdn_mixer_decode(a.x, a.in_proj, params, a.conv_state, a.state, a.out_proj, num_k_heads=hk,
                                  num_v_heads=hv, input_norm_eps=1e-6)
        mx.eval(out)
    return out


#: GridBarriers::wait (grid_sync.cuh) with barrier b's wait left out (the slot still freed after the
#: last): what a body without that barrier would run.
_WAIT = "grid_wait(ctr(), base + b * BARW);"


def _skip_wait(b: int) -> str:
    return f"if (b != {b}) {_WAIT}"


@pytest.mark.parametrize("what,shape,source,old,new,index", [
    ("grid barrier 1 (proj written)", (256, 2, 4), "grid_sync.cuh", _WAIT, _skip_wait(1), None),
    ("grid barrier 2 (y written)", (256, 2, 4), "grid_sync.cuh", _WAIT, _skip_wait(2), None),
    ("y staged for out_proj", (256, 2, 4), "gdn_mixer_body.cuh", "ldcg16(y + 8 * i);\n    __syncthreads();",
     "ldcg16(y + 8 * i);", None),
    ("a tile round's partial sums read before the next round writes them (qg_tiles)", (1024, 2, 8),
     "qgemv_tile.cuh",
     "qg_store<Cfg, RES>(acc, out, residual, tile * 16, n_rows, g, t);\n      }\n      __syncthreads();",
     "qg_store<Cfg, RES>(acc, out, residual, tile * 16, n_rows, g, t);\n      }", None),
])
def test_planted_missing_barriers_in_the_mixer(what, shape, source, old, new, index):
    """gdn_mixer_decode.cu (its body, gdn_mixer_body.cuh; its grid barriers,
    grid_sync.cuh; or the GEMV tiles it runs from qgemv_tile.cuh) without
    one of its barriers: blocks read scratch that other blocks have
    not written yet, or threads shared memory that others have not written
    or still read: caught as a schedule-dependent output, or as results that
    differ from the intact kernel's."""
    ok = _mixer(shape)
    assert all(not mx.isnan(o).any().item() for o in ok)
    with cuda_check.planted(source, old, new, index=index):
        try:
            bad = _mixer(shape)
        except CudaCheckError as e:
            assert "depends on the order" in str(e), str(e)
            return
    assert any(not mx.array_equal(a, b).item() for a, b in zip(bad, ok)), f"{what}: removed, not caught"


def test_mixer_traps_on_a_counter_it_cannot_use():
    """The one-launch mixer whose barrier counter (its slot's) reads as a
    value no launch can leave (1500 more: remainder mod 2 * BARW at least
    BARW) traps rather than pass a barrier early."""
    ok = _mixer((256, 2, 4))
    assert all(not mx.isnan(o).any().item() for o in ok)
    claim = "v0 = ld_relaxed_u64(&grid_claim(SLOTS::table(), grid_tag())->ctr);"
    with cuda_check.planted("grid_sync.cuh", claim, claim[:-1] + " + 1500;"):
        with pytest.raises(CudaCheckError, match=r"gdn_mixer_decode.cu .*__trap\(\) at grid_sync.cuh"):
            _mixer((256, 2, 4))


def _moe_block():
    """The one-launch MoE block (2 rows, top-4 of 32 experts, D 256, I 128)
    on a grid of 3 blocks: several router tiles, gate+up items and down
    tiles per block."""
    from moe_blocks import make_arrays, quant
    from mlx_qwen_fast.kernels import moe_block_decode as mb

    experts, shared, eg = make_arrays(E=32, D=256, I=128, seed=5)
    router = quant((32, 256), 55, scale=3.0, bits=8)
    nw = (1.0 + 0.2 * mx.random.normal((256,), key=mx.random.key(56))).astype(mx.bfloat16)
    x = (2.0 * mx.random.normal((2, 1, 256), key=mx.random.key(57))).astype(mx.bfloat16)
    with cuda_check.simulated(sm_count=3):
        out = mb.moe_block_decode(x, nw, router, experts, shared, eg, top_k=4, norm_eps=1e-6)
        mx.eval(out)
    return out


@pytest.mark.parametrize("what,source,old,new", [
    ("grid barrier 1 (logits written)", "grid_sync.cuh", _WAIT, _skip_wait(1)),
    ("grid barrier 2 (h and the shared gate written)", "grid_sync.cuh", _WAIT, _skip_wait(2)),
    ("h staged for the down tiles", "moe_block_body.cuh", "ldcg16(h + 8 * i);\n  __syncthreads();",
     "ldcg16(h + 8 * i);"),
])
def test_planted_missing_barriers_in_the_moe_block(what, source, old, new):
    """moe_block_decode.cu (its body, moe_block_body.cuh; its grid barriers,
    grid_sync.cuh) without one of its barriers: blocks route from
    logits, or read SwiGLU rows, that other blocks have not written yet, or
    threads read staged rows others have not written: caught as a
    schedule-dependent output, as an unwritten (poisoned) output, or as
    results that differ from the intact kernel's."""
    ok = _moe_block()
    assert not mx.isnan(ok).any().item()
    with cuda_check.planted(source, old, new):
        try:
            bad = _moe_block()
        except CudaCheckError as e:
            assert re.search(r"depends on the order|never written|poison|out-of-bounds", str(e)), str(e)
            return
    assert not mx.array_equal(bad, ok).item(), f"{what}: removed, not caught"


def _gdn_layer():
    """The one-launch GDN decoder layer (2 rows; mixer K 256, 2/4 heads; MoE
    top-4 of 32 experts, I 128) on a grid of 3 blocks."""
    from gdn_helpers import mixer_arrays
    from moe_blocks import make_arrays, quant
    from mlx_qwen_fast.kernels import gdn_layer_decode as gl
    from mlx_qwen_fast.kernels import gdn_mixer_decode as gm

    a = mixer_arrays(9, 2, 256, 2, 4, mx.bfloat16)
    params = gm.mixer_params(a.conv_weight, a.A_log, a.dt_bias, a.norm_weight, a.input_norm_weight)
    experts, shared, eg = make_arrays(E=32, D=256, I=128, seed=15)
    router = quant((32, 256), 65, scale=3.0, bits=8)
    nw = (1.0 + 0.2 * mx.random.normal((256,), key=mx.random.key(66))).astype(mx.bfloat16)
    with cuda_check.simulated(sm_count=3):
        out = gl.gdn_layer_decode(a.x, a.in_proj, params, a.conv_state, a.state, a.out_proj, nw, router, experts,
                                  shared, eg, num_k_heads=2, num_v_heads=4, input_norm_eps=1e-6, top_k=4,
                                  post_norm_eps=1e-6)
        mx.eval(out)
    return out


@pytest.mark.parametrize("what,source,old,new", [
    ("the join (h written by the mixer's out_proj tiles)", "grid_sync.cuh", _WAIT, _skip_wait(3)),
    ("the block's first barrier (logits written)", "grid_sync.cuh", _WAIT, _skip_wait(4)),
    ("the block's second barrier (SwiGLU rows written)", "grid_sync.cuh", _WAIT, _skip_wait(5)),
])
def test_planted_missing_barriers_in_the_gdn_layer(what, source, old, new):
    """gdn_layer_decode.cu without the join or a barrier of its MoE block:
    blocks read h, logits or SwiGLU rows that other blocks have not written
    yet (caught as a schedule-dependent, unwritten or different output).
    (The check cannot tell a non-coherent load from an L2 one: that h is
    read through L2 only is the source's contract, not tested here.)"""
    ok = _gdn_layer()
    assert all(not mx.isnan(o).any().item() for o in ok)
    with cuda_check.planted(source, old, new):
        try:
            bad = _gdn_layer()
        except CudaCheckError as e:
            assert re.search(r"depends on the order|never written|poison|out-of-bounds", str(e)), str(e)
            return
    assert any(not mx.array_equal(a, b).item() for a, b in zip(bad, ok)), f"{what}: planted, not caught"


def _attention_layer():
    """The one-launch attention decoder layer (2 rows; K 256, 4 query and 2
    KV heads, a cache of 160 positions in 2 splits, this token at 70; MoE
    top-4 of 32 experts, I 128) on a grid of 3 blocks: (out, keys, values)."""
    from moe_blocks import make_arrays, quant
    from mlx_qwen_fast.kernels import attention_layer_decode as al

    def norm_w(seed, n):
        return (1.0 + 0.2 * mx.random.normal((n,), key=mx.random.key(seed))).astype(mx.bfloat16)

    x = (2.0 * mx.random.normal((2, 1, 256), key=mx.random.key(70))).astype(mx.bfloat16)
    keys, values = (mx.random.normal((2, 2, 160, 256), key=mx.random.key(s)).astype(mx.bfloat16) for s in (71, 72))
    experts, shared, eg = make_arrays(E=32, D=256, I=128, seed=73)
    with cuda_check.simulated(sm_count=3):
        out = al.attention_layer_decode(x, norm_w(74, 256), quant((3072, 256), 75, scale=4.0), norm_w(76, 256),
                                        norm_w(77, 256), keys, values, mx.array(70, mx.int32),
                                        quant((256, 1024), 78, scale=2.0), norm_w(79, 256),
                                        quant((32, 256), 80, scale=3.0, bits=8), experts, shared, eg, num_heads=4,
                                        num_kv_heads=2, scale=1 / 16, input_norm_eps=1e-6, q_eps=1e-6, k_eps=1e-6,
                                        rope_dims=64, top_k=4, post_norm_eps=1e-6)
        mx.eval(out)
    return out


@pytest.mark.parametrize("what,source,old,new", [
    ("barrier 1 (proj written)", "grid_sync.cuh", _WAIT, _skip_wait(1)),
    ("barrier 2 (the partials written)", "grid_sync.cuh", _WAIT, _skip_wait(2)),
    ("barrier 3 (y written)", "grid_sync.cuh", _WAIT, _skip_wait(3)),
    ("the join (h written)", "grid_sync.cuh", _WAIT, _skip_wait(4)),
    ("this token's row from proj (the buffer's stale row read instead)", "attention_layer_decode.cu",
     "if (holds_off && t == q0.tiles - 1) {", "if (false) {"),
])
def test_planted_bugs_in_the_attention_layer(what, source, old, new):
    """attention_layer_decode.cu without one of its grid barriers (blocks
    read proj, partials, y or h before other blocks wrote them), or with the
    current position's K/V row taken from the cache buffer (not yet
    written) instead of the projection: caught as a schedule-dependent,
    unwritten or different output."""
    ok = _attention_layer()
    assert all(not mx.isnan(o).any().item() for o in ok)
    with cuda_check.planted(source, old, new):
        try:
            bad = _attention_layer()
        except CudaCheckError as e:
            assert re.search(r"depends on the order|never written|poison|out-of-bounds", str(e)), str(e)
            return
    assert any(not mx.array_equal(a, b).item() for a, b in zip(bad, ok)), f"{what}: planted, not caught"
