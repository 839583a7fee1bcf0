#!/usr/bin/env python3
"""Checks that the code excerpts of the guide still match the code.

Every line of a ```cuda block in docs/guide/*.md must appear, stripped of indentation, in a
file under src/ (lines holding "..." mark elisions and are skipped). An excerpt that no longer
matches means a chapter explains code that has changed. Exit 1 and list the lines otherwise.
Usage: tools/check_excerpts.py
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE_SUFFIXES = {".cu", ".cuh", ".h", ".cpp", ".inc"}


def main():
    source_lines = set()
    for path in (ROOT / "src").rglob("*"):
        if path.is_file() and path.suffix in SOURCE_SUFFIXES:
            source_lines.update(line.strip() for line in path.read_text().splitlines())
    stale = []
    for chapter in sorted((ROOT / "docs" / "guide").glob("*.md")):
        for block in re.findall(r"```cuda\n(.*?)```", chapter.read_text(), re.S):
            for line in block.splitlines():
                text = line.strip()
                if text and "..." not in text and text not in source_lines:
                    stale.append(f"{chapter.relative_to(ROOT)}: {text}")
    for s in stale:
        print("not in src/:", s)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
