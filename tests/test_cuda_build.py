"""The kernel build path (``kernels/_cuda_build.py``): disk cache and the
launched image (compressed fatbin or plain cubin).

The CPU tests check the switch; the ``cuda`` ones run on the GPU machine:

    source .mlxcuda/boot.sh && PYTHONPATH=. python3 -m pytest -q -m cuda tests/test_cuda_build.py
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from cuda_helpers import cuda, finite, needs_cuda
from mlx_qwen_fast.kernels import _cuda_build as cb

D, HK, HV = 128, 16, 32
C = (2 * HK + HV) * D
FATBIN_MAGIC = (0xBA55ED50).to_bytes(4, "little")
ELF_MAGIC = b"\x7fELF"


@pytest.fixture
def fresh_nvfatbin():
    """Forget the nvFatbin search before and after, so the test's environment decides it."""
    cb._get_nvfatbin.cache_clear()
    yield
    cb._get_nvfatbin.cache_clear()


def test_nvfatbin_switch_off(monkeypatch, fresh_nvfatbin):
    """MLX_QWEN_FAST_NVFATBIN=0: no nvFatbin, plain cubins are launched."""
    monkeypatch.setenv(cb.NVFATBIN_ENV, "0")
    assert cb._get_nvfatbin() is None
    assert cb.fatbin_id() == "cubin"


def test_nvfatbin_bad_path_is_not_found(monkeypatch, fresh_nvfatbin, tmp_path):
    """A path that is not a library is skipped (the search goes on, never raises)."""
    bogus = tmp_path / "libnvfatbin.so.13"
    bogus.write_bytes(b"not a library")
    monkeypatch.setenv(cb.NVFATBIN_ENV, str(bogus))
    nf = cb._get_nvfatbin()
    assert nf is None or nf.path != str(bogus)


def _decode_kernel_inputs(seed):
    from mlx_qwen_fast.kernels import gated_delta_decode as kd

    ks = mx.random.split(mx.random.key(seed), 6)
    proj = mx.random.normal((1, 1, kd.packed_width(HK, HV)), key=ks[0]).astype(mx.bfloat16)
    params = kd.decode_params(
        0.3 * mx.random.normal((C, 4, 1), key=ks[1]), mx.random.uniform(-2, 1, (HV,), key=ks[2]),
        mx.random.uniform(-1, 1, (HV,), key=ks[3]), 1.0 + 0.1 * mx.random.normal((D,), key=ks[4]))
    cs = mx.random.normal((1, 3, C), key=ks[5]).astype(mx.bfloat16)
    st = 0.1 * mx.random.normal((1, HV, D, D), key=mx.random.key(seed + 1))
    return proj, params, cs, st


@cuda
@needs_cuda
def test_image_runs_bit_identical_to_cubin():
    """The launched image (a compressed fatbin where nvFatbin is installed)
    computes exactly what the plain cubin does: the GDN decode kernel over
    two steps on fresh random inputs, outputs poisoned first."""
    from mlx_qwen_fast.kernels import gated_delta_decode as kd

    kern = kd._kernel(mx.bfloat16, mx.float32, mx.float32, mx.float32, mx.float32, HV, HK, True)
    image, cubin = kern.image, kern.cubin
    assert cubin[:4] == ELF_MAGIC
    if cb._get_nvfatbin() is not None:
        assert image[:4] == FATBIN_MAGIC and len(image) < len(cubin)
        assert cb.build_stats[kern.name]["image_bytes"] == len(image)
    else:
        assert image == cubin
    proj, params, cs, st = _decode_kernel_inputs(11)
    results = []
    cb.set_poison(True)
    try:
        for binary in (image, cubin):
            kern._image = binary
            o, c1, s1 = kd.gated_delta_decode_packed(proj, params, cs, st, num_k_heads=HK, num_v_heads=HV)
            o, c1, s1 = kd.gated_delta_decode_packed(proj, params, c1, s1, num_k_heads=HK, num_v_heads=HV)
            mx.eval(o, c1, s1)
            assert finite(o, c1, s1)
            results.append((o, c1, s1))
    finally:
        cb.set_poison(False)
        kern._image = image
    for u, v in zip(*results):
        assert mx.array_equal(u, v).item()


@cuda
@needs_cuda
def test_disk_cache_is_reused(monkeypatch, tmp_path):
    """A second process (here: the in-memory caches cleared) loads the cubin
    from the disk cache instead of compiling, byte for byte the same."""
    monkeypatch.setenv("MLX_QWEN_FAST_CACHE", str(tmp_path))
    cfg = dict(GDN_X="bf16_t", GDN_W="float", GDN_A="float", GDN_DT="float", GDN_N="float",
               GDN_HV=HV, GDN_HK=HK, GDN_PACKED=1, MQF_TEST_CACHE=1)  # an extra macro: a fresh name
    first = cb.CudaKernel("gated_delta_decode.cu", "mqf_gdn_decode", cfg)
    data = first.cubin
    assert cb.build_stats[first.name]["source"] == "compiled"
    assert len(list(tmp_path.glob(f"{first.name}-*.cubin"))) == 1
    monkeypatch.delitem(cb._cubins, first.name)
    monkeypatch.delitem(cb._images, first.name, raising=False)
    second = cb.CudaKernel("gated_delta_decode.cu", "mqf_gdn_decode", cfg)
    assert second.name == first.name and second.cubin == data
    assert cb.build_stats[second.name]["source"] == "cache"
