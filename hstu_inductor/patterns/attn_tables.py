"""Attention bias, path (b): bias terms proven to be the original HSTU's table bias go to the op's tables.

A bias term ``R`` found by ``attn_bias`` (a tensor added to the scores before the silu) is proven to be

    R(b, h, i, j) = Tp[c + j - i (, h)] + Tt[bucket(ts_b(q(i)) - ts_b(j)) (, h)]      (either part may be absent)

on every in-sequence position, for tables ``Tp`` / ``Tt`` read from graph inputs, shared by the heads (``[V]``
or ``[V, 1]``) or with a column per head (``[V, H]``: head h reads column h, as ``nn.Embedding(V, H)`` gathered
and moved to the head axis), each independently,
the jagged timestamps ``ts`` padded with 0 by the user's own pad (or a ``[B, N]`` timestamps input the
caller padded, read as it is), ``q(i) = next(i) = min(i + 1, N - 1)`` (the original HSTU) or ``q(i) = i``
(the op's ``ts_next``), and a
bucket that is a non-decreasing step function of ``|dt|``. Then the op gets ``timestamps``,
``pos_w = Tp[c - N + 1 : c + N]``, ``ts_w = Tt`` (``[H, ...]``, transposed, per head) and the bucket's
thresholds ``ts_bounds`` and computes
the bias in-kernel (docs/semantics.md, path (b)): nothing ``N x N`` is materialised, and gradients reach
the tables through the op. Anything unproven stays a dense ``rab`` term (path (a), ``attn_bias``).

What is read from the graph (structure), and what is proven (numbers):

* The time table's gather (``index`` / ``index_select`` / ``embedding`` of a view of ``Tt``) and its index
  ``I`` are found structurally. ``I`` is walked back through position ops (which move values, never
  change them) and value ops that are each monotone (``abs`` first, then clamp / log / div / mul /
  floor / casts / bucketize ... by constants) to a ``sub``, the gap ``G``. So the bucket is a function
  of the gap alone, monotone in ``|dt|``. Run on CPU tensors of ``G``'s dtype (its own rounding: an
  fp32 log of int64 gaps stays fp32), ``reference.time_bucket_bounds`` bisects its thresholds, which
  are checked against it at each threshold and its predecessor, at 0, at the largest gap and on
  samples of both signs: with monotony, that is equality with ``buckets_from_bounds`` for every gap.
* Everything else is proven on the attention proof's probes: the user's ``R`` is evaluated with
  zero tables (it must vanish: no other part), with each table holding distinct integers (the index
  each position reads) and with random tables (``R`` is exactly the sum of the two gathers), on random
  timestamps with log-spread gaps of both signs. The position index must be ``c + j - i`` for one
  constant ``c`` (across probe values of a symbolic ``N``: ``c - N`` constant), and the time index the
  reference bucket of the 0-padded timestamps' ``ts(q(i)) - ts(j)``, on every in-sequence position
  of every head.

Static sizes too large to probe: ``attn_prove`` leaves a term that :func:`analyse` finds plausible
uncut in the generalised copy (``attention._prove_generalised``), so this proof runs there on small
probes; a literal of the bucket that the copy made a constant symbol is read at its real value.

The thresholds reach the graph as a buffer of the rewritten module (``get_attr`` + ``lift_fresh_copy``,
:func:`emit_tables`): AOTAutograd lifts it like the model's own buffers, export keeps it as state.
"""
from __future__ import annotations

import contextvars
import dataclasses
import math
import operator

import torch

from .. import _compat, config
from ..reference.jagged import jagged_to_padded
from ..reference.rab import buckets_from_bounds, map_fits, time_bucket_bounds
from . import attn_layout as lay
from . import constants
from .attn_find import meta_val
from .prover import Decline, attribute, close, closure, concrete, evaluate, probe_values, solve_binding, sym_expr

aten = torch.ops.aten

