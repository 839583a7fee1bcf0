#!/usr/bin/env bash
# D = 64 decoding whose last round of query blocks is partial (e.g. 5 sequences x 32 heads = 160
# blocks = 132 + 28): dec68e0 (A: the dense kernel, whose tail split cut that round in parts)
# beside a later build (B: the run-time bounds kernels, no tail split), hattn-bench in the
# order A B B A, one batch size per call.
# Usage: ab.sh A.tar.xz B.tar.xz OUT_DIR
set -uo pipefail
out=$3
declare -A dir commit
for x in a b; do
  case $x in a) f=$1 ;; b) f=$2 ;; esac
  dir[$x]=/tmp/ab_$x
  mkdir -p "${dir[$x]}"
  tar xJf "$f" -C "${dir[$x]}" || exit 1
  commit[$x]=$(cat "${dir[$x]}/prebuild_commit.txt")
done
mkdir -p "$out"
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm,power.limit --format=csv >"$out/machine.txt"
for order in a1 b1 b2 a2; do
  x=${order:0:1}
  for batch in 2 3 4 5 6 7 9 12 16; do
    for seqlen in 4096 16384; do
      HATTN_COMMIT=${commit[$x]} "${dir[$x]}/hattn-bench" --kernels 16_coalesced_store --no-gemm \
        --seqlen-q 1 --causal no --dims 64 --seqlens $seqlen --tokens $((batch * seqlen)) \
        --csv "$out/b${batch}_s${seqlen}_$order.csv" >"$out/b${batch}_s${seqlen}_$order.log" 2>&1
    done
  done
done
python3 - "$out" <<'PY'
import csv, glob, sys
out = sys.argv[1]
def us(f):
    try:
        rows = list(csv.DictReader(open(f)))
    except OSError:
        return float("nan")
    return 1000 * float(rows[0]["ms"]) if rows else float("nan")
print("batch seqlen   A1      B1      B2      A2   A/B")
for batch in (2, 3, 4, 5, 6, 7, 9, 12, 16):
    for seqlen in (4096, 16384):
        t = {o: us(f"{out}/b{batch}_s{seqlen}_{o}.csv") for o in ("a1", "b1", "b2", "a2")}
        a = (t["a1"] + t["a2"]) / 2
        b = (t["b1"] + t["b2"]) / 2
        print(f"{batch:5d} {seqlen:6d} " + " ".join(f"{t[o]:7.1f}" for o in ("a1", "b1", "b2", "a2")) + f" {a / b:5.3f}")
PY
