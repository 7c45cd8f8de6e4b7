"""Search/replace patterns that find HSTU subgraphs in ATen graphs and rewrite them to hstu ops.

Importing this package registers every rewriter (see ``registry.register``). The pattern table
and how to add a spelling are documented in ``docs/patterns.md``.
"""
from . import attention, blocks  # noqa: F401  (each module registers its rewriters)
from .pipeline import HSTUPatternPass, rewrite_dynamo_graph, run_rewriters
from .registry import REWRITERS, register

__all__ = ["HSTUPatternPass", "rewrite_dynamo_graph", "run_rewriters", "REWRITERS", "register"]
