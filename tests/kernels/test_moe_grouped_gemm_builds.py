"""The builds of the grouped expert GEMMs (``kernels/moe_grouped_gemm_builds.py``):
build configurations, tile rules, the choice of build, and the K order of
the "wgmma" build (with a numpy emulation of its fragment layout). Host
side only: runs on any backend.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_qwen_fast.kernels import moe_grouped_gemm_builds as ggb


def test_build_config_mma():
    """The "mma" build: its warp grid covers the tile in m16n8 fragments,
    every thread takes part in the tile loads, and the static shared memory
    (two stages of A and W tiles with scales/biases) fits 48 KB."""
    for stage, o in (("gate_up", 512), ("down", 2048), ("gate_up", 192), ("down", 320)):
        for bm in ggb.TILE_CHOICES:
            c = ggb.build_config("mma", stage, bm, o)
            d = c["defines"]
            assert d["MOE_BM"] == bm and o % c["bn"] == 0
            assert c["source"] == "moe_grouped_gemm.cu" and c["smem"] == 0
            wm, wn = d.get("MOE_WM", 2), d.get("MOE_WN", 2)
            assert c["threads"] == 32 * wm * wn
            assert (bm // wm) % 16 == 0 and (c["bn"] // wn) % 8 == 0
            assert bm * 8 % c["threads"] == 0 and c["bn"] * 8 % c["threads"] == 0
            nmat = 2 if stage == "gate_up" else 1
            assert 2 * 72 * (bm + nmat * c["bn"]) + 4 * bm <= 48 * 1024  # static smem


def test_build_config_wgmma():
    """The "wgmma" build: 256 threads, 128 (gate+up) / 256 (down) features per
    CTA, dynamic shared memory within the 227 KB an SM grants one block;
    several feature tiles per down CTA only where h fits the cp.async ring
    (K <= 128 x stages), the tile is at most 64 rows and D splits evenly."""
    for stage, feat in (("gate_up", 128), ("down", 256)):
        for bm in ggb.TILE_CHOICES:
            c = ggb.build_config("wgmma", stage, bm, 2048)
            assert c["threads"] == 256 and c["bn"] == feat and c["source"] == "moe_grouped_gemm_wgmma.cu"
            assert c["defines"]["MOE_BM"] == bm and c["defines"]["MOE_STAGES"] == ggb.WGMMA_STAGES
            assert 0 < c["smem"] <= 227 * 1024
            assert "MOE_FT" not in c["defines"]  # down_ft 1 by default
    assert ggb.build_config("wgmma", "down", 64, 2048, 512, down_ft=4)["bn"] == 1024
    assert ggb.build_config("wgmma", "down", 64, 2048, 512, down_ft=4)["defines"]["MOE_FT"] == 4
    assert "MOE_FT" not in ggb.build_config("wgmma", "down", 64, 2048, 1024, down_ft=4)["defines"]  # K > 128 * stages
    assert "MOE_FT" not in ggb.build_config("wgmma", "down", 64, 512, 512, down_ft=4)["defines"]  # 512 % 1024
    assert "MOE_FT" not in ggb.build_config("wgmma", "gate_up", 64, 512, 2048, down_ft=4)["defines"]
    assert "MOE_FT" not in ggb.build_config("wgmma", "down", 128, 2048, 512, down_ft=8)["defines"]  # tile 128: one
    assert ggb.down_feature_tiles(4096 * 8, 256) == 8 and ggb.down_feature_tiles(512 * 8, 256) == 1
    assert ggb.wgmma_shapes_ok(2048, 512) and ggb.wgmma_shapes_ok(256, 128)
    for d, i in ((192, 128), (320, 64), (384, 128), (2048, 64), (2048, 192)):
        assert not ggb.wgmma_shapes_ok(d, i)


def test_build_config_errors():
    assert set(ggb.VARIANTS) == {"wgmma", "mma"}
    with pytest.raises(ValueError, match="variant"):
        ggb.build_config("nope", "gate_up", 64, 512)
    for args, what in ((("gate_up", 64.0, 512), "bm"), (("both", 64, 512), "stage"), ((0, 64, 512), "stage"),
                       (("gate_up", 64, 100), "out_cols"), (("down", 64, 0), "out_cols")):
        with pytest.raises(ValueError, match=what):
            ggb.build_config("mma", *args)
    with pytest.raises(ValueError, match="multiple of 128"):
        ggb.build_config("wgmma", "gate_up", 64, 192)
    with pytest.raises(ValueError, match="multiple of 256"):
        ggb.build_config("wgmma", "down", 64, 384)


def test_choose_tile_rows():
    """32 rows while experts average fewer than 64 assignments, else 64, for
    every build; one of TILE_CHOICES always; bad counts and variants named."""
    for v in (None,) + ggb.VARIANTS:
        for nk in (0, 1, 512 * 8, 2048 * 8, 4096 * 8, 100000):
            assert ggb.choose_tile_rows(nk, 256, v) in ggb.TILE_CHOICES
        assert ggb.choose_tile_rows(64 * 256 - 1, 256, v) == 32
        assert ggb.choose_tile_rows(64 * 256, 256, v) == 64
        assert ggb.choose_tile_rows(512 * 8, 256, v) == 32
        assert ggb.choose_tile_rows(4096 * 8, 256, v) == 64
    assert ggb.choose_tile_rows(1, 256) in ggb.TILE_CHOICES
    with pytest.raises(ValueError, match="variant"):
        ggb.choose_tile_rows(4096, 256, "nope")
    for bad in ("100", None, 1.5, True):
        with pytest.raises(ValueError, match="num_assignments"):
            ggb.choose_tile_rows(bad, 256)


def test_default_variant_falls_back(monkeypatch):
    """"wgmma" only where it runs: compute capability 9.0 and the shapes it
    takes; elsewhere "mma" (never an error)."""
    from mlx_qwen_fast.kernels import _cuda_build as cb

    monkeypatch.setattr(cb, "gpu_arch", lambda: (9, 0))
    assert ggb.default_variant(2048, 512) == "wgmma"
    assert ggb.default_variant(192, 128) == "mma"
    assert ggb.default_variant(2048, 64) == "mma"
    monkeypatch.setattr(cb, "gpu_arch", lambda: (8, 0))
    assert ggb.default_variant(2048, 512) == "mma"

    def no_gpu():
        raise RuntimeError("no CUDA driver")

    monkeypatch.setattr(cb, "gpu_arch", no_gpu)
    assert ggb.default_variant(2048, 512) == "mma"


@pytest.mark.parametrize("lead", [(), (3,), (2, 5)])
def test_permute_k_permutes_within_chunks(lead):
    """permute_k reorders the inputs within each chunk of 128 (a permutation,
    the same for every chunk and row, not the identity), unpermute_k undoes
    it; other widths are refused. (Which order: the kernel's fragment
    layout, test_wgmma_fragment_mapping.)"""
    K = 384
    a = mx.arange(int(np.prod(lead, dtype=np.int64)) * K).reshape(*lead, K)
    p = ggb.permute_k(a)
    assert p.shape == a.shape
    rows = np.asarray(p).reshape(-1, K) % K
    for c in range(K // 128):
        chunk = rows[:, 128 * c:128 * (c + 1)]
        assert np.array_equal(np.sort(chunk, axis=1), np.broadcast_to(np.arange(128 * c, 128 * (c + 1)), chunk.shape))
        assert np.array_equal(chunk - 128 * c, np.broadcast_to(rows[:1, :128], chunk.shape))
    assert mx.array_equal(ggb.unpermute_k(p), a).item()
    assert not mx.array_equal(p, a).item()
    for bad in (mx.zeros((4, 64)), mx.zeros((200,)), mx.zeros(())):
        with pytest.raises(ValueError, match="multiple of 128"):
            ggb.permute_k(bad)
        with pytest.raises(ValueError, match="multiple of 128"):
            ggb.unpermute_k(bad)


def test_wgmma_fragment_mapping():
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
    xp = np.asarray(ggb.permute_k(mx.array(x.astype(np.int32))))

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
