"""FlashAttention-3 as the benchmarks' optional anchor: found only when given, a wrong path is
an error that names where it came from, and no test needs the library (CPU; the GPU runs of
the benchmarks in test_bench.py time it when HATTN_FA3_LIB names it)."""

import pytest
from hattn import bench, bench_backward, bench_fp8, capstone, fa3

KERNELS = ["16_coalesced_store", "fwd_sm90"]


@pytest.fixture(autouse=True)
def no_library(monkeypatch):
    monkeypatch.delenv(fa3.ENV_VAR, raising=False)


def test_the_flag_comes_before_the_environment(monkeypatch):
    assert fa3.library_path(None) is None
    monkeypatch.setenv(fa3.ENV_VAR, "/from/env.so")
    assert fa3.library_path(None) == "/from/env.so"
    assert fa3.library_path("/from/flag.so") == "/from/flag.so"


def test_not_given_is_not_an_error():
    assert fa3.check_path(None) is None
    assert fa3.load(None) == fa3.NOT_GIVEN
    assert "--fa3" in fa3.NOT_GIVEN and fa3.ENV_VAR in fa3.NOT_GIVEN


def test_a_missing_file_names_its_source(monkeypatch, tmp_path):
    missing = str(tmp_path / "nope.so")
    assert fa3.check_path(missing) == f"--fa3: no such file: {missing}"
    monkeypatch.setenv(fa3.ENV_VAR, missing)
    assert fa3.check_path(None) == f"{fa3.ENV_VAR}: no such file: {missing}"
    assert fa3.load(None) == fa3.check_path(None)


def test_a_file_that_is_no_library_does_not_load(tmp_path):
    fake = tmp_path / "fake.so"
    fake.write_text("not a shared library")
    why = fa3.load(str(fake))
    assert why is not None and why.startswith(f"FlashAttention-3 library {fake} did not load")


@pytest.mark.parametrize("parse", [
    lambda argv: bench.parse_args(argv, KERNELS),
    bench_backward.parse_args,
    bench_fp8.parse_args,
    capstone.parse_args,
])  # fmt: skip
def test_every_benchmark_refuses_a_wrong_path(parse, tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse(["--fa3", str(tmp_path / "nope.so")])
    assert "--fa3: no such file" in capsys.readouterr().err


def test_every_benchmark_has_an_fa3_column_by_default():
    assert "fa3" in bench.parse_args([], KERNELS).anchor_list
    assert "fa3" in bench.parse_args(["--varlen", "mixed"], KERNELS).anchor_list
    assert "fa3" in bench_backward.parse_args([]).anchor_list
    assert "fa3" in bench_backward.parse_args(["--varlen", "equal"]).anchor_list
    assert {"fa3_fp8", "fa3_bf16"} <= set(bench_fp8.NAMES)
    assert "fa3" in capstone.parse_args([]).variant_list


def test_capstone_hands_fa3_only_what_it_takes():
    import torch

    q = torch.zeros(1, 4, 8, 128, dtype=torch.bfloat16)
    kv = torch.zeros(1, 2, 16, 128, dtype=torch.bfloat16)
    why = capstone.fa3_fallback_reason
    assert why(q, kv, kv, None, 0.0, False, True) == "not 4-d bf16 CUDA tensors"  # CPU tensors
    assert why(q, kv, kv, torch.zeros(8, 16), 0.0, False, True) == "a mask or dropout"
    assert why(q, kv, kv, None, 0.1, False, True) == "a mask or dropout"
