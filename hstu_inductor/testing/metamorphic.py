"""Metamorphic coverage: semantics-preserving transformations of the graphs Dynamo captures.

The spelling grammar (``grammar``) only draws spellings from families the matcher already knows,
so its rate says little about code we did not foresee. Here a model (a grammar sample or any other
case) is compiled through a wrapping Dynamo backend, :class:`Metamorphic`, that rewrites each
captured graph into an *equivalent* one before the real backend sees it, and we measure whether the
real backend still rewrites the attention, never rewrites a near miss, and still equals eager.

Design choices (and why):

- **Transform the torch-level FX graph that Dynamo hands to the backend**, not the user's source:
  every model gets the same transformations for free, and it is exactly what the backend reads
  (``call_function`` on ``torch.*`` / ``operator.*`` / ``F.*`` and ``call_method`` nodes). The
  wrapper copies ``gm``, applies the transformations, then calls the inner backend
  (``hstu_inductor.backend.hstu_eager_backend`` by default). It sets ``__wrapped__`` to the inner
  backend, so the frame is traced with our backend's Dynamo options
  (``capture_dynamic_output_shape_ops``) as for a plain ``backend="hstu_eager"`` compile.
- **Each transformation is a small generic function** ``fn(gm, rng) -> int`` (sites changed) over
  node targets and example values (``node.meta["example_value"]``: dtypes, shapes), never over the
  grammar's names, so it applies to any model (the public-style GR/tzrec stacks too). It picks a
  random non-empty subset of its applicable sites, so one seed exercises one combination and many
  seeds cover many. New nodes get an ``example_value`` computed in the graph's own fake mode, so
  transformations compose (a later one reads the dtypes of an earlier one's nodes).
- **Values are preserved exactly** (integer and boolean re-association and commutation, slicing
  forms, in-place twins, where/masked_fill/mul of a 0/1 mask, buffers) **or up to float rounding**
  (moving a scalar factor across a linear op, ``x / c`` vs ``x * (1 / c)``). No float sums are
  re-associated. Masking by multiplication differs from ``where`` only on non-finite scores, which
  these models never produce.
- **A failing transformation never breaks the run**: each is applied to a copy of the current
  graph; if it raises, the copy is dropped and the error recorded in ``Record.transform_errors``.
- ``mask_buffer`` turns a constant tensor (a mask, an ``arange``) into a graph *input*, which is how
  a registered buffer reaches a backend under Dynamo (``inline_inbuilt_nn_modules``). The wrapper
  evaluates the lifted constant subgraph once (real tensors, or fakes of the caller's fake mode in
  the fake modes), hands the value to the inner backend as an example input and passes the same
  tensor first on every call, as Dynamo passes a module's buffers (static shape, marked a static
  input, a ``GraphArg`` naming ``L['self']._buffers[...]``). Dynamo guards a buffer's metadata, not
  its values, so a backend may rewrite such a graph only by reading the value at compile time and
  guarding it at run time (the backend's ``ConstantGuard``), or by checking it on every call.
- ``sizes_coincide`` is not a graph transformation but a size choice of the run (``COINCIDE``):
  sizes where ``B * H * D == N``, ``D == N`` or ``B == H``, where a size-based reading of the graph
  can confuse two dimensions.

``run(case, transforms, mode)`` mirrors ``grammar_run.run`` (same modes, same outcome names and
tolerances) and returns a :class:`Record`; ``scripts/metamorphic_rates.py`` runs many;
``docs/metamorphic.md`` has the transformations and the measured rates.
"""
from __future__ import annotations

import contextlib
import dataclasses
import operator
import random
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node
from torch._subclasses.fake_tensor import (FakeTensor, FakeTensorMode,
                                           unset_fake_temporarily)

from .. import _compat, backend
from ..report import collecting
from . import grammar_run
from .grammar import Sample, sample

# ------------------------------------------------------------------------------------------------
# Graph helpers

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _ev(a):
    """The example value Dynamo recorded for a node (None for constants and unknown nodes)."""
    return a.meta.get("example_value") if isinstance(a, Node) else None


def _tensor(a):
    v = _ev(a)
    return v if isinstance(v, torch.Tensor) else None


def _is_int_tensor(a) -> bool:
    t = _tensor(a)
    return t is not None and t.dtype in _INT_DTYPES


