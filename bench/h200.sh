#!/usr/bin/env bash
# H200 session driver: one stage per device call (each under 10 minutes).
#   bash bench/h200.sh prefill   # prefill sweep 256..128K, stock vs patched
#   bash bench/h200.sh decode    # decode sweep 256..128K context
#   bash bench/h200.sh ab        # both sweeps in one process (one stock warm-up; ~9 min)
#   bash bench/h200.sh tests     # pytest -m cuda, kernel tests (MoE first; ~5-8 min)
#   bash bench/h200.sh layers    # tests/test_cuda_layers.py (full GDN layer vs stock; 182 s on 2026-12-01)
#   bash bench/h200.sh checks    # decode-path tests + numerics (stock/patched vs fp32), then the per-op benchmark (300 s on 2026-12-01)
#   bash bench/h200.sh moe       # MoE kernel device scripts: grouped GEMM variants, decode GEMV
#   bash bench/h200.sh kernels   # every CUDA test in parallel (untimed), then on a quiet GPU the MoE
#                                # kernel timings and a patched-only decode with/without the MoE decode kernels (~9 min)
#   bash bench/h200.sh profile   # chained-call latency of the prefill kernels + ncu --set full on them (~4 min)
#   bash bench/h200.sh prefill-check  # prefill kernel + layer tests, chained latencies, ops rows at 4K, patched prefill A/B (~5 min)
#   bash bench/h200.sh diag      # chained latencies, GDN decode-step ops, per-kernel GPU time of a 4K prefill (ncu)
#   bash bench/h200.sh fused     # fused GDN prefill kernel: tests, chained latencies, prefill-step op (~3 min)
#   bash bench/h200.sh check     # GDN kernel + layer tests in parallel, ncu of the front end (~3 min)
#   bash bench/h200.sh final     # GDN prefill linked chains, patched prefill with the fused GDN kernel off/on, A/B at 4K
#   bash bench/h200.sh frontend  # GDN front end (16-byte weight loads): tests, chains at 16/8 tokens per warp, decode-step split, ncu (~6 min)
#   bash bench/h200.sh steady    # steady-state chained latencies, bench.ops prefill rows, ncu GPU times, fused GDN off/on (~6 min)
#   bash bench/h200.sh decodecheck  # decode-path tests, decode split, bench.ops decode rows, packed projection off/on (~7 min)
#   bash bench/h200.sh ab4k      # end-to-end A/B at 4K, stock vs patched (~3.5 min)
#   bash bench/h200.sh moedecode # one-launch decode MoE: tests, bench/moe_decode_cuda.py, FUSED_AB="0 1" decode off/on (~5-9 min)
#   bash bench/h200.sh gemmncu   # ncu GPU time of each MoE-block kernel at T=4096 (pflv, wg), then ab4k (~6 min)
#   bash bench/h200.sh s10a      # tenth session: four-input GDN decode kernel tests, per-node host cost, decode ms_steady
#   bash bench/h200.sh s10b      # tenth session: compiled-step tests on the GPU, decode rows again, A/B at 4K (~6 min)
#   bash bench/h200.sh s10c      # tenth session: one-lop3 decode MoE dequant (tests, kernel times), decode_step rows x2
#   bash bench/h200.sh s10d      # tenth session: the final tree's GDN decode tests (kernel, layer, CPU-side checks)
#   (s10e, the tenth session's shared-expert prototype under ncu, was removed with the prototype: s13b times the production form)
#   bash bench/h200.sh s12a      # twelfth session: compressed-fatbin images vs cubins (tests, node cost, decode rows)
#   bash bench/h200.sh s12b|s12c # twelfth session: issue 4's GDN rows x3 + the 4K A/B; patched decode fatbin vs cubin
#   bash bench/h200.sh s12d      # twelfth session: the whole model's start-up cost; the prefill/layer CUDA tests with fatbin images
#   bash bench/h200.sh s14a      # fourteenth session: one-launch decode MoE tests, CuPy-graph times and phases, slot tests
#   (s14c, the fourteenth session's L2-prefetch trial of the decode step, was removed with the prefetch: calls 6-7, moe-cuda-log.md)
#   bash bench/h200.sh s14b      # fourteenth session: bench.ops moe.decode, stock / four-node step / one launch
#   bash bench/h200.sh s15a      # fifteenth session: the one-token decode block's read floor vs its kernels, 4 and 40 layers
#   bash bench/h200.sh s15b      # fifteenth session: decode MoE kernel tests, then s15a with the kernels' phase stamps
#   bash bench/h200.sh s16a      # sixteenth session: s15b's tests, then the read floors incl. the dependent one-launch floor
#   bash bench/h200.sh s16d      # sixteenth session: the final tree's routing tie test and one-launch tests
#   bash bench/h200.sh s16c      # sixteenth session: route_warp rescan form (reverted after this call): routing tests, one-launch tests, floors
#   bash bench/h200.sh s16b      # sixteenth session: the read floors (dependent floor: barriers vs flags in the data), kernel times N = 1, 2, 4
#   (s15c, the fifteenth session's one-launch "overlap" expert kernel, was removed with it: calls 4-5, moe-cuda-log.md)
#   bash bench/h200.sh s13e      # thirteenth session: the route fix checked (column routing repeated, slot tests)
#   bash bench/h200.sh s13c|s13d # thirteenth session: the slot with one router+gate matmul (tests, ncu); the 4K A/B
#   bash bench/h200.sh s13b      # thirteenth session: the shared expert in the routing's shared slot (tests, ncu per T, 3 forms)
#   bash bench/h200.sh s13a      # thirteenth session: the review-fixed nvFatbin path (fatbin_id, tests), decode_step x3
#   bash bench/h200.sh s11a      # eleventh session: MLX's CUDA graphs on/off: node cost, GDN decode rows, patched decode 4K
#   bash bench/h200.sh s11b      # eleventh session: routing inside the decode MoE kernels (tests, MLX and CuPy-graph times)
#   bash bench/h200.sh s11c      # eleventh session: shared expert through the wg kernels (tests, ncu of the block with/without)
#   bash bench/h200.sh s9b|s9c   # ninth session: register cap and stall reasons of the wg GEMMs; the MoE block under ncu
#   bash bench/h200.sh s8a|s8b|s8c|s8d  # eighth session: grouping kernels, ncu of one MoE-block call, graph limits, block tests
#   bash bench/h200.sh wgmma     # wgmma MoE GEMM: its CUDA tests, chained timings vs pflv, patched 4K prefill pflv/wg (~7 min)
#   bash bench/h200.sh scan      # GDN scan variants (check, chained latency), prefill A/B with the fastest (~8 min)
# Run from the repo root on the device with .mlxcuda carried; results go to $OUT.
# A fresh process pays MLX-CUDA's first-use kernel compilation: 177-225 s for
# the stock engine's per-token GDN loop (measured 2026-11-29 and 2026-12-01),
# hence the separate --warmup-max-seconds budget and one process per stage.
# Never run two GPU jobs at once when timing: only the ratios within one run
# mean anything then.
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
# needs_nvf: stop a fatbin-vs-cubin stage that has no nvFatbin (both legs would run cubins)
needs_nvf() { [ -n "$NVF" ] || { echo "no libnvfatbin: carry .nvfatbin/ (the nvidia-nvfatbin wheel)"; exit 2; }; }
export PYTHONPATH="$PWD:$PYTHONPATH" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
P="--preset qwen3.6-35b-a3b --router-skew ${SKEW:-1.0}"
AB="python3 -m bench.ab $P --no-plots --warmup-max-seconds 300"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)  # Nsight Compute CLI
# ncu_table CSV [WIDTH]: "ID kernel-name GPU-time" per row of an `ncu --csv` metrics file.
ncu_table() {
  python3 -c "import csv,sys; [print(r['ID'], r['Kernel Name'][:int(sys.argv[2])], r['Metric Value']) for r in csv.DictReader(l for l in open(sys.argv[1]) if l.startswith('\"'))]" "$1" "${2:-70}"
}
# ncu_calls CSV: split an `ncu --csv` GPU-time file into calls (a call starts at each kernel named as the
# first one, e.g. the router matmul of a MoE block) and print each call's kernel count and total in us
ncu_calls() {
  python3 -c "
import csv, sys
rows = [r for r in csv.DictReader(l for l in open(sys.argv[1]) if l.startswith('\"'))]
scale = {'nsecond': 1e-3, 'ns': 1e-3, 'usecond': 1.0, 'us': 1.0, 'msecond': 1e3, 'ms': 1e3}
calls = []
for r in rows:
    if not calls or r['Kernel Name'] == rows[0]['Kernel Name']:
        calls.append([])
    calls[-1].append((r['Kernel Name'][:48], float(r['Metric Value'].replace(',', '')) * scale.get(r['Metric Unit'], 1.0)))
for i, c in enumerate(calls):
    print(f'call {i}: {len(c)} kernels, {sum(t for _, t in c):.1f} us;', '; '.join(f'{n[:28]} {t:.1f}' for n, t in c))
" "$1"
}
# ncu_block: GPU time of every kernel of one patched MoE-block call (T=4096, then T=1) -> $OUT/ncu-block.csv
ncu_block() {
  timeout 150 $NCU --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
    python3 bench/profile_kernels.py block > $OUT/ncu-block.csv 2>$OUT/ncu-block.err
  ncu_table $OUT/ncu-block.csv
}
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
checks)  # decode-path CUDA tests in the background (untimed) beside the numerics, then the per-op benchmark alone
  XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 3"
  ( timeout 280 python3 -m pytest -q $XD tests/test_cuda_layers.py tests/test_cuda_moe_decode.py \
      tests/test_compiled_steps.py "tests/test_cuda_moe.py::test_grouped_gemm_refuses_unsupported" \
      "tests/test_cuda_moe.py::test_dispatch_by_backend_and_env" > "$OUT/tests-decode.txt" 2>&1
    echo "rc=$?" >> "$OUT/tests-decode.txt" ) &
  timeout 330 python3 -m bench.numerics $P --out "$OUT/numerics.json" > "$OUT/numerics.log" 2>&1
  wait; tail -3 "$OUT/tests-decode.txt"; tail -8 "$OUT/numerics.log"
  timeout 220 python3 -m bench.ops $P --max-seconds 15 --out "$OUT/ops.json" > "$OUT/ops.log" 2>&1
  tail -45 "$OUT/ops.log" ;;
