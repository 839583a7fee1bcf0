"""Summarizes probe.sh's output: each run's figures and the clocks and power sampled during it.
python3 summarize.py DIR > summary.txt"""
import csv, datetime, glob, os, statistics, sys

d = sys.argv[1]
fmt = "%Y/%m/%d %H:%M:%S.%f"
spans = {}
for line in open(os.path.join(d, "marks.txt")):
    day, clock, what, name = line.split()
    spans.setdefault(name, {})[what] = datetime.datetime.strptime(f"{day} {clock}", fmt)
samples = []
for row in csv.reader(open(os.path.join(d, "smi.csv"))):
    if len(row) < 5:
        continue
    t = datetime.datetime.strptime(row[0].strip(), fmt)
    samples.append((t, float(row[1].split()[0]), float(row[2].split()[0]), row[4].strip()))

def busy(name):  # samples of the span drawing more than 300 W (a kernel running, not host work)
    s = spans[name]
    return [x for x in samples if s["start"] <= x[0] <= s["end"] and x[2] > 300]

print(f"{'run':22s} {'kernel':24s} {'reps':>5s} {'ms':>7s} {'TFLOP/s':>8s}   busy samples: n, median MHz, median W")
for name in spans:
    b = busy(name)
    smi = f"{len(b):4d} {statistics.median(x[1] for x in b):6.0f} {statistics.median(x[2] for x in b):6.0f}" if b else "   0"
    if name.endswith("pybench"):
        path = os.path.join(d, name, "pybench.csv")  # as probe.sh leaves it, or copied beside
        rows = list(csv.DictReader(open(path if os.path.exists(path) else os.path.join(d, name + ".csv"))))
        figures = [(r["name"], r["reps"], float(r["ms"]), float(r["tflops"])) for r in rows if r["status"] == "ok"]
    else:
        rows = list(csv.DictReader(open(os.path.join(d, name + ".csv"))))
        figures = [(r["kernel"], r["reps"], float(r["ms"]), float(r["tflops"])) for r in rows]
    for i, (k, reps, ms, tf) in enumerate(figures):
        print(f"{name:22s} {k:24s} {reps:>5s} {ms:7.3f} {tf:8.1f}   {smi if i == 0 else ''}")
