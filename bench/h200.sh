#!/usr/bin/env bash
# H200 session driver: one stage per device call (each well under 10 minutes).
#   bash bench/h200.sh prefill   # CUDA layer tests, MoE tile probe, prefill sweep
#   bash bench/h200.sh decode    # decode sweep, numerics, ops
# Run from the repo root on the device with .mlxcuda carried; results go to $OUT.
set -uo pipefail
source .mlxcuda/boot.sh || exit 1
export PYTHONPATH="$PWD:$PYTHONPATH" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
P="--preset qwen3.6-35b-a3b --router-skew ${SKEW:-1.0}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
case "$1" in
prefill)
  timeout 150 python3 -m pytest -q -m cuda tests/test_cuda_layers.py 2>&1 | tail -15 | tee "$OUT/tests.txt"
  timeout 90 python3 -m bench.moe_tiled_probe --tokens 2048,4096 --tiles 16,32 2>&1 | tail -8 | tee "$OUT/moe_probe.txt"
  python3 -m bench.ab $P --no-plots --prefill 256,512,1k,2k,4k --rounds 2 --max-seconds 50 --out "$OUT/ab-prefill.json" 2>&1 | tee -a "$OUT/ab.log" | tail -20
  python3 -m bench.ab $P --no-plots --prefill 8k,16k,32k,64k,128k --rounds 1 --max-seconds 50 --no-ceilings --append --out "$OUT/ab-prefill.json" 2>&1 | tee -a "$OUT/ab.log" | tail -20
  ;;
decode)
  python3 -m bench.ab $P --no-plots --decode 256,512,1k,2k,4k,8k,16k,32k,64k,128k --decode-steps 32 --rounds 2 --max-seconds 60 --out "$OUT/ab-decode.json" 2>&1 | tee -a "$OUT/ab.log" | tail -20
  timeout 120 python3 -m bench.numerics $P --out "$OUT/numerics.json" 2>&1 | tail -12
  timeout 150 python3 -m bench.ops $P --out "$OUT/ops.json" 2>&1 | tail -25
  ;;
esac
