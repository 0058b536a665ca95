"""mlx-lm integration: swap the fast-path modules into a loaded model.

Three routes, all ending in :func:`patch`:

* ``patch(model)`` on a model from ``mlx_lm.load`` (in place);
* ``mlx_lm.load(path, model_config={"model_type": "qwen3_5_moe_fast"})`` or a
  checkpoint whose config names that type (see ``models/qwen3_5_moe_fast.py``);
* :func:`install`, which wraps ``mlx_lm.utils.load_model`` (and
  ``sharded_load``, to patch after sharding) so that
  ``mlx_lm.generate``, ``benchmark``, ``chat``, ``server`` and user scripts
  calling ``mlx_lm.load`` get the fast path (``MLX_QWEN_FAST=0`` disables it).

A model the fast path does not support is left entirely stock, with one
warning naming the reason. In a supported model, each op family decides at
patch time, from every fast module's own weights, which of its kernels may
run for it (``decide_kernels`` in :mod:`mlx_qwen_fast.ops.moe` and
:mod:`~mlx_qwen_fast.ops.gated_delta`): an op whose kernels do not read the
weights' quantisation stays stock where they would run, with one warning per
op and reason, and the :class:`~mlx_qwen_fast.patch_report.PatchReport` says
so (:mod:`mlx_qwen_fast.patch_report`: the report and its table of ops).
"""

import functools
import inspect
import sys
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import mlx.nn as nn
import mlx_lm.utils

from . import backend, config, generation, speculative
from .compiled import StepPlans
from .layers import FAST_CLASSES, HEAD_CLASSES, LAYER_CLASSES, MODEL_CLASSES, rebind
from .patch_report import FAMILIES, PatchReport, apply_declines, declined_text, op_table, warn_declined

SUPPORTED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5", "qwen3_5_moe_fast")
# mlx-lm's sharded_load, which shards or pipelines the model load_model gave it
# (install's load_model leaves what it loads stock; install's sharded_load
# wrapper patches, and so declines, the model once it is sharded)
_SHARDED_LOAD = inspect.unwrap(mlx_lm.utils.sharded_load)
_SLOTS = ("linear_attn", "mlp", "self_attn")  # the modules with a fast class


def _decide_kernels(model: nn.Module) -> List[Tuple[str, Dict[str, str]]]:
    """Each fast module's op family decides which kernels may run for it
    (``decide_kernels``, kept on the module for the dispatcher): ``[(family
    name, {implementation: reason})]``, one entry per fast module of the
    families in ``FAMILIES`` (the attention kernels read no weights: they
    decline none)."""
    names = {id(module): name for name, module in FAMILIES}
    fast = tuple(FAST_CLASSES.values())
    out = []
    for layer in model.layers:
        for slot in _SLOTS:
            module = getattr(layer, slot, None)
            if isinstance(module, fast) and id(module.ops) in names:
                out.append((names[id(module.ops)], module.ops.decide_kernels(module)))
    return out


def _model_type(model: nn.Module) -> str:
    mt = getattr(model, "model_type", None)
    if mt is None and hasattr(model, "args"):
        mt = getattr(model.args, "model_type", None)
    return mt or type(model).__module__.rsplit(".", 1)[-1]


def _group_size(group) -> int:
    """Size of a distributed group (anything with ``size()`` and ``rank()``,
    as ``mx.distributed.Group``); 1 for anything else (``None``, an int)."""
    if callable(getattr(group, "size", None)) and callable(getattr(group, "rank", None)):
        return int(group.size())
    return 1


