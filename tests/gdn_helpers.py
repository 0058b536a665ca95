"""Inputs and fp32 references of the Gated DeltaNet kernel tests (scan, front
end, decode, the one-launch mixer) and the full-size layer of the layer tests.

Shapes are Qwen3.6-35B-A3B's: 16 key heads, 32 value heads, head dims 128
(the front end, decode and mixer helpers take other head counts too).
References are plain MLX ops in float32: :func:`reference` is
``ops.gated_delta.gated_delta_recurrent`` (the package's reference of
record), :func:`ref_frontend` mlx-lm's own expressions for the conv, norms
and gates.
"""

from typing import NamedTuple

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


def ref_frontend(qkv, a, b, w, cs, A_log, dt_bias, eps=1e-6, hk=HK, hv=HV):
    """mlx-lm's front end in fp32: conv + SiLU, q/k L2 norm (q scaled), gates,
    new conv state (``hk`` key and ``hv`` value heads of 128). Returns (q, k,
    v, g, beta, conv_state)."""
    f = mx.float32
    B, T, _ = qkv.shape
    c = (2 * hk + hv) * D
    x = mx.concatenate([cs.astype(f), qkv.astype(f)], axis=1)
    conv = nn.Conv1d(c, c, 4, groups=c, bias=False)
    conv.weight = w.astype(f)
    o = nn.silu(conv(x))
    q = o[..., : hk * D].reshape(B, T, hk, D)
    k = o[..., hk * D: 2 * hk * D].reshape(B, T, hk, D)
    v = o[..., 2 * hk * D:].reshape(B, T, hv, D)
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


def decode_reference(qkv, z, a, b, w, cs, A_log, dt_bias, state, norm_weight, dtype, hk=HK, hv=HV):
    """The decode step's fp32 reference (the kernels' contract): mlx-lm's
    front end (:func:`ref_frontend`), q/k/v rounded to ``dtype`` as the
    kernels store them, the fp32 recurrence (:func:`reference`), mlx-lm's
    gated RMSNorm. Returns (out [B, 1, hv*D], conv_state, state)."""
    from mlx_lm.models.qwen3_next import Qwen3NextRMSNormGated

    B = qkv.shape[0]
    q, k, v, g, beta, rcs = ref_frontend(qkv, a, b, w, cs, A_log, dt_bias, hk=hk, hv=hv)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    y, rs = reference(q, k, v, g, beta, state)
    m = Qwen3NextRMSNormGated(D, eps=1e-6)
    m.weight = norm_weight
    return m(y.astype(dtype), z.reshape(B, 1, hv, D)).reshape(B, 1, hv * D), rcs, rs


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


class MixerArrays(NamedTuple):
    """A Gated DeltaNet decoder layer's mixer for one decode step (the
    arrays of ``kernels/gdn_mixer_decode.py``): ``x`` [B, 1, K]; ``in_proj`` /
    ``out_proj``: (weight, scales, biases) of ``mx.quantize`` (affine, 4-bit,
    group 64, scales in x's dtype) of [qkv | z | a | b] [P, K] and out_proj
    [K, hv * 128]; the layer's constants; the states."""

    x: mx.array
    in_proj: tuple
    out_proj: tuple
    conv_weight: mx.array
    A_log: mx.array
    dt_bias: mx.array
    norm_weight: mx.array
    input_norm_weight: mx.array
    conv_state: mx.array
    state: mx.array
    hk: int
    hv: int


