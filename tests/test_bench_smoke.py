"""Smoke test of the benchmarks (CPU, tiny preset): every script runs end to end
and writes a result JSON of the documented schema, and the A/B plots are
written. Not a timing claim: lengths, rounds and steps are the smallest that
exercise the code paths (chunked prefill, decode from a copied cache,
``--append``, every op family)."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import ab, common, numerics, ops  # noqa: E402

HEADER = {
    "kind": str, "date": str, "device": str, "backend": str, "mlx_version": str,
    "mlx_lm_version": str, "python": str, "commit": str, "config": dict,
}
NUM = (int, float)
OPT_NUM = (int, float, type(None))
PREFILL = {"tokens": int, "engine": str, "tok_s": OPT_NUM, "tok_s_min": OPT_NUM,
           "tok_s_max": OPT_NUM, "peak_gb": OPT_NUM, "status": str, "seconds": NUM,
           "tokens_done": int, "roofline_frac": OPT_NUM, "flops_per_token": NUM}
DECODE = {"context": int, "engine": str, "tok_s": OPT_NUM, "tok_s_min": OPT_NUM,
          "tok_s_max": OPT_NUM, "peak_gb": OPT_NUM, "roofline_frac": OPT_NUM,
          "host_ms_per_token": OPT_NUM, "device_ms_per_token": OPT_NUM, "status": str,
          "bytes_per_token": NUM}
PAIR = {"a": str, "b": str, "positions": int, "top1_agree": NUM, "ppl_delta_pct": NUM,
        "mean_kl": NUM, "max_abs_dlogit": NUM}
OP = {"op": str, "backend": str, "impl": str, "shape": dict, "ms": OPT_NUM,
      "gbps": OPT_NUM, "tflops": OPT_NUM, "roofline_frac": OPT_NUM, "status": str}
TINY = ["--preset", "tiny", "--dtype", "float32"]
SMALL_CEILINGS = ["--copy-mib", "4", "--matmul-n", "64"]


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


def test_ab_numerics_ops(tmp_path):
    # --- A/B: both sweeps on 2 small lengths, chunked prefill (step 8)
    out = tmp_path / "ab.json"
    ab.main(TINY + SMALL_CEILINGS + [
        "--prefill", "8,12", "--decode", "8,12", "--prefill-step-size", "8",
        "--rounds", "1", "--decode-steps", "2", "--out", str(out)])
    res = load(out, "ab")
    for key in ("preset", "router_skew", "patch_report", "prefill", "decode", "ceilings"):
        assert key in res
    assert res["preset"] == "tiny" and res["router_skew"] == 0.0
    assert isinstance(res["patch_report"]["ops"], dict) and res["patch_report"]["ops"]
    check_ceilings(res["ceilings"])
    assert {(r["tokens"], r["engine"]) for r in res["prefill"]} == {
        (n, e) for n in (8, 12) for e in ("stock", "patched")}
    assert {(r["context"], r["engine"]) for r in res["decode"]} == {
        (n, e) for n in (8, 12) for e in ("stock", "patched")}
    for r in res["prefill"]:
        check_keys(r, PREFILL, "prefill")
        assert r["status"] in common.STATUSES
        assert r["status"] == "ok", r
    for r in res["decode"]:
        check_keys(r, DECODE, "decode")
        assert r["status"] == "ok", r
    # plots next to the JSON (skipped only without matplotlib)
    if importlib.util.find_spec("matplotlib") is not None:
        for suffix in ("prefill", "decode"):
            png = tmp_path / f"ab-{suffix}.png"
            assert png.exists() and png.stat().st_size > 0, png

    # --- --append: one more length for one engine, merged into the same file;
    # a 0.001 s budget times the prefill out at its first chunk boundary
    ab.main(TINY + ["--prefill", "24", "--prefill-step-size", "8", "--rounds", "1",
                    "--engines", "patched", "--no-ceilings", "--no-plots",
                    "--max-seconds", "0.001", "--out", str(out), "--append"])
    res = load(out, "ab")
    assert len(res["runs"]) == 2 and len(res["prefill"]) == 5 and len(res["decode"]) == 4
    new = [r for r in res["prefill"] if r["tokens"] == 24]
    assert len(new) == 1 and new[0]["status"] == "timeout" and new[0]["tokens_done"] == 8
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


def test_pick_scan_config(tmp_path):
    """bench/pick_scan_config.py: the fastest configuration whose checks all
    passed; stale (other-length) configurations, missing times and failed
    checks are skipped; bad files give a message, not a traceback."""
    import subprocess

    script = Path(__file__).resolve().parents[1] / "bench" / "pick_scan_config.py"
    res = {
        "checks": [{"cfg": [8, 2, 4, 32, 0, 1], "ok": True}, {"cfg": [8, 2, 4, 64, 0, 1], "ok": True},
                   {"cfg": [8, 1, 4, 32, 0, 1], "ok": False}, {"cfg": [8, 2, 4, 64, 0, 1, 0, 4], "ok": True},
                   {"cfg": [8, 2, 4, 16, 0, 1], "ok": True}],
        "timings": {"scan B=1 T=4096 cfg=[8, 2, 4, 32, 0, 1]": 0.9e-3,
                    "scan B=1 T=4096 cfg=[8, 2, 4, 64, 0, 1]": 0.8e-3,
                    "scan B=1 T=4096 cfg=[8, 1, 4, 32, 0, 1]": 0.1e-3,  # failed a check
                    "scan B=1 T=4096 cfg=[8, 2, 4, 64, 0, 1, 0, 4]": 0.05e-3,  # another kernel version
                    "scan B=1 T=4096 cfg=[8, 2, 4, 16, 0, 1]": None,
                    "scan single-call B=1 T=4096 cfg=[8, 2, 4, 32, 0, 1]": 0.01e-3},
    }
    p = tmp_path / "scan.json"
    p.write_text(json.dumps(res))
    run = lambda *a: subprocess.run([sys.executable, str(script), *a], capture_output=True, text=True)  # noqa: E731
    r = run(str(p))
    assert r.returncode == 0 and r.stdout.strip() == "8,2,4,64,0,1"
    p.write_text("{}")
    assert run(str(p)).stdout.strip() == "8,2,4,32,0,1"
    for bad in ("[]", "not json"):
        p.write_text(bad)
        r = run(str(p))
        assert r.returncode != 0 and "Traceback" not in r.stderr and str(p) in r.stderr
    r = run()
    assert r.returncode != 0 and "usage" in r.stderr


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


def test_prefill_profile_summary(tmp_path, capsys):
    """ncu CSV -> GPU ms per kernel family; units converted, unknown ones refused."""
    from bench import prefill_profile as pp

    head = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\n'
    rows = [("mqf_moe_gate_up_abc", "us", "1,500"), ("void mlx::qmm_sm80_kernel<64>", "ms", "0.3"),
            ("mqf_gdn_prefill_0f", "ns", "150000"), ("foo", "usecond", "50")]
    csv_path = tmp_path / "k.csv"
    csv_path.write_text("==PROF== Connected\n" + head + "".join(
        f'"{i}","{n}","gpu__time_duration.sum","{u}","{v}"\n' for i, (n, u, v) in enumerate(rows)))
    pp.summary(str(csv_path))
    out = capsys.readouterr().out
    lines = {ln[:44].strip(): ln[44:].split() for ln in out.splitlines() if ln[:44].strip()}
    assert lines["moe grouped GEMM (ours)"][:2] == ["1.50", "75.0%"]
    assert lines["quantized matmul / GEMV / dequantize (MLX)"][:2] == ["0.30", "15.0%"]
    assert lines["gdn prefill, fused front end + scan (ours)"][:2] == ["0.15", "7.5%"]
    assert lines["other"][:2] == ["0.05", "2.5%"]
    assert lines["total (serialised)"][:2] == ["2.00", "4"]
    csv_path.write_text(head + '"0","x","gpu__time_duration.sum","parsec","1"\n')
    with pytest.raises(SystemExit, match="unknown time unit"):
        pp.summary(str(csv_path))
    with pytest.raises(SystemExit, match="cannot read"):
        pp.summary(str(tmp_path / "missing.csv"))
