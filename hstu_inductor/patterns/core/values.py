"""Element values: booleans and numbers as sympy expressions, and the one error of the core."""
from __future__ import annotations

import contextlib
import time

import sympy
import torch

from ..prover import Decline


class Unsupported(Decline):
    """No value rule for an op (or for this use of it): the proof cannot say what it computes."""


def meta_val(n):
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else None


def is_bool(e) -> bool:
    """A boolean value (sympy's Symbol is both an Expr and a Boolean: our symbols are integers)."""
    return isinstance(e, sympy.logic.boolalg.Boolean) and not isinstance(e, sympy.Expr)


def num(e):
    """``e`` as a number (a boolean is 1 or 0)."""
    if is_bool(e):
        if e is sympy.true:
            return sympy.Integer(1)
        if e is sympy.false:
            return sympy.Integer(0)
        _check_cases(e)
        return sympy.Piecewise((1, e), (0, True))
    return e


_MAX_CASES = 64


def _check_cases(cond) -> None:
    """Sympy folds every case split inside a condition out of it: the product of their sizes. Past
    ``_MAX_CASES`` that is minutes of sympy for an element nobody can decide: declined instead."""
    n = 1
    for p in cond.atoms(sympy.Piecewise):
        n *= len(p.args)
        if n > _MAX_CASES:
            raise Unsupported(f"an element condition splits into more than {_MAX_CASES} cases (tables read at "
                              f"symbolic positions, compared)")


def indicator(e):
    """The condition ``c`` when ``e`` is a boolean or ``c ? 1 : 0`` (in any number type), else None."""
    if is_bool(e):
        return e
    if isinstance(e, sympy.Piecewise) and len(e.args) == 2 and e.args[1][1] is sympy.true:
        (one, c), (zero, _) = e.args
        if one.is_number and zero.is_number and float(one) == 1 and float(zero) == 0:
            return c
    return None


def boolean(e):
    """``e`` as a boolean (a number is ``e != 0``)."""
    return e if is_bool(e) else sympy.Ne(e, 0)


def select(c, a, b):
    """``where(c, a, b)`` for booleans or numbers."""
    c = boolean(c)
    if c is sympy.true:
        return a
    if c is sympy.false:
        return b
    if is_bool(a) and is_bool(b):
        return sympy.ITE(c, a, b)
    return sympy.Piecewise((num(a), c), (num(b), True))




def exact_divisions(e):
    """``e`` with each of torch's floor divisions that divides exactly (``(N**2) // N``, left by a
    view of a flattened ``[N, N]``) replaced by its polynomial quotient: the index arithmetic then
    stays linear in the coordinates, which keeps z3's queries quick and their time predictable."""
    if not isinstance(e, sympy.Basic) or not any(type(a).__name__ in TORCH_DIVS for a in sympy.preorder_traversal(e)):
        return e

    def walk(x):
        if not x.args:
            return x
        x = x.func(*[walk(a) for a in x.args])
        if type(x).__name__ in TORCH_DIVS:
            q = sympy.cancel(x.args[0] / x.args[1])
            if sympy.fraction(q)[1] == 1 and not q.is_number:
                return q
        return x
    return walk(e)


TORCH_DIVS = ("FloorDiv", "CleanDiv")  # torch.utils._sympy.functions


def size_expr(s):
    """A size as a sympy expression, with the shape environment's replacements applied (two symbols
    Dynamo proved equal, an unbacked size tied to a backed one, read as one)."""
    if isinstance(s, torch.SymInt):
        e = s.node.expr
        env = getattr(s.node, "shape_env", None)
        if env is not None:
            try:
                e = env.replace(e)
            except Exception:  # replacements are an optimisation of the reading, never required
                pass
        return exact_divisions(sympy.sympify(e))
    if isinstance(s, sympy.Basic):
        return s
    return sympy.Integer(int(s))


_DEADLINE: list = [None]


@contextlib.contextmanager
def time_budget(seconds: float):
    """Proof steps taken after ``seconds`` raise :class:`Unsupported`: a proof never holds a user's
    compile for long (the graph then compiles as stock Inductor would)."""
    saved = _DEADLINE[0]
    _DEADLINE[0] = time.monotonic() + seconds
    try:
        yield
    finally:
        _DEADLINE[0] = saved


def check_budget() -> None:
    if _DEADLINE[0] is not None and time.monotonic() > _DEADLINE[0]:
        raise Unsupported("the proof ran past its time budget (hstu_inductor.config.proof_budget_s)")
