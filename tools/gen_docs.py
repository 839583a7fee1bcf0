#!/usr/bin/env python3
"""Regenerates the result tables in README.md, results/README.md and docs/**/*.md from results files.

Tables live between marker lines, so the prose around them is never touched:

    <!-- results:lineage -->          the lineage summary (results/README.md)
    <!-- results:KERNEL_NAME -->      a guide chapter's grid for one kernel
    <!-- results:anchors -->          our kernels beside cuDNN and FlashAttention-2 (python -m hattn.bench)
    <!-- results:anchors.NAME -->     the same from results/NAME.csv and .json (a run of a few kernels)
    <!-- results:capstone -->         one Wan 2.1 transformer step per variant (python -m hattn.capstone)
    <!-- results:capstone.DIR -->     the same from results/DIR/*.json
    <!-- results:backward -->         the backward beside SDPA's (python -m hattn.bench_backward)
    <!-- results:backward.PATH -->    the same from results/PATH.csv (an earlier run kept as evidence)
    <!-- results:ab.PATH -->          kernels side by side from one hattn-bench run, results/PATH.csv
    <!-- results:fp8 -->              the FP8 forward beside bf16 attention (python -m hattn.bench_fp8)
    <!-- results:fp8_accuracy -->     its error beside FA3's FP8 against float64 (bench_fp8 --fp64-errors)
    <!-- results:mla -->              MLA decoding beside torch and our GQA decoding (python -m hattn.bench_mla)
    <!-- results:status -->           the README's status: ours over the best anchor, per results file
    <!-- /results -->

Numbers come only from results files: hattn-bench's CSV (default results/lineage.csv) and
python -m hattn.bench's pybench.csv/pybench.json (default results/pybench.*).
Usage: tools/gen_docs.py [--results results/lineage.csv] [--check]
"""
import argparse
import csv
import json
import math
import os
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
MARKER = re.compile(r"(<!-- results:([\w./-]+) -->\n)(.*?)(<!-- /results -->)", re.S)