def _distributed_reason(model: nn.Module) -> Optional[str]:
    """Why a pipelined or tensor-parallel sharded model is declined, else None.

    The fast modules run the whole computation of one rank's unsharded
    layer and issue no collective, so they cannot stand in for modules that
    mlx-lm split across a group. Detected from what mlx-lm leaves behind:

    * ``model.model.pipeline(group)`` (``PipelineMixin``) sets
      ``pipeline_size`` to the group's size;
    * ``Model.shard(group)`` sets ``sharding_group`` on every ``linear_attn``,
      sparse-MoE ``mlp`` and, for an untied head, the language model (whose
      ``switch_mlp``, shared expert and GDN projections it shards in place,
      keeping their classes), and replaces attention and dense-MLP
      projections with ``mlx.nn``'s distributed linears, which keep the
      group as ``group``.

    A group of size 1 splits nothing and its collectives are identities, so
    it is not declined.
    """
    inner = getattr(model, "model", None)
    pipeline_size = getattr(inner, "pipeline_size", 1)
    if isinstance(pipeline_size, int) and pipeline_size > 1:
        return (f"pipeline-parallel model (pipeline size {pipeline_size}, rank "
                f"{getattr(inner, 'pipeline_rank', '?')}): the fast path does not support mlx-lm's "
                "pipeline stages; left stock")
    size, where = 1, ""
    for name, module in model.named_modules():
        for attr in ("sharding_group", "group"):
            n = _group_size(getattr(module, attr, None))
            if n > size:
                size, where = n, name
    if size > 1:
        return (f"tensor-parallel sharded model (group size {size}, e.g. {where}): the fast "
                "modules do not implement mlx-lm's collectives; left stock")
    return None


def _unsupported_reason(model: nn.Module) -> Optional[str]:
    model_type = _model_type(model)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    distributed = _distributed_reason(model)
    if distributed is not None:
        return distributed
    layers = getattr(model, "layers", None)
    if not layers:
        return "the model has no decoder layers"
    mixers = set(FAST_CLASSES) | set(FAST_CLASSES.values())
    for i, layer in enumerate(layers):
        mixer = getattr(layer, "linear_attn", None) or getattr(layer, "self_attn", None)
        if mixer is None or type(mixer) not in mixers:
            return f"layer {i} has an unsupported token mixer {type(mixer).__name__}"
        if hasattr(layer, "linear_attn"):
            la = layer.linear_attn
            if la.head_k_dim % 32 or la.head_v_dim % 32:
                return (
                    f"layer {i}: Gated DeltaNet head dims {la.head_k_dim}/"
                    f"{la.head_v_dim} are not multiples of 32"
                )
    return None


def _swap(model: nn.Module, to_fast: bool) -> Dict[str, int]:
    swapped = {slot: 0 for slot in _SLOTS}
    swapped["decoder_layer"] = 0
    stock_layers = {fast: stock for stock, fast in LAYER_CLASSES.items()}
    for layer in model.layers:
        if to_fast and type(layer) in LAYER_CLASSES:
            layer.__class__ = LAYER_CLASSES[type(layer)]  # same object, same arrays: only __call__ changes
            swapped["decoder_layer"] += 1
        elif not to_fast and type(layer) in stock_layers:
            layer.__class__ = stock_layers[type(layer)]
            swapped["decoder_layer"] += 1
        if not to_fast:  # the fast paths' cached plans (and their array copies) go with them
            for m in [layer] + [getattr(layer, n, None) for n in _SLOTS]:
                if m is not None:
                    StepPlans.drop(m)
        for slot in _SLOTS:
            module = getattr(layer, slot, None)
            if module is None:
                continue
            if to_fast and type(module) in FAST_CLASSES:
                setattr(layer, slot, rebind(module, FAST_CLASSES[type(module)]))
                swapped[slot] += 1
            elif not to_fast and type(module) in FAST_CLASSES.values():
                setattr(layer, slot, rebind(module, module.stock_class))
                swapped[slot] += 1
    stock_models = {fast: stock for stock, fast in MODEL_CLASSES.items()}
    for stack in _layer_stacks(model):
        if to_fast and type(stack) in MODEL_CLASSES:
            stack.__class__ = MODEL_CLASSES[type(stack)]  # same object: only __call__ changes
            swapped["layer_stack"] = swapped.get("layer_stack", 0) + 1
        elif not to_fast and type(stack) in stock_models:
            stack.__class__ = stock_models[type(stack)]
            swapped["layer_stack"] = swapped.get("layer_stack", 0) + 1
    stock_heads = {fast: stock for stock, fast in HEAD_CLASSES.items()}
    for head in _heads(model):
        if to_fast and type(head) in HEAD_CLASSES:
            head.__class__ = HEAD_CLASSES[type(head)]  # same object, same arrays: only __call__ changes
            swapped["lm_head"] = swapped.get("lm_head", 0) + 1
        elif not to_fast and type(head) in stock_heads:
            head.__class__ = stock_heads[type(head)]
            swapped["lm_head"] = swapped.get("lm_head", 0) + 1
    return {k: v for k, v in swapped.items() if v}


