"""Every environment switch of mlx_qwen_fast, declared once and parsed once.

This module is the only place in the package that reads (or writes)
``os.environ``. Each switch is a :class:`Switch` in :data:`SWITCHES`: its
name, kind, default and one-line meaning. :meth:`Switch.get` parses the
variable the first time it is asked for and keeps the value for the life of
the process (the hot paths of decode ask per layer and per token); a value
it does not know is warned about once (``RuntimeWarning``) and the default
is used. :func:`reload` forgets the parsed values, so that a changed
environment is read again (tests, and a script that sets a variable after
``import mlx_qwen_fast`` but wants it seen).

Boolean switches take ``1``/``true``/``yes``/``on`` and ``0``/``false``/
``no``/``off`` (any case, surrounding blanks ignored); unset or empty means
the default.

The import of the package also sets two variables of MLX's own on CUDA
(:func:`apply_process_settings`, undone by :func:`restore_process_settings`
for the CLIs' ``--stock``): see :data:`MLX_GRAPH_LIMIT` and
:data:`MLX_PTX_CACHE`.

The README's table of variables is :func:`markdown_table` (a test checks
that they agree).
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

__all__ = [
    "Switch",
    "SWITCHES",
    "FAST_PATH",
    "MOE_PREFILL_KERNEL",
    "MOE_DECODE_KERNEL",
    "DECODE_LAYER_STEP",
    "DECODE_MODEL_STEP",
    "ATTENTION_DECODE_KERNEL",
    "ATTENTION_PREFILL_KERNEL",
    "DECODE_GEMV_KERNEL",
    "GDN_MIXER_KERNEL",
    "MOE_BLOCK_KERNEL",
    "GDN_LAYER_KERNEL",
    "METAL_KERNELS",
    "MLX_COMPILES_AHEAD",
    "KERNEL_CACHE",
    "NVRTC",
    "NVFATBIN",
    "ARCH",
    "POISON",
    "reload",
    "raw_value",
    "cache_root",
    "kernel_cache_dir",
    "cuda_toolkit_lib_dirs",
    "mlx_ptx_cache_dir",
    "child_environment",
    "apply_process_settings",
    "restore_process_settings",
    "process_settings_report",
    "markdown_table",
]

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")
_ARCH_RE = re.compile(r"sm_\d{2,3}[a-z]?")


@dataclass(frozen=True)
class Switch:
    """One environment variable of the package.

    Attributes:
        name: the variable, e.g. ``"MLX_QWEN_FAST_MOE_KERNEL"``.
        kind: ``"bool"``; ``"path"`` (any non-empty string, used as a file
            or folder); ``"path-or-off"`` (a path, or exactly ``0``: off,
            parsed as False); ``"arch"`` (a CUDA target ``sm_XY`` or
            ``sm_XYa``).
        default: the value when the variable is unset, empty or not
            understood (None for the path kinds: "not set").
        values: how the variable is written, for the table (e.g. ``"0"``).
        meaning: one line for the README's table.
    """

    name: str
    kind: str
    default: Any
    values: str
    meaning: str

    def get(self, *, warn: bool = True) -> Any:
        """The parsed value (cached after the first call; see :func:`reload`).

        A value that is not understood is warned about once, by the first
        call with ``warn`` (the import's own read passes ``warn=False``: a
        warning raised while the package is imported would reach a CLI's
        user before the CLI can print it as one line)."""
        try:
            value = _values[self.name]
        except KeyError:
            value = _values[self.name] = _parse(self)
        if warn and _unwarned:
            message = _unwarned.pop(self.name, None)
            if message is not None:
                warnings.warn(message, RuntimeWarning, stacklevel=2)
        return value

    def is_set(self) -> bool:
        """True if the environment holds a non-empty value for this switch."""
        return bool(os.environ.get(self.name, "").strip())


def _parse(switch: Switch) -> Any:
    raw = os.environ.get(switch.name)
    text = "" if raw is None else raw.strip()
    if not text:
        return switch.default
    if switch.kind == "bool":
        low = text.lower()
        if low in _ON:
            return True
        if low in _OFF:
            return False
        expected = f"one of {', '.join(_ON + _OFF)}"
    elif switch.kind == "path":
        return text
    elif switch.kind == "path-or-off":
        return False if text == "0" else text
    elif switch.kind == "arch":
        if _ARCH_RE.fullmatch(text):
            return text
        expected = "a CUDA target such as sm_90a or sm_89"
    else:  # a declaration error, not a user's
        raise AssertionError(f"unknown switch kind {switch.kind!r}")
    _unwarned[switch.name] = (f"{switch.name}={raw!r} is not understood (expected {expected}); "
                              f"using the default ({switch.default!r})")
    return switch.default


_values: Dict[str, Any] = {}
#: name -> the warning about its value not yet given (see :meth:`Switch.get`).
_unwarned: Dict[str, str] = {}


def raw_value(switch: Switch) -> str:
    """The switch's variable as the environment holds it ("" when unset), for messages."""
    return os.environ.get(switch.name, "")


