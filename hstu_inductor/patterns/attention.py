"""Rewriter "attention": find silu attention over jagged sequences, prove it, call hstu.attention.

How a candidate is found and proven (details and the argument in ``docs/patterns.md``):

1. **Anchor.** A ``bmm`` ``O = X @ Y`` whose left operand ``X`` is reached from another ``bmm``
   ``S = A @ K`` through shape-preserving ops only, with ``S`` square in its last two dims.
2. **Structure (layout algebra, ``attn_layout``).** ``A``, ``K`` and ``Y`` are followed back through
   layout ops and scalar multiplies to the dense tensors ``D`` that feed them, and ``O`` forward
   to the dense tensor the unpad reads. Each ``D`` is taken to be ``pad(src)`` viewed as
   ``D.shape``; the algebra then says which logical element (sequence ``b``, row ``n``, feature
   digits of ``src``) sits at every position of every operand, so the contractions are checked
   exactly: ``S`` contracts q/k features within a head, its batch covers every sequence and head
   once, ``X`` and ``Y`` pair the same (sequence, head), ``O`` is read back row by row.
3. **Meaning (``prover``).** The user's own nodes are run on random probes: each pad subgraph
   must equal ``reference.jagged_to_padded``; the score subgraph (``S`` -> ``X``, including the
   mask built from offsets/num_targets) must equal ``mask * s * silu(alpha * S)`` for candidate
   constants taken from the graph; the unpad must read rows ``(b, n)`` of every jagged row.
4. **Rewrite.** The jagged output node is replaced by ``hstu.attention`` on the jagged sources
   (re-laid-out as ``[L, H, D]`` with the proven head split); the dead subgraph is removed by DCE.

Anything unproven is reported as a near miss with the reason.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import operator
import random
import time
from typing import Optional

import sympy
import torch

from .. import _compat, config
from . import attn_layout as lay
from .prover import (
    Decline, close, closure, concrete, evaluate, hints, is_static, make_probes, make_targets,
    mask_candidates, reference_mask, reference_pad, scalar_constants, silu, solve_binding, sym_expr, valid_at,
)
from . import generalize
from .generalize import TooLarge
from .sizes import SIZE_READS as _SIZE_READS, emit_source, size_source
from .registry import register

log = logging.getLogger("hstu_inductor")
aten = torch.ops.aten

BMM = aten.bmm.default
_SCALAR_MUL = {aten.mul.Tensor, aten.mul.Scalar}
_SCALAR_DIV = {aten.div.Tensor, aten.div.Scalar}

_SOFTMAX = {aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default,
            aten.logsumexp.default, aten.amax.default, aten.sum.dim_IntList}


def _fbgemm(name):
    try:
        import fbgemm_gpu  # noqa: F401
        return getattr(torch.ops.fbgemm, name).default
    except Exception:
        return None


def _pad_ops():
    ops = {aten.index.Tensor, aten._unsafe_index.Tensor, aten.index_select.default, aten.cat.default,
           aten.index_put.default, aten.index_put_.default, aten._unsafe_index_put.default,
           aten.index_copy.default, aten.index_copy_.default, aten.scatter.src, aten.scatter_.src,
           aten.scatter.value, aten.where.self, aten.mul.Tensor, aten.masked_fill.Scalar,
           aten.masked_fill_.Scalar, aten.masked_fill.Tensor, aten.zeros.default, aten.new_zeros.default,
           aten.full.default, aten.new_full.default, aten.zeros_like.default, aten.full_like.default,
           aten.gather.default, aten.masked_scatter.default, aten._jagged_to_padded_dense_forward.default,
           aten.select_scatter.default, aten.slice_scatter.default, aten.copy_.default, aten.fill_.Scalar,
           aten.zero_.default, aten.scalar_tensor.default}
    for name in ("jagged_to_padded_dense_forward", "jagged_to_padded_dense", "jagged_2d_to_dense"):
        op = _fbgemm(name)
        if op is not None:
            ops.add(op)
    return ops


def _unpad_ops():
    ops = {aten.index.Tensor, aten._unsafe_index.Tensor, aten.index_select.default, aten.gather.default,
           aten._padded_dense_to_jagged_forward.default}
    for name in ("dense_to_jagged_forward", "dense_to_jagged", "jagged_dense_elementwise_mul"):
        op = _fbgemm(name)
        if op is not None and name != "jagged_dense_elementwise_mul":
            ops.add(op)
    return ops


_PAD_OPS = None
_UNPAD_OPS = None


def _hint(x) -> int:
    if isinstance(x, torch.SymInt):
        return int(x.node.hint) if x.node.hint is not None else -1
    return int(x)


def _val(n):
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else None


def _is_float(n) -> bool:
    v = _val(n)
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def _has_float(n) -> bool:
    """Is ``n`` (or any tensor in the list/tuple it produces) floating point?"""
    v = _val(n)
    vals = v if isinstance(v, (list, tuple)) else [v]
    return any(isinstance(x, torch.Tensor) and x.is_floating_point() for x in vals)


def _is_int_tensor(n) -> bool:
    v = _val(n)
    return isinstance(v, torch.Tensor) and not v.is_floating_point() and not v.is_complex()


def _name(n) -> str:
    t = n.target
    return getattr(t, "__name__", str(t)) if n.op == "call_function" else n.op


# ---------------------------------------------------------------------------------------------
# Anchor


def _score_path_op(n) -> bool:
    if n.op != "call_function":
        return False
    t = n.target
    if t is BMM or t is operator.getitem:
        return t is operator.getitem
    if lay.is_layout_node(n) or t in _SOFTMAX:
        return True
    tags = getattr(t, "tags", ())
    return (torch.Tag.pointwise in tags or torch.Tag.nondeterministic_seeded in tags
            or t in (aten.tril.default, aten.triu.default, aten._to_copy.default, aten.masked_fill.Tensor,
                     aten.native_dropout.default))


def find_score_product(pv, square: bool = True) -> Optional[torch.fx.Node]:
    """The ``bmm`` computing the scores that feed ``pv``'s left operand, or None. With
    ``square=False`` rectangular scores (delta rows x keys, cached attention) are returned too."""
    found, seen, stack = set(), set(), [pv.args[0]]
    while stack:
        n = stack.pop()
        if n in seen or not isinstance(n, torch.fx.Node):
            continue
        seen.add(n)
        if n.op == "call_function" and n.target is BMM:
            found.add(n)
            continue
        if _score_path_op(n):
            stack.extend(a for a in n.all_input_nodes if _is_float(a) or a.target is aten.native_dropout.default)
    if len(found) != 1:
        return None
    s = found.pop()
    shape = _val(s).shape
    if len(shape) != 3:
        return None
    if square and not lay.eq(shape[1], shape[2]):
        return None
    return s


def is_square(S) -> bool:
    shape = _val(S).shape
    return lay.eq(shape[1], shape[2])


def is_pad(D) -> bool:
    global _PAD_OPS
    if _PAD_OPS is None:
        _PAD_OPS = _pad_ops()
    return D.op == "call_function" and D.target in _PAD_OPS


# ---------------------------------------------------------------------------------------------
# Structure


def _scalar_of(n, a):
    return a if isinstance(a, (int, float)) and not isinstance(a, bool) else None


def walk_operand(node):
    """Follow a bmm operand back through layout ops and scalar multiplies.
    Returns ``(dense source D, ops from D to node, scalar factor)``."""
    ops, factor, cur = [], 1.0, node
    while True:
        if lay.is_layout_node(cur):
            ops.append(cur)
            cur = cur.args[0]
            continue
        if cur.op == "call_function" and cur.target in _SCALAR_MUL | _SCALAR_DIV and len(cur.args) == 2:
            a0, a1 = cur.args
            if isinstance(a0, torch.fx.Node) and _scalar_of(cur, a1) is not None:
                factor = factor * a1 if cur.target in _SCALAR_MUL else factor / a1
                ops.append(cur)
                cur = a0
                continue
            if cur.target in _SCALAR_MUL and isinstance(a1, torch.fx.Node) and _scalar_of(cur, a0) is not None:
                factor = factor * a0
                ops.append(cur)
                cur = a1
                continue
        break
    ops.reverse()
    return cur, ops, factor


def _sym_scalar(a):
    """The sympy value of a SymInt graph node (``x / N`` with a symbolic N), else None."""
    val = _val(a)
    return sym_expr(val) if isinstance(val, torch.SymInt) else None


def walk_forward(node, sym=False):
    """Follow ``node`` forward through single-user layout ops and scalar multiplies. ``sym``:
    also by SymInt nodes (the factor is then a sympy expression; callers must prove it)."""
    ops, factor, cur = [], 1.0, node

    def scalar(u, a):
        if _scalar_of(u, a) is not None:
            return a
        return _sym_scalar(a) if sym and isinstance(a, torch.fx.Node) else None

    while len(users := [u for u in cur.users if u.target not in _SIZE_READS]) == 1:  # size reads: re-pointed
        u = users[0]
        if lay.is_layout_node(u) and u.args[0] is cur:
            ops.append(u)
            cur = u
            continue
        if u.op == "call_function" and u.target in _SCALAR_MUL | _SCALAR_DIV and len(u.args) == 2:
            a0, a1 = u.args
            if a0 is cur and (c := scalar(u, a1)) is not None:
                factor = factor * c if u.target in _SCALAR_MUL else factor / c
                ops.append(u)
                cur = u
                continue
            if u.target in _SCALAR_MUL and a1 is cur and (c := scalar(u, a0)) is not None:
                factor = factor * c
                ops.append(u)
                cur = u
                continue
        break
    return cur, ops, factor


def _through_layout(ops, layout):
    for op in ops:
        if feature_slice(op) is not None:  # only operand_layout models slices of a pad
            raise Decline(f"{op.name} slices a padded tensor (not supported here)")
        if lay.is_layout_node(op):
            layout = lay.apply(op, layout)
    return layout


def pad_source(D) -> torch.fx.Node:
    """The jagged tensor that the pad subgraph ending at ``D`` reads (walk through pad ops)."""
    global _PAD_OPS
    if _PAD_OPS is None:
        _PAD_OPS = _pad_ops()
    if D.op != "call_function" or D.target not in _PAD_OPS:
        raise Decline(f"operand {D.name} ({_name(D)}) is not produced by a recognised pad")
    leaves, seen, stack = set(), set(), [D]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for a in n.all_input_nodes:
            if not _is_float(a):
                continue
            root = a
            while lay.is_layout_node(root):
                root = root.args[0]
            scalar_mul = root.op == "call_function" and root.target in _SCALAR_MUL | _SCALAR_DIV and any(
                _scalar_of(root, x) is not None for x in root.args)
            if root.op == "call_function" and root.target in _PAD_OPS and not scalar_mul:
                stack.append(root)
            elif root.op == "call_function" and root.target is not operator.getitem and not any(
                    _has_float(x) for x in root.all_input_nodes):
                stack.append(root)  # float made from ints/constants only (e.g. mask.to(float))
            else:
                leaves.add(a)
    if len(leaves) != 1:
        raise Decline(f"pad ending at {D.name} reads {len(leaves)} float tensors "
                      f"({', '.join(sorted(x.name for x in leaves))}); expected one jagged source")
    return leaves.pop()


def _key(m):
    return (str(sympy.expand(m[0])), m[1], str(sympy.expand(m[2])))


def _dimkey(dim):
    return tuple(_key(m) for m in lay.normalize_dim(dim))


@dataclasses.dataclass
class Operand:
    node: torch.fx.Node   # the bmm operand
    D: torch.fx.Node      # dense tensor at the end of the pad
    ops: list             # layout / scalar / feature-slice ops from D to node
    factor: float
    src: torch.fx.Node    # jagged source [L, *F]
    prefix: str           # logical axis prefix for src's feature dims
    layout: tuple = None
    # feature slices of the padded tensor (one padded uvqk split into q, k, v) are slices of the
    # source: the operand reads ``src`` narrowed by these ``(feature dim, start, length)`` steps
    narrows: list = dataclasses.field(default_factory=list)
    feat: list = None     # feature sizes of the narrowed source


@dataclasses.dataclass
class Plan:
    pv: torch.fx.Node
    S: torch.fx.Node
    out: torch.fx.Node
    q: Operand
    k: Operand
    v: Operand
    offsets: torch.fx.Node
    num_targets: Optional[torch.fx.Node]
    N: int                       # or a sympy expression of graph symbols (symbolic max length)
    alpha: float = 1.0
    scale: Optional[float] = None           # constant scale (None: 1/N)
    scale_node: Optional[torch.fx.Node] = None  # attn_scale input (times scale_factor)
    scale_factor: float = 1.0
    params: tuple = (True, 0, 0, 0)
    head_modes: list = None      # q-feature modes forming the head index (S batch order)
    c_modes: list = None         # q-feature modes contracted in S
    v_head_modes: list = None    # v-feature modes paired with head_modes
    e_modes: list = None         # v-feature modes of the output
    out_rest: list = None        # modes of out's feature dims (flattened, in order)
    spelling: str = ""
    lengths: bool = False        # ``offsets`` is per-sequence lengths [B] (offsets are its cumsum)
    dense: bool = False          # no unpad: ``out`` is the dense [B, N, ...] / [B*N, ...] output
    rest_shape: list = None      # feature sizes of the dense output
    offsets_arg: Optional[torch.fx.Node] = None  # the offsets node passed to the op (rewrite)
    N_node: object = None        # symbolic N: the node holding it, or (graph input, dim) of a size
    N_arg: object = None         # the op's max_seq_len argument (rewrite)
    scale_per_n: bool = False    # symbolic N: the op's scale is ``scale`` (or the scale input) / N


def _modes_of_axes(dim, prefix):
    return [m for m in lay.normalize_dim(dim) if m[1] is not None and m[1].startswith(prefix)]


def _feature_axes(src, prefix):
    shape = _val(src).shape
    if len(shape) < 2:
        raise Decline(f"jagged source {src.name} has no feature dims")
    if not all(is_static(s) for s in shape[1:]):
        if not config.specialize_features:
            raise Decline(f"jagged source {src.name} has symbolic feature dims {tuple(shape)}")
        # dynamic=True makes head/feature dims symbolic although models fix them (weights): take
        # them as constants, guarded, so the compiled graph recompiles if they ever change
        # (a feature size equal to B shares B's symbol under duck sizing: B is then fixed too, and a
        # batch of another size recompiles once with separate symbols)
        _compat.specialize_ints(shape[1:])
        shape = _val(src).shape
        if not all(is_static(s) for s in shape[1:]):
            raise Decline(f"jagged source {src.name} has symbolic feature dims {tuple(shape)}")
    return [int(s) for s in shape[1:]], [f"{prefix}{k}" for k in range(len(shape) - 1)]


def _check_tiles(modes, sizes, axes, what):
    for size, axis in zip(sizes, axes):
        ms = [m for m in modes if m[1] == axis]
        ms.sort(key=lambda m: int(m[2]))
        expect = 1
        for s, _, st in ms:
            if int(st) != expect:
                raise Decline(f"{what}: feature digits of {axis} are not covered exactly once")
            expect *= int(s)
        if expect != size:
            raise Decline(f"{what}: feature dim {axis} of size {size} is not covered exactly once")


def feature_slice(n):
    """``(input, dim, start, stop, drops_dim)`` when ``n`` takes a static slice of one dimension
    (``slice`` that is not the identity, ``select``, a ``split``/``split_with_sizes``/``unbind``
    output), else None. Whether that dimension is a feature digit is for the layout algebra."""
    if n.op != "call_function":
        return None
    t = n.target
    if t is operator.getitem and isinstance(n.args[0], torch.fx.Node) and n.args[0].op == "call_function":
        parent, i = n.args[0], n.args[1]
        pt = parent.target
        x = parent.args[0]
        xv = _val(x)
        if not isinstance(xv, torch.Tensor) or not isinstance(i, int):
            return None
        dim = (parent.args[2] if len(parent.args) > 2 else parent.kwargs.get("dim", 0)) \
            if pt is not aten.unbind.int else (parent.args[1] if len(parent.args) > 1 else 0)
        dim = dim % xv.dim()
        if _static_feature(x, xv.shape[dim]) is None:
            return None
        size = int(xv.shape[dim])
        if pt is aten.split_with_sizes.default:
            sizes = [_static_feature(x, z) for z in parent.args[1]]
            if None in sizes:
                return None
            return x, dim, sum(sizes[:i]), sum(sizes[:i + 1]), False
        if pt is aten.split.Tensor:
            step = _static_feature(x, parent.args[1])
            if step is None:
                return None
            return x, dim, i * step, min(size, (i + 1) * step), False
        if pt is aten.unbind.int:
            return x, dim, i, i + 1, True
        return None
    if t not in (aten.slice.Tensor, aten.select.int) or lay.is_layout_node(n):
        return None
    x = n.args[0]
    xv = _val(x)
    if not isinstance(xv, torch.Tensor):
        return None
    dim = (n.args[1] if len(n.args) > 1 else 0) % xv.dim()
    if _static_feature(x, xv.shape[dim]) is None:
        return None
    size = int(xv.shape[dim])
    if t is aten.select.int:
        idx = n.args[2]
        if not isinstance(idx, int):
            return None
        idx = idx % size
        return x, dim, idx, idx + 1, True
    start = n.args[2] if len(n.args) > 2 else None
    end = n.args[3] if len(n.args) > 3 else None
    step = n.args[4] if len(n.args) > 4 else 1
    bounds = [a if a is None or isinstance(a, int) else _static_feature(x, a) for a in (start, end)]
    if any(b is None and a is not None for a, b in zip((start, end), bounds)):
        return None  # a symbolic bound that is not a feature size (None would read as "no bound")
    start, end = bounds
    if step != 1 or not all(a is None or isinstance(a, int) for a in (start, end)):
        return None
    start, stop, _ = slice(start, end).indices(size)
    return (x, dim, start, stop, False) if start < stop else None


def _static_feature(x, size):
    """``size`` (an int, a SymInt or a node holding one) as an int: static, or a symbolic feature
    size specialised with a guard (``config.specialize_features``: symbols that size no input's
    rows, as ``dynamic=True`` makes head and feature dims). None otherwise."""
    val = _val(size) if isinstance(size, torch.fx.Node) else size
    if isinstance(val, int):
        return val
    if not isinstance(val, torch.SymInt):
        return None
    if not is_static(val):
        if not config.specialize_features or sym_expr(val).free_symbols & _row_symbols(x.graph):
            return None
        _compat.specialize_ints([val])
    return int(sym_expr(val)) if is_static(val) else None


def _row_symbols(graph) -> set:
    """Symbols of the row counts of the graph's inputs (dim 0 of each input tensor)."""
    out = set()
    for p in graph.find_nodes(op="placeholder"):
        v = _val(p)
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            out |= sym_expr(v.shape[0]).free_symbols
    return out


