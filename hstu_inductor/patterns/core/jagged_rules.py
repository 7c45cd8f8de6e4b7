"""Value rules that need the jagged structure: row-to-sequence maps, scatters, jagged pad ops.

Every rule here rests on one property of valid offsets: ``off`` is non-decreasing with
``off(0) = 0`` and ``off(B) = L``, so jagged row ``r = off(b) + p`` (``0 <= p < n_b``) satisfies
``off(x) <= r`` exactly for ``x <= b`` and ``off(x) > r`` exactly for ``x > b``. Hence:

* :func:`count_le`: ``#{k in [0, K): off(k + c) <= r} = clamp(b - c + 1, 0, K)``. That is
  ``searchsorted(offsets, r, right=True)``, ``bucketize(r, offsets[1:], right=True)``,
  ``(r[:, None] >= offsets[None, 1:]).sum(1)`` and the cumsum of one-hot sequence starts;
* ``repeat_interleave(lengths)[r] = b`` and ``cumsum(lengths)[x] = off(x + 1)`` (telescoping);
* :func:`invert`: the writer of a scatter at a target element, by solving the index map's
  equations (``u = t`` for a plain coordinate, ``K*u1 + u2 = t`` with ``0 <= u2 < K`` by mixed radix,
  ``off(b') + p' = off(b) + p`` by the row pairs), checked injective on its domain.

A strict ``off(x) < r`` count (``searchsorted(..., right=False)``) depends on which sequences are
empty: declined (:class:`~.elements.Unsupported`).
"""
from __future__ import annotations

import sympy
import torch

from .decide import collapse, equal
from .domain import off
from .elements import NAMED_RULES, _dtype, _kw, _op, _opname, linear, rule, unravel
from .rules_layout import _align, _broadcast_shape, _index, _slice_bounds
from .values import meta_val
from .rules_values import _cast
from .values import Unsupported, boolean, indicator, num, select

aten = torch.ops.aten


# ---------------------------------------------------------------------------------------------
# counting sequence starts

def _offset_form(E, e, k):
    """``c`` when ``e`` (a function of the fresh coordinate ``k``) is ``off(k + c)``, else None."""
    e = sympy.expand(E.dom.canon(e))
    if isinstance(e, sympy.Function) and e.func == off:
        c = sympy.expand(e.args[0] - k)
        if c.is_Integer:
            return int(c)
    # cat([0], cumsum(lengths)) and friends, or a batch of one, where off(k + 1) is the total length L:
    # equal to off(k + c) for some c? decide it
    cands = {int(sympy.expand(a.args[0] - k)) for a in e.atoms(off) if sympy.expand(a.args[0] - k).is_Integer}
    for c in sorted(cands) or [0, 1]:
        ok, _ = equal(E.dom, e, off(k + c))
        if ok:
            return c
    return None


def count_le(E, seq_at, K, x, what):
    """``#{k in [0, K): seq(k) <= x}`` for ``seq(k) = off(k + c)`` and ``x`` a jagged row."""
    k = E.dom.coord("k", K)
    c = _offset_form(E, seq_at(k), k)
    if c is None:
        raise Unsupported(f"{what}: the sorted sequence is not the offsets (read as {seq_at(k)})")
    row = E.dom.guarded_row(x)
    if row is None and isinstance(x, sympy.Basic) and x.has(sympy.Piecewise):
        row = E.dom.guarded_row(collapse(E.dom, x))
    if row is None:
        raise Unsupported(f"{what}: searched values are not jagged rows ({x})")
    b, _, cond = row
    return _guard(E, cond, _count(E, b, c, K), what)


def _guard(E, cond, value, what):
    """``value`` where ``cond`` holds; outside it the element is not modelled (an opaque value)."""
    return value if cond is sympy.true else select(cond, value, E.dom.opaque(what.split(":")[0].split()[0]))


def _count(E, b, c, K):
    n = b - c + 1
    lo_ok = E.dom.known(sympy.Ge(n, 0))
    hi_ok = E.dom.known(sympy.Le(n, K))
    out = n
    if not hi_ok:
        out = sympy.Min(out, K)
    if not lo_ok:
        out = sympy.Max(out, 0)
    return out


def _sorted_count(E, n, idx, values, boundaries, right, what):
    """``searchsorted`` / ``bucketize`` against the offsets: the number of offsets at or below the row."""
    if len(E.shape(boundaries)) != 1:
        raise Unsupported(f"{what} over a batch of sorted sequences")
    if not right:
        raise Unsupported(f"{what}(right=False) over the offsets depends on which sequences are empty")
    x = E.at(E.src(n, values), idx)
    K = E.shape(boundaries)[0]
    return _cast(count_le(E, lambda k: E.at(E.src(n, boundaries), (k,)), K, x, what), _dtype(n))


