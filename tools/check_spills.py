#!/usr/bin/env python3
"""Checks the ptxas spill reports of a build against tools/spill_budget.txt.

The build must run ptxas with -v (cmake -DHATTN_PTXAS_VERBOSE=ON; scripts/test.sh does). For
each kernel compiled in the log, its spill stores (bytes) must not exceed its budget: the
largest budget of the lines in spill_budget.txt that match it, 0 when none does. A kernel
over its budget fails the check (exit 1): a change spilled where it did not before, which
a GPU run would otherwise be the first to show. A kernel under a budget above 0 is listed,
so that the budget can be lowered. Kernels the log does not show (an incremental build) are
not checked. Spills depend on the compiler: with --nvcc VERSION (the build's nvcc) and a budget
for another major.minor version (its `nvcc` line), nothing is checked and it says so.
Usage: tools/check_spills.py BUILD_LOG [--nvcc VERSION] [--budget FILE]
"""
import argparse
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
ENTRY = re.compile(r"Compiling entry function '([^']+)'")
SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


# A named namespace's kernels, keyed by the folder they come from.
NAMESPACE_STEMS = {"fwd": "attention", "bwd": "attention_backward", "mla": "mla"}


def kernel_key(mangled):
    """'FILE_STEM KERNEL_AND_ARGS' for a kernel in a file's anonymous namespace (the namespace's
    hashes differ between checkouts), 'attention KERNEL_AND_ARGS' for the production forward's
    (namespace hattn::fwd, src/attention/), 'attention_backward KERNEL_AND_ARGS' for the production
    backward's (hattn::bwd, src/attention/backward/), 'mla KERNEL_AND_ARGS' for MLA decoding's
    (hattn::mla, src/mla/), else the mangled name."""
    m = re.match(r"_ZN5hattn\d+_GLOBAL__N__[0-9a-f]+_\d+_(\w+?)_cu_[0-9a-f]{8}\d+(\w+)$", mangled)
    if m:
        return f"{m.group(1)} {m.group(2)}"
    m = re.match(r"_ZN5hattn3(fwd|bwd|mla)\d+(\w+)$", mangled)
    return f"{NAMESPACE_STEMS[m.group(1)]} {m.group(2)}" if m else mangled


def parse_log(text):
    """{kernel key: spill store bytes} from ptxas -v output."""
    spills, current = {}, None
    for line in text.splitlines():
        entry = ENTRY.search(line)
        if entry:
            current = kernel_key(entry.group(1))
            continue
        spill = SPILL.search(line)
        if spill and current is not None:
            spills[current] = max(spills.get(current, 0), int(spill.group(1)))
            current = None
    return spills


def parse_budget(text):
    """[(file stem, regex over the kernel and its template arguments, bytes)]."""
    budget = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("nvcc "):
            stem, pattern, limit = line.split()
            budget.append((stem, re.compile(pattern), int(limit)))
    return budget


def budget_nvcc(text):
    """The nvcc major.minor the budget was measured with (its `nvcc X.Y` line), or None."""
    m = re.search(r"^nvcc\s+(\d+\.\d+)", text, re.M)
    return m.group(1) if m else None


def check(spills, budget):
    """(failures, loose): kernels over their budget, and kernels under a budget above 0."""
    failures, loose = [], []
    for key, stored in sorted(spills.items()):
        stem, _, kernel = key.partition(" ")
        limits = [limit for s, pattern, limit in budget if s == stem and pattern.search(kernel)]
        limit = max(limits, default=0)
        if stored > limit:
            failures.append(f"{key}: {stored} bytes of spill stores, budget {limit}")
        elif stored < limit:
            loose.append(f"{key}: {stored} bytes of spill stores, budget {limit}")
    return failures, loose


def main(argv):
    parser = argparse.ArgumentParser(prog="tools/check_spills.py")
    parser.add_argument("log")
    parser.add_argument("--nvcc", help="the build's nvcc version, e.g. 13.0.88")
    parser.add_argument("--budget", default=str(ROOT / "tools" / "spill_budget.txt"))
    args = parser.parse_args(argv[1:])
    budget_text = pathlib.Path(args.budget).read_text()
    measured_with = budget_nvcc(budget_text)
    if args.nvcc and measured_with and ".".join(args.nvcc.split(".")[:2]) != measured_with:
        print(f"check_spills: the budget is for nvcc {measured_with}, this build used {args.nvcc}: not checked")
        return 0
    spills = parse_log(pathlib.Path(args.log).read_text(errors="replace"))
    failures, loose = check(spills, parse_budget(budget_text))
    for line in loose:
        print("under budget (lower it):", line)
    for line in failures:
        print("OVER BUDGET:", line)
    print(f"check_spills: {len(spills)} kernels in the log, {len(failures)} over budget")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
