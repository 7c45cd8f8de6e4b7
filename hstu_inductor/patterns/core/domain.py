"""The symbols of one value-level proof: coordinates with their ranges, sizes, the jagged offsets.

A proof reasons about *one element* of each tensor at symbolic coordinates. Every coordinate is a
sympy integer symbol with a known range ``[0, size)``; sizes are integers or the graph's own size
symbols. The jagged batch is described by two uninterpreted functions:

* ``off(x)``: ``offsets[x]`` for ``0 <= x <= B`` (non-decreasing, ``off(0) = 0``, ``off(B) = L``);
* ``tgt(x)``: ``num_targets[x]``, in ``[0, n_x]``.

A jagged row ``r`` of an ``[L, ...]`` tensor is written ``off(b) + p`` for a *sequence symbol* ``b``
in ``[0, B)`` and a *position symbol* ``p`` in ``[0, n_b)``: every row of ``[0, L)`` is exactly one such
pair when the offsets are valid (the op's input checks enforce that at run time). The length of
sequence ``b`` is its own symbol ``n_b`` in ``[0, N]``; :meth:`Domain.canon` rewrites
``off(b + 1)`` to ``off(b) + n_b``, so lengths computed as ``offsets[1:] - offsets[:-1]`` and
offsets read one past a row's sequence agree with it.

:meth:`Domain.floordiv` and :meth:`Domain.mod` simplify with these ranges: ``(b*N + p) // N`` is
``b`` because ``0 <= p < N``. That is what makes the association of a user's index arithmetic
irrelevant: ``seg * N + arange(L) - offsets[seg]`` and ``seg * N + (arange(L) - offsets[seg])``
both become ``b*N + p``.
"""
from __future__ import annotations

import itertools
from typing import Optional

import sympy

off = sympy.Function("off")
tgt = sympy.Function("tgt")


