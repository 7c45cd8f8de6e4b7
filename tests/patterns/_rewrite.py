"""Rewriting an exported program's ATen graph directly (the fake-tensor production-size tests)."""
import time

import torch

from hstu_inductor import _compat
from hstu_inductor.patterns import run_rewriters
from hstu_inductor.report import collecting


class FnModule(torch.nn.Module):
    """A plain function as a module, for ``torch.export.export``."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def rewrite_exported(ep):
    """Run the rewriters on the ATen graph of ``ep`` (its own fake inputs). Returns (report, graph, seconds)."""
    vals = [n.meta["val"] for n in ep.graph_module.graph.find_nodes(op="placeholder")]
    start = time.perf_counter()
    with collecting() as report, torch._guards.detect_fake_mode(vals):
        gm = _compat.trace_aten(ep.graph_module, vals)
        run_rewriters(gm)
    return report, gm, time.perf_counter() - start
