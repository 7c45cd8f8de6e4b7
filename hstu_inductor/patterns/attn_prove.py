"""Attention, stage 3 (prove): the decision by meaning (``attn_meaning``), cross-checked on random probes.

:func:`prove` reads the candidate's structure (``attn_structure``) and proves what it computes with
``attn_meaning`` (any size; :func:`prove_candidate`). Where they are cheap, the probes below run too
and must agree: a disagreement declines the candidate and logs a warning (a prover bug). With
``config.prover == "probes"`` the probes alone decide (for comparison; they decline candidates too
large to probe).

The probes: the user's own nodes are run eagerly (``prover.evaluate``: float64, CPU, sizes bound to each probe)
on random jagged probes (lengths in ``[0, N]`` including 0, 1 and N; random ``num_targets``):

* each pad subgraph must equal ``reference.jagged_to_padded`` with zero padding;
* the score chain ``S -> X`` (mask built from offsets / num_targets, scale) must equal
  ``mask * c * s * silu(alpha * S)`` for ``alpha`` and the mask parameters taken from the graph's
  constants (:func:`_fit`), then checked on every probe;
* the unpad must read row ``(b, n)`` of the dense output for every jagged row, and each row scale
  must be ``c * s_row ** power`` (``attn_rowscale.check_row_scale``).

With a symbolic ``N`` the probes span several N (:func:`probe_ns`) and the scale must be a constant
or proportional to ``1/N`` (:func:`n_law`). Sizes too large to probe raise ``TooLarge``.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import math
import random

import torch

from ..spec import AttentionSpec
from .. import _compat
from . import attn_bias, attn_intervals, attn_tables, constants
from . import attn_layout as lay
from .attn_find import (
    PadMismatch, find_operand, jagged_descriptor, looks_like_lengths, meta_val, retry_sources,
)
from .attn_meaning import assign_scale, n_law
from .attn_rowscale import check_row_scale
from .attn_structure import Plan, Subgraphs, structure
from .prover import (
    Decline, TooLarge, close, closure, concrete, evaluate, hints, make_probes, make_targets, mask_candidates, probe_values,
    reference_mask, reference_pad, scalar_constants, scalar_scale, silu, solve_binding, sym_expr, valid_at,
)

aten = torch.ops.aten


def check_leaves(leaves, allowed, what):
    """Decline unless the subgraph ``what`` reads only ``allowed`` inputs (plus constants and sizes)."""
    for leaf in leaves:
        if leaf in allowed or leaf.op == "get_attr" or isinstance(meta_val(leaf), (torch.SymInt, int)) \
                or constants.value(leaf) is not None:  # module state: ``evaluate`` reads its value
            continue
        raise Decline(f"{what} depends on input {leaf.name} (data we do not model)")


def probe_scale(scale_leaf, binding, gen, env):
    """A fresh positive ``attn_scale`` probe bound to ``scale_leaf`` in ``env`` (None if no scale).
    Exact in float32 like ``probe_values``: a scale padded by an op without float64 kernels (fbgemm's
    ``jagged_to_padded_dense``, run in float32 by the evaluator) must come back unchanged."""
    if scale_leaf is None:
        return None
    shape = [concrete(s, binding) for s in meta_val(scale_leaf).shape]
    env[scale_leaf] = (torch.rand(shape, generator=gen, dtype=torch.float32) + 0.5).to(torch.float64)
    return env[scale_leaf]


def probe_cost(nodes, binding) -> int:
    """Elements the tensors of ``nodes`` hold at the probe sizes ``binding``."""
    cost, sizes = 0, []
    for n in nodes:
        val = meta_val(n)
        if isinstance(val, torch.Tensor):
            dims = []
            for s in val.shape:
                try:
                    dims.append(concrete(s, binding))
                except Decline:  # an unbacked size (data-dependent op): counted as the largest size below
                    dims.append(None)
            sizes += [d for d in dims if d is not None]
            cost += math.prod(d for d in dims if d is not None) * (max(sizes, default=1) if None in dims else 1)
    return cost


def check_pad(gm, x, order, env0, binding, off, N, gen) -> None:
    """One probe of the pad subgraph ``order`` of operand ``x``: on random source values it must
    equal ``reference.jagged_to_padded(offsets, N)`` with zero padding."""
    shape = [concrete(s, binding) for s in meta_val(x.src).shape]
    src = probe_values(shape, gen)
    try:
        env = evaluate(gm, order, {**env0, x.src: src})
    except Decline as e:  # e.g. an index past the rows of a source read with a sentinel row
        raise PadMismatch(f"pad of {x.src.name}: {e}", x.D) from None
    got = env[x.D]
    ref = reference_pad(src, off, N)
    if got.numel() != ref.numel() or not torch.equal(got.reshape(-1).to(torch.float64), ref.reshape(-1)):
        raise PadMismatch(f"pad of {x.src.name} is not jagged_to_padded(offsets, N={N}) with zero padding", x.D)


@contextlib.contextmanager
def past_pads(plan):
    """Mark a Decline raised once ``plan``'s pads were proven (``attn_find.retry_sources``)."""
    try:
        yield
    except Decline as e:
        if plan.pads_proven and not isinstance(e, PadMismatch):
            e.past_pads = True
        raise


