#!/usr/bin/env bash
# Timing on the H200, one call: kernel 16 plain vs softcap 30 (the landed tanh.approx form),
# softcap at D = 64 with three consumers (branch build) vs two (main's rule), in A-B-B-A order,
# and bwd_15 plain vs softcap 30.
#   A: archive of main + backward-softcap (two consumers for softcap)
#   B: archive of the softcap-three-consumers branch
# Usage: timing.sh A.tar.xz B.tar.xz OUT_DIR   (the backward takes no --settle: burst figures)
set -uo pipefail
a=$1 b=$2 out=$3
ca=$(tar xJOf "$a" prebuild_commit.txt) cb=$(tar xJOf "$b" prebuild_commit.txt)
mkdir -p "$out" /tmp/ta /tmp/tb
tar xJf "$a" -C /tmp/ta && tar xJf "$b" -C /tmp/tb || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm,power.limit --format=csv >"$out/machine.txt"
fwd=(--kernels 16_coalesced_store --seqlens "1024,4096,16384" --causal both --settle 0.5 --no-gemm)
HATTN_COMMIT=$ca /tmp/ta/hattn-bench "${fwd[@]}" --dims 64,128,256 --csv "$out/plain.csv" >"$out/plain.log" 2>&1
HATTN_COMMIT=$ca /tmp/ta/hattn-bench "${fwd[@]}" --dims 64,128,256 --softcap 30 --csv "$out/softcap.csv" >"$out/softcap.log" 2>&1
HATTN_COMMIT=$ca /tmp/ta/hattn-bench "${fwd[@]}" --dims 64 --softcap 30 --csv "$out/d64_two_1.csv" >"$out/d64_two_1.log" 2>&1
HATTN_COMMIT=$cb /tmp/tb/hattn-bench "${fwd[@]}" --dims 64 --softcap 30 --csv "$out/d64_three_1.csv" >"$out/d64_three_1.log" 2>&1
HATTN_COMMIT=$cb /tmp/tb/hattn-bench "${fwd[@]}" --dims 64 --softcap 30 --csv "$out/d64_three_2.csv" >"$out/d64_three_2.log" 2>&1
HATTN_COMMIT=$ca /tmp/ta/hattn-bench "${fwd[@]}" --dims 64 --softcap 30 --csv "$out/d64_two_2.csv" >"$out/d64_two_2.log" 2>&1
bwd=(--backward --kernels bwd_15_tma_sums --dims "64,128" --seqlens "1024,4096,16384" --causal both --no-gemm)
HATTN_COMMIT=$ca /tmp/ta/hattn-bench "${bwd[@]}" --csv "$out/bwd_plain.csv" >"$out/bwd_plain.log" 2>&1
HATTN_COMMIT=$ca /tmp/ta/hattn-bench "${bwd[@]}" --softcap 30 --csv "$out/bwd_softcap.csv" >"$out/bwd_softcap.log" 2>&1
for f in "$out"/*.log; do echo "== $f"; grep -E "^\[" "$f"; done
