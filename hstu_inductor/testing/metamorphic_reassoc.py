"""Metamorphic transformation ``reassoc``: integer / boolean chains re-associated and commuted.

Exact: integers form a commutative ring mod 2^k and ``&`` / ``|`` / ``^`` are associative and
commutative, so any bracketing and order of a chain's terms gives the same values. Float sums are
never touched (their rounding depends on the order).
"""
from __future__ import annotations

import operator
import random

import torch
from torch.fx import GraphModule, Node

from .metamorphic_graph import (
    _ADD, _INT_DTYPES, _MUL, _SUB, _apply, _ev, _fn, _is_bool_tensor, _is_int_tensor, _note, _replace, _tensor)

_AND, _OR, _XOR = (operator.and_,), (operator.or_,), (operator.xor,)


def _chain_kind(n) -> str | None:
    """Which chain an integer/boolean binary node belongs to: ``"addsub"`` (signed terms), or an
    associative-commutative op (``"mul"``, ``"and"``, ``"or"``, ``"xor"``)."""
    if not (isinstance(n, Node) and n.op == "call_function" and len(n.args) == 2 and not n.kwargs):
        return None
    t = _tensor(n)
    if t is None:
        return None
    if t.dtype in _INT_DTYPES and n.target in _ADD + _SUB:
        return "addsub"
    if t.dtype in _INT_DTYPES + (torch.bool,):
        for kind, targets in (("mul", _MUL), ("and", _AND), ("or", _OR), ("xor", _XOR)):
            if n.target in targets:
                return kind
    return None


def _leaf_ok(a, dtype) -> bool:
    """A chain term whose order cannot change the result dtype: a tensor of the chain's dtype, a
    SymInt node or a Python int (a bool scalar only in a bool chain)."""
    if isinstance(a, Node):
        t = _ev(a)
        return (isinstance(t, torch.Tensor) and t.dtype == dtype) or isinstance(t, torch.SymInt)
    return isinstance(a, int) and (not isinstance(a, bool) or dtype == torch.bool)


def _absorbed(n: Node) -> bool:
    """True if ``n`` is an inner node of a larger chain (its only user continues the chain)."""
    if len(n.users) != 1:
        return False
    (u,) = n.users
    return _chain_kind(u) == _chain_kind(n) and _tensor(u).dtype == _tensor(n).dtype


def _terms(n: Node, sign: int, kind: str, dtype, out: list) -> None:
    """Flatten a chain into ``(sign, term)`` pairs (sign is +1 except for subtracted add/sub terms)."""
    a, b = n.args
    s = -1 if n.target in _SUB else 1
    for operand, sg in ((a, sign), (b, sign * s)):
        if (isinstance(operand, Node) and len(operand.users) == 1 and _chain_kind(operand) == kind
                and _tensor(operand).dtype == dtype):
            _terms(operand, sg, kind, dtype, out)
        else:
            out.append((sg, operand))


def _tree_sig(n, kind: str, dtype):
    """The shape of the original chain, to tell a real change from the same tree redrawn."""
    if (isinstance(n, Node) and _chain_kind(n) == kind and _tensor(n).dtype == dtype):
        return (n.target in _SUB, _tree_sig(n.args[0], kind, dtype), _tree_sig(n.args[1], kind, dtype))
    return id(n) if isinstance(n, Node) else ("c", n)


def _draw_tree(terms: list, rng: random.Random):
    """A random bracketing of ``terms`` (already in the chosen order) as a nested plan:
    ``(is_sub, left, right)`` or ``(sign, term)`` at the leaves. The first term of every group is a
    node, so no node computes a Python constant; a group after a minus has its signs flipped."""
    if len(terms) == 1:
        return terms[0]
    splits = [k for k in range(1, len(terms)) if isinstance(terms[k][1], Node)] or [len(terms) - 1]
    k = rng.choice(splits)
    right = terms[k:]
    is_sub = right[0][0] < 0
    if is_sub:
        right = [(-s, t) for s, t in right]
    return (is_sub, _draw_tree(terms[:k], rng), _draw_tree(right, rng))


def _plan_sig(plan):
    if len(plan) == 3:
        return (plan[0], _plan_sig(plan[1]), _plan_sig(plan[2]))
    sign, t = plan
    leaf = id(t) if isinstance(t, Node) else ("c", t)
    return leaf if sign > 0 else ("neg", leaf)


def _emit_plan(gm, before: Node, plan, kind: str) -> Node:
    if len(plan) == 2:
        sign, t = plan
        return t if sign > 0 else _fn(gm, before, operator.neg, t)
    is_sub, left, right = plan
    a, b = _emit_plan(gm, before, left, kind), _emit_plan(gm, before, right, kind)
    op = {"addsub": operator.sub if is_sub else operator.add, "mul": operator.mul,
          "and": operator.and_, "or": operator.or_, "xor": operator.xor}[kind]
    return _fn(gm, before, op, a, b)


def _reassoc_site(gm: GraphModule, root: Node, rng: random.Random) -> bool:
    kind, dtype = _chain_kind(root), _tensor(root).dtype
    terms: list = []
    _terms(root, 1, kind, dtype, terms)
    if not all(_leaf_ok(t, dtype) for _, t in terms) or not any(_is_int_tensor(t) or _is_bool_tensor(t)
                                                                for _, t in terms):
        return False
    old = _tree_sig(root, kind, dtype)
    for attempt in range(12):
        order = terms[:]
        rng.shuffle(order)
        # the first term: a tensor (so every intermediate is a tensor op), positive if one is; a
        # negated first term (``-b + a``) only when nothing else changes the tree (``a - b``)
        heads = [i for i, (s, t) in enumerate(order) if _tensor(t) is not None and (s > 0 or attempt >= 8)] or \
                [i for i, (s, t) in enumerate(order) if _tensor(t) is not None]
        order.insert(0, order.pop(rng.choice(heads)))
        plan = _draw_tree(order, rng)
        if _plan_sig(plan) != old:
            new = _emit_plan(gm, root, plan, kind)
            _note(gm, f"reassoc: {root.name} ({kind}, {len(terms)} terms) -> {new.name}")
            _replace(gm, root, new)
            return True
    return False


def reassoc(gm: GraphModule, rng: random.Random) -> int:
    """Re-associate and commute integer add/sub chains (``a - b + c`` -> ``(a + c) - b`` ->
    ``a + (c - b)``), integer products (``x * N`` <-> ``N * x``) and boolean ``&``/``|``/``^``
    chains of masks. Only integer and bool tensors (``example_value`` dtypes): exact."""
    roots = [n for n in gm.graph.nodes if _chain_kind(n) is not None and not _absorbed(n)]
    return _apply(gm, rng, roots, lambda n: _reassoc_site(gm, n, rng))
