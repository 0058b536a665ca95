"""bench/user_view.py: the parser of mlx-lm's benchmark output, the summary
math, the plan, the checkpoint marker, and one end-to-end run on the CPU
(tiny preset, both engines, one process each)."""

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import common, user_view as uv  # noqa: E402

OK_OUT = """Running warmup..
Timing with prompt_tokens=4096, generation_tokens=128, batch_size=1.
Trial 1:  prompt_tps=13012.345, generation_tps=120.500, peak_memory=21.345, total_time=1.400
Trial 2:  prompt_tps=12988.000, generation_tps=140.500, peak_memory=21.400, total_time=1.300
Averages: prompt_tps=13000.173, generation_tps=130.500, peak_memory=21.373
"""
HALF_OUT = """Running warmup..
Timing with prompt_tokens=4096, generation_tokens=128, batch_size=4.
Trial 1:  prompt_tps=900.000, generation_tps=150.000, peak_memory=30.100, total_time=20.000
"""
PATCH_ERR = ("mlx_qwen_fast: patched 30 linear_attn, 40 mlp on cuda; ops: moe.prefill=wg\n"
             "some warning\n")


def test_parse_ok():
    r = uv.parse_benchmark_output(OK_OUT, PATCH_ERR, rc=0, num_trials=2)
    assert r["status"] == "ok" and r["error"] is None
    assert [t["trial"] for t in r["trials"]] == [1, 2]
    # the record's rates are the mean of the trials: mlx-lm's own Averages line
    assert r["prompt_tps"] == pytest.approx(r["mlx_averages"]["prompt_tps"], abs=1e-3)
    assert r["generation_tps"] == pytest.approx(r["mlx_averages"]["generation_tps"], abs=1e-3)
    assert r["peak_memory_gb"] == max(t["peak_memory_gb"] for t in r["trials"])
    assert r["trials"][1]["total_time_s"] == pytest.approx(1.3)
    assert r["timing"] == {"prompt_tokens": 4096, "generation_tokens": 128, "batch_size": 1}
    assert r["patch_line"].startswith("mlx_qwen_fast: patched 30 linear_attn")
    assert r["stderr_tail"][-1] == "some warning"


def test_parse_truncated_and_crashed():
    # exit 0 but fewer trial lines than asked and no Averages line
    r = uv.parse_benchmark_output(HALF_OUT, "", rc=0, num_trials=2)
    assert r["status"] == "error" and "truncated" in r["error"]
    assert len(r["trials"]) == 1 and r["prompt_tps"] == pytest.approx(900.0)
    # a crash after one trial: the last stderr lines are kept
    err = "Fatal Python error: Segmentation fault\n\nCurrent thread 0x01 (most recent call first):\n"
    r = uv.parse_benchmark_output(HALF_OUT, err, rc=-11, num_trials=2)
    assert r["status"] == "error"
    assert "Segmentation fault" in r["error"]
    assert any("Segmentation fault" in l for l in r["stderr_tail"])
    # nothing on stdout at all (import failed)
    r = uv.parse_benchmark_output("", "ModuleNotFoundError: No module named 'mlx_lm'\n", rc=1,
                                  num_trials=2)
    assert r["status"] == "error" and r["prompt_tps"] is None and r["peak_memory_gb"] is None
    assert "ModuleNotFoundError" in r["error"]


@pytest.mark.parametrize("err", [
    "Traceback (most recent call last):\nRuntimeError: [malloc] Unable to allocate 68719476736 bytes.\n",
    "RuntimeError: cudaMallocManaged failed: out of memory.\n",
    "terminate called after throwing an instance of 'std::bad_alloc'\n  what():  std::bad_alloc\n",
])
def test_parse_oom(err):
    r = uv.parse_benchmark_output("Running warmup..\n", err, rc=1, num_trials=2)
    assert r["status"] == "oom"
    assert r["stderr_tail"] == err.splitlines()[-uv.STDERR_TAIL_LINES:]
    assert r["error"] and r["error"] in err


