"""What the passes rewrote and what they declined, collected per ``explain()`` call."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading

log = logging.getLogger("hstu_inductor")

KINDS = ("attention", "preprocess", "output")


@dataclasses.dataclass
class GraphBreak:
    """One Dynamo graph break seen during an explained call.

    ``file``/``line``: the user's code where Dynamo broke (the innermost frame); ``reason``:
    Dynamo's reason, condensed to its first lines (``full_reason`` keeps all of it); ``hint``: how
    to avoid it; ``effect``: what it does to HSTU candidates when that can be told (empty if not):
    a break that *splits* a candidate starts with ``"splits"``."""

    file: str
    line: int
    reason: str
    hint: str
    effect: str = ""
    full_reason: str = dataclasses.field(default="", repr=False)

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def splits_candidate(self) -> bool:
        return self.effect.startswith("splits")


@dataclasses.dataclass
class Fallback:
    """A graph (or frame) where a stage of ours raised, and what was compiled instead.

    ``stage``: ``"canonicalise"``, ``"ATen retrace"``, ``"rewriters"``, ``"cost rule"``, ``"compile"``
    (Inductor or AOTAutograd on the rewritten graph) or ``"frame trace"`` (Dynamo tracing the frame
    under our frame config); ``error``: the exception, ``"Type: message"`` (condensed)."""

    stage: str
    error: str
    instead: str

    def __str__(self) -> str:
        return f"{self.stage} failed ({self.error}); {self.instead}"


def describe_error(e: BaseException, limit: int = 600) -> str:
    """``"Type: message"``, the message's first lines only (torch's can run to pages)."""
    text = " ".join(line.strip() for line in str(e).strip().splitlines()[:4] if line.strip())
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


class StageFailed(Exception):
    """An exception of one of our stages (:func:`stage`), for the backend to fall back on."""

    def __init__(self, stage_name: str, error: Exception):
        super().__init__(f"{stage_name}: {describe_error(error)}")
        self.stage, self.error = stage_name, error


@contextlib.contextmanager
def stage(name: str):
    """Raise an exception of the block as :class:`StageFailed` naming ``name``. Under
    ``config.strict``, and for the exceptions Dynamo steers a compile with (a restart of the frame's
    analysis, a skipped frame: ``_compat.dynamo_control_flow``), the exception passes unchanged."""
    from . import _compat, config

    try:
        yield
    except StageFailed:
        raise
    except Exception as e:
        if config.strict or isinstance(e, _compat.dynamo_control_flow()):
            raise
        raise StageFailed(name, e) from e


@dataclasses.dataclass
class RewriteReport:
    """Counts of rewritten subgraphs per kind, and ``(kind, reason)`` for candidates left alone."""

    counts: dict = dataclasses.field(default_factory=lambda: {k: 0 for k in KINDS})
    near_misses: list = dataclasses.field(default_factory=list)
    details: list = dataclasses.field(default_factory=list)  # (kind, spelling/description) per rewrite
    lowered: dict = dataclasses.field(default_factory=dict)  # post-grad: how hstu ops reached Inductor
    graphs: int = 0
    cost_rule: list = dataclasses.field(default_factory=list)  # one line per graph the cost rule decided
    graph_breaks: list = dataclasses.field(default_factory=list)  # GraphBreak, filled by explain()
    fallbacks: list = dataclasses.field(default_factory=list)  # Fallback: a stage of ours raised
    proofs: list = dataclasses.field(default_factory=list)  # (kind, node, seconds) per proven candidate
    # attention implementations chosen while the graphs were traced (ops/variants.py): "fwd:gluon_ws" -> count
    variants: dict = dataclasses.field(default_factory=dict)
    # one ``graph_breaks.GraphRecord`` per Dynamo graph compiled (where it starts/ends, what it holds)
    records: list = dataclasses.field(default_factory=list, repr=False)

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
        if self.fallbacks:
            lines.append(f"  fallbacks ({len(self.fallbacks)}):")
            lines += [f"    ! {f}" for f in self.fallbacks]
        lines += [f"  cost rule: {what}" for what in self.cost_rule]
        if self.graph_breaks:
            lines.append(f"  graph breaks ({len(self.graph_breaks)}):")
            for b in self.graph_breaks:
                lines.append(f"    ! {b.where}: {b.reason}")
                if b.effect:
                    lines.append(f"        effect: {b.effect}")
                lines.append(f"        avoid:  {b.hint}")
        else:
            lines.append("  graph breaks: none")
        if self.lowered:
            lines.append("  after AOTAutograd (fwd+bwd graphs compiled now; none on a cache hit):")
            lines += [f"    {what}: {n}" for what, n in sorted(self.lowered.items())]
        if self.variants:
            lines.append("  attention kernels chosen: " + ", ".join(f"{k} x{n}" for k, n in sorted(self.variants.items())))
        return "\n".join(lines)

    def as_dict(self) -> dict:
        """The decisions as plain JSON data (the structured-trace artifact ``hstu_rewrites``)."""
        return {
            "graphs": self.graphs,
            "counts": dict(self.counts),
            "rewrites": [{"kind": kind, "what": what} for kind, what in self.details],
            "near_misses": [{"kind": kind, "reason": reason} for kind, reason in self.near_misses],
            "fallbacks": [dataclasses.asdict(f) for f in self.fallbacks],
            "cost_rule": list(self.cost_rule),
            "proofs": [{"kind": kind, "node": node, "seconds": seconds} for kind, node, seconds in self.proofs],
            "variants": dict(self.variants),
            "lowered": dict(self.lowered),
        }

    def merge(self, other: "RewriteReport") -> None:
        for k, v in other.counts.items():
            self.counts[k] = self.counts.get(k, 0) + v
        self.near_misses += other.near_misses
        self.details += other.details
        for k, v in other.lowered.items():
            self.lowered[k] = self.lowered.get(k, 0) + v
        self.graphs += other.graphs
        self.cost_rule += other.cost_rule
        self.graph_breaks += other.graph_breaks
        self.fallbacks += other.fallbacks
        self.proofs += other.proofs
        self.records += other.records


_local = threading.local()


def _active() -> list:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def _stages() -> list:
    if not hasattr(_local, "stages"):
        _local.stages = []
    return _local.stages


@contextlib.contextmanager
def collecting():
    """Collect the reports of every graph compiled inside the block into one RewriteReport."""
    report = RewriteReport()
    _active().append(report)
    try:
        yield report
    finally:
        _active().remove(report)


@contextlib.contextmanager
def staged():
    """One backend compile: the reports published inside are held in the yielded RewriteReport and
    handed on (to the enclosing stage, else to the collectors and the log) only if the block ends
    without an exception. Dynamo abandons a compile by raising through the backend (e.g. its
    ``dynamic=True`` float handling restarts the analysis and calls the backend again for the same
    frame), so an abandoned compile's rewrites are never counted next to its redo's."""
    stage = RewriteReport()
    _stages().append(stage)
    try:
        yield stage
    finally:
        _stages().pop()
    publish(stage)


def publish(report: RewriteReport) -> None:
    """Hand one graph's report to the current stage (a backend compile still under way), or else to
    every active collector, log it (INFO: ``TORCH_LOGS="hstu_inductor"``, ``set_logs(modules={"hstu": logging.INFO})``)
    and emit it as the structured-trace artifact ``hstu_rewrites`` (``TORCH_TRACE``; docs/debugging.md)."""
    if _stages():
        _stages()[-1].merge(report)
        return
    for collector in _active():
        collector.merge(report)
    if any(report.counts.values()) or report.near_misses or report.fallbacks:
        log.info("%s", report)
    from . import _compat

    # also when nothing was found: tlparse then shows that our backend saw the frame
    _compat.trace_json_artifact("hstu_rewrites", report.as_dict)
