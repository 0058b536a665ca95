"""The weight format the kernels read, and the decode contracts the CUDA
and Metal paths share.

* :data:`KERNEL_QUANTIZATION`, :func:`quantization_problem`,
  :func:`kernel_problems`: which kernel implementations a block's modules
  decline, and why (pure: module attributes and dtypes only); the
  dispatcher's :func:`mlx_qwen_fast.ops.moe.decide_kernels` keeps the
  answer on the block (:data:`_DECLINED`);
* :func:`decode_arrays`, :func:`_decode_rows`, :data:`_DECODE_CHILDREN`,
  :data:`_EXPERT_PATHS`: the block's arrays as the decode kernels take
  them, the token rows they take, and the arrays' paths under the block;
  the CUDA decode kernels (:mod:`mlx_qwen_fast.kernels.moe_decode_gemv`)
  and their Metal ports (:mod:`mlx_qwen_fast.kernels.moe_gate_up_metal`,
  :mod:`mlx_qwen_fast.kernels.moe_down_metal`) share one contract.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import mlx.core as mx

from ...compiled import linear_arrays
from ...kernels.moe_contract import DECODE_MAX_TOKENS
from .._checks import is_int


# ---------------------------------------------------------------------------
# The weight format the kernels read, decided per block at patch time
# ---------------------------------------------------------------------------

#: The one weight format of the CUDA MoE kernels (grouped GEMMs and decode
#: GEMVs): MLX affine quantisation, 4 bits, groups of 64 inputs, bf16 scales
#: and biases, no bias term. The kernels unpack eight 4-bit values per uint32
#: word and one scale/bias pair per 64 inputs; any other layout would be read
#: as garbage, so every other format runs stock.
KERNEL_QUANTIZATION = "affine 4-bit group 64 with bfloat16 scales and biases"

_QUANTIZED_CLASSES = ("QuantizedLinear", "QuantizedSwitchLinear")
_DECLINED = "_mqf_declined"  # block attribute: {implementation: reason} from decide_kernels


def _dtype_name(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def quantization_problem(m, bits: Tuple[int, ...] = (4,), scales: Tuple = (mx.bfloat16,)) -> Optional[str]:
    """Why the CUDA MoE kernels cannot read the (switch) linear layer ``m``,
    or None when they can.

    Read from the module's own attributes and array dtypes (nothing is
    evaluated): it must be an ``nn.QuantizedLinear`` or mlx-lm
    ``QuantizedSwitchLinear`` with ``mode`` "affine", ``bits`` in ``bits``,
    ``group_size`` 64, ``scales`` and ``biases`` of a dtype in ``scales``
    (bfloat16) and no ``bias`` term.

    Args:
        m: any module (or object).
        bits: the bit widths accepted (4 for expert weights; the decode
            kernels also read an 8-bit shared-expert gate).
        scales: the scale and bias dtypes accepted (the Metal prefill
            kernels read float32, float16 and bfloat16).

    Returns:
        None, or the first difference in a few words: "3-bit weights",
        "mxfp4 weights", "group size 32", "float32 scales", "unquantised
        weights", "a LoRASwitchLinear layer", ...

    Raises:
        ValueError: ``bits`` not a tuple of ints.
    """
    if not isinstance(bits, tuple) or not all(is_int(b) for b in bits):
        raise ValueError(f"quantization_problem: bits must be a tuple of ints (the bit widths accepted), got {bits!r}")
    name = type(m).__name__
    if name not in _QUANTIZED_CLASSES:
        return "unquantised weights" if name in ("Linear", "SwitchLinear") else f"a {name} layer"
    mode = getattr(m, "mode", None) or "affine"
    if mode != "affine":
        return f"{mode} weights"
    if getattr(m, "bits", None) not in bits:
        return f"{getattr(m, 'bits', None)}-bit weights"
    if getattr(m, "group_size", None) != 64:
        return f"group size {getattr(m, 'group_size', None)}"
    if "biases" not in m or "scales" not in m:
        return "no affine scales and biases"
    if "bias" in m:
        return "a bias term"
    for leaf in ("scales", "biases"):
        if m[leaf].dtype not in scales:
            return f"{_dtype_name(m[leaf].dtype)} {leaf}"
    return None


def _first_problem(part: str, block, child: str, names: Tuple[str, ...],
                   scales: Tuple = (mx.bfloat16,)) -> Optional[str]:
    """``"<part>: <problem> (<child>.<name>)"`` for the first module
    ``block.<child>.<name>`` (``name`` in ``names``) that the kernels cannot
    read as 4-bit with scales of ``scales`` (:func:`quantization_problem`),
    or None."""
    parent = getattr(block, child, None)
    for n in names:
        p = quantization_problem(getattr(parent, n, None), scales=scales)
        if p is not None:
            return f"{part}: {p} ({child}.{n})"
    return None


_PROJS = ("gate_proj", "up_proj", "down_proj")
#: The scale and bias dtypes the Metal prefill kernels read.
_METAL_PREFILL_SCALES = (mx.float32, mx.float16, mx.bfloat16)


def kernel_problems(block) -> Dict[str, str]:
    """The kernel implementations that cannot run ``block`` for the way its
    modules are quantised, each with the reason.

    * "cuda-prefill" reads the routed experts (``switch_mlp.gate_proj``,
      ``up_proj``, ``down_proj``): they must be :data:`KERNEL_QUANTIZATION`.
      The router and the shared expert may be quantised any way (they run on
      MLX's quantised matmuls when they differ from the experts).
    * "cuda-decode" reads the routed experts and the shared expert
      (``shared_expert.gate_proj``, ...), both :data:`KERNEL_QUANTIZATION`,
      and the shared-expert gate: 4- or 8-bit affine group 64 with bf16
      scales and biases, or a bias-free bf16 ``nn.Linear``. The router may be
      any ``nn.Linear`` / ``nn.QuantizedLinear`` (the step applies it with
      ``mx.quantized_matmul`` at its own settings).
    * "metal-decode" reads what "cuda-decode" reads but the router, which
      it calls as the module it is (any layer).
    * "metal-prefill" reads the routed experts only, 4-bit affine group 64
      with no bias term as :data:`KERNEL_QUANTIZATION` but with float32,
      float16 or bfloat16 scales and biases (the router and the shared
      expert run as the modules they are).

    Pure: reads module attributes and dtypes only, on every backend. Shapes
    and activation dtypes are still checked per call, where the kernels
    decline anything else to the stock block.

    Args:
        block: a ``Qwen3NextSparseMoeBlock`` (or the fast subclass).

    Returns:
        ``{implementation name: reason}`` for the implementations that do
        not apply, e.g. ``{"cuda-prefill": "moe experts: 3-bit weights
        (switch_mlp.gate_proj)", "cuda-decode": ..., "metal-decode": ...}``;
        empty when all apply.
    """
    experts = _first_problem("moe experts", block, "switch_mlp", _PROJS)
    if experts is not None:
        problems = dict.fromkeys(("cuda-prefill", "cuda-decode", "metal-decode"), experts)
        metal = _first_problem("moe experts", block, "switch_mlp", _PROJS, _METAL_PREFILL_SCALES)
        if metal is not None:  # the Metal prefill also reads float32 and float16 scales
            problems["metal-prefill"] = metal
        return problems
    decode = _first_problem("moe shared expert", block, "shared_expert", _PROJS)
    if decode is None:
        sg = getattr(block, "shared_expert_gate", None)
        gate = quantization_problem(sg, bits=(4, 8))
        dense_bf16 = (type(sg).__name__ == "Linear" and "bias" not in sg
                      and sg["weight"].dtype == mx.bfloat16)
        if gate is not None and not dense_bf16:
            decode = f"moe shared-expert gate: {gate} (shared_expert_gate)"
    if decode is not None:
        return {"cuda-decode": decode, "metal-decode": decode}
    if linear_arrays(getattr(block, "gate", None)) is None:
        return {"cuda-decode": f"moe router: a {type(getattr(block, 'gate', None)).__name__} layer (gate)"}
    return {}

# ---------------------------------------------------------------------------
# The decode kernels' arrays, shared by the CUDA and Metal decode
# ---------------------------------------------------------------------------


def _quantized_ok(m, bits=(4,)) -> bool:
    """An affine group-64 quantised (switch) linear layer of one of ``bits``,
    bf16 scales and biases, no bias term (:func:`quantization_problem`)."""
    return quantization_problem(m, bits) is None


def decode_arrays(block):
    """``(experts, shared, expert_gate)`` of a ``Qwen3NextSparseMoeBlock`` as
    :func:`mlx_qwen_fast.kernels.moe_decode_gemv.moe_decode_arrays` takes them,
    or None when a module is not quantised the way the kernels need (routed
    and shared experts 4-bit group 64 affine with bf16 scales; shared gate
    4/8-bit group 64 or a bias-free bf16 ``nn.Linear``)."""
    try:
        sm, se, sgm = block.switch_mlp, block.shared_expert, block.shared_expert_gate
        mods = (sm.gate_proj, sm.up_proj, sm.down_proj, se.gate_proj, se.up_proj, se.down_proj)
    except AttributeError:
        return None
    if not all(_quantized_ok(m) for m in mods):
        return None
    q = lambda m: (m["weight"], m["scales"], m["biases"])  # noqa: E731
    if _quantized_ok(sgm, bits=(4, 8)):
        eg = (sgm["weight"], sgm["scales"], sgm["biases"], sgm.bits)
    elif type(sgm).__name__ == "Linear" and "bias" not in sgm and sgm["weight"].dtype == mx.bfloat16:
        w = sgm["weight"]
        eg = (w, w, w, 16)
    else:
        return None
    return tuple(q(m) for m in mods[:3]), tuple(q(m) for m in mods[3:]), eg


def _decode_rows(block, x) -> Optional[int]:
    """The token rows of ``x`` where both decode kernels' plans may apply --
    an unsharded block, ``x`` bf16 ``[..., D]`` with 1 to
    ``DECODE_MAX_TOKENS`` rows -- else None."""
    if getattr(block, "sharding_group", None) is not None:
        return None
    if not isinstance(x, mx.array) or x.ndim < 1 or x.dtype != mx.bfloat16:
        return None
    n = math.prod(x.shape[:-1])
    return n if 1 <= n <= DECODE_MAX_TOKENS else None


_DECODE_CHILDREN = ("gate", "shared_expert_gate", "switch_mlp", "shared_expert")
_EXPERT_PATHS = tuple((parent, proj, leaf) for parent in ("switch_mlp", "shared_expert")
                      for proj in ("gate_proj", "up_proj", "down_proj")
                      for leaf in ("weight", "scales", "biases"))
