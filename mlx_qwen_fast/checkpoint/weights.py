"""The random weights of a model's parameters.

Every parameter is drawn from its own key, derived from ``seed`` and the
parameter's path, so the weights do not depend on the order in which they are
generated: ``build_model`` and the streaming ``write_checkpoint`` produce
identical arrays for the same arguments.

Weight distributions (``H`` = hidden size, ``L`` = number of layers). Matrices
are zero-mean uniform with the stated standard deviation (uniform like
``nn.Linear``'s own init, and ~5x cheaper than normals on the CPU):

- embeddings std 1; every RMSNorm weight (input, post-attention, final, q/k
  norms and the gated norm of Gated DeltaNet) ``1 + 0.1 N(0, 1)``, stored in
  mlx layout (used as is, so mlx-lm's ``sanitize`` changes nothing);
- linear and expert weights std ``1/sqrt(fan_in)``; the projections that write
  into the residual stream (``o_proj``, ``out_proj``, expert and shared-expert
  ``down_proj``) further scaled by ``sqrt(4 / L)``, so the residual stream
  stays O(1) (RMS ~1.1 after the embedding, ~1.7 after the last layer);
- ``in_proj_a`` scaled by 0.5; ``A_log = log(U(0.1, 8))``; ``dt_bias`` chosen
  per head so that the decay ``g = exp(-exp(A_log) * softplus(a + dt_bias))``
  is ``U(0.5, 0.99)`` across heads at ``a = 0`` (on real activations its
  10/50/90% quantiles are about 0.5/0.8/0.97);
- depthwise conv1d ``N(0, 1/kernel)``, shape ``(conv_dim, kernel, 1)``;
- router std ``1/sqrt(H)``, optionally skewed (``router_skew``);
- ``lm_head`` std ``lm_head_scale / sqrt(H)``.
"""

import hashlib
import math
from typing import Dict

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

# Multiplier of the lm_head weights for the demo and token-identity tests.
# With scale 1 the logits of a random model are flat (std ~1), and mlx-lm's
# sampler takes the argmax of bf16 log-probabilities around -ln(vocab), where
# the bf16 spacing is 0.03-0.06: near-ties are settled by rounding, and even
# one-shot vs step-by-step decoding of stock mlx-lm disagree on some tokens.
# With 16 the logits have std ~16 and the top-1/top-2 margins are many bf16
# ulps (bench/results/package-figures.md, "Random checkpoints").
# A uniform scale cannot help against noise in the hidden state itself: margin
# and noise scale together, so bf16 vs fp32 (or two bf16 implementations with
# different rounding) still pick different top-1 tokens where the float32
# margin is small (tiny preset: 79-85% agreement at any scale). Compare such
# paths in fp32, or report the margin where they diverge.
DEMO_LM_HEAD_SCALE = 16.0

# Calibration of ``router_skew``: the router row of the expert of popularity
# rank r (1 = most popular) is multiplied by ``r ** (-router_skew * 0.4)``.
_SKEW_EXPONENT = 0.4


def _key(seed: int, path: str) -> mx.array:
    """A PRNG key that depends only on the seed and the parameter path."""
    digest = hashlib.sha256(f"{int(seed)}/{path}".encode()).digest()
    return mx.random.key(int.from_bytes(digest[:7], "little"))


def _normal(seed, path, shape, std=1.0, mean=0.0):
    return mean + std * mx.random.normal(shape, key=_key(seed, path))


def _matrix(seed, path, shape, std):
    """Zero-mean uniform with standard deviation ``std`` (uniform like
    ``nn.Linear``'s init, and ~5x cheaper than a normal on the CPU)."""
    bound = math.sqrt(3.0) * std
    return mx.random.uniform(-bound, bound, shape, key=_key(seed, path))


def _uniform(seed, path, shape, low, high):
    return mx.random.uniform(low, high, shape, key=_key(seed, path))


def _router_row_scale(seed, path, num_experts, router_skew):
    """Per-expert row multiplier of a router, shape (num_experts, 1)."""
    # A random permutation of 1..E is a random assignment of ranks.
    rank = mx.random.permutation(num_experts, key=_key(seed, path + "#rank")) + 1
    return mx.power(rank.astype(mx.float32), -_SKEW_EXPONENT * router_skew)[:, None]


def _random_weights(
    model: nn.Module,
    args,
    seed: int,
    router_skew: float,
    lm_head_scale: float,
) -> Dict[str, mx.array]:
    """Lazy float32 arrays for every parameter of an unquantized ``model``."""
    n_layers = args.num_hidden_layers
    residual_scale = math.sqrt(4.0 / n_layers)
    kernel = args.linear_conv_kernel_dim
    H = args.hidden_size
    residual_writers = ("o_proj", "out_proj", "down_proj")

    weights = {}
    for path, p in tree_flatten(model.parameters()):
        shape = p.shape
        name = path.rsplit(".", 2)
        module, leaf = name[-2], name[-1]
        if path.endswith("embed_tokens.weight"):
            w = _matrix(seed, path, shape, std=1.0)
        elif path.endswith("lm_head.weight"):
            w = _matrix(seed, path, shape, std=lm_head_scale / math.sqrt(H))
        elif "norm" in module and leaf == "weight":
            w = _normal(seed, path, shape, std=0.1, mean=1.0)
        elif module == "conv1d":
            w = _normal(seed, path, shape, std=1.0 / math.sqrt(kernel))
        elif leaf == "A_log":
            w = mx.log(_uniform(seed, path, shape, 0.1, 8.0))
        elif leaf == "dt_bias":
            # softplus(dt_bias) * exp(A_log) = -log(g0): decay g0 at a = 0.
            a_log_path = path[: -len("dt_bias")] + "A_log"
            A = _uniform(seed, a_log_path, shape, 0.1, 8.0)
            g0 = _uniform(seed, path, shape, 0.5, 0.99)
            s = -mx.log(g0) / A
            w = mx.log(mx.expm1(s))  # inverse softplus
        elif leaf == "weight" and p.ndim in (2, 3):  # linear and expert weights
            std = 1.0 / math.sqrt(shape[-1])
            if module in residual_writers:
                std *= residual_scale
            elif module == "in_proj_a":
                std *= 0.5
            w = _matrix(seed, path, shape, std=std)
            if path.endswith("mlp.gate.weight") and router_skew > 0:
                w = w * _router_row_scale(seed, path, shape[0], router_skew)
        else:
            raise ValueError(f"No initializer for parameter {path} {shape}")
        weights[path] = w
    return weights
