"""The patched model on the CPU as if the backend were Metal (tests/README.md,
"The patched model through the Metal checker").

:func:`metal_backend` makes the package take its Metal paths while MLX
computes on the CPU and every ``mx.fast.metal_kernel`` call runs the source
MLX generates for it through the Metal checker (:mod:`metal_check`). Inside:

* ``mx.fast.metal_kernel`` builds :class:`metal_check.SimKernel`\\ s and
  ``mx.metal.is_available()`` is True (:func:`metal_check.simulated`); the
  modules that build Metal kernels at import or keep one once built
  (:func:`kernel_modules`: mlx-lm's ``models.gated_delta``, every
  ``mlx_qwen_fast.kernels`` module named ``*metal*``) are reloaded, so
  their kernels are SimKernels, and reloaded again on the way out (the real
  ones back);
* ``mlx_qwen_fast.backend.current()`` returns ``"metal"``: every dispatcher
  and :func:`mlx_qwen_fast.patching.patch` (its report included) ask it;
* :data:`mlx_qwen_fast.config.METAL_KERNELS` is on (through the ``env``
  fixture; put back as it was on the way out);
* the default device is the CPU, and ``mx.compile`` is disabled: a
  SimKernel runs when it is called (it evaluates its inputs and runs the
  program), which a compile trace does not allow, so compiled decode steps
  run their Python eagerly (same ops, the kernels called from them).

Everything is put back on the way out, also when the body raises, so
nothing leaks into the next test. :class:`MetalRun` counts the kernels'
calls per phase of the model (prefill: a call of more than one token per
row; decode: one) or inside any block (:meth:`MetalRun.launches`), and :func:`kernel_problems` holds them against the
:class:`~mlx_qwen_fast.patch_report.PatchReport`.

:func:`build` makes the model the Metal kernels take: the tiny preset's
structure with 128-wide Gated DeltaNet heads (the GDN decode kernel's
size), head_dim-256 attention (the full model's), 4 layers (3 GDN, 1
attention).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pkgutil
from typing import Dict, List, Optional, Sequence

import mlx.core as mx

import metal_check

#: Name under which :func:`build` registers :func:`model_config` in
#: ``checkpoint.PRESETS`` (only while it builds).
PRESET = "metal-e2e"

#: mlx-lm's modules that build Metal kernels at import (the GDN recurrence
#: kernels the patched prefill runs on Metal: "mlx-lm-metal").
MLX_LM_KERNEL_MODULES = ("mlx_lm.models.gated_delta",)

#: Report family -> the name prefixes of the kernel modules that serve it
#: (a family not listed: its own name, e.g. "moe" -> ``moe_*``). "linear":
#: the decode projections with their norms and residuals (``ops.linear``).
FAMILY_MODULES = {"linear": ("linear", "quantized_gemv", "add_rms_norm")}

#: The Metal kernels of a sparse MoE block's prefill ("metal-prefill"), one
#: launch each per block and call.
MOE_PREFILL_KERNELS = ("mqf_moe_route", "mqf_moe_group_count", "mqf_moe_group_scatter", "mqf_moe_gemm_gate_up",
                       "mqf_moe_gemm_down")


def model_config() -> dict:
    """config.json of the model: the tiny preset with Gated DeltaNet heads
    of 128 (2 key, 4 value heads), attention of head_dim 256 (16 query, 2 KV
    heads, 64 rotated dims), 4 layers (3 GDN, then 1 attention); hidden
    256, 32 experts of 128, top 8. The model of conftest's ``kernel_heads``
    fixture (every decode kernel's shape; a test checks they agree), as a
    function: module-scoped fixtures cannot use that one."""
    from mlx_qwen_fast import checkpoint

    cfg = checkpoint.preset_config("tiny")
    text = cfg["text_config"]
    text.update(linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=2,
                linear_num_value_heads=4, num_hidden_layers=4, layer_types=text["layer_types"][:4],
                head_dim=256)
    text["rope_parameters"]["mrope_section"] = [11, 11, 10]
    return cfg


def build(seed: int = 0, **kwargs):
    """``checkpoint.build_model`` of :func:`model_config` (``kwargs`` as
    there; default fp32, quantised as the checkpoint). Returns ``(model,
    config)``."""
    from mlx_qwen_fast import checkpoint

    kwargs.setdefault("dtype", mx.float32)
    checkpoint.PRESETS[PRESET] = model_config()
    try:
        return checkpoint.build_model(PRESET, seed=seed, **kwargs)
    finally:
        del checkpoint.PRESETS[PRESET]


def kernel_modules() -> List[str]:
    """The modules :func:`metal_backend` reloads: mlx-lm's
    (:data:`MLX_LM_KERNEL_MODULES`) and every module of
    ``mlx_qwen_fast.kernels`` whose name contains "metal"."""
    import mlx_qwen_fast.kernels as kernels

    ours = sorted(f"{kernels.__name__}.{m.name}" for m in pkgutil.iter_modules(kernels.__path__)
                  if "metal" in m.name)
    return list(MLX_LM_KERNEL_MODULES) + ours


PHASES = ("prefill", "decode")


class MetalRun:
    """What ran inside :func:`metal_backend`.

    Attributes:
        kernels: every SimKernel built inside (``.name``, ``.origin``: the
            module that built it, ``.calls``).
        calls: phase ("prefill" / "decode") -> {kernel: calls in model
            calls of that phase}, counted by the models :meth:`model`
            wrapped.
        model_calls: phase -> how many calls of the wrapped models it had.
        modules: the kernel modules reloaded (:func:`kernel_modules`).
    """

    def __init__(self, kernels: List[metal_check.SimKernel], modules: Sequence[str]):
        self.kernels = kernels
        self.modules = list(modules)
        self.calls: Dict[str, Dict[metal_check.SimKernel, int]] = {p: {} for p in PHASES}
        self.model_calls: Dict[str, int] = {p: 0 for p in PHASES}

    def model(self, model):
        """``model`` as a callable that counts the SimKernel calls of each of
        its calls under that call's phase (``generate_step`` calls a model
        only as ``model(tokens, cache=...)``)."""
        run = self

        def call(inputs, *args, **kwargs):
            phase = "prefill" if inputs.shape[1] > 1 else "decode"
            run.model_calls[phase] += 1
            launched: Dict[metal_check.SimKernel, int] = {}
            try:
                with run.launches() as launched:
                    return model(inputs, *args, **kwargs)
            finally:
                for k, n in launched.items():
                    run.calls[phase][k] = run.calls[phase].get(k, 0) + n

        return call

    @contextlib.contextmanager
    def launches(self):
        """Yields a dict that holds, once the block is left (also by an
        exception), {kernel: calls made inside the block} of the kernels
        called there (those built inside count from 0)."""
        before = {k: k.calls for k in self.kernels}
        launched: Dict[metal_check.SimKernel, int] = {}
        try:
            yield launched
        finally:
            for k in self.kernels:
                n = k.calls - before.get(k, 0)
                if n:
                    launched[k] = n

    def ran(self, phase: str) -> Dict[metal_check.SimKernel, int]:
        """{kernel: calls} of the kernels that ran in ``phase``."""
        return dict(self.calls[phase])


@contextlib.contextmanager
def metal_backend(env):
    """The package on "Metal", MLX on the CPU, Metal kernels through the
    checker (module docstring). ``env``: the test's ``env`` fixture.
    Yields a :class:`MetalRun`."""
    from mlx_qwen_fast import backend, config

    switch = config.METAL_KERNELS
    saved_switch = os.environ.get(switch.name)
    saved_current = backend.current
    saved_device = mx.default_device()
    compile_off = bool(os.environ.get("MLX_DISABLE_COMPILE"))  # MLX's own switch: leave it as it was
    names = kernel_modules()
    mods = [importlib.import_module(n) for n in names]
    env.set(switch.name, "1")
    try:
        with metal_check.simulated() as built:
            for m in mods:
                importlib.reload(m)
            backend.current = lambda: backend.METAL
            mx.set_default_device(mx.cpu)
            mx.disable_compile()
            try:
                yield MetalRun(built, names)
            finally:
                if not compile_off:
                    mx.enable_compile()
                mx.set_default_device(saved_device)
                backend.current = saved_current
    finally:
        for m in mods:
            importlib.reload(m)  # outside simulated(): the real kernels (None without Metal) back
        if saved_switch is None:
            env.unset(switch.name)
        else:
            env.set(switch.name, saved_switch)


def generate_tokens(model, prompt: mx.array, max_tokens: int, *, cache_model=None):
    """Greedy tokens and the logits ``[V]`` each was chosen from, by mlx-lm's
    ``generate_step`` on the CPU stream with a fresh prompt cache of
    ``cache_model`` (default ``model``; pass the model when ``model`` is a
    :meth:`MetalRun.model` wrapper). ``prompt``: 1-D token ids."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    logits: List[mx.array] = []

    def record(tokens, row):  # a logits processor that changes nothing: sees the raw logits
        logits.append(row[0])
        return row

    cache = make_prompt_cache(cache_model if cache_model is not None else model)
    tokens = []
    for tok, _ in generate_step(prompt, model, max_tokens=max_tokens, prompt_cache=cache,
                                logits_processors=[record], stream=mx.cpu):
        tokens.append(int(tok))
    return tokens, logits[:len(tokens)]


