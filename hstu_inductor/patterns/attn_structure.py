"""Attention, stage 2 (structure): which logical element sits at each position of each operand.

Each padded tensor ``D`` found by ``attn_find`` is taken to be ``pad(src)`` ``[B, N, *F]`` viewed as
``D.shape``; the layout algebra (``attn_layout``) carries that through the operand's layout ops, so
the contractions are checked exactly, with no probe: ``S = A @ K`` contracts the same q/k feature
digits within a head and pairs query rows with key rows of the same sequence, its batch covers every
(sequence, head) once (:func:`analyse`); the chain ``S -> X`` only keeps the shape
(:func:`score_subgraph`); ``X @ V`` pairs the same (sequence, head); the output is laid out
``[B, N, heads, value features]`` before the unpad, and nothing inside the candidate is used outside
it (:func:`structure`). Head and feature splits found here are what the rewrite regroups.

What the checked pieces *compute* (pad, mask, scale, unpad) is left to ``attn_prove``.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Optional

import sympy
import torch

from .. import _compat, config
from ..spec import AttentionSpec
from . import attn_layout as lay
from .attn_find import (
    BMM, SOFTMAX, Operand, feature_slice, find_operand, is_float, jagged_descriptor, meta_val, op_name, size_hint,
)
from . import attn_bias, attn_intervals, constants
from .attn_rowscale import after_unpad, output_chain, unify_scales, unify_side
from .prover import Decline, closure, is_static, sym_expr
from .sizes import SIZE_READS, size_source

aten = torch.ops.aten


def mode_key(m):
    """A hashable, canonical form of a mode (sizes/strides expanded), to compare layouts."""
    return (str(sympy.expand(m[0])), m[1], str(sympy.expand(m[2])))


def dim_key(dim):
    return tuple(mode_key(m) for m in lay.normalize_dim(dim))



@dataclasses.dataclass
class Plan:
    """A candidate as the stages fill it in: operands (find), modes and output (structure), constants
    (prove), the op's arguments (emit)."""
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
    params: AttentionSpec = AttentionSpec()  # the mask options proven
    constants: dict = dataclasses.field(default_factory=dict)  # mask constant symbol -> real value
    pads_proven: bool = False    # the numeric proof got past the pads (attn_prove.past_pads)
    head_modes: list = None      # q-feature modes forming the head index (S batch order)
    c_modes: list = None         # q-feature modes contracted in S
    v_head_modes: list = None    # v-feature modes paired with head_modes
    e_modes: list = None         # v-feature modes of the output
    out_rest: list = None        # modes of out's feature dims (flattened, in order)
    lengths: bool = False        # ``offsets`` is per-sequence lengths [B] (offsets are its cumsum)
    dense: bool = False          # no unpad: ``out`` is the dense [B, N, ...] / [B*N, ...] output
    rest_shape: list = None      # feature sizes of the dense output
    offsets_arg: Optional[torch.fx.Node] = None  # the offsets node passed to the op (rewrite)
    N_node: object = None        # symbolic N: the node holding it, or (graph input, dim) of a size
    N_arg: object = None         # the op's max_seq_len argument (rewrite)
    scale_per_n: bool = False    # symbolic N: the op's scale is ``scale`` (or the scale input) / N
    B: object = None             # batch size (sympy expression)
    Z: tuple = None              # modes of the score product's batch dim: (sequence, head digits)
    Y: tuple = None              # layout of the value product's right operand (v)
    size_reads: list = dataclasses.field(default_factory=list)  # size reads re-pointed by the rewrite
    metadata_asserts: list = dataclasses.field(default_factory=list)  # export's asserts on replaced casts
    rab: object = None           # attn_bias.Bias: tensors added to the scores before the activation
    intervals: object = None     # attn_intervals.Intervals: the interval tensor the mask is decoded from



@dataclasses.dataclass
class Subgraphs:
    """What :func:`structure` found for the numeric proof (``attn_prove``) to run on probes."""
    s_order: list                # the score chain S -> X, in graph order
    layouts: dict                # node of the score chain -> its layout (axes b, i, j, head digits)
    S_layout: tuple              # layout of the score product S
    scale_leaf: Optional[torch.fx.Node]  # the attn_scale input, if any
    Odense: torch.fx.Node        # the dense output the unpad reads (or the output, with no unpad)
    u_order: list                # the unpad subgraph, in graph order
    u_leaves: set
    rest_shape: list             # feature sizes of the dense output (sympy)
    fo: float                    # scalar factor on the output chain
    chain_scale: bool            # the score chain reads scale_leaf
    pre: dict                    # row scales before the unpad (node -> RowScale)
    post: dict                   # row scales after the unpad (optional: left to the user if unproven)


