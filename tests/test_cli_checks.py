"""The checks of mlx-lm's arguments made before mlx-lm is imported
(mlx_qwen_fast/_cli_checks.py): the prompt read from stdin, the safetensors
headers, and that a usage error exits before anything heavy is imported.
The same checks through the CLIs: test_cli.py."""

import sys

import pytest

from cli_run import run_python
from mlx_qwen_fast import _cli_checks


def test_a_prompt_from_stdin_reaches_mlx_lm(monkeypatch, capsys):
    """The prompt the check read from stdin is there again for mlx-lm's
    ``sys.stdin.read()``; only the value argparse keeps (the last) counts."""
    import io

    for argv in (["--prompt", "-"], ["-p", "x", "-p", "-"], ["--prompt=-"]):
        monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
        _cli_checks.check_arguments("generate", argv)
        assert sys.stdin.read() == "hello\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    _cli_checks.check_arguments("generate", ["--prompt", "-", "--prompt", "hi"])  # "hi" wins: stdin is not read
    with pytest.raises(SystemExit) as e:
        _cli_checks.check_arguments("cache_prompt", ["--prompt", "-"])
    assert e.value.code == 2 and "--prompt -" in capsys.readouterr().err


def test_checks_run_before_mlx_lm_is_imported(monkeypatch, tmp_path):
    """A usage error exits before mlx-lm (and transformers) are imported."""
    code = ("import sys; from mlx_qwen_fast import _cli_checks\n"
            "try:\n    _cli_checks.check_arguments('generate', ['--model', sys.argv[1]])\n"
            "except SystemExit as e:\n    print(e.code, 'mlx_lm' in sys.modules, 'transformers' in sys.modules)\n")
    r = run_python("-c", code, str(tmp_path / "missing"))
    assert r.stdout.split() == ["2", "False", "False"], r.stdout + r.stderr


def test_safetensors_check_reads_headers(tmp_path):
    import mlx.core as mx

    p = tmp_path / "model.safetensors"
    mx.save_safetensors(str(p), {"w": mx.ones((64, 64))})
    assert _cli_checks._safetensors_problem(p) is None
    p.write_bytes(p.read_bytes()[:-1])
    assert "truncated" in _cli_checks._safetensors_problem(p)
    p.write_bytes(b"\x00" * 4)
    assert "truncated" in _cli_checks._safetensors_problem(p)
    p.write_bytes(b"\xff" * 64)
    assert _cli_checks._safetensors_problem(p) is not None


@pytest.mark.parametrize("header", [b"[1, 2]", b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": ["a", "b"]}}',
                                    b'{"w": {"data_offsets": [0]}}', b'{"w": {"data_offsets": null}}'])
def test_malformed_safetensors_headers_are_one_line(tmp_path, header):
    import struct

    p = tmp_path / "model.safetensors"
    p.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    problem = _cli_checks._safetensors_problem(p)
    assert problem and "not a" in problem
