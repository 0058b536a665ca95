"""mlx-lm's token generator on a patched model: the KV buffers sized once.

mlx-lm's ``generate_step`` (behind ``generate``, ``stream_generate``, the
``generate`` CLI, ``benchmark`` and the server's single-request path) knows
before its first token how many positions its prompt cache will hold: the
cache's offset, plus the prompt, plus ``max_tokens``. The patched decode
step (:mod:`mlx_qwen_fast.ops.decoder`) is one compiled call whose trace
depends on the attention layers' KV buffer capacity, so a buffer that grows
mid-generation costs a whole-stack trace on that token (110-135 ms against
~6-8 ms for its neighbours on an H100: the ``--boundary`` rows of
bench/results/INDEX.md).

:func:`install` makes ``mlx_lm.generate.generate_step`` (looked up there at
each call by ``stream_generate``) a wrapper that hands that number to
:func:`mlx_qwen_fast.ops.kv_buffers.reserve_kv` for a patched model before
mlx-lm's generator starts: the first decode token sizes the buffers for the
whole generation, and no later token traces again. Tokens, logits and the
cache's contents are what mlx-lm's generator gives (``KVCache`` reads and
trims from its offset at any capacity). A stock model, a ``max_tokens`` of
-1 (endless) or a cache without plain ``KVCache`` entries (a
``RotatingKVCache`` of ``max_kv_size``, a quantised cache) pass through
unchanged.
"""

from __future__ import annotations

import functools
import importlib

__all__ = ["install", "stock_generate_step"]


def _positions(prompt, prompt_cache, max_tokens, input_embeddings) -> int:
    """Positions the cache holds after the generator's last token: its
    offset now, the prompt (or its embeddings), ``max_tokens``."""
    n = len(input_embeddings) if input_embeddings is not None else len(prompt)
    offset = max((getattr(c, "offset", 0) for c in prompt_cache if type(getattr(c, "offset", 0)) is int),
                 default=0)
    return offset + n + max_tokens


def _wrap(stock):
    """``generate_step`` around mlx-lm's ``stock``: the same generator, the
    prompt cache's KV buffers reserved for the generation first."""
    from mlx_lm.models.cache import make_prompt_cache

    from . import patching
    from .ops import kv_buffers

    @functools.wraps(stock)
    def generate_step(prompt, model, *args, **kwargs):
        max_tokens = kwargs.get("max_tokens", 256)  # mlx-lm's default
        if (type(max_tokens) is int and max_tokens >= 0 and getattr(model, "layers", None) is not None
                and patching.is_patched(model)):
            cache = kwargs.get("prompt_cache")
            if cache is None:  # what the stock function makes itself
                cache = kwargs["prompt_cache"] = make_prompt_cache(model, max_kv_size=kwargs.get("max_kv_size"))
            kv_buffers.reserve_kv(cache, _positions(prompt, cache, max_tokens, kwargs.get("input_embeddings")))
        yield from stock(prompt, model, *args, **kwargs)

    generate_step._mqf_stock = stock
    return generate_step


def install() -> None:
    """Make ``mlx_lm.generate.generate_step`` the reserving wrapper (see the
    module docstring). Idempotent; :func:`mlx_qwen_fast.patch` calls it."""
    module = importlib.import_module("mlx_lm.generate")  # the module: mlx_lm.generate is also a function
    current = module.generate_step
    if getattr(current, "_mqf_stock", None) is None:
        module.generate_step = _wrap(current)


def stock_generate_step():
    """mlx-lm's own ``generate_step`` (the function :func:`install` wraps)."""
    current = importlib.import_module("mlx_lm.generate").generate_step
    return getattr(current, "_mqf_stock", current)
