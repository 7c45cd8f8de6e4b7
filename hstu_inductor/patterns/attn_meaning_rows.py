"""The value-level attention proof (``attn_meaning``): the row scales.

Each factor applied to the attention output (before the unpad, on the dense output; or after it,
on the jagged rows) must be ``c * s_row ** power`` on every row the unpad reads: one constant,
times the row's ``attn_scale`` where ``power`` is 1.
"""
from __future__ import annotations

import math

import sympy

from . import attn_layout as lay
from .attn_find import meta_val
from .attn_meaning_cases import _at_the_row
from .attn_meaning_chain import Chain
from .attn_meaning_domain import _domain, _leaf_fn, _offsets_leaf
from .core import decide
from .core.domain import off
from .core.elements import Elements
from .core.semantics import cases
from .core.values import num
from .prover import Decline


def prove_row_scale(plan, sub, m, scale_leaf) -> None:
    """``m``'s factor is ``c * s_row ** power`` on every row the unpad reads (sets ``m.c``)."""
    dom = _domain(plan, plan.q.src, m.leaf)
    s_fn = None
    leaves = {plan.offsets: _offsets_leaf(plan)}
    if m.leaf is not None:
        if meta_val(m.leaf).dim() == 0:
            s_fn = sympy.Symbol("attn_scale")
            leaves[m.leaf] = lambda idx: s_fn
        else:
            s_fn = _leaf_fn("attn_scale")
            leaves[m.leaf] = lambda idx: s_fn(idx[-1] if idx else 0)
    E = Elements(dom, leaves)
    shape = E.shape(m.main)
    if m.layout is not None:  # dense: the logical row (b, i) of each position
        ch = _RowAxes(dom, plan)
        pos = ch.position(m.layout)
        rows = [sympy.Lt(ch.i, dom.length(ch.b))]
        srow = None if s_fn is None else s_fn if isinstance(s_fn, sympy.Symbol) else dom.canon(s_fn(off(ch.b) + ch.i))
    else:  # after the unpad: jagged row r
        b, p, r = dom.row("s")
        pos = (r,) + tuple(dom.coord("e", s) for s in shape[1:])
        rows = []
        srow = None if s_fn is None else s_fn if isinstance(s_fn, sympy.Symbol) else dom.canon(s_fn(r))
    fac = E.at(m.factor, E.broadcast(m.factor, pos))
    eff = 1 / num(fac) if m.div else num(fac)
    pieces = [(c, v) for c, v in cases(eff) if _sat(dom, sympy.And(c, *rows))]
    if not pieces:
        return
    ratios = set()
    for c, v in pieces:
        if srow is not None and m.power:
            v = _at_the_row(dom, v, srow, [c, *rows])
        q = sympy.simplify(v / srow) if (srow is not None and m.power) else sympy.simplify(v)
        if q.free_symbols or q.has(sympy.Function) or not q.is_number:
            raise Decline(f"{m.node.name} does not scale each query row by "
                          f"{'its attn_scale' if m.power else 'one constant'}")
        ratios.add(float(q))
    c0 = next(iter(ratios))
    if c0 == 0 or not all(math.isclose(x, c0, rel_tol=1e-9) for x in ratios):
        raise Decline(f"{m.node.name} does not scale each query row by one constant times its attn_scale")
    m.c = c0
    if plan.dense and m.layout is not None:
        pad_rows = [sympy.Ge(ch.i, dom.length(ch.b))]
        for c, v in cases(eff):
            if _sat(dom, sympy.And(c, *pad_rows)) and v in (sympy.oo, -sympy.oo, sympy.zoo, sympy.nan):
                raise Decline(f"{m.node.name} is not finite on padding rows of the dense attention output")


class _RowAxes(Chain):
    """Logical (b, heads, i) coordinates of a dense output position (no interpreter)."""

    def __init__(self, dom, plan):  # noqa: D401 - a reduced Chain
        self.dom = dom
        self.plan = plan
        self.b = dom.sequence("b")
        self.i = dom.coord("i", lay.to_expr(plan.N))
        self.axes = {"b": self.b, "i": self.i}
        self.digits = {}


def _sat(dom, cond) -> bool:
    if cond is sympy.true:
        return True
    if cond is sympy.false:
        return False
    r = decide.satisfiable(dom, cond)
    return True if r is None else r
