"""Quantisation plans: bits, group sizes, modes, per-part overrides and
mlx-lm's mixed recipes, checked against what MLX implements, and the
``quant_predicate`` that makes them with mlx-lm's ``quantize_model``.

By default mlx-community's 4-bit layout (affine 4-bit group
64, router and shared-expert gate 8-bit); every other layout is made with
MLX's ``nn.quantize`` through mlx-lm's ``quantize_model`` (see
:func:`build_model` and :func:`quantization_plan`), so config.json's
``quantization`` block is the one ``mlx_lm.convert`` writes and stock
``mlx_lm.load`` loads it.
"""

import numbers
from typing import Dict, Mapping, NamedTuple, Optional, Tuple

import mlx.nn as nn

# mlx-lm (which imports transformers) is imported inside the functions that
# use it, so that importing this package, and the CLI's argument checks, stay
# light. Its constants this module needs are written out below, and
# tests/test_checkpoint.py checks they are still mlx-lm's.

#: mlx-lm's mixed per-layer quantisation recipes (``mlx_lm.convert.QUANT_RECIPES``).
QUANT_RECIPES = ("mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6")

#: The default quantisation (mlx-community's 4-bit checkpoints): what the
#: CUDA kernels read. Other quantisations: ``bits``, ``group_size``,
#: ``mode``, ``parts`` and ``recipe`` of :func:`build_model`.
QUANT_GROUP_SIZE = 64
QUANT_BITS = 4
QUANT_MODE = "affine"

#: MLX's quantisation modes (``mx.quantize``, MLX 0.32) -> their default
#: ``(group_size, bits)``. "affine" takes :data:`AFFINE_BITS` and
#: :data:`AFFINE_GROUP_SIZES`; each of the others only its default pair.
QUANT_MODES: Dict[str, Tuple[int, int]] = {
    "affine": (64, 4),
    "mxfp4": (32, 4),
    "nvfp4": (16, 4),
    "mxfp8": (32, 8),
}
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUP_SIZES = (32, 64, 128)

#: Parts a per-part override names -> the module paths (suffixes of the
#: checkpoint's module paths) each covers; every quantised module of the
#: model is in exactly one part.
PARTS: Dict[str, Tuple[str, ...]] = {
    "experts": tuple(f"mlp.switch_mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")),
    "shared_expert": tuple(f"mlp.shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj")),
    "router": ("mlp.gate",),
    "shared_expert_gate": ("mlp.shared_expert_gate",),
    "attention": tuple(f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
    "linear_attention": tuple(
        f"linear_attn.{p}" for p in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")
    ),
    "embed_tokens": ("model.embed_tokens",),
    "lm_head": ("lm_head",),
}

#: Parts the model's own ``quant_predicate`` quantises 8-bit affine group 64
#: whatever the rest (``mlx_lm.convert`` writes them so): their default.
_GATE_PARTS = ("router", "shared_expert_gate")
_GATE_SPEC = (64, 8, "affine")

_PART_KEYS = ("bits", "group_size", "mode")


class Quantization(NamedTuple):
    """A checked quantisation plan (:func:`quantization_plan`).

    ``group_size``, ``bits``, ``mode``: the top-level setting (config.json's
    ``quantization`` block); ``parts``: part name -> ``(group_size, bits,
    mode)`` for the parts given an override; ``recipe``: an mlx-lm recipe
    name or None.
    """

    group_size: int
    bits: int
    mode: str
    parts: Dict[str, Tuple[int, int, str]]
    recipe: Optional[str]


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _check_spec(group_size, bits, mode, what: Dict[str, str]) -> Tuple[int, int, str]:
    """``(group_size, bits, mode)`` if MLX takes that combination, else
    ValueError naming the argument through ``what`` (key -> how to name it:
    ``what["bits"]`` etc.; each message shows the value given)."""
    if mode not in QUANT_MODES:
        raise ValueError(f"{what['mode']}={mode!r}: expected one of {', '.join(QUANT_MODES)}")
    if mode == "affine":
        if not _is_int(bits) or bits not in AFFINE_BITS:
            raise ValueError(f"{what['bits']}={bits!r}: mode 'affine' takes bits "
                             f"{', '.join(map(str, AFFINE_BITS))}")
        if not _is_int(group_size) or group_size not in AFFINE_GROUP_SIZES:
            raise ValueError(f"{what['group_size']}={group_size!r}: mode 'affine' takes group sizes "
                             f"{', '.join(map(str, AFFINE_GROUP_SIZES))}")
    else:
        g, b = QUANT_MODES[mode]
        if bits != b or not _is_int(bits):
            raise ValueError(f"{what['bits']}={bits!r}: mode {mode!r} takes bits {b} only")
        if group_size != g or not _is_int(group_size):
            raise ValueError(f"{what['group_size']}={group_size!r}: mode {mode!r} takes group size {g} only")
    return int(group_size), int(bits), mode


def _resolve_part(base: Tuple[int, int, str], override: Mapping) -> Tuple[int, int, str]:
    """The part's ``(group_size, bits, mode)``: the override's keys, the rest
    from ``base`` when the mode stays the same, else the new mode's defaults."""
    mode = override.get("mode", base[2])
    g, b = (base[0], base[1]) if mode == base[2] else QUANT_MODES.get(mode, (None, None))
    return override.get("group_size", g), override.get("bits", b), mode