def _is_bool_tensor(a) -> bool:
    t = _tensor(a)
    return t is not None and t.dtype == torch.bool


def _is_float_tensor(a) -> bool:
    t = _tensor(a)
    return t is not None and t.is_floating_point()


def _is_number(a) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool)


def _concrete(x):
    """``x`` as a Python int if it is one or a SymInt with a known constant value, else None."""
    if isinstance(x, int):
        return x
    return x.node.maybe_as_int() if isinstance(x, torch.SymInt) else None


def _is_op(n, functions=(), methods=()) -> bool:
    return isinstance(n, Node) and ((n.op == "call_function" and n.target in functions)
                                    or (n.op == "call_method" and n.target in methods))


def _inplace(n: Node) -> bool:
    """A node that mutates its first argument (never erased as dead code)."""
    name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
    return (isinstance(name, str) and name.endswith("_") and not name.endswith("__")) or n.kwargs.get("inplace") is True


def _fake_mode_of(gm: GraphModule):
    mode = gm.meta.get("metamorphic_fake_mode")
    if mode is None:
        mode = gm.meta["metamorphic_fake_mode"] = _compat.graph_fake_mode(gm)
    return mode


def _infer(gm: GraphModule, node: Node):
    """The example value of a node we created: its op run on its inputs' example values in the
    graph's fake mode (so later transformations can read its dtype and shape)."""
    def val(a):
        return a.meta.get("example_value") if isinstance(a, Node) else a

    args, kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), val)
    mode = _fake_mode_of(gm)
    with mode if mode is not None else contextlib.nullcontext():
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        self = args[0]
        if _inplace(node) and isinstance(self, torch.Tensor):
            self = self.clone()  # the input's own example value stays as it is
        return getattr(self, node.target)(*args[1:], **kwargs)


_META_SKIP = ("example_value", "val", "tensor_meta", "unbacked_bindings")


def _new(gm: GraphModule, before: Node, op: str, target, args, kwargs=None, like: Node | None = None) -> Node:
    """A new node right before ``before`` (all inputs of a node we replace precede it), with the
    source metadata of ``like`` (stack trace: reports still name the user's line) and an example value."""
    with gm.graph.inserting_before(before):
        n = gm.graph.create_node(op, target, tuple(args), dict(kwargs or {}))
    src = like if like is not None else before
    n.meta.update({k: v for k, v in src.meta.items() if k not in _META_SKIP})
    n.meta["example_value"] = _infer(gm, n)
    return n


def _fn(gm, before, target, *args, like=None, **kwargs) -> Node:
    return _new(gm, before, "call_function", target, args, kwargs, like)


def _method(gm, before, name, *args, like=None, **kwargs) -> Node:
    return _new(gm, before, "call_method", name, args, kwargs, like)