def walk_sliced(node):
    """:func:`walk_operand`, continued through feature slices of a padded tensor (padded uvqk)."""
    D, ops, factor = walk_operand(node)
    while (sl := feature_slice(D)) is not None:
        D2, ops2, f2 = walk_operand(sl[0])
        ops, factor, D = ops2 + [D] + ops, factor * f2, D2
    return D, ops, factor


def _operand(node, prefix) -> Operand:
    D, ops, factor = walk_sliced(node)
    src = pad_source(D)
    _no_lost_grad(src)
    return Operand(node, D, ops, factor, src, prefix)


def operand_layout(x: Operand, B, N, sizes, axes):
    """Layout of ``x.node`` (sets ``x.layout``, ``x.narrows``, ``x.feat``): the pad ``D`` is
    ``[B, N, *sizes]`` viewed as ``D.shape``; feature slices narrow the logical source."""
    layout = lay.view(lay.source_layout([B, N, *sizes], ["b", "n", *axes]), _val(x.D).shape)
    feat = list(sizes)
    for op in x.ops:
        sl = feature_slice(op)
        if sl is not None:
            _, dim, start, stop, drops = sl
            axis = next((m[1] for m in lay.normalize_dim(layout[dim]) if m[1] is not None), None)
            if axis not in axes:
                raise Decline(f"{op.name} slices the padded {x.src.name} along rows, not features")
            k = axes.index(axis)
            layout, (_, first, length) = lay.narrow(layout, dim, start, stop, feat[k])
            if drops:
                layout = layout[:dim] + layout[dim + 1:]
            x.narrows.append((k, first, length))
            feat[k] = length
        elif lay.is_layout_node(op):
            layout = lay.apply(op, layout)
    x.layout, x.feat = layout, feat
    return layout


