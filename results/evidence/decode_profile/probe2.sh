#!/usr/bin/env bash
# Decoding, second probe (run: probe2/, README.md). 1. With 4 query heads per K/V head the
# items are few (16 at D = 128 with 4 x 4k keys) and the automatic rule's 4-tile floor per part
# may leave SMs idle: hattn-bench at fixed part counts. 2. Why the attention kernel stops at
# 66-71% of the DRAM peak without GQA: Nsight Compute's warp states, scheduler and source
# counters at 4 x 4k keys, dense (176-key tiles at D = 128, 80 at D = 256) and paged (128, 64).
# Usage: probe2.sh BINARIES.tar.xz OUT_DIR
set -uo pipefail
bin=$1 out=$2
mkdir -p "$out" /tmp/pb
tar xJf "$bin" -C /tmp/pb || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm,power.limit --format=csv >"$out/machine.txt"
dec=(--kernels 16_coalesced_store --seqlen-q 1 --causal no --no-gemm --reps 3)
gqa=(--kernels 16_coalesced_store --seqlen-q 1 --causal no --no-gemm --gqa 4 --seqlens "4096,16384" --dims "64,128,256")
for n in 0 2 4 8 16 32; do
  /tmp/pb/hattn-bench "${gqa[@]}" --num-splits $n --csv "$out/gqa4_splits_$n.csv" >"$out/gqa4_splits_$n.log" 2>&1
done
sections=(--section WarpStateStats --section SchedulerStats --section SourceCounters --section SpeedOfLight)
for d in 128 256; do
  ncu --clock-control none -k regex:coalesced --launch-skip 1 --launch-count 1 "${sections[@]}" \
    /tmp/pb/hattn-bench "${dec[@]}" --seqlens 4096 --dims $d >"$out/stalls_d${d}_dense.txt" 2>&1
  ncu --clock-control none -k regex:coalesced --launch-skip 1 --launch-count 1 "${sections[@]}" \
    /tmp/pb/hattn-bench "${dec[@]}" --seqlens 4096 --dims $d --page-size 128 >"$out/stalls_d${d}_paged.txt" 2>&1
done
for f in "$out"/gqa4_splits_*.log; do echo "== $f"; grep -E "^\[" "$f"; done
for f in "$out"/stalls_*.txt; do
  echo "== $f"
  grep -E "Duration|DRAM Throughput|Warp Cycles Per Issued|No Eligible|Stall|stall" "$f" | head -20
done