@rule(_op("searchsorted", "Tensor"))
def _searchsorted(E, n, idx):
    right = bool(n.kwargs.get("right", n.args[3] if len(n.args) > 3 else False)) or n.kwargs.get("side") == "right"
    return _sorted_count(E, n, idx, n.args[1], n.args[0], right, "searchsorted")


@rule(_op("bucketize", "Tensor"))
def _bucketize(E, n, idx):
    right = bool(n.kwargs.get("right", n.args[3] if len(n.args) > 3 else False))
    return _sorted_count(E, n, idx, n.args[0], n.args[1], right, "bucketize")


@rule(_op("sum", "dim_IntList"))
def _sum(E, n, idx):
    a = n.args[0]
    shape = E.shape(a)
    dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    keep = bool(n.args[2]) if len(n.args) > 2 else bool(n.kwargs.get("keepdim", False))
    if dims is None or len(dims) != 1:
        raise Unsupported("sum over several dims")
    d = dims[0] % len(shape)
    k = E.dom.coord("k", shape[d])
    src = list(idx)
    if keep:
        src[d] = k
    else:
        src.insert(d, k)
    e = E.at(E.src(n, a), tuple(src))
    pred = indicator(e)
    if not isinstance(pred, (sympy.LessThan, sympy.StrictLessThan, sympy.GreaterThan, sympy.StrictGreaterThan)):
        raise Unsupported(f"sum of {e} (only counts of passed sequence starts are modelled)")
    if isinstance(pred, (sympy.LessThan, sympy.StrictLessThan)):
        lo, hi, strict = pred.lhs, pred.rhs, isinstance(pred, sympy.StrictLessThan)
    else:
        lo, hi, strict = pred.rhs, pred.lhs, isinstance(pred, sympy.StrictGreaterThan)
    K = shape[d]
    # lo (<|<=) hi: one side reads the sorted offsets at k, the other is a jagged row
    if lo.has(k) and not hi.has(k) and not strict:  # off(k + c) <= row
        return _cast(count_le(E, lambda kk: lo.xreplace({k: kk}), K, hi, "sum of comparisons"), _dtype(n))
    if hi.has(k) and not lo.has(k) and strict:  # row < off(k + c): the complement of the count
        return _cast(K - count_le(E, lambda kk: hi.xreplace({k: kk}), K, lo, "sum of comparisons"), _dtype(n))
    raise Unsupported(f"sum of {pred}: a count that depends on which sequences are empty")


def _is_one_hot_histogram(E, node):
    """``(index node, dim)`` when ``node`` adds ones into zeros at an index (scatter_add / index_add /
    index_put with accumulate) along its only dim; else None."""
    if node.op != "call_function":
        return None
    t = node.target
    if t in (_op("scatter_add"), _op("scatter_add_"), _op("index_add"), _op("index_add_")):
        base, dim, index, src = node.args[:4]
    elif t in (_op("index_put"), _op("index_put_")) and (len(node.args) > 3 and node.args[3]):
        base, index, src = node.args[0], node.args[1][0], node.args[2]
    else:
        return None
    if len(E.shape(base)) != 1:
        return None
    y = E.dom.coord("y", E.shape(base)[0])
    if sympy.expand(num(E.at(E.src(node, base), (y,)))) != 0:
        return None
    z = E.dom.coord("z", E.shape(src)[0] if E.shape(src) else 1)
    one = E.at(E.src(node, src), (z,) if E.shape(src) else ())
    if sympy.expand(num(one)) != 1:
        return None
    return E.src(node, index)


@rule(_op("cumsum"))
def _cumsum(E, n, idx):
    a, dim = n.args[:2]
    shape = E.shape(a)
    src = E.src(n, a)
    if len(shape) == 1:
        # read as a histogram before any element is: evaluating ones scattered at the offsets as values
        # asks for an inversion that fails
        index = _is_one_hot_histogram(E, src)
        if index is not None:  # ones added at sequence starts: a running count of starts passed
            K = E.shape(index)[0]
            return _cast(count_le(E, lambda k: E.at(index, (k,)), K, idx[0], "cumsum of one-hot starts"),
                         _dtype(n))
    d = dim % len(shape)
    y = E.dom.coord("y", shape[d])
    along = sympy.expand(E.dom.canon(num(E.at(src, tuple(y if k == d else x for k, x in enumerate(idx))))))
    t = _lengths_form(E, along, y) if len(shape) == 1 else None
    if t is not None:
        c1, c0 = t  # e(y) = off(y + c1) - off(y + c0), c1 = c0 + 1
        return _cast(off(idx[0] + c1) - off(c0), _dtype(n))
    # the same modelled value c all along the dim (ones): c * (i + 1). An opaque element is no evidence of
    # that (each read outside a rule's domain is its own unknown)
    if y not in along.free_symbols and not E.dom.has_opaque(along):
        return _cast(along * (idx[d] + 1), _dtype(n))
    raise Unsupported(f"cumsum of {along} (only lengths, one-hot starts and values constant along the dim are "
                      "modelled)")