def _may_require_grad(node) -> bool:
    """Whether ``node`` may carry a gradient. The ATen retrace drops ``requires_grad`` from its
    fake values, so unless the pipeline recorded it (``meta["requires_grad"]``) we assume it
    does whenever grad mode is on while compiling."""
    val = _val(node)
    if "requires_grad" in node.meta:
        return bool(node.meta["requires_grad"])
    if isinstance(val, torch.Tensor) and val.requires_grad:
        return True
    return torch.is_grad_enabled()


def _no_lost_grad(src):
    """Decline when the source reaches a grad-requiring tensor only through ``detach``: the ATen
    retrace of nested-tensor code detaches its values (eager keeps the gradient), and rewriting
    such a graph would silently drop those gradients."""
    cur = src
    while cur.op == "call_function" and (lay.is_layout_node(cur) or cur.target is aten.detach.default):
        if cur.target is aten.detach.default:
            if _may_require_grad(cur.args[0]):
                raise Decline(f"jagged source {src.name} is a detached view of a tensor that requires grad "
                              f"(nested tensors lose autograd in the ATen retrace); left to stock Inductor")
        cur = cur.args[0]


def probe_scale(scale_leaf, binding, gen, env):
    """A fresh positive ``attn_scale`` probe bound to ``scale_leaf`` in ``env`` (None if no scale).
    Exact in float32 like ``_rand``: a scale padded by an op without float64 kernels (fbgemm's
    ``jagged_to_padded_dense``, run in float32 by the evaluator) must come back unchanged."""
    if scale_leaf is None:
        return None
    shape = [concrete(s, binding) for s in _val(scale_leaf).shape]
    env[scale_leaf] = (torch.rand(shape, generator=gen, dtype=torch.float32) + 0.5).to(torch.float64)
    return env[scale_leaf]


def scalar_scale(scale_probe):
    """``s_i`` when it is the same for every row (1 without a scale tensor), else None."""
    if scale_probe is None:
        return torch.ones((), dtype=torch.float64)
    return scale_probe.reshape(()) if scale_probe.numel() == 1 else None


def jagged_descriptor(q) -> torch.fx.Node:
    """The single 1-D integer input of the q pad: ``offsets [B+1]`` or per-sequence ``lengths [B]``
    (the model derives offsets itself; which one is decided by :func:`prove`)."""
    order, leaves = closure([q.D], {q.src})
    ints = [x for x in leaves if _is_int_tensor(x)]
    if len(ints) != 1 or _val(ints[0]).dim() != 1:
        raise Decline(f"pad of {q.src.name} does not depend on exactly one 1-D integer input (offsets or lengths)")
    return ints[0]


def looks_like_lengths(node) -> bool:
    """Whether ``node`` is summed into offsets by the graph (cumsum, fbgemm's complete cumsum):
    only decides which reading of the jagged input is tried (and reported) first."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            name = getattr(u.target, "__name__", str(u.target))
            if u.target is aten.cumsum.default or "cumsum" in name:
                return True
            if lay.is_layout_node(u):
                stack.append(u)
    return False


def batch_size(plan) -> sympy.Expr:
    """``B`` from the jagged descriptor: ``len(lengths)`` or ``len(offsets) - 1``."""
    n = sym_expr(_val(plan.offsets).shape[0])
    return n if plan.lengths else n - 1


def batch_hint(plan) -> int:
    return _hint(_val(plan.offsets).shape[0]) - (0 if plan.lengths else 1)


def descriptor_probe(plan, off, lens):
    """The probe value of the jagged descriptor input (offsets or lengths, in its dtype)."""
    return (lens if plan.lengths else off).to(_val(plan.offsets).dtype)


def score_modes(QL, KL, bkey, fq, axq):
    """``(batch modes, head_modes, c_modes)`` of a score product with q/k layouts ``QL``/``KL``
    (full and delta attention): its batch is (sequence, head), no operand broadcasts, it contracts
    q/k features only, and the head and feature modes tile q's features. Raises Decline."""
    Z = lay.normalize_dim(QL[0])
    if [_key(m) for m in Z].count(bkey) != 1 or any(m[1] != "b" and not str(m[1]).startswith("q") for m in Z):
        raise Decline("score product batch is not (sequence, head)")
    if any(m[1] is None for d in QL for m in d) or any(m[1] is None for d in KL for m in d):
        raise Decline("score product broadcasts an operand")
    c_modes = list(lay.normalize_dim(QL[2]))
    if any(not str(m[1]).startswith("q") for m in c_modes):
        raise Decline("score product contracts over something other than features")
    head_modes = [m for m in Z if m[1] != "b"]
    _check_tiles(head_modes + c_modes, fq, axq, "score product")
    return Z, head_modes, c_modes


def value_modes(Y, nkey):
    """Output feature modes of a value product with v layout ``Y`` contracting over the key rows
    ``nkey``; they must all be value features. Raises Decline."""
    if len(Y) != 3 or _dimkey(Y[1]) != nkey:
        raise Decline("value product does not contract over key rows of the padded sequences")
    e_modes = list(lay.normalize_dim(Y[2]))
    if any(m[1] is None or not m[1].startswith("v") for m in e_modes) or any(m[1] is None for d in Y for m in d):
        raise Decline("value product output dims are not value features")
    return e_modes


def symbolic_n(Nexpr, B, rows, q_D, name):
    """The node holding a symbolic max length ``N`` (padded size ``B * N * features``), to pass
    to the op at runtime: a SymInt input, a size read, or a SymInt the pad itself uses. ``N`` must
    be one symbol's polynomial that shares no symbol with ``B`` / ``L``: the probes bind it
    independently (to several values) through that symbol."""
    if sympy.fraction(Nexpr)[1] != 1 or len(Nexpr.free_symbols) != 1:
        raise Decline(f"padded size of {name} is not B * N * features for N a constant or a "
                      f"polynomial of one symbol ({Nexpr})")
    others = sym_expr(B).free_symbols.union(*(sym_expr(r).free_symbols for r in rows))
    if Nexpr.free_symbols & others:
        raise Decline(f"symbolic N={Nexpr} shares a symbol with the batch size or the jagged length "
                      f"(the probes cannot vary N alone)")

    def is_n(val):
        return isinstance(val, torch.SymInt) and sympy.expand(sym_expr(val) - Nexpr) == 0

    def holds_n(n):
        return is_n(_val(n))

    graph = q_D.graph
    found = [n for n in graph.nodes if n.op == "placeholder" and holds_n(n)]
    found += [n for n in graph.nodes if n.target is aten.sym_size.int and n.args[0].op == "placeholder"
              and holds_n(n)]
    order, leaves = closure([q_D], set())
    found += [n for n in [*order, *leaves] if holds_n(n)]  # used by the pad: defined before the output
    if found:
        return found[0]
    for n in graph.nodes:  # a graph input's size, e.g. a padded tensor marked dynamic
        val = _val(n)
        if n.op == "placeholder" and isinstance(val, torch.Tensor):
            for d, s in enumerate(val.shape):
                if is_n(s):
                    return (n, d)
    raise Decline(f"no graph input carries the symbolic N={Nexpr} of the padded {name}")


