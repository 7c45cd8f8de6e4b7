"""Constant tensors read at symbolic coordinates: recognised by value, exactly.

A mask kept as a registered buffer (``triu(ones(N, N), 1)`` of the original HSTU), a small
constant made by ``torch.tensor([0])``, a position table ``arange(N)``: their values are known at
compile time. Read at concrete coordinates they are looked up; read at symbolic coordinates they
need a closed form, found by an exhaustive comparison with the whole tensor (so the form *is* the
tensor, at its real size):

* ``c + sum_k a_k * x_k`` (compared with ``arange`` along each dim);
* 1-D in a few affine pieces over ranges of its index (``(arange(N) - c).clamp(min=0)``, ids of a
  contextual prefix);
* 2-D whose value depends on ``j - i`` only (constant along every diagonal): a ``Piecewise`` over the
  runs of equal values of ``j - i`` (a causal mask, a band, an upper triangle);
* else, a tensor of at most ``_SMALL`` elements: a ``Piecewise`` over its elements.

Anything else is :class:`~.elements.Unsupported`, naming the constant. The cost is a few passes
over the tensor (16 M elements for ``N = 4096``: tens of milliseconds), paid once per constant.
"""
from __future__ import annotations

import sympy
import torch

_SMALL = 16


def _value(x):
    if isinstance(x, bool):
        return sympy.true if x else sympy.false
    if isinstance(x, int):
        return sympy.Integer(x)
    f = float(x)
    if f == float("inf"):
        return sympy.oo
    if f == float("-inf"):
        return -sympy.oo
    return sympy.Integer(int(f)) if f.is_integer() else sympy.Float(f, 53)


def _scalar(t: torch.Tensor):
    return _value(t.item())


def table_element(t: torch.Tensor, idx, name: str):
    from .values import Unsupported, select

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if all(isinstance(x, sympy.Integer) or (isinstance(x, sympy.Expr) and x.is_Integer) for x in idx):
        return _scalar(t[tuple(int(x) for x in idx)])
    form = _closed_form(t, name)
    if form is None:
        raise Unsupported(f"constant {name} {tuple(t.shape)} is read at symbolic coordinates and has no "
                          f"recognised closed form")
    return form(idx, select)


def _closed_form(t: torch.Tensor, name: str):
    keep = [d for d in range(t.dim()) if t.shape[d] != 1]
    if 0 < len(keep) < t.dim():  # unit dims (a [1, 1, N, N] mask buffer) are read at index 0 only
        inner = _closed_form(t.reshape([t.shape[d] for d in keep]), name)
        return None if inner is None else lambda idx, select: inner(tuple(idx[d] for d in keep), select)
    # the closed forms first: a small arange read as a 16-way Piecewise makes every later step slow
    form = _affine(t)
    if form is None and t.dim() == 1:
        form = _pieces(t)
    if form is None and t.dim() == 2:
        form = _band(t)
    if form is None and t.numel() <= _SMALL:
        form = _small(t)
    return form


def _small(t: torch.Tensor):
    """One flat case split over the flat index, a case per distinct value (nested selects would make
    every comparison with the element fold exponentially)."""
    flat = [_value(v) for v in t.reshape(-1).tolist()]
    shape = list(t.shape)
    where: dict = {}
    for k, v in enumerate(flat):
        where.setdefault(v, []).append(k)

    def small(idx, select):
        lin = sympy.Integer(0)
        for x, s in zip(idx, shape):
            lin = lin * s + x
        at = {v: sympy.Or(*[sympy.Eq(lin, k) for k in ks]) for v, ks in where.items()}
        if t.dtype == torch.bool:
            return at.get(sympy.true, sympy.false)
        *rest, last = where
        return sympy.Piecewise(*[(v, at[v]) for v in rest], (last, True))
    return small


def _affine(t: torch.Tensor):
    """``c + sum_k a_k * x_k`` (an ``arange``; unit dims were dropped by ``_closed_form``)."""
    if t.dtype == torch.bool or t.dim() == 0 or t.numel() < 2:
        return None
    origin = (0,) * t.dim()
    c = t[origin].item()
    steps = [(t[tuple(1 if k == d else 0 for k in range(t.dim()))] - t[origin]).item() for d in range(t.dim())]
    want = torch.full(t.shape, float(c), dtype=torch.float64)
    for d, a in enumerate(steps):
        shape = [1] * t.dim()
        shape[d] = t.shape[d]
        want = want + torch.arange(t.shape[d], dtype=torch.float64).reshape(shape) * a
    if not torch.equal(t.to(torch.float64), want):
        return None
    coefs, cv = [_value(a) for a in steps], _value(c)
    return lambda idx, select: sum((a * x for a, x in zip(coefs, idx)), sympy.Integer(0)) + cv


_PIECES = 4


def _pieces(t: torch.Tensor):
    """A 1-D table in at most ``_PIECES`` affine runs: ``Piecewise`` over index ranges (linear
    conditions, which z3 decides at once, where a case per element would multiply)."""
    if t.dtype == torch.bool or t.numel() < 3:
        return None
    v = t.to(torch.float64)
    d = v[1:] - v[:-1]
    runs, start = [], 0  # (first index, last index, value at first, step)
    while start < t.numel():
        end = start
        step = d[start].item() if start < d.numel() else 0.0
        while end + 1 < t.numel() and d[end].item() == step:
            end += 1
        runs.append((start, end, v[start].item(), step))
        if len(runs) > _PIECES:
            return None
        start = end + 1
    pieces = [(_value(c), _value(a), lo, hi) for lo, hi, c, a in runs]

    def piecewise(idx, select):
        x = idx[0]
        c, a, lo, _ = pieces[-1]
        out = c + a * (x - lo)
        for c, a, lo, hi in reversed(pieces[:-1]):
            out = select(sympy.Le(x, hi), c + a * (x - lo), out)
        return out
    return piecewise


def _band(t: torch.Tensor):
    R, C = t.shape
    if R > 1 and C > 1 and not torch.equal(t[1:, 1:], t[:-1, :-1]):
        return None
    # value as a function of d = j - i, for d in [-(R-1), C-1]: first column reversed, then first row
    along = torch.cat([t[1:, 0].flip(0), t[0, :]])
    d0 = -(R - 1)
    change = torch.nonzero(along[1:] != along[:-1]).reshape(-1).tolist()
    if len(change) > 8:
        return None
    runs = [(d0 + c, _value(along[c].item())) for c in change + [len(along) - 1]]  # (last d of a run, value)

    def band(idx, select):
        d = idx[1] - idx[0]
        out = runs[-1][1]
        for last, v in reversed(runs[:-1]):
            out = select(sympy.Le(d, last), v, out)
        return out
    return band
