#!/usr/bin/env python3
"""The loops of one or more kernels in an nvdisasm listing, with their instruction mix.

    python3 tools/sass_loops.py LISTING REGEX [--out FILE] [--min N] [--order]

LISTING is `nvdisasm -c` output (scripts/disasm.sh makes one); REGEX picks kernels by mangled
name. For each kernel: its instruction count and HGMMA count, then each loop (a branch back
to an earlier label) that holds an HGMMA or at least --min instructions: its address range,
size and opcode histogram. --out writes the matching kernels' listings to FILE. --order
prints instead, in address order, where the kernel waits and synchronizes beside its math:
its wgmma waits, GEMMs, barriers and arrives, branches, shuffles, row maxima, exponentials
and packs, a run of one opcode folded into its first line and a count.
"""
import argparse
import collections
import re
import signal
import sys


def split_kernels(text):
    """{mangled name: [listing lines]} per .text section."""
    kernels, current = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*\.section\s+\.text\.(\S+?),", line)
        if m:
            current = m.group(1)
            kernels[current] = []
        elif current:
            kernels[current].append(line)
    return kernels


# One instruction of the listing: its address and its text up to the semicolon.
INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")


def mnemonic(instruction):
    """The instruction's name with its modifiers, without a predicate: "MUFU.EX2"."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0]


def opcode(instruction):
    return mnemonic(instruction).split(".")[0]


def loops(lines):
    """[(first, last, [instructions])] for each backward branch."""
    labels, instrs = {}, []
    for line in lines:
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(instrs)
            continue
        m = INSTRUCTION.match(line)
        if m:
            instrs.append((int(m.group(1), 16), m.group(2).strip()))
    found = []
    for j, (_, text) in enumerate(instrs):
        m = re.search(r"BRA\s+(?:`\()?(\.L_x_\d+)", text)
        if m and labels.get(m.group(1), j + 1) <= j:
            start = labels[m.group(1)]
            found.append((instrs[start][0], instrs[j][0], [t for _, t in instrs[start:j + 1]]))
    return instrs, found


# What --order prints: waits and GEMMs, barriers and arrives, branches, and the softmax's steps.
ORDER_OPCODES = re.compile(r"^(WARPGROUP\.DEPBAR|HGMMA|BAR\.|SYNCS\.ARRIVE|BRA|SHFL|FMNMX|MUFU\.EX2|F2FP)")


def order(lines):
    """["ADDR INSTRUCTION", "    ... N more"] for the instructions ORDER_OPCODES picks."""
    printed, last, repeats = [], None, 0
    for line in lines:
        m = INSTRUCTION.match(line)
        if not m:
            continue
        text = m.group(2).strip()
        name = mnemonic(text)
        if not ORDER_OPCODES.match(name):
            continue
        if name == last:
            repeats += 1
            continue
        if repeats:
            printed.append(f"    ... {repeats} more")
        printed.append(f"{m.group(1)} {text}")
        last, repeats = name, 0
    if repeats:
        printed.append(f"    ... {repeats} more")
    return printed


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("listing")
    p.add_argument("regex")
    p.add_argument("--out")
    p.add_argument("--min", type=int, default=200, help="show loops without HGMMA from this size (default 200)")
    p.add_argument("--order", action="store_true", help="the waits, barriers and softmax steps in address order")
    args = p.parse_args(argv)
    kernels = {k: v for k, v in split_kernels(open(args.listing).read()).items() if re.search(args.regex, k)}
    if not kernels:
        print(f"no kernel matches {args.regex!r}", file=sys.stderr)
        return 1
    if args.out:
        with open(args.out, "w") as f:
            for name, lines in kernels.items():
                f.write(f"// {name}\n" + "\n".join(lines) + "\n")
    for name, lines in kernels.items():
        if args.order:
            print(name + "\n" + "\n".join(order(lines)))
            continue
        instrs, found = loops(lines)
        total = collections.Counter(opcode(t) for _, t in instrs)
        print(f"{name}\n  {len(instrs)} instructions, HGMMA {total['HGMMA']}")
        for first, last, body in found:
            ops = collections.Counter(opcode(t) for t in body)
            if ops["HGMMA"] == 0 and len(body) < args.min:
                continue
            print(f"  loop {first:#x}-{last:#x}: {len(body)} instructions, HGMMA {ops['HGMMA']}")
            print("    " + ", ".join(f"{k} {v}" for k, v in ops.most_common(24)))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # piped into head: stop quietly
    raise SystemExit(main())
