#!/usr/bin/env bash
# H200 session driver: one stage per device call (each under 10 minutes).
#   bash bench/h200.sh prefill   # prefill sweep 256..128K, stock vs patched
#   bash bench/h200.sh decode    # decode sweep 256..128K context
#   bash bench/h200.sh checks    # pytest -m cuda, numerics, ops
# Run from the repo root on the device with .mlxcuda carried; results go to $OUT.
# A fresh process pays MLX-CUDA's first-use kernel compilation: 225 s for the
# stock engine's per-token GDN loop (measured 2026-11-29), hence the separate
# --warmup-max-seconds budget and one process per stage.
set -uo pipefail
source .mlxcuda/boot.sh || exit 1
export PYTHONPATH="$PWD:$PYTHONPATH" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
P="--preset qwen3.6-35b-a3b --router-skew ${SKEW:-1.0}"
AB="python3 -m bench.ab $P --no-plots --warmup-max-seconds 300"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
case "$1" in
prefill)
  $AB --prefill 256,512,1k,2k,4k,8k,16k,32k,64k,128k --rounds 2 --max-seconds 45 \
    --out "$OUT/ab-prefill.json" 2>&1 | tee "$OUT/ab-prefill.log" | tail -25 ;;
decode)
  $AB --decode 256,512,1k,2k,4k,8k,16k,32k,64k,128k --decode-steps 32 --rounds 2 \
    --max-seconds 60 --out "$OUT/ab-decode.json" 2>&1 | tee "$OUT/ab-decode.log" | tail -25 ;;
checks)
  timeout 240 python3 -m pytest -q -m cuda tests 2>&1 | tail -15 | tee "$OUT/tests.txt"
  timeout 150 python3 -m bench.numerics $P --out "$OUT/numerics.json" 2>&1 | tail -12
  timeout 180 python3 -m bench.ops $P --out "$OUT/ops.json" 2>&1 | tail -25 ;;
*) echo "usage: bash bench/h200.sh {prefill|decode|checks}"; exit 2 ;;
esac
