"""Shared by the benchmark scripts: where their result rows go, the peak memory of a step."""
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


def peak_mib(step) -> tuple:
    """(MiB allocated by one call of ``step`` above what was allocated before it, absolute peak MiB): the
    memory the step itself needs (e.g. N x N buffers), and with its inputs. CUDA; ``step`` already warmed up."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return (peak - base) / 2 ** 20, peak / 2 ** 20
