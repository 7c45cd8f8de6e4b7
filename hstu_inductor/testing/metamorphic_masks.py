"""Metamorphic transformations of masks: how a mask is applied (``mask_apply``) and where it comes
from (``mask_buffer``).

``mask_apply`` respells zeroing by a bool mask (``where`` / ``masked_fill`` / a product with the
mask cast to float): exact on finite scores. ``mask_buffer`` turns a constant tensor (a mask, an
``arange``) into a graph input, the way a registered buffer reaches a backend under Dynamo; the
wrapping backend (``metamorphic.Metamorphic``) supplies its value.
"""
from __future__ import annotations

import operator
import random

import torch
from torch.fx import GraphModule, Node

from .. import _compat

from .metamorphic_graph import (
    _MUL, _apply, _concrete, _erase_dead, _fn, _inplace, _is_bool_tensor, _is_float_tensor, _is_number, _is_op, _live,
    _method, _name, _note, _replace, _subset, _tensor)

# ------------------------------------------------------------------------------------------------
# mask_apply: where(m, p, 0) <-> p.masked_fill(~m, 0) <-> p * m.to(p.dtype)

def _mask_of(a):
    """``(m, keep)`` if ``a`` is a bool mask, or a 0/1 float made from one (``m.to(dtype)``,
    ``m.float()``, ``m.type(dtype)``): multiplying by ``a`` keeps the entries where ``m == keep``."""
    if _is_bool_tensor(a):
        return a, True
    if _is_op(a, (), ("to", "float", "type", "half", "bfloat16")) and _is_bool_tensor(a.args[0]) \
            and _is_float_tensor(a):
        return a.args[0], True
    return None


def _masked_zero(n: Node):
    """``(p, m, keep, form)`` when ``n`` is ``p`` with the entries where ``m != keep`` set to 0
    (``p`` float, ``m`` bool), spelled ``form``; else None."""
    if n.op == "call_function" and n.target is torch.where and len(n.args) == 3 and not n.kwargs:
        c, a, b = n.args
        if _is_bool_tensor(c) and _is_float_tensor(a) and _is_number(b) and b == 0:
            return a, c, True, "where"
        if _is_bool_tensor(c) and _is_float_tensor(b) and _is_number(a) and a == 0:
            return b, c, False, "where"
    if _is_op(n, (torch.masked_fill,), ("masked_fill",)) and len(n.args) == 3 and not n.kwargs:
        p, c, v = n.args
        if _is_float_tensor(p) and _is_bool_tensor(c) and _is_number(v) and v == 0:
            return p, c, False, "masked_fill"
    if n.op == "call_function" and n.target in _MUL and len(n.args) == 2 and not n.kwargs and _is_float_tensor(n):
        for p, k in (n.args, n.args[::-1]):
            mk = _mask_of(k)
            if mk is not None and _is_float_tensor(p) and _tensor(p).dtype == _tensor(n).dtype:
                return p, mk[0], mk[1], "mul"
    return None


def _mask_apply_site(gm: GraphModule, n: Node, rng: random.Random) -> bool:
    p, m, keep, form = _masked_zero(n)
    if _is_op(m, (operator.invert,)) and rng.random() < 0.7:  # where(~m0, ...) reads as where(m0, ...) flipped
        m, keep = m.args[0], not keep
    tn, tp = _tensor(n), _tensor(p)
    forms = ["where", "mul"]
    if tuple(torch.broadcast_shapes(tp.shape, _tensor(m).shape)) == tuple(tp.shape) and tn.shape == tp.shape:
        forms.append("masked_fill")  # masked_fill keeps p's shape: the mask must not broadcast p
    forms = [f for f in forms if f != form] or forms
    new_form = rng.choice(forms)

    def cond(want_keep):  # a bool node true where entries are kept (want_keep) or dropped
        return m if keep == want_keep else _fn(gm, n, operator.invert, m, like=n)

    if new_form == "where":
        if rng.random() < 0.5:
            new = _fn(gm, n, torch.where, cond(True), p, 0.0, like=n)
        else:
            new = _fn(gm, n, torch.where, cond(False), 0.0, p, like=n)
    elif new_form == "masked_fill":
        new = _method(gm, n, "masked_fill", p, cond(False), 0.0, like=n)
    else:
        f = _method(gm, n, "to", cond(True), tp.dtype, like=n)
        new = _fn(gm, n, operator.mul, *((p, f) if rng.random() < 0.5 else (f, p)), like=n)
    if _tensor(new).shape != tn.shape or _tensor(new).dtype != tn.dtype:
        _erase_dead(gm, new)
        return False
    _note(gm, f"mask_apply: {n.name} ({form}) -> {new_form}")
    _replace(gm, n, new)
    return True


def mask_apply(gm: GraphModule, rng: random.Random) -> int:
    """Zeroing by a bool mask respelled: ``torch.where(m, p, 0)`` <-> ``p.masked_fill(~m, 0)`` <->
    ``p * m.to(p.dtype)`` (``m`` bool, ``p`` float; a ``~m`` mask may be read as ``m`` flipped).
    Exact on finite ``p``."""
    sites = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method") and _masked_zero(n)]
    return _apply(gm, rng, sites, lambda n: _mask_apply_site(gm, n, rng),
                  alive=lambda n: _live(gm, n) and _masked_zero(n) is not None)


# ------------------------------------------------------------------------------------------------
# mask_buffer: a constant tensor (mask, arange) becomes a graph input, like a registered buffer

_RANDOM = ("rand", "randn", "randint", "rand_like", "randn_like", "bernoulli", "dropout", "normal", "empty",
           "empty_like", "new_empty", "multinomial", "randperm")