moe)  # logs and JSONs packed into one file: $OUT brings back at most 8 files
  M=/tmp/moe_out; mkdir -p $M
  timeout 300 python3 bench/moe_cuda.py --sections check,time --out $M 2>&1 | tail -45
  timeout 200 python3 bench/moe_decode_cuda.py --out $M 2>&1 | tail -20
  tar czf "$OUT/moe.tgz" -C $M . ;;
kernels)  # correctness first, all at once (nothing is timed while they run), then timings alone
  M=/tmp/k_out; mkdir -p $M; XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 4"
  ( timeout 330 python3 -m pytest -q -m cuda $XD tests/test_cuda_moe.py tests/test_cuda_moe_decode.py \
      tests/test_cuda_gated_delta.py > $M/tests.txt 2>&1; echo "rc=$?" >> $M/tests.txt ) &
  ( timeout 330 python3 -m pytest -q tests/test_cuda_layers.py > $M/tests-layers.txt 2>&1; echo "rc=$?" >> $M/tests-layers.txt ) &
  timeout 150 python3 bench/moe_cuda.py --sections build,check --out $M > $M/moe-check.txt 2>&1
  timeout 120 python3 bench/moe_decode_cuda.py --sections build,check --out $M > $M/moe-decode-check.txt 2>&1
  wait; date
  timeout 120 python3 bench/moe_cuda.py --sections time --out $M > $M/moe-time.txt 2>&1
  timeout 100 python3 bench/moe_decode_cuda.py --sections time,raw --out $M > $M/moe-decode-time.txt 2>&1
  for f in 0 1; do MLX_QWEN_FAST_MOE_DECODE_KERNEL=$f timeout 75 $AB --engines patched --decode 4k \
      --decode-steps 32 --rounds 2 --out $M/ab-decode-k$f.json > $M/ab-decode-k$f.txt 2>&1; done
  tar czf "$OUT/kernels.tgz" -C $M .
  tail -4 $M/tests.txt $M/tests-layers.txt; grep -h "check:\|per variant" $M/moe-check.txt $M/moe-decode-check.txt
  tail -62 $M/moe-time.txt | grep -v "^ *[0-9]* route\|^$"; tail -14 $M/moe-decode-time.txt
  grep -h "^decode" $M/ab-decode-k*.txt ;;
scan)  # GDN scan variants (checked vs fp32, chained latency), then a prefill A/B with the fastest checked one
  M=/tmp/s_out; mkdir -p $M
  timeout 200 python3 bench/gdn_cuda.py --sections scan --out $M > $M/gdn-scan.txt 2>&1
  CFG=$(python3 bench/pick_scan_config.py $M/gdn_scan.json); echo "fastest checked scan config: $CFG"
  SET="import sys, bench.ab as a, mlx_qwen_fast.kernels.gated_delta_scan as S; S.DEFAULT_CONFIG = S.ScanConfig(*map(int, sys.argv[1].split(','))); a.main(sys.argv[2:])"
  timeout 300 python3 -c "$SET" "$CFG" $P --no-plots --warmup-max-seconds 300 --prefill 512,4k --rounds 2 \
    --max-seconds 30 --out $M/ab-prefill-scan.json > $M/ab-prefill-scan.txt 2>&1
  timeout 140 python3 -c "$SET" "$CFG" $P --no-plots --engines patched --prefill $L --rounds 2 \
    --max-seconds 30 --out $M/ab-prefill-patched.json > $M/ab-prefill-patched.txt 2>&1
  tar czf "$OUT/scan.tgz" -C $M .
  grep -h "\[scan\]\|FAIL" $M/gdn-scan.txt | tail -24; grep -h "^prefill" $M/ab-prefill-*.txt ;;
profile)  # optional CUDA tests first ($PTESTS: pytest args, untimed, in parallel), then the chained
          # (dependent) call latency of the prefill kernels, then ncu --set full on them
  M=/tmp/p_out; mkdir -p $M
  if [ -n "${PTESTS:-}" ]; then
    eval "timeout 240 python3 -m pytest -q -n 4 $PTESTS" > $M/tests.txt 2>&1; echo "rc=$?" >> $M/tests.txt
    tail -6 $M/tests.txt
  fi
  timeout 200 python3 bench/profile_kernels.py chain > $M/chain.txt 2>&1; grep -v "^\[" $M/chain.txt | tail -16
  [ "${PNCU:-1}" = 0 ] && exit 0
  timeout 240 $NCU --clock-control none --set full -k "regex:mqf_gdn_scan|mqf_moe_gate_up|mqf_moe_down" \
    -o $M/prof python3 bench/profile_kernels.py ncu > $M/ncu-run.txt 2>&1; tail -2 $M/ncu-run.txt
  $NCU --import $M/prof.ncu-rep --page details > $M/details.txt 2>&1
  $NCU --import $M/prof.ncu-rep --page source --print-source sass --csv > $M/sass.csv 2>&1
  tar czf "$OUT/profile.tgz" --exclude prof.ncu-rep -C $M .
  grep -E "^  mqf_|Duration|Registers Per|Issued Ipc Active|  Executed Instructions  " $M/details.txt | head -64 ;;
