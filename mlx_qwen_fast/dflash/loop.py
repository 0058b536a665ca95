"""DFlash speculative decoding: the generation loop and its entry points.

The loop (DFlash, arXiv 2602.06036; z-lab/dflash ``dflash_generate`` and
its MLX port ``dflash/model_mlx.py``):

1. prefill: the target runs over the prompt (chunks of
   ``prefill_step_size`` tokens, the last token alone, as mlx-lm's
   ``generate_step`` reads a prompt) through :func:`capture.forward`, which also
   returns its hidden states after the layers ``target_layer_ids``; each
   chunk's hidden states go into the drafter's context cache
   (:meth:`DFlashDrafter.add_context`); the first token is sampled from the
   last position's logits;
2. draft: the drafter runs once over the block ``[y, mask x (b - 1)]`` (``y``
   the last accepted token, ``b`` the block size) and proposes ``b - 1``
   tokens (its greedy tokens);
3. verify: the target runs once over ``[y, d_1 .. d_{b-1}]`` with its cache
   (again through :func:`capture.forward`: the same call gives the hidden
   states of these positions; no second pass) and samples a token ``t_i``
   from each position's logits with the caller's sampler;
4. accept the longest prefix of drafts with ``d_i == t_{i-1}`` (``a``
   drafts), emit ``t_0 .. t_a`` (the accepted drafts and the target's token
   after them), remove the ``b - 1 - a`` rejected positions from the
   target's caches (mlx-lm's ``trim_prompt_cache``: ``KVCache.trim`` for the
   attention layers, :class:`mlx_qwen_fast.speculative.RollbackArraysCache`
   for the Gated DeltaNet layers, recording during the loop), append the
   hidden states of the ``a + 1`` kept positions to the drafter's context,
   and go on from ``y = t_a``.

Exactness. Greedy (the default sampler): every emitted token is the
target's argmax given the tokens before it, as in plain decoding. With a
stochastic sampler, step 4 is rejection sampling with the drafter's
proposal as a point mass (its argmax): a draft ``d`` is accepted with the
target's probability ``p(d)``, and a rejected one is replaced by a draw
from ``p`` restricted to tokens other than ``d`` -- drawing ``t ~ p`` and
accepting iff ``t == d`` realises both in one draw, so each emitted token
has the target's (sampler's) distribution given the tokens before it, for
any mlx-lm sampler whose randomness is per row (temperature, top-p,
min-p, top-k; XTC draws one coin per call, shared by a block's positions).
Rejection sampling against the drafter's full distribution ``q``
(acceptance ``sum min(p, q)``) would need the sampler's distribution,
which mlx-lm's sampler interface (logprobs -> token) does not expose.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, List, Optional, Sequence, Tuple, Union

import mlx.core as mx

from .. import prompt_cache as prompt_cache_ops
from .. import speculative
from . import capture

__all__ = ["DFlashStats", "dflash_generate_step", "generate", "speculative_step", "stream_generate"]


@dataclass
class DFlashStats:
    """What a :func:`dflash_generate_step` run did, filled in as it goes.

    Attributes:
        accepted: per verified block, how many drafts were accepted
            (0 .. block - 1).
        drafted: per verified block, how many drafts it held.
    """

    accepted: List[int] = field(default_factory=list)
    drafted: List[int] = field(default_factory=list)

    @property
    def blocks(self) -> int:
        """Verify passes run."""
        return len(self.accepted)

    @property
    def acceptance(self) -> float:
        """Accepted drafts over drafted ones (0.0 when none was drafted)."""
        d = sum(self.drafted)
        return sum(self.accepted) / d if d else 0.0

    @property
    def tokens_per_block(self) -> float:
        """Tokens emitted per verify pass (accepted + 1)."""
        return (sum(self.accepted) + self.blocks) / self.blocks if self.blocks else 0.0


def _check(prompt, max_tokens, block_size, drafter, kv_bits, max_kv_size, input_embeddings, prefill_step_size):
    if not isinstance(prompt, mx.array) or prompt.ndim != 1 or prompt.size == 0:
        raise ValueError("prompt: expected a non-empty 1-D mx.array of token ids")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < -1:
        raise ValueError(f"max_tokens: expected an int >= 0, or -1 for no limit, got {max_tokens!r}")
    top = int(getattr(drafter, "block_size", 0))
    if top < 2:
        raise ValueError(f"drafter: block_size must be >= 2, got {top!r}")
    b = top if block_size is None else block_size
    if isinstance(b, bool) or not isinstance(b, int) or not 2 <= b <= top:
        raise ValueError(f"block_size: expected an int in [2, {top}] (the drafter's block size), got {block_size!r}")
    if isinstance(prefill_step_size, bool) or not isinstance(prefill_step_size, int) or prefill_step_size < 1:
        raise ValueError(f"prefill_step_size: expected an int >= 1, got {prefill_step_size!r}")
    if kv_bits is not None:
        raise ValueError("kv_bits: a quantised KV cache is not supported by DFlash decoding (pass None)")
    if max_kv_size is not None:
        raise ValueError("max_kv_size: a rotating KV cache cannot roll back a rejected draft (pass None)")
    if input_embeddings is not None:
        raise ValueError("input_embeddings: not supported by DFlash decoding (the drafter reads token ids)")
    return b


def _kv_offset(cache) -> int:
    for c in cache:
        if hasattr(c, "offset"):
            return int(c.offset)
    return 0


def _cache_arrays(cache) -> List[mx.array]:
    """The arrays of the drafter's caches that hold something (mlx-lm
    caches; a stand-in's cache may be anything)."""
    out = []
    for c in cache or ():
        keys, values = getattr(c, "keys", None), getattr(c, "values", None)
        out += [a for a in (keys, values) if isinstance(a, mx.array)]
    return out