# ops that move values without changing them (the bucket function skips them)
_POSITION = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default, aten.permute.default,
    aten.transpose.int, aten.t.default, aten.clone.default, aten.detach.default, aten.alias.default,
    aten.slice.Tensor, aten.select.int, aten.flatten.using_ints, aten.index.Tensor, aten.index_select.default,
    aten.repeat.default,
}
# value ops monotone in their one timestamp-dependent input (other inputs: scalar constants)
_MONOTONE = {
    aten.clamp.default, aten.clamp.Tensor, aten.clamp_min.default, aten.clamp_max.default, aten.log.default,
    aten.log2.default, aten.log10.default, aten.log1p.default, aten.sqrt.default, aten.exp.default,
    aten.floor.default, aten.ceil.default, aten.trunc.default, aten.round.default, aten._to_copy.default,
    aten.div.Tensor, aten.div.Tensor_mode, aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor,
    aten.floor_divide.default, aten.minimum.default, aten.maximum.default, aten.bucketize.Tensor,
    aten.neg.default, aten.relu.default, aten.searchsorted.Tensor,
}
_SORTED = {aten.bucketize.Tensor: 1, aten.searchsorted.Tensor: 0}  # the boundaries' argument
_FIRST_ONLY = {aten.div.Tensor, aten.div.Tensor_mode, aten.floor_divide.default, aten.bucketize.Tensor}
_TABLE_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
                aten.squeeze.dim, aten.squeeze.default, aten.squeeze.dims, aten.t.default, aten.clone.default,
                aten.detach.default, aten.alias.default, aten._to_copy.default, aten.slice.Tensor}
_TS_DTYPES = (torch.int32, torch.int64, torch.float32, torch.float64)


@dataclasses.dataclass
class TermCheck:
    """One bias term on its way to path (b): what was read structurally, what the probes found."""
    term: object                      # attn_bias.BiasTerm
    pos: torch.fx.Node = None         # position table leaf
    ts: torch.fx.Node = None          # time table leaf
    index: torch.fx.Node = None       # the time gather's index I
    gap: torch.fx.Node = None         # G = ts(.) - ts(.)
    stamps: torch.fx.Node = None      # X: the jagged timestamps [L] the pad reads, or padded [B, N] ones
    dense: bool = False               # X is [B, N] (an input padded by the caller, read as it is)
    ts_next: bool = None              # the gap is ts(next(i)) - ts(j) (True) or ts(i) - ts(j); None: not read yet
    source: torch.fx.Node = None      # the graph input the timestamps come from
    bounds: torch.Tensor = None       # thresholds of the bucket (CPU)
    order_i: list = None              # closure of I from X (native dtypes)
    order_r: list = None              # closure of R from the tables, X and I (float64)
    sizes: list = dataclasses.field(default_factory=list)  # SymInt leaves of both closures
    deltas: set = dataclasses.field(default_factory=set)   # c - (N - 1) per probe
    probes: int = 0
    heads: dict = dataclasses.field(default_factory=dict)  # table leaf -> it has a column per head
    reason: str = None                # why the term stays a dense rab term


@dataclasses.dataclass
class Tables:
    """The op's table bias: which terms moved, from which tables, with which factors."""
    terms: list
    pos: tuple = None                 # (table leaf, delta, factor)
    ts: tuple = None                  # (table leaf, factor)
    stamps: torch.fx.Node = None
    ts_dtype: torch.dtype = None      # the op's timestamps dtype: the gap's
    bounds: torch.Tensor = None
    ts_next: bool = True              # the gap of the time bucket: ts(next(i)) - ts(j), else ts(i) - ts(j)
    per_head: frozenset = frozenset()  # the table leaves with a column per head ([V, H])


def _is_table(n) -> bool:
    """A float ``[V]`` or ``[V, C]`` input (``C`` 1, or one column per head: the probes decide)."""
    val = meta_val(n)
    return n.op in ("placeholder", "get_attr") and isinstance(val, torch.Tensor) and val.is_floating_point() \
        and val.dim() in (1, 2)


def _tensor_leaves(leaves, allowed):
    """The data inputs among ``leaves``: constants (``get_attr``, module state) are read by value."""
    return [x for x in leaves if x not in allowed and isinstance(meta_val(x), torch.Tensor) and x.op != "get_attr"
            and constants.value(x) is None]


# Whether the graph being rewritten computes gradients (``pipeline.rewrite_dynamo_graph`` sets it from the
# Dynamo graph's inputs; the ATen retrace's inputs no longer say). Export programs: False.
TRAINING: contextvars.ContextVar[bool] = contextvars.ContextVar("hstu_training", default=False)


def wanted() -> bool:
    """``config.rab_tables``: "auto" takes the tables in training (where the dense path's bias build and its
    scatter into the tables dominate the step), the dense bias in inference (faster without gradients)."""
    if config.rab_tables != "auto":
        return bool(config.rab_tables)
    return TRAINING.get()


def analyse(plan) -> list:
    """A :class:`TermCheck` for every bias term that reads a 1-D float table (structural part)."""
    if plan.rab is None or not wanted():
        return []
    out = []
    for t in plan.rab.terms:
        _, leaves = closure([t.node], set())
        tables = [x for x in leaves if _is_table(x)]
        if not tables:
            continue
        tc = TermCheck(t)
        try:
            _structure(tc, plan, tables)
        except Decline as e:
            tc.reason = str(e)
        out.append(tc)
    return out


