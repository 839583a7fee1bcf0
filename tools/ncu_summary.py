"""A short table from ncu's raw metrics (`ncu -i REPORT --page raw --csv`): per kernel, its time,
throughputs, tensor-pipe and issue activity, and its largest warp stall reasons, as cycles a
warp waits per issued instruction. Kernels of under 2% of the longest one's time are left out.

    python3 tools/ncu_summary.py ncu_fa3.csv
"""

from __future__ import annotations

import csv
import re
import sys

# (label, metric) rows shown when the report has them.
ROWS = [
    ("duration (us)", "gpu__time_duration.sum"),
    ("SM throughput %", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("memory throughput %", "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("issue slots busy %", "sm__inst_issued.avg.pct_of_peak_sustained_active"),
    ("instructions (M)", "smsp__inst_executed.sum"),
    ("warp cycles / issue", "smsp__average_warp_latency_per_inst_issued.ratio"),
    ("L2 hit %", "lts__t_sector_hit_rate.pct"),
    ("DRAM throughput %", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("registers / thread", "launch__registers_per_thread"),
    ("grid", "launch__grid_size"),
    ("block", "launch__block_size"),
]
PIPE = re.compile(r"^sm__(pipe_tensor_cycles_active|inst_executed_pipe_tensor_op_gmma)\.avg\.pct_of_peak_sustained_active$")
STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$")
TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}


def number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def short_name(name: str, width: int = 60) -> str:
    """A kernel's name without `void` and its parameter list, cut to `width` in the middle. The
    parameter list opens at the first parenthesis outside the template arguments, which may
    hold their own ("(int)128" in ncu's source page)."""
    depth = 0
    for i, c in enumerate(name):
        depth += (c == "<") - (c == ">")
        if c == "(" and depth == 0:
            name = name[:i]
            break
    name = re.sub(r"^void\s+", "", name)
    if len(name) > width:
        half = (width - 3) // 2
        name = name[:half] + "..." + name[len(name) - (width - 3 - half):]
    return name


def main(path: str) -> None:
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    start = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    header, units, kernels = rows[start], rows[start + 1], rows[start + 2:]
    col = {name: i for i, name in enumerate(header)}
    unit = {name: units[i] for i, name in enumerate(header) if i < len(units)}

    def value(kernel, metric):
        i = col.get(metric)
        if i is None or i >= len(kernel):
            return None
        v = number(kernel[i])
        if v is not None and metric == "gpu__time_duration.sum":
            v *= TO_US.get(unit.get(metric, "usecond"), 1.0)
        return v

    times = [value(k, "gpu__time_duration.sum") or 0.0 for k in kernels]
    longest = max(times, default=0.0)
    kernels = [k for k, t in zip(kernels, times) if t >= 0.02 * longest]
    names = [short_name(k[col["Kernel Name"]]) for k in kernels]
    print("| | " + " | ".join(f"`{n}`" for n in names) + " |")
    print("|---" * (len(names) + 1) + "|")

    def line(label, values):
        cells = ["" if v is None else f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}" for v in values]
        print(f"| {label} | " + " | ".join(cells) + " |")

    for label, metric in ROWS:
        values = [value(k, metric) for k in kernels]
        if metric == "smsp__inst_executed.sum":
            values = [None if v is None else v / 1e6 for v in values]
        if any(v is not None for v in values):
            line(label, values)
    for metric in sorted(m for m in col if PIPE.match(m)):
        values = [value(k, metric) for k in kernels]
        if any(v for v in values):
            line(f"{metric.removeprefix('sm__')} %", values)
    stalls = {STALL.match(m).group(1): m for m in col if STALL.match(m)}
    totals = {reason: sum(value(k, m) or 0.0 for k in kernels) for reason, m in stalls.items()}
    for reason in sorted(totals, key=totals.get, reverse=True)[:8]:
        if totals[reason] > 0:
            line(f"stall: {reason}", [value(k, stalls[reason]) for k in kernels])


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
