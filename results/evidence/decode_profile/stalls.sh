#!/usr/bin/env bash
# Why does decoding's attention kernel stop at 66-71% of the DRAM peak? Nsight Compute's warp
# states, scheduler and source counters (the stall reasons by instruction) of kernel 16 at one
# query per sequence, 4 x 4k keys, dense (176-key tiles at D = 128, 80 at D = 256) and paged
# (128 and 64). Not yet run.
# Usage: stalls.sh BINARIES.tar.xz OUT_DIR
set -uo pipefail
bin=$1 out=$2
mkdir -p "$out" /tmp/pb
tar xJf "$bin" -C /tmp/pb || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm,power.limit --format=csv >"$out/machine.txt"
dec=(--kernels 16_coalesced_store --seqlen-q 1 --causal no --no-gemm --reps 3)
sections=(--section WarpStateStats --section SchedulerStats --section SourceCounters --section SpeedOfLight)
for d in 128 256; do
  ncu --clock-control none -k regex:coalesced --launch-skip 1 --launch-count 1 "${sections[@]}" \
    /tmp/pb/hattn-bench "${dec[@]}" --seqlens 4096 --dims $d >"$out/stalls_d${d}_dense.txt" 2>&1
  ncu --clock-control none -k regex:coalesced --launch-skip 1 --launch-count 1 "${sections[@]}" \
    /tmp/pb/hattn-bench "${dec[@]}" --seqlens 4096 --dims $d --page-size 128 >"$out/stalls_d${d}_paged.txt" 2>&1
done
for f in "$out"/stalls_*.txt; do
  echo "== $f"
  grep -E "Duration|DRAM Throughput|Warp Cycles Per Issued|No Eligible|Stall|stall" "$f" | head -20
done
