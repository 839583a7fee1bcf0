"""tools/gen_docs.py (CPU only): the results stamps' timing clause follows hattn-bench's --settle, and
the A/B table of one hattn-bench run."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "tools" / "gen_docs.py")
gen_docs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen_docs)


def row(commit, kernel, settle=None, gemm=790.0):
    r = {"commit": commit, "gpu": "NVIDIA H200", "kernel": kernel, "sm_clock_mhz": 1800.0, "gemm_tflops": gemm}
    if settle is not None:
        r["settle_s"] = settle
    return r


PATH = ROOT / "results" / "lineage.csv"


def test_a_run_without_settle_is_stamped_as_bursts():
    stamp = gen_docs.provenance([row("abc", "08_x"), row("abc", "09_y")], PATH)
    assert "each point timed as a burst after its setup" in stamp
    assert stamp.count("timed") == 1


def test_a_settled_run_says_how_long():
    stamp = gen_docs.provenance([row("abc", "08_x", "2.5")], PATH)
    assert "each point timed after 2.5 s of untimed calls" in stamp and "burst" not in stamp


def test_runs_timed_differently_get_a_clause_each():
    stamp = gen_docs.provenance([row("abc", "08_x"), row("def", "16_y", "3")], PATH)
    assert "commit `abc` (kernels 08), SM clock 1800 MHz, each point timed as a burst after its setup" in stamp
    assert "commit `def` (kernels 16), SM clock 1800 MHz, each point timed after 3 s of untimed calls" in stamp


def test_two_runs_at_one_commit_get_a_clause_each():
    # The lineage split across device calls: one commit, two hattn-bench runs, two GEMM ceilings.
    stamp = gen_docs.provenance([row("abc", "01_x", "0.5", 771.2), row("abc", "08_y", "0.5", 780.0)], PATH)
    assert "commit `abc` (kernels 01), SM clock 1800 MHz, cuBLAS bf16 GEMM ceiling 771 TFLOP/s" in stamp
    assert "commit `abc` (kernels 08), SM clock 1800 MHz, cuBLAS bf16 GEMM ceiling 780 TFLOP/s" in stamp
    assert stamp.count("each point timed after 0.5 s of untimed calls") == 1  # said once, for both runs


AB_HEADER = ("commit,gpu,sm_clock_mhz,gemm_tflops,kernel,dtype,head_dim,causal,batch,seqlen_q,seqlen_k,heads_q,"
             "heads_kv,reps,ms,tflops,pct_gemm,max_err,err_budget,check,gbps")


def ab_table_of(tmp_path, monkeypatch, rows):
    """gen_docs.ab_table of a hattn-bench CSV with these data rows."""
    monkeypatch.setattr(gen_docs, "ROOT", tmp_path)
    path = tmp_path / "ab.csv"
    path.write_text("\n".join([AB_HEADER, *rows]) + "\n")
    return gen_docs.ab_table(path)


def test_ab_table_puts_kernels_side_by_side(tmp_path, monkeypatch):
    # Two kernels of one hattn-bench run: a column each, the last over the first, the check.
    table = ab_table_of(tmp_path, monkeypatch, [
        "abc,NVIDIA H200,1980,0,k_old,bf16,64,0,16,1024,1024,32,32,20,1.0,200.0,0,0,1,PASS,0",
        "abc,NVIDIA H200,1980,0,k_new,bf16,64,0,16,1024,1024,32,32,20,1.0,250.0,0,0,1,PASS,0"])
    assert "| `k_old` | `k_new` | k_new / k_old | check |" in table
    assert "| D=64 full S=1024 B=16 H=32 | 200.0 | 250.0 | 1.250 | PASS |" in table
    assert "commit `abc`" in table


def test_ab_table_shows_a_refused_shape_as_a_dash(tmp_path, monkeypatch):
    # hattn-bench writes a refused shape as a row of zeros with check "unsupported": no 0.0
    # TFLOP/s in the table, no 0 MHz clock, and no ratio where either end is missing.
    table = ab_table_of(tmp_path, monkeypatch, [
        "abc,NVIDIA H200,0,0,k_old,bf16,128,0,16,1024,1024,16,16,0,0,0,0,0,0,unsupported,0",
        "abc,NVIDIA H200,1980,0,k_new,bf16,128,0,16,1024,1024,16,16,20,1.0,250.0,0,0,1,PASS,0"])
    assert "| D=128 full S=1024 B=16 H=16 | – | 250.0 | – | PASS |" in table
    assert "SM clock at the start 1980 MHz" in table


def test_ab_table_names_the_kv_heads_of_a_gqa_shape(tmp_path, monkeypatch):
    # hattn-bench --gqa 4: 32 query heads over 8 K/V heads reads H=32:8; without GQA, H=32.
    table = ab_table_of(tmp_path, monkeypatch, [
        "abc,NVIDIA H200,1980,0,k_old,bf16,64,0,16,1024,1024,32,8,20,1.0,200.0,0,0,1,PASS,0",
        "abc,NVIDIA H200,1980,0,k_new,bf16,64,0,16,1024,1024,32,8,20,1.0,220.0,0,0,1,PASS,0",
        "abc,NVIDIA H200,1980,0,k_old,bf16,64,0,4,4096,4096,32,32,20,1.0,300.0,0,0,1,PASS,0",
        "abc,NVIDIA H200,1980,0,k_new,bf16,64,0,4,4096,4096,32,32,20,1.0,300.0,0,0,1,PASS,0"])
    assert "| D=64 full S=1024 B=16 H=32:8 | 200.0 | 220.0 | 1.100 | PASS |" in table
    assert "| D=64 full S=4096 B=4 H=32 | 300.0 | 300.0 | 1.000 | PASS |" in table


def test_anchors_table_shows_the_chosen_steps_and_rates_all():
    import csv
    import json

    folder = ROOT / "build" / "test_gen_docs"  # git-ignored; the table names its path relative to ROOT
    folder.mkdir(parents=True, exist_ok=True)
    fields = ["tag", "head_dim", "causal", "seqlen_q", "batch", "heads_q", "name", "status", "tflops"]
    shape = ["grid", 128, False, 4096, 4, 16]
    rows = [shape + [name, "ok", t] for name, t in
            (("sdpa_cudnn", 500.0), ("03_mma_sync", 50.0), ("08_warp_specialization", 400.0),
             ("16_coalesced_store", 550.0), ("99_probe", 600.0))]
    with open(folder / "pybench.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(fields)
        w.writerows(rows)
    meta = {"gpu": "NVIDIA H200", "commit": "abc", "torch": "2.11", "cudnn": "91900"}
    (folder / "pybench.json").write_text(json.dumps({"meta": meta, "results": []}))
    table = gen_docs.anchors_table(folder / "pybench.csv")
    header = next(line for line in table.splitlines() if line.startswith("| shape"))
    assert header == "| shape | cuDNN | 08_warp_specialization | 16_coalesced_store | ours / best anchor |"
    assert "Steps 03, 99 are in the CSV only." in table
    assert "| grid D=128 full S=4096 B=4 H=16 |" not in table  # grid rows carry no tag
    assert "| D=128 full S=4096 B=4 H=16 | 500 | 400 | 550 | 1.20 |" in table  # 99's 600 / 500


MLA_HEAD = "commit,gpu,sm_clock_mhz,name,batch,seqlen_k,heads_q,seqlen_q,rows,ms,reps,gbps,hbm_fraction,tflops,max_err,tol,status"
MLA_OURS = "abcdef123456,NVIDIA H200,1980,hattn_mla,64,4096,16,1,16,0.10,50,4300,0.90,95,0.001,0.01,ok"
MLA_TORCH = "abcdef123456,NVIDIA H200,1980,torch_mla,64,4096,16,1,16,0.30,50,1400,0.30,31,,,ok"


def test_mla_table_rates_ours_beside_torch_and_fa3(tmp_path, monkeypatch):
    monkeypatch.setattr(gen_docs, "ROOT", tmp_path)
    path = tmp_path / "pybench_mla.csv"
    lines = [MLA_HEAD,
             MLA_OURS,
             MLA_TORCH,
             "abcdef123456,NVIDIA H200,1980,fa3_mla,64,4096,16,1,16,0.12,50,3600,0.75,80,,,ok"]
    path.write_text("\n".join(lines) + "\n")
    table = gen_docs.mla_table(path)
    assert "| 64 | 4096 | 16 x 1 | 4300 | 0.90 | 95 | 3.00 | 1.20 | – | ok |" in table
    assert "commit `abcdef123456`" in table


def test_status_rates_mla_over_its_best_anchor(tmp_path, monkeypatch):
    monkeypatch.setattr(gen_docs, "ROOT", tmp_path)
    (tmp_path / "results").mkdir()
    lines = [MLA_HEAD,
             MLA_OURS,
             MLA_TORCH,
             "abcdef123456,NVIDIA H200,1980,fa3_mla,64,4096,16,1,16,0.12,50,3600,0.75,80,,,ok",
             "abcdef123456,NVIDIA H200,1980,hattn_mla,64,4096,128,2,256,0.50,50,900,0.20,700,0.001,0.01,ok",
             "abcdef123456,NVIDIA H200,1980,torch_mla,64,4096,128,2,256,0.45,50,990,0.22,780,,,ok"]
    (tmp_path / "results" / "pybench_mla.csv").write_text("\n".join(lines) + "\n")
    row = next(line for line in gen_docs.status_table().splitlines() if line.startswith("| MLA decoding"))
    # 0.12 / 0.10 and 0.45 / 0.50: the best anchor of each point over ours.
    assert "| FA3, torch (bmm + softmax) | 0.90 | 1.05 | 1 of 2 | `results/pybench_mla.csv` at `abcdef1` |" in row


def test_mla_table_states_the_ceilings_of_its_run(tmp_path, monkeypatch):
    monkeypatch.setattr(gen_docs, "ROOT", tmp_path)
    (tmp_path / "results").mkdir()
    path = tmp_path / "results" / "pybench_mla.csv"
    lines = [MLA_HEAD,
             "abcdef123456,NVIDIA H200,1980,ceiling_copy,,,,,,1.00,50,4300,0.8958,,,,ok",
             "abcdef123456,NVIDIA H200,1980,ceiling_cublas,,,,,,1.40,50,,,785,,,ok",
             MLA_OURS,
             MLA_TORCH]
    path.write_text("\n".join(lines) + "\n")
    table = gen_docs.mla_table(path)
    assert "| 64 | 4096 | 16 x 1 | 4300 | 0.90 | 95 | 3.00 | – | – | ok |" in table
    assert "copy moved 4300 GB/s (read plus written, 0.90 of 4.8 TB/s)" in table
    assert "ran at 785 TFLOP/s" in table
    row = next(line for line in gen_docs.status_table().splitlines() if line.startswith("| MLA decoding"))
    assert "| 3.00 | 3.00 | 1 of 1 |" in row  # the ceilings are not points


def test_mla_table_without_results_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(gen_docs, "ROOT", tmp_path)
    assert "No results yet" in gen_docs.mla_table(tmp_path / "pybench_mla.csv")


BWD_HEAD = ("commit,gpu,sm_clock_mhz,name,dtype,head_dim,causal,batch,seqlen,heads_q,heads_kv,tokens,ms,reps,tflops,"
            "ratio_to_best_anchor,max_err_dq,max_err_dk,max_err_dv,status")


def test_status_names_a_run_that_was_not_on_the_h200(tmp_path, monkeypatch):
    monkeypatch.setattr(gen_docs, "ROOT", tmp_path)
    (tmp_path / "results").mkdir()
    for name, gpu in (("pybench_backward.csv", "NVIDIA H200"), ("pybench_backward_fa3.csv", "NVIDIA H100 80GB HBM3")):
        lines = [BWD_HEAD,
                 f"abcdef123456,{gpu},1980,hattn,bf16,64,False,16,1024,32,32,16384,1.0,20,335,0.80,0,0,0,ok",
                 f"abcdef123456,{gpu},1980,fa3,bf16,64,False,16,1024,32,32,16384,0.8,20,410,,0,0,0,ok"]
        (tmp_path / "results" / name).write_text("\n".join(lines) + "\n")
    rows = gen_docs.status_table().splitlines()
    plain = next(r for r in rows if r.startswith("| backward, bf16 (dq, dk, dv)"))
    beside = next(r for r in rows if r.startswith("| backward, bf16, beside FA3"))
    assert plain.endswith("`results/pybench_backward.csv` at `abcdef1` |")  # the H200: no note
    assert beside.endswith("`results/pybench_backward_fa3.csv` at `abcdef1`, on the H100 |")
    assert "| FA3 | 0.80 | 0.80 | 0 of 1 |" in beside
    # A results file that is not there gives no row of its own.
    assert not any(r.startswith("| backward, varlen (mixed lengths), beside FA3") for r in rows)


def test_capstone_rows_come_from_each_folder_with_their_gpu(tmp_path, monkeypatch):
    import json

    monkeypatch.setattr(gen_docs, "ROOT", tmp_path)
    (tmp_path / "results").mkdir()
    for folder, gpu, variants in (("capstone", "NVIDIA H200", {"torch_cudnn": 630.0, "hattn": 600.0}),
                                  ("capstone_fa3", "NVIDIA H100 80GB HBM3",
                                   {"torch_cudnn": 650.0, "hattn": 601.0, "fa3": 588.0})):
        (tmp_path / "results" / folder).mkdir()
        run = {"meta": {"gpu": gpu, "model": "wan2.1-1.3b", "size": "480p", "tokens": 32760, "commit": "abcdef123456",
                        "torch": "2.11", "cudnn": 91900, "diffusers": "0.42.1"},
               "results": [{"variant": v, "ms": ms} for v, ms in variants.items()]}
        (tmp_path / "results" / folder / "wan2.1-1.3b_480p.json").write_text(json.dumps(run))
    rows = [r for r in gen_docs.status_table().splitlines() if r.startswith("| capstone")]
    assert len(rows) == 2
    assert "| torch SDPA; FA3 not in the run | 1.050 |" in rows[0]
    assert rows[0].endswith("`results/capstone/` at `abcdef1` |")
    assert "| FA3, torch SDPA | 0.978 |" in rows[1]
    assert rows[1].endswith("`results/capstone_fa3/` at `abcdef1`, on the H100 |")
    table = gen_docs.capstone_table(tmp_path / "results" / "capstone_fa3")
    assert "| 0.978x |" in table and "NVIDIA H100 80GB HBM3" in table