def quantization_plan(
    bits: Optional[int] = None,
    group_size: Optional[int] = None,
    mode: str = QUANT_MODE,
    parts: Optional[Mapping[str, Mapping[str, object]]] = None,
    recipe: Optional[str] = None,
    *,
    names: Optional[Mapping[str, str]] = None,
) -> Quantization:
    """Check a quantisation request and resolve its defaults.

    Args:
        bits: top-level bits; None = the mode's default (4 for "affine").
        group_size: top-level group size; None = the mode's default (64 for
            "affine").
        mode: a key of :data:`QUANT_MODES`.
        parts: part name (a key of :data:`PARTS`) -> override, a mapping with
            any of ``"bits"``, ``"group_size"``, ``"mode"``. Keys not given
            come from the part's default setting if the mode stays the same
            (the top level; 8-bit affine group 64 for the router and the
            shared-expert gate), else from the new mode's defaults.
        recipe: one of mlx-lm's ``QUANT_RECIPES`` ("mixed_2_6", "mixed_3_4",
            "mixed_3_6", "mixed_4_6"): its per-layer mixed bit widths, built
            by mlx-lm's own ``mixed_quant_predicate_builder`` as
            ``mlx_lm.convert --quant-predicate`` builds them (mode "affine"
            only, no parts; the recipe also sets the router's and the
            shared-expert gate's bits, as in ``mlx_lm.convert``).
        names: how error messages name the arguments (keys "bits",
            "group_size", "mode", "recipe", "parts", "part.bits",
            "part.group_size", "part.mode"; ``{part}`` in a "part.*" name
            stands for the part's name); default the Python names.

    Returns:
        :class:`Quantization`.

    Raises:
        ValueError: a combination MLX does not implement (e.g. mode "mxfp4"
            with bits 8), bits or group size outside :data:`AFFINE_BITS` /
            :data:`AFFINE_GROUP_SIZES`, an unknown part, mode or recipe, a
            recipe with another mode or with parts; the message names the
            argument and the value.
    """
    n = {"bits": "bits", "group_size": "group_size", "mode": "mode", "recipe": "recipe", "parts": "parts"}
    n.update(names or {})
    if mode not in QUANT_MODES:
        raise ValueError(f"{n['mode']}={mode!r}: expected one of {', '.join(QUANT_MODES)}")
    g0, b0 = QUANT_MODES[mode]
    top = _check_spec(g0 if group_size is None else group_size, b0 if bits is None else bits, mode, n)
    if recipe is not None:
        if recipe not in QUANT_RECIPES:
            raise ValueError(f"{n['recipe']}={recipe!r}: expected one of {', '.join(QUANT_RECIPES)}")
        if mode != "affine":
            raise ValueError(f"{n['recipe']}={recipe!r}: mlx-lm's recipes are affine only, got {n['mode']}={mode!r}")
        if parts:
            raise ValueError(f"{n['recipe']}={recipe!r} cannot be combined with {n['parts']}")
    resolved = {}
    for part, override in (parts or {}).items():
        if part not in PARTS:
            raise ValueError(f"{n['parts']}: unknown part {part!r}; expected one of {', '.join(PARTS)}")
        if not isinstance(override, Mapping) or not set(override) <= set(_PART_KEYS):
            raise ValueError(f"{n['parts']}[{part!r}]: expected a mapping with keys among "
                             f"{', '.join(_PART_KEYS)}, got {override!r}")
        what = {k: n.get(f"part.{k}", f"{n['parts']}[{part!r}][{k!r}]") for k in _PART_KEYS}
        what = {k: v.replace("{part}", part) for k, v in what.items()}
        base = _GATE_SPEC if part in _GATE_PARTS else top
        resolved[part] = _check_spec(*_resolve_part(base, override), what)
    return Quantization(*top, resolved, recipe)


def _part_of(path: str) -> Optional[str]:
    """The part (key of :data:`PARTS`) of a module path, or None."""
    for part, suffixes in PARTS.items():
        if any(path == s or path.endswith("." + s) for s in suffixes):
            return part
    return None


def _quant_predicate(model: nn.Module, plan: Quantization):
    """The ``quant_predicate`` for ``mlx_lm.utils.quantize_model``: None
    where the plan has no parts and no recipe (mlx-lm then takes the model's
    own: 8-bit router and shared-expert gate, the rest at the top-level
    setting), else the recipe's, or the model's with the parts' overrides on
    top. A
    part at the top-level setting returns True (no per-path entry in
    config.json), a gate part at its default the model's own entry, any
    other override its full ``{"group_size", "bits", "mode"}`` entry."""
    if not plan.parts and plan.recipe is None:
        return None
    if plan.recipe is not None:
        from mlx_lm.convert import mixed_quant_predicate_builder

        return mixed_quant_predicate_builder(plan.recipe, model, plan.group_size)
    own = model.quant_predicate
    top = (plan.group_size, plan.bits, plan.mode)

    def predicate(path, module):
        part = _part_of(path)
        if part not in plan.parts:
            return own(path, module)
        spec = plan.parts[part]
        if part in _GATE_PARTS and spec == _GATE_SPEC:
            return own(path, module)
        if part not in _GATE_PARTS and spec == top:
            return True
        g, b, m = spec
        return {"group_size": g, "bits": b, "mode": m}

    return predicate
