#!/usr/bin/env bash
# Decoding, third probe: which instructions the attention kernel's warps stall on (probe2 found
# 56-64% of their stalls on global loads without saying which). Nsight Compute's source page,
# SASS with the warp-stall samples of each instruction, at 4 x 4k keys, D = 128, dense and paged.
# Summed by stall_summary.py (probe3/stall_summary.txt).
# Usage: probe3.sh BINARIES.tar.xz OUT_DIR
set -uo pipefail
bin=$1 out=$2
mkdir -p "$out" /tmp/pb
tar xJf "$bin" -C /tmp/pb || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm --format=csv >"$out/machine.txt"
dec=(--kernels 16_coalesced_store --seqlen-q 1 --causal no --no-gemm --reps 3 --seqlens 4096 --dims 128)
for layout in dense paged; do
  extra=()
  [ "$layout" = paged ] && extra=(--page-size 128)
  ncu --clock-control none -k regex:coalesced --launch-skip 1 --launch-count 1 --section SourceCounters \
    --section WarpStateStats --page source --print-source sass --csv \
    /tmp/pb/hattn-bench "${dec[@]}" "${extra[@]}" >"$out/source_d128_$layout.csv" 2>"$out/source_d128_$layout.err"
  echo "$layout: rc=$? $(wc -l <"$out/source_d128_$layout.csv") lines"
done
