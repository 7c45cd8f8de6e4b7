"""The value-level attention proof (``attn_meaning``): the score chain, by cases (``prove_chain``).

The chain's inputs other than the scores are split into cases (``core.semantics.cases``); each
feasible combination is evaluated on samples (``attn_meaning_float``) and must give one ``(alpha,
beta, c)`` everywhere the scores are kept; the mask is then fitted (``attn_meaning_mask``). A
symbolic ``N`` is evaluated at several values (``_bindings``), so the scale's law over ``N`` can be
checked (``attn_meaning.n_law``).
"""
from __future__ import annotations

import itertools
import math

import sympy
import torch

from ..spec import AttentionSpec
from .attn_find import meta_val
from .attn_meaning_chain import Chain, _chain_inputs
from .attn_meaning_float import _classify, _concrete, _evaluate, _fit_beta, _Sample, _zero_scores
from .attn_meaning_mask import _fit_mask, _prove_intervals
from .core import decide
from .core.domain import off, tgt
from .core.semantics import cases
from .prover import Decline, hints

_SAMPLES = 64          # float samples per case combination
_MAX_COMBOS = 256      # case combinations of the score chain's inputs


def _feasible(ch: Chain, cond, extra=()) -> bool:
    if cond is sympy.false:
        return False
    if cond is sympy.true and not extra:
        return True
    r = decide.satisfiable(ch.dom, sympy.And(cond, *extra))
    if r is None:
        raise Decline("could not decide whether a case of the score chain occurs (solver timeout)")
    return r


def prove_chain(gm, plan, sub, ch=None):
    """The score chain, by cases: fills ``alpha``, the mask parameters, the rab ratio, and returns
    ``(c per N binding, scale_used)`` for the caller's scale bookkeeping. ``ch``: the score positions'
    coordinates (default: padded sequences, :class:`Chain`)."""
    ch = Chain(plan, sub) if ch is None else ch
    ch.sderived = set(sub.layouts)
    data, inputs = _chain_inputs(ch)
    keys = list(inputs)
    split = [cases(inputs[k]) for k in keys]
    if math.prod(len(c) for c in split) > _MAX_COMBOS:
        raise Decline(f"score chain has too many cases to enumerate ({math.prod(len(c) for c in split)})")
    for k, cs in zip(keys, split):
        for cond, _ in cs:
            if any(isinstance(a.func, sympy.core.function.UndefinedFunction) and a.func not in (off, tgt)
                   and not getattr(a.func, "is_int_leaf", False) for a in cond.atoms(sympy.Function)):
                raise Decline(f"mask depends on float data ({k[1].name if hasattr(k[1], 'name') else k[1]})")
    from .prover import scalar_constants
    floats, ints = scalar_constants(sub.s_order)
    alpha_cands = sorted({1.0} | {c for c in floats if c != 0} | {1.0 / c for c in floats if c != 0})
    hint = hints(meta_val(plan.q.src), meta_val(plan.offsets), meta_val(plan.S))
    bindings = _bindings(plan, hint)
    in_seq = ch.in_seq()
    gen = torch.Generator().manual_seed(1234)
    sample = _Sample(_SAMPLES, gen)
    srow_app = None
    if ch.scale_fn is not None:
        # canonical like every element read (a batch of one: off(0) = 0)
        srow_app = ch.scale_fn if isinstance(ch.scale_fn, sympy.Symbol) else \
            ch.dom.canon(ch.scale_fn(off(ch.b) + ch.i))
    results = {}  # combo index -> (cond, [per-binding class])
    chosen = None
    beta = None
    consts = []
    for bi, binding in enumerate(bindings):
        per = []
        for combo in itertools.product(*split):
            cond = sympy.And(*[c for c, _ in combo])
            if cond is sympy.false:
                continue
            key = tuple(str(c) for c, _ in combo)
            if key not in results:
                if not _feasible(ch, cond):
                    results[key] = None
                    continue
                results[key] = {"cond": cond, "inseq": _feasible(ch, cond, in_seq), "cls": []}
            r = results[key]
            if r is None:
                continue
            if r["inseq"] and srow_app is not None:
                if "at_row" not in r:  # the scale gathered at an index that is the row in-sequence
                    r["at_row"] = [(c, _at_the_row(ch.dom, v, srow_app, [cond, *in_seq])) for c, v in combo]
                combo = r["at_row"]
            values = {k: _concrete(v, binding, sample, ch, padding=not r["inseq"]) for k, (_, v) in zip(keys, combo)}
            g = _evaluate(ch, data, values, binding, sample)
            if not bool(torch.isfinite(g).all()):
                raise Decline("scores are not finite on some positions (e.g. -inf masking before the silu)")
            apps = {a for _, v in combo if isinstance(v, sympy.Basic) for a in _scale_apps(v, ch)}
            if apps and r["inseq"] and not _is_row_scale(apps, srow_app):
                raise Decline(f"scores are not scale * silu(alpha * qk) with the query row's attn_scale: they are "
                              f"scaled by {', '.join(map(str, apps))}")
            srow = sample.leaf(srow_app) if apps else None
            cls = _classify(g, sample, srow, alpha_cands) if r["inseq"] else "zero" if bool((g == 0).all()) else "pad"
            if cls is None:
                raise Decline("scores are not scale * silu(alpha * qk) for any alpha "
                              "(other activation or normalisation?)")
            if cls not in ("zero", "pad"):
                a, c = cls
                if chosen is None:
                    chosen = a
                elif not math.isclose(a, chosen, rel_tol=1e-9):
                    raise Decline(f"scores use alpha={a:g} in some positions and {chosen:g} in others")
                if plan.rab is not None:
                    cands = [1.0, a, -1.0, *[x for x in floats if x], *[1 / x for x in floats if x]]
                    bt = _fit_beta(g, sample, srow, a, c, dict.fromkeys(cands))
                    if bt is None:
                        raise Decline("scores with a bias are not scale * silu(alpha * qk + b * bias) for any "
                                      "b among the graph's constants (bias added after the activation?)")
                    if beta is not None and not math.isclose(bt, beta, rel_tol=1e-9):
                        raise Decline("the bias enters the scores with different coefficients")
                    beta = bt
                per.append((c, apps != set()))
                r["cls"].append(("hstu", c))
            else:
                r["cls"].append((cls, None))
            if plan.dense and r is not None and _feasible(ch, cond, _padding_rows(ch)):
                g0 = _evaluate(ch, data, values, binding, _zero_scores(sample))
                if not bool((g0 == 0).all()):
                    raise Decline("attention output is used padded (no unpad) but its padding rows are not zero")
        cs = {round(c, 15) for c, _ in per}
        if len({c for c in cs}) > 1 and not all(math.isclose(c, per[0][0], rel_tol=1e-9) for c, _ in per):
            raise Decline("scores are scaled by different constants in different positions")
        if per:
            consts.append((binding, per[0][0], per[0][1]))
    if chosen is None:
        raise Decline("attention scores are zero everywhere")
    scale_used = any(u for _, _, u in consts)
    if scale_used and not all(u for _, _, u in consts):
        raise Decline("the attn_scale input scales some positions and not others")
    # the mask: where the scores are kept
    kept = [r["cond"] for r in results.values() if r is not None and r["inseq"]
            and any(k == "hstu" for k, _ in r["cls"])]
    mask = sympy.Or(*kept) if kept else sympy.false
    if plan.intervals is not None:
        plan.params = AttentionSpec()
        _prove_intervals(ch, mask, in_seq)
    else:
        plan.params = _fit_mask(ch, mask, ints, in_seq)
    plan.alpha = float(chosen * plan.q.factor * plan.k.factor)
    if plan.rab is not None:
        plan.rab.ratio = beta / chosen
        plan.rab.coeff = float(beta)
        _tables(plan, ch)
    return consts, scale_used


