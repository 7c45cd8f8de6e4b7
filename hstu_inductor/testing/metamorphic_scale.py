"""Metamorphic transformation ``scale_move``: a scalar factor moved across a linear op, or respelled.

Equal up to float rounding: ``(c * q) @ k^T`` and ``c * (q @ k^T)`` (or ``x / c`` and
``x * (1 / c)``) round differently. A reciprocal is used only when it gives the user's constant
back exactly.
"""
from __future__ import annotations

import operator
import random

import torch
from torch.fx import GraphModule, Node

from .metamorphic_graph import (
    _MUL, _apply, _erase_dead, _ev, _fn, _is_float_tensor, _is_number, _live, _name, _new, _note, _replace, _tensor)

_MATMULS = (torch.matmul, operator.matmul, torch.bmm, torch.mm)
_VIEW_METHODS = ("view", "reshape", "transpose", "permute", "contiguous", "unsqueeze", "squeeze", "flatten",
                 "expand", "clone", "t", "unflatten")
_VIEW_FNS = (torch.transpose, torch.reshape, torch.permute, torch.unsqueeze, torch.squeeze, torch.flatten, torch.t)


def _is_scalar(a) -> bool:
    """A Python number, or a node holding a symbolic float/int (under ``dynamic=True`` Dynamo passes a
    float attribute such as ``self.alpha`` as a 0-d input read with ``.item()``)."""
    return _is_number(a) or (isinstance(a, Node) and isinstance(_ev(a), (torch.SymFloat, torch.SymInt)))


def _scale_of(n):
    """``(x, c, form)`` for ``x * c`` (``mul``), ``c * x`` (``rmul``), ``x / c`` (``div``) with
    ``x`` a float tensor node and ``c`` a scalar (``_is_scalar``); else None."""
    if not (isinstance(n, Node) and n.op == "call_function" and len(n.args) == 2 and not n.kwargs):
        return None
    a, b = n.args
    if n.target in _MUL:
        if _is_float_tensor(a) and _is_scalar(b):
            return a, b, "mul"
        if _is_float_tensor(b) and _is_scalar(a):
            return b, a, "rmul"
    if n.target in (operator.truediv, torch.div) and _is_float_tensor(a) and _is_scalar(b) \
            and not (_is_number(b) and b == 0):
        return a, b, "div"
    return None


def _apply_scale(gm, before, x, c, form: str, like=None) -> Node:
    """``x`` scaled by ``c`` in ``form`` (the spelling of the site it comes from)."""
    args = {"mul": (x, c), "rmul": (c, x), "div": (x, c)}[form]
    return _fn(gm, before, operator.truediv if form == "div" else operator.mul, *args, like=like)


def _reciprocal(gm, before, c, like=None):
    """``1 / c``: a number (None unless it gives ``c`` back exactly: no drift of the user's
    constant), or a node for a symbolic scalar."""
    if isinstance(c, Node):
        return _fn(gm, before, operator.truediv, 1.0, c, like=like)
    inv = 1.0 / c
    if 1.0 / inv != c:
        return None
    return int(inv) if float(inv).is_integer() else inv


def _respell_scale(gm, f: Node, rng) -> str | None:
    """``x / c`` -> ``x * (1 / c)`` or ``(1 / c) * x``; ``x * c`` -> ``c * x`` or ``x / (1 / c)``."""
    x, c, form = _scale_of(f)
    forms = [g for g in ("mul", "rmul", "div") if g != form]
    rng.shuffle(forms)
    for new_form in forms:
        flip = (form == "div") != (new_form == "div")  # between a factor and a divisor
        k = _reciprocal(gm, f, c, like=f) if flip else c
        if k is None:
            continue
        _replace(gm, f, _apply_scale(gm, f, x, k, new_form, like=f))
        return f"{form} -> {new_form}"
    return None


