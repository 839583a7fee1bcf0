#!/usr/bin/env python3
"""Instruction mix of address ranges of one kernel's SASS, two kernels side by side.

    step_mix.py LISTING_A REGEX_A RANGES_A LISTING_B REGEX_B RANGES_B

LISTING: nvdisasm -c output (scripts/disasm.sh's OUT.all); REGEX: picks the kernel's .text
section by its mangled name; RANGES: comma-separated hex START-END (END exclusive) of the
instructions to count. Prints each opcode's count (predicates and modifiers dropped) in both.
"""
import collections
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "tools"))
from sass_loops import INSTRUCTION, opcode, split_kernels  # noqa: E402  (the listing's parsing, once)


def mix(listing, regex, ranges):
    kernels = [lines for name, lines in split_kernels(open(listing).read()).items() if re.search(regex, name)]
    if len(kernels) != 1:
        sys.exit(f"{listing}: {len(kernels)} kernels match {regex!r}; want one")
    spans = [tuple(int(x, 16) for x in r.split("-")) for r in ranges.split(",")]
    counts = collections.Counter()
    for line in kernels[0]:
        m = INSTRUCTION.match(line)
        if m and any(lo <= int(m.group(1), 16) < hi for lo, hi in spans):
            counts[opcode(m.group(2).strip())] += 1
    return counts


a, b = mix(*sys.argv[1:4]), mix(*sys.argv[4:7])
print(f"{'opcode':12s} {'A':>5s} {'B':>5s}")
print(f"{'all':12s} {sum(a.values()):5d} {sum(b.values()):5d}")
for op in sorted(set(a) | set(b), key=lambda k: (-(a[k] + b[k]), k)):
    print(f"{op:12s} {a[op]:5d} {b[op]:5d}")
