#!/usr/bin/env bash
# Timing on the H200, one call: kernel 16 before (A) and after (B) the idle-consumer skip, in
# A-B-B-A order: decoding (one query per sequence; dense and with 4 query heads per K/V head,
# which packs them into one item), and the forward grid at S = 1k, 4k, 16k (where every
# block's consumers have rows, so B should read as A).
# Usage: timing.sh A.tar.xz B.tar.xz OUT_DIR
set -uo pipefail
a=$1 b=$2 out=$3
ca=$(tar xJOf "$a" prebuild_commit.txt) cb=$(tar xJOf "$b" prebuild_commit.txt)
mkdir -p "$out" /tmp/ta /tmp/tb
tar xJf "$a" -C /tmp/ta && tar xJf "$b" -C /tmp/tb || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm,power.limit --format=csv >"$out/machine.txt"
dec=(--kernels 16_coalesced_store --seqlen-q 1 --causal no --seqlens "4096,16384,65536" --dims "64,128,256" --no-gemm)
grid=(--kernels 16_coalesced_store --seqlens "1024,4096,16384" --causal both --dims "64,128,256" --settle 0.5 --no-gemm)
run() {  # tag binary-dir commit args...
  local tag=$1 dir=$2 commit=$3
  shift 3
  HATTN_COMMIT=$commit "$dir/hattn-bench" "$@" --csv "$out/$tag.csv" >"$out/$tag.log" 2>&1
}
for order in a1 b1 b2 a2; do
  case $order in a*) d=/tmp/ta c=$ca ;; *) d=/tmp/tb c=$cb ;; esac
  run "decode_$order" $d "$c" "${dec[@]}"
  run "decode_gqa4_$order" $d "$c" "${dec[@]}" --gqa 4
done
for order in a1 b1 b2 a2; do
  case $order in a*) d=/tmp/ta c=$ca ;; *) d=/tmp/tb c=$cb ;; esac
  run "grid_$order" $d "$c" "${grid[@]}"
done
for f in "$out"/*.log; do echo "== $f"; grep -E "^\[|FAIL" "$f"; done
