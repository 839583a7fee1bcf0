#!/usr/bin/env bash
# Where does a decoding call's time go? One query per sequence, bf16, heads x D = 2048. For
# kernel 16 (prebuilt binaries): hattn-bench at fixed split-KV part counts, then Nsight
# Compute's durations and DRAM traffic of the attention kernel and the combine, and one
# detailed profile of the attention kernel at D = 128, 4 x 4k keys.
# Usage: profile.sh BINARIES.tar.xz OUT_DIR
set -uo pipefail
bin=$1 out=$2
mkdir -p "$out" /tmp/pb
tar xJf "$bin" -C /tmp/pb || exit 1
commit=$(cat /tmp/pb/prebuild_commit.txt)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm,power.limit --format=csv >"$out/machine.txt"
dec=(--kernels 16_coalesced_store --seqlen-q 1 --causal no --no-gemm)
for n in 0 1 2 4 8 16; do
  HATTN_COMMIT=$commit /tmp/pb/hattn-bench "${dec[@]}" --seqlens 4096,16384 --dims 64,128,256 --num-splits $n \
    --csv "$out/splits_$n.csv" >"$out/splits_$n.log" 2>&1
done
metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum
metrics+=,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,sm__cycles_active.avg
for d in 64 128 256; do
  for s in 4096 16384; do
    ncu --clock-control none -k 'regex:coalesced|combine' --launch-skip 2 --launch-count 4 --print-kernel-base function --metrics "$metrics" \
      --csv /tmp/pb/hattn-bench "${dec[@]}" --seqlens $s --dims $d --reps 3 >"$out/ncu_d${d}_s${s}.csv" 2>&1
  done
done
ncu --clock-control none -k 'regex:coalesced' --launch-skip 1 --launch-count 1 --set detailed \
  /tmp/pb/hattn-bench "${dec[@]}" --seqlens 4096 --dims 128 --reps 3 >"$out/ncu_detailed_d128_s4096.txt" 2>&1
for f in "$out"/splits_*.log; do echo "== $f"; grep -E "^\[" "$f"; done
python3 - "$out" <<'PY'
import csv, glob, io, sys
for f in sorted(glob.glob(sys.argv[1] + "/ncu_d*.csv")):
    text = open(f).read()
    rows = list(csv.DictReader(io.StringIO(text[text.find('"ID"'):]))) if '"ID"' in text else []
    print("==", f)
    for r in rows:
        print(" ", r["ID"], r["Kernel Name"][:32], r["Metric Name"], r["Metric Value"])
PY
