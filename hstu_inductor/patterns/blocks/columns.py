"""Which columns of the projection output each tensor holds, read from its layout.

The preprocess block's projection output ``P: [L, D]`` is a fresh contiguous tensor (a GEMM result).
Every view of it, however spelled (``split``, ``chunk``, slices, ``narrow``, ``view(L, 4, H, d)`` then
``unbind``/``select``/indexing, ``unflatten``, ``permute``, ...), is a fake tensor sharing ``P``'s storage,
and its sizes, strides and storage offset say exactly which elements of ``P`` it holds. One rule covers
every spelling: a view whose first dim runs over the rows of ``P`` (size ``L``, stride ``D``) and whose
other dims are contiguous among themselves, at offset ``a`` into the row, holds columns ``[a, a + n)`` of
every row in order: it is the *column block* ``[a, a + n)`` (``View.cols``). Views that interleave columns
(``P.view(L, H, 4, d)[:, :, i]``) or mix rows are not column blocks.

``view_tree(P)`` follows every view of ``P`` (``SPLIT_SPELLINGS``: index-based views, checked to share
``P``'s storage) and records, per view, what its other users do with it: read its values (``reads``),
apply silu to it (``acts``, ``ACTIVATION_SPELLINGS``; a silu over a block spanning several pieces starts a
tree of its own, whose views hold silu values), or write into it (``writes``: only a write *into* the view
counts; reading it as the source of an in-place op into another buffer is a read). ``preprocess.py``
cuts the tree into u, v, q, k by these column ranges.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Callable, Optional

import torch
from torch.fx import Node

from .common import _eq, _is, _same_layout, _static, _storage, _storages, _tval, _val, _writes_into

aten = torch.ops.aten

#: Index-based views: every element of the result is an element of the input chosen by its index alone
#: (not by strides, unlike ``as_strided`` or a dtype view), so they commute with elementwise ops such as
#: silu and replay on any tensor of the same shape. The names label the report's spelling.
SPLIT_SPELLINGS: dict = {
    target: name for name, targets in {
        "split": ("split_with_sizes.default", "unsafe_split_with_sizes.default"),
        "chunk": ("split.Tensor", "unsafe_split.Tensor"),
        "unbind": ("unbind.int",),
        "slices": ("slice.Tensor",),
        "narrow": ("narrow.default",),
        "select": ("select.int",),
        "view": ("view.default", "_unsafe_view.default", "reshape.default", "_reshape_alias.default"),
        "unsqueeze": ("unsqueeze.default",),
        "squeeze": ("squeeze.dim", "squeeze.dims", "squeeze.default"),
        "permute": ("t.default", "transpose.int", "permute.default"),
        "expand": ("expand.default",),
        "alias": ("alias.default", "detach.default"),
        "diagonal": ("diagonal.default",),
        "unfold": ("unfold.default",),
    }.items() for target in (getattr(getattr(aten, t.split(".")[0], None), t.split(".")[1], None)
                             for t in targets) if target is not None
}


# ---------------------------------------------------------------------------------------------
# Activation spellings. fn(user, same) -> act node | None: ``user`` (a user of the tensor read) starts
# ``silu(t)`` spelled some way, where ``same(x)`` says whether ``x`` holds the tensor's values.
# ---------------------------------------------------------------------------------------------
def _act_silu(n: Node, same: Callable) -> Optional[Node]:
    """``F.silu(t)`` / ``nn.SiLU()``."""
    return n if _is(n, aten.silu.default) and same(n.args[0]) else None


def _act_mul_sigmoid(n: Node, same: Callable) -> Optional[Node]:
    """``t * torch.sigmoid(t)`` (either operand order, ``t`` maybe two views of the same elements);
    ``n`` is the sigmoid or the mul."""
    if _is(n, aten.sigmoid.default) and same(n.args[0]):
        users = list(n.users)
        return _act_mul_sigmoid(users[0], same) if len(users) == 1 else None
    if _is(n, aten.mul.Tensor) and len(n.args) == 2:
        for x, s in (n.args, n.args[::-1]):
            if isinstance(x, Node) and same(x) and _is(s, aten.sigmoid.default) and same(s.args[0]) \
                    and len(s.users) == 1:
                return n
    return None


ACTIVATION_SPELLINGS: dict[str, Callable] = {
    "silu": _act_silu,
    "x*sigmoid(x)": _act_mul_sigmoid,
}


def _activation(user: Node, same: Callable) -> Optional[Node]:
    for fn in ACTIVATION_SPELLINGS.values():
        act = fn(user, same)
        if act is not None:
            return act
    return None


def _act_spelling(act: Node) -> str:
    return "silu" if _is(act, aten.silu.default) else "x*sigmoid(x)"


# ---------------------------------------------------------------------------------------------
# The view tree
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class View:
    node: Node
    parent: Optional["View"]
    cols: Optional[tuple]   # (a, b): the columns [a, b) of every row of P, in order; None: not a column block
    silu: bool              # holds silu of P's values (a view of a silu over a block of several pieces)
    children: list = dataclasses.field(default_factory=list)  # Views of this view
    reads: list = dataclasses.field(default_factory=list)     # users reading the values (graph output too)
    acts: list = dataclasses.field(default_factory=list)      # (act node, View tree of the act or None)
    writes: list = dataclasses.field(default_factory=list)    # users that may write into it

    def descendants(self, into_acts: bool = True):
        """This view and every view below it (with ``into_acts``, the trees of silu over them too)."""
        yield self
        for c in self.children:
            yield from c.descendants(into_acts)
        if into_acts:
            for _, sub in self.acts:
                if sub is not None:
                    yield from sub.descendants(into_acts)

    def path(self) -> list:
        """The views from the tree's top down to this one."""
        out, v = [], self
        while v is not None:
            out.append(v)
            v = v.parent
        return out[::-1]