def check_pads(gm, pads, env0, binding, off, N, gen) -> None:
    """:func:`check_pad` for every ``(operand, pad subgraph)``; one :class:`PadMismatch` naming
    every pad that failed (q, k, v may all read a source further back)."""
    bad = []
    for x, order in pads:
        try:
            check_pad(gm, x, order, env0, binding, off, N, gen)
        except PadMismatch as e:
            bad.append(e)
    if bad:
        raise PadMismatch(str(bad[0]), *(d for e in bad for d in e.Ds))


def probe_inputs(plan, descriptor, sym_leaves, binding, lengths, rng, p) -> tuple:
    """``(env, num_targets probe)``: the probe's jagged descriptor, the size inputs ``binding``
    fixes, and random num_targets for ``lengths`` when the candidate reads them (else None)."""
    env0 = {plan.offsets: descriptor}
    for s in sym_leaves:
        try:
            env0[s] = concrete(meta_val(s), binding)
        except Decline:
            pass
    targets = None
    if plan.num_targets is not None:
        targets = torch.tensor(make_targets(lengths, rng, p), dtype=meta_val(plan.num_targets).dtype)
        env0[plan.num_targets] = targets
    return env0, targets


def descriptor_probe(plan, off, lens):
    """The probe value of the jagged descriptor input (offsets or lengths, in its dtype)."""
    return (lens if plan.lengths else off).to(meta_val(plan.offsets).dtype)


# ---------------------------------------------------------------------------------------------
# The proof


_MAX_PROBE_ELEMS = 2e7   # per probe, summed over the evaluated nodes (float64: <= 160 MB); above it the
#                          probes do not run (the value-level proof does not need them)
_PROBES = 10
_SYM_PROBES_PER_N = 5  # symbolic N: per probe value of N (edge lengths 0, 1, N-1, N and one random)


def prove(gm, S, pv) -> Plan:
    """Prove the candidate reading its jagged integer input as offsets, then as lengths (or the
    other way round when the graph sums it); the first full proof wins. Both readings are proven
    from scratch, so trying two cannot make a wrong graph pass. The reason reported is the one of
    the more plausible reading."""
    first = looks_like_lengths(jagged_descriptor(find_operand(S.args[0], "q")))
    reason = None
    def attempt(lengths, sources, intervals=True):
        plan, sub = structure(S, pv, lengths, sources, intervals)
        try:
            with past_pads(plan):
                prove_candidate(gm, plan, sub)
        except Decline as e:
            # the interval candidate is chosen by shape: an HSTU mask may read some other [L, 3]
            # integer tensor; prove it again with that tensor left in the chain
            if plan.intervals is None or isinstance(e, (PadMismatch, TooLarge)):
                raise
            try:
                return attempt(lengths, sources, False)
            except Decline:
                raise e from None
        return plan

    for lengths in (first, not first):
        try:  # a pad may read a source further back than the nearest (a table with a sentinel row)
            return retry_sources(functools.partial(attempt, lengths))
        except (Decline, lay.LayoutError) as e:
            reason = reason or e
    raise reason


def prove_candidate(gm, plan: Plan, sub: Subgraphs) -> None:
    """The decision: by meaning (``attn_meaning``, any size), cross-checked by the probes where they are
    cheap (a disagreement is a prover bug: logged, and the candidate declined); ``config.prover ==
    "probes"``: the probes alone."""
    from .. import config
    from . import attn_meaning

    if config.prover == "probes":
        return numeric_proof(gm, plan, sub)
    out = plan.out
    attn_meaning.prove(gm, plan, sub)
    _cross_check(gm, plan, sub, out)


