"""The value-level attention proof (``attn_meaning``): the pads into the score chain and the unpad
out of it.

* **Pads.** Element ``(b, p, f)`` of each pad ``D`` (``[B, N, *F]`` viewed as ``D.shape``) must be
  ``src(off(b) + p, f)`` where ``p < n_b`` and 0 elsewhere.
* **Unpad.** Row ``off(b) + p`` of the output must be element ``(b, p)`` of the dense output.

Both decided by ``core.decide`` (z3) at one element of symbolic coordinates.
"""
from __future__ import annotations

import sympy

from . import attn_layout as lay
from .attn_find import PadMismatch, meta_val
from .attn_meaning_domain import _domain, _leaf_fn, _offsets_leaf, _rows, _short
from .core import decide
from .core.domain import off
from .core.elements import Elements, unravel
from .core.values import Unsupported
from .prover import Decline, sym_expr


def prove_pads(plan) -> None:
    """Every pad ``D`` is ``jagged_to_padded(src, offsets, N)`` viewed as ``D.shape``; one
    :class:`PadMismatch` naming every pad that is not (its next source candidate may be)."""
    bad, seen, shared = [], [], {}
    for x in (plan.q, plan.k, plan.v):
        if any(x.D is y for y in seen):
            continue
        seen.append(x.D)
        try:
            prove_pad(plan, x, shared)
        except PadMismatch as e:
            bad.append(e)
        except Unsupported as e:
            bad.append(PadMismatch(f"pad of {x.src.name}: {e}", x.D))
    if bad:
        raise PadMismatch(str(bad[0]), *(d for e in bad for d in e.Ds))


def _pad_context(plan, x, shared: dict):
    """(domain, b, p, feature coordinates, interpreter) for the pad of ``x``. Pads of sources with the same
    rows and feature shape share them: the index arithmetic the pads have in common (sequence ids,
    positions, validity masks) is then interpreted once, at the same symbolic element."""
    fshape = [sym_expr(s) for s in meta_val(x.src).shape[1:]]
    key = (_rows(x.src), tuple(fshape))
    if key not in shared:
        dom = _domain(plan, x.src)
        b = dom.sequence("b")
        p = dom.coord("p", plan.N)
        fs = tuple(dom.coord(f"f{k}", s) for k, s in enumerate(fshape))
        leaves = {y.src: (lambda f: lambda idx: f(*idx))(_leaf_fn(f"src_{y.src.name}"))
                  for y in (plan.q, plan.k, plan.v)}
        shared[key] = (dom, b, p, fs, fshape, Elements(dom, {**leaves, plan.offsets: _offsets_leaf(plan)}))
    return shared[key]


def prove_pad(plan, x, shared=None) -> None:
    dom, b, p, fs, fshape, E = _pad_context(plan, x, {} if shared is None else shared)
    src = _leaf_fn(f"src_{x.src.name}")
    lin = b * lay.to_expr(plan.N) + p
    for f, s in zip(fs, fshape):
        lin = lin * s + f
    got = E.at(x.D, unravel(E, sympy.expand(lin), E.shape(x.D)))
    want = sympy.Piecewise((src(off(b) + p, *fs), sympy.Lt(p, dom.length(b))), (0, True))
    ok, cex = decide.equal(dom, got, want)
    if not ok:
        raise PadMismatch(f"pad of {x.src.name} is not jagged_to_padded(offsets, N={plan.N}) with zero padding"
                          + (f" (e.g. at {_short(cex)})" if isinstance(cex, dict) else ""), x.D)


def prove_unpad(plan, sub) -> None:
    """Row ``off(b) + p`` of the output is element ``(b, p)`` of the dense output."""
    dom = _domain(plan, plan.q.src)
    b, p, r = dom.row("o")
    Od = _leaf_fn("dense_out")
    E = Elements(dom, {sub.Odense: lambda idx: Od(*idx), plan.offsets: _offsets_leaf(plan)})
    rest = [sym_expr(s) for s in sub.rest_shape]
    fs = tuple(dom.coord(f"e{k}", s) for k, s in enumerate(rest))
    got = E.at(plan.out, (r, *fs))
    N = lay.to_expr(plan.N)
    flat = [plan.B * N, *rest]
    lin = sympy.Integer(0)
    for x, s in zip((b * N + p, *fs), flat):
        lin = lin * s + x
    want = Od(*unravel(E, sympy.expand(lin), E.shape(sub.Odense)))
    ok, cex = decide.equal(dom, got, want)
    if not ok:
        raise Decline("unpad does not read row (b, n) of the dense output for every jagged row"
                      + (f" (e.g. at {_short(cex)})" if isinstance(cex, dict) else ""))
