"""Metamorphic transformation ``split_forms``: split / chunk / slices / narrow / unflatten+unbind
interchanged.

Exact: every spelling is a view of the same values. Bounds must be concrete (or end-relative on a
symbolic size, ``x[1:]``), and a split needs the pieces to tile the dimension.
"""
from __future__ import annotations

import operator
import random

import torch
from torch.fx import GraphModule, Node

from .metamorphic_graph import _apply, _concrete, _erase_dead, _fn, _is_op, _live, _method, _note, _tensor

_SPLIT_FNS = (torch.split, torch.chunk, torch.unbind)


def _dim_size(t: torch.Tensor, dim: int):
    return _concrete(t.shape[dim])


def _norm_dim(dim, ndim):
    return dim + ndim if dim < 0 else dim


def _plain_slice(n: Node):
    """``(x, dim, start, stop)`` for ``x[..., a:b]``-like getitems (one non-trivial step-1 slice,
    the rest full slices / an Ellipsis) and ``narrow``, with concrete bounds; else None."""
    if n.op == "call_function" and n.target in (torch.narrow,) or (n.op == "call_method" and n.target == "narrow"):
        x, dim, start, length = (list(n.args) + [None] * 4)[:4]
        t = _tensor(x)
        start, length = _concrete(start), _concrete(length)
        if t is None or not isinstance(dim, int) or start is None or length is None:
            return None
        dim = _norm_dim(dim, t.dim())
        size = _dim_size(t, dim)
        if start < 0:
            if size is None:
                return None
            start += size
        return (x, dim, start, start + length)
    if not (n.op == "call_function" and n.target is operator.getitem and len(n.args) == 2):
        return None
    x, idx = n.args
    t = _tensor(x)
    if t is None:
        return None
    idx = idx if isinstance(idx, tuple) else (idx,)
    if any(not isinstance(i, (slice, type(Ellipsis))) for i in idx) or sum(i is Ellipsis for i in idx) > 1:
        return None
    if Ellipsis in idx:
        e = idx.index(Ellipsis)
        idx = idx[:e] + (slice(None),) * (t.dim() - len(idx) + 1) + idx[e + 1:]
    if len(idx) > t.dim():
        return None
    real = [(d, s) for d, s in enumerate(idx) if s != slice(None)]
    if len(real) != 1:
        return None
    dim, s = real[0]
    if s.step not in (None, 1) or any(isinstance(b, Node) for b in (s.start, s.stop)):
        return None
    size = _dim_size(t, dim)
    start, stop = s.start or 0, s.stop
    if size is None and start >= 0 and (stop is None or stop < 0):
        return (x, dim, start, ("end", stop or 0))  # a symbolic size: ``x[1:]``, ``x[:-1]`` stay end-relative
    if start < 0 or stop is None or stop < 0:
        if size is None:
            return None
        start = start + size if start < 0 else start
        stop = size if stop is None else (stop + size if stop < 0 else stop)
        start, stop = max(0, min(start, size)), max(0, min(stop, size))
    if size is not None:
        stop = min(stop, size)
    if stop < start:
        return None
    return (x, dim, start, stop)


