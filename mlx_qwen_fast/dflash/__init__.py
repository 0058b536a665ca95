"""DFlash block-diffusion speculative decoding for the patched Qwen3.5/3.6 models.

A DFlash drafter (DFlash, arXiv 2602.06036; checkpoints in z-lab's layout,
e.g. z-lab/Qwen3.6-35B-A3B-DFlash) drafts a whole block of tokens in one
forward from the target's hidden states; the target verifies the block in
one forward, which also gives the hidden states for the next draft.

Python::

    import mlx_lm, mlx_qwen_fast
    from mlx_qwen_fast import dflash
    model, tokenizer = mlx_lm.load(TARGET)      # after mlx_qwen_fast.install()
    drafter = dflash.load_drafter(DRAFTER_DIR)
    text = dflash.generate(model, tokenizer, prompt, drafter, max_tokens=256)
    # or dflash.stream_generate(...), dflash.dflash_generate_step(...), or
    # mlx_lm.generate(model, tokenizer, prompt, draft_model=drafter)

Modules: :mod:`.drafter` (the drafter model and its loader),
:mod:`.capture` (the target's forward that returns the hidden states of
the drafter's target layers), :mod:`.loop` (the generation loop and the
entry points), :mod:`.presets` (random-weight drafter checkpoints).
Importing this package imports mlx-lm (through :mod:`mlx_qwen_fast.speculative`).
"""

from .drafter import DFlashDrafter, DrafterArgs, load_drafter
from .loop import DFlashStats, dflash_generate_step, generate, stream_generate

__all__ = ["DFlashDrafter", "DFlashStats", "DrafterArgs", "dflash_generate_step", "generate", "load_drafter",
           "stream_generate"]
