"""MLX's compiles of a first use in worker processes (mlx_qwen_fast/mlx_compiles.py):
the job list from a checkpoint's config, every job's ops as valid MLX calls,
the workers' files published whole into the shared cache, the CLI's wiring."""

import json
import sys

import pytest

from mlx_qwen_fast import _cli, backend, mlx_compiles as mc, warmup

_Q4_ROUTER8 = {"group_size": 64, "bits": 4, "mode": "affine",
               "language_model.model.layers.0.mlp.gate": {"group_size": 64, "bits": 8},
               "language_model.model.layers.0.mlp.shared_expert_gate": {"group_size": 64, "bits": 8},
               "language_model.model.layers.1.mlp.gate": {"group_size": 64, "bits": 8},
               "language_model.lm_head": False}


def _config(q=None, dtype="bfloat16"):
    cfg = {"model_type": "qwen3_5_moe", "text_config": {"dtype": dtype}}
    if q is not None:
        cfg["quantization"] = q
    return cfg


def test_quantization_classes_from_the_global_and_per_layer_entries():
    assert mc.quantization_classes(_config(_Q4_ROUTER8)) == [(4, 64, "affine"), (8, 64, "affine")]
    assert mc.quantization_classes(_config({"group_size": 32, "bits": 3})) == [(3, 32, "affine")]
    assert mc.quantization_classes(_config({"group_size": 32, "bits": 4, "mode": "mxfp4"})) == [(4, 32, "mxfp4")]
    assert mc.quantization_classes(_config()) == []
    # quantization_config (transformers' name) when quantization is absent; another library's: none
    assert mc.quantization_classes({"quantization_config": {"group_size": 64, "bits": 6}}) == [(6, 64, "affine")]
    assert mc.quantization_classes({"quantization_config": {"quant_method": "gptq", "bits": 4,
                                                            "group_size": 128}}) == []


def test_jobs_per_tile_class_and_kernel():
    jobs = mc.jobs_for(_config(_Q4_ROUTER8))
    qmm = [op for j in jobs for op in j.ops if op["op"] == "quantized_matmul"]
    # 4 and 8 bits: MLX's qmm_sm80 (outputs a multiple of 128) and qmm_naive (64 outputs), 16/32/64 rows
    assert sorted((o["bits"], o["rows"], o["n"]) for o in qmm) == sorted(
        (b, r, n) for b in (4, 8) for r in mc.QMM_ROWS for n in (64, 128))
    assert all(len(j.ops) == 1 for j in jobs if j.ops[0]["op"] == "quantized_matmul")  # one module a worker
    assert all(o["k"] % 64 == 0 and o["dtype"] == "bfloat16" for o in qmm)
    # the gathers first (every first use needs them), then the tile classes in QMM_ROWS's order
    assert [j.ops[0]["op"] for j in jobs[:2]] == ["take", "take"]
    assert [o["rows"] for o in qmm] == sorted((o["rows"] for o in qmm), key=mc.QMM_ROWS.index)
    assert sorted(o["index_dtype"] for j in jobs for o in j.ops if o["op"] == "take" and o["dtype"] != "uint32") \
        == ["int32", "uint32"]
    assert {o["dtype"] for j in mc.jobs_for(_config(_Q4_ROUTER8), "float16") for o in j.ops
            if o["op"] != "take" or o["dtype"] != "uint32"} == {"float16"}
    # the dtype from the text config, else the top level's
    for cfg, want in (({"text_config": {"dtype": "float16"}, "dtype": "float32"}, "float16"),
                      ({"text_config": {}, "torch_dtype": "float32"}, "float32"), ({"dtype": "int8"}, "bfloat16")):
        assert {o["dtype"] for j in mc.jobs_for(dict(cfg, quantization=_Q4_ROUTER8)) for o in j.ops
                if o["op"] != "take" or o["dtype"] != "uint32"} == {want}
    # float32 activations: MLX's naive kernel for every output count (qmm_sm80 takes 16-bit ones)
    f32 = [j for j in mc.jobs_for(_config(_Q4_ROUTER8), "float32") if j.ops[0]["op"] == "quantized_matmul"]
    assert len(f32) == 2 * len(mc.QMM_ROWS) and {j.ops[0]["n"] for j in f32} == {128}
    # 3 bits: MLX's naive kernel for every output count, so one job per tile class
    three = [j for j in mc.jobs_for(_config({"group_size": 64, "bits": 3})) if j.ops[0]["op"] == "quantized_matmul"]
    assert [j.ops[0]["rows"] for j in three] == list(mc.QMM_ROWS)
    # other modes take MLX's other kernels: no quantised-matmul job; unquantised: the gathers only
    for q in ({"group_size": 32, "bits": 4, "mode": "mxfp4"}, None):
        assert {j.ops[0]["op"] for j in mc.jobs_for(_config(q))} == {"take"}