@dataclasses.dataclass
class _Root:
    rows: object    # L (int or SymInt)
    width: int      # elements per row
    offset: int     # the root's storage offset
    base: int       # column of P where the root's row starts
    storage: object
    silu: bool


def _block(t: Optional[torch.Tensor], root: _Root) -> Optional[tuple]:
    """``(a, b)`` when ``t``, a view of ``root``'s storage, holds columns ``[a, b)`` of every row of P in
    row-major order: dim 0 runs over the rows (size L, stride = the row width), the other dims are
    contiguous among themselves, and the elements lie inside one row. None otherwise."""
    if not isinstance(t, torch.Tensor) or t.dim() < 1 or not _eq(t.shape[0], root.rows):
        return None
    n = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        s, st = _static(size), _static(stride)
        if s is None or st is None or (s != 1 and st != n):
            return None
        n *= s
    if n == 0:
        return None
    if _static(t.shape[0]) != 1 and _static(t.stride(0)) != root.width:
        return None
    off = _static(t.storage_offset())
    if off is None:
        return None
    off -= root.offset
    if off < 0 or off + n > root.width:
        return None
    return root.base + off, root.base + off + n


def _root(node: Node, base: int, silu: bool) -> Optional[_Root]:
    """The tree context of a fresh contiguous ``[L, ...]`` tensor whose rows hold P's columns from ``base``."""
    t = _tval(node)
    if t is None or t.dim() < 1:
        return None
    width = 1
    for s in t.shape[1:]:
        s = _static(s)
        if s is None:
            return None
        width *= s
    off, st = _static(t.storage_offset()), _storage(t)
    if off is None or st is None or width == 0:
        return None
    root = _Root(t.shape[0], width, off, base, st, silu)
    return root if _block(t, root) == (base, base + width) else None


def _same_values(x, node: Node) -> bool:
    """``x`` holds the elements of ``node``: the same node, or a view with the same storage and layout."""
    if x is node:
        return True
    a, b = _tval(x), _tval(node)
    return (a is not None and b is not None and a.shape == b.shape and _same_layout(a, b)
            and _storage(a) is not None and _storage(a) == _storage(b))


def _view_child(user: Node, parent: View, root: _Root) -> Optional[View]:
    """``user`` as a view of ``parent`` (an index-based view op on it, or an item of a multi-view), or None
    (for example a ``reshape`` that had to copy: its result has a storage of its own)."""
    if user.target is operator.getitem:
        if not isinstance(_val(parent.node), (list, tuple)):
            return None
    elif not (user.op == "call_function" and user.target in SPLIT_SPELLINGS and user.args
              and user.args[0] is parent.node):
        return None
    if _storages(user) != {root.storage}:
        return None
    return View(user, parent, _block(_tval(user), root), root.silu)


def _grow(view: View, root: _Root) -> None:
    for user in list(view.node.users):
        if user.op == "output":
            view.reads.append(user)
        elif _writes_into(user, view.node):
            view.writes.append(user)
        elif (child := _view_child(user, view, root)) is not None:
            view.children.append(child)
            _grow(child, root)
        elif not root.silu and (act := _activation(user, lambda x: _same_values(x, view.node))) is not None:
            if all(a is not act for a, _ in view.acts):  # x*sigmoid(x): sigmoid and mul both use the view
                sub = None
                if view.cols is not None:  # silu over a column block: its views hold silu values
                    sub_root = _root(act, view.cols[0], True)
                    if sub_root is not None and sub_root.width == view.cols[1] - view.cols[0]:
                        sub = View(act, view, view.cols, True)
                        _grow(sub, sub_root)
                view.acts.append((act, sub))
        else:
            view.reads.append(user)


def view_tree(node: Node) -> Optional[View]:
    """The tree of views of the contiguous 2-D tensor ``node`` (the projection output), or None."""
    t = _tval(node)
    root = _root(node, 0, False) if t is not None and t.dim() == 2 else None
    if root is None:
        return None
    top = View(node, None, (0, root.width), False)
    _grow(top, root)
    return top


def alias_writes(node: Node) -> list:
    """Users that may write into ``node`` or into a view of it (``node``: a fresh tensor, e.g. a silu result)."""
    root = _root(node, 0, True)
    if root is None:
        return [u for u in node.users if _writes_into(u, node)]
    top = View(node, None, (0, root.width), True)
    _grow(top, root)
    return [w for v in top.descendants() for w in v.writes]


def spelling_of(path: list) -> str:
    """The report's name for the views on ``path`` (from P to a piece): ``split``, ``view+unbind``, ..."""
    names = []
    for parent, v in zip(path, path[1:]):
        if v.node.target is operator.getitem or v.silu and not parent.silu:
            continue
        a, b = _tval(parent.node), _tval(v.node)
        if a is not None and b is not None and a.shape == b.shape and _same_layout(a, b):
            continue  # a view that changes nothing (``t[:, :]``, a full slice of the rows)
        name = SPLIT_SPELLINGS.get(v.node.target, str(v.node.target))
        if not names or names[-1] != name:
            names.append(name)
    return "+".join(names) or "view"