def op_has_tables() -> bool:
    """The op takes ``ts_bounds`` (the tables without thresholds could only express the fp64 bucket)."""
    schema = torch.ops.hstu.attention.default._schema
    return any(a.name == "ts_bounds" for a in schema.arguments)


def _views(T, within):
    """``T`` and the views / casts of it inside the term (what a gather may read)."""
    out, stack = {T}, [T]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in within and u.target in _TABLE_VIEWS and u.args[0] is n and u not in out:
                out.add(u)
                stack.append(u)
    return out


def _gather_index(n, views):
    """The index tensor of ``n`` when ``n`` gathers from one of ``views`` along its first dim."""
    if n.target is aten.index.Tensor and n.args[0] in views:
        idx = list(n.args[1])
        if len(idx) == 1 and isinstance(idx[0], torch.fx.Node):
            return idx[0]
    if n.target is aten.index_select.default and n.args[0] in views and n.args[1] == 0:
        return n.args[2]
    if n.target is aten.embedding.default and n.args[0] in views:
        return n.args[1]
    return None


def _structure(tc, plan, tables):
    """The time table (gathered by data), the position table (the other one), the bucket, the
    timestamps and the evaluation orders; Decline when the term cannot be the table bias."""
    t = tc.term
    order, _ = closure([t.node], set())
    within = set(order)
    timed = []
    for T in tables:
        views = _views(T, within)
        for n in order:
            idx = _gather_index(n, views)
            if idx is None:
                continue
            _, ileaves = closure([idx], set())
            if _tensor_leaves(ileaves, {plan.offsets, T}):
                timed.append((T, idx))
    if len({T for T, _ in timed}) > 1 or len(timed) > 1:
        raise Decline("the time table is gathered more than once (or several tables by data)")
    if timed:
        tc.ts, tc.index = timed[0]
        if not lay.to_expr(sym_expr(meta_val(tc.ts).shape[0])).is_Integer:
            raise Decline("time table of symbolic size (the thresholds depend on its length)")
        _bucket(tc, plan)
    rows = sym_expr(meta_val(plan.q.src).shape[0])
    # what the bucket reads (its boundaries, a module buffer) is part of the bucket function, not a table
    bucket_reads = closure([tc.index], set())[1] if tc.index is not None else set()
    rest = [T for T in tables if T is not tc.ts and T is not tc.source  # float [L] timestamps are no table
            and T not in bucket_reads and not (rows.free_symbols and lay.eq(sym_expr(meta_val(T).shape[0]), rows))]
    if len(rest) > 1:
        raise Decline(f"{len(rest)} tables gathered by position (the op takes one)")
    tc.pos = rest[0] if rest else None
    if tc.pos is None and tc.ts is None:
        raise Decline(f"bias term {t.node.name} reads no table besides its timestamps")
    cut = {tc.stamps, tc.index} - {None}
    tc.order_r, rleaves = closure([t.node], cut)
    extra = _tensor_leaves(rleaves, {plan.offsets, tc.pos, tc.ts} | cut)
    ileaves = closure([tc.index], {tc.stamps})[1] if tc.index is not None else set()
    tc.sizes = [x for x in rleaves | ileaves if isinstance(meta_val(x), torch.SymInt)]
    if extra:
        raise Decline(f"bias term {t.node.name} also reads {extra[0].name} (not a table bias alone)")


