#!/usr/bin/env python3
"""The guide's table of lineage diffs: each step against the parent its header names.

Every lineage file (src/lineage/NN_*.cu, src/lineage/bwd_NN_*.cu) but the first of each
lineage names its parent on a `// Parent: NAME.` line near its top. This tool counts the lines
each step adds and removes against that parent (Python's difflib, as `git diff --no-index`
would show them, give or take the diff algorithm) and writes the table between the
<!-- lineage:diffs --> markers of docs/guide/README.md.
Usage: tools/lineage_diffs.py [--check]   (--check: exit 1 when the table is out of date)
"""
import difflib
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "guide" / "README.md"
BEGIN, END = "<!-- lineage:diffs -->", "<!-- /lineage:diffs -->"


def steps():
    """[(path, parent path or None)] in lineage order, forward then backward."""
    files = sorted((ROOT / "src" / "lineage").glob("[0-9][0-9]_*.cu")) + sorted(
        (ROOT / "src" / "lineage").glob("bwd_[0-9][0-9]_*.cu"))
    by_stem = {f.stem: f for f in files}
    out = []
    for f in files:
        m = re.search(r"^// Parent: (\w+)\.$", "\n".join(f.read_text().splitlines()[:3]), re.M)
        if m and m.group(1) not in by_stem:
            sys.exit(f"{f.relative_to(ROOT)}: parent {m.group(1)} is not a lineage file")
        out.append((f, by_stem[m.group(1)] if m else None))
    return out


def changed_lines(parent, child):
    added = removed = 0
    for line in difflib.unified_diff(parent.read_text().splitlines(), child.read_text().splitlines(), n=0,
                                     lineterm=""):
        if line.startswith("+") and not line.startswith("+++"):
            added += 1
        elif line.startswith("-") and not line.startswith("---"):
            removed += 1
    return added, removed


def table():
    rows = ["| step | parent | lines added | lines removed |", "|---|---|---|---|"]
    for f, parent in steps():
        if parent is None:
            rows.append(f"| `{f.stem}` | (none: the first step) | | |")
        else:
            added, removed = changed_lines(parent, f)
            rows.append(f"| `{f.stem}` | `{parent.stem}` | {added} | {removed} |")
    return "\n".join(rows)


def main(argv):
    text = GUIDE.read_text()
    if BEGIN not in text or END not in text:
        sys.exit(f"{GUIDE.relative_to(ROOT)}: no {BEGIN} ... {END} markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{BEGIN}\n{table()}\n{END}{tail}"
    if "--check" in argv:
        if new != text:
            print(f"{GUIDE.relative_to(ROOT)}: the lineage diffs table is out of date (run tools/lineage_diffs.py)")
            return 1
        return 0
    GUIDE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
