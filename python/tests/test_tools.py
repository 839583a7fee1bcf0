"""tools/ctest_summary.py, tools/evidence_index.py, tools/check_figures.py, tools/trial_ratio.py,
tools/ncu_summary.py, tools/sass_stalls.py and tools/fatbin_cubins.py (CPU only): what test.sh
prints of a ctest run, how citations of results/evidence are read, which collisions of text the
figure checker reports, how a trial's times are set beside main's, how ncu's exports are read,
and how cubins are taken out of a library's fat binary."""

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
check_figures = load("check_figures")
trial_ratio = load("trial_ratio")
ncu_summary = load("ncu_summary")
sass_stalls = load("sass_stalls")
fatbin_cubins = load("fatbin_cubins")

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


def figure(tmp_path, body, name="f.svg"):
    """A 300 x 100 figure at font-size 12, as the guide's are written."""
    path = tmp_path / name
    path.write_text('<svg xmlns="http://www.w3.org/2000/svg" width="300" height="100" viewBox="0 0 300 100" '
                    f'font-family="sans-serif" font-size="12">{body}</svg>')
    return path


def test_check_figures_passes_a_clean_figure(tmp_path):
    body = ('<rect x="10" y="10" width="120" height="30" fill="#eee" stroke="#888"/>'
            '<text x="70" y="30" text-anchor="middle">fits its box</text>'
            '<line x1="130" y1="25" x2="200" y2="25" stroke="#444"/>'
            '<g font-size="10"><text x="205" y="29">label</text></g>'
            '<text x="20" y="70" font-weight="bold">a caption<tspan font-weight="normal"> below</tspan></text>'
            # a line under an opaque label background does not cross the label
            '<line x1="150" y1="80" x2="290" y2="80" stroke="#444"/><rect x="180" y="70" width="80" height="16" fill="#fff"/>'
            '<text x="220" y="82" text-anchor="middle">on a line</text>')
    assert check_figures.check(figure(tmp_path, body)) == []


def test_check_figures_reports_each_collision(tmp_path):
    overflow = ('<rect x="80" y="10" width="60" height="30" fill="#eee"/>'
                '<text x="110" y="30" text-anchor="middle">far too long for it</text>')
    overlap = '<text x="20" y="50">first label</text><text x="60" y="54">second</text>'
    crossed = '<text x="20" y="50">crossed</text><line x1="10" y1="40" x2="200" y2="50" stroke="#444"/>'
    outside = '<text x="250" y="50">past the edge</text>'
    for body, expected in ((overflow, "runs out of its box"), (overlap, "texts overlap"),
                           (crossed, "a line crosses 'crossed'"), (outside, "outside the figure")):
        problems = check_figures.check(figure(tmp_path, body))
        assert len(problems) == 1 and expected in problems[0], (body, problems)


def test_check_figures_exit_status(tmp_path, capsys):
    clean = figure(tmp_path, '<text x="20" y="50">ok</text>', "clean.svg")
    bad = figure(tmp_path, '<text x="20" y="50">one</text><text x="22" y="50">two</text>', "bad.svg")
    assert check_figures.main(["--list", str(clean)]) == 0
    assert check_figures.main([str(clean), str(bad)]) == 1
    out = capsys.readouterr().out
    assert "1 figures checked, 0 with problems" in out and "bad.svg: texts overlap: 'one' and 'two'" in out


def test_the_guide_figures_pass():
    """scripts/test.sh runs the same check; here a failure carries the test's name."""
    figures = sorted(check_figures.FIGURES.glob("*.svg"))
    assert figures
    assert [p for f in figures for p in check_figures.check(f)] == []


def test_precision_emulation_study_counts_a_few_cases(tmp_path, capsys, monkeypatch):
    """tools/precision_emulation_study.py on 12 cases of test_precision's draw: a line per dtype and
    softcap, and a CSV row per case with --all (each gradient's bound and variants' errors)."""
    import csv

    study = load("precision_emulation_study")
    out = tmp_path / "cases.csv"
    monkeypatch.setattr("sys.argv", ["precision_emulation_study.py", "--cases", "12", "--out", str(out), "--all"])
    study.main()
    text = capsys.readouterr().out
    assert text.startswith("12 cases") and text.count("cases; emu ") == 4
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 12
    for row in rows:
        for g in ("dq", "dk", "dv"):
            assert float(row[f"{g}_bound"]) >= 1e-6 and float(row[f"{g}_fp64"]) >= 0
            assert row[f"{g}_emu_miss"] == str(int(float(row[f"{g}_emu"]) > float(row[f"{g}_bound"])))


