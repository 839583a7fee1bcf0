#!/usr/bin/env bash
# Timing on the H200, one call: kernel 16's split-KV combine before (A), with batched loads
# (B), and with batched loads launched as a programmatic dependent of the attention kernel (C).
# Decoding (one query per sequence, dense and with 4 query heads per K/V head) in the order
# A B C C B A; the forward grid without a mask (its tail split's combine shares the batched
# loads) A C C A; then Nsight Compute's durations of the combine kernels in A, B and C.
# Usage: timing.sh A.tar.xz B.tar.xz C.tar.xz OUT_DIR
set -uo pipefail
out=$4
declare -A dir commit
for x in a b c; do
  case $x in a) f=$1 ;; b) f=$2 ;; c) f=$3 ;; esac
  dir[$x]=/tmp/t$x
  mkdir -p "${dir[$x]}"
  tar xJf "$f" -C "${dir[$x]}" || exit 1
  commit[$x]=$(cat "${dir[$x]}/prebuild_commit.txt")
done
mkdir -p "$out"
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm,power.limit --format=csv >"$out/machine.txt"
dec=(--kernels 16_coalesced_store --seqlen-q 1 --causal no --seqlens "4096,16384,65536" --dims "64,128,256" --no-gemm)
grid=(--kernels 16_coalesced_store --seqlens "4096,16384" --causal no --dims "128,256" --settle 0.5 --no-gemm)
run() {  # tag which args...
  local tag=$1 x=$2
  shift 2
  HATTN_COMMIT=${commit[$x]} "${dir[$x]}/hattn-bench" "$@" --csv "$out/$tag.csv" >"$out/$tag.log" 2>&1
}
for order in a1 b1 c1 c2 b2 a2; do
  run "decode_$order" "${order:0:1}" "${dec[@]}"
  run "decode_gqa4_$order" "${order:0:1}" "${dec[@]}" --gqa 4
done
for order in a1 c1 c2 a2; do run "grid_$order" "${order:0:1}" "${grid[@]}"; done
for x in a b c; do
  for d in 128 256; do
    ncu --clock-control none -k regex:combine --launch-skip 2 --launch-count 2 --print-kernel-base function \
      --metrics gpu__time_duration.sum --csv "${dir[$x]}/hattn-bench" "${dec[@]}" --dims $d --seqlens 16384 \
      --reps 3 >"$out/ncu_combine_${x}_d$d.csv" 2>&1
  done
done
for f in "$out"/decode*.log "$out"/grid*.log; do echo "== $f"; grep -E "^\[|FAIL" "$f"; done
python3 - "$out" <<'PY'
import csv, glob, io, sys
for f in sorted(glob.glob(sys.argv[1] + "/ncu_combine_*.csv")):
    text = open(f).read()
    rows = list(csv.DictReader(io.StringIO(text[text.find('"ID"'):]))) if '"ID"' in text else []
    print(f.rsplit("/", 1)[1], [r["Metric Value"] for r in rows])
PY
