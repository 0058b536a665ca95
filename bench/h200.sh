#!/usr/bin/env bash
# Device driver: one stage per device call, each well inside 10 minutes.
#
#   bash bench/h200.sh tests      # the CUDA tests: large ones serially, the rest in parallel (~7 min)
#   bash bench/h200.sh ab         # bench.ab at 4K, stock vs patched, prefill and decode (~6-8 min)
#   bash bench/h200.sh ops        # bench.ops rows of the default paths at the model's shapes (~4 min)
#   bash bench/h200.sh profile    # ncu: GPU time per kernel of one patched 4K prefill, then every
#                                 # counter of the package's kernels (~6-8 min)
#   bash bench/h200.sh dprofile   # ncu: GPU time per kernel of patched decode tokens at 4K (~3-5 min)
#   bash bench/h200.sh phases     # SM cycles per phase of the one-launch GDN mixer and MoE block (~2 min)
#   bash bench/h200.sh userview   # bench.user_view: mlx-lm's own benchmark command, stock vs patched (~5-9 min)
#   bash bench/h200.sh firstuse   # bench.first_use: the CLI's first and second run on a fresh machine (~6 min;
#                                 # FU_WARMUP=1 then lists what the warm-up's prompt lengths compile, +4 min)
#   bash bench/h200.sh ahead      # bench.first_use with MLX's compiles in worker processes, then without (~7 min)
#   bash bench/h200.sh decode     # nodes per decode token, then a decode switch on/off through the CLI (~6-9 min)
#   bash bench/h200.sh split      # bench.decode_split with a decode switch off/on, alternating processes (~2-4 min)
#
# Run from the repository root on the device with .mlxcuda carried (and .nvfatbin for
# compressed-fatbin launches); every result goes to $OUT (at most 8 files, named
# below per stage), and a short digest to stdout. Environment knobs: SKEW (router
# skew of the random checkpoints, default 1.0), TEST_WORKERS (xdist workers of the
# tests stage, default 4), UV_CONFIGS / UV_RESUME (userview), CK (checkpoint folder of firstuse and decode,
# default /tmp/ck), DECODE_PAIRS / DECODE_AB / NODES (decode),
# PROFILE_FULL=0 (profile stage without the --set full pass).
#
# A fresh machine pays MLX's first-use compiles (minutes: the stock engine's
# per-token GDN loop, the quantised matmuls), hence one process per stage and
# bench.ab's own warm-up budget. Never run two GPU jobs at once when timing.
set -uo pipefail
source .mlxcuda/boot.sh || exit 1
# nvFatbin (the cuda13 extra's nvidia-nvfatbin), carried as a wheel in .nvfatbin/: the package then
# launches its kernels as compressed fatbins (kernels/_cuda_build.py). Not into /tmp/site: MLX takes
# <site>/nvidia/cu13/include as *the* CUDA header folder once it exists (in a pip install the
# nvidia-cuda-runtime package fills it; here it would hold nvFatbin.h alone and MLX's JIT breaks).
NVF=""
for w in .nvfatbin/nvidia_nvfatbin-*.whl; do [ -f "$w" ] || continue
  ls /tmp/nvfatbin/nvidia/cu13/lib/libnvfatbin.so* >/dev/null 2>&1 || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/nvfatbin "$w"
  NVF=$(ls /tmp/nvfatbin/nvidia/cu13/lib/libnvfatbin.so* | head -1); export MLX_QWEN_FAST_NVFATBIN="$NVF"; done
export PYTHONPATH="$PWD:$PYTHONPATH" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
P="--preset qwen3.6-35b-a3b --router-skew ${SKEW:-1.0}"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)  # Nsight Compute CLI
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
echo "kernel images: ${NVF:-plain cubins (no .nvfatbin carried)}" | tee -a "$OUT/gpu.txt"

case "${1:-}" in
tests)  # pytest -m "cuda and large" serially (full-size shapes, several GB each), then
        # -m "cuda and not large" under pytest-xdist (serially without it); one line per test (-v), so that
        # a run cut by its timeout still names its failures. Files: tests-large.txt, tests.txt
  # tests/test_server.py imports the openai client of the test extra, which the device's Python lacks
  # (and it holds no CUDA test): left out, so that collection does not stop the run
  IGN="--ignore=tests/test_server.py"
  timeout 240 python3 -m pytest -v $IGN -m "cuda and large" tests > "$OUT/tests-large.txt" 2>&1  # >110 s on a fresh machine
  echo "rc=$? (5: none collected)" >> "$OUT/tests-large.txt"; tail -4 "$OUT/tests-large.txt"
  XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n ${TEST_WORKERS:-4}"
  timeout 330 python3 -m pytest -v $IGN $XD -m "cuda and not large" tests > "$OUT/tests.txt" 2>&1
  echo "rc=$?" >> "$OUT/tests.txt"; tail -4 "$OUT/tests.txt"
  grep -hE "(FAILED|ERROR) " "$OUT/tests-large.txt" "$OUT/tests.txt" | head -20 ;;
