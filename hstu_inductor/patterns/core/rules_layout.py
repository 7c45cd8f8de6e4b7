"""Value rules of layout ops and gathers: they map coordinates, never change values.

Views are mixed-radix arithmetic on the coordinates (``linear`` / ``unravel``), simplified with the
coordinates' ranges by :class:`~.domain.Domain`; a gather substitutes the index tensor's element
into the source coordinate (negative indices read Python-style unless the ranges exclude them).
"""
from __future__ import annotations

import operator

import sympy
import torch

from .elements import _dtype, _opname, _op, _src, linear, rule, unravel
from .rules_values import _cast
from .values import Unsupported, num, select

aten = torch.ops.aten

@rule(_op("view"), _op("_unsafe_view"), _op("reshape"))
def _view(E, n, idx):
    a = n.args[0]
    return E.at(_src(E, n), unravel(E, linear(idx, E.shape(n)), E.shape(a)))


@rule(_op("permute"))
def _permute(E, n, idx):
    perm = [p % len(idx) for p in n.args[1]]
    src = [None] * len(idx)
    for out_d, in_d in enumerate(perm):
        src[in_d] = idx[out_d]
    return E.at(_src(E, n), tuple(src))


@rule(_op("transpose", "int"))
def _transpose(E, n, idx):
    d0, d1 = n.args[1] % len(idx), n.args[2] % len(idx)
    src = list(idx)
    src[d0], src[d1] = idx[d1], idx[d0]
    return E.at(_src(E, n), tuple(src))


@rule(_op("t"))
def _t(E, n, idx):
    return E.at(_src(E, n), tuple(reversed(idx)) if len(idx) == 2 else idx)


@rule(_op("unsqueeze"))
def _unsqueeze(E, n, idx):
    d = n.args[1] % len(idx)
    return E.at(_src(E, n), idx[:d] + idx[d + 1:])


@rule(_op("squeeze", "dim"), _op("squeeze", "dims"), _op("squeeze"))
def _squeeze(E, n, idx):
    shape = E.shape(n.args[0])
    if n.target is _op("squeeze"):
        dims = [d for d, s in enumerate(shape) if s == 1]
    else:
        dims = n.args[1] if isinstance(n.args[1], (list, tuple)) else [n.args[1]]
        dims = [d % len(shape) for d in dims if shape[d % len(shape)] == 1]
    it = iter(idx)
    src = tuple(sympy.Integer(0) if d in dims else next(it) for d in range(len(shape)))
    return E.at(_src(E, n), src)


@rule(_op("expand"))
def _expand(E, n, idx):
    a = n.args[0]
    shape = E.shape(a)
    sub = idx[len(idx) - len(shape):]
    return E.at(_src(E, n), tuple(sympy.Integer(0) if s == 1 else x for s, x in zip(shape, sub)))


def _slice_bounds(E, size, start, end, step):
    start = sympy.Integer(0) if start is None else E.scalar(start)
    step = E.scalar(step)
    if start.is_number and start < 0:
        start = start + size
    return start, step


@rule(_op("slice", "Tensor"))
def _slice(E, n, idx):
    a = n.args[0]
    shape = E.shape(a)
    dim = (n.args[1] if len(n.args) > 1 else 0) % len(shape)
    start = n.args[2] if len(n.args) > 2 else None
    step = n.args[4] if len(n.args) > 4 else 1
    start, step = _slice_bounds(E, shape[dim], start, None, step)
    src = list(idx)
    src[dim] = start + step * idx[dim]
    return E.at(_src(E, n), tuple(src))


@rule(_op("select", "int"))
def _select(E, n, idx):
    a = n.args[0]
    shape = E.shape(a)
    dim = n.args[1] % len(shape)
    i = E.scalar(n.args[2])
    if i.is_number and i < 0:
        i = i + shape[dim]
    return E.at(_src(E, n), idx[:dim] + (i,) + idx[dim:])


@rule(_op("flip"))
def _flip(E, n, idx):
    shape = E.shape(n)
    src = list(idx)
    for d in n.args[1]:
        d = d % len(shape)
        src[d] = shape[d] - 1 - idx[d]
    return E.at(_src(E, n), tuple(src))


@rule(_op("roll"))
def _roll(E, n, idx):
    shape = E.shape(n)
    shifts = n.args[1] if isinstance(n.args[1], (list, tuple)) else [n.args[1]]
    dims = n.args[2] if len(n.args) > 2 else n.kwargs.get("dims", [])
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    if not dims:
        raise Unsupported("roll of the flattened tensor")
    src = list(idx)
    for s, d in zip(shifts, dims):
        d = d % len(shape)
        src[d] = E.dom.mod(idx[d] - E.scalar(s), shape[d])
    return E.at(_src(E, n), tuple(src))


@rule(_op("repeat"))
def _repeat(E, n, idx):
    a = n.args[0]
    shape = E.shape(a)
    lead = len(idx) - len(shape)
    src = tuple(E.dom.mod(idx[lead + d], s) for d, s in enumerate(shape))
    return E.at(_src(E, n), src)


def _pieces(E, n, idx, tensors, dim):
    """Piecewise over the inputs of a concatenation along ``dim``."""
    cases = []
    start = sympy.Integer(0)
    for t in tensors:
        size = E.shape(t)[dim] if len(E.shape(t)) > dim else None
        if size is None:  # torch.cat skips empty 1-D tensors
            continue
        local = list(idx)
        local[dim] = idx[dim] - start
        cases.append((start + size, t, tuple(local)))
        start = start + size
    return cases


@rule(_op("cat"))
def _cat(E, n, idx):
    tensors = n.args[0]
    dim = (n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)) % len(idx)
    cases = _pieces(E, n, idx, tensors, dim)
    out = None
    for end, t, local in reversed(cases):
        v = E.at(E.src(n, t), local)
        out = v if out is None else select(sympy.Lt(idx[dim], end), v, out)
    return out