def load(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for key in ("head_dim", "seqlen_q", "batch", "heads_q", "causal", "reps"):
            r[key] = int(r[key])
        for key in ("ms", "tflops", "pct_gemm", "gemm_tflops", "sm_clock_mhz"):
            r[key] = float(r[key])
    return rows


def provenance(rows, path):
    """Where the figures of `rows` come from: one clause per benchmark run. A run is a commit
    and the GEMM ceiling hattn-bench measured once at its start: two runs at one commit (the
    lineage split across device calls) get a clause each."""
    runs = {}
    for r in rows:
        runs.setdefault((r["commit"], r["gemm_tflops"]), []).append(r)

    def timing(rs):
        # hattn-bench --settle: untimed calls before each point's timed ones; without it the
        # timed calls are a burst after the point's idle setup (results/evidence/clock_carryover/).
        settle = float(rs[0].get("settle_s") or 0)
        return (f"each point timed after {settle:g} s of untimed calls" if settle > 0
                else "each point timed as a burst after its setup")

    timings = {timing(rs) for rs in runs.values()}
    parts = []
    for (commit, _), rs in runs.items():
        clocks = sorted({int(r["sm_clock_mhz"]) for r in rs if r["sm_clock_mhz"] > 0})
        clock = f"{clocks[0]}-{clocks[-1]} MHz" if len(clocks) > 1 else f"{clocks[0]} MHz" if clocks else "unknown"
        kernels = ", ".join(sorted({r["kernel"].split("_")[0] for r in rs}))
        which = f" (kernels {kernels})" if len(runs) > 1 else ""
        how = f", {timing(rs)}" if len(timings) > 1 else ""
        parts.append(f"commit `{commit}`{which}, SM clock {clock}{how}, cuBLAS bf16 GEMM ceiling "
                     f"{rs[0]['gemm_tflops']:.0f} TFLOP/s in the same run")
    common = f"; {timings.pop()}" if len(timings) == 1 else ""
    return (f"_{rows[0]['gpu']}; " + "; ".join(parts) + common +
            f"; from `{path.relative_to(ROOT)}` by `tools/gen_docs.py`._\n")


def fmt(r):
    if r is None:
        return "–"
    if r["check"] != "PASS":
        return r["check"]
    return f"{r['tflops']:.1f}"


def kernel_table(rows, kernel, previous, path):
    mine = [r for r in rows if r["kernel"] == kernel and r["seqlen_q"] == int(r["seqlen_k"])]
    if not mine:
        return f"_No results for {kernel} yet in `{path.relative_to(ROOT)}`._\n"
    seqlens = sorted({r["seqlen_q"] for r in mine})
    index = {(r["head_dim"], r["causal"], r["seqlen_q"]): r for r in mine}
    out = ["TFLOP/s, bf16 forward, batch × seqlen = 16384, heads × D = 2048:", "",
           "| D | mask | " + " | ".join(f"S={s}" for s in seqlens) + " |",
           "|---|---|" + "---|" * len(seqlens)]
    for d in sorted({r["head_dim"] for r in mine}):
        for causal in (0, 1):
            if not any(k[0] == d and k[1] == causal for k in index):
                continue
            cells = [fmt(index.get((d, causal, s))) for s in seqlens]
            out.append(f"| {d} | {'causal' if causal else 'full'} | " + " | ".join(cells) + " |")
    out.append("")
    if previous:
        prev = {(r["head_dim"], r["causal"], r["seqlen_q"]): r for r in rows if r["kernel"] == previous}
        ratios = [index[k]["tflops"] / prev[k]["tflops"] for k in index
                  if k in prev and index[k]["check"] == prev[k]["check"] == "PASS" and prev[k]["tflops"] > 0]
        if ratios:
            geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
            out.append(f"Against the previous step ({previous}): {geo:.2f}× (geometric mean over "
                       f"{len(ratios)} shapes; range {min(ratios):.2f}× to {max(ratios):.2f}×).\n")
    out.append(provenance(mine + [r for r in rows if r["kernel"] == previous], path))
    return "\n".join(out) + "\n"


def lineage_table(rows, kernels, descriptions, path):
    points = [(128, 0, 4096), (128, 0, 16384), (128, 1, 16384), (64, 0, 16384), (256, 0, 16384)]
    index = {(r["kernel"], r["head_dim"], r["causal"], r["seqlen_q"]): r for r in rows}
    head = " | ".join(f"D={d} {'causal' if c else 'full'} S={s // 1024}k" for d, c, s in points)
    out = ["TFLOP/s, bf16 forward (batch × seqlen = 16384, heads × D = 2048):", "",
           f"| step | main idea | {head} |", "|---|---|" + "---|" * len(points)]
    for k in kernels:
        cells = [fmt(index.get((k, d, c, s))) for d, c, s in points]
        link = f"[{k}](docs/guide/{k}.md)"
        out.append(f"| {link} | {descriptions.get(k, '')} | " + " | ".join(cells) + " |")
    out += ["", provenance(rows, path)]
    return "\n".join(out) + "\n"


ANCHOR_TABLE_STEPS = ("05", "08", "10", "11", "12", "13", "14", "15", "16")


def anchors_table(csv_path):
    """Our kernels beside the SDPA anchors, all timed in one process on the same tensors."""
    json_path = csv_path.with_suffix(".json")
    if not csv_path.exists() or not json_path.exists():
        return f"_No side-by-side results yet (`{csv_path.relative_to(ROOT)}`)._\n"
    meta = json.loads(json_path.read_text())["meta"]
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    names = list(dict.fromkeys(r["name"] for r in rows))
    anchors = [n for n in names if n == "fa3" or n.startswith(("sdpa_", "varlen_"))]
    ours = [n for n in names if n not in anchors]
    # The columns: the FlashAttention-2-class step and the Hopper steps from warp specialization
    # on; the CSV holds every kernel the run timed, and the ratio is over all of them.
    shown = [n for n in ours if n[:2] in ANCHOR_TABLE_STEPS] or ours
    label = {"fa3": "FA3", "sdpa_cudnn": "cuDNN", "sdpa_cudnn_bshd": "cuDNN (BSHD views)",
             "sdpa_flash": "FA2 (SDPA FLASH)", "varlen_cudnn": "cuDNN varlen", "varlen_flash": "FA2 varlen"}
    shapes = list(dict.fromkeys((r["tag"], int(r["head_dim"]), r["causal"] == "True", int(r["seqlen_q"]),
                                 int(r["batch"]), int(r["heads_q"]), int(r.get("seqlen_k") or r["seqlen_q"]))
                                for r in rows))  # fmt: skip
    index = {(r["tag"], int(r["head_dim"]), r["causal"] == "True", int(r["seqlen_q"]), int(r["batch"]),
              int(r["heads_q"]), r["name"]): r for r in rows}
    cols = anchors + ours
    hidden = [n for n in ours if n not in shown]
    out = ["TFLOP/s, bf16 forward; our kernels and torch SDPA timed in one process on the same tensors "
           "(`python -m hattn.bench`). The last column is our best kernel over the best anchor."
           + (f" Steps {', '.join(n[:2] for n in hidden)} are in the CSV only." if hidden else ""), "",
           "| shape | " + " | ".join(label.get(c, c) for c in anchors + shown) + " | ours / best anchor |",
           "|---|" + "---|" * (len(anchors + shown) + 1)]
    for tag, d, causal, s, b, h, keys in shapes:
        cells, best_anchor, best_ours = [], 0.0, 0.0
        for c in cols:
            r = index.get((tag, d, causal, s, b, h, c))
            ok = r is not None and r["status"] == "ok"
            t = float(r["tflops"]) if ok else 0.0
            if c in anchors or c in shown:
                cells.append(f"{t:.0f}" if ok else (r["status"] if r else "–"))
            if c in anchors:
                best_anchor = max(best_anchor, t)
            else:
                best_ours = max(best_ours, t)
        ratio = f"{best_ours / best_anchor:.2f}" if best_anchor > 0 else "–"
        seq = f"S={s}" if keys == s else f"Sq={s} Sk={keys}"
        name = f"{'' if tag == 'grid' else tag + ' '}D={d} {'causal' if causal else 'full'} {seq} B={b} H={h}"
        out.append(f"| {name} | " + " | ".join(cells) + f" | {ratio} |")
    out += ["", f"_{meta['gpu']}, commit `{meta['commit']}`, torch {meta['torch']}, cuDNN {meta['cudnn']}; "
            f"from `{csv_path.relative_to(ROOT)}` by `tools/gen_docs.py`._\n"]
    return "\n".join(out) + "\n"


def heads(hq, hkv):
    """H=Hq, or H=Hq:Hkv where there are fewer K/V heads (GQA)."""
    return f"H={hq}" if hkv == hq else f"H={hq}:{hkv}"


def pybench_table(csv_path, what, caption, label, ours, ratio_key, ratio_title, heads_key):
    """One row per shape of a python -m hattn.bench_* CSV: TFLOP/s per implementation (`label`
    names them), then `ours` over the best anchor (`ratio_key`) and ours's check."""
    if not csv_path.exists():
        return f"_No {what} results yet (`{csv_path.relative_to(ROOT)}`)._\n"
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))

    def key(r):  # K/V heads: heads_kv where the CSV has it (GQA), else the query heads
        return (int(r["head_dim"]), r["causal"] == "True", int(r["seqlen"]), int(r["batch"]), int(r[heads_key]),
                int(r.get("heads_kv") or r[heads_key]))

    names = list(dict.fromkeys(r["name"] for r in rows))
    shapes = list(dict.fromkeys(key(r) for r in rows))
    index = {(*key(r), r["name"]): r for r in rows}
    out = [caption, "",
           "| shape | " + " | ".join(label.get(n, n) for n in names) + f" | {ratio_title} | check |",
           "|---|" + "---|" * (len(names) + 2)]
    for shape in shapes:
        d, causal, s, b, h, hkv = shape
        got = {n: index.get((*shape, n)) for n in names}
        cells = [f"{float(r['tflops']):.0f}" if r and r["tflops"] else "not given" if r and r["status"] == "not given"
                 else "–" for r in got.values()]  # fmt: skip
        mine = got.get(ours)
        ratio = mine[ratio_key] if mine else ""
        ratio = f"{float(ratio):.2f}" if ratio else "–"
        out.append(f"| D={d} {'causal' if causal else 'full'} S={s} B={b} {heads(h, hkv)} | "
                   + " | ".join(cells) + f" | {ratio} | {mine['status'] if mine else '–'} |")
    first = rows[0]
    clocks = sorted({r["sm_clock_mhz"] for r in rows})
    out += ["", f"_{first['gpu']}, commit `{first['commit']}`, SM clock at the start {', '.join(clocks)} MHz; "
            f"from `{csv_path.relative_to(ROOT)}` by `tools/gen_docs.py`._"]
    return "\n".join(out) + "\n"