def test_trial_ratio_matches_points_and_leaves_out_failed_or_missing_ones(tmp_path):
    header = "commit,gpu,kernel,head_dim,seqlen_k,varlen,reps,ms,tflops,check\n"
    files = {}
    for name, rows in {
        "main_1": ["a,H,k,64,1024,mixed,5,2.0,1,PASS", "a,H,k,64,1024,mixed,5,6.0,1,PASS",
                   "a,H,k,64,4096,,5,4.0,1,PASS", "a,H,k,64,8192,,5,8.0,1,PASS"],
        "main_2": ["a,H,k,64,1024,mixed,5,4.0,1,PASS", "a,H,k,64,1024,mixed,5,6.0,1,PASS",
                   "a,H,k,64,4096,,5,4.0,1,PASS", "a,H,k,64,8192,,5,8.0,1,PASS"],
        "trial_1": ["b,H,k,64,1024,mixed,5,1.5,1,PASS", "b,H,k,64,1024,mixed,5,6.6,1,PASS",
                    "b,H,k,64,4096,,5,1.0,1,FAIL", "b,H,k,64,16384,,5,9.0,1,PASS"],
    }.items():
        files[name] = tmp_path / f"{name}.csv"
        files[name].write_text(header + "\n".join(rows) + "\n")
    lines, ratios = trial_ratio.compare([files["main_1"], files["main_2"]], [files["trial_1"]])
    # Two equal points (two varlen batches of one shape) pair up by their place.
    assert lines[0] == "kernel=k head_dim=64 seqlen_k=1024 varlen=mixed: main 3.0000 ms, trial 1.5000 ms, trial/main 0.500"
    assert lines[1].endswith("trial/main 1.100")
    assert lines[2] == "kernel=k head_dim=64 seqlen_k=4096: check FAIL, not compared"
    assert lines[3] == "kernel=k head_dim=64 seqlen_k=8192: only in main"
    assert lines[4] == "kernel=k head_dim=64 seqlen_k=16384: only in the trial"
    assert [round(r, 6) for r in ratios] == [0.5, 1.1]
    # A timing probe's failed checks are expected: its point is compared; main's must still pass.
    lines, ratios = trial_ratio.compare([files["main_1"], files["main_2"]], [files["trial_1"]], probe=True)
    assert lines[2] == "kernel=k head_dim=64 seqlen_k=4096: main 4.0000 ms, probe 1.0000 ms, probe/main 0.250"
    assert [round(r, 6) for r in ratios] == [0.5, 1.1, 0.25]
    lines, _ = trial_ratio.compare([files["trial_1"]], [files["main_1"]], probe=True)
    assert lines[2] == "kernel=k head_dim=64 seqlen_k=4096: check FAIL, not compared"


NCU_RAW = """\
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","gpu__time_duration.sum","launch__registers_per_thread","sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active","sm__pipe_tensor_cycles_active.max.pct_of_peak_sustained_active","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio","smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"
"","","","","","","","","","","","ms","register/thread","%","%","inst","inst"
"0","1","python3","h","void hattn::fwd::forward_kernel<bf16, 128>(CUtensorMap_st, Params)","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0","1.5","168","72.4","73.0","0.82","1.64"
"1","1","python3","h","void at::fill<int>(int)","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","0.002","16","0","0","0","0"
"2","1","python3","h","void cutlass::device_kernel<flash::Fwd>(Params)","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0","1.25","168","82.2","83.0","0.48","1.56"
"""


def test_ncu_summary_reads_units_and_leaves_out_small_kernels(tmp_path, capsys):
    path = tmp_path / "raw.csv"
    path.write_text(NCU_RAW)
    ncu_summary.main(str(path))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| | `hattn::fwd::forward_kernel<bf16, 128>` | `cutlass::device_kernel<flash::Fwd>` |"
    assert "| duration (us) | 1,500 | 1,250 |" in lines  # milliseconds read as such
    assert "| pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active % | 72.4 | 82.2 |" in lines
    assert not any(".max." in line for line in lines)
    stalls = [line for line in lines if line.startswith("| stall:")]
    assert stalls == ["| stall: wait | 1.64 | 1.56 |", "| stall: barrier | 0.82 | 0.48 |"]  # the larger first
    assert not any("fill" in line for line in lines)  # under 2% of the longest kernel's time


def _source_rows(samples):
    header = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
              '"stall_barrier","stall_wait","stall_barrier (Not Issued)"')
    rows = [f'"{0x1000 + 16 * i:#x}","  {sass}","{n}","10","{barrier}","{n - barrier}","0"'
            for i, (sass, n, barrier) in enumerate(samples)]
    return header + "\n" + "\n".join(rows)


