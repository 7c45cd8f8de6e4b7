"""The value-level attention proof (``attn_meaning``): the score chain at one symbolic position.

:class:`Chain` holds the score positions' logical coordinates (batch, heads, ``i``, ``j``) and the
element interpreter with the candidate's inputs as leaves (offsets, targets, scale, bias terms,
intervals); ``_chain_inputs`` reads every tensor the chain's data nodes take besides the scores as
an element expression of that position, which ``attn_meaning_cases`` splits into cases. A
subclass with other coordinates (``attn_packed.PackedChain``) proves other layouts the same way.
"""
from __future__ import annotations

import sympy
import torch

from . import attn_layout as lay
from .attn_find import meta_val
from .attn_meaning_domain import _domain, _leaf_fn, _offsets_leaf
from .core.domain import tgt
from .core.elements import Elements
from .core.semantics import hstu_valid

aten = torch.ops.aten


class Chain:
    """The score positions' logical coordinates and the interpreter the chain's inputs are read with."""

    def __init__(self, plan, sub):
        self.plan, self.sub = plan, sub
        self.dom = dom = _domain(plan, plan.q.src, sub.scale_leaf)
        self.b = dom.sequence("b")
        N = lay.to_expr(plan.N)
        self.i = dom.coord("i", N)
        self.j = dom.coord("j", N)
        self.axes = {"b": self.b, "i": self.i, "j": self.j}
        self.digits = {}
        for size, axis, stride in plan.Z:  # head digits: one symbol per mode of the scores' batch
            if axis == "b":
                continue
            h = dom.coord("h", size)
            self.axes[axis] = self.axes.get(axis, sympy.Integer(0)) + h * stride
        self._leaves(plan, sub)

    def _leaves(self, plan, sub) -> None:
        """The interpreter, with the candidate's inputs as leaves (offsets, num_targets, scale, bias, intervals)."""
        leaves = {plan.offsets: _offsets_leaf(plan)}
        if plan.num_targets is not None:
            leaves[plan.num_targets] = lambda idx: tgt(idx[0])
        self.scale_fn = None
        if sub.scale_leaf is not None:
            if meta_val(sub.scale_leaf).dim() == 0:
                self.scale_fn = sympy.Symbol("attn_scale")
                leaves[sub.scale_leaf] = lambda idx: self.scale_fn
            else:
                self.scale_fn = _leaf_fn("attn_scale")
                leaves[sub.scale_leaf] = lambda idx: self.scale_fn(idx[-1] if idx else 0)
        self.bias_fns = {}
        if plan.rab is not None:
            for k, t in enumerate(plan.rab.terms):
                f = _leaf_fn(f"rab{k}")
                self.bias_fns[t.node] = f
                leaves[t.node] = (lambda f: lambda idx: f(*idx))(f)
        self.iv_fn = None
        if plan.intervals is not None:
            self.iv_fn = _leaf_fn("iv", integer=True)
            leaves[plan.intervals.node] = lambda idx: self.iv_fn(*idx)
        self.E = Elements(self.dom, leaves)
        self.E._versions(plan.S.graph)

    def head(self):
        """The score position's linear head index (``0 .. H-1``), symbolic (``attn_layout.head_index``)."""
        h = sympy.Integer(0)
        for size, axis, stride in self.plan.head_modes:
            h = h * size + self.dom.mod(self.dom.floordiv(self.axes[axis], stride), size)
        return h

    def position(self, layout) -> tuple:
        """Coordinates of the logical element ``(b, heads, i, j)`` in a tensor of ``layout``; a mode of
        an axis the scores do not carry (a value feature) gets a digit symbol of its own."""
        out = []
        for dim in layout:
            x = sympy.Integer(0)
            for mode in dim:
                size, axis, stride = mode
                if axis is None:
                    digit = sympy.Integer(0)
                elif axis in self.axes:
                    digit = self.dom.mod(self.dom.floordiv(self.axes[axis], stride), size)
                else:
                    key = (size, axis, stride)
                    if key not in self.digits:
                        self.digits[key] = self.dom.coord("d", size)
                    digit = self.digits[key]
                x = x * size + digit
            out.append(sympy.expand(x))
        return tuple(out)

    def in_seq(self):
        n = self.dom.length(self.b)
        return [sympy.Lt(self.i, n), sympy.Lt(self.j, n)]

    def mask_args(self):
        """``(same sequence, i, j, n, t)``: ``valid(params)`` is the first and ``hstu_valid`` of the rest."""
        return (sympy.true, self.i, self.j, *_mask_symbols(self))

    def valid(self, params):
        """HSTU's mask at the score position, for mask parameters ``params``."""
        same, i, j, n, t = self.mask_args()
        return sympy.And(same, hstu_valid(i, j, n, t, params))

    sampled = True  # the mask's parameters are filtered on random (i, j, n, t) first


def _chain_inputs(ch: Chain):
    """``(data nodes in order, {(node, arg): element expression})`` of the score chain: the data nodes
    read the scores; the expressions are every other tensor they read, at their position."""
    plan, sub = ch.plan, ch.sub
    data = [n for n in sub.s_order if n in _sderived(sub, plan)]
    inputs = {}
    for n in data:
        pos = ch.position(sub.layouts[n])
        if n.target in (aten.tril.default, aten.triu.default):
            k = n.args[1] if len(n.args) > 1 else n.kwargs.get("diagonal", 0)
            i, j = pos[-2], pos[-1]
            inputs[(n, "keep")] = sympy.Le(j - i, k) if n.target is aten.tril.default else sympy.Ge(j - i, k)
            continue
        for a in _tensor_args(n):
            if a in ch.sderived:
                continue
            inputs[(n, a)] = ch.E.at(ch.E.src(n, a), ch.E.broadcast(a, pos))
    return data, inputs


def _sderived(sub, plan):
    return set(sub.layouts)


def _tensor_args(n):
    out = []
    for a in (*n.args, *n.kwargs.values()):
        for x in (a if isinstance(a, (list, tuple)) else [a]):
            if isinstance(x, torch.fx.Node) and isinstance(meta_val(x), torch.Tensor) and x not in out:
                out.append(x)
    return out


def _mask_symbols(ch):
    """The mask's free parameters other than i, j: the sequence's length and targets."""
    n = ch.dom.length(ch.b)
    t = tgt(ch.b) if ch.plan.num_targets is not None else None
    return n, t