def backward_table(csv_path):
    """hattn's backward beside SDPA's (python -m hattn.bench_backward), one row per shape."""
    return pybench_table(
        csv_path, "backward",
        "TFLOP/s of the backward alone (dq, dk, dv; 2.5x the forward's FLOPs), bf16, timed in one process "
        "on the same tensors (`python -m hattn.bench_backward`). `hattn:NAME` is backward kernel NAME called "
        "directly; the last columns are hattn (\"auto\" at that commit) over the better anchor, and the check "
        "against the reference anchor's gradients (the first that ran: cuDNN's; FA2's for a varlen run, whose S is "
        "its longest sequence).",
        {"hattn": "hattn (auto, autograd)", "sdpa_cudnn": "cuDNN", "sdpa_flash": "FA2 (SDPA FLASH)",
         "varlen_cudnn": "cuDNN varlen", "varlen_flash": "FA2 varlen", "fa3": "FA3"},
        "hattn", "ratio_to_best_anchor", "hattn / best anchor", "heads_q")


def ab_table(csv_path):
    """Kernels side by side from one hattn-bench run (forward or backward): TFLOP/s per shape,
    and the last kernel over the first. A kernel that refused a shape ("unsupported") gets "–"
    there."""
    if not csv_path.exists():
        return f"_No results yet (`{csv_path.relative_to(ROOT)}`)._\n"
    all_rows = load(csv_path)
    kernels = list(dict.fromkeys(r["kernel"] for r in all_rows))
    shapes = list(dict.fromkeys((r["head_dim"], r["causal"], r["seqlen_q"], r["batch"], r["heads_q"],
                                 int(r["heads_kv"])) for r in all_rows))
    rows = [r for r in all_rows if r["check"] != "unsupported"]  # timed rows only
    index = {(r["head_dim"], r["causal"], r["seqlen_q"], r["batch"], r["heads_q"], int(r["heads_kv"]), r["kernel"]): r
             for r in rows}
    first, last = kernels[0], kernels[-1]
    out = ["TFLOP/s, " + all_rows[0]["dtype"] + ", one `hattn-bench` run (each kernel timed in turn on the same "
           "tensors; the check compares sampled rows with the fp64 reference).", "",
           "| shape | " + " | ".join(f"`{k}`" for k in kernels) + f" | {last} / {first} | check |",
           "|---|" + "---|" * (len(kernels) + 2)]
    for d, causal, s, b, h, hkv in shapes:
        got = [index.get((d, causal, s, b, h, hkv, k)) for k in kernels]
        cells = [f"{r['tflops']:.1f}" if r else "–" for r in got]
        ratio = f"{got[-1]['tflops'] / got[0]['tflops']:.3f}" if got[0] and got[-1] else "–"
        checks = {r["check"] for r in got if r}
        out.append(f"| D={d} {'causal' if causal else 'full'} S={s} B={b} {heads(h, hkv)} | " + " | ".join(cells)
                   + f" | {ratio} | {', '.join(sorted(checks))} |")
    clocks = sorted({f"{r['sm_clock_mhz']:.0f}" for r in rows})
    out += ["", f"_{all_rows[0]['gpu']}, commit `{all_rows[0]['commit']}`, SM clock at the start {', '.join(clocks)} MHz; "
            f"from `{csv_path.relative_to(ROOT)}` by `tools/gen_docs.py`._"]
    return "\n".join(out) + "\n"


