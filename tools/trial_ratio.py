#!/usr/bin/env python3
"""A trial's hattn-bench times over main's, point by point.

scripts/gpu_run.sh's `trial` step times the same points with this run's binaries and a trial's,
in the order main, trial, trial, main, each call writing its own CSV. This reads them, matches
the points (every column that is not a measurement, and the point's place among equal ones),
and prints each point's mean trial time over its mean main time, then one line with the
ratios' min, median and max (below 1: the trial is faster). A point missing on one side, or
failing its check on either, is listed and left out of the ratios; a failed check is a result
to read, never a speedup. With --probe the trial is a timing probe, a build that leaves work
out on purpose (its results are wrong, its checks fail): its times are compared anyway, and
only main's checks must pass.
Usage: tools/trial_ratio.py [--probe] --main A.csv [B.csv ...] --trial C.csv [D.csv ...]
"""

import argparse
import csv
import statistics
import sys

# hattn-bench's CSV columns that a call measures; the others name the point.
MEASURED = {"commit", "gpu", "sm_clock_mhz", "gemm_tflops", "reps", "ms", "tflops", "pct_gemm", "max_err",
            "err_budget", "check", "gbps"}
# Columns shown for a point, when present, in this order.
SHOWN = ("kernel", "dtype", "kv_dtype", "head_dim", "causal", "batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv",
         "varlen", "window_left", "window_right", "num_splits", "pack_gqa")


def read_points(paths):
    """{point key: [(ms, check), ...]} over the files, and each key's shown columns."""
    times, shown = {}, {}
    for path in paths:
        seen = {}
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                base = tuple((k, v) for k, v in row.items() if k not in MEASURED and k is not None)
                seen[base] = seen.get(base, 0) + 1
                key = base + (("#", seen[base]),)
                times.setdefault(key, []).append((float(row["ms"]), row.get("check", "PASS")))
                shown[key] = " ".join(f"{c}={row[c]}" for c in SHOWN if row.get(c) not in (None, ""))
    return times, shown


def who(probe):
    """How the lines name the trial's side."""
    return "probe" if probe else "trial"


def compare(main_paths, trial_paths, probe=False):
    """(lines of the table, the ratios); probe: the trial's checks are not read."""
    side = who(probe)
    main, shown = read_points(main_paths)
    trial, trial_shown = read_points(trial_paths)
    shown.update(trial_shown)
    lines, ratios = [], []
    for key in list(main) + [k for k in trial if k not in main]:
        if key not in main or key not in trial:
            lines.append(f"{shown[key]}: only in {'main' if key in main else 'the trial'}")
            continue
        failed = [check for _, check in main[key] + ([] if probe else trial[key]) if check != "PASS"]
        if failed:
            lines.append(f"{shown[key]}: check {failed[0]}, not compared")
            continue
        main_ms = statistics.fmean(ms for ms, _ in main[key])
        trial_ms = statistics.fmean(ms for ms, _ in trial[key])
        ratios.append(trial_ms / main_ms)
        lines.append(f"{shown[key]}: main {main_ms:.4f} ms, {side} {trial_ms:.4f} ms, {side}/main {ratios[-1]:.3f}")
    return lines, ratios


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--main", nargs="+", required=True, help="main's CSVs")
    parser.add_argument("--trial", nargs="+", required=True, help="the trial's CSVs")
    parser.add_argument("--probe", action="store_true", help="a timing probe: its failed checks are expected")
    args = parser.parse_args()
    lines, ratios = compare(args.main, args.trial, args.probe)
    side = who(args.probe)
    print("\n".join(lines))
    if not ratios:
        print(f"{side}/main: no point compared")
        return 1
    print(f"{side}/main time over {len(ratios)} points: min {min(ratios):.3f}, median {statistics.median(ratios):.3f}, "
          f"max {max(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
