"""`python -m mlx_qwen_fast.server`: `mlx_lm.server` with the fast path installed.

Takes exactly ``mlx_lm.server``'s flags, plus ``--stock`` to run stock
mlx-lm, ``--version``, and ``--dflash-drafter DIR`` to serve with a DFlash
block drafter as the draft model (:mod:`mlx_qwen_fast.dflash.cli`); see
:func:`mlx_qwen_fast._cli.run_mlx_lm_main`.

``GET /v1/models`` (OpenAI's list format) names the model given by
``--model`` first, its id written as given (the value a request's
``"model"`` field takes to use the loaded model), then the mlx models that
mlx-lm finds in the Hugging Face cache; a missing or unreadable cache adds
none rather than failing. Stock mlx-lm 0.32.2 answers 200 with an empty body
there (its cache scan raises ``CacheNotFound`` after the status line is
sent), and ``--stock`` keeps exactly that behaviour: it runs stock mlx-lm.

Request fields that mlx-lm 0.32.2 accepts but then fails on, taking the
whole server down or dropping the connection without an answer, are
answered with HTTP 400 and one line instead (:func:`request_problem`).
"""

import functools
import json
import logging
from typing import List, Optional

#: Files a cached repo's ``main`` revision must hold to be listed: mlx-lm
#: 0.32.2's own criterion for "probably an mlx-lm model".
_MLX_LM_FILES = ("config.json", "model.safetensors.index.json", "tokenizer_config.json")


def cached_models(only: Optional[str] = None, cache_dir=None) -> List[str]:
    """Repo ids of the models in the Hugging Face cache that mlx-lm's server
    lists (model repos whose ``main`` revision holds ``_MLX_LM_FILES``), sorted.

    Args:
        only: keep just this repo id (``GET /v1/models/<id>``); None keeps all.
        cache_dir: the hub cache folder; None: huggingface_hub's (``HF_HUB_CACHE``,
            else ``HF_HOME/hub``).

    Returns [] when the cache folder is missing, is a file, or cannot be
    read (huggingface_hub's ``CacheNotFound``, ``ValueError``, ``OSError``):
    an absent cache means no cached models, not an error.
    """
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        repos = scan_cache_dir(cache_dir).repos
    except (CacheNotFound, ValueError, OSError) as exc:
        logging.debug("mlx_qwen_fast: no Hugging Face cache to list models from: %s", exc)
        return []
    out = []
    for repo in repos:
        if repo.repo_type != "model" or "main" not in repo.refs or (only is not None and repo.repo_id != only):
            continue
        names = {f.file_path.name for f in repo.refs["main"].files}
        if all(n in names for n in _MLX_LM_FILES):
            out.append(repo.repo_id)
    return sorted(out)


def handle_models_request(self) -> None:
    """``GET /v1/models[/<id>]`` for mlx-lm's ``APIHandler`` (installed on it
    as its method by :func:`install`): the ``--model`` id first, then
    :func:`cached_models`, each once, as ``{"object": "list", "data": [...]}``.
    A path ``/v1/models/<id>`` keeps only that id (as mlx-lm does)."""
    parts = self.path.split("?", 1)[0].split("/")
    only = "/".join(parts[3:]) if len(parts) > 3 else None
    ids = []
    loaded = self.response_generator.cli_args.model
    if loaded and (only is None or loaded == only):
        ids.append(loaded)  # first: chat front ends take the first entry as the default model
    ids += [i for i in cached_models(only) if i not in ids]
    body = {"object": "list",
            "data": [{"id": i, "object": "model", "created": self.created, "owned_by": "local"} for i in ids]}
    # The status line goes out only once the body is built: a failure while
    # building it closes the connection (an error to the client), never a
    # 200 with an empty body.
    payload = json.dumps(body).encode()
    self._set_completion_headers(200)
    self.send_header("Content-Length", str(len(payload)))
    self.end_headers()
    self.wfile.write(payload)
    self.wfile.flush()


