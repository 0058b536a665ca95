"""patch() and install() on mlx-lm's tensor-parallel and pipeline-parallel models.

The fast modules issue none of mlx-lm's collectives, so a model sharded
(``Model.shard``) or pipelined (``model.model.pipeline``) over a group of
more than one process is declined: left entirely stock, one warning, the
report's reason naming the configuration. A group of one process shards
nothing and is patched as usual.

* In-process tests run mlx-lm's own ``shard()`` / ``pipeline()`` with a
  stand-in group of size 2 (they only read ``size()`` and ``rank()`` while
  splitting), so the modules are exactly as shard() leaves them on rank 0.
* ``test_two_ring_ranks_decline_and_match_stock`` runs two real processes
  over MLX's ring backend on 127.0.0.1 (``mlx.launch``, ``distributed_rank.py``),
  tensor parallel and a 2-stage pipeline.
"""

import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import mlx.core as mx
import mlx_lm
import mlx_lm.utils
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.qwen3_5 import DecoderLayer, GatedDeltaNet
from mlx_lm.models.qwen3_next import Qwen3NextSparseMoeBlock

import mlx_qwen_fast
from mlx_qwen_fast import patch

import distributed_rank

TP_REASON = "tensor-parallel sharded model (group size 2"
PP_REASON = "pipeline-parallel model (pipeline size 2"
LAUNCH_TIMEOUT_S = 120
GREEDY_TOKENS = 16


class FakeGroup:
    """What shard()/pipeline() read of a group: its size and this process's rank."""

    def __init__(self, size, rank=0):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.fixture
def tiny(tiny_checkpoint):
    return mlx_lm.load(str(tiny_checkpoint))[0]


def _patch_recording(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = patch(model)
    return report, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def _stock_modules(model):
    return [(type(l.linear_attn) if hasattr(l, "linear_attn") else None, type(l.mlp)) for l in model.layers]


def _assert_declined(model, report, caught, reason):
    assert not report.patched and report.reason.startswith(reason), report.reason
    assert report.reason.endswith("left stock")
    assert caught == [f"mlx_qwen_fast: model left on the stock path: {report.reason}"]
    assert not mlx_qwen_fast.is_patched(model) and model.patch_report is report
    for la, mlp in _stock_modules(model):
        assert la in (None, GatedDeltaNet) and mlp is Qwen3NextSparseMoeBlock
    assert all(type(l) is DecoderLayer for l in model.layers)  # no compiled decode step either


def test_tensor_parallel_shard_is_declined(tiny):
    tiny.shard(FakeGroup(2))
    assert tiny.layers[0].linear_attn.num_v_heads == 4  # shard() split the heads of 8
    before = {id(l): dict(l.items()) for l in tiny.layers}
    report, caught = _patch_recording(tiny)
    _assert_declined(tiny, report, caught, TP_REASON)
    assert {id(l): dict(l.items()) for l in tiny.layers} == before


def test_each_sharded_module_kind_is_detected_alone(tiny):
    """Every mark shard() leaves declines by itself: the group on a
    ``linear_attn``, on a sparse-MoE ``mlp``, and on a distributed linear
    (attention projections)."""
    from mlx.nn.layers.distributed import shard_linear

    layers = tiny.layers
    attn = next(l for l in layers if not l.is_linear).self_attn
    marks = [
        lambda: setattr(layers[0].linear_attn, "sharding_group", FakeGroup(2)),
        lambda: setattr(layers[1].mlp, "sharding_group", FakeGroup(2)),
        lambda: setattr(attn, "o_proj", shard_linear(attn.o_proj, "sharded-to-all", group=FakeGroup(2))),
    ]
    original_o_proj = attn.o_proj
    for mark in marks:
        layers[0].linear_attn.sharding_group = layers[1].mlp.sharding_group = None
        attn.o_proj = original_o_proj
        assert mlx_qwen_fast.patching._distributed_reason(tiny) is None
        mark()
        assert mlx_qwen_fast.patching._distributed_reason(tiny).startswith(TP_REASON)


def test_pipeline_is_declined(tiny):
    n = len(tiny.layers)
    tiny.model.pipeline(FakeGroup(2, rank=1))
    assert len(tiny.layers) == n - n // 2  # rank 1 holds the first half
    report, caught = _patch_recording(tiny)
    _assert_declined(tiny, report, caught, PP_REASON)
    assert "rank 1" in report.reason


def test_group_of_one_is_patched(tiny):
    """shard() and pipeline() over a single process split nothing: patched."""
    group = mx.distributed.init()
    assert group.size() == 1
    tiny.shard(group)
    tiny.model.pipeline(group)
    report, caught = _patch_recording(tiny)
    assert report.patched and report.reason is None and not caught
    assert mlx_qwen_fast.is_patched(tiny)


def test_patched_then_sharded_goes_back_to_stock(tiny):
    """patch, shard, patch: the fast modules would skip the collectives, so
    the second patch puts the stock modules back, with what shard() set."""
    assert patch(tiny).patched
    tiny.shard(FakeGroup(2))
    report, caught = _patch_recording(tiny)
    _assert_declined(tiny, report, caught, TP_REASON)
    la = tiny.layers[0].linear_attn
    assert la.sharding_group.size() == 2 and la.num_v_heads == 4


def test_install_patches_sharded_load_after_sharding(tiny_checkpoint, monkeypatch, capsys):
    """install() wraps sharded_load (mlx_lm.utils's and the name chat and
    server imported) so the model is patched once it is sharded: over a
    group of one it is patched, with one report; uninstall() puts mlx-lm's
    back everywhere."""
    import mlx_lm.chat
    import mlx_lm.server

    original = mlx_lm.utils.sharded_load
    try:
        assert mlx_qwen_fast.install(verbose=True)
        assert mlx_lm.chat.sharded_load is mlx_lm.utils.sharded_load is mlx_lm.server.sharded_load
        assert mlx_lm.utils.sharded_load is not original
        model, _ = mlx_lm.utils.sharded_load(str(tiny_checkpoint))
        assert mlx_qwen_fast.is_patched(model)
        reports = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mlx_qwen_fast:")]
        assert reports == [str(model.patch_report)]
    finally:
        mlx_qwen_fast.uninstall()
    assert mlx_lm.utils.sharded_load is original
    assert mlx_lm.chat.sharded_load is original and mlx_lm.server.sharded_load is original


def test_install_declines_a_model_sharded_inside_sharded_load(tiny_checkpoint):
    """sharded_load shards after load_model: install's load_model leaves the
    model stock there, and the sharded_load wrapper declines the sharded one."""
    real_shard = type(mlx_lm.load(str(tiny_checkpoint))[0]).shard

    def shard_over_two(self, group=None):
        return real_shard(self, FakeGroup(2))

    try:
        assert mlx_qwen_fast.install()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(type(mlx_lm.load(str(tiny_checkpoint))[0]), "shard", shard_over_two)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model, _ = mlx_lm.utils.sharded_load(str(tiny_checkpoint))
    finally:
        mlx_qwen_fast.uninstall()
    caught = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    _assert_declined(model, model.patch_report, caught, TP_REASON)


def _greedy(model, n):
    out = []
    for (tok, _), _ in zip(generate_step(mx.array(distributed_rank.PROMPT), model, max_tokens=n), range(n)):
        out.append(int(tok))
    return out


def _pythonpath():
    """This checkout of the package first, so that the ranks import it."""
    root = str(Path(mlx_qwen_fast.__file__).resolve().parents[1])
    return os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p])


