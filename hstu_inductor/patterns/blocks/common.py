"""Shared tools of the block rewriters: FX helpers, casts, mutation checks, the numeric probe."""
from __future__ import annotations

import operator
from typing import Callable, Optional

import torch
from torch.fx import Graph, GraphModule, Node

aten = torch.ops.aten


class Decline(Exception):
    """A recognisable candidate whose semantics could not be proven; the message is the reason."""


# ---------------------------------------------------------------------------------------------
# FX helpers
# ---------------------------------------------------------------------------------------------
def _is(n, *targets) -> bool:
    return isinstance(n, Node) and n.op == "call_function" and n.target in targets


def _val(n):
    return n.meta.get("val") if isinstance(n, Node) else n


def _tval(n) -> Optional[torch.Tensor]:
    v = _val(n)
    return v if isinstance(v, torch.Tensor) else None


def _name(n) -> str:
    if isinstance(n, Node):
        return f"{n.name} ({_target_name(n)})" if n.op == "call_function" else n.name
    return repr(n)


def _target_name(n: Node) -> str:
    t = n.target
    if t is operator.getitem:
        return "getitem"
    return str(getattr(t, "__name__", t)) if not isinstance(t, torch._ops.OpOverload) else str(t).replace(".default", "")


def _getitem_of(n, idx: int) -> Optional[Node]:
    """``src`` if ``n`` is ``src[idx]``."""
    if _is(n, operator.getitem) and n.args[1] == idx:
        return n.args[0]
    return None


def _eq(a, b) -> bool:
    """Sizes equal without adding guards (ints or SymInts)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    try:
        return bool(statically_known_true(a == b))
    except Exception:
        return False


def _static(v) -> Optional[int]:
    """A concrete int for an int or a SymInt that is a known constant, else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, torch.SymInt):
        try:
            expr = v.node.expr
            if expr.is_number:
                return int(expr)
        except Exception:
            return None
    return None


def _shape_is(t: torch.Tensor, *dims) -> bool:
    return t is not None and t.dim() == len(dims) and all(_eq(a, b) for a, b in zip(t.shape, dims))


_VIEW_TARGETS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _same_tensor(a, b) -> bool:
    """``a`` and ``b`` are the same value: the same node, or identical views of the same node."""
    if a is b:
        return True
    if _is(a, *_VIEW_TARGETS) and _is(b, *_VIEW_TARGETS):
        return _same_tensor(a.args[0], b.args[0]) and list(a.args[1]) == list(b.args[1])
    return False

def _order(graph: Graph) -> dict:
    return {n: i for i, n in enumerate(graph.nodes)}


def _fake_call(target, args, kwargs=None):
    """meta['val'] for a new node: run ``target`` on the fake values of ``args`` (nodes or values)."""
    vals = torch.fx.node.map_arg(tuple(args), _val)  # nested too: view sizes may hold SymInt nodes
    modes = [v.fake_mode for v in vals if isinstance(v, torch.Tensor) and hasattr(v, "fake_mode")]
    if not modes:
        return None
    # the graph's meta values may belong to a different fake mode than the one active around us
    with modes[0]:
        return target(*vals, **torch.fx.node.map_arg(dict(kwargs or {}), _val))


def _call(graph: Graph, target, args, kwargs=None) -> Node:
    node = graph.call_function(target, tuple(args), kwargs or {})
    val = _fake_call(target, args, kwargs)
    if val is not None:
        node.meta["val"] = val
    return node


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dim() == b.dim() and all(_eq(x, y) for x, y in zip(a.stride(), b.stride()))
            and _eq(a.storage_offset(), b.storage_offset()))


