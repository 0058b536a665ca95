"""The Metal gated-attention decode kernels (``kernels/attention_decode_metal.py``:
the new key's RMSNorm + RoPE, the cache write, single-pass or split-K
attention over the cache, the combine with the sigmoid gate, head_dim 256),
run on the CPU through ``tests/metal_check.py`` (MLX's generated source as
C++, one fiber per GPU thread, guard pages, outputs poisoned with NaN).

Against :func:`mlx_qwen_fast.ops.attention.decode_attention_reference` on
fp32 copies of fresh random inputs. Bounds (compare.tolerance): the kernels
round where the stock path rounds (the RMSNorm's normalised value and its
product with the weight, RoPE's result, the attention output, the result);
the fp32 reference rounds nowhere, so each of those points on the longest
path is one rounding of difference: the new key has 3, the output 5 (the
query's or the new key's 3, the attention output, the result); fp32
results: FP32_TOL. The value row is a copy (exact), the other cache rows
stay as they were (exact).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import metal_check as mc
from compare import assert_close, finite, npa, rel_err, tolerance
from mlx_qwen_fast.kernels import attention_decode_metal as adm
from mlx_qwen_fast.kernels.attention_contract import DH, proj_width
from mlx_qwen_fast.ops.attention import decode_attention_reference

MODULE = adm.__name__
needs_cxx = pytest.mark.skipif(mc.CXX is None, reason="no C++ compiler (g++) to build the Metal sources")


def _inputs(B, hq, hkv, cap, dtype, seed):
    ks = mx.random.split(mx.random.key(seed), 5)
    proj = (2.0 * mx.random.normal((B, 1, proj_width(hq, hkv)), key=ks[0])).astype(dtype)
    keys = mx.random.normal((B, hkv, cap, DH), key=ks[1]).astype(dtype)
    values = mx.random.normal((B, hkv, cap, DH), key=ks[2]).astype(dtype)
    qw = (1.0 + 0.3 * mx.random.normal((DH,), key=ks[3])).astype(dtype)
    kw = (1.0 + 0.3 * mx.random.normal((DH,), key=ks[4])).astype(dtype)
    return proj, keys, values, qw, kw


def _settings(hq, hkv, dims=64, trad=False, rscale=1.0):
    return dict(num_heads=hq, num_kv_heads=hkv, scale=DH ** -0.5, q_eps=1e-6, k_eps=1e-6, rope_dims=dims,
                rope_traditional=trad, rope_base=1e7, rope_scale=rscale)


def _f32(*xs):
    return [x.astype(mx.float32) for x in xs]


def test_single_pass_up_to_one_block_then_fixed_blocks():
    assert adm.SINGLE_PASS_MAX == adm.BLOCK == 256
    assert [adm.blocks(c) for c in (1, 255, 256)] == [0, 0, 0]
    assert [adm.blocks(c) for c in (257, 512, 513, 768, 131072)] == [2, 2, 3, 3, 512]


CASES = [
    # B, hq, hkv, capacity, offset (context = offset + 1), dtype; the model's heads first
    (1, 16, 2, 256, 0, mx.bfloat16),  # context 1, one pass
    (2, 16, 2, 256, 254, mx.float32),  # context 255, one pass, a free row
    (1, 16, 2, 256, 255, mx.bfloat16),  # context 256: the largest one-pass buffer, full
    (2, 16, 2, 512, 255, mx.float32),  # context 256, split: the second block empty
    (1, 16, 2, 512, 256, mx.bfloat16),  # context 257: one position in the second block
    (2, 16, 2, 768, 511, mx.bfloat16),  # context 512: two full blocks and an empty one
    (1, 16, 2, 768, 512, mx.float32),  # context 513: a block boundary passed
    (1, 16, 2, 512, 0, mx.float32),  # context 1, split: only the first block has a position
    (2, 4, 1, 256, 254, mx.bfloat16),  # 4 query heads on one KV head
    (1, 4, 1, 768, 600, mx.float32),
    (2, 8, 8, 512, 256, mx.bfloat16),  # one query head per KV head (one SIMD group per threadgroup)
    (1, 8, 8, 256, 130, mx.float32),
    (1, 16, 2, 512, 400, mx.float16),
    (1, 16, 2, 4096, 4000, mx.bfloat16),  # 16 blocks, the last one empty
]


@needs_cxx
@pytest.mark.parametrize("B,hq,hkv,cap,off,dtype", CASES)
def test_metal_kernels_match_reference(B, hq, hkv, cap, off, dtype):
    proj, keys, values, qw, kw = _inputs(B, hq, hkv, cap, dtype, seed=cap + off + B + hq)
    st = _settings(hq, hkv)
    offset = mx.array(off, mx.int32)
    ref, rk, rv = decode_attention_reference(*_f32(proj, keys, values), offset, *_f32(qw, kw), **st)
    old_k, old_v = npa(keys).copy(), npa(values).copy()
    with mc.simulated_modules(MODULE) as (m,):
        out, k2, v2 = m.attention_decode_metal(proj, keys, values, offset, qw, kw, **st)
        mx.eval(out, k2, v2)
        calls = {kind: k.calls for kind, k in m._KERNELS.items()}
    split = adm.blocks(cap) > 0
    assert calls == ({"key": 1, "split": 1, "combine": 1} if split else {"key": 1, "single": 1})
    assert out.shape == (B, 1, hq * DH) and out.dtype == dtype
    assert k2.shape == keys.shape and k2.dtype == dtype and v2.shape == values.shape
    assert finite(out, k2, v2)  # every output element written (the checker starts them as NaN)
    assert_close(out, ref, tolerance(dtype, 5), "out")
    assert_close(k2[:, :, off], rk[:, :, off], tolerance(dtype, 3), "new key row")
    assert_close(v2[:, :, off], rv[:, :, off], 0.0, "new value row (a copy)")
    others = np.arange(cap) != off
    assert_close(npa(k2)[:, :, others], old_k[:, :, others], 0.0, "other key rows")
    assert_close(npa(v2)[:, :, others], old_v[:, :, others], 0.0, "other value rows")


@needs_cxx
@pytest.mark.parametrize("cap,off", [(256, 200), (512, 300)])
def test_traditional_full_rope_and_scaled_positions(cap, off):
    """RoPE over the whole head in (2i, 2i+1) pairs with rope_scale 0.5,
    fp32 weights under bf16 activations (one pass and split)."""
    dtype, hq, hkv = mx.bfloat16, 4, 1
    proj, keys, values, qw, kw = _inputs(1, hq, hkv, cap, dtype, seed=off)
    qw, kw = qw.astype(mx.float32), kw.astype(mx.float32)
    st = _settings(hq, hkv, dims=256, trad=True, rscale=0.5)
    offset = mx.array(off, mx.int32)
    ref, rk, _ = decode_attention_reference(*_f32(proj, keys, values), offset, qw, kw, **st)
    with mc.simulated_modules(MODULE) as (m,):
        out, k2, _ = m.attention_decode_metal(proj, keys, values, offset, qw, kw, **st)
        mx.eval(out, k2)
    assert finite(out, k2)
    assert_close(out, ref, tolerance(dtype, 5), "out")
    assert_close(k2[:, :, off], rk[:, :, off], tolerance(dtype, 3), "new key row")


def _planted(folder, kind, old, new):
    """Copies of the kernel sources in ``folder``, ``old`` replaced by
    ``new`` in the ``kind`` kernel's."""
    for f in adm.SOURCE_DIR.iterdir():
        text = f.read_text()
        if f.name == f"attention_decode_{kind}.metal":
            assert old in text
            text = text.replace(old, new)
        (folder / f.name).write_text(text)