def _tables(plan, ch) -> None:
    """Bias terms proven to be the table bias go to the op's tables (path b); the rest stay dense."""
    from . import attn_tables
    from .attn_table_meaning import prove_term

    if not attn_tables.wanted():
        return
    checks = attn_tables.analyse(plan)
    for tc in checks:
        if tc.reason is None:
            try:
                prove_term(tc, ch)
            except Decline as e:
                tc.reason = str(e)
    attn_tables.finish(checks, plan)


def _at_the_row(dom, v, srow, assume):
    """``v`` with each read of the scale at an index equal to the row's under ``assume`` (decided)
    replaced by ``srow``: a gather pad reads it at ``min(off(b) + i, L - 1)``, which is the row on
    every in-sequence position."""
    if isinstance(srow, sympy.Symbol) or not isinstance(v, sympy.Basic):
        return v
    reps = {}
    for a in v.atoms(sympy.Function):
        if a.func == srow.func and a != srow and len(a.args) == len(srow.args):
            same = sympy.And(*[sympy.Eq(x, y) for x, y in zip(a.args, srow.args)])
            if decide.valid(dom, same, assume)[0] is True:
                reps[a] = srow
    return v.xreplace(reps) if reps else v


def _is_row_scale(apps, srow_app) -> bool:
    if len(apps) != 1:
        return False
    (a,) = apps
    if isinstance(srow_app, sympy.Symbol):
        return a == srow_app
    return a.func == srow_app.func and all(sympy.expand(x - y) == 0 for x, y in zip(a.args, srow_app.args))


def _scale_apps(v, ch):
    if ch.scale_fn is None:
        return set()
    if isinstance(ch.scale_fn, sympy.Symbol):
        return {ch.scale_fn} if v.has(ch.scale_fn) else set()
    return {a for a in v.atoms(sympy.Function) if a.func == ch.scale_fn}


def _padding_rows(ch):
    n = ch.dom.length(ch.b)
    return [sympy.Ge(ch.i, n), sympy.Lt(ch.j, n)]


def _bindings(plan, hint):
    """Values of the size symbols the float part is evaluated at: the hints, and for a symbolic N
    two more values of it (its law, constant or ``1/N``, is checked over them). When other sizes are
    symbolic (``L``, ``B``), one more binding moves them all: a score constant that changes with them
    (``1 / n_b`` of a batch of one is ``1 / L``) is no constant the op could take."""
    base = {s: int(v) for s, v in hint.items()}
    Nsyms = sympy.sympify(plan.N).free_symbols
    others = [s for s in base if s not in Nsyms]
    moved = [{**base, **{s: base[s] + 1 for s in others}}] if others else []
    if not Nsyms:
        return [base, *moved]
    out = []
    (sym,) = Nsyms
    for extra in (0, 3, 11):
        b = dict(base)
        b[sym] = base.get(sym, 8) + extra
        out.append(b)
    return out + moved