def _strides_free(node: Node, val) -> bool:
    """Whether ``node``'s users compute the same when ``node`` holds ``val``: its values, maybe with
    other strides. Only view ops can tell, by failing (``view`` of incompatible strides) or by reading
    strides (``as_strided``): they are re-run on fake values and their own users checked likewise; a
    graph output would show the caller other strides than eager's."""
    old = _tval(node)
    if old is not None and _same_layout(old, val):
        return True
    for user in node.users:
        t = user.target
        if user.op == "output" or t is aten.as_strided.default:
            return False
        if t is operator.getitem:  # a piece of a multi-output view (split)
            out = val[user.args[1]]
        elif getattr(t, "is_view", False) or t is aten._unsafe_view.default:
            try:
                out = _fake_call(t, [val if a is node else a for a in user.args], user.kwargs)
            except Exception:  # e.g. view: "view size is not compatible with input tensor's size and stride"
                return False
        else:
            continue
        if not _strides_free(user, out):
            return False
    return True


def _replace_by_view(graph: Graph, old: Node, new: Node) -> None:
    """``old.replace_all_uses_with(new)`` for a ``new`` view holding ``old``'s values: a contiguous copy
    of it where ``old``'s users depend on strides the view does not have (``_strides_free``)."""
    if not _strides_free(old, _val(new)):
        with graph.inserting_after(new):
            new = _call(graph, aten.clone.default, [new], {"memory_format": torch.contiguous_format})
    old.replace_all_uses_with(new)


def _getitem(graph: Graph, src: Node, i: int) -> Node:
    node = graph.call_function(operator.getitem, (src, i))
    if "val" in src.meta:
        node.meta["val"] = src.meta["val"][i]
    return node


# ---------------------------------------------------------------------------------------------
# Memory: which tensors share storage, which ops write into their arguments
# ---------------------------------------------------------------------------------------------
def _tensors(v) -> list:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _tensors(x)]
    return []


def _storage(t: torch.Tensor):
    """A key for the (fake) storage of ``t``: views share it, fresh results do not. None if unknown."""
    try:
        from torch.multiprocessing.reductions import StorageWeakRef

        return StorageWeakRef(t.untyped_storage())
    except Exception:
        return None


def _storages(n) -> Optional[set]:
    """The storages ``n``'s value lives in (several for a tuple value); None when one is unknown."""
    ts = _tensors(_val(n))
    out = {_storage(t) for t in ts}
    return None if not ts or None in out else out


def _flat_nodes(v) -> list:
    if isinstance(v, Node):
        return [v]
    if isinstance(v, (list, tuple)):
        return [x for a in v for x in _flat_nodes(a)]
    return []


#: ops whose destination, after the call, aliases the *source* tensor (not just its values)
_ALIASING_SOURCE = tuple(t for t in (getattr(aten.set_, o, None)
                                     for o in ("source_Tensor", "source_Tensor_storage_offset")) if t is not None)