def _lengths_form(E, e, y):
    """``_telescoping`` of ``e``, after collapsing Piecewise branches that agree (decided); else
    whether ``e`` equals the lengths ``off(y + 1) - off(y)`` (one sequence: ``L`` itself)."""
    t = _telescoping(e, y)
    if t is None and e.has(sympy.Piecewise):
        t = _telescoping(sympy.expand(E.dom.canon(collapse(E.dom, e))), y)
    if t is None:
        ok, _ = equal(E.dom, e, off(y + 1) - off(y))
        t = (1, 0) if ok else None
    return t


def _telescoping(e, y):
    """``(c0 + 1, c0)`` when ``e = off(y + c0 + 1) - off(y + c0)``."""
    terms = sympy.Add.make_args(e)
    if len(terms) != 2:
        return None
    pos = [t for t in terms if isinstance(t, sympy.Function) and t.func == off]
    neg = [-t for t in terms if isinstance(-t, sympy.Function) and (-t).func == off]
    if len(pos) != 1 or len(neg) != 1:
        return None
    c1, c0 = sympy.expand(pos[0].args[0] - y), sympy.expand(neg[0].args[0] - y)
    if c1.is_Integer and c0.is_Integer and c1 == c0 + 1:
        return int(c1), int(c0)
    return None


@rule(_op("repeat_interleave", "Tensor"))
def _repeat_interleave(E, n, idx):
    repeats = n.args[0]
    K = E.shape(repeats)[0]
    k = E.dom.coord("k", K)
    e = sympy.expand(E.dom.canon(num(E.at(E.src(n, repeats), (k,)))))
    t = _lengths_form(E, e, k)
    if t is None or t != (1, 0):
        raise Unsupported(f"repeat_interleave by {e} (only the sequence lengths are modelled)")
    row = E.dom.guarded_row(idx[0])
    if row is None:
        raise Unsupported("repeat_interleave of the lengths read at something other than a jagged row")
    return _cast(_guard(E, row[2], row[0], "repeat_interleave"), _dtype(n))


# ---------------------------------------------------------------------------------------------
# scatters: who writes an element


def _unknowns(E, shape, rows=True):
    """Fresh coordinates for a scatter's positions: a jagged row for a dim of ``L`` rows (``rows``)."""
    ys, syms = [], []
    for s in shape:
        if rows and E.dom.is_rows(s):
            b, p, r = E.dom.row("w")
            ys.append(r)
            syms.append(("row", b, p))
        else:
            u = E.dom.coord("u", s)
            ys.append(u)
            syms.append(("plain", u, s))
    return ys, syms


def _solve_one(E, val, target, unknown_syms, solved):
    """Solve ``val == target`` for unknowns of ``val``; updates ``solved``; True if progress."""
    val = sympy.expand(E.dom.canon(val.xreplace(solved)))
    free = [u for u in unknown_syms if val.has(u) and u not in solved]
    if not free:
        return False
    # a jagged row against a jagged row: off(b') + p' == off(b) + p
    for (kind, *rest) in [s for s in E._inv_syms if s[0] == "row"]:
        b, p = rest
        if b in free or p in free:
            c = sympy.expand(val - off(b) - p)
            if not c.has(*free):
                row = E.dom.as_row(sympy.expand(target - c))
                if row is not None:
                    solved[b], solved[p] = row
                    return True
    if len(free) == 1:
        u = free[0]
        poly = sympy.Poly(val, u) if val.is_polynomial(u) else None
        if poly is not None and poly.degree() == 1:
            a, c = poly.all_coeffs()
            if a == 1 or a == -1:
                solved[u] = sympy.expand((target - c) / a)
                return True
        return False
    if len(free) == 2:
        for u1, u2 in ((free[0], free[1]), (free[1], free[0])):
            if not (val.is_polynomial(u1) and val.is_polynomial(u2)):
                continue
            p1, p2 = sympy.Poly(val, u1), sympy.Poly(val, u2)
            if p1.degree() != 1 or p2.degree() != 1:
                continue
            K = p1.all_coeffs()[0]
            if K.has(u2) or sympy.expand(p2.all_coeffs()[0] - 1) != 0:
                continue
            c = sympy.expand(val - K * u1 - u2)
            if c.has(u1, u2):
                continue
            rng = E.dom.bounds(u2)
            if rng is None or not E.dom.known(sympy.Ge(rng[0], 0)) or not E.dom.known(sympy.Lt(rng[1], K)):
                continue
            t = sympy.expand(target - c)
            solved[u1] = E.dom.floordiv(t, K)
            solved[u2] = E.dom.mod(t, K)
            return True
    return False


