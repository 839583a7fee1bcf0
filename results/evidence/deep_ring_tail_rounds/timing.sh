#!/usr/bin/env bash
# Timing on the H200, one call: kernel 16 of main (A) beside the deep ring and the tail cut over
# several rounds (B), hattn-bench in the order A B B A. Decoding (one query per sequence: dense,
# 4 query heads per K/V head, a paged cache, 32 sequences), the D = 128 prefill that runs the
# run-time bounds kernels (variable-length, paged, sliding window), and the forward grid
# without a mask (the tail cut).
# Usage: [TAGS='decode grid ...'] [PRE_DIMS=64,128] timing.sh A.tar.xz B.tar.xz OUT_DIR
set -uo pipefail
out=$3
declare -A dir commit
for x in a b; do
  case $x in a) f=$1 ;; b) f=$2 ;; esac
  dir[$x]=/tmp/t$x
  mkdir -p "${dir[$x]}"
  tar xJf "$f" -C "${dir[$x]}" || exit 1
  commit[$x]=$(cat "${dir[$x]}/prebuild_commit.txt")
done
mkdir -p "$out"
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm,power.limit --format=csv >"$out/machine.txt"
k=(--kernels 16_coalesced_store --no-gemm)
dec=("${k[@]}" --seqlen-q 1 --causal no --seqlens "4096,16384,65536" --dims "64,128,256")
pre=("${k[@]}" --dims "${PRE_DIMS:-128}" --seqlens "2048,4096,16384" --settle 0.3)  # PRE_DIMS: the prefill head dims
grid=("${k[@]}" --seqlens "2048,4096,8192,16384" --causal no --dims "128,256" --settle 0.5)
run() {  # tag a|b args...
  local tag=$1 x=$2
  shift 2
  HATTN_COMMIT=${commit[$x]} "${dir[$x]}/hattn-bench" "$@" --csv "$out/$tag.csv" >"$out/$tag.log" 2>&1
}
# TAGS: which of these to run (default: all)
tags=${TAGS:-"decode decode_gqa4 decode_paged decode_batch32 prefill_varlen prefill_paged prefill_window grid"}
for order in a1 b1 b2 a2; do
  x=${order:0:1}
  for tag in $tags; do
    case $tag in
      decode) run "decode_$order" "$x" "${dec[@]}" ;;
      decode_gqa4) run "decode_gqa4_$order" "$x" "${dec[@]}" --gqa 4 ;;
      decode_paged) run "decode_paged_$order" "$x" "${dec[@]}" --page-size 256 ;;
      decode_batch32) run "decode_batch32_$order" "$x" "${dec[@]}" --seqlens 4096 --tokens 131072 ;;
      prefill_varlen) run "prefill_varlen_$order" "$x" "${pre[@]}" --varlen mixed ;;
      prefill_paged) run "prefill_paged_$order" "$x" "${pre[@]}" --page-size 256 ;;
      prefill_window) run "prefill_window_$order" "$x" "${pre[@]}" --window 1024,0 ;;
      grid) run "grid_$order" "$x" "${grid[@]}" ;;
      *) echo "unknown tag $tag" && exit 2 ;;
    esac
  done
done
for f in "$out"/*.log; do
  echo "== $f"
  grep -E "^\[|FAIL" "$f"
done