def test_parse_timeout_and_sigkill():
    r = uv.parse_benchmark_output(HALF_OUT, "", rc=None, timed_out=True, num_trials=2)
    assert r["status"] == "timeout" and len(r["trials"]) == 1
    # an allocation failure, then a hang until the timeout, counts as OOM
    r = uv.parse_benchmark_output("", "RuntimeError: cudaMallocManaged failed: out of memory.",
                                  rc=None, timed_out=True, num_trials=2)
    assert r["status"] == "oom"
    # SIGKILL that the harness did not send: the kernel's OOM killer
    r = uv.parse_benchmark_output("Running warmup..\n", "", rc=-9, num_trials=2)
    assert r["status"] == "oom" and "SIGKILL" in r["error"]


def test_run_process_timeout_kills():
    out = uv.run_process([sys.executable, "-c",
                          "import time; print('Running warmup..', flush=True); time.sleep(60)"],
                         uv.child_env(dict(os.environ)), timeout_s=3)
    assert out.timed_out and out.rc is None and out.wall_s < 30
    assert out.stdout_times and out.stdout_times[0][1] == "Running warmup.."


def _rec(config, engine, p, g, b, status="ok", **kw):
    return {"config": config, "engine": engine, "prompt_tokens": p, "generation_tokens": g,
            "batch_size": b, "status": status, "process": kw.pop("process", 0), **kw}


def test_summary_math():
    stock_p, stock_g = [300.0, 280.0, 330.0], [50.0, 55.0, 53.0]
    pat_p, pat_g = [13000.0, 12100.0, 14200.0], [110.0, 160.0, 140.0]
    runs = []
    for i, (p, g) in enumerate(zip(stock_p, stock_g)):
        runs.append(_rec("b1", "stock", 4096, 128, 1, prompt_tps=p, generation_tps=g,
                         peak_memory_gb=20.0 + i, process=i))
    for i, (p, g) in enumerate(zip(pat_p, pat_g)):
        runs.append(_rec("b1", "patched", 4096, 128, 1, prompt_tps=p, generation_tps=g,
                         peak_memory_gb=21.0 + i, process=i))
    # records that are not ok must not enter the statistics
    runs.append(_rec("b1", "patched", 4096, 128, 1, status="error", prompt_tps=1e9,
                     generation_tps=1e9, peak_memory_gb=999.0, process=3))
    runs.append(_rec("32k", "patched", 32768, 128, 1, prompt_tps=11600.0, generation_tps=100.0,
                     peak_memory_gb=25.0))
    rows = uv.summarize(runs)
    by = {(r["config"], r["engine"]): r for r in rows}
    assert [(r["config"], r["engine"]) for r in rows] == [
        ("b1", "stock"), ("b1", "patched"), ("32k", "patched")]
    s, p = by[("b1", "stock")], by[("b1", "patched")]
    assert s["prompt_tps"] == statistics.median(stock_p)
    assert (s["prompt_tps_min"], s["prompt_tps_max"]) == (min(stock_p), max(stock_p))
    assert p["generation_tps"] == statistics.median(pat_g)
    assert (p["generation_tps_min"], p["generation_tps_max"]) == (min(pat_g), max(pat_g))
    assert p["n_ok"] == 3 and p["n"] == 4 and p["statuses"] == ["error"]
    assert p["peak_memory_gb"] == 21.0 + 2
    assert p["prompt_ratio"] == pytest.approx(statistics.median(pat_p) / statistics.median(stock_p))
    assert p["generation_ratio"] == pytest.approx(
        statistics.median(pat_g) / statistics.median(stock_g))
    assert s["prompt_ratio"] is None
    assert by[("32k", "patched")]["prompt_ratio"] is None  # no stock to compare with
    lines = uv.format_summary(rows)
    assert len(lines) == 1 + len(rows)
    ratio_text = f"{statistics.median(pat_p) / statistics.median(stock_p):.2f}x"
    assert ratio_text in lines[2] and ratio_text not in lines[1]
    assert uv.ratio(5.0, 0.0) is None and uv.ratio(None, 2.0) is None


