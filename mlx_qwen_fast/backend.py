"""Which MLX backend the current default device runs on.

Every op module asks :func:`current` to choose its implementation, so one place
decides between the CUDA kernels, Metal (where mlx-lm's own kernels stay in
place) and the plain-MLX reference ops (CPU, and GPUs without a kernel).
"""

import os
import warnings

import mlx.core as mx

CPU = "cpu"
CUDA = "cuda"
METAL = "metal"


def current() -> str:
    """Backend of ``mx.default_device()``: ``"cpu"``, ``"cuda"`` or ``"metal"``."""
    if mx.default_device() == mx.cpu:
        return CPU
    if mx.metal.is_available():
        return METAL
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return CUDA
    return CPU


BACKENDS = (CPU, CUDA, METAL)


def resolve(name=None) -> str:
    """``name`` checked against :data:`BACKENDS`, or :func:`current` when None.

    Raises:
        ValueError: ``name`` is not "cpu", "cuda" or "metal".
    """
    if name is None:
        return current()
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    return name


#: The environment variable that switches the fast path off.
ENV_SWITCH = "MLX_QWEN_FAST"
#: Values of :data:`ENV_SWITCH` that switch the fast path off (any case, stripped).
OFF_VALUES = ("0", "false", "no", "off")
#: Values that mean on (unset is on too); anything else is on, with a warning.
ON_VALUES = ("", "1", "true", "yes", "on")

#: ``MLX_MAX_MB_PER_BUFFER`` set on CUDA when the environment has none.
CUDA_GRAPH_MB = 1_000_000
_GRAPH_MB_VAR = "MLX_MAX_MB_PER_BUFFER"
_we_set: "str | None" = None  # the value this module wrote, while it stands


def fast_path_enabled() -> bool:
    """False when the environment sets ``MLX_QWEN_FAST`` to one of
    :data:`OFF_VALUES` (any case, stripped); a value in neither
    :data:`OFF_VALUES` nor :data:`ON_VALUES` counts as on and is warned
    about (RuntimeWarning)."""
    value = os.environ.get(ENV_SWITCH, "1").strip().lower()
    if value not in OFF_VALUES + ON_VALUES:
        warnings.warn(f"{ENV_SWITCH}={os.environ[ENV_SWITCH]!r} is neither on ({', '.join(ON_VALUES[1:])}) "
                      f"nor off ({', '.join(OFF_VALUES)}): taken as on", RuntimeWarning)
    return value not in OFF_VALUES


def raise_cuda_graph_byte_limit() -> bool:
    """Lift MLX's per-CUDA-graph input-size limit, unless the user set it.

    MLX's CUDA backend commits (instantiates or updates, and launches) the
    CUDA graph it is recording once the sizes of its nodes' inputs add up to
    ``MLX_MAX_MB_PER_BUFFER`` (counted in elements, ``array::data_size``, per
    MB: 1000 on Hopper and Blackwell, 25-400 elsewhere; mlx
    ``backend/cuda/device.cpp``), or once it holds more than
    ``MLX_MAX_OPS_PER_BUFFER`` nodes. Every MoE node lists a whole layer's
    expert weights as inputs (~126 M elements per layer of Qwen3.6-35B-A3B
    at 4 bits), so a decode token commits a graph every ~8 MoE layers beyond
    the node-count commits; lifted, only the node count commits. Measured on
    the H200 (bench/results/moe-cuda-log.md, eighth session): patched decode
    at 4K context, median of 4 processes each, 81 -> 134 tok/s (processes
    vary by +-30% on that machine; why the commits cost that much is not
    established). Peak memory of a 4K prefill +0.9 GB.

    Sets ``MLX_MAX_MB_PER_BUFFER`` to :data:`CUDA_GRAPH_MB` when MLX's
    default device is a CUDA GPU, the variable is not set and the fast path
    is not switched off (``MLX_QWEN_FAST=0``). MLX reads the variable once,
    when the GPU first evaluates something, so this takes effect only if it
    runs before that (``import mlx_qwen_fast`` calls it). It applies to the
    whole process (stock models too) and, being an environment variable, to
    child processes. Returns True if it set the variable.
    """
    global _we_set
    if _GRAPH_MB_VAR in os.environ or not fast_path_enabled() or current() != CUDA:
        return False
    _we_set = str(CUDA_GRAPH_MB)
    os.environ[_GRAPH_MB_VAR] = _we_set
    return True


def restore_cuda_graph_byte_limit() -> bool:
    """Undo :func:`raise_cuda_graph_byte_limit` (the variable is removed if
    it still holds the value written there), so that a process that has not
    yet evaluated anything on the GPU runs with MLX's own limit (the CLIs'
    ``--stock``). Returns True if it removed the variable."""
    global _we_set
    if _we_set is None or os.environ.get(_GRAPH_MB_VAR) != _we_set:
        return False
    del os.environ[_GRAPH_MB_VAR]
    _we_set = None
    return True


def cuda_graph_settings() -> str:
    """``MLX_MAX_MB_PER_BUFFER`` in the environment now and who set it, e.g.
    ``"MLX_MAX_MB_PER_BUFFER=1000000 (mlx_qwen_fast)"`` or ``"... (environment)"``,
    or ``"MLX_MAX_MB_PER_BUFFER unset (MLX default)"``; empty off CUDA. (MLX
    itself uses the value it read at the GPU's first evaluation.)"""
    if current() != CUDA:
        return ""
    value = os.environ.get(_GRAPH_MB_VAR)
    if value is None:
        return f"{_GRAPH_MB_VAR} unset (MLX default)"
    origin = "mlx_qwen_fast" if value == _we_set else "environment"
    return f"{_GRAPH_MB_VAR}={value} ({origin})"