def invert(E, ishape, index_at, targets, tshape, what):
    """:func:`_invert` with the sources' ``L``-row dims read as jagged rows and the targets plain;
    where sizes coincide (one full sequence: ``B * N == L``), the other readings are tried too."""
    first = None
    for src_rows, tgt_rows in ((True, False), (True, True), (False, False)):
        if (tgt_rows or not src_rows) and not any(E.dom.is_rows(s) for s in (*ishape, *tshape)):
            continue
        try:
            return _invert(E, ishape, index_at, targets, tshape, what, src_rows, tgt_rows)
        except Unsupported as e:
            first = first or e
    raise first


def _invert(E, ishape, index_at, targets, tshape, what, src_rows, tgt_rows):
    """The source position writing element ``targets`` (of dims of sizes ``tshape``) of a scatter
    whose index map is ``index_at(y)`` (one expression per indexed dim) over source positions ``y``
    in ``ishape``. Returns ``(condition, y)``: ``y`` is written there exactly when ``condition``
    holds. Solved once for generic targets (fresh coordinates, so the map is checked injective on
    its whole domain), then read at ``targets``. Raises Unsupported when the map cannot be inverted
    or may write an element twice."""
    ys, syms = _unknowns(E, ishape, src_rows)
    E._inv_syms = syms
    unknown = []
    for s in syms:
        unknown += [s[1], s[2]] if s[0] == "row" else [s[1]]
    vals = [sympy.expand(E.dom.canon(num(v))) for v in index_at(tuple(ys))]
    if any(v.has(sympy.Piecewise) for v in vals):  # e.g. offsets spelled F.pad(cumsum(lengths), (1, 0))
        vals = [sympy.expand(E.dom.canon(collapse(E.dom, v))) if v.has(sympy.Piecewise) else v for v in vals]
    generic, gsyms = _unknowns(E, tshape, tgt_rows)  # fresh targets
    solved: dict = {u: E.dom.canon(u) for u in unknown if E.dom.canon(u) != u}  # one-value ranges (B = 1)
    progress = True
    while progress and any(u not in solved for u in unknown):
        progress = False
        for v, t in zip(vals, generic):
            if _solve_one(E, v, t, unknown, solved):
                progress = True
    missing = [u for u in unknown if u not in solved]
    if missing:
        raise Unsupported(f"{what}: cannot invert its index map ({', '.join(map(str, vals))})")
    # injective: the solution recovers every source position from the index it writes
    back = _bind_generic(E, gsyms, vals, f"{what}: writes rows {{}} that are not jagged rows")
    for u in unknown:
        again = E.dom.simplify_divmod(E.dom.canon(solved[u].xreplace(back)))
        if sympy.expand(again - E.dom.canon(u)) != 0:
            raise Unsupported(f"{what}: may write an element twice (index map {', '.join(map(str, vals))} "
                              f"is not injective)")
    # read at the actual targets
    at = _bind_generic(E, gsyms, targets, f"{what}: written rows read at {{}}, not a jagged row")
    sol = {u: E.dom.simplify_divmod(E.dom.canon(solved[u].xreplace(at))) for u in unknown}
    conds = []
    for s in syms:
        if s[0] == "row":
            _, b, p = s
            bb, pp = sol[b], sol[p]
            conds += [sympy.Ge(bb, 0), sympy.Lt(bb, E.dom.B), sympy.Ge(pp, 0), sympy.Lt(pp, E.dom.length(bb))]
        else:
            _, u, size = s
            conds += [sympy.Ge(sol[u], 0), sympy.Lt(sol[u], size)]
    for v, t in zip(vals, targets):
        lhs = E.dom.simplify_divmod(E.dom.canon(v.xreplace(sol)))
        if sympy.expand(lhs - t) != 0:
            conds.append(sympy.Eq(lhs, t))
    y = tuple(E.dom.canon(yexpr.xreplace(sol)) for yexpr in ys)
    cond = sympy.And(*[c for c in conds if c is not sympy.true and not _known_true(E, c)])
    return cond, y


def _known_true(E, c) -> bool:
    if isinstance(c, (sympy.StrictLessThan, sympy.LessThan, sympy.StrictGreaterThan, sympy.GreaterThan)):
        return E.dom.known(c)
    return False


