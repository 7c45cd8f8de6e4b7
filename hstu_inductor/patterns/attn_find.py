"""Attention, stage 1 (find): the candidate and its operands, read off the graph.

A candidate is anchored at a ``bmm`` ``O = X @ Y`` whose left operand ``X`` is reached from another
``bmm`` ``S = A @ K`` through shape-preserving ops only (:func:`find_score_product`). Each ``bmm``
operand is followed back through layout ops, scalar multiplies and feature slices to the dense tensor
``D`` that feeds it (:func:`walk_sliced`), and ``D`` back by data flow to the one jagged source it
reads (:func:`source_candidates`: whatever ops spell the pad); :func:`find_operand` bundles that as an
:class:`Operand`. The jagged integer input of the pads (offsets or lengths) is
:func:`jagged_descriptor`.

Nothing here is proven: the walks only say *what* the next stages check (``attn_structure``: the
layouts, ``attn_prove``: the meaning). The node helpers and op sets at the top are the vocabulary of
every attention module (``attn_*``).
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Optional

import torch

from .. import _compat, config
from . import attn_layout as lay
from . import constants
from .prover import Decline, TooLarge, closure, is_static, sym_expr
from .sizes import SIZE_READS

aten = torch.ops.aten

BMM = aten.bmm.default
SCALAR_MUL = {aten.mul.Tensor, aten.mul.Scalar}
SCALAR_DIV = {aten.div.Tensor, aten.div.Scalar}

SOFTMAX = {aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default,
           aten.logsumexp.default, aten.amax.default, aten.sum.dim_IntList}


def size_hint(x) -> int:
    if isinstance(x, torch.SymInt):
        return int(x.node.hint) if x.node.hint is not None else -1
    return int(x)


def meta_val(n):
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else None


def is_float(n) -> bool:
    v = meta_val(n)
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def has_float(n) -> bool:
    """Is ``n`` (or any tensor in the list/tuple it produces) floating point?"""
    v = meta_val(n)
    vals = v if isinstance(v, (list, tuple)) else [v]
    return any(isinstance(x, torch.Tensor) and x.is_floating_point() for x in vals)


def is_int_tensor(n) -> bool:
    v = meta_val(n)
    return isinstance(v, torch.Tensor) and not v.is_floating_point() and not v.is_complex()


def op_name(n) -> str:
    """The op's name for messages (``index_put``), or the node kind for non-calls."""
    t = n.target
    return getattr(t, "__name__", str(t)) if n.op == "call_function" else n.op


# ---------------------------------------------------------------------------------------------
# Anchor: the score product feeding a value product


def _score_path_op(n) -> bool:
    if n.op != "call_function":
        return False
    t = n.target
    if t is BMM or t is operator.getitem:
        return t is operator.getitem
    if lay.is_layout_node(n) or t in SOFTMAX:
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
            stack.extend(a for a in n.all_input_nodes if is_float(a) or a.target is aten.native_dropout.default)
    if len(found) != 1:
        return None
    s = found.pop()
    shape = meta_val(s).shape
    if len(shape) != 3:
        return None
    if square and not lay.eq(shape[1], shape[2]):
        return None
    return s


def is_square(S) -> bool:
    shape = meta_val(S).shape
    return lay.eq(shape[1], shape[2])


def is_pad(D) -> bool:
    """Whether ``D`` is computed from one float tensor of the graph (and integers, sizes, constants):
    the shape of a pad. What it computes is for the numeric proof."""
    return bool(source_candidates(D))


# ---------------------------------------------------------------------------------------------
# Operands: from a bmm operand back to its pad and the jagged source


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
        if cur.op == "call_function" and cur.target in SCALAR_MUL | SCALAR_DIV and len(cur.args) == 2:
            a0, a1 = cur.args
            if isinstance(a0, torch.fx.Node) and _scalar_of(cur, a1) is not None:
                factor = factor * a1 if cur.target in SCALAR_MUL else factor / a1
                ops.append(cur)
                cur = a0
                continue
            if cur.target in SCALAR_MUL and isinstance(a1, torch.fx.Node) and _scalar_of(cur, a0) is not None:
                factor = factor * a0
                ops.append(cur)
                cur = a1
                continue
        break
    ops.reverse()
    return cur, ops, factor


def _sym_scalar(a):
    """The sympy value of a SymInt graph node (``x / N`` with a symbolic N), else None."""
    val = meta_val(a)
    return sym_expr(val) if isinstance(val, torch.SymInt) else None


