"""Where a kernel's warps wait, from ncu's source page (`ncu -i REPORT --page source
--print-source sass --csv`, written by `scripts/gpu_run.sh ncu-fa3` as NAME_sass.csv): for each
kernel of at least --min-share of all samples, its samples by stall reason, by how often each
SASS line ran (lines that run equally often are one role's loop: a consumer step's lines run
warps x CTAs x steps times, the producer's and the epilogue's other counts), and its SASS lines
with the most samples, each with its two largest reasons.

    python3 tools/sass_stalls.py ncu_fa3_sass.csv [--top 25]
"""

from __future__ import annotations

import argparse
import csv
import pathlib
import re
import sys
from collections import Counter

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from ncu_summary import short_name  # noqa: E402  (a sibling script)

REASON = re.compile(r"^stall_(\w+)$")  # the all-samples columns; "(Not Issued)" ones are left out


def kernels(path: str):
    """(kernel name, header, rows) for each kernel of the file."""
    name, header, rows = None, None, []
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                if name is not None:
                    yield name, header, rows
                name, header, rows = row[1], None, []
            elif header is None:
                header = row
            else:
                rows.append(row)
    if name is not None:
        yield name, header, rows


def count(text: str) -> int:
    try:
        return int(float(text.replace(",", "")))
    except ValueError:
        return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=25, help="SASS lines shown per kernel (default: 25)")
    p.add_argument("--min-share", type=float, default=0.05, help="kernels of less of all samples are left out")
    args = p.parse_args()
    found = list(kernels(args.csv))
    col_samples = "Warp Stall Sampling (All Samples)"
    totals = {n: sum(count(r[h.index(col_samples)]) for r in rows) for n, h, rows in found}
    everything = sum(totals.values()) or 1  # over the kernels, each counted once
    shown = set()
    for name, header, rows in found:
        # ncu's source page holds each kernel twice: the first copy is shown.
        if totals[name] < args.min_share * everything or name in shown:
            continue
        shown.add(name)
        col = {c: i for i, c in enumerate(header)}
        reasons = [(REASON.match(c).group(1), i) for c, i in col.items() if REASON.match(c)]
        by_reason = Counter()
        by_opcode = Counter()
        by_runs, lines_by_runs = Counter(), Counter()
        runs_col = col.get("Instructions Executed")
        for r in rows:
            for reason, i in reasons:
                by_reason[reason] += count(r[i])
            if runs_col is not None:
                runs = count(r[runs_col])
                by_runs[runs] += count(r[col[col_samples]])
                lines_by_runs[runs] += 1
            opcode = r[col["Source"]].split()
            opcode = [w for w in opcode if not w.startswith("@")]
            by_opcode[opcode[0].split(".")[0] if opcode else "?"] += count(r[col[col_samples]])
        total = totals[name] or 1
        print(f"## {short_name(name, 90)}\n")
        print(f"{totals[name]:,} samples, {len(rows):,} SASS lines")
        print("by reason: " + ", ".join(f"{k} {v / total:.1%}" for k, v in by_reason.most_common(10) if v))
        print("by opcode: " + ", ".join(f"{k} {v / total:.1%}" for k, v in by_opcode.most_common(12) if v))
        if by_runs:
            print("by runs of a line: " + ", ".join(f"{runs:,} ({lines_by_runs[runs]} lines) {v / total:.1%}"
                                                   for runs, v in by_runs.most_common(6) if v))
        print(f"\n| offset | SASS | samples | largest reasons |\n|---|---|---|---|")
        base = int(rows[0][col["Address"]], 16) if rows else 0
        ranked = sorted(rows, key=lambda r: count(r[col[col_samples]]), reverse=True)[: args.top]
        for r in sorted(ranked, key=lambda r: int(r[col["Address"]], 16)):
            samples = count(r[col[col_samples]])
            top = sorted(((count(r[i]), reason) for reason, i in reasons), reverse=True)[:2]
            why = ", ".join(f"{reason} {n / max(samples, 1):.0%}" for n, reason in top if n)
            sass = " ".join(r[col["Source"]].split())
            print(f"| {int(r[col['Address']], 16) - base:#06x} | `{sass}` | {samples / total:.1%} | {why} |")
        print()


if __name__ == "__main__":
    main()
