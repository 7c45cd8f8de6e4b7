"""The ``"hstu"`` torch.compile backend: Inductor with the HSTU rewrites applied first.

``torch.compile(model, backend="hstu")`` finds this through the ``torch_dynamo_backends`` entry
point, so no import of ``hstu_inductor`` is needed. Flow per Dynamo graph:

1. retrace the torch-level graph to ATen under Dynamo's fake mode (symbolic sizes kept);
2. run the rewriters (``patterns``), which replace proven HSTU subgraphs by ``torch.ops.hstu.*``;
3. hand the rewritten graph (or, if nothing was rewritten, the original one) to ``compile_fx``.

Because the hstu ops are in the graph Inductor receives, Inductor's FX graph cache keys them
like any other op; AOTAutograd differentiates through their registered autograd.
"""
from __future__ import annotations

import logging

import torch
import torch._inductor.custom_graph_pass

from . import _compat, config

log = logging.getLogger("hstu_inductor")

__all__ = ["hstu_backend"]


def hstu_backend(gm: torch.fx.GraphModule, example_inputs, mode: str | None = None, options: dict | None = None):
    """Dynamo backend entry: ``fn(gm, example_inputs, **kw)``; accepts ``mode=`` and ``options=``."""
    config.validate()
    from . import ops  # noqa: F401  (register torch.ops.hstu.*)
    from .patterns import rewrite_dynamo_graph

    rewritten = rewrite_dynamo_graph(gm)
    if rewritten is not None:
        log.debug("hstu_inductor: rewritten graph\n%s", rewritten.code)
    patches = {**_compat.mode_options(mode), **(options or {})}
    patches["post_grad_custom_post_pass"] = _with_audit(patches.get("post_grad_custom_post_pass"))
    return _compat.compile_fx(rewritten if rewritten is not None else gm, example_inputs, patches)


def _with_audit(user_pass):
    """Our post-grad audit pass, chained after a user's own pass if they gave one."""
    from .patterns.pipeline import HSTULoweringAudit

    audit = HSTULoweringAudit()
    return audit if user_pass is None else _Chain(user_pass, audit)


class _Chain(torch._inductor.custom_graph_pass.CustomGraphPass):
    """Two post-grad passes in one hook (torch 2.11 holds one callable per hook). No uuid (cache
    bypassed) when the user's pass has none, as Inductor would do for that pass alone."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __call__(self, graph):
        self.first(graph)
        self.second(graph)

    def uuid(self):
        first = getattr(self.first, "uuid", lambda: None)()
        return None if first is None else repr((first, self.second.uuid()))


def register() -> None:
    """Register ``"hstu"`` with Dynamo (idempotent; the entry point does this for installed copies)."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "hstu" not in _BACKENDS:
        register_backend(hstu_backend, name="hstu")
