"""Every tensor element as a sympy expression of symbolic coordinates: the value-level interpreter.

``Elements(domain, leaves).at(node, idx)`` is the value of ``node``'s element at coordinates
``idx`` (a tuple of sympy integer expressions, one per dimension). Nothing is allocated: a
``[128, 4, 4096, 4096]`` mask costs what a ``[2, 2]`` one does. Each ATen op has a rule of a few
lines (``RULES``) that maps the output coordinate to its inputs' coordinates and combines their
elements:

* pointwise ops combine elements (integers and booleans exactly; floats of the data as applied
  uninterpreted functions, e.g. ``src(off(b) + p, f)``);
* layout ops (view, permute, expand, slice, cat, ...) map coordinates (views by mixed-radix
  arithmetic that :class:`~.domain.Domain` simplifies with the coordinates' ranges);
* gathers substitute index elements into coordinates; scatters invert the index map
  (:meth:`Elements._invert`: ``seq * N + pos`` at jagged row ``off(b) + p`` is ``b*N + p``, whose
  inverse at padded slot ``(b', p')`` is ``(b', p')``);
* the jagged ops (searchsorted / bucketize over the offsets, repeat_interleave by the lengths, a
  cumsum of the lengths, counts of passed sequence starts) by their defining property on
  non-decreasing offsets (``jagged_rules``).

Booleans are sympy Booleans; numbers are sympy numbers; a boolean used as a number is
``Piecewise((1, c), (0, True))``. An op without a rule raises :class:`Unsupported`, which names it:
the proof then declines with that reason instead of guessing.

In-place ops (the ATen retrace keeps ``index_copy_``, ``zero_``, ``masked_fill_``) are read as their
functional twins: a later reader of the mutated tensor sees the mutation's result
(:meth:`Elements._versions`). A mutation through a view of a tensor that is read again is declined.
"""
from __future__ import annotations

import math
from typing import Optional

import sympy
import torch

from .. import constants
from .domain import Domain
from .values import Unsupported, check_budget, meta_val, size_expr

aten = torch.ops.aten


def _dtype(n):
    v = meta_val(n)
    return v.dtype if isinstance(v, torch.Tensor) else None


class Elements:
    """The value interpreter of one proof. ``leaves``: node -> ``fn(idx) -> expr`` for the inputs
    the proof treats as given (offsets, num_targets, the data being moved)."""

    def __init__(self, domain: Domain, leaves: dict, gm: Optional[torch.fx.GraphModule] = None):
        self.dom = domain
        self.leaves = dict(leaves)
        self.gm = gm
        self.overrides: dict = {}  # node -> rule, for nodes a proof reads in its own way
        self._memo: dict = {}
        self._read: dict = {}   # (reader, arg) -> the version of arg it reads (in-place ops)
        self._bad_reads: dict = {}
        self._versions_done: set = set()

    # -- entry points ----------------------------------------------------------------------------
    def shape(self, n) -> tuple:
        v = meta_val(n)
        if not isinstance(v, torch.Tensor):
            raise Unsupported(f"{getattr(n, 'name', n)} is not a tensor")
        return tuple(size_expr(s) for s in v.shape)

    def at(self, n, idx: tuple):
        """The element of ``n`` at ``idx``."""
        idx = tuple(sympy.sympify(x) for x in idx)
        key = (n, idx)
        if key in self._memo:
            return self._memo[key]
        check_budget()
        if n in self.leaves:
            out = self.leaves[n](idx)
        elif n in self.overrides:
            out = self.overrides[n](self, n, idx)
        elif n.op == "call_function":
            self._versions(n.graph)
            rule = RULES.get(n.target) or NAMED_RULES.get(_qualname(n.target))
            if rule is None:
                raise Unsupported(f"no value rule for {_opname(n)} ({n.name})")
            out = rule(self, n, idx)
        elif n.op == "get_attr":
            out = self._constant(n, idx)
        elif n.op == "placeholder" and (value := constants.value(n)) is not None:
            out = constant_element(value, idx, n.name)  # module state, read by value (and guarded)
            constants.record(n)
        else:
            raise Unsupported(f"{n.name} is an input the proof does not model")
        out = self.dom.canon(out) if isinstance(out, sympy.Basic) else out
        self._memo[key] = out
        return out

    def arg(self, n, a, idx: tuple):
        """Element of argument ``a`` of ``n`` (a node, broadcast to ``idx``, or a scalar)."""
        if isinstance(a, torch.fx.Node):
            v = meta_val(a)
            if isinstance(v, torch.Tensor):
                src = self._read.get((n, a), a)
                if (n, a) in self._bad_reads:
                    raise Unsupported(self._bad_reads[(n, a)])
                return self.at(src, self.broadcast(a, idx))
            return self.scalar(a)
        return self.scalar(a)

    def scalar(self, a):
        if isinstance(a, torch.fx.Node):
            v = meta_val(a)
            if isinstance(v, torch.SymInt):
                return size_expr(v)
            if isinstance(v, (torch.SymFloat, torch.SymBool)):
                return sympy.sympify(v.node.expr)
            if isinstance(v, (int, float, bool)):
                return self.scalar(v)
            raise Unsupported(f"{a.name} is neither a tensor nor a scalar")
        if isinstance(a, bool):
            return sympy.true if a else sympy.false
        if isinstance(a, int):
            return sympy.Integer(a)
        if isinstance(a, float):
            if math.isinf(a):
                return sympy.oo if a > 0 else -sympy.oo
            if math.isnan(a):
                return sympy.nan
            # an integral float is exact as an integer: 1.0 and 1 must compare equal in the proofs
            return sympy.Integer(int(a)) if float(a).is_integer() else sympy.Float(a, 53)
        if isinstance(a, torch.SymInt):
            return size_expr(a)
        if isinstance(a, torch.SymFloat):
            return sympy.sympify(a.node.expr)
        if a is None:
            return None
        raise Unsupported(f"unsupported scalar argument {a!r}")

    def src(self, n, a):
        """The version of input ``a`` that ``n`` reads (the result of an in-place op on it, if any)."""
        if (n, a) in self._bad_reads:
            raise Unsupported(self._bad_reads[(n, a)])
        return self._read.get((n, a), a)

    def broadcast(self, a, idx: tuple) -> tuple:
        """``idx`` of a broadcast result read in input ``a`` (trailing alignment, size-1 dims read 0)."""
        shape = self.shape(a)
        k = len(shape)
        if k > len(idx):
            raise Unsupported(f"{a.name} has more dims than its broadcast result")
        sub = idx[len(idx) - k:]
        return tuple(sympy.Integer(0) if s == 1 else x for s, x in zip(shape, sub))

    # -- constants -------------------------------------------------------------------------------
    def _constant(self, n, idx):
        obj = n.graph.owning_module
        for part in n.target.split("."):
            obj = getattr(obj, part)
        if not isinstance(obj, torch.Tensor):
            raise Unsupported(f"constant {n.name} is not a tensor")
        return constant_element(obj, idx, n.name)

    # -- in-place ops ------------------------------------------------------------------------------
    def _versions(self, graph):
        """Readers of a tensor mutated in place read the mutation's result. Computed once per graph."""
        if graph in self._versions_done:
            return
        self._versions_done.add(graph)
        latest: dict = {}          # base node -> node holding its current value
        through_view: dict = {}    # base node -> the view mutation (reading it again is declined)
        order = {n: i for i, n in enumerate(graph.nodes)}
        mutated_at: dict = {}      # base node -> position of its last mutation
        for n in graph.nodes:
            for a in n.all_input_nodes:
                base = _base(a)
                if base in through_view and a is not through_view[base] and n is not through_view[base]:
                    self._bad_reads[(n, a)] = (f"{n.name} reads {a.name} after {through_view[base].name} "
                                               f"mutated it through a view")
                elif a in latest and latest[a] is not n:
                    self._read[(n, a)] = latest[a]
                elif _is_view(a) and base in mutated_at and order[a] < mutated_at[base] and n is not a:
                    self._bad_reads[(n, a)] = f"{n.name} reads the view {a.name} of {base.name} after a mutation"
            if n.op == "call_function" and _mutates_first(n):
                target = n.args[0]
                base = _base(target)
                mutated_at[base] = order[n]
                if _is_view(target) and target is not base:
                    through_view[base] = n
                else:
                    latest[base] = n
                    latest[target] = n


