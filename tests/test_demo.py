"""The README's main job: `python -m mlx_qwen_fast.demo` with no arguments."""

import os
import subprocess
import sys


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
