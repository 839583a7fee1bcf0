#!/usr/bin/env bash
# What the decoding floor is made of (next device session): Nsight Compute's duration, active
# SM cycles, DRAM bytes and grid size of each kernel of one decoding call (the attention kernel
# and, when split, the combine), with the caches flushed before each kernel (ncu's default)
# and not (--cache-control none), beside hattn-bench's event times of the same calls, split
# automatically and not (--num-splits 1), then with 2 to 16 parts at 1 x 4k and 4 x 4k. The
# gap between the event time and the kernels' durations is the launches'.
# Usage: probe_floor.sh HATTN_BENCH OUT_DIR
set -uo pipefail
bench=$1
out=$2
mkdir -p "$out"
shapes=(--kernels 16_coalesced_store --seqlen-q 1 --causal no --seqlens 4096 --tokens 4096 --dims "64,128,256" --no-gemm)
metrics=gpu__time_duration.sum,sm__cycles_active.avg,dram__bytes_read.sum,launch__grid_size
for splits in 0 1; do
  "$bench" "${shapes[@]}" --num-splits "$splits" --csv "$out/events_splits$splits.csv" >"$out/events_splits$splits.log" 2>&1
  "$bench" "${shapes[@]}" --num-splits "$splits" --warm-l2 --csv "$out/events_warm_splits$splits.csv" \
    >"$out/events_warm_splits$splits.log" 2>&1
  for cache in all none; do
    # --launch-skip 4: past the checked call and the warm-up of the first shape.
    ncu --clock-control none --cache-control $cache --launch-skip 4 --launch-count 12 --metrics "$metrics" --csv \
      "$bench" "${shapes[@]}" --num-splits "$splits" --reps 3 --check-rows 1 \
      >"$out/ncu_splits${splits}_cache_$cache.csv" 2>&1
  done
done
# Parts per query block by hand: the automatic rule keeps 4 tiles per part (5 parts at
# D = 128 with 1 x 4k keys), so each CTA sweeps its tiles one after the other.
for n in 2 4 6 8 12 16; do
  "$bench" "${shapes[@]}" --num-splits $n --csv "$out/events_n$n.csv" >"$out/events_n$n.log" 2>&1
  "$bench" "${shapes[@]}" --num-splits $n --seqlens 4096 --tokens 16384 --csv "$out/events_b4_n$n.csv" \
    >"$out/events_b4_n$n.log" 2>&1
done
python3 - "$out" <<'PY'
import csv, glob, io, sys
for f in sorted(glob.glob(sys.argv[1] + "/ncu_*.csv")):
    text = open(f).read()
    if '"ID"' not in text:
        print(f, "no ncu rows")
        continue
    rows = list(csv.DictReader(io.StringIO(text[text.find('"ID"'):])))
    print("==", f.rsplit("/", 1)[1])
    for r in rows:
        print(r["ID"], r["Kernel Name"][:40], r["Metric Name"], r["Metric Value"])
PY
