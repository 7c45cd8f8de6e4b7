"""Constant buffers made explicit: ``zeros``/``full`` with their dtype and device spelled out.

Users allocate the zero buffer of a pad in many ways: ``t.new_zeros(...)``, ``torch.zeros_like(t)``,
``t.new_full(..., 0.0)``, ``torch.empty(...).zero_()`` / ``.fill_(0.0)``, or ``torch.zeros(...)``
with the default dtype. They all compute the same constant tensor, but two of them get in the way
of the attention proof: the ``*_like`` / ``new_*`` forms read another float tensor (only its
metadata, but the pad then seems to read two float tensors), and a buffer without an explicit dtype
stays float32 in the float64 probes (``index_put`` then fails on the dtype mismatch), while
``empty`` is uninitialised until its in-place fill.

``make_explicit`` replaces each of them by ``aten.zeros`` / ``aten.full`` with the dtype and device of
the node's own value (its traced metadata) and sizes taken from that value too (a symbolic size
is read from the template tensor with ``sym_size``, a metadata read). Exact: the new node computes
the same tensor; nothing else in the graph changes.
"""
from __future__ import annotations

from typing import Optional

import torch

from .prover import sym_expr
from .sizes import emit_source, expr_source

aten = torch.ops.aten

_LIKE = {aten.zeros_like.default: 0.0, aten.ones_like.default: 1.0, aten.full_like.default: None}
_NEW = {aten.new_zeros.default: 0.0, aten.new_ones.default: 1.0, aten.new_full.default: None}
_FACTORY = {aten.zeros.default: 0.0, aten.ones.default: 1.0, aten.full.default: None}
# in place, or their functional twins in a functionalised graph (pipeline: graphs with in-place ops)
_FILL = {aten.zero_.default: 0.0, aten.fill_.Scalar: None, aten.zero.default: 0.0, aten.fill.Scalar: None}


def _val(n):
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else None


def _sizes(graph, node, template) -> Optional[list]:
    """Sizes of ``node``'s value as graph arguments: ints, or ``sym_size(template, d)`` nodes."""
    val, tval = _val(node), _val(template)
    out = []
    for d, s in enumerate(val.shape):
        if isinstance(s, int):
            out.append(s)
        elif (src := expr_source(graph, sym_expr(s))) is not None:  # from the inputs' sizes
            with graph.inserting_before(node):
                out.append(emit_source(graph, src))
        elif tval is not None and d < tval.dim() and tval.shape[d] is s:
            with graph.inserting_before(node):
                sz = graph.call_function(aten.sym_size.int, (template, d))
            sz.meta["val"] = s
            out.append(sz)
        else:
            return None
    return out


def _emit(graph, node, sizes, fill) -> torch.fx.Node:
    val = _val(node)
    kwargs = {"dtype": val.dtype, "device": val.device, "pin_memory": False}
    with graph.inserting_before(node):
        if fill == 0.0:
            new = graph.call_function(aten.zeros.default, (sizes,), kwargs)
        else:
            new = graph.call_function(aten.full.default, (sizes, fill), kwargs)
    new.meta.update(node.meta)
    return new


def _replacement(graph, n) -> Optional[tuple]:
    """(node to replace, sizes, fill value) for a constant buffer spelling, else None."""
    val = _val(n)
    if not isinstance(val, torch.Tensor) or val.layout != torch.strided:
        return None
    if n.target in _LIKE:
        fill = _LIKE[n.target] if _LIKE[n.target] is not None else n.args[1]
        if n.kwargs.get("memory_format") not in (None, torch.preserve_format, torch.contiguous_format):
            return None
        sizes = _sizes(graph, n, n.args[0])
        return (n, sizes, fill) if sizes is not None else None
    if n.target in _NEW:
        fill = _NEW[n.target] if _NEW[n.target] is not None else n.args[2]
        return (n, list(n.args[1]), fill)
    if n.target in _FACTORY and "dtype" not in n.kwargs:  # default dtype: spell it out
        fill = _FACTORY[n.target] if _FACTORY[n.target] is not None else n.args[1]
        return (n, list(n.args[0]), fill)
    if n.target in _FILL:  # torch.empty(...) / x.new_empty(...) / empty_like(x), then .zero_() / .fill_(c)
        buf = n.args[0]
        if not (isinstance(buf, torch.fx.Node) and len(buf.users) == 1 and not buf.kwargs.get("memory_format")):
            return None
        if buf.target is aten.empty.memory_format:
            sizes = list(buf.args[0])
        elif buf.target is aten.new_empty.default:
            sizes = list(buf.args[1])
        elif buf.target is aten.empty_like.default:
            sizes = _sizes(graph, buf, buf.args[0])
        else:
            return None
        fill = _FILL[n.target] if _FILL[n.target] is not None else n.args[1]
        return (n, sizes, fill) if sizes is not None else None
    return None


def make_explicit(gm: torch.fx.GraphModule) -> int:
    """Rewrite every constant-buffer spelling of ``gm`` to an explicit ``zeros`` / ``full`` (in
    place). Returns how many nodes were replaced."""
    graph, count = gm.graph, 0
    for n in list(graph.nodes):
        if n.op != "call_function":
            continue
        fill_val = None
        m = _replacement(graph, n)
        if m is None:
            continue
        node, sizes, fill_val = m
        if not isinstance(fill_val, (int, float)) or isinstance(fill_val, bool):
            continue  # a fill value that is a tensor or symbolic: left as written
        new = _emit(graph, node, sizes, float(fill_val) if _val(node).dtype.is_floating_point else fill_val)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        count += 1
    if count:
        graph.eliminate_dead_code()
        gm.recompile()
    return count