@pytest.mark.parametrize("q", [_Q4_ROUTER8, {"group_size": 32, "bits": 3}, {"group_size": 128, "bits": 6},
                               {"group_size": 64, "bits": 5}])
def test_every_job_is_a_valid_mlx_call(q):
    """The ops run here as they do in a worker (on the CPU they compile nothing)."""
    for job in mc.jobs_for(_config(q)):
        mc.run_job(job)


def test_run_op_names_an_unknown_op():
    with pytest.raises(ValueError, match="unknown op 'matmul'"):
        mc.run_op({"op": "matmul"})


def test_worker_count_bounds(monkeypatch):
    def ram(gb):
        monkeypatch.setattr(mc.os, "sysconf", lambda name: 4096 if name == "SC_PAGE_SIZE" else (gb << 30) // 4096)

    ram(128)
    monkeypatch.setattr(mc.os, "cpu_count", lambda: 16)
    assert mc.worker_count(15) == 15 and mc.worker_count(40) == 15 and mc.worker_count(1) == 1
    monkeypatch.setattr(mc.os, "cpu_count", lambda: 1)
    assert mc.worker_count(15) == 1
    monkeypatch.setattr(mc.os, "cpu_count", lambda: 64)
    ram(8)
    assert mc.worker_count(15) == 2  # 8 GB of host memory at 3 GB a worker


# A stand-in worker: writes the modules its job names into the MLX cache folder it is given
# (as MLX does: .cu, .ptx, .txt), then exits with the job's code, or sleeps past the timeout.
_FAKE = r"""
import json, os, sys, time
spec = json.loads(sys.argv[-1]); d = os.environ["MLX_PTX_CACHE_DIR"]
for op in spec["ops"]:
    if op["op"] == "write":
        for ext in (".cu", ".ptx", ".txt"):
            open(os.path.join(d, op["module"] + ext), "w").write(op["module"] + ext)
    elif op["op"] == "exit":
        sys.exit(op["code"])
    elif op["op"] == "sleep":
        time.sleep(op["s"])
"""


def _job(name, *ops):
    return mc.Job(name, tuple(ops))


def test_workers_publish_whole_modules(tmp_path):
    cache = tmp_path / "ptx"
    cache.mkdir()
    (cache / "kept.ptx").write_text("the cache's own")
    jobs = [_job("a", {"op": "write", "module": "qmm_a"}, {"op": "write", "module": "kept"}),
            _job("b", {"op": "write", "module": "qmm_b"}, {"op": "exit", "code": 3}),
            _job("c", {"op": "sleep", "s": 30}),
            _job("d")]
    ahead = mc.Ahead(jobs, cache, timeout_s=3.0, command=[sys.executable, "-c", _FAKE])
    r = ahead.wait()
    # only a worker that exited with code 0 is published (one stopped inside MLX's write of a module
    # would leave it half written); the failed and the stopped ones are named with the reason
    assert r["published"] == ["qmm_a"] and r["failed"] == ["b (exit code 3)", "c (stopped after 3 s)"]
    assert all((cache / f"qmm_a{ext}").read_text() == "qmm_a" + ext for ext in (".cu", ".ptx", ".txt"))
    assert (cache / "kept.ptx").read_text() == "the cache's own"  # a module the cache holds is left alone
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        ["kept.ptx"] + [f"qmm_a{ext}" for ext in (".cu", ".ptx", ".txt")])  # no folder