def _split_segments(n: Node):
    """For a split/chunk/unbind node used only through ``getitem(i)``: ``(x, dim, [(a, b)...],
    {i: getitem node}, form)`` with concrete bounds; else None."""
    if not (_is_op(n, _SPLIT_FNS, ("split", "chunk", "unbind"))):
        return None
    if not n.users or any(not (u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int))
                          for u in n.users):
        return None
    form = n.target if n.op == "call_method" else n.target.__name__
    args = list(n.args)
    x = args[0]
    t = _tensor(x)
    if t is None:
        return None
    if form == "unbind":
        dim = args[1] if len(args) > 1 else n.kwargs.get("dim", 0)
    else:
        dim = args[2] if len(args) > 2 else n.kwargs.get("dim", 0)
    if not isinstance(dim, int):
        return None
    dim = _norm_dim(dim, t.dim())
    size = _dim_size(t, dim)
    if size is None:
        return None
    if form == "unbind":
        return None  # its outputs drop the dimension: not a slice of x (handled as a target form only)
    spec = args[1] if len(args) > 1 else n.kwargs.get("split_size_or_sections", n.kwargs.get("chunks"))
    if form == "chunk":
        if not isinstance(spec, int):
            return None
        step = -(-size // spec)
        sizes = [min(step, size - i) for i in range(0, size, step)] if step else []
    elif isinstance(spec, int):
        sizes = [min(spec, size - i) for i in range(0, size, spec)] if spec else []
    elif isinstance(spec, (list, tuple)) and all(isinstance(s, int) for s in spec):
        sizes = list(spec)
    else:
        return None
    bounds, a = [], 0
    for s in sizes:
        bounds.append((a, a + s))
        a += s
    users = {u.args[1]: u for u in n.users}
    if max(users) >= len(bounds):
        return None
    return (x, dim, bounds, users, form)


def _emit_segments(gm, before: Node, x: Node, dim: int, segs: list, form: str, like: Node) -> list:
    """Nodes computing ``x`` restricted to each ``(a, b)`` of ``segs`` along ``dim``, spelled ``form``:
    ``slice`` / ``narrow`` (one op per segment), ``split`` / ``chunk`` / ``unbind`` (one op for all,
    segments must tile ``[0, size)``; ``chunk`` / ``unbind`` need equal sizes)."""
    t = _tensor(x)
    ndim = t.dim()
    if form == "slice":
        out = []
        for a, b in segs:
            b = (b[1] or None) if isinstance(b, tuple) else b  # end-relative: x[a:], x[a:-k]
            idx = (Ellipsis, slice(a, b)) if dim == ndim - 1 and ndim > 1 else (slice(None),) * dim + (slice(a, b),)
            out.append(_fn(gm, before, operator.getitem, x, idx if len(idx) > 1 else idx[0], like=like))
        return out
    if form == "narrow":
        return [_method(gm, before, "narrow", x, dim, a, _length(gm, before, x, dim, a, b, like), like=like)
                for a, b in segs]
    sizes = [b - a for a, b in segs]
    if form == "split":
        whole = _fn(gm, before, torch.split, x, sizes, dim, like=like)
    elif form == "chunk":
        whole = _method(gm, before, "chunk", x, len(sizes), dim, like=like)
    else:  # unbind: split one dimension into (k, s), take each of the k rows
        k, s = len(sizes), sizes[0]
        whole = _method(gm, before, "unbind", _method(gm, before, "unflatten", x, dim, (k, s), like=like), dim,
                        like=like)
        return [_fn(gm, before, operator.getitem, whole, i, like=like) for i in range(k)]
    return [_fn(gm, before, operator.getitem, whole, i, like=like) for i in range(len(sizes))]


def _length(gm, before, x, dim, a, b, like):
    """``b - a``; for an end-relative ``b`` (a symbolic size) ``x.size(dim) + k - a`` as SymInt nodes."""
    if not isinstance(b, tuple):
        return b - a
    size = _method(gm, before, "size", x, dim, like=like)
    return size if b[1] - a == 0 else _fn(gm, before, operator.add, size, b[1] - a, like=like)


def _tiling(segs: list, size):
    """``segs`` (disjoint) completed with the gaps between them into a tiling of ``[0, size)``:
    ``(tiles, position of each seg in tiles)``; None if they overlap or the size is unknown."""
    if size is None or any(isinstance(b, tuple) for _, b in segs):
        return None
    order = sorted(range(len(segs)), key=lambda i: segs[i])
    tiles, where, a = [], {}, 0
    for i in order:
        s, e = segs[i]
        if s < a:
            return None
        if s > a:
            tiles.append((a, s))
        where[i] = len(tiles)
        tiles.append((s, e))
        a = e
    if a < size:
        tiles.append((a, size))
    return tiles, [where[i] for i in range(len(segs))]


def _respell(gm, x: Node, dim: int, segs: list, olds: list, current: str, rng: random.Random) -> bool:
    """Replace the nodes ``olds`` (each computing ``x[..., a:b]`` for its ``segs`` entry along
    ``dim``) by another spelling than ``current``."""
    size = _dim_size(_tensor(x), dim)
    tiling = _tiling(segs, size)
    forms = ["slice", "narrow"]
    if tiling is not None:
        tiles, _ = tiling
        forms.append("split")
        lens = {b - a for a, b in tiles}
        if len(lens) == 1 and len(tiles) > 1 and next(iter(lens)) > 0:
            forms += ["chunk", "unbind"]
    forms = [f for f in forms if f != current]
    if not forms:
        return False
    form = rng.choice(forms)
    before = min(olds, key=lambda o: list(gm.graph.nodes).index(o))  # all users come after the first
    if form in ("split", "chunk", "unbind"):
        tiles, where = tiling
        outs = _emit_segments(gm, before, x, dim, tiles, form, like=olds[0])
        outs = [outs[w] for w in where]
    else:
        outs = _emit_segments(gm, before, x, dim, segs, form, like=olds[0])
    for old, new in zip(olds, outs):
        old.replace_all_uses_with(new)
    for o in list(outs):
        _erase_dead(gm, o)  # tiles nobody reads are dropped again (split keeps its getitems' base)
    for old in olds:
        _erase_dead(gm, old)
    _note(gm, f"split_forms: {', '.join(o.name for o in olds)} ({current}) -> {form}")
    return True


def _slice_groups(gm: GraphModule) -> list:
    """Sites: each split-like node, and per ``(x, dim)`` the plain slices/narrows of ``x`` (one
    group if pairwise disjoint, else one site per slice)."""
    sites, by_base = [], {}
    for n in gm.graph.nodes:
        seg = _split_segments(n)
        if seg is not None:
            x, dim, bounds, users, form = seg
            idx = sorted(users)
            sites.append((x, dim, [bounds[i] for i in idx], [users[i] for i in idx],
                          "split" if form == "split" else form))
            continue
        sl = _plain_slice(n) if n.op in ("call_function", "call_method") else None
        if sl is not None:
            by_base.setdefault((sl[0], sl[1]), []).append((n, (sl[2], sl[3])))
    for (x, dim), items in by_base.items():
        segs = [s for _, s in items]
        if len(items) > 1 and _tiling(segs, _dim_size(_tensor(x), dim)) is not None:
            groups = [items]
        else:
            groups = [[it] for it in items]
        for g in groups:
            current = "narrow" if all(n.target in ("narrow", torch.narrow) for n, _ in g) else "slice"
            sites.append((x, dim, [s for _, s in g], [n for n, _ in g], current))
    return sites


def split_forms(gm: GraphModule, rng: random.Random) -> int:
    """``torch.split(x, s, dim)`` / ``chunk`` / slices ``x[..., a:b]`` / ``x.unflatten(dim, (k, s))
    .unbind(dim)`` / ``narrow`` interchanged where equivalent (concrete bounds; a split needs the
    segments to tile the dimension, gaps become unused pieces). Exact (views of the same values)."""
    return _apply(gm, rng, _slice_groups(gm), lambda site: _respell(gm, *site, rng),
                  alive=lambda site: all(_live(gm, o) for o in site[3]) and _live(gm, site[0]))
