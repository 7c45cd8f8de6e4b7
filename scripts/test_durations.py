#!/usr/bin/env python3
"""Write ``tests/durations.txt`` (seconds per test, costliest first) from pytest's
``--durations=0`` report, read from the files given or stdin.

``tests/conftest.py`` queues xdist's work units longest first from this file; ``make durations``
runs the suite and calls this. Setup, call and teardown of one test are summed.
"""
from __future__ import annotations

import collections
import fileinput
import os
import re

_LINE = re.compile(r"^\s*([0-9.]+)s\s+(setup|call|teardown)\s+(\S.*?)\s*$")


def main() -> None:
    secs: dict[str, float] = collections.defaultdict(float)
    for line in fileinput.input():
        m = _LINE.match(line)
        if m:
            secs[m.group(3)] += float(m.group(1))
    if not secs:
        raise SystemExit("no --durations lines found in the input")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "durations.txt")
    with open(out, "w", encoding="utf-8") as f:
        f.write("# seconds nodeid: written by scripts/test_durations.py (make durations); read by\n"
                "# tests/conftest.py to queue xdist's work longest first. Stale entries only reorder.\n")
        for nodeid, s in sorted(secs.items(), key=lambda kv: (-kv[1], kv[0])):
            f.write(f"{s:.2f} {nodeid}\n")
    print(f"{len(secs)} tests, {sum(secs.values()):.0f} s -> {os.path.normpath(out)}")


if __name__ == "__main__":
    main()