def test_close_stops_the_workers_and_leaves_nothing(tmp_path):
    """What runs when the process exits early (a load error, Ctrl-C): running workers are killed, queued
    ones never start, and neither their folders nor their modules are left in the cache."""
    import time

    cache = tmp_path / "ptx"
    cache.mkdir()
    jobs = [_job("slow", {"op": "write", "module": "qmm_slow"}, {"op": "sleep", "s": 60})] * 3
    ahead = mc.Ahead(jobs, cache, command=[sys.executable, "-c", _FAKE])
    deadline = time.time() + 30
    while not ahead._running and time.time() < deadline:
        time.sleep(0.05)
    procs = [p for p, _ in ahead._running.values()]
    assert procs
    t0 = time.time()
    ahead.close()
    assert all(p.wait(timeout=10) is not None for p in procs) and time.time() - t0 < 10
    time.sleep(0.3)  # the scheduler thread sees the close
    assert list(cache.iterdir()) == []
    ahead.close()  # idempotent


def test_start_off_cuda_or_warm_does_nothing(env, tmp_path, tiny_checkpoint, monkeypatch):
    env.set("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    monkeypatch.setattr(backend, "current", lambda: backend.CPU)
    assert mc.start(tiny_checkpoint) is None
    monkeypatch.setattr(backend, "current", lambda: backend.CUDA)
    warmup.mark_warm(tiny_checkpoint, "test")
    assert mc.start(tiny_checkpoint) is None
    env.unset("MLX_PTX_CACHE_DIR")
    assert mc.start(tiny_checkpoint) is None


def test_start_runs_the_checkpoints_jobs(env, tmp_path, tiny_checkpoint, monkeypatch):
    """On CUDA (faked) with a cold cache: the workers run the config's jobs (the real worker module;
    on the CPU their ops compile nothing), and wait() reports each done."""
    env.set("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    monkeypatch.setattr(backend, "current", lambda: backend.CUDA)
    cfg = json.loads((tiny_checkpoint / "config.json").read_text())
    only = [j for j in mc.jobs_for(cfg) if j.ops[0]["op"] != "quantized_matmul"]  # fewer processes on 2 cores
    monkeypatch.setattr(mc, "jobs_for", lambda config, dtype=None: only)
    ahead = mc.start(tiny_checkpoint, "float32")
    assert ahead is not None and ahead.jobs == only
    r = ahead.wait()
    assert r["failed"] == [] and r["published"] == []
    # the workers' folders are gone; the configuration is marked done
    assert [p.name for p in (tmp_path / "ptx").iterdir()] == [mc.done_marker(tiny_checkpoint).name]


def test_the_cli_starts_the_workers_and_waits_after_loading(env, tmp_path, tiny_checkpoint, monkeypatch, capsys):
    """On CUDA (faked): the first run says it compiles ahead and passes install() a wait that reports;
    with the switch off, the old notice; warm, nothing."""
    from mlx_qwen_fast import patching

    env.set("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    env.set("MLX_QWEN_FAST_COMPILE_AHEAD", "1")
    monkeypatch.setattr(backend, "current", lambda: backend.CUDA)
    started = []

    class FakeAhead:
        jobs, workers = [1, 2, 3], 2

        def wait(self):
            return {"seconds": 1.5, "published": ["m1", "m2"], "failed": ["x"]}

    monkeypatch.setattr(mc, "start", lambda path, dtype=None: started.append((path, dtype)) or FakeAhead())
    hooks = []
    monkeypatch.setattr(patching, "install", lambda verbose=False, after_load=None: hooks.append(after_load))
    import types

    fake = types.ModuleType("mlx_lm.fake_cmd2")
    fake.main = lambda: None
    monkeypatch.setitem(sys.modules, "mlx_lm.fake_cmd2", fake)
    # (no --dtype here: the CLI's --dtype wraps mlx_lm's loader for the rest of the process)
    _cli.run_mlx_lm_main("mlx_lm.fake_cmd2", ["--model", str(tiny_checkpoint)])
    assert started == [(tiny_checkpoint, None)]
    assert "3 of MLX's CUDA kernel modules compile in 2 processes while it loads" in capsys.readouterr().err
    hooks[-1]()
    assert "2 MLX kernel modules compiled ahead, 1.5 s since the start; not done: x" in capsys.readouterr().err
    # that run completed: the model is warm, so the next starts nothing
    _cli.run_mlx_lm_main("mlx_lm.fake_cmd2", ["--model", str(tiny_checkpoint)])
    assert len(started) == 1 and hooks[-1] is None and capsys.readouterr().err == ""
    (tmp_path / "ptx").joinpath(warmup.marker_path(tiny_checkpoint).name).unlink()
    env.set("MLX_QWEN_FAST_COMPILE_AHEAD", "0")
    _cli.run_mlx_lm_main("mlx_lm.fake_cmd2", ["--model", str(tiny_checkpoint)])
    assert len(started) == 1 and hooks[-1] is None and "warmup" in capsys.readouterr().err
    # the activation dtype a --dtype names reaches the jobs (the run above marked the model warm again)
    warmup.marker_path(tiny_checkpoint).unlink()
    env.set("MLX_QWEN_FAST_COMPILE_AHEAD", "1")
    assert _cli._first_use_notice(["--model", str(tiny_checkpoint)], "float16")[1] is not None
    assert started[-1] == (tiny_checkpoint, "float16")


def test_install_calls_after_load_once_after_the_next_load(tiny_checkpoint):
    import mlx_lm

    from mlx_qwen_fast import patching

    seen = []
    patching.uninstall()
    try:
        patching.install(after_load=lambda: seen.append(1))
        model, _ = mlx_lm.load(str(tiny_checkpoint))
        assert len(seen) == 1 and patching.is_patched(model)
        mlx_lm.load(str(tiny_checkpoint))
        assert len(seen) == 1
    finally:
        patching.uninstall()


@pytest.mark.cuda
def test_a_worker_compiles_mlx_modules_into_the_cache(tmp_path):
    """On the GPU: one quantised-matmul job's worker leaves MLX's module for it in the cache."""
    cache = tmp_path / "ptx"
    cache.mkdir()
    job = [j for j in mc.jobs_for(_config(_Q4_ROUTER8)) if j.ops[0]["op"] == "quantized_matmul"][0]
    r = mc.Ahead([job], cache).wait()
    assert r["failed"] == [] and len(r["published"]) == 1 and r["published"][0].startswith("qmm_")
    m = r["published"][0]
    assert (cache / f"{m}.ptx").stat().st_size > 0 and (cache / f"{m}.txt").is_file()


def test_start_removes_what_a_dead_parent_left_and_survives_an_unwritable_cache(env, tmp_path, tiny_checkpoint,
                                                                                monkeypatch):
    import subprocess

    cache = tmp_path / "ptx"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (cache / f".mqf-ahead-{dead}-x" / "0").mkdir(parents=True)
    (cache / f".mqf-ahead-{mc.os.getpid()}-y").mkdir()  # a live process's (this one's): kept
    env.set("MLX_PTX_CACHE_DIR", str(cache))
    monkeypatch.setattr(backend, "current", lambda: backend.CUDA)
    monkeypatch.setattr(mc, "jobs_for", lambda config, dtype=None: [_job("nothing")])
    ahead = mc.start(tiny_checkpoint)
    assert ahead is not None and ahead.wait()["failed"] == []
    assert sorted(p.name for p in cache.iterdir()) == [f".mqf-ahead-{mc.os.getpid()}-y",
                                                       mc.done_marker(tiny_checkpoint).name]
    # a cache path that cannot be a folder: no workers, no exception (MLX compiles as it would)
    (tmp_path / "file").write_text("")
    env.set("MLX_PTX_CACHE_DIR", str(tmp_path / "file" / "ptx"))
    assert mc.start(tiny_checkpoint) is None


def test_a_worker_that_cannot_start_is_named_and_wait_returns(tmp_path):
    r = mc.Ahead([_job("a"), _job("b")], tmp_path, command=[sys.executable + "\0"]).wait()
    assert r["published"] == [] and [f.split(" (")[0] for f in r["failed"]] == ["a", "b"]
    assert all("not started" in f for f in r["failed"]) and list(tmp_path.iterdir()) == []


def test_a_worker_exits_when_its_parent_is_gone():
    """The real worker: told a parent that is not its parent (as when the parent died before it
    started), it exits with code 1 at once (Linux), compiling nothing."""
    import subprocess

    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    spec = json.dumps({"name": "x", "ops": [{"op": "take", "dtype": "float32", "index_dtype": "int32"}],
                       "parent": 1 if mc.os.getpid() != 1 else 2})
    r = subprocess.run([sys.executable, "-m", "mlx_qwen_fast.mlx_compiles", "--job", spec], timeout=120)
    assert r.returncode == 1
    spec = json.dumps({"name": "x", "ops": [{"op": "take", "dtype": "float32", "index_dtype": "int32"}],
                       "parent": mc.os.getpid()})
    assert subprocess.run([sys.executable, "-m", "mlx_qwen_fast.mlx_compiles", "--job", spec],
                          timeout=120).returncode == 0


def test_workers_mark_their_configuration_done_when_every_job_ran_to_its_end(env, tmp_path, tiny_checkpoint,
                                                                              monkeypatch):
    """A failed job counts (it would fail again; its module compiles in the caller); workers stopped by
    close() before their end do not."""
    import time

    cache = tmp_path / "ptx"
    cache.mkdir()
    env.set("MLX_PTX_CACHE_DIR", str(cache))
    marker = mc.done_marker(tiny_checkpoint)
    assert marker.parent == cache and marker.name.endswith("-ahead")
    fake = [sys.executable, "-c", _FAKE]
    ahead = mc.Ahead([_job("slow", {"op": "sleep", "s": 60})], cache, command=fake, marker=marker)
    time.sleep(0.5)
    ahead.close()
    assert not marker.exists()
    r = mc.Ahead([_job("a"), _job("b", {"op": "exit", "code": 1})], cache, command=fake, marker=marker).wait()
    assert r["failed"] == ["b (exit code 1)"] and marker.is_file()
    assert json.loads(marker.read_text())["failed"] == ["b (exit code 1)"]
    monkeypatch.setattr(backend, "current", lambda: backend.CUDA)
    assert mc.start(tiny_checkpoint) is None  # done: not started again


def test_a_scripts_first_load_compiles_ahead_before_returning(env, tiny_checkpoint, monkeypatch, capsys):
    """mlx_lm.load through install() (a user's script): on a first use the load starts the workers
    and waits for them before it returns; not for a lazy load, not when a CLI passed after_load, not
    with the switch off."""
    import mlx_lm

    from mlx_qwen_fast import patching

    calls = []

    class FakeAhead:
        jobs, workers = [1, 2], 2

        def wait(self):
            calls.append("wait")
            return {"seconds": 0.5, "published": ["m"], "failed": []}

    monkeypatch.setattr(mc, "start", lambda path, dtype=None: calls.append(str(path)) or FakeAhead())
    env.set("MLX_QWEN_FAST_COMPILE_AHEAD", "1")
    patching.uninstall()
    try:
        patching.install()
        model, _ = mlx_lm.load(str(tiny_checkpoint))
        assert calls == [str(tiny_checkpoint), "wait"] and patching.is_patched(model)
        err = capsys.readouterr().err
        assert "2 of MLX's CUDA kernel modules compile in 2 processes" in err and "1 MLX kernel modules" in err
        mlx_lm.load(str(tiny_checkpoint), lazy=True)
        patching.install(after_load=lambda: None)
        mlx_lm.load(str(tiny_checkpoint))
        env.set("MLX_QWEN_FAST_COMPILE_AHEAD", "0")
        mlx_lm.load(str(tiny_checkpoint))
        assert calls == [str(tiny_checkpoint), "wait"]
    finally:
        patching.uninstall()