def reload() -> None:
    """Forget the parsed values: the next :meth:`Switch.get` reads the environment again."""
    _values.clear()
    _unwarned.clear()


FAST_PATH = Switch(
    "MLX_QWEN_FAST", "bool", True, "`0`",
    "`patch()`, `install()`, the CLIs and the demo leave every model on stock mlx-lm "
    "(and the import leaves MLX's variables below alone)")
MOE_PREFILL_KERNEL = Switch(
    "MLX_QWEN_FAST_MOE_KERNEL", "bool", True, "`0`",
    "MoE prefill keeps stock `gather_qmm` on CUDA")
MOE_DECODE_KERNEL = Switch(
    "MLX_QWEN_FAST_MOE_DECODE_KERNEL", "bool", True, "`0`",
    "MoE decode (1-4 tokens) keeps stock on CUDA")
DECODE_LAYER_STEP = Switch(
    "MLX_QWEN_FAST_DECODE_LAYER", "bool", True, "`0`",
    "decode runs each decoder layer's modules one by one instead of one compiled call per layer")
DECODE_MODEL_STEP = Switch(
    "MLX_QWEN_FAST_DECODE_MODEL", "bool", True, "`0`",
    "decode runs one compiled call per decoder layer instead of one for the whole layer stack")
VERIFY_MODEL_STEP = Switch(
    "MLX_QWEN_FAST_VERIFY_STEP", "bool", False, "`1`",
    "a forward of 2-16 tokens per row with a cache (a speculative verify) runs every layer in one compiled call "
    "instead of mlx-lm's loop over the layers (off: 6-9 ms faster a pass on an H100, bench/results/verify-step-log.md, "
    "but its fp32 tests against the loop fail on the GPU, not yet explained)")
ATTENTION_DECODE_KERNEL = Switch(
    "MLX_QWEN_FAST_ATTENTION_KERNEL", "bool", True, "`0`",
    "the decode layer step keeps MLX's attention ops (RMSNorm, RoPE, masked SDPA, gate) on CUDA "
    "instead of the head_dim-256 decode-attention kernels")
ATTENTION_PREFILL_KERNEL = Switch(
    "MLX_QWEN_FAST_ATTENTION_PREFILL_KERNEL", "bool", True, "`0`",
    "gated-attention prefill (more than one token per call) keeps mlx-lm's attention module on CUDA "
    "(MLX's unfused attention for head_dim 256: memory grows with chunk x context) instead of the "
    "head_dim-256 flash-attention kernel")
DECODE_GEMV_KERNEL = Switch(
    "MLX_QWEN_FAST_GEMV_KERNEL", "bool", True, "`0`",
    "the decode layer step keeps MLX's RMSNorm, quantized matmul and residual add around each projection "
    "on CUDA instead of the fused quantised-GEMV kernel")
PREFILL_GEMM_KERNEL = Switch(
    "MLX_QWEN_FAST_PREFILL_GEMM", "bool", True, "`0`",
    "on CUDA, the 4-bit projections of a prefill chunk (Gated DeltaNet in_proj_qkv, in_proj_z and out_proj; "
    "attention q and o) run on MLX's quantized matmul instead of the package's fused-dequantisation GEMM "
    "(timings: bench/results/prefill-gemm-log.md)")
