#!/usr/bin/env bash
# The main job: build, run the GPU tests and benchmark the lineage, in one go.
#
#   scripts/gpu_run.sh [OUT_DIR]
#
# Full logs go to OUT_DIR (default: $OUT when set, else build/gpu_run); a compact summary is
# printed last. Without a Hopper GPU it builds, says so, and stops.
#
# Environment knobs:
#   BENCH_ARGS       extra hattn-bench flags (default when unset: --settle 0.5, the full grid,
#                    all kernels, as results/lineage.csv was timed; set it empty for burst figures)
#   BENCH2_ARGS, BENCH3_ARGS
#                    when set, more hattn-bench runs with these flags (bench2.csv, bench3.csv):
#                    e.g. the same kernel with split-KV on and off
#   AB_ARGS          when set: hattn-bench with these flags, which name two kernels
#                    (--kernels A,B), then again with the two swapped (ab.csv, ba.csv): an A/B
#                    in both orders, e.g. AB_ARGS='--backward --kernels X,Y --dims 256 --no-gemm'
#   NCU_ARGS         when set: ncu's duration, tensor-pipe share, L2 hit rate and reduction
#                    sectors, and the warps' barrier and long-scoreboard stall shares, of every
#                    kernel of one hattn-bench call with these flags and --reps 1 (ncu.txt)
#   GTEST_FILTER     restrict the GPU tests (default: all; GoogleTest patterns: only * and ?)
#   BACKWARD_BENCH_ARGS
#                    extra flags for the backward lineage's hattn-bench run (after the forward's)
#   SKIP_TESTS=1     skip the GoogleTest run      SKIP_BENCH=1   skip both benchmarks
#   SKIP_SASS=1      skip the disassembly summary (2+ minutes of CPU, run beside the GPU tests)
#   SANITIZE=1       compute-sanitizer memcheck + racecheck on a few small cases
#   SANITIZE_FILTER  gtest filter for those cases (default: shapes 4, 7 and 12, every kernel)
#   SANITIZE_SHAPES  KERNEL:I,J,...: instead, backward kernel KERNEL on the backward suite's dense
#                    shapes I, J, ... (0-based, in the test list's order; their test indices
#                    shift as kernels and shapes are added), e.g. bwd_13_producer:1,2,7,12
#   PYTHON=1         also build the Python package (or install dist/'s wheel for this Python,
#                    from scripts/build_wheel.sh) and run its tests and benchmark
#   PYTEST_ARGS      with PYTHON=1: what pytest runs (default: python/tests; e.g.
#                    "python/tests/test_backward.py python/tests/test_bench.py -k backward")
#   PY_BENCH_ARGS    flags for python -m hattn.bench
#   PY_VARLEN        equal|mixed: also python -m hattn.bench --varlen MODE (flags: PY_VARLEN_ARGS)
#   PY_BACKWARD_ARGS when set (may be empty): also python -m hattn.bench_backward with these flags
#   PY_BACKWARD2_ARGS, PY_BACKWARD3_ARGS
#                    when set: a second and a third python -m hattn.bench_backward run (e.g. one
#                    with --gqa 4, one with --varlen mixed; each writes its own CSV)
#   PY_KERNEL_TIMES_ARGS
#                    when set (may be empty): also python -m hattn.kernel_times with these flags
#                    (each GPU kernel of one backward call: hattn's and SDPA's)
#   HATTN_FA3_LIB    with PYTHON=1: a FlashAttention-3 library for the benchmarks' FA3 columns
#                    (default: .anchors/flash_attn_3_sm90.so.xz unpacked, when present)
#   PY_FP8_ARGS      when set (may be empty): also python -m hattn.bench_fp8 with these flags
#   CAPSTONE=1       with PYTHON=1: also python -m hattn.capstone (Wan 2.1 1.3B at 480p, 14B at
#                    720p; CAPSTONE_SPECS="MODEL SIZE REPS;..." for others). With PYTHON=1, diffusers is installed from .whl/ when that exists
#                    (scripts/fetch_wheels.sh), before the Python tests.
#   HATTN_COMMIT     commit recorded in the results (default: the PREBUILT archive's commit, else
#                    git rev-parse HEAD; a copied working tree's .git may lag behind its files)
#   PREBUILT         an archive from scripts/prebuild.sh: its binaries (and build log) instead of
#                    building here, which saves the GPU machine's build time
#   TEST_TIMEOUT     seconds before a hung GPU test, sanitizer or pytest run is killed (default 1200)
#   PACK=1           at the end, pack OUT_DIR into OUT_DIR.tgz and remove it (one file to
#                    bring back from a remote machine instead of many)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=${1:-${OUT:-build/gpu_run}}
mkdir -p "$out"
commit_given=${HATTN_COMMIT:-}
export HATTN_COMMIT=${HATTN_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
jobs=$(nproc 2>/dev/null || echo 2)
summary=()
note() { summary+=("$*"); echo "== $*"; }

# GoogleTest filters know only * and ?: a bracket class would match nothing, silently, after
# the device time is spent. Refuse it before anything runs.
for name in GTEST_FILTER SANITIZE_FILTER; do
  if [[ "${!name:-}" == *[\[\]]* ]]; then
    echo "$name: GoogleTest filters have only * and ? (no [...] classes): ${!name}"
    exit 2
  fi
done

# --- machine --------------------------------------------------------------------------------
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,driver_version --format=csv 2>&1; nvcc --version | tail -1; } |
  tee "$out/machine.txt"

