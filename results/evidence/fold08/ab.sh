#!/usr/bin/env bash
# Kernel 08 with the scale folded into the exponent (B) beside main's kernel 08 (A):
# hattn-bench --settle 0.5 in the order A B B A, then kernel 08's GPU tests with B and
# compute-sanitizer on three shapes.  Usage: ab.sh A.tar.xz B.tar.xz OUT_DIR [KERNEL]
set -uo pipefail
out=$3 kernel=${4:-08_warp_specialization}
mkdir -p "$out"
for x in a b; do
  mkdir -p /tmp/ab_$x && tar xJf "$([ $x = a ] && echo "$1" || echo "$2")" -C /tmp/ab_$x || exit 1
  echo "$x: $(cat /tmp/ab_$x/prebuild_commit.txt)" >>"$out/commits.txt"
done
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm,power.limit --format=csv >"$out/machine.txt"
for order in a1 b1 b2 a2; do
  /tmp/ab_${order:0:1}/hattn-bench --kernels "$kernel" --no-gemm --settle 0.5 --dims 64,128,256 \
    --seqlens 2048,16384 --csv "$out/$order.csv" >"$out/$order.log" 2>&1
done
python3 - "$out" <<'PY'
import csv, sys
out = sys.argv[1]
runs = {o: list(csv.DictReader(open(f"{out}/{o}.csv"))) for o in ("a1", "b1", "b2", "a2")}
print("D  S      causal   A1    B1    B2    A2  (TFLOP/s)   B/A")
for i, row in enumerate(runs["a1"]):
    t = {o: float(runs[o][i]["tflops"]) for o in runs}
    print(f"{row['head_dim']:>3s} {row['seqlen_k']:>6s} {row['causal']:>3s} "
          + " ".join(f"{t[o]:5.0f}" for o in runs) + f"   {(t['b1'] + t['b2']) / (t['a1'] + t['a2']):.3f}")
PY
cd /tmp/ab_b && timeout 300 ./hattn_tests --gtest_filter="*${kernel}*:Validation.*:Dispatch.*" >"$out/gtest_b.log" 2>&1
echo "gtest (B, $kernel): rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$out/gtest_b.log" | tr '\n' ' ')"
grep -E '^\[  FAILED  \]' "$out/gtest_b.log" | head -5
for tool in memcheck racecheck; do
  timeout 300 compute-sanitizer --tool $tool ./hattn_tests \
    --gtest_filter="AllKernels/KernelTest.MatchesFp64Reference/${kernel}_4_*:AllKernels/KernelTest.MatchesFp64Reference/${kernel}_7_*" \
    >"$out/sanitizer_$tool.log" 2>&1
  echo "$tool: rc=$? $(tail -1 "$out/sanitizer_$tool.log")"
done
