#!/usr/bin/env bash
# The forward kernels in the prebuilt FA3 library, by the mainloop's template arguments: stages,
# cluster shape, tile (block M, block N, head dim) and the V head dim. CPU only (strings, c++filt).
# bash results/evidence/fa3_no_dv512/list_kernels.sh .anchors/flash_attn_3_sm90.so
set -euo pipefail
lib=${1:-.anchors/flash_attn_3_sm90.so}
sha256sum "$lib"
strings -n 20 "$lib" | grep '^_ZN7cutlass13device_kernelIN5flash11enable_sm90INS1_16FlashAttnFwdSm90' | c++filt |
  grep -o 'CollectiveMainloopFwdSm90<[0-9]*, cute::tuple<cute::C<[0-9]*>, cute::C<[0-9]*>, cute::C<[0-9]*> >, cute::tuple<cute::C<[0-9]*>, cute::C<[0-9]*>, cute::C<[0-9]*> >, [0-9]*' |
  sed 's/cute::C<\([0-9]*\)>/\1/g; s/CollectiveMainloopFwdSm90<\([0-9]*\), cute::tuple<\([0-9, ]*\) >, cute::tuple<\([0-9, ]*\) >, \([0-9]*\)/stages \1, cluster (\2), tile (\3), head dim V \4/' |
  sort | uniq -c
