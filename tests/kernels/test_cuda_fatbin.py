"""The launched image of a kernel build (``kernels/_cuda_fatbin.py``): the
nvFatbin switch, the choice of compressed fatbin or plain cubin, and its
fallback.

The CPU tests check the switch and the image choice with stand-ins; the
``cuda`` one launches both images of a real kernel.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from compare import finite
from mlx_qwen_fast import config
from mlx_qwen_fast.kernels import _cuda_build as cb
from mlx_qwen_fast.kernels import _cuda_fatbin

D, HK, HV = 128, 16, 32
C = (2 * HK + HV) * D
FATBIN_MAGIC = (0xBA55ED50).to_bytes(4, "little")
ELF_MAGIC = b"\x7fELF"


@pytest.fixture
def fresh_nvfatbin(monkeypatch):
    """Forget the nvFatbin lookup (and any failure) before and after, so the
    test's environment decides it."""
    lookup = _cuda_fatbin.get_nvfatbin  # a test may replace it
    lookup.cache_clear()
    monkeypatch.setattr(_cuda_fatbin, "_failed", None)
    yield
    lookup.cache_clear()


def test_nvfatbin_switch_off(env, fresh_nvfatbin):
    """MLX_QWEN_FAST_NVFATBIN=0: no nvFatbin, plain cubins are launched."""
    env.set(config.NVFATBIN.name, "0")
    assert _cuda_fatbin.get_nvfatbin() is None
    assert _cuda_fatbin.fatbin_id() == "cubin"


def test_nvfatbin_bad_path_warns(env, fresh_nvfatbin, tmp_path):
    """A path that is not a library is named in a warning, then skipped."""
    bogus = tmp_path / "libnvfatbin.so.13"
    bogus.write_bytes(b"not a library")
    env.set(config.NVFATBIN.name, str(bogus))
    with pytest.warns(RuntimeWarning, match="not a loadable libnvfatbin"):
        nf = _cuda_fatbin.get_nvfatbin()
    assert nf is None or nf.path != str(bogus)


class _FakeNvFatbin:
    """Stands in for the library: returns ``result`` (bytes) or raises it."""

    mode, version, path = "zstd", (13, 5), "fake"

    def __init__(self, result):
        self.result, self.calls = result, 0

    def compress(self, cubin, arch):
        self.calls += 1
        assert arch == "sm_90a"
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def _kernel_with_cubin(monkeypatch, tag, cubin):
    """A CudaKernel whose cubin is already 'built' (no compiler needed)."""
    kern = cb.CudaKernel("gated_delta_decode.cu", "mqf_gdn_decode", {"MQF_TEST_IMAGE": tag})
    monkeypatch.setitem(cb._cubins, kern.name, cubin)
    monkeypatch.setitem(cb.build_stats, kern.name, {"arch": "sm_90a", "source": "cache"})
    return kern


CUBIN = ELF_MAGIC + bytes(200)


@pytest.mark.parametrize("result,expect", [
    (FATBIN_MAGIC + bytes(20), "fatbin"),   # smaller: launched
    (FATBIN_MAGIC + bytes(400), "cubin"),   # larger than the cubin: the cubin is launched
])
def test_image_choice_and_reuse(monkeypatch, fresh_nvfatbin, result, expect):
    """The image is the fatbin only when it is smaller; it is built once per
    kernel name (a second CudaKernel of the same build reuses it); the
    build record says which form runs and both sizes."""
    fake = _FakeNvFatbin(result)
    monkeypatch.setattr(_cuda_fatbin, "get_nvfatbin", lambda: fake)
    kern = _kernel_with_cubin(monkeypatch, len(result), CUBIN)
    monkeypatch.delitem(cb._images, kern.name, raising=False)
    image = kern.image
    assert image == (result if expect == "fatbin" else CUBIN)
    st = cb.build_stats[kern.name]
    assert st["image"] == ("fatbin-zstd" if expect == "fatbin" else "cubin")
    assert (st["cubin_bytes"], st["image_bytes"]) == (len(CUBIN), len(image))
    again = cb.CudaKernel("gated_delta_decode.cu", "mqf_gdn_decode", {"MQF_TEST_IMAGE": len(result)})
    assert again.image == image and fake.calls == 1
    cb._images.pop(kern.name)


