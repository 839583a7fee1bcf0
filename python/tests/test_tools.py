"""tools/ctest_summary.py and tools/evidence_index.py (CPU only): what test.sh prints of a ctest
run, and how citations of results/evidence are read."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ctest_summary = load("ctest_summary")
evidence_index = load("evidence_index")

LOG = """\
   1/4 Test    #1: Reference.TwoKeys ....................................   Passed    0.03 sec
   2/4 Test    #2: AllKernels/KernelTest.Matches/01_naive_0 ..............***Skipped   0.02 sec
   3/4 Test    #3: AllKernels/KernelTest.Matches/01_naive_1 ..............***Skipped   0.02 sec
   4/4 Test    #4: Validation.Bad ........................................***Failed    0.01 sec
"""


def test_ctest_summary_counts_and_names(tmp_path, capsys, monkeypatch):
    log = tmp_path / "ctest.log"
    log.write_text(LOG)
    monkeypatch.setattr("sys.argv", ["ctest_summary.py", str(log)])
    assert ctest_summary.main() == 1  # a failure
    out = capsys.readouterr().out
    assert "4 tests: 1 passed, 2 skipped, 1 failed" in out
    assert "skipped by suite: AllKernels/KernelTest 2" in out
    assert "FAILED: Validation.Bad" in out


def test_evidence_citations_expand_braces_and_paths():
    ev = "evid" + "ence/"  # spelled apart, so that this file cites no evidence itself
    text = f"see `results/{ev}bench_x_{{a,b}}.log` and results/{ev}fold08/README.md, {ev}clock_carryover/."
    names = evidence_index.cited_names(text)
    assert names == {"bench_x_a.log", "bench_x_b.log", "fold08", "clock_carryover"}  # the entries
    assert evidence_index.cites_entry(names, "fold08") and evidence_index.cites_entry(names, "bench_x_a.log")
    assert not evidence_index.cites_entry(names, "fold")  # a prefix of a cited name is not cited


def test_the_index_is_current():
    """scripts/test.sh runs the same check; here a failure carries the test's name."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, str(ROOT / "tools" / "evidence_index.py"), "--check"], capture_output=True,
                         text=True, cwd=ROOT)  # fmt: skip
    assert res.returncode == 0, res.stderr