ab)  # bench.ab at 4K: prefill of a 4K prompt and decode at 4K context, stock vs patched in one process,
     # engines alternating, each warmed up until two runs agree within 5%. Files: ab-4k.json, ab-4k.log
  timeout 560 python3 -m bench.ab $P --prefill 4k --decode 4k --decode-steps 32 --rounds 3 \
    --max-seconds 60 --warmup-max-seconds 300 --no-plots --out "$OUT/ab-4k.json" > "$OUT/ab-4k.log" 2>&1
  echo "rc=$?" >> "$OUT/ab-4k.log"; grep -E "warm-up:|^(prefill|decode) |^rc=" "$OUT/ab-4k.log"; tail -8 "$OUT/ab-4k.log" ;;
ops)  # bench.ops: mlx-lm's code vs the patched path per op (--defaults-only) for the decode ops and the
      # MoE block at 4K, then the GDN prefill kernels at 4K alone (mlx-lm's per-token loop there takes
      # minutes). Files: ops.json (both runs), ops.log
  timeout 300 python3 -m bench.ops $P --ops gated_delta.decode_step,gated_delta.decode_layer,moe \
    --prefill-tokens 4k --defaults-only --max-seconds 8 --out "$OUT/ops.json" > "$OUT/ops.log" 2>&1
  echo "rc=$?" >> "$OUT/ops.log"
  timeout 200 python3 -m bench.ops $P --ops gated_delta.prefill,gated_delta.prefill_step --prefill-tokens 4k \
    --impls cuda-kernel --max-seconds 8 --no-ceilings --append --out "$OUT/ops.json" >> "$OUT/ops.log" 2>&1
  echo "rc=$?" >> "$OUT/ops.log"; grep -E "^(gated|moe)|^rc=|rror" "$OUT/ops.log" ;;
profile)  # ncu: GPU time of every kernel of one patched 4K prefill (profiler on around that prompt only),
          # summed per kernel family; then ncu --set full on one launch each of the package's kernels
          # (bench/profile_kernels.py kernels). Files: prefill-breakdown.txt, prefill-kernels.csv.gz,
          # ncu-details.txt, ncu-kernels.log
  [ -n "$NCU" ] || { echo "no ncu (Nsight Compute) on this machine"; exit 2; }
  timeout 330 "$NCU" --profile-from-start off --metrics gpu__time_duration.sum --csv \
    python3 bench/profile_kernels.py prefill $P --tokens 4k > /tmp/prefill-kernels.csv 2> /tmp/prefill-profile.err
  echo "rc=$?" >> /tmp/prefill-profile.err
  { grep -E "^# prefill|^rc=|rror" /tmp/prefill-profile.err; python3 bench/profile_kernels.py summary /tmp/prefill-kernels.csv; } \
    > "$OUT/prefill-breakdown.txt" 2>&1
  gzip -c /tmp/prefill-kernels.csv > "$OUT/prefill-kernels.csv.gz"; cat "$OUT/prefill-breakdown.txt"
  [ "${PROFILE_FULL:-1}" = 0 ] && exit 0
  timeout 200 "$NCU" --set full -k "regex:mqf_" -o /tmp/prof -f python3 bench/profile_kernels.py kernels \
    > "$OUT/ncu-kernels.log" 2>&1; echo "rc=$?" >> "$OUT/ncu-kernels.log"; tail -2 "$OUT/ncu-kernels.log"
  "$NCU" --import /tmp/prof.ncu-rep --page details > "$OUT/ncu-details.txt" 2>&1
  grep -E "^  mqf_|Duration|Registers Per|DRAM Throughput|Achieved Occupancy" "$OUT/ncu-details.txt" | head -60 ;;
dprofile)  # ncu: GPU time of every kernel of ${DPROFILE_TOKENS:-3} patched greedy decode tokens at 4K (the
           # profiler on around those tokens only, after warm-up steps), per token and kernel family: the
           # GPU floor under a decode token. DPROFILE_SWITCH=VAR=0 profiles with a switch set.
           # Files: decode-breakdown.txt, decode-kernels.csv.gz
  [ -n "$NCU" ] || { echo "no ncu (Nsight Compute) on this machine"; exit 2; }
  K="${DPROFILE_TOKENS:-3}"
  env ${DPROFILE_SWITCH:-} timeout 330 "$NCU" --profile-from-start off --metrics gpu__time_duration.sum --csv \
    python3 bench/profile_kernels.py decode $P --context 4096 --tokens-profiled "$K" \
    > /tmp/decode-kernels.csv 2> /tmp/decode-profile.err
  echo "rc=$?" >> /tmp/decode-profile.err
  { grep -E "^# decode|^rc=|rror" /tmp/decode-profile.err; python3 bench/profile_kernels.py summary \
      /tmp/decode-kernels.csv --per "$K"; } > "$OUT/decode-breakdown.txt" 2>&1
  gzip -c /tmp/decode-kernels.csv > "$OUT/decode-kernels.csv.gz"; cat "$OUT/decode-breakdown.txt" ;;
