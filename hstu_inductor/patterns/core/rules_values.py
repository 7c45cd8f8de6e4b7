"""Value rules of pointwise and creation ops (integers and booleans exact, floats symbolic).

Each rule maps an output element to its inputs' elements at the same (broadcast) coordinates and
combines them the way torch does: integer division floors, float-to-integer casts truncate toward
zero, a boolean used as a number is 0 or 1.
"""
from __future__ import annotations

import sympy
import torch

from .elements import _dtype, _kw, _op, _opname, _src, rule
from .values import Unsupported, boolean, is_bool, num, select

aten = torch.ops.aten


def _binary(fn):
    def r(E, n, idx):
        a = E.arg(n, n.args[0], idx)
        b = E.arg(n, n.args[1], idx)
        return fn(E, n, a, b)
    return r


def _is_int_dtype(dt) -> bool:
    return dt is not None and not dt.is_floating_point and dt is not torch.bool


def _add(E, n, a, b):
    alpha = _kw(n, "alpha", 1)
    if _dtype(n) is torch.bool:
        return sympy.Or(boolean(a), boolean(b))
    return num(a) + E.scalar(alpha) * num(b)


def _sub(E, n, a, b):
    alpha = _kw(n, "alpha", 1)
    return num(a) - E.scalar(alpha) * num(b)


def _rsub(E, n, a, b):
    alpha = _kw(n, "alpha", 1)
    return num(b) - E.scalar(alpha) * num(a)


def _mul(E, n, a, b):
    if _dtype(n) is torch.bool:
        return sympy.And(boolean(a), boolean(b))
    return num(a) * num(b)


def _div(E, n, a, b):
    mode = _kw(n, "rounding_mode", None)
    a, b = num(a), num(b)
    if mode is None:
        return a / b
    if mode == "floor":
        return _floordiv(E, a, b)
    if mode == "trunc":
        q = a / b
        return sympy.Piecewise((sympy.floor(q), q >= 0), (sympy.ceiling(q), True))
    raise Unsupported(f"division with rounding mode {mode!r}")


def _floordiv(E, a, b):
    if isinstance(b, sympy.Expr) and E.dom.pos_(b):
        return E.dom.floordiv(a, b)
    return sympy.floor(a / b)


def _remainder(E, n, a, b):
    a, b = num(a), num(b)
    if isinstance(b, sympy.Expr) and E.dom.pos_(b):
        return E.dom.mod(a, b)
    return sympy.Mod(a, b)


for _name, _fn in (("add", _add), ("sub", _sub), ("mul", _mul), ("div", _div), ("rsub", _rsub)):
    rule(_op(_name, "Tensor"), _op(_name, "Scalar"))(_binary(_fn))
rule(_op("div", "Tensor_mode"), _op("div", "Scalar_mode"))(_binary(_div))
rule(_op("floor_divide"), _op("floor_divide", "Scalar"))(_binary(lambda E, n, a, b: _floordiv(E, num(a), num(b))))
rule(_op("remainder", "Tensor"), _op("remainder", "Scalar"))(_binary(_remainder))
rule(_op("minimum"), _op("fmin"))(_binary(lambda E, n, a, b: sympy.Min(num(a), num(b))))
rule(_op("maximum"), _op("fmax"))(_binary(lambda E, n, a, b: sympy.Max(num(a), num(b))))

_CMP = {"eq": sympy.Eq, "ne": sympy.Ne, "lt": sympy.Lt, "le": sympy.Le, "gt": sympy.Gt, "ge": sympy.Ge}
for _name, _fn in _CMP.items():
    rule(_op(_name, "Tensor"), _op(_name, "Scalar"))(
        _binary(lambda E, n, a, b, f=_fn: _compare(f, a, b)))


def _compare(f, a, b):
    if is_bool(a) and is_bool(b) and f in (sympy.Eq, sympy.Ne):
        eq = sympy.Equivalent(a, b)
        return eq if f is sympy.Eq else sympy.Not(eq)
    return f(num(a), num(b))