def _bucket(tc, plan):
    """The bucket chain ``G -> I`` (monotone value ops of |G|), the timestamps, the thresholds."""
    _, leaves = closure([tc.index], set())
    srcs = _tensor_leaves(leaves, {plan.offsets})
    if len(srcs) != 1:
        raise Decline(f"time bucket reads {len(srcs)} tensors besides the offsets (not one timestamp tensor)")
    order, _ = closure([tc.index], set())
    dep = {srcs[0]}
    for n in order:
        if any(a in dep for a in n.all_input_nodes):
            dep.add(n)
    chain, cur = [], tc.index
    while True:
        ins = [a for a in cur.all_input_nodes if a in dep]
        if cur.target is aten.sub.Tensor and len(ins) == 2 and not cur.kwargs:
            break
        if len(ins) != 1 or cur.op != "call_function":
            raise Decline(f"time bucket: {cur.name} ({_name(cur)}) is not a function of one gap ts(.) - ts(.)")
        if cur.target in _POSITION:
            if cur.args[0] is not ins[0]:
                raise Decline(f"time bucket: {cur.name} gathers by the timestamps")
        elif cur.target in _MONOTONE or cur.target is aten.abs.default:
            uses = _uses(cur, ins[0])
            if uses != 1:  # x * x is no monotone function of x
                raise Decline(f"time bucket: {cur.name} ({_name(cur)}) reads the gap {uses} times")
            if cur.target in _FIRST_ONLY and cur.args[0] is not ins[0]:
                raise Decline(f"time bucket: {cur.name} ({_name(cur)}) divides by the gap (not monotone)")
            if cur.target in _SORTED and cur.args[_SORTED[cur.target]] is ins[0]:
                raise Decline(f"time bucket: {cur.name} ({_name(cur)}) searches the gap (not monotone)")
            for a in cur.all_input_nodes:
                if a is ins[0] or cur.target in _SORTED:
                    continue
                v = meta_val(a)
                if isinstance(v, torch.Tensor) and v.numel() != 1:
                    raise Decline(f"time bucket: {cur.name} combines the gap with a non-scalar tensor")
        else:
            raise Decline(f"time bucket: {cur.name} ({_name(cur)}) is not a monotone op of the gap")
        chain.append(cur)
        cur = ins[0]
    tc.gap, tc.source = cur, srcs[0]
    chain.reverse()
    values = [n for n in chain if n.target not in _POSITION]
    if not values or values[0].target is not aten.abs.default or \
            any(n.target is aten.abs.default for n in values[1:]):
        raise Decline("time bucket is not a monotone function of |ts(.) - ts(.)| (abs first)")
    gdt = meta_val(tc.gap).dtype
    if gdt not in _TS_DTYPES or meta_val(tc.index).is_floating_point():
        raise Decline(f"time gap of dtype {gdt} (int32/int64/fp32/fp64 only)")
    tc.stamps = _stamps(tc, tc.gap, srcs[0], plan)
    tc.order_i, _ = closure([tc.index], {tc.stamps})
    nb = int(sym_expr(meta_val(tc.ts).shape[0])) - 1
    fn = _chain_fn(chain, tc.gap)
    tc.bounds = time_bucket_bounds(nb, gdt, fn)
    check_bounds(fn, tc.bounds, nb, gdt)


def _name(n):
    return getattr(n.target, "__name__", str(n.target))


def _uses(n, x) -> int:
    """How many times ``n``'s arguments name ``x``."""
    count = 0

    def visit(a):
        nonlocal count
        count += a is x
        return a
    torch.fx.node.map_arg((n.args, n.kwargs), visit)
    return count


def _stamps(tc, G, src, plan):
    """The timestamps the gap is computed from: jagged ``[L]`` (the latest node of ``src``'s rows from
    which the gap reads nothing but the offsets and sizes; the graph pads them), else padded ``[B, N]``
    (the latest such node; the original HSTU's ``all_timestamps``, whose padding the bias reads)."""
    sv = meta_val(src)
    if sv.dim() == 1:
        rows = sym_expr(sv.shape[0])
        fits = lambda v: v.dim() == 1 and lay.eq(sym_expr(v.shape[0]), rows)  # noqa: E731
    elif sv.dim() == 2:
        tc.dense = True
        fits = lambda v: v.dim() == 2 and lay.eq(sym_expr(v.shape[0]), plan.B) \
            and lay.eq(sym_expr(v.shape[1]), plan.N)  # noqa: E731
    else:
        raise Decline(f"timestamps {src.name} of {sv.dim()} dims (jagged [L] or padded [B, N])")
    order, _ = closure([G], set())
    for n in reversed([*order, src] if src not in order else order):
        val = meta_val(n)
        if not (isinstance(val, torch.Tensor) and fits(val)):
            continue
        _, leaves = closure([G], {n})
        if not _tensor_leaves(leaves, {n, plan.offsets}):
            if val.dtype not in _TS_DTYPES:
                raise Decline(f"timestamps {n.name} of dtype {val.dtype}")
            return n
    raise Decline("timestamps are neither a jagged [L] tensor padded in the graph nor a [B, N] tensor")


def gap_decline(tc) -> Decline:
    """The reason a time table is not the op's: read elsewhere than at the gap of ``(next(i), j)`` or ``(i, j)``."""
    return Decline(f"time table {tc.ts.name} is not read at bucket(ts(next(i)) - ts(j)) or "
                   f"bucket(ts(i) - ts(j)) of the "
                   f"{'padded' if tc.dense else '0-padded'} timestamps")