def feature_axes(src, prefix):
    shape = meta_val(src).shape
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
        shape = meta_val(src).shape
        if not all(is_static(s) for s in shape[1:]):
            raise Decline(f"jagged source {src.name} has symbolic feature dims {tuple(shape)}")
    return [int(s) for s in shape[1:]], [f"{prefix}{k}" for k in range(len(shape) - 1)]


def check_tiles(modes, sizes, axes, what):
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


def through_layout(ops, layout):
    """``layout`` carried through layout ops ``ops`` (feature slices are only modelled by
    :func:`operand_layout`)."""
    for op in ops:
        if feature_slice(op) is not None:  # only operand_layout models slices of a pad
            raise Decline(f"{op.name} slices a padded tensor (not supported here)")
        if lay.is_layout_node(op):
            layout = lay.apply(op, layout)
    return layout


def operand_layout(x: Operand, B, N, sizes, axes, packed=False):
    """Layout of ``x.node`` (sets ``x.layout``, ``x.narrows``, ``x.feat``): the pad ``D`` is
    ``[B, N, *sizes]`` viewed as ``D.shape`` (``packed``: ``D`` is the jagged source itself, ``[L, *sizes]``
    with rows on axis ``r``, and ``N`` is ``L``); feature slices narrow the logical source."""
    if packed:
        layout = lay.source_layout([N, *sizes], ["r", *axes])
    else:
        layout = lay.view(lay.source_layout([B, N, *sizes], ["b", "n", *axes]), meta_val(x.D).shape)
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


def batch_size(plan) -> sympy.Expr:
    """``B`` from the jagged descriptor: ``len(lengths)`` or ``len(offsets) - 1``."""
    n = sym_expr(meta_val(plan.offsets).shape[0])
    return n if plan.lengths else n - 1


def batch_hint(plan) -> int:
    return size_hint(meta_val(plan.offsets).shape[0]) - (0 if plan.lengths else 1)


def score_modes(QL, KL, bkey, fq, axq):
    """``(batch modes, head_modes, c_modes)`` of a score product with q/k layouts ``QL``/``KL``
    (full and delta attention): its batch is (sequence, head), no operand broadcasts, it contracts
    q/k features only, and the head and feature modes tile q's features. Raises Decline."""
    Z = lay.normalize_dim(QL[0])
    # one sequence (B = 1, specialised by Dynamo even under dynamic=True): its size-1 mode is dropped
    # by normalisation, so the batch holds the head modes only
    want = 0 if bkey[0] == "1" else 1
    if [mode_key(m) for m in Z].count(bkey) != want or any(m[1] != "b" and not str(m[1]).startswith("q") for m in Z):
        raise Decline("score product batch is not (sequence, head)")
    if any(m[1] is None for d in QL for m in d) or any(m[1] is None for d in KL for m in d):
        raise Decline("score product broadcasts an operand")
    c_modes = list(lay.normalize_dim(QL[2]))
    if any(not str(m[1]).startswith("q") for m in c_modes):
        raise Decline("score product contracts over something other than features")
    head_modes = [m for m in Z if m[1] != "b"]
    check_tiles(head_modes + c_modes, fq, axq, "score product")
    return Z, head_modes, c_modes


def value_modes(Y, nkey):
    """Output feature modes of a value product with v layout ``Y`` contracting over the key rows
    ``nkey``; they must all be value features. Raises Decline."""
    if len(Y) != 3 or dim_key(Y[1]) != nkey:
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
        return is_n(meta_val(n))

    graph = q_D.graph
    found = [n for n in graph.nodes if n.op == "placeholder" and holds_n(n)]
    found += [n for n in graph.nodes if n.target is aten.sym_size.int and n.args[0].op == "placeholder"
              and holds_n(n)]
    order, leaves = closure([q_D], set())
    found += [n for n in [*order, *leaves] if holds_n(n)]  # used by the pad: defined before the output
    if found:
        return found[0]
    for n in graph.nodes:  # a graph input's size, e.g. a padded tensor marked dynamic
        val = meta_val(n)
        if n.op == "placeholder" and isinstance(val, torch.Tensor):
            for d, s in enumerate(val.shape):
                if is_n(s):
                    return (n, d)
    raise Decline(f"no graph input carries the symbolic N={Nexpr} of the padded {name}")