def analyse(S, pv, lengths=False) -> Plan:
    """Structural part of the proof. Raises Decline. ``lengths``: read the jagged integer input as
    per-sequence lengths rather than offsets."""
    q = _operand(S.args[0], "q")
    k = _operand(S.args[1], "q")  # k's features must line up with q's: same axis names
    v = _operand(pv.args[1], "v")
    fq, axq = _feature_axes(q.src, "q")
    fk, _ = _feature_axes(k.src, "q")
    fv, axv = _feature_axes(v.src, "v")
    dt = {_val(x.src).dtype for x in (q, k, v)}
    if len(dt) != 1:
        raise Decline(f"q, k, v dtypes differ: {dt}")

    offsets = jagged_descriptor(q)
    plan = Plan(pv=pv, S=S, out=None, q=q, k=k, v=v, offsets=offsets, num_targets=None, N=0, lengths=lengths)
    B = batch_size(plan)
    for x in (k, v):  # separate symbols are fine (the jagged contract makes them equal), hints must agree
        if _hint(_val(x.src).shape[0]) != _hint(_val(q.src).shape[0]):
            raise Decline("q, k, v have different numbers of jagged rows")

    # N from the dense size of the q pad
    numel = sympy.Integer(1)
    for s in _val(q.D).shape:
        numel = numel * sym_expr(s)
    Nexpr = sympy.cancel(numel / (B * math.prod(fq)))
    if Nexpr.is_Integer:
        if int(Nexpr) <= 0:
            raise Decline(f"padded size of {q.src.name} is not B * N * features for a constant N ({Nexpr})")
        N = plan.N = int(Nexpr)
    else:
        N = plan.N = Nexpr
        plan.N_node = symbolic_n(Nexpr, B, [_val(x.src).shape[0] for x in (q, k, v)], q.D, q.src.name)

    for x, f, axes in ((q, fq, axq), (k, fk, axq), (v, fv, axv)):
        operand_layout(x, B, N, f, axes)
    if q.feat != k.feat:
        raise Decline(f"q {q.feat} and k {k.feat} feature shapes differ")
    fq, fv = q.feat, v.feat

    A, K = q.layout, k.layout
    if len(A) != 3 or len(K) != 3:
        raise Decline("score product operands are not 3-D")
    nmode = ((lay.to_expr(N), "n", sympy.Integer(1)),)
    bkey = _key((B, "b", sympy.Integer(1)))
    if _dimkey(A[1]) != tuple(_key(m) for m in nmode) or _dimkey(K[2]) != tuple(_key(m) for m in nmode):
        raise Decline("score product does not pair query rows with key rows of the padded sequences")
    if _dimkey(A[2]) != _dimkey(K[1]) or not lay.normalize_dim(A[2]):
        raise Decline("score product does not contract the same q/k feature digits")
    if _dimkey(A[0]) != _dimkey(K[0]):
        raise Decline("score product batches q and k differently")
    plan._Z, plan.head_modes, plan.c_modes = score_modes(A, K, bkey, fq, axq)

    # PV product
    plan._Y = v.layout
    plan.e_modes = value_modes(v.layout, tuple(_key(m) for m in nmode))
    plan._B = B
    return plan


# ---------------------------------------------------------------------------------------------
# Score subgraph: S -> X (shape-preserving ops + mask + scale)


def score_subgraph(plan: Plan, Xnode, rows=None):
    """Walk the shape-preserving chain ``S -> X``. ``rows``: the size of ``S``'s query-row dim
    (``N`` for full attention, the delta rows per sequence for cached attention)."""
    S = plan.S
    Zd = plan._Z
    N = plan.N
    rows = lay.to_expr(N) if rows is None else rows
    S_layout = (tuple(Zd), ((rows, "i", sympy.Integer(1)),), ((lay.to_expr(N), "j", sympy.Integer(1)),))
    order, leaves = closure([Xnode], {S})
    sderived, layouts = {S}, {S: S_layout}
    for n in order:
        sd = [a for a in n.all_input_nodes if a in sderived]
        if not sd:
            continue
        sderived.add(n)
        t = n.target
        if t in (aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default):
            raise Decline("softmax over the scores: softmax attention is not HSTU attention")
        if t in _SOFTMAX:
            raise Decline(f"scores are reduced by {_name(n)} (softmax-like normalisation): not HSTU attention")
        tags = getattr(t, "tags", ())
        if torch.Tag.nondeterministic_seeded in tags or t is operator.getitem:
            raise Decline(f"dropout/random op {_name(n)} on the attention weights: not modelled by hstu.attention")
        if lay.is_layout_node(n):
            layouts[n] = lay.apply(n, layouts[n.args[0]])
            continue
        if t is BMM:
            raise Decline("scores feed another product before the value product")
        out = _val(n)
        if not isinstance(out, torch.Tensor) or not out.is_floating_point() and t not in (aten.ne.Scalar,):
            raise Decline(f"{_name(n)} on the scores does not give floating scores")
        for a in sd:
            ashape = _val(a).shape
            if len(ashape) != len(out.shape) or not all(lay.eq(x, y) for x, y in zip(ashape, out.shape)):
                raise Decline(f"{_name(n)} changes the shape of the scores (reduction or broadcast)")
        keys = {tuple(_dimkey(d) for d in layouts[a]) for a in sd}
        if len(keys) != 1:
            raise Decline(f"{_name(n)} combines the scores with a differently laid out copy of themselves")
        layouts[n] = layouts[sd[0]]
    if Xnode not in sderived:
        raise Decline("value product operand does not come from the scores")
    return order, leaves, sderived, layouts, S_layout


# ---------------------------------------------------------------------------------------------
# The proof


@dataclasses.dataclass
class _Probe:
    lengths: list
    targets: Optional[list]
    binding: dict
    offsets: torch.Tensor
    nt: Optional[torch.Tensor]


_MAX_PROBE_ELEMS = 2e7   # per probe, summed over the evaluated nodes (float64: <= 160 MB); above it
#                          the candidate is proven on a generalised copy of the graph (generalize.py)
_PROBES = 10
_SYM_PROBES_PER_N = 5  # symbolic N: per probe value of N (edge lengths 0, 1, N-1, N and one random)


def prove(gm, S, pv) -> Plan:
    """Prove the candidate reading its jagged integer input as offsets, then as lengths (or the
    other way round when the graph sums it); the first full proof wins. Both readings are proven
    from scratch, so trying two cannot make a wrong graph pass. The reason reported is the one of
    the more plausible reading."""
    global _UNPAD_OPS
    if _UNPAD_OPS is None:
        _UNPAD_OPS = _unpad_ops()
    first = looks_like_lengths(jagged_descriptor(_operand(S.args[0], "q")))
    reason = None
    for lengths in (first, not first):
        try:
            return _prove(gm, S, pv, lengths)
        except (Decline, lay.LayoutError) as e:
            reason = reason or e
    raise reason


def _prove(gm, S, pv, lengths) -> Plan:
    plan = analyse(S, pv, lengths)
    N, B = plan.N, plan._B
    q, k, v = plan.q, plan.k, plan.v

    # ---- score subgraph structure
    Xnode = pv.args[0]
    s_order, s_leaves, sderived, layouts, S_layout = score_subgraph(plan, Xnode)
    XL = layouts[Xnode]
    if len(XL) != 3:
        raise Decline("value product left operand is not 3-D")
    ikey = ((str(sympy.expand(lay.to_expr(N))), "i", "1"),)
    jkey = ((str(sympy.expand(lay.to_expr(N))), "j", "1"),)
    if _dimkey(XL[1]) != ikey or _dimkey(XL[2]) != jkey:
        raise Decline("value product does not contract the scores over key rows")
    XZ = lay.normalize_dim(XL[0])
    if sorted(map(_key, XZ)) != sorted(map(_key, plan._Z)) or any(m[1] is None for d in XL for m in d):
        raise Decline("value product batch does not cover every (sequence, head) of the scores once")
    YZ = lay.normalize_dim(plan._Y[0])
    if len(YZ) != len(XZ):
        raise Decline("scores and values are batched differently (head layouts do not pair)")
    pair = {}
    for mx, mv in zip(XZ, YZ):
        if mx[1] == "b":
            if _key(mv) != _key(mx):
                raise Decline("scores and values pair different sequences")
        elif mv[1] is None or not mv[1].startswith("v") or not lay.eq(mx[0], mv[0]):
            raise Decline("scores and values pair heads of different sizes")
        else:
            pair[_key(mx)] = mv
    plan.v_head_modes = [pair[_key(m)] for m in plan.head_modes]
    _, axv = _feature_axes(v.src, "v")
    _check_tiles(plan.v_head_modes + plan.e_modes, v.feat, axv, "value product")

    # side inputs of the score subgraph
    nt, scale_leaf = None, None
    for leaf in s_leaves:
        if leaf is S or leaf is plan.offsets:
            continue
        val = _val(leaf)
        if isinstance(val, torch.SymInt) or leaf.op == "get_attr":
            continue
        if isinstance(val, torch.Tensor) and not val.is_floating_point():
            if val.dim() == 1 and _hint(val.shape[0]) == batch_hint(plan) and nt is None \
                    and leaf.op == "placeholder":
                nt = leaf
                continue
            raise Decline(f"mask depends on input {leaf.name} of shape {tuple(val.shape)}, which is neither "
                          f"offsets nor num_targets (data we do not model)")
        if isinstance(val, torch.Tensor) and scale_leaf is None and (
                val.numel() == 1 or (val.dim() == 1 and _hint(val.shape[0]) == _hint(_val(q.src).shape[0]))):
            scale_leaf = leaf
            continue
        raise Decline(f"scores depend on tensor {leaf.name} of shape {tuple(getattr(val, 'shape', ()))} "
                      f"(data we do not model)")
    plan.num_targets = nt
    chain_scale = scale_leaf is not None

    # ---- output side: O -> dense (-> row scales) -> unpad (-> row scales)
    Odense, o_ops, fo, pre = output_chain(pv, plan)
    scale_leaf = _unify_scales(scale_leaf, chain_scale, pre)
    o_users = [u for u in Odense.users if u.target not in _SIZE_READS]
    U = o_users[0] if len(o_users) == 1 else None
    # no unpad in this graph (e.g. a graph break before torch.nested.masked_select, or a padded
    # consumer): the dense output itself is replaced by pad(hstu.attention) (padding rows proven 0)
    plan.dense = U is None or U.op != "call_function" or U.target not in _UNPAD_OPS
    out = U = Odense if plan.dense else U
    if isinstance(_val(U), (tuple, list)):
        gets = [u for u in U.users if u.target is operator.getitem and u.args[1] == 0]
        if len(gets) != 1:
            raise Decline("unpad output is not used as a tensor")
        out = gets[0]
    plan.out = out
    OL = (layouts[Xnode][0], ((lay.to_expr(N), "i", sympy.Integer(1)),), plan._Y[2])
    for op in o_ops:  # layouts of the dense operands of the row scales, for the numeric proof
        if op in pre:
            pre[op].layout = OL
        OL = _through_layout([op], OL)
    post = {} if plan.dense else _unify_side(scale_leaf, chain_scale or any(m.power for m in pre.values()),
                                             after_unpad(out, plan))
    scale_leaf = scale_leaf or next((m.leaf for m in post.values() if m.leaf is not None), None)
    first = lay.normalize_dim(OL[0]) if OL else ()
    bi = (_key((B, "b", sympy.Integer(1))), _key((lay.to_expr(N), "i", sympy.Integer(1))))
    if tuple(map(_key, first)) == bi:
        rest = OL[1:]
    elif len(OL) >= 2 and tuple(map(_key, first)) == bi[:1] and _dimkey(OL[1]) == bi[1:]:
        rest = OL[2:]
    else:
        raise Decline("dense attention output is not laid out as [B, N, ...] before the unpad"
                      + (f" (no unpad: consumed by {', '.join(sorted(u.name for u in Odense.users))})"
                         if plan.dense else ""))
    out_rest = [m for d in rest for m in lay.normalize_dim(d)]
    want = {_key(m): m for m in plan.head_modes + plan.e_modes}
    if sorted(map(_key, out_rest)) != sorted(want) or any(m[1] is None for m in out_rest):
        raise Decline("unpadded output features are not exactly (head, value feature)")
    plan.out_rest = out_rest
    rest_shape = [sym_expr(s) for s in _val(Odense).shape[len(OL) - len(rest):]]
    out_shape = [sym_expr(s) for s in _val(out).shape]
    if not plan.dense and (len(out_shape) != 1 + len(rest_shape)
                           or not all(lay.eq(a, b) for a, b in zip(out_shape[1:], rest_shape))):
        raise Decline("unpad output shape is not [L, features]")
    plan.rest_shape = [int(s) for s in rest_shape] if all(s.is_Integer for s in rest_shape) else None
    if plan.dense and plan.rest_shape is None:
        raise Decline("dense attention output has symbolic feature dims")
    if plan.dense and not all(is_static(s) or lay.eq(s, N) for s in _val(out).shape[1:]):
        raise Decline("dense attention output has symbolic sizes other than N")

    # ---- extra users: intermediates must stay inside the candidate
    region = set()
    for x in (q, k, v):
        order, _ = closure([x.D], {x.src})
        region |= {n for n in order if _is_float(n)}
        region |= set(x.ops)
        region |= {op.args[0] for op in x.ops if op.target is operator.getitem}  # the split itself
    region |= {n for n in sderived}
    region |= {pv, *o_ops}
    u_order, u_leaves = closure([out], {Odense})
    region |= {n for n in u_order if _is_float(n) and n is not out}
    if U is not out:
        region.add(U)
    region.discard(out)  # dense mode: the output is Odense itself
    plan.size_reads = []
    for n in region:
        for u in n.users:
            if u in region or u is out or _is_dead(u):
                continue
            if u.target in _SIZE_READS and size_source(u) is not None:  # re-read from inputs on rewrite
                plan.size_reads.append(u)
                continue
            raise Decline(f"intermediate {n.name} has a user outside the attention ({u.name}); "
                          f"rewriting would keep it alive")

    # ---- numeric proof (real tensors: leave the tracing fake mode for the probes)
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # probes are small: thread start-up costs more than it saves
    try:
        with unset_fake_temporarily(), torch.no_grad():
            _numeric_proof(gm, plan, s_order, sderived, layouts, S_layout, scale_leaf, Odense, u_order, u_leaves,
                           rest_shape, fo, chain_scale, pre, post)
    finally:
        torch.set_num_threads(threads)
    return plan


