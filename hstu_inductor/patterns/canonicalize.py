"""Exact rewrites of a Dynamo (torch-level) graph, run before the ATen retrace.

Nested jagged tensors (NJT) do not survive ``_compat.trace_aten``: the retrace reads the NJT's
values through a ``detach``, so in training the pads built from them would lose their gradient
(and the attention rewriter declines them). The common use of an NJT in attention code is a pad:

    nt = nested_view_from_values_offsets_lengths(values, offsets, None, ragged_idx=1, ...)
    padded = nt.to_padded_tensor(padding, output_size=(B, N, *values.shape[1:]))

which is replaced by ``reference.jagged_to_padded(values, offsets, N, padding)``, plain
differentiable gather/where code that reads ``values`` directly.

Exactness (torch/nested/_internal/ops.py, ``to_padded_tensor_default``): an NJT without lengths
and with ragged dim 1 pads through ``aten._jagged_to_padded_dense_forward(values, [offsets],
[output_size[1]], padding)``: ``out[b, i] = values[offsets[b] + i]`` for ``i < min(n_b, N)``,
``padding`` elsewhere; rows past ``offsets[-1]`` are never read. ``jagged_to_padded`` computes the
same (bitwise, tested in ``tests/patterns/test_canonicalize.py``) and its gradient w.r.t. values
is the scatter of the padded gradient's in-sequence rows, as eager NJT's. Outside the jagged
contract (a sequence longer than ``N``, or ``offsets[-1] < L``) the forward still agrees; eager
NJT's backward raises there, while this one gives the gradient of the truncating forward.
The other ``output_size`` entries are ignored by NJT; we still require them to be ``B`` and the
feature sizes (provably, without guards) and leave anything unusual alone. Without ``output_size`` NJT pads
to its cached max seqlen (``nested_tensor_from_jagged(..., max_seqlen=N)``) or else to ``L``, the traced
output's width either way: taken when that width is a plain int.

The canonicalised graph is a copy: when no rewriter fires afterwards, the pipeline hands the
original graph to stock Inductor, exactly as before.
"""
from __future__ import annotations

import copy
import inspect
import logging
import numbers

import torch

from .. import _compat
from ..reference.jagged import jagged_to_padded

log = logging.getLogger("hstu_inductor")

__all__ = ["canonicalize", "grad_losing_njt"]


def _val(x):
    return x.meta.get("example_value", x.meta.get("val")) if isinstance(x, torch.fx.Node) else x


