"""mlx-lm's public API on a patched model: same tokens as stock mlx-lm.

Uses the demo checkpoint (non-flat logits), so greedy token identity between
the stock and patched paths is a real check rather than a coin toss.
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm import batch_generate, generate, stream_generate
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

from mlx_qwen_fast.patching import patched_copy

PROMPTS = ["Tell me about rivers.", "Why do cats purr when they are happy and calm?"]


@pytest.fixture(scope="module")
def models(demo_checkpoint):
    # fp32 activations, so that greedy tokens of the two paths are comparable
    # (in bf16 on random weights they differ at near-ties; see test_patch.py).
    stock, tokenizer = mlx_lm.load(str(demo_checkpoint))
    stock.set_dtype(mx.float32)
    fast, report = patched_copy(stock)
    assert report.patched
    return stock, fast, tokenizer


def _chat(tokenizer, text):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )


def test_generate_and_stream_generate(models):
    stock, fast, tok = models
    prompt = _chat(tok, PROMPTS[0])
    text_stock = generate(stock, tok, prompt, max_tokens=24)
    text_fast = generate(fast, tok, prompt, max_tokens=24)
    assert text_fast == text_stock
    streamed = list(stream_generate(fast, tok, prompt, max_tokens=24))
    assert "".join(r.text for r in streamed) == text_fast
    assert streamed[-1].generation_tokens == len(streamed)
    assert streamed[-1].prompt_tokens == len(prompt)


def test_batch_generate_two_lengths(models):
    stock, fast, tok = models
    prompts = [_chat(tok, p) for p in PROMPTS]
    assert len(prompts[0]) != len(prompts[1])  # left padding in the batch
    kw = dict(max_tokens=16, return_token_ids=True)
    out_stock = batch_generate(stock, tok, prompts, **kw)
    out_fast = batch_generate(fast, tok, prompts, **kw)
    assert out_fast.token_ids == out_stock.token_ids
    # And each batched row equals the unbatched patched generation.
    for p, ids in zip(prompts, out_fast.token_ids):
        single = [r.token for r in stream_generate(fast, tok, p, max_tokens=16)]
        assert ids == single[: len(ids)]


def test_prompt_cache_save_load_round_trip(models, tmp_path):
    _, fast, tok = models
    prompt = _chat(tok, PROMPTS[1])
    cache = make_prompt_cache(fast)
    # Prefill the prompt into the cache (all but nothing left: mlx-lm feeds >= 1 token).
    for _ in stream_generate(fast, tok, prompt, max_tokens=1, prompt_cache=cache):
        pass
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    follow = tok.encode(" And then?", add_special_tokens=False)
    a = [r.token for r in stream_generate(fast, tok, follow, max_tokens=12, prompt_cache=cache)]
    b = [r.token for r in stream_generate(fast, tok, follow, max_tokens=12, prompt_cache=loaded)]
    assert a == b


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_streaming_chat_completion(demo_checkpoint):
    # The server loads the checkpoint as stored (bf16) and installs the fast
    # path; its text must equal the patched model's own generate in-process.
    model, tok = mlx_lm.load(str(demo_checkpoint))
    fast, _ = patched_copy(model)
    port = _free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_qwen_fast.server", "--model", str(demo_checkpoint),
         "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                assert proc.poll() is None, proc.stdout.read().decode()
                time.sleep(0.5)
        else:
            pytest.fail("server did not start within 120 s")
        body = {
            "messages": [{"role": "user", "content": PROMPTS[0]}],
            "max_tokens": 16,
            "temperature": 0.0,
            "stream": True,
        }
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        chunks, done = [], False
        with urllib.request.urlopen(req, timeout=120) as resp:
            assert resp.status == 200
            for raw in resp:
                line = raw.decode().strip()
                if not line or line.startswith(":"):  # SSE comments (mlx-lm's keepalives)
                    continue
                assert line.startswith("data: "), line
                payload = line[len("data: "):]
                if payload == "[DONE]":
                    done = True
                    break
                chunk = json.loads(payload)
                assert chunk["object"] == "chat.completion.chunk"
                assert isinstance(chunk["id"], str) and chunk["choices"]
                chunks.append(chunk)
        assert done and chunks
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
        expected = generate(fast, tok, _chat(tok, PROMPTS[0]), max_tokens=16)
        assert text == expected
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_generate_cli_fast_and_stock(demo_checkpoint):
    """`python -m mlx_qwen_fast.generate` takes mlx_lm.generate's flags (+ --stock)."""
    texts = {}
    for flag in ([], ["--stock"]):
        proc = subprocess.run(
            [sys.executable, "-m", "mlx_qwen_fast.generate", "--model", str(demo_checkpoint),
             "--prompt", PROMPTS[0], "--max-tokens", "8", "--verbose", "False", *flag],
            capture_output=True, text=True, timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        assert ("mlx_qwen_fast: patched" in proc.stderr) == (not flag), proc.stderr
        texts[bool(flag)] = proc.stdout
    assert texts[False].strip() and texts[True].strip()
