#!/usr/bin/env bash
# Disassembles one kernel file on a machine without a GPU or CUDA's disassembler: compiles
# FILE to a cubin with the build's flags (sm_90a, -O3), disassembles it with nvdisasm from
# PyPI (nvidia-cuda-nvdisasm, fetched once into .tools/, git-ignored) and prints the loops of
# the kernels whose mangled names match REGEX, with their instruction mix (tools/sass_loops.py).
#
#   scripts/disasm.sh src/lineage/bwd_13_producer.cu 'main_kernelI13__nv_bfloat16Li128ELb0E'
#
# FILE may also be a built library (.so, or .so.xz): its cubins are taken out of the fat binary
# (tools/fatbin_cubins.py) instead, so that a kernel built elsewhere, FlashAttention-3's
# (.anchors/flash_attn_3_sm90.so.xz from ../shared/anchors/fa3/), reads beside ours:
#
#   scripts/disasm.sh .anchors/flash_attn_3_sm90.so.xz 'FlashAttnBwdSm90.*ILi80EEENS7_ILi128EEESB_EEENS_10bfloat16_tEfNS_4arch4Sm90ELb0ELb0ELb0ELb0ELb0E'
#
# The full disassembly of the matching kernels goes to OUT (default build/disasm/NAME.sass).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 2 ] || { sed -n 2,15p "$0"; exit 2; }
src=$1 pattern=$2
name=$(basename "$src" .xz)
name=${name%.cu}
name=${name%.so}
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
if [[ $src == *.cu ]]; then
  cubin=$(dirname "$out")/$name.cubin
  nvcc -O3 -DNDEBUG -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -std=c++20 -Iinclude -Isrc \
    -Isrc/common -Isrc/lineage -cubin -o "$cubin" "$src"
  "$nvdisasm" -c "$cubin" >"$out.all"
else  # a library: every cubin of its fat binary, one listing after another
  cubins=$(dirname "$out")/$name.cubins
  rm -rf "$cubins"
  python3 tools/fatbin_cubins.py "$src" "$cubins" >/dev/null
  for cubin in "$cubins"/*.cubin; do "$nvdisasm" -c "$cubin"; done >"$out.all"
fi
python3 tools/sass_loops.py "$out.all" "$pattern" --out "$out"
