"""Smoke tests of the benchmarks (CPU, tiny preset): every script imports and
answers ``--help``, the CPU-capable ones run end to end and write a result
JSON of the documented schema, the CUDA-only ones refuse with a message, and
bench.ab's warm-up rule stops where it should. Not a timing claim: lengths,
rounds and steps are the smallest that exercise the code paths (chunked
prefill, decode from a copied cache, ``--append``, every op family)."""

import contextlib
import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import ab, common, numerics, ops  # noqa: E402
from cuda_helpers import HAS_CUDA  # noqa: E402

HEADER = {
    "kind": str, "date": str, "device": str, "backend": str, "mlx_version": str,
    "mlx_lm_version": str, "python": str, "commit": str, "config": dict,
}
NUM = (int, float)
OPT_NUM = (int, float, type(None))
PREFILL = {"tokens": int, "engine": str, "tok_s": OPT_NUM, "tok_s_min": OPT_NUM,
           "tok_s_max": OPT_NUM, "peak_gb": OPT_NUM, "status": str, "seconds": NUM,
           "tokens_done": int, "roofline_frac": OPT_NUM, "flops_per_token": NUM,
           "warmup_runs": int, "warmup_tok_s": list, "warmup_seconds": NUM}
DECODE = {"context": int, "engine": str, "tok_s": OPT_NUM, "tok_s_min": OPT_NUM,
          "tok_s_max": OPT_NUM, "peak_gb": OPT_NUM, "roofline_frac": OPT_NUM,
          "host_ms_per_token": OPT_NUM, "device_ms_per_token": OPT_NUM, "status": str,
          "bytes_per_token": NUM, "warmup_runs": int, "warmup_tok_s": list, "warmup_seconds": NUM}
PAIR = {"a": str, "b": str, "positions": int, "top1_agree": NUM, "ppl_delta_pct": NUM,
        "mean_kl": NUM, "max_abs_dlogit": NUM}
OP = {"op": str, "backend": str, "impl": str, "shape": dict, "ms": OPT_NUM,
      "gbps": OPT_NUM, "tflops": OPT_NUM, "roofline_frac": OPT_NUM, "status": str}
TINY = ["--preset", "tiny", "--dtype", "float32"]
SMALL_CEILINGS = ["--copy-mib", "4", "--matmul-n", "64"]

#: The scripts of bench/ this file covers (bench.user_view has its own tests):
#: modules run as ``python -m bench.<name>``, and the CUDA-only device scripts.
MODULES = ("ab", "numerics", "ops", "ceilings", "plots", "first_use", "startup", "verify_pass", "dflash")
DEVICE_SCRIPTS = ("gdn_cuda.py", "moe_cuda.py", "moe_decode_cuda.py", "profile_kernels.py", "node_cost.py",
                  "prefill_gemm.py")
H200_STAGES = {"tests", "ab", "ops", "profile", "dprofile", "phases", "userview", "firstuse", "ahead", "decode", "split"}


def check_keys(record, schema, where):
    for key, types in schema.items():
        assert key in record, f"{where}: missing {key!r}"
        assert isinstance(record[key], types) and not isinstance(record[key], bool), (
            f"{where}: {key}={record[key]!r} is not {types}")
        if isinstance(record[key], float):
            assert math.isfinite(record[key]), f"{where}: {key} not finite"


def load(path, kind):
    with open(path) as f:
        result = json.load(f)
    check_keys(result, HEADER, path)
    assert result["kind"] == kind
    return result


def check_ceilings(c):
    assert c is None or (c["copy_gbps"] > 0 and c["bf16_tflops"] > 0)


def check_warmup(r, max_runs, tol):
    """A record's warm-up fields follow the rule: 1..max_runs rates, and
    converged exactly when the last two agree (or it stopped at the cap)."""
    rates = r["warmup_tok_s"]
    assert r["warmup_runs"] == len(rates) and 1 <= len(rates) <= max_runs, r
    assert all(isinstance(x, float) and x > 0 for x in rates), r
    if r["warmup_converged"]:
        assert len(rates) >= 2 and ab.rates_agree(rates[-2], rates[-1], tol), r
    else:
        assert r["warmup_converged"] is False and len(rates) == max_runs, r
    for a, b in zip(rates[:-2], rates[1:-1]):  # it did not stop later than needed
        assert not ab.rates_agree(a, b, tol), r