def _chain_fn(chain, G):
    """The bucket as a function of a 1-D CPU gap tensor: the chain's value ops on it, position ops
    skipped, constants evaluated on CPU (run outside the fake mode: ``attn_prove.numeric_proof``)."""
    gm = G.graph.owning_module
    consts = {}
    for n in chain:
        for a in n.all_input_nodes:
            if a is G or a in chain or a in consts:
                continue
            order, leaves = closure([a], set())
            env = {}
            for x in leaves:
                v = meta_val(x)
                if isinstance(v, (torch.SymInt, int)):
                    env[x] = _real_int(x)
                elif x.op == "get_attr":
                    env[x] = attribute(gm, x.target).detach().cpu()
                elif constants.value(x) is not None:  # module state (a boundary buffer): guarded by value
                    constants.record(x)
                    env[x] = constants.value(x).detach().cpu()
                else:
                    raise Decline(f"time bucket reads input {x.name}")
            consts[a] = evaluate(gm, order, env, native=True)[a]
            if n.target in _SORTED:
                b = consts[a]
                if b.dim() != 1 or bool((b[1:] < b[:-1]).any()):
                    raise Decline(f"time bucket: {_name(n)} against boundaries that are not sorted")
            elif isinstance(consts[a], torch.Tensor):
                consts[a] = consts[a].reshape(())

    def fn(dt):
        env = {G: dt, **consts}
        prev = dt
        for n in chain:
            if n.target in _POSITION:
                env[n] = prev
            else:
                load = lambda a: env[a] if isinstance(a, torch.fx.Node) else (  # noqa: E731
                    torch.device("cpu") if isinstance(a, torch.device) else a)
                args = torch.utils._pytree.tree_map(load, list(n.args))
                kwargs = {k: load(v) for k, v in n.kwargs.items()}
                env[n] = n.target(*args, **kwargs)
            prev = env[n]
        return prev
    return fn


def _real_int(x) -> int:
    """A size the bucket reads, as the constant it is. A symbolic size: Decline."""
    e = sym_expr(meta_val(x))
    if e.is_Integer:
        return int(e)
    raise Decline(f"time bucket reads the symbolic size {x.name}")


def _top(dtype):
    return torch.finfo(dtype).max if dtype.is_floating_point else torch.iinfo(dtype).max


def check_bounds(fn, bounds, nb, dtype) -> None:
    """``fn`` (monotone in |dt| by construction) equals ``buckets_from_bounds(., bounds)``: at every
    threshold and its predecessor (that is equality everywhere, for a monotone step function), at 0,
    at the largest gap, and on log-spread samples of both signs; values in ``[0, nb]``."""
    g = torch.Generator().manual_seed(17)
    top = _top(dtype)
    if dtype.is_floating_point:
        b = bounds.to(dtype)
        finite = torch.isfinite(b) & (b <= top)
        pred = torch.nextafter(b[finite], torch.zeros_like(b[finite])).clamp(min=0)
        sample = torch.exp(torch.rand(4000, generator=g, dtype=torch.float64) * math.log(min(top, 1e30))).to(dtype)
        xs = torch.cat([b[finite], pred, sample, torch.tensor([0.0, 0.5, 1.0, top], dtype=dtype)])
    else:
        b = bounds[bounds <= top].to(dtype)
        pred = (b - 1).clamp(min=0)
        sample = torch.exp(torch.rand(4000, generator=g, dtype=torch.float64) * math.log(float(top)))
        xs = torch.cat([b, pred, sample.clamp(max=float(top) / 2).to(dtype), torch.arange(0, 4097, dtype=dtype),
                        torch.tensor([top], dtype=dtype)])
    xs = torch.cat([xs, -xs[xs > 0]])
    with torch.no_grad():
        got = fn(xs.clone())
    if got.shape != xs.shape:
        raise Decline("time bucket does not map each gap to one bucket")
    got = got.to(torch.int64)
    if bool((got < 0).any()) or bool((got > nb).any()):
        raise Decline(f"time bucket leaves [0, {nb}] (the table's rows)")
    ref = buckets_from_bounds(xs, bounds)
    if not torch.equal(got, ref):
        bad = int(torch.nonzero(got != ref)[0])
        raise Decline(f"time bucket is not a monotone step function of |dt| (at dt={xs[bad].item()!r}: "
                      f"{int(got[bad])}, thresholds say {int(ref[bad])})")


# ---------------------------------------------------------------------------------------------
# Probes