def walk_forward(node, sym=False):
    """Follow ``node`` forward through single-user layout ops and scalar multiplies. ``sym``:
    also by SymInt nodes (the factor is then a sympy expression; callers must prove it)."""
    ops, factor, cur = [], 1.0, node

    def scalar(u, a):
        if _scalar_of(u, a) is not None:
            return a
        return _sym_scalar(a) if sym and isinstance(a, torch.fx.Node) else None

    while len(users := [u for u in cur.users if u.target not in SIZE_READS]) == 1:  # size reads: re-pointed
        u = users[0]
        if lay.is_layout_node(u) and u.args[0] is cur:
            ops.append(u)
            cur = u
            continue
        if u.op == "call_function" and u.target in SCALAR_MUL | SCALAR_DIV and len(u.args) == 2:
            a0, a1 = u.args
            if a0 is cur and (c := scalar(u, a1)) is not None:
                factor = factor * c if u.target in SCALAR_MUL else factor / c
                ops.append(u)
                cur = u
                continue
            if u.target in SCALAR_MUL and a1 is cur and (c := scalar(u, a0)) is not None:
                factor = factor * c
                ops.append(u)
                cur = u
                continue
        break
    return cur, ops, factor


_MAX_SOURCES = 4  # dominators tried as a pad's jagged source, nearest first


def _data_inputs(n, cache) -> list:
    """The float inputs of ``n`` that carry data: a graph input, or computed from one. Floats made
    from integers and constants only (zero buffers, ``mask.to(float)``, ``get_attr`` constants) are
    part of whatever reads them."""
    return [a for a in n.all_input_nodes if has_float(a) and _is_data(a, cache)]


# ops whose result depends on their input's shape and dtype only, never its values
_METADATA_ONLY = {aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
                  aten.new_empty_strided.default, aten.empty_like.default, aten.zeros_like.default,
                  aten.ones_like.default, aten.full_like.default}


def _is_data(n, cache) -> bool:
    """Iteratively (graphs are deep): whether a float graph input's values reach ``n``."""
    stack = [n]
    while stack:
        x = stack[-1]
        if x in cache:
            stack.pop()
            continue
        if x.op == "placeholder" or x.target in _METADATA_ONLY:
            cache[x] = x.op == "placeholder" and has_float(x)
            stack.pop()
            continue
        todo = [a for a in x.all_input_nodes if has_float(a) and a not in cache]
        if todo:
            stack.extend(todo)
            continue
        cache[x] = any(cache[a] for a in x.all_input_nodes if has_float(a))
        stack.pop()
    return cache[n]


def source_candidates(D) -> list:
    """The jagged sources ``D`` may pad, nearest first: the float nodes every data path into ``D``
    passes through (its dominators among the float data flow), among the nearest ``_MAX_SOURCES``.
    Found by data flow, whatever ops spell the pad (index_put, scatter, an embedding over a table
    with a sentinel row, a one-hot matmul, ...). A step of the pad itself is no candidate: a tensor
    of the padded shape, or one with other rows than the furthest dominator (rows gathered by the
    offsets, ``[B * N, F]``): the jagged rows of a source are what the offsets count, so taking such
    a step for the source would bind the offsets to the wrong row count. Which candidate the pad
    really reads is decided by the proof (``retry_sources``), in this order."""
    if D.op != "call_function":
        return []
    index = {n: i for i, n in enumerate(D.graph.nodes)}
    cache: dict = {}
    frontier, chain = set(_data_inputs(D, cache)), []
    while frontier and len(chain) < _MAX_SOURCES:
        if len(frontier) == 1:
            (x,) = frontier
            if isinstance(meta_val(x), torch.Tensor) and meta_val(x).dim() >= 1:  # a tuple is no source
                chain.append(x)
            if x.op != "call_function":
                break
            frontier = set(_data_inputs(x, cache))
            continue
        latest = max(frontier, key=index.__getitem__)  # every path through it was seen: expand it
        if latest.op != "call_function":
            break  # two graph inputs reach D: no single source
        frontier.remove(latest)
        frontier |= set(_data_inputs(latest, cache))
    if not chain:
        return []
    dshape = meta_val(D).shape
    rows = meta_val(chain[-1]).shape[0]
    same_rows = [x for x in chain if lay.eq(meta_val(x).shape[0], rows)]
    steps = [x for x in same_rows
             if not (meta_val(x).dim() == len(dshape) and all(map(lay.eq, meta_val(x).shape, dshape)))]
    # a candidate of the padded shape comes last: it is a step of the pad, or, where sizes coincide
    # (one sequence of N rows, whose pad [1, N, F] lost its size-1 batch), the source itself; the
    # proof tells which one is read
    return steps + [x for x in same_rows if x not in steps]


