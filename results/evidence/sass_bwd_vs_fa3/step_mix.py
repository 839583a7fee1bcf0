#!/usr/bin/env python3
"""Instruction mix of address ranges of one kernel's SASS, two kernels side by side.

    step_mix.py LISTING_A REGEX_A RANGES_A LISTING_B REGEX_B RANGES_B

LISTING: nvdisasm -c output (scripts/disasm.sh's OUT.all); REGEX: picks the kernel's .text
section by its mangled name; RANGES: comma-separated hex START-END (END exclusive) of the
instructions to count. Prints each opcode's count (predicates and modifiers dropped) in both.
"""
import collections
import re
import sys


def kernel_lines(listing, regex):
    text = open(listing).read()
    starts = [m for m in re.finditer(r"^\.text\.(\S+):", text, re.M) if re.search(regex, m.group(1))]
    if len(starts) != 1:
        sys.exit(f"{listing}: {len(starts)} kernels match {regex!r}; want one")
    end = text.find("\n.text.", starts[0].end())
    return text[starts[0].end():end if end >= 0 else None].splitlines()


def mix(listing, regex, ranges):
    spans = [tuple(int(x, 16) for x in r.split("-")) for r in ranges.split(",")]
    counts = collections.Counter()
    for line in kernel_lines(listing, regex):
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if m and any(lo <= int(m.group(1), 16) < hi for lo, hi in spans):
            counts[m.group(2)] += 1
    return counts


a, b = mix(*sys.argv[1:4]), mix(*sys.argv[4:7])
print(f"{'opcode':12s} {'A':>5s} {'B':>5s}")
print(f"{'all':12s} {sum(a.values()):5d} {sum(b.values()):5d}")
for op in sorted(set(a) | set(b), key=lambda k: (-(a[k] + b[k]), k)):
    print(f"{op:12s} {a[op]:5d} {b[op]:5d}")