prefill-check)  # prefill kernels: CUDA tests (GDN + MoE kernels with the default GEMM variant, layers; untimed,
                # in parallel), then on a quiet GPU chained latencies, bench.ops prefill rows at 4K and a
                # patched-only prefill A/B (296 s on 2026-12-01); files straight to $OUT (7 + gpu.txt), so a cut run keeps them
  M=$OUT; XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 4"
  ( timeout 200 python3 -m pytest -q $XD tests/test_cuda_moe.py tests/test_cuda_gated_delta.py \
      -k "pflv or not grouped_gemm_vs_reference" > $M/tests.txt 2>&1; echo "rc=$?" >> $M/tests.txt ) &
  ( timeout 200 python3 -m pytest -q tests/test_cuda_layers.py > $M/tests-layers.txt 2>&1; echo "rc=$?" >> $M/tests-layers.txt ) &
  wait; tail -3 $M/tests.txt $M/tests-layers.txt
  timeout 90 python3 bench/profile_kernels.py chain > $M/chain.txt 2>&1; grep -v "^\[" $M/chain.txt
  timeout 100 python3 -m bench.ops $P --ops gated_delta.prefill,moe.prefill --prefill-tokens 4k \
    --impls stock-loop,stock,cuda-kernel --max-seconds 8 --out $M/ops.json > $M/ops.log 2>&1; grep -E "^(gated|moe)" $M/ops.log
  timeout 90 $AB --engines patched --prefill 512,4k --rounds 2 --max-seconds 15 --out $M/ab-prefill.json \
    > $M/ab-prefill.txt 2>&1; grep -h "^prefill" $M/ab-prefill.txt ;;
diag)  # GDN kernel + layer tests (untimed, in parallel), then where the time goes: chained latencies
       # of the GDN front end alone / + scan / fused, the GDN prefill-step, decode-step and decode-layer
       # ops, MoE pflv with and without its register cap, the per-kernel GPU time of one patched 4K
       # prefill (ncu), stock dense qmm vs bf16 at the projection shapes; files straight to $OUT (8)
  M=$OUT
  XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 4"
  ( timeout 170 python3 -m pytest -q $XD tests/test_cuda_gated_delta.py -k "fused or frontend or decode" \
      > $M/tests.txt 2>&1; echo "rc=$?" >> $M/tests.txt ) &
  ( timeout 170 python3 -m pytest -q tests/test_cuda_layers.py -k fused_layer > $M/tests-layers.txt 2>&1
    echo "rc=$?" >> $M/tests-layers.txt ) &
  wait; tail -3 $M/tests.txt $M/tests-layers.txt
  timeout 60 python3 bench/profile_kernels.py chain gdn > $M/chain.txt 2>&1; grep -v "^\[" $M/chain.txt
  timeout 90 python3 -m bench.ops $P --ops gated_delta.prefill_step,gated_delta.decode_step,gated_delta.decode_layer \
    --prefill-tokens 4k --impls cuda-kernel,cuda-fused,stock,patched --max-seconds 6 \
    --out $M/ops-gdn.json > $M/ops-gdn.log 2>&1; grep "^gated" $M/ops-gdn.log
  timeout 90 python3 bench/profile_kernels.py chain moe >> $M/chain.txt 2>&1; grep -v "^\[" $M/chain.txt | grep moe -A1
  timeout 150 $NCU --profile-from-start off --metrics gpu__time_duration.sum --csv \
    python3 bench/prefill_profile.py run $P --tokens 4k > /tmp/prefill-kernels.csv 2> /tmp/pp.err
  tail -3 /tmp/pp.err > $M/prefill-breakdown.txt
  python3 bench/prefill_profile.py summary /tmp/prefill-kernels.csv >> $M/prefill-breakdown.txt 2>&1
  gzip -c /tmp/prefill-kernels.csv > $M/prefill-kernels.csv.gz; cat $M/prefill-breakdown.txt
  timeout 60 python3 bench/profile_kernels.py chain qmm >> $M/chain.txt 2>&1; grep -A1 "^dense" $M/chain.txt ;;
fused)  # fused GDN prefill kernel: its tests (vs the two kernels, bit for bit), then chained latencies
        # (scan alone, two kernels, fused with 1 and 2 front-end blocks per SM) and the prefill-step op
  M=$OUT; XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 4"
  timeout 120 python3 -m pytest -q $XD tests/test_cuda_gated_delta.py -k "fused" > $M/tests-fused.txt 2>&1
  echo "rc=$?" >> $M/tests-fused.txt; tail -n 3 $M/tests-fused.txt
  timeout 100 python3 bench/profile_kernels.py chain scan,gdn > $M/chain-fused.txt 2>&1; grep -v "^\[" $M/chain-fused.txt
  timeout 60 python3 -m bench.ops $P --ops gated_delta.prefill_step --prefill-tokens 4k --impls cuda-kernel,cuda-fused \
    --max-seconds 6 --out $M/ops-prefill-step.json > $M/ops-prefill-step.log 2>&1; grep "^gated" $M/ops-prefill-step.log ;;
check)  # the GDN kernel tests (but T=4096) and the GDN layer tests (both prefill paths), in parallel, then
        # ncu --set full of the front-end kernel; files straight to $OUT
  M=$OUT
  XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 6"
  timeout 150 python3 -m pytest -q $XD tests/test_cuda_gated_delta.py tests/test_cuda_layers.py \
    -k "not compiled_decode_step and not 4096" > $M/tests-check.txt 2>&1; echo "rc=$?" >> $M/tests-check.txt; tail -n 3 $M/tests-check.txt
  timeout 45 $NCU --clock-control none --set full -k "regex:mqf_gdn_frontend" -o /tmp/fe \
    python3 bench/profile_kernels.py ncu > /dev/null 2>&1
  $NCU --import /tmp/fe.ncu-rep --page details > $M/ncu-frontend.txt 2>&1
  grep -E "Duration|Registers Per|Issued Ipc A|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occ" $M/ncu-frontend.txt ;;
final)  # linked chains of the GDN prefill (two kernels vs fused), patched-only 4K prefill with the fused
        # kernel off then on, then the end-to-end A/B at 4K (stock vs patched, prefill and decode,
        # alternating); files straight to $OUT
  timeout 60 python3 bench/profile_kernels.py chain gdn > $OUT/chain-final.txt 2>&1; grep -v "^\[" $OUT/chain-final.txt
  timeout 50 python3 -m bench.ops $P --ops gated_delta.prefill_step --prefill-tokens 4k --impls cuda-kernel,cuda-fused \
    --max-seconds 5 --out $OUT/ops-prefill-step.json > $OUT/ops-prefill-step.log 2>&1; grep "^gated" $OUT/ops-prefill-step.log
  for f in 0 1; do MLX_QWEN_FAST_GDN_FUSED=$f timeout 55 $AB --engines patched --prefill 4k --rounds 2 \
      --max-seconds 15 --out /tmp/abf$f.json >> $OUT/ab-fused.log 2>&1; echo "fused=$f: $(grep -h "^prefill" $OUT/ab-fused.log | tail -1)"; done
  timeout 330 $AB --prefill 4k --decode 4k --decode-steps 32 --rounds 2 --max-seconds 60 \
    --out $OUT/ab-final.json > $OUT/ab-final.log 2>&1; tail -14 $OUT/ab-final.log ;;
frontend)  # GDN front end with 16-byte weight loads: GDN kernel + layer tests (untimed, in parallel), then chained
           # latencies (front end at 16 and 8 tokens per warp, alone and + scan linked; fused), the decode step split
           # into graph building and evaluation beside one-op MLX chains, bench.ops prefill-step and decode-step,
           # ncu --set full of the front-end and decode kernels; files straight to $OUT
  M=$OUT
  XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 6"
  timeout 200 python3 -m pytest -q $XD tests/test_cuda_gated_delta.py tests/test_cuda_layers.py \
    -k "not compiled_decode_step and (not 4096 or fused)" > $M/tests.txt 2>&1; echo "rc=$?" >> $M/tests.txt; tail -n 3 $M/tests.txt
  timeout 120 python3 bench/profile_kernels.py chain gdn,decode > $M/chain.txt 2>&1; grep -v "^\[" $M/chain.txt
  timeout 70 python3 -m bench.ops $P --ops gated_delta.prefill_step,gated_delta.decode_step --prefill-tokens 4k \
    --impls cuda-kernel,cuda-fused --max-seconds 6 --out $M/ops.json > $M/ops.log 2>&1; grep "^gated" $M/ops.log
  timeout 90 $NCU --clock-control none --set full -k "regex:mqf_gdn_frontend|mqf_gdn_decode|mqf_moe_dec" -c 6 -o /tmp/fd \
    python3 bench/profile_kernels.py ncu > /dev/null 2>&1
  $NCU --import /tmp/fd.ncu-rep --page details > $M/ncu-details.txt 2>&1
  grep -E "^  mqf_|Duration|Registers Per|DRAM Throughput|Achieved Occupancy|Theoretical Occ|Sectors/Req|L1/TEX Hit" $M/ncu-details.txt | head -64 ;;