def _heads(model: nn.Module) -> List[nn.Module]:
    """The language-model heads of ``model`` (mlx-lm's ``TextModel.lm_head``:
    on the model itself or on its ``language_model``); none where the
    embeddings are tied."""
    found = []
    for m in (model, getattr(model, "language_model", None)):
        head = getattr(m, "lm_head", None) if isinstance(m, nn.Module) else None
        if isinstance(head, nn.Module) and not any(head is f for f in found):
            found.append(head)
    return found


def _layer_stacks(model: nn.Module) -> List[nn.Module]:
    """The model's layer stacks (mlx-lm's ``Qwen3_5TextModel``, stock or
    fast): the model itself, or its ``model`` (``Model.model`` is
    ``language_model.model``)."""
    classes = tuple(MODEL_CLASSES) + tuple(MODEL_CLASSES.values())
    found = []
    for m in (model, getattr(model, "model", None), getattr(getattr(model, "language_model", None), "model", None)):
        if isinstance(m, classes) and not any(m is f for f in found):
            found.append(m)
    return found


def patch(model: nn.Module, *, warn: bool = True) -> PatchReport:
    """Swap the fast-path modules into a loaded mlx-lm Qwen3.5/3.6 model, in place.

    Swaps every Gated DeltaNet (``linear_attn``), sparse-MoE (``mlp``) and
    gated-attention (``self_attn``) module for its fast subclass in
    :mod:`mlx_qwen_fast.layers`, sharing the loaded (quantised) arrays under
    the same parameter paths. Dense MLPs stay as they are. Patching an
    already patched model swaps nothing more; its decisions below are made
    again from the modules as they are then, and ``model.patch_report``
    stays the first patch's unless they changed.

    Each fast module's op family then decides, from the module's own
    weights (bits, group size, mode, dtypes of scales and biases), which of
    its kernels may run for it; an op whose kernels do not read them runs
    stock in that layer (``report.declined`` says which, why and where).

    Args:
        model: a model from ``mlx_lm.load`` (``qwen3_5_moe`` or ``qwen3_5``).
        warn: emit one ``UserWarning`` when the model is left stock, and one
            per op and reason where this backend's kernels declined the
            weights' quantisation.

    Returns:
        A :class:`PatchReport`, also kept as ``model.patch_report``. If the
        model type or a layer's shape is not supported, the model is
        tensor-parallel sharded (``model.shard`` with a group of more than
        one process) or pipelined (``model.model.pipeline``), or the
        environment sets ``MLX_QWEN_FAST=0`` (see :func:`enabled`), nothing
        is changed, ``report.patched`` is False and ``report.reason`` says
        why. A model patched and then sharded or pipelined is put back to
        its stock modules by the next patch (the fast modules issue none of
        mlx-lm's collectives).

    Raises:
        TypeError: ``model`` is not an ``mlx.nn.Module`` (e.g. a path, or the
            ``(model, tokenizer)`` pair ``mlx_lm.load`` returns).
    """
    _check_module("patch", model)
    return _patch(model, warn, stacklevel=3)


