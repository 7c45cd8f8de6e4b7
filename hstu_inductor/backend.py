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

Safety net: an exception of any of our stages (canonicalise, ATen retrace, rewriters, cost rule, the
compile of the rewritten graph) makes :func:`_fall_back` compile the *original* graph as the stock
backend would (``compile_fx`` with the user's mode and options; ``aot_eager`` for ``hstu_eager``),
with one warning and a ``RewriteReport.fallbacks`` entry naming the stage and the exception
(``explain()`` prints it). A frame whose Dynamo trace fails under our frame config is traced again
with Dynamo's defaults (``_compat.install_frame_config``; same warning and report). Exceptions by
which Dynamo steers a compile (a restart of the frame's analysis, a skipped frame) pass through, and
``config.strict = True`` re-raises instead of falling back. What a failed stage added to the frame's
``ShapeEnv`` (guards, size facts) stays: the fallback compiles the same graph, not a fresh trace.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import threading

import torch

from . import _compat, config, cost_rule

log = logging.getLogger("hstu_inductor")

__all__ = ["hstu_backend", "hstu_eager_backend"]


def hstu_backend(gm: torch.fx.GraphModule, example_inputs, mode: str | None = None, options: dict | None = None):
    """Dynamo backend entry: ``fn(gm, example_inputs, **kw)``; accepts ``mode=`` and ``options=``."""
    user = {**_compat.mode_options(mode), **(options or {})}
    patches = {**user, "post_grad_custom_post_pass": _with_audit(user.get("post_grad_custom_post_pass"))}
    cudagraphs = bool(patches.get("triton.cudagraphs", torch._inductor.config.triton.cudagraphs))
    return _compile(gm, lambda g: _compat.compile_fx(g, example_inputs, patches),
                    stock=("stock Inductor", lambda g: _compat.compile_fx(g, example_inputs, user)),
                    cost=lambda g: cost_rule.decide(g, example_inputs, cudagraphs), example_inputs=example_inputs)


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
    run = lambda g: _compat.aot_eager(g, example_inputs)  # noqa: E731
    return _compile(gm, run, stock=("aot_eager", run), example_inputs=example_inputs)


def _compile(gm: torch.fx.GraphModule, compile_rewritten, stock, cost=None, example_inputs=None):
    """Rewrite ``gm`` and compile the result, as one staged report (``report.staged``): when Dynamo
    abandons the compile by raising through it (it restarts the frame's analysis, e.g. under
    ``dynamic=True`` once a float input got specialised, and calls the backend again), nothing of it
    is counted; the redo is. ``cost``: the cost rule (``cost_rule.decide``), which may keep ``gm``
    as it is, or compile both and pick per call. ``stock``: ``(name, compile)`` of the stock backend,
    for the safety net (module docstring). Then warn about graph breaks seen to split an HSTU
    candidate."""
    from . import graph_breaks
    from .report import StageFailed, staged

    _install_frame_config()  # again, in case something removed Dynamo's compile callbacks
    with staged() as stage:
        try:
            compiled = _rewrite_and_compile(gm, stage, compile_rewritten, cost, example_inputs, stock)
        except StageFailed as failure:
            compiled = _fall_back(gm, stage, failure, stock)
    graph_breaks.warn_splits(stage.records)
    return compiled


def _rewrite_and_compile(gm, stage, compile_rewritten, cost, example_inputs=None, stock=None):
    """Steps 1-3 of the module docstring; an exception of ours comes out as ``report.StageFailed``.
    A rewrite that read module state by value runs behind a :class:`ConstantGuard`."""
    from .patterns.constants import module_state
    from .report import stage as failing

    state = module_state(gm, example_inputs) if example_inputs is not None else None
    rewritten = _rewritten(gm, state)
    read = rewritten.meta.get("hstu_constants", []) if rewritten is not gm else []
    compiled, runs_rewrite = _compile_decided(gm, rewritten, stage, compile_rewritten, cost, failing)
    if read and runs_rewrite and stock is not None:  # kept stock code reads no module state by value: no guard
        return ConstantGuard(compiled, {i: state[i] for i in read}, lambda args: stock[1](gm), stock[0])
    return compiled


def _compile_decided(gm, rewritten, stage, compile_rewritten, cost, failing):
    """The cost rule's choice between ``gm`` and ``rewritten``, compiled, and whether it may run the rewrite."""
    from . import graph_breaks

    if not getattr(_state, "ddp_pieces", False):  # a DDP piece: recorded whole, before the split
        graph_breaks.record_graph(gm, stage)
    decision = None
    if cost is not None and rewritten is not gm:
        with failing("cost rule"):
            decision = cost(rewritten)
    if decision is not None:
        _record_decision(decision, stage)
    with failing("compile"):
        if decision is None or decision.choice == "hstu":
            return compile_rewritten(rewritten), rewritten is not gm
        if decision.choice == "inductor":
            return compile_rewritten(gm), False
        return cost_rule.SizeDispatch(decision, compile_rewritten(gm), compile_rewritten(rewritten)), True


def _record_decision(decision, stage) -> None:
    line = decision.describe()
    if decision.choice == "inductor":  # the graph is kept whole: what was found, not counted as rewritten
        line += " (found: " + ", ".join(f"{k} {n}" for k, n in stage.counts.items() if n) + ")"
        stage.counts = dict.fromkeys(stage.counts, 0)
    stage.cost_rule.append(line)
    log.info("hstu_inductor: cost rule: %s", line)


def _fall_back(gm, stage, failure, stock):
    """Compile the original ``gm`` with the stock backend, as if we had found nothing, and report the
    failure: one warning and a ``fallbacks`` entry. An exception of the stock compile is the stock
    backend's own and propagates (chained to ours)."""
    from . import graph_breaks
    from .report import Fallback, describe_error

    name, compile_stock = stock
    compiled = compile_stock(gm)
    stage.counts = dict.fromkeys(stage.counts, 0)
    stage.details.clear()
    stage.cost_rule.clear()
    stage.lowered.clear()  # the failed compile's audit; the stock compile has none
    for rec in stage.records:
        rec.counts = dict(stage.counts)
    if not getattr(_state, "ddp_pieces", False):  # a DDP piece: counted with its whole graph
        stage.graphs = max(stage.graphs, 1)
        if not stage.records:
            graph_breaks.record_graph(gm, stage)
    _report_fallback(stage, Fallback(failure.stage, describe_error(failure.error),
                                     f"the original graph was compiled by {name}"), failure.error)
    return compiled


def _report_fallback(report, fallback, error) -> None:
    report.fallbacks.append(fallback)
    log.warning("hstu_inductor: %s", fallback)
    log.debug("hstu_inductor: %s failure", fallback.stage, exc_info=error)


class ConstantGuard:
    """The compiled rewrite, run while the module state it read by value is unchanged: the same
    storage and version counter as at compile time (an in-place update moves the counter, a new
    tensor assigned to the attribute has another storage). Otherwise the original graph, compiled by
    the stock backend on first need, runs from then on: a changed mask is never read stale."""

    def __init__(self, compiled, tensors: dict, compile_stock, stock_name: str):
        self.compiled = compiled
        self.checks = [(i, t.data_ptr(), t._version) for i, t in tensors.items()]
        self.compile_stock = compile_stock
        self.stock_name = stock_name
        self.stock = None

    def _unchanged(self, args) -> bool:
        return all(args[i].data_ptr() == ptr and args[i]._version == ver for i, ptr, ver in self.checks)

    def __call__(self, *args):
        if self.stock is None and self._unchanged(args):
            return self.compiled(*args)
        if self.stock is None:
            log.warning("hstu_inductor: module state read by the rewrite changed since compile; running the "
                        "original graph (%s) from now on", self.stock_name)
            self.stock = self.compile_stock(args)
        return self.stock(*args)


def _rewritten(gm: torch.fx.GraphModule, module_state: dict | None = None) -> torch.fx.GraphModule:
    """Steps 1-2 of the module docstring: ``gm`` with its proven HSTU subgraphs replaced (``gm``
    itself when nothing was rewritten, or when it is a DDP piece of a graph rewritten whole)."""
    config.validate()
    from . import ops  # noqa: F401  (register torch.ops.hstu.*)
    from .patterns import rewrite_dynamo_graph

    if getattr(_state, "ddp_pieces", False):
        return gm  # a piece of a graph already rewritten whole, before the DDP split
    _report_ddp_piece(gm)
    rewritten = rewrite_dynamo_graph(gm, module_state)
    if rewritten is None:
        return gm
    _keep_dynamo_inputs(gm, rewritten)
    log.debug("hstu_inductor: rewritten graph\n%s", rewritten.code)
    return rewritten


def _keep_dynamo_inputs(gm: torch.fx.GraphModule, rewritten: torch.fx.GraphModule) -> None:
    """Give the ATen retrace the Dynamo input metadata of ``gm``: without it AOTAutograd does not
    recognise a Dynamo graph and marks no input static, so CUDA graphs copy every parameter into its
    static buffer on each replay (benchmarks/cudagraph_step.py). The retrace's own buffers (a table
    rewrite's bucket bounds) get sources of their own."""
    known = getattr(gm, "_param_name_to_source", None)
    if not _compat.carry_dynamo_placeholder_meta(gm, rewritten):
        log.debug("hstu_inductor: the ATen retrace changed the graph inputs; no Dynamo input metadata kept")
        return
    own = [name for name, _ in itertools.chain(rewritten.named_parameters(), rewritten.named_buffers())]
    if known is not None and any(name not in known for name in own):
        rewritten._param_name_to_source = {**known, **{name: _compat.synthetic_source(f"hstu_rewrite.{name}")
                                                      for name in own if name not in known}}


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
    from .report import Fallback, StageFailed, describe_error, staged

    config.validate()
    with staged() as stage:  # the whole graph's rewrites and its pieces' compiles, counted only together
        try:
            rewritten = rewrite_dynamo_graph(gm)
        except StageFailed as failure:  # the pieces are cut from the original graph, as without the hook
            rewritten = None
            stage.counts = dict.fromkeys(stage.counts, 0)
            stage.details.clear()
            stage.graphs = max(stage.graphs, 1)
            _report_fallback(stage, Fallback(failure.stage, describe_error(failure.error),
                                             "the DDP pieces were cut from the original graph"), failure.error)
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


class _Chain(_compat.custom_graph_pass_base()):
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


def _frame_may_retrace(error: Exception) -> bool:
    """Whether a frame whose trace raised ``error`` under :func:`_frame_config` is traced again with
    Dynamo's defaults (else the error reaches the user): always, unless ``config.strict``."""
    return not config.strict


def _frame_retraced(error: Exception) -> None:
    """The trace with Dynamo's defaults succeeded: one warning, and a fallback in the report."""
    from .report import Fallback, RewriteReport, describe_error, publish

    report = RewriteReport()
    names = ", ".join(sorted(_frame_config())) or "our frame config"
    _report_fallback(report, Fallback("frame trace", describe_error(error),
                                      f"the frame was traced again without {names} (Dynamo's defaults)"), error)
    publish(report)


def _install_frame_config() -> None:
    """Install :func:`_frame_config` for our frames and the re-trace of frames that fail under it
    (idempotent; it survives ``torch._dynamo.reset()``). Also makes the size-bound rounding exact
    (``_compat.install_exact_int_rounding``): the unbacked sizes our config lets into graphs hit a
    float rounding of torch's that fails the trace (see that function)."""
    reasons = [_compat.install_exact_int_rounding(),
               _compat.install_frame_config(_is_ours, _frame_config, _frame_may_retrace, _frame_retraced)]
    reasons = [r for r in reasons if r is not None]
    if reasons and not getattr(_state, "frame_config_logged", False):
        _state.frame_config_logged = True
        log.info("hstu_inductor: Dynamo config for our frames not fully applied (%s)", "; ".join(reasons))


def register() -> None:
    """Register ``"hstu"`` with Dynamo (idempotent; the entry point does this for installed copies)."""
    _compat.register_dynamo_backend(hstu_backend, "hstu")
    _compat.register_dynamo_backend(hstu_eager_backend, "hstu_eager")
    _install_frame_config()
    reason = _compat.install_ddp_pre_split(_rewrite_before_ddp_split)
    if reason is not None:
        log.info("hstu_inductor: DDP graph splits not handled (%s); see docs/distributed.md", reason)
