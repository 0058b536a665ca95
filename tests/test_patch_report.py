"""``mlx_qwen_fast.patch_report``: the implementation each op runs
(``op_implementations``, a patched model's ``PatchReport.ops``) as the
switches and the decode planner choose it, and the kernels a model's
weights make the op families decline (reported stock, warned about once
per op and reason). The patch itself: test_patch.py."""

import warnings

import pytest

from mlx_qwen_fast import backend, config
from mlx_qwen_fast.checkpoint import build_model
from mlx_qwen_fast.kernels import _cuda_build as cb
from mlx_qwen_fast.patching import patch


def test_op_implementations_per_backend():
    from mlx_qwen_fast import op_implementations

    cur = op_implementations()
    assert set(cur) == {f"{f}.{p}" for f in ("gated_delta", "attention", "moe") for p in ("prefill", "decode")} | {
        "linear.prefill", "linear.decode", "lm_head.decode", "model.decode"}
    # the prefill GEMM only where CUDA runs it and its switch is on
    assert cur["linear.prefill"] == ("cuda-kernel" if cb.cuda_available() and config.PREFILL_GEMM_KERNEL.get()
                                     else "stock")
    # the flash-attention kernel where CUDA runs it, else mlx-lm's module
    assert cur["attention.prefill"] == ("cuda-kernel" if cb.cuda_available() else "stock")
    assert cur["attention.decode"] == "compiled-layer"  # ops.decoder, on every backend
    cpu = op_implementations("cpu")
    assert cpu["moe.prefill"] == cpu["moe.decode"] == "stock"
    assert cpu["attention.prefill"] == cpu["linear.prefill"] == "stock"
    assert cpu["linear.decode"] == cpu["lm_head.decode"] == "stock"  # the fused GEMV is CUDA's
    assert cpu["model.decode"] == "compiled-layer"  # the whole stack needs the GDN and MoE decode kernels
    assert cpu["gated_delta.prefill"] == "chunked"
    if not cb.cuda_available():
        # "cuda" asked for where MLX has no CUDA device: what would run here, every family alike
        assert op_implementations("cuda") == cpu
        assert cur == cpu
    for bad in ("", "gpu", "CUDA"):
        with pytest.raises(ValueError, match="backend"):
            op_implementations(bad)


# ---------------------------------------------------------------------------
# quantisations other than the kernels' format


@pytest.fixture
def cuda_machine(monkeypatch, env):
    """patch() as on a machine with a CUDA device and the kernels switched
    on (its decisions and report only: nothing under it runs a model)."""
    monkeypatch.setattr(backend, "current", lambda: "cuda")
    monkeypatch.setattr(cb, "cuda_available", lambda: True)
    env.unset(config.MOE_PREFILL_KERNEL.name)
    env.unset(config.MOE_DECODE_KERNEL.name)


_KERNELS = {"moe.prefill": "cuda-prefill", "moe.decode": "cuda-decode"}


@pytest.mark.parametrize("switch, row, one_launch, launches", [
    (config.MOE_BLOCK_KERNEL, "moe.decode", "cuda-block", "cuda-decode"),
    (config.GDN_MIXER_KERNEL, "gated_delta.decode", "cuda-mixer", "cuda-kernel"),
], ids=["moe_block", "gdn_mixer"])
def test_report_follows_the_one_launch_switches(cuda_machine, env, switch, row, one_launch, launches):
    """The MoE (GDN) decode entry names the one-launch block (mixer) exactly
    when its switch and the fused GEMV are on; the whole-stack step is kept
    either way."""
    from mlx_qwen_fast import op_implementations

    for on, gemv, want in (("0", "1", launches), ("1", "1", one_launch), ("1", "0", launches)):
        env.set(switch.name, on)
        env.set(config.DECODE_GEMV_KERNEL.name, gemv)
        table = op_implementations()
        assert table[row] == want, (on, gemv)
        assert table["model.decode"] == "compiled-model", (on, gemv)