# ---------------------------------------------------------------------------------------------
# Row scales applied to the attention output (``(P @ V) * attn_scale`` per query row)


@dataclasses.dataclass
class RowScale:
    """``node = main * factor`` (or ``main / factor``) where ``factor`` depends only on a scale
    input, the jagged descriptor and constants. Proven numerically to be ``c * s_row ** power``."""
    node: torch.fx.Node
    main: torch.fx.Node
    factor: torch.fx.Node
    div: bool
    leaf: Optional[torch.fx.Node]  # the float input the factor reads (None: a constant factor)
    power: int = 0
    layout: tuple = None            # layout of ``main`` (dense, before the unpad); None after it
    c: Optional[float] = None


def _scale_like(leaf, plan) -> bool:
    val = _val(leaf)
    return isinstance(val, torch.Tensor) and val.is_floating_point() and leaf.op == "placeholder" and (
        val.numel() == 1 or (val.dim() == 1 and _hint(val.shape[0]) == _hint(_val(plan.q.src).shape[0])))


def row_scale(cur, plan) -> Optional[RowScale]:
    """``cur``'s single user when it multiplies (divides) ``cur`` elementwise, without broadcasting
    it, by a factor made only of one scale input (scalar or ``[L]``), the jagged descriptor and
    constants; else None."""
    if len(cur.users) != 1:
        return None
    u = next(iter(cur.users))
    if u.op != "call_function" or u.target not in (aten.mul.Tensor, aten.div.Tensor) or len(u.args) != 2:
        return None
    a0, a1 = u.args
    if a0 is cur and isinstance(a1, torch.fx.Node):
        factor = a1
    elif u.target is aten.mul.Tensor and a1 is cur and isinstance(a0, torch.fx.Node):
        factor = a0
    else:
        return None
    cv, uv, fv = _val(cur), _val(u), _val(factor)
    if not all(isinstance(t, torch.Tensor) for t in (cv, uv, fv)) or not fv.is_floating_point() or \
            uv.dim() != cv.dim() or fv.dim() > cv.dim() or not all(lay.eq(a, b) for a, b in zip(uv.shape, cv.shape)):
        return None
    order, leaves = closure([factor], set())
    if any(torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()) for n in order):
        return None
    floats = []
    for leaf in leaves:
        val = _val(leaf)
        if leaf is plan.offsets or leaf.op == "get_attr" or isinstance(val, torch.SymInt):
            continue
        if not _scale_like(leaf, plan):
            return None
        floats.append(leaf)
    if len(floats) > 1:
        return None
    return RowScale(u, cur, factor, u.target is aten.div.Tensor, floats[0] if floats else None,
                    power=1 if floats else 0)


def output_chain(pv, plan):
    """Follow the value product forward through layout ops, scalar multiplies and row scales
    (``dict`` node -> RowScale) to the dense tensor read by the unpad."""
    ops, factor, cur, scales = [], 1.0, pv, {}
    while True:
        cur, step, f = walk_forward(cur, sym=not isinstance(plan.N, int))
        ops += step
        factor *= f
        m = row_scale(cur, plan)
        if m is None:
            return cur, ops, factor, scales
        scales[m.node] = m
        ops.append(m.node)
        cur = m.node


def after_unpad(out, plan):
    """Row scales applied directly to the unpadded output (in order)."""
    scales, cur = {}, out
    while (m := row_scale(cur, plan)) is not None:
        scales[m.node] = m
        cur = m.node
    return scales


def _unify_scales(leaf, used, scales):
    """The one scale input of the candidate; a second input or a second use declines."""
    for m in scales.values():
        if m.leaf is None:
            continue
        if leaf is not None and m.leaf is not leaf:
            raise Decline(f"attention output scaled by {m.leaf.name} and scores by {leaf.name}: two scale inputs")
        if used:
            raise Decline(f"{leaf.name if leaf is not None else m.leaf.name} scales the attention twice")
        leaf, used = m.leaf, True
    return leaf


def _unify_side(leaf, used, scales):
    """Row scales after the unpad are optional (leaving them to the user is exact): keep the
    prefix that uses at most one scale input once."""
    kept = {}
    for n, m in scales.items():
        if m.leaf is not None and ((leaf is not None and m.leaf is not leaf) or used):
            break
        if m.leaf is not None:
            leaf, used = m.leaf, True
        kept[n] = m
    return kept


def _is_dead(n, depth=0) -> bool:
    """A pure node whose result is never used (e.g. the ``detach`` autograd leaves on saved
    tensors while tracing): it does not keep an intermediate alive."""
    if depth > 8 or n.op != "call_function" or n.is_impure():
        return False
    if not (lay.is_layout_node(n) or n.target in (aten.detach.default, operator.getitem)):  # getitem: split output
        return False
    return all(_is_dead(u, depth + 1) for u in n.users)


def _rand(shape, gen):
    """Random float64 probe values that are exact in float32 (ops without float64 kernels run in
    float32 on them, exactly for data movement). Never exactly 0: CPU float32 randn yields exact
    zeros (in pairs) about once per few million values, and a zero score hides the mask there
    (silu(0) = 0), which made the mask fit fail at N >= 512."""
    r = torch.randn(shape, generator=gen, dtype=torch.float32)
    return r.masked_fill_(r == 0, 1.0).to(torch.float64)


def _check_leaves(leaves, allowed, what):
    for leaf in leaves:
        if leaf in allowed or leaf.op == "get_attr" or isinstance(_val(leaf), torch.SymInt):
            continue
        raise Decline(f"{what} depends on input {leaf.name} (data we do not model)")