def _qualname(target) -> str:
    schema = getattr(target, "_schema", None)
    return f"{schema.name}.{schema.overload_name or 'default'}" if schema is not None else str(target)


def _opname(n) -> str:
    return getattr(n.target, "__name__", str(n.target))


def _mutates_first(n) -> bool:
    schema = getattr(n.target, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    info = schema.arguments[0].alias_info
    return bool(info is not None and info.is_write)


_VIEWS = None


def _is_view(n) -> bool:
    global _VIEWS
    if _VIEWS is None:
        _VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
                  aten.transpose.int, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim,
                  aten.squeeze.dims, aten.squeeze.default, aten.expand.default, aten.slice.Tensor,
                  aten.select.int, aten.alias.default, aten.diagonal.default, aten.as_strided.default,
                  aten.unfold.default}
    return isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target in _VIEWS


def _base(n):
    """The tensor ``n`` aliases: through views and the results of in-place ops."""
    cur = n
    while isinstance(cur, torch.fx.Node) and cur.op == "call_function" and (
            _is_view(cur) or _mutates_first(cur)):
        cur = cur.args[0]
    return cur


def constant_element(t: torch.Tensor, idx, name: str):
    """Element of a constant tensor (a buffer read by value): concrete coordinates read it; symbolic
    ones need a recognised form (``tables``)."""
    from .tables import table_element

    return table_element(t, idx, name)


# ---------------------------------------------------------------------------------------------
# Rules

RULES: dict = {}
NAMED_RULES: dict = {}  # "ns::op.overload" -> rule, for ops of optional libraries (fbgemm)


def rule(*targets):
    def deco(fn):
        for t in targets:
            if t is not None:
                RULES[t] = fn
        return fn
    return deco


def _op(name, overload="default"):
    pkt = getattr(aten, name, None)
    return getattr(pkt, overload, None) if pkt is not None else None


def _kw(n, name, default=None):
    if name in n.kwargs:
        return n.kwargs[name]
    schema = getattr(n.target, "_schema", None)
    if schema is not None:
        for i, a in enumerate(schema.arguments):
            if a.name == name and i < len(n.args):
                return n.args[i]
    return default


def _src(E, n):
    return E.src(n, n.args[0])


def linear(idx, shape):
    """Row-major linear index of ``idx`` in ``shape``."""
    lin = sympy.Integer(0)
    for x, s in zip(idx, shape):
        lin = lin * s + x
    return sympy.expand(lin)


def unravel(E, lin, shape) -> tuple:
    out = []
    rest = lin
    for s in reversed(shape[1:]):
        out.append(E.dom.mod(rest, s))
        rest = E.dom.floordiv(rest, s)
    out.append(rest)
    return tuple(reversed(out))
