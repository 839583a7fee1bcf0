#!/usr/bin/env bash
# Disassembles one kernel file on a machine without a GPU or CUDA's disassembler: compiles
# FILE to a cubin with the build's flags (sm_90a, -O3), disassembles it with nvdisasm from
# PyPI (nvidia-cuda-nvdisasm, fetched once into .tools/, git-ignored) and prints the loops of
# the kernels whose mangled names match REGEX, with their instruction mix (tools/sass_loops.py).
#
#   scripts/disasm.sh src/lineage/bwd_13_producer.cu 'main_kernelI13__nv_bfloat16Li128ELb0E'
#
# The full disassembly of the matching kernels goes to OUT (default build/disasm/NAME.sass).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 2 ] || { sed -n 2,9p "$0"; exit 2; }
src=$1 pattern=$2
name=$(basename "$src" .cu)
out=${OUT:-build/disasm/$name.sass}
nvdisasm=.tools/nvidia/cu13/bin/nvdisasm
if [ ! -x "$nvdisasm" ]; then
  mkdir -p .tools/wheel
  python3 -m pip download --no-deps -q -d .tools/wheel nvidia-cuda-nvdisasm
  python3 -m zipfile -e .tools/wheel/nvidia_cuda_nvdisasm-*.whl .tools
  chmod +x "$nvdisasm"
fi
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
mkdir -p "$(dirname "$out")"
cubin=$(dirname "$out")/$name.cubin
nvcc -O3 -DNDEBUG -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -std=c++20 -Iinclude -Isrc \
  -Isrc/common -Isrc/lineage -cubin -o "$cubin" "$src"
"$nvdisasm" -c "$cubin" >"$out.all"
python3 tools/sass_loops.py "$out.all" "$pattern" --out "$out"