def probe_timestamps(n, dtype, gen):
    """``[n]`` timestamps whose gaps spread over many buckets: 0, small and up to 1e8 (int32: 1e6),
    of both signs (some sequences out of order), fractional for float dtypes."""
    big = 1e6 if dtype == torch.int32 else 1e8
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    gaps = torch.exp(u * math.log(big))
    gaps = torch.where(torch.rand(n, generator=gen) < 0.15, torch.zeros_like(gaps), gaps)
    gaps = torch.where(torch.rand(n, generator=gen) < 0.25, -gaps, gaps)
    if not dtype.is_floating_point:
        gaps = gaps.floor()
    start = float(torch.randint(0, int(big), (), generator=gen))
    return (start + torch.cumsum(gaps, 0)).to(dtype)


def probe(checks, gm, plan, env0, binding, off, lens, Np, crd, shape, in_seq, gen) -> None:
    """One probe of every term still on its way to path (b); a term that fails keeps its reason."""
    for tc in checks:
        if tc.reason is None:
            try:
                _probe_term(tc, gm, plan, env0, binding, off, Np, crd, shape, in_seq, gen)
            except Decline as e:
                tc.reason = str(e)


def _probe_term(tc, gm, plan, env0, binding, off, Np, crd, shape, in_seq, gen):
    t = tc.term
    env = dict(env0)
    Lp = int(off[-1])
    if tc.stamps is not None:
        if tc.dense:  # [B, N], padding included: random like the rest (the bias may read it)
            Bp = off.shape[0] - 1
            binding = solve_binding([(meta_val(tc.stamps).shape[0], Bp), (meta_val(tc.stamps).shape[1], Np)], binding)
            raw = probe_timestamps(Bp * Np, meta_val(tc.stamps).dtype, gen).reshape(Bp, Np)
        else:
            binding = solve_binding([(meta_val(tc.stamps).shape[0], Lp)], binding)
            raw = probe_timestamps(Lp, meta_val(tc.stamps).dtype, gen)
        env[tc.stamps] = raw.to(torch.float64) if raw.is_floating_point() else raw
    tabs = [T for T in (tc.pos, tc.ts) if T is not None]
    pairs = []
    if tc.pos is not None:  # a table size of its own symbol: probed at two values (the window must not move)
        V = sym_expr(meta_val(tc.pos).shape[0])
        if V.free_symbols and not lay.eq(V, 2 * lay.to_expr(plan.N) - 1):
            taken = set().union(*(sym_expr(s).free_symbols for s in (
                meta_val(plan.q.src).shape[0], meta_val(plan.offsets).shape[0], lay.to_expr(plan.N),
                *(meta_val(tc.stamps).shape if tc.stamps is not None else ()))))
            if V.free_symbols & taken:
                raise Decline(f"position table {tc.pos.name}'s size shares a symbol with the jagged sizes or N")
            pairs.append((V, 2 * Np - 1 + 3 * (tc.probes % 2)))
    tc.probes += 1
    binding = solve_binding(pairs, binding) if pairs else binding
    tshape = {T: [concrete(s, binding) for s in meta_val(T).shape] for T in tabs}
    for x in tc.sizes:  # size reads of the timestamps / tables: their own symbols, bound just above
        try:
            env[x] = concrete(meta_val(x), binding)
        except Decline:
            pass
    if tc.stamps is not None:
        env[tc.index] = evaluate(gm, tc.order_i, {**env, tc.stamps: raw}, native=True)[tc.index]
    lc = lay.concretize(t.layout, binding)

    def at(values):
        e = dict(env)
        for T in tabs:
            e[T] = values.get(T, torch.zeros(tshape[T], dtype=torch.float64))
        out = evaluate(gm, tc.order_r, e)[t.node]
        return lay.gather(out.to(torch.float64), lc, crd).expand(shape)

    def unique(T):
        return torch.arange(1, math.prod(tshape[T]) + 1, dtype=torch.float64).reshape(tshape[T])

    r0 = at({})
    if bool((r0[in_seq] != 0).any()):
        raise Decline(f"bias term {t.node.name} is not zero with zero tables (a part besides the table gathers)")
    bb, ii, jj = (crd[a].expand(shape) for a in ("b", "i", "j"))
    sel = in_seq.expand(shape)
    heads = lay.head_count(plan.head_modes)
    idx, flat = {}, {}
    for T in tabs:
        d = at({T: unique(T)})[sel]
        k = d.round()
        if not torch.equal(k, d) or bool((k < 1).any()) or bool((k > math.prod(tshape[T])).any()):
            raise Decline(f"bias term {t.node.name} does not read {T.name} by one gather (index probe)")
        flat[T] = k.to(torch.int64) - 1
        cols = tshape[T][1] if len(tshape[T]) == 2 else 1
        if cols > 1:  # a column per head: head h must read column h
            if cols != heads:
                raise Decline(f"table {T.name} has {cols} columns for {heads} heads")
            hh = torch.as_tensor(lay.head_index(plan.head_modes, crd)).expand(shape)[sel]
            if not torch.equal(flat[T] % cols, hh):
                raise Decline(f"bias term {t.node.name} reads a column of {T.name} other than its head's")
        tc.heads[T] = cols > 1
        idx[T] = flat[T] // cols
    if tc.pos is not None:
        rel = idx[tc.pos] - (jj[sel] - ii[sel])
        c = int(rel[0]) if rel.numel() else Np - 1
        if not bool((rel == c).all()):
            raise Decline(f"position table {tc.pos.name} is not read at c + j - i")
        delta = c - (Np - 1)
        if delta < 0 or delta + 2 * Np - 1 > tshape[tc.pos][0]:
            raise Decline(f"position table {tc.pos.name} read at N - 1 + {delta} + j - i: no window of 2N - 1 rows")
        tc.deltas.add(delta)
        if len(tc.deltas) > 1:
            raise Decline(f"position table {tc.pos.name} read at an offset that changes with N or its size")
    if tc.ts is not None:
        # the op's timestamps as [B, N]: a padded input as it is, jagged ones padded with 0
        tsp = raw.to(meta_val(tc.gap).dtype)
        tsp = tsp if tc.dense else jagged_to_padded(tsp, off, Np)
        for nxt_mode in (True, False) if tc.ts_next is None else (tc.ts_next,):
            rows = (torch.arange(Np) + 1).clamp(max=Np - 1) if nxt_mode else torch.arange(Np)
            ref = buckets_from_bounds(tsp[:, rows][:, :, None] - tsp[:, None, :], tc.bounds)
            if torch.equal(idx[tc.ts], ref[bb[sel], ii[sel], jj[sel]]):
                tc.ts_next = nxt_mode
                break
        else:
            raise gap_decline(tc)
    rnd = {T: probe_values(tshape[T], gen) for T in tabs}
    want = sum(rnd[T].reshape(-1)[flat[T]] for T in tabs)
    if not close(at(rnd)[sel], want):
        raise Decline(f"bias term {t.node.name} is not the sum of its table gathers (random tables)")