def _numeric_proof(gm, plan, s_order, sderived, layouts, S_layout, scale_leaf, Odense, u_order, u_leaves,
                   rest_shape, fo, chain_scale=True, pre=None, post=None):
    N, B = plan.N, plan._B
    q, k, v = plan.q, plan.k, plan.v
    Lq = sym_expr(_val(q.src).shape[0])
    base = hints(_val(q.src), _val(plan.offsets), _val(plan.S))
    B_static = B.free_symbols == set()
    L_static = any(sym_expr(_val(x.src).shape[0]).free_symbols == set() for x in (q, k, v))
    Lq = next((sym_expr(_val(x.src).shape[0]) for x in (q, k, v)
               if sym_expr(_val(x.src).shape[0]).free_symbols == set()), Lq)
    pads = []
    for x in (q, k, v):
        if any(x.D is y.D for y, _ in pads):  # one padded tensor sliced into several operands
            continue
        order, leaves = closure([x.D], {x.src})
        _check_leaves(leaves, {x.src, plan.offsets}, f"pad of {x.src.name}")
        pads.append((x, order))
    _check_leaves(u_leaves, {Odense, plan.offsets}, "unpad")
    pre, post = pre or {}, post or {}
    sides = {m.node: closure([m.factor], set())[0] for m in [*pre.values(), *post.values()]}
    post_ok = len(post)  # row scales after the unpad that passed every probe so far
    sym_leaves = [n for n in gm.graph.nodes if isinstance(_val(n), torch.SymInt)
                  and (n.op == "placeholder" or n.target is aten.sym_size.int)]

    sym_n = not isinstance(N, int)
    Bs, Ls = int(B) if B_static else None, int(Lq) if L_static else None
    floats, ints = scalar_constants(s_order)
    if sym_n:
        side_floats, side_ints = scalar_constants([n for order in sides.values() for n in order])
        Ns = probe_ns(plan, base, floats | side_floats, ints | side_ints, Bs, Ls)
        probes = []
        for idx, Nv in enumerate(Ns):
            sets = make_probes(Nv, Bs, Ls, _SYM_PROBES_PER_N, seed=1234 + idx)
            if Ls is None:  # one probe per N without a sequence of length N: the scale is fitted per
                sets[2] = [min(n, Nv - 1) for n in sets[2]]  # probe, so 1/max(lengths) must not look like 1/N
            probes += [(Nv, lengths) for lengths in sets]
    else:
        probes = [(N, lengths) for lengths in make_probes(N, Bs, Ls, _PROBES, seed=1234)]
    rng = random.Random(99)
    gen = torch.Generator().manual_seed(4321)
    alphas = sorted({1.0} | {c for c in floats if c != 0} | {1.0 / c for c in floats if c != 0})
    mask_ints = {i for i in ints if 0 < i <= max(Nv for Nv, _ in probes) + 1}
    chosen = None
    consts = []  # symbolic N: (N, fitted score constant, binding) per probe
    for p, (Np, lengths) in enumerate(probes):
        Bp, Lp = len(lengths), sum(lengths)
        pairs = [(sym_expr(_val(plan.offsets).shape[0]), Bp + (0 if plan.lengths else 1))]
        pairs += [(sym_expr(_val(x.src).shape[0]), Lp) for x in (q, k, v)]
        if scale_leaf is not None and _val(scale_leaf).dim() == 1 and _val(scale_leaf).numel() != 1:
            pairs.append((sym_expr(_val(scale_leaf).shape[0]), Lp))
        if plan.num_targets is not None:
            pairs.append((sym_expr(_val(plan.num_targets).shape[0]), Bp))
        if sym_n:
            shared = N.free_symbols & set().union(*(sym_expr(e).free_symbols for e, _ in pairs))
            if shared:
                raise Decline(f"symbolic N={N} shares a symbol with the sizes of the jagged inputs "
                              f"(the probes cannot vary N alone)")
            pairs.append((N, Np))
        binding = solve_binding(pairs, base)
        off = torch.tensor([0] + list(itertools_accumulate(lengths)), dtype=_val(plan.offsets).dtype)
        lens = torch.tensor(lengths, dtype=torch.int64)
        env0 = {plan.offsets: descriptor_probe(plan, off, lens)}
        for s in sym_leaves:
            try:
                env0[s] = concrete(_val(s), binding)
            except Decline:
                pass
        targets = None
        if plan.num_targets is not None:
            targets = torch.tensor(make_targets(lengths, rng, p), dtype=_val(plan.num_targets).dtype)
            env0[plan.num_targets] = targets
        cost = 0
        for n in [*s_order, *u_order, *(n for _, order in pads for n in order)]:
            val = _val(n)
            if isinstance(val, torch.Tensor):
                cost += math.prod(concrete(s, binding) for s in val.shape)
        if cost > _MAX_PROBE_ELEMS and sym_n:
            raise Decline(f"too large to prove numerically at N={Np} ({cost:.2g} elements per probe; "
                          f"symbolic N is probed above every integer constant of the score subgraph)")
        if cost > _MAX_PROBE_ELEMS:  # proven on small instances of the same graph instead (generalize.py)
            raise TooLarge(f"too large to prove numerically at these static sizes ({cost:.2g} elements per probe)",
                           plan=plan, last=list(post)[-1] if post else plan.out, B=Bs, N=N if isinstance(N, int) else None, L=Ls,
                           descriptor=plan.offsets.name if plan.offsets.op == "placeholder" else None,
                           lengths=plan.lengths)

        # pads
        for x, order in pads:
            shape = [concrete(s, binding) for s in _val(x.src).shape]
            src = _rand(shape, gen)
            env = evaluate(gm, order, {**env0, x.src: src})
            got = env[x.D]
            ref = reference_pad(src, off, Np)
            if got.numel() != ref.numel() or not torch.equal(got.reshape(-1).to(torch.float64), ref.reshape(-1)):
                raise Decline(f"pad of {x.src.name} is not jagged_to_padded(offsets, N={Np}) with zero padding")

        # scores -> X
        Sc = lay.concretize(S_layout, binding)
        Sshape = [concrete(s, binding) for s in _val(plan.S).shape]
        crdS = lay.coords(Sc, Sshape)
        in_seq_S = (crdS["i"] < lens[crdS["b"]]) & (crdS["j"] < lens[crdS["b"]])
        S_probe = _rand(Sshape, gen) * in_seq_S
        scale_probe = probe_scale(scale_leaf, binding, gen, env0)
        env = dict(env0)
        env[plan.S] = S_probe
        env = evaluate(gm, s_order, env)
        X = env[plan.pv.args[0]]
        XLc = lay.concretize(layouts[plan.pv.args[0]], binding)
        crd = lay.coords(XLc, list(X.shape))
        bb, ii, jj = crd["b"], crd["i"], crd["j"]
        n_b = lens[bb]
        in_seq = ((ii < n_b) & (jj < n_b)).expand(X.shape)
        S_at = lay.gather(S_probe, Sc, crd).expand(X.shape)
        if not bool(torch.isfinite(X).all()):
            raise Decline("scores are not finite on padding positions (e.g. -inf masking)")
        s_at = scalar_scale(scale_probe if chain_scale else None)
        if s_at is None:
            s_at = lay.gather(reference_pad(scale_probe, off, Np), (((Bp, "b", 1),), ((Np, "i", 1),)),
                              crd).expand(X.shape)
        if chosen is None:
            chosen = _fit(X, S_at, s_at, in_seq, bb, ii, jj, lens, targets, Np, alphas, mask_ints,
                          plan.num_targets is not None)
        alpha, c0, params = chosen
        if sym_n:  # the constant may scale with N (1/N): fitted per probe, its N-law checked below
            try:
                _, c0 = fit_alpha(X, S_at, s_at, (X != 0) & in_seq, [alpha])
            except Decline:
                raise Decline(f"scores at N={Np} are not c * silu(alpha * qk) with the alpha={alpha:g} found at "
                              f"N={probes[0][0]} (alpha depends on N?)") from None
            consts.append((Np, c0, binding))
        mref = reference_mask(lens, Np, targets, params)[bb, ii, jj].expand(X.shape)
        expect = torch.where(mref, c0 * s_at * silu(alpha * S_at), torch.zeros((), dtype=torch.float64))
        if not close(torch.where(in_seq, X, 0.0), torch.where(in_seq, expect, 0.0)):
            raise Decline(f"scores differ from mask * scale * silu(alpha * qk) on probe {p} (lengths {lengths})")
        if plan.dense and bool(((X != 0) & (ii >= n_b) & (jj < n_b)).any()):
            raise Decline(f"attention output is used padded (no unpad) but its padding rows are not zero "
                          f"(probe {p})")

        # unpad (none in dense mode)
        Oshape = [concrete(s, binding) for s in _val(Odense).shape]
        O_probe = _rand(Oshape, gen)
        if not plan.dense:
            env = evaluate(gm, u_order, {**env0, Odense: O_probe})
            got = env[plan.out]
            rest = [concrete(s, binding) for s in rest_shape]
            flat = O_probe.reshape(Bp * Np, *rest)
            seq = torch.repeat_interleave(torch.arange(Bp), lens)
            pos = torch.arange(Lp) - off[:-1].to(torch.int64)[seq]
            if not (got.shape == (Lp, *rest) and torch.equal(got.to(torch.float64), flat[seq * Np + pos])):
                raise Decline("unpad does not read row (b, n) of the dense output for every jagged row")

        # row scales: factor == c * s_row ** power on every row the unpad reads
        for idx, m in enumerate([*pre.values(), *post.values()]):
            if m.node in post and list(post).index(m.node) >= post_ok:
                continue
            try:
                _check_row_scale(gm, m, sides[m.node], env0, binding, scale_probe, off, lens, Np, p, plan.dense)
            except Decline:
                if m.node not in post:
                    raise
                post_ok = list(post).index(m.node)  # leave it (and what follows) to the user

    alpha, c0, params = chosen
    plan.alpha = float(alpha * q.factor * k.factor)
    plan.params = params
    kept = [*pre.values(), *list(post.values())[:post_ok]]
    if post_ok:
        plan.out = kept[-1].node
    if not chain_scale and not any(m.power for m in kept):
        scale_leaf = None
    if sym_n:
        factor, plan.scale_per_n = n_law(consts, v.factor * fo * math.prod(m.c for m in kept))
        if scale_leaf is None:
            plan.scale = None if plan.scale_per_n and abs(factor - 1.0) <= 1e-9 else factor
            plan.scale_per_n = plan.scale_per_n and plan.scale is not None
        else:
            plan.scale_node, plan.scale_factor = scale_leaf, factor
        return
    factor = c0 * v.factor * fo * math.prod(m.c for m in kept)
    if scale_leaf is None:
        plan.scale = None if abs(factor * N - 1.0) <= 1e-9 else float(factor)
    else:
        plan.scale_node, plan.scale_factor = scale_leaf, float(factor)


