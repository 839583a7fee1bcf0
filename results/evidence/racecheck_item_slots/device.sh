#!/usr/bin/env bash
# The device calls of this folder (repository root, on the GPU machine):
#   device.sh OUT          the long randomized contract alone (the package from dist/'s wheel;
#                          LIMIT seconds, PYTEST_K a -k expression); with PROBE=1, then the probe
#                          in its three modes under racecheck, and initcheck limited to its
#                          kernel by name. (Beside a sanitizer the contract shares the GPU with
#                          its instrumented kernels: on an H100 it ran about 10 cases a second.)
#   device.sh branch OUT   racecheck over the varlen test that runs the dynamic work list's
#                          kernels (Varlen.WorkOrderIsAStableSortByCost: D 128 and 256, causal
#                          and not) with main's binaries and with the branch's
#                          (.prebuilt/build-gpu.tar.xz, .prebuilt/item_slot_arrivals.tar.xz), at
#                          once; then the branch as a trial: its varlen and dispatch tests, and
#                          hattn-bench on varlen batches in the order main, trial, trial, main
#   device.sh sanitize OUT the quick contract (24 forward cases, as gpu_run.sh's sanitize
#                          contract:24) under memcheck, racecheck, synccheck and initcheck, the
#                          four at once (dist/'s wheel installed; LIMIT seconds each); initcheck's
#                          log kept as its first 20 KB and last 40 lines
# INSTALLED=1: the wheel is installed already (two modes run one after the other need not
# install it twice).
set -uo pipefail
install_wheel() {
  [ -n "${INSTALLED:-}" ] || python3 -m pip install --no-deps --force-reinstall -q dist/hattn-*-cp312-*.whl >/dev/null 2>&1
}
if [ "$1" = sanitize ]; then
  o=$2
  mkdir -p "$o"
  install_wheel
  for tool in memcheck racecheck synccheck initcheck; do
    HATTN_CONTRACT_CASES=24 HATTN_CONTRACT_BWD_CASES=6 timeout "${LIMIT:-300}" \
      compute-sanitizer --tool $tool --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
      python/tests/test_contract.py >"/tmp/sanitize_$tool.log" 2>&1 &
  done
  wait
  for tool in memcheck racecheck synccheck; do cp "/tmp/sanitize_$tool.log" "$o/"; done
  { head -c 20000 /tmp/sanitize_initcheck.log; echo; echo "[... cut ...]"; tail -n 40 /tmp/sanitize_initcheck.log; } \
    >"$o/sanitize_initcheck_excerpt.log"
  { grep -c "Uninitialized" /tmp/sanitize_initcheck.log
    grep -A1 "Uninitialized" /tmp/sanitize_initcheck.log | grep -o "  at .*" | sed 's/+0x.*//' | cut -c1-160 | sort | uniq -c
  } >"$o/initcheck_reports.txt"
  grep -h "passed\|failed\|ERROR SUMMARY\|RACECHECK SUMMARY" /tmp/sanitize_*.log
  exit 0
fi
if [ "$1" = branch ]; then
  o=$2
  mkdir -p "$o"
  for x in build-gpu item_slot_arrivals; do
    mkdir -p "/tmp/rc_$x" && tar xJf ".prebuilt/$x.tar.xz" -C "/tmp/rc_$x" || exit 1
    timeout 300 compute-sanitizer --tool racecheck --error-exitcode 9 "/tmp/rc_$x/hattn_tests" \
      --gtest_filter=Varlen.WorkOrderIsAStableSortByCost >"$o/racecheck_$x.log" 2>&1 &
  done
  wait
  scripts/gpu_run.sh --out "$o/trial" --prebuilt .prebuilt/build-gpu.tar.xz --no-sass \
    trial .prebuilt/item_slot_arrivals.tar.xz --test 'Varlen.*:Dispatch.*' \
    --varlen mixed --kernels fwd_sm90 --no-gemm --dims 64,128,256 --seqlens 1024,4096 >"$o/trial.txt" 2>&1
  tail -n 4 "$o"/racecheck_*.log "$o/trial.txt"
  tar czf "$o/trial.tgz" -C "$o" trial && rm -rf "$o/trial"
  exit 0
fi
o=$1
mkdir -p "$o"
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv >"$o/machine.txt" 2>&1
install_wheel
cat dist/*.whl.commit >>"$o/machine.txt" 2>/dev/null
# PYTEST_K: a -k expression (say, the cache, varlen and FP8 parts alone); -x: the first
# failure's report is written even when the time limit then cuts the run.
start=$(date +%s)
HATTN_CONTRACT_CASES=10000 HATTN_CONTRACT_BWD_CASES=2000 timeout "${LIMIT:-400}" \
  python3 -m pytest -q -x -p no:cacheprovider python/tests/test_contract.py ${PYTEST_K:+-k "$PYTEST_K"} \
  >"$o/contract.log" 2>&1
echo "contract rc=$? after $(($(date +%s) - start)) s" >>"$o/contract.log"
if [ -n "${PROBE:-}" ]; then
  compute-sanitizer --version >"$o/probe_sanitizer_options.txt" 2>&1
  compute-sanitizer --help 2>&1 | grep -iA3 "kernel-name\|kernel-regex" >>"$o/probe_sanitizer_options.txt"
  nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -lineinfo -Isrc -std=c++20 \
    results/evidence/racecheck_item_slots/probe.cu -o /tmp/probe || exit 1
  for m in warp every racy; do
    /tmp/probe $m >"$o/probe_plain_$m.txt" 2>&1
    compute-sanitizer --tool racecheck /tmp/probe $m >"$o/probe_racecheck_$m.txt" 2>&1
  done
  compute-sanitizer --tool initcheck --kernel-name kns=hand_off /tmp/probe >"$o/probe_initcheck_kns.txt" 2>&1
  tail -n 3 "$o"/probe_*
fi
tail -n 3 "$o/contract.log"