def masked_rank(E, mask, shape, idx):
    """Row-major rank of ``idx`` among the true elements of ``mask`` broadcast to ``shape``, for the
    padding mask ``x1 < n(x0)`` (over dims 0, 1, broadcast along the rest)."""
    mshape = E.shape(mask)
    if len(shape) < 2:
        raise Unsupported("masked_scatter with a 1-D mask")
    b = E.dom.sequence("mb")
    p = E.dom.coord("mp", shape[1])
    rest = tuple(E.dom.coord("mr", s) for s in shape[2:])
    full = (b, p) + rest
    m = E.at(mask, tuple(sympy.Integer(0) if s == 1 else x for s, x in zip(mshape, full[len(full) - len(mshape):])))
    ok, _ = equal(E.dom, boolean(m), sympy.Lt(p, E.dom.length(b)))
    if not ok:
        raise Unsupported(f"masked_scatter with a mask other than the padding mask ({m})")
    T = sympy.Mul(*shape[2:]) if len(shape) > 2 else sympy.Integer(1)
    return sympy.expand(off(idx[0]) * T + idx[1] * T + linear(idx[2:], shape[2:]))


@rule(_op("index", "Tensor"))
def _index_or_mask(E, n, idx):
    """``index`` with a boolean mask (an unpad ``dense[valid]``) here, integer indices in ``rules_layout``."""
    if any(t is not None and _dtype(t) in (torch.bool, torch.uint8) for t in n.args[1]):
        return bool_index(E, n, idx)
    return _index(E, n, idx)


def padding_mask_layout(E, mask, mshape, what):
    """How a padding mask ``p < n_b`` over ``[B, W]`` (or flattened, ``[B * W]``) addresses slot ``(b, p)``:
    ``at(b, p)`` gives the mask's index tuple. Its true elements in row-major order are then the jagged rows:
    the one of rank ``off(b) + p`` is ``at(b, p)``. Unsupported for any other mask."""
    if len(mshape) not in (1, 2):
        raise Unsupported(f"{what} over other than two dims, or their flattening")
    b = E.dom.sequence("ib")
    if len(mshape) == 2:
        width = sympy.sympify(mshape[1])
        at = lambda b, p: (b, p)  # noqa: E731
    else:  # dense [B*W, ...] and its mask flattened alike: element b*W + p is (b, p)
        width = sympy.simplify(sympy.sympify(mshape[0]) / E.dom.B)
        if not (width.is_integer or (width.is_Symbol and width.is_positive)):
            raise Unsupported(f"flat {what} over {mshape[0]} elements: not B rows of one width")
        at = lambda b, p: (b * width + p,)  # noqa: E731
    # every sequence's rows fit in a mask row (n_b <= N <= W): only then are the ranks the jagged rows
    if not E.dom.known(sympy.Ge(width, E.dom.N)):
        raise Unsupported(f"{what} over rows of width {width}, not known to hold max_seq_len {E.dom.N}")
    p = E.dom.coord("ip", width)
    m = E.at(mask, at(b, p))
    ok, _ = equal(E.dom, boolean(m), sympy.Lt(p, E.dom.length(b)))
    if not ok:
        raise Unsupported(f"{what} with a mask other than the padding mask ({m})")
    return at


def bool_index(E, n, idx):
    """``dense[mask]`` for the padding mask over the two leading dims (or their flattening): row ``off(b) + p``
    is ``dense[b, p]``."""
    a, indices = n.args[:2]
    if len(indices) != 1:
        raise Unsupported("boolean index with other indices")
    mask = indices[0]
    at = padding_mask_layout(E, E.src(n, mask), E.shape(mask), "boolean index")
    row = E.dom.guarded_row(idx[0])
    if row is None:
        raise Unsupported("boolean-mask unpad read at something other than a jagged row")
    return _guard(E, row[2], E.at(E.src(n, a), at(row[0], row[1]) + tuple(idx[1:])), "unpad")


@rule(_op("nonzero"))
def _nonzero(E, n, idx):
    """``nonzero(mask)`` of a padding mask: its row ``off(b) + p`` holds the index of slot ``(b, p)`` (a row
    count equal to ``L`` is what makes its rows jagged rows: the shape environment must know it)."""
    mask = n.args[0]
    at = padding_mask_layout(E, E.src(n, mask), E.shape(mask), "nonzero")
    row = E.dom.guarded_row(idx[0])
    if row is None:
        raise Unsupported("nonzero read at something other than a jagged row (its row count not known to be L)")
    coords = at(row[0], row[1])
    value = coords[0] if len(coords) == 1 else select(sympy.Eq(idx[1], 0), coords[0], coords[1])
    return _guard(E, row[2], value, "nonzero")


# ---------------------------------------------------------------------------------------------
# one-hot products


