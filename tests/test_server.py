"""`python -m mlx_qwen_fast.server` (mlx_qwen_fast/server.py) seen through the
official OpenAI client: the models list (with no Hugging Face cache folder),
chat completions streamed and not, text completions, two concurrent streams,
bad requests answered with HTTP 400 while the server keeps serving. One
server process on the tiny checkpoint serves the whole module."""

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import types
import urllib.error
import urllib.request
from pathlib import Path

import openai  # the test extra's: a missing client fails here rather than skipping
import pytest

from mlx_qwen_fast import server as fast_server

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 120
MAX_TOKENS = 6
MESSAGES = [{"role": "user", "content": "Tell me about rivers."}]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.headers.get("Content-Type"), r.read()


class _Server(types.SimpleNamespace):
    """port, model (the --model value), log (path of its stdout+stderr)."""

    def url(self, path):
        return f"http://127.0.0.1:{self.port}{path}"

    def log_text(self):
        return self.log.read_text(errors="replace")

    def healthy(self):
        try:
            return _get(self.url("/health"))[0] == 200
        except (OSError, urllib.error.HTTPError):
            return False


@contextlib.contextmanager
def _serving(model, root, *flags):
    """The server on ``model`` (extra mlx-lm ``flags``), ``HF_HOME`` an empty
    folder under ``root`` (no hub cache in it); stopped on exit."""
    hf_home = root / "hf_home"
    hf_home.mkdir()
    env = dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("HF_HUB_CACHE", None)  # the cache is HF_HOME/hub, which does not exist
    srv = _Server(port=_free_port(), model=str(model), log=root / "server.log")
    with open(srv.log, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_qwen_fast.server", "--model", srv.model,
             "--host", "127.0.0.1", "--port", str(srv.port), *flags],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not srv.healthy():
            if proc.poll() is not None:
                pytest.fail(f"server exited with code {proc.returncode}:\n{srv.log_text()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"server did not answer /health within {START_TIMEOUT_S} s:\n{srv.log_text()[-4000:]}")
            time.sleep(0.5)
        yield srv
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    """The server on the tiny checkpoint, started once for the module and
    stopped after it."""
    with _serving(tiny_checkpoint, tmp_path_factory.mktemp("server")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0, timeout=120)


def test_models_list_without_a_hub_cache(server, client):
    status, ctype, body = _get(server.url("/v1/models"))
    assert status == 200 and ctype == "application/json"
    listing = json.loads(body)
    assert listing["object"] == "list"
    assert [m["id"] for m in listing["data"]] == [server.model]
    entry = listing["data"][0]
    assert entry["object"] == "model" and isinstance(entry["created"], int) and entry["created"] > 0
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    assert "CacheNotFound" not in server.log_text() and "Traceback" not in server.log_text()


def test_models_path_filters_by_id(server):
    _, _, body = _get(server.url("/v1/models/" + server.model.lstrip("/")))
    assert json.loads(body)["data"] == []  # the id without its leading "/" is another id
    _, _, body = _get(server.url("/v1/models/" + server.model))
    assert [m["id"] for m in json.loads(body)["data"]] == [server.model]


def _chat(client, model, stream, messages=MESSAGES):
    return client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                          temperature=0.0, stream=stream)


def _drain(stream):
    """(text, finish reasons of the chunks, number of chunks) of a chat stream."""
    text, reasons, n = "", [], 0
    for chunk in stream:
        n += 1
        assert chunk.object == "chat.completion.chunk" and chunk.id
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reasons.append(choice.finish_reason)
    return text, reasons, n


def test_chat_completion(server, client):
    r = _chat(client, server.model, stream=False)
    assert r.object == "chat.completion" and len(r.choices) == 1
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("length", "stop")
    assert 1 <= r.usage.completion_tokens <= MAX_TOKENS and r.usage.prompt_tokens > 0


def test_chat_completion_stream(server, client):
    text, reasons, n = _drain(_chat(client, server.model, stream=True))
    assert n >= 2 and text
    assert reasons[-1] in ("length", "stop") and all(r is None for r in reasons[:-1])
    # Greedy decoding: the stream says what the one-shot answer says.
    assert text == _chat(client, server.model, stream=False).choices[0].message.content


def test_text_completion(server, client):
    r = client.completions.create(model=server.model, prompt="Rivers are", max_tokens=MAX_TOKENS, temperature=0.0)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert isinstance(r.choices[0].text, str) and r.choices[0].text
    assert r.choices[0].finish_reason in ("length", "stop")