steady)  # steady-state chained latencies (chains of 16 and 48: host work overlaps GPU work, as in the model's
         # prefill) of the GDN prefill kernels and the MoE experts, bench.ops prefill rows at 4K, the kernels' GPU
         # time in ncu, patched-only 4K prefill with the fused GDN kernel off, on, off, on; files straight to $OUT
  M=$OUT
  timeout 150 python3 bench/profile_kernels.py chain scan,gdn,moe > $M/chain.txt 2>&1; grep -v "^\[" $M/chain.txt
  timeout 150 python3 -m bench.ops $P --ops gated_delta.prefill,gated_delta.prefill_step,moe.prefill --prefill-tokens 4k \
    --impls cuda-kernel,cuda-fused --max-seconds 8 --out $M/ops.json > $M/ops.log 2>&1; grep -E "^(gated|moe)" $M/ops.log
  timeout 90 $NCU --clock-control none --metrics gpu__time_duration.sum --csv -k "regex:mqf_gdn|mqf_moe_gate|mqf_moe_down" \
    python3 bench/profile_kernels.py ncu > $M/ncu-times.csv 2>/dev/null
  python3 -c "import csv,sys; [print(r['Kernel Name'][:40], r['Metric Value'], r['Metric Unit']) for r in csv.DictReader(l for l in open(sys.argv[1]) if l.startswith('\"'))]" $M/ncu-times.csv
  for f in 0 1 0 1; do MLX_QWEN_FAST_GDN_FUSED=$f timeout 60 $AB --engines patched --prefill 4k --rounds 2 \
      --max-seconds 15 --no-ceilings --out /tmp/abf.json >> $M/ab-fused.log 2>&1; echo "fused=$f: $(grep -h "^prefill .*patched ok" $M/ab-fused.log | tail -1)"; done ;;
decodecheck)  # the decode paths changed on 2026-12-02 (packed GDN input projection, MoE step without reshapes):
              # their CUDA tests (untimed, in parallel), then on a quiet GPU the decode split, bench.ops decode rows,
              # patched-only decode at 4K context with the packed projection off, on, off, on; files straight to $OUT
  M=$OUT; XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 6"
  timeout 230 python3 -m pytest -q $XD tests/test_cuda_gated_delta.py tests/test_cuda_layers.py tests/test_cuda_moe_decode.py \
    tests/test_cuda_moe.py -k "decode or rout or dispatch or block_cuda or fused_layer or compiled" \
    > $M/tests.txt 2>&1; echo "rc=$?" >> $M/tests.txt; tail -n 3 $M/tests.txt
  timeout 60 python3 bench/profile_kernels.py chain decode > $M/chain.txt 2>&1; grep -v "^\[" $M/chain.txt
  timeout 100 python3 -m bench.ops $P --ops gated_delta.decode_layer,gated_delta.decode_step,moe.decode \
    --impls stock,patched,cuda-kernel,cuda-decode-kernel --max-seconds 5 --out $M/ops.json > $M/ops.log 2>&1
  grep -E "^(gated|moe)" $M/ops.log
  for f in 0 1 0 1; do MLX_QWEN_FAST_GDN_PACKED_DECODE=$f timeout 70 $AB --engines patched --decode 4k --decode-steps 32 \
      --rounds 2 --no-ceilings --out /tmp/abd.json >> $M/ab-packed.log 2>&1
    echo "packed=$f: $(grep -h "^decode .*patched ok" $M/ab-packed.log | tail -1)"; done ;;
wgmma)  # the "wg" grouped GEMM (2026-12-02): its CUDA tests (untimed), then steady chained timings against pflv
         # (bench/moe_wgmma.py), then patched-only 4K prefill with the default GEMM variant pflv / wg / pflv / wg
  M=$OUT; timeout 200 python3 -m pytest -q -n 6 tests/test_cuda_moe.py -k "wg or block_cuda or dispatch or default" \
    > $M/tests.txt 2>&1; echo "rc=$?" >> $M/tests.txt; tail -n 2 $M/tests.txt
  timeout 150 python3 bench/moe_wgmma.py --sections time --out $M > $M/time.txt 2>&1; tail -12 $M/time.txt
  SET="import sys, bench.ab as a, mlx_qwen_fast.kernels.moe_grouped_gemm as G; G.DEFAULT_VARIANT = sys.argv[1]; a.main(sys.argv[2:])"
  for v in pflv wg pflv wg; do timeout 90 python3 -c "$SET" $v $P --no-plots --engines patched --prefill 4k --rounds 2 \
      --max-seconds 15 --no-ceilings --out /tmp/abv.json >> $M/ab-variant.log 2>&1
    echo "$v: $(grep -h '^prefill .*patched ok' $M/ab-variant.log | tail -1)"; done ;;
moedecode)  # the one-launch decode MoE kernel (2026-12-02): decode MoE tests (untimed), then build/check/time/raw
             # of bench/moe_decode_cuda.py alone on the GPU, then patched-only 4K decode with it off/on/off/on
  M=$OUT; timeout 240 python3 -m pytest -q -n 6 tests/test_cuda_moe_decode_fused.py tests/test_cuda_moe_decode.py \
    > $M/tests.txt 2>&1; echo "rc=$?" >> $M/tests.txt; tail -n 3 $M/tests.txt
  timeout 240 python3 bench/moe_decode_cuda.py --out $M > $M/moe-decode.txt 2>&1; tail -32 $M/moe-decode.txt
  for f in ${FUSED_AB:-}; do MLX_QWEN_FAST_MOE_DECODE_FUSED=$f timeout 90 $AB --engines patched --decode 4k \
      --decode-steps 32 --rounds 2 --no-ceilings --out $M/ab-decode-f$f.json >> $M/ab-decode.log 2>&1
    echo "fused=$f: $(grep -h '^decode .*patched ok' $M/ab-decode.log | tail -1)"; done ;;
gemmncu)  # GPU time (ncu, boost clocks) of every kernel of the MoE block at T=4096 with pflv and wg
          # (bench/moe_wgmma.py --sections ncu: routing, x permutation, gate+up, down, combine), then ab4k
  M=$OUT
  timeout 200 $NCU --clock-control none --metrics gpu__time_duration.sum --csv \
    python3 bench/moe_wgmma.py --sections ncu --out /tmp/wgn > $M/ncu-moe.csv 2>/dev/null
  ncu_table $M/ncu-moe.csv 60 | tail -24
  timeout 330 $AB --prefill 4k --decode 4k --decode-steps 32 --rounds 2 --max-seconds 60 \
    --out $OUT/ab-4k.json > $OUT/ab-4k.log 2>&1; tail -14 $OUT/ab-4k.log ;;
s8a)  # routing tests, every kernel of one MoE-block call under ncu (T=4096, T=1), patched decode at 4K
       # with MLX's default graph limits and with MLX_MAX_MB_PER_BUFFER raised, alternating (~7 min)
  XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 4"
  timeout 150 python3 -m pytest -q $XD tests/test_cuda_moe.py -k "rout or grouped_gemm_vs or block_cuda" \
    > $OUT/tests-routing.txt 2>&1; echo "rc=$?" >> $OUT/tests-routing.txt; tail -3 $OUT/tests-routing.txt
  ncu_block
  for mb in default 1000000 default 1000000; do
    if [ $mb = default ]; then E=""; else E="MLX_MAX_MB_PER_BUFFER=$mb"; fi
    env $E timeout 80 $AB --engines patched --decode 4k --decode-steps 32 --rounds 2 --max-seconds 30 \
      --out $OUT/dec-mb-$mb.json > $OUT/dec-mb-$mb-$RANDOM.log 2>&1
    echo "MB=$mb: $(ls -t $OUT/dec-mb-$mb-*.log | head -1 | xargs tail -1)"
  done ;;