def test_report_follows_the_decode_planner(cuda_machine, env):
    """The report's decode rows are the decode planner's
    (``ops.decoder.decode_routes``) and follow each route switch -- the
    whole-stack and layer steps, the one-launch mixer and MoE block --
    in ``op_implementations`` and in a patched model's report, patched again
    after the change; a router of another format narrows the block to the
    three launches for that model only."""
    from mlx_qwen_fast import op_implementations
    from mlx_qwen_fast.ops import decoder

    model, _ = build_model("tiny", seed=0)
    odd, _ = build_model("tiny", seed=0, parts={"router": {"bits": 3}})
    for layer_on, model_on, mixer, block in ((1, 1, 1, 1), (1, 0, 1, 1), (1, 1, 0, 0), (1, 0, 0, 1), (0, 1, 1, 1)):
        env.set(config.DECODE_LAYER_STEP.name, str(layer_on))
        env.set(config.DECODE_MODEL_STEP.name, str(model_on))
        env.set(config.GDN_MIXER_KERNEL.name, str(mixer))
        env.set(config.MOE_BLOCK_KERNEL.name, str(block))
        case = (layer_on, model_on, mixer, block)
        routes = decoder.decode_routes()
        assert routes == decoder.decode_routes("cuda")
        want = {
            "model.decode": "stock" if not layer_on else "compiled-model" if model_on else "compiled-layer",
            "gated_delta.decode": "cuda-mixer" if layer_on and mixer else "cuda-kernel",
            "moe.decode": "cuda-block" if layer_on and block else "cuda-decode",
            "attention.decode": "compiled-layer+cuda-kernel" if layer_on else "stock",
            "linear.decode": "compiled-layer+cuda-kernel" if layer_on else "stock",
            "lm_head.decode": "cuda-kernel",
        }
        assert routes.table() == want, case
        table = op_implementations()
        assert {k: v for k, v in table.items() if k.endswith(".decode")} == want, case
        assert table["moe.prefill"] == "cuda-prefill" and table["gated_delta.prefill"] == "cuda-kernel", case
        report = patch(model, warn=False)
        assert report.ops == table and model.patch_report is report, case
        odd_ops = patch(odd, warn=False).ops
        narrowed = decoder.decode_routes(model=odd)  # the patched model's fast blocks
        assert narrowed._replace(moe=routes.moe) == routes, case
        assert narrowed.moe == ("cuda-decode" if routes.moe == "cuda-block" else routes.moe), case
        assert odd_ops == dict(table, **{"moe.decode": narrowed.moe}), case