def test_two_concurrent_streams(server, client):
    prompts = ["Tell me about rivers.", "Why do cats purr when they are happy and calm?"]
    results, errors = {}, []
    start = threading.Barrier(len(prompts))

    def worker(i):
        try:
            start.wait(timeout=30)
            results[i] = _drain(_chat(client, server.model, stream=True,
                                      messages=[{"role": "user", "content": prompts[i]}]))
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not any(t.is_alive() for t in threads), "a stream did not finish within 180 s"
    assert not errors, errors
    for i in range(len(prompts)):
        text, reasons, _ = results[i]
        assert text and reasons[-1] in ("length", "stop"), (i, results[i])


@pytest.mark.parametrize("kind, extra, expect", [
    ("chat", {"max_tokens": -1}, "max_tokens must be at least 1"),  # mlx-lm's own check
    ("chat", {"extra_body": {"stop": 5}}, "stop must be a string or a list of strings"),
    ("chat", {"logit_bias": {"99999999": 1.0}}, "logit_bias token id 99999999 is outside the vocabulary"),
    ("chat", {"seed": -1}, "seed must be between 0 and 2**64 - 1"),
    ("text", {"prompt": ""}, "prompt must be a non-empty string"),
    ("text", {"prompt": ["a", "b"]}, "prompt must be a non-empty string"),
])
def test_bad_request_is_400_and_the_server_keeps_serving(server, client, kind, extra, expect):
    kwargs = dict({"model": server.model, "max_tokens": 2}, **extra)
    with pytest.raises(openai.BadRequestError) as info:
        if kind == "chat":
            client.chat.completions.create(messages=MESSAGES, **kwargs)
        else:
            client.completions.create(**kwargs)
    # mlx-lm's error body is {"error": "<text>"}, not OpenAI's {"error": {"message": ...}}:
    # the client keeps the text as the error's body.
    assert info.value.status_code == 400 and expect in info.value.body
    assert server.healthy()