def finish(checks, plan) -> None:
    """After every probe: the proven terms form the op's table bias (one position and one time
    table at most); the rest stay dense rab terms."""
    if plan.rab is None:
        return
    plan.rab.table_reasons = [f"{tc.term.node.name}: {tc.reason}" for tc in checks if tc.reason]
    pos = ts = None
    moved = []
    for tc in checks:
        if tc.reason is not None:
            continue
        if (tc.pos is not None and pos is not None) or (tc.ts is not None and ts is not None) or \
                (tc.ts is not None and pos is not None and tc.ts is pos[0]) or \
                (tc.pos is not None and ts is not None and tc.pos is ts[0]):
            plan.rab.table_reasons.append(f"{tc.term.node.name}: a second table of the same kind stays dense")
            continue
        f = tc.term.sign  # the coefficient b is applied at emission
        if tc.pos is not None:
            pos = (tc.pos, next(iter(tc.deltas)), f)
        if tc.ts is not None:
            ts = (tc.ts, f, tc)
        moved.append(tc.term)
    if not moved:
        return
    if not op_has_tables():
        plan.rab.table_reasons.append("the op takes no ts_bounds: every term stays dense")
        return
    tabs = Tables(moved, pos=pos)
    tabs.per_head = frozenset(T for tc in checks if tc.reason is None and tc.term in moved
                              for T, per in tc.heads.items() if per)
    if ts is not None:
        tc = ts[2]
        tabs.ts = ts[:2]
        tabs.stamps, tabs.ts_dtype, tabs.bounds = tc.stamps, meta_val(tc.gap).dtype, tc.bounds
        tabs.ts_next = tc.ts_next is not False
    plan.rab.tables = tabs


# ---------------------------------------------------------------------------------------------
# Emit


