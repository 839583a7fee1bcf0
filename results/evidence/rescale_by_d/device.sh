#!/usr/bin/env bash
# One device call for the rescale by head dim: kernel 16's GPU tests and sanitizers with build B,
# then B beside A on the grid and varlen (../fast_divisor/ab.sh, A B B A).
# Usage (after `git apply rescale_by_d.patch` and scripts/prebuild.sh for B, main's build for A):
#   results/evidence/rescale_by_d/device.sh A.tar.xz B.tar.xz $OUT
set -uo pipefail
a=$1 b=$2 o=${3:-$OUT}
k16='TileScheduler.*:FastDivisor.*:Validation.*:Dispatch.*:SplitKv.*:Varlen.*:AllKernels/KernelTest.*16_coalesced*:Cases/AppendKvGpu.*:*Decod*:*Paged*'
san='*MatchesFp64Reference/16_coalesced_store_*_D128_Sq190_Sk700_causal*:*MatchesFp64Reference/16_coalesced_store_*_D256_*varlen*:SplitKv.*'
PREBUILT=$b GTEST_FILTER="$k16" SANITIZE=1 SANITIZE_FILTER="$san" SKIP_BENCH=1 SKIP_SASS=1 \
  scripts/gpu_run.sh "$o/tests" >"$o/tests.txt" 2>&1
tail -6 "$o/tests.txt"
RUNS='grid varlen' results/evidence/fast_divisor/ab.sh "$a" "$b" "$o/ab" >"$o/ab.txt" 2>&1
cat "$o/ab.txt"
tar czf "$o/logs.tgz" -C "$o" tests ab 2>/dev/null && rm -rf "$o/tests" "$o/ab"
