"""DFlash block-diffusion speculative decoding for the patched Qwen3.5/3.6 models.

A DFlash drafter (DFlash, arXiv 2602.06036; checkpoints in z-lab's layout,
e.g. z-lab/Qwen3.6-35B-A3B-DFlash) drafts a whole block of tokens in one
forward from the target's hidden states; the target verifies the block in
one forward, which also gives the hidden states for the next draft.

Python::

    import mlx_lm, mlx_qwen_fast
    from mlx_qwen_fast import dflash
    mlx_qwen_fast.install()
    model, tokenizer = mlx_lm.load(TARGET)
    drafter = dflash.load_drafter(DRAFTER_DIR)
    text = dflash.generate(model, tokenizer, prompt, drafter, max_tokens=256)
    # or dflash.stream_generate(...), dflash.dflash_generate_step(...), or
    # mlx_lm.generate(model, tokenizer, prompt, draft_model=drafter)

Command line: ``python -m mlx_qwen_fast.generate --model TARGET
--dflash-drafter DIR ...``; a random-weight drafter folder:
``python -m mlx_qwen_fast.checkpoint --preset tiny-dflash --out DIR``.

Modules: :mod:`.drafter` (the drafter model and its loader),
:mod:`.capture` (the target's forward that returns the hidden states of
the drafter's target layers), :mod:`.loop` (the generation loop and the
entry points), :mod:`.presets` (random-weight drafter checkpoints),
:mod:`.cli` (the ``--dflash-drafter`` flag). Importing the package is
light; its names load their module (and mlx-lm) on first use.
"""

import importlib

#: public name -> the submodule that defines it
_NAMES = {
    "DFlashDrafter": "drafter", "DrafterArgs": "drafter", "load_drafter": "drafter",
    "DFlashStats": "loop", "dflash_generate_step": "loop", "generate": "loop", "stream_generate": "loop",
}

__all__ = sorted(_NAMES)


def __getattr__(name):
    # PEP 562: a public name imports its module on first access
    if name in _NAMES:
        value = getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
