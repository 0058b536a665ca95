"""bench.mac, the one command of the Metal A/B on a Mac: the commands it
runs (each process under ``MLX_QWEN_FAST_METAL=1``), the report it makes of
bench.user_view's and bench.ab's result files, and one end-to-end run of
the tiny preset on this machine's CPU with the smallest lengths (the
plumbing, not a timing: MLX runs no Metal here)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import mac  # noqa: E402
from bench import user_view as uv  # noqa: E402


def _uv_run(config, engine, prompt_tps, gen_tps, status="ok"):
    return {"config": config, "engine": engine, "prompt_tokens": 4096, "generation_tokens": 128, "batch_size": 1,
            "status": status, "prompt_tps": prompt_tps if status == "ok" else None,
            "generation_tps": gen_tps if status == "ok" else None, "peak_memory_gb": 20.0}


def test_report_rows_and_table():
    """Medians and ratios per measurement from the two tools' files; runs that
    were not "ok" and failed steps are noted, not hidden."""
    runs = [_uv_run("b1", "stock", 100.0, 10.0), _uv_run("b1", "patched", 300.0, 25.0),
            _uv_run("b1", "stock", 120.0, 12.0), _uv_run("b1", "patched", 0, 0, status="timeout")]
    user_view = {"device": "Apple M5 Max", "backend": "metal", "commit": "abc", "summary": uv.summarize(runs)}
    ab = {"device": "Apple M5 Max", "backend": "metal", "commit": "abc",
          "prefill": [{"tokens": 4096, "engine": "stock", "status": "ok", "tok_s": 400.0},
                      {"tokens": 4096, "engine": "patched", "status": "ok", "tok_s": 1000.0}],
          "decode": [{"context": 4096, "engine": "stock", "status": "ok", "tok_s": 50.0},
                     {"context": 4096, "engine": "patched", "status": "oom", "tok_s": None}]}
    rows = mac.report_rows("tiny", user_view, ab)
    got = {(r["tool"], r["measure"]): (r["stock"], r["patched"], r["ratio"], r["note"]) for r in rows}
    assert got == {
        ("user_view", "b1 prompt"): (110.0, 300.0, pytest.approx(300 / 110), "patched 1/2 ok"),
        ("user_view", "b1 generation"): (11.0, 25.0, pytest.approx(25 / 11), "patched 1/2 ok"),
        ("ab", "prefill 4096"): (400.0, 1000.0, 2.5, ""),
        ("ab", "decode at 4096"): (50.0, None, None, "patched oom"),
    }
    failed = mac.report_rows("qwen3.6-35b-a3b", None, ab, failed=["user_view"])
    assert failed[0] == {"preset": "qwen3.6-35b-a3b", "tool": "user_view", "measure": "-", "stock": None,
                         "patched": None, "ratio": None, "note": "failed (see its output above)"}
    text = mac.format_report(rows + failed, [user_view, ab])
    lines = text.splitlines()
    assert lines[0] == "- device Apple M5 Max, backend metal, commit abc"  # the same machine line once
    assert "| tiny | ab | prefill 4096 | 400.0 | 1,000.0 | 2.50x |  |" in lines
    assert "| tiny | ab | decode at 4096 | 50.0 | - | - | patched oom |" in lines
    assert sum(line.startswith("| ") for line in lines) == 1 + len(rows) + len(failed)


def test_plan_and_arguments(capsys, tmp_path):
    """``--plan`` prints each preset's two commands (tiny first) under the
    Metal switch, with the tools' default measurements, and runs nothing;
    an unknown preset is refused."""
    assert mac.main(["--plan", "--out", str(tmp_path / "r"), "--checkpoints", str(tmp_path / "ck")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and all(line.startswith("MLX_QWEN_FAST_METAL=1 ") for line in lines)
    ckpt = str(tmp_path / "ck" / "tiny")
    assert f"-m bench.user_view --preset tiny --checkpoint {ckpt} --configs b1" in lines[0]
    assert "-m bench.ab --preset tiny --prefill 4k --decode 4k" in lines[1]
    assert "--preset qwen3.6-35b-a3b" in lines[2] and lines[3].endswith(str(tmp_path / "r" / "ab-qwen3.6-35b-a3b.json"))
    assert not (tmp_path / "r").exists()
    with pytest.raises(SystemExit):
        mac.main(["--plan", "--presets", "tiny,huge"])
    r = subprocess.run([sys.executable, "-m", "bench.mac", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and "usage" in r.stdout.lower()


def test_end_to_end_tiny_on_cpu(tmp_path):
    """The tiny preset with the smallest lengths, as a user would run it: both
    tools run, every measurement has both engines and a ratio, the report
    is printed and written; the exit code is 0."""
    out = tmp_path / "r"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "bench.mac", "--presets", "tiny", "--out", str(out),
                        "--checkpoints", str(tmp_path / "ck"),
                        "--user-view-args", "--prompt 32 --gen 4 --batch 1 --processes 1 -n 1 --timeout 240",
                        "--ab-args", "--dtype float32 --prefill 8 --decode 8 --prefill-step-size 8 --rounds 1 "
                                     "--decode-steps 2 --warmup-max-runs 1 --no-plots --no-ceilings"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = (out / "report.md").read_text()
    assert report in r.stdout
    rows = [line for line in report.splitlines() if line.startswith("| tiny |")]
    assert [row.split(" | ")[2] for row in rows] == ["p32-g4-b1 prompt", "p32-g4-b1 generation", "prefill 8",
                                                     "decode at 8"]
    assert all(row.split(" | ")[5].endswith("x") for row in rows), report