s8b)  # grouping kernels (count + scatter): tests, ncu of one MoE-block call; patched decode at 4K under
       # MLX's graph limits: MLX default (1000 MB), the package's (no byte limit), + 300 ops, + fused MoE decode
  timeout 200 python3 -m pytest -q tests/test_cuda_moe.py -k "rout or block_cuda or (wg_grouped_gemm_vs_reference and 2048)" \
    > $OUT/tests-routing.txt 2>&1; echo "rc=$?" >> $OUT/tests-routing.txt; tail -3 $OUT/tests-routing.txt
  ncu_block
  i=0
  for v in mb1000 pkg ops300 fused mb1000 pkg ops300 fused; do
    i=$((i+1)); case $v in mb1000) E="MLX_MAX_MB_PER_BUFFER=1000";; pkg) E="";; ops300) E="MLX_MAX_OPS_PER_BUFFER=300";;
      fused) E="MLX_QWEN_FAST_MOE_DECODE_FUSED=1";; esac
    env $E timeout 80 $AB --engines patched --decode 4k --decode-steps 64 --rounds 3 --max-seconds 30 \
      --out $OUT/dec-$v-$i.json > /tmp/dec-$v-$i.log 2>&1
    echo "$v: $(tail -1 /tmp/dec-$v-$i.log)"
  done
  for v in mb1000 pkg; do
    [ $v = mb1000 ] && E="MLX_MAX_MB_PER_BUFFER=1000" || E=""
    env $E timeout 80 $AB --engines patched --prefill 4k --rounds 3 --max-seconds 30 --out $OUT/pre-$v.json > /tmp/pre-$v.log 2>&1
    echo "prefill $v: $(tail -1 /tmp/pre-$v.log)"
  done
  tar czf $OUT/logs.tgz -C /tmp $(cd /tmp && ls dec-*.log pre-*.log) ;;
s8c)  # the whole-block CUDA test (verbose, stop at the first failure), then ab4k (~6 min)
  timeout 120 python3 -m pytest -q -x -rA tests/test_cuda_moe.py -k "block_cuda" > $OUT/tests-block.txt 2>&1
  echo "rc=$?" >> $OUT/tests-block.txt; grep -v "^PASSED\|^\.\+" $OUT/tests-block.txt | tail -40
  timeout 330 $AB --prefill 4k --decode 4k --decode-steps 32 --rounds 2 --max-seconds 60 \
    --out $OUT/ab-4k.json > $OUT/ab-4k.log 2>&1; tail -14 $OUT/ab-4k.log ;;
s8d)  # the whole-block CUDA tests alone, with durations (~3 min cold)
  timeout 190 python3 -m pytest -q -x -rA --durations=0 tests/test_cuda_moe.py -k "block_cuda" > $OUT/tests-block.txt 2>&1
  echo "rc=$?" >> $OUT/tests-block.txt; tail -30 $OUT/tests-block.txt ;;
ab4k)  # the end-to-end A/B at 4K: stock vs patched, prefill and decode, alternating (187 s on 2026-12-01)
  timeout 330 $AB --prefill 4k --decode 4k --decode-steps 32 --rounds 2 --max-seconds 60 \
    --out $OUT/ab-4k.json > $OUT/ab-4k.log 2>&1; tail -14 $OUT/ab-4k.log ;;
s9b)  # wg GEMMs: 128-register cap (2 CTAs/SM) under ncu in the MoE block, its tests; stall reasons of the default build
  M=/tmp/s9b; mkdir -p $M
  for mb in 2 None; do  # None: no register cap (the default)
    timeout 150 $NCU --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
      python3 bench/profile_kernels.py block 4096 minb=$mb > $OUT/ncu-block-minb$mb.csv 2>$OUT/ncu-block-minb$mb.err
    echo "== minb $mb"; ncu_table $OUT/ncu-block-minb$mb.csv 60 | grep -E "mqf_moe_(gate|down)"
  done
  timeout 200 $NCU --clock-control none --profile-from-start off -k regex:mqf_moe_ \
    --section WarpStateStats --section SchedulerStats --section Occupancy --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    python3 bench/profile_kernels.py block 4096 > $M/ncu-stalls.txt 2>&1
  grep -E "mqf_moe_|Stall|Warp Cycles|Issued Warp|Eligible|Achieved Occ|L2 Hit|L1/TEX Hit|Mem Busy|Max Bandwidth|DRAM Through|Executed Ipc|Registers|Theoretical Occ|Block Limit" $M/ncu-stalls.txt | head -120
  timeout 150 python3 -m pytest -q tests/test_cuda_moe.py -k "wg_tunings and minb" > $M/tests-minb.txt 2>&1
  echo "rc=$?" >> $M/tests-minb.txt; tail -2 $M/tests-minb.txt
  tar czf $OUT/s9b-logs.tgz -C $M . ;;
s9c)  # wg down with scale-d starts (no accumulator writes between wgmmas): tests, ncu of the MoE block, stall details
  M=/tmp/s9c; mkdir -p $M
  timeout 200 python3 -m pytest -q tests/test_cuda_moe.py -k "wg_tunings or (wg_grouped_gemm_vs_reference and 2048)" \
    > $M/tests-wg.txt 2>&1; echo "rc=$?" >> $M/tests-wg.txt; tail -2 $M/tests-wg.txt; grep -E "^FAILED" $M/tests-wg.txt | head
  timeout 150 $NCU --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
    python3 bench/profile_kernels.py block 4096,2048 > $M/ncu-block.csv 2>$M/ncu-block.err
  ncu_table $M/ncu-block.csv 60 | grep -E "mqf_moe_(gate|down)"
  timeout 150 $NCU --clock-control none --profile-from-start off -k regex:mqf_moe_gate --launch-count 1 \
    --section WarpStateStats --section SourceCounters --print-details all \
    python3 bench/profile_kernels.py block 4096 > $M/ncu-gate-stalls.txt 2>&1
  grep -iE "stall|warp cycles" $M/ncu-gate-stalls.txt | head -40
  tar czf $OUT/s9c-logs.tgz -C $M . ;;
s10a)  # four-input GDN decode kernel: its tests, MLX's per-node host cost (bench/node_cost.py), decode rows with ms_steady
  M=/tmp/s10a; mkdir -p $M; XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 6"
  timeout 240 python3 -m pytest -q $XD tests/test_cuda_gated_delta.py tests/test_cuda_layers.py tests/test_compiled_steps.py \
    -k "decode or compiled or packed" > $M/tests.txt 2>&1; echo "rc=$?" >> $M/tests.txt; tail -2 $M/tests.txt
  grep -E "^FAILED" $M/tests.txt | head
  timeout 100 python3 bench/node_cost.py 30 > $M/nodecost.txt 2>&1; tail -20 $M/nodecost.txt
  timeout 150 python3 -m bench.ops $P --ops gated_delta.decode_step,gated_delta.decode_layer \
    --impls stock,patched,cuda-kernel,cuda-kernel-packed --max-seconds 5 --no-ceilings --out $M/ops.json > $M/ops.log 2>&1
  grep -E "^gated|Error|error" $M/ops.log
  tar czf $OUT/s10a-logs.tgz -C $M . ;;
s10b)  # the CPU-designed compiled-step tests on the GPU, the decode rows again (another process), then ab4k
  M=/tmp/s10b; mkdir -p $M
  timeout 100 python3 -m pytest -q tests/test_compiled_steps.py > $M/tests.txt 2>&1; echo "rc=$?" >> $M/tests.txt
  tail -2 $M/tests.txt
  timeout 150 python3 -m bench.ops $P --ops gated_delta.decode_step,gated_delta.decode_layer \
    --impls stock,patched,cuda-kernel,cuda-kernel-packed --max-seconds 5 --no-ceilings --out $M/ops.json > $M/ops.log 2>&1
  grep -E "^gated|Error|error" $M/ops.log
  timeout 330 $AB --prefill 4k --decode 4k --decode-steps 32 --rounds 2 --max-seconds 60 \
    --out $M/ab-4k.json > $M/ab-4k.log 2>&1; tail -14 $M/ab-4k.log
  tar czf $OUT/s10b-logs.tgz -C $M . ;;