def analyse(S, pv, lengths=False, sources=None) -> Plan:
    """Structural part of the proof. Raises Decline. ``lengths``: read the jagged integer input as
    per-sequence lengths rather than offsets; ``sources``: which source candidate each pad reads (``attn_find.Sources``)."""
    q = find_operand(S.args[0], "q", sources)
    k = find_operand(S.args[1], "q", sources)  # k's features must line up with q's: same axis names
    v = find_operand(pv.args[1], "v", sources)
    fq, axq = feature_axes(q.src, "q")
    fk, _ = feature_axes(k.src, "q")
    if fq != fk and math.prod(fq) == math.prod(fk):
        # the same features spelled with other dims ([L, H*D] and [L, H, D]): read both flat (a view)
        fq, axq, fk = [math.prod(fq)], ["q0"], [math.prod(fk)]
        q.flat = k.flat = True
    fv, axv = feature_axes(v.src, "v")
    dt = {meta_val(x.src).dtype for x in (q, k, v)}
    if len(dt) != 1:
        raise Decline(f"q, k, v dtypes differ: {dt}")

    offsets = jagged_descriptor(q)
    plan = Plan(pv=pv, S=S, out=None, q=q, k=k, v=v, offsets=offsets, num_targets=None, N=0, lengths=lengths)
    B = batch_size(plan)
    for x in (k, v):  # separate symbols are fine (the jagged contract makes them equal), hints must agree
        if size_hint(meta_val(x.src).shape[0]) != size_hint(meta_val(q.src).shape[0]):
            raise Decline("q, k, v have different numbers of jagged rows")

    # N from the dense size of the q pad
    numel = sympy.Integer(1)
    for s in meta_val(q.D).shape:
        numel = numel * sym_expr(s)
    Nexpr = sympy.cancel(numel / (B * math.prod(fq)))
    if Nexpr.is_Integer:
        if int(Nexpr) <= 0:
            raise Decline(f"padded size of {q.src.name} is not B * N * features for a constant N ({Nexpr})")
        N = plan.N = int(Nexpr)
    else:
        N = plan.N = Nexpr
        plan.N_node = symbolic_n(Nexpr, B, [meta_val(x.src).shape[0] for x in (q, k, v)], q.D, q.src.name)

    for x, f, axes in ((q, fq, axq), (k, fk, axq), (v, fv, axv)):
        operand_layout(x, B, N, f, axes)
    if q.feat != k.feat:
        raise Decline(f"q {q.feat} and k {k.feat} feature shapes differ")
    fq, fv = q.feat, v.feat

    A, K = q.layout, k.layout
    if len(A) != 3 or len(K) != 3:
        raise Decline("score product operands are not 3-D")
    nmode = ((lay.to_expr(N), "n", sympy.Integer(1)),)
    bkey = mode_key((B, "b", sympy.Integer(1)))
    if dim_key(A[1]) != tuple(mode_key(m) for m in nmode) or dim_key(K[2]) != tuple(mode_key(m) for m in nmode):
        raise Decline("score product does not pair query rows with key rows of the padded sequences")
    if dim_key(A[2]) != dim_key(K[1]) or not lay.normalize_dim(A[2]):
        raise Decline("score product does not contract the same q/k feature digits")
    if dim_key(A[0]) != dim_key(K[0]):
        raise Decline("score product batches q and k differently")
    plan.Z, plan.head_modes, plan.c_modes = score_modes(A, K, bkey, fq, axq)

    # PV product
    plan.Y = v.layout
    plan.e_modes = value_modes(v.layout, tuple(mode_key(m) for m in nmode))
    plan.B = B
    return plan


# ---------------------------------------------------------------------------------------------
# Score subgraph: S -> X (shape-preserving ops + mask + scale)