# --- build (ptxas report kept for registers and spills) --------------------------------------
build="build-gpu"
if [ -n "${PREBUILT:-}" ]; then
  # Binaries built elsewhere (scripts/prebuild.sh): unpacked, not rebuilt.
  if ! { mkdir -p "$build" && tar xJf "$PREBUILT" -C "$build"; }; then
    echo "PREBUILT: cannot unpack $PREBUILT"
    exit 1
  fi
  cp "$build/prebuild.log" "$out/build.log"
  # The binaries' own commit, unless the caller named one.
  [ -n "$commit_given" ] || HATTN_COMMIT=$(cat "$build/prebuild_commit.txt")
  note "prebuilt binaries of $(cat "$build/prebuild_commit.txt") ($(grep -c 'registers' "$out/build.log") ptxas reports in build.log)"
else
  rm -f "$build"/prebuild_*.txt  # an earlier PREBUILT run's, which would describe another build
  if ! { cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DHATTN_PTXAS_VERBOSE=ON >"$out/build.log" 2>&1 &&
    cmake --build "$build" -j "$jobs" >>"$out/build.log" 2>&1; }; then
    tail -40 "$out/build.log"
    echo "BUILD FAILED (log: $out/build.log)"
    exit 1
  fi
  note "build ok ($(grep -c 'registers' "$out/build.log") ptxas reports in build.log)"