@rule(_op("stack"))
def _stack(E, n, idx):
    tensors = n.args[0]
    dim = (n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)) % len(idx)
    rest = idx[:dim] + idx[dim + 1:]
    out = None
    for k in reversed(range(len(tensors))):
        v = E.at(E.src(n, tensors[k]), rest)
        out = v if out is None else select(sympy.Eq(idx[dim], k), v, out)
    return out


@rule(_op("constant_pad_nd"))
def _pad(E, n, idx):
    a = n.args[0]
    pads = list(n.args[1])
    value = _cast(E.scalar(n.args[2] if len(n.args) > 2 else 0), _dtype(n))
    shape = E.shape(a)
    src = list(idx)
    inside = []
    for k in range(len(pads) // 2):
        d = len(shape) - 1 - k
        before = E.scalar(pads[2 * k])  # the amount after only sets the size
        src[d] = idx[d] - before
        inside += [sympy.Ge(src[d], 0), sympy.Lt(src[d], shape[d])]
    v = E.at(_src(E, n), tuple(src))
    return _cast(select(sympy.And(*inside), v, value), _dtype(n))


@rule(operator.getitem)
def _getitem(E, n, idx):
    parent, i = n.args
    t = parent.target
    shape = E.shape(parent.args[0])
    if t is _op("split", "Tensor") or t is _op("split_with_sizes"):
        dim = (parent.args[2] if len(parent.args) > 2 else parent.kwargs.get("dim", 0)) % len(shape)
        if t is _op("split", "Tensor"):
            start = E.scalar(parent.args[1]) * i
        else:
            start = sum((E.scalar(s) for s in parent.args[1][:i]), sympy.Integer(0))
        src = list(idx)
        src[dim] = idx[dim] + start
        return E.at(E.src(parent, parent.args[0]), tuple(src))
    if t is _op("unbind", "int"):
        dim = (parent.args[1] if len(parent.args) > 1 else 0) % len(shape)
        return E.at(E.src(parent, parent.args[0]), idx[:dim] + (sympy.Integer(i),) + idx[dim:])
    if t is _op("chunk"):
        raise Unsupported("chunk (expected decomposed to split)")
    raise Unsupported(f"getitem of {_opname(parent)}")


# -- gathers -------------------------------------------------------------------------------------

def _wrap(E, v, size):
    """A possibly negative index read Python-style."""
    v = num(v)
    b = E.dom.bounds(v)
    if b is not None and sympy.expand(b[0]).is_nonnegative:
        return v
    return sympy.Piecewise((v + size, v < 0), (v, True))


@rule(_op("index", "Tensor"))
def _index(E, n, idx):
    a = n.args[0]
    shape = E.shape(a)
    indices = list(n.args[1]) + [None] * (len(shape) - len(n.args[1]))
    adv = [k for k, t in enumerate(indices) if t is not None]
    if any(_dtype(indices[k]) in (torch.bool, torch.uint8) for k in adv):
        raise Unsupported("boolean index (handled by jagged_rules)")
    ishape = _broadcast_shape([E.shape(indices[k]) for k in adv])
    contiguous = adv == list(range(adv[0], adv[-1] + 1))
    m = len(ishape)
    if contiguous:
        lead = adv[0]
        iidx = idx[lead:lead + m]
        rest = list(idx[:lead]) + list(idx[lead + m:])
    else:
        iidx = idx[:m]
        rest = list(idx[m:])
    src, r = [], iter(rest)
    for k in range(len(shape)):
        if indices[k] is None:
            src.append(next(r))
        else:
            t = indices[k]
            v = E.at(E.src(n, t), _align(E, t, iidx))
            src.append(_wrap(E, v, shape[k]))
    return E.at(_src(E, n), tuple(src))


def _align(E, t, iidx):
    shape = E.shape(t)
    sub = iidx[len(iidx) - len(shape):]
    return tuple(sympy.Integer(0) if s == 1 else x for s, x in zip(shape, sub))


def _broadcast_shape(shapes):
    nd = max(len(s) for s in shapes)
    out = []
    for d in range(nd):
        dims = [s[len(s) - nd + d] for s in shapes if len(s) - nd + d >= 0]
        big = [x for x in dims if x != 1]
        out.append(big[0] if big else sympy.Integer(1))
    return tuple(out)


@rule(_op("index_select"))
def _index_select(E, n, idx):
    a, dim, index = n.args[:3]
    shape = E.shape(a)
    dim = dim % len(shape)
    v = E.at(E.src(n, index), (idx[dim],) if E.shape(index) else ())
    src = list(idx)
    src[dim] = _wrap(E, v, shape[dim])
    return E.at(_src(E, n), tuple(src))


@rule(_op("gather"))
def _gather(E, n, idx):
    a, dim, index = n.args[:3]
    shape = E.shape(a)
    dim = dim % len(shape)
    v = E.at(E.src(n, index), idx)
    src = list(idx)
    src[dim] = _wrap(E, v, shape[dim])
    return E.at(_src(E, n), tuple(src))


@rule(_op("take"))
def _take(E, n, idx):
    a, index = n.args[:2]
    v = _wrap(E, E.at(E.src(n, index), idx), sympy.Mul(*E.shape(a)))
    return E.at(_src(E, n), unravel(E, v, E.shape(a)))


@rule(_op("embedding"))
def _embedding(E, n, idx):
    w, indices = n.args[:2]
    k = len(E.shape(indices))
    v = E.at(E.src(n, indices), idx[:k])
    return E.at(E.src(n, w), (_wrap(E, v, E.shape(w)[0]),) + idx[k:])