def test_report_declines_the_moe_block_with_the_decode_kernels(cuda_machine, env):
    """With the one-launch MoE block on, experts of a quantisation the MoE
    decode kernels decline are reported stock, as with the block off."""
    env.set(config.MOE_BLOCK_KERNEL.name, "1")
    model, _ = build_model("tiny", seed=0, parts={"experts": {"bits": 3}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = patch(model)
    assert report.ops["moe.decode"] == "stock" and "moe.decode" in report.declined
    model, _ = build_model("tiny", seed=0)
    report = patch(model, warn=False)
    assert report.ops["moe.decode"] == "cuda-block" and not report.declined


@pytest.mark.parametrize(
    "kwargs, declined",
    [
        ({}, {}),  # the layout the kernels read
        # issue 31's H200 case: 3-bit experts were reported as running the 4-bit kernels
        ({"parts": {"experts": {"bits": 3}, "attention": {"bits": 8}, "shared_expert": {"bits": 8}}},
         {"moe.prefill": "moe experts: 3-bit weights (switch_mlp.gate_proj)",
          "moe.decode": "moe experts: 3-bit weights (switch_mlp.gate_proj)"}),
        ({"bits": 8}, {"moe.prefill": "moe experts: 8-bit weights", "moe.decode": "moe experts: 8-bit weights"}),
        ({"mode": "mxfp4"}, {"moe.prefill": "moe experts: mxfp4 weights", "moe.decode": "moe experts: mxfp4 weights"}),
        ({"parts": {"shared_expert": {"bits": 8}}}, {"moe.decode": "moe shared expert: 8-bit weights"}),
        ({"parts": {"attention": {"bits": 8}, "linear_attention": {"mode": "nvfp4"}, "router": {"bits": 3}}}, {}),
    ],
)
def test_patch_report_declines_kernels_for_other_quantisations(cuda_machine, kwargs, declined):
    """Where the CUDA kernels would run, an op whose modules are quantised
    another way is reported stock, with one warning per op and reason naming
    both, and its dispatcher keeps to that decision; the layout the kernels
    read (and quantisations of the parts they do not read) keep them."""
    model, _ = build_model("tiny", seed=0, **kwargs)
    layers = len(model.layers)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = patch(model)
    assert report.patched and report.backend == "cuda"
    assert report.ops["gated_delta.prefill"] == "cuda-kernel"
    # the one-launch mixer reads affine 4-bit group-64 projections; others take the three launches
    gdn_format = kwargs.get("parts", {}).get("linear_attention", {"bits": kwargs.get("bits", 4),
                                                                   "mode": kwargs.get("mode", "affine")})
    mixer = gdn_format.get("bits", 4) == 4 and gdn_format.get("mode", "affine") == "affine"
    assert report.ops["gated_delta.decode"] == ("cuda-mixer" if mixer else "cuda-kernel"), (kwargs, report.ops)
    # the one-launch MoE block reads an affine 4- or 8-bit router; another takes the three launches
    router_bits = kwargs.get("parts", {}).get("router", {}).get("bits", kwargs.get("bits", 8))
    kernels = dict(_KERNELS, **{"moe.decode": "cuda-block" if router_bits in (4, 8) else "cuda-decode"})
    for op, impl in kernels.items():
        assert report.ops[op] == ("stock" if op in declined else impl), (op, report.ops)
    assert set(report.declined) == set(declined)
    messages = [str(w.message) for w in caught]
    assert len(messages) == len(declined), messages
    for op, reason in declined.items():
        assert reason in report.declined[op] and f"in {layers} of {layers} layers" in report.declined[op]
        assert f"{op} kernel declined: {report.declined[op]}" in str(report)
        (msg,) = [m for m in messages if m.startswith(f"mlx_qwen_fast: {op} runs stock")]
        assert reason in msg and "the kernels implement affine 4-bit group 64" in msg
    # the Metal kernels read what the CUDA ones read (the Metal prefill: with any float scales)
    metal = {"metal-decode"} if "moe.decode" in declined else set()
    metal |= {"metal-prefill"} if "moe.prefill" in declined else set()
    for layer in model.layers:  # the decision the dispatcher reads
        assert set(layer.mlp._mqf_declined) == {_KERNELS[op] for op in declined} | metal


def test_patch_declines_per_layer_and_quietly_without_warn(cuda_machine):
    """Layers quantised differently from each other: the op keeps the kernel
    where it applies and the report counts the layers that run stock;
    warn=False keeps the report and drops the warnings; patching again
    decides again."""
    model, _ = build_model("tiny", seed=0)
    odd = build_model("tiny", seed=0, parts={"experts": {"bits": 3}})[0].layers
    for i in (1, 4):
        model.layers[i].mlp.switch_mlp = odd[i].mlp.switch_mlp
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = patch(model, warn=False)
    assert report.ops["moe.prefill"] == "cuda-prefill" and report.ops["moe.decode"] == "cuda-block"
    n = len(model.layers)
    assert report.declined == {op: f"moe experts: 3-bit weights (switch_mlp.gate_proj) in 2 of {n} layers"
                               for op in _KERNELS}
    assert [bool(layer.mlp._mqf_declined) for layer in model.layers] == [i in (1, 4) for i in range(n)]
    model.layers[1].mlp.switch_mlp = build_model("tiny", seed=0)[0].layers[1].mlp.switch_mlp
    with pytest.warns(UserWarning, match="in 1 of"):
        assert "in 1 of" in patch(model).declined["moe.prefill"]
    assert not model.layers[1].mlp._mqf_declined


@pytest.mark.parametrize("name", ["cpu", "metal"])
def test_no_kernel_to_decline_off_cuda(monkeypatch, name):
    """Off CUDA the MoE runs stock whatever the weights: nothing declined,
    no warning (the decision is still kept for the dispatcher)."""
    monkeypatch.setattr(backend, "current", lambda: name)
    model, _ = build_model("tiny", seed=0, parts={"experts": {"bits": 3}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = patch(model)
    assert report.backend == name and report.declined == {}
    assert report.ops["moe.prefill"] == report.ops["moe.decode"] == "stock"
    assert "declined" not in str(report)
    assert set(model.layers[0].mlp._mqf_declined) == {"cuda-prefill", "cuda-decode", "metal-decode", "metal-prefill"}
