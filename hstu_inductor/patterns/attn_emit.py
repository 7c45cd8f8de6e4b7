"""Attention, stage 4 (emit): replace a proven candidate by the ``hstu`` op call.

The op takes the jagged sources themselves: each is narrowed by its proven feature slices and
re-laid-out as ``[L, heads, features]`` in the head/feature digit order the structure stage found
(:func:`regroup`); ``max_seq_len`` is the constant N or the graph node holding a symbolic N
(:func:`emit_n`); ``attn_scale`` is the user's scale input times the proven factor, a constant, or
None for ``1/N`` (:func:`emit_scale`). The result is laid out like the user's output node
(:func:`replace_output`; re-padded when the graph has no unpad) and substituted for it; the dead
subgraph is left to dead-code elimination. Size reads of intermediates are re-pointed at the graph
inputs first (``sizes.py``). :func:`describe` is the one-line report of a rewrite.
"""
from __future__ import annotations

import dataclasses
import math
import operator

import sympy
import torch

from . import attn_bias, attn_intervals, attn_tables
from .attn_find import Operand, meta_val, op_name
from .attn_layout import arg_value, head_count
from .attn_structure import Plan, mode_key
from .prover import is_static, sym_expr
from .sizes import emit_source, size_source

aten = torch.ops.aten


def _fake_call(target, args, kwargs=None):
    """The traced value of ``target(*args)`` (for the new node's metadata), or None."""
    if target in _OUTPUT_SHAPES:  # our ops' bodies double as fake impls: running one costs seconds
        q, v = args[0].meta.get("val"), args[2].meta.get("val")
        if q is None or v is None:
            return None
        return v.new_empty((q.shape[0], v.shape[1], v.shape[2]))
    try:
        return target(*arg_value(args), **arg_value(kwargs or {}))
    except Exception:
        return None


_OUTPUT_SHAPES = {torch.ops.hstu.attention.default, torch.ops.hstu.delta_attention.default}


def emit_call(graph, target, args, kwargs=None):
    """A new ``call_function`` node (at the insertion point) with its traced value."""
    node = graph.call_function(target, tuple(args), kwargs or {})
    val = _fake_call(target, args, kwargs)
    if val is not None:
        node.meta["val"] = val
    return node


def _flat_stride(m, sizes, prefix):
    axis = int(m[1][len(prefix):])
    return int(m[2]) * math.prod(sizes[axis + 1:])


def regroup(graph, src, sizes, prefix, groups):
    """``src [L, *sizes]`` -> ``[L, prod(g) for g in groups]`` with the feature digits of each
    group (modes over axes ``prefix<k>``) in the given order."""
    modes = [m for g in groups for m in g]
    order = sorted(range(len(modes)), key=lambda i: -_flat_stride(modes[i], sizes, prefix))
    view_sizes = [int(modes[i][0]) for i in order]
    x = _reshape(graph, src, view_sizes)
    perm = [order.index(i) + 1 for i in range(len(modes))]
    if perm != sorted(perm):
        x = emit_call(graph, aten.permute.default, [x, [0, *perm]])
    return _reshape(graph, x, [math.prod(int(m[0]) for m in g) for g in groups])


def _reshape(graph, x, feature_sizes):
    """``x.reshape(-1, *feature_sizes)``, or ``x`` itself when it already has those sizes."""
    val = meta_val(x)
    if isinstance(val, torch.Tensor) and val.dim() == 1 + len(feature_sizes) and all(
            is_static(a) and int(a) == b for a, b in zip(val.shape[1:], feature_sizes)):
        return x
    return emit_call(graph, aten.reshape.default, [x, [-1, *feature_sizes]])


def _narrowed(graph, x: Operand):
    """The operand's jagged source with its proven feature slices applied (``src[:, a:b]``)."""
    t = x.src
    if x.flat and meta_val(t).dim() != 2:
        t = emit_call(graph, aten.reshape.default, [t, [-1, math.prod(x.feat)]])
    for k, start, length in x.narrows:
        t = emit_call(graph, aten.slice.Tensor, [t, 1 + k, start, start + length])
    return t


def emit_offsets(graph, plan):
    """The op's offsets: the user's offsets input, or ``[0, cumsum(lengths)]`` from lengths."""
    if not plan.lengths:
        return plan.offsets
    csum = emit_call(graph, aten.cumsum.default, [plan.offsets, 0])
    zero = emit_call(graph, aten.new_zeros.default, [csum, [1]])
    return emit_call(graph, aten.cat.default, [[zero, csum]])  # (constant_pad_nd's meta would specialize B)


