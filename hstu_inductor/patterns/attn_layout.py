"""A small layout algebra for the attention prover: which logical element sits at each position.

A tensor reached from a *source* tensor through pure layout ops (view, permute, expand, ...) is
described by a :data:`Layout`: one tuple of *modes* per dimension, outer to inner. A mode
``(size, axis, stride)`` says that, inside its dimension, an index digit of radix ``size``
contributes ``digit * stride`` to the coordinate of logical ``axis`` (``axis=None``: broadcast,
the digit selects nothing). Sizes and strides are sympy expressions, so the same algebra runs on
symbolic shapes (``B``, ``L``) and on the concrete sizes of a probe.

Example: a padded ``[B, N, H, D]`` tensor with axes ``b, n, f0, f1`` viewed as ``[B*N, H*D]``
has layout ``(((B, b, 1), (N, n, 1)), ((H, f0, 1), (D, f1, 1)))``.

This module is shared by the attention rewriter only; it never mutates graphs.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Optional

import sympy
import torch

from .core.values import exact_divisions
from .prover import substitute

aten = torch.ops.aten

Mode = tuple  # (size: sympy.Expr, axis: Optional[str], stride: sympy.Expr)
Layout = tuple  # tuple[tuple[Mode, ...], ...]


class LayoutError(Exception):
    """A layout op the algebra cannot express (the caller declines the candidate)."""


#: Optional rewrite applied to every size expression (see :func:`canonical`).
_CANON: Optional[Callable] = None


@contextlib.contextmanager
def canonical(fn: Callable):
    """Apply ``fn`` to every size expression read by the algebra inside the block. Used by the
    delta-attention prover to rename ``R // B`` (delta rows per sequence, a floor division of two
    symbols in dynamic graphs) to one fresh symbol, with ``R := B * delta``."""
    global _CANON
    old, _CANON = _CANON, fn
    try:
        yield
    finally:
        _CANON = old


def to_expr(x) -> sympy.Expr:
    if isinstance(x, torch.SymInt):
        e = exact_divisions(x.node.expr)
    elif isinstance(x, (int, bool)):
        e = sympy.Integer(int(x))
    elif isinstance(x, sympy.Expr):
        e = x
    else:
        raise LayoutError(f"not a size: {x!r}")
    return _CANON(e) if _CANON is not None else e


def eq(a, b) -> bool:
    return sympy.expand(to_expr(a) - to_expr(b)) == 0


def _divides(d, n) -> Optional[sympy.Expr]:
    """``n / d`` if it is a polynomial (an exact integer quotient for every value), else None."""
    q = sympy.cancel(to_expr(n) / to_expr(d))
    num, den = sympy.fraction(q)
    if den == 1 and (not q.is_number or (q.is_Integer and q > 0)):
        return q
    return None


def dim_size(dim) -> sympy.Expr:
    out = sympy.Integer(1)
    for size, _, _ in dim:
        out = out * size
    return out


def normalize_dim(dim) -> tuple:
    """Drop size-1 modes and merge adjacent modes of one axis that form a single radix."""
    modes = [m for m in dim if not eq(m[0], 1)]
    out: list = []
    for m in modes:
        if out:
            size0, axis0, stride0 = out[-1]
            if axis0 == m[1] and (axis0 is None or eq(stride0, m[2] * m[0])):
                out[-1] = (size0 * m[0], axis0, m[2] if axis0 is not None else sympy.Integer(0))
                continue
        out.append(m)
    return tuple(out)


def normalize(layout) -> tuple:
    return tuple(normalize_dim(d) for d in layout)


def source_layout(sizes, axes) -> tuple:
    """The layout of a source tensor whose dimension ``d`` is logical axis ``axes[d]``."""
    return tuple(((to_expr(s), a, sympy.Integer(1)),) if not eq(s, 1) else () for s, a in zip(sizes, axes))


def view(layout, sizes) -> tuple:
    modes = [m for d in layout for m in d if not eq(m[0], 1)]
    total = sympy.Integer(1)
    for m in modes:
        total = total * m[0]
    sizes = [to_expr(s) for s in sizes]
    if any(eq(s, -1) for s in sizes):
        known = sympy.Integer(1)
        for s in sizes:
            if not eq(s, -1):
                known = known * s
        rest = _divides(known, total)
        if rest is None:
            raise LayoutError("cannot infer -1 in view")
        sizes = [rest if eq(s, -1) else s for s in sizes]
    out = []
    for t in sizes:
        dim, rem = [], t
        while not eq(rem, 1):
            if not modes:
                raise LayoutError("view: sizes do not match")
            size, axis, stride = modes[0]
            if eq(size, rem):
                dim.append(modes.pop(0))
                rem = sympy.Integer(1)
            elif (q := _divides(size, rem)) is not None:  # the whole mode fits, more to take
                dim.append(modes.pop(0))
                rem = q
            elif (q := _divides(rem, size)) is not None:  # split the mode: outer part here
                dim.append((rem, axis, stride * q if axis is not None else sympy.Integer(0)))
                modes[0] = (q, axis, stride)
                rem = sympy.Integer(1)
            else:
                raise LayoutError(f"view: cannot split a mode of size {size} into {rem}")
        out.append(tuple(dim))
    if modes:
        raise LayoutError("view: sizes do not match")
    return tuple(out)


def permute(layout, perm) -> tuple:
    n = len(layout)
    perm = [p % n for p in perm]
    if sorted(perm) != list(range(n)):
        raise LayoutError("bad permutation")
    return tuple(layout[p] for p in perm)


def expand(layout, sizes) -> tuple:
    sizes = list(sizes)
    lead = len(sizes) - len(layout)
    if lead < 0:
        raise LayoutError("expand to fewer dims")
    out = []
    for i, s in enumerate(sizes):
        if i < lead:
            out.append(() if eq(s, 1) else ((to_expr(s), None, sympy.Integer(0)),))
            continue
        dim = layout[i - lead]
        if eq(s, -1) or eq(s, dim_size(dim)):
            out.append(dim)
        elif eq(dim_size(dim), 1):
            out.append(((to_expr(s), None, sympy.Integer(0)),))
        else:
            raise LayoutError("expand of a non-singleton dim")
    return tuple(out)


def _sizes_of(node) -> list:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise LayoutError(f"{node} has no tensor value")
    return [to_expr(s) for s in val.shape]


def arg_value(a):
    """A node argument with nodes replaced by their traced values (through lists / tuples)."""
    if isinstance(a, torch.fx.Node):
        return a.meta.get("val")
    if isinstance(a, (list, tuple)):
        return type(a)(arg_value(x) for x in a)
    return a


#: ATen ops that only move/broadcast elements (values unchanged).
LAYOUT_OPS = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
    aten.transpose.int, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.squeeze.default, aten.expand.default, aten.clone.default, aten.alias.default,
    aten.contiguous.default, aten._to_copy.default, aten.slice.Tensor, aten.lift_fresh_copy.default,
    aten.detach.default,
}


def is_layout_node(node) -> bool:
    if node.op != "call_function" or node.target not in LAYOUT_OPS:
        return False
    if node.target is aten._to_copy.default:
        src = node.args[0].meta.get("val")
        out = node.meta.get("val")
        return isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and src.dtype == out.dtype \
            and src.device == out.device
    if node.target is aten.slice.Tensor:
        try:
            apply(node, None, check_only=True)
        except LayoutError:
            return False
    return True


def apply(node, layout, check_only=False):
    """Layout of ``node``'s output given the layout of its first argument."""
    t = node.target
    args = [arg_value(a) for a in node.args]
    if t is aten.slice.Tensor:  # only the identity slice
        src = node.args[0].meta.get("val")
        dim = args[1] if len(args) > 1 else 0
        start = args[2] if len(args) > 2 else None
        end = args[3] if len(args) > 3 else None
        step = args[4] if len(args) > 4 else 1
        size = src.shape[dim]
        if (start in (None, 0)) and step == 1 and (end is None or (isinstance(end, int) and end >= 2 ** 62)
                                                   or (not isinstance(end, torch.SymInt) and eq(end, size))):
            return layout
        raise LayoutError("slice is not the identity")
    if check_only:
        return None
    if t in (aten.clone.default, aten.alias.default, aten.contiguous.default, aten._to_copy.default,
             aten.lift_fresh_copy.default, aten.detach.default):
        return layout
    if t in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        return view(layout, args[1])
    if t is aten.permute.default:
        return permute(layout, args[1])
    if t is aten.transpose.int:
        n = len(layout)
        d0, d1 = args[1] % n, args[2] % n
        perm = list(range(n))
        perm[d0], perm[d1] = d1, d0
        return permute(layout, perm)
    if t is aten.t.default:
        return permute(layout, [1, 0]) if len(layout) == 2 else layout
    if t is aten.unsqueeze.default:
        n = len(layout) + 1
        d = args[1] % n
        return layout[:d] + ((),) + layout[d:]
    if t in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
        n = len(layout)
        if t is aten.squeeze.default:
            dims = [i for i in range(n) if eq(dim_size(layout[i]), 1)]
        else:
            dims = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
            dims = [d % n for d in dims if eq(dim_size(layout[d % n]), 1)]
        return tuple(d for i, d in enumerate(layout) if i not in dims)
    if t is aten.expand.default:
        return expand(layout, args[1])
    raise LayoutError(f"not a layout op: {t}")


