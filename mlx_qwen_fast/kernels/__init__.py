"""Fused CUDA kernels, one kernel per file (like mlx-lm's own ``mlx_lm/kernels``).

Each module holds one kernel: a docstring saying what it fuses, ``supports()``
(whether a call can use it; never compiles) and a thin typed wrapper.  The
kernel sources live in ``mlx_qwen_fast/cuda/*.cu``; ``_cuda_build`` compiles
them once per machine (NVRTC, disk cache of cubins) and launches them with
``mx.fast.precompiled_cuda_kernel``.

Importing this package needs only MLX; nothing is compiled until a kernel is
first called on a CUDA device.

Modules (each exposes the wrapper of the same name and ``supports``):

- ``gated_delta_scan``      prefill recurrence (state in registers)
- ``gated_delta_frontend``  conv + SiLU + q/k L2 norm + gates (prefill)
- ``gated_rms_norm``        output gated RMSNorm with z
- ``gated_delta_decode``    the whole GDN layer step for T = 1
- ``moe_routing``           softmax/top-k routing + expert grouping + block map
                            (MoE prefill, on by default on CUDA; see ``ops.moe``)
- ``moe_grouped_gemm``      fused-dequant grouped expert GEMM (gate+up SwiGLU,
                            down + routing weight; MoE prefill, on by default)
- ``moe_decode_gemv``       fused decode MoE, N <= 4 tokens: gate+up SwiGLU and
                            down + combine + shared expert (on by default on
                            CUDA; see ``ops.moe``)
- ``attention_decode``      gated attention for one token, head_dim 256: q/k
                            RMSNorm + RoPE, the cache write, split-K attention
                            and the output gate (on by default on CUDA inside
                            the decode layer step; see ``ops.attention``)
- ``quantized_gemv``        decode projection, 1-4 rows: RMSNorm + 4/8-bit GEMV
                            + residual (on by default on CUDA inside the decode
                            step; see ``ops.linear``)
- ``gdn_mixer_decode``      a GDN layer's whole mixer for one token, 1-4 rows:
                            RMSNorm + in_proj, the decode step, out_proj +
                            residual in one persistent launch (grid barriers);
                            not used by the ops yet

Import them by module path, e.g.
``from mlx_qwen_fast.kernels.gated_delta_scan import gated_delta_scan, supports``
(the package does not re-export the functions: a function named like its
module would hide the module's ``supports``).
"""