_STRUCTURED = ("arange", "tril", "triu", "eye", "ge", "gt", "le", "lt", "eq", "ne", "tril_", "triu_")
_VIEWISH = (operator.getitem, operator.invert, "to", "bool", "float", "unsqueeze", "view", "reshape", "expand",
            "__getitem__", "logical_not")


def _constants(gm: GraphModule) -> set:
    """Nodes whose value depends on no graph input (not even a size): a registered buffer could
    hold them. Random and uninitialised ops are never constant."""
    const = set()
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            const.add(n)
        elif n.op in ("call_function", "call_method") and _name(n) not in _RANDOM \
                and all(a in const for a in n.all_input_nodes):
            const.add(n)
    return const


def _structured(n: Node, const: set) -> bool:
    """The constant subgraph of ``n`` builds a pattern (arange, tril, comparisons), not a fill:
    masks and positions are what models register as buffers; zero buffers are not."""
    seen, stack = set(), [n]
    while stack:
        m = stack.pop()
        if m in seen or m not in const:
            continue
        seen.add(m)
        if _name(m) in _STRUCTURED or _name(m) in ("__ge__", "__lt__"):
            return True
        stack.extend(m.all_input_nodes)
    return False


def _batch_sizes(gm: GraphModule) -> set:
    """Sizes a buffer cannot have: the leading size of every user input (rows, batch + 1) and one
    less. Under static shapes Dynamo writes input sizes into the graph as constants, so
    ``arange(L)`` looks constant; a registered buffer is sized by the model (``N``), not the batch."""
    out = set()
    for p in gm.graph.find_nodes(op="placeholder"):
        t, src = _tensor(p), getattr(p, "_dynamo_source", None)
        if t is not None and t.dim() and "self" not in (src.name if src is not None else "self"):
            k = _concrete(t.shape[0])
            if k is not None:
                out |= {k, k - 1}
    return out


def _liftable(n: Node, const: set, batch: set) -> bool:
    t = _tensor(n)
    return (t is not None and n.op != "get_attr" and not _inplace(n)
            and not any(_inplace(u) and u.args and u.args[0] is n for u in n.users)
            and all(_concrete(s) is not None and (_concrete(s) == 1 or _concrete(s) not in batch) for s in t.shape)
            and _structured(n, const))


def _const_subgraph(gm: GraphModule, n: Node) -> GraphModule:
    """A graph module computing ``n`` from nothing (its constant ancestors copied in order)."""
    need, stack = set(), [n]
    while stack:
        m = stack.pop()
        if m not in need:
            need.add(m)
            stack.extend(m.all_input_nodes)
    graph, env = torch.fx.Graph(), {}
    for m in gm.graph.nodes:
        if m in need:
            env[m] = graph.node_copy(m, lambda a: env[a])
    graph.output(env[n])
    return GraphModule(gm, graph)


def mask_buffer(gm: GraphModule, rng: random.Random) -> int:
    """A tensor computed only from constants (e.g. ``tril(ones(N, N))``, ``arange(N)[:, None] >=
    arange(N)``) becomes a new graph input, the way a registered buffer reaches a backend under
    Dynamo. Lifted: a constant with a non-constant user, or (half the time) its constant operand
    when it is a view/invert/cast of one (``~self.mask``). The wrapper supplies the value
    (``gm.meta["metamorphic_buffers"]``: placeholder, value graph). Exact."""
    const, batch = _constants(gm), _batch_sizes(gm)
    frontier = [n for n in gm.graph.nodes if n in const and any(u not in const for u in n.users)]
    sites = []
    for n in frontier:
        parents = [a for a in n.all_input_nodes if a in const]
        if _name(n) in _VIEWISH and len(parents) == 1 and _liftable(parents[0], const, batch) and rng.random() < 0.5:
            n = parents[0]
        if _liftable(n, const, batch) and n not in sites:
            sites.append(n)
    done = 0
    for n in _subset(rng, sites):
        if not _live(gm, n):
            continue
        value = _const_subgraph(gm, n)
        # Dynamo puts buffers first, static-shaped, marked static inputs, without a guard on values
        buffers = gm.meta.setdefault("metamorphic_buffers", [])
        first = next(iter(gm.graph.nodes))  # a placeholder, or the first op of a graph without inputs
        with gm.graph.inserting_before(first) if not buffers else gm.graph.inserting_after(buffers[-1][0]):
            ph = gm.graph.placeholder(f"metamorphic_buffer_{done}")
        ph.meta["example_value"] = _tensor(n)
        ph.meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"}
        ph.meta["stack_trace"] = n.meta.get("stack_trace")
        ph.meta["grapharg"] = _buffer_grapharg(f"metamorphic_buffer_{len(buffers)}", _tensor(n))
        ph._dynamo_source = None  # AOTAutograd's dedup guards need no source; Dynamo's own guards are built apart
        buffers.append((ph, value))
        _note(gm, f"mask_buffer: {n.name} {tuple(_tensor(n).shape)} {_tensor(n).dtype} -> input {ph.name}")
        n.replace_all_uses_with(ph)
        _erase_constants(gm, n, const)
        done += 1
    return done


def _buffer_grapharg(name: str, fake: torch.Tensor):
    return _compat.buffer_grapharg(name, fake)


def _erase_constants(gm: GraphModule, n: Node, const: set) -> None:
    """Erase ``n`` and the constant ancestors it leaves unread; an in-place constant op goes only
    with its input, when nothing else reads that input."""
    stack = [n]
    while stack:
        m = stack.pop()
        if not _live(gm, m) or m.users or m not in const or m.op == "get_attr":
            continue
        if _inplace(m) and m.args and isinstance(m.args[0], Node) and set(m.args[0].users) != {m}:
            continue
        inputs = m.all_input_nodes
        gm.graph.erase_node(m)
        stack.extend(inputs)
