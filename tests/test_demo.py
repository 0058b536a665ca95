"""The README's main job: `python -m mlx_qwen_fast.demo` with no arguments."""

import os
import subprocess
import sys

import pytest

from cli_run import run_module

CLI = "python -m mlx_qwen_fast.demo"


def test_demo_runs_and_tokens_match(tmp_path):
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_qwen_fast.demo", "--max-tokens", "32"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "=== stock ===" in out and "=== patched ===" in out
    assert "tokens identical: True" in out
    assert (tmp_path / "mlx_qwen_fast" / "tiny-demo" / "config.json").exists()


def test_demo_bad_arguments_are_usage_errors(tmp_path, capsys):
    from mlx_qwen_fast import demo

    bad_json, no_weights = tmp_path / "bad_json", tmp_path / "no_weights"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{")
    no_weights.mkdir()
    (no_weights / "config.json").write_text('{"model_type": "qwen3_5_moe"}')
    for argv, words in ((["--max-tokens", "0"], "argument --max-tokens: expected a whole number >= 1, got 0"),
                        (["--prompt", "  "], "--prompt is empty"),
                        (["--model", str(tmp_path / "missing")], f"--model {tmp_path / 'missing'}: no such folder"),
                        (["--model", str(bad_json)], f"--model {bad_json}: config.json is not valid JSON"),
                        (["--model", str(no_weights)], f"--model {no_weights}: no weights")):
        with pytest.raises(SystemExit) as e:
            demo.main(argv)
        assert e.value.code == 2
        assert words in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--bogus"], "unrecognized arguments: --bogus (python -m mlx_qwen_fast.demo --help lists the flags)"),
    (["--modle", "{missing}"], "unrecognized arguments: --modle {missing} (did you mean --model?)"),
    (["--max-tokens", "0"], "argument --max-tokens: expected a whole number >= 1, got 0"),
    (["--max-tokens", "many"], "argument --max-tokens: expected a whole number >= 1, got 'many'"),
    (["--max-tokens"], "argument --max-tokens: expected one argument"),
    (["--dtype", "float16"], "argument --dtype: invalid choice: 'float16' (choose from 'float32', 'bfloat16')"),
    (["--prompt", "  "], "--prompt is empty: expected the text to continue"),
    (["--model", "{missing}"], "--model {missing}: no such folder"),
    (["--model", "{bad_json}"], "--model {bad_json}: config.json is not valid JSON"),
    (["--model", "{file}"], "--model {file}: is a file; expected a checkpoint folder"),
])
def test_demo_usage_errors_are_one_line_before_mlx_lm(tmp_path, argv, message):
    """`python -m mlx_qwen_fast.demo` with a bad argument: one line naming
    it, exit code 2, no usage block, mlx-lm never imported, no demo
    checkpoint written."""
    missing, bad_json, a_file = tmp_path / "missing", tmp_path / "bad_json", tmp_path / "a_file"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{")
    a_file.write_text("x")

    def fill(text):
        return text.replace("{missing}", str(missing)).replace("{bad_json}", str(bad_json)).replace(
            "{file}", str(a_file))

    cache = tmp_path / "cache"
    r = run_module("mlx_qwen_fast.demo", *map(fill, argv), env={"XDG_CACHE_HOME": str(cache)})
    assert r.returncode == 2, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{CLI}: error: "), r.stderr
    assert fill(message) in lines[0], r.stderr
    assert r.stdout == ""
    assert r.heavy() == []
    assert not cache.exists()


def test_demo_says_when_the_fast_path_is_off(tmp_path):
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), MLX_QWEN_FAST="0")
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_qwen_fast.demo", "--max-tokens", "4"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "both runs below are stock mlx-lm" in proc.stdout
    assert "=== patched (left stock) ===" in proc.stdout
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "MLX_QWEN_FAST=0" in line]
    assert len(said) == 1, said  # one line, not a report, a note and a warning
    assert "Warning" not in proc.stderr and ".py:" not in proc.stderr, proc.stderr  # no raw warnings.warn


def test_demo_names_a_damaged_checkpoint(tmp_path, monkeypatch):
    """A cached demo checkpoint whose weights file was cut short: the demo
    stops with a message naming the folder and what to do, not a traceback."""
    from mlx_qwen_fast import demo

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = demo.ensure_demo_checkpoint(demo.default_checkpoint_dir())
    shard = next(path.glob(demo.SHARD_GLOB))
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(SystemExit) as e:
        demo.main(["--max-tokens", "2"])
    assert str(path) in str(e.value) and "delete that folder" in str(e.value)
