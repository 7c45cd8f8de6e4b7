"""The value-level attention proof (``attn_meaning``): its domain and leaves, shared by every part.

A proof reads a candidate's inputs as leaves (uninterpreted functions of their indices: ``src_q(r,
f)``, ``off(b)``) over a ``core.domain.Domain``: the batch ``B``, the padded length ``N`` and the
jagged rows ``L`` of the inputs, with the graph's shape environment so a symbolic size keeps its
facts. ``_short`` words a solver's counterexample for a decline.
"""
from __future__ import annotations

import sympy
import torch

from .attn_find import meta_val
from .core.domain import Domain, off
from .core.values import size_expr


class _RealLeaf(sympy.Function):
    """Marker base for data leaves (Real-valued in the decision procedure)."""


def _leaf_fn(name, integer=False):
    f = sympy.Function(name)
    if integer:
        f.is_int_leaf = True
    return f


def _offsets_leaf(plan):
    if plan.lengths:
        return lambda idx: off(idx[0] + 1) - off(idx[0])
    return lambda idx: off(idx[0])


def _rows(x) -> sympy.Expr:
    return size_expr(meta_val(x).shape[0])


def _domain(plan, rows_of, scale=None) -> Domain:
    """The domain of a proof over the jagged rows of ``rows_of``, with the graph's shape environment.
    Every per-token input (q, k, v, a per-row ``scale``, the interval tensor) has the ``L`` jagged rows:
    that is the inputs' contract, which the op checks at run time; under ``mark_dynamic`` each has
    a symbol of its own."""
    env = None
    for n in (rows_of, plan.offsets, plan.S):
        for s in getattr(meta_val(n), "shape", ()):
            if isinstance(s, torch.SymInt):
                env = s.node.shape_env
                break
        if env is not None:
            break
    dom = Domain(plan.B, plan.N, _rows(rows_of), env)
    dom.row_sizes = [_rows(x) for x in (plan.q.src, plan.k.src, plan.v.src)]
    if scale is not None and meta_val(scale).dim() == 1:
        dom.row_sizes.append(_rows(scale))
    if plan.intervals is not None:
        dom.row_sizes.append(size_expr(meta_val(plan.intervals.node).shape[plan.intervals.row_dim]))
    return dom


def _short(model: dict) -> str:
    keep = {k: v for k, v in model.items() if not k.startswith("k!") and len(k) < 24}
    return ", ".join(f"{k}={v}" for k, v in sorted(keep.items())[:8])