def mixer_arrays(seed, B, K, hk, hv, dtype) -> MixerArrays:
    """Random :class:`MixerArrays` (weights scaled by their fan-in, the
    constants as :func:`fe_params` and the decode tests draw them: decays
    0.5-1, norm weights around 1)."""
    c, kv = (2 * hk + hv) * D, hv * D
    P = c + hv * D + 2 * hv
    ks = mx.random.split(mx.random.key(seed), 10)
    w_in = (mx.random.normal((P, K), key=ks[0]) * K**-0.5).astype(dtype)
    w_out = (mx.random.normal((K, kv), key=ks[1]) * kv**-0.5).astype(dtype)
    return MixerArrays(
        x=(3.0 * mx.random.normal((B, 1, K), key=ks[2])).astype(dtype),
        in_proj=tuple(mx.quantize(w_in, group_size=64, bits=4)),
        out_proj=tuple(mx.quantize(w_out, group_size=64, bits=4)),
        conv_weight=(0.5 * mx.random.normal((c, 4, 1), key=ks[3])).astype(dtype),
        A_log=mx.log(mx.random.uniform(0.1, 8.0, (hv,), key=ks[4])),
        dt_bias=mx.random.uniform(-1.0, 1.0, (hv,), key=ks[5]).astype(dtype),
        norm_weight=(1 + 0.3 * mx.random.normal((D,), key=ks[6])).astype(dtype),
        input_norm_weight=(1 + 0.2 * mx.random.normal((K,), key=ks[7])).astype(dtype),
        conv_state=mx.random.normal((B, 3, c), key=ks[8]).astype(dtype),
        state=0.5 * mx.random.normal((B, hv, D, D), key=ks[9]),
        hk=hk, hv=hv)


def mixer_reference(a: MixerArrays, conv_state, state, x=None, input_norm_eps=1e-6):
    """``(out [B, 1, K], conv_state, state)`` of the mixer's step, composed
    of the references of the three kernels it fuses: the input projection
    with the RMSNorm, :func:`decode_reference`, out_proj with the residual.

    float32 x: the projections are ``ops.linear.decode_linear_reference``
    (MLX's ``rms_norm`` and fp32 ``quantized_matmul``), everything fp32.
    bfloat16 x: the projections are ``references.decode_gemv_reference``
    (float64 with the GEMV kernel's bf16 rounding points; MLX's bf16
    ``quantized_matmul`` on the CPU is itself only bf16-accurate), the
    projection's output rounded to bf16 as the kernel stores it."""
    from references import decode_gemv_reference

    from mlx_qwen_fast.ops.linear import decode_linear_reference

    x = a.x if x is None else x
    B, K = x.shape[0], x.shape[-1]
    hk, hv = a.hk, a.hv
    c = (2 * hk + hv) * D
    static = ("quantized", 64, 4, "affine", True, False)
    if x.dtype == mx.float32:
        proj = decode_linear_reference(x, a.in_proj, static, norm=(a.input_norm_weight, input_norm_eps))
    else:
        proj, _ = decode_gemv_reference(x.reshape(B, K), *a.in_proj, 4, 64, a.input_norm_weight, input_norm_eps)
        proj = mx.array(proj.astype(np.float32)).astype(x.dtype).reshape(B, 1, -1)
    qkv, z, ga, gb = (proj[..., lo:hi] for lo, hi in ((0, c), (c, c + hv * D), (c + hv * D, c + hv * D + hv),
                                                        (c + hv * D + hv, c + hv * D + 2 * hv)))
    y, rcs, rs = decode_reference(qkv, z, ga, gb, a.conv_weight, conv_state, a.A_log, a.dt_bias, state,
                                  a.norm_weight, x.dtype, hk=hk, hv=hv)
    if x.dtype == mx.float32:
        out = decode_linear_reference(y, a.out_proj, static, residual=x)
    else:
        out, _ = decode_gemv_reference(y.reshape(B, hv * D), *a.out_proj, 4, 64, residual=x.reshape(B, K))
        out = mx.array(out.astype(np.float32)).reshape(B, 1, K)
    return out, rcs, rs


#: A Gated DeltaNet layer of Qwen3.6-35B-A3B's shape (hidden 2048).
FULL_ARGS = TextModelArgs(
    model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=4,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256, vocab_size=256,
    linear_num_value_heads=HV, linear_num_key_heads=HK, linear_key_head_dim=D,
    linear_value_head_dim=D, linear_conv_kernel_dim=4,
)


def full_size_layer(seed, dtype, args=FULL_ARGS):
    """Stock ``GatedDeltaNet`` of ``args`` (:data:`FULL_ARGS`: Qwen3.6's
    layer), random weights from ``seed``, 4-bit group-64 projections,
    activations in ``dtype`` (A_log kept in float32, as mlx-lm keeps it)."""
    mx.random.seed(seed)
    layer = GatedDeltaNet(args)
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
