"""Compares bench_mla CSVs of .so variants: python3 mla_compare.py DIR BASE  (files DIR/mla_<variant>_<run>.csv)."""
import csv, glob, os, statistics, sys
from collections import defaultdict
d, base = sys.argv[1], sys.argv[2]
ms = defaultdict(lambda: defaultdict(list))  # variant -> point -> [ms]
tf = defaultdict(lambda: defaultdict(list))
clock = defaultdict(list)
for f in sorted(glob.glob(os.path.join(d, "mla_*_*.csv"))):
    v = os.path.basename(f)[4:-4].rsplit("_", 1)[0]
    for r in csv.DictReader(open(f)):
        if r["name"] != "hattn_mla" or r["status"] != "ok":
            if r["name"] == "hattn_mla": print("NOT OK", v, r["batch"], r["seqlen_k"], r["heads_q"], r["seqlen_q"], r["status"])
            continue
        k = (int(r["batch"]), int(r["seqlen_k"]), int(r["heads_q"]), int(r["seqlen_q"]))
        ms[v][k].append(float(r["ms"])); tf[v][k].append(float(r["tflops"]))
        clock[v].append(int(r["sm_clock_mhz"] or 0))
print(f"variant / {base} (time ratio, <1 faster), per point; TFLOP/s in brackets")
pts = sorted(ms[base])
vs = [v for v in ms if v != base]
print("point".ljust(22), base.ljust(12), " ".join(v.ljust(16) for v in vs))
for k in pts:
    b = statistics.mean(ms[base][k])
    row = f"{k[0]}x{k[1]} {k[2]}x{k[3]}".ljust(22) + f"{b:.3f}ms[{statistics.mean(tf[base][k]):.0f}]".ljust(12)
    for v in vs:
        if k in ms[v]:
            row += f" {statistics.mean(ms[v][k]) / b:.3f}[{statistics.mean(tf[v][k]):.0f}]".ljust(17)
    print(row)
for v in vs:
    r = [statistics.mean(ms[v][k]) / statistics.mean(ms[base][k]) for k in pts if k in ms[v]]
    if r: print(f"{v}: min {min(r):.3f} median {statistics.median(r):.3f} max {max(r):.3f} over {len(r)} points; clocks {min(clock[v])}-{max(clock[v])}")