def fp8_accuracy_table(csv_path):
    """The FP8 forward's error beside FA3's FP8 on the same e4m3 codes (python -m hattn.bench_fp8
    --fp64-errors): max and RMS of |out - ref| against float64 attention of the codes' values."""
    rows = list(csv.DictReader(open(csv_path, newline=""))) if csv_path.exists() else []
    if not rows or "err64_max" not in rows[0]:
        return f"_No results yet (`{csv_path.relative_to(ROOT)}`, `python -m hattn.bench_fp8 --fp64-errors`)._\n"
    by = {}
    for r in rows:
        by.setdefault((int(r["head_dim"]), r["causal"] == "True", int(r["seqlen"]), r["batch"], r["heads"]), {})[r["name"]] = r
    out = ["Error against attention in float64 of the e4m3 codes' values (codes x descales), on the same inputs "
           "for both; max and root mean square of |out - ref| over the whole output.", "",
           "| shape | hattn FP8 max | FA3 FP8 max | hattn / FA3 | hattn FP8 RMS | FA3 FP8 RMS | hattn / FA3 |",
           "|---|---|---|---|---|---|---|"]
    worst = None
    for (d, causal, s, b, h), names in by.items():
        ours, theirs = names.get("hattn_fp8"), names.get("fa3_fp8")
        if not ours or not ours["err64_max"]:
            continue
        cells = []
        for key in ("err64_max", "err64_rms"):
            a = float(ours[key])
            t = float(theirs[key]) if theirs and theirs[key] else None
            cells += [f"{a:.2e}", f"{t:.2e}" if t is not None else "not run", f"{a / t:.2f}" if t else "–"]
            if t and key == "err64_max":
                worst = max(worst or 0.0, a / t)
        out.append(f"| D={d} {'causal' if causal else 'full'} S={s} B={b} H={h} | " + " | ".join(cells) + " |")
    r0 = rows[0]
    out += ["", f"_{r0['gpu']}, commit `{r0['commit'][:12]}`"
            + (f"; hattn's largest max-error ratio to FA3's: {worst:.2f}" if worst is not None else "")
            + f"; from `{csv_path.relative_to(ROOT)}` by `tools/gen_docs.py`._"]
    return "\n".join(out) + "\n"


