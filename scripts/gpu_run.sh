#!/usr/bin/env bash
# The main job on a GPU machine: build, then run steps; a compact summary is printed last and
# full logs go to the output folder. Without a Hopper GPU it builds, says so, and stops.
#
#   scripts/gpu_run.sh [OPTIONS] [STEP [ARGS...]] [+ STEP [ARGS...]]...
#
# With no step it runs `test + bench + bench-backward`: the GPU tests and the lineage's
# benchmark. Steps run in the order given (or at once: --together), separated by a lone `+`;
# each writes NAME.log (and NAME.csv where it times), NAME_2... when a step comes again. A step
# may start with VAR=VALUE words: environment for that step only (a trial's switch), whose
# values join its name (HATTN_TRIAL=on bench ... writes bench_on.log). For example
#
#   scripts/gpu_run.sh test '*Window*' + ab --kernels fwd_sm90,16_coalesced_store --dims 128
#   scripts/gpu_run.sh --prebuilt .prebuilt/build-gpu.tar.xz python + py bench_backward --dims 64
#   scripts/gpu_run.sh bench --dims 128 + HATTN_TRIAL=on bench --dims 128   # a trial's switch, read by its code
#   scripts/gpu_run.sh --together test + HATTN_CONTRACT_CASES=10000 HATTN_CONTRACT_BWD_CASES=2000 \
#     python python/tests/test_contract.py    # the C++ suite beside the long randomized contract
#
# Options (before the first step):
#   --out DIR         the output folder (default: $OUT when set, else build/gpu_run)
#   --prebuilt FILE   binaries from scripts/prebuild.sh instead of building here (saves the GPU
#                     machine's build time); their commit is recorded unless --commit names one
#   --build DIR       the build folder (default build-gpu)
#   --commit SHA      the commit recorded in the results (default: git rev-parse HEAD; a copied
#                     working tree's .git may lag behind its files)
#   --timeout S       seconds before a hung test, sanitizer or pytest run is killed (default 1200)
#   --shards N        run the test and trial steps' hattn_tests as N processes at once on the
#                     one GPU (GoogleTest's sharding; the fp64 references are computed on the
#                     CPU, so the full suite is CPU-bound); the log then joins the N shards' logs.
#                     Default: half the CPU cores, at most 8 (8 shards ran the whole suite in
#                     under 500 s on a 16-core H100 machine: results/evidence/h100_270ac8d/)
#   --no-sass         skip the disassembly summary (a couple of minutes of CPU beside the tests)
#   --together        run the steps at once, each beside the others (the GPU tests' CPU-bound
#                     shards beside pytest runs, say; never timings). A step's output goes to
#                     LABEL.out; the summary keeps the steps' notes in their order
#   --pack            at the end, pack everything in the output folder into gpu_run.tgz there,
#                     beside summary.txt (two files to bring back: the device tool returns 8)
#   --dry-run         print the steps and stop (no build)
#
# Steps:
#   test [FILTER]            the C++ GPU tests (GoogleTest FILTER: only * and ?; default all)
#   bench [FLAGS]            hattn-bench over the forward lineage; FLAGS replace the default
#                            `--settle 0.5` (sustained figures, as results/lineage.csv is timed)
#   bench-backward [FLAGS]   hattn-bench --backward over every backward step from B02 (B01, on
#                            CUDA cores, takes minutes a shape), D 64/128/256, S 1k/4k/16k; FLAGS
#                            are added
#   ab FLAGS                 hattn-bench with FLAGS naming two kernels (--kernels A,B), then again
#                            with the two swapped: an A/B in both orders (NAME_ab.csv, NAME_ba.csv)
#   trial ARCHIVE [--test FILTER] [FLAGS]
#                            a trial's binaries (scripts/prebuild.sh's archive, built at the
#                            trial's commit) beside this run's: with --test, the trial's
#                            hattn_tests FILTER first; then hattn-bench FLAGS from this run's
#                            binaries and the trial's in the order main, trial, trial, main
#                            (NAME_main_1.csv ...), and each point's trial time over main's
#                            (tools/trial_ratio.py: NAME.txt; min, median and max in the summary)
#   trial ARCHIVE --probe [FLAGS]
#                            the same for a timing probe, a build that leaves work out on purpose
#                            (say, a kernel without its dQ reductions): no tests, its failed
#                            checks expected, its times compared to main's anyway
#   ncu FLAGS                ncu's duration, tensor-pipe share, L2 hit rate, reduction sectors and
#                            barrier/long-scoreboard stalls of every kernel of one hattn-bench call
#   ncu-fa3 FLAGS            ncu's sections (speed of light, pipes, warp states, scheduler, memory)
#                            over one forward (--backward: backward) of hattn and one of
#                            FlashAttention-3 on the same tensors (tools/ncu_vs_fa3.py FLAGS:
#                            --dim, --seqlen, --causal, --backward); the
#                            report, its raw metrics (NAME.csv), each kernel's SASS with its stall
#                            samples (NAME_sass.csv) and tools/ncu_summary.py's table
#   sanitize [FILTER | KERNEL:I,J,... | contract:N]
#                            compute-sanitizer memcheck, racecheck, synccheck and initcheck over a
#                            few GPU tests (default: shapes 4, 7 and 12 of every forward kernel);
#                            KERNEL:I,J picks the backward suite's dense shapes I, J (0-based) of
#                            backward kernel KERNEL; contract:N runs the Python package's
#                            randomized contract test instead, N forward and N/4 backward cases
#                            (initcheck then reports torch's reads of outputs that every element
#                            of was written: results/evidence/sanitize_contract_270ac8d/)
#   python [PYTEST ARGS]     install the Python package (dist/'s wheel for this Python when
#                            present, from scripts/build_wheel.sh; else built here with the
#                            lineage), then pytest (default: python/tests)
#   py MODULE [FLAGS]        python -m hattn.MODULE --out OUT/NAME FLAGS: bench, bench_backward,
#                            bench_fp8, bench_mla, kernel_times (installs the package first if needed)
#   capstone [MODEL SIZE REPS]
#                            python -m hattn.capstone (default: Wan 2.1 1.3B at 480p, 5 reps, and
#                            14B at 720p, 3 reps); diffusers is installed from .whl/ when present
#                            (scripts/fetch_wheels.sh)
#
# The Python steps pass FlashAttention-3 to the benchmarks when HATTN_FA3_LIB names it or
# .anchors/flash_attn_3_sm90.so.xz is there (copied from ../shared/anchors/fa3/; git-ignored):
# a measuring stick only, nothing builds or tests against it.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