_CHECKED = ("alpha", "params", "scale", "scale_node", "scale_factor", "scale_per_n", "out")


def _cross_check(gm, plan, sub, out) -> None:
    """Run the probes on a proven candidate when they are cheap; keep the proof's constants, take the
    probes' table-bias analysis (path b is still proven on probes). ``out``: the output before the
    proof moved it past row scales."""
    import logging

    proven = {k: getattr(plan, k) for k in _CHECKED}
    plan.out = out
    rab = (plan.rab.ratio, plan.rab.coeff, plan.rab.tables, plan.rab.table_reasons) if plan.rab is not None else None
    if plan.rab is not None:
        plan.rab.ratio = None
    try:
        numeric_proof(gm, plan, sub)
    except TooLarge:
        numeric = None
    except Decline as e:
        logging.getLogger("hstu_inductor").warning(
            "hstu_inductor: the value-level proof accepted %s but the probes decline it (%s); declined",
            plan.pv.name, e)
        raise Decline(f"value-level proof and probes disagree: {e}") from None
    else:
        numeric = {k: getattr(plan, k) for k in _CHECKED}
    for k, v in proven.items():
        setattr(plan, k, v)
    if plan.rab is not None:  # the tables are the value-level proof's (the probes would redo them)
        plan.rab.ratio, plan.rab.coeff, plan.rab.tables, plan.rab.table_reasons = rab
    if numeric is not None and not _same(proven, numeric):
        logging.getLogger("hstu_inductor").warning(
            "hstu_inductor: value-level proof and probes give different constants for %s: %s vs %s",
            plan.pv.name, proven, numeric)
        raise Decline(f"value-level proof and probes give different constants ({proven} vs {numeric})")


def _same(a: dict, b: dict) -> bool:
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, float) and isinstance(y, float):
            if not math.isclose(x, y, rel_tol=1e-6):
                return False
        elif isinstance(x, tuple) and isinstance(y, tuple):
            if tuple(int(v) if not isinstance(v, bool) else v for v in x) != \
                    tuple(int(v) if not isinstance(v, bool) else v for v in y):
                return False
        elif x != y and not (x is None and y is None):
            return False
    return True


