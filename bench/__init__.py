"""Benchmarks of mlx_qwen_fast against stock mlx-lm (see bench/README.md).

Modules (each a CLI, ``python -m bench.<name> --help``, and importable):

* :mod:`bench.ab` -- end-to-end prefill/decode A/B, stock vs patched twin;
* :mod:`bench.numerics` -- teacher-forced logits vs an fp32 reference;
* :mod:`bench.ops` -- one op at a time, every implementation;
* :mod:`bench.ceilings` -- measured copy bandwidth and bf16 matmul rate;
* :mod:`bench.plots` -- PNG plots from a result JSON;
* :mod:`bench.first_use`, :mod:`bench.startup` -- first-use cost of the CLI
  and of the package's kernels;
* :mod:`bench.user_view` -- mlx-lm's own benchmark command, stock vs patched;
* :mod:`bench.common` -- shared helpers (result header, JSON writer, timing,
  checkpoint loading, the roofline byte/FLOP model).

Device scripts (CUDA; ``python3 bench/<name>.py --help``): ``gdn_cuda``,
``moe_cuda``, ``moe_decode_cuda`` (on :mod:`bench.device_script`),
``profile_kernels`` (Nsight Compute launches and summaries), ``node_cost``.
"""