def test_malformed_body_is_400(server):
    req = urllib.request.Request(server.url("/v1/chat/completions"), data=b"{not json",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 400 and "Invalid JSON" in json.loads(info.value.read())["error"]


@pytest.mark.parametrize("body, vocab, expect", [
    ({"stop": "x"}, None, None),
    ({"stop": ["x", "y"]}, None, None),
    ({"stop": ["x", 1]}, None, "stop must be"),
    ({"logit_bias": {"10": 1}}, 11, None),
    ({"logit_bias": {"11": 1}}, 11, "outside the vocabulary (0 to 10)"),
    ({"logit_bias": {"-1": 1}}, None, "outside the vocabulary (at least 0)"),
    ({"seed": 2**64}, None, "seed must be"),
    ({"stream_options": {"include_usage": True}}, None, None),
    ({"stream_options": 5}, None, "stream_options must be an object"),
])
def test_request_problem(body, vocab, expect):
    problem = fast_server.request_problem("/v1/chat/completions", dict({"messages": MESSAGES}, **body), vocab)
    assert problem is None if expect is None else expect in problem


def test_request_problem_prompt_only_for_text_completions():
    assert fast_server.request_problem("/v1/completions", {"prompt": "hi"}) is None
    assert "prompt" in fast_server.request_problem("/v1/completions", {})
    assert fast_server.request_problem("/v1/chat/completions", {"messages": MESSAGES}) is None


def _fake_repo(hub, repo_id, files):
    folder = hub / ("models--" + repo_id.replace("/", "--"))
    commit = "0" * 40
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    snap = folder / "snapshots" / commit
    snap.mkdir(parents=True)
    for name in files:
        (snap / name).write_text("{}")


def test_cached_models(tmp_path):
    hub = tmp_path / "hub"
    _fake_repo(hub, "org/mlx-model", fast_server._MLX_LM_FILES)
    _fake_repo(hub, "org/no-index", ["config.json", "tokenizer_config.json"])
    assert fast_server.cached_models(cache_dir=hub) == ["org/mlx-model"]
    assert fast_server.cached_models("org/other", cache_dir=hub) == []
    assert fast_server.cached_models(cache_dir=tmp_path / "missing") == []
    (tmp_path / "file").write_text("")
    assert fast_server.cached_models(cache_dir=tmp_path / "file") == []


def test_install_sets_the_methods_once():
    from mlx_lm import server as mlx_server

    handler = type("Handler", (mlx_server.APIHandler,), {})
    module = types.SimpleNamespace(__name__="fake_server", APIHandler=handler)
    fast_server.install(module)
    fast_server.install(module)
    assert handler.handle_models_request is fast_server.handle_models_request
    wrapped = handler.validate_model_parameters
    assert wrapped.checks_requests and wrapped.__wrapped__ is mlx_server.APIHandler.validate_model_parameters
    assert mlx_server.APIHandler.handle_models_request is not fast_server.handle_models_request
    with pytest.raises(AttributeError, match="handle_models_request not found"):
        fast_server.install(types.SimpleNamespace(__name__="empty", APIHandler=object))


def test_draft_model_serves_plain_greedy_text(server, client, tmp_path):
    """`--draft-model` passes through to mlx-lm's server: its speculative
    decoding runs on the patched target and draft (the tiny-draft preset)
    and answers what the plain server answers, twice (the second request
    reuses the prompt cache the first left)."""
    from mlx_qwen_fast.checkpoint import write_checkpoint

    draft = write_checkpoint(tmp_path / "draft", "tiny-draft", seed=1)
    want = _chat(client, server.model, stream=False).choices[0].message.content
    with _serving(server.model, tmp_path, "--draft-model", str(draft), "--num-draft-tokens", "3") as spec:
        spec_client = openai.OpenAI(base_url=spec.url("/v1"), api_key="x", max_retries=0, timeout=120)
        for _ in range(2):
            assert _chat(spec_client, spec.model, stream=False).choices[0].message.content == want
        assert spec.log_text().count("mlx_qwen_fast: patched") == 2, spec.log_text()[-4000:]


def _fp32_copy(folder, out):
    """A copy of the checkpoint ``folder`` at ``out`` with its bf16 tensors
    (scales, biases, norms) in fp32: mlx-lm then computes in fp32."""
    import shutil

    import mlx.core as mx

    shutil.copytree(folder, out)
    for f in out.glob("*.safetensors"):
        arrays = mx.load(str(f))
        mx.save_safetensors(str(f), {k: v.astype(mx.float32) if v.dtype == mx.bfloat16 else v
                                     for k, v in arrays.items()}, metadata={"format": "mlx"})
    return out


def _chat_turns(srv, turns=4):
    """A chat of ``turns`` turns (a system prompt, then per turn a user
    message; the assistant's answer sent back edited, as clients do when
    they re-render or trim it): per turn (answer, prompt tokens, cached
    tokens)."""
    client = openai.OpenAI(base_url=srv.url("/v1"), api_key="x", max_retries=0, timeout=120)
    messages = [{"role": "system", "content": "You answer in one line. " * 8}]
    out = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Turn {turn}: tell me about rivers and lakes. " * 3})
        r = client.chat.completions.create(model=srv.model, messages=messages, max_tokens=8, temperature=0.0)
        details = r.usage.prompt_tokens_details
        out.append((r.choices[0].message.content, r.usage.prompt_tokens, details.cached_tokens if details else None))
        messages.append({"role": "assistant", "content": f"(edited) {r.choices[0].message.content[:5]}"})
    return out


def test_speculative_chat_resumes_from_the_last_prompt(tiny_checkpoint, tmp_path):
    """`--draft-model` serves one request at a time, where mlx-lm keeps only
    each request's final cache (prompt + answer), which a hybrid model
    cannot trim: each turn of a chat whose answers come back edited would
    read its whole prompt again. With the checkpoint at each prompt's end
    (mlx_qwen_fast.prompt_cache) turn k reads only what follows turn k-1's
    prompt (cached = that prompt's tokens - 1, as mlx-lm's batched path
    reuses for plain decoding), and every answer is the one a server
    without a prompt cache gives."""
    from mlx_qwen_fast.checkpoint import write_checkpoint

    # fp32 copies: in bf16 a prompt read in two calls rounds differently from one call, and greedy
    # tokens of random weights may follow the rounding
    target = _fp32_copy(tiny_checkpoint, tmp_path / "target")
    draft = _fp32_copy(write_checkpoint(tmp_path / "draft", "tiny-draft", seed=1), tmp_path / "draft32")
    flags = ("--draft-model", str(draft), "--num-draft-tokens", "3")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with _serving(target, tmp_path / "a", *flags) as srv:
        got = _chat_turns(srv)
    with _serving(target, tmp_path / "b", *flags, "--prompt-cache-size", "0") as srv:
        fresh = _chat_turns(srv)
    assert [a for a, _, _ in got] == [a for a, _, _ in fresh]
    assert [p for _, p, _ in got] == [p for _, p, _ in fresh]
    assert all(c in (0, None) for _, _, c in fresh)
    cached = [c for _, _, c in got]
    assert cached[0] in (0, None)
    assert cached[1:] == [p - 1 for _, p, _ in got[:-1]], got
