"""Sums the warp-stall samples of an Nsight Compute source page (--page source --print-source
sass --csv, plain or gzipped) by what the stalled instruction waits on. The retry branch after
an mbarrier try_wait counts as the wait (the samples land on it while the phase is not done).

    python3 stall_summary.py probe3/source_d128_dense.csv.gz ...
"""
import csv
import gzip
import sys


def main(path):
    lines = (gzip.open(path, "rt") if path.endswith(".gz") else open(path)).read().splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith('"Address"'))
    rows = list(csv.reader(lines[start:]))
    hdr, data = rows[0], [r for r in rows[1:] if len(r) == len(rows[0])]
    col = hdr.index("Warp Stall Sampling (All Samples)")
    num = lambda x: float(x.replace(",", "") or 0)
    total = sum(num(r[col]) for r in data)
    groups = {}
    for j, r in enumerate(data):
        sass = r[1]
        if "WARPGROUP.DEPBAR" in sass or "WARPGROUP.ARRIVE" in sass or "HGMMA" in sass:
            g = "wgmma: wait for the tensor cores"
        elif "SYNCS.PHASECHK" in sass or ("BRA" in sass and sass.lstrip().startswith("@") and
                                           any("SYNCS.PHASECHK" in data[i][1] for i in range(max(0, j - 8), j))):
            g = "mbarrier: try_wait and its retry branch"
        elif "BAR.SYNC" in sass or "BAR.ARV" in sass or "BAR.RED" in sass:
            g = "named barrier (bar.sync / bar.arrive)"
        elif "MUFU" in sass:
            g = "MUFU (exp2)"
        else:
            g = "other"
        groups[g] = groups.get(g, 0.0) + num(r[col])
    print(f"{path}: {total:.0f} samples")
    for g, v in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {v / total * 100:5.1f}%  {g}")


for p in sys.argv[1:]:
    main(p)