def fp8_table(csv_path):
    """The FP8 forward beside bf16 attention on the same values (python -m hattn.bench_fp8)."""
    header = csv_path.read_text().split("\n", 1)[0] if csv_path.exists() else ""
    # A run with FA3 has ratio_to_best_anchor (over every anchor, FA3's FP8 included); an
    # earlier run's only ratio is over the bf16 anchors.
    every = "ratio_to_best_anchor" in header.split(",")
    return pybench_table(
        csv_path, "FP8",
        "TFLOP/s of the forward (4 B H S^2 D, halved when causal, for every dtype), timed in one "
        "process on the same values (`python -m hattn.bench_fp8`: e4m3 codes with per-head descales for "
        "the FP8 kernels, their dequantized bf16 values for the others); the last columns are hattn FP8 over the "
        + ("best anchor (FA3 FP8 and bf16, cuDNN, FA2)" if every else "best bf16 anchor (cuDNN, FA2)")
        + ", and its check against cuDNN's output.",
        {"hattn_fp8": "hattn FP8", "hattn_bf16": "hattn bf16", "fa3_fp8": "FA3 FP8", "fa3_bf16": "FA3 bf16",
         "sdpa_cudnn": "cuDNN bf16", "sdpa_flash": "FA2 bf16 (SDPA FLASH)"},
        "hattn_fp8", "ratio_to_best_anchor" if every else "ratio_to_best_bf16_anchor",
        "FP8 / best anchor" if every else "FP8 / best bf16 anchor", "heads")