def _patch(model: nn.Module, warn: bool, stacklevel: int) -> PatchReport:
    """:func:`patch` of a checked module; ``stacklevel`` puts the warning at
    the public function's caller (``warnings.warn`` counts from here)."""
    reason = _unsupported_reason(model)
    if reason is None and not enabled():
        reason = f"disabled by the environment ({_off_setting()})"
    if reason is not None:
        if warn:
            warnings.warn(f"mlx_qwen_fast: model left on the stock path: {reason}", stacklevel=stacklevel)
        report = PatchReport(False, reason, _model_type(model), backend.current())
        if is_patched(model) and _distributed_reason(model) is not None:
            # patched, then sharded or pipelined: the fast modules would skip the
            # collectives, so the model goes back to stock (rebind keeps what
            # shard()/pipeline() set on the modules)
            _swap(model, to_fast=False)
        if not is_patched(model):
            _set_report(model, report)
        return report
    swapped = _swap(model, to_fast=True)
    speculative.install()  # mlx-lm's speculative decoding: the patched caches roll back
    generation.install()  # mlx-lm's generate_step: the KV buffers sized for the whole generation
    previous = getattr(model, "patch_report", None)
    ops = op_table(backend.current(), model)
    declined = apply_declines(ops, _decide_kernels(model))
    if warn:
        warn_declined(declined)
    declined = declined_text(declined)
    report = PatchReport(
        True,
        None,
        _model_type(model),
        backend.current(),
        swapped,
        ops,
        config.process_settings_report(backend.current()),
        declined,
    )
    same = (isinstance(previous, PatchReport) and previous.patched and is_patched(model)
            and (previous.ops, previous.declined) == (ops, declined))
    if swapped or not same:
        _set_report(model, report)  # a second patch that swaps and decides nothing new keeps the first's
    return report


def _set_report(model: nn.Module, report: PatchReport) -> None:
    """Keep ``report`` as ``model.patch_report`` (a plain attribute, not a parameter)."""
    object.__setattr__(model, "patch_report", report)


def _check_module(fn: str, model) -> None:
    if isinstance(model, nn.Module):
        return
    hint = ""
    if isinstance(model, tuple) and model and isinstance(model[0], nn.Module):
        hint = " (mlx_lm.load returns (model, tokenizer): pass the model)"
    raise TypeError(
        f"{fn} expects a loaded mlx-lm model (mlx.nn.Module), got {type(model).__name__}{hint}"
    )


def unpatch(model: nn.Module) -> Dict[str, int]:
    """Restore the stock mlx-lm modules (same arrays); returns counts per slot.
    ``model.patch_report`` then says the model is stock.

    Raises:
        TypeError: ``model`` is not an ``mlx.nn.Module``.
    """
    _check_module("unpatch", model)
    swapped = _swap(model, to_fast=False) if hasattr(model, "layers") else {}
    _set_report(model, PatchReport(False, "unpatched by mlx_qwen_fast.unpatch", _model_type(model),
                                   backend.current()))
    return swapped


def is_patched(model: nn.Module) -> bool:
    """True if any layer of ``model`` holds a fast-path module.

    Raises:
        TypeError: ``model`` is not an ``mlx.nn.Module``.
    """
    _check_module("is_patched", model)
    fast = tuple(FAST_CLASSES.values())
    return any(
        isinstance(getattr(layer, slot, None), fast)
        for layer in getattr(model, "layers", [])
        for slot in _SLOTS
    )


def clone_modules(value):
    """A copy of a module tree (new Module/list/dict containers) whose leaf
    arrays are the same objects: no array is copied, and updating the copy's
    parameters (``set_dtype``, patching) leaves the original untouched."""
    if isinstance(value, nn.Module):
        new = value.__class__.__new__(value.__class__)
        new.__dict__.update(value.__dict__)
        for k, v in value.items():
            dict.__setitem__(new, k, clone_modules(v))
        return new
    if isinstance(value, list):
        return [clone_modules(v) for v in value]
    if isinstance(value, dict):
        return {k: clone_modules(v) for k, v in value.items()}
    return value