def run_py(*argv, timeout=120):
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_ab_numerics_ops(tmp_path):
    # --- A/B: both sweeps on 2 small lengths, chunked prefill (step 8)
    out = tmp_path / "ab.json"
    ab.main(TINY + SMALL_CEILINGS + [
        "--prefill", "8,12", "--decode", "8,12", "--prefill-step-size", "8",
        "--rounds", "1", "--decode-steps", "2", "--warmup-max-runs", "4", "--out", str(out)])
    res = load(out, "ab")
    for key in ("preset", "router_skew", "patch_report", "prefill", "decode", "ceilings"):
        assert key in res
    assert res["preset"] == "tiny" and res["router_skew"] == 0.0
    assert res["config"]["warmup_max_runs"] == 4 and res["config"]["warmup_tolerance"] == 0.05
    assert isinstance(res["patch_report"]["ops"], dict) and res["patch_report"]["ops"]
    check_ceilings(res["ceilings"])
    assert {(r["tokens"], r["engine"]) for r in res["prefill"]} == {
        (n, e) for n in (8, 12) for e in ("stock", "patched")}
    assert {(r["context"], r["engine"]) for r in res["decode"]} == {
        (n, e) for n in (8, 12) for e in ("stock", "patched")}
    for r in res["prefill"]:
        check_keys(r, PREFILL, "prefill")
        assert r["status"] == "ok", r
        check_warmup(r, 4, 0.05)  # 8 = [7, 1] and 12 = [8, 3, 1]: new chunk shapes each
    for r in res["decode"]:
        check_keys(r, DECODE, "decode")
        assert r["status"] == "ok", r
        check_warmup(r, 4, 0.05)
    # plots next to the JSON (skipped only without matplotlib)
    if importlib.util.find_spec("matplotlib") is not None:
        for suffix in ("prefill", "decode"):
            png = tmp_path / f"ab-{suffix}.png"
            assert png.exists() and png.stat().st_size > 0, png

    # --- --append: two lengths for one engine, merged into the same file; a
    # 0.001 s budget times the prefill out at its first chunk boundary, so the
    # longer length is not run (and has no warm-up)
    ab.main(TINY + ["--prefill", "12,24", "--prefill-step-size", "8", "--rounds", "1",
                    "--engines", "patched", "--no-ceilings", "--no-plots", "--warmup-max-runs", "1",
                    "--max-seconds", "0.001", "--out", str(out), "--append"])
    res = load(out, "ab")
    assert len(res["runs"]) == 2 and len(res["prefill"]) == 5 and len(res["decode"]) == 4
    new = {r["tokens"]: r for r in res["prefill"] if r["run"] == 1}
    assert set(new) == {12, 24}
    assert new[12]["status"] == "timeout" and new[12]["tokens_done"] == 8
    assert new[12]["warmup_runs"] == 1 and new[12]["warmup_converged"] is False  # one run: never converged
    assert new[24]["skipped"] and new[24]["warmup_runs"] == 0  # timed out at 12 already
    check_ceilings(res["ceilings"])  # kept from the first run

    # --- numerics: short sequence
    out = tmp_path / "numerics.json"
    numerics.main(TINY + ["--positions", "32", "--out", str(out)])
    res = load(out, "numerics")
    assert [(p["a"], p["b"]) for p in res["pairs"]][:2] == [("stock", "fp32"), ("patched", "fp32")]
    for p in res["pairs"]:
        check_keys(p, PAIR, "pair")
        assert p["positions"] == 32 and 0.0 <= p["top1_agree"] <= 1.0
        assert p["mean_kl"] >= -1e-6

    # --- ops: tiny shapes
    out = tmp_path / "ops.json"
    ops.main(TINY + ["--smoke", "--out", str(out)])
    res = load(out, "ops")
    check_ceilings(res["ceilings"])
    assert {r["op"] for r in res["ops"]} == set(ops.OPS)
    for r in res["ops"]:
        check_keys(r, OP, "op")
        assert r["status"] in common.STATUSES
        if r["impl"] in ("stock", "stock-loop") or r["default"]:
            assert r["status"] == "ok", r  # others may be kernels of no use here
    gd = {r["impl"] for r in res["ops"] if r["op"] == "gated_delta.prefill"}
    assert "stock-loop" in gd and "chunked" in gd
    assert {r["impl"] for r in res["ops"] if r["op"].startswith("attention")} == {"stock"}
    layer = {r["impl"]: r for r in res["ops"] if r["op"] == "gated_delta.decode_layer"}
    assert set(layer) == {"stock", "patched"} and layer["patched"]["default"]
    assert all(r["status"] == "ok" and r["shape"]["chain"] == 2 for r in layer.values())
    pstep = {r["impl"]: r for r in res["ops"] if r["op"] == "gated_delta.prefill_step"}
    assert pstep["stock"]["status"] == "ok" and pstep["stock"]["chain"] == ops.CHAIN
    assert pstep["stock"]["chain_steady"] == [2, 3] and pstep["stock"]["ms_chain_short"] is not None
    step = {r["impl"]: r for r in res["ops"] if r["op"] == "gated_delta.decode_step"}
    assert "stock" in step and all(r["status"] == "ok" and r["shape"]["chain"] == 2
                                   for r in step.values())
    for r in list(step.values()) + list(layer.values()):  # the steady-state decode figure
        assert r["decode_steady"] == [2, 3] and isinstance(r["ms_steady"], float), r

    # --- ops --defaults-only: per op and shape, mlx-lm's code and the default only
    out2 = tmp_path / "ops-defaults.json"
    ops.main(TINY + ["--smoke", "--defaults-only", "--no-ceilings", "--ops", "gated_delta,moe",
                     "--out", str(out2)])
    rows = load(out2, "ops")["ops"]
    by_point = {}
    for r in rows:
        by_point.setdefault((r["op"], r["shape"]["T"]), []).append(r)
    for point, rs in by_point.items():
        impls = [r["impl"] for r in rs]
        assert 1 <= len(impls) <= 2 and impls[0] in ("stock", "stock-loop"), (point, impls)
        assert any(r["default"] for r in rs), (point, impls)
    assert [r["impl"] for r in by_point[("gated_delta.prefill", 16)]] == ["stock-loop", "chunked"]


