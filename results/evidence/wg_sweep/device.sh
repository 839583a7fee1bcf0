#!/usr/bin/env bash
# One device call: kernel 16's GPU tests and sanitizers with build B, then A/B timings.
#   A = main (.prebuilt/main_2776cdc.tar.xz), B = each consumer sweeps only its own tiles
#   (.prebuilt/wg_b.tar.xz), C = B with three consumers on every causal sweep at D = 64
#   (.prebuilt/wg_c.tar.xz).
set -uo pipefail
o=${1:-$OUT}
k16='TileScheduler.*:FastDivisor.*:Validation.*:Dispatch.*:SplitKv.*:Varlen.*:AllKernels/KernelTest.*16_coalesced*:Cases/AppendKvGpu.*:*Decod*:*Paged*'
san='*MatchesFp64Reference/16_coalesced_store_4_*:*MatchesFp64Reference/16_coalesced_store_7_*:*MatchesFp64Reference/16_coalesced_store_10_*:*MatchesFp64Reference/16_coalesced_store_17_*:SplitKv.*'
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  PREBUILT=.prebuilt/wg_b.tar.xz GTEST_FILTER="$k16" SANITIZE=1 SANITIZE_FILTER="$san" SKIP_BENCH=1 SKIP_SASS=1 \
    scripts/gpu_run.sh "$o/tests_b" >"$o/tests_b.txt" 2>&1
  tail -8 "$o/tests_b.txt"
fi
RUNS=${RUNS_AB:-'grid causal64 gqacausal varlen'} results/evidence/fast_divisor/ab.sh \
  .prebuilt/main_2776cdc.tar.xz .prebuilt/wg_b.tar.xz "$o/ab" >"$o/ab.txt" 2>&1
RUNS='causal64' results/evidence/fast_divisor/ab.sh .prebuilt/wg_b.tar.xz .prebuilt/wg_c.tar.xz "$o/bc" >"$o/bc.txt" 2>&1
cat "$o/ab.txt" "$o/bc.txt"
tar czf "$o/logs.tgz" -C "$o" tests_b ab bc 2>/dev/null && rm -rf "$o/tests_b" "$o/ab" "$o/bc"
