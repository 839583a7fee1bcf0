#!/usr/bin/env bash
# Kernel 08 with three K/V stages (S) and with K released after S = Q K^T (K) beside main (A):
# hattn-bench --settle 0.5 in the order A S K K S A; then kernel 08's GPU tests and a
# compute-sanitizer pass with the K build.  Usage: ab.sh A.tar.xz S.tar.xz K.tar.xz OUT_DIR
set -uo pipefail
out=$4
mkdir -p "$out"
declare -A dir
i=1
for x in a s k; do
  dir[$x]=/tmp/ab_$x
  mkdir -p "${dir[$x]}"
  tar xJf "${!i}" -C "${dir[$x]}" || exit 1
  echo "$x: $(cat "${dir[$x]}/prebuild_commit.txt")" >>"$out/commits.txt"
  i=$((i + 1))
done
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm,power.limit --format=csv >"$out/machine.txt"
for order in a1 s1 k1 k2 s2 a2; do
  x=${order:0:1}
  "${dir[$x]}/hattn-bench" --kernels 08_warp_specialization --no-gemm --settle 0.5 --dims 64,128,256 \
    --seqlens 2048,16384 --csv "$out/$order.csv" >"$out/$order.log" 2>&1
done
python3 - "$out" <<'PY'
import csv, sys
out = sys.argv[1]
runs = {o: list(csv.DictReader(open(f"{out}/{o}.csv"))) for o in ("a1", "s1", "k1", "k2", "s2", "a2")}
print("D  S      causal   A1    S1    K1    K2    S2    A2  (TFLOP/s)   S/A   K/A")
for i, row in enumerate(runs["a1"]):
    t = {o: float(runs[o][i]["tflops"]) for o in runs}
    a, s, k = (t["a1"] + t["a2"]) / 2, (t["s1"] + t["s2"]) / 2, (t["k1"] + t["k2"]) / 2
    print(f"{row['head_dim']:>3s} {row['seqlen_k']:>6s} {row['causal']:>3s} "
          + " ".join(f"{t[o]:5.0f}" for o in runs) + f"   {s / a:.3f} {k / a:.3f}")
PY
cd "${dir[k]}" && timeout 300 ./hattn_tests --gtest_filter='*08_warp*' >"$out/gtest_k.log" 2>&1
echo "gtest (K build, kernel 08): rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$out/gtest_k.log" | tr '\n' ' ')"
for tool in memcheck racecheck; do
  timeout 300 compute-sanitizer --tool $tool ./hattn_tests \
    --gtest_filter='AllKernels/KernelTest.MatchesFp64Reference/08_warp_specialization_4_*:AllKernels/KernelTest.MatchesFp64Reference/08_warp_specialization_7_*:AllKernels/KernelTest.MatchesFp64Reference/08_warp_specialization_12_*' \
    >"$out/sanitizer_$tool.log" 2>&1
  echo "$tool: rc=$? $(tail -1 "$out/sanitizer_$tool.log")"
done