def _family_of(origin: str) -> Optional[str]:
    """The report family a kernel module serves, from its name (None: none)."""
    base = origin.rsplit(".", 1)[-1]
    for family in ("gated_delta", "moe", "attention", "linear"):
        if any(base.startswith(p) for p in FAMILY_MODULES.get(family, (family,))):
            return family
    return None


def metal_ops(report) -> Dict[str, str]:
    """The ops of ``report`` whose implementation is a Metal one (its name
    says "metal": "metal-kernel", mlx-lm's "mlx-lm-metal", ...)."""
    return {op: impl for op, impl in report.ops.items() if "metal" in impl}


def kernel_problems(report, run: MetalRun) -> List[str]:
    """Where the kernels that ran and the report disagree, both ways:

    * every op the report names a Metal implementation for
      (:func:`metal_ops`, ``"<family>.<phase>"``) ran a kernel of its family
      in that phase: one of the package's (``mlx_qwen_fast.*``) for the
      package's implementations, one of mlx-lm's for "mlx-lm-*";
    * every kernel that ran is one of those: its family's op in that phase
      has a Metal implementation of its origin (a package kernel where the
      report names none, or mlx-lm's recurrence kernel in a decode the
      report gives the package's kernel -- the decode fell back -- is a
      problem).

    Returns the problems (empty: they agree)."""
    ops = metal_ops(report)
    problems = []

    def owner(impl: str) -> str:
        return "mlx_lm." if impl.startswith("mlx-lm") else "mlx_qwen_fast."

    for op, impl in sorted(ops.items()):
        family, phase = op.split(".", 1)
        if phase not in PHASES:
            problems.append(f"{op} = {impl!r}: phase {phase!r} is not one of {PHASES}")
            continue
        ran = [k for k in run.ran(phase) if k.origin.startswith(owner(impl)) and _family_of(k.origin) == family]
        if not ran:
            problems.append(f"{op} = {impl!r} in the report, but no {owner(impl)}* {family} kernel ran in "
                            f"{phase} (ran: {_names(run.ran(phase))})")
    for phase in PHASES:
        for k, n in run.ran(phase).items():
            family = _family_of(k.origin)
            impl = ops.get(f"{family}.{phase}")
            if impl is None or not k.origin.startswith(owner(impl)):
                problems.append(f"kernel {k.name} ({k.origin}) ran {n}x in {phase}, but the report gives "
                                f"{family}.{phase} = {report.ops.get(f'{family}.{phase}')!r}")
    return problems


def _names(calls: Dict[metal_check.SimKernel, int]) -> str:
    return ", ".join(f"{k.name} ({k.origin}) x{n}" for k, n in calls.items()) or "none"
