"""What the passes rewrote and what they declined, collected per ``explain()`` call."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading

log = logging.getLogger("hstu_inductor")

KINDS = ("attention", "preprocess", "output")


@dataclasses.dataclass
class RewriteReport:
    """Counts of rewritten subgraphs per kind, and ``(kind, reason)`` for candidates left alone."""

    counts: dict = dataclasses.field(default_factory=lambda: {k: 0 for k in KINDS})
    near_misses: list = dataclasses.field(default_factory=list)
    details: list = dataclasses.field(default_factory=list)  # (kind, spelling/description) per rewrite
    lowered: dict = dataclasses.field(default_factory=dict)  # post-grad: how hstu ops reached Inductor
    graphs: int = 0

    def __str__(self) -> str:
        lines = [f"hstu_inductor report: {self.graphs} graph(s) compiled"]
        lines += [f"  rewritten {kind:<10} {n}" for kind, n in self.counts.items()]
        for kind, what in self.details:
            lines.append(f"    + {kind}: {what}")
        if self.near_misses:
            lines.append(f"  near misses ({len(self.near_misses)}):")
            lines += [f"    - {kind}: {reason}" for kind, reason in self.near_misses]
        else:
            lines.append("  near misses: none")
        if self.lowered:
            lines.append("  after AOTAutograd (fwd+bwd graphs compiled now; none on a cache hit):")
            lines += [f"    {what}: {n}" for what, n in sorted(self.lowered.items())]
        return "\n".join(lines)

    def merge(self, other: "RewriteReport") -> None:
        for k, v in other.counts.items():
            self.counts[k] = self.counts.get(k, 0) + v
        self.near_misses += other.near_misses
        self.details += other.details
        for k, v in other.lowered.items():
            self.lowered[k] = self.lowered.get(k, 0) + v
        self.graphs += other.graphs


_local = threading.local()


def _active() -> list:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


@contextlib.contextmanager
def collecting():
    """Collect the reports of every graph compiled inside the block into one RewriteReport."""
    report = RewriteReport()
    _active().append(report)
    try:
        yield report
    finally:
        _active().remove(report)


def publish(report: RewriteReport) -> None:
    """Hand one graph's report to every active collector, and log it."""
    for collector in _active():
        collector.merge(report)
    if any(report.counts.values()) or report.near_misses:
        log.info("%s", report)