def _written_args(n: Node) -> Optional[list]:
    """The nodes ``n`` writes into: the arguments its schema marks ``(a!)``; [] for a pure op; None when
    unknown (a higher-order op, e.g. a user Triton kernel, may write into any tensor it is given)."""
    if n.op != "call_function" or n.target is operator.getitem:
        return []
    if isinstance(n.target, torch._ops.HigherOrderOperator):
        return None
    schema = getattr(n.target, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            out += _flat_nodes(n.args[i] if i < len(n.args) else n.kwargs.get(a.name))
    return out


def _writes_into(user: Node, t: Node) -> bool:
    """Whether the call ``user`` may modify ``t`` in place (``t`` as a written argument, or handed to an op
    that may write anywhere). Reading ``t`` as the *source* of an in-place op into another buffer
    (``zeros.index_add_(0, i, t)``, ``buf[i] = t``, ``buf.copy_(t)``) does not modify ``t``."""
    written = _written_args(user)
    if written is None:
        return True
    if user.target in _ALIASING_SOURCE:
        return True  # the destination becomes an alias of t: later writes into it would modify t
    return any(w is t for w in written)


def _closure(outputs: list, inputs: list) -> list:
    """The call nodes computing ``outputs`` from ``inputs`` (stopping there and at non-calls)."""
    stop = {id(n) for n in inputs if n is not None}
    seen, stack = {}, list(outputs)
    while stack:
        n = stack.pop()
        if not isinstance(n, Node) or id(n) in stop or n in seen or n.op != "call_function":
            continue
        seen[n] = True
        stack += n.all_input_nodes
    return list(seen)


def _check_no_mutation(graph: Graph, first: Node, last: Node, what: str, reads: list) -> None:
    """No in-place op between ``first`` and ``last`` (inclusive, graph order) writes into memory the block
    reads: the fused op reads its inputs at ``last``, the user's code read them where it computed the
    block. ``reads``: the op's inputs and the matched nodes. A write into another buffer (a zero buffer
    being filled, whatever its source) is not a mutation of the block; a write into a graph input is
    taken as one (inputs may share memory with each other)."""
    read_st: set = set()
    known = True
    for r in reads:
        if r is None or (_val(r) is not None and not _tensors(_val(r))):  # no bias, or a size: no memory
            continue
        st = _storages(r)
        known &= st is not None
        read_st |= st or set()
    inputs_st: set = set()
    for n in graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            inputs_st |= _storages(n) or set()
    seen = False
    for n in graph.nodes:
        if n is first:
            seen = True
        if seen and n.op == "call_function":
            written = _written_args(n)
            for w in (written if written is not None else [None]):
                st = _storages(w) if w is not None else None
                if not known or st is None or st & (read_st | inputs_st) or n.target in _ALIASING_SOURCE:
                    raise Decline(f"{what}: in-place op {_name(n)} inside the matched region"
                                  + (f" writes into {_name(w)}" if w is not None else ""))
        if n is last:
            return


# ---------------------------------------------------------------------------------------------
# Stage: casts (x.float() / .to(dtype) / .type_as)
# ---------------------------------------------------------------------------------------------
def _cast_of(n) -> Optional[Node]:
    """``src`` if ``n`` is a pure dtype conversion ``_to_copy(src, dtype=...)`` (nothing else)."""
    if not _is(n, aten._to_copy.default) or len(n.args) != 1:
        return None
    extra = set(n.kwargs) - {"dtype", "layout", "device", "memory_format"}
    if extra or n.kwargs.get("memory_format") not in (None, torch.preserve_format):
        return None
    src, sv, nv = n.args[0], _tval(n.args[0]), _tval(n)
    if sv is None or nv is None or sv.device != nv.device or not sv.dtype.is_floating_point:
        return None
    return src


def _strip_fp32_cast(n):
    """Parameter upcast ``w.float()``: the op upcasts norm parameters itself."""
    src = _cast_of(n)
    if src is not None and _tval(n).dtype == torch.float32:
        return src
    return n


# ---------------------------------------------------------------------------------------------
# Numeric probe: run the matched subgraph on fresh random inputs and compare with the hstu op.
# ---------------------------------------------------------------------------------------------
_PROBE_ROWS = 6
_PROBE_TOL = {torch.float64: 1e-9, torch.float32: 2e-4, torch.float16: 3e-2, torch.bfloat16: 5e-2}


def _probe(inputs: list, row_inputs: set, outputs: list, op_fn: Callable, rows,
           passthrough: Optional[dict] = None) -> Optional[str]:
    """None when the subgraph ``inputs -> outputs`` equals ``op_fn(*probe_inputs)`` (a list of
    tensors, reshaped to the outputs' shapes) on random data; otherwise the reason.
    ``passthrough`` maps nodes to evaluate as their given source (a dropout taken as identity).

    ``rows`` is the row count L (int or SymInt). Static L: the probe uses ``min(L, 6)`` rows and
    substitutes the row count in the few row-carrying args of the copied nodes (group norm N,
    view shapes' leading dim). Symbolic L: its symbol is set to 6.
    """
    import sympy

    from ... import _compat

    L_static = _static(rows)
    Lp = min(L_static, _PROBE_ROWS) if L_static is not None else _PROBE_ROWS
    if L_static == 0:
        return "no rows to probe"
    subs: dict = {}
    if L_static is None:
        expr = rows.node.expr
        if not isinstance(expr, sympy.Symbol):
            return f"row count {expr} is not a plain symbol"
        subs[expr] = sympy.Integer(Lp)

    def concrete(v):
        if isinstance(v, torch.SymInt):
            e = v.node.expr.xreplace(subs)
            if not e.is_number:
                raise Decline(f"symbolic size {v.node.expr}")
            return int(e)
        return v

    def fix_rows(v):
        return Lp if (L_static is not None and isinstance(v, int) and v == L_static) else v

    passthrough = passthrough or {}
    input_set = {id(n): i for i, n in enumerate(inputs)}
    order = _order(outputs[0].graph)
    closure, stack = {}, list(outputs)
    while stack:
        n = stack.pop()
        if id(n) in input_set or n in closure:
            continue
        if n in passthrough:
            stack.append(passthrough[n])
            continue
        if isinstance(_val(n), torch.SymInt):
            continue
        if n.op != "call_function":
            return f"subgraph depends on {n.name} outside the match"
        closure[n] = True
        for a in (*n.args, *n.kwargs.values()):
            for x in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(x, Node):
                    stack.append(x)
    g = Graph()
    env: dict = {}
    for i, n in enumerate(inputs):
        if n is not None:
            env[n] = g.placeholder(f"in{i}")

    def arg(x):
        if isinstance(x, Node):
            x = passthrough.get(x, x)
            if x in env:
                return env[x]
            return concrete(_val(x))
        return x

    try:
        for n in sorted(closure, key=order.__getitem__):
            args = torch.fx.node.map_aggregate(n.args, arg)
            kwargs = torch.fx.node.map_aggregate(n.kwargs, arg)
            if n.target is aten.native_group_norm.default:
                args = (*args[:3], fix_rows(args[3]), *args[4:])
            elif n.target is aten._to_copy.default:  # the probe runs on CPU: keep the dtype only
                kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "layout")}
            elif n.target in _VIEW_TARGETS:
                shape = list(args[1])
                args = (args[0], [fix_rows(shape[0]), *shape[1:]], *args[2:])
            env[n] = g.call_function(n.target, tuple(args), dict(kwargs))
        g.output(tuple(env[o] for o in outputs))
        gen = torch.Generator().manual_seed(20240917)
        with _compat.no_fake_mode(), torch.no_grad():
            real = []
            for n in inputs:
                if n is None:
                    real.append(None)
                    continue
                v = _tval(n)
                shape = [concrete(s) for s in v.shape]
                if n in row_inputs and L_static is not None:
                    shape[0] = Lp
                if not v.dtype.is_floating_point:
                    return f"probe input {n.name} is not floating point"
                real.append(torch.randn(shape, generator=gen, dtype=torch.float32).to(v.dtype))
            got = GraphModule(torch.nn.Module(), g)(*[r for r in real if r is not None])
            want = op_fn(*real)
            for o, a, b in zip(outputs, got, want):
                b = b.reshape(a.shape)
                tol = _PROBE_TOL.get(a.dtype, 1e-4)
                err = (a.double() - b.double()).abs().max().item() / (b.double().abs().max().item() + 1e-12)
                if not err <= tol:
                    return f"output {o.name} differs from the hstu op by {err:.2e} (relative)"
    except Decline as e:
        return str(e)
    except Exception as e:  # a probe that cannot run proves nothing
        return f"probe failed: {type(e).__name__}: {e}"
    return None

def _rewrite_each(gm, report, kind, candidates, rewrite_at, wanted) -> None:
    """Try ``rewrite_at`` on every candidate still in the graph; a Decline becomes a near miss."""
    changed = False
    for n in candidates:
        if n.graph is not gm.graph or not wanted(n):
            continue
        try:
            changed |= rewrite_at(gm, n, report)
        except Decline as e:
            report.near_misses.append((kind, str(e)))
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
def _quiet(fn, *args):
    """``fn(*args)``, or None where it declines (used to look for candidates, not to prove them)."""
    try:
        return fn(*args)
    except Decline:
        return None