def emit_tables(call, gm, plan, N_arg, rows=None, has_intervals=False) -> list:
    """``[timestamps, pos_w, ts_w, ts_bounds]`` for the op (all None without a table bias), then ``False`` for a
    gap ``ts(i) - ts(j)`` (the op's ``ts_next``; left out for the original's ``ts(next(i)) - ts(j)``). When the
    time buckets' ``[B, N, N]`` map fits ``config.bucket_map_mb``, ``timestamps`` is ``hstu::time_bucket_map``'s
    map instead (``ts_bounds`` None): the op's autograd then saves the map, and the backward reads it rather than
    computing it again. ``rows``: the op's L (a node or int); ``has_intervals``: the call replaces the mask."""
    tabs = getattr(plan.rab, "tables", None) if plan.rab is not None else None
    if tabs is None:
        return [None] * 4
    coeff = plan.rab.coeff
    pos_w = ts_w = stamps = bounds = None
    if tabs.pos is not None:
        T, delta, f = tabs.pos
        x = _flat(call, T, T in tabs.per_head)
        V = sym_expr(meta_val(T).shape[0])
        if not (delta == 0 and lay.eq(V, 2 * lay.to_expr(plan.N) - 1)):
            stop = 2 * N_arg - 1 + delta if isinstance(N_arg, int) else \
                call(operator.add, [call(operator.mul, [N_arg, 2]), delta - 1])
            x = call(aten.slice.Tensor, [x, -1, delta, stop])
        pos_w = _times(call, x, f * coeff)
    if tabs.ts is not None:
        T, f = tabs.ts
        ts_w = _times(call, _flat(call, T, T in tabs.per_head), f * coeff)
        stamps = tabs.stamps
        if meta_val(stamps).dtype != tabs.ts_dtype:
            stamps = call(aten._to_copy.default, [stamps], {"dtype": tabs.ts_dtype})
        # get_attr + lift_fresh_copy: how a graph holds a tensor constant (fake modes lift it, so a
        # re-trace of the graph under one takes it too)
        bounds = call(aten.lift_fresh_copy.default,
                      [_constant(gm, tabs.bounds, meta_val(stamps).device, meta_val(stamps))])
        nb = int(meta_val(T).shape[0]) - 1
        B = meta_val(plan.offsets_arg).shape[0] - 1
        n = meta_val(N_arg) if isinstance(N_arg, torch.fx.Node) else N_arg
        if rows is not None and map_fits(nb, B, n, config.get("bucket_map_mb")):
            lower = plan.params.keys_up_to_query(has_intervals)
            bmap = call(torch.ops.hstu.time_bucket_map.default,
                        [stamps, plan.offsets_arg, rows, N_arg, nb, bounds, tabs.ts_next, lower])
            return [bmap, pos_w, ts_w, None]
    return [stamps, pos_w, ts_w, bounds] + ([False] if tabs.ts is not None and not tabs.ts_next else [])


def _flat(call, T, per_head=False):
    """The op's table: ``[V]``, or ``[H, V]`` for a table with a column per head."""
    if per_head:
        return call(aten.t.default, [T])
    return T if meta_val(T).dim() == 1 else call(aten.reshape.default, [T, [-1]])


def _times(call, x, f):
    return x if f == 1.0 else call(aten.mul.Tensor, [x, f])


def _constant(gm, value, device, like):
    """A constant tensor in the graph: a buffer of ``gm`` read by ``get_attr`` (lifted by AOTAutograd
    like the module's own buffers; exported with the rewritten program)."""
    with _compat.no_fake_mode():
        real = value.to(device)
    k = 0
    while hasattr(gm, f"_hstu_ts_bounds_{k}"):
        k += 1
    name = f"_hstu_ts_bounds_{k}"
    gm.register_buffer(name, real)
    node = gm.graph.get_attr(name)
    fake_mode = getattr(like, "fake_mode", None)
    node.meta["val"] = fake_mode.from_tensor(real, static_shapes=True) if fake_mode is not None else real
    return node


def describe(plan) -> str:
    tabs = getattr(plan.rab, "tables", None) if plan.rab is not None else None
    if tabs is None:
        return ""
    parts = []
    if tabs.pos is not None:
        T, delta, _ = tabs.pos
        parts.append(f"pos_w={T.name}" + (f"[{delta}:{delta}+2N-1]" if delta else "")
                     + (" per head" if T in tabs.per_head else ""))
    if tabs.ts is not None:
        parts.append(f"ts_w={tabs.ts[0].name}" + (" per head" if tabs.ts[0] in tabs.per_head else "")
                     + f" (timestamps {tabs.stamps.name}, {len(tabs.bounds)} bucket "
                     f"thresholds on {str(tabs.ts_dtype).replace('torch.', '')} gaps"
                     + ("" if tabs.ts_next else " ts(i) - ts(j)") + ")")
    return "tables: " + ", ".join(parts)