def patched_copy(model: nn.Module, *, warn: bool = True):
    """A patched twin of ``model`` that shares all its weight arrays.

    The module tree is copied (cheap: no array is copied), then patched;
    ``model`` itself stays stock. Used for A/B runs in one process.

    Returns:
        ``(fast_model, report)``.

    Raises:
        TypeError: ``model`` is not an ``mlx.nn.Module``.
    """
    _check_module("patched_copy", model)
    twin = clone_modules(model)
    return twin, _patch(twin, warn, stacklevel=3)


def enabled() -> bool:
    """False when the environment sets ``MLX_QWEN_FAST`` to 0, false, no or off
    (any case; :data:`mlx_qwen_fast.config.FAST_PATH`): then :func:`patch`
    (and so :func:`install`, the CLIs, the demo and ``patched_copy``) leaves
    every model stock. Every switch is read here, so that a value not
    understood is warned about on any backend (:func:`config.check_all`)."""
    config.check_all()
    return config.FAST_PATH.get()


def _off_setting() -> str:
    return f"{config.FAST_PATH.name}={config.raw_value(config.FAST_PATH)}"


def _installed(fn) -> Optional[object]:
    """The wrapper :func:`install` put in place, where ``fn`` is it or a
    wrapper of it made with ``functools.wraps`` (which copies its
    attributes), else None."""
    ours = getattr(fn, "_mlx_qwen_fast", None)
    return ours if getattr(ours, "_mlx_qwen_fast", None) is ours else None


def install(*, verbose: bool = False, after_load: Optional[Callable[[], object]] = None) -> bool:
    """Make every ``mlx_lm.load`` return a patched model.

    Wraps ``mlx_lm.utils.load_model`` (which ``mlx_lm.load``, ``sharded_load``
    and so ``generate``, ``benchmark``, ``chat`` and ``server`` all call).
    Inside ``sharded_load`` the wrapper leaves the model stock, since
    sharded_load shards or pipelines it afterwards; ``sharded_load`` itself
    (``mlx_lm.utils``'s and the name in loaded mlx-lm modules) is wrapped to
    patch the model it returns, which declines a group of more than one
    process (see :func:`patch`).
    Other model types pass through untouched (no warning), and so does a
    model that its class already patched (model type ``qwen3_5_moe_fast``:
    its own report is kept). Idempotent: a second call wraps nothing more;
    it only switches ``verbose`` on where it asks for it, and turns back on
    a wrapper that :func:`uninstall` could not remove.
    ``verbose``: print each load's :class:`PatchReport` to stderr (a model
    left stock is then said by that line, without :func:`patch`'s warning),
    one line for a model type without a fast path, and, when the environment
    switches the fast path off, one line saying so. A supported model's
    first (not lazy) load on a CUDA machine compiles MLX's slow modules in
    worker processes before it returns, saying so in two lines
    (:mod:`mlx_qwen_fast.mlx_compiles`; once per machine and model
    configuration; the CLIs start them earlier instead). ``after_load``: called
    once, after the next load has read its model and before it is patched
    (the CLIs wait there for the MLX compiles they started,
    :mod:`mlx_qwen_fast.mlx_compiles`).
    Returns False (and installs nothing) when ``MLX_QWEN_FAST=0``.
    """
    if not enabled():
        if verbose:
            print(f"mlx_qwen_fast: the fast path is off ({_off_setting()} in the environment): running stock mlx-lm",
                  file=sys.stderr)
        return False
    current = mlx_lm.utils.load_model
    ours = _installed(current)
    if ours is not None:
        ours._active = True
        ours._verbose = ours._verbose or verbose
        if after_load is not None:
            ours._after_load.append(after_load)
        _put_sharded_load(ours._sharded_load)
        return True

    @functools.wraps(current)
    def load_model(*args, **kwargs):
        model, model_config = current(*args, **kwargs)
        hooked = bool(load_model._after_load)
        while load_model._after_load:
            load_model._after_load.pop(0)()
        if not load_model._active or not enabled():
            return model, model_config
        if sys._getframe(1).f_code is _SHARDED_LOAD.__code__:
            return model, model_config  # sharded_load shards it next: patched (or declined) after that
        lazy = kwargs.get("lazy", args[1] if len(args) > 1 else False)
        if not hooked and not lazy and _model_type(model) in SUPPORTED_MODEL_TYPES:
            _compile_ahead(args[0] if args else kwargs.get("model_path"))
        _patch_loaded(model)
        return model, model_config

    def _patch_loaded(model):
        model_type = _model_type(model)
        if model_type in SUPPORTED_MODEL_TYPES:
            # a model its class patched (qwen3_5_moe_fast) keeps the report of that patch
            report = getattr(model, "patch_report", None) if is_patched(model) else None
            if report is None:
                report = patch(model, warn=not load_model._verbose)  # verbose: the report's line says it
            if load_model._verbose:
                print(report, file=sys.stderr)
        elif load_model._verbose:
            print(f"mlx_qwen_fast: model_type {model_type!r} has no fast path (supported: "
                  f"{', '.join(SUPPORTED_MODEL_TYPES)}): running stock mlx-lm", file=sys.stderr)

    @functools.wraps(_SHARDED_LOAD)
    def sharded_load(*args, **kwargs):
        out = _SHARDED_LOAD(*args, **kwargs)
        if load_model._active and enabled():
            _patch_loaded(out[0])  # sharded or pipelined by now: patch declines a group of more than one
        return out

    # set after functools.wraps, which copies the attributes of the function it wraps
    load_model._mlx_qwen_fast = load_model
    load_model._wrapped = current
    load_model._active = True
    load_model._verbose = verbose
    load_model._after_load = [] if after_load is None else [after_load]
    load_model._sharded_load = sharded_load
    mlx_lm.utils.load_model = load_model
    _put_sharded_load(sharded_load)
    return True