def probe_ns(plan, base, floats, ints, B, L) -> list:
    """Probe values of a symbolic ``N``, largest first (the mask and alpha are fitted there): the
    compile-time hint when small; 2 (the smallest N of a dynamic graph: catches a scale or mask
    clamped for small N), 5 and 12; and one above every integer constant of the score subgraph,
    so that a constant window / contextual length / threshold acts inside some probe (below it,
    it would look like "no window" at every probe N). Static ``B`` and ``L`` need ``B*N >= L``."""
    consts = [abs(i) for i in ints] + [abs(f) for f in floats if float(f).is_integer()]
    big = int(max(consts, default=0))
    nmin = -(-L // B) if L is not None and B is not None else 2
    # 2 * big + 2: a window w acts only on id distances, and a contextual prefix c (or targets)
    # shortens those by up to c: the largest probe must exceed w + c for the window to show
    ns = {2, 5, 12, 2 * big + 2}
    hint = concrete(plan.N, base)
    if 2 <= hint <= 64:
        ns.add(hint)
    ns = {max(n, nmin) for n in ns}
    while len(ns) < 3:
        ns.add(max(ns) + 3)
    return sorted(ns, reverse=True)


def n_law(consts, rest) -> tuple:
    """``(k, per_n)``: the total scale (score constant per probe times ``rest``, the value/output
    factors, which may hold N) is the constant ``k`` at every probe N, or ``k / N`` at every one.
    Probes span at least two N values, so the two laws cannot both hold."""
    totals = []
    for Nv, c, binding in consts:
        r = sympy.sympify(rest).subs(binding)
        if not r.is_number:
            raise Decline(f"output scale {rest} depends on sizes other than N")
        totals.append((Nv, c * float(r)))
    if len({Nv for Nv, _ in totals}) < 2:
        raise Decline("symbolic N was probed at a single value")
    N0, t0 = totals[0]
    if all(math.isclose(t, t0, rel_tol=1e-9) for _, t in totals):
        return float(t0), False
    if all(math.isclose(t * Nv, t0 * N0, rel_tol=1e-9) for Nv, t in totals):
        return float(t0 * N0), True
    raise Decline("attention scale is neither a constant nor proportional to 1/N across probe values of N "
                  f"({', '.join(f'N={Nv}: {t:.6g}' for Nv, t in totals[::max(1, len(totals) // 4)])})")


def _check_row_scale(gm, m, order, env0, binding, scale_probe, off, lens, N, p, dense=False):
    """One probe of a row scale: ``m``'s effective factor (broadcast to its main operand) must be
    ``m.c * s_row ** m.power`` on the rows the unpad reads (fits ``m.c`` on the first probe); with
    no unpad (``dense``) it must also be finite on padding rows (they stay zero)."""
    env = evaluate(gm, order, env0)
    shape = [concrete(s, binding) for s in _val(m.main).shape]
    try:
        fac = torch.broadcast_to(env[m.factor].to(torch.float64), shape)
    except RuntimeError as e:
        raise Decline(f"scale {m.factor.name} does not broadcast to the attention output") from e
    eff = 1.0 / fac if m.div else fac
    if dense and not bool(torch.isfinite(eff).all()):
        raise Decline(f"{m.node.name} is not finite on padding rows of the dense attention output")
    if m.layout is not None:  # dense: rows (b, i) from the layout algebra
        crd = lay.coords(lay.concretize(m.layout, binding), shape)
        b, i = crd["b"], crd["i"]
        rows = (i < lens[b]).expand(shape)
        srow = None if scale_probe is None or not m.power else scalar_scale(scale_probe)
        if m.power and srow is None:
            srow = reference_pad(scale_probe, off, N)[b, i].expand(shape)
    else:  # after the unpad: row r is jagged row r
        rows = torch.ones(shape, dtype=torch.bool)
        srow = None if not m.power else scalar_scale(scale_probe)
        if m.power and srow is None:
            srow = scale_probe.reshape([-1] + [1] * (len(shape) - 1)).expand(shape)
    if srow is None:
        srow = torch.ones((), dtype=torch.float64)
    if not bool(rows.any()):
        return
    ratio = (eff / srow.expand(shape))[rows]
    if m.c is None:
        m.c = float(ratio[0])
    if m.c == 0 or not bool(torch.allclose(ratio, torch.full_like(ratio, m.c), rtol=1e-9, atol=0)):
        raise Decline(f"{m.node.name} does not scale each query row by "
                      f"{'its attn_scale' if m.power else 'one constant'} (probe {p})")


def itertools_accumulate(xs):
    acc = 0
    for x in xs:
        acc += x
        yield acc


def sample_in_sequence(X, in_seq, *coords, limit=200000):
    """Flat indices of (at most ``limit``, fixed-seed random) in-sequence probe positions of ``X``
    and each coordinate tensor gathered there."""
    flat_idx = torch.nonzero(in_seq.reshape(-1)).reshape(-1)
    if flat_idx.numel() == 0:
        raise Decline("probe has no in-sequence positions")
    if flat_idx.numel() > limit:
        flat_idx = flat_idx[torch.randperm(flat_idx.numel(), generator=torch.Generator().manual_seed(0))[:limit]]
    return flat_idx, [t.expand(X.shape).reshape(-1)[flat_idx] for t in coords]


def _fit(X, S_at, s_at, in_seq, bb, ii, jj, lens, targets, N, alphas, mask_ints, has_targets):
    """Find (alpha, c0, mask params) with X == mask * c0 * s * silu(alpha S) on in-sequence positions."""
    obs = (X != 0) & in_seq
    # mask parameters: cheap filter on a sample, then the full reference mask
    flat_idx, (b_s, i_s, j_s) = sample_in_sequence(X, in_seq, bb, ii, jj)
    o_s = obs.reshape(-1)[flat_idx]
    params = None
    for cand in mask_candidates(mask_ints, N, has_targets):
        causal, w, c, f = cand
        if torch.equal(valid_at(b_s, i_s, j_s, lens, targets, w, c, f, causal), o_s):
            full = reference_mask(lens, N, targets, cand)[bb, ii, jj].expand(X.shape)
            if torch.equal(full & in_seq, obs):
                params = cand
                break
    if params is None:
        causal_like = bool((obs & (jj > ii).expand(X.shape)).any())
        what = "has entries above the diagonal (not causal)" if causal_like else "matches no HSTU mask"
        raise Decline(f"attention mask {what} for any (max_attn_len, contextual_seq_len, "
                      f"min_full_attn_seq_len) taken from the graph's constants")
    a, c0 = fit_alpha(X, S_at, s_at, obs, alphas)
    return a, c0, params


def fit_alpha(X, S_at, s_at, sel, alphas):
    """``(alpha, c0)`` with ``X == c0 * s * silu(alpha * S)`` on ``sel`` (alpha among ``alphas``)."""
    for a in alphas:
        ratio = X[sel] / (s_at.expand(X.shape)[sel] * silu(a * S_at[sel]))
        if ratio.numel() == 0:
            continue
        c0 = float(ratio.mean())
        if c0 != 0 and bool(torch.allclose(ratio, torch.full_like(ratio, c0), rtol=1e-9, atol=0)):
            return a, c0
    raise Decline("scores are not scale * silu(alpha * qk) for any alpha among the graph's constants "
                  "(other activation or normalisation?)")


# ---------------------------------------------------------------------------------------------
# Rewrite


def _fake_call(target, args, kwargs=None):
    if target in _OUTPUT_SHAPES:  # our ops' bodies double as fake impls: running one costs seconds
        q, v = args[0].meta.get("val"), args[2].meta.get("val")
        if q is None or v is None:
            return None
        return v.new_empty((q.shape[0], v.shape[1], v.shape[2]))

    def m(a):
        if isinstance(a, torch.fx.Node):
            return a.meta.get("val")
        if isinstance(a, (list, tuple)):
            return type(a)(m(x) for x in a)
        return a
    try:
        return target(*m(args), **m(kwargs or {}))
    except Exception:
        return None


_OUTPUT_SHAPES = {torch.ops.hstu.attention.default, torch.ops.hstu.delta_attention.default}


def _emit(graph, target, args, kwargs=None):
    node = graph.call_function(target, tuple(args), kwargs or {})
    val = _fake_call(target, args, kwargs)
    if val is not None:
        node.meta["val"] = val
    return node


def _flat_stride(m, sizes, prefix):
    axis = int(m[1][len(prefix):])
    return int(m[2]) * math.prod(sizes[axis + 1:])


def _regroup(graph, src, sizes, prefix, groups):
    """``src [L, *sizes]`` -> ``[L, prod(g) for g in groups]`` with the feature digits of each
    group (modes over axes ``prefix<k>``) in the given order."""
    modes = [m for g in groups for m in g]
    order = sorted(range(len(modes)), key=lambda i: -_flat_stride(modes[i], sizes, prefix))
    view_sizes = [int(modes[i][0]) for i in order]
    x = _reshape(graph, src, view_sizes)
    perm = [order.index(i) + 1 for i in range(len(modes))]
    if perm != sorted(perm):
        x = _emit(graph, aten.permute.default, [x, [0, *perm]])
    return _reshape(graph, x, [math.prod(int(m[0]) for m in g) for g in groups])


def _reshape(graph, x, feature_sizes):
    """``x.reshape(-1, *feature_sizes)``, or ``x`` itself when it already has those sizes."""
    val = _val(x)
    if isinstance(val, torch.Tensor) and val.dim() == 1 + len(feature_sizes) and all(
            is_static(a) and int(a) == b for a, b in zip(val.shape[1:], feature_sizes)):
        return x
    return _emit(graph, aten.reshape.default, [x, [-1, *feature_sizes]])


def _narrowed(graph, x: Operand):
    """The operand's jagged source with its proven feature slices applied (``src[:, a:b]``)."""
    t = x.src
    for k, start, length in x.narrows:
        t = _emit(graph, aten.slice.Tensor, [t, 1 + k, start, start + length])
    return t


def emit_offsets(graph, plan):
    """The op's offsets: the user's offsets input, or ``[0, cumsum(lengths)]`` from lengths."""
    if not plan.lengths:
        return plan.offsets
    csum = _emit(graph, aten.cumsum.default, [plan.offsets, 0])
    zero = _emit(graph, aten.new_zeros.default, [csum, [1]])
    return _emit(graph, aten.cat.default, [[zero, csum]])  # (constant_pad_nd's meta would specialize B)


def _reroute_size_reads(graph, plan):
    for read in getattr(plan, "size_reads", ()):
        with graph.inserting_before(read):
            new = emit_source(graph, size_source(read))
        read.replace_all_uses_with(new)


def rewrite(gm, plan: Plan):
    graph = gm.graph
    q, k, v = plan.q, plan.k, plan.v
    _reroute_size_reads(graph, plan)
    with graph.inserting_before(plan.out):
        q3 = _regroup(graph, _narrowed(graph, q), q.feat, "q", [plan.head_modes, plan.c_modes])
        k3 = q3 if (k.src, k.narrows) == (q.src, q.narrows) else \
            _regroup(graph, _narrowed(graph, k), k.feat, "q", [plan.head_modes, plan.c_modes])
        v3 = _regroup(graph, _narrowed(graph, v), v.feat, "v", [plan.v_head_modes, plan.e_modes])
        dtype = _val(q.src).dtype
        plan.N_arg = emit_n(graph, plan)
        scale = emit_scale(graph, plan, dtype, _val(q.src).device)
        causal, w, c, f = plan.params
        plan.offsets_arg = emit_offsets(graph, plan)
        y = _emit(graph, torch.ops.hstu.attention.default,
                  [q3, k3, v3, plan.offsets_arg, plan.N_arg, plan.alpha, plan.num_targets, scale, w, c, f,
                   causal])
        replace_output(graph, plan, y, dtype)


def emit_n(graph, plan):
    """The op's ``max_seq_len``: the constant N, or the graph node holding the symbolic N (a size
    of a graph input is read with ``sym_size``)."""
    if isinstance(plan.N, int):
        return plan.N
    if isinstance(plan.N_node, tuple):
        return _emit(graph, aten.sym_size.int, list(plan.N_node))
    return plan.N_node


def emit_scale(graph, plan, dtype, device):
    """The ``attn_scale`` argument for the hstu op: the user's scale tensor (cast, times a proven
    constant factor), a proven scalar as a 0-d tensor, or None for the default 1/N. With
    ``scale_per_n`` (symbolic N) either is divided by the runtime N."""
    if plan.scale_node is not None:
        scale = plan.scale_node
        if _val(scale).dtype != dtype:
            scale = _emit(graph, aten._to_copy.default, [scale], {"dtype": dtype})
        if plan.scale_factor != 1.0:
            scale = _emit(graph, aten.mul.Tensor, [scale, plan.scale_factor])
    elif plan.scale is not None:
        scale = _emit(graph, aten.scalar_tensor.default, [plan.scale], {"dtype": dtype, "device": device})
    else:
        return None
    if plan.scale_per_n:
        scale = _emit(graph, aten.div.Tensor, [scale, plan.N_arg])
    return scale


def replace_output(graph, plan, y, dtype):
    """Lay the op's ``[rows, H, Dv]`` result out as the user's output node and substitute it."""
    heads = [int(m[0]) for m in plan.head_modes]
    es = [int(m[0]) for m in plan.e_modes]
    ykeys = [_key(m) for m in list(plan.head_modes) + list(plan.e_modes)]
    perm = [ykeys.index(_key(m)) + 1 for m in plan.out_rest]
    x = _reshape(graph, y, [*heads, *es])
    if perm != sorted(perm):
        x = _emit(graph, aten.permute.default, [x, [0, *perm]])
    out_val = _val(plan.out)
    if getattr(plan, "dense", False):
        x = _pad_rows(graph, plan, _reshape(graph, x, plan.rest_shape), y)
    else:
        x = _reshape(graph, x, [int(s) for s in out_val.shape[1:]])
    if out_val.dtype != dtype:
        x = _emit(graph, aten._to_copy.default, [x], {"dtype": out_val.dtype})
    plan.out.replace_all_uses_with(x)


def _pad_rows(graph, plan, x, y):
    """``x [L, *rest]`` -> the dense output's shape, zero rows past each length (index_put into
    zeros on flat rows ``b*N + p``; differentiable, no data-dependent sizes)."""
    offsets = plan.offsets_arg
    L = _emit(graph, aten.sym_size.int, [y, 0])
    rows = _emit(graph, aten.arange.start, [0, L], {"dtype": torch.int64, "device": _val(y).device})
    seq = _emit(graph, aten.sub.Tensor, [_emit(graph, aten.searchsorted.Tensor, [offsets, rows], {"right": True}), 1])
    pos = _emit(graph, aten.sub.Tensor, [rows, _emit(graph, aten.index.Tensor, [offsets, [seq]])])
    flat = _emit(graph, aten.add.Tensor, [_emit(graph, aten.mul.Tensor, [seq, plan.N_arg]), pos])
    B = _emit(graph, operator.sub, [_emit(graph, aten.sym_size.int, [offsets, 0]), 1])
    zeros = _emit(graph, aten.new_zeros.default, [x, [_emit(graph, operator.mul, [B, plan.N_arg]), *plan.rest_shape]])
    dense = _emit(graph, aten.index_put.default, [zeros, [flat], x])
    sizes = [plan.N_arg if not is_static(s) else int(s) for s in _val(plan.out).shape[1:]]  # no int(SymInt): a guard
    return _emit(graph, aten.reshape.default, [dense, [-1, *sizes]])


def describe_scale(plan) -> str:
    per_n = "/N" if plan.scale_per_n else ""
    if plan.scale_node is not None:
        return f"attn_scale={plan.scale_node.name}" + (f"*{plan.scale_factor:g}" if plan.scale_factor != 1 else "") \
            + per_n
    return f"scale={plan.scale:g}{per_n}" if plan.scale is not None else "scale=1/N"


def describe(plan: Plan) -> str:
    causal, w, c, f = plan.params
    parts = [f"N={plan.N}" + ("" if isinstance(plan.N, int) else " (symbolic)"), f"alpha={plan.alpha:g}", f"heads={math.prod(int(m[0]) for m in plan.head_modes)}"]
    parts.append(describe_scale(plan))
    if plan.num_targets is not None:
        parts.append(f"num_targets={plan.num_targets.name}")
    if plan.lengths:
        parts.append(f"offsets from lengths {plan.offsets.name}")
    if plan.dense:
        parts.append("dense output, no unpad in this graph")
    if not causal:
        parts.append("causal=False")
    if w:
        parts.append(f"max_attn_len={w}")
    if c:
        parts.append(f"contextual_seq_len={c}")
    if f:
        parts.append(f"min_full_attn_seq_len={f}")
    pads = sorted({_name(x.D) for x in (plan.q, plan.k, plan.v)})
    if any(x.narrows for x in (plan.q, plan.k, plan.v)):
        pads.append(f"feature slices of {'/'.join(sorted({x.D.name for x in (plan.q, plan.k, plan.v)}))}")
    return f"silu attention ({', '.join(parts)}; pad via {'/'.join(pads)}, {'no unpad' if plan.dense else 'unpad via ' + _name(plan.out)})"


@register("attention")
def rewrite_attention(gm: torch.fx.GraphModule, report) -> None:
    """Replace every proven jagged silu attention in ``gm`` by ``hstu.attention`` (in place)."""
    buffers.make_explicit(gm)  # new_zeros / zeros_like / empty().zero_() ... -> zeros(dtype=...)
    consumed = set()
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not BMM or node in consumed or not node.users:
            continue
        try:
            S = find_score_product(node, square=False)
            delta = S is not None and attn_delta.is_candidate(S, node)
            if S is not None and not delta and not is_square(S):
                S = None
        except Exception:  # malformed metadata: not a candidate
            S = None
        if S is None or S in consumed:
            continue
        generalised = None
        try:
            try:
                plan = attn_delta.prove_delta(gm, S, node) if delta else prove(gm, S, node)
            except TooLarge as e:  # static sizes too large to probe: prove a generalised copy
                start = time.perf_counter()
                try:
                    plan = generalize.prove_generalised(gm, e, prove, rewrite)
                except generalize.GeneralizeError as g:
                    raise Decline(f"{e}; generalising its sizes failed: {g}") from None
                except (Decline, lay.LayoutError) as g:
                    raise Decline(f"{e}; on the generalised graph: {g}") from None
                generalised = time.perf_counter() - start
                log.info("hstu_inductor: %s proven on a generalised graph in %.2f s", node.name, generalised)
        except (Decline, lay.LayoutError) as e:
            report.near_misses.append(("attention", f"{node.name}: {e}"))
            continue
        except Exception as e:
            if config.strict:
                raise
            log.exception("hstu_inductor: attention prover failed on %s", node.name)
            report.near_misses.append(("attention", f"{node.name}: prover error {type(e).__name__}: {e}"))
            continue
        if delta:
            attn_delta.rewrite_delta(gm, plan)
        elif generalised is None:
            rewrite(gm, plan)
        consumed |= {node, S}
        report.counts["attention"] += 1
        what = attn_delta.describe_delta(plan) if delta else describe(plan)
        if generalised is not None:
            what += f" [static sizes generalised, proof {generalised:.2f} s]"
        report.details.append(("attention", what))


from . import attn_delta, buffers  # noqa: E402  (cached attention; imports this module's helpers)