def _logic(f):
    return _binary(lambda E, n, a, b: f(boolean(a), boolean(b)) if _dtype(n) is torch.bool else _int_bits(n))


def _int_bits(n):
    raise Unsupported(f"bitwise {_opname(n)} on integers")


rule(_op("bitwise_and", "Tensor"), _op("bitwise_and", "Scalar"), _op("logical_and"))(_logic(sympy.And))
rule(_op("bitwise_or", "Tensor"), _op("bitwise_or", "Scalar"), _op("logical_or"))(_logic(sympy.Or))
rule(_op("bitwise_xor", "Tensor"), _op("bitwise_xor", "Scalar"), _op("logical_xor"))(_logic(sympy.Xor))


@rule(_op("bitwise_not"), _op("logical_not"))
def _not(E, n, idx):
    a = E.arg(n, n.args[0], idx)
    if n.target is _op("bitwise_not") and _dtype(n) is not torch.bool:
        raise Unsupported("bitwise not on integers")
    return sympy.Not(boolean(a))


@rule(_op("neg"))
def _neg(E, n, idx):
    return -num(E.arg(n, n.args[0], idx))


@rule(_op("abs"))
def _abs(E, n, idx):
    return sympy.Abs(num(E.arg(n, n.args[0], idx)))


@rule(_op("reciprocal"))
def _reciprocal(E, n, idx):
    return 1 / num(E.arg(n, n.args[0], idx))


@rule(_op("sign"))
def _sign(E, n, idx):
    return sympy.sign(num(E.arg(n, n.args[0], idx)))


def _clamp_value(E, x, lo, hi):
    x = num(x)
    if lo is not None:
        x = sympy.Max(x, num(lo))
    if hi is not None:
        x = sympy.Min(x, num(hi))
    return x


@rule(_op("clamp"), _op("clamp", "Tensor"))
def _clamp(E, n, idx):
    x = E.arg(n, n.args[0], idx)
    lo = _kw(n, "min", None)
    hi = _kw(n, "max", None)
    lo = None if lo is None else E.arg(n, lo, idx)
    hi = None if hi is None else E.arg(n, hi, idx)
    return _clamp_value(E, x, lo, hi)


@rule(_op("clamp_min"), _op("clamp_min", "Tensor"))
def _clamp_min(E, n, idx):
    return _clamp_value(E, E.arg(n, n.args[0], idx), E.arg(n, n.args[1], idx), None)


@rule(_op("clamp_max"), _op("clamp_max", "Tensor"))
def _clamp_max(E, n, idx):
    return _clamp_value(E, E.arg(n, n.args[0], idx), None, E.arg(n, n.args[1], idx))


@rule(_op("where", "self"), _op("where", "ScalarSelf"), _op("where", "ScalarOther"), _op("where", "Scalar"))
def _where(E, n, idx):
    c, a, b = (E.arg(n, x, idx) for x in n.args[:3])
    return _cast(select(c, a, b), _dtype(n))


@rule(_op("masked_fill", "Scalar"), _op("masked_fill", "Tensor"), _op("masked_fill_", "Scalar"),
      _op("masked_fill_", "Tensor"))
def _masked_fill(E, n, idx):
    x, m, v = (E.arg(n, a, idx) for a in n.args[:3])
    return _cast(select(m, v, x), _dtype(n))


def _cast(e, dt):
    """``e`` converted to the element type of ``dt`` (torch's conversion rules)."""
    if dt is None:
        return e
    if dt is torch.bool:
        return boolean(e)
    e = num(e)
    if dt.is_floating_point:
        return e
    if isinstance(e, sympy.Piecewise):
        return sympy.Piecewise(*[(_cast(v, dt), c) for v, c in e.args])
    # float -> integer truncates toward zero
    if isinstance(e, sympy.Expr) and e.is_number and not e.is_Integer and e.is_finite:
        return sympy.Integer(int(e))
    if isinstance(e, sympy.Expr) and (e.is_integer or not _has_float(e)):
        return e
    return sympy.Piecewise((sympy.floor(e), e >= 0), (sympy.ceiling(e), True))


