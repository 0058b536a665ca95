"""The CLIs as they run mlx-lm (mlx_qwen_fast/_cli.py): usage errors one
line, exit code 2, before anything heavy is imported; --version, --stock,
--dtype; a model type without a fast path says so. The checks themselves:
test_cli_checks.py; the parser: test_cli_parser.py."""

import json
import os
import shutil
import sys

import pytest

from cli_run import run_python
from mlx_qwen_fast import _cli, _cli_checks


@pytest.fixture(scope="module")
def broken(tmp_path_factory, tiny_checkpoint):
    """Copies of the tiny checkpoint, each broken one way."""
    root = tmp_path_factory.mktemp("broken")
    out = {}
    for name in ("cfg", "nocfg", "trunc", "notok", "noweights", "shape", "emptyvocab", "fieldtype"):
        shutil.copytree(tiny_checkpoint, root / name)
        out[name] = root / name
    (out["cfg"] / "config.json").write_text("{not json")
    (out["nocfg"] / "config.json").unlink()
    shard = sorted(out["trunc"].glob("model*.safetensors"))[0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    (out["notok"] / "tokenizer.json").unlink()
    for f in out["noweights"].glob("model*.safetensors"):
        f.unlink()
    (out["noweights"] / "model.safetensors.index.json").unlink()
    cfg = json.loads((out["shape"] / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    text["moe_intermediate_size"] = 2 * text["moe_intermediate_size"]
    (out["shape"] / "config.json").write_text(json.dumps(cfg))
    cfg = json.loads((out["fieldtype"] / "config.json").read_text())
    cfg.get("text_config", cfg)["num_hidden_layers"] = "eight"  # parses, but mlx-lm's ModelArgs raise TypeError
    (out["fieldtype"] / "config.json").write_text(json.dumps(cfg))
    tok = json.loads((out["emptyvocab"] / "tokenizer.json").read_text())
    tok["model"]["vocab"] = {}
    (out["emptyvocab"] / "tokenizer.json").write_text(json.dumps(tok))
    out["file"] = shard
    return out


@pytest.mark.parametrize("case, expect", [
    ("cfg", "config.json is not valid JSON"),
    ("nocfg", "no config.json"),
    ("trunc", "is truncated"),
    ("notok", "no tokenizer"),
    ("noweights", "no weights"),
    ("emptyvocab", "no usable vocabulary"),
    ("file", "is a file"),
])
def test_broken_checkpoint_is_one_line_exit_2(broken, case, expect):
    r = run_python("-m", "mlx_qwen_fast.generate", "--model", str(broken[case]), "--prompt", "hi", "-m", "2")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--model {broken[case]}" in lines[0] and expect in lines[0], r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize("case, expect", [("shape", "shape"), ("fieldtype", "TypeError")])
def test_a_config_that_does_not_fit_is_one_line(broken, case, expect):
    """Weights of other shapes than config.json's, or a field of the wrong
    type: mlx-lm's error, on one line, exit 2."""
    r = run_python("-m", "mlx_qwen_fast.generate", "--model", str(broken[case]), "--prompt", "hi", "-m", "2")
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "could not load it" in last and expect in last
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("argv, expect", [
    (["-m", "mlx_qwen_fast.generate", "--model", "no-such-model-here"], "no such folder"),
    (["-m", "mlx_qwen_fast.generate", "--model", ""], "--model is empty"),
    (["-m", "mlx_qwen_fast.generate", "--model", "./no-such-model-here"], "no such folder"),
    (["-m", "mlx_qwen_fast", "bogus"], "unknown subcommand"),
    (["-m", "mlx_qwen_fast"], "a subcommand is needed"),
])
def test_usage_errors_without_a_checkpoint(argv, expect):
    r = run_python(*argv)
    assert r.returncode == 2 and expect in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("argv, expect", [
    (["-m", "mlx_qwen_fast.generate", "-m", "0"], "--max-tokens 0"),
    (["-m", "mlx_qwen_fast.generate", "--max-tokens=-3"], "--max-tokens -3"),
    (["-m", "mlx_qwen_fast.generate", "--prompt", "  "], "--prompt is empty"),
    (["-m", "mlx_qwen_fast", "benchmark", "-p", "0"], "--prompt-tokens 0"),
    (["-m", "mlx_qwen_fast", "benchmark", "-g", "x"], "--generation-tokens x"),
    (["-m", "mlx_qwen_fast", "benchmark", "-b", "0"], "--batch-size 0"),
    (["-m", "mlx_qwen_fast.generate", "--num-draft-tokens", "-2"], "--num-draft-tokens -2"),
    (["-m", "mlx_qwen_fast.generate", "--prefill-step-size", "0"], "--prefill-step-size 0"),
    (["-m", "mlx_qwen_fast", "benchmark", "--prefill-step-size=-5"], "--prefill-step-size -5"),
])
def test_bad_counts_and_prompts(tiny_checkpoint, argv, expect):
    r = run_python(*argv, "--model", str(tiny_checkpoint))
    assert r.returncode == 2 and expect in r.stderr, r.stderr


@pytest.mark.parametrize("stdin", ["", " \n\t\n"])
def test_an_empty_prompt_from_stdin_is_a_usage_error(tiny_checkpoint, stdin):
    r = run_python("-m", "mlx_qwen_fast.generate", "--model", str(tiny_checkpoint), "--prompt", "-", "-m", "2",
             stdin=stdin)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--prompt -" in lines[0] and "stdin" in lines[0], r.stderr
    assert r.stdout == ""


def test_version_names_ours_mlx_and_mlx_lm():
    import mlx.core as mx
    import mlx_qwen_fast

    r = run_python("-m", "mlx_qwen_fast", "--version")
    assert r.returncode == 0
    out = r.stdout.strip()
    assert out.startswith(f"mlx_qwen_fast {mlx_qwen_fast.__version__}") and f"mlx {mx.__version__}" in out
    assert "mlx-lm " in out
    assert run_python("-m", "mlx_qwen_fast.generate", "--version").stdout.strip() == out


def test_generate_runs_and_reports_the_patch(tiny_checkpoint):
    r = run_python("-m", "mlx_qwen_fast.generate", "--model", str(tiny_checkpoint), "--prompt", "hello", "-m", "3")
    assert r.returncode == 0, r.stderr
    assert "mlx_qwen_fast: patched" in r.stderr and "Generation: 3 tokens" in r.stdout


def test_a_package_warning_is_one_clean_line(tiny_checkpoint):
    """A switch value the package does not understand, through a CLI: one
    line in the CLI's format, not Python's warning (file:line, category,
    source line)."""
    r = run_python("-m", "mlx_qwen_fast.generate", "--model", str(tiny_checkpoint), "--prompt", "hi", "-m", "2",
             env={"MLX_QWEN_FAST": "banana"})
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stderr.splitlines() if "banana" in line]
    assert len(said) == 1 and said[0].startswith("mlx_qwen_fast: warning: MLX_QWEN_FAST='banana'"), r.stderr
    assert "RuntimeWarning" not in r.stderr and ".py:" not in r.stderr, r.stderr
    assert "mlx_qwen_fast: patched" in r.stderr  # the default (on) was used


def test_one_line_warnings_formats_the_packages_once_and_leaves_others(env, capsys):
    import warnings

    from mlx_qwen_fast import patching

    env.set("MLX_QWEN_FAST", "banana")
    with warnings.catch_warnings(record=True) as others:
        warnings.simplefilter("always")
        with _cli.one_line_warnings():
            assert patching.enabled() is True  # the package's code warns about the value
            for _ in range(2):
                warnings.warn("mlx_qwen_fast: model left on the stock path: a reason")
            warnings.warn("mlx_qwen_fast: model left on the stock path: a reason")  # another line, same text
            warnings.warn("some other library's warning")
        warnings.warn("mlx_qwen_fast: after the CLI")  # the override ends with the context
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "mlx_qwen_fast: warning: MLX_QWEN_FAST='banana' is not understood (expected one of 1, true, yes, "
        "on, 0, false, no, off); using the default (True)",
        "mlx_qwen_fast: warning: model left on the stock path: a reason",
    ]
    assert [str(w.message) for w in others] == ["some other library's warning", "mlx_qwen_fast: after the CLI"]


def test_model_type_without_fast_path_says_so(tmp_path):
    """A llama-type checkpoint through the CLI: stock, with one line saying so."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    from mlx_qwen_fast.checkpoint import make_tokenizer

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=1, intermediate_size=128,
                           num_attention_heads=2, rms_norm_eps=1e-5, vocab_size=512, num_key_value_heads=2)
    model = llama.Model(args)
    mx.eval(model.parameters())
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp_path / "config.json").write_text(json.dumps(
        dict(model_type="llama", hidden_size=64, num_hidden_layers=1, intermediate_size=128,
             num_attention_heads=2, rms_norm_eps=1e-5, vocab_size=512, num_key_value_heads=2)))
    make_tokenizer(tmp_path)
    r = run_python("-m", "mlx_qwen_fast.generate", "--model", str(tmp_path), "--prompt", "hi", "-m", "2")
    assert r.returncode == 0, r.stderr
    assert "model_type 'llama' has no fast path" in r.stderr and "running stock" in r.stderr


# ---------------------------------------------------------------------------
# in process, mlx-lm's main replaced by a recording stand-in module
# ---------------------------------------------------------------------------

FAKE = "mqf_test_fake_cli"


@pytest.fixture
def fake_main(monkeypatch):
    """A module ``FAKE`` whose ``main`` records sys.argv[1:] and the graph
    limit variable at the time it runs."""
    import types

    from mlx_qwen_fast import config

    seen = []
    mod = types.ModuleType(FAKE)
    mod.main = lambda: seen.append((list(sys.argv[1:]), os.environ.get(config.MLX_GRAPH_LIMIT.name)))
    monkeypatch.setitem(sys.modules, FAKE, mod)
    monkeypatch.setattr("sys.argv", ["prog"])  # run_mlx_lm_main rewrites sys.argv
    return seen


def test_cli_says_when_it_runs_stock(fake_main, env, capsys):
    from mlx_qwen_fast.patching import install, uninstall

    _cli.run_mlx_lm_main(FAKE, ["--temp", "0", "--stock"])
    assert [argv for argv, _ in fake_main] == [["--temp", "0"]]
    assert "--stock: running stock mlx-lm" in capsys.readouterr().err
    env.set("MLX_QWEN_FAST", "off")
    try:
        assert install(verbose=True) is False
        err = capsys.readouterr().err
        assert "fast path is off" in err and "MLX_QWEN_FAST=off" in err and "stock mlx-lm" in err
    finally:
        uninstall()


def test_cli_model_flag_forms(fake_main, monkeypatch, tmp_path, capsys, tiny_checkpoint):
    """--model=PATH is checked like --model PATH; a checkpoint folder and a
    repo id pass; -m is mlx-lm's --max-tokens, not a model."""
    monkeypatch.setattr(_cli_checks, "_hub_offline", lambda: False)  # a repo id is left to mlx-lm to fetch
    for argv, what in (([f"--model={tmp_path}/nope", "--stock"], "no such folder"),
                       (["--model", str(tmp_path), "--stock"], "no config.json")):
        with pytest.raises(SystemExit) as exc:
            _cli.run_mlx_lm_main(FAKE, argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert what in err and err.count("\n") == 1, err  # one line
    assert not fake_main  # mlx-lm's main never ran
    _cli.run_mlx_lm_main(FAKE, ["--model", str(tiny_checkpoint), "--stock"])
    _cli.run_mlx_lm_main(FAKE, ["--model", "mlx-community/some-model", "--stock"])
    _cli.run_mlx_lm_main(FAKE, ["-m", "/x", "--stock"])
    assert len(fake_main) == 3


def test_cli_subcommands_that_pass(capsys):
    for argv in (["generate", "--prompt", "hi"], ["server"], ["dwq"], ["--help"], ["--version"]):
        _cli.check_subcommand(argv)  # mlx-lm's CLI modules (mlx_lm.quant's too) and its own flags pass
    with pytest.raises(SystemExit) as exc:
        _cli.check_subcommand(["--model", "m"])
    assert exc.value.code == 2 and "unknown subcommand" in capsys.readouterr().err


def test_stock_cli_undoes_the_graph_limit(fake_main, process_environment):
    """--stock removes what the import set (a process that has not used the
    GPU yet then runs with MLX's defaults)."""
    from mlx_qwen_fast import config

    assert config.apply_process_settings("cuda")
    _cli.run_mlx_lm_main(FAKE, ["--stock"])
    assert fake_main == [([], None)]
    assert config.MLX_PTX_CACHE.name not in os.environ


@pytest.mark.parametrize("argv, expect", [
    (["-m", "mlx_qwen_fast.generate", "-m0"], "--max-tokens 0"),
    (["-m", "mlx_qwen_fast.generate", "--max-tok", "0"], "--max-tokens 0"),
    (["-m", "mlx_qwen_fast", "benchmark", "-n=0"], "--num-trials 0"),
    (["-m", "mlx_qwen_fast", "benchmark", "-b0"], "--batch-size 0"),
    (["-m", "mlx_qwen_fast", "benchmark", "--prompt-tok=0"], "--prompt-tokens 0"),
])
def test_counts_in_every_spelling_argparse_takes(tiny_checkpoint, argv, expect):
    r = run_python(*argv, "--model", str(tiny_checkpoint))
    assert r.returncode == 2 and expect in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_an_mlx_lm_module_without_main_is_not_a_subcommand():
    r = run_python("-m", "mlx_qwen_fast", "utils")
    assert r.returncode == 2 and "unknown subcommand 'utils'" in r.stderr


def test_a_quoted_tilde_model_path_is_expanded(tiny_checkpoint, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    shutil.copytree(tiny_checkpoint, home / "ck")
    r = run_python("-m", "mlx_qwen_fast.generate", "--model", "~/ck", "--prompt", "hi", "-m", "2",
                   env={"HOME": str(home)})
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def draft_checkpoint(tmp_path_factory):
    """The tiny-draft preset's checkpoint (4 layers, the tiny vocabulary)."""
    from mlx_qwen_fast.checkpoint import DEMO_LM_HEAD_SCALE, write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("draft"), "tiny-draft", seed=1,
                            lm_head_scale=DEMO_LM_HEAD_SCALE)


def test_generate_with_a_draft_model(demo_checkpoint, draft_checkpoint):
    """`--draft-model` through our generate entry point: mlx-lm's speculative
    decoding runs on the patched target and draft (both loaded patched) and
    prints plain generation's text (on the CPU a verify's tokens get the
    bits one-token decoding gives them: tests/test_speculative.py); with
    `--stock` mlx-lm refuses the hybrid model's caches."""
    args = ("-m", "mlx_qwen_fast.generate", "--model", str(demo_checkpoint), "--prompt", "Tell me about rivers.",
            "-m", "12", "--verbose", "False")
    plain = run_python(*args, timeout=300)
    assert plain.returncode == 0, plain.stderr
    spec = run_python(*args, "--draft-model", str(draft_checkpoint), "--num-draft-tokens", "3", timeout=300)
    assert spec.returncode == 0, spec.stderr
    assert spec.stderr.count("mlx_qwen_fast: patched") == 2, spec.stderr  # target and draft
    assert spec.stdout.strip() and spec.stdout == plain.stdout
    stock = run_python(*args, "--draft-model", str(draft_checkpoint), "--stock", timeout=300)
    assert stock.returncode != 0 and "requires a trimmable prompt cache" in stock.stderr, stock.stderr


def test_dtype_float32_makes_patched_and_stock_tokens_agree(demo_checkpoint):
    """`--dtype float32`: the model is cast before the fast path patches it
    (the report names no kernel the fp32 model would decline), and the
    patched and the `--stock` run print the same text; a bad value or the
    flag twice is one line, exit code 2."""
    args = ("-m", "mlx_qwen_fast.generate", "--model", str(demo_checkpoint), "--prompt", "Tell me about rivers.",
            "-m", "16", "--verbose", "False")
    fast = run_python(*args, "--dtype", "float32", timeout=300)
    stock = run_python(*args, "--dtype=float32", "--stock", timeout=300)
    assert fast.returncode == 0 and stock.returncode == 0, fast.stderr + stock.stderr
    assert "mlx_qwen_fast: patched" in fast.stderr
    assert fast.stdout.strip() and fast.stdout == stock.stdout
    for bad, expect in ((("--dtype", "float8"), "--dtype: expected one of bfloat16, float16, float32, got 'float8'"),
                        (("--dtype", "float32", "--dtype", "float16"), "--dtype given 2 times: expected one")):
        r = run_python("-m", "mlx_qwen_fast.generate", "--model", str(demo_checkpoint), "--prompt", "hi", *bad)
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [f"mlx_qwen_fast: error: {expect}"], r.stderr


def test_cast_model_keeps_what_the_checkpoint_keeps_in_float32():
    """cast_model: float32 casts every floating parameter; bfloat16/float16
    cast the 16-bit ones and leave float32 ones (A_log); integer (packed
    quantised) weights never change."""
    import copy

    from mlx.utils import tree_flatten

    import mlx.core as mx

    from mlx_qwen_fast._cli import cast_model
    from mlx_qwen_fast.checkpoint import build_model

    model, _ = build_model("tiny", seed=0)
    before = dict(tree_flatten(model.parameters()))
    assert any(v.dtype == mx.float32 for v in before.values()) and any(v.dtype == mx.uint32 for v in before.values())
    for dtype in (mx.float32, mx.float16):
        m = copy.deepcopy(model)
        cast_model(m, dtype)
        for k, v in tree_flatten(m.parameters()):
            was = before[k].dtype
            if was == mx.uint32:
                assert v.dtype == mx.uint32, k
            elif dtype == mx.float32 or was in (mx.bfloat16, mx.float16):
                assert v.dtype == dtype, k
            else:
                assert v.dtype == was, k


def test_install_dtype_casts_what_mlx_lm_loads(monkeypatch, tiny_checkpoint):
    """After install_dtype("float32"), mlx_lm.load returns a model whose
    floating parameters are all float32 (the checkpoint's are bfloat16)."""
    import mlx.core as mx
    import mlx_lm
    import mlx_lm.utils
    from mlx.utils import tree_flatten

    monkeypatch.setattr(mlx_lm.utils, "load_model", mlx_lm.utils.load_model)  # undone after the test
    model, _ = mlx_lm.load(str(tiny_checkpoint))
    assert mx.bfloat16 in {v.dtype for _, v in tree_flatten(model.parameters())}
    _cli.install_dtype("float32")
    model, _ = mlx_lm.load(str(tiny_checkpoint))
    dtypes = {v.dtype for _, v in tree_flatten(model.parameters())}
    assert dtypes <= {mx.float32, mx.uint32} and mx.float32 in dtypes