def narrow(layout, dim, start, stop, axis_size):
    """Keep index digits ``start <= d < stop`` of dimension ``dim`` (a feature slice/select).

    Expressible only when ``dim`` is one mode ``(size, axis, stride)`` carrying the outermost digit
    of ``axis`` (whose modes tile ``[0, axis_size)``): the kept elements are then the contiguous
    coordinate range ``[start*stride, stop*stride)`` of ``axis``, i.e. a narrowed *source*.
    Returns ``(layout relative to the narrowed source, (axis, first coordinate, new axis size))``."""
    modes = normalize_dim(layout[dim])
    if len(modes) != 1 or modes[0][1] is None:
        raise LayoutError("slice of a dimension that is not one logical axis digit")
    size, axis, stride = modes[0]
    if not (0 <= start < stop <= int(size)):
        raise LayoutError("slice out of range")
    same = [m for d in layout for m in normalize_dim(d) if m[1] == axis]
    if not tiles(same, axis_size) or any(int(m[2]) > int(stride) for m in same):
        raise LayoutError("slice does not select a contiguous range of its axis")
    new = list(layout)
    new[dim] = ((sympy.Integer(stop - start), axis, stride),)
    return tuple(new), (axis, int(start * stride), int((stop - start) * stride))


# ---------------------------------------------------------------------------------------------
# Concrete evaluation helpers (probe sizes are plain ints)