def _compile_ahead(model_path) -> None:
    """A model's first use on a CUDA machine through ``mlx_lm.load`` (a
    user's script; the CLIs start the workers before loading, through
    ``after_load``): compile MLX's slow modules in worker processes now,
    before the first forward would compile them one after another
    (:mod:`mlx_qwen_fast.mlx_compiles`, with
    :data:`mlx_qwen_fast.config.MLX_COMPILES_AHEAD` on), saying so on
    stderr. Nothing where :func:`mlx_qwen_fast.mlx_compiles.start` finds
    nothing to do."""
    if model_path is None or not config.MLX_COMPILES_AHEAD.get():
        return
    from . import mlx_compiles

    ahead = mlx_compiles.start(model_path)
    if ahead is None:
        return
    print(mlx_compiles.started_line(ahead, while_loading=False), file=sys.stderr)
    print(mlx_compiles.done_line(ahead.wait()), file=sys.stderr)


def _put_sharded_load(fn) -> None:
    """Make ``fn`` the ``sharded_load`` of ``mlx_lm.utils`` and of every loaded
    mlx-lm module that imported mlx-lm's own by name (chat, server,
    benchmark, dwq); where one holds another function, it stays. A module
    imported later binds ``mlx_lm.utils``'s, which is ``fn``; one that bound
    mlx-lm's before still loads stock (install's load_model does not patch
    inside sharded_load)."""
    replaced = (_SHARDED_LOAD, mlx_lm.utils.sharded_load)
    for name, module in list(sys.modules.items()):
        if (name == "mlx_lm" or name.startswith("mlx_lm.")) and module is not None:
            if any(getattr(module, "sharded_load", None) is f for f in replaced):
                module.sharded_load = fn


def uninstall() -> None:
    """Undo :func:`install`: ``mlx_lm.utils.load_model`` is the function
    install wrapped again. Where another wrapper has since been put around
    install's (``mlx_lm.utils.load_model`` is not install's own), that one
    stays and install's passes every model through untouched. Already
    loaded models stay as they are."""
    current = mlx_lm.utils.load_model
    ours = _installed(current)
    if ours is None:
        return
    ours._active = False
    if current is ours:
        mlx_lm.utils.load_model = ours._wrapped
    if mlx_lm.utils.sharded_load is ours._sharded_load:
        _put_sharded_load(_SHARDED_LOAD)
