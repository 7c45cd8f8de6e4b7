"""Cached (delta) attention: prove a plain-PyTorch subgraph equals ``hstu.delta_attention``.

Semantics (``/work/shared/HSTU_SEMANTICS.md``, "Cached (delta) attention"): ``delta_q [B*D, H, Dq]``
holds the last ``D`` positions of every sequence (dense, viewed ``[B, D, H, Dq]``); ``k, v`` are the
full jagged tensors padded through ``offsets``; the output ``[B*D, H, Dv]`` equals rows
``n_b-D .. n_b-1`` of the full causal HSTU attention (targets / contextual / window, ``f = 0``).

The proof runs the stages of full attention (``attention.py``) and reuses their pieces (``attn_find``,
``attn_structure``, ``attn_prove``, ``attn_emit``); what differs:

1. **Anchor.** Same ``bmm`` pair ``O = X @ Y``, ``S = A @ K``, but ``S`` is ``[Z, D, N]`` (may be
   rectangular). A candidate is *delta* when ``A`` walks back (layout ops, scalar multiplies) to a
   tensor that is not produced by a pad (the dense ``delta_q``) while ``K`` walks back to a pad.
2. **Structure (layout algebra).** ``delta_q [R, *F]`` is taken to be ``[B, D, *F]`` with
   ``R = B * D`` (logical axes ``b, d, q*``); ``K`` and ``Y`` are pads of jagged ``k, v`` as in
   full attention. Checked exactly: ``S`` pairs delta row ``d`` of sequence ``b`` with key row ``n``
   of the same sequence and head, contracting the same q/k feature digits; ``X @ Y`` pairs the
   same (sequence, head); the output, followed forward through layout ops, is
   ``[B*D, features]`` (or ``[B, D, features]``) with features exactly (head, value feature).
   In dynamic graphs ``D`` is spelled ``R // B`` (a floor division of two symbols); the algebra
   then runs with ``R := B * delta`` for a fresh symbol ``delta`` (``attn_layout.canonical``).
3. **Meaning (numeric probes, float64).** Pads of ``k``/``v`` must equal
   ``reference.jagged_to_padded``; the score chain ``S -> X`` must equal
   ``mask_delta(b, d, j) * c * s * silu(alpha * S)`` where ``mask_delta`` is rows
   ``n_b - D + d`` of ``reference.hstu_mask`` (``query_positions``), with candidate constants
   taken from the graph. Probes use random lengths in ``[D, N]`` (including ``D`` and ``N``) and
   random ``num_targets``; a chain written for other rows (e.g. the first ``D``) fails here.
4. **Inference only.** ``hstu.delta_attention`` has no autograd: a proven candidate whose inputs
   may need gradients (grad mode on while compiling, or inputs marked ``requires_grad``) is
   declined with "delta attention op is inference-only".
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import random

import sympy
import torch
from torch.utils._sympy.functions import FloorDiv

from ..reference import hstu_mask
from .. import _compat
from . import attn_layout as lay
from .attn_emit import describe_scale, emit_call, emit_scale, regroup, replace_output
from .attn_find import (
    SCALAR_MUL, Operand, find_operand, is_float, is_int_tensor, is_pad, is_square, meta_val, op_name,
    retry_sources, size_hint, walk_forward, walk_operand, walk_sliced,
)
from .attn_prove import (
    check_leaves, check_pads, fit_alpha, past_pads, probe_cost, probe_inputs, probe_scale, sample_in_sequence,
)
from .attn_structure import (
    Plan, check_tiles, dim_key, feature_axes, is_dead, mode_key, score_modes, score_subgraph, side_inputs,
    through_layout, value_heads, value_modes,
)
from .prover import (
    Decline, close, closure, compose_lengths, concrete, evaluate, hints, mask_candidates, probe_values,
    scalar_constants, scalar_scale, silu, solve_binding, sym_expr, valid_at,
)

aten = torch.ops.aten

_PROBES = 10
_MAX_PROBE_ELEMS = 6e7


@dataclasses.dataclass
class DeltaPlan(Plan):
    """A cached-attention candidate: a :class:`Plan` with the delta rows per sequence."""
    Dd: object = None  # sympy: an integer, or a fresh symbol for ``R // B`` in dynamic graphs


# ---------------------------------------------------------------------------------------------
# Candidate


def is_candidate(S, pv) -> bool:
    """``S``'s left operand is a dense (unpadded) tensor, its right operand and ``pv``'s right
    operand are pads: the shape of cached attention."""
    qD, _, _ = walk_sliced(S.args[0])
    kD, _, _ = walk_sliced(S.args[1])
    vD, _, _ = walk_sliced(pv.args[1])
    # a square score product with padded queries is full attention; a rectangular one may read
    # queries gathered from a padded or jagged tensor
    return is_float(qD) and is_pad(kD) and is_pad(vD) and (not is_pad(qD) or not is_square(S))


def _delta_rows(B, R):
    """``(D, canon)``: the delta rows per sequence as a sympy expression and the size rewrite that
    makes ``R == B * D`` visible to the layout algebra (None when not needed)."""
    d = lay._divides(B, R)
    if d is not None:
        return d, None
    if not isinstance(R, sympy.Symbol):
        raise Decline(f"delta query rows {R} are not a multiple of the batch size {B}")
    delta = sympy.Symbol("hstu_delta_rows", positive=True, integer=True)
    def is_b(d):  # B itself, or max(1, B) (``max(B, 1)`` guards a division by zero in user code)
        if sympy.expand(d - B) == 0:
            return True
        return type(d).__name__ == "Max" and len(d.args) == 2 and any(a == 1 for a in d.args) and any(
            sympy.expand(a - B) == 0 for a in d.args)

    def divides_by_b(x):
        return isinstance(x, FloorDiv) and x.args[0] == R and is_b(x.args[1])

    def canon(e):
        if not e.has(R):
            return e
        e = e.replace(divides_by_b, lambda x: delta)
        return sympy.expand(e.xreplace({R: B * delta}))

    return delta, canon


# ---------------------------------------------------------------------------------------------
# Proof


def prove_delta(gm, S, pv):
    """Structural and numeric proof of a cached-attention candidate; returns the plan or raises."""
    return retry_sources(functools.partial(_prove_delta, gm, S, pv))


def _prove_delta(gm, S, pv, sources):
    qsrc, qops, qfactor = walk_operand(S.args[0])
    k = find_operand(S.args[1], "q", sources)
    order, leaves = closure([k.D], {k.src})
    ints = [x for x in leaves if is_int_tensor(x)]
    if len(ints) != 1 or meta_val(ints[0]).dim() != 1:
        raise Decline(f"pad of {k.src.name} does not depend on exactly one 1-D integer input (offsets)")
    offsets = ints[0]
    B0 = sym_expr(meta_val(offsets).shape[0]) - 1
    R0 = sym_expr(meta_val(qsrc).shape[0])
    Dd, canon = _delta_rows(B0, R0)
    with lay.canonical(canon) if canon is not None else contextlib.nullcontext():
        return _prove(gm, S, pv, qsrc, qops, qfactor, k, offsets, Dd, R0, sources)


def _prove(gm, S, pv, qsrc, qops, qfactor, k, offsets, Dd, R0, sources):
    v = find_operand(pv.args[1], "v", sources)
    q = Operand(S.args[0], qsrc, qops, qfactor, qsrc, "q")
    # features as one flat logical axis per source: delta_q [R, H, Dq] and k [L, H*Dq] line up
    fq, axq = _flat_features(qsrc, "q")
    fk, _ = _flat_features(k.src, "q")
    fv, axv = _flat_features(v.src, "v")
    if fq != fk:
        raise Decline(f"delta q ({fq[0]}) and k ({fk[0]}) feature sizes differ")
    dt = {meta_val(x.src).dtype for x in (q, k, v)}
    if len(dt) != 1:
        raise Decline(f"delta q, k, v dtypes differ: {dt}")
    if size_hint(meta_val(k.src).shape[0]) != size_hint(meta_val(v.src).shape[0]):
        raise Decline("k and v have different numbers of jagged rows")
    B = lay.to_expr(meta_val(offsets).shape[0]) - 1

    numel = sympy.Integer(1)
    for s in meta_val(k.D).shape:
        numel = numel * sym_expr(s)
    Nexpr = sympy.cancel(numel / ((sym_expr(meta_val(offsets).shape[0]) - 1) * math.prod(fk)))
    if Nexpr.free_symbols:  # full attention proves symbolic N; the delta probes are written for a constant N
        raise Decline(f"delta attention with a symbolic max length N={Nexpr} is not supported (N must be "
                      f"static here)")
    if not Nexpr.is_Integer or int(Nexpr) <= 0:
        raise Decline(f"padded size of {k.src.name} is not B * N * features for a constant N ({Nexpr})")
    N = int(Nexpr)
    if Dd.is_Integer and not 1 <= int(Dd) <= N:
        raise Decline(f"delta rows per sequence D={Dd} not in [1, N={N}]")

    q.layout = through_layout(q.ops, lay.view(lay.source_layout([B, Dd, *fq], ["b", "d", *axq]),
                                                 meta_val(qsrc).shape))
    for x, f, axes in ((k, fk, axq), (v, fv, axv)):
        base = lay.source_layout([B, N, *f], ["b", "n", *axes])
        x.layout = through_layout(x.ops, lay.view(base, meta_val(x.D).shape))

    QL, KL = q.layout, k.layout
    if len(QL) != 3 or len(KL) != 3:
        raise Decline("score product operands are not 3-D")
    nkey = dim_key(((sympy.Integer(N), "n", sympy.Integer(1)),))
    dkey = dim_key(((Dd, "d", sympy.Integer(1)),))
    if dim_key(QL[1]) != dkey:
        raise Decline("score product rows are not the delta rows of delta_q viewed [B, D, ...]")
    if dim_key(KL[2]) != nkey:
        raise Decline("score product does not pair delta rows with key rows of the padded sequences")
    if dim_key(QL[2]) != dim_key(KL[1]) or not lay.normalize_dim(QL[2]):
        raise Decline("score product does not contract the same q/k feature digits")
    if dim_key(QL[0]) != dim_key(KL[0]):
        raise Decline("score product batches delta q and k differently")
    Z, head_modes, c_modes = score_modes(QL, KL, mode_key((B, "b", sympy.Integer(1))), fq, axq)

    plan = DeltaPlan(pv=pv, S=S, out=None, q=q, k=k, v=v, offsets=offsets, num_targets=None, N=N, Dd=Dd)
    Y = v.layout
    plan.head_modes, plan.c_modes = head_modes, c_modes
    plan.e_modes = value_modes(Y, nkey)
    plan.Y, plan.Z, plan.B = Y, Z, B

    # ---- score chain
    Xnode = pv.args[0]
    s_order, s_leaves, sderived, layouts, S_layout = score_subgraph(plan, Xnode, rows=Dd)
    XL = layouts[Xnode]
    if len(XL) != 3:
        raise Decline("value product left operand is not 3-D")
    if dim_key(XL[1]) != dim_key(((Dd, "i", sympy.Integer(1)),)) or \
            dim_key(XL[2]) != dim_key(((sympy.Integer(N), "j", sympy.Integer(1)),)):
        raise Decline("value product does not contract the scores over key rows")
    plan.v_head_modes = value_heads(plan, XL)
    check_tiles(plan.v_head_modes + plan.e_modes, fv, axv, "value product")

    # side inputs of the score chain: num_targets [B] and attn_scale (scalar or per delta row [B*D])
    nt, scale_leaf = side_inputs(s_leaves, plan, size_hint(meta_val(offsets).shape[0]) - 1,
                                 size_hint(meta_val(qsrc).shape[0]))
    plan.num_targets = nt

    # ---- output: pv forward through layout ops / scalar multiplies to [B*D, features]
    out, chain, fo, out_rest, _ = _output(plan, pv, XL, Y, B, Dd)
    plan.out, plan.out_rest = out, out_rest

    # ---- extra users
    region = set(q.ops)
    for x in (k, v):
        order, _ = closure([x.D], {x.src})
        region |= {n for n in order if is_float(n)}
        region |= set(x.ops)
    region |= set(sderived)
    region |= {pv, *chain}
    region.discard(out)
    for n in region:
        for u in n.users:
            if u not in region and u is not out and u.target is not aten.sym_size.int and not is_dead(u):
                raise Decline(f"intermediate {n.name} has a user outside the attention ({u.name}); "
                              f"rewriting would keep it alive")

    # ---- numeric proof
    with past_pads(plan), _compat.no_fake_mode(), torch.no_grad():
        _numeric_proof(gm, plan, s_order, layouts, S_layout, scale_leaf, qsrc, R0, fo)

    # ---- inference only
    if _may_need_grad([qsrc, k.src, v.src, scale_leaf]):
        raise DeclinePastPads("delta attention op is inference-only (hstu.delta_attention has no autograd) and "
                      "gradients may be needed here (grad mode on while compiling, or inputs require grad); "
                      "run under torch.no_grad()/inference_mode to rewrite it")
    return plan


class DeclinePastPads(Decline):
    """A candidate declined after its whole proof (pads included) went through."""
    past_pads = True


def _flat_features(src, prefix):
    sizes, _ = feature_axes(src, prefix)
    return [math.prod(sizes)], [f"{prefix}0"]


def _output(plan, pv, XL, Y, B, Dd):
    """Choose the last node of pv's single-user layout/scalar chain laid out as ``[B*D, feats]``
    (or ``[B, D, feats]`` with static ``D``). Returns ``(node, chain up to it, factor, rest modes, lead)``."""
    layout = (XL[0], ((Dd, "i", sympy.Integer(1)),), Y[2])
    bi = tuple(mode_key(m) for m in lay.normalize_dim(((B, "b", sympy.Integer(1)), (Dd, "i", sympy.Integer(1)))))
    bkey = (mode_key((B, "b", sympy.Integer(1))),)
    ikey = dim_key(((Dd, "i", sympy.Integer(1)),))
    want = sorted(mode_key(m) for m in plan.head_modes + plan.e_modes)
    cur, chain, factor, best = pv, [], 1.0, None
    while True:
        first = tuple(map(mode_key, lay.normalize_dim(layout[0]))) if layout else ()
        lead = None
        if first == bi:
            lead = 1
        elif first == bkey and len(layout) >= 2 and dim_key(layout[1]) == ikey and Dd.is_Integer:
            lead = 2
        if lead is not None:
            rest = [m for d in layout[lead:] for m in lay.normalize_dim(d)]
            shape = meta_val(cur).shape
            if sorted(map(mode_key, rest)) == want and not any(m[1] is None for m in rest) and all(
                    lay.to_expr(s).is_Integer for s in shape[lead:]):
                best = (cur, list(chain), factor, rest, lead)
        _, step, _ = walk_forward(cur)
        if not step:
            break
        nxt = step[0]
        if lay.is_layout_node(nxt):
            layout = lay.apply(nxt, layout)
        else:  # scalar multiply / divide
            a0, a1 = nxt.args
            c = a1 if a0 is cur else a0
            factor = factor * c if nxt.target in SCALAR_MUL else factor / c
        chain.append(nxt)
        cur = nxt
    if best is None:
        raise Decline("delta attention output is not laid out as [B*D, heads, value features] "
                      "(or [B, D, ...]) after the value product")
    node, chain, factor, rest, lead = best
    return node, chain, factor, rest, lead


def _may_need_grad(nodes) -> bool:
    """Whether the delta attention's inputs may need gradients. Nodes carrying
    ``meta["requires_grad"]`` or a grad-requiring value decide it; otherwise, under a
    ``torch.compile`` trace (the retrace drops ``requires_grad``) grad mode decides, and outside
    one (``torch.export`` programs, packaged for inference by AOTInductor) it does not."""
    known = []
    for n in nodes:
        if n is None:
            continue
        if "requires_grad" in n.meta:
            known.append(bool(n.meta["requires_grad"]))
            continue
        val = meta_val(n)
        if isinstance(val, torch.Tensor) and val.requires_grad:
            return True
        known.append(None)
    if any(x is True for x in known):
        return True
    if known and all(x is False for x in known):
        return False
    if torch._guards.TracingContext.try_get() is None:
        return False
    return torch.is_grad_enabled()


# ---------------------------------------------------------------------------------------------
# Numeric proof


def delta_probes(N, B, Dd, L, count, seed=0):
    """``(D, lengths)`` probes: lengths in ``[D, N]`` (including D, D+1, N and N-1), ``B``/``D``/``L``
    fixed where the graph is static."""
    rng = random.Random(seed)
    probes = []
    for p in range(count):
        b, d = _probe_sizes(N, B, Dd, L, [3, 2, 4, 3][p % 4], min(N, [2, 1, 3, N][p % 4]))
        edges = [[N, d, d + 1], [d, N, N - 1], [d + 1, N, d], [N, N, d]][p % 4] if p < 8 else []
        edges = [min(max(e, d), N) for e in edges]
        if L is None:
            lengths = [rng.randint(d, N) for _ in range(b)]
            for slot, e in enumerate(edges[:b]):
                lengths[(slot + p) % b] = e
        else:
            extra = L - b * d
            if extra < 0 or extra > b * (N - d):
                raise Decline(f"static sizes L={L}, B={b}, D={d}, N={N} admit no lengths in [D, N]")
            lengths = [d + r for r in compose_lengths(extra, b, N - d, rng, [e - d for e in edges])]
        probes.append((d, lengths))
    return probes


def _probe_sizes(N, B, Dd, L, b_pref, d_pref):
    """``(B, D)`` for a probe: the graph's static values, else the preferred ones, else the first
    pair (``B >= 2``) that admits lengths in ``[D, N]`` summing to a static ``L``."""
    def ok(b, d):
        return L is None or b * d <= L <= b * N

    b_opts = [B] if B is not None else [b_pref] + list(range(2, max(2, L or 0) + 1))
    d_opts = [Dd] if Dd is not None else [d_pref] + list(range(1, N + 1))
    for b in b_opts:
        for d in d_opts:
            if ok(b, d):
                return b, d
    raise Decline(f"static sizes (L={L}, B={B}, D={Dd}, N={N}) admit no sequence lengths in [D, N]")


def _numeric_proof(gm, plan, s_order, layouts, S_layout, scale_leaf, qsrc, R0, fo):
    N = plan.N
    k, v = plan.k, plan.v
    Bexpr = sym_expr(meta_val(plan.offsets).shape[0]) - 1
    Dd = plan.Dd
    base = hints(meta_val(qsrc), meta_val(k.src), meta_val(plan.offsets), meta_val(plan.S))
    L0 = sym_expr(meta_val(k.src).shape[0])
    pads = []
    for x in (k, v):
        order, leaves = closure([x.D], {x.src})
        check_leaves(leaves, {x.src, plan.offsets}, f"pad of {x.src.name}")
        pads.append((x, order))
    sym_leaves = [n for n in gm.graph.nodes if isinstance(meta_val(n), torch.SymInt)
                  and (n.op == "placeholder" or n.target is aten.sym_size.int)]

    probes = delta_probes(N, int(Bexpr) if Bexpr.is_Integer else None, int(Dd) if Dd.is_Integer else None,
                          int(L0) if L0.is_Integer else None, _PROBES, seed=1234)
    rng = random.Random(99)
    gen = torch.Generator().manual_seed(4321)
    floats, ints = scalar_constants(s_order)
    alphas = sorted({1.0} | {c for c in floats if c != 0} | {1.0 / c for c in floats if c != 0})
    mask_ints = {i for i in ints if 0 < i <= N + 1}
    chosen = None
    for p, (Dp, lengths) in enumerate(probes):
        Bp, Lp = len(lengths), sum(lengths)
        pairs = [(sym_expr(meta_val(plan.offsets).shape[0]), Bp + 1), (R0, Bp * Dp)]
        pairs += [(sym_expr(meta_val(x.src).shape[0]), Lp) for x in (k, v)]
        if scale_leaf is not None and meta_val(scale_leaf).dim() == 1 and meta_val(scale_leaf).numel() != 1:
            pairs.append((sym_expr(meta_val(scale_leaf).shape[0]), Bp * Dp))
        if plan.num_targets is not None:
            pairs.append((sym_expr(meta_val(plan.num_targets).shape[0]), Bp))
        binding = solve_binding(pairs, base)
        if not Dd.is_Integer:
            binding[Dd] = Dp
        off = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=meta_val(plan.offsets).dtype)
        lens = torch.tensor(lengths, dtype=torch.int64)
        env0, targets = probe_inputs(plan, off, sym_leaves, binding, lengths, rng, p)
        cost = probe_cost([*s_order, *(n for _, order in pads for n in order)], binding)
        if cost > _MAX_PROBE_ELEMS:
            raise Decline(f"too large to prove numerically at these static sizes ({cost:.2g} elements per probe)")

        check_pads(gm, pads, env0, binding, off, N, gen)
        plan.pads_proven = True

        Sc = lay.concretize(S_layout, binding)
        Sshape = [concrete(s, binding) for s in meta_val(plan.S).shape]
        crdS = lay.coords(Sc, Sshape)
        S_probe = probe_values(Sshape, gen) * (crdS["j"] < lens[crdS["b"]])
        env = dict(env0)
        env[plan.S] = S_probe
        scale_probe = probe_scale(scale_leaf, binding, gen, env)
        env = evaluate(gm, s_order, env)
        X = env[plan.pv.args[0]]
        crd = lay.coords(lay.concretize(layouts[plan.pv.args[0]], binding), list(X.shape))
        bb, ii, jj = crd["b"], crd["i"], crd["j"]
        in_seq = (jj < lens[bb]).expand(X.shape)
        S_at = lay.gather(S_probe, Sc, crd).expand(X.shape)
        if not bool(torch.isfinite(X).all()):
            raise Decline("scores are not finite on padding positions (e.g. -inf masking)")
        s_at = scalar_scale(scale_probe)
        if s_at is None:
            s_at = scale_probe.reshape(Bp, Dp)[bb, ii].expand(X.shape)
        qpos = lens[:, None] - Dp + torch.arange(Dp)[None, :]  # [B, D]: raw positions of the delta rows
        if chosen is None:
            chosen = _fit(X, S_at, s_at, in_seq, bb, ii, jj, lens, qpos, targets, N, alphas, mask_ints,
                          plan.num_targets is not None)
        alpha, c0, params = chosen
        mref = hstu_mask(lens, N, targets, query_positions=qpos, spec=params)[bb, ii, jj].expand(X.shape)
        expect = torch.where(mref, c0 * s_at * silu(alpha * S_at), torch.zeros((), dtype=torch.float64))
        if not close(torch.where(in_seq, X, 0.0), torch.where(in_seq, expect, 0.0)):
            raise Decline(f"delta scores differ from mask(rows n_b-D..n_b-1) * scale * silu(alpha * qk) on probe "
                          f"{p} (D={Dp}, lengths {lengths})")

    alpha, c0, params = chosen
    plan.alpha = float(alpha * plan.q.factor * k.factor)
    plan.params = params
    factor = c0 * v.factor * fo
    if scale_leaf is None:
        plan.scale = None if abs(factor * N - 1.0) <= 1e-9 else float(factor)
    else:
        plan.scale_node, plan.scale_factor = scale_leaf, float(factor)


def _fit(X, S_at, s_at, in_seq, bb, ii, jj, lens, qpos, targets, N, alphas, mask_ints, has_targets):
    """``(alpha, c0, params)`` with X == mask_delta * c0 * s * silu(alpha S) on in-sequence keys."""
    obs = (X != 0) & in_seq
    flat_idx, (b_s, d_s, j_s) = sample_in_sequence(X, in_seq, bb, ii, jj)
    i_s = qpos[b_s, d_s]
    o_s = obs.reshape(-1)[flat_idx]
    params = None
    for cand in mask_candidates(mask_ints, N, has_targets):
        if not cand.causal or cand.min_full_attn_seq_len != 0:  # the op is causal with min_full_attn_seq_len = 0
            continue
        if torch.equal(valid_at(b_s, i_s, j_s, lens, targets, cand), o_s):
            full = hstu_mask(lens, N, targets, query_positions=qpos, spec=cand)[bb, ii, jj].expand(X.shape)
            if torch.equal(full & in_seq, obs):
                params = cand
                break
    if params is None:
        raise Decline("delta attention mask is not rows n_b-D..n_b-1 of a causal HSTU mask for any "
                      "(max_attn_len, contextual_seq_len) taken from the graph's constants "
                      "(queries not the last D rows of each sequence?)")
    a, c0 = fit_alpha(X, S_at, s_at, obs, alphas)
    return a, c0, params


# ---------------------------------------------------------------------------------------------
# Rewrite


def rewrite_delta(gm, plan):
    graph = gm.graph
    q, k, v = plan.q, plan.k, plan.v
    fq = [math.prod(int(s) for s in meta_val(q.src).shape[1:])]  # flat feature axes (see _prove)
    fv = [math.prod(int(s) for s in meta_val(v.src).shape[1:])]
    with graph.inserting_before(plan.out):
        q3 = regroup(graph, q.src, fq, "q", [plan.head_modes, plan.c_modes])
        k3 = regroup(graph, k.src, fq, "q", [plan.head_modes, plan.c_modes])
        v3 = regroup(graph, v.src, fv, "v", [plan.v_head_modes, plan.e_modes])
        dtype = meta_val(q.src).dtype
        scale = emit_scale(graph, plan, dtype, meta_val(q.src).device)
        spec = plan.params
        y = emit_call(graph, torch.ops.hstu.delta_attention.default,
                      [q3, k3, v3, plan.offsets, plan.N, plan.alpha, plan.num_targets, scale, spec.max_attn_len,
                       spec.contextual_seq_len], spec.added_op_kwargs())
        replace_output(graph, plan, y, dtype)


def describe_delta(plan) -> str:
    w, c = plan.params.max_attn_len, plan.params.contextual_seq_len
    parts = [f"N={plan.N}", f"D={plan.Dd}" if plan.Dd.is_Integer else "D=R//B (dynamic)", f"alpha={plan.alpha:g}",
             f"heads={lay.head_count(plan.head_modes)}"]
    parts.append(describe_scale(plan))
    if plan.num_targets is not None:
        parts.append(f"num_targets={plan.num_targets.name}")
    if w:
        parts.append(f"max_attn_len={w}")
    if c:
        parts.append(f"contextual_seq_len={c}")
    pads = sorted({op_name(x.D) for x in (plan.k, plan.v)})
    return f"delta (cached) silu attention ({', '.join(parts)}; k/v pad via {'/'.join(pads)}, dense delta_q)"
