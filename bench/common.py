"""Shared pieces of the benchmarks.

* provenance: :func:`device_name`, :func:`git_commit`, :func:`result_header`;
* results: :func:`default_out`, :func:`write_json`, :func:`read_json`,
  :func:`merge_records` (for ``--append``);
* timing: :func:`measure`, :func:`stats`, :func:`peak_gb`, :func:`is_oom`;
* checkpoints: :func:`add_checkpoint_args`, :func:`load_checkpoint`,
  :func:`random_tokens`, :func:`parse_lengths`;
* the roofline model: :class:`ModelShape`, :class:`Quant`, :class:`Roofline`
  (decode bytes per token and prefill FLOPs per token from the config).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "bench" / "results"

#: Every status a measurement may carry. "error" is any exception other than
#: an allocation failure (message in the record's ``error`` field), recorded so
#: that one failing point does not lose a whole sweep.
STATUSES = ("ok", "timeout", "oom", "error")

#: Top-level keys every result file has (``kind``-specific keys come on top).
HEADER_KEYS = (
    "kind",
    "date",
    "device",
    "backend",
    "mlx_version",
    "mlx_lm_version",
    "python",
    "commit",
    "kernel_image",
    "config",
)

GB = 1e9


# ---------------------------------------------------------------------------
# Provenance
# ---------------------------------------------------------------------------


def backend_name() -> str:
    """"cpu", "cuda" or "metal": the backend of MLX's default device."""
    from mlx_qwen_fast import backend

    return backend.current()


def device_name() -> str:
    """Name of the device the benchmarks run on.

    On CUDA the first line of ``nvidia-smi --query-gpu=name`` (e.g. "NVIDIA
    H200") when nvidia-smi is there, else ``mx.device_info()["device_name"]``
    (the CPU model on the CPU backend).
    """
    if backend_name() == "cuda":
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            names = [line.strip() for line in out.stdout.splitlines() if line.strip()]
            if out.returncode == 0 and names:
                return names[0]
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        name = mx.device_info().get("device_name")
    except Exception:  # device_info is informational only
        name = None
    return name or platform.processor() or platform.machine() or "unknown"


def slug(text: str) -> str:
    """``"NVIDIA H200"`` -> ``"nvidia-h200"`` (for file names)."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def git_commit() -> str:
    """``git rev-parse HEAD`` of this repository, + "-dirty" when tracked files
    differ from it; "unknown" without git. The environment variable
    ``BENCH_COMMIT`` overrides it (for copies of the tree without ``.git``)."""
    env = os.environ.get("BENCH_COMMIT")
    if env:
        return env
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=20,
        )
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=20,
        )
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def versions() -> Dict[str, str]:
    import mlx_lm

    return {"mlx_version": mx.__version__, "mlx_lm_version": mlx_lm.__version__}


def today() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")


def jsonable(value: Any) -> Any:
    """Plain-JSON form of argparse values, dataclasses, numpy scalars, dtypes."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return jsonable(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def kernel_image() -> Optional[str]:
    """How the package's CUDA kernels are launched here (``_cuda_fatbin.fatbin_id``:
    compressed fatbin or plain cubin); None off the CUDA backend."""
    if backend_name() != "cuda":
        return None
    from mlx_qwen_fast.kernels import _cuda_fatbin

    return _cuda_fatbin.fatbin_id()


def result_header(kind: str, args: Optional[argparse.Namespace] = None, **extra) -> Dict:
    """The top-level keys of every result file (:data:`HEADER_KEYS`) + ``extra``."""
    header = {
        "kind": kind,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(),
        "backend": backend_name(),
        **versions(),
        "python": platform.python_version(),
        "commit": git_commit(),
        "kernel_image": kernel_image(),
        "config": jsonable(vars(args)) if args is not None else {},
    }
    header.update(jsonable(extra))
    return header


# ---------------------------------------------------------------------------
# Result files
# ---------------------------------------------------------------------------


def default_out(kind: str, device: Optional[str] = None) -> Path:
    """``bench/results/<date>-<device>-<kind>.json``."""
    return RESULTS_DIR / f"{today()}-{slug(device or device_name())}-{kind}.json"


