"""The kernel warm-up (mlx_qwen_fast/warmup.py): work split, the atomic
publishing of worker caches, the marker, and a whole run on the CPU."""

import os

import pytest

from mlx_qwen_fast import warmup


def test_split_deals_every_length_once_longest_first():
    for parts in (1, 2, 3, 8, 20):
        groups = warmup._split(warmup.PROMPT_TOKENS, parts)
        flat = sorted(x for g in groups for x in g)
        assert flat == sorted(warmup.PROMPT_TOKENS)
        assert len(groups) == min(parts, len(warmup.PROMPT_TOKENS)) and all(groups)
        assert groups[0][0] == max(warmup.PROMPT_TOKENS)


def _module(d, name, ptx=b"binary", txt=b"kernel\tmangled\n"):
    (d / f"{name}.ptx").write_bytes(ptx)
    (d / f"{name}.txt").write_bytes(txt)
    (d / f"{name}.cu").write_text("source")


def test_publish_moves_complete_modules_and_keeps_existing(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    _module(src, "qmm_a")
    _module(src, "qmm_b")
    (src / "sub").mkdir()
    _module(src / "sub", "long_name")
    _module(dst, "qmm_b", ptx=b"already there")
    assert warmup._publish(src, dst) == 2
    assert (dst / "qmm_a.ptx").read_bytes() == b"binary"
    assert (dst / "qmm_a.txt").read_bytes() == b"kernel\tmangled\n"
    assert (dst / "sub" / "long_name.ptx").is_file()
    assert (dst / "qmm_b.ptx").read_bytes() == b"already there"
    assert not list(dst.rglob("*.tmp"))
    assert warmup._publish(src, None) == 0 and warmup._publish(tmp_path / "none", dst) == 0


def test_publish_writes_the_kernel_list_before_the_binary(tmp_path, monkeypatch):
    """MLX reads a module when its .ptx exists, then its .txt: the .ptx must
    appear last."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    _module(src, "m")
    order = []
    real = os.replace
    monkeypatch.setattr(warmup.os, "replace", lambda a, b: (order.append(os.path.basename(b)), real(a, b)))
    warmup._publish(src, dst)
    assert order == ["m.txt", "m.cu", "m.ptx"]


def test_marker_follows_the_cache_and_the_config(env, tmp_path, tiny_checkpoint):
    env.unset("MLX_PTX_CACHE_DIR")
    assert warmup.marker_path(tiny_checkpoint) is None
    env.set("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    m = warmup.marker_path(tiny_checkpoint)
    assert m.parent == tmp_path / "ptx" and m.name.startswith("mlx_qwen_fast-warm-")
    assert warmup.marker_path(tiny_checkpoint) == m  # same config, same key


def test_warmup_off_cuda_does_nothing(tiny_checkpoint):
    from mlx_qwen_fast import backend

    if backend.current() == backend.CUDA:
        pytest.skip("CPU behaviour")
    assert warmup.is_warm(tiny_checkpoint)
    assert warmup.warmup(tiny_checkpoint)["workers"] == 0


def test_warmup_rejects_a_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        warmup.warmup(tmp_path)


def test_workers_run_and_write_the_marker(env, tmp_path, tiny_checkpoint):
    """The whole mechanism with real worker processes (on the CPU they only
    run the model; on CUDA they also fill the cache)."""
    env.set("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    w = warmup.Warmup(tiny_checkpoint, jobs=2)
    assert w.jobs == 2
    result = w.start().wait(progress=False)
    assert result["workers"] == 2 and result["failed"] == []
    assert warmup.marker_path(tiny_checkpoint).is_file()
