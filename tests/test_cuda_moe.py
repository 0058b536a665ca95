"""CUDA MoE kernels (routing, grouped GEMM) vs the ops.moe references.

The kernel tests are marked ``cuda`` and skipped where MLX has no CUDA backend;
the host-side helpers (nibble unpacking, launch plans, tile choice, shape
checks, dispatch gating) run everywhere. On the GPU machine:

    source .mlxcuda/boot.sh && PYTHONPATH=. python3 -m pytest -q tests/test_cuda_moe.py

Outputs are poisoned with NaN before every launch (``set_poison``), inputs are
fresh random data; references are ``ops.moe.route`` / ``group_by_expert`` /
``block_map`` / ``expert_swiglu`` (stock ``gather_qmm``) and an fp32 matmul on
``mx.dequantize``-d weights.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from mlx_qwen_fast.kernels import moe_grouped_gemm as gg
from mlx_qwen_fast.kernels import moe_routing as mr
from mlx_qwen_fast.ops import moe

import moe_blocks  # tests/ is on sys.path
from cuda_helpers import BF16_EPS, GATHER_QMM_TOL, HAS_CUDA, cuda, finite, needs_cuda, npa, rel


@functools.lru_cache(maxsize=None)
def qproj(E, O, K, seed, scale=1.0):
    """A bf16 4-bit QuantizedSwitchLinear E x (K -> O), random weights from
    ``seed``; built once per argument set (the tests never modify it)."""
    p = QuantizedSwitchLinear(K, O, E, bias=False, group_size=64, bits=4)
    w = mx.random.normal((E, O, K), key=mx.random.key(seed)) * (scale / K**0.5)
    p.weight, p.scales, p.biases = mx.quantize(w.astype(mx.bfloat16), group_size=64, bits=4)
    mx.eval(p.parameters())
    return p


def make_logits(n, E, kind, seed, dtype):
    z = mx.random.normal((n, E), key=mx.random.key(seed)) * 2.0
    if kind == "skewed":  # a handful of popular experts
        bias = mx.zeros((E,)).at[mx.array([3, 4, 5, 200 % E])].add(3.0)
        z = z + bias
    elif kind == "empty":  # 8 experts take everything, the rest are empty
        bias = mx.zeros((E,)).at[mx.arange(8) * 3].add(40.0)
        z = z + bias
    elif kind == "one":  # every token's top-1 is expert 17
        z = z + mx.zeros((E,)).at[17].add(60.0)
    return z.astype(dtype)


# ---------------------------------------------------------------------------
# host-side helpers (run everywhere)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("K", [64, 192, 320, 2048])
def test_unpack_matches_mx_dequantize(K):
    w = (mx.random.normal((4, 64, K), key=mx.random.key(K)) * 3).astype(mx.bfloat16)
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    # MLX's CPU dequantize rounds twice, bf16(bf16(s * q) + b), as the kernel
    # does; its CUDA backend rounds once (measured on the H200, 2026-12-01),
    # so the bit-exact reference is taken on the CPU stream.
    ref = npa(mx.dequantize(wq, s, b, group_size=64, bits=4, stream=mx.cpu))
    got = gg.unpack_affine_4bit(wq, s, b)
    assert got.shape == ref.shape
    assert np.array_equal(got, ref)  # bit-exact, low nibble first
    # the other nibble order is clearly wrong (guards the test itself)
    wn = np.asarray(wq).astype(np.uint32)
    swapped = ((wn & 0x0F0F0F0F) << 4) | ((wn >> 4) & 0x0F0F0F0F)
    assert not np.array_equal(gg.unpack_affine_4bit(swapped, s, b), ref)


def _bf16_once_f64(v):
    """float64 -> nearest bf16 (8 significant bits, ties to even), as float64."""
    m, e = np.frexp(np.asarray(v, dtype=np.float64))  # v = m * 2**e, 0.5 <= |m| < 1
    return np.ldexp(np.round(m * 256.0), e - 8)  # np.round: half to even


@pytest.mark.parametrize("K", [64, 320, 2048])
def test_unpack_once_rounding(K):
    """rounding="once" (MOE_DEQ=1 variants): bf16(s*q + b) from the exact value."""
    w = (mx.random.normal((4, 64, K), key=mx.random.key(K + 1)) * 3).astype(mx.bfloat16)
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    got = gg.unpack_affine_4bit(wq, s, b, rounding="once")
    wn = np.asarray(wq).astype(np.uint64)
    q = np.stack([(wn >> np.uint64(4 * j)) & np.uint64(15) for j in range(8)], -1)
    q = q.reshape(*wn.shape[:-1], K).astype(np.float64)
    s64 = np.repeat(npa(s).astype(np.float64), 64, axis=-1)
    b64 = np.repeat(npa(b).astype(np.float64), 64, axis=-1)
    ref = _bf16_once_f64(s64 * q + b64)
    assert got.dtype == np.float32 and got.shape == ref.shape
    assert np.array_equal(got.astype(np.float64), ref)
    # the two roundings differ somewhere (guards the test itself), by at most
    # half an ulp of bf16(s*q) (the extra rounding) plus one ulp of the result
    twice = gg.unpack_affine_4bit(wq, s, b, rounding="twice").astype(np.float64)
    if K >= 320:
        assert not np.array_equal(got, twice)
    assert np.all(np.abs(ref - twice) <= np.abs(s64 * q) * 2.0**-8 + np.abs(ref) * 2.0**-7)
    with pytest.raises(ValueError, match="rounding"):
        gg.unpack_affine_4bit(wq, s, b, rounding="thrice")


@cuda
@needs_cuda
def test_unpack_once_matches_cuda_dequantize():
    w = (mx.random.normal((4, 64, 2048), key=mx.random.key(5)) * 3).astype(mx.bfloat16)
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    ref = npa(mx.dequantize(wq, s, b, group_size=64, bits=4))  # GPU stream
    assert np.array_equal(gg.unpack_affine_4bit(wq, s, b, rounding="once"), ref)


def test_grouped_gemm_variant_config():
    assert gg.DEFAULT_VARIANT in gg.VARIANTS and set(gg.VARIANT_ROUNDING) == set(gg.VARIANTS)
    for v in gg.VARIANTS:
        if v == "wg":  # own layout: test_wg_variant_config
            continue
        for kind, o in ((0, 512), (1, 2048), (0, 192), (1, 320)):
            for bm in gg.TILE_CHOICES:
                c = gg.variant_config(v, kind, bm, o)
                d = c["defines"]
                assert d["MOE_BM"] == bm and o % c["bn"] == 0 and c["bn"] == d["MOE_BN"]
                wm, wn = d.get("MOE_WM", 2), d.get("MOE_WN", 2)
                assert c["threads"] == 32 * wm * wn
                assert (bm // wm) % 16 == 0 and (c["bn"] // wn) % 8 == 0
                assert bm * 8 % c["threads"] == 0 and c["bn"] * 8 % c["threads"] == 0
                nmat = 2 if kind == 0 else 1
                if v == "async":  # dynamic shared memory: stages x (A + W + scale/bias)
                    assert c["smem"] == d["MOE_STAGES"] * (bm * 144 + nmat * c["bn"] * 40) <= 227 * 1024
                    assert c["source"] == "moe_grouped_gemm_async.cu" and d["MOE_WN"] * 32 * d["MOE_WM"] == c["threads"]
                else:
                    assert 2 * 72 * (bm + nmat * c["bn"]) + 4 * bm <= 48 * 1024  # static smem
                    assert c.get("smem", 0) == 0
                assert (d.get("MOE_DEQ", 0) == 1) == (gg.VARIANT_ROUNDING[v] == "once")
    assert gg.variant_config("base", 0, 64, 512)["defines"] == dict(MOE_BM=64, MOE_BN=64)
    assert gg.variant_config("big", 1, 64, 2048)["bn"] == 128
    assert gg.variant_config("big", 1, 64, 320)["bn"] == 64  # 320 % 128 != 0
    with pytest.raises(ValueError, match="variant"):
        gg.variant_config("nope", 0, 64, 512)
    with pytest.raises(ValueError, match="variant"):
        gg.choose_tile_rows(4096, 256, "nope")
    for v in gg.VARIANTS:
        for nk in (0, 1, 512 * 8, 2048 * 8, 4096 * 8, 100000):
            assert gg.choose_tile_rows(nk, 256, v) in gg.TILE_CHOICES
    assert gg.choose_tile_rows(4096 * 8, 256, "base") == 64
    assert gg.choose_tile_rows(4096 * 8, 256, "pfl") == 64
    assert gg.choose_tile_rows(512 * 8, 256, "pfl") == 32
    assert gg.choose_tile_rows(4096 * 8, 256, "pflv") == 64
    # pflv: 16-byte weight fetches need BN = threads / 2 (BM 32/64, 128 threads);
    # gate+up at BM 64 capped at 128 registers; BM 128 (256 threads) builds as pfl
    d = gg.variant_config("pflv", 0, 64, 512)["defines"]
    assert d["MOE_WV"] == 1 and d["MOE_MINB"] == 4 and d["MOE_LDM"] == 1
    assert gg.variant_config("pflv", 1, 32, 2048)["defines"]["MOE_WV"] == 1
    assert "MOE_MINB" not in gg.variant_config("pflv", 1, 64, 2048)["defines"]
    assert gg.variant_config("pflv", 0, 128, 512)["defines"] == gg.variant_config("pfl", 0, 128, 512)["defines"]
    for args, what in (((0, 64.0, 512), "bm"), ((2, 64, 512), "kind"), ((-1, 64, 512), "kind"),
                       ((0, 64, 100), "out_cols"), ((1, 64, 0), "out_cols")):
        with pytest.raises(ValueError, match=what):
            gg.variant_config("pflv", *args)
    with pytest.raises(ValueError, match="out_cols"):
        gg.variant_config("async", 0, 64, 100)
    for bad in ("100", None, 1.5, True):
        with pytest.raises(ValueError, match="num_assignments"):
            gg.choose_tile_rows(bad, 256)
    assert gg.choose_tile_rows(4096 * 8, 256, "big") == 128
    assert gg.choose_tile_rows(512 * 8, 256, "async") == 32
    assert gg.choose_tile_rows(4096 * 8, 256, "async") == 64
    assert gg.choose_tile_rows(16384 * 8, 256, "async") == 64
    assert gg.variant_config("async", 0, 64, 512)["bn"] == 128
    assert gg.variant_config("async", 0, 64, 64)["bn"] == 64
    assert gg.variant_config("async", 1, 32, 2048)["bn"] == 256
    assert gg.variant_config("async", 1, 32, 320)["bn"] == 64


def _prmt(a, b, sel):
    """PTX prmt.b32 (default mode) on Python ints."""
    src = [(a >> (8 * i)) & 255 for i in range(4)] + [(b >> (8 * i)) & 255 for i in range(4)]
    out = 0
    for k in range(4):
        n = (sel >> (4 * k)) & 15
        byte = src[n & 7]
        if n & 8:
            byte = 255 if byte & 128 else 0
        out |= byte << (8 * k)
    return out


def test_async_variant_fragment_mapping():
    """CPU emulation of one K step of moe_grouped_gemm_async.cu for one warp
    tile (16 rows x 8 columns): the A registers read as 16-byte chunks, the B
    registers dequantised by dequant_pairs (prmt selectors, magic 128), fed
    to m16n8k16 with the PTX fragment layout, must give x . w over the 64
    natural inputs (values kept exact: small integers)."""
    rng = np.random.default_rng(0)
    A = rng.integers(-8, 8, size=(16, 64)).astype(np.int64)  # 16 rows, one K step
    q = rng.integers(0, 16, size=(8, 64)).astype(np.int64)   # 8 weight rows (n), nibbles
    words = np.zeros((8, 8), dtype=np.int64)
    for w in range(8):
        for j in range(8):
            words[:, w] |= q[:, 8 * w + j] << (4 * j)
    # thread (g, tq): dequantised pairs of words 2tq + h -> list of (k_lo, k_hi) values (q here)
    def pairs(word):
        v, u = word & 0x0F0F0F0F, (word >> 4) & 0x0F0F0F0F
        out = []
        for i in range(4):
            sel = i | ((8 | i) << 4) | ((4 + i) << 8) | ((12 + i) << 12)
            m = _prmt(int(v), int(u), sel) | 0x43004300
            lo, hi = (m & 0xFFFF) - 0x4300, (m >> 16) - 0x4300  # bf16 128 + q minus 128 (exact)
            out.append((lo, hi))
        return out
    C = np.zeros((16, 8), dtype=np.int64)
    for h in range(2):
        for half in range(2):  # kk = 2h + half
            Am = np.zeros((16, 16), dtype=np.int64)  # logical m16 x k16 slice
            Bm = np.zeros((16, 8), dtype=np.int64)   # logical k16 x n8
            for lane in range(32):
                g, tq = lane >> 2, lane & 3
                chunk = 2 * tq + h  # 16-byte chunk (8 inputs) of rows g, g + 8
                a_row = lambda r: [(A[r, 8 * chunk + 2 * i], A[r, 8 * chunk + 2 * i + 1]) for i in range(4)]  # noqa: E731
                ag, ag8 = a_row(g), a_row(g + 8)
                # kernel: kk even uses .x/.y, odd .z/.w; a0 row g, a1 row g+8, a2 row g (k+8), a3 row g+8 (k+8)
                a0, a2 = ag[2 * half], ag[2 * half + 1]
                a1, a3 = ag8[2 * half], ag8[2 * half + 1]
                Am[g, 2 * tq:2 * tq + 2] = a0
                Am[g + 8, 2 * tq:2 * tq + 2] = a1
                Am[g, 8 + 2 * tq:8 + 2 * tq + 2] = a2
                Am[g + 8, 8 + 2 * tq:8 + 2 * tq + 2] = a3
                p = pairs(int(words[g, chunk]))
                b0, b1 = p[2 * half], p[2 * half + 1]
                Bm[2 * tq:2 * tq + 2, g] = b0
                Bm[8 + 2 * tq:8 + 2 * tq + 2, g] = b1
            C += Am @ Bm
    np.testing.assert_array_equal(C, A @ q.T)
    # scale/bias chunk selection: prmt(sb, sb, 0x1010 | 0x3232) replicates the low / high bf16
    assert _prmt(0xBBBBAAAA, 0xBBBBAAAA, 0x1010) == 0xAAAAAAAA
    assert _prmt(0xBBBBAAAA, 0xBBBBAAAA, 0x3232) == 0xBBBBBBBB
    # which half: the kernel copies the aligned pair (row*kg + kt) & ~1 of
    # weight row row = e*O + n0 + wn*WNC + j*8 + g and takes its high half when
    # ((g & kg & 1) + kt) & 1 (row_par, ssel): must be element row*kg + kt,
    # also for odd kg = K/64 (the test shapes D = 192, 320, I = 64)
    for kg in (1, 3, 5, 8):
        for O, bn in ((64, 64), (192, 64), (512, 128), (2048, 256)):
            wnc = bn // 8
            for e in (0, 1, 3):
                for n0 in range(0, O, bn):
                    for wn in (0, 7):
                        for j in range(wnc // 8):
                            for g in range(8):
                                row = e * O + n0 + wn * wnc + j * 8 + g
                                for kt in range(kg):
                                    hi = ((g & kg & 1) + kt) & 1
                                    assert ((row * kg + kt) & ~1) + hi == row * kg + kt


def test_wg_variant_config():
    """The "wg" variant: 256 threads, 128 (gate+up) / 256 (down) features per
    CTA, dynamic shared memory = max(cp.async ring, epilogue staging) + 1024
    (alignment), within the 227 KB an SM grants one block."""
    for kind, feat in ((0, 128), (1, 256)):
        for bm in gg.TILE_CHOICES:
            c = gg.variant_config("wg", kind, bm, 2048)
            st = c["defines"]["MOE_STAGES"]
            assert c["threads"] == 256 and c["bn"] == feat and c["source"] == "moe_grouped_gemm_wgmma.cu"
            assert c["defines"]["MOE_BM"] == bm and 3 <= st <= 6
            staging = bm * (feat + 8) * 2 if kind == 0 else 0  # down stores from registers
            assert c["smem"] == max(st * bm * 256, staging) + 1024 <= 227 * 1024
            assert "MOE_FT" not in c["defines"]  # down_ft 1 by default
    # several feature tiles per down CTA only where h fits the ring and D splits evenly
    assert gg.variant_config("wg", 1, 64, 2048, 512, down_ft=4)["bn"] == 1024
    assert gg.variant_config("wg", 1, 64, 2048, 512, down_ft=4)["defines"]["MOE_FT"] == 4
    assert "MOE_FT" not in gg.variant_config("wg", 1, 64, 2048, 1024, down_ft=4)["defines"]  # K > 128 * stages
    assert "MOE_FT" not in gg.variant_config("wg", 1, 64, 512, 512, down_ft=4)["defines"]  # 512 % 1024
    assert "MOE_FT" not in gg.variant_config("wg", 0, 64, 512, 2048, down_ft=4)["defines"]
    assert "MOE_FT" not in gg.variant_config("wg", 1, 128, 2048, 512, down_ft=8)["defines"]  # tile 128: one
    assert gg.wg_down_ft(4096 * 8, 256) == 8 and gg.wg_down_ft(512 * 8, 256) == 1
    saved = dict(gg.WG_TUNE)
    try:
        gg.WG_TUNE["down_ft"] = 2
        assert gg.wg_down_ft(512 * 8, 256) == 2
        assert gg.variant_config("wg", 1, 64, 2048, 512)["defines"]["MOE_FT"] == 2
    finally:
        gg.WG_TUNE.clear()
        gg.WG_TUNE.update(saved)
    with pytest.raises(ValueError, match="multiple of 128"):
        gg.variant_config("wg", 0, 64, 192)
    with pytest.raises(ValueError, match="multiple of 256"):
        gg.variant_config("wg", 1, 64, 384)
    assert gg.wg_shapes_ok(2048, 512) and gg.wg_shapes_ok(256, 128)
    for d, i in ((192, 128), (320, 64), (384, 128), (2048, 64), (2048, 192)):
        assert not gg.wg_shapes_ok(d, i)
    assert gg.choose_tile_rows(512 * 8, 256, "wg") == 32
    assert gg.choose_tile_rows(2048 * 8, 256, "wg") == 32
    assert gg.choose_tile_rows(4096 * 8, 256, "wg") == 64


def test_default_variant_falls_back(monkeypatch):
    """The default ("wg") only where it runs: compute capability 9.0 and the
    shapes it takes; elsewhere the fallback (never an error)."""
    from mlx_qwen_fast.kernels import _cuda_build as cb

    assert gg.DEFAULT_VARIANT == "wg" and gg.FALLBACK_VARIANT in gg.VARIANTS
    monkeypatch.setattr(cb, "gpu_arch", lambda: (9, 0))
    assert gg.default_variant(2048, 512) == "wg"
    assert gg.default_variant(192, 128) == gg.FALLBACK_VARIANT
    assert gg.default_variant(2048, 64) == gg.FALLBACK_VARIANT
    monkeypatch.setattr(cb, "gpu_arch", lambda: (8, 0))
    assert gg.default_variant(2048, 512) == gg.FALLBACK_VARIANT

    def no_gpu():
        raise RuntimeError("no CUDA driver")

    monkeypatch.setattr(cb, "gpu_arch", no_gpu)
    assert gg.default_variant(2048, 512) == gg.FALLBACK_VARIANT


@pytest.mark.parametrize("lead", [(), (3,), (2, 5)])
def test_permute_k_is_the_kernel_order(lead):
    """permute_k puts natural input 32q + 8(s//2) + 2(s%2) + hs + 4j of each
    128-chunk at position 16s + 8hs + 2q + j (the fragment slot of thread q,
    k16 step s, register half hs, element j in moe_grouped_gemm_wgmma.cu),
    and unpermute_k undoes it."""
    K = 384
    a = mx.arange(int(np.prod(lead, dtype=np.int64)) * K).reshape(*lead, K)
    p = gg.permute_k(a)
    assert p.shape == a.shape
    want = np.empty(K, dtype=np.int64)
    for c in range(K // 128):
        for s in range(8):
            for hs in range(2):
                for q in range(4):
                    for j in range(2):
                        want[128 * c + 16 * s + 8 * hs + 2 * q + j] = (
                            128 * c + 32 * q + 8 * (s // 2) + 2 * (s % 2) + hs + 4 * j)
    assert sorted(want.tolist()) == list(range(K))
    np.testing.assert_array_equal(np.asarray(p).reshape(-1, K) % K, np.broadcast_to(want, (max(1, a.size // K), K)))
    assert mx.array_equal(gg.unpermute_k(p), a).item()
    assert not mx.array_equal(p, a).item()
    for bad in (mx.zeros((4, 64)), mx.zeros((200,)), mx.zeros(())):
        with pytest.raises(ValueError, match="multiple of 128"):
            gg.permute_k(bad)
        with pytest.raises(ValueError, match="multiple of 128"):
            gg.unpermute_k(bad)


def test_wg_variant_fragment_mapping():
    """CPU emulation of one 128-input chunk of moe_grouped_gemm_wgmma.cu for
    one warp's 16 weight rows: A registers dequantised as dq_pair does (nibble
    pair (a, a+4) of word s//2 of the thread's four, a = 2(s%2) + hs; magic
    128 subtracted exactly), placed by the wgmma m64nNk16 A-fragment layout;
    B read as wgmma reads the K-major tile (row n, positions 16s..16s+15) of
    the permute_k-ed activations. The sum over the 8 k16 steps must be
    W . x over the natural inputs (small integers: exact)."""
    rng = np.random.default_rng(1)
    N = 8
    q = rng.integers(0, 16, size=(16, 128)).astype(np.int64)  # 16 weight rows, nibble values
    x = rng.integers(-8, 8, size=(N, 128)).astype(np.int64)
    words = np.zeros((16, 16), dtype=np.int64)
    for w in range(16):
        for j in range(8):
            words[:, w] |= q[:, 8 * w + j] << (4 * j)
    xp = np.asarray(gg.permute_k(mx.array(x.astype(np.int32))))

    def dq_pair(word, a):
        m = ((int(word) >> (4 * a)) & 0x000F000F) | 0x43004300
        return (m & 0xFFFF) - 0x4300, (m >> 16) - 0x4300

    C = np.zeros((16, N), dtype=np.int64)
    for s in range(8):
        Am = np.full((16, 16), -999, dtype=np.int64)
        for lane in range(32):
            g, qq = lane >> 2, lane & 3
            wl, wh = words[g, 4 * qq + s // 2], words[g + 8, 4 * qq + s // 2]
            a = 2 * (s % 2)
            regs = [dq_pair(wl, a), dq_pair(wh, a), dq_pair(wl, a + 1), dq_pair(wh, a + 1)]
            # reg 0: (row g, slots 2q, 2q+1); 1: (g+8, 2q..); 2: (g, 2q+8..); 3: (g+8, 2q+8..)
            for r, (row, col) in enumerate(((g, 2 * qq), (g + 8, 2 * qq), (g, 2 * qq + 8), (g + 8, 2 * qq + 8))):
                Am[row, col:col + 2] = regs[r]
        assert (Am != -999).all()
        Bm = xp[:, 16 * s:16 * s + 16].T  # [k16, N]
        C += Am @ Bm
    np.testing.assert_array_equal(C, q @ x.T)


def test_plan_and_tiles():
    p = mr.plan(4096, 8, 256, 64)
    assert p["num_assignments"] == 32768
    assert p["max_tiles"] == 32768 // 64 + 256 == moe.max_tiles(32768, 256, 64)
    assert p["route_grid"] == (512 * 256, 1, 1)
    assert mr.plan(7, 8, 256, 32)["max_tiles"] == 2 + 256
    assert mr.plan(0, 8, 256, 32)["route_grid"][0] == 256
    # grouping: chunks of 1024 assignments up to GROUP_MAX_CTAS CTAs, then longer chunks
    assert (p["group_chunk"], p["group_grid"], p["group_block"]) == (1024, (32 * 1024, 1, 1), (1024, 1, 1))
    assert mr.plan(1, 8, 256, 32)["group_grid"] == (1024, 1, 1)
    assert mr.plan(0, 8, 256, 32)["group_grid"] == (1024, 1, 1)
    big = mr.plan(16385, 8, 256, 64)  # 131080 assignments > 128 * 1024
    assert big["group_chunk"] == 2048 and big["group_grid"][0] == 65 * 1024
    # the largest call: 32-bit grids, chunk ends and block-map indices stay in range
    top = mr.plan(mr.MAX_TOKENS, mr.MAX_ASSIGNMENTS // mr.MAX_TOKENS, 1024, 1)
    assert top["group_grid"][0] // 1024 <= mr.GROUP_MAX_CTAS
    assert top["group_grid"][0] // 1024 * top["group_chunk"] < 2**31 and 2 * top["max_tiles"] < 2**31
    assert mr.plan(mr.MAX_TOKENS, 1, 256, 64)["route_grid"][0] < 2**31
    for bad in [(mr.MAX_TOKENS + 1, 1, 256, 64), (mr.MAX_TOKENS, mr.MAX_ASSIGNMENTS // mr.MAX_TOKENS + 1, 256, 64),
                (4, 8, 256, mr.MAX_TILE_ROWS + 1), (4.5, 8, 256, 32), (4, 8.0, 256, 32)]:
        with pytest.raises(ValueError, match="plan"):
            mr.plan(*bad)
    with pytest.raises(ValueError, match="tile_rows"):
        mr.plan(4, 8, 256, 0)
    assert gg.choose_tile_rows(512 * 8, 256) == 32
    assert gg.choose_tile_rows(4096 * 8, 256) == 64
    assert gg.choose_tile_rows(1, 256) in gg.TILE_CHOICES


def test_routing_argument_errors():
    # checked before any GPU work: ValueError naming the argument, on any backend
    inds = mx.zeros((2, 8), mx.int32)
    for call, name in [
        (lambda: mr.route(mx.array(1.0), 1), "logits"),
        (lambda: mr.route([[0.0] * 64], 1), "logits"),
        (lambda: mr.route(mx.zeros((2, 64)), 2.0), "top_k"),
        (lambda: mr.route(mx.zeros((2, 48)), 2), "logits must"),
        (lambda: mr.route(mx.zeros((2, 64)), 33), "top_k must"),  # the logits are fine: top_k is named alone
        (lambda: mr.route(mx.zeros((2, 64)), 0), "top_k must"),
        (lambda: moe.route(mx.zeros((2, 8)), 2.5), "top_k must"),  # the reference op too
        (lambda: moe.route(np.zeros((2, 8), np.float32), 2), "logits must"),
        (lambda: mr.group(inds, 256, 2**31 - 1), "tile_rows"),
        (lambda: mr.group(inds, 256, 1.5), "tile_rows"),
        (lambda: mr.group(inds, 256.0, 32), "num_experts"),
        (lambda: mr.group(mx.zeros((2, 0), mx.int32), 256, 32), "k"),
        (lambda: mr.group(mx.zeros((2, 8), mx.float32), 256, 32), "inds"),
        (lambda: mr.group([[1] * 8], 256, 32), "inds"),
    ]:
        with pytest.raises(ValueError, match=name):
            call()
    assert not mr.supports(mx.array(1.0), 1)


def test_supports_arrays_shapes():
    E, D, I = 4, 192, 128
    x = mx.zeros((5, D), mx.bfloat16)
    g, u, d = (qproj(E, I, D, 1), qproj(E, I, D, 2), qproj(E, D, I, 3))
    arr = lambda p: (p.weight, p.scales, p.biases)  # noqa: E731
    assert gg.supports_arrays(x, arr(g), arr(u), arr(d))
    assert not gg.supports_arrays(x.astype(mx.float32), arr(g), arr(u), arr(d))
    # I = 96: output columns not a multiple of the 64-column tile -> refused
    g96, u96 = qproj(E, 96, D, 4), qproj(E, 96, D, 5)
    assert not gg.supports_arrays(x, arr(g96), arr(u96), arr(d))
    assert not gg.supports_arrays(x, arr(g), arr(u96), arr(d))  # gate/up mismatch
    d_bad = qproj(E, 256, I, 6)  # down output != D
    assert not gg.supports_arrays(x, arr(g), arr(u), arr(d_bad))
    if not HAS_CUDA:
        assert not gg.supports(x, g, u, d)
        assert not mr.supports(mx.zeros((3, 256)), 8)


def test_dispatch_by_backend_and_env(monkeypatch):
    from mlx_qwen_fast.kernels import _cuda_build as cb

    monkeypatch.delenv(moe.MOE_KERNEL_ENV, raising=False)
    monkeypatch.delenv(moe.MOE_DECODE_KERNEL_ENV, raising=False)
    monkeypatch.setattr(cb, "cuda_available", lambda: False)  # "cuda" asked for without a CUDA device
    assert moe.implementation_for(4096, "cuda") == "stock" and moe.implementation_for(1, "cuda") == "stock"
    monkeypatch.setattr(cb, "cuda_available", lambda: True)
    assert "cuda-kernel" in moe.IMPLEMENTATIONS
    n = moe.MOE_KERNEL_MIN_TOKENS
    assert moe.implementation_for(4096, "cuda") == "cuda-kernel"
    assert moe.implementation_for(n, "cuda") == "cuda-kernel"
    # below the prefill threshold: the decode kernels up to their maximum, stock between
    assert moe.implementation_for(1, "cuda") == "cuda-decode-kernel"
    assert moe.implementation_for(moe.MOE_DECODE_KERNEL_MAX_TOKENS, "cuda") == "cuda-decode-kernel"
    assert moe.implementation_for(moe.MOE_DECODE_KERNEL_MAX_TOKENS + 1, "cuda") == "stock"
    assert moe.implementation_for(n - 1, "cuda") == "stock"
    for b in ("cpu", "metal"):
        assert moe.implementation_for(4096, b) == "stock"
        assert moe.implementation_for(1, b) == "stock"
    monkeypatch.setenv(moe.MOE_KERNEL_ENV, "0")  # the A/B switch of the prefill kernels
    assert moe.implementation_for(4096, "cuda") == "stock"
    assert moe.implementation_for(1, "cuda") == "cuda-decode-kernel"
    monkeypatch.setenv(moe.MOE_KERNEL_ENV, "1")
    assert moe.implementation_for(4096, "cuda") == "cuda-kernel"
    monkeypatch.setenv(moe.MOE_DECODE_KERNEL_ENV, "0")  # the decode kernels' switch
    assert moe.implementation_for(1, "cuda") == "stock"
    assert moe.implementation_for(4096, "cuda") == "cuda-kernel"
    monkeypatch.setenv(moe.MOE_DECODE_KERNEL_ENV, "1")
    assert moe.implementation_for(1, "cuda") == "cuda-decode-kernel"


def test_cuda_kernel_impl_falls_back_to_stock_off_cuda():
    if HAS_CUDA:
        pytest.skip("checks the CPU fallback")
    block = make_block(D=128, H=64, E=32, k=4, dtype=mx.float32)
    x = mx.random.normal((2, 5, 128), key=mx.random.key(0))
    a = moe.sparse_moe(block, x, implementation="cuda-kernel")
    b = moe.sparse_moe(block, x, implementation="stock")
    assert mx.array_equal(a, b).item()
    x1 = x[:, :1]  # decode-sized call through the decode kernels' entry
    a1 = moe.sparse_moe(block, x1, implementation="cuda-decode-kernel")
    assert mx.array_equal(a1, moe.sparse_moe(block, x1, implementation="stock")).item()


# ---------------------------------------------------------------------------
# routing kernels
# ---------------------------------------------------------------------------


@cuda
@needs_cuda
def test_route_takes_leading_axes(poison):
    """route on [B, L, E] logits: the [B*L, E] result in [B, L, k] (no
    reshape node in the decode step); an empty leading axis gives empty."""
    logits = mx.random.normal((2, 3, 256), key=mx.random.key(31))
    i3, s3 = mr.route(logits, 8)
    i2, s2 = mr.route(logits.reshape(6, 256), 8)
    assert i3.shape == (2, 3, 8) and s3.shape == (2, 3, 8)
    assert mx.array_equal(i3.reshape(6, 8), i2).item() and mx.array_equal(s3.reshape(6, 8), s2).item()
    e_i, e_s = mr.route(mx.zeros((1, 0, 256)), 8)
    assert e_i.shape == (1, 0, 8) and e_s.shape == (1, 0, 8)


@cuda
@needs_cuda
@pytest.mark.parametrize("E,k", [(256, 8), (64, 4), (992, 31)])
def test_route_ties_take_the_lowest_id_first(poison, E, k):
    """Exact ties (logits from {0, 1, 2, 3}): slot j is the j-th expert by
    (probability descending, id ascending), every token (route_warp's rule)."""
    rng = np.random.default_rng(E + k)
    lg = rng.integers(0, 4, size=(33, E)).astype(np.float32)
    lg[0] = 0.0  # every expert tied
    inds, scores = mr.route(mx.array(lg), k)
    want = np.stack([np.lexsort((np.arange(E), -row))[:k] for row in lg])
    assert np.array_equal(np.asarray(inds), want)
    assert np.all(np.diff(np.asarray(scores), axis=1) <= 0)


def check_routing(logits, k, tile, normalize=True):
    E = logits.shape[1]
    r = mr.route_and_group(logits, k, tile, normalize=normalize)
    inds, scores = r.inds, r.scores
    assert inds.dtype == mx.int32 and scores.dtype == mx.float32
    ref_i, ref_s = moe.route(logits, k, normalize=normalize)
    ii, ss = np.asarray(inds), np.asarray(scores)
    ri, rs = np.asarray(ref_i).astype(np.int64), np.asarray(ref_s)
    # selection: the same probabilities (ties may pick different ids)
    np.testing.assert_allclose(np.sort(ss, 1), np.sort(rs, 1), rtol=2e-6, atol=1e-7)
    probs = np.asarray(mx.softmax(logits.astype(mx.float32), axis=-1, precise=True))
    sel = np.take_along_axis(probs, ii, 1)
    want = sel / sel.sum(1, keepdims=True) if normalize else sel
    np.testing.assert_allclose(ss, want, rtol=2e-6, atol=1e-7)
    assert np.all(np.diff(ss, axis=1) <= 0)  # decreasing probability
    assert all(len(set(row)) == k for row in ii.tolist())
    if logits.dtype == mx.float32:  # no ties: the same experts
        assert np.array_equal(np.sort(ii, 1), np.sort(ri, 1))
    # grouping, against the reference grouping of the kernel's own inds
    g = r.groups
    ref = moe.group_by_expert(inds, E)
    assert np.array_equal(np.asarray(g.counts), np.asarray(ref.counts))
    assert np.array_equal(np.asarray(g.offsets), np.asarray(ref.offsets))
    assert np.array_equal(np.asarray(g.sorted_experts), np.asarray(ref.sorted_experts))
    order, inv = np.asarray(g.order), np.asarray(g.inverse)
    nk = ii.size
    assert np.array_equal(np.sort(order), np.arange(nk))
    assert np.array_equal(ii.reshape(-1)[order], np.asarray(ref.sorted_experts))
    assert np.array_equal(inv[order], np.arange(nk))
    # same set per expert as the stable reference (order within is free)
    off = np.asarray(g.offsets)
    ro = np.asarray(ref.order)
    for e in np.nonzero(np.asarray(g.counts))[0][:64]:
        a, b = off[e], off[e + 1]
        assert np.array_equal(np.sort(order[a:b]), ro[a:b])
    assert np.array_equal(np.asarray(r.block_map), np.asarray(moe.block_map(ref, tile)))
    return r


@cuda
@needs_cuda
@pytest.mark.parametrize("n", [1, 2, 7, 64, 2049, 4099])
@pytest.mark.parametrize("kind", ["random", "skewed", "empty"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_routing_vs_reference(poison, n, kind, dtype):
    logits = make_logits(n, 256, kind, seed=n * 7 + len(kind), dtype=dtype)
    tile = 64 if n > 1000 else 32
    r = check_routing(logits, 8, tile)
    if kind == "empty":
        counts = np.asarray(r.groups.counts)
        assert np.count_nonzero(counts) == 8 and counts.sum() == n * 8


@cuda
@needs_cuda
@pytest.mark.parametrize("n", [1, 64, 4099])
def test_routing_all_to_one_expert(poison, n):
    logits = make_logits(n, 256, "one", seed=n, dtype=mx.float32)
    r = check_routing(logits, 1, 32)
    counts = np.asarray(r.groups.counts)
    assert counts[17] == n and counts.sum() == n
    assert np.allclose(np.asarray(r.scores), 1.0)


@cuda
@needs_cuda
@pytest.mark.parametrize("n,max_ctas", [(16385, None), (4099, 2), (300, 1)])
def test_routing_chunked_grouping(poison, monkeypatch, n, max_ctas):
    # chunks longer than one 1024-assignment round (ragged last round), and
    # more than GROUP_MAX_CTAS * 1024 assignments at the default
    if max_ctas is not None:
        monkeypatch.setattr(mr, "GROUP_MAX_CTAS", max_ctas)
    check_routing(make_logits(n, 256, "skewed", seed=n, dtype=mx.bfloat16), 8, 64)


@cuda
@needs_cuda
def test_routing_unnormalized_and_other_sizes(poison):
    check_routing(make_logits(300, 128, "random", 1, mx.float32), 4, 64, normalize=False)
    check_routing(make_logits(33, 64, "skewed", 2, mx.float16), 6, 32)


# ---------------------------------------------------------------------------
# grouped GEMM kernels
# ---------------------------------------------------------------------------


_dequantized = {}  # (id of a cached qproj, rounding) -> weights


def dequant(p, rounding):
    """fp32 weights [E, O, K] as the kernel variant dequantises them, on the
    GPU with MLX ops: ``bf16(bf16(s * q) + b)`` ("twice", the baseline and
    mx.dequantize on CPU) or ``bf16(s * q + b)`` ("once", the packed variants
    and mx.dequantize on CUDA); ``s * q`` is exact in fp32."""
    key = (id(p), rounding)
    if key in _dequantized and _dequantized[key][0] is p:
        return _dequantized[key][1]
    E, O, KW = p.weight.shape
    shifts = mx.arange(8, dtype=mx.uint32) * 4
    q = ((p.weight[..., None] >> shifts) & 15).reshape(E, O, KW * 8).astype(mx.float32)
    sc = mx.repeat(p.scales.astype(mx.float32), 64, axis=-1)
    bi = mx.repeat(p.biases.astype(mx.float32), 64, axis=-1)
    bf = lambda t: t.astype(mx.bfloat16).astype(mx.float32)  # noqa: E731
    w = bf(bf(sc * q) + bi) if rounding == "twice" else bf(sc * q + bi)
    mx.eval(w)
    _dequantized[key] = (p, w)  # the GEMM cases share their weights
    return w


@pytest.mark.parametrize("rounding", ["twice", "once"])
def test_dequant_helper_matches_host_unpack(rounding):
    """The GPU-side test helper dequantises as the kernels' host reference."""
    p = qproj(3, 64, 192, 11, scale=3.0)
    got = np.asarray(dequant(p, rounding))
    want = gg.unpack_affine_4bit(p.weight, p.scales, p.biases, rounding=rounding)
    assert np.array_equal(got, want)


def dense_ref(x, r, gate, up, down, rounding="twice"):
    """fp32 reference on the weights as the kernel dequantises them
    (:func:`dequant`), rounding where SwitchGLU does (gate, up, swiglu and
    down outputs to bf16). Returns (h in grouped order, y [N*k, D] weighted
    in assignment order). One plain matmul per expert's rows (``gather_mm``
    with repeated sorted indices gave wrong rows on CUDA, 2026-12-01)."""
    wg, wu, wd = (dequant(p, rounding) for p in (gate, up, down))
    k = r.groups.top_k
    order = r.groups.order
    off = np.asarray(r.groups.offsets).tolist()
    xr = x[order // k].astype(mx.float32)  # [NK, D] in grouped order
    bf = lambda t: t.astype(mx.bfloat16).astype(mx.float32)  # noqa: E731
    hs, os_ = [], []
    for e in range(len(off) - 1):
        if off[e + 1] == off[e]:
            continue
        xe = xr[off[e]:off[e + 1]]
        g = bf(xe @ wg[e].T)
        u = bf(xe @ wu[e].T)
        hh = bf(g * mx.sigmoid(g) * u)
        hs.append(hh)
        os_.append(bf(hh @ wd[e].T))
    h, o = mx.concatenate(hs), mx.concatenate(os_)
    y = mx.zeros_like(o).at[order].add(o * r.scores.reshape(-1)[order][:, None])
    mx.eval(h, y)
    return h, y


@cuda
@needs_cuda
@pytest.mark.parametrize("D,I,E", [(192, 128, 32), (320, 64, 32), (2048, 512, 256)])
@pytest.mark.parametrize("n", [1, 7, 64, 300])
@pytest.mark.parametrize("variant,tile", [
    ("base", 32), ("base", 64), ("deq", 64), ("pf", 32), ("pfl", 32), ("pfl", 64), ("pfl", 128),
    ("pflv", 32), ("pflv", 64), ("pflv", 128),
    ("big", 32), ("big", 64), ("big", 128),
    ("async", 32), ("async", 64), ("async", 128),
    ("wg", 32), ("wg", 64), ("wg", 128),
])
def test_grouped_gemm_vs_reference(poison, D, I, E, n, variant, tile):
    k = 8
    gate, up, down = qproj(E, I, D, 1), qproj(E, I, D, 2), qproj(E, D, I, 3)
    x = mx.random.normal((n, D), key=mx.random.key(n + D)).astype(mx.bfloat16)
    logits = make_logits(n, E, "skewed", seed=n, dtype=mx.float32)
    r = mr.route_and_group(logits, k, tile)
    arr = lambda p: (p.weight, p.scales, p.biases)  # noqa: E731
    if variant == "wg" and not gg.wg_shapes_ok(D, I):  # refused with a clear error, never run
        with pytest.raises(ValueError, match="variant 'wg' needs D % 256 == 0 and I % 128 == 0"):
            gg.gate_up_swiglu(x, r, arr(gate), arr(up), variant=variant)
        with pytest.raises(ValueError, match="variant 'wg' needs"):
            gg.moe_experts(x, r, gate, up, down, variant=variant)
        return
    h = gg.gate_up_swiglu(x, r, arr(gate), arr(up), variant=variant)
    y = gg.down_weighted(h, r, arr(down), variant=variant)
    assert h.shape == (n * k, I) and h.dtype == mx.bfloat16
    assert y.shape == (n * k, D) and y.dtype == mx.float32
    assert finite(h, y)  # every row written (outputs were NaN)
    h_ref, y_ref = dense_ref(x, r, gate, up, down, gg.VARIANT_ROUNDING[variant])
    assert rel(h, h_ref) < 2 * BF16_EPS
    assert rel(y, y_ref) < 4 * BF16_EPS
    # the down kernel alone on the reference h: only its own rounding differs
    y2 = gg.down_weighted(h_ref.astype(mx.bfloat16), r, arr(down), variant=variant)
    assert rel(y2, y_ref) < 2 * BF16_EPS
    # vs the stock-path reference (gather_qmm), combined per token
    groups = moe.group_by_expert(r.inds, E)
    ref = moe.combine(moe.expert_swiglu(x, groups, gate, up, down), r.scores, dtype=mx.float32)
    got = gg.moe_experts(x, r, gate, up, down, out_dtype=mx.float32, variant=variant)
    # gather_qmm's own error is not bf16-tight (1.6e-2 per projection on CPU)
    assert rel(got, ref) < GATHER_QMM_TOL


@cuda
@needs_cuda
@pytest.mark.parametrize("D,I,E", [(256, 128, 32), (512, 256, 64), (2048, 512, 256)])
@pytest.mark.parametrize("n,kind", [(1, "random"), (2, "random"), (4, "skewed"), (64, "empty"), (300, "one"),
                                    (2049, "skewed"), (4099, "skewed")])
@pytest.mark.parametrize("tile", [32, 64, 128])
def test_wg_grouped_gemm_vs_reference(poison, D, I, E, n, kind, tile):
    """The wgmma kernels on shapes they take (K chunks of 128, 128 / 256
    features per CTA): ragged item ends (n*k not a multiple of the tile),
    empty experts, all rows on one expert, n*k > 32,768 and not a multiple of
    64 (n = 4099); h in natural order from the public function, the down
    kernel alone on the reference h, both output dtypes."""
    k = 8
    gate, up, down = qproj(E, I, D, 11), qproj(E, I, D, 12), qproj(E, D, I, 13)
    x = mx.random.normal((n, D), key=mx.random.key(7 * n + D)).astype(mx.bfloat16)
    r = mr.route_and_group(make_logits(n, E, kind, seed=n + 3, dtype=mx.float32), k, tile)
    arr = lambda p: (p.weight, p.scales, p.biases)  # noqa: E731
    h = gg.gate_up_swiglu(x, r, arr(gate), arr(up), variant="wg")
    y = gg.down_weighted(h, r, arr(down), variant="wg")
    assert h.shape == (n * k, I) and h.dtype == mx.bfloat16
    assert y.shape == (n * k, D) and y.dtype == mx.float32
    assert finite(h, y)
    h_ref, y_ref = dense_ref(x, r, gate, up, down, "once")
    assert rel(h, h_ref) < 2 * BF16_EPS
    assert rel(y, y_ref) < 4 * BF16_EPS
    y2 = gg.down_weighted(h_ref.astype(mx.bfloat16), r, arr(down), variant="wg")
    assert rel(y2, y_ref) < 2 * BF16_EPS
    y3 = gg.down_weighted(h_ref.astype(mx.bfloat16), r, arr(down), out_dtype=mx.bfloat16, variant="wg")
    assert y3.dtype == mx.bfloat16 and finite(y3) and rel(y3, y_ref) < 2 * BF16_EPS
    got = gg.moe_experts(x, r, gate, up, down, out_dtype=mx.float32, variant="wg")
    want = y_ref.reshape(n, k, D).sum(axis=1)
    assert rel(got, want) < 4 * BF16_EPS
    # the same function as the checked mma.sync kernel (same one-rounding dequantisation)
    assert rel(got, gg.moe_experts(x, r, gate, up, down, out_dtype=mx.float32, variant="pflv")) < 4 * BF16_EPS


@cuda
@needs_cuda
@pytest.mark.parametrize("tune", [{"down_ft": 1}, {"down_ft": 2}, {"down_ft": 4}, {"down_ft": 8}, {"minb": 2}],
                         ids=lambda t: "-".join(f"{k}{v}" for k, v in t.items()))
@pytest.mark.parametrize("D,I,E,n,tile", [(2048, 512, 256, 300, 64), (2048, 512, 256, 4099, 128),
                                          (512, 256, 64, 77, 32), (1024, 640, 32, 40, 64)])
def test_wg_tunings_vs_reference(poison, tune, D, I, E, n, tile):
    """The "wg" build options (several feature tiles per down CTA with h
    resident, where I fits the ring and D splits evenly, else one; a
    128-register cap for two CTAs per SM) compute the same function."""
    saved = dict(gg.WG_TUNE)
    gg.WG_TUNE.update(tune)
    try:
        k = 8
        gate, up, down = qproj(E, I, D, 21), qproj(E, I, D, 22), qproj(E, D, I, 23)
        x = mx.random.normal((n, D), key=mx.random.key(n + 5)).astype(mx.bfloat16)
        r = mr.route_and_group(make_logits(n, E, "skewed", seed=n, dtype=mx.float32), k, tile)
        h_ref, y_ref = dense_ref(x, r, gate, up, down, "once")
        for out_dtype in (mx.float32, mx.bfloat16):
            y = gg.down_weighted(h_ref.astype(mx.bfloat16), r, (down.weight, down.scales, down.biases),
                                 out_dtype=out_dtype, variant="wg")
            assert y.dtype == out_dtype and finite(y) and rel(y, y_ref) < 2 * BF16_EPS
        got = gg.moe_experts(x, r, gate, up, down, out_dtype=mx.float32, variant="wg")
        assert finite(got) and rel(got, y_ref.reshape(n, k, D).sum(axis=1)) < 4 * BF16_EPS
    finally:
        gg.WG_TUNE.clear()
        gg.WG_TUNE.update(saved)


@cuda
@needs_cuda
def test_grouped_gemm_refuses_unsupported(poison):
    E, D = 32, 192
    x = mx.zeros((4, D), mx.bfloat16)
    # I = 96 is not a multiple of the kernels' 64-column tiles (a down
    # projection with 96 inputs cannot be quantised with group 64 at all, so
    # the check sees one of 128 inputs: refused for the gate/up size alone)
    g96, u96 = qproj(E, 96, D, 1), qproj(E, 96, D, 2)
    d = qproj(E, D, 128, 3)
    assert not gg.supports(x, g96, u96, d)
    r = mr.route_and_group(make_logits(4, E, "random", 0, mx.float32), 8, 32)
    with pytest.raises(ValueError, match="gate"):
        gg.gate_up_swiglu(x, r, (g96.weight, g96.scales, g96.biases), (u96.weight, u96.scales, u96.biases))
    with pytest.raises(ValueError, match="x must be bfloat16"):
        gg.gate_up_swiglu(x.astype(mx.float32), r, (g96.weight, g96.scales, g96.biases), (u96.weight, u96.scales, u96.biases))


# ---------------------------------------------------------------------------
# the whole block through the dispatch
# ---------------------------------------------------------------------------


def make_block(D=128, H=64, E=32, k=8, dtype=mx.bfloat16, router_scale=4.0):
    return moe_blocks.make_block(D=D, H=H, E=E, k=k, dtype=dtype, router_scale=router_scale)


def test_single_expert_routing_is_the_grouping_of_one_expert():
    """The host-built routing of a one-expert call equals what the grouping
    ops give for ``inds = zeros([N, 1])`` (any backend)."""
    for n, tile in [(1, 32), (65, 32), (1024, 64), (4099, 128)]:
        scores = mx.random.uniform(shape=(n, 1))
        r = gg.single_expert_routing(scores, tile)
        want = moe.group_by_expert(mx.zeros((n, 1), mx.int32), 1)
        for f in ("counts", "offsets", "order", "sorted_experts", "inverse"):
            assert mx.array_equal(getattr(r.groups, f), getattr(want, f)).item(), f
        assert r.groups.top_k == 1 and r.tile_rows == tile and r.inds.shape == (n, 1)
        assert mx.array_equal(r.block_map, moe.block_map(want, tile)).item()
        assert r.scores is scores
    with pytest.raises(ValueError, match="scores"):
        gg.single_expert_routing(mx.zeros((4, 1), mx.bfloat16), 32)
    with pytest.raises(ValueError, match="scores"):
        gg.single_expert_routing(mx.zeros((4, 2), mx.float32), 32)
    with pytest.raises(ValueError, match="tile_rows"):
        gg.single_expert_routing(mx.zeros((4, 1), mx.float32), 48)


def test_single_expert_tile_rows_fills_the_gpu(monkeypatch):
    monkeypatch.setattr(gg.cb, "sm_count", lambda: 132)
    # gate+up CTAs = ceil(N / tile) * I / 128 >= 0.9 * 132
    assert gg.single_expert_tile_rows(4096, 512) == 128
    assert gg.single_expert_tile_rows(2048, 512) == 64
    assert gg.single_expert_tile_rows(1024, 512) == 32
    assert gg.single_expert_tile_rows(100, 512) == 32


def test_shared_expert_supported_checks_the_modules():
    block = moe_blocks.make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16)
    assert gg.shared_expert_supported(block.shared_expert, 256)
    assert not gg.shared_expert_supported(block.shared_expert, 512)  # another hidden size
    assert not gg.shared_expert_supported(block.switch_mlp, 256)  # 3-D switch weights
    assert not gg.shared_expert_supported(object(), 256)
    narrow = moe_blocks.make_block(D=256, H=64, E=32, k=8, dtype=mx.bfloat16)
    assert not gg.shared_expert_supported(narrow.shared_expert, 256)  # I_s = 64: not a multiple of 128


def test_shared_in_gemm_switch(monkeypatch):
    """The grouped-kernel shared expert: only with the "wg" default (a compute
    capability 9.0 GPU, D % 256, I % 128), from SHARED_GEMM_MIN_TOKENS tokens,
    and not with MLX_QWEN_FAST_MOE_SHARED_GEMM=0 (read on every call)."""
    monkeypatch.delenv(gg.SHARED_GEMM_ENV, raising=False)
    monkeypatch.setattr(gg.cb, "gpu_arch", lambda: (9, 0))
    n = gg.SHARED_GEMM_MIN_TOKENS
    assert gg.shared_in_gemm(n, 2048, 512)
    assert not gg.shared_in_gemm(n - 1, 2048, 512)
    assert not gg.shared_in_gemm(n, 2048, 64)  # no "wg" build for I = 64
    monkeypatch.setenv(gg.SHARED_GEMM_ENV, "0")
    assert not gg.shared_in_gemm(n, 2048, 512)
    monkeypatch.setenv(gg.SHARED_GEMM_ENV, "1")
    assert gg.shared_in_gemm(n, 2048, 512)
    monkeypatch.setattr(gg.cb, "gpu_arch", lambda: (8, 0))
    assert not gg.shared_in_gemm(n, 2048, 512)


def test_moe_experts_and_shared_argument_errors():
    """Bad arguments are named before anything is compiled (any backend)."""
    block = moe_blocks.make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16)
    sm = block.switch_mlp
    n = 64
    x = mx.zeros((n, 256), mx.bfloat16)
    routing = None  # never reached: the checks come first
    ok = mx.zeros((n, 1), mx.float32)
    args = (sm.gate_proj, sm.up_proj, sm.down_proj)
    with pytest.raises(ValueError, match="x must"):
        gg.moe_experts_and_shared(x[None], routing, *args, block.shared_expert, ok)
    with pytest.raises(ValueError, match="shared_scores"):
        gg.moe_experts_and_shared(x, routing, *args, block.shared_expert, mx.zeros((n + 1, 1), mx.float32))
    with pytest.raises(ValueError, match="shared_scores"):
        gg.moe_experts_and_shared(x, routing, *args, block.shared_expert, ok.astype(mx.bfloat16))
    with pytest.raises(ValueError, match="shared_expert"):
        gg.moe_experts_and_shared(x, routing, *args, sm, ok)


def _shared_fp32(x, se, gate):
    """``gate * shared_expert(x)`` in fp32 on the dequantised weights, bf16
    roundings where the kernels (and SwitchGLU) round: g, u, silu(g) * u and the
    down output."""
    def deq(p):
        return mx.dequantize(p["weight"], p["scales"], p["biases"], group_size=64, bits=4).astype(mx.float32)

    def bf(a):
        return a.astype(mx.bfloat16).astype(mx.float32)

    xf = x.astype(mx.float32)
    g = bf(xf @ deq(se.gate_proj).T)
    u = bf(xf @ deq(se.up_proj).T)
    h = bf(g * mx.sigmoid(g) * u)
    return gate * bf(h @ deq(se.down_proj).T)


@cuda
@needs_cuda
@pytest.mark.parametrize("n", [1, 65, 1000, 2049, 4099])
def test_moe_experts_and_shared_vs_fp32(poison, n):
    """Routed experts + the shared expert as a one-expert group of the "wg"
    kernels = the routed kernels' output + the shared expert in fp32 (ragged
    N: one token, fewer rows than a tile, N not a multiple of any tile)."""
    D, I, E, k = 2048, 512, 64, 8
    block = moe_blocks.make_block(D=D, H=I, E=E, k=k, dtype=mx.bfloat16, seed=n)
    sm, se = block.switch_mlp, block.shared_expert
    assert gg.shared_expert_supported(se, D)
    x = (mx.random.normal((n, D), key=mx.random.key(7 * n)) * 1.5).astype(mx.bfloat16)
    routing = mr.route_and_group(block.gate(x), k, gg.choose_tile_rows(n * k, E, "wg"))
    gate = mx.sigmoid(block.shared_expert_gate(x).astype(mx.float32))
    got = gg.moe_experts_and_shared(x, routing, sm.gate_proj, sm.up_proj, sm.down_proj, se, gate)
    routed = gg.moe_experts(x, routing, sm.gate_proj, sm.up_proj, sm.down_proj, out_dtype=mx.float32, variant="wg")
    want = routed + _shared_fp32(x, se, gate)
    assert got.shape == (n, D) and got.dtype == mx.bfloat16 and finite(got)
    assert rel(got, want) < 2 * BF16_EPS
    assert rel(got - routed, want - routed) < 4 * BF16_EPS  # the shared expert's part alone


@cuda
@needs_cuda
@pytest.mark.parametrize("n", [16, 128, 333, 1100])
def test_block_cuda_kernel_vs_reference(poison, n):
    block = make_block(D=256, H=128, E=64, k=8)
    x = mx.random.normal((1, n, 256), key=mx.random.key(n)).astype(mx.bfloat16)
    assert gg.supports(x.reshape(n, 256), block.switch_mlp.gate_proj,
                       block.switch_mlp.up_proj, block.switch_mlp.down_proj)
    got = moe.sparse_moe(block, x, implementation="cuda-kernel")
    ref = moe.sparse_moe(block, x, implementation="reference")
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert finite(got)
    # Tokens whose k-th and (k+1)-th router probabilities tie exactly (bf16
    # logits of 64 experts tie often enough) may pick either expert, in the
    # kernel (lower id) as in the reference (argpartition): compare the rest.
    probs = np.asarray(mx.softmax(block.gate(x.reshape(n, 256)).astype(mx.float32), axis=-1, precise=True))
    top = -np.sort(-probs, axis=1)
    keep = top[:, block.top_k - 1] > top[:, block.top_k]
    assert keep.sum() >= n // 2
    assert rel(npa(got.reshape(n, 256))[keep], npa(ref.reshape(n, 256))[keep]) < GATHER_QMM_TOL


@cuda
@needs_cuda
def test_block_shared_expert_in_gemm_or_dense(poison, monkeypatch):
    """The block's shared expert: in the routing's shared slot from
    SHARED_SLOT_MIN_TOKENS tokens (router and gate as one matmul, the logit
    read from its column); with MLX_QWEN_FAST_MOE_SHARED_GEMM=group as its own
    one-expert group from SHARED_GEMM_MIN_TOKENS; =0, or below the
    thresholds, MLX's dense matmuls. All are the same block (dense: bf16
    products, gemm: fp32)."""
    n = gg.SHARED_GEMM_MIN_TOKENS + 5
    s = gg.SHARED_SLOT_MIN_TOKENS
    block = moe_blocks.make_block(D=256, H=128, E=64, k=8, dtype=mx.bfloat16, seed=3)
    x = mx.random.normal((1, n, 256), key=mx.random.key(5)).astype(mx.bfloat16)
    monkeypatch.delenv(gg.SHARED_GEMM_ENV, raising=False)
    calls = []
    real_group, real_experts, real_route = gg.moe_experts_and_shared, gg.moe_experts, mr.route_and_group

    def counted_group(*a, **k):
        calls.append(("group", a[0].shape[0]))
        return real_group(*a, **k)

    def counted_experts(*a, **k):
        calls.append(("slot" if k.get("shared_expert") is not None else "routed", a[0].shape[0]))
        return real_experts(*a, **k)

    def counted_route(*a, **k):
        calls.append(("column" if k.get("shared_column") else "logits" if k.get("shared_logits") is not None
                      else "plain", a[0].shape[0]))
        return real_route(*a, **k)

    monkeypatch.setattr(gg, "moe_experts_and_shared", counted_group)
    monkeypatch.setattr(gg, "moe_experts", counted_experts)
    monkeypatch.setattr(mr, "route_and_group", counted_route)

    def run(tokens):
        calls.clear()
        return moe.sparse_moe(block, x[:, :tokens], implementation="cuda-kernel")

    slot = run(n)
    assert calls == [("column", n), ("slot", n)]
    # a shared gate unlike the router (dense fp32): no joint matmul, its logits cast and passed apart
    joint_gate = block.shared_expert_gate
    block.shared_expert_gate = nn.Linear(256, 1, bias=False)
    block.shared_expert_gate.weight = mx.random.normal((1, 256), key=mx.random.key(8)) * 0.05
    apart = run(n)
    assert calls == [("logits", n), ("slot", n)]
    dense_gate = moe.sparse_moe(block, x, implementation="reference")
    assert finite(apart) and rel(apart, dense_gate) < GATHER_QMM_TOL
    block.shared_expert_gate = joint_gate
    run(s)
    assert calls == [("column", s), ("slot", s)]
    run(s - 1)  # below both thresholds: dense
    assert calls == [("plain", s - 1), ("routed", s - 1)]
    monkeypatch.setenv(gg.SHARED_GEMM_ENV, "group")
    group = run(n)
    assert calls == [("plain", n), ("group", n)]
    run(gg.SHARED_GEMM_MIN_TOKENS - 1)
    assert calls == [("plain", gg.SHARED_GEMM_MIN_TOKENS - 1), ("routed", gg.SHARED_GEMM_MIN_TOKENS - 1)]
    monkeypatch.setenv(gg.SHARED_GEMM_ENV, "0")
    dense = run(n)
    assert calls == [("plain", n), ("routed", n)]
    assert finite(slot, group, dense)
    assert rel(slot, dense) < GATHER_QMM_TOL
    # slot and group: the same bf16 roundings of the expert outputs; the slot's
    # router and gate logits come from one joint matmul (bf16 outputs, which
    # may round differently from the two matmuls apart), the sums in another
    # fp32 order
    assert rel(slot, group) < BF16_EPS


def test_shared_slot_helpers(monkeypatch):
    """Expert count of the shared slot's grouping, the slot's size check and
    the form the block takes (any backend: nothing compiles)."""
    assert [mr.shared_group_experts(e) for e in (32, 64, 256, 255)] == [64, 96, 288, 256]
    block = moe_blocks.make_block(D=256, H=128, E=32, k=8, dtype=mx.bfloat16)
    assert gg.shared_slot_supported(block.shared_expert, 256, 128)
    assert not gg.shared_slot_supported(block.shared_expert, 256, 256)  # routed experts of another size
    assert not gg.shared_slot_supported(block.shared_expert, 512, 128)
    assert not gg.shared_slot_supported(object(), 256, 128)
    monkeypatch.delenv(gg.SHARED_GEMM_ENV, raising=False)
    monkeypatch.setattr(gg.cb, "gpu_arch", lambda: (9, 0))
    n, s = gg.SHARED_GEMM_MIN_TOKENS, gg.SHARED_SLOT_MIN_TOKENS
    assert s < n

    def form(tokens, d=256, i=128, E=32, k=8):
        return gg.shared_form(tokens, d, i, block.shared_expert, num_experts=E, top_k=k)

    assert form(n) == "slot" and form(s) == "slot"
    assert form(s - 1) is None
    assert form(n, i=256) == "group"  # I_s != I: its own launches
    assert form(n - 1, i=256) is None
    assert form(n, i=64) is None  # no "wg" build for I = 64
    # the slot needs room in the routing: k + 1 <= 32 slots, E + 32 <= 1024 grouped experts
    assert form(s, k=31) == "slot" and form(s, E=992) == "slot"
    assert form(n, k=32) == "group" and form(n, E=1024) == "group" and form(s, E=1024) is None
    assert [mr.shared_slot_fits(E, k) for E, k in ((256, 8), (992, 31), (1024, 8), (256, 32))] == [
        True, True, False, False]
    monkeypatch.setenv(gg.SHARED_GEMM_ENV, "group")
    assert form(n) == "group"
    assert form(n - 1) is None
    monkeypatch.setenv(gg.SHARED_GEMM_ENV, "0")
    assert form(n) is None
    monkeypatch.setattr(gg.cb, "gpu_arch", lambda: (8, 0))  # no wgmma
    monkeypatch.delenv(gg.SHARED_GEMM_ENV)
    assert form(n) is None


def test_shared_slot_argument_errors():
    """A shared slot without the shared expert's weights, the weights without
    the slot, and bad shared logits are named before anything compiles (any
    backend: the routings here come from the reference grouping ops)."""
    E, k, n, D, I = 32, 8, 40, 256, 128
    block = moe_blocks.make_block(D=D, H=I, E=E, k=k, dtype=mx.bfloat16)
    sm, se = block.switch_mlp, block.shared_expert
    x = mx.zeros((n, D), mx.bfloat16)
    inds = mx.random.randint(0, E, (n, k)).astype(mx.int32)
    scores = mx.ones((n, k), mx.float32)
    plain_groups = moe.group_by_expert(inds, E)
    plain = mr.Routing(inds, scores, plain_groups, moe.block_map(plain_groups, 32), 32)
    inds9 = mx.concatenate([inds, mx.full((n, 1), E, mx.int32)], axis=1)
    slot_groups = moe.group_by_expert(inds9, mr.shared_group_experts(E))
    slot = mr.Routing(inds9, mx.ones((n, k + 1), mx.float32), slot_groups, moe.block_map(slot_groups, 32), 32, E)
    args = (sm.gate_proj, sm.up_proj, sm.down_proj)
    with pytest.raises(ValueError, match="shared"):
        gg.moe_experts(x, plain, *args, shared_expert=se, variant="wg")
    with pytest.raises(ValueError, match="shared"):
        gg.moe_experts(x, slot, *args, variant="wg")
    with pytest.raises(ValueError, match="shared_expert must"):
        gg.moe_experts(x, slot, *args, shared_expert=sm, variant="wg")
    with pytest.raises(ValueError, match="variant 'wg'"):
        gg.moe_experts(x, slot, *args, shared_expert=se, variant="pflv")
    logits = mx.zeros((n, E), mx.bfloat16)
    with pytest.raises(ValueError, match="shared_logits"):
        mr.route(logits, k, shared_logits=mx.zeros((n, 1), mx.float32))  # another dtype
    with pytest.raises(ValueError, match="shared_logits"):
        mr.route(logits, k, shared_logits=mx.zeros((n, 2), mx.bfloat16))
    with pytest.raises(ValueError, match="top_k < 32"):
        mr.route(mx.zeros((n, 64), mx.bfloat16), 32, shared_logits=mx.zeros((n, 1), mx.bfloat16))  # 33 slots
    with pytest.raises(ValueError, match="E <= 992"):  # 1,056 grouped experts: more than the grouping takes
        mr.route(mx.zeros((n, 1024), mx.bfloat16), k, shared_logits=mx.zeros((n, 1), mx.bfloat16))
    with pytest.raises(ValueError, match="E \\+ 32"):
        mr.route(mx.zeros((n, E + 16), mx.bfloat16), k, shared_column=True)  # E + 32 columns needed
    with pytest.raises(ValueError, match="not both"):
        mr.route(mx.zeros((n, E + 32), mx.bfloat16), k, shared_column=True, shared_logits=mx.zeros((n, 1), mx.bfloat16))


@pytest.mark.parametrize("mode", ["plain", "input", "column"])
def test_route_launch_counts_tokens(monkeypatch, mode):
    """route() launches one warp per token with N = the rows of the logits,
    whatever their width (the shared column's E + 32 included: an N taken
    from E alone once made the kernel write rows past its outputs on the
    H200), and asks for [N, k (+1)] outputs (any backend: the launch is
    recorded, not run)."""
    seen = {}

    class Recorder:
        def __call__(self, inputs, output_shapes, output_dtypes, grid, threadgroup, scalars):
            seen.update(inputs=inputs, shapes=output_shapes, grid=grid, scalars=scalars)
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

    monkeypatch.setattr(mr, "_kernel", lambda stage, **defs: seen.update(defs=defs) or Recorder())
    n, E, k = 37, 64, 8
    logits = mx.zeros((n, E + (32 if mode == "column" else 0)), mx.bfloat16)
    kw = {"shared_column": True} if mode == "column" else (
        {"shared_logits": mx.zeros((n, 1), mx.bfloat16)} if mode == "input" else {})
    inds, scores = mr.route(logits, k, **kw)
    slots = k + (mode != "plain")
    assert seen["scalars"][0] == n and seen["grid"] == mr.plan(n, slots, E, 1)["route_grid"]
    assert seen["shapes"] == [(n, slots), (n, slots)] and inds.shape == (n, slots)
    assert seen["defs"]["MOE_E"] == E and seen["defs"].get("MOE_SHARED", 0) == {"plain": 0, "input": 1,
                                                                                  "column": 2}[mode]
    assert len(seen["inputs"]) == (2 if mode == "input" else 1)


def test_router_with_shared_gate_is_both_layers():
    """The joint router: its columns are the router's and the gate's outputs
    (then zeros), built once, rebuilt when a weight is replaced; None for
    layers of other kinds (any backend)."""
    E, D = 32, 256
    block = moe_blocks.make_block(D=D, H=128, E=E, k=8, dtype=mx.bfloat16, seed=9)
    x = mx.random.normal((5, D), key=mx.random.key(2)).astype(mx.bfloat16)
    joint = moe.router_with_shared_gate(block)
    assert joint is not None and joint[0][0].shape[0] == E + 32
    from mlx_qwen_fast.compiled import apply_linear

    out = apply_linear(x, *joint)
    assert out.shape == (5, E + 32)
    assert rel(out[:, :E], block.gate(x)) < BF16_EPS and rel(out[:, E:E + 1], block.shared_expert_gate(x)) < BF16_EPS
    assert not np.asarray(out[:, E + 1:].astype(mx.float32)).any()
    assert moe.router_with_shared_gate(block) is joint  # cached
    g = block.shared_expert_gate
    g.weight = mx.array(g.weight)  # a replaced array (as load_weights does): rebuilt
    again = moe.router_with_shared_gate(block)
    assert again is not joint and mx.array_equal(again[0][0], joint[0][0]).item()
    block.shared_expert_gate = nn.Linear(D, 1, bias=False)  # another kind than the router
    assert moe.router_with_shared_gate(block) is None


@cuda
@needs_cuda
@pytest.mark.parametrize("n", [1, 7, 2049, 4099])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("where", ["input", "column"])
def test_route_and_group_with_shared_slot(poison, n, dtype, where):
    """The shared slot: the first k slots are route()'s without it bit for
    bit, slot k is expert E with sigmoid(logit) in fp32; the grouping counts
    E rounded up to 32 more experts: E's group holds every token once, the
    ids above it are empty, the rest is the grouping without the slot. The
    logit as a second input or as column E of [N, E + 32] logits."""
    E, k, tile = 256, 8, 64
    logits = make_logits(n, E, "skewed", seed=n, dtype=dtype)
    sl = (mx.random.normal((n, 1), key=mx.random.key(n + 1)) * 4).astype(dtype)
    if where == "input":
        r = mr.route_and_group(logits, k, tile, shared_logits=sl)
    else:
        wide = mx.concatenate([logits, sl, mx.full((n, 31), 1e4, dtype)], axis=1)  # the rest never read
        r = mr.route_and_group(wide, k, tile, shared_column=True)
    plain = mr.route_and_group(logits, k, tile)
    assert r.shared_id == E and plain.shared_id is None
    assert r.inds.shape == (n, k + 1) and r.scores.shape == (n, k + 1) and r.groups.top_k == k + 1
    assert mx.array_equal(r.inds[:, :k], plain.inds).item() and mx.array_equal(r.scores[:, :k], plain.scores).item()
    assert np.all(np.asarray(r.inds[:, k]) == E)
    want = 1.0 / (1.0 + np.exp(-np.asarray(sl.astype(mx.float32), dtype=np.float64)))
    np.testing.assert_allclose(np.asarray(r.scores[:, k:]), want, rtol=4e-7, atol=0)
    counts = np.asarray(r.groups.counts)
    assert counts.shape == (mr.shared_group_experts(E),)
    assert np.array_equal(counts[:E], np.asarray(plain.groups.counts)) and counts[E] == n
    assert not counts[E + 1:].any()
    ref = moe.group_by_expert(r.inds, mr.shared_group_experts(E))
    assert np.array_equal(np.asarray(r.groups.offsets), np.asarray(ref.offsets))
    order = np.asarray(r.groups.order)
    assert np.array_equal(np.sort(order), np.arange(n * (k + 1)))
    assert np.array_equal(np.asarray(r.inds).reshape(-1)[order], np.asarray(ref.sorted_experts))
    assert np.array_equal(np.asarray(r.block_map), np.asarray(moe.block_map(ref, tile)))


@cuda
@needs_cuda
@pytest.mark.parametrize("E,k,dtype", [(512, 31, mx.float16), (992, 8, mx.bfloat16), (64, 1, mx.float32)])
@pytest.mark.parametrize("where", ["input", "column"])
def test_route_shared_slot_other_shapes(poison, E, k, dtype, where):
    """The shared slot at other expert counts and top-k (the slot in lane 31,
    the grouping over 544 / 1,024 experts), float16 logits, and no tokens."""
    for n in (0, 333):
        logits = make_logits(n, E, "random", seed=E + n, dtype=dtype)
        sl = (mx.random.normal((n, 1), key=mx.random.key(n + 3)) * 4).astype(dtype)
        if where == "input":
            r = mr.route_and_group(logits, k, 32, shared_logits=sl)
        else:
            wide = mx.concatenate([logits, sl, mx.zeros((n, 31), dtype)], axis=1)
            r = mr.route_and_group(wide, k, 32, shared_column=True)
        plain = mr.route_and_group(logits, k, 32)
        assert r.inds.shape == (n, k + 1) and r.groups.counts.shape == (mr.shared_group_experts(E),)
        if n == 0:
            assert r.groups.order.shape == (0,)
            continue
        assert mx.array_equal(r.inds[:, :k], plain.inds).item()
        assert mx.array_equal(r.scores[:, :k], plain.scores).item()
        assert np.all(np.asarray(r.inds[:, k]) == E)
        want = 1.0 / (1.0 + np.exp(-np.asarray(sl.astype(mx.float32), dtype=np.float64)))
        np.testing.assert_allclose(np.asarray(r.scores[:, k:]), want, rtol=4e-7, atol=0)
        counts = np.asarray(r.groups.counts)
        assert counts[E] == n and not counts[E + 1:].any()
        ref = moe.group_by_expert(r.inds, mr.shared_group_experts(E))
        assert np.array_equal(np.asarray(r.block_map), np.asarray(moe.block_map(ref, 32)))


@cuda
@needs_cuda
@pytest.mark.parametrize("n,tile,D,I", [(1, None, 2048, 512), (65, None, 2048, 512), (1000, None, 2048, 512),
                                        (2049, 32, 2048, 512), (2049, 64, 2048, 512), (2049, 128, 2048, 512),
                                        (4099, None, 2048, 512), (1000, None, 2048, 1024), (333, None, 1024, 640)])
def test_moe_experts_with_shared_slot_vs_fp32(poison, n, tile, D, I):
    """The shared expert in the routing's shared slot (one more group of the
    routed experts' two launches) = the routed kernels' output + the shared
    expert in fp32 (ragged N; every tile size at N = 2049; I = 1024, whose
    down kernel takes one feature tile per CTA, and I = 640, an odd number
    of K chunks), the same as its own one-expert launches up to the fp32
    summation order, and the same bits with its logit read from column E."""
    E, k = 64, 8
    block = moe_blocks.make_block(D=D, H=I, E=E, k=k, dtype=mx.bfloat16, seed=n + 11)
    sm, se = block.switch_mlp, block.shared_expert
    assert gg.shared_slot_supported(se, D, I)
    x = (mx.random.normal((n, D), key=mx.random.key(3 * n)) * 1.5).astype(mx.bfloat16)
    logits, sl = block.gate(x), block.shared_expert_gate(x)
    tile = tile or gg.choose_tile_rows(n * (k + 1), E + 1, "wg")
    slot = mr.route_and_group(logits, k, tile, shared_logits=sl)
    got = gg.moe_experts(x, slot, sm.gate_proj, sm.up_proj, sm.down_proj, shared_expert=se, variant="wg",
                         out_dtype=mx.float32)
    plain = mr.route_and_group(logits, k, tile)
    routed = gg.moe_experts(x, plain, sm.gate_proj, sm.up_proj, sm.down_proj, out_dtype=mx.float32, variant="wg")
    gate = mx.sigmoid(sl.astype(mx.float32))
    want = routed + _shared_fp32(x, se, gate)
    assert got.shape == (n, D) and got.dtype == mx.float32 and finite(got)
    assert rel(got, want) < 2 * BF16_EPS
    assert rel(got - routed, want - routed) < 4 * BF16_EPS  # the shared expert's part alone
    group = gg.moe_experts_and_shared(x, plain, sm.gate_proj, sm.up_proj, sm.down_proj, se, gate,
                                      out_dtype=mx.float32)
    assert rel(got, group) < BF16_EPS
    wide = mx.concatenate([logits, sl, mx.zeros((n, 31), logits.dtype)], axis=1)
    column = mr.route_and_group(wide, k, tile, shared_column=True)
    got_c = gg.moe_experts(x, column, sm.gate_proj, sm.up_proj, sm.down_proj, shared_expert=se, variant="wg",
                           out_dtype=mx.float32)
    assert mx.array_equal(column.inds, slot.inds).item() and finite(got_c)
    assert rel(got_c, got) < 2 * BF16_EPS  # the same routing; rows of one group may be placed in another order
