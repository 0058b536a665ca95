"""``mlx_qwen_fast.config``: every environment switch declared once, parsed
once (cached until ``reload``), documented in the README's table; MLX's own
variables that the import sets on CUDA."""

import os
import re
import warnings
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_qwen_fast import config

README = Path(__file__).resolve().parents[1] / "README.md"
BOOL_ON = ("1", "true", "yes", "on")
BOOL_OFF = ("0", "false", "no", "off")
PATH_KINDS = ("path", "path-or-off")


def test_every_switch_is_declared_once_with_a_meaning():
    names = [s.name for s in config.SWITCHES]
    assert len(set(names)) == len(names)
    for s in config.SWITCHES:
        assert isinstance(s, config.Switch)
        assert s.name.startswith("MLX_QWEN_FAST") and s.name == s.name.strip()
        assert s.meaning.strip() and s.values.strip(), s.name
        assert s.kind in ("bool", "path", "path-or-off", "arch"), s.name
    for attr in ("FAST_PATH", "MOE_PREFILL_KERNEL", "MOE_DECODE_KERNEL", "KERNEL_CACHE", "NVRTC",
                 "NVFATBIN", "ARCH", "POISON"):
        assert getattr(config, attr) in config.SWITCHES, attr


def _documented_values(switch, tmp_path):
    """The values the table documents for ``switch``: the backquoted ones,
    and a path for the path kinds."""
    values = re.findall(r"`([^`]+)`", switch.values)
    if switch.kind in PATH_KINDS:
        values.append(str(tmp_path / "some file"))
    return values


@pytest.mark.parametrize("switch", config.SWITCHES, ids=lambda s: s.name)
def test_every_switch_parses_its_documented_values(env, switch, tmp_path):
    """Each documented value parses without a warning and changes the value
    from the default (that is what setting it is for)."""
    values = _documented_values(switch, tmp_path)
    assert values, f"{switch.name}: no documented value in {switch.values!r}"
    for raw in values:
        env.set(switch.name, raw)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = switch.get()
        assert got != switch.default, (switch.name, raw, got)
        assert switch.is_set()
    env.unset(switch.name)
    assert switch.get() == switch.default and not switch.is_set()


@pytest.mark.parametrize("switch", [s for s in config.SWITCHES if s.kind == "bool"], ids=lambda s: s.name)
def test_bool_switches_take_the_usual_spellings(env, switch):
    for raw in BOOL_ON + tuple(v.upper() for v in BOOL_ON) + (" On ",):
        env.set(switch.name, raw)
        assert switch.get() is True, raw
    for raw in BOOL_OFF + tuple(v.upper() for v in BOOL_OFF) + (" No ",):
        env.set(switch.name, raw)
        assert switch.get() is False, raw
    for raw in ("", "  "):  # empty: the default
        env.set(switch.name, raw)
        assert switch.get() == switch.default


def test_unknown_value_warns_once_and_takes_the_default(env):
    """A value no switch knows is named in one RuntimeWarning and the default
    is used; the parsed value is kept, so no second warning until reload."""
    s = config.FAST_PATH
    env.set(s.name, "banana")
    with pytest.warns(RuntimeWarning, match=r"MLX_QWEN_FAST='banana' is not understood"):
        assert s.get() is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert s.get() is True  # cached: no second warning
    config.reload()
    with pytest.warns(RuntimeWarning, match="banana"):
        s.get()
    env.set(config.ARCH.name, "sm9")
    with pytest.warns(RuntimeWarning, match="sm9"):
        assert config.ARCH.get() is None


def test_patching_reads_every_switch_on_any_backend(env):
    """A value not understood in a switch that this backend never reads (the
    MoE kernel switch on the CPU) is still warned about, once, when the fast
    path is asked whether it is enabled (patch, install, the CLIs)."""
    from mlx_qwen_fast import patching

    env.set(config.MOE_PREFILL_KERNEL.name, "maybe")
    with pytest.warns(RuntimeWarning, match=r"MLX_QWEN_FAST_MOE_KERNEL='maybe' is not understood"):
        assert patching.enabled() is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert patching.enabled() is True


def test_the_imports_reading_leaves_the_warning_to_the_next(env):
    """The import reads the off switch with ``warn=False`` (on CUDA): a value
    not understood is then warned about once, by the next reading (patch,
    install, a CLI, where it can be printed as one line), not at import."""
    s = config.FAST_PATH
    env.set(s.name, "banana")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert s.get(warn=False) is True
        assert config.apply_process_settings("cuda") is not None  # reads it without warning too
        config.restore_process_settings()
    with pytest.warns(RuntimeWarning, match="'banana'") as seen:
        assert s.get() is True
    assert len(seen) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert s.get() is True  # said once


