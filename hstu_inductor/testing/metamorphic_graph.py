"""Graph helpers of the metamorphic transformations (``metamorphic``), shared by all of them.

A transformation reads the torch-level FX graph Dynamo captured through its example values
(``node.meta["example_value"]``: dtypes, shapes) and writes new nodes that get an example value of
their own, computed in the graph's fake mode, so that a later transformation can read them too.
Here: reading example values, creating nodes (``_new`` / ``_fn`` / ``_method``), replacing and
erasing what a rewrite leaves dead, noting the changed sites, drawing a random subset of a
transformation's sites (``_apply``), and copying a Dynamo graph module. Nothing here knows a
particular transformation.
"""
from __future__ import annotations

import contextlib
import operator
import random
from typing import Callable

import torch
from torch.fx import GraphModule, Node

from .. import _compat

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)

# sums and products as Dynamo writes them (``a + b``) or as torch calls: read by several transformations
_ADD, _SUB, _MUL = (operator.add, torch.add), (operator.sub, torch.sub), (operator.mul, torch.mul)


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


def _name(n: Node) -> str:
    return n.target if n.op == "call_method" else getattr(n.target, "__name__", str(n.target))


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
