#!/usr/bin/env bash
# Builds a wheel of the Python package here, for a machine with another Python and no compiler
# time to spare (the GPU machine: Python 3.12), so that it installs there without compiling:
#
#   scripts/build_wheel.sh                 # -> dist/hattn-<version>-cp312-cp312-linux_x86_64.whl
#   pip install --no-deps dist/hattn-*.whl # there (torch 2.11 already installed)
#
# Environment: PYTHON, the interpreter whose version the wheel is for (default: python3.12, or
# pyenv's 3.12); LINEAGE=OFF for the production kernels only (default ON: the tests and the
# guide's benchmark need the lineage); BUILD=DIR builds in that CMake tree with scripts/test.sh's
# options (BUILD=build: its kernels are reused, only the binding and what depends on the Python
# recompile). The extension links no torch, so the wheel needs only the CUDA runtime (13) and
# torch 2.11 beside it. The build tree is otherwise build-py/<wheel tag>/.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-}
if [ -z "$py" ]; then  # the first Python 3.12 that runs (a pyenv shim may not)
  for candidate in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
    if "$candidate" --version >/dev/null 2>&1; then py=$candidate; break; fi
  done
fi
[ -n "$py" ] && "$py" --version >/dev/null 2>&1 || { echo "build_wheel: no Python 3.12 here (set PYTHON)"; exit 2; }
ver=$("$py" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
venv=.wheel-venv-$ver
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check 'scikit-build-core>=0.10' 'nanobind>=2.0'
start=$SECONDS
settings=(--config-settings=cmake.define.HATTN_LINEAGE="${LINEAGE:-ON}")
if [ -n "${BUILD:-}" ]; then
  settings+=("--config-settings=build-dir=$(cd "$BUILD" && pwd)" --config-settings=cmake.define.HATTN_BUILD_TESTS=ON
    --config-settings=cmake.define.HATTN_BUILD_BENCH=ON --config-settings=cmake.define.HATTN_PTXAS_VERBOSE=ON)
fi
"$venv/bin/python" -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps -w dist "${settings[@]}" .
wheel=$(ls -t dist/hattn-*cp$ver*.whl | head -1)
commit=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] || commit="$commit+dirty"
echo "$commit" >"$wheel.commit"  # what scripts/gpu_run.sh reports when it installs the wheel
echo "build_wheel: $wheel ($commit) in $((SECONDS - start)) s (lineage ${LINEAGE:-ON})"
