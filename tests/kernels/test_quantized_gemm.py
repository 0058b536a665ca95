"""The dense 4-bit prefill GEMM (``kernels/quantized_gemm.py``: the grouped
GEMM's down kernel on one group) vs fp32 references.

Argument checks and the tile rule run on any backend; the kernels on CUDA
(the small shapes also on the CPU through the CUDA check), outputs poisoned
with NaN, fresh random weights and activations for each shape: ragged last
row tiles, 1 row, leading batch axes, both builds, every tile size.

Reference: fp32 ``x @ W^T`` on the weights as the kernel dequantises them
(``bf16(s * q + b)``, one rounding: test_moe_grouped_gemm.dequant), rounded
once to bf16. Bounds (compare.tolerance, bf16): against that reference the
result's own rounding and a flipped one (fp32 sums in another order),
roundings=2; against ``mx.quantized_matmul`` (the stock projection, which
may dequantise with two roundings), compare.GATHER_QMM_TOL.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

import cuda_check
from compare import GATHER_QMM_TOL, assert_close, finite, tolerance
from test_moe_grouped_gemm import dequant
from moe_blocks import qproj
from mlx_qwen_fast.kernels import quantized_gemm as qg

BF = mx.bfloat16
TOL = tolerance(BF, roundings=2)
CPU_WGMMA = pytest.mark.cpu_check("moe_grouped_gemm_wgmma.cu")
CPU_MMA = pytest.mark.cpu_check("moe_grouped_gemm.cu")


def weights(O, K, seed):
    """(w, s, b) of one random 4-bit group-64 projection K -> O, and its
    fp32 weights as the kernel dequantises them."""
    p = qproj(1, O, K, seed)
    arrays = (p.weight[0], p.scales[0], p.biases[0])
    return arrays, dequant(p, "once")[0]


def reference(x, wf):
    return (x.astype(mx.float32) @ wf.T).astype(BF)


# ---------------------------------------------------------------------------
# host side (any backend)
# ---------------------------------------------------------------------------


def test_argument_errors_name_the_argument():
    (w, s, b), _ = weights(256, 128, 1)
    x = mx.zeros((4, 128), BF)
    with pytest.raises(ValueError, match="x must be a bfloat16"):
        qg.quantized_gemm(x.astype(mx.float32), w, s, b)
    with pytest.raises(ValueError, match="4-bit group-64"):
        qg.quantized_gemm(mx.zeros((4, 192), BF), w, s, b)  # K does not match w
    with pytest.raises(ValueError, match="4-bit group-64"):
        qg.quantized_gemm(x, w, s.astype(mx.float32), b)
    with pytest.raises(ValueError, match="w must be uint32"):
        qg.quantized_gemm(x, w[None], s, b)
    with pytest.raises(ValueError, match="tile_rows must be one of"):
        qg.quantized_gemm(x, w, s, b, variant="mma", tile_rows=48)
    with pytest.raises(ValueError, match="variant must be one of"):
        qg.quantized_gemm(x, w, s, b, variant="cublas")
    (w2, s2, b2), _ = weights(64, 128, 2)
    with cuda_check.simulated():  # a Hopper GPU, so only the shape refuses
        with pytest.raises(ValueError, match="the wgmma build needs O % 256 == 0"):
            qg.quantized_gemm(x, w2, s2, b2, variant="wgmma")
    assert not qg.supports(x.astype(mx.float32), w, s, b)


def test_tile_rule_fills_the_gpu():
    """The largest tile whose grid gives three SMs in four a CTA; smaller
    ones for few rows or narrow outputs; always one of the builds' tiles."""
    assert qg.choose_tile_rows(4096, 2048, "wgmma", 132) == 128  # 32 x 8 CTAs
    assert qg.choose_tile_rows(4096, 512, "wgmma", 132) == 64    # 64 x 2 (32 x 2 too few)
    assert qg.choose_tile_rows(4096, 1024, "wgmma", 132) == 128  # 32 x 4 = 128 of 132 SMs
    assert qg.choose_tile_rows(1024, 2048, "wgmma", 132) == 64   # 16 x 8 (8 x 8 too few)
    assert qg.choose_tile_rows(2048, 256, "wgmma", 132) == 32    # 64 x 1: too few for 64 rows
    assert qg.choose_tile_rows(100, 256, "wgmma", 132) == 32     # too few rows for any
    assert qg.choose_tile_rows(4096, 512, "mma", 132) == 128     # 32 x 8 (64 features per CTA)
    assert qg.choose_tile_rows(4096, 64, "mma", 132) == 32       # 128 x 1: fewest anyway


# ---------------------------------------------------------------------------
# kernels (CUDA; the small shapes also on the CPU)
# ---------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.usefixtures("poison")
@pytest.mark.parametrize("lead,O,K", [
    pytest.param((1,), 256, 128, id="1x256x128"),
    pytest.param((2, 37), 512, 256, id="2x37x512x256"),
    pytest.param((300,), 768, 384, id="300x768x384"),
    pytest.param((1, 4099), 2048, 4096, marks=pytest.mark.large, id="4099x2048x4096"),
])
@pytest.mark.parametrize("variant", [pytest.param("wgmma", marks=CPU_WGMMA), pytest.param("mma", marks=CPU_MMA)])
@pytest.mark.parametrize("tile", [None, 32, 64, 128])
def test_quantized_gemm_vs_reference(lead, O, K, variant, tile):
    """Every row and column written (poisoned outputs), each output within
    bf16 rounding of the fp32 product on the dequantised weights, and as
    mx.quantized_matmul (the stock projection) to its own accuracy."""
    if cuda_check.active() and (tile in (None, 64) or O > 512):
        pytest.skip("the CPU check runs the small shapes at tiles 32 and 128")
    (w, s, b), wf = weights(O, K, 100 + O + K)
    x = mx.random.normal((*lead, K), key=mx.random.key(K + len(lead))).astype(BF)
    y = qg.quantized_gemm(x, w, s, b, variant=variant, tile_rows=tile)
    assert y.shape == (*lead, O) and y.dtype == BF
    assert finite(y)
    assert_close(y, reference(x, wf), TOL, f"{variant} tile {tile}")
    stock = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4)
    assert_close(y, stock, GATHER_QMM_TOL, "vs mx.quantized_matmul")


@pytest.mark.cuda
@pytest.mark.parametrize("variant", [pytest.param("wgmma", marks=CPU_WGMMA), pytest.param("mma", marks=CPU_MMA)])
def test_no_rows(variant):
    (w, s, b), _ = weights(256, 128, 5)
    y = qg.quantized_gemm(mx.zeros((0, 128), BF), w, s, b, variant=variant)
    assert y.shape == (0, 256) and y.dtype == BF
    # and the kernel still runs after it (the CPU check must see a launch)
    x = mx.random.normal((3, 128), key=mx.random.key(6)).astype(BF)
    assert finite(qg.quantized_gemm(x, w, s, b, variant=variant, tile_rows=32))
