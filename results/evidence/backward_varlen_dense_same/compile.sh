#!/usr/bin/env bash
# compile.sh ROOT OUTDIR FILE...: each src/backward/FILE of the source tree ROOT to PTX (no line
# info), and to a cubin with ptxas -v (the build's flags: -O3, sm_90a, -lineinfo), into OUTDIR.
set -u
root=$1; out=$2; shift 2
mkdir -p "$out"
flags="-I$root/include -I$root/src -I$root/src/kernels -I$root/src/backward -isystem=/usr/local/cuda/include -O3 -DNDEBUG -Xcompiler=-fPIC -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -std=c++20 -x cu"
for f in "$@"; do
  b=$(basename "$f" .cu)
  /usr/local/cuda/bin/nvcc $flags -ptx "$root/src/backward/$f" -o "$out/$b.ptx" || echo "PTX FAIL $f"
  /usr/local/cuda/bin/nvcc $flags -lineinfo -cubin -Xptxas=-v "$root/src/backward/$f" -o "$out/$b.cubin" 2> "$out/$b.ptxas.txt" || echo "CUBIN FAIL $f"
  echo "done $f"
done
