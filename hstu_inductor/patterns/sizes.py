"""Sizes of intermediates re-expressed from the graph's inputs.

Fully symbolic graphs (``dynamic=True``) read the sizes of every tensor: ``reshape(B * H, N, -1)``
reads ``sym_numel`` of its input, a ``zeros_like`` made explicit reads ``sym_size`` of its template.
Such a read keeps an intermediate alive (and looks like a second data input to the provers) although
only its size is used. :func:`size_source` finds the same SymInt among the inputs' sizes (a size of an
input, a SymInt input, or a product / offset of those), :func:`emit_source` computes it from there.
"""
from __future__ import annotations

import operator

import sympy
import torch

from .prover import sym_expr

aten = torch.ops.aten

SIZE_READS = {aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int}

__all__ = ["SIZE_READS", "size_source", "expr_source", "emit_source"]


def _val(n):
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else n


def size_source(read):
    """A way to compute the SymInt the size read ``read`` gives from the graph's inputs: an int,
    ``(placeholder, dim)``, a SymInt placeholder, ``("add", source, k)``, ``[k, source, ...]`` (a
    product), or None."""
    val = _val(read)
    if isinstance(val, int):
        return val
    if not isinstance(val, torch.SymInt):
        return None
    return expr_source(read.graph, sym_expr(val))


def expr_source(graph, expr):
    """``expr`` as an input size, a SymInt input, or a product / offset of those; else None."""
    if expr.is_Integer:  # e.g. a feature size specialised by the proof
        return int(expr)
    for p in graph.find_nodes(op="placeholder"):
        pv = _val(p)
        if isinstance(pv, torch.SymInt) and sympy.expand(sym_expr(pv) - expr) == 0:
            return p
        if isinstance(pv, torch.Tensor):
            for d, sz in enumerate(pv.shape):
                if sympy.expand(sym_expr(sz) - expr) == 0:
                    return (p, d)
    const, term = sympy.expand(expr).as_coeff_Add()
    if const != 0 and const.is_Integer:  # e.g. B = len(offsets) - 1
        base = expr_source(graph, term)
        return None if base is None else ("add", base, int(const))
    coeff, rest = sympy.factor(expr).as_coeff_Mul()
    factors = [b for f in sympy.Mul.make_args(rest) for b, e in [f.as_base_exp()]
               for _ in range(int(e) if e.is_Integer and e > 0 else 0)]
    if not factors or not coeff.is_Integer or (len(factors) == 1 and coeff == 1):
        return None
    parts = [expr_source(graph, f) for f in factors]
    return None if any(x is None for x in parts) else [int(coeff), *parts]


def _call(graph, target, args):
    node = graph.call_function(target, tuple(args))
    vals = [_val(a) for a in args]
    try:
        node.meta["val"] = target(*vals)
    except Exception:  # metadata only
        pass
    return node


def emit_source(graph, src):
    """Graph nodes (at the current insertion point) computing a :func:`size_source` result."""
    if isinstance(src, (int, torch.fx.Node)):
        return src
    if isinstance(src, tuple) and src[0] == "add":
        return _call(graph, operator.add, [emit_source(graph, src[1]), src[2]])
    if isinstance(src, tuple):
        return _call(graph, aten.sym_size.int, list(src))
    out = src[0]
    for part in src[1:]:
        out = _call(graph, operator.mul, [out, emit_source(graph, part)])
    return out