GDN_MIXER_KERNEL = Switch(
    "MLX_QWEN_FAST_GDN_MIXER", "bool", True, "`0`",
    "on CUDA, a Gated DeltaNet layer's decode step runs its input RMSNorm and projection, the recurrence, "
    "out_proj and the residual as three launches instead of one persistent kernel (the one-launch mixer needs "
    "the fused GEMV on)")
MOE_BLOCK_KERNEL = Switch(
    "MLX_QWEN_FAST_MOE_BLOCK", "bool", True, "`0`",
    "on CUDA, a layer's decode step runs its MoE block (post-attention RMSNorm, router, routing, the experts, "
    "the shared expert and the residual) as three launches instead of one persistent kernel (the one-launch "
    "block needs the fused GEMV on)")
GDN_LAYER_KERNEL = Switch(
    "MLX_QWEN_FAST_GDN_LAYER", "bool", False, "`1`",
    "on CUDA, a Gated DeltaNet decoder layer's decode step runs the one-launch mixer and the one-launch MoE "
    "block as one launch instead of two (needs both of them on; less GPU time per layer, decode not measured faster)")
METAL_KERNELS = Switch(
    "MLX_QWEN_FAST_METAL", "bool", False, "`1`",
    "on Apple silicon, the package's Metal kernels run (decode: the Gated DeltaNet step, the MoE block, "
    "the head_dim-256 attention, the residual add fused with the post-attention RMSNorm; prefill: the MoE "
    "block's routing and grouped expert GEMMs); checked only by running MLX's generated source on a CPU, never "
    "timed on a Mac")
MLX_COMPILES_AHEAD = Switch(
    "MLX_QWEN_FAST_COMPILE_AHEAD", "bool", True, "`0`",
    "on a model's first use on a CUDA machine, the CLIs, `warmup` and `mlx_lm.load` with the fast path installed "
    "leave MLX to compile its quantised-matmul "
    "and gather kernels when first needed, one after another, instead of in worker processes while the "
    "checkpoint loads (timings: bench/results/package-figures.md, \"First use\")")
KERNEL_CACHE = Switch(
    "MLX_QWEN_FAST_CACHE", "path", None, "a folder",
    "where compiled CUDA kernels are cached (default `$XDG_CACHE_HOME/mlx_qwen_fast` "
    "or `~/.cache/mlx_qwen_fast`)")
NVRTC = Switch(
    "MLX_QWEN_FAST_NVRTC", "path", None, "a file",
    "the `libnvrtc` to compile kernels with (default: the one MLX loaded, else one on disk)")
NVFATBIN = Switch(
    "MLX_QWEN_FAST_NVFATBIN", "path-or-off", None, "a file, or `0`",
    "the `libnvfatbin` that compresses launched kernels (a path that does not load is "
    "warned about and skipped); `0` launches plain cubins")
ARCH = Switch(
    "MLX_QWEN_FAST_ARCH", "arch", None, "e.g. `sm_90a`",
    "build kernels for this target instead of asking the driver (cache warming)")
POISON = Switch(
    "MLX_QWEN_FAST_POISON", "bool", False, "`1`",
    "fill every kernel output with NaN before its launch (tests: shows unwritten elements)")

#: Every switch, in the README's order.
SWITCHES: Tuple[Switch, ...] = (
    FAST_PATH, MOE_PREFILL_KERNEL, MOE_DECODE_KERNEL, DECODE_LAYER_STEP, DECODE_MODEL_STEP, VERIFY_MODEL_STEP,
    ATTENTION_DECODE_KERNEL, ATTENTION_PREFILL_KERNEL, DECODE_GEMV_KERNEL, PREFILL_GEMM_KERNEL, GDN_MIXER_KERNEL, MOE_BLOCK_KERNEL,
    GDN_LAYER_KERNEL, METAL_KERNELS, MLX_COMPILES_AHEAD, KERNEL_CACHE, NVRTC, NVFATBIN, ARCH, POISON,
)


