"""The kernel warm-up (mlx_qwen_fast/warmup.py): its marker, the model run
on the CPU, and the CLI's first-use notice."""

import pytest

from mlx_qwen_fast import _cli, backend, warmup


def test_marker_follows_the_cache_and_the_config(env, tmp_path, tiny_checkpoint):
    env.unset("MLX_PTX_CACHE_DIR")
    assert warmup.marker_path(tiny_checkpoint) is None
    env.set("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    m = warmup.marker_path(tiny_checkpoint)
    assert m.parent == tmp_path / "ptx" and m.name.startswith("mlx_qwen_fast-warm-")
    assert warmup.marker_path(tiny_checkpoint) == m  # same config, same key


def test_marker_changes_with_the_config(env, tmp_path, tiny_checkpoint):
    import shutil

    env.set("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    other = tmp_path / "other"
    shutil.copytree(tiny_checkpoint, other)
    (other / "config.json").write_text((other / "config.json").read_text().replace('"rms_norm_eps": 1e-06',
                                                                                   '"rms_norm_eps": 1e-05'))
    assert warmup.marker_path(other) != warmup.marker_path(tiny_checkpoint)


def test_warmup_rejects_a_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        warmup.warmup(tmp_path)


def test_the_model_run_covers_both_layer_kinds(tiny_checkpoint):
    """The cut model (one layer of each kind, patched) runs every prompt length."""
    warmup._run_model(tiny_checkpoint, (1, 5, 40))


def test_off_cuda_there_is_nothing_to_do_and_no_notice(tiny_checkpoint, capsys):
    if backend.current() == backend.CUDA:
        pytest.skip("CPU behaviour")
    assert warmup.is_warm(tiny_checkpoint)
    assert warmup.warmup(tiny_checkpoint) == {"seconds": 0.0, "ran": False}
    _cli._first_use_notice(["--model", str(tiny_checkpoint)])
    assert capsys.readouterr().err == ""


@pytest.mark.cuda
def test_warmup_writes_the_marker_and_silences_the_notice(env, tmp_path, tiny_checkpoint, capsys):
    env.set("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    env.set("MLX_QWEN_FAST_COMPILE_AHEAD", "0")  # the notice without workers (tests/test_mlx_compiles.py has them)
    _cli._first_use_notice(["--model", str(tiny_checkpoint)])
    assert "warmup" in capsys.readouterr().err
    env.set("MLX_QWEN_FAST_COMPILE_AHEAD", "1")  # the warm-up as it runs by default: the workers first
    assert warmup.warmup(tiny_checkpoint)["ran"]
    assert warmup.marker_path(tiny_checkpoint).is_file() and warmup.is_warm(tiny_checkpoint)
    _cli._first_use_notice(["--model", str(tiny_checkpoint)])
    assert capsys.readouterr().err == ""


def test_a_completed_cli_run_marks_the_model_warm(env, tmp_path, tiny_checkpoint, monkeypatch, capsys):
    """On CUDA (faked here), the first CLI run of a model prints the notice
    and, once it completes, writes the marker: the second run prints nothing.
    A run that fails writes no marker."""
    import sys
    import types

    from mlx_qwen_fast import patching

    env.set("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    env.set("MLX_QWEN_FAST_COMPILE_AHEAD", "0")  # the notice without workers (tests/test_mlx_compiles.py has them)
    monkeypatch.setattr(backend, "current", lambda: backend.CUDA)
    monkeypatch.setattr(patching, "install", lambda verbose=False, after_load=None: None)
    fake = types.ModuleType("mlx_lm.fake_cmd")
    calls = []

    def main():
        calls.append(list(sys.argv[1:]))
        if "--fail" in sys.argv:
            raise SystemExit(1)

    fake.main = main
    monkeypatch.setitem(sys.modules, "mlx_lm.fake_cmd", fake)
    argv = ["--model", str(tiny_checkpoint)]
    with pytest.raises(SystemExit):
        _cli.run_mlx_lm_main("mlx_lm.fake_cmd", argv + ["--fail"])
    assert "warmup" in capsys.readouterr().err and not warmup.is_warm(tiny_checkpoint)
    _cli.run_mlx_lm_main("mlx_lm.fake_cmd", argv)
    assert "warmup" in capsys.readouterr().err and warmup.is_warm(tiny_checkpoint)
    assert "fake_cmd" in warmup.marker_path(tiny_checkpoint).read_text()
    _cli.run_mlx_lm_main("mlx_lm.fake_cmd", argv)
    assert "warmup" not in capsys.readouterr().err and len(calls) == 3