s10c)  # one-lop3 dequantisation in the decode MoE kernels: their tests, kernel-only CUDA-graph times; the
       # compiled-step tests (CPU device); the GDN decode_step rows in two processes (host spread on one machine)
  M=/tmp/s10c; mkdir -p $M; XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 6"
  timeout 240 python3 -m pytest -q $XD tests/test_cuda_moe_decode_fused.py tests/test_cuda_moe_decode.py \
    > $M/tests-moe-decode.txt 2>&1; echo "rc=$?" >> $M/tests-moe-decode.txt; tail -2 $M/tests-moe-decode.txt
  timeout 60 python3 -m pytest -q tests/test_compiled_steps.py > $M/tests-steps.txt 2>&1; tail -1 $M/tests-steps.txt
  timeout 150 python3 bench/moe_decode_cuda.py --sections build,raw --out $M/md > $M/moe-decode-raw.txt 2>&1
  tail -12 $M/moe-decode-raw.txt
  for i in 1 2; do timeout 100 python3 -m bench.ops $P --ops gated_delta.decode_step --impls stock,cuda-kernel,cuda-kernel-packed \
      --max-seconds 5 --no-ceilings --out $M/ops$i.json > $M/ops$i.log 2>&1; grep -E "^gated|rror" $M/ops$i.log; done
  tar czf $OUT/s10c-logs.tgz -C $M . ;;
s10d)  # the final tree's GDN decode paths on the GPU: kernel + layer tests of the packed step, the CPU-side checks
  M=/tmp/s10d; mkdir -p $M; XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 6"
  timeout 200 python3 -m pytest -q $XD tests/test_cuda_gated_delta.py tests/test_cuda_layers.py tests/test_gated_delta.py \
    tests/test_compiled_steps.py -k "decode or compiled or packed" > $M/tests.txt 2>&1; echo "rc=$?" >> $M/tests.txt
  tail -2 $M/tests.txt; grep -E "^FAILED" $M/tests.txt | head
  tar czf $OUT/s10d-logs.tgz -C $M . ;;
s11a)  # MLX's CUDA graphs (default) vs direct launches (MLX_USE_CUDA_GRAPHS=0): per-node host cost, the GDN
       # decode rows (ms_steady), then patched-only decode at 4K context with graphs on, off, on, off
  M=/tmp/s11a; mkdir -p $M
  for g in 1 0; do MLX_USE_CUDA_GRAPHS=$g timeout 70 python3 bench/node_cost.py 30 > $M/nodecost-g$g.txt 2>&1
    echo "graphs=$g"; grep -E "trivial|GDN|add" $M/nodecost-g$g.txt | tail -12; done
  for g in 1 0; do MLX_USE_CUDA_GRAPHS=$g timeout 110 python3 -m bench.ops $P --ops gated_delta.decode_step,gated_delta.decode_layer \
      --impls stock,patched,cuda-kernel-packed --max-seconds 5 --no-ceilings --out $M/ops-g$g.json > $M/ops-g$g.log 2>&1
    echo "graphs=$g"; grep -E "^gated|rror" $M/ops-g$g.log; done
  for g in 1 0 1 0; do MLX_USE_CUDA_GRAPHS=$g timeout 75 $AB --engines patched --decode 4k --decode-steps 32 \
      --rounds 2 --no-ceilings --out /tmp/abg.json >> $M/ab-graphs.log 2>&1
    echo "graphs=$g: $(grep -h "^decode .*patched ok" $M/ab-graphs.log | tail -1)"; done
  tar czf $OUT/s11a-logs.tgz -C $M . ;;
s11b)  # routing inside the decode MoE kernels: the decode MoE tests, then build/time/raw of bench/moe_decode_cuda.py
  M=/tmp/s11b; mkdir -p $M; XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 6"
  timeout 240 python3 -m pytest -q $XD tests/test_cuda_moe_decode.py tests/test_cuda_moe_decode_fused.py \
    > $M/tests.txt 2>&1; echo "rc=$?" >> $M/tests.txt; tail -2 $M/tests.txt; grep -E "^FAILED" $M/tests.txt | head
  timeout 240 python3 bench/moe_decode_cuda.py --sections build,time,raw --out $M/md > $M/moe-decode.txt 2>&1
  grep -E "\[time\]|\[raw\] N=1 |\[raw\] N=4 |\[raw\] copy|rror" $M/moe-decode.txt | grep -v phases
  tar czf $OUT/s11b-logs.tgz -C $M . ;;
s11c)  # the shared expert as a one-expert group of the wg kernels: its tests, then ncu GPU time of one
       # patched MoE-block call at T=4096, 2048, 1024 with it (MLX_QWEN_FAST_MOE_SHARED_GEMM=1) and without (0)
  M=/tmp/s11c; mkdir -p $M; XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 6"
  timeout 200 python3 -m pytest -q $XD tests/test_cuda_moe.py -k "single_expert or shared or block_cuda or moe_experts" \
    > $M/tests.txt 2>&1; echo "rc=$?" >> $M/tests.txt; tail -2 $M/tests.txt; grep -E "^FAILED|Error" $M/tests.txt | head -8
  for g in 1 0; do
    MLX_QWEN_FAST_MOE_SHARED_GEMM=$g timeout 150 $NCU --clock-control none --profile-from-start off \
      --metrics gpu__time_duration.sum --csv python3 bench/profile_kernels.py block 4096,2048,1024 \
      > $M/ncu-block-g$g.csv 2>$M/ncu-block-g$g.err
    echo "shared_gemm=$g"; ncu_calls $M/ncu-block-g$g.csv | cut -c1-400
  done
  tar czf $OUT/s11c-logs.tgz -C $M . ;;
s12a)  # twelfth session: kernels launched as compressed fatbins (MLX_QWEN_FAST_NVFATBIN=the carried
       # library) vs plain cubins (=0): build/cache tests + decode tests, node_cost, the decode rows of bench.ops alternating
  needs_nvf; M=/tmp/s12a; mkdir -p $M; XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 6"
  python3 -c "from mlx_qwen_fast.kernels import _cuda_build as cb; print('image:', cb.fatbin_id())"
  timeout 200 python3 -m pytest -q $XD tests/test_cuda_build.py tests/test_cuda_moe_decode.py \
    tests/test_cuda_gated_delta.py -k "build or cache or image or decode" > $M/tests.txt 2>&1
  echo "rc=$?" >> $M/tests.txt; tail -2 $M/tests.txt; grep -E "^FAILED|Error" $M/tests.txt | head -8
  for g in "$NVF" 0; do t=fatbin; [ "$g" = 0 ] && t=cubin
    MLX_QWEN_FAST_NVFATBIN=$g timeout 60 python3 bench/node_cost.py 30 > $M/nodecost-$t.txt 2>&1
    echo "image=$t"; grep -E "in= 1 out=1|gdn" $M/nodecost-$t.txt | tail -14; done
  for g in "$NVF" 0 "$NVF" 0; do t=fatbin; [ "$g" = 0 ] && t=cubin
    MLX_QWEN_FAST_NVFATBIN=$g timeout 100 python3 -m bench.ops $P \
      --ops gated_delta.decode_step,gated_delta.decode_layer,moe.decode --impls patched,cuda-kernel-packed,cuda-decode-kernel \
      --max-seconds 4 --no-ceilings --out $M/ops-$t.json >> $M/ops-$t.log 2>&1
    echo "image=$t"; grep -E "^gated|^moe|rror" $M/ops-$t.log | tail -4; done
  tar czf $OUT/s12a-logs.tgz -C $M . ;;