phases)  # bench.phase_clock: the diagnostic builds of the one-launch GDN mixer and MoE block at the model's
         # shapes, SM cycles per phase (median and last block) at the card's SM clock. Files: phase-clock.json,
         # phase-clock.log
  MHZ=$(nvidia-smi --query-gpu=clocks.max.sm --format=csv,noheader,nounits | head -1)
  timeout 300 python3 -m bench.phase_clock --sm-mhz "${MHZ:-1980}" --out "$OUT/phase-clock.json" \
    > "$OUT/phase-clock.log" 2>&1; echo "rc=$?" >> "$OUT/phase-clock.log"; cat "$OUT/phase-clock.log" ;;
userview)  # bench.user_view: mlx-lm's `benchmark` command in fresh processes, stock vs patched, 3 processes
           # per engine, alternating. UV_CONFIGS (default b1: 4K prompt, 128 tokens, batch 1; ~290 s warm; on a
           # fresh machine stock's first process alone took 204-312 s, so b1 needs a second call there) picks the configurations; the rest of the sweep (UV_CONFIGS=32k,128k, then
           # b4) goes into later calls of a warm machine with UV_RESUME=<the previous user_view.json copied into
           # the tree>, merged into one file. One MLX compile cache for both engines (MLX_PTX_CACHE_DIR set
           # here: the user's own, so --stock keeps it), reused while the machine stays warm.
           # Files: user_view.json, user_view.log
  export MLX_PTX_CACHE_DIR="${MLX_PTX_CACHE_DIR:-/tmp/mlx-ptx-uv}"
  R=""; [ -f "${UV_RESUME:-}" ] && R="--resume $UV_RESUME"
  timeout 570 python3 -m bench.user_view $P --checkpoint /tmp/uv-ckpt --configs "${UV_CONFIGS:-b1}" $R \
    --budget-s 530 --out "$OUT/user_view.json" > "$OUT/user_view.log" 2>&1
  echo "rc=$?" >> "$OUT/user_view.log"; tail -24 "$OUT/user_view.log" ;;
firstuse)  # bench.first_use: `python -m mlx_qwen_fast.generate` twice in fresh processes, the first with
           # empty compile caches, on the full-size random checkpoint in $CK, written first (~2 min)
           # unless a complete one is there (generation_config.json is the checkpoint CLI's last file).
           # Files: first_use.json, first_use.log
  CK="${CK:-/tmp/ck}"
  if [ ! -f "$CK/config.json" ] || [ ! -f "$CK/generation_config.json" ]; then
    timeout 240 python3 -m mlx_qwen_fast.checkpoint --preset qwen3.6-35b-a3b --out "$CK" --overwrite \
      > "$OUT/first_use.log" 2>&1 || { tail -5 "$OUT/first_use.log"; exit 1; }
  fi
  FUR=""; [ "${FU_WARMUP:-0}" = 1 ] && rm -rf /tmp/fu && FUR="--cache-root /tmp/fu"
  timeout 330 python3 -m bench.first_use --model "$CK" --runs 2 --timeout 250 $FUR --out "$OUT/first_use.json" \
    >> "$OUT/first_use.log" 2>&1; echo "rc=$?" >> "$OUT/first_use.log"; grep -E "^run |^rc=" "$OUT/first_use.log"
  [ "${FU_WARMUP:-0}" = 1 ] || exit 0
  # FU_WARMUP=1: then `python -m mlx_qwen_fast warmup` (the cut-down model on prompts of 1 to 2,100
  # tokens) on the compile caches the two runs filled (bench.first_use --cache-root /tmp/fu), so that
  # the listing also names every MLX module that other prompt lengths compile, with the second each
  # appeared. Files: warmup.log (its start and end in epoch seconds), warmup-cache.txt (ls of both)
  export MLX_PTX_CACHE_DIR=/tmp/fu/mlx-ptx MLX_QWEN_FAST_CACHE=/tmp/fu/kernels
  date +%s.%N > "$OUT/warmup.log"
  timeout "${FU_WARMUP_S:-240}" python3 -m mlx_qwen_fast warmup --model "$CK" >> "$OUT/warmup.log" 2>&1
  echo "rc=$? end $(date +%s.%N)" >> "$OUT/warmup.log"; tail -3 "$OUT/warmup.log"
  ls -l --time-style=+%s.%N "$MLX_PTX_CACHE_DIR" "$MLX_QWEN_FAST_CACHE" > "$OUT/warmup-cache.txt" 2>&1
  grep -c "\.ptx$" "$OUT/warmup-cache.txt" ;;