def _launch(args, timeout):
    """Run ``args`` in its own process group; kill the whole group on timeout."""
    env = dict(os.environ, PYTHONPATH=_pythonpath())
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"mlx.launch did not finish in {timeout} s:\n{out[-4000:]}")
    return proc.returncode, out


@pytest.mark.skipif(not mx.distributed.is_available("ring"), reason="MLX built without the ring backend")
@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_two_ring_ranks_decline_and_match_stock(demo_checkpoint, mode):
    """Two processes over the ring backend: on each rank shard() (or a
    2-stage pipeline()) + patch() declines with one warning and leaves no
    fast module, and so does install()'s sharded_load; the split, declined
    model's fp32 greedy tokens are the single-process stock model's."""
    script = Path(distributed_rank.__file__).resolve()
    rc, out = _launch(
        [sys.executable, "-c", "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())",
         "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2",
         "--python", sys.executable, "--env", f"PYTHONPATH={_pythonpath()}",
         str(script), str(demo_checkpoint), str(GREEDY_TOKENS), mode],
        LAUNCH_TIMEOUT_S,
    )
    assert rc == 0, out[-4000:]
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines() if "RESULT " in line]
    assert sorted(r["rank"] for r in results) == [0, 1], out[-4000:]

    stock = mlx_lm.load(str(demo_checkpoint))[0]
    stock.set_dtype(mx.float32)
    expected = _greedy(stock, GREEDY_TOKENS)
    reason = TP_REASON if mode == "tensor" else PP_REASON
    for r in results:
        assert r["size"] == 2
        for route in ("patch", "sharded_load") if mode == "tensor" else ("patch",):
            got = r[route]
            assert not got["patched"] and not got["is_patched"], (r["rank"], route, got)
            assert got["reason"].startswith(reason), got["reason"]
            assert got["warnings"] == [f"mlx_qwen_fast: model left on the stock path: {got['reason']}"]
        assert r["tokens"] == expected, f"rank {r['rank']}: sharded {r['tokens']} vs stock {expected}"