# --- arguments ---------------------------------------------------------------------------------
out=${OUT:-build/gpu_run}
build=build-gpu prebuilt='' commit_given='' timeout_s=1200 shards='' sass=1 pack=0 dry_run=0 together=0
while [ $# -gt 0 ]; do
  case $1 in
    --out) out=$2; shift 2 ;;
    --prebuilt) prebuilt=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    --commit) commit_given=$2; shift 2 ;;
    --timeout) timeout_s=$2; shift 2 ;;
    --shards) shards=$2; shift 2 ;;
    --no-sass) sass=0; shift ;;
    --pack) pack=1; shift ;;
    --together) together=1; shift ;;
    --dry-run) dry_run=1; shift ;;
    -h | --help) usage; exit 0 ;;
    -*) echo "gpu_run.sh: unknown option $1 (see --help)"; exit 2 ;;
    *) break ;;
  esac
done
if [ -z "$shards" ]; then
  shards=$(($(nproc 2>/dev/null || echo 2) / 2))
  [ "$shards" -ge 1 ] || shards=1
  [ "$shards" -le 8 ] || shards=8
fi
[[ $shards =~ ^[1-9][0-9]*$ ]] || { echo "gpu_run.sh: --shards takes a count of processes, 1 or more (got: $shards)"; exit 2; }
[ $# -gt 0 ] || set -- test + bench + bench-backward

# Each step is stored as its words joined by the unit separator.
steps=() words=()
flush_step() {
  [ ${#words[@]} -gt 0 ] || { echo "gpu_run.sh: an empty step (two '+' in a row, or one at an end)"; exit 2; }
  local IFS=$'\x1f'
  steps+=("${words[*]}")
  words=()
}
for word in "$@"; do
  if [ "$word" = + ]; then flush_step; else words+=("$word"); fi
done
flush_step

# A step's leading VAR=VALUE words into step_env, the rest into w.
split_env() {  # STEP
  IFS=$'\x1f' read -ra w <<<"$1"
  step_env=()
  while [ ${#w[@]} -gt 0 ] && [[ ${w[0]} =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; do
    step_env+=("${w[0]}")
    w=("${w[@]:1}")
  done
  [ ${#w[@]} -gt 0 ] || { echo "gpu_run.sh: a step of only VAR=VALUE words (${step_env[*]})"; exit 2; }
}

# Every step's arguments are checked before anything is built or run: a mistake found after the
# build would cost the GPU machine's time.
declare -A seen=()
labels=()
for step in "${steps[@]}"; do
  split_env "$step"
  name=${w[0]} args=("${w[@]:1}")
  case $name in
    test | sanitize)
      if [[ "${args[*]:-}" == *[\[\]]* ]]; then
        echo "gpu_run.sh $name: GoogleTest filters have only * and ? (no [...] classes): ${args[*]}"
        exit 2
      fi
      if [ "$name" = sanitize ] && [[ "${args[0]:-}" == contract* ]] && ! [[ ${args[0]} =~ ^contract:[1-9][0-9]*$ ]]; then
        echo "gpu_run.sh sanitize: contract:N with N a count of cases (got: ${args[0]})"
        exit 2
      fi ;;
    ab)
      if ! [[ " ${args[*]:-} " =~ \ --kernels[\ =][^,\ ]+,[^,\ ]+\  ]]; then
        echo "gpu_run.sh ab: name two kernels with --kernels A,B (got: ${args[*]:-nothing})"
        exit 2
      fi ;;
    ncu) [ ${#args[@]} -gt 0 ] || { echo "gpu_run.sh ncu: give hattn-bench flags for one small call"; exit 2; } ;;
    ncu-fa3)
      [ -f .anchors/flash_attn_3_sm90.so.xz ] || [ -n "${HATTN_FA3_LIB:-}" ] ||
        { echo "gpu_run.sh ncu-fa3: needs FlashAttention-3 (.anchors/flash_attn_3_sm90.so.xz or HATTN_FA3_LIB)"; exit 2; } ;;
    trial)
      if [[ "${args[0]:-}" != *.tar.xz ]] || [ ! -f "${args[0]}" ]; then
        echo "gpu_run.sh trial: ARCHIVE is a prebuilt .tar.xz that is here (got: ${args[0]:-nothing})"
        exit 2
      fi
      if [ "${args[1]:-}" = --test ] && { [ -z "${args[2]:-}" ] || [[ ${args[2]} == *[\[\]]* ]]; }; then
        echo "gpu_run.sh trial: --test FILTER, a GoogleTest filter with only * and ? (got: ${args[2]:-nothing})"
        exit 2
      fi ;;
    py)
      case ${args[0]:-} in
        bench | bench_backward | bench_fp8 | bench_mla | kernel_times) ;;
        *) echo "gpu_run.sh py: MODULE is one of bench, bench_backward, bench_fp8, bench_mla, kernel_times (got: ${args[0]:-nothing})"
          exit 2 ;;
      esac ;;
    capstone)
      [ ${#args[@]} -eq 0 ] || [ ${#args[@]} -eq 3 ] ||
        { echo "gpu_run.sh capstone: MODEL SIZE REPS, or nothing for the two default runs"; exit 2; } ;;
    bench | bench-backward | python) ;;
    *) echo "gpu_run.sh: unknown step '$name' (test, bench, bench-backward, ab, trial, ncu, ncu-fa3, sanitize, python, py, capstone)"
      exit 2 ;;
  esac
  # The step's label names its files: the step (and a py step's module), numbered when repeated.
  label=${name//-/_}
  [ "$name" = py ] && label=py_${args[0]}
  if [ "$name" = trial ]; then label=$(basename "${args[0]}" .tar.xz) && label=trial_${label//[^A-Za-z0-9]/_}; fi
  for assignment in "${step_env[@]}"; do
    value=${assignment#*=}
    label+=_${value//[^A-Za-z0-9]/_}
  done
  seen[$label]=$((${seen[$label]:-0} + 1))
  [ "${seen[$label]}" -gt 1 ] && label+="_${seen[$label]}"
  labels+=("$label")
done

if [ "$dry_run" = 1 ]; then
  echo "output: $out${prebuilt:+; prebuilt: $prebuilt}"
  for i in "${!steps[@]}"; do
    split_env "${steps[$i]}"
    printf '%s:' "${labels[$i]}"
    printf ' %q' "${step_env[@]}" "${w[@]}"
    echo
  done
  exit 0
fi

mkdir -p "$out"
export HATTN_COMMIT=${commit_given:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
jobs=$(nproc 2>/dev/null || echo 2)
summary=()
note() { summary+=("$*"); echo "== $*"; }
tables=()  # logs whose "# TFLOP/s" tables the summary repeats

# --- machine --------------------------------------------------------------------------------
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,driver_version --format=csv 2>&1; nvcc --version | tail -1; } |
  tee "$out/machine.txt"

# --- build (ptxas report kept for registers and spills) --------------------------------------
if [ -n "$prebuilt" ]; then
  if ! { mkdir -p "$build" && tar xJf "$prebuilt" -C "$build"; }; then
    echo "--prebuilt: cannot unpack $prebuilt"
    exit 1
  fi
  cp "$build/prebuild.log" "$out/build.log"
  [ -n "$commit_given" ] || HATTN_COMMIT=$(cat "$build/prebuild_commit.txt")
  note "prebuilt binaries of $(cat "$build/prebuild_commit.txt") ($(grep -c 'registers' "$out/build.log") ptxas reports in build.log)"
else
  rm -f "$build"/prebuild_*.txt  # an earlier prebuilt run's, which would describe another build
  if ! { cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DHATTN_PTXAS_VERBOSE=ON >"$out/build.log" 2>&1 &&
    cmake --build "$build" -j "$jobs" >>"$out/build.log" 2>&1; }; then
    tail -40 "$out/build.log"
    echo "BUILD FAILED (log: $out/build.log)"
    exit 1
  fi
  note "build ok ($(grep -c 'registers' "$out/build.log") ptxas reports in build.log)"
fi
# Register/spill report per kernel, and spills against tools/spill_budget.txt as scripts/test.sh
# checks them (with the nvcc version this build recorded).
grep -E "Compiling entry function|registers|spill" "$out/build.log" >"$out/ptxas.txt" || true
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
# A couple of minutes of CPU, so it runs beside the first steps; a timed step waits for it first
# (sass_wait), so that it does not share the host with the timing.
sass_pid=
if [ "$sass" = 1 ] && command -v cuobjdump >/dev/null; then
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

bench_bin="$build/hattn-bench"
tests_bin="$build/hattn_tests"

# --- steps ---------------------------------------------------------------------------------------
# BIN LOG FILTER: hattn_tests, in --shards processes at once when more than one; its exit status.
run_gtests() {
  local bin=$1 log=$2 filter=$3 rc=0 shard pids=()
  if [ "$shards" -le 1 ]; then
    timeout "$timeout_s" "$bin" --gtest_filter="$filter" --gtest_brief=1 >"$log" 2>&1
    return
  fi
  for ((shard = 0; shard < shards; shard++)); do
    GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$shard timeout "$timeout_s" "$bin" \
      --gtest_filter="$filter" --gtest_brief=1 >"$log.$shard" 2>&1 &
    pids+=($!)
  done
  for shard in "${!pids[@]}"; do wait "${pids[$shard]}" || rc=$?; done
  for ((shard = 0; shard < shards; shard++)); do
    echo "=== shard $shard of $shards"
    cat "$log.$shard"
  done >"$log"
  rm -f "$log".[0-9]*
  # One line for the whole run, summed over the shards, as a single process would print it.
  awk '/^\[  PASSED  \] [0-9]+ test/ {p += $4} /^\[  FAILED  \] [0-9]+ test/ {f += $4}
       /^\[  SKIPPED \] [0-9]+ test/ {k += $4} /^\[==========\] [0-9]+ tests? from/ {n += $2}
       END {printf "[==========] %d tests ran in %s shards\n[  PASSED  ] %d tests.\n", n, '"$shards"', p
            if (k) printf "[  SKIPPED ] %d tests.\n", k
            if (f) printf "[  FAILED  ] %d tests, listed below\n", f}' "$log" >>"$log"
  return $rc
}

# LOG: gtest's failed count (when any) and passed count, for a step's note.
gtest_counts() {
  { grep -Eo '^\[  FAILED  \] [0-9]+ tests?, listed below' "$1" | tail -1
    grep -E '^\[  PASSED  \]' "$1" | tail -1; } | paste -sd ' ' -
}

step_test() {  # LABEL [FILTER]
  local log="$out/$1.log" rc=0
  run_gtests "$tests_bin" "$log" "${2:-*}" || rc=$?
  tail -5 "$log"
  grep -E "^\[  FAILED  \]" "$log" | head -20
  note "$1 (${2:-*}): rc=$rc, $(gtest_counts "$log")"
}

step_bench() {  # LABEL [FLAGS]: the defaults when no flags are given
  local label=$1
  shift
  # Each point after 0.5 s of untimed calls: sustained figures, as the committed lineage
  # (results/evidence/clock_carryover/ says why the default 20 calls read high).
  [ $# -gt 0 ] || set -- --settle 0.5
  sass_wait
  "$bench_bin" --csv "$out/$label.csv" "$@" 2>&1 | tee "$out/$label.log"
  note "$label: rc=${PIPESTATUS[0]} -> $out/$label.csv"
  tables+=("$out/$label.log")
}

step_bench_backward() {  # LABEL [FLAGS]: added to the defaults
  local label=$1 kernels
  shift
  # Every backward kernel the binary registers from B02 on, from its --list, so that a new step
  # is timed without an edit here.
  kernels=$("$bench_bin" --list | sed -n '/^backward kernels/,$p' |
    grep -Eo '^  bwd_[0-9a-z_]+' | grep -v 'bwd_01_' | tr -d ' ' | paste -sd, -)
  sass_wait
  "$bench_bin" --backward --kernels "$kernels" --dims 64,128,256 --seqlens 1024,4096,16384 --no-gemm \
    --csv "$out/$label.csv" "$@" 2>&1 | tee "$out/$label.log"
  note "$label: rc=${PIPESTATUS[0]} -> $out/$label.csv"
  tables+=("$out/$label.log")
}

step_ab() {  # LABEL FLAGS (with --kernels A,B)
  local label=$1 order swapped=()
  shift
  sass_wait
  for order in ab ba; do
    if [ "$order" = ba ]; then  # the same flags, the two kernels' order reversed
      swapped=()
      local prev=
      for word in "$@"; do
        if [ "$prev" = --kernels ]; then word=${word#*,},${word%%,*}; fi
        [[ $word == --kernels=* ]] && { word=${word#--kernels=}; word=--kernels=${word#*,},${word%%,*}; }
        swapped+=("$word")
        prev=$word
      done
      set -- "${swapped[@]}"
    fi
    "$bench_bin" --csv "$out/${label}_$order.csv" "$@" >"$out/${label}_$order.log" 2>&1
    note "$label ($order): rc=$? -> $out/${label}_$order.csv"
    sed -n '/^# TFLOP\/s/,$p' "$out/${label}_$order.log"
  done
}

step_trial() {  # LABEL ARCHIVE [--test FILTER | --probe] [FLAGS]
  local label=$1 archive=$2 dir="$build-$1" who rc
  shift 2
  if ! { rm -rf "$dir" && mkdir -p "$dir" && tar xJf "$archive" -C "$dir"; }; then
    note "$label: cannot unpack $archive"
    return
  fi
  note "$label: the trial's binaries, built at $(cat "$dir/prebuild_commit.txt" 2>/dev/null || echo unknown)"
  local probe=()
  if [ "${1:-}" = --probe ]; then
    probe=(--probe)
    shift
  elif [ "${1:-}" = --test ]; then
    rc=0
    run_gtests "$dir/hattn_tests" "$out/${label}_test.log" "$2" || rc=$?
    grep -E "^\[  FAILED  \]" "$out/${label}_test.log" | head -20
    note "$label test ($2): rc=$rc, $(gtest_counts "$out/${label}_test.log")"
    shift 2
  fi
  sass_wait
  # Main, trial, trial, main: a drift over the calls (the clock, the heat) weighs on both alike.
  for who in main_1 trial_1 trial_2 main_2; do
    local bin="$bench_bin"
    [[ $who == trial* ]] && bin="$dir/hattn-bench"
    timeout "$timeout_s" "$bin" --csv "$out/${label}_$who.csv" "$@" >"$out/${label}_$who.log" 2>&1
    rc=$?
    [ "$rc" = 0 ] || note "$label $who: rc=$rc (log ${label}_$who.log)"
  done
  python3 tools/trial_ratio.py "${probe[@]}" --main "$out/${label}"_main_?.csv --trial "$out/${label}"_trial_?.csv \
    >"$out/$label.txt" 2>&1
  cat "$out/$label.txt"
  note "$label ($*): $(tail -1 "$out/$label.txt") -> $out/$label.txt"
}

step_ncu() {  # LABEL FLAGS
  local label=$1 metrics
  shift
  sass_wait
  metrics=gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed
  metrics+=,lts__t_sector_hit_rate.pct,lts__t_sectors_srcunit_tex_op_red.sum
  metrics+=,smsp__warp_issue_stalled_barrier_per_warp_active.pct
  metrics+=,smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct
  ncu --metrics "$metrics" "$bench_bin" "$@" --reps 1 >"$out/$label.txt" 2>&1
  note "$label: rc=$? -> $out/$label.txt"
  grep -E "^  [a-z_ ]*[(<]|^  void|duration|tensor_op" "$out/$label.txt" | head -40
}

step_ncu_fa3() {  # LABEL FLAGS
  local label=$1 sections=() section
  shift
  ensure_python
  sass_wait
  for section in SpeedOfLight ComputeWorkloadAnalysis WarpStateStats SchedulerStats \
    MemoryWorkloadAnalysis InstructionStats LaunchStats Occupancy SourceCounters; do
    sections+=(--section "$section")
  done
  # Clocks locked to base (ncu's default): both libraries are seen at the same clock.
  timeout "$timeout_s" ncu --profile-from-start off "${sections[@]}" -f -o "$out/$label" \
    python3 tools/ncu_vs_fa3.py "$@" >"$out/$label.log" 2>&1
  note "$label ($*): rc=$? -> $out/$label.ncu-rep"
  ncu -i "$out/$label.ncu-rep" --page raw --csv >"$out/$label.csv" 2>>"$out/$label.log"
  ncu -i "$out/$label.ncu-rep" --page details >"$out/$label.txt" 2>>"$out/$label.log"
  # Each kernel's SASS with its warp-state samples: where its warps wait.
  ncu -i "$out/$label.ncu-rep" --page source --print-source sass --csv >"$out/${label}_sass.csv" 2>>"$out/$label.log" ||
    note "$label: ncu --page source failed (see $label.log)"
  grep -E "TFLOP/s|max \|" "$out/$label.log"
  python3 tools/ncu_summary.py "$out/$label.csv" | tee "$out/${label}_summary.txt"
}

step_sanitize() {  # LABEL [FILTER | KERNEL:I,J,...]
  local label=$1 filter=${2:-'AllKernels/KernelTest.MatchesFp64Reference/*_4_*:*MatchesFp64Reference/*_7_*:*MatchesFp64Reference/*_12_*'}
  if [[ $filter != contract:* && $filter =~ ^[a-z0-9_]+:[0-9,]+$ ]]; then
    # Backward kernel KERNEL on the backward suite's dense shapes I, J, ... (their test indices
    # shift as kernels and shapes are added, so they are looked up in the binary's list).
    local kernel=${filter%%:*} names picks i
    mapfile -t names < <("$tests_bin" --gtest_list_tests \
      --gtest_filter="Shapes/BackwardTest.MatchesFp64Reference/${kernel}_*" | grep -Eo "MatchesFp64Reference/${kernel}_[0-9]+")
    IFS=, read -ra picks <<<"${filter#*:}"
    filter=""
    for i in "${picks[@]}"; do
      [ -n "${names[$i]:-}" ] && filter+="${filter:+:}Shapes/BackwardTest.${names[$i]}"
    done
    note "$label ${2}: ${filter:-no such kernel or shapes}"
    [ -n "$filter" ] || return
  fi
  local tool target=("$tests_bin" --gtest_filter="$filter")
  if [[ $filter == contract:* ]]; then  # the randomized cases, through the Python package
    ensure_python
    export HATTN_CONTRACT_CASES=${filter#contract:} HATTN_CONTRACT_BWD_CASES=$(((${filter#contract:} + 3) / 4))
    target=(python3 -m pytest -q python/tests/test_contract.py)
  fi
  for tool in memcheck racecheck synccheck initcheck; do
    timeout "$timeout_s" compute-sanitizer --tool $tool --error-exitcode 9 "${target[@]}" \
      >"$out/${label}_$tool.log" 2>&1
    note "$label $tool: rc=$? ($(grep -Eo 'ERROR SUMMARY: [0-9]+ errors?|RACECHECK SUMMARY: [0-9]+ hazards? displayed' "$out/${label}_$tool.log" | tail -1))"
  done
}

python_ready=0
ensure_python() {
  [ "$python_ready" = 0 ] || return 0
  python_ready=1
  # A wheel built elsewhere for this Python (scripts/build_wheel.sh, dist/ carried) installs
  # without compiling; else the package is built here, with the lineage (its tests and
  # benchmarks cover every step), in the C++ build's tree when there is one, so that only the
  # binding compiles.
  local py_tag wheel settings=(--config-settings=cmake.define.HATTN_LINEAGE=ON)
  py_tag=$(python3 -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  # shellcheck disable=SC2012  # the newest wheel; the names have no odd characters
  wheel=$(ls -t dist/hattn-*-"$py_tag"-*.whl 2>/dev/null | head -1 || true)
  if [ -n "$wheel" ]; then
    python3 -m pip install --no-deps --force-reinstall -q "$wheel" >"$out/pip.log" 2>&1
    local rc=$? built
    built=$(cat "$wheel.commit" 2>/dev/null || echo unknown)
    note "pip install $wheel (built at $built): rc=$rc"
    # The package's Python comes from the wheel, the tests from the tree: say when they differ.
    # The same commit when one hash begins the other (--commit takes an abbreviated one).
    local clean=${built%+dirty}
    [[ -n $clean && ($HATTN_COMMIT == "$clean"* || $clean == "$HATTN_COMMIT"*) ]] ||
      note "WARNING: the wheel was built at $built, the run is recorded as $HATTN_COMMIT (rebuild: scripts/build_wheel.sh)"
  else
    if [ -f "$build/CMakeCache.txt" ]; then
      settings+=("--config-settings=build-dir=$(cd "$build" && pwd)" --config-settings=cmake.define.HATTN_PTXAS_VERBOSE=ON
        --config-settings=cmake.define.HATTN_BUILD_TESTS=ON --config-settings=cmake.define.HATTN_BUILD_BENCH=ON)
    fi
    python3 -m pip install --no-build-isolation --no-deps -q "${settings[@]}" . >"$out/pip.log" 2>&1
    note "pip install: rc=$?"
  fi
  if [ -z "${HATTN_FA3_LIB:-}" ] && [ -f .anchors/flash_attn_3_sm90.so.xz ]; then
    xz -dkf .anchors/flash_attn_3_sm90.so.xz && export HATTN_FA3_LIB=$PWD/.anchors/flash_attn_3_sm90.so
  fi
  note "FlashAttention-3 for the benchmarks: ${HATTN_FA3_LIB:-not given}"
  if [ -d .whl ]; then  # diffusers for the capstone and its tests, carried as wheels
    python3 -m pip install --no-index --find-links .whl -q 'diffusers==0.42.1' >"$out/pip_diffusers.log" 2>&1
    note "pip install diffusers from .whl: rc=$?"
  fi
}

step_python() {  # LABEL [PYTEST ARGS]
  local label=$1
  shift
  [ $# -gt 0 ] || set -- python/tests
  ensure_python
  # -rs: the log names every skipped test and why (the summary line alone does not).
  timeout "$timeout_s" python3 -m pytest -q -rs "$@" >"$out/$label.log" 2>&1
  local rc=$?
  # pytest's count line ("N passed, M skipped in S s"; a second -q in the arguments drops it).
  note "$label: rc=$rc $(grep -E '(passed|failed|error|skipped|no tests ran)' "$out/$label.log" | tail -1)"
}

step_py() {  # LABEL MODULE [FLAGS]
  local label=$1 module=$2
  shift 2
  ensure_python
  sass_wait
  PYTHONUNBUFFERED=1 python3 -m "hattn.$module" --out "$out/$label" "$@" 2>&1 | tee "$out/$label.log"
  note "$label ($*): rc=${PIPESTATUS[0]} -> $out/$label/"
}

step_capstone() {  # LABEL [MODEL SIZE REPS]
  local label=$1 runs spec
  shift
  ensure_python
  sass_wait
  if [ $# -eq 3 ]; then runs=("$*"); else runs=("wan2.1-1.3b 480p 5" "wan2.1-14b 720p 3"); fi
  for spec in "${runs[@]}"; do
    # shellcheck disable=SC2086  # the spec's words: MODEL SIZE REPS
    set -- $spec
    python3 -m hattn.capstone --model "$1" --size "$2" --reps "$3" --out "$out/${label}_$1_$2" \
      >"$out/${label}_$1_$2.log" 2>&1
    note "$label $1 $2: rc=$?; hattn's speedup over $(grep -E '^(torch_|fa3)' "$out/${label}_$1_$2.log" |
      awk '{printf "%s %s; ", $1, $3}')"
  done
}

run_step() {  # I: step I with its environment, in this shell
  split_env "${steps[$1]}"
  local name=${w[0]//-/_} assignment
  for assignment in "${step_env[@]}"; do export "${assignment?}"; done  # this step only
  [ ${#step_env[@]} -eq 0 ] || note "${labels[$1]}: with ${step_env[*]}"
  "step_$name" "${labels[$1]}" "${w[@]:1}"
  for assignment in "${step_env[@]}"; do unset "${assignment%%=*}"; done
}

if [ "$together" = 1 ]; then
  # The package is installed once, before the steps that use it start side by side.
  for step in "${steps[@]}"; do
    split_env "$step"
    case ${w[0]} in
      python | py | capstone) ensure_python ;;
      sanitize) [[ ${w[1]:-} != contract:* ]] || ensure_python ;;
    esac
  done
  pids=()
  for i in "${!steps[@]}"; do
    # Each step in a subshell: its notes and tables come back through files, in step order.
    (
      notes_before=${#summary[@]} tables_before=${#tables[@]}
      sass_pid=''  # the disassembly is this shell's child: the main shell waits for it below
      run_step "$i"
      printf '%s\n' "${summary[@]:$notes_before}" >"$out/.notes_$i"
      printf '%s\n' "${tables[@]:$tables_before}" >"$out/.tables_$i"
    ) >"$out/${labels[$i]}.out" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  for i in "${!steps[@]}"; do
    mapfile -t lines <"$out/.notes_$i" 2>/dev/null || lines=("${labels[$i]}: ended without its notes (see ${labels[$i]}.out)")
    for line in "${lines[@]}"; do [ -z "$line" ] || summary+=("$line"); done
    mapfile -t lines <"$out/.tables_$i" 2>/dev/null || lines=()
    for line in "${lines[@]}"; do [ -z "$line" ] || tables+=("$line"); done
    rm -f "$out/.notes_$i" "$out/.tables_$i"
  done
else
  for i in "${!steps[@]}"; do run_step "$i"; done
fi
sass_wait

echo
echo "================ summary (commit $HATTN_COMMIT) ================"
for log in "${tables[@]}"; do sed -n '/^# TFLOP\/s/,$p' "$log"; done
printf '%s\n' "${summary[@]}"
if [ "$pack" = 1 ]; then  # after the summary, which reads the logs
  packed=$(mktemp -d)
  if tar czf "$packed/gpu_run.tgz" -C "$out" . && find "$out" -mindepth 1 -delete; then
    mv "$packed/gpu_run.tgz" "$out/" && printf '%s\n' "${summary[@]}" >"$out/summary.txt" &&
      echo "packed into $out/gpu_run.tgz (and summary.txt)"
  fi
  rmdir "$packed" 2>/dev/null
fi
