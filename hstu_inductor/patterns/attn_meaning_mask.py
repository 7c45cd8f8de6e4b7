"""The value-level attention proof (``attn_meaning``): the mask.

The score chain's mask (the disjunction of the cases where the scores are kept) must *be* HSTU's
``valid(i, j)`` for parameters read off the graph's integer constants: each candidate is filtered
on random points and at the solver's counterexamples so far, and decided for every ``i, j < n <= N``
and ``0 <= t <= n`` (``_fit_mask``). A mask read from an interval tensor must be
``[0, x0) | [x1, x2)`` per row (``_prove_intervals``).
"""
from __future__ import annotations

import sympy
import torch

from .attn_find import meta_val
from .attn_meaning_chain import Chain, _mask_symbols
from .attn_meaning_domain import _short
from .core import decide
from .core.domain import off, tgt
from .core.semantics import interval_valid
from ..spec import AttentionSpec
from .prover import Decline, mask_candidates, valid_at, valid_at_many


def _fit_mask(ch: Chain, mask, ints, in_seq):
    """The HSTU mask parameters that make ``mask`` equal ``valid(i, j)`` on every in-sequence element."""
    n, t = _mask_symbols(ch)
    N = ch.plan.N
    consts = {abs(int(a)) for a in mask.atoms(sympy.Integer)} | {abs(i) for i in ints}
    Nint = int(N) if isinstance(N, int) or sympy.sympify(N).is_Integer else None
    cap = Nint if Nint is not None else max(consts | {64}) + 2
    cands = mask_candidates({c for c in consts if 0 < c <= cap + 1}, cap, t is not None)
    survivors = _sample_filter(ch, mask, cands, n, t, cap) if ch.sampled else []
    eq = decide.Equivalence(ch.dom, mask, in_seq)
    for params in survivors:
        if eq.check(ch.valid(params)):
            return params
    # the cheap filter can miss facts of the batch (one sequence: n_b = L; rows read through the
    # offsets): every candidate, each rejected by a counterexample found so far or decided
    seen = _CounterexampleFilter(ch, eq)
    for params in cands:
        if params not in survivors and not seen.rejects(params) and eq.check(ch.valid(params)):
            return params
    # no parameter set: say where the first plausible reading differs
    params = survivors[0] if survivors else AttentionSpec()
    ok, cex = decide.valid(ch.dom, sympy.Equivalent(mask, ch.valid(params)), in_seq)
    where = f" (e.g. at {_short(cex)})" if isinstance(cex, dict) else ""
    causal_like, _ = decide.valid(ch.dom, sympy.Implies(mask, sympy.Le(ch.j, ch.i)), in_seq)
    what = "matches no HSTU mask" if causal_like else "has entries above the diagonal (not causal)"
    raise Decline(f"attention mask {what} for any (max_attn_len, contextual_seq_len, "
                  f"min_full_attn_seq_len) taken from the graph's constants{where}")


class _CounterexampleFilter:
    """Rejects a candidate numerically (``valid_at``) at the counterexamples z3 found so far, so that
    the symbolic ``valid(params)`` is built and decided only for candidates that survive them all."""

    def __init__(self, ch, eq):
        self.ch, self.eq, self.seen, self.cols = ch, eq, -1, None

    def rejects(self, params) -> bool:
        if self.seen != len(self.eq.models):
            self.seen = len(self.eq.models)
            same, i, j, n, t = self.ch.mask_args()
            exprs = [same, i, j, n] + ([t] if t is not None else [])
            pts = [(v, want) for v, want in self.eq.points(exprs) if v[1] < v[3] and v[2] < v[3]]
            self.cols = None
            if pts:
                cols = torch.tensor([list(map(int, v)) + [int(want)] for v, want in pts]).unbind(1)
                self.cols = (*cols[:4], cols[4] if t is not None else None, cols[-1])
        if self.cols is None:
            return False
        same, i, j, n, t, want = self.cols
        got = same.bool() & valid_at(torch.arange(len(i)), i, j, n, t, params)
        return not torch.equal(got, want.bool())


def _sample_filter(ch, mask, cands, n, t, cap):
    """Candidates that agree with ``mask`` on random in-sequence points (a cheap filter before the
    decision procedure)."""
    g = torch.Generator().manual_seed(7)
    M = 3000
    nn = torch.randint(1, cap + 1, (M,), generator=g)
    nn[:200] = cap
    nn[200:300] = 1
    ii = (torch.rand(M, generator=g) * nn).long()
    jj = (torch.rand(M, generator=g) * nn).long()
    jj[300:600] = ii[300:600]
    tt = (torch.rand(M, generator=g) * (nn + 1)).long().clamp(max=nn)
    tt[600:800] = 0
    tt[800:900] = nn[800:900]
    env = {ch.i: ii, ch.j: jj}
    apps = {}
    for a in mask.atoms(sympy.Function):
        if a.func == off:
            apps[a] = torch.randint(0, 1 << 20, (M,), generator=g)
        elif a.func == tgt:
            apps[a] = tt
    for s in mask.free_symbols:
        if s in env:
            continue
        if s == n:
            env[s] = nn
        elif s in ch.dom.ranges:
            lo, hi = ch.dom.ranges[s]
            hi = sympy.sympify(hi).xreplace({sympy.sympify(ch.plan.N): cap}) if not isinstance(ch.plan.N, int) else hi
            hi = int(hi) if sympy.sympify(hi).is_Integer else cap
            env[s] = torch.randint(int(lo), max(int(lo), hi) + 1, (M,), generator=g)
        else:
            env[s] = torch.full((M,), cap)
    rep = {a: sympy.Symbol(f"_a{k}") for k, a in enumerate(apps)}
    syms = list(env) + list(rep.values())
    try:
        f = sympy.lambdify(syms, mask.xreplace(rep), "numpy")
        got = torch.as_tensor(f(*[env[s].numpy() for s in env], *[apps[a].numpy() for a in apps]))
        got = got.expand(M).to(torch.bool)
    except Exception:  # lambdify could not vectorise it: no filtering, the decision decides
        return cands
    b = torch.arange(M)
    i32 = [x.to(torch.int32) for x in (ii, jj, nn, tt)]  # sizes here are < 2**31; half the memory traffic
    out = []
    for k in range(0, len(cands), 256):  # chunks: a few MB of [chunk, M] temporaries
        chunk = cands[k:k + 256]
        agree = (valid_at_many(b, *i32[:3], i32[3] if t is not None else None, chunk) == got).all(dim=1)
        out.extend(p for p, ok in zip(chunk, agree.tolist()) if ok)
    return out


def _prove_intervals(ch: Chain, mask, in_seq):
    iv = ch.plan.intervals
    idx = [None, None, None]
    row = off(ch.b) + ch.i
    head = ch.head() if iv.heads > 1 else sympy.Integer(0)
    xs = []
    for k in range(3):
        idx = [None] * meta_val(iv.node).dim()
        idx[iv.row_dim] = row
        idx[iv.field_dim] = sympy.Integer(k)
        if iv.head_dim is not None:
            idx[iv.head_dim] = head if iv.heads > 1 else sympy.Integer(0)
        xs.append(ch.iv_fn(*idx))
    want = interval_valid(ch.j, *xs)
    ok, cex = decide.valid(ch.dom, sympy.Equivalent(mask, want), in_seq)
    if not ok:
        raise Decline(f"mask read from the interval tensor {iv.node.name} is not [0, x0) | [x1, x2) per row"
                      + (f" (e.g. at {_short(cex)})" if isinstance(cex, dict) else ""))
