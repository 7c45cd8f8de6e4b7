"""preprocess: LayerNorm(x) -> projection -> u, v, q, k -> silu(u)  =>  hstu.stu_preprocess.

By meaning: normalised rows times a weight, cut in any way into the four consecutive column blocks
u, v, q, k of the projection output (``columns.py`` reads which columns each view holds), with silu(u)
applied anywhere before u is used (on u, on a view of u, or on a block holding u and more).

The proof: the norm and projection stages are read exactly (``stages.py``) and probed numerically
against the op; the pieces are proven by their layout (the op's ``uvqk`` output has the projection's
layout, so each piece becomes the same columns of it); silu commutes with views, so ``silu`` of a view
of u is the same view of the op's ``act``.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
from torch.fx import Graph, GraphModule, Node

from ... import config
from ...report import RewriteReport
from ..registry import register
from .columns import View, _act_spelling, alias_writes, spelling_of, view_tree
from .common import (Decline, _call, _check_no_mutation, _closure, _fake_call, _getitem, _is, _name,
                     _probe, _quiet, _replace_by_view, _rewrite_each, _shape_is, _static, _tval)
from .stages import _match_norm, _match_projection

aten = torch.ops.aten
_ROLES = "uvqk"


@dataclasses.dataclass
class Piece:
    view: View    # the top-most view lying inside one part (the user's u, v, q or k, however cut)
    part: int     # 0..3: u, v, q, k
    silu: bool    # its values are silu(P) (a view of a silu over a block spanning several pieces)


@dataclasses.dataclass
class SplitMatch:
    hv: int
    hq: int
    pieces: list      # Pieces
    spanning: list    # users reading across parts (would keep the projection alive)
    spelling: str


def _assign(top: View, parts: list) -> tuple:
    """Pieces (the top-most views inside one part, on every path from P) and the users reading views
    that span several parts."""
    pieces, spanning = [], []

    def part_of(cols):
        if cols is None:
            return None
        return next((i for i, (a, b) in enumerate(parts) if a <= cols[0] and cols[1] <= b), None)

    def walk(v: View):
        part = part_of(v.cols) if v is not top else None
        if part is not None:
            pieces.append(Piece(v, part, v.silu))
            return
        spanning.extend(v.reads)
        for act, sub in v.acts:
            if sub is not None:
                walk(sub)
            else:
                spanning.append(act)
        for c in v.children:
            walk(c)

    walk(top)
    return pieces, spanning


def _natural_blocks(top: View) -> list:
    """The column ranges of the first proper blocks on each path from P (the user's first cut)."""
    D = top.cols[1]
    out = []

    def walk(v: View):
        if v is not top and v.cols is not None and v.cols != (0, D):
            out.append(v.cols)
            return
        for c in v.children:
            walk(c)
        for _, sub in v.acts:
            if sub is not None:
                walk(sub)

    walk(top)
    return sorted(set(out))


def _find_split(top: View, where: str):
    """The four pieces u, v, q, k (``SplitMatch``), or a string saying why there are none. Raises Decline
    when P is cut into four consecutive blocks of the wrong sizes."""
    D = top.cols[1]
    witnessed = {v.cols for v in top.descendants() if v.cols is not None and v.cols != (0, D)}
    found = None
    for hv in sorted({b for a, b in witnessed if a == 0}):
        if D - 2 * hv <= 0 or (D - 2 * hv) % 2:
            continue
        hq = (D - 2 * hv) // 2
        parts = [(0, hv), (hv, 2 * hv), (2 * hv, 2 * hv + hq), (2 * hv + hq, D)]
        if not all(p in witnessed for p in parts):
            continue
        pieces, spanning = _assign(top, parts)
        if found is None or (found.spanning and not spanning):
            u = next(p for p in pieces if p.part == 0) if any(p.part == 0 for p in pieces) else pieces[0]
            found = SplitMatch(hv, hq, pieces, spanning, spelling_of(u.view.path()))
        if not spanning:
            break
    if found is not None:
        return found
    blocks = _natural_blocks(top)
    if len(blocks) == 4 and blocks[0][0] == 0 and blocks[-1][1] == D and \
            all(a[1] == b[0] for a, b in zip(blocks, blocks[1:])):
        sizes = [b - a for a, b in blocks]
        raise Decline(f"{where}: split sizes {sizes} are not [hv, hv, hq, hq]")
    if not blocks:
        return "no view of it holds a block of consecutive columns (pieces interleaving columns are not u, v, q, k)"
    return (f"its views hold the column blocks {blocks[:6]}, not four consecutive blocks u, v, q, k of sizes "
            "[hv, hv, hq, hq]")


def _reads(piece: Piece) -> tuple:
    """``(raw, silu)``: users reading the piece's values as they are, and silu spellings over it as
    ``(act node, view)`` (for a piece of silu values, every read is a silu read)."""
    raw, silu = [], []
    for v in piece.view.descendants(into_acts=False):
        if piece.silu:
            silu += [(r, None) for r in v.reads]
        else:
            raw += v.reads
            silu += [(act, v) for act, _ in v.acts]
    return raw, silu


def _silu_root(view: View) -> Node:
    """The silu over a larger block that ``view`` (holding silu values) is a view of."""
    return next(v for v in view.path() if v.silu).node


def _role_of(view: View, pieces: list) -> str:
    """What a write into ``view`` modifies, for the report."""
    role = next((_ROLES[p.part] for p in pieces if any(d is view for d in p.view.descendants())),
                "the projection output")
    return f"silu({role})" if view.silu else role


# ---------------------------------------------------------------------------------------------
# the rewriter
# ---------------------------------------------------------------------------------------------
def _rewrite_preprocess_at(gm: GraphModule, P: Node, report: RewriteReport, seen: set, why: dict) -> bool:
    """Try ``P`` as the projection output that is cut into u, v, q, k. Returns True when rewritten;
    ``seen`` collects the projections examined, ``why`` says why others are not candidates."""
    graph = gm.graph
    if not _is(P, aten.addmm.default, aten.mm.default, aten.add.Tensor):
        return False
    top = view_tree(P)
    if top is None or not top.children and not top.acts:
        return False
    try:
        proj, proj_err = _match_projection(P), None
    except Decline as e:
        proj, proj_err = None, e
    if proj is None and proj_err is None:
        return False
    where = _name(next(iter(P.users)))  # the user's first cut (users are kept in the order they were made)
    split = _find_split(top, where)
    if isinstance(split, str):
        why[P] = split
        return False
    seen.add(P)
    if proj_err is not None:
        raise proj_err
    if split.spanning:
        names = ", ".join(_name(n) for n in split.spanning[:3])
        raise Decline(f"{where}: projection output has other users ({names})")
    norm = _match_norm(proj.inp) if isinstance(proj.inp, Node) else None
    if norm is None:
        raise Decline(f"{where}: projection input {_name(proj.inp)} is not a LayerNorm of x")
    if norm.groups:
        raise Decline(f"{where}: input normalisation is a group norm, not a LayerNorm")
    xv, wv = _tval(norm.src), _tval(proj.weight)
    E = _static(xv.shape[1])
    hv, hq = split.hv, split.hq
    D = 2 * (hv + hq)
    w_shape = (D, E) if proj.linear_layout else (E, D)
    if E is None or not _shape_is(wv, *w_shape):
        raise Decline(f"{where}: projection weight {tuple(wv.shape)} is not {w_shape}")
    if xv.dtype != wv.dtype:
        raise Decline(f"{where}: x is {xv.dtype} but the projection weight is {wv.dtype}")

    # activations: u is read only through silu; silu_all when v, q, k are too
    raw_n, silu_n = [0] * 4, [0] * 4
    for p in split.pieces:
        raw, silu = _reads(p)
        raw_n[p.part] += len(raw) + sum(len(v.writes) for v in p.view.descendants(into_acts=False))
        silu_n[p.part] += len(silu)
    silu_only = [raw_n[i] == 0 and silu_n[i] > 0 for i in range(4)]
    if not silu_only[0]:
        other = [i for i in range(1, 4) if silu_only[i]]
        if other:
            raise Decline(f"{where}: silu is applied to chunk {other[0]} ({_ROLES[other[0]]}), "
                          "not (only) to chunk 0 (u)")
        raise Decline(f"{where}: u (chunk 0) is not consumed only by silu(u)")
    silu_all = all(silu_only)

    # no write into the projection output or a view of it, nor into the silu results the op returns
    for v in top.descendants():
        for w in v.writes:
            raise Decline(f"{where}: {_role_of(v, split.pieces)} is modified in place by {_name(w)}")
    acts = {}  # silu nodes the op's act replaces: act -> (piece, view the silu reads)
    for p in split.pieces:
        if not p.silu and (p.part == 0 or silu_all):
            for act, v in _reads(p)[1]:
                acts.setdefault(act, (p, v))
    for act in acts:
        for w in alias_writes(act):
            raise Decline(f"{where}: silu({_ROLES[acts[act][0].part]}) is modified in place by {_name(w)}")
    reads = [norm.src, norm.weight, norm.bias, proj.weight, proj.bias]
    _check_no_mutation(graph, norm.first, P, where, reads + _closure([P], reads))

    # numeric probe: LayerNorm and projection against the op's uvqk (the pieces are proven by layout)
    w_lin_fn = (lambda w: w) if proj.linear_layout else (lambda w: w.t())

    def op_fn(x, lw, lb, w, b):
        return [torch.ops.hstu.stu_preprocess(x, lw, lb, norm.eps, w_lin_fn(w), b, hv, hq, silu_all)[1]]

    reason = _probe(reads, {norm.src}, [P], op_fn, xv.shape[0])
    if reason is not None:
        raise Decline(f"{where}: numeric probe: {reason}")

    target = torch.ops.hstu.stu_preprocess_save.default if config.block_backward == "save" \
        else torch.ops.hstu.stu_preprocess.default
    emit = _Emit(graph, P, split, silu_all)
    emit.check(target, norm, proj, acts)
    with graph.inserting_before(P):
        w = proj.weight if proj.linear_layout else _call(graph, aten.t.default, [proj.weight])
        op = _call(graph, target, [norm.src, norm.weight, norm.bias, norm.eps, w, proj.bias, hv, hq, silu_all])
        emit.act, emit.uvqk = _getitem(graph, op, 0), _getitem(graph, op, 1)
    emit.replace(acts)

    act_names = sorted({_act_spelling(a) for a in acts}
                       | {_act_spelling(_silu_root(p.view)) + " before split" for p in split.pieces if p.silu})
    spelling = (f"{norm.spelling} -> {proj.spelling} -> {split.spelling} -> "
                f"{'/'.join(act_names)}({'all' if silu_all else 'u'})")
    report.counts["preprocess"] += 1
    report.details.append(("preprocess", spelling))
    return True


class _Emit:
    """The pieces as views of the op's outputs: ``uvqk`` has P's layout, so a piece holding columns
    ``[a, b)`` becomes ``uvqk[:, a:b]`` viewed to the piece's shape; ``act`` holds silu of columns
    ``[0, hv)`` (``[0, D)`` with ``silu_all``), so silu over a view of u becomes the same view of it."""

    def __init__(self, graph: Graph, P: Node, split: SplitMatch, silu_all: bool):
        self.graph, self.P, self.split, self.silu_all = graph, P, split, silu_all
        self.act = self.uvqk = None
        self._blocks: dict = {}

    def _shape(self, view: View) -> list:
        """The piece's dims after the rows (static: they count columns)."""
        return [_static(s) for s in _tval(view.node).shape[1:]]

    def block(self, src: Node, view: View) -> Node:
        """A view of ``src`` (``act`` or ``uvqk``, inserted before P) holding ``view``'s columns in its shape."""
        a, b = view.cols
        rest = self._shape(view)
        key = (src, a, b, tuple(rest))
        if key not in self._blocks:
            width = _tval(src).shape[1]
            with self.graph.inserting_before(self.P):
                n = src if (a, b) == (0, width) else _call(self.graph, aten.slice.Tensor, [src, 1, a, b])
                if rest != [b - a]:
                    n = _call(self.graph, aten.view.default, [n, [-1, *rest]])
            self._blocks[key] = n
        return self._blocks[key]

    def _chain(self, piece: Piece, view: View) -> list:
        path = view.path()
        return path[path.index(piece.view) + 1:]

    def check(self, target, norm, proj, acts) -> None:
        """Dry run on fake values: every replacement can be built (views of the op's outputs replay the
        user's view chains). Raises Decline before the graph is touched otherwise."""
        try:
            w = proj.weight if proj.linear_layout else _fake_call(aten.t.default, [proj.weight])
            act, uvqk = _fake_call(target, [norm.src, norm.weight, norm.bias, norm.eps, w, proj.bias,
                                            self.split.hv, self.split.hq, self.silu_all])[:2]
            for p in self.split.pieces:
                if any(s is None for s in self._shape(p.view)):
                    raise ValueError(f"symbolic piece shape {tuple(_tval(p.view.node).shape)}")
            for act_node, (piece, view) in acts.items():
                a, b = piece.view.cols
                cur = _fake_call(aten.slice.Tensor, [act, 1, a, b])
                cur = _fake_call(aten.view.default, [cur, [-1, *self._shape(piece.view)]])
                for v in self._chain(piece, view):
                    n = v.node
                    if n.target is operator.getitem:
                        cur = cur[n.args[1]]
                    else:
                        cur = _fake_call(n.target, [cur if x is n.args[0] else x for x in n.args], n.kwargs)
                if tuple(cur.shape) != tuple(_tval(view.node).shape):
                    raise ValueError("shape changed")
        except Decline:
            raise
        except Exception as e:
            raise Decline(f"{_name(self.P)}: the pieces cannot be rebuilt as views of the op's outputs: "
                          f"{type(e).__name__}: {e}")

    def _act_for(self, part: int):
        """The op output holding silu of this part's columns: ``act`` for u (for all four with silu_all)."""
        return self.act if part == 0 or self.silu_all else None

    def replace(self, acts: dict) -> None:
        graph = self.graph
        for p in self.split.pieces:
            act = self._act_for(p.part)
            if p.silu:  # silu(P[:, a:b]), a view of a silu over a larger block
                if act is not None:
                    new = self.block(act, p.view)
                else:  # silu of v, q or k without silu_all: silu of the same columns of uvqk
                    with graph.inserting_before(self.P):
                        new = _call(graph, aten.silu.default, [self.block(self.uvqk, p.view)])
                _replace_by_view(graph, p.view.node, new)
            elif act is None:  # v, q, k read as they are (a silu over them stays the user's)
                _replace_by_view(graph, p.view.node, self.block(self.uvqk, p.view))
            # u (all four with silu_all): read only through silu spellings, each replaced below
        for act_node, (piece, view) in acts.items():  # silu over a view of a piece: that view of act
            cur = self.block(self.act, piece.view)
            with graph.inserting_before(act_node):
                for v in self._chain(piece, view):
                    n = v.node
                    if n.target is operator.getitem:
                        cur = _getitem(graph, cur, n.args[1])
                    else:
                        prev = cur
                        cur = graph.node_copy(n, lambda x, n=n, prev=prev: prev if x is n.args[0] else x)
                        cur.meta["val"] = _fake_call(cur.target, cur.args, cur.kwargs)
            _replace_by_view(graph, act_node, cur)


def _preprocess_candidates(graph: Graph) -> list:
    """Projection outputs (GEMM results) that something views."""
    return [n for n in graph.nodes if _is(n, aten.addmm.default, aten.mm.default, aten.add.Tensor) and n.users]


@register("preprocess")
def rewrite_preprocess(gm: GraphModule, report: RewriteReport) -> None:
    """LayerNorm -> projection -> u, v, q, k (column blocks) -> silu(u)  =>  hstu.stu_preprocess."""
    gm.graph.eliminate_dead_code()
    seen: set = set()
    why: dict = {}
    _rewrite_each(gm, report, "preprocess", _preprocess_candidates(gm.graph),
                  lambda g, n, r: _rewrite_preprocess_at(g, n, r, seen, why), lambda n: bool(n.users))
    _report_unsplit_projections(gm, report, seen, why)


def _report_unsplit_projections(gm: GraphModule, report: RewriteReport, seen: set, why: dict) -> None:
    """``explain`` is never silent about a LayerNorm feeding a projection: one that is not a
    preprocess candidate (its output is not cut into u, v, q, k) is reported as a near miss."""
    done = set()
    for n in gm.graph.nodes:
        if n in seen or not n.users:
            continue
        proj = _quiet(_match_projection, n)
        norm = _quiet(_match_norm, proj.inp) if proj is not None and isinstance(proj.inp, Node) else None
        if norm is None or norm.groups or norm.out in done:
            continue
        done.add(norm.out)
        detail = f": {why[n]}" if n in why else ""
        report.near_misses.append(("preprocess", f"{_name(n)}: projection of LayerNorm({norm.src.name}) is not "
                                                 f"split into four chunks u, v, q, k along the last dim{detail}"))


