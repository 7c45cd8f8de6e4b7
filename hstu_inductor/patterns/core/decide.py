"""Deciding facts about element expressions: sympy -> z3, validity under the domain's facts.

The element expressions of :mod:`.elements` are quantifier-free formulas in linear integer
arithmetic with uninterpreted functions (``off``, ``tgt``, the data leaves): z3 decides them in
milliseconds, whatever the sizes and constants. :func:`valid` asks whether a formula holds for
*every* coordinate in range and every valid jagged batch; a counterexample (a model) is returned
otherwise, so a near-miss reason can name the element where the user's code differs.

The facts of a valid batch (:meth:`Facts.formula`): coordinates in their ranges; ``0 <= n_b <= N``;
``0 <= off(x) <= L`` for ``0 <= x <= B``; ``off`` non-decreasing (instantiated for every pair of
applications that occurs); ``p < n_b`` for the position of a jagged row; ``0 <= tgt(b) <= n_b``; the row
count of every per-token input (its own symbol under dynamic shapes) equals ``L``.
These are what the op's input checks enforce at run time.
"""
from __future__ import annotations

import functools
from typing import Optional

import sympy

from .domain import Domain, off, tgt
from .values import TORCH_DIVS, Unsupported, boolean, check_budget, is_bool

try:
    import z3
except ImportError:  # pragma: no cover - a hard dependency; a broken install declines proofs
    z3 = None


def available() -> bool:
    return z3 is not None


