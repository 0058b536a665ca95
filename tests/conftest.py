"""Shared fixtures and the suite's run rules (how to run it: tests/README.md).

* ``tests/`` is put on ``sys.path`` here, so every test module imports the
  helper modules beside this file by name (``import moe_blocks``,
  ``from compare import assert_close``); test file names are unique across
  the subfolders (pytest's default ``prepend`` import mode needs that).
* Marker ``cuda``: needs an NVIDIA GPU with MLX's CUDA backend; skipped here
  when there is none. The one way to mark a CUDA test (no per-file skipif).
* Marker ``cpu_check("file.cu", ...)``: a ``cuda`` test (or one parameter
  set of it) that also runs without a GPU, on the CPU, through the CUDA check
  (``cuda_check.simulated()``: the named kernel sources are compiled as C++
  and run checked, tests/cuda_check.py). The test fails if a named source
  never launched. ``test_cuda_check.py`` fails when a kernel source of the
  package has no such test.
* Marker ``large``: builds full-size-shape models or arrays (several GB of
  GPU memory). Under pytest-xdist workers they are skipped unless
  ``--run-large`` is given: run them alone, serially
  (``python -m pytest -q -m "cuda and large" tests``).
* Every test starts and ends with the package's switches re-read from the
  environment (:func:`mlx_qwen_fast.config.reload`), so an environment
  changed by ``monkeypatch`` never leaks into the next test. Use the ``env``
  fixture to change a switch inside a test.
* On CUDA, MLX's buffer cache is emptied after every test; under xdist each
  worker's MLX memory limit is set to its share of the GPU.
* fp32 means fp32: MLX's CUDA backend runs fp32 matrix products on the
  tensor cores as TF32 (10-bit mantissa) unless ``MLX_ENABLE_TF32=0``
  (``mlx/utils.h``: ``enable_tf32``, read at the first product), which
  would hold fp32 comparisons to TF32's rounding; the suite sets it to 0
  unless the environment says otherwise.
* A model's first load does not start MLX's compile workers
  (``MLX_QWEN_FAST_COMPILE_AHEAD=0`` unless the environment says
  otherwise): every tiny checkpoint's configuration would start a set of
  processes once, beside the xdist workers; tests/test_mlx_compiles.py and
  the warm-up's GPU test turn them on where they test them.
"""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("MLX_ENABLE_TF32", "0")  # before MLX's first matrix product (see above)
os.environ.setdefault("MLX_QWEN_FAST_COMPILE_AHEAD", "0")  # no compile workers on a first load (see above)

import mlx.core as mx  # noqa: E402

from mlx_qwen_fast import config  # noqa: E402  (sets MLX's variables before any GPU use)

from cuda_helpers import HAS_CUDA  # noqa: E402

#: Share of the GPU's memory that all xdist workers together may hold
#: (MLX's memory limit of each worker: this share divided by the workers).
GPU_SHARE = 0.9


def pytest_addoption(parser):
    parser.addoption(
        "--run-large", action="store_true", default=False,
        help="run tests marked 'large' under pytest-xdist workers too (skipped there by default)",
    )


def _xdist_worker():
    return os.environ.get("PYTEST_XDIST_WORKER")


def _gpu_memory_bytes():
    try:
        info = mx.device_info(mx.gpu)
    except (RuntimeError, ValueError, TypeError):
        return None
    for key in ("total_memory", "memory_size"):
        if isinstance(info.get(key), int) and info[key] > 0:
            return info[key]
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs an NVIDIA GPU with MLX's CUDA backend (skipped otherwise)")
    config.addinivalue_line(
        "markers",
        "cpu_check(*sources): a cuda test that also runs on the CPU through the CUDA check "
        "(tests/cuda_check.py) when there is no GPU; sources: the kernel files it must launch",
    )
    config.addinivalue_line(
        "markers",
        "large: full-size shapes, several GB of GPU memory; skipped under pytest-xdist workers "
        "unless --run-large (run them alone: -m 'cuda and large')",
    )
    if HAS_CUDA and _xdist_worker():
        workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
        total = _gpu_memory_bytes()
        if total:
            mx.set_memory_limit(int(total * GPU_SHARE / workers))


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs an NVIDIA GPU with MLX's CUDA backend")
    skip_large = pytest.mark.skip(
        reason="large: skipped under pytest-xdist workers; run alone (-m 'cuda and large') or pass --run-large")
    large_off = bool(_xdist_worker()) and not config.getoption("--run-large")
    for item in items:
        if (not HAS_CUDA and item.get_closest_marker("cuda") is not None
                and item.get_closest_marker("cpu_check") is None):
            item.add_marker(skip_cuda)
        if large_off and item.get_closest_marker("large") is not None:
            item.add_marker(skip_large)


@pytest.fixture(autouse=True)
def _switches_and_memory():
    """Switches re-read from the environment before and after each test; on
    CUDA, MLX's cached buffers freed after it."""
    config.reload()
    yield
    config.reload()
    if HAS_CUDA:
        mx.clear_cache()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep the call phase's report on the item (the cuda-check fixture reads it)."""
    outcome = yield
    if call.when == "call":
        item.mqf_call_report = outcome.get_result()