class _Clock:
    """A fake ``time`` module for bench.ab: ``perf_counter`` returns a clock
    that only the fake runs advance."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self):
        return self.now


class _Runs:
    """A fake ``run_once`` for :func:`bench.ab.warm_until_stable`: each call
    takes the next (status, seconds) off the list, advances the clock by the
    seconds and records the budget it was given."""

    def __init__(self, clock, *runs):
        self.clock, self.runs, self.budgets = clock, list(runs), []

    def __call__(self, max_seconds):
        self.budgets.append(max_seconds)
        status, seconds = self.runs.pop(0)
        self.clock.now += seconds
        return ab.Run(status, seconds, 10 if status == "ok" else 3)


def _ctx(max_runs=6, tol=0.05, budget=None):
    return ab.Context(roofline=None, ceilings=None, vocab=10, prompt_seed=0, step=8, rounds=1,
                      max_seconds=None, warmup_max_seconds=budget, warmup_max_runs=max_runs,
                      warmup_tolerance=tol)


def test_warmup_rule(monkeypatch):
    """bench.ab's warm-up: runs until two consecutive rates agree within the
    tolerance, capped by runs and by the time budget; a first run that fails
    fails the warm-up, a later timeout only ends it."""
    clock = _Clock()
    monkeypatch.setattr(ab, "time", clock)
    # 100 -> 50 -> 49 tok/s (10 tokens in 0.1, 0.2, 0.204 s): the last two agree
    runs = _Runs(clock, ("ok", 0.1), ("ok", 0.2), ("ok", 0.204), ("ok", 0.3))
    w = ab.warm_until_stable(runs, 10, _ctx(), "t")
    assert w.converged and w.failed is None and len(runs.runs) == 1
    assert w.rates == pytest.approx([100.0, 50.0, 10 / 0.204])
    assert w.seconds == pytest.approx(0.504)
    f = w.fields()
    assert f["warmup_runs"] == 3 and f["warmup_converged"] is True and len(f["warmup_tok_s"]) == 3
    # never two alike: stops at the cap, not converged
    runs = _Runs(clock, *[("ok", s) for s in (0.1, 0.2, 0.4, 0.8)])
    w = ab.warm_until_stable(runs, 10, _ctx(max_runs=3), "t")
    assert not w.converged and len(w.rates) == 3 and runs.runs == [("ok", 0.8)]
    # one run only (--warmup-max-runs 1): a single warm-up, never "converged"
    w = ab.warm_until_stable(_Runs(clock, ("ok", 0.1), ("ok", 0.1)), 10, _ctx(max_runs=1), "t")
    assert w.rates == [100.0] and not w.converged
    # exactly at the tolerance agrees; just above does not
    assert ab.rates_agree(100.0, 105.0, 0.05) and not ab.rates_agree(100.0, 105.1, 0.05)
    # the budget (1 s, 0.2 of it spent before): each run is given what is left,
    # and no run starts once what is left is shorter than the last run
    runs = _Runs(clock, ("ok", 0.3), ("ok", 0.4), ("ok", 0.41))
    w = ab.warm_until_stable(runs, 10, _ctx(budget=1.0), "t", spent=0.2)
    assert runs.budgets == pytest.approx([0.8, 0.5]) and len(w.rates) == 2 and not w.converged
    assert w.seconds == pytest.approx(0.9)
    # a first run that does not finish fails the warm-up; a later timeout only ends it
    w = ab.warm_until_stable(_Runs(clock, ("timeout", 5.0)), 10, _ctx(), "t")
    assert w.failed is not None and w.failed.status == "timeout" and w.rates == []
    w = ab.warm_until_stable(_Runs(clock, ("ok", 0.1), ("timeout", 5.0)), 10, _ctx(), "t")
    assert w.failed is None and w.rates == [100.0] and not w.converged
    w = ab.warm_until_stable(_Runs(clock, ("ok", 0.1), ("oom", 0.5)), 10, _ctx(), "t")
    assert w.failed is not None and w.failed.status == "oom"


def test_ab_refuses_bad_warmup_flags(tmp_path):
    for argv in (["--warmup-max-runs", "0"], ["--warmup-tolerance", "0"]):
        with pytest.raises(SystemExit, match="--warmup-max-runs must be >= 1"):
            ab.main(TINY + argv + ["--no-ceilings", "--out", str(tmp_path / "x.json")])


def test_roofline_matches_design_notes():
    from mlx_qwen_fast.checkpoint import PRESETS

    roof = common.Roofline.from_config(PRESETS["qwen3.6-35b-a3b"], common.Quant.affine())
    assert roof.kv_bytes_per_token() == 20480
    assert roof.decode_bytes_per_token(0) == pytest.approx(1.80e9, rel=0.01)
    assert roof.decode_bytes_per_token(4096) == pytest.approx(1.88e9, rel=0.01)
    assert roof.decode_bytes_per_token(131072) == pytest.approx(4.48e9, rel=0.01)
    assert roof.active_params() == pytest.approx(2.95e9, rel=0.01)


def test_chunking_matches_generate_step():
    assert ab.chunk_sizes(1, 2048) == [1]
    assert ab.chunk_sizes(2048, 2048) == [2047, 1]
    assert ab.chunk_sizes(4096, 2048) == [2048, 2047, 1]
    assert ab.warmup_length(131072, 2048) == 4096
    assert common.parse_lengths("256,1k,128K") == [256, 1024, 131072]


def test_ops_rejects_bad_arguments_before_building(tmp_path, capsys, monkeypatch):
    """--ops / --impls / --repeats errors name the argument and come before
    the ceilings and the checkpoint are built (minutes on the full preset)."""
    def no_build(*a, **k):
        raise AssertionError("built a checkpoint before checking the arguments")

    monkeypatch.setattr(common, "load_checkpoint", no_build)
    monkeypatch.setattr(ops.ceilings_mod, "from_args", no_build)
    out = str(tmp_path / "o.json")
    for argv, needle in (
        (["--ops", "gated_delta.nonsense"], "--ops: unknown 'gated_delta.nonsense'"),
        (["--ops", "gated_delta.prefill_step", "--impls", "stock,typo"], "--impls: ['typo']"),
        (["--ops", "gated_delta.prefill_step", "--impls", "chunked"], "--impls: ['chunked']"),
        (["--repeats", "0"], "--repeats"),
    ):
        with pytest.raises(SystemExit) as e:
            ops.main(TINY + argv + ["--out", out])
        assert e.value.code == 2
        assert needle in capsys.readouterr().err


def test_ops_implementations_on_cuda_names():
    """The CUDA rows bench.ops would run there: the names of the package's
    dispatch tables (no kernel is built to list them)."""
    assert list(ops.implementations("moe", "cuda")) == ["stock", "reference", "cuda-prefill", "cuda-decode"]
    assert list(ops.implementations(ops._STEP, "cuda")) == ["stock", "cuda-kernel"]
    assert list(ops.implementations(ops._PSTEP, "cuda")) == ["stock", "cuda-kernel"]
    assert "cuda-kernel" in ops.implementations("gated_delta", "cuda")
    assert list(ops.implementations("attention", "cuda")) == ["stock"]
    assert ops.applies("moe", "cuda-decode", 4) and not ops.applies("moe", "cuda-decode", 5)


def test_startup_and_first_use_on_cpu(tmp_path):
    """bench.startup (two fresh processes, tiny preset) and bench.first_use
    (the generate CLI on a tiny checkpoint) run on the CPU and write their JSONs."""
    from mlx_qwen_fast.checkpoint import write_checkpoint

    out = tmp_path / "startup.json"
    r = run_py("-m", "bench.startup", "--preset", "tiny", "--prompt", "16", "--out", str(out), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = load(out, "startup")
    assert set(res["runs"]) == {"first_use", "cached"}
    assert all(v["rc"] == 0 and v["first_prefill_s"] > 0 for v in res["runs"].values()), res["runs"]

    ck = write_checkpoint(tmp_path / "ck", "tiny", seed=0)
    out = tmp_path / "first_use.json"
    r = run_py("-m", "bench.first_use", "--model", str(ck), "--runs", "1", "--max-tokens", "2",
               "--timeout", "200", "--out", str(out), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = load(out, "first_use")
    (run,) = res["runs"]
    assert run["rc"] == 0 and run["status"] == "ok" and run["first_token_s"] is not None, run


@pytest.mark.parametrize("name", MODULES)
def test_module_help(name):
    r = run_py("-m", f"bench.{name}", "--help")
    assert r.returncode == 0 and "usage" in r.stdout.lower(), r.stderr[-2000:]


def test_phase_clock_help_and_cpu_refusal():
    """bench.phase_clock answers --help and, without CUDA, exits 2 with one
    line (its kernels' diagnostic builds run on the CPU in their kernel
    tests: test_phase_clock_build)."""
    r = run_py("-m", "bench.phase_clock", "--help")
    assert r.returncode == 0 and "usage" in r.stdout.lower(), r.stderr[-2000:]
    if not HAS_CUDA:
        r = run_py("-m", "bench.phase_clock")
        assert r.returncode == 2 and "Traceback" not in r.stderr and "CUDA" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("script", DEVICE_SCRIPTS)
def test_device_script_help_and_cpu_refusal(script):
    """Every device script answers --help here and, without CUDA, exits with
    a one-line message rather than a traceback."""
    path = str(ROOT / "bench" / script)
    r = run_py(path, "--help")
    assert r.returncode == 0 and "usage" in r.stdout.lower(), r.stderr[-2000:]
    argv = {"profile_kernels.py": ["kernels"], "node_cost.py": ["2"]}.get(script, [])
    r = run_py(path, *argv)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "CUDA" in r.stderr, r.stderr[-2000:]


def test_profile_summary(tmp_path, capsys):
    """ncu CSV -> GPU ms per kernel family; units converted, unknown ones refused."""
    from bench import profile_kernels as pk

    head = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\n'
    rows = [("mqf_moe_gate_up_abc", "us", "1,500"), ("void mlx::qmm_sm80_kernel<64>", "ms", "0.3"),
            ("mqf_gdn_scan_0f", "ns", "150000"), ("foo", "usecond", "50")]
    csv_path = tmp_path / "k.csv"
    csv_path.write_text("==PROF== Connected\n" + head + "".join(
        f'"{i}","{n}","gpu__time_duration.sum","{u}","{v}"\n' for i, (n, u, v) in enumerate(rows)))
    pk.main(["summary", str(csv_path)])
    out = capsys.readouterr().out
    lines = {ln[:44].strip(): ln[44:].split() for ln in out.splitlines() if ln[:44].strip()}
    assert lines["moe grouped GEMM (ours)"][:2] == ["1.500", "75.0%"]
    assert lines["quantized matmul / GEMV / dequantize (MLX)"][:2] == ["0.300", "15.0%"]
    assert lines["gdn scan (ours)"][:2] == ["0.150", "7.5%"]
    assert lines["other"][:2] == ["0.050", "2.5%"]
    assert lines["total (serialised)"][:2] == ["2.000", "4"]
    pk.main(["summary", str(csv_path), "--per", "2"])  # two decode tokens profiled: per token
    out = capsys.readouterr().out
    lines = {ln[:44].strip(): ln[44:].split() for ln in out.splitlines() if ln[:44].strip()}
    assert lines["moe grouped GEMM (ours)"] == ["0.750", "75.0%", "0.5"]
    assert lines["total (serialised)"] == ["1.000", "2"]
    with pytest.raises(SystemExit, match="--per must be >= 1"):
        pk.main(["summary", str(csv_path), "--per", "0"])
    # every kernel base name of the package falls in one of "ours" families
    for name in ("mqf_moe_route_1", "mqf_moe_count_1", "mqf_moe_scatter_1", "mqf_moe_dec_gate_up_1",
                 "mqf_moe_dec_down_1", "mqf_moe_down_1", "mqf_gdn_frontend_1", "mqf_gdn_decode_1",
                 "mqf_gated_rms_norm_1"):
        fam = next(f for f, rx in pk.FAMILIES if re.search(rx, name))
        assert fam.endswith("(ours)") and fam != "other ours", (name, fam)
    csv_path.write_text(head + '"0","x","gpu__time_duration.sum","parsec","1"\n')
    with pytest.raises(SystemExit, match="unknown time unit"):
        pk.summary(str(csv_path))
    with pytest.raises(SystemExit, match="cannot read"):
        pk.summary(str(tmp_path / "missing.csv"))


def test_h200_stages():
    """bench/h200.sh parses, offers exactly the stable stages, and every file
    a stage writes lies directly under $OUT (at most 8 per stage, gpu.txt included)."""
    text = (ROOT / "bench" / "h200.sh").read_text()
    assert subprocess.run(["bash", "-n", str(ROOT / "bench" / "h200.sh")]).returncode == 0
    body = text[text.index('case "${1:-}" in'):]
    labels = re.findall(r"^([a-z]+)\)", body, flags=re.M)
    assert set(labels) == H200_STAGES and len(labels) == len(H200_STAGES)
    assert not re.search(r"\bs\d+[a-z]?\b", body), "a stage or comment named after a session"
    for label, block in zip(labels, re.split(r"^[a-z]+\)", body, flags=re.M)[1:]):
        files = set(re.findall(r'\$OUT/([A-Za-z0-9_.-]+)"?', block))
        assert all("/" not in f for f in files), (label, files)
        assert 1 <= len(files) + 1 <= 8, (label, files)  # + gpu.txt


def test_first_use_cache_root(tmp_path):
    """--cache-root: the two cache folders are made under it, and a root whose
    caches already hold files is refused (a first use needs empty caches)."""
    from bench import first_use

    ptx, kernels = first_use._cache_dirs(tmp_path / "c")
    assert (ptx, kernels) == (tmp_path / "c" / "mlx-ptx", tmp_path / "c" / "kernels")
    assert ptx.is_dir() and kernels.is_dir()
    (kernels / "x.cubin").write_bytes(b"0")
    with pytest.raises(SystemExit, match="not empty"):
        first_use._cache_dirs(tmp_path / "c")
    a, b = first_use._cache_dirs(None)
    assert a.is_dir() and b.is_dir() and a != b


def test_nodes_counts_graph_and_layers():
    """bench.nodes: primitive names of an unevaluated graph (evaluated arrays
    are leaves), and a tiny model's step split into its layers."""
    import mlx.core as mx

    from bench import nodes

    a, b = mx.array([1.0, 2.0]), mx.array([3.0, 4.0])
    mx.eval(a, b)
    assert sorted(nodes.graph_primitives([(a + b) * b])) == ["Add", "Multiply"]
    c = nodes.count(["Add", "Reshape", "Add"])
    assert c == {"nodes": 3, "launching": 2, "by_primitive": {"Add": 2, "Reshape": 1}}
    res = nodes.main(["--preset", "tiny", "--dtype", "float32", "--context", "300", "--engines", "stock"])
    rec = res["engines"]["stock"]
    kinds = rec["layers"]
    assert set(kinds) == {"linear_attention", "full_attention"}
    assert sum(k["layers"] for k in kinds.values()) == rec["num_layers"]
    assert rec["outside_layers"]["nodes"] > 0
    assert "SliceUpdate" in kinds["full_attention"]["by_primitive"]
    # the next K/V row is written in place: the synthetic cache has room for it
    model, _ = __import__("mlx_qwen_fast.checkpoint", fromlist=["x"]).build_model("tiny", dtype=mx.float32)
    cache = nodes.synthetic_cache(model, 256)
    kv = [c for c in cache if hasattr(c, "keys")][0]
    cap = kv.keys.shape[2]
    nodes.step_graph(model, cache)
    assert cap == 512 and kv.keys.shape[2] == cap and kv.offset == 257


