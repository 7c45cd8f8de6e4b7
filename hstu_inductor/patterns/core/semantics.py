"""HSTU's mask as a sympy predicate (HSTU_SEMANTICS.md), and case splitting of element values.

:func:`hstu_valid` is ``valid(i, j)`` of the semantics for one sequence of length ``n`` with
``t`` targets, the reference's own definition evaluated on sympy expressions; the prover compares a user's
mask with it by :func:`~.decide.valid` (for every ``i, j < n <= N``, ``0 <= t <= n``).
:func:`cases` splits an element value into ``(condition, value)`` pieces without conditionals, so
that the float part of a score chain can be evaluated once per piece.
"""
from __future__ import annotations

import sympy

from ...reference import mask
from ...spec import AttentionSpec
from .values import is_bool


def hstu_valid(i, j, n, t, params):
    """``valid(i, j)`` for ``params = (causal, max_attn_len, contextual_seq_len, min_full_attn_seq_len)``
    (``t`` is None without targets); ``i, j < n`` is assumed by the caller. The reference's definition
    (``reference.mask.hstu_valid``), evaluated on sympy expressions."""
    spec = params if isinstance(params, AttentionSpec) else AttentionSpec(*params)
    return mask.hstu_valid(i, j, n, t, spec, mask.SYMPY)


def interval_valid(j, x0, x1, x2):
    """Key column ``j`` is visible for the row's interval triple: ``[0, x0) | [x1, x2)``."""
    return sympy.Or(sympy.And(j >= 0, j < x0), sympy.And(j >= x1, j < x2))


def cases(e) -> list:
    """``[(condition, value)]`` covering every case of ``e``, each ``value`` free of Piecewise/ITE.
    A boolean ``e`` is itself the condition: ``[(e, True), (~e, False)]``."""
    if is_bool(e):
        if e is sympy.true or e is sympy.false:
            return [(sympy.true, e)]
        inner = _split_bool(e)
        if inner is not None:
            return inner
        return [(e, sympy.true), (sympy.Not(e), sympy.false)]
    if not isinstance(e, sympy.Basic) or not e.has(sympy.Piecewise):
        return [(sympy.true, e)]
    e = sympy.piecewise_fold(e)
    if not isinstance(e, sympy.Piecewise):
        return [(sympy.true, e)]
    out, before = [], sympy.true
    for value, cond in e.args:
        here = sympy.And(before, cond)
        for c2, v2 in cases(value):
            out.append((sympy.And(here, c2), v2))
        before = sympy.And(before, sympy.Not(cond))
    return out


def _split_bool(e):
    if isinstance(e, sympy.ITE):
        c, a, b = e.args
        return [(sympy.And(c, ca), va) for ca, va in cases(a)] + \
               [(sympy.And(sympy.Not(c), cb), vb) for cb, vb in cases(b)]
    return None