def numeric_proof(gm, plan: Plan, sub: Subgraphs) -> None:
    """Run the candidate's pads, score chain, unpad and row scales on fresh random probes (float64,
    real tensors) and compare with the reference; on success fill in the plan's constants (alpha,
    mask parameters, scale). Raises Decline (TooLarge above ``_MAX_PROBE_ELEMS`` per probe)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # probes are small: thread start-up costs more than it saves
    try:
        with _compat.no_fake_mode(), torch.no_grad():
            _probe_all(gm, plan, sub)
    finally:
        torch.set_num_threads(threads)


def _probe_all(gm, plan: Plan, sub: Subgraphs) -> None:
    s_order, layouts, S_layout, scale_leaf = sub.s_order, sub.layouts, sub.S_layout, sub.scale_leaf
    Odense, u_order, rest_shape, fo = sub.Odense, sub.u_order, sub.rest_shape, sub.fo
    chain_scale, pre, post = sub.chain_scale, sub.pre, sub.post
    N, B = plan.N, plan.B
    q, k, v = plan.q, plan.k, plan.v
    Lq = sym_expr(meta_val(q.src).shape[0])
    base = hints(meta_val(q.src), meta_val(plan.offsets), meta_val(plan.S))
    B_static = B.free_symbols == set()
    L_static = any(sym_expr(meta_val(x.src).shape[0]).free_symbols == set() for x in (q, k, v))
    Lq = next((sym_expr(meta_val(x.src).shape[0]) for x in (q, k, v)
               if sym_expr(meta_val(x.src).shape[0]).free_symbols == set()), Lq)
    pads = []
    for x in (q, k, v):
        if any(x.D is y.D for y, _ in pads):  # one padded tensor sliced into several operands
            continue
        order, leaves = closure([x.D], {x.src})
        check_leaves(leaves, {x.src, plan.offsets}, f"pad of {x.src.name}")
        pads.append((x, order))
    check_leaves(sub.u_leaves, {Odense, plan.offsets}, "unpad")
    sides = {m.node: closure([m.factor], set())[0] for m in [*pre.values(), *post.values()]}
    post_ok = len(post)  # row scales after the unpad that passed every probe so far
    sym_leaves = [n for n in gm.graph.nodes if (isinstance(meta_val(n), torch.SymInt)
                  and (n.op == "placeholder" or n.target is aten.sym_size.int))
                  or (n.op == "placeholder" and type(meta_val(n)) is int)]  # an int input: a size specialised

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
    if plan.alpha != 1.0:  # cross-checking a value-level proof: its alpha may be computed by nodes
        alphas = [plan.alpha] + [a for a in alphas if a != plan.alpha]
    # absolute values: a window spelled ``ones.tril().triu(-w)`` carries it as the diagonal -w
    mask_ints = {abs(i) for i in ints if 0 < abs(i) <= max(Nv for Nv, _ in probes) + 1}
    chosen = None
    consts = []  # symbolic N: (N, fitted score constant, binding) per probe
    tables, tgen = None, torch.Generator().manual_seed(777)  # bias terms on their way to path (b)
    for p, (Np, lengths) in enumerate(probes):
        Bp, Lp = len(lengths), sum(lengths)
        pairs = [(sym_expr(meta_val(plan.offsets).shape[0]), Bp + (0 if plan.lengths else 1))]
        pairs += [(sym_expr(meta_val(x.src).shape[0]), Lp) for x in (q, k, v)]
        if scale_leaf is not None and meta_val(scale_leaf).dim() == 1 and meta_val(scale_leaf).numel() != 1:
            pairs.append((sym_expr(meta_val(scale_leaf).shape[0]), Lp))
        if plan.num_targets is not None:
            pairs.append((sym_expr(meta_val(plan.num_targets).shape[0]), Bp))
        if sym_n:
            shared = N.free_symbols & set().union(*(sym_expr(e).free_symbols for e, _ in pairs))
            if shared:
                raise Decline(f"symbolic N={N} shares a symbol with the sizes of the jagged inputs "
                              f"(the probes cannot vary N alone)")
            pairs.append((N, Np))
        pairs += attn_intervals.binding_pairs(plan.intervals, Lp)
        binding = solve_binding(pairs, base)
        off = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=meta_val(plan.offsets).dtype)
        lens = torch.tensor(lengths, dtype=torch.int64)
        env0, targets = probe_inputs(plan, descriptor_probe(plan, off, lens), sym_leaves, binding, lengths, rng, p)
        cost = probe_cost([*s_order, *u_order, *(n for _, order in pads for n in order)], binding)
        if cost > _MAX_PROBE_ELEMS:
            what = f"at N={Np} (a constant of the score subgraph)" if sym_n else "at these static sizes"
            raise TooLarge(f"too large to prove numerically {what} ({cost:.2g} elements per probe)")

        # pads
        check_pads(gm, pads, env0, binding, off, Np, gen)
        plan.pads_proven = True

        # scores -> X
        Sc = lay.concretize(S_layout, binding)
        Sshape = [concrete(s, binding) for s in meta_val(plan.S).shape]
        crdS = lay.coords(Sc, Sshape)
        in_seq_S = (crdS["i"] < lens[crdS["b"]]) & (crdS["j"] < lens[crdS["b"]])
        S_probe = probe_values(Sshape, gen) * in_seq_S
        scale_probe = probe_scale(scale_leaf, binding, gen, env0)
        env = dict(env0)
        env[plan.S] = S_probe
        attn_bias.bind(plan.rab, env, binding, gen)
        attn_intervals.bind(plan.intervals, env, binding, gen, Np)
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
        if plan.rab is not None:  # silu(a * S + b * R) == silu(a * (S + b/a * R)): fold the bias into S
            R_at = attn_bias.at(plan.rab, env, binding, crd, X.shape)
            if plan.rab.ratio is None:
                attn_bias.fit_ratio(plan.rab, fit_alpha, X, S_at, R_at, s_at, (X != 0) & in_seq, alphas, floats)
            S_at = S_at + plan.rab.ratio * R_at
        iv_mask = None if plan.intervals is None else \
            attn_intervals.mask_at(plan.intervals, off, Np, crd, plan.head_modes, X.shape)
        if chosen is None and iv_mask is not None:
            if not torch.equal(iv_mask & in_seq, (X != 0) & in_seq):
                raise Decline(f"mask read from the interval tensor {plan.intervals.node.name} is not "
                              f"[0, x0) | [x1, x2) per row (probe {p})")
            alpha, c0 = fit_alpha(X, S_at, s_at, (X != 0) & in_seq, alphas)
            chosen = alpha, c0, [(0, AttentionSpec())]
        if chosen is None:  # every parameter set that fits probe 0; the later probes tell them apart
            alpha, c0, fits = _fit(X, S_at, s_at, in_seq, bb, ii, jj, lens, targets, Np, alphas, mask_ints,
                                   plan.num_targets is not None)
            chosen = alpha, c0, list(enumerate(fits))
        alpha, c0, fits = chosen
        if sym_n:  # the constant may scale with N (1/N): fitted per probe, its N-law checked below
            try:
                _, c0 = fit_alpha(X, S_at, s_at, (X != 0) & in_seq, [alpha])
            except Decline:
                raise Decline(f"scores at N={Np} are not c * silu(alpha * qk) with the alpha={alpha:g} found at "
                              f"N={probes[0][0]} (alpha depends on N?)") from None
            consts.append((Np, c0, binding))
        def holds(reading):
            params = reading[1]
            mref = iv_mask if iv_mask is not None else \
                reference_mask(lens, Np, targets, params)[bb, ii, jj].expand(X.shape)
            expect = torch.where(mref, c0 * s_at * silu(alpha * S_at), torch.zeros((), dtype=torch.float64))
            return close(torch.where(in_seq, X, 0.0), torch.where(in_seq, expect, 0.0))

        fits[:] = [f for f in fits if holds(f)]
        if not fits:
            raise Decline(f"scores differ from mask * scale * silu(alpha * qk) on probe {p} (lengths {lengths})")
        if plan.rab is not None:  # which bias terms are the table bias (else they stay dense rab terms)
            tables = attn_tables.analyse(plan) if tables is None else tables
            attn_tables.probe(tables, gm, plan, env0, binding, off, lens, Np, crd, X.shape, in_seq, tgen)
        if plan.dense and bool(((X != 0) & (ii >= n_b) & (jj < n_b)).any()):
            raise Decline(f"attention output is used padded (no unpad) but its padding rows are not zero "
                          f"(probe {p})")

        # unpad (none in dense mode)
        Oshape = [concrete(s, binding) for s in meta_val(Odense).shape]
        O_probe = probe_values(Oshape, gen)
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
                check_row_scale(gm, m, sides[m.node], env0, binding, scale_probe, off, lens, Np, p, plan.dense)
            except Decline:
                if m.node not in post:
                    raise
                post_ok = list(post).index(m.node)  # leave it (and what follows) to the user

    alpha, c0, fits = chosen
    attn_tables.finish(tables or [], plan)
    params = fits[0][1]
    plan.alpha = float(alpha * q.factor * k.factor)
    if plan.rab is not None:
        plan.rab.coeff = float(plan.rab.ratio * alpha)  # the op adds rab to alpha * qk: b * R
    plan.params = params
    kept = [*pre.values(), *list(post.values())[:post_ok]]
    if post_ok:
        plan.out = kept[-1].node
    if not chain_scale and not any(m.power for m in kept):
        scale_leaf = None
    if sym_n:
        assign_scale(plan, scale_leaf, *n_law(consts, v.factor * fo * math.prod(m.c for m in kept)))
    else:
        assign_scale(plan, scale_leaf, c0 * v.factor * fo * math.prod(m.c for m in kept), None)


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
    """``(alpha, c0, [mask params, ...])`` with X == mask * c0 * s * silu(alpha S) on in-sequence
    positions: every candidate parameter set that fits this probe, in candidate order."""
    obs = (X != 0) & in_seq
    # mask parameters: cheap filter on a sample, then the full reference mask
    flat_idx, (b_s, i_s, j_s) = sample_in_sequence(X, in_seq, bb, ii, jj)
    o_s = obs.reshape(-1)[flat_idx]
    fits = []
    for cand in mask_candidates(mask_ints, N, has_targets):
        if torch.equal(valid_at(b_s, i_s, j_s, lens, targets, cand), o_s):
            full = reference_mask(lens, N, targets, cand)[bb, ii, jj].expand(X.shape)
            if torch.equal(full & in_seq, obs):
                fits.append(cand)
    if not fits:
        causal_like = bool((obs & (jj > ii).expand(X.shape)).any())
        what = "has entries above the diagonal (not causal)" if causal_like else "matches no HSTU mask"
        raise Decline(f"attention mask {what} for any (max_attn_len, contextual_seq_len, "
                      f"min_full_attn_seq_len) taken from the graph's constants")
    a, c0 = fit_alpha(X, S_at, s_at, obs, alphas)
    return a, c0, fits


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
