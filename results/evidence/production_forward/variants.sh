#!/usr/bin/env bash
# Variants of the production forward beside step 16 at 6800c02 (one device call):
# VARIANTS='a b' FULL=a results/evidence/production_forward/variants.sh
#   for each variant: hattn-bench A B B A on short causal sweeps and a window at D = 128
#   (base 16 vs the variant's fwd_sm90), then fp8_ab at D = 128; FULL: that variant on the
#   grid, varlen, decoding, paged and windows, and fp8_ab at D = 64 and 128.
# Each .prebuilt/var_NAME.tar.xz holds hattn-bench, fp8_ab and prebuild_commit.txt.
set -uo pipefail
o=$OUT
for v in $VARIANTS; do
  KERNEL_A=16_coalesced_store KERNEL_B=fwd_sm90 RUNS='short window128' results/evidence/fast_divisor/ab.sh \
    .prebuilt/base6800.tar.xz .prebuilt/var_$v.tar.xz $o/$v >$o/$v.txt 2>&1
  echo "== $v"; tail -n +2 $o/$v.txt
  mkdir -p /tmp/fp8_$v && tar xJf .prebuilt/var_$v.tar.xz -C /tmp/fp8_$v
  /tmp/fp8_$v/fp8_ab 16_coalesced_store fwd_sm90 | grep "^128" >$o/fp8_$v.txt; cat $o/fp8_$v.txt
  rm -rf $o/$v
done
if [ -n "${FULL:-}" ]; then
  KERNEL_A=16_coalesced_store KERNEL_B=fwd_sm90 RUNS='grid varlen dec1x4k dec16k gqa4 paged window' \
    results/evidence/fast_divisor/ab.sh .prebuilt/base6800.tar.xz .prebuilt/var_$FULL.tar.xz $o/full >$o/full.txt 2>&1
  echo "== full $FULL"; tail -n +2 $o/full.txt
  /tmp/fp8_$FULL/fp8_ab 16_coalesced_store fwd_sm90 >$o/fp8_full.txt; cat $o/fp8_full.txt
  tar czf $o/full_logs.tgz -C $o full && rm -rf $o/full
fi