def test_image_falls_back_to_cubin_once(monkeypatch, fresh_nvfatbin):
    """A failing nvFatbin is warned about once, its kernel launches the
    cubin, and later kernels of the process do not try again."""
    fake = _FakeNvFatbin(RuntimeError("nvFatbinCreate failed: unknown option"))
    monkeypatch.setattr(_cuda_fatbin, "get_nvfatbin", lambda: fake)
    k1 = _kernel_with_cubin(monkeypatch, 101, CUBIN)
    k2 = _kernel_with_cubin(monkeypatch, 102, CUBIN + b"\1")
    for k in (k1, k2):
        monkeypatch.delitem(cb._images, k.name, raising=False)
    with pytest.warns(RuntimeWarning, match="unknown option"):
        assert k1.image == CUBIN
    assert k2.image == CUBIN + b"\1" and fake.calls == 1
    assert _cuda_fatbin.fatbin_id().startswith("cubin (nvFatbin failed: ")
    for k in (k1, k2):
        cb._images.pop(k.name)


def test_nvfatbin_errors_are_named(fresh_nvfatbin):
    """With a real libnvfatbin (skipped without one): an empty cubin and a
    cubin that is not ELF are refused with nvFatbin's own message."""
    nf = _cuda_fatbin.get_nvfatbin()
    if nf is None:
        pytest.skip("no libnvfatbin here (pip install nvidia-nvfatbin, or set MLX_QWEN_FAST_NVFATBIN)")
    with pytest.raises(RuntimeError, match=r"nvFatbinAddCubin \(0 bytes for sm_90a\) failed: .*empty"):
        nf.compress(b"", "sm_90a")
    with pytest.raises(RuntimeError, match="nvFatbinAddCubin"):
        nf.compress(b"not an ELF file" * 8, "sm_90a")


def _decode_kernel_inputs(seed):
    from mlx_qwen_fast.kernels import gated_delta_contract as kc

    ks = mx.random.split(mx.random.key(seed), 6)
    proj = mx.random.normal((1, 1, kc.packed_width(HK, HV)), key=ks[0]).astype(mx.bfloat16)
    params = kc.decode_params(
        0.3 * mx.random.normal((C, 4, 1), key=ks[1]), mx.random.uniform(-2, 1, (HV,), key=ks[2]),
        mx.random.uniform(-1, 1, (HV,), key=ks[3]), 1.0 + 0.1 * mx.random.normal((D,), key=ks[4]))
    cs = mx.random.normal((1, 3, C), key=ks[5]).astype(mx.bfloat16)
    st = 0.1 * mx.random.normal((1, HV, D, D), key=mx.random.key(seed + 1))
    return proj, params, cs, st


@pytest.mark.cuda
def test_image_runs_bit_identical_to_cubin():
    """The launched image (a compressed fatbin where nvFatbin is installed)
    computes exactly what the plain cubin does: the GDN decode kernel over
    two steps on fresh random inputs, outputs poisoned first."""
    from mlx_qwen_fast.kernels import gated_delta_decode as kd

    if _cuda_fatbin.get_nvfatbin() is None:
        pytest.skip("no libnvfatbin: the image is the cubin itself")
    kern = kd._kernel(mx.bfloat16, HV, HK)
    image, cubin = kern.image, kern.cubin
    assert cubin[:4] == ELF_MAGIC
    # MLX keys its loaded modules by kernel name *and* a hash of the binary
    # (custom_kernel.cpp), so the two runs below load two modules
    assert image[:4] == FATBIN_MAGIC and len(image) < len(cubin)
    assert cb.build_stats[kern.name]["image_bytes"] == len(image)
    proj, params, cs, st = _decode_kernel_inputs(11)
    results = []
    cb.set_poison(True)
    try:
        for binary in (image, cubin):
            kern._image = binary
            o, c1, s1 = kd.gated_delta_decode(proj, params, cs, st, num_k_heads=HK, num_v_heads=HV)
            o, c1, s1 = kd.gated_delta_decode(proj, params, c1, s1, num_k_heads=HK, num_v_heads=HV)
            mx.eval(o, c1, s1)
            assert finite(o, c1, s1)
            results.append((o, c1, s1))
    finally:
        cb.set_poison(None)
        kern._image = image
    for u, v in zip(*results):
        assert mx.array_equal(u, v).item()