def concretize(layout, binding: dict) -> tuple:
    """Substitute symbol values; returns a layout of python ints."""
    def c(e):
        e = substitute(to_expr(e), binding)
        if not e.is_Integer:
            raise LayoutError(f"unbound size {e}")
        return int(e)

    return tuple(tuple((c(s), a, c(st)) for s, a, st in d) for d in layout)


class _Coords(dict):
    """An axis the layout does not carry had size 1 (normalisation drops size-1 modes, e.g. the
    sequence axis of a batch of one): its coordinate is 0 everywhere."""

    def __missing__(self, axis):
        return torch.zeros((), dtype=torch.int64)


def head_count(head_modes) -> int:
    """The number of heads of a candidate's score modes (``plan.head_modes``)."""
    return math.prod(int(m[0]) for m in head_modes)


def head_index(head_modes, crd):
    """The linear head index (``0 .. H-1``) at logical coordinates ``crd`` (:func:`coords`)."""
    h = 0
    for size, axis, stride in head_modes:
        h = h * int(size) + (crd[axis] // int(stride)) % int(size)
    return h


def coords(layout, shape) -> dict:
    """For every position of a tensor of ``shape`` with (concrete) ``layout``: its logical
    coordinate per axis, as int64 tensors broadcastable to ``shape`` (0 for an axis it does not carry)."""
    out: dict = _Coords()
    nd = len(shape)
    for d, dim in enumerate(layout):
        idx = torch.arange(shape[d], dtype=torch.int64).view([-1 if i == d else 1 for i in range(nd)])
        weight = 1
        for size, axis, stride in reversed(dim):
            if axis is not None:
                digit = (idx // weight) % size
                out[axis] = out.get(axis, 0) + digit * stride
            weight *= size
    return out


def gather(tensor, layout, crd: dict):
    """``tensor`` (concrete layout) read at logical coordinates ``crd`` (broadcastable tensors).
    Axes of ``crd`` that the layout does not carry are ignored (broadcast)."""
    idx = []
    for dim in layout:
        acc = 0
        weight = 1
        for size, axis, stride in reversed(dim):
            if axis is not None and axis in crd:
                acc = acc + ((crd[axis] // stride) % size) * weight
            weight *= size
        idx.append(acc if isinstance(acc, torch.Tensor) else torch.zeros((), dtype=torch.int64))
    idx = torch.broadcast_tensors(*idx) if idx else idx
    return tensor[tuple(idx)]


def axis_modes(layout, pred=lambda axis: True) -> list:
    return [m for d in layout for m in d if m[1] is not None and pred(m[1])]


def tiles(modes, size) -> bool:
    """Do ``modes`` (all of one axis) enumerate ``0..size-1`` exactly once?"""
    ms = sorted(modes, key=lambda m: sympy.default_sort_key(m[2]))
    expect = sympy.Integer(1)
    for s, _, st in sorted(ms, key=lambda m: _stride_order(m[2])):
        if not eq(st, expect):
            return False
        expect = expect * s
    return eq(expect, size)


def _stride_order(st):
    try:
        return int(st)
    except TypeError:
        return math.inf