def test_sass_stalls_ranks_lines_and_reasons_per_kernel(tmp_path, capsys, monkeypatch):
    path = tmp_path / "sass.csv"
    path.write_text('"Kernel Name","void ours<(int)128, (bool)0>(CUtensorMap_st, int)"\n' + _source_rows([
        ("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16], R24", 10, 0),
        ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 60, 60),
        ("@P1 MUFU.EX2 R1, R1", 30, 0),
    ]) + '\n"Kernel Name","tiny"\n' + _source_rows([("EXIT", 1, 0)]) + "\n")
    path.write_text(path.read_text() * 2)  # ncu writes each kernel's section twice
    monkeypatch.setattr("sys.argv", ["sass_stalls.py", str(path), "--top", "2"])
    sass_stalls.main()
    out = capsys.readouterr().out
    assert out.count("## ours<(int)128, (bool)0>\n") == 1  # the template's casts kept, the parameters cut; once
    assert "tiny" not in out  # under 5% of all samples
    assert "by reason: barrier 60.0%, wait 40.0%" in out
    assert "by opcode: WARPGROUP 60.0%, MUFU 30.0%, HGMMA 10.0%" in out  # the predicate skipped
    assert "by runs of a line: 10 (3 lines) 100.0%" in out  # each line ran 10 times: one loop
    table = [line for line in out.splitlines() if line.startswith("| 0x")]
    assert table == ["| 0x0010 | `WARPGROUP.DEPBAR.LE gsb0, 0x0` | 60.0% | barrier 100% |",
                     "| 0x0020 | `@P1 MUFU.EX2 R1, R1` | 30.0% | wait 100% |"]


def _elf_with_section(name: bytes, body: bytes) -> bytes:
    """A minimal 64-bit little-endian ELF file: a null section, `name` holding `body`, and the
    section-name table."""
    import struct
    names = b"\0" + name + b"\0.shstrtab\0"
    header_size, body_at = 64, 64
    names_at = body_at + len(body)
    shoff = (names_at + len(names) + 7) // 8 * 8
    elf = bytearray(b"\x7fELF" + bytes([2, 1, 1]) + bytes(9))
    elf += struct.pack("<HHIQQQIHHHHHH", 3, 0x3E, 1, 0, 0, shoff, 0, header_size, 0, 0, 64, 3, 2)
    elf += body + names + bytes(shoff - names_at - len(names))
    for sh_name, offset, size in ((0, 0, 0), (1, body_at, len(body)), (len(name) + 2, names_at, len(names))):
        elf += struct.pack("<IIQQQQIIQQ", sh_name, 1 if size else 0, 0, 0, offset, size, 0, 0, 1, 0)
    return bytes(elf)


def _fatbin(*payloads) -> bytes:
    """One fat binary whose entries are (kind, payload) pairs, each with a 64-byte header naming sm_90."""
    import struct
    entries = b""
    for kind, payload in payloads:
        header = bytearray(64)
        struct.pack_into("<HHIQ", header, 0, kind, 0x101, 64, len(payload))
        struct.pack_into("<I", header, 0x1C, 90)
        entries += bytes(header) + payload
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(entries)) + entries


def test_fatbin_cubins_writes_each_cubin_and_skips_the_rest(tmp_path, capsys):
    cubin = b"\x7fELF" + b"cubin for sm_90"
    fatbins = _fatbin((1, b"// ptx text"), (2, cubin), (2, b"\x28\xb5compressed")) + bytes(8)
    library = tmp_path / "lib.so"
    library.write_bytes(_elf_with_section(b".nv_fatbin", fatbins + _fatbin((2, cubin + b" again"))))
    assert fatbin_cubins.main([str(library), str(tmp_path / "out")]) == 0
    written = sorted((tmp_path / "out").iterdir())
    assert [p.name for p in written] == ["entry001_sm90.cubin", "entry003_sm90.cubin"]
    assert written[0].read_bytes() == cubin and written[1].read_bytes() == cubin + b" again"
    assert "entry 2 (sm_90): compressed, skipped" in capsys.readouterr().out


def test_fatbin_cubins_refuses_what_holds_no_device_code(tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("not an ELF file")
    plain = tmp_path / "plain.so"
    plain.write_bytes(_elf_with_section(b".text", b"\x90" * 16))
    assert fatbin_cubins.main([str(text), str(tmp_path / "a")]) == 1
    assert fatbin_cubins.main([str(plain), str(tmp_path / "b")]) == 1
    err = capsys.readouterr().err
    assert "not a 64-bit little-endian ELF file" in err and "no .nv_fatbin section" in err
