#!/usr/bin/env bash
# Kernel 16 with an item's divisions done by FastDivisor (B) beside the build before it (A):
# decoding (dense at D = 64, 128, 256; GQA 4 packed; a paged cache) and a few prefill shapes,
# hattn-bench in the order A B B A, each run's GPU times in its own CSV.
# Usage: [RUNS='dec1x4k grid ...'] [KERNEL_A=name] [KERNEL_B=name] ab.sh A.tar.xz B.tar.xz OUT_DIR
# (RUNS: names below; default: the first five. KERNEL_A, KERNEL_B: the kernel each build runs;
# default 16_coalesced_store)
set -uo pipefail
out=$3
declare -A dir commit kernel
kernel[a]=${KERNEL_A:-16_coalesced_store}
kernel[b]=${KERNEL_B:-16_coalesced_store}
for x in a b; do
  case $x in a) f=$1 ;; b) f=$2 ;; esac
  dir[$x]=/tmp/ab_$x
  mkdir -p "${dir[$x]}"
  tar xJf "$f" -C "${dir[$x]}" || exit 1
  commit[$x]=$(cat "${dir[$x]}/prebuild_commit.txt")
done
mkdir -p "$out"
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm,power.limit --format=csv >"$out/machine.txt"
runs=(
  "dec1x4k|--seqlen-q 1 --causal no --dims 64,128,256 --seqlens 4096 --tokens 4096"
  "dec16k|--seqlen-q 1 --causal no --dims 64,128,256 --seqlens 4096,16384 --tokens 16384"
  "gqa4|--seqlen-q 1 --causal no --dims 128 --gqa 4 --seqlens 4096,16384 --tokens 16384"
  "paged|--seqlen-q 1 --causal no --dims 128 --page-size 256 --seqlens 4096,16384 --tokens 16384"
  "prefill|--dims 64,128,256 --seqlens 512,2048 --tokens 16384"
  "grid|--dims 64,128,256 --seqlens 512,1024,2048,4096,8192,16384"
  "varlen|--dims 64,128 --seqlens 1024,4096 --varlen mixed"
  "window|--dims 64,128 --seqlens 1024,4096 --window 256,0"
  "grid64|--dims 64 --seqlens 512,1024,2048,4096,8192,16384"
  "causalgrid|--dims 64,128,256 --seqlens 512,1024,2048,4096,8192,16384 --causal yes"
  "rankflip|--dims 64,128,256 --seqlens 2048,4096,8192 --causal yes"
  "causal64|--dims 64 --seqlens 512,1024,2048,4096,8192 --causal yes"
  "gqacausal|--dims 128 --gqa 4 --seqlens 512,2048,8192 --causal yes"
  "short|--dims 64,128 --seqlens 512,1024 --causal yes"
  "window128|--dims 128 --seqlens 1024,4096 --window 256,0"
  "window64wide|--dims 64 --seqlens 4096,8192 --window 2048,0"
)
wanted=${RUNS:-"dec1x4k dec16k gqa4 paged prefill"}
selected=()
for r in "${runs[@]}"; do
  [[ " $wanted " == *" ${r%%|*} "* ]] && selected+=("$r")
done
runs=("${selected[@]}")
for order in a1 b1 b2 a2; do
  x=${order:0:1}
  for r in "${runs[@]}"; do
    name=${r%%|*}
    # shellcheck disable=SC2086  # the flags split into words
    HATTN_COMMIT=${commit[$x]} "${dir[$x]}/hattn-bench" --kernels "${kernel[$x]}" --no-gemm ${r#*|} \
      --csv "$out/${name}_$order.csv" >"$out/${name}_$order.log" 2>&1
  done
done
python3 - "$out" "${runs[@]}" <<'PY'
import csv, sys
out, names = sys.argv[1], [r.split("|")[0] for r in sys.argv[2:]]
def rows(name, order):
    try:
        return list(csv.DictReader(open(f"{out}/{name}_{order}.csv")))
    except OSError:
        return []
print("run      D  Sk     batch causal    A1      B1      B2      A2  (us)  A/B")
for name in names:
    runs = {o: rows(name, o) for o in ("a1", "b1", "b2", "a2")}
    for i, row in enumerate(runs["a1"]):
        t = {o: 1000 * float(runs[o][i]["ms"]) if i < len(runs[o]) else float("nan") for o in runs}
        a, b = (t["a1"] + t["a2"]) / 2, (t["b1"] + t["b2"]) / 2
        print(f"{name:8s} {row['head_dim']:>3s} {row['seqlen_k']:>6s} {row['batch']:>4s} {row['causal']:>6s} "
              + " ".join(f"{t[o]:7.1f}" for o in ("a1", "b1", "b2", "a2")) + f" {a / b:6.3f}")
PY
