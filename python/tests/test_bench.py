"""The benchmark's shapes, flags and reports (no GPU needed; the timed run itself needs one)."""

import csv
import json
import math

import hattn
import pytest
import torch
from hattn import bench, report
from helpers import requires_hopper

KERNELS = [k.name for k in hattn.kernels()]


def timed(rows):
    """The rows of a benchmark CSV but FA3's where its library was not given (checked to say
    so); with the library (HATTN_FA3_LIB on the GPU machine) FA3's rows are timed like the rest."""
    for r in rows:
        if r["status"] == "not given":
            assert r["name"].startswith("fa3") and r["tflops"] == "", r
    return [r for r in rows if r["status"] != "not given"]


def test_grid_is_the_flashattention3_grid():
    shapes = bench.grid_shapes(bench.GRID_DIMS, bench.GRID_SEQLENS, (False, True))
    assert len(shapes) == 3 * 6 * 2
    for s in shapes:
        assert s.batch * s.seqlen_q == 16384 and s.heads_q * s.head_dim == 2048
        assert s.seqlen_q == s.seqlen_k and s.heads_q == s.heads_kv
    caps = bench.capstone_shapes()
    pairs = {(32760, 12), (32760, 40), (75600, 12), (75600, 40)}
    assert {(s.seqlen_q, s.heads_q) for s in caps if s.tag == "capstone"} == pairs
    assert all(s.seqlen_k == s.seqlen_q for s in caps if s.tag == "capstone")
    assert {(s.seqlen_q, s.heads_q) for s in caps if s.tag == "capstone-cross"} == pairs  # to the prompt's keys
    assert all(s.seqlen_k == bench.CROSS_KEYS for s in caps if s.tag == "capstone-cross")
    assert all(s.batch == 1 and s.head_dim == 128 and not s.causal for s in caps)


def test_round_order_varies_the_neighbours():
    n, rounds = 5, 40
    orders = [bench.round_order(n, r) for r in range(rounds)]
    assert all(sorted(order) == list(range(n)) for order in orders)
    assert orders == [bench.round_order(n, r) for r in range(rounds)]  # repeatable
    follows = {(order[i - 1], order[i]) for order in orders for i in range(1, n)}
    assert follows == {(a, b) for a in range(n) for b in range(n) if a != b}
    assert {order[0] for order in orders} == set(range(n))


def test_flops():
    s = bench.Shape("grid", 4, 4096, 4096, 16, 16, 128, False)
    assert s.flops == 4 * 4 * 16 * 4096 * 4096 * 128
    assert bench.Shape("grid", 4, 4096, 4096, 16, 16, 128, True).flops == s.flops / 2


def test_default_flags():
    args = bench.parse_args([], KERNELS)
    assert args.kernel_list == KERNELS
    assert args.anchor_list == list(bench.ANCHORS)
    assert len(args.shapes) == 36 + 8
    assert args.out == "results" and args.reps >= 10 and args.flush_mb >= 256


def test_subset_flags():
    args = bench.parse_args(
        [
            "--dims",
            "128",
            "--seqlens",
            "1k,4096",
            "--causal",
            "yes",
            "--no-capstone",
            "--kernels",
            f"{KERNELS[0]},auto",
            "--reps",
            "3",
        ],
        KERNELS,
    )
    assert [(s.head_dim, s.seqlen_q, s.causal) for s in args.shapes] == [(128, 1024, True), (128, 4096, True)]
    assert args.kernel_list == [KERNELS[0], "auto"] and args.reps == 3
    only_capstone = bench.parse_args(["--no-grid"], KERNELS)
    assert [s.tag for s in only_capstone.shapes] == ["capstone"] * 4 + ["capstone-cross"] * 4