def test_configs_and_plan():
    cfgs = uv.parse_configs("b1, 8kx16x2:patched ,128k")
    assert [(c.prompt_tokens, c.generation_tokens, c.batch_size, c.engines) for c in cfgs] == [
        (4096, 128, 1, ("stock", "patched")), (8192, 16, 2, ("patched",)),
        (131072, 128, 1, ("patched",))]
    with pytest.raises(Exception):
        uv.parse_configs("b9")
    with pytest.raises(Exception):
        uv.parse_configs("4096x128")
    plan = uv.build_plan(cfgs[:2], processes=3, order="stock-first")
    seq = [(j.config.name, j.engine, j.process, j.first_in_pair) for j in plan]
    assert seq[:6] == [("b1", "stock", 0, True), ("b1", "patched", 0, False),
                       ("b1", "stock", 1, True), ("b1", "patched", 1, False),
                       ("b1", "stock", 2, True), ("b1", "patched", 2, False)]
    assert [s[1:3] for s in seq[6:]] == [("patched", 0), ("patched", 1), ("patched", 2)]
    abba = [j.engine for j in uv.build_plan(cfgs[:1], processes=4, order="abba")]
    assert abba == ["stock", "patched", "patched", "stock"] * 2
    assert len({j.key for j in plan}) == len(plan)
    # explicit lists: prompt outermost
    ex = uv.explicit_configs([32, 64], [4], [1, 2], ("patched",))
    assert [c.key for c in ex] == [(32, 4, 1), (32, 4, 2), (64, 4, 1), (64, 4, 2)]


def test_estimates_follow_the_rates():
    f = uv.H200
    stock = uv.estimate_process_s(4096, 128, 1, "stock", 2)
    patched = uv.estimate_process_s(4096, 128, 1, "patched", 2)
    start = f["import_s"] + f["load_s"]
    assert stock - start == pytest.approx(
        3 * (4096 / f["stock_prefill_tps"][4096] + 128 / f["stock_decode_tps"][4096]))
    assert start < patched < stock
    assert uv.estimate_process_s(131072, 128, 1, "patched", 2) > \
        uv.estimate_process_s(32768, 128, 1, "patched", 2)
    plan = uv.build_plan([uv.NAMED_CONFIGS["b1"]], 2)
    warm = uv.plan_estimate(plan, 2, fresh=False, write_checkpoint=False)
    cold = uv.plan_estimate(plan, 2, fresh=True, write_checkpoint=True)
    assert cold[0] - warm[0] == pytest.approx(f["stock_jit_s"] + f["checkpoint_s"])
    assert cold[2:] == warm[2:]


def test_child_env_passes_caches_through():
    base = {"MLX_PTX_CACHE_DIR": "/c/ptx", "MLX_QWEN_FAST_CACHE": "/c/k", "PYTHONPATH": "/a:/b",
            "FOO": "bar"}
    env = uv.child_env(base)
    assert env["MLX_PTX_CACHE_DIR"] == "/c/ptx" and env["MLX_QWEN_FAST_CACHE"] == "/c/k"
    assert env["FOO"] == "bar" and env["PYTHONUNBUFFERED"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(uv.REPO_ROOT), "/a", "/b"]
    assert base["PYTHONPATH"] == "/a:/b"  # not modified in place
    assert uv.child_env({})["PYTHONPATH"] == str(uv.REPO_ROOT)


def test_marker_and_foreign_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text("{}")
    shard = ck / "model-00001-of-00001.safetensors"
    shard.write_bytes(b"x" * 100)
    want = {"preset": "tiny", "seed": 0, "router_skew": 1.0}
    assert uv.marker_matches(ck, want) == (False, "no marker")
    # a checkpoint without a marker is not overwritten unasked
    with pytest.raises(RuntimeError, match="did not write"):
        uv.ensure_checkpoint(ck, "tiny", 0, 1.0, env=uv.child_env(dict(os.environ)))
    (ck / uv.MARKER).write_text(json.dumps({**want, "files": uv.checkpoint_files(ck)}))
    assert uv.marker_matches(ck, want)[0]
    assert not uv.marker_matches(ck, {**want, "seed": 1})[0]
    assert not uv.marker_matches(ck, {**want, "router_skew": 0.0})[0]
    shard.write_bytes(b"x" * 50)  # a truncated shard
    ok, reason = uv.marker_matches(ck, want)
    assert not ok and "differ" in reason


