"""Graph-level driver: canonicalise a graph to ATen, run the rewriters, report.

Why rewrite *before* AOTAutograd: the rewritten ``hstu::*`` ops carry their own autograd, so a
forward-only pattern also gives the training backward (AOTAutograd differentiates through our
ops). Matching inside Inductor's joint graph would need a forward+backward pattern per spelling.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import pathlib

import torch

from .. import _compat, config

CustomGraphPass = _compat.custom_graph_pass_base()
from ..report import RewriteReport, publish, stage
from . import attn_tables, constants
from .blocks import fuse_u_silu
from .canonicalize import canonicalize, grad_losing_njt
from .float_inputs import specialise_float_inputs
from .registry import REWRITERS

log = logging.getLogger("hstu_inductor")

# Dynamo nodes whose effect make_fx would execute instead of record (grad mode, autocast):
# retracing such graphs could change gradients, so they are left to stock Inductor.
_STATEFUL_TARGETS = ("_set_grad_enabled", "_enter_autocast", "_exit_autocast", "set_grad_enabled",
                     "_enter_inference_mode", "_exit_inference_mode")


@functools.cache
def package_hash() -> str:
    """Hash of this package's sources: changes whenever pattern, op or kernel code changes."""
    root = pathlib.Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


class HSTUPatternPass(CustomGraphPass):
    """Runs every enabled rewriter on an ATen-level graph, in place.

    ``uuid()`` hashes this package's sources and the options that change generated code, so Inductor's
    FX graph cache is invalidated when the pattern logic or those options change. Survives
    ``copy.deepcopy`` (AOTI).
    """

    def __init__(self):
        self.last_report = RewriteReport()

    def __call__(self, graph: torch.fx.Graph) -> None:
        gm = graph.owning_module
        if gm is None:
            gm = torch.fx.GraphModule(torch.nn.Module(), graph)
        self.last_report = run_rewriters(gm)

    def uuid(self) -> bytes:
        return cache_uuid()


def cache_uuid() -> bytes:
    """Key for Inductor's caches: our sources + ``config.cache_key()``. Needed because a graph that
    calls ``hstu::*`` ops looks the same to Inductor's cache after our op/kernel code or a kernel
    option (traced into the generated code with the ops' bodies) changed."""
    return hashlib.sha256((package_hash() + config.cache_key()).encode()).digest()