def one_hot_product(E, n, idx):
    """``A @ X`` where ``A[s, r]`` is 1 for the single ``r = g(s)`` allowed by a condition: ``X[g(s)]``."""
    a, x = n.args[:2]
    ashape = E.shape(a)
    r = E.dom.coord("oh", ashape[-1])
    lead = idx[:-2]
    e = E.at(E.src(n, a), lead + (idx[-2], r))
    cond = indicator(e)
    if cond is None:
        raise Unsupported("matrix product in an index subgraph (only one-hot selections are modelled)")
    parts = list(sympy.And.make_args(cond))
    hit, rest = None, []
    for c in parts:
        if hit is None and isinstance(c, sympy.Eq) and (c.lhs - c.rhs).has(r):
            d = sympy.expand(c.lhs - c.rhs)
            poly = sympy.Poly(d, r) if d.is_polynomial(r) else None
            if poly is not None and poly.degree() == 1 and poly.all_coeffs()[0] in (1, -1):
                a1, c0 = poly.all_coeffs()
                hit = sympy.expand(-c0 / a1)
                continue
        rest.append(c)
    if hit is None or any(c.has(r) for c in rest):
        raise Unsupported(f"matrix product with a selection other than one-hot ({cond})")
    R = ashape[-1]
    keep = sympy.And(*rest, sympy.Ge(hit, 0), sympy.Lt(hit, R))
    v = E.at(E.src(n, x), lead + (hit, idx[-1]))
    return select(keep, v, sympy.Integer(0))


# ---------------------------------------------------------------------------------------------
# jagged <-> padded ops (aten and fbgemm)


def _offsets_at(E, n, offsets_list, x):
    o = offsets_list[0] if isinstance(offsets_list, (list, tuple)) else offsets_list
    if len(offsets_list) != 1:
        raise Unsupported("jagged op with several jagged dims")
    return E.at(E.src(n, o), (x,))


def _to_padded(E, n, idx):
    values, offsets = n.args[:2]
    pad = n.args[3] if len(n.args) > 3 else n.kwargs.get("padding_value", 0.0)
    b, p, rest = idx[0], idx[1], idx[2:]
    start = _offsets_at(E, n, offsets, b)
    end = _offsets_at(E, n, offsets, b + 1)
    v = E.at(E.src(n, values), (start + p,) + tuple(rest))
    return _cast(select(sympy.Lt(p, end - start), v, E.scalar(pad)), _dtype(n))


def _to_jagged(E, n, idx):
    dense, offsets = n.args[:2]
    row = E.dom.guarded_row(idx[0])
    if row is None:
        raise Unsupported("dense-to-jagged read at something other than a jagged row")
    b, p, cond = row
    start = _offsets_at(E, n, offsets, b)
    ok, _ = equal(E.dom, start, off(b))
    if not ok:
        raise Unsupported(f"dense-to-jagged with offsets {start} other than the batch's")
    return _guard(E, cond, E.at(E.src(n, dense), (b, p) + tuple(idx[1:])), "unpad")


rule(_op("_jagged_to_padded_dense_forward"))(_to_padded)
rule(_op("_padded_dense_to_jagged_forward"))(_to_jagged)
NAMED_RULES["fbgemm::jagged_to_padded_dense_forward.default"] = _to_padded
NAMED_RULES["fbgemm::jagged_to_padded_dense.default"] = _to_padded
NAMED_RULES["fbgemm::dense_to_jagged_forward.default"] = _to_jagged


def _complete_cumsum(E, n, idx):
    lengths = n.args[0]
    y = E.dom.coord("y", E.shape(lengths)[0])
    e = sympy.expand(E.dom.canon(num(E.at(E.src(n, lengths), (y,)))))
    t = _lengths_form(E, e, y)
    if t is None:
        raise Unsupported(f"complete cumsum of {e} (only the sequence lengths are modelled)")
    c1, c0 = t
    return off(idx[0] + c0) - off(c0)


NAMED_RULES["fbgemm::asynchronous_complete_cumsum.default"] = _complete_cumsum


# ---------------------------------------------------------------------------------------------
# scatters (inverted index maps)

def _scatter_value(E, n, idx, base, writes, accumulate):
    """``base`` at ``idx`` overwritten (or accumulated) by ``writes = [(cond, value)]``."""
    old = E.at(E.src(n, base), idx)
    out = old
    for cond, value in writes:
        new = num(old) + num(value) if accumulate else value
        out = select(cond, new, out)
    return _cast(out, _dtype(n))