s12b)  # the GDN rows of issue 4 in three processes (decode_step steady, prefill_step at 4K), then the
       # end-to-end A/B at 4K (stock vs patched, prefill and decode, alternating), kernels as fatbins
  M=/tmp/s12b; mkdir -p $M
  for i in 1 2 3; do timeout 100 python3 -m bench.ops $P --ops gated_delta.decode_step,gated_delta.prefill_step \
      --prefill-tokens 4k --impls cuda-kernel-packed,cuda-kernel --max-seconds 4 --no-ceilings --out $M/ops-$i.json \
      > $M/ops-$i.log 2>&1; echo "process $i"; grep -E "^gated|rror" $M/ops-$i.log; done
  timeout 330 $AB --prefill 4k --decode 4k --decode-steps 32 --rounds 2 --max-seconds 60 \
    --out $M/ab-4k.json > $M/ab-4k.log 2>&1; tail -14 $M/ab-4k.log
  tar czf $OUT/s12b-logs.tgz -C $M . ;;
s12c)  # patched-only decode at 4K context, kernels as compressed fatbins vs plain cubins, alternating
  needs_nvf; M=/tmp/s12c; mkdir -p $M
  for g in "$NVF" 0 "$NVF" 0; do t=fatbin; [ "$g" = 0 ] && t=cubin
    MLX_QWEN_FAST_NVFATBIN=$g timeout 110 $AB --engines patched --decode 4k --decode-steps 64 --rounds 4 \
      --no-ceilings --out $M/ab-$t.json >> $M/ab-$t.log 2>&1
    echo "$t: $(grep -h "^decode .*patched ok" $M/ab-$t.log | tail -1)"; done
  tar czf $OUT/s12c-logs.tgz -C $M . ;;
s12d)  # the whole model's start-up cost, first use (empty kernel cache, NVRTC) vs cached, two fresh processes
       # (bench.startup), then the CUDA tests not run with fatbin images in s12a (prefill kernels, layers)
  M=/tmp/s12d; mkdir -p $M; XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 2"  # -n 8: out of GPU memory (call 5)
  timeout 230 python3 -m bench.startup $P --out $M/startup.json > $M/startup.log 2>&1; tail -4 $M/startup.log | cut -c1-600
  timeout 300 python3 -m pytest -q $XD tests/test_cuda_moe.py tests/test_cuda_layers.py tests/test_cuda_gated_delta.py \
    -k "not decode" > $M/tests.txt 2>&1; echo "rc=$?" >> $M/tests.txt
  tail -2 $M/tests.txt; grep -E "^FAILED|^ERROR" $M/tests.txt | head -8
  tar czf $OUT/s12d-logs.tgz -C $M . ;;
s13a)  # thirteenth session: the review-fixed nvFatbin path on the GPU (fatbin_id, build/cache + decode tests,
       # fatbin and cubin legs), then issue 4's decode_step row in three processes
  needs_nvf; M=/tmp/s13a; mkdir -p $M; XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 2"
  python3 -c "from mlx_qwen_fast.kernels import _cuda_build as cb; print('image:', cb.fatbin_id(), 'driver', cb._driver_version())"
  timeout 240 python3 -m pytest -q $XD tests/test_cuda_build.py tests/test_cuda_moe_decode.py \
    tests/test_cuda_gated_delta.py -k "build or cache or image or decode or fatbin" > $M/tests.txt 2>&1
  echo "rc=$?" >> $M/tests.txt; tail -2 $M/tests.txt; grep -E "^FAILED|^ERROR" $M/tests.txt | head -8
  MLX_QWEN_FAST_NVFATBIN=0 timeout 60 python3 -m pytest -q tests/test_cuda_build.py > $M/tests-cubin.txt 2>&1
  echo "cubin leg rc=$?: $(tail -1 $M/tests-cubin.txt)"
  for i in 1 2 3; do timeout 100 python3 -m bench.ops $P --ops gated_delta.decode_step --impls cuda-kernel-packed \
      --max-seconds 4 --no-ceilings --out $M/ops-$i.json > $M/ops-$i.log 2>&1; echo "process $i"; grep -E "^gated|rror" $M/ops-$i.log; done
  tar czf $OUT/s13a-logs.tgz -C $M . ;;
s13b)  # the shared expert in the routing's shared slot (one more group of the wg launches): the MoE tests,
       # then ncu GPU time of one patched MoE-block call per T, shared slot (1) / own one-expert group / dense (0)
  M=/tmp/s13b; mkdir -p $M; XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 2"
  timeout 260 python3 -m pytest -q $XD tests/test_cuda_moe.py -k "shared or rout or block or moe_experts" \
    > $M/tests.txt 2>&1; echo "rc=$?" >> $M/tests.txt; tail -2 $M/tests.txt; grep -E "^FAILED|^ERROR" $M/tests.txt | head -8
  for g in 1 group 0; do
    MLX_QWEN_FAST_MOE_SHARED_GEMM=$g timeout 150 $NCU --clock-control none --profile-from-start off \
      --metrics gpu__time_duration.sum --csv python3 bench/profile_kernels.py block ${TS:-4096,2048,1024,512,256,128} \
      shared_min_tokens=128 > $M/ncu-block-$g.csv 2>$M/ncu-block-$g.err
    echo "shared_gemm=$g"; ncu_calls $M/ncu-block-$g.csv | cut -c1-60; grep -E "rror" $M/ncu-block-$g.err | head -3
  done
  tar czf $OUT/s13b-logs.tgz -C $M . ;;
s13c)  # the shared slot with the router and the shared gate as one matmul: the MoE tests, then ncu GPU time
       # of one patched MoE-block call: slot at 4096,1024,256,128; the one-expert group and dense at 128
  M=/tmp/s13c; mkdir -p $M; XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 2"
  timeout 280 python3 -m pytest -q $XD tests/test_cuda_moe.py -k "shared or rout or block or moe_experts" \
    > $M/tests.txt 2>&1; echo "rc=$?" >> $M/tests.txt; tail -2 $M/tests.txt; grep -E "^FAILED|^ERROR" $M/tests.txt | head -8
  for g in 1 group 0; do T=128; [ $g = 1 ] && T=4096,1024,256,128
    MLX_QWEN_FAST_MOE_SHARED_GEMM=$g timeout 120 $NCU --clock-control none --profile-from-start off \
      --metrics gpu__time_duration.sum --csv python3 bench/profile_kernels.py block $T \
      shared_min_tokens=128 > $M/ncu-block-$g.csv 2>$M/ncu-block-$g.err
    echo "shared_gemm=$g"; ncu_calls $M/ncu-block-$g.csv | cut -c1-60; grep -E "rror" $M/ncu-block-$g.err | head -3
  done
  tar czf $OUT/s13c-logs.tgz -C $M . ;;
s13d)  # the shared column's routing repeated (call 3's one failure), then the end-to-end A/B at 4K
       # (stock vs patched, prefill and decode, alternating), the final tree
  M=/tmp/s13d; mkdir -p $M
  timeout 90 python3 bench/route_column_check.py 20 > $M/route-column.txt 2>&1; grep -E "of|rror" $M/route-column.txt | head -12
  timeout 60 python3 -m pytest -q tests/test_cuda_moe.py -k "test_route_and_group_with_shared_slot" > $M/tests-route.txt 2>&1
  tail -1 $M/tests-route.txt
  timeout 400 $AB --prefill 4k --decode 4k --decode-steps 32 --rounds 2 --max-seconds 60 \
    --out $M/ab-4k.json > $M/ab-4k.log 2>&1; tail -14 $M/ab-4k.log
  tar czf $OUT/s13d-logs.tgz -C $M . ;;
s13e)  # after the route fix (N from the logits' rows): the shared column's routing repeated, the slot tests
  M=/tmp/s13e; mkdir -p $M; XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 2"
  timeout 90 python3 bench/route_column_check.py 20 > $M/route-column.txt 2>&1; grep -E "of|rror" $M/route-column.txt | head -12
  timeout 200 python3 -m pytest -q $XD tests/test_cuda_moe.py -k "shared or route_launch or block" > $M/tests.txt 2>&1
  echo "rc=$?" >> $M/tests.txt; tail -2 $M/tests.txt; grep -E "^FAILED|^ERROR" $M/tests.txt | head -8
  tar czf $OUT/s13e-logs.tgz -C $M . ;;
