"""Attention, stage 3 (prove) by meaning: what the structurally checked pieces compute, at any size.

The pieces of a candidate (``attn_structure``: pads, the score chain ``S -> X``, the unpad, row
scales) are read element by element with the value interpreter (``core.elements``): one element at
symbolic coordinates stands for all of them, so the proof costs the same at ``B=128, N=4096`` as at
``B=2, N=4``, static or dynamic, whatever the mask constants.

* **Pads** (``attn_meaning_pads``). Element ``(b, p, f)`` of each pad ``D`` (``[B, N, *F]`` viewed
  as ``D.shape``) must be ``src(off(b) + p, f)`` where ``p < n_b`` and 0 elsewhere: decided by
  ``core.decide`` (z3).
* **Score chain** (``attn_meaning_chain``: its positions and inputs; ``attn_meaning_cases``: the
  proof by cases; ``attn_meaning_float``: the float part on samples; ``attn_meaning_mask``: the
  mask). The chain's nodes that read the scores are float data; everything else they read
  (the mask, a padded per-row scale, a bias) is an element expression of the score position. Those
  expressions are split into cases (``core.semantics.cases``); per combination of cases the float part
  is evaluated on random scores (``float64``, the user's own ops) and must be 0 or
  ``c * s_i * silu(alpha * S + beta * R)`` with one ``(alpha, beta, c)`` for all combinations. The
  mask is then the disjunction of the combinations' conditions, and it must *be* HSTU's
  ``valid(i, j)`` (``core.semantics.hstu_valid``) for parameters read off its integer constants:
  decided for every ``i, j < n <= N`` and ``0 <= t <= n``, not sampled.
* **Unpad** (``attn_meaning_pads``). Row ``off(b) + p`` of the output must be element ``(b, p)`` of
  the dense output.
* **Row scales** (``attn_meaning_rows``). Each factor must be ``c * s_row ** power`` on the rows the
  unpad reads.

A symbolic ``N`` is a symbol here like any size; the chain's float constants are evaluated at several
values of it (the scale must be a constant or ``k / N``: ``attn_prove.n_law``).

This module holds the whole proof (``prove``) and the op's scale from its result (``n_law``,
``assign_scale``); ``attn_meaning_domain`` the domain and leaves every part reads. It re-exports
what other modules read through it (``attn_packed``, ``attn_prove``).
"""
from __future__ import annotations

import contextlib
import math

import sympy
import torch

from .attn_meaning_cases import prove_chain
from .attn_meaning_chain import Chain, _mask_symbols
from .attn_meaning_domain import _domain
from .attn_meaning_mask import _fit_mask
from .attn_meaning_pads import prove_pad, prove_pads, prove_unpad
from .attn_meaning_rows import prove_row_scale
from .core.semantics import hstu_valid
from .core.values import time_budget
from .prover import Decline

# what other modules read through this one: ``attn_prove`` (``prove``, ``assign_scale``, ``n_law``),
# ``attn_packed`` (the score chain's machinery: ``Chain``, ``prove_chain``, ``_domain``,
# ``_mask_symbols``, ``hstu_valid``), and one part of the proof at a time when debugging
__all__ = ["prove", "prove_chain", "prove_pads", "prove_pad", "prove_unpad", "prove_row_scale", "n_law",
           "assign_scale", "Chain", "hstu_valid", "_domain", "_mask_symbols", "_fit_mask"]


# ---------------------------------------------------------------------------------------------
# The whole proof


@contextlib.contextmanager
def _compat_scope():
    """Real tensors (the float part runs the user's ops on CPU samples), no autograd."""
    from .. import _compat

    with _compat.no_fake_mode(), torch.no_grad():
        yield


def prove(gm, plan, sub) -> None:
    """Prove the candidate by meaning and fill in the plan's constants (alpha, mask parameters,
    scale); raises Decline (``PadMismatch`` for a pad, so that its next source is tried)."""
    from .. import config

    with _compat_scope(), time_budget(config.proof_budget_s):
        _prove(gm, plan, sub)


def _prove(gm, plan, sub) -> None:
    prove_pads(plan)
    plan.pads_proven = True
    consts, _ = prove_chain(gm, plan, sub)
    if not plan.dense:
        prove_unpad(plan, sub)
    pre, post = sub.pre, sub.post
    for m in pre.values():
        prove_row_scale(plan, sub, m, sub.scale_leaf)
    post_ok = 0
    for m in post.values():  # optional: a row scale after the unpad that is not proven stays the user's
        try:
            prove_row_scale(plan, sub, m, sub.scale_leaf)
        except Decline:
            break
        post_ok += 1
    kept = [*pre.values(), *list(post.values())[:post_ok]]
    if post_ok:
        plan.out = kept[-1].node
    scale_leaf = sub.scale_leaf
    if not sub.chain_scale and not any(m.power for m in kept):
        scale_leaf = None
    rest = plan.v.factor * sub.fo * math.prod(m.c for m in kept)
    if not (isinstance(plan.N, int) or sympy.sympify(plan.N).is_Integer):
        (sym,) = sympy.sympify(plan.N).free_symbols
        law = [(int(sympy.sympify(plan.N).xreplace({sym: b[sym]})), c, b) for b, c, _ in consts]
        assign_scale(plan, scale_leaf, *n_law(law, rest))
    else:
        if not all(math.isclose(c, consts[0][1], rel_tol=1e-9) for _, c, _ in consts):
            raise Decline("attention scale changes with the sizes besides N (e.g. 1/L): not one constant "
                          f"({', '.join(f'{c:.6g}' for _, c, _ in consts)})")
        assign_scale(plan, scale_leaf, consts[0][1] * float(sympy.sympify(rest)), None)


def n_law(consts, rest) -> tuple:
    """``(k, per_n)``: the total scale (score constant per probe times ``rest``, the value/output
    factors, which may hold N) is the constant ``k`` at every probe N, or ``k / N`` at every one.
    Probes span at least two N values, so the two laws cannot both hold."""
    totals = []
    for Nv, c, binding in consts:
        r = sympy.sympify(rest).subs(binding)
        if not r.is_number:
            raise Decline(f"output scale {rest} depends on sizes other than N")
        totals.append((Nv, c * float(r)))
    if len({Nv for Nv, _ in totals}) < 2:
        raise Decline("symbolic N was probed at a single value")
    N0, t0 = totals[0]
    if all(math.isclose(t, t0, rel_tol=1e-9) for _, t in totals):
        return float(t0), False
    if all(math.isclose(t * Nv, t0 * N0, rel_tol=1e-9) for Nv, t in totals):
        return float(t0 * N0), True
    raise Decline("attention scale is neither a constant nor proportional to 1/N across probe values of N "
                  f"({', '.join(f'N={Nv}: {t:.6g}' for Nv, t in totals[::max(1, len(totals) // 4)])})")


def assign_scale(plan, scale_leaf, factor, per_n) -> None:
    """The op's scale from the proven total ``factor``: times the scale input when there is one, else a
    constant, or None for the op's default ``1/N``. ``per_n``: symbolic N (None: static), whether the
    factor is per ``1/N`` (``n_law``)."""
    if scale_leaf is not None:
        plan.scale_node, plan.scale_factor = scale_leaf, float(factor)
        plan.scale_per_n = bool(per_n)
    elif per_n is None:
        plan.scale = None if abs(factor * int(plan.N) - 1.0) <= 1e-9 else float(factor)
    else:
        plan.scale = None if per_n and abs(factor - 1.0) <= 1e-9 else factor
        plan.scale_per_n = per_n and plan.scale is not None
