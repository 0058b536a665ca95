"""The DFlash command lines: the drafter presets of ``python -m
mlx_qwen_fast.checkpoint`` and ``--dflash-drafter DIR`` on ``python -m
mlx_qwen_fast.generate`` (subprocesses on tiny checkpoints); usage errors
are one line, exit code 2, before mlx-lm is imported where the check needs
no model."""

import json
import math
import os
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from cli_run import run_module
from mlx_qwen_fast.dflash import load_drafter, presets
from mlx_qwen_fast.dflash.drafter import DFlashDrafter, DrafterArgs


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("dflash") / "tiny-dflash"
    r = run_module("mlx_qwen_fast.checkpoint", "--preset", "tiny-dflash", "--out", str(out), "--seed", "3")
    assert r.returncode == 0, r.stderr
    assert "DFlash drafter tiny-dflash" in r.stdout
    return out


def test_the_checkpoint_cli_writes_a_drafter(drafter_dir):
    """The folder holds z-lab's files; it loads with the preset's weights
    for that seed; writing again needs --overwrite; target-only flags are
    refused (one line, exit 2, mlx-lm not imported)."""
    assert sorted(p.name for p in drafter_dir.iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_drafter(drafter_dir)
    want, cfg = presets.build_drafter("tiny-dflash", seed=3)
    assert json.loads((drafter_dir / "config.json").read_text()) == cfg
    for (k, a), (k2, b) in zip(tree_flatten(loaded.parameters()), tree_flatten(want.parameters())):
        assert k == k2 and mx.array_equal(a, b).item(), k
    again = run_module("mlx_qwen_fast.checkpoint", "--preset", "tiny-dflash", "--out", str(drafter_dir))
    assert again.returncode == 2 and "pass --overwrite" in again.stderr and len(again.stderr.splitlines()) == 1
    flags = run_module("mlx_qwen_fast.checkpoint", "--preset", "tiny-dflash", "--out", str(drafter_dir / "x"),
                       "--bits", "8")
    assert flags.returncode == 2 and flags.heavy() == []
    assert flags.stderr.strip().endswith("--bits apply to target presets only (a drafter takes --out, --overwrite "
                                         "and --seed)")


def test_the_full_preset_has_the_published_layout():
    """qwen3.6-35b-a3b-dflash: z-lab's config keys and values named in the
    published drafter's description, and its weight names and shapes
    (computed from the lazy model: nothing is drawn)."""
    cfg = presets.preset_config("qwen3.6-35b-a3b-dflash")
    assert cfg["dflash_config"] == {"mask_token_id": 248070, "target_layer_ids": [1, 10, 19, 28, 37]}
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["head_dim"], cfg["block_size"], cfg["vocab_size"]) == \
        (2048, 8, 6144, 32, 4, 128, 16, 248320)
    assert cfg["rope_scaling"]["rope_type"] == "yarn" and cfg["model_type"] == "qwen3"
    model = DFlashDrafter(DrafterArgs.from_dict(cfg))
    shapes = {k: v.shape for k, v in tree_flatten(model.parameters())}
    assert shapes["fc.weight"] == (2048, 5 * 2048)
    assert shapes["hidden_norm.weight"] == shapes["norm.weight"] == (2048,)
    assert shapes["layers.7.self_attn.q_proj.weight"] == (4096, 2048)
    assert shapes["layers.7.self_attn.k_proj.weight"] == (512, 2048)
    assert shapes["layers.0.self_attn.k_norm.weight"] == (128,)
    assert shapes["layers.3.mlp.down_proj.weight"] == (2048, 6144)
    assert len(shapes) == 4 + 8 * 11 - 1  # fc, hidden_norm, norm + 11 a layer
    n = sum(math.prod(s) for s in shapes.values())
    assert 470e6 < n < 480e6  # ~0.95 GB in bf16, the published folder's size


def _generate(model, *extra, tokens="12"):
    return run_module("mlx_qwen_fast.generate", "--model", str(model), "--prompt", "Tell me about rivers.",
                      "-m", tokens, "--verbose", "False", *extra, timeout=300)


def test_generate_with_a_dflash_drafter(demo_checkpoint, drafter_dir):
    """`--dflash-drafter DIR` through our generate entry point prints plain
    generation's text (the target patched, the drafter loaded as a DFlash
    drafter, not patched as a target); --verbose adds the acceptance line."""
    plain = _generate(demo_checkpoint)
    assert plain.returncode == 0, plain.stderr
    got = _generate(demo_checkpoint, "--dflash-drafter", str(drafter_dir))
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() and got.stdout == plain.stdout
    assert got.stderr.count("mlx_qwen_fast: patched") == 1 and "has no fast path" not in got.stderr
    verbose = run_module("mlx_qwen_fast.generate", "--model", str(demo_checkpoint), "--prompt", "Hi",
                         "-m", "5", f"--dflash-drafter={drafter_dir}", "--verbose", "True", timeout=300)
    assert verbose.returncode == 0 and "DFlash: " in verbose.stdout and "% of drafts accepted" in verbose.stdout


def _bad(tmp_path, drafter_dir):
    nokeys = tmp_path / "nokeys"
    nokeys.mkdir()
    (nokeys / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 256}))
    noweights = tmp_path / "noweights"
    noweights.mkdir()
    (noweights / "config.json").write_text((drafter_dir / "config.json").read_text())
    return {"missing": (tmp_path / "absent", "no such folder"),
            "nokeys": (nokeys, "config.json lacks 'num_hidden_layers'"),
            "noweights": (noweights, "no weights (model*.safetensors)")}


