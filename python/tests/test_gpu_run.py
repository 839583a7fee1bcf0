"""scripts/gpu_run.sh on a machine without a GPU: its arguments, and its steps run against stand-in
binaries (a prebuilt archive of scripts that log how they were called), so that a mistake in the
script shows here and not after a GPU machine's build."""

import os
import shlex
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_run.sh"


def run(*args, env=None):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60)


def test_dry_run_lists_the_default_steps():
    r = run("--dry-run")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[1:] == ["test: test", "bench: bench", "bench_backward: bench-backward"]


def test_dry_run_numbers_repeated_steps_and_keeps_words():
    r = run("--dry-run", "py", "bench_backward", "--dims", "64", "+", "py", "bench_backward", "--gqa", "4",
            "+", "python", "python/tests", "-k", "a or b")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()[1:]
    assert lines[0] == "py_bench_backward: py bench_backward --dims 64"
    assert lines[1] == "py_bench_backward_2: py bench_backward --gqa 4"
    assert shlex.split(lines[2].split(":", 1)[1]) == ["python", "python/tests", "-k", "a or b"]


def test_dry_run_takes_ncu_fa3_when_fa3_is_named():
    env = dict(os.environ, HATTN_FA3_LIB="/nowhere/fa3.so")
    r = run("--dry-run", "ncu-fa3", "--dim", "128", "--causal", "+", "ncu-fa3", "--seqlen", "16384", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()[1:]
    assert lines[0] == "ncu_fa3: ncu-fa3 --dim 128 --causal"
    assert lines[1] == "ncu_fa3_2: ncu-fa3 --seqlen 16384"


def test_dry_run_names_a_steps_environment_in_its_label():
    r = run("--dry-run", "test", "+", "HATTN_TRIAL=units", "test", "*cache*", "+", "A=1", "B=x.y", "bench")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()[1:]
    assert lines[0] == "test: test"
    assert shlex.split(lines[1].split(":", 1)[1]) == ["HATTN_TRIAL=units", "test", "*cache*"]
    assert lines[1].startswith("test_units:")
    assert lines[2].startswith("bench_1_x_y:")


@pytest.mark.parametrize("args, message", [
    (["ab", "--kernels", "one"], "name two kernels"),
    (["py", "nope"], "MODULE is one of"),
    (["frob"], "unknown step 'frob'"),
    (["test", "+", "+", "bench"], "an empty step"),
    (["test", "+"], "an empty step"),
    (["test", "a[b]"], "only * and ?"),
    (["capstone", "a", "b"], "MODEL SIZE REPS"),
    (["ncu"], "give hattn-bench flags"),
    (["sanitize", "contract:x"], "contract:N with N a count"),
    (["--zap"], "unknown option --zap"),
    (["--shards", "0", "test"], "--shards takes a count"),
    (["X=1", "+", "test"], "a step of only VAR=VALUE words"),
])
def test_bad_arguments_are_refused_before_anything_runs(args, message):
    r = run("--dry-run", *args)
    assert r.returncode == 2
    assert message in r.stdout


def _stub(path, body):
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _gpu_tools(tmp_path, record=""):
    """A folder of stand-ins for nvidia-smi (an H200; `record` first) and nvcc, and an
    environment whose PATH finds them first."""
    tools = tmp_path / "tools"
    tools.mkdir()
    _stub(tools / "nvidia-smi", record + 'echo "NVIDIA H200, 1980 MHz"\n')
    _stub(tools / "nvcc", 'echo "Build cuda_13.0"\n')
    return tools, dict(os.environ, PATH=f"{tools}:{os.environ['PATH']}")


def _prebuilt(tmp_path, tests_body, bench_body):
    """A prebuilt archive (scripts/prebuild.sh's files) whose binaries are scripts."""
    bins = tmp_path / "bins"
    bins.mkdir()
    _stub(bins / "hattn_tests", tests_body)
    _stub(bins / "hattn-bench", bench_body)
    (bins / "prebuild.log").write_text("ptxas info    : Used 128 registers\n")
    (bins / "prebuild_commit.txt").write_text("abc123\n")
    (bins / "prebuild_nvcc.txt").write_text("13.0\n")
    archive = tmp_path / "prebuilt.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        for f in bins.iterdir():
            tar.add(f, arcname=f.name)
    return archive


def test_steps_call_the_binaries_as_documented(tmp_path):
    calls = tmp_path / "calls.txt"
    record = f'printf "%s" "$(basename "$0")" >>{calls}; printf " %s" "$@" >>{calls}; echo >>{calls}\n'
    archive = _prebuilt(tmp_path, record + 'echo "[  PASSED  ] 3 tests."\n', record + """
if [ "${1:-}" = --list ]; then printf 'forward kernels:\\n  01_naive\\nbackward kernels:\\n  bwd_01_cuda_core\\n  bwd_02_mma_sync\\n  bwd_sm90\\n'; exit 0; fi
for a in "$@"; do [ "${prev:-}" = --csv ] && echo "kernel,tflops" >"$a"; prev=$a; done
echo "# TFLOP/s"; echo "table row"
""")
    tools, env = _gpu_tools(tmp_path, record)
    _stub(tools / "compute-sanitizer", record + 'echo "========= ERROR SUMMARY: 0 errors"\n')
    _stub(tools / "ncu", record)
    out = tmp_path / "out"
    r = run("--out", str(out), "--build", str(tmp_path / "build"), "--prebuilt", str(archive), "--no-sass",
            "--shards", "1", "test", "*Window*", "+", "bench", "+", "bench-backward", "--gqa", "4",
            "+", "ab", "--kernels", "fwd_sm90,16_coalesced_store", "--dims", "128",
            "+", "sanitize", "+", "ncu", "--dims", "64", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    log = [line.split() for line in calls.read_text().splitlines() if not line.startswith("nvidia-smi")]
    assert log[0] == ["hattn_tests", "--gtest_filter=*Window*", "--gtest_brief=1"]
    assert log[1][0] == "hattn-bench" and log[1][-2:] == ["--settle", "0.5"]  # the default flags
    backward = log[3]  # after the --list that finds the backward kernels
    assert log[2] == ["hattn-bench", "--list"]
    assert backward[backward.index("--kernels") + 1] == "bwd_02_mma_sync,bwd_sm90"  # no B01
    assert backward[-2:] == ["--gqa", "4"]
    assert log[4][log[4].index("--kernels") + 1] == "fwd_sm90,16_coalesced_store"
    assert log[5][log[5].index("--kernels") + 1] == "16_coalesced_store,fwd_sm90"  # swapped
    tools_run = [entry[2] for entry in log[6:10]]
    assert tools_run == ["memcheck", "racecheck", "synccheck", "initcheck"]
    assert log[10][0] == "ncu" and log[10][-2:] == ["--reps", "1"]
    for name in ("test.log", "bench.csv", "bench_backward.csv", "ab_ab.csv", "ab_ba.csv",
                 "sanitize_memcheck.log", "ncu.txt"):
        assert (out / name).exists(), name
    summary = r.stdout[r.stdout.index("==== summary (commit abc123)"):]
    assert summary.count("table row") == 2  # the two benchmarks' tables
    assert "sanitize memcheck: rc=0 (ERROR SUMMARY: 0 errors)" in summary


def test_sanitize_contract_runs_the_randomized_cases_under_each_tool(tmp_path):
    """sanitize contract:N: the Python contract test, N forward and N / 4 backward cases, under
    each of the four tools (contract:N is not read as a backward KERNEL:I,J)."""
    calls = tmp_path / "calls.txt"
    archive = _prebuilt(tmp_path, "exit 0\n", "exit 0\n")
    tools, env = _gpu_tools(tmp_path)
    _stub(tools / "compute-sanitizer",
          f'echo "$2 $HATTN_CONTRACT_CASES $HATTN_CONTRACT_BWD_CASES ${{*:5}}" >>{calls}\n'
          'echo "========= ERROR SUMMARY: 0 errors"\n')
    # python3: the interpreter tag for the wheel's name, else nothing (pip installs nothing).
    _stub(tools / "python3", 'if [ "$1" = -c ]; then echo cp312; fi\n')
    out = tmp_path / "out"
    r = run("--out", str(out), "--build", str(tmp_path / "build"), "--prebuilt", str(archive), "--no-sass",
            "sanitize", "contract:10", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert calls.read_text().splitlines() == [
        f"{tool} 10 3 python3 -m pytest -q python/tests/test_contract.py"
        for tool in ("memcheck", "racecheck", "synccheck", "initcheck")]
    assert "no such kernel or shapes" not in r.stdout
    assert "sanitize initcheck: rc=0 (ERROR SUMMARY: 0 errors)" in r.stdout


def test_together_runs_the_steps_at_once_and_keeps_their_notes_in_order(tmp_path):
    """--together: each step starts before the other ends (each waits for the other's start,
    so run one after the other they would time out), its output goes to LABEL.out, and the
    summary lists the notes in the steps' order whichever ends first."""
    started = tmp_path / "started"
    started.mkdir()
    wait_for = 'for i in $(seq 50); do [ -e {other} ] && break; sleep 0.1; done; [ -e {other} ] || exit 7\n'
    tests = f"touch {started}/tests\n" + wait_for.format(other=started / "bench") + 'echo "[  PASSED  ] 2 tests."\n'
    bench = (f"touch {started}/bench\n" + wait_for.format(other=started / "tests") +
             'for a in "$@"; do [ "${prev:-}" = --csv ] && echo "kernel,tflops" >"$a"; prev=$a; done\n'
             'echo "# TFLOP/s"; echo "table row"\n')  # fmt: skip
    archive = _prebuilt(tmp_path, tests, bench)
    _, env = _gpu_tools(tmp_path)
    out = tmp_path / "out"
    r = run("--out", str(out), "--build", str(tmp_path / "build"), "--prebuilt", str(archive), "--no-sass",
            "--shards", "1", "--together", "HATTN_TRIAL=x", "test", "+", "bench", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = r.stdout[r.stdout.index("==== summary"):].splitlines()
    notes = [line for line in summary if line.startswith(("test_x", "bench"))]
    assert notes[0] == "test_x: with HATTN_TRIAL=x"
    assert notes[1].startswith("test_x (*): rc=0") and notes[1].endswith("[  PASSED  ] 2 tests.")
    assert notes[2].startswith("bench:")
    assert "table row" in summary  # the bench step's table, through its file
    assert (out / "test_x.out").exists() and (out / "bench.out").exists()
    assert not list(out.glob(".notes_*")) and not list(out.glob(".tables_*"))


def test_a_steps_environment_reaches_its_binaries_only(tmp_path):
    calls = tmp_path / "calls.txt"
    record = f'echo "$(basename "$0") trial=${{HATTN_TRIAL:-none}}" >>{calls}\n'
    archive = _prebuilt(tmp_path, record + 'echo "[  PASSED  ] 1 test."\n', record)
    _, env = _gpu_tools(tmp_path)
    env.pop("HATTN_TRIAL", None)
    out = tmp_path / "out"
    r = run("--out", str(out), "--build", str(tmp_path / "build"), "--prebuilt", str(archive), "--no-sass",
            "--shards", "1", "HATTN_TRIAL=units", "test", "+", "test", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert calls.read_text().splitlines() == ["hattn_tests trial=units", "hattn_tests trial=none"]
    assert (out / "test_units.log").exists() and (out / "test.log").exists()
    assert "test_units: with HATTN_TRIAL=units" in r.stdout


def test_shards_split_the_tests_and_sum_their_counts(tmp_path):
    """--shards N: N hattn_tests processes, each given GoogleTest's shard variables; one log,
    ending with the summed counts that the summary line quotes."""
    calls = tmp_path / "calls.txt"
    body = (f'echo "shard ${{GTEST_SHARD_INDEX}} of ${{GTEST_TOTAL_SHARDS}} $*" >>{calls}\n'
            'echo "[==========] 4 tests from 1 test suite ran. (1 ms total)"\n'
            'echo "[  PASSED  ] 3 tests."\necho "[  SKIPPED ] 1 test, listed below:"\n')
    archive = _prebuilt(tmp_path, body, "exit 0\n")
    tools, env = _gpu_tools(tmp_path)
    out = tmp_path / "out"
    r = run("--out", str(out), "--build", str(tmp_path / "build"), "--prebuilt", str(archive), "--no-sass",
            "--shards", "3", "test", "*Window*", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(calls.read_text().splitlines()) == [
        f"shard {i} of 3 --gtest_filter=*Window* --gtest_brief=1" for i in range(3)]
    log = (out / "test.log").read_text()
    assert log.count("=== shard") == 3
    assert log.rstrip().splitlines()[-3:] == [
        "[==========] 12 tests ran in 3 shards", "[  PASSED  ] 9 tests.", "[  SKIPPED ] 3 tests."]
    assert not list(out.glob("test.log.*"))  # the shards' own logs are joined into test.log
    assert "test (*Window*): rc=0, [  PASSED  ] 9 tests." in r.stdout  # skipped are not failed
    # Without --shards: half the cores (nproc), at most 8.
    for cores, shards in (("6", 3), ("40", 8), ("1", 1)):
        calls.unlink()
        _stub(tools / "nproc", f"echo {cores}\n")
        r = run("--out", str(out), "--build", str(tmp_path / "build"), "--prebuilt", str(archive), "--no-sass",
                "test", env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert len(calls.read_text().splitlines()) == shards, cores


def test_pack_leaves_two_files_in_the_output_folder(tmp_path):
    """--pack: the device tool brings back at most 8 files, so everything goes into gpu_run.tgz,
    beside summary.txt, inside the output folder ($OUT) itself."""
    archive = _prebuilt(tmp_path, 'echo "[  PASSED  ] 3 tests."\n', "exit 0\n")
    _, env = _gpu_tools(tmp_path)
    out = tmp_path / "out"
    r = run("--out", str(out), "--build", str(tmp_path / "build"), "--prebuilt", str(archive), "--no-sass", "--pack",
            "--shards", "1", "test", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["gpu_run.tgz", "summary.txt"]
    with tarfile.open(out / "gpu_run.tgz") as tar:
        assert "./test.log" in tar.getnames()
    assert "test (*): rc=0" in (out / "summary.txt").read_text()


def _bench_stub(ms, record=""):
    """hattn-bench writing two points to its --csv, each `ms` long; the second fails its check
    when ms is 'fail'."""
    return record + f"""
for a in "$@"; do [ "${{prev:-}}" = --csv ] && csv=$a; prev=$a; done
echo "commit,gpu,kernel,head_dim,seqlen_k,reps,ms,tflops,check" >"$csv"
echo "c,H,bwd_sm90,64,1024,5,{ms},1,PASS" >>"$csv"
echo "c,H,bwd_sm90,64,4096,5,4.0,1,{'FAIL' if ms == 'fail' else 'PASS'}" >>"$csv"
"""


def _trial_setup(tmp_path, trial_tests, name):
    """Main's binaries (hattn-bench at 2.0 ms a point) and a trial's archive `name` (1.0 ms,
    hattn_tests running `trial_tests`), both recording their calls: (calls, main, trial, env,
    out, build)."""
    calls = tmp_path / "calls.txt"
    record = f'echo "$0 $*" >>{calls}\n'
    (tmp_path / "m").mkdir()
    (tmp_path / "t").mkdir()
    main = _prebuilt(tmp_path / "m", "exit 0\n", _bench_stub("2.0", record))
    trial = _prebuilt(tmp_path / "t", record + trial_tests, _bench_stub("1.0", record)).rename(tmp_path / name)
    _, env = _gpu_tools(tmp_path)
    return calls, main, trial, env, tmp_path / "out", tmp_path / "build"


def test_trial_times_main_and_the_trial_in_turn_and_gives_their_ratio(tmp_path):
    calls, main, trial, env, out, build = _trial_setup(tmp_path, 'echo "[  PASSED  ] 2 tests."\n', "my-trial.tar.xz")
    r = run("--out", str(out), "--build", str(build), "--prebuilt", str(main), "--no-sass", "--shards", "1",
            "trial", str(trial), "--test", "*Backward*", "--backward", "--dims", "64", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    log = calls.read_text().splitlines()
    assert log[0].startswith(f"{build}-trial_my_trial/hattn_tests --gtest_filter=*Backward*")
    order = [line.split()[0] for line in log[1:]]
    assert order == [f"{build}/hattn-bench", f"{build}-trial_my_trial/hattn-bench",
                     f"{build}-trial_my_trial/hattn-bench", f"{build}/hattn-bench"]
    assert all(line.split()[-3:] == ["--backward", "--dims", "64"] for line in log[1:])
    table = (out / "trial_my_trial.txt").read_text()
    assert "seqlen_k=1024: main 2.0000 ms, trial 1.0000 ms, trial/main 0.500" in table
    assert "trial/main time over 2 points: min 0.500, median 0.750, max 1.000" in table
    assert "trial_my_trial test (*Backward*): rc=0, [  PASSED  ] 2 tests." in r.stdout
    # With --shards the trial's tests are sharded as the test step's are.
    calls.unlink()
    r = run("--out", str(out), "--build", str(build), "--prebuilt", str(main), "--no-sass", "--shards", "2",
            "trial", str(trial), "--test", "*Backward*", "--backward", "--dims", "64", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[==========] 0 tests ran in 2 shards" in (out / "trial_my_trial_test.log").read_text()
    assert "trial_my_trial test (*Backward*): rc=0, [  PASSED  ] 4 tests." in r.stdout


def test_trial_probe_runs_no_tests_and_compares_times_anyway(tmp_path):
    calls, main, probe, env, out, build = _trial_setup(tmp_path, "", "no-dq.tar.xz")
    r = run("--out", str(out), "--build", str(build), "--prebuilt", str(main), "--no-sass", "--shards", "1",
            "trial", str(probe), "--probe", "--backward", "--dims", "64", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    log = calls.read_text().splitlines()
    assert not any("hattn_tests" in line for line in log)  # a probe's results are wrong: no tests
    assert all(line.split()[-3:] == ["--backward", "--dims", "64"] for line in log)
    table = (out / "trial_no_dq.txt").read_text()
    assert "seqlen_k=1024: main 2.0000 ms, probe 1.0000 ms, probe/main 0.500" in table
    assert "probe/main time over 2 points" in table


@pytest.mark.parametrize("args, message", [
    (["trial", "nope.tar.xz"], "ARCHIVE is a prebuilt .tar.xz that is here"),
    (["trial", "README.md"], "ARCHIVE is a prebuilt .tar.xz that is here"),
])
def test_trial_refuses_a_missing_archive(args, message):
    r = run("--dry-run", *args)
    assert r.returncode == 2
    assert message in r.stdout
