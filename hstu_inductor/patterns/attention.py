"""Rewriter "attention": find silu attention over jagged sequences, prove it, call hstu.attention.

This module only drives the stages; each lives in its own module, read in this order:

1. **Find** (``attn_find``). Anchor: a ``bmm`` ``O = X @ Y`` whose left operand ``X`` is reached
   from another ``bmm`` ``S = A @ K`` through shape-preserving ops only. ``A``, ``K`` and ``Y`` are
   followed back through layout ops, scalar multiplies and feature slices to the pads that feed
   them, and each pad to the jagged source it reads.
2. **Structure** (``attn_structure``, on the layout algebra of ``attn_layout``). Each pad is taken to
   be ``pad(src)`` viewed as its shape; the algebra says which logical element (sequence ``b``, row
   ``n``, feature digits of ``src``) sits at every position of every operand, so the contractions
   are checked exactly: ``S`` contracts q/k features within a head, its batch covers every
   sequence and head once, ``X`` and ``Y`` pair the same (sequence, head), ``O`` is read back row by
   row (row scales on the output: ``attn_rowscale``).
3. **Meaning** (``attn_prove``, on the probe tools of ``prover``). The user's own nodes are run on
   random probes: each pad must equal ``reference.jagged_to_padded``; the score chain ``S -> X``
   (mask built from offsets / num_targets) must equal ``mask * s * silu(alpha * S)`` for constants
   taken from the graph; the unpad must read rows ``(b, n)`` of every jagged row. Static sizes too
   large to probe are proven on a generalised copy of the graph (``generalize``).
4. **Rewrite** (``attn_emit``). The output node is replaced by ``hstu.attention`` on the jagged
   sources (re-laid-out as ``[L, H, D]`` with the proven head split); the dead subgraph is removed
   by DCE.

Cached (delta) attention candidates (dense queries for the last rows of each sequence, rectangular
scores) go through the same stages in ``attn_delta`` and become ``hstu.delta_attention``.
Anything unproven is reported as a near miss with the reason. Details: ``docs/patterns.md``.
"""
from __future__ import annotations

import logging
import time

import torch

from .. import config
from . import attn_delta, buffers, generalize
from . import attn_layout as lay
from .attn_emit import describe, fold_default_scale, rewrite
from .attn_find import BMM, find_score_product, is_square
from .attn_prove import prove
from .prover import Decline
from .generalize import TooLarge
from .registry import register

log = logging.getLogger("hstu_inductor")


def _prove_generalised(gm, e):
    """``generalize.prove_generalised``; when the copy that generalises a table-bias term's producers
    too (``e.table_cut``: for path (b)) does not generalise or prove, again with those terms cut
    (path (a), their producers left as they are)."""
    try:
        return generalize.prove_generalised(gm, e, prove, rewrite)
    except (generalize.GeneralizeError, Decline, lay.LayoutError) as first:
        if not getattr(e, "table_cut", None):
            raise
        log.debug("hstu_inductor: generalised proof with the table bias's producers failed (%s); "
                  "again with the bias cut out", first)
        e.sizes.cut.update(e.table_cut)
        e.table_cut = None
        return generalize.prove_generalised(gm, e, prove, rewrite)


@register("attention")
def rewrite_attention(gm: torch.fx.GraphModule, report) -> None:
    """Replace every proven jagged silu attention in ``gm`` by ``hstu.attention`` (in place)."""
    buffers.make_explicit(gm)  # new_zeros / zeros_like / empty().zero_() ... -> zeros(dtype=...)
    consumed = set()
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not BMM or node in consumed or not node.users:
            continue
        try:
            S = find_score_product(node, square=False)
            delta = S is not None and attn_delta.is_candidate(S, node)
            if S is not None and not delta and not is_square(S):
                S = None
        except Exception:  # malformed metadata: not a candidate
            S = None
        if S is None or S in consumed:
            continue
        generalised = None
        try:
            try:
                plan = attn_delta.prove_delta(gm, S, node) if delta else prove(gm, S, node)
            except TooLarge as e:  # static sizes too large to probe: prove a generalised copy
                start = time.perf_counter()
                try:
                    plan = _prove_generalised(gm, e)
                except generalize.GeneralizeError as g:
                    raise Decline(f"{e}; generalising its sizes failed: {g}") from None
                except (Decline, lay.LayoutError) as g:
                    raise Decline(f"{e}; on the generalised graph: {g}") from None
                generalised = time.perf_counter() - start
                log.info("hstu_inductor: %s proven on a generalised graph in %.2f s", node.name, generalised)
        except (Decline, lay.LayoutError) as e:
            report.near_misses.append(("attention", f"{node.name}: {e}"))
            continue
        except Exception as e:
            if config.strict:
                raise
            log.exception("hstu_inductor: attention prover failed on %s", node.name)
            report.near_misses.append(("attention", f"{node.name}: prover error {type(e).__name__}: {e}"))
            continue
        if delta:
            attn_delta.rewrite_delta(gm, plan)
        elif generalised is None:
            rewrite(gm, plan)
        else:
            fold_default_scale(gm)
        consumed |= {node, S}
        report.counts["attention"] += 1
        what = attn_delta.describe_delta(plan) if delta else describe(plan)
        if generalised is not None:
            what += f" [static sizes generalised, proof {generalised:.2f} s]"
        report.details.append(("attention", what))
