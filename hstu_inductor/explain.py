"""``hstu_inductor.explain``: what the backend rewrote, and why it left candidates alone."""
from __future__ import annotations

import torch

from .report import RewriteReport, collecting

__all__ = ["explain"]


def explain(model_or_fn, *args, dynamic=None, backend: str = "hstu", **kwargs) -> RewriteReport:
    """Compile ``model_or_fn`` with ``backend="hstu"``, run it once on ``args``/``kwargs``, report.

    The report's ``.counts`` (``attention``/``preprocess``/``output``), ``.variants`` (the attention kernels
    the compiled graphs run, ``ops/variants.py``), ``.near_misses``,
    ``.fallbacks`` (stages of ours that raised, with the exception: the graph or frame was then
    compiled as stock would) and ``.output`` (the compiled result) cover this call only. Dynamo's
    cache is reset first so every graph is compiled (and reported) afresh; note that this also
    discards code compiled earlier in the process (it recompiles on its next call).

    ``backend="hstu_eager"`` makes the same rewrites and decisions but runs the rewritten graphs
    op by op instead of generating code (much faster to answer on a large model); the report then
    has no ``lowered`` lines, which describe Inductor's code.
    """
    from . import graph_breaks
    from .ops import variants
    from .backend import hstu_backend, hstu_eager_backend, register

    backends = {"hstu": hstu_backend, "hstu_eager": hstu_eager_backend}
    if backend not in backends:
        raise ValueError(f"explain(backend=...) must be one of {sorted(backends)}, got {backend!r}")
    torch._dynamo.reset()
    register()  # a no-op once registered (our frame config survives reset())
    compiled = torch.compile(model_or_fn, backend=backends[backend], dynamic=dynamic)
    variants.reset_traced()
    with collecting() as report, graph_breaks.collect(report):
        report.output = compiled(*args, **kwargs)
    report.variants = variants.traced()
    return report
