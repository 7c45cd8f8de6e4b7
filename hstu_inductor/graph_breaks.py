"""Graph breaks around HSTU candidates: what ``explain()`` reports and the backend warns about.

A Dynamo graph break ends one graph and resumes the frame in another, so a subgraph that straddles
it is never seen whole by the backend and cannot be rewritten. Per Dynamo graph the backend keeps a
:class:`GraphRecord`: where the graph ends (the break's user stack) or resumes, what HSTU pieces it
holds (uvqk split, jagged pad, attention scores ``silu(q k^T)``, the scores' product with ``v``) and
what was rewritten in it. ``explain()`` joins these with the breaks Dynamo logs (which also name
breaks that end an empty graph, and frames Dynamo runs eagerly) into ``RewriteReport.graph_breaks``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
import re
import threading

import torch

from . import _compat
from .report import GraphBreak, RewriteReport

log = logging.getLogger("hstu_inductor")

__all__ = ["GraphRecord", "record_graph", "warn_splits", "reset_warnings", "collect", "hint_for"]

_MATMULS = {"matmul", "bmm", "einsum", "baddbmm", "__matmul__"}
_SPLITS = {"split", "chunk", "split_with_sizes", "tensor_split"}
_PADS = ("jagged_to_padded_dense", "to_padded_tensor")
_RESUME = re.compile(r"torch_dynamo_resume_in_(\w+?)_at_(\d+)$")


@dataclasses.dataclass
class GraphRecord:
    """One Dynamo graph the backend compiled (see the module docstring)."""

    ends_at: tuple | None  # (file, line): the graph break that ended it (innermost frame)
    break_stack: list  # [(file, line), ...] of that break, outermost first
    reason: str  # Dynamo's reason for the break ("" when the graph ended otherwise)
    resumes: tuple | None  # (file, line): the graph is a frame resumed after a break at that line
    pieces: frozenset  # "uvqk split", "raw u out", "pad", "scores", "value product", "open scores"
    counts: dict

    def describe(self) -> str:
        done = [f"{k} rewritten" for k, n in self.counts.items() if n]
        parts = [p for p in ("uvqk split", "pad", "scores", "value product") if p in self.pieces]
        return ", ".join(done) or (f"{', '.join(parts)} (not rewritten)" if parts else "")


def _name(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        if node.target is operator.matmul:
            return "matmul"
        return str(getattr(node.target, "__name__", node.target))
    return ""


def _near(start: torch.fx.Node, step, want, depth: int | None) -> bool:
    """True if a node within ``depth`` steps (None: any number) of ``start`` (``step(n)``: next nodes)
    satisfies ``want``."""
    frontier, seen, left = [start], {start}, depth
    while frontier and (left is None or left > 0):
        frontier = list({m: None for n in frontier for m in step(n) if m not in seen})
        if any(want(m) for m in frontier):
            return True
        seen.update(frontier)
        left = None if left is None else left - 1
    return False


def _pieces(gm: torch.fx.GraphModule) -> frozenset:
    """The HSTU pieces in a torch-level Dynamo graph (names only: cheap, no retrace)."""
    found = set()
    ups = lambda n: n.all_input_nodes  # noqa: E731
    downs = lambda n: list(n.users)  # noqa: E731
    is_mm = lambda n: _name(n) in _MATMULS  # noqa: E731
    scores = []
    for n in gm.graph.nodes:
        name = _name(n)
        if any(p in name for p in _PADS):
            found.add("pad")
        elif name in _SPLITS and (len(n.users) == 4 or (len(n.args) > 1 and isinstance(n.args[1], (list, tuple))
                                                        and len(n.args[1]) == 4) or n.args[1:2] == (4,)):
            found.add("uvqk split")
            u = [m for m in n.users if _name(m) == "getitem" and m.args[1:2] == (0,)]
            src = n.args[0] if n.args and isinstance(n.args[0], torch.fx.Node) else None
            projected = src is not None and _name(src) in _MATMULS | {"linear", "addmm"}
            if projected and u and any(m.op == "output" for m in u[0].users):
                found.add("raw u out")  # chunk 0 leaves the graph before any silu(u)
        elif name == "silu" and _near(n, ups, is_mm, 3):
            scores.append(n)
    if scores:
        found.add("scores")
        is_score = lambda m: m in scores  # noqa: E731
        if any(is_mm(n) and _near(n, ups, is_score, 5) for n in gm.graph.nodes):
            found.add("value product")
        is_out = lambda m: m.op == "output"  # noqa: E731
        if any(not _near(s, downs, is_mm, None) and _near(s, downs, is_out, None) for s in scores):
            found.add("open scores")  # scores that leave the graph, no product with v after them in it
    return frozenset(found)


def record_graph(gm: torch.fx.GraphModule, stage: RewriteReport) -> GraphRecord | None:
    """Describe the Dynamo graph ``gm`` (rewrites so far in ``stage``, the current backend compile's
    report) and add the record to ``stage``. None (nothing added) if the description fails."""
    try:
        ended, reason, stack = _compat.compile_reason(gm)
        resumes = None
        if stack:
            m = _RESUME.match(stack[0][2])
            if m:
                resumes = (stack[0][0], int(m.group(2)))
        rec = GraphRecord(ends_at=(stack[-1][0], stack[-1][1]) if ended and stack else None,
                          break_stack=[(f, line) for f, line, _ in stack] if ended else [],
                          reason=reason if ended else "", resumes=resumes, pieces=_pieces(gm),
                          counts=dict(stage.counts))
    except Exception:  # a report aid: never fail the compile for it
        log.debug("hstu_inductor: could not describe graph for the graph-break report", exc_info=True)
        return None
    stage.records.append(rec)
    return rec


# --------------------------------------------------------------------------------------------
# What a break does to the candidates around it
# --------------------------------------------------------------------------------------------

def _effect(before: list, after: list, reason: str) -> str:
    """``splits ...`` when a break cuts an attention candidate in two, else what lies next to it."""
    attn = lambda recs: sum(r.counts.get("attention", 0) for r in recs)  # noqa: E731
    if any("open scores" in r.pieces and not r.counts.get("attention") for r in before):
        return ("splits an attention candidate: the graph that ends here computes the scores silu(q k^T) but not "
                "their product with v, so this attention is left to stock Inductor")
    if (any("pad" in r.pieces for r in before) and not attn(before) and not attn(after)
            and any(p in r.pieces for r in after for p in ("scores", "value product"))):
        return ("splits an attention candidate: the jagged pad is before the break and the attention after it, "
                "so this attention is left to stock Inductor")
    if any("raw u out" in r.pieces and not r.counts.get("preprocess") for r in before):
        return ("splits an STU preprocess candidate: the graph that ends here splits the uvqk projection four ways "
                "and hands u on before silu(u), so the preprocess block is left to stock Inductor")
    notes = []
    m = re.search(r"frame skipped: (\w+) \((.+?) line (\d+)\)", reason)
    if m or "Skipping the function and falling back to eager" in reason:
        where = f"`{m.group(1)}` ({m.group(2)}:{m.group(3)})" if m else "the enclosing function"
        notes.append(f"Dynamo runs {where} eagerly (nothing in that frame is compiled, only the functions it calls, "
                     "each as its own graph)")
    if any(r.pieces or any(r.counts.values()) for r in before + after):
        def side(recs):
            described = [d for d in (r.describe() for r in recs) if d]
            counted = {d: described.count(d) for d in described}
            return "; ".join(d if n == 1 else f"{d} (x{n} graphs)" for d, n in counted.items()) or "no HSTU pieces"
        notes.append(f"next to HSTU candidates: graph before the break: {side(before)}; graph after it: {side(after)}")
    return "; ".join(notes)


def _splits(rec: GraphRecord, recent: dict) -> list:
    """``[(location, reason, effect)]`` for the breaks that ``rec`` shows to split a candidate."""
    out = []
    if rec.ends_at is not None:
        effect = _effect([rec], [], rec.reason)
        if effect.startswith("splits"):
            out.append((rec.ends_at, rec.reason, effect))
    if rec.resumes is not None:
        for loc, before in list(recent.items()):
            if rec.resumes in before.break_stack:
                effect = _effect([before], [rec], before.reason)
                if effect.startswith("splits") and not _effect([before], [], "").startswith("splits"):  # warned
                    out.append((loc, before.reason, effect))
    return out


_warned = threading.local()


def reset_warnings() -> None:
    """Forget which graph breaks were warned about (each is warned about once per thread)."""
    _warned.__dict__.clear()


def warn_splits(records: list) -> None:
    """Backend: a warning on logger ``hstu_inductor``, once per location (and thread), for each graph
    break the just-compiled graphs show to split an HSTU candidate."""
    state = _warned.__dict__
    recent, seen = state.setdefault("recent", {}), state.setdefault("seen", set())
    for rec in records:
        for loc, reason, effect in _splits(rec, recent):
            if loc not in seen:
                seen.add(loc)
                log.warning("hstu_inductor: graph break at %s:%d %s (Dynamo: %s). To avoid it: %s. "
                            "hstu_inductor.explain(model, *inputs) lists every graph break.",
                            loc[0], loc[1], effect, condense(reason), hint_for(reason))
        if rec.ends_at is not None:
            recent[rec.ends_at] = rec
            while len(recent) > 64:
                recent.pop(next(iter(recent)))


# --------------------------------------------------------------------------------------------
# Dynamo's reason text: condensed, and a hint for the common classes
# --------------------------------------------------------------------------------------------

_HINTS = (  # (pattern on Dynamo's reason, lower case; hint), first match wins
    (r"graph_break\(\)", "remove the explicit torch._dynamo.graph_break() call"),
    (r"dynamic shape operator|dynamic_output_shape",
     "an op whose output size depends on tensor data (repeat_interleave without output_size, nonzero, "
     "masked_select): pass output_size= (e.g. the row count L = x.shape[0]) where the op takes it, or set "
     "torch._dynamo.config.capture_dynamic_output_shape_ops = True so the op stays in the graph"),
    (r"\.item\(\)|tolist|capture_scalar_outputs|data-dependent (?:operator|output)|unbacked",
     "`.item()`/`.tolist()` reads tensor data (e.g. offsets or lengths) on the host: pass the max length as a "
     "Python int (a model constant) instead, or set torch._dynamo.config.capture_scalar_outputs = True"),
    (r"`print`|builtin print|logging|logger",
     "print/logging inside forward: remove it, or add the function to "
     "torch._dynamo.config.reorderable_logging_functions"),
    (r"compiler\.disable|_dynamo\.disable|disabled",
     "a call to a function under torch.compiler.disable: move the call out of the model's forward, or remove "
     "the decorator if the function is traceable"),
    (r"numpy|\.numpy\(\)", "a NumPy call or .numpy(): use the torch op on the tensor instead"),
    (r"data-dependent branching|generic_jump|jump",
     "Python control flow on a tensor value: use torch.where / torch.cond, or decide it from Python ints"),
    (r"skip|not traceable|marked as skipped|builtin",
     "a call to a function Dynamo skips: move it out of the model's forward, or let it into the graph with "
     "torch._dynamo.allow_in_graph (tensors in and out, no side effects)"),
    (r"graph break in loop|for/while loop",
     "a graph break inside a for/while loop makes Dynamo run that whole frame eagerly: remove the break inside"),
)
_GENERIC_HINT = ("see Dynamo's reason; TORCH_LOGS=graph_breaks prints its traceback, and "
                 "torch._dynamo.explain(model)(*inputs) lists every break")


def hint_for(reason: str) -> str:
    inner = reason.split("Graph break encountered:", 1)[-1].lower()  # the break itself, not the skip it caused
    for pattern, hint in _HINTS:
        if re.search(pattern, inner):
            return hint
    return _GENERIC_HINT


def condense(reason: str) -> str:
    """Dynamo's reason in one line: its break type and explanation (hints/debug context dropped)."""
    lines = [ln.strip() for ln in reason.splitlines() if ln.strip()]
    keep = [ln for ln in lines if not ln.startswith(("Hint:", "Developer debug context", "For more details",
                                                     "Encountered graph break when attempting to trace"))]
    text = " ".join(keep) or reason.strip()
    text = text.replace("Explanation: ", "- ")
    return text if len(text) <= 300 else text[:297] + "..."


