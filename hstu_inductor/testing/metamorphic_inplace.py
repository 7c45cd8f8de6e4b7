"""Metamorphic transformation ``inplace``: out-of-place ops on a fresh buffer made in-place, and
in-place ops made out-of-place.

Exact, because the mutation is never seen outside: the mutated buffer is one the graph allocated
itself (never an input, a parameter or a view of one) and nothing else reads, or a fresh clone.
"""
from __future__ import annotations

import operator
import random

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from .metamorphic_graph import _apply, _fn, _method, _name, _note, _replace, _tensor

_BUFFER_OPS = ("index_copy", "index_put", "scatter", "scatter_add", "masked_fill", "masked_scatter",
               "index_add", "index_fill", "scatter_reduce")
_FACTORIES = (torch.zeros, torch.ones, torch.full, torch.empty, torch.zeros_like, torch.ones_like,
              torch.full_like, torch.empty_like, torch.clone, torch.tensor, torch.arange)
_FACTORY_METHODS = ("new_zeros", "new_ones", "new_full", "new_empty", "clone")
# ops that always return a new tensor and whose backward does not save their output
_ALLOCATING = _FACTORIES + (operator.mul, operator.truediv, operator.add, operator.sub, torch.einsum,
                            torch.matmul, operator.matmul, torch.bmm, F.silu, torch.where)
_ARITH_INPLACE = {operator.mul: "mul_", operator.truediv: "div_", operator.add: "add_", operator.sub: "sub_"}
_INPLACE_TWINS = tuple(op + "_" for op in _BUFFER_OPS) + ("zero_", "fill_", "mul_", "div_", "add_", "sub_")


def _fresh(n) -> bool:
    """A tensor this graph allocated itself (never an input, a parameter or a view of one), so
    mutating it is invisible outside its users."""
    if not isinstance(n, Node) or _tensor(n) is None:
        return False
    if n.op == "call_function":
        return n.target in _ALLOCATING and not n.kwargs.get("inplace", False)
    if n.op == "call_method":
        if n.target in _FACTORY_METHODS + _BUFFER_OPS:
            return True
        if n.target in ("zero_", "fill_"):
            return _fresh(n.args[0])
    return False


def _buffer_op_name(n: Node) -> str | None:
    if n.op == "call_method" and n.target in _BUFFER_OPS:
        return n.target
    if n.op == "call_function" and getattr(n.target, "__name__", None) in _BUFFER_OPS \
            and getattr(torch, n.target.__name__, None) is n.target:
        return n.target.__name__
    return None


def _to_inplace(gm: GraphModule, n: Node) -> bool:
    """``buf.op(...)`` -> ``buf.op_(...)`` on a fresh buffer used only here, else on ``buf.clone()``;
    ``a * b`` (and / + -) -> ``a.mul_(b)`` when ``a`` is fresh, used only here and keeps its shape and dtype."""
    name = _buffer_op_name(n)
    self = n.args[0] if n.args else None
    if name is not None and _tensor(self) is not None:
        target = self if _fresh(self) and len(self.users) == 1 else _method(gm, n, "clone", self)
        new = _method(gm, n, name + "_", target, *n.args[1:], **n.kwargs)
        _note(gm, f"inplace: {n.name} = {name}(...) -> {'' if target is self else 'clone().'}{name}_")
        _replace(gm, n, new)
        return True
    if n.op == "call_function" and n.target in _ARITH_INPLACE and not n.kwargs and len(n.args) == 2:
        a, b = n.args
        ta, tn = _tensor(a), _tensor(n)
        if (ta is not None and tn is not None and _fresh(a) and len(a.users) == 1 and a is not b
                and ta.dtype == tn.dtype and ta.shape == tn.shape and ta.is_floating_point()):
            new = _method(gm, n, _ARITH_INPLACE[n.target], a, b, like=n)
            _note(gm, f"inplace: {n.name} = {n.target.__name__}(a, b) -> a.{_ARITH_INPLACE[n.target]}(b)")
            _replace(gm, n, new)
            return True
    return False


def _to_out_of_place(gm: GraphModule, n: Node) -> bool:
    """``buf.op_(...)`` -> ``buf.op(...)`` (``zero_`` -> ``zeros_like``, ``fill_`` -> ``full_like``)
    when ``buf`` is fresh and nothing but this op reads it."""
    if not (n.op == "call_method" and n.target in _INPLACE_TWINS and n.args):
        return False
    self = n.args[0]
    if not (_fresh(self) and len(self.users) == 1):
        return False
    if n.target == "zero_":
        new = _fn(gm, n, torch.zeros_like, self)
    elif n.target == "fill_":
        new = _fn(gm, n, torch.full_like, self, *n.args[1:], **n.kwargs)
    else:
        new = _method(gm, n, n.target[:-1], *n.args, **n.kwargs)
    _note(gm, f"inplace: {n.name} = {n.target}(...) -> out of place {_name(new)}")
    n.replace_all_uses_with(new)
    gm.graph.erase_node(n)  # in-place, so _erase_dead keeps it; nothing reads its input any more
    return True


def inplace(gm: GraphModule, rng: random.Random) -> int:
    """Out-of-place ops with an in-place twin rewritten in place on a fresh buffer
    (``zeros(...).index_copy(0, i, x)`` -> ``buf.index_copy_(0, i, x)``, ``t.masked_fill(m, v)`` ->
    ``t.clone().masked_fill_(m, v)``, ``silu(s) / N`` -> ``silu(s).div_(N)``), and in-place ops back
    to out-of-place where the buffer is fresh and read by nobody else (``new_empty(s).zero_()`` ->
    ``zeros_like(new_empty(s))``). Exact."""
    sites = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    sites = [n for n in sites if _buffer_op_name(n) or n.target in _ARITH_INPLACE or
             (n.op == "call_method" and n.target in _INPLACE_TWINS)]
    return _apply(gm, rng, sites, lambda n: _to_out_of_place(gm, n) if n.op == "call_method"
                  and n.target in _INPLACE_TWINS else _to_inplace(gm, n))