class _Translator:
    """sympy -> z3, with integer symbols, ``off``/``tgt`` as Int functions and other applied
    functions (data leaves) as Real-valued functions."""

    def __init__(self):
        self.vars: dict = {}
        self.funcs: dict = {}
        self.apps: list = []   # off/tgt applications met (for the facts)

    def var(self, s):
        if s not in self.vars:
            self.vars[s] = z3.Int(s.name) if not getattr(s, "is_real_var", False) else z3.Real(s.name)
        return self.vars[s]

    def func(self, f, arity, real):
        key = (f.__name__, arity, real)
        if key not in self.funcs:
            sort = z3.RealSort() if real else z3.IntSort()
            self.funcs[key] = z3.Function(f.__name__, *([z3.IntSort()] * arity), sort)
        return self.funcs[key]

    def __call__(self, e):
        return self.tr(sympy.sympify(e))

    def tr(self, e):
        if e is sympy.true or e == sympy.true:
            return z3.BoolVal(True)
        if e is sympy.false or e == sympy.false:
            return z3.BoolVal(False)
        if isinstance(e, sympy.Integer):
            return z3.IntVal(int(e))
        if isinstance(e, sympy.Rational):
            return z3.RealVal(f"{e.p}/{e.q}")
        if isinstance(e, sympy.Float):
            return z3.RealVal(str(sympy.Rational(e)))
        if e in (sympy.oo, -sympy.oo, sympy.zoo, sympy.nan):
            raise Unsupported(f"infinite value {e} in a decided formula")
        if isinstance(e, sympy.Symbol):
            return self.var(e)
        if isinstance(e, sympy.Add):
            return functools.reduce(lambda a, b: a + b, (self.tr(a) for a in e.args))
        if isinstance(e, sympy.Mul):
            return functools.reduce(lambda a, b: a * b, (self.tr(a) for a in e.args))
        if isinstance(e, sympy.Pow):
            base, ex = e.args
            if ex.is_Integer and ex > 0:
                return functools.reduce(lambda a, b: a * b, [self.tr(base)] * int(ex))
            if ex == -1:
                return z3.ToReal(self.tr(base)) if z3.is_int(self.tr(base)) else 1 / self.tr(base)
            raise Unsupported(f"power {e}")
        if isinstance(e, sympy.floor):
            x = e.args[0]
            num, den = sympy.fraction(sympy.together(x))
            if den != 1:
                a, d = self.tr(num), self.tr(den)
                if z3.is_int(a) and z3.is_int(d):
                    return a / d  # z3 integer division: floor for a positive divisor
            return z3.ToInt(self._real(self.tr(x)))
        if isinstance(e, sympy.ceiling):
            return -z3.ToInt(-self._real(self.tr(e.args[0])))
        if isinstance(e, sympy.Mod):
            return self.tr(e.args[0]) % self.tr(e.args[1])
        if isinstance(e, (sympy.Min, sympy.Max)):
            args = [self.tr(a) for a in e.args]
            pick = (lambda a, b: z3.If(a <= b, a, b)) if isinstance(e, sympy.Min) else \
                (lambda a, b: z3.If(a >= b, a, b))
            return functools.reduce(pick, args)
        if isinstance(e, sympy.Abs):
            x = self.tr(e.args[0])
            return z3.If(x >= 0, x, -x)
        if isinstance(e, sympy.sign):
            x = self.tr(e.args[0])
            return z3.If(x > 0, 1, z3.If(x < 0, -1, 0))
        if isinstance(e, sympy.Piecewise):
            out = None
            for value, cond in reversed(e.args):
                v = self.tr(value)
                if out is None:
                    out = v
                    if cond is not sympy.true:  # no default branch: the last piece stands for the rest
                        pass
                    continue
                out = z3.If(self.tr(cond), v, out)
            return out
        if isinstance(e, sympy.ITE):
            return z3.If(self.tr(e.args[0]), self.tr(e.args[1]), self.tr(e.args[2]))
        if isinstance(e, sympy.Eq):
            return self.tr(e.lhs) == self.tr(e.rhs)
        if isinstance(e, sympy.Ne):
            return self.tr(e.lhs) != self.tr(e.rhs)
        if isinstance(e, sympy.StrictLessThan):
            return self.tr(e.lhs) < self.tr(e.rhs)
        if isinstance(e, sympy.LessThan):
            return self.tr(e.lhs) <= self.tr(e.rhs)
        if isinstance(e, sympy.StrictGreaterThan):
            return self.tr(e.lhs) > self.tr(e.rhs)
        if isinstance(e, sympy.GreaterThan):
            return self.tr(e.lhs) >= self.tr(e.rhs)
        if isinstance(e, sympy.And):
            return z3.And(*[self.tr(a) for a in e.args])
        if isinstance(e, sympy.Or):
            return z3.Or(*[self.tr(a) for a in e.args])
        if isinstance(e, sympy.Not):
            return z3.Not(self.tr(e.args[0]))
        if isinstance(e, sympy.Xor):
            return functools.reduce(z3.Xor, [self.tr(a) for a in e.args])
        if isinstance(e, sympy.Equivalent):
            args = [self.tr(a) for a in e.args]
            return z3.And(*[a == args[0] for a in args[1:]])
        if isinstance(e, sympy.Implies):
            return z3.Implies(self.tr(e.args[0]), self.tr(e.args[1]))
        name = type(e).__name__
        if name in TORCH_DIVS:  # torch's size arithmetic
            a, d = self.tr(e.args[0]), self.tr(e.args[1])
            return a / d if z3.is_int(a) and z3.is_int(d) else z3.ToInt(self._real(a) / self._real(d))
        if name in ("PythonMod", "Mod") and len(e.args) == 2:
            return self.tr(e.args[0]) % self.tr(e.args[1])
        if name in ("Identity",):
            return self.tr(e.args[0])
        if isinstance(e, sympy.Function) and isinstance(e.func, sympy.core.function.UndefinedFunction):
            real = e.func not in (off, tgt) and not getattr(e.func, "is_int_leaf", False)
            f = self.func(e.func, len(e.args), real)
            args = [self._int(self.tr(a)) for a in e.args]
            if e.func in (off, tgt):
                self.apps.append(e)
            return f(*args)
        raise Unsupported(f"cannot decide a formula holding {type(e).__name__} ({e})")

    @staticmethod
    def _real(x):
        return z3.ToReal(x) if z3.is_int(x) else x

    @staticmethod
    def _int(x):
        if z3.is_int(x):
            return x
        raise Unsupported("a non-integer coordinate")


