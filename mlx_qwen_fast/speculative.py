"""Speculative decoding on the patched model: Gated DeltaNet caches that roll back.

mlx-lm's speculative decoding (``mlx_lm.generate.speculative_generate_step``,
behind ``generate`` / ``stream_generate(..., draft_model=...)``, the
``--draft-model`` flag of ``mlx_lm.generate`` and ``mlx_lm.server``) runs
the target model over the last token plus K draft tokens in one call (the
verify), then removes the rejected tokens from every cache with
``trim_prompt_cache(cache, n)``; the draft model's cache is trimmed the same
way after its K one-token calls. It refuses a model whose caches are not all
trimmable (``can_trim_prompt_cache``), and mlx-lm's ``ArraysCache`` -- the
Gated DeltaNet layers' conv state and recurrent state -- is not: a recurrent
state cannot be un-applied.

Here the state is not un-applied but kept: while a speculative loop runs,
each Gated DeltaNet cache of a patched model is a :class:`RollbackArraysCache`
(the same object, its class swapped) that records its calls over its last
``max_steps`` tokens (the states before each call, and for a call of
several tokens on a GPU its input), and ``trim(n)`` puts back the states
from n tokens ago. The attention layers'
``KVCache`` is trimmed by mlx-lm as it always is (its offset moves back).
``max_steps`` is ``num_draft_tokens + 1``, the most tokens one verify adds
(and the most a draft round adds), so every trim mlx-lm asks for is
recorded.

Which call records what (a **segment** per call: the states before it,
and for a call of several tokens the layer's input, to replay a prefix):

* one token (the draft's steps): the layer runs as it always does (any
  backend's decode path); the segment is the previous state, kept alive
  instead of freed: no computation;
* 2 .. ``max_steps`` tokens (the verify, a draft step over two tokens), on
  a GPU (:data:`REPLAY_BACKENDS`): the layer runs as it always does too
  (on CUDA the fused prefill kernels, whole); the segment keeps the states
  before the call and the layer's input ``[B, T, D]``. A trim that ends
  inside such a call puts the states from before it back and replays the
  kept tokens through the layer's own call (:meth:`RollbackArraysCache.trim`):
  the recurrence costs only where drafts were rejected, and the verify
  runs at the speed of any S-token forward (recording every token's states
  instead costs ~10 graph nodes per token and layer: host time). On the
  CPU the call runs the recurrence token by token in fp32
  (:func:`mlx_qwen_fast.ops.gated_delta.gated_delta_net_steps`, the
  reference of record) and records one segment per token, so that a verify
  trimmed to any accepted length is bit for bit sequential decoding;
* more than ``max_steps`` tokens (a prompt's prefill), a padding mask, or a
  cache with per-row lengths: the layer runs as it always does and the
  recorded segments are dropped, so a trim reaching back past that call
  raises.

Memory, per Gated DeltaNet layer and batch row: one snapshot of the
recurrent state (``Hv * Dv * Dk`` fp32: 2 MiB at Qwen3.6's Hv = 32, Dv = Dk
= 128) and of the conv state (``3 * conv_dim`` in the activation dtype, 48
KiB in bf16) per recorded call, at most ``max_steps`` of them (one-token
calls: the draft's steps) and usually one or two (a verify); the verify's
input, ``T * D`` in the activation dtype. For Qwen3.6's 30 such layers about
61 MiB per recorded call.

Plain decoding and prefill pay nothing: a cache is a
:class:`RollbackArraysCache` only inside :func:`rollback` (which
:func:`install`'s wrapper of ``speculative_generate_step`` enters for the
target's and the draft's caches and leaves when the generator ends);
everywhere else the caches are mlx-lm's plain ``ArraysCache`` and nothing is
recorded. Inside it the compiled whole-model and decoder-layer decode
steps (:mod:`mlx_qwen_fast.ops.decoder`) decline the swapped caches, so a
draft's one-token call runs module by module: the Gated DeltaNet module's
own decode path (on CUDA its fused kernel) and the attention layers'
compiled layer step still apply; the Gated DeltaNet layers' norms and
residuals run as mlx-lm's layer runs them, their MoE block through its
fast module's own dispatch.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Any, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from . import prompt_cache as prompt_cache_ops
from . import backend
from .ops import gated_delta as gated_delta_ops

__all__ = ["RollbackArraysCache", "Segment", "forward", "install", "rollback", "rollback_layers",
           "stock_speculative_generate_step"]

#: mlx-lm's ``num_draft_tokens`` default in ``speculative_generate_step``.
DEFAULT_NUM_DRAFT_TOKENS = 2


class Segment(NamedTuple):
    """One recorded call of a Gated DeltaNet layer on a
    :class:`RollbackArraysCache`: the states before it (``conv``, ``rec``;
    None for a cache that held no state yet), its token count ``tokens``,
    and for ``tokens > 1`` the layer and its input ``[B, tokens, D]`` to
    replay a prefix of the call (``layer`` and ``inputs`` None for one
    token)."""

    conv: Optional[mx.array]
    rec: Optional[mx.array]
    tokens: int
    layer: Any = None
    inputs: Optional[mx.array] = None

    def replay(self, k: int) -> Tuple[mx.array, mx.array]:
        """The states after the first ``k`` tokens of the call (0 < k <
        ``tokens``), by the layer's own call on them from the states before
        it (:func:`mlx_qwen_fast.ops.gated_delta.gated_delta_net`)."""
        tmp = ArraysCache(2)
        tmp[0], tmp[1] = self.conv, self.rec
        gated_delta_ops.gated_delta_net(self.layer, self.inputs[:, :k], None, tmp)
        return tmp[0], tmp[1]


class RollbackArraysCache(ArraysCache):
    """mlx-lm's ``ArraysCache`` of a Gated DeltaNet layer (``[conv state,
    recurrent state]``) that records its last calls, up to ``max_steps``
    tokens, and can be trimmed back over them.

    Only :func:`rollback` makes one (by swapping an existing cache's class,
    so the same object keeps its arrays) and turns it back into a plain
    ``ArraysCache`` on exit. The layer's forward records through
    :func:`forward` (:class:`mlx_qwen_fast.layers.FastGatedDeltaNet` calls
    it for a cache of this class), the whole-stack verify step
    (:func:`mlx_qwen_fast.ops.verify.verify_model`) through :meth:`record`.

    Attributes:
        max_steps: how many tokens back :meth:`trim` can reach (>= 1).
        steps: the recorded calls (:class:`Segment`), oldest first, their
            tokens adding up to at most ``max_steps`` (older calls dropped
            whole).
    """

    max_steps: int
    steps: List[Segment]

    def is_trimmable(self) -> bool:
        """True: :meth:`trim` can remove up to :meth:`recorded` tokens."""
        return True

    def recorded(self) -> int:
        """Tokens recorded: how far back :meth:`trim` reaches."""
        return sum(seg.tokens for seg in self.steps)

    def record(self, segment: Segment) -> None:
        """Add the call ``segment`` (made before the cache's states were
        replaced by the call's), dropping the oldest calls whole while more
        than ``max_steps`` tokens are recorded."""
        self.steps.append(segment)
        while self.steps and self.recorded() > self.max_steps:
            del self.steps[0]

    def state_at(self, n: int) -> Tuple[Optional[mx.array], Optional[mx.array]]:
        """The ``(conv, recurrent)`` states ``n`` tokens ago (0 <= n <=
        :meth:`recorded`), replaying a prefix of a recorded call where ``n``
        ends inside one; nothing changes. Raises ValueError as :meth:`trim`."""
        self._check(n)
        return self._back(n)[0]

    def _check(self, n) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"RollbackArraysCache.trim: n must be an int >= 0, got {n!r}")
        have = self.recorded()
        if n > have:
            raise ValueError(
                f"RollbackArraysCache.trim: n={n} tokens asked, but only the states before the last "
                f"{have} tokens are recorded (max_steps={self.max_steps}; a call of more than "
                f"max_steps tokens, a padding mask or per-row lengths drop them)")

    def _back(self, n: int):
        """``(states n tokens ago, recorded calls that stay, the shortened
        call or None)``."""
        if n == 0:
            return (self.cache[0], self.cache[1]), len(self.steps), None
        i, left = len(self.steps), n
        while left >= self.steps[i - 1].tokens:
            left -= self.steps[i - 1].tokens
            i -= 1
            if left == 0:
                seg = self.steps[i]
                return (seg.conv, seg.rec), i, None
        seg = self.steps[i - 1]  # the trim ends inside this call: keep its first tokens - left
        keep = seg.tokens - left
        return seg.replay(keep), i - 1, seg._replace(tokens=keep)

    def trim(self, n: int) -> int:
        """Put the states back to where they were ``n`` tokens ago (the
        states from before a recorded call, and where ``n`` ends inside a
        call of several tokens, its kept tokens replayed: :class:`Segment`).

        Args:
            n: tokens to remove, 0 <= n <= :meth:`recorded` (the tokens
                recorded since the last call the cache could not record).

        Returns:
            n (as mlx-lm's ``KVCache.trim``; ``trim_prompt_cache`` returns
            the first cache's count).

        Raises:
            ValueError: ``n`` not an int >= 0, or more tokens than recorded
                (the states from before them are gone: trimming fewer would
                leave the cache at a wrong position silently).
        """
        self._check(n)
        if n:
            (self.cache[0], self.cache[1]), stay, short = self._back(n)
            del self.steps[stay:]
            if short is not None:
                self.steps.append(short)
        return n


def forward(layer, inputs: mx.array, mask: Optional[mx.array], cache: RollbackArraysCache) -> mx.array:
    """A Gated DeltaNet layer's call on a recording cache (see the module
    docstring for which call records what).

    Args:
        layer: an mlx-lm ``GatedDeltaNet`` (the patched class).
        inputs: ``[B, S, D]`` hidden states.
        mask: ``[B, S]`` bool or None.
        cache: the layer's :class:`RollbackArraysCache`; updated in place.

    Returns:
        ``[B, S, D]``, what :func:`mlx_qwen_fast.ops.gated_delta.gated_delta_net`
        returns for the same call.

    Raises:
        ValueError: as :func:`~mlx_qwen_fast.ops.gated_delta.gated_delta_net`.
    """
    T = inputs.shape[1] if isinstance(inputs, mx.array) and inputs.ndim == 3 else 0
    if T == 0 or inputs.size == 0:  # bad input raises there; an empty call changes nothing
        return gated_delta_ops.gated_delta_net(layer, inputs, mask, cache)
    if T > cache.max_steps or mask is not None or cache.lengths is not None or cache.left_padding is not None:
        cache.steps.clear()  # a trim cannot reach back past this call
        return gated_delta_ops.gated_delta_net(layer, inputs, mask, cache)
    if T > 1 and not replays():
        before = (cache[0], cache[1])
        out, after = gated_delta_ops.gated_delta_net_steps(layer, inputs, cache)
        record_steps(cache, before, after)
        return out
    before = Segment(cache[0], cache[1], T, *((layer, inputs) if T > 1 else ()))
    out = gated_delta_ops.gated_delta_net(layer, inputs, None, cache)
    cache.record(before)
    return out


#: Backends where a recorded call of several tokens runs the layer's own
#: (fused) path and a trim replays (see the module docstring); elsewhere
#: (the CPU) the call runs the recurrence token by token in fp32
#: (:func:`~mlx_qwen_fast.ops.gated_delta.gated_delta_net_steps`) and
#: records the states before each token, so that a verify is bit for bit
#: sequential decoding: the reference of record, where speed does not count.
REPLAY_BACKENDS = (backend.CUDA, backend.METAL)


def replays() -> bool:
    """Whether recorded calls of several tokens replay on trim (the
    current backend in :data:`REPLAY_BACKENDS`) rather than record every
    token's states."""
    return backend.current() in REPLAY_BACKENDS


def record_steps(cache: "RollbackArraysCache", before, after) -> None:
    """Record a call of ``len(after)`` tokens as one-token segments:
    ``before`` the states before it, ``after`` the ``(conv, recurrent)``
    states after each of its tokens (the last is the cache's own)."""
    states = [before] + list(after[:-1])
    for conv, rec in states:
        cache.record(Segment(conv, rec, 1))


def _rollback_layer(layer) -> bool:
    """Whether ``layer``'s cache can record: a decoder layer whose Gated
    DeltaNet is the patched class (whose call goes through :func:`forward`)."""
    from .layers import FastGatedDeltaNet

    return isinstance(getattr(layer, "linear_attn", None), FastGatedDeltaNet)


def rollback_layers(model) -> List[bool]:
    """Per layer of ``model`` (``model.layers``), whether its cache would
    record under :func:`rollback` (a patched Gated DeltaNet layer)."""
    return [_rollback_layer(layer) for layer in getattr(model, "layers", [])]


@contextlib.contextmanager
def rollback(model, cache: Sequence[Any], max_steps: int) -> Iterator[List[RollbackArraysCache]]:
    """Within it, the Gated DeltaNet caches of ``model`` in ``cache`` record
    their last ``max_steps`` tokens and are trimmable (:class:`RollbackArraysCache`).

    Each plain ``ArraysCache`` entry of a patched Gated DeltaNet layer
    (batch without left padding or per-row lengths) becomes a
    :class:`RollbackArraysCache` -- the same object, its arrays kept -- and
    on exit (also on an exception) a plain ``ArraysCache`` again, holding
    the states it has then, its recorded steps dropped. Other entries (a
    ``KVCache``, the caches of stock layers) are left as they are: mlx-lm's
    ``can_trim_prompt_cache`` then still says whether the whole cache can
    be trimmed.

    Args:
        model: an mlx-lm model (``model.layers``; a patched Qwen3.5/3.6).
        cache: its prompt cache, one entry per layer (``make_prompt_cache``).
        max_steps: int >= 1, the most tokens a trim removes
            (``num_draft_tokens + 1`` for mlx-lm's speculative loop).

    Yields:
        The caches made trimmable.

    Raises:
        ValueError: ``max_steps`` not an int >= 1, or ``cache`` not one
            entry per layer of ``model``.
    """
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(f"rollback: max_steps must be an int >= 1, got {max_steps!r}")
    layers = getattr(model, "layers", None)
    if layers is None or len(cache) != len(layers):
        raise ValueError(f"rollback: cache must hold one entry per layer of model "
                         f"({'no layers' if layers is None else len(layers)}), got {len(cache)}")
    made = []
    for layer, c in zip(layers, cache):
        if (type(c) is ArraysCache and c.lengths is None and c.left_padding is None
                and _rollback_layer(layer)):
            c.__class__ = RollbackArraysCache
            c.max_steps, c.steps = max_steps, []
            made.append(c)
    try:
        yield list(made)
    finally:
        for c in made:
            c.__class__ = ArraysCache
            del c.max_steps, c.steps


def _rollback_if_complete(model, cache, max_steps: int):
    """:func:`rollback` where ``cache`` has one entry per layer of
    ``model``; otherwise nothing (mlx-lm decides what such a cache does)."""
    if len(cache) != len(getattr(model, "layers", ())):
        return contextlib.nullcontext([])
    return rollback(model, cache, max_steps)


def _wrap(stock):
    """``speculative_generate_step`` around mlx-lm's ``stock``: the same
    generator, its target and draft caches inside :func:`rollback`."""

    @functools.wraps(stock)
    def speculative_generate_step(prompt, model, draft_model, *args, **kwargs):
        if getattr(draft_model, "is_dflash_drafter", False):  # a DFlash drafter runs its own loop
            from .dflash.loop import speculative_step

            yield from speculative_step(prompt, model, draft_model, *args, **kwargs)
            return
        cache = kwargs.get("prompt_cache")
        if cache is None:  # what the stock function makes itself
            cache = make_prompt_cache(model) + make_prompt_cache(draft_model)
            kwargs["prompt_cache"] = cache
        k = kwargs.get("num_draft_tokens", DEFAULT_NUM_DRAFT_TOKENS)
        steps = k + 1 if isinstance(k, int) and not isinstance(k, bool) and k >= 0 else 1  # stock checks k
        n = len(model.layers)
        start = prompt_cache_ops._kv_offset(cache[:n])
        with _rollback_if_complete(model, cache[:n], steps), \
                _rollback_if_complete(draft_model, cache[n:], steps):
            first = True
            for item in stock(prompt, model, draft_model, *args, **kwargs):
                if first and start is not None and isinstance(prompt, mx.array):
                    # the prompt's last token is the first verify's first: both models have read
                    # start + P - 1 positions before it (mlx-lm's prefill leaves one token)
                    q = start + max(prompt.size - 1, 0)
                    prompt_cache_ops.record(cache[:n], q)
                    prompt_cache_ops.record(cache[n:], q)
                first = False
                yield item

    speculative_generate_step._mqf_stock = stock
    return speculative_generate_step


def install() -> None:
    """Make mlx-lm's speculative decoding use :func:`rollback`:
    ``mlx_lm.generate.speculative_generate_step`` (looked up there at each
    call by ``stream_generate``, and so by ``generate``, the CLI and the
    server) becomes a wrapper of mlx-lm's function that puts the target's
    and the draft's Gated DeltaNet caches in recording mode for the
    generator's lifetime. Idempotent; :func:`mlx_qwen_fast.patch` calls it.
    A model none of whose layers is patched passes through unchanged, so
    stock mlx-lm still refuses it ("requires a trimmable prompt cache").
    A DFlash drafter as the draft model (``is_dflash_drafter``) runs the
    DFlash loop instead (:func:`mlx_qwen_fast.dflash.loop.speculative_step`)."""
    module = importlib.import_module("mlx_lm.generate")  # the module: mlx_lm.generate is also a function
    current = module.speculative_generate_step
    if getattr(current, "_mqf_stock", None) is None:
        module.speculative_generate_step = _wrap(current)


def stock_speculative_generate_step():
    """mlx-lm's own ``speculative_generate_step`` (the function :func:`install` wraps)."""
    current = importlib.import_module("mlx_lm.generate").speculative_generate_step
    return getattr(current, "_mqf_stock", current)
