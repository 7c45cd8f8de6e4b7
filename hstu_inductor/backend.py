"""The ``"hstu"`` torch.compile backend: Inductor with the HSTU rewrites applied first.

``torch.compile(model, backend="hstu")`` finds this through the ``torch_dynamo_backends`` entry
point, so no import of ``hstu_inductor`` is needed. Flow per Dynamo graph:

1. retrace the torch-level graph to ATen under Dynamo's fake mode (symbolic sizes kept);
2. run the rewriters (``patterns``), which replace proven HSTU subgraphs by ``torch.ops.hstu.*``;
3. hand the rewritten graph (or, if nothing was rewritten, the original one) to ``compile_fx``;
   ``backend="hstu_eager"`` hands it to Dynamo's ``aot_eager`` instead (no code generation: for
   bisecting a difference between Inductor and the rewrites, and for fast rewrite tests).

Under ``DistributedDataParallel`` Dynamo's DDPOptimizer splits each graph at gradient-bucket
boundaries before calling the backend per piece; :func:`_rewrite_before_ddp_split` (installed into
it through ``_compat``) runs steps 1-2 on the whole graph first, so the split only cuts between
rewritten blocks (each hstu op is one node), and each piece then gets step 3 alone.

Because the hstu ops are in the graph Inductor receives, Inductor's FX graph cache keys them
like any other op; AOTAutograd differentiates through their registered autograd.
"""
from __future__ import annotations

import contextlib
import logging
import threading

import torch
import torch._inductor.custom_graph_pass

from . import _compat, config, cost_rule

log = logging.getLogger("hstu_inductor")

__all__ = ["hstu_backend", "hstu_eager_backend"]


def hstu_backend(gm: torch.fx.GraphModule, example_inputs, mode: str | None = None, options: dict | None = None):
    """Dynamo backend entry: ``fn(gm, example_inputs, **kw)``; accepts ``mode=`` and ``options=``."""
    patches = {**_compat.mode_options(mode), **(options or {})}
    patches["post_grad_custom_post_pass"] = _with_audit(patches.get("post_grad_custom_post_pass"))
    cudagraphs = bool(patches.get("triton.cudagraphs", torch._inductor.config.triton.cudagraphs))
    return _compile(gm, lambda g: _compat.compile_fx(g, example_inputs, patches),
                    cost=lambda g: cost_rule.decide(g, example_inputs, cudagraphs))


def hstu_eager_backend(gm: torch.fx.GraphModule, example_inputs, mode: str | None = None, options: dict | None = None):
    """``backend="hstu_eager"``: the same rewrites as ``"hstu"``, then AOTAutograd running every op
    eagerly (Dynamo's ``aot_eager``) instead of Inductor. Each hstu op stays one call of its own
    implementation (Triton kernels on CUDA, the reference on CPU); nothing is generated or built.
    For bisecting: a result that differs under ``"hstu"`` but not here comes from Inductor's code
    generation, not from a rewrite. Also a cheap way to see what is rewritten (``explain`` counts
    are the same)."""
    if mode not in (None, "default") or options:
        raise ValueError(f'backend="hstu_eager" runs no Inductor, so it takes no mode or options (got mode={mode!r}, '
                         f'options={options!r}); use backend="hstu" for those')
    return _compile(gm, lambda g: _compat.aot_eager(g, example_inputs))


def _compile(gm: torch.fx.GraphModule, compile_rewritten, cost=None):
    """Rewrite ``gm`` and compile the result, as one staged report (``report.staged``): when Dynamo
    abandons the compile by raising through it (it restarts the frame's analysis, e.g. under
    ``dynamic=True`` once a float input got specialised, and calls the backend again), nothing of it
    is counted; the redo is. ``cost``: the cost rule (``cost_rule.decide``), which may keep ``gm``
    as it is, or compile both and pick per call. Then warn about graph breaks seen to split an HSTU
    candidate."""
    from . import graph_breaks
    from .report import staged

    _install_frame_config()  # again: torch._dynamo.reset() drops Dynamo's compile callbacks
    with staged() as stage:
        rewritten = _rewritten(gm)
        if not getattr(_state, "ddp_pieces", False):  # a DDP piece: recorded whole, before the split
            graph_breaks.record_graph(gm, stage)
        decision = _decide(cost, rewritten) if cost is not None and rewritten is not gm else None
        if decision is not None:
            line = decision.describe()
            if decision.choice == "inductor":  # the graph is kept whole: what was found, not counted as rewritten
                line += " (found: " + ", ".join(f"{k} {n}" for k, n in stage.counts.items() if n) + ")"
                stage.counts = dict.fromkeys(stage.counts, 0)
            stage.cost_rule.append(line)
            log.info("hstu_inductor: cost rule: %s", line)
        if decision is None or decision.choice == "hstu":
            compiled = compile_rewritten(rewritten)
        elif decision.choice == "inductor":
            compiled = compile_rewritten(gm)
        else:
            compiled = cost_rule.SizeDispatch(decision, compile_rewritten(gm), compile_rewritten(rewritten))
    graph_breaks.warn_splits(stage.records)
    return compiled