fi
# Register/spill report per kernel: the function name line followed by its usage lines.
grep -E "Compiling entry function|registers|spill" "$out/build.log" >"$out/ptxas.txt" || true
# Spills against tools/spill_budget.txt, as scripts/test.sh checks them on a CPU machine (the
# same nvcc version: the one CMake recorded for this build).
nvcc_version=$(cat "$build"/prebuild_nvcc.txt 2>/dev/null ||
  grep -ho 'CMAKE_CUDA_COMPILER_VERSION "[0-9.]*"' "$build"/CMakeFiles/*/CMakeCUDACompiler.cmake |
  head -1 | grep -o '[0-9][0-9.]*' || true)
python3 tools/check_spills.py "$out/build.log" --nvcc "${nvcc_version:-unknown}" >"$out/spills.txt" 2>&1
note "spill check: rc=$? ($(tail -1 "$out/spills.txt"))"

if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "No NVIDIA GPU here: built everything; GPU tests and the benchmark need an H100/H200 (sm_90)."
  exit 0
fi

# --- disassembly: which MMA instructions each kernel uses, and no local memory -------------
# It takes a couple of minutes of CPU, so it runs beside the tests and sanitizers; the timed
# runs below wait for it first (sass_wait), so that it does not share the host with them.
sass_pid=
if [ "${SKIP_SASS:-0}" != 1 ] && command -v cuobjdump >/dev/null; then
  (
    sass_of="$build/libhattn.a"
    [ -f "$sass_of" ] || sass_of="$build/hattn_tests"  # prebuilt: the test binary holds every kernel
    cuobjdump --dump-sass "$sass_of" >"$out/sass.txt" 2>&1 || true
    python3 - "$out/sass.txt" >"$out/sass_summary.txt" <<'PY'
import re, sys, collections
counts = collections.OrderedDict(); fn = None
for line in open(sys.argv[1], errors="replace"):
    m = re.search(r"Function : (\S+)", line)
    if m: fn = m.group(1); counts[fn] = collections.Counter(); continue
    if fn:
        for op in ("HGMMA", "QGMMA", "HMMA", "LDSM", "LDGSTS", "UTMALDG", "FFMA", "LDL", "STL", "SYNCS"):
            if re.search(r"\b%s\b" % op, line): counts[fn][op] += 1
for fn, c in counts.items():
    print(f"{fn[:90]:90s} " + " ".join(f"{k}={v}" for k, v in sorted(c.items())))
PY
  ) &
  sass_pid=$!
fi
sass_wait() {
  [ -n "$sass_pid" ] || return 0
  wait "$sass_pid"
  sass_pid=
  note "sass: $(wc -l <"$out/sass_summary.txt") kernels summarized in sass_summary.txt"
}

# --- GPU tests -------------------------------------------------------------------------------
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-1200}" "$build/hattn_tests" --gtest_filter="${GTEST_FILTER:-*}" --gtest_brief=1 >"$out/tests.log" 2>&1
  rc=$?
  tail -5 "$out/tests.log"
  grep -E "^\[  FAILED  \]" "$out/tests.log" | head -20
  note "gtest: rc=$rc, $(grep -Eo '[0-9]+ tests?, listed below' "$out/tests.log" | head -1 || true) $(grep -E '^\[  PASSED  \]' "$out/tests.log")"
fi

# --- sanitizers on small shapes ----------------------------------------------------------------
if [ "${SANITIZE:-0}" = 1 ]; then
  filter=${SANITIZE_FILTER:-'AllKernels/KernelTest.MatchesFp64Reference/*_4_*:*MatchesFp64Reference/*_7_*:*MatchesFp64Reference/*_12_*'}
  if [ -n "${SANITIZE_SHAPES:-}" ]; then
    kernel=${SANITIZE_SHAPES%%:*}
    mapfile -t names < <("$build/hattn_tests" --gtest_list_tests \
      --gtest_filter="Shapes/BackwardTest.MatchesFp64Reference/${kernel}_*" | grep -Eo "MatchesFp64Reference/${kernel}_[0-9]+")
    IFS=, read -ra picks <<<"${SANITIZE_SHAPES#*:}"
    filter=""
    for i in "${picks[@]}"; do
      [ -n "${names[$i]:-}" ] && filter+="${filter:+:}Shapes/BackwardTest.${names[$i]}"
    done
    note "SANITIZE_SHAPES $SANITIZE_SHAPES: ${filter:-no such kernel or shapes}"
  fi
  for tool in memcheck racecheck; do
    timeout "${TEST_TIMEOUT:-1200}" compute-sanitizer --tool $tool --error-exitcode 9 "$build/hattn_tests" \
      --gtest_filter="$filter" >"$out/sanitizer_$tool.log" 2>&1
    note "compute-sanitizer $tool: rc=$? ($(grep -Eo 'ERROR SUMMARY: [0-9]+ errors?|RACECHECK SUMMARY: [0-9]+ hazards? displayed' "$out/sanitizer_$tool.log" | tail -1))"
  done
fi

# --- benchmark ---------------------------------------------------------------------------------
sass_wait
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  # Each point after 0.5 s of untimed calls: sustained figures, as the committed lineage
  # (results/evidence/clock_carryover/ says why the default 20 calls read high).
  # shellcheck disable=SC2086
  "$build/hattn-bench" --csv "$out/bench.csv" ${BENCH_ARGS---settle 0.5} 2>&1 | tee "$out/bench.log"
  note "bench: rc=${PIPESTATUS[0]} -> $out/bench.csv"
  # The backward lineage from B02 (B01, on CUDA cores, takes minutes a shape): every backward
  # kernel the binary registers, from its --list, so that a new step is timed without an edit here.
  backward_kernels=$("$build/hattn-bench" --list | sed -n '/^backward kernels/,$p' |
    grep -Eo '^  bwd_[0-9a-z_]+' | grep -v 'bwd_01_' | tr -d ' ' | paste -sd, -)
  # shellcheck disable=SC2086
  "$build/hattn-bench" --backward --kernels "$backward_kernels" --dims 64,128,256 \
    --seqlens 1024,4096,16384 --no-gemm --csv "$out/bench_backward.csv" ${BACKWARD_BENCH_ARGS:-} 2>&1 |
    tee "$out/bench_backward.log"
  note "backward bench: rc=${PIPESTATUS[0]} -> $out/bench_backward.csv"
fi
if [ -n "${AB_ARGS:-}" ]; then
  ab_kernels=$(printf '%s\n' "$AB_ARGS" | sed -n 's/.*--kernels[ =]\([^ ]*\).*/\1/p')
  ba_kernels=$(printf '%s\n' "$ab_kernels" | tr ',' '\n' | tac | paste -sd, -)
  for order in ab ba; do
    args=$AB_ARGS
    [ "$order" = ba ] && args=${AB_ARGS/--kernels $ab_kernels/--kernels $ba_kernels}
    # shellcheck disable=SC2086
    "$build/hattn-bench" --csv "$out/$order.csv" $args >"$out/$order.log" 2>&1
    note "A/B ($order): rc=$? -> $out/$order.csv"
    sed -n '/^# TFLOP\/s/,$p' "$out/$order.log"
  done
fi
if [ -n "${NCU_ARGS:-}" ]; then
  metrics=gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed
  metrics+=,lts__t_sector_hit_rate.pct,lts__t_sectors_srcunit_tex_op_red.sum
  metrics+=,smsp__warp_issue_stalled_barrier_per_warp_active.pct
  metrics+=,smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct
  # shellcheck disable=SC2086
  ncu --metrics "$metrics" "$build/hattn-bench" $NCU_ARGS --reps 1 >"$out/ncu.txt" 2>&1
  note "ncu: rc=$? -> $out/ncu.txt"
  grep -E "^  [a-z_ ]*[(<]|^  void|duration|tensor_op" "$out/ncu.txt" | head -40
fi
for n in 2 3; do
  args_var="BENCH${n}_ARGS"
  [ -n "${!args_var:-}" ] || continue
  # shellcheck disable=SC2086
  "$build/hattn-bench" --csv "$out/bench$n.csv" ${!args_var} >"$out/bench$n.log" 2>&1
  note "bench $n: rc=$? -> $out/bench$n.csv"
  sed -n '/^# TFLOP\/s/,$p' "$out/bench$n.log"
done

# --- Python package ------------------------------------------------------------------------------
if [ "${PYTHON:-0}" = 1 ]; then
  # A wheel built elsewhere for this Python (scripts/build_wheel.sh, dist/ carried) installs
  # without compiling; else the package is built here, with the lineage (its tests and
  # benchmarks cover every step).
  py_tag=$(python3 -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  wheel=$(ls -t dist/hattn-*-"$py_tag"-*.whl 2>/dev/null | head -1 || true)
  if [ -n "$wheel" ]; then
    python3 -m pip install --no-deps --force-reinstall -q "$wheel" >"$out/pip.log" 2>&1
    rc=$?
    note "pip install $wheel (built at $(cat "$wheel.commit" 2>/dev/null || echo unknown)): rc=$rc"
  else
    python3 -m pip install --no-build-isolation --no-deps -q --config-settings=cmake.define.HATTN_LINEAGE=ON . \
      >"$out/pip.log" 2>&1
    note "pip install: rc=$?"
  fi
  # FlashAttention-3, timed beside hattn by the Python benchmarks when given: HATTN_FA3_LIB, else
  # the library unpacked from .anchors/ (copied there from ../shared/anchors/fa3/, whose README
  # says how; git-ignored). A measuring stick only: nothing builds or tests against it.
  if [ -z "${HATTN_FA3_LIB:-}" ] && [ -f .anchors/flash_attn_3_sm90.so.xz ]; then
    xz -dkf .anchors/flash_attn_3_sm90.so.xz && export HATTN_FA3_LIB=$PWD/.anchors/flash_attn_3_sm90.so
  fi
  note "FlashAttention-3 for the benchmarks: ${HATTN_FA3_LIB:-not given}"
  if [ -d .whl ]; then  # diffusers for the capstone and its tests, carried as wheels (scripts/fetch_wheels.sh)
    python3 -m pip install --no-index --find-links .whl -q 'diffusers==0.42.1' >"$out/pip_diffusers.log" 2>&1
    note "pip install diffusers from .whl: rc=$?"
  fi
  # shellcheck disable=SC2086
  timeout "${TEST_TIMEOUT:-1200}" python3 -m pytest -q ${PYTEST_ARGS:-python/tests} >"$out/pytest.log" 2>&1
  note "pytest: rc=$? $(tail -1 "$out/pytest.log")"
  if [ -n "${PY_BENCH_ARGS+x}" ]; then
    # shellcheck disable=SC2086
    PYTHONUNBUFFERED=1 python3 -m hattn.bench --out "$out" ${PY_BENCH_ARGS} 2>&1 | tee "$out/py_bench.log"
    note "python bench: rc=${PIPESTATUS[0]}"
  fi
  if [ -n "${PY_VARLEN:-}" ]; then
    # shellcheck disable=SC2086
    PYTHONUNBUFFERED=1 python3 -m hattn.bench --varlen "$PY_VARLEN" --out "$out" ${PY_VARLEN_ARGS:-} 2>&1 |
      tee "$out/py_bench_varlen_$PY_VARLEN.log"
    note "python varlen bench ($PY_VARLEN): rc=${PIPESTATUS[0]}"
  fi
  for n in "" 2 3; do
    var="PY_BACKWARD${n}_ARGS"
    [ -n "${!var+x}" ] || continue
    # shellcheck disable=SC2086  # the flags are words
    PYTHONUNBUFFERED=1 python3 -m hattn.bench_backward --out "$out" ${!var} 2>&1 |
      tee "$out/py_bench_backward$n.log"
    note "python backward bench${n:+ $n} (${!var}): rc=${PIPESTATUS[0]}"
  done
  if [ -n "${PY_FP8_ARGS+x}" ]; then
    # shellcheck disable=SC2086
    PYTHONUNBUFFERED=1 python3 -m hattn.bench_fp8 --out "$out" ${PY_FP8_ARGS} 2>&1 | tee "$out/py_bench_fp8.log"
    note "python FP8 bench: rc=${PIPESTATUS[0]}"
  fi
  if [ -n "${PY_KERNEL_TIMES_ARGS+x}" ]; then
    # shellcheck disable=SC2086
    PYTHONUNBUFFERED=1 python3 -m hattn.kernel_times --out "$out" ${PY_KERNEL_TIMES_ARGS} 2>&1 |
      tee "$out/kernel_times.log"
    note "python kernel times: rc=${PIPESTATUS[0]}"
  fi
  if [ "${CAPSTONE:-0}" = 1 ]; then
    IFS=';' read -ra specs <<<"${CAPSTONE_SPECS:-wan2.1-1.3b 480p 5;wan2.1-14b 720p 3}"
    for spec in "${specs[@]}"; do
      # shellcheck disable=SC2086  # the spec's words are the arguments
      set -- $spec
      python3 -m hattn.capstone --model "$1" --size "$2" --reps "$3" --out "$out/capstone_$1_$2" \
        >"$out/capstone_$1_$2.log" 2>&1
      note "capstone $1 $2: rc=$?; hattn's speedup over $(grep -E '^(torch_|fa3)' "$out/capstone_$1_$2.log" |
        awk '{printf "%s %s; ", $1, $3}')"
    done
  fi
fi

echo
echo "================ summary (commit $HATTN_COMMIT) ================"
[ -f "$out/bench.log" ] && sed -n '/^# TFLOP\/s/,$p' "$out/bench.log"
[ -f "$out/bench_backward.log" ] && sed -n '/^# TFLOP\/s/,$p' "$out/bench_backward.log"
printf '%s\n' "${summary[@]}"
if [ "${PACK:-0}" = 1 ]; then  # after the summary, which reads bench.log
  tar czf "${out%/}.tgz" -C "$(dirname "$out")" "$(basename "$out")" && rm -rf "$out" && echo "packed into ${out%/}.tgz"
fi
