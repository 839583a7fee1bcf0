#!/usr/bin/env bash
# One device call for the planned tail: kernel 16's GPU tests and sanitizers with build B, then
# B beside A on the causal grid, decoding and varlen (../fast_divisor/ab.sh, A B B A).
# Usage (after `git apply tail_plan.patch` and scripts/prebuild.sh for B, main's build for A):
#   results/evidence/tail_plan/device.sh A.tar.xz B.tar.xz $OUT
set -uo pipefail
a=$1 b=$2 o=${3:-$OUT}
k16='TileScheduler.*:TailPlan.*:FastDivisor.*:Validation.*:Dispatch.*:SplitKv.*:Varlen.*:AllKernels/KernelTest.*16_coalesced*:Cases/AppendKvGpu.*:*Decod*:*Paged*'
san='*MatchesFp64Reference/16_coalesced_store_*_D64_Sq2000_Sk2000_causal*:*MatchesFp64Reference/16_coalesced_store_*_D128_Sq190_Sk700_causal*:SplitKv.*'
PREBUILT=$b GTEST_FILTER="$k16" SANITIZE=1 SANITIZE_FILTER="$san" SKIP_BENCH=1 SKIP_SASS=1 \
  scripts/gpu_run.sh "$o/tests" >"$o/tests.txt" 2>&1
tail -6 "$o/tests.txt"
RUNS='causalgrid dec1x4k dec16k varlen' results/evidence/fast_divisor/ab.sh "$a" "$b" "$o/ab" >"$o/ab.txt" 2>&1
cat "$o/ab.txt"
tar czf "$o/logs.tgz" -C "$o" tests ab 2>/dev/null && rm -rf "$o/tests" "$o/ab"