def pad_source(D, skip: int = 0, cands=None) -> torch.fx.Node:
    """The jagged tensor that the pad subgraph ending at ``D`` reads: its ``skip``-th source
    candidate (``cands``, default :func:`source_candidates`)."""
    cands = source_candidates(D) if cands is None else cands
    if not cands:
        raise Decline(f"operand {D.name} ({op_name(D)}) is not computed from a single float tensor of the graph: "
                      f"expected one jagged source")
    if skip >= len(cands):
        raise Decline(f"no jagged source of {D.name} is padded to it")
    return cands[skip]


@dataclasses.dataclass
class Operand:
    """One ``bmm`` operand of a candidate: found here, its layout filled in by ``attn_structure``."""
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
    flat: bool = False    # its features are read flattened to one dim (q and k spell them differently)


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
        xv = meta_val(x)
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
    xv = meta_val(x)
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
    val = meta_val(size) if isinstance(size, torch.fx.Node) else size
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
        v = meta_val(p)
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


class PadMismatch(Decline):
    """The pads ``Ds`` are not ``jagged_to_padded`` of the sources tried: the next candidates may be."""

    def __init__(self, msg, *Ds):
        super().__init__(msg)
        self.Ds = Ds


class Sources:
    """Which source candidate each pad reads in one proof attempt (:func:`retry_sources`)."""

    def __init__(self):
        self.skip: dict = {}   # pad -> index into its source_candidates
        self.count: dict = {}  # pad -> how many it has (the pads this attempt read)

    def pick(self, D) -> torch.fx.Node:
        cands = source_candidates(D)
        self.count[D] = len(cands)
        return pad_source(D, self.skip.get(D, 0), cands)

    def advance(self, Ds) -> bool:
        """Move ``Ds`` to their next candidates; False when none has one left."""
        moved = False
        for D in Ds:
            if self.skip.get(D, 0) + 1 < self.count.get(D, 0):
                self.skip[D] = self.skip.get(D, 0) + 1
                moved = True
        return moved


def retry_sources(attempt):
    """``attempt(sources)`` (a proof reading each pad's chosen source candidate), again with the next
    candidates of the pads that did not match (:class:`PadMismatch`) or, on any other failure, of
    every pad, until it proves or they run out. Raises the first reason from an attempt whose pads
    were proven (``past_pads``, set by the numeric proofs), else the first reason (the nearest
    sources are the plausible ones). A candidate too large to probe is handed on at once."""
    sources, first, past_pads = Sources(), None, None
    while True:
        try:
            return attempt(sources)
        except PadMismatch as e:
            first = first or e
            moved = sources.advance(e.Ds)
        except TooLarge:
            raise
        except (Decline, lay.LayoutError) as e:  # e.g. a table with a sentinel row has one row too many
            first = first or e
            if getattr(e, "past_pads", False):  # its pads were proven: the reason that says most
                past_pads = past_pads or e
            moved = sources.advance(list(sources.count))
        if not moved:
            raise past_pads or first


def find_operand(node, prefix, sources: Optional[Sources] = None) -> Operand:
    """``node``'s operand: its pad ``D`` and jagged source (the one ``sources`` picks, default the
    nearest)."""
    D, ops, factor = walk_sliced(node)
    src = sources.pick(D) if sources is not None else pad_source(D)
    _no_lost_grad(src)
    return Operand(node, D, ops, factor, src, prefix)


def _may_require_grad(node) -> bool:
    """Whether ``node`` may carry a gradient. The ATen retrace drops ``requires_grad`` from its
    fake values, so unless the pipeline recorded it (``meta["requires_grad"]``) we assume it
    does whenever grad mode is on while compiling."""
    val = meta_val(node)
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


def jagged_descriptor(q) -> torch.fx.Node:
    """The single 1-D integer input of the q pad: ``offsets [B+1]`` or per-sequence ``lengths [B]``
    (the model derives offsets itself; which one is decided by ``attn_prove.prove``)."""
    order, leaves = closure([q.D], {q.src})
    # module state (an ``arange`` buffer of positions) is a constant the provers read by value
    ints = [x for x in leaves if is_int_tensor(x) and constants.value(x) is None]
    if len(ints) != 1 or meta_val(ints[0]).dim() != 1:
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
