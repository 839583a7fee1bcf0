#!/usr/bin/env python3
"""The index of results/evidence/: one row per entry (id, what it holds, the commit its name
carries, the documents that cite it), written between the markers

    <!-- evidence:index -->
    <!-- /evidence -->

of results/README.md. --check (scripts/test.sh runs it) fails when the index is stale, when an
entry is cited by no document (the index itself does not count: an entry nothing cites goes,
git keeps it), or when a document cites results/evidence/NAME that does not exist.

Usage: tools/evidence_index.py [--check]
"""
import argparse
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
EVIDENCE = ROOT / "results" / "evidence"
INDEX = ROOT / "results" / "README.md"
MARKER = re.compile(r"(<!-- evidence:index -->\n)(.*?)(<!-- /evidence -->)", re.S)
TEXT_SUFFIXES = {".md", ".py", ".cu", ".cuh", ".h", ".cpp", ".sh", ".txt", ".toml"}
CITE = re.compile(r"evidence/([\w.+-]*(?:\{[\w,]+\}[\w.+-]*)?)")
COMMIT = re.compile(r"(?<![0-9a-f])([0-9a-f]{7,12})(?![0-9a-f])")


def tracked_files():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [f for f in out.split() if (ROOT / f).is_file()]


def cited_names(text):
    """The evidence names a text cites: evidence/NAME, with a brace list expanded (a_{x,y}.log
    cites a_x.log and a_y.log)."""
    names = set()
    for m in CITE.finditer(text):
        cite = m.group(1).rstrip(".")
        brace = re.match(r"(.*)\{([\w,]+)\}(.*)", cite)
        if brace:
            names.update(brace.group(1) + alt + brace.group(3) for alt in brace.group(2).split(","))
        elif cite:
            names.add(cite)
    return names


def documents():
    """{path: text} of the tracked text files outside results/evidence/ (the index's block of
    results/README.md left out)."""
    docs = {}
    for f in tracked_files():
        path = ROOT / f
        if (f.startswith("results/evidence/") or path == pathlib.Path(__file__).resolve()
                or (path.suffix not in TEXT_SUFFIXES and path.name != "CMakeLists.txt")):
            continue
        text = path.read_text(errors="replace")
        if path == INDEX:
            text = MARKER.sub("", text)
        docs[f] = text
    return docs


def what(entry):
    """A line on what an entry holds: its README's title, else its kind and size."""
    readme = entry / "README.md" if entry.is_dir() else None
    if readme and readme.exists():
        for line in readme.read_text(errors="replace").splitlines():
            if line.startswith("# "):
                return line[2:].strip().replace("|", "/")
    if entry.is_dir():
        return f"{sum(1 for p in entry.rglob('*') if p.is_file())} files"
    return f"{entry.suffix[1:] or 'file'}, {entry.stat().st_size // 1024 or 1} KB"


def cites_entry(names, entry):
    """Whether cited names reach an entry: the entry itself or a path inside it."""
    return any(n == entry or n.startswith(entry + "/") for n in names)


def index_table(cites):
    """The index's rows; cites: {document: the evidence names it cites}."""
    rows = ["| id | what | commit | cited by |", "|---|---|---|---|"]
    for entry in sorted(EVIDENCE.iterdir(), key=lambda p: p.name):
        citers = sorted(f for f, c in cites.items() if cites_entry(c, entry.name))
        commit = COMMIT.search(entry.name)
        rows.append(f"| `{entry.name}` | {what(entry)} | {commit.group(1) if commit else '–'} | "
                    + ", ".join(f"`{c}`" for c in citers) + " |")
    return "\n".join(rows) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    cites = {f: cited_names(t) for f, t in documents().items()}
    problems = []
    names = {p.name for p in EVIDENCE.iterdir()}
    for f, cited in cites.items():
        for name in sorted(cited):
            if not (EVIDENCE / name).exists():
                problems.append(f"{f} cites results/evidence/{name}, which does not exist")
    for name in sorted(names):
        if not any(cites_entry(c, name) for c in cites.values()):
            problems.append(f"results/evidence/{name} is cited by no document (remove it: git keeps it)")
    text = INDEX.read_text()
    m = MARKER.search(text)
    if not m:
        problems.append(f"{INDEX.relative_to(ROOT)} has no <!-- evidence:index --> markers")
    else:
        new = text[:m.start(2)] + index_table(cites) + text[m.end(2):]
        if new != text:
            if args.check:
                problems.append(f"{INDEX.relative_to(ROOT)}: the evidence index is stale (run tools/evidence_index.py)")
            else:
                INDEX.write_text(new)
                print(f"wrote the index of {len(names)} entries into {INDEX.relative_to(ROOT)}")
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
