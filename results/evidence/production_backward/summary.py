#!/usr/bin/env python3
"""The A/B table of this folder's README from its CSVs: bwd_sm90 over bwd_15_tma_sums (mean
TFLOP/s of each kernel's runs at a point; above 1: bwd_sm90 faster)."""
import csv
import pathlib
import statistics

HERE = pathlib.Path(__file__).parent
SETS = [("grid, both orders", ["ab_b15_first.csv", "ab_sm90_first.csv"]), ("GQA 4", ["ab_gqa4.csv"]),
        ("varlen, mixed lengths", ["ab_varlen_mixed.csv"])]

print("| set | shape | bwd_15_tma_sums | bwd_sm90 | sm90 / B15 | check |")
print("|---|---|---|---|---|---|")
every = []
for name, files in SETS:
    points = {}
    for f in files:
        for r in csv.DictReader(open(HERE / f)):
            key = (int(r["head_dim"]), r["causal"] == "1", int(r["seqlen_q"]), int(r["batch"]), int(r["heads_q"]),
                   int(r["heads_kv"]))
            points.setdefault(key, {}).setdefault(r["kernel"], []).append((float(r["tflops"]), r["check"]))
    for (d, causal, s, b, hq, hkv), runs in points.items():
        a = statistics.mean(t for t, _ in runs["bwd_15_tma_sums"])
        c = statistics.mean(t for t, _ in runs["bwd_sm90"])
        checks = sorted({ck for v in runs.values() for _, ck in v})
        every.append(c / a)
        heads = f"H={hq}" if hq == hkv else f"H={hq}:{hkv}"
        print(f"| {name} | D={d} {'causal' if causal else 'full'} S={s} B={b} {heads} | {a:.1f} | {c:.1f} | "
              f"{c / a:.3f} | {', '.join(checks)} |")
print(f"\nmin {min(every):.3f}, median {statistics.median(every):.3f} over {len(every)} points")