# --------------------------------------------------------------------------------------------
# explain(): the breaks of one call
# --------------------------------------------------------------------------------------------

@contextlib.contextmanager
def collect(report: RewriteReport):
    """Around an explained call: capture Dynamo's graph-break log, then fill ``report.graph_breaks``
    from it and from ``report.records`` (one entry per location, in the order first seen)."""
    logged: dict = {}

    def sink(file, line, reason):
        logged.setdefault((file, line), []).append(reason)

    try:
        ctx = _compat.capture_graph_break_logs(sink)
    except Exception:  # without the log, the backend's own records still name most breaks
        ctx = contextlib.nullcontext()
    with ctx:
        yield
    for rec in report.records:  # breaks that ended a compiled graph, whether logged or not
        if rec.ends_at is not None and rec.ends_at not in logged:
            logged[rec.ends_at] = [rec.reason]
    for loc, reasons in logged.items():
        before = [r for r in report.records if r.ends_at == loc]
        stacks = [r.break_stack for r in before] or [[loc]]
        after = [r for r in report.records if r.resumes is not None and any(r.resumes in s for s in stacks)]
        # Dynamo's own reason, preferring the plain one over "failed to handle ... skipping" wrappers
        reason = min(reasons, key=lambda s: ("Graph break encountered:" in s, len(s)))
        skip = next((s for s in reasons if "Skipping the function" in s or "frame skipped" in s), "")
        effect = _effect(before, after, skip or reason)
        report.graph_breaks.append(GraphBreak(file=loc[0], line=loc[1], reason=condense(reason),
                                              hint=hint_for(reason), effect=effect,
                                              full_reason="\n\n".join(dict.fromkeys(reasons))))
