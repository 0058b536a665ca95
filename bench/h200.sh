#!/usr/bin/env bash
# H200 session driver: one stage per device call (each under 10 minutes).
#   bash bench/h200.sh prefill   # prefill sweep 256..128K, stock vs patched
#   bash bench/h200.sh decode    # decode sweep 256..128K context
#   bash bench/h200.sh ab        # both sweeps in one process (one stock warm-up; ~9 min)
#   bash bench/h200.sh tests     # pytest -m cuda, kernel tests (MoE first; ~5-8 min)
#   bash bench/h200.sh layers    # tests/test_cuda_layers.py (full GDN layer vs stock; 182 s on 2026-12-01)
#   bash bench/h200.sh checks    # numerics (stock/patched vs fp32) and per-op benchmark
#   bash bench/h200.sh moe       # MoE kernel device scripts: grouped GEMM variants, decode GEMV
#   bash bench/h200.sh decode-moe  # decode A/B with the opt-in fused MoE decode kernels on
# Run from the repo root on the device with .mlxcuda carried; results go to $OUT.
# A fresh process pays MLX-CUDA's first-use kernel compilation: 177-225 s for
# the stock engine's per-token GDN loop (measured 2026-11-29 and 2026-12-01),
# hence the separate --warmup-max-seconds budget and one process per stage.
# Never run two GPU jobs at once when timing: only the ratios within one run
# mean anything then.
set -uo pipefail
source .mlxcuda/boot.sh || exit 1
export PYTHONPATH="$PWD:$PYTHONPATH" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
P="--preset qwen3.6-35b-a3b --router-skew ${SKEW:-1.0}"
AB="python3 -m bench.ab $P --no-plots --warmup-max-seconds 300"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
L=256,512,1k,2k,4k,8k,16k,32k,64k,128k
case "$1" in
prefill)
  $AB --prefill $L --rounds 2 --max-seconds 30 \
    --out "$OUT/ab-prefill.json" 2>&1 | tee "$OUT/ab-prefill.log" | tail -25 ;;
decode)
  $AB --decode $L --decode-steps 32 --rounds 2 \
    --max-seconds 60 --out "$OUT/ab-decode.json" 2>&1 | tee "$OUT/ab-decode.log" | tail -25 ;;
ab)
  timeout 560 $AB --prefill $L --decode $L --decode-steps 32 --rounds 2 --max-seconds 30 \
    --out "$OUT/ab.json" > "$OUT/ab.log" 2>&1; tail -32 "$OUT/ab.log" ;;
tests)
  timeout 560 python3 -m pytest -q -m cuda tests/test_cuda_moe_decode.py tests/test_cuda_moe.py \
    tests/test_cuda_gated_delta.py 2>&1 | tail -30 | tee "$OUT/tests.txt" ;;
layers)
  timeout 560 python3 -m pytest -q tests/test_cuda_layers.py 2>&1 | tail -15 | tee "$OUT/tests-layers.txt" ;;
checks)
  timeout 300 python3 -m bench.numerics $P --out "$OUT/numerics.json" 2>&1 | tail -12
  timeout 240 python3 -m bench.ops $P --out "$OUT/ops.json" 2>&1 | tail -30 ;;
moe)  # logs and JSONs packed into one file: $OUT brings back at most 8 files
  M=/tmp/moe_out; mkdir -p $M
  timeout 300 python3 bench/moe_cuda.py --sections check,time --out $M 2>&1 | tail -45
  timeout 200 python3 bench/moe_decode_cuda.py --out $M 2>&1 | tail -20
  tar czf "$OUT/moe.tgz" -C $M . ;;
decode-moe)
  MLX_QWEN_FAST_MOE_DECODE_KERNEL=1 timeout 560 $AB --decode 256,4k,32k --decode-steps 32 --rounds 2 \
    --out "$OUT/ab-decode-moe-kernel.json" 2>&1 | tee "$OUT/ab-decode-moe-kernel.log" | tail -12 ;;
*) echo "usage: bash bench/h200.sh {prefill|decode|ab|tests|layers|checks|moe|decode-moe}"; exit 2 ;;
esac