class HSTULoweringAudit(CustomGraphPass):
    """Post-grad pass (fwd and bwd graphs): records how the hstu ops were lowered.

    Counts ``hstu::*`` calls Inductor still sees (opaque extern calls) and user-defined Triton
    kernel calls (what ``triton_op`` bodies become). Its ``uuid()`` also puts our source hash into
    Inductor's FX graph / AOTAutograd cache keys, so stale compiled code is never reused.
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        report = RewriteReport()
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            name = str(node.target)
            if name.startswith("hstu."):
                report.lowered[f"extern call {name}"] = report.lowered.get(f"extern call {name}", 0) + 1
            elif "triton_kernel_wrapper" in name:
                kernel = _triton_kernel_name(node)
                report.lowered[f"triton kernel {kernel}"] = report.lowered.get(f"triton kernel {kernel}", 0) + 1
        if report.lowered:
            publish(report)

    def uuid(self) -> bytes:
        return cache_uuid()


def _triton_kernel_name(node: torch.fx.Node) -> str:
    try:
        kernel = _compat.user_triton_kernel(node.kwargs["kernel_idx"])
        return getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", "?")
    except Exception:  # naming is best effort; the count is what matters
        return "?"


def run_rewriters(gm: torch.fx.GraphModule) -> RewriteReport:
    """Apply every enabled rewriter kind to ``gm`` in place; returns (and publishes) the report."""
    report = RewriteReport(graphs=1)
    for kind, rewriters in REWRITERS.items():
        if not config.patterns.get(kind, True):
            continue
        if kind != "attention" and _attention_declined(report):
            if _has_layer_norm(gm):  # only where a block could be: a graph of attention alone says nothing more
                report.near_misses.append((kind, "not tried: the graph's attention was declined, and a block "
                                                 "rewritten alone is slower than Inductor's fused code "
                                                 "(config.lone_blocks)"))
            continue
        for rewriter in rewriters:
            rewriter(gm, report)
    # joins the two block rewrites' ops, so it runs after both
    fused = fuse_u_silu(gm, report) if config.fuse_u_silu else 0
    if any(report.counts.values()) or fused:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    publish(report)
    return report


def _attention_declined(report: RewriteReport) -> bool:
    """The graph had attention candidates and none was rewritten (the attention rewriters run first)."""
    return not config.lone_blocks and report.counts["attention"] == 0 and \
        any(kind == "attention" for kind, _ in report.near_misses)


def _has_layer_norm(gm: torch.fx.GraphModule) -> bool:
    norms = (torch.ops.aten.native_layer_norm.default, torch.ops.aten.layer_norm.default)
    return any(n.op == "call_function" and n.target in norms for n in gm.graph.nodes)


def _computes_grads(gm) -> bool:
    """Grad mode on and a Dynamo input that requires grad (the phase ``cost_rule`` calls "train")."""
    return torch.is_grad_enabled() and any(
        isinstance(v := n.meta.get("example_value"), torch.Tensor) and v.requires_grad
        for n in gm.graph.find_nodes(op="placeholder"))


def rewrite_dynamo_graph(gm: torch.fx.GraphModule, module_state: dict | None = None) -> torch.fx.GraphModule | None:
    """Canonicalise a Dynamo (torch-level) graph to ATen and rewrite it.

    Before the retrace, ``canonicalize`` replaces nested-tensor pads by plain jagged gathers
    (exact; see ``canonicalize.py``); graphs still holding a grad-requiring nested tensor are
    not retraced, since the retrace would detach its values.

    Returns the rewritten ATen graph, or None when nothing was rewritten (the caller then
    compiles the original graph unchanged, exactly like stock Inductor). An exception of the
    canonicalisation, the retrace or a rewriter is raised as ``report.StageFailed`` naming the
    stage (the backend then compiles the original graph: ``backend._fall_back``); under
    ``config.strict`` it is raised as it is.

    ``module_state``: placeholder position -> value of the inputs that are module buffers or frozen
    parameters (``constants.module_state``); a rewrite may read them by value. The positions it read
    are ``meta["hstu_constants"]`` of the result, for the caller to guard.
    """
    stateful = [n for n in gm.graph.nodes if n.op == "call_function"
                and getattr(n.target, "__name__", "") in _STATEFUL_TARGETS]
    if stateful:
        report = RewriteReport(graphs=1)
        report.near_misses.append(("graph", f"graph switches grad/autocast mode ({stateful[0].target.__name__}); "
                                            "not retraced"))
        publish(report)
        return None
    fake_mode = _compat.graph_fake_mode(gm)
    if fake_mode is None:
        publish(RewriteReport(graphs=1))
        return None
    # Exact torch-level rewrites (nested-tensor pads) on a copy: `gm` stays what stock Inductor gets.
    with stage("canonicalise"):
        canon = canonicalize(gm)
    lost = grad_losing_njt(canon)
    if lost is not None:
        report = RewriteReport(graphs=1)
        report.near_misses.append(("graph", f"nested tensor {lost.name} requires grad and the ATen retrace "
                                            "would detach its values; not retraced"))
        publish(report)
        return None
    with stage("ATen retrace"):
        with fake_mode:
            aten_gm = _compat.trace_aten(canon, _compat.placeholder_values(canon))
            if _compat.mutates(aten_gm):  # in-place ops: read as data flow (functionalised)
                aten_gm = _compat.trace_aten_functional(canon, _compat.placeholder_values(canon))
                # functionalisation leaves dead views of mutated tensors; a dead user is still a user to
                # the structural checks ("consumed by ...")
                aten_gm.graph.eliminate_dead_code()
                aten_gm.recompile()
        specialise_float_inputs(canon, aten_gm)  # dynamic=True: floats read with .item() (float_inputs.py)
    token = attn_tables.TRAINING.set(_computes_grads(gm))
    try:
        with stage("rewriters"), fake_mode, constants.known(module_state):
            report = run_rewriters(aten_gm)
            aten_gm.meta["hstu_constants"] = sorted(constants.used())
    finally:
        attn_tables.TRAINING.reset(token)
    return aten_gm if any(report.counts.values()) else None