def _reroute_size_reads(graph, plan):
    for read in plan.size_reads:
        with graph.inserting_before(read):
            new = emit_source(graph, size_source(read))
        read.replace_all_uses_with(new)


def rewrite(gm, plan: Plan):
    graph = gm.graph
    q, k, v = plan.q, plan.k, plan.v
    _reroute_size_reads(graph, plan)
    for a in plan.metadata_asserts:  # they only check an intermediate that the rewrite removes
        graph.erase_node(a)
    with graph.inserting_before(plan.out):
        q3 = regroup(graph, _narrowed(graph, q), q.feat, "q", [plan.head_modes, plan.c_modes])
        k3 = q3 if (k.src, k.narrows) == (q.src, q.narrows) else \
            regroup(graph, _narrowed(graph, k), k.feat, "q", [plan.head_modes, plan.c_modes])
        v3 = regroup(graph, _narrowed(graph, v), v.feat, "v", [plan.v_head_modes, plan.e_modes])
        dtype = meta_val(q.src).dtype
        plan.N_arg = emit_n(graph, plan)
        scale = emit_scale(graph, plan, dtype, meta_val(q.src).device)
        w, c, f, causal = (emit_param(graph, x) for x in plan.params.op_args())
        added = {name: emit_param(graph, x) for name, x in plan.params.added_op_kwargs().items()}
        plan.offsets_arg = emit_offsets(graph, plan)
        args = [q3, k3, v3, plan.offsets_arg, plan.N_arg, plan.alpha, plan.num_targets, scale, w, c, f, causal]
        call = lambda t, a, kw=None: emit_call(graph, t, a, kw)  # noqa: E731
        extra = [attn_bias.emit_rab(call, plan, plan.N_arg), attn_intervals.emit_intervals(call, plan)]
        rows = meta_val(q3).shape[0]
        rows = call(aten.sym_size.int, [q3, 0]) if isinstance(rows, torch.SymInt) else rows
        tables = attn_tables.emit_tables(call, gm, plan, plan.N_arg, rows, extra[1] is not None)
        if any(x is not None for x in tables):  # path (b): timestamps, pos_w, ts_w, ts_bounds
            extra += tables
        if any(x is not None for x in extra):  # graphs without rab / intervals keep the 12-argument call
            args += extra
        y = emit_call(graph, torch.ops.hstu.attention.default, args, added)
        replace_output(graph, plan, y, dtype)


def emit_param(graph, x):
    """A mask parameter as the op takes it: an int, or (a mask constant's symbol, plus or minus
    one, in a generalised graph) the ``SymInt`` input holding it."""
    if not isinstance(x, sympy.Expr):
        return x
    if x.is_Integer:
        return int(x)
    (sym,) = x.free_symbols
    node = next(n for n in graph.find_nodes(op="placeholder")
                if isinstance(meta_val(n), torch.SymInt) and sym_expr(meta_val(n)) == sym)
    d = int(x - sym)
    return emit_call(graph, operator.add, [node, d]) if d else node


def emit_n(graph, plan):
    """The op's ``max_seq_len``: the constant N, or the graph node holding the symbolic N (a size
    of a graph input is read with ``sym_size``)."""
    if isinstance(plan.N, int):
        return plan.N
    if isinstance(plan.N_node, tuple):
        return emit_call(graph, aten.sym_size.int, list(plan.N_node))
    return plan.N_node


def emit_scale(graph, plan, dtype, device):
    """The ``attn_scale`` argument for the hstu op: the user's scale tensor (cast, times a proven
    constant factor), a proven scalar as a 0-d tensor, or None for the default 1/N. With
    ``scale_per_n`` (symbolic N) either is divided by the runtime N."""
    if plan.scale_node is not None:
        scale = plan.scale_node
        if meta_val(scale).dtype != dtype:
            scale = emit_call(graph, aten._to_copy.default, [scale], {"dtype": dtype})
        if plan.scale_factor != 1.0:
            scale = emit_call(graph, aten.mul.Tensor, [scale, plan.scale_factor])
    elif plan.scale is not None:
        scale = emit_call(graph, aten.scalar_tensor.default, [plan.scale], {"dtype": dtype, "device": device})
    else:
        return None
    if plan.scale_per_n:
        scale = emit_call(graph, aten.div.Tensor, [scale, plan.N_arg])
    return scale