def request_problem(path: str, body: dict, vocab_size: Optional[int] = None) -> Optional[str]:
    """Why the request ``body`` posted to ``path`` would make mlx-lm 0.32.2's
    server fail after accepting it, as one line; None when it would not.

    Checked: ``stop`` (a string or a list of strings; anything else kills
    the generation thread, after which every request fails), ``logit_bias``
    token ids (0 to ``vocab_size - 1``; one outside the logits aborts the
    process), ``seed`` (0 to 2**64 - 1) and ``stream_options`` (an object;
    either one wrong drops the connection without an answer) and, for
    ``/v1/completions``, ``prompt`` (a non-empty string; a list or an empty
    one kills the generation thread).

    Args:
        path: the request's path, e.g. "/v1/chat/completions".
        body: the request's JSON object.
        vocab_size: number of token ids of the requested model; None checks
            only that ``logit_bias`` ids are not negative.
    """
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(w, str) for w in stop)):
        return "stop must be a string or a list of strings"
    bias = body.get("logit_bias")
    if isinstance(bias, dict):
        for key in bias:
            try:
                token = int(key)
            except (TypeError, ValueError):
                continue  # mlx-lm's own check rejects it
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                limit = f"0 to {vocab_size - 1}" if vocab_size is not None else "at least 0"
                return f"logit_bias token id {key} is outside the vocabulary ({limit})"
    seed = body.get("seed")
    if isinstance(seed, int) and not 0 <= seed < 2**64:
        return "seed must be between 0 and 2**64 - 1"
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        return "stream_options must be an object"
    if path == "/v1/completions":
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            return "prompt must be a non-empty string"
    return None


def _loaded_vocab_size(handler) -> Optional[int]:
    """Token ids of the model the request asks for, when it is the loaded
    one (len of its tokenizer: ids past it are never produced); else None."""
    provider = handler.response_generator.model_provider
    tokenizer, key = provider.tokenizer, provider.model_key  # read once: the generation thread reloads
    wanted = handler.requested_model
    if tokenizer is None or not key or wanted not in ("default_model", key[0]):
        return None
    return len(tokenizer)


def _with_request_checks(validate):
    """mlx-lm's ``APIHandler.validate_model_parameters`` followed by
    :func:`request_problem`; a problem is raised as the ValueError that
    mlx-lm's ``do_POST`` answers with HTTP 400 and ``{"error": ...}``."""

    @functools.wraps(validate)
    def validate_model_parameters(self):
        validate(self)
        problem = request_problem(self.path, self.body, _loaded_vocab_size(self))
        if problem:
            raise ValueError(problem)

    validate_model_parameters.checks_requests = True
    return validate_model_parameters


def install(server_module) -> None:
    """Make mlx-lm's server module ``server_module`` (``mlx_lm.server``)
    answer ``GET /v1/models`` with :func:`handle_models_request`, reject
    the requests :func:`request_problem` finds fault with (HTTP 400), and
    keep its prompt cache in a
    :class:`mlx_qwen_fast.prompt_cache.CheckpointPromptCache` (a speculative
    request resumes from an earlier prompt's end). It sets methods on the
    module's ``APIHandler`` class, the class ``mlx_lm.server.run`` always
    serves with (it passes no handler class on to the HTTP server).
    Installing twice changes nothing more.

    Raises AttributeError (one line) when ``APIHandler`` lacks either method
    (an mlx-lm this package does not fit).
    """
    handler = getattr(server_module, "APIHandler", None)
    for name in ("handle_models_request", "validate_model_parameters"):
        if not callable(getattr(handler, name, None)):
            raise AttributeError(f"{server_module.__name__}.APIHandler.{name} not found: this mlx-lm does "
                                 f"not fit mlx_qwen_fast (it pins mlx-lm 0.32.2)")
    handler.handle_models_request = handle_models_request
    if not getattr(handler.validate_model_parameters, "checks_requests", False):
        handler.validate_model_parameters = _with_request_checks(handler.validate_model_parameters)
    from . import prompt_cache  # imports mlx-lm: not at module level, which the CLI imports before its checks

    prompt_cache.install(server_module)


def main() -> None:
    """Run ``mlx_lm.server`` with the fast path and the models list above;
    ``--stock``: stock mlx-lm, unchanged; ``--dflash-drafter DIR``: the
    DFlash drafter as the draft model."""
    from .dflash import cli as dflash_cli

    dflash_cli.run("mlx_lm.server", dflash_cli.hook_server)


if __name__ == "__main__":
    main()