class Domain:
    """Coordinate symbols, their ranges, the jagged sizes ``B``, ``N``, ``L``."""

    def __init__(self, B, N, L, shape_env=None):
        self.B, self.N, self.L = (sympy.sympify(x) for x in (B, N, L))
        self.shape_env = shape_env  # what Dynamo knows about the size symbols (equalities it asserts)
        self.row_sizes: list = []   # other symbols of the jagged row count (per-input symbols under mark_dynamic)
        # size symbols created without a sign (an int argument such as N made symbolic): sizes are >= 1
        self._posify = {x: sympy.Dummy(x.name, positive=True, integer=True)
                        for e in (self.B, self.N, self.L) for x in e.free_symbols if not x.is_positive}
        self.ranges: dict = {}    # symbol -> (lo, hi), inclusive, sympy expressions
        self.rows: dict = {}      # position symbol -> its sequence symbol (the pair of a jagged row)
        self.lengths: dict = {}   # sequence symbol -> its length symbol n_b
        self.targets: dict = {}   # sequence symbol -> tgt(b) (kept as an application)
        self._count = itertools.count()

    # -- symbols ---------------------------------------------------------------------------------
    def coord(self, name: str, size) -> sympy.Symbol:
        """A fresh coordinate in ``[0, size)``."""
        s = sympy.Symbol(f"{name}_{next(self._count)}", integer=True)
        self.ranges[s] = (sympy.Integer(0), sympy.sympify(size) - 1)
        return s

    def sequence(self, name: str = "b") -> sympy.Symbol:
        """A fresh sequence symbol ``b`` in ``[0, B)`` with its length symbol ``n_b`` in ``[0, N]``."""
        b = self.coord(name, self.B)
        n = sympy.Symbol(f"n_{b.name}", integer=True)
        self.ranges[n] = (sympy.Integer(0), self.N)
        self.lengths[b] = n
        return b

    def row(self, name: str = "r") -> tuple:
        """A fresh jagged row: ``(b, p, off(b) + p)`` with ``0 <= p < n_b``."""
        b = self.sequence("b" + name)
        p = sympy.Symbol(f"p{name}_{next(self._count)}", integer=True)
        self.ranges[p] = (sympy.Integer(0), self.N - 1)  # the tighter p < n_b is a fact of decide()
        self.rows[p] = b
        return b, p, off(b) + p

    def length(self, b) -> sympy.Expr:
        return self.lengths[b] if b in self.lengths else off(b + 1) - off(b)

    def as_row(self, e) -> Optional[tuple]:
        """``(b, p)`` when ``e`` is the jagged row ``off(b) + p`` of a registered pair."""
        e = sympy.expand(self.canon(e))
        for p, b in self.rows.items():
            if sympy.expand(e - self.canon(off(b) + p)) == 0:
                return b, p
        return None

    def guarded_row(self, e) -> Optional[tuple]:
        """``(b, p, condition)``: ``e`` is row ``off(b) + p`` of sequence ``b`` where ``condition`` holds
        (``true`` for a registered pair; ``p < n_b`` for a coordinate ``p`` of a padded position, which is
        a jagged row exactly on the sequence's own positions)."""
        row = self.as_row(e)
        if row is not None:
            return row[0], row[1], sympy.true
        e = sympy.expand(self.canon(e))
        for b, n in self.lengths.items():
            p = sympy.expand(e - self.canon(off(b)))
            if p.has(off) or p == e:
                continue
            r = self.bounds(p)
            if r is not None and self.nonneg_(r[0]) and self.nonpos_(sympy.expand(r[1] - self.N + 1)):
                return b, p, sympy.Lt(p, n)
        return None

    def _minmax(self, e):
        """``Min`` / ``Max`` arguments that the ranges show never win, dropped (a clamp of a row index
        to ``B * N - 1`` that it never exceeds)."""
        seen: dict = {}

        def walk(x):
            if not x.args or not x.has(sympy.Min, sympy.Max):
                return x
            if x in seen:
                return seen[x]
            args = [walk(a) for a in x.args]
            # rebuilt only where an argument changed: sympy re-evaluates a rebuilt Min / Max (costly)
            y = x.func(*args) if any(a is not b for a, b in zip(args, x.args)) else x
            seen[x] = y = _drop(y)
            return y

        def _drop(x):
            if isinstance(x, (sympy.Min, sympy.Max)) and len(x.args) == 2:
                a, c = x.args
                lt = sympy.Le if isinstance(x, sympy.Min) else sympy.Ge
                if self.known(lt(a, c)):
                    return a
                if self.known(lt(c, a)):
                    return c
            return x
        return walk(e)

    def opaque(self, tag: str = "v") -> sympy.Symbol:
        """A value the proof does not model (what a rule reads outside its domain): any proof that
        depends on it fails, which is what makes reading it unsound-free."""
        return sympy.Symbol(f"opaque_{tag}_{next(self._count)}", integer=True)

    @staticmethod
    def has_opaque(e) -> bool:
        """Whether ``e`` holds a value made by :meth:`opaque`."""
        return isinstance(e, sympy.Basic) and any(s.name.startswith("opaque_") for s in e.free_symbols)

    def canon(self, e):
        """A coordinate whose range holds one value -> that value (a batch of one: ``b = 0``);
        ``off(b + 1)`` -> ``off(b) + n_b`` for the registered sequences; ``off(B)`` -> ``L``; ``off(0)`` -> 0."""
        if not isinstance(e, sympy.Basic):
            return e
        fixed = {s: lo for s, (lo, hi) in self.ranges.items() if lo == hi and s in e.free_symbols}
        if fixed:
            e = e.xreplace(fixed)
        if e.has(sympy.Min, sympy.Max):
            e = self._minmax(e)
        if not e.has(off):
            return e
        rep = {}
        for a in e.atoms(off):
            x = sympy.expand(a.args[0])
            if x == 0:
                rep[a] = sympy.Integer(0)
            elif sympy.expand(x - self.B) == 0:
                rep[a] = self.L
            else:
                for b, n in self.lengths.items():
                    if sympy.expand(x - b - 1) == 0:
                        rep[a] = off(b) + n
        return e.xreplace(rep) if rep else e

    def is_rows(self, size) -> bool:
        """Whether a dim of ``size`` holds the ``L`` jagged rows (the same expression, or a symbol the
        shape environment knows to be equal: an unbacked row count asserted equal to ``L``)."""
        size = sympy.sympify(size)
        if any(sympy.expand(size - r) == 0 for r in (self.L, *self.row_sizes)):
            return True
        if size.is_number and self.L.is_number:
            return False
        from ... import _compat
        return _compat.known_equal(self.shape_env, size, self.L)

    # -- ranges ----------------------------------------------------------------------------------
    def bounds(self, e) -> Optional[tuple]:
        """Inclusive ``(lo, hi)`` of an integer expression by interval arithmetic, or None."""
        e = sympy.sympify(e)
        if e.is_Integer:
            return e, e
        if e.is_Symbol:
            if e in self.ranges:
                return self.ranges[e]
            return e, e  # a size symbol of the graph: kept symbolic, so that s - s cancels
        if isinstance(e, sympy.Add):
            parts = [self.bounds(a) for a in e.args]
            if any(p is None for p in parts):
                return None
            return sympy.Add(*(p[0] for p in parts)), sympy.Add(*(p[1] for p in parts))
        if isinstance(e, sympy.Mul):
            coeff, rest = e.as_coeff_Mul()
            if coeff != 1:
                r = self.bounds(rest)
                if r is None:
                    return None
                lo, hi = r[0] * coeff, r[1] * coeff
                return (lo, hi) if coeff > 0 else (hi, lo)
            factors = list(e.args)
            pos = [f for f in factors if f.is_positive]
            var = [f for f in factors if not f.is_positive]
            if len(var) == 1 and pos:
                r = self.bounds(var[0])
                if r is None or not self.nonneg_(r[0]):
                    return None
                k = sympy.Mul(*pos)
                return r[0] * k, r[1] * k
            return None
        if isinstance(e, (sympy.Min, sympy.Max)):
            parts = [self.bounds(a) for a in e.args]
            if any(p is None for p in parts):
                return None
            pick = sympy.Min if isinstance(e, sympy.Min) else sympy.Max
            return pick(*(p[0] for p in parts)), pick(*(p[1] for p in parts))
        if isinstance(e, sympy.Mod):
            m = e.args[1]
            if m.is_positive:
                return sympy.Integer(0), m - 1
            return None
        if isinstance(e, sympy.Function) and e.func == off:
            return sympy.Integer(0), self.L
        if isinstance(e, sympy.Function) and e.func == tgt:
            return sympy.Integer(0), self.N
        return None

    def known(self, rel) -> bool:
        """Whether ``rel`` (``lhs < rhs`` / ``<=``) holds for every value, by the ranges."""
        if rel is sympy.true or rel is sympy.false:
            return rel is sympy.true
        d = sympy.expand(rel.lhs - rel.rhs)
        b = self.bounds(d)
        if b is None:
            return False
        if isinstance(rel, sympy.StrictLessThan):
            return self.neg_(b[1])
        if isinstance(rel, sympy.LessThan):
            return self.nonpos_(b[1])
        if isinstance(rel, sympy.StrictGreaterThan):
            return self.pos_(b[0])
        if isinstance(rel, sympy.GreaterThan):
            return self.nonneg_(b[0])
        return False

    # -- integer division ----------------------------------------------------------------------
    def _splits(self, a, d):
        """Ways to write ``a = d * q + r`` (the caller keeps the first whose ``r`` is in ``[0, d)``):
        the terms divisible by ``d``; then each term's coefficient reduced to its balanced remainder
        (``46 i mod 47`` is ``-i``; ``(3N - 2) i mod (3N - 1)`` is ``-i``, by polynomial division)."""
        a, d = sympy.expand(a), sympy.sympify(d)
        q, r = sympy.Integer(0), sympy.Integer(0)
        q2, r2 = sympy.Integer(0), sympy.Integer(0)
        for t in sympy.Add.make_args(a):
            c = sympy.cancel(t / d)
            num, den = sympy.fraction(c)
            if den == 1 and (c.is_Integer or not c.is_number):
                q += c
                q2 += c
                continue
            r += t
            coeff, rest = t.as_independent(*[x for x in t.free_symbols if x in self.ranges], as_Add=False)
            k = self._balanced_quotient(coeff, d)
            q2 += k * rest
            r2 += sympy.expand(t - k * rest * d)
        yield q, r
        if r2 != r:
            yield q2, r2

    @staticmethod
    def _balanced_quotient(coeff, d):
        if coeff.is_number and d.is_number:
            return sympy.Integer(int(sympy.floor(coeff / d + sympy.Rational(1, 2))))
        try:
            quo, rem = sympy.div(sympy.Poly(coeff, *sorted(coeff.free_symbols | d.free_symbols, key=str)),
                                 sympy.Poly(d, *sorted(coeff.free_symbols | d.free_symbols, key=str)))
        except Exception:  # not polynomials: no reduction
            return sympy.Integer(0)
        k = quo.as_expr()
        return k if k.is_Integer else sympy.Integer(0)

    def _divmod(self, a, d):
        """``(a // d, a mod d)`` when some split of ``a`` has its remainder in ``[0, d)`` (or ``[-d, 0)``)."""
        if self.as_row(a) is not None and self.is_rows(d):  # a jagged row is below L
            return sympy.Integer(0), sympy.expand(a)
        for q, r in self._splits(a, d):
            b = self.bounds(r)
            if b is None:
                continue
            if self.nonneg_(b[0]) and self.neg_(sympy.expand(b[1] - d)):
                return q, r
            if self.nonneg_(b[0] + d) and self.neg_(b[1]):
                return q - 1, r + d
        return None

    def floordiv(self, a, d):
        """``a // d`` for a positive ``d``, exact where the ranges allow."""
        d = sympy.sympify(d)
        if d == 1:
            return sympy.expand(a)
        qr = self._divmod(a, d)
        return qr[0] if qr is not None else sympy.floor(sympy.expand(a) / d)

    def mod(self, a, d):
        """``a mod d`` (Python sign convention) for a positive ``d``."""
        d = sympy.sympify(d)
        if d == 1:
            return sympy.Integer(0)
        qr = self._divmod(a, d)
        return qr[1] if qr is not None else sympy.Mod(sympy.expand(a), d)

    def simplify_divmod(self, e):
        """``e`` with every ``floor(a / d)`` and ``Mod(a, d)`` re-simplified by the ranges (after a
        substitution made them simplifiable)."""
        if not isinstance(e, sympy.Basic) or not e.has(sympy.floor, sympy.Mod):
            return e

        def walk(x):
            if not x.args:
                return x
            x = x.func(*[walk(a) for a in x.args])
            if isinstance(x, sympy.floor):
                num, den = sympy.fraction(sympy.together(x.args[0]))
                if den != 1 and self.pos_(den):
                    return self.floordiv(num, den)
            if isinstance(x, sympy.Mod) and self.pos_(x.args[1]):
                return self.mod(x.args[0], x.args[1])
            return x
        return sympy.expand(walk(e))


    def neg_(self, e) -> bool:
        return _neg(sympy.sympify(e).xreplace(self._posify))

    def nonneg_(self, e) -> bool:
        return _nonneg(sympy.sympify(e).xreplace(self._posify))

    def nonpos_(self, e) -> bool:
        return _nonpos(sympy.sympify(e).xreplace(self._posify))

    def pos_(self, e) -> bool:
        return _pos(sympy.sympify(e).xreplace(self._posify))


def _sign_known(e, test) -> bool:
    e = sympy.expand(e)
    v = test(e)
    return bool(v) if v is not None else False


def _neg(e) -> bool:
    return _sign_known(e, lambda x: x.is_negative)


def _nonneg(e) -> bool:
    return _sign_known(e, lambda x: x.is_nonnegative)


def _nonpos(e) -> bool:
    return _sign_known(e, lambda x: x.is_nonpositive)


def _pos(e) -> bool:
    return _sign_known(e, lambda x: x.is_positive)