@needs_cxx
def test_planted_bugs_fail_the_checks(tmp_path, monkeypatch):
    """The checks above catch a combine that drops the last block (numbers)
    and a single pass that leaves half of each head unwritten (poison)."""
    B, hq, hkv, dtype = 1, 16, 2, mx.float32
    st = _settings(hq, hkv)
    cases = (("combine", "o += w * rows[s * R + t];", "o += s + 1 < ns ? w * rows[s * R + t] : 0.0f;", 512, 300),
             ("single", "for (int e = 0; e < MQF_EL; e++) {\n        const float a",
              "for (int e = 0; e < MQF_EL / 2; e++) {\n        const float a", 256, 100))
    for kind, old, new, cap, off in cases:
        proj, keys, values, qw, kw = _inputs(B, hq, hkv, cap, dtype, seed=cap)
        offset = mx.array(off, mx.int32)
        ref, _, _ = decode_attention_reference(proj, keys, values, offset, qw, kw, **st)
        src = tmp_path / kind
        src.mkdir()
        _planted(src, kind, old, new)
        with mc.simulated_modules(MODULE) as (m,):
            monkeypatch.setattr(m, "SOURCE_DIR", src)
            out, _, _ = m.attention_decode_metal(proj, keys, values, offset, qw, kw, **st)
            mx.eval(out)
        if kind == "single":
            assert not finite(out)
        else:
            assert finite(out) and rel_err(out, ref) > tolerance(dtype, 5)