class Facts:
    """The facts of a valid jagged batch over the symbols of ``dom`` (module docstring)."""

    def __init__(self, dom: Domain, extra=()):
        self.dom = dom
        self.extra = list(extra)
        self.assumed = False  # facts of the input contract beyond the sizes' own: checked consistent

    def formula(self, tr: _Translator):
        dom = self.dom
        fs = []
        # Only the coordinates the formula reads (and those their facts name) are constrained: every
        # coordinate is a "for all" of its own, and one over an empty dim (``offsets[1:-1]`` of a batch of
        # one) would otherwise make all facts contradictory, so every formula valid.
        fs += [tr(e) for e in self.extra]
        seq_of = {x: b for b, n in dom.lengths.items() for x in (b, n)}  # a sequence and its length
        done: set = set()
        linked: set = set()
        while True:
            todo = [x for x in list(tr.vars) if x not in done]
            if not todo:
                break
            for x in todo:
                done.add(x)
                if x in dom.ranges:
                    lo, hi = dom.ranges[x]
                    fs += [tr(x) >= tr(lo), tr(x) <= tr(hi)]
                if x in dom.rows:
                    fs.append(tr(x) < tr(dom.length(dom.rows[x])))
                b = seq_of.get(x)
                if b is not None and b not in linked:  # once per sequence, from its symbol or its length
                    linked.add(b)
                    n = dom.lengths[b]
                    fs.append(tr(off(b)) + tr(n) <= tr(dom.L))
                    fs.append(tr(off(b)) >= 0)
                    fs.append(tr(off(b + 1)) == tr(off(b)) + tr(n))  # links n_b to the other offsets
        for s in _size_symbols(dom):
            fs.append(tr(s) >= 1)
        for r in dom.row_sizes:  # per-token inputs have the L rows: their contract, which the op checks
            d = sympy.expand(sympy.sympify(r) - dom.L)
            if d != 0 and not d.is_number:  # a symbol of its own (dynamic shapes, an unbacked row count)
                fs.append(tr(r) == tr(dom.L))
                self.assumed = True
        # applications of off / tgt seen while translating (including those of the facts)
        seen = []
        for a in list(tr.apps):
            if any(a == s for s in seen):
                continue
            seen.append(a)
        offs = [a for a in seen if a.func == off]
        for a in offs:
            x = tr(a.args[0])
            fs.append(z3.Implies(z3.And(x >= 0, x <= tr(dom.B)), z3.And(tr(a) >= 0, tr(a) <= tr(dom.L))))
            fs.append(z3.Implies(x == 0, tr(a) == 0))
            fs.append(z3.Implies(x == tr(dom.B), tr(a) == tr(dom.L)))
        for a1 in offs:
            for a2 in offs:
                if a1 is a2:
                    continue
                fs.append(z3.Implies(tr(a1.args[0]) <= tr(a2.args[0]), tr(a1) <= tr(a2)))
        for a in (a for a in seen if a.func == tgt):
            b = a.args[0]
            fs.append(tr(a) >= 0)
            fs.append(tr(a) <= tr(dom.length(b)))
        return z3.And(*fs)


def _size_symbols(dom):
    out = set()
    for e in (dom.B, dom.N, dom.L):
        out |= {s for s in sympy.sympify(e).free_symbols if s not in dom.ranges}
    return out


#: z3's work per query, in its deterministic resource units (about 5 M a second on one core): a
#: query past it is undecided on every machine alike, so a decision never depends on the load.
RLIMIT = 30_000_000
#: Wall-clock backstop only; ``RLIMIT`` binds first on any machine at least a tenth as fast.
TIMEOUT_MS = 60_000


def _solver():
    s = z3.Solver()
    s.set("rlimit", RLIMIT)
    s.set("timeout", TIMEOUT_MS)
    return s


def valid(dom: Domain, formula, assume=()):
    """``(True, None)`` when ``formula`` holds under the facts of ``dom`` and ``assume``; else
    ``(False, model)`` with a counterexample (a dict of symbol name -> value), or ``(None, reason)``
    when z3 could not decide it within ``RLIMIT``."""
    if z3 is None:
        raise Unsupported("z3-solver is not installed (pip install z3-solver): value-level proofs need it")
    tr = _Translator()
    goal = tr(formula)
    assumptions = [tr(a) for a in assume]
    facts = _checked_facts(dom, tr)  # after the goal: its applications get their facts too
    if facts is None:
        return None, "the sizes contradict the input contract"
    s = _solver()
    s.add(facts, *assumptions, z3.Not(goal))
    r = s.check()
    if r == z3.unsat:
        return True, None
    if r == z3.sat:
        m = s.model()
        return False, {str(d): m[d] for d in m.decls()}
    return None, s.reason_unknown()


