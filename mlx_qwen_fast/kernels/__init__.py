"""Fused CUDA and Metal kernels, one kernel per file (like mlx-lm's own ``mlx_lm/kernels``).

Each module holds one kernel: a docstring saying what it fuses, a thin
typed wrapper and, for the CUDA ones, ``supports()`` (whether a call can
use it; never compiles). The CUDA sources live in
``mlx_qwen_fast/cuda/*.cu``; ``_cuda_build`` compiles them once per machine
(NVRTC through ``_cuda_toolchain``, disk cache of cubins) and launches them
with ``mx.fast.precompiled_cuda_kernel`` (a compressed fatbin where
``_cuda_fatbin`` can make one). ``_checks`` holds the wrappers' argument
checks. The Metal sources live in
``mlx_qwen_fast/metal/`` and run through ``mx.fast.metal_kernel``.

Importing this package needs only MLX; nothing is compiled until a kernel is
first called on its device. Which op calls which kernel by default is
decided in ``mlx_qwen_fast/ops`` (one dispatcher per op family) and
reported by ``mlx_qwen_fast.op_implementations()``.

CUDA modules (each exposes the wrapper of the same name and ``supports``):

- ``gated_delta_scan``      prefill recurrence (state in registers)
- ``gated_delta_frontend``  conv + SiLU + q/k L2 norm + gates (prefill)
- ``gated_rms_norm``        output gated RMSNorm with z
- ``gated_delta_decode``    the GDN recurrence step for T = 1
- ``gdn_mixer_decode``      a GDN layer's whole mixer for one token, 1-4 rows:
                            RMSNorm + in_proj, the decode step, out_proj +
                            residual in one persistent launch (grid barriers)
- ``moe_routing``           softmax/top-k routing + expert grouping + block map
                            (MoE prefill)
- ``moe_grouped_gemm``      fused-dequant grouped expert GEMM (gate+up SwiGLU,
                            down + routing weight; MoE prefill); its builds
                            ("wgmma", "mma"), tile rules and K order in
                            ``moe_grouped_gemm_builds``
- ``moe_decode_gemv``       fused decode MoE, N <= 4 tokens: gate+up SwiGLU and
                            down + combine + shared expert
- ``moe_block_decode``      a MoE block's whole decode step, 1-4 rows: RMSNorm +
                            router, routing + gate/up, down + shared expert +
                            combine + residual in one persistent launch
- ``gdn_layer_decode``      a GDN decoder layer's whole decode step, 1-4 rows:
                            the two kernels above (the mixer, then the MoE
                            block) in one persistent launch
- ``attention_decode``      gated attention for one token, head_dim 256: q/k
                            RMSNorm + RoPE, the cache write, split-K attention
                            and the output gate
- ``attention_layer_decode`` a gated-attention decoder layer's whole decode
                            step, 1-4 rows: q|k|v GEMV, attention over the
                            cache, o_proj + residual and the MoE block in one
                            persistent launch (then the two cache-row writes);
                            measured slower than its launches, on no decode path
- ``attention_prefill``     causal flash-attention prefill, head_dim 256
- ``quantized_gemv``        decode projection, 1-4 rows: RMSNorm + 4/8-bit GEMV
                            + residual

Metal modules (opt-in, ``MLX_QWEN_FAST_METAL=1``; checked by running MLX's
generated source on a CPU): ``gated_delta_decode_metal`` (the GDN decode
step), ``attention_decode_metal`` (gated attention decode, head_dim 256),
``moe_route_metal``, ``moe_gate_up_metal`` and ``moe_down_metal`` (the decode
MoE block's three launches), ``add_rms_norm_metal`` (a residual add fused
with the next RMSNorm: the attention layer's decode step), and for the MoE
prefill ``moe_group_metal`` (the grouping: histogram, scans, block map,
scatter) and ``moe_grouped_gemm_metal`` (the grouped 4-bit GEMMs on
``simdgroup_matrix``).

Contract modules (backend-neutral: the argument checks and constants that a
CUDA kernel and its Metal port share; both wrappers import them from here):

- ``moe_contract``          the 4-bit group-64 predicate, the decode weights,
                            the shared-expert gate's bits, the expert-id and
                            grouped-routing checks
- ``attention_contract``    gated attention decode: head_dim, the projection's
                            width, one step's checks
- ``gated_delta_contract``  the GDN decode step: head dim and conv width, the
                            packed projection and constants, one step's checks

Import them by module path, e.g.
``from mlx_qwen_fast.kernels.gated_delta_scan import gated_delta_scan, supports``
(the package does not re-export the functions: a function named like its
module would hide the module's ``supports``).
"""