@rule(_op("index_put"), _op("index_put_"), _op("_index_put_impl_"))
def _index_put(E, n, idx):
    base, indices, values = n.args[:3]
    accumulate = bool(n.args[3]) if len(n.args) > 3 else bool(n.kwargs.get("accumulate", False))
    shape = E.shape(base)
    indices = list(indices) + [None] * (len(shape) - len(indices))
    adv = [k for k, t in enumerate(indices) if t is not None]
    if any(_dtype(indices[k]) in (torch.bool, torch.uint8) for k in adv):
        return _bool_index_put(E, n, idx, base, indices, adv, values, accumulate)
    triangle = _triangle_written(E, n, idx, indices, adv, values)
    if triangle is not None:
        return _scatter_value(E, n, idx, base, [triangle], accumulate)
    if adv != list(range(adv[0], adv[-1] + 1)):
        raise Unsupported("index_put with non-adjacent index tensors")
    ishape = _broadcast_shape([E.shape(indices[k]) for k in adv])
    lead = adv[0]
    rest_out = list(idx[:lead]) + list(idx[adv[-1] + 1:])

    def index_at(y):
        return [E.at(E.src(n, indices[k]), _align(E, indices[k], y)) for k in adv]

    found = invert(E, ishape, index_at, [idx[k] for k in adv], [shape[k] for k in adv], f"{_opname(n)} {n.name}")
    if found is None:
        return _scatter_value(E, n, idx, base, [], accumulate)
    cond, y = found
    vshape = E.shape(values)
    full = tuple(idx[:lead]) + tuple(y) + tuple(idx[adv[-1] + 1:])
    v = E.at(E.src(n, values), _bcast_to(full, vshape))
    _ = rest_out
    return _scatter_value(E, n, idx, base, [(cond, v)], accumulate)


def _triangle_written(E, n, idx, indices, adv, values):
    """``m[tuple(torch.tril_indices(R, C, o))] = v`` (or ``triu_indices``) with one value ``v`` for every write:
    ``(cond, v)``, the element ``(a, c)`` written exactly when ``c - a <= o`` (``>= o``), ``a < R``, ``c < C``.
    The rows of ``tril_indices`` list each such pair once, so the writes need no inversion. None when the
    indices are not the two rows of one such node."""
    if len(adv) != 2:
        return None
    rows = []
    for k in adv:
        t = indices[k]
        if not (isinstance(t, torch.fx.Node) and t.target is aten.select.int and t.args[1] == 0):
            return None
        rows.append((t.args[0], t.args[2]))
    (tri, r0), (tri1, r1) = rows
    if tri is not tri1 or (r0, r1) != (0, 1) or tri.target not in (aten.tril_indices.default, aten.triu_indices.default):
        return None
    R, C = tri.args[:2]
    o = tri.args[2] if len(tri.args) > 2 else tri.kwargs.get("offset", 0)
    if not all(isinstance(x, int) for x in (R, C, o)):
        return None
    if any(s != 1 for s in E.shape(values)):
        return None  # one value per write (a scalar), else which write holds which value needs the ranks
    a, c = idx[adv[0]], idx[adv[1]]
    side = sympy.Le(c - a, o) if tri.target is aten.tril_indices.default else sympy.Ge(c - a, o)
    cond = sympy.And(side, sympy.Lt(a, R), sympy.Lt(c, C))
    v = E.at(E.src(n, values), tuple(sympy.Integer(0) for _ in E.shape(values)))
    return cond, v


def _bool_index_put(E, n, idx, base, indices, adv, values, accumulate):
    """``dense[mask] = values`` for the padding mask over the two leading dims (a pad): the true elements,
    in row-major order, take the rows of ``values``, so ``dense[b, p]`` gets row ``off(b) + p``."""
    if adv != [0] or len(E.shape(indices[0])) != 2:
        raise Unsupported("index_put with a boolean mask other than one over the two leading dims")
    mask = E.src(n, indices[0])
    padding_mask_layout(E, mask, E.shape(indices[0]), "boolean-mask index_put")
    rank = off(idx[0]) + idx[1]
    v = E.at(E.src(n, values), _bcast_to((rank,) + tuple(idx[2:]), E.shape(values)))
    return _scatter_value(E, n, idx, base, [(boolean(E.at(mask, tuple(idx[:2]))), v)], accumulate)


def _bcast_to(full, vshape):
    sub = full[len(full) - len(vshape):]
    return tuple(sympy.Integer(0) if s == 1 else x for s, x in zip(vshape, sub))