def write_json(path, data: Dict) -> Path:
    """Write ``data`` as JSON (atomically: temp file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(jsonable(data), f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path


def read_json(path) -> Dict:
    with open(path) as f:
        return json.load(f)


def merge_records(
    old: Sequence[Dict], new: Sequence[Dict], key: Callable[[Dict], Any]
) -> List[Dict]:
    """``old`` records updated by ``new`` ones with the same ``key`` (new wins),
    in the order of ``key`` values first seen."""
    merged: Dict[Any, Dict] = {}
    for rec in list(old) + list(new):
        merged[key(rec)] = rec
    return list(merged.values())


# ---------------------------------------------------------------------------
# Timing and memory
# ---------------------------------------------------------------------------


def measure(
    fn: Callable[[], Any],
    *,
    warmup: int = 1,
    repeats: int = 5,
    budget_s: Optional[float] = None,
) -> List[float]:
    """Wall-clock seconds of ``mx.eval(fn())``, ``repeats`` times after ``warmup``.

    Each repeat: ``mx.synchronize()``, start the clock, build the graph
    (``fn()``), ``mx.eval`` it, ``mx.synchronize()``, stop. Stops early once the
    timed repeats have used ``budget_s`` (at least one is always timed).
    """
    for _ in range(warmup):
        mx.eval(fn())
    mx.synchronize()
    times: List[float] = []
    for _ in range(repeats):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        times.append(time.perf_counter() - t0)
        if budget_s is not None and sum(times) > budget_s:
            break
    return times


def stats(values: Iterable[float]) -> Dict[str, Optional[float]]:
    """``{"median", "min", "max", "n"}`` of ``values`` (None when empty)."""
    v = [float(x) for x in values]
    if not v:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": float(np.median(v)), "min": min(v), "max": max(v), "n": len(v)}


def reset_peak() -> None:
    mx.synchronize()
    mx.reset_peak_memory()


def peak_gb() -> float:
    """Peak memory MLX allocated since the last :func:`reset_peak`, in GB (1e9 B).
    Process-wide: it includes the weights and every live cache."""
    mx.synchronize()
    return mx.get_peak_memory() / GB


_OOM_PATTERNS = ("out of memory", "outofmemory", "unable to allocate", "malloc", "alloc")


def is_oom(exc: BaseException) -> bool:
    """True for the RuntimeError MLX raises when an allocation fails."""
    msg = str(exc).lower()
    return isinstance(exc, (RuntimeError, MemoryError)) and any(p in msg for p in _OOM_PATTERNS)


def free_memory() -> None:
    import gc

    gc.collect()
    mx.clear_cache()


# ---------------------------------------------------------------------------
# Checkpoints and inputs
# ---------------------------------------------------------------------------

PRESET_NAMES = ("qwen3.6-35b-a3b", "tiny")


def add_checkpoint_args(parser: argparse.ArgumentParser, default_preset="qwen3.6-35b-a3b"):
    """``--model PATH`` or ``--preset P --seed N --router-skew S``."""
    g = parser.add_argument_group("checkpoint")
    g.add_argument("--model", default=None,
                   help="mlx-lm checkpoint (path or HF repo) loaded with mlx_lm.load; "
                        "overrides --preset")
    g.add_argument("--preset", default=default_preset, choices=PRESET_NAMES,
                   help="random-weight model built in memory by "
                        "mlx_qwen_fast.checkpoint.build_model (default %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="weight seed of --preset")
    g.add_argument("--router-skew", type=float, default=0.0,
                   help="expert popularity skew of --preset (0 = uniform routing)")
    g.add_argument("--lm-head-scale", type=float, default=None,
                   help="lm_head multiplier of --preset (default 1.0: flat logits)")
    g.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="dtype of --preset's scales, norms and activations (default "
                        "bfloat16, as the real checkpoint; float32 makes CPU smoke runs "
                        "~5x faster: MLX's CPU bf16 quantized matmuls are slow)")


def load_checkpoint(args) -> Tuple[Any, Dict, Optional[Any]]:
    """``(model, config, tokenizer)`` from ``--model`` or ``--preset`` args.

    The tokenizer is None for a preset.
    """
    if getattr(args, "model", None):
        import mlx_lm

        model, tokenizer, config = mlx_lm.load(args.model, return_config=True)
        return model, config, tokenizer
    from mlx_qwen_fast.checkpoint import build_model

    model, config = build_model(
        args.preset,
        seed=args.seed,
        router_skew=args.router_skew,
        lm_head_scale=getattr(args, "lm_head_scale", None),
        dtype=getattr(mx, getattr(args, "dtype", "bfloat16")),
    )
    return model, config, None


def checkpoint_fields(args) -> Dict:
    """Top-level provenance of the checkpoint: ``model``, ``preset``, ``seed``,
    ``router_skew`` (preset fields are None with ``--model``)."""
    if getattr(args, "model", None):
        return {"model": args.model, "preset": None, "seed": None, "router_skew": None,
                "dtype": None}
    return {"model": None, "preset": args.preset, "seed": args.seed,
            "router_skew": args.router_skew, "dtype": getattr(args, "dtype", "bfloat16")}


def text_args(model):
    """The text model's ``ModelArgs`` (mlx-lm ``qwen3_5``/``qwen3_5_moe``)."""
    lm = getattr(model, "language_model", None)
    return lm.args if lm is not None else model.args


