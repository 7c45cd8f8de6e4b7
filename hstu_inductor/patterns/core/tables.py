"""Constant tensors read at symbolic coordinates: recognised by value, exactly.

A mask kept as a registered buffer (``triu(ones(N, N), 1)`` of the original HSTU), a small
constant made by ``torch.tensor([0])``, a position table ``arange(N)``: their values are known at
compile time. Read at concrete coordinates they are looked up; read at symbolic coordinates they
need a closed form, found by an exhaustive comparison with the whole tensor (so the form *is* the
tensor, at its real size):

* a tensor of at most ``_SMALL`` elements: a ``Piecewise`` over its elements;
* 1-D: ``a * x + c`` (compared with ``arange``);
* 2-D whose value depends on ``j - i`` only (constant along every diagonal): a ``Piecewise`` over the
  runs of equal values of ``j - i`` (a causal mask, a band, an upper triangle).

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
    if t.numel() <= _SMALL:
        flat = [_value(v) for v in t.reshape(-1).tolist()]
        shape = list(t.shape)

        def small(idx, select):
            lin = sympy.Integer(0)
            for x, s in zip(idx, shape):
                lin = lin * s + x
            out = flat[-1]
            for k in reversed(range(len(flat) - 1)):
                out = select(sympy.Eq(lin, k), flat[k], out)
            return out
        return small
    if t.dim() == 1:
        n = t.shape[0]
        if t.dtype == torch.bool:
            return None
        a = (t[1] - t[0]).item()
        c = t[0].item()
        ar = torch.arange(n, dtype=torch.float64)
        if torch.equal(t.to(torch.float64), ar * a + c):
            av, cv = _value(a), _value(c)
            return lambda idx, select: av * idx[0] + cv
        return None
    if t.dim() == 2:
        R, C = t.shape
        if R > 1 and C > 1 and not torch.equal(t[1:, 1:], t[:-1, :-1]):
            return None
        # value as a function of d = j - i, for d in [-(R-1), C-1]: first column reversed, then first row
        along = torch.cat([t[1:, 0].flip(0), t[0, :]])
        d0 = -(R - 1)
        change = torch.nonzero(along[1:] != along[:-1]).reshape(-1).tolist()
        if len(change) > 8:
            return None
        runs = []  # (last d of the run, value)
        start = 0
        for c in change + [len(along) - 1]:
            runs.append((d0 + c, _value(along[c].item())))
            start = c + 1
        _ = start

        def band(idx, select):
            d = idx[1] - idx[0]
            out = runs[-1][1]
            for last, v in reversed(runs[:-1]):
                out = select(sympy.Le(d, last), v, out)
            return out
        return band
    return None