def _decide(cost, rewritten):
    """The cost rule's decision; a failure of the rule keeps the rewrite (raises under ``config.strict``)."""
    try:
        return cost(rewritten)
    except Exception:
        if config.strict:
            raise
        log.exception("hstu_inductor: cost rule failed; the graph stays rewritten")
        return None


def _rewritten(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Steps 1-2 of the module docstring: ``gm`` with its proven HSTU subgraphs replaced (``gm``
    itself when nothing was rewritten, or when it is a DDP piece of a graph rewritten whole)."""
    config.validate()
    from . import ops  # noqa: F401  (register torch.ops.hstu.*)
    from .patterns import rewrite_dynamo_graph

    if getattr(_state, "ddp_pieces", False):
        return gm  # a piece of a graph already rewritten whole, before the DDP split
    _report_ddp_piece(gm)
    rewritten = rewrite_dynamo_graph(gm)
    if rewritten is None:
        return gm
    log.debug("hstu_inductor: rewritten graph\n%s", rewritten.code)
    return rewritten


_state = threading.local()


@contextlib.contextmanager
def _ddp_pieces():
    """Inside: the backend compiles DDP split pieces of a graph that was rewritten whole."""
    before = getattr(_state, "ddp_pieces", False)
    _state.ddp_pieces = True
    try:
        yield
    finally:
        _state.ddp_pieces = before


def _rewrite_before_ddp_split(split, backend, gm):
    """DDPOptimizer hook (``_compat.install_ddp_pre_split``): for our backend, rewrite the whole
    Dynamo graph, then let the DDPOptimizer split the result and compile each piece (without a
    second rewrite). Other backends, and graphs we cannot hand over intact, are left alone."""
    if _compat.unwrap_backend(backend)[0] not in (hstu_backend, hstu_eager_backend):
        return split(gm)
    from . import graph_breaks, ops  # noqa: F401
    from .patterns import rewrite_dynamo_graph
    from .report import staged

    config.validate()
    with staged() as stage:  # the whole graph's rewrites and its pieces' compiles, counted only together
        rewritten = rewrite_dynamo_graph(gm)
        graph_breaks.record_graph(gm, stage)
        if rewritten is not None and not _compat.carry_dynamo_placeholder_meta(gm, rewritten):
            log.warning("hstu_inductor: ATen retrace changed the graph inputs; DDP pieces compiled unrewritten")
            rewritten = None
        with _ddp_pieces():
            compiled = split(rewritten if rewritten is not None else gm)
    graph_breaks.warn_splits(stage.records)
    return compiled


def _report_ddp_piece(gm) -> None:
    """Near miss for a graph the DDPOptimizer split before we saw it (only when the pre-split hook
    is missing): blocks cut by a bucket boundary are then silently left to stock Inductor."""
    reason = str(getattr(gm, "compile_subgraph_reason", ""))
    if "DDPOptimizer" not in reason:
        return
    from .report import RewriteReport, publish

    why = _compat.ddp_pre_split_status() or "hook not applied to this graph"
    report = RewriteReport()
    report.near_misses.append(("graph", "DDPOptimizer split this graph at DDP gradient-bucket boundaries before the "
                                        f"backend saw it ({why}); a block cut by a split is not rewritten. Keep "
                                        "blocks whole with torch._dynamo.config.optimize_ddp='python_reducer' "
                                        "(docs/distributed.md)"))
    publish(report)


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


def _is_ours(backend) -> bool:
    return backend in (hstu_backend, hstu_eager_backend)


def _frame_config() -> dict:
    """Dynamo options set while a frame is traced for our backend (``_compat.install_frame_config``):
    keep data-dependent-shape ops in the graph (``config.capture_dynamic_shape_ops``), so the row
    index of a pad (``repeat_interleave`` without ``output_size``) does not split the attention."""
    return {"capture_dynamic_output_shape_ops": True} if config.capture_dynamic_shape_ops else {}


def _install_frame_config() -> None:
    """Install :func:`_frame_config` for our frames (idempotent). At import, and on every backend call:
    ``torch._dynamo.reset()`` clears Dynamo's compile callbacks, so after a reset the first frame
    is traced with Dynamo's defaults and the frames after it with ours."""
    reason = _compat.install_frame_config(_is_ours, _frame_config)
    if reason is not None and not getattr(_state, "frame_config_logged", False):
        _state.frame_config_logged = True
        log.info("hstu_inductor: Dynamo config for our frames not applied (%s)", reason)


def register() -> None:
    """Register ``"hstu"`` with Dynamo (idempotent; the entry point does this for installed copies)."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "hstu" not in _BACKENDS:
        register_backend(hstu_backend, name="hstu")
    if "hstu_eager" not in _BACKENDS:
        register_backend(hstu_eager_backend, name="hstu_eager")
    _install_frame_config()
    reason = _compat.install_ddp_pre_split(_rewrite_before_ddp_split)
    if reason is not None:
        log.info("hstu_inductor: DDP graph splits not handled (%s); see docs/distributed.md", reason)