s14a)  # fourteenth session: the one-launch decode MoE kernel's tests, bench/moe_decode_cuda.py build + raw (CuPy
       # graphs, phase stamps), the deferred slot tests. Calls 1-3 ran it on the cluster/split-K rebuild (tree
       # 6bf8423..3a0fd0b, slower: reverted, moe-cuda-log.md "fourteenth session"); now it runs the kept kernel
  M=$OUT; XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 4"
  timeout 170 python3 -m pytest -q $XD tests/test_cuda_moe_decode_fused.py > $M/tests-fused.txt 2>&1
  echo "rc=$?" >> $M/tests-fused.txt; tail -2 $M/tests-fused.txt; grep -E "^FAILED|^ERROR|^E  " $M/tests-fused.txt | head -12
  timeout 150 python3 bench/moe_decode_cuda.py --out $M --sections build,raw > $M/moe-decode.txt 2>&1
  grep -E "\[raw\]|rror" $M/moe-decode.txt | cut -c1-240 | tail -20
  [ "${MOE_TESTS:-1}" = 1 ] || exit 0  # (call 1 ran them: 96 passed)
  timeout 170 python3 -m pytest -q $XD tests/test_cuda_moe.py -k "shared or rout or block or moe_experts" \
    > $M/tests-moe.txt 2>&1; echo "rc=$?" >> $M/tests-moe.txt; tail -2 $M/tests-moe.txt
  grep -E "^FAILED|^ERROR" $M/tests-moe.txt | head -8 ;;
s14b)  # fourteenth session: issue 5's "moe.decode" op through MLX (one call per evaluation), stock vs the
       # four-node step, then the opt-in one-launch kernel (MLX_QWEN_FAST_MOE_DECODE_FUSED=1)
  timeout 200 python3 -m bench.ops $P --ops moe.decode --repeats 20 --out $OUT/ops-moe-decode.json \
    > $OUT/ops-moe-decode.log 2>&1; tail -6 $OUT/ops-moe-decode.log
  MLX_QWEN_FAST_MOE_DECODE_FUSED=1 timeout 150 python3 -m bench.ops $P --ops moe.decode --impls cuda-decode-kernel \
    --repeats 20 --no-ceilings --out $OUT/ops-moe-decode-fused.json > $OUT/ops-moe-decode-fused.log 2>&1
  tail -4 $OUT/ops-moe-decode-fused.log ;;
s15a)  # fifteenth session: bench/cuda/decode_read_floor.cu (the block's bytes read with the kernels' CTAs and
       # lane addresses, no arithmetic) vs the decode kernels, CuPy graphs of 64 layers over 4 and 40 layers' weights
  timeout 400 python3 bench/moe_decode_cuda.py --out $OUT --sections build,floor > $OUT/moe-decode-floor.txt 2>&1
  grep -E "\[floor\]|rror|Trace" $OUT/moe-decode-floor.txt | cut -c1-200 | tail -40 ;;
s15b)  # fifteenth session: the decode MoE kernels' tests (gate+up weights through cp.async), then the read
       # floor vs the kernels with their phase stamps and the 8-warp down build (bench/moe_decode_cuda.py floor)
  XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 6"
  timeout 200 python3 -m pytest -q $XD tests/test_cuda_moe_decode.py tests/test_cuda_moe_decode_fused.py tests/test_compiled_steps.py \
    > $OUT/tests-moe-decode.txt 2>&1; echo "rc=$?" >> $OUT/tests-moe-decode.txt; tail -2 $OUT/tests-moe-decode.txt
  grep -E "^FAILED|^ERROR" $OUT/tests-moe-decode.txt | head -8
  timeout 300 python3 bench/moe_decode_cuda.py --out $OUT --sections build,floor > $OUT/moe-decode-floor.txt 2>&1
  grep -E "\[floor\]|rror|Trace" $OUT/moe-decode-floor.txt | cut -c1-420 | tail -44 ;;
s16a)  # sixteenth session: the decode MoE kernel tests (the __syncwarp build), then the read floors incl. the
       # dependent one-launch floor (bench/cuda/decode_dep_floor.cu) and the one-launch kernel's phase stamps
  XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 6"
  timeout 200 python3 -m pytest -q $XD tests/test_cuda_moe_decode.py tests/test_cuda_moe_decode_fused.py tests/test_compiled_steps.py \
    > $OUT/tests-moe-decode.txt 2>&1; echo "rc=$?" >> $OUT/tests-moe-decode.txt; tail -2 $OUT/tests-moe-decode.txt
  grep -E "^FAILED|^ERROR" $OUT/tests-moe-decode.txt | head -8
  timeout 330 python3 bench/moe_decode_cuda.py --out $OUT --sections build,floor > $OUT/moe-decode-floor.txt 2>&1
  grep -E "\[floor\]|rror|Trace" $OUT/moe-decode-floor.txt | grep -v "L= 4" | cut -c1-520 | tail -40 ;;
s16b)  # sixteenth session: the read floors only (dependent one-launch floor: counter barriers vs flags in the data)
  timeout 330 python3 bench/moe_decode_cuda.py --out $OUT --sections ${SECTIONS:-build,floor,raw} > $OUT/moe-decode-floor.txt 2>&1
  grep -E "\[floor\]|\[raw\]|rror|Trace" $OUT/moe-decode-floor.txt | grep -v "L= 4" | grep -E "dep|phases|all, 1|gate\+up \| down|copy|raw" | cut -c1-520 | tail -40 ;;
s16c)  # sixteenth session: route_warp without local memory: the routing tests (exact ties), the one-launch and
       # decode kernel tests, then the read floors (build,floor)
  XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 6"
  timeout 240 python3 -m pytest -q $XD tests/test_cuda_moe.py -k "route or routing" tests/test_cuda_moe_decode_fused.py \
    > $OUT/tests-route.txt 2>&1; echo "rc=$?" >> $OUT/tests-route.txt; tail -2 $OUT/tests-route.txt
  grep -E "^FAILED|^ERROR" $OUT/tests-route.txt | head -8
  timeout 300 python3 bench/moe_decode_cuda.py --out $OUT --sections build,floor > $OUT/moe-decode-floor.txt 2>&1
  grep -E "\[floor\]|rror|Trace" $OUT/moe-decode-floor.txt | grep -v "L= 4" | grep -E "dep|phases|all, 1|gate\+up \| down|one launch" | cut -c1-520 | tail -30 ;;
s16d)  # sixteenth session: the final tree's routing tie test (route_warp as before the session) and one-launch tests
  # (call 5 ran both files under one -k, which deselected the one-launch tests: now two runs)
  timeout 120 python3 -m pytest -q tests/test_cuda_moe.py -k "ties or test_route_takes or all_to_one" \
    > $OUT/tests-final.txt 2>&1; echo "rc=$?" >> $OUT/tests-final.txt
  timeout 150 python3 -m pytest -q tests/test_cuda_moe_decode_fused.py >> $OUT/tests-final.txt 2>&1
  echo "rc=$?" >> $OUT/tests-final.txt; grep -E "passed|failed|^rc=|^FAILED|^ERROR" $OUT/tests-final.txt | head -12 ;;
*) echo "usage: bash bench/h200.sh {prefill|decode|ab|tests|layers|checks|moe|kernels|scan|profile|prefill-check|diag|fused|final|check|frontend|steady|decodecheck|ab4k|wgmma|moedecode|gemmncu|s8a|s8b|s8c|s8d|s9b|s9c|s10a|s10b|s10c|s10d|s11a|s11b|s11c|s12a|s12b|s12c|s12d|s13a|s13b|s13c|s13d|s13e|s14a|s14b|s15a|s15b|s16a|s16b|s16c|s16d}"; exit 2 ;;
esac