def replace_output(graph, plan, y, dtype):
    """Lay the op's ``[rows, H, Dv]`` result out as the user's output node and substitute it."""
    heads = [int(m[0]) for m in plan.head_modes]
    es = [int(m[0]) for m in plan.e_modes]
    ykeys = [mode_key(m) for m in list(plan.head_modes) + list(plan.e_modes)]
    perm = [ykeys.index(mode_key(m)) + 1 for m in plan.out_rest]
    x = _reshape(graph, y, [*heads, *es])
    if perm != sorted(perm):
        x = emit_call(graph, aten.permute.default, [x, [0, *perm]])
    out_val = meta_val(plan.out)
    if plan.dense:
        x = _pad_rows(graph, plan, _reshape(graph, x, plan.rest_shape), y)
    else:
        x = _reshape(graph, x, [int(s) for s in out_val.shape[1:]])
    if out_val.dtype != dtype:
        x = emit_call(graph, aten._to_copy.default, [x], {"dtype": out_val.dtype})
    plan.out.replace_all_uses_with(x)


def _pad_rows(graph, plan, x, y):
    """``x [L, *rest]`` -> the dense output's shape, zero rows past each length (index_put into
    zeros on flat rows ``b*N + p``; differentiable, no data-dependent sizes)."""
    offsets = plan.offsets_arg
    L = emit_call(graph, aten.sym_size.int, [y, 0])
    rows = emit_call(graph, aten.arange.start, [0, L], {"dtype": torch.int64, "device": meta_val(y).device})
    seq = emit_call(graph, aten.sub.Tensor, [emit_call(graph, aten.searchsorted.Tensor, [offsets, rows], {"right": True}), 1])
    pos = emit_call(graph, aten.sub.Tensor, [rows, emit_call(graph, aten.index.Tensor, [offsets, [seq]])])
    flat = emit_call(graph, aten.add.Tensor, [emit_call(graph, aten.mul.Tensor, [seq, plan.N_arg]), pos])
    B = emit_call(graph, operator.sub, [emit_call(graph, aten.sym_size.int, [offsets, 0]), 1])
    zeros = emit_call(graph, aten.new_zeros.default, [x, [emit_call(graph, operator.mul, [B, plan.N_arg]), *plan.rest_shape]])
    dense = emit_call(graph, aten.index_put.default, [zeros, [flat], x])
    sizes = [plan.N_arg if not is_static(s) else int(s) for s in meta_val(plan.out).shape[1:]]  # no int(SymInt): a guard
    return emit_call(graph, aten.reshape.default, [dense, [-1, *sizes]])


def describe_scale(plan) -> str:
    per_n = "/N" if plan.scale_per_n else ""
    if plan.scale_node is not None:
        return f"attn_scale={plan.scale_node.name}" + (f"*{plan.scale_factor:g}" if plan.scale_factor != 1 else "") \
            + per_n
    return f"scale={plan.scale:g}{per_n}" if plan.scale is not None else "scale=1/N"


def describe(plan: Plan) -> str:
    parts = [f"N={plan.N}" + ("" if isinstance(plan.N, int) else " (symbolic)"), f"alpha={plan.alpha:g}", f"heads={head_count(plan.head_modes)}"]
    parts.append(describe_scale(plan))
    if plan.num_targets is not None:
        parts.append(f"num_targets={plan.num_targets.name}")
    if plan.lengths:
        parts.append(f"offsets from lengths {plan.offsets.name}")
    if plan.dense:
        parts.append("dense output, no unpad in this graph")
    for field in dataclasses.fields(plan.params):  # the mask options that are not their defaults
        x = getattr(plan.params, field.name)
        x = int(sympy.sympify(x).subs(plan.constants)) if isinstance(x, sympy.Expr) else x
        if x != field.default:
            parts.append(f"{field.name}={x}")
    parts += [x for x in (attn_bias.describe(plan), attn_tables.describe(plan), attn_intervals.describe(plan)) if x]
    if plan.rab is not None and plan.rab.table_reasons:
        parts.append("stays dense: " + "; ".join(plan.rab.table_reasons))
    pads = sorted({op_name(x.D) for x in (plan.q, plan.k, plan.v)})
    if any(x.narrows for x in (plan.q, plan.k, plan.v)):
        pads.append(f"feature slices of {'/'.join(sorted({x.D.name for x in (plan.q, plan.k, plan.v)}))}")
    return f"silu attention ({', '.join(parts)}; pad via {'/'.join(pads)}, {'no unpad' if plan.dense else 'unpad via ' + op_name(plan.out)})"