def _erase_dead(gm: GraphModule, node: Node) -> None:
    """Erase ``node`` and the inputs it leaves without users (pure ops only: an in-place op's
    mutation may be observed through its input)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if n.graph is not gm.graph or n.op not in ("call_function", "call_method") or n.users or _inplace(n):
            continue
        inputs = n.all_input_nodes
        gm.graph.erase_node(n)
        stack.extend(inputs)


def _replace(gm: GraphModule, old: Node, new: Node) -> None:
    old.replace_all_uses_with(new)
    _erase_dead(gm, old)


def _note(gm: GraphModule, what: str) -> None:
    """One changed site, in words (kept on the record: which sites a decline followed)."""
    gm.meta.setdefault("metamorphic_sites", []).append(what)


def _subset(rng: random.Random, sites: list, p: float = 0.6) -> list:
    """A random non-empty subset of ``sites`` (each kept with probability ``p``), in graph order."""
    if not sites:
        return []
    keep = [s for s in sites if rng.random() < p]
    return keep or [rng.choice(sites)]


def _live(gm: GraphModule, n: Node) -> bool:
    return n.graph is gm.graph and n in gm.graph.nodes


def _apply(gm: GraphModule, rng: random.Random, sites: list, change: Callable, alive=None) -> int:
    """``change(site) -> bool`` on a random subset of ``sites``; if none of them could be changed,
    on the others one by one until one is (a transformation that applies somewhere must change
    something). ``alive(site)``: whether an earlier change left the site in the graph."""
    alive = alive or (lambda n: _live(gm, n))
    chosen = _subset(rng, sites)
    done = sum(bool(change(s)) for s in chosen if alive(s))
    if done == 0:
        rest = [s for s in sites if s not in chosen]
        rng.shuffle(rest)
        for s in rest:
            if alive(s) and change(s):
                return 1
    return done


def copy_graph_module(gm: GraphModule) -> GraphModule:
    """A copy of a Dynamo graph module with its own graph (node metadata shared shallowly) and the
    attributes Dynamo and our backend read (sources, reasons, the shape env)."""
    graph = torch.fx.Graph()
    env: dict = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    for old_node, new_node in env.items():  # AOTAutograd reads each Dynamo placeholder's source
        if hasattr(old_node, "_dynamo_source"):
            new_node._dynamo_source = old_node._dynamo_source
    new = GraphModule(gm, graph)
    new.meta = dict(gm.meta)
    for attr in ("_param_name_to_source", "_source_to_user_stacks", "compile_subgraph_reason", "shape_env"):
        if hasattr(gm, attr):
            setattr(new, attr, getattr(gm, attr))
    return new


# ------------------------------------------------------------------------------------------------
# 1. reassoc: integer / boolean chains re-associated and commuted (exact: a commutative ring mod 2^k)

_ADD, _SUB, _MUL = (operator.add, torch.add), (operator.sub, torch.sub), (operator.mul, torch.mul)
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


# ------------------------------------------------------------------------------------------------
# 2. inplace: out-of-place ops on a fresh buffer made in-place, and in-place ops made out-of-place

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


# ------------------------------------------------------------------------------------------------
# 3. split_forms: split / chunk / slices / narrow / unflatten+unbind interchanged

_SPLIT_FNS = (torch.split, torch.chunk, torch.unbind)


def _dim_size(t: torch.Tensor, dim: int):
    return _concrete(t.shape[dim])


def _norm_dim(dim, ndim):
    return dim + ndim if dim < 0 else dim


def _plain_slice(n: Node):
    """``(x, dim, start, stop)`` for ``x[..., a:b]``-like getitems (one non-trivial step-1 slice,
    the rest full slices / an Ellipsis) and ``narrow``, with concrete bounds; else None."""
    if n.op == "call_function" and n.target in (torch.narrow,) or (n.op == "call_method" and n.target == "narrow"):
        x, dim, start, length = (list(n.args) + [None] * 4)[:4]
        t = _tensor(x)
        start, length = _concrete(start), _concrete(length)
        if t is None or not isinstance(dim, int) or start is None or length is None:
            return None
        dim = _norm_dim(dim, t.dim())
        size = _dim_size(t, dim)
        if start < 0:
            if size is None:
                return None
            start += size
        return (x, dim, start, start + length)
    if not (n.op == "call_function" and n.target is operator.getitem and len(n.args) == 2):
        return None
    x, idx = n.args
    t = _tensor(x)
    if t is None:
        return None
    idx = idx if isinstance(idx, tuple) else (idx,)
    if any(not isinstance(i, (slice, type(Ellipsis))) for i in idx) or sum(i is Ellipsis for i in idx) > 1:
        return None
    if Ellipsis in idx:
        e = idx.index(Ellipsis)
        idx = idx[:e] + (slice(None),) * (t.dim() - len(idx) + 1) + idx[e + 1:]
    if len(idx) > t.dim():
        return None
    real = [(d, s) for d, s in enumerate(idx) if s != slice(None)]
    if len(real) != 1:
        return None
    dim, s = real[0]
    if s.step not in (None, 1) or any(isinstance(b, Node) for b in (s.start, s.stop)):
        return None
    size = _dim_size(t, dim)
    start, stop = s.start or 0, s.stop
    if size is None and start >= 0 and (stop is None or stop < 0):
        return (x, dim, start, ("end", stop or 0))  # a symbolic size: ``x[1:]``, ``x[:-1]`` stay end-relative
    if start < 0 or stop is None or stop < 0:
        if size is None:
            return None
        start = start + size if start < 0 else start
        stop = size if stop is None else (stop + size if stop < 0 else stop)
        start, stop = max(0, min(start, size)), max(0, min(stop, size))
    if size is not None:
        stop = min(stop, size)
    if stop < start:
        return None
    return (x, dim, start, stop)


def _split_segments(n: Node):
    """For a split/chunk/unbind node used only through ``getitem(i)``: ``(x, dim, [(a, b)...],
    {i: getitem node}, form)`` with concrete bounds; else None."""
    if not (_is_op(n, _SPLIT_FNS, ("split", "chunk", "unbind"))):
        return None
    if not n.users or any(not (u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int))
                          for u in n.users):
        return None
    form = n.target if n.op == "call_method" else n.target.__name__
    args = list(n.args)
    x = args[0]
    t = _tensor(x)
    if t is None:
        return None
    if form == "unbind":
        dim = args[1] if len(args) > 1 else n.kwargs.get("dim", 0)
    else:
        dim = args[2] if len(args) > 2 else n.kwargs.get("dim", 0)
    if not isinstance(dim, int):
        return None
    dim = _norm_dim(dim, t.dim())
    size = _dim_size(t, dim)
    if size is None:
        return None
    if form == "unbind":
        return None  # its outputs drop the dimension: not a slice of x (handled as a target form only)
    spec = args[1] if len(args) > 1 else n.kwargs.get("split_size_or_sections", n.kwargs.get("chunks"))
    if form == "chunk":
        if not isinstance(spec, int):
            return None
        step = -(-size // spec)
        sizes = [min(step, size - i) for i in range(0, size, step)] if step else []
    elif isinstance(spec, int):
        sizes = [min(spec, size - i) for i in range(0, size, spec)] if spec else []
    elif isinstance(spec, (list, tuple)) and all(isinstance(s, int) for s in spec):
        sizes = list(spec)
    else:
        return None
    bounds, a = [], 0
    for s in sizes:
        bounds.append((a, a + s))
        a += s
    users = {u.args[1]: u for u in n.users}
    if max(users) >= len(bounds):
        return None
    return (x, dim, bounds, users, form)


def _emit_segments(gm, before: Node, x: Node, dim: int, segs: list, form: str, like: Node) -> list:
    """Nodes computing ``x`` restricted to each ``(a, b)`` of ``segs`` along ``dim``, spelled ``form``:
    ``slice`` / ``narrow`` (one op per segment), ``split`` / ``chunk`` / ``unbind`` (one op for all,
    segments must tile ``[0, size)``; ``chunk`` / ``unbind`` need equal sizes)."""
    t = _tensor(x)
    ndim = t.dim()
    if form == "slice":
        out = []
        for a, b in segs:
            b = (b[1] or None) if isinstance(b, tuple) else b  # end-relative: x[a:], x[a:-k]
            idx = (Ellipsis, slice(a, b)) if dim == ndim - 1 and ndim > 1 else (slice(None),) * dim + (slice(a, b),)
            out.append(_fn(gm, before, operator.getitem, x, idx if len(idx) > 1 else idx[0], like=like))
        return out
    if form == "narrow":
        return [_method(gm, before, "narrow", x, dim, a, _length(gm, before, x, dim, a, b, like), like=like)
                for a, b in segs]
    sizes = [b - a for a, b in segs]
    if form == "split":
        whole = _fn(gm, before, torch.split, x, sizes, dim, like=like)
    elif form == "chunk":
        whole = _method(gm, before, "chunk", x, len(sizes), dim, like=like)
    else:  # unbind: split one dimension into (k, s), take each of the k rows
        k, s = len(sizes), sizes[0]
        whole = _method(gm, before, "unbind", _method(gm, before, "unflatten", x, dim, (k, s), like=like), dim,
                        like=like)
        return [_fn(gm, before, operator.getitem, whole, i, like=like) for i in range(k)]
    return [_fn(gm, before, operator.getitem, whole, i, like=like) for i in range(len(sizes))]


def _length(gm, before, x, dim, a, b, like):
    """``b - a``; for an end-relative ``b`` (a symbolic size) ``x.size(dim) + k - a`` as SymInt nodes."""
    if not isinstance(b, tuple):
        return b - a
    size = _method(gm, before, "size", x, dim, like=like)
    return size if b[1] - a == 0 else _fn(gm, before, operator.add, size, b[1] - a, like=like)


def _tiling(segs: list, size):
    """``segs`` (disjoint) completed with the gaps between them into a tiling of ``[0, size)``:
    ``(tiles, position of each seg in tiles)``; None if they overlap or the size is unknown."""
    if size is None or any(isinstance(b, tuple) for _, b in segs):
        return None
    order = sorted(range(len(segs)), key=lambda i: segs[i])
    tiles, where, a = [], {}, 0
    for i in order:
        s, e = segs[i]
        if s < a:
            return None
        if s > a:
            tiles.append((a, s))
        where[i] = len(tiles)
        tiles.append((s, e))
        a = e
    if a < size:
        tiles.append((a, size))
    return tiles, [where[i] for i in range(len(segs))]


def _respell(gm, x: Node, dim: int, segs: list, olds: list, current: str, rng: random.Random) -> bool:
    """Replace the nodes ``olds`` (each computing ``x[..., a:b]`` for its ``segs`` entry along
    ``dim``) by another spelling than ``current``."""
    size = _dim_size(_tensor(x), dim)
    tiling = _tiling(segs, size)
    forms = ["slice", "narrow"]
    if tiling is not None:
        tiles, _ = tiling
        forms.append("split")
        lens = {b - a for a, b in tiles}
        if len(lens) == 1 and len(tiles) > 1 and next(iter(lens)) > 0:
            forms += ["chunk", "unbind"]
    forms = [f for f in forms if f != current]
    if not forms:
        return False
    form = rng.choice(forms)
    before = min(olds, key=lambda o: list(gm.graph.nodes).index(o))  # all users come after the first
    if form in ("split", "chunk", "unbind"):
        tiles, where = tiling
        outs = _emit_segments(gm, before, x, dim, tiles, form, like=olds[0])
        outs = [outs[w] for w in where]
    else:
        outs = _emit_segments(gm, before, x, dim, segs, form, like=olds[0])
    for old, new in zip(olds, outs):
        old.replace_all_uses_with(new)
    for o in list(outs):
        _erase_dead(gm, o)  # tiles nobody reads are dropped again (split keeps its getitems' base)
    for old in olds:
        _erase_dead(gm, old)
    _note(gm, f"split_forms: {', '.join(o.name for o in olds)} ({current}) -> {form}")
    return True


def _slice_groups(gm: GraphModule) -> list:
    """Sites: each split-like node, and per ``(x, dim)`` the plain slices/narrows of ``x`` (one
    group if pairwise disjoint, else one site per slice)."""
    sites, by_base = [], {}
    for n in gm.graph.nodes:
        seg = _split_segments(n)
        if seg is not None:
            x, dim, bounds, users, form = seg
            idx = sorted(users)
            sites.append((x, dim, [bounds[i] for i in idx], [users[i] for i in idx],
                          "split" if form == "split" else form))
            continue
        sl = _plain_slice(n) if n.op in ("call_function", "call_method") else None
        if sl is not None:
            by_base.setdefault((sl[0], sl[1]), []).append((n, (sl[2], sl[3])))
    for (x, dim), items in by_base.items():
        segs = [s for _, s in items]
        if len(items) > 1 and _tiling(segs, _dim_size(_tensor(x), dim)) is not None:
            groups = [items]
        else:
            groups = [[it] for it in items]
        for g in groups:
            current = "narrow" if all(n.target in ("narrow", torch.narrow) for n, _ in g) else "slice"
            sites.append((x, dim, [s for _, s in g], [n for n, _ in g], current))
    return sites


def split_forms(gm: GraphModule, rng: random.Random) -> int:
    """``torch.split(x, s, dim)`` / ``chunk`` / slices ``x[..., a:b]`` / ``x.unflatten(dim, (k, s))
    .unbind(dim)`` / ``narrow`` interchanged where equivalent (concrete bounds; a split needs the
    segments to tile the dimension, gaps become unused pieces). Exact (views of the same values)."""
    return _apply(gm, rng, _slice_groups(gm), lambda site: _respell(gm, *site, rng),
                  alive=lambda site: all(_live(gm, o) for o in site[3]) and _live(gm, site[0]))


# ------------------------------------------------------------------------------------------------
# 4. mask_apply: where(m, p, 0) <-> p.masked_fill(~m, 0) <-> p * m.to(p.dtype)

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
# 5. mask_buffer: a constant tensor (mask, arange) becomes a graph input, like a registered buffer

_RANDOM = ("rand", "randn", "randint", "rand_like", "randn_like", "bernoulli", "dropout", "normal", "empty",
           "empty_like", "new_empty", "multinomial", "randperm")
_STRUCTURED = ("arange", "tril", "triu", "eye", "ge", "gt", "le", "lt", "eq", "ne", "tril_", "triu_")
_VIEWISH = (operator.getitem, operator.invert, "to", "bool", "float", "unsqueeze", "view", "reshape", "expand",
            "__getitem__", "logical_not")


def _name(n: Node) -> str:
    return n.target if n.op == "call_method" else getattr(n.target, "__name__", str(n.target))


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
    """What Dynamo records on a registered buffer's placeholder: a ``GraphArg`` whose source is
    ``L['self']._buffers[name]`` (a backend tells module state from user inputs by it)."""
    from torch._dynamo import source as S
    from torch._dynamo.variables.builder import GraphArg

    src = S.DictGetItemSource(S.UnspecializedParamBufferSource(S.UnspecializedNNModuleSource(
        S.LocalSource("self", is_input=True)), "_buffers"), name)
    return GraphArg(src, None, pass_arg_as_tensor=False, fake_tensor=fake, is_tensor=True)


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


# ------------------------------------------------------------------------------------------------
# 6. scale_move: a scalar factor moved across a linear op, or respelled

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


# ------------------------------------------------------------------------------------------------
# The registry and the wrapping backend

TRANSFORMS: dict[str, Callable[[GraphModule, random.Random], int]] = {
    "reassoc": reassoc,
    "inplace": inplace,
    "split_forms": split_forms,
    "mask_apply": mask_apply,
    "mask_buffer": mask_buffer,
    "scale_move": scale_move,
}
SIZE_TRANSFORMS = ("sizes_coincide",)  # a size choice of the run, not a graph transformation
ALL = tuple(TRANSFORMS) + SIZE_TRANSFORMS


class Metamorphic:
    """Dynamo backend: ``torch.compile(model, backend=Metamorphic(inner, transforms, seed))``
    transforms a copy of every captured graph (``transforms`` in order, each on a random subset of
    its sites drawn from ``seed`` and the graph's index) and compiles it with ``inner``. ``calls``
    holds, per backend call, the sites changed per transformation and their descriptions."""

    def __init__(self, inner=None, transforms=(), seed: int = 0):
        self.inner = inner if inner is not None else backend.hstu_eager_backend
        self.__wrapped__ = self.inner  # our frames keep hstu's Dynamo options (_compat.unwrap_backend)
        unknown = [t for t in transforms if t not in TRANSFORMS]
        if unknown:
            raise ValueError(f"unknown graph transformations {unknown}; known: {sorted(TRANSFORMS)}")
        self.transforms, self.seed = tuple(transforms), seed
        self.calls: list = []

    def __call__(self, gm: GraphModule, example_inputs):
        rng = random.Random(f"{self.seed}:{len(self.calls)}:{'+'.join(self.transforms)}")
        call = {"changed": {}, "sites": [], "errors": []}
        self.calls.append(call)
        new = copy_graph_module(gm)
        for name in self.transforms:
            trial = copy_graph_module(new)
            try:
                call["changed"][name] = TRANSFORMS[name](trial, rng)
                trial.graph.lint()
                trial.recompile()
                new = trial
            except Exception as e:  # a transformation bug must not hide the others' results
                call["changed"][name] = 0
                call["errors"].append(f"{name}: {type(e).__name__}: {e}"[:300])
        call["sites"] = list(new.meta.get("metamorphic_sites", []))
        buffers = new.meta.get("metamorphic_buffers", [])
        for key in ("metamorphic_sites", "metamorphic_buffers", "metamorphic_fake_mode"):
            new.meta.pop(key, None)
        if not buffers:
            return self.inner(new, example_inputs)
        lifted = _WithBuffers(None, [value for _, value in buffers])
        # the buffers' values are example inputs like the user's (real, or fakes of the caller's mode)
        lifted.compiled = self.inner(new, lifted.values_for(example_inputs) + list(example_inputs))
        return lifted


def _caller_fake_mode(args):
    """The fake mode of the caller's fake tensors (the fake modes), else None."""
    return next((a.fake_mode for a in args if isinstance(a, FakeTensor)), None)


class _WithBuffers:
    """The compiled function of a graph with lifted buffers: computes their values once per fake
    mode of the caller (real tensors otherwise) and passes the same tensors first on every call, as
    Dynamo passes a module's buffers (a backend may guard them by identity and version)."""

    def __init__(self, compiled, buffers: list):
        self.compiled, self.buffers, self.values = compiled, buffers, {}

    def values_for(self, args) -> list:
        mode = _caller_fake_mode(args)
        key = id(mode)
        if key not in self.values:
            ctx = mode if mode is not None else unset_fake_temporarily()
            with ctx, torch.no_grad():
                self.values[key] = [b() for b in self.buffers]
        return self.values[key]

    def __call__(self, *args):
        return self.compiled(*self.values_for(args), *args)


# ------------------------------------------------------------------------------------------------
# Cases, modes and runs

@dataclasses.dataclass
class Case:
    """A model to transform: how to build it at ``(N, H, D)`` and make inputs, and what the
    backend must do with it (``layers`` attention rewrites if HSTU; at most ``near_miss_layers``
    if not)."""

    name: str
    seed: int
    expected_hstu: bool
    layers: int
    build: Callable
    inputs: Callable  # (B, N, H, D, lengths, seed, requires_grad) -> tuple
    dtype: torch.dtype = torch.float32
    differentiable: bool = True
    near_miss_layers: int = 0
    choices: dict = dataclasses.field(default_factory=dict)
    lengths: Callable | None = None  # (B, N, seed, L=None) -> list; default: grammar_run._lengths


def grammar_case(seed_or_sample) -> Case:
    """A grammar sample as a case (same model, inputs and expectation as ``grammar_run``)."""
    s = seed_or_sample if isinstance(seed_or_sample, Sample) else sample(seed_or_sample)
    return Case(name=f"grammar:{s.seed}", seed=s.seed, expected_hstu=s.expected_hstu,
                layers=grammar_run._layers(s), build=s.build,
                inputs=lambda B, N, H, D, lengths, seed, requires_grad=False: s.inputs(
                    B, N, H, D, lengths=lengths, seed=seed, requires_grad=requires_grad),
                dtype=s.dtype, differentiable=s.differentiable,
                near_miss_layers=grammar_run._hstu_layers_of_near_miss(s), choices=dict(s.choices))


MODES = {k: v for k, v in grammar_run.MODES.items() if k != "fake_one"}  # fake_one: export only
# sizes_coincide: per mode family, sizes where two dimensions the graph reads coincide
COINCIDE = {
    "small": {"bhd_eq_n": dict(B=2, N=16, H=2, D=4), "d_eq_n": dict(B=4, N=16, H=2, D=16),
              "b_eq_h": dict(B=2, N=16, H=2, D=8)},
    "one": {"hd_eq_n": dict(B=1, N=16, H=2, D=8), "d_eq_n": dict(B=1, N=16, H=2, D=16),
            "b_eq_h": dict(B=1, N=16, H=1, D=8)},
    "production": {"bhd_eq_n": dict(B=8, N=4096, H=4, D=128), "d_eq_n": dict(B=128, N=128, H=4, D=128),
                   "b_eq_h": dict(B=4, N=4096, H=4, D=128)},
}


@dataclasses.dataclass
class Record:
    case: str
    seed: int
    mode: str
    transforms: tuple
    expected_hstu: bool
    choices: dict = dataclasses.field(default_factory=dict)
    sizes: dict = dataclasses.field(default_factory=dict)
    size_config: str = ""  # sizes_coincide: which coincidence
    changed: dict = dataclasses.field(default_factory=dict)  # transformation -> sites changed (all graphs)
    sites: list = dataclasses.field(default_factory=list)
    transform_errors: list = dataclasses.field(default_factory=list)
    counts: dict = dataclasses.field(default_factory=dict)
    reasons: list = dataclasses.field(default_factory=list)
    outcome: str = "error"
    numeric_ok: bool | None = None
    numeric_err: float | None = None
    grad_err: float | None = None
    seconds: float = 0.0
    graphs: int = 0
    error: str | None = None
    traceback: str | None = None

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["transforms"] = list(self.transforms)
        return d


def _outcome(case: Case, counts: dict) -> str:
    n = counts.get("attention", 0)
    if not case.expected_hstu:
        return "false_positive" if n > case.near_miss_layers else "near_miss_kept"
    return "rewritten" if n >= case.layers else ("partial" if n else "declined")


def _sizes(mode: str, transforms, seed: int) -> tuple[dict, str]:
    sizes = dict(MODES[mode])
    if "sizes_coincide" not in transforms:
        return sizes, ""
    family = "production" if mode.startswith("fake") else ("one" if sizes["B"] == 1 else "small")
    name = random.Random(f"sizes:{seed}").choice(sorted(COINCIDE[family]))
    return dict(COINCIDE[family][name]), name


def _lengths(case: Case, B, N, seed, L=None):
    fn = case.lengths or grammar_run._lengths
    return fn(B, N, seed, L)


def _compiled(case: Case, mode: str, meta: Metamorphic, rec: Record, grads: bool, sizes: dict):
    B, N, H, D = sizes["B"], sizes["N"], sizes["H"], sizes["D"]
    grads = grads and case.differentiable
    with contextlib.nullcontext() if case.differentiable else torch.no_grad():
        torch.manual_seed(case.seed)
        model = case.build(N, H, D)
        inputs = case.inputs(B, N, H, D, _lengths(case, B, N, case.seed), case.seed, requires_grad=grads)
        eager = grammar_run._tuple(model(*inputs))
        torch._dynamo.reset()
        backend.register()  # reset() dropped the Dynamo callbacks the import installed
        with collecting() as report:
            compiled = torch.compile(model, backend=meta, dynamic=mode in ("compile_dynamic", "compile_one"))
            got = grammar_run._tuple(compiled(*inputs))
        rec.numeric_err, rec.grad_err, rec.numeric_ok = grammar_run.compare_with_eager(
            model, inputs, eager, got, case.dtype, grads)
    return report


def _fake(case: Case, mode: str, meta: Metamorphic, sizes: dict):
    """Production sizes under ``FakeTensorMode``: ``torch.compile`` with the wrapper called on fake
    inputs inside the fake mode (``grammar_run.fake_compiled``); ``fake_auto`` marks the
    batch/row dims dynamic (``maybe_mark_dynamic``, as ``Dim.AUTO``)."""
    B, N, H, D = sizes["B"], sizes["N"], sizes["H"], sizes["D"]
    with FakeTensorMode() as fake_mode:
        torch.manual_seed(case.seed)
        model = case.build(N, H, D)
        lengths = _lengths(case, B, N, case.seed, L=B * N - 3 * N // 2) if B > 1 \
            else [grammar_run.one_length(N, case.seed)]
        inputs = case.inputs(B, N, H, D, lengths, case.seed)
    return grammar_run.fake_compiled(model, inputs, mode, fake_mode, backend_fn=meta)


def run(case, transforms=(), mode: str = "compile_static", grads: bool = False, seed: int | None = None) -> Record:
    """One case (a :class:`Case`, a grammar :class:`Sample` or a grammar seed) in one mode with the
    transformations ``transforms`` (names of ``ALL``, applied in order); never raises. The
    transformations' random choices follow ``seed`` (default: the case's seed)."""
    if not isinstance(case, Case):
        case = grammar_case(case)
    transforms = tuple(transforms)
    unknown = set(transforms) - set(ALL)
    if unknown:
        raise ValueError(f"unknown transformations {sorted(unknown)}; known: {list(ALL)}")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; known: {sorted(MODES)}")
    seed = case.seed if seed is None else seed
    sizes, size_name = _sizes(mode, transforms, seed)
    rec = Record(case.name, case.seed, mode, transforms, case.expected_hstu, dict(case.choices), sizes, size_name)
    meta = Metamorphic(backend.hstu_eager_backend, [t for t in transforms if t in TRANSFORMS], seed)
    start = time.perf_counter()
    try:
        report = _fake(case, mode, meta, sizes) if mode.startswith("fake") \
            else _compiled(case, mode, meta, rec, grads, sizes)
        rec.counts, rec.graphs = dict(report.counts), report.graphs
        rec.reasons = [r for k, r in report.near_misses if k == "attention"]
        rec.outcome = _outcome(case, rec.counts)
    except Exception as e:  # recorded, not raised: one bad model must not stop a measurement
        grammar_run.record_error(rec, e)
    finally:
        torch._dynamo.reset()
    for call in meta.calls:
        for name, k in call["changed"].items():
            rec.changed[name] = rec.changed.get(name, 0) + k
        rec.sites += call["sites"]
        rec.transform_errors += call["errors"]
    if size_name:
        rec.changed["sizes_coincide"] = 1
    rec.seconds = time.perf_counter() - start
    return rec
