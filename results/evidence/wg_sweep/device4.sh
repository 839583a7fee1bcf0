#!/usr/bin/env bash
# Fourth device call: as the third, but rows past the sequence pass only without a causal mask or
# with own sweeps (.prebuilt/own_d.tar.xz), beside main 2776cdc:
# kernel 16's GPU tests and sanitizers, then A/B at D = 64.
set -uo pipefail
o=${1:-$OUT}
k16='TileScheduler.*:FastDivisor.*:Validation.*:Dispatch.*:SplitKv.*:Varlen.*:AllKernels/KernelTest.*16_coalesced*:Cases/AppendKvGpu.*:*Decod*:*Paged*'
san='*MatchesFp64Reference/16_coalesced_store_*_D64_Sq2000_Sk2000_causal*:*MatchesFp64Reference/16_coalesced_store_*_D64_Sq1500_Sk1900_causal*:*MatchesFp64Reference/16_coalesced_store_*_D64_Sq1000_Sk2000_fp16*'
PREBUILT=.prebuilt/own_d.tar.xz GTEST_FILTER="$k16" SANITIZE=1 SANITIZE_FILTER="$san" SKIP_BENCH=1 SKIP_SASS=1 \
  scripts/gpu_run.sh "$o/tests" >"$o/tests.txt" 2>&1
tail -5 "$o/tests.txt"
RUNS='grid64 causal64' results/evidence/fast_divisor/ab.sh .prebuilt/main_2776cdc.tar.xz .prebuilt/own_d.tar.xz "$o/ac" >"$o/ac.txt" 2>&1
cat "$o/ac.txt"
tar czf "$o/logs.tgz" -C "$o" tests ac 2>/dev/null && rm -rf "$o/tests" "$o/ac"