def test_bad_input_names_the_argument():
    """Refused before any kernel is built (no Metal needed), by name; an
    empty batch returns without a launch."""
    proj, keys, values, qw, kw = _inputs(1, 16, 2, 8, mx.float32, 0)
    off = mx.array(3, mx.int32)
    st = dict(num_heads=16, num_kv_heads=2, scale=DH ** -0.5, q_eps=1e-6, k_eps=1e-6, rope_dims=64, rope_base=1e7)
    good = (proj, keys, values, off, qw, kw)
    cases = [
        ((proj[..., 1:],) + good[1:], "proj"),
        ((proj.reshape(1, -1),) + good[1:], "proj"),
        ((proj.astype(mx.int32),) + good[1:], "proj"),
        ((proj, keys[..., :128], values, off, qw, kw), "keys"),
        ((proj, keys.astype(mx.bfloat16), values, off, qw, kw), "keys"),
        ((proj, keys, values[:, :, :4], off, qw, kw), "values"),
        ((proj, keys, values, mx.array([3], mx.int32), qw, kw), "offset"),
        ((proj, keys, values, mx.array(3.0), qw, kw), "offset"),
        ((proj, keys, values, 3, qw, kw), "offset"),
        ((proj, keys, values, off, qw[:64], kw), "q_norm_weight"),
        ((proj, keys, values, off, qw, kw.astype(mx.bfloat16)), "k_norm_weight"),
        ((proj, keys, values, off, qw, None), "k_norm_weight"),
    ]
    with mc.simulated_modules(MODULE) as (m,):
        for args, name in cases:
            with pytest.raises(ValueError, match=f"attention_decode_metal: .*{name}"):
                m.attention_decode_metal(*args, **st)
        for change, name in ((dict(num_kv_heads=3), "num_heads"), (dict(q_eps=0.0), "q_eps"),
                             (dict(rope_dims=63), "rope_dims"), (dict(scale=-1.0), "scale"),
                             (dict(rope_base=float("inf")), "rope_base")):
            with pytest.raises(ValueError, match=name):
                m.attention_decode_metal(*good, **{**st, **change})
        # 16 query heads per KV head: the CUDA kernels take them, these do not
        p32, k32, v32, _, _ = _inputs(1, 32, 2, 8, mx.float32, 0)
        with pytest.raises(ValueError, match="num_heads .*at most 8 query heads per KV head"):
            m.attention_decode_metal(p32, k32, v32, off, qw, kw, **{**st, "num_heads": 32})
        out, k2, v2 = m.attention_decode_metal(proj[:0], keys[:0], values[:0], off, qw, kw, **st)
        assert out.shape == (0, 1, 16 * DH) and k2.shape == (0, 2, 8, DH)
        assert m._KERNELS == {}


def test_supports_metal_head_dim_256_up_to_8_heads_per_kv_head():
    proj, keys, values, _, _ = _inputs(1, 16, 2, 8, mx.bfloat16, 1)
    hd = dict(num_heads=16, num_kv_heads=2, head_dim=DH)
    assert adm.supports(proj, keys, values, **hd) == mx.metal.is_available()
    with mc.simulated():  # Metal seen as available
        assert adm.supports(proj, keys, values, **hd)
        assert not adm.supports(proj, keys, values, **{**hd, "head_dim": 128})
        assert not adm.supports(proj, keys.astype(mx.float32), values, **hd)
        assert not adm.supports(proj[:, :, :-1], keys, values, **hd)
        assert not adm.supports(proj[:0], keys[:0], values[:0], **hd)
        p32, k32, v32, _, _ = _inputs(1, 32, 2, 8, mx.bfloat16, 1)
        assert not adm.supports(p32, k32, v32, num_heads=32, num_kv_heads=2, head_dim=DH)
        p8, k8, v8, _, _ = _inputs(1, 8, 8, 8, mx.bfloat16, 1)
        assert adm.supports(p8, k8, v8, num_heads=8, num_kv_heads=8, head_dim=DH)