def _linear_positions(n: Node) -> list:
    """Argument positions in which ``n`` is linear (homogeneous of degree 1), so a scalar factor
    of that argument can be moved to the output and back."""
    if n.op == "call_function":
        if n.target in _MATMULS:
            return [0, 1]
        if n.target is torch.einsum and len(n.args) >= 3 and isinstance(n.args[0], str):
            return list(range(1, len(n.args)))
        if n.target in _VIEW_FNS:
            return [0]
        if n.target is operator.getitem and _tensor(n.args[0]) is not None:
            return [0]
        if n.target is torch.where and len(n.args) == 3:
            _, a, b = n.args
            return [1] if _is_number(b) and b == 0 else ([2] if _is_number(a) and a == 0 else [])
        if n.target in _MUL and len(n.args) == 2 and all(_tensor(a) is not None for a in n.args):
            return [0, 1]
        if n.target in (torch.index_select, torch.gather):
            return [0]
    if n.op == "call_method":
        if n.target in ("matmul", "bmm", "mm"):
            return [0, 1]
        if n.target in _VIEW_METHODS + ("index_select", "gather"):
            return [0]
        if n.target == "masked_fill" and len(n.args) == 3 and _is_number(n.args[2]) and n.args[2] == 0:
            return [0]
    return []


def _move_down(gm, f: Node, rng, hops: int) -> str | None:
    """``U(..., x * c, ...)`` -> ``U(..., x, ...) * c`` for the only user ``U`` of the scale node,
    repeated ``hops`` times while the next user is linear too (same spelling of the scale)."""
    path = []
    for _ in range(hops):
        sc = _scale_of(f)
        if sc is None or len(f.users) != 1:
            break
        x, c, form = sc
        (u,) = f.users
        pos = [i for i, a in enumerate(u.args) if a is f]
        if len(pos) != 1 or pos[0] not in _linear_positions(u) or f in u.kwargs.values():
            break
        tu = _tensor(u)
        if tu is None or not tu.is_floating_point() or tu.dtype != _tensor(x).dtype:
            break
        args = list(u.args)
        args[pos[0]] = x
        inner = _new(gm, u, u.op, u.target, args, u.kwargs, like=u)
        new = _apply_scale(gm, u, inner, c, form, like=f)
        path.append(_name(u))
        u.replace_all_uses_with(new)
        gm.graph.erase_node(u)
        _erase_dead(gm, f)
        f = new
    return " past ".join(path) if path else None


def _move_up(gm, f: Node, rng) -> str | None:
    """``U(..., y, ...) * c`` -> ``U(..., y * c, ...)`` for a linear ``U`` read only by the scale."""
    u, c, form = _scale_of(f)
    if len(u.users) != 1 or u.op not in ("call_function", "call_method"):
        return None
    pos = [p for p in _linear_positions(u) if p < len(u.args) and _is_float_tensor(u.args[p])
           and _tensor(u.args[p]).dtype == _tensor(u).dtype]
    if not pos:
        return None
    p = rng.choice(pos)
    args = list(u.args)
    args[p] = _apply_scale(gm, f, u.args[p], c, form, like=f)  # at f: a symbolic c may come after U
    new = _new(gm, f, u.op, u.target, args, u.kwargs, like=u)
    _replace(gm, f, new)
    return f"into {_name(u)} argument {p}"


def _scale_site(gm, f: Node, rng: random.Random) -> bool:
    actions = ["down", "up", "respell"]
    rng.shuffle(actions)
    for action in actions:
        if action == "down":
            what = _move_down(gm, f, rng, hops=rng.choice([1, 1, 2]))
        elif action == "up":
            what = _move_up(gm, f, rng)
        else:
            what = _respell_scale(gm, f, rng)
        if what is not None:
            _note(gm, f"scale_move: {f.name}: {action} {what}")
            return True
    return False


def scale_move(gm: GraphModule, rng: random.Random) -> int:
    """A scalar factor moved across a linear op (``(c * q) @ k^T`` <-> ``c * (q @ k^T)``,
    ``(silu(s) / N).masked_fill(~m, 0) @ v`` <-> ``(silu(s).masked_fill(~m, 0) @ v) / N``, also
    past views, where/masked_fill with 0, mask products, gathers), or respelled (``x / c`` <->
    ``x * (1 / c)`` <-> ``(1 / c) * x``). Equal up to float rounding."""
    sites = [n for n in gm.graph.nodes if _scale_of(n) is not None]
    return _apply(gm, rng, sites, lambda n: _scale_site(gm, n, rng), alive=lambda n: _live(gm, n) and _scale_of(n))