@pytest.fixture(autouse=True)
def _cuda_check(request):
    """Tests marked ``cpu_check`` run under ``cuda_check.simulated()`` when
    there is no GPU, and fail if a kernel source the marker names never
    launched."""
    mark = request.node.get_closest_marker("cpu_check")
    if HAS_CUDA or mark is None:
        yield
        return
    import cuda_check

    first = len(cuda_check.launches)
    with cuda_check.simulated():
        yield
    ran = {f for f, _ in cuda_check.launches[first:]}
    missing = [s for s in mark.args if s not in ran]
    report = getattr(request.node, "mqf_call_report", None)
    if missing and report is not None and report.passed:
        pytest.fail(f"marked cpu_check for {missing}, which never launched (ran: {sorted(ran)})")


@pytest.fixture
def env(monkeypatch):
    """Set (``env.set(name, value)``) or remove (``env.unset(name)``) an
    environment variable for this test; the package's switches see the
    change at once (:func:`mlx_qwen_fast.config.reload`), and it is undone
    after the test."""

    class _Env:
        def set(self, name, value):
            monkeypatch.setenv(name, value)
            config.reload()

        def unset(self, name):
            monkeypatch.delenv(name, raising=False)
            config.reload()

    return _Env()


@pytest.fixture
def process_environment():
    """For tests of MLX's variables that the package sets
    (``config.apply_process_settings`` / ``restore_process_settings``, which
    write ``os.environ`` directly): both start unset and unclaimed, and the
    whole environment and what the package remembers having set are put
    back after the test."""
    saved_env = dict(os.environ)
    saved = [(s, s.written) for s in config._PROCESS_SETTINGS]
    for s in config._PROCESS_SETTINGS:
        os.environ.pop(s.name, None)
        s.written = None
    config.reload()
    yield
    os.environ.clear()
    os.environ.update(saved_env)
    for s, w in saved:
        s.written = w
    config.reload()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Path of the tiny random-weight checkpoint (seed 0), written once per session.

    Load it with ``mlx_lm.load(tiny_checkpoint)``; ``build_model("tiny", seed=0)``
    gives the same arrays in memory.
    """
    from mlx_qwen_fast.checkpoint import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("tiny_checkpoint"), "tiny", seed=0)


@pytest.fixture(scope="session")
def demo_checkpoint(tmp_path_factory):
    """Tiny checkpoint (seed 0) with ``lm_head_scale=DEMO_LM_HEAD_SCALE``: logits
    far from flat, so greedy tokens of two code paths can be compared."""
    from mlx_qwen_fast.checkpoint import DEMO_LM_HEAD_SCALE, write_checkpoint

    return write_checkpoint(
        tmp_path_factory.mktemp("demo_checkpoint"),
        "tiny",
        seed=0,
        lm_head_scale=DEMO_LM_HEAD_SCALE,
    )


@pytest.fixture(scope="session")
def quant_checkpoint(tmp_path_factory):
    """``quant_checkpoint(name)``: path of the tiny checkpoint (seed 0,
    ``lm_head_scale=DEMO_LM_HEAD_SCALE``) quantised as
    ``quant_variants.VARIANTS[name]``, written once per session."""
    from mlx_qwen_fast.checkpoint import DEMO_LM_HEAD_SCALE, write_checkpoint
    from quant_variants import VARIANTS

    written = {}

    def get(name):
        if name not in written:
            written[name] = write_checkpoint(tmp_path_factory.mktemp(f"quant_{name}"), "tiny", seed=0,
                                             lm_head_scale=DEMO_LM_HEAD_SCALE, **VARIANTS[name][0])
        return written[name]

    return get


@pytest.fixture
def poison():
    """Fill every CUDA kernel output with NaN before the launch (a row the
    kernel forgets to write then fails the ``finite`` checks); afterwards the
    setting goes back to ``MLX_QWEN_FAST_POISON``."""
    from mlx_qwen_fast.kernels import _cuda_build as cb

    cb.set_poison(True)
    yield
    cb.set_poison(None)


@pytest.fixture
def gdn128(monkeypatch):
    """The tiny preset with 128-wide Gated DeltaNet heads (the decode
    kernel's head size) and 4 layers (3 Gated DeltaNet, 1 attention)."""
    from mlx_qwen_fast import checkpoint

    cfg = checkpoint.preset_config("tiny")
    text = cfg["text_config"]
    text.update(linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=2,
                linear_num_value_heads=4, num_hidden_layers=4,
                layer_types=text["layer_types"][:4])
    monkeypatch.setitem(checkpoint.PRESETS, "tiny-gdn128", cfg)
    return "tiny-gdn128"


@pytest.fixture
def kernel_heads(monkeypatch, gdn128):
    """``gdn128`` with the full model's attention heads too (head_dim 256,
    16 query and 2 KV heads, 64 rotated dims): every decode kernel's shape."""
    from mlx_qwen_fast import checkpoint

    cfg = checkpoint.preset_config(gdn128)
    cfg["text_config"].update(head_dim=256)
    cfg["text_config"]["rope_parameters"]["mrope_section"] = [11, 11, 10]
    monkeypatch.setitem(checkpoint.PRESETS, "tiny-kernel-heads", cfg)
    return "tiny-kernel-heads"