def _has_float(e) -> bool:
    return any(isinstance(a, sympy.Float) for a in e.atoms(sympy.Number)) or bool(
        [f for f in e.atoms(sympy.Function) if f.func.__name__ in ("log", "exp", "sqrt")])


@rule(_op("_to_copy"), _op("clone"), _op("alias"), _op("detach"), _op("lift_fresh_copy"), _op("contiguous"))
def _copy(E, n, idx):
    return _cast(E.at(_src(E, n), idx), _dtype(n))


@rule(_op("fill_", "Scalar"), _op("fill", "Scalar"), _op("zero_"), _op("zero"))
def _fill(E, n, idx):
    v = 0 if n.target in (_op("zero_"), _op("zero")) else n.args[1]
    return _cast(E.scalar(v), _dtype(n))


# -- creation -------------------------------------------------------------------------------------

@rule(_op("arange"), _op("arange", "start"), _op("arange", "start_step"))
def _arange(E, n, idx):
    if n.target is _op("arange"):
        start, step = 0, 1
    else:
        start = n.args[0]
        step = n.args[2] if len(n.args) > 2 else n.kwargs.get("step", 1)
    return _cast(E.scalar(start) + E.scalar(step) * idx[0], _dtype(n))


@rule(_op("zeros"), _op("zeros_like"), _op("new_zeros"))
def _zeros(E, n, idx):
    return _cast(sympy.Integer(0), _dtype(n))


@rule(_op("ones"), _op("ones_like"), _op("new_ones"))
def _ones(E, n, idx):
    return _cast(sympy.Integer(1), _dtype(n))


@rule(_op("full"), _op("full_like"), _op("new_full"))
def _full(E, n, idx):
    return _cast(E.scalar(n.args[1]), _dtype(n))


@rule(_op("scalar_tensor"))
def _scalar_tensor(E, n, idx):
    return _cast(E.scalar(n.args[0]), _dtype(n))


@rule(_op("eye"), _op("eye", "m"))
def _eye(E, n, idx):
    return _cast(sympy.Eq(idx[0], idx[1]), _dtype(n))


@rule(_op("tril"), _op("triu"))
def _tri(E, n, idx):
    k = E.scalar(n.args[1] if len(n.args) > 1 else n.kwargs.get("diagonal", 0))
    i, j = idx[-2], idx[-1]
    keep = sympy.Le(j - i, k) if n.target is _op("tril") else sympy.Ge(j - i, k)
    x = E.at(_src(E, n), idx)
    return _cast(select(keep, x, sympy.Integer(0) if not is_bool(x) else sympy.false), _dtype(n))


def _reduced_dims(n, ndim) -> list:
    """The dims a reduction reduces: all without a dim argument (``max(x)``), else the ones named."""
    dims = n.args[1] if len(n.args) > 1 and not isinstance(n.args[1], torch.dtype) else n.kwargs.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(ndim))
    dims = [dims] if isinstance(dims, int) else list(dims)
    return sorted(d % ndim for d in dims)


@rule(_op("max"), _op("min"), _op("amax"), _op("amin"), _op("sum"), _op("mean"), _op("max", "dim"),
      _op("min", "dim"), _op("mean", "dim"), _op("prod"))
def _batch_reduction(E, n, idx):
    a = n.args[0]
    shape = E.shape(a)
    dims = _reduced_dims(n, len(shape))
    if n.target not in (_op("max", "dim"), _op("min", "dim")) and all(sympy.sympify(shape[d]) == 1 for d in dims):
        # over size-1 dims only (a batch of one): the element itself
        keep = bool(n.args[2]) if len(n.args) > 2 and isinstance(n.args[2], bool) else bool(n.kwargs.get("keepdim"))
        it = iter(idx)
        src = []
        for d in range(len(shape)):
            if d in dims:
                if keep:
                    next(it)
                src.append(sympy.Integer(0))
            else:
                src.append(next(it))
        return _cast(E.at(_src(E, n), tuple(src)), _dtype(n))
    raise Unsupported(f"{_opname(n)} ({n.name}) reduces over the batch: a value of the whole batch, neither a "
                      f"constant nor proportional to 1/N")
