#!/usr/bin/env bash
# Device calls for the production forward (fwd_sm90, src/attention/) beside step 16 at 6800c02.
#   device.sh tests NEW.tar.xz OUT        its GPU tests (every fwd_sm90 case, dispatch, split-KV,
#                                         varlen, FP8, decoding, paged, KV append) + sanitizers
#   device.sh ab BASE.tar.xz NEW.tar.xz FP8_AB OUT
#                                         hattn-bench A B B A (A: 16 in BASE, B: fwd_sm90 in NEW)
#                                         on the grid, varlen, decoding, paged, a window; then
#                                         FP8 (fp8_ab, both kernels of NEW interleaved)
set -uo pipefail
mode=$1
shift
case $mode in
  tests)
    b=$1 o=$2
    filter='*fwd_sm90*:ForwardPlan.*:Dispatch.*:Validation.*:SplitKv.*:Varlen.*:Fp8*:*Decod*:*Paged*:Cases/AppendKvGpu.*'
    san='*MatchesFp64Reference/fwd_sm90_*_D128_Sq190_Sk700_causal*:*MatchesFp64Reference/fwd_sm90_*_D256_*varlen*'
    san="$san:*MatchesFp64Reference/fwd_sm90_*_D64_Sq2000_Sk2000_causal*:*MatchesFp64Reference/fwd_sm90_*_window800x800*"
    san="$san:*MatchesFp64Reference/fwd_sm90_2*_D128_Sq1000_Sk3000_bf16:SplitKv.*"
    PREBUILT=$b GTEST_FILTER="$filter" SANITIZE=1 SANITIZE_FILTER="$san" SKIP_BENCH=1 SKIP_SASS=1 \
      scripts/gpu_run.sh "$o/tests" >"$o/tests.txt" 2>&1
    tail -8 "$o/tests.txt"
    grep -h "FAILED\|Failure" "$o/tests/tests.log" | head -20
    tar czf "$o/tests_logs.tgz" -C "$o" tests && rm -rf "$o/tests"
    ;;
  ab)
    a=$1 b=$2 fp8=$3 o=$4
    KERNEL_A=16_coalesced_store KERNEL_B=fwd_sm90 RUNS='grid varlen dec1x4k dec16k gqa4 paged window' \
      results/evidence/fast_divisor/ab.sh "$a" "$b" "$o/ab" >"$o/ab.txt" 2>&1
    cat "$o/ab.txt"
    if [ -n "$fp8" ]; then
      xz -dkc "$fp8" >/tmp/fp8_ab && chmod +x /tmp/fp8_ab && /tmp/fp8_ab 16_coalesced_store fwd_sm90 | tee "$o/fp8.txt"
    fi
    tar czf "$o/ab_logs.tgz" -C "$o" ab && rm -rf "$o/ab"
    ;;
esac