ahead)  # the first use with MLX's compiles in worker processes (MLX_QWEN_FAST_COMPILE_AHEAD=1) and without
        # (=0), each one process on empty compile caches (bench.first_use --runs 1), on the checkpoint in $CK
        # (written first unless complete). Files: ahead-on.json, ahead-off.json, ahead.log
  CK="${CK:-/tmp/ck}"
  if [ ! -f "$CK/config.json" ] || [ ! -f "$CK/generation_config.json" ]; then
    timeout 240 python3 -m mlx_qwen_fast.checkpoint --preset qwen3.6-35b-a3b --out "$CK" --overwrite \
      > "$OUT/ahead.log" 2>&1 || { tail -5 "$OUT/ahead.log"; exit 1; }
  fi
  for V in ${AHEAD_ORDER:-1 0}; do
    L=$([ "$V" = 1 ] && echo on || echo off)
    MLX_QWEN_FAST_COMPILE_AHEAD=$V timeout 260 python3 -m bench.first_use --model "$CK" --runs 1 --timeout 240 \
      --out "$OUT/ahead-$L.json" >> "$OUT/ahead.log" 2>&1; echo "rc=$? ($L)" >> "$OUT/ahead.log"
  done
  grep -E "^run |^rc=" "$OUT/ahead.log" ;;
decode)  # graph nodes per decode token at 4K (bench.nodes: stock and patched), then mlx-lm's benchmark
        # through our CLI on the checkpoint in $CK (written first unless complete), with the switch
        # ${DECODE_AB:-MLX_QWEN_FAST_DECODE_LAYER} =1 and =0 alternating, ${DECODE_PAIRS:-3} processes each
        # (a fresh machine's first process pays MLX's compiles: one more before the timed pairs);
        # NODES=0 skips the node count. Files: nodes-4k.json, nodes-4k.log, layer-ab.log
  CK="${CK:-/tmp/ck}"
  if [ ! -f "$CK/config.json" ] || [ ! -f "$CK/generation_config.json" ]; then
    timeout 240 python3 -m mlx_qwen_fast.checkpoint --preset qwen3.6-35b-a3b --out "$CK" --overwrite \
      > "$OUT/layer-ab.log" 2>&1 || { tail -5 "$OUT/layer-ab.log"; exit 1; }
  fi
  if [ "${NODES:-1}" != 0 ]; then
    timeout 120 python3 -m bench.nodes $P --context 4096 --out "$OUT/nodes-4k.json" > "$OUT/nodes-4k.log" 2>&1
    echo "rc=$?" >> "$OUT/nodes-4k.log"; tail -10 "$OUT/nodes-4k.log"
  fi
  BENCH="python3 -m mlx_qwen_fast benchmark --model $CK -p 4096 -g 128 -n 2"
  AB="${DECODE_AB:-MLX_QWEN_FAST_DECODE_LAYER}"
  echo "== warm-up" >> "$OUT/layer-ab.log"; timeout 200 $BENCH >> "$OUT/layer-ab.log" 2>&1
  for i in $(seq "${DECODE_PAIRS:-3}"); do for L in 1 0; do
    echo "== pair $i $AB=$L" >> "$OUT/layer-ab.log"
    env "$AB=$L" timeout 90 $BENCH >> "$OUT/layer-ab.log" 2>&1; echo "rc=$?" >> "$OUT/layer-ab.log"
  done; done
  grep -E "^== |Averages|^rc=" "$OUT/layer-ab.log" ;;
split)  # bench.decode_split at 4K on the in-memory random checkpoint (nodes per token, host build and encode,
        # GPU wait, pipelined tok/s), the switch ${SPLIT_AB:-MLX_QWEN_FAST_GDN_MIXER} =0 and =1 alternating,
        # ${SPLIT_PAIRS:-2} processes each. Files: split-ab.log
  AB="${SPLIT_AB:-MLX_QWEN_FAST_GDN_MIXER}"
  for i in $(seq "${SPLIT_PAIRS:-2}"); do for L in 0 1; do
    echo "== pair $i $AB=$L" >> "$OUT/split-ab.log"
    env "$AB=$L" timeout 150 python3 -m bench.decode_split $P --context 4096 --nodes --repeats 2 --steps 30 \
      --pipelined 100 >> "$OUT/split-ab.log" 2>&1; echo "rc=$?" >> "$OUT/split-ab.log"
  done; done
  grep -E "^== |^# ops|^nodes|^split|^rc=" "$OUT/split-ab.log" ;;
*) echo "usage: bash bench/h200.sh {tests|ab|ops|profile|dprofile|phases|userview|firstuse|ahead|decode|split}"; exit 2 ;;
esac
