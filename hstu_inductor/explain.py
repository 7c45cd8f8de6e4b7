"""``hstu_inductor.explain``: what the backend rewrote, and why it left candidates alone."""
from __future__ import annotations

import torch

from .report import RewriteReport, collecting

__all__ = ["explain"]


def explain(model_or_fn, *args, dynamic=None, **kwargs) -> RewriteReport:
    """Compile ``model_or_fn`` with ``backend="hstu"``, run it once on ``args``/``kwargs``, report.

    The report's ``.counts`` (``attention``/``preprocess``/``output``), ``.near_misses`` and
    ``.output`` (the compiled result) cover this call only. Dynamo's cache is reset first so
    every graph is compiled (and reported) afresh; note that this also discards code compiled
    earlier in the process (it recompiles on its next call).
    """
    from .backend import hstu_backend

    torch._dynamo.reset()
    compiled = torch.compile(model_or_fn, backend=hstu_backend, dynamic=dynamic)
    with collecting() as report:
        report.output = compiled(*args, **kwargs)
    return report
