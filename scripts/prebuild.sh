#!/usr/bin/env bash
# Builds the GPU binaries on this machine (no GPU needed: nvcc 13.0 and the same CMake options
# as scripts/gpu_run.sh) and packs them, so that a GPU machine can run gpu_run.sh without
# building (its build takes about two minutes of GPU-machine time on 16 cores):
#
#   scripts/prebuild.sh                          # -> .prebuilt/build-gpu.tar.xz
#   scripts/gpu_run.sh --prebuilt .prebuilt/build-gpu.tar.xz [STEPS]    # on the GPU machine
#   ARCHIVE=.prebuilt/trial.tar.xz scripts/prebuild.sh   # a trial's binaries, beside main's
#
# The archive holds hattn_tests, hattn-bench, the build's log (ptxas's register and spill
# reports for the files this build compiled: all of them after a clean build, FRESH=1) and the
# commit. The GPU machine needs the same CUDA major version (the binaries load libcudart.so.13
# and, for hattn-bench, cuBLAS). Python's extension comes from scripts/build_wheel.sh, or is built there.
set -euo pipefail
cd "$(dirname "$0")/.." || exit 1
jobs=${JOBS:-$(nproc 2>/dev/null || echo 2)}
build=${BUILD:-build-gpu}  # BUILD=build reuses scripts/test.sh's tree (the same options)
[ "${FRESH:-0}" = 1 ] && rm -rf "$build"
mkdir -p .prebuilt
log=.prebuilt/build.log
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DHATTN_PTXAS_VERBOSE=ON >"$log" 2>&1
cmake --build "$build" -j "$jobs" --target hattn_tests hattn-bench >>"$log" 2>&1 || {
  tail -40 "$log"
  echo "BUILD FAILED (log: $log)"
  exit 1
}
commit=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
if [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then commit="$commit+dirty"; fi
echo "$commit" >.prebuilt/commit.txt
cp "$log" "$build/prebuild.log"
cp .prebuilt/commit.txt "$build/prebuild_commit.txt"
# The compiler's version, for tools/check_spills.py there (as gpu_run.sh reads it from CMake).
grep -ho 'CMAKE_CUDA_COMPILER_VERSION "[0-9.]*"' "$build"/CMakeFiles/*/CMakeCUDACompiler.cmake | head -1 |
  grep -o '[0-9][0-9.]*' >"$build/prebuild_nvcc.txt" || true
# xz -9: its 64 MiB window spans hattn_tests, so hattn-bench's copy of the kernels packs as
# references to it (11 MB at -3, 5.3 MB at -9 for about 35 s more): a trial's binaries then
# fit beside main's in a device call's 64 MiB.
archive=${ARCHIVE:-.prebuilt/build-gpu.tar.xz}
tar cf - -C "$build" hattn_tests hattn-bench prebuild.log prebuild_commit.txt prebuild_nvcc.txt |
  xz -T"$jobs" -9 >"$archive"
echo "packed $(du -h "$archive" | cut -f1) for commit $commit into $archive" \
  "($(grep -c 'registers' "$log" || true) ptxas reports in the log)"