def score_subgraph(plan: Plan, Xnode, rows=None):
    """Walk the shape-preserving chain ``S -> X``. ``rows``: the size of ``S``'s query-row dim
    (``N`` for full attention, the delta rows per sequence for cached attention)."""
    S = plan.S
    Zd = plan.Z
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
        if t in SOFTMAX:
            raise Decline(f"scores are reduced by {op_name(n)} (softmax-like normalisation): not HSTU attention")
        tags = getattr(t, "tags", ())
        if torch.Tag.nondeterministic_seeded in tags or t is operator.getitem:
            raise Decline(f"dropout/random op {op_name(n)} on the attention weights: not modelled by hstu.attention")
        if lay.is_layout_node(n):
            layouts[n] = lay.apply(n, layouts[n.args[0]])
            continue
        if t is BMM:
            raise Decline("scores feed another product before the value product")
        out = meta_val(n)
        if not isinstance(out, torch.Tensor) or not out.is_floating_point() and t not in (aten.ne.Scalar,):
            raise Decline(f"{op_name(n)} on the scores does not give floating scores")
        for a in sd:
            ashape = meta_val(a).shape
            if len(ashape) != len(out.shape) or not all(lay.eq(x, y) for x, y in zip(ashape, out.shape)):
                raise Decline(f"{op_name(n)} changes the shape of the scores (reduction or broadcast)")
        keys = {tuple(dim_key(d) for d in layouts[a]) for a in sd}
        if len(keys) != 1:
            raise Decline(f"{op_name(n)} combines the scores with a differently laid out copy of themselves")
        layouts[n] = layouts[sd[0]]
    if Xnode not in sderived:
        raise Decline("value product operand does not come from the scores")
    return order, leaves, sderived, layouts, S_layout


# ---------------------------------------------------------------------------------------------
# The value product and the output side


def value_heads(plan, XL) -> list:
    """The v-feature modes paired with ``plan.head_modes`` by the value product ``X @ V`` (``XL``: the
    layout of ``X``): its batch must cover every (sequence, head) of the scores ``plan.Z`` once and
    pair each with the same sequence and an equally sized head of ``v`` (layout ``plan.Y``)."""
    XZ = lay.normalize_dim(XL[0])
    if sorted(map(mode_key, XZ)) != sorted(map(mode_key, plan.Z)) or any(m[1] is None for d in XL for m in d):
        raise Decline("value product batch does not cover every (sequence, head) of the scores once")
    YZ = lay.normalize_dim(plan.Y[0])
    if len(YZ) != len(XZ):
        raise Decline("scores and values are batched differently (head layouts do not pair)")
    pair = {}
    for mx, mv in zip(XZ, YZ):
        if mx[1] == "b":
            if mode_key(mv) != mode_key(mx):
                raise Decline("scores and values pair different sequences")
        elif mv[1] is None or not mv[1].startswith("v") or not lay.eq(mx[0], mv[0]):
            raise Decline("scores and values pair heads of different sizes")
        else:
            pair[mode_key(mx)] = mv
    return [pair[mode_key(m)] for m in plan.head_modes]


def side_inputs(s_leaves, plan, batch: int, rows: int) -> tuple:
    """``(num_targets, scale input)`` among the leaves of the score chain (either may be None):
    besides ``S``, offsets, sizes and constants, the chain may read one 1-D integer input of
    ``batch`` entries (num_targets) and one float input that is a scalar or has ``rows`` entries
    (attn_scale). Anything else is data we do not model: Decline."""
    nt, scale_leaf = None, None
    for leaf in s_leaves:
        if leaf is plan.S or leaf is plan.offsets:
            continue
        val = meta_val(leaf)
        if isinstance(val, (torch.SymInt, int)) or leaf.op == "get_attr" or constants.value(leaf) is not None:
            continue  # sizes and constants (module state is read by value: ``constants``)
        if isinstance(val, torch.Tensor) and not val.is_floating_point():
            if val.dim() == 1 and size_hint(val.shape[0]) == batch and nt is None \
                    and leaf.op == "placeholder":
                nt = leaf
                continue
            raise Decline(f"mask depends on input {leaf.name} of shape {tuple(val.shape)}, which is neither "
                          f"offsets nor num_targets (data we do not model)")
        if isinstance(val, torch.Tensor) and scale_leaf is None and (
                val.numel() == 1 or (val.dim() == 1 and size_hint(val.shape[0]) == rows)):
            scale_leaf = leaf
            continue
        raise Decline(f"scores depend on tensor {leaf.name} of shape {tuple(getattr(val, 'shape', ()))} "
                      f"(data we do not model)")
    return nt, scale_leaf