def _dim_scatter(accumulate, value_arg=3, dim_writes_only=True):
    def r(E, n, idx):
        base, dim, index = n.args[:3]
        src = n.args[value_arg] if len(n.args) > value_arg else None
        shape = E.shape(base)
        dim = dim % len(shape)
        ishape = E.shape(index)
        if len(ishape) == 1 and len(shape) > 1 or n.target in (_op("index_copy"), _op("index_copy_"),
                                                             _op("index_add"), _op("index_add_")):
            # index_copy / index_add: a 1-D index over dim; the other dims pass through
            def index_at(y):
                return [E.at(E.src(n, index), (y[0],))]
            found = invert(E, (ishape[0],), index_at, [idx[dim]], [shape[dim]], f"{_opname(n)} {n.name}")
            if found is None:
                return _scatter_value(E, n, idx, base, [], accumulate)
            cond, y = found
            sidx = list(idx)
            sidx[dim] = y[0]
            v = E.at(E.src(n, src), tuple(sidx))
            if n.target in (_op("index_add"), _op("index_add_")):
                alpha = _kw(n, "alpha", 1)
                v = num(v) * E.scalar(alpha)
            return _scatter_value(E, n, idx, base, [(cond, v)], accumulate)
        # scatter: index has the rank of self; out[..., index[y], ...] = src[y] with y == idx elsewhere
        others = [d for d in range(len(shape)) if d != dim]

        def index_at(y):
            full = list(idx)
            full[dim] = y[0]
            return [E.at(E.src(n, index), tuple(full))]
        found = invert(E, (ishape[dim],), index_at, [idx[dim]], [shape[dim]], f"{_opname(n)} {n.name}")
        if found is None:
            return _scatter_value(E, n, idx, base, [], accumulate)
        cond, y = found
        full = list(idx)
        full[dim] = y[0]
        inside = sympy.And(*[sympy.Lt(idx[d], ishape[d]) for d in others if ishape[d] != shape[d]])
        if isinstance(src, torch.fx.Node) and isinstance(meta_val(src), torch.Tensor):
            v = E.at(E.src(n, src), tuple(full))
        else:
            v = E.scalar(src)
        return _scatter_value(E, n, idx, base, [(sympy.And(cond, inside), v)], accumulate)
    return r


rule(_op("index_copy"), _op("index_copy_"))(_dim_scatter(False))
rule(_op("index_add"), _op("index_add_"))(_dim_scatter(True))
rule(_op("scatter", "src"), _op("scatter_", "src"), _op("scatter", "value"), _op("scatter_", "value"))(
    _dim_scatter(False))
rule(_op("scatter_add"), _op("scatter_add_"))(_dim_scatter(True))


@rule(_op("slice_scatter"))
def _slice_scatter(E, n, idx):
    base, src = n.args[:2]
    shape = E.shape(base)
    dim = (n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)) % len(shape)
    start = n.args[3] if len(n.args) > 3 else n.kwargs.get("start")
    step = n.args[5] if len(n.args) > 5 else n.kwargs.get("step", 1)
    start, step = _slice_bounds(E, shape[dim], start, None, step)
    size = E.shape(src)[dim]
    k = idx[dim] - start
    local = list(idx)
    if step == 1:
        local[dim] = k
        cond = sympy.And(sympy.Ge(k, 0), sympy.Lt(k, size))
    else:
        local[dim] = E.dom.floordiv(k, step)
        cond = sympy.And(sympy.Ge(k, 0), sympy.Eq(E.dom.mod(k, step), 0), sympy.Lt(local[dim], size))
    v = E.at(E.src(n, src), tuple(local))
    return _scatter_value(E, n, idx, base, [(cond, v)], False)


@rule(_op("select_scatter"))
def _select_scatter(E, n, idx):
    base, src, dim, index = n.args[:4]
    shape = E.shape(base)
    dim = dim % len(shape)
    i = E.scalar(index)
    if i.is_number and i < 0:
        i = i + shape[dim]
    v = E.at(E.src(n, src), idx[:dim] + idx[dim + 1:])
    return _scatter_value(E, n, idx, base, [(sympy.Eq(idx[dim], i), v)], False)


@rule(_op("masked_scatter"), _op("masked_scatter_"))
def _masked_scatter(E, n, idx):
    base, mask, source = n.args[:3]
    m = E.at(E.src(n, mask), E.broadcast(mask, idx))
    rank = masked_rank(E, E.src(n, mask), E.shape(n), idx)
    v = E.at(E.src(n, source), unravel(E, rank, E.shape(source)))
    return _scatter_value(E, n, idx, base, [(boolean(m), v)], False)


# -- products in the index world (one-hot matmuls) ----------------------------------------------

@rule(_op("mm"), _op("bmm"))
def _mm(E, n, idx):
    return one_hot_product(E, n, idx)


def _bind_generic(E, gsyms, values, unsupported: str) -> dict:
    """The generic index symbols bound to ``values``: a plain symbol to its value, a jagged row's
    pair ``(b, p)`` to the row's decomposition (``unsupported``, formatted with the value, if the
    value is not a jagged row)."""
    out = {}
    for g, v in zip(gsyms, values):
        if g[0] == "plain":
            out[g[1]] = v
            continue
        row = E.dom.as_row(v)
        if row is None:
            raise Unsupported(unsupported.format(v))
        out[g[1]], out[g[2]] = row
    return out
