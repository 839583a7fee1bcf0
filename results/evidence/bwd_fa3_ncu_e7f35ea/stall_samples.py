"""ncu's per-instruction warp-state samples (gpu_run.sh ncu-fa3's NAME_sass.csv) of one kernel,
summed by how many times each instruction ran: instructions that run equally often belong to
one role's loop (a consumer step runs 8 warps x CTAs x steps times), so the groups say where
each role's warps wait. With --top N, the N instructions with the most samples.

    python3 stall_samples.py ncu_fa3_sass.csv backward_kernel [--top 30]
"""

import argparse
import collections
import csv


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv")
    p.add_argument("kernel", help="a part of the kernel's name (its first section in the file)")
    p.add_argument("--top", type=int, default=0)
    args = p.parse_args()
    name, header, rows, section, chosen = None, None, [], 0, None
    for rec in csv.reader(open(args.csv)):
        if not rec:
            continue
        if rec[0] == "Kernel Name":  # a section per kernel (ncu writes each twice: the first is used)
            section, header = section + 1, None
            if chosen is None and args.kernel in rec[1]:
                chosen, name = section, rec[1]
        elif rec[0] == "Address":
            header = rec
        elif section == chosen and header:
            rows.append(dict(zip(header, rec)))
    if not rows:
        raise SystemExit(f"no kernel named like {args.kernel!r} in {args.csv}")
    stalls = [c for c in header if c.startswith("stall_") and "Not Issued" not in c]
    total = sum(number(r["Warp Stall Sampling (All Samples)"]) for r in rows)
    print(f"{name[:110]}\n{len(rows)} instructions, {total:.0f} samples")
    groups, counts = collections.defaultdict(collections.Counter), collections.Counter()
    for r in rows:
        runs = number(r["Instructions Executed"])
        counts[runs] += 1
        groups[runs]["all"] += number(r["Warp Stall Sampling (All Samples)"])
        for c in stalls:
            groups[runs][c[6:]] += number(r[c])
    print("runs of each instruction | instructions | samples | largest reasons")
    for runs, g in sorted(groups.items(), key=lambda kv: -kv[1]["all"])[:10]:
        reasons = " ".join(f"{k}:{v:.0f}" for k, v in g.most_common(7) if k != "all")
        print(f"{runs:10.0f} | {counts[runs]:4d} | {g['all']:7.0f} ({100 * g['all'] / total:4.1f}%) | {reasons}")
    if args.top:
        print(f"the {args.top} instructions with the most samples:")
        for r in sorted(rows, key=lambda r: -number(r["Warp Stall Sampling (All Samples)"]))[: args.top]:
            top3 = sorted(((number(r[c]), c[6:]) for c in stalls), reverse=True)[:3]
            print(f"{r['Address'][-5:]:>5s} {number(r['Warp Stall Sampling (All Samples)']):6.0f} "
                  f"{number(r['Instructions Executed']):8.0f}  {r['Source'][:58]:58s} "
                  + " ".join(f"{c}:{v:.0f}" for v, c in top3))


if __name__ == "__main__":
    main()