def random_tokens(n: int, vocab_size: int, seed: int = 0) -> mx.array:
    """``n`` token ids uniform in ``[1, vocab_size)`` (never 0), int32, fixed seed."""
    rng = np.random.default_rng(seed)
    return mx.array(rng.integers(1, vocab_size, size=n, dtype=np.int64).astype(np.int32))


def parse_lengths(text: str) -> List[int]:
    """``"256,512,1k,2K,1m"`` -> ``[256, 512, 1024, 2048, 1048576]`` (k = 1024)."""
    out = []
    if text.strip().lower() == "none":
        return out
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1
        if part.endswith("k"):
            mult, part = 1024, part[:-1]
        elif part.endswith("m"):
            mult, part = 1024 * 1024, part[:-1]
        value = int(float(part) * mult)
        if value < 1:
            raise argparse.ArgumentTypeError(f"length must be >= 1, got {part!r}")
        out.append(value)
    return out


def lengths_arg(text: str) -> List[int]:
    try:
        return parse_lengths(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def fmt_len(n: int) -> str:
    """1024 -> "1K", 131072 -> "128K", 300 -> "300"."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


# ---------------------------------------------------------------------------
# Roofline model
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class ModelShape:
    """The dimensions of a Qwen3.5/3.6-MoE text model that the byte and FLOP
    counts need."""

    hidden: int
    layers: int
    attn_layers: int
    gdn_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    gdn_k_heads: int
    gdn_v_heads: int
    gdn_k_dim: int
    gdn_v_dim: int
    conv_kernel: int
    experts: int
    top_k: int
    moe_inter: int
    shared_inter: int
    vocab: int

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        """From a config.json dict (with or without ``text_config``) or an
        mlx-lm ``TextModelArgs``."""
        if not isinstance(config, dict):
            config = vars(config)
        text = config.get("text_config", config)
        layers = text["num_hidden_layers"]
        interval = text.get("full_attention_interval", 4)
        attn = sum(1 for i in range(layers) if (i + 1) % interval == 0)
        hidden = text["hidden_size"]
        heads = text["num_attention_heads"]
        return cls(
            hidden=hidden,
            layers=layers,
            attn_layers=attn,
            gdn_layers=layers - attn,
            heads=heads,
            kv_heads=text["num_key_value_heads"],
            head_dim=text.get("head_dim") or hidden // heads,
            gdn_k_heads=text["linear_num_key_heads"],
            gdn_v_heads=text["linear_num_value_heads"],
            gdn_k_dim=text["linear_key_head_dim"],
            gdn_v_dim=text["linear_value_head_dim"],
            conv_kernel=text.get("linear_conv_kernel_dim", 4),
            experts=text["num_experts"],
            top_k=text["num_experts_per_tok"],
            moe_inter=text["moe_intermediate_size"],
            shared_inter=text["shared_expert_intermediate_size"],
            vocab=text["vocab_size"],
        )

    @property
    def conv_dim(self) -> int:
        return 2 * self.gdn_k_heads * self.gdn_k_dim + self.gdn_v_heads * self.gdn_v_dim


def bytes_per_weight(bits: int, group_size: int, mode: str = "affine", scale_bytes: int = 2):
    """Stored bytes per weight of a quantised matrix: packed bits + the
    per-group scale and bias (affine, ``scale_bytes`` each) or 8-bit scale
    (mxfp4/nvfp4/mxfp8). 4-bit affine, group 64, bf16 scales: 0.5 + 4/64 = 0.5625."""
    per_group = 2 * scale_bytes if mode in (None, "affine") else 1
    return bits / 8 + per_group / group_size


@dataclasses.dataclass
class Quant:
    """Bytes per weight by kind of matrix."""

    linear: float = 0.5625  # every quantised projection, experts, embedding, lm_head
    router: float = 1.0625  # mlp.gate and mlp.shared_expert_gate (8-bit)
    lm_head: float = 0.5625
    float_bytes: int = 2  # unquantised params (norms, conv1d) and activations

    @classmethod
    def affine(cls, bits=4, group_size=64, router_bits=8, scale_bytes=2) -> "Quant":
        b = bytes_per_weight(bits, group_size, "affine", scale_bytes)
        return cls(b, bytes_per_weight(router_bits, group_size, "affine", scale_bytes), b)

    @classmethod
    def from_config(cls, config: Dict) -> "Quant":
        """From the ``quantization`` block of a checkpoint config (per-path
        entries override the default for routers and lm_head); bf16 (2 B per
        weight) when the config has none."""
        q = config.get("quantization") or config.get("quantization_config")
        if not q:
            return cls(2.0, 2.0, 2.0)
        default = bytes_per_weight(q.get("bits", 4), q.get("group_size", 64), q.get("mode", "affine"))

        def override(suffix):
            for k, v in q.items():
                if k.endswith(suffix) and isinstance(v, dict):
                    return bytes_per_weight(
                        v.get("bits", q.get("bits", 4)),
                        v.get("group_size", q.get("group_size", 64)),
                        v.get("mode", q.get("mode", "affine")),
                    )
                if k.endswith(suffix) and v is False:
                    return 2.0
            return default

        return cls(default, override("mlp.gate"), override("lm_head"))


class Roofline:
    """Bytes per decoded token and FLOPs per prefilled token of the model.

    Decode reads, per token: every weight of the layers a token passes (the
    top-k routed experts of each MoE layer, not all of them; one embedding
    row), the fp32 Gated DeltaNet state (read + write), the conv state (read +
    write), and the KV cache of the context (read) plus the new token's K/V
    (write). For Qwen3.6-35B-A3B 4-bit this is ~1.80 GB at short context, +
    20,480 B per context token (DESIGN-NOTES section 4: ../shared/docs/, outside this repository).

    Prefill FLOPs per token of a ``T``-token prompt: 2 x active parameters
    except the lm_head, + the lm_head once per prompt (``generate_step``
    evaluates only the cache state of the earlier chunks, so their logits
    are never computed; DESIGN-NOTES' 5.9 GFLOP/token counts the lm_head for
    every token), + causal attention ``4 * t * heads * head_dim`` per
    attention layer averaged over the prompt (``t`` = keys seen, mean
    ``(T + 1) / 2``), + the GDN recurrence ``6 * Hv * Dk * Dv`` per GDN layer.
    (Also skipped in the earlier chunks but still counted: the last layer's
    output half, ~1/40 of the rest.)
    """

    def __init__(self, shape: ModelShape, quant: Quant):
        self.shape = shape
        self.quant = quant

    @classmethod
    def from_config(cls, config: Dict, quant: Optional[Quant] = None) -> "Roofline":
        return cls(ModelShape.from_config(config), quant or Quant.from_config(config))

    # parameter counts -----------------------------------------------------
    def params(self) -> Dict[str, int]:
        """Parameters a token passes through, by group (routed experts: top-k)."""
        s = self.shape
        d = s.hidden
        gdn = d * (2 * s.gdn_k_heads * s.gdn_k_dim + s.gdn_v_heads * s.gdn_v_dim)  # in_proj_qkv
        gdn += d * s.gdn_v_heads * s.gdn_v_dim  # in_proj_z
        gdn += 2 * d * s.gdn_v_heads  # in_proj_b, in_proj_a
        gdn += s.gdn_v_heads * s.gdn_v_dim * d  # out_proj
        attn = d * 2 * s.heads * s.head_dim + 2 * d * s.kv_heads * s.head_dim
        attn += s.heads * s.head_dim * d
        return {
            "routed_experts": s.layers * s.top_k * 3 * d * s.moe_inter,
            "shared_expert": s.layers * 3 * d * s.shared_inter,
            "routers": s.layers * d * (s.experts + 1),
            "gdn_projections": s.gdn_layers * gdn,
            "attention_projections": s.attn_layers * attn,
            "lm_head": s.vocab * d,
        }

    def active_params(self) -> int:
        return sum(self.params().values())

    # decode ----------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per context token: K and V, every attention layer."""
        s = self.shape
        return s.attn_layers * s.kv_heads * s.head_dim * 2 * self.quant.float_bytes

    def decode_bytes(self, context: float) -> Dict[str, float]:
        """Bytes moved to decode one token at ``context`` tokens of cache, by
        group, and ``"total"``."""
        s, q = self.shape, self.quant
        p = self.params()
        fb = q.float_bytes
        small = s.layers * 2 * s.hidden * fb  # input / post-attention RMSNorm weights
        small += s.gdn_layers * (s.conv_dim * s.conv_kernel * fb + s.gdn_v_dim * fb + 2 * s.gdn_v_heads * 4)
        small += s.attn_layers * 2 * s.head_dim * fb + s.hidden * fb  # q/k norms, final norm
        out = {
            "routed_experts": p["routed_experts"] * q.linear,
            "shared_expert": p["shared_expert"] * q.linear,
            "routers": p["routers"] * q.router,
            "gdn_projections": p["gdn_projections"] * q.linear,
            "attention_projections": p["attention_projections"] * q.linear,
            "lm_head": p["lm_head"] * q.lm_head,
            "embedding_row": s.hidden * q.linear,
            "norms_conv_weights": small,
            "gdn_state": s.gdn_layers * s.gdn_v_heads * s.gdn_v_dim * s.gdn_k_dim * 4 * 2,
            "conv_state": s.gdn_layers * (s.conv_kernel - 1) * s.conv_dim * fb * 2,
            "kv_cache": self.kv_bytes_per_token() * (context + 1),
        }
        out["total"] = sum(out.values())
        return out

    def decode_bytes_per_token(self, context: float) -> float:
        return self.decode_bytes(context)["total"]

    # prefill ---------------------------------------------------------------
    def prefill_flops_per_token(self, prompt_len: int) -> float:
        s = self.shape
        lm_head = self.params()["lm_head"]
        mean_keys = (prompt_len + 1) / 2
        attn = s.attn_layers * 4 * mean_keys * s.heads * s.head_dim
        gdn = s.gdn_layers * 6 * s.gdn_v_heads * s.gdn_k_dim * s.gdn_v_dim
        return 2 * (self.active_params() - lm_head) + 2 * lm_head / prompt_len + attn + gdn

    def summary(self) -> Dict:
        return {
            "active_params": self.active_params(),
            "decode_bytes_short_context": self.decode_bytes_per_token(0),
            "kv_bytes_per_context_token": self.kv_bytes_per_token(),
            "quant_bytes_per_weight": dataclasses.asdict(self.quant),
        }


def roofline_frac(rate: Optional[float], ceiling: Optional[float]) -> Optional[float]:
    """``rate / ceiling`` (same units), None when either is unknown."""
    if not rate or not ceiling:
        return None
    return rate / ceiling


def print_table(rows: Sequence[Dict], columns: Sequence[str], file=sys.stdout) -> None:
    """Aligned text table of ``rows`` (dicts) for the console."""

    def cell(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    table = [[str(c) for c in columns]] + [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    for row in table:
        print("  ".join(x.rjust(w) for x, w in zip(row, widths)), file=file)
    file.flush()
