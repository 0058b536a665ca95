"""Quantisation variants of the tiny checkpoint (tests/test_checkpoint.py:
layout and loading; tests/test_patch.py: patched vs stock).

``VARIANTS``: name -> ``(quantisation arguments of write_checkpoint,
{part: (group_size, bits, mode)})``, the setting every quantised module of
each part (:data:`mlx_qwen_fast.checkpoint.PARTS`) must load with.
"""

from mlx_qwen_fast.checkpoint import PARTS

AFFINE4 = (64, 4, "affine")
GATES = (64, 8, "affine")  # router and shared-expert gate unless overridden (the model's quant_predicate)


def _expect(top, **parts):
    out = {p: top for p in PARTS}
    out["router"] = out["shared_expert_gate"] = GATES
    out.update(parts)
    return out


VARIANTS = {
    # mlx-community's 4-bit layout: the only one the CUDA MoE kernels read
    "affine4": ({}, _expect(AFFINE4)),
    "affine8": ({"bits": 8}, _expect((64, 8, "affine"))),
    # the H200 report of issue 31: 3-bit experts, 8-bit attention and shared expert
    "experts3": (
        {"parts": {"experts": {"bits": 3}, "attention": {"bits": 8}, "shared_expert": {"bits": 8}}},
        _expect(AFFINE4, experts=(64, 3, "affine"), attention=(64, 8, "affine"),
                shared_expert=(64, 8, "affine")),
    ),
    "experts-g32-gdn5-g128": (
        {"parts": {"experts": {"group_size": 32}, "linear_attention": {"bits": 5, "group_size": 128}}},
        _expect(AFFINE4, experts=(32, 4, "affine"), linear_attention=(128, 5, "affine")),
    ),
    "mxfp4": ({"mode": "mxfp4"}, _expect((32, 4, "mxfp4"))),
    "nvfp4-experts-6bit-router": (
        {"parts": {"experts": {"mode": "nvfp4"}, "router": {"bits": 6}}},
        _expect(AFFINE4, experts=(16, 4, "nvfp4"), router=(64, 6, "affine")),
    ),
}
