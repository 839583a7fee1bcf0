#!/usr/bin/env bash
# The test command: builds the library and runs every test this machine can run.
# CPU tests (reference, validation, dispatch, scheduler) always run; GPU tests skip with the
# reason when there is no Hopper GPU. Then the docs checks (tables and code excerpts up to
# date), then the Python tests when scripts/test_python.sh exists.
#
#   scripts/test.sh
#
# Needs: CMake >= 3.24, Ninja, a C++20 compiler, the CUDA toolkit (nvcc 12.4+), GoogleTest.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${JOBS:-2}
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build -j "$jobs"
ctest --test-dir build --output-on-failure -j "$jobs"
# The docs: result tables match results/, code excerpts match src/.
python3 tools/gen_docs.py --check
python3 tools/check_excerpts.py
if [ -x scripts/test_python.sh ]; then
  scripts/test_python.sh
fi
