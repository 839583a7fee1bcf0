#!/usr/bin/env bash
# Second device call: the landed form (three consumers, short causal sweeps only; commit in
# .prebuilt/own_b.tar.xz) beside main 2776cdc: kernel 16's GPU tests and sanitizers, then A/B.
set -uo pipefail
o=${1:-$OUT}
k16='TileScheduler.*:FastDivisor.*:Validation.*:Dispatch.*:SplitKv.*:Varlen.*:AllKernels/KernelTest.*16_coalesced*:Cases/AppendKvGpu.*:*Decod*:*Paged*'
san='*MatchesFp64Reference/16_coalesced_store_*_D64_Sq2000_Sk2000_causal*:*MatchesFp64Reference/16_coalesced_store_*_D64_Sq1500_Sk1900_causal*:*MatchesFp64Reference/16_coalesced_store_*_D64_Sq200_Sk1300_causal*:*MatchesFp64Reference/16_coalesced_store_*_D64_Sq2100_Sk2100_causal*'
PREBUILT=.prebuilt/own_b.tar.xz GTEST_FILTER="$k16" SANITIZE=1 SANITIZE_FILTER="$san" SKIP_BENCH=1 SKIP_SASS=1 \
  scripts/gpu_run.sh "$o/tests" >"$o/tests.txt" 2>&1
tail -7 "$o/tests.txt"
grep -c "16_coalesced_store_.*D64_Sq\(2000_Sk2000\|1500_Sk1900\)" "$o/tests/sanitizer_memcheck.log"
RUNS='grid causal64 gqacausal varlen' results/evidence/fast_divisor/ab.sh \
  .prebuilt/main_2776cdc.tar.xz .prebuilt/own_b.tar.xz "$o/ab" >"$o/ab.txt" 2>&1
cat "$o/ab.txt"
tar czf "$o/logs.tgz" -C "$o" tests ab 2>/dev/null && rm -rf "$o/tests" "$o/ab"
