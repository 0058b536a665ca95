"""Inputs and fp32 references of the Gated DeltaNet kernel tests (scan, front
end, decode) and the full-size layer of the layer tests.

Shapes are Qwen3.6-35B-A3B's: 16 key heads, 32 value heads, head dims 128.
References are plain MLX ops in float32: :func:`reference` is
``ops.gated_delta.gated_delta_recurrent`` (the package's reference of
record), :func:`ref_frontend` mlx-lm's own expressions for the conv, norms
and gates.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.qwen3_5 import GatedDeltaNet, TextModelArgs

from mlx_qwen_fast.ops.gated_delta import gated_delta_recurrent

D, HK, HV = 128, 16, 32
C = (2 * HK + HV) * D


def reference(q, k, v, g, beta, state, mask=None):
    """The recurrence in fp32 (``gated_delta_recurrent`` on fp32 copies)."""
    f = mx.float32
    return gated_delta_recurrent(q.astype(f), k.astype(f), v.astype(f), g, beta, state, mask)


def make_scan_inputs(B, T, decay, seed, dtype=mx.bfloat16):
    """q, k (unit norm, q scaled by D**-0.5), v, g, beta, state; ``decay``
    "strong" (g in 0.05-0.6), "weak" (1 - g in 1e-4..1e-2) or "mixed" (weak,
    with gates of 0, 1e-6, 1e-3, 1e-2 and 0.0099 scattered in)."""
    ks = mx.random.split(mx.random.key(seed), 6)
    q = mx.random.normal((B, T, HK, D), key=ks[0])
    k = mx.random.normal((B, T, HK, D), key=ks[1])
    q = q / mx.linalg.norm(q, axis=-1, keepdims=True) * D**-0.5
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((B, T, HV, D), key=ks[2])
    if decay == "strong":
        g = mx.random.uniform(0.05, 0.6, (B, T, HV), key=ks[3])
    elif decay == "mixed":  # weak decay with gates of 0, 1e-6, 1e-3 and 1e-2 scattered in
        g = 1.0 - mx.random.uniform(1e-4, 1e-2, (B, T, HV), key=ks[3])
        pick = mx.random.randint(0, 40, (B, T, HV), key=mx.random.key(seed + 1))
        for code, val in ((0, 0.0), (1, 1e-6), (2, 1e-3), (3, 1e-2), (4, 0.0099)):
            g = mx.where(pick == code, val, g)
    else:
        g = 1.0 - mx.random.uniform(1e-4, 1e-2, (B, T, HV), key=ks[3])
    beta = mx.random.uniform(0, 1, (B, T, HV), key=ks[4])
    s0 = 0.5 * mx.random.normal((B, HV, D, D), key=ks[5])
    # bf16-exact values, so fp32 and bf16 kernel runs see the same numbers
    q, k, v = (x.astype(mx.bfloat16).astype(dtype) for x in (q, k, v))
    return q, k, v, g, beta, s0


def fe_params(seed, dtype):
    """conv weight [C, 4, 1], A_log [HV] (fp32), dt_bias [HV]."""
    ks = mx.random.split(mx.random.key(seed), 3)
    w = (0.5 * mx.random.normal((C, 4, 1), key=ks[0])).astype(dtype)
    A_log = mx.log(mx.random.uniform(0.1, 8.0, (HV,), key=ks[1]))
    dt_bias = mx.random.uniform(-1.0, 1.0, (HV,), key=ks[2]).astype(dtype)
    return w, A_log, dt_bias


def ref_frontend(qkv, a, b, w, cs, A_log, dt_bias, eps=1e-6):
    """mlx-lm's front end in fp32: conv + SiLU, q/k L2 norm (q scaled), gates,
    new conv state. Returns (q, k, v, g, beta, conv_state)."""
    f = mx.float32
    B, T, _ = qkv.shape
    x = mx.concatenate([cs.astype(f), qkv.astype(f)], axis=1)
    conv = nn.Conv1d(C, C, 4, groups=C, bias=False)
    conv.weight = w.astype(f)
    o = nn.silu(conv(x))
    q = o[..., : HK * D].reshape(B, T, HK, D)
    k = o[..., HK * D: 2 * HK * D].reshape(B, T, HK, D)
    v = o[..., 2 * HK * D:].reshape(B, T, HV, D)
    q = q * mx.rsqrt((q * q).sum(-1, keepdims=True) + eps) * D**-0.5
    k = k * mx.rsqrt((k * k).sum(-1, keepdims=True) + eps)
    g = mx.exp(-mx.exp(A_log.astype(f)) * nn.softplus(a.astype(f) + dt_bias.astype(f)))
    return q, k, v, g, mx.sigmoid(b.astype(f)), x[:, -3:]


def decode_step_inputs(key, B, dtype):
    """One token's four projection outputs (qkv [B, 1, C], z [B, 1, HV*D],
    a, b [B, 1, HV]) in ``dtype``, fresh random from ``key``."""
    kt = mx.random.split(key, 4)
    qkv = mx.random.normal((B, 1, C), key=kt[0]).astype(dtype)
    z = mx.random.normal((B, 1, HV * D), key=kt[1]).astype(dtype)
    a = mx.random.normal((B, 1, HV), key=kt[2]).astype(dtype)
    b = mx.random.normal((B, 1, HV), key=kt[3]).astype(dtype)
    return qkv, z, a, b


def decode_reference(qkv, z, a, b, w, cs, A_log, dt_bias, state, norm_weight, dtype):
    """The decode step's fp32 reference (the kernels' contract): mlx-lm's
    front end (:func:`ref_frontend`), q/k/v rounded to ``dtype`` as the
    kernels store them, the fp32 recurrence (:func:`reference`), mlx-lm's
    gated RMSNorm. Returns (out [B, 1, HV*D], conv_state, state)."""
    from mlx_lm.models.qwen3_next import Qwen3NextRMSNormGated

    B = qkv.shape[0]
    q, k, v, g, beta, rcs = ref_frontend(qkv, a, b, w, cs, A_log, dt_bias)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    y, rs = reference(q, k, v, g, beta, state)
    m = Qwen3NextRMSNormGated(D, eps=1e-6)
    m.weight = norm_weight
    return m(y.astype(dtype), z.reshape(B, 1, HV, D)).reshape(B, 1, HV * D), rcs, rs


def assert_decode_step(got, ref, dtype):
    """A decode kernel's (out, conv_state, state) against
    :func:`decode_reference`'s: shapes and dtype, every value written (not
    poison), the conv state exact, the state within one rounding of
    ``dtype`` (q/k/v stored in it), the output within five (y's rounding and
    the gated norm's)."""
    from compare import assert_close, finite, tolerance

    out, ncs, ns = got
    ro, rcs, rs = ref
    assert out.shape == ro.shape and out.dtype == dtype
    assert finite(out, ns, ncs)
    assert_close(ncs, rcs, 0.0, "conv state (exact)")
    assert_close(ns, rs, tolerance(dtype, roundings=1), "state")
    assert_close(out, ro, tolerance(dtype, roundings=5), "out")


#: A Gated DeltaNet layer of Qwen3.6-35B-A3B's shape (hidden 2048).
FULL_ARGS = TextModelArgs(
    model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=4,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256, vocab_size=256,
    linear_num_value_heads=HV, linear_num_key_heads=HK, linear_key_head_dim=D,
    linear_value_head_dim=D, linear_conv_kernel_dim=4,
)


def full_size_layer(seed, dtype):
    """Stock ``GatedDeltaNet`` of :data:`FULL_ARGS`, random weights from
    ``seed``, 4-bit group-64 projections, activations in ``dtype`` (A_log
    kept in float32, as mlx-lm keeps it)."""
    mx.random.seed(seed)
    layer = GatedDeltaNet(FULL_ARGS)
    new = []
    for name, p in tree_flatten(layer.parameters()):
        if name.endswith("A_log"):
            new.append((name, mx.log(mx.random.uniform(0.1, 8.0, p.shape))))
        elif name.endswith("dt_bias"):
            new.append((name, mx.random.uniform(-1.0, 1.0, p.shape)))
        elif "norm" in name:
            new.append((name, 1.0 + 0.1 * mx.random.normal(p.shape)))
        elif "conv1d" in name:
            new.append((name, mx.random.normal(p.shape) * 0.5))
        else:
            new.append((name, mx.random.normal(p.shape) * p.shape[-1] ** -0.5))
    layer.update(tree_unflatten(new))
    nn.quantize(layer, group_size=64, bits=4)
    A_log = layer.A_log  # mlx-lm keeps A_log in float32 (cast_predicate)
    layer.set_dtype(dtype)
    layer.A_log = A_log
    mx.eval(layer.parameters())
    return layer


#: Kinds of argument that are not an mx.array, as a caller passes them by
#: mistake: kind -> (the argument made from a valid array, how the error
#: message names it).
NOT_ARRAYS = {
    "list": (lambda a: np.asarray(a).tolist(), "list"),
    "numpy": (np.asarray, "numpy.ndarray"),
    "None": (lambda a: None, "None"),
}