def test_resume_compatibility():
    old = {"kind": "user_view", "preset": "tiny", "seed": 0, "router_skew": 1.0, "num_trials": 2}
    uv.check_resumable(old, dict(old))
    for k, v in (("seed", 1), ("num_trials", 3), ("preset", "qwen3.6-35b-a3b")):
        with pytest.raises(ValueError, match=k):
            uv.check_resumable(old, {**old, k: v})
    with pytest.raises(ValueError):
        uv.check_resumable({**old, "kind": "ab"}, old)


REQUIRED = {"engine": str, "prompt_tokens": int, "generation_tokens": int, "batch_size": int,
            "prompt_tps": float, "generation_tps": float, "peak_memory_gb": float,
            "status": str, "process": int, "order": int, "wall_s": float, "trials": list}


def _run_cli(args, timeout=300):
    return subprocess.run([sys.executable, "-m", "bench.user_view", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_end_to_end_tiny(tmp_path):
    ck, out = tmp_path / "ck", tmp_path / "uv.json"
    args = ["--preset", "tiny", "--checkpoint", str(ck), "--prompt", "32", "--gen", "4",
            "--batch", "1", "--processes", "1", "-n", "1", "--timeout", "240"]
    proc = _run_cli(args + ["--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    for key in common.HEADER_KEYS:
        assert key in res, key
    assert res["kind"] == "user_view" and res["preset"] == "tiny" and res["router_skew"] == 1.0
    assert res["checkpoint"]["reused"] is False and (ck / uv.MARKER).is_file()
    runs = res["runs"]
    assert sorted(r["engine"] for r in runs) == ["patched", "stock"]
    assert [r["engine"] for r in sorted(runs, key=lambda r: r["order"])] == ["stock", "patched"]
    for r in runs:
        for key, typ in REQUIRED.items():
            assert isinstance(r[key], typ), (key, r[key])
        assert r["status"] == "ok", r
        assert (r["prompt_tokens"], r["generation_tokens"], r["batch_size"]) == (32, 4, 1)
        assert r["prompt_tps"] > 0 and r["generation_tps"] > 0 and r["peak_memory_gb"] > 0
        assert r["wall_s"] > 0 and len(r["trials"]) == 1
        assert all(math.isfinite(t["prompt_tps"]) and t["prompt_tps"] > 0 for t in r["trials"])
    by = {r["engine"]: r for r in runs}
    assert by["patched"]["patch_line"]  # the patched CLI did patch the model
    assert "--stock" in by["stock"]["cmd"] and "--stock" not in by["patched"]["cmd"]
    row = [r for r in res["summary"] if r["engine"] == "patched"][0]
    assert row["prompt_ratio"] == pytest.approx(
        by["patched"]["prompt_tps"] / by["stock"]["prompt_tps"])
    tail = proc.stdout.strip().splitlines()
    assert tail[-1].split()[1] == "patched" and tail[-2].split()[1] == "stock"

    # resume: nothing left to run, the checkpoint is reused, the file keeps its runs
    proc = _run_cli(args + ["--resume", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res2 = json.loads(out.read_text())
    assert len(res2["invocations"]) == 2 and res2["invocations"][1]["ran"] == 0
    assert res2["invocations"][1]["checkpoint"]["reused"] is True
    assert [r["order"] for r in res2["runs"]] == [r["order"] for r in runs]

    # a budget too small for any process: nothing runs, exit code 3 (left for a resume)
    proc = _run_cli([("1,2" if a == "1" and args[i - 1] == "--batch" else a) for i, a in enumerate(args)] + ["--resume", str(out), "--budget-s", "5"])
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "left for --resume" in proc.stdout
    assert len(json.loads(out.read_text())["runs"]) == len(runs)
