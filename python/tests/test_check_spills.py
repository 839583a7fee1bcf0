"""tools/check_spills.py (CPU only): ptxas spill reports against the budget."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("check_spills", ROOT / "tools" / "check_spills.py")
check_spills = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_spills)

# Two kernels of one file, as ptxas -v reports them (the namespace hashes are made up).
LOG = """\
ptxas info    : Compiling entry function '_ZN5hattn44_GLOBAL__N__7ab585e4_11_08_x_cu_80030f6b11main_kernelI6__halfLi128EEEvv' for 'sm_90a'
ptxas info    : Function properties for _ZN5hattn44_GLOBAL__N__7ab585e4_11_08_x_cu_80030f6b11main_kernelI6__halfLi128EEEvv
    24 bytes stack frame, 24 bytes spill stores, 28 bytes spill loads
ptxas info    : Used 255 registers, used 16 barriers
ptxas info    : Compiling entry function '_ZN5hattn44_GLOBAL__N__7ab585e4_11_08_x_cu_80030f6b11main_kernelI6__halfLi64EEEvv' for 'sm_90a'
ptxas info    : Function properties for _ZN5hattn44_GLOBAL__N__7ab585e4_11_08_x_cu_80030f6b11main_kernelI6__halfLi64EEEvv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 178 registers, used 16 barriers
"""


def test_log_gives_each_kernel_its_spill_stores_by_file_and_template_arguments():
    spills = check_spills.parse_log(LOG)
    assert spills == {"08_x main_kernelI6__halfLi128EEEvv": 24, "08_x main_kernelI6__halfLi64EEEvv": 0}


def test_named_namespaces_give_their_folder_as_the_stem():
    assert check_spills.kernel_key("_ZN5hattn3fwd14forward_kernelIvEEvv") == "attention forward_kernelIvEEvv"
    assert check_spills.kernel_key("_ZN5hattn3bwd15backward_kernelIvEEvv") == "attention_backward backward_kernelIvEEvv"
    assert check_spills.kernel_key("_ZN5hattn3mla17mla_decode_kernelIvEEvv") == "mla mla_decode_kernelIvEEvv"


def test_a_kernel_without_a_budget_line_must_not_spill():
    failures, _ = check_spills.check(check_spills.parse_log(LOG), [])
    assert failures == ["08_x main_kernelI6__halfLi128EEEvv: 24 bytes of spill stores, budget 0"]


def test_a_budget_line_allows_its_kernels_that_many_bytes_and_says_when_it_is_loose():
    budget = check_spills.parse_budget("08_x  main_kernelI\\w+?Li128E  24   # comment\n")
    assert check_spills.check(check_spills.parse_log(LOG), budget) == ([], [])
    budget = check_spills.parse_budget("08_x  main_kernelI\\w+?Li128E  40\n")
    failures, loose = check_spills.check(check_spills.parse_log(LOG), budget)
    assert failures == [] and loose == ["08_x main_kernelI6__halfLi128EEEvv: 24 bytes of spill stores, budget 40"]
    budget = check_spills.parse_budget("08_x  main_kernelI\\w+?Li128E  16\n")
    assert check_spills.check(check_spills.parse_log(LOG), budget)[0] != []


def test_the_committed_budget_parses():
    assert len(check_spills.parse_budget((ROOT / "tools" / "spill_budget.txt").read_text())) > 0


def test_a_build_with_another_nvcc_is_not_checked(tmp_path, capsys):
    (tmp_path / "build.log").write_text(LOG)
    (tmp_path / "budget.txt").write_text("nvcc 13.0\n")  # no line for 08_x: its 24 bytes are over
    args = ["check_spills.py", str(tmp_path / "build.log"), "--budget", str(tmp_path / "budget.txt")]
    assert check_spills.main(args + ["--nvcc", "13.0.88"]) == 1
    assert check_spills.main(args + ["--nvcc", "12.8.1"]) == 0
    assert "not checked" in capsys.readouterr().out