def check_all() -> None:
    """Read every switch, warning once about each value not understood, so
    that a bad value is reported also where this backend never reads that
    switch (the CUDA kernels' switches on the CPU or Metal)."""
    for switch in SWITCHES:
        switch.get()


# ---------------------------------------------------------------------------
# folders
# ---------------------------------------------------------------------------


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/mlx_qwen_fast``, or ``~/.cache/mlx_qwen_fast``: the
    package's folder for everything it keeps between processes (the demo's
    checkpoint, MLX's compile cache when :func:`apply_process_settings` chose it)."""
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlx_qwen_fast"


def kernel_cache_dir() -> Path:
    """Folder of the compiled-kernel cache: :data:`KERNEL_CACHE`, else :func:`cache_root`."""
    chosen = KERNEL_CACHE.get()
    return Path(chosen) if chosen else cache_root()


def mlx_ptx_cache_dir() -> Optional[str]:
    """``MLX_PTX_CACHE_DIR`` as the environment holds it now (None: unset,
    MLX's own default)."""
    return os.environ.get(MLX_PTX_CACHE.name) or None


def child_environment(**overrides: str) -> Dict[str, str]:
    """A copy of this process's environment with ``overrides``, for the
    package's worker processes (:mod:`mlx_qwen_fast.mlx_compiles`)."""
    return dict(os.environ, **overrides)


def cuda_toolkit_lib_dirs() -> List[str]:
    """``lib64`` of the CUDA toolkits named by ``CUDA_HOME`` and ``CUDA_PATH`` (where set)."""
    return [os.path.join(os.environ[v], "lib64") for v in ("CUDA_HOME", "CUDA_PATH")
            if os.environ.get(v, "").strip()]


# ---------------------------------------------------------------------------
# MLX's own variables, set by the import on CUDA
# ---------------------------------------------------------------------------


@dataclass
class _ProcessSetting:
    """An MLX variable the import sets on CUDA when the environment does not."""

    name: str
    why: str
    written: Optional[str] = field(default=None)  # the value written here, while it stands


#: ``MLX_MAX_MB_PER_BUFFER``: MLX's CUDA backend commits the CUDA graph it is
#: recording once the sizes of its nodes' inputs add up to this many "MB"
#: (counted in elements, ``array::data_size``: 1000 per MB on Hopper;
#: mlx ``backend/cuda/device.cpp``) or once it holds ``MLX_MAX_OPS_PER_BUFFER``
#: nodes. Every MoE node lists a whole layer's expert weights as inputs
#: (~126 M elements per layer of Qwen3.6-35B-A3B at 4 bits), so decode would
#: commit a graph every ~8 layers; set to :data:`GRAPH_LIMIT_VALUE`, only the
#: node count commits. Measured: bench/results/package-figures.md, "MLX's graph limit".
MLX_GRAPH_LIMIT = _ProcessSetting(
    "MLX_MAX_MB_PER_BUFFER", "so that a decode step is not split into extra CUDA graphs")
GRAPH_LIMIT_VALUE = "1000000"

#: ``MLX_PTX_CACHE_DIR``: where MLX keeps the kernels it compiles at run time
#: (quantised matmuls, gathers, fused elementwise kernels). MLX's default is
#: ``/tmp/mlx/<version>/ptx``, which a reboot may empty; the first use of a
#: fresh cache compiles for minutes (bench/results/package-figures.md, "First use").
#: Set to ``<cache_root()>/mlx-ptx/<mlx version>`` it is kept with the
#: package's own kernels.
MLX_PTX_CACHE = _ProcessSetting(
    "MLX_PTX_CACHE_DIR", "so that MLX's compiled kernels outlive /tmp")

_PROCESS_SETTINGS = (MLX_GRAPH_LIMIT, MLX_PTX_CACHE)

#: Records, for child processes, which of MLX's variables the package set and
#: to what (``NAME=value`` entries joined by ``;``): a child that imports the
#: package then still knows them as the package's, so its ``--stock`` removes
#: them rather than taking them for the user's.
_SET_BY_PACKAGE = "MLX_QWEN_FAST_SET_VARIABLES"


