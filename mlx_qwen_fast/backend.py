"""Which MLX backend the current default device runs on.

Every op module asks :func:`current` to choose its implementation, so one place
decides between the CUDA kernels, Metal (where mlx-lm's own kernels stay in
place) and the plain-MLX reference ops (CPU, and GPUs without a kernel).
"""

import os

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


#: ``MLX_MAX_MB_PER_BUFFER`` set on CUDA when the environment has none (MB).
CUDA_GRAPH_MB = 1_000_000
_GRAPH_MB_VAR = "MLX_MAX_MB_PER_BUFFER"
_graph_mb_origin = "mlx default"


def raise_cuda_graph_byte_limit() -> bool:
    """Lift MLX's per-CUDA-graph input-byte limit, unless the user set it.

    MLX's CUDA backend commits (instantiates or updates, and launches) the
    CUDA graph it is recording once the nodes' *inputs* add up to
    ``MLX_MAX_MB_PER_BUFFER`` MB (1000 on Hopper and Blackwell, 100 to 400
    elsewhere; mlx ``backend/cuda/device.cpp``), or once it holds more than
    ``MLX_MAX_OPS_PER_BUFFER`` nodes. Every MoE node lists a whole layer's
    expert weights as inputs (~453 MB per layer of Qwen3.6-35B-A3B at 4
    bits), so a decode token commits a graph about every two layers; with
    the byte limit lifted only the node limit commits (a few times per
    token). Measured on the H200 (bench/results/moe-cuda-log.md, eighth
    session): patched decode at 4K context, median of 4 processes each,
    81 -> 134 tok/s (processes vary by +-30% on that machine).

    Sets ``MLX_MAX_MB_PER_BUFFER`` to :data:`CUDA_GRAPH_MB` when MLX's
    default device is a CUDA GPU, the variable is not set and the fast path
    is not switched off (``MLX_QWEN_FAST=0``). MLX reads the variable once,
    when the GPU first evaluates something, so this takes effect only if it
    runs before that (``import mlx_qwen_fast`` calls it). It applies to the
    whole process (stock models too). Returns True if it set the variable.
    """
    global _graph_mb_origin
    if _GRAPH_MB_VAR in os.environ:
        if _graph_mb_origin == "mlx default":
            _graph_mb_origin = "environment"
        return False
    if os.environ.get("MLX_QWEN_FAST", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if current() != CUDA:
        return False
    os.environ[_GRAPH_MB_VAR] = str(CUDA_GRAPH_MB)
    _graph_mb_origin = "mlx_qwen_fast"
    return True


def cuda_graph_settings() -> str:
    """``MLX_MAX_MB_PER_BUFFER`` in force and who set it, e.g.
    ``"MLX_MAX_MB_PER_BUFFER=1000000 (mlx_qwen_fast)"``; empty off CUDA."""
    if current() != CUDA:
        return ""
    value = os.environ.get(_GRAPH_MB_VAR, "MLX default")
    return f"{_GRAPH_MB_VAR}={value} ({_graph_mb_origin})"