def _process(logits: mx.array, history: mx.array, processors) -> mx.array:
    """``logits`` ``[1, V]`` through mlx-lm's logits processors (each
    ``(tokens, logits) -> logits``, ``tokens`` all tokens up to and with the
    current input)."""
    for p in processors:
        logits = p(history, logits)
    return logits


def _steps(prompt: mx.array, model, drafter, stream, *, max_tokens: int, sampler, logits_processors,
           prompt_cache, prefill_step_size: int, block_size: Optional[int], kv_bits, max_kv_size,
           input_embeddings, prompt_progress_callback, stats: Optional[DFlashStats]
           ) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """The loop of the module docstring; yields ``(token, logprobs,
    from_draft)``."""
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    block = _check(prompt, max_tokens, block_size, drafter, kv_bits, max_kv_size, input_embeddings,
                   prefill_step_size)
    parts = capture.check_target(model, drafter)
    n_layers = len(parts.text_model.layers)
    ids = tuple(getattr(drafter, "target_layer_ids", ()))
    if prompt_cache is None:
        cache, dcache = make_prompt_cache(model), drafter.make_cache()
    else:
        if len(prompt_cache) < n_layers:
            raise ValueError(f"prompt_cache: expected one entry per target layer ({n_layers}), then optionally "
                             f"the drafter's, got {len(prompt_cache)}")
        cache = prompt_cache[:n_layers]
        dcache = prompt_cache[n_layers:] if len(prompt_cache) > n_layers else drafter.make_cache()
    sampler = sampler or make_sampler()
    progress = prompt_progress_callback or (lambda *_: None)
    processors = list(logits_processors or ())
    prompt = prompt.astype(mx.uint32)
    history = prompt if processors else None
    if max_tokens == 0:
        return

    with mx.stream(stream):
        pos = _kv_offset(cache)  # position of the next token the target reads
        P = prompt.size
        progress(0, P)
        done = 0
        while done < P:
            # the last prompt token alone, as mlx-lm's generate_step reads it: the first token's logits are
            # plain decoding's to the bit (a call over more tokens may round differently in bf16)
            n = 1 if done == P - 1 else min(prefill_step_size, P - 1 - done)
            last = done + n == P
            logits, hidden = capture.forward(model, prompt[done:done + n][None], cache, ids, parts,
                                             last_only=True)
            if hidden is not None:
                drafter.add_context(hidden, pos, dcache)
            mx.eval([c.state for c in cache], _cache_arrays(dcache), [logits] if last else [])
            pos, done = pos + n, done + n
            progress(done, P)
            if not last:
                mx.clear_cache()
        logits = logits[:, -1, :]
        if processors:
            logits = _process(logits, history, processors)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        y = sampler(logprobs)
        mx.eval(y)
        y = int(y.item())
        # the prompt's end (pos: every prompt position read, by the target and into the drafter's
        # context): where a server's next request may resume (mlx_qwen_fast.prompt_cache)
        prompt_cache_ops.record(cache, pos)
        prompt_cache_ops.record(dcache, pos)
        yield y, logprobs[0], False
        emitted = 1
        if processors:
            history = mx.concatenate([history, mx.array([y], mx.uint32)])

        # pos: the position of y, the last emitted token (not yet read by the target)
        with speculative.rollback(parts.text_model, cache, block):
            while max_tokens < 0 or emitted < max_tokens:
                # a whole block even where fewer tokens are left: one verify shape (S = block) for the whole
                # generation, so the compiled verify step is traced once; the extra tokens are trimmed below
                b = block
                left = None if max_tokens < 0 else max_tokens - emitted
                y_arr = mx.array([y], mx.uint32)
                drafts = drafter.propose(model, y_arr, pos, b - 1, dcache) if b > 1 else None
                tokens_in = y_arr if drafts is None else mx.concatenate([y_arr, drafts.astype(mx.uint32)])
                logits, hidden = capture.forward(model, tokens_in[None], cache, ids, parts)
                logits = logits[0]
                if processors:
                    rows = [_process(logits[i:i + 1], mx.concatenate([history, tokens_in[1:i + 1]]), processors)
                            for i in range(b)]
                    logits = mx.concatenate(rows, axis=0)
                logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                t = sampler(logprobs)
                mx.eval(t, tokens_in)
                t_list, d_list = t.tolist(), tokens_in.tolist()[1:]
                usable = b - 1 if left is None else min(b - 1, left - 1)  # drafts that may still be emitted
                a = 0
                while a < usable and d_list[a] == t_list[a]:
                    a += 1
                if stats is not None:
                    stats.accepted.append(a)
                    stats.drafted.append(usable)
                if b - 1 - a:
                    trim_prompt_cache(cache, b - 1 - a)
                if hidden is not None:
                    drafter.add_context(hidden[:, :a + 1], pos, dcache)
                pos += a + 1
                out = t_list[:a + 1]
                if processors:
                    history = mx.concatenate([history, mx.array(out, mx.uint32)])
                for i, token in enumerate(out):
                    yield token, logprobs[i], i < a
                emitted += a + 1
                y = out[-1]
                if emitted // 256 != (emitted - a - 1) // 256:
                    mx.clear_cache()


