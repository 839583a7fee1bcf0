#!/usr/bin/env python3
"""A few lines on what a ctest run did, from its log: how many tests passed, failed and were
skipped, the skipped ones by suite, and why they skipped (the first one's GoogleTest message,
from running it again through the test binary). scripts/test.sh prints this instead of ctest's
own listing of every skipped test (thousands of lines where there is no GPU).

Usage: tools/ctest_summary.py CTEST_LOG [TEST_BINARY]
"""
import collections
import re
import subprocess
import sys

RESULT = re.compile(r"Test\s+#\d+: (\S+).*?(Passed|\*\*\*Skipped|\*\*\*Failed|\*\*\*Timeout|\*\*\*Exception\S*)\s+[\d.]+ sec")


def skip_reason(binary, test):
    """The GoogleTest skip message of one test, run alone."""
    try:
        out = subprocess.run([binary, f"--gtest_filter={test}"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if "Skipped" in line and i + 1 < len(lines) and not lines[i + 1].startswith("["):
            return lines[i + 1].strip()
    return None


def main():
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    text = open(sys.argv[1], errors="replace").read()
    results = [(m.group(1), m.group(2).strip("*")) for m in RESULT.finditer(text)]
    counts = collections.Counter(status for _, status in results)
    skipped = [name for name, status in results if status == "Skipped"]
    failed = [name for name, status in results if status not in ("Passed", "Skipped")]
    print(f"ctest: {len(results)} tests: {counts['Passed']} passed, {len(skipped)} skipped, {len(failed)} failed")
    if skipped:
        suites = collections.Counter(name.split(".")[0] for name in skipped)
        print("  skipped by suite: " + ", ".join(f"{s} {n}" for s, n in suites.most_common()))
        reason = skip_reason(sys.argv[2], skipped[0]) if len(sys.argv) > 2 else None
        if reason:
            print(f"  why (the first, {skipped[0]}): {reason}")
    for name in failed:
        print(f"  FAILED: {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