def _checked_facts(dom: Domain, tr: _Translator):
    """The facts of ``dom`` for what ``tr`` translated; None when the input contract they assume
    contradicts the sizes (contradictory facts would make every formula valid)."""
    F = Facts(dom)
    facts = F.formula(tr)
    if F.assumed:
        s = _solver()
        s.add(facts)
        if s.check() != z3.sat:
            return None
    return facts


def equal(dom: Domain, a, b, assume=()):
    """Whether ``a == b`` (numbers) or ``a <-> b`` (booleans) for every valid element."""
    if is_bool(a) or is_bool(b):
        f = sympy.Equivalent(boolean(a), boolean(b))
    else:
        f = sympy.Eq(a, b, evaluate=False)
    return valid(dom, f, assume)


def satisfiable(dom: Domain, cond, assume=()) -> Optional[bool]:
    ok, _ = valid(dom, sympy.Not(cond), assume)
    return None if ok is None else not ok


def collapse(dom: Domain, e):
    """``e`` with every ``Piecewise`` branch dropped whose value equals the next branch's wherever its
    condition holds (``cat([0], cumsum(lengths))[k]`` is ``off(k)``, since ``off(0) = 0``). Decided,
    so exact; used by rules that recognise a form (the offsets, the lengths) before giving up."""
    if not isinstance(e, sympy.Basic) or not e.has(sympy.Piecewise):
        return e
    args = [collapse(dom, a) for a in e.args] if e.args else []
    e = e.func(*args) if args else e
    if not isinstance(e, sympy.Piecewise):
        return e
    pieces = list(e.args)
    while len(pieces) >= 2:
        (v1, c1), (v2, c2) = pieces[0], pieces[1]
        rest = sympy.Piecewise(*pieces[1:]) if len(pieces) > 2 or c2 is not sympy.true else v2
        ok, _ = valid(dom, sympy.Implies(c1, sympy.Eq(v1, rest)))
        if ok:
            pieces = pieces[1:]
            continue
        ok, _ = valid(dom, sympy.Implies(sympy.Not(c1), sympy.Eq(rest, v1)))
        if ok:  # the later branches agree with the first wherever they are taken
            return v1
        break
    if len(pieces) == 1 and pieces[0][1] is sympy.true:
        return pieces[0][0]
    return sympy.Piecewise(*pieces)


class Equivalence:
    """Decides ``target <-> candidate`` for many candidates against one ``target`` (a mask against
    HSTU's mask for each parameter set): counterexamples found so far reject most candidates by
    evaluation, so z3 runs only for candidates that survive them."""

    def __init__(self, dom: Domain, target, assume=()):
        if z3 is None:
            raise Unsupported("z3-solver is not installed (pip install z3-solver): value-level proofs need it")
        self.dom = dom
        self.tr = _Translator()
        self.target = self.tr(target)
        self.assume = [self.tr(a) for a in assume]
        self.models: list = []

    def check(self, candidate) -> bool:
        check_budget()
        c = self.tr(candidate)
        same = self.target == c
        for m in self.models:
            if z3.is_false(m.eval(same, model_completion=True)):
                return False
        facts = _checked_facts(self.dom, self.tr)
        if facts is None:
            return False
        s = _solver()
        s.add(facts, *self.assume, z3.Not(same))
        r = s.check()
        if r == z3.sat:
            self.models.append(s.model())
            return False
        return r == z3.unsat

    def points(self, exprs) -> list:
        """``(values of exprs, value of the target)`` at each counterexample found so far (ints and
        bools; a point where one is neither is left out), for filtering candidates numerically."""
        zs = [self.tr(e) for e in exprs]
        out = []
        for m in self.models:
            vals = [_concrete(m.eval(z, model_completion=True)) for z in zs + [self.target]]
            if None not in vals:
                out.append((vals[:-1], vals[-1]))
        return out


def _concrete(v):
    if z3.is_true(v) or z3.is_false(v):
        return z3.is_true(v)
    return v.as_long() if z3.is_int_value(v) else None
