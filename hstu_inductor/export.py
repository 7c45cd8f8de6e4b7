"""HSTU rewrites for ``torch.export`` programs, packaged with AOTInductor.

    ep = torch.export.export(model, args, dynamic_shapes=...)
    result = hstu_inductor.export.export_and_package(model, args, dynamic_shapes=..., package_path="m.pt2")
    print(result.report)                         # what was rewritten
    runner = torch._inductor.aoti_load_package(result.package_path)   # no hstu_inductor import needed

The same rewriters as ``backend="hstu"`` run on the exported program's ATen graph; the rewritten
graph is exported again (``hstu::*`` ops stay single nodes in the ``ExportedProgram``) and
AOTInductor then traces into the ops' ``triton_op`` bodies, so the package holds plain ATen
code / our Triton kernels rather than calls back into Python.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import tempfile

import torch
import torch.utils._pytree as pytree
from torch.export import Dim, ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from . import _compat, config
from .report import RewriteReport, collecting

log = logging.getLogger("hstu_inductor")

__all__ = ["rewrite_exported_program", "aoti_compile_and_package", "export_and_package", "ExportResult"]


@dataclasses.dataclass
class ExportResult:
    package_path: str
    report: RewriteReport
    exported_program: ExportedProgram


class _LiftedProgram(torch.nn.Module):
    """Calls a lifted ATen graph (parameters, buffers and constants as leading inputs) with the
    program's state, so that the rewritten graph can be exported again like a user module."""

    def __init__(self, gm: torch.fx.GraphModule, ep: ExportedProgram):
        super().__init__()
        self.gm = gm
        self._state_inputs: list[tuple[str, str]] = []  # (attribute, target) in input order
        self._user_positions: list[int] = []
        for i, spec in enumerate(ep.graph_signature.input_specs):
            if spec.kind == InputKind.USER_INPUT:
                self._user_positions.append(i)
                continue
            if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                raise NotImplementedError(f"hstu export: input kind {spec.kind} is not supported")
            value = ep.state_dict.get(spec.target, ep.constants.get(spec.target))
            attr = f"_state_{len(self._state_inputs)}"
            if spec.kind == InputKind.PARAMETER:
                self.register_parameter(attr, torch.nn.Parameter(value, requires_grad=False))
            else:
                self.register_buffer(attr, value)
            self._state_inputs.append((attr, spec.target))
        bad = [s.kind for s in ep.graph_signature.output_specs if s.kind != OutputKind.USER_OUTPUT]
        if bad:
            raise NotImplementedError(f"hstu export: programs with {bad[0]} outputs (in-place state updates) "
                                      "are not supported; export the model in eval mode without buffer mutation")
        self._n_inputs = len(ep.graph_signature.input_specs)
        self._out_spec = ep.call_spec.out_spec

    def forward(self, *args):
        flat_user = [a for a in pytree.tree_leaves(args)]
        state = iter(getattr(self, attr) for attr, _ in self._state_inputs)
        user = iter(flat_user)
        user_pos = set(self._user_positions)
        inputs = [next(user) if i in user_pos else next(state) for i in range(self._n_inputs)]
        outs = self.gm(*inputs)
        return pytree.tree_unflatten(list(outs), self._out_spec)


def _auto_dynamic_shapes(ep: ExportedProgram, args) -> tuple:
    """``Dim.AUTO`` on every user-input dim that is symbolic in ``ep`` (in the args' structure)."""
    vals = iter(n.meta["val"] for n, spec in zip(ep.graph.find_nodes(op="placeholder"), ep.graph_signature.input_specs)
                if spec.kind == InputKind.USER_INPUT)

    def spec_for(leaf):
        if not isinstance(leaf, torch.Tensor):
            next(vals, None)
            return None
        val = next(vals)
        dims = {i: Dim.AUTO for i, s in enumerate(val.shape) if isinstance(s, torch.SymInt)}
        return dims or None

    return tuple(pytree.tree_map(spec_for, a) for a in args)


def rewrite_exported_program(ep: ExportedProgram) -> tuple[ExportedProgram, RewriteReport]:
    """Apply the HSTU rewriters to ``ep``; returns the new program (or ``ep`` when nothing matched)."""
    from .patterns import run_rewriters

    config.validate()
    args, kwargs = ep.example_inputs
    if kwargs:
        raise NotImplementedError("hstu export: pass the model inputs positionally (keyword inputs unsupported)")
    gm = ep.graph_module
    vals = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    fake_mode = torch._guards.detect_fake_mode(vals)
    with collecting() as report:
        with fake_mode:
            aten_gm = _compat.trace_aten(gm, vals)
            run_rewriters(aten_gm)
    if not any(report.counts.values()):
        return ep, report
    wrapper = _LiftedProgram(aten_gm, ep)
    new_ep = torch.export.export(wrapper, tuple(args), dynamic_shapes={"args": _auto_dynamic_shapes(ep, args)})
    return new_ep, report


def _has_hstu_ops(ep: ExportedProgram) -> bool:
    return any(n.op == "call_function" and str(n.target).startswith("hstu.") for n in ep.graph.nodes)


def aoti_compile_and_package(ep: ExportedProgram, package_path: str | None = None, **inductor_configs) -> str:
    """Rewrite ``ep`` (unless it already holds hstu ops) and package it with AOTInductor; returns the path."""
    from .backend import _with_audit

    if not _has_hstu_ops(ep):
        ep, report = rewrite_exported_program(ep)
        log.info("%s", report)
    if package_path is None:
        package_path = os.path.join(tempfile.mkdtemp(prefix="hstu_aoti_"), "model.pt2")
    configs = dict(inductor_configs)
    # AOTI autotunes kernels while compiling, by default running the wrapper on random buffers:
    # random offsets violate the jagged contract (out-of-range gathers -> device asserts). The
    # two-pass mode tunes on the program's real example inputs instead.
    configs.setdefault("triton.autotune_at_compile_time", False)
    configs.setdefault("triton.autotune_with_sample_inputs", True)
    configs["post_grad_custom_post_pass"] = _with_audit(configs.get("post_grad_custom_post_pass"))
    return torch._inductor.aoti_compile_and_package(ep, package_path=package_path, inductor_configs=configs)


def export_and_package(model, args, dynamic_shapes=None, package_path: str | None = None,
                       **inductor_configs) -> ExportResult:
    """``torch.export`` ``model`` on ``args`` (positional), rewrite, package. Returns path, report, program."""
    ep = torch.export.export(model, tuple(args), dynamic_shapes=dynamic_shapes)
    new_ep, report = rewrite_exported_program(ep)
    path = aoti_compile_and_package(new_ep, package_path, **inductor_configs)
    return ExportResult(path, report, new_ep)