def _same_size(a, b) -> bool:
    """``a == b`` for ints/SymInts, decided without adding guards (undecidable -> False)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if not isinstance(a, (int, torch.SymInt)) or isinstance(a, bool):
        return False
    return bool(statically_known_true(a == b))


def _to_padded_args(node):
    """``(nt, padding, output_size)`` of a ``to_padded_tensor`` call, or None."""
    if node.op == "call_method" and node.target == "to_padded_tensor":
        names = ("self", "padding", "output_size")
    elif node.op == "call_function" and node.target is torch.nested.to_padded_tensor:
        names = ("input", "padding", "output_size")
    else:
        return None
    if len(node.args) > 3 or any(k not in names for k in node.kwargs):
        return None
    bound = dict(zip(names, node.args))
    for k, v in node.kwargs.items():
        if k in bound:
            return None
        bound[k] = v
    if names[0] not in bound or "padding" not in bound:
        return None
    return bound[names[0]], bound["padding"], bound.get("output_size")


def _njt_source(nt):
    """``(values, offsets)`` when ``nt`` is built by ``nested_view_from_values_offsets_lengths``
    with no lengths and ragged dim 1 from a dense values tensor and 1-D int offsets; else None."""
    target = _compat.njt_view_target()
    if target is None or not isinstance(nt, torch.fx.Node) or nt.op != "call_function" or nt.target is not target:
        return None
    try:
        bound = inspect.signature(target).bind(*nt.args, **nt.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    a = bound.arguments
    values, offsets = a["values"], a["offsets"]
    if a["lengths"] is not None or a["ragged_idx"] != 1:
        return None
    vv, ov = _val(values), _val(offsets)
    if not (isinstance(values, torch.fx.Node) and isinstance(vv, torch.Tensor) and not vv.is_nested
            and vv.dim() >= 1 and vv.is_floating_point()):
        return None
    if not (isinstance(offsets, torch.fx.Node) and isinstance(ov, torch.Tensor) and not ov.is_nested
            and ov.dim() == 1 and ov.dtype in (torch.int32, torch.int64)):
        return None
    return values, offsets


def _match(node):
    """``(nt, values, offsets, N, padding)`` for a to_padded_tensor we may replace, else None."""
    call = _to_padded_args(node)
    if call is None:
        return None
    nt, padding, size = call
    src = _njt_source(nt)
    if src is None:
        return None
    values, offsets = src
    # A padding that is a graph value (SymFloat) or a bool is left alone.
    if isinstance(padding, bool) or not isinstance(padding, numbers.Real):
        return None
    vv, ov = _val(values), _val(offsets)
    if size is None:
        # NJT pads to its cached max seqlen (``max_seqlen=`` at construction) or else to L: the width of
        # the traced output either way. Taken when it is a plain int (a symbolic one has no node to read).
        out = _val(node)
        width = out.shape[1] if isinstance(out, torch.Tensor) and out.dim() == vv.dim() + 1 else None
        if not isinstance(width, int) or isinstance(width, bool):
            return None
        size = [ov.shape[0] - 1, width, *vv.shape[1:]]
    if not isinstance(size, (list, tuple)):
        return None
    if len(size) != vv.dim() + 1:
        return None
    n = size[1]
    n_val = _val(n)
    if isinstance(n_val, bool) or not isinstance(n_val, (int, torch.SymInt)):
        return None
    if isinstance(n_val, int) and n_val < 0:
        return None
    expected = [ov.shape[0] - 1, None, *vv.shape[1:]]
    if not all(e is None or _same_size(_val(s), e) for s, e in zip(size, expected)):
        return None
    out = _val(node)
    if not (isinstance(out, torch.Tensor) and out.dtype == vv.dtype):
        return None
    return nt, values, offsets, n, padding


def canonicalize(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` itself when nothing applies, else a copy with every matching NJT pad replaced.

    The NJT node is removed when the pad was its only user; otherwise it stays for its other
    users (the replaced pad reads ``values`` directly, which is exact either way).
    """
    target = _compat.njt_view_target()
    if target is None or not gm.graph.find_nodes(op="call_function", target=target):
        return gm
    if not any(_match(n) is not None for n in gm.graph.nodes):
        return gm
    graph = copy.deepcopy(gm.graph)  # Graph.__deepcopy__ copies node meta shallowly (fake values shared)
    replaced = 0
    for node in list(graph.nodes):
        m = _match(node)
        if m is None:
            continue
        nt, values, offsets, n, padding = m
        with graph.inserting_before(node):
            pad = graph.call_function(jagged_to_padded, (values, offsets, n, padding))
        pad.meta = dict(node.meta)
        node.replace_all_uses_with(pad)
        graph.erase_node(node)
        if not nt.users:
            graph.erase_node(nt)
        replaced += 1
    graph.lint()
    log.debug("hstu_inductor: %d nested-tensor pad(s) replaced by jagged_to_padded", replaced)
    return torch.fx.GraphModule(gm, graph, gm.__class__.__name__)


def grad_losing_njt(gm: torch.fx.GraphModule):
    """The first node whose value is a nested jagged tensor that requires grad, or None.

    The ATen retrace detaches such a tensor's values, so any rewrite of that retrace would drop
    its gradient: the pipeline does not retrace such graphs. Grad mode is part of Dynamo's guards,
    and a fake NJT reports its values' ``requires_grad`` even under ``no_grad``, hence both checks.
    """
    if not torch.is_grad_enabled():
        return None
    for node in gm.graph.nodes:
        val = _val(node)
        if _compat.is_njt(val) and val.requires_grad:
            return node
    return None
