"""The server's prompt cache for speculative decoding on a hybrid model:
a new request resumes from the end of an earlier request's prompt.

mlx-lm's server keeps the caches of earlier requests in an
``LRUPromptCache`` keyed by their tokens (prompt and generated) and starts
a new request from the entry that shares the longest prefix with it -- but
only if it can trim that entry back to the shared prefix
(``can_trim_prompt_cache``), or if the entry is a prefix of the new prompt.
A Gated DeltaNet state cannot be trimmed, so a hybrid model's entry is
reused only by a prompt that extends it exactly. The batched path (plain
decoding) also stores a cache at the end of each prompt segment, one token
before the prompt's end; the one-request-at-a-time path that
``--draft-model`` and ``--dflash-drafter`` take stores only the final one.
A chat whose client resends a previous answer edited, re-rendered or cut
(the usual case: thinking removed, whitespace changed) then recomputes its
whole prompt each turn.

Here each speculative generation records a **checkpoint** at its prompt's
end on every cache entry (:func:`record`): the position q, and for a Gated
DeltaNet entry the conv and recurrent state there (references to arrays
that exist anyway: the recording caches of
:mod:`mlx_qwen_fast.speculative` or the state after the DFlash prefill).
:class:`CheckpointPromptCache` (the server's LRU class once
:func:`install` ran) starts a request from such an entry when its
checkpoint lies within the shared prefix and beyond what mlx-lm would
reuse: the Gated DeltaNet states are put back to the checkpoint's and the
KV caches trimmed to q (their rows before q never change after it).

Memory: one checkpoint per cached entry, per Gated DeltaNet layer its
recurrent state (``Hv * Dv * Dk`` fp32: 2 MiB at Qwen3.6's shape) and conv
state, ~61 MiB for Qwen3.6's 30 such layers; not counted in the LRU's byte
total (``--prompt-cache-bytes``), which counts the entry's own arrays.
"""

from __future__ import annotations

import copy
from typing import Any, List, Optional, Sequence

from mlx_lm.models.cache import ArraysCache, LRUPromptCache, can_trim_prompt_cache

__all__ = ["CheckpointPromptCache", "checkpoint_position", "install", "record", "restore"]

_ATTR = "_mqf_prompt_checkpoint"  # on a cache entry: (q,) or (q, conv state, recurrent state)


def _kv_offset(cache: Sequence[Any]) -> Optional[int]:
    """The offset of the first entry of ``cache`` that has one (a KV cache)."""
    for c in cache:
        offset = getattr(c, "offset", None)
        if isinstance(offset, int):
            return offset
    return None


def record(cache: Sequence[Any], q: int) -> bool:
    """Record on every entry of ``cache`` (one model's prompt cache) its
    state at position ``q``, where the model has read positions up to
    ``offset - 1`` (``offset``: its KV caches' common offset, >= q).

    A KV entry records q alone. A Gated DeltaNet entry (an ``ArraysCache``)
    records its states: the current ones where ``offset == q``; else, for a
    recording cache (:class:`mlx_qwen_fast.speculative.RollbackArraysCache`)
    that reaches back to q, its states there (``state_at``).

    Args:
        cache: the entries of one model (target or draft), one per layer.
        q: the position to record (tokens read before it), >= 0.

    Returns:
        True if every entry recorded; False (and no entry keeps a
        checkpoint) where one cannot: no KV entry to read the offset from,
        KV offsets that differ or are below q, a Gated DeltaNet state from
        before q no longer held, another entry type.
    """
    offset = _kv_offset(cache)
    marks: List[tuple] = []
    ok = offset is not None and 0 <= q <= offset
    for c in cache if ok else ():
        if isinstance(c, ArraysCache):
            if c.lengths is not None or c.left_padding is not None:
                ok = False
            elif offset == q:
                marks.append((q, c[0], c[1]))
            else:
                back = offset - q
                if not callable(getattr(c, "state_at", None)) or back > c.recorded():
                    ok = False
                else:
                    marks.append((q, *c.state_at(back)))
        elif getattr(c, "offset", None) == offset and c.is_trimmable():
            marks.append((q,))
        else:
            ok = False
        if not ok:
            break
    for c in cache:
        if ok:
            setattr(c, _ATTR, marks.pop(0))
        else:
            c.__dict__.pop(_ATTR, None)
    return ok


def checkpoint_position(cache: Sequence[Any]) -> Optional[int]:
    """The position q of the checkpoint every entry of ``cache`` holds (the
    same q in all), or None."""
    qs = {getattr(c, _ATTR, (None,))[0] for c in cache}
    if len(qs) != 1 or None in qs or not cache:
        return None
    return qs.pop()


def restore(cache: Sequence[Any]) -> Optional[List[Any]]:
    """``cache`` put back to its checkpoint, in place (the caller passes a
    copy): Gated DeltaNet entries get the recorded states, KV entries are
    trimmed to q; the checkpoints are removed. None (``cache`` unchanged)
    where :func:`checkpoint_position` is None or a KV entry cannot be
    trimmed back to q."""
    q = checkpoint_position(cache)
    if q is None:
        return None
    for c in cache:
        if not isinstance(c, ArraysCache) and (not c.is_trimmable() or c.offset < q):
            return None
    for c in cache:
        mark = c.__dict__.pop(_ATTR)
        if isinstance(c, ArraysCache):
            c[0], c[1] = mark[1], mark[2]
        else:
            c.trim(c.offset - q)
    return list(cache)


class CheckpointPromptCache(LRUPromptCache):
    """mlx-lm's ``LRUPromptCache`` that also starts a request from a
    checkpoint (see the module docstring): where mlx-lm would reuse fewer
    tokens -- no entry equal to the tokens, the entry that shares the longest
    prefix cannot be trimmed --, that entry's checkpoint at q, if every
    entry holds one with ``shorter < q <= min(len(tokens) - 1, shared
    prefix)`` (``shorter``: the longest stored prefix of the tokens), gives
    a copy of the entry at q and the tokens from q on. Everything else is
    mlx-lm's."""

    def fetch_nearest_cache(self, model: Any, tokens: List[int]):
        result = self._trie.search(model, tokens)
        if result.exact is None and result.longer is not None:
            entry = self._trie.get(result.model, result.longer)
            if not can_trim_prompt_cache(entry.prompt_cache):
                short = len(result.shorter) if result.shorter is not None else 0
                q = checkpoint_position(entry.prompt_cache)
                if q is not None and short < q <= min(len(tokens) - 1, result.common_prefix):
                    cache = restore(copy.deepcopy(entry.prompt_cache))
                    if cache is not None:
                        return cache, tokens[q:]
        return super().fetch_nearest_cache(model, tokens)


def install(server_module) -> None:
    """Make ``server_module`` (``mlx_lm.server``) keep its prompt cache in a
    :class:`CheckpointPromptCache` (``run`` makes it from the module's
    ``LRUPromptCache`` name). Idempotent."""
    server_module.LRUPromptCache = CheckpointPromptCache