def test_decode_split_switch_alternates_in_one_process(tmp_path, monkeypatch):
    """bench.decode_split --switch: each repeat runs the split with the switch
    off and on, the order alternating between repeats, each run tagged with
    its value and the value the package read (the switch parsed again); the
    variable is left as the last run set it; a name that is
    not a boolean switch is refused before any model is built."""
    from bench import decode_split

    var = "MLX_QWEN_FAST_GDN_MIXER"
    monkeypatch.setenv(var, "1")  # restored (or removed) afterwards: the run sets it
    out = tmp_path / "split.json"
    assert decode_split.main(["--preset", "tiny", "--context", "16", "--steps", "2", "--pipelined", "3",
                              "--repeats", "2", "--switch", var, "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["switch"][var] for r in runs] == ["0", "1", "1", "0"]
    assert [r["switch_read"] for r in runs] == [False, True, True, False]  # what the package read
    assert all(r["pipelined_tok_s"] > 0 and r["build_ms"] > 0 for r in runs)
    for bad in ("MLX_QWEN_FAST_CACHE", "NOT_A_SWITCH"):
        with pytest.raises(SystemExit):
            decode_split.main(["--preset", "tiny", "--switch", bad])


def test_verify_pass_on_cpu(tmp_path, monkeypatch):
    """bench.verify_pass on the tiny preset (fp32, CPU): every size of
    --sizes timed (median and min of the repeats, t(S)/t(1) exactly 1 at
    S = 1) for B = 2 inside the rollback context, each op's implementation
    per size in the JSON, the cache put back after every pass (the same
    logits from every pass of one size); bad arguments refused before any
    model is built."""
    from bench import verify_pass

    out = tmp_path / "verify.json"
    assert verify_pass.main(TINY + ["--context", "16", "--sizes", "1-2,5", "--batch", "2", "--repeats", "2",
                                    "--warmup", "1", "--rollback", "--out", str(out)]) == 0
    res = load(out, "verify_pass")
    assert res["sizes"] == [1, 2, 5] and res["batch"] == 2 and res["rollback"] is True
    assert [r["S"] for r in res["runs"]] == [1, 2, 5]
    assert all(len(r["times_ms"]) == 2 and 0 < r["min_ms"] <= r["median_ms"] for r in res["runs"])
    assert [r["S"] for r in res["table"]] == [1, 2, 5] and res["table"][0]["ratio"] == 1.0
    assert set(res["implementations"]) == {"1", "2", "5"}
    assert res["implementations"]["5"]["gated_delta"] == "steps-reference"
    # --switch: each pass with the switch off and on, the parsed value following the variable
    monkeypatch.setenv("MLX_QWEN_FAST_GDN_MIXER", "1")  # restored afterwards: the run sets it
    assert verify_pass.main(TINY + ["--context", "8", "--sizes", "2", "--repeats", "1", "--warmup", "0",
                                    "--switch", "MLX_QWEN_FAST_GDN_MIXER", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["switch"]["MLX_QWEN_FAST_GDN_MIXER"], r["switch_parsed"]) for r in runs] == \
        [("0", False), ("1", True)]
    # the compiled S-token step against mlx-lm's loop, inside the rollback context too: off never runs
    # it, on runs it for every timed pass of S >= 2 (the one-token passes are decode_model's)
    for extra in ([], ["--rollback"]):
        monkeypatch.setenv("MLX_QWEN_FAST_VERIFY_STEP", "0")
        assert verify_pass.main(TINY + ["--context", "8", "--sizes", "1,2,3", "--repeats", "2", "--warmup", "1",
                                        "--switch", "MLX_QWEN_FAST_VERIFY_STEP", "--out", str(out)] + extra) == 0
        res = json.loads(out.read_text())
        steps = {(r["switch"]["MLX_QWEN_FAST_VERIFY_STEP"], r["S"]): r["step_runs"] for r in res["runs"]}
        assert steps == {("0", 1): 0, ("0", 2): 0, ("0", 3): 0, ("1", 1): 0, ("1", 2): 2, ("1", 3): 2}, extra
        assert "verify-step" in res["implementations"]["2"]["model"]
        assert "verify-step" not in res["implementations"]["1"].get("model", "")
        assert [row["verify_step"] for row in res["table"]] == ["0/2", "0/2", "0/2", "0/2", "2/2", "2/2"]
    for bad in (["--sizes", "0-3"], ["--sizes", "a"], ["--batch", "0"], ["--stock", "--rollback"],
                ["--switch", "NOT_A_SWITCH"]):
        with pytest.raises(SystemExit):
            verify_pass.main(TINY + bad)


def test_verify_pass_cache_comes_back(tmp_path):
    """A pass and the cache's restore: the next pass of the same tokens sees
    the same cache (the same logits bit for bit), on the patched tiny model
    inside the rollback context and outside it."""
    from bench import verify_pass
    from mlx_qwen_fast import patched_copy, speculative
    from mlx_qwen_fast.checkpoint import build_model

    model, _ = build_model("tiny", seed=0, dtype=mx.float32)
    model, _ = patched_copy(model)
    for rollback in (False, True):
        cache = verify_pass.make_cache(model, 16, 2, 4)
        with speculative.rollback(model, cache, 4) if rollback else contextlib.nullcontext():
            state = verify_pass.CacheState(cache)
            tokens = mx.array([[3, 4, 5], [6, 7, 8]])
            kv = [c for c in cache if not hasattr(c, "cache")]
            gdn = [c for c in cache if hasattr(c, "cache")]
            states = [c[1] for c in gdn]
            first = model(tokens, cache=cache)
            mx.eval(first)
            assert all(c.offset == 19 for c in kv) and all(c[1] is not st for c, st in zip(gdn, states))
            state.restore()
            assert all(c.offset == 16 for c in kv) and all(c[1] is st for c, st in zip(gdn, states))
            again = model(tokens, cache=cache)
            assert mx.array_equal(first, again).item()
def test_dflash_bench_on_cpu(tmp_path):
    """bench.dflash on the tiny preset: plain decoding, the oracle and a
    synthetic-acceptance stand-in, the drafter's cost; the oracle accepts
    every draft and all modes give plain greedy decoding's tokens; a bad
    --accept is refused before any model is built."""
    from bench import dflash as bench_dflash

    out = tmp_path / "dflash.json"
    assert bench_dflash.main(TINY + ["--lm-head-scale", "16", "--context", "12", "--tokens", "10", "--accept",
                                     "oracle,0.6", "--block", "4", "--repeats", "1", "--out", str(out)]) == 0
    data = load(out, "dflash")
    modes = [r["mode"] for r in data["records"]]
    assert modes == ["plain", "oracle", "0.6"]
    for r in data["records"]:
        assert r["tok_s"] > 0 and r["exact"] is True, r
    oracle = data["records"][1]
    assert oracle["acceptance"] == 1.0 and oracle["tokens_per_block"] >= 3 and oracle["tok_s_with_drafter"] > 0
    assert data["drafter"]["drafter"] == "tiny-dflash" and data["drafter"]["block_ms"] > 0
    # fp32 on the CPU: the loop's own continuation is plain decoding's, found by the first run
    assert data["reference"] == {"rounds": 1, "fixed_point": True, "is_plain": True}
    assert all(r["as_reference"] for r in data["records"][1:])
    for bad in ("oracle,1.5", "sometimes"):
        with pytest.raises(SystemExit):
            bench_dflash.main(TINY + ["--accept", bad])


def test_dflash_loop_reference_reaches_the_loops_own_tokens():
    """loop_reference started from a wrong continuation (plain decoding's
    with one token changed) reaches the loop's own tokens in a second run
    (fp32 CPU: plain decoding's) and says it took two; with one run allowed
    it stops without a fixed point."""
    from mlx_lm.generate import generate_step

    from bench import dflash as bench_dflash
    from mlx_qwen_fast.checkpoint import DEMO_LM_HEAD_SCALE, build_model
    from mlx_qwen_fast.patching import patched_copy

    model, _ = build_model("tiny", seed=0, dtype=mx.float32, lm_head_scale=DEMO_LM_HEAD_SCALE)
    fast, _ = patched_copy(model, warn=False)
    prompt = mx.array([3, 9, 27, 81, 243, 7])
    plain = [t for t, _ in generate_step(prompt, fast, max_tokens=12)]
    wrong = plain[:5] + [(plain[5] + 1) % 1000] + plain[6:]
    ref, rounds, fixed = bench_dflash.loop_reference(prompt, fast, wrong, 4, (), 1280, 12, rounds=4)
    assert (ref, rounds, fixed) == (plain, 2, True)
    ref, rounds, fixed = bench_dflash.loop_reference(prompt, fast, wrong, 4, (), 1280, 12, rounds=1)
    assert (ref, rounds, fixed) == (plain, 1, False)


def test_phase_clock_table():
    """bench.phase_clock's rows: per mark the median and last block's cycles
    (median over launches) and the step from the previous mark, in us."""
    import numpy as np

    from bench import phase_clock

    marks = ("start", "A", "end")
    launches = [mx.array(np.array([[0, 100, 300, -1], [0, 200, 500, -1], [0, 150, 400, -1]], np.int64)),
                mx.array(np.array([[0, 100, 300, -1], [0, 300, 700, -1], [0, 150, 400, -1]], np.int64))]
    rows = phase_clock._table("k", marks, launches, mhz=100.0)
    assert [r["mark"] for r in rows] == list(marks)
    assert [r["cycles_median_block"] for r in rows] == [0, 150, 400]
    assert [r["cycles_max_block"] for r in rows] == [0, 250, 600]  # medians of (200, 300) and (500, 700)
    assert [r["us_step_max"] for r in rows] == [0.0, 2.5, 3.5]
