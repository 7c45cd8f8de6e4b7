"""Table bias (path b) by meaning: a bias term is the original HSTU's table bias at every position.

``attn_tables`` finds a term's tables, the time gather's index ``I``, the gap ``G`` it buckets and the
bucket's thresholds (a 1-D function of the gap, bisected exactly). What remains is proven here on
one element at symbolic coordinates (``core``), so at any size:

1. **The term is the sum of its gathers.** With the tables and ``I`` as leaves, the term's element at
   score position ``(b, h, i, j)`` must be ``Tp[c + j - i] + Tt[I(...)]`` on every in-sequence position,
   for one constant ``c`` (decided: the tables are uninterpreted functions, so nothing else may reach
   the term); a table with a column per head (``[V, H]``) read at column ``h``.
2. **The bucket reads the gap of ``(next(i), j)`` or of ``(i, j)``.** ``I`` at those coordinates is the
   bucket chain (monotone value ops, proven by ``attn_tables``) of ``G`` at some coordinates; with the value
   ops read as the identity, ``I``'s element is ``G`` at those coordinates, and ``G`` there must be
   ``ts(next(i)) - ts(j)`` (the original HSTU, ``next(i) = min(i + 1, N - 1)``) or ``ts(i) - ts(j)`` of the
   timestamps padded with 0; the op's ``ts_next`` says which.
"""
from __future__ import annotations

import sympy
import torch

from . import attn_layout as lay
from .attn_find import meta_val
from .attn_tables import _POSITION, gap_decline
from .core import decide
from .core.domain import off
from .core.elements import Elements
from .prover import Decline, closure


def prove_term(tc, ch) -> None:
    """Prove table term ``tc`` (an ``attn_tables.TermCheck`` past its structural part) at the chain's
    coordinates ``ch`` (``attn_meaning.Chain``); fills ``tc.deltas``. Raises Decline."""
    plan, dom = ch.plan, ch.dom
    t = tc.term
    if tc.stamps is not None and not tc.dense:  # jagged timestamps have the L rows (their own symbol if dynamic)
        dom.row_sizes.append(lay.to_expr(meta_val(tc.stamps).shape[0]))
    Tp, Tt, Iu, ts = (sympy.Function(f"{k}_{id(tc)}") for k in ("Tp", "Tt", "I", "ts"))
    Iu.is_int_leaf = True
    leaves = dict(ch.E.leaves)
    leaves.pop(t.node, None)  # the term itself is what is read here
    if tc.pos is not None:
        leaves[tc.pos] = lambda idx: Tp(*idx)
    if tc.ts is not None:
        leaves[tc.ts] = lambda idx: Tt(*idx)
        leaves[tc.index] = lambda idx: Iu(*idx)
    E = Elements(dom, leaves)
    pos = ch.position(t.layout)
    R = E.at(t.node, pos)
    in_seq = ch.in_seq()
    want = sympy.Integer(0)
    c = None
    if tc.pos is not None:
        apps = sorted(R.atoms(Tp), key=str)
        if not apps:
            raise Decline(f"bias term {t.node.name} does not read {tc.pos.name}")
        arg = sympy.expand(apps[0].args[0] - (ch.j - ch.i))
        if arg.has(ch.i, ch.j, ch.b) or arg.free_symbols - set(sympy.sympify(plan.N).free_symbols):
            raise Decline(f"position table {tc.pos.name} is not read at c + j - i (read at {apps[0].args[0]})")
        c = arg
        _column(tc, tc.pos, apps[0].args[1:], ch, in_seq)
        want += Tp(c + ch.j - ch.i, *apps[0].args[1:])
    if tc.ts is not None:
        apps = sorted(R.atoms(Iu), key=str)
        if len({a.args for a in apps}) != 1:
            raise Decline(f"bias term {t.node.name} does not read {tc.ts.name} by one gather")
        targs = [a for a in R.atoms(Tt)]
        if len(targs) != 1:
            raise Decline(f"bias term {t.node.name} does not read {tc.ts.name} by one gather")
        _column(tc, tc.ts, targs[0].args[1:], ch, in_seq)
        want += targs[0]
        _prove_gap(tc, ch, E, apps[0].args, ts, leaves)
    ok, cex = decide.valid(dom, sympy.Eq(R, want, evaluate=False), in_seq)
    if not ok:
        raise Decline(f"bias term {t.node.name} is not the sum of its table gathers")
    if c is not None:
        delta = sympy.expand(c - (lay.to_expr(plan.N) - 1))
        if not delta.is_Integer:
            raise Decline(f"position table {tc.pos.name} read at an offset that changes with N or its size")
        delta = int(delta)
        V = lay.to_expr(meta_val(tc.pos).shape[0])
        if delta < 0 or not _fits(dom, delta + 2 * lay.to_expr(plan.N) - 1, V):
            raise Decline(f"position table {tc.pos.name} read at N - 1 + {delta} + j - i: no window of 2N - 1 rows")
        tc.deltas.add(delta)