def _stream(stream):
    if stream is not None:
        return stream
    from mlx_lm.generate import generation_stream

    return generation_stream


def dflash_generate_step(
    prompt: mx.array,
    model,
    drafter,
    stream=None,
    *,
    max_tokens: int = 256,
    sampler: Optional[Callable[[mx.array], mx.array]] = None,
    logits_processors: Optional[List[Callable[[mx.array, mx.array], mx.array]]] = None,
    prompt_cache: Optional[List[Any]] = None,
    prefill_step_size: int = 2048,
    block_size: Optional[int] = None,
    max_kv_size: Optional[int] = None,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 0,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    input_embeddings: Optional[mx.array] = None,
    stats: Optional[DFlashStats] = None,
) -> Generator[Tuple[int, mx.array], None, None]:
    """Generate tokens with DFlash speculative decoding; a drop-in for
    mlx-lm's ``generate_step`` (same arguments, same yields) with a drafter.

    See the module docstring for the algorithm and its exactness (greedy:
    the tokens of plain greedy decoding; a stochastic sampler: the target's
    distribution, by rejection sampling).

    Args:
        prompt: ``[P]`` token ids (P >= 1).
        model: the target, a Qwen3.5/3.6 model patched by
            :func:`mlx_qwen_fast.patch`.
        drafter: a :class:`~mlx_qwen_fast.dflash.drafter.DFlashDrafter`
            (:func:`~mlx_qwen_fast.dflash.drafter.load_drafter`), or any
            object with ``block_size``, ``target_layer_ids``,
            ``make_cache()``, ``add_context(hidden, position, cache)`` and
            ``propose(model, last_token, position, num, cache) -> [num]``
            (and ``is_dflash_drafter = True`` for :func:`stream_generate`
            and mlx-lm's entry points to route it here).
        stream: the MLX stream to run on (mlx-lm's ``generation_stream`` by
            default).
        max_tokens: tokens to generate; -1 for no limit.
        sampler: mlx-lm sampler (``logprobs [N, V] -> tokens [N]``,
            rows independent); default greedy.
        logits_processors: mlx-lm's ``(tokens, logits) -> logits``, applied
            to each verified position with the tokens up to it.
        prompt_cache: the target's cache (``make_prompt_cache(model)``),
            optionally followed by the drafter's (``drafter.make_cache()``),
            updated in place; it may already hold a prefix (the drafter then
            has no context for the prefix, unless its cache is given too).
        prefill_step_size: prompt tokens per prefill call.
        block_size: verify block size, 2 .. the drafter's (default the
            drafter's: ``block_size - 1`` drafts a block).
        max_kv_size, kv_bits, input_embeddings: must be None (a rotating or
            quantised KV cache, embeddings input: not supported).
        kv_group_size, quantized_kv_start: accepted for mlx-lm's signature;
            unused (``kv_bits`` is None).
        prompt_progress_callback: ``(processed, total)`` after each prefill
            chunk, as mlx-lm calls it.
        stats: a :class:`DFlashStats` to fill in (acceptance per block).

    Yields:
        ``(token, logprobs)``: token an int, logprobs ``[V]`` the target's
        log-probabilities (after the logits processors) at that position.

    Raises:
        ValueError: a bad argument (named), a target the fast path does not
            support, or a drafter that does not fit it
            (:func:`mlx_qwen_fast.dflash.capture.check_target`).
    """
    for token, logprobs, _ in _steps(
            prompt, model, drafter, _stream(stream), max_tokens=max_tokens, sampler=sampler,
            logits_processors=logits_processors, prompt_cache=prompt_cache,
            prefill_step_size=prefill_step_size, block_size=block_size, kv_bits=kv_bits,
            max_kv_size=max_kv_size, input_embeddings=input_embeddings,
            prompt_progress_callback=prompt_progress_callback, stats=stats):
        yield token, logprobs


