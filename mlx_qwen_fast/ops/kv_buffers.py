"""The KV cache buffers of the compiled decode and verify steps.

A compiled step takes a plain ``KVCache``'s buffers (``[B, Hkv, capacity,
Dh]``) as inputs and writes the new rows at the offset in place, so the
room must exist before the call (:func:`make_room`, as mlx-lm 0.32.2's
``KVCache.update_and_fetch`` makes it) and the step traces again for every
new capacity: the buffers grow in steps of :data:`KV_GROWTH` positions
(mlx-lm grows by 256), or once to a reservation (:func:`reserve_kv`) that
covers a whole generation. mlx-lm's own calls take any capacity
(``update_and_fetch``, ``trim`` and the attention work from the offset).
"""

from __future__ import annotations

import mlx.core as mx

from ._checks import check_int

__all__ = ["KV_GROWTH", "KV_RESERVE_MAX", "kv_cache_type", "make_room", "reserve_kv"]


def kv_cache_type():
    """mlx-lm's plain ``KVCache`` class (imported at the first call: the
    package imports mlx-lm lazily)."""
    from mlx_lm.models.cache import KVCache

    return KVCache



#: Positions a KV buffer grows to a multiple of when the decode step needs
#: room (mlx-lm grows by ``KVCache.step``, 256). The compiled step traces
#: again for every new buffer shape (a whole-stack trace: one slow token,
#: bench.decode_split --boundary), so growing in larger steps makes that
#: token 16 times rarer, for at most 4095 spare positions per attention
#: layer (20 KB a position at the reference model's 2 KV heads of 256 in
#: bf16: 80 MB over its 10 layers at batch 1).
KV_GROWTH = 4096

#: Most positions past a cache's offset that a reservation
#: (:func:`reserve_kv`) adds at once: 32768 positions are ~650 MB over the
#: reference model's 10 attention layers at batch 1 (20 KB a position).
KV_RESERVE_MAX = 32768

_RESERVE_ATTR = "_mqf_kv_reserve"  # a KVCache's reserved capacity (positions), set by reserve_kv


def _grow(cache, want: int, dtype) -> None:
    """Grow ``cache``'s buffers (``[B, Hkv, capacity, Dh]``, capacity <
    ``want``) to the next multiple of ``max(KV_GROWTH, cache.step)``
    positions at or above ``want``, as ``KVCache.update_and_fetch`` (mlx-lm
    0.32.2) grows them: cut to the offset where the buffer is not full,
    extended with zero rows of ``dtype``."""
    prev, keys = cache.offset, cache.keys
    growth = max(KV_GROWTH, cache.step)
    extra = -(-want // growth) * growth - prev
    B, hkv, _, dh = keys.shape
    new_k = mx.zeros((B, hkv, extra, dh), dtype)
    new_v = mx.zeros((B, hkv, extra, cache.values.shape[3]), dtype)
    if keys.shape[2] != prev:
        cache.keys, cache.values = cache.keys[..., :prev, :], cache.values[..., :prev, :]
    cache.keys = mx.concatenate([cache.keys, new_k], axis=2)
    cache.values = mx.concatenate([cache.values, new_v], axis=2)


def _wanted(cache, n: int = 1) -> int:
    """The capacity a compiled step wants of a KV cache now: ``n`` more
    positions (1 for a decode step), or its reservation (at most
    :data:`KV_RESERVE_MAX` past that)."""
    want = cache.offset + n
    reserved = cache.__dict__.get(_RESERVE_ATTR)
    if type(reserved) is int and reserved > want:
        want = min(reserved, want + KV_RESERVE_MAX)
    return want


def reserve_kv(prompt_cache, positions: int) -> int:
    """Tell the decode step how many positions the plain ``KVCache``
    entries of ``prompt_cache`` will hold, so that it sizes their buffers
    once instead of growing them as the tokens come: the compiled whole-
    stack step traces again for every new buffer shape (a slow token; see
    :data:`KV_GROWTH`), and a buffer sized for the whole generation never
    changes shape within it.

    A cache with buffers grows now (to the next multiple of
    ``max(KV_GROWTH, step)`` at or above ``positions``, at most
    :data:`KV_RESERVE_MAX` past its offset); an empty one keeps the
    number, which the decode step honours when it first plans for it (a
    prefill through mlx-lm's ``update_and_fetch`` still grows it by
    ``step`` as stock does). Other entries (``ArraysCache``,
    ``RotatingKVCache``, quantised caches, ``None``) are left alone.
    mlx-lm's own calls take any capacity (``update_and_fetch``, ``trim``
    and the attention work from the offset; ``state``, and so a saved
    prompt cache, holds the whole buffer).

    Args:
        prompt_cache: a list of mlx-lm cache objects (one per layer).
        positions: the total positions (offset included) the caches will
            hold, e.g. ``offset + prompt tokens + max_tokens``.

    Returns:
        The number of ``KVCache`` entries the reservation applies to.

    Raises:
        ValueError: ``positions`` not an int >= 0, or ``prompt_cache`` not a
            list or tuple.
    """
    if type(positions) is not int or positions < 0:
        raise ValueError(f"reserve_kv: positions must be an int >= 0, got {positions!r}")
    if not isinstance(prompt_cache, (list, tuple)):
        raise ValueError(f"reserve_kv: prompt_cache must be a list of mlx-lm caches, got "
                         f"{type(prompt_cache).__name__}")
    kv_type, n = kv_cache_type(), 0
    for c in prompt_cache:
        if type(c) is not kv_type:
            continue
        c.__dict__[_RESERVE_ATTR] = positions
        n += 1
        k, v = c.keys, c.values
        if isinstance(k, mx.array) and isinstance(v, mx.array) and k.ndim == 4 and v.ndim == 4:
            want = _wanted(c)
            if want > k.shape[2]:
                _grow(c, want, k.dtype)
    return n


def make_room(cache, x_dtype, B: int, hkv: int, dh: int, n: int = 1) -> bool:
    """Make room for ``n`` more positions in a plain ``KVCache`` (and for its
    reservation, :func:`reserve_kv`) as ``KVCache.update_and_fetch``
    (mlx-lm 0.32.2) does, in larger steps (:func:`_grow`): new rows of the
    new rows' dtype, ``x_dtype``, so that a cache of another dtype is
    promoted as stock promotes it. False (nothing changed) where the
    buffers do not match the step's batch, heads or head size. Raises
    ValueError where ``n`` is not an int >= 0."""
    if type(n) is not int or n < 0:
        check_int("make_room", "n", n, 0)
    keys = cache.keys
    if keys is None or keys.ndim != 4 or tuple(keys.shape[:2]) != (B, hkv) or keys.shape[3] != dh:
        return False
    if cache.values is None or tuple(cache.values.shape) != tuple(keys.shape):
        return False
    want = _wanted(cache, n)
    if want > keys.shape[2]:
        _grow(cache, want, x_dtype)
    return True
