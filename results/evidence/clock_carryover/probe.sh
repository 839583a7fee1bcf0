#!/usr/bin/env bash
# Step 08 at D = 128, S = 16k, no mask: 600 TFLOP/s in hattn-bench's lineage run (ad64f6c), 548
# in python -m hattn.bench (24ca129). Is it the neighbour before it (hattn-bench times every
# kernel of a shape in lineage order, so 08 follows the slower 07) and the short timing window?
#   bash probe.sh OUT_DIR    (after scripts/gpu_run.sh built build-gpu and installed hattn)
# Each step is marked in marks.txt; nvidia-smi samples clocks and power every 50 ms (smi.csv).
set -u
out=$1
mkdir -p "$out"
bench=build-gpu/hattn-bench
shape="--dims 128 --seqlens 16384 --causal no --no-gemm"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader -lms 50 >"$out/smi.csv" 2>&1 &
smi=$!
mark() { echo "$(date +%Y/%m/%d\ %H:%M:%S.%3N) $*" >>"$out/marks.txt"; }
run() {  # name, then hattn-bench flags
  local name=$1
  shift
  mark "start $name"
  # shellcheck disable=SC2086
  "$bench" $shape "$@" --csv "$out/$name.csv" >"$out/$name.log" 2>&1
  mark "end $name"
  sleep 3  # let the board cool between runs
}
sleep 3
for rep in 1 2; do
  run "r${rep}_07_then_08" --kernels 07_wgmma,08_warp_specialization
  run "r${rep}_16_then_08" --kernels 16_coalesced_store,08_warp_specialization
  run "r${rep}_08_for_3s" --kernels 08_warp_specialization --reps 1000 --seconds 3
  run "r${rep}_16_for_3s" --kernels 16_coalesced_store --reps 1000 --seconds 3
  mark "start r${rep}_pybench"
  python3 -m hattn.bench --out "$out/r${rep}_pybench" --kernels 08_warp_specialization,16_coalesced_store \
    --anchors sdpa_cudnn --dims 128 --seqlens 16k --causal no --no-capstone --no-plots >"$out/r${rep}_pybench.log" 2>&1
  mark "end r${rep}_pybench"
  sleep 3
done
kill "$smi"