def test_values_are_parsed_once_until_reload(monkeypatch):
    s = config.MOE_DECODE_KERNEL
    monkeypatch.delenv(s.name, raising=False)
    config.reload()
    assert s.get() is True
    monkeypatch.setenv(s.name, "0")
    assert s.get() is True  # the first reading stands (hot paths ask per layer and token)
    config.reload()
    assert s.get() is False


def test_path_switches(env, tmp_path):
    env.set(config.KERNEL_CACHE.name, str(tmp_path))
    assert config.kernel_cache_dir() == tmp_path
    env.unset(config.KERNEL_CACHE.name)
    env.set("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert config.kernel_cache_dir() == config.cache_root() == tmp_path / "xdg" / "mlx_qwen_fast"
    env.set(config.NVFATBIN.name, "0")
    assert config.NVFATBIN.get() is False  # "0": off, not a path
    env.set(config.NVFATBIN.name, str(tmp_path / "libnvfatbin.so"))
    assert config.NVFATBIN.get() == str(tmp_path / "libnvfatbin.so")


def test_readme_holds_the_table_of_variables():
    """The README's table of environment variables is config.markdown_table(),
    verbatim (regenerate the README from it when a switch changes)."""
    table = config.markdown_table()
    assert table.startswith("| variable |") and all(f"`{s.name}`" in table for s in config.SWITCHES)
    assert table in README.read_text(), (
        "README.md does not contain config.markdown_table(); paste its output into the "
        "'Environment variables' section")


# ---------------------------------------------------------------------------
# MLX's variables set by the import on CUDA
# ---------------------------------------------------------------------------

GRAPH, PTX = config.MLX_GRAPH_LIMIT.name, config.MLX_PTX_CACHE.name


def test_process_settings(process_environment, env, tmp_path):
    from mlx_qwen_fast.patching import enabled

    env.set("XDG_CACHE_HOME", str(tmp_path))
    ptx = str(tmp_path / "mlx_qwen_fast" / "mlx-ptx" / mx.__version__)
    assert config.apply_process_settings("cpu") == []  # not CUDA: untouched
    assert GRAPH not in os.environ and PTX not in os.environ
    assert config.process_settings_report("cpu") == ""
    assert config.process_settings_report("cuda") == (
        f"{GRAPH} unset (MLX default), {PTX} unset (MLX default)")
    for off in ("off", " No ", "FALSE", "0"):
        env.set(config.FAST_PATH.name, off)
        assert config.apply_process_settings("cuda") == []  # switched off: untouched
        assert GRAPH not in os.environ and PTX not in os.environ
        assert enabled() is False
    env.unset(config.FAST_PATH.name)
    assert config.apply_process_settings("cuda") == [GRAPH, PTX]
    assert config.apply_process_settings("cuda") == []  # idempotent
    assert os.environ[GRAPH] == config.GRAPH_LIMIT_VALUE and os.environ[PTX] == ptx
    assert config.process_settings_report("cuda") == (
        f"{GRAPH}={config.GRAPH_LIMIT_VALUE} (mlx_qwen_fast), {PTX}={ptx} (mlx_qwen_fast)")
    os.environ[GRAPH] = "1000"  # changed later by the user: theirs
    assert config.process_settings_report("cuda").startswith(f"{GRAPH}=1000 (environment)")
    assert config.restore_process_settings() == [PTX]  # the graph limit is not ours any more: kept
    assert os.environ[GRAPH] == "1000" and PTX not in os.environ
    del os.environ[GRAPH]
    assert config.apply_process_settings("cuda") == [GRAPH, PTX]
    assert config.restore_process_settings() == [GRAPH, PTX]  # ours: removed (--stock)
    assert GRAPH not in os.environ and PTX not in os.environ
    assert config.restore_process_settings() == []
    os.environ[GRAPH] = "2000"  # the user's value wins
    os.environ[PTX] = str(tmp_path / "mine")
    assert config.apply_process_settings("cuda") == []
    assert os.environ[GRAPH] == "2000" and os.environ[PTX] == str(tmp_path / "mine")
    assert config.process_settings_report("cuda") == (
        f"{GRAPH}=2000 (environment), {PTX}={tmp_path / 'mine'} (environment)")