@pytest.mark.parametrize("case", ["missing", "nokeys", "noweights"])
def test_a_bad_drafter_folder_is_one_line_before_mlx_lm(tmp_path, drafter_dir, tiny_checkpoint, case):
    folder, expect = _bad(tmp_path, drafter_dir)[case]
    r = _generate(tiny_checkpoint, "--dflash-drafter", str(folder))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--dflash-drafter {folder}: {expect}" in lines[0], r.stderr
    assert r.heavy() == []


@pytest.mark.parametrize("extra, expect", [
    (("--stock",), "drop --stock"),
    (("--draft-model", "x"), "--dflash-drafter and --draft-model cannot both be given"),
    (("--dflash-drafter", "DIR"), "given 2 times"),
])
def test_flags_that_do_not_go_with_it(tiny_checkpoint, drafter_dir, extra, expect):
    extra = [str(drafter_dir) if e == "DIR" else e for e in extra]
    r = _generate(tiny_checkpoint, "--dflash-drafter", str(drafter_dir), *extra)
    assert r.returncode == 2 and expect in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.heavy() == []


def _other_vocabulary(drafter_dir, tmp_path):
    """A copy of the drafter folder whose config names another vocabulary (2048)."""
    other = tmp_path / "other"
    other.mkdir()
    cfg = json.loads((drafter_dir / "config.json").read_text())
    cfg["vocab_size"] = 2048
    (other / "config.json").write_text(json.dumps(cfg))
    (other / "model.safetensors").write_bytes((drafter_dir / "model.safetensors").read_bytes())
    return other


def test_the_fast_path_switched_off_is_a_usage_error(tiny_checkpoint, drafter_dir):
    """MLX_QWEN_FAST=0 (what --stock does, from the environment) with the
    flag: one line naming the variable, exit code 2, before mlx-lm loads."""
    for module in ("mlx_qwen_fast.generate", "mlx_qwen_fast.server"):
        r = run_module(module, "--model", str(tiny_checkpoint), "--dflash-drafter", str(drafter_dir),
                       env={"MLX_QWEN_FAST": "0"}, timeout=120)
        assert r.returncode == 2, r.stderr
        assert r.stderr.strip().splitlines() == [
            "mlx_qwen_fast: error: --dflash-drafter needs the fast path (its Gated DeltaNet caches roll back): "
            "MLX_QWEN_FAST switches it off in the environment"], r.stderr
        assert r.heavy() == []


def test_a_drafter_that_does_not_fit_the_target(tmp_path, drafter_dir, tiny_checkpoint):
    """A drafter of another vocabulary: found once the target is loaded,
    one line naming the flag and what differs."""
    other = _other_vocabulary(drafter_dir, tmp_path)
    r = _generate(tiny_checkpoint, "--dflash-drafter", str(other))
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("mlx_qwen_fast: error: --dflash-drafter") and "vocab_size 2048 does not match" in last


# --- the server ---------------------------------------------------------------


def test_server_with_a_dflash_drafter(tiny_checkpoint, drafter_dir, tmp_path):
    """`python -m mlx_qwen_fast.server --dflash-drafter DIR`: chat answers
    are the plain server's greedy text, twice (the second request on the
    prompt cache the first left), through the DFlash loop (the server logs
    its draft model as the drafter); a drafter of another vocabulary ends
    the server at start with one line, exit code 2."""
    import openai

    from test_server import MESSAGES, REPO, _free_port, _serving

    def chat(srv):
        client = openai.OpenAI(base_url=srv.url("/v1"), api_key="x", max_retries=0, timeout=120)
        r = client.chat.completions.create(model=srv.model, messages=MESSAGES, max_tokens=10, temperature=0.0)
        return r.choices[0].message.content

    plain_root, spec_root = tmp_path / "plain", tmp_path / "spec"
    plain_root.mkdir()
    spec_root.mkdir()
    with _serving(tiny_checkpoint, plain_root) as plain:
        want = chat(plain)
    assert want
    with _serving(tiny_checkpoint, spec_root, "--dflash-drafter", str(drafter_dir)) as spec:
        assert [chat(spec), chat(spec)] == [want, want]
        log = spec.log_text()
        assert log.count("mlx_qwen_fast: patched") == 1, log[-4000:]
        assert f"mlx_qwen_fast: draft model: the DFlash drafter in {drafter_dir}" in log, log[-4000:]

    other = _other_vocabulary(drafter_dir, tmp_path)
    # a plain subprocess: the server ends with os._exit (from mlx-lm's generation thread), which
    # skips run_module's module report
    r = subprocess.run([sys.executable, "-m", "mlx_qwen_fast.server", "--model", str(tiny_checkpoint),
                        "--port", str(_free_port()), "--dflash-drafter", str(other)],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("mlx_qwen_fast: error: --dflash-drafter") and "vocab_size 2048 does not match" in last


@pytest.mark.parametrize("extra, expect", [
    (("--stock",), "drop --stock"),
    (("--draft-model", "x"), "--dflash-drafter and --draft-model cannot both be given"),
])
def test_server_flags_that_do_not_go_with_it(tiny_checkpoint, drafter_dir, extra, expect):
    r = run_module("mlx_qwen_fast.server", "--model", str(tiny_checkpoint), "--dflash-drafter", str(drafter_dir),
                   *extra, timeout=120)
    assert r.returncode == 2 and expect in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.heavy() == []
