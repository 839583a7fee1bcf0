#!/usr/bin/env bash
# The test command: builds the library and runs every test this machine can run.
# CPU tests (reference, validation, dispatch, scheduler) always run; GPU tests skip with the
# reason when there is no Hopper GPU. Before them, the spill check (ptxas's reports against
# tools/spill_budget.txt). Then the docs checks (tables and code excerpts up to
# date, the lineage diffs table current), then the Python tests when scripts/test_python.sh exists.
#
#   scripts/test.sh
#
# Needs: CMake >= 3.24, Ninja, a C++20 compiler, the CUDA toolkit (nvcc 12.4+), GoogleTest.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${JOBS:-2}
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DHATTN_PTXAS_VERBOSE=ON
# ptxas's register and spill reports go to build/build.log only; the build's own lines show.
cmake --build build -j "$jobs" 2>&1 | tee build/build.log | { grep -v -E "^ptxas info|bytes stack frame" || true; }
# No kernel spills more than tools/spill_budget.txt allows (the kernels compiled just now).
nvcc_version=$(grep -ho 'CMAKE_CUDA_COMPILER_VERSION "[0-9.]*"' build/CMakeFiles/*/CMakeCUDACompiler.cmake |
  head -1 | grep -o '[0-9][0-9.]*' || true)
python3 tools/check_spills.py build/build.log --nvcc "${nvcc_version:-unknown}"
# ctest's full listing (every test, and every skipped one again at the end) goes to
# build/ctest.log; printed: a summary of what passed, failed and skipped and why, and on a
# failure the log's end, where ctest repeats the failures' output.
if ! ctest --test-dir build --output-on-failure -j "$jobs" >build/ctest.log 2>&1; then
  tail -150 build/ctest.log
  python3 tools/ctest_summary.py build/ctest.log build/hattn_tests || true
  exit 1
fi
python3 tools/ctest_summary.py build/ctest.log build/hattn_tests
# The install rules: find_package(hattn) from a C++ project (tests/consumer/).
scripts/test_install.sh build
# The docs: result tables match results/, code excerpts match src/, the evidence index is
# current and every evidence entry is cited.
python3 tools/gen_docs.py --check
python3 tools/check_excerpts.py
python3 tools/check_figures.py
python3 tools/lineage_diffs.py --check
python3 tools/evidence_index.py --check
if [ -x scripts/test_python.sh ]; then
  # The package is built in the same tree, so each kernel compiles once.
  HATTN_CMAKE_BUILD=$PWD/build scripts/test_python.sh
fi
