#!/usr/bin/env bash
# The device call of this folder: the probe under racecheck (both modes) and initcheck limited
# to its kernel by name, beside the long randomized contract (the package from dist/'s wheel).
# Usage (repository root, on the GPU machine): device.sh OUT
set -uo pipefail
o=$1
mkdir -p "$o"
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv >"$o/machine.txt" 2>&1
(
  compute-sanitizer --version >"$o/probe_sanitizer_options.txt" 2>&1
  compute-sanitizer --help 2>&1 | grep -iA3 "kernel-name\|kernel-regex" >>"$o/probe_sanitizer_options.txt"
  nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -lineinfo -Isrc -std=c++20 \
    results/evidence/racecheck_item_slots/probe.cu -o /tmp/probe || exit 1
  for m in warp every racy; do
    /tmp/probe $m >"$o/probe_plain_$m.txt" 2>&1
    compute-sanitizer --tool racecheck /tmp/probe $m >"$o/probe_racecheck_$m.txt" 2>&1
  done
  compute-sanitizer --tool initcheck --kernel-name kns=hand_off /tmp/probe >"$o/probe_initcheck_kns.txt" 2>&1
) &
python3 -m pip install --no-deps --force-reinstall -q dist/hattn-*-cp312-*.whl >/dev/null 2>&1
cat dist/*.whl.commit >>"$o/machine.txt" 2>/dev/null
# PYTEST_K: a -k expression (say, the cache, varlen and FP8 parts alone); -x: the first
# failure's report is written even when the time limit then cuts the run.
HATTN_CONTRACT_CASES=10000 HATTN_CONTRACT_BWD_CASES=2000 timeout "${LIMIT:-400}" \
  python3 -m pytest -q -x -p no:cacheprovider python/tests/test_contract.py ${PYTEST_K:+-k "$PYTEST_K"} \
  >"$o/contract.log" 2>&1
echo "contract rc=$?" >>"$o/contract.log"
wait
tail -n 3 "$o"/probe_* "$o/contract.log"
