#!/usr/bin/env bash
# Builds the Python package `hattn` into a virtual environment and runs its pytest suite.
#
#   scripts/test_python.sh [pytest arguments]
#
# Without a Hopper GPU (CI, developer machines) the CPU tests run and the GPU tests skip with a
# reason; on an H200 everything runs. Environment:
#   HATTN_VENV       the virtual environment (default: <repo>/.venv, git-ignored); reused when present
#   PYTHON           the interpreter that creates it (default: python3)
#   HATTN_TORCH      the torch version to install when the venv has none (default: 2.11.0)
#   HATTN_TORCH_FULL 1: install torch with all its nvidia-* wheels instead of the light route below
#   HATTN_CMAKE_BUILD
#                    a CMake build tree of this checkout (scripts/test.sh passes its own): the package
#                    is built in it with the same options, so only the binding compiles; else in
#                    <repo>/build-py/
#
# torch from PyPI: the default Linux wheel pulls ~3 GB of nvidia-* CUDA wheels (4.6 GB venv, about
# 90 s here). The CPU tests need none of them to *run*, but libtorch links a few CUDA libraries at
# load time. The light route installs torch with --no-deps plus only the three CUDA libraries that
# the system CUDA toolkit (in the loader path on our machines) lacks, and torch's pure-Python
# dependencies: 1.7 GB, about 50 s. If `import torch` still fails, it falls back to the full install.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${HATTN_VENV:-$root/.venv}
torch_version=${HATTN_TORCH:-2.11.0}
start=$SECONDS

log() { printf '[test_python %4ds] %s\n' $((SECONDS - start)) "$*"; }

if [ ! -x "$venv/bin/python" ]; then
  log "creating $venv"
  "${PYTHON:-python3}" -m venv "$venv"
fi
py=$venv/bin/python
pip_install() { "$py" -m pip install --disable-pip-version-check --no-input --progress-bar off -q "$@"; }

if ! "$py" -c 'import torch' >/dev/null 2>&1; then
  if [ "${HATTN_TORCH_FULL:-0}" = 1 ]; then
    log "installing torch==$torch_version with its CUDA dependencies"
    pip_install "torch==$torch_version"
  else
    log "installing torch==$torch_version (light route: --no-deps + the CUDA libraries the system lacks)"
    # Pins as torch 2.11.0 declares them; for another version, the fallback below still works.
    pip_install --no-deps "torch==$torch_version" \
      nvidia-cufile==1.15.1.6 nvidia-cusparselt-cu13==0.8.0 nvidia-nvshmem-cu13==3.4.5
    log "(pip's notes that torch's nvidia-*, cuda-* and triton requirements are missing are expected here)"
    pip_install filelock 'typing-extensions>=4.10.0' 'setuptools<82' 'sympy>=1.13.3' 'networkx>=2.5.1' \
      jinja2 'fsspec>=0.8.5' numpy
    if ! "$py" -c 'import torch' 2>/dev/null; then
      "$py" -c 'import torch' 2>&1 | tail -n 1 || true
      log "the light torch does not load here; installing torch with all its dependencies"
      pip_install "torch==$torch_version"
    fi
  fi
fi
"$py" -c 'import torch; print("torch", torch.__version__, "| CUDA available:", torch.cuda.is_available())'

log "installing build and test tools"
pip_install 'scikit-build-core>=0.10' 'nanobind>=2.0' pytest numpy matplotlib 'diffusers==0.42.1'  # diffusers: the capstone's tests

# --no-build-isolation: build with the tools above (works offline too); --no-deps: torch is there,
# and the resolver must not pull the nvidia-* wheels that the light route left out.
settings=(--config-settings=cmake.define.HATTN_LINEAGE=ON)  # the tests cover every step
if [ -n "${HATTN_CMAKE_BUILD:-}" ]; then
  # The C++ build's own options, so that its kernels are reused rather than compiled again.
  settings+=("--config-settings=build-dir=$HATTN_CMAKE_BUILD"
    --config-settings=cmake.define.HATTN_BUILD_TESTS=ON --config-settings=cmake.define.HATTN_BUILD_BENCH=ON
    --config-settings=cmake.define.HATTN_PTXAS_VERBOSE=ON)
fi
log "building and installing hattn (CMake build tree: ${HATTN_CMAKE_BUILD:-$root/build-py/})"
pip_install --no-build-isolation --no-deps "${settings[@]}" "$root"

log "running pytest"
cd "$root"
exec "$py" -m pytest python/tests -rs "$@"