def _column(tc, T, cols, ch, in_seq) -> None:
    """The column a gather of table ``T`` reads: 0 of a ``[V]`` / ``[V, 1]`` table, or the score's own head of
    a ``[V, H]`` table (a column per head); records which in ``tc.heads``."""
    width = meta_val(T).shape[1] if meta_val(T).dim() == 2 else 1
    heads = lay.head_count(ch.plan.head_modes)
    if not lay.to_expr(width).is_Integer:
        raise Decline(f"table {T.name} has a symbolic number of columns")
    width = int(width)
    if width > 1 and width != heads:
        raise Decline(f"table {T.name} has {width} columns for {heads} heads")
    h = ch.head() if width > 1 else sympy.Integer(0)
    col = cols[0] if cols else sympy.Integer(0)
    ok, _ = decide.valid(ch.dom, sympy.Eq(col, h, evaluate=False), in_seq)
    if not ok:
        raise Decline(f"bias term {tc.term.node.name} reads a column of {T.name} other than its head's")
    tc.heads[T] = width > 1


def _fits(dom, need, have) -> bool:
    """The table has the rows the window needs: decided where the sizes allow; a table size of a symbol
    of its own is compared at its current value (the op checks ``pos_w`` is ``[2N - 1]`` on every call,
    so a later table too short raises instead of reading past it)."""
    d = sympy.expand(sympy.sympify(have) - need)
    if dom.nonneg_(d):
        return True
    from .. import _compat
    if dom.shape_env is None:
        return False
    d = d.xreplace({k: sympy.Integer(v) for k, v in _compat.shape_env_hints(dom.shape_env).items()})
    return bool(d.is_number and d >= 0)


def _prove_gap(tc, ch, E, icoords, ts, leaves) -> None:
    """``I`` at ``icoords`` is the bucket of ``G`` at ``ts(next(i)) - ts(j)`` or at ``ts(i) - ts(j)`` (padded with
    0); ``tc.ts_next`` says which."""
    dom, plan = ch.dom, ch.plan
    chain = _value_chain(tc)
    leaves = dict(leaves)
    leaves.pop(tc.index, None)
    leaves[tc.stamps] = lambda idx: ts(*idx)
    G = Elements(dom, leaves)
    for n in chain:  # the bucket's value ops: each a monotone function of its one gap input
        G.overrides[n] = _identity_of(n, chain, tc.gap)
    gap = G.at(tc.index, tuple(icoords))
    N = lay.to_expr(plan.N)
    nb = dom.length(ch.b)

    def tspad(p):
        if tc.dense:  # a [B, N] input: its padding is data
            return ts(ch.b, p)
        return sympy.Piecewise((ts(off(ch.b) + p), sympy.Lt(p, nb)), (0, True))

    for nxt_mode in (True, False) if tc.ts_next is None else (tc.ts_next, not tc.ts_next):
        row = sympy.Min(ch.i + 1, N - 1) if nxt_mode else ch.i
        ok, _ = decide.valid(dom, sympy.Eq(gap, tspad(row) - tspad(ch.j), evaluate=False), ch.in_seq())
        if ok:  # the proof decides the gap (a probe may have matched both where they agree)
            tc.ts_next = nxt_mode
            return
    raise gap_decline(tc)


def _value_chain(tc):
    """The value ops between the gap and the bucket index (position ops excluded)."""
    order, _ = closure([tc.index], {tc.gap})
    dep, out = {tc.gap}, []
    for n in order:
        if any(a in dep for a in n.all_input_nodes):
            dep.add(n)
            if n.target not in _POSITION:
                out.append(n)
    return out


def _identity_of(n, chain, gap):
    """Read a value op of the bucket as its gap input (the bucket itself is proven by its thresholds)."""
    src = next(a for a in n.all_input_nodes if a is gap or a in chain or _reaches(a, gap))

    def rule(E, node, idx):
        return E.at(src, E.broadcast(src, idx))
    return rule


def _reaches(a, gap) -> bool:
    order, leaves = closure([a], {gap})
    return gap in leaves


_ = torch