def mla_table(csv_path):
    """MLA decoding (python -m hattn.bench_mla): per point, ours in GB/s (share of HBM) and
    TFLOP/s, torch's formulation over ours in time, our GQA decoding of about the same bytes."""
    if not csv_path.exists():
        return f"_No results yet (`{csv_path.relative_to(ROOT)}`, `python -m hattn.bench_mla`)._\n"
    rows = list(csv.DictReader(open(csv_path, newline="")))
    points, ceilings = {}, {}
    for r in rows:
        if r["name"].startswith("ceiling_"):
            ceilings[r["name"]] = r
            continue
        points.setdefault((int(r["batch"]), int(r["seqlen_k"]), int(r["heads_q"]), int(r["seqlen_q"])), {})[r["name"]] = r

    def num(r, field, spec):
        return format(float(r[field]), spec) if r and r.get(field) not in (None, "") else "–"

    out = ["| batch | keys | heads x new tokens | hattn GB/s | of 4.8 TB/s | hattn TFLOP/s | torch ms / hattn ms | "
           "FA3 ms / hattn ms | hattn GQA GB/s | status |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (batch, keys, heads, sq), by in sorted(points.items()):
        ours, gqa = by.get("hattn_mla"), by.get("hattn_gqa")

        def over_ours(other):
            r = by.get(other)
            return (f"{float(r['ms']) / float(ours['ms']):.2f}" if ours and r and ours.get("ms") and r.get("ms")
                    else "–")

        out.append(f"| {batch} | {keys} | {heads} x {sq} | {num(ours, 'gbps', '.0f')} | {num(ours, 'hbm_fraction', '.2f')} | "
                   f"{num(ours, 'tflops', '.0f')} | {over_ours('torch_mla')} | {over_ours('fa3_mla')} | {num(gqa, 'gbps', '.0f')} | "
                   f"{ours['status'] if ours else 'missing'} |")
    first = rows[0]
    if ceilings:
        copy, mm = ceilings.get("ceiling_copy"), ceilings.get("ceiling_cublas")
        out += ["", f"Ceilings measured in the same run: a device-to-device copy moved {num(copy, 'gbps', '.0f')} GB/s "
                f"(read plus written, {num(copy, 'hbm_fraction', '.2f')} of 4.8 TB/s); cuBLAS's 8192³ bf16 product "
                f"ran at {num(mm, 'tflops', '.0f')} TFLOP/s."]
    out += ["", f"_{first['gpu']}; commit `{first['commit'][:12]}`; SM clock {first.get('sm_clock_mhz') or '?'} MHz at "
            f"the first point; from `{csv_path.relative_to(ROOT)}` by `tools/gen_docs.py`._"]
    return "\n".join(out) + "\n"


STATUS_LABELS = {"fa3": "FA3", "sdpa_cudnn": "cuDNN", "sdpa_cudnn_bshd": "cuDNN", "sdpa_flash": "FA2",
                 "varlen_cudnn": "cuDNN", "varlen_flash": "FA2", "fa3_fp8": "FA3 FP8", "fa3_bf16": "FA3",
                 "torch_mla": "torch (bmm + softmax)", "fa3_mla": "FA3", "fa3_det": "FA3 deterministic"}


def gpu_note(gpu):
    """", on the H100" where a run was not on the H200 (the results' usual GPU), else ""."""
    if not gpu or "H200" in gpu:
        return ""
    m = re.search(r"\b([A-Z]\d{2,3})\b", gpu)
    return f", on the {m.group(1) if m else gpu}"


def status_table():
    """The README's status: one row per results file, ours over the best anchor of its run."""
    import statistics

    def read(name):
        path = ROOT / "results" / name
        return list(csv.DictReader(open(path, newline=""))) if path.exists() else []

    def summary(what, rows, name, ours, ratio_of, anchors_of):
        mine = [r for r in rows if ours(r) and ratio_of(r) not in ("", None)]
        if not mine:
            return f"| {what} | – | – | – | – | no results yet (`results/{name}`) |"
        ratios = [float(ratio_of(r)) for r in mine]
        anchors = sorted({STATUS_LABELS.get(r["name"], r["name"]) for r in rows if anchors_of(r)})
        missing = "" if "FA3" in anchors else "; FA3 not in the run"
        commit = rows[0]["commit"] if "commit" in rows[0] else ""
        return (f"| {what} | {', '.join(anchors)}{missing} | {min(ratios):.2f} | {statistics.median(ratios):.2f} | "
                f"{sum(r >= 1.0 for r in ratios)} of {len(ratios)} | `results/{name}`"
                + (f" at `{commit[:7]}`" if commit else "") + gpu_note(rows[0].get("gpu", "")) + " |")

    out = ["| what | anchors in the run | ours / best anchor: min | median | at or above 1 | results |",
           "|---|---|---|---|---|---|"]
    # Forward: the best hattn kernel of each shape (python -m hattn.bench records a ratio per row);
    # the production forward's own runs (pybench_production*.csv) where there are any, else the
    # lineage run's grid.
    forward_runs = [("forward, bf16, the FlashAttention-3 grid", "pybench_production.csv", "grid"),
                    ("forward, varlen: mixed lengths", "pybench_production_varlen_mixed.csv", "varlen-mixed"),
                    ("forward, varlen: many short sequences (50..2000)", "pybench_production_varlen_short.csv",
                     "varlen-short"),
                    ("decoding: one query, GQA 8, the grid's small caches", "pybench_production_decode.csv", "grid")]
    if not (ROOT / "results" / forward_runs[0][1]).exists():
        forward_runs[0] = ("forward, bf16, the FlashAttention-3 grid", "pybench.csv", "grid")
    for what, name, tag in forward_runs:
        fwd = [r for r in read(name) if r["tag"] == tag]
        meta_path = ROOT / "results" / name.replace(".csv", ".json")
        meta = json.loads(meta_path.read_text())["meta"] if meta_path.exists() else {}
        commit = meta.get("commit", "")
        best = {}
        for r in fwd:
            if r["kind"] == "hattn" and r["status"] == "ok" and r["ratio"]:
                key = (r["head_dim"], r["causal"], r["seqlen_q"], r["seqlen_k"], r["batch"])
                best[key] = max(best.get(key, 0.0), float(r["ratio"]))
        if not best:
            continue
        anchors = sorted({STATUS_LABELS.get(r["name"], r["name"]) for r in fwd if r["kind"] == "anchor"
                          and r["status"] == "ok"})
        kernels = sorted({r["name"] for r in fwd if r["kind"] == "hattn"})
        ours = f"`{kernels[0]}`" if len(kernels) == 1 else "the run's best kernel"
        ratios = list(best.values())
        out.append(f"| {what} ({len(ratios)} points; ours: {ours}) | "
                   f"{', '.join(anchors)}{'' if 'FA3' in anchors else '; FA3 not in the run'} | {min(ratios):.2f} | "
                   f"{statistics.median(ratios):.2f} | {sum(x >= 1.0 for x in ratios)} of {len(ratios)} | "
                   f"`results/{name}` at `{commit[:7]}`{gpu_note(meta.get('gpu', ''))} |")
    bwd_anchor = lambda r: not r["name"].startswith("hattn") and r.get("status") != "not given"
    for what, name in (("backward, bf16 (dq, dk, dv)", "pybench_backward.csv"),
                       ("backward, bf16, beside FA3", "pybench_backward_fa3.csv"),
                       ("backward, GQA 4", "pybench_backward_gqa4.csv"),
                       ("backward, varlen (mixed lengths)", "pybench_backward_varlen_mixed.csv"),
                       ("backward, varlen (mixed lengths), beside FA3", "pybench_backward_varlen_mixed_fa3.csv"),
                       ("backward, sliding window of 1,024 keys, beside FA3", "pybench_backward_window1024.csv"),
                       ("backward, sliding window of 4,096 keys, beside FA3", "pybench_backward_window4096.csv")):
        rows = read(name)
        if not rows and name != "pybench_backward.csv":  # the FA3 runs get a row only once they exist
            continue
        out.append(summary(what, rows, name, lambda r: r["name"] == "hattn", lambda r: r["ratio_to_best_anchor"],
                           bwd_anchor))
    fp8 = read("pybench_fp8.csv")
    key = "ratio_to_best_anchor" if fp8 and "ratio_to_best_anchor" in fp8[0] else "ratio_to_best_bf16_anchor"
    out.append(summary("FP8 forward (e4m3; the anchors in bf16 unless named FP8)", fp8, "pybench_fp8.csv",
                       lambda r: r["name"] == "hattn_fp8", lambda r: r[key],
                       lambda r: not r["name"].startswith("hattn") and r["status"] == "ok"))
    # MLA decoding: time ratios per point, the best of torch's formulation and FA3's MLA mode over ours.
    mla = read("pybench_mla.csv")
    points = {}
    for r in mla:
        if r["status"] == "ok" and r.get("ms"):
            points.setdefault((r["batch"], r["seqlen_k"], r["heads_q"], r["seqlen_q"]), {})[r["name"]] = float(r["ms"])
    mla_rows = []
    for key, by in points.items():
        anchors = [ms for name, ms in by.items() if name in ("torch_mla", "fa3_mla")]
        if "hattn_mla" in by and anchors:
            mla_rows.append({"name": "hattn_mla", "ratio": min(anchors) / by["hattn_mla"], "commit": mla[0]["commit"]})
    mla_rows += [{"name": n, "ratio": None, "commit": mla[0]["commit"]} for n in
                 sorted({r["name"] for r in mla if r["name"] in ("torch_mla", "fa3_mla") and r["status"] == "ok"})]
    out.append(summary("MLA decoding, bf16 (576 / 512 features, paged latent cache)", mla_rows, "pybench_mla.csv",
                       lambda r: r["name"] == "hattn_mla", lambda r: r["ratio"], lambda r: r["name"] != "hattn_mla"))
    for folder in ("capstone", "capstone_fa3"):
        runs = [json.loads(p.read_text()) for p in sorted((ROOT / "results" / folder).glob("*.json"))]
        for run in runs:
            ms = {r["variant"]: r["ms"] for r in run["results"]}
            others = {k: v for k, v in ms.items() if k != "hattn"}
            if "hattn" not in ms or not others:
                continue
            m = run["meta"]
            names = sorted({("FA3" if k == "fa3" else "torch SDPA") for k in others})
            missing = "" if "fa3" in others else "; FA3 not in the run"
            ratio = min(others.values()) / ms["hattn"]
            out.append(f"| capstone: {m['model']} {m['size']}, one transformer step, end to end | "
                       f"{', '.join(names)}{missing} | {ratio:.3f} | – | {int(ratio >= 1)} of 1 | "
                       f"`results/{folder}/` at `{m['commit'][:7]}`{gpu_note(m.get('gpu', ''))} |")
    out += ["", "_Ratios of throughput (time for the capstone), each over the best anchor timed in the same run; "
            "from the files named by `tools/gen_docs.py`._"]
    return "\n".join(out) + "\n"


def capstone_table(directory):
    """One row per results/capstone/*.json: the step's time under each variant."""
    runs = [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]
    if not runs:
        return "_No capstone results yet._\n"
    variants = list(dict.fromkeys(r["variant"] for run in runs for r in run["results"]))
    with_fa3 = "fa3" in variants or any(run["meta"].get("fa3") for run in runs)
    out = ["Milliseconds for one transformer forward (one denoising step), bf16, median; "
           + ("the last columns are the fastest torch variant's time over hattn's, and FlashAttention-3's "
              "(`fa3`: SDPA replaced by FA3's forward) over hattn's" if with_fa3
              else "the last column is the fastest torch variant's time over hattn's")
           + ".\n",
           "| model | video tokens | " + " | ".join(variants) + " | speedup over torch |"
           + (" speedup over FA3 |" if with_fa3 else ""),
           "|---|---|" + "---|" * len(variants) + "---|" + ("---|" if with_fa3 else "")]
    for run in runs:
        ms = {r["variant"]: r["ms"] for r in run["results"]}
        best_torch = min(v for k, v in ms.items() if k.startswith("torch_"))
        m = run["meta"]
        fa3 = (f" {ms['fa3'] / ms['hattn']:.3f}x |" if "fa3" in ms else " not given |") if with_fa3 else ""
        out.append(f"| {m['model']} {m['size']} | {m['tokens']:,} | "
                   + " | ".join(f"{ms[v]:.0f}" if v in ms else "" for v in variants)
                   + f" | {best_torch / ms['hattn']:.3f}x |" + fa3)
    metas = [run["meta"] for run in runs]
    commits = ", ".join(sorted({f"`{m['commit']}`" for m in metas}))
    out += ["", f"_{metas[0]['gpu']}; commit {commits}; torch {metas[0]['torch']}, cuDNN {metas[0]['cudnn']}, "
            f"diffusers {metas[0]['diffusers']}; from `{directory.relative_to(ROOT)}/*.json` by "
            f"`tools/gen_docs.py`._"]
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(ROOT / "results" / "lineage.csv"))
    ap.add_argument("--pybench", default=str(ROOT / "results" / "pybench.csv"))
    ap.add_argument("--check", action="store_true", help="exit 1 if any file would change")
    args = ap.parse_args()
    path = pathlib.Path(args.results).resolve()
    rows = load(path)
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    descriptions = {}
    for source in sorted((ROOT / "src" / "lineage").glob("[0-9][0-9]_*.cu")):
        # The entry is `KernelEntry entry{NAME, "description" "maybe continued", ...}`, where
        # NAME is a literal or kName, defined as `kName = "..."`.
        text = source.read_text()
        m = re.search(r'KernelEntry entry\{\s*(kName|"\w+"),\s*((?:"[^"]*"\s*)+)', text)
        if not m:
            continue
        name = m.group(1).strip('"')
        if name == "kName":
            k = re.search(r'kName = "(\w+)"', text)
            name = k.group(1) if k else source.stem
        descriptions[name] = "".join(re.findall(r'"([^"]*)"', m.group(2)))

    def render(name):
        if name == "lineage":
            return lineage_table(rows, kernels, descriptions, path)
        if name == "capstone":
            return capstone_table(ROOT / "results" / "capstone")
        if name.startswith("capstone."):
            return capstone_table(ROOT / "results" / name[len("capstone."):])
        if name == "status":
            return status_table()
        if name == "anchors":
            return anchors_table(pathlib.Path(args.pybench).resolve())
        if name.startswith("anchors."):
            return anchors_table(ROOT / "results" / (name[len("anchors."):] + ".csv"))
        if name == "backward":
            return backward_table(ROOT / "results" / "pybench_backward.csv")
        if name.startswith("backward."):
            return backward_table(ROOT / "results" / (name[len("backward."):] + ".csv"))
        if name == "fp8":
            return fp8_table(ROOT / "results" / "pybench_fp8.csv")
        if name == "fp8_accuracy":
            return fp8_accuracy_table(ROOT / "results" / "pybench_fp8.csv")
        if name == "mla":
            return mla_table(ROOT / "results" / "pybench_mla.csv")
        if name.startswith("ab."):
            return ab_table(ROOT / "results" / (name[len("ab."):] + ".csv"))
        previous = None
        names = sorted(set(kernels) | {name})
        i = names.index(name)
        if i > 0 and names[i - 1] in kernels:
            previous = names[i - 1]
        return kernel_table(rows, name, previous, path)

    changed = []
    for doc in [ROOT / "README.md", ROOT / "results" / "README.md", *sorted((ROOT / "docs").glob("*.md")),
                *sorted((ROOT / "docs" / "guide").glob("*.md"))]:
        if not doc.exists():
            continue
        text = doc.read_text()
        # The tables link to docs/... from the repository's root; from a doc elsewhere, relative to it.
        up = os.path.relpath(ROOT, doc.parent)
        relink = (lambda t: t) if up == "." else (lambda t: t.replace("](docs/", f"]({up}/docs/"))
        new = MARKER.sub(lambda m: m.group(1) + relink(render(m.group(2))) + m.group(4), text)
        if new != text:
            changed.append(doc.relative_to(ROOT))
            if not args.check:
                doc.write_text(new)
    for c in changed:
        print(("would update " if args.check else "updated ") + str(c))
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
