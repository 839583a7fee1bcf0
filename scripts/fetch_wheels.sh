#!/usr/bin/env bash
# Downloads the Python packages the capstone needs beyond the GPU machine's image (diffusers
# and its dependencies) into .whl/ (git-ignored), as wheels for that machine's Python, so that
# they can travel with the working tree to a machine without network access.
#
#   scripts/fetch_wheels.sh               # here, where PyPI is reachable
#   pip install --no-index --find-links .whl 'diffusers==0.42.1'    # there
#
# Python version and platform of the GPU machine: PY_VERSION (default 3.12), manylinux x86_64.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download 'diffusers==0.42.1' --python-version "${PY_VERSION:-3.12}" --only-binary=:all: \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d .whl -q
du -sh .whl