@pytest.mark.parametrize(
    "flags", [["--kernels", "99_nope"], ["--anchors", "sdpa_math"], ["--seqlens", "x"], ["--reps", "0"]]
)
def test_bad_flags(flags, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(flags, KERNELS)
    assert "error" in capsys.readouterr().err


def test_slow_kernels():
    assert bench.is_slow("01_naive") and bench.is_slow("02_fused_online_softmax")
    assert not bench.is_slow("03_mma_sync") and not bench.is_slow("auto")


def synthetic_records():
    """Records as bench_shape makes them, for two grid shapes and a capstone shape."""
    records = []
    shapes = [
        bench.Shape("grid", 32, 512, 512, 16, 16, 128, False),
        bench.Shape("grid", 16, 1024, 1024, 16, 16, 128, True),
        bench.Shape("capstone", 1, 32760, 32760, 12, 12, 128, False),
    ]
    for i, shape in enumerate(shapes):
        base = dict(tag=shape.tag, batch=shape.batch, seqlen_q=shape.seqlen_q, seqlen_k=shape.seqlen_k,
                    heads_q=shape.heads_q, heads_kv=shape.heads_kv, head_dim=shape.head_dim, causal=shape.causal,
                    dtype="bf16", flops=shape.flops, ratio=None, best_anchor=None, tol=0.01, note="")  # fmt: skip
        for name, kind, ms, status in [("sdpa_cudnn", "anchor", 1.0, "ok"), ("sdpa_flash", "anchor", 2.0, "ok"),
                                       (KERNELS[0], "hattn", 50.0, "ok"), (KERNELS[-1], "hattn", 0.9 + i, "ok"),
                                       ("99_broken", "hattn", None, "FAIL")]:  # fmt: skip
            tflops = shape.flops / (ms * 1e9) if ms else None
            err = float("nan") if status == "FAIL" else 0.004
            records.append(dict(base, name=name, kind=kind, ms=ms, tflops=tflops, max_err=err, status=status))
    report.fill_ratios(records)
    return records


def test_ratios_and_summary():
    records = synthetic_records()
    first = [r for r in records if r["seqlen_q"] == 512]
    assert all(r["best_anchor"] == "sdpa_cudnn" for r in first)
    by_name = {r["name"]: r for r in first}
    assert by_name["sdpa_cudnn"]["ratio"] == pytest.approx(1.0)
    assert by_name[KERNELS[-1]]["ratio"] == pytest.approx(1.0 / 0.9)
    assert by_name["99_broken"]["ratio"] is None
    table = report.format_table(records)
    assert "sdpa_flash" in table and "FAIL" in table and "0.50x" in table
    summary = report.format_summary(records)
    assert "FAILED" in summary and KERNELS[-1] in summary


def test_csv_and_json(tmp_path):
    records = synthetic_records()
    report.write_csv(records, tmp_path / "r.csv")
    rows = list(csv.DictReader(open(tmp_path / "r.csv")))
    assert len(rows) == len(records) and set(rows[0]) == set(report.FIELDS)
    report.write_json({"gpu": "test"}, records, tmp_path / "r.json")
    data = json.load(open(tmp_path / "r.json"))  # valid JSON: NaN written as null
    assert data["meta"]["gpu"] == "test" and len(data["results"]) == len(records)
    assert any(r["max_err"] is None and r["status"] == "FAIL" for r in data["results"])


def test_plots(tmp_path):
    pytest.importorskip("matplotlib")
    records = synthetic_records()
    assert report.plot_lineage(records, KERNELS, str(tmp_path / "lineage.png"))
    assert report.plot_vs_anchors(records, str(tmp_path / "anchors.png"))
    for name in ("lineage.png", "anchors.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_main_without_gpu_says_so(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark would run")
    assert bench.main(["--no-capstone", "--dims", "64", "--seqlens", "512"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_varlen_flags_and_shapes():
    args = bench.parse_args(["--varlen", "equal", "--dims", "128", "--seqlens", "512,2k"], KERNELS)
    assert args.kernel_list == KERNELS[-1:]  # only the production forward runs varlen batches
    assert args.anchor_list == list(bench.VARLEN_ANCHORS)
    assert not args.plots
    assert len(args.shapes) == 2 * 2  # no capstone shapes
    for s in args.shapes:
        assert s.tag == "varlen-equal" and s.lengths == (s.seqlen_q,) * s.batch
        dense = bench.Shape("grid", s.batch, s.seqlen_q, s.seqlen_k, s.heads_q, s.heads_kv, s.head_dim, s.causal)
        assert s.flops == dense.flops  # equal lengths: the dense grid point's work


def test_varlen_mixed_lengths():
    shapes = bench.varlen_shapes((64,), (1024,), (False, True), "mixed")
    full, causal = shapes
    assert full.lengths == causal.lengths  # the same batch under both masks
    assert len(full.lengths) == 16 and all(256 <= n <= 1792 for n in full.lengths)
    assert full.seqlen_q == max(full.lengths) and len(set(full.lengths)) > 1
    assert full.flops == 4.0 * full.heads_q * 64 * sum(n * n for n in full.lengths)
    assert causal.flops == full.flops / 2
    assert shapes == bench.varlen_shapes((64,), (1024,), (False, True), "mixed")  # seeded


def test_varlen_anchor_names_are_checked():
    with pytest.raises(SystemExit):
        bench.parse_args(["--varlen", "mixed", "--anchors", "sdpa_cudnn"], KERNELS)
    args = bench.parse_args(["--varlen", "mixed", "--anchors", "varlen_flash"], KERNELS)
    assert args.anchor_list == ["varlen_flash"]


@requires_hopper
def test_timer_head_start_keeps_the_host_out_of_the_times():
    """A call whose host work (50 us of busy waiting) outlasts its GPU work (one small add)
    reads at least the host's time without the GPU's head start, and its GPU time with it."""
    import time

    import torch

    x = torch.zeros(1024, device="cuda")

    def call():
        until = time.perf_counter() + 50e-6
        while time.perf_counter() < until:
            pass
        x.add_(1)

    plain_ms = bench.Timer(1, 0, 10, 1.0, head_start=False).interleaved([call])[0][0]  # medians
    ahead_ms = bench.Timer(1, 0, 10, 1.0, head_start=True).interleaved([call])[0][0]
    assert plain_ms > 0.045
    assert ahead_ms < 0.03


def test_timer_gives_the_head_start_to_short_calls_only():
    class Probe(bench.Timer):  # no GPU: _timed reports call_ms per call and records its flag
        def __init__(self, call_ms):
            self.warmup, self.reps, self.budget_ms, self.head_start = 2, 5, 1000.0, True
            self.call_ms, self.flags = call_ms, []

        def _timed(self, fns, rounds, head_start):
            self.flags.append(head_start)
            return [[self.call_ms] * rounds for _ in fns]

    for call_ms, timed_with_head_start in ((0.05, True), (2.0, False)):
        probe = Probe(call_ms)
        assert [ms for ms, _ in probe.interleaved([lambda: None, lambda: None])] == [call_ms, call_ms]
        assert probe.flags == [True, timed_with_head_start]  # the sizing round, then the timed ones


def test_decode_flag_sets_the_queries():
    argv = ["--seqlen-q", "1", "--dims", "128", "--seqlens", "4k", "--no-capstone", "--causal", "no"]
    args = bench.parse_args(argv, KERNELS)
    assert [(s.seqlen_q, s.seqlen_k, s.batch) for s in args.shapes] == [(1, 4096, 4)]
    assert args.shapes[0].flops == 4.0 * 4 * 16 * 1 * 4096 * 128
    causal = bench.Shape("grid", 4, 1, 4096, 16, 16, 128, True)  # one query sees every key, bottom-right
    assert causal.flops == args.shapes[0].flops
    s = bench.Shape("grid", 1, 4, 10, 1, 1, 64, True)  # rows see 7, 8, 9 and 10 keys
    assert s.flops == 4.0 * 64 * (7 + 8 + 9 + 10)
    for bad in (["--varlen", "equal", "--causal", "no"], ["--causal", "both"]):
        with pytest.raises(SystemExit):  # not with varlen; SDPA's causal is top-left when Sq != Sk
            bench.parse_args(["--seqlen-q", "1", *bad], KERNELS)


def test_gqa_and_tokens_flags_shape_a_decoding_batch():
    argv = ["--seqlen-q", "1", "--dims", "64,128", "--seqlens", "4k", "--no-capstone", "--causal", "no",
            "--gqa", "4", "--tokens", "131072"]  # fmt: skip
    args = bench.parse_args(argv, KERNELS)
    assert [(s.batch, s.heads_q, s.heads_kv, s.head_dim) for s in args.shapes] == [(32, 32, 8, 64), (32, 16, 4, 128)]
    for bad in (["--gqa", "0"], ["--gqa", "3"], ["--tokens", "0"]):
        with pytest.raises(SystemExit):  # 3 does not divide 2048 / 64 = 32 heads
            bench.parse_args(["--dims", "64", *bad], KERNELS)
    with pytest.raises(SystemExit):
        bench.parse_args(["--varlen", "equal", "--gqa", "2"], KERNELS)


def test_backward_bench_flags_and_no_gpu(capsys):
    import torch
    from hattn import bench_backward

    args = bench_backward.parse_args([])
    assert (args.dims, args.seqlens, args.causal) == ("128", "1k,4k,16k", "both")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark would run")
    assert bench_backward.main(["--dims", "64", "--seqlens", "512"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_backward_bench_varlen_flags():
    from hattn import bench_backward

    assert bench_backward.parse_args(["--varlen", "mixed"]).varlen == "mixed"
    assert bench_backward.parse_args(["--deterministic"]).deterministic
    assert bench_backward.parse_args(["--step"]).step
    for bad in (["--step", "--varlen", "mixed"], ["--step", "--kernels", "bwd_sm90"]):
        with pytest.raises(SystemExit):
            bench_backward.parse_args(bad)
    assert not bench_backward.parse_args([]).deterministic
    # cuDNN's varlen backward only when asked for (inf/NaN and a fault on the H200); FA2 the reference
    assert bench_backward.parse_args(["--varlen", "mixed"]).anchor_list == ["varlen_flash", "fa3"]
    args = bench_backward.parse_args(["--varlen", "mixed", "--anchors", "varlen_flash,varlen_cudnn"])
    assert args.anchor_list == ["varlen_flash", "varlen_cudnn"]
    assert bench_backward.parse_args([]).anchor_list == ["sdpa_cudnn", "sdpa_flash", "fa3"]
    for bad in (["--anchors", "varlen_flash"], ["--varlen", "equal", "--anchors", "sdpa_cudnn"],
                ["--anchors", ""], ["--anchors", "sdpa_flash,sdpa_flash"],
                ["--anchors", "fa3"]):  # fmt: skip  (FA3 alone: no torch reference)
        with pytest.raises(SystemExit):
            bench_backward.parse_args(bad)
    with pytest.raises(SystemExit):  # the grid's tokens only
        bench_backward.parse_args(["--varlen", "equal", "--tokens", "4096"])
    args = bench_backward.parse_args(["--varlen", "equal", "--kernels", "bwd_08_dq_overlap"])
    assert args.kernels == "bwd_08_dq_overlap"  # named kernels beside "auto", as for dense batches


def _stub_backward_bench(monkeypatch, make_inputs, backward_fn):
    """python -m hattn.bench_backward on CPU tensors: `make_inputs` and `backward_fn` stand in for
    the GPU's, every implementation is timed at 1 ms, and the environment is a placeholder."""
    import torch
    from hattn import bench_backward

    class Timer:
        def __init__(self, *args):
            pass

        def interleaved(self, fns):
            return [(1.0, 5) for _ in fns]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("HATTN_FA3_LIB", raising=False)  # FA3 not given: its rows say so
    monkeypatch.setattr(bench_backward, "make_inputs", make_inputs)
    monkeypatch.setattr(bench_backward, "backward_fn", backward_fn)
    monkeypatch.setattr(bench_backward, "Timer", Timer)
    monkeypatch.setattr(bench_backward, "environment", lambda: {
        "gpu": "none", "torch": "-", "cudnn": "-", "commit": "-", "sm_clock_mhz_start": 0})  # fmt: skip
    monkeypatch.setattr(bench_backward, "commit", lambda: "-")


def test_backward_bench_gqa_flags(monkeypatch, tmp_path):
    """--gqa R: R query heads per K/V head on the grid, written to pybench_backward_gqaR.csv (CPU
    tensors, stand-in implementations)."""
    import torch
    from hattn import bench_backward

    assert bench_backward.parse_args([]).gqa == 1
    assert bench_backward.parse_args(["--dims", "64,128,256", "--gqa", "4"]).gqa == 4
    for bad in (["--gqa", "0"], ["--dims", "64", "--gqa", "3"], ["--dims", "256", "--gqa", "16"],
                ["--varlen", "mixed", "--gqa", "2"]):  # fmt: skip
        with pytest.raises(SystemExit):  # 3 does not divide 32 heads, 16 not 8
            bench_backward.parse_args(bad)
    seen = []

    def backward_fn(name, q, k, v, dout, causal, step=False):
        seen.append((name, q.shape[2], k.shape[2]))
        return lambda: tuple(torch.ones(1) for _ in range(3))

    def make_inputs(shape, *args, **kwargs):
        q = torch.ones(shape.batch, 1, shape.heads_q, 1)
        kv = torch.ones(shape.batch, 1, shape.heads_kv, 1)
        return q, kv, kv, q

    _stub_backward_bench(monkeypatch, make_inputs, backward_fn)
    flags = ["--dims", "128", "--seqlens", "1024", "--causal", "no", "--gqa", "4", "--out", str(tmp_path)]
    assert bench_backward.main(flags) == 0
    assert set(seen) == {(n, 16, 4) for n in ("hattn", "sdpa_cudnn", "sdpa_flash")}  # 16 query heads, 4 K/V
    with open(tmp_path / "pybench_backward_gqa4.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["heads_q"], r["heads_kv"]) for r in rows} == {("16", "4")}
    assert {r["name"]: r["status"] for r in rows}["fa3"] == "not given"
    assert not (tmp_path / "pybench_backward.csv").exists()  # the dense table is left as it is


def test_backward_bench_window(monkeypatch, tmp_path):
    """--window L: the grid with a sliding window, hattn (and FA3, when given) called with it, torch
    SDPA's anchors left out, gradients checked against the fp32 masked reference, written to
    pybench_backward_window<L>.csv (CPU tensors, stand-in implementations)."""
    import torch
    from hattn import bench_backward

    assert bench_backward.parse_args([]).window == -1
    assert bench_backward.parse_args(["--window", "256"]).window == 256
    for bad in (["--window", "-2"], ["--window", "256", "--varlen", "mixed"]):
        with pytest.raises(SystemExit):
            bench_backward.parse_args(bad)
    seen, references = [], []

    def backward_fn(name, q, k, v, dout, causal, step=False, window=(-1, -1)):
        seen.append((name, causal, window))
        return lambda: tuple(torch.ones(1) for _ in range(3))

    def make_inputs(shape, *args, **kwargs):
        t = torch.ones(shape.batch, 1, shape.heads_q, 1)
        return t, t, t, t

    def window_reference_grads(q, k, v, dout, shape):
        references.append(shape.window_size)
        return tuple(torch.ones(1) for _ in range(3))

    _stub_backward_bench(monkeypatch, make_inputs, backward_fn)
    monkeypatch.setattr(bench_backward, "window_reference_grads", window_reference_grads)
    flags = ["--dims", "128", "--seqlens", "1024", "--window", "256", "--out", str(tmp_path)]
    assert bench_backward.main(flags) == 0
    assert sorted(seen) == [("hattn", False, (256, 256)), ("hattn", True, (256, 0))]  # no SDPA anchor
    assert sorted(references) == [(256, 0), (256, 256)]
    with open(tmp_path / "pybench_backward_window256.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["name"], r["status"]) for r in rows} == {("hattn", "ok"), ("fa3", "not given")}
    assert all(r["ratio_to_best_anchor"] == "" for r in rows)  # no anchor timed: no ratio
    assert not (tmp_path / "pybench_backward.csv").exists()


@pytest.mark.parametrize("failing, reference", [
    ((), "sdpa_cudnn"),
    (("sdpa_cudnn:nan",), "sdpa_flash"),
    (("sdpa_cudnn:raise",), "sdpa_flash"),
    (("sdpa_flash:raise",), "sdpa_cudnn"),
    (("sdpa_cudnn:nan", "sdpa_flash:raise"), None),
    (("sdpa_cudnn:build",), "sdpa_flash"),  # its forward raised: no backward to call
])  # fmt: skip
def test_backward_bench_drops_failing_anchors(monkeypatch, tmp_path, capsys, failing, reference):
    """The reference is the first anchor whose backward ran and gave finite gradients; an anchor
    that raised or gave NaN is not timed and a line says why (CPU tensors, stand-in anchors)."""
    import torch
    from hattn import bench_backward

    ones = torch.ones(2, 4, 2, 8)
    bad = dict(f.split(":") for f in failing)

    def backward_fn(name, q, k, v, dout, causal, step=False):
        if bad.get(name) == "build":
            raise RuntimeError(f"{name} does not take this shape\nsecond line")

        def call():
            if bad.get(name) == "raise":
                raise RuntimeError(f"{name} failed\nsecond line")
            fill = float("nan") if bad.get(name) == "nan" else 1.0
            return tuple(torch.full_like(ones, fill) for _ in range(3))
        return call

    _stub_backward_bench(monkeypatch, lambda *a, **kw: (ones,) * 4, backward_fn)
    flags = ["--dims", "64", "--seqlens", "256", "--causal", "no", "--tokens", "512", "--out", str(tmp_path)]
    rc = bench_backward.main(flags)
    out = capsys.readouterr().out
    for name in bad:
        assert f"# {name}: " in out  # the line that says why
    if reference is None:
        assert rc == 3 and "no anchor ran" in out
        return
    assert rc == 0
    with open(tmp_path / "pybench_backward.csv") as f:
        status = {r["name"]: r["status"] for r in csv.DictReader(f)}
    assert status.pop(reference) == "reference" and status.pop("hattn") == "ok"
    assert status.pop("fa3") == "not given"  # its library not given: a row that says so
    assert set(status) == {"sdpa_cudnn", "sdpa_flash"} - set(bad) - {reference}  # failed anchors not timed


@requires_hopper
def test_backward_bench_varlen_runs_and_checks(tmp_path):
    from hattn import bench_backward

    flags = ["--varlen", "mixed", "--dims", "64", "--seqlens", "1024", "--reps", "2", "--out", str(tmp_path),
             "--kernels", "bwd_sm90,bwd_07_dkdv_direct"]  # fmt: skip
    assert bench_backward.main(flags) == 0
    with open(tmp_path / "pybench_backward_varlen_mixed.csv") as f:
        rows = list(csv.DictReader(f))
    # cuDNN's only with --anchors; B07 (the lineage: dense batches) refuses packed ones and is not timed
    assert {r["name"] for r in rows} == {"hattn", "hattn:bwd_sm90", "varlen_flash", "fa3"}
    assert all(float(r["tflops"]) > 0 and int(r["tokens"]) > 0 for r in timed(rows))
    assert [r["status"] for r in rows if r["name"].startswith("hattn")] == ["ok"] * 4  # 2 kernels x full, causal


@requires_hopper
def test_backward_bench_runs_and_checks(tmp_path):
    from hattn import bench_backward

    flags = ["--dims", "64", "--seqlens", "256", "--tokens", "512", "--reps", "2", "--out", str(tmp_path),
             "--kernels", "bwd_02_mma_sync"]  # fmt: skip
    assert bench_backward.main(flags) == 0
    with open(tmp_path / "pybench_backward.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["name"] for r in rows} == {"hattn", "hattn:bwd_02_mma_sync", "sdpa_cudnn", "sdpa_flash", "fa3"}
    assert all(float(r["tflops"]) > 0 for r in timed(rows))
    assert [r["status"] for r in rows if r["name"].startswith("hattn")] == ["ok"] * 4  # 2 shapes x 2


# --- python -m hattn.bench_fp8 ----------------------------------------------------------------------------


def test_fp8_bench_flags():
    from hattn import bench_fp8

    args = bench_fp8.parse_args([])
    assert (args.seqlens, args.causal, args.out) == ("1k,4k,16k", "both", "results")
    assert [(s.seqlen_q, s.causal) for s in args.shapes] == [(n, c) for n in (1024, 4096, 16384) for c in (False, True)]
    for s in args.shapes:
        assert s.batch * s.seqlen_q == 16384 and (s.heads_q, s.heads_kv, s.head_dim) == (16, 16, 128)
    args = bench_fp8.parse_args(["--seqlens", "2k", "--causal", "yes", "--reps", "3", "--out", "/tmp/x"])
    assert [(s.seqlen_q, s.batch, s.causal) for s in args.shapes] == [(2048, 8, True)]
    assert args.reps == 3 and args.out == "/tmp/x"
    for bad in (["--seqlens", "x"], ["--seqlens", ""], ["--causal", "maybe"], ["--reps", "0"]):
        with pytest.raises(SystemExit):
            bench_fp8.parse_args(bad)


def test_fp8_bench_quantizes_per_batch_and_head():
    import torch
    from hattn import bench_fp8

    t = torch.randn(2, 64, 4, 128) * torch.tensor([1.0, 10.0, 0.1, 3.0])[:, None]  # heads of different ranges
    codes, descale = bench_fp8.quantize(t, heads_kv=2)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == t.shape
    assert descale.dtype == torch.float32 and descale.shape == (2, 2)
    assert codes.float().abs().amax().item() == 448.0  # each group's largest value maps to 448
    back = bench_fp8.dequantize(codes, descale, torch.float32)
    assert ((back - t).abs() <= t.abs() / 16 + descale.max() * 2**-9).all()  # e4m3: 3 mantissa bits


def test_fp8_bench_without_gpu_says_so(capsys):
    import torch
    from hattn import bench_fp8

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark would run")
    assert bench_fp8.main(["--seqlens", "512"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("fp8_error, status, rc, fa3_given, fp64",
                         [(1e-3, "ok", 0, False, False), (0.5, "FAIL", 1, False, False),
                          (float("nan"), "FAIL", 1, False, False), (1e-3, "ok", 0, True, False),
                          (1e-3, "ok", 0, True, True)])  # fmt: skip
def test_fp8_bench_checks_and_writes_csv(monkeypatch, tmp_path, capsys, fp8_error, status, rc, fa3_given, fp64):
    """main's flow on CPU stand-ins: every implementation checked against cuDNN's output, the
    passing ones timed, the CSV written with one row per (shape, implementation). Without an
    FA3 library its rows say "not given" and its calls never run."""
    import torch
    from hattn import bench_fp8, fa3

    ref = torch.ones(2, 8, 2, 128)

    def not_called():
        raise AssertionError("FA3 called without its library")

    def implementations(shape):
        fa3_out = (lambda: ref + 2e-3) if fa3_given else not_called
        return {
            "hattn_fp8": ("e4m3", lambda: ref + fp8_error),
            "hattn_bf16": ("bf16", lambda: ref.clone()),
            "fa3_fp8": ("e4m3", fa3_out),
            "fa3_bf16": ("bf16", (lambda: ref.clone()) if fa3_given else not_called),
            "sdpa_cudnn": ("bf16", lambda: ref.clone()),
            "sdpa_flash": ("bf16", lambda: ref.clone()),
        }

    monkeypatch.delenv(fa3.ENV_VAR, raising=False)
    if fa3_given:
        monkeypatch.setattr(fa3, "load", lambda given: None)

    class Timer:
        def __init__(self, *args):
            pass

        def interleaved(self, fns):
            return [(1.0 + i, 5) for i in range(len(fns))]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(bench_fp8, "implementations", implementations)
    monkeypatch.setattr(bench_fp8, "Timer", Timer)
    monkeypatch.setattr(bench_fp8, "sm_clock_mhz", lambda: "1980")
    monkeypatch.setattr(bench_fp8, "environment", lambda: {
        "gpu": "stand-in", "torch": "-", "cudnn": "-", "commit": "abc", "sm_clock_mhz_start": "1980"})  # fmt: skip
    monkeypatch.setattr(bench_fp8, "fp64_reference", lambda shape: ref.double())
    assert bench_fp8.main(["--seqlens", "1k", "--causal", "no", "--out", str(tmp_path)]
                          + (["--fp64-errors"] if fp64 else [])) == rc  # fmt: skip
    with open(tmp_path / "pybench_fp8.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(bench_fp8.FIELDS)
    by = {r["name"]: r for r in rows}
    assert list(by) == list(bench_fp8.NAMES)
    assert by["hattn_fp8"]["status"] == status and by["hattn_fp8"]["dtype"] == "e4m3"
    assert by["sdpa_cudnn"]["status"] == "ok" and by["sdpa_cudnn"]["tol"] == ""  # the reference
    assert all(r["commit"] == "abc" and r["gpu"] == "stand-in" and r["heads"] == "16" for r in rows)
    if status == "ok":
        assert float(by["hattn_fp8"]["tflops"]) > 0
        assert float(by["hattn_fp8"]["max_err"]) == pytest.approx(1e-3, rel=1e-3)  # fp32 1 + 1e-3
        assert float(by["sdpa_flash"]["ratio_to_best_bf16_anchor"]) <= 1.0
        assert float(by["sdpa_flash"]["ratio_to_best_anchor"]) <= 1.0
    if fa3_given:  # within the FP8 bound, timed, and an anchor of both ratios
        assert by["fa3_fp8"]["status"] == "ok" and float(by["fa3_fp8"]["tflops"]) > 0
        assert by["fa3_bf16"]["status"] == "ok" and float(by["fa3_bf16"]["tflops"]) > 0
    else:
        assert by["fa3_fp8"]["status"] == by["fa3_bf16"]["status"] == "not given"
        assert by["fa3_fp8"]["ms"] == "" and "--fa3" in by["fa3_fp8"]["note"]
    if status != "ok":
        assert by["hattn_fp8"]["ms"] == "" and "hattn_fp8: FAIL" in capsys.readouterr().out  # not timed
    if fp64:  # against the float64 reference: ours 1e-3 off, FA3's 2e-3 (fp32 rounding of 1 + x)
        assert float(by["hattn_fp8"]["err64_max"]) == pytest.approx(1e-3, rel=1e-3)
        assert float(by["fa3_fp8"]["err64_max"]) == pytest.approx(2e-3, rel=1e-3)
        assert float(by["sdpa_cudnn"]["err64_rms"]) == 0.0
        assert "(fa3_fp8 0.002: x0.50)" in capsys.readouterr().out
    else:
        assert all(r["err64_max"] == r["err64_rms"] == "" for r in rows)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp8_bench_fp64_reference(monkeypatch, causal):
    """attention_fp64 on CPU codes: torch's float64 attention of the dequantized values, GQA and a
    query count that is no multiple of the row block included; fp64_errors' max and RMS."""
    import torch
    import torch.nn.functional as F
    from hattn import bench_fp8

    monkeypatch.setattr(bench_fp8, "FP64_ROWS", 3)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, s, h, 64, generator=gen) for s, h in ((7, 4), (11, 2), (11, 2)))
    (q8, qd), (k8, kd), (v8, vd) = (bench_fp8.quantize(t, heads_kv=2) for t in (q, k, v))
    got = bench_fp8.attention_fp64(q8, qd, k8, kd, v8, vd, causal)
    exact = [(c.double() * d.double().repeat_interleave(c.shape[2] // 2, dim=1)[:, None, :, None]).transpose(1, 2)
             for c, d in ((q8, qd), (k8, kd), (v8, vd))]  # codes x descale, exact in float64
    mask = torch.ones(7, 11, dtype=torch.bool).tril(diagonal=11 - 7) if causal else None
    want = F.scaled_dot_product_attention(*exact, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    assert got.dtype == torch.float64 and torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    worst, rms = bench_fp8.fp64_errors((want + 0.25).float(), want)
    assert worst == pytest.approx(0.25, rel=1e-6) and rms == pytest.approx(0.25, rel=1e-6)
    assert math.isnan(bench_fp8.fp64_errors(torch.full_like(want, float("nan")), want)[0])


@requires_hopper
def test_fp8_bench_runs_and_checks(tmp_path):
    from hattn import bench_fp8

    assert bench_fp8.main(["--seqlens", "512", "--tokens", "1024", "--reps", "2", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "pybench_fp8.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["name"] for r in rows} == set(bench_fp8.NAMES) and len(rows) == 2 * len(bench_fp8.NAMES)
    assert all(r["status"] == "ok" and float(r["tflops"]) > 0 for r in timed(rows))


def test_kernel_times_flags_and_no_gpu(capsys):
    import torch
    from hattn import kernel_times

    args = kernel_times.parse_args([])
    assert (args.dims, args.seqlens, args.causal, args.impls) == ("128", "1k,16k", "both", list(kernel_times.IMPLEMENTATIONS))
    with pytest.raises(SystemExit):
        kernel_times.parse_args(["--impls", "hattn,nonesuch"])
    assert "unknown nonesuch" in capsys.readouterr().err
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the profile would run")
    assert kernel_times.main(["--dims", "64", "--seqlens", "512"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


@requires_hopper
def test_kernel_times_lists_each_backward_kernel(tmp_path):
    from hattn import kernel_times

    assert kernel_times.main(["--dims", "64", "--seqlens", "512", "--causal", "no", "--impls", "hattn,sdpa_cudnn",
                              "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "kernel_times.csv")))
    ours = [r["kernel"] for r in rows if r["impl"] == "hattn"]
    # The backward's three kernels: delta, the main pass, dQ's conversion.
    assert any("delta_kernel" in k for k in ours) and any("convert_kernel" in k for k in ours), ours
    assert all(float(r["us"]) > 0 for r in rows)
    assert any(r["impl"] == "sdpa_cudnn" for r in rows)


def test_window_flags_shapes_and_flops():
    args = bench.parse_args(["--window", "1024", "--dims", "128", "--seqlens", "1k,4k"], ["fwd_sm90"])
    assert [s.tag for s in args.shapes] == ["window1024"] * 4 and not args.capstone and not args.plots
    assert {s.window_size for s in args.shapes} == {(1024, 1024), (1024, 0)}
    # FLOPs count the visible entries, bottom-right aligned, against a brute-force count.
    for shape in (bench.Shape("w", 2, 7, 9, 3, 1, 64, True, window=2), bench.Shape("w", 1, 9, 7, 2, 2, 64, False, window=3)):
        left, right = shape.window_size
        offset = shape.seqlen_k - shape.seqlen_q
        visible = sum(1 for i in range(shape.seqlen_q) for j in range(shape.seqlen_k)
                      if i + offset - left <= j <= i + offset + right)  # fmt: skip
        assert shape.flops == 4.0 * shape.batch * shape.heads_q * shape.head_dim * visible
    wide = bench.Shape("w", 1, 64, 64, 1, 1, 64, True, window=64)  # wider than the keys: plain causal
    assert wide.flops == bench.Shape("g", 1, 64, 64, 1, 1, 64, True).flops + 4.0 * 64 * 64 / 2
    for flags in (["--window", "-2"], ["--window", "8", "--varlen", "mixed"], ["--window", "8", "--seqlen-q", "1"]):
        with pytest.raises(SystemExit):
            bench.parse_args(flags, ["fwd_sm90"])


def test_varlen_short_sequences():
    args = bench.parse_args(["--varlen", "short", "--dims", "64,128", "--causal", "yes"], ["fwd_sm90"])
    assert [s.tag for s in args.shapes] == ["varlen-short"] * 2
    for shape in args.shapes:
        assert sum(shape.lengths) >= bench.SHORT_TOKENS and shape.batch == len(shape.lengths)
        assert all(bench.SHORT_LENGTHS[0] <= n <= bench.SHORT_LENGTHS[1] for n in shape.lengths)
        assert shape.seqlen_q == max(shape.lengths)


def test_paged_flags_and_cache():
    argv = ["--paged", "256", "--seqlen-q", "1", "--causal", "no", "--dims", "128", "--seqlens", "4k", "--tokens", "65536"]
    args = bench.parse_args(argv, ["fwd_sm90"])
    assert [(s.tag, s.page_size, s.seqlen_q, s.batch) for s in args.shapes] == [("paged256", 256, 1, 16)]
    assert not args.capstone and not args.plots
    for flags in (["--paged", "100"], ["--paged", "128", "--varlen", "mixed"], ["--paged", "128", "--window", "8"]):
        with pytest.raises(SystemExit):
            bench.parse_args(flags, ["fwd_sm90"])
    # The paged cache holds the same keys: gathering the pages by the block table gives k back.
    k, v = torch.randn(3, 300, 2, 8), torch.randn(3, 300, 2, 8)
    k_cache, v_cache, table, lens = bench.paged_cache(k, v, 128)
    assert table.shape == (3, 3) and sorted(table.flatten().tolist()) == list(range(9))
    for cache, want in ((k_cache, k), (v_cache, v)):
        gathered = cache[table.long()].flatten(1, 2)[:, :300]
        assert torch.equal(gathered, want)
    assert lens.tolist() == [300] * 3 and lens.dtype == torch.int32