def speculative_step(prompt: mx.array, model, draft_model, stream=None, *, num_draft_tokens: int = 2,
                     max_tokens: int = 256, sampler=None, logits_processors=None, prompt_cache=None,
                     prefill_step_size: int = 512, kv_bits=None, kv_group_size: int = 64,
                     quantized_kv_start: int = 0, **kwargs):
    """mlx-lm's ``speculative_generate_step`` signature over the DFlash loop:
    what :func:`mlx_qwen_fast.speculative.install`'s wrapper runs when the
    draft model is a DFlash drafter, so ``mlx_lm.stream_generate`` /
    ``generate(..., draft_model=drafter)`` decode with it.

    ``num_draft_tokens`` is not used: a DFlash drafter drafts its own block
    (``block_size - 1`` tokens, from its config). ``prompt_cache``: the
    target's entries then the drafter's, as mlx-lm's loop splits them.
    Yields ``(token, logprobs, from_draft)`` as mlx-lm's function does.
    """
    yield from _steps(prompt, model, draft_model, _stream(stream), max_tokens=max_tokens, sampler=sampler,
                      logits_processors=logits_processors, prompt_cache=prompt_cache,
                      prefill_step_size=prefill_step_size, block_size=None, kv_bits=kv_bits,
                      max_kv_size=kwargs.pop("max_kv_size", None),
                      input_embeddings=kwargs.pop("input_embeddings", None),
                      prompt_progress_callback=kwargs.pop("prompt_progress_callback", None),
                      stats=kwargs.pop("stats", None))


def stream_generate(model, tokenizer, prompt: Union[str, mx.array, List[int]], drafter,
                    max_tokens: int = 256, **kwargs):
    """mlx-lm's ``stream_generate`` with a DFlash drafter: yields mlx-lm's
    ``GenerationResponse`` per token (``from_draft`` True for accepted
    drafts), stopping at the tokenizer's EOS tokens.

    Args:
        model, tokenizer, prompt, max_tokens: as for mlx-lm's
            ``stream_generate``.
        drafter: as for :func:`dflash_generate_step`.
        kwargs: the other arguments of :func:`dflash_generate_step`
            (``sampler``, ``logits_processors``, ``prompt_cache``,
            ``prefill_step_size``, ``stream``, ...); ``num_draft_tokens`` is
            ignored (the drafter's block size is used).

    Raises:
        ValueError: as :func:`dflash_generate_step`; ``drafter`` None.
    """
    mlx_generate = importlib.import_module("mlx_lm.generate")  # the module: mlx_lm.generate is also a function

    if drafter is None:
        raise ValueError("drafter: a DFlash drafter is required (load_drafter(path))")
    speculative.install()  # routes a DFlash drafter to speculative_step
    kwargs.pop("draft_model", None)
    yield from mlx_generate.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens,
                                            draft_model=drafter, **kwargs)


def generate(model, tokenizer, prompt: Union[str, List[int]], drafter, verbose: bool = False, **kwargs) -> str:
    """mlx-lm's ``generate`` with a DFlash drafter: the text of
    :func:`stream_generate`'s responses (``verbose`` prints them and mlx-lm's
    timing lines).

    Raises:
        ValueError: as :func:`stream_generate`.
    """
    mlx_generate = importlib.import_module("mlx_lm.generate")  # the module: mlx_lm.generate is also a function

    if drafter is None:
        raise ValueError("drafter: a DFlash drafter is required (load_drafter(path))")
    speculative.install()
    kwargs.pop("draft_model", None)
    return mlx_generate.generate(model, tokenizer, prompt, verbose=verbose, draft_model=drafter, **kwargs)