def _inherited() -> Dict[str, str]:
    raw = os.environ.get(_SET_BY_PACKAGE, "")
    return dict(part.split("=", 1) for part in raw.split(";") if "=" in part)


def _record() -> None:
    entries = [f"{s.name}={s.written}" for s in _PROCESS_SETTINGS if s.written is not None]
    if entries:
        os.environ[_SET_BY_PACKAGE] = ";".join(entries)
    else:
        os.environ.pop(_SET_BY_PACKAGE, None)


def _mlx_version() -> str:
    import mlx.core as mx

    return mx.__version__


def apply_process_settings(backend: str) -> List[str]:
    """Set MLX's variables that the fast path wants, where the user has not.

    On ``backend == "cuda"`` with the fast path on (:data:`FAST_PATH`), each
    of :data:`MLX_GRAPH_LIMIT` (to :data:`GRAPH_LIMIT_VALUE`) and
    :data:`MLX_PTX_CACHE` (to a folder under :func:`cache_root`) that the
    environment does not set is set. MLX reads both once, at the GPU's first
    evaluation (graph limit) or first run-time compile (PTX cache), so this
    takes effect only before those (``import mlx_qwen_fast`` calls it). Both
    apply to the whole process, stock models included, and to child
    processes, which are told that the package set them (a child's
    :func:`restore_process_settings` removes them too). Returns the names it
    set.
    """
    if backend != "cuda" or not FAST_PATH.get(warn=False):  # warned about at patch() / install()
        return []
    values = {MLX_GRAPH_LIMIT.name: GRAPH_LIMIT_VALUE,
              MLX_PTX_CACHE.name: str(cache_root() / "mlx-ptx" / _mlx_version())}
    inherited = _inherited()
    done = []
    for s in _PROCESS_SETTINGS:
        if s.name in os.environ:
            if inherited.get(s.name) == os.environ[s.name]:  # a parent process's setting of ours
                s.written = os.environ[s.name]
            continue
        s.written = os.environ[s.name] = values[s.name]
        done.append(s.name)
    _record()
    return done


def restore_process_settings() -> List[str]:
    """Undo :func:`apply_process_settings` (each variable that still holds
    the value written there is removed), so that a process that has not yet
    used the GPU runs with MLX's own defaults (the CLIs' ``--stock``).
    Returns the names it removed."""
    done = []
    for s in _PROCESS_SETTINGS:
        if s.written is not None and os.environ.get(s.name) == s.written:
            del os.environ[s.name]
            done.append(s.name)
        s.written = None
    _record()
    return done


def process_settings_report(backend: str) -> str:
    """Each MLX variable of :func:`apply_process_settings` as it stands and
    who set it, e.g. ``"MLX_MAX_MB_PER_BUFFER=1000000 (mlx_qwen_fast),
    MLX_PTX_CACHE_DIR unset (MLX default)"``; empty off CUDA."""
    if backend != "cuda":
        return ""
    parts = []
    for s in _PROCESS_SETTINGS:
        value = os.environ.get(s.name)
        if value is None:
            parts.append(f"{s.name} unset (MLX default)")
        else:
            origin = "mlx_qwen_fast" if value == s.written else "environment"
            parts.append(f"{s.name}={value} ({origin})")
    return ", ".join(parts)


def markdown_table() -> str:
    """The README's table of environment variables (one row per switch,
    then MLX's variables that the import sets)."""
    rows = ["| variable | values | effect |", "|---|---|---|"]
    for s in SWITCHES:
        rows.append(f"| `{s.name}` | {s.values} | {s.meaning} |")
    rows.append(f"| `{MLX_GRAPH_LIMIT.name}` | MLX's own | when unset, `import mlx_qwen_fast` sets it to "
                f"{GRAPH_LIMIT_VALUE} on CUDA, {MLX_GRAPH_LIMIT.why} |")
    rows.append(f"| `{MLX_PTX_CACHE.name}` | MLX's own | when unset, `import mlx_qwen_fast` sets it to "
                f"`<cache>/mlx-ptx/<mlx version>` on CUDA, {MLX_PTX_CACHE.why} |")
    return "\n".join(rows)
