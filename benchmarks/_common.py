"""Shared by the benchmark scripts: where their result rows go."""
from __future__ import annotations

import csv
import logging
import os


def write_csv(rows: list, out: str, name: str) -> str:
    """Write ``rows`` (dicts with the same keys) to ``out/name`` and log the path."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    logging.getLogger("hstu_inductor.benchmarks").info("wrote %s", path)
    return path
