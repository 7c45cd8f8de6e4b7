"""Registry of rewriters, one list per subgraph kind.

A rewriter is ``fn(gm: torch.fx.GraphModule, report: RewriteReport) -> None``: it finds candidate
subgraphs of its kind in an ATen-level graph (see ``_compat.trace_aten``), proves them, rewrites
the proven ones to ``torch.ops.hstu.*`` (``report.counts[kind] += 1``, ``report.details``) and
records why the others were left alone (``report.near_misses.append((kind, reason))``).
"""
from __future__ import annotations

from typing import Callable

import torch

from ..report import KINDS, RewriteReport

Rewriter = Callable[[torch.fx.GraphModule, RewriteReport], None]

REWRITERS: dict[str, list[Rewriter]] = {k: [] for k in KINDS}


def register(kind: str):
    """Decorator adding a rewriter for ``kind`` (one of ``attention``, ``preprocess``, ``output``)."""
    if kind not in REWRITERS:
        raise ValueError(f"unknown pattern kind {kind!r}; expected one of {KINDS}")

    def deco(fn: Rewriter) -> Rewriter:
        REWRITERS[kind].append(fn)
        return fn

    return deco