def structure(S, pv, lengths, sources=None, intervals=True) -> tuple[Plan, Subgraphs]:
    """The structural proof of a full-attention candidate (``lengths``: read the jagged integer input
    as lengths): :func:`analyse`, then the score chain, its side inputs (num_targets, attn_scale),
    the output side (row scales, unpad) and that no intermediate is used outside the candidate.
    ``intervals=False``: no interval tensor is cut out of the score chain. Returns the plan and the
    subgraphs the numeric proof runs. Raises Decline."""
    plan = analyse(S, pv, lengths, sources)
    N, B = plan.N, plan.B
    q, k, v = plan.q, plan.k, plan.v

    # ---- score subgraph structure
    Xnode = pv.args[0]
    s_order, s_leaves, sderived, layouts, S_layout = score_subgraph(plan, Xnode)
    XL = layouts[Xnode]
    if len(XL) != 3:
        raise Decline("value product left operand is not 3-D")
    ikey = ((str(sympy.expand(lay.to_expr(N))), "i", "1"),)
    jkey = ((str(sympy.expand(lay.to_expr(N))), "j", "1"),)
    if dim_key(XL[1]) != ikey or dim_key(XL[2]) != jkey:
        raise Decline("value product does not contract the scores over key rows")
    plan.v_head_modes = value_heads(plan, XL)
    _, axv = feature_axes(v.src, "v")
    check_tiles(plan.v_head_modes + plan.e_modes, v.feat, axv, "value product")

    # a bias added to the scores and an interval tensor read by the mask are cut out of the chain:
    # the proof binds them to probes (attn_bias, attn_intervals)
    plan.rab = attn_bias.find_bias(s_order, sderived, layouts, plan)
    plan.intervals = attn_intervals.find_intervals(s_order, s_leaves, sderived, plan) if intervals else None
    cut = attn_bias.cut_nodes(plan.rab) | ({plan.intervals.node} if plan.intervals else set())
    if cut:
        s_order, s_leaves = closure([Xnode], {S, *cut})
        s_leaves = s_leaves - cut

    # side inputs of the score subgraph
    nt, scale_leaf = side_inputs(s_leaves, plan, batch_hint(plan), size_hint(meta_val(q.src).shape[0]))
    plan.num_targets = nt
    if plan.intervals is not None and nt is not None:
        raise Decline("mask reads an interval tensor and num_targets (intervals replace the HSTU mask)")
    chain_scale = scale_leaf is not None

    # ---- output side: O -> dense (-> row scales) -> unpad (-> row scales)
    Odense, o_ops, fo, pre = output_chain(pv, plan)
    scale_leaf = unify_scales(scale_leaf, chain_scale, pre)
    o_users = [u for u in Odense.users if u.target not in SIZE_READS]
    U = o_users[0] if len(o_users) == 1 else None
    # no unpad in this graph (e.g. a graph break before torch.nested.masked_select, or a padded
    # consumer): the dense output itself is replaced by pad(hstu.attention) (padding rows proven 0)
    plan.dense = U is None or U.op != "call_function" or not reads_rows(U, meta_val(q.src).shape[0])
    out = U = Odense if plan.dense else U
    if isinstance(meta_val(U), (tuple, list)):
        gets = [u for u in U.users if u.target is operator.getitem and u.args[1] == 0]
        if len(gets) != 1:
            raise Decline("unpad output is not used as a tensor")
        out = gets[0]
    plan.out = out
    OL = (layouts[Xnode][0], ((lay.to_expr(N), "i", sympy.Integer(1)),), plan.Y[2])
    for op in o_ops:  # layouts of the dense operands of the row scales, for the numeric proof
        if op in pre:
            pre[op].layout = OL
        OL = through_layout([op], OL)
    post = {} if plan.dense else unify_side(scale_leaf, chain_scale or any(m.power for m in pre.values()),
                                             after_unpad(out, plan))
    scale_leaf = scale_leaf or next((m.leaf for m in post.values() if m.leaf is not None), None)
    first = lay.normalize_dim(OL[0]) if OL else ()
    bi = (mode_key((B, "b", sympy.Integer(1))), mode_key((lay.to_expr(N), "i", sympy.Integer(1))))
    if bi[0][0] == "1":  # one sequence: its size-1 mode is dropped by normalisation (see score_modes)
        bi = bi[1:]
    if tuple(map(mode_key, first)) == bi:
        rest = OL[1:]
    elif len(OL) >= 2 and tuple(map(mode_key, first)) == bi[:-1] and dim_key(OL[1]) == bi[-1:]:
        rest = OL[2:]
    else:
        raise Decline("dense attention output is not laid out as [B, N, ...] before the unpad"
                      + (f" (no unpad: consumed by {', '.join(sorted(u.name for u in Odense.users))})"
                         if plan.dense else ""))
    out_rest = [m for d in rest for m in lay.normalize_dim(d)]
    want = {mode_key(m): m for m in plan.head_modes + plan.e_modes}
    if sorted(map(mode_key, out_rest)) != sorted(want) or any(m[1] is None for m in out_rest):
        raise Decline("unpadded output features are not exactly (head, value feature)")
    plan.out_rest = out_rest
    rest_shape = [sym_expr(s) for s in meta_val(Odense).shape[len(OL) - len(rest):]]
    out_shape = [sym_expr(s) for s in meta_val(out).shape]
    if not plan.dense and (len(out_shape) != 1 + len(rest_shape)
                           or not all(lay.eq(a, b) for a, b in zip(out_shape[1:], rest_shape))):
        raise Decline("unpad output shape is not [L, features]")
    plan.rest_shape = [int(s) for s in rest_shape] if all(s.is_Integer for s in rest_shape) else None
    if plan.dense and plan.rest_shape is None:
        raise Decline("dense attention output has symbolic feature dims")
    if plan.dense and not all(is_static(s) or lay.eq(s, N) for s in meta_val(out).shape[1:]):
        raise Decline("dense attention output has symbolic sizes other than N")

    # ---- extra users: intermediates must stay inside the candidate
    region = set()
    for x in (q, k, v):
        order, _ = closure([x.D], {x.src})
        region |= {n for n in order if is_float(n)}
        region |= set(x.ops)
        region |= {op.args[0] for op in x.ops if op.target is operator.getitem}  # the split itself
    region |= {n for n in sderived}
    region |= {pv, *o_ops}
    u_order, u_leaves = closure([out], {Odense})
    region |= {n for n in u_order if is_float(n) and n is not out}
    if U is not out:
        region.add(U)
    region.discard(out)  # dense mode: the output is Odense itself
    pads = {x.D for x in (q, k, v)}
    for n in region:
        for u in n.users:
            if u in region or u is out or is_dead(u):
                continue
            if u.target in SIZE_READS and size_source(u) is not None:  # re-read from inputs on rewrite
                plan.size_reads.append(u)
                continue
            if u.target is aten._assert_tensor_metadata.default:  # export's check of a cast: dropped with it
                plan.metadata_asserts.append(u)
                continue
            if n in pads and _head_slice(u):
                continue  # another head's slice of a shared pad (a loop over heads): dead once each is rewritten
            raise Decline(f"intermediate {n.name} has a user outside the attention ({u.name}); "
                          f"rewriting would keep it alive")
    return plan, Subgraphs(s_order, layouts, S_layout, scale_leaf, Odense, u_order, u_leaves, rest_shape, fo,
                           chain_scale, pre, post)


def _head_slice(u) -> bool:
    """``u`` is a feature slice of a padded tensor, possibly after identity layout ops (another head's
    operand in a loop over heads)."""
    for _ in range(4):
        if feature_slice(u) is not None:
            return True
        if not lay.is_layout_node(u) or len(u.users) != 1:
            return False
        u = next(iter(u.users))
    return False


def reads_rows(U, rows) -> bool:
    """Whether ``U`` (the dense output's user) has one row per jagged row: the shape of an unpad,
    whatever ops spell it (its meaning is proven numerically)."""
    val = meta_val(U)
    val = val[0] if isinstance(val, (tuple, list)) and val else val
    return isinstance(val, torch.Tensor) and val.dim() >= 1 and lay.eq(val.shape[0], rows)


def is_dead(n, depth=0) -> bool:
    """A pure node whose result is never used (e.g. the ``detach`` autograd leaves on saved
    tensors while tracing): it does not keep an intermediate alive."""
    if depth > 8 or n.op != "call_function" or n.is_impure():
        return False
    if not (lay.is_layout_node(n) or n.target in (aten.detach.default, operator.getitem)):  # getitem: split output
        return False
    return all(is_dead(u, depth + 1) for u in n.users)
